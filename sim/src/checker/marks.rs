//! Coverage marks agree with the trace. A scenario's `[expect] reach` list
//! and a sweep's coverage table are only as true as the marks: a mark that
//! fires on the wrong path (or stays silent on the right one) claims
//! coverage nobody has. The drainer marks that the trace can corroborate
//! are checked both ways: the mark comes exactly when its evidence does.
//!
//! The core reports a mark in the same step as the store answer it
//! follows (no await between), so a replica's owed mark must come before
//! its next store call.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox::core::marks::Mark;
use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::{Call, Event};

/// One replica's store call in progress, and the mark it owes.
#[derive(Default)]
struct Replica {
    /// The mark or release call in progress and the rows it names.
    called: Option<(Call, BTreeSet<Uuid>)>,
    /// Rows of that call the store changed (marked published, or parked).
    changed: usize,
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
                r.called = Some((*call, ids.iter().copied().collect()));
                r.changed = 0;
            }
            Event::MarkedPublished { replica, ids } => {
                let r = replicas.entry(replica).or_default();
                if let Some((Call::MarkPublished, named)) = &r.called {
                    r.changed += ids.iter().filter(|id| named.contains(id)).count();
                }
            }
            Event::MarkedFailed {
                replica, parked, ..
            } => {
                let r = replicas.entry(replica).or_default();
                if let Some((Call::MarkFailed, named)) = &r.called {
                    r.changed += parked.iter().filter(|id| named.contains(id)).count();
                }
            }
            Event::StoreAnswered { replica, call } => {
                let r = replicas.entry(replica).or_default();
                let named = match &r.called {
                    Some((c, named)) if c == call => named.len(),
                    _ => continue,
                };
                match call {
                    Call::MarkPublished if r.changed < named => {
                        r.owed = Some((Mark::LeaseLostBeforeMark, *at));
                    }
                    Call::MarkFailed if r.changed > 0 => r.owed = Some((Mark::RowParked, *at)),
                    _ => {}
                }
                r.called = None;
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
