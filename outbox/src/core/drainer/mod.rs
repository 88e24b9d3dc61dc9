//! The lease-based three-phase drainer of ADR-018 (#478, #1061).
//!
//! One tick: **claim** (one statement, lease stamped, no transaction left
//! open) → **publish** (one channel, confirm-select once, publishes pipelined
//! up to the depth, the whole phase under one deadline, no database
//! transaction open) → **mark** (bulk `published_at` for acks, bulk
//! `attempts + 1` for the rows' own faults, both guarded by `claimed_by`).
//! Any infrastructure failure in Phase 2 releases every claim without
//! touching `attempts` and asks the broker adapter for a single-flight
//! reconnect. A broker's nack is infrastructure trouble too (a queue full
//! under `reject-publish`, or the broker's own internal error; measured on
//! RabbitMQ 3.10, a node loss, a leader election or a quorum queue without
//! a majority never nacks: confirms come late or the connection drops):
//! the nacked rows are released without blame and the drainer backs off.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use super::durability::DurableStandbys;
use super::marks::Marks;
use super::ports::{Broker, Clock, Entropy, OutboxStore};
use crate::error::DrainError;

mod claim;
mod mark;
mod pipeline;
mod publish;
mod run;
mod settings;

pub use claim::Walk;
pub use settings::DrainerConfig;

/// After this long without work or errors the drainer polls at the idle tick.
pub const STEADY_AFTER: Duration = Duration::from_secs(60);
/// The idle tick is this multiple of the busy tick (250 ms → 1 s).
pub const IDLE_TICK_FACTOR: u32 = 4;
/// Longest wait between ticks after consecutive failures.
pub const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Longest a `last_error` text is kept.
pub const LAST_ERROR_MAX_CHARS: usize = 1024;
/// Most batches one replica holds at once while draining: one claimed
/// ahead, one being published, one awaiting its last confirms or its marks.
pub const BATCHES_IN_HAND_MAX: usize = 3;

/// What one stage of [`Drainer::drain`] did, and the failures it met.
type Stage = (TickReport, Vec<DrainError>);

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Rows claimed in Phase 1.
    pub claimed: usize,
    /// Of those, rows with an ordering key: their keys' next events may be
    /// claimable as soon as they are marked.
    pub keyed_claimed: usize,
    /// Rows confirmed and marked published.
    pub published: u64,
    /// Confirmed rows whose mark found the lease gone (another drainer
    /// reclaimed them: they will be published again).
    pub mark_lost: u64,
    /// Rows failed by their own fault (a routing key no broker accepts),
    /// their attempts bumped.
    pub failed: u64,
    /// Rows the broker nacked, released without blame.
    pub refused: u64,
    /// Of those, rows that parked.
    pub parked: u64,
    /// Clock time spent in Phase 1 (claim).
    pub claim_time: Duration,
    /// Clock time spent in Phase 2 (channel, publishes, confirms).
    pub publish_time: Duration,
    /// Clock time spent in Phase 3 (marks).
    pub mark_time: Duration,
}

/// The drainer: the production code in production and in the simulation.
pub struct Drainer<S, B, C, E> {
    store: Arc<S>,
    broker: Arc<B>,
    clock: Arc<C>,
    entropy: Arc<E>,
    config: DrainerConfig,
    /// Signalled when new rows commit (production: PostgreSQL NOTIFY), so
    /// an idle drainer claims at once instead of at its next tick.
    wakeup: Option<Arc<tokio::sync::Notify>>,
    /// With `max_rows_per_sec`: the clock time (ns) before which the next
    /// claim may not start.
    next_claim_at: AtomicU64,
    /// Coverage marks (none in production).
    marks: Marks,
    /// A Phase-2 failure implicated the broker connection of this
    /// generation + 1 (0: none): replaced once every claim in hand is
    /// released, so a slow reconnect never keeps rows claimed.
    reconnect_due: AtomicU64,
    /// The current drain met a failure: the claim stage claims nothing
    /// more. Set where the failure is detected, before any release is
    /// awaited, so no claim slips in meanwhile.
    failing: AtomicBool,
    /// Ordering keys: where the next key window starts (`""`: the first
    /// key). It moves past a window once every claimable head in it was
    /// claimed, and starts over after the last key.
    key_cursor: std::sync::Mutex<String>,
    /// The standbys a claimed batch waits for before it is published.
    durable: Option<Arc<DurableStandbys>>,
}

impl<S, B, C, E> std::fmt::Debug for Drainer<S, B, C, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drainer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
impl<S: OutboxStore, B: Broker, C: Clock, E: Entropy> Drainer<S, B, C, E> {
    /// Wakes the drainer between ticks whenever `wakeup` is notified (a
    /// permit stored while a tick runs makes the next sleep end at once).
    /// Polling stays the fallback: a lost notification only costs a tick.
    /// Error backoff is never cut short by it.
    pub fn with_wakeup(mut self, wakeup: Arc<tokio::sync::Notify>) -> Self {
        self.wakeup = Some(wakeup);
        self
    }

    /// Publishes a claimed batch only once `standbys` have flushed the
    /// commits of its rows (replicated before published; see
    /// [`durability`](crate::core::durability)).
    pub fn with_durable_standbys(mut self, standbys: Arc<DurableStandbys>) -> Self {
        self.durable = Some(standbys);
        self
    }

    /// Reports the paths it takes to `marks` (the simulation's coverage).
    pub fn with_marks(mut self, marks: Marks) -> Self {
        self.marks = marks;
        self
    }

    /// Builds a drainer from its ports and a checked configuration.
    pub fn new(
        store: Arc<S>,
        broker: Arc<B>,
        clock: Arc<C>,
        entropy: Arc<E>,
        config: DrainerConfig,
    ) -> Self {
        Self {
            store,
            broker,
            clock,
            entropy,
            config,
            wakeup: None,
            next_claim_at: AtomicU64::new(0),
            marks: Marks::default(),
            reconnect_due: AtomicU64::new(0),
            failing: AtomicBool::new(false),
            key_cursor: std::sync::Mutex::default(),
            durable: None,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &DrainerConfig {
        &self.config
    }
}

impl TickReport {
    fn absorb(&mut self, other: &TickReport) {
        self.claimed += other.claimed;
        self.keyed_claimed += other.keyed_claimed;
        self.published += other.published;
        self.mark_lost += other.mark_lost;
        self.failed += other.failed;
        self.refused += other.refused;
        self.parked += other.parked;
        self.claim_time += other.claim_time;
        self.publish_time += other.publish_time;
        self.mark_time += other.mark_time;
    }
}
#[cfg(test)]
mod tests {
    use super::publish::BatchOutcome;
    use super::run::backoff_delay;
    use super::*;
    use crate::core::ports::Confirm;
    use crate::core::truncate_chars;
    use uuid::Uuid;

    const TICK: Duration = Duration::from_millis(250);

    #[test]
    fn backoff_doubles_from_the_tick_up_to_the_cap() {
        let no_jitter = |errors| backoff_delay(TICK, errors, 0);
        assert_eq!(no_jitter(0), TICK);
        assert_eq!(no_jitter(1), TICK);
        assert_eq!(no_jitter(2), TICK * 2);
        assert_eq!(no_jitter(4), TICK * 8);
        assert_eq!(no_jitter(7), ERROR_BACKOFF_MAX);
        assert_eq!(no_jitter(u32::MAX), ERROR_BACKOFF_MAX);
    }

    #[test]
    fn backoff_jitter_stays_below_a_quarter_and_follows_the_random_draw() {
        for errors in [1, 3, 9] {
            let base = backoff_delay(TICK, errors, 0);
            let quarter = base.as_millis() as u64 / 4;
            for random in [0, 1, quarter - 1, quarter, quarter + 7, u64::MAX] {
                let d = backoff_delay(TICK, errors, random);
                assert_eq!(d, base + Duration::from_millis(random % quarter));
                assert!(d >= base && d < base + base / 4, "{d:?} for base {base:?}");
            }
        }
        // Two draws can differ: replicas that failed together spread out.
        assert_ne!(backoff_delay(TICK, 1, 1), backoff_delay(TICK, 1, 2));
    }

    #[test]
    fn a_tick_too_short_to_jitter_backs_off_by_the_tick_alone() {
        let tiny = Duration::from_millis(2);
        for random in [0, 1, 5, u64::MAX] {
            assert_eq!(backoff_delay(tiny, 1, random), tiny);
        }
    }

    #[test]
    fn truncate_chars_counts_characters_not_bytes() {
        assert_eq!(truncate_chars("héllo", 2), "hé");
        assert_eq!(truncate_chars("héllo", 5), "héllo");
        assert_eq!(truncate_chars("héllo", 50), "héllo");
        assert_eq!(truncate_chars("", 3), "");
        let long = "é".repeat(LAST_ERROR_MAX_CHARS + 10);
        assert_eq!(
            truncate_chars(&long, LAST_ERROR_MAX_CHARS).chars().count(),
            LAST_ERROR_MAX_CHARS
        );
    }

    #[test]
    fn a_nack_is_filed_blameless_with_its_first_reason_bounded() {
        let mut outcome = BatchOutcome::default();
        let (a, b, c) = (Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3));
        assert!(!outcome.record(a, Confirm::Ack));
        assert!(outcome.record(b, Confirm::Nack("x".repeat(LAST_ERROR_MAX_CHARS * 2))));
        assert!(outcome.record(c, Confirm::Nack("second".into())));
        assert_eq!(outcome.acked, vec![a]);
        assert_eq!(outcome.refused, vec![b, c]);
        assert!(outcome.failed.is_empty(), "a nack blames no row");
        let reason = outcome.refusal.unwrap();
        assert!(reason.starts_with('x'), "{reason}");
        assert_eq!(reason.chars().count(), LAST_ERROR_MAX_CHARS);
    }
}
