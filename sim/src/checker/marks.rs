//! Coverage marks agree with the trace. A scenario's `[expect] reach` list
//! and a sweep's coverage table are only as true as the marks: a mark that
//! fires on the wrong path (or stays silent on the right one) claims
//! coverage nobody has. The drainer marks that the trace can corroborate
//! are checked both ways: the mark comes exactly when its evidence does.
//!
//! The core reports a drainer mark in the same step as the store answer
//! it follows (no await between), so a replica's owed mark must come
//! before its next store call. A consumer's `message_id_mismatch` is held
//! to counts: at most one per delivery of a message whose `message_id`
//! differs from its envelope id, at least one per such delivery it acked.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox::core::marks::Mark;
use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::{Call, Event, Settle};

/// One replica's store calls in progress, and the mark it owes.
#[derive(Default)]
struct Replica {
    /// The mark and release calls in progress (the drain's stages make
    /// theirs concurrently, at most one of each kind): the rows each names
    /// and how many of them the store changed (marked published, or
    /// parked).
    called: BTreeMap<Call, (BTreeSet<Uuid>, usize)>,
    /// The mark the last answer calls for, and when it came.
    owed: Option<(Mark, Duration)>,
}

/// The marks checked here.
const CHECKED: [Mark; 3] = [Mark::ClaimFull, Mark::LeaseLostBeforeMark, Mark::RowParked];

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let mut replicas: BTreeMap<&str, Replica> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::ClaimCalled { replica } => {
                settle(replicas.entry(replica).or_default(), replica, out);
            }
            Event::ClaimReturned { replica, ids } => {
                let r = replicas.entry(replica).or_default();
                if ids.len() as u64 >= u64::from(ctx.limits.batch_size) {
                    r.owed = Some((Mark::ClaimFull, *at));
                }
            }
            Event::StoreCalled { replica, call, ids } => {
                let r = replicas.entry(replica).or_default();
                settle(r, replica, out);
                r.called.insert(*call, (ids.iter().copied().collect(), 0));
            }
            Event::MarkedPublished { replica, ids } => {
                let r = replicas.entry(replica).or_default();
                if let Some((named, changed)) = r.called.get_mut(&Call::MarkPublished) {
                    *changed += ids.iter().filter(|id| named.contains(id)).count();
                }
            }
            Event::MarkedFailed {
                replica, parked, ..
            } => {
                let r = replicas.entry(replica).or_default();
                if let Some((named, changed)) = r.called.get_mut(&Call::MarkFailed) {
                    *changed += parked.iter().filter(|id| named.contains(id)).count();
                }
            }
            Event::StoreAnswered { replica, call } => {
                let r = replicas.entry(replica).or_default();
                let Some((named, changed)) = r.called.remove(call) else {
                    continue;
                };
                match call {
                    Call::MarkPublished if changed < named.len() => {
                        r.owed = Some((Mark::LeaseLostBeforeMark, *at));
                    }
                    Call::MarkFailed if changed > 0 => r.owed = Some((Mark::RowParked, *at)),
                    _ => {}
                }
            }
            Event::Mark { who, mark } if CHECKED.contains(mark) => {
                let r = replicas.entry(who).or_default();
                match r.owed.take() {
                    Some((owed, _)) if owed == *mark => {}
                    owed => {
                        out.add(
                            Invariant::MarksTruthful,
                            Some(*at),
                            format!("{who} marked {} without {}", mark.name(), evidence(*mark)),
                        );
                        r.owed = owed;
                    }
                }
            }
            _ => {}
        }
    }
    for (name, r) in &mut replicas {
        settle(r, name, out);
    }
    message_id_marks(ctx, out);
}

/// A consumer's `message_id_mismatch` marks against its deliveries of
/// messages whose `message_id` differs from the envelope id inside.
fn message_id_marks(ctx: &Context<'_>, out: &mut Findings) {
    let foreign = |mid: &Option<String>| {
        mid.as_ref()
            .and_then(|m| ctx.model.hostile.get(m).map(|h| (m, h)))
            .is_some_and(|(m, (_, envelope))| envelope.is_some_and(|e| e.to_string() != *m))
    };
    // Per consumer: (deliveries, acks, marks).
    let mut clients: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
    for (_, e) in ctx.events {
        match e {
            Event::Delivered {
                client, message_id, ..
            } if foreign(message_id) => clients.entry(client).or_default().0 += 1,
            Event::Settled {
                client,
                message_id,
                settle: Settle::Ack,
            } if foreign(message_id) => clients.entry(client).or_default().1 += 1,
            Event::Mark {
                who,
                mark: Mark::MessageIdMismatch,
            } => clients.entry(who).or_default().2 += 1,
            _ => {}
        }
    }
    for (client, (delivered, acked, marked)) in clients {
        if marked > delivered || marked < acked {
            out.add(
                Invariant::MarksTruthful,
                None,
                format!(
                    "{client} marked message_id_mismatch {marked} times for {delivered} \
                     deliveries of foreign message_ids, {acked} of them acked"
                ),
            );
        }
    }
}

/// Reports a mark still owed when the replica moves on.
fn settle(r: &mut Replica, replica: &str, out: &mut Findings) {
    if let Some((mark, at)) = r.owed.take() {
        out.add(
            Invariant::MarksTruthful,
            Some(at),
            format!(
                "{replica} saw {} but did not mark {}",
                evidence(mark),
                mark.name()
            ),
        );
    }
}

/// What the trace must show for `mark`.
fn evidence(mark: Mark) -> &'static str {
    match mark {
        Mark::ClaimFull => "a claim returning a full batch",
        Mark::LeaseLostBeforeMark => "a mark that changed fewer rows than it named",
        Mark::RowParked => "a failure mark that parked a row",
        _ => "its evidence",
    }
}
