//! Leases (#478): a mark or a release changes only rows whose lease the
//! marking replica holds (the `claimed_by` guard), so a stale replica whose
//! lease was taken over changes nothing; a replica publishes only rows it
//! holds, each with the envelope id as AMQP `message_id` (so a duplicate is
//! recognisable end to end), and in claim order (`enqueued_at`, id), batch
//! after batch, as the ADR says the drainer publishes.

use std::collections::{BTreeMap, VecDeque};

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::{Call, Event};

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    guard(ctx, out);
    publishes(ctx, out);
    pipeline_depth(ctx, out);
}

/// #478: a replica has at most `pipeline_depth` publishes unconfirmed at
/// once, overlapping batches included. A publish stops counting when its
/// confirm reaches the replica, or when the replica settles its row without
/// it (a mark or a release: it gave up on that confirm).
fn pipeline_depth(ctx: &Context<'_>, out: &mut Findings) {
    let depth = ctx.limits.pipeline_depth as usize;
    let mut unconfirmed: BTreeMap<&str, std::collections::BTreeSet<Uuid>> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::PublishSent {
                client, message_id, ..
            } => {
                let set = unconfirmed.entry(client.as_str()).or_default();
                set.insert(*message_id);
                if set.len() > depth {
                    out.add(
                        Invariant::PipelineDepth,
                        Some(*at),
                        format!(
                            "{client} has {} publishes unconfirmed; the depth is {depth}",
                            set.len()
                        ),
                    );
                }
            }
            Event::ConfirmReceived { client, message_id } => {
                if let Some(set) = unconfirmed.get_mut(client.as_str()) {
                    set.remove(message_id);
                }
            }
            Event::StoreCalled { replica, ids, .. } => {
                if let Some(set) = unconfirmed.get_mut(replica.as_str()) {
                    for id in ids {
                        set.remove(id);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The store's view: who holds each lease, and whether marks respect it.
fn guard(ctx: &Context<'_>, out: &mut Findings) {
    let mut owner: BTreeMap<Uuid, String> = BTreeMap::new();
    let mut check =
        |at, replica: &String, id: &Uuid, owner: &BTreeMap<Uuid, String>, what: &str| {
            if owner.get(id) != Some(replica) {
                out.add(
                    Invariant::ClaimedByGuard,
                    Some(at),
                    format!(
                        "{replica} {what} {id} while the lease was {:?}",
                        owner.get(id)
                    ),
                );
            }
        };
    for (at, e) in ctx.events {
        match e {
            Event::Claimed { replica, ids, .. } => {
                for id in ids {
                    owner.insert(*id, replica.clone());
                }
            }
            Event::MarkedPublished { replica, ids } => {
                for id in ids {
                    check(*at, replica, id, &owner, "marked");
                }
            }
            Event::MarkedFailed { replica, ids, .. } => {
                for id in ids {
                    check(*at, replica, id, &owner, "bumped");
                    owner.remove(id);
                }
            }
            Event::Released { replica, ids } => {
                for id in ids {
                    check(*at, replica, id, &owner, "released");
                    owner.remove(id);
                }
            }
            Event::LeasesRestored { owners } | Event::CommitsLost { leases: owners, .. } => {
                for (id, o) in owners {
                    match o {
                        Some(r) => owner.insert(*id, r.clone()),
                        None => owner.remove(id),
                    };
                }
            }
            Event::Unparked { ids } | Event::Skipped { ids } => {
                for id in ids {
                    owner.remove(id);
                }
            }
            _ => {}
        }
    }
}

/// One claim of a row as its replica received it: the batch number, the
/// row's position in it, and whether it was published yet. A replica can
/// hold a row twice: when its own lease expired while it stalled, its next
/// claim takes the row again.
#[derive(Debug, Clone, Copy)]
struct Held {
    pos: (u64, usize),
    published: bool,
}

/// The replica's view: what it holds (claims returned to it, not yet handed
/// to a mark or a release) and in what order it publishes.
fn publishes(ctx: &Context<'_>, out: &mut Findings) {
    let mut held: BTreeMap<(&str, Uuid), VecDeque<Held>> = BTreeMap::new();
    let mut batches: BTreeMap<&str, u64> = BTreeMap::new();
    let mut last: BTreeMap<&str, (u64, usize)> = BTreeMap::new();
    for (at, e) in ctx.events {
        let at = Some(*at);
        match e {
            Event::ClaimReturned { replica, ids } => {
                let b = batches.entry(replica).or_insert(0);
                *b += 1;
                for (i, id) in ids.iter().enumerate() {
                    held.entry((replica, *id)).or_default().push_back(Held {
                        pos: (*b, i),
                        published: false,
                    });
                }
            }
            Event::StoreCalled {
                replica,
                call: Call::MarkPublished | Call::MarkFailed | Call::Release,
                ids,
            } => {
                for id in ids {
                    if let Some(q) = held.get_mut(&(replica.as_str(), *id)) {
                        q.pop_front();
                    }
                }
            }
            Event::PublishSent {
                client,
                message_id,
                body_id,
            } => {
                if *body_id != Some(*message_id) {
                    out.add(
                        Invariant::PublishOnlyClaimed,
                        at,
                        format!("{client} published {message_id} with a body holding envelope {body_id:?}"),
                    );
                }
                let claim = held
                    .get_mut(&(client.as_str(), *message_id))
                    .and_then(|q| q.iter_mut().find(|h| !h.published));
                let Some(claim) = claim else {
                    out.add(
                        Invariant::PublishOnlyClaimed,
                        at,
                        format!("{client} published {message_id}, which it does not hold (or already published under this claim)"),
                    );
                    continue;
                };
                claim.published = true;
                let pos = claim.pos;
                if let Some(prev) = last.insert(client, pos)
                    && prev >= pos
                {
                    out.add(
                        Invariant::PublishOrder,
                        at,
                        format!(
                            "{client} published row {} of batch {} after row {} of batch {}",
                            pos.1, pos.0, prev.1, prev.0
                        ),
                    );
                }
            }
            _ => {}
        }
    }
}
