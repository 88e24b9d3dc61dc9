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
    // The gap is the tick plus the claim's own round-trips (a few ms).
    assert!(
        (mean(&busy) - tick_ms).abs() < tick_ms * 0.5,
        "busy gap {} vs tick {tick_ms}",
        mean(&busy)
    );
    assert!(
        (mean(&idle) - 4.0 * tick_ms).abs() < tick_ms,
        "idle gap {} vs 4 x tick {tick_ms}",
        mean(&idle)
    );
}
