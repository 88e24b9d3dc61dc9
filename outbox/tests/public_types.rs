//! Every type a service holds prints with `{:?}` (C-COMMON-TRAITS), and
//! none prints a secret.

use outbox::http::{AdminAuth, AdminRouter};
use outbox::{
    DrainerHandle, InboxDrainer, LapinBroker, Outbox, OutboxBuilder, PgInboxStore, PgTx, Publisher,
    Subscriber, TokioClock,
};

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
