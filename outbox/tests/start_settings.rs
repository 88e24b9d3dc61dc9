//! A service that is not the ADR's names its variables under its own
//! prefix: `Env::prefixed("ORDERS_MQ_")` reads `ORDERS_MQ_*` where the
//! library reads `CANOPY_MQ_*`, errors name the variable as the operator
//! sets it, and `Outbox::builder(..).env(..)` reads the drainer's, the
//! janitor's and the broker's under it. Settings built or changed in code
//! are checked at start as those read are. One test in its own binary: it
//! sets the process's environment.

use std::ffi::OsStr;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;

use outbox::config::{Env, vars};
use outbox::{
    ConfigError, DrainerConfig, InboxJanitorSettings, LapinBroker, Outbox, PgTx, StartError,
    SubscriberSettings,
};

struct Noop;

impl outbox::Handler<PgTx> for Noop {
    async fn handle(
        &self,
        _tx: &mut PgTx,
        _event: &outbox::EventEnvelope,
    ) -> Result<(), outbox::HandlerError> {
        Ok(())
    }
}

/// Sets `var` to `value` (raw bytes) for the length of `f`.
fn with_var<T>(var: &str, value: &[u8], f: impl FnOnce() -> T) -> T {
    // SAFETY: the only test of this binary, and it runs its cases one after
    // another; nothing else reads the environment while it changes.
    unsafe { std::env::set_var(var, OsStr::from_bytes(value)) };
    let out = f();
    // SAFETY: as above.
    unsafe { std::env::remove_var(var) };
    out
}

fn invalid_var(e: &ConfigError) -> String {
    match e {
        ConfigError::Invalid { var, .. } => var.to_string(),
        ConfigError::NotUnicode { var, .. } => var.clone(),
        other => panic!("{other:?}"),
    }
}

/// What the builder's start fails with, before it touches the database.
async fn start_error(builder: outbox::OutboxBuilder) -> StartError {
    match builder.start().await {
        Ok(_) => panic!("started"),
        Err(e) => e,
    }
}

fn lazy_pool() -> sqlx::PgPool {
    // Never connected: every case fails at its settings first.
    sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn variables_are_read_and_named_under_the_service_prefix() {
    for bad in ["", "orders_mq_", "ORDERS_MQ", "1X_", "ORDERS-MQ_", "_"] {
        let e = Env::prefixed(bad).expect_err(bad);
        assert!(e.to_string().starts_with("env prefix="), "{e}");
    }
    let env = Env::prefixed("ORDERS_MQ_").unwrap();
    assert_eq!(env.name(vars::BATCH_SIZE), "ORDERS_MQ_DRAINER_BATCH_SIZE");
    assert_eq!(env.name("DATABASE_URL"), "DATABASE_URL");

    // Read and named under the prefix.
    let e = with_var("ORDERS_MQ_DRAINER_BATCH_SIZE", b"0", || {
        env.read(|l| DrainerConfig::from_lookup(l)).unwrap_err()
    });
    assert_eq!(invalid_var(&e), "ORDERS_MQ_DRAINER_BATCH_SIZE");
    assert!(
        e.to_string().starts_with("ORDERS_MQ_DRAINER_BATCH_SIZE=0"),
        "{e}"
    );
    let e = with_var("ORDERS_MQ_INBOX_RETENTION_DAYS", b"0", || {
        env.read(|l| InboxJanitorSettings::from_lookup(l))
            .unwrap_err()
    });
    assert_eq!(invalid_var(&e), "ORDERS_MQ_INBOX_RETENTION_DAYS");
    let s = with_var("ORDERS_MQ_SUBSCRIBER_PREFETCH", b"7", || {
        env.read(|l| SubscriberSettings::from_lookup("q", &["#"], l))
            .unwrap()
    });
    assert_eq!(s.spec.prefetch, 7);
    let e = with_var("ORDERS_MQ_SUBSCRIBER_PREFETCH", b"\xff", || {
        env.read(|l| SubscriberSettings::from_lookup("q", &["#"], l))
            .unwrap_err()
    });
    assert_eq!(invalid_var(&e), "ORDERS_MQ_SUBSCRIBER_PREFETCH");
    let e = LapinBroker::from_env_in(&env).unwrap_err();
    assert_eq!(invalid_var(&e), "ORDERS_MQ_AMQP_URLS");

    // The default prefix's variables are not read under another one.
    let read = with_var(vars::BATCH_SIZE, b"0", || {
        env.read(|l| DrainerConfig::from_lookup(l))
    });
    assert!(read.is_ok(), "{read:?}");

    // The builder reads under its prefix.
    let starting = with_var("ORDERS_MQ_DRAINER_BATCH_SIZE", b"0", || {
        // The settings are read when start is first polled: poll it here.
        let mut start = Box::pin(start_error(Outbox::builder(lazy_pool()).env(env.clone())));
        let waker = std::task::Waker::noop();
        match start
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker))
        {
            std::task::Poll::Ready(e) => e,
            std::task::Poll::Pending => panic!("start went past its settings"),
        }
    });
    let e = starting;
    let StartError::Config(e) = e else {
        panic!("{e:?}")
    };
    assert_eq!(invalid_var(&e), "ORDERS_MQ_DRAINER_BATCH_SIZE");
    let e = start_error(
        Outbox::builder(lazy_pool())
            .env(env.clone())
            .subscribe(SubscriberSettings::new("q", &["#"]), Noop),
    )
    .await;
    let StartError::Config(e) = e else {
        panic!("{e:?}")
    };
    assert_eq!(invalid_var(&e), "ORDERS_MQ_AMQP_URLS");

    // A subscription's settings built in code are checked at start, too.
    let mut settings = SubscriberSettings::new("q", &["#"]);
    settings.max_attempts = 0;
    let e = start_error(
        Outbox::builder(lazy_pool())
            .amqp_urls("amqp://guest:guest@127.0.0.1:1/%2f")
            .subscribe(settings, Noop),
    )
    .await;
    let StartError::Config(e) = e else {
        panic!("{e:?}")
    };
    assert!(e.to_string().contains("MAX_ATTEMPTS=0"), "{e}");

    let mut config = DrainerConfig::builder().build().unwrap();
    config.lease_ttl = std::time::Duration::ZERO;
    let e = start_error(Outbox::builder(lazy_pool()).drainer(config)).await;
    let StartError::Config(e) = e else {
        panic!("{e:?}")
    };
    assert_eq!(invalid_var(&e), vars::LEASE_TTL_SECS);
    let e = start_error(
        Outbox::builder(lazy_pool())
            .amqp_urls("amqp://guest:guest@127.0.0.1:1/%2f")
            .inbox_janitor(InboxJanitorSettings {
                retention: std::time::Duration::ZERO,
                ..Default::default()
            })
            .subscribe(SubscriberSettings::new("q", &["#"]), Noop),
    )
    .await;
    let StartError::Config(e) = e else {
        panic!("{e:?}")
    };
    assert_eq!(invalid_var(&e), "inbox janitor retention");
}
