//! The simulation engines, and the one interface the fakes, the adapters
//! and the world see of them.
//!
//! Two engines run the same scenarios with the same production code, one
//! per build:
//! - **turmoil** (the default build, [`turmoil`]): a simulated network
//!   between hosts, each host a runtime of its own, stepped 10 ms at a time
//!   in a seeded random host order. Inside a host, tasks run in tokio's
//!   fixed order.
//! - **madsim** (`RUSTFLAGS="--cfg madsim"`, [`madsim`]): one runtime whose
//!   scheduler picks the next ready task at random, across and *inside*
//!   hosts, so it explores the races between the tasks of one process (the
//!   drainer, janitor, stats task and commit listener `DrainerHandle`
//!   spawns; the subscriber's workers) that turmoil never reorders, and it
//!   can check its own determinism (`Runtime::check_determinism`).
//!
//! What differs is bound here, thinly: the network's stream and listener
//! types ([`net`]), the clock ([`now`], [`sleep`], [`timeout`]), the task
//! and clock adapters the
//! production code is handed ([`Spawner`], [`Clock`]), and the world's
//! control of hosts and links ([`Sim`]). Everything else (the fakes' state
//! machines and their transport, the adapters, the checker) is the same
//! source on both: in the madsim build `tokio` is madsim's drop-in, whose
//! `spawn` and `time` are madsim's and whose `sync` and `io` are tokio's.

use std::future::Future;
use std::time::Duration;

#[cfg(madsim)]
pub mod madsim;
#[cfg(not(madsim))]
pub mod turmoil;

#[cfg(madsim)]
use self::madsim as imp;
#[cfg(not(madsim))]
use self::turmoil as imp;

pub use imp::{Clock, NAME, Sim, Spawner, sleep, timeout};

/// What [`timeout`] returns when its deadline passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

/// What a host's software returns; an `Err` stops the run (a
/// `SimulationError` in the trace).
pub type HostResult = Result<(), Box<dyn std::error::Error>>;

/// The engines, by name.
pub const ENGINES: [&str; 2] = ["turmoil", "madsim"];

/// How a simulation is built. `None` leaves the engine's default.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Seeds the engine's own randomness (turmoil's host order and
    /// latencies; madsim's task order and latencies).
    pub seed: u64,
    /// turmoil's step; the world's fault schedule is applied at this
    /// granularity on both engines.
    pub step: Option<Duration>,
    /// One-way message latency, drawn per message.
    pub latency: Option<(Duration, Duration)>,
    /// The run fails (`step` returns an error) past this much simulated
    /// time.
    pub limit: Duration,
}

impl Settings {
    /// The engine's defaults, seeded, with a ten-minute bound.
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed,
            step: None,
            latency: None,
            limit: Duration::from_secs(600),
        }
    }
}

/// Runs `body` on a simulation built from `settings`, to its end.
pub fn simulate<T, F, Fut>(settings: Settings, body: F) -> T
where
    T: Send,
    F: FnOnce(Sim) -> Fut + Send,
    Fut: Future<Output = T>,
{
    imp::simulate(settings, body)
}

/// Simulated time since the run began, from inside a host or from the
/// world.
pub fn now() -> Duration {
    imp::now()
}

/// The simulated network, as the fakes and the adapters use it.
pub mod net {
    pub use super::imp::net::{ReadHalf, TcpListener, TcpStream, WriteHalf, split};

    /// Opens a connection to `host:port` (no bound: callers bound it).
    pub async fn connect(host: &str, port: u16) -> std::io::Result<TcpStream> {
        TcpStream::connect((host, port)).await
    }

    /// Listens on `port` on every address of this host.
    pub async fn bind(port: u16) -> std::io::Result<TcpListener> {
        TcpListener::bind(("0.0.0.0", port)).await
    }
}

/// Runs a future whose every await is ready at once (the turmoil world's
/// drive loop: `Sim::step` returns as soon as turmoil has stepped) to its
/// end on this thread.
#[cfg(not(madsim))]
fn run_ready<T>(fut: impl Future<Output = T>) -> T {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(t) => t,
        std::task::Poll::Pending => {
            unreachable!("the turmoil world awaits nothing but turmoil's own steps")
        }
    }
}
