#![no_main]
//! `props::scenario` under libFuzzer.

#[path = "../props/sim.rs"]
#[allow(dead_code)]
mod props;

libfuzzer_sys::fuzz_target!(|data: &[u8]| props::scenario(data));
