//! Hostile messages: what a broker may deliver to a subscription besides
//! the drainer's envelopes, because any client with publish rights on the
//! exchange can send anything. The fake RabbitMQ puts them in the
//! subscription's queue at seeded moments (fault `hostile`).
//!
//! Each is survivable, and why:
//! - **not JSON**, **binary** (not even UTF-8), an envelope whose id is **not
//!   a UUID v7**: the subscriber cannot decode them; it dead-letters them at
//!   once, without touching the inbox.
//! - an envelope with an extra field holding **`\u0000`**, a **lone
//!   surrogate**, or a **number beyond `jsonb`'s range**: it decodes (serde
//!   skips unknown fields without judging them) but PostgreSQL refuses to
//!   store it (SQLSTATE class 22); the subscriber dead-letters it at once
//!   instead of retrying a statement that can never succeed.
//! - an **oversized** envelope, one byte over the subscriber's
//!   `max_body_bytes`: dead-lettered at once, before it is parsed; and
//!   one **at the limit**, exactly `max_body_bytes` long, which is taken
//!   and applied once.
//! - a valid envelope whose AMQP **`message_id` is foreign** (another UUID, a
//!   string that is no UUID, or none): it is a real event and takes effect
//!   exactly once, keyed by the envelope id, never by the `message_id`.
//! - a valid envelope with a **foreign trace context**: `traceparent` and
//!   `tracestate`, as AMQP headers and envelope headers, that are not W3C
//!   trace context (`publish_tx` would refuse them; another client need
//!   not): it takes effect once, and the context is ignored.

use rand::Rng;
use rand::rngs::SmallRng;
use uuid::Uuid;

use super::queues::QueuedMessage;
use crate::trace::HostileKind;
use crate::wire::{WireBody, WireOrdering, WireTrace};

/// One hostile message and what the checker needs to know of it.
#[derive(Debug, Clone)]
pub struct Hostile {
    pub kind: HostileKind,
    pub message: QueuedMessage,
    /// The envelope id inside, if the body holds one.
    pub envelope_id: Option<Uuid>,
}

/// Builds a hostile message of `kind`; `limit` is the subscriber's
/// `max_body_bytes`. With `ordering` it carries that key and number as
/// headers, with the key's bucket, and an envelope inside names the key
/// too, as the drainer's keyed events do.
pub fn build(
    kind: HostileKind,
    rng: &mut SmallRng,
    limit: usize,
    ordering: Option<WireOrdering>,
) -> Hostile {
    let routing_key = format!("hostile.{kind:?}").to_lowercase();
    let mut trace = None;
    let key = ordering.as_ref().map(|(k, _)| k.as_str());
    let (body, message_id, envelope_id) =
        body_of(kind, rng, (&routing_key, key), limit, &mut trace);
    let bucket = ordering.as_ref().map(|(key, seq)| {
        let o = outbox::core::ports::KeySeq {
            key: key.clone(),
            seq: *seq,
        };
        outbox::core::ports::bucket_of(Some(&o), Uuid::nil()).to_string()
    });
    Hostile {
        kind,
        message: QueuedMessage {
            message_id,
            routing_key,
            body,
            redelivered: false,
            trace,
            ordering,
            bucket,
        },
        envelope_id,
    }
}

/// A hostile message's body, `message_id` and envelope id; `trace` gets
/// the AMQP trace headers it carries (none, but for a foreign trace
/// context).
fn body_of(
    kind: HostileKind,
    rng: &mut SmallRng,
    (routing_key, key): (&str, Option<&str>),
    limit: usize,
    trace: &mut Option<WireTrace>,
) -> (WireBody, Option<String>, Option<Uuid>) {
    match kind {
        HostileKind::NotJson => (
            WireBody::Text(format!("hostile {} {{ not json", rng.random::<u32>())),
            Some(random_v4(rng).to_string()),
            None,
        ),
        HostileKind::Binary => {
            let mut bytes = vec![0xff, 0xfe, 0x00, 0x80];
            bytes.extend((0..16).map(|_| rng.random::<u8>()));
            (
                WireBody::Bytes(bytes),
                Some(random_v4(rng).to_string()),
                None,
            )
        }
        HostileKind::NotV7 => {
            let mut e = envelope(rng, (routing_key, key), 0);
            e.id = random_v4(rng);
            let body = serde_json::to_string(&e).expect("envelopes encode");
            (WireBody::Text(body), Some(e.id.to_string()), Some(e.id))
        }
        HostileKind::ForeignMessageId => {
            let e = envelope(rng, (routing_key, key), 0);
            let message_id = match rng.random_range(0..3) {
                0 => Some(random_v4(rng).to_string()),
                1 => Some(format!("not-a-uuid-{}", rng.random::<u32>())),
                _ => None,
            };
            (WireBody::Text(encode(&e)), message_id, Some(e.id))
        }
        HostileKind::ForeignTraceContext => {
            let garbage = match rng.random_range(0..3) {
                0 => "00-00000000000000000000000000000000-00f067aa0ba902b7-01".to_owned(),
                1 => format!("not-w3c-{}", rng.random::<u32>()),
                _ => "f".repeat(300),
            };
            let e = envelope(rng, (routing_key, key), 0)
                .with_header("traceparent", garbage.clone())
                .with_header("tracestate", "a=\u{1}b");
            let body = serde_json::to_string(&e).expect("envelopes encode");
            *trace = Some((garbage, Some("a=\n".to_owned())));
            (WireBody::Text(body), Some(e.id.to_string()), Some(e.id))
        }
        HostileKind::NulEscape | HostileKind::LoneSurrogate | HostileKind::NumberOutOfRange => {
            let e = envelope(rng, (routing_key, key), 0);
            let extra = match kind {
                HostileKind::NulEscape => r#""note":"\u0000""#,
                HostileKind::LoneSurrogate => r#""note":"\ud800""#,
                _ => r#""note":1e1000000"#,
            };
            let mut body = encode(&e);
            body.pop(); // the closing brace
            body.push(',');
            body.push_str(extra);
            body.push('}');
            (WireBody::Text(body), Some(e.id.to_string()), Some(e.id))
        }
        HostileKind::Oversized | HostileKind::AtTheLimit => {
            let len = if kind == HostileKind::Oversized {
                limit + 1
            } else {
                limit
            };
            let e = sized_envelope(rng, (routing_key, key), len);
            (
                WireBody::Text(encode(&e)),
                Some(e.id.to_string()),
                Some(e.id),
            )
        }
    }
}

fn random_v4(rng: &mut SmallRng) -> Uuid {
    uuid::Builder::from_random_bytes(rng.random()).into_uuid()
}

/// A valid envelope with a seeded v7 id and a payload of `pad` bytes,
/// under `routing_key` and ordering key `key` (if any).
fn envelope(
    rng: &mut SmallRng,
    (routing_key, key): (&str, Option<&str>),
    pad: usize,
) -> outbox::EventEnvelope {
    let ms = crate::sim_now_ms() + crate::workload::EPOCH_MS;
    let random: [u8; 10] = rng.random();
    outbox::EventEnvelope {
        id: uuid::Builder::from_unix_timestamp_millis(ms, &random).into_uuid(),
        routing_key: routing_key.to_owned(),
        occurred_at: time::OffsetDateTime::UNIX_EPOCH + std::time::Duration::from_millis(ms),
        headers: Default::default(),
        payload: serde_json::json!({ "hostile": true, "pad": "p".repeat(pad) }),
        ordering_key: key.map(str::to_owned),
    }
}

/// A valid envelope whose encoding is exactly `len` bytes (each padding
/// character adds one byte).
fn sized_envelope(
    rng: &mut SmallRng,
    keys: (&str, Option<&str>),
    len: usize,
) -> outbox::EventEnvelope {
    let mut e = envelope(rng, keys, 0);
    let bare = encode(&e).len();
    assert!(
        len >= bare,
        "a {len}-byte envelope is shorter than an empty one"
    );
    e.payload = serde_json::json!({ "hostile": true, "pad": "p".repeat(len - bare) });
    debug_assert_eq!(encode(&e).len(), len);
    e
}

fn encode(e: &outbox::EventEnvelope) -> String {
    let limits = outbox::envelope::EnvelopeLimits {
        max_envelope_bytes: usize::MAX,
    };
    e.encode(&limits)
        .expect("hostile envelopes are valid envelopes")
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn each_kind_is_what_it_claims_to_be() {
        let mut rng = SmallRng::seed_from_u64(1);
        for kind in HostileKind::ALL {
            let h = build(*kind, &mut rng, 2048, None);
            let bytes = h.message.body.as_bytes();
            let decoded = outbox::EventEnvelope::decode_delivery(bytes);
            let refused = std::str::from_utf8(bytes)
                .ok()
                .and_then(crate::fakes::pg::jsonb::jsonb_refusal);
            match kind {
                HostileKind::NotJson | HostileKind::Binary | HostileKind::NotV7 => {
                    assert!(decoded.is_err(), "{kind:?}")
                }
                HostileKind::NulEscape
                | HostileKind::LoneSurrogate
                | HostileKind::NumberOutOfRange => {
                    assert!(decoded.is_ok(), "{kind:?} decodes");
                    assert!(refused.is_some(), "{kind:?} is refused by jsonb");
                }
                HostileKind::ForeignMessageId => {
                    let e = decoded.expect("valid");
                    assert_eq!(Some(e.id), h.envelope_id);
                    assert_ne!(h.message.message_id, Some(e.id.to_string()));
                }
                HostileKind::Oversized => {
                    assert!(decoded.is_ok());
                    assert_eq!(bytes.len(), 2049);
                }
                HostileKind::AtTheLimit => {
                    assert!(decoded.is_ok());
                    assert_eq!(bytes.len(), 2048);
                }
                HostileKind::ForeignTraceContext => {
                    let e = decoded.expect("valid");
                    assert_eq!(Some(e.id), h.envelope_id);
                    assert_eq!(outbox::TraceContext::from_headers(&e.headers), None);
                    let (tp, ts) = h.message.trace.clone().expect("trace headers");
                    assert!(outbox::TraceContext::parse(&tp, ts.as_deref()).is_err());
                }
            }
        }
    }
}
