//! Simulation sweep speed: one seed of the `swarm` scenario (60 simulated
//! seconds of faults with three replicas, then healing and the liveness
//! phase) per iteration, seeds rotating, on one thread.
//!
//! Back of the envelope: a run is ~6 000 turmoil steps of 10 ms over six
//! hosts (~3 µs per host step, whether or not the host has work) plus ~12k
//! traced events, so ~0.1 s per seed on one core. `sim sweep` runs one seed
//! per core, so seeds/min on this machine = 2 x 60 / (time per seed). Issue
//! 3's target is 1000 seeds/min.
//!
//! `cargo bench -p benches --bench sweep`

use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sim::scenario::Scenario;

fn swarm(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
    let scenario = Scenario::find(&dir, "swarm").expect("swarm scenario");
    let clean = scenario.clean_twin().expect("swarm has faults");
    let mut group = c.benchmark_group("sweep");
    group.sample_size(10);
    group.throughput(Throughput::Elements(1));
    let mut seed = 0u64;
    group.bench_function("swarm_seed", |b| {
        b.iter(|| {
            seed += 1;
            let o = sim::world::run(&scenario, seed);
            assert!(o.verdict.ok(), "swarm seed {seed} failed");
        });
    });
    // Baseline measured in the same run: the same workload without faults.
    group.bench_function("swarm_clean_twin_seed", |b| {
        b.iter(|| {
            seed += 1;
            let o = sim::world::run(&clean, seed);
            assert!(o.verdict.ok(), "swarm.clean seed {seed} failed");
        });
    });
    group.finish();
}

criterion_group!(benches, swarm);
criterion_main!(benches);
