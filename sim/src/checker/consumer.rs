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
//!   handler's own (never for database or broker trouble; an overrun only
//!   from a delivery's second, the first being run once more, or from a
//!   replay's or release's first: a run dropped with no result of its own
//!   overran; a failure of a consumer's one delivery it has not recorded
//!   when it runs that delivery's handler again was forgotten with its
//!   transaction, and answers no later record); a delivery is
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
//!   inbox is asked to store it at most once per delivery. On an ordered
//!   subscription a keyed one keeps its place in its key's order instead:
//!   it leaves a record under its key and number (a dead-lettered inbox
//!   row, or one held behind an earlier event of its key) and is never
//!   handled; it may then be acked (held) or requeued (it comes back). Its
//!   key's later events wait behind the record (`key_applied_in_order`)
//!   until an operator skips it.
//! - **keyed by envelope id**: nothing is ever keyed by a foreign AMQP
//!   `message_id`.
//! - **ack after commit**: a delivery is acked only once its event's
//!   processed mark has committed (the ADR's step 4: commit, then ack;
//!   with batches, after the batch's commit).
//! - **dead letters kept**: on quorum queues, every delivery the broker
//!   took back without requeue is in the dead-letter queue at the end, or
//!   still waiting for it to take it, once for each time; a dead-letter
//!   queue without a leader, a majority or room delays a dead letter and
//!   never drops it. (A classic queue's dead letters are lost while its
//!   node is down: the cost the quorum default exists to avoid.)

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::model::{ConsumerFinal, Model};
use crate::trace::{Event, FaultKind, HandlerResult, Replay, Settle};

/// A handler failure not yet matched by a record: when it happened, when
/// its delivery was settled after it, and how many deliveries of its event
/// that client still held unsettled (one of them is the failure's).
type Unmatched = (Duration, Option<Duration>, u32);

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let Some(fin) = &ctx.fin.consumer else {
        return;
    };
    let after_retention = effects(ctx, out);
    budget(ctx, out);
    every_failure_counted(ctx, out);
    batch_max(ctx, out);
    trace_context_carried(ctx, out);
    replay(ctx, out);
    replay_exact(ctx, out);
    rejected(ctx, out);
    keyed(ctx, out);
    acked_after_commit(ctx, out);
    dead_letters_kept(ctx, fin, out);
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

/// The consumer a side or control connection belongs to
/// (`consumer-1#2/side`).
fn consumer_of(client: &str) -> &str {
    client.split('/').next().unwrap_or(client)
}

/// The deliveries each client holds unsettled, by event: from its
/// `Delivered` to its `Settled`.
#[derive(Default)]
struct InHand<'e>(BTreeMap<(&'e str, Uuid), u32>);

impl<'e> InHand<'e> {
    fn delivered(&mut self, client: &'e str, event: Uuid) {
        *self.0.entry((client, event)).or_insert(0) += 1;
    }

    /// One settled; whether the client now holds none of `event`.
    fn settled(&mut self, client: &'e str, event: Uuid) -> bool {
        let Some(n) = self.0.get_mut(&(client, event)) else {
            return true;
        };
        *n = n.saturating_sub(1);
        if *n > 0 {
            return false;
        }
        self.0.remove(&(client, event));
        true
    }

    fn count(&self, client: &'e str, event: Uuid) -> u32 {
        self.0.get(&(client, event)).copied().unwrap_or(0)
    }
}

/// Handler failures of one consumer for one event not yet recorded.
#[derive(Default)]
struct Credits {
    /// Of runs of the one delivery the consumer held.
    delivery: u32,
    /// Of other runs (replays, releases, beside a duplicate).
    other: u32,
}

impl Credits {
    fn any(&self) -> bool {
        self.delivery + self.other > 0
    }

    fn take(&mut self) {
        if self.delivery > 0 {
            self.delivery -= 1;
        } else {
            self.other = self.other.saturating_sub(1);
        }
    }
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

/// What [`budget`] knows so far of the run.
#[derive(Default)]
struct Budget<'e> {
    /// Handler failures not yet recorded, per consumer and event: those of
    /// a run of the one delivery the consumer held (forgotten when it
    /// runs that delivery's handler again), and the others.
    handler_failures: BTreeMap<(&'e str, Uuid), Credits>,
    records: BTreeMap<(&'e str, Uuid), Records>,
    replaying: BTreeSet<(&'e str, Uuid)>,
    /// The rows each operator's replay under way asked for, by client.
    asked: BTreeMap<&'e str, BTreeSet<Uuid>>,
    /// Rows marked dead-lettered: the mark stays until a replay resets it.
    dead: BTreeSet<Uuid>,
    /// When each client last took a delivery of each event, and when the
    /// latest failover came: a batch a failover came behind is requeued
    /// whole, failure or not (its commits may be gone).
    taken_at: BTreeMap<(&'e str, Uuid), Duration>,
    failed_over_at: Option<Duration>,
    /// An ordered subscription's deferrals: what was delivered, and what
    /// took effect or was skipped, so far.
    delivered: BTreeSet<Uuid>,
    settled_for_good: BTreeSet<Uuid>,
    /// Deliveries each client holds unsettled.
    open: InHand<'e>,
    /// Events whose handler overran in a client while it held a delivery
    /// of theirs, since it last held none.
    overran_in_hand: BTreeSet<(&'e str, Uuid)>,
    /// Handler runs under way that reported no result yet.
    unreported: BTreeSet<(&'e str, Uuid)>,
}

fn budget<'a>(ctx: &Context<'a>, out: &mut Findings) {
    let mut b: Budget<'a> = Budget::default();
    for (at, e) in ctx.events {
        let at = Some(*at);
        match e {
            Event::Delivered {
                client, message_id, ..
            } => {
                if let Some(event) = ctx.model.event_of(message_id.as_deref()) {
                    b.delivered.insert(event);
                    b.open.delivered(client, event);
                    if let Some(at) = at {
                        b.taken_at.insert((client.as_str(), event), at);
                    }
                }
            }
            Event::FailedOver { .. } => b.failed_over_at = at,
            Event::InboxCommitted { effects, .. } => {
                b.settled_for_good.extend(effects.iter().map(|(_, id)| *id));
            }
            Event::InboxSkipped { events, .. } => b.settled_for_good.extend(events.iter().copied()),
            Event::InboxDeleted { ids } => {
                for id in ids {
                    b.settled_for_good.remove(id);
                }
            }
            Event::HandlerStarted { .. }
            | Event::HandlerEnded { .. }
            | Event::HandlerRan { .. }
            | Event::ConstraintFailed { .. } => b.runs(e),
            Event::ReplayStarted { .. }
            | Event::ReplayEnded { .. }
            | Event::InboxReset { .. }
            | Event::Replayed { .. }
            | Event::ReplayReleased { .. } => b.replays(e),
            // A keyed delivery given up on: its record (`rejected`).
            Event::InboxFailure {
                event_id,
                dead_lettered: true,
                ..
            } if ctx.model.given_up.contains(event_id) => {
                b.dead.insert(*event_id);
            }
            Event::InboxFailure { event_id, .. } if ctx.model.given_up.contains(event_id) => {}
            Event::InboxFailure {
                client,
                event_id,
                attempts,
                dead_lettered,
            } => {
                let failure = (client.as_str(), *event_id, *attempts, *dead_lettered);
                b.failure(ctx, at, failure, out);
            }
            Event::Settled {
                client,
                message_id,
                settle,
            } => b.settled(
                ctx,
                at,
                client.as_str(),
                message_id.as_deref(),
                *settle,
                out,
            ),
            _ => {}
        }
    }
}

impl<'e> Budget<'e> {
    /// Whether `client`'s runs of `event` now are its one delivery's: it
    /// holds exactly one, and no operator's replay of its is under way.
    fn one_delivery(&self, client: &'e str, event: Uuid) -> bool {
        self.open.count(client, event) == 1 && !self.asked.contains_key(client)
    }

    /// A failure of the handler's own: an attempt the consumer owes.
    fn failed(&mut self, client: &'e str, event: Uuid) {
        let delivery = self.one_delivery(client, event);
        let c = self
            .handler_failures
            .entry((consumer_of(client), event))
            .or_default();
        if delivery {
            c.delivery += 1;
        } else {
            c.other += 1;
        }
    }

    /// A handler run begins. A consumer runs its one delivery's handler
    /// again only once that delivery's earlier failures are recorded, or
    /// forgotten with a transaction that did not commit (met again, then,
    /// if they recur): none of them can be recorded after this. (With a
    /// duplicate in hand, or beside a replay or a release, a failure of
    /// another run may still be recorded by its own pass.)
    fn started(&mut self, client: &'e str, event: Uuid) {
        self.unreported.insert((client, event));
        if self.one_delivery(client, event)
            && let Some(c) = self.handler_failures.get_mut(&(consumer_of(client), event))
        {
            c.delivery = 0;
        }
    }

    /// What handler runs tell the budget: the failures they owe records.
    fn runs(&mut self, e: &'e Event) {
        match e {
            // Run, so delivered (whatever its `message_id` said: a foreign
            // publisher's may name no event).
            Event::HandlerStarted {
                client, event_id, ..
            } => {
                self.delivered.insert(*event_id);
                self.started(client, *event_id);
            }
            // A run the subscriber dropped with no result of its own: it
            // overran (at its deadline; or its host went down).
            Event::HandlerEnded { client, event_id } => self.ended(client, *event_id),
            Event::HandlerRan {
                client,
                event_id,
                result,
            } => {
                self.unreported.remove(&(client.as_str(), *event_id));
                match result {
                    HandlerResult::Failed => self.failed(client, *event_id),
                    HandlerResult::Overran => self.overran(client, *event_id),
                    HandlerResult::Ok | HandlerResult::Unavailable => {}
                }
            }
            // The handler's work cannot commit: its data breaks a deferred
            // constraint (its `Ok` notwithstanding).
            Event::ConstraintFailed { client, events, .. } => {
                for id in events {
                    self.failed(client, *id);
                }
            }
            _ => {}
        }
    }

    /// A handler run ended: dropped with no result of its own, it overran.
    fn ended(&mut self, client: &'e str, event: Uuid) {
        if self.unreported.remove(&(client, event)) {
            self.overran(client, event);
        }
    }

    /// A handler run that overran: a failure of the handler's (an attempt
    /// to record) only where the subscriber counts one. A delivery's first
    /// overrun is not: the database answering at its deadline, the run may
    /// still have waited on a stall that just ended, so the delivery runs
    /// once more, watched, and only a second overrun counts (if the
    /// database answered throughout, which the record then says). A run
    /// that is no delivery's (a replay, or the release of a held row) has
    /// no retry in place: its first overrun counts.
    fn overran(&mut self, client: &'e str, event: Uuid) {
        let in_hand = self.open.count(client, event) > 0 && !self.asked.contains_key(client);
        if !in_hand || !self.overran_in_hand.insert((client, event)) {
            self.failed(client, event);
        }
    }

    /// What replays tell the budget: while an operator's replay runs, a
    /// failure its client records of a row it asked for is the replay's (a
    /// budget of one), a row within its budget keeping its attempts; after
    /// a reset, the next failure that client records of the row is the
    /// replay's or release's, not a delivery's.
    fn replays(&mut self, e: &'e Event) {
        match e {
            Event::ReplayStarted {
                client,
                ids,
                matching,
                ..
            } => {
                let asked = matching.iter().chain(ids.iter().flatten()).copied();
                self.asked.insert(client, asked.collect());
            }
            Event::ReplayEnded { client, .. } => {
                self.asked.remove(client.as_str());
            }
            Event::InboxReset { client, ids } => {
                for id in ids {
                    self.replaying.insert((client.as_str(), *id));
                    self.dead.remove(id);
                }
            }
            Event::Replayed {
                client, event_id, ..
            }
            | Event::ReplayReleased {
                client, event_id, ..
            } => {
                self.replaying.remove(&(client.as_str(), *event_id));
            }
            _ => {}
        }
    }

    /// A failure recorded in the inbox: a handler's failure answers it, and
    /// it is dead-lettered exactly at the budget.
    fn failure(
        &mut self,
        ctx: &Context<'_>,
        at: Option<Duration>,
        (client, event_id, attempts, dead_lettered): (&'e str, Uuid, i32, bool),
        out: &mut Findings,
    ) {
        let max = ctx.limits.consumer_max_attempts;
        let key = (consumer_of(client), event_id);
        match self.handler_failures.get_mut(&key).filter(|c| c.any()) {
            Some(c) => c.take(),
            None => out.add(
                Invariant::AttemptOnlyOnHandlerFailure,
                at,
                format!(
                    "{client} recorded attempt {attempts} of {event_id} without a handler failure"
                ),
            ),
        }
        let was_dead = if dead_lettered {
            !self.dead.insert(event_id)
        } else {
            self.dead.contains(&event_id)
        };
        if self.replaying.remove(&(client, event_id)) {
            return; // a replay's budget is one (see `replay`)
        }
        // An operator's replay of a row still within its budget: its budget
        // of one counts from the row's attempts (no reset). The record is a
        // delivery's or the replay's; either counts.
        let replays_within_budget = dead_lettered
            && (attempts as u32) < max
            && self
                .asked
                .get(client)
                .is_some_and(|asked| asked.contains(&event_id));
        if dead_lettered != (attempts as u32 >= max || was_dead) && !replays_within_budget {
            out.add(
                Invariant::DeadLetterAtBudget,
                at,
                format!("{event_id} recorded at attempt {attempts} of a budget of {max} with dead_lettered = {dead_lettered} (dead-lettered before: {was_dead})"),
            );
        }
        let r = self
            .records
            .entry((consumer_of(client), event_id))
            .or_default();
        if dead_lettered {
            r.at_budget += 1;
        } else {
            r.below_budget += 1;
        }
    }

    /// A settlement: a requeue or a dead-letter answers a failure record.
    fn settled(
        &mut self,
        ctx: &Context<'_>,
        at: Option<Duration>,
        client: &'e str,
        message_id: Option<&str>,
        settle: Settle,
        out: &mut Findings,
    ) {
        let max = ctx.limits.consumer_max_attempts;
        let Some(event) = ctx.model.event_of(message_id) else {
            return;
        };
        if self.open.settled(client, event) {
            self.overran_in_hand.remove(&(client, event));
        }
        let r = self.records.entry((client, event)).or_default();
        let Err(what) = r.answer(settle) else {
            return;
        };
        // Requeued because a failover came between the delivery and its
        // settlement (replicated before acked: the batch's commits may be
        // gone with the old primary).
        let taken = self.taken_at.get(&(client, event));
        if settle == Settle::Requeue
            && taken.is_some_and(|t| self.failed_over_at.is_some_and(|f| f >= *t))
        {
            return;
        }
        // Requeued behind an earlier event of its key.
        if settle == Settle::Requeue
            && super::ordered::deferral_justified(
                ctx,
                event,
                &self.delivered,
                &self.settled_for_good,
            )
        {
            return;
        }
        let side = if settle == Settle::Requeue {
            "below"
        } else {
            "reaching"
        };
        out.add(
            Invariant::DeadLetterAtBudget,
            at,
            format!("{client} {what} {event} without a failure record {side} the budget of {max}"),
        );
    }
}

/// Every delivery of an event written with trace context carries it: the
/// context travels with the row, so a republish carries it too.
fn trace_context_carried(ctx: &Context<'_>, out: &mut Findings) {
    for (at, e) in ctx.events {
        let Event::Delivered {
            client,
            message_id: Some(mid),
            trace,
            ..
        } = e
        else {
            continue;
        };
        let Some(written) = Uuid::parse_str(mid)
            .ok()
            .and_then(|id| ctx.model.traced.get(&id))
        else {
            continue;
        };
        if trace.as_ref() != Some(written) {
            out.add(
                Invariant::TraceContextCarried,
                Some(*at),
                format!("{client} got {mid} with trace context {trace:?}; it was written with {written:?}"),
            );
        }
    }
}

/// No transaction of deliveries holds more than the batch maximum, whatever
/// the prefetch lets a worker hold unacknowledged.
fn batch_max(ctx: &Context<'_>, out: &mut Findings) {
    let max = ctx.limits.consumer_batch_max;
    for (at, e) in ctx.events {
        if let Event::InboxBatch {
            client, deliveries, ..
        } = e
            && *deliveries > max
        {
            out.add(
                Invariant::BatchMax,
                Some(*at),
                format!(
                    "{client} applied {deliveries} deliveries in one transaction; the most is {max}"
                ),
            );
        }
    }
}

/// The `for_secs` of a fault's `Debug` text (the world's `FaultStart`
/// detail), if it has one.
fn fault_length(detail: &str) -> Option<Duration> {
    let rest = detail.split("for_secs: ").nth(1)?;
    let number: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    number.parse::<f64>().ok().map(Duration::from_secs_f64)
}

/// When each consumer (by host) met database trouble that lets a failure
/// it had go uncounted: its transaction's statement failed or its reply was
/// lost, the server ended its session or one of its statements (a
/// deadlock, a timeout), a ping of its subscriber failed or was slower than
/// the subscriber's probe (what the subscriber takes for a stall), the host
/// crashed, or a window in which its database was cut off or slow (then its
/// overruns were the database's).
#[derive(Default)]
struct Trouble {
    at: BTreeMap<String, Vec<Duration>>,
    /// (host or "" for every host, from, to).
    windows: Vec<(String, Duration, Duration)>,
}

impl Trouble {
    /// `slow`: a ping slower than this (the subscriber's probe) says the
    /// database stalled.
    fn of(events: &[(Duration, Event)], slow: Duration) -> Self {
        let mut t = Trouble::default();
        for (at, e) in events {
            let host = match e {
                Event::Pinged {
                    client,
                    took,
                    answered,
                } if !answered || *took > slow => Some(super::host_of(client)),
                Event::Fault {
                    kind: FaultKind::PgFailure | FaultKind::PgReplyLost | FaultKind::PgIdleTimeout,
                    detail,
                } => detail
                    .split([' ', '\''])
                    .find(|w| w.contains('#'))
                    .map(super::host_of),
                Event::LockWaitEnded { client, how, .. }
                    if *how != crate::trace::WaitEnd::Acquired =>
                {
                    Some(super::host_of(client))
                }
                Event::Host { host, up: false } => Some(host.as_str()),
                Event::FaultStart { kind, detail } => {
                    let len = fault_length(detail).unwrap_or_default();
                    let whose = match kind {
                        FaultKind::PgSlow => Some(String::new()),
                        FaultKind::Partition if detail.contains("b: \"pg\"") => detail
                            .split('"')
                            .nth(1)
                            .filter(|h| h.starts_with("consumer-"))
                            .map(str::to_owned),
                        _ => None,
                    };
                    if let Some(h) = whose {
                        t.windows.push((h, *at, *at + len));
                    }
                    None
                }
                _ => None,
            };
            if let Some(h) = host {
                t.at.entry(h.to_owned()).or_default().push(*at);
            }
        }
        t
    }

    /// Whether `client`'s host met trouble in `[from, to]`.
    fn between(&self, client: &str, from: Duration, to: Duration) -> bool {
        let host = super::host_of(client);
        self.at
            .get(host)
            .is_some_and(|v| v.iter().any(|t| (from..=to).contains(t)))
            || self
                .windows
                .iter()
                .any(|(h, a, b)| (h.is_empty() || h == host) && *a <= to && from <= *b)
    }
}

/// The other way of `attempt_only_on_handler_failure`: every failure of a
/// handler's own (an `Err`, a panic, a statement error it swallowed) is
/// recorded as an attempt by that consumer (or met by a delivery that finds
/// the event already processed), unless database trouble came during the
/// run or between the failure and the settlement of a delivery of that
/// event (the transaction holding the record did not commit, so the
/// handler ran again: the failure is met again, not lost), or the server
/// crashed before its record or was down when it failed (madsim seeds 1
/// and 3 and turmoil seed 112 of `partitioned_retention`: a failure lost to
/// the crash left its record to be taken by a later failure of the event). Failures and records are
/// matched oldest first per consumer and event, so a duplicate in flight
/// (two deliveries of one event at one consumer) is held to two records
/// for two failures, and a failure's delivery counts as settled once every
/// delivery of its event the consumer held when it failed is (the trace
/// does not say which one failed: turmoil seed 7 of
/// `producer_and_consumer_swarm`, a duplicate's ack came while the failed
/// delivery's rerun waited on a lock, and its consumer died before it
/// settled). Overruns are left out here: whether one counts depends on
/// the pings, and `budget` judges the records they make.
fn every_failure_counted(ctx: &Context<'_>, out: &mut Findings) {
    let probe = ctx.limits.handler_timeout / outbox::core::subscriber::PROBE_DIVISOR;
    let trouble = Trouble::of(ctx.events, probe);
    // Per (consumer, event): failures not yet matched by a record, each
    // with when it happened and when its delivery was settled after it.
    let mut pending: BTreeMap<(String, Uuid), VecDeque<Unmatched>> = BTreeMap::new();
    let mut held = InHand::default();
    let mut pg_down = false;
    for (at, e) in ctx.events {
        match e {
            // The server crashed: every record not committed by now is
            // lost with its transaction, whoever's (the failures are met
            // again on redelivery). Matching oldest first, a failure from
            // before the crash would otherwise take a later one's record.
            // A failure while it is down cannot be recorded until it is
            // back (the handler's session died with it).
            Event::Host { host, up } if host == "pg" => {
                pg_down = !*up;
                pending.clear();
            }
            Event::HandlerRan {
                client,
                event_id,
                result: HandlerResult::Failed,
            } if !pg_down => {
                let unsettled = held.count(client, *event_id).max(1);
                pending
                    .entry((client.clone(), *event_id))
                    .or_default()
                    .push_back((*at, None, unsettled));
            }
            Event::Delivered {
                client, message_id, ..
            } => {
                if let Some(id) = ctx.model.event_of(message_id.as_deref()) {
                    held.delivered(client, id);
                }
            }
            // Counted; or its delivery found the event already processed
            // (a duplicate delivery of it took effect first): no attempt
            // is owed for a failure the event's effect made moot.
            Event::InboxFailure {
                client, event_id, ..
            }
            | Event::InboxDuplicate { client, event_id } => {
                let key = (consumer_of(client).to_owned(), *event_id);
                if let Some(q) = pending.get_mut(&key) {
                    q.pop_front();
                }
            }
            Event::Settled {
                client, message_id, ..
            } => {
                let Some(id) = ctx.model.event_of(message_id.as_deref()) else {
                    continue;
                };
                held.settled(client, id);
                if let Some(q) = pending.get_mut(&(client.clone(), id)) {
                    for f in q.iter_mut().filter(|f| f.1.is_none()) {
                        f.2 = f.2.saturating_sub(1);
                        if f.2 == 0 {
                            f.1 = Some(*at);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    unmatched_failures(ctx, &trouble, pending, out);
}

/// The failures no record matched, each settled with no database trouble
/// in between. A failure whose delivery was not settled when the run
/// stopped was still being worked on: not judged here.
fn unmatched_failures(
    ctx: &Context<'_>,
    trouble: &Trouble,
    pending: BTreeMap<(String, Uuid), VecDeque<Unmatched>>,
    out: &mut Findings,
) {
    for ((client, id), q) in pending {
        for (at, until) in q.into_iter().filter_map(|(at, s, _)| Some((at, s?))) {
            // Trouble during the run counts too (it lasts the deadline at
            // most): a statement of the handler's that met it.
            let run_began = at.saturating_sub(ctx.limits.handler_timeout);
            if !trouble.between(&client, run_began, until) {
                out.add(
                    Invariant::EveryFailureCounted,
                    Some(at),
                    format!(
                        "{client}'s handler failed for {id} and no attempt was recorded for it \
                         (no database trouble until {:.3}s)",
                        until.as_secs_f64()
                    ),
                );
            }
        }
    }
}

/// One operator replay as the trace tells it.
#[derive(Default)]
struct ReplayRun<'a> {
    client: &'a str,
    at: Duration,
    ids: Option<&'a [Uuid]>,
    limit: usize,
    matching: &'a [Uuid],
    ended: Option<(bool, bool)>,
    /// The row its answer's cursor names (`next`).
    next: Option<Uuid>,
    /// Rows dead-lettered or given a failure record meanwhile (they may
    /// have come to match), processed meanwhile (they may have left).
    came: BTreeSet<Uuid>,
    left: BTreeSet<Uuid>,
    reset: BTreeSet<Uuid>,
    replayed: Vec<Uuid>,
    /// Held rows its rows released (their resets are theirs), and rows
    /// held when it began (a subscriber's own release may reset them).
    released: BTreeSet<Uuid>,
    held: BTreeSet<Uuid>,
}

impl ReplayRun<'_> {
    fn judge(&self, out: &mut Findings) {
        let Some((true, more)) = self.ended else {
            return; // cut short by the database: what it did is judged elsewhere
        };
        let (client, at) = (self.client, Some(self.at));
        let mut bad = |what: String| {
            out.add(
                Invariant::ReplayExact,
                at,
                format!("{client}'s replay {what}"),
            )
        };
        let selectable = |id: &Uuid| {
            self.ids.is_none_or(|ids| ids.contains(id))
                && (self.matching.contains(id) || self.came.contains(id))
        };
        for id in self.replayed.iter().chain(&self.reset) {
            let release = self.released.contains(id) || self.held.contains(id);
            if !selectable(id) && !release {
                bad(format!("touched {id}, which it was not asked for"));
            }
        }
        if self.replayed.len() > self.limit {
            bad(format!(
                "replayed {} rows past its limit of {}",
                self.replayed.len(),
                self.limit
            ));
        }
        if more && self.replayed.len() < self.limit {
            bad(format!(
                "said more match after {} rows of {}",
                self.replayed.len(),
                self.limit
            ));
        }
        // A row processed meanwhile may still have matched when the last
        // page was read (poison_to_dlq_and_replay, madsim seed 166): it
        // counts for `more`.
        let rest = self
            .matching
            .iter()
            .chain(&self.came)
            .any(|id| !self.replayed.contains(id) && selectable(id));
        if more && !rest {
            bad("said more match, and none did".into());
        }
        // A row that came to match meanwhile (an ordered subscription's own
        // release may dead-letter one) and was replayed took a place a
        // matching row would have had.
        let came_in = self
            .replayed
            .iter()
            .filter(|id| !self.matching.contains(id))
            .count();
        let owed = if more {
            self.limit.saturating_sub(came_in)
        } else {
            self.matching.len()
        };
        for id in self.matching.iter().take(owed) {
            if !self.replayed.contains(id) && !self.left.contains(id) {
                bad(format!("left out {id}, which matched (more: {more})"));
            }
        }
        self.judge_cursor(more, &mut bad);
    }

    /// Paging is exact: the cursor it answers is there exactly when more
    /// match, and is the place of the last row it replayed, so the next
    /// page (after it) neither steps past a matching row nor comes back
    /// to one.
    fn judge_cursor(&self, more: bool, bad: &mut impl FnMut(String)) {
        let Some(next) = self.next else {
            if more {
                bad("said more match and gave no place to go on from".into());
            }
            return;
        };
        if !more {
            bad(format!(
                "gave a place to go on from ({next}) with nothing more"
            ));
            return;
        }
        if !self.replayed.contains(&next) {
            bad(format!(
                "answered a cursor at {next}, a row it did not replay"
            ));
            return;
        }
        // In the order it pages by, no row it replayed comes after the
        // cursor (a row that came to match meanwhile has no place here).
        let place = |id: &Uuid| self.matching.iter().position(|m| m == id);
        if let Some(at) = place(&next)
            && let Some(past) = self
                .replayed
                .iter()
                .find(|id| place(id).is_some_and(|p| p > at))
        {
            bad(format!(
                "answered a cursor at {next}, before {past}, which it replayed too"
            ));
        }
    }
}

/// Replays touch exactly what they were asked for (see [`ReplayRun`]).
fn replay_exact(ctx: &Context<'_>, out: &mut Findings) {
    let mut runs: BTreeMap<&str, ReplayRun<'_>> = BTreeMap::new();
    let mut held_ever: BTreeSet<Uuid> = BTreeSet::new();
    for (at, e) in ctx.events {
        match e {
            Event::InboxHeld { events, .. } => {
                held_ever.extend(events.iter().copied());
                for r in runs.values_mut().filter(|r| r.ended.is_none()) {
                    r.held.extend(events.iter().copied());
                }
            }
            Event::ReplayStarted {
                client,
                ids,
                limit,
                matching,
                ..
            } => {
                if let Some(done) = runs.insert(
                    client,
                    ReplayRun {
                        client,
                        at: *at,
                        ids: ids.as_deref(),
                        limit: *limit as usize,
                        matching,
                        held: held_ever.clone(),
                        ..ReplayRun::default()
                    },
                ) {
                    done.judge(out);
                }
            }
            Event::ReplayEnded {
                client,
                ok,
                more,
                next,
            } => {
                if let Some(r) = runs.get_mut(client.as_str()) {
                    r.ended = Some((*ok, *more));
                    r.next = *next;
                }
            }
            Event::Replayed {
                client, event_id, ..
            } => {
                if let Some(r) = runs.get_mut(client.as_str()) {
                    r.replayed.push(*event_id);
                }
            }
            Event::ReplayReleased {
                client, event_id, ..
            } => {
                if let Some(r) = runs.get_mut(client.as_str()) {
                    r.released.insert(*event_id);
                }
            }
            Event::InboxFailure { event_id, .. } => {
                for r in runs.values_mut().filter(|r| r.ended.is_none()) {
                    r.came.insert(*event_id);
                }
            }
            Event::InboxCommitted { processed, .. } => {
                for r in runs.values_mut().filter(|r| r.ended.is_none()) {
                    r.left.extend(processed.iter().copied());
                }
            }
            Event::InboxReset { ids, .. } => {
                for r in runs.values_mut().filter(|r| r.ended.is_none()) {
                    r.reset.extend(ids.iter().copied());
                }
            }
            _ => {}
        }
    }
    for r in runs.into_values() {
        r.judge(out);
    }
}

/// What [`replay`] knows of each row so far.
#[derive(Default)]
struct ReplayBudgets {
    /// Whether each row's last failure record dead-lettered it (none since
    /// a reset).
    last_record: BTreeMap<Uuid, bool>,
    /// Rows whose dead-lettering record another replay then reset (an
    /// ordered subscription's own release may replay a row the operator's
    /// replay failed, before the operator's outcome is reported).
    superseded: BTreeSet<Uuid>,
    /// Runs that committed (a failure recorded, or a processed mark) by a
    /// client while its operator's replay was under way, of a row that
    /// was dead-lettered and had no reset: that run owed one.
    unreset_dead_runs: BTreeSet<(String, Uuid)>,
    /// Clients whose operator's replay is under way, each with the rows
    /// dead-lettered when it began and untouched since (a row another
    /// run records or resets meanwhile, a release racing, is no longer
    /// the replay's to judge).
    under_way: BTreeMap<String, BTreeSet<Uuid>>,
}

impl ReplayBudgets {
    /// A reset comes only to a dead-lettered row: once per replay or
    /// release.
    fn reset(&mut self, at: Duration, client: &str, ids: &[Uuid], out: &mut Findings) {
        for id in ids {
            self.touched(*id);
            self.unreset_dead_runs.remove(&(client.to_owned(), *id));
            if self.last_record.remove(id) == Some(true) {
                self.superseded.insert(*id);
            } else {
                out.add(
                    Invariant::ReplayFreshBudget,
                    Some(at),
                    format!("{client} reset the budget of {id}, which was not dead-lettered"),
                );
            }
        }
    }

    /// A run of `id` committed (a failure record, or its processed mark):
    /// one of a dead-lettered row with no reset owed one.
    fn ran(&mut self, client: &str, id: Uuid) {
        if self
            .under_way
            .get(client)
            .is_some_and(|dead| dead.contains(&id))
        {
            self.unreset_dead_runs.insert((client.to_owned(), id));
        }
        self.touched(id);
    }

    /// A record or reset of `id`: no replay under way judges it any more.
    fn touched(&mut self, id: Uuid) {
        for dead in self.under_way.values_mut() {
            dead.remove(&id);
        }
    }
}

fn replay(ctx: &Context<'_>, out: &mut Findings) {
    let mut b = ReplayBudgets::default();
    for (at, e) in ctx.events {
        match e {
            Event::ReplayStarted { client, .. } => {
                let dead = b
                    .last_record
                    .iter()
                    .filter(|(_, d)| **d)
                    .map(|(id, _)| *id)
                    .collect();
                b.under_way.insert(client.clone(), dead);
            }
            Event::ReplayEnded { client, .. } => {
                b.under_way.remove(client);
            }
            Event::InboxReset { client, ids } => b.reset(*at, client, ids, out),
            Event::InboxFailure {
                client,
                event_id,
                dead_lettered,
                ..
            } => {
                // Its record comes before its report.
                b.ran(client, *event_id);
                b.last_record.insert(*event_id, *dead_lettered);
            }
            Event::InboxCommitted {
                client, processed, ..
            } => {
                for id in processed {
                    b.ran(client, *id);
                }
            }
            Event::Replayed {
                client,
                event_id,
                outcome,
            }
            | Event::ReplayReleased {
                client,
                event_id,
                outcome,
            } => {
                // A fresh budget is a dead-lettered row's: one within its
                // budget keeps its attempts. An operator's replay runs each
                // row once, with a fresh budget; a release's later attempts
                // go on with the budget its first gave (and may meet a row
                // a racing release dead-lettered meanwhile, which a
                // delivery may run too).
                let ran = matches!(outcome, Replay::Applied | Replay::Failed);
                let owed = b.unreset_dead_runs.remove(&(client.clone(), *event_id))
                    && matches!(e, Event::Replayed { .. });
                if ran && owed {
                    out.add(
                        Invariant::ReplayFreshBudget,
                        Some(*at),
                        format!("{client} replayed {event_id} ({outcome:?}) without resetting its budget"),
                    );
                }
                let last = b.last_record.get(event_id);
                if *outcome == Replay::Failed
                    && last != Some(&true)
                    && !b.superseded.contains(event_id)
                {
                    out.add(
                        Invariant::ReplayKeepsFailedFindable,
                        Some(*at),
                        format!("{client}'s replay of {event_id} failed but left it not dead-lettered ({last:?})"),
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
    let (mut held, mut recorded) = (BTreeSet::new(), BTreeSet::new());
    // A refusal whose reply was lost on the way (the fault follows it at
    // once) never reached the subscriber, which rightly retried in place.
    let mut last_refusal: Option<(&str, Uuid)> = None;
    for (at, e) in ctx.events {
        let at = Some(*at);
        unrefuse_if_lost(last_refusal, e, &mut refused);
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
                && model.hostile.get(mid).is_some_and(|(k, _)| !k.applies())
                && !given_up_settled(ctx, mid, *settle, &held) =>
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
            Event::InboxHeld { events, .. } => held.extend(events.iter().copied()),
            // A keyed delivery given up on is recorded dead-lettered: its
            // record holds its key.
            Event::InboxFailure {
                event_id,
                dead_lettered: true,
                ..
            } if model.given_up.contains(event_id) => {
                recorded.insert(*event_id);
            }
            Event::InboxFailure {
                client, event_id, ..
            } if rejected.contains(event_id) || model.given_up.contains(event_id) => out.add(
                Invariant::RejectedAtOnce,
                at,
                format!("{client} recorded an attempt for rejected delivery {event_id}"),
            ),
            _ => {}
        }
    }
    rejected_at_end(model, fin, &refused, &deliveries, out);
    recorded.extend(held.iter().filter(|id| model.given_up.contains(id)));
    given_up_at_end(model, &recorded, out);
}

/// A refusal (`last`) whose reply `e` says was lost never reached the
/// subscriber: it does not count as asked.
fn unrefuse_if_lost(last: Option<(&str, Uuid)>, e: &Event, refused: &mut BTreeMap<Uuid, u32>) {
    if let (
        Some((client, id)),
        Event::Fault {
            kind: FaultKind::PgReplyLost,
            detail,
        },
    ) = (last, e)
        && detail.strip_prefix(client) == Some(" inbox_try_insert")
        && let Some(n) = refused.get_mut(&id)
    {
        *n -= 1;
    }
}

/// Whether a keyed delivery given up on (`mid`) was rightly settled with
/// `settle` (not a dead-letter): acked once its record was held behind an
/// earlier event of its key (`held`), or requeued (behind an earlier event
/// of its key that waits for a retry, or because the database could not
/// take its record: it comes back either way).
fn given_up_settled(ctx: &Context<'_>, mid: &str, settle: Settle, held: &BTreeSet<Uuid>) -> bool {
    let Some(id) = Uuid::parse_str(mid)
        .ok()
        .filter(|id| ctx.model.given_up.contains(id))
    else {
        return false;
    };
    match settle {
        Settle::Ack => held.contains(&id),
        Settle::Requeue => true,
        Settle::DeadLetter => true,
    }
}

/// At the end: each keyed delivery given up on left its record in the
/// inbox (dead-lettered, or held behind an earlier event of its key), the
/// record that holds its key's later events until an operator acts.
fn given_up_at_end(model: &Model, recorded: &BTreeSet<Uuid>, out: &mut Findings) {
    for id in &model.given_up {
        if !recorded.contains(id) {
            let (key, seq) = &model.keyed[id];
            out.add(
                Invariant::RejectedAtOnce,
                None,
                format!("keyed delivery {id} ({key:?} #{seq}) was given up on and left no record that holds its key"),
            );
        }
    }
}

/// At the end: each rejected delivery is in the dead-letter queue, the
/// inbox was asked to store it at most once per delivery, and it has no
/// inbox row.
fn rejected_at_end(
    model: &Model,
    fin: &ConsumerFinal,
    refused: &BTreeMap<Uuid, u32>,
    deliveries: &BTreeMap<&str, u32>,
    out: &mut Findings,
) {
    for (mid, (kind, envelope)) in model.hostile.iter().filter(|(_, (k, _))| !k.applies()) {
        let keyed = Uuid::parse_str(mid).is_ok_and(|id| model.given_up.contains(&id));
        if !keyed && !fin.dead_letters.contains_key(&Some(mid.clone())) {
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
        if !keyed && fin.rows.contains(id) {
            out.add(
                Invariant::RejectedAtOnce,
                None,
                format!("rejected delivery {id} ({kind:?}) has an inbox row"),
            );
        }
    }
}

/// On quorum queues, each delivery the broker took back without requeue is
/// in the dead-letter queue at the end, or waiting for it, as many times as
/// it was dead-lettered.
fn dead_letters_kept(ctx: &Context<'_>, fin: &ConsumerFinal, out: &mut Findings) {
    if !fin.quorum {
        return;
    }
    let mut sent: BTreeMap<&Option<String>, (u32, Duration)> = BTreeMap::new();
    for (at, e) in ctx.events {
        if let Event::Settled {
            message_id,
            settle: Settle::DeadLetter,
            ..
        } = e
        {
            let n = sent.entry(message_id).or_insert((0, *at));
            *n = (n.0 + 1, *at);
        }
    }
    for (mid, (n, last)) in sent {
        let kept = fin.dead_letters.get(mid).copied().unwrap_or(0)
            + fin.dead_letters_waiting.get(mid).copied().unwrap_or(0);
        if kept < n {
            out.add(
                Invariant::DeadLettersKept,
                Some(last),
                format!(
                    "{mid:?} was dead-lettered {n} time(s) but the dead-letter queue holds {kept}"
                ),
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
            // Held behind its key: recorded, acked, applied later.
            Event::InboxHeld { events, .. } => processed.extend(events.iter().copied()),
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
