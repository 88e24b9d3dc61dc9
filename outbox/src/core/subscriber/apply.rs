//! Applying a batch in one transaction: inbox rows, handlers, the commit,
//! and what each delivery came to.

use tokio::sync::watch;
use tracing::Instrument;

use super::consume::Item;
use super::escalation::{BatchFailure, Escalation, Next, Pass};
use super::outcome::DeliveryOutcome;
use super::{Handler, RETRY_BACKOFF_MAX, RETRY_BACKOFF_MIN, Subscriber};
use crate::core::drainer::LAST_ERROR_MAX_CHARS;
use crate::core::marks::{Mark, Marks};
use crate::core::ports::{
    AttemptRecord, Clock, ConsumerBroker, InboxStore, InsertOutcome, TxBounds,
};
use crate::core::{sleep_or_shutdown, truncate_chars};
use crate::error::StoreError;

/// What one delivery of a transaction came to (with its commit).
pub(super) enum Applied {
    Processed,
    Duplicate,
    /// An earlier event of its key waits for its retry: not handled.
    Deferred,
    /// An earlier event of its key is dead-lettered: recorded held.
    Held,
    /// The handler failed with this error; its attempt is recorded.
    Failed(AttemptRecord, String),
}

/// The slots of `items` whose handlers ran with an `Ok` (by `applied`).
pub(super) fn processed_of(items: &[&Item<'_>], applied: &[Applied]) -> Vec<usize> {
    items
        .iter()
        .zip(applied)
        .filter(|(_, a)| matches!(a, Applied::Processed))
        .map(|(item, _)| item.slot)
        .collect()
}

/// The failures recorded so far in a transaction: (slot, error).
pub(super) fn failures_of(items: &[&Item<'_>], applied: &[Applied]) -> Vec<(usize, String)> {
    items
        .iter()
        .zip(applied)
        .filter_map(|(item, a)| match a {
            Applied::Failed(_, error) => Some((item.slot, error.clone())),
            _ => None,
        })
        .collect()
}

/// Text fit for `last_error`: bounded, and without the NUL character
/// PostgreSQL's `text` refuses (it would make the record itself fail).
pub(super) fn storable(text: &str) -> String {
    truncate_chars(text, LAST_ERROR_MAX_CHARS).replace('\0', "\u{FFFD}")
}

/// The recorded failure of a handler whose `Ok` cannot commit.
pub(super) fn cannot_commit(e: &StoreError) -> String {
    storable(&format!(
        "the handler returned Ok but its transaction cannot commit: {e}"
    ))
}

/// Why one delivery ended its transaction.
pub(super) enum Abort {
    Store(StoreError),
    /// Its handler failed with this error in an optimistic pass.
    Handler(String),
    /// Its handler was given up on mid-run: the transaction must end at the
    /// server. `failure` is the handler's failure to record, if the
    /// overrun or panic counts; otherwise it was database trouble (`e`).
    Abandoned {
        failure: Option<String>,
        e: StoreError,
    },
}

impl From<StoreError> for Abort {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl Abort {
    /// Whether a statement of the transaction may still run at the server.
    pub(super) fn leaves_statement_running(&self) -> bool {
        matches!(self, Self::Abandoned { .. })
    }

    /// The transaction's failure, for the delivery at `index` (its `slot`),
    /// given the `failures` recorded before it in the same transaction and
    /// the slots whose handlers ran with an `Ok` before it (`ran_ok`).
    /// `last_ok` is the slot of the item whose handler last returned `Ok`
    /// in the transaction (and the marks), which an aborted transaction
    /// blames.
    pub(super) fn into_failure(
        self,
        index: usize,
        slot: usize,
        mut failures: Vec<(usize, String)>,
        ran_ok: Vec<usize>,
        last_ok: Option<(usize, &Marks)>,
    ) -> BatchFailure {
        match self {
            Self::Store(StoreError::Refused(reason)) => BatchFailure::Refused {
                index,
                reason,
                failures,
            },
            // Our statement found the transaction aborted: the handler that
            // ran last swallowed its statement's error.
            Self::Store(e @ StoreError::Aborted(_)) if last_ok.is_some() => {
                let (culprit, marks) = last_ok.expect("checked");
                marks.hit(Mark::HandlerTxCannotCommit);
                failures.push((culprit, cannot_commit(&e)));
                BatchFailure::HandlerFailed { failures, ran_ok }
            }
            Self::Store(e) if e.is_unavailable() => BatchFailure::trouble(e, failures),
            // A statement of ours failed for no reason of the database's:
            // a handler left the transaction aborted, or its data broke
            // something; the next pass finds which.
            Self::Store(e) => BatchFailure::Culpable {
                error: e.to_string(),
                failures,
            },
            Self::Handler(text)
            | Self::Abandoned {
                failure: Some(text),
                ..
            } => {
                failures.push((slot, text));
                BatchFailure::HandlerFailed { failures, ran_ok }
            }
            Self::Abandoned { failure: None, e } => BatchFailure::trouble(e, failures),
        }
    }
}

impl<S, B, C, H> Subscriber<S, B, C, H>
where
    S: InboxStore,
    B: ConsumerBroker,
    C: Clock,
    H: Handler<S::HandlerTx>,
{
    /// Applies `items` until each is decided: in one transaction while
    /// that works, escalating when it does not (see [`Escalation`]), and
    /// repeated with a backoff while the database is unavailable. Fills in
    /// the outcome of each; a delivery whose data the inbox refuses is
    /// decided (dead-lettered) and the rest run again without it; at
    /// shutdown, what is undecided is requeued.
    pub(super) async fn apply_until_decided(
        &self,
        items: &[Item<'_>],
        outcomes: &mut [Option<DeliveryOutcome>],
        shutdown: &watch::Receiver<bool>,
    ) {
        let mut backoff = RETRY_BACKOFF_MIN;
        let mut shutdown = shutdown.clone();
        let mut escalation = Escalation::default();
        let mut in_place = None;
        loop {
            let live: Vec<&Item<'_>> = items
                .iter()
                .filter(|i| outcomes[i.slot].is_none())
                .collect();
            if live.is_empty() {
                return;
            }
            escalation.rescope(outcomes);
            let group = escalation.group(&live);
            let pass = escalation.pass();
            let failure = match self.apply(&group, self.settings.max_attempts, pass).await {
                Ok(applied) => {
                    for (item, applied) in group.iter().zip(applied) {
                        outcomes[item.slot] = Some(self.outcome_of(item, applied));
                    }
                    continue;
                }
                Err(failure) => failure,
            };
            let error = match escalation.after(&group, failure, &self.marks) {
                Next::Again => continue,
                Next::Refused { index, reason } => {
                    let item = group[index];
                    outcomes[item.slot] = Some(self.refused(item, reason, live.len()));
                    continue;
                }
                Next::RetryInPlace(e) => e,
            };
            self.marks.hit(Mark::InboxRetriedInPlace);
            self.retried_in_place(&mut in_place, &error, group.len());
            if sleep_or_shutdown(&*self.clock, backoff, &mut shutdown).await {
                self.marks.hit(Mark::RequeuedAtShutdown);
                for item in live {
                    outcomes[item.slot] = Some(DeliveryOutcome::Requeued);
                }
                return;
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// A batch's inbox statements failed again (not on a delivery's data):
    /// registered as retried in place (readiness fails past
    /// [`RETRY_IN_PLACE_GRACE`](super::RETRY_IN_PLACE_GRACE)), said in the
    /// log at its first failure and then once per
    /// [`RETRY_IN_PLACE_LOG_EVERY`](super::RETRY_IN_PLACE_LOG_EVERY), not
    /// once per retry.
    fn retried_in_place<'h>(
        &'h self,
        in_place: &mut Option<super::health::InPlace<'h>>,
        error: &StoreError,
        deliveries: usize,
    ) {
        let queue = &self.settings.spec.queue;
        let now = self.clock.now();
        let text = error.to_string();
        match in_place {
            None => {
                *in_place = Some(self.health.in_place(now, &text));
                tracing::warn!(
                    queue = %queue,
                    deliveries,
                    error = %error,
                    "inbox statements failed; retrying the deliveries in place, no attempt counted"
                );
            }
            Some(batch) => {
                batch.failed_again(&text);
                if now.saturating_sub(batch.logged) >= super::RETRY_IN_PLACE_LOG_EVERY {
                    batch.logged = now;
                    tracing::warn!(
                        queue = %queue,
                        deliveries,
                        error = %error,
                        retried_secs = now.saturating_sub(batch.since).as_secs(),
                        "inbox statements still failing; the deliveries are still retried in place"
                    );
                }
            }
        }
    }

    /// A delivery whose data the inbox refused: dead-lettered at once.
    pub(super) fn refused(&self, item: &Item<'_>, reason: String, batch: usize) -> DeliveryOutcome {
        self.marks.hit(Mark::Unstorable);
        if batch > 1 {
            self.marks.hit(Mark::BatchRerunWithoutRefused);
        }
        let _entered = item.span.enter();
        tracing::error!(
            queue = %self.settings.spec.queue,
            event_id = %item.entry.event_id,
            error = %reason,
            "the inbox refuses this delivery's data; dead-lettering it"
        );
        DeliveryOutcome::Unstorable { reason }
    }

    /// The outcome of one applied delivery.
    pub(super) fn outcome_of(&self, item: &Item<'_>, applied: Applied) -> DeliveryOutcome {
        match applied {
            Applied::Processed => DeliveryOutcome::Processed,
            Applied::Duplicate => DeliveryOutcome::Duplicate,
            Applied::Deferred => DeliveryOutcome::Deferred,
            Applied::Held => DeliveryOutcome::Held,
            Applied::Failed(record, _) if record.dead_lettered => {
                self.marks.hit(Mark::DeadLetteredAtBudget);
                let _entered = item.span.enter();
                tracing::warn!(
                    queue = %item.entry.subscription,
                    event_id = %item.entry.event_id,
                    attempts = record.attempts,
                    "handler failed for the last time; dead-lettering"
                );
                DeliveryOutcome::DeadLettered {
                    attempts: record.attempts,
                }
            }
            Applied::Failed(record, _) => DeliveryOutcome::Retrying {
                attempts: record.attempts,
            },
        }
    }

    /// BEGIN; per item, in its span: try_insert, then the handler and mark
    /// processed; a check that the work can commit if a handler wrote
    /// last; COMMIT. Every outcome takes effect with the commit: a commit
    /// whose outcome is unknown is retried like any store error, and the
    /// next attempt finds what did commit. Any failure ends the whole
    /// transaction (at the server, when a handler was given up on
    /// mid-statement), a handler's included in an optimistic pass; with
    /// savepoints, a failed handler (or one `pass` knows failed, or one
    /// whose work the check finds cannot commit) rolls back to its item's
    /// savepoint and its attempt is recorded against `max_attempts`.
    pub(super) async fn apply(
        &self,
        items: &[&Item<'_>],
        max_attempts: u32,
        pass: Pass<'_>,
    ) -> Result<Vec<Applied>, BatchFailure> {
        let bounds = TxBounds::for_handler(self.settings.handler_timeout);
        let mut tx = self
            .store
            .inbox_begin(bounds)
            .await
            .map_err(|e| BatchFailure::trouble(e, Vec::new()))?;
        if let Err(e) = self.lock_keys(&mut tx, items).await {
            self.store.inbox_rollback(tx).await;
            // Blamed on the first keyed delivery (only they take locks).
            let index = items
                .iter()
                .position(|i| i.entry.ordering.is_some())
                .unwrap_or(0);
            let abort = Abort::from(e);
            return Err(abort.into_failure(index, items[index].slot, Vec::new(), Vec::new(), None));
        }
        let mut applied = Vec::with_capacity(items.len());
        let mut handler_wrote_last = false;
        // The slot of the item whose handler ran last with an `Ok`: our own
        // statements never swallow an error, so a transaction found aborted
        // after it was aborted by it.
        let mut last_ok: Option<usize> = None;
        for (index, item) in items.iter().enumerate() {
            let one = self
                .apply_one(&mut tx, item, max_attempts, pass)
                .instrument(item.span.clone())
                .await;
            match one {
                Ok((a, wrote_last)) => {
                    if matches!(a, Applied::Processed) {
                        last_ok = Some(item.slot);
                    }
                    applied.push(a);
                    handler_wrote_last = wrote_last;
                }
                Err(abort) => {
                    let failures = failures_of(items, &applied);
                    if abort.leaves_statement_running() {
                        self.marks.hit(Mark::HandlerTxAbandoned);
                        self.store.inbox_abandon(tx).await;
                    } else {
                        self.store.inbox_rollback(tx).await;
                    }
                    let last_ok = last_ok.map(|slot| (slot, &self.marks));
                    let ran_ok = processed_of(items, &applied);
                    return Err(abort.into_failure(index, item.slot, failures, ran_ok, last_ok));
                }
            }
        }
        self.commit_applied(tx, items, applied, handler_wrote_last, last_ok)
            .await
    }

    /// Commits an applied batch: first, if a handler wrote last, a check
    /// that its work can commit.
    async fn commit_applied(
        &self,
        mut tx: S::Tx,
        items: &[&Item<'_>],
        applied: Vec<Applied>,
        handler_wrote_last: bool,
        last_ok: Option<usize>,
    ) -> Result<Vec<Applied>, BatchFailure> {
        // A handler's statement that failed, its error swallowed, leaves
        // the transaction aborted, and PostgreSQL answers its COMMIT with a
        // rollback and no error: never take that for committed. Any later
        // statement of ours would have failed, so only a handler that
        // wrote last needs the check.
        if handler_wrote_last && let Err(e) = self.store.inbox_check(&mut tx).await {
            let mut failures = failures_of(items, &applied);
            self.store.inbox_rollback(tx).await;
            if let (StoreError::Aborted(_), Some(slot)) = (&e, last_ok) {
                self.marks.hit(Mark::HandlerTxCannotCommit);
                failures.push((slot, cannot_commit(&e)));
                return Err(BatchFailure::HandlerFailed {
                    failures,
                    ran_ok: processed_of(items, &applied),
                });
            }
            return Err(BatchFailure::of_transaction(e, failures, false));
        }
        if let Err(e) = self.store.inbox_commit(tx).await {
            // A COMMIT that did not answer may have committed.
            return Err(BatchFailure::of_transaction(
                e,
                failures_of(items, &applied),
                true,
            ));
        }
        if items.len() > 1 {
            self.marks.hit(Mark::BatchCommitted);
        }
        Ok(applied)
    }

    /// The key locks of the keyed deliveries among `items`, all in one
    /// call, first in their transaction (none if none is keyed).
    pub(super) async fn lock_keys(
        &self,
        tx: &mut S::Tx,
        items: &[&Item<'_>],
    ) -> Result<(), StoreError> {
        let keys: Vec<&str> = items
            .iter()
            .filter_map(|i| i.entry.ordering.map(|o| o.key.as_str()))
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        self.store
            .inbox_lock_keys(tx, &self.settings.spec.queue, &keys)
            .await
    }

    /// One item of [`apply`](Self::apply), in its transaction: what it came
    /// to, and whether its handler's statements were the transaction's
    /// last (nothing of ours ran after them to show they left it usable).
    pub(super) async fn apply_one(
        &self,
        tx: &mut S::Tx,
        item: &Item<'_>,
        max_attempts: u32,
        pass: Pass<'_>,
    ) -> Result<(Applied, bool), Abort> {
        let entry = &item.entry;
        let inserted = self.store.inbox_try_insert(tx, entry).await?;
        self.marks.hit(match inserted {
            InsertOutcome::Inserted => Mark::InboxInserted,
            InsertOutcome::InFlightRetry { .. } => Mark::InFlightRetry,
            InsertOutcome::AlreadyProcessed => Mark::AlreadyProcessed,
            InsertOutcome::BehindRetry => Mark::DeferredBehindKey,
            InsertOutcome::Held => Mark::HeldBehindKey,
        });
        match inserted {
            InsertOutcome::AlreadyProcessed => return Ok((Applied::Duplicate, false)),
            InsertOutcome::BehindRetry => return Ok((Applied::Deferred, false)),
            InsertOutcome::Held => return Ok((Applied::Held, false)),
            InsertOutcome::Inserted | InsertOutcome::InFlightRetry { .. } => {}
        }
        // A trusted delivery runs as in an optimistic pass.
        let pass = match pass {
            Pass::Savepoints { failed, trusted }
                if trusted.contains(&item.slot) && !failed.contains_key(&item.slot) =>
            {
                Pass::Optimistic
            }
            pass => pass,
        };
        let known = match pass {
            Pass::Optimistic => None,
            Pass::Savepoints { failed, .. } => {
                self.store.inbox_savepoint(tx).await?;
                failed.get(&item.slot)
            }
        };
        let failure = match known {
            // Its failure is known from a pass that rolled back: one
            // failure, one attempt, one handler run.
            Some(text) => text.clone(),
            None => match self.handle_one(tx, item, pass).await? {
                None => {
                    // A row this transaction inserted carries its mark already.
                    if inserted != InsertOutcome::Inserted {
                        match self.store.inbox_mark_processed(tx, entry).await {
                            Ok(()) => {}
                            // Its handler left the transaction aborted.
                            Err(e @ StoreError::Aborted(_)) => {
                                self.marks.hit(Mark::HandlerTxCannotCommit);
                                return Err(Abort::Handler(cannot_commit(&e)));
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                    let wrote_last =
                        inserted == InsertOutcome::Inserted && matches!(pass, Pass::Optimistic);
                    return Ok((Applied::Processed, wrote_last));
                }
                Some(text) => text,
            },
        };
        let record = self
            .store
            .inbox_record_failure(tx, entry, &failure, max_attempts)
            .await?;
        Ok((Applied::Failed(record, failure), false))
    }
}
