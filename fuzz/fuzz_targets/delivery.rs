#![no_main]
//! `props::delivery` under libFuzzer.

#[path = "../props/outbox.rs"]
#[allow(dead_code)]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::delivery(data));
