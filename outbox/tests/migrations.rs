//! The migrations are the ADR's, byte for byte, forward-only, and the
//! byte-identity check catches a missing or edited copy.

use outbox::migrate::{
    FILES, FileStatus, MigrationCheckError, PARTITIONED_FILES, check_dir, check_files, stamp_dir,
};

const ADR_CANONICAL_SCHEMA: &str = "CREATE TABLE event_outbox (
    id UUID PRIMARY KEY DEFAULT gen_random_uuid(),
    routing_key TEXT NOT NULL,
    payload JSONB NOT NULL,
    enqueued_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at TIMESTAMPTZ,
    attempts INT NOT NULL DEFAULT 0,
    last_error TEXT
);

CREATE INDEX event_outbox_unpublished_idx
    ON event_outbox (enqueued_at)
    WHERE published_at IS NULL;
";

fn repo_migrations() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations")
}

#[test]
fn the_first_migration_is_the_adrs_canonical_schema_byte_for_byte() {
    assert_eq!(FILES[0].0, "20260506000000_create_event_outbox.sql");
    assert_eq!(FILES[0].1, ADR_CANONICAL_SCHEMA);
}

#[test]
fn the_lease_migration_carries_the_adrs_index() {
    let lease = FILES
        .iter()
        .find(|(n, _)| n.contains("lease"))
        .expect("lease migration");
    assert!(lease.1.contains("ADD COLUMN claimed_at TIMESTAMPTZ NULL"));
    assert!(lease.1.contains("ADD COLUMN claimed_by TEXT NULL"));
    assert!(lease.1.contains(
        "CREATE INDEX event_outbox_lease_idx\n    ON event_outbox (claimed_at NULLS FIRST, enqueued_at)\n    WHERE published_at IS NULL;"
    ));
}

#[test]
fn files_list_every_migration_in_the_folder_in_order() {
    let mut on_disk: Vec<String> = std::fs::read_dir(repo_migrations())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".sql"))
        .collect();
    on_disk.sort();
    let listed: Vec<&str> = FILES.iter().map(|(n, _)| *n).collect();
    assert_eq!(on_disk, listed);
    assert_eq!(outbox::MIGRATOR.iter().count(), FILES.len());
    check_dir(&repo_migrations()).unwrap();
}

#[test]
fn the_check_reports_missing_and_edited_copies() {
    let dir = std::env::temp_dir().join(format!("outbox-mig-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let written = stamp_dir(&dir).unwrap();
    assert_eq!(written.len(), FILES.len());
    let ok = check_dir(&dir).unwrap();
    assert!(ok.iter().all(|f| f.status == FileStatus::Identical));
    assert_eq!(ok[0].expected_sha384.len(), 96);

    std::fs::remove_file(dir.join(FILES[1].0)).unwrap();
    std::fs::write(dir.join(FILES[0].0), FILES[0].1.replace("INT", "BIGINT")).unwrap();
    match check_dir(&dir) {
        Err(MigrationCheckError::Mismatch {
            failures: 2, files, ..
        }) => {
            assert!(matches!(files[0].status, FileStatus::Differs { .. }));
            assert_eq!(files[1].status, FileStatus::Missing);
        }
        other => panic!("{other:?}"),
    }
    // Stamping never overwrites an edited file, and then writes nothing
    // (issue 25: it wrote the missing files before it failed).
    assert!(matches!(
        stamp_dir(&dir),
        Err(MigrationCheckError::Mismatch { failures: 1, .. })
    ));
    assert!(
        !dir.join(FILES[1].0).exists(),
        "nothing written on a conflict"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".partial"))
        .collect();
    assert!(leftovers.is_empty());
    assert!(matches!(
        check_dir(&dir.join("nope")),
        Err(MigrationCheckError::Folder { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A migration waiting on a lock gives up after `MIGRATION_LOCK_TIMEOUT`
/// instead of queueing every query of the table behind it (issue 25: the
/// HOT-claim migration takes an exclusive lock on `event_outbox`).
#[sqlx::test(migrations = false)]
async fn a_migration_that_cannot_have_its_lock_gives_up_instead_of_stalling_the_table(
    pool: sqlx::PgPool,
) {
    use std::time::{Duration, Instant};
    // Every migration before the last that alters event_outbox applied.
    let last_on_outbox = FILES
        .iter()
        .rposition(|(name, _)| name.contains("event_outbox"))
        .expect("a migration of event_outbox");
    let dir = std::env::temp_dir().join(format!("outbox-mig-lock-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, body) in &FILES[..last_on_outbox] {
        std::fs::write(dir.join(name), body).unwrap();
    }
    sqlx::migrate::Migrator::new(dir.as_path())
        .await
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    // A long transaction reads the table (ACCESS SHARE).
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM event_outbox")
        .execute(&mut *reader)
        .await
        .unwrap();
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), outbox::migrate::run(&pool))
        .await
        .expect("the migration gives up on its own");
    let err = result.expect_err("the lock was never free");
    assert!(err.to_string().contains("lock timeout"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
    // Once the table is quiet it runs, and the connection it used is back
    // to the server's default.
    reader.rollback().await.unwrap();
    outbox::migrate::run(&pool).await.unwrap();
    let lock_timeout: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(lock_timeout, "0");
}

#[test]
fn partitioned_files_list_every_partitioned_migration_in_order() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations-partitioned");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".sql"))
        .collect();
    on_disk.sort();
    let listed: Vec<&str> = PARTITIONED_FILES.iter().map(|(n, _)| *n).collect();
    assert_eq!(on_disk, listed);
    assert_eq!(
        outbox::migrate::PARTITIONED_MIGRATOR.iter().count(),
        PARTITIONED_FILES.len()
    );
    // They come after every plain migration: a database that has both
    // applies them in one order whichever migrator runs first.
    assert!(PARTITIONED_FILES[0].0 > FILES[FILES.len() - 1].0);
    check_files(&dir, PARTITIONED_FILES).unwrap();
}

/// Moving a live table to the partitioned layout loses no row (issue 28):
/// rows written before stay (in the first partition) and can be claimed,
/// marked and listed; rows written after land in the partitions of their
/// time; the migrations are idempotent.
#[sqlx::test(migrations = false)]
async fn moving_a_table_to_the_partitioned_layout_keeps_every_row(pool: sqlx::PgPool) {
    use outbox::core::ports::OutboxStore;
    outbox::migrate::run(&pool).await.unwrap();
    let store = outbox::PgOutboxStore::new(pool.clone());
    let publisher = outbox::Publisher::new(pool.clone());
    let mut before = Vec::new();
    for i in 0..50 {
        let e = outbox::EventEnvelope::new("k", serde_json::json!({ "i": i }));
        let mut tx = pool.begin().await.unwrap();
        publisher.publish_tx(&mut tx, &e).await.unwrap();
        tx.commit().await.unwrap();
        before.push(e.id);
    }
    sqlx::query(
        "INSERT INTO event_inbox (event_id, subscription, routing_key, payload, processed_at) \
         SELECT id, 's', routing_key, payload, now() FROM event_outbox",
    )
    .execute(&pool)
    .await
    .unwrap();
    outbox::migrate::partition(&pool, None).await.unwrap();
    outbox::migrate::partition(&pool, None).await.unwrap();
    for table in ["event_outbox", "event_inbox"] {
        let (kind, rows, first): (String, i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT (SELECT relkind::TEXT FROM pg_class WHERE oid = '{table}'::regclass), \
                    (SELECT count(*) FROM {table}), (SELECT count(*) FROM {table}_p_first)"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((kind.as_str(), rows, first), ("p", 50, 50), "{table}");
    }
    let after = outbox::EventEnvelope::new("k", serde_json::json!({ "after": true }));
    let mut tx = pool.begin().await.unwrap();
    publisher.publish_tx(&mut tx, &after).await.unwrap();
    tx.commit().await.unwrap();
    let claimed = store
        .outbox_claim(outbox::core::ports::ClaimParams {
            replica_id: "r",
            batch_size: 100,
            lease_ttl: std::time::Duration::from_secs(60),
            key_heads: &[],
            after: None,
        })
        .await
        .unwrap();
    assert_eq!(claimed.len(), 51);
    assert_eq!(store.outbox_mark_published("r", &before).await.unwrap(), 50);
    let retired = store
        .outbox_retire_partitions(std::time::Duration::from_secs(7 * 86_400))
        .await
        .unwrap();
    assert!(
        retired.partitioned && retired.dropped.is_empty(),
        "{retired:?}"
    );
}
