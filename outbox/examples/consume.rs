//! A subscriber whose handler writes one domain row per event (so effects
//! can be counted in SQL: `SELECT count(*), count(DISTINCT event_id) FROM
//! consume_effects`), optionally failing every K-th first attempt. Prints
//! processed / duplicates absorbed / dead-lettered and the rate.
//!
//! ```text
//! cargo run --release -p outbox --example consume -- --queue demo.orders --binding 'demo.#' \
//!     [--exit-after N] [--fail-every K] [--prefill N [--duplicate-ratio R]] \
//!     [--exchange canopy.events] [--database-url URL] [--amqp-url URL[,URL...]]
//! ```
//!
//! `--prefill N` first publishes N envelopes (with publisher confirms) whose
//! routing key matches `demo.prefill`, each one again with probability R
//! (same message id: what a republish after a lost mark looks like), so a
//! run measures itself. Stops after `--exit-after` deliveries are settled
//! (by default, with `--prefill`, every prefilled message), or on Ctrl-C;
//! in-flight deliveries finish first. The rate is measured from the first
//! to the last settled delivery.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use outbox::amqp::redact_url;
use outbox::core::ports::{Broker, Confirm, OutgoingMessage, PublishChannel};
use outbox::core::subscriber::SubscriberStats;
use outbox::{
    EventEnvelope, Handler, HandlerError, LapinBroker, PgInboxStore, PgTx, Subscriber,
    SubscriberSettings, TokioClock,
};
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;

/// Publishes in flight while prefilling.
const PREFILL_DEPTH: usize = 256;

/// Consumes a subscription through the inbox, one domain row per applied
/// event, measuring the run.
#[derive(Debug, Parser)]
#[command(name = "consume", version, about, long_about = None)]
struct Args {
    /// The subscription's queue.
    #[arg(long, value_name = "NAME")]
    queue: String,
    /// The routing key pattern the queue is bound with.
    #[arg(long, value_name = "KEY")]
    binding: String,
    /// The exchange the queue is bound to (default: the library's).
    #[arg(long, value_name = "NAME")]
    exchange: Option<String>,
    /// Stop after this many deliveries are settled (default, with
    /// `--prefill`: every prefilled message).
    #[arg(long, value_name = "N")]
    exit_after: Option<u64>,
    /// Every K-th event fails its first attempt.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    fail_every: Option<u64>,
    /// First publish N envelopes (with publisher confirms).
    #[arg(long, value_name = "N", default_value_t = 0)]
    prefill: u64,
    /// The share of prefilled envelopes published twice.
    #[arg(long, value_name = "R", default_value_t = 0.0, value_parser = ratio)]
    duplicate_ratio: f64,
    /// The service's database.
    #[arg(
        long,
        value_name = "URL",
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    /// The broker's nodes, comma-separated (default: the local broker).
    #[arg(
        long,
        value_name = "URL[,URL...]",
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_default_value = true
    )]
    amqp_url: String,
}

fn ratio(v: &str) -> Result<f64, String> {
    v.parse()
        .ok()
        .filter(|r: &f64| (0.0..=1.0).contains(r))
        .ok_or_else(|| format!("must be in 0..=1, got {v:?}"))
}

/// One domain row per applied event; every K-th event fails its first
/// attempt.
struct Effects {
    fail_every: Option<u64>,
    first_seen: AtomicU64,
    failed_once: std::sync::Mutex<BTreeSet<uuid::Uuid>>,
}

impl Handler<PgTx> for Effects {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        if let Some(k) = self.fail_every {
            let mut failed = self.failed_once.lock().expect("lock");
            if !failed.contains(&event.id) {
                let n = self.first_seen.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_multiple_of(k) {
                    failed.insert(event.id);
                    return Err(HandlerError::msg(format!(
                        "deliberate failure of first attempt #{n}"
                    )));
                }
            }
        }
        sqlx::query("INSERT INTO consume_effects (event_id, routing_key) VALUES ($1, $2)")
            .bind(event.id)
            .bind(&event.routing_key)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

fn settled(s: &SubscriberStats) -> u64 {
    s.processed + s.duplicates + s.dead_lettered + s.undecodable
}

/// A small deterministic generator for the duplicate choice.
fn next_unit(state: &mut u64) -> f64 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1);
    (*state >> 11) as f64 / (1u64 << 53) as f64
}

async fn prefill(broker: &LapinBroker, exchange: &str, args: &Args) -> Result<u64, String> {
    let mut ch = broker.channel_open().await.map_err(|e| e.to_string())?;
    ch.channel_confirm_select()
        .await
        .map_err(|e| e.to_string())?;
    let mut pending = std::collections::VecDeque::new();
    let mut sent = 0u64;
    let mut rng = 0x5eed_u64;
    for i in 0..args.prefill {
        let e = EventEnvelope::new("demo.prefill", serde_json::json!({ "n": i }));
        let body = e.encode(&Default::default()).map_err(|e| e.to_string())?;
        let copies = if next_unit(&mut rng) < args.duplicate_ratio {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let confirm = ch
                .channel_publish(OutgoingMessage {
                    exchange,
                    routing_key: &e.routing_key,
                    message_id: e.id,
                    body: body.as_bytes(),
                    trace: None,
                    ordering: None,
                })
                .await
                .map_err(|e| e.to_string())?;
            pending.push_back(confirm);
            sent += 1;
            if pending.len() >= PREFILL_DEPTH {
                let c = pending.pop_front().expect("non-empty");
                if c.await.map_err(|e| e.to_string())? != Confirm::Ack {
                    return Err("the broker refused a prefill message".into());
                }
            }
        }
    }
    for c in pending {
        if c.await.map_err(|e| e.to_string())? != Confirm::Ack {
            return Err("the broker refused a prefill message".into());
        }
    }
    ch.channel_close().await;
    Ok(sent)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut settings = SubscriberSettings::from_env(args.queue.as_str(), &[args.binding.as_str()])?;
    if let Some(x) = &args.exchange {
        settings.spec.exchange = x.clone();
    }
    if args.prefill > 0 {
        // The prefill's routing key must reach the queue.
        settings.spec.bindings.push("demo.prefill".into());
    }
    settings.validate()?;
    // One host, or libpq's node list (`h1:p1,h2:p2` and
    // `target_session_attrs=read-write`): the pool follows the writable node.
    let pool = outbox::pg::nodes::connect(
        &args.database_url,
        PgPoolOptions::new().max_connections(settings.concurrency + 4),
    )
    .await
    .map_err(|e| format!("cannot connect to {}: {e}", redact_url(&args.database_url)))?;
    outbox::migrate::run(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS consume_effects (event_id UUID NOT NULL, routing_key TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let broker = Arc::new(LapinBroker::from_list(&args.amqp_url)?);
    // Declare the topology first, so a prefill reaches the queue.
    {
        let conn = broker.connection().await?;
        let ch = conn.create_channel().await?;
        LapinBroker::declare_subscription(&ch, &settings.spec).await?;
        let _ = ch.close(200, "OK".into()).await;
    }
    let mut exit_after = args.exit_after;
    if args.prefill > 0 {
        let t = Instant::now();
        let sent = prefill(&broker, &settings.spec.exchange, &args).await?;
        println!(
            "prefilled {sent} messages ({} events) in {:.2} s",
            args.prefill,
            t.elapsed().as_secs_f64()
        );
        // Unless told otherwise, stop once every prefilled message settled.
        exit_after.get_or_insert(sent);
    }

    let handler = Arc::new(Effects {
        fail_every: args.fail_every,
        first_seen: AtomicU64::new(0),
        failed_once: Default::default(),
    });
    let subscriber = Arc::new(Subscriber::new(
        Arc::new(PgInboxStore::new(pool.clone())),
        broker.clone(),
        Arc::new(TokioClock::default()),
        handler,
        settings.clone(),
    ));
    let counters = subscriber.counters();
    let (stop, rx) = watch::channel(false);
    let runner = {
        let s = subscriber.clone();
        tokio::spawn(async move { s.run(rx).await })
    };
    println!(
        "consuming {} (bindings {:?}, prefetch {}, concurrency {}, max attempts {})",
        settings.spec.queue,
        settings.spec.bindings,
        settings.spec.prefetch,
        settings.concurrency,
        settings.max_attempts
    );
    let mut started: Option<Instant> = None;
    let mut last_settled_at = Instant::now();
    let mut last_settled = 0;
    loop {
        tokio::select! {
            biased;
            _ = tokio::signal::ctrl_c() => break,
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        if runner.is_finished() {
            break;
        }
        let n = settled(&counters.snapshot());
        if n > 0 && started.is_none() {
            started = Some(Instant::now());
        }
        if n > last_settled {
            last_settled = n;
            last_settled_at = Instant::now();
        }
        if exit_after.is_some_and(|limit| n >= limit) {
            break;
        }
    }
    let _ = stop.send(true);
    runner.await??;
    broker.close().await;

    let s = counters.snapshot();
    let secs = started
        .map(|t| last_settled_at.duration_since(t).as_secs_f64())
        .unwrap_or(0.0)
        .max(1e-9);
    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM consume_effects")
            .fetch_one(&pool)
            .await?;
    println!(
        "processed {}  duplicates absorbed {}  retried {}  dead-lettered {}  undecodable {}",
        s.processed, s.duplicates, s.retried, s.dead_lettered, s.undecodable
    );
    println!(
        "{} deliveries settled in {secs:.2} s = {:.0} deliveries/s ({:.0} events applied/s)",
        settled(&s),
        settled(&s) as f64 / secs,
        s.processed as f64 / secs
    );
    println!("consume_effects: {rows} rows, {distinct} distinct events (all time, this database)");
    Ok(())
}
