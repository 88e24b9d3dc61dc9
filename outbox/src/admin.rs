//! Operator functions: list parked outbox rows, unpark or skip them, and
//! [`ReplayTarget`], a subscription as an operator's tools see it (replay,
//! skip, list, counts). The `outbox-admin` crate serves them over HTTP.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use uuid::Uuid;

use crate::core::ports::{Clock, ConsumerBroker, InboxStore, OutboxStore};
use crate::core::subscriber::{Handler, Subscriber};
use crate::error::StoreError;

pub use crate::core::ports::{
    InboxCounts, InboxCursor, InboxFilter, InboxRow, ParkedCursor, ParkedFilter, ParkedRow,
    PayloadField, UnparkSelector,
};
pub use crate::core::subscriber::{ReplayOutcome, ReplayPage, SubscriberStats};

/// Most parked rows listed in one call.
pub const LIST_LIMIT_MAX: u32 = 1000;

/// Lists the parked rows `filter` selects, oldest parked first: at most
/// `filter.limit`, capped at [`LIST_LIMIT_MAX`] (see [`ParkedFilter`]).
pub async fn list_parked<S: OutboxStore>(
    store: &S,
    filter: &ParkedFilter,
) -> Result<Vec<ParkedRow>, StoreError> {
    let filter = ParkedFilter {
        limit: filter.limit.min(LIST_LIMIT_MAX),
        ..filter.clone()
    };
    store.outbox_list_parked(&filter).await
}

/// Unparks the selected rows, resetting their attempts to 0; the drainer
/// claims them on its next tick. Returns how many were unparked (ids that are
/// not parked are ignored).
pub async fn unpark<S: OutboxStore>(
    store: &S,
    selector: &UnparkSelector,
) -> Result<u64, StoreError> {
    let n = store.outbox_unpark(selector).await?;
    tracing::info!(unparked = n, ?selector, "outbox rows unparked by operator");
    Ok(n)
}

/// Skips the selected parked rows: they are marked done without being
/// published (recorded in `skipped_at`; the janitor deletes them with the
/// published rows), so the later events of their ordering keys go on.
/// Returns how many were skipped (ids that are not parked are ignored).
///
/// Skipping gives an event up: its subscribers never see it. Unpark instead
/// when the cause is fixed and the event should still be delivered.
pub async fn skip<S: OutboxStore>(store: &S, selector: &UnparkSelector) -> Result<u64, StoreError> {
    let n = store.outbox_skip(selector).await?;
    tracing::warn!(
        skipped = n,
        ?selector,
        "parked outbox rows skipped by operator"
    );
    Ok(n)
}

/// A boxed future, as [`ReplayTarget`]'s methods return it.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A subscriber as the admin surface sees it: replay. (Its counters reach
/// `/metrics` through the `metrics` facade.)
pub trait ReplayTarget: Send + Sync + 'static {
    /// The subscription (queue) name.
    fn subscription(&self) -> &str;
    /// Replays unprocessed rows of this subscription matching `filter`.
    fn replay<'a>(
        &'a self,
        filter: &'a InboxFilter,
    ) -> BoxFuture<'a, Result<ReplayPage, StoreError>>;
    /// Skips these dead-lettered rows of this subscription (see
    /// [`Subscriber::skip`]).
    fn skip<'a>(&'a self, ids: &'a [Uuid]) -> BoxFuture<'a, Result<ReplayPage, StoreError>>;
    /// Lists unprocessed rows of this subscription matching `filter` (the
    /// console's dead-letter list).
    fn list<'a>(
        &'a self,
        filter: &'a InboxFilter,
    ) -> BoxFuture<'a, Result<Vec<InboxRow>, StoreError>>;
    /// Its counters since it started.
    fn stats(&self) -> SubscriberStats;
    /// How its inbox stands (see [`Subscriber::inbox_counts`]).
    fn counts(&self, window: Duration, cap: u32) -> BoxFuture<'_, Result<InboxCounts, StoreError>>;
    /// Why it is not ready, if it is not (see
    /// [`Subscriber::readiness_reasons`]); `/readyz` includes it. None by
    /// default.
    fn readiness_reasons(&self) -> Vec<crate::UnreadyReason> {
        Vec::new()
    }
}

impl<S, B, C, H> ReplayTarget for Subscriber<S, B, C, H>
where
    S: InboxStore,
    B: ConsumerBroker,
    C: Clock,
    H: Handler<S::HandlerTx>,
{
    fn subscription(&self) -> &str {
        &self.settings().spec.queue
    }

    fn replay<'a>(
        &'a self,
        filter: &'a InboxFilter,
    ) -> BoxFuture<'a, Result<ReplayPage, StoreError>> {
        Box::pin(Subscriber::replay_page(self, filter))
    }

    fn skip<'a>(&'a self, ids: &'a [Uuid]) -> BoxFuture<'a, Result<ReplayPage, StoreError>> {
        Box::pin(Subscriber::skip(self, ids))
    }

    fn list<'a>(
        &'a self,
        filter: &'a InboxFilter,
    ) -> BoxFuture<'a, Result<Vec<InboxRow>, StoreError>> {
        Box::pin(Subscriber::list_unprocessed(self, filter))
    }

    fn stats(&self) -> SubscriberStats {
        self.counters().snapshot()
    }

    fn counts(&self, window: Duration, cap: u32) -> BoxFuture<'_, Result<InboxCounts, StoreError>> {
        Box::pin(Subscriber::inbox_counts(self, window, cap))
    }
    fn readiness_reasons(&self) -> Vec<crate::UnreadyReason> {
        Subscriber::readiness_reasons(self)
    }
}
