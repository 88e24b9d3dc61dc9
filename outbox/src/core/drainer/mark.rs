//! Phase 3, mark: acked rows published, the rows' own faults counted,
//! everything else released, each statement guarded by `claimed_by`.

use std::sync::atomic::Ordering;

use tracing::{Instrument, Span};
use uuid::Uuid;

use super::publish::BatchOutcome;
use super::{Drainer, TickReport};
use crate::core::marks::Mark;
use crate::core::ports::{Broker, ClaimedRow, Clock, Entropy, OutboxStore, RowFailure};
use crate::error::DrainError;
use crate::telemetry::drainer as metric;

impl<S: OutboxStore, B: Broker, C: Clock, E: Entropy> Drainer<S, B, C, E> {
    /// Phase 3: marks the confirmed rows published and records the failures,
    /// both guarded by `claimed_by`.
    pub(super) async fn mark(
        &self,
        rows: &[ClaimedRow],
        outcome: BatchOutcome,
        report: &mut TickReport,
        span: &Span,
    ) -> Result<(), DrainError> {
        let t2 = self.clock.now();
        debug_assert_eq!(
            outcome.acked.len() + outcome.failed.len() + outcome.refused.len(),
            rows.len()
        );
        let before = *report;
        // Every statement is tried even if one fails: rows whose fate can be
        // recorded must not wait for their lease.
        let (published, failed, refused) = async {
            let published = self.mark_published(&outcome.acked, report).await;
            let failed = self.mark_failed(&outcome.failed, report).await;
            let refused = self.release_refused(&outcome, report).await;
            (published, failed, refused)
        }
        .instrument(tracing::info_span!(parent: span, "outbox.mark"))
        .await;
        let took = self.clock.now().saturating_sub(t2);
        report.mark_time += took;
        metrics::histogram!(metric::MARK_DURATION).record(took.as_secs_f64());
        span.record("outbox.published", report.published - before.published);
        span.record("outbox.nacked", report.failed - before.failed);
        span.record("outbox.mark_lost", report.mark_lost - before.mark_lost);
        span.record(
            "outbox.outcome",
            if published.is_err() || failed.is_err() {
                "mark_failed"
            } else if !outcome.refused.is_empty() {
                "partly_nacked"
            } else if !outcome.failed.is_empty() {
                "partly_failed"
            } else {
                "published"
            },
        );
        published.and(failed).and(refused)
    }

    /// Phase 3 for the rows the broker nacked: released without blame, and
    /// the tick fails (so the drainer backs off, instead of offering a full
    /// queue the same rows again at once).
    pub(super) async fn release_refused(
        &self,
        outcome: &BatchOutcome,
        report: &mut TickReport,
    ) -> Result<(), DrainError> {
        let Some(reason) = &outcome.refusal else {
            return Ok(());
        };
        let refused = &outcome.refused;
        metrics::counter!(metric::NACKED).increment(refused.len() as u64);
        report.refused += refused.len() as u64;
        // A refusal fails the drain: no claim may start while its rows are
        // handed back (found by the simulation, poison_parking seeds 14
        // and 18, once the key window moved the claims' timing).
        self.failing.store(true, Ordering::Relaxed);
        self.release_ids(refused).await;
        Err(DrainError::Refused {
            rows: refused.len(),
            reason: reason.clone(),
        })
    }

    /// Phase 3 for the confirmed rows.
    pub(super) async fn mark_published(
        &self,
        acked: &[Uuid],
        report: &mut TickReport,
    ) -> Result<(), DrainError> {
        let cfg = &self.config;
        if !acked.is_empty() {
            let published = self
                .store
                .outbox_mark_published(&cfg.replica_id, acked)
                .await?;
            let lost = acked.len() as u64 - published;
            report.published += published;
            report.mark_lost += lost;
            metrics::counter!(metric::PUBLISHED).increment(published);
            if lost > 0 {
                metrics::counter!(metric::MARK_LOST).increment(lost);
                self.marks.hit(Mark::LeaseLostBeforeMark);
                tracing::warn!(
                    replica = %cfg.replica_id,
                    lost,
                    "lease lost before mark: another drainer reclaimed rows this one published; \
                     they will be published again"
                );
            }
        }
        Ok(())
    }

    /// Phase 3 for the row-culpable failures (routing keys no broker
    /// accepts).
    pub(super) async fn mark_failed(
        &self,
        failures: &[RowFailure],
        report: &mut TickReport,
    ) -> Result<(), DrainError> {
        let cfg = &self.config;
        if !failures.is_empty() {
            let fail = self
                .store
                .outbox_mark_failed(&cfg.replica_id, failures, cfg.max_attempts)
                .await?;
            report.failed += fail.recorded;
            report.parked += fail.parked;
            metrics::counter!(metric::NACKED).increment(fail.recorded);
            if fail.parked > 0 {
                metrics::counter!(metric::PARKED).increment(fail.parked);
                self.marks.hit(Mark::RowParked);
                tracing::warn!(
                    replica = %cfg.replica_id,
                    parked = fail.parked,
                    max_attempts = cfg.max_attempts,
                    "outbox rows parked after repeated row-culpable failures; unpark to retry"
                );
            }
        }
        Ok(())
    }

    pub(super) async fn release_all(&self, rows: &[ClaimedRow]) {
        if rows.is_empty() {
            return;
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        self.release_ids(&ids).await;
    }

    /// Releases the claims on `ids` (attempts untouched); one that cannot
    /// be released is reclaimed when its lease expires.
    pub(super) async fn release_ids(&self, ids: &[Uuid]) {
        match self
            .store
            .outbox_release(&self.config.replica_id, ids)
            .await
        {
            Ok(n) => metrics::counter!(metric::RELEASED).increment(n),
            Err(e) => {
                self.marks.hit(Mark::ReleaseFailed);
                tracing::warn!(
                    replica = %self.config.replica_id,
                    rows = ids.len(),
                    error = %e,
                    "could not release claims; they will be reclaimed when the lease expires"
                );
            }
        }
    }
}
