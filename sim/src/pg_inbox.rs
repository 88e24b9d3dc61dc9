//! The fake PostgreSQL's `event_inbox` table and the simulated handler's
//! domain table, as the subscriber relies on them (ADR-018 amendment #433).
//!
//! Modelled: an inserted row is invisible to other sessions until commit
//! and, like every row a transaction touched, locked until it ends; a
//! second session's insert of the same event (or its failure record) waits
//! for that lock, as `INSERT … ON CONFLICT` does, so deliveries of one event
//! serialize; commit applies the row, its `processed` mark and the handler's
//! effects together, rollback (or a dropped connection) none of them; failure
//! records are autocommit upserts that count attempts and mark the row
//! dead-lettered at the budget, and leave a processed row alone; replay
//! listing, budget reset and the retention sweep. The server sessions live
//! in `pg_fake.rs`; this module is their inbox logic.

use std::collections::BTreeMap;

use uuid::Uuid;

use crate::wire::{PgReply, PgRequest, WireInboxEntry, WireInboxRow, WireInsertOutcome};

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
}

impl InboxRow {
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
        }
    }
}

/// The committed inbox, its row locks and the handler's committed effects.
#[derive(Debug, Default)]
pub struct Inbox {
    rows: BTreeMap<Uuid, InboxRow>,
    /// Rows held by an open transaction, by session number.
    locks: BTreeMap<Uuid, u64>,
    /// Committed handler effects per (subscription, event).
    effects: BTreeMap<(String, Uuid), u32>,
}

/// An open transaction's inbox work, applied at commit.
#[derive(Debug, Default)]
pub struct InboxTx {
    inserts: Vec<InboxRow>,
    processed: Vec<Uuid>,
    effects: Vec<(String, Uuid)>,
    locked: Vec<Uuid>,
}

impl InboxTx {
    /// Whether the transaction did any inbox work.
    pub fn is_empty(&self) -> bool {
        self.inserts.is_empty() && self.locked.is_empty() && self.effects.is_empty()
    }
}

/// What a commit applied, for the trace.
#[derive(Debug, Default)]
pub struct Committed {
    pub processed: Vec<Uuid>,
    pub effects: Vec<(String, Uuid)>,
}

impl Inbox {
    /// Every committed row.
    pub fn rows(&self) -> impl Iterator<Item = &InboxRow> {
        self.rows.values()
    }

    /// Committed handler effects per (subscription, event).
    pub fn effects(&self) -> &BTreeMap<(String, Uuid), u32> {
        &self.effects
    }

    /// Moves a row's `processed_ms` `by_ms` into the past (conformance).
    pub fn backdate_processed(&mut self, id: Uuid, by_ms: u64) {
        if let Some(p) = self.rows.get_mut(&id).and_then(|r| r.processed_ms.as_mut()) {
            *p = p.saturating_sub(by_ms);
        }
    }

    /// Whether `req` must wait for a row another session holds.
    pub fn blocked(&self, req: &PgRequest, session: u64) -> bool {
        let id = match req {
            PgRequest::InboxTryInsert { entry } | PgRequest::InboxRecordFailure { entry, .. } => {
                entry.event_id
            }
            _ => return false,
        };
        self.locks.get(&id).is_some_and(|s| *s != session)
    }

    /// Applies an inbox request; `None` if `req` is not one. `tx` is the
    /// session's open transaction, if any.
    pub fn apply(
        &mut self,
        req: &PgRequest,
        session: u64,
        tx: Option<&mut InboxTx>,
        now: u64,
    ) -> Option<PgReply> {
        let reply = match req {
            PgRequest::InboxTryInsert { entry } => {
                let Some(tx) = tx else {
                    return Some(PgReply::Error("inbox insert outside a transaction".into()));
                };
                let id = entry.event_id;
                if tx.inserts.iter().any(|r| r.event_id == id) {
                    PgReply::Inbox(WireInsertOutcome::InFlightRetry { attempts: 0 })
                } else if let Some(row) = self.rows.get(&id) {
                    let outcome = if row.processed_ms.is_some() {
                        WireInsertOutcome::AlreadyProcessed
                    } else {
                        WireInsertOutcome::InFlightRetry {
                            attempts: row.attempts,
                        }
                    };
                    self.lock(tx, id, session);
                    PgReply::Inbox(outcome)
                } else {
                    tx.inserts.push(InboxRow::new(entry, now));
                    self.lock(tx, id, session);
                    PgReply::Inbox(WireInsertOutcome::Inserted)
                }
            }
            PgRequest::InboxMarkProcessed { event_id } => {
                let Some(tx) = tx else {
                    return Some(PgReply::Error("inbox mark outside a transaction".into()));
                };
                if let Some(row) = tx.inserts.iter_mut().find(|r| r.event_id == *event_id) {
                    row.processed_ms = Some(now);
                } else {
                    tx.processed.push(*event_id);
                }
                PgReply::Ok
            }
            PgRequest::Effect {
                subscription,
                event_id,
            } => {
                let Some(tx) = tx else {
                    return Some(PgReply::Error("effect outside a transaction".into()));
                };
                tx.effects.push((subscription.clone(), *event_id));
                PgReply::Ok
            }
            PgRequest::InboxRecordFailure {
                entry,
                error,
                max_attempts,
            } => {
                let row = self
                    .rows
                    .entry(entry.event_id)
                    .or_insert_with(|| InboxRow::new(entry, now));
                if row.processed_ms.is_some() {
                    PgReply::Attempt {
                        attempts: 0,
                        dead_lettered: false,
                    }
                } else {
                    row.attempts += 1;
                    row.last_error = Some(error.clone());
                    if row.attempts >= *max_attempts as i32 && row.dead_lettered_ms.is_none() {
                        row.dead_lettered_ms = Some(now);
                    }
                    PgReply::Attempt {
                        attempts: row.attempts,
                        dead_lettered: row.dead_lettered_ms.is_some(),
                    }
                }
            }
            PgRequest::InboxList {
                ids,
                subscription,
                routing_key,
                dead_lettered_only,
                limit,
            } => {
                let mut rows: Vec<&InboxRow> = self
                    .rows
                    .values()
                    .filter(|r| r.processed_ms.is_none())
                    .filter(|r| ids.as_ref().is_none_or(|ids| ids.contains(&r.event_id)))
                    .filter(|r| subscription.as_ref().is_none_or(|s| *s == r.subscription))
                    .filter(|r| routing_key.as_ref().is_none_or(|k| *k == r.routing_key))
                    .filter(|r| !dead_lettered_only || r.dead_lettered_ms.is_some())
                    .collect();
                rows.sort_by_key(|r| (r.received_ms, r.event_id));
                PgReply::InboxRows(
                    rows.into_iter()
                        .take(*limit as usize)
                        .map(|r| WireInboxRow {
                            event_id: r.event_id,
                            subscription: r.subscription.clone(),
                            routing_key: r.routing_key.clone(),
                            payload: r.payload.clone(),
                            attempts: r.attempts,
                            last_error: r.last_error.clone(),
                            received_ms: r.received_ms,
                            dead_lettered_ms: r.dead_lettered_ms,
                        })
                        .collect(),
                )
            }
            PgRequest::InboxReset { ids } => {
                let mut n = 0;
                for id in ids {
                    if let Some(r) = self.rows.get_mut(id)
                        && r.processed_ms.is_none()
                    {
                        r.attempts = 0;
                        r.dead_lettered_ms = None;
                        n += 1;
                    }
                }
                PgReply::Count(n)
            }
            PgRequest::InboxDeleteProcessed {
                older_than_ms,
                limit,
            } => {
                let cutoff = now.saturating_sub(*older_than_ms);
                let mut expired: Vec<(u64, Uuid)> = self
                    .rows
                    .values()
                    .filter_map(|r| {
                        r.processed_ms
                            .filter(|p| *p < cutoff)
                            .map(|p| (p, r.event_id))
                    })
                    .collect();
                expired.sort();
                expired.truncate(*limit as usize);
                for (_, id) in &expired {
                    self.rows.remove(id);
                }
                PgReply::Count(expired.len() as u64)
            }
            _ => return None,
        };
        Some(reply)
    }

    fn lock(&mut self, tx: &mut InboxTx, id: Uuid, session: u64) {
        if self.locks.insert(id, session).is_none() {
            tx.locked.push(id);
        }
    }

    /// Applies a committed transaction's inbox work and releases its locks.
    pub fn commit(&mut self, tx: InboxTx, now: u64) -> Committed {
        let mut out = Committed::default();
        for row in tx.inserts {
            if row.processed_ms.is_some() {
                out.processed.push(row.event_id);
            }
            self.rows.insert(row.event_id, row);
        }
        for id in tx.processed {
            if let Some(r) = self.rows.get_mut(&id) {
                r.processed_ms = Some(now);
                out.processed.push(id);
            }
        }
        for effect in tx.effects {
            *self.effects.entry(effect.clone()).or_insert(0) += 1;
            out.effects.push(effect);
        }
        for id in tx.locked {
            self.locks.remove(&id);
        }
        out
    }

    /// Discards a transaction's inbox work and releases its locks.
    pub fn rollback(&mut self, tx: InboxTx) {
        for id in tx.locked {
            self.locks.remove(&id);
        }
    }
}
