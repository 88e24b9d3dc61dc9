//! The producer half against the real local PostgreSQL and RabbitMQ: what is
//! committed reaches an independent consumer, what is rolled back never does,
//! and broker faults, crashes and nacks lose nothing and blame no row wrongly.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{PlainConsumer, Proxy, eventually, unique};
use outbox::admin::UnparkSelector;
use outbox::core::drainer::Drainer;
use outbox::core::ports::{Clock, OutboxStore};
use outbox::runtime::OsEntropy;
use outbox::{
    DrainError, DrainerConfig, EventEnvelope, LapinBroker, PgOutboxStore, Publisher, TokioClock,
};
use sqlx::PgPool;

type TestDrainer = Drainer<PgOutboxStore, LapinBroker, TokioClock, OsEntropy>;

fn drainer(pool: &PgPool, amqp_url: &str, config: DrainerConfig) -> TestDrainer {
    Drainer::new(
        Arc::new(PgOutboxStore::new(pool.clone())),
        Arc::new(LapinBroker::new(amqp_url)),
        Arc::new(TokioClock::default()),
        Arc::new(OsEntropy::default()),
        config,
    )
}

fn config(exchange: &str, replica: &str) -> outbox::config::DrainerConfigBuilder {
    DrainerConfig::builder()
        .exchange(exchange)
        .replica_id(replica)
}

/// Ticks until a tick claims nothing (bounded).
async fn drain_all(d: &TestDrainer) -> u64 {
    let mut published = 0;
    for _ in 0..1000 {
        let r = d.tick().await.expect("tick");
        published += r.published;
        if r.claimed == 0 {
            return published;
        }
    }
    panic!("outbox did not drain within 1000 ticks");
}

async fn row_attempts(pool: &PgPool) -> Vec<(uuid::Uuid, i32, bool)> {
    sqlx::query_as(
        "SELECT id, attempts, published_at IS NOT NULL FROM event_outbox ORDER BY enqueued_at, id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn write_events(pool: &PgPool, key: &str, n: usize) -> Vec<EventEnvelope> {
    let publisher = Publisher::new(pool.clone());
    let mut out = Vec::new();
    for i in 0..n {
        let env = EventEnvelope::new(key, serde_json::json!({ "n": i }));
        publisher.publish(&env).await.unwrap();
        out.push(env);
    }
    out
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn committed_envelopes_reach_a_consumer_and_rolled_back_ones_never_do(pool: PgPool) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "orders.#").await;
    let publisher = Publisher::new(pool.clone());
    sqlx::query("CREATE TABLE orders (n INT PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();

    let mut committed = Vec::new();
    let mut rolled_back = Vec::new();
    for n in 0..60 {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO orders (n) VALUES ($1)")
            .bind(n)
            .execute(&mut *tx)
            .await
            .unwrap();
        let env = EventEnvelope::new("orders.created", serde_json::json!({ "n": n }));
        if n % 10 == 9 {
            // Many envelopes in one round-trip, same transaction.
            let many: Vec<_> = (0..5)
                .map(|k| EventEnvelope::new("orders.line", serde_json::json!({ "n": n, "k": k })))
                .collect();
            publisher.publish_many_tx(&mut tx, &many).await.unwrap();
            committed.extend(many.iter().map(|e| e.id));
        }
        publisher.publish_tx(&mut tx, &env).await.unwrap();
        if n % 3 == 0 {
            tx.rollback().await.unwrap();
            rolled_back.push(env.id);
            if n % 10 == 9 {
                committed.truncate(committed.len() - 5);
            }
        } else {
            tx.commit().await.unwrap();
            committed.push(env.id);
        }
    }
    assert_eq!(
        publisher.outbox_pending_count().await.unwrap(),
        committed.len() as u64
    );

    let d = drainer(
        &pool,
        &common::amqp_url(),
        config(&exchange, "r1").batch_size(17).build().unwrap(),
    );
    d.tick().await.unwrap(); // connects lazily; the consumer is already bound
    drain_all(&d).await;
    assert_eq!(publisher.outbox_pending_count().await.unwrap(), 0);

    let got = consumer
        .wait_for(committed.len(), Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let got_ids: Vec<uuid::Uuid> = consumer
        .snapshot()
        .await
        .iter()
        .map(|r| r.message_id.parse().unwrap())
        .collect();
    let mut want = committed.clone();
    want.sort();
    let mut have = got_ids.clone();
    have.sort();
    assert_eq!(have, want, "exactly the committed envelopes, each once");
    for id in &rolled_back {
        assert!(
            !got_ids.contains(id),
            "rolled-back envelope {id} was published"
        );
    }
    for r in &got {
        assert!(r.persistent, "delivery mode must be persistent");
        let env = EventEnvelope::decode(&r.body).unwrap();
        assert_eq!(
            env.id.to_string(),
            r.message_id,
            "message_id is the envelope id"
        );
        assert_eq!(env.routing_key, r.routing_key);
    }
    // Publishing order follows enqueue order within one drainer.
    let published_order: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM event_outbox ORDER BY enqueued_at, id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(published_order.len(), committed.len());
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn broker_connections_cut_mid_drain_lose_nothing_and_blame_no_row(pool: PgPool) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let events = write_events(&pool, "cut.event", 300).await;
    // Depth 1 makes every batch a long series of round-trips, so cuts land
    // mid-batch: after claim, between publishes, before confirms.
    let d = drainer(
        &pool,
        &proxy.amqp_url(),
        config(&exchange, "r1")
            .batch_size(50)
            .pipeline_depth(1)
            .build()
            .unwrap(),
    );
    let proxy = Arc::new(proxy);
    let cutter = {
        let proxy = proxy.clone();
        tokio::spawn(async move {
            for _ in 0..15 {
                tokio::time::sleep(Duration::from_millis(7)).await;
                proxy.cut();
            }
        })
    };
    let mut errors = 0;
    for _ in 0..2000 {
        match d.tick().await {
            Ok(r) if r.claimed == 0 && cutter.is_finished() => break,
            Ok(_) => {}
            Err(e) => {
                assert!(e.implicates_broker(), "unexpected error {e}");
                errors += 1;
            }
        }
    }
    assert!(errors > 0, "the cuts should have interrupted some batches");
    let rows = row_attempts(&pool).await;
    assert!(
        rows.iter().all(|(_, a, p)| *a == 0 && *p),
        "all published, attempts 0: {rows:?}"
    );
    let got = consumer
        .wait_for(events.len(), Duration::from_secs(10))
        .await;
    for e in &events {
        assert!(
            got.iter().any(|r| r.message_id == e.id.to_string()),
            "lost {}",
            e.id
        );
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_black_holed_broker_times_out_releases_claims_and_drains_after(pool: PgPool) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let d = drainer(
        &pool,
        &proxy.amqp_url(),
        config(&exchange, "r1")
            .pipeline_depth(4)
            .confirm_timeout_secs(1)
            .lease_ttl_secs(5)
            .build()
            .unwrap(),
    );
    // Establish the connection with a warm-up event, then black-hole it.
    let mut events = write_events(&pool, "hole.warmup", 1).await;
    assert_eq!(drain_all(&d).await, 1);
    events.extend(write_events(&pool, "hole.event", 10).await);
    proxy.hold();
    let started = tokio::time::Instant::now();
    let err = d.tick().await.expect_err("black-hole must time out");
    assert!(
        matches!(
            err,
            DrainError::ConfirmTimeout {
                rows: 10,
                timeout_secs: 1
            }
        ),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "deadline bounded the tick"
    );
    let claimed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM event_outbox WHERE claimed_by IS NOT NULL AND published_at IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(claimed, 0, "every claim released");
    assert!(row_attempts(&pool).await.iter().all(|(_, a, _)| *a == 0));
    proxy.pass();
    drain_all(&d).await;
    assert!(
        row_attempts(&pool)
            .await
            .iter()
            .all(|(_, a, p)| *a == 0 && *p)
    );
    let got = consumer
        .wait_for(events.len(), Duration::from_secs(10))
        .await;
    for e in &events {
        assert!(
            got.iter().any(|r| r.message_id == e.id.to_string()),
            "lost {}",
            e.id
        );
    }
}

/// A store whose mark never returns: the drainer "crashes" between publish
/// and mark when the test aborts it there.
struct StuckMark(PgOutboxStore);

impl outbox::core::ports::Replication for StuckMark {
    async fn replication_positions(
        &self,
        standbys: &[String],
    ) -> Result<outbox::core::ports::ReplicationPositions, outbox::StoreError> {
        self.0.replication_positions(standbys).await
    }
}

impl OutboxStore for StuckMark {
    async fn outbox_key_window(
        &self,
        after: &str,
        limit: u32,
        ttl: Duration,
    ) -> Result<outbox::core::ports::KeyWindow, outbox::StoreError> {
        self.0.outbox_key_window(after, limit, ttl).await
    }
    async fn outbox_claim(
        &self,
        p: outbox::core::ports::ClaimParams<'_>,
    ) -> Result<Vec<outbox::core::ports::ClaimedRow>, outbox::StoreError> {
        self.0.outbox_claim(p).await
    }
    async fn outbox_mark_published(
        &self,
        _: &str,
        _: &[uuid::Uuid],
    ) -> Result<u64, outbox::StoreError> {
        std::future::pending().await
    }
    async fn outbox_mark_failed(
        &self,
        r: &str,
        f: &[outbox::core::ports::RowFailure],
        m: u32,
    ) -> Result<outbox::core::ports::FailOutcome, outbox::StoreError> {
        self.0.outbox_mark_failed(r, f, m).await
    }
    async fn outbox_release(&self, r: &str, ids: &[uuid::Uuid]) -> Result<u64, outbox::StoreError> {
        self.0.outbox_release(r, ids).await
    }
    async fn outbox_stats(&self) -> Result<outbox::runtime::OutboxStats, outbox::StoreError> {
        self.0.outbox_stats().await
    }
    async fn outbox_delete_published(
        &self,
        o: Duration,
        l: u32,
    ) -> Result<u64, outbox::StoreError> {
        self.0.outbox_delete_published(o, l).await
    }
    async fn outbox_retire_partitions(
        &self,
        o: Duration,
    ) -> Result<outbox::core::ports::PartitionsRetired, outbox::StoreError> {
        self.0.outbox_retire_partitions(o).await
    }
    async fn outbox_list_parked(
        &self,
        f: &outbox::admin::ParkedFilter,
    ) -> Result<Vec<outbox::admin::ParkedRow>, outbox::StoreError> {
        self.0.outbox_list_parked(f).await
    }
    async fn outbox_unpark(&self, s: &UnparkSelector) -> Result<u64, outbox::StoreError> {
        self.0.outbox_unpark(s).await
    }
    async fn outbox_skip(&self, s: &UnparkSelector) -> Result<u64, outbox::StoreError> {
        self.0.outbox_skip(s).await
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_drainer_stopped_between_publish_and_mark_is_covered_by_another_after_the_lease(
    pool: PgPool,
) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let events = write_events(&pool, "crash.event", 5).await;
    let cfg = |r: &str| {
        config(&exchange, r)
            .pipeline_depth(4)
            .confirm_timeout_secs(1)
            .lease_ttl_secs(2)
            .build()
            .unwrap()
    };
    let crashed = Drainer::new(
        Arc::new(StuckMark(PgOutboxStore::new(pool.clone()))),
        Arc::new(LapinBroker::new(common::amqp_url())),
        Arc::new(TokioClock::default()),
        Arc::new(OsEntropy::default()),
        cfg("crashed"),
    );
    let task = tokio::spawn(async move { crashed.tick().await });
    consumer
        .wait_for(events.len(), Duration::from_secs(10))
        .await;
    task.abort(); // the process dies after publishing, before marking
    let _ = task.await;

    let survivor = drainer(&pool, &common::amqp_url(), cfg("survivor"));
    assert_eq!(
        survivor.tick().await.unwrap().claimed,
        0,
        "lease still held"
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(drain_all(&survivor).await, events.len() as u64);

    let got = consumer
        .wait_for(2 * events.len(), Duration::from_secs(10))
        .await;
    for e in &events {
        let copies = got
            .iter()
            .filter(|r| r.message_id == e.id.to_string())
            .count();
        assert_eq!(
            copies, 2,
            "published, then republished with the same message_id"
        );
    }
    assert!(
        row_attempts(&pool)
            .await
            .iter()
            .all(|(_, a, p)| *a == 0 && *p)
    );
}

/// Issue 28: the drainer's claims, marks and releases run on sessions of
/// its own, named after the pool's application with a suffix, at most
/// `DRAIN_SESSIONS` of them, opened with the settings that spare each
/// commit a WAL flush; statements of the caller's sessions keep theirs.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_drainer_claims_and_marks_on_sessions_of_its_own(pool: PgPool) {
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .application_name("orders-svc");
    let named = sqlx::postgres::PgPoolOptions::new()
        .connect_with(options)
        .await
        .unwrap();
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let events = write_events(&named, "own.event", 120).await;
    let d = drainer(
        &named,
        &common::amqp_url(),
        config(&exchange, "own").build().unwrap(),
    );
    assert_eq!(drain_all(&d).await, events.len() as u64);
    consumer
        .wait_for(events.len(), Duration::from_secs(10))
        .await;
    let drain_sessions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(format!(
        "orders-svc {}",
        outbox::pg::DRAIN_APPLICATION_SUFFIX
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        (1..=i64::from(outbox::pg::DRAIN_SESSIONS)).contains(&drain_sessions),
        "{drain_sessions} drainer sessions"
    );
    let sync: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&named)
        .await
        .unwrap();
    assert_eq!(sync, "on", "the caller's own sessions keep their settings");
    let unpublished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        unpublished, 0,
        "every mark is visible at once, flushed or not"
    );
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn two_drainers_on_one_table_publish_each_envelope_once(pool: PgPool) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let events = write_events(&pool, "race.event", 400).await;
    let a = drainer(
        &pool,
        &common::amqp_url(),
        config(&exchange, "a").batch_size(10).build().unwrap(),
    );
    let b = drainer(
        &pool,
        &common::amqp_url(),
        config(&exchange, "b").batch_size(10).build().unwrap(),
    );
    let (pa, pb) = tokio::join!(drain_all(&a), drain_all(&b));
    assert_eq!(pa + pb, events.len() as u64);
    consumer
        .wait_for(events.len(), Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = consumer.snapshot().await;
    assert_eq!(got.len(), events.len(), "no envelope published twice");
    let mut ids: Vec<_> = got.iter().map(|r| r.message_id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), events.len());
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_full_queue_s_nacks_blame_no_row_and_its_rows_publish_once_it_has_room(pool: PgPool) {
    // A queue that refuses every publish (reject-publish at length 0)
    // nacks the poison.* rows: the infrastructure's trouble, not theirs
    // (issue 26). They are released with their attempts untouched, never
    // park however often it happens, the rest publishes, and the tick
    // fails so the drain loop backs off.
    let exchange = unique("ex");
    let conn = common::connect().await;
    let reject_queue = common::declare_rejecting_queue(&conn, &exchange, "poison.#").await;
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let poison = write_events(&pool, "poison.event", 1).await.remove(0);
    let fine = write_events(&pool, "fine.event", 3).await;
    let d = drainer(
        &pool,
        &common::amqp_url(),
        config(&exchange, "r1").max_attempts(1).build().unwrap(),
    );
    for _ in 0..3 {
        match d.tick().await {
            Err(DrainError::Refused { rows: 1, reason }) => {
                assert!(reason.contains("basic.nack"), "{reason}")
            }
            other => panic!("expected a refused tick, got {other:?}"),
        }
        let (attempts, parked, claimed): (i32, bool, bool) = sqlx::query_as(
            "SELECT attempts, parked_at IS NOT NULL, claimed_by IS NOT NULL \
             FROM event_outbox WHERE id = $1",
        )
        .bind(poison.id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((attempts, parked, claimed), (0, false, false));
    }
    let stats = PgOutboxStore::new(pool.clone())
        .outbox_stats()
        .await
        .unwrap();
    assert_eq!((stats.pending, stats.parked), (1, 0));

    // The queue has room again: the row publishes.
    common::delete_queue(&conn, &reject_queue).await;
    assert_eq!(drain_all(&d).await, 1);
    let got = consumer
        .wait_for(fine.len() + 1, Duration::from_secs(10))
        .await;
    assert!(got.iter().any(|r| r.message_id == poison.id.to_string()));
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn unpublishable_rows_park_at_the_budget_and_unpark_gives_a_fresh_one(pool: PgPool) {
    let exchange = unique("ex");
    let _consumer = PlainConsumer::start(&exchange, "#").await;
    let bad = write_events(&pool, "bad.event", 1).await.remove(0);
    // A routing key no broker accepts, written past publish_tx's checks.
    sqlx::query("UPDATE event_outbox SET routing_key = repeat('k', 256) WHERE id = $1")
        .bind(bad.id)
        .execute(&pool)
        .await
        .unwrap();
    let d = drainer(
        &pool,
        &common::amqp_url(),
        config(&exchange, "r1").max_attempts(3).build().unwrap(),
    );
    for expected in 1..=3 {
        let r = d.tick().await.unwrap();
        assert_eq!(r.failed, 1, "the unpublishable row is blamed");
        let (attempts, last_error, parked): (i32, Option<String>, bool) = sqlx::query_as(
            "SELECT attempts, last_error, parked_at IS NOT NULL FROM event_outbox WHERE id = $1",
        )
        .bind(bad.id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(attempts, expected);
        assert!(last_error.unwrap().contains("routing key"));
        assert_eq!(parked, expected == 3, "parks exactly at the budget");
    }
    // Parked: no longer claimed.
    assert_eq!(d.tick().await.unwrap().claimed, 0);
    let store = PgOutboxStore::new(pool.clone());
    let parked = outbox::admin::list_parked(&store, &outbox::admin::ParkedFilter::page(10, None))
        .await
        .unwrap();
    assert_eq!(
        (parked.len(), parked[0].id, parked[0].attempts),
        (1, bad.id, 3)
    );
    let n = outbox::admin::unpark(&store, &UnparkSelector::Ids(vec![bad.id]))
        .await
        .unwrap();
    assert_eq!(n, 1);
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM event_outbox WHERE id = $1")
        .bind(bad.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(attempts, 0, "unpark resets the budget");
    assert_eq!(
        d.tick().await.unwrap().failed,
        1,
        "claimed again after unpark"
    );
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_janitor_deletes_only_published_rows_past_retention(pool: PgPool) {
    let events = write_events(&pool, "janitor.event", 6).await;
    // 0,1: published 8 days ago; 2: published now; 3: unpublished but old;
    // 4: parked and old; 5: pending.
    for (i, sql) in [
        (0, "published_at = now() - interval '8 days'"),
        (1, "published_at = now() - interval '8 days'"),
        (2, "published_at = now()"),
        (3, "enqueued_at = now() - interval '30 days'"),
        (
            4,
            "parked_at = now() - interval '30 days', enqueued_at = now() - interval '30 days'",
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE event_outbox SET {sql} WHERE id = $1"
        )))
        .bind(events[i].id)
        .execute(&pool)
        .await
        .unwrap();
    }
    let store = PgOutboxStore::new(pool.clone());
    let cfg = DrainerConfig::builder().janitor_batch(1).build().unwrap();
    let deleted = outbox::core::janitor::sweep(&store, &cfg).await.unwrap();
    assert_eq!(deleted, 2);
    let left: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM event_outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut want: Vec<_> = events[2..].iter().map(|e| e.id).collect();
    want.sort();
    assert_eq!(left, want);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn stats_feed_gauges_and_readiness_says_why_it_is_unready(pool: PgPool) {
    let store = PgOutboxStore::new(pool.clone());
    let clock = TokioClock::default();
    let cfg = DrainerConfig::builder()
        .pending_warn(2)
        .oldest_warn_secs(60)
        .build()
        .unwrap();
    let health = outbox::runtime::OutboxHealth::default();
    let r = health.readiness(&cfg, clock.now());
    assert_eq!(r.reasons, vec![outbox::UnreadyReason::NotSampled]);

    outbox::core::stats::sample(&store, &clock, &cfg, &health)
        .await
        .unwrap();
    assert!(health.readiness(&cfg, clock.now()).ready);

    let events = write_events(&pool, "stats.event", 3).await;
    sqlx::query("UPDATE event_outbox SET enqueued_at = now() - interval '2 minutes' WHERE id = $1")
        .bind(events[0].id)
        .execute(&pool)
        .await
        .unwrap();
    let s = outbox::core::stats::sample(&store, &clock, &cfg, &health)
        .await
        .unwrap();
    assert_eq!(s.pending, 3);
    assert!(s.oldest_unpublished_age_secs >= 119.0);
    let r = health.readiness(&cfg, clock.now());
    assert!(!r.ready);
    assert!(r.reasons.iter().any(|x| matches!(
        x,
        outbox::UnreadyReason::PendingOverThreshold {
            pending: 3,
            threshold: 2
        }
    )));
    assert!(r.reasons.iter().any(|x| matches!(
        x,
        outbox::UnreadyReason::OldestOverThreshold {
            threshold_secs: 60,
            ..
        }
    )));
    // A sample older than three intervals is stale.
    let later = clock.now() + cfg.stats_interval * 4;
    assert!(
        health
            .readiness(&cfg, later)
            .reasons
            .iter()
            .any(|x| matches!(x, outbox::UnreadyReason::Stale { .. }))
    );
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_spawned_drainer_drains_and_shuts_down_gracefully(pool: PgPool) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let events = write_events(&pool, "spawn.event", 50).await;
    let handle = outbox::DrainerHandle::spawn(
        pool.clone(),
        LapinBroker::new(common::amqp_url()),
        config(&exchange, "spawned").build().unwrap(),
    );
    consumer
        .wait_for(events.len(), Duration::from_secs(10))
        .await;
    let publisher = Publisher::new(pool.clone());
    eventually(Duration::from_secs(10), || {
        let p = publisher.clone();
        async move { p.outbox_pending_count().await.unwrap() == 0 }
    })
    .await;
    eventually(Duration::from_secs(10), || async {
        handle.readiness().ready
    })
    .await;
    tokio::time::timeout(Duration::from_secs(20), handle.shutdown())
        .await
        .expect("shutdown is bounded");
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_commit_wakes_an_idle_drainer_long_before_its_tick(pool: PgPool) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    // A one-minute tick: without the NOTIFY wakeup nothing would publish
    // within the bound below.
    let handle = outbox::DrainerHandle::spawn(
        pool.clone(),
        LapinBroker::new(common::amqp_url()),
        config(&exchange, "woken")
            .tick_ms(60_000)
            .lease_ttl_secs(300)
            .confirm_timeout_secs(30)
            .build()
            .unwrap(),
    );
    // Let the drainer's first (empty) tick pass and its listener connect.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events = write_events(&pool, "woken.event", 3).await;
    consumer
        .wait_for(events.len(), Duration::from_secs(10))
        .await;
    // A rolled-back transaction notifies nobody and publishes nothing.
    let mut tx = pool.begin().await.unwrap();
    let ghost = EventEnvelope::new("woken.ghost", serde_json::json!({}));
    Publisher::new(pool.clone())
        .publish_tx(&mut tx, &ghost)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), handle.shutdown())
        .await
        .expect("shutdown is bounded");
    assert_eq!(consumer.snapshot().await.len(), 3);
}

/// The claim is a HOT update: no index names a column it writes, so the
/// row's claimed version stays on its page (where there is room) and no
/// index gains an entry.
/// Checked as a rule over every index on the table (an index on
/// `claimed_at` or `claimed_by`, added by anyone, fails it), then on the
/// claim statement itself, in a transaction of the test's own.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_claim_rewrites_no_index(pool: PgPool) {
    let defs: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_indexdef(indexrelid) FROM pg_index
         WHERE indrelid = 'event_outbox'::regclass",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(defs.len() >= 4, "{defs:?}");
    for def in &defs {
        assert!(
            !def.contains("claimed_"),
            "an index the claim must update: {def}"
        );
    }
    write_events(&pool, "hot.event", 25).await;
    // Keyed heads (issue 27) are claimed by the same UPDATE.
    let publisher = Publisher::new(pool.clone());
    for k in 0..25 {
        let e = EventEnvelope::new("hot.keyed", serde_json::json!({}))
            .with_ordering_key(format!("k{k}"));
        publisher.publish(&e).await.unwrap();
    }
    let heads = key_heads(&pool).await;
    let mut tx = claim_tx(&pool).await;
    let claimed = sqlx::query(include_str!("../src/pg/sql/outbox_claim.sql"))
        .bind("hot")
        .bind(60.0_f64)
        .bind(100_i64)
        .bind(&heads)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 50);
    let (updated, hot): (i64, i64) = sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_updated('event_outbox'::regclass),
                pg_stat_get_xact_tuples_hot_updated('event_outbox'::regclass)",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(updated, 50);
    // A page holds its rows at half its size, so nearly every claimed
    // version fits beside its row (the rest go to another page, which is
    // not HOT); with an index on a claimed column none would be.
    assert!(
        hot * 10 >= updated * 8,
        "{hot} of {updated} claimed rows HOT"
    );
}

/// Ordering keys (issue 27) end to end on the real services: two drainers
/// race over interleaved events of 30 keys (more keys than a batch, so the
/// key window moves and wraps) and unkeyed ones; the broker receives each
/// key's events in the order their transactions committed, each once, with
/// the key and its number as headers.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn two_drainers_publish_each_keys_events_in_commit_order(pool: PgPool) {
    let exchange = unique("ex");
    let consumer = PlainConsumer::start(&exchange, "#").await;
    let publisher = Publisher::new(pool.clone());
    let mut written = 0;
    for round in 0..8 {
        for k in 0..30 {
            let e = EventEnvelope::new("keyed.event", serde_json::json!({ "round": round }))
                .with_ordering_key(format!("key-{k:02}"));
            publisher.publish(&e).await.unwrap();
            written += 1;
        }
        publisher
            .publish(&EventEnvelope::new("plain.event", serde_json::json!({})))
            .await
            .unwrap();
        written += 1;
    }
    let cfg = |r: &str| config(&exchange, r).batch_size(8).build().unwrap();
    let (a, b) = (
        drainer(&pool, &common::amqp_url(), cfg("a")),
        drainer(&pool, &common::amqp_url(), cfg("b")),
    );
    let mut published = 0;
    for _ in 0..200 {
        let (pa, pb) = tokio::join!(drain_all(&a), drain_all(&b));
        published += pa + pb;
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL")
                .fetch_one(&pool)
                .await
                .unwrap();
        if left == 0 {
            break;
        }
    }
    assert_eq!(published, written);
    let got = consumer
        .wait_for(written as usize, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got_now = consumer.snapshot().await;
    assert_eq!(got_now.len(), got.len(), "nothing published twice");
    let mut per_key: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    for r in &got_now {
        match (
            r.headers.get("x-canopy-ordering-key"),
            r.headers.get("x-canopy-key-seq"),
        ) {
            (Some(k), Some(seq)) => per_key
                .entry(k.clone())
                .or_default()
                .push(seq.parse().unwrap()),
            (None, None) => assert_eq!(r.routing_key, "plain.event"),
            other => panic!("half an ordering: {other:?}"),
        }
    }
    assert_eq!(per_key.len(), 30);
    for (key, seqs) in per_key {
        assert_eq!(seqs, (1..=8).collect::<Vec<i64>>(), "{key} out of order");
    }
}

/// The claim's keyed candidates (issue 27) are found by primary key, and
/// each head check is one probe of the head index: the plan of the keyed
/// part names no other index, whatever the statistics say (written as
/// `id = ANY($4) ORDER BY enqueued_at`, it walked an age-ordered index
/// filtered for the candidates: 185 ms a claim at 700k rows).
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_keyed_claim_finds_its_candidates_by_primary_key(pool: PgPool) {
    write_events(&pool, "plain.event", 300).await;
    let publisher = Publisher::new(pool.clone());
    for k in 0..50 {
        let e = EventEnvelope::new("keyed.event", serde_json::json!({}))
            .with_ordering_key(format!("k{}", k % 10));
        publisher.publish(&e).await.unwrap();
    }
    sqlx::query("VACUUM ANALYZE event_outbox")
        .execute(&pool)
        .await
        .unwrap();
    for candidates in [key_heads(&pool).await, Vec::new()] {
        let mut tx = claim_tx(&pool).await;
        let explain = format!(
            "EXPLAIN (FORMAT JSON) {}",
            include_str!("../src/pg/sql/outbox_claim.sql")
        );
        let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
            .bind("r")
            .bind(60.0_f64)
            .bind(100_i64)
            .bind(&candidates)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let keyed = find(&plan, &|n| n["Subplan Name"] == "CTE keyed").expect("a keyed CTE");
        let mut indexes = Vec::new();
        walk(keyed, &mut |n| {
            if let Some(i) = n["Index Name"].as_str() {
                indexes.push(i.to_owned());
            }
            assert!(
                !n["Node Type"].as_str().unwrap_or("").contains("Seq Scan"),
                "{n}"
            );
        });
        assert!(
            indexes
                .iter()
                .all(|i| i == "event_outbox_pkey" || i == "event_outbox_key_head_idx"),
            "the keyed claim walks {indexes:?}"
        );
    }
}

/// The unkeyed claim reads no row it does not claim, and finds each row it
/// claims once: it walks `event_outbox_claim_unkeyed_idx` in claim order
/// and stops at the batch (no sort of a larger run of rows first), and it
/// stamps the lease on the row versions the lock took, by their address
/// (a TID scan), not by a second lookup of each row's primary key.
/// The backlog is one `publish_many_tx` transaction of 1 000 rows, which
/// share their `enqueued_at`: walked through `event_outbox_unpublished_idx`
/// with an incremental sort, a claim of 100 read all 1 000.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_unkeyed_claim_reads_only_the_rows_it_claims(pool: PgPool) {
    let batch: Vec<EventEnvelope> = (0..1000)
        .map(|i| EventEnvelope::new("plain.event", serde_json::json!({ "n": i })))
        .collect();
    let mut tx = pool.begin().await.unwrap();
    Publisher::new(pool.clone())
        .publish_many_tx(&mut tx, &batch)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::query("VACUUM ANALYZE event_outbox")
        .execute(&pool)
        .await
        .unwrap();
    // Prepared and run as the drainer's sessions run it: one generic plan
    // (`plan_cache_mode`), whatever the batch size and the candidates.
    let mut tx = claim_tx(&pool).await;
    let prepare = format!(
        "PREPARE claim(text, float8, bigint, uuid[]) AS {}",
        include_str!("../src/pg/sql/outbox_claim.sql")
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(prepare))
        .execute(&mut *tx)
        .await
        .unwrap();
    let plan: serde_json::Value =
        sqlx::query_scalar("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim('r', 60, 100, '{}')")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    tx.rollback().await.unwrap();
    let unkeyed = find(&plan, &|n| n["Subplan Name"] == "CTE unkeyed").expect("an unkeyed CTE");
    let mut scans = Vec::new();
    walk(unkeyed, &mut |n| {
        let kind = n["Node Type"].as_str().unwrap_or("");
        assert!(!kind.contains("Sort"), "the unkeyed claim sorts: {n}");
        if kind.contains("Scan") {
            scans.push((n["Index Name"].clone(), n["Actual Rows"].clone()));
        }
    });
    assert_eq!(
        scans,
        [(
            serde_json::json!("event_outbox_claim_unkeyed_idx"),
            serde_json::json!(100)
        )],
        "the unkeyed claim's scans (index, rows read)"
    );
    let claimed = find(&plan, &|n| n["Subplan Name"] == "CTE claimed").expect("a claimed CTE");
    let update = find(claimed, &|n| n["Node Type"] == "ModifyTable").expect("the update");
    let target = update["Plans"][0]["Plans"]
        .as_array()
        .and_then(|p| p.iter().find(|n| n["Parent Relationship"] == "Inner"))
        .expect("the update's row lookup");
    assert_eq!(target["Node Type"], "Tid Scan", "{target}");
    assert_eq!(target["Actual Loops"], 100, "{target}");
}

/// The heads of the first 100 keys, as the drainer's key window finds them.
async fn key_heads(pool: &PgPool) -> Vec<uuid::Uuid> {
    let window = PgOutboxStore::new(pool.clone())
        .outbox_key_window("", 100, Duration::from_secs(60))
        .await
        .unwrap();
    window.heads.iter().map(|h| h.id).collect()
}

/// A transaction of the test's own with the settings of the drainer's own
/// sessions (`outbox::pg::DRAIN_SESSION_SETTINGS`, the claim's planner
/// settings among them).
async fn claim_tx(pool: &PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    for (name, value) in outbox::pg::DRAIN_SESSION_SETTINGS {
        sqlx::query("SELECT set_config($1, $2, true)")
            .bind(name)
            .bind(value)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx
}

/// The first plan node (depth first) that `pred` accepts.
fn find<'a>(
    n: &'a serde_json::Value,
    pred: &dyn Fn(&serde_json::Value) -> bool,
) -> Option<&'a serde_json::Value> {
    if pred(n) {
        return Some(n);
    }
    let children = n
        .as_array()
        .into_iter()
        .flatten()
        .chain(n.get("Plan"))
        .chain(
            n.get("Plans")
                .and_then(|p| p.as_array())
                .into_iter()
                .flatten(),
        );
    for c in children {
        if let Some(found) = find(c, pred) {
            return Some(found);
        }
    }
    None
}

/// Calls `f` on every plan node under `n`.
fn walk(n: &serde_json::Value, f: &mut dyn FnMut(&serde_json::Value)) {
    f(n);
    for c in n
        .get("Plans")
        .and_then(|p| p.as_array())
        .into_iter()
        .flatten()
    {
        walk(c, f);
    }
}
