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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit, watch};
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
    /// With `max_rows_per_sec`: the clock time (ns) before which the next
    /// claim may not start.
    next_claim_at: AtomicU64,
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
            next_claim_at: AtomicU64::new(0),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &DrainerConfig {
        &self.config
    }

    /// One claim → publish → mark cycle, strictly in sequence. [`run`]
    /// drains with [`drain`] instead, which overlaps batches.
    ///
    /// [`run`]: Self::run
    /// [`drain`]: Self::drain
    pub async fn tick(&self) -> Result<TickReport, DrainError> {
        let mut report = TickReport::default();
        let wait = self.pace_wait();
        if !wait.is_zero() {
            self.clock.sleep(wait).await;
        }
        let claimed = self.claim(&mut report).await?;
        if claimed.rows.is_empty() {
            return Ok(report);
        }
        let permits = Semaphore::new(self.config.pipeline_depth as usize);
        let t1 = self.clock.now();
        let sending = self.send(claimed, &permits).await?;
        let (rows, outcome) = self.settle(sending).await?;
        report.publish_time = self.clock.now().saturating_sub(t1);
        self.mark(&rows, outcome, &mut report).await?;
        Ok(report)
    }

    /// Drains until a claim comes back short of a full batch (or `shutdown`
    /// turns true, or something fails), overlapping consecutive batches so
    /// that neither the database nor the broker waits for the other: while
    /// batch *n* is published, batch *n − 1*'s last confirms are awaited
    /// and its rows marked, and batch *n + 1* is claimed. Each phase keeps
    /// its own rules: no database transaction is ever open across broker
    /// I/O, one channel per batch, at most `pipeline_depth` unconfirmed
    /// publishes for the whole replica, and one deadline per batch counted
    /// from its claim to its last confirm (so it never outlives the
    /// confirm timeout, whatever the overlap). After a failure nothing new
    /// is claimed or published; the batch in hand is finished (confirmed
    /// and marked, or released) and the first error returned.
    ///
    /// The report sums the batches; its phase times overlap.
    pub async fn drain(&self, shutdown: &watch::Receiver<bool>) -> Result<TickReport, DrainError> {
        let batch = self.config.batch_size as usize;
        let permits = Semaphore::new(self.config.pipeline_depth as usize);
        let mut report = TickReport::default();
        if !self.pace(shutdown).await {
            return Ok(report);
        }
        let mut next = self.claim(&mut report).await?;
        let mut tail: Option<Sending<'_, B::Channel>> = None;
        let mut first_error: Option<DrainError> = None;
        while !next.rows.is_empty() || tail.is_some() {
            let more = next.rows.len() >= batch && first_error.is_none() && !*shutdown.borrow();
            let claimed = std::mem::replace(&mut next, Claimed::none());
            let previous = tail.take();
            let (mut send_report, mut settle_report, mut claim_report) = (
                TickReport::default(),
                TickReport::default(),
                TickReport::default(),
            );
            let (sent, settled, claim) = tokio::join!(
                async {
                    if claimed.rows.is_empty() {
                        return Ok(None);
                    }
                    let t = self.clock.now();
                    let sending = self.send(claimed, &permits).await;
                    send_report.publish_time = self.clock.now().saturating_sub(t);
                    sending.map(Some)
                },
                async {
                    let Some(previous) = previous else {
                        return Ok(());
                    };
                    let t = self.clock.now();
                    let (rows, outcome) = self.settle(previous).await?;
                    settle_report.publish_time = self.clock.now().saturating_sub(t);
                    self.mark(&rows, outcome, &mut settle_report).await
                },
                async {
                    if more && self.pace(shutdown).await {
                        self.claim(&mut claim_report).await
                    } else {
                        Ok(Claimed::none())
                    }
                },
            );
            for r in [&send_report, &settle_report, &claim_report] {
                report.absorb(r);
            }
            let mut errors = Vec::new();
            if let Err(e) = settled {
                errors.push(e);
            }
            match sent {
                Ok(sending) => tail = sending,
                Err(e) => errors.push(e),
            }
            match claim {
                Ok(claimed) => next = claimed,
                Err(e) => errors.push(e),
            }
            for e in errors {
                if first_error.is_none() {
                    first_error = Some(e);
                } else {
                    tracing::warn!(
                        replica = %self.config.replica_id,
                        error = %e,
                        "outbox drain: a further failure while finishing the batch in hand"
                    );
                }
            }
            if first_error.is_some() && !next.rows.is_empty() {
                // Claimed in the same step as a failure: hand the rows back.
                let claimed = std::mem::replace(&mut next, Claimed::none());
                self.release_all(&claimed.rows).await;
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// With `max_rows_per_sec`, waits until the next claim may start;
    /// false if `shutdown` turned true meanwhile.
    async fn pace(&self, shutdown: &watch::Receiver<bool>) -> bool {
        let wait = self.pace_wait();
        wait.is_zero() || !sleep_or_shutdown(&*self.clock, wait, &mut shutdown.clone()).await
    }

    /// How long until the next claim may start (zero without a bound).
    fn pace_wait(&self) -> Duration {
        if self.config.max_rows_per_sec.is_none() {
            return Duration::ZERO;
        }
        let at = Duration::from_nanos(self.next_claim_at.load(Ordering::Relaxed));
        at.saturating_sub(self.clock.now())
    }

    /// Phase 1: one claim of up to a batch. With `max_rows_per_sec`, the
    /// claimed rows push the next claim's earliest start back by their share
    /// of a second, counted from this claim's start (no burst allowance).
    async fn claim(&self, report: &mut TickReport) -> Result<Claimed, DrainError> {
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
        let at = self.clock.now();
        debug_assert!(rows.len() <= cfg.batch_size as usize, "store over-claimed");
        if let Some(rate) = cfg.max_rows_per_sec {
            let from = Duration::from_nanos(self.next_claim_at.load(Ordering::Relaxed)).max(t0);
            let share = Duration::from_secs(rows.len() as u64) / rate.get();
            let next = (from + share).as_nanos().min(u128::from(u64::MAX)) as u64;
            self.next_claim_at.store(next, Ordering::Relaxed);
        }
        report.claimed += rows.len();
        report.claim_time += at.saturating_sub(t0);
        Ok(Claimed { rows, at })
    }

    /// Phase 2, first part: opens the batch's channel and publishes every
    /// row, within what is left of the batch's deadline. Returns with up to
    /// `pipeline_depth` publishes still unconfirmed; on failure the rows are
    /// released and the connection replaced.
    async fn send<'p>(
        &self,
        claimed: Claimed,
        permits: &'p Semaphore,
    ) -> Result<Sending<'p, B::Channel>, DrainError> {
        let generation = self.broker.connection_generation();
        let deadline = claimed.at + self.config.confirm_timeout;
        let left = deadline.saturating_sub(self.clock.now());
        let published =
            with_deadline(&*self.clock, left, self.publish_all(&claimed.rows, permits)).await;
        match self.phase2_result(published, claimed.rows.len()) {
            Ok((channel, pending, outcome)) => Ok(Sending {
                rows: claimed.rows,
                channel,
                pending,
                outcome,
                deadline,
                generation,
            }),
            Err(e) => Err(self.phase2_failed(&claimed.rows, generation, e).await),
        }
    }

    /// Phase 2, second part: awaits the batch's remaining confirms within its
    /// deadline and closes its channel.
    async fn settle(
        &self,
        sending: Sending<'_, B::Channel>,
    ) -> Result<(Vec<ClaimedRow>, BatchOutcome), DrainError> {
        let Sending {
            rows,
            channel,
            mut pending,
            mut outcome,
            deadline,
            generation,
        } = sending;
        let left = deadline.saturating_sub(self.clock.now());
        let confirms = async {
            while let Some((id, confirm, permit)) = pending.pop_front() {
                outcome.record(id, confirm.await?);
                drop(permit);
            }
            Ok::<(), BrokerError>(())
        };
        let settled = with_deadline(&*self.clock, left, confirms).await;
        channel.channel_close().await;
        match self.phase2_result(settled, rows.len()) {
            Ok(()) => Ok((rows, outcome)),
            Err(e) => Err(self.phase2_failed(&rows, generation, e).await),
        }
    }

    /// Phase 3: marks the confirmed rows published and records the failures,
    /// both guarded by `claimed_by`.
    async fn mark(
        &self,
        rows: &[ClaimedRow],
        outcome: BatchOutcome,
        report: &mut TickReport,
    ) -> Result<(), DrainError> {
        let cfg = &self.config;
        debug_assert_eq!(outcome.acked.len() + outcome.failed.len(), rows.len());
        let t2 = self.clock.now();
        if !outcome.acked.is_empty() {
            let published = self
                .store
                .outbox_mark_published(&cfg.replica_id, &outcome.acked)
                .await?;
            let lost = outcome.acked.len() as u64 - published;
            report.published += published;
            report.mark_lost += lost;
            if lost > 0 {
                tracing::warn!(
                    replica = %cfg.replica_id,
                    lost,
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
            report.failed += fail.recorded;
            report.parked += fail.parked;
            if fail.parked > 0 {
                tracing::warn!(
                    replica = %cfg.replica_id,
                    parked = fail.parked,
                    max_attempts = cfg.max_attempts,
                    "outbox rows parked after repeated row-culpable failures; unpark to retry"
                );
            }
        }
        report.mark_time += self.clock.now().saturating_sub(t2);
        Ok(())
    }

    /// Publishes `rows` on a new confirm-mode channel, in claim order, each
    /// publish holding one of the replica's `pipeline_depth` permits until
    /// its confirm is awaited. Returns the channel, the still unconfirmed
    /// publishes and the verdicts so far.
    #[allow(clippy::type_complexity)]
    async fn publish_all<'p>(
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
                            outcome.record(id, confirm?);
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
    fn phase2_result<T>(
        &self,
        step: Option<Result<T, BrokerError>>,
        rows: usize,
    ) -> Result<T, DrainError> {
        match step {
            Some(result) => result.map_err(DrainError::from),
            None => Err(DrainError::ConfirmTimeout {
                rows,
                timeout_secs: self.config.confirm_timeout.as_secs(),
            }),
        }
    }

    /// A Phase 2 infrastructure failure: every claim of the batch released
    /// (attempts untouched), the connection replaced (single-flight).
    async fn phase2_failed(
        &self,
        rows: &[ClaimedRow],
        generation: u64,
        error: DrainError,
    ) -> DrainError {
        self.release_all(rows).await;
        self.reconnect(generation).await;
        error
    }

    async fn release_all(&self, rows: &[ClaimedRow]) {
        if rows.is_empty() {
            return;
        }
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
            // `drain` returns once a claim comes back short of a full batch:
            // the backlog is drained, so the next claim waits a tick.
            let delay = match self.drain(&shutdown).await {
                Ok(report) => {
                    consecutive_errors = 0;
                    if report.claimed > 0 {
                        last_busy = Some(self.clock.now());
                    }
                    let steady = last_busy
                        .is_none_or(|t| self.clock.now().saturating_sub(t) >= STEADY_AFTER);
                    if steady { idle_tick } else { cfg.tick }
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

/// Rows from one claim and the clock time the claim returned (where the
/// batch's deadline starts).
struct Claimed {
    rows: Vec<ClaimedRow>,
    at: Duration,
}

impl Claimed {
    fn none() -> Self {
        Self {
            rows: Vec::new(),
            at: Duration::ZERO,
        }
    }
}

/// Unconfirmed publishes of one batch, oldest first, each holding a permit.
type Pending<'p, Ch> = VecDeque<(Uuid, <Ch as PublishChannel>::Confirm, SemaphorePermit<'p>)>;

/// A batch between its last publish and its last confirm.
struct Sending<'p, Ch: PublishChannel> {
    rows: Vec<ClaimedRow>,
    channel: Ch,
    pending: Pending<'p, Ch>,
    outcome: BatchOutcome,
    /// Clock time by which the last confirm must be in.
    deadline: Duration,
    generation: u64,
}

impl TickReport {
    fn absorb(&mut self, other: &TickReport) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.mark_lost += other.mark_lost;
        self.failed += other.failed;
        self.parked += other.parked;
        self.claim_time += other.claim_time;
        self.publish_time += other.publish_time;
        self.mark_time += other.mark_time;
    }
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
