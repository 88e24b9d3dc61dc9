//! The library's migrations: an embedded migrator and the byte-identity check
//! ("review is a checksum exercise", ADR-018).
//!
//! A service either runs [`migrator`] directly or stamps copies of
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

/// The partitioned layout's migrations (issue 28; [`partition`]), run
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

/// The embedded sqlx migrator over `migrations/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// The embedded migrator, tolerant of a service's own migrations in the same
/// database (it ignores applied versions it does not know).
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!();
    m.set_ignore_missing(true);
    m
}

/// The partitioned layout's migrations (issue 28), run after [`migrator`]'s:
/// `event_outbox` and `event_inbox` become tables partitioned by time, and
/// the janitors drop whole partitions instead of deleting rows. Opt-in: the
/// plain layout of the ADR's files stays the default. See [`partition`].
pub static PARTITIONED_MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate!("./migrations-partitioned");

/// The partitioned layout's migrator, tolerant of the plain layout's
/// versions (and a service's own) already applied in the database.
pub fn partitioned_migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!("./migrations-partitioned");
    m.set_ignore_missing(true);
    m
}

/// Moves a database to the partitioned layout (issue 28): runs the plain
/// layout's migrations ([`run`]), then the partitioned layout's, on a
/// connection whose `lock_timeout` is [`MIGRATION_LOCK_TIMEOUT`].
/// `width` is one partition's span (`None`: a day); it applies when the
/// layout is first created (`event_partitioning.width_secs` holds it and
/// may be updated later: partitions created from then on take the new
/// width). Rows already in the tables stay where they are, in the first
/// partition, and are dropped with it once every one is past retention.
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
    let mut conn = pool.acquire().await?;
    let mut set = format!(
        "SET lock_timeout = '{}ms';",
        MIGRATION_LOCK_TIMEOUT.as_millis()
    );
    if let Some(width) = width {
        set += &format!(
            " SET canopy.partition_width_secs = '{}';",
            width.as_secs().max(1)
        );
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(set))
        .execute(&mut *conn)
        .await?;
    let ran = partitioned_migrator().run(&mut *conn).await;
    sqlx::raw_sql("RESET lock_timeout; RESET canopy.partition_width_secs")
        .execute(&mut *conn)
        .await?;
    ran
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

/// How long a migration waits for a lock before it fails, in [`run`]. A
/// migration that alters `event_outbox` takes an exclusive lock; queued
/// behind a long transaction it would hold every query on the table back
/// behind it (PostgreSQL's lock queue), so it gives up instead, to be run
/// again when the table is quieter.
pub const MIGRATION_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs [`migrator`] on one connection of `pool` whose `lock_timeout` is
/// [`MIGRATION_LOCK_TIMEOUT`]: a migration that cannot have its lock soon
/// fails (and is rolled back, to be run again) rather than stalling the
/// service's own queries on the table behind it.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
/// outbox::migrate::run(&pool).await?;
/// # Ok(()) }
/// ```
pub async fn run(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut conn = pool.acquire().await?;
    let set = format!(
        "SET lock_timeout = '{}ms'",
        MIGRATION_LOCK_TIMEOUT.as_millis()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(set))
        .execute(&mut *conn)
        .await?;
    let ran = migrator().run(&mut *conn).await;
    // The connection goes back to the pool as it came.
    sqlx::raw_sql("RESET lock_timeout")
        .execute(&mut *conn)
        .await?;
    ran
}
