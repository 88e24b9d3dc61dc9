//! Crash and pause points: where in a port call a fault can stop a replica
//! (a crash: the calling task parks forever and the world crashes the host)
//! or stall it (a stop-the-world pause). Each host's adapters share one
//! [`Hooks`], whose probabilities the world turns on and off.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::trace::{Event, FaultKind, Trace};

/// Where in a tick a crash or pause can be injected.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Point {
    /// Phase 1 returned; nothing published yet.
    AfterClaim,
    /// Some of the batch is published, some not.
    MidPublish,
    /// Everything confirmed; the mark not yet sent.
    BeforeMark,
    /// The mark was applied but its reply not yet seen.
    MidMark,
    /// Consumer: the handler's transaction committed; the ack not yet sent.
    AfterCommit,
    /// Consumer: the handler wrote its effect and has not returned.
    MidHandler,
}

/// Crash and pause probabilities per point, shared by a drainer host's
/// adapters and changed by the world.
#[derive(Debug, Clone, Default)]
pub struct Hooks {
    inner: Arc<Mutex<HooksInner>>,
}

#[derive(Debug, Default)]
struct HooksInner {
    crash_prob: BTreeMap<Point, f64>,
    pause: BTreeMap<Point, (f64, Duration)>,
    rng: Option<SmallRng>,
    /// Set when a crash point fired; the world crashes the host.
    crash_requested: bool,
}

impl Hooks {
    /// Hooks with their own seeded RNG.
    pub fn new(seed: u64) -> Self {
        let hooks = Self::default();
        hooks.inner.lock().expect("hooks").rng = Some(SmallRng::seed_from_u64(seed));
        hooks
    }

    /// Sets the crash probability at `point`.
    pub fn set_crash(&self, point: Point, prob: f64) {
        self.inner
            .lock()
            .expect("hooks")
            .crash_prob
            .insert(point, prob);
    }

    /// Sets a pause of `length` with probability `prob` at `point`.
    pub fn set_pause(&self, point: Point, prob: f64, length: Duration) {
        self.inner
            .lock()
            .expect("hooks")
            .pause
            .insert(point, (prob, length));
    }

    /// Clears every crash and pause (faults heal).
    pub fn clear(&self) {
        let mut h = self.inner.lock().expect("hooks");
        h.crash_prob.clear();
        h.pause.clear();
    }

    /// Takes the crash request, if a point fired.
    pub fn take_crash_request(&self) -> bool {
        std::mem::take(&mut self.inner.lock().expect("hooks").crash_requested)
    }

    /// Passes `point`: may pause, or crash (never returns).
    pub async fn at(&self, point: Point, who: &str, trace: &Trace) {
        let (crash, pause) = {
            let mut h = self.inner.lock().expect("hooks");
            let crash_p = h.crash_prob.get(&point).copied().unwrap_or(0.0);
            let pause = h.pause.get(&point).copied();
            if crash_p <= 0.0 && pause.is_none_or(|(p, _)| p <= 0.0) {
                return; // nothing armed here (unseeded hooks never are)
            }
            let rng = h.rng.as_mut().expect("hooks seeded");
            let crash = crash_p > 0.0 && rng.random_bool(crash_p.min(1.0));
            let pause = pause.filter(|(p, _)| *p > 0.0 && rng.random_bool(p.min(1.0)));
            if crash {
                h.crash_requested = true;
            }
            (crash, pause.map(|(_, d)| d))
        };
        if crash {
            trace.now(Event::Fault {
                kind: FaultKind::CrashPoint,
                detail: format!("{who} crashes at {point:?}"),
            });
            std::future::pending::<()>().await;
        }
        if let Some(d) = pause {
            trace.now(Event::Fault {
                kind: FaultKind::Pause,
                detail: format!("{who} paused {} ms at {point:?}", d.as_millis()),
            });
            crate::engine::sleep(d).await;
        }
    }
}
