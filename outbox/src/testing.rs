//! Helpers for testing a service's own [`Handler`]: [`HandlerTest`] runs it
//! exactly as a subscription does (the inbox row, the handler and the
//! processed mark in one transaction on your database, the attempt budget,
//! the dead-letter decision), on deliveries the test makes instead of a
//! broker's: first deliveries, duplicates, redeliveries, a failure injected
//! after the handler ran, bodies that are no envelope. Each call returns
//! when the delivery is settled: no sleeps, no broker.
//!
//! ```no_run
//! # use outbox::{EventEnvelope, Handler, HandlerError, PgTx, DeliveryOutcome};
//! # use outbox::testing::HandlerTest;
//! struct Ship;
//! impl Handler<PgTx> for Ship {
//!     async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
//!         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
//!             .bind(event.payload["id"].as_i64())
//!             .execute(&mut **tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let test = HandlerTest::start(pool.clone(), "shipping.orders", Ship).await?;
//! let event = EventEnvelope::new("orders.created", serde_json::json!({ "id": 7 }));
//! // The first attempt fails after the handler ran: its work rolls back.
//! assert_eq!(test.fail_once(&event).await, DeliveryOutcome::Retrying { attempts: 1 });
//! assert_eq!(test.redeliver(&event).await, DeliveryOutcome::Processed);
//! assert_eq!(test.deliver(&event).await, DeliveryOutcome::Duplicate);
//! let shipped: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments WHERE order_id = 7")
//!     .fetch_one(&pool)
//!     .await?;
//! assert_eq!(shipped, 1); // exactly once
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sqlx::PgPool;
use tokio::sync::watch;

use crate::core::ports::{ConsumerBroker, Delivery, DeliverySource, SubscriptionSpec};
use crate::core::subscriber::{DeliveryOutcome, Handler, Subscriber, SubscriberSettings};
use crate::envelope::EventEnvelope;
use crate::error::{BrokerError, HandlerError};
use crate::pg::inbox::{PgInboxStore, PgTx};
use crate::runtime::TokioClock;
use crate::service::StartError;

/// A handler run as a subscription runs it, on deliveries the test makes.
/// See the [module docs](self).
pub struct HandlerTest<H: Handler<PgTx>> {
    subscriber: Subscriber<PgInboxStore, TestBroker, TokioClock, Injected<H>>,
    consumer: TestConsumer,
    fail_next: Arc<AtomicBool>,
    tags: AtomicU64,
    shutdown: watch::Receiver<bool>,
    _stop: watch::Sender<bool>,
}

impl<H: Handler<PgTx>> std::fmt::Debug for HandlerTest<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTest")
            .field("subscription", &self.subscriber.settings().spec.queue)
            .finish_non_exhaustive()
    }
}

impl<H: Handler<PgTx>> HandlerTest<H> {
    /// Runs the library's migrations on `pool`, then tests `handler` as
    /// subscription `queue` with the default settings (an attempt budget
    /// of 5).
    pub async fn start(pool: PgPool, queue: &str, handler: H) -> Result<Self, StartError> {
        Self::with_settings(pool, SubscriberSettings::new(queue, &["#"]), handler).await
    }

    /// As [`start`](Self::start), with `settings` (its attempt budget,
    /// size limit and handler deadline apply).
    pub async fn with_settings(
        pool: PgPool,
        settings: SubscriberSettings,
        handler: H,
    ) -> Result<Self, StartError> {
        settings.validate()?;
        crate::migrate::run(&pool)
            .await
            .map_err(StartError::Migrate)?;
        let fail_next = Arc::new(AtomicBool::new(false));
        let injected = Injected {
            handler,
            fail_next: fail_next.clone(),
        };
        let subscriber = Subscriber::new(
            Arc::new(PgInboxStore::new(pool)),
            Arc::new(TestBroker),
            Arc::new(TokioClock::default()),
            Arc::new(injected),
            settings,
        );
        let (stop, shutdown) = watch::channel(false);
        Ok(Self {
            subscriber,
            consumer: TestConsumer,
            fail_next,
            tags: AtomicU64::new(1),
            shutdown,
            _stop: stop,
        })
    }

    /// Delivers `event` once, as the broker's first delivery of it, and
    /// returns what the subscription made of it (processed, a duplicate,
    /// a failed attempt to retry, dead-lettered).
    pub async fn deliver(&self, event: &EventEnvelope) -> DeliveryOutcome {
        self.one(self.delivery_of(event, false)).await
    }

    /// Delivers `event` again, flagged redelivered (the broker's redelivery
    /// after a requeue, a lost ack or a consumer that went away).
    pub async fn redeliver(&self, event: &EventEnvelope) -> DeliveryOutcome {
        self.one(self.delivery_of(event, true)).await
    }

    /// Delivers `event` with its handler failing after it ran (its work
    /// must roll back with the attempt): one failed attempt.
    pub async fn fail_once(&self, event: &EventEnvelope) -> DeliveryOutcome {
        self.fail_next.store(true, Ordering::SeqCst);
        let outcome = self.deliver(event).await;
        self.fail_next.store(false, Ordering::SeqCst);
        outcome
    }

    /// Delivers `events` in one batch (one transaction, as a subscription
    /// applies up to its `batch_max`): their outcomes, in order.
    pub async fn deliver_batch(&self, events: &[EventEnvelope]) -> Vec<DeliveryOutcome> {
        let deliveries = events.iter().map(|e| self.delivery_of(e, false)).collect();
        self.subscriber
            .deliver_batch(&self.consumer, deliveries, &self.shutdown)
            .await
    }

    /// Delivers `event` as the broker would until the subscription settles
    /// it for good: again after each failed attempt, up to the budget.
    /// Every outcome, in order; the last is `Processed`, `Duplicate` or
    /// `DeadLettered` (a handler that always fails is dead-lettered at its
    /// budget).
    pub async fn deliver_until_settled(&self, event: &EventEnvelope) -> Vec<DeliveryOutcome> {
        let mut outcomes = vec![self.deliver(event).await];
        let budget = self.subscriber.settings().max_attempts as usize;
        while matches!(outcomes.last(), Some(DeliveryOutcome::Retrying { .. }))
            && outcomes.len() <= budget
        {
            outcomes.push(self.redeliver(event).await);
        }
        outcomes
    }

    /// Delivers a raw body that a foreign publisher sent (no envelope, say):
    /// what the subscription made of it.
    pub async fn deliver_raw(&self, body: &[u8]) -> DeliveryOutcome {
        let delivery = Delivery {
            tag: self.tags.fetch_add(1, Ordering::Relaxed),
            message_id: None,
            routing_key: "testing.raw".into(),
            body: body.to_vec(),
            redelivered: false,
            trace: None,
            ordering: None,
        };
        self.one(delivery).await
    }

    fn delivery_of(&self, event: &EventEnvelope, redelivered: bool) -> Delivery {
        Delivery {
            tag: self.tags.fetch_add(1, Ordering::Relaxed),
            message_id: Some(event.id.to_string()),
            routing_key: event.routing_key.clone(),
            body: serde_json::to_vec(event).expect("an envelope serializes"),
            redelivered,
            trace: None,
            ordering: None,
        }
    }

    async fn one(&self, delivery: Delivery) -> DeliveryOutcome {
        let mut outcomes = self
            .subscriber
            .deliver_batch(&self.consumer, vec![delivery], &self.shutdown)
            .await;
        outcomes.pop().expect("one outcome per delivery")
    }
}

/// The user's handler, and a failure injected after it ran.
struct Injected<H> {
    handler: H,
    fail_next: Arc<AtomicBool>,
}

impl<H: Handler<PgTx>> Handler<PgTx> for Injected<H> {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        self.handler.handle(tx, event).await?;
        if self.fail_next.swap(false, Ordering::SeqCst) {
            return Err(HandlerError::msg(
                "a failure injected by HandlerTest::fail_once",
            ));
        }
        Ok(())
    }
}

/// No broker: the test hands the deliveries in itself.
struct TestBroker;

impl ConsumerBroker for TestBroker {
    type Consumer = TestConsumer;

    async fn subscription_open(&self, _: &SubscriptionSpec) -> Result<TestConsumer, BrokerError> {
        Ok(TestConsumer)
    }
}

/// Settles go nowhere: the outcome a delivery returns says how it was
/// settled.
struct TestConsumer;

impl DeliverySource for TestConsumer {
    async fn delivery_next(&self) -> Option<Delivery> {
        None
    }
    async fn delivery_ack(&self, _: u64) -> Result<(), BrokerError> {
        Ok(())
    }
    async fn delivery_ack_many(&self, _: &[u64]) -> Result<(), BrokerError> {
        Ok(())
    }
    async fn delivery_nack(&self, _: u64, _: bool) -> Result<(), BrokerError> {
        Ok(())
    }
    async fn consumer_close(&self) {}
}
