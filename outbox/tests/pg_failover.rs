//! A node list follows the writable PostgreSQL node on the real pair of
//! `.ci/pg-pair` (pg1 on 5441 streaming to pg2 on 5442). One test in its
//! own binary: it changes the pair's roles (an orderly switchover: the
//! primary turned read-only in place, the standby promoted), then makes the
//! pair again, whatever the outcome.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use outbox::core::ports::OutboxStore;
use outbox::pg::nodes;
use outbox::{EventEnvelope, PgOutboxStore, Publisher};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const NODES: &str =
    "postgres://postgres@127.0.0.1:5441,127.0.0.1:5442/postgres?target_session_attrs=read-write";

fn pair(args: &[&str]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/pg-pair");
    let out = Command::new(&script)
        .args(args)
        .output()
        .expect("runs .ci/pg-pair");
    assert!(
        out.status.success(),
        ".ci/pg-pair {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Makes the pair again when the test ends, passed or not.
struct Remake;

impl Drop for Remake {
    fn drop(&mut self) {
        pair(&["reset"]);
        pair(&["start"]);
    }
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
    let _remake = Remake;
    let pool = nodes::connect(
        NODES,
        PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("the pair is up: .ci/pg-pair start");
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
