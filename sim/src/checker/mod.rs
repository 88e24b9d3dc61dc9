//! The checker: every rule of ADR-018 and its amendments that the code must
//! keep, each a named [`Invariant`], verified from the trace and the fakes'
//! final state, separately from the code under test. The invariant table
//! (docs/internals/invariants.md) lists each rule with where it is implemented, where it
//! is checked and which scenarios reach it; keep the two in step.
//!
//! One file per family of rules:
//! - [`delivery`]: nothing committed is lost, nothing uncommitted is
//!   published, the outbox drains, unpublishable rows park, a run without
//!   faults wastes no work.
//! - [`transactions`]: no transaction is held across broker I/O (#478).
//! - [`attempts`]: attempts grow only on row-culpable failures, rows park
//!   exactly at the budget and are not claimed while parked.
//! - [`leases`]: marks are guarded by `claimed_by`; a replica publishes only
//!   rows it holds, with the envelope id as `message_id`, in claim order.
//! - [`nodes`]: a broker client tries first the node it was assigned, and
//!   leaves a node that falls silent within the heartbeat's bound.
//! - [`timing`]: Phase 2 ends within `confirm_timeout` of the claim (#1061);
//!   releases come before the lease expires; a replica backs off after a
//!   failure and hands back every claim it holds first; claims keep to the
//!   rate bound; an idle replica polls no faster than the ADR's cadence.
//! - [`ordering`]: ordering keys, the producer's half: a key's events are
//!   numbered in commit order, claimed only as its head and published in
//!   order.
//! - [`ordered`]: ordering keys, the consumer's half: an ordered
//!   subscription applies a key's events in order, one at a time, and holds
//!   them behind a dead-lettered head.
//! - [`stats`]: the stats gauges and readiness say what the table held.
//! - [`retention`]: the janitors delete only expired published (processed)
//!   rows, and do delete them.
//! - [`consumer`]: exactly-once effect (#433), the attempt budget, replay,
//!   hostile deliveries, and dead letters kept on quorum queues.
//! - [`statements`]: a statement its client gave up on ends at the server;
//!   a handler's transaction carries the server's own bounds.
//! - [`failover`]: a failover takes back what the promoted standby never
//!   held; the broker never stored an event it took back, and no delivery
//!   was acked whose effect it took back.
//! - [`expectations`]: what a scenario's faults must make happen.
//! - [`marks`]: the coverage marks agree with the trace, so a scenario's
//!   `[expect] reach` list cannot be met by a mark that lies.
//!
//! Violations are values: [`Violation`] names its [`Invariant`], the
//! simulated time and what happened.

mod attempts;
mod consumer;
mod delivery;
mod expectations;
mod failover;
mod leases;
mod marks;
mod nodes;
mod ordered;
mod ordering;
mod retention;
mod statements;
mod stats;
mod timing;
mod transactions;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::model::{FinalState, Model};
use crate::scenario::Expect;
use crate::trace::Event;

macro_rules! invariants {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// A rule the checker states.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Invariant {
            $($(#[$doc])* $variant,)*
        }

        impl Invariant {
            /// Every invariant, in declaration order.
            pub const ALL: &'static [Invariant] = &[$(Invariant::$variant,)*];

            /// Its stable name, as tables and reports spell it.
            pub fn name(self) -> &'static str {
                match self {
                    $(Invariant::$variant => $name,)*
                }
            }
        }
    };
}

invariants! {
    // --- delivery
    /// Once faults heal, every committed envelope is stored by the broker.
    Lost = "lost",
    /// The broker stores no envelope the store did not commit.
    PhantomPublish = "phantom_publish",
    /// At the end no committed, publishable row is left unpublished.
    Undrained = "undrained",
    /// A row whose routing key no broker accepts parks (until an operator skips it) and is never published.
    UnpublishableParks = "unpublishable_parks",
    /// A run without faults releases no claim and publishes nothing twice.
    QuietRun = "quiet_run",
    // --- transactions
    /// No transaction waits on its client while that client publishes (#478).
    TxAcrossBrokerIo = "tx_across_broker_io",
    // --- attempts
    /// Attempts grow only on row-culpable failures (unpublishable keys; a
    /// broker nack is infrastructure trouble).
    AttemptsOnlyOnBlame = "attempts_only_on_blame",
    /// A row parks exactly when its attempts reach the budget.
    ParkAtBudget = "park_at_budget",
    /// A parked row is not claimed until unparked.
    ParkedNotClaimed = "parked_not_claimed",
    // --- leases
    /// A mark or release changes only rows the replica holds (`claimed_by`).
    ClaimedByGuard = "claimed_by_guard",
    /// A replica publishes only rows it holds, with the envelope id as `message_id`.
    PublishOnlyClaimed = "publish_only_claimed",
    /// A replica publishes its rows in claim order (`enqueued_at`, id).
    PublishOrder = "publish_order",
    /// A replica has at most `pipeline_depth` publishes unconfirmed at once, overlapping batches included (#478).
    PipelineDepth = "pipeline_depth",
    /// A broker client given a node list tries first the node it was assigned, whatever answers.
    StartsAtAssignedNode = "starts_at_assigned_node",
    /// A subscription's broker client whose node falls silent (cut off, its connections left open) is connected to another node within the heartbeat's bound.
    LeavesASilentNode = "leaves_a_silent_node",
    // --- timing
    /// Phase 2 ends (last confirm in, or the batch released) within `confirm_timeout` of its claim (#1061).
    Phase2Deadline = "phase2_deadline",
    /// A release comes before the replica's lease on the row expires.
    ReleaseBeforeLeaseExpiry = "release_before_lease_expiry",
    /// After a failure a replica backs off (the tick, doubled per failure in a row) before it claims again.
    BackoffAfterFailure = "backoff_after_failure",
    /// After a failure a replica hands back every claim it holds before it claims again.
    ReleaseOnFailure = "release_on_failure",
    /// With `max_rows_per_sec`, a claim of k rows delays the replica's next claim by k / rate.
    RateBound = "rate_bound",
    /// After a drain that ended without failure the next claim waits the tick, four ticks once steady for a minute, unless a commit woke the replica or the drain claimed a keyed row (its key's next event is claimable once it is marked).
    PollCadence = "poll_cadence",
    /// A drain's claim walks on from a place in claim order only if it was called right after a full claim of the same drain and before any store failure of that drain, and at most `CLAIMS_PER_WALK` claims make one walk: a row claimable behind the place waits a bounded number of claims (issue 28).
    ClaimWalk = "claim_walk",
    /// The outbox gauges say what the stats task's sample said (pending, oldest unpublished age, parked, ready), and readiness fails exactly past its thresholds or when the sample is stale (#1230).
    GaugesTruthful = "gauges_truthful",
    // --- ordering keys
    /// The events of one ordering key are numbered 1, 2, … in the order their transactions committed, with no gap or repeat.
    KeyNumberedInCommitOrder = "key_numbered_in_commit_order",
    /// A keyed event is claimed only when every earlier event of its key is published or skipped: one event of a key between claim and mark, and a parked head holds back the rest until unparked or skipped.
    KeyHeadOnlyClaimed = "key_head_only_claimed",
    /// A keyed event is sent to the broker only once every earlier event of its key is marked published (or skipped).
    KeyPublishedInOrder = "key_published_in_order",
    /// On an ordered subscription, a keyed event takes effect only once every earlier event of its key took effect or was skipped: commit order, a dead-lettered event holding back its key until replayed or skipped.
    KeyAppliedInOrder = "key_applied_in_order",
    /// On an ordered subscription, a delivery is recorded held only behind an earlier event of its key that has not taken effect.
    KeyHeldBehindItsHead = "key_held_behind_its_head",
    /// On an ordered subscription, no handler run of a keyed event begins while a run of another event of its key (on any worker of any replica, replays included) has not ended.
    KeyHandledOneAtATime = "key_handled_one_at_a_time",
    // --- retention
    /// The outbox janitor deletes only rows published longer ago than the retention.
    OutboxJanitorScope = "outbox_janitor_scope",
    /// Published rows do not outlive the retention by more than two sweeps.
    OutboxRetention = "outbox_retention",
    /// The inbox janitor deletes only rows processed longer ago than the retention.
    InboxJanitorScope = "inbox_janitor_scope",
    /// Processed inbox rows do not outlive the retention by more than two sweeps.
    InboxRetention = "inbox_retention",
    // --- consumer
    /// Every committed event (and valid foreign one) takes effect exactly once within the inbox retention (#433).
    ExactlyOnceEffect = "exactly_once_effect",
    /// Nothing takes effect that was never committed (or was refused).
    PhantomEffect = "phantom_effect",
    /// An effect commits in the same transaction as its inbox row's processed mark.
    EffectWithMark = "effect_with_mark",
    /// An event whose effect committed is never dead-lettered.
    NoDeadLetterAfterEffect = "no_dead_letter_after_effect",
    /// A failed attempt is recorded only for a handler failure, never for database or broker trouble.
    AttemptOnlyOnHandlerFailure = "attempt_only_on_handler_failure",
    /// Every handler failure (an Err, a panic, a swallowed error, an overrun that counts) is recorded as one attempt before the handler runs for that event again or the delivery is settled, unless database trouble came between.
    EveryFailureCounted = "every_failure_counted",
    /// A delivery is dead-lettered exactly when its recorded attempts reach the budget, never before or after.
    DeadLetterAtBudget = "dead_letter_at_budget",
    /// Replay gives a dead-lettered row a fresh budget before its handler runs, and a budget is reset only on a dead-lettered row (once per replay or release).
    ReplayFreshBudget = "replay_fresh_budget",
    /// A replay touches exactly the rows it was asked for (by ids, by filter, up to its limit, after its cursor) and no other, says `more` exactly when it stopped at its limit, and its cursor is the place of the last row it replayed (paging is exact).
    ReplayExact = "replay_exact",
    /// A replayed row whose handler fails again stays dead-lettered (findable).
    ReplayKeepsFailedFindable = "replay_keeps_failed_findable",
    /// A delivery that is no valid envelope, too large, or unstorable is dead-lettered at once, never retried in place.
    RejectedAtOnce = "rejected_at_once",
    /// A delivery is keyed by its envelope id, never by its AMQP `message_id`.
    KeyedByEnvelopeId = "keyed_by_envelope_id",
    /// A delivery is acked only after its event's processed mark committed (#433 step 4: commit, then ack).
    AckAfterCommit = "ack_after_commit",
    /// On quorum queues every delivery taken back without requeue ends in the dead-letter queue (or on its way there): a node or a leader lost never drops one.
    DeadLettersKept = "dead_letters_kept",
    /// Every delivery of an event written with trace context carries that context (its traceparent and tracestate AMQP headers), republishes included.
    TraceContextCarried = "trace_context_carried",
    /// A transaction of deliveries holds at most `CANOPY_MQ_SUBSCRIBER_BATCH_MAX` of them, whatever the prefetch.
    BatchMax = "batch_max",
    /// Every event delivered is decided in the end: applied, or dead-lettered at its budget; none is retried in place forever.
    EveryDeliveryDecided = "every_delivery_decided",
    // --- statements
    /// A statement that waits on a lock when its client stops waiting for it ends at the server soon after (its locks and pooled connection come back).
    AbandonedStatementEnds = "abandoned_statement_ends",
    /// A handler runs in a transaction the server itself bounds: no statement of it runs past the handler's deadline and one second, and it may sit idle at least a minute and more than twice the deadline.
    HandlerTxBounds = "handler_tx_bounds",
    // --- failover
    /// The broker never stores an event whose commit a failover took back (replicated before published).
    NoPhantomEvent = "no_phantom_event",
    /// No delivery is acked whose effect a failover then takes back (replicated before acked), nor after a failover took its effect back and before it took effect again.
    NoLostEffect = "no_lost_effect",
    // --- expectations
    /// What the scenario's faults must make happen did happen.
    ScenarioExpectation = "scenario_expectation",
    /// A coverage mark comes exactly when the trace shows its path was taken (a full claim, a mark that found leases gone, a park, a foreign `message_id`).
    MarksTruthful = "marks_truthful",
}

impl std::fmt::Display for Invariant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub invariant: Invariant,
    /// Simulated time it was seen (none for end-of-run checks).
    pub at: Option<Duration>,
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.at {
            Some(at) => write!(
                f,
                "{} at {:.3}s: {}",
                self.invariant,
                at.as_secs_f64(),
                self.detail
            ),
            None => write!(f, "{} at the end: {}", self.invariant, self.detail),
        }
    }
}

/// What a run found.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    pub committed: usize,
    pub rolled_back: usize,
    pub published: usize,
    pub duplicates: usize,
    pub parked: usize,
    /// Violations, at most [`LISTED_MAX`] per invariant.
    pub violations: Vec<Violation>,
    /// How many violations of each invariant were found (all of them).
    pub counts: BTreeMap<Invariant, usize>,
}

impl Verdict {
    /// True when no invariant broke.
    pub fn ok(&self) -> bool {
        self.counts.is_empty()
    }

    /// The invariants that broke.
    pub fn broken(&self) -> Vec<Invariant> {
        self.counts.keys().copied().collect()
    }
}

/// Most violations listed per invariant (the rest are counted).
pub const LISTED_MAX: usize = 5;

/// The configuration the rules are stated against.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Drainer: rows per claim.
    pub batch_size: u32,
    /// Drainer: unconfirmed publishes per replica.
    pub pipeline_depth: u32,
    /// Stats task: its interval.
    pub stats_interval: Duration,
    /// Readiness: pending rows over this are unready.
    pub pending_warn: u64,
    /// Readiness: an oldest pending row older than this is unready.
    pub oldest_warn: Duration,
    /// Drainer: row-culpable failures before a row parks.
    pub max_attempts: u32,
    /// Drainer: Phase 2's deadline, from the claim.
    pub confirm_timeout: Duration,
    /// Drainer: the claim lease.
    pub lease_ttl: Duration,
    /// Drainer: the busy tick (the first backoff).
    pub tick: Duration,
    /// Drainer: the longest backoff.
    pub backoff_max: Duration,
    /// Drainer: the bound on rows claimed per second, if any.
    pub max_rows_per_sec: Option<u32>,
    /// Outbox retention.
    pub retention: Duration,
    /// Subscriber: failed attempts before a delivery is dead-lettered.
    pub consumer_max_attempts: u32,
    /// Inbox retention.
    pub inbox_retention: Duration,
    /// Subscriber: how soon after its client gave up on it a statement
    /// waiting at the server must end.
    pub abandoned_statement_bound: Duration,
    /// Subscriber: the handler deadline.
    pub handler_timeout: Duration,
    /// Subscriber: most deliveries in one transaction.
    pub consumer_batch_max: u32,
    /// Subscriber: partition queues of an ordered subscription (0: not
    /// ordered).
    pub consumer_partitions: u16,
}

/// Slack on timing rules: a timer fires at the first step after its
/// instant, and the call it triggers may start a step later.
pub const TIMING_SLACK: Duration = Duration::from_millis(25);

/// Everything a family of rules reads.
pub struct Context<'a> {
    pub events: &'a [(Duration, Event)],
    pub model: &'a Model,
    pub fin: &'a FinalState,
    pub limits: &'a Limits,
    pub expect: &'a Expect,
}

/// Collects violations.
#[derive(Debug, Default)]
pub struct Findings {
    listed: Vec<Violation>,
    counts: BTreeMap<Invariant, usize>,
}

impl Findings {
    /// Records a violation of `invariant` seen at `at`.
    pub fn add(&mut self, invariant: Invariant, at: Option<Duration>, detail: String) {
        let n = self.counts.entry(invariant).or_insert(0);
        *n += 1;
        if *n <= LISTED_MAX {
            self.listed.push(Violation {
                invariant,
                at,
                detail,
            });
        }
    }
}

/// Checks every rule.
pub fn check(
    events: &[(Duration, Event)],
    fin: &FinalState,
    limits: &Limits,
    expect: &Expect,
) -> Verdict {
    let original = events;
    let rewritten = failover::rewrite(events);
    let events = rewritten.as_deref().unwrap_or(events);
    let model = Model::from_trace(events);
    let ctx = Context {
        events,
        model: &model,
        fin,
        limits,
        expect,
    };
    let mut out = Findings::default();
    delivery::check(&ctx, &mut out);
    transactions::check(&ctx, &mut out);
    attempts::check(&ctx, &mut out);
    ordering::check(&ctx, &mut out);
    ordered::check(&ctx, &mut out);
    leases::check(&ctx, &mut out);
    nodes::check(&ctx, &mut out);
    timing::check(&ctx, &mut out);
    retention::check(&ctx, &mut out);
    consumer::check(&ctx, &mut out);
    statements::check(&ctx, &mut out);
    stats::check(&ctx, &mut out);
    expectations::check(&ctx, &mut out);
    marks::check(&ctx, &mut out);
    failover::check(&ctx, original, &mut out);
    let duplicates = fin
        .stored
        .values()
        .map(|c| (*c as usize).saturating_sub(1))
        .sum();
    Verdict {
        committed: model.committed.len(),
        rolled_back: model.rolled_back.len(),
        published: fin.stored.len(),
        duplicates,
        parked: fin.parked.len(),
        violations: out.listed,
        counts: out.counts,
    }
}

/// One subscription's end state, for [`check_end_state`].
#[derive(Debug, Clone, Copy)]
pub struct SubscriptionEnd<'a> {
    /// Its name, in the violations' details.
    pub name: &'a str,
    /// The events it must have applied, each exactly once.
    pub expected: &'a BTreeSet<uuid::Uuid>,
    /// Its committed effects, per event.
    pub effects: &'a BTreeMap<uuid::Uuid, u32>,
}

/// The rules that need no trace, with the simulation's own definitions:
/// nothing committed lost (`lost`), nothing published that was not
/// committed (`phantom_publish`), nothing publishable left unpublished
/// (`undrained`), unpublishable rows parked and never published
/// (`unpublishable_parks`), and each subscription's events applied exactly
/// once and nothing else (`exactly_once_effect`, `phantom_effect`). For
/// observers of runs that have no trace: the chaos runner judges the real
/// services with these.
pub fn check_end_state(
    model: &Model,
    fin: &FinalState,
    subscriptions: &[SubscriptionEnd<'_>],
) -> Verdict {
    let mut out = Findings::default();
    delivery::end_state(model, fin, &mut out);
    for s in subscriptions {
        let label = format!("[{}] ", s.name);
        consumer::exactly_once(s.expected, s.effects, &BTreeMap::new(), &label, &mut out);
    }
    Verdict {
        committed: model.committed.len(),
        rolled_back: model.rolled_back.len(),
        published: fin.stored.len(),
        duplicates: fin
            .stored
            .values()
            .map(|c| (*c as usize).saturating_sub(1))
            .sum(),
        parked: fin.parked.len(),
        violations: out.listed,
        counts: out.counts,
    }
}

/// The host a replica or client name runs on (`drainer-1#2` → `drainer-1`).
pub(crate) fn host_of(client: &str) -> &str {
    let base = client.split('/').next().unwrap_or(client);
    base.split('#').next().unwrap_or(base)
}
