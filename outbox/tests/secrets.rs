//! Passwords in AMQP and PostgreSQL URLs never reach logs, errors or Debug
//! output.

use outbox::core::ports::Broker;
use outbox::{LapinBroker, redact_url};

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

#[tokio::test]
async fn a_failed_broker_connection_does_not_leak_the_password() {
    // Port 1 on loopback: nothing listens there, the connect fails at once.
    let broker = LapinBroker::new(format!("amqp://svc:{SECRET}@127.0.0.1:1/%2f"));
    assert!(!format!("{broker:?}").contains(SECRET));
    let err = broker
        .channel_open()
        .await
        .err()
        .expect("no broker on port 1");
    assert!(!err.to_string().contains(SECRET), "{err}");
    assert!(!format!("{err:?}").contains(SECRET), "{err:?}");
}
