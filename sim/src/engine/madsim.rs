//! The madsim engine: hosts are madsim nodes of one runtime, whose
//! scheduler runs the ready tasks of every node in a seeded random order;
//! the world is the runtime's main task, stepping by sleeping. The
//! production code gets madsim's clock and tasks through the sim's own
//! adapters (the production ones are tokio's, which does not run here).
//!
//! Links: madsim clogs a link (messages wait until it is unclogged, as
//! TCP retransmits across an outage), which serves for both the black-hole
//! and the partition; each clogged pair counts its faults, so two faults
//! on one link end only when both have. A connection attempt over a
//! clogged link is refused at once, where turmoil's waits to time out.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use madsim::net::NetSim;
use madsim::runtime::{Handle, NodeHandle, Runtime};
use madsim::time::TimeHandle;

use super::{HostResult, Settings};

/// This engine's name, as `--engine` takes it.
pub const NAME: &str = "madsim";

/// madsim's network.
pub mod net {
    pub use madsim::net::{TcpListener, TcpStream};

    /// The read half of a stream.
    pub type ReadHalf = tokio::io::ReadHalf<TcpStream>;
    /// The write half of a stream.
    pub type WriteHalf = tokio::io::WriteHalf<TcpStream>;

    /// A stream's two halves; the stream ends for the peer once both are
    /// dropped.
    pub fn split(stream: TcpStream) -> (ReadHalf, WriteHalf) {
        tokio::io::split(stream)
    }
}

/// The clock the production code runs on: madsim's time.
#[derive(Debug, Clone)]
pub struct Clock {
    origin: std::time::Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            origin: madsim::time::Instant::now(),
        }
    }
}

impl outbox::core::ports::Clock for Clock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    async fn sleep(&self, d: Duration) {
        sleep(d).await;
    }
}

/// Waits `d`: madsim's sleep, added to the runtime's timer heap once per
/// waker, where madsim's own adds an entry at every poll that finds it
/// pending and its heap cannot take one back. A deadline polled at each
/// wake of what it bounds (a request's timeout at each frame, the
/// drainer's confirm deadline at each confirm) left an entry per poll,
/// each later popped and fired as a spurious wake: popping them was a
/// tenth of a madsim sweep's CPU (ARCHITECTURE.md, "Sweep speed").
pub fn sleep(d: Duration) -> Sleep {
    Sleep {
        inner: madsim::time::sleep(d),
        armed: None,
    }
}

/// The future [`sleep`] returns.
#[derive(Debug)]
#[must_use = "a sleep does nothing unless awaited"]
pub struct Sleep {
    inner: madsim::time::Sleep,
    /// The waker the heap's entry wakes, once one is added.
    armed: Option<std::task::Waker>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.inner.is_elapsed() {
            return std::task::Poll::Ready(());
        }
        if self.armed.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            return std::task::Poll::Pending;
        }
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll(cx);
        if polled.is_pending() {
            this.armed = Some(cx.waker().clone());
        }
        polled
    }
}

/// Runs `fut` until `d` has passed (the future polled first, as tokio's
/// `timeout` does), on [`sleep`].
pub async fn timeout<F: Future>(d: Duration, fut: F) -> Result<F::Output, super::Elapsed> {
    let mut fut = std::pin::pin!(fut);
    let mut deadline = sleep(d);
    std::future::poll_fn(|cx| {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(cx) {
            return std::task::Poll::Ready(Ok(v));
        }
        std::pin::Pin::new(&mut deadline)
            .poll(cx)
            .map(|()| Err(super::Elapsed))
    })
    .await
}

/// Where `DrainerHandle` spawns its tasks: madsim's, on the current node.
#[derive(Debug, Clone, Copy, Default)]
pub struct Spawner;

impl outbox::core::ports::Spawn for Spawner {
    fn spawn(&self, task: outbox::core::ports::BoxTask) -> outbox::core::ports::TaskEnd {
        let handle = madsim::task::spawn(task);
        Box::pin(async move {
            match handle.await {
                Err(e) if e.is_panic() => Err(e.to_string()),
                _ => Ok(()),
            }
        })
    }
}

pub(super) fn now() -> Duration {
    TimeHandle::try_current().map_or(Duration::ZERO, |t| t.elapsed())
}

/// madsim's configuration for `settings`.
pub fn config(settings: &Settings) -> madsim::Config {
    let mut config = madsim::Config::default();
    if let Some((min, max)) = settings.latency {
        config.net.send_latency = min..max.max(min + Duration::from_nanos(1));
    }
    config
}

/// Runs `body` on a runtime of its own, on a thread of its own: madsim
/// seeds std's `HashMap` keys (which madsim's network uses) from the
/// runtime's seed only if the runtime is the thread's first user of them,
/// so a second run on one thread would not repeat the first.
pub(super) fn simulate<T, F, Fut>(settings: Settings, body: F) -> T
where
    T: Send,
    F: FnOnce(Sim) -> Fut + Send,
    Fut: Future<Output = T>,
{
    std::thread::scope(|scope| {
        let run = scope.spawn(move || {
            let rt = Runtime::with_seed_and_config(settings.seed, config(&settings));
            rt.block_on(async move { body(Sim::new(settings)).await })
        });
        run.join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The world's handle on the simulation; lives in the runtime's main task.
pub struct Sim {
    handle: Handle,
    net: Arc<NetSim>,
    step: Duration,
    limit: Duration,
    nodes: BTreeMap<String, NodeHandle>,
    /// Faults holding each clogged (from, to) link.
    clogs: BTreeMap<(String, String), u32>,
    /// Clients still running.
    clients: Arc<Mutex<u32>>,
    /// The first host failure.
    failed: Arc<Mutex<Option<String>>>,
}

impl Drop for Sim {
    /// Kills every host as the run ends, so the executor drops their
    /// tasks' futures as it drains its queue: a task whose waker the
    /// fakes' state holds while that state is the task's own (a statement
    /// parked on a row lock) is otherwise never dropped, and its run's
    /// world with it (a madsim sweep grew about 3 MB per such run, and
    /// `--seeds 0..200` ran out of memory).
    fn drop(&mut self) {
        for node in self.nodes.values() {
            self.handle.kill(node.id());
        }
    }
}

impl Sim {
    /// The simulation of the runtime this is called in.
    pub fn new(settings: Settings) -> Self {
        Self {
            handle: Handle::current(),
            net: NetSim::current(),
            step: settings.step.unwrap_or(Duration::from_millis(1)),
            limit: settings.limit,
            nodes: BTreeMap::new(),
            clogs: BTreeMap::new(),
            clients: Arc::default(),
            failed: Arc::default(),
        }
    }

    fn add<F, Fut>(&mut self, name: &str, init: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        assert!(!self.nodes.contains_key(name), "two hosts named {name}");
        let n = u32::try_from(self.nodes.len() + 1).expect("few hosts");
        let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + n));
        // The node's software is its init task: when it returns, the node
        // exits with every task it spawned, as a turmoil host does.
        let node = self
            .handle
            .create_node()
            .name(name)
            .ip(ip)
            .init(init)
            .build();
        self.net.add_dns_record(name, ip);
        self.nodes.insert(name.to_owned(), node);
    }

    /// A host running `software`, started again by it after a restart.
    pub fn host<F, Fut>(&mut self, name: &str, software: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HostResult> + 'static,
    {
        let failed = self.failed.clone();
        let host = name.to_owned();
        self.add(name, move || {
            let run = software();
            let (failed, host) = (failed.clone(), host.clone());
            async move {
                if let Err(e) = run.await {
                    failed
                        .lock()
                        .expect("failed")
                        .get_or_insert(format!("{host}: {e}"));
                }
            }
        });
    }

    /// A host running the software `start` makes, once; the run's clients
    /// are done when every one has returned.
    pub fn client<F, Fut>(&mut self, name: &str, start: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = HostResult> + 'static,
    {
        let once = Mutex::new(Some(start));
        *self.clients.lock().expect("clients") += 1;
        let (clients, failed, host) = (self.clients.clone(), self.failed.clone(), name.to_owned());
        self.add(name, move || {
            // A client runs once; it is never restarted.
            let run = once.lock().expect("client").take().map(|start| start());
            let (clients, failed, host) = (clients.clone(), failed.clone(), host.clone());
            async move {
                let Some(run) = run else { return };
                if let Err(e) = run.await {
                    failed
                        .lock()
                        .expect("failed")
                        .get_or_insert(format!("{host}: {e}"));
                }
                *clients.lock().expect("clients") -= 1;
            }
        });
    }

    fn node(&self, host: &str) -> &NodeHandle {
        self.nodes
            .get(host)
            .unwrap_or_else(|| panic!("no host named {host}"))
    }

    /// Stops `host`: its tasks and connections are gone.
    pub fn crash(&mut self, host: &str) {
        self.handle.kill(self.node(host).id());
    }

    /// Starts a crashed `host` again, as a new process.
    pub fn restart(&mut self, host: &str) {
        self.handle.restart(self.node(host).id());
    }

    fn clog(&mut self, a: &str, b: &str) {
        for (from, to) in [(a, b), (b, a)] {
            let n = self
                .clogs
                .entry((from.to_owned(), to.to_owned()))
                .or_insert(0);
            *n += 1;
            if *n == 1 {
                self.net.clog_link(self.node(from).id(), self.node(to).id());
            }
        }
    }

    fn unclog(&mut self, a: &str, b: &str) {
        for (from, to) in [(a, b), (b, a)] {
            let key = (from.to_owned(), to.to_owned());
            let Some(n) = self.clogs.get_mut(&key) else {
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.clogs.remove(&key);
                self.net
                    .unclog_link(self.node(from).id(), self.node(to).id());
            }
        }
    }

    /// Holds every message between `a` and `b` until [`Sim::release`]
    /// (a black-hole).
    pub fn hold(&mut self, a: &str, b: &str) {
        self.clog(a, b);
    }

    /// Ends [`Sim::hold`]: held messages are delivered.
    pub fn release(&mut self, a: &str, b: &str) {
        self.unclog(a, b);
    }

    /// Cuts `a` off from `b` until [`Sim::repair`]: messages wait, new
    /// connections are refused.
    pub fn partition(&mut self, a: &str, b: &str) {
        self.clog(a, b);
    }

    /// Ends [`Sim::partition`].
    pub fn repair(&mut self, a: &str, b: &str) {
        self.unclog(a, b);
    }

    /// Simulated time since the run began.
    pub fn elapsed(&self) -> Duration {
        now()
    }

    /// Lets the hosts run for one step; `Ok(true)` once every client is
    /// done, `Err` if a host failed or the run outlived its bound.
    pub async fn step(&mut self) -> Result<bool, String> {
        madsim::time::sleep(self.step).await;
        if let Some(e) = self.failed.lock().expect("failed").clone() {
            return Err(e);
        }
        if now() > self.limit {
            return Err(format!("ran past {} simulated s", self.limit.as_secs()));
        }
        Ok(*self.clients.lock().expect("clients") == 0)
    }
}
