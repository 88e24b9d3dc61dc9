//! The drainer's settings: what the drainer, its janitor and its stats task
//! read. The core owns them; `crate::config` builds them (with the ADR's
//! defaults and rules) and parses the environment into them.

use std::num::NonZeroU32;
use std::time::Duration;

/// Everything the drainer, its janitor and its stats task need to know.
///
/// ```
/// use outbox::DrainerConfig;
/// let cfg = DrainerConfig::builder()
///     .replica_id("orders-1")
///     .exchange("orders.events")
///     .batch_size(200)
///     .build()
///     .unwrap();
/// assert_eq!(cfg.pipeline_depth, 32);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainerConfig {
    /// Identity written to `claimed_by`; unique per running drainer.
    pub replica_id: String,
    /// Exchange every row is published to (a durable topic exchange).
    pub exchange: String,
    /// Poll interval while busy (the ADR's 250 ms). Idle interval is 4×.
    pub tick: Duration,
    /// Rows claimed per tick.
    pub batch_size: u32,
    /// Lease length: a claim older than this is reclaimable.
    pub lease_ttl: Duration,
    /// Unconfirmed publishes in flight per replica (overlapping batches
    /// share the bound).
    pub pipeline_depth: u32,
    /// Deadline over the whole of Phase 2 of one batch.
    pub confirm_timeout: Duration,
    /// At most this many rows claimed per second by this replica (`None`:
    /// drain as fast as the database and the broker allow). Bounds the
    /// drainer's share of a database it shares with foreground traffic while
    /// it works off a backlog.
    pub max_rows_per_sec: Option<NonZeroU32>,
    /// How long a drainer woken by a commit's notification waits before it
    /// claims, so that a stream of small commits is claimed a few at a time
    /// rather than one claim, publish and mark round each: the database's
    /// work per event falls with the rows per round (harness
    /// P3). Costs up to this much latency on a quiet outbox.
    pub wakeup_linger: Duration,
    /// Row-culpable failures after which a row parks.
    pub max_attempts: u32,
    /// Age after which published rows are deleted.
    pub retention: Duration,
    /// How often the retention janitor runs.
    pub janitor_interval: Duration,
    /// Rows deleted per janitor statement.
    pub janitor_batch: u32,
    /// How often the stats task samples the outbox.
    pub stats_interval: Duration,
    /// Pending-row count above which the outbox is unhealthy.
    pub pending_warn: u64,
    /// Oldest-unpublished age above which the outbox is unhealthy.
    pub oldest_warn: Duration,
    /// Standbys (`application_name`s as in `pg_stat_replication`) that
    /// must have flushed a commit before anything resting on it is
    /// published or acked (see [`durability`](crate::core::durability));
    /// empty: no gate.
    pub durable_standbys: Vec<String>,
    /// How many of `durable_standbys` must have flushed (`ANY n (…)`);
    /// `None`: all of them.
    pub durable_standbys_any: Option<u32>,
}
