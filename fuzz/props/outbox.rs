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

/// `password` with every character but the list's separator `,` replaced
/// by a letter or digit it does not hold: the same shape to every parser (a
/// password drawn here holds no character that ends the userinfo), other
/// text. `None` for a password holding every letter and digit.
fn stand_in(password: &str) -> Option<String> {
    let fill = ('a'..='z')
        .chain('A'..='Z')
        .chain('0'..='9')
        .find(|c| !password.contains(*c))?;
    Some(
        password
            .chars()
            .map(|c| if c == ',' { c } else { fill })
            .collect(),
    )
}

/// What a redacting step shows of `text`: the redacted text and the error
/// `LapinBroker::from_list` makes of it.
fn shown(text: &str) -> (String, Option<String>) {
    let error = outbox::LapinBroker::from_list(text)
        .err()
        .map(|e| e.to_string());
    (outbox::amqp::redact_url(text), error)
}

/// `redact_url` on any text never panics; on an AMQP URL (or a list of
/// them) with a password, the password is in neither the redacted text nor
/// the error `LapinBroker::from_list` makes of it.
///
/// Judged first by difference: what is shown of the address with its
/// password is what is shown of it with a stand-in password of the same
/// shape, so no character of the password reaches the text. Where the two
/// differ (a password that changes how the address parses, which is no
/// leak), the password, or each piece of it between the list's commas, must
/// not be in the text unless the text around it holds it anyway.
pub fn redact_url(data: &[u8]) {
    let whole = String::from_utf8_lossy(data);
    let _ = outbox::amqp::redact_url(&whole);
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
    let url = |password: &str| format!("amqp://{user}:{password}@{rest}");
    let list = |password: &str| format!("{other},{}", url(password));
    let around = [
        format!("amqp://{user}:***@{rest}"),
        format!("{other},amqp://{user}:***@{rest}"),
        format!("{other},<invalid>"),
    ];
    let pieces: Vec<&str> = password
        .split(',')
        .filter(|p| p.chars().count() >= 4)
        .filter(|p| !around.iter().any(|a| a.contains(p)))
        .collect();
    let stand_in = stand_in(&password);
    let texts: [&dyn Fn(&str) -> String; 2] = [&url, &list];
    for text in texts {
        let seen = shown(&text(&password));
        if stand_in.as_ref().is_some_and(|s| seen == shown(&text(s))) {
            continue;
        }
        let (redacted, error) = seen;
        for piece in &pieces {
            assert!(
                !redacted.contains(piece),
                "{piece:?} of {password:?} survives in {redacted:?}"
            );
            if let Some(e) = &error {
                assert!(!e.contains(piece), "{piece:?} of {password:?} in {e:?}");
            }
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
    outbox_admin::ADMIN_TOKEN_VAR,
    outbox_admin::ADMIN_OPEN_VAR,
];

/// Variables a configuration needs set: an error may name one unset.
const REQUIRED_VARS: &[&str] = &[outbox_admin::ADMIN_TOKEN_VAR];

/// Variables whose values are secrets: never in an error.
const SECRET_VARS: &[&str] = &[outbox_admin::ADMIN_TOKEN_VAR];

/// An environment for `from_lookup`.
type Env = BTreeMap<&'static str, String>;

/// What every settings type's `from_lookup` makes of `env`: an error's text
/// for each that refuses it.
fn config_errors(env: &Env) -> Vec<(&'static str, Option<ConfigError>)> {
    let lookup = |name: &str| env.get(name).cloned();
    vec![
        (
            "DrainerConfig",
            outbox::DrainerConfig::from_lookup(lookup).err(),
        ),
        (
            "SubscriberSettings",
            outbox::SubscriberSettings::from_lookup("fuzz.queue", &["fuzz.#"], lookup)
                .map(|s| {
                    s.validate()
                        .expect("settings from_lookup returns are valid")
                })
                .err(),
        ),
        (
            "InboxJanitorSettings",
            outbox::InboxJanitorSettings::from_lookup(lookup).err(),
        ),
        (
            "AdminAuth",
            outbox_admin::AdminAuth::from_lookup(lookup).err(),
        ),
    ]
}

/// A secret's stand-in: the same surrounding whitespace and the same length
/// in bytes once trimmed (all a rule may read of a secret), other text.
fn secret_stand_in(secret: &str) -> String {
    let trimmed = secret.trim();
    if trimmed.is_empty() {
        return secret.to_owned();
    }
    let lead = secret.len() - secret.trim_start().len();
    let fill = if trimmed.bytes().all(|b| b == b'x') {
        "y"
    } else {
        "x"
    };
    format!(
        "{}{}{}",
        &secret[..lead],
        fill.repeat(trimmed.len()),
        &secret[lead + trimmed.len()..]
    )
}

/// Any values for any variables (each line: one byte choosing the
/// variable, then its value): every `from_lookup` returns a valid
/// configuration or an error naming a variable that was set (or a required
/// one that was not), and a secret never reaches the error: each error is
/// the same, to the byte, with the secret replaced by a stand-in of the
/// same shape.
pub fn config(data: &[u8]) {
    let mut env = Env::new();
    for line in data.split(|b| *b == b'\n') {
        let Some((&pick, value)) = line.split_first() else {
            continue;
        };
        let var = VARS[usize::from(pick) % VARS.len()];
        env.insert(var, String::from_utf8_lossy(value).into_owned());
    }
    let errors = config_errors(&env);
    for (what, e) in &errors {
        let Some(e) = e else { continue };
        let ConfigError::Invalid { var, .. } = e else {
            panic!("{what}: an error of a kind this property does not know: {e}")
        };
        let shown = e.to_string();
        assert!(
            shown.starts_with(var.as_ref()),
            "{what}: {shown:?} does not name {var}"
        );
        // A rule between two variables may be broken by the default of the
        // one not set: the error names it and the one that was.
        assert!(
            REQUIRED_VARS.contains(&var.as_ref()) || env.keys().any(|set| shown.contains(set)),
            "{what}: the error names no variable that was set: {e}"
        );
    }
    let texts = |errors: Vec<(&str, Option<ConfigError>)>| -> Vec<Option<String>> {
        errors
            .into_iter()
            .map(|(_, e)| e.map(|e| e.to_string()))
            .collect()
    };
    let errors = texts(errors);
    for secret in SECRET_VARS {
        let Some(value) = env.get(secret) else {
            continue;
        };
        let mut other = env.clone();
        other.insert(secret, secret_stand_in(value));
        assert_eq!(
            errors,
            texts(config_errors(&other)),
            "an error shows something of {secret}"
        );
    }
}
