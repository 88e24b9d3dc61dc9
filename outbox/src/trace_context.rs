//! W3C trace context carried through the outbox, without OpenTelemetry.
//!
//! A trace context travels with an event as two envelope headers,
//! [`TRACEPARENT`] and [`TRACESTATE`], stored with the row. The drainer sets
//! them as AMQP message headers of the same names (so any instrumented
//! consumer, in any language, continues the trace), and the subscriber reads
//! them back from the delivery (or, failing that, from the envelope).
//!
//! With the `otel` feature, [`crate::Publisher::publish_tx`] fills them in
//! from the current span; without it, a context the caller put in the
//! headers is carried all the same. A `traceparent` header that is not a
//! valid W3C `traceparent` is refused at `publish_tx`
//! ([`crate::PublishError::InvalidTraceContext`]).
//!
//! ```
//! use outbox::trace_context::TraceContext;
//! let tc = TraceContext::parse(
//!     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
//!     Some("congo=t61rcWkgMzE"),
//! )
//! .unwrap();
//! assert_eq!(tc.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
//! assert!(TraceContext::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None).is_err());
//! ```

use std::collections::BTreeMap;

/// Header (envelope and AMQP) holding the W3C `traceparent`.
pub const TRACEPARENT: &str = "traceparent";
/// Header (envelope and AMQP) holding the W3C `tracestate`.
pub const TRACESTATE: &str = "tracestate";
/// Longest `tracestate` carried (the W3C limit is 32 members; 512
/// characters is the length every propagator must accept).
pub const TRACESTATE_MAX_BYTES: usize = 512;

/// A validated W3C trace context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

impl TraceContext {
    /// Validates a `traceparent` (and optional `tracestate`): version `00`
    /// exactly 55 characters, a later version at least that with a `-`
    /// after the flags; lowercase hex; trace id and parent id not all
    /// zeros; version not `ff`. A `tracestate` must be printable ASCII; one
    /// longer than [`TRACESTATE_MAX_BYTES`] is cut down as W3C Trace
    /// Context says a propagator may (its list members over 128 characters
    /// go first, then members from the end, until it fits), never refused;
    /// an empty one is dropped.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Result<Self, String> {
        check_traceparent(traceparent)?;
        let tracestate = match tracestate.map(|s| s.trim_matches([' ', '\t'])) {
            None | Some("") => None,
            Some(s) if !s.bytes().all(|b| (0x20..0x7f).contains(&b)) => {
                return Err("tracestate holds a character outside printable ASCII".into());
            }
            Some(s) if s.len() > TRACESTATE_MAX_BYTES => truncated(s),
            Some(s) => Some(s.to_owned()),
        };
        Ok(Self {
            traceparent: traceparent.to_owned(),
            tracestate,
        })
    }

    /// The context in an envelope's headers, if there is a valid one.
    pub fn from_headers(headers: &BTreeMap<String, String>) -> Option<Self> {
        let traceparent = headers.get(TRACEPARENT)?;
        Self::parse(traceparent, headers.get(TRACESTATE).map(String::as_str)).ok()
    }

    /// The `traceparent` value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The 32-hex-digit trace id.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The 16-hex-digit id of the span that wrote the event.
    pub fn parent_id(&self) -> &str {
        &self.traceparent[36..52]
    }
}

/// Longest list member kept first when a `tracestate` is cut down.
const TRACESTATE_MEMBER_LONG: usize = 128;

/// `tracestate` cut down to [`TRACESTATE_MAX_BYTES`] by the W3C rule:
/// members over 128 characters removed first, then members from the end.
fn truncated(tracestate: &str) -> Option<String> {
    let mut members: Vec<&str> = tracestate
        .split(',')
        .map(|m| m.trim_matches([' ', '\t']))
        .filter(|m| !m.is_empty())
        .collect();
    let len = |m: &[&str]| m.iter().map(|s| s.len()).sum::<usize>() + m.len().saturating_sub(1);
    while len(&members) > TRACESTATE_MAX_BYTES {
        match members
            .iter()
            .rposition(|m| m.len() > TRACESTATE_MEMBER_LONG)
        {
            Some(long) => members.remove(long),
            None => members.pop().unwrap_or_default(),
        };
    }
    (!members.is_empty()).then(|| members.join(","))
}

fn check_traceparent(s: &str) -> Result<(), String> {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    let zeros = |r: std::ops::Range<usize>| b[r].iter().all(|&c| c == b'0');
    let bad = |why: &str| Err(format!("traceparent is not W3C trace context: {why}"));
    if b.len() < 55 || !s.is_ascii() {
        return bad("too short or not ASCII");
    }
    if !hex(0..2) || &b[0..2] == b"ff" {
        return bad("invalid version");
    }
    if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return bad("misplaced separators");
    }
    if !hex(3..35) || zeros(3..35) {
        return bad("invalid trace id");
    }
    if !hex(36..52) || zeros(36..52) {
        return bad("invalid parent id");
    }
    if !hex(53..55) {
        return bad("invalid flags");
    }
    match (&b[0..2], b.len()) {
        (b"00", 55) => Ok(()),
        (b"00", _) => bad("version 00 is exactly 55 characters"),
        (_, 55) => Ok(()),
        (_, _) if b[55] == b'-' => Ok(()),
        _ => bad("trailing data without a separator"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn accepts_the_spec_example_and_reads_its_ids() {
        let tc = TraceContext::parse(TP, Some(" ")).unwrap();
        assert_eq!(tc.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tc.parent_id(), "00f067aa0ba902b7");
        assert_eq!(tc.tracestate(), None);
    }

    #[test]
    fn a_long_tracestate_is_cut_down_as_the_spec_says_never_refused() {
        // 40 members of 14 characters (599 bytes in all): members go from
        // the end until it fits (issue 25: it was refused, and the whole
        // context with it).
        let members: Vec<String> = (0..40).map(|i| format!("vendor{i:02}=value")).collect();
        let long = members.join(",");
        let tc = TraceContext::parse(TP, Some(&long)).unwrap();
        let kept = tc.tracestate().unwrap();
        assert!(kept.len() <= TRACESTATE_MAX_BYTES);
        assert!(long.starts_with(kept), "the first members are kept: {kept}");
        assert_eq!(kept.split(',').count(), 34);
        // A member over 128 characters goes first, wherever it is.
        let big = format!("big={}", "x".repeat(200));
        let with_big = format!("first=1,{big},{}", members[..25].join(","));
        let kept = TraceContext::parse(TP, Some(&with_big))
            .unwrap()
            .tracestate()
            .unwrap()
            .to_owned();
        assert!(!kept.contains("big="));
        assert!(kept.starts_with("first=1,vendor00=value"));
        // One member alone too long: no tracestate, the parent stays.
        let alone = format!("a={}", "b".repeat(600));
        assert_eq!(
            TraceContext::parse(TP, Some(&alone)).unwrap().tracestate(),
            None
        );
    }

    #[test]
    fn refuses_what_the_spec_refuses() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0é",
        ] {
            assert!(TraceContext::parse(bad, None).is_err(), "{bad:?}");
        }
        assert!(TraceContext::parse(TP, Some("a=\u{e9}")).is_err());
        assert!(TraceContext::parse(TP, Some("a=\n")).is_err());
        let later = format!("{}-more", TP.replacen("00", "01", 1));
        assert!(TraceContext::parse(&later, None).is_ok());
    }
}
