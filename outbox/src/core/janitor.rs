//! The retention janitor: deletes published rows older than the retention
//! period, in bounded batches, once per interval. It never touches an
//! unpublished row (parked or not): lease recovery is the claim's job.

use std::sync::Arc;

use tokio::sync::watch;

use super::ports::{Clock, OutboxStore};
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
    let mut deleted = 0;
    for _ in 0..SWEEP_BATCHES_MAX {
        let n = store
            .outbox_delete_published(config.retention, config.janitor_batch)
            .await?;
        deleted += n;
        if n < u64::from(config.janitor_batch) {
            break;
        }
    }
    Ok(deleted)
}

/// Sweeps every `janitor_interval` (the first sweep right away) until
/// `shutdown` turns true.
pub async fn run<S: OutboxStore, C: Clock>(
    store: Arc<S>,
    clock: Arc<C>,
    config: DrainerConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        match sweep(&*store, &config).await {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "outbox retention sweep"),
            Err(e) => {
                tracing::warn!(error = %e, "outbox retention sweep failed; retrying next interval")
            }
        }
        if sleep_or_shutdown(&*clock, config.janitor_interval, &mut shutdown).await {
            return;
        }
    }
}
