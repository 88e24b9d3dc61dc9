//! Ports: the one seam between the drainer's logic and the outside world.
//!
//! One trait per external system, methods named `<entity>_<verb>`. Production
//! adapters live in `pg/` (sqlx), `amqp/` (lapin) and `runtime.rs` (tokio time
//! and tasks, OS entropy); the simulation has its own. Errors say whose fault a failure
//! is: [`StoreError`] and [`BrokerError`] are always blameless for the rows,
//! only [`Confirm::Nack`] (and a row the core itself finds unpublishable)
//! counts toward parking.

use std::future::Future;
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{BrokerError, StoreError};
pub use crate::trace_context::TraceContext;

/// What one pass of [`OutboxStore::outbox_retire_partitions`] (or the
/// inbox's) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartitionsRetired {
    /// The table is partitioned by time; `false`: the plain layout, where
    /// retention deletes rows and the pass does nothing.
    pub partitioned: bool,
    /// Partitions created for the time ahead, by name.
    pub created: Vec<String>,
    /// Partitions dropped whole, by name.
    pub dropped: Vec<String>,
}

/// Time as the core sees it.
pub trait Clock: Send + Sync + 'static {
    /// Monotonic time since an arbitrary origin.
    fn now(&self) -> Duration;
    /// Completes after `d` of this clock's time.
    fn sleep(&self, d: Duration) -> impl Future<Output = ()> + Send;
}

/// Where long-running tasks run: tokio in production
/// ([`TokioSpawn`](crate::runtime::TokioSpawn)), the simulation's runtime under
/// simulation, so [`DrainerHandle`](crate::DrainerHandle) runs the same
/// tasks on either.
pub trait Spawn: Send + Sync + 'static {
    /// Runs `task` on its own. The returned future resolves once the task
    /// has ended: `Err` with the panic's message if it panicked.
    fn spawn(&self, task: BoxTask) -> TaskEnd;
}

/// A task handed to [`Spawn::spawn`].
pub type BoxTask = std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// The end of a spawned task, as [`Spawn::spawn`] reports it.
pub type TaskEnd = std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'static>>;

/// Randomness as the core sees it (jitter only; ids come from the store).
pub trait Entropy: Send + Sync + 'static {
    /// A uniformly distributed 64-bit value.
    fn next_u64(&self) -> u64;
}

/// What the claim needs to know.
#[derive(Debug, Clone, Copy)]
pub struct ClaimParams<'a> {
    /// Identity stamped into `claimed_by`.
    pub replica_id: &'a str,
    /// Most rows to claim.
    pub batch_size: u32,
    /// Leases older than this are reclaimable.
    pub lease_ttl: Duration,
    /// Keyed rows the claim may take (from [`OutboxStore::outbox_key_window`]),
    /// each only if it is still its key's head; unkeyed rows are found by
    /// the claim itself.
    pub key_heads: &'a [Uuid],
    /// Unkeyed rows only past this place in claim order (the last unkeyed
    /// row of the drain's previous full claim); `None`: from the oldest.
    /// Rows before it (in flight in this drain, published but not yet
    /// vacuumed out of the claim's index, or claimable again) are not
    /// walked: see [`ClaimPosition`].
    pub after: Option<ClaimPosition>,
}

/// A row's place in claim order: its `enqueued_at` (microseconds since the
/// Unix epoch), then its id. A drain that claims full batches walks on
/// from the last one's place ([`ClaimParams::after`]) instead of from the
/// oldest row each time, past every row it has in flight and every row
/// published since the table was last vacuumed (on PostgreSQL their index
/// entries stay until VACUUM, and each claim from the oldest row read
/// them all again). A row that becomes claimable behind the place (a late
/// commit, an expired lease, a released row) is taken by the next claim
/// from the oldest row: the first of the next drain (a drain ends on a
/// short claim), or at most [`CLAIMS_PER_WALK`] claims later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimPosition {
    /// The row's `enqueued_at`, in microseconds since the Unix epoch.
    pub enqueued_at_micros: i64,
    /// The row's id.
    pub id: Uuid,
}

/// Most claims a drain makes from one walk of the claim order: after this
/// many, the next claim starts from the oldest row again.
pub const CLAIMS_PER_WALK: u32 = 8;

/// One key's head, as [`OutboxStore::outbox_key_window`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHead {
    /// The ordering key.
    pub key: String,
    /// Its lowest-numbered unpublished row.
    pub id: Uuid,
    /// Not parked, and its lease free or expired.
    pub claimable: bool,
}

/// The heads of a run of keys with unpublished rows, in key byte order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyWindow {
    /// One per key, in byte order of the keys.
    pub heads: Vec<KeyHead>,
    /// No key with unpublished rows comes after the last one (fewer keys
    /// than asked for).
    pub exhausted: bool,
}

/// One claimed outbox row, as Phase 2 needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedRow {
    /// Row id = envelope id = AMQP `message_id`.
    pub id: Uuid,
    /// Routing key to publish with.
    pub routing_key: String,
    /// The encoded envelope: the AMQP body.
    pub body: Vec<u8>,
    /// Row-culpable failures so far.
    pub attempts: i32,
    /// The trace context the row was written under (its envelope's valid
    /// `traceparent`/`tracestate` headers), set as AMQP headers on publish.
    pub trace: Option<TraceContext>,
    /// How long ago the row was written, as the store saw it at the claim
    /// (the start of the commit-to-confirm lag).
    pub age: Duration,
    /// Its ordering key and number, if it has a key: the store claimed it
    /// as its key's head (every earlier event of the key is published).
    pub ordering: Option<KeySeq>,
    /// Its place in claim order (`None` if the store cannot place it: an
    /// `enqueued_at` of ±infinity, written by hand).
    pub position: Option<ClaimPosition>,
}

/// The AMQP header carrying an event's ordering key (a long string).
pub const ORDERING_KEY_HEADER: &str = "x-canopy-ordering-key";
/// The AMQP header carrying an event's number within its ordering key (a
/// signed 64-bit integer).
pub const KEY_SEQ_HEADER: &str = "x-canopy-key-seq";

/// The AMQP header carrying an event's bucket, `0..BUCKETS` as a long
/// string: where an ordered subscription routes it ([`bucket_of`]). No
/// `x-` prefix: RabbitMQ's headers exchange ignores headers whose names
/// begin with `x-` when it matches.
pub const BUCKET_HEADER: &str = "canopy-bucket";

/// Buckets an event's key hashes to. An ordered subscription's partition
/// count divides it, so bucket `b` is partition `b % partitions`.
pub const BUCKETS: u16 = 64;

/// The bucket every message the drainer publishes carries
/// ([`BUCKET_HEADER`]): FNV-1a (64-bit) of its ordering key's bytes, or of
/// its id's bytes if it has no key, modulo [`BUCKETS`]. Stable across
/// releases and platforms: each key's events all go to one partition of
/// every ordered subscription, whichever replica published them.
///
/// ```
/// use outbox::core::ports::{KeySeq, bucket_of, BUCKETS};
/// let a = KeySeq { key: "order-17".into(), seq: 1 };
/// let b = KeySeq { key: "order-17".into(), seq: 9 };
/// let id = uuid::Uuid::nil();
/// assert_eq!(bucket_of(Some(&a), id), bucket_of(Some(&b), uuid::Uuid::max()));
/// assert!(bucket_of(None, id) < BUCKETS);
/// ```
pub fn bucket_of(ordering: Option<&KeySeq>, id: Uuid) -> u16 {
    let bytes: &[u8] = match ordering {
        Some(o) => o.key.as_bytes(),
        None => id.as_bytes(),
    };
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % u64::from(BUCKETS)) as u16
}

/// An event's place in its ordering key: the key, and the
/// event's number among the key's events, 1 for the first, in the order
/// their transactions committed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct KeySeq {
    /// The ordering key.
    pub key: String,
    /// The event's number within the key.
    pub seq: i64,
}

impl KeySeq {
    /// A key and number as a delivery's headers carry them, if well formed:
    /// a key [`crate::EventEnvelope::with_ordering_key`] accepts and a
    /// positive number.
    pub fn from_headers(key: String, seq: i64) -> Option<Self> {
        let valid = seq > 0 && crate::envelope::validate_ordering_key(&key).is_ok();
        valid.then_some(Self { key, seq })
    }
}

/// A row-culpable failure to record in Phase 3.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowFailure {
    /// The row.
    pub id: Uuid,
    /// What went wrong, for `last_error`.
    pub error: String,
}

/// What a bulk failure mark did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailOutcome {
    /// Rows whose attempts were bumped (those still claimed by us).
    pub recorded: u64,
    /// Of those, rows that reached the budget and parked.
    pub parked: u64,
}

/// A snapshot of the outbox for gauges and readiness.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct OutboxStats {
    /// Unpublished, unparked rows.
    pub pending: u64,
    /// Age of the oldest unpublished, unparked row, in seconds (0 if none).
    pub oldest_unpublished_age_secs: f64,
    /// Parked rows.
    pub parked: u64,
    /// Pending rows that wait behind a parked row of their ordering key:
    /// none of them is claimed until that row is unparked or skipped.
    pub blocked: u64,
}

/// A parked row, for operators deciding whether to unpark it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ParkedRow {
    /// Row id = envelope id.
    pub id: Uuid,
    /// Routing key.
    pub routing_key: String,
    /// Row-culpable failures recorded.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// When the envelope was written.
    #[serde(with = "time::serde::rfc3339")]
    pub enqueued_at: OffsetDateTime,
    /// When it parked.
    #[serde(with = "time::serde::rfc3339")]
    pub parked_at: OffsetDateTime,
    /// Its ordering key and number, if it has a key: while it is parked,
    /// its key's later events wait.
    pub ordering: Option<KeySeq>,
    /// The envelope the drainer publishes for it (JSON, as `publish_tx`
    /// encoded it): its payload and headers, for an operator to read.
    pub envelope: String,
}

/// Where a listing of parked rows goes on: after this row (the order is
/// `parked_at`, then `id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParkedCursor {
    /// When the row parked.
    pub parked_at: OffsetDateTime,
    /// Its id.
    pub id: Uuid,
}

impl ParkedCursor {
    /// The place of `row`.
    pub fn of(row: &ParkedRow) -> Self {
        Self {
            parked_at: row.parked_at,
            id: row.id,
        }
    }
}

/// Which parked rows a listing reads, and how much of each.
///
/// ```
/// use outbox::core::ports::{ParkedFilter, PayloadField};
/// // The first page of rows whose payload's `customer.id` is 42, without
/// // their envelopes (a list of many large rows reads none of them).
/// let f = ParkedFilter {
///     payload_field: Some(PayloadField::dotted("customer.id", "42")),
///     omit_envelope: true,
///     ..ParkedFilter::page(50, None)
/// };
/// assert_eq!(f.limit, 50);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParkedFilter {
    /// At most this many rows.
    pub limit: u32,
    /// Only rows after this one in the listing's order.
    pub after: Option<ParkedCursor>,
    /// Exactly these rows (those that are parked).
    pub ids: Option<Vec<Uuid>>,
    /// Only rows whose event payload holds a value at a path, matched by
    /// the database (see [`PayloadField`]).
    pub payload_field: Option<PayloadField>,
    /// Leave each row's `envelope` empty: a listing that shows rows, not
    /// their envelopes, reads no envelope from the database.
    pub omit_envelope: bool,
}

impl ParkedFilter {
    /// Up to `limit` rows with their envelopes, after `after` if given.
    pub fn page(limit: u32, after: Option<ParkedCursor>) -> Self {
        Self {
            limit,
            after,
            ..Self::default()
        }
    }
}

/// Which parked rows to unpark or skip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnparkSelector {
    /// Exactly these ids (those that are parked).
    Ids(Vec<Uuid>),
    /// Every parked row.
    All,
}

/// A position in the primary's write-ahead log (PostgreSQL's `pg_lsn`, as
/// bytes from `0/0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WalPosition(pub u64);

impl std::fmt::Display for WalPosition {
    /// As PostgreSQL writes a `pg_lsn`: `0/3000148`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// How far one named standby has flushed the primary's WAL, as the
/// primary last heard from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StandbyFlush {
    /// No standby of that name streams from the primary.
    Absent,
    /// It streams, but this role may not read its position (PostgreSQL
    /// shows `pg_stat_replication`'s positions only to superusers and
    /// members of `pg_read_all_stats`).
    Hidden,
    /// It has flushed the WAL up to here.
    At(WalPosition),
}

/// The primary's WAL flush position and where each named standby stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationPositions {
    /// The primary's WAL flush position: past the commit record of every
    /// transaction that committed synchronously and is visible (its commit
    /// was flushed before any session could see it, whether or not a
    /// synchronous standby acknowledged it).
    pub flushed: WalPosition,
    /// The primary's timeline: a promotion starts a new one, so two
    /// answers on the same timeline come from the same line of history
    /// (PostgreSQL's `TimeLineID`).
    pub timeline: u32,
    /// Each named standby, in the order asked.
    pub standbys: Vec<StandbyFlush>,
}

/// Where the standbys stand: what the durability gates
/// ([`crate::core::durability`]) wait on. A supertrait of both stores.
pub trait Replication: Send + Sync + 'static {
    /// The primary's flush position now and each of `standbys`
    /// (`application_name`s as in `pg_stat_replication`) in order. On a
    /// server that is not a primary, [`StoreError::Unavailable`].
    fn replication_positions(
        &self,
        standbys: &[String],
    ) -> impl Future<Output = Result<ReplicationPositions, StoreError>> + Send;
}

/// The outbox table.
pub trait OutboxStore: Replication {
    /// Ordering keys: the heads of up to `limit` keys that have unpublished
    /// rows, the first key after `after` in byte order (`""`: from the
    /// first), whatever each key's backlog. `claimable` as the claim would
    /// see it under `lease_ttl`; a hint only, the claim checks again.
    fn outbox_key_window(
        &self,
        after: &str,
        limit: u32,
        lease_ttl: Duration,
    ) -> impl Future<Output = Result<KeyWindow, StoreError>> + Send;

    /// Phase 1: claims up to `batch_size` unpublished, unparked rows that are
    /// unclaimed or whose lease expired, stamping the lease, in
    /// `(enqueued_at, id)` order. Never touches `attempts`. Rows without an
    /// ordering key are found by the claim; a keyed row is claimed only if
    /// it is among `key_heads` and is its key's head (no row of its key
    /// with a lower number is unpublished).
    fn outbox_claim(
        &self,
        params: ClaimParams<'_>,
    ) -> impl Future<Output = Result<Vec<ClaimedRow>, StoreError>> + Send;

    /// Phase 3: sets `published_at` on those `ids` still claimed by
    /// `replica_id`; returns how many it marked.
    fn outbox_mark_published(
        &self,
        replica_id: &str,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Phase 3: for each failure whose row is still claimed by `replica_id`,
    /// `attempts + 1`, `last_error`, lease released, parked if attempts reach
    /// `max_attempts`.
    fn outbox_mark_failed(
        &self,
        replica_id: &str,
        failures: &[RowFailure],
        max_attempts: u32,
    ) -> impl Future<Output = Result<FailOutcome, StoreError>> + Send;

    /// Releases the lease on those `ids` still claimed by `replica_id`,
    /// without touching `attempts`; returns how many it released.
    fn outbox_release(
        &self,
        replica_id: &str,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts pending and parked rows and the oldest pending age.
    fn outbox_stats(&self) -> impl Future<Output = Result<OutboxStats, StoreError>> + Send;

    /// Deletes at most `limit` rows published more than `older_than` ago;
    /// never an unpublished row. Returns how many it deleted. On the
    /// partitioned layout it leaves alone the rows of a closed partition
    /// (one whose id range has passed) that holds no unpublished row:
    /// [`outbox_retire_partitions`](Self::outbox_retire_partitions) drops
    /// that partition whole once its newest row is past retention.
    fn outbox_delete_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The partitioned layout's retention: creates the
    /// partitions of the time ahead, and drops every closed partition in
    /// which each row is published, and was longer ago than `older_than`
    /// (a partition holding an unpublished row is never dropped). On the
    /// plain layout it does nothing and says so.
    fn outbox_retire_partitions(
        &self,
        older_than: Duration,
    ) -> impl Future<Output = Result<PartitionsRetired, StoreError>> + Send;

    /// Lists the parked rows `filter` selects, oldest parked first: at
    /// most `filter.limit`, after `filter.after` (a page's last row) if
    /// given.
    fn outbox_list_parked(
        &self,
        filter: &ParkedFilter,
    ) -> impl Future<Output = Result<Vec<ParkedRow>, StoreError>> + Send;

    /// Unparks rows: clears `parked_at` and the lease and resets `attempts`
    /// to 0 (a fresh budget). Returns how many it unparked.
    fn outbox_unpark(
        &self,
        selector: &UnparkSelector,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Skips parked rows: marks them done without publishing them (they
    /// count as published for the claim, the gauges and retention, and are
    /// recorded as skipped), so their keys' later events go on. Returns how
    /// many it skipped; rows that are not parked are left alone.
    fn outbox_skip(
        &self,
        selector: &UnparkSelector,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// The broker's verdict on one publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirm {
    /// Stored by the broker (persisted to every queue it routed to, or
    /// routed nowhere, which is normal on a fan-out topic exchange).
    Ack,
    /// Refused by the broker: the row's fault.
    Nack(String),
}

/// One message to publish.
#[derive(Debug, Clone, Copy)]
pub struct OutgoingMessage<'a> {
    /// Target exchange.
    pub exchange: &'a str,
    /// Routing key.
    pub routing_key: &'a str,
    /// AMQP `message_id` (the envelope id).
    pub message_id: Uuid,
    /// AMQP body (the encoded envelope).
    pub body: &'a [u8],
    /// Sent as the `traceparent`/`tracestate` AMQP headers.
    pub trace: Option<&'a TraceContext>,
    /// Sent as the `x-canopy-ordering-key`/`x-canopy-key-seq` AMQP headers.
    pub ordering: Option<&'a KeySeq>,
}

/// The message broker, as the drainer uses it.
pub trait Broker: Send + Sync + 'static {
    /// A channel dedicated to one batch.
    type Channel: PublishChannel;

    /// Identifies the current connection; changes whenever it is replaced.
    fn connection_generation(&self) -> u64;

    /// Opens a channel, connecting first if there is no live connection.
    fn channel_open(&self) -> impl Future<Output = Result<Self::Channel, BrokerError>> + Send;

    /// Replaces the connection if it is still generation `generation`; a
    /// no-op if someone else already did (single-flight).
    fn connection_reconnect(
        &self,
        generation: u64,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Closes the connection at shutdown, bounded (nothing by default).
    fn connection_close(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Wakes the drainer whenever a transaction that wrote envelopes commits
/// (PostgreSQL's `LISTEN canopy_outbox`), so an event is a claim away
/// instead of up to a tick. Failures only cost latency: the drainer keeps
/// polling at its tick.
pub trait CommitWakeup: Send + 'static {
    /// Calls `wakeup.notify_one()` for each commit until `shutdown` turns
    /// true, reconnecting on its own after failures.
    fn listen(
        self,
        wakeup: std::sync::Arc<tokio::sync::Notify>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send;
}

/// A channel on which the drainer publishes one batch.
pub trait PublishChannel: Send {
    /// Resolves to the broker's verdict on one publish.
    type Confirm: Future<Output = Result<Confirm, BrokerError>> + Send + Unpin;

    /// Puts the channel into publisher-confirm mode (once per channel).
    fn channel_confirm_select(&mut self) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Publishes one persistent message, `mandatory` unset; the returned
    /// future resolves when the broker confirms it.
    fn channel_publish(
        &mut self,
        message: OutgoingMessage<'_>,
    ) -> impl Future<Output = Result<Self::Confirm, BrokerError>> + Send;

    /// Closes the channel. Must not block the caller for long: adapters bound
    /// or detach the close handshake.
    fn channel_close(self) -> impl Future<Output = ()> + Send;
}

// ---------------------------------------------------------------------------
// The consumer side (ADR-018 amendment #433).

/// One inbox row as a delivery (or a replay) brings it.
#[derive(Debug, Clone, Copy)]
pub struct InboxEntry<'a> {
    /// The envelope id (with the subscription, the inbox key).
    pub event_id: Uuid,
    /// The subscription (queue) it came through: each subscription keeps
    /// its own row, so two that both receive an event each take its effect.
    pub subscription: &'a str,
    /// Its routing key.
    pub routing_key: &'a str,
    /// The encoded envelope (stored as `payload` for replay).
    pub payload: &'a [u8],
    /// Replay: give an existing dead-lettered row a fresh budget (attempts
    /// 0, dead-letter mark cleared) in this transaction, before the
    /// savepoint, so the reset takes effect only with the attempt's commit:
    /// a replay cut short never leaves a row out of the dead-lettered set
    /// without its effect. A row still within its budget keeps its attempts
    /// (so two replays or releases of one row that race never reset what
    /// the other spent).
    pub fresh_budget: bool,
    /// Its ordering key and number, on an ordered subscription only: the
    /// row records them, and the insert first looks for an earlier event
    /// of the key still unprocessed ([`InsertOutcome::BehindRetry`],
    /// [`InsertOutcome::Held`]). The transaction must hold the key's lock
    /// by then ([`InboxStore::inbox_lock_keys`]).
    pub ordering: Option<&'a KeySeq>,
}

/// What `inbox_try_insert` found, holding the row's lock until the
/// transaction ends, so concurrent deliveries of one event serialize on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    /// First sight of this event: the row is new in this transaction.
    Inserted,
    /// The row exists, unprocessed: an earlier attempt failed (its attempts
    /// were recorded) or a replay is re-running it.
    InFlightRetry {
        /// Failed attempts recorded so far.
        attempts: i32,
    },
    /// The event already took effect: the handler must not run again.
    AlreadyProcessed,
    /// Ordered subscription: an earlier event of its key is unprocessed,
    /// waiting for its retry (or behind one). The delivery goes back to
    /// the queue behind it, unhandled, and its row (if it had none)
    /// records that it waits too (unprocessed, no attempt): whichever
    /// replica gets the key's deliveries next, in whatever order, then
    /// holds a later one behind it.
    BehindRetry,
    /// Ordered subscription: an earlier event of its key is dead-lettered,
    /// or held itself. The row is recorded held (unprocessed, `held_at`
    /// set, locked): the delivery is acked after the commit, and its
    /// handler runs only once that earlier event is replayed or skipped
    /// ([`InboxStore::inbox_held`] finds it then). Nothing is lost.
    Held,
}

/// What recording a failed attempt does once committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptRecord {
    /// Failed attempts recorded, this one included.
    pub attempts: i32,
    /// The budget is spent: the row is marked dead-lettered.
    pub dead_lettered: bool,
}

/// How one subscription's inbox stands, for the operator console's
/// overview ([`InboxStore::inbox_counts`]). Each count stops at the cap it
/// was asked with (a count equal to the cap means "at least"), so asking
/// costs no more than the cap's rows however large the table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct InboxCounts {
    /// Rows processed (or skipped) within the window before now.
    pub processed_recently: u64,
    /// Unprocessed rows with a failure recorded and not dead-lettered: a
    /// delivery retried.
    pub retrying: u64,
    /// Dead-lettered rows, not yet replayed or skipped.
    pub dead_lettered: u64,
}

/// An inbox row, for operators and replay.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InboxRow {
    /// Envelope id.
    pub event_id: Uuid,
    /// The subscription it came through.
    pub subscription: String,
    /// Routing key.
    pub routing_key: String,
    /// The encoded envelope.
    #[serde(skip)]
    pub payload: Vec<u8>,
    /// Failed attempts recorded.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// When it was first received.
    #[serde(with = "time::serde::rfc3339")]
    pub received_at: OffsetDateTime,
    /// When it was dead-lettered, if it was.
    #[serde(with = "time::serde::rfc3339::option")]
    pub dead_lettered_at: Option<OffsetDateTime>,
    /// Its ordering key and number, if an ordered subscription got it.
    pub ordering: Option<KeySeq>,
    /// Held behind an earlier event of its key that is dead-lettered: it
    /// waits for that one's replay or skip.
    pub held: bool,
}

/// Which unprocessed inbox rows to list or replay.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InboxFilter {
    /// Exactly these events (those still unprocessed).
    #[serde(default)]
    pub ids: Option<Vec<Uuid>>,
    /// Only rows that came through this subscription.
    #[serde(default)]
    pub subscription: Option<String>,
    /// Only rows with this routing key.
    #[serde(default)]
    pub routing_key: Option<String>,
    /// Only rows that were dead-lettered.
    #[serde(default)]
    pub dead_lettered_only: bool,
    /// At most this many rows, oldest first.
    #[serde(default)]
    pub limit: Option<u32>,
    /// Only rows after this one in the listing's order: where the last
    /// page stopped (a replay's `next`), so rows that failed again are not
    /// met again.
    #[serde(default)]
    pub after: Option<InboxCursor>,
    /// Only rows whose event payload holds a value at a path, matched by
    /// the database (see [`PayloadField`]). Not part of the replay route's
    /// body.
    #[serde(skip)]
    pub payload_field: Option<PayloadField>,
    /// Leave each listed row's `payload` empty: a listing that shows rows,
    /// not their envelopes, then reads no payload from the database, however
    /// large they are. Replays always read them. Not part of the replay
    /// route's body.
    #[serde(skip)]
    pub omit_payload: bool,
}

/// A condition on an inbox row's event payload (the envelope's `payload`):
/// the value at `path` (object keys and array indexes, from the payload's
/// top) is the string `value`, or is not a string and equals `value` read
/// as JSON (numbers compare as numbers: `1` matches `1.0`).
///
/// ```
/// let f = outbox::core::ports::PayloadField::dotted("customer.id", "42");
/// assert_eq!(f.path, ["customer", "id"]);
/// assert_eq!(f.value_json(), Some(serde_json::json!(42)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PayloadField {
    /// Steps from the payload's top.
    pub path: Vec<String>,
    /// The value wanted, as text.
    pub value: String,
}

impl PayloadField {
    /// `path` written with dots (`customer.id`, `lines.0.sku`).
    pub fn dotted(path: &str, value: &str) -> Self {
        Self {
            path: path.split('.').map(str::to_owned).collect(),
            value: value.to_owned(),
        }
    }

    /// `value` read as JSON, if it is JSON.
    pub fn value_json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.value).ok()
    }
}

/// A place in the listing of inbox rows (oldest first: `received_at`, then
/// `event_id`); a listing `after` it starts with the next row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InboxCursor {
    /// When the row was received.
    #[serde(with = "time::serde::rfc3339")]
    pub received_at: time::OffsetDateTime,
    /// Its event.
    pub event_id: Uuid,
}

impl InboxCursor {
    /// The place of `row`.
    pub fn of(row: &InboxRow) -> Self {
        Self {
            received_at: row.received_at,
            event_id: row.event_id,
        }
    }
}

/// Default number of rows one listing returns.
pub const LIST_LIMIT_DEFAULT: u32 = 100;
/// Largest number of rows one listing (or replay) returns.
pub const LIST_LIMIT_MAX: u32 = 10_000;

/// The inbox table.
pub trait InboxStore: Replication {
    /// A transaction: the handler's, holding the inbox row until it ends.
    type Tx: Send;
    /// What a handler is given of the transaction: what the service's own
    /// code writes with (in production, sqlx's `Transaction`).
    type HandlerTx: Send;

    /// The handler's view of `tx`.
    fn handler_tx(tx: &mut Self::Tx) -> &mut Self::HandlerTx;

    /// Begins the handler's transaction, bounded at the server by
    /// `bounds` (the server ends it past them, whatever its client does).
    fn inbox_begin(
        &self,
        bounds: TxBounds,
    ) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Whether the transaction can still commit what it holds so far: it
    /// is not aborted (a statement of the handler failed, even if the
    /// handler swallowed the error: PostgreSQL would answer the COMMIT with
    /// a rollback and no error), and every deferred constraint holds for
    /// what it wrote (`SET CONSTRAINTS ALL IMMEDIATE`, inside a savepoint
    /// rolled back after, so the constraints stay deferred). An error that
    /// is not [`StoreError::is_unavailable`] means the work written since
    /// the last check cannot commit; the transaction is then aborted, and
    /// [`inbox_record_failure`](Self::inbox_record_failure) still recovers
    /// it to the delivery's savepoint.
    fn inbox_check(&self, tx: &mut Self::Tx)
    -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls the transaction back to the latest savepoint
    /// [`inbox_savepoint`](Self::inbox_savepoint) set: the work of the
    /// delivery after it is undone (an aborted transaction recovered), its
    /// inbox row and lock stay.
    fn inbox_undo_handler(
        &self,
        tx: &mut Self::Tx,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Ends the transaction at the server whatever its connection is doing:
    /// a statement of it may still run there (a handler's future was
    /// dropped at its deadline, or panicked, mid-statement), which the
    /// server does not notice; it is ended there (its locks released) and
    /// the connection is never reused. Best effort: what cannot reach the
    /// server is ended by the transaction's [`TxBounds`].
    fn inbox_abandon(&self, tx: Self::Tx) -> impl Future<Output = ()> + Send;

    /// Ordered subscriptions, first in a handler's transaction
    /// with keyed deliveries: takes the lock of each of `keys` in
    /// `subscription`, held until the transaction ends (a savepoint's
    /// rollback keeps it), waiting for a transaction that holds one. Every
    /// taker takes its keys in one order, so two never wait on each other
    /// in a cycle. Deliveries, replays and skips of one key then decide one
    /// after the other, each seeing what the one before committed: a
    /// delivery recorded held behind a dead-lettered event cannot commit
    /// after that event's replay or skip looked for the key's held rows,
    /// which would leave it held for ever. A key listed twice is locked
    /// once.
    fn inbox_lock_keys(
        &self,
        tx: &mut Self::Tx,
        subscription: &str,
        keys: &[&str],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Inserts the row if absent (`ON CONFLICT DO NOTHING`) and locks it,
    /// waiting for a concurrent transaction that holds it; then sets the
    /// savepoint [`inbox_record_failure`](Self::inbox_record_failure) rolls
    /// a failed handler's work back to.
    ///
    /// A row it inserts ([`InsertOutcome::Inserted`]) is inserted marked
    /// processed: no other session sees the mark before the commit, and
    /// the handler's success then needs no further statement, while its
    /// failure clears the mark ([`inbox_record_failure`](Self::inbox_record_failure)).
    ///
    /// One transaction may hold several deliveries (a batch). A row this
    /// transaction already inserted or locked is reported as the
    /// transaction left it (processed by an earlier delivery of the same
    /// event: `AlreadyProcessed`). After an error the transaction may be
    /// aborted: the caller rolls it back.
    fn inbox_try_insert(
        &self,
        tx: &mut Self::Tx,
        entry: &InboxEntry<'_>,
    ) -> impl Future<Output = Result<InsertOutcome, StoreError>> + Send;

    /// Sets the savepoint [`inbox_record_failure`](Self::inbox_record_failure)
    /// rolls back to, right after a delivery's `inbox_try_insert`: its
    /// handler's work comes after it, its inbox row and lock before. In a
    /// batch each delivery sets its own, and a rollback reaches the latest.
    fn inbox_savepoint(
        &self,
        tx: &mut Self::Tx,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Sets `processed_at` on `entry`'s row, in the handler's transaction:
    /// needed for a row that existed before the attempt
    /// ([`InsertOutcome::InFlightRetry`]); one this transaction inserted is
    /// marked already.
    fn inbox_mark_processed(
        &self,
        tx: &mut Self::Tx,
        entry: &InboxEntry<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Commits the handler's transaction.
    fn inbox_commit(&self, tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls the handler's transaction back (best effort: a broken
    /// connection rolls back by itself). A connection that still owes the
    /// reply to a statement whose call gave up (its bound expired) is
    /// handled as [`inbox_abandon`](Self::inbox_abandon) does.
    fn inbox_rollback(&self, tx: Self::Tx) -> impl Future<Output = ()> + Send;

    /// In the handler's transaction, after the handler failed: rolls its
    /// work back to the savepoint `inbox_savepoint` set (the inbox row and
    /// its lock stay), then clears the processed mark, and sets
    /// `attempts + 1`, `last_error`, and the dead-letter mark once attempts
    /// reach `max_attempts`. The record
    /// survives the handler's rollback and takes effect with the caller's
    /// commit, so a retry after a lost reply can never count one failure
    /// twice.
    fn inbox_record_failure(
        &self,
        tx: &mut Self::Tx,
        entry: &InboxEntry<'_>,
        error: &str,
        max_attempts: u32,
    ) -> impl Future<Output = Result<AttemptRecord, StoreError>> + Send;

    /// A key's held rows in `subscription` ([`InsertOutcome::Held`]) with a
    /// number above `after`, lowest first, at most `limit`: what a replay
    /// or skip of the key's dead-lettered event releases, in the key's
    /// order.
    fn inbox_held(
        &self,
        subscription: &str,
        key: &str,
        after: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<InboxRow>, StoreError>> + Send;

    /// Held rows of `subscription` that nothing holds back any more, at
    /// most `limit`, one per key (its lowest): no earlier unprocessed row
    /// of the key is dead-lettered or waiting for a retry. A release cut
    /// short (a replay or skip whose release met trouble, a crash) leaves
    /// such rows; the subscriber finds them and releases them.
    fn inbox_releasable(
        &self,
        subscription: &str,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<InboxRow>, StoreError>> + Send;

    /// Skips these dead-lettered rows of `subscription`: marked processed
    /// without their effect (`skipped_at` set), so their keys' held rows
    /// can go on. Returns the rows it skipped (those dead-lettered and
    /// unprocessed), with their ordering.
    fn inbox_skip(
        &self,
        subscription: &str,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<Vec<InboxRow>, StoreError>> + Send;

    /// Unprocessed rows matching `filter`, oldest first.
    fn inbox_list_unprocessed(
        &self,
        filter: &InboxFilter,
    ) -> impl Future<Output = Result<Vec<InboxRow>, StoreError>> + Send;

    /// `subscription`'s rows processed within `window` before the store's
    /// now, retried and dead-lettered, each counted up to `cap`.
    fn inbox_counts(
        &self,
        subscription: &str,
        window: Duration,
        cap: u32,
    ) -> impl Future<Output = Result<InboxCounts, StoreError>> + Send;

    /// Deletes at most `limit` rows processed more than `older_than` ago;
    /// never an unprocessed row. Returns how many it deleted. On the
    /// partitioned layout it leaves alone the rows of a closed partition
    /// that holds no unprocessed row (as
    /// [`OutboxStore::outbox_delete_published`]).
    fn inbox_delete_processed(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The partitioned layout's inbox retention: as
    /// [`OutboxStore::outbox_retire_partitions`], a partition is dropped
    /// once each of its rows was processed longer ago than `older_than`;
    /// never one holding an unprocessed (failing, dead-lettered or held)
    /// row.
    fn inbox_retire_partitions(
        &self,
        older_than: Duration,
    ) -> impl Future<Output = Result<PartitionsRetired, StoreError>> + Send;

    /// One round trip to the database outside any handler transaction
    /// (`SELECT 1`): the subscriber asks it when a handler overruns its
    /// deadline, to tell a handler that was slow from one whose own
    /// statements waited on a database that does not answer.
    fn inbox_ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// The server's own bounds on one handler transaction, so that no
/// statement or idle spell of it outlives the subscriber's interest in it
/// even when nothing can reach the server to end it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxBounds {
    /// Longest the transaction may sit idle between statements
    /// (`idle_in_transaction_session_timeout`): a consumer that vanished
    /// mid-handler releases its inbox rows after this.
    pub idle: Duration,
    /// Longest one statement may run (`statement_timeout`).
    pub statement: Duration,
}

/// The least idle-in-transaction bound of a handler transaction.
pub const HANDLER_IDLE_IN_TX_MIN: Duration = Duration::from_secs(60);
/// How long a handler's statement may run past the handler's deadline
/// before the server itself ends it (should the subscriber's own end of it
/// not reach the server).
pub const STATEMENT_GRACE: Duration = Duration::from_secs(1);

impl TxBounds {
    /// The bounds of a transaction whose handler may run `handler_timeout`:
    /// a statement may run the handler's deadline and
    /// [`STATEMENT_GRACE`] (no statement of a handler can usefully run
    /// longer); the transaction may sit idle at least
    /// [`HANDLER_IDLE_IN_TX_MIN`], and longer than a handler's whole run
    /// and the subscriber's check of the database after it (a slow valid
    /// handler doing other work between statements is never cut off).
    pub fn for_handler(handler_timeout: Duration) -> Self {
        Self {
            idle: HANDLER_IDLE_IN_TX_MIN.max(handler_timeout * 2 + STORE_CALL_TIMEOUT),
            statement: handler_timeout + STATEMENT_GRACE,
        }
    }
}

/// Bound on one store call (acquiring a connection and running its
/// statements), part of every store port's contract: a database that stops
/// answering (a black-holed connection, a wedged server) would otherwise
/// hold the caller until TCP gives up, which takes many minutes; on expiry
/// the call fails as [`StoreError::Unavailable`].
pub const STORE_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What a subscription consumes, and how its dead-letter queue is named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionSpec {
    /// The durable queue (also the subscription's name in the inbox).
    pub queue: String,
    /// The topic exchange the queue is bound to.
    pub exchange: String,
    /// Binding keys (topic patterns).
    pub bindings: Vec<String>,
    /// Unacknowledged deliveries the broker may push (`basic.qos`).
    pub prefetch: u16,
    /// What kind of queue the subscription and its dead-letter queue are.
    pub queue_type: QueueType,
    /// Per-key order: 0 for one queue shared by every worker
    /// (no order); else this many partition queues `<queue>.p{i}`, each
    /// with a single active consumer, fed by the headers exchange
    /// `<queue>.route` by each event's [`BUCKET_HEADER`]. A divisor of
    /// [`BUCKETS`].
    pub partitions: u16,
    /// The partition this consumer takes (`None` on an unpartitioned
    /// subscription); see [`consumed_queue`](Self::consumed_queue).
    pub partition: Option<u16>,
}

/// The kind of RabbitMQ queue a subscription declares
/// (`CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE`).
///
/// On a cluster only a quorum queue keeps what is routed to it while a
/// node is down: a classic queue lives on one node, and while that node is
/// down the broker drops what is routed to it and still confirms the
/// publish (measured on RabbitMQ 3.10: 10 of 10 confirmed, 0 kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum QueueType {
    /// Replicated over the cluster (a publish is confirmed once a majority
    /// has it); the default.
    #[default]
    Quorum,
    /// A single-node queue: only for a single-node broker, or a
    /// subscription kept as it was declared before quorum queues.
    Classic,
}

impl QueueType {
    /// The `x-queue-type` argument's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quorum => "quorum",
            Self::Classic => "classic",
        }
    }
}

impl std::fmt::Display for QueueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "quorum" => Ok(Self::Quorum),
            "classic" => Ok(Self::Classic),
            _ => Err("must be quorum or classic".into()),
        }
    }
}

/// The `x-delivery-limit` of a quorum subscription queue: how many times
/// the broker delivers one message before it dead-letters it itself.
///
/// The inbox decides a delivery's fate (`CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS`,
/// at most [`SUBSCRIBER_MAX_ATTEMPTS_MAX`]); the broker's limit is only the
/// backstop for a message that kills its consumer's process before the
/// inbox can count anything. It must therefore stay far above the inbox's
/// budget: RabbitMQ counts every return of a delivery, not only the
/// subscriber's nacks: a redelivery after a crash, a node loss or a
/// consumer reopened after broker trouble, and a requeue at shutdown each
/// add one (measured on 3.10: a consumer whose node stopped saw its five
/// unacknowledged deliveries again with `x-delivery-count` 1). 1 000 leaves
/// 900 such returns beyond the largest budget. It is set explicitly because
/// RabbitMQ 4 gives quorum queues a default limit of 20.
pub const QUORUM_DELIVERY_LIMIT: u32 = 1000;

/// The largest `CANOPY_MQ_SUBSCRIBER_MAX_ATTEMPTS` accepted, a tenth of
/// [`QUORUM_DELIVERY_LIMIT`].
pub const SUBSCRIBER_MAX_ATTEMPTS_MAX: u32 = 100;

/// The `x-delivery-limit` of a quorum dead-letter queue: in effect none
/// (nothing dead-letters it further, so reaching a limit would drop the
/// message; RabbitMQ 4's default of 20 would). Not -1: on RabbitMQ 3.x a
/// negative limit drops a message after its first delivery.
pub const DLQ_DELIVERY_LIMIT: u32 = i32::MAX as u32;

/// The dead-letter exchange every subscription's queue names.
pub const DLQ_EXCHANGE: &str = "canopy.dlq";

impl SubscriptionSpec {
    /// `<queue>.dlq`: where deliveries nacked without requeue go.
    pub fn dlq_name(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// `<queue>.route`: an ordered subscription's headers exchange, bound
    /// to [`exchange`](Self::exchange) with each binding and to each
    /// partition queue by bucket.
    pub fn route_exchange(&self) -> String {
        format!("{}.route", self.queue)
    }

    /// `<queue>.route.rest`: the fanout exchange that takes what
    /// `<queue>.route` cannot route by bucket (a message without a valid
    /// [`BUCKET_HEADER`], from a foreign publisher say) to partition 0, so
    /// nothing routed to the subscription is dropped.
    pub fn rest_exchange(&self) -> String {
        format!("{}.route.rest", self.queue)
    }

    /// `<queue>.p{partition}`.
    pub fn partition_queue(&self, partition: u16) -> String {
        format!("{}.p{partition}", self.queue)
    }

    /// The queue this consumer takes deliveries from: its partition's, or
    /// the subscription's own.
    pub fn consumed_queue(&self) -> String {
        match self.partition {
            Some(p) => self.partition_queue(p),
            None => self.queue.clone(),
        }
    }

    /// The buckets routed to `partition`: `partition`, `partition +
    /// partitions`, … below [`BUCKETS`].
    pub fn buckets_of(&self, partition: u16) -> impl Iterator<Item = u16> + use<> {
        let step = self.partitions.max(1);
        (partition..BUCKETS).step_by(usize::from(step))
    }
}

/// One message pushed by the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The channel's tag for ack/nack.
    pub tag: u64,
    /// AMQP `message_id`, if set.
    pub message_id: Option<String>,
    /// Routing key it was published with.
    pub routing_key: String,
    /// AMQP body.
    pub body: Vec<u8>,
    /// The broker delivered it before (nacked with requeue, or its
    /// consumer's channel closed unacknowledged).
    pub redelivered: bool,
    /// A valid trace context from its `traceparent`/`tracestate` AMQP
    /// headers, if it carries one.
    pub trace: Option<TraceContext>,
    /// Its ordering key and number, from its `x-canopy-ordering-key` and
    /// `x-canopy-key-seq` AMQP headers, if it carries both.
    pub ordering: Option<KeySeq>,
}

/// The message broker, as the subscriber uses it.
pub trait ConsumerBroker: Send + Sync + 'static {
    /// A running consumer on one channel.
    type Consumer: DeliverySource;

    /// Declares the topology (the queue with its dead-letter arguments, the
    /// `canopy.dlq` exchange, `<queue>.dlq` and the bindings; for an ordered
    /// subscription, `<queue>.route` and the partition queue
    /// `spec.partition` names instead of the queue), sets the prefetch and
    /// starts consuming from [`SubscriptionSpec::consumed_queue`].
    fn subscription_open(
        &self,
        spec: &SubscriptionSpec,
    ) -> impl Future<Output = Result<Self::Consumer, BrokerError>> + Send;
}

/// A running consumer; shared by the subscriber's workers.
pub trait DeliverySource: Send + Sync + 'static {
    /// The next delivery; `None` once the consumer has ended (channel or
    /// connection lost, or closed), and forever after.
    fn delivery_next(&self) -> impl Future<Output = Option<Delivery>> + Send;

    /// Acknowledges a delivery.
    fn delivery_ack(&self, tag: u64) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Acknowledges these deliveries, and only these: with one
    /// `basic.ack` (`multiple`) when they are all of the consumer's
    /// unsettled deliveries up to the highest of them (see [`Unsettled`]),
    /// else one per delivery.
    fn delivery_ack_many(
        &self,
        tags: &[u64],
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Rejects a delivery: back to the queue if `requeue`, else to the
    /// dead-letter queue.
    fn delivery_nack(
        &self,
        tag: u64,
        requeue: bool,
    ) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Stops consuming and closes the channel (bounded); unacknowledged
    /// deliveries go back to the queue.
    fn consumer_close(&self) -> impl Future<Output = ()> + Send;
}

/// The deliveries a consumer's channel has handed out and not yet settled,
/// kept by each [`DeliverySource`] so that [`delivery_ack_many`] acks with
/// one `multiple` frame exactly when that acks nothing it was not asked to.
///
/// A tag leaves the set only once its ack or nack has been sent, so a
/// `multiple` ack decided meanwhile by another caller sharing the channel
/// never covers (and so never acks twice, which the broker punishes by
/// closing the channel) a tag whose own frame is still on its way.
///
/// [`delivery_ack_many`]: DeliverySource::delivery_ack_many
#[derive(Debug, Default)]
pub struct Unsettled(std::sync::Mutex<std::collections::BTreeSet<u64>>);

/// How to send the acks of [`DeliverySource::delivery_ack_many`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckPlan {
    /// Nothing to ack.
    Nothing,
    /// One `basic.ack` with `multiple` set, on this tag.
    Through(u64),
    /// One `basic.ack` per tag.
    Each(Vec<u64>),
}

impl Unsettled {
    /// A delivery handed out.
    pub fn delivered(&self, tag: u64) {
        self.0.lock().expect("unsettled tags").insert(tag);
    }

    /// These deliveries' acks or nacks have been sent.
    pub fn settled(&self, tags: &[u64]) {
        let mut set = self.0.lock().expect("unsettled tags");
        for tag in tags {
            set.remove(tag);
        }
    }

    /// How to ack `tags`: through the highest one if they are exactly the
    /// unsettled tags up to it, else one by one. Call [`settled`] once
    /// the frames have been sent.
    ///
    /// [`settled`]: Self::settled
    pub fn plan(&self, tags: &[u64]) -> AckPlan {
        let mut wanted: Vec<u64> = tags.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        let Some(&highest) = wanted.last() else {
            return AckPlan::Nothing;
        };
        let set = self.0.lock().expect("unsettled tags");
        if wanted.len() > 1 && set.range(..=highest).copied().eq(wanted.iter().copied()) {
            AckPlan::Through(highest)
        } else {
            AckPlan::Each(wanted)
        }
    }

    /// Acks `tags` as [`plan`](Self::plan) says, each frame sent with
    /// `ack(tag, multiple)`, then marks them settled (a frame that could
    /// not be sent went with its channel, and its tags with it). Every
    /// frame is tried; the first error is returned.
    pub async fn ack<F, Fut>(&self, tags: &[u64], ack: F) -> Result<(), BrokerError>
    where
        F: Fn(u64, bool) -> Fut,
        Fut: Future<Output = Result<(), BrokerError>>,
    {
        let sent = match self.plan(tags) {
            AckPlan::Nothing => Ok(()),
            AckPlan::Through(tag) => ack(tag, true).await,
            AckPlan::Each(tags) => {
                let mut sent = Ok(());
                for tag in tags {
                    sent = sent.and(ack(tag, false).await);
                }
                sent
            }
        };
        self.settled(tags);
        sent
    }

    /// Forgets every tag (the channel is gone, and its tags with it).
    pub fn clear(&self) {
        self.0.lock().expect("unsettled tags").clear();
    }
}

#[cfg(test)]
mod unsettled_tests {
    use super::{AckPlan, Unsettled};

    fn with(tags: &[u64]) -> Unsettled {
        let u = Unsettled::default();
        for &t in tags {
            u.delivered(t);
        }
        u
    }

    #[test]
    fn all_unsettled_up_to_the_highest_go_in_one_frame() {
        let u = with(&[1, 2, 3, 4, 5]);
        assert_eq!(u.plan(&[3, 1, 2]), AckPlan::Through(3));
        u.settled(&[1, 2, 3]);
        assert_eq!(u.plan(&[4, 5]), AckPlan::Through(5));
    }

    #[test]
    fn a_gap_held_by_someone_else_means_one_frame_each() {
        let u = with(&[1, 2, 3]);
        assert_eq!(u.plan(&[1, 3]), AckPlan::Each(vec![1, 3]));
        // Until the other tag's own frame has gone out.
        u.settled(&[2]);
        assert_eq!(u.plan(&[1, 3]), AckPlan::Through(3));
    }

    #[test]
    fn unknown_tags_or_a_single_tag_are_acked_one_by_one() {
        let u = with(&[5, 6]);
        assert_eq!(u.plan(&[5, 7]), AckPlan::Each(vec![5, 7]));
        assert_eq!(u.plan(&[6]), AckPlan::Each(vec![6]));
        assert_eq!(u.plan(&[]), AckPlan::Nothing);
        u.clear();
        assert_eq!(u.plan(&[5, 6]), AckPlan::Each(vec![5, 6]));
    }
}
