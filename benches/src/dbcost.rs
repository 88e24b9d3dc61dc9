//! What a workload costs the database server, as another service's commits
//! would feel it: the CPU time of the workload's own PostgreSQL backends
//! (found by `application_name` in `pg_stat_activity`, the sessions whose
//! name begins with the workload's, their time read
//! from `/proc/<pid>/stat`, so the harness must run on the database's
//! machine), and the WAL the server wrote and flushed meanwhile
//! (`pg_stat_wal`: bytes, and `wal_sync`, the flushes a commit or the WAL
//! writer waited for).
//!
//! The WAL figures are the whole server's: measure with nothing else
//! writing. The CPU figure is the named backends' alone.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::PgPool;

/// The server's WAL counters at one instant.
#[derive(Debug, Clone, Copy, Default)]
struct Wal {
    bytes: u64,
    syncs: u64,
}

async fn wal(pool: &PgPool) -> Result<Wal, sqlx::Error> {
    // A backend reports its WAL counters when its transaction ends (or
    // within a second of going idle); each statement here is a transaction
    // of its own, so it reads a fresh snapshot.
    let (bytes, syncs): (i64, i64) =
        sqlx::query_as("SELECT wal_bytes::bigint, wal_sync FROM pg_stat_wal")
            .fetch_one(pool)
            .await?;
    Ok(Wal {
        bytes: bytes.max(0) as u64,
        syncs: syncs.max(0) as u64,
    })
}

/// CPU time (user + system) of process `pid`, or `None` once it is gone.
fn cpu_of(pid: i32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its `)`.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the line are the 12th and 13th after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(
        ticks as f64 / clock_ticks_per_sec(),
    ))
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 on Linux
/// everywhere this runs).
fn clock_ticks_per_sec() -> f64 {
    100.0
}

/// A meter over one workload: the backends named `application_name`.
pub struct Meter {
    pool: PgPool,
    application_name: String,
    wal: Wal,
    /// Each backend's CPU time when the measurement started (zero for one
    /// that connected since), and when last read.
    backends: BTreeMap<i32, (Duration, Duration)>,
    /// Whether the first sample was taken.
    started: bool,
}

/// What the workload cost the server between [`Meter::start`] and
/// [`Meter::finish`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Cost {
    /// CPU time of the workload's backends.
    pub cpu: Duration,
    /// WAL bytes the server wrote.
    pub wal_bytes: u64,
    /// WAL flushes (`fsync`s) the server made.
    pub wal_flushes: u64,
    /// Backends of the workload seen.
    pub backends: usize,
}

impl Cost {
    /// The cost per unit of work (per event) as
    /// (CPU µs, WAL bytes, WAL flushes).
    pub fn per(&self, n: u64) -> (f64, f64, f64) {
        let n = n.max(1) as f64;
        (
            self.cpu.as_secs_f64() * 1e6 / n,
            self.wal_bytes as f64 / n,
            self.wal_flushes as f64 / n,
        )
    }
}

impl Meter {
    /// Starts measuring the backends whose name begins with
    /// `application_name` (the library's drainer names its own sessions
    /// after the pool's, with a suffix), through
    /// `pool` (a connection not of the workload).
    pub async fn start(pool: &PgPool, application_name: &str) -> Result<Self, sqlx::Error> {
        let mut meter = Self {
            pool: pool.clone(),
            application_name: application_name.to_owned(),
            wal: wal(pool).await?,
            backends: BTreeMap::new(),
            started: false,
        };
        meter.sample().await?;
        meter.started = true;
        Ok(meter)
    }

    /// Reads the workload's backends' CPU time now. Call it often enough
    /// that a backend that ends is read shortly before (a pool keeps its
    /// connections, so they rarely do).
    pub async fn sample(&mut self) -> Result<(), sqlx::Error> {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE starts_with(application_name, $1)",
        )
        .bind(&self.application_name)
        .fetch_all(&self.pool)
        .await?;
        for pid in pids {
            if let Some(now) = cpu_of(pid) {
                let base = if self.started { Duration::ZERO } else { now };
                self.backends.entry(pid).or_insert((base, now)).1 = now;
            }
        }
        Ok(())
    }

    /// Ends the measurement (after a last [`sample`](Self::sample)).
    pub async fn finish(mut self) -> Result<Cost, sqlx::Error> {
        self.sample().await?;
        // Let the backends report their last WAL counters.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let end = wal(&self.pool).await?;
        Ok(Cost {
            cpu: self
                .backends
                .values()
                .map(|(first, last)| *last - *first)
                .sum(),
            wal_bytes: end.bytes.saturating_sub(self.wal.bytes),
            wal_flushes: end.syncs.saturating_sub(self.wal.syncs),
            backends: self.backends.len(),
        })
    }
}
