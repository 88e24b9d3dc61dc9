//! The orchestrator: sets the services up, starts the processes behind
//! their proxies, injects the planned faults, heals, waits until the run
//! has settled (or its bound), stops everything, reads the final state,
//! judges, reports, and leaves the services as it found them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use sqlx::{Executor, PgPool, Row};
use tokio::sync::watch;

use super::cluster;
use super::judge::{self, Outcome};
use super::observer::{self, Observed};
use super::plan::{self, Fault, Service};
use super::proxy::Proxy;
use super::report::{Injected, Report};
use super::roles::{EFFECTS_DDL, orders_ddl};
use super::{DRAINERS, EXCHANGE, OBSERVER_QUEUE, ORDERS_DB, REPLICAS, SUBSCRIPTIONS};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What `chaos run` was asked for.
#[derive(Debug, Clone)]
pub struct Args {
    pub events: u64,
    pub faults: usize,
    pub seed: u64,
    /// Events per second the producer writes.
    pub rate: f64,
    /// Where the report, the processes' logs and counters go.
    pub out: PathBuf,
    /// How long, after the producer is done and the faults healed, the run
    /// may go without progress (no event published, parked, or applied by
    /// a subscription) before it has settled; and the least it may take to
    /// settle in all (see [`settle`]).
    pub settle: Duration,
    /// A PostgreSQL URL with a database to administer from (`postgres`).
    pub pg_admin: String,
    /// The broker's nodes: AMQP URLs separated by commas (the observer and
    /// the set-up connect to the first that answers, never proxied; each
    /// process gets a proxy to each node, and the list of its proxies).
    pub amqp: String,
    /// The broker is the project's three-node cluster (`--cluster`):
    /// `amqp` lists its nodes in order, node faults are planned, and the
    /// observer reads a quorum queue.
    pub cluster: bool,
    /// Keep the databases and queues after the run.
    pub keep: bool,
    /// Ordering keys the order events spread over (`--ordering-keys`; 0:
    /// none): the subscriptions are then ordered, and the report judges
    /// each key's order at the broker and in each subscription.
    pub ordering_keys: u64,
}

impl Args {
    /// The producer's rate for `events` when none is given: about a
    /// minute of production, between 300 and 3 000 events/s.
    pub fn default_rate(events: u64) -> f64 {
        (events as f64 / 60.0).clamp(300.0, 3000.0)
    }
}

/// How many events must have reached the broker before a fault planned
/// `at` into a production `window` of `events` fires: its planned share
/// of the nine tenths that surely reach it (some transactions roll back,
/// some rows are unpublishable, the last are in flight when the producer
/// ends), so the last faults do not all wait for the producer's end and
/// fire together.
fn share_before(events: u64, at: Duration, window: Duration) -> usize {
    if window.is_zero() {
        return 0;
    }
    (events as f64 * 0.9 * (at.as_secs_f64() / window.as_secs_f64()).min(1.0)) as usize
}

/// `host:port` of a URL like `scheme://user:pass@host:port/...`.
fn host_port(url: &str, default_port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hp = rest.split(['/', '?']).next().unwrap_or("127.0.0.1");
    if hp.contains(':') {
        hp.to_owned()
    } else {
        format!("{hp}:{default_port}")
    }
}

/// `url` with its `host:port` replaced by `127.0.0.1:port`.
fn through(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (user, rest) = match rest.rsplit_once('@') {
        Some((u, r)) => (format!("{u}@"), r),
        None => (String::new(), rest),
    };
    let tail = rest.find(['/', '?']).map_or("", |i| &rest[i..]);
    format!("{scheme}://{user}127.0.0.1:{port}{tail}")
}

/// One process slot: its role, its environment, its proxies, and the
/// process running in it now.
struct Slot {
    role: &'static str,
    env: Vec<(String, String)>,
    child: Option<Child>,
    /// Set while a fault has it down on purpose.
    down: bool,
    log: PathBuf,
}

impl Slot {
    fn start(&mut self) -> Result<(), BoxError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(std::env::current_exe()?)
            .arg(self.role)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        self.down = false;
        Ok(())
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, and reap.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A process to start: name, role, database, role-specific environment.
type Spec<'a> = (String, &'static str, &'a str, Vec<(&'a str, String)>);

/// Every process of the run, by name.
type Slots = Arc<Mutex<BTreeMap<String, Slot>>>;

/// Sends `signal` (`TERM`, `STOP`, `CONT`) to `pid`.
fn signal(pid: u32, signal: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .map_err(|e| format!("kill -{signal}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{signal} {pid} failed"))
    }
}

/// Runs a service command (`rabbitmqctl`, `pg_ctlcluster`) off the runtime.
async fn command(program: &str, args: &[&str]) -> Result<(), String> {
    let (p, a): (String, Vec<String>) =
        (program.into(), args.iter().map(|s| (*s).into()).collect());
    let out = tokio::task::spawn_blocking(move || Command::new(&p).args(&a).output())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Waits (bounded) until RabbitMQ answers again.
async fn broker_up(amqp: &str, within: Duration) -> Result<(), String> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Ok(c) = super::connect_any(amqp).await {
            let _ = c.close(200, "OK".into()).await;
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!("RabbitMQ not back within {} s", within.as_secs()))
}

/// Waits (bounded) until PostgreSQL answers again.
async fn postgres_up(admin: &str, within: Duration) -> Result<(), String> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Ok(p) = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(admin)
            .await
        {
            p.close().await;
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!("PostgreSQL not back within {} s", within.as_secs()))
}

/// The PostgreSQL cluster version (`/etc/postgresql/VERSION`).
fn pg_version() -> String {
    std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .max()
        })
        .unwrap_or_else(|| "15".into())
}

/// Where a run's production stands, for the fault schedule.
struct Progress {
    /// When production began.
    production: Instant,
    /// When the run began (the report's clock).
    start: Instant,
    /// The planned production window.
    window: Duration,
    /// Events the producer writes.
    events: u64,
    /// What the observer saw reach the broker.
    seen: Arc<Mutex<Observed>>,
}

/// No fault is injected sooner than this after the previous one healed.
const FAULT_GAP_MIN: Duration = Duration::from_secs(1);
/// A fault waiting for its share of the events fires anyway once no event
/// has reached the broker for this long (the pipeline is done, or wedged).
const PROGRESS_STALL: Duration = Duration::from_secs(15);

/// Injects the planned faults one at a time, in order, so no two ever hold
/// a target at once and recovery from each is part of the run. A fault
/// waits for its planned instant, for a gap after the previous one healed
/// (a quarter of a fault's slot, at least [`FAULT_GAP_MIN`]), and for its
/// share of the events to have reached the broker: a pipeline slower than
/// planned (a loaded machine, a long recovery) stretches the schedule, and
/// a producer that finished early does not make the rest fire together;
/// only a pipeline in which nothing moves for [`PROGRESS_STALL`] lets a
/// fault go without its share. So where the faults fall among the events
/// does not depend on the machine's speed.
async fn inject_in_order(
    planned: Vec<plan::Planned>,
    progress: Progress,
    world: Arc<World>,
    injected: Arc<Mutex<Vec<Injected>>>,
) {
    let slot = progress.window / planned.len().max(1) as u32;
    let gap = (slot / 4).max(FAULT_GAP_MIN);
    let mut healed: Option<Instant> = None;
    for p in planned {
        tokio::time::sleep_until((progress.production + p.at).into()).await;
        if let Some(healed) = healed {
            tokio::time::sleep_until((healed + gap).into()).await;
        }
        let share = share_before(progress.events, p.at, progress.window);
        wait_for_share(&progress.seen, share).await;
        let began = progress.start.elapsed();
        println!("chaos: {:>6.1} s  {}", began.as_secs_f64(), p.fault);
        let trouble = world.inject(&p.fault).await.err();
        if let Some(t) = &trouble {
            println!("chaos: trouble injecting {}: {t}", p.fault);
        }
        healed = Some(Instant::now());
        injected.lock().expect("injected").push(Injected {
            planned: p,
            began,
            ended: progress.start.elapsed(),
            trouble,
        });
    }
}

/// Waits until `share` events reached the broker, or none arrived for
/// [`PROGRESS_STALL`].
async fn wait_for_share(seen: &Mutex<Observed>, share: usize) {
    let (mut last, mut since) = (0, Instant::now());
    loop {
        let n = seen.lock().expect("observed").stored.len();
        if n >= share {
            return;
        }
        if n != last {
            (last, since) = (n, Instant::now());
        } else if since.elapsed() >= PROGRESS_STALL {
            println!(
                "chaos: no event reached the broker for {PROGRESS_STALL:?}; the fault goes ahead at {n} of {share}"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the faults and their injection share.
struct World {
    slots: Slots,
    proxies: BTreeMap<String, Proxy>,
    args: Args,
    /// The producer's database, unproxied (to arm mark stalls).
    orders: PgPool,
}

impl World {
    /// The proxies between `target` and `service` (one per broker node).
    fn proxies_of(&self, target: &str, service: Service) -> Result<Vec<&Proxy>, String> {
        let (one, node) = (
            format!("{target}/{}", service.name()),
            format!("{target}/{}-", service.name()),
        );
        let found: Vec<&Proxy> = self
            .proxies
            .iter()
            .filter(|(k, _)| **k == one || k.starts_with(&node))
            .map(|(_, p)| p)
            .collect();
        if found.is_empty() {
            Err(format!("no proxy {one}"))
        } else {
            Ok(found)
        }
    }

    /// Every process's proxy to broker node `n` (1-based).
    fn node_proxies(&self, n: u16) -> Vec<&Proxy> {
        let suffix = format!("/rabbit-{n}");
        self.proxies
            .iter()
            .filter(|(k, _)| k.ends_with(&suffix))
            .map(|(_, p)| p)
            .collect()
    }

    /// The broker's nodes this run faults (1-based): one unless a cluster.
    fn broker_nodes(&self) -> std::ops::RangeInclusive<u16> {
        1..=if self.args.cluster { cluster::NODES } else { 1 }
    }

    /// `rabbitmqctl ARGS` on every node of the broker.
    async fn ctl_all(&self, args: &[&str]) -> Result<(), String> {
        if !self.args.cluster {
            return command("rabbitmqctl", args).await;
        }
        for n in self.broker_nodes() {
            cluster::ctl(n, args).await?;
        }
        Ok(())
    }

    /// Injects a node fault and heals it.
    async fn inject_node(&self, fault: &Fault) -> Result<(), String> {
        if !self.args.cluster {
            return Err(format!("{fault}: not a cluster run"));
        }
        match fault {
            Fault::NodeKill {
                node,
                restart_after,
            } => {
                cluster::kill(*node).await?;
                tokio::time::sleep(*restart_after).await;
                cluster::start_down_nodes().await
            }
            Fault::NodeStop { node, down } => {
                cluster::ctl(*node, &["stop_app"]).await?;
                tokio::time::sleep(*down).await;
                cluster::ctl(*node, &["start_app"]).await?;
                cluster::await_all().await
            }
            Fault::NodePartition { node, cut } => {
                let proxies = self.node_proxies(*node);
                for p in &proxies {
                    p.hold();
                }
                let cut_off = cluster::cut_off(*node).await;
                tokio::time::sleep(*cut).await;
                let rejoined = cluster::rejoin(*node).await;
                for p in &proxies {
                    p.pass();
                }
                cut_off?;
                rejoined?;
                cluster::await_all().await
            }
            other => Err(format!("{other} is no node fault")),
        }
    }

    fn with_slot<T>(&self, target: &str, f: impl FnOnce(&mut Slot) -> T) -> Result<T, String> {
        let mut slots = self.slots.lock().expect("slots");
        let slot = slots
            .get_mut(target)
            .ok_or_else(|| format!("no process {target}"))?;
        Ok(f(slot))
    }

    /// Injects `fault` and heals it; returns when it is healed.
    async fn inject(&self, fault: &Fault) -> Result<(), String> {
        match fault {
            Fault::Kill { .. } | Fault::Pause { .. } => self.inject_process(fault).await,
            Fault::CloseAllConnections | Fault::RestartBroker { .. } => {
                self.inject_broker(fault).await
            }
            Fault::NodeKill { .. } | Fault::NodeStop { .. } | Fault::NodePartition { .. } => {
                self.inject_node(fault).await
            }
            Fault::RestartPostgres | Fault::TerminateBackends | Fault::StallMarks { .. } => {
                self.inject_postgres(fault).await
            }
            Fault::Blackhole { .. } | Fault::Cut { .. } => self.inject_proxy(fault).await,
        }
    }

    /// A process killed and restarted, or paused and resumed.
    async fn inject_process(&self, fault: &Fault) -> Result<(), String> {
        match fault {
            Fault::Kill {
                target,
                restart_after,
            } => {
                self.with_slot(target, |s| {
                    s.down = true;
                    s.kill();
                })?;
                tokio::time::sleep(*restart_after).await;
                self.with_slot(target, |s| s.start().map_err(|e| e.to_string()))?
            }
            Fault::Pause { target, stopped } => {
                let pid = self
                    .with_slot(target, |s| {
                        s.down = true;
                        s.pid()
                    })?
                    .ok_or("not running")?;
                signal(pid, "STOP")?;
                tokio::time::sleep(*stopped).await;
                let r = signal(pid, "CONT");
                self.with_slot(target, |s| s.down = false)?;
                r
            }
            other => unreachable!("{other} is no process fault"),
        }
    }

    /// The broker's connections closed, or its app stopped and started.
    async fn inject_broker(&self, fault: &Fault) -> Result<(), String> {
        match fault {
            Fault::CloseAllConnections => {
                self.ctl_all(&["close_all_connections", "chaos run"]).await
            }
            Fault::RestartBroker { down } => {
                self.ctl_all(&["stop_app"]).await?;
                tokio::time::sleep(*down).await;
                self.ctl_all(&["start_app"]).await?;
                broker_up(&self.args.amqp, Duration::from_secs(60)).await
            }
            other => unreachable!("{other} is no broker fault"),
        }
    }

    /// PostgreSQL restarted, its backends terminated, or a drainer's marks
    /// stalled.
    async fn inject_postgres(&self, fault: &Fault) -> Result<(), String> {
        match fault {
            Fault::RestartPostgres => {
                let version = pg_version();
                command(
                    "pg_ctlcluster",
                    &[
                        "--skip-systemctl-redirect",
                        "-m",
                        "immediate",
                        &version,
                        "main",
                        "restart",
                    ],
                )
                .await?;
                postgres_up(&self.args.pg_admin, Duration::from_secs(60)).await
            }
            Fault::TerminateBackends => {
                let admin = PgPool::connect(&self.args.pg_admin)
                    .await
                    .map_err(|e| e.to_string())?;
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = ANY($1) AND pid <> pg_backend_pid()",
                )
                .bind(databases())
                .execute(&admin)
                .await
                .map_err(|e| e.to_string())?;
                admin.close().await;
                Ok(())
            }
            Fault::StallMarks { target, stalled } => {
                let pid = self.with_slot(target, |s| s.pid())?.ok_or("not running")?;
                // The replica id the drainer set as its application_name.
                let replica = format!("{target}-{pid}");
                sqlx::query(
                    "INSERT INTO chaos_stall (replica, until) \
                     VALUES ($1, clock_timestamp() + make_interval(secs => $2)) \
                     ON CONFLICT (replica) DO UPDATE SET until = excluded.until, stalled = 0",
                )
                .bind(&replica)
                .bind(stalled.as_secs_f64())
                .execute(&self.orders)
                .await
                .map_err(|e| e.to_string())?;
                tokio::time::sleep(*stalled).await;
                // What it did: a stall that held no mark statement (say, its
                // name no longer matched the drainer's sessions) is no fault.
                let held: i64 =
                    sqlx::query_scalar("SELECT stalled FROM chaos_stall WHERE replica = $1")
                        .bind(&replica)
                        .fetch_one(&self.orders)
                        .await
                        .map_err(|e| e.to_string())?;
                eprintln!("chaos: {target}'s stall held {held} mark statements");
                Ok(())
            }
            other => unreachable!("{other} is no PostgreSQL fault"),
        }
    }

    /// A proxy holding, or cutting, what passes through it.
    async fn inject_proxy(&self, fault: &Fault) -> Result<(), String> {
        match fault {
            Fault::Blackhole {
                target,
                service,
                held,
            } => {
                let proxies = self.proxies_of(target, *service)?;
                for p in &proxies {
                    p.hold();
                }
                tokio::time::sleep(*held).await;
                for p in &proxies {
                    p.pass();
                }
                Ok(())
            }
            Fault::Cut { target, service } => {
                for p in self.proxies_of(target, *service)? {
                    p.cut();
                }
                Ok(())
            }
            other => unreachable!("{other} is no proxy fault"),
        }
    }
}

/// The run's databases.
fn databases() -> Vec<String> {
    std::iter::once(ORDERS_DB)
        .chain(SUBSCRIPTIONS.iter().map(|s| s.db))
        .map(str::to_owned)
        .collect()
}

/// The run's queues (each subscription's, its partitions' and its DLQ,
/// the observer's).
fn queues() -> Vec<String> {
    SUBSCRIPTIONS
        .iter()
        .flat_map(|s| {
            let mut q = vec![s.queue.to_owned(), s.settings(true).spec.dlq_name()];
            q.extend(s.consumed_queues(true));
            q
        })
        .chain([OBSERVER_QUEUE.to_owned()])
        .collect()
}

/// The run's exchanges: its own and each subscription's routing ones (on
/// an ordered subscription).
fn exchanges() -> Vec<String> {
    SUBSCRIPTIONS
        .iter()
        .flat_map(|s| {
            let spec = s.settings(true).spec;
            [spec.route_exchange(), spec.rest_exchange()]
        })
        .chain([EXCHANGE.to_owned()])
        .collect()
}

/// Deletes the run's queues and exchange (what is missing is skipped).
async fn clean_broker(amqp: &str) -> Result<(), BoxError> {
    let conn = super::connect_any(amqp).await?;
    for q in queues() {
        // A failed delete closes the channel: one channel per attempt.
        let ch = conn.create_channel().await?;
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    for x in exchanges() {
        let ch = conn.create_channel().await?;
        let _ = ch
            .exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    super::close(conn).await;
    Ok(())
}

/// Whether `queue` exists and has a consumer: a subscriber binds its queue
/// after declaring it and consumes after binding, so only then is nothing
/// published to the exchange routed nowhere.
async fn queue_consumed(amqp: &str, queue: &str) -> bool {
    let Ok(conn) = super::connect_any(amqp).await else {
        return false;
    };
    let ok = match conn.create_channel().await {
        Ok(ch) => super::peek_queue(&ch, queue)
            .await
            .is_some_and(|q| q.consumer_count() > 0),
        Err(_) => false,
    };
    super::close(conn).await;
    ok
}

/// Per whole second from `start` (Unix seconds), rows of `table` by their
/// `at` column.
async fn per_second(
    pool: &PgPool,
    table: &str,
    start: f64,
) -> Result<BTreeMap<u64, u64>, BoxError> {
    let sql = format!(
        "SELECT greatest(floor(extract(epoch FROM at) - $1), 0)::bigint AS s, count(*)::bigint AS n \
         FROM {table} GROUP BY 1"
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(start)
        .fetch_all(pool)
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<i64, _>("s") as u64, r.get::<i64, _>("n") as u64))
        .collect())
}

/// Where the run stands after the faults healed: whether it owes nothing
/// more, and how far it got (rows published or parked, plus events applied
/// and dead-lettered by each subscription: it grows while the run makes
/// progress).
struct Standing {
    done: bool,
    progress: i64,
}

/// Whether the run owes nothing more: every committed event is published
/// (or parked, if unpublishable), seen by the observer, and applied by
/// each subscription (poison dead-lettered at shipping instead).
async fn settled(
    orders: &PgPool,
    subs: &BTreeMap<String, PgPool>,
    seen: &Mutex<Observed>,
) -> Result<Standing, BoxError> {
    let pending: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND parked_at IS NULL",
    )
    .fetch_one(orders)
    .await?;
    let mut progress = -pending;
    let mut done = pending == 0;
    let ids: Vec<(uuid::Uuid, String)> = sqlx::query_as("SELECT event_id, kind FROM chaos_orders")
        .fetch_all(orders)
        .await?;
    {
        let seen = seen.lock().expect("observed");
        if ids
            .iter()
            .any(|(id, k)| k != "unpublishable" && !seen.stored.contains_key(id))
        {
            done = false;
        }
    }
    for s in SUBSCRIPTIONS {
        let pool = &subs[s.name];
        let must: i64 = ids
            .iter()
            .filter(|(_, k)| k != "unpublishable" && (!s.fails || k != "poison"))
            .count() as i64;
        let applied: i64 = sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM chaos_effects")
            .fetch_one(pool)
            .await?;
        progress += applied;
        done &= applied >= must;
        if s.fails {
            let poison = ids.iter().filter(|(_, k)| k == "poison").count() as i64;
            let dead: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM event_inbox WHERE dead_lettered_at IS NOT NULL",
            )
            .fetch_one(pool)
            .await?;
            progress += dead;
            done &= dead >= poison;
        }
    }
    Ok(Standing { done, progress })
}

/// Waits for the run to settle after the faults healed at `healed` (since
/// the run's `start`): true if it did. A run settles when it is live: it
/// never goes `bound` without progress, and it is done within as long
/// again as it took to heal (at least `bound`: a backlog left at the heal
/// drains at no less than about the rate the run went at). A fixed time
/// after the heal would judge the machine's speed against the backlog
/// (the 1M-event keyed run on two cores), not whether anything stalls.
async fn settle(
    orders: &PgPool,
    subs: &BTreeMap<String, PgPool>,
    seen: &Mutex<Observed>,
    healed: Duration,
    bound: Duration,
) -> bool {
    let until = Instant::now() + healed.max(bound);
    let (mut best, mut moved) = (i64::MIN, Instant::now());
    while Instant::now() < until && moved.elapsed() < bound {
        if let Ok(standing) = settled(orders, subs, seen).await {
            if standing.done {
                return true;
            }
            if standing.progress > best {
                (best, moved) = (standing.progress, Instant::now());
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    false
}

/// The run's databases: the producer's and one per subscription.
struct Databases {
    orders: PgPool,
    subs: BTreeMap<String, PgPool>,
}

impl Databases {
    /// Fresh databases and a clean broker, the observer's queue declared.
    async fn fresh(args: &Args) -> Result<Self, BoxError> {
        clean_broker(&args.amqp).await?;
        let orders = crate::recreate_database(&args.pg_admin, ORDERS_DB, 4).await?;
        orders.execute(sqlx::AssertSqlSafe(orders_ddl())).await?;
        let mut subs: BTreeMap<String, PgPool> = BTreeMap::new();
        for s in SUBSCRIPTIONS {
            let pool = crate::recreate_database(&args.pg_admin, s.db, 4).await?;
            pool.execute(EFFECTS_DDL).await?;
            subs.insert(s.name.to_owned(), pool);
        }
        let observer_queue = if args.cluster {
            outbox::QueueType::Quorum
        } else {
            outbox::QueueType::Classic
        };
        observer::declare(&args.amqp, EXCHANGE, OBSERVER_QUEUE, observer_queue).await?;
        Ok(Self { orders, subs })
    }

    /// Leaves the services as they were found (unless `--keep`).
    async fn leave(self, args: &Args) -> Result<(), BoxError> {
        self.orders.close().await;
        for (_, p) in self.subs {
            p.close().await;
        }
        if !args.keep {
            for db in databases() {
                crate::drop_database(&args.pg_admin, &db).await?;
            }
            clean_broker(&args.amqp).await?;
        }
        Ok(())
    }
}

/// The processes of a run, by name, with their proxies.
struct Cast {
    slots: Slots,
    proxies: BTreeMap<String, Proxy>,
    drainers: Vec<String>,
    subscribers: Vec<String>,
}

impl Cast {
    /// Every process's slot (none started) and its proxies (started).
    async fn new(args: &Args, out: &Path) -> Result<Self, BoxError> {
        let (specs, drainers, subscribers) = specs(args);
        let pg_up = host_port(&args.pg_admin, 5432);
        let mq_nodes = super::nodes(&args.amqp);
        let out_str = out.to_string_lossy().into_owned();
        let mut proxies = BTreeMap::new();
        let mut slots = BTreeMap::new();
        for (name, role, db, extra) in specs {
            let pg = Proxy::start(pg_up.clone()).await?;
            let db_url = crate::database_url(&through(&args.pg_admin, pg.port), db)
                .map_err(|e| e.to_string())?;
            proxies.insert(format!("{name}/pg"), pg);
            let mut env: Vec<(String, String)> = vec![
                ("CHAOS_DB".into(), db_url),
                ("CHAOS_OUT".into(), out_str.clone()),
            ];
            if role != "producer" {
                let list = broker_proxies(&name, &mq_nodes, &mut proxies).await?;
                env.push(("CHAOS_AMQP".into(), list.join(",")));
            }
            env.extend(extra.into_iter().map(|(k, v)| (k.to_owned(), v)));
            let log = out.join(format!("{name}.log"));
            let slot = Slot {
                role,
                env,
                child: None,
                down: false,
                log,
            };
            slots.insert(name, slot);
        }
        Ok(Self {
            slots: Arc::new(Mutex::new(slots)),
            proxies,
            drainers,
            subscribers,
        })
    }

    /// Starts the named processes.
    fn start(&self, names: &[String]) -> Result<(), BoxError> {
        let mut s = self.slots.lock().expect("slots");
        for name in names {
            s.get_mut(name).expect("slot").start()?;
        }
        Ok(())
    }
}

/// What each process is: the producer, the drainers, each subscription's
/// replicas; and the drainers' and subscribers' names.
fn specs(args: &Args) -> (Vec<Spec<'static>>, Vec<String>, Vec<String>) {
    let mut specs: Vec<Spec<'static>> = vec![(
        "producer".into(),
        "producer",
        ORDERS_DB,
        vec![
            ("CHAOS_EVENTS", args.events.to_string()),
            ("CHAOS_RATE", args.rate.to_string()),
            ("CHAOS_SEED", args.seed.to_string()),
            ("CHAOS_ORDERING_KEYS", args.ordering_keys.to_string()),
        ],
    )];
    let drainers: Vec<String> = (1..=DRAINERS).map(|i| format!("drainer-{i}")).collect();
    for d in &drainers {
        let env = vec![("CHAOS_REPLICA", d.clone())];
        specs.push((d.clone(), "drainer", ORDERS_DB, env));
    }
    let mut subscribers = Vec::new();
    for s in SUBSCRIPTIONS {
        for j in 1..=REPLICAS {
            let name = format!("{}-{j}", s.name);
            subscribers.push(name.clone());
            let env = vec![
                ("CHAOS_SUBSCRIPTION", s.name.into()),
                ("CHAOS_NAME", name.clone()),
                ("CHAOS_ORDERING_KEYS", args.ordering_keys.to_string()),
            ];
            specs.push((name, "subscriber", s.db, env));
        }
    }
    (specs, drainers, subscribers)
}

/// One proxy per broker node for process `name`; the list of their URLs.
async fn broker_proxies(
    name: &str,
    mq_nodes: &[String],
    proxies: &mut BTreeMap<String, Proxy>,
) -> Result<Vec<String>, BoxError> {
    let mut list = Vec::new();
    for (k, url) in (1..).zip(mq_nodes) {
        let mq = Proxy::start(host_port(url, 5672)).await?;
        list.push(through(url, mq.port));
        let key = if mq_nodes.len() == 1 {
            format!("{name}/rabbit")
        } else {
            format!("{name}/rabbit-{k}")
        };
        proxies.insert(key, mq);
    }
    Ok(list)
}

/// Empties the output folder of an earlier run's logs and counters.
fn clear_out(out: &Path) -> Result<(), BoxError> {
    std::fs::create_dir_all(out)?;
    for e in std::fs::read_dir(out)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("stats-") || name.ends_with(".log") || name == "producer.json" {
            std::fs::remove_file(e.path())?;
        }
    }
    Ok(())
}

/// Waits until every subscription's queue has a consumer.
async fn queues_consumed(args: &Args) -> Result<(), BoxError> {
    for queue in SUBSCRIPTIONS
        .iter()
        .flat_map(|s| s.consumed_queues(args.ordering_keys > 0))
    {
        let until = Instant::now() + Duration::from_secs(30);
        while !queue_consumed(&args.amqp, &queue).await {
            if Instant::now() > until {
                return Err(format!("{queue} was not consumed within 30 s").into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// The faults for this run, printed.
fn plan_faults(args: &Args, cast: &Cast, window: Duration) -> Vec<plan::Planned> {
    let nodes = if args.cluster { cluster::NODES } else { 1 };
    let planned = plan::plan(
        args.seed,
        args.faults,
        window,
        (&cast.drainers, &cast.subscribers),
        nodes,
    );
    println!(
        "chaos: seed {}, {} events at {:.0}/s over {:.0} s, {} faults (each at its \
         instant, or later once its share of the events reached the broker):",
        args.seed,
        args.events,
        args.rate,
        window.as_secs_f64(),
        planned.len()
    );
    for (i, p) in planned.iter().enumerate() {
        println!(
            "  {:>2}. at {:>6.1} s / {:>8} events  {}",
            i + 1,
            p.at.as_secs_f64(),
            share_before(args.events, p.at, window),
            p.fault
        );
    }
    planned
}

/// Watches the processes: one that exits by itself is a failure of the run
/// (the producer's exit is its end) and is restarted so the run goes on.
struct Watchdog {
    exits: Arc<Mutex<Vec<String>>>,
    producer: Arc<Mutex<Option<std::process::ExitStatus>>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Watchdog {
    fn spawn(slots: Slots) -> Self {
        let exits: Arc<Mutex<Vec<String>>> = Arc::default();
        let producer: Arc<Mutex<Option<std::process::ExitStatus>>> = Arc::default();
        let (stop, mut watching) = watch::channel(false);
        let (e, p) = (exits.clone(), producer.clone());
        let task = tokio::spawn(async move {
            loop {
                Self::look(&slots, &e, &p);
                tokio::select! {
                    _ = watching.changed() => return,
                    () = tokio::time::sleep(Duration::from_millis(300)) => {}
                }
            }
        });
        Self {
            exits,
            producer,
            stop,
            task,
        }
    }

    fn look(
        slots: &Slots,
        exits: &Mutex<Vec<String>>,
        producer: &Mutex<Option<std::process::ExitStatus>>,
    ) {
        let mut slots = slots.lock().expect("slots");
        for (name, slot) in slots.iter_mut() {
            if slot.down {
                continue;
            }
            let Some(status) = slot
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            else {
                continue;
            };
            slot.child = None;
            if name == "producer" {
                *producer.lock().expect("status") = Some(status);
                slot.down = true;
            } else {
                let exit = format!("{name} exited by itself ({status})");
                exits.lock().expect("exits").push(exit);
                let _ = slot.start();
            }
        }
    }

    /// Waits for the producer's exit; its status.
    async fn producer_done(&self) -> std::process::ExitStatus {
        loop {
            if let Some(status) = *self.producer.lock().expect("status") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// Stops watching; the exits seen.
    async fn stop(self) -> Vec<String> {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        self.exits.lock().expect("exits").clone()
    }
}

/// The observer's task, reading what reaches the broker.
struct Observing {
    seen: Arc<Mutex<Observed>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Observing {
    fn spawn(args: &Args, start: Instant) -> Self {
        let seen: Arc<Mutex<Observed>> = Arc::default();
        let (stop, observer_stop) = watch::channel(false);
        let task = tokio::spawn(observer::observe(
            args.amqp.clone(),
            OBSERVER_QUEUE.into(),
            seen.clone(),
            start,
            observer_stop,
        ));
        Self { seen, stop, task }
    }

    /// Stops observing and reads what is left in the queue.
    async fn stop(self, args: &Args, start: Instant) -> Result<Observed, BoxError> {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        let rest = observer::read_rest(&args.amqp, OBSERVER_QUEUE, &self.seen, start).await?;
        if rest > 0 {
            println!("chaos: {rest} messages were left in the observer's queue; counted");
        }
        Ok(self.seen.lock().expect("observed").clone())
    }
}

/// What happened while the run went, for the judge's extra rules.
struct Course {
    quiet: bool,
    producer: std::process::ExitStatus,
    exits: Vec<String>,
    planned: usize,
    faults: Vec<Injected>,
}

/// Runs the chaos run; `Ok(true)` if every rule held.
pub async fn run(args: Args, command_line: String) -> Result<bool, BoxError> {
    let wall = Instant::now();
    clear_out(&args.out)?;
    let dbs = Databases::fresh(&args).await?;
    let cast = Cast::new(&args, &args.out).await?;
    let start = Instant::now();
    let observing = Observing::spawn(&args, start);
    // Subscribers first (they declare their queues), then the drainers,
    // then the producer.
    cast.start(&cast.subscribers)?;
    queues_consumed(&args).await?;
    cast.start(&cast.drainers)?;
    let window = Duration::from_secs_f64(args.events as f64 / args.rate);
    let planned = plan_faults(&args, &cast, window);
    let production = Instant::now();
    let start_unix = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_secs_f64()
        - start.elapsed().as_secs_f64();
    cast.start(&["producer".to_owned()])?;
    let slots = cast.slots.clone();
    let world = Arc::new(World {
        slots: cast.slots,
        proxies: cast.proxies,
        args: args.clone(),
        orders: dbs.orders.clone(),
    });
    let injected: Arc<Mutex<Vec<Injected>>> = Arc::default();
    let progress = Progress {
        production,
        start,
        window,
        events: args.events,
        seen: observing.seen.clone(),
    };
    let faults = tokio::spawn(inject_in_order(
        planned.clone(),
        progress,
        world,
        injected.clone(),
    ));
    let watchdog = Watchdog::spawn(slots.clone());
    let producer = watchdog.producer_done().await;
    println!(
        "chaos: producer done after {:.1} s ({producer})",
        production.elapsed().as_secs_f64(),
    );
    let _ = faults.await;
    let quiet = settle_after_faults(&dbs, &observing.seen, start, args.settle).await;
    let exits = watchdog.stop().await;
    tokio::task::spawn_blocking(move || stop_all(&slots)).await?;
    let observed = observing.stop(&args, start).await?;
    let mut faults = injected.lock().expect("injected").clone();
    faults.sort_by_key(|f| f.planned.at);
    let course = Course {
        quiet,
        producer,
        exits,
        planned: planned.len(),
        faults,
    };
    let books = Books::read(&args, &dbs, observed, start_unix).await?;
    let ok = books.report(&args, command_line, wall.elapsed(), course)?;
    dbs.leave(&args).await?;
    Ok(ok)
}

/// Waits for the run to settle once the faults healed, then for late
/// duplicates to land before the books close: whether it settled.
async fn settle_after_faults(
    dbs: &Databases,
    seen: &Mutex<Observed>,
    start: Instant,
    bound: Duration,
) -> bool {
    println!(
        "chaos: faults healed at {:.1} s; settling",
        start.elapsed().as_secs_f64()
    );
    let quiet = settle(&dbs.orders, &dbs.subs, seen, start.elapsed(), bound).await;
    println!(
        "chaos: {} at {:.1} s",
        if quiet {
            "settled"
        } else {
            "did not settle within the bound"
        },
        start.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    quiet
}

/// The run's final state, read once every process stopped.
struct Books {
    outcome: Outcome,
    applied: BTreeMap<String, BTreeMap<u64, u64>>,
    committed: BTreeMap<u64, u64>,
}

impl Books {
    async fn read(
        args: &Args,
        dbs: &Databases,
        observed: Observed,
        start_unix: f64,
    ) -> Result<Self, BoxError> {
        let mut outcome = Outcome {
            observed,
            ..Outcome::default()
        };
        judge::read_orders(&dbs.orders, &mut outcome).await?;
        outcome.rolled_back = rolled_back(&args.out);
        let mut applied = BTreeMap::new();
        for s in SUBSCRIPTIONS {
            let pool = &dbs.subs[s.name];
            let mut state = judge::read_subscription(pool).await?;
            state.dlq = judge::drain_queue(&args.amqp, &format!("{}.dlq", s.queue)).await?;
            outcome.subscriptions.insert(s.name.to_owned(), state);
            let rate = per_second(pool, "chaos_effects", start_unix).await?;
            applied.insert(s.name.to_owned(), rate);
        }
        let committed = per_second(&dbs.orders, "chaos_orders", start_unix).await?;
        Ok(Self {
            outcome,
            applied,
            committed,
        })
    }

    /// Judges, writes the report: whether every rule held.
    fn report(
        &self,
        args: &Args,
        command: String,
        wall: Duration,
        course: Course,
    ) -> Result<bool, BoxError> {
        let mut judgement = judge::judge(&self.outcome);
        judgement.rules.extend(course.rules());
        let out_str = args.out.to_string_lossy().into_owned();
        let counters = super::roles::counters(&out_str);
        let report = Report {
            command,
            seed: args.seed,
            events: args.events,
            rate: args.rate,
            wall,
            faults: &course.faults,
            outcome: &self.outcome,
            judgement: &judgement,
            counters: &counters,
            committed_per_second: &self.committed,
            applied_per_second: &self.applied,
        };
        let out = &args.out;
        std::fs::write(out.join("report.md"), report.markdown())?;
        let json = serde_json::to_string_pretty(&report.json())?;
        std::fs::write(out.join("report.json"), json)?;
        std::fs::write(out.join("plot.svg"), report.svg())?;
        println!("\n{}", report.markdown());
        println!("chaos: report in {}", out.join("report.md").display());
        Ok(judgement.ok())
    }
}

/// The transactions the producer rolled back on purpose (`producer.json`).
fn rolled_back(out: &Path) -> std::collections::BTreeSet<uuid::Uuid> {
    let Ok(text) = std::fs::read_to_string(out.join("producer.json")) else {
        return Default::default();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Default::default();
    };
    v["rolled_back"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().and_then(|s| uuid::Uuid::parse_str(s).ok()))
        .collect()
}

impl Course {
    /// The rules of the run itself: processes stayed up, the run settled,
    /// every planned fault was injected and healed.
    fn rules(&self) -> [judge::Rule; 3] {
        let exits = self.exits.clone();
        let failed = self.faults.iter().filter(|f| f.trouble.is_some()).count();
        [
            judge::Rule {
                name: "processes_stay_up".into(),
                says: "no process exited but by a fault (the producer when done)",
                violations: exits.len() + usize::from(!self.producer.success()),
                examples: exits,
            },
            judge::Rule {
                name: "settled".into(),
                says: "after the faults healed the run settled, never going the settle bound \
                       without progress, within as long again as it took to heal",
                violations: usize::from(!self.quiet),
                examples: Vec::new(),
            },
            judge::Rule {
                name: "faults_injected".into(),
                says: "every planned fault was injected and healed",
                violations: failed + self.planned - self.faults.len(),
                examples: self
                    .faults
                    .iter()
                    .filter_map(|f| f.trouble.clone())
                    .collect(),
            },
        ]
    }
}

/// SIGTERM every process, then SIGKILL what is still there after 25 s.
fn stop_all(slots: &Slots) {
    let mut slots = slots.lock().expect("slots");
    for slot in slots.values_mut() {
        if let Some(pid) = slot.pid() {
            let _ = signal(pid, "CONT");
            let _ = signal(pid, "TERM");
        }
    }
    let until = Instant::now() + Duration::from_secs(25);
    for slot in slots.values_mut() {
        if let Some(c) = slot.child.as_mut() {
            while c.try_wait().ok().flatten().is_none() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        slot.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_go_through_the_proxy_and_keep_their_credentials() {
        assert_eq!(
            host_port("postgres://postgres@127.0.0.1:5432/postgres", 5432),
            "127.0.0.1:5432"
        );
        assert_eq!(
            host_port("amqp://guest:guest@localhost/%2f", 5672),
            "localhost:5672"
        );
        assert_eq!(
            through("amqp://guest:guest@127.0.0.1:5672/%2f", 4000),
            "amqp://guest:guest@127.0.0.1:4000/%2f"
        );
        assert_eq!(
            through(
                "postgres://postgres@db.example:5432/postgres?sslmode=disable",
                4001
            ),
            "postgres://postgres@127.0.0.1:4001/postgres?sslmode=disable"
        );
    }

    #[test]
    fn a_fault_waits_for_its_share_of_the_events() {
        let window = Duration::from_secs(100);
        assert_eq!(share_before(1_000_000, Duration::ZERO, window), 0);
        assert_eq!(
            share_before(1_000_000, Duration::from_secs(25), window),
            225_000
        );
        assert_eq!(
            share_before(1_000_000, Duration::from_secs(99), window),
            891_000
        );
        assert_eq!(share_before(10, Duration::from_secs(200), window), 9);
        assert_eq!(share_before(10, Duration::from_secs(1), Duration::ZERO), 0);
    }
}
