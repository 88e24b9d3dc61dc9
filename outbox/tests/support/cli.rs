//! Running a command-line tool or example the way a user does, for the
//! tests of every package that ships one (included with `#[path]`).

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// A built example of the package under test: `cargo test` builds the
/// examples beside the tests.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().and_then(|deps| deps.parent()).unwrap();
    target.join("examples").join(name)
}

/// Runs `exe` with `args`, with addresses that reach nothing.
pub fn run(exe: &PathBuf, args: &[&str]) -> Output {
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

/// The exit status and both streams, for an assertion's message.
pub fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `args` print a usage and exit 0.
pub fn assert_help(exe: &PathBuf, args: &[&str]) {
    let out = run(exe, args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Usage:"), "{args:?}: {}", text(&out));
}

/// `args` are refused with exit 2 and a message naming `names`.
pub fn assert_refused(exe: &PathBuf, args: &[&str], names: &str) {
    let out = run(exe, args);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(names),
        "{args:?} should name {names}: {}",
        text(&out)
    );
}
