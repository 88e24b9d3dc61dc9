//! Ordering keys (issue 27), the consumer's half, on an ordered
//! subscription (`consumer_partitions` > 0):
//!
//! - **applied in commit order**: an event of a key takes effect only once
//!   every earlier event of its key has taken effect in the subscription or
//!   was skipped (at the outbox, never published; or at the inbox by an
//!   operator). So a key's effects commit in the order its transactions
//!   committed, a dead-lettered event holds back its key's later events
//!   until it is replayed or skipped, and a duplicate or a redelivery never
//!   reorders what took effect. A foreign publisher's keyed messages count
//!   by their key and number too, the ones the subscriber must give up on
//!   (not an envelope, too large, refused by the inbox) among them: those
//!   can never take effect, so their key goes on only once they are
//!   skipped.
//! - **held, not lost**: a delivery recorded held waits behind an earlier
//!   event of its key that is unprocessed (dead-lettered or held itself)
//!   in the inbox when it commits.
//! - **one handler at a time**: no handler run of a keyed event begins
//!   while a run of an event of the same key has not ended, on any worker
//!   of any replica (a run ends when it returns, when the subscriber drops
//!   it, or when its host crashes).
//! - **deferred only behind its key**: a delivery requeued with no failure
//!   recorded (deferred) is keyed, and an earlier event of its key was
//!   delivered and has not taken effect or been skipped yet
//!   ([`deferral_justified`], used by the budget rule).
//!
//! Effects come from the fake's `InboxCommitted` (a handler transaction's
//! commit, replays included), inbox skips from its `InboxSkipped`, holds
//! from its `InboxHeld`.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    if ctx.limits.consumer_partitions == 0 || ctx.model.keyed.is_empty() {
        return;
    }
    one_handler_per_key(ctx, out);
    // Per subscription: events that took effect. Skips and holds name no
    // subscription (the simulation has one): a skip counts for each, and
    // a hold is judged against what took effect in any.
    let mut done: BTreeMap<&str, BTreeSet<Uuid>> = BTreeMap::new();
    let mut skipped: BTreeSet<Uuid> = BTreeSet::new();
    let mut anywhere: BTreeSet<Uuid> = BTreeSet::new();
    for (at, e) in ctx.events {
        let at = Some(*at);
        match e {
            Event::InboxCommitted { effects, .. } => {
                for (sub, id) in effects {
                    let seen = done.entry(sub.as_str()).or_default();
                    if seen.contains(id) {
                        continue; // a repeat after retention; judged elsewhere
                    }
                    let pending =
                        pending_before(ctx, id, |e| seen.contains(e) || skipped.contains(e));
                    if let Some((earlier, key)) = pending {
                        out.add(
                            Invariant::KeyAppliedInOrder,
                            at,
                            format!(
                                "{id} of key {key:?} took effect in {sub} before its earlier event {earlier}"
                            ),
                        );
                    }
                    seen.insert(*id);
                    anywhere.insert(*id);
                }
            }
            Event::InboxSkipped { events, .. } => skipped.extend(events.iter().copied()),
            Event::InboxHeld { client, events } => {
                for id in events {
                    let pending =
                        pending_before(ctx, id, |e| anywhere.contains(e) || skipped.contains(e));
                    if ctx.model.keyed.contains_key(id) && pending.is_none() {
                        out.add(
                            Invariant::KeyHeldBehindItsHead,
                            at,
                            format!(
                                "{client} recorded {id} held though every earlier event of its key took effect"
                            ),
                        );
                    }
                }
            }
            _ => {}
        }
    }
}

/// A handler run under way: its client, event and session.
type Run<'a> = (&'a str, Uuid, Option<u64>);

/// No handler run of a keyed event begins while another run of its key
/// is under way: runs go from `HandlerStarted` to `HandlerEnded`, to the
/// end of their transaction at the server (`InboxBatch` of their session:
/// a paused replica's run, whose transaction the server ended, takes no
/// effect whatever it does when it wakes), or to the crash of their
/// client's host (clients are named `host#n`).
fn one_handler_per_key(ctx: &Context<'_>, out: &mut Findings) {
    // Key → the runs under way.
    let mut running: BTreeMap<&str, Vec<Run<'_>>> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::HandlerStarted {
                client,
                event_id,
                session,
            } => {
                let Some((key, _)) = ctx.model.keyed.get(event_id) else {
                    continue;
                };
                let runs = running.entry(key.as_str()).or_default();
                if let Some((other, earlier, _)) = runs.first() {
                    out.add(
                        Invariant::KeyHandledOneAtATime,
                        Some(*at),
                        format!(
                            "{client} began handling {event_id} of key {key:?} while {other} was handling {earlier}"
                        ),
                    );
                }
                runs.push((client.as_str(), *event_id, *session));
            }
            Event::HandlerEnded { client, event_id } => {
                if let Some((key, _)) = ctx.model.keyed.get(event_id)
                    && let Some(runs) = running.get_mut(key.as_str())
                    && let Some(i) = runs
                        .iter()
                        .position(|(c, e, _)| (*c, *e) == (client.as_str(), *event_id))
                {
                    runs.remove(i);
                }
            }
            Event::InboxBatch { session, .. } => {
                for runs in running.values_mut() {
                    runs.retain(|(_, _, s)| *s != Some(*session));
                }
            }
            Event::Host { host, up: false } => {
                for runs in running.values_mut() {
                    runs.retain(|(client, _, _)| {
                        client.split_once('#').map(|(h, _)| h) != Some(host.as_str())
                    });
                }
            }
            _ => {}
        }
    }
}

/// The first earlier event of `id`'s key that is neither `done` nor
/// skipped at the outbox, if `id` is keyed and has one.
fn pending_before<'m>(
    ctx: &'m Context<'_>,
    id: &Uuid,
    done: impl Fn(&Uuid) -> bool,
) -> Option<(Uuid, &'m str)> {
    let (key, seq) = ctx.model.keyed.get(id)?;
    ctx.model
        .by_key
        .get(key)?
        .range(..*seq)
        .map(|(_, e)| *e)
        .find(|e| !done(e) && !ctx.model.skipped.contains(e))
        .map(|e| (e, key.as_str()))
}

/// Whether a requeue of `event` that answers no failure record is an
/// ordered subscription's deferral: `event` is keyed, and an earlier event
/// of its key was delivered (`delivered`) and its inbox row does not say
/// it took effect or was skipped (`done`; a row the janitor deleted past
/// the retention says nothing: a redelivery of its event is new to the
/// inbox, and the later events of its key wait behind it again).
pub fn deferral_justified(
    ctx: &Context<'_>,
    event: Uuid,
    delivered: &BTreeSet<Uuid>,
    done: &BTreeSet<Uuid>,
) -> bool {
    if ctx.limits.consumer_partitions == 0 {
        return false;
    }
    let Some((key, seq)) = ctx.model.keyed.get(&event) else {
        return false;
    };
    ctx.model.by_key.get(key).is_some_and(|events| {
        events
            .range(..*seq)
            .any(|(_, e)| delivered.contains(e) && !done.contains(e))
    })
}
