//! The library on a real three-node RabbitMQ cluster (issue 26): nodes
//! rabbit1..3@localhost on AMQP ports 5681..5683, started by
//! `.ci/rabbit-cluster start` (`.ci/run` starts it). Each test stops and
//! restarts nodes (`rabbitmqctl stop_app` / `start_app`, as the `rabbitmq`
//! user), so the tests hold a file lock on the cluster one at a time, and a
//! guard restarts every node it stopped, even when the test fails.
//!
//! What RabbitMQ 3.10 sends a publisher in each case, measured here (and
//! stated as the drainer's rule in ARCHITECTURE.md): a classic queue whose
//! node is down drops what is routed to it and the publish is still
//! confirmed; a quorum queue keeps it; a queue full under `reject-publish`
//! nacks; a quorum queue without a majority neither acks nor nacks until
//! the majority is back.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::{Cluster, connect, node_url, queue_len};
use common::{eventually, unique};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation, Connection};
use outbox::core::drainer::Drainer;
use outbox::core::ports::Broker;
use outbox::runtime::OsEntropy;
use outbox::{
    DrainError, DrainerConfig, EventEnvelope, Handler, HandlerError, LapinBroker, PgInboxStore,
    PgOutboxStore, PgTx, Publisher, QueueType, Subscriber, SubscriberSettings, TokioClock,
};
use sqlx::PgPool;
use tokio::sync::watch;

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

async fn delete_queues(n: u16, queues: &[&str]) {
    let conn = connect(n).await;
    for q in queues {
        let ch = conn.create_channel().await.unwrap();
        let _ = ch.queue_delete((*q).into(), Default::default()).await;
    }
    let _ = conn.close(200, "OK".into()).await;
}

/// A confirm-mode channel on `conn`.
async fn confirming(conn: &Connection) -> lapin::Channel {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch
}

async fn publish(ch: &lapin::Channel, queue: &str) -> lapin::PublisherConfirm {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        b"m",
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .unwrap()
}

fn settings(queue: &str, exchange: &str, queue_type: QueueType) -> SubscriberSettings {
    let mut s = SubscriberSettings::new(queue, &["cluster.#"]).queue_type(queue_type);
    s.spec.exchange = exchange.to_owned();
    s.spec.prefetch = 16;
    s.concurrency = 2;
    s.batch_linger = Duration::from_millis(5);
    s
}

/// Declares a subscription's topology through the library on node `n`.
async fn declare(n: u16, settings: &SubscriberSettings) {
    let broker = LapinBroker::new(node_url(n));
    let conn = broker.connection().await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    LapinBroker::declare_subscription(&ch, &settings.spec)
        .await
        .unwrap();
    broker.close().await;
}

async fn write_events(pool: &PgPool, n: usize) -> Vec<EventEnvelope> {
    let publisher = Publisher::new(pool.clone());
    let mut out = Vec::new();
    for i in 0..n {
        let e = EventEnvelope::new("cluster.event", serde_json::json!({ "n": i }));
        publisher.publish(&e).await.unwrap();
        out.push(e);
    }
    out
}

type TestDrainer = Drainer<PgOutboxStore, LapinBroker, TokioClock, OsEntropy>;

fn drainer(pool: &PgPool, broker: Arc<LapinBroker>, exchange: &str) -> TestDrainer {
    Drainer::new(
        Arc::new(PgOutboxStore::new(pool.clone())),
        broker,
        Arc::new(TokioClock::default()),
        Arc::new(OsEntropy::default()),
        DrainerConfig::builder()
            .exchange(exchange)
            .replica_id("cluster")
            .build()
            .unwrap(),
    )
}

/// Drains until nothing is pending (bounded); a tick that fails (the
/// connection's node stopped) is retried, as the drain loop would.
async fn drain_all(d: &TestDrainer) {
    let started = Instant::now();
    loop {
        match d.tick().await {
            Ok(r) if r.claimed == 0 => return,
            Ok(_) => {}
            Err(e) => {
                assert!(
                    matches!(e, DrainError::Broker(_) | DrainError::ConfirmTimeout { .. }),
                    "{e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the outbox did not drain within 2 minutes"
        );
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn a_classic_queue_on_a_stopped_node_loses_confirmed_events_and_a_quorum_queue_keeps_them(
    pool: PgPool,
) {
    // The "Why", through the library: both subscriptions are
    // declared on node 3, node 3 stops, the drainer drains through node 1,
    // and every publish is confirmed and marked.
    let cluster = Cluster::hold().await;
    let exchange = unique("cluster.why.x");
    let quorum = settings(&unique("cluster.why.q"), &exchange, QueueType::Quorum);
    let classic = settings(&unique("cluster.why.c"), &exchange, QueueType::Classic);
    declare(3, &quorum).await;
    declare(3, &classic).await;
    let events = write_events(&pool, 200).await;
    {
        let _down = cluster.stop(3);
        let d = drainer(&pool, Arc::new(LapinBroker::new(node_url(1))), &exchange);
        drain_all(&d).await;
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(pending, 0, "every publish was confirmed and marked");
    }
    // Node 3 is back.
    let queues = |s: &SubscriberSettings| (s.spec.queue.clone(), s.spec.dlq_name());
    let ((q, q_dlq), (c, c_dlq)) = (queues(&quorum), queues(&classic));
    eventually(Duration::from_secs(20), || async {
        queue_len(3, &q).await == events.len() as u32
    })
    .await;
    assert_eq!(
        queue_len(3, &c).await,
        0,
        "RabbitMQ dropped what was routed to the classic queue while its node was down \
         (and confirmed it): if this fails, RabbitMQ changed, and the default's reason with it"
    );
    delete_queues(1, &[&q, &q_dlq, &c, &c_dlq]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_queue_nacks_and_a_quorum_queue_without_a_majority_neither_acks_nor_nacks() {
    let cluster = Cluster::hold().await;
    let conn = connect(1).await;
    // A full queue under reject-publish: basic.nack. (A quorum queue's
    // leader notices it is full a moment late, so the test fills it first
    // and asks on a fresh channel.)
    for kind in ["classic", "quorum"] {
        let queue = unique(&format!("cluster.full.{kind}"));
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(queue.as_str().into(), durable(), args)
            .await
            .unwrap();
        let filler = confirming(&conn).await;
        for _ in 0..3 {
            publish(&filler, &queue).await.await.unwrap();
        }
        let mut verdict = None;
        for _ in 0..50 {
            let ch = confirming(&conn).await;
            let confirm = publish(&ch, &queue).await.await.unwrap();
            if matches!(confirm, Confirmation::Nack(_)) {
                verdict = Some(confirm);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            matches!(verdict, Some(Confirmation::Nack(_))),
            "a full {kind} queue under reject-publish nacks"
        );
        delete_queues(1, &[&queue]).await;
    }

    // No majority: the confirm waits for it, neither ack nor nack.
    let queue = unique("cluster.nomajority");
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    conn.create_channel()
        .await
        .unwrap()
        .queue_declare(queue.as_str().into(), durable(), args)
        .await
        .unwrap();
    let ch = confirming(&conn).await;
    let down = (cluster.stop(2), cluster.stop(3));
    let mut confirm = publish(&ch, &queue).await;
    let early = tokio::time::timeout(Duration::from_secs(5), &mut confirm).await;
    assert!(
        early.is_err(),
        "without a majority the broker neither acks nor nacks: {early:?}"
    );
    drop(down);
    let late = tokio::time::timeout(Duration::from_secs(60), confirm)
        .await
        .expect("confirmed once the majority is back")
        .unwrap();
    assert!(late.is_ack(), "{late:?}");
    assert_eq!(queue_len(1, &queue).await, 1);
    delete_queues(1, &[&queue]).await;
}

/// A handler that records each event it applies, in its transaction.
struct Record;

impl Handler<PgTx> for Record {
    async fn handle(&self, tx: &mut PgTx, event: &EventEnvelope) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO cluster_effects (event_id) VALUES ($1)")
            .bind(event.id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[sqlx::test(migrator = "outbox::migrate::MIGRATOR")]
async fn drainer_and_subscriber_move_to_another_node_when_theirs_stops_and_lose_nothing(
    pool: PgPool,
) {
    let cluster = Cluster::hold().await;
    sqlx::query("CREATE TABLE cluster_effects (event_id UUID NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let exchange = unique("cluster.move.x");
    let settings = settings(&unique("cluster.move.q"), &exchange, QueueType::Quorum);
    let (queue, dlq) = (settings.spec.queue.clone(), settings.spec.dlq_name());
    // The drainer starts on node 1, the subscriber on node 3.
    let list = |nodes: &[u16]| {
        let urls: Vec<String> = nodes.iter().map(|n| node_url(*n)).collect();
        LapinBroker::from_list(&urls.join(",")).unwrap()
    };
    let drainer_broker = Arc::new(list(&[1, 2]));
    let d = drainer(&pool, drainer_broker.clone(), &exchange);
    declare(3, &settings).await;
    let subscriber_broker = Arc::new(list(&[3, 1]));
    let subscriber = Arc::new(Subscriber::new(
        Arc::new(PgInboxStore::new(pool.clone())),
        subscriber_broker.clone(),
        Arc::new(TokioClock::default()),
        Arc::new(Record),
        settings,
    ));
    let counters = subscriber.counters();
    let (stop, stopped) = watch::channel(false);
    let run = {
        let s = subscriber.clone();
        tokio::spawn(async move { s.run(stopped).await })
    };
    let processed = |n: u64| {
        let counters = counters.clone();
        async move {
            eventually(Duration::from_secs(60), || async {
                counters.snapshot().processed >= n
            })
            .await;
        }
    };
    let mut written = write_events(&pool, 100).await;
    drain_all(&d).await;
    processed(100).await;

    // The subscriber's node stops: it reopens on node 1. Then the
    // drainer's node stops: it moves on to node 2.
    for (node, moved) in [(3, &subscriber_broker), (1, &drainer_broker)] {
        let generation = moved.connection_generation();
        let _down = cluster.stop(node);
        written.extend(write_events(&pool, 100).await);
        drain_all(&d).await;
        processed(written.len() as u64).await;
        assert!(
            moved.connection_generation() > generation,
            "a new connection after rabbit{node} stopped"
        );
    }
    let _ = stop.send(true);
    run.await.unwrap().unwrap();
    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM cluster_effects")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (effects, distinct),
        (written.len() as i64, written.len() as i64)
    );
    delete_queues(2, &[&queue, &dlq]).await;
}

#[tokio::test]
async fn a_node_list_names_every_node_that_did_not_answer_and_never_a_password() {
    let broker = LapinBroker::from_list(
        "amqp://app:s3cr%2Ct@127.0.0.1:1/%2f, amqp://app:hunter2@127.0.0.1:2/%2f",
    )
    .unwrap();
    let e = broker.connection().await.unwrap_err().to_string();
    for part in [
        "amqp://app:***@127.0.0.1:1/%2f: ",
        "amqp://app:***@127.0.0.1:2/%2f: ",
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
    for secret in ["s3cr", "hunter2"] {
        assert!(!e.contains(secret), "{secret} in {e}");
    }
    let debug = format!("{broker:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    // A password with an unencoded comma splits its address: the error
    // shows neither half of it.
    let e = LapinBroker::from_list("amqp://app:pa,ss@127.0.0.1/%2f")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("CANOPY_MQ_AMQP_URLS="), "{e}");
    assert!(!e.contains("app:pa") && !e.contains("ss@"), "{e}");
}
