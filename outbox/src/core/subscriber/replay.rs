//! Replay and skip: the operator's way back for dead-lettered events, and
//! the release of an ordered key's held rows.

use std::sync::atomic::AtomicBool;

use tracing::{Instrument, Span, field::Empty};

use super::apply::Applied;
use super::consume::Item;
use super::escalation::{Escalation, Level, Next};
use super::outcome::DeliveryOutcome;
use super::{Handler, RETRY_BACKOFF_MIN, Subscriber};
use crate::core::marks::Mark;
use crate::core::ports::{
    Clock, ConsumerBroker, InboxCursor, InboxEntry, InboxFilter, InboxRow, InboxStore, KeySeq,
    LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX,
};
use crate::envelope::EventEnvelope;
use crate::error::StoreError;

/// Rows a replay reads from the inbox at a time.
pub const REPLAY_PAGE: usize = 100;

/// What a replay did, and where more rows match.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReplayPage {
    /// Each row replayed (or skipped), oldest first, and what it came to.
    pub results: Vec<(uuid::Uuid, ReplayOutcome)>,
    /// On an ordered subscription: the held rows a row that took effect
    /// (or was skipped) released, each replayed in its key's order, and
    /// what it came to; not counted against the limit.
    pub released: Vec<(uuid::Uuid, ReplayOutcome)>,
    /// Where the rest begins (the filter's `after`), if more rows match.
    pub next: Option<InboxCursor>,
}

/// What a replay of one inbox row did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReplayOutcome {
    /// The handler's effect committed.
    Applied,
    /// It had taken effect meanwhile; the handler did not run.
    AlreadyProcessed,
    /// The handler failed again; the failure is recorded on the row.
    Failed {
        /// The handler's error.
        error: String,
    },
    /// The stored payload is not an envelope.
    Undecodable {
        /// Why.
        reason: String,
    },
    /// An earlier event of its ordering key is still unprocessed (on an
    /// ordered subscription): it stays held behind that one; replay or
    /// skip that one first.
    Held,
    /// Skipped by an operator: marked processed without its effect.
    Skipped,
}

impl<S, B, C, H> Subscriber<S, B, C, H>
where
    S: InboxStore,
    B: ConsumerBroker,
    C: Clock,
    H: Handler<S::HandlerTx>,
{
    /// Re-runs the handler, with the inbox's semantics, for unprocessed
    /// rows of this subscription matching `filter` (up to its limit), each
    /// given a fresh budget right before its own attempt (so a replay cut
    /// short leaves the rows it did not reach as they were: still
    /// dead-lettered, still findable). No broker is involved: a
    /// dead-lettered delivery stays in `<queue>.dlq` for the record; its
    /// effect comes from here. On an ordered subscription a row that takes
    /// effect releases its key's held rows, replayed in the key's order and
    /// listed after the rows asked for. See
    /// [`replay_page`](Self::replay_page) for where to go on from.
    pub async fn replay(
        &self,
        filter: &InboxFilter,
    ) -> Result<Vec<(uuid::Uuid, ReplayOutcome)>, StoreError> {
        self.replay_page(filter).await.map(|mut page| {
            page.results.append(&mut page.released);
            page.results
        })
    }

    /// [`replay`](Self::replay), saying where more rows match: `next` is
    /// the place to pass as the filter's `after` for the rest (rows that
    /// failed again are then not met again), `None` when no more rows
    /// matched. Rows are read [`REPLAY_PAGE`] at a time, not all at once.
    pub async fn replay_page(&self, filter: &InboxFilter) -> Result<ReplayPage, StoreError> {
        let queue = &self.settings.spec.queue;
        let span = tracing::info_span!(
            "outbox.replay",
            messaging.destination.subscription.name = %queue,
            outbox.rows = Empty,
        );
        self.replay_rows(filter).instrument(span).await
    }

    pub(super) async fn replay_rows(&self, filter: &InboxFilter) -> Result<ReplayPage, StoreError> {
        let limit = filter
            .limit
            .unwrap_or(LIST_LIMIT_DEFAULT)
            .clamp(1, LIST_LIMIT_MAX) as usize;
        let mut page = filter.clone();
        page.subscription = Some(self.settings.spec.queue.clone());
        // A replay runs what it lists.
        page.omit_payload = false;
        let mut results = Vec::new();
        let mut released = Vec::new();
        loop {
            let want = (limit - results.len()).min(REPLAY_PAGE);
            // One row more than wanted says whether more match.
            page.limit = Some(want as u32 + 1);
            let mut rows = self.store.inbox_list_unprocessed(&page).await?;
            let more = rows.len() > want;
            rows.truncate(want);
            let last = rows.last().map(InboxCursor::of);
            for row in rows {
                // A held row this replay already released: replayed.
                if let Some(at) = released
                    .iter()
                    .position(|(id, _): &(uuid::Uuid, _)| *id == row.event_id)
                {
                    results.push(released.remove(at));
                    continue;
                }
                let outcome = self.replay_row(&row).await?;
                let took_effect = outcome == ReplayOutcome::Applied;
                results.push((row.event_id, outcome));
                if took_effect && let Some(o) = &row.ordering {
                    self.release_held(o, &mut released).await;
                }
            }
            Span::current().record("outbox.rows", results.len());
            if !more || results.len() >= limit {
                let next = if more { last } else { None };
                return Ok(ReplayPage {
                    results,
                    released,
                    next,
                });
            }
            page.after = last;
        }
    }

    /// Skips these dead-lettered rows (see [`InboxStore::inbox_skip`]):
    /// marked processed without their effect. Each skipped row of an
    /// ordering key then releases the key's held rows, replayed in the
    /// key's order until one does not take effect (it is dead-lettered
    /// then, and the rest stay held behind it). Returns each skipped row
    /// ([`ReplayOutcome::Skipped`]) and each released row with what its
    /// replay came to. Ids that are not dead-lettered rows of this
    /// subscription are ignored.
    pub async fn skip(&self, ids: &[uuid::Uuid]) -> Result<ReplayPage, StoreError> {
        let queue = &self.settings.spec.queue;
        let skipped = self.store.inbox_skip(queue, ids).await?;
        tracing::warn!(queue = %queue, skipped = skipped.len(), "dead-lettered inbox rows skipped by operator");
        let (mut results, mut released) = (Vec::new(), Vec::new());
        for row in skipped {
            results.push((row.event_id, ReplayOutcome::Skipped));
            if let Some(o) = &row.ordering {
                self.release_held(o, &mut released).await;
            }
        }
        Ok(ReplayPage {
            results,
            released,
            next: None,
        })
    }

    /// `o` took effect (replayed) or was skipped: its key's held rows are
    /// replayed in the key's order, each appended to `results`, until one
    /// does not take effect (a held row a replay released before, still
    /// held, is not replayed twice).
    ///
    /// Database trouble ends the release, not the replay or skip that
    /// asked for it: what it did not reach stays held, and the
    /// subscriber's own sweep releases it within [`RELEASE_EVERY`].
    pub(super) async fn release_held(
        &self,
        o: &KeySeq,
        results: &mut Vec<(uuid::Uuid, ReplayOutcome)>,
    ) {
        let queue = &self.settings.spec.queue;
        let mut after = o.seq;
        let stopped = |e: StoreError| {
            tracing::warn!(queue = %queue, key = ?o.key, error = %e, "releasing held rows stopped on the database; the rest are released later");
        };
        loop {
            let rows = match self
                .store
                .inbox_held(queue, &o.key, after, REPLAY_PAGE as u32)
                .await
            {
                Ok(rows) => rows,
                Err(e) => return stopped(e),
            };
            if rows.is_empty() {
                return;
            }
            for row in rows {
                after = row.ordering.as_ref().map_or(after, |k| k.seq);
                self.marks.hit(Mark::HeldReleased);
                let outcome = match self.release_row(&row).await {
                    Ok(outcome) => outcome,
                    Err(e) => return stopped(e),
                };
                let went_on = matches!(
                    outcome,
                    ReplayOutcome::Applied | ReplayOutcome::AlreadyProcessed
                );
                results.push((row.event_id, outcome));
                if !went_on {
                    return;
                }
            }
        }
    }

    /// One stored row replayed.
    pub(super) async fn replay_row(&self, row: &InboxRow) -> Result<ReplayOutcome, StoreError> {
        self.replay_row_with(row, true, 1).await
    }

    /// A held row released: replayed with the attempt budget a delivery has
    /// (`max_attempts`, retried in place after [`RETRY_BACKOFF_MIN`]), since
    /// it never had a delivery's retries; it is dead-lettered, the key's
    /// new head, only once it failed them all.
    ///
    /// A held row whose payload is no envelope (a delivery given up on at
    /// once, recorded behind a dead-lettered event) cannot run: it is
    /// dead-lettered at once, the key's new head, for an operator to skip.
    pub(super) async fn release_row(&self, row: &InboxRow) -> Result<ReplayOutcome, StoreError> {
        let budget = self.settings.max_attempts.max(1);
        let mut attempt = 1;
        loop {
            let outcome = self.replay_row_with(row, attempt == 1, budget).await?;
            if let ReplayOutcome::Undecodable { reason } = &outcome {
                let entry = InboxEntry {
                    event_id: row.event_id,
                    subscription: &row.subscription,
                    routing_key: &row.routing_key,
                    payload: &row.payload,
                    fresh_budget: false,
                    ordering: row.ordering.as_ref(),
                };
                self.record_given_up(&entry, reason).await?;
                return Ok(outcome);
            }
            if !matches!(outcome, ReplayOutcome::Failed { .. }) || attempt >= budget {
                return Ok(outcome);
            }
            attempt += 1;
            self.clock.sleep(RETRY_BACKOFF_MIN).await;
        }
    }

    /// One stored row replayed against `budget` attempts, its budget reset
    /// first if `fresh`.
    pub(super) async fn replay_row_with(
        &self,
        row: &InboxRow,
        fresh: bool,
        budget: u32,
    ) -> Result<ReplayOutcome, StoreError> {
        let envelope = match EventEnvelope::decode_delivery(&row.payload) {
            Err(reason) => return Ok(ReplayOutcome::Undecodable { reason }),
            Ok(envelope) => envelope,
        };
        let item = Item {
            slot: 0,
            entry: InboxEntry {
                event_id: row.event_id,
                subscription: &row.subscription,
                routing_key: &row.routing_key,
                payload: &row.payload,
                fresh_budget: fresh,
                ordering: row.ordering.as_ref(),
            },
            envelope: &envelope,
            span: Span::current(),
            // A replay has no retry in place: its first overrun with the
            // database answering is the handler's.
            overran: AtomicBool::new(true),
        };
        Ok(self.replay_outcome(self.replay_one(&item, budget).await?))
    }

    /// One replayed row, escalated like a delivery until decided, but
    /// never retried in place: database trouble is the operator's answer.
    /// An operator's replay has a budget of 1: a row whose handler fails
    /// again is in no queue any more, so it stays dead-lettered until the
    /// next replay, or nothing would ever run it again. Found by the
    /// simulation (producer_and_consumer_swarm, seed 43). A released held
    /// row has a delivery's budget ([`release_row`](Self::release_row)).
    pub(super) async fn replay_one(
        &self,
        item: &Item<'_>,
        budget: u32,
    ) -> Result<Applied, StoreError> {
        let mut escalation = Escalation::starting(Level::Savepoints);
        let group = [item];
        loop {
            let failure = match self.apply(&group, budget, escalation.pass()).await {
                Ok(mut applied) => return Ok(applied.pop().expect("one item, one outcome")),
                Err(failure) => failure,
            };
            match escalation.after(&group, failure, &self.marks) {
                Next::Again => {}
                Next::Refused { reason, .. } => return Err(StoreError::Refused(reason)),
                Next::RetryInPlace(e) => return Err(e),
            }
        }
    }

    /// What a replayed row's attempt came to, counted.
    pub(super) fn replay_outcome(&self, applied: Applied) -> ReplayOutcome {
        match applied {
            Applied::Processed => {
                self.marks.hit(Mark::ReplayApplied);
                self.counters
                    .count(&DeliveryOutcome::Processed, &self.settings.spec.queue);
                ReplayOutcome::Applied
            }
            Applied::Duplicate => {
                self.marks.hit(Mark::ReplayAlreadyProcessed);
                ReplayOutcome::AlreadyProcessed
            }
            Applied::Failed(_, error) => {
                self.marks.hit(Mark::ReplayFailedAgain);
                ReplayOutcome::Failed { error }
            }
            Applied::Deferred | Applied::Held => ReplayOutcome::Held,
        }
    }
}
