//! The stats task and readiness (#1230): the gauges say what the sample
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

use super::{Context, Findings, Invariant, TIMING_SLACK};
use crate::trace::Event;

/// A sample as the stats task saw it.
#[derive(Clone, Copy)]
struct Sample {
    at: Duration,
    pending: u64,
    oldest: Duration,
    parked: u64,
    blocked: u64,
}

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let l = ctx.limits;
    let under = |s: &Sample| s.pending <= l.pending_warn && s.oldest <= l.oldest_warn;
    // The last successful sample of each replica, and the last stats call
    // (Some: answered with this sample; None: failed) the gauges follow.
    let mut last_ok: BTreeMap<&str, Sample> = BTreeMap::new();
    let mut current: Option<(&str, Option<Sample>)> = None;
    for (at, e) in ctx.events {
        match e {
            Event::StatsAnswered {
                replica,
                pending,
                oldest_age_ms,
                parked,
                blocked,
            } => {
                let s = Sample {
                    at: *at,
                    pending: *pending,
                    oldest: Duration::from_millis(*oldest_age_ms),
                    parked: *parked,
                    blocked: *blocked,
                };
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
                if *ready != expected && !sample.is_some_and(stale_by_a_hair) {
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
