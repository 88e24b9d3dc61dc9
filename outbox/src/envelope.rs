//! The event envelope: what a service writes into the outbox, what the drainer
//! publishes as the AMQP body, and what a consumer's inbox is keyed by.
//!
//! The envelope's `id` is a UUID v7. It is the `event_outbox` row id, the AMQP
//! `message_id` of every publish of that row (first publish and republishes
//! alike), and the consumer inbox key, so a duplicate is recognisable
//! end to end.
//!
//! The canonical outbox schema (ADR-018) has one `payload JSONB` column: it
//! holds the whole encoded envelope (id, routing key, occurred-at, headers and
//! the caller's payload), which is exactly the body the drainer publishes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::PublishError;
use crate::trace_context::{TRACEPARENT, TRACESTATE, TraceContext};

/// AMQP `shortstr` limit: routing keys and header names longer than this
/// cannot be sent on the wire.
pub const ROUTING_KEY_MAX_BYTES: usize = 255;

/// Default upper bound on an encoded envelope, in bytes (see
/// [`EnvelopeLimits`]).
pub const DEFAULT_MAX_ENVELOPE_BYTES: usize = 256 * 1024;

/// One event, as written to the outbox and published to the broker.
///
/// ```
/// use outbox::EventEnvelope;
/// let env = EventEnvelope::new("snap.case.determined", serde_json::json!({"case": 42}))
///     .with_header("tenant", "ny");
/// assert_eq!(env.id.get_version_num(), 7);
/// env.validate(&outbox::envelope::EnvelopeLimits::default()).unwrap();
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventEnvelope {
    /// UUID v7: outbox row id, AMQP `message_id` and inbox key.
    pub id: Uuid,
    /// Topic-exchange routing key; 1 to 255 bytes.
    pub routing_key: String,
    /// When the domain fact happened (not when it was published).
    #[serde(with = "time::serde::rfc3339")]
    pub occurred_at: OffsetDateTime,
    /// Free-form metadata (tenant, trace id, schema version, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The event body proper.
    pub payload: serde_json::Value,
    /// The ordering key, if the event has one (see
    /// [`with_ordering_key`](Self::with_ordering_key)); absent from the
    /// encoded envelope when unset, so unkeyed envelopes are as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordering_key: Option<String>,
}

/// [`EventEnvelope`] borrowed, serialized exactly as it is (field order,
/// formats and the empty-headers rule are the same).
#[derive(Serialize)]
struct EnvelopeView<'a> {
    id: Uuid,
    routing_key: &'a str,
    #[serde(with = "time::serde::rfc3339")]
    occurred_at: OffsetDateTime,
    #[serde(skip_serializing_if = "no_headers")]
    headers: &'a BTreeMap<String, String>,
    payload: &'a serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    ordering_key: Option<&'a str>,
}

fn no_headers(headers: &&BTreeMap<String, String>) -> bool {
    headers.is_empty()
}

impl EventEnvelope {
    /// A new envelope with a fresh UUID v7 and `occurred_at` = now (UTC).
    pub fn new(routing_key: impl Into<String>, payload: serde_json::Value) -> Self {
        Self {
            id: Uuid::now_v7(),
            routing_key: routing_key.into(),
            occurred_at: OffsetDateTime::now_utc(),
            headers: BTreeMap::new(),
            payload,
            ordering_key: None,
        }
    }

    /// Gives the event an ordering key: `publish_tx` numbers the events of
    /// one key in the order their transactions commit (a second transaction
    /// writing the same key waits at its write until the first has
    /// committed or rolled back). The key is 1 to
    /// [`ORDERING_KEY_MAX_BYTES`] bytes without NUL; a bad key is refused at
    /// `publish_tx` with [`PublishError::InvalidOrderingKey`].
    ///
    /// Issue 27 in progress: the commit order is recorded (`key_seq`); the
    /// drainer and the subscriber do not yet hold to it.
    ///
    /// ```
    /// use outbox::EventEnvelope;
    /// let env = EventEnvelope::new("orders.paid", serde_json::json!({"order": 7}))
    ///     .with_ordering_key("order-7");
    /// assert_eq!(env.ordering_key.as_deref(), Some("order-7"));
    /// env.validate(&outbox::envelope::EnvelopeLimits::default()).unwrap();
    /// assert!(EventEnvelope::new("orders.paid", serde_json::json!({}))
    ///     .with_ordering_key("")
    ///     .validate(&outbox::envelope::EnvelopeLimits::default())
    ///     .is_err());
    /// ```
    #[must_use]
    pub fn with_ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Adds (or replaces) one header.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Checks everything [`crate::Publisher`] checks before writing, and
    /// returns the encoded body on success.
    pub fn validate(&self, limits: &EnvelopeLimits) -> Result<(), PublishError> {
        self.encode(limits).map(drop)
    }

    /// Validates and encodes the envelope as the JSON body that is stored and
    /// published.
    pub fn encode(&self, limits: &EnvelopeLimits) -> Result<String, PublishError> {
        self.encode_traced(limits, None)
    }

    /// [`encode`](Self::encode), adding `trace` as the `traceparent` and
    /// `tracestate` headers unless the envelope already has a
    /// `traceparent` (the caller's context wins). A `traceparent` header
    /// must be valid W3C trace context.
    pub(crate) fn encode_traced(
        &self,
        limits: &EnvelopeLimits,
        trace: Option<&TraceContext>,
    ) -> Result<String, PublishError> {
        self.check_contents()?;
        if let Some(tp) = self.headers.get(TRACEPARENT) {
            TraceContext::parse(tp, self.headers.get(TRACESTATE).map(String::as_str))
                .map_err(|reason| PublishError::InvalidTraceContext { reason })?;
        }
        let encoded = match trace {
            Some(tc) if !self.headers.contains_key(TRACEPARENT) => {
                let mut headers = self.headers.clone();
                headers.insert(TRACEPARENT.to_owned(), tc.traceparent().to_owned());
                headers.remove(TRACESTATE);
                if let Some(ts) = tc.tracestate() {
                    headers.insert(TRACESTATE.to_owned(), ts.to_owned());
                }
                serde_json::to_string(&EnvelopeView {
                    id: self.id,
                    routing_key: &self.routing_key,
                    occurred_at: self.occurred_at,
                    headers: &headers,
                    payload: &self.payload,
                    ordering_key: self.ordering_key.as_deref(),
                })
            }
            // The common path serializes the envelope itself (measured:
            // through the borrowed view it was 15-20 % slower).
            _ => serde_json::to_string(self),
        };
        let body = encoded.map_err(|e| PublishError::Encode(e.to_string()))?;
        if body.len() > limits.max_envelope_bytes {
            return Err(PublishError::PayloadTooLarge {
                bytes: body.len(),
                limit: limits.max_envelope_bytes,
            });
        }
        Ok(body)
    }

    /// Everything [`encode`](Self::encode) checks except the size: a v7 id,
    /// a valid routing key and header names, no NUL character anywhere.
    fn check_contents(&self) -> Result<(), PublishError> {
        let version = self.id.get_version_num();
        if version != 7 {
            return Err(PublishError::IdNotV7 {
                id: self.id,
                version,
            });
        }
        validate_routing_key(&self.routing_key)?;
        if let Some(key) = &self.ordering_key {
            validate_ordering_key(key)?;
        }
        for (name, value) in &self.headers {
            if name.is_empty() || name.len() > ROUTING_KEY_MAX_BYTES {
                return Err(PublishError::InvalidHeaderName {
                    name: truncate_for_error(name),
                });
            }
            if name.contains('\0') || value.contains('\0') {
                return Err(PublishError::NulCharacter {
                    location: format!("header {}", truncate_for_error(name)),
                });
            }
        }
        if let Some(path) = nul_path(&self.payload, "payload") {
            return Err(PublishError::NulCharacter { location: path });
        }
        Ok(())
    }

    /// Decodes a published body back into an envelope.
    pub fn decode(body: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }

    /// Decodes a delivered body and checks what the inbox needs of it: a v7
    /// id, a valid routing key, no NUL characters (PostgreSQL refuses them).
    /// Size is not limited here: the broker already accepted the message.
    /// The error says why, for the dead-letter log line.
    ///
    /// The reason is at most [`REASON_MAX_CHARS`] characters, whatever the
    /// body (it is logged).
    pub fn decode_delivery(body: &[u8]) -> Result<Self, String> {
        let bounded = |s: String| crate::core::truncate_chars(&s, REASON_MAX_CHARS);
        let envelope = Self::decode(body).map_err(|e| bounded(format!("not an envelope: {e}")))?;
        envelope
            .check_contents()
            .map_err(|e| bounded(format!("invalid envelope: {e}")))?;
        Ok(envelope)
    }
}

/// Checks a routing key: non-empty, at most 255 bytes, no NUL.
pub fn validate_routing_key(routing_key: &str) -> Result<(), PublishError> {
    if routing_key.is_empty() {
        return Err(PublishError::EmptyRoutingKey);
    }
    if routing_key.len() > ROUTING_KEY_MAX_BYTES {
        return Err(PublishError::RoutingKeyTooLong {
            bytes: routing_key.len(),
        });
    }
    if routing_key.contains('\0') {
        return Err(PublishError::NulCharacter {
            location: "routing_key".into(),
        });
    }
    Ok(())
}

/// Longest ordering key, in bytes.
pub const ORDERING_KEY_MAX_BYTES: usize = 255;

/// Checks an ordering key: non-empty, at most [`ORDERING_KEY_MAX_BYTES`]
/// bytes, no NUL (PostgreSQL `text` refuses it).
pub fn validate_ordering_key(key: &str) -> Result<(), PublishError> {
    let reason = if key.is_empty() {
        "it is empty".to_owned()
    } else if key.len() > ORDERING_KEY_MAX_BYTES {
        format!(
            "it is {} bytes long; the limit is {ORDERING_KEY_MAX_BYTES}",
            key.len()
        )
    } else if key.contains('\0') {
        "it contains a NUL character, which PostgreSQL cannot store".to_owned()
    } else {
        return Ok(());
    };
    Err(PublishError::InvalidOrderingKey { reason })
}

/// Limits enforced on every envelope before it is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeLimits {
    /// Largest encoded envelope accepted, in bytes. Large bodies slow every
    /// claim and publish of the batch they sit in; RabbitMQ's own limit is far
    /// higher, so this is a guard against accidents, not a broker constraint.
    pub max_envelope_bytes: usize,
}

impl Default for EnvelopeLimits {
    fn default() -> Self {
        Self {
            max_envelope_bytes: DEFAULT_MAX_ENVELOPE_BYTES,
        }
    }
}

/// Longest reason [`EventEnvelope::decode_delivery`] gives.
pub const REASON_MAX_CHARS: usize = 512;
/// Longest path to a NUL that an error names (keys can be long).
const NUL_PATH_MAX_CHARS: usize = 200;

/// One step of the path to a NUL.
enum Step<'a> {
    Index(usize),
    Key(&'a str),
}

/// PostgreSQL `jsonb` refuses `\u0000` inside strings, so a NUL anywhere would
/// fail the caller's transaction at INSERT time with an obscure error. Names
/// where the first one is, under `root`, in at most [`NUL_PATH_MAX_CHARS`]
/// characters (escaped: a key cannot forge a log line). The walk keeps only
/// the steps of the path it returns, so a deep or wide payload costs no
/// memory beyond its depth.
fn nul_path(value: &serde_json::Value, root: &str) -> Option<String> {
    let mut steps = Vec::new();
    let in_key = find_nul(value, &mut steps)?;
    let mut path = String::from(root);
    let mut room = NUL_PATH_MAX_CHARS;
    let mut push = |path: &mut String, text: &str| {
        for c in text.chars().flat_map(char::escape_debug) {
            if room == 0 {
                return false;
            }
            path.push(c);
            room -= 1;
        }
        true
    };
    for step in steps.iter().rev() {
        let fits = match step {
            Step::Index(i) => push(&mut path, &format!("[{i}]")),
            Step::Key(k) => push(&mut path, ".") && push(&mut path, k),
        };
        if !fits {
            path.push('…');
            break;
        }
    }
    if in_key {
        path.push_str(" (a key)");
    }
    Some(path)
}

/// Whether `value` holds a NUL: `Some(true)` in a key, `Some(false)` in a
/// string; `steps` gets the path to it, innermost first.
fn find_nul<'a>(value: &'a serde_json::Value, steps: &mut Vec<Step<'a>>) -> Option<bool> {
    match value {
        serde_json::Value::String(s) => s.contains('\0').then_some(false),
        serde_json::Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| {
            let in_key = find_nul(v, steps)?;
            steps.push(Step::Index(i));
            Some(in_key)
        }),
        serde_json::Value::Object(map) => map.iter().find_map(|(k, v)| {
            if k.contains('\0') {
                return Some(true);
            }
            let in_key = find_nul(v, steps)?;
            steps.push(Step::Key(k));
            Some(in_key)
        }),
        _ => None,
    }
}

fn truncate_for_error(s: &str) -> String {
    const MAX: usize = 64;
    if s.len() <= MAX {
        return format!("{s:?}");
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &s[..end], s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn env() -> EventEnvelope {
        EventEnvelope::new("k.v", serde_json::json!({"a": [1, "x"]})).with_header("tenant", "ny")
    }

    #[test]
    fn the_borrowed_encoding_is_the_envelopes_own() {
        for e in [env(), EventEnvelope::new("k", serde_json::json!(null))] {
            let body = e.encode(&EnvelopeLimits::default()).unwrap();
            assert_eq!(body, serde_json::to_string(&e).unwrap());
            assert_eq!(EventEnvelope::decode(body.as_bytes()).unwrap(), e);
        }
    }

    #[test]
    fn a_captured_context_is_added_unless_the_caller_set_one() {
        let captured = TraceContext::parse(TP, Some("a=b")).unwrap();
        let limits = EnvelopeLimits::default();
        let body = env().encode_traced(&limits, Some(&captured)).unwrap();
        let back = EventEnvelope::decode(body.as_bytes()).unwrap();
        assert_eq!(
            TraceContext::from_headers(&back.headers),
            Some(captured.clone())
        );
        assert_eq!(back.headers["tenant"], "ny");

        let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let mine = env().with_header(TRACEPARENT, own);
        let body = mine.encode_traced(&limits, Some(&captured)).unwrap();
        let back = EventEnvelope::decode(body.as_bytes()).unwrap();
        assert_eq!(back.headers[TRACEPARENT], own);
        assert!(!back.headers.contains_key(TRACESTATE));
    }

    #[test]
    fn an_invalid_traceparent_header_is_refused_but_decodes_on_delivery() {
        let bad = env().with_header(TRACEPARENT, "not-a-context");
        assert!(matches!(
            bad.encode(&EnvelopeLimits::default()),
            Err(PublishError::InvalidTraceContext { .. })
        ));
        // A consumer takes what a foreign producer sent: the event is still
        // an event, only its context is ignored.
        let body = serde_json::to_vec(&bad).unwrap();
        assert!(EventEnvelope::decode_delivery(&body).is_ok());
    }
}
