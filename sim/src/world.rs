//! The world: builds one turmoil simulation from a scenario and a seed, runs
//! the fault phase, heals everything, and runs the liveness phase until every
//! committed envelope is stored by the broker (or the bound passes).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use outbox::{Drainer, DrainerConfig, TokioClock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::adapters::{Hooks, Point, SimBroker, SimStore};
use crate::checker::{self, Verdict};
use crate::mq_fake::{self, MqFaults, MqState};
use crate::pg_fake::{self, PgFaults, PgState};
use crate::scenario::{Fault, Scenario};
use crate::trace::{Event, Trace};

/// Simulated time per turmoil step: the scheduling quantum. Every host runs
/// until idle once per step and a message sent in one step is delivered in a
/// later one, so a round trip costs one or two steps. 10 ms keeps every
/// timing the drainer relies on several steps long (the 50 ms tick, the 2 s
/// confirm deadline, the 5 s lease) while a 60-second swarm seed costs about
/// 6 000 steps; turmoil's cost is per host per step, whether or not anything
/// happens, so the step is what bounds sweep speed.
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
    pub trace_hash: u64,
    /// Simulated seconds the run took.
    pub sim_secs: f64,
    pub trace: Trace,
    /// The faults this seed scheduled (swarm draws included), for the report.
    pub faults: Vec<String>,
}

/// The drainer configuration every scenario starts from: the production
/// defaults scaled to simulated seconds, then the scenario's overrides.
pub fn drainer_config(s: &Scenario, replica: &str) -> DrainerConfig {
    let c = &s.config;
    DrainerConfig::builder()
        .replica_id(replica)
        .exchange("canopy.events")
        .tick_ms(c.tick_ms.unwrap_or(50))
        .batch_size(c.batch_size.unwrap_or(20))
        .pipeline_depth(c.pipeline_depth.unwrap_or(8))
        .lease_ttl_secs(c.lease_ttl_secs.unwrap_or(5))
        .confirm_timeout_secs(c.confirm_timeout_secs.unwrap_or(2))
        .max_attempts(c.max_attempts.unwrap_or(3))
        .max_rows_per_sec(c.max_rows_per_sec.unwrap_or(0))
        .retention(Duration::from_secs(c.retention_secs.unwrap_or(3)))
        .janitor_interval(Duration::from_secs(c.janitor_interval_secs.unwrap_or(2)))
        .janitor_batch(c.janitor_batch.unwrap_or(1000))
        .build()
        .unwrap_or_else(|e| panic!("scenario {} has an invalid drainer config: {e}", s.name))
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

/// Draws swarm faults for this seed.
fn swarm_faults(s: &Scenario, rng: &mut SmallRng) -> Vec<Fault> {
    let Some(swarm) = &s.swarm else {
        return Vec::new();
    };
    let phase = s.timing.fault_phase_secs;
    let drainers = s.topology.drainers;
    let consumers = s.topology.consumers.max(1);
    let consumer = |rng: &mut SmallRng| format!("consumer-{}", rng.random_range(1..=consumers));
    let mut out = Vec::new();
    for family in &swarm.families {
        if !rng.random_bool(0.5) {
            continue;
        }
        let n = rng.random_range(1..=swarm.max_occurrences.max(1));
        for _ in 0..n {
            let len = rng.random_range(0.5..(phase / 3.0).max(1.0));
            let at = rng.random_range(0.0..(phase - len).max(0.1));
            let target = format!("drainer-{}", rng.random_range(1..=drainers));
            let f = match family.as_str() {
                "blackhole" => Fault::Blackhole {
                    target,
                    at_secs: at,
                    for_secs: len,
                },
                "partition_rabbit" => Fault::Partition {
                    a: target,
                    b: "rabbit".into(),
                    at_secs: at,
                    for_secs: len,
                },
                "partition_pg" => Fault::Partition {
                    a: target,
                    b: "pg".into(),
                    at_secs: at,
                    for_secs: len,
                },
                "crash" => Fault::Crash {
                    target,
                    at_secs: at,
                    restart_after_secs: len,
                },
                "crash_point" => {
                    let points = [
                        Point::AfterClaim,
                        Point::MidPublish,
                        Point::BeforeMark,
                        Point::MidMark,
                    ];
                    Fault::CrashPoint {
                        point: points[rng.random_range(0..points.len())],
                        prob: 0.05,
                        at_secs: at,
                        for_secs: len,
                    }
                }
                "pause" => Fault::Pause {
                    point: Point::BeforeMark,
                    prob: 0.1,
                    ms: rng.random_range(1000..8000),
                    at_secs: at,
                    for_secs: len,
                },
                "pg" => Fault::Pg {
                    lose_reply_prob: 0.02,
                    fail_prob: 0.02,
                    at_secs: at,
                    for_secs: len,
                },
                "mq_drop" => Fault::Mq {
                    drop_conn_prob: 0.02,
                    confirm_delay_ms: 0,
                    nack_prefix: None,
                    duplicate_prob: 0.0,
                    at_secs: at,
                    for_secs: len,
                },
                "confirm_delay" => Fault::Mq {
                    drop_conn_prob: 0.0,
                    confirm_delay_ms: rng.random_range(100..4000),
                    nack_prefix: None,
                    duplicate_prob: 0.0,
                    at_secs: at,
                    for_secs: len,
                },
                "consumer_crash" => Fault::Crash {
                    target: consumer(rng),
                    at_secs: at,
                    restart_after_secs: len,
                },
                "consumer_crash_point" => {
                    let points = [Point::AfterCommit, Point::MidHandler];
                    Fault::CrashPoint {
                        point: points[rng.random_range(0..points.len())],
                        prob: 0.05,
                        at_secs: at,
                        for_secs: len,
                    }
                }
                "consumer_partition" => Fault::Partition {
                    a: consumer(rng),
                    b: if rng.random_bool(0.5) { "rabbit" } else { "pg" }.into(),
                    at_secs: at,
                    for_secs: len,
                },
                "duplicate_delivery" => Fault::Mq {
                    drop_conn_prob: 0.0,
                    confirm_delay_ms: 0,
                    nack_prefix: None,
                    duplicate_prob: 0.2,
                    at_secs: at,
                    for_secs: len,
                },
                "downstream" => Fault::Downstream {
                    at_secs: at,
                    for_secs: len,
                },
                other => unreachable!("unknown family {other} passed scenario checks"),
            };
            out.push(f);
        }
    }
    out
}

struct Env {
    pg: PgState,
    mq: MqState,
    /// Every host's crash and pause points: drainers, then consumers.
    hooks: Vec<(String, Hooks)>,
    trace: Trace,
    drainers: u32,
    /// The consumers' downstream refuses `poison.` events while set.
    downstream_broken: Arc<AtomicBool>,
    /// Set at the heal: the operator starts replaying dead letters.
    healed: Arc<AtomicBool>,
}

impl Env {
    fn hosts(&self, pattern: &str) -> Vec<String> {
        if pattern == "drainers" {
            (1..=self.drainers)
                .map(|i| format!("drainer-{i}"))
                .collect()
        } else {
            vec![pattern.to_owned()]
        }
    }

    fn apply(
        &self,
        sim: &mut turmoil::Sim<'_>,
        fault: &Fault,
        start: bool,
        crashed: &mut BTreeSet<String>,
    ) {
        let verb = if start { "start" } else { "heal" };
        self.trace.now(Event::Fault(format!("{verb} {fault:?}")));
        match fault {
            Fault::Blackhole { target, .. } => {
                for h in self.hosts(target) {
                    if start {
                        sim.hold(h.as_str(), "rabbit");
                    } else {
                        sim.release(h.as_str(), "rabbit");
                    }
                }
            }
            Fault::Partition { a, b, .. } => {
                for h in self.hosts(a) {
                    if start {
                        sim.partition(h.as_str(), b.as_str());
                    } else {
                        sim.repair(h.as_str(), b.as_str());
                    }
                }
            }
            Fault::Crash { target, .. } => {
                for h in self.hosts(target) {
                    if start {
                        if crashed.insert(h.clone()) {
                            sim.crash(h.as_str());
                            self.trace.now(Event::Host { host: h, up: false });
                        }
                    } else if crashed.remove(&h) {
                        sim.bounce(h.as_str());
                        self.trace.now(Event::Host { host: h, up: true });
                    }
                }
            }
            Fault::Downstream { .. } => self.downstream_broken.store(start, Ordering::SeqCst),
            Fault::CrashPoint { point, prob, .. } => {
                for (_, hooks) in &self.hooks {
                    hooks.set_crash(*point, if start { *prob } else { 0.0 });
                }
            }
            Fault::Pause {
                point, prob, ms, ..
            } => {
                for (_, hooks) in &self.hooks {
                    hooks.set_pause(
                        *point,
                        if start { *prob } else { 0.0 },
                        Duration::from_millis(*ms),
                    );
                }
            }
            Fault::Pg {
                lose_reply_prob,
                fail_prob,
                ..
            } => {
                *self.pg.faults.lock().expect("faults") = if start {
                    PgFaults {
                        lose_reply_prob: *lose_reply_prob,
                        fail_prob: *fail_prob,
                    }
                } else {
                    PgFaults::default()
                };
            }
            Fault::Mq {
                drop_conn_prob,
                confirm_delay_ms,
                nack_prefix,
                duplicate_prob,
                ..
            } => {
                *self.mq.faults.lock().expect("faults") = if start {
                    MqFaults {
                        nack_prefix: nack_prefix.clone(),
                        drop_conn_prob: *drop_conn_prob,
                        confirm_delay_ms: *confirm_delay_ms,
                        duplicate_prob: *duplicate_prob,
                    }
                } else {
                    MqFaults::default()
                };
            }
        }
    }
}

/// Runs `scenario` with `seed`.
pub fn run(scenario: &Scenario, seed: u64) -> RunOutcome {
    let mut rng = SmallRng::seed_from_u64(seed);
    let trace = Trace::default();
    crate::set_world_now(Duration::ZERO);
    let mut faults = scenario.faults.clone();
    faults.extend(swarm_faults(scenario, &mut rng));
    let mut schedule: Vec<Scheduled> = Vec::new();
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

    let heal_at = secs(scenario.timing.fault_phase_secs);
    let liveness = secs(scenario.timing.liveness_secs);
    let drainers = scenario.topology.drainers;
    let env = Env {
        pg: PgState::new(rng.random(), trace.clone()),
        mq: MqState::new(rng.random(), trace.clone()),
        hooks: (1..=drainers)
            .map(|i| (format!("drainer-{i}"), Hooks::new(rng.random())))
            .collect(),
        trace: trace.clone(),
        drainers,
        downstream_broken: Arc::default(),
        healed: Arc::default(),
    };
    let mut env = env;
    let consumers = scenario.topology.consumers;
    for i in 1..=consumers {
        env.hooks
            .push((format!("consumer-{i}"), Hooks::new(rng.random())));
    }
    if consumers > 0 {
        // Deployment: the subscription exists before anything is published.
        env.mq.queues.lock().expect("queues").declare_subscription(
            CONSUMER_QUEUE,
            "canopy.events",
            &["#".to_owned()],
        );
    }

    let mut sim = turmoil::Builder::new()
        .rng_seed(rng.random())
        .tick_duration(STEP)
        // Hosts run in a seeded random order within each step, so a seed
        // explores interleavings a fixed order would never produce.
        .enable_random_order()
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(STEP)
        .tcp_capacity(1 << 16)
        // The run ends itself (quiescence or the liveness bound); this is a
        // backstop far beyond both.
        .simulation_duration(heal_at + liveness * 4 + Duration::from_secs(600))
        .build();

    let pg = env.pg.clone();
    sim.host("pg", move || pg_fake::serve(pg.clone()));
    let mq = env.mq.clone();
    sim.host("rabbit", move || mq_fake::serve(mq.clone()));
    for i in 1..=drainers {
        let name = format!("drainer-{i}");
        let hooks = env.hooks[(i - 1) as usize].1.clone();
        let trace = trace.clone();
        let scenario = scenario.clone();
        let entropy_seed: u64 = rng.random();
        let incarnation = Arc::new(AtomicU32::new(0));
        let host = name.clone();
        sim.host(name.as_str(), move || {
            // Each start is a new process: a new replica id, as production's
            // drainer-{hostname}-{pid}-{uuid} would be.
            let n = incarnation.fetch_add(1, Ordering::SeqCst) + 1;
            let replica = format!("{host}#{n}");
            let config = drainer_config(&scenario, &replica);
            let store = Arc::new(SimStore::new(replica.clone(), trace.clone(), hooks.clone()));
            let broker = Arc::new(SimBroker::new(replica, trace.clone(), hooks.clone()));
            let seed = entropy_seed ^ u64::from(n);
            async move {
                let clock = Arc::new(TokioClock::default());
                let (_keep, rx) = tokio::sync::watch::channel(false);
                tokio::spawn(outbox::core::janitor::run(
                    store.clone(),
                    clock.clone(),
                    config.clone(),
                    rx.clone(),
                ));
                let drainer = Drainer::new(
                    store,
                    broker,
                    clock,
                    Arc::new(outbox::SplitMix64::new(seed)),
                    config,
                );
                drainer.run(rx).await;
                drop(_keep);
                Ok(())
            }
        });
    }
    for i in 1..=consumers {
        spawn_consumer(&mut sim, &env, scenario, i);
    }
    let done = Arc::new(AtomicBool::new(false));
    let workload_seed: u64 = rng.random();
    sim.client(
        "workload",
        crate::workload::run(
            scenario.workload.clone(),
            workload_seed,
            trace.clone(),
            done.clone(),
        ),
    );

    let mut crashed: BTreeSet<String> = BTreeSet::new();
    let mut restarts: Vec<(Duration, String)> = Vec::new();
    let mut next = 0;
    let mut healed = false;
    let mut liveness_deadline: Option<Duration> = None;
    let mut steps: u32 = 0;
    loop {
        let now = sim.elapsed();
        crate::set_world_now(now);
        while next < schedule.len() && schedule[next].at <= now {
            let s = &schedule[next];
            if !healed {
                env.apply(&mut sim, &faults[s.fault], s.start, &mut crashed);
            }
            next += 1;
        }
        for (host, hooks) in &env.hooks {
            if hooks.take_crash_request() {
                let host = host.clone();
                if crashed.insert(host.clone()) {
                    sim.crash(host.as_str());
                    trace.now(Event::Host {
                        host: host.clone(),
                        up: false,
                    });
                    restarts.push((now + CRASH_RESTART_AFTER, host));
                }
            }
        }
        restarts.retain(|(at, host)| {
            if *at <= now && crashed.remove(host) {
                sim.bounce(host.as_str());
                trace.now(Event::Host {
                    host: host.clone(),
                    up: true,
                });
                false
            } else {
                *at > now
            }
        });
        if !healed && now >= heal_at {
            healed = true;
            heal(&env, &mut sim, &faults, &schedule[next..], &mut crashed);
            restarts.clear();
            next = schedule.len();
        }
        // The operator keeps unparking during the liveness phase: rows that
        // were nacked just before the heal park after it.
        if healed && steps.is_multiple_of(UNPARK_EVERY_STEPS) {
            env.pg.operator_unpark_all();
        }
        if healed && liveness_deadline.is_none() && done.load(Ordering::SeqCst) {
            liveness_deadline = Some(now + liveness);
        }
        steps += 1;
        if let Some(deadline) = liveness_deadline
            && steps.is_multiple_of(QUIESCENCE_CHECK_STEPS)
            && ((env.pg.drained() && (consumers == 0 || env.pg.consumed())) || now >= deadline)
        {
            break;
        }
        if let Err(e) = sim.step() {
            trace.now(Event::Fault(format!("simulation error: {e}")));
            break;
        }
    }

    let stored = env.mq.stored.lock().expect("stored").counts();
    let config = drainer_config(scenario, "check");
    let max_attempts = config.max_attempts;
    // Retention liveness: a published row outlives its retention by at most
    // two janitor intervals (one sweep may just have missed it), plus the
    // adapter's store timeout should a sweep fail.
    let overdue = env.pg.published_before(
        config.retention + config.janitor_interval * 2 + crate::adapters::STORE_REQUEST_TIMEOUT,
    );
    let expect = crate::scenario::Expect {
        quiet: faults.is_empty(),
        ..scenario.expect.clone()
    };
    let verdict = checker::check(
        &trace.events(),
        &stored,
        &env.pg.parked_ids(),
        &env.pg.attempts(),
        &env.pg.unpublished(),
        max_attempts,
        &expect,
    );
    let mut verdict = verdict;
    if consumers > 0 {
        let view = consumer_view(&env.pg);
        let events = trace.events();
        verdict
            .violations
            .extend(checker::check_consumers(&events, &view, &scenario.expect));
    }
    for id in overdue.iter().take(5) {
        verdict.violations.push(format!(
            "retention: {id} was published long ago but the janitor kept it"
        ));
    }
    RunOutcome {
        scenario: scenario.name.clone(),
        seed,
        verdict,
        trace_hash: trace.hash(),
        sim_secs: sim.elapsed().as_secs_f64(),
        trace,
        faults: faults.iter().map(|f| format!("{f:?}")).collect(),
    }
}

/// Ends every fault still active, restarts crashed hosts, and has the
/// operator unpark what parked.
fn heal(
    env: &Env,
    sim: &mut turmoil::Sim<'_>,
    faults: &[Fault],
    pending: &[Scheduled],
    crashed: &mut BTreeSet<String>,
) {
    env.trace.now(Event::Fault("heal: every fault ends".into()));
    for s in pending.iter().filter(|s| !s.start) {
        // Only faults that started have their end still pending.
        if pending.iter().any(|p| p.start && p.fault == s.fault) {
            continue;
        }
        env.apply(sim, &faults[s.fault], false, crashed);
    }
    env.downstream_broken.store(false, Ordering::SeqCst);
    env.healed.store(true, Ordering::SeqCst);
    for (_, hooks) in &env.hooks {
        hooks.clear();
    }
    *env.pg.faults.lock().expect("faults") = PgFaults::default();
    *env.mq.faults.lock().expect("faults") = MqFaults::default();
    for host in std::mem::take(crashed) {
        sim.bounce(host.as_str());
        env.trace.now(Event::Host { host, up: true });
    }
    env.pg.operator_unpark_all();
}

/// The subscriber settings every consumer host runs with: the production
/// defaults scaled down, then the scenario's overrides.
pub fn subscriber_settings(s: &Scenario) -> outbox::SubscriberSettings {
    let c = &s.config;
    let mut settings = outbox::SubscriberSettings::new(CONSUMER_QUEUE, &["#"]);
    settings.spec.exchange = "canopy.events".into();
    settings.spec.prefetch = c.consumer_prefetch.unwrap_or(8);
    settings.concurrency = c.consumer_concurrency.unwrap_or(2);
    settings.max_attempts = c.consumer_max_attempts.unwrap_or(3);
    settings
        .validate()
        .unwrap_or_else(|e| panic!("scenario {} has invalid consumer settings: {e}", s.name));
    settings
}

/// Host `consumer-{i}`: the production subscriber on the simulation
/// adapters. `consumer-1` also plays the operator who, after the heal,
/// replays dead-lettered events now that the downstream works again.
fn spawn_consumer(sim: &mut turmoil::Sim<'_>, env: &Env, scenario: &Scenario, i: u32) {
    let host = format!("consumer-{i}");
    let hooks = env.hooks[(env.drainers + i - 1) as usize].1.clone();
    let trace = env.trace.clone();
    let settings = subscriber_settings(scenario);
    let transient = scenario.config.consumer_transient_one_in.unwrap_or(0);
    let downstream = env.downstream_broken.clone();
    let healed = env.healed.clone();
    let incarnation = Arc::new(AtomicU32::new(0));
    let name = host.clone();
    sim.host(name.as_str(), move || {
        let n = incarnation.fetch_add(1, Ordering::SeqCst) + 1;
        let who = format!("{host}#{n}");
        let store = Arc::new(
            crate::inbox_adapter::SimInboxStore::new(who.clone(), trace.clone())
                .with_hooks(hooks.clone()),
        );
        let broker = Arc::new(SimBroker::new(who.clone(), trace.clone(), hooks.clone()));
        let handler = Arc::new(
            crate::consumer::SimHandler::new(CONSUMER_QUEUE, transient)
                .with_downstream(downstream.clone())
                .with_hooks(hooks.clone(), who.clone(), trace.clone()),
        );
        let subscriber = Arc::new(outbox::Subscriber::new(
            store,
            broker,
            Arc::new(TokioClock::default()),
            handler,
            settings.clone(),
        ));
        let operator = i == 1;
        let healed = healed.clone();
        async move {
            let (_keep, rx) = tokio::sync::watch::channel(false);
            if operator {
                let s = subscriber.clone();
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(REPLAY_EVERY).await;
                        if healed.load(Ordering::SeqCst) {
                            let filter = outbox::core::ports::InboxFilter {
                                dead_lettered_only: true,
                                ..Default::default()
                            };
                            let _ = s.replay(&filter).await;
                        }
                    }
                });
            }
            subscriber
                .run(rx)
                .await
                .map_err(|e| -> Box<dyn std::error::Error> { e.to_string().into() })?;
            Ok(())
        }
    });
}

/// The subscription's final state, for the checker.
fn consumer_view(pg: &PgState) -> checker::ConsumerView {
    let deliverable = pg.deliverable();
    let table = pg.table.lock().expect("table");
    let effects = table
        .inbox
        .effects()
        .iter()
        .filter(|((sub, _), _)| sub == CONSUMER_QUEUE)
        .map(|((_, id), n)| (*id, *n))
        .collect();
    let processed = table
        .inbox
        .rows()
        .filter(|r| r.processed_ms.is_some())
        .map(|r| r.event_id)
        .collect();
    checker::ConsumerView {
        deliverable,
        effects,
        processed,
    }
}
