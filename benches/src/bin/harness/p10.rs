//! P10 (issue 28): retention at scale. Bulk-loads `event_outbox` and
//! `event_inbox` with published and processed rows spread evenly over the
//! last eight days (one day of them past the seven days' retention), then,
//! while a drainer drains and a subscriber applies a steady 1 000 events/s
//! written by a foreground through `publish_tx`, runs one sweep of each
//! janitor at defaults and measures: its wall time and rows/s, the
//! foreground's commit latency and a probe's claim latency during the
//! sweep against a quiet window before it, the tables' and indexes' sizes,
//! their dead tuples, and what autovacuum did afterwards.
//!
//! Not in CI and not in the default run (it loads tens of millions of rows:
//! `--only p10 [--p10-rows 20000000] [--p10-layout plain|partitioned|both]`);
//! the tables are emptied at the end. The partitioned layout (issue 28)
//! runs in a database of its own, its past eight days in daily partitions
//! (as a service partitioned for that long has them).

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::core::janitor::{InboxJanitorSettings, sweep, sweep_inbox};
use outbox::core::ports::{ClaimParams, OutboxStore};
use outbox::{DrainerConfig, DrainerHandle, EventEnvelope, LapinBroker, PgOutboxStore};
use sqlx::{Executor, PgPool};

use super::foreground::{self, Samples};
use super::{EXCHANGE, ms, percentile};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The subscription (queue) whose inbox rows P10 loads and applies.
pub const QUEUE: &str = "harness.p10";
/// Its dead-letter queue (the subscriber declares both).
pub const DLQ: &str = "harness.p10.dlq";
/// The steady load: events/s written, drained and applied.
const RATE: u64 = 1_000;
/// The quiet window measured before the sweeps.
const QUIET: Duration = Duration::from_secs(30);
/// Rows per bulk `INSERT … SELECT` while loading.
const LOAD_CHUNK: u64 = 1_000_000;
/// Longest wait for autovacuum after the sweeps.
const AUTOVACUUM_WAIT: Duration = Duration::from_secs(180);

/// Bulk-loads `rows` published outbox rows and `rows` processed inbox rows
/// of subscription [`QUEUE`], row `i` written `8 days × (1 − i / rows)`
/// ago, with ids that are UUIDv7 of that instant; then `VACUUM ANALYZE`.
/// Returns the rows loaded per second.
async fn load(pool: &PgPool, rows: u64) -> BoxResult<f64> {
    let started = Instant::now();
    let mut from = 0;
    while from < rows {
        let to = (from + LOAD_CHUNK).min(rows);
        for statement in [LOAD_OUTBOX, LOAD_INBOX] {
            sqlx::query(statement)
                .bind(from as i64)
                .bind(to as i64 - 1)
                .bind(rows as i64)
                .bind(QUEUE)
                .execute(pool)
                .await?;
        }
        from = to;
        eprintln!("  loaded {to} of {rows} rows into each table");
    }
    pool.execute("VACUUM ANALYZE event_outbox").await?;
    pool.execute("VACUUM ANALYZE event_inbox").await?;
    Ok(2.0 * rows as f64 / started.elapsed().as_secs_f64())
}

/// Row `i` of `$3`, written `8 days × (1 − i / $3)` ago: its instant `t`,
/// and its id (a UUIDv7 of `t`: 48 bits of milliseconds, then `md5`
/// bits with the version and variant set). `$4` names the subscription.
macro_rules! load_rows {
    () => {
        "FROM generate_series($1::bigint, $2::bigint) AS g(i), \
         LATERAL (SELECT now() - interval '8 days' * (1 - g.i::float8 / $3::bigint) AS t, \
                         md5(g.i::text) AS h) AS r, \
         LATERAL (SELECT (lpad(to_hex((extract(epoch FROM r.t) * 1000)::bigint), 12, '0') \
                          || '7' || substr(r.h, 1, 3) || '8' || substr(r.h, 4, 15))::uuid AS id, \
                         jsonb_build_object('order_id', g.i, 'customer', 'c-4711', \
                                            'total_cents', 12345, 'currency', 'EUR') AS body) AS v \
         WHERE $4::text IS NOT NULL"
    };
}

const LOAD_OUTBOX: &str = concat!(
    "INSERT INTO event_outbox (id, routing_key, payload, envelope, enqueued_at, published_at) \
     SELECT v.id, 'harness.order.created', v.body, v.body::text, r.t, r.t + interval '5 ms' ",
    load_rows!()
);

const LOAD_INBOX: &str = concat!(
    "INSERT INTO event_inbox (subscription, event_id, routing_key, payload, received_at, processed_at, attempts) \
     SELECT $4, v.id, 'harness.order.created', v.body, r.t + interval '10 ms', r.t + interval '15 ms', 1 ",
    load_rows!()
);

/// A table's shape at one instant.
#[derive(Debug, Clone, Copy, Default)]
struct Shape {
    heap_bytes: i64,
    index_bytes: i64,
    live: i64,
    dead: i64,
    autovacuums: i64,
}

/// A table's shape, summed over its partitions on the partitioned layout.
async fn shape(pool: &PgPool, table: &str) -> BoxResult<Shape> {
    let (heap_bytes, index_bytes, live, dead, autovacuums): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT coalesce(sum(pg_relation_size(relid)), 0)::BIGINT, \
                    coalesce(sum(pg_indexes_size(relid)), 0)::BIGINT, \
                    coalesce(sum(n_live_tup), 0)::BIGINT, coalesce(sum(n_dead_tup), 0)::BIGINT, \
                    coalesce(sum(autovacuum_count), 0)::BIGINT \
             FROM pg_stat_user_tables \
             WHERE relid = $1::regclass \
                OR relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = $1::regclass)",
        )
        .bind(table)
        .fetch_one(pool)
        .await?;
    Ok(Shape {
        heap_bytes,
        index_bytes,
        live,
        dead,
        autovacuums,
    })
}

/// The steady load: a foreground writing [`RATE`] events/s through
/// `publish_tx` on a thread and runtime of its own (as another service
/// would), a probe timing a claim of one row (then released) every 100 ms,
/// a drainer and a subscriber at defaults.
struct Steady {
    started: Instant,
    stop: tokio::sync::watch::Sender<bool>,
    foreground: tokio::task::JoinHandle<Result<Samples, String>>,
    probe: tokio::task::JoinHandle<Result<Samples, outbox::StoreError>>,
    drainer: DrainerHandle,
    subscriber: tokio::task::JoinHandle<Result<(), outbox::SubscribeError>>,
}

/// P10's handler: the inbox row is the whole effect.
struct Applies;

impl outbox::core::subscriber::Handler<outbox::PgTx> for Applies {
    async fn handle(
        &self,
        _tx: &mut outbox::PgTx,
        _event: &EventEnvelope,
    ) -> Result<(), outbox::HandlerError> {
        Ok(())
    }
}

fn subscription() -> outbox::SubscriberSettings {
    let mut s =
        outbox::SubscriberSettings::from_env(QUEUE, &["#"]).unwrap_or_else(|e| panic!("{e}"));
    s.spec.exchange = EXCHANGE.into();
    s
}

impl Steady {
    async fn start(pool: &PgPool, amqp_url: &str) -> BoxResult<Self> {
        let started = Instant::now();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let foreground = tokio::spawn(foreground::apart(
            pool,
            RATE,
            None,
            started,
            stopped.clone(),
        ));
        let probe = tokio::spawn(claim_probe(pool.clone(), started, stopped.clone()));
        // The handle's own janitor sweeps at once: with the longest
        // retention it finds nothing, and P10 runs the sweeps it measures.
        let config = DrainerConfig::builder()
            .exchange(EXCHANGE)
            .replica_id("harness-p10")
            .retention_days(outbox::config::RETENTION_DAYS_MAX)
            .build()
            .expect("defaults are valid");
        let broker = || LapinBroker::from_list(amqp_url).expect("--amqp-url checked at start");
        let drainer = DrainerHandle::spawn(pool.clone(), broker(), config);
        let subscriber = Arc::new(outbox::Subscriber::new(
            Arc::new(outbox::PgInboxStore::new(pool.clone())),
            Arc::new(broker()),
            Arc::new(outbox::TokioClock::default()),
            Arc::new(Applies),
            subscription(),
        ));
        let subscriber = tokio::spawn(async move { subscriber.run(stopped).await });
        Ok(Self {
            started,
            stop,
            foreground,
            probe,
            drainer,
            subscriber,
        })
    }

    /// Stops everything; the foreground's and the probe's samples.
    async fn stop(self) -> BoxResult<(Samples, Samples)> {
        let _ = self.stop.send(true);
        let probe = self.probe.await??;
        let foreground = self.foreground.await??;
        self.drainer.shutdown().await;
        self.subscriber.await??;
        Ok((foreground, probe))
    }
}

/// Every 100 ms until `stop`: one claim of at most one row for a replica
/// of its own, timed, and the row released at once.
async fn claim_probe(
    pool: PgPool,
    started: Instant,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Samples, outbox::StoreError> {
    const PROBE: &str = "harness-p10-probe";
    let store = PgOutboxStore::new(pool);
    let mut samples = Samples::default();
    loop {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = stop.changed() => break,
        }
        let t = Instant::now();
        let claimed = store
            .outbox_claim(ClaimParams {
                replica_id: PROBE,
                batch_size: 1,
                lease_ttl: Duration::from_secs(60),
                key_heads: &[],
                after: None,
            })
            .await?;
        samples.0.push((t - started, t.elapsed()));
        let ids: Vec<uuid::Uuid> = claimed.iter().map(|r| r.id).collect();
        if !ids.is_empty() {
            store.outbox_release(PROBE, &ids).await?;
        }
    }
    Ok(samples)
}

/// One janitor sweep's figures.
struct Swept {
    table: &'static str,
    rows: u64,
    expired_before: i64,
    /// Rows past retention after the sweep (on the partitioned layout, the
    /// ones in partitions not yet due whole).
    expired_after: i64,
    /// Partitions before and after the sweep.
    partitions: (i64, i64),
    wall: Duration,
    /// Offsets of the sweep from the steady load's start.
    from: Duration,
    to: Duration,
}

/// Rows of `table` past the seven days' retention.
async fn expired(pool: &PgPool, table: &str) -> BoxResult<i64> {
    let sql = match table {
        "event_outbox" => {
            "SELECT count(*) FROM event_outbox \
             WHERE published_at IS NOT NULL AND published_at < now() - interval '7 days'"
        }
        _ => {
            "SELECT count(*) FROM event_inbox \
             WHERE processed_at IS NOT NULL AND processed_at < now() - interval '7 days'"
        }
    };
    Ok(sqlx::query_scalar(sql).fetch_one(pool).await?)
}

/// How many partitions `table` has (0: the plain layout).
async fn partitions(pool: &PgPool, table: &str) -> BoxResult<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass")
            .bind(table)
            .fetch_one(pool)
            .await?,
    )
}

/// On a database just moved to the partitioned layout (its tables empty),
/// replaces the first partition (every id below the cut) by daily
/// partitions of the ten days before the cut, as the janitor would have
/// created them on a service partitioned for that long, so the load lands
/// in the partitions of its days.
pub async fn partition_past_days(pool: &PgPool) -> BoxResult<()> {
    use outbox::pg::partitions::{bound_at, partition_name};
    const DAY_MS: u64 = 86_400_000;
    for table in ["event_outbox", "event_inbox"] {
        let cut: i64 =
            sqlx::query_scalar("SELECT cut_ms FROM event_partitioning WHERE parent = $1")
                .bind(table)
                .fetch_one(pool)
                .await?;
        let cut = cut as u64;
        pool.execute(sqlx::AssertSqlSafe(format!("DROP TABLE {table}_p_first")))
            .await?;
        let fill = if table == "event_outbox" {
            " WITH (fillfactor = 50)"
        } else {
            ""
        };
        for day in 1..=10 {
            let lo = cut - day * DAY_MS;
            pool.execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE {} PARTITION OF {table} FOR VALUES FROM ('{}') TO ('{}'){fill}",
                partition_name(table, lo),
                bound_at(lo),
                bound_at(lo + DAY_MS)
            )))
            .await?;
        }
    }
    Ok(())
}

/// One sweep of each janitor at defaults, one after the other.
async fn sweeps(pool: &PgPool, started: Instant) -> BoxResult<Vec<Swept>> {
    let store = PgOutboxStore::new(pool.clone());
    let inbox = outbox::PgInboxStore::new(pool.clone());
    let config = DrainerConfig::builder()
        .exchange(EXCHANGE)
        .build()
        .expect("defaults are valid");
    let mut out = Vec::new();
    for table in ["event_outbox", "event_inbox"] {
        let expired_before = expired(pool, table).await?;
        eprintln!("  sweeping {table} ({expired_before} rows past retention) ...");
        let parts_before = partitions(pool, table).await?;
        let from = started.elapsed();
        let t = Instant::now();
        let rows = match table {
            "event_outbox" => sweep(&store, &config).await?,
            _ => sweep_inbox(&inbox, &InboxJanitorSettings::default()).await?,
        };
        let wall = t.elapsed();
        let to = started.elapsed();
        out.push(Swept {
            table,
            rows,
            expired_before,
            expired_after: expired(pool, table).await?,
            partitions: (parts_before, partitions(pool, table).await?),
            wall,
            from,
            to,
        });
    }
    Ok(out)
}

/// Waits (at most [`AUTOVACUUM_WAIT`]) until autovacuum has run on both
/// tables since `before`; how long that took, per table (`None`: not
/// within the wait).
async fn autovacuum_after(pool: &PgPool, before: &[Shape; 2]) -> BoxResult<[Option<Duration>; 2]> {
    let started = Instant::now();
    let mut done = [None, None];
    while started.elapsed() < AUTOVACUUM_WAIT && done.iter().any(Option::is_none) {
        for (i, table) in ["event_outbox", "event_inbox"].into_iter().enumerate() {
            if done[i].is_none() && shape(pool, table).await?.autovacuums > before[i].autovacuums {
                done[i] = Some(started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(done)
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn shape_row(table: &mut Vec<String>, name: &str, when: &str, s: Shape) {
    table.push(format!(
        "| P10 `{name}` {when} | heap {:.0} MiB, indexes {:.0} MiB, {} live, {} dead tuples | — | information |",
        mib(s.heap_bytes),
        mib(s.index_bytes),
        s.live,
        s.dead
    ));
}

/// The latency rows of one window against the quiet one.
fn latency_rows(
    table: &mut Vec<String>,
    what: &str,
    quiet: &[Duration],
    during: &[Duration],
    name: &str,
) {
    let quiet_p99 = percentile(quiet, 0.99);
    let p99 = percentile(during, 0.99);
    table.push(format!(
        "| P10 {what} during the {name} sweep ({} samples) against quiet ({}) | p50 {:.2} ms, p99 {:.2} ms against p50 {:.2} ms, p99 {:.2} ms | {:.2}× quiet p99 | information |",
        during.len(),
        quiet.len(),
        ms(percentile(during, 0.5)),
        ms(p99),
        ms(percentile(quiet, 0.5)),
        ms(quiet_p99),
        p99.as_secs_f64() / quiet_p99.as_secs_f64().max(1e-9)
    ));
}

/// Runs P10 over `rows` rows per table, adding its rows to `table` and its
/// keys to `json`.
pub async fn run(
    pool: &PgPool,
    amqp_url: &str,
    rows: u64,
    table: &mut Vec<String>,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> BoxResult<()> {
    eprintln!(
        "P10: loading {rows} published outbox rows and {rows} processed inbox rows over 8 days ..."
    );
    let load_rate = load(pool, rows).await?;
    table.push(format!(
        "| P10 bulk load, {rows} rows per table over 8 days | {load_rate:.0} rows/s | — | information |"
    ));
    let before = [
        shape(pool, "event_outbox").await?,
        shape(pool, "event_inbox").await?,
    ];
    eprintln!("P10: steady {RATE} events/s: a quiet {QUIET:?}, then one sweep of each janitor ...");
    let steady = Steady::start(pool, amqp_url).await?;
    tokio::time::sleep(QUIET).await;
    let quiet_to = steady.started.elapsed();
    let swept = sweeps(pool, steady.started).await?;
    let after = [
        shape(pool, "event_outbox").await?,
        shape(pool, "event_inbox").await?,
    ];
    eprintln!("P10: waiting for autovacuum ...");
    let vacuumed = autovacuum_after(pool, &after).await?;
    let (foreground, probe) = steady.stop().await?;
    report(
        table,
        json,
        &before,
        &after,
        &swept,
        &vacuumed,
        (&foreground, &probe),
        quiet_to,
    );
    pool.execute("TRUNCATE event_outbox, event_inbox, orders")
        .await?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn report(
    table: &mut Vec<String>,
    json: &mut serde_json::Map<String, serde_json::Value>,
    before: &[Shape; 2],
    after: &[Shape; 2],
    swept: &[Swept],
    vacuumed: &[Option<Duration>; 2],
    (foreground, probe): (&Samples, &Samples),
    quiet_to: Duration,
) {
    let names = ["event_outbox", "event_inbox"];
    for i in 0..2 {
        shape_row(table, names[i], "loaded", before[i]);
    }
    let quiet_fg = foreground.window(Duration::ZERO, quiet_to);
    let quiet_claim = probe.window(Duration::ZERO, quiet_to);
    for (i, s) in swept.iter().enumerate() {
        let removed = s.expired_before - s.expired_after;
        let rate = removed as f64 / s.wall.as_secs_f64().max(1e-9);
        table.push(format!(
            "| P10 one `{}` janitor sweep at defaults ({} rows past retention; partitions {} → {}) | {removed} rows gone ({} by row deletes) in {:.1} s, {rate:.0} rows/s; {} past retention left | — | information |",
            s.table,
            s.expired_before,
            s.partitions.0,
            s.partitions.1,
            s.rows,
            s.wall.as_secs_f64(),
            s.expired_after
        ));
        json.insert(
            format!(
                "p10_{}_sweep_removed",
                if i == 0 { "outbox" } else { "inbox" }
            ),
            removed.into(),
        );
        let key = if i == 0 { "outbox" } else { "inbox" };
        json.insert(format!("p10_{key}_sweep_rows"), s.rows.into());
        json.insert(format!("p10_{key}_sweep_secs"), s.wall.as_secs_f64().into());
        json.insert(format!("p10_{key}_sweep_rows_per_sec"), rate.into());
        let fg = foreground.window(s.from, s.to);
        let claim = probe.window(s.from, s.to);
        latency_rows(
            table,
            "foreground tx + `publish_tx` commit",
            &quiet_fg,
            &fg,
            s.table,
        );
        latency_rows(table, "claim of one row", &quiet_claim, &claim, s.table);
        json.insert(
            format!("p10_{key}_sweep_foreground_p99_ratio"),
            (percentile(&fg, 0.99).as_secs_f64()
                / percentile(&quiet_fg, 0.99).as_secs_f64().max(1e-9))
            .into(),
        );
    }
    for i in 0..2 {
        shape_row(table, names[i], "after the sweeps", after[i]);
        table.push(format!(
            "| P10 autovacuum on `{}` after the sweeps | {} | — | information |",
            names[i],
            vacuumed[i].map_or(
                format!("none within {} s", AUTOVACUUM_WAIT.as_secs()),
                |d| format!("ran within {:.0} s", d.as_secs_f64())
            )
        ));
    }
    json.insert("p10_outbox_heap_bytes".into(), before[0].heap_bytes.into());
    json.insert("p10_inbox_heap_bytes".into(), before[1].heap_bytes.into());
}
