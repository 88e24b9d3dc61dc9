//! The bug catalogue (`sim/bugs/catalogue.toml`) stays applicable: every
//! edit's `old` text is in its file exactly once, so `reintroduce.py` can
//! put each bug back. (Four edits had gone stale as the code moved before
//! this check existed.)

use std::path::Path;

#[test]
fn every_edit_of_the_bug_catalogue_applies_to_todays_source() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("sim/bugs/catalogue.toml")).unwrap();
    let catalogue: toml::Table = toml::from_str(&text).unwrap();
    let bugs = catalogue["bug"].as_array().expect("[[bug]] entries");
    assert!(bugs.len() >= 30, "only {} bugs", bugs.len());
    let mut stale = Vec::new();
    for bug in bugs {
        let name = bug["name"].as_str().unwrap();
        for edit in bug["edit"].as_array().expect("[[bug.edit]] entries") {
            let file = edit["file"].as_str().unwrap();
            let old = edit["old"].as_str().unwrap();
            let found = std::fs::read_to_string(root.join(file))
                .map(|src| src.matches(old).count())
                .unwrap_or(0);
            if found != 1 {
                stale.push(format!("{name}: {file} holds its old text {found} times"));
            }
        }
    }
    assert!(stale.is_empty(), "stale edits:\n{}", stale.join("\n"));
}
