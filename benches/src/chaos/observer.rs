//! The independent observer: a durable catch-all queue bound to the
//! exchange before anything is published, read on a connection of its own
//! (plain lapin, straight to the broker, no proxy, none of the library's
//! code), acked one by one. It counts how often each `message_id` arrived
//! as a new message (a republish is one more); a broker redelivery of
//! something it already saw (its ack was lost with a connection) is counted
//! apart, not as a publish. Reconnects across broker restarts: the queue and
//! its persistent messages survive them. On a cluster it takes the node
//! list and reconnects to the first node that answers.
//!
//! A session never trusts lapin to notice its own end: every step (connect,
//! channel, consume, each ack) is bounded by [`STEP_TIMEOUT`], and after
//! [`IDLE_PROBE`] without a delivery the session asks the broker, on its own
//! channel, how many messages wait in the queue. A probe that finds
//! messages waiting though none arrived ends the session and a new one
//! starts. When the run ends, [`read_rest`] takes what is still in the
//! queue: the books close on what the broker stored, not on how far behind
//! the observer was. (A CI run once saw the observer go silent after a
//! RabbitMQ and a PostgreSQL restart while the subscriptions got every
//! event: 5 834 events judged lost that the broker had stored.)

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicQosOptions};
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
    /// Sessions (connections) the observer read through: 1 plus its
    /// reconnects.
    pub sessions: u64,
    /// Sessions ended by the idle probe or a step past [`STEP_TIMEOUT`]
    /// rather than by the broker closing them.
    pub wedged: u64,
}

/// How long one step of a session may take before the session counts as
/// wedged and is replaced.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a session waits for a delivery before it probes its queue.
pub const IDLE_PROBE: Duration = Duration::from_secs(3);

/// How a session ended.
enum End {
    /// The broker or the network closed it, or refused to open it.
    Closed,
    /// The run told the observer to stop.
    Stopped,
    /// A step hung, or the queue held messages the consumer did not get.
    Wedged,
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
    super::close(conn).await;
    Ok(())
}

/// Reads `queue` into `seen` until `stop` turns true, reconnecting after
/// any failure; a session open when `stop` turns closes its connection, so
/// what it had not acked goes back to the queue for [`read_rest`].
pub async fn observe(
    amqp: String,
    queue: String,
    seen: Arc<Mutex<Observed>>,
    start: Instant,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        match read(&amqp, &queue, &seen, start, &mut stop).await {
            End::Stopped => return,
            End::Wedged => seen.lock().expect("observed").wedged += 1,
            End::Closed => {}
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// One connection's worth of reading; returns when it breaks, wedges or
/// is stopped, its connection closed.
async fn read(
    amqp: &str,
    queue: &str,
    seen: &Mutex<Observed>,
    start: Instant,
    stop: &mut watch::Receiver<bool>,
) -> End {
    let Ok(Ok(conn)) = tokio::time::timeout(STEP_TIMEOUT, super::connect_any(amqp)).await else {
        return End::Closed;
    };
    seen.lock().expect("observed").sessions += 1;
    let end = tokio::select! {
        _ = stop.changed() => End::Stopped,
        end = consume(&conn, queue, seen, start) => end,
    };
    super::close(conn).await;
    end
}

/// Reads `queue` on a channel of `conn` until the session ends.
async fn consume(
    conn: &lapin::Connection,
    queue: &str,
    seen: &Mutex<Observed>,
    start: Instant,
) -> End {
    use tokio::time::timeout;
    let setup = async {
        let ch = conn.create_channel().await?;
        ch.basic_qos(1000, BasicQosOptions::default()).await?;
        let deliveries = ch
            .basic_consume(
                queue.into(),
                "chaos-observer".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok::<_, lapin::Error>((ch, deliveries))
    };
    let (ch, mut deliveries) = match timeout(STEP_TIMEOUT, setup).await {
        Ok(Ok(open)) => open,
        // Refused: a broker still starting (its queues not yet back).
        Ok(Err(_)) => return End::Closed,
        Err(_) => return wedged("its channel's setup hung", start),
    };
    loop {
        let d = match timeout(IDLE_PROBE, deliveries.next()).await {
            Ok(Some(Ok(d))) => d,
            Ok(_) => return End::Closed,
            Err(_idle) => match super::peek_queue(&ch, queue)
                .await
                .map(|q| q.message_count())
            {
                Some(0) => continue,
                // Messages wait, yet none came: the consumer is deaf.
                Some(n) => return wedged(&format!("{n} messages wait, none came"), start),
                // The channel failed: the broker is likely going down.
                None => return End::Closed,
            },
        };
        record(seen, &d, start);
        match timeout(STEP_TIMEOUT, d.ack(BasicAckOptions::default())).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return End::Closed,
            Err(_) => return wedged("an ack hung", start),
        }
    }
}

/// A wedged session, said in the run's output (when, and why) so a run
/// that needed a new session shows it.
fn wedged(why: &str, start: Instant) -> End {
    println!(
        "chaos: {:6.1} s  the observer's session wedged ({why}); reconnecting",
        start.elapsed().as_secs_f64()
    );
    End::Wedged
}

/// After the observer stopped: takes what is left in `queue` (what the
/// broker stored that the observer had not read, its unacked deliveries
/// included) with `basic.get` and counts it as the observer would have.
/// Returns how many messages it took.
pub async fn read_rest(
    amqp: &str,
    queue: &str,
    seen: &Mutex<Observed>,
    start: Instant,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    let conn = super::connect_any(amqp).await?;
    let ch = conn.create_channel().await?;
    let mut taken = 0;
    loop {
        let get = ch.basic_get(queue.into(), BasicGetOptions { no_ack: true });
        let Some(m) = tokio::time::timeout(STEP_TIMEOUT, get).await?? else {
            break;
        };
        record(seen, &m.delivery, start);
        taken += 1;
    }
    super::close(conn).await;
    Ok(taken)
}

/// Counts one delivery.
fn record(seen: &Mutex<Observed>, d: &lapin::message::Delivery, start: Instant) {
    let id = d
        .properties
        .message_id()
        .as_ref()
        .and_then(|m| Uuid::parse_str(m.as_str()).ok());
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
