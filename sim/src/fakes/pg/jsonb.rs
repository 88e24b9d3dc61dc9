//! What PostgreSQL refuses to store, as the fake must refuse it: `jsonb`
//! input and `text` with a NUL byte. Each refusal carries PostgreSQL's
//! SQLSTATE and message, and the inbox conformance suite runs the same
//! inputs against the real database (`sim/tests/conformance/inbox.rs`).
//!
//! Measured on PostgreSQL 15 (`SELECT $1::jsonb`):
//! - `\u0000` anywhere in a string or key: 22P05 "unsupported Unicode escape
//!   sequence".
//! - a lone surrogate (`\ud800` not followed by a low `\u` escape, or a low
//!   one alone), any other bad escape, a raw control character in a string,
//!   or any other deviation from the JSON grammar (`01`, `1.`, `.5`,
//!   trailing commas or text): 22P02 "invalid input syntax for type json".
//! - a number `numeric` cannot hold: more than 131 072 digits before the
//!   decimal point (the first non-zero digit at 10^131072 or beyond), more
//!   than 16 383 after it (fraction digits minus the exponent), or an
//!   exponent of 1 073 741 823 or more in magnitude: 22003 "value overflows
//!   numeric format". A number run straight into letters, digits, `_` or
//!   non-ASCII bytes is one bad token: 22P02, whatever its size; and so is
//!   an out-of-range number followed by a bad token (PostgreSQL lexes the
//!   next token before it converts a number).
//! - nesting deeper than its stack allows: 54001 "stack depth limit
//!   exceeded" (at the default `max_stack_depth` of 2 MB, past 14 543
//!   nested arrays). The fake refuses past [`DEPTH_MAX`], earlier: the
//!   boundary depends on the server's stack, and a fake may be unkinder
//!   than the real server, never kinder.

/// A refusal: PostgreSQL's SQLSTATE and message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub message: &'static str,
}

const SYNTAX: Refusal = Refusal {
    code: "22P02",
    message: "invalid input syntax for type json",
};
const NUL_ESCAPE: Refusal = Refusal {
    code: "22P05",
    message: "unsupported Unicode escape sequence",
};
const NUMERIC_OVERFLOW: Refusal = Refusal {
    code: "22003",
    message: "value overflows numeric format",
};
const STACK_DEPTH: Refusal = Refusal {
    code: "54001",
    message: "stack depth limit exceeded",
};
const NUL_BYTE: Refusal = Refusal {
    code: "22021",
    message: "invalid byte sequence for encoding \"UTF8\": 0x00",
};

/// `numeric`'s largest decimal weight: digits before the point.
const INT_DIGITS_MAX: i64 = 131_072;
/// `numeric`'s largest display scale: digits after the point.
const DSCALE_MAX: i64 = 16_383;
/// Exponents at or beyond this magnitude are refused outright (INT_MAX / 2).
const EXPONENT_LIMIT: i64 = 1_073_741_823;

/// Why PostgreSQL refuses `text` as a `text` value, if it does.
pub fn text_refusal(text: &str) -> Option<Refusal> {
    text.contains('\0').then_some(NUL_BYTE)
}

/// Why PostgreSQL refuses `text` as `jsonb` input, if it does.
pub fn jsonb_refusal(text: &str) -> Option<Refusal> {
    if text.contains('\0') {
        return Some(NUL_BYTE);
    }
    let mut p = Parser {
        b: text.as_bytes(),
        i: 0,
    };
    if let Err(r) = p.document() {
        return Some(r);
    }
    p.ws();
    (p.i != p.b.len()).then(|| p.unexpected())
}

/// The most containers the fake lets one document nest. PostgreSQL's
/// recursive parser gives up where its stack does (see the module's
/// notes); the fake's parser keeps its open containers on a heap stack, so
/// no nesting overflows the thread it runs on (a fuzzing finding, issue
/// 30: a 4 000-deep array overflowed a test thread's stack).
pub const DEPTH_MAX: usize = 10_000;

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// What PostgreSQL reports for a token the grammar does not want here:
    /// its lexer's refusal if the token does not lex (a string's `\u0000`
    /// is 22P05), else a syntax error. Its lexer reads each token before
    /// the parser judges it (found by the differential fuzz target, issue
    /// 30).
    fn unexpected(&self) -> Refusal {
        self.next_token_lexes().err().unwrap_or(SYNTAX)
    }

    fn eat(&mut self, c: u8) -> Result<(), Refusal> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.unexpected())
        }
    }

    /// One JSON value and all it holds. `open` holds the containers the
    /// parser is inside, innermost last (`{` or `[`).
    fn document(&mut self) -> Result<(), Refusal> {
        let mut open: Vec<u8> = Vec::new();
        loop {
            // A value is due.
            self.ws();
            let c = self.peek().ok_or(SYNTAX)?;
            let close = match c {
                b'{' => Some(b'}'),
                b'[' => Some(b']'),
                _ => None,
            };
            if let Some(close) = close {
                if open.len() == DEPTH_MAX {
                    return Err(STACK_DEPTH);
                }
                self.i += 1;
                self.ws();
                if self.peek() == Some(close) {
                    self.i += 1;
                } else {
                    open.push(c);
                    if c == b'{' {
                        self.member_key()?;
                    }
                    continue;
                }
            } else {
                self.scalar(c)?;
            }
            // A value ended: close the containers it ends, then go on to
            // the next value, or end.
            if !self.after_value(&mut open)? {
                return Ok(());
            }
        }
    }

    /// After a value: closes each container that ends here, up to a `,`
    /// (then another value is due: true) or the outermost (false).
    fn after_value(&mut self, open: &mut Vec<u8>) -> Result<bool, Refusal> {
        while let Some(&c) = open.last() {
            self.ws();
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    if c == b'{' {
                        self.member_key()?;
                    }
                    return Ok(true);
                }
                Some(b'}') if c == b'{' => self.i += 1,
                Some(b']') if c == b'[' => self.i += 1,
                _ => return Err(self.unexpected()),
            }
            open.pop();
        }
        Ok(false)
    }

    /// An object member's key and its colon.
    fn member_key(&mut self) -> Result<(), Refusal> {
        self.ws();
        self.string()?;
        self.ws();
        self.eat(b':')
    }

    /// A string, a number or a word, starting with `c`.
    fn scalar(&mut self, c: u8) -> Result<(), Refusal> {
        match c {
            b'"' => self.string(),
            b'-' | b'0'..=b'9' => self.number(),
            _ => self.literal(),
        }
    }

    /// A word (`true`, `false`, `null`): PostgreSQL's lexer takes the whole
    /// run of letters, digits, `_` and non-ASCII bytes as one token, so
    /// `truex` is one bad token, and a byte that starts no token is one too.
    fn literal(&mut self) -> Result<(), Refusal> {
        let start = self.i;
        while self.peek().is_some_and(word_byte) {
            self.i += 1;
        }
        match &self.b[start..self.i] {
            b"true" | b"false" | b"null" => Ok(()),
            _ => Err(SYNTAX),
        }
    }

    fn hex4(&mut self) -> Result<u32, Refusal> {
        let digits = self.b.get(self.i..self.i + 4).ok_or(SYNTAX)?;
        let text = std::str::from_utf8(digits).map_err(|_| SYNTAX)?;
        let v = u32::from_str_radix(text, 16).map_err(|_| SYNTAX)?;
        if !digits.iter().all(u8::is_ascii_hexdigit) {
            return Err(SYNTAX);
        }
        self.i += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<(), Refusal> {
        self.eat(b'"')?;
        loop {
            let c = self.peek().ok_or(SYNTAX)?;
            self.i += 1;
            match c {
                b'"' => return Ok(()),
                0..=0x1f => return Err(SYNTAX),
                b'\\' => self.escape()?,
                _ => {}
            }
        }
    }

    fn escape(&mut self) -> Result<(), Refusal> {
        let c = self.peek().ok_or(SYNTAX)?;
        self.i += 1;
        match c {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Ok(()),
            b'u' => {
                let v = self.hex4()?;
                match v {
                    0 => Err(NUL_ESCAPE),
                    0xD800..=0xDBFF => {
                        // A high surrogate must be followed by a low one.
                        if self.b.get(self.i..self.i + 2) != Some(b"\\u") {
                            return Err(SYNTAX);
                        }
                        self.i += 2;
                        let low = self.hex4()?;
                        if (0xDC00..=0xDFFF).contains(&low) {
                            Ok(())
                        } else {
                            Err(SYNTAX)
                        }
                    }
                    0xDC00..=0xDFFF => Err(SYNTAX),
                    _ => Ok(()),
                }
            }
            _ => Err(SYNTAX),
        }
    }

    /// A number: its token, then its range (see `next_token_lexes`).
    fn number(&mut self) -> Result<(), Refusal> {
        if self.number_token()? {
            return Ok(());
        }
        // PostgreSQL lexes the token after a scalar before it converts the
        // scalar: a bad token there is the syntax error it reports, not the
        // number's range (`1e1000000\u{1b}` is 22P02; found by the
        // differential fuzz target, issue 30).
        self.next_token_lexes()?;
        Err(NUMERIC_OVERFLOW)
    }

    /// Lexes a number token; whether `numeric` can hold it.
    fn number_token(&mut self) -> Result<bool, Refusal> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        let int_start = self.i;
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(SYNTAX),
        }
        let int = &self.b[int_start..self.i];
        let mut frac: &[u8] = &[];
        if self.peek() == Some(b'.') {
            self.i += 1;
            let start = self.i;
            self.digits();
            if self.i == start {
                return Err(SYNTAX);
            }
            frac = &self.b[start..self.i];
        }
        let mut exponent: i64 = 0;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            let negative = match self.peek() {
                Some(b'-') => {
                    self.i += 1;
                    true
                }
                Some(b'+') => {
                    self.i += 1;
                    false
                }
                _ => false,
            };
            let start = self.i;
            self.digits();
            if self.i == start {
                return Err(SYNTAX);
            }
            for d in &self.b[start..self.i] {
                // Saturate: anything this large is refused below.
                exponent = (exponent * 10 + i64::from(d - b'0')).min(EXPONENT_LIMIT);
            }
            if negative {
                exponent = -exponent;
            }
        }
        // PostgreSQL's lexer takes letters, digits, `_` and non-ASCII
        // bytes right after a number as part of its token, which is then no
        // number: a syntax error, before the value's range is looked at
        // (`1e1073741823x` is 22P02, not 22003; found by the differential
        // fuzz target, issue 30).
        if self.peek().is_some_and(word_byte) {
            return Err(SYNTAX);
        }
        Ok(numeric_fits(int, frac, exponent))
    }

    /// Whether the token after the current position lexes (whitespace
    /// skipped; the end of the input counts as one), as PostgreSQL's
    /// lexer reads it, without moving: a string's own refusal if it is a
    /// bad string, a syntax error for any other bad token.
    fn next_token_lexes(&self) -> Result<(), Refusal> {
        let mut ahead = Parser {
            b: self.b,
            i: self.i,
        };
        ahead.ws();
        match ahead.peek() {
            None | Some(b'{' | b'}' | b'[' | b']' | b',' | b':') => Ok(()),
            Some(b'"') => ahead.string(),
            Some(b'-' | b'0'..=b'9') => ahead.number_token().map(drop),
            Some(_) => ahead.literal(),
        }
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
    }
}

/// A byte PostgreSQL's JSON lexer reads as part of a word or a number's
/// token (`JSON_ALPHANUMERIC_CHAR`).
fn word_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80
}

/// Whether `int.frac × 10^exponent` fits PostgreSQL's `numeric`.
fn numeric_fits(int: &[u8], frac: &[u8], exponent: i64) -> bool {
    if exponent.abs() >= EXPONENT_LIMIT {
        return false;
    }
    let dscale = (frac.len() as i64 - exponent).max(0);
    if dscale > DSCALE_MAX {
        return false;
    }
    // The decimal position of the first non-zero digit (0 for the ones).
    let first_nonzero = int
        .iter()
        .position(|d| *d != b'0')
        .map(|k| int.len() as i64 - 1 - k as i64)
        .or_else(|| {
            frac.iter()
                .position(|d| *d != b'0')
                .map(|k| -(k as i64) - 1)
        });
    match first_nonzero {
        None => true, // zero
        Some(p) => p + exponent < INT_DIGITS_MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(text: &str) -> Option<&'static str> {
        jsonb_refusal(text).map(|r| r.code)
    }

    #[test]
    fn refusals_match_what_postgresql_15_said() {
        // Each line was run through `SELECT $$…$$::jsonb` on PostgreSQL 15.
        for (text, want) in [
            (r#"{"a":"\u0000"}"#, Some("22P05")),
            (r#"{"\u0000":1}"#, Some("22P05")),
            (r#"{"a":"\ud800"}"#, Some("22P02")),
            (r#"{"a":"\udc00"}"#, Some("22P02")),
            (r#"{"a":"\ud800\u0041"}"#, Some("22P02")),
            (r#"{"a":"\ud800\ud800"}"#, Some("22P02")),
            (r#"{"a":"\ud800x"}"#, Some("22P02")),
            (r#""\uD83D\uDE00""#, None),
            (r#"{"a":"\u00e9"}"#, None),
            (r#"{"a":"\x"}"#, Some("22P02")),
            ("{\"a\":\"tab\t\"}", Some("22P02")),
            (r#"{"a":1e1000000}"#, Some("22003")),
            (r#"{"a":1e131071}"#, None),
            (r#"{"a":9e131071}"#, None),
            (r#"{"a":1e131072}"#, Some("22003")),
            (r#"{"a":100e131069}"#, None),
            (r#"{"a":100e131070}"#, Some("22003")),
            (r#"{"a":0.01e131073}"#, None),
            (r#"{"a":0.01e131074}"#, Some("22003")),
            (r#"{"a":1e-16383}"#, None),
            (r#"{"a":1e-16384}"#, Some("22003")),
            (r#"{"a":1.5e-16383}"#, Some("22003")),
            (r#"{"a":0e-20000}"#, Some("22003")),
            (r#"{"a":0e99999999}"#, None),
            (r#"{"a":1e1073741822}"#, Some("22003")),
            (r#"{"a":1E+5}"#, None),
            (r#"{"a":-0}"#, None),
            (r#"{"a":01}"#, Some("22P02")),
            (r#"{"a":1.}"#, Some("22P02")),
            (r#"{"a":.5}"#, Some("22P02")),
            ("[1,]", Some("22P02")),
            (r#"{"a":1}x"#, Some("22P02")),
            (r#" {"a":1} "#, None),
            ("", Some("22P02")),
            ("not json", Some("22P02")),
            ("{\"a\":\"\0\"}", Some("22021")),
        ] {
            assert_eq!(code(text), want, "{text}");
        }
        let zeros = "0".repeat(16_384);
        assert_eq!(code(&format!("{{\"a\":1.{zeros}}}")), Some("22003"));
        assert_eq!(code(&format!("{{\"a\":1.{}}}", &zeros[1..])), None);
    }

    #[test]
    fn nesting_is_held_on_the_heap_and_refused_past_the_depth_bound() {
        let nested = |n: usize, open: &str, close: &str| open.repeat(n) + &close.repeat(n);
        // Deeper than a test thread's stack would take recursively.
        assert_eq!(code(&nested(DEPTH_MAX, "[", "]")), None);
        assert_eq!(
            code(&nested(DEPTH_MAX, "{\"a\":", "}").replace(":}", ":1}")),
            None
        );
        assert_eq!(code(&nested(DEPTH_MAX + 1, "[", "]")), Some("54001"));
        assert_eq!(code(&nested(1_000_000, "[", "]")), Some("54001"));
        // Inside, the grammar still holds.
        assert_eq!(
            code(&format!("{}1,]{}", "[".repeat(500), "]".repeat(499))),
            Some("22P02")
        );
        assert_eq!(
            code(&format!("{}{}", "[".repeat(500), "]".repeat(499))),
            Some("22P02")
        );
        assert_eq!(code("[[1,2],{\"a\":[{}]},[]]"), None);
        assert_eq!(code("{\"a\" 1}"), Some("22P02"));
        assert_eq!(code("[1 2]"), Some("22P02"));
        assert_eq!(code("{\"a\":1,}"), Some("22P02"));
    }

    #[test]
    fn text_with_a_nul_byte_is_refused() {
        assert_eq!(text_refusal("a\0b").map(|r| r.code), Some("22021"));
        assert_eq!(text_refusal("ab"), None);
    }
}
