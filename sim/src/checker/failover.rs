//! Failovers: what a promotion took back, and the two rules the
//! durability gates keep across it.
//!
//! A failover takes back the commits the promoted standby never held
//! (`Event::FailedOver`): outbox rows, and handler effects with their
//! processed marks. The outbox's rows were real until the failover (a
//! stats sample before it counted them): the rules that fold the table
//! drop them at the failover, and the model counts them as never
//! committed. The effects are history no more: [`rewrite`] drops them
//! from the inbox commits that made them before the other rules read the
//! trace, so "took effect" means what the surviving database holds. Two
//! rules judge what happened to them:
//! - `no_phantom_event`: the broker never stored an event whose commit a
//!   failover took back (replicated before published);
//! - `no_lost_effect`: no delivery was acked whose effect a failover then
//!   took back (replicated before acked), nor acked after a failover took
//!   its effect back and before it took effect again (a wait that trusted
//!   the new primary's flush position for a commit on the old one).

use std::collections::BTreeSet;
use std::time::Duration;

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::{Event, Settle};

/// The trace as the surviving inbox tells it: each failover's lost
/// effects (the latest ones before it, as many as it took back) removed,
/// with their processed marks, from the commits that made them. `None` if
/// no failover came.
pub fn rewrite(events: &[(Duration, Event)]) -> Option<Vec<(Duration, Event)>> {
    let failovers: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, (_, e))| matches!(e, Event::FailedOver { .. }))
        .map(|(i, _)| i)
        .collect();
    if failovers.is_empty() {
        return None;
    }
    let mut out = events.to_vec();
    for at in failovers {
        let Event::FailedOver { lost_effects, .. } = events[at].1.clone() else {
            unreachable!("a failover");
        };
        let mut effects = lost_effects;
        for (_, e) in out[..at].iter_mut().rev() {
            if let Event::InboxCommitted {
                effects: done,
                processed,
                ..
            } = e
            {
                done.retain(|effect| match effects.iter().position(|l| l == effect) {
                    Some(i) => {
                        effects.swap_remove(i);
                        processed.retain(|id| *id != effect.1);
                        false
                    }
                    None => true,
                });
            }
        }
    }
    Some(out)
}

pub fn check(ctx: &Context<'_>, original: &[(Duration, Event)], out: &mut Findings) {
    for id in ctx.fin.stored.keys() {
        if ctx.model.taken_back.contains(id) {
            out.add(
                Invariant::NoPhantomEvent,
                None,
                format!("{id} was stored by the broker, and a failover took its commit back"),
            );
        }
    }
    // Acked since the last failover; and effects a failover took back
    // that have not taken place again.
    let mut acked: BTreeSet<Uuid> = BTreeSet::new();
    let mut gone: BTreeSet<Uuid> = BTreeSet::new();
    for (at, e) in original {
        match e {
            Event::Settled {
                message_id,
                settle: Settle::Ack,
                ..
            } => {
                let Some(id) = ctx.model.event_of(message_id.as_deref()) else {
                    continue;
                };
                if gone.contains(&id) {
                    out.add(
                        Invariant::NoLostEffect,
                        Some(*at),
                        format!(
                            "{id} was acked after a failover took its effect back, before it \
                             took effect again"
                        ),
                    );
                }
                acked.insert(id);
            }
            Event::InboxCommitted { effects, .. } => {
                for (_, id) in effects {
                    gone.remove(id);
                }
            }
            Event::FailedOver { lost_effects, .. } => {
                for (subscription, id) in lost_effects {
                    if acked.contains(id) {
                        out.add(
                            Invariant::NoLostEffect,
                            Some(*at),
                            format!(
                                "{id} on {subscription}: its delivery was acked, and a failover \
                                 took its effect back"
                            ),
                        );
                    }
                    gone.insert(*id);
                }
                // What is acked after this failover is judged at the next.
                acked.clear();
            }
            _ => {}
        }
    }
}
