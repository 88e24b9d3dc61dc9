//! The subscriber: the consumer half of ADR-018 (amendment #433), exactly
//! once in effect over an at-least-once broker.
//!
//! Per delivery:
//! 1. BEGIN; `inbox_try_insert` → [`InsertOutcome`].
//! 2. `AlreadyProcessed`: commit, ack; the handler does not run.
//! 3. Otherwise the handler runs with the transaction. Ok: mark processed,
//!    commit, ack. Err: roll back to the savepoint taken after the inbox
//!    insert (the handler's work goes, the row and its lock stay), record
//!    the attempt in the same transaction and commit (so the count survives
//!    the handler's rollback, as the ADR's separate connection meant it to,
//!    and a retry after a lost reply cannot count one failure twice), then
//!    nack with requeue while attempts < budget, else nack without requeue:
//!    the broker moves it to `<queue>.dlq`.
//!
//! A delivery that is over the size limit, is not a valid envelope, or holds
//! data the inbox refuses to store (a `\u0000` or a lone surrogate in a
//! `jsonb` string, a number beyond `jsonb`'s range) goes to the dead-letter
//! queue at once and is never retried in place. Database trouble is nobody's
//! fault, whether the inbox or the handler's own statements meet it: the
//! delivery is retried in place with a backoff (no attempt is counted) until
//! the database answers or the subscriber shuts down (then it is requeued).
//! Broker trouble ends the consumer; the subscriber reopens it with a
//! backoff, and the broker redelivers whatever was unacknowledged; the inbox
//! absorbs the duplicates.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::watch;
use tracing::{Instrument, Span, field::Empty};

use super::drainer::LAST_ERROR_MAX_CHARS;
use super::marks::{Mark, Marks};
use super::ports::{
    AttemptRecord, Clock, ConsumerBroker, Delivery, DeliverySource, InboxEntry, InboxFilter,
    InboxStore, InsertOutcome, SubscriptionSpec,
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
    /// Queue, exchange, bindings, prefetch.
    pub spec: SubscriptionSpec,
    /// Deliveries handled at once (each in its own transaction).
    pub concurrency: u32,
    /// Failed attempts after which a delivery is dead-lettered.
    pub max_attempts: u32,
    /// Largest delivery body handled, in bytes; a larger one is
    /// dead-lettered at once.
    pub max_body_bytes: u32,
    /// Longest the handler may run on one delivery: past it the handler's
    /// work is rolled back and the attempt counts as failed.
    pub handler_timeout: Duration,
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
        }
    }
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
    H: Handler<S::Tx>,
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
        let spec = &self.settings.spec;
        let mut backoff = RETRY_BACKOFF_MIN;
        let mut first = true;
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            match self.broker.subscription_open(spec).await {
                Ok(consumer) => {
                    first = false;
                    backoff = RETRY_BACKOFF_MIN;
                    tracing::info!(queue = %spec.queue, "subscriber consuming");
                    self.consume(&consumer, &shutdown).await;
                    let _ =
                        with_deadline(&*self.clock, CLOSE_TIMEOUT, consumer.consumer_close()).await;
                    if *shutdown.borrow() {
                        tracing::info!(queue = %spec.queue, "subscriber stopped");
                        return Ok(());
                    }
                    self.marks.hit(Mark::ConsumerReopened);
                    tracing::warn!(queue = %spec.queue, "consumer ended; reopening");
                }
                Err(source @ BrokerError::Channel(_)) if first => {
                    return Err(SubscribeError::Setup {
                        queue: spec.queue.clone(),
                        source,
                    });
                }
                Err(e) => {
                    first = false;
                    tracing::warn!(queue = %spec.queue, error = %e, "cannot open the subscription; retrying");
                }
            }
            if sleep_or_shutdown(&*self.clock, backoff, &mut shutdown).await {
                return Ok(());
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// Runs `concurrency` workers over one consumer until it ends or
    /// shutdown.
    async fn consume(&self, consumer: &B::Consumer, shutdown: &watch::Receiver<bool>) {
        let workers = (0..self.settings.concurrency.max(1))
            .map(|_| {
                let mut shutdown = shutdown.clone();
                Box::pin(async move {
                    loop {
                        if *shutdown.borrow() {
                            return;
                        }
                        let next = tokio::select! {
                            biased;
                            _ = shutdown.changed() => return,
                            next = consumer.delivery_next() => next,
                        };
                        let Some(delivery) = next else { return };
                        self.deliver(consumer, delivery, &shutdown).await;
                    }
                }) as Pin<Box<dyn Future<Output = ()> + Send + '_>>
            })
            .collect();
        JoinAll { futures: workers }.await;
    }

    /// Handles one delivery to the end: ack or nack included, in a
    /// `process <queue>` span whose parent is the trace context the
    /// delivery carries (its AMQP headers, else its envelope's).
    pub async fn deliver(
        &self,
        consumer: &B::Consumer,
        delivery: Delivery,
        shutdown: &watch::Receiver<bool>,
    ) -> DeliveryOutcome {
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
        let outcome = self
            .settle_delivery(consumer, delivery, decoded, shutdown)
            .instrument(span.clone())
            .await;
        span.record("outbox.inbox.outcome", outcome.label());
        self.counters.count(&outcome, queue);
        outcome
    }

    /// [`deliver`](Self::deliver) once the delivery is decoded.
    async fn settle_delivery(
        &self,
        consumer: &B::Consumer,
        delivery: Delivery,
        decoded: Result<EventEnvelope, DeliveryOutcome>,
        shutdown: &watch::Receiver<bool>,
    ) -> DeliveryOutcome {
        let queue = &self.settings.spec.queue;
        let outcome = match decoded {
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
                rejected
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
                let entry = InboxEntry {
                    event_id: envelope.id,
                    subscription: queue,
                    routing_key: &envelope.routing_key,
                    payload: &delivery.body,
                    fresh_budget: false,
                };
                self.attempt_until_decided(&entry, &envelope, shutdown)
                    .await
            }
        };
        let settle = match &outcome {
            DeliveryOutcome::Processed | DeliveryOutcome::Duplicate => {
                consumer.delivery_ack(delivery.tag).await
            }
            DeliveryOutcome::Retrying { .. } | DeliveryOutcome::Requeued => {
                consumer.delivery_nack(delivery.tag, true).await
            }
            DeliveryOutcome::DeadLettered { .. }
            | DeliveryOutcome::Undecodable { .. }
            | DeliveryOutcome::TooLarge { .. }
            | DeliveryOutcome::Unstorable { .. } => {
                consumer.delivery_nack(delivery.tag, false).await
            }
        };
        if let Err(e) = settle {
            self.marks.hit(Mark::SettleLost);
            // The broker will redeliver it; the inbox absorbs the repeat.
            tracing::debug!(queue = %queue, error = %e, "ack/nack lost with the channel");
        }
        outcome
    }

    /// One attempt, repeated in place while the database is unavailable.
    async fn attempt_until_decided(
        &self,
        entry: &InboxEntry<'_>,
        envelope: &EventEnvelope,
        shutdown: &watch::Receiver<bool>,
    ) -> DeliveryOutcome {
        let mut backoff = RETRY_BACKOFF_MIN;
        let mut shutdown = shutdown.clone();
        loop {
            let error = match self
                .attempt(entry, envelope, self.settings.max_attempts)
                .await
            {
                Ok(Attempt::Applied) => return DeliveryOutcome::Processed,
                Ok(Attempt::AlreadyProcessed) => return DeliveryOutcome::Duplicate,
                Ok(Attempt::Failed(record, _)) if record.dead_lettered => {
                    self.marks.hit(Mark::DeadLetteredAtBudget);
                    tracing::warn!(
                        queue = %entry.subscription,
                        event_id = %entry.event_id,
                        attempts = record.attempts,
                        "handler failed for the last time; dead-lettering"
                    );
                    return DeliveryOutcome::DeadLettered {
                        attempts: record.attempts,
                    };
                }
                Ok(Attempt::Failed(record, _)) => {
                    return DeliveryOutcome::Retrying {
                        attempts: record.attempts,
                    };
                }
                Err(StoreError::Refused(reason)) => {
                    self.marks.hit(Mark::Unstorable);
                    tracing::error!(
                        queue = %entry.subscription,
                        event_id = %entry.event_id,
                        error = %reason,
                        "the inbox refuses this delivery's data; dead-lettering it"
                    );
                    return DeliveryOutcome::Unstorable { reason };
                }
                Err(e) => e,
            };
            self.marks.hit(Mark::InboxRetriedInPlace);
            tracing::warn!(
                queue = %entry.subscription,
                event_id = %entry.event_id,
                error = %error,
                "inbox unavailable; retrying the delivery in place"
            );
            if sleep_or_shutdown(&*self.clock, backoff, &mut shutdown).await {
                self.marks.hit(Mark::RequeuedAtShutdown);
                return DeliveryOutcome::Requeued;
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// BEGIN, try_insert, the handler; then mark processed, or (the handler
    /// failed) roll back to the savepoint and record the attempt against
    /// `max_attempts`; COMMIT. Either way the outcome takes effect with the
    /// commit: a commit whose outcome is unknown is retried like any store
    /// error, and the next attempt finds what did commit.
    async fn attempt(
        &self,
        entry: &InboxEntry<'_>,
        envelope: &EventEnvelope,
        max_attempts: u32,
    ) -> Result<Attempt, StoreError> {
        let mut tx = self.store.inbox_begin().await?;
        let inserted = match self.store.inbox_try_insert(&mut tx, entry).await {
            Ok(outcome) => outcome,
            Err(e) => {
                self.store.inbox_rollback(tx).await;
                return Err(e);
            }
        };
        self.marks.hit(match inserted {
            InsertOutcome::Inserted => Mark::InboxInserted,
            InsertOutcome::InFlightRetry { .. } => Mark::InFlightRetry,
            InsertOutcome::AlreadyProcessed => Mark::AlreadyProcessed,
        });
        if inserted == InsertOutcome::AlreadyProcessed {
            self.store.inbox_commit(tx).await?;
            return Ok(Attempt::AlreadyProcessed);
        }
        let (recorded, attempt) = match self.run_handler(&mut tx, envelope).await {
            Ok(()) => (self.store.inbox_mark_processed(&mut tx, entry).await, None),
            Err(error) if error.is_unavailable() => {
                // The handler's database is unavailable: nobody's fault, no
                // attempt counts; retried in place like the inbox's own.
                self.marks.hit(Mark::HandlerUnavailable);
                self.store.inbox_rollback(tx).await;
                return Err(StoreError::Unavailable(error.message().to_owned()));
            }
            Err(error) => {
                self.marks.hit(Mark::HandlerFailed);
                tracing::debug!(event_id = %entry.event_id, error = %error, "handler failed");
                let text = truncate_chars(error.message(), LAST_ERROR_MAX_CHARS);
                match self
                    .store
                    .inbox_record_failure(&mut tx, entry, &text, max_attempts)
                    .await
                {
                    Ok(record) => (Ok(()), Some((record, text))),
                    Err(e) => (Err(e), None),
                }
            }
        };
        if let Err(e) = recorded {
            self.store.inbox_rollback(tx).await;
            return Err(e);
        }
        self.store.inbox_commit(tx).await?;
        Ok(match attempt {
            Some((record, text)) => Attempt::Failed(record, text),
            None => Attempt::Applied,
        })
    }

    /// Runs the handler under its deadline with a panic caught: a handler
    /// that panics or overruns has failed, like one that returns `Err`, so
    /// its work is rolled back and the attempt counts (a poison event thus
    /// reaches the dead-letter queue instead of taking every worker down).
    /// A panic is only caught where panics unwind (not under
    /// `panic = "abort"`).
    async fn run_handler(
        &self,
        tx: &mut S::Tx,
        envelope: &EventEnvelope,
    ) -> Result<(), HandlerError> {
        let limit = self.settings.handler_timeout;
        let guarded = CatchUnwind(Box::pin(self.handler.handle(tx, envelope)));
        let started = self.clock.now();
        let ran = with_deadline(&*self.clock, limit, guarded).await;
        metrics::histogram!(
            metric::HANDLER_DURATION,
            metric::LABEL => self.settings.spec.queue.clone()
        )
        .record(self.clock.now().saturating_sub(started).as_secs_f64());
        match ran {
            Some(Ok(result)) => result,
            Some(Err(panic)) => {
                self.marks.hit(Mark::HandlerPanicked);
                Err(HandlerError::msg(format!("handler panicked: {panic}")))
            }
            None => {
                self.marks.hit(Mark::HandlerTimedOut);
                Err(HandlerError::msg(format!(
                    "handler ran past its deadline of {} s",
                    limit.as_secs_f64()
                )))
            }
        }
    }

    /// Re-runs the handler, with the inbox's semantics, for unprocessed
    /// rows of this subscription matching `filter`, each given a fresh
    /// budget right before its own attempt (so a replay cut short leaves the
    /// rows it did not reach as they were: still dead-lettered, still
    /// findable). No broker is involved: a dead-lettered delivery stays in
    /// `<queue>.dlq` for the record; its effect comes from here.
    pub async fn replay(
        &self,
        filter: &InboxFilter,
    ) -> Result<Vec<(uuid::Uuid, ReplayOutcome)>, StoreError> {
        let queue = &self.settings.spec.queue;
        let span = tracing::info_span!(
            "outbox.replay",
            messaging.destination.subscription.name = %queue,
            outbox.rows = Empty,
        );
        self.replay_rows(filter).instrument(span).await
    }

    async fn replay_rows(
        &self,
        filter: &InboxFilter,
    ) -> Result<Vec<(uuid::Uuid, ReplayOutcome)>, StoreError> {
        let mut filter = filter.clone();
        filter.subscription = Some(self.settings.spec.queue.clone());
        let rows = self.store.inbox_list_unprocessed(&filter).await?;
        Span::current().record("outbox.rows", rows.len());
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let outcome = match EventEnvelope::decode_delivery(&row.payload) {
                Err(reason) => ReplayOutcome::Undecodable { reason },
                Ok(envelope) => {
                    let entry = InboxEntry {
                        event_id: row.event_id,
                        subscription: &row.subscription,
                        routing_key: &row.routing_key,
                        payload: &row.payload,
                        fresh_budget: true,
                    };
                    // A budget of 1: a row whose handler fails again is in no
                    // queue any more, so it stays dead-lettered until the
                    // next replay, or nothing would ever run it again. Found
                    // by the simulation (producer_and_consumer_swarm, seed 43).
                    match self.attempt(&entry, &envelope, 1).await? {
                        Attempt::Applied => {
                            self.marks.hit(Mark::ReplayApplied);
                            self.counters
                                .count(&DeliveryOutcome::Processed, &self.settings.spec.queue);
                            ReplayOutcome::Applied
                        }
                        Attempt::AlreadyProcessed => {
                            self.marks.hit(Mark::ReplayAlreadyProcessed);
                            ReplayOutcome::AlreadyProcessed
                        }
                        Attempt::Failed(_, error) => {
                            self.marks.hit(Mark::ReplayFailedAgain);
                            ReplayOutcome::Failed { error }
                        }
                    }
                }
            };
            out.push((row.event_id, outcome));
        }
        Ok(out)
    }
}

enum Attempt {
    Applied,
    AlreadyProcessed,
    /// The handler failed with this error; its attempt is recorded.
    Failed(AttemptRecord, String),
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
