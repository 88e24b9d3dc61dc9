//! The fake PostgreSQL: a state machine (sessions and transactions here,
//! the tables in [`outbox`] (`event_outbox`) and [`inbox`] (`event_inbox`
//! and the handler's domain table), what PostgreSQL refuses to store in
//! [`jsonb`]) that takes one request at a time with the time it arrived and
//! answers with a reply, a lost reply or "blocked on a row lock", and never
//! touches a network, a runtime or a clock; [`serve`] is its transport, the
//! simulated `pg` host of either engine.
//!
//! Modelled: sessions over the simulated network, one transaction at a time
//! per session; inserts invisible until commit; an error inside a
//! transaction aborts it (later statements fail with 25P02 until the
//! rollback, or until a rollback to a savepoint set before the error, as in
//! PostgreSQL), and its COMMIT answers like a successful one while rolling
//! it back (PostgreSQL answers the tag `ROLLBACK`, which drivers do not
//! read); a transaction rolls back when its connection ends or the host
//! crashes; errors as SQLSTATE and message, which the adapters map with the
//! production mapping. The tables are the "disk": they survive a crash of
//! the host; open transactions do not, and neither do the asynchronous
//! commits the WAL writer had not flushed ([`wal`]).
//!
//! The unkind parts, each shown against PostgreSQL by the inbox
//! conformance suite:
//! - a statement that waits on a lock (an inbox row another transaction
//!   holds, the handler's domain table locked by another session, a
//!   deferred unique key another open transaction wrote) keeps waiting, and
//!   its transaction keeps its locks, after its client stopped waiting for
//!   the reply: the server notices nothing until the wait ends;
//! - what ends such a wait: the lock, `statement_timeout` (57014),
//!   `lock_timeout` (55P03), a deadlock (40P01, found at once where
//!   PostgreSQL waits `deadlock_timeout`), `pg_cancel_backend` from another
//!   session (57014) or `pg_terminate_backend` (57P01, the session ends);
//! - `idle_in_transaction_session_timeout` ends the session with FATAL
//!   25P03;
//! - a deferred unique constraint fails at COMMIT (23505, the transaction
//!   rolled back), or earlier at `SET CONSTRAINTS ALL IMMEDIATE`; so does a
//!   deferred constraint trigger (P0001), which waits for nobody, so it can
//!   pass the check and still fail the COMMIT.
//!
//! Faults (each survivable, and why):
//! - **crash** (a `crash` fault on `pg`): sessions end, open transactions
//!   roll back, and the drainer's asynchronous commits of the last 600 ms
//!   are taken back ([`wal`] says why that is survivable).
//! - **reply lost after apply** (`lose_reply_prob`): the request takes
//!   effect and the connection is closed before the reply. A lost claim reply
//!   leaves leases that expire; a lost mark reply leaves rows published with
//!   the drainer unaware (it retries nothing it needs); a lost commit reply
//!   leaves the workload unsure, which is why the checker takes the committed
//!   set from this fake, not from the client.
//! - **statement failure** (`fail_prob`): the request is refused without
//!   effect with 40001 (a serialization failure: transient, nobody's fault).
//!   Claims are released or expire and attempts do not move; a subscriber
//!   retries in place and counts no attempt, even when the handler's own
//!   statement is the one that failed.
//! - **slow** (`delay_ms`): every reply waits, as on a database stalled on
//!   I/O or locks. A handler whose own statements it holds past the
//!   handler's deadline has not failed: it waited on the database, and
//!   the subscriber, which pings the database before blaming a handler
//!   that overran, counts no attempt. Claims slower than the Phase-2
//!   deadline hand their rows back at once.
//! - **unavailable** (the world partitions `pg`): requests and connects hang
//!   until the adapters' timeouts; nothing committed is lost because nothing
//!   is acknowledged without being applied.
//! - **refused data** (not a fault of the fake but of its input): a `jsonb`
//!   value PostgreSQL cannot store, or a NUL in `text`, is refused with
//!   PostgreSQL's SQLSTATE (class 22), which the subscriber must dead-letter
//!   at once rather than retry.

pub mod inbox;
pub mod jsonb;
pub mod outbox;
pub mod partitions;
pub mod serve;
pub mod standby;
pub mod wal;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

use std::collections::BTreeMap;

use self::inbox::{Caller, Inbox, InboxTx};
use self::outbox::{OutboxTable, PriorLease, Row};
use crate::trace::{Event, FaultKind, Trace, WaitEnd};
use crate::wire::{PgError, PgReply, PgRequest, TxSettings};

pub use self::serve::{PG_PORT, serve};

/// The fake's clock starts a day after the simulation's zero, so rows can be
/// backdated (retention tests) without underflow.
const CLOCK_OFFSET_MS: u64 = 86_400_000;

/// The fake's clock (`now()`) in milliseconds at simulated time `t`.
pub fn clock_ms(t: Duration) -> u64 {
    t.as_millis() as u64 + CLOCK_OFFSET_MS
}

/// The fake's clock (`now()`) in milliseconds, now.
pub fn now_ms() -> u64 {
    clock_ms(crate::sim_now())
}

/// A UUID v7's milliseconds at the fake's clock `now` (the simulation's
/// ids count from `workload::EPOCH_MS` at simulated zero).
pub fn id_ms(now: u64) -> u64 {
    crate::workload::EPOCH_MS + now.saturating_sub(CLOCK_OFFSET_MS)
}

/// The fake's clock at which UUID v7 ids reach `id_ms` (inverse of
/// [`id_ms`]).
pub fn fake_ms(id_ms: u64) -> u64 {
    (id_ms + CLOCK_OFFSET_MS).saturating_sub(crate::workload::EPOCH_MS)
}

/// The SQLSTATE of the injected statement failure (serialization failure).
pub const INJECTED_FAILURE_CODE: &str = "40001";

/// Both tables: the database's "disk".
#[derive(Debug, Default, Clone)]
pub struct Database {
    /// `event_outbox`.
    pub outbox: OutboxTable,
    /// `event_inbox` and the handler's domain table.
    pub inbox: Inbox,
    /// What a crash of the server takes back.
    pub wal: wal::Wal,
}

/// Fault settings, changed by the world while the simulation runs.
#[derive(Debug, Clone, Default)]
pub struct PgFaults {
    /// Probability that an applied request's reply is lost.
    pub lose_reply_prob: f64,
    /// Probability that a request fails without effect.
    pub fail_prob: f64,
    /// How long every reply waits before it is sent.
    pub reply_delay: Duration,
    /// The statements (by [`request_name`]) that may fail or lose their
    /// reply; all if empty.
    pub statements: Vec<String>,
}

impl PgFaults {
    /// Whether `req` is one the faults may strike.
    fn strikes(&self, req: &PgRequest) -> bool {
        !matches!(req, PgRequest::Hello { .. })
            && (self.statements.is_empty()
                || self.statements.iter().any(|s| s == request_name(req)))
    }
}

/// Everything the fake shares with the world: the tables, the faults, the
/// RNG.
#[derive(Debug, Clone)]
pub struct PgState {
    pub db: Arc<Mutex<Database>>,
    pub faults: Arc<Mutex<PgFaults>>,
    rng: Arc<Mutex<SmallRng>>,
    sessions: Arc<Mutex<u64>>,
    /// Woken whenever a transaction ends (inbox lock waiters recheck).
    unlocked: Arc<tokio::sync::Notify>,
    /// Counts commits that wrote outbox rows; listeners send a
    /// notification for each change.
    notify: Arc<super::Signal>,
    /// Every open session's handle for signals from other sessions.
    controls: Arc<Mutex<BTreeMap<u64, Arc<Control>>>>,
    /// The wait-for graph: sessions waiting on a lock, and the sessions
    /// holding it (deadlock detection).
    waits: Arc<Mutex<BTreeMap<u64, Vec<u64>>>>,
    /// While the server crashes: the open transactions of the sessions
    /// dying with it, by session number. The engine drops a host's tasks
    /// in an order of its own (tokio's task ids are process-wide), so they
    /// are rolled back here afterwards, in session order, for a trace that
    /// is the same on every run.
    dying: Arc<Mutex<Option<Dying>>>,
    /// The streaming replica a failover promotes.
    standby: Arc<Mutex<standby::Standby>>,
    /// A primary demoted in place: every write fails with 25006.
    read_only: Arc<std::sync::atomic::AtomicBool>,
    trace: Trace,
}

/// The open transactions of the sessions a crash ends, by session number,
/// with their clients.
type Dying = BTreeMap<u64, (String, Tx)>;

/// The session number of the outside session that holds the domain table
/// locked during a `DomainLock` fault (it never waits, so it is in no
/// deadlock).
pub const OUTSIDE_SESSION: u64 = 0;

/// What another session asked of one: `pg_terminate_backend` or
/// `pg_cancel_backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kill {
    Terminate,
    Cancel,
}

/// A session's handle for signals from other sessions.
#[derive(Debug, Default)]
pub struct Control {
    /// Its `application_name`, while a transaction set one.
    tag: Mutex<Option<String>>,
    /// The signal not yet acted on (a terminate overrides a cancel).
    kill: Mutex<Option<Kill>>,
    wake: tokio::sync::Notify,
}

impl Control {
    /// Takes the pending signal, if any.
    pub fn take(&self) -> Option<Kill> {
        self.kill.lock().expect("kill").take()
    }

    /// Resolves with the next signal (cancel-safe: one that arrives while
    /// nobody waits is kept).
    pub async fn signalled(&self) -> Kill {
        loop {
            let woken = self.wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if let Some(k) = self.take() {
                return k;
            }
            woken.await;
        }
    }

    /// Puts `kill` back as pending (for whoever acts on it next).
    pub fn resend(&self, kill: Kill) {
        self.send(kill);
    }

    fn send(&self, kill: Kill) {
        let mut pending = self.kill.lock().expect("kill");
        if *pending != Some(Kill::Terminate) {
            *pending = Some(kill);
        }
        drop(pending);
        self.wake.notify_one();
    }
}

impl PgState {
    /// A fresh, empty database.
    pub fn new(seed: u64, trace: Trace) -> Self {
        Self {
            db: Arc::default(),
            faults: Arc::default(),
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
            sessions: Arc::default(),
            unlocked: Arc::default(),
            notify: Arc::default(),
            controls: Arc::default(),
            waits: Arc::default(),
            dying: Arc::default(),
            standby: Arc::default(),
            read_only: Arc::default(),
            trace,
        }
    }

    /// The trace the fake records into.
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// Gives both tables the partitioned layout (issue 28) as
    /// `migrations-partitioned/` does at the simulation's start: partitions
    /// `width_ms` wide, three ahead of the cut.
    pub fn partition(&self, width_ms: u64) -> Self {
        let now_id = id_ms(clock_ms(Duration::ZERO));
        let mut db = self.lock();
        db.outbox.partitions = Some(partitions::Partitions::new(
            "event_outbox",
            width_ms,
            3,
            now_id,
        ));
        db.inbox.partitions = Some(partitions::Partitions::new(
            "event_inbox",
            width_ms,
            3,
            now_id,
        ));
        drop(db);
        self.clone()
    }

    fn roll(&self, p: f64) -> bool {
        p > 0.0 && self.rng.lock().expect("rng").random_bool(p.min(1.0))
    }

    /// A new session (a connection), numbered in the order they opened.
    pub fn open_session(&self) -> Session {
        let id = {
            let mut n = self.sessions.lock().expect("sessions");
            *n += 1;
            *n
        };
        let control = Arc::new(Control::default());
        self.controls
            .lock()
            .expect("controls")
            .insert(id, control.clone());
        Session::new(self.clone(), id, control)
    }

    /// Signals every session but `except` whose `application_name` is
    /// `name`; returns their numbers.
    fn signal(&self, name: &str, except: u64, kill: Kill) -> Vec<u64> {
        let controls = self.controls.lock().expect("controls");
        let mut hit = Vec::new();
        for (id, c) in controls.iter() {
            if *id != except && c.tag.lock().expect("tag").as_deref() == Some(name) {
                c.send(kill);
                hit.push(*id);
            }
        }
        hit
    }

    /// Records that `session` waits on `holders`; true if that closes a
    /// cycle of waits (a deadlock).
    pub fn wait_for(&self, session: u64, holders: &[u64]) -> bool {
        let mut waits = self.waits.lock().expect("waits");
        waits.insert(session, holders.to_vec());
        let mut seen = std::collections::BTreeSet::new();
        let mut stack: Vec<u64> = holders.to_vec();
        while let Some(s) = stack.pop() {
            if s == session {
                return true;
            }
            if seen.insert(s)
                && let Some(next) = waits.get(&s)
            {
                stack.extend(next.iter().copied());
            }
        }
        false
    }

    /// `session` no longer waits.
    pub fn wait_over(&self, session: u64) {
        self.waits.lock().expect("waits").remove(&session);
    }

    /// Holds (or frees) the handler's domain table, as another session's
    /// `LOCK TABLE … IN SHARE MODE` would (the `DomainLock` fault).
    pub fn set_domain_lock(&self, locked: bool) {
        self.lock().inbox.domain_locked = locked;
        if !locked {
            self.unlocked.notify_waiters();
        }
    }

    /// How long a reply waits before it is sent (the slow-database
    /// fault).
    pub fn reply_delay(&self) -> Duration {
        self.faults.lock().expect("faults").reply_delay
    }

    /// Woken whenever a transaction ends: a [`Handled::Blocked`] request
    /// may go on.
    pub fn unlocked(&self) -> &tokio::sync::Notify {
        &self.unlocked
    }

    /// Changes once per commit that wrote outbox rows (what a `LISTEN`ing
    /// session is notified of).
    pub fn commits(&self) -> super::Watcher {
        self.notify.watch()
    }

    /// The tables, locked.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Database> {
        self.db.lock().expect("database")
    }

    /// The server is about to crash: the sessions that end with it leave
    /// their open transactions to [`PgState::crashed`].
    pub fn crashing(&self) {
        *self.dying.lock().expect("dying") = Some(BTreeMap::new());
    }

    /// The server crashed at `now_ms`: the open transactions of its
    /// sessions are rolled back, in session order, and the asynchronous
    /// commits the WAL writer had not flushed are taken back ([`wal`]).
    pub fn crashed(&self, now_ms: u64) {
        let dying = self.dying.lock().expect("dying").take().unwrap_or_default();
        for (session, (client, tx)) in dying {
            roll_back(self, session, &client, tx);
        }
        let mut db = self.lock();
        let before = db.wal.crash(now_ms);
        if before.is_empty() {
            return;
        }
        let self::outbox::Restored {
            leases,
            unmarked,
            parks,
        } = db.outbox.restore_rows(before);
        drop(db);
        self.trace.now(Event::CommitsLost {
            leases,
            unmarked,
            parks,
        });
    }

    /// `replication_positions.sql` at `now`: the flush position, the
    /// timeline, and where each named standby stands.
    fn replication_positions(&self, standbys: &[String], now: u64) -> PgReply {
        let db = self.lock();
        let standby = self.standby.lock().expect("standby");
        PgReply::Replication {
            flushed: db.wal.flushed_at(now),
            timeline: db.wal.timeline(),
            standbys: standbys
                .iter()
                .map(|name| {
                    (name == standby::STANDBY)
                        .then(|| standby.position(&db.wal, now))
                        .flatten()
                })
                .collect(),
        }
    }

    /// The database as the WAL flushed by `now` holds it, with no open
    /// transaction's locks: what a standby that streamed it holds.
    fn flushed_copy(db: &Database, now_ms: u64) -> Database {
        let mut copy = db.clone();
        let before = copy.wal.crash(now_ms);
        copy.outbox.restore_rows(before);
        copy.outbox.clear_open();
        copy.inbox.clear_open();
        copy
    }

    /// The standby falls away at `now_ms`, holding what was flushed.
    pub fn standby_away(&self, now_ms: u64) {
        let held = Self::flushed_copy(&self.lock(), now_ms);
        self.standby.lock().expect("standby").fall_away(held);
    }

    /// The standby streams again.
    pub fn standby_back(&self) {
        self.standby.lock().expect("standby").come_back();
    }

    /// The primary shuts down cleanly at `now_ms` (a switchover): the WAL
    /// writer's pending flushes are done.
    pub fn shut_down_cleanly(&self, now_ms: u64) {
        self.lock().wal.shutdown(now_ms);
    }

    /// The primary turns read-only in place (or writable again).
    pub fn set_read_only(&self, on: bool) {
        self.read_only
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the primary refuses writes.
    pub fn read_only(&self) -> bool {
        self.read_only.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The standby is promoted at `now_ms` (while no session is open):
    /// what it holds becomes the database, on the next timeline; what
    /// the old primary held beyond it is gone, in the trace.
    pub fn promote(&self, now_ms: u64) {
        let mut db = self.lock();
        let held = self.standby.lock().expect("standby").take_held();
        let mut new = held.unwrap_or_else(|| Self::flushed_copy(&db, now_ms));
        new.outbox.clear_open();
        new.inbox.clear_open();
        new.wal.promoted_after(&db.wal);
        let lost: Vec<Uuid> = db
            .outbox
            .committed()
            .difference(new.outbox.committed())
            .copied()
            .collect();
        let lost_effects: Vec<(String, Uuid)> = db
            .inbox
            .effects()
            .iter()
            .filter(|(k, n)| new.inbox.effects().get(k).copied().unwrap_or(0) < **n)
            .map(|(k, _)| k.clone())
            .collect();
        let restored = new.outbox.taken_back_from(&db.outbox);
        *db = new;
        drop(db);
        self.unlocked.notify_waiters();
        self.trace.now(Event::FailedOver { lost, lost_effects });
        if !(restored.leases.is_empty()
            && restored.unmarked.is_empty()
            && restored.parks.is_empty())
        {
            self.trace.now(Event::CommitsLost {
                leases: restored.leases,
                unmarked: restored.unmarked,
                parks: restored.parks,
            });
        }
    }

    /// An operator unparks every parked row that a fix can make publishable
    /// (the liveness phase).
    pub fn operator_unpark_all(&self) {
        self.lock().outbox.operator_unpark_fixable(&self.trace);
    }
}

/// An open transaction's effects, undone on rollback.
#[derive(Debug, Default)]
struct Tx {
    /// When it began: PostgreSQL's `now()` inside it.
    began_ms: u64,
    inserts: Vec<Row>,
    /// Rows this transaction claimed, with their lease before the claim.
    claimed: Vec<PriorLease>,
    /// Inbox rows, processed marks and handler effects.
    inbox: InboxTx,
    /// A statement failed: only ROLLBACK (or COMMIT, which rolls back) is
    /// accepted until the end, as in PostgreSQL.
    aborted: bool,
}

/// What became of one request.
#[derive(Debug)]
pub enum Handled {
    /// Send this reply.
    Reply(PgReply),
    /// The request took effect and its reply is lost: the connection dies.
    Lost,
    /// Another session holds a lock the request needs (an inbox row, as
    /// PostgreSQL's `INSERT … ON CONFLICT` waits on a row lock; the domain
    /// table; a deferred unique key): hand the same request in again once
    /// [`PgState::unlocked`] wakes. `holders` are the sessions it waits on,
    /// `on` says what for.
    Blocked { holders: Vec<u64>, on: &'static str },
}

/// One session (connection) of the fake: what it has open, and how it
/// answers each request. The transport feeds it requests in arrival order
/// and drops it when the connection ends, which rolls back what was open.
pub struct Session {
    state: PgState,
    id: u64,
    client: String,
    tx: Option<Tx>,
    /// `SET LOCAL` settings of the open transaction.
    local: TxSettings,
    /// The request being handled passed the failure roll and waits on a
    /// lock: it is not rolled again.
    admitted: bool,
    control: Arc<Control>,
    /// `synchronous_commit`: off for the drainer's own sessions, whose
    /// commits a crash may take back ([`wal`]).
    synchronous_commit: bool,
}

impl Session {
    fn new(state: PgState, id: u64, control: Arc<Control>) -> Self {
        Self {
            state,
            id,
            client: format!("session-{id}"),
            tx: None,
            local: TxSettings::default(),
            admitted: false,
            control,
            synchronous_commit: true,
        }
    }

    /// Its handle for signals from other sessions.
    pub fn control(&self) -> Arc<Control> {
        self.control.clone()
    }

    /// How long the open transaction may sit waiting for the next request
    /// before the server ends the session
    /// (`idle_in_transaction_session_timeout`); `None` when nothing is open
    /// or no bound is set.
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.local
            .idle_in_tx_ms
            .filter(|_| self.tx.is_some())
            .map(Duration::from_millis)
    }

    /// How long a statement may run (`statement_timeout`) and wait on a
    /// lock (`lock_timeout`), if bounded.
    pub fn statement_bounds(&self) -> (Option<Duration>, Option<Duration>) {
        (
            self.local.statement_ms.map(Duration::from_millis),
            self.local.lock_ms.map(Duration::from_millis),
        )
    }

    /// The idle-in-transaction timeout fired: records it and answers the
    /// FATAL error PostgreSQL sends before it closes the connection; the
    /// transport then drops the session, which rolls the transaction back.
    pub fn idle_timed_out(&self) -> PgReply {
        let limit = self.local.idle_in_tx_ms.unwrap_or_default();
        self.state.trace.now(Event::Fault {
            kind: FaultKind::PgIdleTimeout,
            detail: format!(
                "pg terminates {}'s session: idle in transaction past {limit} ms",
                self.client
            ),
        });
        PgReply::Error(PgError::new(
            "25P03",
            "terminating connection due to idle-in-transaction timeout",
        ))
    }

    /// Another session terminated this one: the error PostgreSQL sends
    /// before it closes the connection.
    pub fn terminated() -> PgReply {
        PgReply::Error(PgError::new(
            "57P01",
            "terminating connection due to administrator command",
        ))
    }

    /// A request that was [`Handled::Blocked`] began waiting: records it.
    /// True if the wait closes a cycle (the caller fails it as a deadlock).
    pub fn wait_began(&self, holders: &[u64], on: &str) -> bool {
        self.state.trace.now(Event::LockWait {
            client: self.client.clone(),
            session: self.id,
            on: on.to_owned(),
        });
        self.state.wait_for(self.id, holders)
    }

    /// The blocked request still waits, now on `holders`; true on a
    /// deadlock.
    pub fn still_waiting(&self, holders: &[u64]) -> bool {
        self.state.wait_for(self.id, holders)
    }

    /// The wait ended as `how`; for every end but the lock's, the statement
    /// fails (aborting the transaction) with the SQLSTATE PostgreSQL gives.
    pub fn wait_ended(&mut self, how: WaitEnd) -> Option<PgReply> {
        self.state.wait_over(self.id);
        self.state.trace.now(Event::LockWaitEnded {
            client: self.client.clone(),
            session: self.id,
            how,
        });
        let (code, message) = match how {
            WaitEnd::Acquired | WaitEnd::Terminated | WaitEnd::ConnectionClosed => return None,
            WaitEnd::StatementTimeout => ("57014", "canceling statement due to statement timeout"),
            WaitEnd::LockTimeout => ("55P03", "canceling statement due to lock timeout"),
            WaitEnd::Deadlock => ("40P01", "deadlock detected"),
            WaitEnd::Cancelled => ("57014", "canceling statement due to user request"),
        };
        self.admitted = false;
        Some(self.failed(PgError::new(code, message)))
    }

    /// Handles one request that arrived at simulated time `now`, under the
    /// fault settings.
    pub fn handle(&mut self, req: &PgRequest, now: Duration) -> Handled {
        let faults = self.state.faults.lock().expect("faults").clone();
        if !self.admitted {
            if faults.strikes(req) && self.state.roll(faults.fail_prob) {
                self.state.trace.now(Event::Fault {
                    kind: FaultKind::PgFailure,
                    detail: format!("{} {}", self.client, request_name(req)),
                });
                return Handled::Reply(self.failed(PgError::new(
                    INJECTED_FAILURE_CODE,
                    "could not serialize access (injected statement failure)",
                )));
            }
            self.admitted = true;
        }
        if let (PgRequest::InboxLockKeys { subscription, keys }, Some(tx)) = (req, self.tx.as_mut())
            && !tx.aborted
        {
            let mut db = self.state.lock();
            if let Some(holder) = db
                .inbox
                .lock_keys(subscription, keys, self.id, &mut tx.inbox)
            {
                return Handled::Blocked {
                    holders: vec![holder],
                    on: "inbox key lock",
                };
            }
        }
        if !self.tx.as_ref().is_some_and(|t| t.aborted) {
            let tx = self.tx.as_ref().map(|t| &t.inbox);
            let db = self.state.lock();
            let blocked = db
                .inbox
                .blocked(req, self.id, tx)
                .or_else(|| key_wait(&db.outbox, req, self.id));
            drop(db);
            if let Some((holders, on)) = blocked {
                return Handled::Blocked { holders, on };
            }
        }
        self.admitted = false;
        if self.state.read_only() && writes(req) && !matches!(req, PgRequest::Commit) {
            // A primary demoted in place (`default_transaction_read_only`):
            // what `.ci/pg-pair readonly` shows PostgreSQL answering.
            return Handled::Reply(self.failed(PgError::new(
                "25006",
                "cannot execute UPDATE in a read-only transaction",
            )));
        }
        let reply = self.apply(req, clock_ms(now));
        if faults.strikes(req) && self.state.roll(faults.lose_reply_prob) {
            self.state.trace.now(Event::Fault {
                kind: FaultKind::PgReplyLost,
                detail: format!("{} {}", self.client, request_name(req)),
            });
            return Handled::Lost;
        }
        Handled::Reply(reply)
    }

    /// A failed statement: it aborts the open transaction.
    fn failed(&mut self, error: PgError) -> PgReply {
        if let Some(tx) = self.tx.as_mut() {
            tx.aborted = true;
        }
        PgReply::Error(error)
    }

    fn apply(&mut self, req: &PgRequest, now: u64) -> PgReply {
        if let (Some(tx), PgRequest::InboxRecordFailure { .. } | PgRequest::InboxUndoHandler) =
            (self.tx.as_mut(), req)
            && tx.inbox.has_savepoint()
        {
            // It begins with ROLLBACK TO SAVEPOINT, which PostgreSQL accepts
            // in an aborted transaction and which recovers it.
            tx.aborted = false;
        }
        if self.tx.as_ref().is_some_and(|t| t.aborted)
            && !matches!(req, PgRequest::Rollback | PgRequest::Commit)
        {
            return PgReply::Error(PgError::new(
                "25P02",
                "current transaction is aborted, commands ignored until end of transaction block",
            ));
        }
        let reply = match req {
            PgRequest::Hello {
                client,
                synchronous_commit,
            } => {
                self.client = client.clone();
                self.synchronous_commit = *synchronous_commit;
                PgReply::Session { id: self.id }
            }
            PgRequest::Begin => self.begin(now),
            PgRequest::SetLocal(settings) => {
                // Outside a transaction PostgreSQL warns and ignores it.
                if self.tx.is_some() {
                    self.set_local(settings);
                    if settings.statement_ms.is_some() || settings.idle_in_tx_ms.is_some() {
                        self.state.trace.now(Event::TxBounds {
                            session: self.id,
                            statement_ms: self.local.statement_ms,
                            idle_in_tx_ms: self.local.idle_in_tx_ms,
                        });
                    }
                }
                PgReply::Ok
            }
            PgRequest::Terminate { application_name } | PgRequest::Cancel { application_name } => {
                let terminate = matches!(req, PgRequest::Terminate { .. });
                let kill = if terminate {
                    Kill::Terminate
                } else {
                    Kill::Cancel
                };
                let sessions = self.state.signal(application_name, self.id, kill);
                let n = sessions.len() as u64;
                self.state.trace.now(Event::BackendSignalled {
                    client: self.client.clone(),
                    sessions,
                    terminate,
                });
                PgReply::Count(n)
            }
            PgRequest::Commit => self.commit(now),
            PgRequest::Listen | PgRequest::Ping => PgReply::Ok,
            PgRequest::ReplicationPositions { standbys } => {
                self.state.replication_positions(standbys, now)
            }
            PgRequest::Raise { code } => PgReply::Error(PgError::new(code, "raised")),
            PgRequest::Rollback => {
                // Outside a transaction PostgreSQL warns ("there is no
                // transaction in progress") and succeeds.
                self.rollback();
                PgReply::Ok
            }
            _ => self.statement(req, now),
        };
        if let PgReply::Error(e) = reply {
            return self.failed(e);
        }
        reply
    }

    fn begin(&mut self, now: u64) -> PgReply {
        if self.tx.is_some() {
            return PgReply::Error(PgError::new("25001", "already in a transaction"));
        }
        self.tx = Some(Tx {
            began_ms: now,
            ..Tx::default()
        });
        self.end_local();
        PgReply::Ok
    }

    /// `SET LOCAL`: each given setting, until the transaction ends.
    fn set_local(&mut self, s: &TxSettings) {
        let l = &mut self.local;
        l.idle_in_tx_ms = s.idle_in_tx_ms.or(l.idle_in_tx_ms);
        l.statement_ms = s.statement_ms.or(l.statement_ms);
        l.lock_ms = s.lock_ms.or(l.lock_ms);
        if let Some(name) = &s.application_name {
            l.application_name = Some(name.clone());
            *self.control.tag.lock().expect("tag") = Some(name.clone());
        }
    }

    /// The transaction ended: its `SET LOCAL` settings go with it.
    fn end_local(&mut self) {
        self.local = TxSettings::default();
        *self.control.tag.lock().expect("tag") = None;
    }

    /// One statement: an inbox request, or an outbox one. Outside a
    /// transaction a statement that writes commits at once: through the
    /// WAL ([`wal`]), flushed if the session commits synchronously, kept
    /// for a crash to take back if not.
    fn statement(&mut self, req: &PgRequest, now: u64) -> PgReply {
        // `now()` is the transaction's start, as in PostgreSQL.
        let autocommit = self.tx.is_none();
        let now = self.tx.as_ref().map_or(now, |t| t.began_ms);
        let trace = &self.state.trace;
        let mut db = self.state.db.lock().expect("database");
        let caller = Caller {
            session: self.id,
            client: &self.client,
            trace,
        };
        let tx = self.tx.as_mut().map(|t| &mut t.inbox);
        let mut before = Vec::new();
        let reply = match db.inbox.apply(req, &caller, tx, now) {
            Some(reply) => reply,
            None => {
                let at = At {
                    session: self.id,
                    trace,
                    now,
                };
                outbox_statement(&at, &mut self.tx, &mut db.outbox, req, &mut before)
            }
        };
        if autocommit && writes(req) && !matches!(reply, PgReply::Error(_)) {
            if self.synchronous_commit {
                db.wal.flush(now);
            } else {
                db.wal.async_commit(now, before);
            }
        }
        reply
    }
}

/// Whether `req` writes (a statement that commits, outside a transaction).
fn writes(req: &PgRequest) -> bool {
    !matches!(
        req,
        PgRequest::Hello { .. }
            | PgRequest::Begin
            | PgRequest::SetLocal(_)
            | PgRequest::Rollback
            | PgRequest::KeyWindow { .. }
            | PgRequest::Stats
            | PgRequest::ListParked { .. }
            | PgRequest::InboxCheck
            | PgRequest::Terminate { .. }
            | PgRequest::Cancel { .. }
            | PgRequest::InboxSavepoint
            | PgRequest::Listen
            | PgRequest::Raise { .. }
            | PgRequest::InboxList { .. }
            | PgRequest::InboxHeld { .. }
            | PgRequest::InboxReleasable { .. }
            | PgRequest::InboxCounts { .. }
            | PgRequest::Ping
            | PgRequest::ReplicationPositions { .. }
    )
}

/// Where and when a statement runs.
struct At<'a> {
    session: u64,
    trace: &'a Trace,
    now: u64,
}

/// The outbox's statements (`outbox/src/pg/sql/outbox_*.sql`).
///
/// Outside a transaction, the rows a statement changes go into `before` as
/// they were (for [`wal`]: a crash may take the statement back if its
/// session commits asynchronously). Not the janitor's deletes: they never
/// run on such a session.
fn outbox_statement(
    at: &At<'_>,
    tx: &mut Option<Tx>,
    table: &mut OutboxTable,
    req: &PgRequest,
    before: &mut Vec<Row>,
) -> PgReply {
    if tx.is_none() {
        let ids: Vec<Uuid> = match req {
            PgRequest::MarkPublished { ids, .. } | PgRequest::Release { ids, .. } => ids.clone(),
            PgRequest::MarkFailed { failures, .. } => failures.iter().map(|(id, _)| *id).collect(),
            PgRequest::Unpark { ids } | PgRequest::Skip { ids } => {
                table.parked_among(ids.as_deref())
            }
            _ => Vec::new(),
        };
        before.extend(ids.iter().filter_map(|id| table.row(id).cloned()));
    }
    match req {
        PgRequest::Insert { rows } => insert(tx, table, rows, at.session, at.now),
        PgRequest::KeyWindow {
            after,
            limit,
            lease_ttl_ms,
        } => PgReply::KeyWindow(table.key_window(after, *limit, *lease_ttl_ms, at.now)),
        PgRequest::Claim { .. } => claim(at, tx, table, req, before),
        PgRequest::MarkPublished { .. }
        | PgRequest::MarkFailed { .. }
        | PgRequest::Release { .. } => mark(at, table, req),
        PgRequest::Stats => {
            let reply = table.stats(at.now);
            if let PgReply::Stats {
                pending,
                oldest_age_ms,
                parked,
                blocked,
            } = reply
            {
                at.trace.now(Event::StatsSampled {
                    pending,
                    oldest_age_ms,
                    parked,
                    blocked,
                });
            }
            reply
        }
        other => janitor_or_operator(at, table, other),
    }
}

/// The drainer's claim (Phase 1).
fn claim(
    at: &At<'_>,
    tx: &mut Option<Tx>,
    table: &mut OutboxTable,
    req: &PgRequest,
    before: &mut Vec<Row>,
) -> PgReply {
    let PgRequest::Claim {
        replica,
        batch_size,
        lease_ttl_ms,
        key_heads,
        after,
    } = req
    else {
        unreachable!("only a claim comes here");
    };
    // In a transaction its row locks last until the transaction ends;
    // alone (the drainer's own sessions), until it returns.
    let mut alone = Vec::new();
    let claimed = tx.as_mut().map_or(&mut alone, |tx| &mut tx.claimed);
    let rows = table.claim(
        claimed,
        at.session,
        replica,
        *batch_size,
        *lease_ttl_ms,
        key_heads,
        *after,
        at.now,
    );
    table.unlock(&alone);
    for (id, claimed_ms, claimed_by) in alone {
        if let Some(mut row) = table.row(&id).cloned() {
            (row.claimed_ms, row.claimed_by) = (claimed_ms, claimed_by);
            before.push(row);
        }
    }
    at.trace.now(Event::Claimed {
        replica: replica.clone(),
        ids: rows.iter().map(|r| r.id).collect(),
        attempts: rows.iter().map(|r| r.attempts).collect(),
    });
    PgReply::Rows(rows)
}

/// The drainer's marks (Phase 3) and releases, guarded by `claimed_by`.
fn mark(at: &At<'_>, table: &mut OutboxTable, req: &PgRequest) -> PgReply {
    let (trace, session, now) = (at.trace, at.session, at.now);
    match req {
        PgRequest::MarkPublished { replica, ids } => {
            let ids = table.mark_published(session, replica, ids, now);
            let n = ids.len() as u64;
            trace.now(Event::MarkedPublished {
                replica: replica.clone(),
                ids,
            });
            PgReply::Count(n)
        }
        PgRequest::MarkFailed {
            replica,
            failures,
            max_attempts,
        } => {
            let (ids, parked) = table.mark_failed(session, replica, failures, *max_attempts, now);
            let reply = PgReply::Failed {
                recorded: ids.len() as u64,
                parked: parked.len() as u64,
            };
            trace.now(Event::MarkedFailed {
                replica: replica.clone(),
                ids,
                parked,
            });
            reply
        }
        PgRequest::Release { replica, ids } => {
            let ids = table.release(session, replica, ids);
            let n = ids.len() as u64;
            trace.now(Event::Released {
                replica: replica.clone(),
                ids,
            });
            PgReply::Count(n)
        }
        other => unreachable!("{} is not a mark", request_name(other)),
    }
}

/// The retention janitor's and the operator's statements.
fn janitor_or_operator(at: &At<'_>, table: &mut OutboxTable, req: &PgRequest) -> PgReply {
    let (trace, now) = (at.trace, at.now);
    match req {
        PgRequest::DeletePublished {
            older_than_ms,
            limit,
        } => {
            let ids = table.delete_published(*older_than_ms, *limit, now);
            let n = ids.len() as u64;
            if !ids.is_empty() {
                trace.now(Event::Deleted { ids });
            }
            PgReply::Count(n)
        }
        PgRequest::RetirePartitions { older_than_ms } => {
            let (reply, ids) = table.retire_partitions(*older_than_ms, now);
            if !ids.is_empty() {
                trace.now(Event::Deleted { ids });
            }
            reply
        }
        PgRequest::ListParked {
            limit,
            after,
            ids,
            payload_field,
            omit_envelope,
        } => PgReply::Parked(table.list_parked(&self::outbox::ParkedSelect {
            limit: *limit,
            after: *after,
            ids: ids.as_deref(),
            payload_field: payload_field.as_ref(),
            omit_envelope: *omit_envelope,
        })),
        PgRequest::Unpark { ids } => {
            let ids = table.unpark(ids.as_deref());
            let n = ids.len() as u64;
            trace.now(Event::Unparked { ids });
            PgReply::Count(n)
        }
        PgRequest::Skip { ids } => {
            let ids = table.skip(ids.as_deref(), now);
            let n = ids.len() as u64;
            trace.now(Event::Skipped { ids });
            PgReply::Count(n)
        }
        other => unreachable!("{} is handled before the outbox", request_name(other)),
    }
}

/// A keyed insert waits while another open transaction holds one of its
/// keys (it wrote the key and has not ended).
fn key_wait(
    table: &OutboxTable,
    req: &PgRequest,
    session: u64,
) -> Option<(Vec<u64>, &'static str)> {
    let PgRequest::Insert { rows } = req else {
        return None;
    };
    let keys = rows.iter().filter_map(|r| r.ordering_key.as_deref());
    let holders = table.key_holders(keys, session);
    (!holders.is_empty()).then_some((holders, "event_outbox_key"))
}

/// `publish_tx` / `publish_many_tx`: one statement inserting every row,
/// all or nothing, in the open transaction; a keyed row takes its key's
/// next number (in batch order) under the key's lock.
fn insert(
    tx: &mut Option<Tx>,
    table: &mut OutboxTable,
    rows: &[crate::wire::NewRow],
    session: u64,
    now: u64,
) -> PgReply {
    let Some(tx) = tx.as_mut() else {
        return PgReply::Error(PgError::new("25P01", "insert outside a transaction"));
    };
    for (i, row) in rows.iter().enumerate() {
        if table.contains(&row.id)
            || tx.inserts.iter().any(|r| r.id == row.id)
            || rows[..i].iter().any(|r| r.id == row.id)
        {
            return PgReply::Error(PgError::new(
                "23505",
                format!("duplicate key value violates event_outbox_pkey: {}", row.id),
            ));
        }
        if let Some(r) =
            jsonb::text_refusal(&row.routing_key).or_else(|| jsonb::jsonb_refusal(&row.body))
        {
            return PgReply::Error(PgError::new(r.code, r.message));
        }
    }
    for r in rows {
        let mut row = Row::new(r.id, r.routing_key.clone(), r.body.clone(), now);
        row.ordering = r
            .ordering_key
            .as_ref()
            .map(|key| (key.clone(), table.take_number(key, session)));
        tx.inserts.push(row);
    }
    PgReply::Count(rows.len() as u64)
}

impl Session {
    fn commit(&mut self, now: u64) -> PgReply {
        let Some(tx) = self.tx.take() else {
            // As PostgreSQL: a warning, and success.
            return PgReply::Ok;
        };
        if tx.aborted {
            // PostgreSQL answers COMMIT of an aborted transaction with a
            // rollback (the command tag `ROLLBACK`, no error): a client
            // that does not read the tag believes it committed.
            self.tx = Some(tx);
            self.rollback();
            return PgReply::Ok;
        }
        let (blamed, error) = {
            let db = self.state.lock();
            (
                db.inbox.deferred_violations(&tx.inbox),
                db.inbox.violation_error(&tx.inbox),
            )
        };
        if !blamed.is_empty() {
            // A deferred constraint is checked here, and fails the COMMIT:
            // the transaction is rolled back.
            self.state.trace.now(Event::ConstraintFailed {
                client: self.client.clone(),
                events: blamed,
                at_commit: true,
            });
            self.tx = Some(tx);
            self.rollback();
            return PgReply::Error(error);
        }
        self.end_local();
        batch_ended(&self.state, self.id, &self.client, &tx.inbox, true);
        self.apply_commit(tx, now);
        PgReply::Ok
    }

    /// Makes a transaction that passed its checks durable and visible.
    fn apply_commit(&mut self, tx: Tx, committed_ms: u64) {
        let now = tx.began_ms;
        let trace = &self.state.trace;
        let mut db = self.state.lock();
        // A transaction that wrote flushes the WAL at COMMIT (the sessions
        // that commit asynchronously never open one).
        if !tx.inserts.is_empty() || !tx.claimed.is_empty() || !tx.inbox.is_empty() {
            db.wal.flush(committed_ms);
        }
        let ids: Vec<Uuid> = tx.inserts.iter().map(|r| r.id).collect();
        let numbered: Vec<(Uuid, String, i64)> = tx
            .inserts
            .iter()
            .filter_map(|r| r.ordering.clone().map(|(k, s)| (r.id, k, s)))
            .collect();
        for row in tx.inserts {
            db.outbox.commit_row(row);
        }
        if !tx.inbox.is_empty() {
            let done = db.inbox.commit(tx.inbox, now, self.id);
            self.state.unlocked.notify_waiters();
            self.trace_inbox_commit(done, now);
        }
        db.outbox.unlock(&tx.claimed);
        if db.outbox.end_key_locks(self.id, true) {
            self.state.unlocked.notify_waiters();
        }
        if !ids.is_empty() {
            trace.now(Event::Committed {
                client: self.client.clone(),
                ids,
            });
            if !numbered.is_empty() {
                trace.now(Event::KeysNumbered { rows: numbered });
            }
            self.state.notify.bump();
        }
    }

    /// What an inbox transaction's commit did, in the trace.
    fn trace_inbox_commit(&self, done: inbox::Committed, now: u64) {
        let trace = &self.state.trace;
        if !done.reset.is_empty() {
            trace.now(Event::InboxReset {
                client: self.client.clone(),
                ids: done.reset,
            });
        }
        if !done.held.is_empty() {
            trace.now(Event::InboxHeld {
                client: self.client.clone(),
                events: done.held,
            });
        }
        for (event_id, attempts, dead_lettered) in done.failures {
            trace.now(Event::InboxFailure {
                client: self.client.clone(),
                event_id,
                attempts,
                dead_lettered,
            });
        }
        if !done.processed.is_empty() || !done.effects.is_empty() {
            trace.now(Event::InboxCommitted {
                client: self.client.clone(),
                began: Duration::from_millis(now - CLOCK_OFFSET_MS),
                processed: done.processed,
                effects: done.effects,
            });
        }
    }

    /// Undoes the open transaction: inserts vanish, claimed leases return to
    /// what they were, locks are released.
    fn rollback(&mut self) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        self.end_local();
        roll_back(&self.state, self.id, &self.client, tx);
    }
}

/// Records how many deliveries a handler transaction held.
fn batch_ended(state: &PgState, session: u64, client: &str, inbox: &InboxTx, committed: bool) {
    if inbox.deliveries() > 0 {
        state.trace.now(Event::InboxBatch {
            client: client.to_owned(),
            session,
            deliveries: inbox.deliveries(),
            committed,
        });
    }
}

/// Undoes session `session`'s transaction `tx`.
fn roll_back(state: &PgState, session: u64, client: &str, tx: Tx) {
    batch_ended(state, session, client, &tx.inbox, false);
    let mut db = state.lock();
    db.inbox.rollback(tx.inbox, session);
    db.outbox.end_key_locks(session, false);
    state.unlocked.notify_waiters();
    let owners = db.outbox.restore(tx.claimed);
    drop(db);
    if !owners.is_empty() {
        state.trace.now(Event::LeasesRestored { owners });
    }
    let ids: Vec<Uuid> = tx.inserts.iter().map(|r| r.id).collect();
    if !ids.is_empty() {
        state.trace.now(Event::RolledBack {
            client: client.to_owned(),
            ids,
        });
    }
}

impl Drop for Session {
    /// The connection ended (closed, broken, or the host crashed): an open
    /// transaction is rolled back, as PostgreSQL does.
    fn drop(&mut self) {
        let dying = Arc::clone(&self.state.dying);
        match dying.lock().expect("dying").as_mut() {
            Some(dying) => {
                if let Some(tx) = self.tx.take() {
                    self.end_local();
                    dying.insert(self.id, (self.client.clone(), tx));
                }
            }
            None => self.rollback(),
        }
        self.state.wait_over(self.id);
        self.state
            .controls
            .lock()
            .expect("controls")
            .remove(&self.id);
    }
}

/// Every statement's name as [`request_name`] gives it (a scenario's
/// `statements` list of a `pg` fault names these).
pub const STATEMENT_NAMES: &[&str] = &[
    "hello",
    "begin",
    "set_local",
    "inbox_check",
    "terminate",
    "cancel",
    "commit",
    "rollback",
    "insert",
    "claim",
    "mark_published",
    "mark_failed",
    "release",
    "stats",
    "delete_published",
    "retire_partitions",
    "list_parked",
    "unpark",
    "skip",
    "key_window",
    "inbox_lock_keys",
    "inbox_try_insert",
    "inbox_mark_processed",
    "effect",
    "inbox_savepoint",
    "inbox_undo_handler",
    "raise",
    "listen",
    "ping",
    "inbox_record_failure",
    "inbox_list",
    "inbox_held",
    "inbox_skip",
    "inbox_releasable",
    "inbox_delete_processed",
    "inbox_retire_partitions",
    "inbox_counts",
];

fn request_name(req: &PgRequest) -> &'static str {
    match req {
        PgRequest::Hello { .. } => "hello",
        PgRequest::Begin => "begin",
        PgRequest::SetLocal(_) => "set_local",
        PgRequest::InboxCheck => "inbox_check",
        PgRequest::Terminate { .. } => "terminate",
        PgRequest::Cancel { .. } => "cancel",
        PgRequest::Commit => "commit",
        PgRequest::Rollback => "rollback",
        PgRequest::Insert { .. } => "insert",
        PgRequest::Claim { .. } => "claim",
        PgRequest::MarkPublished { .. } => "mark_published",
        PgRequest::MarkFailed { .. } => "mark_failed",
        PgRequest::Release { .. } => "release",
        PgRequest::Stats => "stats",
        PgRequest::DeletePublished { .. } => "delete_published",
        PgRequest::RetirePartitions { .. } => "retire_partitions",
        PgRequest::ListParked { .. } => "list_parked",
        PgRequest::Unpark { .. } => "unpark",
        PgRequest::Skip { .. } => "skip",
        PgRequest::KeyWindow { .. } => "key_window",
        PgRequest::InboxLockKeys { .. } => "inbox_lock_keys",
        PgRequest::InboxTryInsert { .. } => "inbox_try_insert",
        PgRequest::InboxMarkProcessed { .. } => "inbox_mark_processed",
        PgRequest::Effect { .. } => "effect",
        PgRequest::InboxSavepoint => "inbox_savepoint",
        PgRequest::InboxUndoHandler => "inbox_undo_handler",
        PgRequest::Raise { .. } => "raise",
        PgRequest::Listen => "listen",
        PgRequest::Ping => "ping",
        PgRequest::ReplicationPositions { .. } => "replication_positions",
        PgRequest::InboxRecordFailure { .. } => "inbox_record_failure",
        PgRequest::InboxList { .. } => "inbox_list",
        PgRequest::InboxHeld { .. } => "inbox_held",
        PgRequest::InboxSkip { .. } => "inbox_skip",
        PgRequest::InboxReleasable { .. } => "inbox_releasable",
        PgRequest::InboxDeleteProcessed { .. } => "inbox_delete_processed",
        PgRequest::InboxRetirePartitions { .. } => "inbox_retire_partitions",
        PgRequest::InboxCounts { .. } => "inbox_counts",
    }
}
