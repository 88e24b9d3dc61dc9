//! Phase 1, the claim: one statement stamping the lease, and the rows no
//! broker would take.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::{Instrument, Span, field::Empty};
use uuid::Uuid;

use super::{Drainer, TickReport};
use crate::core::durability::GateError;
use crate::core::marks::Mark;
use crate::core::ports::{
    Broker, CLAIMS_PER_WALK, ClaimParams, ClaimPosition, ClaimedRow, Clock, Entropy, OutboxStore,
};
use crate::envelope::ROUTING_KEY_MAX_BYTES;
use crate::error::{DrainError, StoreError};
use crate::telemetry::drainer as metric;

/// A row the broker could never accept: the row's own fault, found without
/// any broker I/O (rows written by hand, bypassing `publish_tx` validation).
pub(super) fn unpublishable(row: &ClaimedRow) -> Option<String> {
    if row.routing_key.is_empty() || row.routing_key.len() > ROUTING_KEY_MAX_BYTES {
        return Some(format!(
            "routing key of {} bytes cannot be published (1..=255)",
            row.routing_key.len()
        ));
    }
    None
}

/// A gate's failure as the drain reports it.
fn drain_error(e: GateError, rows: usize) -> DrainError {
    match e {
        GateError::Store(e) => DrainError::Store(e),
        other => DrainError::NotReplicated {
            rows,
            reason: other.to_string(),
        },
    }
}

/// Rows from one claim and the clock time the claim was sent, where the
/// batch's deadline starts: the database stamped the lease no earlier, so a
/// deadline counted from here ends before the lease does (`confirm_timeout
/// < lease_ttl`), however long the claim's reply took to come back.
pub(super) struct Claimed {
    pub(super) rows: Vec<ClaimedRow>,
    pub(super) at: Duration,
    /// The batch's span, parent of its phases' spans.
    pub(super) span: Span,
}

/// Where a drain's claims walk the claim order: from the oldest row, or on
/// from the last unkeyed row of its previous full claim, at most
/// [`CLAIMS_PER_WALK`] claims from one walk. Public so that a harness
/// walks exactly as a drain does.
#[derive(Debug, Default)]
pub struct Walk {
    after: Option<ClaimPosition>,
    claims: u32,
}

impl Walk {
    /// Where the next claim starts (`None`: from the oldest row).
    pub fn after(&self) -> Option<ClaimPosition> {
        self.after
    }

    /// Takes in a claim's rows (`full`: a whole batch). The drain's next
    /// claim walks on from this one's last unkeyed row, or from the oldest
    /// row again once this walk has made [`CLAIMS_PER_WALK`] claims. A
    /// short claim ends the drain (as it always did), and the next drain
    /// starts from the oldest row.
    pub fn next(&mut self, rows: &[ClaimedRow], full: bool) {
        self.claims += 1;
        if !full || self.claims >= CLAIMS_PER_WALK {
            *self = Self::default();
            return;
        }
        let last = rows
            .iter()
            .filter(|r| r.ordering.is_none())
            .filter_map(|r| r.position)
            .max();
        self.after = self.after.max(last);
    }
}

impl<S: OutboxStore, B: Broker, C: Clock, E: Entropy> Drainer<S, B, C, E> {
    /// Phase 1: one claim of up to a batch. With `max_rows_per_sec`, the
    /// claimed rows push the next claim's earliest start back by their share
    /// of a second, counted from this claim's start (no burst allowance).
    pub(super) async fn claim(
        &self,
        report: &mut TickReport,
        expect_rows: bool,
        after: Option<ClaimPosition>,
        stopped: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<Claimed, DrainError> {
        let cfg = &self.config;
        // A claim expected to find work is the first child of its batch's
        // span; a poll gets a DEBUG span of its own, and a batch span only
        // once it found rows.
        let (batch, claim_span) = if expect_rows {
            let batch = self.batch_span();
            let claim = tracing::info_span!(parent: &batch, "outbox.claim");
            (Some(batch), claim)
        } else {
            let poll = tracing::debug_span!("outbox.poll", outbox.replica = %cfg.replica_id);
            (None, poll)
        };
        // The gate vouches only for work between two reads of the
        // primary's timeline: this one, and the wait's after the claim.
        let since = match &self.durable {
            Some(gate) => Some(gate.timeline(&*self.store).await.map_err(|e| {
                if let Some(batch) = &batch {
                    batch.record("outbox.outcome", "claim_failed");
                }
                drain_error(e, 0)
            })?),
            None => None,
        };
        let t0 = self.clock.now();
        if after.is_some() {
            self.marks.hit(Mark::ClaimResumed);
        }
        let rows = self.claim_rows(after).instrument(claim_span.clone()).await;
        let at = self.clock.now();
        metrics::histogram!(metric::CLAIM_DURATION).record(at.saturating_sub(t0).as_secs_f64());
        let rows = rows.inspect_err(|_| {
            if let Some(batch) = &batch {
                batch.record("outbox.outcome", "claim_failed");
            }
        })?;
        let span = match batch {
            Some(batch) => batch,
            None if rows.is_empty() => Span::none(),
            None => {
                let batch = self.batch_span();
                batch.follows_from(&claim_span);
                batch
            }
        };
        span.record("messaging.batch.message_count", rows.len());
        if rows.is_empty() {
            span.record("outbox.outcome", "empty");
        }
        debug_assert!(rows.len() <= cfg.batch_size as usize, "store over-claimed");
        if rows.len() >= cfg.batch_size as usize {
            self.marks.hit(Mark::ClaimFull);
        }
        if let Some(rate) = cfg.max_rows_per_sec {
            let from = Duration::from_nanos(self.next_claim_at.load(Ordering::Relaxed)).max(t0);
            let share = Duration::from_secs(rows.len() as u64) / rate.get();
            let next = (from + share).as_nanos().min(u128::from(u64::MAX)) as u64;
            self.next_claim_at.store(next, Ordering::Relaxed);
        }
        report.claimed += rows.len();
        report.keyed_claimed += rows.iter().filter(|r| r.ordering.is_some()).count();
        report.claim_time += at.saturating_sub(t0);
        let claimed = Claimed { rows, at: t0, span };
        if let Some(since) = since {
            self.replicated(&claimed, since, stopped).await?;
        }
        Ok(claimed)
    }

    /// With durable standbys (`CANOPY_MQ_DURABLE_STANDBYS`): waits until
    /// they have flushed the primary's WAL past every claimed row's commit,
    /// within the batch's Phase-2 deadline (counted from the claim, as the
    /// publishes are); else hands the batch back without blame. Stops
    /// waiting once `stopped` says so (another stage of the drain failed,
    /// or shutdown).
    async fn replicated(
        &self,
        claimed: &Claimed,
        since: u32,
        stopped: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<(), DrainError> {
        let Some(gate) = &self.durable else {
            return Ok(());
        };
        if claimed.rows.is_empty() {
            return Ok(());
        }
        let until = claimed.at + self.config.confirm_timeout;
        let span = tracing::info_span!(parent: &claimed.span, "outbox.replicated");
        let waited = gate
            .wait(&*self.store, &*self.clock, since, Some(until), stopped)
            .instrument(span)
            .await;
        let Err(e) = waited else {
            return Ok(());
        };
        self.marks.hit(Mark::NotReplicated);
        claimed.span.record("outbox.outcome", "not_replicated");
        self.release_all(&claimed.rows).await;
        Err(drain_error(e, claimed.rows.len()))
    }

    /// The claim's statements: the next window of key heads, then the
    /// claim of unkeyed rows (past `place`, if given) and of those heads;
    /// moves the key cursor.
    pub(super) async fn claim_rows(
        &self,
        place: Option<ClaimPosition>,
    ) -> Result<Vec<ClaimedRow>, StoreError> {
        let cfg = &self.config;
        let after = self.key_cursor.lock().expect("key cursor").clone();
        let mut window = self
            .store
            .outbox_key_window(&after, cfg.batch_size, cfg.lease_ttl)
            .await?;
        if window.exhausted && !after.is_empty() {
            // The last keys: the window goes on from the first key (up to
            // the cursor), so a claim never comes back empty while a key
            // before the cursor has work.
            let room = cfg.batch_size.saturating_sub(window.heads.len() as u32);
            let rest = self
                .store
                .outbox_key_window("", room, cfg.lease_ttl)
                .await?;
            // Past the cursor again: every key was seen, start over next time.
            let wrapped = rest.heads.iter().any(|h| h.key > after);
            window.exhausted = rest.exhausted || wrapped;
            let before = rest.heads.into_iter().filter(|h| h.key <= after);
            window.heads.extend(before);
        }
        let heads: Vec<Uuid> = window
            .heads
            .iter()
            .filter(|h| h.claimable)
            .map(|h| h.id)
            .collect();
        let rows = self
            .store
            .outbox_claim(ClaimParams {
                replica_id: &cfg.replica_id,
                batch_size: cfg.batch_size,
                lease_ttl: cfg.lease_ttl,
                key_heads: &heads,
                after: place,
            })
            .await?;
        if heads.iter().all(|h| rows.iter().any(|r| r.id == *h)) {
            let next = match window.heads.last() {
                Some(last) if !window.exhausted => last.key.clone(),
                _ => String::new(),
            };
            *self.key_cursor.lock().expect("key cursor") = next;
        }
        Ok(rows)
    }

    /// The span of one batch: parent of its phases' spans.
    pub(super) fn batch_span(&self) -> Span {
        let cfg = &self.config;
        tracing::info_span!(
            "outbox.batch",
            outbox.replica = %cfg.replica_id,
            messaging.system = "rabbitmq",
            messaging.destination.name = %cfg.exchange,
            messaging.batch.message_count = Empty,
            outbox.outcome = Empty,
            outbox.published = Empty,
            outbox.nacked = Empty,
            outbox.mark_lost = Empty,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ports::KeySeq;

    fn row(at: i64, keyed: bool) -> ClaimedRow {
        let id = Uuid::from_u128(at as u128);
        ClaimedRow {
            id,
            routing_key: "k".into(),
            body: Vec::new(),
            attempts: 0,
            trace: None,
            age: Duration::ZERO,
            ordering: keyed.then(|| KeySeq {
                key: "k".into(),
                seq: 1,
            }),
            position: Some(ClaimPosition {
                enqueued_at_micros: at,
                id,
            }),
        }
    }

    #[test]
    fn a_walk_goes_on_from_the_last_unkeyed_row_of_each_full_claim() {
        let mut walk = Walk::default();
        assert_eq!(walk.after(), None, "a drain starts from the oldest row");
        // The keyed row is newer than every unkeyed one: not where the
        // unkeyed walk stands.
        walk.next(&[row(1, false), row(2, false), row(9, true)], true);
        assert_eq!(walk.after().map(|p| p.enqueued_at_micros), Some(2));
        // A full claim of keyed rows only leaves the place where it was.
        walk.next(&[row(20, true)], true);
        assert_eq!(walk.after().map(|p| p.enqueued_at_micros), Some(2));
        walk.next(&[row(3, false)], true);
        assert_eq!(walk.after().map(|p| p.enqueued_at_micros), Some(3));
        // A short claim ends the walk with the drain.
        walk.next(&[row(4, false)], false);
        assert_eq!(walk.after(), None);
    }

    #[test]
    fn a_walk_starts_over_after_claims_per_walk_claims() {
        let mut walk = Walk::default();
        for n in 1..CLAIMS_PER_WALK {
            walk.next(&[row(i64::from(n), false)], true);
            assert!(walk.after().is_some());
        }
        walk.next(&[row(99, false)], true);
        assert_eq!(walk.after(), None, "from the oldest row again");
        walk.next(&[row(100, false)], true);
        assert!(walk.after().is_some(), "and on from there");
    }
}
