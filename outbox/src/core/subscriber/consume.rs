//! Consuming: the workers, their consumers, and gathering deliveries into
//! batches (in key order on an ordered subscription), then settling them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll};

use tokio::sync::watch;
use tracing::{Instrument, Span, field::Empty};

use super::outcome::DeliveryOutcome;
use super::replay::REPLAY_PAGE;
use super::{
    CLOSE_TIMEOUT, Handler, RELEASE_EVERY, RETRY_BACKOFF_MAX, RETRY_BACKOFF_MIN, Subscriber,
    SubscriptionState,
};
use crate::core::durability::GateError;
use crate::core::marks::Mark;
use crate::core::ports::{
    Clock, ConsumerBroker, Delivery, DeliverySource, InboxEntry, InboxStore, KeySeq,
    SubscriptionSpec,
};
use crate::core::{sleep_or_shutdown, with_deadline};
use crate::envelope::EventEnvelope;
use crate::error::{BrokerError, SubscribeError};
use crate::telemetry::{propagation, subscriber as metric};

/// A delivery decoded (or not), with its span.
pub(super) struct Prepared {
    pub(super) delivery: Delivery,
    pub(super) span: Span,
    pub(super) decoded: Result<EventEnvelope, DeliveryOutcome>,
}

/// A decoded delivery of a batch: `slot` is its place among the batch's
/// deliveries.
pub(super) struct Item<'a> {
    pub(super) slot: usize,
    pub(super) entry: InboxEntry<'a>,
    pub(super) envelope: &'a EventEnvelope,
    pub(super) span: Span,
    /// Its handler overran once while the database answered: the next
    /// overrun counts an attempt.
    pub(super) overran: AtomicBool,
}

/// Polls every future, in order, until all are done: the workers of one
/// consumer, without spawning (so the caller's runtime, real or simulated,
/// schedules them deterministically).
pub(super) struct JoinAll<'a> {
    pub(super) futures: Vec<Pin<Box<dyn Future<Output = ()> + Send + 'a>>>,
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

/// Whether a batch may be settled as decided (replicated before acked).
enum Replicated {
    /// The named standbys hold what it rests on (or no gate).
    Yes,
    /// A failover came between the batch and the wait: everything goes
    /// back to the queue.
    FailedOver,
    /// Shutdown came first: nothing is settled.
    Stopped,
}

impl<S, B, C, H> Subscriber<S, B, C, H>
where
    S: InboxStore,
    B: ConsumerBroker,
    C: Clock,
    H: Handler<S::HandlerTx>,
{
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
        self.set_state(SubscriptionState::Starting);
        let stopped = || {
            self.set_state(SubscriptionState::Stopped);
            Ok(())
        };
        loop {
            if *shutdown.borrow() {
                return stopped();
            }
            match self.open_consumers(&specs).await {
                Ok(consumers) => {
                    first = false;
                    backoff = RETRY_BACKOFF_MIN;
                    tracing::info!(queue = %queue, "subscriber consuming");
                    self.set_state(SubscriptionState::Consuming);
                    self.consume(&consumers, &shutdown).await;
                    self.close_consumers(&consumers).await;
                    if *shutdown.borrow() {
                        tracing::info!(queue = %queue, "subscriber stopped");
                        return stopped();
                    }
                    self.marks.hit(Mark::ConsumerReopened);
                    tracing::warn!(queue = %queue, "consumer ended; reopening");
                    self.set_state(SubscriptionState::Reconnecting {
                        error: "its consumer ended".into(),
                    });
                }
                Err(source @ BrokerError::Channel(_)) if first => {
                    self.set_state(SubscriptionState::Failed {
                        error: source.to_string(),
                    });
                    return Err(SubscribeError::Setup {
                        queue: queue.clone(),
                        source,
                    });
                }
                Err(e) => {
                    first = false;
                    tracing::warn!(queue = %queue, error = %e, "cannot open the subscription; retrying");
                    self.set_state(SubscriptionState::Reconnecting {
                        error: e.to_string(),
                    });
                }
            }
            if sleep_or_shutdown(&*self.clock, backoff, &mut shutdown).await {
                return stopped();
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// One consumer, on a channel of its own, per worker (on an ordered
    /// subscription, one per partition queue): a worker's deliveries are
    /// then the only unsettled ones of its channel, so a batch is acked
    /// with one `multiple` frame. All or none.
    pub(super) async fn open_consumers(
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
    pub(super) async fn close_consumers(&self, consumers: &[B::Consumer]) {
        for consumer in consumers {
            let _ = with_deadline(&*self.clock, CLOSE_TIMEOUT, consumer.consumer_close()).await;
        }
    }

    /// Runs one worker per consumer until shutdown, or until any consumer
    /// ends (then all stop, to reopen together). Each worker takes a
    /// delivery, then whatever else arrives within `batch_linger` of it (up
    /// to `batch_max` in all), and applies them in one transaction.
    pub(super) async fn consume(
        &self,
        consumers: &[B::Consumer],
        shutdown: &watch::Receiver<bool>,
    ) {
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
    pub(super) async fn release_orphans(&self) {
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
    pub(super) async fn gather(
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
    pub(super) async fn deliver_in_key_order(
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
    /// transaction: the first pass without savepoints, and after a handler
    /// failure a pass with a savepoint per delivery, so a failed handler
    /// rolls back only its own work; they are acked or nacked only once
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
        let mut items = self.items(&prepared);
        // Event-id order (UUID v7: creation order): every batch takes its
        // inbox row locks in the same order, so two batches holding the
        // same events (a redelivery storm) never wait on each other in a
        // cycle. Found by the simulation (producer_and_consumer_swarm,
        // seed 0: two workers' batches deadlocked on two duplicated events).
        items.sort_by_key(|i| i.entry.event_id);
        let since = self.timeline_before(shutdown).await;
        self.apply_until_decided(&items, &mut outcomes, shutdown)
            .await;
        drop(items);
        let mut settled = Vec::with_capacity(prepared.len());
        for (p, outcome) in prepared.iter().zip(outcomes) {
            settled.push(match outcome.unwrap_or(DeliveryOutcome::Requeued) {
                // A keyed one still holds its key (see `given_up`).
                o if o.given_up_at_once() => self.settle_given_up(p, o).await,
                o => o,
            });
        }
        match self.replicated(&settled, since, shutdown).await {
            Replicated::Yes => self.settle_all(consumer, &prepared, &settled).await,
            Replicated::FailedOver => {
                // What the batch committed or read may be gone with the
                // old primary: every delivery goes back to the queue, and
                // the new primary's inbox decides each again.
                self.marks.hit(Mark::RequeuedAfterFailover);
                for outcome in &mut settled {
                    if !outcome.requeues() {
                        *outcome = DeliveryOutcome::Requeued;
                    }
                }
                self.settle_all(consumer, &prepared, &settled).await;
            }
            // Shutdown came while the standbys had not flushed the batch:
            // nothing of it is settled, the broker redelivers it once the
            // consumer closes, and the inbox absorbs the repeat.
            Replicated::Stopped => self.marks.hit(Mark::RequeuedAtShutdown),
        }
        for (p, outcome) in prepared.iter().zip(&settled) {
            p.span.record("outbox.inbox.outcome", outcome.label());
            self.counters.count(outcome, queue);
        }
        settled
    }

    /// The deliveries that decoded, as the inbox entries to apply.
    fn items<'p>(&'p self, prepared: &'p [Prepared]) -> Vec<Item<'p>> {
        let queue = &self.settings.spec.queue;
        prepared
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
            .collect()
    }

    /// Acks and nacks a batch's deliveries as their outcomes say.
    async fn settle_all(
        &self,
        consumer: &B::Consumer,
        prepared: &[Prepared],
        settled: &[DeliveryOutcome],
    ) {
        // The nacks (rare) all at once, then the acks in one call: on a
        // worker's own channel, one `basic.ack multiple` frame.
        JoinAll {
            futures: prepared
                .iter()
                .zip(settled)
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
            .zip(settled)
            .filter(|(_, outcome)| outcome.acks())
            .map(|(p, _)| p.delivery.tag)
            .collect();
        if !acks.is_empty()
            && let Err(e) = consumer.delivery_ack_many(&acks).await
        {
            self.settle_lost(&e);
        }
    }

    /// Replicated before acked: with durable standbys, waits until they
    /// have flushed the primary's WAL past the batch's commit and past
    /// every commit it read, before anything of the batch is acked or
    /// dead-lettered (a requeue needs no wait: it promises nothing). A
    /// primary that cannot be asked (it may be failing over) is asked
    /// again after a backoff. False if shutdown came first.
    async fn replicated(
        &self,
        settled: &[DeliveryOutcome],
        since: Option<u32>,
        shutdown: &watch::Receiver<bool>,
    ) -> Replicated {
        let Some(gate) = &self.durable else {
            return Replicated::Yes;
        };
        if settled.iter().all(DeliveryOutcome::requeues) {
            return Replicated::Yes;
        }
        // Without the timeline from before the batch (shutdown came while
        // it was asked for) nothing vouches for where it ran.
        let Some(since) = since else {
            return Replicated::Stopped;
        };
        let stopped = || *shutdown.borrow();
        let mut pause = RETRY_BACKOFF_MIN;
        loop {
            match gate
                .wait(&*self.store, &*self.clock, since, None, &stopped)
                .await
            {
                Ok(waited) => {
                    if waited {
                        self.marks.hit(Mark::AckHeldForStandby);
                    }
                    return Replicated::Yes;
                }
                Err(GateError::Store(e)) => tracing::debug!(
                    queue = %self.settings.spec.queue,
                    error = %e,
                    "acks wait for the standbys: the primary could not be asked"
                ),
                Err(GateError::FailedOver { .. }) => return Replicated::FailedOver,
                Err(_) => return Replicated::Stopped,
            }
            if sleep_or_shutdown(&*self.clock, pause, &mut shutdown.clone()).await {
                return Replicated::Stopped;
            }
            pause = (pause * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// With durable standbys, the primary's timeline before a batch
    /// begins, asked again after a backoff while the database cannot
    /// answer (a pooled session broken by a failover, say); `None` without
    /// a gate, or if shutdown came first.
    async fn timeline_before(&self, shutdown: &watch::Receiver<bool>) -> Option<u32> {
        let gate = self.durable.as_ref()?;
        let mut pause = RETRY_BACKOFF_MIN;
        loop {
            match gate.timeline(&*self.store).await {
                Ok(timeline) => return Some(timeline),
                Err(e) => tracing::debug!(
                    queue = %self.settings.spec.queue,
                    error = %e,
                    "the primary's timeline could not be read before a batch"
                ),
            }
            if sleep_or_shutdown(&*self.clock, pause, &mut shutdown.clone()).await {
                return None;
            }
            pause = (pause * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// Decodes a delivery, opens its span and logs what is wrong with it.
    pub(super) fn prepare(&self, delivery: Delivery) -> Prepared {
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
        let span = self.span_of(&delivery, &decoded);
        span.in_scope(|| self.log_prepared(&delivery, &decoded));
        Prepared {
            delivery,
            span,
            decoded,
        }
    }

    /// The delivery's `process <queue>` span, its parent the trace context
    /// the delivery carries (its AMQP headers, else its envelope's).
    fn span_of(
        &self,
        delivery: &Delivery,
        decoded: &Result<EventEnvelope, DeliveryOutcome>,
    ) -> tracing::Span {
        let spec = &self.settings.spec;
        let queue = &spec.queue;
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
        span
    }

    /// Logs what is wrong with a delivery, or odd about it.
    fn log_prepared(&self, delivery: &Delivery, decoded: &Result<EventEnvelope, DeliveryOutcome>) {
        let queue = &self.settings.spec.queue;
        match decoded {
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
    }

    /// Acks or nacks a delivery as its outcome says.
    pub(super) async fn settle(&self, consumer: &B::Consumer, tag: u64, outcome: &DeliveryOutcome) {
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
    pub(super) fn settle_lost(&self, e: &BrokerError) {
        self.marks.hit(Mark::SettleLost);
        tracing::debug!(queue = %self.settings.spec.queue, error = %e, "ack/nack lost with the channel");
    }
}
