//! No transaction held across broker I/O (#478): no store transaction of a
//! client waits on it (a statement answered, the next not yet sent) across
//! time in which that client sent a publish. A short claim beside another
//! batch's publishes passes: the overlapping drainer's claim never waits on
//! them; the pre-#478 drainer, whose transaction stayed open while it
//! published and awaited confirms, fails.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Context, Findings, Invariant};
use crate::trace::Event;

pub fn check(ctx: &Context<'_>, out: &mut Findings) {
    // Per client: since when its open transaction has waited on it, and
    // whether it published meanwhile.
    let mut idle: BTreeMap<&str, (Duration, bool)> = BTreeMap::new();
    for (at, e) in ctx.events {
        match e {
            Event::TxIdle { client } => {
                idle.insert(client, (*at, false));
            }
            Event::TxResumed { client } | Event::TxEnd { client } => {
                if let Some((since, true)) = idle.remove(client.as_str())
                    && *at > since
                {
                    out.add(
                        Invariant::TxAcrossBrokerIo,
                        Some(*at),
                        format!(
                            "{client} held a transaction open from {:.3}s while it published",
                            since.as_secs_f64()
                        ),
                    );
                }
            }
            Event::PublishSent { client, .. } => {
                if let Some((_, published)) = idle.get_mut(client.as_str()) {
                    *published = true;
                }
            }
            _ => {}
        }
    }
}
