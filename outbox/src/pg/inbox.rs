//! The inbox store on PostgreSQL (`event_inbox`, ADR-018 amendment #433).

use std::time::Duration;

use sqlx::{PgPool, Postgres, Row};

use super::{bounded, delete_expired, map_err, sql};
use crate::core::ports::{
    AttemptRecord, InboxEntry, InboxFilter, InboxRow, InboxStore, InsertOutcome,
};
use crate::error::StoreError;

/// The handler's transaction: what a [`crate::core::subscriber::Handler`]
/// receives in production.
pub type PgTx = sqlx::Transaction<'static, Postgres>;

/// Idle-in-transaction bound of a handler transaction: a consumer that
/// vanishes mid-handler (partitioned, killed without a TCP reset) would
/// otherwise hold its inbox row lock until TCP keepalive gives up (hours),
/// blocking every redelivery of that event elsewhere. Only time *between*
/// statements counts, so a handler doing SQL is never cut off by it.
pub const HANDLER_IDLE_IN_TX_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Default and largest number of rows one listing or replay returns.
pub const LIST_LIMIT_DEFAULT: u32 = 100;
/// See [`LIST_LIMIT_DEFAULT`].
pub const LIST_LIMIT_MAX: u32 = 10_000;

/// The inbox store on a PostgreSQL pool: handler transactions come from the
/// pool, and failed attempts are recorded on another pooled connection.
#[derive(Debug, Clone)]
pub struct PgInboxStore {
    pool: PgPool,
}

impl PgInboxStore {
    /// Wraps a pool. The `event_inbox` migration must have been applied (see
    /// [`crate::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The pool it uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

fn payload_text<'a>(entry: &InboxEntry<'a>) -> Result<&'a str, StoreError> {
    std::str::from_utf8(entry.payload)
        .map_err(|e| StoreError::Refused(format!("payload is not UTF-8: {e}")))
}

impl InboxStore for PgInboxStore {
    type Tx = PgTx;

    async fn inbox_begin(&self) -> Result<PgTx, StoreError> {
        bounded(async {
            self.pool
                .begin_with(sql::INBOX_BEGIN)
                .await
                .map_err(map_err)
        })
        .await
    }

    async fn inbox_try_insert(
        &self,
        tx: &mut PgTx,
        entry: &InboxEntry<'_>,
    ) -> Result<InsertOutcome, StoreError> {
        let payload = payload_text(entry)?;
        bounded(async {
            let done = sqlx::query(sql::INBOX_TRY_INSERT)
                .bind(entry.event_id)
                .bind(entry.subscription)
                .bind(entry.routing_key)
                .bind(payload)
                .execute(&mut **tx)
                .await
                .map_err(map_err)?;
            let outcome = if done.rows_affected() == 1 {
                InsertOutcome::Inserted
            } else {
                // The row exists (committed: the insert waited for any
                // transaction holding it). Lock it for this transaction.
                let row = sqlx::query(sql::INBOX_LOCK)
                    .bind(entry.event_id)
                    .bind(entry.subscription)
                    .fetch_optional(&mut **tx)
                    .await
                    .map_err(map_err)?;
                match row {
                    Some(r) if r.get::<bool, _>("processed") => InsertOutcome::AlreadyProcessed,
                    Some(_) if entry.fresh_budget => {
                        sqlx::query(sql::INBOX_RESET_ATTEMPTS)
                            .bind([entry.event_id].as_slice())
                            .bind(entry.subscription)
                            .execute(&mut **tx)
                            .await
                            .map_err(map_err)?;
                        InsertOutcome::InFlightRetry { attempts: 0 }
                    }
                    Some(r) => InsertOutcome::InFlightRetry {
                        attempts: r.get("attempts"),
                    },
                    // Deleted in between (only processed rows are ever
                    // deleted, after retention): nothing left to compare with.
                    None => {
                        return Err(StoreError::Statement(format!(
                            "inbox row {} vanished while locking it",
                            entry.event_id
                        )));
                    }
                }
            };
            Ok(outcome)
        })
        .await
    }

    async fn inbox_savepoint(&self, tx: &mut PgTx) -> Result<(), StoreError> {
        bounded(async {
            sqlx::raw_sql(sql::INBOX_SAVEPOINT)
                .execute(&mut **tx)
                .await
                .map_err(map_err)
                .map(drop)
        })
        .await
    }

    async fn inbox_mark_processed(
        &self,
        tx: &mut PgTx,
        entry: &InboxEntry<'_>,
    ) -> Result<(), StoreError> {
        bounded(async {
            sqlx::query(sql::INBOX_MARK_PROCESSED)
                .bind(entry.event_id)
                .bind(entry.subscription)
                .execute(&mut **tx)
                .await
                .map_err(map_err)?;
            Ok(())
        })
        .await
    }

    async fn inbox_commit(&self, tx: PgTx) -> Result<(), StoreError> {
        bounded(async { tx.commit().await.map_err(map_err) }).await
    }

    async fn inbox_rollback(&self, tx: PgTx) {
        // A failure here means the connection is gone, which rolls back too.
        let _ = bounded(async { tx.rollback().await.map_err(map_err) }).await;
    }

    async fn inbox_record_failure(
        &self,
        tx: &mut PgTx,
        entry: &InboxEntry<'_>,
        error: &str,
        max_attempts: u32,
    ) -> Result<AttemptRecord, StoreError> {
        bounded(async {
            sqlx::raw_sql(sql::INBOX_ROLLBACK_HANDLER)
                .execute(&mut **tx)
                .await
                .map_err(map_err)?;
            let row = sqlx::query(sql::INBOX_RECORD_FAILURE)
                .bind(entry.event_id)
                .bind(error)
                .bind(i64::from(max_attempts))
                .bind(entry.subscription)
                .fetch_optional(&mut **tx)
                .await
                .map_err(map_err)?;
            match row {
                Some(r) => Ok(AttemptRecord {
                    attempts: r.get("attempts"),
                    dead_lettered: r.get("dead_lettered"),
                }),
                None => Err(StoreError::Statement(format!(
                    "inbox row {} is not held by this transaction",
                    entry.event_id
                ))),
            }
        })
        .await
    }

    async fn inbox_list_unprocessed(&self, f: &InboxFilter) -> Result<Vec<InboxRow>, StoreError> {
        let limit = f
            .limit
            .unwrap_or(LIST_LIMIT_DEFAULT)
            .clamp(1, LIST_LIMIT_MAX);
        bounded(async {
            let rows = sqlx::query(sql::INBOX_LIST_UNPROCESSED)
                .bind(f.ids.as_deref())
                .bind(f.subscription.as_deref())
                .bind(f.routing_key.as_deref())
                .bind(f.dead_lettered_only)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await
                .map_err(map_err)?;
            Ok(rows
                .into_iter()
                .map(|r| InboxRow {
                    event_id: r.get("event_id"),
                    subscription: r.get("subscription"),
                    routing_key: r.get("routing_key"),
                    payload: r.get::<String, _>("payload").into_bytes(),
                    attempts: r.get("attempts"),
                    last_error: r.get("last_error"),
                    received_at: r.get("received_at"),
                    dead_lettered_at: r.get("dead_lettered_at"),
                })
                .collect())
        })
        .await
    }

    async fn inbox_delete_processed(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        delete_expired(&self.pool, sql::INBOX_DELETE_PROCESSED, older_than, limit).await
    }

    async fn inbox_ping(&self) -> Result<(), StoreError> {
        bounded(async {
            sqlx::query(sql::INBOX_PING)
                .execute(&self.pool)
                .await
                .map(drop)
                .map_err(map_err)
        })
        .await
    }
}
