//! The fake RabbitMQ: connections, channels, confirm mode, per-message
//! ack/nack, and one persistent queue bound to every routing key (the
//! checker's view of what the broker stored), served on the simulated
//! `rabbit` host. The queue is the "disk": it survives a crash of the host;
//! connections and channels do not.
//!
//! Faults (each survivable, and why):
//! - **black-hole** (the world holds the link between a drainer and
//!   `rabbit`): confirms never arrive; the Phase-2 deadline fires, claims are
//!   released without blame, the reconnect replaces the connection.
//! - **connection drop** (`drop_conn_prob` per publish): the broker closes the
//!   connection mid-batch, before or after storing the message; outstanding
//!   confirms fail, claims are released, stored messages are republished
//!   later (duplicates, never losses).
//! - **poison nack** (`nack_prefix`): every publish whose routing key starts
//!   with the prefix is nacked, as `reject-publish` does; the row is blamed,
//!   parks at the budget, and publishes once unparked and healed.
//! - **confirm delay** (`confirm_delay_ms`): confirms are held back; beyond
//!   the deadline this is a black-hole, below it a slow broker.
//! - **silent peer** (the world partitions a client from `rabbit`): both
//!   ends send heartbeats and close a connection silent past
//!   `wire::HEARTBEAT_TIMEOUT`, as AMQP does; a partitioned consumer's
//!   unacknowledged deliveries go back to the queue for the others, and the
//!   consumer reconnects after the heal. Without this a message delivered
//!   into a partition would sit unacknowledged forever.
//! - **duplicate delivery** (`duplicate_prob`): see [`queues`].
//! - **hostile messages** ([`MqState::inject_hostile`]): see [`hostile`].
//!
//! Queues, bindings, consumers and dead-lettering live in [`queues`].

pub mod hostile;
pub mod queues;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::envelope::ROUTING_KEY_MAX_BYTES;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

use crate::trace::{Event, FaultKind, HostileKind, Trace};
use crate::wire::{
    HEARTBEAT_EVERY, HEARTBEAT_TIMEOUT, MqReply, MqRequest, read_frame, write_frame,
};

/// The fake's port.
pub const MQ_PORT: u16 = 5672;

/// Fault settings, changed by the world while the simulation runs.
#[derive(Debug, Clone, Default)]
pub struct MqFaults {
    /// Routing-key prefix that the broker nacks.
    pub nack_prefix: Option<String>,
    /// Probability, per publish, that the broker drops the connection.
    pub drop_conn_prob: f64,
    /// Extra delay before each confirm is sent.
    pub confirm_delay_ms: u64,
    /// Probability, per delivery, that the broker also keeps a redelivered
    /// copy (see [`queues`]).
    pub duplicate_prob: f64,
}

/// A hostile message the broker put in a queue, kept until the end so the
/// world can tell when every one has settled.
#[derive(Debug, Clone)]
pub struct Injected {
    pub kind: HostileKind,
    pub queue: String,
    pub message_id: Option<String>,
    pub envelope_id: Option<Uuid>,
}

/// What the broker stored: every acked message, in order.
#[derive(Debug, Default)]
pub struct Stored {
    pub messages: Vec<(Uuid, String)>,
}

impl Stored {
    /// How many times each message id was stored.
    pub fn counts(&self) -> BTreeMap<Uuid, u32> {
        let mut m = BTreeMap::new();
        for (id, _) in &self.messages {
            *m.entry(*id).or_insert(0) += 1;
        }
        m
    }
}

/// Everything the fake shares with the world.
#[derive(Debug, Clone)]
pub struct MqState {
    pub stored: Arc<Mutex<Stored>>,
    pub faults: Arc<Mutex<MqFaults>>,
    /// Queues and consumers (the subscriber's side).
    pub queues: Arc<Mutex<queues::Queues>>,
    /// Hostile messages injected so far.
    pub injected: Arc<Mutex<Vec<Injected>>>,
    connections: Arc<Mutex<u64>>,
    rng: Arc<Mutex<SmallRng>>,
    /// Bumped to close every connection (`rabbitmqctl close_all_connections`).
    close_all: Arc<tokio::sync::watch::Sender<u64>>,
    trace: Trace,
}

impl MqState {
    /// A fresh broker with an empty queue.
    pub fn new(seed: u64, trace: Trace) -> Self {
        Self {
            stored: Arc::default(),
            faults: Arc::default(),
            queues: Arc::new(Mutex::new(queues::Queues::new(trace.clone()))),
            injected: Arc::default(),
            connections: Arc::default(),
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
            close_all: Arc::new(tokio::sync::watch::channel(0).0),
            trace,
        }
    }

    /// Closes every client connection, as `rabbitmqctl close_all_connections`
    /// does: clients see the connection end.
    pub fn close_all_connections(&self) {
        self.trace.now(Event::Fault {
            kind: FaultKind::MqDrop,
            detail: "broker closes every connection".into(),
        });
        self.close_all.send_modify(|g| *g += 1);
    }

    fn roll(&self, p: f64) -> bool {
        p > 0.0 && self.rng.lock().expect("rng").random_bool(p.min(1.0))
    }

    /// Puts a hostile message of one of `kinds` (drawn from the broker's
    /// RNG) in `queue`, as a foreign publisher on `exchange` would;
    /// `delivery_limit` is the subscribers' `max_body_bytes`.
    pub fn inject_hostile(
        &self,
        exchange: &str,
        queue: &str,
        kinds: &[HostileKind],
        delivery_limit: usize,
    ) {
        if kinds.is_empty() {
            return;
        }
        let h = {
            let mut rng = self.rng.lock().expect("rng");
            let kind = kinds[rng.random_range(0..kinds.len())];
            hostile::build(kind, &mut rng, delivery_limit)
        };
        self.trace.now(Event::Hostile {
            kind: h.kind,
            message_id: h.message.message_id.clone(),
            envelope_id: h.envelope_id,
        });
        self.injected.lock().expect("injected").push(Injected {
            kind: h.kind,
            queue: queue.to_owned(),
            message_id: h.message.message_id.clone(),
            envelope_id: h.envelope_id,
        });
        self.with_queues(|q| q.route(exchange, h.message));
    }

    /// Envelope ids of injected hostile messages that must take effect.
    pub fn hostile_applies(&self) -> Vec<Uuid> {
        self.injected
            .lock()
            .expect("injected")
            .iter()
            .filter(|h| h.kind.applies())
            .filter_map(|h| h.envelope_id)
            .collect()
    }

    /// Whether every hostile message that must be dead-lettered is in its
    /// queue's dead-letter queue (the world's quiescence).
    pub fn hostiles_dead_lettered(&self) -> bool {
        let injected = self.injected.lock().expect("injected");
        let queues = self.queues.lock().expect("queues");
        injected.iter().filter(|h| !h.kind.applies()).all(|h| {
            queues
                .ready(&format!("{}.dlq", h.queue))
                .iter()
                .any(|m| m.message_id == h.message_id)
        })
    }

    /// Runs `f` on the queues, then pushes what became deliverable.
    fn with_queues<T>(&self, f: impl FnOnce(&mut queues::Queues) -> T) -> T {
        let duplicate_prob = self.faults.lock().expect("faults").duplicate_prob;
        let mut queues = self.queues.lock().expect("queues");
        let out = f(&mut queues);
        queues.dispatch(crate::sim_now(), || self.roll(duplicate_prob));
        out
    }
}

/// Runs the server until the host crashes.
pub async fn serve(state: MqState) -> turmoil::Result {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", MQ_PORT)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(connection(state.clone(), stream));
    }
}

#[derive(Debug, Default)]
struct Channel {
    confirm: bool,
    seq: u64,
}

/// Frames to the client, each not before its instant.
type Frames = tokio::sync::mpsc::UnboundedSender<(Duration, MqReply)>;

/// One client connection, as the broker sees it.
struct Conn {
    state: MqState,
    id: u64,
    client: String,
    channels: BTreeMap<u32, Channel>,
    out: Frames,
}

/// What the broker does after a request.
enum Next {
    /// Answer (or not) and read the next request.
    Go(Option<MqReply>),
    /// Drop the connection.
    Close,
}

/// One publish, as it arrived.
struct Publish {
    channel: u32,
    exchange: String,
    routing_key: String,
    message_id: Uuid,
    body: crate::wire::WireBody,
    trace: Option<crate::wire::WireTrace>,
}

async fn connection(state: MqState, stream: turmoil::net::TcpStream) {
    let (mut r, w) = stream.into_split();
    let (out, writer) = spawn_writer(w);
    let heartbeat = spawn_heartbeat(out.clone());
    let id = {
        let mut n = state.connections.lock().expect("connections");
        *n += 1;
        *n
    };
    let mut close_all = state.close_all.subscribe();
    let mut conn = Conn {
        state: state.clone(),
        id,
        client: String::from("?"),
        channels: BTreeMap::new(),
        out,
    };
    loop {
        let next = tokio::select! {
            biased;
            _ = close_all.changed() => break,
            next = tokio::time::timeout(HEARTBEAT_TIMEOUT, read_frame::<_, MqRequest>(&mut r)) => match next {
                Ok(next) => next,
                Err(_) => {
                    state.trace.now(Event::Fault {
                        kind: FaultKind::HeartbeatTimeout,
                        detail: format!(
                            "broker closes {}'s connection: no heartbeat for {} s",
                            conn.client,
                            HEARTBEAT_TIMEOUT.as_secs()
                        ),
                    });
                    break;
                }
            },
        };
        let Ok(Some(req)) = next else { break };
        let now = crate::sim_now();
        match conn.handle(req, now) {
            Next::Go(Some(reply)) => {
                let _ = conn.out.send((now, reply));
            }
            Next::Go(None) => {}
            Next::Close => break,
        }
    }
    // The connection is gone: its consumers' deliveries go back.
    state.with_queues(|q| q.close(id, None));
    heartbeat.abort();
    writer.abort();
}

/// Writes frames on a task of its own, so a confirm delay holds back
/// confirms without holding back the reading of publishes.
fn spawn_writer(mut w: turmoil::net::tcp::OwnedWriteHalf) -> (Frames, tokio::task::JoinHandle<()>) {
    let (out, mut frames) = tokio::sync::mpsc::unbounded_channel::<(Duration, MqReply)>();
    let writer = tokio::spawn(async move {
        while let Some((not_before, frame)) = frames.recv().await {
            let now = crate::sim_now();
            if not_before > now {
                tokio::time::sleep(not_before - now).await;
            }
            if write_frame(&mut w, &frame).await.is_err() {
                return;
            }
        }
    });
    (out, writer)
}

/// Sends heartbeats while the connection lives.
fn spawn_heartbeat(out: Frames) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(HEARTBEAT_EVERY).await;
            if out.send((Duration::ZERO, MqReply::Heartbeat)).is_err() {
                return;
            }
        }
    })
}

impl Conn {
    /// An ack or nack of a tag the channel has not delivered, or has
    /// already settled: RabbitMQ closes the channel (its unacknowledged
    /// deliveries go back to their queues).
    fn unknown_tag(&mut self, channel: u32, tag: u64) -> MqReply {
        self.channels.remove(&channel);
        let conn = self.id;
        self.state.with_queues(|q| q.close(conn, Some(channel)));
        closed(
            channel,
            &format!("PRECONDITION_FAILED - unknown delivery tag {tag}"),
        )
    }

    /// Applies one request.
    fn handle(&mut self, req: MqRequest, now: Duration) -> Next {
        let (state, conn) = (&self.state, self.id);
        let reply = match req {
            MqRequest::Hello { client } => {
                self.client = client;
                None
            }
            MqRequest::Heartbeat => None,
            MqRequest::ChannelOpen { channel } => {
                self.channels.insert(channel, Channel::default());
                Some(MqReply::Ok { channel })
            }
            MqRequest::ConfirmSelect { channel } => match self.channels.get_mut(&channel) {
                Some(ch) => {
                    ch.confirm = true;
                    Some(MqReply::Ok { channel })
                }
                None => Some(closed(channel, "no such channel")),
            },
            MqRequest::ChannelClose { channel } => {
                self.channels.remove(&channel);
                state.with_queues(|q| q.close(conn, Some(channel)));
                None
            }
            MqRequest::DeclareSubscription {
                channel,
                queue,
                exchange,
                bindings,
            } => {
                state.with_queues(|q| q.declare_subscription(&queue, &exchange, &bindings));
                Some(MqReply::Ok { channel })
            }
            MqRequest::Qos { channel, prefetch } => {
                state.with_queues(|q| q.qos(conn, channel, prefetch));
                Some(MqReply::Ok { channel })
            }
            MqRequest::Consume { channel, queue } => {
                let (out, client) = (self.out.clone(), &self.client);
                if state.with_queues(|q| q.consume(conn, channel, client, &queue, out)) {
                    Some(MqReply::Ok { channel })
                } else {
                    Some(closed(channel, &format!("NOT_FOUND - no queue '{queue}'")))
                }
            }
            MqRequest::Ack {
                channel,
                tag,
                multiple,
            } => {
                if state.with_queues(|q| q.ack(conn, channel, tag, multiple)) {
                    None
                } else {
                    Some(self.unknown_tag(channel, tag))
                }
            }
            MqRequest::Nack {
                channel,
                tag,
                requeue,
            } => {
                if state.with_queues(|q| q.nack(conn, channel, tag, requeue)) {
                    None
                } else {
                    Some(self.unknown_tag(channel, tag))
                }
            }
            MqRequest::Publish {
                channel,
                exchange,
                routing_key,
                message_id,
                body,
                trace,
            } => {
                return self.publish(
                    Publish {
                        channel,
                        exchange,
                        routing_key,
                        message_id,
                        body,
                        trace,
                    },
                    now,
                );
            }
        };
        Next::Go(reply)
    }

    /// Stores and routes a publish (or nacks it, or drops the connection
    /// before or after storing it, as the faults say) and confirms it on a
    /// confirm-mode channel.
    fn publish(&mut self, p: Publish, now: Duration) -> Next {
        let state = &self.state;
        let faults = state.faults.lock().expect("faults").clone();
        let Some(ch) = self.channels.get_mut(&p.channel) else {
            return Next::Go(Some(closed(p.channel, "no such channel")));
        };
        ch.seq += 1;
        let seq = ch.seq;
        if p.routing_key.len() > ROUTING_KEY_MAX_BYTES {
            // Not encodable as an AMQP shortstr: the broker closes the
            // channel, failing every confirm outstanding on it.
            self.channels.remove(&p.channel);
            return Next::Go(Some(closed(p.channel, "routing key longer than 255 bytes")));
        }
        let client = &self.client;
        // A drop may come before or after the message is stored.
        if state.roll(faults.drop_conn_prob / 2.0) {
            state.trace.now(Event::Fault {
                kind: FaultKind::MqDrop,
                detail: format!("broker drops {client}'s connection before storing"),
            });
            return Next::Close;
        }
        let ack = !faults
            .nack_prefix
            .as_ref()
            .is_some_and(|prefix| p.routing_key.starts_with(prefix.as_str()));
        if ack {
            state
                .stored
                .lock()
                .expect("stored")
                .messages
                .push((p.message_id, p.routing_key.clone()));
            let message = queues::QueuedMessage {
                message_id: Some(p.message_id.to_string()),
                routing_key: p.routing_key.clone(),
                body: p.body,
                redelivered: false,
                trace: p.trace,
            };
            state.with_queues(|q| q.route(&p.exchange, message));
        } else {
            state.trace.now(Event::Fault {
                kind: FaultKind::MqNack,
                detail: format!("broker nacks {} ({})", p.message_id, p.routing_key),
            });
        }
        state.trace.now(Event::Confirmed {
            client: client.clone(),
            message_id: p.message_id,
            ack,
        });
        if state.roll(faults.drop_conn_prob / 2.0) {
            state.trace.now(Event::Fault {
                kind: FaultKind::MqDrop,
                detail: format!("broker drops {client}'s connection after storing"),
            });
            return Next::Close;
        }
        let confirm = self.channels.get(&p.channel).is_some_and(|c| c.confirm);
        if confirm {
            let at = now + Duration::from_millis(faults.confirm_delay_ms);
            let _ = self.out.send((
                at,
                MqReply::Confirm {
                    channel: p.channel,
                    seq,
                    ack,
                },
            ));
        }
        Next::Go(None)
    }
}

fn closed(channel: u32, reason: &str) -> MqReply {
    MqReply::ChannelClosed {
        channel,
        reason: reason.to_owned(),
    }
}
