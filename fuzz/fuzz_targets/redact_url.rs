#![no_main]
//! `props::redact_url` under libFuzzer.

#[path = "../props/outbox.rs"]
#[allow(dead_code)]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::redact_url(data));
