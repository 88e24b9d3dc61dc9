//! A variable set to bytes that are not UTF-8 fails the boot naming it,
//! whichever reader reads it, instead of being taken as unset (which applied
//! the default: with `CANOPY_MQ_ADMIN_OPEN=true`, a garbled admin token ran
//! the admin routes open). One test in its own binary: it sets the
//! process's environment.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use outbox::config::vars;
use outbox::{ConfigError, DrainerConfig, InboxJanitorSettings, LapinBroker, SubscriberSettings};
use outbox_admin::{ADMIN_OPEN_VAR, ADMIN_TOKEN_VAR, AdminAuth};

/// Runs `read` with `var` set to `secret-\xff-token`, then unset.
fn garbled<T: std::fmt::Debug>(var: &str, read: impl Fn() -> Result<T, ConfigError>) -> String {
    let raw = OsStr::from_bytes(b"secret-\xff-token");
    // SAFETY: the only test of this binary, and it runs its cases one after
    // another; nothing else reads the environment while it changes.
    unsafe { std::env::set_var(var, raw) };
    let got = read();
    // SAFETY: as above.
    unsafe { std::env::remove_var(var) };
    let e = got.expect_err("a value that is not UTF-8 is refused");
    let ConfigError::NotUnicode {
        var: named,
        at,
        len,
    } = &e
    else {
        panic!("{var}: {e:?}");
    };
    assert_eq!((named.as_str(), *at, *len), (var, 8, 14));
    let said = e.to_string();
    assert!(
        !said.contains("secret") && !said.contains("token"),
        "{said}"
    );
    said
}

#[test]
fn a_value_that_is_not_utf8_fails_the_boot_naming_its_variable() {
    for var in [
        vars::TICK_MS,
        vars::REPLICA_ID,
        vars::EXCHANGE,
        vars::BUFFER_MAX,
    ] {
        let said = garbled(var, DrainerConfig::from_env);
        assert!(
            said.starts_with(&format!("{var} is invalid: must be UTF-8")),
            "{said}"
        );
    }
    for var in [
        vars::SUBSCRIBER_PREFETCH,
        vars::SUBSCRIBER_QUEUE_TYPE,
        vars::EXCHANGE,
    ] {
        garbled(var, || SubscriberSettings::from_env("q", &["k"]));
    }
    garbled(vars::INBOX_RETENTION_DAYS, InboxJanitorSettings::from_env);
    garbled(vars::AMQP_URLS, LapinBroker::from_env);
    garbled(vars::AMQP_HEARTBEAT_SECS, LapinBroker::from_env);
    // The admin token: garbled, the surface never runs open, even when
    // told it may.
    // SAFETY: as in `garbled`.
    unsafe { std::env::set_var(ADMIN_OPEN_VAR, "true") };
    garbled(ADMIN_TOKEN_VAR, AdminAuth::from_env);
    garbled(outbox_admin::ADMIN_ALLOWED_HOSTS_VAR, AdminAuth::from_env);
    // SAFETY: as in `garbled`.
    unsafe { std::env::remove_var(ADMIN_OPEN_VAR) };
}
