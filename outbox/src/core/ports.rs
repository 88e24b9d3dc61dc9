//! Ports: the one seam between the drainer's logic and the outside world.
//!
//! One trait per external system, methods named `<entity>_<verb>`. Production
//! adapters live in `pg/` (sqlx), `amqp/` (lapin) and `runtime.rs` (tokio time,
//! OS entropy); the simulation has its own. Errors say whose fault a failure
//! is: [`StoreError`] and [`BrokerError`] are always blameless for the rows,
//! only [`Confirm::Nack`] (and a row the core itself finds unpublishable)
//! counts toward parking.

use std::future::Future;
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::{BrokerError, StoreError};

/// Time as the core sees it.
pub trait Clock: Send + Sync + 'static {
    /// Monotonic time since an arbitrary origin.
    fn now(&self) -> Duration;
    /// Completes after `d` of this clock's time.
    fn sleep(&self, d: Duration) -> impl Future<Output = ()> + Send;
}

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
}

/// Which parked rows to unpark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnparkSelector {
    /// Exactly these ids (those that are parked).
    Ids(Vec<Uuid>),
    /// Every parked row.
    All,
}

/// The outbox table.
pub trait OutboxStore: Send + Sync + 'static {
    /// Phase 1: claims up to `batch_size` unpublished, unparked rows that are
    /// unclaimed or whose lease expired, stamping the lease, in
    /// `(enqueued_at, id)` order. Never touches `attempts`.
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
    /// never an unpublished row. Returns how many it deleted.
    fn outbox_delete_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Lists up to `limit` parked rows, oldest first.
    fn outbox_list_parked(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<ParkedRow>, StoreError>> + Send;

    /// Unparks rows: clears `parked_at` and the lease and resets `attempts`
    /// to 0 (a fresh budget). Returns how many it unparked.
    fn outbox_unpark(
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
}

/// A channel on which the drainer publishes one batch.
pub trait PublishChannel: Send {
    /// Resolves to the broker's verdict on one publish.
    type Confirm: Future<Output = Result<Confirm, BrokerError>> + Send;

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
