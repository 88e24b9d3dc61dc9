//! One handler run, supervised: its panic caught, its deadline kept, the
//! database pinged to tell a stalled database from a hung handler.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use super::apply::{Abort, cannot_commit, storable};
use super::consume::Item;
use super::escalation::Pass;
use super::{Handler, Subscriber};
use crate::core::drainer::LAST_ERROR_MAX_CHARS;
use crate::core::marks::Mark;
use crate::core::ports::{Clock, ConsumerBroker, InboxStore};
use crate::core::{truncate_chars, with_deadline};
use crate::envelope::EventEnvelope;
use crate::error::{HandlerError, StoreError};
use crate::telemetry::subscriber as metric;

/// A watched handler run pings the database every `deadline /
/// (2 × PROBE_DIVISOR)`; one ping slower than `deadline / PROBE_DIVISOR`
/// means the database stalled during the run.
pub const PROBE_DIVISOR: u32 = 10;

/// A handler's failure, and whether its future was dropped mid-run (a
/// deadline, a panic), so a statement of it may still run at the server.
pub(super) struct HandlerFailure {
    pub(super) error: HandlerError,
    pub(super) abandoned: bool,
}

/// Polls a future, turning a panic inside it into `Err` with the panic's
/// message. It is not polled again after a panic.
pub(super) struct CatchUnwind<F>(pub(super) Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fut = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(payload) => Poll::Ready(Err(panic_message(payload.as_ref()))),
        }
    }
}

/// The text a panic was raised with, bounded.
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    truncate_chars(text, LAST_ERROR_MAX_CHARS)
}

impl<S, B, C, H> Subscriber<S, B, C, H>
where
    S: InboxStore,
    B: ConsumerBroker,
    C: Clock,
    H: Handler<S::HandlerTx>,
{
    /// Runs one item's handler: `None` if its work stands; the failure to
    /// record (with savepoints) if the handler failed or, with savepoints,
    /// if its work cannot commit; an `Abort` for what ends the transaction
    /// (database trouble, a handler given up on, any handler failure in an
    /// optimistic pass).
    pub(super) async fn handle_one(
        &self,
        tx: &mut S::Tx,
        item: &Item<'_>,
        pass: Pass<'_>,
    ) -> Result<Option<String>, Abort> {
        let savepoints = matches!(pass, Pass::Savepoints { .. });
        let failure = match self.run_handler(tx, item.envelope, &item.overran).await {
            Ok(()) if !savepoints => return Ok(None),
            // Found by delivery: can what its handler wrote commit?
            Ok(()) => return self.check_own_work(tx, item).await,
            Err(f) => f,
        };
        let HandlerFailure { error, abandoned } = failure;
        if error.is_unavailable() {
            // The handler's database is unavailable (or the overrun was its
            // stall): nobody's fault, no attempt counts; retried in place
            // like the inbox's own.
            self.marks.hit(Mark::HandlerUnavailable);
            let e = StoreError::Unavailable(error.message().to_owned());
            return Err(if abandoned {
                Abort::Abandoned { failure: None, e }
            } else {
                Abort::Store(e)
            });
        }
        self.marks.hit(Mark::HandlerFailed);
        tracing::debug!(event_id = %item.entry.event_id, error = %error, "handler failed");
        let text = storable(error.message());
        if abandoned {
            // Its statement may still run at the server: the transaction
            // ends there, and the failure is recorded in the next one.
            return Err(Abort::Abandoned {
                failure: Some(text),
                e: StoreError::Unavailable("handler given up on".into()),
            });
        }
        match pass {
            Pass::Optimistic => Err(Abort::Handler(text)),
            Pass::Savepoints { .. } => Ok(Some(text)),
        }
    }

    /// After a handler's `Ok`, with savepoints: `None` if the transaction
    /// can still commit; the failure to record if it cannot because of
    /// this delivery's work. A check that fails once that work is undone
    /// blames work before it (a constraint trigger, which waits for no
    /// other writer, can fail on an earlier delivery's row that another
    /// transaction's commit made a duplicate since its check): the
    /// transaction cannot commit for a reason of another delivery's, found
    /// by running each alone.
    pub(super) async fn check_own_work(
        &self,
        tx: &mut S::Tx,
        item: &Item<'_>,
    ) -> Result<Option<String>, Abort> {
        let e = match self.store.inbox_check(tx).await {
            Ok(()) => return Ok(None),
            Err(e) if e.is_unavailable() => return Err(Abort::Store(e)),
            Err(e) => e,
        };
        self.store.inbox_undo_handler(tx).await?;
        if let Err(again) = self.store.inbox_check(tx).await {
            return Err(Abort::Store(again));
        }
        self.marks.hit(Mark::HandlerTxCannotCommit);
        tracing::debug!(event_id = %item.entry.event_id, error = %e,
            "the handler returned Ok but its work cannot commit");
        Ok(Some(cannot_commit(&e)))
    }

    /// Runs the handler under its deadline with a panic caught: a handler
    /// that panics or overruns has failed, like one that returns `Err`, so
    /// its work is rolled back and the attempt counts (a poison event thus
    /// reaches the dead-letter queue instead of taking every worker down);
    /// either leaves the transaction with a statement perhaps still
    /// running (`abandoned`). A panic is only caught where panics unwind
    /// (not under `panic = "abort"`). An overrun is the handler's only when
    /// the database answers a ping at its deadline and the delivery's
    /// handler has overrun so once already (`overran`, set by the first,
    /// which is retried in place like database trouble).
    pub(super) async fn run_handler(
        &self,
        tx: &mut S::Tx,
        envelope: &EventEnvelope,
        overran: &AtomicBool,
    ) -> Result<(), HandlerFailure> {
        let limit = self.settings.handler_timeout;
        let guarded = CatchUnwind(Box::pin(self.handler.handle(S::handler_tx(tx), envelope)));
        let started = self.clock.now();
        // A run after an overrun is watched: the database is pinged all
        // along (every half of `probe`), and one ping slower than `probe`
        // means the run met a stall.
        let watched = overran.load(Ordering::Relaxed);
        let stalled = AtomicBool::new(false);
        let probe = limit / PROBE_DIVISOR;
        let ran = if watched {
            tokio::select! {
                biased;
                ran = with_deadline(&*self.clock, limit, guarded) => ran,
                never = self.watch_database(probe, &stalled) => match never {},
            }
        } else {
            with_deadline(&*self.clock, limit, guarded).await
        };
        metrics::histogram!(
            metric::HANDLER_DURATION,
            metric::LABEL => self.settings.spec.queue.clone()
        )
        .record(self.clock.now().saturating_sub(started).as_secs_f64());
        let abandoned = |error| HandlerFailure {
            error,
            abandoned: true,
        };
        match ran {
            Some(Ok(result)) => result.map_err(|error| HandlerFailure {
                error,
                abandoned: false,
            }),
            Some(Err(panic)) => {
                self.marks.hit(Mark::HandlerPanicked);
                Err(abandoned(HandlerError::msg(format!(
                    "handler panicked: {panic}"
                ))))
            }
            None => Err(abandoned(self.overrun(overran, &stalled, probe).await)),
        }
    }

    /// Why a handler ran past its deadline, as far as the database can
    /// tell: a handler whose own statements waited on a database that does
    /// not answer overran through no fault of its own, so the database is
    /// asked (on a connection of its own, within the same limit) before
    /// the handler is blamed.
    pub(super) async fn overrun(
        &self,
        overran: &AtomicBool,
        stalled: &AtomicBool,
        probe: Duration,
    ) -> HandlerError {
        let limit = self.settings.handler_timeout;
        let ping = with_deadline(&*self.clock, limit, self.store.inbox_ping()).await;
        let deadline = limit.as_secs_f64();
        if stalled.load(Ordering::Relaxed) {
            self.marks.hit(Mark::HandlerStalledOnDatabase);
            return HandlerError::unavailable(format!(
                "handler ran past its deadline of {deadline} s while the database \
                 stalled (a ping took over {} s)",
                probe.as_secs_f64()
            ));
        }
        if !matches!(ping, Some(Ok(()))) {
            self.marks.hit(Mark::HandlerStalledOnDatabase);
            let why = match ping {
                Some(Err(e)) => e.to_string(),
                _ => format!("no answer within {deadline} s"),
            };
            return HandlerError::unavailable(format!(
                "handler ran past its deadline of {deadline} s while the database \
                 did not answer ({why})"
            ));
        }
        if !overran.swap(true, Ordering::Relaxed) {
            // The database answers now, but the handler's own statements
            // may have waited on a stall that ended just as it overran:
            // run it once more, watched, before blaming it. Found by the
            // simulation (slow_database's short stalls: 34 of 40 seeds
            // failed without the second run, 5 of 300 without its watch).
            self.marks.hit(Mark::HandlerOverranOnce);
            return HandlerError::unavailable(format!(
                "handler ran past its deadline of {deadline} s; the database answers \
                 now, so it runs once more before the overrun counts"
            ));
        }
        self.marks.hit(Mark::HandlerTimedOut);
        HandlerError::msg(format!("handler ran past its deadline of {deadline} s"))
    }

    /// Pings the database every half of `probe` (each on a connection of
    /// its own) for as long as it is polled; sets `stalled` when a ping
    /// fails or takes longer than `probe`.
    pub(super) async fn watch_database(
        &self,
        probe: Duration,
        stalled: &AtomicBool,
    ) -> std::convert::Infallible {
        loop {
            let answer = with_deadline(&*self.clock, probe, self.store.inbox_ping()).await;
            if !matches!(answer, Some(Ok(()))) {
                stalled.store(true, Ordering::Relaxed);
            }
            self.clock.sleep(probe / 2).await;
        }
    }
}
