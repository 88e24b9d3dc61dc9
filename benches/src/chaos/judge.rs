//! The verdict of a chaos run: the final state read from each database and
//! the dead-letter queues, judged by the simulation's own end-state rules
//! (`sim::checker::check_end_state`) and by the run's poison rules.
//!
//! The committed set is the producer's domain table (each event's row
//! commits in its transaction: the database, not the producer, is the
//! judge of what committed); what the broker stored is what the observer
//! saw; each subscription's effects are its domain table's rows.

use std::collections::{BTreeMap, BTreeSet};

use lapin::options::BasicGetOptions;
use sim::checker::{SubscriptionEnd, Verdict, check_end_state};
use sim::model::{FinalState, Model};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::observer::Observed;
use super::{SUBSCRIBER_MAX_ATTEMPTS, SUBSCRIPTIONS};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One subscription's final state.
#[derive(Debug, Default, Clone)]
pub struct SubscriptionState {
    /// Effect rows per event.
    pub effects: BTreeMap<Uuid, u32>,
    /// Each event's first effect, in the order the effects were written.
    pub applied: Vec<Uuid>,
    /// Inbox rows dead-lettered, with their attempts.
    pub dead_lettered: BTreeMap<Uuid, i32>,
    /// Messages in its dead-letter queue, by `message_id`.
    pub dlq: BTreeMap<String, u32>,
}

/// Everything the run left.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// Committed events, by kind (`order`, `poison`, `unpublishable`).
    pub committed: BTreeMap<Uuid, String>,
    /// Events whose transaction rolled back (the producer's record).
    pub rolled_back: BTreeSet<Uuid>,
    /// Outbox rows parked, unpublished, and every row's attempts.
    pub parked: BTreeSet<Uuid>,
    pub unpublished: BTreeSet<Uuid>,
    pub attempts: BTreeMap<Uuid, i32>,
    /// Every row a mark set `published_at` on: (row, its claim's holder
    /// then, the marking replica).
    pub marks: Vec<(Uuid, Option<String>, String)>,
    /// Keyed rows of the outbox: their ordering key and number.
    pub keyed: BTreeMap<Uuid, (String, i64)>,
    /// What the observer saw.
    pub observed: Observed,
    /// Per subscription, by name.
    pub subscriptions: BTreeMap<String, SubscriptionState>,
}

impl Outcome {
    /// The committed events of `kind`.
    pub fn of_kind(&self, kind: &str) -> BTreeSet<Uuid> {
        self.committed
            .iter()
            .filter(|(_, k)| k.as_str() == kind)
            .map(|(id, _)| *id)
            .collect()
    }
}

/// Reads the producer's tables.
pub async fn read_orders(pool: &PgPool, out: &mut Outcome) -> Result<(), BoxError> {
    for r in sqlx::query("SELECT event_id, kind FROM chaos_orders")
        .fetch_all(pool)
        .await?
    {
        out.committed.insert(r.get("event_id"), r.get("kind"));
    }
    for r in sqlx::query(
        "SELECT id, published_at IS NOT NULL AS published, parked_at IS NOT NULL AS parked, attempts, \
         ordering_key, key_seq FROM event_outbox",
    )
    .fetch_all(pool)
    .await?
    {
        let id: Uuid = r.get("id");
        if !r.get::<bool, _>("published") {
            out.unpublished.insert(id);
            if r.get::<bool, _>("parked") {
                out.parked.insert(id);
            }
        }
        out.attempts.insert(id, r.get("attempts"));
        let key: Option<String> = r.get("ordering_key");
        if let (Some(key), Some(seq)) = (key, r.get::<Option<i64>, _>("key_seq")) {
            out.keyed.insert(id, (key, seq));
        }
    }
    for r in sqlx::query("SELECT id, claimed_by, marked_by FROM chaos_marks")
        .fetch_all(pool)
        .await?
    {
        out.marks
            .push((r.get("id"), r.get("claimed_by"), r.get("marked_by")));
    }
    Ok(())
}

/// Reads one subscription's tables.
pub async fn read_subscription(pool: &PgPool) -> Result<SubscriptionState, BoxError> {
    let mut s = SubscriptionState::default();
    for r in sqlx::query("SELECT event_id, count(*) AS n FROM chaos_effects GROUP BY event_id")
        .fetch_all(pool)
        .await?
    {
        s.effects
            .insert(r.get("event_id"), r.get::<i64, _>("n") as u32);
    }
    let mut seen = BTreeSet::new();
    for r in sqlx::query("SELECT event_id FROM chaos_effects ORDER BY n")
        .fetch_all(pool)
        .await?
    {
        let id: Uuid = r.get("event_id");
        if seen.insert(id) {
            s.applied.push(id);
        }
    }
    for r in
        sqlx::query("SELECT event_id, attempts FROM event_inbox WHERE dead_lettered_at IS NOT NULL")
            .fetch_all(pool)
            .await?
    {
        s.dead_lettered.insert(r.get("event_id"), r.get("attempts"));
    }
    Ok(s)
}

/// Takes every message out of `queue` (a dead-letter queue), by
/// `message_id`.
pub async fn drain_queue(amqp: &str, queue: &str) -> Result<BTreeMap<String, u32>, BoxError> {
    let conn = super::connect_any(amqp).await?;
    let ch = conn.create_channel().await?;
    let mut ids = BTreeMap::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await?
    {
        let id = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str().to_owned())
            .unwrap_or_default();
        *ids.entry(id).or_insert(0) += 1;
    }
    super::close(conn).await;
    Ok(ids)
}

/// One rule's result.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The rule's name (the simulation's invariant name where it is one).
    pub name: String,
    /// What it says.
    pub says: &'static str,
    /// Violations (all counted, a few listed).
    pub violations: usize,
    pub examples: Vec<String>,
}

/// Every rule and how the run kept it.
#[derive(Debug, Clone)]
pub struct Judgement {
    pub rules: Vec<Rule>,
    /// The simulation checker's verdict on the end state.
    pub verdict: Verdict,
}

impl Judgement {
    /// True if every rule held.
    pub fn ok(&self) -> bool {
        self.rules.iter().all(|r| r.violations == 0)
    }
}

const EXAMPLES: usize = 5;

fn rule(name: &str, says: &'static str, violations: Vec<String>) -> Rule {
    Rule {
        name: name.to_owned(),
        says,
        violations: violations.len(),
        examples: violations.into_iter().take(EXAMPLES).collect(),
    }
}

/// The simulation's end-state invariants, with what each says.
const SIM_RULES: [(&str, &str); 6] = [
    (
        "lost",
        "every committed, publishable event reached the broker",
    ),
    (
        "phantom_publish",
        "the broker holds no event that was not committed",
    ),
    (
        "undrained",
        "no committed, publishable row is left unpublished",
    ),
    (
        "unpublishable_parks",
        "a row no broker accepts parks and is never published",
    ),
    (
        "exactly_once_effect",
        "each subscription applied each of its events exactly once",
    ),
    (
        "phantom_effect",
        "no subscription applied an event that was not committed",
    ),
];

/// Judges `o`.
pub fn judge(o: &Outcome) -> Judgement {
    let unpublishable = o.of_kind("unpublishable");
    let poison = o.of_kind("poison");
    let verdict = sim_verdict(o, &unpublishable, &poison);
    let mut rules = sim_rules(&verdict);
    // The #478 guard, from the database's own audit of each mark.
    rules.push(rule(
        "claimed_by_guard",
        "a mark changes only rows the marking replica holds",
        o.marks
            .iter()
            .filter(|(_, holder, marker)| holder.as_deref() != Some(marker.as_str()))
            .map(|(id, holder, marker)| {
                format!("{id} marked published by {marker} while {holder:?} held its claim")
            })
            .collect(),
    ));
    // Parking: exactly the unpublishable rows, nothing else.
    rules.push(rule(
        "only_unpublishable_parks",
        "nothing but the rows no broker accepts parked",
        o.parked
            .difference(&unpublishable)
            .map(|id| {
                format!(
                    "{id} ({}) parked",
                    o.committed.get(id).map_or("?", String::as_str)
                )
            })
            .collect(),
    ));
    rules.extend(dead_letter_rules(o, &poison));
    rules.extend(order_rules(o));
    rules.push(rule(
        "observer_saw_only_envelopes",
        "every message the observer saw carries an envelope id",
        (0..o.observed.foreign)
            .map(|_| "a message without a UUID message_id".to_owned())
            .collect(),
    ));
    Judgement { rules, verdict }
}

/// The simulation checker's verdict on the end state `o`.
fn sim_verdict(o: &Outcome, unpublishable: &BTreeSet<Uuid>, poison: &BTreeSet<Uuid>) -> Verdict {
    let model = Model {
        committed: o.committed.keys().copied().collect(),
        rolled_back: o.rolled_back.clone(),
        unpublishable: unpublishable.clone(),
        ..Model::default()
    };
    let fin = FinalState {
        stored: o.observed.stored.clone(),
        parked: o.parked.clone(),
        attempts: o.attempts.clone(),
        unpublished: o.unpublished.clone(),
        ..FinalState::default()
    };
    let publishable: BTreeSet<Uuid> = model.publishable().copied().collect();
    let mut expected: BTreeMap<String, BTreeSet<Uuid>> = BTreeMap::new();
    for s in SUBSCRIPTIONS {
        let e = if s.fails {
            publishable.difference(poison).copied().collect()
        } else {
            publishable.clone()
        };
        expected.insert(s.name.to_owned(), e);
    }
    let empty = SubscriptionState::default();
    let ends: Vec<SubscriptionEnd<'_>> = SUBSCRIPTIONS
        .iter()
        .map(|s| SubscriptionEnd {
            name: s.name,
            expected: &expected[s.name],
            effects: &o.subscriptions.get(s.name).unwrap_or(&empty).effects,
        })
        .collect();
    check_end_state(&model, &fin, &ends)
}

/// [`SIM_RULES`] as the verdict kept them.
fn sim_rules(verdict: &Verdict) -> Vec<Rule> {
    SIM_RULES
        .iter()
        .map(|(name, says)| {
            let found: Vec<String> = verdict
                .violations
                .iter()
                .filter(|v| v.invariant.name() == *name)
                .map(|v| v.detail.clone())
                .collect();
            let n = verdict
                .counts
                .iter()
                .find(|(i, _)| i.name() == *name)
                .map_or(0, |(_, n)| *n);
            Rule {
                name: (*name).to_owned(),
                says,
                violations: n,
                examples: found,
            }
        })
        .collect()
}

/// Dead letters: each poison event at shipping, at its budget, and in its
/// dead-letter queue; nothing else anywhere.
fn dead_letter_rules(o: &Outcome, poison: &BTreeSet<Uuid>) -> [Rule; 2] {
    let empty = SubscriptionState::default();
    let mut dead = Vec::new();
    let mut stray = Vec::new();
    for s in SUBSCRIPTIONS {
        let state = o.subscriptions.get(s.name).unwrap_or(&empty);
        let must: BTreeSet<Uuid> = if s.fails {
            poison.clone()
        } else {
            BTreeSet::new()
        };
        for id in &must {
            match state.dead_lettered.get(id) {
                None => dead.push(format!("[{}] poison {id} is not dead-lettered", s.name)),
                // A republished copy after the dead-letter runs and fails
                // again: attempts past the budget are a duplicate's.
                Some(a) if *a < SUBSCRIBER_MAX_ATTEMPTS as i32 => dead.push(format!(
                    "[{}] poison {id} dead-lettered after {a} attempts (budget {SUBSCRIBER_MAX_ATTEMPTS})",
                    s.name
                )),
                Some(_) => {}
            }
            if !state.dlq.contains_key(&id.to_string()) {
                dead.push(format!(
                    "[{}] poison {id} is not in {}.dlq",
                    s.name, s.queue
                ));
            }
        }
        for id in state.dead_lettered.keys().filter(|id| !must.contains(id)) {
            stray.push(format!("[{}] {id} dead-lettered in the inbox", s.name));
        }
        for mid in state
            .dlq
            .keys()
            .filter(|m| Uuid::parse_str(m).map_or(true, |id| !must.contains(&id)))
        {
            stray.push(format!("[{}] {mid} in {}.dlq", s.name, s.queue));
        }
    }
    [
        rule(
            "poison_dead_lettered",
            "each poison event is dead-lettered at shipping, at its budget, into shipping's DLQ",
            dead,
        ),
        rule(
            "only_poison_dead_lettered",
            "nothing but poison events is dead-lettered, in either subscription",
            stray,
        ),
    ]
}

/// Each ordering key's order, at the broker and in each subscription.
fn order_rules(o: &Outcome) -> [Rule; 2] {
    let empty = SubscriptionState::default();
    let mut applied = Vec::new();
    for s in SUBSCRIPTIONS {
        let state = o.subscriptions.get(s.name).unwrap_or(&empty);
        applied.extend(out_of_order(&o.keyed, &state.applied, s.name));
    }
    [
        rule(
            "key_published_in_order",
            "one ordering key's events first reached the broker in the order their transactions committed",
            out_of_order(&o.keyed, &o.observed.first_arrivals, "the broker"),
        ),
        rule(
            "key_applied_in_order",
            "each subscription applied one ordering key's events in the order their transactions committed, none missing before another",
            applied,
        ),
    ]
}

/// Where `order` (event ids, first sight of each) breaks the order of
/// their keys: an event seen while an earlier event of its key had not
/// been (numbers from 1, no gaps: the outbox numbers a key's committed
/// events so), at `place`.
fn out_of_order(keyed: &BTreeMap<Uuid, (String, i64)>, order: &[Uuid], place: &str) -> Vec<String> {
    let mut next: BTreeMap<&str, i64> = BTreeMap::new();
    let mut found = Vec::new();
    for id in order {
        let Some((key, seq)) = keyed.get(id) else {
            continue;
        };
        let expected = next.entry(key.as_str()).or_insert(1);
        if *seq != *expected {
            found.push(format!(
                "[{place}] {id}, number {seq} of key {key:?}, came when number {expected} was due"
            ));
        }
        *expected = (*expected).max(*seq + 1);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    /// Events 1..=3 of key "a", 4..=5 of key "b".
    fn keyed() -> BTreeMap<Uuid, (String, i64)> {
        [
            (1, "a", 1),
            (2, "a", 2),
            (3, "a", 3),
            (4, "b", 1),
            (5, "b", 2),
        ]
        .into_iter()
        .map(|(n, k, s)| (id(n), (k.to_owned(), s)))
        .collect()
    }

    #[test]
    fn each_keys_events_in_order_interleaved_with_others_are_in_order() {
        let order = [4, 1, 2, 5, 3, 9].map(id); // 9: unkeyed
        assert!(out_of_order(&keyed(), &order, "x").is_empty());
    }

    #[test]
    fn a_later_event_first_or_a_missing_one_is_out_of_order() {
        let swapped = out_of_order(&keyed(), &[2, 1, 3].map(id), "billing");
        assert_eq!(swapped.len(), 2, "{swapped:?}");
        assert!(swapped[0].contains("[billing]") && swapped[0].contains("number 2"));
        // Number 2 never came: 3 came when 2 was due.
        let gap = out_of_order(&keyed(), &[1, 3].map(id), "x");
        assert_eq!(gap.len(), 1, "{gap:?}");
        assert!(gap[0].contains("number 3") && gap[0].contains("number 2 was due"));
    }
}
