//! The foreground P3 and P10 measure beside the library: another service's
//! transactions, each an order and its event through `publish_tx`, at a
//! steady rate on a thread, runtime and connection of their own, as that
//! service would commit against the shared database.

use std::future::Future;
use std::time::{Duration, Instant};

use outbox::Publisher;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;

/// Latencies observed, each at its start's offset from the load's start.
#[derive(Debug, Default)]
pub struct Samples(pub Vec<(Duration, Duration)>);

impl Samples {
    /// The latencies observed in `[from, to)`, sorted.
    pub fn window(&self, from: Duration, to: Duration) -> Vec<Duration> {
        let mut w: Vec<Duration> = self
            .0
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, l)| *l)
            .collect();
        w.sort();
        w
    }

    /// Every latency, sorted.
    pub fn sorted(&self) -> Vec<Duration> {
        self.window(Duration::ZERO, Duration::MAX)
    }
}

/// `rate` transactions/s on a thread, runtime and connection of their own
/// (started at once), until `count` have run, if given, or `stop` turns
/// true; each commit's latency at its start's offset from `started`.
pub fn apart(
    pool: &PgPool,
    rate: u64,
    count: Option<u64>,
    started: Instant,
    stop: watch::Receiver<bool>,
) -> impl Future<Output = Result<Samples, String>> + Send + 'static {
    let options = pool.connect_options();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let result = rt.block_on(async move {
            let own = PgPoolOptions::new()
                .max_connections(1)
                .connect_with((*options).clone())
                .await
                .map_err(|e| e.to_string())?;
            let samples = commits(&own, rate, count, started, stop)
                .await
                .map_err(|e| e.to_string());
            own.close().await;
            samples
        });
        let _ = tx.send(result);
    });
    async move {
        rx.await
            .map_err(|_| "the foreground's thread ended".to_owned())?
    }
}

/// The transactions of [`apart`], on a connection of `pool`'s.
async fn commits(
    pool: &PgPool,
    rate: u64,
    count: Option<u64>,
    started: Instant,
    mut stop: watch::Receiver<bool>,
) -> Result<Samples, Box<dyn std::error::Error>> {
    let publisher = Publisher::new(pool.clone());
    let every = Duration::from_micros(1_000_000 / rate);
    let mut next = tokio::time::Instant::now();
    let mut samples = Samples::default();
    for i in 0..count.unwrap_or(u64::MAX) as usize {
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            Ok(()) = stop.changed() => break,
        }
        next += every;
        let t = Instant::now();
        let mut tx = pool.begin().await?;
        sqlx::query("INSERT INTO orders (id, note) VALUES ($1, 'foreground')")
            .bind(i as i64)
            .execute(&mut *tx)
            .await?;
        publisher.publish_tx(&mut tx, &benches::envelope(i)).await?;
        tx.commit().await?;
        samples.0.push((t - started, t.elapsed()));
    }
    Ok(samples)
}
