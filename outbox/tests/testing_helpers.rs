//! `outbox::testing::HandlerTest` as a service's own test would use it, on
//! the real PostgreSQL: a handler's effect takes place exactly once through
//! a failed first attempt, a redelivery and a duplicate; a handler that
//! always fails is dead-lettered at its budget with nothing applied; a body
//! that is no envelope goes to the dead-letter queue at once; a batch
//! applies each event once.

use outbox::testing::HandlerTest;
use outbox::{DeliveryOutcome, EventEnvelope, Handler, HandlerError, PgTx, SubscriberSettings};
use sqlx::PgPool;

/// The service's handler under test: one shipment per order.
struct Ship;

impl Handler<PgTx> for Ship {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        let Some(order) = event.payload["id"].as_i64() else {
            return Err(HandlerError::msg("an order event without an id"));
        };
        sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
            .bind(order)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

async fn shipments(pool: &PgPool, order: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM shipments WHERE order_id = $1")
        .bind(order)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn with_shipments(pool: &PgPool) {
    sqlx::query("CREATE TABLE shipments (order_id BIGINT NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

fn order(id: i64) -> EventEnvelope {
    EventEnvelope::new("orders.created", serde_json::json!({ "id": id }))
}

#[sqlx::test]
async fn a_shipment_is_made_once_through_a_failure_a_redelivery_and_a_duplicate(pool: PgPool) {
    with_shipments(&pool).await;
    let test = HandlerTest::start(pool.clone(), "shipping.orders", Ship)
        .await
        .unwrap();
    let event = order(7);
    assert_eq!(
        test.fail_once(&event).await,
        DeliveryOutcome::Retrying { attempts: 1 }
    );
    assert_eq!(
        shipments(&pool, 7).await,
        0,
        "the failed attempt rolled back"
    );
    assert_eq!(test.redeliver(&event).await, DeliveryOutcome::Processed);
    assert_eq!(test.deliver(&event).await, DeliveryOutcome::Duplicate);
    assert_eq!(test.redeliver(&event).await, DeliveryOutcome::Duplicate);
    assert_eq!(shipments(&pool, 7).await, 1);
}

#[sqlx::test]
async fn a_poison_event_is_dead_lettered_at_its_budget_with_nothing_applied(pool: PgPool) {
    with_shipments(&pool).await;
    let mut settings = SubscriberSettings::new("shipping.orders", &["#"]);
    settings.max_attempts = 3;
    let test = HandlerTest::with_settings(pool.clone(), settings, Ship)
        .await
        .unwrap();
    let poison = EventEnvelope::new("orders.created", serde_json::json!({ "id": "seven" }));
    let outcomes = test.deliver_until_settled(&poison).await;
    assert_eq!(
        outcomes,
        [
            DeliveryOutcome::Retrying { attempts: 1 },
            DeliveryOutcome::Retrying { attempts: 2 },
            DeliveryOutcome::DeadLettered { attempts: 3 },
        ]
    );
    let not_json = test.deliver_raw(b"not json").await;
    assert!(
        matches!(not_json, DeliveryOutcome::Undecodable { .. }),
        "{not_json:?}"
    );
}

#[sqlx::test]
async fn a_batch_applies_each_event_once(pool: PgPool) {
    with_shipments(&pool).await;
    let test = HandlerTest::start(pool.clone(), "shipping.orders", Ship)
        .await
        .unwrap();
    let events = [order(1), order(2), order(1)];
    let outcomes = test.deliver_batch(&events[..2]).await;
    assert_eq!(
        outcomes,
        [DeliveryOutcome::Processed, DeliveryOutcome::Processed]
    );
    // The same event under a new id is a new event: the handler's own data
    // decides what "the same order" means.
    assert_eq!(test.deliver(&events[2]).await, DeliveryOutcome::Processed);
    assert_eq!(test.deliver(&events[0]).await, DeliveryOutcome::Duplicate);
    assert_eq!(
        (shipments(&pool, 1).await, shipments(&pool, 2).await),
        (2, 1)
    );
}
