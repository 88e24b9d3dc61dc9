//! The deterministic simulation testbed: the production drainer, built with
//! simulation adapters of its ports, run against fake PostgreSQL and RabbitMQ
//! servers on a turmoil network under seeded fault scenarios.
//!
//! # Layout (after TigerBeetle's VOPR)
//! - `main.rs`: the `sim` binary: `run SCENARIO --seed N`, `sweep`; the seed
//!   is printed first, a failure prints the command that reproduces it.
//! - [`world`]: builds the turmoil simulation from a scenario and a seed,
//!   applies the fault schedule, heals, and runs the liveness phase.
//! - [`pg_fake`], [`mq_fake`]: the fakes, with their fault catalogues.
//! - [`adapters`]: the ports over the simulated network, with crash and
//!   pause points.
//! - [`workload`]: the producer's transactions.
//! - [`checker`]: the invariants, checked from the trace and final state.
//! - [`scenario`]: parses `scenarios/*.toml`.
//! - [`trace`]: the event trace and its hash.
//! - [`wire`]: the protocol between adapters and fakes.
//!
//! One seeded RNG drives everything: the workload, the fault plan, the
//! fakes' random faults and turmoil's network. The same seed gives the same
//! trace, byte for byte.

pub mod adapters;
pub mod checker;
pub mod consumer;
pub mod inbox_adapter;
pub mod mq_fake;
pub mod mq_queues;
pub mod pg_fake;
pub mod pg_inbox;
pub mod scenario;
pub mod trace;
pub mod wire;
pub mod workload;
pub mod world;

use std::cell::Cell;
use std::time::Duration;

thread_local! {
    /// Simulated time as the world loop last saw it, for code running
    /// outside a host (the world itself, drops during a crash).
    static WORLD_NOW: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Current simulated time.
pub fn sim_now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_else(|| WORLD_NOW.with(Cell::get))
}

/// Current simulated time in whole milliseconds.
pub fn sim_now_ms() -> u64 {
    sim_now().as_millis() as u64
}

pub(crate) fn set_world_now(d: Duration) {
    WORLD_NOW.with(|c| c.set(d));
}
