//! The deterministic core: the drainer, the retention janitor and the stats
//! task, written only against the ports in [`ports`].
//!
//! Architecture invariant: nothing under `core/` names sqlx, lapin,
//! `tokio::time`, `std::time::{Instant, SystemTime}`, uuid generation, a
//! random source or an unordered map. Time, ids and randomness come in through
//! [`ports::Clock`] and [`ports::Entropy`], I/O through [`ports::OutboxStore`]
//! and [`ports::Broker`], coverage marks through [`marks::Marks`].
//! `tests/core_hygiene.rs` enforces it, so the simulation runs exactly this
//! code with its own adapters.

pub mod drainer;
pub mod durability;
pub mod janitor;
pub mod marks;
pub mod ports;
pub mod stats;
pub mod subscriber;
pub mod topology;

use std::future::Future;
use std::time::Duration;

use ports::Clock;

/// Runs `fut` until it completes or `limit` of clock time passes.
/// Polls the future first (`biased`), so a ready result always wins.
pub(crate) async fn with_deadline<C: Clock, F: Future>(
    clock: &C,
    limit: Duration,
    fut: F,
) -> Option<F::Output> {
    tokio::select! {
        biased;
        out = fut => Some(out),
        () = clock.sleep(limit) => None,
    }
}

/// Sleeps for `d` unless `shutdown` fires first; returns true on shutdown.
pub(crate) async fn sleep_or_shutdown<C: Clock>(
    clock: &C,
    d: Duration,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    if *shutdown.borrow() {
        return true;
    }
    tokio::select! {
        biased;
        changed = shutdown.changed() => changed.is_err() || *shutdown.borrow(),
        () = clock.sleep(d) => false,
    }
}

/// The first `max` characters of `s` (never splitting a character).
pub(crate) fn truncate_chars(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}
