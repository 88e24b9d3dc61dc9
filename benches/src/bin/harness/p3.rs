//! P3, restated (issue 28): what draining costs the database server per
//! event, where another service's commits would feel it: the CPU time of
//! the drainer's own PostgreSQL backends, the WAL bytes and the WAL flushes
//! (`benches::dbcost`), for the production drainer at defaults and, as a
//! contrast, the pre-#478 antipattern, each draining the same backlog in
//! the same run. Then, as information, a foreground at a steady 1 000
//! transactions/s for 60 s, each writing an order and its event with
//! `publish_tx`, without a drainer and with one draining the events as they
//! come: its commit latency, and what the drain added to the server's work
//! per event.
//!
//! (On a two-core machine that runs the database, the broker and the
//! harness, the foreground's tail moves with the machine's load more than
//! with anything the drainer does through the database, and idle p99 alone
//! moves 0.8–2.3 ms between runs: the latency rows are no target.)

use std::time::{Duration, Instant};

use benches::dbcost::{Cost, Meter};
use outbox::{DrainerConfig, DrainerHandle, LapinBroker, PgOutboxStore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

use super::{DRAIN_LIMIT, EXCHANGE, antipattern_drain, ms, percentile};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Whether any row is still to publish (parked rows aside; the backlogs
/// here park none).
const PENDING_ANY: &str =
    "SELECT EXISTS (SELECT 1 FROM event_outbox WHERE published_at IS NULL AND parked_at IS NULL)";

/// The `application_name` of the drained-by pool, by which the meter
/// finds its backends.
const DRAINER_APP: &str = "harness-p3-drainer";

/// The steady foreground's rate (transactions/s) and length.
const STEADY_RATE: u64 = 1_000;
const STEADY_SECS: u64 = 60;

/// Who drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// The production drainer, defaults.
    Drainer,
    /// The drainer's claim and mark statements alone, one after the other
    /// on the drainer's own sessions, each claim walking on from the last
    /// as a drain's do, no broker and no overlap: the floor
    /// of what the statements cost, against which the drainer's figure
    /// shows what its pipeline, its other statements and its neighbours
    /// add.
    Statements,
    /// The pre-#478 drainer (one transaction across the batch).
    Antipattern,
}

/// A pool like `pool` whose sessions are named `application_name`.
async fn named_pool(pool: &PgPool, application_name: &str) -> BoxResult<PgPool> {
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .application_name(application_name);
    Ok(PgPoolOptions::new().connect_with(options).await?)
}

/// The production drainer at defaults on `pool`.
fn drainer(pool: &PgPool, amqp_url: &str) -> DrainerHandle {
    let config = DrainerConfig::builder()
        .exchange(EXCHANGE)
        .replica_id("harness-p3")
        .build()
        .expect("defaults are valid");
    DrainerHandle::spawn(
        pool.clone(),
        LapinBroker::from_list(amqp_url).expect("--amqp-url checked at start"),
        config,
    )
}

/// Samples `meter` until nothing is pending (bounded by
/// [`DRAIN_LIMIT`]). Asks whether any row is pending, not how many: a
/// count of a 100 000-row backlog every 100 ms is most of a core on this
/// machine, and its snapshot, held while it scans, keeps the drainer's
/// dead index entries and row versions from being cleaned up as it goes,
/// so the meter's own probe would add to what it measures.
async fn until_drained(pool: &PgPool, meter: &mut Meter) -> BoxResult<()> {
    let started = Instant::now();
    while sqlx::query_scalar::<_, bool>(PENDING_ANY)
        .fetch_one(pool)
        .await?
    {
        if started.elapsed() > DRAIN_LIMIT {
            return Err(format!("not drained within {DRAIN_LIMIT:?}").into());
        }
        meter.sample().await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Claims and marks batch after batch through the production store on
/// `own` until a claim from the oldest row comes back empty, sampling
/// `meter` every 100 ms.
async fn statements_only(own: &PgPool, meter: &mut Meter) -> BoxResult<()> {
    let store = PgOutboxStore::new(own.clone());
    let started = Instant::now();
    let mut sampled = Instant::now();
    // Walked as a drain walks (`ClaimParams::after`): the drainer's own
    // `Walk`; a short claim ends the walk, and the loop ends on an empty
    // claim from the oldest row.
    let mut walk = outbox::core::drainer::Walk::default();
    loop {
        let after = walk.after();
        let (rows, marked) = benches::claim_and_mark_after(&store, "harness-p3", after).await?;
        walk.next(&rows, rows.len() >= benches::CLAIM_BATCH as usize);
        if rows.is_empty() {
            if after.is_none() {
                return Ok(());
            }
            continue;
        }
        if marked != rows.len() as u64 {
            return Err(format!("marked {marked} of {} rows claimed", rows.len()).into());
        }
        if started.elapsed() > DRAIN_LIMIT {
            return Err(format!("not drained within {DRAIN_LIMIT:?}").into());
        }
        if sampled.elapsed() >= Duration::from_millis(100) {
            meter.sample().await?;
            sampled = Instant::now();
        }
    }
}

/// The cost of draining `n` pre-filled rows flat out, and the rate.
async fn backlog_cost(
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    who: Drain,
) -> BoxResult<(Cost, f64)> {
    benches::prefill(pool, n).await?;
    let own = named_pool(pool, DRAINER_APP).await?;
    let mut meter = Meter::start(pool, DRAINER_APP).await?;
    let started = Instant::now();
    let cost = match who {
        Drain::Drainer => {
            let handle = drainer(&own, amqp_url);
            until_drained(pool, &mut meter).await?;
            let cost = meter.finish().await?;
            handle.shutdown().await;
            cost
        }
        Drain::Statements => {
            statements_only(&own, &mut meter).await?;
            meter.finish().await?
        }
        Drain::Antipattern => {
            let (_stop_tx, stop) = tokio::sync::watch::channel(false);
            let task = tokio::spawn(antipattern_drain(own.clone(), amqp_url.to_owned(), stop));
            until_drained(pool, &mut meter).await?;
            let cost = meter.finish().await?;
            task.await?.map_err(|e| e.to_string())?;
            cost
        }
    };
    let rate = n as f64 / started.elapsed().as_secs_f64();
    own.close().await;
    pool.execute("TRUNCATE event_outbox").await?;
    Ok((cost, rate))
}

/// One steady run: the foreground's latencies and what the run cost the
/// server (with `drain`, a drainer at defaults drains the events as they
/// come, and the meter also covers its catching up at the end).
async fn steady(pool: &PgPool, amqp_url: &str, drain: bool) -> BoxResult<(Vec<Duration>, Cost)> {
    let own = named_pool(pool, DRAINER_APP).await?;
    let mut meter = Meter::start(pool, DRAINER_APP).await?;
    let handle = drain.then(|| drainer(&own, amqp_url));
    // Never stopped: it runs its count.
    let (_, never) = tokio::sync::watch::channel(false);
    let foreground = super::foreground::apart(
        pool,
        STEADY_RATE,
        Some(STEADY_RATE * STEADY_SECS),
        Instant::now(),
        never,
    );
    tokio::pin!(foreground);
    let latencies = loop {
        tokio::select! {
            samples = &mut foreground => break samples?.sorted(),
            () = tokio::time::sleep(Duration::from_millis(500)) => meter.sample().await?,
        }
    };
    if handle.is_some() {
        until_drained(pool, &mut meter).await?;
    }
    let cost = meter.finish().await?;
    if let Some(h) = handle {
        h.shutdown().await;
    }
    own.close().await;
    pool.execute("TRUNCATE event_outbox, orders").await?;
    Ok((latencies, cost))
}

/// Runs P3 over a backlog of `n` rows and the steady foreground, adding
/// its rows to `table` and its keys to `json`.
pub async fn run(
    pool: &PgPool,
    amqp_url: &str,
    n: usize,
    table: &mut Vec<String>,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> BoxResult<()> {
    for (who, key, name, target) in [
        (
            Drain::Drainer,
            "p3",
            "the drainer, defaults",
            "≤ ½ of the drainer before issue 28",
        ),
        (
            Drain::Statements,
            "p3_statements",
            "its claim and mark statements alone, in turn, no broker",
            "floor (information)",
        ),
        (
            Drain::Antipattern,
            "p3_antipattern",
            "the pre-#478 antipattern",
            "contrast",
        ),
    ] {
        eprintln!("P3: the database's cost of draining {n} rows, {name} ...");
        let (cost, rate) = backlog_cost(pool, amqp_url, n, who).await?;
        let (cpu_us, wal_bytes, flushes) = cost.per(n as u64);
        table.push(format!(
            "| P3 database cost per event drained, {name}, {n} rows ({rate:.0} rows/s, {} backends) | \
             CPU {cpu_us:.1} µs, WAL {wal_bytes:.0} bytes, {flushes:.4} WAL flushes | — | {target} |",
            cost.backends
        ));
        json.insert(format!("{key}_cpu_us_per_event"), cpu_us.into());
        json.insert(format!("{key}_wal_bytes_per_event"), wal_bytes.into());
        json.insert(format!("{key}_wal_flushes_per_event"), flushes.into());
        json.insert(format!("{key}_drain_rows_per_sec"), rate.into());
    }

    steady_cost(pool, amqp_url, table, json).await
}

/// The steady foreground without a drainer, then with one: what the drain
/// adds per event, and the foreground's latency either way.
async fn steady_cost(
    pool: &PgPool,
    amqp_url: &str,
    table: &mut Vec<String>,
    json: &mut serde_json::Map<String, serde_json::Value>,
) -> BoxResult<()> {
    eprintln!(
        "P3: a foreground at {STEADY_RATE} tx/s for {STEADY_SECS} s, without a drainer, then with one ..."
    );
    let (idle, idle_cost) = steady(pool, amqp_url, false).await?;
    let (draining, drain_cost) = steady(pool, amqp_url, true).await?;
    let events = STEADY_RATE * STEADY_SECS;
    let added = Cost {
        cpu: drain_cost.cpu,
        wal_bytes: drain_cost.wal_bytes.saturating_sub(idle_cost.wal_bytes),
        wal_flushes: drain_cost.wal_flushes.saturating_sub(idle_cost.wal_flushes),
        backends: drain_cost.backends,
    };
    let (cpu_us, wal_bytes, flushes) = added.per(events);
    table.push(format!(
        "| P3 database cost the drain adds per event, steady {STEADY_RATE} events/s | \
         CPU {cpu_us:.1} µs, WAL {wal_bytes:.0} bytes, {flushes:.4} WAL flushes | — | information |"
    ));
    json.insert("p3_steady_cpu_us_per_event".into(), cpu_us.into());
    json.insert("p3_steady_wal_bytes_per_event".into(), wal_bytes.into());
    json.insert("p3_steady_wal_flushes_per_event".into(), flushes.into());
    let idle_p99 = percentile(&idle, 0.99);
    for (name, l) in [
        ("no drainer", &idle),
        ("a drainer draining them", &draining),
    ] {
        let (p50, p99) = (percentile(l, 0.5), percentile(l, 0.99));
        table.push(format!(
            "| P3 foreground tx + `publish_tx` at {STEADY_RATE}/s for {STEADY_SECS} s, {name} | \
             p50 {:.2} ms, p99 {:.2} ms, max {:.1} ms | {:.2}× no-drainer p99 | information |",
            ms(p50),
            ms(p99),
            ms(l.last().copied().unwrap_or_default()),
            p99.as_secs_f64() / idle_p99.as_secs_f64()
        ));
    }
    json.insert(
        "p3_foreground_ms".into(),
        serde_json::json!({
            "no_drainer": { "p50": ms(percentile(&idle, 0.5)), "p99": ms(idle_p99) },
            "draining": { "p50": ms(percentile(&draining, 0.5)), "p99": ms(percentile(&draining, 0.99)) },
        }),
    );
    json.insert(
        "p3_ratio".into(),
        (percentile(&draining, 0.99).as_secs_f64() / idle_p99.as_secs_f64()).into(),
    );
    Ok(())
}
