//! The documentation's relative links lead somewhere: every `](path)` and
//! `](path#anchor)` in README.md, ARCHITECTURE.md, CHANGELOG.md,
//! CONTRIBUTING.md, each crate's README and the
//! pages under `docs/` names a file of the repository, and an anchor names
//! a heading of that page (GitHub's slugs: lower case, spaces to hyphens,
//! punctuation dropped).

use std::path::{Path, PathBuf};

fn pages(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "CHANGELOG.md",
        "CONTRIBUTING.md",
        "outbox/README.md",
        "outbox-admin/README.md",
        "outbox-migrations/README.md",
    ]
    .iter()
    .map(|p| root.join(p))
    .collect();
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The targets of `[text](target)` links, code spans and blocks left out.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let unquoted: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = unquoted.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_owned());
                rest = &rest[end..];
            }
        }
    }
    out
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(slug(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn every_relative_link_of_the_docs_leads_somewhere() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut broken = Vec::new();
    let pages = pages(&root);
    assert!(pages.len() >= 10, "only {} pages", pages.len());
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for target in links(&text) {
            if target.starts_with("http") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            let name = page.strip_prefix(&root).unwrap().display().to_string();
            if !file.exists() {
                broken.push(format!("{name}: {target} (no such file)"));
                continue;
            }
            let is_page = file.extension().is_some_and(|e| e == "md");
            if !anchor.is_empty() && is_page {
                let text = std::fs::read_to_string(&file).unwrap();
                if !anchors(&text).iter().any(|a| a == anchor) {
                    broken.push(format!("{name}: {target} (no such heading)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_stays_short() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines: the guide under docs/ is where the rest goes"
    );
}

#[test]
fn slugs_follow_github() {
    assert_eq!(slug(" Admin HTTP surface"), "admin-http-surface");
    assert_eq!(slug(" Bad input, end to end"), "bad-input-end-to-end");
    assert_eq!(
        links("see [a](b.md#c) and `[x](y)`\n```\n[p](q)\n```"),
        ["b.md#c"]
    );
}
