//! The library's fuzz properties (`fuzz/props/outbox.rs`) on stable, over
//! every committed input of their targets (`fuzz/props/replay.rs`): a
//! finding of the fuzzer stays fixed here.

#[path = "../../fuzz/props/outbox.rs"]
mod props;
#[path = "../../fuzz/props/replay.rs"]
mod replay;

use replay::replay;

#[test]
fn delivery_corpus() {
    replay("delivery", props::delivery);
}

#[test]
fn envelope_corpus() {
    replay("envelope", props::envelope);
}

#[test]
fn trace_context_corpus() {
    replay("trace_context", props::trace_context);
}

#[test]
fn redact_url_corpus() {
    replay("redact_url", props::redact_url);
}

#[test]
fn config_corpus() {
    replay("config", props::config);
}
