#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

// The guide's examples compile (`cargo test --doc -p outbox`).
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../../README.md")]
    mod readme {}
    #[doc = include_str!("../../docs/start.md")]
    mod start {}
    #[doc = include_str!("../../docs/consuming.md")]
    mod consuming {}
    #[doc = include_str!("../../docs/partitioned.md")]
    mod partitioned {}
    #[doc = include_str!("../../docs/ordering.md")]
    mod ordering {}
    #[doc = include_str!("../../docs/admin.md")]
    mod admin {}
    #[doc = include_str!("../../docs/configuration.md")]
    mod configuration {}
    #[doc = include_str!("../../docs/rabbitmq.md")]
    mod rabbitmq {}
    #[doc = include_str!("../../docs/observability.md")]
    mod observability {}
    #[doc = include_str!("../../docs/guarantees.md")]
    mod guarantees {}
    #[doc = include_str!("../../docs/wire-format.md")]
    mod wire_format {}
    #[doc = include_str!("../../docs/postgresql.md")]
    mod postgresql {}
}

pub mod admin;
pub mod amqp;
pub mod config;
// Unstable: the ports and the pieces the simulation drives one by one.
#[doc(hidden)]
pub mod core;
pub mod envelope;
pub mod error;
pub mod migrate;
pub mod pg;
pub mod runtime;
pub mod service;
pub mod telemetry;
pub mod testing;
pub mod trace_context;

pub use amqp::LapinBroker;
pub use config::DrainerConfig;
pub use core::janitor::InboxJanitorSettings;
pub use core::ports::QueueType;
pub use core::stats::{Readiness, UnreadyReason};
pub use core::subscriber::{DeliveryOutcome, Handler, Subscriber, SubscriberSettings};
pub use envelope::EventEnvelope;
pub use error::{
    BrokerError, ConfigError, DrainError, HandlerError, PublishError, StoreError, SubscribeError,
};
pub use pg::PgOutboxStore;
pub use pg::inbox::{PgInboxStore, PgTx};
pub use pg::publisher::Publisher;
pub use runtime::{DrainerHandle, InboxDrainer, TokioClock};
pub use service::{Outbox, OutboxBuilder, StartError};
pub use trace_context::TraceContext;
