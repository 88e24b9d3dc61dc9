//! The broker, producer side: `LapinBroker` on RabbitMQ (through a TCP proxy
//! that can cut the connection) and `SimBroker` on the fake RabbitMQ, the
//! same bodies.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use outbox::core::ports::{Broker, Confirm, OutgoingMessage, PublishChannel};
use sim::adapters::{Hooks, SimBroker};
use sim::fakes::mq::{self, MqFaults, MqState};
use sim::trace::Trace;
use uuid::Uuid;

#[cfg(not(madsim))]
use crate::common;
use crate::harness::in_sim;

/// One side of the broker conformance suite.
trait BrokerArm {
    type B: Broker;
    fn broker(&self) -> &Self::B;
    fn exchange(&self) -> &str;
    /// Makes the broker nack what is published with routing keys `prefix.*`.
    async fn nack_prefix(&self, prefix: &str);
    /// Breaks every connection of the broker client.
    async fn cut(&self);
}

#[cfg(not(madsim))]
struct RealBroker {
    broker: Arc<outbox::LapinBroker>,
    exchange: String,
    proxy: common::Proxy,
    admin: lapin::Connection,
}

#[cfg(not(madsim))]
impl BrokerArm for RealBroker {
    type B = outbox::LapinBroker;
    fn broker(&self) -> &outbox::LapinBroker {
        &self.broker
    }
    fn exchange(&self) -> &str {
        &self.exchange
    }
    async fn nack_prefix(&self, prefix: &str) {
        common::declare_rejecting_queue(&self.admin, &self.exchange, &format!("{prefix}.#")).await;
    }
    async fn cut(&self) {
        self.proxy.cut();
    }
}

struct FakeBroker {
    broker: SimBroker,
    state: MqState,
}

impl BrokerArm for FakeBroker {
    type B = SimBroker;
    fn broker(&self) -> &SimBroker {
        &self.broker
    }
    fn exchange(&self) -> &str {
        "canopy.events"
    }
    async fn nack_prefix(&self, prefix: &str) {
        *self.state.faults.lock().unwrap() = MqFaults {
            nack_prefix: Some(format!("{prefix}.")),
            ..MqFaults::default()
        };
    }
    async fn cut(&self) {
        self.state.close_all_connections();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn with_fake_broker<F, Fut>(body: F)
where
    F: FnOnce(FakeBroker) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let trace = Trace::default();
    let state = MqState::new(3, trace.clone());
    let server = state.clone();
    in_sim(
        "rabbit",
        move || mq::serve(server.clone()),
        move || async move {
            body(FakeBroker {
                broker: SimBroker::new("conformance", trace, Hooks::new(1)),
                state,
            })
            .await;
        },
    );
}

#[cfg(not(madsim))]
async fn with_real_broker<F, Fut>(body: F)
where
    F: FnOnce(RealBroker) -> Fut,
    Fut: Future<Output = ()>,
{
    let proxy = common::Proxy::start("127.0.0.1:5672").await;
    let admin = common::connect().await;
    let exchange = common::unique("conf");
    let ch = admin.create_channel().await.unwrap();
    common::declare_exchange(&ch, &exchange).await;
    let broker = Arc::new(outbox::LapinBroker::new(proxy.amqp_url()));
    body(RealBroker {
        broker,
        exchange: exchange.clone(),
        proxy,
        admin,
    })
    .await;
    // The body passed: leave nothing behind on the shared broker.
    ch.exchange_delete(exchange.as_str().into(), Default::default())
        .await
        .unwrap();
}

/// Opens a channel, publishes one message and awaits its confirm, all under
/// a deadline as the drainer's Phase 2 is.
async fn publish_one<B: Broker>(
    b: &B,
    exchange: &str,
    key: &str,
) -> Result<Confirm, outbox::BrokerError> {
    tokio::time::timeout(
        Duration::from_secs(5),
        publish_one_unbounded(b, exchange, key),
    )
    .await
    .unwrap_or_else(|_| Err(outbox::BrokerError::Connection("deadline".into())))
}

async fn publish_one_unbounded<B: Broker>(
    b: &B,
    exchange: &str,
    key: &str,
) -> Result<Confirm, outbox::BrokerError> {
    let mut ch = b.channel_open().await?;
    ch.channel_confirm_select().await?;
    let confirm = ch
        .channel_publish(OutgoingMessage {
            exchange,
            routing_key: key,
            message_id: Uuid::now_v7(),
            body: b"{}",
            trace: None,
            ordering: None,
        })
        .await?;
    let r = confirm.await;
    ch.channel_close().await;
    r
}

async fn a_publish_is_confirmed_even_with_no_queue_bound<A: BrokerArm>(arm: A) {
    let r = publish_one(arm.broker(), arm.exchange(), "nobody.listens")
        .await
        .unwrap();
    assert_eq!(
        r,
        Confirm::Ack,
        "mandatory is unset: unroutable is not a failure"
    );
}

async fn a_rejecting_queue_nacks_and_others_still_ack<A: BrokerArm>(arm: A) {
    arm.nack_prefix("poison").await;
    let r = publish_one(arm.broker(), arm.exchange(), "poison.x")
        .await
        .unwrap();
    assert!(matches!(r, Confirm::Nack(_)), "{r:?}");
    let r = publish_one(arm.broker(), arm.exchange(), "fine.x")
        .await
        .unwrap();
    assert_eq!(r, Confirm::Ack);
}

async fn a_lost_connection_fails_and_a_reconnect_recovers<A: BrokerArm>(arm: A) {
    let b = arm.broker();
    publish_one(b, arm.exchange(), "k").await.unwrap();
    let generation = b.connection_generation();
    arm.cut().await;
    // The old connection is unusable: opening a channel or confirming fails,
    // or (if the client noticed the loss already) a new connection is made.
    let r = publish_one(b, arm.exchange(), "k").await;
    if r.is_err() {
        b.connection_reconnect(generation).await.unwrap();
        // A second reconnect for the same generation is a no-op.
        let g2 = b.connection_generation();
        b.connection_reconnect(generation).await.unwrap();
        assert_eq!(b.connection_generation(), g2, "single-flight");
    }
    assert_eq!(
        publish_one(b, arm.exchange(), "k").await.unwrap(),
        Confirm::Ack
    );
    assert!(
        b.connection_generation() > generation,
        "a new connection was made"
    );
}

conformance!(rabbitmq: with_real_broker, fake: with_fake_broker;
    a_publish_is_confirmed_even_with_no_queue_bound,
    a_rejecting_queue_nacks_and_others_still_ack,
    a_lost_connection_fails_and_a_reconnect_recovers,
);
