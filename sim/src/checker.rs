//! The checker: the invariants of the design, verified from the trace and the
//! fakes' final state, separately from the code under test.
//!
//! 1. **Nothing committed is lost**: once faults heal, every envelope the
//!    store committed is stored by the broker within the liveness bound.
//! 2. **Nothing uncommitted is published**: the broker stores no envelope
//!    the store did not commit.
//! 3. **No transaction held across broker I/O** (#478): no transaction
//!    waits on its client across time during which that client sent a
//!    publish. (A short claim may run beside the publishes of another batch,
//!    as the overlapping drainer does: it never waits on them.)
//! 4. **Attempts grow only on row-culpable failures**: a row's attempts are
//!    bumped at most as often as the broker nacked it.
//! 5. **Stale marks change nothing**: every row a mark changed was, at that
//!    moment, leased by the marking replica.
//! 6. **Parked rows are not claimed** until unparked.
//! 7. **The janitor deletes only published rows.**
//!
//! Duplicates (an envelope stored more than once) are counted and reported,
//! not forbidden: the contract is at-least-once.

use std::collections::{BTreeMap, BTreeSet};

use uuid::Uuid;

use crate::scenario::Expect;
use crate::trace::Event;

/// What a run found.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    pub committed: usize,
    pub rolled_back: usize,
    pub published: usize,
    pub duplicates: usize,
    pub parked: usize,
    pub violations: Vec<String>,
}

impl Verdict {
    /// True when no invariant broke.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Most violations listed per invariant (the rest are counted).
const LISTED_MAX: usize = 5;

fn push_all(out: &mut Vec<String>, name: &str, found: Vec<String>) {
    let n = found.len();
    for f in found.into_iter().take(LISTED_MAX) {
        out.push(format!("{name}: {f}"));
    }
    if n > LISTED_MAX {
        out.push(format!("{name}: … and {} more", n - LISTED_MAX));
    }
}

/// Checks every invariant. `stored` counts how often the broker stored each
/// envelope; `liveness_met` says whether the run reached quiescence before
/// its liveness deadline.
pub fn check(
    events: &[(std::time::Duration, Event)],
    stored: &BTreeMap<Uuid, u32>,
    still_parked: &BTreeSet<Uuid>,
    final_attempts: &BTreeMap<Uuid, i32>,
    unpublished: &BTreeSet<Uuid>,
    max_attempts: u32,
    expect: &Expect,
) -> Verdict {
    let mut v = Verdict::default();
    let mut committed = BTreeSet::new();
    let mut rolled_back = BTreeSet::new();
    // Per client: since when its open transaction has waited on it, and
    // whether it published meanwhile.
    let mut idle_tx: BTreeMap<String, (f64, bool)> = BTreeMap::new();
    let mut owner: BTreeMap<Uuid, String> = BTreeMap::new();
    let mut parked: BTreeSet<Uuid> = BTreeSet::new();
    let mut published: BTreeSet<Uuid> = BTreeSet::new();
    let mut nacks: BTreeMap<Uuid, u32> = BTreeMap::new();
    let mut bumps: BTreeMap<Uuid, u32> = BTreeMap::new();
    let (mut io_in_tx, mut stale, mut parked_claims, mut bad_deletes, mut blame) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut releases, mut parks) = (0usize, 0usize);
    let mut unpublishable: BTreeSet<Uuid> = BTreeSet::new();

    for (at, e) in events {
        let t = at.as_secs_f64();
        match e {
            Event::Committed { ids, .. } => committed.extend(ids.iter().copied()),
            Event::RolledBack { ids, .. } => rolled_back.extend(ids.iter().copied()),
            Event::TxBegin { .. } => {}
            Event::TxIdle { client } => {
                idle_tx.insert(client.clone(), (t, false));
            }
            Event::TxResumed { client } | Event::TxEnd { client } => {
                if let Some((since, true)) = idle_tx.remove(client)
                    && t > since
                {
                    io_in_tx.push(format!(
                        "{client} held a transaction open from {since:.3}s to {t:.3}s \
                         while it published"
                    ));
                }
            }
            Event::PublishSent { client, .. } => {
                if let Some((_, published)) = idle_tx.get_mut(client) {
                    *published = true;
                }
            }
            Event::Claimed {
                replica,
                ids,
                attempts,
            } => {
                for (id, a) in ids.iter().zip(attempts) {
                    let expected = bumps.get(id).copied().unwrap_or(0);
                    if *a as u32 != expected {
                        blame.push(format!("{id} claimed at {t:.3}s with attempts {a}, but {expected} failures were recorded"));
                    }
                }
                for id in ids {
                    if parked.contains(id) {
                        parked_claims.push(format!("{replica} claimed parked row {id} at {t:.3}s"));
                    }
                    owner.insert(*id, replica.clone());
                }
            }
            Event::MarkedPublished { replica, ids } => {
                for id in ids {
                    if owner.get(id) != Some(replica) {
                        stale.push(format!(
                            "{replica} marked {id} at {t:.3}s while the lease was {:?}",
                            owner.get(id)
                        ));
                    }
                    published.insert(*id);
                }
            }
            Event::MarkedFailed {
                replica,
                ids,
                parked: p,
            } => {
                for id in ids {
                    if owner.get(id) != Some(replica) {
                        stale.push(format!(
                            "{replica} bumped {id} at {t:.3}s without the lease"
                        ));
                    }
                    owner.remove(id);
                    *bumps.entry(*id).or_insert(0) += 1;
                    // An unpublishable row is blamed by the drainer itself, without a nack.
                    if !unpublishable.contains(id)
                        && bumps[id] > nacks.get(id).copied().unwrap_or(0)
                    {
                        blame.push(format!(
                            "{id} bumped to {} at {t:.3}s after {} nacks",
                            bumps[id],
                            nacks.get(id).copied().unwrap_or(0)
                        ));
                    }
                    if p.contains(id) != (bumps[id] >= max_attempts) {
                        blame.push(format!(
                            "{id} at {} failures of a budget of {max_attempts}: parked is {} at {t:.3}s",
                            bumps[id],
                            p.contains(id)
                        ));
                    }
                }
                parks += p.len();
                parked.extend(p.iter().copied());
            }
            Event::LeasesRestored { owners } => {
                for (id, o) in owners {
                    match o {
                        Some(r) => owner.insert(*id, r.clone()),
                        None => owner.remove(id),
                    };
                }
            }
            Event::Released { ids, .. } => {
                releases += ids.len();
                for id in ids {
                    owner.remove(id);
                }
            }
            Event::Unparked { ids } => {
                for id in ids {
                    parked.remove(id);
                    owner.remove(id);
                    bumps.remove(id);
                    nacks.remove(id);
                }
            }
            Event::Deleted { ids } => {
                for id in ids {
                    if !published.contains(id) {
                        bad_deletes.push(format!(
                            "{id} deleted at {t:.3}s but never marked published"
                        ));
                    }
                }
            }
            Event::Confirmed {
                message_id, ack, ..
            } => {
                if !ack {
                    *nacks.entry(*message_id).or_insert(0) += 1;
                }
            }
            Event::Unpublishable { id } => {
                unpublishable.insert(*id);
            }
            Event::Fault(_)
            | Event::ReplyLost { .. }
            | Event::Tick { .. }
            | Event::Host { .. }
            | Event::InboxCommitted { .. }
            | Event::InboxDuplicate { .. }
            | Event::InboxFailure { .. } => {}
        }
    }

    for (id, a) in final_attempts {
        let expected = bumps.get(id).copied().unwrap_or(0);
        if *a as u32 != expected {
            blame.push(format!(
                "{id} ends with attempts {a}, but {expected} failures were recorded"
            ));
        }
    }
    let unparked_poison: Vec<String> = committed
        .iter()
        .filter(|id| unpublishable.contains(id))
        .filter(|id| stored.contains_key(id) || !still_parked.contains(id))
        .map(|id| {
            format!(
                "{id} has an unpublishable routing key but is not parked (stored: {})",
                stored.contains_key(id)
            )
        })
        .collect();
    let lost: Vec<String> = committed
        .iter()
        .filter(|id| !unpublishable.contains(id))
        .filter(|id| !stored.contains_key(id))
        .map(|id| {
            let why = if still_parked.contains(id) {
                " (still parked)"
            } else {
                ""
            };
            format!("{id} committed but never stored by the broker{why}")
        })
        .collect();
    let phantom: Vec<String> = stored
        .keys()
        .filter(|id| !committed.contains(id))
        .map(|id| {
            let why = if rolled_back.contains(id) {
                "rolled back"
            } else {
                "never committed"
            };
            format!("{id} stored by the broker but {why}")
        })
        .collect();
    let undrained: Vec<String> = unpublished
        .iter()
        .filter(|id| !unpublishable.contains(id))
        .map(|id| format!("{id} is still unpublished in the store at the end"))
        .collect();
    let mut unmet = Vec::new();
    let duplicates: usize = stored
        .values()
        .map(|c| (*c as usize).saturating_sub(1))
        .sum();
    for (wanted, seen, what) in [
        (expect.releases, releases, "no claim was ever released"),
        (expect.parks, parks, "no row ever parked"),
        (
            expect.duplicates,
            duplicates,
            "no envelope was ever republished",
        ),
    ] {
        if wanted && seen == 0 {
            unmet.push(what.to_owned());
        }
    }
    let mut noisy = Vec::new();
    if expect.quiet {
        if releases > 0 {
            noisy.push(format!(
                "{releases} claims released in a run without faults"
            ));
        }
        if duplicates > 0 {
            noisy.push(format!("{duplicates} republishes in a run without faults"));
        }
    }
    push_all(&mut v.violations, "lost", lost);
    push_all(&mut v.violations, "wasted work", noisy);
    push_all(&mut v.violations, "not drained", undrained);
    push_all(
        &mut v.violations,
        "unpublishable row not parked",
        unparked_poison,
    );
    push_all(&mut v.violations, "expectation unmet", unmet);
    push_all(&mut v.violations, "uncommitted published", phantom);
    push_all(&mut v.violations, "broker I/O in a transaction", io_in_tx);
    push_all(&mut v.violations, "attempts without a nack", blame);
    push_all(&mut v.violations, "stale mark", stale);
    push_all(&mut v.violations, "parked row claimed", parked_claims);
    push_all(
        &mut v.violations,
        "janitor deleted an unpublished row",
        bad_deletes,
    );

    v.committed = committed.len();
    v.rolled_back = rolled_back.len();
    v.published = stored.len();
    v.duplicates = stored
        .values()
        .map(|c| (*c as usize).saturating_sub(1))
        .sum();
    v.parked = still_parked.len();
    v
}

/// The consumer side's final state, read from the fake PostgreSQL.
#[derive(Debug, Clone, Default)]
pub struct ConsumerView {
    /// Envelopes the subscription must eventually apply.
    pub deliverable: BTreeSet<Uuid>,
    /// Committed handler effects per event (the subscription's).
    pub effects: BTreeMap<Uuid, u32>,
    /// Inbox rows marked processed.
    pub processed: BTreeSet<Uuid>,
}

/// The consumer-side invariants: each deliverable event took effect exactly
/// once; nothing else took effect; an effect exists iff the inbox row is
/// processed; a dead-lettered event had no effect when it was dead-lettered;
/// and what the scenario's faults must have made happen did happen.
pub fn check_consumers(
    events: &[(std::time::Duration, Event)],
    view: &ConsumerView,
    expect: &Expect,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut applied: BTreeSet<Uuid> = BTreeSet::new();
    let (mut duplicates, mut dead_letters) = (0usize, 0usize);
    for (at, e) in events {
        match e {
            Event::InboxCommitted { effects, .. } => {
                applied.extend(effects.iter().map(|(_, id)| *id));
            }
            Event::InboxDuplicate { .. } => duplicates += 1,
            Event::InboxFailure {
                event_id,
                dead_lettered: true,
                attempts,
            } => {
                dead_letters += 1;
                if applied.contains(event_id) {
                    out.push(format!(
                        "dead-lettered with effect: {event_id} was dead-lettered at {:.3} s \
                         (attempt {attempts}) after its effect committed",
                        at.as_secs_f64()
                    ));
                }
            }
            _ => {}
        }
    }
    for id in &view.deliverable {
        match view.effects.get(id).copied().unwrap_or(0) {
            1 => {}
            0 => out.push(format!(
                "never applied: {id} was committed but never took effect"
            )),
            n => out.push(format!("applied {n} times: {id}")),
        }
    }
    for (id, n) in &view.effects {
        if !view.deliverable.contains(id) {
            out.push(format!(
                "phantom effect: {id} took effect {n} time(s) but was never committed"
            ));
        }
        if *n > 0 && !view.processed.contains(id) {
            out.push(format!("effect without processed mark: {id}"));
        }
    }
    for id in &view.processed {
        if view.effects.get(id).copied().unwrap_or(0) == 0 {
            out.push(format!("processed without effect: {id}"));
        }
    }
    if expect.consumer_duplicates && duplicates == 0 {
        out.push("expectation: no delivery found its event already processed".into());
    }
    if expect.dead_letters && dead_letters == 0 {
        out.push("expectation: nothing was dead-lettered".into());
    }
    out
}

#[cfg(test)]
mod tests {
    //! The checker catches each violation on a hand-made trace, and passes a
    //! correct one: it is not a test that cannot fail.

    use std::time::Duration;

    use super::*;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn at(events: Vec<Event>) -> Vec<(Duration, Event)> {
        events
            .into_iter()
            .enumerate()
            .map(|(i, e)| (Duration::from_millis(i as u64), e))
            .collect()
    }

    fn stored(ids: &[u128]) -> BTreeMap<Uuid, u32> {
        ids.iter().map(|n| (id(*n), 1)).collect()
    }

    fn run(events: Vec<Event>, st: &[u128]) -> Verdict {
        check_timed(&at(events), &stored(st), &Expect::default())
    }

    /// `check` on timed events with nothing parked, no attempts and nothing
    /// left unpublished in the store.
    fn check_timed(
        timed: &[(Duration, Event)],
        stored: &BTreeMap<Uuid, u32>,
        expect: &Expect,
    ) -> Verdict {
        check(
            timed,
            stored,
            &BTreeSet::new(),
            &BTreeMap::new(),
            &BTreeSet::new(),
            3,
            expect,
        )
    }

    fn happy() -> Vec<Event> {
        vec![
            Event::Committed {
                client: "w".into(),
                ids: vec![id(1)],
            },
            Event::TxBegin { client: "a".into() },
            Event::Claimed {
                replica: "a".into(),
                ids: vec![id(1)],
                attempts: vec![0],
            },
            Event::TxEnd { client: "a".into() },
            Event::PublishSent {
                client: "a".into(),
                message_id: id(1),
            },
            Event::Confirmed {
                client: "a".into(),
                message_id: id(1),
                ack: true,
            },
            Event::MarkedPublished {
                replica: "a".into(),
                ids: vec![id(1)],
            },
            Event::Deleted { ids: vec![id(1)] },
        ]
    }

    fn kinds(v: &Verdict) -> Vec<String> {
        v.violations
            .iter()
            .map(|s| s.split(':').next().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn a_correct_trace_passes() {
        let v = run(happy(), &[1]);
        assert!(v.ok(), "{:?}", v.violations);
        assert_eq!((v.committed, v.published, v.duplicates), (1, 1, 0));
    }

    #[test]
    fn a_committed_envelope_never_stored_is_lost() {
        assert_eq!(kinds(&run(happy(), &[])), ["lost"]);
    }

    #[test]
    fn a_stored_envelope_never_committed_is_caught() {
        let mut e = happy();
        e.push(Event::RolledBack {
            client: "w".into(),
            ids: vec![id(2)],
        });
        assert_eq!(kinds(&run(e, &[1, 2])), ["uncommitted published"]);
    }

    #[test]
    fn a_transaction_held_across_a_publish_is_caught() {
        // The pre-#478 drainer: the claim's transaction waits while the
        // client publishes and awaits the confirm, then marks and commits.
        let mut e = happy();
        let idle = Event::TxIdle { client: "a".into() };
        e.swap(3, 4); // publish before TxEnd
        e.insert(3, idle);
        assert_eq!(kinds(&run(e, &[1])), ["broker I/O in a transaction"]);
    }

    #[test]
    fn a_run_without_faults_may_not_release_or_republish() {
        let mut e = happy();
        e.insert(
            7,
            Event::Released {
                replica: "a".into(),
                ids: vec![id(1)],
            },
        );
        let quiet = Expect {
            quiet: true,
            ..Expect::default()
        };
        let timed = at(e);
        // With faults a release is fine; without, it is wasted work.
        assert!(check_timed(&timed, &stored(&[1]), &Expect::default()).ok());
        assert_eq!(
            kinds(&check_timed(&timed, &stored(&[1]), &quiet)),
            ["wasted work"]
        );
        let twice: BTreeMap<Uuid, u32> = [(id(1), 2)].into_iter().collect();
        let v = check_timed(&timed, &twice, &quiet);
        assert_eq!(v.violations.len(), 2, "{:?}", v.violations);
    }

    #[test]
    fn a_short_transaction_beside_a_publish_passes() {
        // The overlapping drainer: a claim's statement answers, a publish of
        // another batch goes out in the same instant, the claim commits.
        let mut e = happy();
        let (idle, resumed) = (
            Event::TxIdle { client: "a".into() },
            Event::TxResumed { client: "a".into() },
        );
        e.swap(3, 4); // publish before TxEnd
        let mut timed = at(e);
        let t = timed[3].0;
        timed.insert(3, (t, idle));
        timed.insert(5, (t, resumed));
        let v = check_timed(&timed, &stored(&[1]), &Expect::default());
        assert!(v.ok(), "{:?}", v.violations);
    }

    #[test]
    fn a_mark_without_the_lease_is_caught() {
        let mut e = happy();
        e.insert(
            4,
            Event::Claimed {
                replica: "b".into(),
                ids: vec![id(1)],
                attempts: vec![0],
            },
        );
        assert_eq!(kinds(&run(e, &[1])), ["stale mark"]);
    }

    #[test]
    fn attempts_without_a_nack_or_out_of_step_are_caught() {
        let mut e = happy();
        e.insert(
            5,
            Event::MarkedFailed {
                replica: "a".into(),
                ids: vec![id(1)],
                parked: vec![],
            },
        );
        let k = kinds(&run(e, &[1]));
        assert!(k.contains(&"attempts without a nack".to_owned()), "{k:?}");
        // A claim that reports attempts the trace does not explain.
        let mut e = happy();
        e[2] = Event::Claimed {
            replica: "a".into(),
            ids: vec![id(1)],
            attempts: vec![1],
        };
        assert_eq!(kinds(&run(e, &[1])), ["attempts without a nack"]);
    }

    #[test]
    fn parking_off_budget_and_claiming_a_parked_row_are_caught() {
        let nack = |c: &str| Event::Confirmed {
            client: c.into(),
            message_id: id(1),
            ack: false,
        };
        let claim = |a: i32| Event::Claimed {
            replica: "a".into(),
            ids: vec![id(1)],
            attempts: vec![a],
        };
        let fail = |parked: bool| Event::MarkedFailed {
            replica: "a".into(),
            ids: vec![id(1)],
            parked: if parked { vec![id(1)] } else { vec![] },
        };
        let e = vec![
            Event::Committed {
                client: "w".into(),
                ids: vec![id(1)],
            },
            claim(0),
            nack("a"),
            fail(true), // parked after 1 of 3
        ];
        assert_eq!(kinds(&run(e, &[])), ["lost", "attempts without a nack"]);
        let e = vec![
            Event::Committed {
                client: "w".into(),
                ids: vec![id(1)],
            },
            claim(0),
            nack("a"),
            fail(false),
            claim(1),
            nack("a"),
            fail(false),
            claim(2),
            nack("a"),
            fail(true),
            claim(3), // parked, not unparked
        ];
        assert_eq!(kinds(&run(e, &[])), ["lost", "parked row claimed"]);
    }

    #[test]
    fn an_undrained_row_and_unmet_expectations_are_caught() {
        let expect = Expect {
            releases: true,
            parks: true,
            duplicates: true,
            ..Expect::default()
        };
        let unpublished: BTreeSet<Uuid> = [id(1)].into();
        let v = check(
            &at(happy()),
            &stored(&[1]),
            &BTreeSet::new(),
            &BTreeMap::new(),
            &unpublished,
            3,
            &expect,
        );
        assert_eq!(
            kinds(&v),
            [
                "not drained",
                "expectation unmet",
                "expectation unmet",
                "expectation unmet"
            ]
        );
    }

    #[test]
    fn the_janitor_deleting_an_unpublished_row_is_caught() {
        let mut e = happy();
        e.push(Event::Deleted { ids: vec![id(9)] });
        assert_eq!(kinds(&run(e, &[1])), ["janitor deleted an unpublished row"]);
    }

    #[test]
    fn the_consumer_checker_catches_each_broken_invariant() {
        use std::time::Duration;
        let (a, b, c, d) = (id(1), id(2), id(3), id(4));
        let view = ConsumerView {
            deliverable: [a, b, c].into(),
            // a once (fine), b twice, c never, d never committed.
            effects: [(a, 1), (b, 2), (d, 1)].into(),
            processed: [a, b].into(),
        };
        let events = vec![
            (
                Duration::from_secs(1),
                Event::InboxCommitted {
                    client: "consumer-1".into(),
                    processed: vec![a],
                    effects: vec![("q".into(), a)],
                },
            ),
            (
                Duration::from_secs(2),
                Event::InboxFailure {
                    event_id: a,
                    attempts: 3,
                    dead_lettered: true,
                },
            ),
        ];
        let expect = Expect {
            consumer_duplicates: true,
            ..Expect::default()
        };
        let v = check_consumers(&events, &view, &expect).join("\n");
        for needle in [
            "dead-lettered with effect",
            "applied 2 times",
            "never applied",
            "phantom effect",
            "effect without processed mark",
            "no delivery found its event already processed",
        ] {
            assert!(v.contains(needle), "{needle} missing from:\n{v}");
        }
        let clean = ConsumerView {
            deliverable: [a].into(),
            effects: [(a, 1)].into(),
            processed: [a].into(),
        };
        assert!(check_consumers(&[], &clean, &Expect::default()).is_empty());
    }
}
