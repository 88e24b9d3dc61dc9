//! The checker catches each violation on a hand-made trace and passes a
//! correct one: it is not a test that cannot fail. One table holds a
//! violating trace per invariant, and it must cover every invariant.

use std::collections::BTreeSet;
use std::time::Duration;

use uuid::Uuid;

use outbox::core::marks::Mark;

use super::*;
use crate::model::{ConsumerFinal, FinalState};
use crate::trace::{Call, FaultKind, HandlerResult, HostileKind, Replay, Settle};

fn id(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn limits() -> Limits {
    Limits {
        batch_size: 2,
        pipeline_depth: 2,
        stats_interval: Duration::from_secs(1),
        pending_warn: 10,
        oldest_warn: Duration::from_secs(5),
        max_attempts: 3,
        confirm_timeout: Duration::from_secs(2),
        lease_ttl: Duration::from_secs(5),
        tick: ms(50),
        backoff_max: Duration::from_secs(10),
        max_rows_per_sec: Some(1000),
        retention: Duration::from_secs(3),
        consumer_max_attempts: 3,
        inbox_retention: Duration::from_secs(30),
        abandoned_statement_bound: Duration::from_millis(1500),
        handler_timeout: Duration::from_millis(500),
        consumer_batch_max: 4,
        consumer_partitions: 0,
    }
}

/// A run: events at given milliseconds, the final state, the expectations.
#[derive(Clone)]
struct Run {
    events: Vec<(Duration, Event)>,
    fin: FinalState,
    expect: Expect,
    /// Partitions of an ordered subscription (0: not ordered).
    partitions: u16,
}

impl Run {
    fn at(mut self, t: u64, e: Event) -> Self {
        self.events.push((ms(t), e));
        self.events.sort_by_key(|(t, _)| *t);
        self
    }

    fn with(mut self, f: impl FnOnce(&mut FinalState)) -> Self {
        f(&mut self.fin);
        self
    }

    fn without(mut self, drop: impl Fn(&Event) -> bool) -> Self {
        self.events.retain(|(_, e)| !drop(e));
        self
    }

    fn verdict(&self) -> Verdict {
        let limits = Limits {
            consumer_partitions: self.partitions,
            ..limits()
        };
        check(&self.events, &self.fin, &limits, &self.expect)
    }

    /// The same run on an ordered subscription.
    fn ordered(mut self) -> Self {
        self.partitions = 4;
        self
    }
}

fn s(v: &str) -> String {
    v.to_owned()
}

/// One envelope committed, claimed, published, confirmed, marked and,
/// past retention, deleted: every rule holds.
fn producer() -> Run {
    let a = || s("a");
    Run {
        events: vec![
            (
                ms(0),
                Event::Committed {
                    client: s("w"),
                    ids: vec![id(1)],
                },
            ),
            (ms(10), Event::ClaimCalled { replica: a() }),
            (ms(20), Event::TxBegin { client: a() }),
            (
                ms(20),
                Event::Claimed {
                    replica: a(),
                    ids: vec![id(1)],
                    attempts: vec![0],
                },
            ),
            (ms(30), Event::TxEnd { client: a() }),
            (
                ms(30),
                Event::StoreAnswered {
                    replica: a(),
                    call: Call::Claim,
                },
            ),
            (
                ms(30),
                Event::ClaimReturned {
                    replica: a(),
                    ids: vec![id(1)],
                },
            ),
            (
                ms(40),
                Event::PublishSent {
                    client: a(),
                    message_id: id(1),
                    body_id: Some(id(1)),
                },
            ),
            (
                ms(50),
                Event::Confirmed {
                    client: a(),
                    message_id: id(1),
                    ack: true,
                },
            ),
            (
                ms(60),
                Event::ConfirmReceived {
                    client: a(),
                    message_id: id(1),
                },
            ),
            (
                ms(70),
                Event::StoreCalled {
                    replica: a(),
                    call: Call::MarkPublished,
                    ids: vec![id(1)],
                },
            ),
            (
                ms(80),
                Event::MarkedPublished {
                    replica: a(),
                    ids: vec![id(1)],
                },
            ),
            (
                ms(90),
                Event::StoreAnswered {
                    replica: a(),
                    call: Call::MarkPublished,
                },
            ),
            (ms(4000), Event::Deleted { ids: vec![id(1)] }),
        ],
        fin: FinalState {
            stored: [(id(1), 1)].into(),
            ..FinalState::default()
        },
        expect: Expect::default(),
        partitions: 0,
    }
}

/// The producer run, and a consumer that applies the event once.
fn consumer() -> Run {
    let c = || s("c#1");
    producer()
        .at(
            100,
            Event::Delivered {
                client: c(),
                message_id: Some(id(1).to_string()),
                redelivered: false,
                trace: None,
            },
        )
        .at(
            110,
            Event::HandlerRan {
                client: c(),
                event_id: id(1),
                result: HandlerResult::Ok,
            },
        )
        .at(
            120,
            Event::InboxCommitted {
                client: c(),
                began: ms(105),
                processed: vec![id(1)],
                effects: vec![(s("q"), id(1))],
            },
        )
        .at(
            130,
            Event::Settled {
                client: c(),
                message_id: Some(id(1).to_string()),
                settle: Settle::Ack,
            },
        )
        .with(|f| {
            f.consumer = Some(ConsumerFinal {
                effects: [(id(1), 1)].into(),
                rows: [id(1)].into(),
                ..ConsumerFinal::default()
            })
        })
}

/// A handler failure of event 1 by consumer `c#1`, recorded at
/// `attempts`, then the delivery settled with `settle`.
fn failed_attempt(run: Run, t: u64, attempts: i32, dead: bool, settle: Settle) -> Run {
    run.at(
        t,
        Event::HandlerRan {
            client: s("c#1"),
            event_id: id(1),
            result: HandlerResult::Failed,
        },
    )
    .at(
        t + 1,
        Event::InboxFailure {
            client: s("c#1"),
            event_id: id(1),
            attempts,
            dead_lettered: dead,
        },
    )
    .at(
        t + 2,
        Event::Settled {
            client: s("c#1"),
            message_id: Some(id(1).to_string()),
            settle,
        },
    )
}

/// `consumer()` with `n` runs of id(1)'s handler that overran from `t` on
/// (inside the delivery's window, 100–130 ms, or after it: a replay's),
/// the last recorded as attempt 1.
fn overran(n: u64, t: u64) -> Run {
    let c = || s("c#1");
    let mut run = consumer();
    for i in 0..n {
        let at = t + 3 * i;
        run = run
            .at(
                at,
                Event::HandlerStarted {
                    client: c(),
                    event_id: id(1),
                    session: Some(1),
                },
            )
            .at(
                at + 1,
                Event::HandlerRan {
                    client: c(),
                    event_id: id(1),
                    result: HandlerResult::Overran,
                },
            )
            .at(
                at + 2,
                Event::HandlerEnded {
                    client: c(),
                    event_id: id(1),
                },
            );
    }
    run.at(
        t + 3 * n,
        Event::InboxFailure {
            client: c(),
            event_id: id(1),
            attempts: 1,
            dead_lettered: false,
        },
    )
}

#[test]
fn an_overrun_counts_from_a_deliverys_second_or_a_replays_first() {
    for run in [overran(2, 101), overran(1, 140)] {
        let v = run.verdict();
        assert!(
            !v.counts
                .contains_key(&Invariant::AttemptOnlyOnHandlerFailure),
            "{:#?}",
            v.violations
        );
    }
}

fn nack(t: u64) -> (u64, Event) {
    (
        t,
        Event::Confirmed {
            client: s("a"),
            message_id: id(1),
            ack: false,
        },
    )
}

fn fail_mark(t: u64, parked: bool) -> (u64, Event) {
    (
        t,
        Event::MarkedFailed {
            replica: s("a"),
            ids: vec![id(1)],
            parked: if parked { vec![id(1)] } else { vec![] },
        },
    )
}

fn claim(t: u64, attempts: i32) -> (u64, Event) {
    (
        t,
        Event::Claimed {
            replica: s("a"),
            ids: vec![id(1)],
            attempts: vec![attempts],
        },
    )
}

fn hostile(kind: HostileKind, mid: &str, envelope: Option<Uuid>) -> Event {
    Event::Hostile {
        kind,
        message_id: Some(mid.to_owned()),
        envelope_id: envelope,
        ordering: None,
    }
}

fn with_events(run: Run, events: Vec<(u64, Event)>) -> Run {
    events.into_iter().fold(run, |r, (t, e)| r.at(t, e))
}

fn a() -> String {
    s("a")
}

fn delivery_and_attempt_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (I::Lost, producer().with(|f| f.stored.clear())),
        (
            I::PhantomPublish,
            producer()
                .at(
                    5,
                    Event::RolledBack {
                        client: s("w"),
                        ids: vec![id(2)],
                    },
                )
                .with(|f| {
                    f.stored.insert(id(2), 1);
                }),
        ),
        (
            I::Undrained,
            producer().with(|f| {
                f.unpublished.insert(id(1));
            }),
        ),
        (
            I::UnpublishableParks,
            producer().at(1, Event::Unpublishable { id: id(1) }),
        ),
        (
            I::QuietRun,
            Run {
                expect: Expect {
                    quiet: true,
                    ..Expect::default()
                },
                ..producer().with(|f| {
                    f.stored.insert(id(1), 2);
                })
            },
        ),
        (
            I::TxAcrossBrokerIo,
            // The pre-#478 drainer: its transaction waits on it while it
            // publishes.
            producer()
                .at(35, Event::TxBegin { client: a() })
                .at(36, Event::TxIdle { client: a() })
                .at(45, Event::TxEnd { client: a() }),
        ),
        (
            I::AttemptsOnlyOnBlame,
            with_events(producer(), vec![fail_mark(65, false)]),
        ),
        (
            // A broker's nack (a full queue, a node's trouble) is nobody's
            // fault: a bump after one is still a violation (issue 26).
            I::AttemptsOnlyOnBlame,
            with_events(producer(), vec![nack(55), fail_mark(65, false)]),
        ),
        (
            I::ParkAtBudget,
            with_events(producer(), vec![nack(55), fail_mark(65, true)]),
        ),
        (
            I::ParkedNotClaimed,
            with_events(
                producer(),
                vec![
                    nack(100),
                    fail_mark(101, false),
                    claim(102, 1),
                    nack(103),
                    fail_mark(104, false),
                    claim(105, 2),
                    nack(106),
                    fail_mark(107, true),
                    claim(108, 3),
                ],
            ),
        ),
    ]
}

fn lease_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (
            I::ClaimedByGuard,
            producer().at(
                35,
                Event::Claimed {
                    replica: s("b"),
                    ids: vec![id(1)],
                    attempts: vec![0],
                },
            ),
        ),
        (
            I::PublishOnlyClaimed,
            producer().at(
                45,
                Event::PublishSent {
                    client: a(),
                    message_id: id(2),
                    body_id: Some(id(2)),
                },
            ),
        ),
        (
            I::PublishOnlyClaimed,
            producer().at(
                45,
                Event::PublishSent {
                    client: s("b"),
                    message_id: id(1),
                    body_id: Some(id(3)),
                },
            ),
        ),
        (
            I::PublishOrder,
            producer()
                .at(
                    31,
                    Event::ClaimReturned {
                        replica: a(),
                        ids: vec![id(2), id(3)],
                    },
                )
                .at(
                    41,
                    Event::PublishSent {
                        client: a(),
                        message_id: id(3),
                        body_id: Some(id(3)),
                    },
                )
                .at(
                    42,
                    Event::PublishSent {
                        client: a(),
                        message_id: id(2),
                        body_id: Some(id(2)),
                    },
                ),
        ),
    ]
}

fn timing_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (
            I::Phase2Deadline,
            // No confirm ever reaches the replica; it releases 3 s after the
            // claim returned, a second past the deadline.
            Run {
                events: producer()
                    .events
                    .into_iter()
                    .filter(|(_, e)| !matches!(e, Event::ConfirmReceived { .. }))
                    .map(|(t, e)| match e {
                        Event::StoreCalled { replica, ids, .. } => (
                            ms(3030),
                            Event::StoreCalled {
                                replica,
                                call: Call::Release,
                                ids,
                            },
                        ),
                        other => (t, other),
                    })
                    .collect(),
                ..producer()
            }
            .at(5000, Event::Heal),
        ),
        (
            // Published (and confirmed, and marked) only after the deadline.
            I::Phase2Deadline,
            Run {
                events: producer()
                    .events
                    .into_iter()
                    .map(|(t, e)| match e {
                        Event::PublishSent { .. }
                        | Event::Confirmed { .. }
                        | Event::ConfirmReceived { .. }
                        | Event::StoreCalled { .. }
                        | Event::MarkedPublished { .. }
                        | Event::StoreAnswered {
                            call: Call::MarkPublished,
                            ..
                        } => (t + ms(2100), e),
                        other => (t, other),
                    })
                    .collect(),
                ..producer()
            }
            .at(6000, Event::Heal),
        ),
        (
            I::ReleaseBeforeLeaseExpiry,
            producer().at(
                5100,
                Event::StoreCalled {
                    replica: a(),
                    call: Call::Release,
                    ids: vec![id(1)],
                },
            ),
        ),
        (
            I::BackoffAfterFailure,
            producer()
                .at(
                    200,
                    Event::StoreFailed {
                        replica: a(),
                        call: Call::Claim,
                    },
                )
                .at(210, Event::ClaimCalled { replica: a() }),
        ),
        (
            // One row at 1 000 rows/s: the next claim waits 1 ms; 50 rows
            // would make it wait 50 ms.
            I::RateBound,
            producer()
                .at(300, Event::ClaimCalled { replica: a() })
                .at(
                    310,
                    Event::ClaimReturned {
                        replica: a(),
                        ids: (10..60).map(id).collect(),
                    },
                )
                .at(320, Event::ClaimCalled { replica: a() }),
        ),
        (
            // Busy: the drain ended on a short claim at 30 ms; the next
            // claim waits the 50 ms tick.
            I::PollCadence,
            producer().at(40, Event::ClaimCalled { replica: a() }),
        ),
        (
            // Never busy: the next empty claim waits four ticks (200 ms).
            I::PollCadence,
            idle_polls(&[0, 150]),
        ),
        (
            // The drain's last claim (30 ms) was short: no place to walk
            // on from.
            I::ClaimWalk,
            claim_of(2).at(205, Event::ClaimResumed { replica: a() }),
        ),
        (
            // Eight full claims make a walk; the ninth starts from the
            // oldest row.
            I::ClaimWalk,
            full_claims(outbox::core::ports::CLAIMS_PER_WALK + 1),
        ),
        (
            I::ReleaseOnFailure,
            producer()
                .at(
                    200,
                    Event::ClaimReturned {
                        replica: a(),
                        ids: vec![id(2)],
                    },
                )
                .at(
                    210,
                    Event::StoreFailed {
                        replica: a(),
                        call: Call::MarkPublished,
                    },
                )
                .at(400, Event::ClaimCalled { replica: a() }),
        ),
    ]
}

fn retention_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (
            I::OutboxJanitorScope,
            producer().at(1000, Event::Deleted { ids: vec![id(1)] }),
        ),
        (
            I::OutboxJanitorScope,
            producer().at(4000, Event::Deleted { ids: vec![id(9)] }),
        ),
        (
            I::OutboxRetention,
            producer().with(|f| f.overdue_published = vec![id(1)]),
        ),
        (
            I::InboxJanitorScope,
            consumer().at(20_000, Event::InboxDeleted { ids: vec![id(1)] }),
        ),
        (
            I::InboxRetention,
            consumer().with(|f| f.consumer.as_mut().unwrap().overdue_processed = vec![id(1)]),
        ),
        (
            I::ScenarioExpectation,
            Run {
                expect: Expect {
                    releases: true,
                    ..Expect::default()
                },
                ..producer()
            },
        ),
    ]
}

fn effect_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (
            I::ExactlyOnceEffect,
            consumer().with(|f| {
                f.consumer.as_mut().unwrap().effects.insert(id(1), 2);
            }),
        ),
        (
            I::ExactlyOnceEffect,
            consumer().with(|f| {
                f.consumer.as_mut().unwrap().effects.clear();
            }),
        ),
        (
            I::PhantomEffect,
            consumer().with(|f| {
                f.consumer.as_mut().unwrap().effects.insert(id(7), 1);
            }),
        ),
        (
            I::EffectWithMark,
            consumer().at(
                125,
                Event::InboxCommitted {
                    client: s("c#1"),
                    began: ms(121),
                    processed: vec![id(1)],
                    effects: vec![],
                },
            ),
        ),
        (
            I::NoDeadLetterAfterEffect,
            failed_attempt(consumer(), 200, 3, true, Settle::DeadLetter),
        ),
        (
            // Dead-lettered at its budget on quorum queues; the dead-letter
            // queue holds nothing of it, nor is it on its way there.
            I::DeadLettersKept,
            dead_lettered_on_quorum(|_| {}),
        ),
        (
            // Acked before the batch's commit.
            I::AckAfterCommit,
            consumer().at(
                115,
                Event::Settled {
                    client: s("c#1"),
                    message_id: Some(id(1).to_string()),
                    settle: Settle::Ack,
                },
            ),
        ),
    ]
}

/// Event 1 fails its last attempt and is dead-lettered, on quorum queues;
/// `end` sets where its dead letter is at the end.
fn dead_lettered_on_quorum(end: impl Fn(&mut ConsumerFinal)) -> Run {
    let delivered = producer().at(
        100,
        Event::Delivered {
            client: s("c#1"),
            message_id: Some(id(1).to_string()),
            redelivered: true,
            trace: None,
        },
    );
    failed_attempt(delivered, 110, 3, true, Settle::DeadLetter).with(|f| {
        let mut c = ConsumerFinal {
            dead_lettered: [id(1)].into(),
            rows: [id(1)].into(),
            quorum: true,
            ..ConsumerFinal::default()
        };
        end(&mut c);
        f.consumer = Some(c);
    })
}

#[test]
fn a_dead_letter_in_its_queue_or_on_its_way_or_on_classic_queues_passes() {
    let fine = |run: Run| {
        let v = run.verdict();
        assert!(
            !v.counts.contains_key(&Invariant::DeadLettersKept),
            "{:#?}",
            v.violations
        );
    };
    let mid = Some(id(1).to_string());
    fine(dead_lettered_on_quorum(|c| {
        c.dead_letters.insert(mid.clone(), 1);
    }));
    fine(dead_lettered_on_quorum(|c| {
        c.dead_letters_waiting.insert(mid.clone(), 1);
    }));
    fine(dead_lettered_on_quorum(|c| c.quorum = false));
    // Dead-lettered twice (a duplicate delivery), kept once: one lost.
    let twice = dead_lettered_on_quorum(|c| {
        c.dead_letters.insert(mid.clone(), 1);
    })
    .at(
        210,
        Event::Settled {
            client: s("c#1"),
            message_id: mid.clone(),
            settle: Settle::DeadLetter,
        },
    );
    assert!(
        twice
            .verdict()
            .counts
            .contains_key(&Invariant::DeadLettersKept)
    );
}

fn budget_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (
            // A delivery's first overrun counted: it runs once more first.
            I::AttemptOnlyOnHandlerFailure,
            overran(1, 101),
        ),
        (
            I::AttemptOnlyOnHandlerFailure,
            consumer().at(
                90,
                Event::InboxFailure {
                    client: s("c#1"),
                    event_id: id(1),
                    attempts: 1,
                    dead_lettered: false,
                },
            ),
        ),
        (
            // Dead-lettered at the first failure of a budget of three.
            I::DeadLetterAtBudget,
            failed_attempt(consumer(), 95, 1, true, Settle::DeadLetter),
        ),
        (
            // Recorded below the budget, yet dead-lettered.
            I::DeadLetterAtBudget,
            failed_attempt(consumer(), 95, 1, false, Settle::DeadLetter),
        ),
        (
            // The budget spent, yet requeued for another attempt.
            I::DeadLetterAtBudget,
            failed_attempt(
                failed_attempt(
                    failed_attempt(consumer(), 91, 1, false, Settle::Requeue),
                    94,
                    2,
                    false,
                    Settle::Requeue,
                ),
                97,
                3,
                true,
                Settle::Requeue,
            ),
        ),
    ]
}

fn replay_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (
            I::ReplayFreshBudget,
            // A dead-lettered row replayed and applied with no reset.
            failed_attempt(consumer(), 90, 3, true, Settle::DeadLetter)
                .at(
                    200,
                    Event::ReplayStarted {
                        client: s("c#1"),
                        ask: String::new(),
                        ids: None,
                        limit: 100,
                        matching: vec![id(1)],
                    },
                )
                .at(
                    205,
                    Event::InboxCommitted {
                        client: s("c#1"),
                        began: ms(201),
                        processed: vec![id(1)],
                        effects: vec![(s("q"), id(1))],
                    },
                )
                .at(
                    210,
                    Event::Replayed {
                        client: s("c#1"),
                        event_id: id(1),
                        outcome: Replay::Applied,
                    },
                ),
        ),
        (
            I::ReplayFreshBudget,
            // A budget reset on a row within its budget (a release racing
            // another, resetting what it spent).
            failed_attempt(consumer(), 90, 1, false, Settle::Requeue).at(
                95,
                Event::InboxReset {
                    client: s("c#1"),
                    ids: vec![id(1)],
                },
            ),
        ),
        (
            I::ReplayKeepsFailedFindable,
            failed_replay(consumer(), false),
        ),
    ]
}

/// A NUL-escape delivery delivered once and refused by the inbox twice,
/// then dead-lettered.
fn refused_twice() -> Run {
    consumer()
        .at(140, hostile(HostileKind::NulEscape, "m2", Some(id(5))))
        .at(
            141,
            Event::Delivered {
                client: s("c#1"),
                message_id: Some(s("m2")),
                redelivered: false,
                trace: None,
            },
        )
        .at(
            142,
            Event::InboxRefused {
                client: s("c#1"),
                event_id: id(5),
                code: "22P05",
            },
        )
        .at(
            143,
            Event::InboxRefused {
                client: s("c#1"),
                event_id: id(5),
                code: "22P05",
            },
        )
        .with(|f| {
            f.consumer
                .as_mut()
                .unwrap()
                .dead_letters
                .insert(Some(s("m2")), 1);
        })
}

#[test]
fn a_refusal_whose_reply_was_lost_may_be_asked_again() {
    let lost = Event::Fault {
        kind: crate::trace::FaultKind::PgReplyLost,
        detail: s("c#1 inbox_try_insert"),
    };
    let v = refused_twice().at(142, lost).verdict();
    assert!(v.ok(), "{:#?}", v.violations);
}

/// A foreign publisher's key on an ordered subscription: #1 is not JSON
/// (given up on: its record takes `message_id` id(9)), #2 a valid envelope
/// id(10) that took effect. `recorded` and `skipped` say whether #1 left
/// its dead-lettered record and whether the operator skipped it before #2
/// took effect.
fn given_up_then_applied(recorded: bool, skipped: bool) -> Run {
    let c = || s("c#1");
    let foreign = |kind, mid: &str, envelope, seq| Event::Hostile {
        kind,
        message_id: Some(mid.to_owned()),
        envelope_id: envelope,
        ordering: Some((s("foreign-a"), seq)),
    };
    let mut run = consumer()
        .ordered()
        .at(
            140,
            foreign(HostileKind::NotJson, &id(9).to_string(), None, 1),
        )
        .at(
            141,
            foreign(
                HostileKind::AtTheLimit,
                &id(10).to_string(),
                Some(id(10)),
                2,
            ),
        );
    if recorded {
        run = run.at(
            150,
            Event::InboxFailure {
                client: c(),
                event_id: id(9),
                attempts: 1,
                dead_lettered: true,
            },
        );
    }
    run = run.at(
        155,
        Event::Settled {
            client: c(),
            message_id: Some(id(9).to_string()),
            settle: Settle::DeadLetter,
        },
    );
    if skipped {
        run = run.at(
            160,
            Event::InboxSkipped {
                client: c(),
                events: vec![id(9)],
            },
        );
    }
    run.at(
        170,
        Event::InboxCommitted {
            client: c(),
            began: ms(165),
            processed: vec![id(10)],
            effects: vec![(s("q"), id(10))],
        },
    )
    .with(|f| {
        let c = f.consumer.as_mut().unwrap();
        c.effects.insert(id(10), 1);
        c.rows.extend([id(9), id(10)]);
        c.dead_letters.insert(Some(id(9).to_string()), 1);
    })
}

#[test]
fn a_keyed_delivery_given_up_on_recorded_and_skipped_passes() {
    let v = given_up_then_applied(true, true).verdict();
    assert!(v.ok(), "{:#?}", v.violations);
}

fn hostile_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        (
            // Given up on with no record: nothing held its key.
            I::RejectedAtOnce,
            given_up_then_applied(false, true),
        ),
        (
            // Recorded, never skipped: its key's later event went past it.
            I::KeyAppliedInOrder,
            given_up_then_applied(true, false),
        ),
        (
            // Requeued, and never in the dead-letter queue.
            I::RejectedAtOnce,
            consumer()
                .at(140, hostile(HostileKind::NotJson, "m1", None))
                .at(
                    150,
                    Event::Settled {
                        client: s("c#1"),
                        message_id: Some(s("m1")),
                        settle: Settle::Requeue,
                    },
                ),
        ),
        (
            // Retried in place: the inbox was asked twice for one delivery.
            I::RejectedAtOnce,
            refused_twice(),
        ),
        (
            I::KeyedByEnvelopeId,
            consumer()
                .at(
                    140,
                    hostile(
                        HostileKind::ForeignMessageId,
                        &id(8).to_string(),
                        Some(id(1)),
                    ),
                )
                .at(
                    150,
                    Event::InboxDuplicate {
                        client: s("c#1"),
                        event_id: id(8),
                    },
                ),
        ),
    ]
}

/// The operator replays event 1; the handler fails again and the failure
/// is recorded at attempt 1, `dead_lettered` as given.
/// The consumer's run, then an operator's replay asking for one
/// dead-lettered row of the two that matched (events 1 and 2).
fn one_of_two_asked() -> Run {
    consumer().at(
        200,
        Event::ReplayStarted {
            client: s("c#1"),
            ask: s("dead-lettered, limit 1"),
            ids: None,
            limit: 1,
            matching: vec![id(1), id(2)],
        },
    )
}

fn failed_replay(run: Run, dead_lettered: bool) -> Run {
    run.at(
        200,
        Event::ReplayStarted {
            client: s("c#1"),
            ask: String::new(),
            ids: None,
            limit: 100,
            matching: vec![id(1)],
        },
    )
    .at(
        201,
        Event::InboxReset {
            client: s("c#1"),
            ids: vec![id(1)],
        },
    )
    .at(
        202,
        Event::HandlerRan {
            client: s("c#1"),
            event_id: id(1),
            result: HandlerResult::Failed,
        },
    )
    .at(
        203,
        Event::InboxFailure {
            client: s("c#1"),
            event_id: id(1),
            attempts: 1,
            dead_lettered,
        },
    )
    .at(
        204,
        Event::Replayed {
            client: s("c#1"),
            event_id: id(1),
            outcome: Replay::Failed,
        },
    )
}

fn mark(m: Mark) -> Event {
    Event::Mark {
        who: s("a"),
        mark: m,
    }
}

/// The producer run whose mark found its row's lease gone.
fn mark_lost() -> Run {
    Run {
        events: producer()
            .events
            .into_iter()
            .filter(|(_, e)| !matches!(e, Event::MarkedPublished { .. }))
            .collect(),
        ..producer()
    }
}

/// The producer run, then `n` full claims of one drain from 200 ms, each
/// after the first walking on from the last.
fn full_claims(n: u32) -> Run {
    let mut run = producer();
    for k in 0..u64::from(n) {
        let t = 200 + 10 * k;
        run = run.at(t, Event::ClaimCalled { replica: s("a") });
        if k > 0 {
            run = run.at(t + 1, Event::ClaimResumed { replica: s("a") });
        }
        let first = 10 + 2 * u128::from(k);
        run = run.at(
            t + 2,
            Event::ClaimReturned {
                replica: s("a"),
                ids: vec![id(first), id(first + 1)],
            },
        );
    }
    run
}

#[test]
fn a_failure_while_a_claim_walks_on_is_the_next_claims_business() {
    // The claim was called right after a full one; a release fails while
    // it runs (madsim seed 34 of ordering_keys_consumer_swarm), and only
    // then does it walk on from the place: it was entitled to when called.
    let run = full_claims(2)
        .at(300, Event::ClaimCalled { replica: s("a") })
        .at(
            301,
            Event::StoreFailed {
                replica: s("a"),
                call: Call::Release,
            },
        )
        .at(302, Event::ClaimResumed { replica: s("a") });
    let v = run.verdict();
    assert!(
        !v.broken().contains(&Invariant::ClaimWalk),
        "{:#?}",
        v.violations
    );
    // The claim after it may not.
    let run = run
        .at(
            303,
            Event::ClaimReturned {
                replica: s("a"),
                ids: vec![id(40), id(41)],
            },
        )
        .at(310, Event::ClaimCalled { replica: s("a") })
        .at(311, Event::ClaimResumed { replica: s("a") });
    assert!(run.verdict().broken().contains(&Invariant::ClaimWalk));
}

/// The producer run with a second claim at 200 ms returning `n` rows.
fn claim_of(n: u128) -> Run {
    producer()
        .at(200, Event::ClaimCalled { replica: s("a") })
        .at(
            210,
            Event::ClaimReturned {
                replica: s("a"),
                ids: (2..2 + n).map(id).collect(),
            },
        )
}

fn mark_cases() -> Vec<(Invariant, Run)> {
    use Invariant::MarksTruthful as M;
    let failure_mark = |parked: Vec<Uuid>| {
        producer()
            .at(
                300,
                Event::StoreCalled {
                    replica: s("a"),
                    call: Call::MarkFailed,
                    ids: vec![id(1)],
                },
            )
            .at(
                310,
                Event::MarkedFailed {
                    replica: s("a"),
                    ids: vec![id(1)],
                    parked,
                },
            )
            .at(
                320,
                Event::StoreAnswered {
                    replica: s("a"),
                    call: Call::MarkFailed,
                },
            )
    };
    vec![
        // A short claim marked full; a full claim left unmarked.
        (M, claim_of(1).at(210, mark(Mark::ClaimFull))),
        (
            M,
            claim_of(2).at(300, Event::ClaimCalled { replica: s("a") }),
        ),
        (M, claim_of(2)),
        // A mark that changed every row it named, reported as lease lost;
        // one that changed none, not reported.
        (M, producer().at(90, mark(Mark::LeaseLostBeforeMark))),
        (M, mark_lost()),
        // A park reported when the failure mark parked nothing; a park
        // not reported.
        (M, failure_mark(vec![]).at(320, mark(Mark::RowParked))),
        (M, failure_mark(vec![id(1)])),
        // A foreign message_id acked unmarked; a mark with none delivered.
        (M, foreign_acked()),
        (M, consumer().at(140, mismatch_mark())),
    ]
}

/// A valid envelope (id 7) under the foreign `message_id` "m7", delivered
/// to the consumer and acked.
fn foreign_acked() -> Run {
    consumer()
        .at(
            140,
            hostile(HostileKind::ForeignMessageId, "m7", Some(id(7))),
        )
        .at(
            141,
            Event::Delivered {
                client: s("c#1"),
                message_id: Some(s("m7")),
                redelivered: false,
                trace: None,
            },
        )
        .at(
            145,
            Event::InboxCommitted {
                client: s("c#1"),
                began: ms(142),
                processed: vec![id(7)],
                effects: vec![(s("q"), id(7))],
            },
        )
        .at(
            150,
            Event::Settled {
                client: s("c#1"),
                message_id: Some(s("m7")),
                settle: Settle::Ack,
            },
        )
}

fn mismatch_mark() -> Event {
    Event::Mark {
        who: s("c#1"),
        mark: Mark::MessageIdMismatch,
    }
}

#[test]
fn marks_that_agree_with_the_trace_pass() {
    let quiet = |run: Run| {
        let v = run.verdict();
        assert!(
            !v.counts.contains_key(&Invariant::MarksTruthful),
            "{:#?}",
            v.violations
        );
    };
    quiet(claim_of(1));
    quiet(claim_of(2).at(210, mark(Mark::ClaimFull)));
    quiet(mark_lost().at(90, mark(Mark::LeaseLostBeforeMark)));
    // Another stage's release while the mark is in flight.
    quiet(
        mark_lost()
            .at(
                75,
                Event::StoreCalled {
                    replica: s("a"),
                    call: Call::Release,
                    ids: vec![id(2)],
                },
            )
            .at(90, mark(Mark::LeaseLostBeforeMark)),
    );
    quiet(foreign_acked().at(142, mismatch_mark()));
    // Another replica's mark does not stand for this one's.
    let other = Event::Mark {
        who: s("b"),
        mark: Mark::ClaimFull,
    };
    assert!(claim_of(2).at(210, other).verdict().counts[&Invariant::MarksTruthful] == 2);
}

/// Replica `b` polls an empty outbox at the given milliseconds.
fn idle_polls(at: &[u64]) -> Run {
    at.iter().fold(producer(), |run, &t| {
        run.at(t, Event::ClaimCalled { replica: s("b") }).at(
            t + 1,
            Event::ClaimReturned {
                replica: s("b"),
                ids: vec![],
            },
        )
    })
}

#[test]
fn polls_that_keep_the_cadence_pass() {
    let quiet = |run: Run| {
        let v = run.verdict();
        assert!(v.ok(), "{:#?}", v.violations);
    };
    quiet(idle_polls(&[0, 201, 402]));
    // A commit notification wakes the sleeping replica early.
    quiet(idle_polls(&[0, 150]).at(120, Event::Notified { replica: s("b") }));
    // A notification that came while a failure's backoff could not be woken
    // is still waiting when the next sleep begins.
    quiet(
        idle_polls(&[0, 400, 420])
            .at(
                300,
                Event::StoreFailed {
                    replica: s("b"),
                    call: Call::Claim,
                },
            )
            .at(301, Event::Notified { replica: s("b") }),
    );
    // A restarted replica claims at once.
    quiet(idle_polls(&[0, 20]).at(
        10,
        Event::Host {
            host: s("b"),
            up: false,
        },
    ));
    // Busy a moment ago: the busy tick is enough.
    quiet(producer().at(81, Event::ClaimCalled { replica: s("a") }));
}

/// A violating trace for every invariant (some for several ways to break it).
/// Events 1 and 2 both take deferred unique key `unique.0`; 1 took it.
fn unique_losers() -> Run {
    consumer()
        .at(
            5,
            Event::UniqueKeyed {
                id: id(1),
                key: s("unique.0"),
            },
        )
        .at(
            6,
            Event::UniqueKeyed {
                id: id(2),
                key: s("unique.0"),
            },
        )
        .at(
            7,
            Event::Committed {
                client: s("w"),
                ids: vec![id(2)],
            },
        )
        .with(|f| {
            f.stored.insert(id(2), 1);
            let c = f.consumer.as_mut().unwrap();
            c.unique_keys.insert(s("unique.0"), id(1));
        })
}

/// A statement of session 5 waits on a lock from 200 ms; its client gives
/// up on it at 300 ms; the wait ends at `ended` ms.
fn abandoned_wait(ended: u64) -> Run {
    consumer()
        .at(
            200,
            Event::LockWait {
                client: s("c#1"),
                session: 5,
                on: s("domain table"),
            },
        )
        .at(
            300,
            Event::RequestAbandoned {
                client: s("c#1"),
                session: 5,
            },
        )
        .at(
            ended,
            Event::LockWaitEnded {
                client: s("c#1"),
                session: 5,
                how: crate::trace::WaitEnd::Terminated,
            },
        )
}

fn statement_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        // The loser of a unique key neither took effect nor was
        // dead-lettered: retried forever.
        (I::EveryDeliveryDecided, unique_losers()),
        // Ended 2 s after its client gave up (the bound is 1.5 s).
        (I::AbandonedStatementEnds, abandoned_wait(2300)),
        // Event 1 was written with trace context; its delivery carried none.
        (
            I::TraceContextCarried,
            consumer().at(
                1,
                Event::Traced {
                    id: id(1),
                    traceparent: s("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
                    tracestate: None,
                },
            ),
        ),
        // Three publishes unconfirmed at once with a depth of two.
        (
            I::PipelineDepth,
            [2, 3].into_iter().fold(producer(), |run, n| {
                run.at(
                    45,
                    Event::PublishSent {
                        client: s("a"),
                        message_id: id(n),
                        body_id: Some(id(n)),
                    },
                )
            }),
        ),
        // Asked for one row of two that matched, replayed the other too
        // and said nothing more matches.
        (
            I::ReplayExact,
            one_of_two_asked()
                .at(
                    210,
                    Event::ReplayEnded {
                        client: s("c#1"),
                        ok: true,
                        more: false,
                        next: None,
                    },
                )
                .at(
                    211,
                    Event::Replayed {
                        client: s("c#1"),
                        event_id: id(3),
                        outcome: Replay::Failed,
                    },
                ),
        ),
        // Asked for one row of two that matched, replayed the first and
        // answered the second's place as the cursor: the next page, after
        // it, never replays the second.
        (
            I::ReplayExact,
            one_of_two_asked()
                .at(
                    205,
                    Event::Replayed {
                        client: s("c#1"),
                        event_id: id(1),
                        outcome: Replay::AlreadyProcessed,
                    },
                )
                .at(
                    210,
                    Event::ReplayEnded {
                        client: s("c#1"),
                        ok: true,
                        more: true,
                        next: Some(id(2)),
                    },
                ),
        ),
        // 30 rows pending (the threshold is 10), and the ready gauge set
        // to 1 from that sample.
        (
            I::GaugesTruthful,
            producer()
                .at(
                    300,
                    Event::StatsAnswered {
                        replica: s("a"),
                        pending: 30,
                        oldest_age_ms: 100,
                        parked: 0,
                        blocked: 0,
                    },
                )
                .at(
                    300,
                    Event::Gauge {
                        name: s("canopy_mq_outbox_ready"),
                        micros: 1_000_000,
                    },
                ),
        ),
        // The server's sample counts a row that is parked as pending.
        (
            I::GaugesTruthful,
            producer()
                .at(
                    5,
                    Event::Committed {
                        client: s("w"),
                        ids: vec![id(2)],
                    },
                )
                .at(
                    6,
                    Event::MarkedFailed {
                        replica: s("a"),
                        ids: vec![id(2)],
                        parked: vec![id(2)],
                    },
                )
                .at(
                    25,
                    Event::StatsSampled {
                        pending: 2,
                        oldest_age_ms: 25,
                        parked: 1,
                        blocked: 0,
                    },
                ),
        ),
        // A handler ran with the statement and idle bounds swapped.
        (
            I::HandlerTxBounds,
            applied(&[1]).at(280, bounds(3, 60_000, 1500)).at(
                281,
                Event::HandlerStarted {
                    client: s("c#1"),
                    event_id: id(1),
                    session: Some(3),
                },
            ),
        ),
        // A client assigned rabbit-3 connected first to rabbit-1, every
        // node up and no fault under way.
        (
            I::StartsAtAssignedNode,
            producer()
                .at(
                    1,
                    Event::BrokerAssigned {
                        client: s("a"),
                        node: s("rabbit-3"),
                    },
                )
                .at(
                    2,
                    Event::BrokerConnecting {
                        client: s("a"),
                        node: s("rabbit-1"),
                    },
                ),
        ),
        // A client stayed on its node for 10 s after the node fell silent.
        (
            I::LeavesASilentNode,
            producer()
                .at(
                    1,
                    Event::MqConnected {
                        client: s("consumer-1#1"),
                        node: s("rabbit-3"),
                    },
                )
                .at(
                    1000,
                    Event::FaultStart {
                        kind: FaultKind::NodePartition,
                        detail: s("NodePartition { node: 3, at_secs: 1.0, for_secs: 12.0 }"),
                    },
                )
                .at(
                    11_000,
                    Event::MqConnected {
                        client: s("consumer-1#1"),
                        node: s("rabbit-1"),
                    },
                )
                .at(
                    13_000,
                    Event::FaultEnd {
                        kind: FaultKind::NodePartition,
                    },
                ),
        ),
        // Readiness says ready with no sample taken at all.
        (
            I::GaugesTruthful,
            producer().at(
                300,
                Event::Readiness {
                    replica: s("a"),
                    ready: true,
                    reasons: vec![],
                },
            ),
        ),
        // Five deliveries in one transaction, with a batch maximum of 4.
        (
            I::BatchMax,
            consumer().at(
                121,
                Event::InboxBatch {
                    client: s("c#1"),
                    session: 1,
                    deliveries: 5,
                    committed: false,
                },
            ),
        ),
        // A handler failure, then its delivery acked with no attempt
        // recorded and no database trouble.
        (
            I::EveryFailureCounted,
            consumer().at(
                105,
                Event::HandlerRan {
                    client: s("c#1"),
                    event_id: id(1),
                    result: HandlerResult::Failed,
                },
            ),
        ),
        // Never ended at all.
        (
            I::AbandonedStatementEnds,
            abandoned_wait(2300)
                .without(|e| matches!(e, Event::LockWaitEnded { .. }))
                .at(3000, Event::Heal),
        ),
    ]
}

#[test]
fn a_unique_key_loser_dead_lettered_and_a_wait_ended_in_time_pass() {
    let v = unique_losers()
        .with(|f| {
            f.consumer.as_mut().unwrap().dead_lettered.insert(id(2));
        })
        .verdict();
    assert!(
        !v.counts.contains_key(&Invariant::EveryDeliveryDecided),
        "{:#?}",
        v.violations
    );
    assert!(
        !v.counts.contains_key(&Invariant::ExactlyOnceEffect),
        "{:#?}",
        v.violations
    );
    let v = abandoned_wait(1300).verdict();
    assert!(v.ok(), "{:#?}", v.violations);
    // A failure the database's trouble made the subscriber forget (its
    // transaction's statement failed before the record committed).
    let excused = consumer()
        .at(
            105,
            Event::HandlerRan {
                client: s("c#1"),
                event_id: id(1),
                result: HandlerResult::Failed,
            },
        )
        .at(
            107,
            Event::Fault {
                kind: FaultKind::PgFailure,
                detail: s("c#1 inbox_record_failure"),
            },
        );
    let v = excused.verdict();
    assert!(
        !v.counts.contains_key(&Invariant::EveryFailureCounted),
        "{:#?}",
        v.violations
    );
    // A failure whose record the server's crash took: the failure after
    // the restart is recorded, and the one before is excused.
    let failed = || Event::HandlerRan {
        client: s("c#1"),
        event_id: id(1),
        result: HandlerResult::Failed,
    };
    let crash = consumer()
        .at(95, failed())
        .at(
            100,
            Event::Host {
                host: s("pg"),
                up: false,
            },
        )
        .at(
            110,
            Event::Host {
                host: s("pg"),
                up: true,
            },
        )
        .at(112, failed())
        .at(
            113,
            Event::InboxFailure {
                client: s("c#1"),
                event_id: id(1),
                attempts: 1,
                dead_lettered: false,
            },
        );
    let v = crash.verdict();
    assert!(
        !v.counts.contains_key(&Invariant::EveryFailureCounted),
        "{:#?}",
        v.violations
    );
    // Without the crash the first failure owes a record.
    let v = crash.without(|e| matches!(e, Event::Host { .. })).verdict();
    assert!(
        v.counts.contains_key(&Invariant::EveryFailureCounted),
        "{:#?}",
        v.violations
    );
    // A duplicate in flight: event 1 delivered to c#1 twice (at 100 and
    // 102), a failure at 105 with no record, and the duplicate's ack at 130.
    // The failed delivery is not known settled until both are: a consumer
    // that died holding it owes nothing (its transaction never committed).
    let duplicate = consumer()
        .at(
            102,
            Event::Delivered {
                client: s("c#1"),
                message_id: Some(id(1).to_string()),
                redelivered: true,
                trace: None,
            },
        )
        .at(105, failed());
    let v = duplicate.verdict();
    assert!(
        !v.counts.contains_key(&Invariant::EveryFailureCounted),
        "{:#?}",
        v.violations
    );
    // Once the other delivery settles too, the failure owes its record.
    let v = duplicate
        .at(
            140,
            Event::Settled {
                client: s("c#1"),
                message_id: Some(id(1).to_string()),
                settle: Settle::Requeue,
            },
        )
        .verdict();
    assert!(
        v.counts.contains_key(&Invariant::EveryFailureCounted),
        "{:#?}",
        v.violations
    );
}

/// The events of `producer()`'s envelope for envelope `n`, `t0` ms later.
fn produced(n: u128, t0: u64) -> Vec<(Duration, Event)> {
    producer()
        .events
        .into_iter()
        .map(|(t, e)| {
            let ids = |ids: &[Uuid]| ids.iter().map(|_| id(n)).collect::<Vec<_>>();
            let e = match e {
                Event::Committed { client, ids: i } => Event::Committed {
                    client,
                    ids: ids(&i),
                },
                Event::Claimed {
                    replica,
                    ids: i,
                    attempts,
                } => Event::Claimed {
                    replica,
                    ids: ids(&i),
                    attempts,
                },
                Event::ClaimReturned { replica, ids: i } => Event::ClaimReturned {
                    replica,
                    ids: ids(&i),
                },
                Event::PublishSent { client, .. } => Event::PublishSent {
                    client,
                    message_id: id(n),
                    body_id: Some(id(n)),
                },
                Event::Confirmed { client, ack, .. } => Event::Confirmed {
                    client,
                    message_id: id(n),
                    ack,
                },
                Event::ConfirmReceived { client, .. } => Event::ConfirmReceived {
                    client,
                    message_id: id(n),
                },
                Event::StoreCalled {
                    replica,
                    call,
                    ids: i,
                } => Event::StoreCalled {
                    replica,
                    call,
                    ids: ids(&i),
                },
                Event::MarkedPublished { replica, ids: i } => Event::MarkedPublished {
                    replica,
                    ids: ids(&i),
                },
                Event::Deleted { ids: i } => Event::Deleted { ids: ids(&i) },
                other => other,
            };
            (t + ms(t0), e)
        })
        .collect()
}

/// Two events of key `k`, numbered 1 and 2, the second written 1 ms after
/// the first and drained `t0` ms after it (each committed, claimed,
/// published, confirmed and marked as in `producer()`).
fn keyed(t0: u64, numbers: [i64; 2]) -> Run {
    let mut run = producer();
    run.events
        .extend(produced(2, t0).into_iter().map(|(t, e)| match e {
            Event::Committed { .. } => (ms(1), e),
            e => (t, e),
        }));
    run.fin.stored.insert(id(2), 1);
    run.at(
        0,
        Event::KeysNumbered {
            rows: vec![(id(1), s("k"), numbers[0])],
        },
    )
    .at(
        1,
        Event::KeysNumbered {
            rows: vec![(id(2), s("k"), numbers[1])],
        },
    )
}

/// `keyed(100, [1, 2])` on an ordered subscription, with `effects` (event
/// numbers, in commit order) taking effect from 300 ms on.
fn applied(effects: &[u128]) -> Run {
    let mut run = keyed(100, [1, 2]).ordered();
    for (i, n) in effects.iter().enumerate() {
        run = run.at(
            300 + 10 * i as u64,
            Event::InboxCommitted {
                client: s("c#1"),
                began: ms(290),
                processed: vec![id(*n)],
                effects: vec![(s("q"), id(*n))],
            },
        );
    }
    run
}

/// `applied(&[1, 2])` with a handler run of each event: (client, event,
/// start ms, end ms if it ended); run i is on session i + 1.
fn handled(runs: &[(&str, u128, u64, Option<u64>)]) -> Run {
    let mut run = applied(&[1, 2]);
    for (session, (client, n, start, end)) in (1..).zip(runs) {
        run = run.at(*start, bounds(session, 1500, 60_000)).at(
            *start,
            Event::HandlerStarted {
                client: s(client),
                event_id: id(*n),
                session: Some(session),
            },
        );
        if let Some(end) = end {
            run = run.at(
                *end,
                Event::HandlerEnded {
                    client: s(client),
                    event_id: id(*n),
                },
            );
        }
    }
    run
}

/// The server applied a transaction's bounds on `session`.
fn bounds(session: u64, statement_ms: u64, idle_in_tx_ms: u64) -> Event {
    Event::TxBounds {
        session,
        statement_ms: Some(statement_ms),
        idle_in_tx_ms: Some(idle_in_tx_ms),
    }
}

#[test]
fn a_handler_runs_only_under_the_servers_bounds() {
    // The deadline is 500 ms: a statement may run 501..=1500 ms, the
    // transaction sit idle at least 60 s.
    let start = |b: Option<Event>| {
        let run = applied(&[1]);
        let run = match b {
            Some(b) => run.at(280, b),
            None => run,
        };
        run.at(
            281,
            Event::HandlerStarted {
                client: s("c#1"),
                event_id: id(1),
                session: Some(7),
            },
        )
        .verdict()
        .counts
        .contains_key(&Invariant::HandlerTxBounds)
    };
    assert!(!start(Some(bounds(7, 1500, 60_000))));
    assert!(!start(Some(bounds(7, 1000, 120_000))));
    assert!(start(None), "no bounds at all");
    assert!(start(Some(bounds(7, 60_000, 1500))), "the two swapped");
    assert!(
        start(Some(bounds(7, 500, 60_000))),
        "a statement cut at the deadline"
    );
    assert!(
        start(Some(bounds(7, 1501, 60_000))),
        "a statement past deadline + 1 s"
    );
    assert!(start(Some(bounds(7, 1500, 59_999))), "idle under a minute");
    assert!(
        start(Some(bounds(8, 1500, 60_000))),
        "another session's bounds"
    );
    // A transaction's bounds end with it.
    let next_tx = applied(&[1])
        .at(270, bounds(7, 1500, 60_000))
        .at(
            275,
            Event::InboxBatch {
                client: s("c#1"),
                session: 7,
                deliveries: 1,
                committed: true,
            },
        )
        .at(
            281,
            Event::HandlerStarted {
                client: s("c#1"),
                event_id: id(1),
                session: Some(7),
            },
        );
    assert!(
        next_tx
            .verdict()
            .counts
            .contains_key(&Invariant::HandlerTxBounds)
    );
}

fn ordering_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    vec![
        // Two replicas ran one key's handlers at once (a partition with
        // two active consumers, or a replay without the key's lock).
        (
            I::KeyHandledOneAtATime,
            handled(&[("c#1", 1, 290, Some(299)), ("d#1", 2, 295, Some(305))]),
        ),
        // Two workers of one replica did (a key routed to two of them).
        (
            I::KeyHandledOneAtATime,
            handled(&[("c#1", 1, 290, Some(299)), ("c#1", 2, 295, Some(305))]),
        ),
        // A run never ended by its host's crash holds the key still: a
        // pause is not a crash.
        (
            I::KeyHandledOneAtATime,
            handled(&[("c#1", 1, 290, None), ("d#1", 2, 300, Some(305))]).at(
                298,
                Event::Host {
                    host: s("d"),
                    up: false,
                },
            ),
        ),
        // The second event took effect before the first (a requeued first
        // event overtaken, or a dead-lettered one replayed later).
        (I::KeyAppliedInOrder, applied(&[2, 1])),
        (I::KeyAppliedInOrder, applied(&[2])),
        // Recorded held though the first had taken effect.
        (
            I::KeyHeldBehindItsHead,
            applied(&[1]).at(
                320,
                Event::InboxHeld {
                    client: s("c#1"),
                    events: vec![id(2)],
                },
            ),
        ),
        // Numbered against commit order: the second commit took 1 again,
        // or skipped a number.
        (I::KeyNumberedInCommitOrder, keyed(100, [1, 1])),
        (I::KeyNumberedInCommitOrder, keyed(100, [1, 3])),
        // The second event claimed (and sent) while the first was claimed
        // but not yet marked (at 80): the claim without the head filter.
        (I::KeyHeadOnlyClaimed, keyed(5, [1, 2])),
        (I::KeyPublishedInOrder, keyed(5, [1, 2])),
        // Behind a parked head: the first parks instead of being marked.
        (
            I::KeyHeadOnlyClaimed,
            keyed(100, [1, 2])
                .without(|e| matches!(e, Event::MarkedPublished { ids, .. } if ids == &[id(1)]))
                .at(
                    75,
                    Event::MarkedFailed {
                        replica: s("a"),
                        ids: vec![id(1)],
                        parked: vec![id(1)],
                    },
                ),
        ),
    ]
}

/// A failover at `t` that takes back event 1's effect (and its outbox
/// row, if `row`).
fn failover(t: u64, row: bool) -> (u64, Event) {
    (
        t,
        Event::FailedOver {
            lost: if row { vec![id(1)] } else { vec![] },
            lost_effects: vec![(s("q"), id(1))],
        },
    )
}

fn failover_cases() -> Vec<(Invariant, Run)> {
    use Invariant as I;
    let (t, lost_row) = failover(200, true);
    let (t2, lost_effect) = failover(200, false);
    vec![
        // The broker stored event 1, then a failover took its commit back.
        (I::NoPhantomEvent, producer().at(t, lost_row)),
        // Acked at 130, then the failover took the effect back.
        (I::NoLostEffect, consumer().at(t2, lost_effect.clone())),
        // Committed at 120, taken back by a failover at 125, acked at 130
        // with no effect since (a wait that trusted the new primary).
        (I::NoLostEffect, consumer().at(125, lost_effect)),
    ]
}

#[test]
fn a_failover_that_took_back_only_what_nobody_acted_on_passes() {
    use Invariant as I;
    let rules = [
        I::NoPhantomEvent,
        I::NoLostEffect,
        I::Lost,
        I::PhantomPublish,
    ];
    let fine = |run: Run| {
        let v = run.verdict();
        for i in rules {
            assert!(!v.counts.contains_key(&i), "{:#?}", v.violations);
        }
    };
    // An event committed then taken back, never published: neither lost
    // nor a phantom.
    let never_sent = Run {
        events: vec![
            (
                ms(0),
                Event::Committed {
                    client: s("w"),
                    ids: vec![id(9)],
                },
            ),
            (
                ms(50),
                Event::FailedOver {
                    lost: vec![id(9)],
                    lost_effects: vec![],
                },
            ),
        ],
        fin: FinalState::default(),
        expect: Expect::default(),
        partitions: 0,
    };
    fine(never_sent);
    // An effect taken back at 125, before its ack; applied again on the
    // new primary before the next ack.
    let again = consumer()
        .without(|e| matches!(e, Event::Settled { .. }))
        .at(125, failover(125, false).1)
        .at(
            140,
            Event::InboxCommitted {
                client: s("c#1"),
                began: ms(135),
                processed: vec![id(1)],
                effects: vec![(s("q"), id(1))],
            },
        )
        .at(
            150,
            Event::Settled {
                client: s("c#1"),
                message_id: Some(id(1).to_string()),
                settle: Settle::Ack,
            },
        );
    fine(again);
}

fn cases() -> Vec<(Invariant, Run)> {
    [
        failover_cases(),
        ordering_cases(),
        statement_cases(),
        delivery_and_attempt_cases(),
        lease_cases(),
        timing_cases(),
        retention_cases(),
        effect_cases(),
        budget_cases(),
        replay_cases(),
        hostile_cases(),
        mark_cases(),
    ]
    .concat()
}

#[test]
fn a_keys_events_applied_in_order_or_held_behind_their_head_pass() {
    use Invariant as I;
    let rules = [I::KeyAppliedInOrder, I::KeyHeldBehindItsHead];
    let fine = |run: Run| {
        let v = run.verdict();
        for i in rules {
            assert!(!v.counts.contains_key(&i), "{:#?}", v.violations);
        }
    };
    fine(applied(&[1, 2]));
    // Held behind the dead-lettered first, released after its replay.
    let held = keyed(100, [1, 2]).ordered().at(
        300,
        Event::InboxHeld {
            client: s("c#1"),
            events: vec![id(2)],
        },
    );
    fine(held.clone());
    let effect = |t: u64, n: u128| {
        (
            t,
            Event::InboxCommitted {
                client: s("c#1"),
                began: ms(t - 10),
                processed: vec![id(n)],
                effects: vec![(s("q"), id(n))],
            },
        )
    };
    let (t1, e1) = effect(400, 1);
    let (t2, e2) = effect(410, 2);
    fine(held.clone().at(t1, e1).at(t2, e2));
    // Skipped at the inbox: the second goes on.
    let (t2, e2) = effect(410, 2);
    fine(
        held.at(
            400,
            Event::InboxSkipped {
                client: s("c#1"),
                events: vec![id(1)],
            },
        )
        .at(t2, e2),
    );
    // Not ordered: no such rule.
    let v = keyed(100, [1, 2]).at(t1, effect(400, 2).1).verdict();
    assert!(!v.counts.contains_key(&I::KeyAppliedInOrder));
}

#[test]
fn a_keys_handler_runs_one_after_another_pass() {
    use Invariant as I;
    let fine = |run: Run| {
        let v = run.verdict();
        assert!(
            !v.counts.contains_key(&I::KeyHandledOneAtATime),
            "{:#?}",
            v.violations
        );
    };
    // One after the other, on one replica or two.
    fine(handled(&[
        ("c#1", 1, 290, Some(295)),
        ("c#1", 2, 295, Some(305)),
    ]));
    fine(handled(&[
        ("c#1", 1, 290, Some(295)),
        ("d#1", 2, 296, Some(305)),
    ]));
    // A run again of the same event, after the first ended.
    fine(handled(&[
        ("c#1", 1, 280, Some(285)),
        ("c#1", 1, 290, Some(295)),
    ]));
    // A run that never ended ends with its host's crash; the standby then
    // takes the key.
    fine(
        handled(&[("c#1", 1, 290, None), ("d#1", 2, 300, Some(305))]).at(
            298,
            Event::Host {
                host: s("c"),
                up: false,
            },
        ),
    );
    // A paused replica's run whose transaction the server ended: over,
    // whatever it does when it wakes.
    fine(
        handled(&[("c#1", 1, 290, Some(320)), ("d#1", 2, 300, Some(305))]).at(
            298,
            Event::InboxBatch {
                client: s("c#1"),
                session: 1,
                deliveries: 1,
                committed: false,
            },
        ),
    );
    // Not ordered: runs of one key may overlap.
    let mut run = handled(&[("c#1", 1, 290, Some(299)), ("d#1", 2, 295, Some(305))]);
    run.partitions = 0;
    fine(run);
}

#[test]
fn a_keys_events_drained_in_order_pass_and_a_republish_after_the_mark_is_no_violation() {
    use Invariant as I;
    let run = keyed(100, [1, 2]);
    assert!(run.verdict().ok(), "{:#?}", run.verdict().violations);
    // A stale replica republishes the first event after the second was
    // sent (its lease had expired): the first was marked long before.
    let stale = run.at(
        200,
        Event::PublishSent {
            client: s("b"),
            message_id: id(1),
            body_id: Some(id(1)),
        },
    );
    let v = stale.verdict();
    for i in [I::KeyPublishedInOrder, I::KeyHeadOnlyClaimed] {
        assert!(!v.counts.contains_key(&i), "{:#?}", v.violations);
    }
    // A skipped head releases its key as a mark does.
    let skipped = keyed(100, [1, 2])
        .without(|e| matches!(e, Event::MarkedPublished { ids, .. } if ids == &[id(1)]))
        .at(78, Event::Skipped { ids: vec![id(1)] });
    let v = skipped.verdict();
    for i in [I::KeyPublishedInOrder, I::KeyHeadOnlyClaimed] {
        assert!(!v.counts.contains_key(&i), "{:#?}", v.violations);
    }
}

#[test]
fn correct_runs_pass() {
    for run in [producer(), consumer()] {
        let v = run.verdict();
        assert!(v.ok(), "{:#?}", v.violations);
    }
    let v = producer().verdict();
    assert_eq!((v.committed, v.published, v.duplicates), (1, 1, 0));
}

#[test]
fn every_invariant_is_caught_on_a_trace_that_breaks_it() {
    let mut covered = BTreeSet::new();
    for (invariant, run) in cases() {
        let v = run.verdict();
        assert!(
            v.counts.contains_key(&invariant),
            "{invariant} not caught; found {:?}: {:#?}",
            v.broken(),
            v.violations
        );
        assert!(v.violations.iter().any(|x| x.invariant == invariant));
        covered.insert(invariant);
    }
    let missing: Vec<_> = Invariant::ALL
        .iter()
        .filter(|i| !covered.contains(i))
        .collect();
    assert!(missing.is_empty(), "no violating trace for {missing:?}");
}

#[test]
fn a_short_claim_beside_a_publish_is_no_transaction_across_broker_io() {
    // The overlapping drainer: a claim's statement answers, a publish of
    // another batch goes out in the same instant, the claim commits.
    let run = producer()
        .at(41, Event::TxBegin { client: s("a") })
        .at(41, Event::TxIdle { client: s("a") })
        .at(41, Event::TxResumed { client: s("a") })
        .at(41, Event::TxEnd { client: s("a") });
    assert!(run.verdict().ok(), "{:#?}", run.verdict().violations);
}

#[test]
fn a_replica_blocked_on_the_database_is_held_to_release_once_unblocked() {
    // The confirm never comes; at the deadline the replica is inside a
    // store call (the database is slow) that returns at 3.0 s.
    let base = Run {
        events: producer()
            .events
            .into_iter()
            .filter(|(_, e)| {
                !matches!(
                    e,
                    Event::ConfirmReceived { .. }
                        | Event::StoreCalled { .. }
                        | Event::MarkedPublished { .. }
                        | Event::StoreAnswered {
                            call: Call::MarkPublished,
                            ..
                        }
                )
            })
            .collect(),
        ..producer()
    }
    .at(
        1000,
        Event::StoreCalled {
            replica: s("a"),
            call: Call::Release,
            ids: vec![id(2)],
        },
    )
    .at(
        3000,
        Event::StoreAnswered {
            replica: s("a"),
            call: Call::Release,
        },
    )
    .at(6000, Event::Heal);
    let release = |t| {
        base.clone().at(
            t,
            Event::StoreCalled {
                replica: s("a"),
                call: Call::Release,
                ids: vec![id(1)],
            },
        )
    };
    assert!(
        !release(3010)
            .verdict()
            .counts
            .contains_key(&Invariant::Phase2Deadline)
    );
    assert!(
        release(3200)
            .verdict()
            .counts
            .contains_key(&Invariant::Phase2Deadline)
    );
}

#[test]
fn backoff_doubles_with_failures_in_a_row() {
    let failing = |gaps: &[u64]| {
        let mut run = producer();
        let mut t = 1000;
        for gap in gaps {
            run = run
                .at(
                    t,
                    Event::StoreFailed {
                        replica: s("a"),
                        call: Call::Claim,
                    },
                )
                .at(t + gap, Event::ClaimCalled { replica: s("a") });
            t += gap + 1;
        }
        run.verdict()
            .counts
            .contains_key(&Invariant::BackoffAfterFailure)
    };
    assert!(!failing(&[50, 100, 200]));
    assert!(
        failing(&[50, 60]),
        "the second failure in a row waits 100 ms"
    );
}

#[test]
fn an_effect_repeated_after_its_inbox_row_expired_is_the_retention_window() {
    let again = consumer()
        .at(40_000, Event::InboxDeleted { ids: vec![id(1)] })
        .at(
            41_000,
            Event::InboxCommitted {
                client: s("c#2"),
                began: ms(40_900),
                processed: vec![id(1)],
                effects: vec![(s("q"), id(1))],
            },
        )
        .with(|f| {
            f.consumer.as_mut().unwrap().effects.insert(id(1), 2);
            f.consumer.as_mut().unwrap().rows = BTreeSet::new();
        });
    assert!(again.verdict().ok(), "{:#?}", again.verdict().violations);
}

#[test]
fn a_row_dead_lettered_by_a_failed_replay_stays_so_below_the_budget() {
    // A replay's failure marks the row with a budget of one; a stale
    // duplicate failing afterwards is dead-lettered at attempt 2 of 3.
    let run = failed_replay(consumer(), true);
    let stale = failed_attempt(run.clone(), 300, 2, true, Settle::DeadLetter);
    let broken = stale.verdict().broken();
    assert!(
        !broken.contains(&Invariant::DeadLetterAtBudget),
        "{:#?}",
        stale.verdict().violations
    );
    // Without the replay's mark, attempt 2 of 3 is too early.
    let early = failed_attempt(consumer(), 300, 2, true, Settle::DeadLetter);
    assert!(
        early
            .verdict()
            .broken()
            .contains(&Invariant::DeadLetterAtBudget)
    );
}

#[test]
fn a_sample_of_what_the_table_held_passes() {
    // One row pending and one parked, keyed behind it: pending 1 (blocked
    // by the parked head), parked 1, oldest at least its commit's age.
    let keyed = producer()
        .at(
            5,
            Event::Committed {
                client: s("w"),
                ids: vec![id(2), id(3)],
            },
        )
        .at(
            5,
            Event::KeysNumbered {
                rows: vec![(id(2), s("k"), 1), (id(3), s("k"), 2)],
            },
        )
        .at(
            6,
            Event::MarkedFailed {
                replica: s("a"),
                ids: vec![id(2)],
                parked: vec![id(2)],
            },
        );
    let truthful = keyed.clone().at(
        90,
        Event::StatsSampled {
            pending: 1,
            oldest_age_ms: 85,
            parked: 1,
            blocked: 1,
        },
    );
    let v = truthful.verdict();
    assert!(
        !v.counts.contains_key(&Invariant::GaugesTruthful),
        "{:#?}",
        v.violations
    );
    // The crash takes the park back: the row is pending again, nothing blocked.
    let unparked = keyed
        .at(
            80,
            Event::CommitsLost {
                leases: vec![],
                unmarked: vec![],
                parks: vec![(id(2), false)],
            },
        )
        .at(
            90,
            Event::StatsSampled {
                pending: 2,
                oldest_age_ms: 85,
                parked: 0,
                blocked: 1,
            },
        );
    let v = unparked.verdict();
    assert!(
        v.counts.contains_key(&Invariant::GaugesTruthful),
        "blocked with no parked head"
    );
}

#[test]
fn a_client_that_tries_its_node_first_passes() {
    let run = |tries: &[&str]| {
        let mut r = producer().at(
            1,
            Event::BrokerAssigned {
                client: s("a"),
                node: s("rabbit-3"),
            },
        );
        for node in tries {
            r = r.at(
                2,
                Event::BrokerConnecting {
                    client: s("a"),
                    node: s(node),
                },
            );
        }
        r.verdict()
            .counts
            .contains_key(&Invariant::StartsAtAssignedNode)
    };
    // Its node refused it (down, or not yet listening): the next one.
    assert!(!run(&["rabbit-3", "rabbit-1"]));
    assert!(run(&["rabbit-1", "rabbit-3"]));
}
