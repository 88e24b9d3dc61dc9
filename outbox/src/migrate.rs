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
    if let Err(source) = std::fs::read_dir(dir) {
        return Err(MigrationCheckError::Folder {
            path: dir.to_owned(),
            source,
        });
    }
    let files: Vec<FileCheck> = FILES
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
/// differs: forward-only migrations are never edited.
pub fn stamp_dir(dir: &Path) -> Result<Vec<&'static str>, MigrationCheckError> {
    std::fs::create_dir_all(dir).map_err(|source| MigrationCheckError::Folder {
        path: dir.to_owned(),
        source,
    })?;
    let mut written = Vec::new();
    let mut conflicts = Vec::new();
    for (name, body) in FILES {
        let path = dir.join(name);
        match std::fs::read(&path) {
            Ok(found) if found == body.as_bytes() => {}
            Ok(found) => conflicts.push(FileCheck {
                name,
                expected_sha384: checksum_hex(body.as_bytes()),
                status: FileStatus::Differs {
                    found_sha384: checksum_hex(&found),
                },
            }),
            Err(_) => {
                std::fs::write(&path, body).map_err(|source| MigrationCheckError::Folder {
                    path: path.clone(),
                    source,
                })?;
                written.push(*name);
            }
        }
    }
    if conflicts.is_empty() {
        Ok(written)
    } else {
        Err(MigrationCheckError::Mismatch {
            path: dir.to_owned(),
            failures: conflicts.len(),
            files: conflicts,
        })
    }
}
