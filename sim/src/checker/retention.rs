//! Retention: the outbox janitor deletes only rows published longer ago
//! than the retention, never an unpublished (or parked) one, and does
//! delete them (a published row outlives its retention by at most two sweep
//! intervals and a store timeout); the inbox janitor (#433) likewise deletes
//! only rows processed longer ago than its retention, never an unprocessed
//! one (replay needs those), and does delete them.

use std::collections::BTreeMap;
use std::time::Duration;

use uuid::Uuid;

use super::{Context, Findings, Invariant};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let mut published: BTreeMap<Uuid, Duration> = BTreeMap::new();
    let mut processed: BTreeMap<Uuid, Duration> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::MarkedPublished { ids, .. } | Event::Skipped { ids } => {
                for id in ids {
                    published.insert(*id, *at);
                }
            }
            Event::CommitsLost { unmarked, .. } => {
                for id in unmarked {
                    published.remove(id);
                }
            }
            Event::InboxCommitted {
                processed: ids,
                began,
                ..
            } => {
                for id in ids {
                    processed.insert(*id, *began);
                }
            }
            // An operator's skip marks a row processed, without its effect.
            Event::InboxSkipped { events, .. } => {
                for id in events {
                    processed.insert(*id, *at);
                }
            }
            Event::Deleted { ids } => scope(
                out,
                Invariant::OutboxJanitorScope,
                *at,
                ids,
                &published,
                ctx.limits.retention,
                "published",
            ),
            Event::InboxDeleted { ids } => scope(
                out,
                Invariant::InboxJanitorScope,
                *at,
                ids,
                &processed,
                ctx.limits.inbox_retention,
                "processed",
            ),
            _ => {}
        }
    }
    for id in &ctx.fin.overdue_published {
        out.add(
            Invariant::OutboxRetention,
            None,
            format!("{id} was published long ago but the janitor kept it"),
        );
    }
    if let Some(consumer) = &ctx.fin.consumer {
        for id in &consumer.overdue_processed {
            out.add(
                Invariant::InboxRetention,
                None,
                format!("{id} was processed long ago but the inbox janitor kept it"),
            );
        }
    }
}

/// Every deleted row was `what` at least `retention` before `at`.
fn scope(
    out: &mut Findings,
    invariant: Invariant,
    at: Duration,
    ids: &[Uuid],
    since: &BTreeMap<Uuid, Duration>,
    retention: Duration,
    what: &str,
) {
    for id in ids {
        match since.get(id) {
            None => out.add(
                invariant,
                Some(at),
                format!("{id} deleted but never {what}"),
            ),
            Some(t) if at < *t + retention => out.add(
                invariant,
                Some(at),
                format!(
                    "{id} deleted {:.3}s after it was {what} (retention {:.3}s)",
                    (at - *t).as_secs_f64(),
                    retention.as_secs_f64()
                ),
            ),
            Some(_) => {}
        }
    }
}
