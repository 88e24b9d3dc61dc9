//! Conformance: the same test bodies run against the real service and the
//! fake. "If both arms pass, consumers can rely on the sim" (turmoil); the
//! fakes are worth only their fidelity. river's driver test suite is the
//! model: one body per behaviour, each run on every arm.
//!
//! - [`store`]: `PgOutboxStore` on PostgreSQL vs `SimStore` on the fake.
//! - [`inbox`]: `PgInboxStore` on PostgreSQL vs `SimInboxStore` on the fake,
//!   including what PostgreSQL refuses to store.
//! - [`broker`]: `LapinBroker` on RabbitMQ vs `SimBroker` on the fake
//!   (publish side).
//! - [`consume`]: the same, consumer side.
//! - [`cluster`]: `LapinBroker` on the local three-node RabbitMQ cluster vs
//!   `SimBroker` on the fake cluster: classic loss, quorum survival,
//!   a publish held without a majority, failover of a publisher and of a
//!   consumer, dead-lettering.
//!
//! Real arms use the local services (a fresh database per test, unique
//! exchange and queue names); fake arms run inside a simulation of the
//! build's engine ([`harness::in_sim`]): turmoil by default, madsim in the
//! madsim build, which runs the fake arms only (the real services are not
//! reachable from inside madsim's network).

// The madsim build compiles the real arms' types but runs none of them.
#![cfg_attr(madsim, allow(dead_code, unused_imports))]

#[cfg(not(madsim))]
#[path = "../../../outbox/tests/common/mod.rs"]
mod common;

/// Turns each body into two tests: `postgres` (or `rabbitmq`) on the real
/// service through the suite's `real` wrapper, and `fake` through its
/// `fake` wrapper.
macro_rules! conformance {
    // The PostgreSQL suites run on both layouts (issue 28): the plain one
    // of the ADR's migrations and the partitioned one, on the real server
    // and on the fake.
    (postgres: $real:ident, fake: $fake:ident,
     partitioned: $realp:ident, $fakep:ident; $($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[cfg(not(madsim))]
                #[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
                async fn postgres(pool: sqlx::PgPool) {
                    super::$real(pool, super::$name).await;
                }
                #[cfg(not(madsim))]
                #[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
                async fn postgres_partitioned(pool: sqlx::PgPool) {
                    super::$realp(pool, super::$name).await;
                }
                #[test]
                fn fake() {
                    super::$fake(super::$name);
                }
                #[test]
                fn fake_partitioned() {
                    super::$fakep(super::$name);
                }
            }
        )*
    };
    (rabbitmq_cluster: $real:ident, fake: $fake:ident; $($name:ident),* $(,)?) => {
        $(
            mod $name {
                // `rabbitmqctl` blocks its thread while a node stops.
                #[cfg(not(madsim))]
                #[tokio::test(flavor = "multi_thread")]
                async fn rabbitmq_cluster() {
                    super::$real(super::$name).await;
                }
                #[test]
                fn fake() {
                    super::$fake(super::$name);
                }
            }
        )*
    };
    (rabbitmq: $real:ident, fake: $fake:ident; $($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[cfg(not(madsim))]
                #[tokio::test]
                async fn rabbitmq() {
                    super::$real(super::$name).await;
                }
                #[test]
                fn fake() {
                    super::$fake(super::$name);
                }
            }
        )*
    };
}

mod broker;
mod cluster;
mod consume;
mod harness;
mod inbox;
mod store;
