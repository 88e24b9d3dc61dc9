//! The deterministic simulation testbed: the production drainer, janitors
//! and subscriber, built with simulation adapters of their ports, run
//! against fake PostgreSQL and RabbitMQ servers on a simulated network
//! (turmoil's, or madsim's in the madsim build: [`engine`]) under seeded
//! fault scenarios, and judged rule by rule against ADR-018.
//!
//! # Layout (after TigerBeetle's VOPR)
//! - `main.rs`: the `sim` binary: `run SCENARIO --seed N`, `sweep`; the seed
//!   is printed first, a failure prints the command that reproduces it, a
//!   sweep prints violations and coverage (marks, faults) by scenario.
//! - [`scenario`]: parses `scenarios/*.toml`: typed timed faults and swarm
//!   families.
//! - [`engine`]: the two engines (turmoil, madsim) behind one interface.
//! - [`world`]: builds the simulation from a scenario and a seed (hosts, the
//!   fakes, the fault schedule), heals, runs the liveness phase, judges.
//! - [`fakes`]: the fake PostgreSQL ([`fakes::pg`]) and RabbitMQ
//!   ([`fakes::mq`]), each with its fault catalogue in its module doc,
//!   hostile messages ([`fakes::mq::hostile`]) and what PostgreSQL refuses
//!   to store ([`fakes::pg::jsonb`]).
//! - [`adapters`]: the ports over the simulated network, with crash and
//!   pause points and the trace of what the production code asked for.
//! - [`workload`]: the producer's transactions and the consumer's handler.
//! - [`model`]: what must be true, folded from the trace, and the oracle
//!   that reads what is true from the fakes.
//! - [`checker`]: the invariants, one family per file, each violation a
//!   typed value.
//! - [`shrink`]: `sim shrink`: a failing run cut down to the faults,
//!   workload and hosts its failure needs.
//! - [`timeline`]: the SVG picture of a run (`sim run ... --timeline`).
//! - [`trace`]: the typed event trace and its hash; [`wire`]: the protocol
//!   between adapters and fakes.
//!
//! One seed drives everything: the workload, the fault plan, the fakes'
//! random faults and turmoil's network, each from its own stream derived
//! from the seed and the purpose's name ([`world::stream`]), so removing one
//! of them moves no other. The same seed gives the same trace, byte for
//! byte.

pub mod adapters;
pub mod checker;
pub mod engine;
pub mod fakes;
pub mod gauges;
pub mod model;
pub mod scenario;
pub mod shrink;
pub mod timeline;
pub mod trace;
pub mod wire;
pub mod workload;
pub mod world;

use std::time::Duration;

/// Current simulated time.
pub fn sim_now() -> Duration {
    engine::now()
}

/// Current simulated time in whole milliseconds.
pub fn sim_now_ms() -> u64 {
    sim_now().as_millis() as u64
}
