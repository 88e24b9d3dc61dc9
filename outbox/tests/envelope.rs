//! Invalid envelopes are refused with a typed `PublishError` before anything
//! is written, and the caller's transaction stays usable.

use outbox::envelope::EnvelopeLimits;
use outbox::{EventEnvelope, PublishError, Publisher};
use sqlx::PgPool;

fn env(key: &str) -> EventEnvelope {
    EventEnvelope::new(key, serde_json::json!({ "ok": true }))
}

#[test]
fn routing_keys_must_be_1_to_255_bytes_without_nul() {
    let l = EnvelopeLimits::default();
    assert!(matches!(
        env("").validate(&l),
        Err(PublishError::EmptyRoutingKey)
    ));
    assert!(matches!(
        env(&"k".repeat(256)).validate(&l),
        Err(PublishError::RoutingKeyTooLong { bytes: 256 })
    ));
    env(&"k".repeat(255)).validate(&l).unwrap();
    assert!(matches!(
        env("a\0b").validate(&l),
        Err(PublishError::NulCharacter { location }) if location == "routing_key"
    ));
}

#[test]
fn ids_must_be_uuid_v7() {
    let mut e = env("k");
    e.id = uuid::Uuid::nil();
    assert!(matches!(
        e.validate(&EnvelopeLimits::default()),
        Err(PublishError::IdNotV7 { version: 0, .. })
    ));
    e.id = uuid::Uuid::from_u128(0x1234_5678_9abc_4def_8123_4567_89ab_cdef);
    assert!(matches!(
        e.validate(&EnvelopeLimits::default()),
        Err(PublishError::IdNotV7 { version: 4, .. })
    ));
}

#[test]
fn payloads_over_the_limit_are_refused() {
    let limits = EnvelopeLimits {
        max_envelope_bytes: 1024,
    };
    let big = EventEnvelope::new("k", serde_json::json!({ "blob": "x".repeat(2000) }));
    match big.validate(&limits) {
        Err(PublishError::PayloadTooLarge { bytes, limit: 1024 }) => assert!(bytes > 2000),
        other => panic!("{other:?}"),
    }
    big.validate(&EnvelopeLimits::default()).unwrap();
}

#[test]
fn nul_characters_anywhere_are_refused_with_their_location() {
    let l = EnvelopeLimits::default();
    let e = EventEnvelope::new("k", serde_json::json!({ "a": [1, "x\u{0}y"] }));
    assert!(matches!(
        e.validate(&l),
        Err(PublishError::NulCharacter { location }) if location == "payload.a[1]"
    ));
    let e = env("k").with_header("tenant", "n\0y");
    assert!(matches!(
        e.validate(&l),
        Err(PublishError::NulCharacter { .. })
    ));
    let e = env("k").with_header("", "v");
    assert!(matches!(
        e.validate(&l),
        Err(PublishError::InvalidHeaderName { .. })
    ));
    let e = env("k").with_header("h".repeat(256), "v");
    assert!(matches!(
        e.validate(&l),
        Err(PublishError::InvalidHeaderName { .. })
    ));
}

#[test]
fn an_envelope_round_trips_through_its_encoding() {
    let e = env("orders.created").with_header("tenant", "ny");
    let body = e.encode(&EnvelopeLimits::default()).unwrap();
    assert_eq!(EventEnvelope::decode(body.as_bytes()).unwrap(), e);
}

async fn outbox_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM event_outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn invalid_envelopes_write_nothing_and_leave_the_transaction_usable(pool: PgPool) {
    let publisher = Publisher::new(pool.clone());
    let mut tx = pool.begin().await.unwrap();
    let err = publisher.publish_tx(&mut tx, &env("")).await.unwrap_err();
    assert!(matches!(err, PublishError::EmptyRoutingKey));
    // One bad envelope refuses the whole batch before anything is written.
    let batch = vec![env("good"), env(&"k".repeat(300))];
    let err = publisher
        .publish_many_tx(&mut tx, &batch)
        .await
        .unwrap_err();
    assert!(matches!(err, PublishError::RoutingKeyTooLong { .. }));
    // The transaction is still usable: a valid envelope commits.
    publisher.publish_tx(&mut tx, &env("good")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(outbox_rows(&pool).await, 1);
    assert!(matches!(
        publisher.publish(&env("")).await,
        Err(PublishError::EmptyRoutingKey)
    ));
    assert_eq!(outbox_rows(&pool).await, 1);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn duplicate_ids_are_refused_with_the_id(pool: PgPool) {
    let publisher = Publisher::new(pool.clone());
    let e = env("k");
    publisher.publish(&e).await.unwrap();
    assert!(matches!(
        publisher.publish(&e).await,
        Err(PublishError::DuplicateId { id }) if id == e.id
    ));
    let mut tx = pool.begin().await.unwrap();
    let one = env("k");
    let twice = vec![one.clone(), one];
    assert!(matches!(
        publisher.publish_many_tx(&mut tx, &twice).await,
        Err(PublishError::DuplicateId { id }) if id == twice[0].id
    ));
    let clash = vec![env("k"), e.clone()];
    assert!(matches!(
        publisher.publish_many_tx(&mut tx, &clash).await,
        Err(PublishError::DuplicateId { id }) if id == e.id
    ));
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn publish_many_writes_every_envelope_in_one_statement(pool: PgPool) {
    let publisher = Publisher::new(pool.clone());
    let batch: Vec<_> = (0..100)
        .map(|i| EventEnvelope::new("audit.fti", serde_json::json!({ "i": i })))
        .collect();
    let mut tx = pool.begin().await.unwrap();
    publisher.publish_many_tx(&mut tx, &batch).await.unwrap();
    publisher.publish_many_tx(&mut tx, &[]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(publisher.outbox_pending_count().await.unwrap(), 100);
    let stored: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM event_outbox WHERE id = $1")
            .bind(batch[7].id)
            .fetch_one(&pool)
            .await
            .unwrap();
    let decoded: EventEnvelope = serde_json::from_value(stored).unwrap();
    assert_eq!(decoded, batch[7]);
}

#[test]
fn a_nul_deep_under_long_keys_is_named_in_a_bounded_escaped_path() {
    // A NUL under 50 levels of 10 kB keys, the last with a line break: the
    // path is cut at 200 characters and escaped.
    let key = "k".repeat(10_000);
    let mut payload = serde_json::json!({ "x\ny": "a\u{0}b" });
    for _ in 0..50 {
        payload = serde_json::json!({ key.clone(): payload });
    }
    let e = EventEnvelope::new("k", payload);
    match e.validate(&EnvelopeLimits {
        max_envelope_bytes: 1 << 30,
    }) {
        Err(PublishError::NulCharacter { location }) => {
            assert!(location.starts_with("payload.kkk"), "{location}");
            assert!(location.ends_with('…'), "{location}");
            assert!(location.chars().count() <= "payload".len() + 200 + 1);
        }
        other => panic!("{other:?}"),
    }
    let e = EventEnvelope::new("k", serde_json::json!({ "a": { "x\ny": "a\u{0}b" } }));
    match e.validate(&EnvelopeLimits::default()) {
        Err(PublishError::NulCharacter { location }) => {
            assert_eq!(location, "payload.a.x\\ny")
        }
        other => panic!("{other:?}"),
    }
    let e = EventEnvelope::new("k", serde_json::json!({ "a": { "b\u{0}": 1 } }));
    match e.validate(&EnvelopeLimits::default()) {
        Err(PublishError::NulCharacter { location }) => assert_eq!(location, "payload.a (a key)"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_delivery_refused_for_a_huge_reason_gets_a_short_one() {
    // serde_json quotes a value of the wrong type whole ("invalid type:
    // string \"zzz…\", expected a map"); the reason stays short.
    let body = format!(r#"{{"headers":"{}"}}"#, "z".repeat(100_000));
    let reason = EventEnvelope::decode_delivery(body.as_bytes()).unwrap_err();
    assert!(
        reason.chars().count() <= outbox::envelope::REASON_MAX_CHARS,
        "{}",
        reason.len()
    );
    assert!(reason.starts_with("not an envelope"), "{reason}");
}
