//! `Drainer::tick`, the strictly sequential claim → publish → mark cycle
//! (the harness's phase breakdown and services that drive the drainer
//! themselves), on the simulation adapters: it publishes and marks what it
//! claimed; when the broker's link black-holes it releases the batch within
//! the confirm timeout, blames no row, and the next tick after the heal
//! publishes it; a broker's nack blames no row either. Its report, and a
//! drain's, count what the store did.

// turmoil only: these drive the turmoil world by hand (links held and
// released between steps); the scenarios and the conformance suite run on
// both engines.
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use outbox::core::drainer::Drainer;
use outbox::{DrainError, DrainerConfig, TokioClock};
use sim::adapters::{Hooks, PgClient, SimBroker, SimStore};
use sim::fakes;
use sim::trace::{Call, Event, Trace};
use sim::wire::{NewRow, PgRequest};
use sim::workload::numbered_envelope;

/// Commits envelopes number `first..first + n` in one transaction.
async fn commit(pg: &PgClient, first: u64, n: u64) {
    commit_keyed(pg, first, n, "orders.created").await;
}

/// Commits envelopes number `first..first + n`, routed by `key`, in one
/// transaction.
async fn commit_keyed(pg: &PgClient, first: u64, n: u64, key: &str) {
    commit_stored_as(pg, first, n, key, key).await;
}

/// Commits envelopes number `first..first + n` of routing key `key`, each
/// row stored with routing key `stored` (a row written by hand, past
/// `publish_tx`, may differ), in one transaction.
async fn commit_stored_as(pg: &PgClient, first: u64, n: u64, key: &str, stored: &str) {
    let rows = (first..first + n)
        .map(|i| {
            let e = numbered_envelope(key, i);
            NewRow {
                id: e.id,
                routing_key: stored.to_owned(),
                body: e.encode(&Default::default()).unwrap(),
                ordering_key: None,
            }
        })
        .collect();
    pg.in_tx(vec![PgRequest::Insert { rows }]).await.unwrap();
}

/// The replica `drainer-1` on the simulation adapters.
type SimDrainer = Drainer<SimStore, SimBroker, TokioClock, outbox::runtime::SplitMix64>;

fn sim_drainer(trace: &Trace, config: DrainerConfig) -> SimDrainer {
    Drainer::new(
        Arc::new(SimStore::new("drainer-1", trace.clone(), Hooks::new(3))),
        Arc::new(SimBroker::new("drainer-1", trace.clone(), Hooks::new(4))),
        Arc::new(TokioClock::default()),
        Arc::new(outbox::runtime::SplitMix64::new(5)),
        config,
    )
}

#[test]
fn a_tick_publishes_and_marks_and_a_black_holed_tick_releases_in_time() {
    let trace = Trace::default();
    let (mut sim, state, _) = fakes::bare_world(1, &trace);
    sim.client("drainer", async move {
        let config = DrainerConfig::builder()
            .replica_id("drainer-1")
            .batch_size(10)
            .pipeline_depth(4)
            .lease_ttl_secs(5)
            .confirm_timeout_secs(2)
            .build()
            .unwrap();
        let drainer = sim_drainer(&trace, config);
        let writer = PgClient::new("writer", trace.clone());
        commit(&writer, 0, 6).await;
        let report = drainer.tick().await.unwrap();
        assert_eq!((report.claimed, report.published), (6, 6), "{report:?}");
        assert_eq!(drainer.tick().await.unwrap().claimed, 0, "nothing left");

        commit(&writer, 6, 3).await;
        turmoil::hold("drainer", "rabbit");
        let e = drainer.tick().await.unwrap_err();
        assert!(
            matches!(e, DrainError::ConfirmTimeout { rows: 3, .. }),
            "{e}"
        );
        // Handed back at the deadline, counted from the claim's return (the
        // tick returns later: it replaces the connection first, which takes
        // its own timeout on a held link).
        let events = trace.events();
        let at = |want: fn(&Event) -> bool| {
            events
                .iter()
                .rev()
                .find(|(_, e)| want(e))
                .map(|(t, _)| *t)
                .expect("the event is in the trace")
        };
        let claimed = at(|e| matches!(e, Event::ClaimReturned { ids, .. } if ids.len() == 3));
        let released = at(
            |e| matches!(e, Event::StoreCalled { call: Call::Release, ids, .. } if ids.len() == 3),
        );
        let after = released - claimed;
        assert!(
            after <= Duration::from_millis(2_025),
            "released {after:?} after the claim returned; confirm timeout 2 s"
        );
        {
            let db = state.lock();
            let unpublished: Vec<_> = db
                .outbox
                .rows()
                .filter(|r| r.published_ms.is_none())
                .collect();
            assert_eq!(unpublished.len(), 3);
            assert!(
                unpublished
                    .iter()
                    .all(|r| r.claimed_by.is_none() && r.attempts == 0),
                "released, nobody blamed: {unpublished:?}"
            );
        }
        turmoil::release("drainer", "rabbit");
        let mut published = 0;
        for _ in 0..20 {
            match drainer.tick().await {
                Ok(report) => published += report.published,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
            if published == 3 {
                break;
            }
        }
        assert_eq!(published, 3, "the next ticks publish the released rows");
        Ok(())
    });
    sim.run().unwrap();
}

#[test]
fn ticks_keep_to_the_rate_bound() {
    // Ten rows at five rows a second, a batch of five: the second tick's
    // claim starts a second after the first's.
    let trace = Trace::default();
    let (mut sim, _, _) = fakes::bare_world(6, &trace);
    sim.client("drainer", async move {
        let config = DrainerConfig::builder()
            .replica_id("drainer-1")
            .batch_size(5)
            .max_rows_per_sec(5)
            .build()
            .unwrap();
        let drainer = sim_drainer(&trace, config);
        commit(&PgClient::new("writer", trace.clone()), 0, 10).await;
        for _ in 0..2 {
            assert_eq!(drainer.tick().await.unwrap().published, 5);
        }
        let calls: Vec<Duration> = trace
            .events()
            .into_iter()
            .filter_map(|(at, e)| matches!(e, Event::ClaimCalled { .. }).then_some(at))
            .collect();
        assert_eq!(calls.len(), 2);
        assert!(
            calls[1] - calls[0] >= Duration::from_secs(1),
            "claims {:?} apart; five rows at five a second take a second",
            calls[1] - calls[0]
        );
        Ok(())
    });
    sim.run().unwrap();
}

/// Commits envelopes number `first..first + n` stored with a routing key
/// no broker accepts (rows written by hand, past `publish_tx`).
async fn commit_unpublishable(pg: &PgClient, first: u64, n: u64) {
    commit_stored_as(pg, first, n, "orders.created", "").await;
}

#[test]
fn reports_count_what_the_store_did() {
    // Batches of three over five good rows and two no broker accepts, with
    // two attempts before a row parks: a drain claims all seven in three
    // batches and marks five published and two failed (the failures are
    // recorded on an ordinary session, the claims made on the drainer's
    // own, and the drain's last claim comes before the failed rows' leases
    // are back); a tick then claims both again and parks them; two drains
    // do the same with two more.
    let trace = Trace::default();
    let (mut sim, state, _) = fakes::bare_world(8, &trace);
    sim.client("drainer", async move {
        let config = DrainerConfig::builder()
            .replica_id("drainer-1")
            .batch_size(3)
            .max_attempts(2)
            .build()
            .unwrap();
        let drainer = sim_drainer(&trace, config);
        let writer = PgClient::new("writer", trace.clone());
        commit(&writer, 0, 2).await;
        commit_unpublishable(&writer, 2, 2).await;
        commit(&writer, 4, 3).await;
        let (_keep, shutdown) = tokio::sync::watch::channel(false);
        let report = drainer.drain(&shutdown).await.unwrap();
        let counts = |r: outbox::core::drainer::TickReport| {
            (r.claimed, r.published, r.failed, r.parked, r.mark_lost)
        };
        assert_eq!(counts(report), (7, 5, 2, 0, 0), "{report:?}");
        let report = drainer.tick().await.unwrap();
        assert_eq!(counts(report), (2, 0, 2, 2, 0), "{report:?}");
        // The same through drains: a drain's report sums its batches'
        // parked rows too.
        commit_unpublishable(&writer, 7, 2).await;
        commit(&writer, 9, 1).await;
        let report = drainer.drain(&shutdown).await.unwrap();
        assert_eq!(counts(report), (3, 1, 2, 0, 0), "{report:?}");
        let report = drainer.drain(&shutdown).await.unwrap();
        assert_eq!(counts(report), (2, 0, 2, 2, 0), "{report:?}");
        let db = state.lock();
        assert_eq!(
            db.outbox.rows().filter(|r| r.parked_ms.is_some()).count(),
            4
        );
        Ok(())
    });
    sim.run().unwrap();
}

#[test]
fn a_nacked_row_is_released_blameless_and_the_tick_fails_so_the_loop_backs_off() {
    // A full queue nacks the poison.* rows: they are released with their
    // attempts untouched, the rest of the batch is marked published, and
    // the tick fails; once the queue has room they publish.
    let trace = Trace::default();
    let (mut sim, state, mq) = fakes::bare_world(9, &trace);
    sim.client("drainer", async move {
        let config = DrainerConfig::builder()
            .replica_id("drainer-1")
            .batch_size(10)
            .max_attempts(1)
            .build()
            .unwrap();
        let drainer = sim_drainer(&trace, config);
        let writer = PgClient::new("writer", trace.clone());
        commit(&writer, 0, 2).await;
        commit_keyed(&writer, 2, 2, "poison.order").await;
        mq.faults.lock().unwrap().nack_prefix = Some("poison.".into());
        for _ in 0..3 {
            match drainer.tick().await {
                Err(DrainError::Refused { rows: 2, reason }) => {
                    assert!(reason.contains("nack"), "{reason}")
                }
                other => panic!("expected a refused tick, got {other:?}"),
            }
            let db = state.lock();
            for r in db.outbox.rows() {
                assert_eq!((r.attempts, r.parked_ms), (0, None), "{r:?}");
                let nacked = r.routing_key.starts_with("poison.");
                assert_eq!(r.published_ms.is_some(), !nacked, "{r:?}");
                if nacked {
                    assert_eq!(r.claimed_by, None, "released: {r:?}");
                }
            }
        }
        mq.faults.lock().unwrap().nack_prefix = None;
        let report = drainer.tick().await.unwrap();
        assert_eq!((report.claimed, report.published), (2, 2), "{report:?}");
        let db = state.lock();
        assert!(db.outbox.rows().all(|r| r.published_ms.is_some()));
        Ok(())
    });
    sim.run().unwrap();
}
