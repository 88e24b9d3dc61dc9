//! The run loop: ticks paced by the outcome, backoff after errors, and the
//! broker's single-flight reconnect.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tracing::Instrument;

use super::{Drainer, ERROR_BACKOFF_MAX, IDLE_TICK_FACTOR, STEADY_AFTER};
use crate::core::marks::Mark;
use crate::core::ports::{Broker, Clock, Entropy, OutboxStore};
use crate::core::sleep_or_shutdown;

/// The pause after `consecutive_errors` failed ticks in a row: the tick
/// doubled per further error, capped at [`ERROR_BACKOFF_MAX`], plus a jitter
/// below a quarter of that drawn from `random`.
pub(super) fn backoff_delay(tick: Duration, consecutive_errors: u32, random: u64) -> Duration {
    let exp = consecutive_errors.saturating_sub(1).min(16);
    let base = tick.saturating_mul(1u32 << exp).min(ERROR_BACKOFF_MAX);
    let quarter_ms = (base.as_millis() as u64 / 4).max(1);
    base + Duration::from_millis(random % quarter_ms)
}

impl<S: OutboxStore, B: Broker, C: Clock, E: Entropy> Drainer<S, B, C, E> {
    /// Replaces the connection a Phase-2 failure implicated, if one did.
    pub(super) async fn reconnect_if_due(&self) {
        let due = self.reconnect_due.swap(0, Ordering::Relaxed);
        let Some(generation) = due.checked_sub(1) else {
            return;
        };
        let span = tracing::info_span!(
            "outbox.reconnect",
            outbox.replica = %self.config.replica_id,
            messaging.system = "rabbitmq",
        );
        let reconnected = self
            .broker
            .connection_reconnect(generation)
            .instrument(span)
            .await;
        if let Err(e) = reconnected {
            self.marks.hit(Mark::ReconnectFailed);
            tracing::warn!(error = %e, "broker reconnect failed; retrying on the next tick");
        }
    }

    /// Runs ticks until `shutdown` turns true (or its sender is dropped). A
    /// batch in hand when shutdown is asked for is finished (Phase 2 is
    /// bounded by the confirm timeout) and marked, or released, before this
    /// returns.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let cfg = &self.config;
        let idle_tick = cfg.tick * IDLE_TICK_FACTOR;
        let mut last_busy: Option<Duration> = None;
        let mut consecutive_errors: u32 = 0;
        let mut idle = false;
        // A commit woke the drainer: its first claim expects rows.
        let mut woken = false;
        tracing::info!(replica = %cfg.replica_id, exchange = %cfg.exchange, "outbox drainer started");
        loop {
            if *shutdown.borrow() {
                break;
            }
            let mut wakeable = true;
            // `drain` returns once a claim comes back short of a full batch:
            // the backlog is drained, so the next claim waits a tick. Not
            // after keyed rows: a key's next event becomes claimable only
            // once its head is marked (inside the drain), so a short claim
            // of heads does not mean the keys are done; drain again at once
            // (a drain that claims no keyed row ends this).
            let delay = match self.drain_expecting(&shutdown, woken).await {
                Ok(report) => {
                    consecutive_errors = 0;
                    if report.claimed > 0 {
                        last_busy = Some(self.clock.now());
                    }
                    let steady = last_busy
                        .is_none_or(|t| self.clock.now().saturating_sub(t) >= STEADY_AFTER);
                    if steady && !idle {
                        self.marks.hit(Mark::IdleTick);
                    }
                    idle = steady;
                    if report.keyed_claimed > 0 {
                        Duration::ZERO
                    } else if steady {
                        idle_tick
                    } else {
                        cfg.tick
                    }
                }
                Err(e) => {
                    self.marks.hit(Mark::DrainFailed);
                    idle = false;
                    consecutive_errors = consecutive_errors.saturating_add(1);
                    last_busy = Some(self.clock.now());
                    tracing::warn!(
                        replica = %cfg.replica_id,
                        error = %e,
                        consecutive_errors,
                        "outbox drain tick failed; claims released, attempts untouched"
                    );
                    wakeable = false;
                    self.backoff(consecutive_errors)
                }
            };
            woken = false;
            let stop = match self.wakeup.as_ref().filter(|_| wakeable) {
                Some(wakeup) if !delay.is_zero() => {
                    tokio::select! {
                        biased;
                        stop = sleep_or_shutdown(&*self.clock, delay, &mut shutdown) => stop,
                        () = wakeup.notified() => {
                            self.marks.hit(Mark::WokenByCommit);
                            woken = true;
                            // Let the commits that follow this one join its
                            // claim (`wakeup_linger`); their notifications
                            // meanwhile leave one wakeup for the next round.
                            !cfg.wakeup_linger.is_zero()
                                && sleep_or_shutdown(&*self.clock, cfg.wakeup_linger, &mut shutdown).await
                        }
                    }
                }
                _ => sleep_or_shutdown(&*self.clock, delay, &mut shutdown).await,
            };
            if stop {
                break;
            }
        }
        tracing::info!(replica = %cfg.replica_id, "outbox drainer stopped");
    }

    /// Exponential backoff from the busy tick, capped, with up to 25 % jitter
    /// so replicas that failed together do not retry in lockstep.
    pub(super) fn backoff(&self, consecutive_errors: u32) -> Duration {
        backoff_delay(
            self.config.tick,
            consecutive_errors,
            self.entropy.next_u64(),
        )
    }
}
