//! Source hygiene (issue 30): no function in `outbox/src`, `outbox-admin/src`, `outbox-migrations/src`, `sim/src` or
//! `benches/src` is over 80 lines, tests aside (a `tests.rs` file, and
//! everything after a file's `#[cfg(test)]`). A function that long mixes
//! concepts; split it along them.
//!
//! The count is a brace match over the source with comments, strings and
//! character literals blanked out: from the line with `fn name` to the line
//! with the body's closing brace, both counted.

use std::path::Path;

const LIMIT: usize = 80;

#[path = "common/sources.rs"]
mod sources;

use sources::rust_files;

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `text` with every comment, string and character literal replaced by
/// spaces (newlines kept), so braces and `fn` inside them do not count.
fn code_only(text: &str) -> Vec<char> {
    let s: Vec<char> = text.chars().collect();
    let mut out = s.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for c in &mut out[from..to.min(s.len())] {
            if *c != '\n' {
                *c = ' ';
            }
        }
    };
    let mut i = 0;
    while i < s.len() {
        let after_ident = i > 0 && is_ident(s[i - 1]);
        let end = if s[i..].starts_with(&['/', '/']) {
            s[i..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(s.len(), |p| i + p)
        } else if s[i..].starts_with(&['/', '*']) {
            block_comment_end(&s, i)
        } else if !after_ident && let Some(end) = raw_string_end(&s, i) {
            end
        } else if s[i] == '"' {
            string_end(&s, i + 1)
        } else if s[i] == '\'' {
            char_literal_end(&s, i).unwrap_or(i + 1)
        } else {
            i += 1;
            continue;
        };
        blank(&mut out, i, end);
        i = end;
    }
    out
}

fn block_comment_end(s: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < s.len() {
        if s[i..].starts_with(&['/', '*']) {
            depth += 1;
            i += 2;
        } else if s[i..].starts_with(&['*', '/']) {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    s.len()
}

/// The end of a raw string (`r"…"`, `r#"…"#`, `br"…"`) starting at `i`.
fn raw_string_end(s: &[char], i: usize) -> Option<usize> {
    let mut j = i;
    if s.get(j) == Some(&'b') {
        j += 1;
    }
    if s.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = s[j..].iter().take_while(|&&c| c == '#').count();
    j += hashes;
    if s.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < s.len() {
        if s[j] == '"'
            && s[j + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == '#')
                .count()
                == hashes
        {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(s.len())
}

fn string_end(s: &[char], mut j: usize) -> usize {
    while j < s.len() {
        match s[j] {
            '\\' => j += 2,
            '"' => return j + 1,
            _ => j += 1,
        }
    }
    s.len()
}

/// The end of a character literal at `i`, or `None` for a lifetime.
fn char_literal_end(s: &[char], i: usize) -> Option<usize> {
    if s.get(i + 1) == Some(&'\\') {
        let close = s[i + 2..].iter().position(|&c| c == '\'')?;
        return Some(i + 2 + close + 1);
    }
    (s.get(i + 2) == Some(&'\'')).then_some(i + 3)
}

/// `(name, first line, lines)` of every function with a body in `code`.
fn functions(code: &[char]) -> Vec<(String, usize, usize)> {
    let line_of = |at: usize| code[..at].iter().filter(|&&c| c == '\n').count() + 1;
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < code.len() {
        let keyword = code[i..].starts_with(&['f', 'n'])
            && (i == 0 || !is_ident(code[i - 1]))
            && code[i + 2].is_whitespace();
        if !keyword {
            i += 1;
            continue;
        }
        let name_at = i
            + 2
            + code[i + 2..]
                .iter()
                .take_while(|c| c.is_whitespace())
                .count();
        let name: String = code[name_at..]
            .iter()
            .take_while(|&&c| is_ident(c))
            .collect();
        let body = code[name_at..]
            .iter()
            .position(|&c| c == '{' || c == ';')
            .map(|p| name_at + p);
        if let (false, Some(open)) = (name.is_empty(), body)
            && code[open] == '{'
            && let Some(close) = matching_brace(code, open)
        {
            found.push((name, line_of(i), line_of(close) - line_of(i) + 1));
        }
        i = name_at.max(i + 2);
    }
    found
}

fn matching_brace(code: &[char], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, &c) in code.iter().enumerate().skip(open) {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// The part of a file that is not test code.
fn non_test_part(text: &str) -> &str {
    text.find("\n#[cfg(test)]").map_or(text, |at| &text[..at])
}

#[test]
fn no_function_is_over_80_lines() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut long = Vec::new();
    let mut counted = 0;
    for root in [
        "outbox/src",
        "outbox-admin/src",
        "outbox-migrations/src",
        "sim/src",
        "benches/src",
    ] {
        let dir = workspace.join(root);
        assert!(dir.is_dir(), "{} not found", dir.display());
        for file in rust_files(&dir) {
            if file.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (name, line, lines) in functions(&code_only(non_test_part(&text))) {
                counted += 1;
                if lines > LIMIT {
                    let path = file.strip_prefix(&workspace).unwrap_or(&file);
                    long.push(format!("{lines:4} lines: {}:{line} {name}", path.display()));
                }
            }
        }
    }
    assert!(
        counted > 500,
        "only {counted} functions found: the scan is broken"
    );
    long.sort();
    assert!(
        long.is_empty(),
        "{} functions over {LIMIT} lines (split each along the concepts it mixes):\n{}",
        long.len(),
        long.join("\n")
    );
}

/// The scanner itself: what it must and must not count.
#[test]
fn the_scanner_counts_bodies_not_braces_in_text() {
    let src = r#####"
fn short() {
    let s = "{ not a brace";
    let c = '{';
    let r = r#"} nor this"#;
    // fn commented() { }
    /* { */
}

trait T {
    fn declared(&self);
    fn with_default<'a>(&'a self) -> &'a str {
        "}"
    }
}

fn three(
) {
}
"#####;
    let found = functions(&code_only(src));
    let names: Vec<(&str, usize, usize)> =
        found.iter().map(|(n, l, c)| (n.as_str(), *l, *c)).collect();
    assert_eq!(
        names,
        [("short", 2, 7), ("with_default", 12, 3), ("three", 17, 3)]
    );
}
