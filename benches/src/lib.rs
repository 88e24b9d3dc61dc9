//! Criterion benches and the side-by-side throughput/latency harness live in
//! this crate; see ARCHITECTURE.md ("Performance").
