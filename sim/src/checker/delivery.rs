//! Delivery: nothing committed is lost, nothing uncommitted is published,
//! the outbox drains, unpublishable rows park, and a run without faults
//! wastes no work. The committed set is the fake PostgreSQL's, from the
//! trace (a lost commit reply leaves the workload unsure; the database is
//! the judge), and what the broker stored is the fake RabbitMQ's.

use super::{Context, Findings, Invariant};
use crate::model::{FinalState, Model};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    end_state(ctx.model, ctx.fin, out);
    if ctx.expect.quiet {
        quiet(ctx, out);
    }
}

/// The rules judged from what must be true and what is, with no trace.
pub(super) fn end_state(model: &Model, fin: &FinalState, out: &mut Findings) {
    for id in model.publishable() {
        if !fin.stored.contains_key(id) {
            let why = if fin.parked.contains(id) {
                " (still parked)"
            } else {
                ""
            };
            out.add(
                Invariant::Lost,
                None,
                format!("{id} committed but never stored by the broker{why}"),
            );
        }
    }
    for id in fin.stored.keys() {
        // One a failover took back is `no_phantom_event`'s.
        if !model.committed.contains(id) && !model.taken_back.contains(id) {
            let why = if model.rolled_back.contains(id) {
                "rolled back"
            } else {
                "never committed"
            };
            out.add(
                Invariant::PhantomPublish,
                None,
                format!("{id} stored by the broker but {why}"),
            );
        }
    }
    for id in fin
        .unpublished
        .iter()
        .filter(|id| !model.unpublishable.contains(id))
    {
        out.add(
            Invariant::Undrained,
            None,
            format!("{id} is still unpublished in the store"),
        );
    }
    for id in model
        .committed
        .iter()
        .filter(|id| model.unpublishable.contains(id))
    {
        let parked = fin.parked.contains(id) || model.skipped.contains(id);
        if fin.stored.contains_key(id) || !parked {
            out.add(
                Invariant::UnpublishableParks,
                None,
                format!(
                    "{id} has an unpublishable routing key but is not parked (stored: {})",
                    fin.stored.contains_key(id)
                ),
            );
        }
    }
}

/// A run without faults may neither release a claim nor publish anything
/// twice: a drainer that throws work away and redoes it would otherwise
/// pass as correct.
fn quiet(ctx: &Context<'_>, out: &mut Findings) {
    for (at, e) in ctx.events {
        if let Event::Released { replica, ids } = e
            && !ids.is_empty()
        {
            out.add(
                Invariant::QuietRun,
                Some(*at),
                format!(
                    "{replica} released {} claims in a run without faults",
                    ids.len()
                ),
            );
        }
    }
    for (id, n) in ctx.fin.stored.iter().filter(|(_, n)| **n > 1) {
        out.add(
            Invariant::QuietRun,
            None,
            format!("{id} stored {n} times in a run without faults"),
        );
    }
}
