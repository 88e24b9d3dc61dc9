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
//! - **P4 publish cost**: a domain transaction alone, with `publish_tx` of 1
//!   envelope, with `publish_many_tx` of 100 (p50 / p99 latency);
//! - **P5 end-to-end latency**: commit → marked published (which follows
//!   the broker's confirm) at a steady 100 events/s.
//!
//! It works in a database of its own (`outbox_harness`, dropped and
//! recreated) and an exchange and queue of its own (`harness.*`, purged and
//! deleted at the end).

use std::time::{Duration, Instant};

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox::{DrainerConfig, DrainerHandle, EventEnvelope, LapinBroker, Publisher, redact_url};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

const EXCHANGE: &str = "harness.events";
const QUEUE: &str = "harness.sink";
/// The harness's own database (named literally in its DROP/CREATE).
const DATABASE: &str = "outbox_harness";
/// The drainer's default pipeline depth, used for the ceiling.
const DEPTH: usize = 32;
/// Longest wait for a drain.
const DRAIN_LIMIT: Duration = Duration::from_secs(1800);

struct Args {
    rows: usize,
    /// Backlog of the large P2 measurement (0 skips P2).
    p2_rows: usize,
    json: String,
    database_url: String,
    amqp_url: String,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        rows: 100_000,
        p2_rows: 1_000_000,
        json: "target/harness.json".into(),
        database_url: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into()),
        amqp_url: std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--rows" => {
                let v = value()?;
                a.rows = v
                    .parse()
                    .map_err(|_| format!("--rows must be a whole number, got {v:?}"))?;
            }
            "--p2-rows" => {
                let v = value()?;
                a.p2_rows = v
                    .parse()
                    .map_err(|_| format!("--p2-rows must be a whole number, got {v:?}"))?;
            }
            "--json" => a.json = value()?,
            "--database-url" => a.database_url = value()?,
            "--amqp-url" => a.amqp_url = value()?,
            "-h" | "--help" => {
                return Err(
                    "usage: harness [--rows N] [--json FILE] [--database-url URL] [--amqp-url URL]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(a)
}

/// A payload like the services': ~200 bytes of JSON once enveloped.
fn envelope(i: usize) -> EventEnvelope {
    EventEnvelope::new(
        "harness.order.created",
        serde_json::json!({ "order_id": i, "customer": "c-4711", "total_cents": 12_345, "currency": "EUR" }),
    )
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

async fn fresh_database(admin_url: &str) -> Result<PgPool, Box<dyn std::error::Error>> {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(admin_url)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", redact_url(admin_url)))?;
    admin
        .execute("DROP DATABASE IF EXISTS outbox_harness WITH (FORCE)")
        .await?;
    admin.execute("CREATE DATABASE outbox_harness").await?;
    admin.close().await;
    let url = match admin_url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{DATABASE}"),
        None => return Err("DATABASE_URL has no database part".into()),
    };
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await?;
    outbox::migrator().run(&pool).await?;
    pool.execute("CREATE TABLE orders (id BIGINT NOT NULL, note TEXT NOT NULL)")
        .await?;
    Ok(pool)
}

async fn broker_topology(conn: &Connection) -> Result<(), Box<dyn std::error::Error>> {
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        EXCHANGE.into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_declare(
        QUEUE.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        QUEUE.into(),
        EXCHANGE.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.queue_purge(QUEUE.into(), QueuePurgeOptions::default())
        .await?;
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

async fn prefill(pool: &PgPool, n: usize) -> Result<(), Box<dyn std::error::Error>> {
    let publisher = Publisher::new(pool.clone());
    let mut i = 0;
    while i < n {
        let batch: Vec<EventEnvelope> = (i..(i + 1000).min(n)).map(envelope).collect();
        let mut tx = pool.begin().await?;
        publisher.publish_many_tx(&mut tx, &batch).await?;
        tx.commit().await?;
        i += batch.len();
    }
    pool.execute("VACUUM ANALYZE event_outbox").await?;
    Ok(())
}

/// The production drainer, default configuration, `replicas` of them.
async fn drain(
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    replicas: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let publisher = Publisher::new(pool.clone());
    let started = Instant::now();
    let handles: Vec<DrainerHandle> = (0..replicas)
        .map(|r| {
            let config = DrainerConfig::builder()
                .exchange(EXCHANGE)
                .replica_id(format!("harness-{r}"))
                .build()
                .expect("defaults are valid");
            DrainerHandle::spawn(pool.clone(), LapinBroker::new(amqp_url), config)
        })
        .collect();
    loop {
        if publisher.outbox_pending_count().await? == 0 {
            break;
        }
        if started.elapsed() > DRAIN_LIMIT {
            return Err(format!("{n} rows not drained within {DRAIN_LIMIT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    for h in handles {
        h.shutdown().await;
    }
    pool.execute("TRUNCATE event_outbox").await?;
    Ok(n as f64 / elapsed.as_secs_f64())
}

/// Claim + mark rate (rows/s) of the store alone, `cycles` batches of 100,
/// on whatever backlog the table holds.
async fn claim_mark_rate(pool: &PgPool, cycles: usize) -> Result<f64, Box<dyn std::error::Error>> {
    use outbox::core::ports::{ClaimParams, OutboxStore};
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
        let claimed = store
            .outbox_claim(ClaimParams {
                replica_id: "harness-p2",
                batch_size: 100,
                lease_ttl: Duration::from_secs(60),
            })
            .await?;
        let ids: Vec<uuid::Uuid> = claimed.iter().map(|r| r.id).collect();
        store.outbox_mark_published("harness-p2", &ids).await?;
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

/// A foreground workload committing single-row transactions at `rate` per
/// second for `secs`: sorted latencies.
async fn foreground(
    pool: &PgPool,
    rate: u64,
    secs: u64,
) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let every = Duration::from_micros(1_000_000 / rate);
    let mut next = tokio::time::Instant::now();
    let mut lat = Vec::with_capacity((rate * secs) as usize);
    for i in 0..(rate * secs) as i64 {
        tokio::time::sleep_until(next).await;
        next += every;
        let t = Instant::now();
        let mut tx = pool.begin().await?;
        sqlx::query("INSERT INTO orders (id, note) VALUES ($1, 'foreground')")
            .bind(i)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        lat.push(t.elapsed());
    }
    lat.sort();
    Ok(lat)
}

/// P3: foreground latency idle, then while the drainer drains a backlog
/// flat out; returns (idle, draining, rows drained per second meanwhile).
async fn foreground_impact(
    pool: &PgPool,
    amqp_url: &str,
    backlog: usize,
) -> Result<(Vec<Duration>, Vec<Duration>, f64), Box<dyn std::error::Error>> {
    let idle = foreground(pool, 200, 10).await?;
    prefill(pool, backlog).await?;
    let publisher = Publisher::new(pool.clone());
    let config = DrainerConfig::builder()
        .exchange(EXCHANGE)
        .replica_id("harness-p3")
        .build()
        .expect("defaults are valid");
    let drainer = DrainerHandle::spawn(pool.clone(), LapinBroker::new(amqp_url), config);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = publisher.outbox_pending_count().await?;
    let t = Instant::now();
    let draining = foreground(pool, 200, 10).await?;
    let after = publisher.outbox_pending_count().await?;
    let rate = before.saturating_sub(after) as f64 / t.elapsed().as_secs_f64();
    drainer.shutdown().await;
    pool.execute("TRUNCATE event_outbox, orders").await?;
    Ok((idle, draining, rate))
}

/// p50 / p99 of one domain transaction in three variants.
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
            let t = Instant::now();
            let mut tx = pool.begin().await?;
            sqlx::query("INSERT INTO orders (id, note) VALUES ($1, 'harness')")
                .bind(i as i64)
                .execute(&mut *tx)
                .await?;
            match variant {
                0 => {}
                1 => publisher.publish_tx(&mut tx, &envelopes[0]).await?,
                _ => publisher.publish_many_tx(&mut tx, &envelopes).await?,
            }
            tx.commit().await?;
            samples.push(t.elapsed());
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
    let drainer = DrainerHandle::spawn(pool.clone(), LapinBroker::new(amqp_url), config);
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = match parse_args() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            std::process::exit(2);
        }
    };
    let pool = fresh_database(&args.database_url).await?;
    let conn = Connection::connect(&args.amqp_url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", redact_url(&args.amqp_url)))?;
    broker_topology(&conn).await?;
    let n = args.rows;

    eprintln!("ceiling: raw publish+confirm of {n} messages at depth {DEPTH} ...");
    let ceiling = ceiling(&conn, n).await?;
    purge(&conn).await?;

    let mut p1 = Vec::new();
    for replicas in [1, 2] {
        eprintln!("P1: prefilling {n} rows, draining with {replicas} replica(s) ...");
        prefill(&pool, n).await?;
        let rate = drain(&pool, &args.amqp_url, n, replicas).await?;
        purge(&conn).await?;
        p1.push((replicas, rate));
    }

    let p2 = if args.p2_rows > 0 {
        eprintln!(
            "P2: claim + mark at 10k and {} rows (minutes) ...",
            args.p2_rows
        );
        Some(claim_scaling(&pool, 10_000, args.p2_rows).await?)
    } else {
        None
    };

    eprintln!("P3: foreground latency idle and while draining ...");
    let p3 = foreground_impact(&pool, &args.amqp_url, n).await?;
    purge(&conn).await?;

    eprintln!("P4: publish cost ...");
    let p4 = publish_cost(&pool, 500).await?;

    eprintln!("P5: end-to-end latency at 100 events/s for 20 s ...");
    let p5 = end_to_end(&pool, &args.amqp_url, 100, 20).await?;
    purge(&conn).await?;
    let ch = conn.create_channel().await?;
    ch.queue_delete(QUEUE.into(), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(EXCHANGE.into(), Default::default())
        .await?;

    println!("| measure | value | ratio | target |");
    println!("|---|---|---|---|");
    println!("| ceiling: raw publish+confirm, depth {DEPTH} | {ceiling:.0} msg/s | 1.00 | — |");
    for (replicas, rate) in &p1 {
        println!(
            "| P1 drain rate, {n} rows, {replicas} replica(s), defaults | {rate:.0} rows/s | {:.2}× ceiling | ≥ 0.9× (1 replica) |",
            rate / ceiling
        );
    }
    if let Some([small, large, behind]) = p2 {
        println!("| P2 claim+mark, 10k unpublished rows | {small:.0} rows/s | 1.00 | — |");
        println!(
            "| P2 claim+mark, {} unpublished rows | {large:.0} rows/s | {:.2}× 10k | ≥ 0.8× |",
            args.p2_rows,
            large / small
        );
        println!(
            "| P2 claim+mark, 10k unpublished behind {} published | {behind:.0} rows/s | {:.2}× 10k | — |",
            args.p2_rows,
            behind / small
        );
    }
    {
        let (idle, draining, rate) = &p3;
        for (name, l) in [("idle", idle), ("while draining", draining)] {
            println!(
                "| P3 foreground 1-row tx at 200/s, {name} | p50 {:.2} ms, p99 {:.2} ms, max {:.1} ms | {:.2}× idle p99 | ≤ 2× |",
                ms(percentile(l, 0.5)),
                ms(percentile(l, 0.99)),
                ms(l.last().copied().unwrap_or_default()),
                percentile(l, 0.99).as_secs_f64() / percentile(idle, 0.99).as_secs_f64()
            );
        }
        println!("| P3 drain rate reached meanwhile | {rate:.0} rows/s | | |");
    }
    let base = p4[0].0;
    for (name, (p50, p99)) in [
        "domain tx alone",
        "domain tx + publish_tx(1)",
        "domain tx + publish_many_tx(100)",
    ]
    .iter()
    .zip(p4.iter())
    {
        println!(
            "| P4 {name} | p50 {:.2} ms, p99 {:.2} ms | {:.2}× alone | many(100) ≤ 3× tx(1) |",
            ms(*p50),
            ms(*p99),
            p50.as_secs_f64() / base.as_secs_f64()
        );
    }
    println!(
        "| P4 publish_many_tx(100) / publish_tx(1) | {:.2}× | | ≤ 3× |",
        p4[2].0.as_secs_f64() / p4[1].0.as_secs_f64()
    );
    println!(
        "| P5 commit → marked published, 100 events/s | p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms | | p50 ≤ 20 ms, p99 ≤ 100 ms |",
        ms(p5.0),
        ms(p5.1),
        ms(p5.2)
    );
    let json = serde_json::json!({
        "rows": n,
        "ceiling_msgs_per_sec": ceiling,
        "p1": p1.iter().map(|(r, rate)| serde_json::json!({
            "replicas": r, "rows_per_sec": rate, "ratio_to_ceiling": rate / ceiling
        })).collect::<Vec<_>>(),
        "p4_ms": {
            "alone": { "p50": ms(p4[0].0), "p99": ms(p4[0].1) },
            "publish_tx_1": { "p50": ms(p4[1].0), "p99": ms(p4[1].1) },
            "publish_many_tx_100": { "p50": ms(p4[2].0), "p99": ms(p4[2].1) },
        },
        "p5_ms": { "p50": ms(p5.0), "p99": ms(p5.1), "max": ms(p5.2) },
        "p3_ms": {
            "idle": { "p50": ms(percentile(&p3.0, 0.5)), "p99": ms(percentile(&p3.0, 0.99)) },
            "draining": { "p50": ms(percentile(&p3.1, 0.5)), "p99": ms(percentile(&p3.1, 0.99)) },
            "drain_rows_per_sec": p3.2,
        },
        "p2_rows_per_sec": p2.map(|[s, l, b]| serde_json::json!({
            "small_10k": s, "large": l, "large_rows": args.p2_rows, "behind_published": b
        })),
    });
    std::fs::write(&args.json, serde_json::to_string_pretty(&json)?)?;
    eprintln!("written {}", args.json);
    pool.close().await;
    let _ = conn.close(200, "OK".into()).await;
    Ok(())
}
