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
    assert_eq!(outbox::migrate::MIGRATOR.iter().count(), FILES.len());
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

/// Applies `FILES[..upto]` (and nothing after) to the database.
async fn apply_files_before(pool: &sqlx::PgPool, upto: usize) {
    let version: i64 = FILES[upto].0[..14].parse().unwrap();
    outbox::migrate::tolerant_migrator()
        .run_to(version - 1, pool)
        .await
        .unwrap();
}

/// A migration that runs in a transaction and waits on a lock gives up after
/// `MIGRATION_LOCK_TIMEOUT` instead of queueing every query of its table
/// behind it (an `ALTER TABLE` takes an exclusive lock).
#[sqlx::test(migrations = false)]
async fn a_migration_that_cannot_have_its_lock_gives_up_instead_of_stalling_the_table(
    pool: sqlx::PgPool,
) {
    use std::time::{Duration, Instant};
    // Every migration before the last that alters a table in a transaction.
    let last_alter = FILES
        .iter()
        .rposition(|(_, body)| {
            !body.starts_with("-- no-transaction") && body.contains("ALTER TABLE")
        })
        .expect("a migration that alters a table");
    let body = FILES[last_alter].1;
    let at = body.find("ALTER TABLE ").unwrap() + "ALTER TABLE ".len();
    let table = body[at..].split_whitespace().next().unwrap();
    apply_files_before(&pool, last_alter).await;
    // A long transaction reads the table (ACCESS SHARE).
    let mut reader = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
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
    assert_fully_migrated(&pool).await;
}

/// Every library migration is recorded and no index is INVALID.
async fn assert_fully_migrated(pool: &sqlx::PgPool) {
    let recorded: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(pool)
            .await
            .unwrap();
    let expected: Vec<i64> = FILES
        .iter()
        .map(|(n, _)| n[..14].parse().unwrap())
        .collect();
    assert_eq!(recorded, expected);
    let invalid: Vec<String> = sqlx::query_scalar(
        "SELECT indexrelid::regclass::TEXT FROM pg_index WHERE NOT indisvalid ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(invalid.is_empty(), "INVALID indexes left: {invalid:?}");
}

/// The index of `FILES` whose migration builds an index concurrently, the
/// first one, and that index's name.
fn first_concurrent_build() -> (usize, &'static str) {
    let at = FILES
        .iter()
        .position(|(_, body)| body.contains("CREATE INDEX CONCURRENTLY"))
        .expect("a concurrent index build");
    let body = FILES[at].1;
    let from =
        body.find("CREATE INDEX CONCURRENTLY ").unwrap() + "CREATE INDEX CONCURRENTLY ".len();
    (at, body[from..].split_whitespace().next().unwrap())
}

/// A session of `pool` whose transaction holds a snapshot and an xid (it
/// wrote a row of a table no migration touches): every concurrent index
/// build of the database waits for it.
async fn old_transaction(pool: &sqlx::PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    sqlx::query("CREATE TABLE IF NOT EXISTS unrelated (x INT)")
        .execute(pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("INSERT INTO unrelated VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Captured log lines, for the test that reads what a waiting migration
/// says.
#[derive(Clone, Default)]
struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A boot beside a transaction older than the lock timeout (a nightly
/// `pg_dump`, a long report) waits for it, says whom it waits for, and
/// succeeds once it ends; it never fails the boot nor leaves an INVALID
/// index.
#[sqlx::test(migrations = false)]
async fn a_boot_beside_a_long_transaction_waits_for_it_and_succeeds(pool: sqlx::PgPool) {
    use std::time::Duration;
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let old = old_transaction(&pool).await;
    let old_pid: i32 = {
        let mut old = old;
        let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *old)
            .await
            .unwrap();
        // Held past the lock timeout (where a boot used to fail) and past
        // one report.
        let hold = outbox::migrate::MIGRATION_LOCK_TIMEOUT.max(outbox::migrate::WAIT_REPORT_EVERY)
            + Duration::from_secs(2);
        tokio::spawn(async move {
            tokio::time::sleep(hold).await;
            old.commit().await.unwrap();
        });
        pid
    };
    tokio::time::timeout(Duration::from_secs(60), outbox::migrate::run(&pool))
        .await
        .expect("the boot ends once the old transaction does")
        .expect("the boot waits for the old transaction instead of failing");
    assert_fully_migrated(&pool).await;
    let said = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    assert!(
        said.contains("a migration waits") && said.contains(&format!("pid={old_pid} ")),
        "the wait names the old transaction's session: {said}"
    );
}

/// A boot after a failed concurrent build (the previous release's runner
/// gave up behind an old transaction and left the index INVALID, its
/// migration unrecorded) succeeds, and so does a boot after a build that
/// finished but was never recorded.
#[sqlx::test(migrations = false)]
async fn a_boot_after_a_failed_index_build_succeeds(pool: sqlx::PgPool) {
    let (at, index) = first_concurrent_build();
    apply_files_before(&pool, at).await;
    // The previous release's runner: a 1 s lock timeout over everything.
    let old = old_transaction(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET lock_timeout = '1s'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let failed = outbox::migrate::tolerant_migrator().run(&mut *conn).await;
    assert!(
        failed.is_err(),
        "the old runner gives up behind the old transaction"
    );
    conn.close().await.unwrap();
    old.rollback().await.unwrap();
    let valid: bool =
        sqlx::query_scalar("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)")
            .bind(index)
            .fetch_one(&pool)
            .await
            .expect("the failed build left its index behind");
    assert!(!valid, "the failed build's index is INVALID");
    // That runner trips on it again: the wedge (on a session of its own:
    // sqlx's runner leaves its lock held when it fails).
    let mut conn = pool.acquire().await.unwrap();
    let again = outbox::migrate::tolerant_migrator().run(&mut *conn).await;
    assert!(
        again
            .as_ref()
            .is_err_and(|e| e.to_string().contains("already exists")),
        "{again:?}"
    );
    conn.close().await.unwrap();
    outbox::migrate::run(&pool).await.unwrap();
    assert_fully_migrated(&pool).await;
    // Built, then its process died before recording it.
    let version: i64 = FILES[at].0[..14].parse().unwrap();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1")
        .bind(version)
        .execute(&pool)
        .await
        .unwrap();
    outbox::migrate::run(&pool).await.unwrap();
    assert_fully_migrated(&pool).await;
}

/// Two replicas booting together both succeed: the second waits for the
/// first's migration lock as long as the first's builds take.
#[sqlx::test(migrations = false)]
async fn replicas_booting_beside_a_long_transaction_both_succeed(pool: sqlx::PgPool) {
    use std::time::Duration;
    let old = old_transaction(&pool).await;
    let first = tokio::spawn({
        let pool = pool.clone();
        async move { outbox::migrate::run(&pool).await }
    });
    let second = tokio::spawn({
        let pool = pool.clone();
        async move { outbox::migrate::run(&pool).await }
    });
    tokio::time::sleep(outbox::migrate::MIGRATION_LOCK_TIMEOUT + Duration::from_secs(1)).await;
    old.commit().await.unwrap();
    for boot in [first, second] {
        tokio::time::timeout(Duration::from_secs(60), boot)
            .await
            .expect("each boot ends")
            .unwrap()
            .expect("each boot succeeds");
    }
    assert_fully_migrated(&pool).await;
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

/// The migration lock is sqlx's own: a boot waits while a runner of the
/// previous release (sqlx's `Migrator::run`) holds it, and runs once it is
/// free.
#[sqlx::test(migrations = false)]
async fn a_boot_waits_for_a_migration_lock_held_by_sqlxs_runner(pool: sqlx::PgPool) {
    use sqlx::migrate::Migrate;
    use std::time::Duration;
    let mut holder = pool.acquire().await.unwrap();
    holder.lock().await.unwrap();
    let boot = tokio::spawn({
        let pool = pool.clone();
        async move { outbox::migrate::run(&pool).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!boot.is_finished(), "the boot waits for the lock");
    let migrated: Option<String> = sqlx::query_scalar("SELECT to_regclass('event_outbox')::TEXT")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(migrated, None, "nothing ran while the lock was held");
    holder.unlock().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), boot)
        .await
        .expect("the boot ends once the lock is free")
        .unwrap()
        .unwrap();
    assert_fully_migrated(&pool).await;
}

/// A UUID v7 whose clock is `ms` (the rest zero but the version and
/// variant bits).
fn v7_at(ms: i64) -> uuid::Uuid {
    let hex = format!("{ms:012x}70008000000000000000");
    uuid::Uuid::parse_str(&hex).unwrap()
}

/// Milliseconds since the epoch, by the database's clock.
async fn db_now_ms(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::INT8")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Writes one outbox row with id `id`, as a producer whose clock runs
/// ahead would.
async fn write_outbox_row(pool: &sqlx::PgPool, id: uuid::Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO event_outbox (id, routing_key, payload) VALUES ($1, 'k', '{}')")
        .bind(id)
        .execute(pool)
        .await
        .map(|_| ())
}

/// A partition move that stopped after its first step (the cut's CHECK in
/// place, the rest not run) would refuse every write once the clock passed
/// the cut: the next run of the migrator undoes the plan and moves the
/// tables with a fresh cut, and writes past the old cut work.
#[sqlx::test(migrations = false)]
async fn a_partition_move_stopped_after_its_first_step_is_finished_at_the_next_boot(
    pool: sqlx::PgPool,
) {
    outbox::migrate::run(&pool).await.unwrap();
    let first: i64 = PARTITIONED_FILES[0].0[..14].parse().unwrap();
    outbox::migrate::tolerant_partitioned_migrator()
        .run_to(first, &pool)
        .await
        .unwrap();
    let cut: i64 =
        sqlx::query_scalar("SELECT cut_ms FROM event_partitioning WHERE parent = 'event_outbox'")
            .fetch_one(&pool)
            .await
            .unwrap();
    // The trap: an id past the cut (the clock two widths on) is refused.
    let e = write_outbox_row(&pool, v7_at(cut + 1)).await.unwrap_err();
    assert!(e.to_string().contains("event_outbox_below_cut"), "{e}");
    outbox::migrate::partition(&pool, None).await.unwrap();
    write_outbox_row(&pool, v7_at(cut + 1)).await.unwrap();
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::TEXT FROM pg_class WHERE oid = 'event_inbox'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kind, "p", "the move finished");
}

/// A move that cannot finish (a row three days ahead makes the cut's proof
/// fail on every run) fails the boot, and leaves nothing that refuses a
/// write; once the row is gone the move finishes.
#[sqlx::test(migrations = false)]
async fn a_partition_move_beside_a_row_ahead_fails_the_boot_and_refuses_no_write(
    pool: sqlx::PgPool,
) {
    outbox::migrate::run(&pool).await.unwrap();
    let ahead = v7_at(db_now_ms(&pool).await + 3 * 86_400_000);
    write_outbox_row(&pool, ahead).await.unwrap();
    for _ in 0..2 {
        let e = outbox::migrate::partition(&pool, None).await.unwrap_err();
        assert!(e.to_string().contains("event_outbox_below_cut"), "{e}");
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_constraint WHERE conname LIKE '%below_cut'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(left, 0, "no cut is left to refuse a write");
        // Past any cut it could have planned: a week ahead.
        write_outbox_row(&pool, v7_at(db_now_ms(&pool).await + 7 * 86_400_000))
            .await
            .unwrap();
        sqlx::query("DELETE FROM event_outbox WHERE id > $1")
            .bind(ahead)
            .execute(&pool)
            .await
            .unwrap();
    }
    sqlx::query("DELETE FROM event_outbox WHERE id = $1")
        .bind(ahead)
        .execute(&pool)
        .await
        .unwrap();
    outbox::migrate::partition(&pool, None).await.unwrap();
}

/// A move that stopped after `event_outbox` moved and before `event_inbox`
/// did goes on with a new cut for the inbox: an inbox write past the old
/// cut works once the move finished.
#[sqlx::test(migrations = false)]
async fn a_partition_move_stopped_before_the_inbox_moved_finishes_with_a_new_cut(
    pool: sqlx::PgPool,
) {
    outbox::migrate::run(&pool).await.unwrap();
    let third: i64 = PARTITIONED_FILES[2].0[..14].parse().unwrap();
    outbox::migrate::tolerant_partitioned_migrator()
        .run_to(third, &pool)
        .await
        .unwrap();
    let cut: i64 =
        sqlx::query_scalar("SELECT cut_ms FROM event_partitioning WHERE parent = 'event_inbox'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let insert = |id: uuid::Uuid| {
        sqlx::query(
            "INSERT INTO event_inbox (event_id, subscription, routing_key, payload) \
             VALUES ($1, 's', 'k', '{}')",
        )
        .bind(id)
        .execute(&pool)
    };
    let e = insert(v7_at(cut + 1)).await.unwrap_err();
    assert!(e.to_string().contains("event_inbox_below_cut"), "{e}");
    outbox::migrate::partition(&pool, None).await.unwrap();
    insert(v7_at(cut + 1)).await.unwrap();
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::TEXT FROM pg_class WHERE oid = 'event_inbox'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kind, "p");
}
