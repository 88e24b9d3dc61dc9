//! Writes N domain rows, each with an envelope through `publish_tx` in the
//! same transaction, then runs the production drainer until nothing is
//! pending, and prints events, seconds and events/s.
//!
//! ```text
//! cargo run --release -p outbox --example produce -- --count 100000 \
//!     [--exchange canopy.events] [--routing-key demo.order.created] \
//!     [--database-url postgres://postgres@127.0.0.1:5432/postgres] \
//!     [--amqp-url amqp://guest:guest@127.0.0.1:5672/%2f[,amqp://...]]
//! ```

use std::time::{Duration, Instant};

use clap::Parser;

use outbox::amqp::redact_url;
use outbox::{DrainerConfig, DrainerHandle, EventEnvelope, LapinBroker, Publisher};
use sqlx::postgres::PgPoolOptions;

/// Domain rows written per transaction while filling the outbox.
const ROWS_PER_TX: usize = 500;
/// Longest the example waits for the drainer.
const DRAIN_LIMIT: Duration = Duration::from_secs(3600);

/// Commits events through `publish_tx` and drains them to the broker,
/// measuring the drain.
#[derive(Debug, Parser)]
#[command(name = "produce", version, about, long_about = None)]
struct Args {
    /// Events to commit and drain.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    count: usize,
    /// The exchange the drainer publishes to.
    #[arg(long, value_name = "NAME", default_value = "canopy.events")]
    exchange: String,
    /// Every event's routing key.
    #[arg(long, value_name = "KEY", default_value = "demo.order.created")]
    routing_key: String,
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // One host, or libpq's node list (`h1:p1,h2:p2` and
    // `target_session_attrs=read-write`): the pool follows the writable node.
    let pool =
        outbox::pg::nodes::connect(&args.database_url, PgPoolOptions::new().max_connections(8))
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", redact_url(&args.database_url)))?;
    outbox::migrate::run(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS produce_demo_orders (
             id UUID PRIMARY KEY,
             n BIGINT NOT NULL,
             created_at TIMESTAMPTZ NOT NULL DEFAULT now()
         )",
    )
    .execute(&pool)
    .await?;

    let broker = LapinBroker::from_list(&args.amqp_url)?;
    broker
        .declare_topic_exchange(&args.exchange)
        .await
        .map_err(|e| format!("cannot reach {}: {e}", broker.redacted_url()))?;

    let publisher = Publisher::new(pool.clone());
    let before = publisher.outbox_pending_count().await?;
    let started = Instant::now();
    let mut written = 0;
    while written < args.count {
        let mut tx = pool.begin().await?;
        for _ in 0..ROWS_PER_TX.min(args.count - written) {
            let env = EventEnvelope::new(
                args.routing_key.clone(),
                serde_json::json!({ "order": written, "amount_cents": 1299, "currency": "USD" }),
            );
            sqlx::query("INSERT INTO produce_demo_orders (id, n) VALUES ($1, $2)")
                .bind(env.id)
                .bind(written as i64)
                .execute(&mut *tx)
                .await?;
            publisher.publish_tx(&mut tx, &env).await?;
            written += 1;
        }
        tx.commit().await?;
    }
    let write_secs = started.elapsed().as_secs_f64();
    println!(
        "wrote    {written} domain rows + envelopes in {write_secs:.2} s ({:.0}/s); {before} were already pending",
        written as f64 / write_secs
    );

    let config = DrainerConfig::builder()
        .exchange(args.exchange.clone())
        .replica_id(format!("produce-{}", std::process::id()))
        .build()?;
    let drain_started = Instant::now();
    let handle = DrainerHandle::spawn(pool.clone(), broker, config);
    let mut pending = publisher.outbox_pending_count().await?;
    while pending > 0 {
        if drain_started.elapsed() > DRAIN_LIMIT {
            return Err(format!("{pending} events still pending after {DRAIN_LIMIT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        pending = publisher.outbox_pending_count().await?;
    }
    let secs = drain_started.elapsed().as_secs_f64();
    handle.shutdown().await;
    let events = written as u64 + before;
    println!(
        "drained  {events} events in {secs:.2} s: {:.0} events/s (exchange {})",
        events as f64 / secs,
        args.exchange
    );
    Ok(())
}
