//! The processes of a chaos run, each its own OS process of the `chaos`
//! binary, configured by environment variables the orchestrator sets:
//!
//! - `chaos producer`: writes domain rows with `publish_tx` and
//!   `publish_many_tx` at a steady rate (open loop), some transactions
//!   rolled back, a few events whose routing key no broker accepts
//!   (written by hand, bypassing `publish_tx`: they must park), a few
//!   poison events (`shipping` refuses them: they must be dead-lettered
//!   there). Every event's domain row commits with it, so the domain table
//!   is the record of what committed. Writes `producer.json` at the end.
//! - `chaos drainer`: `DrainerHandle::spawn`, the library's entry point.
//! - `chaos subscriber`: a `Subscriber` of one subscription, its handler
//!   writing one effect row per event in the handler's transaction.
//!
//! Each runs until SIGTERM (the producer until it is done) and shuts down
//! as a service would.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::envelope::EnvelopeLimits;
use outbox::{
    DrainerConfig, DrainerHandle, EventEnvelope, Handler, HandlerError, LapinBroker, PgInboxStore,
    PgTx, Publisher, Subscriber, TokioClock,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;

use super::{
    CONFIRM_TIMEOUT, DRAINER_MAX_ATTEMPTS, EXCHANGE, LEASE_TTL, ROUTING_ORDER, ROUTING_POISON, Rng,
    SUBSCRIBER_MAX_ATTEMPTS, TRANSIENT_ONE_IN,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A variable the orchestrator sets.
fn var(name: &str) -> Result<String, BoxError> {
    std::env::var(name).map_err(|_| format!("{name} is not set (the orchestrator sets it)").into())
}

fn number<T: std::str::FromStr>(name: &str) -> Result<T, BoxError> {
    let v = var(name)?;
    v.parse()
        .map_err(|_| format!("{name}={v:?} is not a number").into())
}

/// A pool that keeps trying: the database may be restarting when the
/// process starts.
fn pool(url: &str, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(url)
        .expect("the orchestrator passes a valid URL")
}

/// Resolves at SIGTERM (or Ctrl-C).
async fn terminated() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// What an event is, in the producer's domain table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An ordinary event: every subscription applies it.
    Order,
    /// `shipping` always refuses it; `billing` applies it.
    Poison,
    /// Written with an empty routing key: no broker accepts it, it parks.
    Unpublishable,
}

impl Kind {
    /// The domain table's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Order => "order",
            Kind::Poison => "poison",
            Kind::Unpublishable => "unpublishable",
        }
    }
}

/// The producer's domain table; the audit of every mark: for each row a
/// statement sets `published_at` on, who held its claim then and who marked
/// it (`chaos_replica()`: the marking session's `application_name`, which
/// each drainer sets to its replica id, less the suffix the library gives
/// the drainer's own sessions, `outbox::pg::DRAIN_APPLICATION_SUFFIX`; the
/// `claimed_by` guard means the two are the same, even for a mark that
/// arrives late); and the mark stall the `stall_marks` fault arms (a mark
/// statement of a stalled replica waits, before it reads a row, until the
/// stall's end, and counts itself in `chaos_stall.stalled`).
pub fn orders_ddl() -> String {
    let suffix = outbox::pg::DRAIN_APPLICATION_SUFFIX;
    format!(
        "CREATE TABLE chaos_orders (\
         id BIGSERIAL PRIMARY KEY, event_id UUID NOT NULL UNIQUE, kind TEXT NOT NULL, \
         at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()); \
         CREATE FUNCTION chaos_replica() RETURNS text LANGUAGE sql STABLE AS $$ \
           SELECT regexp_replace(current_setting('application_name'), ' {suffix}$', '') $$; \
         CREATE TABLE chaos_marks (id UUID NOT NULL, claimed_by TEXT, marked_by TEXT NOT NULL); \
         CREATE FUNCTION chaos_audit_mark() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO chaos_marks VALUES (NEW.id, OLD.claimed_by, chaos_replica()); \
           RETURN NEW; END $$; \
         CREATE TRIGGER chaos_audit_mark AFTER UPDATE OF published_at ON event_outbox \
           FOR EACH ROW EXECUTE FUNCTION chaos_audit_mark(); \
         CREATE TABLE chaos_stall (replica TEXT PRIMARY KEY, until TIMESTAMPTZ NOT NULL, \
           stalled BIGINT NOT NULL DEFAULT 0); \
         CREATE FUNCTION chaos_stall_mark() RETURNS trigger LANGUAGE plpgsql AS $$ \
           DECLARE u TIMESTAMPTZ; BEGIN \
             SELECT until INTO u FROM chaos_stall WHERE replica = chaos_replica(); \
             IF u > clock_timestamp() THEN \
               UPDATE chaos_stall SET stalled = stalled + 1 WHERE replica = chaos_replica(); \
               PERFORM pg_sleep(extract(epoch FROM u - clock_timestamp())); \
             END IF; \
             RETURN NULL; END $$; \
         CREATE TRIGGER chaos_stall_mark BEFORE UPDATE OF published_at ON event_outbox \
           FOR EACH STATEMENT EXECUTE FUNCTION chaos_stall_mark()"
    )
}

/// A subscription's domain table: one row per effect, no key, so a double
/// effect shows; `n` numbers the effects in the order they were written
/// (one key's effects are written one transaction after the other, under
/// the key's lock, so in the order they committed).
pub const EFFECTS_DDL: &str = "CREATE TABLE chaos_effects (\
     n BIGSERIAL, event_id UUID NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()); \
     CREATE TABLE chaos_failed_once (event_id UUID PRIMARY KEY)";

/// Most attempts at one transaction before the producer gives up on it
/// (the run then fails: the producer reports it).
const TX_RETRIES_MAX: u32 = 600;

/// Transactions in flight at once, each on a connection of its own.
const WRITERS: usize = 8;

/// The producer's plan so far: which transaction comes next.
#[derive(Default)]
struct Next {
    tx: u64,
    events: u64,
}

/// One transaction of the plan: its events (from event number `first`)
/// and whether it rolls back.
struct Planned {
    first: u64,
    events: Vec<(EventEnvelope, Kind)>,
    rollback: bool,
}

/// Transaction `next.tx`, drawn from its own stream (so the plan does not
/// depend on which writer takes it).
/// With `keys` > 0, every order event carries one of `keys` ordering keys
/// (poison and unpublishable events none: a key behind a dead-lettered or
/// parked event waits for an operator).
fn plan_tx(seed: u64, next: &mut Next, total: u64, keys: u64) -> Option<Planned> {
    if next.events >= total {
        return None;
    }
    let mut rng = Rng::new(seed, &format!("chaos producer tx {}", next.tx));
    // One transaction in ten writes five events with publish_many_tx.
    let n = if rng.below(10) == 0 { 5 } else { 1 }.min(total - next.events);
    let events = (0..n)
        .map(|i| {
            let kind = match rng.below(1000) {
                0..2 => Kind::Unpublishable,
                2..7 => Kind::Poison,
                _ => Kind::Order,
            };
            let key = if kind == Kind::Poison {
                ROUTING_POISON
            } else {
                ROUTING_ORDER
            };
            let payload = serde_json::json!({ "n": next.events + i, "kind": kind.name() });
            let envelope = EventEnvelope::new(key, payload);
            let envelope = if keys > 0 && kind == Kind::Order {
                envelope.with_ordering_key(super::ordering_key(rng.below(keys)))
            } else {
                envelope
            };
            (envelope, kind)
        })
        .collect();
    let planned = Planned {
        first: next.events,
        events,
        rollback: rng.below(100) < 3,
    };
    next.tx += 1;
    next.events += n;
    Some(planned)
}

/// `chaos producer`: `CHAOS_DB`, `CHAOS_EVENTS`, `CHAOS_RATE` (events/s),
/// `CHAOS_SEED`, `CHAOS_ORDERING_KEYS`, `CHAOS_OUT`. Open loop: event k is due at k / rate, however
/// long earlier transactions took, written by [`WRITERS`] writers at once.
pub async fn producer() -> Result<(), BoxError> {
    let url = var("CHAOS_DB")?;
    let events: u64 = number("CHAOS_EVENTS")?;
    let rate: f64 = number("CHAOS_RATE")?;
    let seed: u64 = number("CHAOS_SEED")?;
    let keys: u64 = number("CHAOS_ORDERING_KEYS")?;
    let out = var("CHAOS_OUT")?;
    let pool = pool(&url, WRITERS as u32);
    let publisher = Publisher::new(pool.clone());
    let started = Instant::now();
    let next = Arc::new(std::sync::Mutex::new(Next::default()));
    let rolled_back = Arc::new(std::sync::Mutex::new(Vec::new()));
    let abandoned = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let (pool, publisher) = (pool.clone(), publisher.clone());
            let (next, rolled_back, abandoned) =
                (next.clone(), rolled_back.clone(), abandoned.clone());
            tokio::spawn(async move {
                loop {
                    let Some(tx) = plan_tx(seed, &mut next.lock().expect("next"), events, keys)
                    else {
                        return;
                    };
                    let due = started + Duration::from_secs_f64(tx.first as f64 / rate);
                    tokio::time::sleep_until(due.into()).await;
                    let done = write_retried(&pool, &publisher, &tx).await;
                    let n = tx.events.len() as u64;
                    if !done {
                        abandoned.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                    } else if tx.rollback {
                        rolled_back
                            .lock()
                            .expect("rolled back")
                            .extend(tx.events.iter().map(|(e, _)| e.id));
                    }
                }
            })
        })
        .collect();
    let progress = {
        let next = next.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let n = next.lock().expect("next").events;
                eprintln!("producer: {n}/{events} events started");
            }
        })
    };
    for w in writers {
        w.await?;
    }
    progress.abort();
    let abandoned = abandoned.load(std::sync::atomic::Ordering::Relaxed);
    let report = serde_json::json!({
        "written": events,
        "rolled_back": *rolled_back.lock().expect("rolled back"),
        "abandoned": abandoned,
        "secs": started.elapsed().as_secs_f64(),
    });
    std::fs::write(format!("{out}/producer.json"), report.to_string())?;
    eprintln!(
        "producer: done, {events} events in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if abandoned > 0 {
        return Err(format!("{abandoned} events abandoned after {TX_RETRIES_MAX} attempts").into());
    }
    Ok(())
}

/// [`write`], retried while it fails, at most [`TX_RETRIES_MAX`] times:
/// whether the transaction was written.
async fn write_retried(pool: &PgPool, publisher: &Publisher, tx: &Planned) -> bool {
    for attempt in 0..TX_RETRIES_MAX {
        match write(pool, publisher, &tx.events, tx.rollback).await {
            Ok(()) => return true,
            // The commit did apply before its reply was lost.
            Err(e) if e.to_string().contains("duplicate key") && attempt > 0 => return true,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    false
}

/// One domain transaction: a domain row per event and the events through
/// `publish_tx` / `publish_many_tx` (by hand for unpublishable ones), then
/// COMMIT, or ROLLBACK if `rollback`.
async fn write(
    pool: &PgPool,
    publisher: &Publisher,
    batch: &[(EventEnvelope, Kind)],
    rollback: bool,
) -> Result<(), BoxError> {
    let mut tx = pool.begin().await?;
    for (env, kind) in batch {
        sqlx::query("INSERT INTO chaos_orders (event_id, kind) VALUES ($1, $2)")
            .bind(env.id)
            .bind(kind.name())
            .execute(&mut *tx)
            .await?;
    }
    let (unpublishable, publishable): (Vec<_>, Vec<_>) =
        batch.iter().partition(|(_, k)| *k == Kind::Unpublishable);
    for (env, _) in unpublishable {
        // Bypassing publish_tx, which would refuse the empty key.
        let body = env.encode(&EnvelopeLimits::default())?;
        sqlx::query(
            "INSERT INTO event_outbox (id, routing_key, payload) VALUES ($1, '', $2::jsonb)",
        )
        .bind(env.id)
        .bind(body)
        .execute(&mut *tx)
        .await?;
    }
    let envelopes: Vec<EventEnvelope> = publishable.iter().map(|(e, _)| e.clone()).collect();
    match envelopes.as_slice() {
        [] => {}
        [one] => publisher.publish_tx(&mut tx, one).await?,
        many => publisher.publish_many_tx(&mut tx, many).await?,
    }
    if rollback {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(())
}

/// `chaos drainer`: `CHAOS_DB`, `CHAOS_AMQP` (one AMQP URL or a
/// comma-separated list of a cluster's nodes), `CHAOS_REPLICA`. Its
/// sessions carry its replica id as `application_name`, for the marks'
/// audit.
pub async fn drainer() -> Result<(), BoxError> {
    let (url, amqp, replica) = (var("CHAOS_DB")?, var("CHAOS_AMQP")?, var("CHAOS_REPLICA")?);
    let replica = format!("{replica}-{}", std::process::id());
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options.application_name(&replica));
    let config = DrainerConfig::builder()
        .replica_id(replica)
        .exchange(EXCHANGE)
        .tick_ms(100)
        .lease_ttl_secs(LEASE_TTL.as_secs())
        .confirm_timeout_secs(CONFIRM_TIMEOUT.as_secs())
        .max_attempts(DRAINER_MAX_ATTEMPTS)
        .build()?;
    let handle = DrainerHandle::spawn(pool, LapinBroker::from_list(&amqp)?, config);
    terminated().await;
    tokio::time::timeout(Duration::from_secs(20), handle.shutdown())
        .await
        .map_err(|_| "drainer shutdown took over 20 s")?;
    Ok(())
}

/// The subscriptions' handler: one effect row per event, in the handler's
/// transaction; `shipping`'s refuses poison events always and one event in
/// [`TRANSIENT_ONE_IN`] once.
struct Effects {
    fails: bool,
    /// Where a transient failure is remembered, outside the transaction
    /// (so it survives the rollback, and a restart).
    pool: PgPool,
}

impl Handler<PgTx> for Effects {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        if self.fails {
            if event.routing_key == ROUTING_POISON {
                return Err(HandlerError::msg("shipping refuses poison events"));
            }
            if event.id.as_u64_pair().1.is_multiple_of(TRANSIENT_ONE_IN) {
                let first = sqlx::query(
                    "INSERT INTO chaos_failed_once (event_id) VALUES ($1) ON CONFLICT DO NOTHING",
                )
                .bind(event.id)
                .execute(&self.pool)
                .await?
                .rows_affected()
                    == 1;
                if first {
                    return Err(HandlerError::msg("transient failure, first attempt"));
                }
            }
        }
        sqlx::query("INSERT INTO chaos_effects (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// `chaos subscriber`: `CHAOS_DB`, `CHAOS_AMQP`, `CHAOS_SUBSCRIPTION`,
/// `CHAOS_NAME`, `CHAOS_ORDERING_KEYS` (above 0: an ordered subscription
/// of [`PARTITIONS`](super::PARTITIONS)), `CHAOS_OUT` (where it writes its
/// counters every second).
pub async fn subscriber() -> Result<(), BoxError> {
    let (url, amqp) = (var("CHAOS_DB")?, var("CHAOS_AMQP")?);
    let name = var("CHAOS_NAME")?;
    let out = var("CHAOS_OUT")?;
    let sub_name = var("CHAOS_SUBSCRIPTION")?;
    let sub =
        super::subscription(&sub_name).ok_or_else(|| format!("no subscription {sub_name}"))?;
    let pool = pool(&url, 8);
    let keys: u64 = number("CHAOS_ORDERING_KEYS")?;
    let mut settings = sub.settings(keys > 0);
    settings.max_attempts = SUBSCRIBER_MAX_ATTEMPTS;
    settings.handler_timeout = Duration::from_secs(5);
    settings.validate()?;
    let subscriber = Arc::new(Subscriber::new(
        Arc::new(PgInboxStore::new(pool.clone())),
        Arc::new(LapinBroker::from_list(&amqp)?),
        Arc::new(TokioClock::default()),
        Arc::new(Effects {
            fails: sub.fails,
            pool,
        }),
        settings,
    ));
    let (stop, stopped) = watch::channel(false);
    let counters = subscriber.counters();
    let stats = format!("{out}/stats-{name}-{}.json", std::process::id());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let s = counters.snapshot();
            let line = serde_json::json!({
                "processed": s.processed, "duplicates": s.duplicates, "retried": s.retried,
                "dead_lettered": s.dead_lettered, "undecodable": s.undecodable,
                "deferred": s.deferred, "held": s.held,
            });
            let _ = std::fs::write(&stats, line.to_string());
        }
    });
    let run = {
        let subscriber = subscriber.clone();
        tokio::spawn(async move { subscriber.run(stopped).await })
    };
    terminated().await;
    let _ = stop.send(true);
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .map_err(|_| "subscriber shutdown took over 20 s")???;
    Ok(())
}

/// The subscribers' counters, summed over every process's last snapshot
/// (a killed process's last second is missing: a lower bound).
pub fn counters(out: &str) -> BTreeMap<String, u64> {
    let mut sum: BTreeMap<String, u64> = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(out) else {
        return sum;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("stats-") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        if let Ok(serde_json::Value::Object(m)) = serde_json::from_str::<serde_json::Value>(&text) {
            for (k, v) in m {
                *sum.entry(k).or_insert(0) += v.as_u64().unwrap_or(0);
            }
        }
    }
    sum
}
