//! Conformance of the consumer side of the broker: the same bodies against
//! `LapinBroker` on the local RabbitMQ (through a TCP proxy that can cut the
//! connection) and `SimBroker` on the fake broker in a simulation.

use std::future::Future;
use std::time::Duration;

use outbox::core::ports::{
    Broker, Confirm, ConsumerBroker, Delivery, DeliverySource, OutgoingMessage, PublishChannel,
    SubscriptionSpec,
};
use outbox::trace_context::TraceContext;
use outbox::{EventEnvelope, LapinBroker};
use sim::adapters::{Hooks, SimBroker};
use sim::fakes::mq::{self, MqState};
use sim::trace::Trace;

#[cfg(not(madsim))]
use crate::common;
use crate::harness::in_sim;

/// Longest wait for a delivery that must come.
const ARRIVES: Duration = Duration::from_secs(5);
/// Longest wait for a dead letter that waited for room: the dead-letter
/// worker retries every second here.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(20);
/// How long to watch for a delivery that must not come.
const QUIET: Duration = Duration::from_millis(400);

trait ConsumeArm {
    type B: ConsumerBroker + Broker;
    /// The subscriber's broker (its connection can be cut).
    fn broker(&self) -> &Self::B;
    /// A broker to publish with, not affected by cuts.
    fn publisher(&self) -> &Self::B;
    fn spec(&self, prefetch: u16) -> SubscriptionSpec;
    /// Messages waiting in `<queue>.dlq`.
    async fn dlq_len(&self) -> usize;
    /// Breaks the subscriber's connections.
    async fn cut(&self);
    /// Publishes an empty message with `routing_key` and no headers at
    /// all (as a foreign publisher might), not through the library.
    async fn publish_bare(&self, exchange: &str, routing_key: &str);
    /// Sets a `max-length` policy on `<queue>.dlq` (`None` clears it), as
    /// an operator would with `rabbitmqctl set_policy`.
    async fn dlq_max_length(&self, max: Option<usize>);
    /// Purges `<queue>.dlq`, as an operator draining it would; how many
    /// messages went.
    async fn dlq_purge(&self) -> usize;
}

#[cfg(not(madsim))]
struct Real {
    broker: LapinBroker,
    publisher: LapinBroker,
    proxy: common::Proxy,
    queue: String,
    exchange: String,
    admin: lapin::Connection,
}

#[cfg(not(madsim))]
impl ConsumeArm for Real {
    type B = LapinBroker;
    fn broker(&self) -> &LapinBroker {
        &self.broker
    }
    fn publisher(&self) -> &LapinBroker {
        &self.publisher
    }
    fn spec(&self, prefetch: u16) -> SubscriptionSpec {
        SubscriptionSpec {
            queue: self.queue.clone(),
            exchange: self.exchange.clone(),
            bindings: vec!["orders.*".into()],
            prefetch,
            queue_type: outbox::QueueType::Quorum,
            partitions: 0,
            partition: None,
        }
    }
    async fn dlq_len(&self) -> usize {
        let ch = self.admin.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                format!("{}.dlq", self.queue).as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        q.message_count() as usize
    }
    async fn cut(&self) {
        self.proxy.cut();
    }
    async fn publish_bare(&self, exchange: &str, routing_key: &str) {
        let ch = self.admin.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        ch.basic_publish(
            exchange.into(),
            routing_key.into(),
            Default::default(),
            b"{}",
            lapin::BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    async fn dlq_max_length(&self, max: Option<usize>) {
        let name = format!("{}.dlq", self.queue);
        let definition = max.map(|n| format!("{{\"max-length\": {n}}}"));
        let args: Vec<String> = match &definition {
            Some(d) => [
                "set_policy",
                "--apply-to",
                "queues",
                &name,
                &format!("^{name}$"),
                d,
            ]
            .map(String::from)
            .to_vec(),
            None => vec!["clear_policy".into(), name.clone()],
        };
        rabbitmqctl(args).await;
    }
    async fn dlq_purge(&self) -> usize {
        let ch = self.admin.create_channel().await.unwrap();
        let name = format!("{}.dlq", self.queue);
        let purged = ch
            .queue_purge(name.as_str().into(), Default::default())
            .await
            .unwrap();
        purged as usize
    }
}

/// Runs `rabbitmqctl -q` on the local node; panics naming the command if it
/// fails.
#[cfg(not(madsim))]
async fn rabbitmqctl(args: Vec<String>) {
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("timeout")
            .args(["60", "rabbitmqctl", "-q"])
            .args(&args)
            .status()
            .map(|s| (s, args))
    })
    .await
    .unwrap();
    let (status, args) = status.expect("rabbitmqctl runs");
    assert!(status.success(), "rabbitmqctl {args:?}: {status}");
}

struct Fake {
    broker: SimBroker,
    publisher: SimBroker,
    state: MqState,
}

impl ConsumeArm for Fake {
    type B = SimBroker;
    fn broker(&self) -> &SimBroker {
        &self.broker
    }
    fn publisher(&self) -> &SimBroker {
        &self.publisher
    }
    fn spec(&self, prefetch: u16) -> SubscriptionSpec {
        SubscriptionSpec {
            queue: "billing.orders".into(),
            exchange: "canopy.events".into(),
            bindings: vec!["orders.*".into()],
            prefetch,
            queue_type: outbox::QueueType::Quorum,
            partitions: 0,
            partition: None,
        }
    }
    async fn dlq_len(&self) -> usize {
        self.state
            .queues
            .lock()
            .unwrap()
            .ready("billing.orders.dlq")
            .len()
    }
    async fn cut(&self) {
        self.state.close_all_connections();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    async fn publish_bare(&self, exchange: &str, routing_key: &str) {
        self.state.queues.lock().unwrap().inject(
            exchange,
            mq::queues::QueuedMessage {
                message_id: None,
                routing_key: routing_key.into(),
                body: sim::wire::WireBody::from_bytes(b"{}"),
                redelivered: false,
                trace: None,
                ordering: None,
                bucket: None,
            },
        );
    }
    async fn dlq_max_length(&self, max: Option<usize>) {
        self.state
            .queues
            .lock()
            .unwrap()
            .set_max_length("billing.orders.dlq", max);
        self.state.tick(sim::sim_now());
    }
    async fn dlq_purge(&self) -> usize {
        let purged = self
            .state
            .queues
            .lock()
            .unwrap()
            .purge("billing.orders.dlq");
        // What waited for room goes now, as the broker's retry would.
        self.state.tick(sim::sim_now());
        purged
    }
}

#[cfg(not(madsim))]
async fn with_real<F, Fut>(body: F)
where
    F: FnOnce(Real) -> Fut,
    Fut: Future<Output = ()>,
{
    let proxy = common::Proxy::start("127.0.0.1:5672").await;
    let admin = common::connect().await;
    let queue = common::unique("consume");
    let exchange = common::unique("consume.x");
    // A quorum queue's dead-letter worker retries what a target refused
    // every this many milliseconds (180 000 by default), read when the
    // queue starts: short, so the dead-letter body waits seconds, not
    // minutes. RabbitMQ's own test suites set it the same way.
    rabbitmqctl(
        [
            "eval",
            "application:set_env(rabbit, dead_letter_worker_publisher_confirm_timeout, 1000).",
        ]
        .map(String::from)
        .to_vec(),
    )
    .await;
    let arm = Real {
        broker: LapinBroker::new(proxy.amqp_url()),
        publisher: LapinBroker::new(common::amqp_url()),
        proxy,
        queue,
        exchange,
        admin,
    };
    // The ordered body declares up to 4 partitions.
    let declared = SubscriptionSpec {
        partitions: 4,
        ..arm.spec(1)
    };
    body(arm).await;
    common::delete_ordered_subscription(&common::connect().await, &declared).await;
}

fn with_fake<F, Fut>(body: F)
where
    F: FnOnce(Fake) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let trace = Trace::default();
    let state = MqState::new(5, trace.clone());
    let server = state.clone();
    in_sim(
        "rabbit",
        move || mq::serve(server.clone()),
        move || async move {
            body(Fake {
                broker: SimBroker::new("consumer", trace.clone(), Hooks::new(1)),
                publisher: SimBroker::new("producer", trace, Hooks::new(2)),
                state,
            })
            .await;
        },
    );
}

async fn publish<A: ConsumeArm>(arm: &A, exchange: &str, keys: &[&str]) -> Vec<EventEnvelope> {
    let mut ch = arm.publisher().channel_open().await.unwrap();
    ch.channel_confirm_select().await.unwrap();
    let mut out = Vec::new();
    for key in keys {
        let e = EventEnvelope::new(*key, serde_json::json!({ "k": key }));
        let body = e.encode(&Default::default()).unwrap();
        let confirm = ch
            .channel_publish(OutgoingMessage {
                exchange,
                routing_key: key,
                message_id: e.id,
                body: body.as_bytes(),
                trace: None,
                ordering: None,
            })
            .await
            .unwrap();
        assert_eq!(confirm.await.unwrap(), Confirm::Ack);
        out.push(e);
    }
    ch.channel_close().await;
    out
}

async fn next<C: DeliverySource>(c: &C) -> Delivery {
    tokio::time::timeout(ARRIVES, c.delivery_next())
        .await
        .expect("a delivery arrives")
        .expect("the consumer is live")
}

async fn quiet<C: DeliverySource>(c: &C) {
    if let Ok(Some(d)) = tokio::time::timeout(QUIET, c.delivery_next()).await {
        panic!("unexpected delivery {d:?}");
    }
}

fn id_of(d: &Delivery) -> uuid::Uuid {
    EventEnvelope::decode(&d.body).unwrap().id
}

/// `c` ends (with `what`); the subscription, opened again, delivers
/// `unacked` again, marked redelivered, and nothing else.
async fn ends_and_gives_back<A: ConsumeArm>(
    arm: &A,
    spec: &SubscriptionSpec,
    c: <A::B as ConsumerBroker>::Consumer,
    unacked: uuid::Uuid,
    what: &str,
) {
    let end = tokio::time::timeout(ARRIVES, async {
        while c.delivery_next().await.is_some() {}
    })
    .await;
    assert!(end.is_ok(), "the consumer ends with {what}");
    c.consumer_close().await;
    let c = arm.broker().subscription_open(spec).await.unwrap();
    let back = next(&c).await;
    assert_eq!(id_of(&back), unacked, "the unacked delivery is back");
    assert!(back.redelivered);
    c.delivery_ack(back.tag).await.unwrap();
    quiet(&c).await;
    c.consumer_close().await;
}

/// Publishes one event of `key` numbered `seq` through the library (so
/// with its bucket header).
async fn publish_keyed<A: ConsumeArm>(arm: &A, exchange: &str, key: &str, seq: i64) -> uuid::Uuid {
    let mut ch = arm.publisher().channel_open().await.unwrap();
    ch.channel_confirm_select().await.unwrap();
    let e = EventEnvelope::new("orders.keyed", serde_json::json!({ "seq": seq }))
        .with_ordering_key(key);
    let body = e.encode(&Default::default()).unwrap();
    let ordering = outbox::core::ports::KeySeq {
        key: key.into(),
        seq,
    };
    let confirm = ch
        .channel_publish(OutgoingMessage {
            exchange,
            routing_key: "orders.keyed",
            message_id: e.id,
            body: body.as_bytes(),
            trace: None,
            ordering: Some(&ordering),
        })
        .await
        .unwrap();
    assert_eq!(confirm.await.unwrap(), Confirm::Ack);
    ch.channel_close().await;
    e.id
}

/// A key whose bucket lands in partition `p` of 2.
fn key_in(p: u16) -> String {
    (0..)
        .map(|n| format!("acct-{n}"))
        .find(|k| {
            let ks = outbox::core::ports::KeySeq {
                key: k.clone(),
                seq: 1,
            };
            outbox::core::ports::bucket_of(Some(&ks), uuid::Uuid::nil()) % 2 == p
        })
        .expect("some key")
}

// ---- bodies --------------------------------------------------------------

/// An ordered subscription (issue 27): each key's events go to its
/// bucket's partition, one without a bucket header to partition 0; a
/// partition delivers to its first consumer only, the others waiting;
/// requeued deliveries come back in the order they were requeued, before
/// the rest; and when the active consumer goes, the next one gets its
/// unsettled deliveries back in the order they were first delivered.
async fn an_ordered_subscription_has_one_active_consumer_per_partition<A: ConsumeArm>(arm: A) {
    let mut spec = arm.spec(10);
    spec.partitions = 2;
    let on = |p: u16| SubscriptionSpec {
        partition: Some(p),
        ..spec.clone()
    };
    let active = arm.broker().subscription_open(&on(0)).await.unwrap();
    let standby = arm.broker().subscription_open(&on(0)).await.unwrap();
    let other = arm.broker().subscription_open(&on(1)).await.unwrap();
    let (a, b) = (key_in(0), key_in(1));
    let a1 = publish_keyed(&arm, &spec.exchange, &a, 1).await;
    let a2 = publish_keyed(&arm, &spec.exchange, &a, 2).await;
    let a3 = publish_keyed(&arm, &spec.exchange, &a, 3).await;
    let b1 = publish_keyed(&arm, &spec.exchange, &b, 1).await;
    arm.publish_bare(&spec.exchange, "orders.bare").await;
    let got: Vec<Delivery> = vec![
        next(&active).await,
        next(&active).await,
        next(&active).await,
    ];
    assert_eq!(got.iter().map(id_of).collect::<Vec<_>>(), [a1, a2, a3]);
    assert_eq!(got[1].ordering.as_ref().map(|o| o.seq), Some(2));
    let bare = next(&active).await;
    assert_eq!(bare.body, b"{}", "no bucket: partition 0");
    active.delivery_ack(bare.tag).await.unwrap();
    assert_eq!(id_of(&next(&other).await), b1);
    quiet(&standby).await;
    // Requeued: back in the order they were requeued, before anything else.
    active.delivery_nack(got[0].tag, true).await.unwrap();
    active.delivery_nack(got[1].tag, true).await.unwrap();
    let a4 = publish_keyed(&arm, &spec.exchange, &a, 4).await;
    let again: Vec<Delivery> = vec![
        next(&active).await,
        next(&active).await,
        next(&active).await,
    ];
    assert_eq!(again.iter().map(id_of).collect::<Vec<_>>(), [a1, a2, a4]);
    assert!(again[0].redelivered && again[1].redelivered && !again[2].redelivered);
    quiet(&standby).await;
    // The active consumer goes: the standby gets its unsettled deliveries
    // in the order they were delivered to it (a3 first: a1 and a2 came
    // again after it).
    active.consumer_close().await;
    let handed: Vec<uuid::Uuid> = vec![
        id_of(&next(&standby).await),
        id_of(&next(&standby).await),
        id_of(&next(&standby).await),
        id_of(&next(&standby).await),
    ];
    assert_eq!(handed, [a3, a1, a2, a4]);
    standby.consumer_close().await;
    other.consumer_close().await;
}

/// The trace context and the ordering key and number (issue 27) travel as
/// AMQP headers, beside each other or not at all.
async fn trace_context_headers_travel_with_the_message<A: ConsumeArm>(arm: A) {
    let spec = arm.spec(10);
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    let tc = TraceContext::parse(
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        Some("congo=t61rcWkgMzE"),
    )
    .unwrap();
    let mut ch = arm.publisher().channel_open().await.unwrap();
    ch.channel_confirm_select().await.unwrap();
    let ks = outbox::core::ports::KeySeq {
        key: "order-7".into(),
        seq: 3,
    };
    for (trace, ordering) in [(Some(&tc), Some(&ks)), (None, None)] {
        let e = EventEnvelope::new("orders.t", serde_json::json!({}));
        let body = e.encode(&Default::default()).unwrap();
        let confirm = ch
            .channel_publish(OutgoingMessage {
                exchange: &spec.exchange,
                routing_key: "orders.t",
                message_id: e.id,
                body: body.as_bytes(),
                trace,
                ordering,
            })
            .await
            .unwrap();
        assert_eq!(confirm.await.unwrap(), Confirm::Ack);
    }
    ch.channel_close().await;
    let first = next(&c).await;
    assert_eq!(first.trace.as_ref(), Some(&tc));
    assert_eq!(first.ordering.as_ref(), Some(&ks));
    let second = next(&c).await;
    assert_eq!(second.trace, None);
    assert_eq!(second.ordering, None);
    c.delivery_ack(first.tag).await.unwrap();
    c.delivery_ack(second.tag).await.unwrap();
    c.consumer_close().await;
}

async fn deliveries_are_acked_requeued_and_dead_lettered<A: ConsumeArm>(arm: A) {
    let spec = arm.spec(10);
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    let sent = publish(
        &arm,
        &spec.exchange,
        &["orders.a", "other.x", "orders.b", "orders.c"],
    )
    .await;
    let (a, b, cc) = (&sent[0], &sent[2], &sent[3]);
    let d1 = next(&c).await;
    let d2 = next(&c).await;
    let d3 = next(&c).await;
    assert_eq!(
        [id_of(&d1), id_of(&d2), id_of(&d3)],
        [a.id, b.id, cc.id],
        "bound keys only, in order"
    );
    assert!(!d1.redelivered && !d2.redelivered);
    assert_eq!(d1.message_id, Some(a.id.to_string()));
    assert_eq!(d1.routing_key, "orders.a");
    c.delivery_ack(d1.tag).await.unwrap();
    c.delivery_nack(d2.tag, true).await.unwrap();
    let again = next(&c).await;
    assert_eq!(id_of(&again), b.id);
    assert!(again.redelivered, "a requeued delivery comes back flagged");
    c.delivery_ack(again.tag).await.unwrap();
    c.delivery_nack(d3.tag, false).await.unwrap();
    quiet(&c).await;
    assert_eq!(arm.dlq_len().await, 1, "nack without requeue dead-letters");
    c.consumer_close().await;
}

/// A dead letter that its dead-letter queue cannot take (full under a
/// `max-length` policy) waits, and arrives once there is room: quorum
/// queues declared as the library declares them dead-letter at least once.
/// A declaration that falls back to at-most-once drops it. (A quorum queue
/// is full once it holds more than its `max-length`, so the first dead
/// letter fills it; it takes more again once an operator drains it.)
async fn a_dead_letter_waits_for_room_in_the_dead_letter_queue<A: ConsumeArm>(arm: A) {
    let spec = arm.spec(10);
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    arm.dlq_max_length(Some(0)).await;
    let sent = publish(&arm, &spec.exchange, &["orders.a", "orders.b"]).await;
    let (first, second) = (next(&c).await, next(&c).await);
    assert_eq!([id_of(&first), id_of(&second)], [sent[0].id, sent[1].id]);
    c.delivery_nack(first.tag, false).await.unwrap();
    dlq_reaches(&arm, 1).await;
    c.delivery_nack(second.tag, false).await.unwrap();
    quiet(&c).await;
    assert_eq!(
        arm.dlq_len().await,
        1,
        "a full dead-letter queue takes nothing"
    );
    assert_eq!(arm.dlq_purge().await, 1);
    dlq_reaches(&arm, 1).await;
    arm.dlq_max_length(None).await;
    quiet(&c).await;
    assert_eq!(arm.dlq_len().await, 1);
    c.consumer_close().await;
}

/// Waits until `<queue>.dlq` holds `n` messages.
async fn dlq_reaches<A: ConsumeArm>(arm: &A, n: usize) {
    let deadline = tokio::time::Instant::now() + DEAD_LETTER_RETRY;
    while arm.dlq_len().await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the dead-letter queue never held {n}: a dead letter was dropped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn unacked_deliveries_come_back_after_the_connection_is_cut<A: ConsumeArm>(arm: A) {
    let spec = arm.spec(10);
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    let sent = publish(&arm, &spec.exchange, &["orders.a", "orders.b"]).await;
    let d1 = next(&c).await;
    let _d2 = next(&c).await;
    c.delivery_ack(d1.tag).await.unwrap();
    // An ack has no reply: give it time to arrive, or the cut may lose it
    // (which AMQP allows; this body is about the unacked one).
    tokio::time::sleep(Duration::from_millis(200)).await;
    arm.cut().await;
    ends_and_gives_back(&arm, &spec, c, sent[1].id, "its connection").await;
}

async fn the_prefetch_bounds_unacked_deliveries<A: ConsumeArm>(arm: A) {
    let spec = arm.spec(2);
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    publish(
        &arm,
        &spec.exchange,
        &["orders.a", "orders.b", "orders.c", "orders.d"],
    )
    .await;
    let d1 = next(&c).await;
    let _d2 = next(&c).await;
    quiet(&c).await;
    c.delivery_ack(d1.tag).await.unwrap();
    let _d3 = next(&c).await;
    quiet(&c).await;
    c.consumer_close().await;
}

async fn ack_many_settles_exactly_the_tags_it_is_given<A: ConsumeArm>(arm: A) {
    let spec = arm.spec(10);
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    let sent = publish(
        &arm,
        &spec.exchange,
        &["orders.a", "orders.b", "orders.c", "orders.d", "orders.e"],
    )
    .await;
    let mut d = Vec::new();
    for _ in 0..5 {
        d.push(next(&c).await);
    }
    // Contiguous from the first unsettled: one frame (`multiple`).
    c.delivery_ack_many(&[d[1].tag, d[0].tag]).await.unwrap();
    // With a gap (d[2] unsettled): each on its own, d[2] untouched.
    c.delivery_ack_many(&[d[3].tag, d[4].tag]).await.unwrap();
    // An ack has no reply: give them time to arrive before the cut.
    tokio::time::sleep(Duration::from_millis(200)).await;
    arm.cut().await;
    let end = tokio::time::timeout(ARRIVES, async {
        while c.delivery_next().await.is_some() {}
    })
    .await;
    assert!(end.is_ok(), "the consumer ends with its connection");
    c.consumer_close().await;
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    let back = next(&c).await;
    assert_eq!(
        id_of(&back),
        sent[2].id,
        "only the one not acked comes back"
    );
    assert!(back.redelivered);
    c.delivery_ack_many(&[back.tag]).await.unwrap();
    quiet(&c).await;
    c.consumer_close().await;
}

async fn an_ack_of_a_settled_tag_closes_the_channel<A: ConsumeArm>(arm: A) {
    let spec = arm.spec(10);
    let c = arm.broker().subscription_open(&spec).await.unwrap();
    let sent = publish(&arm, &spec.exchange, &["orders.a", "orders.b"]).await;
    let d1 = next(&c).await;
    let _d2 = next(&c).await;
    c.delivery_ack(d1.tag).await.unwrap();
    // Twice: the broker closes the channel (PRECONDITION_FAILED), which
    // ends the consumer and returns its unacked delivery to the queue.
    let _ = c.delivery_ack(d1.tag).await;
    ends_and_gives_back(&arm, &spec, c, sent[1].id, "its channel").await;
}

conformance!(rabbitmq: with_real, fake: with_fake;
    trace_context_headers_travel_with_the_message,
    an_ordered_subscription_has_one_active_consumer_per_partition,
    deliveries_are_acked_requeued_and_dead_lettered,
    a_dead_letter_waits_for_room_in_the_dead_letter_queue,
    unacked_deliveries_come_back_after_the_connection_is_cut,
    the_prefetch_bounds_unacked_deliveries,
    ack_many_settles_exactly_the_tags_it_is_given,
    an_ack_of_a_settled_tag_closes_the_channel,
);
