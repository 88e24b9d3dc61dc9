//! The chaos runner: the whole system on the real PostgreSQL and RabbitMQ,
//! as separate OS processes, under many real faults in one long run, judged
//! by an observer that shares no code with what it observes.
//!
//! `chaos run` (the orchestrator, [`run`]) starts, each as a process of
//! this same binary: a producer writing domain rows with `publish_tx` and
//! `publish_many_tx` at a steady rate, three drainer replicas
//! (`DrainerHandle::spawn`), and two replicas of each of two subscriptions
//! (`Subscriber`), each subscription in a database of its own as services
//! run them; `shipping`'s handler fails now and then, and always on poison
//! events. Every process reaches each service through a TCP proxy of its
//! own in the orchestrator ([`proxy`]), so a fault can black-hole or cut one
//! process's link. It injects a seeded schedule of faults it prints first
//! ([`plan`]): SIGKILL of drainers and subscribers (restarted after),
//! SIGSTOP of a drainer past its lease then SIGCONT, `rabbitmqctl
//! close_all_connections`, a RabbitMQ restart (`stop_app`/`start_app`), a
//! PostgreSQL crash (immediate stop) and restart, `pg_terminate_backend` of the library's sessions,
//! and proxy black-holes and cuts. An observer ([`observer`]) reads a
//! catch-all queue bound to the exchange on its own connection; at the end
//! SQL on each database and the dead-letter queues give the final state,
//! and [`judge`] applies the simulation's own end-state rules to it
//! (`sim::checker::check_end_state`: lost, phantom_publish, undrained,
//! unpublishable_parks, exactly_once_effect, phantom_effect) plus the
//! chaos run's poison rules. [`report`] writes markdown, JSON and an SVG of
//! events published and applied per second with the faults marked.
//!
//! It lives in `benches` beside the performance harness: like the harness
//! it drives the real services, and `benches` already has them and the
//! `sim` crate whose rules it reuses; the production crate stays lean, and
//! `sim`'s madsim build (whose tokio is madsim's) stays free of real I/O.

pub mod cluster;
pub mod judge;
pub mod observer;
pub mod plan;
pub mod proxy;
pub mod report;
pub mod roles;
pub mod run;

use std::time::Duration;

/// The exchange of the run.
pub const EXCHANGE: &str = "chaos.events";
/// The observer's queue: bound to everything, read by the observer alone.
pub const OBSERVER_QUEUE: &str = "chaos.observer";
/// The producer's database (the outbox and its domain table).
pub const ORDERS_DB: &str = "chaos_orders";
/// Routing key of ordinary events.
pub const ROUTING_ORDER: &str = "chaos.order.created";
/// Routing key of events `shipping`'s handler always refuses: they must
/// end dead-lettered there, and take effect in `billing`.
pub const ROUTING_POISON: &str = "chaos.poison.created";

/// Drainer settings of the run: short leases and deadlines, so the faults'
/// effects (leases expiring, Phase-2 timeouts) fall inside the run.
pub const LEASE_TTL: Duration = Duration::from_secs(10);
/// See [`LEASE_TTL`].
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(4);
/// Row-culpable failures before a row parks.
pub const DRAINER_MAX_ATTEMPTS: u32 = 3;
/// Handler failures before a delivery is dead-lettered.
pub const SUBSCRIBER_MAX_ATTEMPTS: u32 = 3;
/// One `shipping` event in this many fails its first attempt (recorded
/// outside the transaction, so a restarted replica does not fail it again).
pub const TRANSIENT_ONE_IN: u64 = 20;

/// Partitions of each subscription when the run writes ordering keys
/// (`--ordering-keys`): each replica runs one worker per partition, and
/// the other replica stands by on each.
pub const PARTITIONS: u16 = 4;

/// The ordering key of a keyed event of the run: one of `keys`.
pub fn ordering_key(k: u64) -> String {
    format!("account-{k}")
}

/// Drainer replicas.
pub const DRAINERS: usize = 3;
/// Replicas of each subscription.
pub const REPLICAS: usize = 2;

/// One subscription of the run.
#[derive(Debug, Clone, Copy)]
pub struct Subscription {
    /// Its name (the processes are `NAME-1`, `NAME-2`).
    pub name: &'static str,
    /// Its database.
    pub db: &'static str,
    /// Its queue (and `QUEUE.dlq`).
    pub queue: &'static str,
    /// Whether its handler fails (poison always, one in
    /// [`TRANSIENT_ONE_IN`] once).
    pub fails: bool,
}

/// The run's two subscriptions.
pub const SUBSCRIPTIONS: [Subscription; 2] = [
    Subscription {
        name: "billing",
        db: "chaos_billing",
        queue: "chaos.billing",
        fails: false,
    },
    Subscription {
        name: "shipping",
        db: "chaos_shipping",
        queue: "chaos.shipping",
        fails: true,
    },
];

impl Subscription {
    /// Its subscriber's settings as the run declares it: bound to
    /// everything on [`EXCHANGE`], and with ordering keys (`keyed`) ordered
    /// over [`PARTITIONS`].
    pub fn settings(&self, keyed: bool) -> outbox::SubscriberSettings {
        let mut settings = outbox::SubscriberSettings::new(self.queue, &["#"]);
        settings.spec.exchange = EXCHANGE.into();
        if keyed {
            settings.ordered(PARTITIONS)
        } else {
            settings
        }
    }

    /// The queues its consumers read: its own, or with ordering keys
    /// (`keyed`) its [`PARTITIONS`] partition queues.
    pub fn consumed_queues(&self, keyed: bool) -> Vec<String> {
        let mut queues: Vec<String> = self
            .settings(keyed)
            .worker_specs()
            .iter()
            .map(outbox::config::SubscriptionSpec::consumed_queue)
            .collect();
        queues.dedup();
        queues
    }
}

/// Connects to the first node of `list` (AMQP URLs separated by commas)
/// that answers: the orchestrator's and the observer's own connections,
/// which must outlive any one node of a cluster.
/// The error names each node with its password hidden.
pub async fn connect_any(list: &str) -> Result<lapin::Connection, String> {
    let mut errors = Vec::new();
    for url in nodes(list) {
        match lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await {
            Ok(c) => return Ok(c),
            Err(e) => errors.push(format!("{}: {e}", outbox::amqp::redact_url(&url))),
        }
    }
    Err(format!("no broker node answered ({})", errors.join("; ")))
}

/// How long closing a connection of the runner's own may take: lapin's
/// `close` can wait forever on a connection the broker already dropped.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Closes `conn`, bounded by [`CLOSE_TIMEOUT`].
pub async fn close(conn: lapin::Connection) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, conn.close(200, "OK".into())).await;
}

/// `queue` as a passive declaration on `ch` sees it (its ready messages
/// and its consumers), or `None` if the broker does not answer within
/// [`observer::STEP_TIMEOUT`] or refuses.
pub async fn peek_queue(ch: &lapin::Channel, queue: &str) -> Option<lapin::Queue> {
    let declare = ch.queue_declare(
        queue.into(),
        lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    );
    tokio::time::timeout(observer::STEP_TIMEOUT, declare)
        .await
        .ok()?
        .ok()
}

/// The nodes `list` names (AMQP URLs separated by commas).
pub fn nodes(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The subscription named `name`.
pub fn subscription(name: &str) -> Option<Subscription> {
    SUBSCRIPTIONS.iter().copied().find(|s| s.name == name)
}

/// A seeded generator for the run's draws (the producer's kinds, the fault
/// plan).
pub struct Rng(outbox::runtime::SplitMix64);

impl Rng {
    /// The generator of `seed`'s stream `purpose`.
    pub fn new(seed: u64, purpose: &str) -> Self {
        Self(outbox::runtime::SplitMix64::new(sim::world::stream(
            seed, purpose,
        )))
    }

    /// A uniform draw in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        use outbox::core::ports::Entropy;
        self.0.next_u64() % n.max(1)
    }

    /// A uniform draw in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        use outbox::core::ports::Entropy;
        (self.0.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform duration in `[lo, hi)`.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        lo + (hi.saturating_sub(lo)).mul_f64(self.unit())
    }
}
