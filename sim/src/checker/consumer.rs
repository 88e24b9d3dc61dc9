//! The consumer (#433): exactly-once effect over an at-least-once broker,
//! the attempt budget, replay, and deliveries no service should have to
//! trust.
//!
//! - **exactly once**: every committed, publishable event (and every valid
//!   event a foreign publisher sent) takes effect exactly once within the
//!   inbox's dedup window: an effect may repeat only for a delivery handled
//!   after the janitor deleted the event's processed row, which it may do
//!   only past the retention (`inbox_janitor_scope`); nothing else takes
//!   effect; an effect commits in the same transaction as its inbox row's
//!   processed mark; an event whose effect committed is never dead-lettered.
//! - **budget**: an attempt is recorded only for a handler failure of the
//!   handler's own (never for database or broker trouble); a delivery is
//!   dead-lettered exactly when its recorded attempts reach the budget:
//!   each dead-letter (requeue) answers a record of that consumer that did
//!   (did not) reach it, and each record says so exactly at the budget (or
//!   when the row is still dead-lettered: a failed replay marks it with a
//!   budget of one, and the mark stays until the next replay resets it).
//! - **replay**: a replayed row gets a fresh budget before its handler
//!   runs, and a row whose handler fails again stays dead-lettered.
//! - **rejected at once**: a delivery that is not a valid envelope, is over
//!   the size limit, or holds data the inbox refuses is dead-lettered at
//!   once: never acked or requeued, never handled, never recorded, and the
//!   inbox is asked to store it at most once per delivery.
//! - **keyed by envelope id**: nothing is ever keyed by a foreign AMQP
//!   `message_id`.
//! - **ack after commit**: a delivery is acked only once its event's
//!   processed mark has committed (the ADR's step 4: commit, then ack;
//!   with batches, after the batch's commit).

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::{Event, FaultKind, HandlerResult, Replay, Settle};

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let Some(fin) = &ctx.fin.consumer else {
        return;
    };
    let after_retention = effects(ctx, out);
    budget(ctx, out);
    replay(ctx, out);
    rejected(ctx, out);
    keyed(ctx, out);
    acked_after_commit(ctx, out);
    let mut expected = ctx.model.expected_effects();
    for (key, events) in ctx.model.unique_groups() {
        unique_key(key, &events, fin, &mut expected, out);
    }
    exactly_once(&expected, &fin.effects, &after_retention, "", out);
}

/// Of the events whose effect takes deferred unique key `key`, exactly one
/// takes effect (the first to commit: it is held to exactly once with the
/// rest of `expected`); the others can never commit theirs, so each must
/// end dead-lettered (decided at its budget), not retried forever.
fn unique_key(
    key: &str,
    events: &std::collections::BTreeSet<Uuid>,
    fin: &crate::model::ConsumerFinal,
    expected: &mut std::collections::BTreeSet<Uuid>,
    out: &mut Findings,
) {
    let winner = fin.unique_keys.get(key).filter(|w| events.contains(w));
    if winner.is_none() {
        // None of them took effect (or a stranger took the key): keep them
        // all expected, so `exactly_once_effect` names each.
        return;
    }
    for id in events.iter().filter(|id| Some(*id) != winner) {
        expected.remove(id);
        if !fin.dead_lettered.contains(id) {
            out.add(
                Invariant::EveryDeliveryDecided,
                None,
                format!(
                    "{id} can never take effect (its unique key {key} is taken) \
                     but is not dead-lettered"
                ),
            );
        }
    }
}

/// Each of `expected` took effect exactly once in `effects` (less those
/// `after_retention` excuses: a duplicate past the inbox retention), and
/// nothing else took effect. `label` names the subscription in the details
/// (empty for the simulation's one).
pub(super) fn exactly_once(
    expected: &BTreeSet<Uuid>,
    effects: &BTreeMap<Uuid, u32>,
    after_retention: &BTreeMap<Uuid, u32>,
    label: &str,
    out: &mut Findings,
) {
    for id in expected {
        let n = effects.get(id).copied().unwrap_or(0);
        let excused = after_retention.get(id).copied().unwrap_or(0);
        match n.saturating_sub(excused) {
            1 => {}
            0 => out.add(
                Invariant::ExactlyOnceEffect,
                None,
                format!("{label}{id} was committed but never took effect"),
            ),
            _ => out.add(
                Invariant::ExactlyOnceEffect,
                None,
                format!(
                    "{label}{id} took effect {n} times ({excused} after its inbox row expired)"
                ),
            ),
        }
    }
    for (id, n) in effects {
        if !expected.contains(id) {
            out.add(
                Invariant::PhantomEffect,
                None,
                format!("{label}{id} took effect {n} time(s) but was never committed"),
            );
        }
    }
}

/// Effects come with their processed mark; no dead-letter after an effect.
/// Returns, per event, the effects that came after the janitor deleted its
/// processed row (the dedup window is the retention).
fn effects(ctx: &Context<'_>, out: &mut Findings) -> BTreeMap<Uuid, u32> {
    let mut applied: BTreeSet<Uuid> = BTreeSet::new();
    let mut expired: BTreeSet<Uuid> = BTreeSet::new();
    let mut after_retention: BTreeMap<Uuid, u32> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::InboxDeleted { ids } => expired.extend(ids.iter().copied()),
            Event::InboxCommitted {
                client,
                processed,
                effects,
                ..
            } => {
                let marked: BTreeSet<&Uuid> = processed.iter().collect();
                let effected: BTreeSet<&Uuid> = effects.iter().map(|(_, id)| id).collect();
                if marked != effected {
                    out.add(
                        Invariant::EffectWithMark,
                        Some(*at),
                        format!("{client} committed effects {effected:?} with processed marks {marked:?}"),
                    );
                }
                for (_, id) in effects {
                    if expired.remove(id) {
                        *after_retention.entry(*id).or_insert(0) += 1;
                    }
                    applied.insert(*id);
                }
            }
            Event::InboxFailure {
                event_id,
                dead_lettered: true,
                attempts,
                ..
            } if applied.contains(event_id) => out.add(
                Invariant::NoDeadLetterAfterEffect,
                Some(*at),
                format!(
                    "{event_id} was dead-lettered (attempt {attempts}) after its effect committed"
                ),
            ),
            _ => {}
        }
    }
    after_retention
}

/// The consumer a side connection belongs to (`consumer-1#2/side`).
fn consumer_of(client: &str) -> &str {
    client.strip_suffix("/side").unwrap_or(client)
}

/// Unused failure records of one consumer for one event.
#[derive(Default)]
struct Records {
    below_budget: u32,
    at_budget: u32,
}

impl Records {
    /// Uses the record a settlement answers; `Err` names the settlement if
    /// there is none.
    fn answer(&mut self, settle: Settle) -> Result<(), &'static str> {
        let (slot, what) = match settle {
            Settle::Ack => return Ok(()),
            Settle::Requeue => (&mut self.below_budget, "requeued"),
            Settle::DeadLetter => (&mut self.at_budget, "dead-lettered"),
        };
        *slot = slot.checked_sub(1).ok_or(what)?;
        Ok(())
    }
}

fn budget(ctx: &Context<'_>, out: &mut Findings) {
    let max = ctx.limits.consumer_max_attempts;
    let mut handler_failures: BTreeMap<Uuid, u32> = BTreeMap::new();
    let mut records: BTreeMap<(&str, Uuid), Records> = BTreeMap::new();
    let mut replaying: BTreeSet<Uuid> = BTreeSet::new();
    // Rows marked dead-lettered: the mark stays until a replay resets it.
    let mut dead: BTreeSet<Uuid> = BTreeSet::new();
    for (at, e) in ctx.events {
        let at = Some(*at);
        match e {
            Event::HandlerRan {
                event_id,
                result: HandlerResult::Failed,
                ..
            } => *handler_failures.entry(*event_id).or_insert(0) += 1,
            // The handler's work cannot commit: its data breaks a deferred
            // constraint (its `Ok` notwithstanding).
            Event::ConstraintFailed { events, .. } => {
                for id in events {
                    *handler_failures.entry(*id).or_insert(0) += 1;
                }
            }
            Event::InboxReset { ids } => {
                replaying.extend(ids.iter().copied());
                for id in ids {
                    dead.remove(id);
                }
            }
            Event::Replayed { event_id, .. } => {
                replaying.remove(event_id);
            }
            Event::InboxFailure {
                client,
                event_id,
                attempts,
                dead_lettered,
            } => {
                match handler_failures.get_mut(event_id).filter(|n| **n > 0) {
                    Some(n) => *n -= 1,
                    None => out.add(
                        Invariant::AttemptOnlyOnHandlerFailure,
                        at,
                        format!("{client} recorded attempt {attempts} of {event_id} without a handler failure"),
                    ),
                }
                let was_dead = if *dead_lettered {
                    !dead.insert(*event_id)
                } else {
                    dead.contains(event_id)
                };
                if replaying.contains(event_id) {
                    continue; // a replay's budget is one (see `replay`)
                }
                if *dead_lettered != (*attempts as u32 >= max || was_dead) {
                    out.add(
                        Invariant::DeadLetterAtBudget,
                        at,
                        format!("{event_id} recorded at attempt {attempts} of a budget of {max} with dead_lettered = {dead_lettered} (dead-lettered before: {was_dead})"),
                    );
                }
                let r = records.entry((consumer_of(client), *event_id)).or_default();
                if *dead_lettered {
                    r.at_budget += 1;
                } else {
                    r.below_budget += 1;
                }
            }
            Event::Settled {
                client,
                message_id,
                settle,
            } => {
                let Some(event) = ctx.model.event_of(message_id.as_deref()) else {
                    continue;
                };
                let r = records.entry((client.as_str(), event)).or_default();
                if let Err(what) = r.answer(*settle) {
                    out.add(
                        Invariant::DeadLetterAtBudget,
                        at,
                        format!("{client} {what} {event} without a failure record {} the budget of {max}", if *settle == Settle::Requeue { "below" } else { "reaching" }),
                    );
                }
            }
            _ => {}
        }
    }
}

fn replay(ctx: &Context<'_>, out: &mut Findings) {
    let mut reset: BTreeSet<Uuid> = BTreeSet::new();
    let mut last_record: BTreeMap<Uuid, bool> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::ReplayStarted { .. } => reset.clear(),
            Event::InboxReset { ids } => {
                for id in ids {
                    reset.insert(*id);
                    last_record.remove(id);
                }
            }
            Event::InboxFailure {
                event_id,
                dead_lettered,
                ..
            } => {
                last_record.insert(*event_id, *dead_lettered);
            }
            Event::Replayed {
                client,
                event_id,
                outcome,
            } => {
                let ran = matches!(outcome, Replay::Applied | Replay::Failed);
                if ran && !reset.remove(event_id) {
                    out.add(
                        Invariant::ReplayFreshBudget,
                        Some(*at),
                        format!("{client} replayed {event_id} ({outcome:?}) without resetting its budget"),
                    );
                }
                if *outcome == Replay::Failed && last_record.get(event_id) != Some(&true) {
                    out.add(
                        Invariant::ReplayKeepsFailedFindable,
                        Some(*at),
                        format!("{client}'s replay of {event_id} failed but left it not dead-lettered ({:?})", last_record.get(event_id)),
                    );
                }
            }
            _ => {}
        }
    }
}

fn rejected(ctx: &Context<'_>, out: &mut Findings) {
    let Some(fin) = &ctx.fin.consumer else {
        return;
    };
    let model = ctx.model;
    let rejected = &model.hostile_rejected;
    let mut deliveries: BTreeMap<&str, u32> = BTreeMap::new();
    let mut refused: BTreeMap<Uuid, u32> = BTreeMap::new();
    // A refusal whose reply was lost on the way (the fault follows it at
    // once) never reached the subscriber, which rightly retried in place.
    let mut last_refusal: Option<(&str, Uuid)> = None;
    for (at, e) in ctx.events {
        let at = Some(*at);
        if let (
            Some((client, id)),
            Event::Fault {
                kind: FaultKind::PgReplyLost,
                detail,
            },
        ) = (last_refusal, e)
            && detail.strip_prefix(client) == Some(" inbox_try_insert")
            && let Some(n) = refused.get_mut(&id)
        {
            *n -= 1;
        }
        last_refusal = match e {
            Event::InboxRefused {
                client, event_id, ..
            } => Some((client.as_str(), *event_id)),
            _ => None,
        };
        match e {
            Event::Delivered {
                message_id: Some(mid),
                ..
            } if model.hostile.get(mid).is_some_and(|(k, _)| !k.applies()) => {
                *deliveries.entry(mid).or_insert(0) += 1;
            }
            Event::Settled {
                client,
                message_id: Some(mid),
                settle,
            } if *settle != Settle::DeadLetter
                && model.hostile.get(mid).is_some_and(|(k, _)| !k.applies()) =>
            {
                let kind = model.hostile[mid].0;
                out.add(
                    Invariant::RejectedAtOnce,
                    at,
                    format!("{client} settled a {kind:?} delivery ({mid}) with {settle:?}"),
                );
            }
            Event::InboxRefused { event_id, .. } => *refused.entry(*event_id).or_insert(0) += 1,
            Event::HandlerRan {
                client, event_id, ..
            } if rejected.contains(event_id) => out.add(
                Invariant::RejectedAtOnce,
                at,
                format!("{client} ran the handler for rejected delivery {event_id}"),
            ),
            Event::InboxFailure {
                client, event_id, ..
            } if rejected.contains(event_id) => out.add(
                Invariant::RejectedAtOnce,
                at,
                format!("{client} recorded an attempt for rejected delivery {event_id}"),
            ),
            _ => {}
        }
    }
    for (mid, (kind, envelope)) in model.hostile.iter().filter(|(_, (k, _))| !k.applies()) {
        if !fin.dead_letters.contains_key(&Some(mid.clone())) {
            out.add(
                Invariant::RejectedAtOnce,
                None,
                format!("a {kind:?} delivery ({mid}) never reached the dead-letter queue"),
            );
        }
        let Some(id) = envelope else { continue };
        let (asked, delivered) = (
            refused.get(id).copied().unwrap_or(0),
            deliveries.get(mid.as_str()).copied().unwrap_or(0),
        );
        if asked > delivered {
            out.add(
                Invariant::RejectedAtOnce,
                None,
                format!("the inbox was asked to store {kind:?} delivery {id} {asked} times over {delivered} deliveries: retried in place"),
            );
        }
        if fin.rows.contains(id) {
            out.add(
                Invariant::RejectedAtOnce,
                None,
                format!("rejected delivery {id} ({kind:?}) has an inbox row"),
            );
        }
    }
}

/// Each ack the broker receives names an event whose processed mark had
/// committed by then. A delivery whose envelope cannot be named (a hostile
/// one with no usable id) is not judged here: `rejected` holds those to
/// never being acked at all.
fn acked_after_commit(ctx: &Context<'_>, out: &mut Findings) {
    let mut processed: BTreeSet<Uuid> = BTreeSet::new();
    for (at, e) in ctx.events {
        match e {
            Event::InboxCommitted { processed: ids, .. } => processed.extend(ids.iter().copied()),
            Event::Settled {
                client,
                message_id: Some(mid),
                settle: Settle::Ack,
            } => {
                let event = match ctx.model.hostile.get(mid) {
                    Some((_, envelope)) => *envelope,
                    None => Uuid::parse_str(mid).ok(),
                };
                if let Some(id) = event.filter(|id| !processed.contains(id)) {
                    out.add(
                        Invariant::AckAfterCommit,
                        Some(*at),
                        format!("{client} acked {id} before its processed mark committed"),
                    );
                }
            }
            _ => {}
        }
    }
}

fn keyed(ctx: &Context<'_>, out: &mut Findings) {
    let Some(fin) = &ctx.fin.consumer else {
        return;
    };
    let foreign: BTreeSet<Uuid> = ctx
        .model
        .hostile
        .iter()
        .filter(|(_, (k, _))| k.applies())
        .filter_map(|(mid, (_, envelope))| {
            Uuid::parse_str(mid).ok().filter(|u| Some(*u) != *envelope)
        })
        .collect();
    if foreign.is_empty() {
        return;
    }
    for (at, e) in ctx.events {
        let keyed_by: Vec<Uuid> = match e {
            Event::InboxCommitted {
                processed, effects, ..
            } => processed
                .iter()
                .chain(effects.iter().map(|(_, id)| id))
                .copied()
                .collect(),
            Event::InboxFailure { event_id, .. }
            | Event::HandlerRan { event_id, .. }
            | Event::InboxDuplicate { event_id, .. } => vec![*event_id],
            _ => continue,
        };
        for id in keyed_by.iter().filter(|id| foreign.contains(id)) {
            out.add(
                Invariant::KeyedByEnvelopeId,
                Some(*at),
                format!("{id}, a foreign message_id, was used as an inbox key"),
            );
        }
    }
    for id in foreign.iter().filter(|id| fin.rows.contains(id)) {
        out.add(
            Invariant::KeyedByEnvelopeId,
            None,
            format!("{id}, a foreign message_id, is an inbox row"),
        );
    }
}
