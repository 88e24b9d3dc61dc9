//! `InboxDrainer::spawn(pool)`, the ADR's entry point, keeps
//! `CANOPY_MQ_INBOX_RETENTION_DAYS` (issue 25: it used the default, so a
//! 10-day-old processed row was deleted at boot with the variable at 30,
//! and a republished duplicate took effect a second time), and refuses 0,
//! which would turn deduplication off. One test in its own binary: it sets
//! the process's environment.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

async fn processed_row(pool: &PgPool, days_ago: f64) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO event_inbox (event_id, subscription, routing_key, payload, processed_at) \
         VALUES ($1, 'q', 'k', '{}'::jsonb, now() - make_interval(days => $2::int))",
    )
    .bind(id)
    .bind(days_ago as i32)
    .execute(pool)
    .await
    .unwrap();
    id
}

async fn exists(pool: &PgPool, id: Uuid) -> bool {
    sqlx::query_scalar("SELECT count(*) = 1 FROM event_inbox WHERE event_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_inbox_janitor_keeps_the_retention_the_environment_sets(pool: PgPool) {
    let ten_days = processed_row(&pool, 10.0).await;
    let forty_days = processed_row(&pool, 40.0).await;
    // SAFETY: the only test of this binary; nothing else reads the
    // environment while it changes.
    unsafe { std::env::set_var("CANOPY_MQ_INBOX_RETENTION_DAYS", "30") };
    let janitor = outbox::InboxDrainer::spawn(pool.clone()).unwrap();
    // It sweeps at once: the row past 30 days goes, the 10-day one stays.
    for _ in 0..100 {
        if !exists(&pool, forty_days).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    janitor.shutdown().await;
    assert!(
        !exists(&pool, forty_days).await,
        "past the retention: deleted"
    );
    assert!(exists(&pool, ten_days).await, "within 30 days: kept");

    unsafe { std::env::set_var("CANOPY_MQ_INBOX_RETENTION_DAYS", "0") };
    let refused = outbox::InboxDrainer::spawn(pool.clone()).expect_err("0 is refused");
    assert!(
        refused
            .to_string()
            .starts_with("CANOPY_MQ_INBOX_RETENTION_DAYS=0 is invalid"),
        "{refused}"
    );
    unsafe { std::env::remove_var("CANOPY_MQ_INBOX_RETENTION_DAYS") };
}
