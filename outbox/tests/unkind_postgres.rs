//! The subscriber against what real PostgreSQL does that a kind database
//! would not (issue 25), on the local PostgreSQL and RabbitMQ:
//! - a handler whose statement waits on a lock past its deadline: the
//!   statement is ended at the server, no pooled connection leaks, the
//!   overruns count attempts and the events dead-letter at their budget;
//! - a deferred constraint that fails at COMMIT: the delivery whose data
//!   breaks it is found and counted, the rest of its batch takes effect,
//!   nothing loops;
//! - a handler that swallows its own SQL error (PostgreSQL then answers the
//!   COMMIT with a rollback and no error): the batch is never taken for
//!   committed nor acked; the delivery is counted and applied on its next
//!   run.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, unique};
use outbox::core::ports::SubscriptionSpec;
use outbox::core::subscriber::{Handler, Subscriber, SubscriberSettings, SubscriberStats};
use outbox::{EventEnvelope, HandlerError, LapinBroker, PgInboxStore, PgTx, TokioClock};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;
use uuid::Uuid;

/// Writes one `effects` row per event; by routing key, also: `orders.locked`
/// a row of `locked` (which a test keeps locked), `orders.keyed` the
/// payload's `k` into `keyed` (unique, deferred), `orders.swallow` a failing
/// statement on the event's first run whose error it logs and ignores.
struct Unkind {
    swallowed: Mutex<BTreeSet<Uuid>>,
}

impl Handler<PgTx> for Unkind {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        match event.routing_key.as_str() {
            "orders.locked" => {
                sqlx::query("INSERT INTO locked (event_id) VALUES ($1)")
                    .bind(event.id)
                    .execute(&mut **tx)
                    .await?;
            }
            "orders.keyed" => {
                sqlx::query("INSERT INTO keyed (k, event_id) VALUES ($1, $2)")
                    .bind(event.payload["k"].as_str())
                    .bind(event.id)
                    .execute(&mut **tx)
                    .await?;
            }
            "orders.swallow" if self.swallowed.lock().unwrap().insert(event.id) => {
                // A "best effort" write that fails; the error is logged
                // and ignored, which leaves the transaction aborted.
                if let Err(e) = sqlx::query("SELECT 1/0").execute(&mut **tx).await {
                    eprintln!("best effort write failed, carrying on: {e}");
                }
            }
            _ => {}
        }
        Ok(())
    }
}

struct Running {
    pool: PgPool,
    exchange: String,
    subscriber: Arc<Subscriber<PgInboxStore, LapinBroker, TokioClock, Unkind>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    publisher: LapinBroker,
}

/// A subscriber on a pool of `connections`, one worker applying batches
/// of up to `batch_max`, with a handler deadline of one second.
async fn start(pool: &PgPool, connections: u32, batch_max: u32, max_attempts: u32) -> Running {
    for table in [
        "CREATE TABLE IF NOT EXISTS effects (event_id UUID NOT NULL)",
        "CREATE TABLE IF NOT EXISTS locked (event_id UUID NOT NULL)",
        "CREATE TABLE IF NOT EXISTS keyed (k TEXT NOT NULL UNIQUE DEFERRABLE INITIALLY DEFERRED, \
         event_id UUID NOT NULL)",
    ] {
        sqlx::query(table).execute(pool).await.unwrap();
    }
    let small = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let queue = unique("unkind");
    let exchange = unique("unkind.x");
    let settings = SubscriberSettings {
        spec: SubscriptionSpec {
            queue: queue.clone(),
            exchange: exchange.clone(),
            bindings: vec!["orders.#".into()],
            prefetch: 16,
            queue_type: outbox::QueueType::Quorum,
            partitions: 0,
            partition: None,
        },
        concurrency: 1,
        max_attempts,
        max_body_bytes: 64 * 1024,
        handler_timeout: Duration::from_secs(1),
        batch_max,
        batch_linger: Duration::from_millis(200),
    };
    let subscriber = Arc::new(Subscriber::new(
        Arc::new(PgInboxStore::new(small.clone())),
        Arc::new(LapinBroker::new(common::amqp_url())),
        Arc::new(TokioClock::default()),
        Arc::new(Unkind {
            swallowed: Mutex::default(),
        }),
        settings,
    ));
    let (stop, rx) = watch::channel(false);
    let s = subscriber.clone();
    let task = tokio::spawn(async move { s.run(rx).await.unwrap() });
    common::wait_for_queue(&queue).await;
    Running {
        pool: small,
        exchange,
        subscriber,
        stop,
        task,
        publisher: LapinBroker::new(common::amqp_url()),
    }
}

impl Running {
    /// Publishes these envelopes, in order, each confirmed.
    async fn publish(&self, events: &[EventEnvelope]) {
        for e in events {
            let body = e.encode(&Default::default()).unwrap();
            common::publish_confirmed(
                &self.publisher,
                &self.exchange,
                &e.routing_key,
                e.id,
                body.as_bytes(),
            )
            .await;
        }
    }

    async fn until(&self, secs: u64, done: impl Fn(&SubscriberStats) -> bool) {
        common::until_counters(&self.subscriber.counters(), secs, done).await;
    }

    async fn count(&self, sql: &'static str, id: Option<Uuid>) -> i64 {
        let q = sqlx::query_scalar(sql);
        let q = match id {
            Some(id) => q.bind(id),
            None => q,
        };
        q.fetch_one(&self.pool).await.unwrap()
    }

    async fn attempts(&self, id: Uuid) -> (i32, bool) {
        sqlx::query_as(
            "SELECT attempts, dead_lettered_at IS NOT NULL FROM event_inbox WHERE event_id = $1",
        )
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn stop(self) {
        self.stop.send_replace(true);
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the subscriber stops")
            .unwrap();
    }
}

/// Sessions of this database waiting on a lock.
async fn lock_waits(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_handler_blocked_on_a_lock_is_ended_at_the_server_leaks_no_connection_and_dead_letters(
    pool: PgPool,
) {
    // Five pooled connections, as the issue's `consume` run had.
    let r = start(&pool, 5, 2, 2).await;
    let mut locker = pool.begin().await.unwrap();
    sqlx::raw_sql("LOCK TABLE locked IN SHARE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let events: Vec<EventEnvelope> = (0..3)
        .map(|i| EventEnvelope::new("orders.locked", serde_json::json!({ "i": i })))
        .collect();
    r.publish(&events).await;
    // Each attempt is two overruns (the first runs once more), each ended at
    // the server; two attempts each, then the dead-letter queue.
    r.until(60, |s| s.dead_lettered == 3).await;
    for e in &events {
        assert_eq!(r.attempts(e.id).await, (2, true));
    }
    // Nothing of theirs still waits on the lock, and the pool is whole: a
    // connection comes at once, and no session of the pool is stuck.
    eventually(Duration::from_secs(5), || async {
        lock_waits(&pool).await == 0
    })
    .await;
    let conn = tokio::time::timeout(Duration::from_secs(1), r.pool.acquire())
        .await
        .expect("the pool has a connection free")
        .unwrap();
    drop(conn);
    assert!(r.pool.size() <= 5);
    // The lock goes; the operator replays; each takes effect once.
    locker.rollback().await.unwrap();
    let replayed = r
        .subscriber
        .replay(&outbox::admin::InboxFilter {
            dead_lettered_only: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(replayed.len(), 3);
    for e in &events {
        let n = r
            .count(
                "SELECT count(*) FROM locked WHERE event_id = $1",
                Some(e.id),
            )
            .await;
        assert_eq!(n, 1, "{} applied once", e.id);
    }
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_deferred_constraint_failing_at_commit_is_the_deliverys_and_never_loops(pool: PgPool) {
    let r = start(&pool, 5, 4, 2).await;
    // Three events share a key under a deferred unique constraint; a fourth
    // is unrelated. They arrive together, so they share a batch.
    let mut events: Vec<EventEnvelope> = (0..3)
        .map(|_| EventEnvelope::new("orders.keyed", serde_json::json!({ "k": "same" })))
        .collect();
    events.push(EventEnvelope::new("orders.plain", serde_json::json!({})));
    r.publish(&events).await;
    r.until(60, |s| s.processed == 2 && s.dead_lettered == 2)
        .await;
    let keyed = r.count("SELECT count(*) FROM keyed", None).await;
    assert_eq!(keyed, 1, "one event took the key");
    let plain = r
        .count(
            "SELECT count(*) FROM effects WHERE event_id = $1",
            Some(events[3].id),
        )
        .await;
    assert_eq!(plain, 1, "the unrelated event took effect");
    let mut dead = 0;
    for e in &events[..3] {
        match r.attempts(e.id).await {
            (2, true) => dead += 1,
            other => assert_eq!(other, (0, false), "{}", e.id),
        }
    }
    assert_eq!(
        dead, 2,
        "the two that cannot commit are dead-lettered at their budget"
    );
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_handler_that_swallows_its_sql_error_is_never_taken_for_committed(pool: PgPool) {
    for batch_max in [1, 4] {
        let r = start(&pool, 5, batch_max, 3).await;
        let events: Vec<EventEnvelope> = (0..4)
            .map(|i| EventEnvelope::new("orders.swallow", serde_json::json!({ "i": i })))
            .collect();
        r.publish(&events).await;
        r.until(60, |s| s.processed == 4).await;
        let stats = r.subscriber.counters().snapshot();
        assert_eq!(stats.retried, 4, "each first run is counted: {stats:?}");
        for e in &events {
            let n = r
                .count(
                    "SELECT count(*) FROM effects WHERE event_id = $1",
                    Some(e.id),
                )
                .await;
            assert_eq!(n, 1, "{} applied once (batches of {batch_max})", e.id);
            let (attempts, dead) = r.attempts(e.id).await;
            assert_eq!((attempts, dead), (1, false));
        }
        r.stop().await;
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_handler_transaction_is_bounded_at_the_server_by_the_handler_deadline(pool: PgPool) {
    use outbox::core::ports::{InboxStore, TxBounds};
    let store = PgInboxStore::new(pool.clone());
    // A deadline of 90 s: the fixed minute idle in transaction cut off
    // every attempt of a valid handler that took longer (issue 25).
    let bounds = TxBounds::for_handler(Duration::from_secs(90));
    let mut tx = store.inbox_begin(bounds).await.unwrap();
    let show = |name: &'static str| format!("SELECT current_setting('{name}')");
    let mut settings = Vec::new();
    for name in [
        "idle_in_transaction_session_timeout",
        "statement_timeout",
        "application_name",
    ] {
        let v: String = sqlx::query_scalar(sqlx::AssertSqlSafe(show(name)))
            .fetch_one(&mut **tx)
            .await
            .unwrap();
        settings.push(v);
    }
    assert_eq!(settings[0], "190s");
    assert_eq!(settings[1], "91s");
    assert_eq!(settings[2], tx.tag());
    store.inbox_rollback(tx).await;
    // SET LOCAL: they end with the transaction.
    let after: String = sqlx::query_scalar("SELECT current_setting('statement_timeout')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, "0");
}
