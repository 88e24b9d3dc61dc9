//! Shrinking a failing run (`sim shrink SCENARIO --seed N`): the smallest
//! scenario found that still breaks the same invariant with the same seed.
//!
//! The run's faults, swarm draws included, become the explicit fault
//! schedule of a new scenario (no swarm), which fails as the original did:
//! every purpose draws from a random stream of its own
//! ([`world::stream`]), so taking the swarm away changes no other draw.
//! Then, while the invariant still breaks: drop faults (halves, quarters,
//! …, then one at a time), halve the workload, drop the last consumer and
//! the last drainer (when no fault names them); then cut each remaining
//! fault's window to end at the violation and halve it, and end the fault
//! phase where the last remaining fault ends. Each step keeps a candidate only if
//! the same invariant still breaks; the rest of the run's randomness stays
//! as it was, so what remains is what the failure needs (or what the
//! schedule happened to need to reach it: shrinking is greedy, not a proof
//! of minimality).

use crate::checker::Invariant;
use crate::scenario::{Expect, Fault, Scenario};
use crate::world::{self, RunOutcome};

/// How big a run is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Size {
    pub faults: usize,
    pub transactions: u32,
    pub drainers: u32,
    pub consumers: u32,
    /// Simulated seconds the run took.
    pub sim_secs: f64,
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} faults, {} transactions, {} drainers, {} consumers, {:.1} simulated s",
            self.faults, self.transactions, self.drainers, self.consumers, self.sim_secs
        )
    }
}

/// A shrunk failure.
#[derive(Debug)]
pub struct Shrunk {
    /// The scenario that still fails, its faults explicit.
    pub scenario: Scenario,
    /// The invariant it breaks (the original run's earliest violation's).
    pub invariant: Invariant,
    pub before: Size,
    pub after: Size,
    /// Runs the shrinking took.
    pub runs: usize,
}

/// Why nothing was shrunk.
#[derive(Debug, thiserror::Error)]
pub enum ShrinkError {
    #[error("{scenario} seed {seed} passes: nothing to shrink")]
    Passes { scenario: String, seed: u64 },
    #[error(
        "{scenario} seed {seed} no longer breaks {invariant} with its faults made explicit \
         (a fault drawn from a stream another purpose shares?)"
    )]
    NotReproduced {
        scenario: String,
        seed: u64,
        invariant: Invariant,
    },
}

/// The invariant a run is shrunk for: its earliest violation's, else (only
/// end-of-run checks broke) the first it lists.
pub fn target(o: &RunOutcome) -> Option<Invariant> {
    let v = &o.verdict;
    v.violations
        .iter()
        .filter(|x| x.at.is_some())
        .min_by_key(|x| x.at)
        .or_else(|| v.violations.first())
        .map(|x| x.invariant)
        .or_else(|| v.counts.keys().next().copied())
}

fn size(s: &Scenario, o: &RunOutcome) -> Size {
    Size {
        faults: s.faults.len(),
        transactions: s.workload.transactions,
        drainers: s.topology.drainers,
        consumers: s.topology.consumers,
        sim_secs: o.sim_secs,
    }
}

/// Whether `fault` names `host`.
fn names(fault: &Fault, host: &str) -> bool {
    match fault {
        Fault::Blackhole { target, .. } | Fault::Crash { target, .. } => target == host,
        Fault::Partition { a, b, .. } => a == host || b == host,
        _ => false,
    }
}

/// The explicit twin of `scenario` for `seed`: its faults (swarm draws
/// included) as timed faults, no swarm, only the seed pinned, and (unless
/// the failure is an unmet expectation) no expectations, which a smaller
/// run need not meet.
pub fn explicit(scenario: &Scenario, seed: u64, invariant: Invariant) -> Scenario {
    let mut s = scenario.clone();
    s.faults = world::faults_of(scenario, seed);
    s.swarm = None;
    s.pin_only(vec![seed]);
    if invariant != Invariant::ScenarioExpectation {
        s.expect = Expect::default();
    }
    s.expect.reach.clear();
    s
}

/// The smallest failing scenario so far, and its run.
struct Search<'p> {
    seed: u64,
    invariant: Invariant,
    /// Runs so far.
    runs: usize,
    best: Scenario,
    last: RunOutcome,
    progress: &'p mut dyn FnMut(&str),
}

impl Search<'_> {
    /// Runs `candidate`; keeps it (and says so, with `note`) if it is
    /// consistent and still breaks the invariant.
    fn keep(&mut self, candidate: Scenario, note: &str) -> bool {
        if candidate.check().is_err() {
            return false;
        }
        self.runs += 1;
        let o = world::run(&candidate, self.seed);
        if !o.verdict.counts.contains_key(&self.invariant) {
            return false;
        }
        (self.progress)(&format!("kept {}{note}", size(&candidate, &o)));
        self.best = candidate;
        self.last = o;
        true
    }
}

impl Search<'_> {
    /// Drops faults: chunks of half, a quarter, … down to one. Whether any
    /// candidate was kept.
    fn drop_faults(&mut self) -> bool {
        let mut changed = false;
        let mut chunk = self.best.faults.len().div_ceil(2).max(1);
        while !self.best.faults.is_empty() {
            let mut i = 0;
            while i < self.best.faults.len() {
                let mut c = self.best.clone();
                c.faults.drain(i..(i + chunk).min(c.faults.len()));
                if self.keep(c, "") {
                    changed = true;
                } else {
                    i += chunk;
                }
            }
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2);
        }
        changed
    }

    /// Halves the workload while the failure stays.
    fn halve_workload(&mut self) -> bool {
        let mut changed = false;
        while self.best.workload.transactions > 1 {
            let mut c = self.best.clone();
            c.workload.transactions /= 2;
            if !self.keep(c, "") {
                break;
            }
            changed = true;
        }
        changed
    }

    /// Drops the last consumer, then the last drainer, if no fault names
    /// them.
    fn drop_hosts(&mut self) -> bool {
        let mut changed = false;
        for consumer in [true, false] {
            let t = &self.best.topology;
            let (n, host) = if consumer {
                (t.consumers, format!("consumer-{}", t.consumers))
            } else {
                (t.drainers, format!("drainer-{}", t.drainers))
            };
            if n <= 1 || self.best.faults.iter().any(|f| names(f, &host)) {
                continue;
            }
            let mut c = self.best.clone();
            if consumer {
                c.topology.consumers -= 1;
            } else {
                c.topology.drainers -= 1;
            }
            changed |= self.keep(c, "");
        }
        changed
    }

    /// Cuts each fault's window at most up to the violation, then halves
    /// it while the failure stays.
    fn shorten_faults(&mut self) {
        let seen = self
            .last
            .verdict
            .violations
            .iter()
            .filter(|v| v.invariant == self.invariant)
            .filter_map(|v| v.at)
            .min()
            .map(|at| at.as_secs_f64());
        for i in 0..self.best.faults.len() {
            let (at, len) = self.best.faults[i].window();
            let mut tries = Vec::new();
            if let Some(seen) = seen.filter(|s| *s > at && *s < at + len) {
                tries.push(seen - at);
            }
            for _ in 0..4 {
                let base = tries.last().copied().unwrap_or(len);
                tries.push(base / 2.0);
            }
            for want in tries {
                let mut c = self.best.clone();
                c.faults[i].set_len(want);
                if !self.keep(c, &format!(" (fault {} for {want:.2} s)", i + 1)) {
                    break;
                }
            }
        }
    }

    /// Ends the fault phase where the last fault does.
    fn end_fault_phase(&mut self) {
        let end = self
            .best
            .faults
            .iter()
            .map(|f| {
                let (at, len) = f.window();
                at + len
            })
            .fold(0.0_f64, f64::max);
        let phase = (end.ceil()).max(1.0);
        if phase < self.best.timing.fault_phase_secs {
            let mut c = self.best.clone();
            c.timing.fault_phase_secs = phase;
            self.keep(c, "");
        }
    }
}

/// Shrinks the failing run of `scenario` with `seed`; `progress` hears of
/// every candidate kept.
pub fn shrink(
    scenario: &Scenario,
    seed: u64,
    mut progress: impl FnMut(&str),
) -> Result<Shrunk, ShrinkError> {
    let first = world::run(scenario, seed);
    let Some(invariant) = target(&first) else {
        return Err(ShrinkError::Passes {
            scenario: scenario.name.clone(),
            seed,
        });
    };
    let twin = explicit(scenario, seed, invariant);
    let before = size(&twin, &first);
    let mut search = Search {
        seed,
        invariant,
        runs: 1,
        best: twin.clone(),
        last: first,
        progress: &mut progress,
    };
    if !search.keep(twin, " (its faults made explicit)") {
        return Err(ShrinkError::NotReproduced {
            scenario: scenario.name.clone(),
            seed,
            invariant,
        });
    }
    loop {
        // Each step runs whatever the one before it did (no `||`).
        let faults = search.drop_faults();
        let workload = search.halve_workload();
        let hosts = search.drop_hosts();
        if !(faults || workload || hosts) {
            break;
        }
    }
    search.shorten_faults();
    search.end_fault_phase();
    let Search {
        runs,
        mut best,
        last,
        ..
    } = search;
    let after = size(&best, &last);
    best.description = format!(
        "Shrunk from {} seed {seed} ({before}) to {after}: still breaks {invariant}.",
        scenario.name
    );
    Ok(Shrunk {
        scenario: best,
        invariant,
        before,
        after,
        runs,
    })
}

/// The shrunk scenario as a scenario file.
pub fn to_toml(s: &Shrunk, command: &str) -> String {
    let body = toml::to_string(&s.scenario).expect("a scenario serializes");
    format!(
        "# Written by `{command}`: the explicit fault schedule that still breaks\n\
         # {} on its own ({} runs to shrink).\n{body}",
        s.invariant, s.runs
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn scenarios() -> &'static Path {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios"))
    }

    #[test]
    fn a_swarms_draws_made_explicit_run_the_same_trace() {
        let swarm = Scenario::find(scenarios(), "producer_and_consumer_swarm").unwrap();
        let seed = 3;
        let twin = explicit(&swarm, seed, Invariant::ScenarioExpectation);
        assert!(twin.swarm.is_none() && !twin.faults.is_empty());
        assert_eq!(
            world::run(&swarm, seed).trace_hash(),
            world::run(&twin, seed).trace_hash()
        );
        // And it survives being written and read back as a file.
        let text = toml::to_string(&twin).unwrap();
        let mut back: Scenario = toml::from_str(&text).unwrap();
        back.name = twin.name.clone();
        back.check().unwrap();
        assert_eq!(
            world::run(&back, seed).trace_hash(),
            world::run(&twin, seed).trace_hash()
        );
    }

    #[test]
    fn a_failure_that_needs_nothing_shrinks_to_nothing() {
        // Nothing parks without poison: the expectation fails whatever the
        // faults, so every fault goes, and the workload down to one.
        let mut s = Scenario::find(scenarios(), "producer_and_consumer_swarm").unwrap();
        s.workload.poison_ratio = 0.0;
        s.workload.unpublishable_ratio = 0.0;
        s.workload.transactions = 40;
        s.expect = Expect {
            parks: true,
            ..Expect::default()
        };
        let mut steps = 0;
        let shrunk = shrink(&s, 5, |_| steps += 1).unwrap();
        assert_eq!(shrunk.invariant, Invariant::ScenarioExpectation);
        assert!(shrunk.before.faults > 0, "{:?}", shrunk.before);
        assert_eq!(shrunk.after.faults, 0);
        assert_eq!(shrunk.after.transactions, 1);
        assert_eq!(shrunk.after.consumers, 1);
        assert_eq!(shrunk.after.drainers, 1);
        assert!(steps > 0);
        // The file it writes fails on its own, with the same invariant.
        let text = to_toml(&shrunk, "sim shrink test");
        let mut back: Scenario = toml::from_str(&text).unwrap();
        back.name = "back".into();
        let o = world::run(&back, 5);
        assert_eq!(target(&o), Some(Invariant::ScenarioExpectation));
    }

    #[test]
    fn a_passing_run_is_not_shrunk() {
        let s = Scenario::find(scenarios(), "producer_and_consumer_swarm").unwrap();
        assert!(matches!(
            shrink(&s, 1, |_| {}),
            Err(ShrinkError::Passes { seed: 1, .. })
        ));
    }
}
