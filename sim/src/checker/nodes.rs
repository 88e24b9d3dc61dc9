//! Broker clients and their node lists: a client given a list of the
//! cluster's nodes tries first the node it was assigned (so that clients
//! spread over the nodes, and a node late in the list is tried at all),
//! whatever answers; and a subscription's client whose node falls silent
//! (cut off from everyone, its connections left open) is connected to
//! another node within the heartbeat's bound. The tries are the client's
//! own record (`BrokerConnecting`); the connections are judged from the
//! fake RabbitMQ's side, by the node that accepted each one.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Context, Findings, Invariant};
use crate::trace::{Event, FaultKind};

/// How long after its node falls silent a client is connected elsewhere:
/// the heartbeat's timeout, and a reconnection.
pub const SILENT_NODE_BOUND: Duration =
    Duration::from_millis(crate::wire::HEARTBEAT_TIMEOUT.as_millis() as u64 + 500);

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    starts_at_assigned_node(ctx, out);
    leaves_a_silent_node(ctx, out);
}

/// Each client connected to a node when it falls silent (a
/// `node_partition`) is connected to another node within
/// [`SILENT_NODE_BOUND`], unless the node speaks again first, the client's
/// host goes down, or another fault is under way (another node may be out
/// of reach too).
fn leaves_a_silent_node(ctx: &Context<'_>, out: &mut Findings) {
    let mut current: BTreeMap<&str, &str> = BTreeMap::new();
    let mut active = 0usize;
    // The silent node, and each of its clients' deadline.
    let mut silent: Option<String> = None;
    let mut due: BTreeMap<&str, Duration> = BTreeMap::new();
    for (at, e) in ctx.events {
        due.retain(|client, by| {
            if *at <= *by {
                return true;
            }
            out.add(
                Invariant::LeavesASilentNode,
                Some(*by),
                format!(
                    "{client} was still on {} {:.3}s after it fell silent",
                    silent.as_deref().unwrap_or("?"),
                    SILENT_NODE_BOUND.as_secs_f64()
                ),
            );
            false
        });
        match e {
            Event::MqConnected { client, node } => {
                current.insert(client, node);
                if silent.as_deref() != Some(node.as_str()) {
                    due.remove(client.as_str());
                }
            }
            Event::FaultStart { kind, detail } => {
                let node = detail
                    .split("node: ")
                    .nth(1)
                    .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                    .map(|n| format!("rabbit-{n}"));
                match (kind, node) {
                    (FaultKind::NodePartition, Some(node)) if active == 0 => {
                        // A subscription's clients: a drainer connects
                        // when it next publishes (its batch's deadline
                        // bounds that).
                        for (client, on) in &current {
                            if *on == node && client.starts_with("consumer-") {
                                due.insert(client, *at + SILENT_NODE_BOUND);
                            }
                        }
                        silent = Some(node);
                    }
                    _ => due.clear(),
                }
                active += 1;
            }
            Event::FaultEnd { .. } => {
                active = active.saturating_sub(1);
                due.clear();
                silent = None;
            }
            Event::Host { host, up: false } => {
                due.retain(|client, _| super::host_of(client) != host);
            }
            _ => {}
        }
    }
}

fn starts_at_assigned_node(ctx: &Context<'_>, out: &mut Findings) {
    // Each client's assigned node, until its first try.
    let mut assigned: BTreeMap<&str, &str> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::BrokerAssigned { client, node } => {
                assigned.insert(client, node);
            }
            Event::BrokerConnecting { client, node } => {
                let Some(first) = assigned.remove(client.as_str()) else {
                    continue;
                };
                if node != first {
                    out.add(
                        Invariant::StartsAtAssignedNode,
                        Some(*at),
                        format!("{client} was assigned {first} and tried {node} first"),
                    );
                }
            }
            _ => {}
        }
    }
}
