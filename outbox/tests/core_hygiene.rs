//! Architecture invariant: the core (`src/core/`) reaches time, randomness,
//! ids and I/O only through its ports, so the simulation runs it unchanged
//! and deterministically. This test reads the core's source and fails on any
//! forbidden name, and on any `select!` that is not `biased`. The core's
//! error types (`src/error.rs`) name no adapter either: each adapter maps its
//! own errors into them.

const FORBIDDEN: &[(&str, &str)] = &[
    ("sqlx", "the store port"),
    ("lapin", "the broker port"),
    ("tokio::time", "the Clock port"),
    ("std::time::Instant", "the Clock port"),
    ("Instant::now", "the Clock port"),
    ("SystemTime", "the Clock port"),
    ("OffsetDateTime::now", "the Clock port"),
    ("now_v7", "ids from the store"),
    ("new_v4", "ids from the store"),
    ("rand::", "the Entropy port"),
    ("getrandom", "the Entropy port"),
    ("HashMap", "an ordered map"),
    ("HashSet", "an ordered set"),
    ("thread_rng", "the Entropy port"),
    ("std::env", "configuration passed in"),
    ("tokio::spawn", "the caller spawning tasks"),
    // Arrows run one way: the core owns its settings and errors and names
    // no adapter and no configuration layer (issue 30).
    (
        "crate::config",
        "the core's own settings (config builds them)",
    ),
    ("crate::pg", "the store port"),
    ("crate::amqp", "the broker port"),
    ("crate::service", "nothing: the entry point wires the core"),
    ("crate::testing", "nothing: the test helpers drive the core"),
    ("crate::admin", "nothing: the admin layer calls the core"),
    ("crate::runtime", "nothing: the runtime spawns the core"),
];

#[path = "common/sources.rs"]
mod sources;

use sources::rust_files;

#[test]
fn the_core_names_no_clock_randomness_driver_or_unordered_map() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let files = rust_files(&dir);
    for must in [
        "mod.rs",
        "drainer/mod.rs",
        "drainer/claim.rs",
        "subscriber/apply.rs",
    ] {
        assert!(
            files.iter().any(|f| f.ends_with(must)),
            "{must} not found in {}",
            dir.display()
        );
    }
    let mut problems = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (lineno, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for (name, instead) in FORBIDDEN {
                if code.contains(name) {
                    problems.push(format!(
                        "{}:{}: `{name}` (use {instead})",
                        file.display(),
                        lineno + 1
                    ));
                }
            }
        }
        let selects = text.matches("select! {").count();
        let biased = text
            .split("select! {")
            .skip(1)
            .filter(|after| after.trim_start().starts_with("biased;"))
            .count();
        if selects != biased {
            problems.push(format!(
                "{}: {selects} select! but {biased} start with `biased;`",
                file.display()
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "core hygiene:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_core_error_types_name_no_adapter() {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/error.rs");
    let text = std::fs::read_to_string(&file).unwrap();
    let problems: Vec<String> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split("//").next().unwrap_or("");
            ["crate::pg", "crate::amqp", "crate::config", "lapin::"]
                .iter()
                .any(|adapter| code.contains(adapter))
        })
        .map(|(n, line)| format!("{}:{}: {}", file.display(), n + 1, line.trim()))
        .collect();
    assert!(
        problems.is_empty(),
        "the core's errors name an adapter (map the error in the adapter):\n{}",
        problems.join("\n")
    );
}
