//! The turmoil engine: hosts are turmoil hosts, each with a tokio runtime
//! of its own; the world steps them 10 ms at a time in a seeded random
//! order. The production code gets tokio's own clock and tasks (the
//! production adapters), which turmoil simulates.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use super::{HostResult, Settings};

/// This engine's name, as `--engine` takes it.
pub const NAME: &str = "turmoil";

/// The clock the production code runs on: tokio's, simulated by turmoil.
pub type Clock = outbox::TokioClock;
/// Where `DrainerHandle` spawns its tasks: tokio's, on the host's runtime.
pub type Spawner = outbox::runtime::TokioSpawn;

/// turmoil's network.
pub mod net {
    pub use turmoil::net::tcp::{OwnedReadHalf as ReadHalf, OwnedWriteHalf as WriteHalf};
    pub use turmoil::net::{TcpListener, TcpStream};

    /// A stream's two halves; dropping the write half ends the stream for
    /// the peer.
    pub fn split(stream: TcpStream) -> (ReadHalf, WriteHalf) {
        stream.into_split()
    }
}

/// Waits `d`: tokio's sleep, on turmoil's clock.
pub use tokio::time::sleep;

/// Runs `fut` until `d` has passed: tokio's `timeout`.
pub async fn timeout<F: Future>(d: Duration, fut: F) -> Result<F::Output, super::Elapsed> {
    tokio::time::timeout(d, fut)
        .await
        .map_err(|_| super::Elapsed)
}

thread_local! {
    /// Simulated time as the world last saw it, for code running outside a
    /// host (the world itself, drops during a crash).
    static WORLD_NOW: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

pub(super) fn now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_else(|| WORLD_NOW.with(Cell::get))
}

pub(super) fn simulate<T, F, Fut>(settings: Settings, body: F) -> T
where
    T: Send,
    F: FnOnce(Sim) -> Fut + Send,
    Fut: Future<Output = T>,
{
    WORLD_NOW.with(|c| c.set(Duration::ZERO));
    align_task_ids();
    let mut b = turmoil::Builder::new();
    b.rng_seed(settings.seed)
        .simulation_duration(settings.limit)
        .tcp_capacity(1 << 16);
    if let Some(step) = settings.step {
        // Hosts run in a seeded random order within each step, so a seed
        // explores interleavings a fixed order would never produce.
        b.tick_duration(step).enable_random_order();
    }
    if let Some((min, max)) = settings.latency {
        b.min_message_latency(min).max_message_latency(max);
    }
    super::run_ready(body(Sim {
        inner: b.build(),
        links: BTreeMap::new(),
    }))
}

/// Starts tokio's process-wide task numbering at a multiple of 64.
///
/// A host's runtime keeps its tasks in lists sharded by task id (four
/// shards on one thread), and a crash drops them shard by shard: the order
/// in which a crashed host's connections close, and so the order in which
/// the fakes see them end, follows each task's id modulo the shard count.
/// The ids come from one counter for the whole process, so the same seed
/// run twice in one process (or after other runs) would drop them in
/// another order. Aligned here, a run started while no other run spawns
/// tasks numbers its tasks the same way every time. Runs on parallel
/// threads (`sim sweep --jobs`) still interleave their numbers: a sweep's
/// failure is reproduced by `sim run`, which runs alone. (The lasting fix
/// is a host whose tasks all live in a `LocalSet`, dropped in spawn
/// order.)
fn align_task_ids() {
    const SHARDS: u64 = 64;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    for _ in 0..SHARDS {
        let id: u64 = rt
            .spawn(async {})
            .id()
            .to_string()
            .parse()
            .expect("a task id is a number");
        if id % SHARDS == SHARDS - 1 {
            break;
        }
    }
}

/// The world's handle on the simulation.
pub struct Sim {
    inner: turmoil::Sim<'static>,
    /// The faults on each link (its hosts in name order): holds and
    /// partitions. turmoil keeps one state per link, so the link is set to
    /// what its faults together say (a partition over a hold) whenever one
    /// starts or ends, and two faults on one link end only when both have.
    links: BTreeMap<(String, String), Faults>,
}

/// The faults holding and cutting one link.
#[derive(Debug, Default, Clone, Copy)]
struct Faults {
    holds: u32,
    partitions: u32,
}

impl Sim {
    /// A host running `software`, started again by it after a restart.
    pub fn host<F, Fut>(&mut self, name: &str, software: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HostResult> + 'static,
    {
        self.inner.host(name, software);
    }

    /// A host running the software `start` makes, once; the run's clients
    /// are done when every one has returned.
    pub fn client<F, Fut>(&mut self, name: &str, start: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = HostResult> + 'static,
    {
        self.inner.client(name, start());
    }

    /// Stops `host`: its tasks and connections are gone.
    pub fn crash(&mut self, host: &str) {
        self.inner.crash(host);
    }

    /// Starts a crashed `host` again, as a new process.
    pub fn restart(&mut self, host: &str) {
        self.inner.bounce(host);
    }

    /// Changes the faults on the link between `a` and `b` by `change`,
    /// and sets the link to what they now say.
    fn link(&mut self, a: &str, b: &str, change: impl FnOnce(&mut Faults)) {
        let key = if a <= b { (a, b) } else { (b, a) };
        let key = (key.0.to_owned(), key.1.to_owned());
        let faults = self.links.entry(key.clone()).or_default();
        let before = *faults;
        change(faults);
        let after = *faults;
        if after.holds == 0 && after.partitions == 0 {
            self.links.remove(&key);
        }
        match (after.partitions > 0, after.holds > 0) {
            (true, _) if before.partitions == 0 => self.inner.partition(a, b),
            (true, _) => {}
            (false, true) if before.partitions > 0 || before.holds == 0 => self.inner.hold(a, b),
            (false, true) => {}
            (false, false) if before.partitions > 0 => self.inner.repair(a, b),
            (false, false) => self.inner.release(a, b),
        }
    }

    /// Holds every message between `a` and `b` until [`Sim::release`]
    /// (a black-hole).
    pub fn hold(&mut self, a: &str, b: &str) {
        self.link(a, b, |f| f.holds += 1);
    }

    /// Ends [`Sim::hold`]: held messages are delivered once no other fault
    /// holds or cuts the link.
    pub fn release(&mut self, a: &str, b: &str) {
        self.link(a, b, |f| f.holds = f.holds.saturating_sub(1));
    }

    /// Drops every message between `a` and `b` until [`Sim::repair`].
    pub fn partition(&mut self, a: &str, b: &str) {
        self.link(a, b, |f| f.partitions += 1);
    }

    /// Ends [`Sim::partition`] once no other fault cuts the link (a hold
    /// still active then holds it).
    pub fn repair(&mut self, a: &str, b: &str) {
        self.link(a, b, |f| f.partitions = f.partitions.saturating_sub(1));
    }

    /// Simulated time since the run began.
    pub fn elapsed(&self) -> Duration {
        self.inner.elapsed()
    }

    /// Runs every host for one step; `Ok(true)` once every client is done,
    /// `Err` if a host failed or the run outlived its bound.
    pub async fn step(&mut self) -> Result<bool, String> {
        let r = self.inner.step().map_err(|e| e.to_string());
        WORLD_NOW.with(|c| c.set(self.inner.elapsed()));
        r
    }
}
