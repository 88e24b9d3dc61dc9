//! Operator functions on the outbox: list parked rows and unpark them with a
//! fresh attempts budget, so the drainer republishes them. The HTTP surface
//! that exposes these comes with the consumer half.

use crate::core::ports::{OutboxStore, ParkedFilter, ParkedRow, UnparkSelector};
use crate::error::StoreError;

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
