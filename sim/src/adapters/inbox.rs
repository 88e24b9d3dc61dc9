//! The `InboxStore` port over the fake PostgreSQL, for the production
//! subscriber in a consumer host.
//!
//! Like the sqlx adapter: every handler transaction runs on a pooled
//! connection of its own (the subscriber handles several deliveries at
//! once), bounded by the same idle-in-transaction timeout, with a savepoint
//! after the inbox insert (and a replay's budget reset before it) and
//! failure records inside it; listings and sweeps run on another
//! connection, outside any handler transaction.

use std::sync::Mutex;
use std::time::Duration;

use outbox::StoreError;
use outbox::core::ports::{
    AttemptRecord, InboxEntry, InboxFilter, InboxRow, InboxStore, InsertOutcome,
};
use time::OffsetDateTime;
use uuid::Uuid;

use super::hooks::{Hooks, Point};
use super::net::{PgClient, connect_pg, request, unexpected};
use crate::trace::Trace;
use crate::wire::{PgReply, PgRequest, WireInboxEntry, WireInsertOutcome};

/// Idle-in-transaction bound of a handler transaction (as the sqlx adapter
/// sets it): a consumer that vanishes mid-handler releases its inbox row
/// lock after this, so a redelivery elsewhere is not blocked for hours.
pub const HANDLER_IDLE_IN_TX_TIMEOUT: Duration = outbox::pg::inbox::HANDLER_IDLE_IN_TX_TIMEOUT;
/// Default and largest number of rows one listing returns.
const LIST_LIMIT_DEFAULT: u32 = outbox::pg::inbox::LIST_LIMIT_DEFAULT;
const LIST_LIMIT_MAX: u32 = outbox::pg::inbox::LIST_LIMIT_MAX;

/// A handler transaction: one connection, held until commit or rollback.
pub struct SimTx {
    conn: Option<crate::engine::net::TcpStream>,
}

impl SimTx {
    /// Sends one request in the transaction. A transport failure drops the
    /// connection, which rolls the transaction back at the server.
    pub async fn call(&mut self, req: PgRequest) -> Result<PgReply, StoreError> {
        request(&mut self.conn, &req).await
    }

    /// The simulated handler's domain write for `event_id`.
    pub async fn effect(&mut self, subscription: &str, event_id: Uuid) -> Result<(), StoreError> {
        self.call(PgRequest::Effect {
            subscription: subscription.to_owned(),
            event_id,
        })
        .await
        .map(drop)
    }
}

/// The inbox store of one consumer replica.
pub struct SimInboxStore {
    client: String,
    idle: Mutex<Vec<crate::engine::net::TcpStream>>,
    side: PgClient,
    hooks: Hooks,
    trace: Trace,
}

impl SimInboxStore {
    /// A store for the consumer `client` (its name in the fake's trace).
    pub fn new(client: impl Into<String>, trace: Trace) -> Self {
        let client = client.into();
        Self {
            side: PgClient::new(format!("{client}/side"), trace.clone()),
            client,
            idle: Mutex::default(),
            hooks: Hooks::default(),
            trace,
        }
    }

    /// Crash and pause points of the consumer host (`AfterCommit`).
    pub fn with_hooks(mut self, hooks: Hooks) -> Self {
        self.hooks = hooks;
        self
    }

    async fn checkout(&self) -> Result<crate::engine::net::TcpStream, StoreError> {
        if let Some(s) = self.idle.lock().expect("idle").pop() {
            return Ok(s);
        }
        connect_pg(&self.client).await
    }

    fn checkin(&self, tx: SimTx) {
        if let Some(s) = tx.conn {
            self.idle.lock().expect("idle").push(s);
        }
    }

    async fn side_call(&self, req: PgRequest) -> Result<PgReply, StoreError> {
        self.side.call(req).await
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
    })
}

fn sim_time(ms: u64) -> OffsetDateTime {
    OffsetDateTime::UNIX_EPOCH + Duration::from_millis(ms)
}

impl InboxStore for SimInboxStore {
    type Tx = SimTx;

    async fn inbox_begin(&self) -> Result<SimTx, StoreError> {
        let mut tx = SimTx {
            conn: Some(self.checkout().await?),
        };
        tx.call(PgRequest::Begin).await?;
        tx.call(PgRequest::SetIdleInTxTimeout {
            ms: HANDLER_IDLE_IN_TX_TIMEOUT.as_millis() as u64,
        })
        .await?;
        Ok(tx)
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
        tx.call(PgRequest::Commit).await?;
        self.checkin(tx);
        self.hooks
            .at(Point::AfterCommit, &self.client, &self.trace)
            .await;
        Ok(())
    }

    async fn inbox_rollback(&self, mut tx: SimTx) {
        if tx.call(PgRequest::Rollback).await.is_ok() {
            self.checkin(tx);
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
        match self
            .side_call(PgRequest::InboxList {
                ids: f.ids.clone(),
                subscription: f.subscription.clone(),
                routing_key: f.routing_key.clone(),
                dead_lettered_only: f.dead_lettered_only,
                limit,
            })
            .await?
        {
            PgReply::InboxRows(rows) => Ok(rows
                .into_iter()
                .map(|r| InboxRow {
                    event_id: r.event_id,
                    subscription: r.subscription,
                    routing_key: r.routing_key,
                    payload: r.payload.into_bytes(),
                    attempts: r.attempts,
                    last_error: r.last_error,
                    received_at: sim_time(r.received_ms),
                    dead_lettered_at: r.dead_lettered_ms.map(sim_time),
                })
                .collect()),
            other => Err(unexpected(other)),
        }
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

    async fn inbox_ping(&self) -> Result<(), StoreError> {
        match self.side_call(PgRequest::Ping).await? {
            PgReply::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}
