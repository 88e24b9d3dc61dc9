//! Timing (#1061, #478), checked as time, which the simulation makes exact:
//! - **Phase-2 deadline**: a batch's Phase 2 (first publish to last confirm
//!   received, or the release) ends within `confirm_timeout` of the claim's
//!   return, whatever the overlap of batches; in particular nothing of the
//!   batch is published after it, and a batch whose confirms are not all in
//!   by then is handed back by then.
//! - **release before lease expiry**: a replica releases a row before its
//!   own lease on it expires (`confirm_timeout < lease_ttl` makes a timed-out
//!   batch's release come first).
//! - **backoff after failure**: after a failed drain (a store call failed,
//!   or claims had to be released) the replica's next claim comes no sooner
//!   than the tick after the failure, doubled for every failure in a row up
//!   to the cap: no hot loop against the database while the broker is down.
//! - **release on failure**: by then every row the replica held is handed
//!   back (marked or released), so none waits for its lease needlessly.
//! - **rate bound** (`max_rows_per_sec`, this library's addition): a claim
//!   that returned *k* rows delays the replica's next claim by *k* / rate,
//!   with no burst allowance.
//! - **poll cadence** (the ADR's "polls every 250ms when busy; backs off to
//!   1s when steady for a minute"): after a drain that ended on a short
//!   claim without a failure, the next claim waits at least the tick, and
//!   at least four ticks once the replica has had nothing to do for a
//!   minute, unless a commit notification reached it meanwhile. Only the
//!   floor is checked: a late poll costs latency, and `undrained` catches
//!   one that never comes.
//! - **claim walk** (issue 28): a claim walks on from a place only if it
//!   was called right after a full claim of its drain and before any store
//!   failure of that drain (one failing while it runs is the next claim's
//!   business), and at most `CLAIMS_PER_WALK` claims make one walk, so a
//!   row claimable behind the place waits a bounded number of claims.
//!
//! A crashed replica is excused from what it did not live to do, and a
//! replica blocked in a store call when a deadline falls (the database is
//! slow or unreachable) from what it could not do before that call
//! returned: it must then do it at once.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use uuid::Uuid;

use super::{Context, Findings, Invariant, TIMING_SLACK, host_of};
use outbox::core::drainer::{IDLE_TICK_FACTOR, STEADY_AFTER};
use outbox::core::ports::CLAIMS_PER_WALK;

use crate::trace::{Call, Event};

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let blocked = Blocked::of(ctx);
    phase2_deadline(ctx, &blocked, out);
    release_before_expiry(ctx, &blocked, out);
    backoff_and_release_on_failure(ctx, out);
    poll_cadence(ctx, out);
    claim_walk(ctx, out);
    if let Some(rate) = ctx.limits.max_rows_per_sec {
        rate_bound(ctx, rate, out);
    }
}

fn rate_bound(ctx: &Context<'_>, rate: u32, out: &mut Findings) {
    // Per replica: when its last claim was called, and the earliest instant
    // its next claim may be called.
    let mut last: BTreeMap<&str, (Duration, Duration)> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::ClaimCalled { replica } => {
                if let Some((_, earliest)) = last.get(replica.as_str())
                    && *at + Duration::from_millis(1) < *earliest
                {
                    out.add(
                        Invariant::RateBound,
                        Some(*at),
                        format!(
                            "{replica} claimed {:.3}s before its rate bound of {rate} rows/s allowed",
                            (*earliest - *at).as_secs_f64()
                        ),
                    );
                }
                last.insert(replica, (*at, *at));
            }
            Event::ClaimReturned { replica, ids } => {
                if let Some((called, earliest)) = last.get_mut(replica.as_str()) {
                    let share = Duration::from_secs(ids.len() as u64) / rate;
                    *earliest = (*earliest).max(*called + share);
                }
            }
            _ => {}
        }
    }
}

/// Every drainer store call: when each replica made it and when it
/// returned (`None`: never, the run ended or the replica crashed).
struct Blocked<'a> {
    calls: BTreeMap<&'a str, Vec<(Duration, Option<Duration>)>>,
}

impl<'a> Blocked<'a> {
    fn of(ctx: &Context<'a>) -> Self {
        let mut calls: BTreeMap<&str, Vec<(Duration, Option<Duration>)>> = BTreeMap::new();
        let mut open: BTreeMap<(&str, u8), VecDeque<usize>> = BTreeMap::new();
        let kind = |c: &Call| *c as u8;
        for (at, e) in ctx.events {
            let (replica, call, start) = match e {
                Event::ClaimCalled { replica } => (replica, &Call::Claim, true),
                Event::StoreCalled { replica, call, .. } => (replica, call, true),
                Event::StoreAnswered { replica, call } | Event::StoreFailed { replica, call } => {
                    (replica, call, false)
                }
                _ => continue,
            };
            let list = calls.entry(replica).or_default();
            let q = open.entry((replica, kind(call))).or_default();
            if start {
                q.push_back(list.len());
                list.push((*at, None));
            } else if let Some(i) = q.pop_front() {
                list[i].1 = Some(*at);
            }
        }
        Self { calls }
    }

    /// When `replica` may be held to do at once what was due at `due`: the
    /// latest return of a store call it was blocked in at `due` (`None` if
    /// one never returned), or `due` itself.
    fn excused_until(&self, replica: &str, due: Duration) -> Option<Duration> {
        let mut until = due;
        for (start, end) in self.calls.get(replica).into_iter().flatten() {
            if *start <= due && end.is_none_or(|e| e > due) {
                until = until.max((*end)?);
            }
        }
        Some(until)
    }
}

/// One claim as the replica received it, and what became of its rows.
struct Batch<'a> {
    replica: &'a str,
    returned: Duration,
    rows: Vec<Uuid>,
    /// Rows published under this claim.
    published: BTreeSet<Uuid>,
    /// When each row's confirm reached the replica.
    confirmed: BTreeMap<Uuid, Duration>,
    /// When each row was handed to a mark or a release (or its replica
    /// crashed).
    handed: BTreeMap<Uuid, Duration>,
    /// A publish after the deadline was already reported.
    late_publish: bool,
}

/// Every claim as its replica received it, with what became of its rows;
/// a publish after the deadline is reported as it is seen.
fn batches<'a>(ctx: &Context<'a>, out: &mut Findings) -> Vec<Batch<'a>> {
    let mut batches: Vec<Batch<'_>> = Vec::new();
    // A replica can hold a row under two claims (its own lease expired while
    // it stalled, and it claimed the row again): oldest first.
    let mut open: BTreeMap<(&str, Uuid), VecDeque<usize>> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::ClaimReturned { replica, ids } => {
                for id in ids {
                    open.entry((replica, *id))
                        .or_default()
                        .push_back(batches.len());
                }
                batches.push(Batch {
                    replica,
                    returned: *at,
                    rows: ids.clone(),
                    published: BTreeSet::new(),
                    confirmed: BTreeMap::new(),
                    handed: BTreeMap::new(),
                    late_publish: false,
                });
            }
            Event::PublishSent {
                client, message_id, ..
            } => published(
                ctx,
                &mut batches,
                &open,
                (*at, client.as_str(), *message_id),
                out,
            ),
            Event::ConfirmReceived { client, message_id } => {
                let claims = open.get(&(client.as_str(), *message_id));
                let first = claims.and_then(|q| {
                    q.iter().copied().find(|b| {
                        batches[*b].published.contains(message_id)
                            && !batches[*b].confirmed.contains_key(message_id)
                    })
                });
                if let Some(b) = first {
                    batches[b].confirmed.insert(*message_id, *at);
                }
            }
            Event::StoreCalled { replica, ids, .. } => {
                for id in ids {
                    let claims = open.get_mut(&(replica.as_str(), *id));
                    if let Some(b) = claims.and_then(VecDeque::pop_front) {
                        batches[b].handed.insert(*id, *at);
                    }
                }
            }
            Event::Host { host, up: false } => {
                open.retain(|(replica, id), claims| {
                    let crashed = host_of(replica) == host;
                    if crashed {
                        for b in claims.iter() {
                            batches[*b].handed.insert(*id, *at);
                        }
                    }
                    !crashed
                });
            }
            _ => {}
        }
    }
    batches
}

/// A publish of a claimed row: its batch's, reported if it came after
/// the batch's deadline.
fn published(
    ctx: &Context<'_>,
    batches: &mut [Batch<'_>],
    open: &BTreeMap<(&str, Uuid), VecDeque<usize>>,
    (at, client, message_id): (Duration, &str, Uuid),
    out: &mut Findings,
) {
    let timeout = ctx.limits.confirm_timeout;
    let claims = open.get(&(client, message_id));
    let first = claims.and_then(|q| {
        q.iter()
            .copied()
            .find(|b| !batches[*b].published.contains(&message_id))
    });
    if let Some(b) = first {
        let batch = &mut batches[b];
        batch.published.insert(message_id);
        if at > batch.returned + timeout + TIMING_SLACK && !batch.late_publish {
            batch.late_publish = true;
            out.add(
                    Invariant::Phase2Deadline,
                    Some(at),
                    format!(
                        "{client} published {message_id} {:.3}s after its claim returned (confirm_timeout {:.3}s)",
                        (at - batch.returned).as_secs_f64(),
                        timeout.as_secs_f64()
                    ),
                );
        }
    }
}

fn phase2_deadline(ctx: &Context<'_>, blocked: &Blocked<'_>, out: &mut Findings) {
    let timeout = ctx.limits.confirm_timeout;
    let end = ctx.events.last().map_or(Duration::ZERO, |(t, _)| *t);
    for batch in &batches(ctx, out) {
        let deadline = batch.returned + timeout;
        let due = deadline + TIMING_SLACK;
        if due > end {
            continue; // the run ended first
        }
        let broker_done = batch.rows.iter().all(|id| {
            ctx.model.unpublishable.contains(id)
                || batch.confirmed.get(id).is_some_and(|t| *t <= deadline)
        });
        if broker_done {
            continue;
        }
        let Some(until) = blocked.excused_until(batch.replica, deadline) else {
            continue; // blocked in a store call that never returned
        };
        let due = until + TIMING_SLACK;
        let waiting = batch
            .rows
            .iter()
            .filter(|id| batch.handed.get(id).is_none_or(|t| *t > due))
            .count();
        if waiting > 0 {
            out.add(
                Invariant::Phase2Deadline,
                Some(due),
                format!(
                    "{} still waited on the broker for {waiting} of {} rows {:.3}s after their claim returned at {:.3}s (confirm_timeout {:.3}s)",
                    batch.replica,
                    batch.rows.len(),
                    (due - batch.returned).as_secs_f64(),
                    batch.returned.as_secs_f64(),
                    timeout.as_secs_f64()
                ),
            );
        }
    }
}

fn release_before_expiry(ctx: &Context<'_>, blocked: &Blocked<'_>, out: &mut Findings) {
    let ttl = ctx.limits.lease_ttl;
    let mut claimed: BTreeMap<(&str, Uuid), Duration> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::Claimed { replica, ids, .. } => {
                for id in ids {
                    claimed.insert((replica, *id), *at);
                }
            }
            Event::StoreCalled {
                replica,
                call: Call::Release,
                ids,
            } => {
                for id in ids {
                    if let Some(t) = claimed.get(&(replica.as_str(), *id))
                        && *at > *t + ttl
                        && blocked
                            .excused_until(replica, *t + ttl)
                            .is_some_and(|until| *at > until + TIMING_SLACK)
                    {
                        out.add(
                            Invariant::ReleaseBeforeLeaseExpiry,
                            Some(*at),
                            format!(
                                "{replica} released {id} {:.3}s after claiming it (lease {:.3}s)",
                                (*at - *t).as_secs_f64(),
                                ttl.as_secs_f64()
                            ),
                        );
                    }
                }
            }
            _ => {}
        }
    }
}

/// One replica's failures since its last claim call.
#[derive(Default)]
struct Cycle {
    /// When the latest failure of the current cycle happened.
    failed_at: Option<Duration>,
    /// Failed cycles in a row.
    in_a_row: u32,
    /// Rows claimed and returned to it, not yet handed to a mark or release.
    held: BTreeSet<Uuid>,
}

fn backoff_and_release_on_failure(ctx: &Context<'_>, out: &mut Findings) {
    let limits = ctx.limits;
    let mut replicas: BTreeMap<&str, Cycle> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::ClaimCalled { replica } => {
                let c = replicas.entry(replica).or_default();
                let Some(failed_at) = c.failed_at.take() else {
                    c.in_a_row = 0;
                    continue;
                };
                c.in_a_row += 1;
                let doubling = 1u32 << (c.in_a_row - 1).min(16);
                let backoff = limits.tick.saturating_mul(doubling).min(limits.backoff_max);
                if *at < failed_at + backoff {
                    out.add(
                        Invariant::BackoffAfterFailure,
                        Some(*at),
                        format!(
                            "{replica} claimed {:.3}s after failure {} in a row (backoff {:.3}s)",
                            (*at - failed_at).as_secs_f64(),
                            c.in_a_row,
                            backoff.as_secs_f64()
                        ),
                    );
                }
                if !c.held.is_empty() {
                    out.add(
                        Invariant::ReleaseOnFailure,
                        Some(*at),
                        format!(
                            "{replica} claimed again after a failure still holding {} rows it never handed back",
                            c.held.len()
                        ),
                    );
                    c.held.clear();
                }
            }
            Event::ClaimReturned { replica, ids } => {
                replicas
                    .entry(replica)
                    .or_default()
                    .held
                    .extend(ids.iter().copied());
            }
            Event::StoreCalled { replica, call, ids } => {
                let c = replicas.entry(replica).or_default();
                for id in ids {
                    c.held.remove(id);
                }
                if *call == Call::Release {
                    c.failed_at = Some(*at);
                }
            }
            Event::StoreFailed { replica, call } if *call != Call::Release => {
                replicas.entry(replica).or_default().failed_at = Some(*at);
            }
            _ => {}
        }
    }
}

/// One replica's current drain, as far as the poll cadence needs it.
#[derive(Default)]
struct Drain {
    /// When the drain ended: its last claim returned short, or failed.
    ended: Option<Duration>,
    /// When the last sleep that a commit could wake began (the end of the
    /// last drain that did not fail): a notification since then may still
    /// be waiting to wake the next sleep.
    wakeable_since: Duration,
    /// It claimed rows.
    claimed: bool,
    /// It claimed a row with an ordering key: the next drain may start at
    /// once (the key's next event is claimable once this one is marked).
    keyed: bool,
    /// It failed (a store call failed, or claims were released).
    failed: bool,
    /// No earlier than the core's last busy instant (the start of the drain
    /// after the last busy one); `None` while the replica was never busy.
    busy_by: Option<Duration>,
    /// The latest commit notification that reached the replica.
    notified: Option<Duration>,
}

fn poll_cadence(ctx: &Context<'_>, out: &mut Findings) {
    let (limits, batch) = (ctx.limits, ctx.limits.batch_size as usize);
    let mut replicas: BTreeMap<&str, Drain> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::ClaimCalled { replica } => {
                let d = replicas.entry(replica).or_default();
                let Some(ended) = d.ended.take() else {
                    continue; // the drain goes on after a full claim
                };
                let woken = d.notified.is_some_and(|n| n >= d.wakeable_since);
                if !d.failed && !woken && !d.keyed {
                    // The core is surely steady when nothing was claimed and
                    // its last busy instant is a minute before the drain's
                    // end; otherwise it may use the busy tick.
                    let steady = !d.claimed
                        && d.busy_by
                            .is_none_or(|b| ended.saturating_sub(b) >= STEADY_AFTER);
                    let floor = if steady {
                        limits.tick * IDLE_TICK_FACTOR
                    } else {
                        limits.tick
                    };
                    if *at + Duration::from_millis(1) < ended + floor {
                        out.add(
                            Invariant::PollCadence,
                            Some(*at),
                            format!(
                                "{replica} claimed {:.3}s after its last drain ended ({}; at least {:.3}s)",
                                (*at - ended).as_secs_f64(),
                                if steady { "steady for a minute" } else { "busy" },
                                floor.as_secs_f64()
                            ),
                        );
                    }
                }
                if d.claimed || d.failed {
                    d.busy_by = Some(*at);
                }
                // A keyed drain is followed at once, with no sleep: a
                // notification that came before it still waits to wake the
                // next sleep.
                if !d.failed && !d.keyed {
                    d.wakeable_since = ended;
                }
                (d.claimed, d.failed, d.keyed) = (false, false, false);
            }
            Event::ClaimReturned { replica, ids } => {
                let d = replicas.entry(replica).or_default();
                d.claimed |= !ids.is_empty();
                d.keyed |= ids.iter().any(|id| ctx.model.keyed.contains_key(id));
                if ids.len() < batch {
                    d.ended = Some(*at);
                }
            }
            Event::StoreCalled {
                replica,
                call: Call::Release,
                ..
            } => replicas.entry(replica).or_default().failed = true,
            Event::StoreFailed { replica, call } => {
                let d = replicas.entry(replica).or_default();
                d.failed = true;
                if *call == Call::Claim {
                    d.ended = Some(*at);
                }
            }
            Event::Notified { replica } => {
                replicas.entry(replica).or_default().notified = Some(*at);
            }
            // A restarted replica starts a new drainer, which claims at once.
            Event::Host { host, up: false } => {
                replicas.retain(|replica, _| host_of(replica) != host);
            }
            _ => {}
        }
    }
}

/// One replica's walk of the claim order, as the claim walk rule needs it.
#[derive(Default)]
struct WalkState {
    /// The replica's last claim came back full.
    last_full: bool,
    /// A store call failed since the walk began: the drain is over, and
    /// its walk with it.
    failed: bool,
    /// Claims of the current walk so far (the first from the oldest row).
    claims: u32,
    /// Why the claim in progress may not walk on from a place, judged when
    /// it was called (a failure while it runs is the next claim's
    /// business); `None` if it may.
    barred: Option<&'static str>,
    /// The claim in progress walks on from a place.
    resumed: bool,
}

fn claim_walk(ctx: &Context<'_>, out: &mut Findings) {
    let batch = ctx.limits.batch_size as usize;
    let mut replicas: BTreeMap<&str, WalkState> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::ClaimCalled { replica } => {
                let w = replicas.entry(replica).or_default();
                w.barred = if w.failed {
                    Some("after a failure of its drain")
                } else if !w.last_full {
                    Some("right after a claim that was not full")
                } else if w.claims >= CLAIMS_PER_WALK {
                    Some("past the walk's last claim")
                } else {
                    None
                };
            }
            Event::ClaimResumed { replica } => {
                let w = replicas.entry(replica).or_default();
                w.resumed = true;
                if let Some(why) = w.barred {
                    out.add(
                        Invariant::ClaimWalk,
                        Some(*at),
                        format!(
                            "{replica} walked on from a place {why} ({} claims of {CLAIMS_PER_WALK})",
                            w.claims
                        ),
                    );
                }
            }
            Event::ClaimReturned { replica, ids } => {
                let w = replicas.entry(replica).or_default();
                w.claims = if std::mem::take(&mut w.resumed) {
                    w.claims + 1
                } else {
                    w.failed = false;
                    1
                };
                w.last_full = ids.len() >= batch;
            }
            Event::StoreFailed { replica, call } => {
                let w = replicas.entry(replica).or_default();
                w.failed = true;
                if *call == Call::Claim {
                    w.resumed = false;
                }
            }
            Event::Host { host, up: false } => {
                replicas.retain(|replica, _| host_of(replica) != host);
            }
            _ => {}
        }
    }
}
