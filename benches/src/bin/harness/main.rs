//! The side-by-side performance harness (issue 5): measures, in one run on
//! the local PostgreSQL and RabbitMQ, the physical ceiling and the library
//! against it, and prints a table plus a JSON file. Goals are ratios against
//! baselines measured in the same run, never absolute times.
//!
//! ```text
//! cargo run --release -p benches --bin harness -- [--rows 100000] [--json target/harness.json]
//! ```
//!
//! Measured so far:
//! - **ceiling**: raw lapin publish + confirm at the drainer's pipeline depth
//!   (32), persistent, same exchange setup and payloads;
//! - **P1 drain rate**: the production drainer (`DrainerHandle`, default
//!   configuration) draining a pre-filled backlog, 1 and 2 replicas;
//! - **P3 database cost** (`p3.rs`): CPU of the drainer's backends, WAL
//!   bytes and WAL flushes per event drained, against the pre-#478
//!   antipattern; a steady foreground's latency as information;
//! - **P4 publish cost**: a domain transaction alone, with `publish_tx` of 1
//!   envelope, with `publish_many_tx` of 100 (p50 / p99 latency);
//! - **P5 end-to-end latency**: commit → marked published (which follows
//!   the broker's confirm) at a steady 100 events/s;
//! - **P7 consume**: raw lapin consume + ack at the subscriber's prefetch
//!   (the ceiling), then the production `Subscriber` at defaults over fresh
//!   events, with 25 % duplicates, and with batches of one;
//! - **P8 WAL**: bytes of WAL per event drained and per event applied.
//!
//! It works in a database of its own (`outbox_harness`, dropped and
//! recreated) and an exchange and queue of its own (`harness.*`, purged and
//! deleted at the end).

mod failover;
mod foreground;
mod gates;
mod p10;
mod p3;
mod sections;

use std::time::{Duration, Instant};

use benches::{claim_and_mark, envelope, fresh_database, prefill};
use clap::Parser;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use outbox::{DrainerConfig, DrainerHandle, EventEnvelope, LapinBroker, Publisher, QueueType};
use sqlx::{Executor, PgPool};

const EXCHANGE: &str = "harness.events";
const QUEUE: &str = "harness.sink";
/// The harness's own database (dropped and recreated).
const DATABASE: &str = "outbox_harness";
/// The drainer's default pipeline depth, used for the ceiling.
const DEPTH: usize = 32;
/// Longest wait for a drain.
const DRAIN_LIMIT: Duration = Duration::from_secs(1800);

/// The sections `--only` takes.
const SECTIONS: [&str; 14] = [
    "p1",
    "p7",
    "beside",
    "phases",
    "antipattern",
    "p2",
    "p3",
    "p4",
    "p5",
    "p9",
    "p9f",
    "p10",
    "gates",
    "failover",
];

/// Measures the drainer and the subscriber on the real services and writes
/// the performance figures (docs/internals/performance.md).
#[derive(Debug, Parser)]
#[command(name = "harness", version, about, long_about = None)]
struct Args {
    /// Rows per measured drain.
    #[arg(long, value_name = "N", default_value_t = 100_000)]
    rows: usize,
    /// Backlog of the large P2 measurement (0 skips P2).
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    p2_rows: usize,
    /// Rows per table P10 loads (it runs only when `--only` names it).
    #[arg(long, value_name = "N", default_value_t = 20_000_000)]
    p10_rows: u64,
    /// The layouts P10 measures.
    #[arg(long = "p10-layout", value_name = "L", value_enum, default_value_t = Layouts::Both)]
    p10_layout: Layouts,
    /// Where the figures go, as flat JSON keys.
    #[arg(long, value_name = "FILE", default_value = "target/harness.json")]
    json: String,
    /// Sections to run, comma-separated (all but p10 when absent). The
    /// ceiling always runs: every ratio needs it.
    #[arg(long, value_name = "SECTIONS", value_delimiter = ',', value_parser = SECTIONS)]
    only: Vec<String>,
    /// The PostgreSQL server (the harness makes its own databases).
    #[arg(
        long,
        value_name = "URL",
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        hide_env_values = true
    )]
    database_url: String,
    /// The broker's nodes, comma-separated (default: the local broker).
    #[arg(
        long,
        value_name = "URL[,URL...]",
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true,
        hide_default_value = true
    )]
    amqp_url: String,
}

/// The layouts `--p10-layout` names.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Layouts {
    Plain,
    Partitioned,
    Both,
}

impl Args {
    /// The layouts P10 measures, by name.
    fn p10_layouts(&self) -> &'static [&'static str] {
        match self.p10_layout {
            Layouts::Plain => &["plain"],
            Layouts::Partitioned => &["partitioned"],
            Layouts::Both => &["plain", "partitioned"],
        }
    }
}

fn parse_args() -> Result<Args, String> {
    let a = Args::parse();
    outbox::LapinBroker::from_list(&a.amqp_url).map_err(|e| format!("--amqp-url: {e}"))?;
    Ok(a)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn broker_topology(conn: &Connection) -> Result<(), Box<dyn std::error::Error>> {
    // A classic sink, empty, whatever an earlier run left behind.
    sink(conn, QueueType::Classic).await
}

/// Replaces the sink queue with an empty one of `kind`, bound to the
/// exchange (declared if need be) with `#`.
async fn sink(conn: &Connection, kind: QueueType) -> Result<(), Box<dyn std::error::Error>> {
    let ch = conn.create_channel().await?;
    ch.queue_delete(QUEUE.into(), QueueDeleteOptions::default())
        .await?;
    benches::declare_catch_all(&ch, EXCHANGE, QUEUE, kind).await?;
    Ok(())
}

async fn purge(conn: &Connection) -> Result<(), Box<dyn std::error::Error>> {
    let ch = conn.create_channel().await?;
    ch.queue_purge(QUEUE.into(), QueuePurgeOptions::default())
        .await?;
    Ok(())
}

/// Raw lapin publish + confirm, `DEPTH` in flight, persistent.
async fn ceiling(conn: &Connection, n: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let bodies: Vec<(uuid::Uuid, String)> = (0..n)
        .map(|i| {
            let e = envelope(i);
            (e.id, e.encode(&Default::default()).expect("valid"))
        })
        .collect();
    let started = Instant::now();
    let mut pending = std::collections::VecDeque::with_capacity(DEPTH);
    for (id, body) in &bodies {
        if pending.len() == DEPTH {
            let c: lapin::PublisherConfirm = pending.pop_front().expect("non-empty");
            c.await?;
        }
        let props = BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        pending.push_back(
            ch.basic_publish(
                EXCHANGE.into(),
                "harness.order.created".into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?,
        );
    }
    for c in pending {
        c.await?;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// The WAL position now.
async fn wal_lsn(pool: &PgPool) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await
}

/// WAL bytes written since `from` (the whole cluster's: run on a quiet
/// database).
async fn wal_since(pool: &PgPool, from: &str) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8")
        .bind(from)
        .fetch_one(pool)
        .await
}

/// What one drain of a backlog measured.
struct DrainRun {
    rows_per_sec: f64,
    /// WAL bytes written from the drainers' start to the last mark, per row.
    wal_bytes_per_row: f64,
}

/// The production drainer, default configuration, `replicas` of them.
/// P9, the drainer's half: drain rates of `n` rows over 1 000 keys and
/// (a tenth of `n`) over 10 keys, each against unkeyed rows in the same
/// run, one replica at defaults; and the writer's cost of a keyed
/// `publish_tx` against an unkeyed one. Table lines and JSON keys.
async fn p9(
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    table: &mut Vec<String>,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), Box<dyn std::error::Error>> {
    for (keys, rows) in [(1000_u32, n), (10, (n / 10).max(1000))] {
        eprintln!("P9: draining {rows} unkeyed rows, then {rows} rows over {keys} keys ...");
        benches::prefill_keyed(pool, rows, None).await?;
        let plain = drain(pool, amqp_url, rows, 1, &[]).await?.rows_per_sec;
        benches::prefill_keyed(pool, rows, Some(keys)).await?;
        let keyed = drain(pool, amqp_url, rows, 1, &[]).await?.rows_per_sec;
        let ratio = keyed / plain;
        table.push(format!(
            "| P9 keyed drain, {rows} rows over {keys} keys, 1 replica, defaults (unkeyed: {plain:.0} rows/s) | {keyed:.0} rows/s | {ratio:.2}× unkeyed | {} |",
            if keys == 1000 { "≥ 0.8×" } else { "—" }
        ));
        json.insert(format!("p9_drain_{keys}_keys_vs_unkeyed"), ratio.into());
        json.insert(format!("p9_drain_{keys}_keys_rows_per_sec"), keyed.into());
    }
    eprintln!("P9: the writer's cost of a keyed publish_tx ...");
    let [plain, keyed] = keyed_publish_cost(pool, 500).await?;
    table.push(format!(
        "| P9 domain tx + keyed publish_tx(1) against unkeyed (p50 {:.2} ms, p99 {:.2} ms) | p50 {:.2} ms, p99 {:.2} ms | {:.2}× unkeyed (p50) | — |",
        ms(plain.0),
        ms(plain.1),
        ms(keyed.0),
        ms(keyed.1),
        keyed.0.as_secs_f64() / plain.0.as_secs_f64()
    ));
    json.insert(
        "p9_publish_tx_keyed_vs_unkeyed_p50".into(),
        (keyed.0.as_secs_f64() / plain.0.as_secs_f64()).into(),
    );
    Ok(())
}

/// P9, the subscriber's half: the production subscriber working off `n`
/// keyed deliveries over 1 000 keys (and a tenth of `n`, at least 1 000,
/// over 10 keys) on an ordered subscription of 4 partitions, each against
/// `n` unkeyed deliveries on the default subscription (4 workers) in the
/// same run. Table lines and JSON keys.
async fn p9_subscriber(
    conn: &Connection,
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    table: &mut Vec<String>,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), Box<dyn std::error::Error>> {
    p7_applied_table(pool).await?;
    for (keys, rows) in [(1000_u32, n), (10, (n / 10).max(1000))] {
        eprintln!("P9: subscribing to {rows} unkeyed deliveries, then {rows} over {keys} keys ...");
        let plain = p9_consume(conn, pool, amqp_url, rows, None, 0).await?;
        let keyed = p9_consume(conn, pool, amqp_url, rows, Some(keys), 0).await?;
        let ratio = keyed / plain;
        table.push(format!(
            "| P9 ordered subscriber, {rows} deliveries over {keys} keys, 4 partitions (unordered, unkeyed: {plain:.0}/s) | {keyed:.0} deliveries/s | {ratio:.2}× unkeyed | {} |",
            if keys == 1000 { "≥ 0.8×" } else { "—" }
        ));
        json.insert(format!("p9_subscribe_{keys}_keys_vs_unkeyed"), ratio.into());
        json.insert(format!("p9_subscribe_{keys}_keys_per_sec"), keyed.into());
    }
    Ok(())
}

/// P9 with failures: the ordered subscriber (1 000 keys) and the unordered
/// one (unkeyed) over `n` deliveries, each without failures and with one
/// event in 20 failing its first attempt (the chaos run's `shipping`), in
/// the same run. What a failure costs a batch shows in the ratio.
async fn p9_failing(
    conn: &Connection,
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    table: &mut Vec<String>,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), Box<dyn std::error::Error>> {
    p7_applied_table(pool).await?;
    for (name, keys) in [("unkeyed", None), ("1000_keys", Some(1000))] {
        eprintln!("P9: {name}, {n} deliveries without failures, then one in 20 failing once ...");
        let clean = p9_consume(conn, pool, amqp_url, n, keys, 0).await?;
        let failing = p9_consume(conn, pool, amqp_url, n, keys, 20).await?;
        let ratio = failing / clean;
        table.push(format!(
            "| P9 subscriber, {n} deliveries, {name}, one in 20 failing its first attempt (none failing: {clean:.0}/s) | {failing:.0} deliveries/s | {ratio:.2}× none failing | — |"
        ));
        json.insert(format!("p9_failing_{name}_per_sec"), failing.into());
        json.insert(format!("p9_failing_{name}_vs_clean"), ratio.into());
    }
    Ok(())
}

/// One P9 subscriber run: `n` deliveries (over `keys` keys on an ordered
/// subscription of 4 partitions, or unkeyed on the default one), its
/// topology declared first and deleted after. Deliveries per second.
async fn p9_consume(
    conn: &Connection,
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    keys: Option<u32>,
    fail_one_in: u64,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut settings = p7_settings(None, None);
    if keys.is_some() {
        settings = settings.ordered(4);
    }
    let ch = conn.create_channel().await?;
    LapinBroker::declare_subscription(&ch, &settings.spec).await?;
    let envelopes: Vec<EventEnvelope> = (0..n).map(envelope).collect();
    p7_fill(conn, &envelopes, keys).await?;
    let (rate, _) =
        p7_subscribe(pool, amqp_url, n as u64, settings.clone(), fail_one_in, &[]).await?;
    let spec = &settings.spec;
    let mut queues = vec![spec.queue.clone(), spec.dlq_name()];
    queues.extend((0..spec.partitions).map(|p| spec.partition_queue(p)));
    for q in queues {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    for x in [
        spec.route_exchange(),
        spec.rest_exchange(),
        spec.exchange.clone(),
    ] {
        ch.exchange_delete(x.as_str().into(), Default::default())
            .await?;
    }
    pool.execute("TRUNCATE event_inbox, p7_applied").await?;
    Ok(rate)
}

/// p50 and p99 of a domain transaction with one `publish_tx`, unkeyed and
/// keyed (100 keys in turn), interleaved so both see the same machine.
async fn keyed_publish_cost(
    pool: &PgPool,
    iterations: usize,
) -> Result<[(Duration, Duration); 2], Box<dyn std::error::Error>> {
    let publisher = Publisher::new(pool.clone());
    let mut samples = [Vec::new(), Vec::new()];
    for i in 0..iterations * 2 {
        let keyed = i % 2 == 1;
        let mut e = envelope(i);
        if keyed {
            e = e.with_ordering_key(format!("key-{}", i % 100));
        }
        let took = domain_tx(pool, &publisher, i, std::slice::from_ref(&e)).await?;
        samples[usize::from(keyed)].push(took);
    }
    pool.execute("TRUNCATE event_outbox, orders").await?;
    Ok(samples.map(|mut s| {
        s.sort();
        (percentile(&s, 0.5), percentile(&s, 0.99))
    }))
}

async fn drain(
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    replicas: usize,
    standbys: &[String],
) -> Result<DrainRun, Box<dyn std::error::Error>> {
    let publisher = Publisher::new(pool.clone());
    let wal_from = wal_lsn(pool).await?;
    let started = Instant::now();
    let handles: Vec<DrainerHandle> = (0..replicas)
        .map(|r| {
            let config = DrainerConfig::builder()
                .exchange(EXCHANGE)
                .replica_id(format!("harness-{r}"))
                .durable_standbys(standbys)
                .build()
                .expect("defaults are valid");
            DrainerHandle::spawn(
                pool.clone(),
                LapinBroker::from_list(amqp_url).expect("--amqp-url checked at start"),
                config,
            )
        })
        .collect();
    loop {
        if publisher.outbox_pending_count().await? == 0 {
            break;
        }
        if started.elapsed() > DRAIN_LIMIT {
            return Err(format!("{n} rows not drained within {DRAIN_LIMIT:?}").into());
        }
        // Counting a large backlog costs the database real work: poll
        // rarely (the rate's error is below 1 % for a drain of seconds).
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    let wal = wal_since(pool, &wal_from).await?;
    for h in handles {
        h.shutdown().await;
    }
    pool.execute("TRUNCATE event_outbox").await?;
    Ok(DrainRun {
        rows_per_sec: n as f64 / elapsed.as_secs_f64(),
        wal_bytes_per_row: wal / n as f64,
    })
}

/// Where one replica's time goes: `Drainer::tick` driven back to back (as
/// `run` does with a full batch) over a pre-filled backlog, summing each
/// phase's clock time. Returns (rows/s, mean claim, publish, mark per tick).
async fn phases(
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
) -> Result<(f64, [Duration; 3]), Box<dyn std::error::Error>> {
    use std::sync::Arc;
    prefill(pool, n).await?;
    let config = DrainerConfig::builder()
        .exchange(EXCHANGE)
        .replica_id("harness-phases")
        .build()
        .expect("defaults are valid");
    let drainer = outbox::core::drainer::Drainer::new(
        Arc::new(outbox::PgOutboxStore::new(pool.clone())),
        Arc::new(LapinBroker::from_list(amqp_url).expect("--amqp-url checked at start")),
        Arc::new(outbox::TokioClock::default()),
        Arc::new(outbox::runtime::SplitMix64::new(1)),
        config,
    );
    let started = Instant::now();
    let (mut ticks, mut rows) = (0u32, 0u64);
    let mut sum = [Duration::ZERO; 3];
    loop {
        let r = drainer.tick().await?;
        if r.claimed == 0 {
            break;
        }
        ticks += 1;
        rows += r.published;
        sum[0] += r.claim_time;
        sum[1] += r.publish_time;
        sum[2] += r.mark_time;
    }
    let rate = rows as f64 / started.elapsed().as_secs_f64();
    pool.execute("TRUNCATE event_outbox").await?;
    Ok((rate, sum.map(|d| d / ticks.max(1))))
}

/// The pre-#478 drainer, for contrast only: one transaction held across the
/// whole batch (`FOR UPDATE SKIP LOCKED`), then per row publish, await its
/// confirm, update the row, next; COMMIT at the end. Drains until the table
/// has nothing unpublished or `stop` turns true; returns rows published.
async fn antipattern_drain(
    pool: PgPool,
    amqp_url: String,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    let conn = benches::chaos::connect_any(&amqp_url).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut published = 0u64;
    while !*stop.borrow() {
        let mut tx = pool.begin().await?;
        let rows: Vec<(uuid::Uuid, String, String)> = sqlx::query_as(
            "SELECT id, routing_key, payload::text FROM event_outbox \
             WHERE published_at IS NULL ORDER BY enqueued_at, id LIMIT 100 \
             FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            tx.commit().await?;
            break;
        }
        for (id, routing_key, body) in &rows {
            let props = BasicProperties::default()
                .with_message_id(id.to_string().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            ch.basic_publish(
                EXCHANGE.into(),
                routing_key.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?
            .await?;
            sqlx::query("UPDATE event_outbox SET published_at = now() WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            published += 1;
        }
        tx.commit().await?;
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.close(200, "OK".into())).await;
    Ok(published)
}

/// The antipattern's drain rate over a pre-filled backlog of `n` rows.
async fn antipattern(
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    prefill(pool, n).await?;
    let (_tx, stop) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let published = antipattern_drain(pool.clone(), amqp_url.to_owned(), stop)
        .await
        .map_err(|e| e.to_string())?;
    let rate = published as f64 / started.elapsed().as_secs_f64();
    pool.execute("TRUNCATE event_outbox").await?;
    Ok(rate)
}

/// The ceiling again, while the drainer's database work runs beside it on
/// the same machine: claim + mark cycles of 100 rows (the production store's
/// statements) paced at `rows_per_sec` over a pre-filled backlog. On a host
/// that runs PostgreSQL, RabbitMQ and the drainer on the same cores, this
/// is the most a drainer doing that work could reach.
async fn ceiling_beside_database(
    conn: &Connection,
    pool: &PgPool,
    n: usize,
    rows_per_sec: f64,
) -> Result<f64, Box<dyn std::error::Error>> {
    prefill(pool, n).await?;
    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    let store = outbox::PgOutboxStore::new(pool.clone());
    let every = Duration::from_secs_f64(100.0 / rows_per_sec.max(1.0));
    let database = tokio::spawn(async move {
        let mut next = tokio::time::Instant::now();
        while !*stop.borrow() {
            let (ids, _) = claim_and_mark(&store, "harness-beside").await?;
            if ids.is_empty() {
                break;
            }
            next += every;
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = stop.changed() => {}
            }
        }
        Ok::<(), outbox::StoreError>(())
    });
    let rate = ceiling(conn, n).await;
    let _ = stop_tx.send(true);
    database.await??;
    pool.execute("TRUNCATE event_outbox").await?;
    rate
}

/// Claim + mark rate (rows/s) of the store alone, `cycles` batches of 100,
/// on whatever backlog the table holds.
async fn claim_mark_rate(pool: &PgPool, cycles: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let store = outbox::PgOutboxStore::new(pool.clone());
    let mut started = Instant::now();
    let mut rows = 0usize;
    // The first cycles (statement preparation, cold buffers) are not timed.
    const WARMUP: usize = 5;
    for cycle in 0..cycles + WARMUP {
        if cycle == WARMUP {
            started = Instant::now();
            rows = 0;
        }
        let (ids, _) = claim_and_mark(&store, "harness-p2").await?;
        rows += ids.len();
    }
    Ok(rows as f64 / started.elapsed().as_secs_f64())
}

/// P2: claim + mark at a small and a large unpublished backlog, and at a
/// small backlog behind a large number of published rows awaiting retention.
async fn claim_scaling(
    pool: &PgPool,
    small: usize,
    large: usize,
) -> Result<[f64; 3], Box<dyn std::error::Error>> {
    pool.execute("TRUNCATE event_outbox").await?;
    prefill(pool, small).await?;
    let at_small = claim_mark_rate(pool, 50).await?;
    pool.execute("TRUNCATE event_outbox").await?;
    prefill(pool, large).await?;
    let at_large = claim_mark_rate(pool, 50).await?;
    // Publish the large backlog (as if drained), then a small fresh one.
    pool.execute("UPDATE event_outbox SET published_at = now() WHERE published_at IS NULL")
        .await?;
    prefill(pool, small).await?;
    let behind_published = claim_mark_rate(pool, 50).await?;
    pool.execute("TRUNCATE event_outbox").await?;
    Ok([at_small, at_large, behind_published])
}

/// p50 / p99 of one domain transaction in three variants.
/// How long one domain transaction (order `i`'s row) takes with
/// `envelopes` written in it: none, one through `publish_tx`, more through
/// `publish_many_tx`.
async fn domain_tx(
    pool: &PgPool,
    publisher: &Publisher,
    i: usize,
    envelopes: &[EventEnvelope],
) -> Result<Duration, Box<dyn std::error::Error>> {
    let t = Instant::now();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO orders (id, note) VALUES ($1, 'harness')")
        .bind(i as i64)
        .execute(&mut *tx)
        .await?;
    match envelopes {
        [] => {}
        [one] => publisher.publish_tx(&mut tx, one).await?,
        many => publisher.publish_many_tx(&mut tx, many).await?,
    }
    tx.commit().await?;
    Ok(t.elapsed())
}

async fn publish_cost(
    pool: &PgPool,
    iterations: usize,
) -> Result<[(Duration, Duration); 3], Box<dyn std::error::Error>> {
    let publisher = Publisher::new(pool.clone());
    let mut out = [(Duration::ZERO, Duration::ZERO); 3];
    for (variant, slot) in out.iter_mut().enumerate() {
        let mut samples = Vec::with_capacity(iterations);
        for i in 0..iterations {
            let envelopes: Vec<EventEnvelope> = match variant {
                0 => Vec::new(),
                1 => vec![envelope(i)],
                _ => (0..100).map(|k| envelope(i * 100 + k)).collect(),
            };
            samples.push(domain_tx(pool, &publisher, i, &envelopes).await?);
        }
        samples.sort();
        *slot = (percentile(&samples, 0.5), percentile(&samples, 0.99));
    }
    pool.execute("TRUNCATE event_outbox, orders").await?;
    Ok(out)
}

/// Commit → marked published at a steady `rate` per second for `secs`.
async fn end_to_end(
    pool: &PgPool,
    amqp_url: &str,
    rate: u64,
    secs: u64,
) -> Result<(Duration, Duration, Duration), Box<dyn std::error::Error>> {
    let config = DrainerConfig::builder()
        .exchange(EXCHANGE)
        .replica_id("harness-e2e")
        .build()
        .expect("defaults are valid");
    let drainer = DrainerHandle::spawn(
        pool.clone(),
        LapinBroker::from_list(amqp_url).expect("--amqp-url checked at start"),
        config,
    );
    let publisher = Publisher::new(pool.clone());
    let mut committed = Vec::new();
    let every = Duration::from_micros(1_000_000 / rate);
    let mut next = tokio::time::Instant::now();
    for i in 0..(rate * secs) as usize {
        tokio::time::sleep_until(next).await;
        next += every;
        let e = envelope(i);
        let mut tx = pool.begin().await?;
        publisher.publish_tx(&mut tx, &e).await?;
        tx.commit().await?;
        committed.push((e.id, std::time::SystemTime::now()));
    }
    // Wait for the tail to drain.
    let started = Instant::now();
    while publisher.outbox_pending_count().await? > 0 && started.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drainer.shutdown().await;
    let published: Vec<(uuid::Uuid, time::OffsetDateTime)> =
        sqlx::query_as("SELECT id, published_at FROM event_outbox WHERE published_at IS NOT NULL")
            .fetch_all(pool)
            .await?;
    let published: std::collections::BTreeMap<_, _> = published.into_iter().collect();
    let mut lat: Vec<Duration> = committed
        .iter()
        .filter_map(|(id, at)| {
            let p = published.get(id)?;
            let at = time::OffsetDateTime::from(*at);
            Some(Duration::try_from(*p - at).unwrap_or(Duration::ZERO))
        })
        .collect();
    lat.sort();
    pool.execute("TRUNCATE event_outbox").await?;
    Ok((
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or_default(),
    ))
}

/// P7's exchange and queue (the subscriber declares the queue, its
/// dead-letter queue and bindings itself).
const P7_EXCHANGE: &str = "harness.p7.events";
const P7_QUEUE: &str = "harness.p7";

/// The table P7's handler writes its domain rows to.
async fn p7_applied_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    pool.execute("CREATE TABLE IF NOT EXISTS p7_applied (event_id uuid PRIMARY KEY, routing_key text NOT NULL)")
        .await?;
    Ok(())
}

/// P7's handler: one domain row per event, in the subscriber's transaction;
/// with `fail_one_in` above 0, the first attempt of one event in that many
/// fails (as the chaos run's `shipping` does), remembered outside the
/// transaction.
#[derive(Default)]
struct Applies {
    fail_one_in: u64,
    failed: std::sync::Mutex<std::collections::BTreeSet<uuid::Uuid>>,
}

impl outbox::core::subscriber::Handler<outbox::PgTx> for Applies {
    async fn handle(
        &self,
        tx: &mut outbox::PgTx,
        event: &EventEnvelope,
    ) -> Result<(), outbox::HandlerError> {
        if self.fail_one_in > 0
            && event.id.as_u64_pair().1.is_multiple_of(self.fail_one_in)
            && self.failed.lock().expect("not poisoned").insert(event.id)
        {
            return Err(outbox::HandlerError::msg(
                "transient failure, first attempt",
            ));
        }
        sqlx::query("INSERT INTO p7_applied (event_id, routing_key) VALUES ($1, $2)")
            .bind(event.id)
            .bind(&event.routing_key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// The subscription P7 measures: defaults (or what `CANOPY_MQ_SUBSCRIBER_*`
/// variables say, to compare settings), with `batch_max` if given, and a
/// queue of `kind` if given.
fn p7_settings(batch_max: Option<u32>, kind: Option<QueueType>) -> outbox::SubscriberSettings {
    let mut s =
        outbox::SubscriberSettings::from_env(P7_QUEUE, &["#"]).unwrap_or_else(|e| panic!("{e}"));
    s.spec.exchange = P7_EXCHANGE.into();
    if let Some(b) = batch_max {
        s.batch_max = b;
    }
    if let Some(kind) = kind {
        s.spec.queue_type = kind;
    }
    s
}

/// Publishes `envelopes` to P7's exchange, persistent, confirmed at depth
/// `DEPTH`, with the headers the drainer sets: the bucket, and with `keys`
/// event `i` as number `i / keys + 1` of key `key-{i % keys}`.
async fn p7_fill(
    conn: &Connection,
    envelopes: &[EventEnvelope],
    keys: Option<u32>,
) -> Result<(), Box<dyn std::error::Error>> {
    use lapin::types::AMQPValue;
    use outbox::core::ports::{BUCKET_HEADER, KEY_SEQ_HEADER, KeySeq, ORDERING_KEY_HEADER};
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut pending = std::collections::VecDeque::with_capacity(DEPTH);
    for (i, e) in envelopes.iter().enumerate() {
        if pending.len() == DEPTH {
            let c: lapin::PublisherConfirm = pending.pop_front().expect("non-empty");
            c.await?;
        }
        let body = e.encode(&Default::default())?;
        let ordering = keys.map(|k| KeySeq {
            key: format!("key-{}", i as u32 % k),
            seq: i64::from(i as u32 / k + 1),
        });
        let mut headers = FieldTable::default();
        let bucket = outbox::core::ports::bucket_of(ordering.as_ref(), e.id);
        headers.insert(
            BUCKET_HEADER.into(),
            AMQPValue::LongString(bucket.to_string().into()),
        );
        if let Some(o) = &ordering {
            headers.insert(
                ORDERING_KEY_HEADER.into(),
                AMQPValue::LongString(o.key.as_str().into()),
            );
            headers.insert(KEY_SEQ_HEADER.into(), AMQPValue::LongLongInt(o.seq));
        }
        let props = BasicProperties::default()
            .with_message_id(e.id.to_string().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_headers(headers);
        pending.push_back(
            ch.basic_publish(
                P7_EXCHANGE.into(),
                e.routing_key.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?,
        );
    }
    for c in pending {
        c.await?;
    }
    let _ = ch.close(200, "OK".into()).await;
    Ok(())
}

/// Raw lapin consume of `n` messages from P7's queue with manual acks at
/// the subscriber's prefetch: the consume ceiling.
async fn p7_consume_ceiling(
    conn: &Connection,
    n: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    let ch = conn.create_channel().await?;
    ch.basic_qos(
        p7_settings(None, None).spec.prefetch,
        BasicQosOptions::default(),
    )
    .await?;
    let mut consumer = ch
        .basic_consume(
            P7_QUEUE.into(),
            "harness-p7-ceiling".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let started = Instant::now();
    let mut got = 0;
    while got < n {
        let next = tokio::time::timeout(
            Duration::from_secs(30),
            std::future::poll_fn(|cx| {
                futures_core::Stream::poll_next(std::pin::Pin::new(&mut consumer), cx)
            }),
        )
        .await
        .map_err(|_| format!("the consume ceiling stalled after {got} of {n}"))?;
        let d = next.ok_or("the consumer ended")??;
        d.ack(BasicAckOptions::default()).await?;
        got += 1;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let _ = ch.close(200, "OK".into()).await;
    Ok(rate)
}

/// The production subscriber (`batch_max` as given, else defaults) working
/// off P7's queue of `n` deliveries. Returns (deliveries/s, WAL bytes per
/// delivery).
async fn p7_subscribe(
    pool: &PgPool,
    amqp_url: &str,
    n: u64,
    settings: outbox::SubscriberSettings,
    fail_one_in: u64,
    standbys: &[String],
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let mut subscriber = outbox::Subscriber::new(
        std::sync::Arc::new(outbox::PgInboxStore::new(pool.clone())),
        std::sync::Arc::new(LapinBroker::from_list(amqp_url).expect("--amqp-url checked at start")),
        std::sync::Arc::new(outbox::TokioClock::default()),
        std::sync::Arc::new(Applies {
            fail_one_in,
            ..Applies::default()
        }),
        settings,
    );
    if let Some(gate) = outbox::core::durability::DurableStandbys::new(standbys.to_vec()) {
        subscriber = subscriber.with_durable_standbys(std::sync::Arc::new(gate));
    }
    let subscriber = std::sync::Arc::new(subscriber);
    let counters = subscriber.counters();
    let (stop, rx) = tokio::sync::watch::channel(false);
    let wal_from = wal_lsn(pool).await?;
    let started = Instant::now();
    let running = {
        let s = subscriber.clone();
        tokio::spawn(async move { s.run(rx).await })
    };
    loop {
        let c = counters.snapshot();
        if c.processed + c.duplicates >= n {
            break;
        }
        if started.elapsed() > DRAIN_LIMIT || running.is_finished() {
            return Err(format!("the subscriber did not take {n} deliveries: {c:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let wal = wal_since(pool, &wal_from).await?;
    let _ = stop.send(true);
    running.await??;
    Ok((n as f64 / elapsed.as_secs_f64(), wal / n as f64))
}

/// The subscriber's queue: declared as the subscriber declares it, and
/// deleted with its dead-letter queue and exchange.
async fn p7_topology(
    amqp_url: &str,
    up: bool,
    kind: Option<QueueType>,
) -> Result<(), Box<dyn std::error::Error>> {
    use outbox::core::ports::{ConsumerBroker, DeliverySource};
    if up {
        let broker = LapinBroker::from_list(amqp_url).expect("--amqp-url checked at start");
        let consumer = broker
            .subscription_open(&p7_settings(None, kind).spec)
            .await?;
        consumer.consumer_close().await;
        return Ok(());
    }
    let conn = benches::chaos::connect_any(amqp_url).await?;
    let ch = conn.create_channel().await?;
    for q in [P7_QUEUE.to_owned(), format!("{P7_QUEUE}.dlq")] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    ch.exchange_delete(P7_EXCHANGE.into(), Default::default())
        .await?;
    let _ = conn.close(200, "OK".into()).await;
    Ok(())
}

/// P7: the consume ceiling, then the subscriber at defaults (fresh
/// events), with 25 % duplicates (of events already applied), and with
/// batches of one (the ADR's one transaction per delivery) for contrast,
/// then at defaults on a classic queue. Returns (ceiling, defaults,
/// duplicates, batch of one, inbox WAL per event applied, classic).
async fn p7(
    conn: &Connection,
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
) -> Result<[f64; 6], Box<dyn std::error::Error>> {
    p7_applied_table(pool).await?;
    p7_topology(amqp_url, true, None).await?;
    let fresh = |n: usize| -> Vec<EventEnvelope> { (0..n).map(envelope).collect() };
    p7_fill(conn, &fresh(n), None).await?;
    eprintln!("  consume ceiling ...");
    let ceiling = p7_consume_ceiling(conn, n).await?;
    eprintln!("  subscriber, defaults ...");
    let applied = fresh(n);
    p7_fill(conn, &applied, None).await?;
    let (defaults, wal) =
        p7_subscribe(pool, amqp_url, n as u64, p7_settings(None, None), 0, &[]).await?;
    // One delivery in four repeats an event the inbox holds as processed.
    let mixed: Vec<EventEnvelope> = (0..n)
        .map(|i| {
            if i % 4 == 3 {
                applied[i].clone()
            } else {
                envelope(i)
            }
        })
        .collect();
    p7_fill(conn, &mixed, None).await?;
    eprintln!("  subscriber, 25 % duplicates ...");
    let (duplicates, _) =
        p7_subscribe(pool, amqp_url, n as u64, p7_settings(None, None), 0, &[]).await?;
    p7_fill(conn, &fresh(n), None).await?;
    eprintln!("  subscriber, batches of one ...");
    let (single, _) =
        p7_subscribe(pool, amqp_url, n as u64, p7_settings(Some(1), None), 0, &[]).await?;
    p7_topology(amqp_url, false, None).await?;
    eprintln!("  subscriber, defaults on a classic queue ...");
    let classic = Some(QueueType::Classic);
    p7_topology(amqp_url, true, classic).await?;
    p7_fill(conn, &fresh(n), None).await?;
    let (on_classic, _) =
        p7_subscribe(pool, amqp_url, n as u64, p7_settings(None, classic), 0, &[]).await?;
    p7_topology(amqp_url, false, classic).await?;
    pool.execute("TRUNCATE event_inbox, p7_applied").await?;
    Ok([ceiling, defaults, duplicates, single, wal, on_classic])
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("error: {msg}");
            std::process::exit(2);
        }
    };
    let want = |section: &str| args.only.is_empty() || args.only.iter().any(|s| s == section);
    let pool = fresh_database(&args.database_url, DATABASE, 16).await?;
    let conn = benches::chaos::connect_any(&args.amqp_url).await?;
    broker_topology(&conn).await?;
    let mut s = sections::Sheet::new(&args, pool, conn).await?;
    if want("p1") {
        sections::p1(&mut s).await?;
    }
    if want("p7") {
        sections::p7_section(&mut s).await?;
    }
    if want("beside") {
        sections::beside(&mut s).await?;
    }
    if want("phases") {
        sections::phases_section(&mut s).await?;
    }
    if want("antipattern") {
        sections::antipattern_section(&mut s).await?;
    }
    if want("p2") && args.p2_rows > 0 {
        sections::p2(&mut s).await?;
    }
    if want("p3") {
        sections::p3_section(&mut s).await?;
    }
    if want("p4") {
        sections::p4(&mut s).await?;
    }
    if want("p9") {
        sections::p9_section(&mut s).await?;
    }
    if want("p9f") {
        sections::p9f(&mut s).await?;
    }
    if want("p5") {
        sections::p5(&mut s).await?;
    }
    // The gates need a primary with a standby (`.ci/pg-pair`): only when
    // asked for by name.
    if args.only.iter().any(|s| s == "gates") {
        gates::section(&mut s).await?;
    }
    if args.only.iter().any(|s| s == "failover") {
        failover::section(&mut s).await?;
    }
    // P10 loads tens of millions of rows: only when asked for by name.
    if args.only.iter().any(|s| s == "p10") {
        sections::p10_section(&mut s).await?;
    }
    finish(s).await
}

/// Removes the harness's queues and exchange, prints the table and writes
/// the JSON.
async fn finish(s: sections::Sheet<'_>) -> Result<(), Box<dyn std::error::Error>> {
    let ch = s.conn.create_channel().await?;
    for q in [QUEUE, p10::QUEUE, p10::DLQ] {
        ch.queue_delete(q.into(), QueueDeleteOptions::default())
            .await?;
    }
    ch.exchange_delete(EXCHANGE.into(), Default::default())
        .await?;
    for line in &s.table {
        println!("{line}");
    }
    std::fs::write(
        &s.args.json,
        serde_json::to_string_pretty(&serde_json::Value::Object(s.json))?,
    )?;
    eprintln!("written {}", s.args.json);
    s.pool.close().await;
    let _ = tokio::time::timeout(Duration::from_secs(5), s.conn.close(200, "OK".into())).await;
    Ok(())
}
