//! The stats task (#1230): samples the outbox, sets the gauges
//! `canopy_mq_outbox_pending`, `canopy_mq_outbox_oldest_unpublished_age_seconds`
//! and `canopy_mq_outbox_parked` through the `metrics` facade, logs a WARN
//! over the thresholds, and keeps the snapshot that readiness reads.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::drainer::DrainerConfig;
use super::ports::{Clock, OutboxStats, OutboxStore};
use super::sleep_or_shutdown;

/// Gauge names.
pub mod gauges {
    /// Unpublished, unparked rows.
    pub const PENDING: &str = "canopy_mq_outbox_pending";
    /// Age in seconds of the oldest unpublished, unparked row.
    pub const OLDEST_AGE: &str = "canopy_mq_outbox_oldest_unpublished_age_seconds";
    /// Parked rows.
    pub const PARKED: &str = "canopy_mq_outbox_parked";
    /// Pending rows that wait behind a parked row of their ordering key.
    pub const BLOCKED: &str = "canopy_mq_outbox_blocked_behind_parked";
}

/// Why the outbox is not ready.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
#[non_exhaustive]
pub enum UnreadyReason {
    /// No sample has been taken yet.
    NotSampled,
    /// The latest sample is older than three stats intervals (the store is
    /// failing or the task stopped).
    Stale {
        /// Seconds since the last successful sample.
        age_secs: u64,
    },
    /// More pending rows than the threshold.
    PendingOverThreshold {
        /// Pending rows.
        pending: u64,
        /// The threshold.
        threshold: u64,
    },
    /// The oldest pending row is older than the threshold.
    OldestOverThreshold {
        /// Its age in seconds.
        age_secs: u64,
        /// The threshold in seconds.
        threshold_secs: u64,
    },
    /// A subscription is not consuming: the broker refused to set it up,
    /// it stopped, or it has been without its consumers for longer than
    /// [`NOT_CONSUMING_GRACE`](crate::core::subscriber::NOT_CONSUMING_GRACE).
    SubscriptionNotConsuming {
        /// The subscription (queue).
        subscription: String,
        /// `starting`, `reconnecting`, `failed` or `stopped`.
        state: &'static str,
        /// The latest reason, if any.
        error: Option<String>,
        /// Seconds it has not been consuming.
        for_secs: u64,
    },
    /// A subscription's batches have been retried in place for longer than
    /// [`RETRY_IN_PLACE_GRACE`](crate::core::subscriber::RETRY_IN_PLACE_GRACE):
    /// their inbox statements keep failing on something other than a
    /// delivery's data (the database unavailable, a constraint of the
    /// inbox table), so nothing of theirs takes effect and no attempt is
    /// counted.
    SubscriptionRetryingInPlace {
        /// The subscription (queue).
        subscription: String,
        /// Batches retried in place now.
        batches: usize,
        /// The latest error of the one retried longest.
        error: String,
        /// Seconds it has been retried.
        for_secs: u64,
    },
    /// Publishing or acking has waited longer than
    /// [`UNREADY_AFTER`](crate::core::durability::UNREADY_AFTER) for a
    /// standby named in `CANOPY_MQ_DURABLE_STANDBYS` to flush what it rests on.
    StandbyBehind {
        /// The standby (`application_name`).
        standby: String,
        /// Where it stood when last asked.
        behind: crate::core::durability::Behind,
        /// Seconds it has been waited for.
        for_secs: u64,
    },
}

impl std::fmt::Display for UnreadyReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotSampled => write!(f, "outbox not sampled yet"),
            Self::Stale { age_secs } => write!(f, "outbox sample is {age_secs} s old"),
            Self::PendingOverThreshold { pending, threshold } => {
                write!(f, "{pending} outbox rows pending (threshold {threshold})")
            }
            Self::OldestOverThreshold {
                age_secs,
                threshold_secs,
            } => write!(
                f,
                "oldest unpublished outbox row is {age_secs} s old (threshold {threshold_secs} s)"
            ),
            Self::SubscriptionNotConsuming {
                subscription,
                state,
                error,
                for_secs,
            } => {
                write!(
                    f,
                    "subscription {subscription} is not consuming ({state} for {for_secs} s)"
                )?;
                match error {
                    Some(e) => write!(f, ": {e}"),
                    None => Ok(()),
                }
            }
            Self::SubscriptionRetryingInPlace {
                subscription,
                batches,
                error,
                for_secs,
            } => write!(
                f,
                "subscription {subscription} has retried {batches} batch(es) in place for \
                 {for_secs} s: {error}"
            ),
            Self::StandbyBehind {
                standby,
                behind,
                for_secs,
            } => write!(
                f,
                "publishing and acking have waited {for_secs} s for standby {standby} \
                 ({behind})"
            ),
        }
    }
}

/// The outbox's readiness: ready, or the list of reasons it is not. Parked
/// rows alone do not make the outbox unready (they need an operator, not a
/// traffic cut); they show in the gauge and the WARN log.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Readiness {
    /// True when `reasons` is empty.
    pub ready: bool,
    /// Why not.
    pub reasons: Vec<UnreadyReason>,
    /// The sample the verdict is based on, if any.
    pub stats: Option<OutboxStats>,
}

/// The latest sample, shared between the stats task and readiness checks.
#[derive(Debug, Clone, Default)]
pub struct OutboxHealth {
    inner: Arc<Mutex<Option<Sample>>>,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    stats: OutboxStats,
    taken_at: Duration,
}

impl OutboxHealth {
    /// Records a sample taken at clock time `now`.
    pub fn record(&self, stats: OutboxStats, now: Duration) {
        *self.inner.lock().expect("health lock") = Some(Sample {
            stats,
            taken_at: now,
        });
    }

    /// The latest sample.
    pub fn latest(&self) -> Option<OutboxStats> {
        self.inner.lock().expect("health lock").map(|s| s.stats)
    }

    /// Judges readiness at clock time `now` against `config`'s thresholds.
    pub fn readiness(&self, config: &DrainerConfig, now: Duration) -> Readiness {
        let sample = *self.inner.lock().expect("health lock");
        let Some(sample) = sample else {
            return Readiness {
                ready: false,
                reasons: vec![UnreadyReason::NotSampled],
                stats: None,
            };
        };
        let mut reasons = threshold_reasons(&sample.stats, config);
        let age = now.saturating_sub(sample.taken_at);
        if age > config.stats_interval * 3 {
            reasons.push(UnreadyReason::Stale {
                age_secs: age.as_secs(),
            });
        }
        Readiness {
            ready: reasons.is_empty(),
            reasons,
            stats: Some(sample.stats),
        }
    }
}

fn threshold_reasons(stats: &OutboxStats, config: &DrainerConfig) -> Vec<UnreadyReason> {
    let mut reasons = Vec::new();
    if stats.pending > config.pending_warn {
        reasons.push(UnreadyReason::PendingOverThreshold {
            pending: stats.pending,
            threshold: config.pending_warn,
        });
    }
    if stats.oldest_unpublished_age_secs > config.oldest_warn.as_secs_f64() {
        reasons.push(UnreadyReason::OldestOverThreshold {
            age_secs: stats.oldest_unpublished_age_secs as u64,
            threshold_secs: config.oldest_warn.as_secs(),
        });
    }
    reasons
}

/// Takes one sample: sets the gauges, records it in `health`, and warns over
/// the thresholds or on parked rows.
pub async fn sample<S: OutboxStore, C: Clock>(
    store: &S,
    clock: &C,
    config: &DrainerConfig,
    health: &OutboxHealth,
) -> Result<OutboxStats, crate::error::StoreError> {
    let stats = store.outbox_stats().await?;
    metrics::gauge!(gauges::PENDING).set(stats.pending as f64);
    metrics::gauge!(gauges::OLDEST_AGE).set(stats.oldest_unpublished_age_secs);
    metrics::gauge!(gauges::PARKED).set(stats.parked as f64);
    metrics::gauge!(gauges::BLOCKED).set(stats.blocked as f64);
    health.record(stats, clock.now());
    let reasons = threshold_reasons(&stats, config);
    metrics::gauge!(crate::telemetry::drainer::READY).set(if reasons.is_empty() {
        1.0
    } else {
        0.0
    });
    for reason in reasons {
        tracing::warn!(%reason, "outbox backlog over threshold: is the drainer publishing?");
    }
    if stats.parked > 0 {
        tracing::warn!(
            parked = stats.parked,
            blocked = stats.blocked,
            "outbox has parked rows; inspect and unpark them once the cause is fixed \
             (or skip them; `blocked` events of their ordering keys wait behind them)"
        );
    }
    Ok(stats)
}

/// Samples every `stats_interval` until `shutdown` turns true.
pub async fn run<S: OutboxStore, C: Clock>(
    store: Arc<S>,
    clock: Arc<C>,
    config: DrainerConfig,
    health: OutboxHealth,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        if let Err(e) = sample(&*store, &*clock, &config, &health).await {
            tracing::warn!(error = %e, "outbox stats sample failed");
            if !health.readiness(&config, clock.now()).ready {
                metrics::gauge!(crate::telemetry::drainer::READY).set(0.0);
            }
        }
        if sleep_or_shutdown(&*clock, config.stats_interval, &mut shutdown).await {
            return;
        }
    }
}
