//! The simulated subscriber's handler: one domain effect per event, written
//! in the handler's transaction (so the fake counts committed effects), with
//! seeded transient failures and a "downstream broken" switch that makes
//! every event of a poison routing key fail until it is turned off. Its
//! own database errors go back with `?`, as a service's handler's would:
//! the production conversion decides whether they count an attempt.
//!
//! A transient failure comes in the four shapes a real handler fails in:
//! an `Err`, a panic, a stall past the subscriber's handler deadline, or an
//! error of its own statement that it swallows (a "best effort" write that
//! fails, logged and ignored) before returning `Ok`, which leaves its
//! transaction aborted: PostgreSQL then answers the COMMIT with a rollback.
//! An `Err`, a panic or a swallowed error fails the event's first run; a
//! stall its first two (the subscriber blames an overrun only when it
//! repeats).
//!
//! Two more ways its transaction cannot commit come from the domain table
//! (`fakes::pg::inbox`): events whose routing key starts with `unique.`
//! (`trigger.`) write that key under a deferred unique constraint (a
//! deferred constraint trigger), so only the first of them to commit can; and while another session holds the table
//! locked (the `DomainLock` fault) every effect waits, past the handler's
//! deadline.
//!
//! It records when each run begins and ends (`HandlerStarted`,
//! `HandlerEnded`: returned or dropped), and what it came to
//! (`HandlerRan`, before a panic
//! or a stall, and when the subscriber drops a run that waits on the
//! locked domain table): the checker's budget rules count attempts against
//! these.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use outbox::core::subscriber::Handler;
use outbox::{EventEnvelope, HandlerError};

use crate::adapters::{Hooks, Point, SimTx};
use crate::trace::{Event, HandlerResult, Trace};

/// What the handler's deliberate panics say (see [`quiet_handler_panics`]).
pub const PANIC_MESSAGE: &str = "simulated handler panic on";

/// Keeps the handler's deliberate panics out of the output (the subscriber
/// catches them; a sweep would print thousands); any other panic still
/// reaches the hook installed before.
pub fn quiet_handler_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !text.starts_with(PANIC_MESSAGE) {
                previous(info);
            }
        }));
    });
}

/// Routing-key prefix of events the broken downstream refuses.
pub const POISON_PREFIX: &str = "poison.";
/// Routing-key prefix of events whose effect writes the routing key under
/// the domain table's deferred unique constraint.
pub const UNIQUE_PREFIX: &str = "unique.";
/// Routing-key prefix of events whose effect writes the routing key under
/// the domain table's deferred constraint trigger (which waits for no
/// other writer).
pub const TRIGGER_PREFIX: &str = "trigger.";

/// The handler of one simulated subscription.
pub struct SimHandler {
    subscription: String,
    /// Events whose first run fails (one in `transient_one_in`, by id;
    /// the first two if the failure is a stall).
    transient_one_in: u64,
    /// How many runs of each event failed on purpose.
    failed: Mutex<BTreeMap<uuid::Uuid, u32>>,
    /// While set, events with a poison routing key fail every attempt.
    pub downstream_broken: Arc<AtomicBool>,
    /// While set, another session holds the domain table locked.
    pub domain_locked: Arc<AtomicBool>,
    hooks: Hooks,
    trace: Trace,
    who: String,
}

impl SimHandler {
    /// A handler for `subscription`; `transient_one_in == 0` disables
    /// transient failures.
    pub fn new(subscription: impl Into<String>, transient_one_in: u64) -> Self {
        Self {
            subscription: subscription.into(),
            transient_one_in,
            failed: Mutex::default(),
            downstream_broken: Arc::new(AtomicBool::new(false)),
            domain_locked: Arc::new(AtomicBool::new(false)),
            hooks: Hooks::default(),
            trace: Trace::default(),
            who: String::new(),
        }
    }

    /// Shares the world's "downstream broken" switch.
    pub fn with_downstream(mut self, broken: Arc<AtomicBool>) -> Self {
        self.downstream_broken = broken;
        self
    }

    /// Shares the world's "domain table locked" switch.
    pub fn with_domain_lock(mut self, locked: Arc<AtomicBool>) -> Self {
        self.domain_locked = locked;
        self
    }

    /// Crash and pause points (`MidHandler`) of consumer `who`.
    pub fn with_hooks(mut self, hooks: Hooks, who: impl Into<String>, trace: Trace) -> Self {
        self.hooks = hooks;
        self.who = who.into();
        self.trace = trace;
        self
    }
}

impl Handler<SimTx> for SimHandler {
    async fn handle(&self, tx: &mut SimTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        self.trace.now(Event::HandlerStarted {
            client: self.who.clone(),
            event_id: event.id,
            session: tx.session(),
        });
        let _run = Running {
            handler: self,
            event,
        };
        let recorded = AtomicBool::new(false);
        let result = self.apply(tx, event, &recorded).await;
        if !recorded.load(Ordering::SeqCst) {
            self.ran(
                event,
                match &result {
                    Ok(()) => HandlerResult::Ok,
                    Err(e) if e.is_unavailable() => HandlerResult::Unavailable,
                    Err(_) => HandlerResult::Failed,
                },
            );
        }
        result
    }
}

impl SimHandler {
    /// Records a run and what it came to.
    fn ran(&self, event: &EventEnvelope, result: HandlerResult) {
        self.trace.now(Event::HandlerRan {
            client: self.who.clone(),
            event_id: event.id,
            result,
        });
    }

    /// One run; sets `recorded` if it recorded what the run came to itself.
    async fn apply(
        &self,
        tx: &mut SimTx,
        event: &EventEnvelope,
        recorded: &AtomicBool,
    ) -> Result<(), HandlerError> {
        if event.routing_key.starts_with(POISON_PREFIX)
            && self.downstream_broken.load(Ordering::SeqCst)
        {
            return Err(HandlerError::msg("downstream refuses poison events"));
        }
        // Deterministic in the event id (a v7 id's low bits are seeded):
        // whether it fails, and how (`shape`: an `Err`, a panic, a stall,
        // a swallowed error).
        let low = event.id.as_u64_pair().1;
        let shape = low.checked_div(self.transient_one_in).unwrap_or(0) % 4;
        let transient = self.transient_one_in > 0 && low.is_multiple_of(self.transient_one_in) && {
            let mut failed = self.failed.lock().expect("lock");
            let n = failed.entry(event.id).or_insert(0);
            let failing_runs = if shape == 2 { 2 } else { 1 };
            *n += 1;
            *n <= failing_runs
        };
        let keyed = [UNIQUE_PREFIX, TRIGGER_PREFIX];
        let unique_key = keyed
            .iter()
            .any(|p| event.routing_key.starts_with(p))
            .then(|| event.routing_key.clone());
        let mut waits = LockedOut {
            handler: self,
            event,
            armed: true,
        };
        let written = tx.effect(&self.subscription, event.id, unique_key).await;
        waits.armed = false;
        written?;
        self.hooks
            .at(Point::MidHandler, &self.who, &self.trace)
            .await;
        if transient {
            // The four ways a handler fails, by the id's next bits: an
            // `Err`, a panic, a stall past the subscriber's deadline, or a
            // failed statement whose error it swallows.
            let failure = Err(HandlerError::msg("transient failure after the effect"));
            match shape {
                0 => return failure,
                1 => {
                    self.ran(event, HandlerResult::Failed);
                    panic!("{PANIC_MESSAGE} {}", event.id);
                }
                2 => {
                    self.ran(event, HandlerResult::Overran);
                    std::future::pending::<()>().await;
                }
                _ => {
                    // A "best effort" statement fails (division by zero);
                    // the handler logs it and carries on: its transaction
                    // is aborted, and its `Ok` cannot commit.
                    let best_effort = tx
                        .call(crate::wire::PgRequest::Raise {
                            code: "22012".into(),
                        })
                        .await;
                    if best_effort.is_err() {
                        self.ran(event, HandlerResult::Failed);
                        recorded.store(true, Ordering::SeqCst);
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }
}

/// A run of the handler, from its call to its end: returned, or dropped by
/// the subscriber (`HandlerEnded` either way).
struct Running<'a> {
    handler: &'a SimHandler,
    event: &'a EventEnvelope,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.handler.trace.now(Event::HandlerEnded {
            client: self.handler.who.clone(),
            event_id: self.event.id,
        });
    }
}

/// A run waiting for its effect's write: dropped armed (the subscriber
/// gave up on it at its deadline) while another session holds the domain
/// table locked, the run failed on that lock, which is the handler's own
/// business (the database answered all along).
struct LockedOut<'a> {
    handler: &'a SimHandler,
    event: &'a EventEnvelope,
    armed: bool,
}

impl Drop for LockedOut<'_> {
    fn drop(&mut self) {
        if self.armed && self.handler.domain_locked.load(Ordering::SeqCst) {
            self.handler.ran(self.event, HandlerResult::Overran);
        }
    }
}
