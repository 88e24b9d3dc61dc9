//! The partitioned layout's retention: `event_outbox` and
//! `event_inbox` partitioned by RANGE of their UUID v7 ids, whose first 48
//! bits are milliseconds since the epoch, one partition per width
//! (`event_partitioning`, written by `migrations-partitioned/`).
//!
//! A partition is *closed* once its range has passed (its upper bound is
//! before the database's `now()`), and *held* while it holds an
//! unfinished row (unpublished; unprocessed). The janitor's pass creates
//! the partitions of the widths ahead and drops each closed partition that
//! is not held and whose newest finished row is past retention; the row
//! sweep deletes expired rows only where no drop will: open and held
//! partitions, and the DEFAULT one. A drop locks the parent, then checks
//! and drops under that lock, so no row can enter or change in between.
//! Names and bounds come from the catalog; every identifier put into a
//! statement is quoted.

use std::time::Duration;

use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::{bounded, map_err};
use crate::core::ports::PartitionsRetired;
use crate::error::StoreError;

/// One partitioned table: its name and what "finished" means for a row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Table {
    pub parent: &'static str,
    /// The column a finished row has set (and the retention counts from).
    pub done: &'static str,
    /// The columns a row is deleted by.
    pub key: &'static str,
    /// The column the table is partitioned by (a UUID v7).
    pub range: &'static str,
}

pub(crate) const OUTBOX: Table = Table {
    parent: "event_outbox",
    done: "published_at",
    key: "id",
    range: "id",
};

pub(crate) const INBOX: Table = Table {
    parent: "event_inbox",
    done: "processed_at",
    key: "subscription, event_id",
    range: "event_id",
};

/// How long a drop or a create waits for the parent's lock before it gives
/// up until the next pass (a long transaction on the table must not queue
/// every writer behind the janitor).
const LOCK_TIMEOUT: &str = "500ms";

/// One partition as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Partition {
    name: String,
    /// Its range in ms (`None`: MINVALUE / MAXVALUE), or the DEFAULT one.
    range: Option<(Option<u64>, Option<u64>)>,
}

/// The layout's settings, when `table` is partitioned.
struct Settings {
    width_ms: u64,
    ahead: u64,
}

async fn settings(pool: &PgPool, table: Table) -> Result<Option<Settings>, StoreError> {
    let row = sqlx::query(
        "SELECT (SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)) AS partitioned, \
         to_regclass('event_partitioning') IS NOT NULL AS planned",
    )
    .bind(table.parent)
    .fetch_one(pool)
    .await
    .map_err(map_err)?;
    let partitioned: Option<bool> = row.try_get("partitioned").map_err(map_err)?;
    let planned: bool = row.try_get("planned").map_err(map_err)?;
    if partitioned != Some(true) || !planned {
        return Ok(None);
    }
    let row = sqlx::query("SELECT width_secs, ahead FROM event_partitioning WHERE parent = $1")
        .bind(table.parent)
        .fetch_one(pool)
        .await
        .map_err(map_err)?;
    let width: i64 = row.try_get("width_secs").map_err(map_err)?;
    let ahead: i32 = row.try_get("ahead").map_err(map_err)?;
    Ok(Some(Settings {
        width_ms: width.max(1) as u64 * 1000,
        ahead: ahead.max(1) as u64,
    }))
}

/// The database's clock in ms since the epoch (the partitions' axis).
async fn db_now_ms(pool: &PgPool) -> Result<u64, StoreError> {
    let ms: i64 = sqlx::query_scalar("SELECT floor(extract(epoch FROM now()) * 1000)::BIGINT")
        .fetch_one(pool)
        .await
        .map_err(map_err)?;
    Ok(ms.max(0) as u64)
}

async fn partitions(pool: &PgPool, table: Table) -> Result<Vec<Partition>, StoreError> {
    let rows = sqlx::query(
        "SELECT c.relname::TEXT AS name, pg_get_expr(c.relpartbound, c.oid) AS bound \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass($1)",
    )
    .bind(table.parent)
    .fetch_all(pool)
    .await
    .map_err(map_err)?;
    let mut parts = Vec::with_capacity(rows.len());
    for r in rows {
        let name: String = r.try_get("name").map_err(map_err)?;
        let bound: String = r.try_get("bound").map_err(map_err)?;
        let range = parse_bound(&bound).ok_or_else(|| {
            StoreError::Statement(format!(
                "partition {name} has a bound I cannot read: {bound}"
            ))
        })?;
        parts.push(Partition { name, range });
    }
    parts.sort_by_key(|p| p.range.map(|(lo, _)| lo.unwrap_or(0)).unwrap_or(u64::MAX));
    Ok(parts)
}

/// `FOR VALUES FROM ('…') TO ('…')` (either may be MINVALUE / MAXVALUE)
/// or `DEFAULT`, as `pg_get_expr` renders a range partition's bound.
fn parse_bound(bound: &str) -> Option<Option<(Option<u64>, Option<u64>)>> {
    if bound.trim() == "DEFAULT" {
        return Some(None);
    }
    let rest = bound.trim().strip_prefix("FOR VALUES FROM (")?;
    let (lo, hi) = rest.split_once(") TO (")?;
    let hi = hi.strip_suffix(')')?;
    let value = |v: &str| -> Option<Option<u64>> {
        match v {
            "MINVALUE" | "MAXVALUE" => Some(None),
            quoted => {
                let id = Uuid::parse_str(quoted.strip_prefix('\'')?.strip_suffix('\'')?).ok()?;
                Some(Some(ms_of(id)))
            }
        }
    };
    Some(Some((value(lo)?, value(hi)?)))
}

/// The first 48 bits of a UUID v7: its writer's clock in ms.
pub fn ms_of(id: Uuid) -> u64 {
    (id.as_u128() >> 80) as u64
}

/// The least UUID at `ms` (a partition bound).
pub fn bound_at(ms: u64) -> Uuid {
    Uuid::from_u128(u128::from(ms) << 80)
}

/// A partition's name: the parent, `_p`, and its start in UTC
/// (`event_outbox_p20261204t000000`), as the migrations name them.
pub fn partition_name(parent: &str, lo_ms: u64) -> String {
    let at = time::OffsetDateTime::UNIX_EPOCH + Duration::from_millis(lo_ms);
    format!(
        "{parent}_p{:04}{:02}{:02}t{:02}{:02}{:02}",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    )
}

/// A statement built here: every identifier in it is quoted ([`ident`])
/// or a constant, every value a bind parameter or computed here.
fn safe(statement: String) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(statement)
}

/// A quoted identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn closed(p: &Partition, now_ms: u64) -> bool {
    matches!(p.range, Some((_, Some(hi))) if hi <= now_ms)
}

/// Whether partition `name` holds an unfinished row.
async fn held(pool: &PgPool, table: Table, name: &str) -> Result<bool, StoreError> {
    sqlx::query_scalar(safe(format!(
        "SELECT EXISTS (SELECT 1 FROM ONLY {} WHERE {} IS NULL)",
        ident(name),
        table.done
    )))
    .fetch_one(pool)
    .await
    .map_err(map_err)
}

/// One pass: create ahead, drop what is due. See the module's doc.
pub(crate) async fn retire(
    pool: &PgPool,
    table: Table,
    older_than: Duration,
) -> Result<PartitionsRetired, StoreError> {
    bounded(async {
        let Some(settings) = settings(pool, table).await? else {
            return Ok(PartitionsRetired::default());
        };
        let now_ms = db_now_ms(pool).await?;
        let parts = partitions(pool, table).await?;
        let created = create_ahead(pool, table, &settings, &parts, now_ms).await?;
        let mut dropped = Vec::new();
        for p in parts.iter().filter(|p| closed(p, now_ms)) {
            if try_drop(pool, table, &p.name, older_than).await? {
                dropped.push(p.name.clone());
            }
        }
        Ok(PartitionsRetired {
            partitioned: true,
            created,
            dropped,
        })
    })
    .await
}

/// Creates the partitions of the current width and `ahead` more that no
/// partition covers yet. A create that cannot take its lock is logged and
/// left to the next pass; rows of that range go to DEFAULT meanwhile, and
/// the create that comes takes them along ([`create_one`]).
async fn create_ahead(
    pool: &PgPool,
    table: Table,
    s: &Settings,
    parts: &[Partition],
    now_ms: u64,
) -> Result<Vec<String>, StoreError> {
    let covered = |lo: u64, hi: u64| {
        parts.iter().any(|p| match p.range {
            Some((a, b)) => a.is_none_or(|a| a < hi) && b.is_none_or(|b| b > lo),
            None => false,
        })
    };
    let default = parts
        .iter()
        .find(|p| p.range.is_none())
        .map(|p| p.name.as_str());
    let first = now_ms / s.width_ms;
    let mut created = Vec::new();
    for bucket in first..=first + s.ahead {
        let (lo, hi) = (bucket * s.width_ms, (bucket + 1) * s.width_ms);
        if covered(lo, hi) {
            continue;
        }
        let name = partition_name(table.parent, lo);
        match create_one(pool, table, &name, (lo, hi), default).await {
            Ok(()) => created.push(name),
            Err(lost @ StoreError::Unavailable(_)) => return Err(lost),
            Err(e) => {
                tracing::warn!(partition = %name, error = %e, "partition not created; the next pass tries again")
            }
        }
    }
    Ok(created)
}

/// Creates partition `name` for `[lo, hi)` in one transaction. PostgreSQL
/// refuses to create a partition while DEFAULT holds a row of its range,
/// so the rows DEFAULT holds there (ids ahead of the partitions, from a
/// writer whose clock ran fast) are moved into it as it is created: under
/// the parent's lock, nobody sees them gone or twice. Without the move one
/// such row would send its whole width to DEFAULT, to be deleted row by
/// row. (Rows are moved by delete and insert: a row trigger a user put on
/// the table sees them again.)
async fn create_one(
    pool: &PgPool,
    table: Table,
    name: &str,
    (lo, hi): (u64, u64),
    default: Option<&str>,
) -> Result<(), StoreError> {
    let fill = if table.parent == OUTBOX.parent {
        " WITH (fillfactor = 50)"
    } else {
        ""
    };
    let range = format!(
        "{col} >= '{}' AND {col} < '{}'",
        bound_at(lo),
        bound_at(hi),
        col = table.range
    );
    let mut tx = pool.begin().await.map_err(map_err)?;
    let mut steps = vec![
        format!("SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"),
        format!("LOCK TABLE ONLY {} IN ACCESS EXCLUSIVE MODE", table.parent),
    ];
    if let Some(default) = default {
        steps.push(format!(
            "CREATE TEMP TABLE canopy_partition_move ON COMMIT DROP AS \
             SELECT * FROM ONLY {d} WHERE {range}",
            d = ident(default)
        ));
        steps.push(format!("DELETE FROM ONLY {} WHERE {range}", ident(default)));
    }
    steps.push(format!(
        "CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ('{}') TO ('{}'){fill}",
        ident(name),
        table.parent,
        bound_at(lo),
        bound_at(hi)
    ));
    if default.is_some() {
        steps.push(format!(
            "INSERT INTO {} SELECT * FROM canopy_partition_move",
            ident(name)
        ));
    }
    for step in steps {
        sqlx::query(safe(step))
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
    }
    tx.commit().await.map_err(map_err)
}

/// Drops partition `name` if, under the parent's lock, no row in it is
/// unfinished and its newest finished row is older than `older_than`.
/// Returns whether it did; a lock not had in time is "not now".
async fn try_drop(
    pool: &PgPool,
    table: Table,
    name: &str,
    older_than: Duration,
) -> Result<bool, StoreError> {
    // Most closed partitions are not due (a row holds them, or their newest
    // is within retention): asked first without the lock, so that only a
    // partition about to go makes writers wait behind the parent's lock.
    if !due(pool, table, name, older_than).await? {
        return Ok(false);
    }
    let mut tx = pool.begin().await.map_err(map_err)?;
    sqlx::query(safe(format!("SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")))
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    let lock = format!("LOCK TABLE ONLY {} IN ACCESS EXCLUSIVE MODE", table.parent);
    if let Err(e) = sqlx::query(safe(lock)).execute(&mut *tx).await {
        tracing::info!(partition = name, error = %map_err(e), "partition drop put off: the table is busy");
        return Ok(false);
    }
    // Again under the lock: a late row may have entered it meanwhile.
    if !due(&mut *tx, table, name, older_than).await? {
        return Ok(false);
    }
    sqlx::query(safe(format!("DROP TABLE {}", ident(name))))
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    tx.commit().await.map_err(map_err)?;
    Ok(true)
}

/// Whether partition `name` holds no unfinished row and its newest
/// finished row was finished more than `older_than` ago (an empty one is).
async fn due<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    table: Table,
    name: &str,
    older_than: Duration,
) -> Result<bool, StoreError> {
    sqlx::query_scalar(safe(format!(
        "SELECT NOT EXISTS (SELECT 1 FROM ONLY {p} WHERE {done} IS NULL) \
         AND coalesce((SELECT max({done}) FROM ONLY {p}) < now() - make_interval(secs => $1), true)",
        p = ident(name),
        done = table.done
    )))
    .bind(older_than.as_secs_f64())
    .fetch_one(executor)
    .await
    .map_err(map_err)
}

/// The row sweep on the partitioned layout, or `None` on the plain one:
/// at most `limit` expired rows, oldest partition first, from the
/// partitions no drop will take whole.
pub(crate) async fn delete_expired(
    pool: &PgPool,
    table: Table,
    older_than: Duration,
    limit: u32,
) -> Result<Option<u64>, StoreError> {
    bounded(async {
        if settings(pool, table).await?.is_none() {
            return Ok(None);
        }
        let now_ms = db_now_ms(pool).await?;
        let mut deleted = 0u64;
        for p in partitions(pool, table).await? {
            if deleted >= u64::from(limit) {
                break;
            }
            if closed(&p, now_ms) && !held(pool, table, &p.name).await? {
                continue;
            }
            let statement = format!(
                "DELETE FROM ONLY {p} WHERE ({key}) IN ( \
                 SELECT {key} FROM ONLY {p} \
                 WHERE {done} IS NOT NULL AND {done} < now() - make_interval(secs => $1) \
                 ORDER BY {done} LIMIT $2)",
                p = ident(&p.name),
                key = table.key,
                done = table.done
            );
            let done = sqlx::query(safe(statement))
                .bind(older_than.as_secs_f64())
                .bind((u64::from(limit) - deleted) as i64)
                .execute(pool)
                .await
                .map_err(map_err)?;
            deleted += done.rows_affected();
        }
        Ok(Some(deleted))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_read_as_pg_get_expr_renders_them() {
        let lo = bound_at(1_700_000_000_000);
        let hi = bound_at(1_700_086_400_000);
        assert_eq!(
            parse_bound(&format!("FOR VALUES FROM ('{lo}') TO ('{hi}')")),
            Some(Some((Some(1_700_000_000_000), Some(1_700_086_400_000))))
        );
        assert_eq!(
            parse_bound(&format!("FOR VALUES FROM (MINVALUE) TO ('{hi}')")),
            Some(Some((None, Some(1_700_086_400_000))))
        );
        assert_eq!(parse_bound("DEFAULT"), Some(None));
        assert_eq!(parse_bound("FOR VALUES IN (1)"), None);
    }

    #[test]
    fn a_v7_id_lies_in_the_partition_of_its_instant() {
        let id =
            uuid::Builder::from_unix_timestamp_millis(1_700_000_123_456, &[0xff; 10]).into_uuid();
        assert_eq!(ms_of(id), 1_700_000_123_456);
        assert!(bound_at(1_700_000_123_456) <= id && id < bound_at(1_700_000_123_457));
        assert_eq!(
            partition_name("event_outbox", 1_764_806_400_000),
            "event_outbox_p20251204t000000"
        );
    }
}
