//! The hosts of a run: drainer replicas (the production `Drainer` and its
//! outbox janitor), consumer replicas (the production `Subscriber` and its
//! inbox janitor; `consumer-1` also plays the operator who replays dead
//! letters after the heal), and the configuration each runs with: the
//! production defaults scaled to simulated seconds, then the scenario's
//! overrides.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use outbox::core::janitor::InboxJanitorSettings;
use outbox::core::ports::{InboxCursor, InboxFilter};
use outbox::core::subscriber::ReplayOutcome;
use outbox::{DrainerConfig, SubscriberSettings};
use uuid::Uuid;

use super::env::Env;
use super::{CONSUMER_QUEUE, EXCHANGE, REPLAY_EVERY};
use crate::adapters::{SimBroker, SimInboxStore, SimStore, TraceMarks};
use crate::engine::{Clock, Spawner};
use crate::fakes::pg::inbox::ListFilter;
use crate::scenario::Scenario;
use crate::trace::{Event, Replay, Trace};
use crate::workload::handler::SimHandler;

/// How often a drainer host asks its handle for readiness.
const READINESS_EVERY: Duration = Duration::from_secs(1);

/// The drainer configuration of `replica`.
pub fn drainer_config(s: &Scenario, replica: &str) -> DrainerConfig {
    let c = &s.config;
    DrainerConfig::builder()
        .replica_id(replica)
        .exchange(EXCHANGE)
        .tick_ms(c.tick_ms.unwrap_or(50))
        .batch_size(c.batch_size.unwrap_or(20))
        .pipeline_depth(c.pipeline_depth.unwrap_or(8))
        .lease_ttl_secs(c.lease_ttl_secs.unwrap_or(5))
        .confirm_timeout_secs(c.confirm_timeout_secs.unwrap_or(2))
        .max_attempts(c.max_attempts.unwrap_or(3))
        .max_rows_per_sec(c.max_rows_per_sec.unwrap_or(0))
        .retention(Duration::from_secs(c.retention_secs.unwrap_or(3)))
        .janitor_interval(Duration::from_secs(c.janitor_interval_secs.unwrap_or(2)))
        .janitor_batch(c.janitor_batch.unwrap_or(1000))
        .stats_interval(Duration::from_millis(c.stats_interval_ms.unwrap_or(1000)))
        .pending_warn(c.pending_warn.unwrap_or(10_000))
        .oldest_warn_secs(c.oldest_warn_secs.unwrap_or(900))
        .durable_standbys(durable_standbys(s))
        .build()
        .unwrap_or_else(|e| panic!("scenario {} has an invalid drainer config: {e}", s.name))
}

/// The standbys the durability gates wait for: the fake's one, if the
/// scenario turns them on.
pub fn durable_standbys(s: &Scenario) -> Vec<String> {
    match s.config.durable_standby {
        Some(true) => vec![crate::fakes::pg::standby::STANDBY.to_owned()],
        _ => Vec::new(),
    }
}

/// The subscriber settings every consumer host runs with.
pub fn subscriber_settings(s: &Scenario) -> SubscriberSettings {
    let c = &s.config;
    let mut settings = SubscriberSettings::new(CONSUMER_QUEUE, &["#"]);
    settings.spec.exchange = EXCHANGE.into();
    settings.spec.prefetch = c.consumer_prefetch.unwrap_or(8);
    settings.concurrency = c.consumer_concurrency.unwrap_or(2);
    settings.batch_max = c.consumer_batch_max.unwrap_or(4);
    settings.spec.partitions = c.consumer_partitions.unwrap_or(0);
    settings.batch_linger = Duration::from_millis(c.consumer_batch_linger_ms.unwrap_or(5));
    settings.max_attempts = c.consumer_max_attempts.unwrap_or(3);
    settings.max_body_bytes = c.consumer_max_body_bytes.unwrap_or(16 * 1024);
    // Stalled handlers (see `SimHandler`) are cut off after half a second,
    // short enough that stalls do not starve a scenario's consumers.
    settings.handler_timeout = std::time::Duration::from_millis(500);
    if let Some(kind) = &c.queue_type {
        let kind = kind
            .parse()
            .unwrap_or_else(|e| panic!("scenario {} has an invalid queue_type: {e}", s.name));
        settings = settings.queue_type(kind);
    }
    settings
        .validate()
        .unwrap_or_else(|e| panic!("scenario {} has invalid consumer settings: {e}", s.name));
    settings
}

/// The inbox janitor's settings on every consumer host.
pub fn inbox_janitor_settings(s: &Scenario) -> InboxJanitorSettings {
    let c = &s.config;
    InboxJanitorSettings {
        retention: Duration::from_secs(c.inbox_retention_secs.unwrap_or(30)),
        interval: Duration::from_secs(c.inbox_janitor_interval_secs.unwrap_or(3)),
        batch: 1000,
    }
}

/// Host `drainer-{i}`: each start is a new process with a new replica id
/// (`drainer-{i}#{n}`), as production's `drainer-{hostname}-{pid}-{uuid}`.
pub fn spawn_drainer(sim: &mut crate::engine::Sim, env: &Env, s: &Scenario, i: u32, seed: u64) {
    let host = format!("drainer-{i}");
    let hooks = env.hooks[(i - 1) as usize].1.clone();
    let trace = env.trace.clone();
    let scenario = s.clone();
    let incarnation = Arc::new(AtomicU32::new(0));
    let name = host.clone();
    let nodes = env.mq.node_hosts();
    sim.host(name.as_str(), move || {
        let n = incarnation.fetch_add(1, Ordering::SeqCst) + 1;
        let replica = format!("{host}#{n}");
        let config = drainer_config(&scenario, &replica);
        let store = SimStore::new(replica.clone(), trace.clone(), hooks.clone());
        let broker = SimBroker::new(replica.clone(), trace.clone(), hooks.clone())
            .with_nodes(nodes.clone(), (i - 1) as usize);
        let marks = TraceMarks::marks(replica.clone(), trace.clone());
        let entropy = outbox::runtime::SplitMix64::new(seed ^ u64::from(n));
        let replica_name = replica.clone();
        let readiness_trace = trace.clone();
        let wakeup = SimCommitWakeup {
            replica,
            trace: trace.clone(),
        };
        async move {
            // The library's own entry point, spawned tasks and all: the
            // drainer, the janitor, the stats task and the commit listener
            // (polling stays the fallback when notifications are lost).
            let ports = outbox::runtime::DrainerPorts {
                store,
                broker,
                clock: Clock::default(),
                entropy,
                wakeup,
                spawn: Spawner {},
                marks,
            };
            let handle = outbox::DrainerHandle::spawn_on(ports, config);
            // Runs until the host crashes or the simulation ends, asking
            // readiness every second as a `/readyz` probe would.
            loop {
                crate::engine::sleep(READINESS_EVERY).await;
                let r = handle.readiness();
                readiness_trace.now(Event::Readiness {
                    replica: replica_name.clone(),
                    ready: r.ready,
                    reasons: r.reasons.iter().map(ToString::to_string).collect(),
                });
            }
        }
    });
}

/// The commit wakeup over the fake PostgreSQL.
struct SimCommitWakeup {
    replica: String,
    trace: Trace,
}

impl outbox::core::ports::CommitWakeup for SimCommitWakeup {
    async fn listen(
        self,
        wakeup: Arc<tokio::sync::Notify>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        tokio::select! {
            _ = shutdown.changed() => {}
            () = crate::adapters::listen::listen_for_commits(self.replica, wakeup, self.trace) => {}
        }
    }
}

/// Host `consumer-{i}`: the production subscriber and inbox janitor on the
/// simulation adapters.
pub fn spawn_consumer(sim: &mut crate::engine::Sim, env: &Env, s: &Scenario, i: u32) {
    let host = format!("consumer-{i}");
    let hooks = env.hooks[(env.drainers + i - 1) as usize].1.clone();
    let trace = env.trace.clone();
    let settings = subscriber_settings(s);
    let janitor = inbox_janitor_settings(s);
    let standbys = durable_standbys(s);
    let transient = s.config.consumer_transient_one_in.unwrap_or(0);
    let (downstream, healed) = (env.downstream_broken.clone(), env.healed.clone());
    let domain_locked = env.domain_locked.clone();
    let pg = env.pg.clone();
    let incarnation = Arc::new(AtomicU32::new(0));
    let name = host.clone();
    let nodes = env.mq.node_hosts();
    // Consumer `i` starts from node K + 1 - i: consumer-1 from the last.
    let first = nodes.len() - 1 - (i as usize - 1) % nodes.len();
    sim.host(name.as_str(), move || {
        let n = incarnation.fetch_add(1, Ordering::SeqCst) + 1;
        let who = format!("{host}#{n}");
        let store =
            Arc::new(SimInboxStore::new(who.clone(), trace.clone()).with_hooks(hooks.clone()));
        let broker = Arc::new(
            SimBroker::new(who.clone(), trace.clone(), hooks.clone())
                .with_nodes(nodes.clone(), first),
        );
        let handler = Arc::new(
            SimHandler::new(CONSUMER_QUEUE, transient)
                .with_downstream(downstream.clone())
                .with_domain_lock(domain_locked.clone())
                .with_hooks(hooks.clone(), who.clone(), trace.clone()),
        );
        let marks = TraceMarks::marks(who.clone(), trace.clone());
        let mut subscriber = outbox::Subscriber::new(
            store.clone(),
            broker,
            Arc::new(Clock::default()),
            handler,
            settings.clone(),
        )
        .with_marks(marks.clone());
        if let Some(gate) = outbox::core::durability::DurableStandbys::new(standbys.clone()) {
            subscriber = subscriber.with_durable_standbys(Arc::new(gate));
        }
        let subscriber = Arc::new(subscriber);
        let operator = (i == 1).then(|| (healed.clone(), pg.clone(), trace.clone(), who.clone()));
        async move {
            let (_keep, rx) = tokio::sync::watch::channel(false);
            tokio::spawn(outbox::core::janitor::run_inbox(
                store,
                Arc::new(Clock::default()),
                janitor,
                rx.clone(),
                marks,
            ));
            if let Some((healed, pg, trace, who)) = operator {
                tokio::spawn(operate(subscriber.clone(), healed, pg, trace, who));
            }
            subscriber
                .run(rx)
                .await
                .map_err(|e| -> Box<dyn std::error::Error> { e.to_string().into() })?;
            Ok(())
        }
    });
}

type SimSubscriber = outbox::Subscriber<SimInboxStore, SimBroker, Clock, SimHandler>;

/// The operator: after the heal, replays every few seconds, asking in turn
/// for (0) a page of dead-lettered rows, three at a time, each page going
/// on after the last (`after`, from the previous page's `next`); (1) by
/// ids: the two oldest dead-lettered rows, a processed one and one the
/// inbox never held; (2) up to five unprocessed `poison.` rows, dead-lettered
/// or not. Each replay records what it asked for and what matched then (the
/// checker's `replay_exact`), and what each row came to.
async fn operate(
    subscriber: Arc<SimSubscriber>,
    healed: Arc<std::sync::atomic::AtomicBool>,
    pg: crate::fakes::pg::PgState,
    trace: Trace,
    who: String,
) {
    let mut after: Option<InboxCursor> = None;
    for round in 0u64.. {
        crate::engine::sleep(REPLAY_EVERY).await;
        if !healed.load(Ordering::SeqCst) {
            continue;
        }
        let filter = ask(round, after, &pg);
        let fake = ListFilter {
            ids: filter.ids.clone(),
            subscription: Some(CONSUMER_QUEUE.to_owned()),
            routing_key: filter.routing_key.clone(),
            dead_lettered_only: filter.dead_lettered_only,
            after: filter.after.map(|c| (ms_of(c.received_at), c.event_id)),
            payload_field: None,
        };
        let limit = filter
            .limit
            .unwrap_or(outbox::core::ports::LIST_LIMIT_DEFAULT);
        trace.now(Event::ReplayStarted {
            client: who.clone(),
            ask: format!("{filter:?}"),
            ids: filter.ids.clone(),
            limit,
            matching: pg.lock().inbox.matching(&fake),
        });
        let page = subscriber.replay_page(&filter).await;
        trace.now(Event::ReplayEnded {
            client: who.clone(),
            ok: page.is_ok(),
            more: page.as_ref().is_ok_and(|p| p.next.is_some()),
            next: page
                .as_ref()
                .ok()
                .and_then(|p| p.next.as_ref())
                .map(|c| c.event_id),
        });
        let Ok(page) = page else { continue };
        if round % 3 == 0 {
            after = page.next;
        }
        // What no replay can apply (a record of a keyed delivery given up
        // on) the operator skips, so that its key goes on.
        let unreadable: Vec<Uuid> = page
            .results
            .iter()
            .filter(|(_, o)| matches!(o, ReplayOutcome::Undecodable { .. }))
            .map(|(id, _)| *id)
            .collect();
        record_page(&trace, &who, page);
        if !unreadable.is_empty()
            && let Ok(skipped) = subscriber.skip(&unreadable).await
        {
            // The skips themselves are the fake's `InboxSkipped`.
            let released = outbox::admin::ReplayPage {
                results: Vec::new(),
                ..skipped
            };
            record_page(&trace, &who, released);
        }
    }
}

/// The trace's record of what a replay or a skip did to each row.
fn record_page(trace: &Trace, who: &str, page: outbox::admin::ReplayPage) {
    for (event_id, outcome) in page.results {
        trace.now(Event::Replayed {
            client: who.to_owned(),
            event_id,
            outcome: replay_of(&outcome),
        });
    }
    for (event_id, outcome) in page.released {
        trace.now(Event::ReplayReleased {
            client: who.to_owned(),
            event_id,
            outcome: replay_of(&outcome),
        });
    }
}

/// A replay outcome as the trace records it.
fn replay_of(outcome: &ReplayOutcome) -> Replay {
    match outcome {
        ReplayOutcome::Applied => Replay::Applied,
        ReplayOutcome::AlreadyProcessed => Replay::AlreadyProcessed,
        ReplayOutcome::Failed { .. } => Replay::Failed,
        ReplayOutcome::Undecodable { .. } => Replay::Undecodable,
        ReplayOutcome::Held => Replay::Held,
        ReplayOutcome::Skipped => Replay::Skipped,
    }
}

/// The operator's ask of round `round` (see [`operate`]).
fn ask(round: u64, after: Option<InboxCursor>, pg: &crate::fakes::pg::PgState) -> InboxFilter {
    match round % 3 {
        0 => InboxFilter {
            dead_lettered_only: true,
            limit: Some(3),
            after,
            ..Default::default()
        },
        1 => {
            let db = pg.lock();
            let dead = db.inbox.matching(&ListFilter {
                subscription: Some(CONSUMER_QUEUE.to_owned()),
                dead_lettered_only: true,
                ..Default::default()
            });
            let processed = db
                .inbox
                .rows()
                .find(|r| r.processed_ms.is_some())
                .map(|r| r.event_id);
            let never = uuid::Uuid::from_u128(0x0000_0000_0000_7000_8000_0000_0000_0001);
            let ids = dead
                .into_iter()
                .take(2)
                .chain(processed)
                .chain([never])
                .collect();
            InboxFilter {
                ids: Some(ids),
                ..Default::default()
            }
        }
        _ => InboxFilter {
            routing_key: Some("poison.event".into()),
            limit: Some(5),
            ..Default::default()
        },
    }
}

/// The fake's milliseconds of a time the sim adapter made from them.
fn ms_of(t: time::OffsetDateTime) -> u64 {
    u64::try_from((t - time::OffsetDateTime::UNIX_EPOCH).whole_milliseconds()).unwrap_or(0)
}
