//! One entry point for a service: [`Outbox::builder`] wires the publisher,
//! the drainer (with its retention janitor, stats task and commit
//! listener), the inbox janitor, any number of subscriptions with their
//! handlers, and what the admin surface of `outbox-admin` serves, under one
//! graceful shutdown. The pieces it wires stay public for services that
//! need them one by one.
//!
//! ```no_run
//! # use outbox::{EventEnvelope, Handler, HandlerError, Outbox, PgTx, SubscriberSettings};
//! struct Ship;
//! impl Handler<PgTx> for Ship {
//!     async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
//!         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
//!             .bind(event.payload["id"].as_i64())
//!             .execute(&mut **tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = Outbox::builder(pool.clone())
//!     .amqp_urls("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .subscribe(SubscriberSettings::from_env("shipping.orders", &["orders.*"])?, Ship)
//!     .start()
//!     .await?; // migrates, then starts everything; bad settings fail here
//!
//! let mut tx = pool.begin().await?;
//! let event = EventEnvelope::new("orders.created", serde_json::json!({ "id": 7 }));
//! outbox.publisher().publish_tx(&mut tx, &event).await?;
//! tx.commit().await?;
//!
//! outbox.shutdown().await?; // subscriptions settle, janitors stop, the drainer finishes
//! # Ok(()) }
//! ```

use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinError, JoinHandle};

use crate::config::Env;
use crate::core::durability::DurableStandbys;
use crate::core::janitor::InboxJanitorSettings;
use crate::core::stats::{Readiness, UnreadyReason};
use crate::core::subscriber::{Handler, Subscriber, SubscriberSettings};
use crate::error::{ConfigError, SubscribeError};
use crate::pg::inbox::{PgInboxStore, PgTx};
use crate::pg::publisher::Publisher;
use crate::runtime::{DrainerHandle, InboxDrainer, TokioClock};
use crate::{DrainerConfig, LapinBroker};

/// Why the library could not start: [`OutboxBuilder::start`], or
/// [`HandlerTest::start`](crate::testing::HandlerTest::start) (which
/// meets only the first two).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A setting breaks a rule (it names the variable).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The library's migrations did not run.
    #[error("the outbox migrations failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// Two subscriptions name the same queue.
    #[error("two subscriptions name the queue {0}")]
    DuplicateSubscription(String),
}

/// Starts one subscription: its task, and what the handle keeps of it.
/// Starts one subscription on the pool, its broker client, the stop
/// signal and the durable standbys its acks wait for.
type Starter = Box<
    dyn FnOnce(&PgPool, LapinBroker, watch::Receiver<bool>, Option<Arc<DurableStandbys>>) -> Started
        + Send
        + 'static,
>;

/// A running subscription.
struct Started {
    queue: String,
    task: JoinHandle<Result<(), SubscribeError>>,
    reasons: Arc<dyn Fn() -> Vec<UnreadyReason> + Send + Sync>,
    target: Arc<dyn crate::admin::ReplayTarget>,
}

/// Builds an [`Outbox`]: see [`Outbox::builder`].
#[must_use = "a builder does nothing until `start`"]
pub struct OutboxBuilder {
    pool: PgPool,
    amqp_urls: Option<String>,
    drainer: Option<DrainerConfig>,
    inbox_janitor: Option<InboxJanitorSettings>,
    migrate: bool,
    env: Env,
    queues: Vec<String>,
    /// Each subscription's settings, checked at `start`.
    checked: Vec<Result<(), ConfigError>>,
    subscriptions: Vec<Starter>,
}

impl std::fmt::Debug for OutboxBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxBuilder")
            .field(
                "amqp_urls",
                &self.amqp_urls.as_deref().map(crate::amqp::redact_url),
            )
            .field("drainer", &self.drainer)
            .field("inbox_janitor", &self.inbox_janitor)
            .field("migrate", &self.migrate)
            .field("env_prefix", &self.env.prefix())
            .field("subscriptions", &self.queues)
            .finish()
    }
}

impl OutboxBuilder {
    /// The broker's nodes, AMQP URLs separated by commas (as
    /// `CANOPY_MQ_AMQP_URLS`, which is read when this is not called).
    pub fn amqp_urls(mut self, urls: impl Into<String>) -> Self {
        self.amqp_urls = Some(urls.into());
        self
    }

    /// The drainer's configuration (else [`DrainerConfig::from_env`]),
    /// checked at start ([`DrainerConfig::validate`]).
    pub fn drainer(mut self, config: DrainerConfig) -> Self {
        self.drainer = Some(config);
        self
    }

    /// The inbox janitor's settings (else
    /// [`InboxJanitorSettings::from_env`]); it runs only beside a
    /// subscription.
    pub fn inbox_janitor(mut self, settings: InboxJanitorSettings) -> Self {
        self.inbox_janitor = Some(settings);
        self
    }

    /// Reads the variables under `env`'s prefix (`ORDERS_MQ_*`, say)
    /// instead of `CANOPY_MQ_*`: the drainer's, the inbox janitor's and the
    /// broker's, for what is not given in code. Read a subscription's with
    /// the same `env` ([`Env::read`] with
    /// [`SubscriberSettings::from_lookup`]).
    pub fn env(mut self, env: Env) -> Self {
        self.env = env;
        self
    }

    /// Does not run the library's migrations at start (for a service whose
    /// own migrator runs stamped copies of them).
    pub fn skip_migrations(mut self) -> Self {
        self.migrate = false;
        self
    }

    /// Adds a subscription: `handler` applies each event of
    /// `settings.spec.queue` once, in the inbox's transaction.
    pub fn subscribe<H: Handler<PgTx>>(mut self, settings: SubscriberSettings, handler: H) -> Self {
        self.queues.push(settings.spec.queue.clone());
        self.checked.push(settings.validate());
        let handler = Arc::new(handler);
        self.subscriptions
            .push(Box::new(move |pool, broker, stop, durable| {
                let mut subscriber = Subscriber::new(
                    Arc::new(PgInboxStore::new(pool.clone())),
                    Arc::new(broker),
                    Arc::new(TokioClock::default()),
                    handler,
                    settings,
                );
                if let Some(durable) = durable {
                    subscriber = subscriber.with_durable_standbys(durable);
                }
                let subscriber = Arc::new(subscriber);
                let queue = subscriber.settings().spec.queue.clone();
                let running = subscriber.clone();
                let task = tokio::spawn(async move { running.run(stop).await });
                let of = subscriber.clone();
                Started {
                    queue,
                    task,
                    reasons: Arc::new(move || of.readiness_reasons()),
                    target: subscriber,
                }
            }));
        self
    }

    /// The broker client of one task.
    fn broker(&self) -> Result<LapinBroker, ConfigError> {
        match &self.amqp_urls {
            Some(urls) => LapinBroker::from_list(urls),
            None => LapinBroker::from_env_in(&self.env),
        }
    }

    /// Checks every setting, runs the migrations (unless
    /// [`skip_migrations`](Self::skip_migrations)), then starts the
    /// drainer, the inbox janitor and each subscription. A subscription the
    /// broker refuses to set up ends on its own:
    /// [`Outbox::subscription_ended`] says so.
    pub async fn start(self) -> Result<Outbox, StartError> {
        let config = match self.drainer.clone() {
            Some(config) => {
                config.validate()?;
                config
            }
            None => self.env.read(|l| DrainerConfig::from_lookup(l))?,
        };
        if let Some(Err(e)) = self.checked.iter().find(|c| c.is_err()) {
            return Err(StartError::Config(e.clone()));
        }
        for (i, queue) in self.queues.iter().enumerate() {
            if self.queues[..i].contains(queue) {
                return Err(StartError::DuplicateSubscription(queue.clone()));
            }
        }
        let inbox_janitor = match (&self.inbox_janitor, self.queues.is_empty()) {
            (_, true) => None,
            (Some(settings), false) => {
                settings.validate()?;
                Some(*settings)
            }
            (None, false) => Some(self.env.read(|l| InboxJanitorSettings::from_lookup(l))?),
        };
        let brokers = (0..=self.subscriptions.len())
            .map(|_| self.broker())
            .collect::<Result<Vec<_>, _>>()?;
        if self.migrate {
            crate::migrate::run(&self.pool)
                .await
                .map_err(StartError::Migrate)?;
        }
        let mut brokers = brokers.into_iter();
        let drainer = DrainerHandle::spawn(
            self.pool.clone(),
            brokers.next().expect("one broker per task"),
            config,
        );
        let inbox_janitor = inbox_janitor.map(|s| InboxDrainer::spawn_with(self.pool.clone(), s));
        let (stop, stopped) = watch::channel(false);
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let mut subscriptions = Vec::new();
        for (start, broker) in self.subscriptions.into_iter().zip(brokers) {
            let durable = drainer.durable_standbys();
            let mut started = start(&self.pool, broker, stopped.clone(), durable);
            let (queue, ended_tx) = (started.queue.clone(), ended_tx.clone());
            let task = started.task;
            // What a subscription's task ends with reaches `ended` too.
            started.task = tokio::spawn(async move {
                let out = ended_with(&queue, task.await);
                let _ = ended_tx.send((queue, out.clone().err()));
                out
            });
            subscriptions.push(started);
        }
        Ok(Outbox {
            publisher: Publisher::new(self.pool.clone()),
            pool: self.pool,
            drainer,
            inbox_janitor,
            subscriptions,
            stop,
            ended,
        })
    }
}

/// What subscription `queue`'s task ended with, a panic included.
fn ended_with(
    queue: &str,
    joined: Result<Result<(), SubscribeError>, JoinError>,
) -> Result<(), SubscribeError> {
    joined.unwrap_or_else(|e| {
        Err(SubscribeError::Panicked {
            queue: queue.to_owned(),
            message: e.to_string(),
        })
    })
}

/// The library running for a service: what [`Outbox::builder`] started.
pub struct Outbox {
    publisher: Publisher,
    pool: PgPool,
    drainer: DrainerHandle,
    inbox_janitor: Option<InboxDrainer>,
    subscriptions: Vec<Started>,
    stop: watch::Sender<bool>,
    ended: mpsc::UnboundedReceiver<(String, Option<SubscribeError>)>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queues: Vec<&str> = self
            .subscriptions
            .iter()
            .map(|s| s.queue.as_str())
            .collect();
        f.debug_struct("Outbox")
            .field("subscriptions", &queues)
            .finish_non_exhaustive()
    }
}

impl Outbox {
    /// A builder on `pool`: set the broker's nodes, add subscriptions, then
    /// [`start`](OutboxBuilder::start). Settings not given come from the
    /// `CANOPY_MQ_*` variables (or another prefix: [`OutboxBuilder::env`]).
    pub fn builder(pool: PgPool) -> OutboxBuilder {
        OutboxBuilder {
            pool,
            amqp_urls: None,
            drainer: None,
            inbox_janitor: None,
            migrate: true,
            env: Env::default(),
            queues: Vec::new(),
            checked: Vec::new(),
            subscriptions: Vec::new(),
        }
    }

    /// Writes events in the caller's transaction (`publish_tx`).
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Whether the service is ready: the outbox keeps up (the drainer's
    /// readiness) and every subscription consumes (a subscription still
    /// setting up counts as ready for
    /// [`NOT_CONSUMING_GRACE`](crate::core::subscriber::NOT_CONSUMING_GRACE)
    /// after its start); each reason says why not.
    pub fn readiness(&self) -> Readiness {
        let mut readiness = self.drainer.readiness();
        for s in &self.subscriptions {
            readiness.reasons.extend((s.reasons)());
        }
        readiness.ready = readiness.reasons.is_empty();
        readiness
    }

    /// The drainer, for what the entry point does not wrap (its health
    /// snapshot, its store).
    pub fn drainer(&self) -> &DrainerHandle {
        &self.drainer
    }

    /// The outbox's store on the service's pool: what operators list,
    /// unpark and skip (`outbox-admin` serves it).
    pub fn outbox_store(&self) -> crate::PgOutboxStore {
        crate::PgOutboxStore::new(self.pool.clone())
    }

    /// Every subscription as an operator's tools see it (replay, skip,
    /// list, counts, readiness), in the order they were added.
    pub fn replay_targets(&self) -> Vec<Arc<dyn crate::admin::ReplayTarget>> {
        self.subscriptions
            .iter()
            .map(|s| s.target.clone())
            .collect()
    }

    /// Resolves when a subscription ends before [`shutdown`](Self::shutdown)
    /// (the broker refused to set it up, say): its queue and its error.
    /// Pending for ever while every subscription consumes.
    pub async fn subscription_ended(&mut self) -> (String, Option<SubscribeError>) {
        match self.ended.recv().await {
            Some(end) => end,
            None => std::future::pending().await,
        }
    }

    /// Stops everything: the subscriptions settle their in-flight
    /// deliveries, the inbox janitor stops, then the drainer finishes or
    /// releases the batch in hand. Returns the first subscription's error,
    /// if one ended with one.
    pub async fn shutdown(self) -> Result<(), SubscribeError> {
        let _ = self.stop.send(true);
        let mut first = Ok(());
        for s in self.subscriptions {
            let out = ended_with(&s.queue, s.task.await);
            if first.is_ok() {
                first = out;
            }
        }
        if let Some(janitor) = self.inbox_janitor {
            janitor.shutdown().await;
        }
        self.drainer.shutdown().await;
        first
    }
}
