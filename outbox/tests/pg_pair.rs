//! The library on the PostgreSQL pair of `.ci/pg-pair` (a primary on
//! 127.0.0.1:5441 streaming to a standby on 5442): what a server that
//! cannot write (a standby, or a primary demoted in place) answers the
//! library is database trouble, never the data's or the handler's fault,
//! so it never charges an attempt, parks or dead-letters. The tests only
//! read the pair's roles; none changes them.

#[path = "support/pair.rs"]
mod support;

use std::time::Duration;

use outbox::{HandlerError, StoreError};
use sqlx::PgPool;
use support::{PG1 as PRIMARY, PG2 as STANDBY, pool};

async fn in_recovery(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The pair as `.ci/pg-pair start` leaves it: the outbox's tables on the
/// primary, replayed on the standby.
async fn pair() -> (PgPool, PgPool) {
    let (primary, standby) = (pool(PRIMARY).await, pool(STANDBY).await);
    assert!(!in_recovery(&primary).await, "5441 is the primary");
    assert!(in_recovery(&standby).await, "5442 is the standby");
    outbox::migrate::run(&primary).await.unwrap();
    for _ in 0..100 {
        let replayed: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('event_outbox')::text")
                .fetch_one(&standby)
                .await
                .unwrap();
        if replayed.is_some() {
            return (primary, standby);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the standby did not replay the outbox's tables within 10 s");
}

#[tokio::test]
async fn every_refusal_of_a_server_in_recovery_is_database_trouble() {
    let (_primary, standby) = pair().await;
    for statement in [
        "CREATE TEMP TABLE scratch (x int)",
        "LISTEN canopy_outbox",
        "SELECT pg_notify('canopy_outbox', '')",
        "SELECT pg_current_xact_id()",
        "UPDATE event_outbox SET attempts = attempts WHERE false",
        "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
    ] {
        let mut tx = standby.begin().await.unwrap();
        let e = sqlx::query(statement).execute(&mut *tx).await.unwrap_err();
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned());
        let handler = HandlerError::from(e);
        assert!(
            handler.is_unavailable(),
            "{statement} ({code:?}) on a standby charged the handler: {handler:?}"
        );
    }
}

#[tokio::test]
async fn a_store_on_the_standby_says_unavailable() {
    let (_primary, standby) = pair().await;
    let store = outbox::PgOutboxStore::new(standby);
    let e = outbox::admin::unpark(&store, &outbox::admin::UnparkSelector::All)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
}
