//! The fault schedule: drawn from the seed before the run and printed, so a
//! run is described by its command line.
//!
//! The run's production window is cut into one slot per fault, and each
//! fault starts at a seeded instant in the first half of its slot, so
//! faults rarely overlap and recovery from one is part of the run. The
//! kinds come in a rotation that starts with a RabbitMQ restart, a
//! PostgreSQL restart, a drainer whose marks stall in the database past its
//! lease (they land after another replica took its rows over: the
//! `claimed_by` guard's case, #478) and a subscriber killed mid-batch,
//! then the other kinds in a seeded order: any run of two faults or more
//! restarts both services, of four or more has all four.
//!
//! On a cluster (`chaos run --cluster`) node faults take the broker
//! restart's place: a node's Erlang VM SIGKILLed (started again after), a
//! node's app stopped (`stop_app`, `start_app` after) and a node cut off
//! from the other nodes and from every client; each comes twice in the
//! rotation, so six of its sixteen kinds are node faults and a run of 30
//! faults has at least ten; the rotation starts with the three of them and
//! a PostgreSQL restart, so a run of four faults has each.

use std::time::Duration;

use super::{LEASE_TTL, Rng};

/// Which service a link fault is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Service {
    /// PostgreSQL.
    Postgres,
    /// RabbitMQ.
    Rabbit,
}

impl Service {
    /// Its short name, as proxies are named (`drainer-1/pg`).
    pub fn name(self) -> &'static str {
        match self {
            Service::Postgres => "pg",
            Service::Rabbit => "rabbit",
        }
    }
}

/// One fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// SIGKILL a process, start it again after `restart_after`.
    Kill {
        target: String,
        restart_after: Duration,
    },
    /// SIGSTOP a drainer for `stopped` (past its lease), then SIGCONT: it
    /// wakes with claims another replica may have taken over.
    Pause { target: String, stopped: Duration },
    /// `rabbitmqctl close_all_connections`.
    CloseAllConnections,
    /// `rabbitmqctl stop_app`, `down` later `start_app`.
    RestartBroker { down: Duration },
    /// A PostgreSQL crash and restart (`pg_ctlcluster -m immediate ...
    /// restart`: no checkpoint, crash recovery at start, so the drainers'
    /// asynchronous commits the WAL writer had not flushed are lost).
    RestartPostgres,
    /// `pg_terminate_backend` of every session of the run's databases.
    TerminateBackends,
    /// The proxy between `target` and `service` passes nothing for `held`
    /// (connections stay open, silent), then delivers what it held.
    Blackhole {
        target: String,
        service: Service,
        held: Duration,
    },
    /// The proxy between `target` and `service` drops every connection.
    Cut { target: String, service: Service },
    /// Every mark (`UPDATE ... SET published_at`) the drainer `target`
    /// sends waits in the database until `stalled` from now, past its
    /// lease, as on a session stuck on I/O or a lock: its claims and
    /// releases go on, other replicas reclaim its rows, and its marks land
    /// late (a trigger the run installs, keyed by the session's
    /// `application_name`).
    StallMarks { target: String, stalled: Duration },
    /// SIGKILL broker node `node`'s Erlang VM (1-based), start it again
    /// after `restart_after`.
    NodeKill { node: u16, restart_after: Duration },
    /// `rabbitmqctl -n rabbitN stop_app`, `down` later `start_app`.
    NodeStop { node: u16, down: Duration },
    /// Broker node `node` cut off from the other nodes (their
    /// distribution connections refused) and from every client (their
    /// proxies to it hold everything) for `cut`.
    NodePartition { node: u16, cut: Duration },
}

impl Fault {
    /// Its kind, as the report names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Kill { .. } => "kill",
            Fault::Pause { .. } => "sigstop",
            Fault::CloseAllConnections => "close_all_connections",
            Fault::RestartBroker { .. } => "rabbitmq_restart",
            Fault::RestartPostgres => "postgres_restart",
            Fault::TerminateBackends => "pg_terminate_backend",
            Fault::Blackhole { .. } => "blackhole",
            Fault::Cut { .. } => "cut",
            Fault::StallMarks { .. } => "stall_marks",
            Fault::NodeKill { .. } => "node_kill",
            Fault::NodeStop { .. } => "node_stop",
            Fault::NodePartition { .. } => "node_partition",
        }
    }

    /// Whether it is a fault of one broker node.
    pub fn is_node_fault(&self) -> bool {
        matches!(
            self,
            Fault::NodeKill { .. } | Fault::NodeStop { .. } | Fault::NodePartition { .. }
        )
    }

    /// How long the fault lasts once injected (zero for an instant one).
    pub fn lasts(&self) -> Duration {
        match self {
            Fault::Kill { restart_after, .. } => *restart_after,
            Fault::Pause { stopped, .. } => *stopped,
            Fault::RestartBroker { down } => *down,
            Fault::Blackhole { held, .. } => *held,
            Fault::StallMarks { stalled, .. } => *stalled,
            Fault::NodeKill { restart_after, .. } => *restart_after,
            Fault::NodeStop { down, .. } => *down,
            Fault::NodePartition { cut, .. } => *cut,
            _ => Duration::ZERO,
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |d: &Duration| format!("{:.1} s", d.as_secs_f64());
        match self {
            Fault::Kill {
                target,
                restart_after,
            } => write!(f, "SIGKILL {target}, restart after {}", s(restart_after)),
            Fault::Pause { target, stopped } => {
                write!(f, "SIGSTOP {target} for {}, then SIGCONT", s(stopped))
            }
            Fault::CloseAllConnections => f.write_str("rabbitmqctl close_all_connections"),
            Fault::RestartBroker { down } => {
                write!(f, "rabbitmqctl stop_app, start_app {} later", s(down))
            }
            Fault::RestartPostgres => f.write_str("PostgreSQL crash (immediate stop) and restart"),
            Fault::TerminateBackends => f.write_str("pg_terminate_backend of the run's sessions"),
            Fault::Blackhole {
                target,
                service,
                held,
            } => write!(
                f,
                "black-hole {target} <-> {} for {}",
                service.name(),
                s(held)
            ),
            Fault::Cut { target, service } => {
                write!(f, "cut {target} <-> {}", service.name())
            }
            Fault::StallMarks { target, stalled } => {
                write!(
                    f,
                    "{target}'s marks stall in the database for {}",
                    s(stalled)
                )
            }
            Fault::NodeKill {
                node,
                restart_after,
            } => write!(
                f,
                "SIGKILL broker node rabbit{node}, restart after {}",
                s(restart_after)
            ),
            Fault::NodeStop { node, down } => write!(
                f,
                "rabbitmqctl -n rabbit{node} stop_app, start_app {} later",
                s(down)
            ),
            Fault::NodePartition { node, cut } => write!(
                f,
                "broker node rabbit{node} cut off from the other nodes and every client for {}",
                s(cut)
            ),
        }
    }
}

/// A fault and when it starts, from the start of production.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub at: Duration,
    pub fault: Fault,
}

/// The kinds that lead a single node's rotation, in this order.
const LEAD: [&str; 4] = [
    "rabbitmq_restart",
    "postgres_restart",
    "stall_marks",
    "kill_subscriber",
];

/// The kinds every rotation shuffles after its leaders.
const SHUFFLED: [&str; 7] = [
    "stall_drainer_db",
    "kill_drainer",
    "sigstop",
    "close_all_connections",
    "blackhole",
    "cut",
    "pg_terminate_backend",
];

/// The kinds that lead a cluster's rotation: the three node faults and a
/// PostgreSQL restart (a short run has them all; the broker restart's
/// place is theirs).
const CLUSTER_LEAD: [&str; 4] = [
    "node_partition",
    "node_kill",
    "postgres_restart",
    "node_stop",
];

/// What a cluster's rotation shuffles besides [`SHUFFLED`]: the single
/// node's other leaders, and each node fault a second time.
const CLUSTER_SHUFFLED: [&str; 5] = [
    "stall_marks",
    "kill_subscriber",
    "node_kill",
    "node_stop",
    "node_partition",
];

/// `count` faults over `window`, on the processes `drainers` and
/// `subscribers`, and on the broker's `nodes` (node faults only when there
/// are three or more).
pub fn plan(
    seed: u64,
    count: usize,
    window: Duration,
    (drainers, subscribers): (&[String], &[String]),
    nodes: u16,
) -> Vec<Planned> {
    let mut rng = Rng::new(seed, "chaos faults");
    let rotation = rotation(&mut rng, nodes);
    let slot = window / count.max(1) as u32;
    let mut planned = Vec::with_capacity(count);
    for i in 0..count {
        let at = slot * i as u32 + slot.mul_f64(0.5 * rng.unit());
        let name = rotation[i % rotation.len()];
        let fault = fault_named(name, &mut rng, (drainers, subscribers), nodes);
        planned.push(Planned { at, fault });
    }
    planned
}

/// The faults' order: the lead ones first, then the rest shuffled.
fn rotation(rng: &mut Rng, nodes: u16) -> Vec<&'static str> {
    let (lead, extra): (&[&str], &[&str]) = if nodes >= 3 {
        (&CLUSTER_LEAD, &CLUSTER_SHUFFLED)
    } else {
        (&LEAD, &[])
    };
    let mut rest: Vec<&str> = extra.iter().chain(&SHUFFLED).copied().collect();
    for i in (1..rest.len()).rev() {
        rest.swap(i, rng.below(i as u64 + 1) as usize);
    }
    lead.iter().copied().chain(rest).collect()
}

/// The fault `name`, its target and length drawn.
fn fault_named(
    name: &str,
    rng: &mut Rng,
    (drainers, subscribers): (&[String], &[String]),
    nodes: u16,
) -> Fault {
    let node = |rng: &mut Rng| 1 + rng.below(u64::from(nodes.max(1))) as u16;
    let pick = |rng: &mut Rng, from: &[String]| from[rng.below(from.len() as u64) as usize].clone();
    let everyone: Vec<String> = drainers.iter().chain(subscribers).cloned().collect();
    let either_service = |rng: &mut Rng| {
        if rng.below(2) == 0 {
            Service::Postgres
        } else {
            Service::Rabbit
        }
    };
    match name {
        "rabbitmq_restart" => Fault::RestartBroker {
            down: rng.between(Duration::from_secs(2), Duration::from_secs(5)),
        },
        "postgres_restart" => Fault::RestartPostgres,
        "kill_drainer" => Fault::Kill {
            target: pick(rng, drainers),
            restart_after: rng.between(Duration::from_secs(1), Duration::from_secs(4)),
        },
        "kill_subscriber" => Fault::Kill {
            target: pick(rng, subscribers),
            restart_after: rng.between(Duration::from_secs(1), Duration::from_secs(4)),
        },
        "stall_drainer_db" => Fault::Blackhole {
            target: pick(rng, drainers),
            service: Service::Postgres,
            held: LEASE_TTL + rng.between(Duration::from_secs(2), Duration::from_secs(6)),
        },
        "stall_marks" => Fault::StallMarks {
            target: pick(rng, drainers),
            stalled: LEASE_TTL + rng.between(Duration::from_secs(2), Duration::from_secs(6)),
        },
        "sigstop" => Fault::Pause {
            target: pick(rng, drainers),
            stopped: LEASE_TTL + rng.between(Duration::from_secs(2), Duration::from_secs(6)),
        },
        "close_all_connections" => Fault::CloseAllConnections,
        "node_kill" => Fault::NodeKill {
            node: node(rng),
            restart_after: rng.between(Duration::from_secs(1), Duration::from_secs(5)),
        },
        "node_stop" => Fault::NodeStop {
            node: node(rng),
            down: rng.between(Duration::from_secs(2), Duration::from_secs(6)),
        },
        "node_partition" => Fault::NodePartition {
            node: node(rng),
            cut: rng.between(Duration::from_secs(4), Duration::from_secs(10)),
        },
        "blackhole" => Fault::Blackhole {
            target: pick(rng, &everyone),
            service: either_service(rng),
            held: rng.between(Duration::from_secs(3), Duration::from_secs(9)),
        },
        "cut" => Fault::Cut {
            target: pick(rng, &everyone),
            service: either_service(rng),
        },
        _ => Fault::TerminateBackends,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(prefix: &str, n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("{prefix}-{i}")).collect()
    }

    #[test]
    fn two_faults_or_more_restart_both_services_and_the_plan_is_the_seeds() {
        let (d, s) = (names("drainer", 3), names("billing", 2));
        let a = plan(7, 8, Duration::from_secs(60), (&d, &s), 1);
        assert_eq!(a, plan(7, 8, Duration::from_secs(60), (&d, &s), 1));
        assert_ne!(a, plan(8, 8, Duration::from_secs(60), (&d, &s), 1));
        let kinds: Vec<&str> = a.iter().map(|p| p.fault.kind()).collect();
        assert!(kinds.contains(&"rabbitmq_restart") && kinds.contains(&"postgres_restart"));
        assert!(a.windows(2).all(|w| w[0].at < w[1].at), "in time order");
        assert!(a.iter().all(|p| p.at < Duration::from_secs(60)));
        let stall = a.iter().any(|p| matches!(&p.fault, Fault::StallMarks { target, stalled } if target.starts_with("drainer-") && *stalled > LEASE_TTL));
        assert!(stall, "a drainer's marks stall past its lease");
        let all = plan(3, 20, Duration::from_secs(60), (&d, &s), 1);
        assert!(
            all.iter().all(|p| !p.fault.is_node_fault()),
            "one node: no node faults"
        );
        for kind in [
            "kill",
            "sigstop",
            "close_all_connections",
            "blackhole",
            "cut",
            "pg_terminate_backend",
            "stall_marks",
        ] {
            assert!(
                all.iter().any(|p| p.fault.kind() == kind),
                "{kind} in two rounds"
            );
        }
    }

    #[test]
    fn on_a_cluster_a_third_of_the_faults_are_node_faults_of_every_kind() {
        let (d, s) = (names("drainer", 3), names("billing", 2));
        for seed in 0..20 {
            let p = plan(seed, 30, Duration::from_secs(60), (&d, &s), 3);
            let node: Vec<&Fault> = p
                .iter()
                .map(|p| &p.fault)
                .filter(|f| f.is_node_fault())
                .collect();
            assert!(node.len() >= 10, "seed {seed}: {} node faults", node.len());
            for kind in ["node_kill", "node_stop", "node_partition"] {
                assert!(node.iter().any(|f| f.kind() == kind), "{kind}");
            }
            assert!(p.iter().all(|p| p.fault.kind() != "rabbitmq_restart"));
            let first: Vec<&str> = plan(seed, 4, Duration::from_secs(20), (&d, &s), 3)
                .iter()
                .map(|p| p.fault.kind())
                .collect();
            assert_eq!(
                first,
                [
                    "node_partition",
                    "node_kill",
                    "postgres_restart",
                    "node_stop"
                ]
            );
            assert!(node.iter().all(|f| match f {
                Fault::NodeKill { node, .. }
                | Fault::NodeStop { node, .. }
                | Fault::NodePartition { node, .. } => (1..=3).contains(node),
                _ => false,
            }));
        }
    }

    #[test]
    fn a_paused_drainer_sleeps_past_its_lease() {
        let (d, s) = (names("drainer", 3), names("billing", 2));
        for p in plan(11, 27, Duration::from_secs(90), (&d, &s), 3) {
            if let Fault::Pause { stopped, target } = p.fault {
                assert!(stopped > LEASE_TTL && target.starts_with("drainer-"));
            }
        }
    }
}
