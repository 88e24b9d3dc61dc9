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

/// The state and since when the subscription has not been consuming (the
/// subscriber's clock).
#[derive(Debug)]
pub(super) struct Health {
    inner: Mutex<(SubscriptionState, Duration)>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            inner: Mutex::new((SubscriptionState::NotRun, Duration::ZERO)),
        }
    }
}

impl Health {
    /// Moves to `state` at `now`; the time it stopped consuming is kept
    /// across states that are not consuming.
    pub(super) fn set(&self, state: SubscriptionState, now: Duration) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let was_consuming = matches!(
            inner.0,
            SubscriptionState::Consuming | SubscriptionState::NotRun
        );
        if was_consuming || matches!(state, SubscriptionState::Consuming) {
            inner.1 = now;
        }
        inner.0 = state;
    }

    pub(super) fn state(&self) -> SubscriptionState {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// Why `subscription` is not ready at `now`, if it is not.
    pub(super) fn reasons(&self, subscription: &str, now: Duration) -> Vec<UnreadyReason> {
        let (state, since) = self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let for_secs = now.saturating_sub(since).as_secs();
        let unready = match state {
            SubscriptionState::NotRun | SubscriptionState::Consuming => false,
            SubscriptionState::Failed { .. } | SubscriptionState::Stopped => true,
            SubscriptionState::Starting | SubscriptionState::Reconnecting { .. } => {
                now.saturating_sub(since) >= NOT_CONSUMING_GRACE
            }
        };
        if !unready {
            return Vec::new();
        }
        vec![UnreadyReason::SubscriptionNotConsuming {
            subscription: subscription.to_owned(),
            state: state.name(),
            error: state.error(),
            for_secs,
        }]
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
}
