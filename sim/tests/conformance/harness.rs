//! The fake arm's harness: a fake server on its simulated host and the test
//! body as a client, in one simulation of this build's engine (turmoil, or
//! madsim in the madsim build: the same bodies run on both).

use std::future::Future;

use sim::engine::{self, HostResult, Settings};

/// Runs the test body `client` makes in a simulation beside a fake server
/// on `host`.
pub fn in_sim<S, SF, C, CF>(host: &str, serve: S, client: C)
where
    S: Fn() -> SF + Send + Sync + 'static,
    SF: Future<Output = HostResult> + 'static,
    C: FnOnce() -> CF + Send + 'static,
    CF: Future<Output = ()> + 'static,
{
    in_sim_hosts(vec![(host.to_owned(), serve)], client);
}

/// Runs the test body `client` makes in a simulation beside fake servers,
/// each `(host, serve)` on its own host (the nodes of a cluster).
pub fn in_sim_hosts<S, SF, C, CF>(servers: Vec<(String, S)>, client: C)
where
    S: Fn() -> SF + Send + Sync + 'static,
    SF: Future<Output = HostResult> + 'static,
    C: FnOnce() -> CF + Send + 'static,
    CF: Future<Output = ()> + 'static,
{
    engine::simulate(Settings::seeded(0), move |mut sim| async move {
        for (host, serve) in servers {
            sim.host(&host, serve);
        }
        sim.client("test", move || async move {
            client().await;
            Ok(())
        });
        loop {
            match sim.step().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => panic!("the simulation stopped: {e}"),
            }
        }
    });
}
