//! `outbox-migrations` as a new user tries it: `--help` on every
//! subcommand prints its usage and exits 0; a wrong argument is named and
//! exits 2; `list` lists both layouts' files.

use std::path::PathBuf;
use std::process::{Command, Output};

fn run(exe: &PathBuf, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        // Nothing may be reached: a tool that got past its arguments fails
        // fast instead of working on a real service.
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("AMQP_URL", "amqp://nobody@127.0.0.1:1/%2f")
        .env("RUST_LOG", "off")
        .output()
        .expect("cargo test builds the tool")
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

fn migrations() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_outbox-migrations"))
}

#[test]
fn outbox_migrations_answers_help_on_every_subcommand() {
    let exe = migrations();
    for args in [
        &["--help"][..],
        &["-h"],
        &["help"],
        &["check", "--help"],
        &["stamp", "--help"],
        &["list", "--help"],
    ] {
        assert_help(&exe, args);
    }
    let out = run(&exe, &["--version"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[test]
fn outbox_migrations_names_what_is_wrong_and_exits_2() {
    let exe = migrations();
    assert_refused(&exe, &[], "Usage:");
    assert_refused(&exe, &["check"], "<DIR>");
    assert_refused(&exe, &["verify", "x"], "'verify'");
    assert_refused(&exe, &["list", "--partitionned"], "'--partitionned'");
}

#[test]
fn outbox_migrations_lists_both_layouts() {
    let plain = run(&migrations(), &["list"]);
    let partitioned = run(&migrations(), &["list", "--partitioned"]);
    assert_eq!(plain.status.code(), Some(0), "{}", text(&plain));
    assert_eq!(partitioned.status.code(), Some(0), "{}", text(&partitioned));
    assert_eq!(
        String::from_utf8_lossy(&plain.stdout).lines().count(),
        outbox::migrate::FILES.len()
    );
    assert_eq!(
        String::from_utf8_lossy(&partitioned.stdout).lines().count(),
        outbox::migrate::PARTITIONED_FILES.len()
    );
    assert_ne!(plain.stdout, partitioned.stdout);
}
