//! A transactional outbox for services that keep their state in PostgreSQL
//! and publish to RabbitMQ (ADR-018).
//!
//! A service writes an [`EventEnvelope`] in the same transaction as its domain
//! rows ([`Publisher::publish_tx`]); a lease-based drainer ([`DrainerHandle`])
//! publishes every committed envelope to RabbitMQ at least once, across broker
//! outages, black-holed connections and restarts, with publisher confirms,
//! and never while a database transaction is open.
//!
//! # Layout
//! - [`envelope`]: the envelope and its validation.
//! - [`pg`]: the PostgreSQL adapter: [`Publisher`] and [`PgOutboxStore`]; all SQL.
//! - [`amqp`]: the RabbitMQ adapter ([`LapinBroker`]).
//! - [`core`]: the drainer, janitor, stats task and subscriber, generic over
//!   [`core::ports`];
//!   the simulation runs this exact code with its own adapters.
//! - [`config`]: `CANOPY_MQ_*` configuration and its boot asserts.
//! - [`migrate`]: the embedded migrator and the byte-identity check.
//! - [`runtime`]: tokio clock and tasks, OS entropy, and [`DrainerHandle`]
//!   wiring.
//! - [`admin`]: operator functions (parked-row listing, unpark); [`http`]: the
//!   admin HTTP surface (axum `Router`: replay, parked rows, unpark, `/readyz`,
//!   `/metrics`), behind the default `admin-http` feature.
//! - [`error`]: every error type.
//! - [`telemetry`]: span names and attributes, metric names;
//!   [`trace_context`]: the W3C context carried with each event.
//!
//! Everything a service needs is re-exported here at the root; the modules
//! hold the rest (the ports, for adapters of your own, and the pieces the
//! simulation drives one by one).
//!
//! # Features
//! - `admin-http` (default): [`http`], the admin router and `/metrics` via
//!   the Prometheus exporter.
//! - `otel`: OpenTelemetry trace context through the outbox (see
//!   [`telemetry`]); without it nothing of OpenTelemetry is compiled in and a
//!   context already in an envelope's headers is still carried.

#![warn(missing_docs)]

pub mod admin;
pub mod amqp;
pub mod config;
pub mod core;
pub mod envelope;
pub mod error;
#[cfg(feature = "admin-http")]
pub mod http;
pub mod migrate;
pub mod pg;
pub mod runtime;
pub mod service;
pub mod telemetry;
pub mod testing;
pub mod trace_context;

pub use amqp::{LapinBroker, redact_url};
pub use config::{DrainerConfig, DrainerConfigBuilder};
pub use core::drainer::{Drainer, TickReport};
pub use core::janitor::InboxJanitorSettings;
pub use core::ports::{
    InboxCounts, InboxCursor, InboxFilter, InboxRow, KeySeq, OutboxStats, ParkedCursor,
    ParkedFilter, ParkedRow, PartitionsRetired, QUORUM_DELIVERY_LIMIT, QueueType,
    SUBSCRIBER_MAX_ATTEMPTS_MAX, SubscriptionSpec, TxBounds, UnparkSelector,
};
pub use core::stats::{OutboxHealth, Readiness, UnreadyReason};
pub use core::subscriber::{
    DeliveryOutcome, Handler, ReplayOutcome, ReplayPage, Subscriber, SubscriberSettings,
    SubscriberStats,
};
pub use envelope::{EnvelopeLimits, EventEnvelope};
pub use error::{
    BrokerError, ConfigError, DrainError, HandlerError, PublishError, StoreError, SubscribeError,
};
pub use migrate::{MIGRATOR, migrator};
pub use pg::PgOutboxStore;
pub use pg::inbox::{PgInboxStore, PgInboxTx, PgTx};
pub use pg::publisher::Publisher;
pub use runtime::{
    DrainerHandle, DrainerPorts, InboxDrainer, OsEntropy, PgCommitWakeup, SplitMix64, TokioClock,
    TokioSpawn,
};
pub use service::{Outbox, OutboxBuilder, StartError};
pub use trace_context::TraceContext;
