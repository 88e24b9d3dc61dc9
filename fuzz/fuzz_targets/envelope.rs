#![no_main]
//! `props::envelope` under libFuzzer.

#[path = "../props/outbox.rs"]
#[allow(dead_code)]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::envelope(data));
