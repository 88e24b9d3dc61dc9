//! The world: builds one simulation (on this build's engine,
//! [`crate::engine`]) from a scenario and a seed (hosts in [`hosts`], the
//! fakes and the fault schedule in [`env`]), runs the fault phase, heals
//! everything, runs the liveness phase until the model's quiescence (or its
//! bound), then has the checker judge.

pub mod env;
pub mod hosts;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use self::env::Env;
pub use self::hosts::{drainer_config, inbox_janitor_settings, subscriber_settings};
use crate::adapters::{Hooks, STORE_REQUEST_TIMEOUT};
use crate::checker::{self, Limits, Verdict};
use crate::engine::{self, Sim};
use crate::fakes::mq::MqState;
use crate::fakes::pg::PgState;
use crate::model::Oracle;
use crate::scenario::{Expect, Fault, Scenario};
use crate::trace::{Event, FaultKind, Trace};
use outbox::core::marks::Mark;

/// Simulated time per step: the world applies its fault schedule at this
/// granularity on both engines, and it is turmoil's scheduling quantum.
/// On turmoil every host runs until idle once per step and a message sent
/// in one step is delivered in a later one, so a round trip costs one or
/// two steps. 10 ms keeps every timing the drainer relies on several steps
/// long (the 50 ms tick, the 2 s confirm deadline, the 5 s lease) while a
/// 60-second swarm seed costs about 6 000 steps; turmoil's cost is per host
/// per step, whether or not anything happens, so the step is what bounds
/// its sweep speed. madsim runs each ready task as it becomes ready, and
/// draws each message's latency from the same 1 ms to one-step range.
pub const STEP: Duration = Duration::from_millis(10);
/// Steps in `d` (at least one).
const fn steps_in(d: Duration) -> u32 {
    let n = d.as_millis() / STEP.as_millis();
    if n == 0 { 1 } else { n as u32 }
}
/// Steps between checks for quiescence in the liveness phase.
const QUIESCENCE_CHECK_STEPS: u32 = steps_in(Duration::from_millis(100));
/// Steps between operator unparks in the liveness phase.
const UNPARK_EVERY_STEPS: u32 = steps_in(Duration::from_secs(2));
/// The exchange drainers publish to and subscriptions bind to.
pub const EXCHANGE: &str = "canopy.events";
/// The subscription every consumer host serves (bound to every event).
pub const CONSUMER_QUEUE: &str = "billing.events";
/// How often the operator (on `consumer-1`) replays dead letters after the
/// heal.
const REPLAY_EVERY: Duration = Duration::from_secs(2);
/// A crash-point crash restarts the host after this long.
const CRASH_RESTART_AFTER: Duration = Duration::from_secs(1);

/// The result of one run.
#[derive(Debug)]
pub struct RunOutcome {
    pub scenario: String,
    pub seed: u64,
    pub verdict: Verdict,
    /// Simulated seconds the run took.
    pub sim_secs: f64,
    pub trace: Trace,
    /// The faults this seed scheduled (swarm draws included), for the report.
    pub faults: Vec<String>,
    /// How often each mark and each kind of fault was hit.
    pub coverage: Coverage,
}

impl RunOutcome {
    /// The hash of the run's trace (FNV-1a 64 of its rendering), computed
    /// when asked: a sweep drops its traces unhashed.
    pub fn trace_hash(&self) -> u64 {
        self.trace.hash()
    }
}

/// How often a run took each marked path and suffered each kind of fault.
#[derive(Debug, Clone, Default)]
pub struct Coverage {
    pub marks: BTreeMap<Mark, u64>,
    pub faults: BTreeMap<FaultKind, u64>,
}

impl Coverage {
    /// Counts marks and faults (window starts and single occurrences).
    pub fn of(events: &[(Duration, Event)]) -> Self {
        let mut c = Self::default();
        for (_, e) in events {
            match e {
                Event::Mark { mark, .. } => *c.marks.entry(*mark).or_insert(0) += 1,
                Event::FaultStart { kind, .. } | Event::Fault { kind, .. } => {
                    *c.faults.entry(*kind).or_insert(0) += 1
                }
                _ => {}
            }
        }
        c
    }

    /// Adds another run's counts.
    pub fn absorb(&mut self, other: &Coverage) {
        for (m, n) in &other.marks {
            *self.marks.entry(*m).or_insert(0) += n;
        }
        for (k, n) in &other.faults {
            *self.faults.entry(*k).or_insert(0) += n;
        }
    }
}

/// The rules' configuration for a scenario.
pub fn limits(s: &Scenario) -> Limits {
    let d = drainer_config(s, "check");
    Limits {
        batch_size: d.batch_size,
        pipeline_depth: d.pipeline_depth,
        stats_interval: d.stats_interval,
        pending_warn: d.pending_warn,
        oldest_warn: d.oldest_warn,
        max_attempts: d.max_attempts,
        confirm_timeout: d.confirm_timeout,
        lease_ttl: d.lease_ttl,
        tick: d.tick,
        backoff_max: outbox::core::drainer::ERROR_BACKOFF_MAX,
        max_rows_per_sec: d.max_rows_per_sec.map(|r| r.get()),
        retention: d.retention,
        consumer_max_attempts: subscriber_settings(s).max_attempts,
        inbox_retention: inbox_janitor_settings(s).retention,
        // The subscriber pings the database (within the handler's
        // deadline) before it ends an overrun handler's statement.
        abandoned_statement_bound: subscriber_settings(s).handler_timeout + Duration::from_secs(1),
        handler_timeout: subscriber_settings(s).handler_timeout,
        consumer_batch_max: subscriber_settings(s).batch_max,
        consumer_partitions: subscriber_settings(s).spec.partitions,
    }
}

/// One step of the fault schedule.
#[derive(Debug, Clone)]
struct Scheduled {
    at: Duration,
    start: bool,
    fault: usize,
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

fn schedule(faults: &[Fault]) -> Vec<Scheduled> {
    let mut schedule = Vec::with_capacity(faults.len() * 2);
    for (i, f) in faults.iter().enumerate() {
        let (at, len) = f.window();
        schedule.push(Scheduled {
            at: secs(at),
            start: true,
            fault: i,
        });
        schedule.push(Scheduled {
            at: secs(at + len),
            start: false,
            fault: i,
        });
    }
    schedule.sort_by_key(|s| (s.at, !s.start, s.fault));
    schedule
}

/// The seed of the random stream `purpose` draws from in a run of `seed`.
///
/// Each purpose (the swarm's draws, each fake, each host's crash points,
/// the engine (its network and scheduling), each drainer, the workload,
/// the fault windows) has a
/// stream of its own, derived from the seed and the purpose's name alone,
/// so taking a fault, a host or part of the workload out of a run leaves
/// every other stream as it was: what `sim shrink` relies on.
pub fn stream(seed: u64, purpose: &str) -> u64 {
    // splitmix64 over the seed mixed with FNV-1a of the purpose.
    let mut z = seed ^ crate::trace::fnv1a(purpose.as_bytes());
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The faults a run of `scenario` with `seed` schedules: the file's timed
/// faults, then the swarm's draws for this seed.
pub fn faults_of(scenario: &Scenario, seed: u64) -> Vec<Fault> {
    let mut faults = scenario.faults.clone();
    if let Some(swarm) = &scenario.swarm {
        let mut rng = SmallRng::seed_from_u64(stream(seed, "swarm"));
        let phase = scenario.timing.fault_phase_secs;
        let t = &scenario.topology;
        faults.extend(swarm.draw(&mut rng, phase, t.drainers, t.consumers, t.broker_nodes));
    }
    faults
}

/// How the engine is built for a run of `scenario` with `seed`.
pub fn settings(scenario: &Scenario, seed: u64) -> engine::Settings {
    engine::Settings {
        seed: stream(seed, engine::NAME),
        step: Some(STEP),
        latency: Some((Duration::from_millis(1), STEP)),
        // The run ends itself (quiescence or the liveness bound); this is a
        // backstop far beyond both.
        limit: secs(scenario.timing.fault_phase_secs + scenario.timing.liveness_secs * 4.0)
            + Duration::from_secs(600),
    }
}

/// Runs `scenario` with `seed` on this build's engine. A task that panics
/// fails the run (`SimulationError` in the trace), as a host that fails
/// does.
pub fn run(scenario: &Scenario, seed: u64) -> RunOutcome {
    crate::workload::handler::quiet_handler_panics();
    let trace = Trace::default();
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (scenario, trace) = (scenario.clone(), trace.clone());
        engine::simulate(settings(&scenario, seed), move |sim| {
            run_on(sim, scenario, seed, trace)
        })
    }));
    run.unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a task panicked".to_owned());
        trace.now(Event::SimulationError {
            message: format!("a task panicked: {message}"),
        });
        trace.seal();
        let events = trace.events();
        let mut verdict = Verdict::default();
        stopped_early(&mut verdict, &events);
        RunOutcome {
            scenario: scenario.name.clone(),
            seed,
            verdict,
            sim_secs: events.last().map_or(0.0, |(t, _)| t.as_secs_f64()),
            coverage: Coverage::of(&events),
            faults: faults_of(scenario, seed)
                .iter()
                .map(|f| format!("{f:?}"))
                .collect(),
            trace,
        }
    })
}

/// Runs `scenario` with `seed` on `sim`, recording into `trace`.
pub async fn run_on(mut sim: Sim, scenario: Scenario, seed: u64, trace: Trace) -> RunOutcome {
    let scenario = &scenario;
    let topology = &scenario.topology;
    let _gauges = crate::gauges::record_into(&trace);
    let faults = faults_of(scenario, seed);
    let fakes = (
        {
            let pg = PgState::new(stream(seed, "pg"), trace.clone());
            match scenario.config.partition_width_ms {
                Some(width) => pg.partition(width),
                None => pg,
            }
        },
        MqState::cluster(
            stream(seed, "mq"),
            trace.clone(),
            topology.broker_nodes.max(1) as usize,
        ),
    );
    let mut hooks: Vec<(String, Hooks)> = (1..=topology.drainers)
        .map(|i| {
            let host = format!("drainer-{i}");
            let hooks = Hooks::new(stream(seed, &format!("hooks {host}")));
            (host, hooks)
        })
        .collect();
    for i in 1..=topology.consumers {
        let host = format!("consumer-{i}");
        let h = Hooks::new(stream(seed, &format!("hooks {host}")));
        hooks.push((host, h));
    }
    let delivery_limit = subscriber_settings(scenario).max_body_bytes as usize;
    let drainer_seeds: Vec<u64> = (1..=topology.drainers)
        .map(|i| stream(seed, &format!("drainer-{i}")))
        .collect();
    let workload_seed = stream(seed, "workload");
    let fault_rng = SmallRng::seed_from_u64(stream(seed, "faults"));
    let mut env = Env::new(
        trace.clone(),
        fakes,
        hooks,
        topology.drainers,
        delivery_limit,
        fault_rng,
    );
    let done = Arc::new(AtomicBool::new(false));
    populate(
        &mut sim,
        &env,
        scenario,
        &drainer_seeds,
        workload_seed,
        &done,
    );
    let queue = (topology.consumers > 0).then_some(CONSUMER_QUEUE);
    drive(&mut sim, &mut env, scenario, &faults, &done, queue).await;
    trace.seal();
    let (verdict, coverage) = {
        let events = trace.lock();
        (
            judge(&env, scenario, &faults, queue, &events),
            Coverage::of(&events),
        )
    };
    RunOutcome {
        scenario: scenario.name.clone(),
        seed,
        verdict,
        sim_secs: sim.elapsed().as_secs_f64(),
        trace,
        faults: faults.iter().map(|f| format!("{f:?}")).collect(),
        coverage,
    }
}

/// madsim's own determinism check of a run of `scenario` with `seed`
/// (`Runtime::check_determinism`): the run twice, every random draw of the
/// second compared with the first's as it is made, so a divergence fails at
/// the draw where it happens. Returns the second run's trace hash and
/// length.
#[cfg(madsim)]
pub fn check_determinism(scenario: &Scenario, seed: u64) -> (u64, usize) {
    use std::sync::Mutex;
    // The check takes a function, not a closure: the run's input waits
    // here, one check at a time.
    static INPUT: Mutex<Option<(Scenario, u64)>> = Mutex::new(None);
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    *INPUT.lock().expect("input") = Some((scenario.clone(), seed));
    let s = settings(scenario, seed);
    let config = engine::madsim::config(&s);
    ::madsim::runtime::Runtime::check_determinism(s.seed, config, || async {
        let (scenario, seed) = INPUT.lock().expect("input").clone().expect("input set");
        let sim = Sim::new(settings(&scenario, seed));
        let o = run_on(sim, scenario, seed, Trace::default()).await;
        (o.trace_hash(), o.trace.events().len())
    })
}

/// Puts the fakes, the drainers, the consumers and the workload on the
/// simulated network.
fn populate(
    sim: &mut Sim,
    env: &Env,
    scenario: &Scenario,
    drainer_seeds: &[u64],
    workload_seed: u64,
    done: &Arc<AtomicBool>,
) {
    if scenario.topology.consumers > 0 {
        // Deployment: the subscription exists before anything is published,
        // declared on the last node (as the consumer hosts' first choice).
        let mut queues = env.mq.queues.lock().expect("queues");
        let last = queues.node_count() - 1;
        let spec = subscriber_settings(scenario).spec;
        let (arguments, dlq_arguments) = crate::wire::subscription_arguments(&spec);
        let topology = crate::fakes::mq::queues::Topology {
            queue: CONSUMER_QUEUE,
            exchange: EXCHANGE,
            bindings: &["#".to_owned()],
            arguments: &arguments,
            dlq_arguments: &dlq_arguments,
            partitions: spec.partitions,
            partition: None,
        };
        queues
            .declare_subscription(&topology, last)
            .expect("a fresh broker declares the subscription");
    }
    crate::fakes::serve(sim, &env.pg, &env.mq);
    for (i, seed) in (1..).zip(drainer_seeds) {
        hosts::spawn_drainer(sim, env, scenario, i, *seed);
    }
    for i in 1..=scenario.topology.consumers {
        hosts::spawn_consumer(sim, env, scenario, i);
    }
    let (workload, trace, done) = (scenario.workload.clone(), env.trace.clone(), done.clone());
    sim.client("workload", move || {
        crate::workload::run(workload, workload_seed, trace, done)
    });
}

/// The retention bound: a row outlives its retention by at most two
/// janitor intervals (one sweep may just have missed it), plus the store
/// timeout should a sweep fail.
fn retention_bound(retention: Duration, interval: Duration) -> Duration {
    retention + interval * 2 + STORE_REQUEST_TIMEOUT
}

fn oracle<'a>(env: &'a Env, scenario: &Scenario, queue: Option<&'a str>) -> Oracle<'a> {
    let d = drainer_config(scenario, "oracle");
    let inbox = inbox_janitor_settings(scenario);
    Oracle {
        pg: &env.pg,
        mq: &env.mq,
        queue,
        queue_type: subscriber_settings(scenario).spec.queue_type,
        outbox_retention_bound: retention_bound(d.retention, d.janitor_interval),
        inbox_retention_bound: retention_bound(inbox.retention, inbox.interval),
    }
}

/// Steps the simulation: the fault phase, the heal, the liveness phase.
async fn drive(
    sim: &mut Sim,
    env: &mut Env,
    scenario: &Scenario,
    faults: &[Fault],
    done: &AtomicBool,
    queue: Option<&str>,
) {
    let schedule = schedule(faults);
    let heal_at = secs(scenario.timing.fault_phase_secs);
    let liveness = secs(scenario.timing.liveness_secs);
    let mut active: BTreeSet<usize> = BTreeSet::new();
    let mut next = 0;
    let mut healed = false;
    let mut deadline: Option<Duration> = None;
    let mut steps: u32 = 0;
    loop {
        let now = sim.elapsed();
        while !healed && next < schedule.len() && schedule[next].at <= now {
            let s = &schedule[next];
            env.apply(sim, s.fault, &faults[s.fault], s.start);
            if s.start {
                active.insert(s.fault);
            } else {
                active.remove(&s.fault);
            }
            next += 1;
        }
        env.crash_requested(sim, now);
        env.restart_due(sim, now);
        if !healed && now >= heal_at {
            healed = true;
            let active: Vec<usize> = std::mem::take(&mut active).into_iter().collect();
            env.heal(sim, faults, &active);
        } else if !healed {
            env.send_hostiles();
        }
        // The operator keeps unparking during the liveness phase: an
        // unpublishable row parks again after each unpark.
        if healed && steps.is_multiple_of(UNPARK_EVERY_STEPS) {
            env.pg.operator_unpark_all();
        }
        if healed && deadline.is_none() && done.load(Ordering::SeqCst) {
            deadline = Some(now + liveness);
        }
        steps += 1;
        if let Some(deadline) = deadline
            && steps.is_multiple_of(QUIESCENCE_CHECK_STEPS)
            && (now >= deadline || oracle(env, scenario, queue).quiescent())
        {
            return;
        }
        if let Err(message) = sim.step().await {
            env.trace.now(Event::SimulationError { message });
            return;
        }
    }
}

/// The checker's verdict on the run.
fn judge(
    env: &Env,
    scenario: &Scenario,
    faults: &[Fault],
    queue: Option<&str>,
    events: &[(Duration, Event)],
) -> Verdict {
    let fin = oracle(env, scenario, queue).read();
    let expect = Expect {
        quiet: faults.is_empty(),
        ..scenario.expect.clone()
    };
    let mut verdict = checker::check(events, &fin, &limits(scenario), &expect);
    stopped_early(&mut verdict, events);
    verdict
}

/// Fails `verdict` if the run stopped early: not a rule of the ADR, but no
/// run that stopped early proves one.
fn stopped_early(verdict: &mut Verdict, events: &[(Duration, Event)]) {
    if let Some((at, Event::SimulationError { message })) = events
        .iter()
        .find(|(_, e)| matches!(e, Event::SimulationError { .. }))
    {
        verdict.violations.push(checker::Violation {
            invariant: checker::Invariant::ScenarioExpectation,
            at: Some(*at),
            detail: format!("the simulation stopped: {message}"),
        });
        *verdict
            .counts
            .entry(checker::Invariant::ScenarioExpectation)
            .or_insert(0) += 1;
    }
}
