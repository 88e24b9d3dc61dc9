//! The invariant table (docs/internals/invariants.md) cannot drift from the checker: every
//! `Invariant` has exactly one row (by its stable name), and every row
//! names an invariant the checker states.

use std::collections::BTreeMap;
use std::path::Path;

use sim::checker::Invariant;

#[test]
fn every_invariant_has_one_row_and_every_row_an_invariant() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let table = std::fs::read_to_string(root.join("docs/internals/invariants.md")).unwrap();
    let mut rows: BTreeMap<String, usize> = BTreeMap::new();
    for line in table.lines() {
        if let Some(rest) = line.strip_prefix("| `")
            && let Some(end) = rest.find('`')
        {
            *rows.entry(rest[..end].to_owned()).or_insert(0) += 1;
        }
    }
    let names: Vec<&str> = Invariant::ALL.iter().map(|i| i.name()).collect();
    let missing: Vec<_> = names.iter().filter(|n| !rows.contains_key(**n)).collect();
    let stale: Vec<_> = rows
        .keys()
        .filter(|r| !names.contains(&r.as_str()))
        .collect();
    let twice: Vec<_> = rows
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(r, _)| r)
        .collect();
    assert!(
        missing.is_empty() && stale.is_empty() && twice.is_empty(),
        "docs/internals/invariants.md: missing {missing:?}, naming no \
         invariant {stale:?}, listed twice {twice:?}"
    );
}
