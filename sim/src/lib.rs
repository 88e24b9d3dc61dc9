//! The deterministic simulation testbed: the production drainer (and later
//! the subscriber) built with simulation adapters of its ports, run under
//! seeded fault scenarios from `scenarios/`. See ARCHITECTURE.md.
