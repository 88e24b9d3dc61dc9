//! The guide's test of a handler (docs/consuming.md, "Testing your
//! handler"), run as a user's test: the block on that page is this file's
//! code below the marker, whitespace aside, and a test fails when they part.

#[test]
fn the_guide_shows_this_very_test() {
    let page = include_str!("../../docs/consuming.md");
    let section = &page[page.find("## Testing your handler").expect("the section")..];
    let start = section.find("```rust").expect("a rust block");
    let body = &section[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    let block = &body[..body.find("```").expect("the block's end")];
    let this = include_str!("guide.rs");
    let code = &this[this.rfind("// ---- the guide's block ----").unwrap()..];
    let code = &code[code.find('\n').unwrap() + 1..];
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(
        squash(block),
        squash(code),
        "docs/consuming.md and outbox/tests/guide.rs show different tests"
    );
}

// ---- the guide's block ----
use outbox::testing::HandlerTest;
use outbox::{DeliveryOutcome, EventEnvelope, Handler, HandlerError, PgTx};

/// Your handler: one shipment per order.
struct Ship;

impl Handler<PgTx> for Ship {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
            .bind(event.payload["id"].as_i64())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

// sqlx gives each test a fresh database with your migrations (the outbox's
// among them) and the fixture `tests/fixtures/shipments.sql`.
#[sqlx::test(fixtures("shipments"))]
async fn a_shipment_is_made_once(pool: sqlx::PgPool) {
    let test = HandlerTest::start(pool.clone(), "shipping.orders", Ship)
        .await
        .unwrap();
    let event = EventEnvelope::new("orders.created", serde_json::json!({ "id": 7 }));
    // The first attempt fails after the handler ran: its work rolls back.
    assert_eq!(
        test.fail_once(&event).await,
        DeliveryOutcome::Retrying { attempts: 1 }
    );
    assert_eq!(test.redeliver(&event).await, DeliveryOutcome::Processed);
    assert_eq!(test.deliver(&event).await, DeliveryOutcome::Duplicate);
    let shipped: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments WHERE order_id = 7")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(shipped, 1);
}
