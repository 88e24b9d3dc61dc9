//! The independent observer: a durable catch-all queue bound to the
//! exchange before anything is published, read on a connection of its own
//! (plain lapin, straight to the broker, no proxy, none of the library's
//! code), acked one by one. It counts how often each `message_id` arrived
//! as a new message (a republish is one more); a broker redelivery of
//! something it already saw (its ack was lost with a connection) is counted
//! apart, not as a publish. Reconnects across broker restarts: the queue and
//! its persistent messages survive them. On a cluster it takes the node
//! list and reconnects to the first node that answers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::watch;
use uuid::Uuid;

/// What the observer saw.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    /// Arrivals as new messages, by envelope id (`message_id`).
    pub stored: BTreeMap<Uuid, u32>,
    /// Redeliveries of messages already counted.
    pub redelivered: u64,
    /// Messages whose `message_id` is no UUID (none expected).
    pub foreign: u64,
    /// New arrivals per whole second since the run's start.
    pub per_second: BTreeMap<u64, u64>,
    /// Each envelope id once, in the order it first arrived: one queue
    /// fed by every drainer, so one key's events arrive in the order
    /// they were published.
    pub first_arrivals: Vec<Uuid>,
}

/// Declares the exchange and the observer's durable queue bound to it
/// (before the producer starts, so nothing is routed past it).
/// On a cluster it is a quorum queue, which keeps what it confirmed when
/// a node goes.
pub async fn declare(
    amqp: &str,
    exchange: &str,
    queue: &str,
    queue_type: outbox::QueueType,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let conn = super::connect_any(amqp).await?;
    let ch = conn.create_channel().await?;
    crate::declare_catch_all(&ch, exchange, queue, queue_type).await?;
    let _ = conn.close(200, "OK".into()).await;
    Ok(())
}

/// Reads `queue` into `seen` until `stop` turns true, reconnecting after
/// any failure.
pub async fn observe(
    amqp: String,
    queue: String,
    seen: Arc<Mutex<Observed>>,
    start: Instant,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        let session = read(&amqp, &queue, &seen, start);
        tokio::select! {
            _ = stop.changed() => return,
            _ = session => {}
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// One connection's worth of reading; returns when it breaks.
async fn read(amqp: &str, queue: &str, seen: &Mutex<Observed>, start: Instant) -> Option<()> {
    let conn = super::connect_any(amqp).await.ok()?;
    let ch = conn.create_channel().await.ok()?;
    ch.basic_qos(1000, BasicQosOptions::default()).await.ok()?;
    let mut deliveries = ch
        .basic_consume(
            queue.into(),
            "chaos-observer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .ok()?;
    while let Some(Ok(d)) = deliveries.next().await {
        let id = d
            .properties
            .message_id()
            .as_ref()
            .and_then(|m| Uuid::parse_str(m.as_str()).ok());
        {
            let mut s = seen.lock().expect("observed");
            match id {
                None => s.foreign += 1,
                Some(id) if d.redelivered && s.stored.contains_key(&id) => s.redelivered += 1,
                Some(id) => {
                    let n = s.stored.entry(id).or_insert(0);
                    *n += 1;
                    if *n == 1 {
                        s.first_arrivals.push(id);
                    }
                    *s.per_second.entry(start.elapsed().as_secs()).or_insert(0) += 1;
                }
            }
        }
        if d.ack(BasicAckOptions::default()).await.is_err() {
            return None;
        }
    }
    None
}
