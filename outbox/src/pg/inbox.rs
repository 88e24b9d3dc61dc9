//! The inbox store on PostgreSQL (`event_inbox`, ADR-018 amendment #433).

use std::time::Duration;

use sqlx::{PgPool, Postgres, Row};
use uuid::Uuid;

use super::{STORE_CALL_TIMEOUT, bounded, delete_expired, map_err, sql};
use crate::core::ports::{
    AttemptRecord, InboxCounts, InboxEntry, InboxFilter, InboxRow, InboxStore, InsertOutcome,
    KeySeq, PayloadField, TxBounds,
};
use crate::error::StoreError;

/// The handler's transaction: what a [`crate::core::subscriber::Handler`]
/// receives in production.
pub type PgTx = sqlx::Transaction<'static, Postgres>;

pub use crate::core::ports::{LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX};

/// Connections of the control pool (pings, ending abandoned transactions):
/// apart from the handlers' pool, so a pool that handlers exhausted cannot
/// keep the subscriber from asking the database or ending what it gave up.
const CONTROL_CONNECTIONS: u32 = 2;

/// A handler transaction of [`PgInboxStore`]: sqlx's transaction, the tag
/// it runs under at the server (`application_name`), and whether a
/// statement of it may still be running there (a call gave up on it).
pub struct PgInboxTx {
    tx: PgTx,
    tag: String,
    abandoned: bool,
}

impl std::fmt::Debug for PgInboxTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgInboxTx")
            .field("tag", &self.tag)
            .field("abandoned", &self.abandoned)
            .finish_non_exhaustive()
    }
}

impl PgInboxTx {
    /// The `application_name` the transaction runs under at the server,
    /// while it lasts (`canopy-inbox-…`): what an operator sees in
    /// `pg_stat_activity`, and what [`InboxStore::inbox_abandon`] ends it by.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Its sqlx transaction and its "a call gave up" mark, apart.
    fn parts(&mut self) -> (&mut PgTx, &mut bool) {
        (&mut self.tx, &mut self.abandoned)
    }
}

impl std::ops::Deref for PgInboxTx {
    type Target = PgTx;
    fn deref(&self) -> &PgTx {
        &self.tx
    }
}

impl std::ops::DerefMut for PgInboxTx {
    fn deref_mut(&mut self) -> &mut PgTx {
        &mut self.tx
    }
}

/// The inbox store on a PostgreSQL pool: handler transactions come from the
/// pool; pings and the ending of abandoned transactions run on a small
/// control pool of its own (same connect options, opened lazily).
#[derive(Debug, Clone)]
pub struct PgInboxStore {
    pool: PgPool,
    control: std::sync::Arc<super::nodes::Derived>,
}

impl PgInboxStore {
    /// Wraps a pool. The `event_inbox` migration must have been applied (see
    /// [`crate::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        let control = super::nodes::Derived::new(
            &pool,
            std::convert::identity,
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(CONTROL_CONNECTIONS)
                .min_connections(0)
                .acquire_timeout(STORE_CALL_TIMEOUT),
        );
        Self {
            pool,
            control: std::sync::Arc::new(control),
        }
    }

    /// The pool it uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Statements of a transaction bounded by the store call's bound: on
    /// expiry one may still run at the server, and `abandoned` says so.
    async fn in_tx<T>(
        abandoned: &mut bool,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(STORE_CALL_TIMEOUT, fut).await {
            Ok(r) => r,
            Err(_) => {
                *abandoned = true;
                Err(timed_out())
            }
        }
    }

    /// Inbox rows a listing statement selects, on the pool, bounded.
    async fn rows(
        &self,
        query: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<InboxRow>, StoreError> {
        bounded(async {
            let rows = query.fetch_all(&self.pool).await.map_err(map_err)?;
            Ok(rows.iter().map(inbox_row).collect())
        })
        .await
    }

    /// One statement of no rows (a savepoint, a check, a rollback to one)
    /// in the transaction, bounded as [`Self::in_tx`].
    async fn raw_in_tx(tx: &mut PgInboxTx, statement: &'static str) -> Result<(), StoreError> {
        let (tx, abandoned) = tx.parts();
        Self::in_tx(abandoned, async {
            sqlx::raw_sql(statement)
                .execute(&mut **tx)
                .await
                .map_err(map_err)
                .map(drop)
        })
        .await
    }

    /// Ends the transaction tagged `tag` at the server (on the control
    /// pool), bounded; false if that could not be done.
    async fn terminate(&self, tag: &str) -> bool {
        let done = bounded(async {
            sqlx::query_scalar::<_, i64>(sql::INBOX_TERMINATE)
                .bind(tag)
                .fetch_one(self.control.pool())
                .await
                .map_err(map_err)
        })
        .await;
        match done {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, "could not end an abandoned handler transaction; \
                    its statement_timeout will");
                false
            }
        }
    }
}

fn timed_out() -> StoreError {
    StoreError::Unavailable(format!(
        "no answer from the database within {} s",
        STORE_CALL_TIMEOUT.as_secs()
    ))
}

/// The begin statement for `bounds`, under `tag`.
fn begin_statement(bounds: TxBounds, tag: &str) -> String {
    sql::INBOX_BEGIN
        .replace("{idle_ms}", &bounds.idle.as_millis().to_string())
        .replace("{statement_ms}", &bounds.statement.as_millis().to_string())
        .replace("{tag}", tag)
}

/// What the insert of a delivery found: whether a row was written, and,
/// for an ordered subscription's keyed delivery, what waits before it
/// (`inbox_try_insert_keyed.sql`: `None` if nothing, `Some(false)` if an
/// event waiting for its retry, `Some(true)` if a dead-lettered or held one).
async fn insert_row(
    tx: &mut PgTx,
    entry: &InboxEntry<'_>,
    payload: &str,
) -> Result<(bool, Option<bool>), StoreError> {
    let Some(o) = entry.ordering else {
        let done = sqlx::query(sql::INBOX_TRY_INSERT)
            .bind(entry.event_id)
            .bind(entry.subscription)
            .bind(entry.routing_key)
            .bind(payload)
            .bind(None::<&str>)
            .bind(None::<i64>)
            .execute(&mut **tx)
            .await
            .map_err(map_err)?;
        return Ok((done.rows_affected() == 1, None));
    };
    let row = sqlx::query(sql::INBOX_TRY_INSERT_KEYED)
        .bind(entry.event_id)
        .bind(entry.subscription)
        .bind(entry.routing_key)
        .bind(payload)
        .bind(&o.key)
        .bind(o.seq)
        .fetch_one(&mut **tx)
        .await
        .map_err(map_err)?;
    let written: i64 = row.get("written");
    Ok((written == 1, row.get("blocked")))
}

/// A statement of no rows about `entry`'s row ($1 event id, $2
/// subscription), in its transaction.
async fn of_event(
    tx: &mut PgTx,
    statement: &'static str,
    entry: &InboxEntry<'_>,
) -> Result<(), StoreError> {
    sqlx::query(statement)
        .bind(entry.event_id)
        .bind(entry.subscription)
        .execute(&mut **tx)
        .await
        .map_err(map_err)
        .map(drop)
}

/// An inbox row as the listing statements select it.
fn inbox_row(r: &sqlx::postgres::PgRow) -> InboxRow {
    let key: Option<String> = r.get("ordering_key");
    let seq: Option<i64> = r.get("key_seq");
    InboxRow {
        event_id: r.get("event_id"),
        subscription: r.get("subscription"),
        routing_key: r.get("routing_key"),
        payload: r.get::<String, _>("payload").into_bytes(),
        attempts: r.get("attempts"),
        last_error: r.get("last_error"),
        received_at: r.get("received_at"),
        dead_lettered_at: r.get("dead_lettered_at"),
        ordering: key.zip(seq).map(|(key, seq)| KeySeq { key, seq }),
        held: r.get("held"),
    }
}

fn payload_text<'a>(entry: &InboxEntry<'a>) -> Result<&'a str, StoreError> {
    std::str::from_utf8(entry.payload)
        .map_err(|e| StoreError::Refused(format!("payload is not UTF-8: {e}")))
}

impl crate::core::ports::Replication for PgInboxStore {
    async fn replication_positions(
        &self,
        standbys: &[String],
    ) -> Result<crate::core::ports::ReplicationPositions, StoreError> {
        super::replication_positions(self.control.pool(), standbys).await
    }
}

impl InboxStore for PgInboxStore {
    type Tx = PgInboxTx;
    type HandlerTx = PgTx;

    fn handler_tx(tx: &mut PgInboxTx) -> &mut PgTx {
        &mut tx.tx
    }

    async fn inbox_begin(&self, bounds: TxBounds) -> Result<PgInboxTx, StoreError> {
        // A tag of hex digits only: it is spliced into the statement.
        let tag = format!("canopy-inbox-{}", uuid::Uuid::now_v7().simple());
        let statement = begin_statement(bounds, &tag);
        let tx = bounded(async {
            self.pool
                .begin_with(sqlx::AssertSqlSafe(statement))
                .await
                .map_err(map_err)
        })
        .await?;
        Ok(PgInboxTx {
            tx,
            tag,
            abandoned: false,
        })
    }

    async fn inbox_check(&self, tx: &mut PgInboxTx) -> Result<(), StoreError> {
        Self::raw_in_tx(tx, sql::INBOX_CHECK).await
    }

    async fn inbox_undo_handler(&self, tx: &mut PgInboxTx) -> Result<(), StoreError> {
        Self::raw_in_tx(tx, sql::INBOX_ROLLBACK_HANDLER).await
    }

    async fn inbox_abandon(&self, tx: PgInboxTx) {
        // The server ends the session; sqlx then finds the connection
        // closed and does not pool it again. Until then it is held here, so
        // the tag names only this transaction.
        self.terminate(&tx.tag).await;
        drop(tx);
    }

    async fn inbox_lock_keys(
        &self,
        tx: &mut PgInboxTx,
        subscription: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        let (tx, abandoned) = tx.parts();
        Self::in_tx(abandoned, async {
            sqlx::query(sql::INBOX_LOCK_KEYS)
                .bind(subscription)
                .bind(keys)
                .execute(&mut **tx)
                .await
                .map_err(map_err)
                .map(drop)
        })
        .await
    }

    async fn inbox_try_insert(
        &self,
        tx: &mut PgInboxTx,
        entry: &InboxEntry<'_>,
    ) -> Result<InsertOutcome, StoreError> {
        let payload = payload_text(entry)?;
        let (tx, abandoned) = tx.parts();
        Self::in_tx(abandoned, async {
            let (written, blocked) = insert_row(tx, entry, payload).await?;
            let holding = match blocked {
                Some(false) => return Ok(InsertOutcome::BehindRetry),
                Some(true) if written => return Ok(InsertOutcome::Held),
                Some(true) => {
                    // A redelivery of a row that exists: held too, unless
                    // it took effect (the lock below says which).
                    of_event(tx, sql::INBOX_HOLD, entry).await?;
                    true
                }
                None => false,
            };
            let outcome = if written {
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
                    Some(_) if holding => InsertOutcome::Held,
                    Some(r) if entry.fresh_budget => {
                        let reset = sqlx::query(sql::INBOX_RESET_ATTEMPTS)
                            .bind([entry.event_id].as_slice())
                            .bind(entry.subscription)
                            .execute(&mut **tx)
                            .await
                            .map_err(map_err)?
                            .rows_affected();
                        InsertOutcome::InFlightRetry {
                            attempts: if reset > 0 { 0 } else { r.get("attempts") },
                        }
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

    async fn inbox_savepoint(&self, tx: &mut PgInboxTx) -> Result<(), StoreError> {
        Self::raw_in_tx(tx, sql::INBOX_SAVEPOINT).await
    }

    async fn inbox_mark_processed(
        &self,
        tx: &mut PgInboxTx,
        entry: &InboxEntry<'_>,
    ) -> Result<(), StoreError> {
        let (tx, abandoned) = tx.parts();
        Self::in_tx(abandoned, of_event(tx, sql::INBOX_MARK_PROCESSED, entry)).await
    }

    async fn inbox_commit(&self, tx: PgInboxTx) -> Result<(), StoreError> {
        let PgInboxTx { tx, tag, abandoned } = tx;
        if abandoned {
            self.terminate(&tag).await;
            return Err(StoreError::Unavailable(
                "the transaction was given up on before its commit".into(),
            ));
        }
        match tokio::time::timeout(STORE_CALL_TIMEOUT, tx.commit()).await {
            Ok(done) => done.map_err(map_err),
            Err(_) => {
                // The COMMIT may still wait at the server (a deferred
                // check waiting for another writer): end it there.
                self.terminate(&tag).await;
                Err(timed_out())
            }
        }
    }

    async fn inbox_rollback(&self, tx: PgInboxTx) {
        if tx.abandoned {
            return self.inbox_abandon(tx).await;
        }
        let PgInboxTx { tx, tag, .. } = tx;
        // A failure means the connection is gone (which rolls back too) or
        // stuck behind a statement: end the transaction at the server.
        let done = tokio::time::timeout(STORE_CALL_TIMEOUT, tx.rollback()).await;
        if !matches!(done, Ok(Ok(()))) {
            self.terminate(&tag).await;
        }
    }

    async fn inbox_record_failure(
        &self,
        tx: &mut PgInboxTx,
        entry: &InboxEntry<'_>,
        error: &str,
        max_attempts: u32,
    ) -> Result<AttemptRecord, StoreError> {
        let (tx, abandoned) = tx.parts();
        Self::in_tx(abandoned, async {
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
        self.rows(
            sqlx::query(sql::INBOX_LIST_UNPROCESSED)
                .bind(f.ids.as_deref())
                .bind(f.subscription.as_deref())
                .bind(f.routing_key.as_deref())
                .bind(f.dead_lettered_only)
                .bind(i64::from(limit))
                .bind(f.after.map(|c| c.received_at))
                .bind(f.after.map(|c| c.event_id))
                .bind(f.omit_payload)
                .bind(f.payload_field.as_ref().map(|p| p.path.clone()))
                .bind(f.payload_field.as_ref().map(|p| p.value.clone()))
                .bind(f.payload_field.as_ref().and_then(PayloadField::value_json)),
        )
        .await
    }

    async fn inbox_held(
        &self,
        subscription: &str,
        key: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.rows(
            sqlx::query(sql::INBOX_HELD)
                .bind(subscription)
                .bind(key)
                .bind(after)
                .bind(i64::from(limit.clamp(1, LIST_LIMIT_MAX))),
        )
        .await
    }

    async fn inbox_releasable(
        &self,
        subscription: &str,
        limit: u32,
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.rows(
            sqlx::query(sql::INBOX_RELEASABLE)
                .bind(subscription)
                .bind(i64::from(limit.clamp(1, LIST_LIMIT_MAX))),
        )
        .await
    }

    async fn inbox_skip(
        &self,
        subscription: &str,
        ids: &[Uuid],
    ) -> Result<Vec<InboxRow>, StoreError> {
        bounded(async {
            let mut tx = self.pool.begin().await.map_err(map_err)?;
            sqlx::query(sql::INBOX_SKIP_LOCK)
                .bind(subscription)
                .bind(ids)
                .execute(&mut *tx)
                .await
                .map_err(map_err)?;
            let rows = sqlx::query(sql::INBOX_SKIP)
                .bind(subscription)
                .bind(ids)
                .fetch_all(&mut *tx)
                .await
                .map_err(map_err)?;
            tx.commit().await.map_err(map_err)?;
            let mut rows: Vec<InboxRow> = rows.iter().map(inbox_row).collect();
            rows.sort_by_key(|r| (r.received_at, r.event_id));
            Ok(rows)
        })
        .await
    }

    async fn inbox_delete_processed(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        match super::partitions::delete_expired(
            &self.pool,
            super::partitions::INBOX,
            older_than,
            limit,
        )
        .await?
        {
            Some(deleted) => Ok(deleted),
            None => {
                delete_expired(&self.pool, sql::INBOX_DELETE_PROCESSED, older_than, limit).await
            }
        }
    }

    async fn inbox_retire_partitions(
        &self,
        older_than: Duration,
    ) -> Result<crate::core::ports::PartitionsRetired, StoreError> {
        super::partitions::retire(&self.pool, super::partitions::INBOX, older_than).await
    }

    async fn inbox_counts(
        &self,
        subscription: &str,
        window: Duration,
        cap: u32,
    ) -> Result<InboxCounts, StoreError> {
        bounded(async {
            let r = sqlx::query(sql::INBOX_COUNTS)
                .bind(subscription)
                .bind(window.as_secs_f64())
                .bind(i64::from(cap))
                .fetch_one(&self.pool)
                .await
                .map_err(map_err)?;
            let count = |name: &str| u64::try_from(r.get::<i64, _>(name)).unwrap_or(0);
            Ok(InboxCounts {
                processed_recently: count("processed_recently"),
                retrying: count("retrying"),
                dead_lettered: count("dead_lettered"),
            })
        })
        .await
    }

    async fn inbox_ping(&self) -> Result<(), StoreError> {
        bounded(async {
            sqlx::query(sql::INBOX_PING)
                .execute(self.control.pool())
                .await
                .map(drop)
                .map_err(map_err)
        })
        .await
    }
}
