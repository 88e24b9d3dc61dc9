//! The library's migrations: an embedded migrator and the byte-identity check
//! ("review is a checksum exercise", ADR-018).
//!
//! A service either runs [`tolerant_migrator`] directly or stamps copies of
//! [`FILES`] into its own `migrations/` folder (`outbox-migrations copy DIR`)
//! and runs its own sqlx migrator; [`check_dir`] (and `outbox-migrations
//! check DIR`) proves the copies are byte-identical.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha384};

/// Every library migration: file name and exact bytes, in order.
pub const FILES: &[(&str, &str)] = &[
    (
        "20260506000000_create_event_outbox.sql",
        include_str!("../migrations/20260506000000_create_event_outbox.sql"),
    ),
    (
        "20260516000000_create_event_inbox.sql",
        include_str!("../migrations/20260516000000_create_event_inbox.sql"),
    ),
    (
        "20260518000000_add_event_outbox_lease.sql",
        include_str!("../migrations/20260518000000_add_event_outbox_lease.sql"),
    ),
    (
        "20260729000000_add_event_outbox_parking.sql",
        include_str!("../migrations/20260729000000_add_event_outbox_parking.sql"),
    ),
    (
        "20261201000000_key_event_inbox_by_subscription.sql",
        include_str!("../migrations/20261201000000_key_event_inbox_by_subscription.sql"),
    ),
    (
        "20261202000000_make_the_claim_hot.sql",
        include_str!("../migrations/20261202000000_make_the_claim_hot.sql"),
    ),
    (
        "20261203000000_keep_the_envelope_as_written.sql",
        include_str!("../migrations/20261203000000_keep_the_envelope_as_written.sql"),
    ),
    (
        "20261204000000_add_event_outbox_ordering_keys.sql",
        include_str!("../migrations/20261204000000_add_event_outbox_ordering_keys.sql"),
    ),
    (
        "20261205000000_add_event_outbox_skip.sql",
        include_str!("../migrations/20261205000000_add_event_outbox_skip.sql"),
    ),
    (
        "20261205000001_index_event_outbox_key_heads.sql",
        include_str!("../migrations/20261205000001_index_event_outbox_key_heads.sql"),
    ),
    (
        "20261205000002_index_event_outbox_unkeyed_claim.sql",
        include_str!("../migrations/20261205000002_index_event_outbox_unkeyed_claim.sql"),
    ),
    (
        "20261205000003_drop_event_outbox_claim_idx.sql",
        include_str!("../migrations/20261205000003_drop_event_outbox_claim_idx.sql"),
    ),
    (
        "20261206000000_add_event_inbox_ordering.sql",
        include_str!("../migrations/20261206000000_add_event_inbox_ordering.sql"),
    ),
    (
        "20261206000001_index_event_inbox_key_waits.sql",
        include_str!("../migrations/20261206000001_index_event_inbox_key_waits.sql"),
    ),
];

/// The partitioned layout's migrations ([`partition`]), run
/// after [`FILES`]: file name and exact bytes, in order.
pub const PARTITIONED_FILES: &[(&str, &str)] = &[
    (
        "20261207000000_plan_event_partitioning.sql",
        include_str!("../migrations-partitioned/20261207000000_plan_event_partitioning.sql"),
    ),
    (
        "20261207000001_validate_event_partitioning_cut.sql",
        include_str!(
            "../migrations-partitioned/20261207000001_validate_event_partitioning_cut.sql"
        ),
    ),
    (
        "20261207000002_partition_event_outbox.sql",
        include_str!("../migrations-partitioned/20261207000002_partition_event_outbox.sql"),
    ),
    (
        "20261207000003_partition_event_inbox.sql",
        include_str!("../migrations-partitioned/20261207000003_partition_event_inbox.sql"),
    ),
];

/// The embedded sqlx migrator over `migrations/`, strict: it refuses a
/// database holding migrations it does not know. For a database of the
/// outbox's tables alone (`#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]`);
/// a service's database, with migrations of its own, takes
/// [`tolerant_migrator`] (which [`run`] uses).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// The embedded migrator, tolerant of a service's own migrations in the same
/// database (it ignores applied versions it does not know): what [`run`]
/// and [`Outbox::builder`](crate::Outbox::builder) run.
pub fn tolerant_migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!();
    m.set_ignore_missing(true);
    m
}

/// The partitioned layout's migrations, run after [`tolerant_migrator`]'s:
/// `event_outbox` and `event_inbox` become tables partitioned by time, and
/// the janitors drop whole partitions instead of deleting rows. Opt-in: the
/// plain layout of the ADR's files stays the default. See [`partition`].
pub static PARTITIONED_MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate!("./migrations-partitioned");

/// The partitioned layout's migrator, tolerant of the plain layout's
/// versions (and a service's own) already applied in the database.
pub fn tolerant_partitioned_migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!("./migrations-partitioned");
    m.set_ignore_missing(true);
    m
}

/// Moves a database to the partitioned layout: runs the plain
/// layout's migrations ([`run`]), then the partitioned layout's, the way
/// [`run`] runs them. `width` is one partition's span (`None`: a day); it
/// applies when the layout is first created (`event_partitioning.width_secs`
/// holds it and may be updated later: partitions created from then on take
/// the new width). Rows already in the tables stay where they are, in the
/// first partition, and are dropped with it once every one is past
/// retention.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
/// outbox::migrate::partition(&pool, None).await?;
/// # Ok(()) }
/// ```
pub async fn partition(
    pool: &sqlx::PgPool,
    width: Option<std::time::Duration>,
) -> Result<(), sqlx::migrate::MigrateError> {
    run(pool).await?;
    let setting = width.map(|width| {
        format!(
            "SET canopy.partition_width_secs = '{}'",
            width.as_secs().max(1)
        )
    });
    run_with(
        pool,
        &tolerant_partitioned_migrator(),
        setting.as_deref(),
        true,
    )
    .await
}

/// A partition move that stopped part-way, finished or undone before the
/// partitioned migrations run, and again if they fail (see [`partition`]):
/// each step either completes or leaves nothing that can refuse a write
/// later. The first step bounds both tables below a cut with a CHECK that
/// holds for every write at once; had the move stopped there, every write
/// would fail once the clock passed the cut.
/// - Stopped before `event_outbox` moved: the plan is undone (both checks
///   and `event_partitioning` dropped, the first two steps unrecorded), so
///   the move starts afresh, with a new cut, the next time it runs.
/// - Stopped after `event_outbox` moved and before `event_inbox` did: the
///   inbox's cut moves forward (two widths from now) and is proved again,
///   so the last step finishes with it.
const REPAIR_STOPPED_MOVE: &str = r"
DO $$
DECLARE
    width_ms BIGINT;
    now_ms BIGINT := floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT;
    new_cut BIGINT;
BEGIN
    IF to_regclass('event_partitioning') IS NULL THEN
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_class
                   WHERE oid = to_regclass('event_outbox') AND relkind = 'p') THEN
        ALTER TABLE event_outbox DROP CONSTRAINT IF EXISTS event_outbox_below_cut;
        ALTER TABLE event_inbox DROP CONSTRAINT IF EXISTS event_inbox_below_cut;
        DROP TABLE event_partitioning;
        DELETE FROM _sqlx_migrations WHERE version IN (20261207000000, 20261207000001);
        RAISE WARNING 'a partition move that stopped before event_outbox moved was undone; '
                      'it starts afresh';
    ELSIF NOT EXISTS (SELECT 1 FROM pg_class
                      WHERE oid = to_regclass('event_inbox') AND relkind = 'p') THEN
        SELECT 1000 * width_secs INTO STRICT width_ms
        FROM event_partitioning WHERE parent = 'event_inbox';
        new_cut := (now_ms / width_ms + 2) * width_ms;
        UPDATE event_partitioning SET cut_ms = new_cut WHERE parent = 'event_inbox';
        ALTER TABLE event_inbox DROP CONSTRAINT IF EXISTS event_inbox_below_cut;
        EXECUTE format('ALTER TABLE event_inbox ADD CONSTRAINT event_inbox_below_cut '
                       'CHECK (event_id < %L) NOT VALID',
                       (lpad(to_hex(new_cut), 12, '0') || repeat('0', 20))::UUID);
        RAISE WARNING 'a partition move that stopped before event_inbox moved goes on with '
                      'a new cut';
    END IF;
END $$;
";

/// Runs [`REPAIR_STOPPED_MOVE`], then proves the inbox's cut if it was
/// moved (a scan that blocks no writer).
async fn repair_stopped_move(
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(REPAIR_STOPPED_MOVE)
        .execute(&mut **conn)
        .await?;
    let pending_inbox: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_constraint \
          WHERE conname = 'event_inbox_below_cut' AND NOT convalidated)",
    )
    .fetch_one(&mut **conn)
    .await?;
    if pending_inbox {
        sqlx::raw_sql("ALTER TABLE event_inbox VALIDATE CONSTRAINT event_inbox_below_cut")
            .execute(&mut **conn)
            .await?;
    }
    Ok(())
}

/// What a failed partition move says: how to find the row that stopped
/// it, when a cut's check was refused.
fn say_how_to_go_on(e: &sqlx::migrate::MigrateError) {
    let text = e.to_string();
    if text.contains("_below_cut") {
        tracing::error!(
            error = %text,
            "the partition move stopped: a row's id is at or above the cut (a UUID v7 from a \
             clock ahead, or an id that is no UUID v7). Find it with `SELECT id, enqueued_at \
             FROM event_outbox ORDER BY id DESC LIMIT 5` (event_inbox: event_id, received_at), \
             move or delete it, and boot again. Nothing is left that refuses a write."
        );
    } else {
        tracing::error!(error = %text, "the partition move stopped; it is finished or undone at the next boot, and nothing is left that refuses a write");
    }
}

/// SHA-384 of a file's bytes in hex (the digest sqlx records per migration).
pub fn checksum_hex(bytes: &[u8]) -> String {
    Sha384::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One library file as found in a service's folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileCheck {
    /// File name.
    pub name: &'static str,
    /// The library's checksum.
    pub expected_sha384: String,
    /// What was found.
    pub status: FileStatus,
}

/// What [`check_dir`] found for one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileStatus {
    /// Byte-identical.
    Identical,
    /// Not present.
    Missing,
    /// Present with other bytes (checksum of what is there).
    Differs {
        /// SHA-384 of the service's copy.
        found_sha384: String,
    },
    /// Present but unreadable.
    Unreadable {
        /// The I/O error.
        error: String,
    },
}

/// Why [`check_dir`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationCheckError {
    /// The folder itself cannot be read.
    #[error("cannot read migrations folder {path}: {source}")]
    Folder {
        /// The folder.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Some files are missing or differ.
    #[error("{} of {} library migrations are missing or differ in {}", .failures, .files.len(), .path.display())]
    Mismatch {
        /// The folder.
        path: PathBuf,
        /// How many files failed.
        failures: usize,
        /// Every file's result.
        files: Vec<FileCheck>,
    },
}

/// Checks that `dir` holds byte-identical copies of every library migration.
/// Returns each file's result when all are identical.
pub fn check_dir(dir: &Path) -> Result<Vec<FileCheck>, MigrationCheckError> {
    check_files(dir, FILES)
}

/// As [`check_dir`], for the given files ([`FILES`] or
/// [`PARTITIONED_FILES`]).
pub fn check_files(
    dir: &Path,
    files: &'static [(&'static str, &'static str)],
) -> Result<Vec<FileCheck>, MigrationCheckError> {
    if let Err(source) = std::fs::read_dir(dir) {
        return Err(MigrationCheckError::Folder {
            path: dir.to_owned(),
            source,
        });
    }
    let files: Vec<FileCheck> = files
        .iter()
        .map(|(name, body)| {
            let status = match std::fs::read(dir.join(name)) {
                Ok(found) if found == body.as_bytes() => FileStatus::Identical,
                Ok(found) => FileStatus::Differs {
                    found_sha384: checksum_hex(&found),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => FileStatus::Missing,
                Err(e) => FileStatus::Unreadable {
                    error: e.to_string(),
                },
            };
            FileCheck {
                name,
                expected_sha384: checksum_hex(body.as_bytes()),
                status,
            }
        })
        .collect();
    let failures = files
        .iter()
        .filter(|f| f.status != FileStatus::Identical)
        .count();
    if failures == 0 {
        Ok(files)
    } else {
        Err(MigrationCheckError::Mismatch {
            path: dir.to_owned(),
            failures,
            files,
        })
    }
}

/// Writes every library migration into `dir` (creating it), leaving files
/// that are already identical untouched. Refuses to overwrite a file that
/// differs (forward-only migrations are never edited) or that cannot be
/// read, and then writes nothing at all: every file is looked at before the
/// first is written. Each is written to a temporary name and renamed, so a
/// failure midway leaves no half-written migration.
pub fn stamp_dir(dir: &Path) -> Result<Vec<&'static str>, MigrationCheckError> {
    stamp_files(dir, FILES)
}

/// As [`stamp_dir`], for the given files ([`FILES`] or
/// [`PARTITIONED_FILES`]).
pub fn stamp_files(
    dir: &Path,
    files: &'static [(&'static str, &'static str)],
) -> Result<Vec<&'static str>, MigrationCheckError> {
    std::fs::create_dir_all(dir).map_err(|source| MigrationCheckError::Folder {
        path: dir.to_owned(),
        source,
    })?;
    let mut missing = Vec::new();
    let mut conflicts = Vec::new();
    for (name, body) in files {
        let conflict = |status| FileCheck {
            name,
            expected_sha384: checksum_hex(body.as_bytes()),
            status,
        };
        match std::fs::read(dir.join(name)) {
            Ok(found) if found == body.as_bytes() => {}
            Ok(found) => conflicts.push(conflict(FileStatus::Differs {
                found_sha384: checksum_hex(&found),
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing.push((*name, *body)),
            Err(e) => conflicts.push(conflict(FileStatus::Unreadable {
                error: e.to_string(),
            })),
        }
    }
    if !conflicts.is_empty() {
        return Err(MigrationCheckError::Mismatch {
            path: dir.to_owned(),
            failures: conflicts.len(),
            files: conflicts,
        });
    }
    let mut written = Vec::with_capacity(missing.len());
    for (name, body) in missing {
        let path = dir.join(name);
        let partial = dir.join(format!(".{name}.partial"));
        std::fs::write(&partial, body)
            .and_then(|()| std::fs::rename(&partial, &path))
            .map_err(|source| {
                let _ = std::fs::remove_file(&partial);
                MigrationCheckError::Folder {
                    path: path.clone(),
                    source,
                }
            })?;
        written.push(name);
    }
    Ok(written)
}

/// How long a migration that runs in a transaction waits for a lock before
/// it fails, in [`run`]. Such a migration takes an exclusive lock on its
/// table; queued behind a long transaction it would hold every query on the
/// table back behind it (PostgreSQL's lock queue), so it gives up instead,
/// to be run again when the table is quieter. A concurrent index build or
/// drop is not bounded by it (see [`run`]).
pub const MIGRATION_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How often a migration that waits says whom it waits for.
pub const WAIT_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs [`tolerant_migrator`] on one connection of `pool`.
///
/// - A migration that runs in a transaction does so with `lock_timeout`
///   [`MIGRATION_LOCK_TIMEOUT`]: one that cannot have its lock soon fails
///   (and is rolled back, to be run again) rather than stalling the
///   service's own queries on the table behind it.
/// - A concurrent index build or drop (`CREATE`/`DROP INDEX CONCURRENTLY`,
///   each alone in its file) waits for every older transaction of the
///   database, as long as it must: it blocks no query while it waits. Every
///   [`WAIT_REPORT_EVERY`] a WARN line names the sessions it waits for (process id,
///   application name, state, how long their transaction has been open).
/// - An index that an earlier build left behind with its migration
///   unrecorded (the build failed or its process died: PostgreSQL keeps it,
///   INVALID) is dropped and built again, so a failed boot never makes the
///   next one fail.
/// - Replicas booting together take turns (sqlx's migration lock); a
///   replica waits for the one migrating as long as it must, with the same
///   WARN line.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
/// outbox::migrate::run(&pool).await?;
/// # Ok(()) }
/// ```
pub async fn run(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    run_with(pool, &tolerant_migrator(), None, false).await
}

/// Runs `migrator` as [`run`] describes, after `setting` (a `SET` statement
/// the migrations read) on the same connection; the partitioned layout's
/// (`repair`) finishes or undoes a move that stopped, before and after.
async fn run_with(
    pool: &sqlx::PgPool,
    migrator: &sqlx::migrate::Migrator,
    setting: Option<&str>,
    repair: bool,
) -> Result<(), sqlx::migrate::MigrateError> {
    let mut conn = pool.acquire().await?;
    let ran = async {
        if let Some(setting) = setting {
            sqlx::raw_sql(sqlx::AssertSqlSafe(setting.to_owned()))
                .execute(&mut *conn)
                .await?;
        }
        run_on(pool, &mut conn, migrator, repair).await
    }
    .await;
    match ran {
        // The connection goes back to the pool as it came.
        Ok(()) => {
            sqlx::raw_sql("RESET lock_timeout; RESET canopy.partition_width_secs")
                .execute(&mut *conn)
                .await?;
            Ok(())
        }
        // A failed run may leave the migration lock held (sqlx does not
        // release it on error) or a setting changed: the session ends.
        Err(e) => {
            let _ = conn.close().await;
            Err(e)
        }
    }
}

/// The steps of [`run`] on its connection.
async fn run_on(
    pool: &sqlx::PgPool,
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
    migrator: &sqlx::migrate::Migrator,
    repair: bool,
) -> Result<(), sqlx::migrate::MigrateError> {
    use sqlx::migrate::Migrate;
    take_migration_lock(pool, conn).await?;
    set_lock_timeout(conn, Some(MIGRATION_LOCK_TIMEOUT)).await?;
    conn.ensure_migrations_table(&migrator.table_name).await?;
    if repair {
        repair_stopped_move(conn).await?;
    }
    let ran = migrate_on(pool, conn, migrator).await;
    if let Err(e) = &ran
        && repair
    {
        say_how_to_go_on(e);
        set_lock_timeout(conn, Some(MIGRATION_LOCK_TIMEOUT)).await?;
        repair_stopped_move(conn).await?;
    }
    ran?;
    conn.unlock().await
}

/// The migrations of [`run_on`], under its lock.
async fn migrate_on(
    pool: &sqlx::PgPool,
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), sqlx::migrate::MigrateError> {
    use sqlx::migrate::Migrate;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **conn)
        .await?;
    let applied: std::collections::BTreeSet<i64> = conn
        .list_applied_migrations(&migrator.table_name)
        .await?
        .into_iter()
        .map(|m| m.version)
        .collect();
    for m in migrator.iter() {
        let Some(build) = Concurrent::of(m) else {
            continue;
        };
        if applied.contains(&m.version) {
            continue;
        }
        // Everything before it, as usual.
        migrator
            .run_direct(Some(m.version - 1), &mut **conn, false)
            .await?;
        set_lock_timeout(conn, None).await?;
        if let Concurrent::Create(index) = build {
            drop_leftover_index(pool, pid, conn, index).await?;
        }
        let what = format!("migration {}", m.version);
        // (`run_direct`: sqlx's own way round `run_to`'s future not being
        // `Send` for every lifetime.)
        let step = migrator.run_direct(Some(m.version), &mut **conn, false);
        waiting(pool, pid, &what, step).await?;
        set_lock_timeout(conn, Some(MIGRATION_LOCK_TIMEOUT)).await?;
    }
    migrator.run_direct(None, &mut **conn, false).await
}

/// Takes the migration lock, the advisory lock sqlx's runner takes (a
/// session's advisory locks nest, so the runner then takes it again at
/// once), polling for it rather than waiting in a statement: a session
/// waiting in a statement holds a snapshot, and a concurrent index build of
/// the replica holding the lock would wait for that snapshot while the
/// session waits for the lock (a deadlock).
async fn take_migration_lock(
    pool: &sqlx::PgPool,
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
) -> Result<(), sqlx::migrate::MigrateError> {
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&mut **conn)
        .await?;
    let key = migration_lock_key(&database);
    let started = std::time::Instant::now();
    let mut reported = std::time::Duration::ZERO;
    loop {
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(&mut **conn)
            .await?;
        if taken {
            return Ok(());
        }
        if started.elapsed() >= reported + WAIT_REPORT_EVERY {
            reported = started.elapsed();
            let holders = sessions(
                pool,
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
                   AND classid::INT8 = ($1 >> 32) AND objid::INT8 = ($1 & 4294967295) \
                   AND objsubid = 1",
                key,
            )
            .await;
            tracing::warn!(
                what = "the migration lock",
                waited_secs = reported.as_secs(),
                blocked_by = %holders,
                "a migration waits for the sessions named in blocked_by; it blocks no query meanwhile"
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// The key of sqlx's migration lock for `database` (sqlx-postgres's
/// `generate_lock_id`: a fixed factor times the name's CRC-32).
fn migration_lock_key(database: &str) -> i64 {
    0x3d32_ad9e * i64::from(crc32(database.as_bytes()))
}

/// CRC-32 (IEEE 802.3, reflected, the zlib one), bit by bit: it runs once
/// per boot over a database name.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// A migration that works concurrently (outside a transaction, waiting for
/// older transactions), and the index it builds.
enum Concurrent<'a> {
    /// `CREATE INDEX CONCURRENTLY` of this index.
    Create(&'a str),
    /// `DROP INDEX CONCURRENTLY`.
    Drop,
}

impl<'a> Concurrent<'a> {
    fn of(m: &'a sqlx::migrate::Migration) -> Option<Self> {
        if !m.no_tx {
            return None;
        }
        let sql = m.sql.as_str();
        let words = || {
            sql.lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .flat_map(str::split_whitespace)
        };
        let statement: Vec<&str> = words().take(3).collect();
        match statement.as_slice() {
            ["CREATE", "INDEX", "CONCURRENTLY"] => {
                let name = words().skip(3).find(|w| {
                    !matches!(w.to_ascii_uppercase().as_str(), "IF" | "NOT" | "EXISTS")
                })?;
                Some(Self::Create(name))
            }
            ["DROP", "INDEX", "CONCURRENTLY"] => Some(Self::Drop),
            _ => None,
        }
    }
}

/// Drops `index` if it exists while the migration that builds it is not
/// recorded: an earlier build failed (the index is INVALID) or died before
/// sqlx recorded it.
async fn drop_leftover_index(
    pool: &sqlx::PgPool,
    pid: i32,
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
    index: &str,
) -> Result<(), sqlx::migrate::MigrateError> {
    let valid: Option<bool> = sqlx::query_scalar(
        "SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass($1)",
    )
    .bind(index)
    .fetch_optional(&mut **conn)
    .await?;
    let Some(valid) = valid else {
        return Ok(());
    };
    tracing::warn!(
        index,
        valid,
        "an earlier migration run left this index behind unrecorded; dropping it to build it again"
    );
    let drop = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP INDEX CONCURRENTLY IF EXISTS {index}"
    )))
    .execute(&mut **conn);
    waiting(pool, pid, &format!("the drop of {index}"), drop).await?;
    Ok(())
}

async fn set_lock_timeout(
    conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
    timeout: Option<std::time::Duration>,
) -> Result<(), sqlx::Error> {
    let ms = timeout.map_or(0, |t| t.as_millis());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET lock_timeout = '{ms}ms'")))
        .execute(&mut **conn)
        .await?;
    Ok(())
}

/// Awaits `step` (run by backend `pid`); while it waits, says every
/// [`WAIT_REPORT_EVERY`] which sessions block it, read on another
/// connection of `pool` (when the pool has none to spare, the line says
/// so).
async fn waiting<T, E>(
    pool: &sqlx::PgPool,
    pid: i32,
    what: &str,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, sqlx::migrate::MigrateError>
where
    sqlx::migrate::MigrateError: From<E>,
{
    let started = std::time::Instant::now();
    let mut step = std::pin::pin!(step);
    loop {
        match tokio::time::timeout(WAIT_REPORT_EVERY, &mut step).await {
            Ok(done) => return Ok(done?),
            Err(_) => {
                let blockers = blockers(pool, pid).await;
                tracing::warn!(
                    what,
                    waited_secs = started.elapsed().as_secs(),
                    blocked_by = %blockers,
                    "a migration waits for the sessions named in blocked_by; it blocks no query meanwhile"
                );
            }
        }
    }
}

/// The sessions that block backend `pid`, for a log line.
async fn blockers(pool: &sqlx::PgPool, pid: i32) -> String {
    sessions(
        pool,
        "SELECT unnest(pg_blocking_pids($1::INT4))",
        i64::from(pid),
    )
    .await
}

/// The sessions whose pids `pids` (a query of one `INT8` parameter) returns,
/// one `pid=… app=… state=… xact_secs=…` each, read on another connection
/// of `pool` (when the pool has none to spare, the text says so).
async fn sessions(pool: &sqlx::PgPool, pids: &'static str, param: i64) -> String {
    let read = async {
        let mut conn = tokio::time::timeout(std::time::Duration::from_secs(1), pool.acquire())
            .await
            .map_err(|_| "no connection to spare".to_owned())?
            .map_err(|e| e.to_string())?;
        let rows: Vec<(i32, String, Option<String>, Option<f64>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT pid, application_name, state, \
                        extract(epoch FROM now() - xact_start)::float8 \
                   FROM pg_stat_activity WHERE pid IN ({pids}) ORDER BY pid"
            )))
            .bind(param)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(rows)
    };
    match read.await {
        Ok(rows) if rows.is_empty() => "none found".to_owned(),
        Ok(rows) => rows
            .iter()
            .map(|(pid, app, state, secs)| {
                format!(
                    "pid={pid} app={app:?} state={} xact_secs={:.0}",
                    state.as_deref().unwrap_or("?"),
                    secs.unwrap_or(0.0)
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        Err(why) => format!("unknown ({why})"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32_is_the_ieee_one() {
        assert_eq!(super::crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(super::crc32(b""), 0);
    }
}
