//! Conformance of the broker as a cluster (issue 26): the same bodies
//! against `LapinBroker` on the local three-node RabbitMQ cluster (nodes
//! stopped with `rabbitmqctl stop_app`, started with `start_app`) and
//! `SimBroker` on the fake cluster (nodes stopped as `stop_app` stops
//! them: their connections closed, new ones refused). Each client takes the
//! node list starting from a node the body names, as a service configured
//! with `CANOPY_MQ_AMQP_URLS` does.

use std::future::Future;
use std::time::Duration;

use outbox::core::ports::{
    Broker, Confirm, ConsumerBroker, Delivery, DeliverySource, OutgoingMessage, PublishChannel,
    SubscriptionSpec,
};
use outbox::{EventEnvelope, QueueType};
use sim::adapters::{Hooks, SimBroker};
use sim::fakes::mq::{self, MqState};
use sim::trace::Trace;

#[cfg(not(madsim))]
use crate::common;

/// Longest wait for a confirm or a delivery that must come: a quorum queue
/// whose leader stopped confirms once it has elected another.
const ARRIVES: Duration = Duration::from_secs(30);
/// How long a publish without a majority is watched for a confirm that
/// must not come.
const NO_MAJORITY_WAIT: Duration = Duration::from_secs(3);
/// Most connection attempts a client makes while its node goes away.
const TRIES: u32 = 20;

trait ClusterArm {
    type B: ConsumerBroker + Broker;
    /// A client whose node list starts at node `first` (1-based).
    fn client(&self, first: u16) -> Self::B;
    /// The body's subscription, of queue type `kind`.
    fn spec(&self, kind: QueueType) -> SubscriptionSpec;
    /// Stops node `n`'s broker (its connections close, new ones fail).
    async fn stop(&mut self, n: u16);
    /// Starts node `n`'s broker again, and waits until it serves.
    async fn start(&mut self, n: u16);
    /// Messages ready in `queue`.
    async fn ready(&self, queue: &str) -> usize;
}

#[cfg(not(madsim))]
struct Real {
    cluster: common::cluster::Cluster,
    stopped: Vec<common::cluster::Stopped>,
    queue: String,
    exchange: String,
}

#[cfg(not(madsim))]
impl ClusterArm for Real {
    type B = outbox::LapinBroker;
    fn client(&self, first: u16) -> outbox::LapinBroker {
        let list: Vec<String> = (0..3)
            .map(|i| common::cluster::node_url((first - 1 + i) % 3 + 1))
            .collect();
        outbox::LapinBroker::from_list(&list.join(",")).unwrap()
    }
    fn spec(&self, kind: QueueType) -> SubscriptionSpec {
        SubscriptionSpec {
            queue: self.queue.clone(),
            exchange: self.exchange.clone(),
            bindings: vec!["cluster.*".into()],
            prefetch: 16,
            queue_type: kind,
            partitions: 0,
            partition: None,
        }
    }
    async fn stop(&mut self, n: u16) {
        let s = self.cluster.stop(n);
        self.stopped.push(s);
    }
    async fn start(&mut self, n: u16) {
        // Dropping the guard starts the node and awaits its startup.
        self.stopped.retain(|s| s.node() != n);
    }
    async fn ready(&self, queue: &str) -> usize {
        // No body stops node 1 while it asks.
        common::cluster::queue_len(1, queue).await as usize
    }
}

#[cfg(not(madsim))]
async fn with_real<F, Fut>(body: F)
where
    F: FnOnce(Real) -> Fut,
    Fut: Future<Output = Real>,
{
    let cluster = common::cluster::Cluster::hold().await;
    let arm = Real {
        cluster,
        stopped: Vec::new(),
        queue: common::unique("cluster"),
        exchange: common::unique("cluster.x"),
    };
    let arm = body(arm).await;
    let (queue, exchange) = (arm.queue.clone(), arm.exchange.clone());
    // Every node is up again before the cleanup.
    drop(arm);
    let conn = common::cluster::connect(1).await;
    common::delete_subscription(&conn, &queue, &exchange).await;
}

struct Fake {
    state: MqState,
    trace: Trace,
}

impl ClusterArm for Fake {
    type B = SimBroker;
    fn client(&self, first: u16) -> SimBroker {
        SimBroker::new(format!("client-{first}"), self.trace.clone(), Hooks::new(1))
            .with_nodes(self.state.node_hosts(), usize::from(first - 1))
    }
    fn spec(&self, kind: QueueType) -> SubscriptionSpec {
        SubscriptionSpec {
            queue: "billing.cluster".into(),
            exchange: "canopy.events".into(),
            bindings: vec!["cluster.*".into()],
            prefetch: 16,
            queue_type: kind,
            partitions: 0,
            partition: None,
        }
    }
    async fn stop(&mut self, n: u16) {
        self.state
            .set_node_up(usize::from(n - 1), false, sim::sim_now());
    }
    async fn start(&mut self, n: u16) {
        self.state
            .set_node_up(usize::from(n - 1), true, sim::sim_now());
    }
    async fn ready(&self, queue: &str) -> usize {
        self.state.queues.lock().unwrap().ready(queue).len()
    }
}

fn with_fake<F, Fut>(body: F)
where
    F: FnOnce(Fake) -> Fut + Send + 'static,
    Fut: Future<Output = Fake> + 'static,
{
    let trace = Trace::default();
    let state = MqState::cluster(7, trace.clone(), 3);
    let hosts = state.node_hosts();
    let servers: Vec<_> = hosts
        .iter()
        .enumerate()
        .map(|(node, host)| {
            let s = state.clone();
            (host.clone(), move || mq::serve_node(s.clone(), node))
        })
        .collect();
    crate::harness::in_sim_hosts(servers, move || async move {
        body(Fake { state, trace }).await;
    });
}

/// Declares the subscription through `client` (opening and closing a
/// consumer, as a subscriber's start does).
async fn declare<B: ConsumerBroker>(client: &B, spec: &SubscriptionSpec) {
    let c = client.subscription_open(spec).await.unwrap();
    c.consumer_close().await;
}

/// Publishes `n` events on `client`, each awaited to its confirm; a
/// connection that fails is replaced (the drainer's reconnect) and the
/// event published again, at most [`TRIES`] times. Returns the confirms.
async fn publish<B: Broker>(client: &B, exchange: &str, n: usize) -> Vec<Confirm> {
    let mut out = Vec::new();
    let mut tries = 0;
    while out.len() < n {
        match publish_one(client, exchange).await {
            Ok(c) => out.push(c),
            Err(e) => {
                tries += 1;
                assert!(tries < TRIES, "no node took the publish: {e}");
                let generation = client.connection_generation();
                let _ = client.connection_reconnect(generation).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    out
}

async fn publish_one<B: Broker>(client: &B, exchange: &str) -> Result<Confirm, String> {
    let e = EventEnvelope::new("cluster.event", serde_json::json!({ "n": 1 }));
    let body = e.encode(&Default::default()).unwrap();
    let mut ch = client.channel_open().await.map_err(|e| e.to_string())?;
    ch.channel_confirm_select()
        .await
        .map_err(|e| e.to_string())?;
    let confirm = ch
        .channel_publish(OutgoingMessage {
            exchange,
            routing_key: "cluster.event",
            message_id: e.id,
            body: body.as_bytes(),
            trace: None,
            ordering: None,
        })
        .await
        .map_err(|e| e.to_string())?;
    let c = tokio::time::timeout(ARRIVES, confirm)
        .await
        .map_err(|_| "no confirm".to_owned())?
        .map_err(|e| e.to_string());
    ch.channel_close().await;
    c
}

async fn next<C: DeliverySource>(c: &C) -> Delivery {
    tokio::time::timeout(ARRIVES, c.delivery_next())
        .await
        .expect("a delivery arrives")
        .expect("the consumer is live")
}

// ---- bodies --------------------------------------------------------------

async fn a_classic_queue_on_a_stopped_node_drops_what_is_confirmed<A: ClusterArm>(mut arm: A) -> A {
    let spec = arm.spec(QueueType::Classic);
    declare(&arm.client(3), &spec).await;
    arm.stop(3).await;
    let confirms = publish(&arm.client(1), &spec.exchange, 10).await;
    assert_eq!(confirms, vec![Confirm::Ack; 10], "every publish is acked");
    arm.start(3).await;
    assert_eq!(arm.ready(&spec.queue).await, 0, "and none was kept");
    arm
}

async fn a_quorum_queue_keeps_what_it_confirmed_while_its_leader_is_down<A: ClusterArm>(
    mut arm: A,
) -> A {
    let spec = arm.spec(QueueType::Quorum);
    declare(&arm.client(3), &spec).await;
    arm.stop(3).await;
    let confirms = publish(&arm.client(1), &spec.exchange, 10).await;
    assert_eq!(confirms, vec![Confirm::Ack; 10]);
    arm.start(3).await;
    assert_eq!(
        arm.ready(&spec.queue).await,
        10,
        "every confirmed event kept"
    );
    arm
}

async fn a_quorum_queue_without_a_majority_confirms_once_it_has_one<A: ClusterArm>(
    mut arm: A,
) -> A {
    let spec = arm.spec(QueueType::Quorum);
    declare(&arm.client(1), &spec).await;
    let publisher = arm.client(1);
    let mut ch = publisher.channel_open().await.unwrap();
    ch.channel_confirm_select().await.unwrap();
    arm.stop(2).await;
    arm.stop(3).await;
    let e = EventEnvelope::new("cluster.event", serde_json::json!({ "n": 1 }));
    let body = e.encode(&Default::default()).unwrap();
    let mut confirm = ch
        .channel_publish(OutgoingMessage {
            exchange: &spec.exchange,
            routing_key: "cluster.event",
            message_id: e.id,
            body: body.as_bytes(),
            trace: None,
            ordering: None,
        })
        .await
        .unwrap();
    let early = tokio::time::timeout(NO_MAJORITY_WAIT, &mut confirm).await;
    assert!(early.is_err(), "without a majority, neither ack nor nack");
    arm.start(2).await;
    let late = tokio::time::timeout(ARRIVES, confirm)
        .await
        .expect("confirmed once the majority is back");
    assert_eq!(late.unwrap(), Confirm::Ack);
    ch.channel_close().await;
    arm.start(3).await;
    assert_eq!(arm.ready(&spec.queue).await, 1, "and kept");
    arm
}

async fn a_publisher_moves_to_the_next_node_when_its_node_stops<A: ClusterArm>(mut arm: A) -> A {
    let spec = arm.spec(QueueType::Quorum);
    declare(&arm.client(2), &spec).await;
    let publisher = arm.client(1);
    assert_eq!(
        publish(&publisher, &spec.exchange, 1).await,
        vec![Confirm::Ack]
    );
    let before = publisher.connection_generation();
    arm.stop(1).await;
    let confirms = publish(&publisher, &spec.exchange, 5).await;
    assert_eq!(confirms, vec![Confirm::Ack; 5]);
    assert!(
        publisher.connection_generation() > before,
        "on a new connection, to another node"
    );
    arm.start(1).await;
    assert_eq!(arm.ready(&spec.queue).await, 6);
    arm
}

async fn a_consumer_moves_and_gets_its_unacked_deliveries_again<A: ClusterArm>(mut arm: A) -> A {
    let spec = arm.spec(QueueType::Quorum);
    declare(&arm.client(1), &spec).await;
    let consumer = arm.client(2);
    let c = consumer.subscription_open(&spec).await.unwrap();
    publish(&arm.client(1), &spec.exchange, 3).await;
    let mut first = Vec::new();
    for _ in 0..3 {
        let d = next(&c).await;
        assert!(!d.redelivered);
        first.push(d.message_id.clone());
    }
    arm.stop(2).await;
    let end = tokio::time::timeout(ARRIVES, async {
        while c.delivery_next().await.is_some() {}
    })
    .await;
    assert!(end.is_ok(), "the consumer ends with its node");
    c.consumer_close().await;
    let mut tries = 0;
    let c = loop {
        match consumer.subscription_open(&spec).await {
            Ok(c) => break c,
            Err(e) => {
                tries += 1;
                assert!(tries < TRIES, "no node took the consumer: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let mut again = Vec::new();
    for _ in 0..3 {
        let d = next(&c).await;
        assert!(
            d.redelivered,
            "a dead node's unacked delivery comes back redelivered"
        );
        c.delivery_ack(d.tag).await.unwrap();
        again.push(d.message_id.clone());
    }
    first.sort();
    again.sort();
    assert_eq!(first, again);
    c.consumer_close().await;
    arm.start(2).await;
    assert_eq!(arm.ready(&spec.queue).await, 0);
    arm
}

async fn dead_letters_reach_the_dlq_while_a_node_is_down<A: ClusterArm>(mut arm: A) -> A {
    let spec = arm.spec(QueueType::Quorum);
    declare(&arm.client(1), &spec).await;
    arm.stop(3).await;
    let c = arm.client(2).subscription_open(&spec).await.unwrap();
    publish(&arm.client(1), &spec.exchange, 2).await;
    for _ in 0..2 {
        let d = next(&c).await;
        c.delivery_nack(d.tag, false).await.unwrap();
    }
    let dlq = spec.dlq_name();
    let deadline = tokio::time::Instant::now() + ARRIVES;
    while arm.ready(&dlq).await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "dead letters reach {dlq}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.consumer_close().await;
    arm.start(3).await;
    assert_eq!(arm.ready(&dlq).await, 2);
    assert_eq!(arm.ready(&spec.queue).await, 0);
    arm
}

conformance! {
    rabbitmq_cluster: with_real, fake: with_fake;
    a_classic_queue_on_a_stopped_node_drops_what_is_confirmed,
    a_quorum_queue_keeps_what_it_confirmed_while_its_leader_is_down,
    a_quorum_queue_without_a_majority_confirms_once_it_has_one,
    a_publisher_moves_to_the_next_node_when_its_node_stops,
    a_consumer_moves_and_gets_its_unacked_deliveries_again,
    dead_letters_reach_the_dlq_while_a_node_is_down,
}
