//! The stats task and readiness (#1230): each sample says what the table
//! held when the server took it (pending rows, parked rows, pending rows
//! blocked behind a parked earlier event of their key; the oldest pending
//! row no younger than its commit), folded here from the store's own
//! events, never from the fake's counters; the gauges say what the sample
//! they were set from said (pending, oldest unpublished age, parked,
//! blocked behind a parked head of their ordering key; ready
//! exactly when under both thresholds), and readiness fails exactly past
//! its thresholds, before the first sample, or when the last sample is
//! older than three intervals.
//!
//! The stats task sets the gauges in the same poll as the store's answer
//! (`StatsAnswered`, recorded by the adapter as it returns), so each
//! `Gauge` belongs to the last stats answer or failure before it.

use std::collections::BTreeMap;
use std::time::Duration;

use uuid::Uuid;

use super::{Context, Findings, Invariant, TIMING_SLACK};
use crate::trace::Event;
use outbox::core::durability::UNREADY_AFTER;

/// A sample as the stats task saw it.
#[derive(Clone, Copy)]
struct Sample {
    at: Duration,
    pending: u64,
    oldest: Duration,
    parked: u64,
    blocked: u64,
}

impl Sample {
    /// The sample a `StatsAnswered` at `at` says.
    fn answered(at: Duration, e: &Event) -> Self {
        let Event::StatsAnswered {
            pending,
            oldest_age_ms,
            parked,
            blocked,
            ..
        } = e
        else {
            unreachable!("a stats answer");
        };
        Sample {
            at,
            pending: *pending,
            oldest: Duration::from_millis(*oldest_age_ms),
            parked: *parked,
            blocked: *blocked,
        }
    }
}

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    samples_truthful(ctx, out);
    gauges_follow_samples(ctx, out);
}

/// A row of `event_outbox` as the store's events say it is.
#[derive(Clone, Copy, Default)]
struct RowState {
    committed_at: Duration,
    published: bool,
    parked: bool,
}

/// The table, folded from the store's events in trace order.
#[derive(Default)]
struct Table {
    rows: BTreeMap<Uuid, RowState>,
}

impl Table {
    fn apply(&mut self, at: Duration, e: &Event) {
        let mut set = |ids: &[Uuid], f: &dyn Fn(&mut RowState)| {
            for id in ids {
                if let Some(r) = self.rows.get_mut(id) {
                    f(r);
                }
            }
        };
        match e {
            Event::Committed { ids, .. } => {
                for id in ids {
                    self.rows.insert(
                        *id,
                        RowState {
                            committed_at: at,
                            ..RowState::default()
                        },
                    );
                }
            }
            Event::MarkedPublished { ids, .. } | Event::Skipped { ids } => {
                set(ids, &|r| r.published = true)
            }
            Event::MarkedFailed { parked, .. } => set(parked, &|r| r.parked = true),
            Event::Unparked { ids } => set(ids, &|r| r.parked = false),
            Event::CommitsLost {
                unmarked, parks, ..
            } => {
                set(unmarked, &|r| r.published = false);
                for (id, parked) in parks {
                    set(&[*id], &|r| r.parked = *parked);
                }
            }
            Event::Deleted { ids } | Event::FailedOver { lost: ids, .. } => {
                for id in ids {
                    self.rows.remove(id);
                }
            }
            _ => {}
        }
    }

    /// (pending, parked, blocked, the oldest pending row's commit).
    fn counts(&self, keyed: &BTreeMap<Uuid, (String, i64)>) -> (u64, u64, u64, Option<Duration>) {
        let unpublished = || self.rows.iter().filter(|(_, r)| !r.published);
        let mut parked_at: BTreeMap<&str, i64> = BTreeMap::new();
        for (id, _) in unpublished().filter(|(_, r)| r.parked) {
            if let Some((key, seq)) = keyed.get(id) {
                let lowest = parked_at.entry(key).or_insert(*seq);
                *lowest = (*lowest).min(*seq);
            }
        }
        let (mut pending, mut parked, mut blocked) = (0, 0, 0);
        let mut oldest: Option<Duration> = None;
        for (id, r) in unpublished() {
            if r.parked {
                parked += 1;
                continue;
            }
            pending += 1;
            oldest = Some(oldest.map_or(r.committed_at, |o| o.min(r.committed_at)));
            if keyed
                .get(id)
                .is_some_and(|(key, seq)| parked_at.get(key.as_str()).is_some_and(|p| p < seq))
            {
                blocked += 1;
            }
        }
        (pending, parked, blocked, oldest)
    }
}

/// Each sample the server took says what the table held then: its
/// pending, parked and blocked counts exactly, its oldest age at least
/// the age of the oldest pending row's commit (a row is inserted before
/// its transaction commits).
fn samples_truthful(ctx: &Context<'_>, out: &mut Findings) {
    let mut table = Table::default();
    // Each key's numbers as the commits gave them, so far.
    let mut keyed: BTreeMap<Uuid, (String, i64)> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::KeysNumbered { rows } => {
                for (id, key, seq) in rows {
                    keyed.insert(*id, (key.clone(), *seq));
                }
            }
            Event::StatsSampled {
                pending,
                oldest_age_ms,
                parked,
                blocked,
            } => {
                let (p, k, b, oldest) = table.counts(&keyed);
                // Less a millisecond: the server's clock counts whole ones.
                let oldest_floor = oldest.map_or(0, |o| {
                    (at.saturating_sub(o).as_millis() as u64).saturating_sub(1)
                });
                if (*pending, *parked, *blocked) != (p, k, b) || *oldest_age_ms < oldest_floor {
                    out.add(
                        Invariant::GaugesTruthful,
                        Some(*at),
                        format!(
                            "the stats sample said pending {pending}, parked {parked}, blocked {blocked}, \
                             oldest {oldest_age_ms} ms; the table held pending {p}, parked {k}, \
                             blocked {b}, oldest at least {oldest_floor} ms"
                        ),
                    );
                }
            }
            _ => {}
        }
        table.apply(*at, e);
    }
}

/// The gauges say what the sample they were set from said, and readiness
/// follows the last sample.
fn gauges_follow_samples(ctx: &Context<'_>, out: &mut Findings) {
    let l = ctx.limits;
    let under = |s: &Sample| s.pending <= l.pending_warn && s.oldest <= l.oldest_warn;
    // The last successful sample of each replica, and the last stats call
    // (Some: answered with this sample; None: failed) the gauges follow.
    let mut last_ok: BTreeMap<&str, Sample> = BTreeMap::new();
    let mut current: Option<(&str, Option<Sample>)> = None;
    let mut standby = StandbyTrouble::default();
    for (at, e) in ctx.events {
        standby.see(*at, e);
        match e {
            Event::StatsAnswered { replica, .. } => {
                let s = Sample::answered(*at, e);
                last_ok.insert(replica, s);
                current = Some((replica, Some(s)));
            }
            Event::StatsFailed { replica } => current = Some((replica, None)),
            Event::Gauge { name, micros } => {
                let value = *micros as f64 / 1e6;
                let Some((replica, sample)) = current else {
                    out.add(
                        Invariant::GaugesTruthful,
                        Some(*at),
                        format!("{name} set to {value} with no sample taken"),
                    );
                    continue;
                };
                let expected = match sample {
                    Some(s) => expected_gauge(name, &s, under(&s)),
                    // A failed sample: the ready gauge goes to 0, and only
                    // when readiness says unready.
                    None => {
                        let ready = last_ok.get(replica).is_some_and(|s| {
                            under(s) && at.saturating_sub(s.at) <= l.stats_interval * 3
                        });
                        (name.ends_with("_ready") && !ready).then_some(0.0)
                    }
                };
                if expected.is_none_or(|x| (x - value).abs() > 2e-6) {
                    out.add(
                        Invariant::GaugesTruthful,
                        Some(*at),
                        format!("{replica} set {name} to {value}; its sample said {expected:?}"),
                    );
                }
            }
            Event::Readiness {
                replica,
                ready,
                reasons,
            } => {
                let sample = last_ok.get(replica.as_str());
                let fresh = |s: &Sample| at.saturating_sub(s.at) <= l.stats_interval * 3;
                let stale_by_a_hair = |s: &Sample| {
                    let age = at.saturating_sub(s.at);
                    age > l.stats_interval * 3 && age <= l.stats_interval * 3 + TIMING_SLACK
                };
                let expected = sample.is_some_and(|s| fresh(s) && under(s));
                let (explained, reasons_ok) = standby.explains(*at, *ready, reasons);
                if (*ready != expected && !sample.is_some_and(stale_by_a_hair) && !explained)
                    || !reasons_ok
                {
                    out.add(
                        Invariant::GaugesTruthful,
                        Some(*at),
                        format!("{replica} said ready = {ready} ({reasons:?}); its last sample says {expected}"),
                    );
                }
            }
            _ => {}
        }
    }
}

/// The standby's trouble (away, or a failover under way): since when,
/// and until when (`None`: going on).
#[derive(Default)]
struct StandbyTrouble(Option<(Duration, Option<Duration>)>);

impl StandbyTrouble {
    fn see(&mut self, at: Duration, e: &Event) {
        match e {
            Event::FaultStart { kind, .. } if standby_fault(*kind) => self.0 = Some((at, None)),
            Event::FaultEnd { kind } if standby_fault(*kind) => {
                if let Some((_, until)) = &mut self.0 {
                    *until = Some(at);
                }
            }
            _ => {}
        }
    }

    /// Whether readiness `ready` with `reasons` at `at` is the durability
    /// gates' (unready only for waits on the standby, past the grace,
    /// while it was in trouble or a moment after: the last waits end),
    /// and whether every reason naming the standby is so explained.
    fn explains(&self, at: Duration, ready: bool, reasons: &[String]) -> (bool, bool) {
        let gated = |reason: &String| reason.contains("for standby");
        let waits = !ready
            && !reasons.is_empty()
            && reasons.iter().all(gated)
            && self.0.is_some_and(|(from, until)| {
                at >= from + UNREADY_AFTER && until.is_none_or(|u| at <= u + STANDBY_TROUBLE_TAIL)
            });
        (waits, waits || !reasons.iter().any(gated))
    }
}

/// How long after the standby's trouble ends a wait for it may still be
/// going on (a drainer's wait lasts up to the Phase-2 deadline).
const STANDBY_TROUBLE_TAIL: Duration = Duration::from_secs(3);

/// Whether a fault of `kind` takes the standby away (or fails over).
fn standby_fault(kind: crate::trace::FaultKind) -> bool {
    use crate::trace::FaultKind;
    matches!(
        kind,
        FaultKind::StandbyAway | FaultKind::Failover | FaultKind::Switchover
    )
}

/// What gauge `name` must be set to after sample `s`.
fn expected_gauge(name: &str, s: &Sample, under: bool) -> Option<f64> {
    use outbox::core::stats::gauges;
    match name {
        n if n == gauges::PENDING => Some(s.pending as f64),
        n if n == gauges::OLDEST_AGE => Some(s.oldest.as_secs_f64()),
        n if n == gauges::PARKED => Some(s.parked as f64),
        n if n == gauges::BLOCKED => Some(s.blocked as f64),
        n if n.ends_with("_ready") => Some(if under { 1.0 } else { 0.0 }),
        _ => None,
    }
}
