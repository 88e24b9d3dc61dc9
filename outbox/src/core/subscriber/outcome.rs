//! What became of each delivery, and the counters a subscriber keeps of
//! those outcomes.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::telemetry::subscriber as metric;

/// What happened to one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// The handler's effect committed; acked.
    Processed,
    /// The event had already taken effect; acked without the handler.
    Duplicate,
    /// The handler failed; nacked with requeue for another attempt.
    Retrying {
        /// Failed attempts so far.
        attempts: i32,
    },
    /// The handler failed for the last time; nacked into `<queue>.dlq`.
    DeadLettered {
        /// Failed attempts.
        attempts: i32,
    },
    /// Not an envelope; nacked into `<queue>.dlq` at once.
    Undecodable {
        /// Why it could not be decoded.
        reason: String,
    },
    /// Its body is over `max_body_bytes`; nacked into `<queue>.dlq` at
    /// once.
    TooLarge {
        /// The body's size.
        bytes: usize,
        /// The limit.
        limit: u32,
    },
    /// The inbox refused its data (the database cannot store it); nacked
    /// into `<queue>.dlq` at once.
    Unstorable {
        /// What the database said.
        reason: String,
    },
    /// Shutdown came while the database was unavailable; requeued.
    Requeued,
    /// On an ordered subscription: an earlier event of its ordering key is
    /// dead-lettered (or held itself), so it was recorded held in the
    /// inbox, unhandled, and acked; it is applied when that event is
    /// replayed or skipped.
    Held,
    /// On an ordered subscription: an earlier event of its ordering key is
    /// being retried, so it was requeued behind that one, unhandled, no
    /// attempt counted (it comes back after it: a queue gives requeued
    /// deliveries back in the order they were requeued, before the rest).
    Deferred,
}

impl DeliveryOutcome {
    /// A short name, for the `outbox.inbox.outcome` span attribute.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Retrying { .. } => "retrying",
            Self::DeadLettered { .. } => "dead_lettered",
            Self::Undecodable { .. } => "undecodable",
            Self::TooLarge { .. } => "too_large",
            Self::Unstorable { .. } => "unstorable",
            Self::Requeued => "requeued",
            Self::Deferred => "deferred",
            Self::Held => "held",
        }
    }

    /// Given up on at once, without the handler: not an envelope, too
    /// large, or refused by the inbox.
    pub fn given_up_at_once(&self) -> bool {
        matches!(
            self,
            Self::Undecodable { .. } | Self::TooLarge { .. } | Self::Unstorable { .. }
        )
    }

    /// Settled with a nack that requeues it: it promises nothing (a
    /// failed attempt to retry, trouble, a key's later event waiting).
    pub fn requeues(&self) -> bool {
        matches!(
            self,
            Self::Retrying { .. } | Self::Requeued | Self::Deferred
        )
    }

    /// Settled with an ack (its effect is in the inbox), not a nack.
    pub fn acks(&self) -> bool {
        matches!(self, Self::Processed | Self::Duplicate | Self::Held)
    }
}

/// Counters of one subscriber since it started.
#[derive(Debug, Default)]
pub struct SubscriberCounters {
    /// Deliveries whose effect committed.
    pub processed: AtomicU64,
    /// Deliveries absorbed as duplicates.
    pub duplicates: AtomicU64,
    /// Failed attempts requeued.
    pub retried: AtomicU64,
    /// Deliveries requeued behind an earlier event of their key.
    pub deferred: AtomicU64,
    /// Deliveries recorded held behind a dead-lettered event of their key.
    pub held: AtomicU64,
    /// Deliveries dead-lettered after the budget.
    pub dead_lettered: AtomicU64,
    /// Deliveries dead-lettered at once, without the handler: not a valid
    /// envelope, over the size limit, or refused by the inbox.
    pub undecodable: AtomicU64,
}

/// A snapshot of [`SubscriberCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SubscriberStats {
    /// Deliveries whose effect committed.
    pub processed: u64,
    /// Deliveries absorbed as duplicates.
    pub duplicates: u64,
    /// Failed attempts requeued.
    pub retried: u64,
    /// Deliveries requeued behind an earlier event of their key.
    pub deferred: u64,
    /// Deliveries recorded held behind a dead-lettered event of their key.
    pub held: u64,
    /// Deliveries dead-lettered after the budget.
    pub dead_lettered: u64,
    /// Deliveries dead-lettered at once, without the handler: not a valid
    /// envelope, over the size limit, or refused by the inbox.
    pub undecodable: u64,
}

impl SubscriberCounters {
    /// The counters now.
    pub fn snapshot(&self) -> SubscriberStats {
        SubscriberStats {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            deferred: self.deferred.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            undecodable: self.undecodable.load(Ordering::Relaxed),
        }
    }

    /// Counts `outcome` here and in its `metrics` counter, labelled with
    /// `subscription`.
    pub(super) fn count(&self, outcome: &DeliveryOutcome, subscription: &str) {
        let (counter, name) = match outcome {
            DeliveryOutcome::Processed => (&self.processed, metric::PROCESSED),
            DeliveryOutcome::Duplicate => (&self.duplicates, metric::DUPLICATES),
            DeliveryOutcome::Retrying { .. } => (&self.retried, metric::RETRIED),
            DeliveryOutcome::Deferred => (&self.deferred, metric::DEFERRED),
            DeliveryOutcome::Held => (&self.held, metric::HELD),
            DeliveryOutcome::DeadLettered { .. } => (&self.dead_lettered, metric::DEAD_LETTERED),
            DeliveryOutcome::Undecodable { .. }
            | DeliveryOutcome::TooLarge { .. }
            | DeliveryOutcome::Unstorable { .. } => (&self.undecodable, metric::UNDECODABLE),
            DeliveryOutcome::Requeued => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(name, metric::LABEL => subscription.to_owned()).increment(1);
    }
}
