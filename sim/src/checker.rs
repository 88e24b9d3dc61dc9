//! The checker: the invariants of the design, verified from the trace and the
//! fakes' final state, separately from the code under test.
//!
//! 1. **Nothing committed is lost**: once faults heal, every envelope the
//!    store committed is stored by the broker within the liveness bound.
//! 2. **Nothing uncommitted is published**: the broker stores no envelope
//!    the store did not commit.
//! 3. **No broker I/O inside a transaction**: no replica publishes while it
//!    holds an open store transaction.
//! 4. **Attempts grow only on row-culpable failures**: a row's attempts are
//!    bumped at most as often as the broker nacked it.
//! 5. **Stale marks change nothing**: every row a mark changed was, at that
//!    moment, leased by the marking replica.
//! 6. **Parked rows are not claimed** until unparked.
//! 7. **The janitor deletes only published rows.**
//!
//! Duplicates (an envelope stored more than once) are counted and reported,
//! not forbidden: the contract is at-least-once.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use crate::trace::Event;

/// What a run found.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    pub committed: usize,
    pub rolled_back: usize,
    pub published: usize,
    pub duplicates: usize,
    pub parked: usize,
    pub violations: Vec<String>,
}

impl Verdict {
    /// True when no invariant broke.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Most violations listed per invariant (the rest are counted).
const LISTED_MAX: usize = 5;

fn push_all(out: &mut Vec<String>, name: &str, found: Vec<String>) {
    let n = found.len();
    for f in found.into_iter().take(LISTED_MAX) {
        out.push(format!("{name}: {f}"));
    }
    if n > LISTED_MAX {
        out.push(format!("{name}: … and {} more", n - LISTED_MAX));
    }
}

/// Checks every invariant. `stored` counts how often the broker stored each
/// envelope; `liveness_met` says whether the run reached quiescence before
/// its liveness deadline.
pub fn check(
    events: &[(std::time::Duration, Event)],
    stored: &BTreeMap<Uuid, u32>,
    still_parked: &BTreeSet<Uuid>,
) -> Verdict {
    let mut v = Verdict::default();
    let mut committed = BTreeSet::new();
    let mut rolled_back = BTreeSet::new();
    let mut open_tx: BTreeSet<String> = BTreeSet::new();
    let mut owner: BTreeMap<Uuid, String> = BTreeMap::new();
    let mut parked: BTreeSet<Uuid> = BTreeSet::new();
    let mut published: BTreeSet<Uuid> = BTreeSet::new();
    let mut nacks: BTreeMap<Uuid, u32> = BTreeMap::new();
    let mut bumps: BTreeMap<Uuid, u32> = BTreeMap::new();
    let (mut io_in_tx, mut stale, mut parked_claims, mut bad_deletes, mut blame) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());

    for (at, e) in events {
        let t = at.as_secs_f64();
        match e {
            Event::Committed { ids, .. } => committed.extend(ids.iter().copied()),
            Event::RolledBack { ids, .. } => rolled_back.extend(ids.iter().copied()),
            Event::TxBegin { client } => {
                open_tx.insert(client.clone());
            }
            Event::TxEnd { client } => {
                open_tx.remove(client);
            }
            Event::PublishSent { client, message_id } => {
                if open_tx.contains(client) {
                    io_in_tx.push(format!(
                        "{client} published {message_id} at {t:.3}s inside a transaction"
                    ));
                }
            }
            Event::Claimed { replica, ids } => {
                for id in ids {
                    if parked.contains(id) {
                        parked_claims.push(format!("{replica} claimed parked row {id} at {t:.3}s"));
                    }
                    owner.insert(*id, replica.clone());
                }
            }
            Event::MarkedPublished { replica, ids } => {
                for id in ids {
                    if owner.get(id) != Some(replica) {
                        stale.push(format!(
                            "{replica} marked {id} at {t:.3}s while the lease was {:?}",
                            owner.get(id)
                        ));
                    }
                    published.insert(*id);
                }
            }
            Event::MarkedFailed {
                replica,
                ids,
                parked: p,
            } => {
                for id in ids {
                    if owner.get(id) != Some(replica) {
                        stale.push(format!(
                            "{replica} bumped {id} at {t:.3}s without the lease"
                        ));
                    }
                    owner.remove(id);
                    *bumps.entry(*id).or_insert(0) += 1;
                    if bumps[id] > nacks.get(id).copied().unwrap_or(0) {
                        blame.push(format!(
                            "{id} bumped to {} at {t:.3}s after {} nacks",
                            bumps[id],
                            nacks.get(id).copied().unwrap_or(0)
                        ));
                    }
                }
                parked.extend(p.iter().copied());
            }
            Event::LeasesRestored { owners } => {
                for (id, o) in owners {
                    match o {
                        Some(r) => owner.insert(*id, r.clone()),
                        None => owner.remove(id),
                    };
                }
            }
            Event::Released { ids, .. } => {
                for id in ids {
                    owner.remove(id);
                }
            }
            Event::Unparked { ids } => {
                for id in ids {
                    parked.remove(id);
                    owner.remove(id);
                    bumps.remove(id);
                    nacks.remove(id);
                }
            }
            Event::Deleted { ids } => {
                for id in ids {
                    if !published.contains(id) {
                        bad_deletes.push(format!(
                            "{id} deleted at {t:.3}s but never marked published"
                        ));
                    }
                }
            }
            Event::Confirmed {
                message_id, ack, ..
            } => {
                if !ack {
                    *nacks.entry(*message_id).or_insert(0) += 1;
                }
            }
            Event::Fault(_) | Event::ReplyLost { .. } | Event::Tick { .. } | Event::Host { .. } => {
            }
        }
    }

    let lost: Vec<String> = committed
        .iter()
        .filter(|id| !stored.contains_key(id))
        .map(|id| {
            let why = if still_parked.contains(id) {
                " (still parked)"
            } else {
                ""
            };
            format!("{id} committed but never stored by the broker{why}")
        })
        .collect();
    let phantom: Vec<String> = stored
        .keys()
        .filter(|id| !committed.contains(id))
        .map(|id| {
            let why = if rolled_back.contains(id) {
                "rolled back"
            } else {
                "never committed"
            };
            format!("{id} stored by the broker but {why}")
        })
        .collect();
    push_all(&mut v.violations, "lost", lost);
    push_all(&mut v.violations, "uncommitted published", phantom);
    push_all(&mut v.violations, "broker I/O in a transaction", io_in_tx);
    push_all(&mut v.violations, "attempts without a nack", blame);
    push_all(&mut v.violations, "stale mark", stale);
    push_all(&mut v.violations, "parked row claimed", parked_claims);
    push_all(
        &mut v.violations,
        "janitor deleted an unpublished row",
        bad_deletes,
    );

    v.committed = committed.len();
    v.rolled_back = rolled_back.len();
    v.published = stored.len();
    v.duplicates = stored
        .values()
        .map(|c| (*c as usize).saturating_sub(1))
        .sum();
    v.parked = still_parked.len();
    v
}
