//! The production drainer's timing, observed in simulated time: it polls at
//! the busy tick while there is (or recently was) work, and backs off to four
//! times that once a minute has passed without work or errors; with
//! `max_rows_per_sec` it claims no faster than that.

// turmoil only: these drive the turmoil world by hand (links held and
// released between steps); the scenarios and the conformance suite run on
// both engines.
#![cfg(not(madsim))]

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

/// Rows claimed per window of `window_s` seconds, over the whole run.
fn claimed_per_window(o: &sim::world::RunOutcome, window_s: f64) -> Vec<usize> {
    let mut per = Vec::new();
    for (at, e) in o.trace.events() {
        if let Event::Claimed { ids, .. } = e {
            let w = (at.as_secs_f64() / window_s) as usize;
            if per.len() <= w {
                per.resize(w + 1, 0);
            }
            per[w] += ids.len();
        }
    }
    per
}

#[test]
fn a_rate_bound_paces_a_backlog_to_the_configured_rows_per_second() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
    let mut s = Scenario::find(&dir, "clean").unwrap();
    s.topology.drainers = 1;
    s.workload.transactions = 30;
    s.workload.envelopes_per_tx = [40, 40];
    s.workload.rollback_ratio = 0.0;
    s.workload.interval_ms = [5, 5]; // 1 200 rows within about two seconds
    s.timing.fault_phase_secs = 5.0;
    s.timing.liveness_secs = 60.0;
    // A tick longer than a claim's share of a second (20 rows / 40 per s): a
    // drainer that waited for its next tick instead of the paced instant
    // would fall well below the bound.
    s.config.tick_ms = Some(700);
    let unbounded = sim::world::run(&s, 3);
    assert!(unbounded.verdict.ok(), "{:?}", unbounded.verdict.violations);
    let fastest = claimed_per_window(&unbounded, 1.0)
        .into_iter()
        .max()
        .unwrap();
    const RATE: usize = 40;
    assert!(
        fastest > 3 * RATE,
        "the backlog drains at {fastest} rows/s unbounded"
    );

    s.config.max_rows_per_sec = Some(RATE as u32);
    let bounded = sim::world::run(&s, 3);
    assert!(bounded.verdict.ok(), "{:?}", bounded.verdict.violations);
    assert_eq!(bounded.verdict.published, 1200);
    let batch = sim::world::drainer_config(&s, "x").batch_size as usize;
    let per_window = claimed_per_window(&bounded, 2.0);
    // Over any two seconds: the bound, plus one claim that started inside
    // the window but was applied a little later.
    for (w, rows) in per_window.iter().enumerate() {
        assert!(*rows <= 2 * RATE + batch, "window {w}: {rows} rows in 2 s");
    }
    // And it drains at the bound, not slower: 1 200 rows take about 30 s.
    let busy: Vec<usize> = per_window[1..5].to_vec();
    assert!(
        busy.iter().all(|rows| *rows >= 2 * RATE - batch),
        "windows 1-4 claimed {busy:?} rows, expected about {} each",
        2 * RATE
    );
}
