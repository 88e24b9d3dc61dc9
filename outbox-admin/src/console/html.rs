//! HTML for the console: escaping, the page frame, small building blocks.
//! Every value that reaches a page goes through [`esc`] (payloads, routing
//! keys and errors are hostile input); nothing is fetched from outside the
//! service and no script runs.

use std::fmt::Write as _;

/// `s` escaped for HTML text and attribute values (double- or
/// single-quoted).
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `bytes` as text for a page: invalid UTF-8 replaced (U+FFFD), escaped.
pub fn esc_bytes(bytes: &[u8]) -> String {
    esc(&String::from_utf8_lossy(bytes))
}

/// `s` percent-encoded for a query string or a path segment.
pub fn url(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// The stylesheet, served at `/admin/console.css`.
pub const CSS: &str = "\
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}\
header{background:#1b1f24;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}\
header a{color:#fff}header form{margin-left:auto}\
main{padding:16px}table{border-collapse:collapse;background:#fff;width:100%}\
td,th{border:1px solid #d0d4da;padding:4px 6px;text-align:left;vertical-align:top}\
th{background:#eceef2}pre{white-space:pre-wrap;word-break:break-all;background:#fff;padding:8px;border:1px solid #d0d4da}\
.bad{color:#a40000}.ok{color:#0a6b00}.filters input{width:12em}fieldset{margin:8px 0}\
.note{color:#555}";

/// A whole page: the frame with navigation (and a logout button carrying
/// `csrf` when signed in), `title` and `body` (already HTML).
pub fn page(title: &str, csrf: Option<&str>, refresh_secs: Option<u32>, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 1024);
    out.push_str("<!doctype html><html lang=en><head><meta charset=utf-8>");
    if let Some(secs) = refresh_secs {
        let _ = write!(out, "<meta http-equiv=refresh content={secs}>");
    }
    let _ = write!(
        out,
        "<title>{} · outbox console</title><link rel=stylesheet href=/admin/console.css></head><body><header><strong>outbox console</strong>",
        esc(title)
    );
    if let Some(csrf) = csrf {
        let _ = write!(
            out,
            "<a href=/admin>overview</a><a href=/admin/parked>parked</a><a href=/admin/dead>dead-lettered</a>\
             <form method=post action=/admin/logout>{}<button>sign out</button></form>",
            hidden("csrf", csrf)
        );
    }
    let _ = write!(
        out,
        "</header><main><h1>{}</h1>{body}</main></body></html>",
        esc(title)
    );
    out
}

/// A hidden form field.
pub fn hidden(name: &str, value: &str) -> String {
    format!(
        "<input type=hidden name=\"{}\" value=\"{}\">",
        esc(name),
        esc(value)
    )
}

/// A text input with a label.
pub fn input(label: &str, name: &str, value: &str, placeholder: &str) -> String {
    format!(
        "<label>{} <input name=\"{}\" value=\"{}\" placeholder=\"{}\"></label> ",
        esc(label),
        esc(name),
        esc(value),
        esc(placeholder)
    )
}

/// A table: `head` cells and rows of cells (each already HTML).
pub fn table(head: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = String::from("<table><thead><tr>");
    for h in head {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            let _ = write!(out, "<td>{cell}</td>");
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_covers_text_and_both_quotes() {
        assert_eq!(
            esc(r#"<script>alert("x")</script> & 'y'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
        assert_eq!(esc_bytes(b"a\xffb<"), "a\u{fffd}b&lt;");
        assert_eq!(url("a b&c=d/é"), "a+b%26c%3Dd%2F%C3%A9");
    }
}
