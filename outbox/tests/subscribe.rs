//! The subscriber against the real local PostgreSQL and RabbitMQ: duplicates
//! take effect once, failed attempts are retried then dead-lettered into
//! `<queue>.dlq` with the attempts recorded, undecodable deliveries go to the
//! dead-letter queue at once, replay applies a dead-lettered event once, and
//! a queue the broker refuses to declare fails the subscriber at boot.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, unique};
use lapin::options::BasicGetOptions;
use outbox::core::ports::{InboxFilter, SubscriptionSpec};
use outbox::core::subscriber::{
    Handler, ReplayOutcome, Subscriber, SubscriberCounters, SubscriberSettings, SubscriberStats,
};
use outbox::pg::inbox::{PgInboxStore, PgTx};
use outbox::{EventEnvelope, HandlerError, LapinBroker, TokioClock};
use sqlx::PgPool;
use tokio::sync::watch;
use uuid::Uuid;

/// Writes one domain row per event it applies (no unique key: a second
/// application would show as a second row). Fails the first attempt of
/// every event when `fail_first`, every attempt when `always_fail`; after
/// writing, panics on `orders.panic` and never returns on `orders.stall`.
struct Effects {
    fail_first: bool,
    always_fail: Arc<Mutex<bool>>,
    seen: Mutex<BTreeSet<Uuid>>,
    /// How long each attempt takes.
    delay: Duration,
    /// Attempts begun.
    started: Arc<std::sync::atomic::AtomicU64>,
}

impl Handler<PgTx> for Effects {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        self.started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        match event.routing_key.as_str() {
            "orders.panic" => panic!("the handler cannot cope with {}", event.id),
            "orders.stall" => std::future::pending::<()>().await,
            _ => {}
        }
        if *self.always_fail.lock().unwrap() {
            return Err(HandlerError::msg("downstream refused the event"));
        }
        if self.fail_first && self.seen.lock().unwrap().insert(event.id) {
            return Err(HandlerError::msg("first attempt fails"));
        }
        Ok(())
    }
}

struct Running {
    pool: PgPool,
    queue: String,
    exchange: String,
    broker: Arc<LapinBroker>,
    subscriber: Arc<Subscriber<PgInboxStore, LapinBroker, TokioClock, Effects>>,
    counters: Arc<SubscriberCounters>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    always_fail: Arc<Mutex<bool>>,
    started: Arc<std::sync::atomic::AtomicU64>,
    /// Publishes without the subscriber's connection (which a test may cut).
    publisher: Arc<LapinBroker>,
}

#[derive(Default)]
struct Options {
    fail_first: bool,
    always_fail: bool,
    delay: Duration,
    /// The subscriber's broker URLs (a proxy's, comma-separated), if not
    /// the broker's own.
    amqp_url: Option<String>,
    /// The handler deadline, if not 30 s.
    handler_timeout: Option<Duration>,
    /// An exchange another subscription already uses, if not a new one.
    exchange: Option<String>,
}

async fn start(pool: PgPool, fail_first: bool, always_fail: bool) -> Running {
    start_with(
        pool,
        Options {
            fail_first,
            always_fail,
            ..Options::default()
        },
    )
    .await
}

async fn start_with(pool: PgPool, o: Options) -> Running {
    let (fail_first, always_fail) = (o.fail_first, o.always_fail);
    sqlx::query("CREATE TABLE IF NOT EXISTS effects (event_id UUID NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let queue = unique("sub");
    let exchange = o.exchange.clone().unwrap_or_else(|| unique("sub.x"));
    let broker = Arc::new(
        LapinBroker::from_list(&o.amqp_url.clone().unwrap_or_else(common::amqp_url)).unwrap(),
    );
    let always_fail = Arc::new(Mutex::new(always_fail));
    let started = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let handler = Arc::new(Effects {
        fail_first,
        always_fail: always_fail.clone(),
        seen: Mutex::default(),
        delay: o.delay,
        started: started.clone(),
    });
    let settings = SubscriberSettings {
        spec: SubscriptionSpec {
            queue: queue.clone(),
            exchange: exchange.clone(),
            bindings: vec!["orders.#".into()],
            prefetch: 16,
            queue_type: outbox::QueueType::Quorum,
            partitions: 0,
            partition: None,
        },
        concurrency: 4,
        max_attempts: 3,
        max_body_bytes: 64 * 1024,
        handler_timeout: o.handler_timeout.unwrap_or(Duration::from_secs(30)),
        batch_max: 4,
        batch_linger: Duration::from_millis(5),
    };
    let subscriber = Arc::new(Subscriber::new(
        Arc::new(PgInboxStore::new(pool.clone())),
        broker.clone(),
        Arc::new(TokioClock::default()),
        handler,
        settings,
    ));
    let counters = subscriber.counters();
    let (stop, rx) = watch::channel(false);
    let s = subscriber.clone();
    let task = tokio::spawn(async move { s.run(rx).await.unwrap() });
    // The queue exists once the subscriber has declared it.
    common::wait_for_queue(&queue).await;
    Running {
        pool,
        queue,
        exchange,
        broker,
        subscriber,
        counters,
        stop,
        task,
        always_fail,
        started,
        publisher: Arc::new(LapinBroker::new(common::amqp_url())),
    }
}

impl Running {
    /// Waits up to `secs` seconds for the counters to satisfy `done`.
    async fn until(&self, secs: u64, done: impl Fn(&SubscriberStats) -> bool) {
        common::until_counters(&self.counters, secs, done).await;
    }

    async fn publish(&self, routing_key: &str, message_id: Uuid, body: &[u8]) {
        common::publish_confirmed(
            &self.publisher,
            &self.exchange,
            routing_key,
            message_id,
            body,
        )
        .await;
    }

    async fn publish_envelope(&self, e: &EventEnvelope) {
        let body = e.encode(&Default::default()).unwrap();
        self.publish(&e.routing_key, e.id, body.as_bytes()).await;
    }

    async fn effects(&self, id: Uuid) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn inbox(&self, id: Uuid) -> Option<(bool, i32, bool)> {
        sqlx::query_as(
            "SELECT processed_at IS NOT NULL, attempts, dead_lettered_at IS NOT NULL \
             FROM event_inbox WHERE event_id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }

    async fn dlq_bodies(&self) -> Vec<Vec<u8>> {
        let conn = common::connect().await;
        let ch = conn.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(
                format!("{}.dlq", self.queue).as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            out.push(m.delivery.data.clone());
        }
        out
    }

    async fn stop(self) {
        self.stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("the subscriber stops within 15 s")
            .unwrap();
        common::delete_subscription(&common::connect().await, &self.queue, &self.exchange).await;
        self.broker.close().await;
        self.publisher.close().await;
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn duplicates_published_on_purpose_take_effect_once(pool: PgPool) {
    let r = start(pool, false, false).await;
    let e = EventEnvelope::new("orders.created", serde_json::json!({ "order": 1 }));
    // The same message twice (a republish after a lost mark looks exactly
    // like this to the consumer), and a second event.
    r.publish_envelope(&e).await;
    r.publish_envelope(&e).await;
    let other = EventEnvelope::new("orders.paid", serde_json::json!({ "order": 1 }));
    r.publish_envelope(&other).await;
    r.until(20, |s| s.processed + s.duplicates == 3).await;
    let s = r.counters.snapshot();
    assert_eq!((s.processed, s.duplicates), (2, 1), "{s:?}");
    assert_eq!(r.effects(e.id).await, 1);
    assert_eq!(r.effects(other.id).await, 1);
    assert_eq!(r.inbox(e.id).await, Some((true, 0, false)));
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_handler_failing_every_first_attempt_still_takes_effect_once(pool: PgPool) {
    let r = start(pool, true, false).await;
    let events: Vec<_> = (0..10)
        .map(|i| EventEnvelope::new("orders.created", serde_json::json!({ "order": i })))
        .collect();
    for e in &events {
        r.publish_envelope(e).await;
    }
    r.until(20, |s| s.processed == 10).await;
    assert_eq!(r.counters.snapshot().retried, 10);
    for e in &events {
        assert_eq!(r.effects(e.id).await, 1, "the failed attempt rolled back");
        assert_eq!(
            r.inbox(e.id).await,
            Some((true, 1, false)),
            "one attempt recorded"
        );
    }
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_permanently_failing_event_ends_in_the_dlq_after_max_attempts_and_replays_once(
    pool: PgPool,
) {
    let r = start(pool, false, true).await;
    let e = EventEnvelope::new("orders.created", serde_json::json!({ "order": 7 }));
    r.publish_envelope(&e).await;
    r.until(20, |s| s.dead_lettered == 1).await;
    assert_eq!(r.counters.snapshot().retried, 2);
    assert_eq!(r.effects(e.id).await, 0, "no failed attempt left an effect");
    assert_eq!(r.inbox(e.id).await, Some((false, 3, true)));
    let dlq = r.dlq_bodies().await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(EventEnvelope::decode(&dlq[0]).unwrap().id, e.id);

    // The downstream recovers; the operator replays the dead-lettered event.
    *r.always_fail.lock().unwrap() = false;
    let filter = InboxFilter {
        dead_lettered_only: true,
        ..InboxFilter::default()
    };
    let replayed = r.subscriber.replay(&filter).await.unwrap();
    assert_eq!(replayed, vec![(e.id, ReplayOutcome::Applied)]);
    assert_eq!(r.effects(e.id).await, 1);
    assert_eq!(r.inbox(e.id).await, Some((true, 0, false)));
    // A second replay finds nothing unprocessed.
    assert!(r.subscriber.replay(&filter).await.unwrap().is_empty());
    assert_eq!(r.effects(e.id).await, 1);
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_panicking_or_stalled_handler_counts_attempts_and_the_subscriber_goes_on(pool: PgPool) {
    let r = start_with(
        pool,
        Options {
            handler_timeout: Some(Duration::from_secs(1)),
            ..Options::default()
        },
    )
    .await;
    let panics = EventEnvelope::new("orders.panic", serde_json::json!({ "order": 1 }));
    let stalls = EventEnvelope::new("orders.stall", serde_json::json!({ "order": 2 }));
    let good = EventEnvelope::new("orders.created", serde_json::json!({ "order": 3 }));
    for e in [&panics, &stalls, &good] {
        r.publish_envelope(e).await;
    }
    r.until(30, |s| s.dead_lettered == 2 && s.processed == 1)
        .await;
    assert_eq!(r.counters.snapshot().retried, 4, "two retries each");
    for e in [&panics, &stalls] {
        assert_eq!(r.effects(e.id).await, 0, "every attempt rolled back");
        assert_eq!(r.inbox(e.id).await, Some((false, 3, true)));
    }
    assert_eq!(r.effects(good.id).await, 1);
    let error = |id: Uuid| {
        let pool = r.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT last_error FROM event_inbox WHERE event_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        error(panics.id).await,
        format!(
            "handler panicked: the handler cannot cope with {}",
            panics.id
        )
    );
    assert_eq!(
        error(stalls.id).await,
        "handler ran past its deadline of 1 s"
    );
    assert_eq!(r.dlq_bodies().await.len(), 2);
    // Still consuming.
    let after = EventEnvelope::new("orders.created", serde_json::json!({ "order": 4 }));
    r.publish_envelope(&after).await;
    r.until(20, |s| s.processed == 2).await;
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn one_event_bound_to_two_queues_takes_effect_once_in_each(pool: PgPool) {
    // Two subscriptions of one service (one database, one inbox) both
    // receive the event: each runs its handler once.
    let first = start(pool.clone(), false, false).await;
    let second = start_with(
        pool,
        Options {
            exchange: Some(first.exchange.clone()),
            ..Options::default()
        },
    )
    .await;
    let e = EventEnvelope::new("orders.created", serde_json::json!({ "order": 1 }));
    first.publish_envelope(&e).await;
    first.publish_envelope(&e).await;
    for r in [&first, &second] {
        r.until(20, |s| s.processed + s.duplicates == 2).await;
    }
    for r in [&first, &second] {
        let s = r.counters.snapshot();
        assert_eq!((s.processed, s.duplicates), (1, 1), "{}: {s:?}", r.queue);
    }
    assert_eq!(first.effects(e.id).await, 2, "one effect per subscription");
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT subscription FROM event_inbox \
         WHERE event_id = $1 AND processed_at IS NOT NULL ORDER BY subscription",
    )
    .bind(e.id)
    .fetch_all(&first.pool)
    .await
    .unwrap();
    let mut queues = vec![first.queue.clone(), second.queue.clone()];
    queues.sort();
    assert_eq!(rows, queues);
    second.stop().await;
    first.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_replay_cut_short_leaves_what_it_did_not_apply_dead_lettered(pool: PgPool) {
    let r = start_with(
        pool,
        Options {
            always_fail: true,
            delay: Duration::from_millis(300),
            ..Options::default()
        },
    )
    .await;
    let events: Vec<_> = (0..3)
        .map(|i| EventEnvelope::new("orders.created", serde_json::json!({ "order": i })))
        .collect();
    for e in &events {
        r.publish_envelope(e).await;
    }
    r.until(30, |s| s.dead_lettered == 3).await;
    *r.always_fail.lock().unwrap() = false;
    let filter = InboxFilter {
        dead_lettered_only: true,
        ..InboxFilter::default()
    };
    // The operator's request is dropped while the second row's handler runs.
    let cut = tokio::time::timeout(Duration::from_millis(450), r.subscriber.replay(&filter)).await;
    assert!(cut.is_err(), "the replay was cut short");
    let mut applied = 0;
    let mut still_dead = 0;
    for e in &events {
        match r.inbox(e.id).await {
            Some((true, 0, false)) => applied += 1,
            Some((false, 3, true)) => still_dead += 1,
            other => panic!(
                "{} is neither applied nor still dead-lettered: {other:?}",
                e.id
            ),
        }
    }
    // Usually (1, 2); a slow machine may cut the first row already.
    assert_eq!(applied + still_dead, 3);
    assert!(still_dead >= 2, "{still_dead} still dead-lettered");
    // The next replay finds the rest and applies each once.
    let replayed = r.subscriber.replay(&filter).await.unwrap();
    assert_eq!(replayed.len(), still_dead);
    for e in &events {
        assert_eq!(r.effects(e.id).await, 1);
        assert_eq!(r.inbox(e.id).await, Some((true, 0, false)));
    }
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn an_undecodable_delivery_goes_to_the_dlq_at_once(pool: PgPool) {
    let r = start(pool, false, false).await;
    let id = Uuid::now_v7();
    r.publish("orders.created", id, b"{not json").await;
    // An envelope with a NUL in its payload: PostgreSQL could never store it.
    let mut nul = EventEnvelope::new("orders.created", serde_json::json!({ "s": "a" }));
    nul.payload = serde_json::json!({ "s": "a\u{0}b" });
    let body = serde_json::to_vec(&nul).unwrap();
    r.publish("orders.created", nul.id, &body).await;
    let good = EventEnvelope::new("orders.created", serde_json::json!({ "order": 1 }));
    r.publish_envelope(&good).await;
    r.until(20, |s| s.undecodable == 2 && s.processed == 1)
        .await;
    assert_eq!(r.counters.snapshot().retried, 0, "never requeued");
    assert_eq!(r.dlq_bodies().await.len(), 2);
    assert_eq!(r.inbox(id).await, None);
    assert_eq!(r.inbox(nul.id).await, None);
    assert_eq!(r.effects(good.id).await, 1);
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_inbox_janitor_deletes_only_processed_rows_past_retention(pool: PgPool) {
    use outbox::core::janitor::{InboxJanitorSettings, sweep_inbox};
    // 0, 1: processed 8 days ago; 2: processed now; 3: unprocessed, received
    // 30 days ago; 4: dead-lettered 30 days ago.
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    for (i, (processed, received, dead)) in [
        (
            "now() - interval '8 days'",
            "now() - interval '9 days'",
            "NULL",
        ),
        (
            "now() - interval '8 days'",
            "now() - interval '9 days'",
            "NULL",
        ),
        ("now()", "now()", "NULL"),
        ("NULL", "now() - interval '30 days'", "NULL"),
        (
            "NULL",
            "now() - interval '30 days'",
            "now() - interval '30 days'",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO event_inbox (event_id, subscription, routing_key, payload, \
             processed_at, received_at, dead_lettered_at) \
             VALUES ($1, 'q', 'k', '{{}}', {processed}, {received}, {dead})"
        )))
        .bind(ids[i])
        .execute(&pool)
        .await
        .unwrap();
    }
    let store = PgInboxStore::new(pool.clone());
    let settings = InboxJanitorSettings {
        batch: 1,
        ..InboxJanitorSettings::default()
    };
    assert_eq!(sweep_inbox(&store, &settings).await.unwrap(), 2);
    let left: Vec<Uuid> = sqlx::query_scalar("SELECT event_id FROM event_inbox ORDER BY event_id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ids[2..].to_vec());
    // The spawned janitor sweeps at once and stops when told.
    let janitor = outbox::InboxDrainer::spawn(pool.clone()).unwrap();
    janitor.shutdown().await;
}

/// `POST /v1/admin/events/replay` with `body`, bearing `token`: the
/// answer's status and JSON.
async fn replay_route(
    router: &axum::Router,
    token: &str,
    body: String,
) -> (axum::http::StatusCode, serde_json::Value) {
    use axum::http::{Request, header};
    use tower::ServiceExt;
    let req = Request::builder()
        .method("POST")
        .uri("/v1/admin/events/replay")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from(body))
        .unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn replay_through_the_http_route_applies_a_dead_lettered_event_once(pool: PgPool) {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use outbox_admin::{AdminAuth, AdminRouter};
    use tower::ServiceExt;

    let r = start(pool, false, true).await;
    let e = EventEnvelope::new("orders.created", serde_json::json!({ "order": 9 }));
    r.publish_envelope(&e).await;
    r.until(20, |s| s.dead_lettered == 1).await;
    *r.always_fail.lock().unwrap() = false;
    let token = "replay-token-long-enough";
    let router = AdminRouter::new(AdminAuth::bearer(token).unwrap())
        .subscriber(r.subscriber.clone())
        .build();
    let replay = |body: String| replay_route(&router, token, body);
    let body = format!(r#"{{"ids":["{}"]}}"#, e.id);
    let (status, json) = replay(body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["results"][0]["event_id"], e.id.to_string());
    assert_eq!(json["results"][0]["subscription"], r.queue);
    assert_eq!(json["results"][0]["outcome"], "applied");
    assert_eq!(r.effects(e.id).await, 1);
    // Again: nothing unprocessed is left, nothing runs twice.
    let (status, json) = replay(body).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json["results"], serde_json::json!([]));
    assert_eq!(r.effects(e.id).await, 1);
    assert_eq!(
        router
            .clone()
            .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap()
            .status(),
        StatusCode::NOT_FOUND,
        "no exporter was given to this router"
    );
    r.stop().await;
}

/// Paging a limited replay over HTTP, as the README shows it: the same
/// request meets the rows that failed again (oldest first), and the
/// answer's `next` for the subscription, passed as `after`, goes on past
/// them until `more` is false; every row is met once.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_limited_replay_over_http_pages_by_its_answers_next(pool: PgPool) {
    use outbox_admin::{AdminAuth, AdminRouter};

    let r = start(pool, false, true).await;
    let events: Vec<EventEnvelope> = (0..5)
        .map(|i| EventEnvelope::new("orders.created", serde_json::json!({ "order": i })))
        .collect();
    for e in &events {
        r.publish_envelope(e).await;
    }
    r.until(30, |s| s.dead_lettered == 5).await;
    let token = "replay-token-long-enough";
    let router = AdminRouter::new(AdminAuth::bearer(token).unwrap())
        .subscriber(r.subscriber.clone())
        .build();
    let replay = |body: serde_json::Value| {
        let answer = replay_route(&router, token, body.to_string());
        async move {
            let (status, json) = answer.await;
            assert_eq!(status, axum::http::StatusCode::OK, "{json}");
            json
        }
    };
    let ids_of = |json: &serde_json::Value| -> Vec<String> {
        json["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["event_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let ask = serde_json::json!({
        "subscription": r.queue, "dead_lettered_only": true, "limit": 2,
    });
    let first = replay(ask.clone()).await;
    assert_eq!(first["more"], true);
    // The same request again meets the same rows: they failed again.
    assert_eq!(ids_of(&replay(ask.clone()).await), ids_of(&first));
    let mut met = ids_of(&first);
    let mut page = first;
    while page["more"] == true {
        let mut next = ask.clone();
        next["after"] = page["next"][&r.queue].clone();
        assert!(next["after"].is_object(), "{page}");
        page = replay(next).await;
        met.extend(ids_of(&page));
    }
    let mut want: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
    want.sort();
    met.sort();
    assert_eq!(met, want, "each row met once");
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn the_subscriber_resumes_after_its_broker_connection_is_cut(pool: PgPool) {
    let proxy = common::Proxy::start("127.0.0.1:5672").await;
    let r = start_with(
        pool,
        Options {
            amqp_url: Some(proxy.amqp_url()),
            ..Options::default()
        },
    )
    .await;
    let mut events = Vec::new();
    for i in 0..5 {
        let e = EventEnvelope::new("orders.created", serde_json::json!({ "i": i }));
        r.publish_envelope(&e).await;
        events.push(e);
    }
    r.until(20, |s| s.processed == 5).await;
    proxy.cut();
    for i in 5..10 {
        let e = EventEnvelope::new("orders.created", serde_json::json!({ "i": i }));
        r.publish_envelope(&e).await;
        events.push(e);
    }
    r.until(30, |s| s.processed == 10).await;
    for e in &events {
        assert_eq!(r.effects(e.id).await, 1);
    }
    r.stop().await;
}

/// A node that goes silent (its link stops without closing: a hung node, a
/// link dropping packets) is left within the heartbeat's bound: with two
/// links to the broker, the subscriber on the first applies again within
/// 30 s of it going silent, through the second, and nothing takes effect
/// twice. With the broker's default heartbeat (60 s, waited out twice) it
/// took two minutes.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_subscriber_leaves_a_silent_node_within_thirty_seconds(pool: PgPool) {
    let silent = common::Proxy::start("127.0.0.1:5672").await;
    let other = common::Proxy::start("127.0.0.1:5672").await;
    let r = start_with(
        pool,
        Options {
            amqp_url: Some(format!("{},{}", silent.amqp_url(), other.amqp_url())),
            ..Options::default()
        },
    )
    .await;
    let mut events = Vec::new();
    for i in 0..5 {
        let e = EventEnvelope::new("orders.created", serde_json::json!({ "i": i }));
        r.publish_envelope(&e).await;
        events.push(e);
    }
    r.until(20, |s| s.processed == 5).await;
    silent.hold();
    let went_silent = std::time::Instant::now();
    for i in 5..10 {
        let e = EventEnvelope::new("orders.created", serde_json::json!({ "i": i }));
        r.publish_envelope(&e).await;
        events.push(e);
    }
    r.until(30, |s| s.processed == 10).await;
    let took = went_silent.elapsed();
    eprintln!("applied again {took:?} after the node went silent");
    assert!(took < Duration::from_secs(30));
    for e in &events {
        assert_eq!(r.effects(e.id).await, 1);
    }
    r.stop().await;
    silent.pass();
}

/// A failure of the inbox's own statements that a retry cannot cure (here
/// a constraint of the inbox table refusing the insert, as a partition cut
/// left behind would) is retried in place, no attempt counted, and
/// readiness fails past `RETRY_IN_PLACE_GRACE` naming the subscription and
/// the cause; once the cause is gone the delivery takes effect once and
/// readiness is clear again.
#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn an_inbox_that_refuses_every_insert_fails_readiness_naming_the_cause(pool: PgPool) {
    let r = start(pool.clone(), false, false).await;
    sqlx::query(
        "ALTER TABLE event_inbox ADD CONSTRAINT no_blocked_events \
         CHECK (routing_key <> 'orders.blocked') NOT VALID",
    )
    .execute(&pool)
    .await
    .unwrap();
    let e = EventEnvelope::new("orders.blocked", serde_json::json!({ "n": 1 }));
    r.publish_envelope(&e).await;
    let started = std::time::Instant::now();
    let reasons = loop {
        let reasons = r.subscriber.readiness_reasons();
        if !reasons.is_empty() || started.elapsed() > Duration::from_secs(30) {
            break reasons;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let text: Vec<String> = reasons.iter().map(ToString::to_string).collect();
    assert!(
        text.iter().any(
            |t| t.starts_with(&format!("subscription {} has retried", r.queue))
                && t.contains("no_blocked_events")
        ),
        "{text:?}"
    );
    assert!(started.elapsed() >= outbox::core::subscriber::RETRY_IN_PLACE_GRACE);
    assert_eq!(r.inbox(e.id).await, None, "nothing committed, no attempt");
    sqlx::query("ALTER TABLE event_inbox DROP CONSTRAINT no_blocked_events")
        .execute(&pool)
        .await
        .unwrap();
    r.until(30, |s| s.processed == 1).await;
    assert_eq!(r.effects(e.id).await, 1);
    assert!(r.subscriber.readiness_reasons().is_empty());
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn shutdown_finishes_the_delivery_in_hand(pool: PgPool) {
    let r = start_with(
        pool,
        Options {
            delay: Duration::from_millis(800),
            ..Options::default()
        },
    )
    .await;
    let e = EventEnvelope::new("orders.created", serde_json::json!({ "slow": true }));
    r.publish_envelope(&e).await;
    let started = r.started.clone();
    eventually(Duration::from_secs(20), || {
        let n = started.load(std::sync::atomic::Ordering::SeqCst);
        async move { n == 1 }
    })
    .await;
    // Stop while the handler is mid-way: it completes, commits and acks.
    let counters = r.counters.clone();
    let id = e.id;
    let pool = r.pool.clone();
    r.stop().await;
    assert_eq!(counters.snapshot().processed, 1);
    let processed: bool =
        sqlx::query_scalar("SELECT processed_at IS NOT NULL FROM event_inbox WHERE event_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(processed);
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_republish_after_a_lost_mark_takes_effect_once(pool: PgPool) {
    let r = start(pool.clone(), false, false).await;
    let config = outbox::DrainerConfig::builder()
        .exchange(r.exchange.as_str())
        .replica_id("republish-test")
        .tick_ms(20)
        .build()
        .unwrap();
    let drainer =
        outbox::DrainerHandle::spawn(pool.clone(), LapinBroker::new(common::amqp_url()), config);
    let e = EventEnvelope::new("orders.created", serde_json::json!({ "order": 42 }));
    outbox::Publisher::new(pool.clone())
        .publish(&e)
        .await
        .unwrap();
    r.until(20, |s| s.processed == 1).await;
    // The drainer's mark is lost: the row looks unpublished again, so the
    // drainer publishes it a second time with the same message id.
    sqlx::query(
        "UPDATE event_outbox SET published_at = NULL, claimed_at = NULL, claimed_by = NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
    r.until(20, |s| s.duplicates == 1).await;
    assert_eq!(r.effects(e.id).await, 1);
    drainer.shutdown().await;
    r.stop().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_queue_that_exists_with_other_arguments_fails_at_boot_naming_it(pool: PgPool) {
    // Someone declared the queue without the dead-letter arguments: the
    // broker refuses the subscriber's declaration (PRECONDITION_FAILED),
    // and the first attempt is a setup error, not a retry loop.
    let (queue, exchange) = (unique("sub.clash"), unique("sub.clash.x"));
    let conn = common::connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await
    .unwrap();
    let broker = Arc::new(LapinBroker::new(common::amqp_url()));
    let subscriber = Subscriber::new(
        Arc::new(PgInboxStore::new(pool)),
        broker.clone(),
        Arc::new(TokioClock::default()),
        Arc::new(Effects {
            fail_first: false,
            always_fail: Arc::default(),
            seen: Mutex::default(),
            delay: Duration::ZERO,
            started: Arc::default(),
        }),
        SubscriberSettings {
            spec: SubscriptionSpec {
                queue: queue.clone(),
                exchange: exchange.clone(),
                bindings: vec!["orders.#".into()],
                prefetch: 4,
                queue_type: outbox::QueueType::Quorum,
                partitions: 0,
                partition: None,
            },
            concurrency: 1,
            max_attempts: 3,
            max_body_bytes: 64 * 1024,
            handler_timeout: Duration::from_secs(30),
            batch_max: 4,
            batch_linger: Duration::from_millis(5),
        },
    );
    let (_stop, rx) = watch::channel(false);
    let result = tokio::time::timeout(Duration::from_secs(30), subscriber.run(rx))
        .await
        .expect("a setup error ends the subscriber at once, without retrying");
    match result {
        Err(outbox::SubscribeError::Setup { queue: q, source }) => {
            assert_eq!(q, queue);
            assert!(
                matches!(source, outbox::BrokerError::Channel(_)),
                "{source:?}"
            );
            // The broker names the queue and the argument; the library
            // names the setting that chose it.
            let text = source.to_string();
            for part in [
                "PRECONDITION_FAILED",
                queue.as_str(),
                "inequivalent arg 'x-",
                "CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE=quorum",
            ] {
                assert!(text.contains(part), "{part:?} not in {text}");
            }
        }
        other => panic!("expected a setup error, got {other:?}"),
    }
    // Readiness says so at once, naming the subscription, for as long as
    // the service runs on without it.
    assert!(matches!(
        subscriber.state(),
        outbox::core::subscriber::SubscriptionState::Failed { .. }
    ));
    let subscriber = Arc::new(subscriber);
    let router = outbox_admin::AdminRouter::new(outbox_admin::AdminAuth::open_insecure())
        .subscriber(subscriber.clone())
        .build();
    let response = tower::ServiceExt::oneshot(
        router,
        axum::http::Request::builder()
            .uri("/readyz")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        response.status(),
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    );
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let reason = body["reasons"][0].as_str().unwrap_or_default();
    assert!(
        reason.starts_with(&format!("subscription {queue} is not consuming (failed"))
            && reason.contains("PRECONDITION_FAILED"),
        "{body}"
    );
    common::delete_subscription(&conn, &queue, &exchange).await;
    broker.close().await;
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_limited_replay_goes_on_past_rows_that_fail_again_and_says_when_nothing_is_left(
    pool: PgPool,
) {
    let r = start(pool, false, true).await;
    let events: Vec<EventEnvelope> = (0..3)
        .map(|i| EventEnvelope::new("orders.created", serde_json::json!({ "order": i })))
        .collect();
    for e in &events {
        r.publish_envelope(e).await;
    }
    r.until(30, |s| s.dead_lettered == 3).await;
    // The downstream is still broken: every replayed row fails again. Two
    // at a time, oldest first, `next` says where the rest begins (issue 25:
    // a filtered replay met the same failing rows again every time).
    let mut filter = InboxFilter {
        dead_lettered_only: true,
        limit: Some(2),
        ..InboxFilter::default()
    };
    let first = r.subscriber.replay_page(&filter).await.unwrap();
    assert_eq!(first.results.len(), 2);
    assert!(
        first
            .results
            .iter()
            .all(|(_, o)| matches!(o, ReplayOutcome::Failed { .. }))
    );
    let next = first.next.expect("a third row matches");
    filter.after = Some(next);
    let second = r.subscriber.replay_page(&filter).await.unwrap();
    let mut replayed: Vec<Uuid> = first
        .results
        .iter()
        .chain(&second.results)
        .map(|(id, _)| *id)
        .collect();
    replayed.sort();
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    assert_eq!(replayed, ids, "each row once");
    assert_eq!(second.next, None, "nothing more matches");
    // A limit of exactly what matches says nothing is left either.
    *r.always_fail.lock().unwrap() = false;
    let all = InboxFilter {
        dead_lettered_only: true,
        limit: Some(3),
        ..InboxFilter::default()
    };
    let page = r.subscriber.replay_page(&all).await.unwrap();
    assert_eq!(page.results.len(), 3);
    assert!(
        page.results
            .iter()
            .all(|(_, o)| *o == ReplayOutcome::Applied)
    );
    assert_eq!(page.next, None);
    for e in &events {
        assert_eq!(r.effects(e.id).await, 1);
    }
    r.stop().await;
}

#[tokio::test]
async fn a_classic_subscription_of_an_earlier_version_declares_as_classic_and_refuses_quorum() {
    // The queue as versions before quorum queues declared it: classic, no
    // x-queue-type, the dead-letter arguments only.
    let (queue, exchange) = (unique("sub.v0"), unique("sub.v0.x"));
    let conn = common::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = lapin::types::FieldTable::default();
    for (k, v) in [
        ("x-dead-letter-exchange", "canopy.dlq".to_owned()),
        ("x-dead-letter-routing-key", queue.clone()),
    ] {
        args.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
    }
    ch.queue_declare(
        queue.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    let settings = |kind| SubscriberSettings::new(queue.as_str(), &["orders.#"]).queue_type(kind);
    let mut classic = settings(outbox::QueueType::Classic);
    classic.spec.exchange = exchange.clone();
    let ch = conn.create_channel().await.unwrap();
    LapinBroker::declare_subscription(&ch, &classic.spec)
        .await
        .expect("an explicit x-queue-type classic is what the queue already is");
    let mut quorum = settings(outbox::QueueType::Quorum);
    quorum.spec.exchange = exchange.clone();
    let ch = conn.create_channel().await.unwrap();
    let e = LapinBroker::declare_subscription(&ch, &quorum.spec)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("PRECONDITION_FAILED") && e.contains("CANOPY_MQ_SUBSCRIBER_QUEUE_TYPE=quorum"),
        "{e}"
    );
    common::delete_subscription(&conn, &queue, &exchange).await;
}
