//! The PostgreSQL pair of `.ci/pg-pair` (pg1 on 127.0.0.1:5441 streaming
//! to pg2 on 5442), for the tests that use it (included with `#[path]`).

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// pg1, the primary of a pair `.ci/pg-pair start` made.
pub const PG1: &str = "postgres://postgres@127.0.0.1:5441/postgres";
/// pg2, its standby.
pub const PG2: &str = "postgres://postgres@127.0.0.1:5442/postgres";

/// A small pool on one node of the pair.
pub async fn pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("{url}: start the pair with `.ci/pg-pair start` ({e})"))
}

/// Runs `.ci/pg-pair` with `args`; what it said, if it failed.
pub fn run(args: &[&str]) -> Result<(), String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/pg-pair");
    let out = Command::new(&script)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run .ci/pg-pair: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        ".ci/pg-pair {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// Runs `.ci/pg-pair` with `args`, which must succeed.
pub fn pair(args: &[&str]) {
    if let Err(e) = run(args) {
        panic!("{e}");
    }
}
