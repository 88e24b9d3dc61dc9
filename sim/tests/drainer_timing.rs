//! The production drainer's adaptive tick, observed in simulated time: it
//! polls at the busy tick while there is (or recently was) work, and backs
//! off to four times that once a minute has passed without work or errors.

use std::path::Path;

use sim::scenario::Scenario;
use sim::trace::Event;

#[test]
fn the_drainer_polls_at_the_busy_tick_then_backs_off_after_a_steady_minute() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
    let mut s = Scenario::find(&dir, "clean").unwrap();
    s.topology.drainers = 1;
    s.workload.transactions = 20; // done within the first second
    s.timing.fault_phase_secs = 100.0; // the run lasts at least this long
    let tick_ms = sim::world::drainer_config(&s, "x").tick.as_millis() as f64;
    let o = sim::world::run(&s, 5);
    assert!(o.verdict.ok(), "{:?}", o.verdict.violations);
    let claims: Vec<f64> = o
        .trace
        .events()
        .into_iter()
        .filter_map(|(at, e)| match e {
            Event::Claimed { ids, .. } if ids.is_empty() => Some(at.as_secs_f64() * 1000.0),
            _ => None,
        })
        .collect();
    let gaps = |from_ms: f64, to_ms: f64| -> Vec<f64> {
        claims
            .windows(2)
            .filter(|w| w[0] >= from_ms && w[1] <= to_ms)
            .map(|w| w[1] - w[0])
            .collect()
    };
    // Busy: from the workload's end until a minute has passed.
    let busy = gaps(5_000.0, 55_000.0);
    let idle = gaps(70_000.0, 99_000.0);
    assert!(
        busy.len() > 100 && idle.len() > 20,
        "{} busy, {} idle gaps",
        busy.len(),
        idle.len()
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    // A gap is the sleep plus the claim's own round trips (four of them, a
    // step or two each), the same in both regimes: busy sleeps one tick,
    // idle four, so the gaps differ by three ticks.
    let (busy, idle) = (mean(&busy), mean(&idle));
    assert!(
        busy >= tick_ms && busy < 2.0 * tick_ms + 100.0,
        "busy gap {busy} vs tick {tick_ms}"
    );
    assert!(
        (idle - busy - 3.0 * tick_ms).abs() < tick_ms * 0.5,
        "idle gap {idle} - busy gap {busy} vs 3 x tick {tick_ms}"
    );
}
