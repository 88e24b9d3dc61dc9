//! The lease-based three-phase drainer of ADR-018 (#478, #1061).
//!
//! One tick: **claim** (one statement, lease stamped, no transaction left
//! open) → **publish** (one channel, confirm-select once, publishes pipelined
//! up to the depth, the whole phase under one deadline, no database
//! transaction open) → **mark** (bulk `published_at` for acks, bulk
//! `attempts + 1` for nacks, both guarded by `claimed_by`). Any infrastructure
//! failure in Phase 2 releases every claim without touching `attempts` and
//! asks the broker adapter for a single-flight reconnect.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use uuid::Uuid;

use super::ports::{
    Broker, ClaimParams, ClaimedRow, Clock, Confirm, Entropy, OutboxStore, OutgoingMessage,
    PublishChannel, RowFailure,
};
use super::{sleep_or_shutdown, truncate_chars, with_deadline};
use crate::config::DrainerConfig;
use crate::envelope::ROUTING_KEY_MAX_BYTES;
use crate::error::{BrokerError, DrainError};

/// After this long without work or errors the drainer polls at the idle tick.
pub const STEADY_AFTER: Duration = Duration::from_secs(60);
/// The idle tick is this multiple of the busy tick (250 ms → 1 s).
pub const IDLE_TICK_FACTOR: u32 = 4;
/// Longest wait between ticks after consecutive failures.
pub const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Longest a `last_error` text is kept.
pub const LAST_ERROR_MAX_CHARS: usize = 1024;

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Rows claimed in Phase 1.
    pub claimed: usize,
    /// Rows confirmed and marked published.
    pub published: u64,
    /// Confirmed rows whose mark found the lease gone (another drainer
    /// reclaimed them: they will be published again).
    pub mark_lost: u64,
    /// Rows nacked (row-culpable) and recorded.
    pub failed: u64,
    /// Of those, rows that parked.
    pub parked: u64,
    /// Clock time spent in Phase 1 (claim).
    pub claim_time: Duration,
    /// Clock time spent in Phase 2 (channel, publishes, confirms).
    pub publish_time: Duration,
    /// Clock time spent in Phase 3 (marks).
    pub mark_time: Duration,
}

/// The drainer: the production code in production and in the simulation.
pub struct Drainer<S, B, C, E> {
    store: Arc<S>,
    broker: Arc<B>,
    clock: Arc<C>,
    entropy: Arc<E>,
    config: DrainerConfig,
    /// Signalled when new rows commit (production: PostgreSQL NOTIFY), so
    /// an idle drainer claims at once instead of at its next tick.
    wakeup: Option<Arc<tokio::sync::Notify>>,
}

impl<S: OutboxStore, B: Broker, C: Clock, E: Entropy> Drainer<S, B, C, E> {
    /// Wakes the drainer between ticks whenever `wakeup` is notified (a
    /// permit stored while a tick runs makes the next sleep end at once).
    /// Polling stays the fallback: a lost notification only costs a tick.
    /// Error backoff is never cut short by it.
    pub fn with_wakeup(mut self, wakeup: Arc<tokio::sync::Notify>) -> Self {
        self.wakeup = Some(wakeup);
        self
    }

    /// Builds a drainer from its ports and a checked configuration.
    pub fn new(
        store: Arc<S>,
        broker: Arc<B>,
        clock: Arc<C>,
        entropy: Arc<E>,
        config: DrainerConfig,
    ) -> Self {
        Self {
            store,
            broker,
            clock,
            entropy,
            config,
            wakeup: None,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &DrainerConfig {
        &self.config
    }

    /// One claim → publish → mark cycle.
    pub async fn tick(&self) -> Result<TickReport, DrainError> {
        let cfg = &self.config;
        let t0 = self.clock.now();
        let rows = self
            .store
            .outbox_claim(ClaimParams {
                replica_id: &cfg.replica_id,
                batch_size: cfg.batch_size,
                lease_ttl: cfg.lease_ttl,
            })
            .await?;
        let t1 = self.clock.now();
        let mut report = TickReport {
            claimed: rows.len(),
            claim_time: t1.saturating_sub(t0),
            ..TickReport::default()
        };
        if rows.is_empty() {
            return Ok(report);
        }
        debug_assert!(rows.len() <= cfg.batch_size as usize, "store over-claimed");

        let generation = self.broker.connection_generation();
        let phase2 = with_deadline(&*self.clock, cfg.confirm_timeout, self.publish_batch(&rows));
        let outcome = match phase2.await {
            Some(Ok(outcome)) => outcome,
            Some(Err(e)) => {
                self.release_all(&rows).await;
                self.reconnect(generation).await;
                return Err(e.into());
            }
            None => {
                self.release_all(&rows).await;
                self.reconnect(generation).await;
                return Err(DrainError::ConfirmTimeout {
                    rows: rows.len(),
                    timeout_secs: cfg.confirm_timeout.as_secs(),
                });
            }
        };

        let t2 = self.clock.now();
        report.publish_time = t2.saturating_sub(t1);
        if !outcome.acked.is_empty() {
            report.published = self
                .store
                .outbox_mark_published(&cfg.replica_id, &outcome.acked)
                .await?;
            report.mark_lost = outcome.acked.len() as u64 - report.published;
            if report.mark_lost > 0 {
                tracing::warn!(
                    replica = %cfg.replica_id,
                    lost = report.mark_lost,
                    "lease lost before mark: another drainer reclaimed rows this one published; \
                     they will be published again"
                );
            }
        }
        if !outcome.failed.is_empty() {
            let fail = self
                .store
                .outbox_mark_failed(&cfg.replica_id, &outcome.failed, cfg.max_attempts)
                .await?;
            report.failed = fail.recorded;
            report.parked = fail.parked;
            if fail.parked > 0 {
                tracing::warn!(
                    replica = %cfg.replica_id,
                    parked = fail.parked,
                    max_attempts = cfg.max_attempts,
                    "outbox rows parked after repeated row-culpable failures; unpark to retry"
                );
            }
        }
        report.mark_time = self.clock.now().saturating_sub(t2);
        Ok(report)
    }

    /// Phase 2: publish the batch on one confirm-mode channel, at most
    /// `pipeline_depth` unconfirmed at a time, in claim order.
    async fn publish_batch(&self, rows: &[ClaimedRow]) -> Result<BatchOutcome, BrokerError> {
        let depth = self.config.pipeline_depth as usize;
        let mut outcome = BatchOutcome::default();
        let mut channel = self.broker.channel_open().await?;
        let result = async {
            channel.channel_confirm_select().await?;
            let mut in_flight: VecDeque<(Uuid, <B::Channel as PublishChannel>::Confirm)> =
                VecDeque::with_capacity(depth);
            for row in rows {
                if let Some(reason) = unpublishable(row) {
                    outcome.failed.push(RowFailure {
                        id: row.id,
                        error: reason,
                    });
                    continue;
                }
                if in_flight.len() == depth {
                    let (id, confirm) = in_flight.pop_front().expect("depth > 0");
                    outcome.record(id, confirm.await?);
                }
                let confirm = channel
                    .channel_publish(OutgoingMessage {
                        exchange: &self.config.exchange,
                        routing_key: &row.routing_key,
                        message_id: row.id,
                        body: &row.body,
                    })
                    .await?;
                in_flight.push_back((row.id, confirm));
            }
            while let Some((id, confirm)) = in_flight.pop_front() {
                outcome.record(id, confirm.await?);
            }
            Ok::<(), BrokerError>(())
        }
        .await;
        channel.channel_close().await;
        result.map(|()| outcome)
    }

    async fn release_all(&self, rows: &[ClaimedRow]) {
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        if let Err(e) = self
            .store
            .outbox_release(&self.config.replica_id, &ids)
            .await
        {
            tracing::warn!(
                replica = %self.config.replica_id,
                rows = ids.len(),
                error = %e,
                "could not release claims; they will be reclaimed when the lease expires"
            );
        }
    }

    async fn reconnect(&self, generation: u64) {
        if let Err(e) = self.broker.connection_reconnect(generation).await {
            tracing::warn!(error = %e, "broker reconnect failed; retrying on the next tick");
        }
    }

    /// Runs ticks until `shutdown` turns true (or its sender is dropped). A
    /// batch in hand when shutdown is asked for is finished (Phase 2 is
    /// bounded by the confirm timeout) and marked, or released, before this
    /// returns.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let cfg = &self.config;
        let idle_tick = cfg.tick * IDLE_TICK_FACTOR;
        let mut last_busy: Option<Duration> = None;
        let mut consecutive_errors: u32 = 0;
        tracing::info!(replica = %cfg.replica_id, exchange = %cfg.exchange, "outbox drainer started");
        loop {
            if *shutdown.borrow() {
                break;
            }
            let mut wakeable = true;
            let delay = match self.tick().await {
                Ok(report) => {
                    consecutive_errors = 0;
                    if report.claimed > 0 {
                        last_busy = Some(self.clock.now());
                    }
                    if report.claimed >= cfg.batch_size as usize {
                        // A full batch: more is waiting. Drain flat out.
                        Duration::ZERO
                    } else {
                        let steady = last_busy
                            .is_none_or(|t| self.clock.now().saturating_sub(t) >= STEADY_AFTER);
                        if steady { idle_tick } else { cfg.tick }
                    }
                }
                Err(e) => {
                    consecutive_errors = consecutive_errors.saturating_add(1);
                    last_busy = Some(self.clock.now());
                    tracing::warn!(
                        replica = %cfg.replica_id,
                        error = %e,
                        consecutive_errors,
                        "outbox drain tick failed; claims released, attempts untouched"
                    );
                    wakeable = false;
                    self.backoff(consecutive_errors)
                }
            };
            let stop = match self.wakeup.as_ref().filter(|_| wakeable) {
                Some(wakeup) if !delay.is_zero() => {
                    tokio::select! {
                        biased;
                        stop = sleep_or_shutdown(&*self.clock, delay, &mut shutdown) => stop,
                        () = wakeup.notified() => false,
                    }
                }
                _ => sleep_or_shutdown(&*self.clock, delay, &mut shutdown).await,
            };
            if stop {
                break;
            }
        }
        tracing::info!(replica = %cfg.replica_id, "outbox drainer stopped");
    }

    /// Exponential backoff from the busy tick, capped, with up to 25 % jitter
    /// so replicas that failed together do not retry in lockstep.
    fn backoff(&self, consecutive_errors: u32) -> Duration {
        backoff_delay(
            self.config.tick,
            consecutive_errors,
            self.entropy.next_u64(),
        )
    }
}

/// The pause after `consecutive_errors` failed ticks in a row: the tick
/// doubled per further error, capped at [`ERROR_BACKOFF_MAX`], plus a jitter
/// below a quarter of that drawn from `random`.
fn backoff_delay(tick: Duration, consecutive_errors: u32, random: u64) -> Duration {
    let exp = consecutive_errors.saturating_sub(1).min(16);
    let base = tick.saturating_mul(1u32 << exp).min(ERROR_BACKOFF_MAX);
    let quarter_ms = (base.as_millis() as u64 / 4).max(1);
    base + Duration::from_millis(random % quarter_ms)
}

/// A row the broker could never accept: the row's own fault, found without
/// any broker I/O (rows written by hand, bypassing `publish_tx` validation).
fn unpublishable(row: &ClaimedRow) -> Option<String> {
    if row.routing_key.is_empty() || row.routing_key.len() > ROUTING_KEY_MAX_BYTES {
        return Some(format!(
            "routing key of {} bytes cannot be published (1..=255)",
            row.routing_key.len()
        ));
    }
    None
}

/// The confirms of one batch, split by verdict.
#[derive(Debug, Default)]
struct BatchOutcome {
    acked: Vec<Uuid>,
    failed: Vec<RowFailure>,
}

impl BatchOutcome {
    fn record(&mut self, id: Uuid, confirm: Confirm) {
        match confirm {
            Confirm::Ack => self.acked.push(id),
            Confirm::Nack(reason) => self.failed.push(RowFailure {
                id,
                error: truncate_chars(&format!("broker nack: {reason}"), LAST_ERROR_MAX_CHARS),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(250);

    #[test]
    fn backoff_doubles_from_the_tick_up_to_the_cap() {
        let no_jitter = |errors| backoff_delay(TICK, errors, 0);
        assert_eq!(no_jitter(0), TICK);
        assert_eq!(no_jitter(1), TICK);
        assert_eq!(no_jitter(2), TICK * 2);
        assert_eq!(no_jitter(4), TICK * 8);
        assert_eq!(no_jitter(7), ERROR_BACKOFF_MAX);
        assert_eq!(no_jitter(u32::MAX), ERROR_BACKOFF_MAX);
    }

    #[test]
    fn backoff_jitter_stays_below_a_quarter_and_follows_the_random_draw() {
        for errors in [1, 3, 9] {
            let base = backoff_delay(TICK, errors, 0);
            let quarter = base.as_millis() as u64 / 4;
            for random in [0, 1, quarter - 1, quarter, quarter + 7, u64::MAX] {
                let d = backoff_delay(TICK, errors, random);
                assert_eq!(d, base + Duration::from_millis(random % quarter));
                assert!(d >= base && d < base + base / 4, "{d:?} for base {base:?}");
            }
        }
        // Two draws can differ: replicas that failed together spread out.
        assert_ne!(backoff_delay(TICK, 1, 1), backoff_delay(TICK, 1, 2));
    }

    #[test]
    fn a_tick_too_short_to_jitter_backs_off_by_the_tick_alone() {
        let tiny = Duration::from_millis(2);
        for random in [0, 1, 5, u64::MAX] {
            assert_eq!(backoff_delay(tiny, 1, random), tiny);
        }
    }

    #[test]
    fn truncate_chars_counts_characters_not_bytes() {
        assert_eq!(truncate_chars("héllo", 2), "hé");
        assert_eq!(truncate_chars("héllo", 5), "héllo");
        assert_eq!(truncate_chars("héllo", 50), "héllo");
        assert_eq!(truncate_chars("", 3), "");
        let long = "é".repeat(LAST_ERROR_MAX_CHARS + 10);
        assert_eq!(
            truncate_chars(&long, LAST_ERROR_MAX_CHARS).chars().count(),
            LAST_ERROR_MAX_CHARS
        );
    }

    #[test]
    fn a_nack_records_a_bounded_error_naming_the_broker() {
        let mut outcome = BatchOutcome::default();
        let id = Uuid::nil();
        outcome.record(id, Confirm::Ack);
        outcome.record(id, Confirm::Nack("x".repeat(LAST_ERROR_MAX_CHARS * 2)));
        assert_eq!(outcome.acked, vec![id]);
        let error = &outcome.failed[0].error;
        assert!(error.starts_with("broker nack: x"), "{error}");
        assert_eq!(error.chars().count(), LAST_ERROR_MAX_CHARS);
    }
}
