//! The fake PostgreSQL's `event_outbox` table, as the drainer relies on it:
//! committed rows in claim order, the row locks of open claim transactions
//! (other claims skip them, as `SKIP LOCKED` does), leases on simulated
//! time, the `claimed_by` guard on marks and releases, attempts and parking,
//! unpark and skip, and the bounded retention sweep. Ordering keys as
//! PostgreSQL has them (issue 27): a keyed insert takes its key's lock
//! (`event_outbox_key`'s row) until its transaction ends, and a second
//! writer of the key waits for it; numbers follow from the committed ones;
//! the claim takes a keyed row only as a candidate that is still its key's
//! head; the key window steps through the keys in byte order. Each method
//! is one statement of `outbox/src/pg/sql/`; the sessions in `mod.rs` call
//! them.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use super::partitions::{self, Home, Partitions};
use crate::trace::{Event, Trace};
use crate::wire::{PgReply, WireOrdering, WireParked, WireRow};

/// A routing key no broker accepts: the drainer blames and parks such rows.
pub fn unpublishable_key(key: &str) -> bool {
    key.is_empty() || key.len() > outbox::envelope::ROUTING_KEY_MAX_BYTES
}

/// One outbox row (times in the fake's milliseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub id: Uuid,
    pub routing_key: String,
    pub body: String,
    pub enqueued_ms: u64,
    pub published_ms: Option<u64>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub claimed_ms: Option<u64>,
    pub claimed_by: Option<String>,
    pub parked_ms: Option<u64>,
    /// Its ordering key and number.
    pub ordering: Option<WireOrdering>,
    /// Skipped by an operator (`skipped_at`): marked published, never sent.
    pub skipped_ms: Option<u64>,
}

impl Row {
    /// Unclaimed, or its lease older than `lease_ttl_ms` at `now` (the
    /// claim's `claimed_at < now() - ttl`).
    fn lease_free(&self, lease_ttl_ms: u64, now: u64) -> bool {
        self.claimed_ms.is_none_or(|c| c + lease_ttl_ms < now)
    }

    /// A row as an INSERT writes it.
    pub fn new(id: Uuid, routing_key: String, body: String, now: u64) -> Self {
        Self {
            id,
            routing_key,
            body,
            enqueued_ms: now,
            published_ms: None,
            attempts: 0,
            last_error: None,
            claimed_ms: None,
            claimed_by: None,
            parked_ms: None,
            ordering: None,
            skipped_ms: None,
        }
    }
}

/// What a crash took back of the rows ([`OutboxTable::restore_rows`]).
#[derive(Debug, Default)]
pub struct Restored {
    /// Rows whose lease went back, with their previous holder.
    pub leases: Vec<(Uuid, Option<String>)>,
    /// Rows unpublished again.
    pub unmarked: Vec<Uuid>,
    /// Rows whose parked flag went back, with the flag they have again.
    pub parks: Vec<(Uuid, bool)>,
}

/// A claim in an open transaction: the row and its lease before the claim,
/// restored if the transaction rolls back.
pub type PriorLease = (Uuid, Option<u64>, Option<String>);

/// What `outbox_list_parked.sql` selects and reads.
#[derive(Debug, Clone, Copy)]
pub struct ParkedSelect<'a> {
    pub limit: u32,
    /// Rows after this one (parked ms, id) only.
    pub after: Option<(u64, Uuid)>,
    pub ids: Option<&'a [Uuid]>,
    pub payload_field: Option<&'a outbox::core::ports::PayloadField>,
    pub omit_envelope: bool,
}

/// The committed table plus the locks of open claim transactions.
#[derive(Debug, Default, Clone)]
pub struct OutboxTable {
    rows: BTreeMap<Uuid, Row>,
    /// Unpublished, unparked rows without an ordering key, in claim order
    /// (`event_outbox_claim_unkeyed_idx`).
    pending: BTreeSet<(u64, Uuid)>,
    /// Unpublished keyed rows, parked ones included, in (key, number)
    /// order (`event_outbox_key_head_idx`): a key's first entry is its head.
    heads: BTreeSet<(String, i64, Uuid)>,
    /// `event_outbox_key`: each key's last committed number.
    key_last: BTreeMap<String, i64>,
    /// Keys whose `event_outbox_key` row an open transaction holds locked
    /// (it wrote the key), with how many numbers it took.
    key_locks: BTreeMap<String, (u64, i64)>,
    /// Rows locked by an open transaction, by session number.
    locks: BTreeMap<Uuid, u64>,
    /// Every envelope ever committed (the janitor deletes rows; this keeps
    /// what consumers must eventually apply, for the world's quiescence).
    committed: BTreeSet<Uuid>,
    /// The partitioned layout, when the table has it (issue 28).
    pub partitions: Option<Partitions>,
}

impl OutboxTable {
    /// Every committed row.
    pub fn rows(&self) -> impl Iterator<Item = &Row> {
        self.rows.values()
    }

    /// One committed row.
    pub fn row(&self, id: &Uuid) -> Option<&Row> {
        self.rows.get(id)
    }

    /// Every envelope ever committed, deleted ones included.
    pub fn committed(&self) -> &BTreeSet<Uuid> {
        &self.committed
    }

    /// Whether a committed (or open) row has this id.
    pub fn contains(&self, id: &Uuid) -> bool {
        self.rows.contains_key(id)
    }

    /// Commits an inserted row.
    pub fn commit_row(&mut self, row: Row) {
        let id = row.id;
        self.committed.insert(id);
        self.rows.insert(id, row);
        self.refresh_pending(id);
    }

    /// The sessions other than `session` holding the lock of a key among
    /// `keys`: an insert of those keys waits for them.
    pub fn key_holders<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k str>,
        session: u64,
    ) -> Vec<u64> {
        let mut holders: Vec<u64> = keys
            .into_iter()
            .filter_map(|k| self.key_locks.get(k))
            .map(|(s, _)| *s)
            .filter(|s| *s != session)
            .collect();
        holders.sort_unstable();
        holders.dedup();
        holders
    }

    /// The next number of `key` for `session`'s insert, taking the key's
    /// lock (the caller checked nobody else holds it).
    pub fn take_number(&mut self, key: &str, session: u64) -> i64 {
        let last = self.key_last.get(key).copied().unwrap_or(0);
        let (holder, taken) = self.key_locks.entry(key.to_owned()).or_insert((session, 0));
        debug_assert_eq!(*holder, session, "the key is locked by another");
        *taken += 1;
        last + *taken
    }

    /// `session`'s transaction ended: the numbers it took become the keys'
    /// last if it committed (given back if not), and its key locks are
    /// released. True if it held any.
    pub fn end_key_locks(&mut self, session: u64, committed: bool) -> bool {
        let mine: Vec<String> = self
            .key_locks
            .iter()
            .filter(|(_, (s, _))| *s == session)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &mine {
            let (_, taken) = self.key_locks.remove(key).expect("listed above");
            if committed {
                *self.key_last.entry(key.clone()).or_insert(0) += taken;
            }
        }
        !mine.is_empty()
    }

    /// Whether a keyed row is its key's head: no row of its key with a
    /// lower number is unpublished.
    fn is_head(&self, key: &str, seq: i64) -> bool {
        self.heads
            .range((key.to_owned(), i64::MIN, Uuid::nil())..)
            .next()
            .is_some_and(|(k, s, _)| k == key && *s == seq)
    }

    fn refresh_pending(&mut self, id: Uuid) {
        if let Some(r) = self.rows.get(&id) {
            let unpublished = r.published_ms.is_none();
            match &r.ordering {
                Some((key, seq)) => {
                    let entry = (key.clone(), *seq, r.id);
                    if unpublished {
                        self.heads.insert(entry);
                    } else {
                        self.heads.remove(&entry);
                    }
                }
                None => {
                    let entry = (r.enqueued_ms, r.id);
                    if unpublished && r.parked_ms.is_none() {
                        self.pending.insert(entry);
                    } else {
                        self.pending.remove(&entry);
                    }
                }
            }
        }
    }

    /// Releases the locks a transaction held on `claimed`.
    pub fn unlock(&mut self, claimed: &[PriorLease]) {
        for (id, _, _) in claimed {
            self.locks.remove(id);
        }
    }

    /// Rolls back claims: the leases return to their previous holders.
    /// Returns the owners restored, for the trace.
    pub fn restore(&mut self, claimed: Vec<PriorLease>) -> Vec<(Uuid, Option<String>)> {
        let mut owners = Vec::new();
        for (id, claimed_ms, claimed_by) in claimed.into_iter().rev() {
            self.locks.remove(&id);
            if let Some(row) = self.rows.get_mut(&id) {
                row.claimed_ms = claimed_ms;
                row.claimed_by = claimed_by.clone();
                owners.push((id, claimed_by));
            }
        }
        owners
    }

    /// A crash took back asynchronous commits: each row as it was before
    /// them (`before`, newest commit first). Returns the leases restored
    /// (with their holders) and the rows unpublished again, for the trace.
    pub fn restore_rows(&mut self, before: Vec<Row>) -> Restored {
        let (mut leases, mut unmarked, mut parks) =
            (BTreeMap::new(), BTreeSet::new(), BTreeMap::new());
        for old in before {
            let id = old.id;
            let Some(row) = self.rows.get_mut(&id) else {
                continue;
            };
            if row.published_ms.is_some() && old.published_ms.is_none() {
                unmarked.insert(id);
            }
            if (row.claimed_ms, &row.claimed_by) != (old.claimed_ms, &old.claimed_by) {
                leases.insert(id, old.claimed_by.clone());
            }
            if row.parked_ms.is_some() != old.parked_ms.is_some() {
                parks.insert(id, old.parked_ms.is_some());
            }
            *row = old;
            self.refresh_pending(id);
        }
        Restored {
            leases: leases.into_iter().collect(),
            unmarked: unmarked.into_iter().collect(),
            parks: parks.into_iter().collect(),
        }
    }

    /// Forgets the open transactions' locks (a promoted standby has none).
    pub fn clear_open(&mut self) {
        self.locks.clear();
        self.key_locks.clear();
    }

    /// What this table (a promoted standby's) took back of the rows both
    /// hold, against the old primary's `old`: leases as this table has
    /// them, rows unpublished again, parked flags as this table has them.
    pub fn taken_back_from(&self, old: &OutboxTable) -> Restored {
        let mut restored = Restored::default();
        for (id, row) in &self.rows {
            let Some(was) = old.rows.get(id) else {
                continue;
            };
            if was.published_ms.is_some() && row.published_ms.is_none() {
                restored.unmarked.push(*id);
            }
            if (was.claimed_ms, &was.claimed_by) != (row.claimed_ms, &row.claimed_by) {
                restored.leases.push((*id, row.claimed_by.clone()));
            }
            if was.parked_ms.is_some() != row.parked_ms.is_some() {
                restored.parks.push((*id, row.parked_ms.is_some()));
            }
        }
        restored
    }

    /// Moves a row's publication `by_ms` into the past (conformance tests).
    pub fn backdate_published(&mut self, id: Uuid, by_ms: u64) {
        if let Some(p) = self.rows.get_mut(&id).and_then(|r| r.published_ms.as_mut()) {
            *p = p.saturating_sub(by_ms);
        }
    }

    /// The parked rows among `ids` (all parked rows for `None`): what an
    /// unpark or a skip would change.
    pub fn parked_among(&self, ids: Option<&[Uuid]>) -> Vec<Uuid> {
        self.rows
            .values()
            .filter(|r| r.published_ms.is_none() && r.parked_ms.is_some())
            .filter(|r| ids.is_none_or(|ids| ids.contains(&r.id)))
            .map(|r| r.id)
            .collect()
    }

    /// `outbox_skip.sql`: the parked rows among `ids` (all for `None`) are
    /// marked published without being sent, recorded as skipped, their
    /// lease dropped. Returns the rows skipped.
    pub fn skip(&mut self, ids: Option<&[Uuid]>, now: u64) -> Vec<Uuid> {
        let targets = self.parked_among(ids);
        for id in &targets {
            let row = self.rows.get_mut(id).expect("listed above");
            row.published_ms = Some(now);
            row.skipped_ms = Some(now);
            row.claimed_ms = None;
            row.claimed_by = None;
            self.refresh_pending(*id);
        }
        targets
    }

    /// Unparks the parked rows among `ids` (all parked rows for `None`):
    /// a fresh attempts budget and no lease. Returns the rows unparked.
    pub fn unpark(&mut self, ids: Option<&[Uuid]>) -> Vec<Uuid> {
        let targets = self.parked_among(ids);
        for id in &targets {
            let row = self.rows.get_mut(id).expect("listed above");
            row.parked_ms = None;
            row.attempts = 0;
            row.claimed_ms = None;
            row.claimed_by = None;
            self.refresh_pending(*id);
        }
        targets
    }

    /// The row if `replica` holds its lease and no other open transaction
    /// holds its lock (the `claimed_by` guard).
    fn guarded(&mut self, id: &Uuid, replica: &str, session: u64) -> Option<&mut Row> {
        if self.locks.get(id).is_some_and(|s| *s != session) {
            return None; // locked by another open transaction
        }
        self.rows
            .get_mut(id)
            .filter(|r| r.claimed_by.as_deref() == Some(replica))
    }

    /// `outbox_key_window.sql`: the heads of up to `limit` keys after
    /// `after` in byte order, each with whether it is claimable (not
    /// parked, lease free or expired).
    pub fn key_window(
        &self,
        after: &str,
        limit: u32,
        lease_ttl_ms: u64,
        now: u64,
    ) -> Vec<(String, Uuid, bool)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = (after.to_owned(), i64::MAX, Uuid::max());
        let mut out: Vec<(String, Uuid, bool)> = Vec::new();
        for (key, _, id) in self.heads.range((Excluded(from), Unbounded)) {
            if out.last().is_some_and(|(k, _, _)| k == key) {
                continue; // not the key's first entry: not its head
            }
            if out.len() == limit as usize {
                break;
            }
            let r = &self.rows[id];
            let claimable = r.parked_ms.is_none() && r.lease_free(lease_ttl_ms, now);
            out.push((key.clone(), *id, claimable));
        }
        out
    }

    /// `outbox_claim.sql`: up to `batch` unpublished, unparked rows that are
    /// unclaimed or whose lease expired, skipping locked ones, in claim
    /// order: unkeyed rows (only past `after`, microseconds and id, when
    /// given: `sql::CLAIM_AFTER`), and the `key_heads` that are still
    /// their key's head; stamps the lease and locks them for the open
    /// transaction.
    #[allow(clippy::too_many_arguments)]
    pub fn claim(
        &mut self,
        claimed: &mut Vec<PriorLease>,
        session: u64,
        replica: &str,
        batch: u32,
        lease_ttl_ms: u64,
        key_heads: &[Uuid],
        after: Option<(i64, Uuid)>,
        now: u64,
    ) -> Vec<WireRow> {
        let free =
            |id: &Uuid| !self.locks.contains_key(id) && self.rows[id].lease_free(lease_ttl_ms, now);
        let past = |(ms, id): &(u64, Uuid)| after.is_none_or(|a| (micros(*ms), *id) > a);
        let mut candidates: Vec<(u64, Uuid)> = self
            .pending
            .iter()
            .filter(|e| past(e))
            .filter(|(_, id)| free(id))
            .take(batch as usize)
            .copied()
            .collect();
        let mut keyed: Vec<(u64, Uuid)> = key_heads
            .iter()
            .filter_map(|id| self.rows.get(id))
            .filter(|r| r.published_ms.is_none() && r.parked_ms.is_none() && free(&r.id))
            .filter(|r| {
                r.ordering
                    .as_ref()
                    .is_some_and(|(key, seq)| self.is_head(key, *seq))
            })
            .map(|r| (r.enqueued_ms, r.id))
            .collect();
        keyed.sort_unstable();
        keyed.dedup();
        keyed.truncate(batch as usize);
        candidates.extend(keyed);
        candidates.sort_unstable();
        candidates.truncate(batch as usize);
        let mut out = Vec::with_capacity(candidates.len());
        for (_, id) in candidates {
            let row = self.rows.get_mut(&id).expect("pending row exists");
            claimed.push((id, row.claimed_ms, row.claimed_by.clone()));
            row.claimed_ms = Some(now);
            row.claimed_by = Some(replica.to_owned());
            out.push(WireRow {
                id,
                routing_key: row.routing_key.clone(),
                body: row.body.clone(),
                attempts: row.attempts,
                age_ms: now.saturating_sub(row.enqueued_ms),
                ordering: row.ordering.clone(),
                enqueued_us: micros(row.enqueued_ms),
            });
            self.locks.insert(id, session);
        }
        out
    }

    /// `outbox_mark_published.sql`, guarded by `claimed_by`.
    pub fn mark_published(
        &mut self,
        session: u64,
        replica: &str,
        ids: &[Uuid],
        now: u64,
    ) -> Vec<Uuid> {
        let mut changed = Vec::new();
        for id in ids {
            if let Some(row) = self.guarded(id, replica, session) {
                row.published_ms = Some(now);
                changed.push(*id);
                self.refresh_pending(*id);
            }
        }
        changed
    }

    /// `outbox_mark_failed.sql`: attempts + 1, `last_error`, lease released,
    /// parked at the budget; guarded by `claimed_by`. Returns the rows
    /// changed and those that parked.
    pub fn mark_failed(
        &mut self,
        session: u64,
        replica: &str,
        failures: &[(Uuid, String)],
        max_attempts: u32,
        now: u64,
    ) -> (Vec<Uuid>, Vec<Uuid>) {
        let (mut changed, mut parked) = (Vec::new(), Vec::new());
        for (id, error) in failures {
            let Some(row) = self.guarded(id, replica, session) else {
                continue;
            };
            if row.published_ms.is_some() {
                continue;
            }
            row.attempts += 1;
            row.last_error = Some(error.clone());
            row.claimed_ms = None;
            row.claimed_by = None;
            if row.attempts >= max_attempts as i32 {
                row.parked_ms = Some(now);
                parked.push(*id);
            }
            changed.push(*id);
            self.refresh_pending(*id);
        }
        (changed, parked)
    }

    /// `outbox_release.sql`, guarded by `claimed_by`; attempts untouched.
    pub fn release(&mut self, session: u64, replica: &str, ids: &[Uuid]) -> Vec<Uuid> {
        let mut changed = Vec::new();
        for id in ids {
            if let Some(row) = self.guarded(id, replica, session) {
                row.claimed_ms = None;
                row.claimed_by = None;
                changed.push(*id);
            }
        }
        changed
    }

    /// `outbox_stats.sql`.
    pub fn stats(&self, now: u64) -> PgReply {
        let (mut pending, mut parked, mut blocked) = (0, 0, 0);
        let mut oldest: Option<u64> = None;
        // The lowest parked number of each key.
        let mut parked_at: BTreeMap<&str, i64> = BTreeMap::new();
        for r in self.rows.values().filter(|r| r.published_ms.is_none()) {
            if let (Some(_), Some((key, seq))) = (r.parked_ms, &r.ordering) {
                let lowest = parked_at.entry(key).or_insert(*seq);
                *lowest = (*lowest).min(*seq);
            }
        }
        for r in self.rows.values().filter(|r| r.published_ms.is_none()) {
            if r.parked_ms.is_some() {
                parked += 1;
            } else {
                pending += 1;
                oldest = Some(oldest.map_or(r.enqueued_ms, |o| o.min(r.enqueued_ms)));
                if let Some((key, seq)) = &r.ordering
                    && parked_at.get(key.as_str()).is_some_and(|p| p < seq)
                {
                    blocked += 1;
                }
            }
        }
        PgReply::Stats {
            pending,
            oldest_age_ms: oldest.map_or(0, |o| now.saturating_sub(o)),
            parked,
            blocked,
        }
    }

    /// `outbox_delete_published.sql`: at most `limit` rows published more
    /// than `older_than_ms` ago, oldest first. On the partitioned layout
    /// (`outbox::pg::partitions`), partition by partition in the janitor's
    /// order, leaving out the closed partitions no unpublished row holds.
    pub fn delete_published(&mut self, older_than_ms: u64, limit: u32, now: u64) -> Vec<Uuid> {
        let spared = self.spared(now);
        let home = |id: Uuid| self.partitions.as_ref().map(|p| p.home(id));
        let mut victims: Vec<(Option<Home>, u64, Uuid)> = self
            .rows
            .values()
            .filter_map(|r| r.published_ms.map(|p| (home(r.id), p, r.id)))
            .filter(|(h, p, _)| p + older_than_ms < now && !h.is_some_and(|h| spared.contains(&h)))
            .collect();
        victims.sort();
        victims.truncate(limit as usize);
        let ids: Vec<Uuid> = victims.into_iter().map(|(_, _, id)| id).collect();
        for id in &ids {
            self.rows.remove(id);
        }
        ids
    }

    /// The closed partitions no unpublished row holds (the row sweep
    /// leaves them to a drop).
    fn spared(&self, now: u64) -> BTreeSet<Home> {
        match &self.partitions {
            Some(parts) => partitions::spared(parts, &self.row_states(), now),
            None => BTreeSet::new(),
        }
    }

    fn row_states(&self) -> Vec<partitions::RowState> {
        self.rows
            .values()
            .map(|r| (r.id, r.published_ms, self.locks.contains_key(&r.id)))
            .collect()
    }

    /// `outbox::pg::partitions::retire` on this table. Returns what it did
    /// and the rows it dropped.
    pub fn retire_partitions(&mut self, older_than_ms: u64, now: u64) -> (PgReply, Vec<Uuid>) {
        let states = self.row_states();
        let Some(parts) = &mut self.partitions else {
            return (PgReply::Retired(Default::default()), Vec::new());
        };
        let (retired, gone) = partitions::retire(parts, &states, older_than_ms, now);
        for id in &gone {
            self.rows.remove(id);
        }
        (PgReply::Retired(retired), gone.into_iter().collect())
    }

    /// `outbox_list_parked.sql`: the parked rows `s` selects.
    pub fn list_parked(&self, s: &ParkedSelect<'_>) -> Vec<WireParked> {
        let mut parked: Vec<WireParked> = self
            .rows
            .values()
            .filter(|r| r.published_ms.is_none())
            .filter(|r| s.ids.is_none_or(|ids| ids.contains(&r.id)))
            .filter(|r| {
                s.payload_field
                    .is_none_or(|f| super::inbox::payload_holds(&r.body, f))
            })
            .filter_map(|r| {
                r.parked_ms.map(|p| WireParked {
                    id: r.id,
                    routing_key: r.routing_key.clone(),
                    attempts: r.attempts,
                    last_error: r.last_error.clone(),
                    enqueued_ms: r.enqueued_ms,
                    parked_ms: p,
                    ordering: r.ordering.clone(),
                    envelope: if s.omit_envelope {
                        String::new()
                    } else {
                        r.body.clone()
                    },
                })
            })
            .collect();
        parked.retain(|p| s.after.is_none_or(|a| (p.parked_ms, p.id) > a));
        parked.sort_by_key(|p| (p.parked_ms, p.id));
        parked.truncate(s.limit as usize);
        parked
    }

    /// The operator's unpark in the liveness phase: every parked row except
    /// those whose routing key no broker accepts (the operator's fix cannot
    /// make them publishable). Traced as `Unparked`. Of those, the ones
    /// with an ordering key are skipped (traced as `Skipped`): their keys'
    /// later events go on.
    pub fn operator_unpark_fixable(&mut self, trace: &Trace) {
        let fixable: Vec<Uuid> = self
            .rows
            .values()
            .filter(|r| r.parked_ms.is_some() && !unpublishable_key(&r.routing_key))
            .map(|r| r.id)
            .collect();
        let ids = self.unpark(Some(&fixable));
        if !ids.is_empty() {
            trace.now(Event::Unparked { ids });
        }
        // A parked row no fix can publish holds back its ordering key's
        // later events: the operator skips it.
        let holding: Vec<Uuid> = self
            .rows
            .values()
            .filter(|r| r.published_ms.is_none() && r.parked_ms.is_some() && r.ordering.is_some())
            .map(|r| r.id)
            .collect();
        let now = super::now_ms();
        let ids = self.skip(Some(&holding), now);
        if !ids.is_empty() {
            trace.now(Event::Skipped { ids });
        }
    }
}

/// Simulated milliseconds as the claim order's microseconds.
fn micros(ms: u64) -> i64 {
    i64::try_from(ms.saturating_mul(1000)).unwrap_or(i64::MAX)
}
