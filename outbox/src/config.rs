//! Drainer configuration: the `CANOPY_MQ_*` variables of ADR-018, their
//! defaults, and the boot asserts of amendments #478 and #1061.
//!
//! Both [`DrainerConfig::from_env`] and [`DrainerConfigBuilder::build`] run the
//! same checks, so a misconfiguration fails at boot with an error naming the
//! variable, the value and the rule, never silently at the first tick.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::error::ConfigError;

/// Assumed worst-case latency of one publish+confirm (#478).
pub const ASSUMED_PUBLISH_LATENCY_MS: u64 = 100;
/// Upper bound on `batch_size`: a claim batch is held in memory and in one
/// statement's parameter arrays.
pub const BATCH_SIZE_MAX: u32 = 10_000;
/// Upper bound on `pipeline_depth` (unconfirmed publishes in flight).
pub const PIPELINE_DEPTH_MAX: u32 = 10_000;
/// Upper bound on the retention, in days (a century).
pub const RETENTION_DAYS_MAX: u64 = 36_500;
/// Longest lease accepted, in seconds (a day): a crashed drainer's rows wait
/// this long to be reclaimed, and PostgreSQL's timestamps bound it anyway.
pub const LEASE_TTL_SECS_MAX: u64 = 86_400;

/// Longest busy tick accepted, in milliseconds (a minute; the idle tick is
/// four times it).
pub const TICK_MS_MAX: u64 = 60_000;
/// Largest parking budget accepted (`attempts` is a 32-bit column, and a
/// row that fails ten thousand times is a poison row by any measure).
pub const MAX_ATTEMPTS_MAX: u32 = 10_000;
/// Largest claim rate bound accepted, rows per second.
pub const MAX_ROWS_PER_SEC_MAX: u32 = 1_000_000;
/// Largest pending-row threshold accepted.
pub const PENDING_WARN_MAX: u64 = 1_000_000_000_000;
/// Longest oldest-unpublished-age threshold accepted, in seconds (a year).
pub const OLDEST_WARN_SECS_MAX: u64 = 365 * 86_400;

/// Every variable [`DrainerConfig::from_env`] reads.
pub mod vars {
    /// Busy poll interval in ms; the idle interval is four times this.
    pub const TICK_MS: &str = "CANOPY_MQ_DRAINER_TICK_MS";
    /// Rows claimed per tick.
    pub const BATCH_SIZE: &str = "CANOPY_MQ_DRAINER_BATCH_SIZE";
    /// Lease length; an older claim is reclaimable by any drainer.
    pub const LEASE_TTL_SECS: &str = "CANOPY_MQ_DRAINER_LEASE_TTL_SECS";
    /// Unconfirmed publishes in flight per replica.
    pub const PIPELINE_DEPTH: &str = "CANOPY_MQ_DRAINER_PIPELINE_DEPTH";
    /// Deadline over the whole Phase 2 of one batch.
    pub const CONFIRM_TIMEOUT_SECS: &str = "CANOPY_MQ_DRAINER_CONFIRM_TIMEOUT_SECS";
    /// Upper bound on the rows one replica claims per second (0: none).
    pub const MAX_ROWS_PER_SEC: &str = "CANOPY_MQ_DRAINER_MAX_ROWS_PER_SEC";
    /// How long a drainer woken by a commit waits for more commits before
    /// it claims (0: claims at once).
    pub const WAKEUP_LINGER_MS: &str = "CANOPY_MQ_DRAINER_WAKEUP_LINGER_MS";
    /// Row-culpable failures before a row parks.
    pub const MAX_ATTEMPTS: &str = "CANOPY_MQ_DRAINER_MAX_ATTEMPTS";
    /// Days a published row is kept before the janitor deletes it.
    pub const RETENTION_DAYS: &str = "CANOPY_MQ_OUTBOX_RETENTION_DAYS";
    /// This drainer's identity in `claimed_by`.
    pub const REPLICA_ID: &str = "CANOPY_MQ_REPLICA_ID";
    /// Exchange the drainer publishes to.
    pub const EXCHANGE: &str = "CANOPY_MQ_EXCHANGE";
    /// Pending-row count above which the stats task warns and readiness fails.
    pub const PENDING_WARN: &str = "CANOPY_MQ_OUTBOX_PENDING_WARN";
    /// Oldest-unpublished age above which the stats task warns and readiness fails.
    pub const OLDEST_WARN_SECS: &str = "CANOPY_MQ_OUTBOX_OLDEST_WARN_SECS";
    /// Standbys (comma-separated `application_name`s) that must have
    /// flushed a commit before what rests on it is published or acked.
    pub const DURABLE_STANDBYS: &str = "CANOPY_MQ_DURABLE_STANDBYS";
    /// Pre-ADR-018 in-memory buffer size: accepted, ignored, warned about once.
    pub const BUFFER_MAX: &str = "CANOPY_MQ_BUFFER_MAX";
    /// Days a processed inbox row is kept before the inbox janitor deletes it.
    pub const INBOX_RETENTION_DAYS: &str = "CANOPY_MQ_INBOX_RETENTION_DAYS";
    /// Unacknowledged deliveries the broker may push to one subscriber.
    pub const SUBSCRIBER_PREFETCH: &str = "CANOPY_MQ_SUBSCRIBER_PREFETCH";
    /// Deliveries one subscriber handles at once.
    pub const SUBSCRIBER_CONCURRENCY: &str = "CANOPY_MQ_SUBSCRIBER_CONCURRENCY";
    /// Failed handler attempts before a delivery is dead-lettered.
    pub const SUBSCRIBER_MAX_ATTEMPTS: &str = "CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS";
    /// Largest delivery body a subscriber handles; larger ones are
    /// dead-lettered at once.
    pub const SUBSCRIBER_MAX_BODY_BYTES: &str = "CANOPY_MQ_SUBSCRIBER_MAX_BODY_BYTES";
    /// Longest a handler may run on one delivery before the attempt counts
    /// as failed.
    pub const SUBSCRIBER_HANDLER_TIMEOUT_SECS: &str = "CANOPY_MQ_SUBSCRIBER_HANDLER_TIMEOUT_SECS";
    /// Deliveries one subscriber worker applies in one transaction.
    pub const SUBSCRIBER_BATCH_MAX: &str = "CANOPY_MQ_SUBSCRIBER_BATCH_MAX";
    /// Longest a batch's first delivery waits for company, in milliseconds.
    pub const SUBSCRIBER_BATCH_LINGER_MS: &str = "CANOPY_MQ_SUBSCRIBER_BATCH_LINGER_MS";
    /// The kind of queue a subscription declares: `quorum` (default) or
    /// `classic`.
    pub const SUBSCRIBER_QUEUE_TYPE: &str = "CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE";
    /// Per-key order: the subscription's partition queues (0, the default:
    /// one queue, no order; else 1, 2, 4, 8, 16, 32 or 64).
    pub const SUBSCRIBER_PARTITIONS: &str = "CANOPY_MQ_SUBSCRIBER_PARTITIONS";
    /// The broker's nodes, comma-separated AMQP URLs (a comma inside a
    /// password is written `%2C`).
    pub const AMQP_URLS: &str = "CANOPY_MQ_AMQP_URLS";
    /// The AMQP heartbeat every connection asks for, in seconds.
    pub const AMQP_HEARTBEAT_SECS: &str = "CANOPY_MQ_AMQP_HEARTBEAT_SECS";
}

/// Default unacknowledged deliveries per subscriber: twice the default
/// concurrency × batch maximum (4 × 16), so each worker's next batch is
/// already delivered while it applies one. A quorum queue needs it: at 64
/// (one batch per worker) the subscriber ran at 0.45× its rate on a
/// classic queue, at 128 at 1.17× (harness P7, 20 000 events, this
/// machine's RabbitMQ 3.10).
pub const SUBSCRIBER_PREFETCH_DEFAULT: u16 = 128;

/// Upper bound on a subscriber's handler concurrency.
pub const SUBSCRIBER_CONCURRENCY_MAX: u32 = 1024;

/// Default largest delivery a subscriber handles: four times the largest
/// envelope [`crate::Publisher`] writes by default, so every default-sized
/// event passes with room to spare, while a stray huge message cannot make
/// every worker hold a broker-sized (128 MiB) body at once.
pub const SUBSCRIBER_MAX_BODY_BYTES_DEFAULT: u32 =
    4 * crate::envelope::DEFAULT_MAX_ENVELOPE_BYTES as u32;
/// RabbitMQ's own largest message (`max_message_size`, 128 MiB).
pub const SUBSCRIBER_MAX_BODY_BYTES_MAX: u32 = 128 * 1024 * 1024;

/// Default handler deadline: long enough for a handler's few statements and
/// a slow downstream call, short enough that a hung handler neither holds
/// its worker nor its inbox row lock for long (PostgreSQL ends a handler
/// transaction idle for 60 s anyway).
pub const SUBSCRIBER_HANDLER_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Longest handler deadline accepted (an hour).
pub const SUBSCRIBER_HANDLER_TIMEOUT_MAX_SECS: u64 = 3600;

/// Default number of deliveries one worker applies in one transaction
/// (chosen by measurement: see docs/internals/performance.md, P7).
pub const SUBSCRIBER_BATCH_MAX_DEFAULT: u32 = 16;
/// Largest batch accepted. Each delivery of a batch is a savepoint, a
/// subtransaction: past 64 of them in one transaction PostgreSQL's
/// subtransaction cache overflows and every session's snapshots slow down.
pub const SUBSCRIBER_BATCH_MAX_MAX: u32 = 64;
/// Default longest wait of a batch's first delivery for company: a trickle
/// keeps its latency, a stream fills its batches.
pub const SUBSCRIBER_BATCH_LINGER_DEFAULT: Duration = Duration::from_millis(2);
/// Longest linger accepted, in milliseconds.
pub const SUBSCRIBER_BATCH_LINGER_MAX_MS: u64 = 1000;

impl crate::core::subscriber::SubscriberSettings {
    /// A subscription of `queue` to `bindings` on the default exchange
    /// (`canopy.events`) with the default prefetch (128), concurrency (4),
    /// attempt budget (5) and batches of up to 16 deliveries lingering at
    /// most 2 ms. Call [`validate`](Self::validate) (or use
    /// [`from_env`](Self::from_env), which does) before running it.
    pub fn new(queue: impl Into<String>, bindings: &[&str]) -> Self {
        Self {
            spec: crate::core::ports::SubscriptionSpec {
                queue: queue.into(),
                exchange: "canopy.events".into(),
                bindings: bindings.iter().map(|b| (*b).to_owned()).collect(),
                prefetch: SUBSCRIBER_PREFETCH_DEFAULT,
                queue_type: crate::core::ports::QueueType::Quorum,
                partitions: 0,
                partition: None,
            },
            concurrency: 4,
            max_attempts: 5,
            max_body_bytes: SUBSCRIBER_MAX_BODY_BYTES_DEFAULT,
            handler_timeout: SUBSCRIBER_HANDLER_TIMEOUT_DEFAULT,
            batch_max: SUBSCRIBER_BATCH_MAX_DEFAULT,
            batch_linger: SUBSCRIBER_BATCH_LINGER_DEFAULT,
        }
    }

    /// The same settings with the subscription's queue of kind `queue_type`
    /// (a builder step; `CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE` in
    /// [`from_env`](Self::from_env)).
    ///
    /// ```
    /// use outbox::{QueueType, SubscriberSettings};
    /// let s = SubscriberSettings::new("billing.orders", &["orders.*"]);
    /// assert_eq!(s.spec.queue_type, QueueType::Quorum);
    /// let s = s.queue_type(QueueType::Classic);
    /// assert_eq!(s.spec.queue_type, QueueType::Classic);
    /// ```
    #[must_use]
    pub fn queue_type(mut self, queue_type: crate::core::ports::QueueType) -> Self {
        self.spec.queue_type = queue_type;
        self
    }

    /// The same settings with events of one ordering key applied in the
    /// order they committed (a builder step; `CANOPY_MQ_SUBSCRIBER_PARTITIONS`
    /// in [`from_env`](Self::from_env)): the subscription becomes
    /// `partitions` partition queues, each consumed by one worker of one
    /// replica at a time (RabbitMQ's single active consumer), and a key's
    /// events all go to one partition. `0` is one queue, no order.
    ///
    /// ```
    /// let s = outbox::SubscriberSettings::new("billing.orders", &["orders.*"]).ordered(8);
    /// assert_eq!(s.workers(), 8);
    /// let queues: Vec<String> = s.worker_specs().iter().map(|w| w.consumed_queue()).collect();
    /// assert_eq!(queues[0], "billing.orders.p0");
    /// assert_eq!(queues[7], "billing.orders.p7");
    /// ```
    #[must_use]
    pub fn ordered(mut self, partitions: u16) -> Self {
        self.spec.partitions = partitions;
        self
    }

    /// The subscriber's workers: one per partition on an ordered
    /// subscription, else [`concurrency`](Self::concurrency).
    pub fn workers(&self) -> u32 {
        match self.spec.partitions {
            0 => self.concurrency.max(1),
            p => u32::from(p),
        }
    }

    /// The subscription as each worker opens it, on a channel of its own:
    /// an even share of `prefetch` (rounded down, at least one), so the
    /// subscriber as a whole holds at most `prefetch` unacknowledged
    /// deliveries.
    ///
    /// ```
    /// let mut s = outbox::SubscriberSettings::new("billing.orders", &["orders.*"]);
    /// s.spec.prefetch = 64;
    /// s.concurrency = 4;
    /// assert_eq!(s.worker_spec().prefetch, 16);
    /// ```
    pub fn worker_spec(&self) -> crate::core::ports::SubscriptionSpec {
        let mut spec = self.spec.clone();
        let share = u32::from(spec.prefetch) / self.workers();
        spec.prefetch = u16::try_from(share.max(1)).unwrap_or(u16::MAX);
        spec
    }

    /// Each worker's [`worker_spec`](Self::worker_spec): on an ordered
    /// subscription, worker `i` consumes partition `i`.
    pub fn worker_specs(&self) -> Vec<crate::core::ports::SubscriptionSpec> {
        let spec = self.worker_spec();
        (0..self.workers())
            .map(|i| {
                let mut w = spec.clone();
                if spec.partitions > 0 {
                    w.partition = u16::try_from(i).ok();
                }
                w
            })
            .collect()
    }

    /// [`new`](Self::new) with `CANOPY_MQ_EXCHANGE`,
    /// `CANOPY_MQ_SUBSCRIBER_PREFETCH`, `CANOPY_MQ_SUBSCRIBER_CONCURRENCY`,
    /// `CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS`,
    /// `CANOPY_MQ_SUBSCRIBER_MAX_BODY_BYTES`,
    /// `CANOPY_MQ_SUBSCRIBER_HANDLER_TIMEOUT_SECS`,
    /// `CANOPY_MQ_SUBSCRIBER_BATCH_MAX`,
    /// `CANOPY_MQ_SUBSCRIBER_BATCH_LINGER_MS`,
    /// `CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE` and
    /// `CANOPY_MQ_SUBSCRIBER_PARTITIONS` applied, then validated.
    pub fn from_env(queue: impl Into<String>, bindings: &[&str]) -> Result<Self, ConfigError> {
        from_process_env(|lookup| Self::from_lookup(queue, bindings, lookup))
    }

    /// Like [`from_env`](Self::from_env), reading variables through `lookup`.
    ///
    /// ```
    /// use outbox::SubscriberSettings;
    /// let s = SubscriberSettings::from_lookup("billing.orders", &["orders.*"], |v| {
    ///     (v == "CANOPY_MQ_SUBSCRIBER_PREFETCH").then(|| "64".to_owned())
    /// })
    /// .unwrap();
    /// assert_eq!(s.spec.prefetch, 64);
    /// let e = SubscriberSettings::from_lookup("billing.orders", &["orders.*"], |v| {
    ///     (v == "CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS").then(|| "0".to_owned())
    /// })
    /// .unwrap_err();
    /// assert_eq!(e.to_string(), "CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS=0 is invalid: must be > 0");
    /// ```
    pub fn from_lookup(
        queue: impl Into<String>,
        bindings: &[&str],
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut s = Self::new(queue, bindings);
        if let Some(v) = lookup(vars::EXCHANGE) {
            s.spec.exchange = v;
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_PREFETCH) {
            s.spec.prefetch = parse(vars::SUBSCRIBER_PREFETCH, &v)?;
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_CONCURRENCY) {
            s.concurrency = parse(vars::SUBSCRIBER_CONCURRENCY, &v)?;
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_MAX_ATTEMPTS) {
            s.max_attempts = parse(vars::SUBSCRIBER_MAX_ATTEMPTS, &v)?;
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_MAX_BODY_BYTES) {
            s.max_body_bytes = parse(vars::SUBSCRIBER_MAX_BODY_BYTES, &v)?;
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_HANDLER_TIMEOUT_SECS) {
            s.handler_timeout =
                Duration::from_secs(parse(vars::SUBSCRIBER_HANDLER_TIMEOUT_SECS, &v)?);
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_BATCH_MAX) {
            s.batch_max = parse(vars::SUBSCRIBER_BATCH_MAX, &v)?;
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_BATCH_LINGER_MS) {
            s.batch_linger = Duration::from_millis(parse(vars::SUBSCRIBER_BATCH_LINGER_MS, &v)?);
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_QUEUE_TYPE) {
            s.spec.queue_type = v.parse().map_err(|rule| ConfigError::Invalid {
                var: vars::SUBSCRIBER_QUEUE_TYPE.into(),
                value: v.clone(),
                rule,
            })?;
        }
        if let Some(v) = lookup(vars::SUBSCRIBER_PARTITIONS) {
            s.spec.partitions = parse(vars::SUBSCRIBER_PARTITIONS, &v)?;
        }
        s.validate()?;
        Ok(s)
    }

    /// Checks every rule, naming the variable (or setting) that breaks one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_topology()?;
        self.check_budgets()
    }

    /// The queue, exchange and bindings, the prefetch, the workers and the
    /// partitions.
    fn check_topology(&self) -> Result<(), ConfigError> {
        let spec = &self.spec;
        // `<queue>.dlq` must fit in an AMQP short string too.
        if spec.queue.trim().is_empty()
            || spec.queue.len() + 4 > crate::envelope::ROUTING_KEY_MAX_BYTES
        {
            return invalid(
                "queue",
                &spec.queue,
                "must be non-blank and at most 251 bytes",
            );
        }
        if spec.exchange.is_empty() || spec.exchange.len() > crate::envelope::ROUTING_KEY_MAX_BYTES
        {
            return invalid(vars::EXCHANGE, &spec.exchange, "must be 1 to 255 bytes");
        }
        if spec.queue.contains(char::is_control) {
            return invalid(
                "queue",
                &spec.queue.escape_debug(),
                "must hold no control character",
            );
        }
        if spec.exchange.contains(char::is_control) {
            return invalid(
                vars::EXCHANGE,
                &spec.exchange.escape_debug(),
                "must hold no control character",
            );
        }
        if spec.bindings.is_empty() {
            return invalid("bindings", &"[]", "must name at least one binding key");
        }
        if let Some(b) = spec
            .bindings
            .iter()
            .find(|b| b.len() > crate::envelope::ROUTING_KEY_MAX_BYTES)
        {
            return invalid("bindings", b, "each must be at most 255 bytes");
        }
        if spec.prefetch == 0 {
            return invalid(vars::SUBSCRIBER_PREFETCH, &spec.prefetch, "must be > 0");
        }
        if self.concurrency == 0 || self.concurrency > SUBSCRIBER_CONCURRENCY_MAX {
            return invalid(
                vars::SUBSCRIBER_CONCURRENCY,
                &self.concurrency,
                "must be > 0 and <= 1024",
            );
        }
        let buckets = crate::core::ports::BUCKETS;
        if spec.partitions > buckets
            || (spec.partitions > 0 && !buckets.is_multiple_of(spec.partitions))
        {
            return invalid(
                vars::SUBSCRIBER_PARTITIONS,
                &spec.partitions,
                "must be 0 (no order) or a divisor of 64: 1, 2, 4, 8, 16, 32 or 64",
            );
        }
        if spec.partitions > 0 && u32::from(spec.partitions) > u32::from(spec.prefetch) {
            return invalid(
                vars::SUBSCRIBER_PARTITIONS,
                &spec.partitions,
                "must be <= CANOPY_MQ_SUBSCRIBER_PREFETCH (each partition's worker needs a delivery)",
            );
        }
        if self.concurrency > u32::from(spec.prefetch) {
            return invalid(
                vars::SUBSCRIBER_CONCURRENCY,
                &self.concurrency,
                "must be <= CANOPY_MQ_SUBSCRIBER_PREFETCH (workers beyond it would never get a delivery)",
            );
        }
        Ok(())
    }

    /// The attempt budget, the body limit, the handler's deadline and the
    /// batches.
    fn check_budgets(&self) -> Result<(), ConfigError> {
        if self.max_attempts == 0 {
            return invalid(
                vars::SUBSCRIBER_MAX_ATTEMPTS,
                &self.max_attempts,
                "must be > 0",
            );
        }
        if self.max_attempts > crate::core::ports::SUBSCRIBER_MAX_ATTEMPTS_MAX {
            return invalid(
                vars::SUBSCRIBER_MAX_ATTEMPTS,
                &self.max_attempts,
                "must be <= 100 (a tenth of the quorum queue's delivery limit, 1000, which \
                 also counts redeliveries after crashes and node losses)",
            );
        }
        if !(1024..=SUBSCRIBER_MAX_BODY_BYTES_MAX).contains(&self.max_body_bytes) {
            return invalid(
                vars::SUBSCRIBER_MAX_BODY_BYTES,
                &self.max_body_bytes,
                "must be >= 1024 and <= 134217728 (RabbitMQ's largest message)",
            );
        }
        if self.handler_timeout.is_zero()
            || self.handler_timeout > Duration::from_secs(SUBSCRIBER_HANDLER_TIMEOUT_MAX_SECS)
        {
            return invalid(
                vars::SUBSCRIBER_HANDLER_TIMEOUT_SECS,
                &self.handler_timeout.as_secs(),
                "must be > 0 and <= 3600",
            );
        }
        if self.batch_max == 0 || self.batch_max > SUBSCRIBER_BATCH_MAX_MAX {
            return invalid(
                vars::SUBSCRIBER_BATCH_MAX,
                &self.batch_max,
                "must be > 0 and <= 64 (each delivery of a batch is a PostgreSQL subtransaction)",
            );
        }
        if self.batch_linger > Duration::from_millis(SUBSCRIBER_BATCH_LINGER_MAX_MS) {
            return invalid(
                vars::SUBSCRIBER_BATCH_LINGER_MS,
                &self.batch_linger.as_millis(),
                "must be <= 1000",
            );
        }
        Ok(())
    }
}

impl crate::core::janitor::InboxJanitorSettings {
    /// Checks settings set in code: a retention, an interval and a batch
    /// that are not zero (a retention of zero would delete the inbox's
    /// deduplication as it is written, and a redelivered duplicate would
    /// take effect again).
    ///
    /// ```
    /// use outbox::InboxJanitorSettings;
    /// assert!(InboxJanitorSettings::default().validate().is_ok());
    /// let zero = InboxJanitorSettings { retention: std::time::Duration::ZERO, ..Default::default() };
    /// assert!(zero.validate().unwrap_err().to_string().contains("retention"));
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        let rules: [(&'static str, bool, String); 3] = [
            (
                "inbox janitor retention",
                self.retention.is_zero(),
                format!("{:?}", self.retention),
            ),
            (
                "inbox janitor interval",
                self.interval.is_zero(),
                format!("{:?}", self.interval),
            ),
            (
                "inbox janitor batch",
                self.batch == 0,
                self.batch.to_string(),
            ),
        ];
        match rules.into_iter().find(|(_, broken, _)| *broken) {
            Some((var, _, value)) => invalid(var, &value, "must not be zero"),
            None => Ok(()),
        }
    }

    /// Reads `CANOPY_MQ_INBOX_RETENTION_DAYS` (default 7); fails naming it.
    pub fn from_env() -> Result<Self, ConfigError> {
        from_process_env(|lookup| Self::from_lookup(lookup))
    }

    /// Like [`Self::from_env`], reading variables through `lookup`.
    ///
    /// ```
    /// use outbox::core::janitor::InboxJanitorSettings;
    /// let s = InboxJanitorSettings::from_lookup(|_| Some("30".into())).unwrap();
    /// assert_eq!(s.retention.as_secs(), 30 * 86_400);
    /// let e = InboxJanitorSettings::from_lookup(|_| Some("soon".into())).unwrap_err();
    /// assert!(e.to_string().starts_with("CANOPY_MQ_INBOX_RETENTION_DAYS=soon is invalid"));
    /// let e = InboxJanitorSettings::from_lookup(|_| Some("0".into())).unwrap_err();
    /// assert!(e.to_string().starts_with("CANOPY_MQ_INBOX_RETENTION_DAYS=0 is invalid"));
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut settings = Self::default();
        if let Some(v) = lookup(vars::INBOX_RETENTION_DAYS) {
            let days: u64 = parse(vars::INBOX_RETENTION_DAYS, &v)?;
            if days == 0 || days > RETENTION_DAYS_MAX {
                return Err(ConfigError::Invalid {
                    var: vars::INBOX_RETENTION_DAYS.into(),
                    value: v,
                    rule: format!(
                        "must be >= 1 and <= {RETENTION_DAYS_MAX} (the inbox's processed \
                         rows are its deduplication: deleted at once, a redelivered \
                         duplicate would take effect again)"
                    ),
                });
            }
            settings.retention = Duration::from_secs(days * 86_400);
        }
        Ok(settings)
    }
}

pub use crate::core::drainer::DrainerConfig;
pub use crate::core::ports::{
    QUORUM_DELIVERY_LIMIT, QueueType, SUBSCRIBER_MAX_ATTEMPTS_MAX, SubscriptionSpec,
};

impl DrainerConfig {
    /// Starts a builder with the ADR's defaults and a generated replica id.
    pub fn builder() -> DrainerConfigBuilder {
        DrainerConfigBuilder::default()
    }

    /// Checks every rule [`DrainerConfigBuilder::build`] checks, for a
    /// configuration whose public fields were set or changed in code.
    /// Durations are judged in the unit of their variable (a lease of
    /// 1.5 s as 1 s). [`Outbox::builder`](crate::Outbox::builder) checks a
    /// configuration it is given so.
    ///
    /// ```
    /// let mut config = outbox::DrainerConfig::builder().build()?;
    /// config.batch_size = 0;
    /// let e = config.validate().unwrap_err();
    /// assert!(e.to_string().starts_with("CANOPY_MQ_DRAINER_BATCH_SIZE=0 is invalid"));
    /// # Ok::<(), outbox::ConfigError>(())
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        let c = self.clone();
        DrainerConfigBuilder {
            replica_id: Some(c.replica_id),
            exchange: c.exchange,
            tick_ms: millis(c.tick),
            batch_size: c.batch_size,
            lease_ttl_secs: c.lease_ttl.as_secs(),
            pipeline_depth: c.pipeline_depth,
            confirm_timeout_secs: c.confirm_timeout.as_secs(),
            max_rows_per_sec: c.max_rows_per_sec.map_or(0, NonZeroU32::get),
            wakeup_linger_ms: millis(c.wakeup_linger),
            max_attempts: c.max_attempts,
            retention: c.retention,
            janitor_interval: c.janitor_interval,
            janitor_batch: c.janitor_batch,
            stats_interval: c.stats_interval,
            pending_warn: c.pending_warn,
            oldest_warn_secs: c.oldest_warn.as_secs(),
            durable_standbys: c.durable_standbys,
            durable_standbys_any: c.durable_standbys_any,
        }
        .build()
        .map(drop)
    }

    /// Reads every `CANOPY_MQ_*` variable (see [`vars`]); unset ones take the
    /// ADR defaults. Fails naming the first variable that breaks a rule.
    pub fn from_env() -> Result<Self, ConfigError> {
        from_process_env(|lookup| Self::from_lookup(lookup))
    }

    /// Like [`DrainerConfig::from_env`], reading variables through `lookup`
    /// (tests and services with their own configuration layer use this).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut b = DrainerConfigBuilder::default();
        if let Some(v) = lookup(vars::TICK_MS) {
            b.tick_ms = parse(vars::TICK_MS, &v)?;
        }
        if let Some(v) = lookup(vars::BATCH_SIZE) {
            b.batch_size = parse(vars::BATCH_SIZE, &v)?;
        }
        if let Some(v) = lookup(vars::LEASE_TTL_SECS) {
            b.lease_ttl_secs = parse(vars::LEASE_TTL_SECS, &v)?;
        }
        if let Some(v) = lookup(vars::PIPELINE_DEPTH) {
            b.pipeline_depth = parse(vars::PIPELINE_DEPTH, &v)?;
        }
        if let Some(v) = lookup(vars::CONFIRM_TIMEOUT_SECS) {
            b.confirm_timeout_secs = parse(vars::CONFIRM_TIMEOUT_SECS, &v)?;
        }
        if let Some(v) = lookup(vars::MAX_ATTEMPTS) {
            b.max_attempts = parse(vars::MAX_ATTEMPTS, &v)?;
        }
        if let Some(v) = lookup(vars::MAX_ROWS_PER_SEC) {
            b.max_rows_per_sec = parse(vars::MAX_ROWS_PER_SEC, &v)?;
        }
        if let Some(v) = lookup(vars::WAKEUP_LINGER_MS) {
            b.wakeup_linger_ms = parse(vars::WAKEUP_LINGER_MS, &v)?;
        }
        if let Some(v) = lookup(vars::RETENTION_DAYS) {
            let days: u64 = parse(vars::RETENTION_DAYS, &v)?;
            if days > RETENTION_DAYS_MAX {
                return Err(ConfigError::Invalid {
                    var: vars::RETENTION_DAYS.into(),
                    value: v,
                    rule: format!("must be <= {RETENTION_DAYS_MAX}"),
                });
            }
            b = b.retention_days(days);
        }
        if let Some(v) = lookup(vars::PENDING_WARN) {
            b.pending_warn = parse(vars::PENDING_WARN, &v)?;
        }
        if let Some(v) = lookup(vars::OLDEST_WARN_SECS) {
            b.oldest_warn_secs = parse(vars::OLDEST_WARN_SECS, &v)?;
        }
        if let Some(v) = lookup(vars::REPLICA_ID) {
            b.replica_id = Some(v);
        }
        if let Some(v) = lookup(vars::EXCHANGE) {
            b.exchange = v;
        }
        if let Some(v) = lookup(vars::DURABLE_STANDBYS) {
            let (names, any) = parse_standbys(&v).map_err(|rule| ConfigError::Invalid {
                var: vars::DURABLE_STANDBYS.into(),
                value: v.escape_debug().to_string(),
                rule,
            })?;
            b.durable_standbys = names;
            b.durable_standbys_any = any;
        }
        if let Some(v) = lookup(vars::BUFFER_MAX) {
            warn_buffer_max_once(&v);
        }
        b.build()
    }
}

fn warn_buffer_max_once(value: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            variable = vars::BUFFER_MAX,
            value,
            "CANOPY_MQ_BUFFER_MAX is deprecated and ignored since ADR-018: \
             the outbox table replaced the in-memory buffer; remove it"
        );
    });
}

/// A whole number a variable holds, and the largest it can be.
pub(crate) trait Whole: Sized + TryFrom<u64> {
    const MAX: u64;
}
impl Whole for u16 {
    const MAX: u64 = u16::MAX as u64;
}
impl Whole for u32 {
    const MAX: u64 = u32::MAX as u64;
}
impl Whole for u64 {
    const MAX: u64 = u64::MAX;
}

/// `value` of `var` as a whole number: an error names the rule it broke,
/// "a whole number" (signs, fractions, letters) or the type's ceiling.
fn parse<T: Whole>(var: &'static str, value: &str) -> Result<T, ConfigError> {
    let digits = value.trim();
    let too_big = || ConfigError::Invalid {
        var: var.into(),
        value: value.to_owned(),
        rule: format!("must be <= {}", T::MAX),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConfigError::Invalid {
            var: var.into(),
            value: value.to_owned(),
            rule: "must be a non-negative whole number".into(),
        });
    }
    let n: u64 = digits.parse().map_err(|_| too_big())?;
    T::try_from(n).map_err(|_| too_big())
}

/// `d` in whole milliseconds, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// [`parse`] for the adapters' own variables.
pub(crate) fn parse_whole<T: Whole>(var: &'static str, value: &str) -> Result<T, ConfigError> {
    parse(var, value)
}

/// Runs `read` over the process's environment: a variable set to a value
/// that is not UTF-8 is an error naming it (never taken as unset, which
/// would quietly apply the default), whatever `read` made of it. Every
/// `from_env` of the library reads through it; a crate of settings of its
/// own (`outbox-admin`'s) does too. The same as
/// [`Env::default().read`](Env::read).
///
/// ```
/// use outbox::config::from_process_env;
/// let port: Option<String> = from_process_env(|lookup| Ok(lookup("NO_SUCH_VARIABLE_SET")))?;
/// assert_eq!(port, None);
/// # Ok::<(), outbox::ConfigError>(())
/// ```
pub fn from_process_env<T>(
    read: impl FnOnce(&dyn Fn(&str) -> Option<String>) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    Env::default().read(read)
}

/// The prefix every variable of the library carries by default.
pub const DEFAULT_PREFIX: &str = "CANOPY_MQ_";

/// The process's environment under a prefix: `CANOPY_MQ_` (the
/// [default](DEFAULT_PREFIX)), or a service's own, so that
/// `CANOPY_MQ_DRAINER_BATCH_SIZE` is read as `ORDERS_MQ_DRAINER_BATCH_SIZE`
/// and an error names the variable the operator sets.
///
/// ```
/// use outbox::config::Env;
/// use outbox::{DrainerConfig, SubscriberSettings};
/// let env = Env::prefixed("ORDERS_MQ_")?;
/// // SAFETY (of the example): nothing else reads the environment here.
/// unsafe { std::env::set_var("ORDERS_MQ_DRAINER_BATCH_SIZE", "0") };
/// let e = env.read(|l| DrainerConfig::from_lookup(l)).unwrap_err();
/// assert!(e.to_string().starts_with("ORDERS_MQ_DRAINER_BATCH_SIZE=0 is invalid"));
/// let settings = env.read(|l| SubscriberSettings::from_lookup("orders.ship", &["#"], l))?;
/// assert_eq!(settings.spec.queue, "orders.ship");
/// // `Outbox::builder(pool).env(env)` reads the drainer's, the janitor's
/// // and the broker's variables under it.
/// # Ok::<(), outbox::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Env {
    prefix: String,
}

impl Default for Env {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }
}

impl Env {
    /// Variables under `prefix` (`A`–`Z`, `0`–`9` and `_`, starting with a
    /// letter and ending with `_`) instead of `CANOPY_MQ_`.
    pub fn prefixed(prefix: &str) -> Result<Self, ConfigError> {
        let well_formed = prefix.len() >= 2
            && prefix.starts_with(|c: char| c.is_ascii_uppercase())
            && prefix.ends_with('_')
            && prefix
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if !well_formed {
            return Err(ConfigError::Invalid {
                var: "env prefix".into(),
                value: prefix.escape_debug().to_string(),
                rule: "must be upper-case letters, digits and `_`, start with a letter and \
                       end with `_` (as CANOPY_MQ_)"
                    .into(),
            });
        }
        Ok(Self {
            prefix: prefix.to_owned(),
        })
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The name under this prefix of the library's variable `var` (a
    /// `CANOPY_MQ_*` name; any other name is its own).
    pub fn name(&self, var: &str) -> String {
        match var.strip_prefix(DEFAULT_PREFIX) {
            Some(rest) => format!("{}{rest}", self.prefix),
            None => var.to_owned(),
        }
    }

    /// Runs `read` over the process's environment, its `CANOPY_MQ_*` names
    /// read under this prefix; an error names the variable as read. A
    /// variable set to a value that is not UTF-8 is an error naming it
    /// (never taken as unset, which would quietly apply the default),
    /// whatever `read` made of it.
    pub fn read<T>(
        &self,
        read: impl FnOnce(&dyn Fn(&str) -> Option<String>) -> Result<T, ConfigError>,
    ) -> Result<T, ConfigError> {
        let garbled = std::cell::RefCell::new(None::<ConfigError>);
        let lookup = |var: &str| {
            let name = self.name(var);
            match std::env::var(&name) {
                Ok(value) => Some(value),
                Err(std::env::VarError::NotPresent) => None,
                Err(std::env::VarError::NotUnicode(raw)) => {
                    let bytes = raw.as_encoded_bytes();
                    let at = std::str::from_utf8(bytes)
                        .err()
                        .map_or(0, |e| e.valid_up_to());
                    garbled
                        .borrow_mut()
                        .get_or_insert_with(|| ConfigError::NotUnicode {
                            var: name,
                            at: at + 1,
                            len: bytes.len(),
                        });
                    None
                }
            }
        };
        let read = read(&lookup);
        match garbled.into_inner() {
            Some(e) => Err(e),
            None => read.map_err(|e| self.renamed(e)),
        }
    }

    /// `e` naming its variable under this prefix.
    fn renamed(&self, e: ConfigError) -> ConfigError {
        match e {
            ConfigError::Invalid { var, value, rule } if var.starts_with(DEFAULT_PREFIX) => {
                ConfigError::Invalid {
                    var: self.name(&var).into(),
                    value,
                    rule: self.rule_renamed(&rule),
                }
            }
            other => other,
        }
    }

    /// A rule's text naming other variables under this prefix.
    fn rule_renamed(&self, rule: &str) -> String {
        if self.prefix == DEFAULT_PREFIX {
            rule.to_owned()
        } else {
            rule.replace(DEFAULT_PREFIX, &self.prefix)
        }
    }
}

/// Builder for services that configure in code. Every setter takes the value
/// in the unit the matching variable uses; [`build`](Self::build) applies the
/// same checks as [`DrainerConfig::from_env`].
#[derive(Debug, Clone)]
pub struct DrainerConfigBuilder {
    replica_id: Option<String>,
    exchange: String,
    tick_ms: u64,
    batch_size: u32,
    lease_ttl_secs: u64,
    pipeline_depth: u32,
    confirm_timeout_secs: u64,
    max_rows_per_sec: u32,
    wakeup_linger_ms: u64,
    max_attempts: u32,
    retention: Duration,
    janitor_interval: Duration,
    janitor_batch: u32,
    stats_interval: Duration,
    pending_warn: u64,
    oldest_warn_secs: u64,
    durable_standbys: Vec<String>,
    durable_standbys_any: Option<u32>,
}

impl Default for DrainerConfigBuilder {
    fn default() -> Self {
        Self {
            replica_id: None,
            exchange: "canopy.events".into(),
            tick_ms: 250,
            batch_size: 100,
            lease_ttl_secs: 60,
            pipeline_depth: 32,
            confirm_timeout_secs: 30,
            max_rows_per_sec: 0,
            wakeup_linger_ms: WAKEUP_LINGER_MS_DEFAULT,
            max_attempts: 10,
            retention: Duration::from_secs(7 * 86_400),
            janitor_interval: Duration::from_secs(3600),
            janitor_batch: 1000,
            stats_interval: Duration::from_secs(15),
            pending_warn: 10_000,
            oldest_warn_secs: 900,
            durable_standbys: Vec::new(),
            durable_standbys_any: None,
        }
    }
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        #[must_use]
        pub fn $name(mut self, value: $ty) -> Self {
            self.$name = value;
            self
        }
    };
}

impl DrainerConfigBuilder {
    /// Sets the `claimed_by` identity (`CANOPY_MQ_REPLICA_ID`).
    #[must_use]
    pub fn replica_id(mut self, id: impl Into<String>) -> Self {
        self.replica_id = Some(id.into());
        self
    }
    /// Sets the exchange (`CANOPY_MQ_EXCHANGE`, default `canopy.events`).
    #[must_use]
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = exchange.into();
        self
    }
    setter!(/// Busy tick in ms (`CANOPY_MQ_DRAINER_TICK_MS`, default 250).
        tick_ms: u64);
    setter!(/// Rows per claim (`CANOPY_MQ_DRAINER_BATCH_SIZE`, default 100).
        batch_size: u32);
    setter!(/// Lease TTL (`CANOPY_MQ_DRAINER_LEASE_TTL_SECS`, default 60).
        lease_ttl_secs: u64);
    setter!(/// Publishes in flight (`CANOPY_MQ_DRAINER_PIPELINE_DEPTH`, default 32).
        pipeline_depth: u32);
    setter!(/// Phase-2 deadline (`CANOPY_MQ_DRAINER_CONFIRM_TIMEOUT_SECS`, default 30).
        confirm_timeout_secs: u64);
    setter!(/// Rows claimed per second at most, 0 for no bound
        /// (`CANOPY_MQ_DRAINER_MAX_ROWS_PER_SEC`, default 0).
        max_rows_per_sec: u32);
    setter!(/// Wait after a commit's wakeup before claiming, 0 for none
        /// (`CANOPY_MQ_DRAINER_WAKEUP_LINGER_MS`, default 10), below the tick.
        wakeup_linger_ms: u64);
    setter!(/// Parking budget (`CANOPY_MQ_DRAINER_MAX_ATTEMPTS`, default 10).
        max_attempts: u32);
    /// Retention in days (`CANOPY_MQ_OUTBOX_RETENTION_DAYS`, default 7),
    /// capped at [`RETENTION_DAYS_MAX`].
    #[must_use]
    pub fn retention_days(mut self, days: u64) -> Self {
        self.retention = Duration::from_secs(days.min(RETENTION_DAYS_MAX) * 86_400);
        self
    }
    setter!(/// Retention as a duration (tests and simulations use seconds).
        retention: Duration);
    setter!(/// Janitor period (default one hour).
        janitor_interval: Duration);
    setter!(/// Rows per janitor DELETE (default 1000).
        janitor_batch: u32);
    setter!(/// Stats sampling period (default 15 s).
        stats_interval: Duration);
    setter!(/// Pending threshold (`CANOPY_MQ_OUTBOX_PENDING_WARN`, default 10000).
        pending_warn: u64);
    setter!(/// Oldest-age threshold (`CANOPY_MQ_OUTBOX_OLDEST_WARN_SECS`, default 900).
        oldest_warn_secs: u64);
    /// The standbys that must have flushed a commit before what rests on
    /// it is published or acked (`CANOPY_MQ_DURABLE_STANDBYS`, default
    /// none): their `application_name`s as `pg_stat_replication` shows them.
    #[must_use]
    pub fn durable_standbys<I: IntoIterator<Item = S>, S: Into<String>>(
        mut self,
        names: I,
    ) -> Self {
        self.durable_standbys = names.into_iter().map(Into::into).collect();
        self.durable_standbys_any = None;
        self
    }

    /// Any `need` of `names` must have flushed a commit
    /// (`CANOPY_MQ_DURABLE_STANDBYS=ANY need (a, b)`): name every node a
    /// failover may promote, and after a switchover the ones still standbys
    /// vouch.
    #[must_use]
    pub fn durable_standbys_any<I: IntoIterator<Item = S>, S: Into<String>>(
        mut self,
        need: u32,
        names: I,
    ) -> Self {
        self.durable_standbys = names.into_iter().map(Into::into).collect();
        self.durable_standbys_any = Some(need);
        self
    }

    /// Checks every rule and returns the configuration.
    pub fn build(self) -> Result<DrainerConfig, ConfigError> {
        self.check_sizes()?;
        self.check_timing()?;
        self.check_budgets()?;
        self.check_standbys()?;
        let replica_id = match self.replica_id {
            Some(id) if id.trim().is_empty() || id.len() > 200 || id.contains(char::is_control) => {
                return invalid(
                    vars::REPLICA_ID,
                    &id.escape_debug(),
                    "must be non-blank, at most 200 bytes, and hold no control character \
                     (it is written in claimed_by and in every log line)",
                );
            }
            Some(id) => id,
            None => default_replica_id(),
        };
        Ok(DrainerConfig {
            replica_id,
            exchange: self.exchange,
            tick: Duration::from_millis(self.tick_ms),
            batch_size: self.batch_size,
            lease_ttl: Duration::from_secs(self.lease_ttl_secs),
            pipeline_depth: self.pipeline_depth,
            confirm_timeout: Duration::from_secs(self.confirm_timeout_secs),
            max_rows_per_sec: NonZeroU32::new(self.max_rows_per_sec),
            wakeup_linger: Duration::from_millis(self.wakeup_linger_ms),
            max_attempts: self.max_attempts,
            retention: self.retention,
            janitor_interval: self.janitor_interval,
            janitor_batch: self.janitor_batch,
            stats_interval: self.stats_interval,
            pending_warn: self.pending_warn,
            oldest_warn: Duration::from_secs(self.oldest_warn_secs),
            durable_standbys: self.durable_standbys,
            durable_standbys_any: self.durable_standbys_any,
        })
    }

    /// The durable standbys: each a name PostgreSQL can hold as an
    /// `application_name` (1 to 63 bytes of printable ASCII; PostgreSQL
    /// turns anything else into `?`, and no standby would then match),
    /// none twice.
    fn check_standbys(&self) -> Result<(), ConfigError> {
        let names = &self.durable_standbys;
        for (i, name) in names.iter().enumerate() {
            let printable = name.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b',');
            if name.trim().is_empty() || name.len() > 63 || !printable {
                return invalid(
                    vars::DURABLE_STANDBYS,
                    &names.join(",").escape_debug(),
                    "must be a comma-separated list of standby application_names, each 1 to 63 \
                     bytes of printable ASCII",
                );
            }
            if names[..i].contains(name) {
                return invalid(
                    vars::DURABLE_STANDBYS,
                    &names.join(",").escape_debug(),
                    format!("names {name} twice"),
                );
            }
        }
        match self.durable_standbys_any {
            Some(need) if need == 0 || need as usize > names.len() => invalid(
                vars::DURABLE_STANDBYS,
                &format!("ANY {need} ({})", names.join(", ")),
                "ANY n needs 1 <= n <= the standbys named",
            ),
            _ => Ok(()),
        }
    }

    /// The tick, the batch and the pipeline.
    fn check_sizes(&self) -> Result<(), ConfigError> {
        if self.tick_ms == 0 || self.tick_ms > TICK_MS_MAX {
            return invalid(
                vars::TICK_MS,
                &self.tick_ms,
                format!("must be > 0 and <= {TICK_MS_MAX}"),
            );
        }
        if self.max_rows_per_sec > MAX_ROWS_PER_SEC_MAX {
            return invalid(
                vars::MAX_ROWS_PER_SEC,
                &self.max_rows_per_sec,
                format!("must be <= {MAX_ROWS_PER_SEC_MAX} (0 for no bound)"),
            );
        }
        if self.batch_size == 0 || self.batch_size > BATCH_SIZE_MAX {
            return invalid(
                vars::BATCH_SIZE,
                &self.batch_size,
                format!("must be > 0 and <= {BATCH_SIZE_MAX}"),
            );
        }
        if self.pipeline_depth == 0 || self.pipeline_depth > PIPELINE_DEPTH_MAX {
            return invalid(
                vars::PIPELINE_DEPTH,
                &self.pipeline_depth,
                format!("must be > 0 and <= {PIPELINE_DEPTH_MAX}"),
            );
        }
        Ok(())
    }

    /// The lease against the worst batch, the Phase 2 deadline against
    /// both, and the wakeup's linger against the tick.
    fn check_timing(&self) -> Result<(), ConfigError> {
        if self.lease_ttl_secs > LEASE_TTL_SECS_MAX {
            return invalid(
                vars::LEASE_TTL_SECS,
                &self.lease_ttl_secs,
                format!("must be <= {LEASE_TTL_SECS_MAX} (a day)"),
            );
        }
        // One worst-case batch at the assumed per-publish latency (#478).
        let batch_worst_ms = u64::from(self.pipeline_depth) * ASSUMED_PUBLISH_LATENCY_MS;
        if self.lease_ttl_secs.saturating_mul(1000) < 3 * batch_worst_ms {
            return invalid(
                vars::LEASE_TTL_SECS,
                &self.lease_ttl_secs,
                format!(
                    "must be >= 3 x {} ({}) x {ASSUMED_PUBLISH_LATENCY_MS} ms = {} ms",
                    vars::PIPELINE_DEPTH,
                    self.pipeline_depth,
                    3 * batch_worst_ms
                ),
            );
        }
        if self.confirm_timeout_secs.saturating_mul(1000) < batch_worst_ms {
            return invalid(
                vars::CONFIRM_TIMEOUT_SECS,
                &self.confirm_timeout_secs,
                format!(
                    "must be >= {} ({}) x {ASSUMED_PUBLISH_LATENCY_MS} ms = {batch_worst_ms} ms",
                    vars::PIPELINE_DEPTH,
                    self.pipeline_depth
                ),
            );
        }
        if self.confirm_timeout_secs >= self.lease_ttl_secs {
            return invalid(
                vars::CONFIRM_TIMEOUT_SECS,
                &self.confirm_timeout_secs,
                format!(
                    "must be < {} ({}) so a timed-out batch releases its claims before they expire",
                    vars::LEASE_TTL_SECS,
                    self.lease_ttl_secs
                ),
            );
        }
        if self.wakeup_linger_ms >= self.tick_ms {
            return invalid(
                vars::WAKEUP_LINGER_MS,
                &self.wakeup_linger_ms,
                format!(
                    "must be < {} ({}): a woken drainer claims no later than it would have polled",
                    vars::TICK_MS,
                    self.tick_ms
                ),
            );
        }
        Ok(())
    }

    /// The parking budget, the janitor's batch and the exchange.
    fn check_budgets(&self) -> Result<(), ConfigError> {
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS_MAX {
            return invalid(
                vars::MAX_ATTEMPTS,
                &self.max_attempts,
                format!("must be > 0 and <= {MAX_ATTEMPTS_MAX}"),
            );
        }
        if self.pending_warn > PENDING_WARN_MAX {
            return invalid(
                vars::PENDING_WARN,
                &self.pending_warn,
                format!("must be <= {PENDING_WARN_MAX}"),
            );
        }
        if self.oldest_warn_secs > OLDEST_WARN_SECS_MAX {
            return invalid(
                vars::OLDEST_WARN_SECS,
                &self.oldest_warn_secs,
                format!("must be <= {OLDEST_WARN_SECS_MAX} (a year)"),
            );
        }
        if self.janitor_batch == 0 || self.janitor_batch > BATCH_SIZE_MAX {
            return invalid(
                "janitor_batch",
                &self.janitor_batch,
                format!("must be > 0 and <= {BATCH_SIZE_MAX}"),
            );
        }
        if self.exchange.is_empty() || self.exchange.len() > crate::envelope::ROUTING_KEY_MAX_BYTES
        {
            // The default exchange ("") confirms every publish and routes
            // it by queue name: nothing bound to topics ever receives it,
            // yet every row would be marked published.
            return invalid(
                vars::EXCHANGE,
                &self.exchange,
                "must be 1 to 255 bytes (the default exchange \"\" routes by queue name, \
                 so a topic subscription would never see an event it confirmed)",
            );
        }
        if self.exchange.contains(char::is_control) {
            return invalid(
                vars::EXCHANGE,
                &self.exchange.escape_debug(),
                "must hold no control character",
            );
        }
        Ok(())
    }
}

/// The error for `var` set to `value`, which breaks `rule`.
/// `CANOPY_MQ_DURABLE_STANDBYS`: `a, b` (all of them) or `ANY n (a, b)`
/// (any n of them), as `synchronous_standby_names` writes it; the names
/// trimmed, empty items dropped. The names' own rules are the builder's.
fn parse_standbys(v: &str) -> Result<(Vec<String>, Option<u32>), String> {
    let list = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let t = v.trim();
    let Some(rest) = t
        .get(..4)
        .filter(|head| head.eq_ignore_ascii_case("any "))
        .map(|_| t[4..].trim_start())
    else {
        return Ok((list(t), None));
    };
    let syntax = || "must be `a, b` or `ANY n (a, b)`".to_owned();
    let (n, names) = rest.split_once('(').ok_or_else(syntax)?;
    let names = names.trim_end().strip_suffix(')').ok_or_else(syntax)?;
    let need: u32 = n.trim().parse().map_err(|_| syntax())?;
    Ok((list(names), Some(need)))
}

fn invalid<T>(
    var: &'static str,
    value: &dyn std::fmt::Display,
    rule: impl Into<String>,
) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid {
        var: var.into(),
        value: value.to_string(),
        rule: rule.into(),
    })
}

/// The default of `CANOPY_MQ_DRAINER_WAKEUP_LINGER_MS`: at 1 000 commits a
/// second, about ten events a claim instead of three or four.
pub const WAKEUP_LINGER_MS_DEFAULT: u64 = 10;

/// `drainer-{hostname}-{pid}-{uuid-v7}`, the ADR's fallback identity.
pub fn default_replica_id() -> String {
    format!(
        "drainer-{}-{}-{}",
        hostname(),
        std::process::id(),
        uuid::Uuid::now_v7()
    )
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
