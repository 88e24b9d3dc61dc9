//! Phase 2, publish: pipelined publishes with confirms under one deadline,
//! and what each confirm says about its row.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};
use tracing::{Instrument, Span};
use uuid::Uuid;

use super::claim::{Claimed, unpublishable};
use super::{Drainer, LAST_ERROR_MAX_CHARS};
use crate::core::marks::Mark;
use crate::core::ports::{
    Broker, ClaimedRow, Clock, Confirm, Entropy, OutboxStore, OutgoingMessage, PublishChannel,
    RowFailure,
};
use crate::core::{truncate_chars, with_deadline};
use crate::error::{BrokerError, DrainError};
use crate::telemetry::{drainer as metric, propagation};

/// Unconfirmed publishes of one batch, oldest first, each holding a permit.
pub(super) type Pending<'p, Ch> =
    VecDeque<(Uuid, <Ch as PublishChannel>::Confirm, SemaphorePermit<'p>)>;

/// A batch between its last publish and its last confirm.
pub(super) struct Sending<'p, Ch: PublishChannel> {
    pub(super) rows: Vec<ClaimedRow>,
    pub(super) channel: Ch,
    pub(super) pending: Pending<'p, Ch>,
    pub(super) outcome: BatchOutcome,
    /// Clock time the claim was sent.
    pub(super) claimed_at: Duration,
    /// Clock time by which the last confirm must be in.
    pub(super) deadline: Duration,
    pub(super) generation: u64,
    /// The batch's span.
    pub(super) span: Span,
}

/// The verdicts of one batch: confirmed, failed by the row's own fault
/// (found before any broker I/O), or nacked by the broker (blameless).
#[derive(Debug, Default)]
pub(super) struct BatchOutcome {
    pub(super) acked: Vec<Uuid>,
    pub(super) failed: Vec<RowFailure>,
    pub(super) refused: Vec<Uuid>,
    /// The first nack's reason, bounded.
    pub(super) refusal: Option<String>,
}

impl BatchOutcome {
    /// Files one verdict; true if it was a nack.
    pub(super) fn record(&mut self, id: Uuid, confirm: Confirm) -> bool {
        match confirm {
            Confirm::Ack => {
                self.acked.push(id);
                false
            }
            Confirm::Nack(reason) => {
                self.refused.push(id);
                self.refusal
                    .get_or_insert_with(|| truncate_chars(&reason, LAST_ERROR_MAX_CHARS));
                true
            }
        }
    }
}

impl<S: OutboxStore, B: Broker, C: Clock, E: Entropy> Drainer<S, B, C, E> {
    /// Phase 2, first part: opens the batch's channel and publishes every
    /// row, within what is left of the batch's deadline. Returns with up to
    /// `pipeline_depth` publishes still unconfirmed; on failure the rows are
    /// released and the connection replaced.
    pub(super) async fn send<'p>(
        &self,
        claimed: Claimed,
        permits: &'p Semaphore,
    ) -> Result<Sending<'p, B::Channel>, DrainError> {
        let generation = self.broker.connection_generation();
        let deadline = claimed.at + self.config.confirm_timeout;
        let left = deadline.saturating_sub(self.clock.now());
        if left.is_zero() {
            // The claim's own reply outlived the batch's deadline (a slow or
            // cut-off database): nothing is published, the rows go back at
            // once, before their lease can expire in our hands. The broker
            // is not implicated.
            self.marks.hit(Mark::ClaimOutlivedDeadline);
            let e = DrainError::ConfirmTimeout {
                rows: claimed.rows.len(),
                timeout_secs: self.config.confirm_timeout.as_secs(),
            };
            return Err(self
                .phase2_failed(&claimed.rows, None, e, &claimed.span)
                .await);
        }
        let exchange = &self.config.exchange;
        let span = tracing::info_span!(
            parent: &claimed.span,
            "send",
            otel.name = %format_args!("send {exchange}"),
            otel.kind = "producer",
            messaging.system = "rabbitmq",
            messaging.operation.name = "publish",
            messaging.operation.type = "send",
            messaging.destination.name = %exchange,
            messaging.batch.message_count = claimed.rows.len(),
        );
        if !span.is_disabled() {
            for trace in claimed.rows.iter().filter_map(|r| r.trace.as_ref()) {
                propagation::link(&span, trace);
            }
        }
        let published = with_deadline(&*self.clock, left, self.publish_all(&claimed.rows, permits))
            .instrument(span)
            .await;
        match self.phase2_result(published, claimed.rows.len()) {
            Ok((channel, pending, outcome)) => Ok(Sending {
                rows: claimed.rows,
                channel,
                pending,
                outcome,
                claimed_at: claimed.at,
                deadline,
                generation,
                span: claimed.span,
            }),
            Err(e) => Err(self
                .phase2_failed(&claimed.rows, Some(generation), e, &claimed.span)
                .await),
        }
    }

    /// Phase 2, second part: awaits the batch's remaining confirms within its
    /// deadline and closes its channel.
    pub(super) async fn settle(
        &self,
        sending: Sending<'_, B::Channel>,
    ) -> Result<(Vec<ClaimedRow>, BatchOutcome), DrainError> {
        let Sending {
            rows,
            channel,
            mut pending,
            mut outcome,
            claimed_at,
            deadline,
            generation,
            span,
        } = sending;
        let left = deadline.saturating_sub(self.clock.now());
        let confirms = async {
            while let Some((id, confirm, permit)) = pending.pop_front() {
                if outcome.record(id, confirm.await?) {
                    self.marks.hit(Mark::RowNacked);
                }
                drop(permit);
            }
            Ok::<(), BrokerError>(())
        };
        let settled = with_deadline(&*self.clock, left, confirms)
            .instrument(tracing::info_span!(parent: &span, "outbox.settle"))
            .await;
        channel.channel_close().await;
        match self.phase2_result(settled, rows.len()) {
            Ok(()) => {
                let since_claim = self.clock.now().saturating_sub(claimed_at);
                metrics::histogram!(metric::PUBLISH_DURATION).record(since_claim.as_secs_f64());
                let lag = metrics::histogram!(metric::COMMIT_TO_CONFIRM);
                for row in &rows {
                    let confirmed = !outcome.failed.iter().any(|f| f.id == row.id)
                        && !outcome.refused.contains(&row.id);
                    if confirmed {
                        lag.record((row.age + since_claim).as_secs_f64());
                    }
                }
                Ok((rows, outcome))
            }
            Err(e) => Err(self.phase2_failed(&rows, Some(generation), e, &span).await),
        }
    }

    /// Publishes `rows` on a new confirm-mode channel, in claim order, each
    /// publish holding one of the replica's `pipeline_depth` permits until
    /// its confirm is awaited. Returns the channel, the still unconfirmed
    /// publishes and the verdicts so far.
    #[allow(clippy::type_complexity)]
    pub(super) async fn publish_all<'p>(
        &self,
        rows: &[ClaimedRow],
        permits: &'p Semaphore,
    ) -> Result<(B::Channel, Pending<'p, B::Channel>, BatchOutcome), BrokerError> {
        let mut outcome = BatchOutcome::default();
        let mut channel = self.broker.channel_open().await?;
        let mut pending: Pending<'p, B::Channel> = VecDeque::new();
        let result = async {
            channel.channel_confirm_select().await?;
            for row in rows {
                if let Some(reason) = unpublishable(row) {
                    self.marks.hit(Mark::RowUnpublishable);
                    outcome.failed.push(RowFailure {
                        id: row.id,
                        error: reason,
                    });
                    continue;
                }
                let permit = loop {
                    // A permit frees when the previous batch's tail or this
                    // batch's oldest publish is confirmed, whichever first.
                    let Some((_, oldest, _)) = pending.front_mut() else {
                        break permits
                            .acquire()
                            .await
                            .expect("the semaphore is never closed");
                    };
                    tokio::select! {
                        biased;
                        permit = permits.acquire() => {
                            break permit.expect("the semaphore is never closed");
                        }
                        confirm = oldest => {
                            let (id, _, permit) = pending.pop_front().expect("non-empty");
                            if outcome.record(id, confirm?) {
                                self.marks.hit(Mark::RowNacked);
                            }
                            drop(permit);
                        }
                    }
                };
                let confirm = channel
                    .channel_publish(OutgoingMessage {
                        exchange: &self.config.exchange,
                        routing_key: &row.routing_key,
                        message_id: row.id,
                        body: &row.body,
                        trace: row.trace.as_ref(),
                        ordering: row.ordering.as_ref(),
                    })
                    .await?;
                pending.push_back((row.id, confirm, permit));
            }
            Ok::<(), BrokerError>(())
        }
        .await;
        match result {
            Ok(()) => Ok((channel, pending, outcome)),
            Err(e) => {
                drop(pending);
                channel.channel_close().await;
                Err(e)
            }
        }
    }

    /// What a Phase 2 step under the batch's deadline came to: its value, a
    /// broker error, or (`None`) the confirm timeout for a batch of `rows`.
    pub(super) fn phase2_result<T>(
        &self,
        step: Option<Result<T, BrokerError>>,
        rows: usize,
    ) -> Result<T, DrainError> {
        match step {
            Some(Ok(value)) => Ok(value),
            Some(Err(e)) => {
                self.marks.hit(Mark::Phase2BrokerError);
                Err(DrainError::from(e))
            }
            None => {
                self.marks.hit(Mark::Phase2Timeout);
                Err(DrainError::ConfirmTimeout {
                    rows,
                    timeout_secs: self.config.confirm_timeout.as_secs(),
                })
            }
        }
    }

    /// A Phase 2 infrastructure failure: every claim of the batch released
    /// (attempts untouched), and the connection of `generation`, if it is
    /// implicated, due for replacement (single-flight) once every other
    /// claim in hand is released too.
    pub(super) async fn phase2_failed(
        &self,
        rows: &[ClaimedRow],
        generation: Option<u64>,
        error: DrainError,
        span: &Span,
    ) -> DrainError {
        span.record("outbox.outcome", "released");
        self.failing.store(true, Ordering::Relaxed);
        self.marks.hit(Mark::ReleasedAfterFailure);
        self.release_all(rows).await;
        if let Some(generation) = generation {
            self.reconnect_due
                .store(generation.saturating_add(1), Ordering::Relaxed);
        }
        error
    }
}
