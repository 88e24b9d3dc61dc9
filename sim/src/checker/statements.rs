//! Statements at the server (the fake PostgreSQL's view): a statement that
//! waits on a lock when its client stops waiting for it (a handler's
//! deadline, the store call's own bound) goes on at the server, holding its
//! transaction's locks and its pooled connection, until something ends it
//! there. The subscriber must end it: within
//! [`Limits::abandoned_statement_bound`] of the client giving up.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Context, Findings, Invariant, TIMING_SLACK};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let bound = ctx.limits.abandoned_statement_bound + TIMING_SLACK;
    // Per session: since when its current statement waits, and by when the
    // wait must end (once its client stopped waiting).
    let mut waiting: BTreeMap<u64, (Duration, String, Option<Duration>)> = BTreeMap::new();
    let mut last = Duration::ZERO;
    for (at, e) in ctx.events {
        last = *at;
        match e {
            Event::LockWait {
                client, session, ..
            } => {
                waiting.insert(*session, (*at, client.clone(), None));
            }
            Event::RequestAbandoned { session, .. } => {
                if let Some((_, _, due)) = waiting.get_mut(session) {
                    due.get_or_insert(*at + bound);
                }
            }
            Event::LockWaitEnded { session, how, .. } => {
                if let Some((since, client, Some(due))) = waiting.remove(session)
                    && *at > due
                {
                    out.add(
                        Invariant::AbandonedStatementEnds,
                        Some(*at),
                        format!(
                            "{client}'s statement on session {session} waited from {:.3}s, \
                             went on {:.3}s after its client stopped waiting for it, \
                             and ended only now ({how:?})",
                            since.as_secs_f64(),
                            (*at - due + bound).as_secs_f64(),
                        ),
                    );
                }
            }
            Event::Host { host, up: false } if host == "pg" => waiting.clear(),
            _ => {}
        }
    }
    for (session, (since, client, due)) in waiting {
        if let Some(due) = due.filter(|due| last > *due) {
            out.add(
                Invariant::AbandonedStatementEnds,
                None,
                format!(
                    "{client}'s statement on session {session} waits since {:.3}s, \
                     {:.3}s after its client stopped waiting for it",
                    since.as_secs_f64(),
                    (last - due + bound).as_secs_f64(),
                ),
            );
        }
    }
}
