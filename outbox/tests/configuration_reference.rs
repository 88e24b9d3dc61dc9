//! The configuration reference cannot drift from the code: every
//! `CANOPY_MQ_*` variable the library and its admin crate read (each a
//! string literal under `outbox/src` or `outbox-admin/src`) has exactly one row in the table of
//! `docs/configuration.md`, and every row names one it reads.

use std::collections::BTreeMap;
use std::path::Path;

/// `CANOPY_MQ_*` names quoted as string literals in `text`.
fn quoted_vars(text: &str, out: &mut BTreeMap<String, usize>) {
    for piece in text.split('"').skip(1).step_by(2) {
        // The prefix alone (`config::DEFAULT_PREFIX`) names no variable.
        let is_name = piece.starts_with("CANOPY_MQ_")
            && piece.len() > "CANOPY_MQ_".len()
            && piece
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
        if is_name {
            *out.entry(piece.to_owned()).or_insert(0) += 1;
        }
    }
}

fn sources(dir: &Path, out: &mut BTreeMap<String, usize>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            quoted_vars(&std::fs::read_to_string(&path).unwrap(), out);
        }
    }
}

/// The variables named by the reference table's rows (`| `NAME` | …`).
fn documented(text: &str) -> BTreeMap<String, usize> {
    let mut rows = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("| `CANOPY_MQ_")
            && let Some(end) = rest.find('`')
        {
            *rows
                .entry(format!("CANOPY_MQ_{}", &rest[..end]))
                .or_insert(0) += 1;
        }
    }
    rows
}

#[test]
fn every_variable_the_library_reads_has_one_row_in_the_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut read = BTreeMap::new();
    sources(&root.join("src"), &mut read);
    sources(&root.join("../outbox-admin/src"), &mut read);
    let doc = std::fs::read_to_string(root.join("../docs/configuration.md")).unwrap();
    let rows = documented(&doc);
    assert!(
        read.len() >= 20,
        "only {} variables found in the code",
        read.len()
    );
    let missing: Vec<_> = read.keys().filter(|v| !rows.contains_key(*v)).collect();
    let stale: Vec<_> = rows.keys().filter(|v| !read.contains_key(*v)).collect();
    let twice: Vec<_> = rows
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(v, _)| v)
        .collect();
    assert!(
        missing.is_empty() && stale.is_empty() && twice.is_empty(),
        "docs/configuration.md: missing {missing:?}, naming variables the code \
         does not read {stale:?}, listed twice {twice:?}"
    );
}
