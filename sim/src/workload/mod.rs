//! The workload: the producer's domain transactions that write envelopes
//! into the fake PostgreSQL, some committed, some rolled back, started at
//! seeded intervals (open loop); and the consumer's handler ([`handler`]).
//! Connection failures leave a transaction in doubt; the fake (not this
//! client) is the judge of what committed.

pub mod handler;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox::EventEnvelope;
use outbox::envelope::EnvelopeLimits;
use outbox::envelope::ROUTING_KEY_MAX_BYTES;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use self::handler::{TRIGGER_PREFIX, UNIQUE_PREFIX};
use crate::adapters::PgClient;
use crate::scenario::Workload;
use crate::trace::{Event, Trace};
use crate::wire::{NewRow, PgRequest};

/// Most attempts at one transaction before the workload moves on.
const TX_RETRIES_MAX: u32 = 50;

/// How many distinct `unique.<n>` routing keys the workload draws from.
pub const UNIQUE_KEYS: u32 = 4;

/// The Unix time (ms) of the simulation's zero, for UUID v7 ids:
/// 2026-01-01.
pub const EPOCH_MS: u64 = 1_767_225_600_000;

/// Runs the workload to its end, then sets `done`. With `writers` > 1 the
/// transactions are shared among that many concurrent writers (clients
/// `workload`, `workload-2`, …), each with a random stream of its own:
/// their transactions overlap, the same ordering key's among them.
pub async fn run(
    spec: Workload,
    seed: u64,
    trace: Trace,
    done: Arc<AtomicBool>,
) -> crate::engine::HostResult {
    let writers = spec.writers.max(1);
    let mut handles = Vec::new();
    for w in 0..writers {
        let (spec, trace) = (spec.clone(), trace.clone());
        // Writer 1 keeps the workload's stream: one writer is as before.
        let seed = seed ^ u64::from(w).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let name = match w {
            0 => "workload".to_owned(),
            w => format!("workload-{}", w + 1),
        };
        let share = (w..spec.transactions).step_by(writers as usize).collect();
        handles.push(tokio::spawn(write(spec, seed, trace, name, share)));
    }
    for h in handles {
        let _ = h.await;
    }
    done.store(true, Ordering::SeqCst);
    Ok(())
}

/// One writer's transactions (numbered `share`), at the workload's pace.
async fn write(spec: Workload, seed: u64, trace: Trace, name: String, share: Vec<u32>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let pg = PgClient::new(name, trace.clone());
    for n in share {
        // Open loop: the interval runs from one transaction's start to the
        // next, so the workload's length does not depend on how long the
        // simulated network makes each round trip (a slow or retried
        // transaction shortens the pause after it, never below zero).
        let started = tokio::time::Instant::now();
        let count = rng.random_range(spec.envelopes_per_tx[0]..=spec.envelopes_per_tx[1]);
        let rollback = rng.random_bool(spec.rollback_ratio);
        let mut rows = Vec::with_capacity(count as usize);
        for k in 0..count {
            rows.push(row(&spec, &mut rng, &trace, n, k));
        }
        commit(&pg, rows, rollback).await;
        let pause = rng.random_range(spec.interval_ms[0]..=spec.interval_ms[1]);
        tokio::time::sleep_until(started + Duration::from_millis(pause)).await;
    }
}

/// Envelope `k` of transaction `n`: poison, unique-keyed, keyed, traced,
/// with the longest routing key, or unpublishable, as the workload draws.
fn row(spec: &Workload, rng: &mut SmallRng, trace: &Trace, n: u32, k: u32) -> NewRow {
    let poison = spec.poison_ratio > 0.0 && rng.random_bool(spec.poison_ratio);
    let unique =
        (!poison && spec.unique_ratio > 0.0 && rng.random_bool(spec.unique_ratio)).then(|| {
            let prefix = if rng.random_bool(0.5) {
                UNIQUE_PREFIX
            } else {
                TRIGGER_PREFIX
            };
            format!("{prefix}{}", rng.random_range(0..UNIQUE_KEYS))
        });
    let key = match &unique {
        Some(key) => key.as_str(),
        None if poison => "poison.event",
        None => "domain.event",
    };
    let mut env = envelope(rng, key, n, k);
    if spec.ordering_keys > 0 && rng.random_bool(spec.keyed_ratio) {
        let key = rng.random_range(0..spec.ordering_keys);
        env.ordering_key = Some(format!("key-{key}"));
    }
    if let Some((traceparent, tracestate)) = trace_context_of(&env) {
        trace.now(Event::Traced {
            id: env.id,
            traceparent: traceparent.clone(),
            tracestate: tracestate.clone(),
        });
        env.headers.insert("traceparent".into(), traceparent);
        if let Some(state) = tracestate {
            env.headers.insert("tracestate".into(), state);
        }
    }
    if let Some(key) = &unique {
        trace.now(Event::UniqueKeyed {
            id: env.id,
            key: key.clone(),
        });
    }
    // Now and then the longest routing key a broker accepts.
    if !poison && unique.is_none() && rng.random_bool(0.02) {
        env.routing_key = format!(
            "domain.{}",
            "k".repeat(ROUTING_KEY_MAX_BYTES - "domain.".len())
        );
    }
    let unpublishable = spec.unpublishable_ratio > 0.0 && rng.random_bool(spec.unpublishable_ratio);
    let encoded = if unpublishable {
        // Written by hand, bypassing publish_tx's validation.
        env.routing_key = if rng.random_bool(0.5) {
            String::new()
        } else {
            "x".repeat(300)
        };
        trace.now(Event::Unpublishable { id: env.id });
        serde_json::to_string(&env).expect("envelopes encode")
    } else {
        env.encode(&EnvelopeLimits::default())
            .expect("workload envelopes are valid")
    };
    NewRow {
        id: env.id,
        routing_key: env.routing_key,
        body: encoded,
        ordering_key: env.ordering_key,
    }
}

/// One transaction's envelopes in one INSERT (as `publish_many_tx`),
/// committed or rolled back, retried while in doubt or refused.
async fn commit(pg: &PgClient, rows: Vec<NewRow>, rollback: bool) {
    // One INSERT for the transaction's envelopes, as publish_many_tx.
    let body = vec![PgRequest::Insert { rows }];
    for _ in 0..TX_RETRIES_MAX {
        let result = if rollback {
            rolled_back(pg, body.clone()).await
        } else {
            pg.in_tx(body.clone()).await.map(drop)
        };
        match result {
            Ok(()) => break,
            // In doubt or refused: try the same envelopes again; a
            // duplicate id (the commit did apply) ends the retries.
            Err(outbox::StoreError::Statement(e)) if e.contains("duplicate key") => break,
            Err(_) => crate::engine::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn rolled_back(pg: &PgClient, body: Vec<PgRequest>) -> Result<(), outbox::StoreError> {
    pg.call(PgRequest::Begin).await?;
    for req in body {
        if let Err(e) = pg.call(req).await {
            pg.disconnect().await;
            return Err(e);
        }
    }
    let r = pg.call(PgRequest::Rollback).await.map(drop);
    if r.is_err() {
        pg.disconnect().await;
    }
    r
}

/// The W3C trace context a third of the envelopes are written with, a
/// `tracestate` on half of those: derived from the id (a v7 id's low bits
/// are seeded), so no random stream moves for it.
fn trace_context_of(e: &EventEnvelope) -> Option<(String, Option<String>)> {
    let (high, low) = e.id.as_u64_pair();
    if !low.is_multiple_of(3) {
        return None;
    }
    let traceparent = format!("00-{high:016x}{low:016x}-{:016x}-01", low | 1);
    let tracestate = low
        .is_multiple_of(2)
        .then(|| format!("sim=t{:x}", low >> 48));
    Some((traceparent, tracestate))
}

/// A UUID v7 from simulated time and seeded randomness.
/// Envelope number `n` on `routing_key`, its id depending on `n` alone (a
/// UUID v7 at the simulation's epoch plus `n` ms): known, distinct,
/// time-ordered ids for tests, with no wall clock or OS randomness.
pub fn numbered_envelope(routing_key: &str, n: u64) -> EventEnvelope {
    let random = (n + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes();
    let mut bytes = [0u8; 10];
    bytes[2..].copy_from_slice(&random);
    let mut e = EventEnvelope::new(routing_key, serde_json::json!({ "n": n }));
    e.id = uuid::Builder::from_unix_timestamp_millis(EPOCH_MS + n, &bytes).into_uuid();
    e
}

fn envelope(rng: &mut SmallRng, key: &str, n: u32, k: u32) -> EventEnvelope {
    let ms = crate::sim_now_ms() + EPOCH_MS;
    let random: [u8; 10] = rng.random();
    let id = uuid::Builder::from_unix_timestamp_millis(ms, &random).into_uuid();
    EventEnvelope {
        id,
        routing_key: key.to_owned(),
        occurred_at: time::OffsetDateTime::UNIX_EPOCH + Duration::from_millis(ms),
        headers: Default::default(),
        payload: serde_json::json!({ "tx": n, "k": k }),
        ordering_key: None,
    }
}
