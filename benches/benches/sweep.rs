//! Simulation sweep speed: one seed of the `swarm` scenario (60 simulated
//! seconds of faults with three replicas, then healing and the liveness
//! phase) per iteration, seeds rotating.
//!
//! Back of the envelope: a run is ~80k turmoil steps of 1 ms over five hosts
//! (~2 µs per host step) plus ~20k traced events, so ~0.8 s per seed on one
//! core: ~75 seeds/min per core, ~150 on this machine's two. Issue 3's
//! target is 1000 seeds/min; criterion prints the time per seed (seeds/min =
//! 60 / that) and the throughput in seeds/s.
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
