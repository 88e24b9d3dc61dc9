//! The durability gates: nothing leaves the service before the named
//! standbys hold the commits it rests on, so that a failover to one of them
//! never takes back what consumers already acted on.
//!
//! - **Replicated before published** (the drainer): after a claim, the
//!   batch is published only once every named standby has flushed the
//!   primary's WAL up to the flush position read right after the claim,
//!   which is past the commit of every row the claim could see.
//! - **Replicated before acked** (the subscriber): after a batch's
//!   transaction ends, its deliveries are acked (or dead-lettered) only
//!   once every named standby has flushed up to the flush position read
//!   then, which is past the batch's own commit and past every commit it
//!   read (an inbox row found processed by another session).
//!
//! A commit is flushed on the primary before any other session can see it
//! (a synchronous commit, PostgreSQL's default, including one whose wait
//! for a synchronous standby was cancelled: the hole synchronous
//! replication leaves), so the primary's flush position read after seeing
//! it is past it. A row a service wrote with `synchronous_commit = off` is
//! visible before it is flushed, and no gate covers it.
//!
//! A standby that is away, or lags, holds publishing and acking back:
//! readiness fails naming it ([`UnreadyReason::StandbyBehind`]) once the
//! wait is longer than [`UNREADY_AFTER`].

use std::sync::Mutex;
use std::time::Duration;

use super::ports::{Clock, Replication, StandbyFlush, WalPosition};
use super::stats::UnreadyReason;
use crate::error::StoreError;

/// First pause between two looks at the standbys' positions; each pause
/// doubles up to [`POLL_MAX`]. A standby on a healthy network flushes a
/// commit within a few milliseconds (the performance page).
pub const POLL_FIRST: Duration = Duration::from_millis(1);
/// Longest pause between two looks at the standbys' positions.
pub const POLL_MAX: Duration = Duration::from_millis(200);
/// A wait longer than this makes readiness fail, naming the standby.
pub const UNREADY_AFTER: Duration = Duration::from_secs(2);

/// Why a gate stopped waiting without the standbys' word.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    /// The primary could not be asked.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The deadline passed first.
    #[error("standby {standby} has not flushed the WAL up to {target} ({behind})")]
    Timeout {
        /// The first named standby that had not.
        standby: String,
        /// The position it had to reach.
        target: WalPosition,
        /// Where it stood.
        behind: Behind,
    },
    /// The caller stopped waiting (shutdown).
    #[error("stopped waiting for the standbys")]
    Stopped,
    /// The primary answered on another timeline than before: a standby
    /// was promoted in between, and what the caller read or wrote on the
    /// old primary may be gone. Nothing resting on it may leave.
    #[error("the primary moved from timeline {before} to {now}: a failover came in between")]
    FailedOver {
        /// The timeline the caller's work ran on.
        before: u32,
        /// The timeline the primary answers on now.
        now: u32,
    },
}

/// Where a standby stood when last asked, short of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Behind {
    /// It was not streaming from the primary.
    Absent,
    /// Its position is hidden from this role.
    Hidden,
    /// This many bytes of WAL behind the target.
    Bytes {
        /// Bytes of WAL.
        bytes: u64,
    },
}

impl std::fmt::Display for Behind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Absent => write!(f, "not streaming from the primary"),
            Self::Hidden => write!(
                f,
                "its position is hidden from this role: grant it pg_read_all_stats"
            ),
            Self::Bytes { bytes } => write!(f, "{bytes} bytes behind"),
        }
    }
}

/// A wait in progress, for readiness.
#[derive(Debug, Clone)]
struct Waiting {
    standby: String,
    behind: Behind,
    since: Duration,
}

/// The standbys that must hold a commit before what rests on it leaves
/// (`CANOPY_MQ_DURABLE_STANDBYS`), shared by the drainer and every
/// subscription of a service.
#[derive(Debug)]
pub struct DurableStandbys {
    names: Vec<String>,
    /// How many of them must have flushed (all, unless `ANY n (…)`).
    need: usize,
    /// The waits in progress that found a standby behind, and the longest
    /// such wait's standing (cleared when the last of them ends).
    waiting: Mutex<(usize, Option<Waiting>)>,
}

/// A wait that found a standby behind: counted in
/// [`DurableStandbys::waiting`] until it ends, however it ends.
struct Behindhand<'a> {
    gate: &'a DurableStandbys,
    counted: bool,
}

impl Behindhand<'_> {
    fn behind(&mut self, standby: &str, behind: Behind, now: Duration) {
        let mut waiting = self.gate.waiting.lock().expect("gate lock");
        if !self.counted {
            self.counted = true;
            waiting.0 += 1;
        }
        let since = waiting.1.as_ref().map_or(now, |w| w.since);
        waiting.1 = Some(Waiting {
            standby: standby.to_owned(),
            behind,
            since,
        });
    }
}

impl Drop for Behindhand<'_> {
    fn drop(&mut self) {
        if self.counted {
            let mut waiting = self.gate.waiting.lock().expect("gate lock");
            waiting.0 -= 1;
            if waiting.0 == 0 {
                waiting.1 = None;
            }
        }
    }
}

impl DurableStandbys {
    /// The gate for `names` (`application_name`s), each of which must
    /// have flushed; `None` for none.
    pub fn new(names: Vec<String>) -> Option<Self> {
        let need = names.len();
        Self::any(need, names)
    }

    /// The gate for any `need` of `names` (`ANY need (…)`, as in
    /// `synchronous_standby_names`): with every standby a failover may
    /// promote named, the one promoted after a switchover is no standby
    /// any more, and the others still vouch. `None` for no name; `need`
    /// is kept within 1..=names.
    pub fn any(need: usize, names: Vec<String>) -> Option<Self> {
        (!names.is_empty()).then(|| Self {
            need: need.clamp(1, names.len()),
            names,
            waiting: Mutex::new((0, None)),
        })
    }

    /// The gate `config` asks for (`CANOPY_MQ_DURABLE_STANDBYS`).
    pub fn of(config: &crate::core::drainer::DrainerConfig) -> Option<Self> {
        let names = config.durable_standbys.clone();
        match config.durable_standbys_any {
            Some(need) => Self::any(need as usize, names),
            None => Self::new(names),
        }
    }

    /// The standbys named.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The primary's timeline now: read before the work a later
    /// [`wait`](Self::wait) vouches for begins (a claim, an inbox
    /// transaction).
    pub async fn timeline<R: Replication>(&self, store: &R) -> Result<u32, GateError> {
        Ok(store.replication_positions(&self.names).await?.timeline)
    }

    /// Waits until every named standby has flushed the primary's WAL up to
    /// its flush position now; gives up at clock time `until` (if any) or
    /// once `stopped` says so. A store error ends the wait at once (the
    /// caller decides whether to ask again). True if it had to wait.
    ///
    /// `since` is the [`timeline`](Self::timeline) read before the work
    /// began: the work ran on a server between the two reads, and a
    /// promotion starts a new timeline, so if the primary still answers on
    /// `since` the work ran on this line of history and the flush position
    /// read now is past it. On another timeline (or one that changes while
    /// it waits) the wait ends with [`GateError::FailedOver`].
    pub async fn wait<R: Replication, C: Clock>(
        &self,
        store: &R,
        clock: &C,
        since: u32,
        until: Option<Duration>,
        stopped: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<bool, GateError> {
        let first = store.replication_positions(&self.names).await?;
        let moved = |now: u32| GateError::FailedOver { before: since, now };
        if first.timeline != since {
            return Err(moved(first.timeline));
        }
        let target = first.flushed;
        let mut standbys = first.standbys;
        let (mut pause, mut waited) = (POLL_FIRST, false);
        let mut behindhand = Behindhand {
            gate: self,
            counted: false,
        };
        loop {
            let Some((standby, behind)) = self.first_behind(&standbys, target) else {
                return Ok(waited);
            };
            let now = clock.now();
            behindhand.behind(standby, behind, now);
            if until.is_some_and(|u| now >= u) {
                return Err(GateError::Timeout {
                    standby: standby.to_owned(),
                    target,
                    behind,
                });
            }
            if stopped() {
                return Err(GateError::Stopped);
            }
            let sleep = until.map_or(pause, |u| pause.min(u.saturating_sub(now)));
            clock.sleep(sleep).await;
            (pause, waited) = ((pause * 2).min(POLL_MAX), true);
            let next = store.replication_positions(&self.names).await?;
            if next.timeline != since {
                return Err(moved(next.timeline));
            }
            standbys = next.standbys;
        }
    }

    /// `None` if enough named standbys reached `target`; else the first
    /// one short of it, and where it stands.
    fn first_behind<'a>(
        &'a self,
        standbys: &[StandbyFlush],
        target: WalPosition,
    ) -> Option<(&'a str, Behind)> {
        let at = |i: usize| standbys.get(i).copied().unwrap_or(StandbyFlush::Absent);
        let reached = (0..self.names.len())
            .filter(|&i| matches!(at(i), StandbyFlush::At(p) if p >= target))
            .count();
        if reached >= self.need {
            return None;
        }
        self.names.iter().enumerate().find_map(|(i, name)| {
            let behind = match at(i) {
                StandbyFlush::At(p) if p >= target => return None,
                StandbyFlush::At(p) => Behind::Bytes {
                    bytes: target.0 - p.0,
                },
                StandbyFlush::Absent => Behind::Absent,
                StandbyFlush::Hidden => Behind::Hidden,
            };
            Some((name.as_str(), behind))
        })
    }

    /// Why readiness fails, at clock time `now`: waits that found a
    /// standby behind, going on for longer than [`UNREADY_AFTER`] (counted
    /// from the first of them, while one is in progress).
    pub fn reasons(&self, now: Duration) -> Vec<UnreadyReason> {
        let waiting = self.waiting.lock().expect("gate lock").1.clone();
        match waiting {
            Some(w) if now.saturating_sub(w.since) > UNREADY_AFTER => {
                vec![UnreadyReason::StandbyBehind {
                    standby: w.standby,
                    behind: w.behind,
                    for_secs: now.saturating_sub(w.since).as_secs(),
                }]
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ports::ReplicationPositions;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A clock that moves only when slept on.
    #[derive(Default)]
    struct StepClock(AtomicU64);
    impl Clock for StepClock {
        fn now(&self) -> Duration {
            Duration::from_micros(self.0.load(Ordering::SeqCst))
        }
        async fn sleep(&self, d: Duration) {
            self.0.fetch_add(d.as_micros() as u64, Ordering::SeqCst);
        }
    }

    /// A primary at 1 000 on timeline 1 whose one standby flushes `step`
    /// bytes per look; promoted (timeline 2) after `promoted_after` looks.
    struct Stream {
        standby: AtomicU64,
        step: u64,
        absent: bool,
        promoted_after: Option<u64>,
        looks: AtomicU64,
    }

    fn stream(at: u64, step: u64, absent: bool) -> Stream {
        Stream {
            standby: AtomicU64::new(at),
            step,
            absent,
            promoted_after: None,
            looks: AtomicU64::new(0),
        }
    }
    impl Replication for Stream {
        async fn replication_positions(
            &self,
            standbys: &[String],
        ) -> Result<ReplicationPositions, StoreError> {
            let at = self.standby.fetch_add(self.step, Ordering::SeqCst);
            let one = if self.absent {
                StandbyFlush::Absent
            } else {
                StandbyFlush::At(WalPosition(at))
            };
            let looks = self.looks.fetch_add(1, Ordering::SeqCst);
            let promoted = self.promoted_after.is_some_and(|n| looks >= n);
            Ok(ReplicationPositions {
                flushed: WalPosition(1_000),
                timeline: if promoted { 2 } else { 1 },
                standbys: standbys.iter().map(|_| one).collect(),
            })
        }
    }

    fn gate() -> DurableStandbys {
        DurableStandbys::new(vec!["pg2".into()]).unwrap()
    }

    #[tokio::test]
    async fn it_passes_once_the_standby_reaches_the_flush_position_read_first() {
        let clock = StepClock::default();
        let store = stream(700, 100, false);
        assert!(
            gate()
                .wait(&store, &clock, 1, None, &|| false)
                .await
                .unwrap()
        );
        // Looks at 700, 800, 900, 1000: three pauses of 1, 2 and 4 ms.
        assert_eq!(clock.now(), Duration::from_millis(7));
    }

    #[tokio::test]
    async fn an_absent_standby_holds_until_the_deadline_and_readiness_names_it() {
        let clock = StepClock::default();
        let store = stream(0, 0, true);
        let gate = gate();
        let until = Duration::from_secs(5);
        let e = gate.wait(&store, &clock, 1, Some(until), &|| false).await;
        assert!(
            matches!(&e, Err(GateError::Timeout { standby, behind: Behind::Absent, .. }) if standby == "pg2"),
            "{e:?}"
        );
        assert_eq!(clock.now(), until, "never sleeps past the deadline");
        assert!(
            gate.reasons(clock.now()).is_empty(),
            "a wait that ended holds readiness no more"
        );
        // While one waits, readiness names the standby past the grace.
        let reasons = std::sync::Mutex::new(Vec::new());
        let start = clock.now();
        let stopped = || {
            if clock.now() >= start + Duration::from_secs(3) {
                *reasons.lock().unwrap() = gate.reasons(clock.now());
                return true;
            }
            false
        };
        let e = gate.wait(&store, &clock, 1, None, &stopped).await;
        assert_eq!(e, Err(GateError::Stopped));
        let reasons = reasons.into_inner().unwrap();
        assert_eq!(reasons.len(), 1);
        assert!(reasons[0].to_string().contains("pg2"), "{}", reasons[0]);
    }

    #[tokio::test]
    async fn a_lagging_standby_stops_the_wait_when_told_and_a_pass_clears_readiness() {
        let clock = StepClock::default();
        let gate = gate();
        let lagging = stream(10, 0, false);
        let stop_at = Duration::from_secs(4);
        let said = std::sync::Mutex::new(String::new());
        let stopped = || {
            let stop = clock.now() >= stop_at;
            if stop {
                *said.lock().unwrap() = gate.reasons(clock.now())[0].to_string();
            }
            stop
        };
        let e = gate.wait(&lagging, &clock, 1, None, &stopped).await;
        assert_eq!(e, Err(GateError::Stopped));
        assert!(said.lock().unwrap().contains("990 bytes behind"));
        let caught_up = stream(1_000, 0, false);
        let waited = gate.wait(&caught_up, &clock, 1, None, &|| false).await;
        assert_eq!(waited, Ok(false), "no wait: no pause");
        assert!(gate.reasons(clock.now()).is_empty());
    }

    #[tokio::test]
    async fn a_promotion_before_or_during_the_wait_lets_nothing_through() {
        let clock = StepClock::default();
        // The work ran on timeline 1; the primary answers on 2 at once,
        // however far its standby flushed.
        let mut promoted = stream(5_000, 0, false);
        promoted.promoted_after = Some(0);
        let e = gate().wait(&promoted, &clock, 1, None, &|| false).await;
        assert_eq!(e, Err(GateError::FailedOver { before: 1, now: 2 }));
        // Promoted while it waited for a lagging standby.
        let mut midway = stream(0, 600, false);
        midway.promoted_after = Some(1);
        let e = gate().wait(&midway, &clock, 1, None, &|| false).await;
        assert_eq!(e, Err(GateError::FailedOver { before: 1, now: 2 }));
        let same = stream(1_000, 0, false);
        assert_eq!(gate().timeline(&same).await, Ok(1));
    }

    /// Two standbys: `a` absent, `b` at `b_at`; the primary at 1 000.
    struct Two(u64);
    impl Replication for Two {
        async fn replication_positions(
            &self,
            _: &[String],
        ) -> Result<ReplicationPositions, StoreError> {
            Ok(ReplicationPositions {
                flushed: WalPosition(1_000),
                timeline: 1,
                standbys: vec![StandbyFlush::Absent, StandbyFlush::At(WalPosition(self.0))],
            })
        }
    }

    #[tokio::test]
    async fn any_n_of_the_named_standbys_may_vouch_but_not_fewer() {
        let clock = StepClock::default();
        let names = || vec!["a".to_owned(), "b".to_owned()];
        let any_one = DurableStandbys::any(1, names()).unwrap();
        assert_eq!(
            any_one.wait(&Two(1_000), &clock, 1, None, &|| false).await,
            Ok(false)
        );
        let until = Some(Duration::from_millis(50));
        let e = any_one.wait(&Two(999), &clock, 1, until, &|| false).await;
        assert!(
            matches!(&e, Err(GateError::Timeout { standby, .. }) if standby == "a"),
            "{e:?}"
        );
        let all = DurableStandbys::new(names()).unwrap();
        let until = Some(clock.now() + Duration::from_millis(50));
        let e = all.wait(&Two(1_000), &clock, 1, until, &|| false).await;
        assert!(
            matches!(&e, Err(GateError::Timeout { standby, behind: Behind::Absent, .. }) if standby == "a"),
            "{e:?}"
        );
        assert_eq!(
            DurableStandbys::any(9, names()).unwrap().need,
            2,
            "at most all"
        );
    }

    #[test]
    fn no_name_no_gate_and_positions_print_as_postgresql_does() {
        assert!(DurableStandbys::new(Vec::new()).is_none());
        assert_eq!(WalPosition(0x1_0300_0148).to_string(), "1/3000148");
        assert_eq!(WalPosition(0).to_string(), "0/0");
    }
}
