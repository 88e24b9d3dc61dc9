//! The lease-based three-phase drainer of ADR-018 (#478, #1061).
//!
//! One tick: **claim** (one statement, lease stamped, no transaction left
//! open) → **publish** (one channel, confirm-select once, publishes pipelined
//! up to the depth, the whole phase under one deadline, no database
//! transaction open) → **mark** (bulk `published_at` for acks, bulk
//! `attempts + 1` for the rows' own faults, both guarded by `claimed_by`).
//! Any infrastructure failure in Phase 2 releases every claim without
//! touching `attempts` and asks the broker adapter for a single-flight
//! reconnect. A broker's nack is infrastructure trouble too (a queue full
//! under `reject-publish`, or the broker's own internal error; measured on
//! RabbitMQ 3.10, a node loss, a leader election or a quorum queue without
//! a majority never nacks: confirms come late or the connection drops):
//! the nacked rows are released without blame and the drainer backs off.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit, mpsc, watch};
use tracing::{Instrument, Span, field::Empty};
use uuid::Uuid;

use super::marks::{Mark, Marks};
use super::ports::{
    Broker, ClaimParams, ClaimedRow, Clock, Confirm, Entropy, OutboxStore, OutgoingMessage,
    PublishChannel, RowFailure,
};
use super::{sleep_or_shutdown, truncate_chars, with_deadline};
use crate::config::DrainerConfig;
use crate::envelope::ROUTING_KEY_MAX_BYTES;
use crate::error::{BrokerError, DrainError, StoreError};
use crate::telemetry::{drainer as metric, propagation};

/// After this long without work or errors the drainer polls at the idle tick.
pub const STEADY_AFTER: Duration = Duration::from_secs(60);
/// The idle tick is this multiple of the busy tick (250 ms → 1 s).
pub const IDLE_TICK_FACTOR: u32 = 4;
/// Longest wait between ticks after consecutive failures.
pub const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Longest a `last_error` text is kept.
pub const LAST_ERROR_MAX_CHARS: usize = 1024;
/// Most batches one replica holds at once while draining: one claimed
/// ahead, one being published, one awaiting its last confirms or its marks.
pub const BATCHES_IN_HAND_MAX: usize = 3;

/// What one stage of [`Drainer::drain`] did, and the failures it met.
type Stage = (TickReport, Vec<DrainError>);

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Rows claimed in Phase 1.
    pub claimed: usize,
    /// Of those, rows with an ordering key: their keys' next events may be
    /// claimable as soon as they are marked.
    pub keyed_claimed: usize,
    /// Rows confirmed and marked published.
    pub published: u64,
    /// Confirmed rows whose mark found the lease gone (another drainer
    /// reclaimed them: they will be published again).
    pub mark_lost: u64,
    /// Rows failed by their own fault (a routing key no broker accepts),
    /// their attempts bumped.
    pub failed: u64,
    /// Rows the broker nacked, released without blame.
    pub refused: u64,
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
    /// Coverage marks (none in production).
    marks: Marks,
    /// A Phase-2 failure implicated the broker connection of this
    /// generation + 1 (0: none): replaced once every claim in hand is
    /// released, so a slow reconnect never keeps rows claimed.
    reconnect_due: AtomicU64,
    /// The current drain met a failure: the claim stage claims nothing
    /// more. Set where the failure is detected, before any release is
    /// awaited, so no claim slips in meanwhile.
    failing: AtomicBool,
    /// Ordering keys: where the next key window starts (`""`: the first
    /// key). It moves past a window once every claimable head in it was
    /// claimed, and starts over after the last key.
    key_cursor: std::sync::Mutex<String>,
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

    /// Reports the paths it takes to `marks` (the simulation's coverage).
    pub fn with_marks(mut self, marks: Marks) -> Self {
        self.marks = marks;
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
            marks: Marks::default(),
            reconnect_due: AtomicU64::new(0),
            failing: AtomicBool::new(false),
            key_cursor: std::sync::Mutex::default(),
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
        let claimed = self.claim(&mut report, true).await?;
        if claimed.rows.is_empty() {
            return Ok(report);
        }
        let permits = Semaphore::new(self.config.pipeline_depth as usize);
        let t1 = self.clock.now();
        let span = claimed.span.clone();
        let phase2 = async {
            let sending = self.send(claimed, &permits).await?;
            self.settle(sending).await
        }
        .await;
        self.reconnect_if_due().await;
        let (rows, outcome) = phase2?;
        report.publish_time = self.clock.now().saturating_sub(t1);
        self.mark(&rows, outcome, &mut report, &span).await?;
        Ok(report)
    }

    /// Drains until a claim comes back short of a full batch (or `shutdown`
    /// turns true, or something fails), as a pipeline of four stages polled
    /// together on the caller's task (no spawning, so the simulation
    /// schedules them too): **claim** → **send** (one channel per batch,
    /// publishes in claim order) → **settle** (await the last confirms) →
    /// **mark**. While batch *n* is published, batch *n − 1*'s last confirms
    /// are awaited and batch *n + 1* is claimed; a slow statement in one
    /// stage holds up no other batch's Phase 2.
    ///
    /// Each phase keeps its rules: no database transaction is ever open
    /// across broker I/O; at most `pipeline_depth` unconfirmed publishes for
    /// the whole replica; at most [`BATCHES_IN_HAND_MAX`] batches claimed
    /// and not yet marked or released (a place is taken before claiming, so
    /// no claimed row waits for one); one deadline per batch counted from
    /// its claim to its last confirm, so a batch's Phase 2 never outlives
    /// `confirm_timeout`, whatever the overlap. After a failure nothing new
    /// is claimed or published: batches already published are settled and
    /// marked (or released), batches not yet published are released, the
    /// connection is replaced if it was implicated, and the first error is
    /// returned.
    ///
    /// The report sums the batches; its phase times overlap.
    pub async fn drain(&self, shutdown: &watch::Receiver<bool>) -> Result<TickReport, DrainError> {
        self.drain_expecting(shutdown, true).await
    }

    /// [`drain`](Self::drain); `expect_rows` says whether the first claim
    /// is expected to find work (a commit woke the drainer) or is a poll on
    /// the tick, which gets a DEBUG `outbox.poll` span instead of a batch
    /// span, so an idle drainer leaves no trace of spans behind.
    async fn drain_expecting(
        &self,
        shutdown: &watch::Receiver<bool>,
        expect_rows: bool,
    ) -> Result<TickReport, DrainError> {
        let permits = Semaphore::new(self.config.pipeline_depth as usize);
        let hands = Semaphore::new(BATCHES_IN_HAND_MAX);
        self.failing.store(false, Ordering::Relaxed);
        let stop = &self.failing;
        let (to_send, sends) = mpsc::channel(1);
        let (to_settle, settles) = mpsc::unbounded_channel();
        let (to_mark, marks) = mpsc::unbounded_channel();
        let stages = tokio::join!(
            self.claim_stage(&hands, to_send, stop, shutdown, expect_rows),
            self.send_stage(sends, to_settle, &permits, stop),
            self.settle_stage(settles, to_mark, stop),
            self.mark_stage(marks, stop),
        );
        self.reconnect_if_due().await;
        let mut report = TickReport::default();
        let mut first_error: Option<DrainError> = None;
        for (r, errors) in [stages.0, stages.1, stages.2, stages.3] {
            report.absorb(&r);
            for e in errors {
                if first_error.is_none() {
                    first_error = Some(e);
                } else {
                    tracing::warn!(
                        replica = %self.config.replica_id,
                        error = %e,
                        "outbox drain: a further failure while finishing the batches in hand"
                    );
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Claims batch after batch while they come back full, each once a
    /// place in hand is free and the send stage has taken the previous one
    /// (so a claimed batch is handed over at once, one ahead of sending).
    async fn claim_stage<'h>(
        &self,
        hands: &'h Semaphore,
        to_send: mpsc::Sender<(Claimed, SemaphorePermit<'h>)>,
        stop: &AtomicBool,
        shutdown: &watch::Receiver<bool>,
        mut expect_rows: bool,
    ) -> Stage {
        let mut report = TickReport::default();
        let stopped = || stop.load(Ordering::Relaxed) || *shutdown.borrow();
        loop {
            if stopped() {
                break;
            }
            let Ok(hand) = hands.acquire().await else {
                break;
            };
            let Ok(slot) = to_send.reserve().await else {
                break;
            };
            if stopped() || !self.pace(shutdown).await || stopped() {
                break;
            }
            let claimed = match self.claim(&mut report, expect_rows).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    return (report, vec![e]);
                }
            };
            let full = claimed.rows.len() >= self.config.batch_size as usize;
            if claimed.rows.is_empty() {
                break;
            }
            if stop.load(Ordering::Relaxed) {
                // Another stage failed while this claim ran: hand it back.
                self.marks.hit(Mark::ReleasedBesideFailure);
                claimed.span.record("outbox.outcome", "released");
                self.release_all(&claimed.rows).await;
                break;
            }
            slot.send((claimed, hand));
            if !full {
                break;
            }
            expect_rows = true;
        }
        (report, Vec::new())
    }

    /// Publishes each batch in claim order; after a failure, releases what
    /// is not yet published.
    async fn send_stage<'p, 'h>(
        &self,
        mut sends: mpsc::Receiver<(Claimed, SemaphorePermit<'h>)>,
        to_settle: mpsc::UnboundedSender<(Sending<'p, B::Channel>, SemaphorePermit<'h>)>,
        permits: &'p Semaphore,
        stop: &AtomicBool,
    ) -> Stage {
        let (mut report, mut errors) = (TickReport::default(), Vec::new());
        while let Some((claimed, hand)) = sends.recv().await {
            if stop.load(Ordering::Relaxed) {
                self.marks.hit(Mark::ReleasedBesideFailure);
                claimed.span.record("outbox.outcome", "released");
                self.release_all(&claimed.rows).await;
                continue;
            }
            let t = self.clock.now();
            match self.send(claimed, permits).await {
                Ok(sending) => {
                    report.publish_time += self.clock.now().saturating_sub(t);
                    let _ = to_settle.send((sending, hand));
                }
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    errors.push(e);
                }
            }
        }
        (report, errors)
    }

    /// Awaits each published batch's last confirms within its deadline.
    async fn settle_stage<'p, 'h>(
        &self,
        mut settles: mpsc::UnboundedReceiver<(Sending<'p, B::Channel>, SemaphorePermit<'h>)>,
        to_mark: mpsc::UnboundedSender<(Vec<ClaimedRow>, BatchOutcome, Span, SemaphorePermit<'h>)>,
        stop: &AtomicBool,
    ) -> Stage {
        let (mut report, mut errors) = (TickReport::default(), Vec::new());
        while let Some((sending, hand)) = settles.recv().await {
            let t = self.clock.now();
            let span = sending.span.clone();
            match self.settle(sending).await {
                Ok((rows, outcome)) => {
                    report.publish_time += self.clock.now().saturating_sub(t);
                    let _ = to_mark.send((rows, outcome, span, hand));
                }
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    errors.push(e);
                }
            }
        }
        (report, errors)
    }

    /// Marks each settled batch; its place in hand frees after the mark.
    async fn mark_stage(
        &self,
        mut marks: mpsc::UnboundedReceiver<(
            Vec<ClaimedRow>,
            BatchOutcome,
            Span,
            SemaphorePermit<'_>,
        )>,
        stop: &AtomicBool,
    ) -> Stage {
        let (mut report, mut errors) = (TickReport::default(), Vec::new());
        while let Some((rows, outcome, span, hand)) = marks.recv().await {
            if let Err(e) = self.mark(&rows, outcome, &mut report, &span).await {
                stop.store(true, Ordering::Relaxed);
                errors.push(e);
            }
            drop(hand);
        }
        (report, errors)
    }

    /// With `max_rows_per_sec`, waits until the next claim may start;
    /// false if `shutdown` turned true meanwhile.
    async fn pace(&self, shutdown: &watch::Receiver<bool>) -> bool {
        let wait = self.pace_wait();
        if wait.is_zero() {
            return true;
        }
        self.marks.hit(Mark::Paced);
        !sleep_or_shutdown(&*self.clock, wait, &mut shutdown.clone()).await
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
    async fn claim(
        &self,
        report: &mut TickReport,
        expect_rows: bool,
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
        let t0 = self.clock.now();
        let rows = self.claim_rows().instrument(claim_span.clone()).await;
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
        Ok(Claimed { rows, at: t0, span })
    }

    /// The claim's statements: the next window of key heads, then the
    /// claim of unkeyed rows and of those heads; moves the key cursor.
    async fn claim_rows(&self) -> Result<Vec<ClaimedRow>, StoreError> {
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
    fn batch_span(&self) -> Span {
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
    async fn settle(
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

    /// Phase 3: marks the confirmed rows published and records the failures,
    /// both guarded by `claimed_by`.
    async fn mark(
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
    async fn release_refused(
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
    async fn mark_published(
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
    async fn mark_failed(
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
    fn phase2_result<T>(
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
    async fn phase2_failed(
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

    async fn release_all(&self, rows: &[ClaimedRow]) {
        if rows.is_empty() {
            return;
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        self.release_ids(&ids).await;
    }

    /// Releases the claims on `ids` (attempts untouched); one that cannot
    /// be released is reclaimed when its lease expires.
    async fn release_ids(&self, ids: &[Uuid]) {
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

    /// Replaces the connection a Phase-2 failure implicated, if one did.
    async fn reconnect_if_due(&self) {
        let due = self.reconnect_due.swap(0, Ordering::Relaxed);
        let Some(generation) = due.checked_sub(1) else {
            return;
        };
        let span = tracing::info_span!(
            "outbox.reconnect",
            outbox.replica = %self.config.replica_id,
            messaging.system = "rabbitmq",
        );
        let reconnected = self
            .broker
            .connection_reconnect(generation)
            .instrument(span)
            .await;
        if let Err(e) = reconnected {
            self.marks.hit(Mark::ReconnectFailed);
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
        let mut idle = false;
        // A commit woke the drainer: its first claim expects rows.
        let mut woken = false;
        tracing::info!(replica = %cfg.replica_id, exchange = %cfg.exchange, "outbox drainer started");
        loop {
            if *shutdown.borrow() {
                break;
            }
            let mut wakeable = true;
            // `drain` returns once a claim comes back short of a full batch:
            // the backlog is drained, so the next claim waits a tick. Not
            // after keyed rows: a key's next event becomes claimable only
            // once its head is marked (inside the drain), so a short claim
            // of heads does not mean the keys are done; drain again at once
            // (a drain that claims no keyed row ends this).
            let delay = match self.drain_expecting(&shutdown, woken).await {
                Ok(report) => {
                    consecutive_errors = 0;
                    if report.claimed > 0 {
                        last_busy = Some(self.clock.now());
                    }
                    let steady = last_busy
                        .is_none_or(|t| self.clock.now().saturating_sub(t) >= STEADY_AFTER);
                    if steady && !idle {
                        self.marks.hit(Mark::IdleTick);
                    }
                    idle = steady;
                    if report.keyed_claimed > 0 {
                        Duration::ZERO
                    } else if steady {
                        idle_tick
                    } else {
                        cfg.tick
                    }
                }
                Err(e) => {
                    self.marks.hit(Mark::DrainFailed);
                    idle = false;
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
            woken = false;
            let stop = match self.wakeup.as_ref().filter(|_| wakeable) {
                Some(wakeup) if !delay.is_zero() => {
                    tokio::select! {
                        biased;
                        stop = sleep_or_shutdown(&*self.clock, delay, &mut shutdown) => stop,
                        () = wakeup.notified() => {
                            self.marks.hit(Mark::WokenByCommit);
                            woken = true;
                            // Let the commits that follow this one join its
                            // claim (`wakeup_linger`); their notifications
                            // meanwhile leave one wakeup for the next round.
                            !cfg.wakeup_linger.is_zero()
                                && sleep_or_shutdown(&*self.clock, cfg.wakeup_linger, &mut shutdown).await
                        }
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

/// Rows from one claim and the clock time the claim was sent, where the
/// batch's deadline starts: the database stamped the lease no earlier, so a
/// deadline counted from here ends before the lease does (`confirm_timeout
/// < lease_ttl`), however long the claim's reply took to come back.
struct Claimed {
    rows: Vec<ClaimedRow>,
    at: Duration,
    /// The batch's span, parent of its phases' spans.
    span: Span,
}

/// Unconfirmed publishes of one batch, oldest first, each holding a permit.
type Pending<'p, Ch> = VecDeque<(Uuid, <Ch as PublishChannel>::Confirm, SemaphorePermit<'p>)>;

/// A batch between its last publish and its last confirm.
struct Sending<'p, Ch: PublishChannel> {
    rows: Vec<ClaimedRow>,
    channel: Ch,
    pending: Pending<'p, Ch>,
    outcome: BatchOutcome,
    /// Clock time the claim was sent.
    claimed_at: Duration,
    /// Clock time by which the last confirm must be in.
    deadline: Duration,
    generation: u64,
    /// The batch's span.
    span: Span,
}

impl TickReport {
    fn absorb(&mut self, other: &TickReport) {
        self.claimed += other.claimed;
        self.keyed_claimed += other.keyed_claimed;
        self.published += other.published;
        self.mark_lost += other.mark_lost;
        self.failed += other.failed;
        self.refused += other.refused;
        self.parked += other.parked;
        self.claim_time += other.claim_time;
        self.publish_time += other.publish_time;
        self.mark_time += other.mark_time;
    }
}

/// The verdicts of one batch: confirmed, failed by the row's own fault
/// (found before any broker I/O), or nacked by the broker (blameless).
#[derive(Debug, Default)]
struct BatchOutcome {
    acked: Vec<Uuid>,
    failed: Vec<RowFailure>,
    refused: Vec<Uuid>,
    /// The first nack's reason, bounded.
    refusal: Option<String>,
}

impl BatchOutcome {
    /// Files one verdict; true if it was a nack.
    fn record(&mut self, id: Uuid, confirm: Confirm) -> bool {
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
    fn a_nack_is_filed_blameless_with_its_first_reason_bounded() {
        let mut outcome = BatchOutcome::default();
        let (a, b, c) = (Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3));
        assert!(!outcome.record(a, Confirm::Ack));
        assert!(outcome.record(b, Confirm::Nack("x".repeat(LAST_ERROR_MAX_CHARS * 2))));
        assert!(outcome.record(c, Confirm::Nack("second".into())));
        assert_eq!(outcome.acked, vec![a]);
        assert_eq!(outcome.refused, vec![b, c]);
        assert!(outcome.failed.is_empty(), "a nack blames no row");
        let reason = outcome.refusal.unwrap();
        assert!(reason.starts_with('x'), "{reason}");
        assert_eq!(reason.chars().count(), LAST_ERROR_MAX_CHARS);
    }
}
