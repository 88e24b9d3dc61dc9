//! The wire protocol between the simulation adapters and the fakes: one
//! length-prefixed frame per request and per reply (bincode: the frames
//! are the simulation's own, never read by a person, and a sweep spends
//! less on them than on JSON), over
//! the engine's `TcpStream`, so every request crosses the simulated network
//! and is subject to its faults (held links black-hole, partitions and
//! crashes break connections).

use outbox::core::ports::SubscriptionSpec;
use outbox::core::topology::{self, ArgumentValue, QueueArguments};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use uuid::Uuid;

/// How often both ends of an AMQP connection send a heartbeat, and how
/// long silence means the peer is gone (the fake's scaled-down version of
/// RabbitMQ's negotiated 60 s: a partitioned consumer's unacknowledged
/// deliveries go back to the queue instead of waiting forever).
pub const HEARTBEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
/// See [`HEARTBEAT_EVERY`].
pub const HEARTBEAT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(6);

/// Largest frame accepted, a bound on what a corrupt length could make us
/// allocate.
pub const FRAME_MAX_BYTES: u32 = 16 * 1024 * 1024;

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> std::io::Result<()> {
    let mut frame = vec![0u8; 4];
    bincode::serialize_into(&mut frame, msg).map_err(std::io::Error::other)?;
    let len = u32::try_from(frame.len() - 4).map_err(std::io::Error::other)?;
    frame[..4].copy_from_slice(&len.to_be_bytes());
    w.write_all(&frame).await?;
    w.flush().await
}

/// Reads one frame; `Ok(None)` on a clean end of stream.
pub async fn read_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len);
    if len > FRAME_MAX_BYTES {
        return Err(std::io::Error::other(format!("frame of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    bincode::deserialize(&body)
        .map(Some)
        .map_err(std::io::Error::other)
}

/// A message body on the wire: text when it is UTF-8, bytes otherwise,
/// so a broker can carry any bytes a real one carries, binary included.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireBody {
    Text(String),
    Bytes(Vec<u8>),
}

impl WireBody {
    /// The body of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) => Self::Text(text.to_owned()),
            Err(_) => Self::Bytes(bytes.to_vec()),
        }
    }

    /// The bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        match self {
            Self::Text(text) => text.into_bytes(),
            Self::Bytes(bytes) => bytes,
        }
    }

    /// The bytes, borrowed.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Text(text) => text.as_bytes(),
            Self::Bytes(bytes) => bytes,
        }
    }
}

/// A statement's failure, as PostgreSQL reports it: SQLSTATE and message.
/// Adapters turn it into a `StoreError` with the production mapping
/// (`StoreError::from_sqlstate`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgError {
    pub code: String,
    pub message: String,
}

impl PgError {
    /// An error with SQLSTATE `code`.
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// The production adapter's view of it.
    pub fn into_store_error(self) -> outbox::StoreError {
        outbox::StoreError::from_sqlstate(&self.code, format!("{} ({})", self.message, self.code))
    }
}

/// A request to the fake PostgreSQL.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PgRequest {
    /// Names the client (replica or workload) for the trace, and says how
    /// the session commits: `synchronous_commit` off for the drainer's own
    /// sessions (`outbox::pg::DRAIN_SESSION_SETTINGS`), whose commits a
    /// crash of the server may take back (`fakes::pg::wal`).
    Hello {
        client: String,
        synchronous_commit: bool,
    },
    Begin,
    /// `SET LOCAL …` in the open transaction (each setting given; they
    /// end with the transaction, as `SET LOCAL` does).
    SetLocal(TxSettings),
    Commit,
    Rollback,
    /// `publish_tx` / `publish_many_tx`: one statement inserting every row,
    /// all or nothing; must be inside a transaction.
    Insert {
        rows: Vec<NewRow>,
    },
    /// `outbox_key_window.sql`: the heads of up to `limit` keys after
    /// `after`, in byte order.
    KeyWindow {
        after: String,
        limit: u32,
        lease_ttl_ms: u64,
    },
    /// Phase 1; inside a transaction (the adapter brackets it like the real
    /// one). `key_heads`: the keyed rows it may take, each if still its
    /// key's head.
    Claim {
        replica: String,
        batch_size: u32,
        lease_ttl_ms: u64,
        key_heads: Vec<Uuid>,
        /// Unkeyed rows only past this place in claim order (microseconds,
        /// id): `ClaimParams::after`.
        after: Option<(i64, Uuid)>,
    },
    MarkPublished {
        replica: String,
        ids: Vec<Uuid>,
    },
    MarkFailed {
        replica: String,
        failures: Vec<(Uuid, String)>,
        max_attempts: u32,
    },
    Release {
        replica: String,
        ids: Vec<Uuid>,
    },
    Stats,
    DeletePublished {
        older_than_ms: u64,
        limit: u32,
    },
    /// `outbox_retire_partitions`.
    RetirePartitions {
        older_than_ms: u64,
    },
    ListParked {
        /// Rows after this one (parked ms, id) only.
        after: Option<(u64, Uuid)>,
        limit: u32,
        /// These rows only.
        ids: Option<Vec<Uuid>>,
        /// Rows whose event payload holds a value at a path only.
        payload_field: Option<outbox::core::ports::PayloadField>,
        /// Each row's envelope left out (empty).
        omit_envelope: bool,
    },
    /// `None`: every parked row.
    Unpark {
        ids: Option<Vec<Uuid>>,
    },
    /// `outbox_skip.sql`; `None`: every parked row.
    Skip {
        ids: Option<Vec<Uuid>>,
    },
    /// `inbox_lock_keys`: in a transaction, the key locks of an ordered
    /// subscription's keyed deliveries, taken in key order; waits while
    /// another open transaction holds one (holding those before it).
    InboxLockKeys {
        subscription: String,
        keys: Vec<String>,
    },
    /// `inbox_try_insert`: in a transaction; waits while another open
    /// transaction holds the row.
    InboxTryInsert {
        entry: WireInboxEntry,
    },
    /// `inbox_mark_processed`, in a transaction.
    InboxMarkProcessed {
        subscription: String,
        event_id: Uuid,
    },
    /// The simulated handler's domain write, in a transaction: committed
    /// effects are what the checker counts. It waits while another session
    /// holds the domain table locked. `unique_key`, if any, is under a
    /// deferred unique constraint (`UNIQUE … DEFERRABLE INITIALLY
    /// DEFERRED`): a second effect with the same key fails the transaction
    /// at its `InboxCheck` or its COMMIT, not here.
    Effect {
        subscription: String,
        event_id: Uuid,
        unique_key: Option<String>,
    },
    /// `inbox_check.sql`: `SAVEPOINT canopy_check; SET CONSTRAINTS ALL
    /// IMMEDIATE; ROLLBACK TO SAVEPOINT canopy_check; RELEASE …`: fails as
    /// the COMMIT would (25P02 in an aborted transaction, 23505 on a
    /// deferred unique key taken), leaving the constraints deferred.
    InboxCheck,
    /// `pg_terminate_backend` of every other session whose
    /// `application_name` is this: answers how many were signalled.
    Terminate {
        application_name: String,
    },
    /// `pg_cancel_backend` of the same: a statement it is running fails
    /// with 57014; an idle session is left as it is.
    Cancel {
        application_name: String,
    },
    /// `SAVEPOINT canopy_handler`, right after `InboxTryInsert`.
    InboxSavepoint,
    /// `ROLLBACK TO SAVEPOINT canopy_handler`: the delivery's work undone
    /// (an aborted transaction recovered), its inbox row and lock kept.
    InboxUndoHandler,
    /// `inbox_record_failure`, in the handler's transaction: back to the
    /// savepoint, then attempts + 1, `last_error`, dead-lettered at the
    /// budget; takes effect at commit.
    InboxRecordFailure {
        subscription: String,
        event_id: Uuid,
        error: String,
        max_attempts: u32,
    },
    /// `LISTEN canopy_outbox`: the connection becomes a listener; from then
    /// on the server sends a `Notification` after every commit that wrote
    /// outbox rows (`publish_tx`'s `pg_notify`, delivered at commit).
    Listen,
    /// A statement that fails with SQLSTATE `code` (a handler's own failing
    /// statement, as `SELECT 1/0` fails on PostgreSQL).
    Raise {
        code: String,
    },
    /// `inbox_list_unprocessed`.
    InboxList {
        ids: Option<Vec<Uuid>>,
        subscription: Option<String>,
        routing_key: Option<String>,
        dead_lettered_only: bool,
        limit: u32,
        /// Rows after this one (received ms, event id) only.
        after: Option<(u64, Uuid)>,
        /// Rows whose event payload holds a value at a path only.
        payload_field: Option<outbox::core::ports::PayloadField>,
        /// Each row's payload left out (empty).
        omit_payload: bool,
    },
    /// `inbox_held.sql`: a key's held rows above `after`, lowest first.
    InboxHeld {
        subscription: String,
        key: String,
        after: i64,
        limit: u32,
    },
    /// `inbox_releasable.sql`: held rows nothing holds back, one per key.
    InboxReleasable {
        subscription: String,
        limit: u32,
    },
    /// `inbox_skip.sql`: these dead-lettered rows marked processed, skipped.
    InboxSkip {
        subscription: String,
        ids: Vec<Uuid>,
    },
    /// `inbox_delete_processed`.
    InboxDeleteProcessed {
        older_than_ms: u64,
        limit: u32,
    },
    /// `inbox_retire_partitions`.
    InboxRetirePartitions {
        older_than_ms: u64,
    },
    /// `inbox_ping` (`SELECT 1`): answers `Ok`.
    Ping,
    /// `replication_positions.sql`: the WAL flush position and the named
    /// standbys' (the durability gates).
    ReplicationPositions {
        standbys: Vec<String>,
    },
    /// `inbox_counts.sql`: a subscription's rows processed within the
    /// window, retried and dead-lettered, each up to `cap`.
    InboxCounts {
        subscription: String,
        window_ms: u64,
        cap: u32,
    },
}

/// `SET LOCAL` settings of one transaction; `None` leaves one as it was.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxSettings {
    /// `idle_in_transaction_session_timeout`: the server ends the session
    /// (FATAL 25P03) when the transaction sits idle this long.
    pub idle_in_tx_ms: Option<u64>,
    /// `statement_timeout`: a statement still running this long after it
    /// arrived fails with 57014.
    pub statement_ms: Option<u64>,
    /// `lock_timeout`: a statement waiting this long on a lock fails with
    /// 55P03.
    pub lock_ms: Option<u64>,
    /// `application_name`, which `Terminate` and `Cancel` find sessions by.
    pub application_name: Option<String>,
}

/// An inbox row as a delivery brings it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireInboxEntry {
    pub event_id: Uuid,
    pub subscription: String,
    pub routing_key: String,
    /// The encoded envelope.
    pub payload: String,
    /// Replay's reset, in the transaction (see `InboxEntry::fresh_budget`).
    pub fresh_budget: bool,
    /// Its ordering key and number, on an ordered subscription.
    pub ordering: Option<WireOrdering>,
}

/// An inbox row on the wire (times in simulated milliseconds).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireInboxRow {
    pub event_id: Uuid,
    pub subscription: String,
    pub routing_key: String,
    pub payload: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub received_ms: u64,
    pub dead_lettered_ms: Option<u64>,
    pub ordering: Option<WireOrdering>,
    pub held: bool,
}

/// What `InboxTryInsert` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireInsertOutcome {
    Inserted,
    InFlightRetry {
        attempts: i32,
    },
    AlreadyProcessed,
    /// `inbox_try_insert_keyed.sql` found an earlier event of the key
    /// waiting for its retry: its row (if new) recorded waiting.
    BehindRetry,
    /// `inbox_try_insert_keyed.sql` found an earlier event of the key
    /// dead-lettered or held: recorded held.
    Held,
}

/// One envelope to insert.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewRow {
    pub id: Uuid,
    pub routing_key: String,
    /// The encoded envelope.
    pub body: String,
    /// Its ordering key, if it has one (numbered by the insert).
    pub ordering_key: Option<String>,
}

/// An event's ordering key and number within it.
pub type WireOrdering = (String, i64);

/// One claimed row on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireRow {
    pub id: Uuid,
    pub routing_key: String,
    /// The encoded envelope (JSON text: bodies travel as strings, not as
    /// arrays of numbers).
    pub body: String,
    pub attempts: i32,
    /// Simulated milliseconds since the row was written.
    pub age_ms: u64,
    pub ordering: Option<WireOrdering>,
    /// When the row was written, in simulated microseconds: its place in
    /// claim order with its id (`ClaimPosition`).
    pub enqueued_us: i64,
}

/// A parked row on the wire (times in simulated milliseconds).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireParked {
    pub id: Uuid,
    pub routing_key: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub enqueued_ms: u64,
    pub parked_ms: u64,
    pub ordering: Option<WireOrdering>,
    /// The envelope as written.
    pub envelope: String,
}

/// A reply from the fake PostgreSQL.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PgReply {
    Ok,
    /// The reply to `Hello`: the session's number (PostgreSQL's backend
    /// pid), which the trace names it by.
    Session {
        id: u64,
    },
    Count(u64),
    Rows(Vec<WireRow>),
    Failed {
        recorded: u64,
        parked: u64,
    },
    Stats {
        pending: u64,
        oldest_age_ms: u64,
        parked: u64,
        blocked: u64,
    },
    /// The reply to `KeyWindow`: (key, head, claimable), in key order.
    KeyWindow(Vec<(String, Uuid, bool)>),
    Parked(Vec<WireParked>),
    Inbox(WireInsertOutcome),
    Attempt {
        attempts: i32,
        dead_lettered: bool,
    },
    InboxRows(Vec<WireInboxRow>),
    /// What a pass over the partitions did.
    Retired(WireRetired),
    /// A commit wrote outbox rows (to a listening connection).
    Notification,
    /// The statement failed (duplicate key, no transaction, refused data,
    /// injected failure).
    Error(PgError),
    /// `replication_positions.sql`'s positions: the primary's flush
    /// position, and each named standby's (`None`: not streaming).
    Replication {
        flushed: u64,
        timeline: u32,
        standbys: Vec<Option<u64>>,
    },
    /// `inbox_counts.sql`'s counts.
    InboxCounts {
        processed_recently: u64,
        retrying: u64,
        dead_lettered: u64,
    },
}

/// `PartitionsRetired` on the wire.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireRetired {
    pub partitioned: bool,
    pub created: Vec<String>,
    pub dropped: Vec<String>,
}

/// A queue declaration's arguments as they travel to the fake RabbitMQ.
pub type WireArguments = Vec<(String, ArgumentValue)>;

/// `args` (as the core decides them) on the wire.
fn wire_arguments(args: QueueArguments) -> WireArguments {
    args.into_iter().map(|(n, v)| (n.to_owned(), v)).collect()
}

/// What `spec` declares, on the wire: the arguments of the queues it
/// consumes from, and `<queue>.dlq`'s, as the core decides them.
pub fn subscription_arguments(spec: &SubscriptionSpec) -> (WireArguments, WireArguments) {
    (
        wire_arguments(topology::consumed_arguments(spec)),
        wire_arguments(topology::dlq_arguments(spec)),
    )
}

/// A request to the fake RabbitMQ.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum MqRequest {
    Hello {
        client: String,
    },
    ChannelOpen {
        channel: u32,
    },
    ConfirmSelect {
        channel: u32,
    },
    Publish {
        channel: u32,
        exchange: String,
        routing_key: String,
        message_id: Uuid,
        body: WireBody,
        /// The `traceparent` and `tracestate` AMQP headers.
        trace: Option<WireTrace>,
        /// The `x-canopy-ordering-key` and `x-canopy-key-seq` headers.
        ordering: Option<WireOrdering>,
        /// The `canopy-bucket` header.
        bucket: Option<String>,
    },
    ChannelClose {
        channel: u32,
    },
    /// The subscription's topology: `<queue>.dlq` on `canopy.dlq`, the
    /// queue with its dead-letter route, its bindings on `exchange`, each
    /// queue declared with the arguments the core decides
    /// (`outbox::core::topology`). With `partitions`, an ordered
    /// subscription's instead: `<queue>.route` bound to `exchange` with the
    /// bindings, and partition `partition`'s queue (every one if `None`)
    /// with a single active consumer, bound by its buckets.
    DeclareSubscription {
        channel: u32,
        queue: String,
        exchange: String,
        bindings: Vec<String>,
        /// The queue's (or each partition queue's) declaration arguments.
        arguments: WireArguments,
        /// `<queue>.dlq`'s.
        dlq_arguments: WireArguments,
        partitions: u16,
        partition: Option<u16>,
    },
    /// `basic.qos`.
    Qos {
        channel: u32,
        prefetch: u16,
    },
    /// `basic.consume`.
    Consume {
        channel: u32,
        queue: String,
    },
    /// AMQP heartbeat: sent when idle, so the broker can tell a silent
    /// client from a vanished one.
    Heartbeat,
    /// `basic.ack` (no reply); with `multiple`, of every unacknowledged
    /// delivery of the channel up to `tag`.
    Ack {
        channel: u32,
        tag: u64,
        multiple: bool,
    },
    /// `basic.nack` (no reply).
    Nack {
        channel: u32,
        tag: u64,
        requeue: bool,
    },
}

/// A frame from the fake RabbitMQ.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum MqReply {
    /// Reply to ChannelOpen / ConfirmSelect / ChannelClose.
    Ok { channel: u32 },
    /// Publisher confirm of the `seq`-th publish on `channel` (1-based).
    Confirm { channel: u32, seq: u64, ack: bool },
    /// The broker closed the channel.
    ChannelClosed { channel: u32, reason: String },
    /// AMQP heartbeat from the broker.
    Heartbeat,
    /// A message pushed to a consumer.
    Deliver {
        channel: u32,
        tag: u64,
        message_id: Option<String>,
        routing_key: String,
        body: WireBody,
        redelivered: bool,
        trace: Option<WireTrace>,
        ordering: Option<WireOrdering>,
    },
}

/// The `traceparent` (and `tracestate`) AMQP headers of a message.
pub type WireTrace = (String, Option<String>);
