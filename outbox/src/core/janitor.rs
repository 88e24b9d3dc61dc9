//! The retention janitors: the outbox's deletes published rows older than
//! the retention period, the inbox's deletes processed rows, both in bounded
//! batches once per interval. Neither touches an unpublished or unprocessed
//! row (parked, dead-lettered or not): lease recovery is the claim's job,
//! and replay needs every unprocessed inbox row.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::ports::{Clock, InboxStore, OutboxStore};
use super::sleep_or_shutdown;
use crate::config::DrainerConfig;
use crate::error::StoreError;

/// Most DELETE statements in one sweep, so a huge backlog of expired rows is
/// worked off over several intervals instead of one endless loop.
pub const SWEEP_BATCHES_MAX: u32 = 1000;

/// One sweep: deletes expired published rows, `janitor_batch` at a time, until
/// a batch comes back short or [`SWEEP_BATCHES_MAX`] is reached. Returns the
/// number of rows deleted.
pub async fn sweep<S: OutboxStore>(store: &S, config: &DrainerConfig) -> Result<u64, StoreError> {
    sweep_batches(config.janitor_batch, || {
        store.outbox_delete_published(config.retention, config.janitor_batch)
    })
    .await
}

/// Sweeps every `janitor_interval` (the first sweep right away) until
/// `shutdown` turns true.
pub async fn run<S: OutboxStore, C: Clock>(
    store: Arc<S>,
    clock: Arc<C>,
    config: DrainerConfig,
    shutdown: watch::Receiver<bool>,
) {
    run_every(&*clock, config.janitor_interval, "outbox", shutdown, || {
        sweep(&*store, &config)
    })
    .await;
}

/// How the inbox janitor runs (ADR-018 amendment #433).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboxJanitorSettings {
    /// Processed rows older than this are deleted
    /// (`CANOPY_MQ_INBOX_RETENTION_DAYS`, default 7 days).
    pub retention: Duration,
    /// Time between sweeps (default one hour).
    pub interval: Duration,
    /// Rows per DELETE statement (default 1000).
    pub batch: u32,
}

impl Default for InboxJanitorSettings {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(7 * 86_400),
            interval: Duration::from_secs(3600),
            batch: 1000,
        }
    }
}

/// One inbox sweep: deletes processed rows past retention in batches;
/// unprocessed rows stay for replay.
pub async fn sweep_inbox<S: InboxStore>(
    store: &S,
    settings: &InboxJanitorSettings,
) -> Result<u64, StoreError> {
    sweep_batches(settings.batch, || {
        store.inbox_delete_processed(settings.retention, settings.batch)
    })
    .await
}

/// Sweeps the inbox every `interval` (the first sweep right away) until
/// `shutdown` turns true.
pub async fn run_inbox<S: InboxStore, C: Clock>(
    store: Arc<S>,
    clock: Arc<C>,
    settings: InboxJanitorSettings,
    shutdown: watch::Receiver<bool>,
) {
    run_every(&*clock, settings.interval, "inbox", shutdown, || {
        sweep_inbox(&*store, &settings)
    })
    .await;
}

/// Runs `delete` (one bounded DELETE) until a batch comes back short of
/// `batch` or [`SWEEP_BATCHES_MAX`] statements ran.
async fn sweep_batches<F, Fut>(batch: u32, mut delete: F) -> Result<u64, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let mut deleted = 0;
    for _ in 0..SWEEP_BATCHES_MAX {
        let n = delete().await?;
        deleted += n;
        if n < u64::from(batch) {
            break;
        }
    }
    Ok(deleted)
}

async fn run_every<C, F, Fut>(
    clock: &C,
    interval: Duration,
    table: &'static str,
    mut shutdown: watch::Receiver<bool>,
    mut sweep: F,
) where
    C: Clock,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    loop {
        match sweep().await {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(table, deleted, "retention sweep"),
            Err(e) => {
                tracing::warn!(table, error = %e, "retention sweep failed; retrying next interval")
            }
        }
        if sleep_or_shutdown(clock, interval, &mut shutdown).await {
            return;
        }
    }
}
