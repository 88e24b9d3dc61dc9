//! The examples' command lines as a new user tries them: `--help` prints
//! their usage and exits 0; a wrong argument is named and exits 2; a
//! password given on the command line never reaches the output. `cargo
//! test` builds the examples beside the tests; this runs the built ones.
//! (`outbox-migrations` has its own crate and tests.)

#[path = "support/cli.rs"]
mod cli;

use std::process::Command;

use cli::{assert_help, assert_refused, example, text};

#[test]
fn the_examples_answer_help() {
    for name in ["produce", "consume"] {
        assert_help(&example(name), &["--help"]);
    }
}

#[test]
fn the_examples_name_a_wrong_argument_and_exit_2() {
    assert_refused(&example("produce"), &["--count", "many"], "--count");
    assert_refused(&example("consume"), &["--queue", "q"], "--binding");
    assert_refused(
        &example("consume"),
        &["--queue", "q", "--binding", "#", "--duplicate-ratio", "2"],
        "--duplicate-ratio",
    );
    assert_refused(
        &example("consume"),
        &["--queue", "q", "--binding", "#", "--fail-every", "0"],
        "--fail-every",
    );
}

#[test]
fn a_password_on_the_command_line_never_reaches_the_output() {
    let url = "amqp://guest:hunter2@127.0.0.1:1/%2f";
    for (name, args) in [
        ("produce", vec!["--count", "many", "--amqp-url", url]),
        ("produce", vec!["--amqp-url", url, "--bogus"]),
        ("consume", vec!["--amqp-url", url]),
        ("produce", vec!["--help"]),
    ] {
        let out = Command::new(example(name))
            .args(&args)
            .env("AMQP_URL", url)
            .env("DATABASE_URL", "postgres://u:hunter2@127.0.0.1:1/none")
            .output()
            .expect("the example is built by cargo test");
        assert!(
            !text(&out).contains("hunter2"),
            "{name} {args:?}: {}",
            text(&out)
        );
    }
}
