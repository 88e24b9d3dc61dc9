//! Ordering keys (issue 27), the producer's half: the events of one key are
//! numbered in the order their transactions committed (1, 2, … with no gap
//! or repeat); a keyed event is claimed only as its key's head, when every
//! earlier event of the key is published or skipped (so a key has one
//! event between claim and mark at a time, and a parked head holds back
//! the rest); and it is sent to the broker only once every earlier event of
//! its key is marked published, so the broker stores each key's events
//! first in commit order. Republishing an event whose predecessors are
//! marked (a reclaimed lease) breaks none of these.
//!
//! The numbers come from the fake's `KeysNumbered` (at each commit), the
//! marks from its `MarkedPublished` and `Skipped`, claims from `Claimed`
//! (the claim statement), sends from the drainers' `PublishSent`.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    if ctx.model.keyed.is_empty() {
        return;
    }
    numbered_in_commit_order(ctx, out);
    let mut done: BTreeSet<Uuid> = BTreeSet::new();
    let mut parked: BTreeSet<Uuid> = BTreeSet::new();
    for (at, e) in ctx.events {
        let at = Some(*at);
        match e {
            Event::MarkedPublished { ids, .. } | Event::Skipped { ids } => {
                done.extend(ids.iter().copied());
            }
            Event::CommitsLost { unmarked, .. } => {
                for id in unmarked {
                    done.remove(id);
                }
            }
            Event::MarkedFailed { parked: p, .. } => parked.extend(p.iter().copied()),
            Event::Unparked { ids } => {
                for id in ids {
                    parked.remove(id);
                }
            }
            Event::Claimed { replica, ids, .. } => {
                for id in ids {
                    if let Some((earlier, key)) = undone_before(ctx, id, &done) {
                        let why = if parked.contains(&earlier) {
                            "parked"
                        } else {
                            "unpublished"
                        };
                        out.add(
                            Invariant::KeyHeadOnlyClaimed,
                            at,
                            format!(
                                "{replica} claimed {id} of key {key:?} while its earlier event {earlier} was {why}"
                            ),
                        );
                    }
                }
            }
            Event::PublishSent {
                client,
                message_id,
                body_id,
            } => {
                let id = body_id.unwrap_or(*message_id);
                if let Some((earlier, key)) = undone_before(ctx, &id, &done) {
                    out.add(
                        Invariant::KeyPublishedInOrder,
                        at,
                        format!(
                            "{client} sent {id} of key {key:?} before its earlier event {earlier} was marked published"
                        ),
                    );
                }
            }
            _ => {}
        }
    }
}

/// The first earlier event of `id`'s key not yet published or skipped, if
/// `id` is keyed and has one.
fn undone_before<'m>(
    ctx: &'m Context<'_>,
    id: &Uuid,
    done: &BTreeSet<Uuid>,
) -> Option<(Uuid, &'m str)> {
    let (key, seq) = ctx.model.keyed.get(id)?;
    let events = ctx.model.by_key.get(key)?;
    events
        .range(..*seq)
        .map(|(_, e)| *e)
        .find(|e| !done.contains(e))
        .map(|e| (e, key.as_str()))
}

/// Each commit's rows of a key continue the key's numbers, in batch order.
fn numbered_in_commit_order(ctx: &Context<'_>, out: &mut Findings) {
    let mut last: BTreeMap<&str, i64> = BTreeMap::new();
    for (at, e) in ctx.events {
        let Event::KeysNumbered { rows } = e else {
            continue;
        };
        for (id, key, seq) in rows {
            let next = last.get(key.as_str()).copied().unwrap_or(0) + 1;
            if *seq != next {
                out.add(
                    Invariant::KeyNumberedInCommitOrder,
                    Some(*at),
                    format!(
                        "{id} committed as number {seq} of key {key:?}; commit order makes it {next}"
                    ),
                );
            }
            last.insert(key, (*seq).max(next - 1));
        }
    }
}
