//! Envelope encode (with validation, as `publish_tx` does) and decode (as
//! the subscriber does for every delivery), for a typical ~200-byte event
//! and a 16 KiB one. Baseline in the same run: `serde_json` alone on the
//! same payload, so the ratio shows what validation costs.
//!
//! `cargo bench -p benches --bench envelope`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use outbox::EventEnvelope;
use outbox::envelope::EnvelopeLimits;

fn payloads() -> [(&'static str, serde_json::Value); 2] {
    [
        (
            "small",
            serde_json::json!({ "order_id": 4711, "customer": "c-4711", "total_cents": 12_345, "currency": "EUR" }),
        ),
        (
            "16k",
            serde_json::json!({ "lines": (0..200).map(|i| serde_json::json!({
                "sku": format!("sku-{i:05}"), "qty": i % 7, "note": "x".repeat(40)
            })).collect::<Vec<_>>() }),
        ),
    ]
}

fn envelope(c: &mut Criterion) {
    let limits = EnvelopeLimits::default();
    let mut group = c.benchmark_group("envelope");
    for (name, payload) in payloads() {
        let e = EventEnvelope::new("orders.created", payload);
        let body = e.encode(&limits).expect("valid");
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(format!("serde_json_to_string/{name}"), |b| {
            b.iter(|| serde_json::to_string(std::hint::black_box(&e)).expect("encodes"))
        });
        group.bench_function(format!("encode_validated/{name}"), |b| {
            b.iter(|| std::hint::black_box(&e).encode(&limits).expect("valid"))
        });
        group.bench_function(format!("decode_delivery/{name}"), |b| {
            b.iter(|| {
                EventEnvelope::decode_delivery(std::hint::black_box(body.as_bytes()))
                    .expect("valid")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, envelope);
criterion_main!(benches);
