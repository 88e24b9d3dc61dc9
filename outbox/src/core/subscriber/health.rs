//! How a subscription stands, for readiness: consuming, or why not and
//! since when.

use std::sync::Mutex;
use std::time::Duration;

use crate::core::stats::UnreadyReason;

/// How long a running subscription may be without its consumers (starting,
/// or reconnecting after the broker lost them) before readiness fails: a
/// broker blip does not take the service out of traffic, an outage that
/// lasts does. A subscription the broker refused to set up fails readiness
/// at once.
pub const NOT_CONSUMING_GRACE: Duration = Duration::from_secs(30);

/// Where a subscription's [`run`](super::Subscriber::run) stands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum SubscriptionState {
    /// `run` has not been called: the subscriber serves replays only.
    NotRun,
    /// `run` is opening its consumers for the first time.
    Starting,
    /// Its consumers are open and taking deliveries.
    Consuming,
    /// Its consumers ended or cannot be opened; it retries with a backoff.
    Reconnecting {
        /// The latest reason.
        error: String,
    },
    /// The broker refused to set the subscription up (`run` returned
    /// [`SubscribeError::Setup`](crate::SubscribeError::Setup)); nothing
    /// consumes it until the deployment is fixed.
    Failed {
        /// What the broker said.
        error: String,
    },
    /// `run` returned after a shutdown.
    Stopped,
}

impl SubscriptionState {
    fn name(&self) -> &'static str {
        match self {
            Self::NotRun => "not_run",
            Self::Starting => "starting",
            Self::Consuming => "consuming",
            Self::Reconnecting { .. } => "reconnecting",
            Self::Failed { .. } => "failed",
            Self::Stopped => "stopped",
        }
    }

    fn error(&self) -> Option<String> {
        match self {
            Self::Reconnecting { error } | Self::Failed { error } => Some(error.clone()),
            _ => None,
        }
    }
}

/// How long a batch may be retried in place (its inbox statements failing
/// on something other than a delivery's data) before readiness fails: a
/// database blip does not, a failure that keeps coming back (the database
/// down, a constraint of the inbox table refusing every insert) does.
pub const RETRY_IN_PLACE_GRACE: Duration = Duration::from_secs(10);
/// How often a batch still retried in place says so in the log (its first
/// failure is said at once).
pub const RETRY_IN_PLACE_LOG_EVERY: Duration = Duration::from_secs(60);

/// The state, since when the subscription has not been consuming, and the
/// batches retried in place (since when, and their latest error), on the
/// subscriber's clock.
#[derive(Debug)]
pub(super) struct Health {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: SubscriptionState,
    since: Duration,
    in_place: std::collections::BTreeMap<u64, (Duration, String)>,
    next_token: u64,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                state: SubscriptionState::NotRun,
                since: Duration::ZERO,
                in_place: std::collections::BTreeMap::new(),
                next_token: 0,
            }),
        }
    }
}

/// One batch retried in place, registered with [`Health`] until dropped.
pub(super) struct InPlace<'a> {
    health: &'a Health,
    token: u64,
    /// When its retries began.
    pub(super) since: Duration,
    /// When it last said so in the log.
    pub(super) logged: Duration,
}

impl InPlace<'_> {
    /// Its latest error.
    pub(super) fn failed_again(&self, error: &str) {
        if let Some(entry) = self.health.lock().in_place.get_mut(&self.token) {
            entry.1 = error.to_owned();
        }
    }
}

impl Drop for InPlace<'_> {
    fn drop(&mut self) {
        self.health.lock().in_place.remove(&self.token);
    }
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves to `state` at `now`; the time it stopped consuming is kept
    /// across states that are not consuming.
    pub(super) fn set(&self, state: SubscriptionState, now: Duration) {
        let mut inner = self.lock();
        let was_consuming = matches!(
            inner.state,
            SubscriptionState::Consuming | SubscriptionState::NotRun
        );
        if was_consuming || matches!(state, SubscriptionState::Consuming) {
            inner.since = now;
        }
        inner.state = state;
    }

    pub(super) fn state(&self) -> SubscriptionState {
        self.lock().state.clone()
    }

    /// A batch begins to be retried in place at `now`, for `error`.
    pub(super) fn in_place(&self, now: Duration, error: &str) -> InPlace<'_> {
        let mut inner = self.lock();
        let token = inner.next_token;
        inner.next_token += 1;
        inner.in_place.insert(token, (now, error.to_owned()));
        InPlace {
            health: self,
            token,
            since: now,
            logged: now,
        }
    }

    /// Why `subscription` is not ready at `now`, if it is not.
    pub(super) fn reasons(&self, subscription: &str, now: Duration) -> Vec<UnreadyReason> {
        let inner = self.lock();
        let mut reasons = Vec::new();
        let (state, since) = (&inner.state, inner.since);
        let unready = match state {
            SubscriptionState::NotRun | SubscriptionState::Consuming => false,
            SubscriptionState::Failed { .. } | SubscriptionState::Stopped => true,
            SubscriptionState::Starting | SubscriptionState::Reconnecting { .. } => {
                now.saturating_sub(since) >= NOT_CONSUMING_GRACE
            }
        };
        if unready {
            reasons.push(UnreadyReason::SubscriptionNotConsuming {
                subscription: subscription.to_owned(),
                state: state.name(),
                error: state.error(),
                for_secs: now.saturating_sub(since).as_secs(),
            });
        }
        // The batch retried longest speaks for all.
        if let Some((since, error)) = inner.in_place.values().min_by_key(|(since, _)| *since)
            && now.saturating_sub(*since) >= RETRY_IN_PLACE_GRACE
        {
            reasons.push(UnreadyReason::SubscriptionRetryingInPlace {
                subscription: subscription.to_owned(),
                batches: inner.in_place.len(),
                error: error.clone(),
                for_secs: now.saturating_sub(*since).as_secs(),
            });
        }
        reasons
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_fails_at_once_on_a_refused_setup_and_after_the_grace_otherwise() {
        let h = Health::default();
        let s = Duration::from_secs;
        assert!(h.reasons("q", s(100)).is_empty(), "never run: replays only");
        h.set(SubscriptionState::Starting, s(10));
        assert!(h.reasons("q", s(39)).is_empty());
        assert_eq!(h.reasons("q", s(40)).len(), 1);
        h.set(SubscriptionState::Consuming, s(41));
        assert!(h.reasons("q", s(1000)).is_empty());
        h.set(
            SubscriptionState::Reconnecting {
                error: "lost".into(),
            },
            s(1000),
        );
        h.set(
            SubscriptionState::Reconnecting {
                error: "refused".into(),
            },
            s(1020),
        );
        assert!(h.reasons("q", s(1029)).is_empty());
        let r = h.reasons("q", s(1030));
        assert_eq!(
            r[0].to_string(),
            "subscription q is not consuming (reconnecting for 30 s): refused"
        );
        h.set(
            SubscriptionState::Failed {
                error: "PRECONDITION_FAILED".into(),
            },
            s(1031),
        );
        let r = h.reasons("q", s(1031));
        assert_eq!(
            r[0].to_string(),
            "subscription q is not consuming (failed for 31 s): PRECONDITION_FAILED"
        );
    }

    #[test]
    fn readiness_fails_while_a_batch_is_retried_in_place_past_the_grace() {
        let h = Health::default();
        let s = Duration::from_secs;
        h.set(SubscriptionState::Consuming, s(0));
        let first = h.in_place(s(100), "timeout");
        let second = h.in_place(s(105), "timeout");
        assert!(h.reasons("q", s(109)).is_empty());
        first.failed_again("violates check constraint");
        let r = h.reasons("q", s(110));
        assert_eq!(
            r[0].to_string(),
            "subscription q has retried 2 batch(es) in place for 10 s: violates check constraint"
        );
        drop(first);
        assert!(h.reasons("q", s(114)).is_empty(), "the other began at 105");
        assert_eq!(h.reasons("q", s(115)).len(), 1);
        drop(second);
        assert!(h.reasons("q", s(1000)).is_empty());
    }
}
