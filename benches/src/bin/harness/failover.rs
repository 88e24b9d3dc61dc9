//! How long an orderly switchover interrupts the service (`--only
//! failover`, against `.ci/pg-pair`'s primary): a drainer and a
//! subscription at defaults on the node list of both nodes, an event
//! committed every 10 ms, then the primary turned read-only in place and
//! the standby promoted; measured from `promote`'s return to the first
//! event committed after it being published, and applied. Then back the
//! other way (so the pair ends as it began), measured the same, and the
//! old primary rejoined as a standby each time.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use sqlx::{Executor, PgPool};

use super::EXCHANGE;
use super::sections::Sheet;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The harness's database on both nodes of the pair, read-write first.
const NODES: &str = "postgres://postgres@127.0.0.1:5441,127.0.0.1:5442/outbox_harness\
                     ?target_session_attrs=read-write";
/// The subscription's queue.
const QUEUE: &str = "harness.failover";

/// Runs `.ci/pg-pair` with `args`.
fn pair(args: &[&str]) -> BoxResult<()> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/pg-pair");
    let out = Command::new(script).args(args).output()?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        ".ci/pg-pair {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    )
    .into())
}

/// Stamps each event it applies.
struct Stamp;

impl outbox::Handler<outbox::PgTx> for Stamp {
    async fn handle(
        &self,
        tx: &mut outbox::PgTx,
        event: &outbox::EventEnvelope,
    ) -> Result<(), outbox::HandlerError> {
        sqlx::query("INSERT INTO failover_applied (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// One switchover from node `from` (1 or 2): the clock time (on the new
/// primary) `promote` returned at, then the first event committed after
/// it published and applied, as seconds after it.
async fn switchover(pool: &PgPool, from: u8) -> BoxResult<(f64, f64)> {
    let node = format!("pg{from}");
    pair(&["readonly", &node])?;
    pair(&["promote"])?;
    let promoted_at = Instant::now();
    let at: time::OffsetDateTime = loop {
        match sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(pool)
            .await
        {
            Ok(at) => break at,
            Err(_) if promoted_at.elapsed() < Duration::from_secs(60) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    // The read's own delay belongs to the service's interruption.
    let at = at - promoted_at.elapsed();
    let started = Instant::now();
    let row = loop {
        let row: Option<(f64, f64)> = sqlx::query_as(
            "SELECT extract(epoch FROM o.published_at - $1)::float8, \
                    extract(epoch FROM a.applied_at - $1)::float8 \
             FROM event_outbox o JOIN failover_applied a ON a.event_id = o.id \
             WHERE o.enqueued_at > $1 ORDER BY o.enqueued_at LIMIT 1",
        )
        .bind(at)
        .fetch_optional(pool)
        .await
        .ok()
        .flatten();
        if let Some(row) = row {
            break row;
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(
                format!("nothing committed after the switchover from {node} took effect").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    pair(&["rejoin", &node])?;
    Ok(row)
}

/// The switchover's interruption, both ways.
pub async fn section(s: &mut Sheet<'_>) -> BoxResult<()> {
    eprintln!("failover: an orderly switchover each way under a steady stream of events ...");
    s.pool
        .execute("CREATE TABLE failover_applied (event_id uuid NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())")
        .await?;
    let pool = outbox::pg::nodes::connect(
        NODES,
        sqlx::postgres::PgPoolOptions::new().max_connections(8),
    )
    .await?;
    let mut settings = outbox::SubscriberSettings::new(QUEUE, &["#"]);
    settings.spec.exchange = EXCHANGE.into();
    let config = outbox::DrainerConfig::builder()
        .exchange(EXCHANGE)
        .build()?;
    let outbox = outbox::Outbox::builder(pool.clone())
        .amqp_urls(s.args.amqp_url.as_str())
        .drainer(config)
        .subscribe(settings, Stamp)
        .skip_migrations()
        .start()
        .await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let producer = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let publisher = outbox::Publisher::new(pool.clone());
            while !*stopped.borrow() {
                let _ = publisher.publish(&benches::envelope(0)).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let there = switchover(&pool, 1).await;
    let back = match there {
        Ok(_) => switchover(&pool, 2).await,
        Err(_) => Ok((0.0, 0.0)),
    };
    let _ = stop.send(true);
    producer.await?;
    outbox.shutdown().await?;
    let ch = s.conn.create_channel().await?;
    for q in [QUEUE.to_owned(), format!("{QUEUE}.dlq")] {
        ch.queue_delete(q.as_str().into(), Default::default())
            .await?;
    }
    let ((pub1, app1), (pub2, app2)) = (there?, back?);
    s.row(format!(
        "| orderly switchover, defaults: `promote` to the first event committed after it published / applied (pg1 → pg2, then back) | {pub1:.2} s / {app1:.2} s, {pub2:.2} s / {app2:.2} s | — | ≤ 5 s |"
    ));
    s.key("failover_published_secs", pub1.max(pub2));
    s.key("failover_applied_secs", app1.max(app2));
    Ok(())
}
