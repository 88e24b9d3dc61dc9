//! Ordering keys on PostgreSQL (issue 27, the producer's half): the events
//! of one key are numbered in the order their transactions commit, even
//! when the transactions overlap; a rollback gives its number back; a
//! batch numbers its keys in batch order; a bad key is refused before
//! anything is written; unkeyed envelopes are written as before. And the
//! drainer's half on the store: a claim takes only a key's head (one row
//! of a key claimed at a time, the next once it is marked), a parked head
//! holds its key back until it is unparked or skipped, and a reclaimed
//! lease keeps the order.

use std::time::Duration;

use outbox::core::ports::{ClaimParams, KeySeq, OutboxStore, RowFailure, UnparkSelector};
use outbox::{EventEnvelope, PgOutboxStore, PublishError, Publisher};
use sqlx::PgPool;
use uuid::Uuid;

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

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
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
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
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

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
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

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
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

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
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

const LEASE: Duration = Duration::from_secs(30);

/// Claims up to 100 rows as `replica` with the lease `ttl`: their ids.
async fn claim_as(store: &PgOutboxStore, replica: &str, ttl: Duration) -> Vec<Uuid> {
    store
        .outbox_claim(ClaimParams {
            replica_id: replica,
            lease_ttl: ttl,
            batch_size: 100,
            key_heads: &heads(store, ttl).await,
            after: None,
        })
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// The claimable heads of every key, as the drainer's window finds them.
async fn heads(store: &PgOutboxStore, ttl: Duration) -> Vec<Uuid> {
    let w = store.outbox_key_window("", 1000, ttl).await.unwrap();
    assert!(w.exhausted);
    w.heads
        .into_iter()
        .filter(|h| h.claimable)
        .map(|h| h.id)
        .collect()
}

/// Writes `keys` as one event each, in order, one transaction each.
async fn write_keyed(pool: &PgPool, keys: &[Option<&str>]) -> Vec<Uuid> {
    let p = Publisher::new(pool.clone());
    let mut ids = Vec::new();
    for k in keys {
        let e = match k {
            Some(k) => keyed(k),
            None => EventEnvelope::new("orders.paid", serde_json::json!({})),
        };
        p.publish(&e).await.unwrap();
        ids.push(e.id);
    }
    ids
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_claim_takes_each_keys_head_and_the_next_only_once_it_is_marked(pool: PgPool) {
    let store = PgOutboxStore::new(pool.clone());
    let ids = write_keyed(&pool, &[Some("a"), Some("a"), Some("b"), None, Some("a")]).await;
    let (a1, a2, b1, u, a3) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
    let first = store
        .outbox_claim(ClaimParams {
            replica_id: "r1",
            lease_ttl: LEASE,
            batch_size: 100,
            key_heads: &heads(&store, LEASE).await,
            after: None,
        })
        .await
        .unwrap();
    assert_eq!(
        first.iter().map(|r| r.id).collect::<Vec<_>>(),
        [a1, b1, u],
        "heads and unkeyed rows, in age order"
    );
    let ordering: Vec<_> = first.iter().map(|r| r.ordering.clone()).collect();
    let ks = |key: &str, seq| {
        Some(KeySeq {
            key: key.into(),
            seq,
        })
    };
    assert_eq!(ordering, [ks("a", 1), ks("b", 1), None]);
    assert_eq!(
        claim_as(&store, "r2", LEASE).await,
        Vec::<Uuid>::new(),
        "a2 waits while a1 is claimed, by anyone"
    );
    assert_eq!(store.outbox_mark_published("r1", &[a1]).await.unwrap(), 1);
    assert_eq!(claim_as(&store, "r2", LEASE).await, [a2]);
    assert_eq!(
        store.outbox_release("r2", &[a2]).await.unwrap(),
        1,
        "a released head is a head again"
    );
    assert_eq!(claim_as(&store, "r1", LEASE).await, [a2]);
    store.outbox_mark_published("r1", &[a2]).await.unwrap();
    assert_eq!(claim_as(&store, "r1", LEASE).await, [a3]);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_reclaimed_lease_hands_over_the_head_and_nothing_behind_it(pool: PgPool) {
    let store = PgOutboxStore::new(pool.clone());
    let ids = write_keyed(&pool, &[Some("k"), Some("k"), Some("k")]).await;
    assert_eq!(claim_as(&store, "r1", LEASE).await, [ids[0]]);
    // r1's lease counts as expired for a claim with a zero TTL: r2 takes
    // the head over, and still only the head.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(claim_as(&store, "r2", Duration::ZERO).await, [ids[0]]);
    assert_eq!(
        store.outbox_mark_published("r1", &[ids[0]]).await.unwrap(),
        0,
        "the old holder's mark is refused"
    );
    assert_eq!(
        store.outbox_mark_published("r2", &[ids[0]]).await.unwrap(),
        1
    );
    assert_eq!(claim_as(&store, "r1", LEASE).await, [ids[1]]);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_parked_head_holds_its_key_until_it_is_skipped_or_unparked(pool: PgPool) {
    let store = PgOutboxStore::new(pool.clone());
    let ids = write_keyed(&pool, &[Some("k"), Some("k"), Some("other"), Some("k")]).await;
    let (k1, k2, o1, k3) = (ids[0], ids[1], ids[2], ids[3]);
    assert_eq!(claim_as(&store, "r", LEASE).await, [k1, o1]);
    let fail = |id| RowFailure {
        id,
        error: "refused".into(),
    };
    let out = store.outbox_mark_failed("r", &[fail(k1)], 1).await.unwrap();
    assert_eq!(out.parked, 1);
    store.outbox_mark_published("r", &[o1]).await.unwrap();
    assert_eq!(
        claim_as(&store, "r", LEASE).await,
        Vec::<Uuid>::new(),
        "k2 and k3 wait behind the parked k1"
    );
    let stats = store.outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.parked, stats.blocked), (2, 1, 2));
    let parked = store
        .outbox_list_parked(&outbox::admin::ParkedFilter::page(10, None))
        .await
        .unwrap();
    assert_eq!(
        parked[0].ordering,
        Some(KeySeq {
            key: "k".into(),
            seq: 1
        })
    );

    // Skip gives k1 up: it is done without being sent, and k2 goes on.
    assert_eq!(
        store
            .outbox_skip(&UnparkSelector::Ids(vec![k2]))
            .await
            .unwrap(),
        0,
        "a row that is not parked is not skipped"
    );
    assert_eq!(store.outbox_skip(&UnparkSelector::All).await.unwrap(), 1);
    let (published, skipped): (bool, bool) = sqlx::query_as(
        "SELECT published_at IS NOT NULL, skipped_at IS NOT NULL FROM event_outbox WHERE id = $1",
    )
    .bind(k1)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(published && skipped);
    assert_eq!(store.outbox_stats().await.unwrap().blocked, 0);
    assert_eq!(claim_as(&store, "r", LEASE).await, [k2]);

    // Unpark gives k2 a fresh budget, and it is the head again.
    store.outbox_mark_failed("r", &[fail(k2)], 1).await.unwrap();
    assert_eq!(store.outbox_stats().await.unwrap().blocked, 1);
    assert_eq!(store.outbox_unpark(&UnparkSelector::All).await.unwrap(), 1);
    assert_eq!(claim_as(&store, "r", LEASE).await, [k2]);
    store.outbox_mark_published("r", &[k2]).await.unwrap();
    assert_eq!(claim_as(&store, "r", LEASE).await, [k3]);
}

/// The head probe reads the key's unpublished rows whether or not another
/// claim holds them locked: while one claim transaction has the head
/// locked (and has not yet committed its lease), a concurrent claim skips
/// the head and does not mistake the next row for it.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_head_locked_by_an_open_claim_hides_nothing_behind_it(pool: PgPool) {
    let store = PgOutboxStore::new(pool.clone());
    let ids = write_keyed(&pool, &[Some("k"), Some("k")]).await;
    let mut open = pool.begin().await.unwrap();
    let locked: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM event_outbox WHERE id = $1 FOR UPDATE")
            .bind(ids[0])
            .fetch_all(&mut *open)
            .await
            .unwrap();
    assert_eq!(locked, [ids[0]]);
    assert_eq!(claim_as(&store, "r", LEASE).await, Vec::<Uuid>::new());
    open.rollback().await.unwrap();
    assert_eq!(claim_as(&store, "r", LEASE).await, [ids[0]]);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_key_window_steps_through_keys_in_byte_order_one_head_each(pool: PgPool) {
    let store = PgOutboxStore::new(pool.clone());
    // "B" < "a" < "é" in bytes, whatever the database's collation says.
    let ids = write_keyed(&pool, &[Some("a"), Some("é"), Some("a"), Some("B"), None]).await;
    let w = store.outbox_key_window("", 2, LEASE).await.unwrap();
    let keys: Vec<_> = w.heads.iter().map(|h| (h.key.as_str(), h.id)).collect();
    assert_eq!(keys, [("B", ids[3]), ("a", ids[0])]);
    assert!(!w.exhausted, "a full window may have keys after it");
    let rest = store.outbox_key_window("a", 2, LEASE).await.unwrap();
    assert_eq!(rest.heads.len(), 1);
    assert_eq!(
        (rest.heads[0].key.as_str(), rest.heads[0].id),
        ("é", ids[1])
    );
    assert!(rest.exhausted);
    // A claimed head is in the window, not claimable; a parked one too.
    claim_as(&store, "r", LEASE).await;
    let w = store.outbox_key_window("", 10, LEASE).await.unwrap();
    assert!(w.heads.iter().all(|h| !h.claimable), "{w:?}");
    let fail = RowFailure {
        id: ids[3],
        error: "refused".into(),
    };
    store.outbox_mark_failed("r", &[fail], 1).await.unwrap();
    let w = store
        .outbox_key_window("", 10, Duration::ZERO)
        .await
        .unwrap();
    let b = w.heads.iter().find(|h| h.key == "B").unwrap();
    assert!(!b.claimable, "parked");
    assert!(w.heads.iter().filter(|h| h.key != "B").all(|h| h.claimable));
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_candidate_that_is_not_its_keys_head_is_not_claimed(pool: PgPool) {
    let store = PgOutboxStore::new(pool.clone());
    let ids = write_keyed(&pool, &[Some("k"), Some("k")]).await;
    let claimed = store
        .outbox_claim(ClaimParams {
            replica_id: "r",
            lease_ttl: LEASE,
            batch_size: 100,
            key_heads: &[ids[1]],
            after: None,
        })
        .await
        .unwrap();
    assert!(claimed.is_empty(), "k2 is behind the unpublished k1");
    let unlisted = store
        .outbox_claim(ClaimParams {
            replica_id: "r",
            lease_ttl: LEASE,
            batch_size: 100,
            key_heads: &[],
            after: None,
        })
        .await
        .unwrap();
    assert!(
        unlisted.is_empty(),
        "a keyed row is claimed only as a candidate"
    );
}
