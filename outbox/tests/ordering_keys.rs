//! Ordering keys on PostgreSQL (issue 27, the producer's half): the events
//! of one key are numbered in the order their transactions commit, even
//! when the transactions overlap; a rollback gives its number back; a
//! batch numbers its keys in batch order; a bad key is refused before
//! anything is written; unkeyed envelopes are written as before.

use std::time::Duration;

use outbox::{EventEnvelope, PublishError, Publisher};
use sqlx::PgPool;

fn keyed(key: &str) -> EventEnvelope {
    EventEnvelope::new("orders.paid", serde_json::json!({ "k": key })).with_ordering_key(key)
}

/// `(ordering_key, key_seq)` of the row of `id`.
async fn seq_of(pool: &PgPool, id: uuid::Uuid) -> (Option<String>, Option<i64>) {
    sqlx::query_as("SELECT ordering_key, key_seq FROM event_outbox WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn each_key_is_numbered_from_one_and_unkeyed_rows_have_no_number(pool: PgPool) {
    let p = Publisher::new(pool.clone());
    let (a1, b1, a2) = (keyed("a"), keyed("b"), keyed("a"));
    let plain = EventEnvelope::new("orders.paid", serde_json::json!({}));
    for e in [&a1, &b1, &a2, &plain] {
        p.publish(e).await.unwrap();
    }
    assert_eq!(seq_of(&pool, a1.id).await, (Some("a".into()), Some(1)));
    assert_eq!(seq_of(&pool, b1.id).await, (Some("b".into()), Some(1)));
    assert_eq!(seq_of(&pool, a2.id).await, (Some("a".into()), Some(2)));
    assert_eq!(seq_of(&pool, plain.id).await, (None, None));
    // The stored envelope carries the key; an unkeyed one has no such field.
    let (with, without): (String, String) = sqlx::query_as(
        "SELECT (SELECT envelope FROM event_outbox WHERE id = $1), \
                (SELECT envelope FROM event_outbox WHERE id = $2)",
    )
    .bind(a1.id)
    .bind(plain.id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(EventEnvelope::decode(with.as_bytes()).unwrap(), a1);
    assert!(!without.contains("ordering_key"), "{without}");
}

/// Two transactions of one key that overlap: the one that began first (its
/// `enqueued_at` earlier) writes second and commits second, so it is
/// numbered second; it waited at its write until the first committed.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn overlapping_transactions_of_a_key_are_numbered_in_commit_order(pool: PgPool) {
    let p = Publisher::new(pool.clone());
    let (early, late) = (keyed("k"), keyed("k"));
    let mut first = pool.begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut second = pool.begin().await.unwrap();
    p.publish_tx(&mut second, &late).await.unwrap();
    // `first` began earlier; its write waits for `second`'s lock.
    let waiting = {
        let (p, early) = (p.clone(), early.clone());
        tokio::spawn(async move {
            p.publish_tx(&mut first, &early).await.unwrap();
            first.commit().await.unwrap();
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the same key's write waits");
    second.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiting write goes on once the other commits")
        .unwrap();
    assert_eq!(seq_of(&pool, late.id).await.1, Some(1));
    assert_eq!(seq_of(&pool, early.id).await.1, Some(2));
    let (early_at, late_at): (time::OffsetDateTime, time::OffsetDateTime) = sqlx::query_as(
        "SELECT (SELECT enqueued_at FROM event_outbox WHERE id = $1), \
                (SELECT enqueued_at FROM event_outbox WHERE id = $2)",
    )
    .bind(early.id)
    .bind(late.id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        early_at < late_at,
        "enqueued_at says the opposite of commit order"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_rolled_back_write_gives_its_number_back(pool: PgPool) {
    let p = Publisher::new(pool.clone());
    p.publish(&keyed("k")).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    p.publish_tx(&mut tx, &keyed("k")).await.unwrap();
    tx.rollback().await.unwrap();
    let next = keyed("k");
    p.publish(&next).await.unwrap();
    assert_eq!(seq_of(&pool, next.id).await.1, Some(2), "no hole");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_batch_numbers_each_key_in_batch_order(pool: PgPool) {
    let p = Publisher::new(pool.clone());
    p.publish(&keyed("b")).await.unwrap();
    let batch = vec![
        keyed("b"),
        keyed("a"),
        EventEnvelope::new("orders.paid", serde_json::json!({})),
        keyed("b"),
        keyed("a"),
        keyed("b"),
    ];
    let mut tx = pool.begin().await.unwrap();
    p.publish_many_tx(&mut tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    let mut got = Vec::new();
    for e in &batch {
        got.push(seq_of(&pool, e.id).await.1);
    }
    assert_eq!(
        got,
        [Some(2), Some(1), None, Some(3), Some(2), Some(4)],
        "b continues after its earlier event; a starts at 1"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bad_key_is_refused_and_nothing_is_written(pool: PgPool) {
    let p = Publisher::new(pool.clone());
    for key in [String::new(), "k".repeat(256), "a\0b".to_owned()] {
        let e = keyed(&key);
        let err = p.publish(&e).await.unwrap_err();
        assert!(
            matches!(err, PublishError::InvalidOrderingKey { .. }),
            "{key:?}: {err}"
        );
        let mut tx = pool.begin().await.unwrap();
        let err = p
            .publish_many_tx(&mut tx, &[keyed("fine"), e])
            .await
            .unwrap_err();
        assert!(matches!(err, PublishError::InvalidOrderingKey { .. }));
        tx.rollback().await.unwrap();
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM event_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    let longest = keyed(&"k".repeat(255));
    p.publish(&longest).await.unwrap();
    assert_eq!(seq_of(&pool, longest.id).await.1, Some(1));
}
