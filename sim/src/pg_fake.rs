//! The fake PostgreSQL: the `event_outbox` table as the drainer relies on it,
//! served on the simulated `pg` host.
//!
//! Modelled: transactions (inserts invisible until commit, rolled back when
//! the client's connection ends or the host crashes), the claim's row locks
//! (rows claimed in an open transaction are skipped by other claims, as with
//! `SKIP LOCKED`, and their leases roll back with it), leases on simulated
//! time, the `claimed_by` guard on marks and releases, attempts and parking,
//! unpark, and the retention sweep. The table itself is the "disk": it
//! survives a crash of the host; open transactions do not.
//!
//! Faults (each survivable, and why):
//! - **reply lost after apply** (`lose_reply_prob`): the request takes
//!   effect and the connection is closed before the reply. A lost claim reply
//!   leaves leases that expire; a lost mark reply leaves rows published with
//!   the drainer unaware (it retries nothing it needs); a lost commit reply
//!   leaves the workload unsure, which is why the checker takes the committed
//!   set from this fake, not from the client.
//! - **statement failure** (`fail_prob`): the request is refused without
//!   effect. Store errors are blameless: claims are released or expire and
//!   attempts do not move.
//! - **unavailable** (the world partitions `pg`): requests and connects hang
//!   until the adapters' timeouts; nothing committed is lost because nothing
//!   is acknowledged without being applied.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use outbox::envelope::ROUTING_KEY_MAX_BYTES;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

use crate::trace::{Event, Trace};
use crate::wire::{PgReply, PgRequest, WireParked, WireRow, read_frame, write_frame};

/// The fake's port.
pub const PG_PORT: u16 = 5432;

/// The fake's clock starts a day after the simulation's zero, so rows can be
/// backdated (retention tests) without underflow.
const CLOCK_OFFSET_MS: u64 = 86_400_000;

/// A routing key no broker accepts: the drainer blames and parks such rows.
pub fn unpublishable_key(key: &str) -> bool {
    key.is_empty() || key.len() > ROUTING_KEY_MAX_BYTES
}

fn now_ms() -> u64 {
    crate::sim_now_ms() + CLOCK_OFFSET_MS
}

/// One outbox row (times in simulated milliseconds).
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
}

/// The committed table plus the locks of open claim transactions.
#[derive(Debug, Default)]
pub struct Table {
    rows: BTreeMap<Uuid, Row>,
    /// Unpublished, unparked rows in claim order.
    pending: BTreeSet<(u64, Uuid)>,
    /// Rows locked by an open transaction, by session number.
    locks: BTreeMap<Uuid, u64>,
    /// The consumer side: `event_inbox` and the handler's domain table.
    pub inbox: crate::pg_inbox::Inbox,
    /// Every envelope ever committed (the janitor deletes rows; this keeps
    /// what consumers must eventually apply).
    committed: BTreeSet<Uuid>,
}

impl Table {
    /// Every committed row.
    pub fn rows(&self) -> impl Iterator<Item = &Row> {
        self.rows.values()
    }

    fn insert(&mut self, row: Row) {
        self.committed.insert(row.id);
        self.pending.insert((row.enqueued_ms, row.id));
        self.rows.insert(row.id, row);
    }

    fn refresh_pending(&mut self, id: Uuid) {
        if let Some(r) = self.rows.get(&id) {
            let key = (r.enqueued_ms, r.id);
            if r.published_ms.is_none() && r.parked_ms.is_none() {
                self.pending.insert(key);
            } else {
                self.pending.remove(&key);
            }
        }
    }

    /// Unparks the parked rows among `ids` (all parked rows for `None`):
    /// a fresh attempts budget and no lease. Returns the rows unparked.
    fn unpark(&mut self, ids: Option<&[Uuid]>) -> Vec<Uuid> {
        let targets: Vec<Uuid> = self
            .rows
            .values()
            .filter(|r| r.published_ms.is_none() && r.parked_ms.is_some())
            .filter(|r| ids.is_none_or(|ids| ids.contains(&r.id)))
            .map(|r| r.id)
            .collect();
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

    fn guarded<'a>(&'a mut self, id: &Uuid, replica: &str, session: u64) -> Option<&'a mut Row> {
        if self.locks.get(id).is_some_and(|s| *s != session) {
            return None; // locked by another open transaction
        }
        self.rows
            .get_mut(id)
            .filter(|r| r.claimed_by.as_deref() == Some(replica))
    }
}

/// Fault settings, changed by the world while the simulation runs.
#[derive(Debug, Clone, Default)]
pub struct PgFaults {
    /// Probability that an applied request's reply is lost.
    pub lose_reply_prob: f64,
    /// Probability that a request fails without effect.
    pub fail_prob: f64,
}

/// Everything the fake shares with the world: the table, the faults, the RNG.
#[derive(Debug, Clone)]
pub struct PgState {
    pub table: Arc<Mutex<Table>>,
    pub faults: Arc<Mutex<PgFaults>>,
    rng: Arc<Mutex<SmallRng>>,
    sessions: Arc<Mutex<u64>>,
    /// Woken whenever a transaction ends (inbox lock waiters recheck).
    unlocked: Arc<tokio::sync::Notify>,
    trace: Trace,
}

impl PgState {
    /// A fresh, empty database.
    pub fn new(seed: u64, trace: Trace) -> Self {
        Self {
            table: Arc::default(),
            faults: Arc::default(),
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
            sessions: Arc::default(),
            unlocked: Arc::default(),
            trace,
        }
    }

    fn roll(&self, p: f64) -> bool {
        p > 0.0 && self.rng.lock().expect("rng").random_bool(p.min(1.0))
    }

    /// An operator unparks every parked row, directly on the table (the
    /// liveness phase of poison scenarios).
    /// Rows whose routing key no broker accepts are left parked: the
    /// operator's fix cannot make them publishable.
    pub fn operator_unpark_all(&self) {
        let mut table = self.table.lock().expect("table");
        let fixable: Vec<Uuid> = table
            .rows
            .values()
            .filter(|r| r.parked_ms.is_some() && !unpublishable_key(&r.routing_key))
            .map(|r| r.id)
            .collect();
        let ids = table.unpark(Some(&fixable));
        drop(table);
        if !ids.is_empty() {
            self.trace.now(Event::Unparked { ids });
        }
    }

    /// Rows parked now.
    pub fn parked_ids(&self) -> BTreeSet<Uuid> {
        self.table
            .lock()
            .expect("table")
            .rows
            .values()
            .filter(|r| r.published_ms.is_none() && r.parked_ms.is_some())
            .map(|r| r.id)
            .collect()
    }

    /// Moves a row's publication `by` into the past (conformance tests).
    pub fn backdate_published(&self, id: Uuid, by: std::time::Duration) {
        let mut table = self.table.lock().expect("table");
        if let Some(p) = table
            .rows
            .get_mut(&id)
            .and_then(|r| r.published_ms.as_mut())
        {
            *p = p.saturating_sub(by.as_millis() as u64);
        }
    }

    /// Every committed row's id and attempts.
    pub fn attempts(&self) -> BTreeMap<Uuid, i32> {
        self.table
            .lock()
            .expect("table")
            .rows
            .values()
            .map(|r| (r.id, r.attempts))
            .collect()
    }

    /// Whether every committed row is published, or parked for good (its
    /// routing key no broker accepts): the run's quiescence.
    pub fn drained(&self) -> bool {
        self.table.lock().expect("table").rows.values().all(|r| {
            r.published_ms.is_some() || (r.parked_ms.is_some() && unpublishable_key(&r.routing_key))
        })
    }

    /// Published rows still present although published more than `age` ago.
    pub fn published_before(&self, age: std::time::Duration) -> Vec<Uuid> {
        let now = now_ms();
        self.table
            .lock()
            .expect("table")
            .rows
            .values()
            .filter(|r| {
                r.published_ms
                    .is_some_and(|p| p + (age.as_millis() as u64) < now)
            })
            .map(|r| r.id)
            .collect()
    }

    /// Committed envelopes a subscription of every event must apply: all
    /// but those whose routing key no broker accepts (never published).
    pub fn deliverable(&self) -> BTreeSet<Uuid> {
        let table = self.table.lock().expect("table");
        table
            .committed
            .iter()
            .filter(|id| {
                table
                    .rows
                    .get(id)
                    .is_none_or(|r| !unpublishable_key(&r.routing_key))
            })
            .copied()
            .collect()
    }

    /// Whether every deliverable envelope is processed in the inbox.
    pub fn consumed(&self) -> bool {
        let deliverable = self.deliverable();
        let table = self.table.lock().expect("table");
        let processed: BTreeSet<Uuid> = table
            .inbox
            .rows()
            .filter(|r| r.processed_ms.is_some())
            .map(|r| r.event_id)
            .collect();
        deliverable.is_subset(&processed)
    }

    /// Committed rows not yet published, parked ones included.
    pub fn unpublished(&self) -> BTreeSet<Uuid> {
        self.table
            .lock()
            .expect("table")
            .rows
            .values()
            .filter(|r| r.published_ms.is_none())
            .map(|r| r.id)
            .collect()
    }
}

/// Runs the server until the host crashes.
pub async fn serve(state: PgState) -> turmoil::Result {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PG_PORT)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let session = {
            let mut n = state.sessions.lock().expect("sessions");
            *n += 1;
            *n
        };
        tokio::spawn(Session::new(state.clone(), session).run(stream));
    }
}

/// An open transaction's effects, undone on rollback.
#[derive(Debug, Default)]
struct Tx {
    inserts: Vec<Row>,
    /// Rows this transaction claimed, with their lease before the claim.
    claimed: Vec<(Uuid, Option<u64>, Option<String>)>,
    /// Inbox rows, processed marks and handler effects.
    inbox: crate::pg_inbox::InboxTx,
}

struct Session {
    state: PgState,
    id: u64,
    client: String,
    tx: Option<Tx>,
    /// Idle-in-transaction timeout of the open transaction, if set.
    idle_tx_timeout: Option<std::time::Duration>,
}

impl Session {
    fn new(state: PgState, id: u64) -> Self {
        Self {
            state,
            id,
            client: format!("session-{id}"),
            tx: None,
            idle_tx_timeout: None,
        }
    }

    async fn run(mut self, stream: turmoil::net::TcpStream) {
        let (mut r, mut w) = stream.into_split();
        loop {
            let next = match self.idle_tx_timeout.filter(|_| self.tx.is_some()) {
                Some(limit) => {
                    match tokio::time::timeout(limit, read_frame::<_, PgRequest>(&mut r)).await {
                        Ok(next) => next,
                        Err(_) => {
                            self.state.trace.now(Event::Fault(format!(
                                "pg terminates {}'s session: idle in transaction past {} ms",
                                self.client,
                                limit.as_millis()
                            )));
                            break; // Drop rolls the transaction back
                        }
                    }
                }
                None => read_frame::<_, PgRequest>(&mut r).await,
            };
            let Ok(Some(req)) = next else { break };
            let fail = !matches!(req, PgRequest::Hello { .. })
                && self
                    .state
                    .roll(self.state.faults.lock().expect("faults").fail_prob);
            let reply = if fail {
                PgReply::Error("injected statement failure".into())
            } else {
                self.wait_for_inbox_lock(&req).await;
                self.apply(&req)
            };
            let lose = !matches!(req, PgRequest::Hello { .. })
                && !fail
                && self
                    .state
                    .roll(self.state.faults.lock().expect("faults").lose_reply_prob);
            if lose {
                self.state.trace.now(Event::ReplyLost {
                    server: "pg",
                    what: format!("{} {}", self.client, request_name(&req)),
                });
                break; // the connection dies; Drop rolls back an open tx
            }
            if write_frame(&mut w, &reply).await.is_err() {
                break;
            }
        }
    }

    /// Waits while another open transaction holds the inbox row `req`
    /// needs, as PostgreSQL's `INSERT … ON CONFLICT` waits on a row lock.
    async fn wait_for_inbox_lock(&self, req: &PgRequest) {
        loop {
            let unlocked = self.state.unlocked.notified();
            tokio::pin!(unlocked);
            unlocked.as_mut().enable();
            if !self
                .state
                .table
                .lock()
                .expect("table")
                .inbox
                .blocked(req, self.id)
            {
                return;
            }
            unlocked.await;
        }
    }

    fn apply(&mut self, req: &PgRequest) -> PgReply {
        let now = now_ms();
        let trace = self.state.trace.clone();
        let mut table = self.state.table.lock().expect("table");
        if let Some(reply) =
            table
                .inbox
                .apply(req, self.id, self.tx.as_mut().map(|t| &mut t.inbox), now)
        {
            if let (
                PgRequest::InboxTryInsert { entry },
                PgReply::Inbox(crate::wire::WireInsertOutcome::AlreadyProcessed),
            ) = (req, &reply)
            {
                trace.now(Event::InboxDuplicate {
                    client: self.client.clone(),
                    event_id: entry.event_id,
                });
            }
            if let (
                PgRequest::InboxRecordFailure { entry, .. },
                PgReply::Attempt {
                    attempts,
                    dead_lettered,
                },
            ) = (req, &reply)
            {
                trace.now(Event::InboxFailure {
                    event_id: entry.event_id,
                    attempts: *attempts,
                    dead_lettered: *dead_lettered,
                });
            }
            return reply;
        }
        match req {
            PgRequest::Hello { client } => {
                self.client = client.clone();
                PgReply::Ok
            }
            PgRequest::Begin => {
                if self.tx.is_some() {
                    return PgReply::Error("already in a transaction".into());
                }
                self.tx = Some(Tx::default());
                self.idle_tx_timeout = None;
                PgReply::Ok
            }
            PgRequest::SetIdleInTxTimeout { ms } => {
                if self.tx.is_none() {
                    return PgReply::Error("SET LOCAL outside a transaction".into());
                }
                self.idle_tx_timeout = Some(std::time::Duration::from_millis(*ms));
                PgReply::Ok
            }
            PgRequest::Commit => {
                let Some(tx) = self.tx.take() else {
                    return PgReply::Error("no transaction".into());
                };
                let ids: Vec<Uuid> = tx.inserts.iter().map(|r| r.id).collect();
                for row in tx.inserts {
                    table.insert(row);
                }
                if !tx.inbox.is_empty() {
                    let done = table.inbox.commit(tx.inbox, now);
                    self.state.unlocked.notify_waiters();
                    if !done.processed.is_empty() || !done.effects.is_empty() {
                        trace.now(Event::InboxCommitted {
                            client: self.client.clone(),
                            processed: done.processed,
                            effects: done.effects,
                        });
                    }
                }
                for (id, _, _) in &tx.claimed {
                    table.locks.remove(id);
                }
                if !ids.is_empty() {
                    trace.now(Event::Committed {
                        client: self.client.clone(),
                        ids,
                    });
                }
                PgReply::Ok
            }
            PgRequest::Rollback => {
                if self.tx.is_none() {
                    return PgReply::Error("no transaction".into());
                }
                drop(table);
                self.rollback();
                PgReply::Ok
            }
            PgRequest::Insert { rows } => {
                let Some(tx) = self.tx.as_mut() else {
                    return PgReply::Error("insert outside a transaction".into());
                };
                // One statement: a duplicate key (in the table, the open
                // transaction or the statement itself) inserts nothing.
                for (i, row) in rows.iter().enumerate() {
                    if table.rows.contains_key(&row.id)
                        || tx.inserts.iter().any(|r| r.id == row.id)
                        || rows[..i].iter().any(|r| r.id == row.id)
                    {
                        return PgReply::Error(format!(
                            "duplicate key value violates event_outbox_pkey: {}",
                            row.id
                        ));
                    }
                }
                tx.inserts.extend(rows.iter().map(|row| Row {
                    id: row.id,
                    routing_key: row.routing_key.clone(),
                    body: row.body.clone(),
                    enqueued_ms: now,
                    published_ms: None,
                    attempts: 0,
                    last_error: None,
                    claimed_ms: None,
                    claimed_by: None,
                    parked_ms: None,
                }));
                PgReply::Count(rows.len() as u64)
            }
            PgRequest::Claim {
                replica,
                batch_size,
                lease_ttl_ms,
            } => {
                let Some(tx) = self.tx.as_mut() else {
                    return PgReply::Error("claim outside a transaction".into());
                };
                let mut out = Vec::new();
                let candidates: Vec<Uuid> = table
                    .pending
                    .iter()
                    .map(|(_, id)| *id)
                    .filter(|id| !table.locks.contains_key(id))
                    .filter(|id| {
                        let r = &table.rows[id];
                        r.claimed_ms.is_none_or(|c| c + lease_ttl_ms < now)
                    })
                    .take(*batch_size as usize)
                    .collect();
                for id in candidates {
                    let row = table.rows.get_mut(&id).expect("pending row exists");
                    tx.claimed
                        .push((id, row.claimed_ms, row.claimed_by.clone()));
                    row.claimed_ms = Some(now);
                    row.claimed_by = Some(replica.clone());
                    out.push(WireRow {
                        id,
                        routing_key: row.routing_key.clone(),
                        body: row.body.clone(),
                        attempts: row.attempts,
                    });
                    table.locks.insert(id, self.id);
                }
                trace.now(Event::Claimed {
                    replica: replica.clone(),
                    ids: out.iter().map(|r| r.id).collect(),
                    attempts: out.iter().map(|r| r.attempts).collect(),
                });
                PgReply::Rows(out)
            }
            PgRequest::MarkPublished { replica, ids } => {
                let mut changed = Vec::new();
                for id in ids {
                    if let Some(row) = table.guarded(id, replica, self.id) {
                        row.published_ms = Some(now);
                        changed.push(*id);
                        table.refresh_pending(*id);
                    }
                }
                trace.now(Event::MarkedPublished {
                    replica: replica.clone(),
                    ids: changed.clone(),
                });
                PgReply::Count(changed.len() as u64)
            }
            PgRequest::MarkFailed {
                replica,
                failures,
                max_attempts,
            } => {
                let mut changed = Vec::new();
                let mut parked = Vec::new();
                for (id, error) in failures {
                    if let Some(row) = table.guarded(id, replica, self.id) {
                        if row.published_ms.is_some() {
                            continue;
                        }
                        row.attempts += 1;
                        row.last_error = Some(error.clone());
                        row.claimed_ms = None;
                        row.claimed_by = None;
                        if row.attempts >= *max_attempts as i32 {
                            row.parked_ms = Some(now);
                            parked.push(*id);
                        }
                        changed.push(*id);
                        table.refresh_pending(*id);
                    }
                }
                trace.now(Event::MarkedFailed {
                    replica: replica.clone(),
                    ids: changed.clone(),
                    parked: parked.clone(),
                });
                PgReply::Failed {
                    recorded: changed.len() as u64,
                    parked: parked.len() as u64,
                }
            }
            PgRequest::Release { replica, ids } => {
                let mut changed = Vec::new();
                for id in ids {
                    if let Some(row) = table.guarded(id, replica, self.id) {
                        row.claimed_ms = None;
                        row.claimed_by = None;
                        changed.push(*id);
                    }
                }
                trace.now(Event::Released {
                    replica: replica.clone(),
                    ids: changed.clone(),
                });
                PgReply::Count(changed.len() as u64)
            }
            PgRequest::Stats => {
                let mut pending = 0;
                let mut parked = 0;
                let mut oldest: Option<u64> = None;
                for r in table.rows.values().filter(|r| r.published_ms.is_none()) {
                    if r.parked_ms.is_some() {
                        parked += 1;
                    } else {
                        pending += 1;
                        oldest = Some(oldest.map_or(r.enqueued_ms, |o| o.min(r.enqueued_ms)));
                    }
                }
                PgReply::Stats {
                    pending,
                    oldest_age_ms: oldest.map_or(0, |o| now.saturating_sub(o)),
                    parked,
                }
            }
            PgRequest::DeletePublished {
                older_than_ms,
                limit,
            } => {
                let mut victims: Vec<(u64, Uuid)> = table
                    .rows
                    .values()
                    .filter_map(|r| r.published_ms.map(|p| (p, r.id)))
                    .filter(|(p, _)| p + older_than_ms < now)
                    .collect();
                victims.sort();
                victims.truncate(*limit as usize);
                let ids: Vec<Uuid> = victims.into_iter().map(|(_, id)| id).collect();
                for id in &ids {
                    table.rows.remove(id);
                }
                if !ids.is_empty() {
                    trace.now(Event::Deleted { ids: ids.clone() });
                }
                PgReply::Count(ids.len() as u64)
            }
            PgRequest::ListParked { limit } => {
                let mut parked: Vec<WireParked> = table
                    .rows
                    .values()
                    .filter(|r| r.published_ms.is_none())
                    .filter_map(|r| {
                        r.parked_ms.map(|p| WireParked {
                            id: r.id,
                            routing_key: r.routing_key.clone(),
                            attempts: r.attempts,
                            last_error: r.last_error.clone(),
                            enqueued_ms: r.enqueued_ms,
                            parked_ms: p,
                        })
                    })
                    .collect();
                parked.sort_by_key(|p| (p.parked_ms, p.id));
                parked.truncate(*limit as usize);
                PgReply::Parked(parked)
            }
            PgRequest::Unpark { ids } => {
                let targets = table.unpark(ids.as_deref());
                trace.now(Event::Unparked {
                    ids: targets.clone(),
                });
                PgReply::Count(targets.len() as u64)
            }
            // Answered by the inbox above.
            PgRequest::InboxTryInsert { .. }
            | PgRequest::InboxMarkProcessed { .. }
            | PgRequest::Effect { .. }
            | PgRequest::InboxRecordFailure { .. }
            | PgRequest::InboxList { .. }
            | PgRequest::InboxReset { .. }
            | PgRequest::InboxDeleteProcessed { .. } => {
                unreachable!("inbox requests are applied by Inbox::apply")
            }
        }
    }

    /// Undoes the open transaction: inserts vanish, claimed leases return to
    /// what they were, locks are released.
    fn rollback(&mut self) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        let mut table = self.state.table.lock().expect("table");
        table.inbox.rollback(tx.inbox);
        self.state.unlocked.notify_waiters();
        let mut owners = Vec::new();
        for (id, claimed_ms, claimed_by) in tx.claimed.into_iter().rev() {
            table.locks.remove(&id);
            if let Some(row) = table.rows.get_mut(&id) {
                row.claimed_ms = claimed_ms;
                row.claimed_by = claimed_by.clone();
                owners.push((id, claimed_by));
            }
        }
        if !owners.is_empty() {
            self.state.trace.now(Event::LeasesRestored { owners });
        }
        let ids: Vec<Uuid> = tx.inserts.iter().map(|r| r.id).collect();
        if !ids.is_empty() {
            self.state.trace.now(Event::RolledBack {
                client: self.client.clone(),
                ids,
            });
        }
    }
}

impl Drop for Session {
    /// The connection ended (closed, broken, or the host crashed): an open
    /// transaction is rolled back, as PostgreSQL does.
    fn drop(&mut self) {
        self.rollback();
    }
}

fn request_name(req: &PgRequest) -> &'static str {
    match req {
        PgRequest::Hello { .. } => "hello",
        PgRequest::Begin => "begin",
        PgRequest::SetIdleInTxTimeout { .. } => "set_idle_in_tx_timeout",
        PgRequest::Commit => "commit",
        PgRequest::Rollback => "rollback",
        PgRequest::Insert { .. } => "insert",
        PgRequest::Claim { .. } => "claim",
        PgRequest::MarkPublished { .. } => "mark_published",
        PgRequest::MarkFailed { .. } => "mark_failed",
        PgRequest::Release { .. } => "release",
        PgRequest::Stats => "stats",
        PgRequest::DeletePublished { .. } => "delete_published",
        PgRequest::ListParked { .. } => "list_parked",
        PgRequest::Unpark { .. } => "unpark",
        PgRequest::InboxTryInsert { .. } => "inbox_try_insert",
        PgRequest::InboxMarkProcessed { .. } => "inbox_mark_processed",
        PgRequest::Effect { .. } => "effect",
        PgRequest::InboxRecordFailure { .. } => "inbox_record_failure",
        PgRequest::InboxList { .. } => "inbox_list",
        PgRequest::InboxReset { .. } => "inbox_reset",
        PgRequest::InboxDeleteProcessed { .. } => "inbox_delete_processed",
    }
}
