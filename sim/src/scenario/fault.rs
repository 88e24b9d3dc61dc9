//! Timed faults: what a scenario file's `[[fault]]` tables say, each with
//! its window in the fault phase.

use serde::{Deserialize, Serialize};

use crate::adapters::Point;
use crate::trace::{FaultKind, HostileKind};

/// One timed fault.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// Hold the links between `target` and `rabbit`: bytes stop, sockets stay.
    Blackhole {
        target: String,
        at_secs: f64,
        for_secs: f64,
    },
    /// Drop everything between `a` and `b` (connections die silently).
    Partition {
        a: String,
        b: String,
        at_secs: f64,
        for_secs: f64,
    },
    /// Cut broker node `node` (1-based, of `rabbit-1..K`) off from the
    /// other nodes and from every client.
    NodePartition {
        node: u32,
        at_secs: f64,
        for_secs: f64,
    },
    /// Every quorum queue's leader steps down, and no election ends before
    /// the window does (an election in the middle of confirms).
    LeaderElection { at_secs: f64, for_secs: f64 },
    /// Crash `target` (a client host, or a broker node `rabbit-N`);
    /// restart it `restart_after_secs` later.
    Crash {
        target: String,
        at_secs: f64,
        restart_after_secs: f64,
    },
    /// Every host crashes at `point` with probability `prob` while active.
    CrashPoint {
        point: Point,
        prob: f64,
        at_secs: f64,
        for_secs: f64,
    },
    /// Every host pauses `ms` at `point` with probability `prob`.
    Pause {
        point: Point,
        prob: f64,
        ms: u64,
        at_secs: f64,
        for_secs: f64,
    },
    /// Store faults.
    Pg {
        #[serde(default)]
        lose_reply_prob: f64,
        #[serde(default)]
        fail_prob: f64,
        /// Every reply waits this long (a database stalled on I/O or
        /// locks).
        #[serde(default, skip_serializing_if = "is_zero")]
        delay_ms: u64,
        /// Only these statements fail or lose their reply (by the fake's
        /// names: `inbox_check`, `commit`, …); every statement if empty.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        statements: Vec<String>,
        at_secs: f64,
        for_secs: f64,
    },
    /// The database's standby stops receiving the WAL; it streams again
    /// (and catches up) when the window ends, unless a failover promoted
    /// it meanwhile.
    StandbyAway { at_secs: f64, for_secs: f64 },
    /// The database fails over to its standby. Unless `orderly`, the
    /// primary crashes and the standby is promoted `for_secs` later with
    /// what it holds (a standby that fell away lacks every commit since);
    /// `orderly`, the primary turns read-only in place (every write fails
    /// with 25006) for `for_secs`, then the caught-up standby is promoted.
    Failover {
        at_secs: f64,
        for_secs: f64,
        #[serde(default)]
        orderly: bool,
    },
    /// Broker faults.
    Mq {
        #[serde(default)]
        drop_conn_prob: f64,
        #[serde(default)]
        confirm_delay_ms: u64,
        #[serde(default)]
        nack_prefix: Option<String>,
        /// Per delivery, the broker also keeps a redelivered copy.
        #[serde(default)]
        duplicate_prob: f64,
        at_secs: f64,
        for_secs: f64,
    },
    /// The consumers' downstream refuses every `poison.` event: their
    /// handlers fail until it heals, so those deliveries dead-letter; the
    /// operator replays them after the heal.
    Downstream { at_secs: f64, for_secs: f64 },
    /// Another session holds the handler's domain table locked (`LOCK
    /// TABLE … IN SHARE MODE`): every handler's write waits past its
    /// deadline, the database answering all along. The overruns are the
    /// handlers' (they count attempts); the waiting statements must end at
    /// the server when the subscriber gives up on them.
    DomainLock { at_secs: f64, for_secs: f64 },
    /// The broker delivers hostile messages to the subscription, about
    /// `per_sec` a second, of the listed kinds (all kinds if none listed).
    /// A share `keyed` of them (none unless set; an ordered subscription
    /// only) carry an ordering key of a foreign publisher's and the key's
    /// next number, as the drainer's keyed events do.
    Hostile {
        per_sec: f64,
        #[serde(default)]
        kinds: Option<Vec<HostileKind>>,
        #[serde(default)]
        keyed: f64,
        at_secs: f64,
        for_secs: f64,
    },
}

impl Fault {
    /// When it starts and how long it lasts (crashes last until restart).
    pub fn window(&self) -> (f64, f64) {
        match self {
            Fault::Blackhole {
                at_secs, for_secs, ..
            }
            | Fault::Partition {
                at_secs, for_secs, ..
            }
            | Fault::NodePartition {
                at_secs, for_secs, ..
            }
            | Fault::LeaderElection { at_secs, for_secs }
            | Fault::CrashPoint {
                at_secs, for_secs, ..
            }
            | Fault::Pause {
                at_secs, for_secs, ..
            }
            | Fault::Pg {
                at_secs, for_secs, ..
            }
            | Fault::Mq {
                at_secs, for_secs, ..
            }
            | Fault::Hostile {
                at_secs, for_secs, ..
            }
            | Fault::Downstream { at_secs, for_secs }
            | Fault::StandbyAway { at_secs, for_secs }
            | Fault::Failover {
                at_secs, for_secs, ..
            }
            | Fault::DomainLock { at_secs, for_secs } => (*at_secs, *for_secs),
            Fault::Crash {
                at_secs,
                restart_after_secs,
                ..
            } => (*at_secs, *restart_after_secs),
        }
    }

    /// What kind of fault it is, for the sweep's fault table.
    /// Sets how long the fault lasts (a crash: how long the host stays down).
    pub fn set_len(&mut self, len: f64) {
        match self {
            Fault::Blackhole { for_secs, .. }
            | Fault::Partition { for_secs, .. }
            | Fault::NodePartition { for_secs, .. }
            | Fault::LeaderElection { for_secs, .. }
            | Fault::CrashPoint { for_secs, .. }
            | Fault::Pause { for_secs, .. }
            | Fault::Pg { for_secs, .. }
            | Fault::Mq { for_secs, .. }
            | Fault::Hostile { for_secs, .. }
            | Fault::Downstream { for_secs, .. }
            | Fault::StandbyAway { for_secs, .. }
            | Fault::Failover { for_secs, .. }
            | Fault::DomainLock { for_secs, .. } => *for_secs = len,
            Fault::Crash {
                restart_after_secs, ..
            } => *restart_after_secs = len,
        }
    }

    pub fn kind(&self) -> FaultKind {
        match self {
            Fault::Blackhole { .. } => FaultKind::Blackhole,
            Fault::Partition { .. } => FaultKind::Partition,
            Fault::NodePartition { .. } => FaultKind::NodePartition,
            Fault::LeaderElection { .. } => FaultKind::LeaderElection,
            Fault::Crash { target, .. } if target.starts_with("rabbit") => FaultKind::NodeCrash,
            Fault::Crash { .. } => FaultKind::Crash,
            Fault::CrashPoint { .. } => FaultKind::CrashPoint,
            Fault::Pause { .. } => FaultKind::Pause,
            Fault::Pg {
                lose_reply_prob, ..
            } if *lose_reply_prob > 0.0 => FaultKind::PgReplyLost,
            Fault::Pg { delay_ms, .. } if *delay_ms > 0 => FaultKind::PgSlow,
            Fault::Pg { .. } => FaultKind::PgFailure,
            Fault::Mq {
                confirm_delay_ms, ..
            } if *confirm_delay_ms > 0 => FaultKind::ConfirmDelay,
            Fault::Mq { nack_prefix, .. } if nack_prefix.is_some() => FaultKind::MqNack,
            Fault::Mq { duplicate_prob, .. } if *duplicate_prob > 0.0 => {
                FaultKind::DuplicateDelivery
            }
            Fault::Mq { .. } => FaultKind::MqDrop,
            Fault::Downstream { .. } => FaultKind::Downstream,
            Fault::DomainLock { .. } => FaultKind::DomainLock,
            Fault::Hostile { .. } => FaultKind::Hostile,
            Fault::StandbyAway { .. } => FaultKind::StandbyAway,
            Fault::Failover { orderly: true, .. } => FaultKind::Switchover,
            Fault::Failover { .. } => FaultKind::Failover,
        }
    }

    /// The hostile kinds it sends (none for other faults).
    pub fn hostile_kinds(&self) -> Vec<HostileKind> {
        match self {
            Fault::Hostile { kinds: Some(k), .. } => k.clone(),
            Fault::Hostile { kinds: None, .. } => HostileKind::ALL.to_vec(),
            _ => Vec::new(),
        }
    }

    /// Checks values a file could get wrong.
    pub fn check(&self) -> Result<(), String> {
        let prob = |p: f64| (0.0..=1.0).contains(&p);
        let ok = match self {
            Fault::CrashPoint { prob: p, .. } | Fault::Pause { prob: p, .. } => prob(*p),
            Fault::Pg {
                lose_reply_prob,
                fail_prob,
                statements,
                ..
            } => {
                prob(*lose_reply_prob)
                    && prob(*fail_prob)
                    && statements
                        .iter()
                        .all(|s| crate::fakes::pg::STATEMENT_NAMES.contains(&s.as_str()))
            }
            Fault::Mq {
                drop_conn_prob,
                duplicate_prob,
                ..
            } => prob(*drop_conn_prob) && prob(*duplicate_prob),
            Fault::Hostile {
                per_sec,
                kinds,
                keyed,
                ..
            } => *per_sec > 0.0 && kinds.as_ref().is_none_or(|k| !k.is_empty()) && prob(*keyed),
            _ => true,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "fault {self:?}: probabilities must be within [0, 1], rates > 0, kinds non-empty"
            ))
        }
    }
}

impl Fault {
    /// Checks that a broker node the fault names exists among `nodes`
    /// (`rabbit` for one node, `rabbit-1..K` for a cluster).
    pub fn check_nodes(&self, nodes: u32) -> Result<(), String> {
        let names = crate::fakes::mq::node_hosts(nodes as usize);
        let ok = match self {
            Fault::NodePartition { node, .. } => nodes > 1 && (1..=nodes).contains(node),
            Fault::Crash { target, .. } | Fault::Blackhole { target, .. }
                if target.starts_with("rabbit") =>
            {
                names.contains(target)
            }
            Fault::Partition { a, b, .. } => [a, b]
                .iter()
                .filter(|h| h.starts_with("rabbit"))
                .all(|h| *h == "rabbit" || names.contains(h)),
            _ => true,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "fault {self:?} names a broker node that is not one of {names:?}"
            ))
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
