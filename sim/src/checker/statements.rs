//! Statements at the server (the fake PostgreSQL's view): a statement that
//! waits on a lock when its client stops waiting for it (a handler's
//! deadline, the store call's own bound) goes on at the server, holding its
//! transaction's locks and its pooled connection, until something ends it
//! there. The subscriber must end it: within
//! [`Limits::abandoned_statement_bound`] of the client giving up.
//!
//! And the server's own bounds on a handler's transaction, for when nothing
//! can reach the server to end a statement: a handler runs only in a
//! transaction whose `statement_timeout` is more than the handler's
//! deadline and at most a second more (a statement of a handler cannot
//! usefully outlive it), and whose `idle_in_transaction_session_timeout` is
//! at least a minute and more than twice the deadline (a valid handler that
//! works between its statements is never cut off).

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Context, Findings, Invariant, TIMING_SLACK};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    abandoned_statements_end(ctx, out);
    handler_tx_bounds(ctx, out);
}

/// The least idle-in-transaction bound of a handler's transaction.
const IDLE_IN_TX_FLOOR: Duration = Duration::from_secs(60);
/// How far past the handler's deadline a statement may run at most.
const STATEMENT_GRACE_MAX: Duration = Duration::from_secs(1);

fn handler_tx_bounds(ctx: &Context<'_>, out: &mut Findings) {
    let deadline = ctx.limits.handler_timeout;
    // Per session: the bounds its open transaction set.
    let mut bounds: BTreeMap<u64, (Option<u64>, Option<u64>)> = BTreeMap::new();
    // Per session: when the server last ended its transaction. A client
    // that read its last reply at that instant may start a handler in the
    // transaction that just ended (nothing it does can take effect): no
    // bounds to judge then; nor while the server is down.
    let mut ended: BTreeMap<u64, Duration> = BTreeMap::new();
    let mut pg_down = false;
    for (at, e) in ctx.events {
        match e {
            Event::TxBounds {
                session,
                statement_ms,
                idle_in_tx_ms,
            } => {
                bounds.insert(*session, (*statement_ms, *idle_in_tx_ms));
            }
            Event::InboxBatch { session, .. } => {
                bounds.remove(session);
                ended.insert(*session, *at);
            }
            Event::Host { host, up } if host == "pg" => {
                pg_down = !*up;
                bounds.clear();
            }
            Event::HandlerStarted {
                session: Some(session),
                ..
            } if pg_down || (!bounds.contains_key(session) && ended.get(session) == Some(at)) => {}
            Event::HandlerStarted {
                client,
                event_id,
                session: Some(session),
            } => {
                let (statement, idle) = bounds.get(session).copied().unwrap_or((None, None));
                let statement_ok = statement
                    .map(Duration::from_millis)
                    .is_some_and(|s| s > deadline && s <= deadline + STATEMENT_GRACE_MAX);
                let idle_ok = idle
                    .map(Duration::from_millis)
                    .is_some_and(|i| i >= IDLE_IN_TX_FLOOR && i > deadline * 2);
                if !(statement_ok && idle_ok) {
                    out.add(
                        Invariant::HandlerTxBounds,
                        Some(*at),
                        format!(
                            "{client}'s handler for {event_id} ran on session {session} with \
                             statement_timeout {statement:?} ms and \
                             idle_in_transaction_session_timeout {idle:?} ms; the deadline \
                             is {} ms",
                            deadline.as_millis()
                        ),
                    );
                }
            }
            _ => {}
        }
    }
}

fn abandoned_statements_end(ctx: &Context<'_>, out: &mut Findings) {
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
