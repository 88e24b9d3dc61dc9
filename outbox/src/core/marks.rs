//! Coverage marks: the core names the paths that matter as it takes them
//! (a lease lost before the mark, a Phase-2 timeout, a dead-letter at the
//! budget, …) and reports them through a port, never a global.
//!
//! Production installs no sink: [`Marks::default`] is `None`, and a mark
//! costs one branch. The simulation installs one that records each mark in
//! its trace, so a sweep can count how often every path was taken and fail
//! a scenario that never reaches what it exists for (FoundationDB's code
//! probes and TigerBeetle's marks are the models). Marks are coverage, not
//! evidence: the simulation's checker never believes a mark, it judges what
//! the ports and the fakes observed.

use std::sync::Arc;

/// Where marks go.
pub trait MarkSink: Send + Sync + 'static {
    /// The core just took the path `mark` names.
    fn hit(&self, mark: Mark);
}

/// The core's handle on a [`MarkSink`]: none by default.
#[derive(Clone, Default)]
pub struct Marks(Option<Arc<dyn MarkSink>>);

impl Marks {
    /// Marks reported to `sink`.
    pub fn to(sink: Arc<dyn MarkSink>) -> Self {
        Self(Some(sink))
    }

    /// Reports `mark`, if a sink is installed.
    #[inline]
    pub fn hit(&self, mark: Mark) {
        if let Some(sink) = &self.0 {
            sink.hit(mark);
        }
    }
}

impl std::fmt::Debug for Marks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Marks(sink)"
        } else {
            "Marks(none)"
        })
    }
}

macro_rules! marks {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// A named path of the core.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[non_exhaustive]
        pub enum Mark {
            $($(#[$doc])* $variant,)*
        }

        impl Mark {
            /// Every mark, in declaration order.
            pub const ALL: &'static [Mark] = &[$(Mark::$variant,)*];

            /// The mark's stable name (snake case), as scenarios spell it.
            pub fn name(self) -> &'static str {
                match self {
                    $(Mark::$variant => $name,)*
                }
            }

            /// The mark named `name`.
            pub fn from_name(name: &str) -> Option<Mark> {
                match name {
                    $($name => Some(Mark::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

marks! {
    // --- the drainer
    /// A claim came back full: the drain goes on, overlapping batches.
    ClaimFull = "claim_full",
    /// A claim walked on from the drain's last full claim
    /// ([`ClaimParams::after`](crate::core::ports::ClaimParams::after)), not
    /// from the oldest row.
    ClaimResumed = "claim_resumed",
    /// A mark found some of its rows' leases gone (another replica took them).
    LeaseLostBeforeMark = "lease_lost_before_mark",
    /// A batch's Phase 2 ran past `confirm_timeout`.
    Phase2Timeout = "phase2_timeout",
    /// A claim's reply came back after its batch's deadline (counted from
    /// when the claim was sent): nothing is published, the rows go back at
    /// once.
    ClaimOutlivedDeadline = "claim_outlived_deadline",
    /// The broker failed during a batch's Phase 2.
    Phase2BrokerError = "phase2_broker_error",
    /// A failed batch's claims were released.
    ReleasedAfterFailure = "released_after_failure",
    /// Rows claimed in the same step as a failure were handed back.
    ReleasedBesideFailure = "released_beside_failure",
    /// A release failed: those rows wait for their lease.
    ReleaseFailed = "release_failed",
    /// The durable standbys did not flush a claimed batch's commits within
    /// its deadline: released unpublished.
    NotReplicated = "not_replicated",
    /// A row's routing key can never be published: blamed without broker I/O.
    RowUnpublishable = "row_unpublishable",
    /// The broker nacked a row.
    RowNacked = "row_nacked",
    /// Rows parked at the attempt budget.
    RowParked = "row_parked",
    /// A drain failed; the replica backs off before claiming again.
    DrainFailed = "drain_failed",
    /// The drainer moved to the idle tick after a steady minute.
    IdleTick = "idle_tick",
    /// The rate bound delayed a claim.
    Paced = "paced",
    /// A commit notification ended the sleep between ticks.
    WokenByCommit = "woken_by_commit",
    /// The single-flight reconnect failed.
    ReconnectFailed = "reconnect_failed",
    // --- the janitors
    /// The outbox janitor deleted expired published rows.
    OutboxSweepDeleted = "outbox_sweep_deleted",
    /// A janitor batch came back full, so the sweep went on.
    SweepBatchFull = "sweep_batch_full",
    /// A retention sweep failed.
    SweepFailed = "sweep_failed",
    /// The inbox janitor deleted expired processed rows.
    InboxSweepDeleted = "inbox_sweep_deleted",
    /// A janitor dropped a whole partition (the partitioned layout).
    PartitionDropped = "partition_dropped",
    /// A janitor created a partition ahead (the partitioned layout).
    PartitionCreated = "partition_created",
    // --- the subscriber
    /// First sight of an event: its inbox row is new.
    InboxInserted = "inbox_inserted",
    /// The inbox row exists, unprocessed: a retry.
    InFlightRetry = "in_flight_retry",
    /// The event already took effect: acked without the handler.
    AlreadyProcessed = "already_processed",
    /// The handler failed: an attempt counts.
    HandlerFailed = "handler_failed",
    /// The handler's database was unavailable: no attempt counts.
    HandlerUnavailable = "handler_unavailable",
    /// The handler panicked: caught, an attempt counts.
    HandlerPanicked = "handler_panicked",
    /// The handler ran past its deadline a second time for this delivery
    /// while the database answered: an attempt counts.
    HandlerTimedOut = "handler_timed_out",
    /// The handler ran past its deadline while the database answered, the
    /// first time for this delivery: it runs once more (retried in place,
    /// no attempt) in case its statements waited on a stall that had just
    /// ended.
    HandlerOverranOnce = "handler_overran_once",
    /// The handler ran past its deadline and the database did not answer
    /// a ping either: its own statements waited on the database, so no
    /// attempt counts.
    HandlerStalledOnDatabase = "handler_stalled_on_database",
    /// One transaction applied several deliveries (a batch) and committed.
    BatchCommitted = "batch_committed",
    /// The inbox refused one delivery of a batch: the batch rolled back and
    /// ran again without it.
    BatchRerunWithoutRefused = "batch_rerun_without_refused",
    /// A handler failed in a pass without savepoints: the transaction
    /// rolled back and runs again with them.
    BatchRerunWithSavepoints = "batch_rerun_with_savepoints",
    /// A handler returned `Ok` but its work cannot commit: its transaction
    /// was aborted by a statement whose error it swallowed, or what it
    /// wrote breaks a deferred constraint. Found by delivery; an attempt
    /// counts.
    HandlerTxCannotCommit = "handler_tx_cannot_commit",
    /// A COMMIT failed on the deliveries' own data after every delivery's
    /// check passed: they run again, each in a transaction of its own.
    BatchRerunAlone = "batch_rerun_alone",
    /// The subscriber gave up on a handler's transaction mid-statement (a
    /// deadline, a panic) and had the server end it.
    HandlerTxAbandoned = "handler_tx_abandoned",
    /// The inbox was unavailable: the delivery is retried in place.
    InboxRetriedInPlace = "inbox_retried_in_place",
    /// A delivery was dead-lettered at its attempt budget.
    DeadLetteredAtBudget = "dead_lettered_at_budget",
    /// A delivery was not a valid envelope: dead-lettered at once.
    Undecodable = "undecodable",
    /// The inbox refused a delivery's data: dead-lettered at once.
    Unstorable = "unstorable",
    /// A delivery was over the size limit: dead-lettered at once.
    TooLarge = "too_large",
    /// A delivery's AMQP `message_id` differs from its envelope id.
    MessageIdMismatch = "message_id_mismatch",
    /// The consumer ended and was reopened.
    ConsumerReopened = "consumer_reopened",
    /// An ack or nack was lost with its channel.
    SettleLost = "settle_lost",
    /// A batch's acks waited for the durable standbys to flush its commit.
    AckHeldForStandby = "ack_held_for_standby",
    /// A failover came between a batch and its acks: all requeued.
    RequeuedAfterFailover = "requeued_after_failover",
    /// Shutdown came while the inbox was unavailable: requeued.
    RequeuedAtShutdown = "requeued_at_shutdown",
    /// An ordered subscription requeued a delivery behind an earlier event
    /// of its key that is being retried.
    DeferredBehindKey = "deferred_behind_key",
    /// An ordered subscription recorded a delivery held behind a
    /// dead-lettered event of its key.
    HeldBehindKey = "held_behind_key",
    /// A replay or skip of a key's event released the key's held rows.
    HeldReleased = "held_released",
    /// An ordered subscription's batch held two events of one key: the
    /// later one waited for the next round.
    KeyRoundSplit = "key_round_split",
    /// A replayed row took effect.
    ReplayApplied = "replay_applied",
    /// A replayed row's handler failed again; it stays dead-lettered.
    ReplayFailedAgain = "replay_failed_again",
    /// A replayed row had taken effect meanwhile.
    ReplayAlreadyProcessed = "replay_already_processed",
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_round_trip() {
        let mut names: Vec<&str> = Mark::ALL.iter().map(|m| m.name()).collect();
        for m in Mark::ALL {
            assert_eq!(Mark::from_name(m.name()), Some(*m));
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Mark::ALL.len());
        assert_eq!(Mark::from_name("no_such_mark"), None);
    }

    #[test]
    fn a_sink_sees_every_hit_and_none_costs_nothing() {
        use std::sync::Mutex;
        #[derive(Default)]
        struct Seen(Mutex<Vec<Mark>>);
        impl MarkSink for Seen {
            fn hit(&self, mark: Mark) {
                self.0.lock().unwrap().push(mark);
            }
        }
        let seen = Arc::new(Seen::default());
        let marks = Marks::to(seen.clone());
        marks.hit(Mark::Phase2Timeout);
        marks.hit(Mark::RowParked);
        assert_eq!(
            *seen.0.lock().unwrap(),
            [Mark::Phase2Timeout, Mark::RowParked]
        );
        Marks::default().hit(Mark::Phase2Timeout); // no sink, no effect
    }
}
