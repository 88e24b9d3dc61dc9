//! A tick and a drain: the claim, send, settle and mark stages, overlapped
//! up to the batches in hand, and the pacing between batches.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit, mpsc, watch};
use tracing::Span;

use super::Walk;
use super::claim::Claimed;
use super::publish::{BatchOutcome, Sending};
use super::{BATCHES_IN_HAND_MAX, Drainer, Stage, TickReport};
use crate::core::marks::Mark;
use crate::core::ports::{Broker, ClaimedRow, Clock, Entropy, OutboxStore};
use crate::core::sleep_or_shutdown;
use crate::error::DrainError;

impl<S: OutboxStore, B: Broker, C: Clock, E: Entropy> Drainer<S, B, C, E> {
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
        let claimed = self.claim(&mut report, true, None, &|| false).await?;
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
    pub(super) async fn drain_expecting(
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
    /// Each full claim's successor walks on from where it stopped
    /// ([`Walk`]).
    pub(super) async fn claim_stage<'h>(
        &self,
        hands: &'h Semaphore,
        to_send: mpsc::Sender<(Claimed, SemaphorePermit<'h>)>,
        stop: &AtomicBool,
        shutdown: &watch::Receiver<bool>,
        mut expect_rows: bool,
    ) -> Stage {
        let mut report = TickReport::default();
        let stopped = || stop.load(Ordering::Relaxed) || *shutdown.borrow();
        let mut walk = Walk::default();
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
            let claimed = match self
                .claim(&mut report, expect_rows, walk.after(), &stopped)
                .await
            {
                Ok(claimed) => claimed,
                Err(e) => {
                    // A claim that failed because another stage had, or
                    // shutdown came (its batch no longer waited for the
                    // standbys), leaves the drain that stage's error.
                    let follows = stop.swap(true, Ordering::Relaxed) || *shutdown.borrow();
                    return (report, if follows { Vec::new() } else { vec![e] });
                }
            };
            let full = claimed.rows.len() >= self.config.batch_size as usize;
            walk.next(&claimed.rows, full);
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
    pub(super) async fn send_stage<'p, 'h>(
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
    pub(super) async fn settle_stage<'p, 'h>(
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
    pub(super) async fn mark_stage(
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
    pub(super) async fn pace(&self, shutdown: &watch::Receiver<bool>) -> bool {
        let wait = self.pace_wait();
        if wait.is_zero() {
            return true;
        }
        self.marks.hit(Mark::Paced);
        !sleep_or_shutdown(&*self.clock, wait, &mut shutdown.clone()).await
    }

    /// How long until the next claim may start (zero without a bound).
    pub(super) fn pace_wait(&self) -> Duration {
        if self.config.max_rows_per_sec.is_none() {
            return Duration::ZERO;
        }
        let at = Duration::from_nanos(self.next_claim_at.load(Ordering::Relaxed));
        at.saturating_sub(self.clock.now())
    }
}
