//! The fake PostgreSQL's `event_inbox` table and the simulated handler's
//! domain table, as the subscriber relies on them (ADR-018 amendment #433).
//!
//! Rows are keyed by (subscription, event id), as the issue-11 migration
//! keys `event_inbox`. Modelled: an inserted row is invisible to other
//! sessions until commit and, like every row a transaction touched, locked
//! until it ends; a second session's insert of the same event (or its
//! failure record) waits for that lock, as `INSERT … ON CONFLICT` does, so
//! deliveries of one event serialize; a row the transaction already holds
//! is seen as the transaction left it; a new row is inserted marked
//! processed (a failure record clears the mark), as `inbox_try_insert.sql`
//! does; commit applies the row, its `processed` mark and the handler's
//! effects together, rollback (or a dropped connection) none of them;
//! savepoints (one per delivery of a batch; a rollback reaches the latest
//! and undoes everything since, row locks included), and failure records
//! in the handler's transaction that roll back to it, count the attempt and
//! mark the row dead-lettered at the budget, taking effect at commit;
//! replay listing, budget reset and the retention sweep. A row whose data
//! PostgreSQL would refuse (see `jsonb.rs`) is refused with its SQLSTATE.
//!
//! The handler's domain table: an effect row per delivery, which waits
//! while another session holds the table locked (the `DomainLock` fault),
//! and, for effects with a key, a deferred check that no two rows share
//! the key: the insert never fails, the check does, at `InboxCheck` (`SET
//! CONSTRAINTS ALL IMMEDIATE`) or at COMMIT. A `unique.` key is under a
//! deferred unique constraint (`UNIQUE … DEFERRABLE INITIALLY DEFERRED`):
//! its check waits first for any other open transaction that wrote the same
//! key (PostgreSQL's recheck waits for the writer to end) and fails with
//! 23505. A `trigger.` key is under a deferred constraint trigger that
//! counts the rows it can see: it waits for nobody, so two transactions can
//! both pass their checks and the second to commit fails at its COMMIT,
//! with the trigger's `RAISE` (P0001).
//! The server sessions live in `mod.rs`; this module is their inbox logic.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use super::jsonb::{Refusal, jsonb_refusal, text_refusal};
use super::partitions::Home;
use crate::trace::{Event, Trace};
use crate::wire::{PgError, PgReply, PgRequest, WireInboxEntry, WireInboxRow, WireInsertOutcome};

/// Why PostgreSQL would refuse to store `entry`, if it would.
fn refusal(entry: &WireInboxEntry) -> Option<Refusal> {
    text_refusal(&entry.subscription)
        .or_else(|| text_refusal(&entry.routing_key))
        .or_else(|| jsonb_refusal(&entry.payload))
}

/// An inbox row's key: (subscription, event id).
type Key = (String, Uuid);

fn key(subscription: &str, event_id: Uuid) -> Key {
    (subscription.to_owned(), event_id)
}

/// Where an inbox request came from, for the trace.
pub struct Caller<'a> {
    pub session: u64,
    pub client: &'a str,
    pub trace: &'a Trace,
}

/// What `inbox_list_unprocessed.sql` selects: unprocessed rows, filtered.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub ids: Option<Vec<Uuid>>,
    pub subscription: Option<String>,
    pub routing_key: Option<String>,
    pub dead_lettered_only: bool,
    /// Rows after this (received ms, event id) only.
    pub after: Option<(u64, Uuid)>,
    /// Rows whose event payload holds a value at a path only
    /// (`inbox_list_unprocessed.sql`'s `#>` and jsonb equality).
    pub payload_field: Option<outbox::core::ports::PayloadField>,
}

impl ListFilter {
    /// Whether `r` is selected.
    pub fn keeps(&self, r: &InboxRow) -> bool {
        r.processed_ms.is_none()
            && self.after.is_none_or(|a| (r.received_ms, r.event_id) > a)
            && self
                .ids
                .as_ref()
                .is_none_or(|ids| ids.contains(&r.event_id))
            && self
                .subscription
                .as_ref()
                .is_none_or(|s| *s == r.subscription)
            && self
                .routing_key
                .as_ref()
                .is_none_or(|k| *k == r.routing_key)
            && (!self.dead_lettered_only || r.dead_lettered_ms.is_some())
            && self
                .payload_field
                .as_ref()
                .is_none_or(|f| payload_holds(&r.payload, f))
    }
}

/// Whether the envelope `payload` (its JSON text) holds `f`, as
/// PostgreSQL's `payload -> 'payload' #> path` compares: the string itself,
/// or a value that is no string and equals `f.value` read as JSON (jsonb
/// equality: numbers by value).
pub(super) fn payload_holds(payload: &str, f: &outbox::core::ports::PayloadField) -> bool {
    let Ok(envelope) = serde_json::from_str::<serde_json::Value>(payload) else {
        return false;
    };
    let found = f
        .path
        .iter()
        .try_fold(envelope.get("payload"), |v, step| match v? {
            serde_json::Value::Object(map) => Some(map.get(step)),
            serde_json::Value::Array(items) => Some(
                step.parse::<i64>()
                    .ok()
                    .and_then(|i| {
                        let len = items.len() as i64;
                        usize::try_from(if i < 0 { len + i } else { i }).ok()
                    })
                    .and_then(|i| items.get(i)),
            ),
            _ => None,
        })
        .flatten();
    match found {
        None => false,
        Some(serde_json::Value::String(s)) => *s == f.value,
        Some(v) => f.value_json().is_some_and(|want| jsonb_eq(v, &want)),
    }
}

/// jsonb's equality: numbers by value, objects by their keys' values,
/// arrays in order.
fn jsonb_eq(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value as V;
    match (a, b) {
        (V::Number(x), V::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64() == y.as_f64(),
        },
        (V::Array(x), V::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| jsonb_eq(x, y))
        }
        (V::Object(x), V::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| jsonb_eq(v, w)))
        }
        _ => a == b,
    }
}

/// One committed inbox row (times in the fake's milliseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxRow {
    pub event_id: Uuid,
    pub subscription: String,
    pub routing_key: String,
    pub payload: String,
    pub received_ms: u64,
    pub processed_ms: Option<u64>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub dead_lettered_ms: Option<u64>,
    /// Its ordering key and number (an ordered subscription's delivery).
    pub ordering: Option<(String, i64)>,
    /// Recorded held behind a dead-lettered event of its key.
    pub held_ms: Option<u64>,
    /// Skipped by an operator (processed without its effect).
    pub skipped_ms: Option<u64>,
}

impl InboxRow {
    /// Whether it is an unprocessed row of `subscription`'s `key` numbered
    /// below `seq`.
    fn waits_before(&self, subscription: &str, key: &str, seq: i64) -> bool {
        self.subscription == subscription
            && self
                .ordering
                .as_ref()
                .is_some_and(|(k, n)| k == key && *n < seq)
    }

    fn wire(&self) -> WireInboxRow {
        WireInboxRow {
            event_id: self.event_id,
            subscription: self.subscription.clone(),
            routing_key: self.routing_key.clone(),
            payload: self.payload.clone(),
            attempts: self.attempts,
            last_error: self.last_error.clone(),
            received_ms: self.received_ms,
            dead_lettered_ms: self.dead_lettered_ms,
            ordering: self.ordering.clone(),
            held: self.held_ms.is_some(),
        }
    }

    fn key(&self) -> Key {
        key(&self.subscription, self.event_id)
    }

    fn new(e: &WireInboxEntry, now: u64) -> Self {
        Self {
            event_id: e.event_id,
            subscription: e.subscription.clone(),
            routing_key: e.routing_key.clone(),
            payload: e.payload.clone(),
            received_ms: now,
            processed_ms: None,
            attempts: 0,
            last_error: None,
            dead_lettered_ms: None,
            ordering: e.ordering.clone(),
            held_ms: None,
            skipped_ms: None,
        }
    }
}

/// The committed inbox, its row locks and the handler's committed effects.
#[derive(Debug, Default, Clone)]
pub struct Inbox {
    rows: BTreeMap<Key, InboxRow>,
    /// Rows held by an open transaction, by session number.
    locks: BTreeMap<Key, u64>,
    /// Ordered subscriptions' key locks (`inbox_lock_keys.sql`'s advisory
    /// lock): (subscription, key) → the session whose transaction holds it.
    key_locks: BTreeMap<(String, String), u64>,
    /// Committed handler effects per (subscription, event).
    effects: BTreeMap<(String, Uuid), u32>,
    /// Committed unique keys of the domain table, and the event that took
    /// each.
    unique_keys: BTreeMap<String, Uuid>,
    /// Unique keys written by open transactions: key → session → count.
    uncommitted_keys: BTreeMap<String, BTreeMap<u64, u32>>,
    /// Another session holds the domain table locked (`DomainLock`):
    /// effect writes wait.
    pub domain_locked: bool,
    /// Every event ever marked processed (the janitor deletes rows; the
    /// world's quiescence needs to know what took effect).
    processed_ever: std::collections::BTreeSet<Uuid>,
    /// The partitioned layout, when the table has it (issue 28).
    pub partitions: Option<super::partitions::Partitions>,
}

/// One effect row an open transaction wrote to the domain table.
#[derive(Debug, Clone)]
struct EffectRow {
    subscription: String,
    event_id: Uuid,
    unique_key: Option<String>,
}

/// An open transaction's inbox work, applied at commit.
#[derive(Debug, Default)]
pub struct InboxTx {
    inserts: Vec<InboxRow>,
    processed: Vec<Key>,
    effects: Vec<EffectRow>,
    locked: Vec<Key>,
    /// Failed attempts recorded on rows this transaction locked (not
    /// inserted): (row, attempts, error, dead-lettered).
    failures: Vec<(Key, i32, String, bool)>,
    /// Rows given a fresh budget by a replay's insert, applied first at
    /// commit.
    resets: Vec<Key>,
    /// Existing rows this transaction marked held (`inbox_hold.sql`).
    holds: Vec<Key>,
    /// Key locks it holds, to its end (a savepoint's rollback keeps them:
    /// each is taken before its delivery's savepoint).
    key_locks: Vec<(String, String)>,
    /// Inbox inserts asked for (deliveries of the batch).
    tried: u32,
    /// Failed attempts recorded on rows this transaction inserted, each as
    /// it was recorded: (event, attempts, dead-lettered).
    insert_failures: Vec<(Uuid, i32, bool)>,
    /// The savepoint: how much handler work there was when it was set.
    savepoint: Option<Savepoint>,
}

/// A savepoint: how far each list of the transaction's work reached, and
/// the rows it had inserted as they stood, when it was set.
#[derive(Debug, Clone)]
struct Savepoint {
    inserts: Vec<InboxRow>,
    processed: usize,
    effects: usize,
    locked: usize,
    failures: usize,
    resets: usize,
    holds: usize,
    insert_failures: usize,
}

impl InboxTx {
    /// Whether the transaction did any inbox work.
    pub fn is_empty(&self) -> bool {
        self.inserts.is_empty()
            && self.locked.is_empty()
            && self.effects.is_empty()
            && self.key_locks.is_empty()
    }

    /// How many deliveries asked for their inbox row in it.
    pub fn deliveries(&self) -> u32 {
        self.tried
    }

    /// Whether a savepoint is set (`ROLLBACK TO SAVEPOINT` can recover an
    /// aborted transaction).
    pub fn has_savepoint(&self) -> bool {
        self.savepoint.is_some()
    }

    /// `SAVEPOINT canopy_handler`. Each delivery of a batch sets its own;
    /// `ROLLBACK TO SAVEPOINT` names the latest of that name, so the latest
    /// is the only one the subscriber can reach.
    fn set_savepoint(&mut self) {
        self.savepoint = Some(Savepoint {
            inserts: self.inserts.clone(),
            processed: self.processed.len(),
            effects: self.effects.len(),
            locked: self.locked.len(),
            failures: self.failures.len(),
            resets: self.resets.len(),
            holds: self.holds.len(),
            insert_failures: self.insert_failures.len(),
        });
    }

    /// `ROLLBACK TO SAVEPOINT`: everything since it goes, row locks taken
    /// since included (returned, for the caller to release, with the
    /// unique keys of the effects undone); the savepoint stays.
    fn rollback_to_savepoint(&mut self) -> Option<(Vec<Key>, Vec<String>)> {
        let sp = self.savepoint.clone()?;
        self.inserts = sp.inserts;
        self.processed.truncate(sp.processed);
        let undone = self.effects.split_off(sp.effects);
        self.failures.truncate(sp.failures);
        self.resets.truncate(sp.resets);
        self.holds.truncate(sp.holds);
        self.insert_failures.truncate(sp.insert_failures);
        let keys = undone.into_iter().filter_map(|e| e.unique_key).collect();
        Some((self.locked.split_off(sp.locked), keys))
    }

    /// Unique keys its effects wrote.
    fn unique_keys(&self) -> impl Iterator<Item = &String> {
        self.effects.iter().filter_map(|e| e.unique_key.as_ref())
    }

    /// The state of row `k` as this transaction sees it, if the transaction
    /// inserted or locked it: (processed, attempts).
    fn own_view(&self, k: &Key, committed: Option<&InboxRow>) -> Option<(bool, i32)> {
        if let Some(row) = self.inserts.iter().find(|r| r.key() == *k) {
            return Some((row.processed_ms.is_some(), row.attempts));
        }
        if !self.locked.contains(k) {
            return None;
        }
        let row = committed?;
        let processed = row.processed_ms.is_some() || self.processed.contains(k);
        let attempts = match self.failures.iter().rev().find(|f| f.0 == *k) {
            Some(f) => f.1,
            None if self.resets.contains(k) => 0,
            None => row.attempts,
        };
        Some((processed, attempts))
    }
}

/// What a commit applied, for the trace.
#[derive(Debug, Default)]
pub struct Committed {
    /// Rows given a fresh budget (replay).
    pub reset: Vec<Uuid>,
    pub processed: Vec<Uuid>,
    pub effects: Vec<(String, Uuid)>,
    /// Failed attempts recorded: (event, attempts, dead-lettered).
    pub failures: Vec<(Uuid, i32, bool)>,
    /// Rows recorded held.
    pub held: Vec<Uuid>,
}

impl Inbox {
    /// Every committed row.
    pub fn rows(&self) -> impl Iterator<Item = &InboxRow> {
        self.rows.values()
    }

    /// Forgets the open transactions' locks and uncommitted keys (a
    /// promoted standby has none).
    pub fn clear_open(&mut self) {
        self.locks.clear();
        self.key_locks.clear();
        self.uncommitted_keys.clear();
    }

    /// Committed handler effects per (subscription, event).
    pub fn effects(&self) -> &BTreeMap<(String, Uuid), u32> {
        &self.effects
    }

    /// Whether `id` was ever marked processed.
    pub fn processed_ever(&self, id: &Uuid) -> bool {
        self.processed_ever.contains(id)
    }

    /// Moves the `processed_ms` of event `id`'s rows `by_ms` into the past
    /// (conformance).
    pub fn backdate_processed(&mut self, id: Uuid, by_ms: u64) {
        for r in self.rows.values_mut().filter(|r| r.event_id == id) {
            if let Some(p) = r.processed_ms.as_mut() {
                *p = p.saturating_sub(by_ms);
            }
        }
    }

    /// Whether `req` (of `session`, whose open transaction is `tx`) must
    /// wait for a lock another session holds: the holders, and what for.
    pub fn blocked(
        &self,
        req: &PgRequest,
        session: u64,
        tx: Option<&InboxTx>,
    ) -> Option<(Vec<u64>, &'static str)> {
        match req {
            PgRequest::InboxTryInsert { entry } => self
                .locks
                .get(&key(&entry.subscription, entry.event_id))
                .filter(|s| **s != session)
                .map(|s| (vec![*s], "inbox row")),
            PgRequest::InboxSkip { subscription, ids } => {
                let key_holders = ids
                    .iter()
                    .filter_map(|id| self.rows.get(&key(subscription, *id)))
                    .filter_map(|r| r.ordering.as_ref())
                    .filter_map(|(k, _)| self.key_locks.get(&(subscription.clone(), k.clone())));
                let mut holders: Vec<u64> = ids
                    .iter()
                    .filter_map(|id| self.locks.get(&key(subscription, *id)))
                    .chain(key_holders)
                    .filter(|s| **s != session)
                    .copied()
                    .collect();
                holders.sort_unstable();
                holders.dedup();
                (!holders.is_empty()).then_some((holders, "inbox row"))
            }
            PgRequest::Effect { .. } if self.domain_locked => {
                Some((vec![super::OUTSIDE_SESSION], "domain table"))
            }
            PgRequest::InboxCheck | PgRequest::Commit => {
                let mut holders: Vec<u64> = tx?
                    .unique_keys()
                    .filter(|k| k.starts_with(WAITING_KEY_PREFIX))
                    .filter_map(|k| self.uncommitted_keys.get(k))
                    .flat_map(|by| by.keys().copied())
                    .filter(|s| *s != session)
                    .collect();
                holders.sort_unstable();
                holders.dedup();
                (!holders.is_empty()).then_some((holders, "deferred unique key"))
            }
            _ => None,
        }
    }

    /// The error a failed check of `tx`'s keys gives: 23505 if a unique
    /// key broke, else the constraint trigger's P0001.
    pub fn violation_error(&self, tx: &InboxTx) -> PgError {
        let blamed = self.deferred_violations(tx);
        let unique = tx.effects.iter().any(|e| {
            blamed.contains(&e.event_id)
                && e.unique_key
                    .as_deref()
                    .is_some_and(|k| k.starts_with(WAITING_KEY_PREFIX))
        });
        if unique {
            unique_violation()
        } else {
            PgError::new(
                "P0001",
                "domain key already taken (deferred constraint trigger)",
            )
        }
    }

    /// The effects of `tx` that a deferred unique key check fails on: each
    /// whose key is committed already or was written by an earlier effect
    /// of `tx` (the later writer is the one that cannot commit).
    pub fn deferred_violations(&self, tx: &InboxTx) -> Vec<Uuid> {
        let mut taken: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
        tx.effects
            .iter()
            .filter(|e| {
                e.unique_key
                    .as_deref()
                    .is_some_and(|k| self.unique_keys.contains_key(k) || !taken.insert(k))
            })
            .map(|e| e.event_id)
            .collect()
    }

    /// Whether event `id` can never take effect because another event took
    /// its unique key, and its inbox row is dead-lettered for it (what the
    /// world waits for before it stops a run).
    pub fn lost_its_unique_key(&self, id: &Uuid) -> bool {
        self.rows.values().any(|r| {
            r.event_id == *id
                && r.dead_lettered_ms.is_some()
                && self
                    .unique_keys
                    .get(&r.routing_key)
                    .is_some_and(|winner| winner != id)
        })
    }

    /// The committed unique keys of the domain table.
    pub fn unique_keys(&self) -> &BTreeMap<String, Uuid> {
        &self.unique_keys
    }

    fn unregister_keys<'k>(&mut self, session: u64, keys: impl IntoIterator<Item = &'k String>) {
        for k in keys {
            if let Some(by) = self.uncommitted_keys.get_mut(k) {
                if let Some(n) = by.get_mut(&session) {
                    *n -= 1;
                    if *n == 0 {
                        by.remove(&session);
                    }
                }
                if by.is_empty() {
                    self.uncommitted_keys.remove(k);
                }
            }
        }
    }

    /// Applies an inbox request; `None` if `req` is not one. `tx` is the
    /// session's open transaction, if any.
    pub fn apply(
        &mut self,
        req: &PgRequest,
        caller: &Caller<'_>,
        tx: Option<&mut InboxTx>,
        now: u64,
    ) -> Option<PgReply> {
        if let PgRequest::InboxTryInsert { entry } = req
            && let Some(r) = refusal(entry)
        {
            caller.trace.now(Event::InboxRefused {
                client: caller.client.to_owned(),
                event_id: entry.event_id,
                code: r.code,
            });
            return Some(PgReply::Error(PgError::new(r.code, r.message)));
        }
        let reply = match req {
            PgRequest::InboxLockKeys { .. }
            | PgRequest::InboxTryInsert { .. }
            | PgRequest::InboxMarkProcessed { .. }
            | PgRequest::Effect { .. }
            | PgRequest::InboxSavepoint
            | PgRequest::InboxCheck
            | PgRequest::InboxUndoHandler
            | PgRequest::InboxRecordFailure { .. } => match tx {
                Some(tx) => self.in_tx(req, caller, tx, now),
                None => outside_tx("an inbox statement"),
            },
            PgRequest::InboxList {
                ids,
                subscription,
                routing_key,
                dead_lettered_only,
                limit,
                after,
                payload_field,
                omit_payload,
            } => {
                let filter = ListFilter {
                    ids: ids.clone(),
                    subscription: subscription.clone(),
                    routing_key: routing_key.clone(),
                    dead_lettered_only: *dead_lettered_only,
                    after: *after,
                    payload_field: payload_field.clone(),
                };
                self.list(|r| filter.keeps(r), *limit, *omit_payload)
            }
            PgRequest::InboxDeleteProcessed {
                older_than_ms,
                limit,
            } => self.delete_processed(now, *older_than_ms, *limit, caller),
            PgRequest::InboxRetirePartitions { older_than_ms } => {
                self.retire_partitions(*older_than_ms, now, caller)
            }
            PgRequest::InboxHeld {
                subscription,
                key: k,
                after,
                limit,
            } => self.held_after(subscription, k, *after, *limit),
            PgRequest::InboxSkip { subscription, ids } => self.skip(subscription, ids, now, caller),
            PgRequest::InboxReleasable {
                subscription,
                limit,
            } => self.releasable(subscription, *limit),
            PgRequest::InboxCounts {
                subscription,
                window_ms,
                cap,
            } => self.counts(subscription, now.saturating_sub(*window_ms), *cap),
            _ => return None,
        };
        Some(reply)
    }

    /// `inbox_counts.sql`: `subscription`'s rows processed after `since`,
    /// retried and dead-lettered, each up to `cap`.
    fn counts(&self, subscription: &str, since: u64, cap: u32) -> PgReply {
        let mine = || {
            self.rows
                .values()
                .filter(|r| r.subscription == subscription)
        };
        let count = |n: usize| (n as u64).min(u64::from(cap));
        let unprocessed = |r: &&InboxRow| r.processed_ms.is_none();
        PgReply::InboxCounts {
            processed_recently: count(
                mine()
                    .filter(|r| r.processed_ms.is_some_and(|at| at > since))
                    .count(),
            ),
            retrying: count(
                mine()
                    .filter(unprocessed)
                    .filter(|r| r.dead_lettered_ms.is_none() && r.attempts > 0)
                    .count(),
            ),
            dead_lettered: count(
                mine()
                    .filter(unprocessed)
                    .filter(|r| r.dead_lettered_ms.is_some())
                    .count(),
            ),
        }
    }

    /// The held rows of `subscription`'s key `k` numbered after `after`,
    /// in key order, at most `limit`.
    fn held_after(&self, subscription: &str, k: &str, after: i64, limit: u32) -> PgReply {
        let mut rows: Vec<&InboxRow> = self
            .rows
            .values()
            .filter(|r| {
                r.processed_ms.is_none()
                    && r.held_ms.is_some()
                    && r.subscription == *subscription
                    && r.ordering
                        .as_ref()
                        .is_some_and(|(x, n)| x == k && *n > after)
            })
            .collect();
        rows.sort_by_key(|r| r.ordering.as_ref().map(|o| o.1));
        PgReply::InboxRows(rows.iter().take(limit as usize).map(|r| r.wire()).collect())
    }

    /// The statements of a handler's transaction.
    fn in_tx(
        &mut self,
        req: &PgRequest,
        caller: &Caller<'_>,
        tx: &mut InboxTx,
        now: u64,
    ) -> PgReply {
        match req {
            PgRequest::InboxLockKeys { subscription, keys } => {
                // The session's handling took them (`blocked` waits until
                // it could): all held.
                let held = self.lock_keys(subscription, keys, caller.session, tx);
                debug_assert_eq!(held, None, "taken before the statement ran");
                PgReply::Ok
            }
            PgRequest::InboxTryInsert { entry } => {
                tx.tried += 1;
                self.try_insert(entry, caller, tx, now)
            }
            PgRequest::InboxMarkProcessed {
                subscription,
                event_id,
            } => {
                let k = key(subscription, *event_id);
                if let Some(row) = tx.inserts.iter_mut().find(|r| r.key() == k) {
                    row.processed_ms = Some(now);
                } else {
                    tx.processed.push(k);
                }
                PgReply::Ok
            }
            PgRequest::Effect {
                subscription,
                event_id,
                unique_key,
            } => {
                self.effect(tx, caller, subscription, *event_id, unique_key.as_ref());
                PgReply::Ok
            }
            PgRequest::InboxCheck => {
                let blamed = self.deferred_violations(tx);
                if blamed.is_empty() {
                    return PgReply::Ok;
                }
                let error = self.violation_error(tx);
                caller.trace.now(Event::ConstraintFailed {
                    client: caller.client.to_owned(),
                    events: blamed,
                    at_commit: false,
                });
                PgReply::Error(error)
            }
            PgRequest::InboxSavepoint => {
                tx.set_savepoint();
                PgReply::Ok
            }
            PgRequest::InboxUndoHandler => match self.undo_handler(tx, caller) {
                Some(()) => PgReply::Ok,
                None => no_savepoint(),
            },
            PgRequest::InboxRecordFailure {
                subscription,
                event_id,
                error,
                max_attempts,
            } => match self.undo_handler(tx, caller) {
                Some(()) => {
                    self.record_failure(tx, key(subscription, *event_id), error, *max_attempts, now)
                }
                None => no_savepoint(),
            },
            other => unreachable!("{other:?} is no handler statement"),
        }
    }

    /// A handler's effect row, its unique key held by the session until
    /// its transaction ends.
    fn effect(
        &mut self,
        tx: &mut InboxTx,
        caller: &Caller<'_>,
        subscription: &str,
        event_id: Uuid,
        unique_key: Option<&String>,
    ) {
        if let Some(k) = unique_key {
            *self
                .uncommitted_keys
                .entry(k.clone())
                .or_default()
                .entry(caller.session)
                .or_insert(0) += 1;
        }
        tx.effects.push(EffectRow {
            subscription: subscription.to_owned(),
            event_id,
            unique_key: unique_key.cloned(),
        });
    }

    /// `ROLLBACK TO SAVEPOINT canopy_handler`: releases what the work since
    /// held; `None` if no savepoint is set.
    fn undo_handler(&mut self, tx: &mut InboxTx, caller: &Caller<'_>) -> Option<()> {
        let (released, keys) = tx.rollback_to_savepoint()?;
        for k in released {
            self.locks.remove(&k);
        }
        self.unregister_keys(caller.session, &keys);
        Some(())
    }

    /// `inbox_try_insert.sql` and `inbox_lock.sql`: inserts the row if
    /// absent, locks it, and says what it found.
    fn try_insert(
        &mut self,
        entry: &WireInboxEntry,
        caller: &Caller<'_>,
        tx: &mut InboxTx,
        now: u64,
    ) -> PgReply {
        let (id, k) = (entry.event_id, key(&entry.subscription, entry.event_id));
        let hold = match self.key_statement(entry, caller, tx, now) {
            Ok(hold) => hold,
            Err(reply) => return reply,
        };
        // A row this transaction already holds (an earlier delivery of the
        // same event in the batch): PostgreSQL's insert conflicts with it
        // and the lock sees it as this transaction left it.
        if let Some(view) = tx.own_view(&k, self.rows.get(&k)) {
            return self.insert_own(entry, caller, tx, view, hold, now);
        }
        let outcome = match self.rows.get(&k) {
            Some(row) if row.processed_ms.is_some() => {
                caller.trace.now(Event::InboxDuplicate {
                    client: caller.client.to_owned(),
                    event_id: id,
                });
                WireInsertOutcome::AlreadyProcessed
            }
            Some(_) if hold => {
                tx.holds.push(k.clone());
                WireInsertOutcome::Held
            }
            // `inbox_reset_attempts.sql`: a dead-lettered row only.
            Some(row) if entry.fresh_budget && row.dead_lettered_ms.is_some() => {
                tx.resets.push(k.clone());
                WireInsertOutcome::InFlightRetry { attempts: 0 }
            }
            Some(row) => WireInsertOutcome::InFlightRetry {
                attempts: row.attempts,
            },
            None if hold => {
                // `inbox_try_insert_keyed.sql`, blocked: unprocessed, held.
                let mut row = InboxRow::new(entry, now);
                row.held_ms = Some(now);
                tx.inserts.push(row);
                WireInsertOutcome::Held
            }
            None => {
                // Inserted marked processed, as `inbox_try_insert.sql` does;
                // a failure record clears the mark.
                let mut row = InboxRow::new(entry, now);
                row.processed_ms = Some(now);
                tx.inserts.push(row);
                WireInsertOutcome::Inserted
            }
        };
        self.lock(tx, k, caller.session);
        PgReply::Inbox(outcome)
    }

    /// [`try_insert`](Self::try_insert) of a row this transaction already
    /// holds, as it left it (`view`: processed, attempts).
    fn insert_own(
        &self,
        entry: &WireInboxEntry,
        caller: &Caller<'_>,
        tx: &mut InboxTx,
        (processed, attempts): (bool, i32),
        hold: bool,
        now: u64,
    ) -> PgReply {
        let (id, k) = (entry.event_id, key(&entry.subscription, entry.event_id));
        if processed {
            caller.trace.now(Event::InboxDuplicate {
                client: caller.client.to_owned(),
                event_id: id,
            });
            return PgReply::Inbox(WireInsertOutcome::AlreadyProcessed);
        }
        if hold {
            if let Some(row) = tx.inserts.iter_mut().find(|r| r.key() == k) {
                row.held_ms.get_or_insert(now);
            } else {
                tx.holds.push(k);
            }
            return PgReply::Inbox(WireInsertOutcome::Held);
        }
        // `inbox_reset_attempts.sql`: a dead-lettered row only, as this
        // transaction sees it.
        let inserted = tx.inserts.iter().position(|r| r.key() == k);
        let dead = match inserted {
            Some(i) => tx.inserts[i].dead_lettered_ms.is_some(),
            None => match tx.failures.iter().rev().find(|f| f.0 == k) {
                Some(f) => f.3,
                None => {
                    !tx.resets.contains(&k)
                        && self
                            .rows
                            .get(&k)
                            .is_some_and(|r| r.dead_lettered_ms.is_some())
                }
            },
        };
        if entry.fresh_budget && dead {
            match inserted {
                Some(i) => {
                    tx.inserts[i].attempts = 0;
                    tx.inserts[i].dead_lettered_ms = None;
                }
                None => tx.resets.push(k),
            }
            return PgReply::Inbox(WireInsertOutcome::InFlightRetry { attempts: 0 });
        }
        PgReply::Inbox(WireInsertOutcome::InFlightRetry { attempts })
    }

    /// The rows `filter` selects now, oldest first: what a replay asking
    /// it should meet (the operator's record of what it asked for).
    pub fn matching(&self, filter: &ListFilter) -> Vec<Uuid> {
        let mut rows: Vec<&InboxRow> = self.rows.values().filter(|r| filter.keeps(r)).collect();
        rows.sort_by_key(|r| (r.received_ms, r.event_id));
        rows.into_iter().map(|r| r.event_id).collect()
    }

    /// `inbox_list_unprocessed.sql`: the rows `filter` keeps, oldest first,
    /// each payload left out (empty) if `omit_payload`.
    fn list(&self, filter: impl Fn(&InboxRow) -> bool, limit: u32, omit_payload: bool) -> PgReply {
        let mut rows: Vec<&InboxRow> = self.rows.values().filter(|r| filter(r)).collect();
        rows.sort_by_key(|r| (r.received_ms, r.event_id));
        PgReply::InboxRows(
            rows.into_iter()
                .take(limit as usize)
                .map(|r| {
                    let mut wire = r.wire();
                    if omit_payload {
                        wire.payload.clear();
                    }
                    wire
                })
                .collect(),
        )
    }

    /// `inbox_releasable.sql`: held rows of `subscription` that no
    /// earlier unprocessed row of their key holds back (dead-lettered, or
    /// not held: waiting for its retry), each key's lowest, in key order.
    fn releasable(&self, subscription: &str, limit: u32) -> PgReply {
        let unprocessed = |r: &&InboxRow| {
            r.subscription == subscription && r.processed_ms.is_none() && r.ordering.is_some()
        };
        let mut by_key: BTreeMap<&str, Vec<&InboxRow>> = BTreeMap::new();
        for r in self.rows.values().filter(unprocessed) {
            let (k, _) = r.ordering.as_ref().expect("filtered");
            by_key.entry(k.as_str()).or_default().push(r);
        }
        let mut out = Vec::new();
        for rows in by_key.values_mut() {
            rows.sort_by_key(|r| r.ordering.as_ref().map(|o| o.1));
            let lowest = rows[0];
            let blocks = |r: &InboxRow| r.dead_lettered_ms.is_some() || r.held_ms.is_none();
            if lowest.held_ms.is_some() && !blocks(lowest) {
                out.push(lowest.wire());
            }
        }
        out.truncate(limit as usize);
        PgReply::InboxRows(out)
    }

    /// `inbox_skip.sql`: these dead-lettered unprocessed rows of
    /// `subscription` marked processed and skipped, oldest first.
    fn skip(&mut self, subscription: &str, ids: &[Uuid], now: u64, caller: &Caller<'_>) -> PgReply {
        let mut skipped = Vec::new();
        for id in ids {
            if let Some(r) = self.rows.get_mut(&key(subscription, *id))
                && r.processed_ms.is_none()
                && r.dead_lettered_ms.is_some()
            {
                r.processed_ms = Some(now);
                r.skipped_ms = Some(now);
                skipped.push(r.clone());
            }
        }
        // A repeated id finds its row processed by the first: skipped once.
        skipped.sort_by_key(|r| (r.received_ms, r.event_id));
        if !skipped.is_empty() {
            caller.trace.now(Event::InboxSkipped {
                client: caller.client.to_owned(),
                events: skipped.iter().map(|r| r.event_id).collect(),
            });
        }
        PgReply::InboxRows(skipped.iter().map(InboxRow::wire).collect())
    }

    /// `inbox_lock_keys.sql`: takes `session`'s locks of `keys` in
    /// `subscription`, in key order, as far as it can: the session holding
    /// the first one it cannot take (the statement waits there, holding
    /// those before it, as PostgreSQL's does), or `None` once it holds them
    /// all. Each is held until the transaction ends.
    pub fn lock_keys(
        &mut self,
        subscription: &str,
        keys: &[String],
        session: u64,
        tx: &mut InboxTx,
    ) -> Option<u64> {
        let sorted: std::collections::BTreeSet<&String> = keys.iter().collect();
        for k in sorted {
            let lock = (subscription.to_owned(), k.clone());
            match self.key_locks.get(&lock) {
                Some(s) if *s != session => return Some(*s),
                Some(_) => {}
                None => {
                    self.key_locks.insert(lock.clone(), session);
                    tx.key_locks.push(lock);
                }
            }
        }
        None
    }

    /// An ordered subscription's keyed delivery, first
    /// (`inbox_try_insert_keyed.sql`, under the key's lock, which it does
    /// not take): looks for earlier unprocessed events of its key and, if
    /// one waits for its retry, records its own row waiting and answers
    /// `BehindRetry`; else whether the row is to be recorded held.
    fn key_statement(
        &mut self,
        entry: &WireInboxEntry,
        caller: &Caller<'_>,
        tx: &mut InboxTx,
        now: u64,
    ) -> Result<bool, PgReply> {
        if entry.ordering.is_none() {
            return Ok(false);
        }
        match self.key_wait(entry, tx) {
            None => Ok(false),
            Some(true) => Ok(true),
            Some(false) => {
                caller.trace.now(Event::InboxBehindKey {
                    client: caller.client.to_owned(),
                    event_id: entry.event_id,
                });
                // Unprocessed, no attempt, unless it has a row.
                let k = key(&entry.subscription, entry.event_id);
                let own = tx.inserts.iter().any(|r| r.key() == k);
                if !own && !self.rows.contains_key(&k) {
                    tx.inserts.push(InboxRow::new(entry, now));
                }
                Err(PgReply::Inbox(WireInsertOutcome::BehindRetry))
            }
        }
    }

    /// `inbox_try_insert_keyed.sql`'s look for an ordered subscription's keyed delivery,
    /// as `tx` sees the inbox: `None` if no earlier event of its key is
    /// unprocessed, `Some(true)` if one of those is dead-lettered or held,
    /// else `Some(false)`.
    fn key_wait(&self, entry: &WireInboxEntry, tx: &InboxTx) -> Option<bool> {
        let (k, seq) = entry.ordering.as_ref()?;
        let sub = entry.subscription.as_str();
        let mut found: Option<bool> = None;
        let mut consider = |processed: bool, blocked: bool| {
            if !processed {
                let f = found.get_or_insert(false);
                *f |= blocked;
            }
        };
        for r in self.rows.values().filter(|r| r.waits_before(sub, k, *seq)) {
            let rk = r.key();
            let processed = r.processed_ms.is_some() || tx.processed.contains(&rk);
            let dead = match tx.failures.iter().rev().find(|f| f.0 == rk) {
                Some(f) => f.3,
                None if tx.resets.contains(&rk) => false,
                None => r.dead_lettered_ms.is_some(),
            };
            consider(
                processed,
                dead || r.held_ms.is_some() || tx.holds.contains(&rk),
            );
        }
        for r in tx.inserts.iter().filter(|r| r.waits_before(sub, k, *seq)) {
            consider(
                r.processed_ms.is_some(),
                r.dead_lettered_ms.is_some() || r.held_ms.is_some(),
            );
        }
        found
    }

    /// `inbox_delete_processed.sql`: at most `limit` rows processed more
    /// than `older_than_ms` before `now`, oldest first; on the partitioned
    /// layout partition by partition, leaving out the closed partitions no
    /// unprocessed row holds (as the outbox's).
    fn delete_processed(
        &mut self,
        now: u64,
        older_than_ms: u64,
        limit: u32,
        caller: &Caller<'_>,
    ) -> PgReply {
        let cutoff = now.saturating_sub(older_than_ms);
        let spared = self.spared(now);
        let home = |id: Uuid| self.partitions.as_ref().map(|p| p.home(id));
        let mut expired: Vec<(Option<Home>, u64, Key)> = self
            .rows
            .values()
            .filter_map(|r| {
                r.processed_ms
                    .filter(|p| *p < cutoff)
                    .map(|p| (home(r.event_id), p, r.key()))
            })
            .filter(|(h, _, _)| !h.is_some_and(|h| spared.contains(&h)))
            .collect();
        expired.sort();
        expired.truncate(limit as usize);
        for (_, _, k) in &expired {
            self.rows.remove(k);
        }
        if !expired.is_empty() {
            caller.trace.now(Event::InboxDeleted {
                ids: expired.iter().map(|(_, _, (_, id))| *id).collect(),
            });
        }
        PgReply::Count(expired.len() as u64)
    }

    /// The closed partitions no unprocessed row holds.
    fn spared(&self, now: u64) -> BTreeSet<Home> {
        match &self.partitions {
            Some(parts) => super::partitions::spared(parts, &self.row_states(), now),
            None => BTreeSet::new(),
        }
    }

    fn row_states(&self) -> Vec<super::partitions::RowState> {
        self.rows
            .values()
            .map(|r| {
                (
                    r.event_id,
                    r.processed_ms,
                    self.locks.contains_key(&r.key()),
                )
            })
            .collect()
    }

    /// `outbox::pg::partitions::retire` on this table (as the outbox's).
    fn retire_partitions(&mut self, older_than_ms: u64, now: u64, caller: &Caller<'_>) -> PgReply {
        let states = self.row_states();
        let Some(parts) = &mut self.partitions else {
            return PgReply::Retired(Default::default());
        };
        let (retired, gone) = super::partitions::retire(parts, &states, older_than_ms, now);
        self.rows.retain(|(_, id), _| !gone.contains(id));
        if !gone.is_empty() {
            caller.trace.now(Event::InboxDeleted {
                ids: gone.into_iter().collect(),
            });
        }
        PgReply::Retired(retired)
    }

    /// Counts a failed attempt on a row the transaction holds.
    fn record_failure(
        &self,
        tx: &mut InboxTx,
        k: Key,
        error: &str,
        max_attempts: u32,
        now: u64,
    ) -> PgReply {
        let budget = |attempts: i32, already: bool| already || attempts >= max_attempts as i32;
        if let Some(row) = tx.inserts.iter_mut().find(|r| r.key() == k) {
            row.processed_ms = None;
            row.attempts += 1;
            row.last_error = Some(error.to_owned());
            if budget(row.attempts, row.dead_lettered_ms.is_some()) {
                row.dead_lettered_ms.get_or_insert(now);
            }
            tx.insert_failures
                .push((row.event_id, row.attempts, row.dead_lettered_ms.is_some()));
            return PgReply::Attempt {
                attempts: row.attempts,
                dead_lettered: row.dead_lettered_ms.is_some(),
            };
        }
        let Some(row) = self.rows.get(&k).filter(|_| tx.locked.contains(&k)) else {
            return PgReply::Error(PgError::new(
                "55000",
                format!("inbox row {} is not held by this transaction", k.1),
            ));
        };
        let (before, was_dead) = tx.failures.iter().rev().find(|f| f.0 == k).map_or(
            if tx.resets.contains(&k) {
                (0, false)
            } else {
                (row.attempts, row.dead_lettered_ms.is_some())
            },
            |f| (f.1, f.3),
        );
        let attempts = before + 1;
        let dead = budget(attempts, was_dead);
        tx.failures.push((k, attempts, error.to_owned(), dead));
        PgReply::Attempt {
            attempts,
            dead_lettered: dead,
        }
    }

    fn lock(&mut self, tx: &mut InboxTx, k: Key, session: u64) {
        if self.locks.insert(k.clone(), session).is_none() {
            tx.locked.push(k);
        }
    }

    /// Applies a committed transaction's inbox work and releases its locks
    /// (`session`'s).
    pub fn commit(&mut self, tx: InboxTx, now: u64, session: u64) -> Committed {
        let keys: Vec<String> = tx.unique_keys().cloned().collect();
        self.unregister_keys(session, &keys);
        let mut out = Committed::default();
        for k in tx.resets {
            if let Some(r) = self.rows.get_mut(&k).filter(|r| r.processed_ms.is_none()) {
                r.attempts = 0;
                r.dead_lettered_ms = None;
                out.reset.push(k.1);
            }
        }
        for k in tx.holds {
            if let Some(r) = self.rows.get_mut(&k).filter(|r| r.processed_ms.is_none()) {
                r.held_ms.get_or_insert(now);
                out.held.push(k.1);
            }
        }
        for row in tx.inserts {
            if row.held_ms.is_some() {
                out.held.push(row.event_id);
            }
            if row.processed_ms.is_some() {
                out.processed.push(row.event_id);
                self.processed_ever.insert(row.event_id);
            }
            self.rows.insert(row.key(), row);
        }
        out.failures.extend(tx.insert_failures);
        for (k, attempts, error, dead) in tx.failures {
            if let Some(r) = self.rows.get_mut(&k) {
                r.attempts = attempts;
                r.last_error = Some(error);
                if dead {
                    r.dead_lettered_ms.get_or_insert(now);
                }
                out.failures.push((k.1, attempts, dead));
            }
        }
        for k in tx.processed {
            if let Some(r) = self.rows.get_mut(&k) {
                r.processed_ms = Some(now);
                out.processed.push(k.1);
                self.processed_ever.insert(k.1);
            }
        }
        for effect in tx.effects {
            let e = (effect.subscription, effect.event_id);
            if let Some(k) = effect.unique_key {
                self.unique_keys.insert(k, effect.event_id);
            }
            *self.effects.entry(e.clone()).or_insert(0) += 1;
            out.effects.push(e);
        }
        for k in tx.locked {
            self.locks.remove(&k);
        }
        for k in tx.key_locks {
            self.key_locks.remove(&k);
        }
        out
    }

    /// Discards a transaction's inbox work and releases its locks
    /// (`session`'s).
    pub fn rollback(&mut self, tx: InboxTx, session: u64) {
        let keys: Vec<String> = tx.unique_keys().cloned().collect();
        self.unregister_keys(session, &keys);
        for k in tx.locked {
            self.locks.remove(&k);
        }
        for k in tx.key_locks {
            self.key_locks.remove(&k);
        }
    }
}

fn no_savepoint() -> PgReply {
    PgReply::Error(PgError::new(
        "3B001",
        "savepoint \"canopy_handler\" does not exist",
    ))
}

/// Keys whose deferred check waits for other writers (a unique index);
/// the others' (a constraint trigger) does not.
pub const WAITING_KEY_PREFIX: &str = "unique.";

/// What PostgreSQL answers when a deferred unique key is taken.
pub fn unique_violation() -> PgError {
    PgError::new(
        "23505",
        "duplicate key value violates unique constraint \"domain_unique_key\"",
    )
}

fn outside_tx(what: &str) -> PgReply {
    PgReply::Error(PgError::new(
        "25P01",
        format!("{what} outside a transaction"),
    ))
}
