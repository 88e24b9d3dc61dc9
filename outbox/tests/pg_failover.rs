//! Failovers on the real pair of `.ci/pg-pair` (pg1 on 5441 streaming to
//! pg2 on 5442): a node list follows the writable node through an orderly
//! switchover (the primary turned read-only in place, the standby
//! promoted), and what a failover takes back, as the simulation's fake must
//! take it back: a standby promoted while it lagged lacks what the primary
//! committed after it fell away, and a commit whose synchronous wait was
//! cancelled is visible before any standby has it. With the durability
//! gates on, the service goes on through an orderly failover and through
//! a failover to a stale standby with no phantom event and no lost effect.
//! Each test changes the pair's roles, so they run one at a time, and
//! each makes the pair again whatever its outcome.

mod common;
#[path = "support/pair.rs"]
mod support;

use std::time::{Duration, Instant};

use outbox::core::ports::{OutboxStore, Replication, StandbyFlush};
use outbox::pg::nodes;
use outbox::{EventEnvelope, PgOutboxStore, Publisher};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::{PG1, PG2, pair, pool};

const NODES: &str =
    "postgres://postgres@127.0.0.1:5441,127.0.0.1:5442/postgres?target_session_attrs=read-write";

/// One test at a time: each changes the pair's roles.
fn one_at_a_time() -> &'static tokio::sync::Mutex<()> {
    static LOCK: std::sync::OnceLock<tokio::sync::Mutex<()>> = std::sync::OnceLock::new();
    LOCK.get_or_init(|| tokio::sync::Mutex::new(()))
}

/// Makes the pair again when the test ends, passed or not.
struct Remake;

impl Drop for Remake {
    fn drop(&mut self) {
        // Never a panic here: it would abort the test binary mid-unwind.
        for args in [&["reset"][..], &["start"]] {
            if let Err(e) = support::run(args) {
                eprintln!("did not remake the pair: {e}");
            }
        }
    }
}

/// A pool of `max` sessions on the node list, on its writable node.
async fn node_list(max: u32) -> PgPool {
    nodes::connect(
        NODES,
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("the pair is up: .ci/pg-pair start")
}

/// The library's tables and the effects table `Record` writes.
async fn migrate_with_effects(pool: &PgPool) {
    outbox::migrate::run(pool).await.unwrap();
    sqlx::query("CREATE TABLE durable_effects (event_id uuid NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

/// The port of the node a session of `pool` is on.
async fn port(pool: &PgPool) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT inet_server_port()")
        .fetch_one(pool)
        .await
}

/// Publishes one event through `pool`; whether it committed.
async fn publish(pool: &PgPool) -> bool {
    let attempt = async {
        let mut tx = pool.begin().await?;
        let event = EventEnvelope::new("orders.created", serde_json::json!({ "id": 1 }));
        Publisher::new(pool.clone())
            .publish_tx(&mut tx, &event)
            .await
            .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
        tx.commit().await
    };
    attempt.await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_list_follows_the_writable_node_through_a_switchover() {
    let _turn = one_at_a_time().lock().await;
    let _remake = Remake;
    let pool = node_list(4).await;
    outbox::migrate::run(&pool).await.unwrap();
    assert_eq!(port(&pool).await.unwrap(), 5441, "the first writable node");
    assert!(publish(&pool).await);
    // The drainer's own sessions and the inbox's control pool are on it too.
    let store = PgOutboxStore::new(pool.clone());
    assert_eq!(
        outbox::admin::list_parked(&store, &Default::default())
            .await
            .unwrap()
            .len(),
        0
    );
    // The drainer's own sessions open on pg1 (a guarded update writes).
    let nobody = [uuid::Uuid::now_v7()];
    assert_eq!(store.outbox_release("nobody", &nobody).await.unwrap(), 0);

    // The switchover: pg1 read-only in place (its sessions ended), pg2
    // promoted.
    pair(&["readonly", "pg1"]);
    pair(&["promote"]);

    // Within a bound, every new statement of the pool runs on pg2, and an
    // event committed there.
    let started = Instant::now();
    loop {
        if port(&pool).await.ok() == Some(5442) && publish(&pool).await {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the pool did not move to pg2 within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let moved_in = started.elapsed();
    // No session of the pool stays on pg1: every one handed out is on pg2.
    for _ in 0..8 {
        assert_eq!(port(&pool).await.unwrap(), 5442);
    }
    // The drainer's own sessions follow: their idle ones on pg1 are closed,
    // and the guarded update writes on pg2.
    let released = store.outbox_release("nobody", &nobody).await;
    assert!(released.is_ok(), "{released:?}");
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        pending, 2,
        "the event of each node, pg1's replicated before the switch"
    );
    eprintln!("the pool moved to the promoted node in {moved_in:?}");
}

/// The ids in `failover_probe` on `pool`'s node.
async fn probe_ids(pool: &PgPool) -> Vec<i32> {
    sqlx::query_scalar("SELECT id FROM failover_probe ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// `failover_probe` on pg1 holding id 1, replayed on pg2.
async fn probe_table() -> PgPool {
    let pg1 = pool(PG1).await;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS failover_probe; CREATE TABLE failover_probe (id int);
         INSERT INTO failover_probe VALUES (1);",
    )
    .execute(&pg1)
    .await
    .unwrap();
    let pg2 = pool(PG2).await;
    let started = Instant::now();
    loop {
        let there: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('failover_probe')::text")
                .fetch_one(&pg2)
                .await
                .unwrap();
        if there.is_some() && probe_ids(&pg2).await == [1] {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "pg2 did not replay"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    pg2.close().await;
    pg1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_promoted_while_it_lagged_lacks_what_it_never_received() {
    let _turn = one_at_a_time().lock().await;
    let _remake = Remake;
    let pg1 = probe_table().await;
    let names = ["pg2".to_owned()];
    let before = PgOutboxStore::new(pg1.clone())
        .replication_positions(&names)
        .await
        .unwrap();
    // The standby falls away; the primary (asynchronous) commits on.
    pair(&["crash", "pg2"]);
    sqlx::query("INSERT INTO failover_probe VALUES (2)")
        .execute(&pg1)
        .await
        .unwrap();
    assert_eq!(probe_ids(&pg1).await, [1, 2], "committed on the primary");
    pg1.close().await;
    // The primary is lost; the stale standby is promoted.
    pair(&["crash", "pg1"]);
    pair(&["up", "pg2"]);
    pair(&["promote"]);
    let pg2 = pool(PG2).await;
    assert_eq!(
        probe_ids(&pg2).await,
        [1],
        "the promoted standby holds what it received, not the later commit"
    );
    // A promotion starts a new timeline: the gates' way of telling the
    // new primary's line of history from the old one's.
    let after = PgOutboxStore::new(pg2)
        .replication_positions(&names)
        .await
        .unwrap();
    assert_eq!(after.timeline, before.timeline + 1, "{before:?} {after:?}");
    assert!(before.timeline >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_synchronous_wait_is_cancelled_is_visible_unreplicated() {
    let _turn = one_at_a_time().lock().await;
    let _remake = Remake;
    pair(&["start", "sync"]);
    let pg1 = probe_table().await;
    pair(&["crash", "pg2"]);
    // A commit now waits for the standby that is gone.
    let writer = pool(PG1).await;
    let mut session = writer.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *session)
        .await
        .unwrap();
    let insert = tokio::spawn(async move {
        sqlx::query("INSERT INTO failover_probe VALUES (2)")
            .execute(&mut *session)
            .await
            .map(drop)
    });
    let started = Instant::now();
    loop {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_one(&pg1)
                .await
                .unwrap();
        if waiting.as_deref() == Some("SyncRep") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the commit never waited for the standby: {waiting:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(probe_ids(&pg1).await, [1], "invisible while it waits");
    // The wait is cancelled (a statement timeout, a client that gives up):
    // PostgreSQL warns, and the commit stands, locally.
    sqlx::query("SELECT pg_cancel_backend($1)")
        .bind(pid)
        .execute(&pg1)
        .await
        .unwrap();
    let done = tokio::time::timeout(Duration::from_secs(10), insert)
        .await
        .expect("the cancelled wait returns")
        .unwrap();
    assert!(
        done.is_ok(),
        "a cancelled synchronous wait is no error: {done:?}"
    );
    assert_eq!(
        probe_ids(&pg1).await,
        [1, 2],
        "visible to every session, though no standby has it"
    );
}

/// Records each event it applies in `durable_effects`.
struct Record;

impl outbox::Handler<outbox::PgTx> for Record {
    async fn handle(
        &self,
        tx: &mut outbox::PgTx,
        event: &EventEnvelope,
    ) -> Result<(), outbox::HandlerError> {
        sqlx::query("INSERT INTO durable_effects (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// How many times `id` took effect on `pool`'s node.
async fn effects(pool: &PgPool, id: uuid::Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM durable_effects WHERE event_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The service on pg1 with `CANOPY_MQ_DURABLE_STANDBYS=pg2`.
async fn durable_service(pg1: &PgPool, queue: &str, exchange: &str) -> outbox::Outbox {
    let gated = outbox::DrainerConfig::builder().durable_standbys(["pg2"]);
    service(pg1, queue, exchange, gated).await
}

/// The service on `pool`: the drainer as `config` says (its exchange and a
/// Phase-2 deadline of 5 s set here), and a subscription recording effects.
async fn service(
    pool: &PgPool,
    queue: &str,
    exchange: &str,
    config: outbox::config::DrainerConfigBuilder,
) -> outbox::Outbox {
    let config = config
        .exchange(exchange)
        .confirm_timeout_secs(5)
        .build()
        .unwrap();
    let mut settings = outbox::SubscriberSettings::new(queue, &["durable.#"]);
    settings.spec.exchange = exchange.to_owned();
    let outbox = outbox::Outbox::builder(pool.clone())
        .amqp_urls(common::amqp_url())
        .drainer(config)
        .subscribe(settings, Record)
        .start()
        .await
        .unwrap();
    common::wait_for_queue(queue).await;
    outbox
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gates_hold_publishing_and_acking_while_the_named_standby_is_away() {
    let _turn = one_at_a_time().lock().await;
    let _remake = Remake;
    let pg1 = pool(PG1).await;
    let store = PgOutboxStore::new(pg1.clone());
    let names = ["pg2".to_owned(), "nope".to_owned()];
    let seen = store.replication_positions(&names).await.unwrap();
    assert!(
        matches!(seen.standbys[..], [StandbyFlush::At(at), StandbyFlush::Absent] if at <= seen.flushed),
        "{seen:?}"
    );
    let on_standby = PgOutboxStore::new(pool(PG2).await);
    let e = on_standby.replication_positions(&names).await.unwrap_err();
    assert!(e.is_unavailable(), "a standby is not asked: {e}");

    migrate_with_effects(&pg1).await;
    let (queue, exchange) = (common::unique("durable"), common::unique("durable.x"));
    let outbox = durable_service(&pg1, &queue, &exchange).await;
    // The standby falls away.
    pair(&["crash", "pg2"]);
    // An event the outbox holds: never published while pg2 lacks it.
    let held = EventEnvelope::new("durable.held", serde_json::json!({ "n": 1 }));
    let mut tx = pg1.begin().await.unwrap();
    outbox.publisher().publish_tx(&mut tx, &held).await.unwrap();
    tx.commit().await.unwrap();
    // An event published beside the outbox: applied, its ack held.
    let beside = EventEnvelope::new("durable.beside", serde_json::json!({ "n": 2 }));
    let broker = outbox::LapinBroker::new(common::amqp_url());
    let body = serde_json::to_vec(&beside).unwrap();
    common::publish_confirmed(&broker, &exchange, "durable.beside", beside.id, &body).await;
    common::eventually(Duration::from_secs(20), || async {
        effects(&pg1, beside.id).await == 1
    })
    .await;
    common::eventually(Duration::from_secs(20), || async {
        outbox
            .readiness()
            .reasons
            .iter()
            .any(|r| r.to_string().contains("standby pg2"))
    })
    .await;
    assert_eq!(effects(&pg1, held.id).await, 0, "published unreplicated");
    let (attempts, published): (i32, bool) =
        sqlx::query_as("SELECT attempts, published_at IS NOT NULL FROM event_outbox WHERE id = $1")
            .bind(held.id)
            .fetch_one(&pg1)
            .await
            .unwrap();
    assert_eq!((attempts, published), (0, false), "held without blame");
    // Shut down while the ack waits: the broker has the delivery back.
    outbox.shutdown().await.unwrap();
    let conn = common::connect().await;
    let (ready, _) = common::queue_counts(&conn, &queue).await.unwrap();
    assert_eq!(ready, 1, "the held ack was never sent");

    // The standby is back: the held event is published, the delivery
    // absorbed as a duplicate, each applied once.
    pair(&["up", "pg2"]);
    let outbox = durable_service(&pg1, &queue, &exchange).await;
    common::eventually(Duration::from_secs(30), || async {
        effects(&pg1, held.id).await == 1
    })
    .await;
    common::eventually(Duration::from_secs(30), || async {
        common::queue_counts(&conn, &queue).await.map(|c| c.0) == Some(0)
    })
    .await;
    assert_eq!(effects(&pg1, beside.id).await, 1, "applied once");
    common::eventually(Duration::from_secs(30), || async {
        outbox.readiness().ready
    })
    .await;
    outbox.shutdown().await.unwrap();
    common::delete_subscription(&conn, &queue, &exchange).await;
}

/// Publishes an event every 20 ms through `pool` until `stop`; the ids
/// whose commit returned Ok.
fn keep_publishing(
    pool: PgPool,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Vec<uuid::Uuid>> {
    tokio::spawn(async move {
        let publisher = Publisher::new(pool.clone());
        let mut committed = Vec::new();
        while !*stop.borrow() {
            let event = EventEnvelope::new("durable.order", serde_json::json!({ "n": 1 }));
            let attempt = async {
                let mut tx = pool.begin().await.ok()?;
                publisher.publish_tx(&mut tx, &event).await.ok()?;
                tx.commit().await.ok()
            };
            if attempt.await.is_some() {
                committed.push(event.id);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        committed
    })
}

/// What the surviving primary holds: every event in its outbox applied
/// exactly once, no effect of an event it does not hold (a phantom),
/// nothing parked or dead-lettered; and how many of `committed` survived.
async fn judge_survivors(pool: &PgPool, committed: &[uuid::Uuid]) -> usize {
    let outbox: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM event_outbox")
        .fetch_all(pool)
        .await
        .unwrap();
    let started = Instant::now();
    loop {
        let applied: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT o.id) FROM event_outbox o JOIN durable_effects e ON e.event_id = o.id",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if applied as usize == outbox.len() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} of the {} events the primary holds never took effect (lost effects)",
            outbox.len() - applied as usize,
            outbox.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT event_id FROM durable_effects GROUP BY event_id HAVING count(*) > 1) t",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(twice, 0, "an event took effect twice");
    let phantoms: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM durable_effects e WHERE NOT EXISTS (SELECT 1 FROM event_outbox o WHERE o.id = e.event_id)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        phantoms, 0,
        "an effect of an event the primary does not hold"
    );
    let (parked, dead): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM event_outbox WHERE parked_at IS NOT NULL), \
                (SELECT count(*) FROM event_inbox WHERE dead_lettered_at IS NOT NULL)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!((parked, dead), (0, 0), "parked or dead-lettered");
    committed.iter().filter(|id| outbox.contains(id)).count()
}

/// The service on the node list with `ANY 1 (pg1, pg2)`, events published
/// all along, through `fail_over`; then judged on the surviving primary.
/// Returns (events committed, events that survived).
async fn through_a_failover(fail_over: impl FnOnce() + Send + 'static) -> (usize, usize) {
    let pool = node_list(12).await;
    migrate_with_effects(&pool).await;
    let (queue, exchange) = (common::unique("durable"), common::unique("durable.x"));
    let config = outbox::DrainerConfig::builder()
        .stats_interval(Duration::from_secs(1))
        .durable_standbys_any(1, ["pg1", "pg2"]);
    let outbox = service(&pool, &queue, &exchange, config).await;
    // Everything the broker takes: a phantom reaches it even when its
    // effect here is lost with the old primary.
    let tap = common::PlainConsumer::start(&exchange, "durable.#").await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let producer = keep_publishing(pool.clone(), stopped);
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::spawn_blocking(fail_over).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = stop.send(true);
    let committed = producer.await.unwrap();
    assert_eq!(
        port(&pool).await.unwrap(),
        5442,
        "the pool is on the promoted node"
    );
    let survived = judge_survivors(&pool, &committed).await;
    let held: Vec<String> = sqlx::query_scalar("SELECT id::text FROM event_outbox")
        .fetch_all(&pool)
        .await
        .unwrap();
    let phantoms: Vec<String> = tap
        .snapshot()
        .await
        .into_iter()
        .map(|r| r.message_id)
        .filter(|id| !held.contains(id))
        .collect();
    assert!(
        phantoms.is_empty(),
        "the broker took events the failover took back: {phantoms:?}"
    );
    common::eventually(Duration::from_secs(30), || async {
        outbox.readiness().ready
    })
    .await;
    outbox.shutdown().await.unwrap();
    common::delete_subscription(&common::connect().await, &queue, &exchange).await;
    (committed.len(), survived)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orderly_failover_under_load_loses_nothing_with_the_gates_on() {
    let _turn = one_at_a_time().lock().await;
    let _remake = Remake;
    let (committed, survived) = through_a_failover(|| {
        pair(&["readonly", "pg1"]);
        pair(&["promote"]);
        pair(&["rejoin", "pg1"]);
    })
    .await;
    assert!(committed > 20, "{committed} events committed");
    assert_eq!(
        survived, committed,
        "an orderly switchover keeps every commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_stale_standby_makes_no_phantom_and_loses_no_effect() {
    let _turn = one_at_a_time().lock().await;
    let _remake = Remake;
    let (committed, survived) = through_a_failover(|| {
        // The standby falls away; the primary commits on (the gates hold
        // what it does not have), then the primary is lost.
        pair(&["crash", "pg2"]);
        std::thread::sleep(Duration::from_millis(800));
        pair(&["crash", "pg1"]);
        pair(&["up", "pg2"]);
        pair(&["promote"]);
        pair(&["rejoin", "pg1"]);
    })
    .await;
    assert!(
        survived < committed,
        "the stale standby lacks the last commits ({survived} of {committed})"
    );
}
