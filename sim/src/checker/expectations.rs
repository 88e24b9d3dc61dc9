//! What a scenario's faults must make happen (its `[expect]` table), so a
//! scenario cannot pass by not exercising its subject: FoundationDB's
//! workloads check a minimum rate in the same spirit. Checked on every
//! seed; the marks a scenario must reach are checked across a sweep.

use super::{Context, Findings, Invariant};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    let expect = ctx.expect;
    let (mut releases, mut parks, mut absorbed, mut dead_letters) = (0, 0, 0, 0);
    let mut lost = 0;
    for (_, e) in ctx.events {
        match e {
            Event::Released { ids, .. } => releases += ids.len(),
            Event::MarkedFailed { parked, .. } => parks += parked.len(),
            Event::InboxDuplicate { .. } => absorbed += 1,
            Event::InboxFailure {
                dead_lettered: true,
                ..
            } => dead_letters += 1,
            Event::CommitsLost {
                leases, unmarked, ..
            } => lost += leases.len() + unmarked.len(),
            _ => {}
        }
    }
    let republished = ctx.fin.stored.values().filter(|n| **n > 1).count();
    for (wanted, seen, what) in [
        (expect.releases, releases, "no claim was ever released"),
        (expect.parks, parks, "no row ever parked"),
        (
            expect.duplicates,
            republished,
            "no envelope was ever republished",
        ),
        (
            expect.consumer_duplicates,
            absorbed,
            "no delivery found its event already processed",
        ),
        (
            expect.dead_letters,
            dead_letters,
            "nothing was dead-lettered",
        ),
        (
            expect.commits_lost,
            lost,
            "no crash of the database took back a drainer's commit",
        ),
    ] {
        if wanted && seen == 0 {
            out.add(Invariant::ScenarioExpectation, None, what.to_owned());
        }
    }
}
