//! The fakes: transport-bound state machines standing in for PostgreSQL
//! ([`pg`]) and RabbitMQ ([`mq`]) on the simulated network. Each module doc
//! lists the faults it injects and why the system must survive each; the
//! conformance suites (`sim/tests/conformance/`) run the same bodies against
//! the fakes and the real services.

pub mod mq;
pub mod pg;

use std::time::Duration;

/// Serves the fake PostgreSQL as host `pg` and the fake RabbitMQ as host
/// `rabbit`, where the adapters look for them.
pub fn serve(sim: &mut turmoil::Sim<'_>, pg: &pg::PgState, mq: &mq::MqState) {
    let pg = pg.clone();
    sim.host("pg", move || pg::serve(pg.clone()));
    let mq = mq.clone();
    sim.host("rabbit", move || mq::serve(mq.clone()));
}

/// A bare world for tests that drive the production core by hand: a fake
/// PostgreSQL (seeded `seed`) and RabbitMQ (`seed + 1`) recording into
/// `trace`, served; turmoil seeded `seed + 2`; ten simulated minutes at most.
pub fn bare_world(
    seed: u64,
    trace: &crate::trace::Trace,
) -> (turmoil::Sim<'static>, pg::PgState, mq::MqState) {
    let (pg, mq) = (
        pg::PgState::new(seed, trace.clone()),
        mq::MqState::new(seed + 1, trace.clone()),
    );
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed + 2)
        .simulation_duration(Duration::from_secs(600))
        .build();
    serve(&mut sim, &pg, &mq);
    (sim, pg, mq)
}
