//! After a failed pass: which deliveries run again, how (optimistic or
//! with savepoints), and when a failure is a delivery's own.

use std::collections::{BTreeMap, BTreeSet};

use super::apply::cannot_commit;
use super::consume::Item;
use super::outcome::DeliveryOutcome;
use crate::core::marks::{Mark, Marks};
use crate::error::StoreError;

/// How [`Subscriber::apply`] runs a transaction of deliveries.
#[derive(Clone, Copy)]
pub(super) enum Pass<'a> {
    /// No savepoints (one round trip less per delivery): a handler failure
    /// ends the pass, to be run again with savepoints.
    Optimistic,
    /// A savepoint after each delivery's inbox row and a check after each
    /// handler's `Ok`; a handler that fails, or whose work cannot commit,
    /// rolls back to it and its attempt is recorded. The failures in
    /// `failed` (by slot) are recorded without running their handler again.
    /// The deliveries in `trusted` (by slot, none of `failed`), whose
    /// handlers ran with an `Ok` in the optimistic pass that failed, run as
    /// in an optimistic pass: no savepoint, no check of their own (a
    /// failure of theirs ends the pass again, now known).
    Savepoints {
        failed: &'a BTreeMap<usize, String>,
        trusted: &'a BTreeSet<usize>,
    },
}

/// Why a transaction of deliveries did not commit.
pub(super) enum BatchFailure {
    /// The inbox refused the data of the delivery at this index; the
    /// transaction rolled back, and `failures` were met before it.
    Refused {
        index: usize,
        reason: String,
        failures: Vec<(usize, String)>,
    },
    /// A handler failed (in an optimistic pass, or given up on mid-run):
    /// these failures, by slot, are known; the transaction rolled back.
    HandlerFailed {
        failures: Vec<(usize, String)>,
        ran_ok: Vec<usize>,
    },
    /// The transaction could not commit for a reason of the deliveries'
    /// own (not the database's availability): a check, a statement of
    /// ours or the COMMIT failed. It did not commit; `failures` were met
    /// on the way.
    Culpable {
        error: String,
        failures: Vec<(usize, String)>,
    },
    /// Database trouble: nobody's fault. Before the COMMIT the transaction
    /// surely did not commit, and `failures` are known; a COMMIT that did
    /// not answer may have committed (`in_doubt`), the failures it recorded
    /// with it.
    Store {
        e: StoreError,
        failures: Vec<(usize, String)>,
        in_doubt: bool,
    },
}

impl BatchFailure {
    /// Database trouble before the COMMIT, with the failures met so far.
    pub(super) fn trouble(e: StoreError, failures: Vec<(usize, String)>) -> Self {
        Self::Store {
            e,
            failures,
            in_doubt: false,
        }
    }

    /// A check (`at_commit` false) or a COMMIT of the whole transaction
    /// failed with `e`.
    pub(super) fn of_transaction(
        e: StoreError,
        failures: Vec<(usize, String)>,
        at_commit: bool,
    ) -> Self {
        if e.is_unavailable() {
            Self::Store {
                e,
                failures,
                in_doubt: at_commit,
            }
        } else {
            Self::Culpable {
                error: e.to_string(),
                failures,
            }
        }
    }
}

/// How far a group of deliveries has escalated to be decided.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Level {
    /// One transaction, no savepoints, one check before the COMMIT when a
    /// handler wrote last.
    #[default]
    Optimistic,
    /// One transaction, a savepoint and a check per delivery: a failure is
    /// found by delivery and rolled back alone.
    Savepoints,
    /// Each delivery in a transaction of its own (with savepoints): a
    /// COMMIT failed on the deliveries' data after every check passed.
    Alone,
}

/// What the next transaction of a group of deliveries is, given how the
/// last ones failed: the escalation that keeps retrying in place bounded
/// to database trouble. A handler failure reruns with savepoints (the
/// failure known, its handler not run again); a transaction that cannot
/// commit on the deliveries' own data (a check, a statement of ours or the
/// COMMIT failed, not for the database's availability) reruns with a check
/// per delivery, then each delivery alone, and a delivery alone whose
/// transaction cannot commit has failed: its failure is recorded in the
/// next. Only database trouble, and a failure no delivery can be blamed for
/// (a delivery's mere failure record does not commit), is retried in place.
#[derive(Default)]
pub(super) struct Escalation {
    pub(super) level: Level,
    /// Handler failures known, by slot: recorded by the next pass without
    /// running their handlers again.
    pub(super) failed: BTreeMap<usize, String>,
    /// Deliveries whose handlers ran with an `Ok` in the optimistic pass
    /// that a handler failure ended, by slot: the savepoint pass after it
    /// runs them without savepoints (a failure is nearly always one
    /// delivery's, and the rest ran clean a moment ago), until a
    /// transaction cannot commit on the deliveries' data.
    pub(super) trusted: BTreeSet<usize>,
    /// After a handler failure ended an optimistic pass: the deliveries it
    /// reached (the trusted and the failed), by slot. Only they run again
    /// with savepoints; those it did not reach wait for them to be decided,
    /// then run in an optimistic pass of their own (a failure costs the
    /// deliveries before it one more run, not the whole batch a savepoint
    /// pass). One ordering key has one delivery in a batch's round, so
    /// splitting a round keeps every key's order.
    pub(super) scope: Option<BTreeSet<usize>>,
}

/// What to do after a failed transaction.
pub(super) enum Next {
    /// Run the next transaction (as [`Escalation::pass`] says).
    Again,
    /// The inbox refused the data of the group's delivery at `index`.
    Refused { index: usize, reason: String },
    /// Database trouble (or trouble no delivery is to blame for): retry in
    /// place after a backoff.
    RetryInPlace(StoreError),
}

impl Escalation {
    pub(super) fn starting(level: Level) -> Self {
        Self {
            level,
            failed: BTreeMap::new(),
            trusted: BTreeSet::new(),
            scope: None,
        }
    }

    /// The deliveries of the next transaction, of those still undecided.
    pub(super) fn group<'i, 'a>(&self, live: &[&'i Item<'a>]) -> Vec<&'i Item<'a>> {
        let scoped = live
            .iter()
            .copied()
            .filter(|i| self.scope.as_ref().is_none_or(|s| s.contains(&i.slot)));
        match self.level {
            Level::Alone => scoped.take(1).collect(),
            _ => scoped.collect(),
        }
    }

    /// Once every delivery in scope is decided, the rest start over with
    /// an optimistic pass (none of them ran).
    pub(super) fn rescope(&mut self, outcomes: &[Option<DeliveryOutcome>]) {
        if let Some(scope) = &self.scope
            && scope.iter().all(|&slot| outcomes[slot].is_some())
        {
            *self = Self::default();
        }
    }

    /// How the next transaction runs.
    pub(super) fn pass(&self) -> Pass<'_> {
        match self.level {
            Level::Optimistic => Pass::Optimistic,
            _ => Pass::Savepoints {
                failed: &self.failed,
                trusted: &self.trusted,
            },
        }
    }

    /// Takes in how the transaction of `group` failed.
    pub(super) fn after(
        &mut self,
        group: &[&Item<'_>],
        failure: BatchFailure,
        marks: &Marks,
    ) -> Next {
        match failure {
            BatchFailure::Refused {
                index,
                reason,
                failures,
            } => {
                // It did not commit: what it met stays known, and the rest
                // run again without the refused one, their failures
                // recorded, not run again (the simulation's
                // every_failure_counted: hostile_deliveries, madsim seed 76).
                if !failures.is_empty() && self.level == Level::Optimistic {
                    self.level = Level::Savepoints;
                }
                self.failed.extend(failures);
                Next::Refused { index, reason }
            }
            BatchFailure::HandlerFailed { failures, ran_ok } => {
                if self.level == Level::Optimistic {
                    marks.hit(Mark::BatchRerunWithSavepoints);
                    self.level = Level::Savepoints;
                    let reached = ran_ok.iter().copied().chain(failures.iter().map(|f| f.0));
                    self.scope = Some(reached.collect());
                    self.trusted.extend(ran_ok);
                }
                self.failed.extend(failures);
                Next::Again
            }
            BatchFailure::Culpable { error, failures } => {
                self.culpable(group, error, failures, marks)
            }
            BatchFailure::Store {
                e,
                failures,
                in_doubt: false,
            } => {
                // It surely did not commit: what it met stays known, one
                // failure one attempt (the simulation's
                // every_failure_counted found a first overrun's retry
                // forgetting a batch mate's failure: poison_to_dlq_and_replay
                // seed 0).
                self.failed.extend(failures);
                Next::RetryInPlace(e)
            }
            BatchFailure::Store { e, .. } => {
                // The transaction may have committed the failures it
                // recorded (a commit whose reply was lost): recording them
                // again would count one failure twice. Their handlers run
                // again instead, and the inbox shows what committed. Found
                // by the simulation (producer_and_consumer_swarm, seed 48).
                for item in group {
                    self.failed.remove(&item.slot);
                }
                Next::RetryInPlace(e)
            }
        }
    }

    /// The transaction failed by a delivery's doing, not known whose: the
    /// next pass is finer (savepoints, then each delivery alone), and a
    /// delivery alone whose work cannot commit fails.
    fn culpable(
        &mut self,
        group: &[&Item<'_>],
        error: String,
        failures: Vec<(usize, String)>,
        marks: &Marks,
    ) -> Next {
        // It did not commit: what it met is known, and no delivery's
        // work is trusted any more.
        self.failed.extend(failures);
        self.trusted.clear();
        match (self.level, group) {
            (Level::Optimistic, _) => {
                marks.hit(Mark::BatchRerunWithSavepoints);
                self.level = Level::Savepoints;
            }
            (_, [_, _, ..]) => {
                marks.hit(Mark::BatchRerunAlone);
                self.level = Level::Alone;
            }
            (_, [one]) if !self.failed.contains_key(&one.slot) => {
                marks.hit(Mark::HandlerTxCannotCommit);
                let e = StoreError::Statement(error);
                self.failed.insert(one.slot, cannot_commit(&e));
            }
            // Not even its failure record commits: not the
            // delivery's doing.
            _ => return Next::RetryInPlace(StoreError::Statement(error)),
        }
        Next::Again
    }
}
