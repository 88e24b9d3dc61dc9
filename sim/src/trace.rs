//! The trace: every port call, fault, delivery and coverage mark, with
//! simulated time, in the order the single-threaded simulation produced
//! them. Its FNV-1a hash is printed with every run; the same seed gives the
//! same trace, byte for byte.
//!
//! Who records what: the fakes record what the services did (commits,
//! claims, marks, confirms, deliveries, settlements, inbox writes); the
//! adapters record what the production code asked for and saw (calls,
//! returns, failures, publishes, confirms received, transaction idleness);
//! the simulated handler and the operator record what they ran; the world
//! records faults and hosts. The checker judges from these and the fakes'
//! final state, never from the core's own marks, which are coverage only.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::core::marks::Mark;
use uuid::Uuid;

/// A kind of fault, as the sweep counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// A link to the broker holds every byte.
    Blackhole,
    /// Two hosts cannot reach each other.
    Partition,
    /// A host crashes (and restarts later).
    Crash,
    /// A crash point fired inside a port call.
    CrashPoint,
    /// A stop-the-world pause fired inside a port call.
    Pause,
    /// The fake PostgreSQL failed a statement.
    PgFailure,
    /// The fake PostgreSQL applied a request and lost its reply.
    PgReplyLost,
    /// The fake PostgreSQL ended a session idle in transaction.
    PgIdleTimeout,
    /// The fake PostgreSQL answered slowly (a window).
    PgSlow,
    /// Another session held the handler's domain table locked (a window):
    /// handler statements that write to it wait.
    DomainLock,
    /// The fake RabbitMQ dropped a connection.
    MqDrop,
    /// The fake RabbitMQ nacked a publish.
    MqNack,
    /// The fake RabbitMQ held confirms back.
    ConfirmDelay,
    /// The fake RabbitMQ kept a redelivered copy of a delivery.
    DuplicateDelivery,
    /// A peer went silent past the heartbeat timeout.
    HeartbeatTimeout,
    /// The consumers' downstream refused poison events.
    Downstream,
    /// The fake RabbitMQ delivered a hostile message.
    Hostile,
    /// A node of the fake RabbitMQ cluster crashed (and restarts later).
    NodeCrash,
    /// A node of the fake RabbitMQ cluster was cut off from the others and
    /// from its clients.
    NodePartition,
    /// A quorum queue of the fake RabbitMQ lost its leader, or elected one.
    LeaderElection,
    /// A classic queue out of reach dropped what was routed to it.
    QueueUnreachable,
    /// The fake PostgreSQL's standby stopped receiving its WAL.
    StandbyAway,
    /// The fake PostgreSQL's primary crashed and its standby was promoted.
    Failover,
    /// The fake PostgreSQL's primary turned read-only in place and its
    /// standby, caught up, was promoted (an orderly switchover).
    Switchover,
}

/// Which drainer store call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Call {
    Claim,
    MarkPublished,
    MarkFailed,
    Release,
}

/// How a consumer settled a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    Ack,
    Requeue,
    DeadLetter,
}

/// What one run of the simulated handler came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerResult {
    /// It wrote its effect and returned Ok.
    Ok,
    /// It failed for a reason of its own (an `Err`, a panic, a broken
    /// downstream, a statement error it swallowed): an attempt must be
    /// counted.
    Failed,
    /// The subscriber gave up on it at its deadline while it did work of
    /// its own (a stall, a wait on the locked domain table; the database
    /// answered): the first such run of a delivery runs once more, the
    /// next counts an attempt.
    Overran,
    /// Its database was unavailable: no attempt may be counted.
    Unavailable,
}

/// How a statement that waited on a lock ended its wait at the fake
/// PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// It got the lock and ran.
    Acquired,
    /// `statement_timeout` ended it (57014).
    StatementTimeout,
    /// `lock_timeout` ended it (55P03).
    LockTimeout,
    /// The server found it in a deadlock and failed it (40P01).
    Deadlock,
    /// `pg_cancel_backend` ended it (57014).
    Cancelled,
    /// `pg_terminate_backend` ended it and its session (57P01).
    Terminated,
    /// Its connection was closed while it waited (the server noticed).
    ConnectionClosed,
}

/// What a replay of one row came to, as the operator saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    Applied,
    AlreadyProcessed,
    Failed,
    Undecodable,
    /// Still held behind an earlier event of its key.
    Held,
    /// Skipped by the operator.
    Skipped,
}

/// Hostile messages the fake broker can deliver (see `fakes::mq::hostile`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "snake_case")]
pub enum HostileKind {
    /// Text that is not JSON.
    NotJson,
    /// Bytes that are not UTF-8.
    Binary,
    /// An envelope whose id is not a UUID v7.
    NotV7,
    /// A valid envelope whose AMQP `message_id` is another id, not a UUID,
    /// or absent: it must take effect once, keyed by the envelope id.
    ForeignMessageId,
    /// An envelope with an extra field holding `\u0000` (jsonb refuses it).
    NulEscape,
    /// An envelope with an extra field holding a lone surrogate.
    LoneSurrogate,
    /// An envelope with an extra field holding a number beyond jsonb's range.
    NumberOutOfRange,
    /// A valid envelope one byte over the subscriber's size limit.
    Oversized,
    /// A valid envelope exactly at the subscriber's size limit: it must be
    /// taken and applied once.
    AtTheLimit,
    /// A valid envelope whose `traceparent`/`tracestate` (AMQP headers and
    /// envelope headers) are not W3C trace context: it is a real event and
    /// takes effect once; its context is ignored.
    ForeignTraceContext,
}

impl HostileKind {
    /// Every kind.
    pub const ALL: &'static [HostileKind] = &[
        HostileKind::NotJson,
        HostileKind::Binary,
        HostileKind::NotV7,
        HostileKind::ForeignMessageId,
        HostileKind::NulEscape,
        HostileKind::LoneSurrogate,
        HostileKind::NumberOutOfRange,
        HostileKind::Oversized,
        HostileKind::AtTheLimit,
        HostileKind::ForeignTraceContext,
    ];

    /// Whether the subscriber must apply it (once) rather than dead-letter
    /// it at once.
    pub fn applies(self) -> bool {
        matches!(
            self,
            HostileKind::ForeignMessageId
                | HostileKind::AtTheLimit
                | HostileKind::ForeignTraceContext
        )
    }
}

/// One thing that happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    // --- faults and hosts (the world and the fakes) ------------------------
    /// A fault window opened.
    FaultStart { kind: FaultKind, detail: String },
    /// A fault window closed.
    FaultEnd { kind: FaultKind },
    /// One injected fault happened.
    Fault { kind: FaultKind, detail: String },
    /// Every fault ended; the liveness phase begins.
    Heal,
    /// A host crashed or restarted.
    Host { host: String, up: bool },
    /// The engine stopped the run (a host's task returned an error, or
    /// a task panicked).
    SimulationError { message: String },

    // --- the producer (the fake PostgreSQL and the workload) ---------------
    /// The workload committed a transaction holding these envelopes.
    Committed { client: String, ids: Vec<Uuid> },
    /// A transaction holding these envelopes rolled back (explicitly or
    /// because its connection died).
    RolledBack { client: String, ids: Vec<Uuid> },
    /// The workload wrote a row no broker can accept (bypassing validation).
    Unpublishable { id: Uuid },
    /// The workload wrote an event with this W3C trace context in its
    /// headers (what every delivery of it must carry).
    Traced {
        id: Uuid,
        traceparent: String,
        tracestate: Option<String>,
    },
    /// The workload wrote an event whose effect takes `key` under the
    /// domain table's deferred unique constraint.
    UniqueKeyed { id: Uuid, key: String },
    /// A commit's keyed rows, with the number each took within its
    /// ordering key (recorded by the fake at the commit, right after
    /// `Committed`: the trace's order of these is the commit order).
    KeysNumbered { rows: Vec<(Uuid, String, i64)> },

    // --- transactions as store clients see them (the adapters) -------------
    /// A client sent BEGIN.
    TxBegin { client: String },
    /// A client's transaction ended (commit or rollback answered, or the
    /// client abandoned the connection).
    TxEnd { client: String },
    /// A statement of the open transaction answered: until the next one (or
    /// the end) the transaction waits on the client.
    TxIdle { client: String },
    /// The client sent the next statement of its open transaction.
    TxResumed { client: String },

    // --- the drainer's store calls as the replica made them (the adapter) --
    /// The replica called `outbox_claim`.
    ClaimCalled { replica: String },
    /// The replica's claim walks on from a place in claim order
    /// (`ClaimParams::after`), not from the oldest row.
    ClaimResumed { replica: String },
    /// A commit notification reached the replica's listener (its wakeup).
    Notified { replica: String },
    /// `outbox_claim` returned these rows to the replica (its view: the
    /// batch's Phase-2 deadline counts from here).
    ClaimReturned { replica: String, ids: Vec<Uuid> },
    /// The replica called a mark or a release for these rows.
    StoreCalled {
        replica: String,
        call: Call,
        ids: Vec<Uuid>,
    },
    /// `outbox_stats` answered the replica (the stats task) with these.
    StatsAnswered {
        replica: String,
        pending: u64,
        oldest_age_ms: u64,
        parked: u64,
        blocked: u64,
    },
    /// The fake PostgreSQL computed an `outbox_stats` answer (at the
    /// server, in the order of its other statements): what the table
    /// held must be what it says.
    StatsSampled {
        pending: u64,
        oldest_age_ms: u64,
        parked: u64,
        blocked: u64,
    },
    /// `outbox_stats` failed for the replica.
    StatsFailed { replica: String },
    /// An outbox gauge was set (by the stats task that last asked), to
    /// `micros` millionths.
    Gauge { name: String, micros: i64 },
    /// The replica's `DrainerHandle::readiness()` said this (the host asks
    /// every second, as a `/readyz` probe would).
    Readiness {
        replica: String,
        ready: bool,
        reasons: Vec<String>,
    },
    /// A drainer store call returned an error to the replica.
    StoreFailed { replica: String, call: Call },
    /// A drainer store call returned successfully to the replica.
    StoreAnswered { replica: String, call: Call },

    // --- what the fake PostgreSQL did with the outbox ----------------------
    /// The store applied a claim; `attempts` are the claimed rows' attempts
    /// as the store returned them, in the same order.
    Claimed {
        replica: String,
        ids: Vec<Uuid>,
        attempts: Vec<i32>,
    },
    /// The store applied a mark; `ids` are the rows it changed.
    MarkedPublished { replica: String, ids: Vec<Uuid> },
    /// The store bumped attempts; `parked` are the rows that parked.
    MarkedFailed {
        replica: String,
        ids: Vec<Uuid>,
        parked: Vec<Uuid>,
    },
    /// A claim's transaction rolled back: these leases went back to their
    /// previous holders.
    LeasesRestored { owners: Vec<(Uuid, Option<String>)> },
    /// The server crashed before the WAL writer flushed some asynchronous
    /// commits (the drainer's claims, marks and releases): these leases are
    /// back with their previous holders, these rows unpublished again.
    CommitsLost {
        leases: Vec<(Uuid, Option<String>)>,
        unmarked: Vec<Uuid>,
        /// Rows whose parked flag the crash took back, with the flag they
        /// have again.
        parks: Vec<(Uuid, bool)>,
    },
    /// The standby was promoted: the old primary's committed outbox rows
    /// it never held (`lost`) and the handler effects it lacks
    /// (`lost_effects`, by subscription and event) are gone.
    FailedOver {
        lost: Vec<Uuid>,
        lost_effects: Vec<(String, Uuid)>,
    },
    /// The store released leases.
    Released { replica: String, ids: Vec<Uuid> },
    /// The outbox janitor deleted rows.
    Deleted { ids: Vec<Uuid> },
    /// An operator unparked rows.
    Unparked { ids: Vec<Uuid> },
    /// An operator skipped parked rows: marked published, never sent.
    Skipped { ids: Vec<Uuid> },

    // --- broker clients and their nodes ------------------------------------
    /// A broker client was given a list of nodes and the node it starts
    /// at (the cluster's clients start at different nodes).
    BrokerAssigned { client: String, node: String },
    /// A broker client tries to connect to `node` (each try of its list).
    BrokerConnecting { client: String, node: String },
    /// The fake RabbitMQ accepted a connection of `client` on `node`.
    MqConnected { client: String, node: String },

    // --- the broker, producer side ------------------------------------------
    /// A client sent a publish; `body_id` is the envelope id its body holds.
    PublishSent {
        client: String,
        message_id: Uuid,
        body_id: Option<Uuid>,
    },
    /// The broker decided on a publish (ack: stored and routed).
    Confirmed {
        client: String,
        message_id: Uuid,
        ack: bool,
    },
    /// The confirm of a publish reached the client.
    ConfirmReceived { client: String, message_id: Uuid },

    // --- the broker, consumer side -----------------------------------------
    /// The broker pushed a message to a consumer, with the
    /// `traceparent`/`tracestate` AMQP headers it carried.
    Delivered {
        client: String,
        message_id: Option<String>,
        redelivered: bool,
        trace: Option<crate::wire::WireTrace>,
    },
    /// A consumer acked or nacked a delivery (as the broker received it).
    Settled {
        client: String,
        message_id: Option<String>,
        settle: Settle,
    },
    /// The broker put a hostile message in the subscription's queue.
    Hostile {
        kind: HostileKind,
        message_id: Option<String>,
        envelope_id: Option<Uuid>,
        /// Its ordering key and number headers, if it carries them.
        ordering: Option<crate::wire::WireOrdering>,
    },

    // --- statements as the fake PostgreSQL ran them ---------------------------
    /// A statement of session `session` (of `client`) began waiting on a
    /// lock another session holds (`on` says which).
    LockWait {
        client: String,
        session: u64,
        on: String,
    },
    /// That wait ended.
    LockWaitEnded {
        client: String,
        session: u64,
        how: WaitEnd,
    },
    /// A consumer's ping of the database (its subscriber asking whether the
    /// database answers) ended after `took`: answered, or not (failed or
    /// given up on).
    Pinged {
        client: String,
        took: Duration,
        answered: bool,
    },
    /// A client stopped waiting for the reply to a statement it had sent on
    /// session `session` (its future was dropped: a deadline, a cancelled
    /// call); the statement goes on at the server until it ends there.
    RequestAbandoned { client: String, session: u64 },
    /// A deferred constraint failed at `InboxCheck` or at COMMIT
    /// (`at_commit`); `events` are the effects it blames (each effect whose
    /// unique key an earlier effect had taken).
    ConstraintFailed {
        client: String,
        events: Vec<Uuid>,
        at_commit: bool,
    },
    /// The server applied a transaction's `SET LOCAL` of its own bounds on
    /// session `session` (`statement_timeout`, and
    /// `idle_in_transaction_session_timeout`), in force until that
    /// transaction ends.
    TxBounds {
        session: u64,
        statement_ms: Option<u64>,
        idle_in_tx_ms: Option<u64>,
    },
    /// `client` had the server end (`terminate`) or cancel the statement of
    /// these sessions.
    BackendSignalled {
        client: String,
        sessions: Vec<u64>,
        terminate: bool,
    },

    // --- the consumer (handler, fake inbox, operator) ------------------------
    /// The simulated handler was called for an event, in the transaction
    /// of PostgreSQL session `session`: a run begins.
    HandlerStarted {
        client: String,
        event_id: Uuid,
        session: Option<u64>,
    },
    /// That run is over: it returned, or the subscriber dropped it (at its
    /// deadline, or its batch gave up). The end of its transaction at the
    /// server (`InboxBatch` of its session: nothing it does after can take
    /// effect) or a crash of the client's host ends it too, recorded or not.
    HandlerEnded { client: String, event_id: Uuid },
    /// The simulated handler ran for an event.
    HandlerRan {
        client: String,
        event_id: Uuid,
        result: HandlerResult,
    },
    /// A handler transaction committed: these inbox rows became processed
    /// and these effects (subscription, event) took place.
    InboxCommitted {
        client: String,
        /// When the transaction began: its `now()`, so the processed rows'
        /// `processed_at`.
        began: Duration,
        processed: Vec<Uuid>,
        effects: Vec<(String, Uuid)>,
    },
    /// A delivery found its event already processed (a duplicate absorbed).
    InboxDuplicate { client: String, event_id: Uuid },
    /// A handler transaction of `client` that held `deliveries` inbox
    /// statements (one per delivery of a batch) ended, committed or not.
    InboxBatch {
        client: String,
        /// The session it ran on.
        session: u64,
        deliveries: u32,
        committed: bool,
    },
    /// A failed attempt was recorded on an inbox row.
    InboxFailure {
        client: String,
        event_id: Uuid,
        attempts: i32,
        dead_lettered: bool,
    },
    /// The fake PostgreSQL refused an inbox row's data (SQLSTATE `code`).
    InboxRefused {
        client: String,
        event_id: Uuid,
        code: &'static str,
    },
    /// Replay gave these rows a fresh budget.
    InboxReset { client: String, ids: Vec<Uuid> },
    /// An ordered subscription's keyed delivery found an earlier event of
    /// its key waiting for its retry: nothing written (`BehindRetry`).
    InboxBehindKey { client: String, event_id: Uuid },
    /// A commit recorded these rows held behind a dead-lettered (or held)
    /// earlier event of their key.
    InboxHeld { client: String, events: Vec<Uuid> },
    /// An operator skipped these dead-lettered rows: processed without
    /// their effect.
    InboxSkipped { client: String, events: Vec<Uuid> },
    /// The inbox janitor deleted rows.
    InboxDeleted { ids: Vec<Uuid> },
    /// The operator started a replay asking for `limit` rows `ask` selects
    /// (ids, routing key, dead-lettered only, a place to start after), which
    /// were `matching` when it asked, oldest first.
    ReplayStarted {
        client: String,
        ask: String,
        /// The ids it asked for, if it asked by ids.
        ids: Option<Vec<Uuid>>,
        limit: u32,
        matching: Vec<Uuid>,
    },
    /// The operator's replay returned (`ok`), saying whether more rows
    /// match (`more`), and the row whose place the rest goes on after
    /// (its answer's `next`).
    ReplayEnded {
        client: String,
        ok: bool,
        more: bool,
        next: Option<Uuid>,
    },
    /// The operator's replay reported on one row.
    Replayed {
        client: String,
        event_id: Uuid,
        outcome: Replay,
    },
    /// A replay (or skip) released this held row: replayed in its key's
    /// order after the row that took effect (or was skipped).
    ReplayReleased {
        client: String,
        event_id: Uuid,
        outcome: Replay,
    },

    // --- coverage ------------------------------------------------------------
    /// The core took a named path (coverage only: never evidence for a
    /// rule; the checker holds the marks it can to the evidence).
    Mark { who: String, mark: Mark },
}

/// Shared, append-only trace.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    inner: Arc<Mutex<Vec<(Duration, Event)>>>,
    sealed: Arc<std::sync::atomic::AtomicBool>,
}

impl Trace {
    /// Records `event` at simulated time `at` (nothing once sealed).
    pub fn record(&self, at: Duration, event: Event) {
        if self.sealed.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        self.inner.lock().expect("trace lock").push((at, event));
    }

    /// Ends the run's trace: what the hosts' tasks record as the engine
    /// drops them after the run (in an order no seed decides) is not part
    /// of it.
    pub fn seal(&self) {
        self.sealed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Records `event` at the current simulated time.
    pub fn now(&self, event: Event) {
        self.record(crate::sim_now(), event);
    }

    /// A copy of every event so far.
    pub fn events(&self) -> Vec<(Duration, Event)> {
        self.inner.lock().expect("trace lock").clone()
    }

    /// Every event so far, borrowed (no copy) while the guard lives.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Duration, Event)>> {
        self.inner.lock().expect("trace lock")
    }

    /// How many events so far.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("trace lock").len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The trace as text, one event per line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.write_to(&mut out);
        out
    }

    /// FNV-1a 64 of the rendered trace, computed without building it.
    pub fn hash(&self) -> u64 {
        let mut h = Fnv1a::default();
        self.write_to(&mut h);
        h.0
    }

    fn write_to(&self, out: &mut impl std::fmt::Write) {
        for (at, e) in self.inner.lock().expect("trace lock").iter() {
            let _ = writeln!(out, "{:>10.3} {e:?}", at.as_secs_f64());
        }
    }
}

/// FNV-1a, 64 bit: stable across platforms and releases (unlike std's
/// `DefaultHasher`).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::default();
    h.feed(bytes);
    h.0
}

/// A running FNV-1a 64 hash that text can be written into.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn feed(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

impl std::fmt::Write for Fnv1a {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.feed(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streamed_hash_is_the_hash_of_the_rendered_text() {
        let t = Trace::default();
        t.record(Duration::from_millis(5), Event::Heal);
        t.record(
            Duration::from_millis(7),
            Event::TxBegin { client: "a".into() },
        );
        assert_eq!(t.hash(), fnv1a(t.render().as_bytes()));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
