#![no_main]
//! `props::trace_context` under libFuzzer.

#[path = "../props/outbox.rs"]
#[allow(dead_code)]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::trace_context(data));
