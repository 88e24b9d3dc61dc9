//! The production subscriber, unchanged, on the simulation adapters: the
//! fake PostgreSQL's inbox and the fake broker's queues. Duplicates and
//! transient failures (after the handler's effect was written) take effect
//! once; a poison event is dead-lettered after the budget with no effect,
//! then replay applies it once.

// turmoil only: these drive the turmoil world by hand (links held and
// released between steps); the scenarios and the conformance suite run on
// both engines.
#![cfg(not(madsim))]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::core::ports::{Broker, Confirm, InboxFilter, OutgoingMessage, PublishChannel};
use outbox::core::subscriber::{ReplayOutcome, Subscriber, SubscriberSettings};
use outbox::{EventEnvelope, TokioClock};
use sim::adapters::{Hooks, SimBroker, SimInboxStore};
use sim::fakes;
use sim::trace::{Event, FaultKind, Trace};
use sim::workload::handler::SimHandler;
use sim::workload::numbered_envelope;

const QUEUE: &str = "billing.orders";

/// `QUEUE` bound to `bindings` on `canopy.events`: a budget of three,
/// 64 KiB deliveries, a handler deadline of a second (the handler's
/// stalls are cut off soon).
fn settings(bindings: &[&str], prefetch: u16, concurrency: u32) -> SubscriberSettings {
    let mut s = SubscriberSettings::new(QUEUE, bindings);
    s.spec.prefetch = prefetch;
    s.concurrency = concurrency;
    s.max_attempts = 3;
    s.max_body_bytes = 64 * 1024;
    s.handler_timeout = Duration::from_secs(1);
    s
}

#[test]
fn the_subscriber_applies_each_event_once_and_dead_letters_then_replays_poison() {
    let trace = Trace::default();
    let (mut sim, pg, mq) = fakes::bare_world(21, &trace);
    let (pg_check, mq_check) = (pg.clone(), mq.clone());
    sim.client("consumer", async move {
        let handler = Arc::new(SimHandler::new(QUEUE, 4));
        handler.downstream_broken.store(true, Ordering::SeqCst);
        let settings = settings(&["orders.*", "poison.*"], 8, 3);
        let subscriber = Arc::new(Subscriber::new(
            Arc::new(SimInboxStore::new("consumer-1", trace.clone())),
            Arc::new(SimBroker::new("consumer-1", trace.clone(), Hooks::new(3))),
            Arc::new(TokioClock::default()),
            handler.clone(),
            settings,
        ));
        let (stop, rx) = tokio::sync::watch::channel(false);
        let runner = {
            let s = subscriber.clone();
            tokio::spawn(async move { s.run(rx).await })
        };
        tokio::time::sleep(Duration::from_secs(1)).await; // the queue is declared

        let publisher = SimBroker::new("producer", trace.clone(), Hooks::new(4));
        let mut ch = publisher.channel_open().await.unwrap();
        ch.channel_confirm_select().await.unwrap();
        let mut events = Vec::new();
        for i in 0..30 {
            events.push(numbered_envelope("orders.created", i));
        }
        let poison: Vec<_> = (0..3)
            .map(|i| numbered_envelope("poison.created", 100 + i))
            .collect();
        // Every fifth event twice: a republish after a lost mark.
        let sends: Vec<&EventEnvelope> = events
            .iter()
            .chain(&poison)
            .chain(events.iter().step_by(5))
            .collect();
        for e in &sends {
            let body = e.encode(&Default::default()).unwrap();
            let c = ch
                .channel_publish(OutgoingMessage {
                    exchange: "canopy.events",
                    routing_key: &e.routing_key,
                    message_id: e.id,
                    body: body.as_bytes(),
                    trace: None,
                    ordering: None,
                })
                .await
                .unwrap();
            assert_eq!(c.await.unwrap(), Confirm::Ack);
        }
        let counters = subscriber.counters();
        for _ in 0..600 {
            let s = counters.snapshot();
            if s.processed + s.duplicates == 36 && s.dead_lettered == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let s = counters.snapshot();
        assert_eq!(
            (s.processed, s.duplicates, s.dead_lettered),
            (30, 6, 3),
            "{s:?}"
        );
        assert!(
            s.retried >= 6,
            "transient failures and poison attempts were retried: {s:?}"
        );
        {
            let db = pg_check.lock();
            let effects = db.inbox.effects();
            for e in &events {
                assert_eq!(
                    effects.get(&(QUEUE.to_owned(), e.id)),
                    Some(&1),
                    "once: {}",
                    e.id
                );
            }
            for e in &poison {
                assert_eq!(
                    effects.get(&(QUEUE.to_owned(), e.id)),
                    None,
                    "no effect yet"
                );
            }
        }
        // The last nack may still be on its way to the broker.
        for _ in 0..50 {
            if mq_check
                .queues
                .lock()
                .unwrap()
                .ready("billing.orders.dlq")
                .len()
                == 3
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            mq_check
                .queues
                .lock()
                .unwrap()
                .ready("billing.orders.dlq")
                .len(),
            3
        );

        // The downstream is fixed; the operator replays the dead letters.
        handler.downstream_broken.store(false, Ordering::SeqCst);
        let filter = InboxFilter {
            ids: Some(poison.iter().map(|e| e.id).collect()),
            ..InboxFilter::default()
        };
        let replayed = subscriber.replay(&filter).await.unwrap();
        assert_eq!(replayed.len(), 3);
        // A poison event's first real attempt may hit a transient failure:
        // replay reports it, and a second replay applies it.
        let failed = replayed
            .iter()
            .filter(|(_, o)| matches!(o, ReplayOutcome::Failed { .. }))
            .count();
        let again = subscriber.replay(&filter).await.unwrap();
        assert_eq!(again.len(), failed, "{replayed:?} then {again:?}");
        assert!(
            again.iter().all(|(_, o)| *o == ReplayOutcome::Applied),
            "{again:?}"
        );
        assert!(subscriber.replay(&filter).await.unwrap().is_empty());
        {
            let db = pg_check.lock();
            for e in &poison {
                assert_eq!(db.inbox.effects().get(&(QUEUE.to_owned(), e.id)), Some(&1));
            }
        }
        stop.send(true).unwrap();
        runner.await.unwrap().unwrap();
        Ok(())
    });
    sim.run().unwrap();
}

#[test]
fn database_trouble_is_retried_in_place_with_a_doubling_backoff_and_counts_no_attempt() {
    // Every statement fails (a serialization failure, nobody's fault) for
    // ten seconds: the one delivery is retried in place, each retry after
    // twice the pause of the last (100 ms up to 5 s): seven tries, not a hot
    // loop. Then the database answers: the event takes effect once, with no
    // attempt recorded.
    let trace = Trace::default();
    let (mut sim, pg, _) = fakes::bare_world(31, &trace);
    let (pg_check, events) = (pg.clone(), trace.clone());
    sim.client("consumer", async move {
        let settings = settings(&["orders.*"], 1, 1);
        let subscriber = Arc::new(Subscriber::new(
            Arc::new(SimInboxStore::new("consumer-1", trace.clone())),
            Arc::new(SimBroker::new("consumer-1", trace.clone(), Hooks::new(3))),
            Arc::new(TokioClock::default()),
            Arc::new(SimHandler::new(QUEUE, 0)),
            settings,
        ));
        let (stop, rx) = tokio::sync::watch::channel(false);
        let runner = {
            let s = subscriber.clone();
            tokio::spawn(async move { s.run(rx).await })
        };
        tokio::time::sleep(Duration::from_secs(1)).await; // the queue is declared
        pg_check.faults.lock().unwrap().fail_prob = 1.0;
        let started = sim::sim_now();
        let publisher = SimBroker::new("producer", trace.clone(), Hooks::new(4));
        let mut ch = publisher.channel_open().await.unwrap();
        ch.channel_confirm_select().await.unwrap();
        let e = numbered_envelope("orders.created", 1);
        let body = e.encode(&Default::default()).unwrap();
        let confirm = ch
            .channel_publish(OutgoingMessage {
                exchange: "canopy.events",
                routing_key: &e.routing_key,
                message_id: e.id,
                body: body.as_bytes(),
                trace: None,
                ordering: None,
            })
            .await
            .unwrap();
        assert_eq!(confirm.await.unwrap(), Confirm::Ack);
        tokio::time::sleep(Duration::from_secs(10)).await;
        pg_check.faults.lock().unwrap().fail_prob = 0.0;
        let tries = events
            .events()
            .into_iter()
            .filter(|(at, ev)| {
                *at >= started
                    && matches!(ev, Event::Fault { kind: FaultKind::PgFailure, detail }
                        if detail.starts_with("consumer-1 "))
            })
            .count();
        assert!(
            (5..=9).contains(&tries),
            "{tries} failed statements in 10 s: 0.1, 0.2, 0.4, … 5 s apart makes seven"
        );
        for _ in 0..100 {
            if subscriber.counters().snapshot().processed == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(subscriber.counters().snapshot().processed, 1);
        {
            let db = pg_check.lock();
            assert_eq!(db.inbox.effects().get(&(QUEUE.to_owned(), e.id)), Some(&1));
            assert!(
                db.inbox.rows().all(|r| r.attempts == 0),
                "database trouble counts no attempt"
            );
        }
        stop.send(true).unwrap();
        runner.await.unwrap().unwrap();
        Ok(())
    });
    sim.run().unwrap();
}
