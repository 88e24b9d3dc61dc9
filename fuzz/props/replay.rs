//! Replays a fuzz target's committed inputs on stable: its corpus
//! (`fuzz/corpus/TARGET`, minimized with `cargo fuzz cmin`) and the inputs
//! that once broke its property (`fuzz/regressions/TARGET`). Included by
//! the regression tests of `outbox` and `sim`.

use std::path::{Path, PathBuf};

/// Every committed input of `target`, in path order.
pub fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut out = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            if path.is_file() {
                out.push((path.clone(), std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    assert!(
        out.len() >= 5,
        "fuzz/corpus/{target} holds {} inputs: run `cargo +nightly fuzz run {target}` (fuzz/README.md)",
        out.len()
    );
    out
}

/// Runs `property` on every input of `target`, naming the input that fails.
pub fn replay(target: &str, property: impl Fn(&[u8])) {
    for (path, data) in inputs(target) {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| property(&data)));
        if let Err(panic) = run {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            panic!(
                "{target}: {} breaks its property: {message}",
                path.display()
            );
        }
    }
}
