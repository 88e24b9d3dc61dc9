//! Production adapters of the time, task and entropy ports, and the wiring
//! that spawns the drainer, the janitor, the stats task and the commit
//! listener.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::amqp::LapinBroker;
use crate::config::DrainerConfig;
use crate::core::drainer::Drainer;
use crate::core::durability::DurableStandbys;
use crate::core::janitor::InboxJanitorSettings;
use crate::core::marks::Marks;
pub use crate::core::ports::OutboxStats;
use crate::core::ports::{
    BoxTask, Broker, Clock, CommitWakeup, Entropy, OutboxStore, Spawn, TaskEnd,
};
pub use crate::core::stats::{OutboxHealth, Readiness, UnreadyReason};
use crate::core::{janitor, stats};
use crate::error::ConfigError;
use crate::pg::PgOutboxStore;
use crate::pg::inbox::PgInboxStore;

/// Tokio's clock. Under `tokio::time::pause` (and turmoil) it is simulated.
#[derive(Debug, Clone)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    async fn sleep(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }
}

/// Tokio's tasks: [`DrainerHandle`]'s tasks in production.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioSpawn;

impl Spawn for TokioSpawn {
    fn spawn(&self, task: BoxTask) -> TaskEnd {
        let handle = tokio::spawn(task);
        Box::pin(async move {
            match handle.await {
                Err(e) if e.is_panic() => Err(e.to_string()),
                _ => Ok(()),
            }
        })
    }
}

/// A seeded SplitMix64 sequence: the `Entropy` the simulation uses directly
/// and the generator behind [`OsEntropy`].
#[derive(Debug)]
pub struct SplitMix64 {
    state: std::sync::atomic::AtomicU64,
}

impl SplitMix64 {
    /// The sequence starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            state: std::sync::atomic::AtomicU64::new(seed),
        }
    }
}

impl Entropy for SplitMix64 {
    fn next_u64(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// OS-seeded entropy: a [`SplitMix64`] seeded from a UUID v7's random bits
/// (which come from the OS).
#[derive(Debug)]
pub struct OsEntropy(SplitMix64);

impl Default for OsEntropy {
    fn default() -> Self {
        Self(SplitMix64::new(uuid::Uuid::now_v7().as_u64_pair().1))
    }
}

impl Entropy for OsEntropy {
    fn next_u64(&self) -> u64 {
        self.0.next_u64()
    }
}

/// The production drainer type.
pub type PgLapinDrainer = Drainer<PgOutboxStore, LapinBroker, TokioClock, OsEntropy>;

/// A running drainer with its janitor, stats task and commit listener.
///
/// [`spawn`](DrainerHandle::spawn) runs it on PostgreSQL and RabbitMQ;
/// [`spawn_on`](DrainerHandle::spawn_on) on any [`DrainerPorts`] (the
/// simulation runs this entry point, spawned tasks and all, on its fakes).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let config = outbox::DrainerConfig::from_env()?; // fails at boot on bad values
/// let broker = outbox::LapinBroker::new("amqp://guest:guest@127.0.0.1:5672/%2f");
/// let handle = outbox::DrainerHandle::spawn(pool, broker, config);
/// // ... serve traffic; `handle.readiness()` backs /readyz ...
/// handle.shutdown().await; // finishes or releases the batch in hand
/// # Ok(()) }
/// ```
pub struct DrainerHandle<S = PgOutboxStore, B = LapinBroker, C = TokioClock> {
    shutdown: watch::Sender<bool>,
    tasks: Vec<TaskEnd>,
    health: OutboxHealth,
    clock: Arc<C>,
    config: DrainerConfig,
    store: Arc<S>,
    broker: Arc<B>,
    durable: Option<Arc<DurableStandbys>>,
}

impl<S, B, C> std::fmt::Debug for DrainerHandle<S, B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainerHandle")
            .field("config", &self.config)
            .field("tasks", &self.tasks.len())
            .finish_non_exhaustive()
    }
}

/// What a [`DrainerHandle`] runs on: the drainer's ports, its commit
/// wakeup, where its tasks run, and where its coverage marks go.
pub struct DrainerPorts<S, B, C, E, W, P = TokioSpawn> {
    /// The outbox table.
    pub store: S,
    /// The broker the drainer publishes to.
    pub broker: B,
    /// Time, for every task.
    pub clock: C,
    /// The drainer's jitter.
    pub entropy: E,
    /// What wakes the drainer at a commit.
    pub wakeup: W,
    /// Where the four tasks run.
    pub spawn: P,
    /// Where the drainer and janitor report their paths (none in production).
    pub marks: Marks,
}

impl<S, B, C, E, W, P> std::fmt::Debug for DrainerPorts<S, B, C, E, W, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainerPorts")
            .field("marks", &self.marks)
            .finish_non_exhaustive()
    }
}

/// The commit wakeup on PostgreSQL: one pooled connection `LISTEN`s.
#[derive(Debug)]
pub struct PgCommitWakeup(pub sqlx::PgPool);

impl CommitWakeup for PgCommitWakeup {
    async fn listen(self, wakeup: Arc<tokio::sync::Notify>, shutdown: watch::Receiver<bool>) {
        listen_for_commits(self.0, wakeup, shutdown).await;
    }
}

impl DrainerHandle {
    /// Spawns the drainer, the retention janitor, the stats task and the
    /// commit listener on PostgreSQL and RabbitMQ.
    pub fn spawn(pool: sqlx::PgPool, broker: LapinBroker, config: DrainerConfig) -> Self {
        let ports = DrainerPorts {
            store: PgOutboxStore::new(pool.clone()),
            broker,
            clock: TokioClock::default(),
            entropy: OsEntropy::default(),
            wakeup: PgCommitWakeup(pool),
            spawn: TokioSpawn,
            marks: Marks::default(),
        };
        Self::spawn_on(ports, config)
    }
}

impl<S: OutboxStore, B: Broker, C: Clock> DrainerHandle<S, B, C> {
    /// Spawns the drainer, the retention janitor, the stats task and the
    /// commit listener on `ports`, each a task of `ports.spawn`.
    pub fn spawn_on<E: Entropy, W: CommitWakeup, P: Spawn>(
        ports: DrainerPorts<S, B, C, E, W, P>,
        config: DrainerConfig,
    ) -> Self {
        let DrainerPorts {
            store,
            broker,
            clock,
            entropy,
            wakeup: listener,
            spawn,
            marks,
        } = ports;
        let store = Arc::new(store);
        let broker = Arc::new(broker);
        let clock = Arc::new(clock);
        let (tx, rx) = watch::channel(false);
        let health = OutboxHealth::default();
        let wakeup = Arc::new(tokio::sync::Notify::new());
        let durable = DurableStandbys::of(&config).map(Arc::new);
        let mut drainer = Drainer::new(
            store.clone(),
            broker.clone(),
            clock.clone(),
            Arc::new(entropy),
            config.clone(),
        )
        .with_marks(marks.clone())
        .with_wakeup(wakeup.clone());
        if let Some(durable) = &durable {
            drainer = drainer.with_durable_standbys(durable.clone());
        }
        let tasks = vec![
            spawn.spawn(Box::pin(drainer.run(rx.clone()))),
            spawn.spawn(Box::pin(listener.listen(wakeup, rx.clone()))),
            spawn.spawn(Box::pin(janitor::run(
                store.clone(),
                clock.clone(),
                config.clone(),
                rx.clone(),
                marks,
            ))),
            spawn.spawn(Box::pin(stats::run(
                store.clone(),
                clock.clone(),
                config.clone(),
                health.clone(),
                rx,
            ))),
        ];
        Self {
            shutdown: tx,
            tasks,
            health,
            clock,
            config,
            store,
            broker,
            durable,
        }
    }

    /// The outbox's readiness, from the stats task's latest sample and the
    /// durable standbys' wait.
    pub fn readiness(&self) -> Readiness {
        self.readiness_probe()()
    }

    /// A cloneable readiness check for an admin surface (`/readyz`).
    pub fn readiness_probe(&self) -> impl Fn() -> Readiness + Send + Sync + 'static {
        let health = self.health.clone();
        let config = self.config.clone();
        let clock = self.clock.clone();
        let durable = self.durable.clone();
        move || {
            let now = clock.now();
            let mut readiness = health.readiness(&config, now);
            if let Some(durable) = &durable {
                readiness.reasons.extend(durable.reasons(now));
                readiness.ready = readiness.reasons.is_empty();
            }
            readiness
        }
    }

    /// The standbys publishing waits for (`CANOPY_MQ_DURABLE_STANDBYS`),
    /// to give a subscriber the same gate
    /// ([`Subscriber::with_durable_standbys`](crate::Subscriber::with_durable_standbys)).
    pub fn durable_standbys(&self) -> Option<Arc<DurableStandbys>> {
        self.durable.clone()
    }

    /// The shared health snapshot (for an admin surface).
    pub fn health(&self) -> &OutboxHealth {
        &self.health
    }

    /// The store the drainer uses (for unpark and parked-row listing).
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Stops every task it spawned (the drainer, the janitor, the stats task
    /// and the commit listener), letting the drainer finish or release the
    /// batch in hand, then closes the broker connection (bounded).
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            if let Err(panic) = task.await {
                tracing::error!(error = %panic, "outbox task panicked");
            }
        }
        self.broker.connection_close().await;
    }
}

/// Pause before listening again after the listener connection failed.
pub const LISTEN_RETRY: Duration = Duration::from_secs(5);

/// Wakes the drainer whenever a transaction that wrote envelopes commits
/// (`publish_tx` and `publish_many_tx` send `NOTIFY canopy_outbox`), so the
/// end-to-end latency is a claim away instead of up to a tick. Holds one
/// connection of the pool. Any failure only costs latency: the drainer keeps
/// polling at its tick.
async fn listen_for_commits(
    pool: sqlx::PgPool,
    wakeup: Arc<tokio::sync::Notify>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(mut listener) => match listener.listen(crate::pg::WAKEUP_CHANNEL).await {
                Ok(()) => loop {
                    tokio::select! {
                        biased;
                        _ = shutdown.changed() => return,
                        n = listener.recv() => match n {
                            Ok(_) => wakeup.notify_one(),
                            Err(e) => {
                                tracing::warn!(error = %crate::pg::map_err(e), "outbox wakeup listener failed; polling until it is back");
                                break;
                            }
                        },
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %crate::pg::map_err(e), "cannot LISTEN for outbox commits; polling");
                }
            },
            Err(e) => {
                tracing::warn!(error = %crate::pg::map_err(e), "cannot connect the outbox wakeup listener; polling");
            }
        }
        tokio::select! {
            biased;
            _ = shutdown.changed() => return,
            () = tokio::time::sleep(LISTEN_RETRY) => {}
        }
    }
}

/// The inbox janitor of amendment #433, running on its own task: deletes
/// processed `event_inbox` rows past retention, hourly, in bounded batches;
/// unprocessed rows stay for replay.
///
/// The name is the ADR's: amendment #433 calls the inbox's retention task
/// `InboxDrainer::spawn(pool)`, and services written against the ADR call
/// it so. It drains nothing from a queue; it only sweeps the inbox.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox::InboxJanitorSettings;
/// let settings = InboxJanitorSettings::from_env()?; // CANOPY_MQ_INBOX_RETENTION_DAYS
/// let janitor = outbox::InboxDrainer::spawn_with(pool, settings);
/// // ...
/// janitor.shutdown().await;
/// # Ok(()) }
/// ```
pub struct InboxDrainer {
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for InboxDrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxDrainer")
            .field("stopping", &*self.shutdown.borrow())
            .finish_non_exhaustive()
    }
}

impl InboxDrainer {
    /// Spawns the janitor with the settings of the environment
    /// (`CANOPY_MQ_INBOX_RETENTION_DAYS`, default 7 days; hourly): fails,
    /// naming the variable, on a value that breaks a rule.
    pub fn spawn(pool: sqlx::PgPool) -> Result<Self, ConfigError> {
        Ok(Self::spawn_with(pool, InboxJanitorSettings::from_env()?))
    }

    /// Spawns the janitor with `settings`.
    pub fn spawn_with(pool: sqlx::PgPool, settings: InboxJanitorSettings) -> Self {
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(janitor::run_inbox(
            Arc::new(PgInboxStore::new(pool)),
            Arc::new(TokioClock::default()),
            settings,
            rx,
            Marks::default(),
        ));
        Self { shutdown: tx, task }
    }

    /// Stops the janitor after its current statement.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        if let Err(e) = self.task.await
            && e.is_panic()
        {
            tracing::error!(error = %e, "inbox janitor panicked");
        }
    }
}
