//! The standby and the failover: one replica, named [`STANDBY`], streams
//! the fake's WAL [`STANDBY_LAG_MS`] behind it (what `pg_stat_replication`
//! shows of it: its flush position), and a promotion makes what it holds
//! the database.
//!
//! It may fall away (the `standby_away` fault): from then on it holds the
//! database as it stood then (the commits flushed by then, none after),
//! and shows no position. A promotion (the `failover` fault) makes that,
//! or, while it streams, every commit flushed, the new primary's
//! database, on a new timeline: a failover to a standby that fell away
//! takes back every commit after it fell away, as a failover to a lagging
//! standby does (`outbox/tests/pg_failover.rs` shows PostgreSQL doing so).
//! The old primary then streams from the new one under the same name.
//!
//! Asked for its position, it answers the primary's flush position
//! [`STANDBY_LAG_MS`] ago: never more than it holds, so the durability
//! gates wait as they would for a real standby's feedback.

use super::Database;
use super::wal::Wal;

/// The standby's `application_name`.
pub const STANDBY: &str = "standby";
/// How far behind the primary's flush position it flushes (measured on
/// `.ci/pg-pair`: 1.2 ms on average, 3.8 ms at worst).
pub const STANDBY_LAG_MS: u64 = 5;

/// The one standby.
#[derive(Debug, Default)]
pub struct Standby {
    /// Fallen away: the database as it holds it.
    away: Option<Box<Database>>,
}

impl Standby {
    /// Its flush position at `now` as the primary shows it (`None`: not
    /// streaming).
    pub fn position(&self, wal: &Wal, now: u64) -> Option<u64> {
        match self.away {
            Some(_) => None,
            None => Some(wal.flushed_at(now.saturating_sub(STANDBY_LAG_MS))),
        }
    }

    /// It falls away holding `holds`.
    pub fn fall_away(&mut self, holds: Database) {
        self.away.get_or_insert_with(|| Box::new(holds));
    }

    /// It streams again (and catches up).
    pub fn come_back(&mut self) {
        self.away = None;
    }

    /// What it holds if it fell away (taken: it is promoted).
    pub fn take_held(&mut self) -> Option<Database> {
        self.away.take().map(|held| *held)
    }
}
