//! The `chaos` command line, as CI and a developer call it: usage errors
//! exit 2 and say what is wrong, and a password in `--amqp-url` never
//! reaches the output. (Building this test also builds `target/debug/chaos`
//! with the test build's features, which is the binary `.ci/run` runs.)

use std::process::{Command, Output};

fn chaos(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .expect("chaos runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn chaos_without_a_role_prints_its_usage_and_exits_2() {
    let out = chaos(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("Usage: chaos <COMMAND>"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn chaos_answers_help_on_every_subcommand_and_exits_0() {
    for args in [
        &["--help"][..],
        &["help"],
        &["run", "--help"],
        &["producer", "--help"],
        &["drainer", "--help"],
        &["subscriber", "--help"],
    ] {
        let out = chaos(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage: chaos"),
            "{args:?}"
        );
    }
}

#[test]
fn chaos_run_names_an_unknown_argument_and_exits_2() {
    let out = chaos(&["run", "--eventz", "5"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("'--eventz'"), "{}", stderr(&out));
}

#[test]
fn chaos_run_refuses_zero_events_and_a_value_that_is_no_number() {
    let zero = chaos(&["run", "--events", "0"]);
    assert_eq!(zero.status.code(), Some(2));
    assert!(stderr(&zero).contains("--events"), "{}", stderr(&zero));
    let word = chaos(&["run", "--seed", "seven"]);
    assert_eq!(word.status.code(), Some(2));
    assert!(
        stderr(&word).contains("'seven'") && stderr(&word).contains("--seed"),
        "{}",
        stderr(&word)
    );
}

#[test]
fn chaos_run_hides_the_password_of_a_bad_node_list() {
    let out = chaos(&[
        "run",
        "--cluster",
        "--amqp-url",
        "amqp://guest:hunter2@127.0.0.1:5681/%2f",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("--cluster needs"), "{err}");
    assert!(
        !err.contains("hunter2"),
        "a password reached the output: {err}"
    );
}
