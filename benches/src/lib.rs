//! Criterion benches and the side-by-side throughput/latency harness live in
//! this crate; see ARCHITECTURE.md ("Performance"). This library holds what
//! the harness and the database benches share.

pub mod chaos;
pub mod dbcost;

/// The error of the set-up helpers (sendable, for the chaos runner's tasks).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

use outbox::EventEnvelope;
use outbox::amqp::redact_url;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

/// A payload like the services': ~200 bytes of JSON once enveloped.
pub fn envelope(i: usize) -> EventEnvelope {
    EventEnvelope::new(
        "harness.order.created",
        serde_json::json!({ "order_id": i, "customer": "c-4711", "total_cents": 12_345, "currency": "EUR" }),
    )
}

/// Drops and recreates database `name` (lower-case letters and `_` only)
/// on the server `admin_url` points at, migrates it, adds an `orders` table
/// for the domain side of a transaction, and returns a pool of
/// `max_connections` on it.
pub async fn fresh_database(
    admin_url: &str,
    name: &str,
    max_connections: u32,
) -> Result<PgPool, Box<dyn std::error::Error>> {
    let pool = recreate_database(admin_url, name, max_connections)
        .await
        .map_err(|e| -> Box<dyn std::error::Error> { e })?;
    pool.execute("CREATE TABLE orders (id BIGINT NOT NULL, note TEXT NOT NULL)")
        .await?;
    Ok(pool)
}

/// Drops and recreates database `name` (lower-case letters and `_` only)
/// on the server `admin_url` points at, migrates it (the outbox and the
/// inbox), and returns a pool of `max_connections` on it.
pub async fn recreate_database(
    admin_url: &str,
    name: &str,
    max_connections: u32,
) -> Result<PgPool, BoxError> {
    drop_database(admin_url, name).await?;
    let admin = admin_pool(admin_url).await?;
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await?;
    admin.close().await;
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(&database_url(admin_url, name)?)
        .await?;
    outbox::migrate::run(&pool).await?;
    Ok(pool)
}

/// Drops database `name` (lower-case letters and `_` only) if it exists,
/// ending its sessions.
pub async fn drop_database(admin_url: &str, name: &str) -> Result<(), BoxError> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
        return Err(format!("database name {name:?}: lower-case letters and _ only").into());
    }
    let admin = admin_pool(admin_url).await?;
    // The name was checked above: only letters and underscores.
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .await?;
    admin.close().await;
    Ok(())
}

/// `admin_url` with its database part replaced by `name`.
pub fn database_url(admin_url: &str, name: &str) -> Result<String, BoxError> {
    match admin_url.rsplit_once('/') {
        Some((base, _)) => Ok(format!("{base}/{name}")),
        None => Err("DATABASE_URL has no database part".into()),
    }
}

async fn admin_pool(admin_url: &str) -> Result<PgPool, BoxError> {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(admin_url)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", redact_url(admin_url)).into())
}

/// Fills the outbox with `n` rows through `publish_many_tx` (1 000 per
/// transaction), then `VACUUM ANALYZE`s it.
pub async fn prefill(pool: &PgPool, n: usize) -> Result<(), Box<dyn std::error::Error>> {
    prefill_keyed(pool, n, None).await
}

/// As [`prefill`], row `i` with the ordering key `key-{i mod keys}` when
/// `keys` is given (so every key's events interleave).
pub async fn prefill_keyed(
    pool: &PgPool,
    n: usize,
    keys: Option<u32>,
) -> Result<(), Box<dyn std::error::Error>> {
    let publisher = outbox::Publisher::new(pool.clone());
    let keyed = |i: usize| match keys {
        Some(k) => envelope(i).with_ordering_key(format!("key-{}", i % k as usize)),
        None => envelope(i),
    };
    let mut i = 0;
    while i < n {
        let batch: Vec<EventEnvelope> = (i..(i + 1000).min(n)).map(keyed).collect();
        let mut tx = pool.begin().await?;
        publisher.publish_many_tx(&mut tx, &batch).await?;
        tx.commit().await?;
        i += batch.len();
    }
    pool.execute("VACUUM ANALYZE event_outbox").await?;
    Ok(())
}

/// The drainer's Phase 1 and Phase 3 without the broker: claims up to 100
/// rows for `replica` (60 s lease) and marks them published. Returns the
/// claimed ids and how many rows the mark changed.
pub async fn claim_and_mark(
    store: &outbox::PgOutboxStore,
    replica: &str,
) -> Result<(Vec<uuid::Uuid>, u64), outbox::StoreError> {
    let (rows, marked) = claim_and_mark_after(store, replica, None).await?;
    Ok((rows.into_iter().map(|r| r.id).collect(), marked))
}

/// As [`claim_and_mark`], the claim walking unkeyed rows only past `after`
/// (`ClaimParams::after`); returns the claimed rows (for a
/// [`Walk`](outbox::core::drainer::Walk) to take in) and how many rows the
/// mark changed.
pub async fn claim_and_mark_after(
    store: &outbox::PgOutboxStore,
    replica: &str,
    after: Option<outbox::core::ports::ClaimPosition>,
) -> Result<(Vec<outbox::core::ports::ClaimedRow>, u64), outbox::StoreError> {
    use outbox::core::ports::{ClaimParams, OutboxStore};
    let claimed = store
        .outbox_claim(ClaimParams {
            replica_id: replica,
            batch_size: CLAIM_BATCH,
            lease_ttl: std::time::Duration::from_secs(60),
            key_heads: &[],
            after,
        })
        .await?;
    let ids: Vec<uuid::Uuid> = claimed.iter().map(|r| r.id).collect();
    let marked = store.outbox_mark_published(replica, &ids).await?;
    Ok((claimed, marked))
}

/// The batch [`claim_and_mark`] claims.
pub const CLAIM_BATCH: u32 = 100;

/// Declares a durable topic exchange and a durable queue of `queue_type`
/// bound to all of it (`#`): the chaos run's observer and the harness's
/// sink.
pub async fn declare_catch_all(
    ch: &lapin::Channel,
    exchange: &str,
    queue: &str,
    queue_type: outbox::QueueType,
) -> Result<(), lapin::Error> {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(queue_type.as_str().into()),
    );
    ch.exchange_declare(
        exchange.into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
}
