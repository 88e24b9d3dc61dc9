//! The simulation adapters of the ports: the production drainer, janitors
//! and subscriber reach the fakes through these, over the engine's network,
//! exactly as they reach PostgreSQL and RabbitMQ through sqlx and lapin.
//! Time and tasks are the engine's ([`crate::engine::Clock`],
//! [`crate::engine::Spawner`]); entropy is a seeded SplitMix64.
//!
//! - [`net`]: connections, bounded requests, the client's transactions.
//! - [`store`]: `OutboxStore` ([`SimStore`]).
//! - [`inbox`]: `InboxStore` ([`SimInboxStore`]).
//! - [`broker`]: `Broker` and `ConsumerBroker` ([`SimBroker`]).
//! - [`listen`]: the commit wakeup (LISTEN/NOTIFY).
//! - [`hooks`]: crash and pause points inside port calls.
//!
//! Marks reported by the core go into the trace through [`TraceMarks`].

pub mod broker;
pub mod hooks;
pub mod inbox;
pub mod listen;
pub mod net;
pub mod store;

use std::sync::Arc;

use outbox::core::marks::{Mark, MarkSink, Marks};

pub use self::broker::SimBroker;
pub use self::hooks::{Hooks, Point};
pub use self::inbox::{SimInboxStore, SimTx};
pub use self::net::{PgClient, STORE_REQUEST_TIMEOUT};
pub use self::store::SimStore;
use crate::trace::{Event, Trace};

/// A mark sink that records each mark in the trace, under the name of the
/// host incarnation that took it.
pub struct TraceMarks {
    who: String,
    trace: Trace,
}

impl TraceMarks {
    /// Marks of `who`, recorded in `trace`.
    pub fn marks(who: impl Into<String>, trace: Trace) -> Marks {
        Marks::to(Arc::new(Self {
            who: who.into(),
            trace,
        }))
    }
}

impl MarkSink for TraceMarks {
    fn hit(&self, mark: Mark) {
        self.trace.now(Event::Mark {
            who: self.who.clone(),
            mark,
        });
    }
}
