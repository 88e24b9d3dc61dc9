//! The world's environment: the fakes' shared state, every host's crash and
//! pause points, and the fault schedule's effects: starting and ending
//! faults, crashing and restarting hosts, sending hostile messages, and the
//! heal that ends them all.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::Rng;
use rand::rngs::SmallRng;

use super::{CONSUMER_QUEUE, CRASH_RESTART_AFTER, EXCHANGE, STEP};
use crate::adapters::Hooks;
use crate::fakes::mq::{MqFaults, MqState};
use crate::fakes::pg::{PgFaults, PgState};
use crate::scenario::Fault;
use crate::trace::{Event, HostileKind, Trace};

/// Everything the world shares with its hosts and fakes.
pub struct Env {
    pub pg: PgState,
    pub mq: MqState,
    /// Every host's crash and pause points: drainers, then consumers.
    pub hooks: Vec<(String, Hooks)>,
    pub trace: Trace,
    pub drainers: u32,
    /// The consumers' downstream refuses `poison.` events while set.
    pub downstream_broken: Arc<AtomicBool>,
    /// Another session holds the consumers' domain table locked while set.
    pub domain_locked: Arc<AtomicBool>,
    /// Set at the heal: the operator starts replaying dead letters.
    pub healed: Arc<AtomicBool>,
    /// The subscribers' `max_body_bytes` (hostile bodies are sized to it).
    pub delivery_limit: usize,
    /// Hostile faults now active: (fault index, per-step probability,
    /// kinds, keyed share).
    hostile: Vec<(usize, f64, Vec<HostileKind>, f64)>,
    /// Decides, step by step, when a hostile message is sent.
    fault_rng: SmallRng,
    crashed: BTreeSet<String>,
    /// Hosts a crash point took down, and when they come back.
    restarts: Vec<(Duration, String)>,
}

impl Env {
    /// The environment of a run: `hooks` in host order, drainers first.
    pub fn new(
        trace: Trace,
        (pg, mq): (PgState, MqState),
        hooks: Vec<(String, Hooks)>,
        drainers: u32,
        delivery_limit: usize,
        fault_rng: SmallRng,
    ) -> Self {
        Self {
            pg,
            mq,
            hooks,
            trace,
            drainers,
            downstream_broken: Arc::default(),
            domain_locked: Arc::default(),
            healed: Arc::default(),
            delivery_limit,
            hostile: Vec::new(),
            fault_rng,
            crashed: BTreeSet::new(),
            restarts: Vec::new(),
        }
    }

    /// The hosts a fault's target names: `drainers` is every drainer,
    /// `rabbit` every node of the broker.
    fn hosts(&self, pattern: &str) -> Vec<String> {
        match pattern {
            "drainers" => (1..=self.drainers)
                .map(|i| format!("drainer-{i}"))
                .collect(),
            "rabbit" => self.mq.node_hosts(),
            _ => vec![pattern.to_owned()],
        }
    }

    /// The broker node (0-based) `host` is, if it is one.
    fn broker_node(&self, host: &str) -> Option<usize> {
        self.mq.node_hosts().iter().position(|h| h == host)
    }

    fn crash(&mut self, sim: &mut crate::engine::Sim, host: &str) -> bool {
        if !self.crashed.insert(host.to_owned()) {
            return false;
        }
        if host == "pg" {
            self.pg.crashing();
        }
        sim.crash(host);
        self.trace.now(Event::Host {
            host: host.to_owned(),
            up: false,
        });
        if let Some(node) = self.broker_node(host) {
            // Its connections die with it; the others see it gone.
            self.mq.set_node_up(node, false, crate::sim_now());
        }
        if host == "pg" {
            // What the WAL writer had not flushed is gone with it.
            self.pg.crashed(crate::fakes::pg::now_ms());
        }
        true
    }

    /// Cuts broker node `node` off from the other nodes and from every
    /// client host, or joins it again.
    fn isolate_node(&mut self, sim: &mut crate::engine::Sim, node: u32, start: bool) {
        let hosts = self.mq.node_hosts();
        let Some(host) = hosts.get((node as usize).wrapping_sub(1)) else {
            return;
        };
        for (client, _) in &self.hooks {
            if start {
                sim.partition(client.as_str(), host.as_str());
            } else {
                sim.repair(client.as_str(), host.as_str());
            }
        }
        self.mq
            .set_node_isolated(node as usize - 1, start, crate::sim_now());
    }

    fn restart(&mut self, sim: &mut crate::engine::Sim, host: &str) {
        if self.crashed.remove(host) {
            sim.restart(host);
            self.trace.now(Event::Host {
                host: host.to_owned(),
                up: true,
            });
        }
    }

    /// Starts (or ends) fault number `index`.
    pub fn apply(
        &mut self,
        sim: &mut crate::engine::Sim,
        index: usize,
        fault: &Fault,
        start: bool,
    ) {
        let kind = fault.kind();
        self.trace.now(if start {
            Event::FaultStart {
                kind,
                detail: format!("{fault:?}"),
            }
        } else {
            Event::FaultEnd { kind }
        });
        match fault {
            Fault::Blackhole { .. } | Fault::Partition { .. } => self.cut_links(sim, fault, start),
            Fault::NodePartition { node, .. } => self.isolate_node(sim, *node, start),
            Fault::LeaderElection { .. } => self.mq.block_elections(start, crate::sim_now()),
            Fault::Crash { target, .. } => {
                for h in self.hosts(target) {
                    if start {
                        self.crash(sim, &h);
                    } else {
                        self.restart(sim, &h);
                    }
                }
            }
            Fault::Downstream { .. } => self.downstream_broken.store(start, Ordering::SeqCst),
            Fault::DomainLock { .. } => {
                self.domain_locked.store(start, Ordering::SeqCst);
                self.pg.set_domain_lock(start);
            }
            Fault::CrashPoint { point, prob, .. } => {
                for (_, hooks) in &self.hooks {
                    hooks.set_crash(*point, if start { *prob } else { 0.0 });
                }
            }
            Fault::Pause {
                point, prob, ms, ..
            } => {
                for (_, hooks) in &self.hooks {
                    let p = if start { *prob } else { 0.0 };
                    hooks.set_pause(*point, p, Duration::from_millis(*ms));
                }
            }
            Fault::Pg { .. } | Fault::Mq { .. } => self.set_service_faults(fault, start),
            Fault::StandbyAway { .. } if start => self.pg.standby_away(crate::fakes::pg::now_ms()),
            Fault::StandbyAway { .. } => self.pg.standby_back(),
            Fault::Failover { orderly, .. } => self.fail_over(sim, *orderly, start),
            Fault::Hostile { per_sec, keyed, .. } => {
                self.hostile.retain(|h| h.0 != index);
                if start {
                    let per_step = (per_sec * STEP.as_secs_f64()).min(1.0);
                    self.hostile
                        .push((index, per_step, fault.hostile_kinds(), *keyed));
                }
            }
        }
    }

    /// A failover begun (the primary crashes, or turns read-only in
    /// place) or completed: the standby is promoted while the database
    /// host is down, so every session the clients open after is on the
    /// new primary.
    fn fail_over(&mut self, sim: &mut crate::engine::Sim, orderly: bool, start: bool) {
        match (orderly, start) {
            (true, true) => self.pg.set_read_only(true),
            (false, true) => {
                self.crash(sim, "pg");
            }
            (true, false) => {
                self.pg.shut_down_cleanly(crate::fakes::pg::now_ms());
                self.crash(sim, "pg");
                self.pg.set_read_only(false);
                self.pg.promote(crate::fakes::pg::now_ms());
                self.restart(sim, "pg");
            }
            (false, false) => {
                if self.crashed.contains("pg") {
                    self.pg.promote(crate::fakes::pg::now_ms());
                }
                self.restart(sim, "pg");
            }
        }
    }

    /// A black-hole or a partition between hosts, begun or healed.
    fn cut_links(&mut self, sim: &mut crate::engine::Sim, fault: &Fault, start: bool) {
        match fault {
            Fault::Blackhole { target, .. } => {
                for h in self.hosts(target) {
                    for node in self.mq.node_hosts() {
                        if start {
                            sim.hold(h.as_str(), node.as_str());
                        } else {
                            sim.release(h.as_str(), node.as_str());
                        }
                    }
                }
            }
            Fault::Partition { a, b, .. } => {
                for h in self.hosts(a) {
                    for other in self.hosts(b) {
                        if start {
                            sim.partition(h.as_str(), other.as_str());
                        } else {
                            sim.repair(h.as_str(), other.as_str());
                        }
                    }
                }
            }
            other => unreachable!("{other:?} cuts no link"),
        }
    }

    /// The fake services' own fault rates, set or cleared.
    fn set_service_faults(&mut self, fault: &Fault, start: bool) {
        match fault {
            Fault::Pg {
                lose_reply_prob,
                fail_prob,
                delay_ms,
                statements,
                ..
            } => {
                *self.pg.faults.lock().expect("faults") = if start {
                    PgFaults {
                        lose_reply_prob: *lose_reply_prob,
                        fail_prob: *fail_prob,
                        reply_delay: Duration::from_millis(*delay_ms),
                        statements: statements.clone(),
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
            other => unreachable!("{other:?} is no service's fault"),
        }
    }

    /// Sends the hostile messages this step draws.
    pub fn send_hostiles(&mut self) {
        for (_, per_step, kinds, keyed) in &self.hostile {
            if self.fault_rng.random_bool(*per_step) {
                let to = crate::fakes::mq::HostileTarget {
                    exchange: EXCHANGE,
                    queue: CONSUMER_QUEUE,
                    delivery_limit: self.delivery_limit,
                    keyed: *keyed,
                };
                self.mq.inject_hostile(&to, kinds);
            }
        }
    }

    /// Crashes the hosts whose crash point fired, to restart them soon.
    pub fn crash_requested(&mut self, sim: &mut crate::engine::Sim, now: Duration) {
        let requested: Vec<String> = self
            .hooks
            .iter()
            .filter(|(_, hooks)| hooks.take_crash_request())
            .map(|(host, _)| host.clone())
            .collect();
        for host in requested {
            if self.crash(sim, &host) {
                self.restarts.push((now + CRASH_RESTART_AFTER, host));
            }
        }
    }

    /// Restarts the crash-point crashes that are due.
    pub fn restart_due(&mut self, sim: &mut crate::engine::Sim, now: Duration) {
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.restarts)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.restarts = later;
        for (_, host) in due {
            self.restart(sim, &host);
        }
    }

    /// Ends every fault still active (`active` are their indexes), restarts
    /// crashed hosts, and has the operator unpark what parked.
    pub fn heal(&mut self, sim: &mut crate::engine::Sim, faults: &[Fault], active: &[usize]) {
        self.trace.now(Event::Heal);
        for &i in active {
            self.apply(sim, i, &faults[i], false);
        }
        self.pg.set_read_only(false);
        self.pg.standby_back();
        self.downstream_broken.store(false, Ordering::SeqCst);
        self.domain_locked.store(false, Ordering::SeqCst);
        self.pg.set_domain_lock(false);
        self.healed.store(true, Ordering::SeqCst);
        for (_, hooks) in &self.hooks {
            hooks.clear();
        }
        *self.pg.faults.lock().expect("faults") = PgFaults::default();
        *self.mq.faults.lock().expect("faults") = MqFaults::default();
        self.hostile.clear();
        self.restarts.clear();
        for host in std::mem::take(&mut self.crashed) {
            self.crashed.insert(host.clone());
            self.restart(sim, &host);
        }
        self.pg.operator_unpark_all();
    }
}
