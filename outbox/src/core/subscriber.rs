//! The subscriber: the consumer half of ADR-018 (amendment #433), exactly
//! once in effect over an at-least-once broker.
//!
//! A worker takes a delivery and whatever else arrives within
//! `batch_linger` (up to `batch_max`), then applies them in one transaction:
//! 1. BEGIN; per delivery, in event-id order (so two batches never wait on
//!    each other's inbox rows in a cycle): `inbox_try_insert` →
//!    [`InsertOutcome`].
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
//! An ordered subscription ([`SubscriberSettings::ordered`], issue 27)
//! applies one ordering key's events in the order they committed: one
//! worker per partition queue, each the single active consumer of its
//! partition across replicas; a batch in rounds of one delivery per key;
//! and the inbox, under the key's lock, deferring a delivery behind an
//! earlier event of its key that waits for a retry
//! ([`DeliveryOutcome::Deferred`]) and holding one behind a dead-lettered
//! event ([`DeliveryOutcome::Held`]) until that event is replayed or
//! skipped ([`Subscriber::skip`]), which releases the key's held rows in
//! order.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::watch;
use tracing::{Instrument, Span, field::Empty};

use super::drainer::LAST_ERROR_MAX_CHARS;
use super::marks::{Mark, Marks};
use super::ports::{
    AttemptRecord, Clock, ConsumerBroker, Delivery, DeliverySource, InboxCursor, InboxEntry,
    InboxFilter, InboxRow, InboxStore, InsertOutcome, KeySeq, LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX,
    SubscriptionSpec, TxBounds,
};
use super::{sleep_or_shutdown, truncate_chars, with_deadline};
use crate::envelope::EventEnvelope;
use crate::error::{BrokerError, HandlerError, StoreError, SubscribeError};
use crate::telemetry::{propagation, subscriber as metric};

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
    /// fsync), each after a savepoint of its own.
    pub batch_max: u32,
    /// Longest a batch's first delivery waits for more to arrive; zero
    /// takes only those already waiting.
    pub batch_linger: Duration,
}

/// What happened to one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// The handler's effect committed; acked.
    Processed,
    /// The event had already taken effect; acked without the handler.
    Duplicate,
    /// The handler failed; nacked with requeue for another attempt.
    Retrying {
        /// Failed attempts so far.
        attempts: i32,
    },
    /// The handler failed for the last time; nacked into `<queue>.dlq`.
    DeadLettered {
        /// Failed attempts.
        attempts: i32,
    },
    /// Not an envelope; nacked into `<queue>.dlq` at once.
    Undecodable {
        /// Why it could not be decoded.
        reason: String,
    },
    /// Its body is over `max_body_bytes`; nacked into `<queue>.dlq` at
    /// once.
    TooLarge {
        /// The body's size.
        bytes: usize,
        /// The limit.
        limit: u32,
    },
    /// The inbox refused its data (the database cannot store it); nacked
    /// into `<queue>.dlq` at once.
    Unstorable {
        /// What the database said.
        reason: String,
    },
    /// Shutdown came while the database was unavailable; requeued.
    Requeued,
    /// On an ordered subscription: an earlier event of its ordering key is
    /// dead-lettered (or held itself), so it was recorded held in the
    /// inbox, unhandled, and acked; it is applied when that event is
    /// replayed or skipped.
    Held,
    /// On an ordered subscription: an earlier event of its ordering key is
    /// being retried, so it was requeued behind that one, unhandled, no
    /// attempt counted (it comes back after it: a queue gives requeued
    /// deliveries back in the order they were requeued, before the rest).
    Deferred,
}

impl DeliveryOutcome {
    /// A short name, for the `outbox.inbox.outcome` span attribute.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Retrying { .. } => "retrying",
            Self::DeadLettered { .. } => "dead_lettered",
            Self::Undecodable { .. } => "undecodable",
            Self::TooLarge { .. } => "too_large",
            Self::Unstorable { .. } => "unstorable",
            Self::Requeued => "requeued",
            Self::Deferred => "deferred",
            Self::Held => "held",
        }
    }

    /// Settled with an ack (its effect is in the inbox), not a nack.
    pub fn acks(&self) -> bool {
        matches!(self, Self::Processed | Self::Duplicate | Self::Held)
    }
}

/// Rows a replay reads from the inbox at a time.
pub const REPLAY_PAGE: usize = 100;

/// What a replay did, and where more rows match.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReplayPage {
    /// Each row replayed (or skipped), oldest first, and what it came to.
    pub results: Vec<(uuid::Uuid, ReplayOutcome)>,
    /// On an ordered subscription: the held rows a row that took effect
    /// (or was skipped) released, each replayed in its key's order, and
    /// what it came to; not counted against the limit.
    pub released: Vec<(uuid::Uuid, ReplayOutcome)>,
    /// Where the rest begins (the filter's `after`), if more rows match.
    pub next: Option<InboxCursor>,
}

/// What a replay of one inbox row did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReplayOutcome {
    /// The handler's effect committed.
    Applied,
    /// It had taken effect meanwhile; the handler did not run.
    AlreadyProcessed,
    /// The handler failed again; the failure is recorded on the row.
    Failed {
        /// The handler's error.
        error: String,
    },
    /// The stored payload is not an envelope.
    Undecodable {
        /// Why.
        reason: String,
    },
    /// An earlier event of its ordering key is still unprocessed (on an
    /// ordered subscription): it stays held behind that one; replay or
    /// skip that one first.
    Held,
    /// Skipped by an operator: marked processed without its effect.
    Skipped,
}

/// Counters of one subscriber since it started.
#[derive(Debug, Default)]
pub struct SubscriberCounters {
    /// Deliveries whose effect committed.
    pub processed: AtomicU64,
    /// Deliveries absorbed as duplicates.
    pub duplicates: AtomicU64,
    /// Failed attempts requeued.
    pub retried: AtomicU64,
    /// Deliveries requeued behind an earlier event of their key.
    pub deferred: AtomicU64,
    /// Deliveries recorded held behind a dead-lettered event of their key.
    pub held: AtomicU64,
    /// Deliveries dead-lettered after the budget.
    pub dead_lettered: AtomicU64,
    /// Deliveries dead-lettered at once, without the handler: not a valid
    /// envelope, over the size limit, or refused by the inbox.
    pub undecodable: AtomicU64,
}

/// A snapshot of [`SubscriberCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SubscriberStats {
    /// Deliveries whose effect committed.
    pub processed: u64,
    /// Deliveries absorbed as duplicates.
    pub duplicates: u64,
    /// Failed attempts requeued.
    pub retried: u64,
    /// Deliveries requeued behind an earlier event of their key.
    pub deferred: u64,
    /// Deliveries recorded held behind a dead-lettered event of their key.
    pub held: u64,
    /// Deliveries dead-lettered after the budget.
    pub dead_lettered: u64,
    /// Deliveries dead-lettered at once, without the handler: not a valid
    /// envelope, over the size limit, or refused by the inbox.
    pub undecodable: u64,
}

impl SubscriberCounters {
    /// The counters now.
    pub fn snapshot(&self) -> SubscriberStats {
        SubscriberStats {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            deferred: self.deferred.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            undecodable: self.undecodable.load(Ordering::Relaxed),
        }
    }

    /// Counts `outcome` here and in its `metrics` counter, labelled with
    /// `subscription`.
    fn count(&self, outcome: &DeliveryOutcome, subscription: &str) {
        let (counter, name) = match outcome {
            DeliveryOutcome::Processed => (&self.processed, metric::PROCESSED),
            DeliveryOutcome::Duplicate => (&self.duplicates, metric::DUPLICATES),
            DeliveryOutcome::Retrying { .. } => (&self.retried, metric::RETRIED),
            DeliveryOutcome::Deferred => (&self.deferred, metric::DEFERRED),
            DeliveryOutcome::Held => (&self.held, metric::HELD),
            DeliveryOutcome::DeadLettered { .. } => (&self.dead_lettered, metric::DEAD_LETTERED),
            DeliveryOutcome::Undecodable { .. }
            | DeliveryOutcome::TooLarge { .. }
            | DeliveryOutcome::Unstorable { .. } => (&self.undecodable, metric::UNDECODABLE),
            DeliveryOutcome::Requeued => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(name, metric::LABEL => subscription.to_owned()).increment(1);
    }
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
        }
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

    /// Its counters (shared; they keep counting).
    pub fn counters(&self) -> Arc<SubscriberCounters> {
        self.counters.clone()
    }

    /// Consumes until `shutdown` turns true: in-flight deliveries finish and
    /// are acked or nacked, then the consumer closes. Reopens the consumer
    /// with a backoff whenever the broker loses it.
    ///
    /// Fails only on invalid settings, or if the very first attempt to set
    /// the subscription up is refused by the broker (not merely
    /// unreachable): a queue declared elsewhere with other arguments, say.
    /// Both are deployment errors to see at boot, not to retry forever.
    pub async fn run(&self, mut shutdown: watch::Receiver<bool>) -> Result<(), SubscribeError> {
        self.settings.validate()?;
        let specs = self.settings.worker_specs();
        let queue = &self.settings.spec.queue;
        let mut backoff = RETRY_BACKOFF_MIN;
        let mut first = true;
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            match self.open_consumers(&specs).await {
                Ok(consumers) => {
                    first = false;
                    backoff = RETRY_BACKOFF_MIN;
                    tracing::info!(queue = %queue, "subscriber consuming");
                    self.consume(&consumers, &shutdown).await;
                    self.close_consumers(&consumers).await;
                    if *shutdown.borrow() {
                        tracing::info!(queue = %queue, "subscriber stopped");
                        return Ok(());
                    }
                    self.marks.hit(Mark::ConsumerReopened);
                    tracing::warn!(queue = %queue, "consumer ended; reopening");
                }
                Err(source @ BrokerError::Channel(_)) if first => {
                    return Err(SubscribeError::Setup {
                        queue: queue.clone(),
                        source,
                    });
                }
                Err(e) => {
                    first = false;
                    tracing::warn!(queue = %queue, error = %e, "cannot open the subscription; retrying");
                }
            }
            if sleep_or_shutdown(&*self.clock, backoff, &mut shutdown).await {
                return Ok(());
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// One consumer, on a channel of its own, per worker (on an ordered
    /// subscription, one per partition queue): a worker's deliveries are
    /// then the only unsettled ones of its channel, so a batch is acked
    /// with one `multiple` frame. All or none.
    async fn open_consumers(
        &self,
        specs: &[SubscriptionSpec],
    ) -> Result<Vec<B::Consumer>, BrokerError> {
        let mut consumers = Vec::new();
        for spec in specs {
            match self.broker.subscription_open(spec).await {
                Ok(c) => consumers.push(c),
                Err(e) => {
                    self.close_consumers(&consumers).await;
                    return Err(e);
                }
            }
        }
        Ok(consumers)
    }

    /// Closes every consumer, each within `CLOSE_TIMEOUT`.
    async fn close_consumers(&self, consumers: &[B::Consumer]) {
        for consumer in consumers {
            let _ = with_deadline(&*self.clock, CLOSE_TIMEOUT, consumer.consumer_close()).await;
        }
    }

    /// Runs one worker per consumer until shutdown, or until any consumer
    /// ends (then all stop, to reopen together). Each worker takes a
    /// delivery, then whatever else arrives within `batch_linger` of it (up
    /// to `batch_max` in all), and applies them in one transaction.
    async fn consume(&self, consumers: &[B::Consumer], shutdown: &watch::Receiver<bool>) {
        let (ended_tx, ended_rx) = watch::channel(false);
        let ended_tx = &ended_tx;
        let mut workers: Vec<Pin<Box<dyn Future<Output = ()> + Send + '_>>> = consumers
            .iter()
            .map(|consumer| {
                let mut shutdown = shutdown.clone();
                let mut ended = ended_rx.clone();
                Box::pin(async move {
                    loop {
                        if *shutdown.borrow() || *ended.borrow() {
                            return;
                        }
                        let next = tokio::select! {
                            biased;
                            _ = shutdown.changed() => return,
                            _ = ended.changed() => return,
                            next = consumer.delivery_next() => next,
                        };
                        let Some(first) = next else {
                            ended_tx.send_replace(true);
                            return;
                        };
                        let (batch, over) = self.gather(consumer, first, &mut shutdown).await;
                        if self.settings.spec.partitions > 0 {
                            self.deliver_in_key_order(consumer, batch, &shutdown).await;
                        } else {
                            self.deliver_batch(consumer, batch, &shutdown).await;
                        }
                        if over {
                            ended_tx.send_replace(true);
                            return;
                        }
                    }
                }) as Pin<Box<dyn Future<Output = ()> + Send + '_>>
            })
            .collect();
        if self.settings.spec.partitions > 0 {
            let (mut shutdown, mut ended) = (shutdown.clone(), ended_rx.clone());
            workers.push(Box::pin(async move {
                loop {
                    if *shutdown.borrow() || *ended.borrow() {
                        return;
                    }
                    tokio::select! {
                        biased;
                        _ = shutdown.changed() => return,
                        _ = ended.changed() => return,
                        () = self.clock.sleep(RELEASE_EVERY) => {}
                    }
                    self.release_orphans().await;
                }
            }));
        }
        JoinAll { futures: workers }.await;
    }

    /// Releases held rows nothing holds back any more (each key's lowest,
    /// then the rest of its key in order): what a release cut short left.
    async fn release_orphans(&self) {
        let queue = &self.settings.spec.queue;
        let rows = match self.store.inbox_releasable(queue, REPLAY_PAGE as u32).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(queue = %queue, error = %e, "cannot look for held rows to release");
                return;
            }
        };
        // Each row is its key's lowest held one: release the key from it.
        for row in rows {
            if let Some(o) = &row.ordering {
                let before = KeySeq {
                    key: o.key.clone(),
                    seq: o.seq - 1,
                };
                let mut released = Vec::new();
                self.release_held(&before, &mut released).await;
                tracing::info!(queue = %queue, key = ?o.key, released = ?released, "held rows released");
            }
        }
    }

    /// `first` and the deliveries that arrive within the linger after it,
    /// up to `batch_max` in all (those already waiting are taken even with
    /// no linger); true if the consumer ended meanwhile.
    async fn gather(
        &self,
        consumer: &B::Consumer,
        first: Delivery,
        shutdown: &mut watch::Receiver<bool>,
    ) -> (Vec<Delivery>, bool) {
        let max = self.settings.batch_max.max(1) as usize;
        let mut batch = Vec::with_capacity(max);
        batch.push(first);
        if max == 1 {
            return (batch, false);
        }
        let linger = self.clock.sleep(self.settings.batch_linger);
        tokio::pin!(linger);
        while batch.len() < max {
            // `delivery_next` is cancel-safe: one dropped while waiting
            // loses nothing.
            tokio::select! {
                biased;
                next = consumer.delivery_next() => match next {
                    Some(d) => batch.push(d),
                    None => return (batch, true),
                },
                () = &mut linger => break,
                _ = shutdown.changed() => break,
            }
        }
        (batch, false)
    }

    /// An ordered subscription's batch, in rounds that each hold at most
    /// one delivery per ordering key (the first of it still in hand), so a
    /// key's events are applied one after the other in delivery order: the
    /// order a partition queue got them in, which is the order they
    /// committed in. Which of them may go is the inbox's to say, under the
    /// key's lock: a delivery behind an earlier event of its key that waits
    /// for its retry is [`Deferred`](DeliveryOutcome::Deferred), one behind
    /// a dead-lettered event is [`Held`](DeliveryOutcome::Held). (The
    /// queue gives deliveries back in an order of its own: a redelivery
    /// goes behind what was already delivered, and a consumer's unsettled
    /// deliveries go back in the order they were last delivered, measured
    /// on RabbitMQ 3.10; only the inbox sees every replica's.) Unkeyed
    /// deliveries all go in the first round.
    async fn deliver_in_key_order(
        &self,
        consumer: &B::Consumer,
        deliveries: Vec<Delivery>,
        shutdown: &watch::Receiver<bool>,
    ) {
        let mut pending = deliveries;
        while !pending.is_empty() {
            let mut round = Vec::with_capacity(pending.len());
            let mut later = Vec::new();
            let mut keys = std::collections::BTreeSet::new();
            for d in pending {
                match &d.ordering {
                    Some(o) if !keys.insert(o.key.clone()) => later.push(d),
                    _ => round.push(d),
                }
            }
            if !later.is_empty() {
                self.marks.hit(Mark::KeyRoundSplit);
            }
            self.deliver_batch(consumer, round, shutdown).await;
            pending = later;
        }
    }

    /// Handles one delivery to the end: a batch of one (see
    /// [`deliver_batch`](Self::deliver_batch)).
    pub async fn deliver(
        &self,
        consumer: &B::Consumer,
        delivery: Delivery,
        shutdown: &watch::Receiver<bool>,
    ) -> DeliveryOutcome {
        self.deliver_batch(consumer, vec![delivery], shutdown)
            .await
            .pop()
            .expect("one outcome per delivery")
    }

    /// Handles deliveries to the end, acks and nacks included, returning
    /// their outcomes in order. Those that decode are applied in one
    /// transaction, each after a savepoint of its own (a failed handler
    /// rolls back only its own work); they are acked or nacked only once
    /// that transaction committed. Each delivery has its own
    /// `process <queue>` span, whose parent is the trace context it carries
    /// (its AMQP headers, else its envelope's).
    pub async fn deliver_batch(
        &self,
        consumer: &B::Consumer,
        deliveries: Vec<Delivery>,
        shutdown: &watch::Receiver<bool>,
    ) -> Vec<DeliveryOutcome> {
        let queue = &self.settings.spec.queue;
        let prepared: Vec<Prepared> = deliveries.into_iter().map(|d| self.prepare(d)).collect();
        let mut outcomes: Vec<Option<DeliveryOutcome>> = prepared
            .iter()
            .map(|p| p.decoded.as_ref().err().cloned())
            .collect();
        let mut items: Vec<Item<'_>> = prepared
            .iter()
            .enumerate()
            .filter_map(|(slot, p)| {
                let envelope = p.decoded.as_ref().ok()?;
                Some(Item {
                    slot,
                    entry: InboxEntry {
                        event_id: envelope.id,
                        subscription: queue,
                        routing_key: &envelope.routing_key,
                        payload: &p.delivery.body,
                        fresh_budget: false,
                        ordering: p
                            .delivery
                            .ordering
                            .as_ref()
                            .filter(|_| self.settings.spec.partitions > 0),
                    },
                    envelope,
                    span: p.span.clone(),
                    overran: AtomicBool::new(false),
                })
            })
            .collect();
        // Event-id order (UUID v7: creation order): every batch takes its
        // inbox row locks in the same order, so two batches holding the
        // same events (a redelivery storm) never wait on each other in a
        // cycle. Found by the simulation (producer_and_consumer_swarm,
        // seed 0: two workers' batches deadlocked on two duplicated events).
        items.sort_by_key(|i| i.entry.event_id);
        self.apply_until_decided(&items, &mut outcomes, shutdown)
            .await;
        drop(items);
        let settled: Vec<DeliveryOutcome> = outcomes
            .into_iter()
            .map(|o| o.unwrap_or(DeliveryOutcome::Requeued))
            .collect();
        // The nacks (rare) all at once, then the acks in one call: on a
        // worker's own channel, one `basic.ack multiple` frame.
        JoinAll {
            futures: prepared
                .iter()
                .zip(&settled)
                .filter(|(_, outcome)| !outcome.acks())
                .map(|(p, outcome)| {
                    Box::pin(
                        self.settle(consumer, p.delivery.tag, outcome)
                            .instrument(p.span.clone()),
                    ) as Pin<Box<dyn Future<Output = ()> + Send + '_>>
                })
                .collect(),
        }
        .await;
        let acks: Vec<u64> = prepared
            .iter()
            .zip(&settled)
            .filter(|(_, outcome)| outcome.acks())
            .map(|(p, _)| p.delivery.tag)
            .collect();
        if !acks.is_empty()
            && let Err(e) = consumer.delivery_ack_many(&acks).await
        {
            self.settle_lost(&e);
        }
        for (p, outcome) in prepared.iter().zip(&settled) {
            p.span.record("outbox.inbox.outcome", outcome.label());
            self.counters.count(outcome, queue);
        }
        settled
    }

    /// Decodes a delivery, opens its span and logs what is wrong with it.
    fn prepare(&self, delivery: Delivery) -> Prepared {
        let spec = &self.settings.spec;
        let queue = &spec.queue;
        metrics::counter!(metric::DELIVERED, metric::LABEL => queue.clone()).increment(1);
        let limit = self.settings.max_body_bytes;
        let decoded = if delivery.body.len() > limit as usize {
            Err(DeliveryOutcome::TooLarge {
                bytes: delivery.body.len(),
                limit,
            })
        } else {
            EventEnvelope::decode_delivery(&delivery.body)
                .map_err(|reason| DeliveryOutcome::Undecodable { reason })
        };
        let span = tracing::info_span!(
            "process",
            otel.name = %format_args!("process {queue}"),
            otel.kind = "consumer",
            messaging.system = "rabbitmq",
            messaging.operation.name = "process",
            messaging.operation.type = "process",
            messaging.destination.name = %spec.exchange,
            messaging.destination.subscription.name = %queue,
            // Escaped: a delivery's bytes cannot forge a log line.
            messaging.rabbitmq.destination.routing_key = %delivery.routing_key.escape_debug(),
            messaging.rabbitmq.message.delivery_tag = delivery.tag,
            messaging.message.id = Empty,
            outbox.inbox.outcome = Empty,
        );
        if !span.is_disabled() {
            let envelope = decoded.as_ref().ok();
            if let Some(trace) = delivery.trace.clone().or_else(|| {
                envelope.and_then(|e| crate::trace_context::TraceContext::from_headers(&e.headers))
            }) {
                propagation::set_parent(&span, &trace);
            }
            if let Some(envelope) = envelope {
                span.record("messaging.message.id", envelope.id.to_string());
            }
        }
        let _entered = span.enter();
        match &decoded {
            Err(rejected) => {
                self.marks.hit(match rejected {
                    DeliveryOutcome::TooLarge { .. } => Mark::TooLarge,
                    _ => Mark::Undecodable,
                });
                tracing::error!(
                    queue = %queue,
                    message_id = delivery.message_id.as_deref().unwrap_or("-"),
                    // Debug-escaped: a delivery's bytes cannot forge a log line.
                    routing_key = ?delivery.routing_key,
                    outcome = ?rejected,
                    "delivery is not a valid event envelope; dead-lettering it"
                );
            }
            Ok(envelope) => {
                if let Some(mid) = delivery.message_id.as_deref()
                    && mid != envelope.id.to_string()
                {
                    self.marks.hit(Mark::MessageIdMismatch);
                    tracing::warn!(
                        queue = %queue,
                        message_id = mid,
                        event_id = %envelope.id,
                        "message_id differs from the envelope id; the envelope id is the inbox key"
                    );
                }
                if envelope.routing_key != delivery.routing_key {
                    // The envelope's key is the event's (it is what the
                    // inbox stores and replay uses); a republish through
                    // another exchange or a shovel may route it otherwise.
                    tracing::debug!(
                        queue = %queue,
                        event_id = %envelope.id,
                        envelope_routing_key = ?envelope.routing_key,
                        delivery_routing_key = ?delivery.routing_key,
                        "delivery routed by another key than its envelope's"
                    );
                }
            }
        }
        drop(_entered);
        Prepared {
            delivery,
            span,
            decoded,
        }
    }

    /// Acks or nacks a delivery as its outcome says.
    async fn settle(&self, consumer: &B::Consumer, tag: u64, outcome: &DeliveryOutcome) {
        let settled = match outcome {
            DeliveryOutcome::Processed | DeliveryOutcome::Duplicate | DeliveryOutcome::Held => {
                consumer.delivery_ack(tag).await
            }
            DeliveryOutcome::Retrying { .. }
            | DeliveryOutcome::Requeued
            | DeliveryOutcome::Deferred => consumer.delivery_nack(tag, true).await,
            DeliveryOutcome::DeadLettered { .. }
            | DeliveryOutcome::Undecodable { .. }
            | DeliveryOutcome::TooLarge { .. }
            | DeliveryOutcome::Unstorable { .. } => consumer.delivery_nack(tag, false).await,
        };
        if let Err(e) = settled {
            self.settle_lost(&e);
        }
    }

    /// An ack or nack that could not be sent: the broker will redeliver
    /// what it was for, and the inbox absorbs the repeat.
    fn settle_lost(&self, e: &BrokerError) {
        self.marks.hit(Mark::SettleLost);
        tracing::debug!(queue = %self.settings.spec.queue, error = %e, "ack/nack lost with the channel");
    }

    /// Applies `items` until each is decided: in one transaction while
    /// that works, escalating when it does not (see [`Escalation`]), and
    /// repeated with a backoff while the database is unavailable. Fills in
    /// the outcome of each; a delivery whose data the inbox refuses is
    /// decided (dead-lettered) and the rest run again without it; at
    /// shutdown, what is undecided is requeued.
    async fn apply_until_decided(
        &self,
        items: &[Item<'_>],
        outcomes: &mut [Option<DeliveryOutcome>],
        shutdown: &watch::Receiver<bool>,
    ) {
        let mut backoff = RETRY_BACKOFF_MIN;
        let mut shutdown = shutdown.clone();
        let mut escalation = Escalation::default();
        loop {
            let live: Vec<&Item<'_>> = items
                .iter()
                .filter(|i| outcomes[i.slot].is_none())
                .collect();
            if live.is_empty() {
                return;
            }
            escalation.rescope(outcomes);
            let group = escalation.group(&live);
            let pass = escalation.pass();
            let failure = match self.apply(&group, self.settings.max_attempts, pass).await {
                Ok(applied) => {
                    for (item, applied) in group.iter().zip(applied) {
                        outcomes[item.slot] = Some(self.outcome_of(item, applied));
                    }
                    continue;
                }
                Err(failure) => failure,
            };
            let error = match escalation.after(&group, failure, &self.marks) {
                Next::Again => continue,
                Next::Refused { index, reason } => {
                    let item = group[index];
                    outcomes[item.slot] = Some(self.refused(item, reason, live.len()));
                    continue;
                }
                Next::RetryInPlace(e) => e,
            };
            self.marks.hit(Mark::InboxRetriedInPlace);
            tracing::warn!(
                queue = %self.settings.spec.queue,
                deliveries = group.len(),
                error = %error,
                "inbox unavailable; retrying the deliveries in place"
            );
            if sleep_or_shutdown(&*self.clock, backoff, &mut shutdown).await {
                self.marks.hit(Mark::RequeuedAtShutdown);
                for item in live {
                    outcomes[item.slot] = Some(DeliveryOutcome::Requeued);
                }
                return;
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// A delivery whose data the inbox refused: dead-lettered at once.
    fn refused(&self, item: &Item<'_>, reason: String, batch: usize) -> DeliveryOutcome {
        self.marks.hit(Mark::Unstorable);
        if batch > 1 {
            self.marks.hit(Mark::BatchRerunWithoutRefused);
        }
        let _entered = item.span.enter();
        tracing::error!(
            queue = %self.settings.spec.queue,
            event_id = %item.entry.event_id,
            error = %reason,
            "the inbox refuses this delivery's data; dead-lettering it"
        );
        DeliveryOutcome::Unstorable { reason }
    }

    /// The outcome of one applied delivery.
    fn outcome_of(&self, item: &Item<'_>, applied: Applied) -> DeliveryOutcome {
        match applied {
            Applied::Processed => DeliveryOutcome::Processed,
            Applied::Duplicate => DeliveryOutcome::Duplicate,
            Applied::Deferred => DeliveryOutcome::Deferred,
            Applied::Held => DeliveryOutcome::Held,
            Applied::Failed(record, _) if record.dead_lettered => {
                self.marks.hit(Mark::DeadLetteredAtBudget);
                let _entered = item.span.enter();
                tracing::warn!(
                    queue = %item.entry.subscription,
                    event_id = %item.entry.event_id,
                    attempts = record.attempts,
                    "handler failed for the last time; dead-lettering"
                );
                DeliveryOutcome::DeadLettered {
                    attempts: record.attempts,
                }
            }
            Applied::Failed(record, _) => DeliveryOutcome::Retrying {
                attempts: record.attempts,
            },
        }
    }

    /// BEGIN; per item, in its span: try_insert, then the handler and mark
    /// processed; a check that the work can commit if a handler wrote
    /// last; COMMIT. Every outcome takes effect with the commit: a commit
    /// whose outcome is unknown is retried like any store error, and the
    /// next attempt finds what did commit. Any failure ends the whole
    /// transaction (at the server, when a handler was given up on
    /// mid-statement), a handler's included in an optimistic pass; with
    /// savepoints, a failed handler (or one `pass` knows failed, or one
    /// whose work the check finds cannot commit) rolls back to its item's
    /// savepoint and its attempt is recorded against `max_attempts`.
    async fn apply(
        &self,
        items: &[&Item<'_>],
        max_attempts: u32,
        pass: Pass<'_>,
    ) -> Result<Vec<Applied>, BatchFailure> {
        let bounds = TxBounds::for_handler(self.settings.handler_timeout);
        let mut tx = self
            .store
            .inbox_begin(bounds)
            .await
            .map_err(|e| BatchFailure::trouble(e, Vec::new()))?;
        if let Err(e) = self.lock_keys(&mut tx, items).await {
            self.store.inbox_rollback(tx).await;
            // Blamed on the first keyed delivery (only they take locks).
            let index = items
                .iter()
                .position(|i| i.entry.ordering.is_some())
                .unwrap_or(0);
            let abort = Abort::from(e);
            return Err(abort.into_failure(index, items[index].slot, Vec::new(), Vec::new(), None));
        }
        let mut applied = Vec::with_capacity(items.len());
        let mut handler_wrote_last = false;
        // The slot of the item whose handler ran last with an `Ok`: our own
        // statements never swallow an error, so a transaction found aborted
        // after it was aborted by it.
        let mut last_ok: Option<usize> = None;
        for (index, item) in items.iter().enumerate() {
            let one = self
                .apply_one(&mut tx, item, max_attempts, pass)
                .instrument(item.span.clone())
                .await;
            match one {
                Ok((a, wrote_last)) => {
                    if matches!(a, Applied::Processed) {
                        last_ok = Some(item.slot);
                    }
                    applied.push(a);
                    handler_wrote_last = wrote_last;
                }
                Err(abort) => {
                    let failures = failures_of(items, &applied);
                    if abort.leaves_statement_running() {
                        self.marks.hit(Mark::HandlerTxAbandoned);
                        self.store.inbox_abandon(tx).await;
                    } else {
                        self.store.inbox_rollback(tx).await;
                    }
                    let last_ok = last_ok.map(|slot| (slot, &self.marks));
                    let ran_ok = processed_of(items, &applied);
                    return Err(abort.into_failure(index, item.slot, failures, ran_ok, last_ok));
                }
            }
        }
        // A handler's statement that failed, its error swallowed, leaves
        // the transaction aborted, and PostgreSQL answers its COMMIT with a
        // rollback and no error: never take that for committed. Any later
        // statement of ours would have failed, so only a handler that
        // wrote last needs the check.
        if handler_wrote_last && let Err(e) = self.store.inbox_check(&mut tx).await {
            let mut failures = failures_of(items, &applied);
            self.store.inbox_rollback(tx).await;
            if let (StoreError::Aborted(_), Some(slot)) = (&e, last_ok) {
                self.marks.hit(Mark::HandlerTxCannotCommit);
                failures.push((slot, cannot_commit(&e)));
                return Err(BatchFailure::HandlerFailed {
                    failures,
                    ran_ok: processed_of(items, &applied),
                });
            }
            return Err(BatchFailure::of_transaction(e, failures, false));
        }
        if let Err(e) = self.store.inbox_commit(tx).await {
            // A COMMIT that did not answer may have committed.
            return Err(BatchFailure::of_transaction(
                e,
                failures_of(items, &applied),
                true,
            ));
        }
        if items.len() > 1 {
            self.marks.hit(Mark::BatchCommitted);
        }
        Ok(applied)
    }

    /// The key locks of the keyed deliveries among `items`, all in one
    /// call, first in their transaction (none if none is keyed).
    async fn lock_keys(&self, tx: &mut S::Tx, items: &[&Item<'_>]) -> Result<(), StoreError> {
        let keys: Vec<&str> = items
            .iter()
            .filter_map(|i| i.entry.ordering.map(|o| o.key.as_str()))
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        self.store
            .inbox_lock_keys(tx, &self.settings.spec.queue, &keys)
            .await
    }

    /// One item of [`apply`](Self::apply), in its transaction: what it came
    /// to, and whether its handler's statements were the transaction's
    /// last (nothing of ours ran after them to show they left it usable).
    async fn apply_one(
        &self,
        tx: &mut S::Tx,
        item: &Item<'_>,
        max_attempts: u32,
        pass: Pass<'_>,
    ) -> Result<(Applied, bool), Abort> {
        let entry = &item.entry;
        let inserted = self.store.inbox_try_insert(tx, entry).await?;
        self.marks.hit(match inserted {
            InsertOutcome::Inserted => Mark::InboxInserted,
            InsertOutcome::InFlightRetry { .. } => Mark::InFlightRetry,
            InsertOutcome::AlreadyProcessed => Mark::AlreadyProcessed,
            InsertOutcome::BehindRetry => Mark::DeferredBehindKey,
            InsertOutcome::Held => Mark::HeldBehindKey,
        });
        match inserted {
            InsertOutcome::AlreadyProcessed => return Ok((Applied::Duplicate, false)),
            InsertOutcome::BehindRetry => return Ok((Applied::Deferred, false)),
            InsertOutcome::Held => return Ok((Applied::Held, false)),
            InsertOutcome::Inserted | InsertOutcome::InFlightRetry { .. } => {}
        }
        // A trusted delivery runs as in an optimistic pass.
        let pass = match pass {
            Pass::Savepoints { failed, trusted }
                if trusted.contains(&item.slot) && !failed.contains_key(&item.slot) =>
            {
                Pass::Optimistic
            }
            pass => pass,
        };
        let known = match pass {
            Pass::Optimistic => None,
            Pass::Savepoints { failed, .. } => {
                self.store.inbox_savepoint(tx).await?;
                failed.get(&item.slot)
            }
        };
        let failure = match known {
            // Its failure is known from a pass that rolled back: one
            // failure, one attempt, one handler run.
            Some(text) => text.clone(),
            None => match self.handle_one(tx, item, pass).await? {
                None => {
                    // A row this transaction inserted carries its mark already.
                    if inserted != InsertOutcome::Inserted {
                        match self.store.inbox_mark_processed(tx, entry).await {
                            Ok(()) => {}
                            // Its handler left the transaction aborted.
                            Err(e @ StoreError::Aborted(_)) => {
                                self.marks.hit(Mark::HandlerTxCannotCommit);
                                return Err(Abort::Handler(cannot_commit(&e)));
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    let wrote_last =
                        inserted == InsertOutcome::Inserted && matches!(pass, Pass::Optimistic);
                    return Ok((Applied::Processed, wrote_last));
                }
                Some(text) => text,
            },
        };
        let record = self
            .store
            .inbox_record_failure(tx, entry, &failure, max_attempts)
            .await?;
        Ok((Applied::Failed(record, failure), false))
    }

    /// Runs one item's handler: `None` if its work stands; the failure to
    /// record (with savepoints) if the handler failed or, with savepoints,
    /// if its work cannot commit; an `Abort` for what ends the transaction
    /// (database trouble, a handler given up on, any handler failure in an
    /// optimistic pass).
    async fn handle_one(
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
    async fn check_own_work(
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
    async fn run_handler(
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
    async fn overrun(
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
    async fn watch_database(
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

    /// Re-runs the handler, with the inbox's semantics, for unprocessed
    /// rows of this subscription matching `filter` (up to its limit), each
    /// given a fresh budget right before its own attempt (so a replay cut
    /// short leaves the rows it did not reach as they were: still
    /// dead-lettered, still findable). No broker is involved: a
    /// dead-lettered delivery stays in `<queue>.dlq` for the record; its
    /// effect comes from here. On an ordered subscription a row that takes
    /// effect releases its key's held rows, replayed in the key's order and
    /// listed after the rows asked for. See
    /// [`replay_page`](Self::replay_page) for where to go on from.
    pub async fn replay(
        &self,
        filter: &InboxFilter,
    ) -> Result<Vec<(uuid::Uuid, ReplayOutcome)>, StoreError> {
        self.replay_page(filter).await.map(|mut page| {
            page.results.append(&mut page.released);
            page.results
        })
    }

    /// [`replay`](Self::replay), saying where more rows match: `next` is
    /// the place to pass as the filter's `after` for the rest (rows that
    /// failed again are then not met again), `None` when no more rows
    /// matched. Rows are read [`REPLAY_PAGE`] at a time, not all at once.
    pub async fn replay_page(&self, filter: &InboxFilter) -> Result<ReplayPage, StoreError> {
        let queue = &self.settings.spec.queue;
        let span = tracing::info_span!(
            "outbox.replay",
            messaging.destination.subscription.name = %queue,
            outbox.rows = Empty,
        );
        self.replay_rows(filter).instrument(span).await
    }

    async fn replay_rows(&self, filter: &InboxFilter) -> Result<ReplayPage, StoreError> {
        let limit = filter
            .limit
            .unwrap_or(LIST_LIMIT_DEFAULT)
            .clamp(1, LIST_LIMIT_MAX) as usize;
        let mut page = filter.clone();
        page.subscription = Some(self.settings.spec.queue.clone());
        let mut results = Vec::new();
        let mut released = Vec::new();
        loop {
            let want = (limit - results.len()).min(REPLAY_PAGE);
            // One row more than wanted says whether more match.
            page.limit = Some(want as u32 + 1);
            let mut rows = self.store.inbox_list_unprocessed(&page).await?;
            let more = rows.len() > want;
            rows.truncate(want);
            let last = rows.last().map(InboxCursor::of);
            for row in rows {
                // A held row this replay already released: replayed.
                if let Some(at) = released
                    .iter()
                    .position(|(id, _): &(uuid::Uuid, _)| *id == row.event_id)
                {
                    results.push(released.remove(at));
                    continue;
                }
                let outcome = self.replay_row(&row).await?;
                let took_effect = outcome == ReplayOutcome::Applied;
                results.push((row.event_id, outcome));
                if took_effect && let Some(o) = &row.ordering {
                    self.release_held(o, &mut released).await;
                }
            }
            Span::current().record("outbox.rows", results.len());
            if !more || results.len() >= limit {
                let next = if more { last } else { None };
                return Ok(ReplayPage {
                    results,
                    released,
                    next,
                });
            }
            page.after = last;
        }
    }

    /// Skips these dead-lettered rows (see [`InboxStore::inbox_skip`]):
    /// marked processed without their effect. Each skipped row of an
    /// ordering key then releases the key's held rows, replayed in the
    /// key's order until one does not take effect (it is dead-lettered
    /// then, and the rest stay held behind it). Returns each skipped row
    /// ([`ReplayOutcome::Skipped`]) and each released row with what its
    /// replay came to. Ids that are not dead-lettered rows of this
    /// subscription are ignored.
    pub async fn skip(&self, ids: &[uuid::Uuid]) -> Result<ReplayPage, StoreError> {
        let queue = &self.settings.spec.queue;
        let skipped = self.store.inbox_skip(queue, ids).await?;
        tracing::warn!(queue = %queue, skipped = skipped.len(), "dead-lettered inbox rows skipped by operator");
        let (mut results, mut released) = (Vec::new(), Vec::new());
        for row in skipped {
            results.push((row.event_id, ReplayOutcome::Skipped));
            if let Some(o) = &row.ordering {
                self.release_held(o, &mut released).await;
            }
        }
        Ok(ReplayPage {
            results,
            released,
            next: None,
        })
    }

    /// `o` took effect (replayed) or was skipped: its key's held rows are
    /// replayed in the key's order, each appended to `results`, until one
    /// does not take effect (a held row a replay released before, still
    /// held, is not replayed twice).
    ///
    /// Database trouble ends the release, not the replay or skip that
    /// asked for it: what it did not reach stays held, and the
    /// subscriber's own sweep releases it within [`RELEASE_EVERY`].
    async fn release_held(&self, o: &KeySeq, results: &mut Vec<(uuid::Uuid, ReplayOutcome)>) {
        let queue = &self.settings.spec.queue;
        let mut after = o.seq;
        let stopped = |e: StoreError| {
            tracing::warn!(queue = %queue, key = ?o.key, error = %e, "releasing held rows stopped on the database; the rest are released later");
        };
        loop {
            let rows = match self
                .store
                .inbox_held(queue, &o.key, after, REPLAY_PAGE as u32)
                .await
            {
                Ok(rows) => rows,
                Err(e) => return stopped(e),
            };
            if rows.is_empty() {
                return;
            }
            for row in rows {
                after = row.ordering.as_ref().map_or(after, |k| k.seq);
                self.marks.hit(Mark::HeldReleased);
                let outcome = match self.release_row(&row).await {
                    Ok(outcome) => outcome,
                    Err(e) => return stopped(e),
                };
                let went_on = matches!(
                    outcome,
                    ReplayOutcome::Applied | ReplayOutcome::AlreadyProcessed
                );
                results.push((row.event_id, outcome));
                if !went_on {
                    return;
                }
            }
        }
    }

    /// One stored row replayed.
    async fn replay_row(&self, row: &InboxRow) -> Result<ReplayOutcome, StoreError> {
        self.replay_row_with(row, true, 1).await
    }

    /// A held row released: replayed with the attempt budget a delivery has
    /// (`max_attempts`, retried in place after [`RETRY_BACKOFF_MIN`]), since
    /// it never had a delivery's retries; it is dead-lettered, the key's
    /// new head, only once it failed them all.
    async fn release_row(&self, row: &InboxRow) -> Result<ReplayOutcome, StoreError> {
        let budget = self.settings.max_attempts.max(1);
        let mut attempt = 1;
        loop {
            let outcome = self.replay_row_with(row, attempt == 1, budget).await?;
            if !matches!(outcome, ReplayOutcome::Failed { .. }) || attempt >= budget {
                return Ok(outcome);
            }
            attempt += 1;
            self.clock.sleep(RETRY_BACKOFF_MIN).await;
        }
    }

    /// One stored row replayed against `budget` attempts, its budget reset
    /// first if `fresh`.
    async fn replay_row_with(
        &self,
        row: &InboxRow,
        fresh: bool,
        budget: u32,
    ) -> Result<ReplayOutcome, StoreError> {
        let envelope = match EventEnvelope::decode_delivery(&row.payload) {
            Err(reason) => return Ok(ReplayOutcome::Undecodable { reason }),
            Ok(envelope) => envelope,
        };
        let item = Item {
            slot: 0,
            entry: InboxEntry {
                event_id: row.event_id,
                subscription: &row.subscription,
                routing_key: &row.routing_key,
                payload: &row.payload,
                fresh_budget: fresh,
                ordering: row.ordering.as_ref(),
            },
            envelope: &envelope,
            span: Span::current(),
            // A replay has no retry in place: its first overrun with the
            // database answering is the handler's.
            overran: AtomicBool::new(true),
        };
        Ok(self.replay_outcome(self.replay_one(&item, budget).await?))
    }

    /// One replayed row, escalated like a delivery until decided, but
    /// never retried in place: database trouble is the operator's answer.
    /// An operator's replay has a budget of 1: a row whose handler fails
    /// again is in no queue any more, so it stays dead-lettered until the
    /// next replay, or nothing would ever run it again. Found by the
    /// simulation (producer_and_consumer_swarm, seed 43). A released held
    /// row has a delivery's budget ([`release_row`](Self::release_row)).
    async fn replay_one(&self, item: &Item<'_>, budget: u32) -> Result<Applied, StoreError> {
        let mut escalation = Escalation::starting(Level::Savepoints);
        let group = [item];
        loop {
            let failure = match self.apply(&group, budget, escalation.pass()).await {
                Ok(mut applied) => return Ok(applied.pop().expect("one item, one outcome")),
                Err(failure) => failure,
            };
            match escalation.after(&group, failure, &self.marks) {
                Next::Again => {}
                Next::Refused { reason, .. } => return Err(StoreError::Refused(reason)),
                Next::RetryInPlace(e) => return Err(e),
            }
        }
    }

    /// What a replayed row's attempt came to, counted.
    fn replay_outcome(&self, applied: Applied) -> ReplayOutcome {
        match applied {
            Applied::Processed => {
                self.marks.hit(Mark::ReplayApplied);
                self.counters
                    .count(&DeliveryOutcome::Processed, &self.settings.spec.queue);
                ReplayOutcome::Applied
            }
            Applied::Duplicate => {
                self.marks.hit(Mark::ReplayAlreadyProcessed);
                ReplayOutcome::AlreadyProcessed
            }
            Applied::Failed(_, error) => {
                self.marks.hit(Mark::ReplayFailedAgain);
                ReplayOutcome::Failed { error }
            }
            Applied::Deferred | Applied::Held => ReplayOutcome::Held,
        }
    }
}

/// A watched handler run pings the database every `deadline /
/// (2 × PROBE_DIVISOR)`; one ping slower than `deadline / PROBE_DIVISOR`
/// means the database stalled during the run.
pub const PROBE_DIVISOR: u32 = 10;

/// What one delivery of a transaction came to (with its commit).
enum Applied {
    Processed,
    Duplicate,
    /// An earlier event of its key waits for its retry: not handled.
    Deferred,
    /// An earlier event of its key is dead-lettered: recorded held.
    Held,
    /// The handler failed with this error; its attempt is recorded.
    Failed(AttemptRecord, String),
}

/// The slots of `items` whose handlers ran with an `Ok` (by `applied`).
fn processed_of(items: &[&Item<'_>], applied: &[Applied]) -> Vec<usize> {
    items
        .iter()
        .zip(applied)
        .filter(|(_, a)| matches!(a, Applied::Processed))
        .map(|(item, _)| item.slot)
        .collect()
}

/// The failures recorded so far in a transaction: (slot, error).
fn failures_of(items: &[&Item<'_>], applied: &[Applied]) -> Vec<(usize, String)> {
    items
        .iter()
        .zip(applied)
        .filter_map(|(item, a)| match a {
            Applied::Failed(_, error) => Some((item.slot, error.clone())),
            _ => None,
        })
        .collect()
}

/// A handler's failure, and whether its future was dropped mid-run (a
/// deadline, a panic), so a statement of it may still run at the server.
struct HandlerFailure {
    error: HandlerError,
    abandoned: bool,
}

/// Text fit for `last_error`: bounded, and without the NUL character
/// PostgreSQL's `text` refuses (it would make the record itself fail).
fn storable(text: &str) -> String {
    truncate_chars(text, LAST_ERROR_MAX_CHARS).replace('\0', "\u{FFFD}")
}

/// The recorded failure of a handler whose `Ok` cannot commit.
fn cannot_commit(e: &StoreError) -> String {
    storable(&format!(
        "the handler returned Ok but its transaction cannot commit: {e}"
    ))
}

/// Why one delivery ended its transaction.
enum Abort {
    Store(StoreError),
    /// Its handler failed with this error in an optimistic pass.
    Handler(String),
    /// Its handler was given up on mid-run: the transaction must end at the
    /// server. `failure` is the handler's failure to record, if the
    /// overrun or panic counts; otherwise it was database trouble (`e`).
    Abandoned {
        failure: Option<String>,
        e: StoreError,
    },
}

impl From<StoreError> for Abort {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl Abort {
    /// Whether a statement of the transaction may still run at the server.
    fn leaves_statement_running(&self) -> bool {
        matches!(self, Self::Abandoned { .. })
    }

    /// The transaction's failure, for the delivery at `index` (its `slot`),
    /// given the `failures` recorded before it in the same transaction and
    /// the slots whose handlers ran with an `Ok` before it (`ran_ok`).
    /// `last_ok` is the slot of the item whose handler last returned `Ok`
    /// in the transaction (and the marks), which an aborted transaction
    /// blames.
    fn into_failure(
        self,
        index: usize,
        slot: usize,
        mut failures: Vec<(usize, String)>,
        ran_ok: Vec<usize>,
        last_ok: Option<(usize, &Marks)>,
    ) -> BatchFailure {
        match self {
            Self::Store(StoreError::Refused(reason)) => BatchFailure::Refused {
                index,
                reason,
                failures,
            },
            // Our statement found the transaction aborted: the handler that
            // ran last swallowed its statement's error.
            Self::Store(e @ StoreError::Aborted(_)) if last_ok.is_some() => {
                let (culprit, marks) = last_ok.expect("checked");
                marks.hit(Mark::HandlerTxCannotCommit);
                failures.push((culprit, cannot_commit(&e)));
                BatchFailure::HandlerFailed { failures, ran_ok }
            }
            Self::Store(e) if e.is_unavailable() => BatchFailure::trouble(e, failures),
            // A statement of ours failed for no reason of the database's:
            // a handler left the transaction aborted, or its data broke
            // something; the next pass finds which.
            Self::Store(e) => BatchFailure::Culpable {
                error: e.to_string(),
                failures,
            },
            Self::Handler(text)
            | Self::Abandoned {
                failure: Some(text),
                ..
            } => {
                failures.push((slot, text));
                BatchFailure::HandlerFailed { failures, ran_ok }
            }
            Self::Abandoned { failure: None, e } => BatchFailure::trouble(e, failures),
        }
    }
}

/// How [`Subscriber::apply`] runs a transaction of deliveries.
#[derive(Clone, Copy)]
enum Pass<'a> {
    /// No savepoints (one round trip less per delivery): a handler failure
    /// ends the pass, to be run again with savepoints.
    Optimistic,
    /// A savepoint after each delivery's inbox row and a check after each
    /// handler's `Ok`; a handler that fails, or whose work cannot commit,
    /// rolls back to it and its attempt is recorded. The failures in
    /// `failed` (by slot) are recorded without running their handler again.
    /// The deliveries in `trusted` (by slot, none of `failed`), whose
    /// handlers ran with an `Ok` in the optimistic pass that failed, run as
    /// in an optimistic pass: no savepoint, no check of their own (a
    /// failure of theirs ends the pass again, now known).
    Savepoints {
        failed: &'a BTreeMap<usize, String>,
        trusted: &'a BTreeSet<usize>,
    },
}

/// Why a transaction of deliveries did not commit.
enum BatchFailure {
    /// The inbox refused the data of the delivery at this index; the
    /// transaction rolled back, and `failures` were met before it.
    Refused {
        index: usize,
        reason: String,
        failures: Vec<(usize, String)>,
    },
    /// A handler failed (in an optimistic pass, or given up on mid-run):
    /// these failures, by slot, are known; the transaction rolled back.
    HandlerFailed {
        failures: Vec<(usize, String)>,
        ran_ok: Vec<usize>,
    },
    /// The transaction could not commit for a reason of the deliveries'
    /// own (not the database's availability): a check, a statement of
    /// ours or the COMMIT failed. It did not commit; `failures` were met
    /// on the way.
    Culpable {
        error: String,
        failures: Vec<(usize, String)>,
    },
    /// Database trouble: nobody's fault. Before the COMMIT the transaction
    /// surely did not commit, and `failures` are known; a COMMIT that did
    /// not answer may have committed (`in_doubt`), the failures it recorded
    /// with it.
    Store {
        e: StoreError,
        failures: Vec<(usize, String)>,
        in_doubt: bool,
    },
}

impl BatchFailure {
    /// Database trouble before the COMMIT, with the failures met so far.
    fn trouble(e: StoreError, failures: Vec<(usize, String)>) -> Self {
        Self::Store {
            e,
            failures,
            in_doubt: false,
        }
    }

    /// A check (`at_commit` false) or a COMMIT of the whole transaction
    /// failed with `e`.
    fn of_transaction(e: StoreError, failures: Vec<(usize, String)>, at_commit: bool) -> Self {
        if e.is_unavailable() {
            Self::Store {
                e,
                failures,
                in_doubt: at_commit,
            }
        } else {
            Self::Culpable {
                error: e.to_string(),
                failures,
            }
        }
    }
}

/// How far a group of deliveries has escalated to be decided.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// One transaction, no savepoints, one check before the COMMIT when a
    /// handler wrote last.
    #[default]
    Optimistic,
    /// One transaction, a savepoint and a check per delivery: a failure is
    /// found by delivery and rolled back alone.
    Savepoints,
    /// Each delivery in a transaction of its own (with savepoints): a
    /// COMMIT failed on the deliveries' data after every check passed.
    Alone,
}

/// What the next transaction of a group of deliveries is, given how the
/// last ones failed: the escalation that keeps retrying in place bounded
/// to database trouble. A handler failure reruns with savepoints (the
/// failure known, its handler not run again); a transaction that cannot
/// commit on the deliveries' own data (a check, a statement of ours or the
/// COMMIT failed, not for the database's availability) reruns with a check
/// per delivery, then each delivery alone, and a delivery alone whose
/// transaction cannot commit has failed: its failure is recorded in the
/// next. Only database trouble, and a failure no delivery can be blamed for
/// (a delivery's mere failure record does not commit), is retried in place.
#[derive(Default)]
struct Escalation {
    level: Level,
    /// Handler failures known, by slot: recorded by the next pass without
    /// running their handlers again.
    failed: BTreeMap<usize, String>,
    /// Deliveries whose handlers ran with an `Ok` in the optimistic pass
    /// that a handler failure ended, by slot: the savepoint pass after it
    /// runs them without savepoints (a failure is nearly always one
    /// delivery's, and the rest ran clean a moment ago), until a
    /// transaction cannot commit on the deliveries' data.
    trusted: BTreeSet<usize>,
    /// After a handler failure ended an optimistic pass: the deliveries it
    /// reached (the trusted and the failed), by slot. Only they run again
    /// with savepoints; those it did not reach wait for them to be decided,
    /// then run in an optimistic pass of their own (a failure costs the
    /// deliveries before it one more run, not the whole batch a savepoint
    /// pass). One ordering key has one delivery in a batch's round, so
    /// splitting a round keeps every key's order.
    scope: Option<BTreeSet<usize>>,
}

/// What to do after a failed transaction.
enum Next {
    /// Run the next transaction (as [`Escalation::pass`] says).
    Again,
    /// The inbox refused the data of the group's delivery at `index`.
    Refused { index: usize, reason: String },
    /// Database trouble (or trouble no delivery is to blame for): retry in
    /// place after a backoff.
    RetryInPlace(StoreError),
}

impl Escalation {
    fn starting(level: Level) -> Self {
        Self {
            level,
            failed: BTreeMap::new(),
            trusted: BTreeSet::new(),
            scope: None,
        }
    }

    /// The deliveries of the next transaction, of those still undecided.
    fn group<'i, 'a>(&self, live: &[&'i Item<'a>]) -> Vec<&'i Item<'a>> {
        let scoped = live
            .iter()
            .copied()
            .filter(|i| self.scope.as_ref().is_none_or(|s| s.contains(&i.slot)));
        match self.level {
            Level::Alone => scoped.take(1).collect(),
            _ => scoped.collect(),
        }
    }

    /// Once every delivery in scope is decided, the rest start over with
    /// an optimistic pass (none of them ran).
    fn rescope(&mut self, outcomes: &[Option<DeliveryOutcome>]) {
        if let Some(scope) = &self.scope
            && scope.iter().all(|&slot| outcomes[slot].is_some())
        {
            *self = Self::default();
        }
    }

    /// How the next transaction runs.
    fn pass(&self) -> Pass<'_> {
        match self.level {
            Level::Optimistic => Pass::Optimistic,
            _ => Pass::Savepoints {
                failed: &self.failed,
                trusted: &self.trusted,
            },
        }
    }

    /// Takes in how the transaction of `group` failed.
    fn after(&mut self, group: &[&Item<'_>], failure: BatchFailure, marks: &Marks) -> Next {
        match failure {
            BatchFailure::Refused {
                index,
                reason,
                failures,
            } => {
                // It did not commit: what it met stays known, and the rest
                // run again without the refused one, their failures
                // recorded, not run again (the simulation's
                // every_failure_counted: hostile_deliveries, madsim seed 76).
                if !failures.is_empty() && self.level == Level::Optimistic {
                    self.level = Level::Savepoints;
                }
                self.failed.extend(failures);
                Next::Refused { index, reason }
            }
            BatchFailure::HandlerFailed { failures, ran_ok } => {
                if self.level == Level::Optimistic {
                    marks.hit(Mark::BatchRerunWithSavepoints);
                    self.level = Level::Savepoints;
                    let reached = ran_ok.iter().copied().chain(failures.iter().map(|f| f.0));
                    self.scope = Some(reached.collect());
                    self.trusted.extend(ran_ok);
                }
                self.failed.extend(failures);
                Next::Again
            }
            BatchFailure::Culpable { error, failures } => {
                // It did not commit: what it met is known, and no delivery's
                // work is trusted any more.
                self.failed.extend(failures);
                self.trusted.clear();
                match (self.level, group) {
                    (Level::Optimistic, _) => {
                        marks.hit(Mark::BatchRerunWithSavepoints);
                        self.level = Level::Savepoints;
                    }
                    (_, [_, _, ..]) => {
                        marks.hit(Mark::BatchRerunAlone);
                        self.level = Level::Alone;
                    }
                    (_, [one]) if !self.failed.contains_key(&one.slot) => {
                        marks.hit(Mark::HandlerTxCannotCommit);
                        let e = StoreError::Statement(error);
                        self.failed.insert(one.slot, cannot_commit(&e));
                    }
                    // Not even its failure record commits: not the
                    // delivery's doing.
                    _ => return Next::RetryInPlace(StoreError::Statement(error)),
                }
                Next::Again
            }
            BatchFailure::Store {
                e,
                failures,
                in_doubt: false,
            } => {
                // It surely did not commit: what it met stays known, one
                // failure one attempt (the simulation's
                // every_failure_counted found a first overrun's retry
                // forgetting a batch mate's failure: poison_to_dlq_and_replay
                // seed 0).
                self.failed.extend(failures);
                Next::RetryInPlace(e)
            }
            BatchFailure::Store { e, .. } => {
                // The transaction may have committed the failures it
                // recorded (a commit whose reply was lost): recording them
                // again would count one failure twice. Their handlers run
                // again instead, and the inbox shows what committed. Found
                // by the simulation (producer_and_consumer_swarm, seed 48).
                for item in group {
                    self.failed.remove(&item.slot);
                }
                Next::RetryInPlace(e)
            }
        }
    }
}

/// A delivery decoded (or not), with its span.
struct Prepared {
    delivery: Delivery,
    span: Span,
    decoded: Result<EventEnvelope, DeliveryOutcome>,
}

/// A decoded delivery of a batch: `slot` is its place among the batch's
/// deliveries.
struct Item<'a> {
    slot: usize,
    entry: InboxEntry<'a>,
    envelope: &'a EventEnvelope,
    span: Span,
    /// Its handler overran once while the database answered: the next
    /// overrun counts an attempt.
    overran: AtomicBool,
}

/// Polls a future, turning a panic inside it into `Err` with the panic's
/// message. It is not polled again after a panic.
struct CatchUnwind<F>(Pin<Box<F>>);

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
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    truncate_chars(text, LAST_ERROR_MAX_CHARS)
}

/// Polls every future, in order, until all are done: the workers of one
/// consumer, without spawning (so the caller's runtime, real or simulated,
/// schedules them deterministically).
struct JoinAll<'a> {
    futures: Vec<Pin<Box<dyn Future<Output = ()> + Send + 'a>>>,
}

impl Future for JoinAll<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.futures
            .retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if self.futures.is_empty() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}
