//! The fakes: transport-bound state machines standing in for PostgreSQL
//! ([`pg`]) and RabbitMQ ([`mq`]) on the simulated network. Each module doc
//! lists the faults it injects and why the system must survive each; the
//! conformance suites (`sim/tests/conformance/`) run the same bodies against
//! the fakes and the real services.

pub mod mq;
pub mod pg;
