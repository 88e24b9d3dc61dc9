//! The fake arm's harness: a fake server on its simulated host and the test
//! body as a client, in one turmoil simulation.

use std::future::Future;
use std::time::Duration;

/// Runs `client` in a turmoil simulation beside a fake server on `host`.
pub fn in_sim<S, SF, C>(host: &str, serve: S, client: C)
where
    S: Fn() -> SF + 'static,
    SF: Future<Output = turmoil::Result> + 'static,
    C: Future<Output = ()> + 'static,
{
    let mut sim = turmoil::Builder::new()
        .simulation_duration(Duration::from_secs(600))
        .build();
    sim.host(host, serve);
    sim.client("test", async move {
        client.await;
        Ok(())
    });
    sim.run().unwrap();
}
