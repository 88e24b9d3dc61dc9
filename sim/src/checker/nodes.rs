//! Broker clients and their node lists: a client given a list of the
//! cluster's nodes starts at the node it was assigned (so that clients
//! spread over the nodes, and a node late in the list is tried at all),
//! unless that node is down or cut off when it first connects. Judged from
//! the fake RabbitMQ's side: the node that accepted the connection.

use std::collections::{BTreeMap, BTreeSet};

use super::{Context, Findings, Invariant};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    // Each client's assigned node, until its first connection.
    let mut assigned: BTreeMap<&str, &str> = BTreeMap::new();
    // Faults under way (a node crashed, partitioned, a link cut, …): any
    // of them may be why the assigned node did not answer.
    let mut active: BTreeMap<String, usize> = BTreeMap::new();
    let mut down: BTreeSet<&str> = BTreeSet::new();
    for (at, e) in ctx.events {
        match e {
            Event::FaultStart { kind, .. } => *active.entry(format!("{kind:?}")).or_default() += 1,
            Event::FaultEnd { kind } => {
                if let Some(n) = active.get_mut(&format!("{kind:?}")) {
                    *n = n.saturating_sub(1);
                }
            }
            Event::Host { host, up } => {
                if *up {
                    down.remove(host.as_str());
                } else {
                    down.insert(host);
                }
            }
            Event::BrokerAssigned { client, node } => {
                assigned.insert(client, node);
            }
            Event::MqConnected { client, node } => {
                let Some(first) = assigned.remove(client.as_str()) else {
                    continue;
                };
                let excused = down.contains(first) || active.values().any(|n| *n > 0);
                if node != first && !excused {
                    out.add(
                        Invariant::StartsAtAssignedNode,
                        Some(*at),
                        format!(
                            "{client} was assigned {first} and first connected to {node}, \
                             with {first} up and no fault under way"
                        ),
                    );
                }
            }
            _ => {}
        }
    }
}
