//! The trace: every port call, fault and delivery, with simulated time, in
//! the order the single-threaded simulation produced them. Its FNV-1a hash is
//! printed with every run; the same seed gives the same trace, byte for byte.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use uuid::Uuid;

/// One thing that happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A scheduled or swarm fault was applied or healed.
    Fault(String),
    /// The workload committed a transaction holding these envelopes.
    Committed { client: String, ids: Vec<Uuid> },
    /// A transaction holding these envelopes was rolled back (explicitly or
    /// because its connection died).
    RolledBack { client: String, ids: Vec<Uuid> },
    /// The workload wrote a row no broker can accept (bypassing validation).
    Unpublishable { id: Uuid },
    /// A client sent BEGIN (recorded by the client: its own view).
    TxBegin { client: String },
    /// A client's transaction ended: commit or rollback answered, or the
    /// client abandoned the connection (recorded by the client).
    TxEnd { client: String },
    /// A statement of a client's open transaction answered: until its next
    /// statement (or its end) the transaction waits on the client.
    TxIdle { client: String },
    /// The client sent the next statement of its open transaction.
    TxResumed { client: String },
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
    /// The store released leases.
    Released { replica: String, ids: Vec<Uuid> },
    /// The janitor deleted rows.
    Deleted { ids: Vec<Uuid> },
    /// An operator unparked rows.
    Unparked { ids: Vec<Uuid> },
    /// A client sent a publish to the broker.
    PublishSent { client: String, message_id: Uuid },
    /// The broker confirmed a publish (ack: stored in the queue).
    Confirmed {
        client: String,
        message_id: Uuid,
        ack: bool,
    },
    /// A fake dropped a reply it had already applied.
    ReplyLost { server: &'static str, what: String },
    /// A drainer tick ended.
    Tick { replica: String, outcome: String },
    /// A handler transaction committed: these inbox rows became processed
    /// and these effects (subscription, event) took place.
    InboxCommitted {
        client: String,
        processed: Vec<Uuid>,
        effects: Vec<(String, Uuid)>,
    },
    /// A delivery found its event already processed (a duplicate absorbed).
    InboxDuplicate { client: String, event_id: Uuid },
    /// A failed handler attempt was recorded on an inbox row.
    InboxFailure {
        event_id: Uuid,
        attempts: i32,
        dead_lettered: bool,
    },
    /// A host crashed or restarted.
    Host { host: String, up: bool },
}

/// Shared, append-only trace.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    inner: Arc<Mutex<Vec<(Duration, Event)>>>,
}

impl Trace {
    /// Records `event` at simulated time `at`.
    pub fn record(&self, at: Duration, event: Event) {
        self.inner.lock().expect("trace lock").push((at, event));
    }

    /// Records `event` at the current simulated time.
    pub fn now(&self, event: Event) {
        self.record(crate::sim_now(), event);
    }

    /// A copy of every event so far.
    pub fn events(&self) -> Vec<(Duration, Event)> {
        self.inner.lock().expect("trace lock").clone()
    }

    /// The trace as text, one event per line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (at, e) in self.inner.lock().expect("trace lock").iter() {
            let _ = writeln!(out, "{:>10.3} {e:?}", at.as_secs_f64());
        }
        out
    }

    /// FNV-1a 64 of the rendered trace.
    pub fn hash(&self) -> u64 {
        fnv1a(self.render().as_bytes())
    }
}

/// FNV-1a, 64 bit: stable across platforms and releases (unlike std's
/// `DefaultHasher`).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
