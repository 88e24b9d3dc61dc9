//! The properties of the library's parsers of outside bytes, one function
//! per fuzz target, each given the fuzzer's bytes. The targets
//! (`fuzz/fuzz_targets/`) call them under libFuzzer on nightly;
//! `outbox/tests/fuzz_regressions.rs` calls them on stable over every
//! committed corpus and crash input, so a finding stays fixed. A property
//! fails by panicking.

use std::collections::BTreeMap;

use outbox::config::vars;
use outbox::envelope::{EnvelopeLimits, EventEnvelope, REASON_MAX_CHARS, validate_routing_key};
use outbox::{ConfigError, TraceContext};

/// Splits `data` at 0xFF bytes (never part of UTF-8) into at most `n`
/// fields, each turned into text lossily.
fn fields(data: &[u8], n: usize) -> Vec<String> {
    data.splitn(n, |b| *b == 0xFF)
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect()
}

/// `decode_delivery` on any body: never panics, a refusal's reason is
/// bounded (it is logged), and what it accepts is what the inbox needs (a
/// v7 id, a valid routing key, no NUL) and decodes to itself once stored.
pub fn delivery(data: &[u8]) {
    match EventEnvelope::decode_delivery(data) {
        Err(reason) => assert!(
            reason.chars().count() <= REASON_MAX_CHARS,
            "an unbounded reason: {} chars",
            reason.chars().count()
        ),
        Ok(envelope) => {
            assert_eq!(envelope.id.get_version_num(), 7, "{envelope:?}");
            validate_routing_key(&envelope.routing_key).expect("an accepted routing key");
            assert!(!envelope.routing_key.contains('\0'));
            let stored = serde_json::to_vec(&envelope).expect("an accepted envelope encodes");
            let again = EventEnvelope::decode_delivery(&stored).expect("and decodes again");
            assert_eq!(again, envelope);
        }
    }
}

/// An envelope made of any routing key, payload text, header and ordering
/// key: `validate` never panics, and an envelope `publish_tx` would accept
/// is never one the subscriber dead-letters as undecodable.
pub fn envelope(data: &[u8]) {
    let f = fields(data, 5);
    let get = |i: usize| f.get(i).cloned().unwrap_or_default();
    let Ok(payload) = serde_json::from_str::<serde_json::Value>(&get(1)) else {
        return;
    };
    let mut envelope = EventEnvelope::new(get(0), payload);
    if f.len() > 3 {
        envelope = envelope.with_header(get(2), get(3));
    }
    if f.len() > 4 {
        envelope.ordering_key = Some(get(4));
    }
    let limits = EnvelopeLimits::default();
    let Ok(body) = envelope.encode(&limits) else {
        return;
    };
    assert!(body.len() <= limits.max_envelope_bytes);
    let delivered = EventEnvelope::decode_delivery(body.as_bytes())
        .unwrap_or_else(|reason| panic!("accepted at publish_tx, refused at delivery: {reason}"));
    assert_eq!(delivered.id, envelope.id);
    assert_eq!(delivered.routing_key, envelope.routing_key);
    assert_eq!(delivered.payload, envelope.payload);
    assert_eq!(delivered.ordering_key, envelope.ordering_key);
}

/// W3C trace context from any `traceparent` (and `tracestate` after the
/// first newline): never panics, and what parses is the canonical form,
/// parsing to itself again.
pub fn trace_context(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (parent, state) = match text.split_once('\n') {
        Some((p, s)) => (p, Some(s)),
        None => (&*text, None),
    };
    let Ok(tc) = TraceContext::parse(parent, state) else {
        return;
    };
    // Version 00 is exactly 55 characters; a later version may carry more
    // after them, which is kept.
    let p = tc.traceparent();
    let canonical = p.get(..55).unwrap_or_else(|| panic!("{p:?} is short"));
    assert!(
        p.len() == 55 || (!p.starts_with("00") && p.as_bytes()[55] == b'-'),
        "{p:?}"
    );
    assert!(
        canonical
            .bytes()
            .all(|b| b == b'-' || b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{p:?}"
    );
    assert_eq!(tc.trace_id().len(), 32);
    assert_eq!(tc.parent_id().len(), 16);
    let again = TraceContext::parse(tc.traceparent(), tc.tracestate()).expect("parses again");
    assert_eq!(again, tc);
    let mut headers = BTreeMap::new();
    headers.insert("traceparent".to_owned(), p.to_owned());
    if let Some(s) = tc.tracestate() {
        headers.insert("tracestate".to_owned(), s.to_owned());
    }
    assert_eq!(TraceContext::from_headers(&headers), Some(tc));
}

/// Characters a password drawn here may hold: none that would end the
/// userinfo or start a percent escape.
fn password_char(c: char) -> bool {
    !matches!(c, '@' | '/' | ':' | '?' | '#' | '%' | '[' | ']' | '\\') && !c.is_whitespace()
}

/// `redact_url` on any text never panics; on an AMQP URL (or a list of
/// them) with a password, the password is in neither the redacted text nor
/// the error `LapinBroker::from_list` makes of it.
pub fn redact_url(data: &[u8]) {
    let whole = String::from_utf8_lossy(data);
    let _ = outbox::redact_url(&whole);
    let f = fields(data, 4);
    let get = |i: usize| f.get(i).cloned().unwrap_or_default();
    let (user, password, rest) = (get(0), get(1), get(2));
    let other = get(3);
    if password.chars().count() < 4
        || !password.chars().all(password_char)
        || !user.chars().all(password_char)
    {
        return;
    }
    let url = format!("amqp://{user}:{password}@{rest}");
    let list = format!("{other},{url}");
    // Only a password that is not also in the text around it can be judged
    // (the list's own glue included: a password `,amq` is in `,amqp://`).
    let around = [
        format!("amqp://{user}:***@{rest}"),
        format!("{other},amqp://{user}:***@{rest}"),
        format!("{other},<invalid>"),
    ];
    if around.iter().any(|a| a.contains(&password)) {
        return;
    }
    for text in [&url, &list] {
        let redacted = outbox::redact_url(text);
        assert!(
            !redacted.contains(&password),
            "{password:?} survives in {redacted:?}"
        );
        if let Err(e) = outbox::LapinBroker::from_list(text) {
            let e = e.to_string();
            assert!(!e.contains(&password), "{password:?} in the error {e:?}");
        }
    }
}

/// Every `CANOPY_MQ_*` variable a settings type reads.
pub const VARS: &[&str] = &[
    vars::TICK_MS,
    vars::BATCH_SIZE,
    vars::LEASE_TTL_SECS,
    vars::PIPELINE_DEPTH,
    vars::CONFIRM_TIMEOUT_SECS,
    vars::MAX_ROWS_PER_SEC,
    vars::WAKEUP_LINGER_MS,
    vars::MAX_ATTEMPTS,
    vars::RETENTION_DAYS,
    vars::REPLICA_ID,
    vars::EXCHANGE,
    vars::PENDING_WARN,
    vars::OLDEST_WARN_SECS,
    vars::BUFFER_MAX,
    vars::INBOX_RETENTION_DAYS,
    vars::SUBSCRIBER_PREFETCH,
    vars::SUBSCRIBER_CONCURRENCY,
    vars::SUBSCRIBER_MAX_ATTEMPTS,
    vars::SUBSCRIBER_MAX_BODY_BYTES,
    vars::SUBSCRIBER_HANDLER_TIMEOUT_SECS,
    vars::SUBSCRIBER_BATCH_MAX,
    vars::SUBSCRIBER_BATCH_LINGER_MS,
    vars::SUBSCRIBER_QUEUE_TYPE,
    vars::SUBSCRIBER_PARTITIONS,
    outbox::http::ADMIN_TOKEN_VAR,
    outbox::http::ADMIN_OPEN_VAR,
];

/// Variables a configuration needs set: an error may name one unset.
const REQUIRED_VARS: &[&str] = &[outbox::http::ADMIN_TOKEN_VAR];

/// Variables whose values are secrets: never in an error.
const SECRET_VARS: &[&str] = &[outbox::http::ADMIN_TOKEN_VAR];

/// Any values for any variables (each line: one byte choosing the
/// variable, then its value): every `from_lookup` returns a valid
/// configuration or an error naming a variable that was set (or a required
/// one that was not), and a secret never reaches the error.
pub fn config(data: &[u8]) {
    let mut env: BTreeMap<&'static str, String> = BTreeMap::new();
    for line in data.split(|b| *b == b'\n') {
        let Some((&pick, value)) = line.split_first() else {
            continue;
        };
        let var = VARS[usize::from(pick) % VARS.len()];
        env.insert(var, String::from_utf8_lossy(value).into_owned());
    }
    let lookup = |name: &str| env.get(name).cloned();
    let judge = |what: &str, result: Result<(), ConfigError>| {
        let Err(e) = result else { return };
        let ConfigError::Invalid { var, .. } = &e else {
            panic!("{what}: an error of a kind this property does not know: {e}")
        };
        let shown = e.to_string();
        assert!(
            shown.starts_with(var),
            "{what}: {shown:?} does not name {var}"
        );
        // A rule between two variables may be broken by the default of the
        // one not set: the error names it and the one that was.
        assert!(
            REQUIRED_VARS.contains(var) || env.keys().any(|set| shown.contains(set)),
            "{what}: the error names no variable that was set: {e}"
        );
        for secret in SECRET_VARS {
            let Some(value) = env.get(secret).map(|v| v.trim()) else {
                continue;
            };
            // Judged only where the secret is no part of another value.
            let elsewhere = env
                .iter()
                .any(|(name, v)| name != secret && v.contains(value));
            // Nor where it is part of a variable's name the error gives, or
            // is made of another variable's value and the text around it
            // (`VAR=` and a run of backslashes from the value: a fuzzing
            // finding of the property, not of the code).
            // Each is cut out for a mark the secret does not hold, so no new
            // text forms where it was (a fuzzing finding of this property:
            // cutting `�` out of `\0\0\0�\0\0` made five NULs, the token).
            let Some(mark) = ('\u{1}'..).find(|c| !value.contains(*c)) else {
                continue;
            };
            let cut = |t: String, x: &str| t.replace(x, &mark.to_string());
            let unnamed = VARS.iter().fold(shown.clone(), |t, name| cut(t, name));
            let unnamed = env
                .iter()
                .filter(|(name, v)| *name != secret && !v.trim().is_empty())
                .fold(unnamed, |t, (_, v)| cut(cut(t, v.as_str()), v.trim()));
            if value.len() >= 4 && !elsewhere {
                assert!(
                    !unnamed.contains(value),
                    "{what}: the secret {secret} in {shown:?}"
                );
            }
        }
    };
    judge(
        "DrainerConfig",
        outbox::DrainerConfig::from_lookup(lookup).map(drop),
    );
    judge(
        "SubscriberSettings",
        outbox::SubscriberSettings::from_lookup("fuzz.queue", &["fuzz.#"], lookup).map(|s| {
            s.validate()
                .expect("settings from_lookup returns are valid");
        }),
    );
    judge(
        "InboxJanitorSettings",
        outbox::InboxJanitorSettings::from_lookup(lookup).map(drop),
    );
    judge(
        "AdminAuth",
        outbox::http::AdminAuth::from_lookup(lookup).map(drop),
    );
}
