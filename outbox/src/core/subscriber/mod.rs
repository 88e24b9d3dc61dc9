//! The subscriber: the consumer half of ADR-018 (amendment #433), exactly
//! once in effect over an at-least-once broker.
//!
//! A worker takes a delivery and whatever else arrives within
//! `batch_linger` (up to `batch_max`), then applies them in one transaction:
//! 1. BEGIN; per delivery, in event-id order (so two batches never wait on
//!    each other's inbox rows in a cycle): `inbox_try_insert` →
//!    [`InsertOutcome`](crate::core::ports::InsertOutcome).
//! 2. `AlreadyProcessed`: the handler does not run; the delivery is acked
//!    after the commit.
//! 3. Otherwise the handler runs with the transaction. Ok: mark processed
//!    (a row the insert created carries the mark from the start, so only a
//!    retried row needs the statement).
//! 4. COMMIT; only then each delivery is acked.
//!
//! That first pass sets no savepoints: handlers nearly always succeed, and
//! a savepoint is one more round trip per delivery. If a handler fails, the
//! pass rolls back whole (as the ADR's step 4 does) and runs again with a
//! savepoint after each delivery's `inbox_try_insert`
//! (`inbox_savepoint`): the failed delivery's handler does not run again, its
//! failure is recorded (`inbox_record_failure`: roll back to its savepoint,
//! keeping the row and its lock, and count the attempt in the same
//! transaction, so the count takes effect with the commit, as the ADR's
//! separate connection meant it to, and a retry after a lost reply cannot
//! count one failure twice); another handler that fails in that pass rolls
//! back only its own savepoint and is recorded the same way. That rerun
//! holds only the deliveries the failed pass reached: those whose handlers
//! ran clean before the failure run again without savepoints (a failure is
//! nearly always one delivery's), and the deliveries after the failure,
//! which never ran, wait for it and then go in an optimistic pass of their
//! own. A failure thus costs the deliveries before it one more run, not the
//! whole batch a savepoint pass (P9f in the harness: a savepoint and a check
//! per delivery make a pass about 0.65x as fast). One failure, one recorded
//! attempt. After the commit, each failed delivery is nacked
//! with requeue while attempts < budget, else without requeue: the broker
//! moves it to `<queue>.dlq`.
//!
//! A batch of one is the ADR's sequence; a batch shares one commit (one
//! fsync) among its deliveries.
//!
//! A delivery that is over the size limit, is not a valid envelope, or holds
//! data the inbox refuses to store (a `\u0000` or a lone surrogate in a
//! `jsonb` string, a number beyond `jsonb`'s range) goes to the dead-letter
//! queue at once and is never retried in place. Database trouble is nobody's
//! fault, whether the inbox or the handler's own statements meet it: the
//! delivery is retried in place with a backoff (no attempt is counted) until
//! the database answers or the subscriber shuts down (then it is requeued);
//! a handler that overran its deadline is asked about too: if the database
//! does not answer a ping it was the database's stall, and if it does, the
//! handler still runs once more before its overrun is blamed (its
//! statements may have waited on a stall that ended just as it overran);
//! the whole batch rolls back and is retried, and a delivery whose data the
//! inbox refused leaves the batch, which runs again without it.
//! Broker trouble ends the consumer; the subscriber reopens it with a
//! backoff, and the broker redelivers whatever was unacknowledged; the inbox
//! absorbs the duplicates.
//!
//! An ordered subscription ([`SubscriberSettings::ordered`])
//! applies one ordering key's events in the order they committed: one
//! worker per partition queue, each the single active consumer of its
//! partition across replicas; a batch in rounds of one delivery per key;
//! and the inbox, under the key's lock, deferring a delivery behind an
//! earlier event of its key that waits for a retry
//! ([`DeliveryOutcome::Deferred`]) and holding one behind a dead-lettered
//! event ([`DeliveryOutcome::Held`]) until that event is replayed or
//! skipped ([`Subscriber::skip`]), which releases the key's held rows in
//! order.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::durability::DurableStandbys;
use super::marks::Marks;
use super::ports::{
    Clock, ConsumerBroker, InboxCounts, InboxFilter, InboxRow, InboxStore, SubscriptionSpec,
};
use crate::envelope::EventEnvelope;
use crate::error::{HandlerError, StoreError};

/// Longest pause between retries of database or broker trouble.
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// First pause after database or broker trouble.
pub const RETRY_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Bound on closing a consumer at shutdown or after it ended.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an ordered subscription looks for held rows nothing holds
/// back any more, and releases them (see [`InboxStore::inbox_releasable`]).
pub const RELEASE_EVERY: Duration = Duration::from_secs(2);

/// Applies one event inside the subscriber's transaction.
///
/// The transaction also holds the event's inbox row: commit happens only
/// after the handler returned `Ok`, so the handler's writes and the
/// "processed" mark commit together or not at all. A handler must not commit
/// or roll back the transaction itself, and should keep its effects inside
/// it (anything else, an HTTP call say, may be repeated on retry).
pub trait Handler<Tx>: Send + Sync + 'static {
    /// Applies `event`; an `Err` rolls everything back and counts an attempt.
    fn handle(
        &self,
        tx: &mut Tx,
        event: &EventEnvelope,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// How one subscription behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberSettings {
    /// Queue, exchange, bindings, prefetch (the subscriber's total,
    /// shared evenly by its workers: see [`worker_spec`](Self::worker_spec)).
    pub spec: SubscriptionSpec,
    /// Workers, each on a channel of its own applying one batch of
    /// deliveries at a time.
    pub concurrency: u32,
    /// Failed attempts after which a delivery is dead-lettered.
    pub max_attempts: u32,
    /// Largest delivery body handled, in bytes; a larger one is
    /// dead-lettered at once.
    pub max_body_bytes: u32,
    /// Longest the handler may run on one delivery: past it the handler's
    /// work is rolled back. The overrun counts as a failed attempt when it
    /// repeats on the run right after, with the database answering
    /// promptly all along (else it was the database's stall: retried in
    /// place, no attempt), so a hung handler spends two deadlines per
    /// attempt.
    pub handler_timeout: Duration,
    /// Deliveries a worker applies in one transaction (one commit, one
    /// fsync). The first pass sets no savepoints; after a handler failure
    /// the deliveries it reached run again with a savepoint each, so a
    /// failed handler rolls back only its own work (see the module docs).
    pub batch_max: u32,
    /// Longest a batch's first delivery waits for more to arrive; zero
    /// takes only those already waiting.
    pub batch_linger: Duration,
}
/// The subscriber: the production code in production and in the simulation.
pub struct Subscriber<S, B, C, H> {
    store: Arc<S>,
    broker: Arc<B>,
    clock: Arc<C>,
    handler: Arc<H>,
    settings: SubscriberSettings,
    counters: Arc<SubscriberCounters>,
    /// Coverage marks (none in production).
    marks: Marks,
    /// Where `run` stands, for readiness.
    health: health::Health,
    /// The standbys a batch's acks wait for.
    durable: Option<Arc<DurableStandbys>>,
}

impl<S, B, C, H> std::fmt::Debug for Subscriber<S, B, C, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<S, B, C, H> Subscriber<S, B, C, H>
where
    S: InboxStore,
    B: ConsumerBroker,
    C: Clock,
    H: Handler<S::HandlerTx>,
{
    /// Builds a subscriber from its ports, its handler and its settings.
    pub fn new(
        store: Arc<S>,
        broker: Arc<B>,
        clock: Arc<C>,
        handler: Arc<H>,
        settings: SubscriberSettings,
    ) -> Self {
        Self {
            store,
            broker,
            clock,
            handler,
            settings,
            counters: Arc::default(),
            marks: Marks::default(),
            health: health::Health::default(),
            durable: None,
        }
    }

    /// Acks a batch only once `standbys` have flushed its commit
    /// (replicated before acked; see [`durability`](crate::core::durability)).
    pub fn with_durable_standbys(mut self, standbys: Arc<DurableStandbys>) -> Self {
        self.durable = Some(standbys);
        self
    }

    /// Reports the paths it takes to `marks` (the simulation's coverage).
    pub fn with_marks(mut self, marks: Marks) -> Self {
        self.marks = marks;
        self
    }

    /// The settings.
    pub fn settings(&self) -> &SubscriberSettings {
        &self.settings
    }

    /// Lists unprocessed rows matching `filter` (the operator's view of what
    /// is dead-lettered or still retried).
    pub async fn list_unprocessed(
        &self,
        filter: &InboxFilter,
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.store.inbox_list_unprocessed(filter).await
    }

    /// How its subscription's inbox stands: rows processed within
    /// `window`, retried and dead-lettered, each counted up to `cap` (every
    /// replica's, from the database).
    pub async fn inbox_counts(
        &self,
        window: Duration,
        cap: u32,
    ) -> Result<InboxCounts, StoreError> {
        let queue = &self.settings.spec.queue;
        self.store.inbox_counts(queue, window, cap).await
    }

    /// Its counters (shared; they keep counting).
    pub fn counters(&self) -> Arc<SubscriberCounters> {
        self.counters.clone()
    }

    /// Where its [`run`](Self::run) stands.
    pub fn state(&self) -> SubscriptionState {
        self.health.state()
    }

    /// Why it is not ready, if it is not (see [`NOT_CONSUMING_GRACE`]):
    /// empty while it consumes, and for a subscriber that was never run
    /// (it serves replays only). The admin router's `/readyz` includes every
    /// subscriber it serves.
    pub fn readiness_reasons(&self) -> Vec<crate::core::stats::UnreadyReason> {
        self.health
            .reasons(&self.settings.spec.queue, self.clock.now())
    }

    /// Moves its state to `state`, now.
    pub(super) fn set_state(&self, state: SubscriptionState) {
        self.health.set(state, self.clock.now());
    }
}

mod apply;
mod consume;
mod escalation;
mod given_up;
mod health;
mod outcome;
mod replay;
mod supervise;

pub use health::{
    NOT_CONSUMING_GRACE, RETRY_IN_PLACE_GRACE, RETRY_IN_PLACE_LOG_EVERY, SubscriptionState,
};
pub use outcome::{DeliveryOutcome, SubscriberCounters, SubscriberStats};
pub use replay::{REPLAY_PAGE, ReplayOutcome, ReplayPage};
pub use supervise::PROBE_DIVISOR;
