//! The `InboxStore` port over the fake PostgreSQL, for the production
//! subscriber in a consumer host.
//!
//! Like the sqlx adapter: every handler transaction runs on a pooled
//! connection of its own (the subscriber handles several deliveries at
//! once), bounded by the same idle-in-transaction timeout, with a savepoint
//! after the inbox insert (and a replay's budget reset before it) and
//! failure records inside it; listings, sweeps and pings run on another
//! connection, outside any handler transaction.
//!
//! The pool is as unkind as sqlx's, because the subscriber's correctness
//! under overruns depends on it: at most [`POOL_MAX`] connections, a
//! checkout waits up to [`ACQUIRE_TIMEOUT`] for one; a request whose caller
//! stops waiting (its future dropped by a deadline, or its own bound
//! expired) leaves the connection owing that reply, and the next request on
//! it first waits for the owed reply (sqlx's `wait_until_ready`); a
//! transaction dropped unfinished goes back to the pool through a task
//! that waits for what the connection owes and rolls it back (sqlx's
//! `return_to_pool`), holding its place in the pool all the while.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use outbox::StoreError;
use outbox::core::ports::{
    AttemptRecord, InboxCounts, InboxEntry, InboxFilter, InboxRow, InboxStore, InsertOutcome,
    TxBounds,
};
use time::OffsetDateTime;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use uuid::Uuid;

use super::hooks::{Hooks, Point};
use super::net::{PgClient, STORE_REQUEST_TIMEOUT, connect_pg_session, unexpected};
use crate::trace::{Event, Trace};
use crate::wire::{
    PgReply, PgRequest, TxSettings, WireInboxEntry, WireInsertOutcome, read_frame, write_frame,
};

/// Default and largest number of rows one listing returns.
use outbox::core::ports::{LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX};
/// Most handler connections one consumer replica holds (sqlx's default
/// `max_connections`).
pub const POOL_MAX: usize = 10;
/// How long a checkout waits for a free connection before it fails (sqlx's
/// default `acquire_timeout`, reported as `PoolTimedOut`).
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a connection going back to the pool may wait for the replies
/// it owes before it is closed as broken: the stand-in for TCP's
/// retransmissions giving up (turmoil's partitions lose bytes for good).
pub const RETURN_GIVE_UP: Duration = Duration::from_secs(30);

/// One pooled connection: a session at the fake, and how many replies it
/// owes for requests whose callers stopped waiting.
struct Conn {
    stream: crate::engine::net::TcpStream,
    session: u64,
    owed: u32,
}

/// Why a request on a connection failed.
enum CallError {
    /// The connection is broken (closed, reset): it is closed.
    Broken(String),
    /// No reply within the bound: the connection stays, owing the reply.
    TimedOut,
}

/// Records a request its caller stopped waiting for, when dropped armed.
struct Abandon<'a> {
    client: &'a str,
    session: u64,
    trace: &'a Trace,
    armed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.trace.now(Event::RequestAbandoned {
                client: self.client.to_owned(),
                session: self.session,
            });
        }
    }
}

impl Conn {
    /// Reads one owed or awaited reply.
    async fn read(&mut self) -> Result<PgReply, CallError> {
        match read_frame::<_, PgReply>(&mut self.stream).await {
            Ok(Some(reply)) => {
                self.owed -= 1;
                Ok(reply)
            }
            Ok(None) => Err(CallError::Broken("connection closed by the server".into())),
            Err(e) => Err(CallError::Broken(format!("connection lost: {e}"))),
        }
    }

    /// Waits for every reply owed, then sends `req` and waits for its
    /// reply, all within the store call's bound.
    async fn call(
        &mut self,
        req: &PgRequest,
        client: &str,
        trace: &Trace,
    ) -> Result<PgReply, CallError> {
        let mut abandon = Abandon {
            client,
            session: self.session,
            trace,
            armed: false,
        };
        let io = async {
            while self.owed > 0 {
                self.read().await?;
            }
            self.owed += 1;
            abandon.armed = true;
            write_frame(&mut self.stream, req)
                .await
                .map_err(|e| CallError::Broken(format!("connection lost: {e}")))?;
            self.read().await
        };
        let result = crate::engine::timeout(STORE_REQUEST_TIMEOUT, io)
            .await
            .unwrap_or(Err(CallError::TimedOut));
        if result.is_ok() || matches!(result, Err(CallError::Broken(_))) {
            abandon.armed = false;
        }
        result
    }

    /// Waits for what it owes, and rolls back an open transaction: what
    /// sqlx does to a connection coming back to its pool.
    async fn settle(&mut self, open: bool) -> bool {
        while self.owed > 0 {
            if self.read().await.is_err() {
                return false;
            }
        }
        if !open {
            return true;
        }
        self.owed += 1;
        if write_frame(&mut self.stream, &PgRequest::Rollback)
            .await
            .is_err()
        {
            return false;
        }
        // Rolled back (or nothing was open after all, which PostgreSQL
        // answers alike).
        matches!(self.read().await, Ok(PgReply::Ok))
    }
}

/// A connection on its way back to the pool, with its place.
struct Returning {
    conn: Conn,
    open: bool,
    permit: OwnedSemaphorePermit,
}

/// The handler connections of one consumer replica.
struct Pool {
    client: String,
    trace: Trace,
    idle: Mutex<Vec<Conn>>,
    places: Arc<Semaphore>,
    /// Connections dropped unfinished go to the returner task.
    returning: OnceLock<mpsc::UnboundedSender<Returning>>,
    /// Transactions begun, for their tags.
    begun: std::sync::atomic::AtomicU64,
}

impl Pool {
    /// The task that brings dropped connections back (started on first
    /// use, on the consumer's host): each waits for what it owes, rolls
    /// back, and goes back idle, or is closed; its place frees only then.
    fn returner(self: &Arc<Self>) -> &mpsc::UnboundedSender<Returning> {
        self.returning.get_or_init(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<Returning>();
            let pool = Arc::downgrade(self);
            tokio::spawn(async move {
                while let Some(mut r) = rx.recv().await {
                    let pool = pool.clone();
                    tokio::spawn(async move {
                        let back = crate::engine::timeout(RETURN_GIVE_UP, r.conn.settle(r.open))
                            .await
                            .unwrap_or(false);
                        if back && let Some(pool) = pool.upgrade() {
                            pool.idle.lock().expect("idle").push(r.conn);
                        }
                        drop(r.permit);
                    });
                }
            });
            tx
        })
    }
}

/// A handler transaction: one pooled connection and its place in the pool,
/// held until commit or rollback. Dropped unfinished, it goes back to the
/// pool only once what it owes has come (sqlx's `return_to_pool`).
pub struct SimTx {
    conn: Option<Conn>,
    permit: Option<OwnedSemaphorePermit>,
    pool: Arc<Pool>,
    /// BEGIN was answered and no COMMIT or ROLLBACK yet.
    open: bool,
    /// Its `application_name` (what `inbox_abandon` ends it by).
    tag: String,
}

impl SimTx {
    /// Sends one request in the transaction. A broken connection is
    /// closed, which rolls the transaction back at the server; one that
    /// did not answer in time stays, owing the reply.
    pub async fn call(&mut self, req: PgRequest) -> Result<PgReply, StoreError> {
        let Some(conn) = self.conn.as_mut() else {
            return Err(StoreError::Unavailable("connection lost".into()));
        };
        match conn.call(&req, &self.pool.client, &self.pool.trace).await {
            Ok(PgReply::Error(e)) => Err(e.into_store_error()),
            Ok(reply) => Ok(reply),
            Err(CallError::Broken(e)) => {
                self.conn = None;
                self.open = false;
                Err(StoreError::Unavailable(e))
            }
            Err(CallError::TimedOut) => Err(StoreError::Unavailable("request timed out".into())),
        }
    }

    /// The simulated handler's domain write for `event_id` (under the
    /// domain table's deferred unique constraint when `unique_key` is set).
    pub async fn effect(
        &mut self,
        subscription: &str,
        event_id: Uuid,
        unique_key: Option<String>,
    ) -> Result<(), StoreError> {
        self.call(PgRequest::Effect {
            subscription: subscription.to_owned(),
            event_id,
            unique_key,
        })
        .await
        .map(drop)
    }

    /// The session the transaction runs on, if its connection lives.
    pub fn session(&self) -> Option<u64> {
        self.conn.as_ref().map(|c| c.session)
    }

    /// The `application_name` it runs under (what a terminate or cancel
    /// finds it by).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Whether its connection still owes the reply to a request whose
    /// caller stopped waiting (that statement may run on at the server).
    pub fn owes(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.owed > 0)
    }
}

impl Drop for SimTx {
    fn drop(&mut self) {
        let (Some(conn), Some(permit)) = (self.conn.take(), self.permit.take()) else {
            return;
        };
        if conn.owed == 0 && !self.open {
            self.pool.idle.lock().expect("idle").push(conn);
            return;
        }
        let returning = Returning {
            conn,
            open: self.open,
            permit,
        };
        // A send fails only once the returner is gone with its host: the
        // connection closes with it.
        let _ = self.pool.returner().send(returning);
    }
}

/// Records a ping when dropped: answered (`ok`), or given up on.
struct PingAnswered<'a> {
    client: &'a str,
    sent: Duration,
    trace: &'a Trace,
    ok: bool,
}

impl Drop for PingAnswered<'_> {
    fn drop(&mut self) {
        self.trace.now(Event::Pinged {
            client: self.client.to_owned(),
            took: crate::sim_now().saturating_sub(self.sent),
            answered: self.ok,
        });
    }
}

/// The inbox store of one consumer replica.
pub struct SimInboxStore {
    pool: Arc<Pool>,
    /// Listings and sweeps.
    side: PgClient,
    /// Pings and ending abandoned transactions (the sqlx adapter's control
    /// pool): never queued behind a listing.
    control: PgClient,
    hooks: Hooks,
}

impl SimInboxStore {
    /// A store for the consumer `client` (its name in the fake's trace).
    pub fn new(client: impl Into<String>, trace: Trace) -> Self {
        let client = client.into();
        Self {
            side: PgClient::new(format!("{client}/side"), trace.clone()),
            control: PgClient::new(format!("{client}/control"), trace.clone()),
            pool: Arc::new(Pool {
                client,
                trace,
                idle: Mutex::default(),
                places: Arc::new(Semaphore::new(POOL_MAX)),
                returning: OnceLock::new(),
                begun: std::sync::atomic::AtomicU64::new(0),
            }),
            hooks: Hooks::default(),
        }
    }

    /// Crash and pause points of the consumer host (`AfterCommit`).
    pub fn with_hooks(mut self, hooks: Hooks) -> Self {
        self.hooks = hooks;
        self
    }

    /// A connection and its place: an idle one, or a new one once a place
    /// is free (within [`ACQUIRE_TIMEOUT`]).
    async fn checkout(&self) -> Result<SimTx, StoreError> {
        self.pool.returner();
        let permit =
            crate::engine::timeout(ACQUIRE_TIMEOUT, self.pool.places.clone().acquire_owned())
                .await
                .map_err(|_| {
                    StoreError::Unavailable(
                        "pool timed out while waiting for an open connection".into(),
                    )
                })?
                .expect("the pool's semaphore is never closed");
        let idle = self.pool.idle.lock().expect("idle").pop();
        let conn = match idle {
            Some(conn) => conn,
            None => {
                let (stream, session) = connect_pg_session(&self.pool.client, true).await?;
                Conn {
                    stream,
                    session,
                    owed: 0,
                }
            }
        };
        let n = self
            .pool
            .begun
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(SimTx {
            conn: Some(conn),
            permit: Some(permit),
            pool: self.pool.clone(),
            open: false,
            tag: format!("canopy-inbox-{}-{n}", self.pool.client),
        })
    }

    /// A side statement answered with inbox rows (a listing, a skip).
    async fn rows(&self, req: PgRequest) -> Result<Vec<InboxRow>, StoreError> {
        match self.side_call(req).await? {
            PgReply::InboxRows(rows) => Ok(rows.into_iter().map(inbox_row).collect()),
            other => Err(unexpected(other)),
        }
    }

    async fn side_call(&self, req: PgRequest) -> Result<PgReply, StoreError> {
        self.side.call(req).await
    }

    /// Ends the transaction tagged `tag` at the server, from the control
    /// connection (as the sqlx adapter does from its control pool).
    async fn terminate(&self, tag: &str) {
        let _ = self
            .control
            .call(PgRequest::Terminate {
                application_name: tag.to_owned(),
            })
            .await;
    }
}

/// The entry on the wire; a payload that is not UTF-8 is refused as the
/// sqlx adapter refuses it (it cannot be bound as text).
fn wire_entry(e: &InboxEntry<'_>) -> Result<WireInboxEntry, StoreError> {
    let payload = std::str::from_utf8(e.payload)
        .map_err(|err| StoreError::Refused(format!("payload is not UTF-8: {err}")))?;
    Ok(WireInboxEntry {
        event_id: e.event_id,
        subscription: e.subscription.to_owned(),
        routing_key: e.routing_key.to_owned(),
        payload: payload.to_owned(),
        fresh_budget: e.fresh_budget,
        ordering: e.ordering.map(|o| (o.key.clone(), o.seq)),
    })
}

/// An inbox row from the wire.
fn inbox_row(r: crate::wire::WireInboxRow) -> InboxRow {
    InboxRow {
        event_id: r.event_id,
        subscription: r.subscription,
        routing_key: r.routing_key,
        payload: r.payload.into_bytes(),
        attempts: r.attempts,
        last_error: r.last_error,
        received_at: sim_time(r.received_ms),
        dead_lettered_at: r.dead_lettered_ms.map(sim_time),
        ordering: r
            .ordering
            .map(|(key, seq)| outbox::core::ports::KeySeq { key, seq }),
        held: r.held,
    }
}

fn sim_time(ms: u64) -> OffsetDateTime {
    OffsetDateTime::UNIX_EPOCH + Duration::from_millis(ms)
}

fn sim_ms(t: OffsetDateTime) -> u64 {
    u64::try_from((t - OffsetDateTime::UNIX_EPOCH).whole_milliseconds()).unwrap_or(0)
}

impl outbox::core::ports::Replication for SimInboxStore {
    async fn replication_positions(
        &self,
        standbys: &[String],
    ) -> Result<outbox::core::ports::ReplicationPositions, StoreError> {
        super::net::replication_positions(&self.control, standbys).await
    }
}

impl InboxStore for SimInboxStore {
    type Tx = SimTx;
    type HandlerTx = SimTx;

    fn handler_tx(tx: &mut SimTx) -> &mut SimTx {
        tx
    }

    async fn inbox_begin(&self, bounds: TxBounds) -> Result<SimTx, StoreError> {
        let mut tx = self.checkout().await?;
        // Open from the moment BEGIN is sent: one whose reply never came
        // may have opened a transaction, which the pool's return must roll
        // back (sqlx's begin queues a ROLLBACK if it is dropped midway).
        tx.open = true;
        if let Err(e) = tx.call(PgRequest::Begin).await {
            if !tx.owes() {
                // Answered (with an error): no transaction began.
                tx.open = false;
            }
            return Err(e);
        }
        tx.call(PgRequest::SetLocal(TxSettings {
            idle_in_tx_ms: Some(bounds.idle.as_millis() as u64),
            statement_ms: Some(bounds.statement.as_millis() as u64),
            lock_ms: None,
            application_name: Some(tx.tag.clone()),
        }))
        .await?;
        Ok(tx)
    }

    async fn inbox_check(&self, tx: &mut SimTx) -> Result<(), StoreError> {
        tx.call(PgRequest::InboxCheck).await.map(drop)
    }

    async fn inbox_undo_handler(&self, tx: &mut SimTx) -> Result<(), StoreError> {
        tx.call(PgRequest::InboxUndoHandler).await.map(drop)
    }

    async fn inbox_abandon(&self, tx: SimTx) {
        // Held until the server ended it, so the tag names only it; then
        // the pool's return finds the connection closed.
        self.terminate(&tx.tag).await;
        drop(tx);
    }

    async fn inbox_lock_keys(
        &self,
        tx: &mut SimTx,
        subscription: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        tx.call(PgRequest::InboxLockKeys {
            subscription: subscription.to_owned(),
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        })
        .await
        .map(drop)
    }

    async fn inbox_try_insert(
        &self,
        tx: &mut SimTx,
        entry: &InboxEntry<'_>,
    ) -> Result<InsertOutcome, StoreError> {
        let outcome = match tx
            .call(PgRequest::InboxTryInsert {
                entry: wire_entry(entry)?,
            })
            .await?
        {
            PgReply::Inbox(WireInsertOutcome::Inserted) => InsertOutcome::Inserted,
            PgReply::Inbox(WireInsertOutcome::InFlightRetry { attempts }) => {
                InsertOutcome::InFlightRetry { attempts }
            }
            PgReply::Inbox(WireInsertOutcome::AlreadyProcessed) => InsertOutcome::AlreadyProcessed,
            PgReply::Inbox(WireInsertOutcome::BehindRetry) => InsertOutcome::BehindRetry,
            PgReply::Inbox(WireInsertOutcome::Held) => InsertOutcome::Held,
            other => return Err(unexpected(other)),
        };
        Ok(outcome)
    }

    async fn inbox_savepoint(&self, tx: &mut SimTx) -> Result<(), StoreError> {
        tx.call(PgRequest::InboxSavepoint).await.map(drop)
    }

    async fn inbox_mark_processed(
        &self,
        tx: &mut SimTx,
        entry: &InboxEntry<'_>,
    ) -> Result<(), StoreError> {
        tx.call(PgRequest::InboxMarkProcessed {
            subscription: entry.subscription.to_owned(),
            event_id: entry.event_id,
        })
        .await
        .map(drop)
    }

    async fn inbox_commit(&self, mut tx: SimTx) -> Result<(), StoreError> {
        if tx.owes() {
            self.inbox_abandon(tx).await;
            return Err(StoreError::Unavailable(
                "the transaction was given up on before its commit".into(),
            ));
        }
        let done = tx.call(PgRequest::Commit).await;
        if !matches!(done, Err(StoreError::Unavailable(_))) {
            // Answered (committed, or failed and rolled back): it ended.
            tx.open = false;
        } else if tx.owes() {
            // The COMMIT may still wait at the server: end it there.
            self.inbox_abandon(tx).await;
            return done.map(drop);
        }
        done?;
        drop(tx);
        self.hooks
            .at(Point::AfterCommit, &self.pool.client, &self.pool.trace)
            .await;
        Ok(())
    }

    async fn inbox_rollback(&self, mut tx: SimTx) {
        if tx.owes() {
            return self.inbox_abandon(tx).await;
        }
        // As the sqlx adapter: ROLLBACK, under the store call's bound; if
        // that fails the transaction is ended at the server.
        match tx.call(PgRequest::Rollback).await {
            Ok(_) => tx.open = false,
            Err(_) => {
                let tag = tx.tag.clone();
                drop(tx);
                self.terminate(&tag).await;
            }
        }
    }

    async fn inbox_record_failure(
        &self,
        tx: &mut SimTx,
        entry: &InboxEntry<'_>,
        error: &str,
        max_attempts: u32,
    ) -> Result<AttemptRecord, StoreError> {
        match tx
            .call(PgRequest::InboxRecordFailure {
                subscription: entry.subscription.to_owned(),
                event_id: entry.event_id,
                error: error.to_owned(),
                max_attempts,
            })
            .await?
        {
            PgReply::Attempt {
                attempts,
                dead_lettered,
            } => Ok(AttemptRecord {
                attempts,
                dead_lettered,
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn inbox_list_unprocessed(&self, f: &InboxFilter) -> Result<Vec<InboxRow>, StoreError> {
        let limit = f
            .limit
            .unwrap_or(LIST_LIMIT_DEFAULT)
            .clamp(1, LIST_LIMIT_MAX);
        self.rows(PgRequest::InboxList {
            ids: f.ids.clone(),
            subscription: f.subscription.clone(),
            routing_key: f.routing_key.clone(),
            dead_lettered_only: f.dead_lettered_only,
            limit,
            after: f.after.map(|c| (sim_ms(c.received_at), c.event_id)),
            payload_field: f.payload_field.clone(),
            omit_payload: f.omit_payload,
        })
        .await
    }

    async fn inbox_counts(
        &self,
        subscription: &str,
        window: Duration,
        cap: u32,
    ) -> Result<InboxCounts, StoreError> {
        let req = PgRequest::InboxCounts {
            subscription: subscription.to_owned(),
            window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
            cap,
        };
        match self.side_call(req).await? {
            PgReply::InboxCounts {
                processed_recently,
                retrying,
                dead_lettered,
            } => Ok(InboxCounts {
                processed_recently,
                retrying,
                dead_lettered,
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn inbox_held(
        &self,
        subscription: &str,
        key: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.rows(PgRequest::InboxHeld {
            subscription: subscription.to_owned(),
            key: key.to_owned(),
            after,
            limit: limit.clamp(1, LIST_LIMIT_MAX),
        })
        .await
    }

    async fn inbox_releasable(
        &self,
        subscription: &str,
        limit: u32,
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.rows(PgRequest::InboxReleasable {
            subscription: subscription.to_owned(),
            limit: limit.clamp(1, LIST_LIMIT_MAX),
        })
        .await
    }

    async fn inbox_skip(
        &self,
        subscription: &str,
        ids: &[uuid::Uuid],
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.rows(PgRequest::InboxSkip {
            subscription: subscription.to_owned(),
            ids: ids.to_vec(),
        })
        .await
    }

    async fn inbox_delete_processed(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        match self
            .side_call(PgRequest::InboxDeleteProcessed {
                older_than_ms: older_than.as_millis() as u64,
                limit,
            })
            .await?
        {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    async fn inbox_retire_partitions(
        &self,
        older_than: Duration,
    ) -> Result<outbox::core::ports::PartitionsRetired, StoreError> {
        match self
            .side_call(PgRequest::InboxRetirePartitions {
                older_than_ms: older_than.as_millis() as u64,
            })
            .await?
        {
            PgReply::Retired(r) => Ok(super::store::retired(r)),
            other => Err(unexpected(other)),
        }
    }

    async fn inbox_ping(&self) -> Result<(), StoreError> {
        // What the subscriber learns of the database here is evidence the
        // checker weighs too: the ping and how long it took.
        let sent = crate::sim_now();
        let mut answered = PingAnswered {
            client: &self.pool.client,
            sent,
            trace: &self.pool.trace,
            ok: false,
        };
        let reply = self.control.call(PgRequest::Ping).await;
        answered.ok = matches!(reply, Ok(PgReply::Ok));
        drop(answered);
        match reply? {
            PgReply::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}
