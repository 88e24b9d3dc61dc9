//! Every scenario (and its clean twin) on its pinned seeds for this build's
//! engine (`seeds` on turmoil, `madsim_seeds` on madsim): every invariant
//! holds, running the same seed twice gives the same trace, byte for byte
//! (compared by hash, and by length as a cross-check; on madsim the second
//! run is madsim's own determinism check, which compares every random draw
//! as it is made), and the pinned seeds together reach every coverage mark
//! the scenario's `reach` list names.

use std::collections::BTreeSet;
use std::path::Path;

use outbox::core::marks::Mark;
use sim::scenario::Scenario;
use sim::trace::Event;

/// One run at a time in this process: each run numbers tokio's tasks from
/// an aligned start (`sim::engine`, turmoil), which runs on parallel test
/// threads would interleave, so the same seed run twice could drop a
/// crashed host's tasks in two orders.
fn run(s: &Scenario, seed: u64) -> sim::world::RunOutcome {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    sim::world::run(s, seed)
}

fn scenarios_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios")
}

fn check(name: &str) {
    let base = Scenario::find(&scenarios_dir(), name).expect("scenario loads");
    assert!(
        !base.pinned().is_empty(),
        "{name} pins no seeds for the {} engine",
        sim::engine::NAME
    );
    let mut all = vec![base.clone()];
    all.extend(base.clean_twin());
    let mut reached: BTreeSet<Mark> = BTreeSet::new();
    for s in all {
        for &seed in s.pinned() {
            let a = run(&s, seed);
            if s.name == base.name {
                reached.extend(a.coverage.marks.keys().copied());
            }
            assert!(
                a.verdict.ok(),
                "{} seed {seed} violated: {:#?}\nreproduce: cargo run --release -p sim -- run {} --seed {seed} --engine {}",
                s.name,
                a.verdict.violations,
                s.name,
                sim::engine::NAME
            );
            assert!(
                a.verdict.committed > 0,
                "{} seed {seed} committed nothing",
                s.name
            );
            #[cfg(not(madsim))]
            let b = {
                let b = run(&s, seed);
                (b.trace_hash(), b.trace.events().len())
            };
            #[cfg(madsim)]
            let b = sim::world::check_determinism(&s, seed);
            assert_eq!(
                (a.trace_hash(), a.trace.events().len()),
                b,
                "{} seed {seed} is not deterministic",
                s.name
            );
        }
    }
    for mark in &base.expect.reach {
        let m = Mark::from_name(mark).expect("scenarios name marks");
        assert!(
            reached.contains(&m),
            "{name}: no pinned seed reaches mark {mark} on {engine}; pin one that does \
             (cargo run --release -p sim -- sweep {name} --seeds 0..50 --by-scenario --engine {engine})",
            engine = sim::engine::NAME
        );
    }
}

#[test]
fn every_scenario_file_has_a_test_here() {
    let mut names: Vec<String> = Scenario::load_dir(&scenarios_dir())
        .expect("scenarios load")
        .into_iter()
        .map(|s| s.name)
        .collect();
    names.sort();
    let listed = [
        "broker_blackhole",
        "broker_node_crash",
        "broker_node_partition",
        "clean",
        "connection_drop",
        "consumer_crash_before_ack",
        "crash_at_every_phase",
        "crash_between_publish_and_mark",
        "db_crash_amid_parking",
        "db_crash_loses_async_commits",
        "db_outage",
        "db_trouble_amid_batches",
        "dead_letters_amid_elections",
        "deferred_constraint",
        "handler_blocked_on_a_lock",
        "hostile_deliveries",
        "hostile_keyed_deliveries",
        "lease_expiry_mid_confirm",
        "ordering_keys_consumer_swarm",
        "ordering_keys_consumers",
        "ordering_keys_handover",
        "ordering_keys_hot",
        "ordering_keys_many",
        "ordering_keys_swarm",
        "overlapping_batches",
        "partitioned_retention",
        "pg_failover_stale_standby",
        "pg_switchover",
        "poison_parking",
        "poison_to_dlq_and_replay",
        "producer_and_consumer_swarm",
        "rate_bounded_backlog",
        "redelivery_storm",
        "refused_amid_failures",
        "replicas_racing",
        "reply_lost",
        "slow_claims",
        "slow_database",
        "swallowed_sql_error",
        "swarm",
    ];
    assert_eq!(names, listed, "add a test below for every scenario file");
}

#[test]
fn broker_blackhole() {
    check("broker_blackhole");
}
#[test]
fn overlapping_batches() {
    check("overlapping_batches");
}
#[test]
fn clean() {
    check("clean");
}
#[test]
fn connection_drop() {
    check("connection_drop");
}
#[test]
fn crash_at_every_phase() {
    check("crash_at_every_phase");
}
#[test]
fn crash_between_publish_and_mark() {
    check("crash_between_publish_and_mark");
}
#[test]
fn db_outage() {
    check("db_outage");
}
#[test]
fn pg_failover_stale_standby() {
    check("pg_failover_stale_standby");
}
#[test]
fn pg_switchover() {
    check("pg_switchover");
}
#[test]
fn db_crash_loses_async_commits() {
    check("db_crash_loses_async_commits");
}
#[test]
fn db_crash_amid_parking() {
    check("db_crash_amid_parking");
}
#[test]
fn lease_expiry_mid_confirm() {
    check("lease_expiry_mid_confirm");
}
#[test]
fn partitioned_retention() {
    check("partitioned_retention");
}
#[test]
fn poison_parking() {
    check("poison_parking");
}
#[test]
fn replicas_racing() {
    check("replicas_racing");
}
#[test]
fn reply_lost() {
    check("reply_lost");
}
#[test]
fn swarm() {
    check("swarm");
}

#[test]
fn different_seeds_give_different_traces() {
    let s = Scenario::find(&scenarios_dir(), "swarm").unwrap();
    let a = run(&s, 11);
    let b = run(&s, 12);
    assert_ne!(a.trace_hash(), b.trace_hash());
}
#[test]
fn consumer_crash_before_ack() {
    check("consumer_crash_before_ack");
}
#[test]
fn poison_to_dlq_and_replay() {
    check("poison_to_dlq_and_replay");
}
#[test]
fn producer_and_consumer_swarm() {
    check("producer_and_consumer_swarm");
}
#[test]
fn redelivery_storm() {
    check("redelivery_storm");
}
#[test]
fn rate_bounded_backlog() {
    check("rate_bounded_backlog");
}
#[test]
fn hostile_deliveries() {
    check("hostile_deliveries");
}
#[test]
fn dead_letters_amid_elections() {
    check("dead_letters_amid_elections");
}
#[test]
fn hostile_keyed_deliveries() {
    check("hostile_keyed_deliveries");
}
#[test]
fn refused_amid_failures() {
    check("refused_amid_failures");
}
#[test]
fn slow_claims() {
    check("slow_claims");
}
#[test]
fn slow_database() {
    check("slow_database");
}
#[test]
fn handler_blocked_on_a_lock() {
    check("handler_blocked_on_a_lock");
}
#[test]
fn deferred_constraint() {
    check("deferred_constraint");
}
#[test]
fn db_trouble_amid_batches() {
    check("db_trouble_amid_batches");
}
#[test]
fn swallowed_sql_error() {
    check("swallowed_sql_error");
}
#[test]
fn broker_node_crash() {
    check("broker_node_crash");
}
#[test]
fn broker_node_partition() {
    check("broker_node_partition");
}
#[test]
fn ordering_keys_consumer_swarm() {
    check("ordering_keys_consumer_swarm");
}
#[test]
fn ordering_keys_consumers() {
    check("ordering_keys_consumers");
}
#[test]
fn ordering_keys_handover() {
    check("ordering_keys_handover");
}
#[test]
fn ordering_keys_hot() {
    check("ordering_keys_hot");
}
#[test]
fn ordering_keys_many() {
    check("ordering_keys_many");
}
#[test]
fn ordering_keys_swarm() {
    check("ordering_keys_swarm");
}

/// The ordering scenarios reach what they are for on every pinned seed:
/// overlapping writers of one key wait on its lock, and a parked head is
/// skipped by the operator (ordering_keys_hot); keyed events are many and
/// spread over more keys than a key window holds (ordering_keys_many).
#[test]
fn the_ordering_scenarios_wait_on_key_locks_and_skip_parked_heads() {
    let s = Scenario::find(&scenarios_dir(), "ordering_keys_hot").expect("scenario loads");
    for &seed in s.pinned() {
        let events = run(&s, seed).trace.events();
        let waits = events
            .iter()
            .filter(|(_, e)| matches!(e, Event::LockWait { on, .. } if on == "event_outbox_key"))
            .count();
        let skipped = events
            .iter()
            .any(|(_, e)| matches!(e, Event::Skipped { ids } if !ids.is_empty()));
        assert!(
            waits > 0 && skipped,
            "seed {seed}: {waits} key-lock waits, skipped: {skipped}"
        );
    }
    let s = Scenario::find(&scenarios_dir(), "ordering_keys_consumers").expect("scenario loads");
    for &seed in s.pinned() {
        let events = run(&s, seed).trace.events();
        let held = events
            .iter()
            .filter(|(_, e)| matches!(e, Event::InboxHeld { .. }))
            .count();
        let deferred = events
            .iter()
            .filter(|(_, e)| {
                matches!(
                    e,
                    Event::Settled {
                        settle: sim::trace::Settle::Requeue,
                        ..
                    }
                )
            })
            .count();
        assert!(
            held > 0 && deferred > 0,
            "seed {seed}: {held} holds, {deferred} requeues"
        );
    }
    let s = Scenario::find(&scenarios_dir(), "ordering_keys_many").expect("scenario loads");
    for &seed in s.pinned() {
        let events = run(&s, seed).trace.events();
        let keys: BTreeSet<&str> = events
            .iter()
            .filter_map(|(_, e)| match e {
                Event::KeysNumbered { rows } => Some(rows.iter().map(|(_, k, _)| k.as_str())),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(keys.len() > 100, "seed {seed}: {} keys", keys.len());
    }
}

/// The cluster scenarios with the subscription forced to a classic queue
/// (what every subscription was before issue 26): what is routed to it
/// while its node is down or cut off is confirmed and dropped, and every
/// pinned seed fails on `lost`.
#[test]
fn a_classic_subscription_loses_events_in_the_cluster_scenarios() {
    for name in ["broker_node_crash", "broker_node_partition"] {
        let mut s = Scenario::find(&scenarios_dir(), name).expect("scenario loads");
        s.config.queue_type = Some("classic".into());
        for &seed in s.pinned() {
            let run = run(&s, seed);
            assert!(
                run.verdict
                    .violations
                    .iter()
                    .any(|v| v.invariant == sim::checker::Invariant::Lost),
                "{name} seed {seed} with a classic queue did not fail on lost: {:#?}",
                run.verdict.violations
            );
        }
    }
}
