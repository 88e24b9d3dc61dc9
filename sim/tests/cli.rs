//! The `sim` command line as a new user tries it: `--help` on the tool and
//! every subcommand exits 0; a wrong or missing argument is named and exits
//! 2; the README's commands parse.

use std::process::{Command, Output};

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .output()
        .expect("sim runs")
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn help_on_the_tool_and_every_subcommand_exits_0() {
    for args in [
        &["--help"][..],
        &["-h"],
        &["help"],
        &["help", "sweep"],
        &["run", "--help"],
        &["shrink", "--help"],
        &["sweep", "--help"],
        &["sweep", "--help", "--engine", "turmoil"],
    ] {
        let out = sim(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage: sim"),
            "{args:?}: {}",
            text(&out)
        );
    }
}

#[test]
fn a_wrong_or_missing_argument_is_named_and_exits_2() {
    for (args, names) in [
        (&[][..], "Usage: sim"),
        (&["sweep"], "--seeds"),
        (&["sweep", "--seeds", "5..5"], "empty seed range"),
        (&["sweep", "--seeds", "0..x"], "--seeds"),
        (&["sweep", "--seeds", "0..2", "--jobs", "two"], "--jobs"),
        (&["run", "broker_blackhole"], "--seed"),
        (&["run", "broker_blackhole", "--seed", "-1"], "'-1'"),
        (&["shrink", "--seed", "3"], "<SCENARIO>"),
        (
            &["run", "x", "--seed", "1", "--engine", "unicorn"],
            "--engine",
        ),
        (&["run", "x", "--seed", "1", "--tracee", "f"], "'--tracee'"),
        (&["replay"], "'replay'"),
    ] {
        let out = sim(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(names),
            "{args:?} should name {names}: {}",
            text(&out)
        );
    }
}

#[test]
fn an_unknown_scenario_is_an_error_that_names_it() {
    let out = sim(&["run", "no_such_scenario", "--seed", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no_such_scenario"),
        "{}",
        text(&out)
    );
}

#[test]
fn the_readme_commands_run() {
    // `sim run SCENARIO --seed N` as the README gives it, on a short
    // scenario: it passes and prints its verdict.
    let out = sim(&["run", "broker_blackhole", "--seed", "7"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("verdict  PASS"),
        "{}",
        text(&out)
    );
}
