//! Attempts and parking (#1230, issue 26): a row's `attempts` grow only on
//! row-culpable failures (a routing key no broker could accept), never on a
//! claim, a lease expiry, a timeout, a broker's nack (a full queue, a node's
//! trouble) or any other infrastructure error; a row parks exactly when its
//! attempts reach the budget; a parked row is not claimed until an operator
//! unparks it, which gives it a fresh budget.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let max = ctx.limits.max_attempts;
    let mut bumps: BTreeMap<Uuid, u32> = BTreeMap::new();
    let mut parked: BTreeSet<Uuid> = BTreeSet::new();
    for (at, e) in ctx.events {
        let at = Some(*at);
        match e {
            Event::Claimed {
                replica,
                ids,
                attempts,
            } => {
                for (id, a) in ids.iter().zip(attempts) {
                    recorded(out, at, id, *a, &bumps, "claimed with");
                    if parked.contains(id) {
                        out.add(
                            Invariant::ParkedNotClaimed,
                            at,
                            format!("{replica} claimed parked row {id}"),
                        );
                    }
                }
            }
            Event::MarkedFailed { ids, parked: p, .. } => {
                for id in ids {
                    let n = bumps.entry(*id).or_insert(0);
                    *n += 1;
                    let n = *n;
                    // Only an unpublishable row is to blame for a failure.
                    if !ctx.model.unpublishable.contains(id) {
                        out.add(
                            Invariant::AttemptsOnlyOnBlame,
                            at,
                            format!("{id} bumped to {n}, but nothing about it is unpublishable"),
                        );
                    }
                    if p.contains(id) != (n >= max) {
                        out.add(
                            Invariant::ParkAtBudget,
                            at,
                            format!(
                                "{id} at {n} failures of a budget of {max}: parked is {}",
                                p.contains(id)
                            ),
                        );
                    }
                }
                parked.extend(p.iter().copied());
            }
            Event::Unparked { ids } => {
                for id in ids {
                    parked.remove(id);
                    bumps.remove(id);
                }
            }
            _ => {}
        }
    }
    for (id, a) in &ctx.fin.attempts {
        recorded(out, None, id, *a, &bumps, "ends with");
    }
}

/// A row's `attempts` as the store reports them must be the row-culpable
/// failures recorded for it (since its last unpark).
fn recorded(
    out: &mut Findings,
    at: Option<std::time::Duration>,
    id: &Uuid,
    attempts: i32,
    bumps: &BTreeMap<Uuid, u32>,
    what: &str,
) {
    let expected = bumps.get(id).copied().unwrap_or(0);
    if attempts as u32 != expected {
        out.add(
            Invariant::AttemptsOnlyOnBlame,
            at,
            format!("{id} {what} attempts {attempts}, but {expected} failures were recorded"),
        );
    }
}
