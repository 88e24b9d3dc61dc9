//! The `service` example's boot (issue 25: with `CANOPY_MQ_ADMIN_TOKEN` set
//! but too short or empty it ran its admin routes open, silently). `cargo
//! test` builds the examples beside the tests; this runs the built one.

#[path = "../../outbox/tests/support/cli.rs"]
mod cli;

use std::process::Command;

use cli::{assert_help, assert_refused, example};

#[test]
fn the_service_example_answers_help_and_names_a_wrong_argument() {
    assert_help(&example("service"), &["--help"]);
    assert_refused(&example("service"), &["--port", "80"], "'--port'");
}

#[test]
fn a_bad_admin_token_fails_the_service_at_boot_naming_the_variable() {
    for token in ["short", ""] {
        let out = Command::new(example("service"))
            .env("CANOPY_MQ_ADMIN_TOKEN", token)
            // Nothing may be reached before the token is judged.
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
            .env("AMQP_URL", "amqp://nobody@127.0.0.1:1/%2f")
            .output()
            .expect("the service example is built by cargo test");
        assert!(!out.status.success(), "{token:?} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("CANOPY_MQ_ADMIN_TOKEN"), "{stderr}");
        // The token itself is a secret: never echoed.
        if !token.is_empty() {
            assert!(!stderr.contains(token), "{stderr}");
        }
    }
}

/// Without a token and without `CANOPY_MQ_ADMIN_OPEN=true` the service
/// refuses to boot rather than run its admin routes open.
#[test]
fn without_a_token_the_service_refuses_to_run_its_admin_routes_open() {
    let out = Command::new(example("service"))
        .env_remove("CANOPY_MQ_ADMIN_TOKEN")
        .env_remove("CANOPY_MQ_ADMIN_OPEN")
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("AMQP_URL", "amqp://nobody@127.0.0.1:1/%2f")
        .output()
        .expect("the service example is built by cargo test");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("CANOPY_MQ_ADMIN_TOKEN") && stderr.contains("must be set"),
        "{stderr}"
    );
}

/// A subscription the broker refuses to set up (here an exchange it cannot
/// use: `amq.direct` is no topic exchange) ends the service with the typed
/// setup error, instead of a service that runs on, ready, taking orders it
/// never ships.
#[test]
fn a_subscription_that_cannot_set_up_ends_the_service() {
    let database = format!("outbox_example_setup_{}", std::process::id());
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let url = match base.rsplit_once('/') {
        Some((server, _)) => format!("{server}/{database}"),
        None => panic!("DATABASE_URL has no database: {base}"),
    };
    let mut child = Command::new(example("service"))
        .env("CANOPY_MQ_ADMIN_OPEN", "true")
        .env_remove("CANOPY_MQ_ADMIN_TOKEN")
        .env("CANOPY_MQ_EXCHANGE", "amq.direct")
        .env("DATABASE_URL", &url)
        .env("SERVICE_ADDR", "127.0.0.1:0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the service example is built by cargo test");
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = Command::new("psql")
        .args([
            &base,
            "-qc",
            &format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"),
        ])
        .output();
    let status = status.unwrap_or_else(|| panic!("the service ran on for 60 s: {stderr}"));
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("service.example.shipments") && stderr.contains("amq.direct"),
        "the error names the subscription and what the broker refused: {stderr}"
    );
}
