//! `outbox-migrations` as a new user tries it: `--help` on every
//! subcommand prints its usage and exits 0; a wrong argument is named and
//! exits 2; `list` lists both layouts' files.

#[path = "../../outbox/tests/support/cli.rs"]
mod cli;

use std::path::PathBuf;

use cli::{assert_help, assert_refused, run, text};

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
