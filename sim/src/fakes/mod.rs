//! The fakes: state machines standing in for PostgreSQL ([`pg`]) and
//! RabbitMQ ([`mq`]), each with a transport (`pg::serve`, `mq::serve`)
//! that serves it on the simulated network of either engine. Each module
//! doc lists the faults it injects and why the system must survive each;
//! the conformance suites (`sim/tests/conformance/`) run the same bodies
//! against the fakes and the real services.

pub mod mq;
pub mod pg;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A counter whose every bump wakes every watcher, in the order they began
/// waiting: the fakes' broadcast (a commit to `LISTEN`ing sessions, "close
/// every connection" to each connection). Not `tokio::sync::watch`, whose
/// waiters sit in shards picked by a thread-local random number that no
/// simulation seeds: on madsim, which runs the woken tasks in the order they
/// were woken, the same seed would not give the same run.
#[derive(Debug, Default)]
pub struct Signal {
    count: AtomicU64,
    notify: tokio::sync::Notify,
}

impl Signal {
    /// Wakes every watcher.
    pub fn bump(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// A watcher that has seen every bump so far.
    pub fn watch(self: &Arc<Self>) -> Watcher {
        Watcher {
            seen: self.count.load(Ordering::SeqCst),
            signal: self.clone(),
        }
    }
}

/// One watcher of a [`Signal`].
#[derive(Debug)]
pub struct Watcher {
    signal: Arc<Signal>,
    seen: u64,
}

impl Watcher {
    /// Resolves once the signal was bumped since this last resolved (bumps
    /// in between coalesce). Cancel-safe.
    pub async fn changed(&mut self) {
        loop {
            let notified = self.signal.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let count = self.signal.count.load(Ordering::SeqCst);
            if count != self.seen {
                self.seen = count;
                return;
            }
            notified.await;
        }
    }
}

/// Serves the fake PostgreSQL as host `pg` and each node of the fake
/// RabbitMQ as its host (`rabbit`, or `rabbit-1`… for a cluster), where
/// the adapters look for them.
pub fn serve(sim: &mut crate::engine::Sim, pg: &pg::PgState, mq: &mq::MqState) {
    let pg = pg.clone();
    sim.host("pg", move || pg::serve(pg.clone()));
    for (node, host) in mq.node_hosts().into_iter().enumerate() {
        let mq = mq.clone();
        sim.host(host.as_str(), move || mq::serve_node(mq.clone(), node));
    }
}

/// A bare world for tests that drive the production core by hand: a fake
/// PostgreSQL (seeded `seed`) and RabbitMQ (`seed + 1`) recording into
/// `trace`, served; turmoil seeded `seed + 2`; ten simulated minutes at most.
#[cfg(not(madsim))]
pub fn bare_world(
    seed: u64,
    trace: &crate::trace::Trace,
) -> (turmoil::Sim<'static>, pg::PgState, mq::MqState) {
    let (pg, mq) = (
        pg::PgState::new(seed, trace.clone()),
        mq::MqState::new(seed + 1, trace.clone()),
    );
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed + 2)
        .simulation_duration(std::time::Duration::from_secs(600))
        .build();
    let (p, m) = (pg.clone(), mq.clone());
    sim.host("pg", move || pg::serve(p.clone()));
    sim.host("rabbit", move || mq::serve(m.clone()));
    (sim, pg, mq)
}
