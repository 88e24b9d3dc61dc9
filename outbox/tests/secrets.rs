//! Passwords in AMQP and PostgreSQL URLs never reach logs, errors or Debug
//! output.

use outbox::LapinBroker;
use outbox::amqp::redact_url;
use outbox::core::ports::Broker;

const SECRET: &str = "hunter2-secret";

#[test]
fn urls_are_redacted() {
    assert_eq!(
        redact_url(&format!("amqp://svc:{SECRET}@127.0.0.1:5672/%2f")),
        "amqp://svc:***@127.0.0.1:5672/%2f"
    );
    assert_eq!(
        redact_url(&format!("postgres://svc:{SECRET}@db:5432/orders")),
        "postgres://svc:***@db:5432/orders"
    );
    assert_eq!(
        redact_url(&format!(
            "postgres://svc@db/orders?password={SECRET}&sslmode=require"
        )),
        "postgres://svc@db/orders?password=***&sslmode=require"
    );
    // Nothing to hide: unchanged.
    assert_eq!(redact_url("amqp://127.0.0.1:5672"), "amqp://127.0.0.1:5672");
    assert_eq!(
        redact_url("amqp://guest@127.0.0.1"),
        "amqp://guest@127.0.0.1"
    );
    // A password containing '@' is hidden whole.
    assert_eq!(redact_url("amqp://u:p@ss@h/v"), "amqp://u:***@h/v");
}

#[test]
fn an_address_without_its_scheme_does_not_show_its_password() {
    // Found by fuzzing redact_url (issue 30): `user:password@host`, its
    // scheme forgotten, went into the error whole.
    for address in [
        format!("svc:{SECRET}@127.0.0.1:5672/%2f"),
        format!("svc_1:{SECRET}@h"),
        format!("amqp://a@h,svc:{SECRET}@h"),
        format!("svc:{SECRET}@h-amqp://other:5672"),
    ] {
        assert!(!redact_url(&address).contains(SECRET), "{address}");
        let e = outbox::LapinBroker::from_list(&address)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!e.contains(SECRET), "{e}");
    }
    assert_eq!(redact_url(&format!("svc:{SECRET}@h")), "svc:***@h");
    // With a scheme and no `//`, the password still follows the second colon.
    assert_eq!(
        redact_url(&format!("amqp:svc:{SECRET}@h")),
        "amqp:svc:***@h"
    );
}

#[test]
fn a_password_holding_a_comma_is_refused_without_showing_it() {
    // Found by fuzzing redact_url (issue 30): a list is split on commas, so
    // a password `Zq7,,Xw9` was cut into pieces and `Zq7` went into the
    // error.
    for list in [
        "amqp://svc:Zq7,,Xw9@h",
        "amqp://a@h,amqp://svc:Zq7,Xw9@h",
        "amqp://svc:Zq7,Xw9,Kp4@h:5672/%2f",
        // A `://` after the host once made the tail look like an address
        // of its own, and `Zq7` was shown.
        "amqp://svc:Zq7,Xw9@h/a://b",
        // No `//` after the scheme (lapin accepts it).
        "amqp:svc:Zq7,Xw9@h",
        "AMQPS://svc:Zq7,Kp4@h",
    ] {
        let e = outbox::LapinBroker::from_list(list)
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds a comma in its user or password"), "{e}");
        for fragment in ["Zq7", "Xw9", "Kp4"] {
            assert!(!e.contains(fragment), "{fragment:?} in {e}");
        }
    }
    // Percent-encoded, it is an address like any other.
    assert!(outbox::LapinBroker::from_list("amqp://svc:Zq7%2C%2CXw9@h").is_ok());
}

#[test]
fn every_address_shape_sqlx_and_lapin_accept_is_redacted() {
    let s = SECRET;
    for (address, expected) in [
        // No `//` after the scheme (lapin accepts it).
        (
            format!("amqp:svc:{s}@127.0.0.1"),
            "amqp:svc:***@127.0.0.1".to_owned(),
        ),
        // Unencoded `/`, `#`, `?` and `@` in the password.
        (
            format!("amqp://svc:a/{s}@h:5672/%2f"),
            "amqp://svc:***@h:5672/%2f".to_owned(),
        ),
        (
            format!("amqp://svc:a#{s}@h/v"),
            "amqp://svc:***@h/v".to_owned(),
        ),
        (
            format!("amqp://svc:a?{s}@h/v"),
            "amqp://svc:***@h/v".to_owned(),
        ),
        (
            format!("amqps://svc:{s}@h/v?heartbeat=10"),
            "amqps://svc:***@h/v?heartbeat=10".to_owned(),
        ),
        (
            format!("postgresql://svc:{s}@[::1]:5432/db"),
            "postgresql://svc:***@[::1]:5432/db".to_owned(),
        ),
        // Query keys, any case, `sslpassword` too.
        (
            format!("postgres://svc@db/x?sslpassword={s}&PASSWORD={s}&sslmode=verify-full"),
            "postgres://svc@db/x?sslpassword=***&PASSWORD=***&sslmode=verify-full".to_owned(),
        ),
        // key=value connection strings, quoted or not.
        (
            format!("host=db user=svc password={s} dbname=x"),
            "host=db user=svc password=*** dbname=x".to_owned(),
        ),
        (
            format!("host=db password='{s} with spaces' sslpassword={s}"),
            "host=db password=*** sslpassword=***".to_owned(),
        ),
        // libpq's own reading (issue 25): spaces around `=`, `;` inside an
        // unquoted value, escaped quotes inside a quoted one.
        (
            format!("host=db password = {s} dbname=x"),
            "host=db password = *** dbname=x".to_owned(),
        ),
        (
            format!("host=db password=hun;{s} dbname=x"),
            "host=db password=*** dbname=x".to_owned(),
        ),
        (
            format!(r"host=db password='hun\'{s} 2' dbname=x"),
            "host=db password=*** dbname=x".to_owned(),
        ),
        (
            format!(r"password='a\\{s}' host=db"),
            "password=*** host=db".to_owned(),
        ),
        // A key that only ends in "password" is left alone.
        (
            "host=db mypassword=x".to_owned(),
            "host=db mypassword=x".to_owned(),
        ),
    ] {
        let redacted = redact_url(&address);
        assert_eq!(redacted, expected, "{address}");
        assert!(!redacted.contains(s), "{address} leaks: {redacted}");
    }
}

#[tokio::test]
async fn a_broker_address_without_slashes_does_not_leak_through_lapins_error() {
    // lapin quotes the address it cannot parse in its error.
    for url in [
        format!("amqp:svc:{SECRET}@127.0.0.1:1"),
        format!("amqp://svc:a/{SECRET}@127.0.0.1:1/%2f"),
        format!("amqp://svc:{}@127.0.0.1:1/%2f", SECRET.replace('-', "%2D")),
    ] {
        let broker = LapinBroker::new(url.clone());
        assert!(!format!("{broker:?}").contains(SECRET), "{url}");
        assert!(!broker.redacted_url().contains(SECRET), "{url}");
        let err = broker
            .channel_open()
            .await
            .expect_err("nothing listens on port 1");
        let shown = format!("{err} {err:?}");
        assert!(!shown.contains(SECRET), "{url}: {shown}");
    }
}

#[tokio::test]
async fn a_failed_broker_connection_does_not_leak_the_password() {
    // Port 1 on loopback: nothing listens there, the connect fails at once.
    let broker = LapinBroker::new(format!("amqp://svc:{SECRET}@127.0.0.1:1/%2f"));
    assert!(!format!("{broker:?}").contains(SECRET));
    let err = broker
        .channel_open()
        .await
        .expect_err("no broker on port 1");
    assert!(!err.to_string().contains(SECRET), "{err}");
    assert!(!format!("{err:?}").contains(SECRET), "{err:?}");
}
