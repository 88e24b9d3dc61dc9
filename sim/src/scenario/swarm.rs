//! Swarm testing: each seed turns each listed fault family on with
//! probability one half and draws its occurrences (when, where, how long),
//! so a sweep explores fault combinations no one wrote down.

use rand::Rng;
use rand::rngs::SmallRng;
use serde::Deserialize;

use super::fault::Fault;
use crate::adapters::Point;

/// The swarm section of a scenario.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Swarm {
    /// Fault families to draw from.
    pub families: Vec<Family>,
    /// Most occurrences of one family in a run.
    #[serde(default = "three")]
    pub max_occurrences: u32,
}

fn three() -> u32 {
    3
}

/// A family of faults a swarm draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// A drainer's link to the broker black-holes.
    Blackhole,
    /// A drainer is cut off from the broker.
    PartitionRabbit,
    /// A drainer is cut off from the database.
    PartitionPg,
    /// A drainer crashes and restarts.
    Crash,
    /// Drainers crash at a phase boundary.
    CrashPoint,
    /// Drainers stall before marking.
    Pause,
    /// Statements fail at random.
    Pg,
    /// The broker drops connections.
    MqDrop,
    /// Confirms arrive late.
    ConfirmDelay,
    /// A consumer crashes and restarts.
    ConsumerCrash,
    /// Consumers crash after commit or mid-handler.
    ConsumerCrashPoint,
    /// A consumer is cut off from the broker or the database.
    ConsumerPartition,
    /// The broker delivers some messages twice.
    DuplicateDelivery,
    /// The consumers' downstream refuses poison events.
    Downstream,
    /// The broker delivers hostile messages.
    Hostile,
    /// Another session locks the consumers' domain table.
    DomainLock,
    /// A broker node crashes and restarts.
    NodeCrash,
    /// A broker node is cut off from the other nodes and from clients.
    NodePartition,
    /// Quorum queues lose their leaders and elect slowly.
    LeaderElection,
}

/// Where and when one occurrence happens.
struct Draw {
    at: f64,
    len: f64,
    drainer: String,
    /// Consumer hosts to pick from.
    consumers: u32,
    /// Broker nodes to pick from.
    nodes: u32,
}

impl Draw {
    fn consumer(&self, rng: &mut SmallRng) -> String {
        format!("consumer-{}", rng.random_range(1..=self.consumers.max(1)))
    }

    fn node(&self, rng: &mut SmallRng) -> u32 {
        rng.random_range(1..=self.nodes.max(1))
    }
}

impl Family {
    /// Whether it needs a broker cluster (three nodes or more).
    pub fn needs_cluster(self) -> bool {
        matches!(
            self,
            Family::NodeCrash | Family::NodePartition | Family::LeaderElection
        )
    }

    /// Whether it needs consumer hosts.
    pub fn needs_consumers(self) -> bool {
        matches!(
            self,
            Family::ConsumerCrash
                | Family::ConsumerCrashPoint
                | Family::ConsumerPartition
                | Family::DuplicateDelivery
                | Family::Downstream
                | Family::Hostile
                | Family::DomainLock
        )
    }

    fn fault(self, d: Draw, rng: &mut SmallRng) -> Fault {
        match self {
            Family::Blackhole
            | Family::PartitionRabbit
            | Family::PartitionPg
            | Family::Crash
            | Family::ConsumerCrash
            | Family::ConsumerPartition => self.host_fault(d, rng),
            Family::CrashPoint | Family::ConsumerCrashPoint | Family::Pause => {
                self.point_fault(d, rng)
            }
            Family::NodeCrash | Family::NodePartition | Family::LeaderElection => {
                self.node_fault(d, rng)
            }
            _ => self.service_fault(d, rng),
        }
    }

    /// A fault of one drainer or consumer host.
    fn host_fault(self, d: Draw, rng: &mut SmallRng) -> Fault {
        let (at_secs, for_secs) = (d.at, d.len);
        match self {
            Family::Blackhole => Fault::Blackhole {
                target: d.drainer,
                at_secs,
                for_secs,
            },
            Family::PartitionRabbit | Family::PartitionPg => Fault::Partition {
                a: d.drainer,
                b: if self == Family::PartitionPg {
                    "pg"
                } else {
                    "rabbit"
                }
                .into(),
                at_secs,
                for_secs,
            },
            Family::Crash => Fault::Crash {
                target: d.drainer,
                at_secs,
                restart_after_secs: for_secs,
            },
            Family::ConsumerCrash => Fault::Crash {
                target: d.consumer(rng),
                at_secs,
                restart_after_secs: for_secs,
            },
            Family::ConsumerPartition => Fault::Partition {
                a: d.consumer(rng),
                b: if rng.random_bool(0.5) { "rabbit" } else { "pg" }.into(),
                at_secs,
                for_secs,
            },
            other => unreachable!("{other:?} is no host's fault"),
        }
    }

    /// A crash or a pause at one point of the code.
    fn point_fault(self, d: Draw, rng: &mut SmallRng) -> Fault {
        let (at_secs, for_secs) = (d.at, d.len);
        match self {
            Family::CrashPoint | Family::ConsumerCrashPoint => {
                let points: &[Point] = if self == Family::CrashPoint {
                    &[
                        Point::AfterClaim,
                        Point::MidPublish,
                        Point::BeforeMark,
                        Point::MidMark,
                    ]
                } else {
                    &[Point::AfterCommit, Point::MidHandler]
                };
                Fault::CrashPoint {
                    point: points[rng.random_range(0..points.len())],
                    prob: 0.05,
                    at_secs,
                    for_secs,
                }
            }
            Family::Pause => Fault::Pause {
                point: Point::BeforeMark,
                prob: 0.1,
                ms: rng.random_range(1000..8000),
                at_secs,
                for_secs,
            },
            other => unreachable!("{other:?} is no point's fault"),
        }
    }

    /// A fault of one broker node, or of the cluster's elections.
    fn node_fault(self, d: Draw, rng: &mut SmallRng) -> Fault {
        let (at_secs, for_secs) = (d.at, d.len);
        match self {
            Family::NodeCrash => Fault::Crash {
                target: format!("rabbit-{}", d.node(rng)),
                at_secs,
                restart_after_secs: for_secs,
            },
            Family::NodePartition => Fault::NodePartition {
                node: d.node(rng),
                at_secs,
                for_secs,
            },
            Family::LeaderElection => Fault::LeaderElection {
                at_secs,
                // An election takes seconds, not the phase.
                for_secs: for_secs.min(4.0),
            },
            other => unreachable!("{other:?} is no node's fault"),
        }
    }

    /// A fault of a service as a whole: the database, the broker, the
    /// consumer's downstream, its domain's locks, hostile publishers.
    fn service_fault(self, d: Draw, rng: &mut SmallRng) -> Fault {
        let (at_secs, for_secs) = (d.at, d.len);
        match self {
            Family::Pg => Fault::Pg {
                lose_reply_prob: 0.02,
                fail_prob: 0.02,
                delay_ms: 0,
                statements: Vec::new(),
                at_secs,
                for_secs,
            },
            Family::MqDrop | Family::ConfirmDelay | Family::DuplicateDelivery => Fault::Mq {
                drop_conn_prob: if self == Family::MqDrop { 0.02 } else { 0.0 },
                confirm_delay_ms: if self == Family::ConfirmDelay {
                    rng.random_range(100..4000)
                } else {
                    0
                },
                nack_prefix: None,
                duplicate_prob: if self == Family::DuplicateDelivery {
                    0.2
                } else {
                    0.0
                },
                at_secs,
                for_secs,
            },
            Family::Downstream => Fault::Downstream { at_secs, for_secs },
            Family::DomainLock => Fault::DomainLock { at_secs, for_secs },
            Family::Hostile => Fault::Hostile {
                per_sec: 0.5,
                kinds: None,
                keyed: 0.0,
                at_secs,
                for_secs,
            },
            other => unreachable!("{other:?} is no service's fault"),
        }
    }
}

impl Swarm {
    /// Draws this seed's faults within a fault phase of `phase` seconds.
    pub fn draw(
        &self,
        rng: &mut SmallRng,
        phase: f64,
        drainers: u32,
        consumers: u32,
        nodes: u32,
    ) -> Vec<Fault> {
        let mut out = Vec::new();
        for family in &self.families {
            if !rng.random_bool(0.5) {
                continue;
            }
            let n = rng.random_range(1..=self.max_occurrences.max(1));
            for _ in 0..n {
                let len = rng.random_range(0.5..(phase / 3.0).max(1.0));
                let at = rng.random_range(0.0..(phase - len).max(0.1));
                let drainer = format!("drainer-{}", rng.random_range(1..=drainers));
                let draw = Draw {
                    at,
                    len,
                    drainer,
                    consumers,
                    nodes,
                };
                out.push(family.fault(draw, rng));
            }
        }
        out
    }
}
