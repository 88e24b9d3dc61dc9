//! Every type a service holds prints with `{:?}` (C-COMMON-TRAITS), and
//! none prints a secret; the root exports at most 30 names.

use outbox::{
    DrainerHandle, InboxDrainer, LapinBroker, Outbox, OutboxBuilder, PgInboxStore, PgTx, Publisher,
    Subscriber, TokioClock,
};
use outbox_admin::{AdminAuth, AdminRouter};

fn debug<T: std::fmt::Debug>() {}

struct Noop;

impl outbox::Handler<PgTx> for Noop {
    async fn handle(
        &self,
        _: &mut PgTx,
        _: &outbox::EventEnvelope,
    ) -> Result<(), outbox::HandlerError> {
        Ok(())
    }
}

#[test]
fn the_types_a_service_holds_are_debug() {
    debug::<Outbox>();
    debug::<OutboxBuilder>();
    debug::<DrainerHandle>();
    debug::<InboxDrainer>();
    debug::<Publisher>();
    debug::<LapinBroker>();
    debug::<AdminRouter>();
    debug::<Subscriber<PgInboxStore, LapinBroker, TokioClock, Noop>>();
    debug::<outbox::testing::HandlerTest<Noop>>();
}

#[test]
fn an_admin_router_never_prints_its_token() {
    let token = "s3cr3t-token-0123456789abcdef0123456789";
    let router = AdminRouter::new(AdminAuth::bearer(token).unwrap());
    let printed = format!("{router:?}");
    assert!(printed.starts_with("AdminRouter"), "{printed}");
    assert!(!printed.contains(token), "{printed}");
}

#[tokio::test]
async fn a_builder_never_prints_the_brokers_password() {
    let pool = sqlx::PgPool::connect_lazy("postgres://postgres@127.0.0.1:5432/postgres").unwrap();
    let builder = Outbox::builder(pool).amqp_urls("amqp://app:hunter2@10.0.0.1:5672/%2f");
    let printed = format!("{builder:?}");
    assert!(printed.contains("10.0.0.1"), "{printed}");
    assert!(!printed.contains("hunter2"), "{printed}");
}

/// The names `pub use`d at the root of `src/lib.rs`.
fn root_exports() -> Vec<String> {
    let lib = include_str!("../src/lib.rs");
    let mut names = Vec::new();
    for stmt in lib.split("pub use ").skip(1) {
        let stmt = &stmt[..stmt.find(';').expect("a use ends")];
        match (stmt.find('{'), stmt.rfind('}')) {
            (Some(open), Some(close)) => names.extend(
                stmt[open + 1..close]
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned),
            ),
            _ => names.push(stmt.rsplit("::").next().unwrap().trim().to_owned()),
        }
    }
    names
}

/// The root says what a service uses, at most 30 names; the rest lives in
/// its modules, and the unstable core is hidden from the docs.
#[test]
fn the_root_exports_at_most_thirty_names_and_hides_the_core() {
    let names = root_exports();
    assert!(names.len() >= 20, "the parser found only {names:?}");
    assert!(names.len() <= 30, "{} root names: {names:?}", names.len());
    for service_needs in [
        "Outbox",
        "EventEnvelope",
        "Handler",
        "PgTx",
        "SubscriberSettings",
    ] {
        assert!(names.iter().any(|n| n == service_needs), "{service_needs}");
    }
    let lib = include_str!("../src/lib.rs");
    assert!(
        lib.contains("#[doc(hidden)]\npub mod core;"),
        "outbox::core is unstable and hidden from the docs"
    );
}
