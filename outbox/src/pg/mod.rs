//! The PostgreSQL adapter: the only place (with [`publisher`]) that
//! runs SQL. One statement per `.sql` file under `sql/`, named after the port
//! method it implements; `map_err` is the one place sqlx errors become
//! [`StoreError`]s.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::core::ports::{
    ClaimParams, ClaimPosition, ClaimedRow, FailOutcome, KeyHead, KeySeq, KeyWindow, OutboxStats,
    OutboxStore, ParkedFilter, ParkedRow, PartitionsRetired, PayloadField, Replication,
    ReplicationPositions, RowFailure, StandbyFlush, UnparkSelector, WalPosition,
};
use crate::error::StoreError;
use crate::trace_context::TraceContext;

pub mod inbox;
pub mod nodes;
pub mod partitions;
pub mod publisher;

pub(crate) mod sql {
    pub const CLAIM: &str = include_str!("sql/outbox_claim.sql");
    /// Where [`CLAIM_AFTER`] puts its bound.
    const PAST_THE_PLACE: &str = "-- [past the walk's place]";
    /// [`CLAIM`] walking unkeyed rows only past ($5 µs since the epoch,
    /// $6 id) in claim order (`ClaimParams::after`).
    pub static CLAIM_AFTER: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        assert!(
            CLAIM.contains(PAST_THE_PLACE),
            "the claim marks its bound's place"
        );
        CLAIM.replacen(
            PAST_THE_PLACE,
            "AND (o.enqueued_at, o.id) > \
             ('epoch'::timestamptz + $5::bigint * interval '1 microsecond', $6::uuid)",
            1,
        )
    });
    pub const KEY_WINDOW: &str = include_str!("sql/outbox_key_window.sql");
    pub const REPLICATION_POSITIONS: &str = include_str!("sql/replication_positions.sql");
    pub const MARK_PUBLISHED: &str = include_str!("sql/outbox_mark_published.sql");
    pub const MARK_FAILED: &str = include_str!("sql/outbox_mark_failed.sql");
    pub const RELEASE: &str = include_str!("sql/outbox_release.sql");
    pub const STATS: &str = include_str!("sql/outbox_stats.sql");
    pub const PENDING_COUNT: &str = include_str!("sql/outbox_pending_count.sql");
    pub const DELETE_PUBLISHED: &str = include_str!("sql/outbox_delete_published.sql");
    pub const LIST_PARKED: &str = include_str!("sql/outbox_list_parked.sql");
    pub const UNPARK: &str = include_str!("sql/outbox_unpark.sql");
    pub const SKIP: &str = include_str!("sql/outbox_skip.sql");
    pub const INSERT: &str = include_str!("sql/outbox_insert.sql");
    pub const INSERT_MANY: &str = include_str!("sql/outbox_insert_many.sql");
    pub const INSERT_KEYED: &str = include_str!("sql/outbox_insert_keyed.sql");
    pub const INSERT_MANY_KEYED: &str = include_str!("sql/outbox_insert_many_keyed.sql");
    pub const INBOX_BEGIN: &str = include_str!("sql/inbox_begin.sql");
    pub const INBOX_CHECK: &str = include_str!("sql/inbox_check.sql");
    pub const INBOX_TERMINATE: &str = include_str!("sql/inbox_terminate.sql");
    pub const INBOX_TRY_INSERT: &str = include_str!("sql/inbox_try_insert.sql");
    pub const INBOX_LOCK: &str = include_str!("sql/inbox_lock.sql");
    pub const INBOX_LOCK_KEYS: &str = include_str!("sql/inbox_lock_keys.sql");
    pub const INBOX_TRY_INSERT_KEYED: &str = include_str!("sql/inbox_try_insert_keyed.sql");
    pub const INBOX_SKIP_LOCK: &str = include_str!("sql/inbox_skip_lock.sql");
    pub const INBOX_HOLD: &str = include_str!("sql/inbox_hold.sql");
    pub const INBOX_HELD: &str = include_str!("sql/inbox_held.sql");
    pub const INBOX_RELEASABLE: &str = include_str!("sql/inbox_releasable.sql");
    pub const INBOX_SKIP: &str = include_str!("sql/inbox_skip.sql");
    pub const INBOX_MARK_PROCESSED: &str = include_str!("sql/inbox_mark_processed.sql");
    pub const INBOX_SAVEPOINT: &str = include_str!("sql/inbox_savepoint.sql");
    pub const INBOX_ROLLBACK_HANDLER: &str = include_str!("sql/inbox_rollback_handler.sql");
    pub const INBOX_RECORD_FAILURE: &str = include_str!("sql/inbox_record_failure.sql");
    pub const INBOX_LIST_UNPROCESSED: &str = include_str!("sql/inbox_list_unprocessed.sql");
    pub const INBOX_COUNTS: &str = include_str!("sql/inbox_counts.sql");
    pub const INBOX_RESET_ATTEMPTS: &str = include_str!("sql/inbox_reset_attempts.sql");
    pub const INBOX_DELETE_PROCESSED: &str = include_str!("sql/inbox_delete_processed.sql");
    pub const INBOX_PING: &str = include_str!("sql/inbox_ping.sql");
}

/// The channel `publish_tx` / `publish_many_tx` notify at commit and the
/// drainer listens on (see `runtime::DrainerHandle`).
pub const WAKEUP_CHANNEL: &str = "canopy_outbox";

/// Bound on one store call (the ports' contract,
/// [`crate::core::ports::STORE_CALL_TIMEOUT`]): on expiry the call fails as
/// `Unavailable` and the drainer's claims are released or expire as with
/// any store error.
pub use crate::core::ports::STORE_CALL_TIMEOUT;

pub(crate) async fn bounded<T>(
    fut: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(STORE_CALL_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "no answer from the database within {} s",
                STORE_CALL_TIMEOUT.as_secs()
            )))
        })
}

/// The outbox store on a PostgreSQL pool. Every method is one autocommit
/// statement: no transaction is ever held open across broker I/O.
///
/// The drainer's hot path (the key window, the claim, the mark of
/// published rows, the release) runs on sessions of its own, at most
/// [`DRAIN_SESSIONS`], opened lazily from the pool's connect options and
/// named after the pool's `application_name` with
/// [`DRAIN_APPLICATION_SUFFIX`] (`pg_stat_activity` shows them), with
/// the settings of [`DRAIN_SESSION_SETTINGS`] given at connect: the claim's
/// planner settings, so each of its statements is one round trip with no
/// transaction around it, and `synchronous_commit = off`, so none of its
/// commits waits for a WAL flush. A claim, a mark or a release that a
/// database crash loses before the WAL writer flushed it (within
/// `3 × wal_writer_delay`, 600 ms by default) only means a lease that
/// expires or an event republished, which the consumer's inbox absorbs:
/// nothing committed by a service is lost, and the at-least-once contract
/// holds. What must survive a crash stays synchronous on the caller's pool:
/// a row-culpable failure's attempt and its parking, the operator's unpark
/// and skip, the janitor.
#[derive(Debug, Clone)]
pub struct PgOutboxStore {
    pool: PgPool,
    /// The drainer's own sessions, made on first use (a pool needs a
    /// runtime to exist; the store does not), shared by clones.
    drain: Arc<OnceLock<nodes::Derived>>,
}

/// Most sessions the drainer's hot path opens (a claim, a mark and a
/// release can overlap: the drainer pipelines its batches).
pub const DRAIN_SESSIONS: u32 = 3;

/// What the drainer's own sessions add to the pool's `application_name`
/// (the whole name if the pool has none).
pub const DRAIN_APPLICATION_SUFFIX: &str = "canopy-outbox-drainer";

/// The settings the drainer's own sessions are opened with (PostgreSQL's
/// `options` startup parameter). The planner settings: a queue table churns
/// faster than autoanalyze, and with statistics taken while the backlog was
/// empty the planner estimates one candidate row and picks a bitmap scan
/// plus a sort of the whole backlog (measured: 50-80 ms per claim at 100k
/// pending rows, growing with the backlog); these leave it only the ordered
/// index walks, which stop after one batch (incremental sorts too: with
/// them the planner walked `event_outbox_unpublished_idx` and sorted each
/// run of equal `enqueued_at`, and a transaction's rows share it, so a
/// claim of 100 read all 1 000 rows of a `publish_many_tx` batch), and JIT
/// off (the disabled sort
/// inflates cost estimates past `jit_above_cost`, and JIT compilation took
/// 30-40 ms of a key window that runs in 0.1 ms). `synchronous_commit = off`:
/// see [`PgOutboxStore`]. `idle_in_transaction_session_timeout`: no
/// statement of the drainer opens a transaction; should one ever be left
/// open, its locks would hide rows from every claim (`SKIP LOCKED`).
pub const DRAIN_SESSION_SETTINGS: &[(&str, &str)] = &[
    ("synchronous_commit", "off"),
    ("enable_seqscan", "off"),
    ("enable_bitmapscan", "off"),
    ("enable_sort", "off"),
    ("enable_incremental_sort", "off"),
    ("jit", "off"),
    ("plan_cache_mode", "force_generic_plan"),
    ("idle_in_transaction_session_timeout", "10s"),
];

/// The drainer's sessions' connect options: the pool's, with its
/// application name and session settings.
fn drain_options(options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
    let name = match options.get_application_name() {
        Some(app) if !app.is_empty() => format!("{app} {DRAIN_APPLICATION_SUFFIX}"),
        _ => DRAIN_APPLICATION_SUFFIX.to_owned(),
    };
    options
        .application_name(&name)
        .options(DRAIN_SESSION_SETTINGS.iter().copied())
}

impl PgOutboxStore {
    /// Wraps a pool. The `event_outbox` migrations must have been applied
    /// (see [`crate::migrate`]). The drainer's own sessions (see the type's
    /// docs) connect with the pool's options when first needed.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            drain: Arc::default(),
        }
    }

    /// The drainer's own sessions (see the type's docs), from the pool's
    /// connect options; made on first use, connecting lazily.
    fn drain(&self) -> &PgPool {
        self.drain
            .get_or_init(|| {
                nodes::Derived::new(
                    &self.pool,
                    drain_options,
                    sqlx::postgres::PgPoolOptions::new()
                        .max_connections(DRAIN_SESSIONS)
                        .min_connections(0)
                        .acquire_timeout(STORE_CALL_TIMEOUT)
                        // No ping before each statement (a round trip the
                        // server pays for): a dead session fails its
                        // statement, which the drainer treats as any store
                        // error (release, back off, retry).
                        .test_before_acquire(false),
                )
            })
            .pool()
    }

    /// The pool it uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs one of the `claimed_by`-guarded bulk updates (`$1` replica id,
    /// `$2` row ids) and returns how many rows it changed.
    async fn guarded_update(
        &self,
        statement: &'static str,
        replica_id: &str,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        bounded(async {
            let done = sqlx::query(statement)
                .bind(replica_id)
                .bind(ids)
                .execute(self.drain())
                .await
                .map_err(map_err)?;
            Ok(done.rows_affected())
        })
        .await
    }
}

/// Runs one of the retention janitors' bounded DELETEs (`$1` age in
/// seconds, `$2` limit) and returns how many rows it deleted.
pub(crate) async fn delete_expired(
    pool: &PgPool,
    statement: &'static str,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    bounded(async {
        let done = sqlx::query(statement)
            .bind(older_than.as_secs_f64())
            .bind(i64::from(limit))
            .execute(pool)
            .await
            .map_err(map_err)?;
        Ok(done.rows_affected())
    })
    .await
}

/// Where the primary's WAL and the named standbys stand (the durability
/// gates), read on `pool`.
pub(crate) async fn replication_positions(
    pool: &PgPool,
    standbys: &[String],
) -> Result<ReplicationPositions, StoreError> {
    fn lsn(text: Option<String>) -> Result<Option<WalPosition>, StoreError> {
        text.map(|t| {
            t.parse::<u64>()
                .map(WalPosition)
                .map_err(|_| StoreError::Statement(format!("a WAL position that is not one: {t}")))
        })
        .transpose()
    }
    let rows: Vec<(Option<String>, i64, i64, Option<String>)> = bounded(async {
        sqlx::query_as(sql::REPLICATION_POSITIONS)
            .bind(standbys)
            .fetch_all(pool)
            .await
            .map_err(map_err)
    })
    .await?;
    let mut positions = ReplicationPositions {
        flushed: WalPosition::default(),
        timeline: 0,
        standbys: Vec::with_capacity(rows.len()),
    };
    for (flushed, timeline, streams, standby) in rows {
        positions.flushed = lsn(flushed)?.unwrap_or_default();
        positions.timeline = timeline as u32;
        positions.standbys.push(match (streams, lsn(standby)?) {
            (0, _) => StandbyFlush::Absent,
            (_, None) => StandbyFlush::Hidden,
            (_, Some(at)) => StandbyFlush::At(at),
        });
    }
    Ok(positions)
}

impl Replication for PgOutboxStore {
    async fn replication_positions(
        &self,
        standbys: &[String],
    ) -> Result<ReplicationPositions, StoreError> {
        replication_positions(self.drain(), standbys).await
    }
}

/// A handler's `?` on a SQL error: the PostgreSQL adapter says whether it is
/// infrastructure trouble (no attempt counted) or the handler's own fault.
impl From<sqlx::Error> for crate::error::HandlerError {
    fn from(e: sqlx::Error) -> Self {
        let unavailable = map_err_ref(&e).is_unavailable();
        Self::with_source(e, unavailable)
    }
}

/// Maps a sqlx error to a store error: connection-level failures are
/// `Unavailable`; a database error is classified by its SQLSTATE
/// ([`StoreError::from_sqlstate`]); anything else is `Statement`. sqlx error
/// texts do not include connection URLs.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    map_err_ref(&e)
}

/// [`map_err`] for a borrowed error (a handler's own `?`).
pub(crate) fn map_err_ref(e: &sqlx::Error) -> StoreError {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => StoreError::from_sqlstate(&code, e.to_string()),
            None => StoreError::Statement(e.to_string()),
        },
        other => StoreError::Statement(other.to_string()),
    }
}

impl OutboxStore for PgOutboxStore {
    async fn outbox_key_window(
        &self,
        after: &str,
        limit: u32,
        lease_ttl: Duration,
    ) -> Result<KeyWindow, StoreError> {
        bounded(async {
            // With the claim's planner settings: a recursive statement's
            // cost estimate passes jit_above_cost, and JIT compilation took
            // 30-40 ms of a window that runs in 0.1 ms (measured with the
            // harness: claims of 100 unkeyed rows went from 3 to 31 ms).
            let query = sqlx::query(sql::KEY_WINDOW)
                .bind(after)
                .bind(i32::try_from(limit).unwrap_or(i32::MAX))
                .bind(lease_ttl.as_secs_f64());
            let heads = self
                .fetch_planned(query)
                .await?
                .into_iter()
                .map(|r| {
                    Ok(KeyHead {
                        key: r.try_get("ordering_key").map_err(map_err)?,
                        id: r.try_get("id").map_err(map_err)?,
                        claimable: r.try_get("claimable").map_err(map_err)?,
                    })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            Ok(KeyWindow {
                exhausted: heads.len() < limit as usize,
                heads,
            })
        })
        .await
    }

    async fn outbox_claim(&self, p: ClaimParams<'_>) -> Result<Vec<ClaimedRow>, StoreError> {
        bounded(async {
            let statement = match p.after {
                None => sql::CLAIM,
                Some(_) => sql::CLAIM_AFTER.as_str(),
            };
            let mut query = sqlx::query(statement)
                .bind(p.replica_id)
                .bind(p.lease_ttl.as_secs_f64())
                .bind(i64::from(p.batch_size))
                .bind(p.key_heads);
            if let Some(after) = p.after {
                query = query.bind(after.enqueued_at_micros).bind(after.id);
            }
            self.fetch_planned(query)
                .await?
                .into_iter()
                .map(|r| {
                    let id = r.try_get("id").map_err(map_err)?;
                    Ok(ClaimedRow {
                        id,
                        routing_key: r.try_get("routing_key").map_err(map_err)?,
                        body: r
                            .try_get::<String, _>("body")
                            .map_err(map_err)?
                            .into_bytes(),
                        attempts: r.try_get("attempts").map_err(map_err)?,
                        trace: r
                            .try_get::<Option<String>, _>("traceparent")
                            .map_err(map_err)?
                            .and_then(|tp| {
                                let ts: Option<String> = r.try_get("tracestate").ok()?;
                                TraceContext::parse(&tp, ts.as_deref()).ok()
                            }),
                        age: Duration::try_from_secs_f64(
                            r.try_get::<f64, _>("age_secs").map_err(map_err)?,
                        )
                        .unwrap_or_default(),
                        ordering: key_seq(&r)?,
                        position: r
                            .try_get::<Option<i64>, _>("enqueued_us")
                            .map_err(map_err)?
                            .map(|enqueued_at_micros| ClaimPosition {
                                enqueued_at_micros,
                                id,
                            }),
                    })
                })
                .collect()
        })
        .await
    }

    async fn outbox_mark_published(
        &self,
        replica_id: &str,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        self.guarded_update(sql::MARK_PUBLISHED, replica_id, ids)
            .await
    }

    async fn outbox_mark_failed(
        &self,
        replica_id: &str,
        failures: &[RowFailure],
        max_attempts: u32,
    ) -> Result<FailOutcome, StoreError> {
        bounded(async {
            let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
            let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
            let parked: Vec<bool> = sqlx::query_scalar(sql::MARK_FAILED)
                .bind(replica_id)
                .bind(&ids)
                .bind(&errors)
                .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
                .fetch_all(&self.pool)
                .await
                .map_err(map_err)?;
            Ok(FailOutcome {
                recorded: parked.len() as u64,
                parked: parked.iter().filter(|p| **p).count() as u64,
            })
        })
        .await
    }

    async fn outbox_release(&self, replica_id: &str, ids: &[Uuid]) -> Result<u64, StoreError> {
        self.guarded_update(sql::RELEASE, replica_id, ids).await
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        bounded(async {
            let row = sqlx::query(sql::STATS)
                .fetch_one(&self.pool)
                .await
                .map_err(map_err)?;
            let pending: i64 = row.try_get("pending").map_err(map_err)?;
            let parked: i64 = row.try_get("parked").map_err(map_err)?;
            let oldest: f64 = row.try_get("oldest_age_secs").map_err(map_err)?;
            let blocked: i64 = row.try_get("blocked").map_err(map_err)?;
            Ok(OutboxStats {
                pending: pending.max(0) as u64,
                oldest_unpublished_age_secs: oldest.max(0.0),
                parked: parked.max(0) as u64,
                blocked: blocked.max(0) as u64,
            })
        })
        .await
    }

    async fn outbox_delete_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        match partitions::delete_expired(&self.pool, partitions::OUTBOX, older_than, limit).await? {
            Some(deleted) => Ok(deleted),
            None => delete_expired(&self.pool, sql::DELETE_PUBLISHED, older_than, limit).await,
        }
    }

    async fn outbox_retire_partitions(
        &self,
        older_than: Duration,
    ) -> Result<PartitionsRetired, StoreError> {
        partitions::retire(&self.pool, partitions::OUTBOX, older_than).await
    }

    async fn outbox_list_parked(&self, f: &ParkedFilter) -> Result<Vec<ParkedRow>, StoreError> {
        bounded(async {
            let field = f.payload_field.as_ref();
            let rows = sqlx::query(sql::LIST_PARKED)
                .bind(i64::from(f.limit))
                .bind(f.after.map(|c| c.parked_at))
                .bind(f.after.map(|c| c.id))
                .bind(f.ids.as_deref())
                .bind(f.omit_envelope)
                .bind(field.map(|p| p.path.clone()))
                .bind(field.map(|p| p.value.clone()))
                .bind(field.and_then(PayloadField::value_json))
                .fetch_all(&self.pool)
                .await
                .map_err(map_err)?;
            rows.into_iter()
                .map(|r| {
                    Ok(ParkedRow {
                        id: r.try_get("id").map_err(map_err)?,
                        routing_key: r.try_get("routing_key").map_err(map_err)?,
                        attempts: r.try_get("attempts").map_err(map_err)?,
                        last_error: r.try_get("last_error").map_err(map_err)?,
                        enqueued_at: r.try_get("enqueued_at").map_err(map_err)?,
                        parked_at: r.try_get("parked_at").map_err(map_err)?,
                        ordering: key_seq(&r)?,
                        envelope: r.try_get("envelope").map_err(map_err)?,
                    })
                })
                .collect()
        })
        .await
    }

    async fn outbox_unpark(&self, selector: &UnparkSelector) -> Result<u64, StoreError> {
        self.parked_update(sql::UNPARK, selector).await
    }

    async fn outbox_skip(&self, selector: &UnparkSelector) -> Result<u64, StoreError> {
        self.parked_update(sql::SKIP, selector).await
    }
}

/// The row's ordering key and number, if it has a key.
fn key_seq(r: &sqlx::postgres::PgRow) -> Result<Option<KeySeq>, StoreError> {
    let key: Option<String> = r.try_get("ordering_key").map_err(map_err)?;
    let seq: Option<i64> = r.try_get("key_seq").map_err(map_err)?;
    Ok(key.zip(seq).map(|(key, seq)| KeySeq { key, seq }))
}

impl PgOutboxStore {
    /// Runs `query` on the drainer's own sessions, whose settings give it
    /// the claim's plans (see [`DRAIN_SESSION_SETTINGS`]).
    async fn fetch_planned(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<sqlx::postgres::PgRow>, StoreError> {
        query.fetch_all(self.drain()).await.map_err(map_err)
    }

    /// An operator's update of the selected parked rows (`$1`: their ids,
    /// or NULL for all); returns how many it changed.
    async fn parked_update(
        &self,
        statement: &'static str,
        selector: &UnparkSelector,
    ) -> Result<u64, StoreError> {
        bounded(async {
            let ids: Option<&[Uuid]> = match selector {
                UnparkSelector::Ids(ids) => Some(ids),
                UnparkSelector::All => None,
            };
            let done = sqlx::query(statement)
                .bind(ids)
                .execute(&self.pool)
                .await
                .map_err(map_err)?;
            Ok(done.rows_affected())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_insert_notifies_the_channel_the_drainer_listens_on() {
        for statement in [
            sql::INSERT,
            sql::INSERT_MANY,
            sql::INSERT_KEYED,
            sql::INSERT_MANY_KEYED,
        ] {
            assert!(
                statement.contains(&format!("pg_notify('{WAKEUP_CHANNEL}'")),
                "{statement}"
            );
        }
    }
}
