#![no_main]
//! `props::config` under libFuzzer.

#[path = "../props/outbox.rs"]
#[allow(dead_code)]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::config(data));
