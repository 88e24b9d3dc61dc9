//! The examples' command lines as a new user tries them: `--help` prints
//! their usage and exits 0; a wrong argument is named and exits 2; a
//! password given on the command line never reaches the output. `cargo
//! test` builds the examples beside the tests; this runs the built ones.
//! (`outbox-migrations` has its own crate and tests.)

use std::path::PathBuf;
use std::process::{Command, Output};

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().and_then(|deps| deps.parent()).unwrap();
    target.join("examples").join(name)
}

fn run(exe: &PathBuf, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        // Nothing may be reached: a tool that got past its arguments fails
        // fast instead of working on a real service.
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("AMQP_URL", "amqp://nobody@127.0.0.1:1/%2f")
        .env("RUST_LOG", "off")
        .output()
        .expect("the tool is built by cargo test")
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_help(exe: &PathBuf, args: &[&str]) {
    let out = run(exe, args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Usage:"), "{args:?}: {}", text(&out));
}

fn assert_refused(exe: &PathBuf, args: &[&str], names: &str) {
    let out = run(exe, args);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(names),
        "{args:?} should name {names}: {}",
        text(&out)
    );
}

#[test]
fn the_examples_answer_help() {
    for name in ["service", "produce", "consume"] {
        assert_help(&example(name), &["--help"]);
    }
}

#[test]
fn the_examples_name_a_wrong_argument_and_exit_2() {
    assert_refused(&example("service"), &["--port", "80"], "'--port'");
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
