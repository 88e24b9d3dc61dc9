//! The `service` example's boot (issue 25: with `CANOPY_MQ_ADMIN_TOKEN` set
//! but too short or empty it ran its admin routes open, silently). `cargo
//! test` builds the examples beside the tests; this runs the built one.

use std::process::Command;

fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().and_then(|deps| deps.parent()).unwrap();
    target.join("examples").join(name)
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
