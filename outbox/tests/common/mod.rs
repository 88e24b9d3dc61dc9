//! Helpers shared by the tests that run against the real local services:
//! an independent lapin consumer, unique names, a TCP proxy that can cut or
//! black-hole the broker connection, and polling with a bound.

#![allow(dead_code)]

pub mod cluster;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The AMQP URL of the local broker (from `AMQP_URL`, see `.cargo/config.toml`).
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A name unique to this test process and call.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "test.{prefix}.{}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Connects to the broker or fails naming it and how to start it.
pub async fn connect() -> Connection {
    match Connection::connect(&amqp_url(), ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => panic!(
            "RabbitMQ is not reachable at {} ({e}); start it with `rabbitmq-server -detached`",
            outbox::amqp::redact_url(&amqp_url())
        ),
    }
}

/// One message as a plain consumer saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub message_id: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub persistent: bool,
    /// Its AMQP headers, as text (strings, and 64-bit integers in decimal).
    pub headers: std::collections::BTreeMap<String, String>,
}

/// A consumer independent of the drainer: its own connection, an exclusive
/// queue bound to `binding` on `exchange`, declared before anything is
/// published. Collects every delivery.
pub struct PlainConsumer {
    pub received: Arc<tokio::sync::Mutex<Vec<Received>>>,
    _conn: Connection,
}

impl PlainConsumer {
    pub async fn start(exchange: &str, binding: &str) -> Self {
        let conn = connect().await;
        let ch = conn.create_channel().await.unwrap();
        declare_exchange(&ch, exchange).await;
        let queue = unique("q");
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            queue.as_str().into(),
            exchange.into(),
            binding.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        let mut consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "plain".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let received = Arc::new(tokio::sync::Mutex::new(Vec::new()));
        let sink = received.clone();
        tokio::spawn(async move {
            use futures_lite::StreamExt;
            while let Some(Ok(d)) = consumer.next().await {
                let props = &d.properties;
                sink.lock().await.push(Received {
                    message_id: props
                        .message_id()
                        .as_ref()
                        .map(|s| s.as_str().to_owned())
                        .unwrap_or_default(),
                    routing_key: d.routing_key.as_str().to_owned(),
                    body: d.data.clone(),
                    persistent: *props.delivery_mode() == Some(2),
                    headers: props
                        .headers()
                        .iter()
                        .flat_map(|t| t.inner().iter())
                        .filter_map(|(k, v)| {
                            let text = match v {
                                AMQPValue::LongString(s) => s.to_string(),
                                AMQPValue::ShortString(s) => s.as_str().to_owned(),
                                AMQPValue::LongLongInt(n) => n.to_string(),
                                _ => return None,
                            };
                            Some((k.as_str().to_owned(), text))
                        })
                        .collect(),
                });
                let _ = d.ack(BasicAckOptions::default()).await;
            }
        });
        Self {
            received,
            _conn: conn,
        }
    }

    pub async fn snapshot(&self) -> Vec<Received> {
        self.received.lock().await.clone()
    }

    /// Waits (bounded) until at least `n` messages arrived.
    pub async fn wait_for(&self, n: usize, limit: Duration) -> Vec<Received> {
        let received = self.received.clone();
        eventually(limit, || {
            let received = received.clone();
            async move { received.lock().await.len() >= n }
        })
        .await;
        self.snapshot().await
    }
}

pub async fn declare_exchange(ch: &lapin::Channel, exchange: &str) {
    ch.exchange_declare(
        exchange.into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

/// Declares a queue that nacks everything routed to it: `x-max-length` 0
/// with `x-overflow` `reject-publish`. The broker deletes it two minutes
/// after its test stops using it (`x-expires`), so runs leave nothing behind.
pub async fn declare_rejecting_queue(conn: &Connection, exchange: &str, binding: &str) -> String {
    let ch = conn.create_channel().await.unwrap();
    declare_exchange(&ch, exchange).await;
    let queue = unique("reject");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    args.insert("x-expires".into(), AMQPValue::LongInt(120_000));
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            auto_delete: false,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.into(),
        binding.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    queue
}

pub async fn delete_queue(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(queue.into(), Default::default())
        .await
        .unwrap();
}

/// Deletes what a subscription declared: its queue, `<queue>.dlq`, and the
/// exchange it was bound to (the test's own).
pub async fn delete_subscription(conn: &Connection, queue: &str, exchange: &str) {
    delete_queue(conn, queue).await;
    delete_queue(conn, &format!("{queue}.dlq")).await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_delete(exchange.into(), Default::default())
        .await
        .unwrap();
}

/// Deletes what an ordered subscription declared (issue 27): its first
/// `spec.partitions` partition queues, `<queue>.route` and its alternate
/// exchange, then what [`delete_subscription`] deletes.
pub async fn delete_ordered_subscription(
    conn: &Connection,
    spec: &outbox::core::ports::SubscriptionSpec,
) {
    for p in 0..spec.partitions {
        delete_queue(conn, &spec.partition_queue(p)).await;
    }
    let ch = conn.create_channel().await.unwrap();
    for x in [spec.route_exchange(), spec.rest_exchange()] {
        ch.exchange_delete(x.as_str().into(), Default::default())
            .await
            .unwrap();
    }
    delete_subscription(conn, &spec.queue, &spec.exchange).await;
}

/// Polls `cond` every 20 ms until it holds; panics after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes `body` through the library's broker port on a confirming
/// channel of its own and waits for the broker's ack.
pub async fn publish_confirmed(
    publisher: &outbox::LapinBroker,
    exchange: &str,
    routing_key: &str,
    message_id: uuid::Uuid,
    body: &[u8],
) {
    use outbox::core::ports::{Broker, Confirm, OutgoingMessage, PublishChannel};
    let mut ch = publisher.channel_open().await.unwrap();
    ch.channel_confirm_select().await.unwrap();
    let confirm = ch
        .channel_publish(OutgoingMessage {
            exchange,
            routing_key,
            message_id,
            body,
            trace: None,
            ordering: None,
        })
        .await
        .unwrap();
    assert_eq!(confirm.await.unwrap(), Confirm::Ack);
}

/// Waits up to `secs` seconds for a subscriber's counters to satisfy
/// `done`.
pub async fn until_counters(
    counters: &outbox::core::subscriber::SubscriberCounters,
    secs: u64,
    done: impl Fn(&outbox::core::subscriber::SubscriberStats) -> bool,
) {
    eventually(Duration::from_secs(secs), || {
        let reached = done(&counters.snapshot());
        async move { reached }
    })
    .await;
}

/// What the proxy does with bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward both ways.
    Pass,
    /// Keep connections open but forward nothing (a black-hole).
    Hold,
}

/// A TCP proxy in front of the broker. `hold()` black-holes every connection
/// (bytes stop flowing, sockets stay open); `cut()` closes every current
/// connection; new connections are accepted in every mode.
pub struct Proxy {
    pub port: u16,
    mode: watch::Sender<ProxyMode>,
    cut: watch::Sender<u64>,
}

impl Proxy {
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mode, mode_rx) = watch::channel(ProxyMode::Pass);
        let (cut, cut_rx) = watch::channel(0u64);
        let upstream = upstream.to_owned();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let generation = *cut_rx.borrow();
                for (r, w) in [
                    (
                        Box::new(cr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(sw) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                    ),
                    (Box::new(sr), Box::new(cw)),
                ] {
                    tokio::spawn(pump(r, w, mode_rx.clone(), cut_rx.clone(), generation));
                }
            }
        });
        Self { port, mode, cut }
    }

    /// The broker URL through this proxy.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    pub fn hold(&self) {
        self.mode.send_replace(ProxyMode::Hold);
    }

    pub fn pass(&self) {
        self.mode.send_replace(ProxyMode::Pass);
    }

    pub fn cut(&self) {
        self.cut.send_modify(|g| *g += 1);
    }
}

async fn pump(
    mut r: Box<dyn tokio::io::AsyncRead + Unpin + Send>,
    mut w: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
    mut mode: watch::Receiver<ProxyMode>,
    mut cut: watch::Receiver<u64>,
    generation: u64,
) {
    // Clones start with the sender's whole history unseen; mark it seen so
    // only changes after this connection was accepted count.
    let generation = generation.max(*cut.borrow_and_update());
    mode.borrow_and_update();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // While held, read nothing and write nothing.
        while *mode.borrow() == ProxyMode::Hold {
            tokio::select! {
                _ = mode.changed() => {}
                _ = cut.changed() => {}
            }
            if *cut.borrow() != generation {
                return;
            }
        }
        let n = tokio::select! {
            n = r.read(&mut buf) => match n { Ok(0) | Err(_) => return, Ok(n) => n },
            _ = cut.changed() => return,
            _ = mode.changed() => continue,
        };
        if *cut.borrow() != generation {
            return;
        }
        // Bytes read just as a hold begins are delivered after it ends.
        while *mode.borrow() == ProxyMode::Hold {
            if mode.changed().await.is_err() {
                return;
            }
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits (bounded) until `queue` exists on the broker: a subscriber
/// declares its queue asynchronously, and a message published before that
/// is routed nowhere.
pub async fn wait_for_queue(queue: &str) {
    // A consumer, not only the queue: a subscriber declares the queue,
    // then binds it, then consumes, so the queue alone may not be bound
    // yet (a quorum queue's declaration takes long enough for a publish to
    // slip in between and be routed nowhere).
    let conn = connect().await;
    eventually(Duration::from_secs(10), || {
        let conn = &conn;
        async move { queue_counts(conn, queue).await.is_some_and(|(_, c)| c > 0) }
    })
    .await;
}

/// `queue`'s ready messages and consumers (a single-active-consumer queue
/// counts only its active one), as a passive declaration answers them;
/// `None` if there is no such queue.
pub async fn queue_counts(conn: &Connection, queue: &str) -> Option<(u32, u32)> {
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .ok()
    .map(|q| (q.message_count(), q.consumer_count()))
}
