//! The retention janitors: the outbox's deletes published rows older than
//! the retention period, the inbox's deletes processed rows, both in bounded
//! batches once per interval. On the partitioned layout each
//! sweep first creates the partitions ahead and drops whole the partitions
//! whose every row expired ([`OutboxStore::outbox_retire_partitions`]);
//! the row deletes then take only what no drop will, and a second pass
//! drops what closed while they ran. Neither touches an
//! unpublished or unprocessed row (parked, dead-lettered or not): lease
//! recovery is the claim's job, and replay needs every unprocessed inbox
//! row.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::Instrument;

use super::drainer::DrainerConfig;
use super::marks::{Mark, Marks};
use super::ports::{Clock, InboxStore, OutboxStore, PartitionsRetired};
use super::sleep_or_shutdown;
use crate::error::StoreError;

/// Statements between two progress lines of a sweep that is catching up
/// (a million rows at the default batch).
pub const SWEEP_PROGRESS_EVERY: u32 = 1000;

/// One sweep: deletes expired published rows, `janitor_batch` at a time,
/// until a batch comes back short: every row past retention when it
/// started is gone (on the partitioned layout, but for the rows of a
/// closed partition whose newest row is still within retention: they go
/// whole with it). Returns the number of rows deleted one by one (not
/// those of the partitions dropped).
///
/// There is no bound on the statements of one sweep: rows expire as fast
/// as they were published a retention period ago, and a janitor that
/// deleted at most a fixed number per interval (an earlier version's
/// million an hour, 278 events/s) would fall behind for good above that
/// rate. Each statement is a short transaction of its own.
pub async fn sweep<S: OutboxStore>(store: &S, config: &DrainerConfig) -> Result<u64, StoreError> {
    sweep_outbox(store, config, &Marks::default(), never()).await
}

/// A shutdown signal that never fires (for one sweep run to its end).
fn never() -> watch::Receiver<bool> {
    watch::channel(false).1
}

async fn sweep_outbox<S: OutboxStore>(
    store: &S,
    config: &DrainerConfig,
    marks: &Marks,
    shutdown: watch::Receiver<bool>,
) -> Result<u64, StoreError> {
    sweep_table(
        Table::Outbox,
        config.janitor_batch,
        marks,
        &shutdown,
        || store.outbox_retire_partitions(config.retention),
        || store.outbox_delete_published(config.retention, config.janitor_batch),
    )
    .await
}

/// One sweep of `table`: a pass over its partitions (`retire`), its row
/// statements (`delete`, see [`sweep_batches`]), then, on the partitioned
/// layout and unless it is shutting down, a second pass. The row
/// statements leave a closed partition that no unfinished row holds to
/// the drop, and one that closed after the first pass (a sweep can outlast
/// a partition's width, or start just before a boundary) would otherwise
/// keep its expired rows until the next sweep. Returns the rows deleted
/// one by one.
async fn sweep_table<R, RF, D, DF>(
    table: Table,
    batch: u32,
    marks: &Marks,
    shutdown: &watch::Receiver<bool>,
    retire: R,
    delete: D,
) -> Result<u64, StoreError>
where
    R: Fn() -> RF,
    RF: Future<Output = Result<PartitionsRetired, StoreError>>,
    D: FnMut() -> DF,
    DF: Future<Output = Result<u64, StoreError>>,
{
    let first = retire().await?;
    note_partitions(table, &first, marks);
    let deleted = sweep_batches(batch, marks, shutdown, delete).await?;
    if first.partitioned && !*shutdown.borrow() {
        note_partitions(table, &retire().await?, marks);
    }
    Ok(deleted)
}

/// Logs and marks what a pass over the partitions did.
fn note_partitions(table: Table, retired: &PartitionsRetired, marks: &Marks) {
    if !retired.created.is_empty() {
        marks.hit(Mark::PartitionCreated);
    }
    if !retired.dropped.is_empty() {
        marks.hit(Mark::PartitionDropped);
    }
    if !retired.created.is_empty() || !retired.dropped.is_empty() {
        tracing::info!(
            table = table.name(),
            created = ?retired.created,
            dropped = ?retired.dropped,
            "partitions retired"
        );
    }
}

/// Sweeps every `janitor_interval` (the first sweep right away) until
/// `shutdown` turns true, reporting its paths to `marks`.
pub async fn run<S: OutboxStore, C: Clock>(
    store: Arc<S>,
    clock: Arc<C>,
    config: DrainerConfig,
    shutdown: watch::Receiver<bool>,
    marks: Marks,
) {
    let table = Table::Outbox;
    run_every(
        &*clock,
        config.janitor_interval,
        table,
        &marks,
        shutdown,
        |shutdown| sweep_outbox(&*store, &config, &marks, shutdown),
    )
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

/// One inbox sweep: deletes processed rows past retention in batches
/// until a batch comes back short (as [`sweep`]); unprocessed rows stay
/// for replay.
pub async fn sweep_inbox<S: InboxStore>(
    store: &S,
    settings: &InboxJanitorSettings,
) -> Result<u64, StoreError> {
    sweep_inbox_marked(store, settings, &Marks::default(), never()).await
}

async fn sweep_inbox_marked<S: InboxStore>(
    store: &S,
    settings: &InboxJanitorSettings,
    marks: &Marks,
    shutdown: watch::Receiver<bool>,
) -> Result<u64, StoreError> {
    sweep_table(
        Table::Inbox,
        settings.batch,
        marks,
        &shutdown,
        || store.inbox_retire_partitions(settings.retention),
        || store.inbox_delete_processed(settings.retention, settings.batch),
    )
    .await
}

/// Sweeps the inbox every `interval` (the first sweep right away) until
/// `shutdown` turns true, reporting its paths to `marks`.
pub async fn run_inbox<S: InboxStore, C: Clock>(
    store: Arc<S>,
    clock: Arc<C>,
    settings: InboxJanitorSettings,
    shutdown: watch::Receiver<bool>,
    marks: Marks,
) {
    run_every(
        &*clock,
        settings.interval,
        Table::Inbox,
        &marks,
        shutdown,
        |shutdown| sweep_inbox_marked(&*store, &settings, &marks, shutdown),
    )
    .await;
}

/// Runs `delete` (one bounded DELETE) until a batch comes back short of
/// `batch`, or `shutdown` turns true (checked between statements).
async fn sweep_batches<F, Fut>(
    batch: u32,
    marks: &Marks,
    shutdown: &watch::Receiver<bool>,
    mut delete: F,
) -> Result<u64, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let mut deleted = 0;
    for statements in 1u64.. {
        let n = delete().await?;
        deleted += n;
        if n < u64::from(batch) || *shutdown.borrow() {
            break;
        }
        marks.hit(Mark::SweepBatchFull);
        if statements % u64::from(SWEEP_PROGRESS_EVERY) == 0 {
            tracing::info!(deleted, "retention sweep catching up");
        }
    }
    Ok(deleted)
}

/// Which table a janitor sweeps (log field and marks).
#[derive(Debug, Clone, Copy)]
enum Table {
    Outbox,
    Inbox,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Table::Outbox => "outbox",
            Table::Inbox => "inbox",
        }
    }
}

async fn run_every<C, F, Fut>(
    clock: &C,
    interval: Duration,
    table: Table,
    marks: &Marks,
    mut shutdown: watch::Receiver<bool>,
    mut sweep: F,
) where
    C: Clock,
    F: FnMut(watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let name = table.name();
    let deleted_mark = match table {
        Table::Outbox => Mark::OutboxSweepDeleted,
        Table::Inbox => Mark::InboxSweepDeleted,
    };
    loop {
        let span = tracing::info_span!(
            "outbox.janitor",
            outbox.table = name,
            outbox.deleted = tracing::field::Empty,
        );
        let swept = sweep(shutdown.clone()).instrument(span.clone()).await;
        if let Ok(deleted) = swept {
            span.record("outbox.deleted", deleted);
        }
        drop(span);
        match swept {
            Ok(0) => {}
            Ok(deleted) => {
                marks.hit(deleted_mark);
                tracing::info!(table = name, deleted, "retention sweep");
            }
            Err(e) => {
                marks.hit(Mark::SweepFailed);
                tracing::warn!(table = name, error = %e, "retention sweep failed; retrying next interval")
            }
        }
        if sleep_or_shutdown(clock, interval, &mut shutdown).await {
            return;
        }
    }
}
