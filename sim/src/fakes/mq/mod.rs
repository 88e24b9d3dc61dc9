//! The fake RabbitMQ: connections, channels, confirm mode, per-message
//! ack/nack, and one persistent queue bound to every routing key (the
//! checker's view of what the broker stored). It is a state machine: each
//! connection ([`Conn`]) takes one request at a time with the simulated
//! time it arrived and answers with frames, each not before an instant it
//! names (confirms held back by a delay, deliveries pushed by the queues),
//! and never touches a network, a runtime or a clock; [`serve`] is its
//! transport, the simulated `rabbit` host of either engine, with AMQP's
//! heartbeats. The queue is the "disk": it survives a crash of the host;
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
//! - **queue full** (`nack_prefix`): while the fault lasts, every publish
//!   whose routing key starts with the prefix is nacked, as a queue full
//!   under `reject-publish` does; the row is blameless (released, its
//!   attempts untouched, the drainer backs off) and publishes once the
//!   queue has room again.
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
//! - **a node goes down, is cut off, or its queues elect a leader** (the
//!   world crashes a node's host, isolates it, or blocks elections): see
//!   [`queues`] for what a cluster does with each queue type. Publishers
//!   and consumers reconnect to another node of their list.
//!
//! Queues, bindings, consumers, dead-lettering and the cluster live in
//! [`queues`].

pub mod hostile;
pub mod queues;
pub mod serve;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::envelope::ROUTING_KEY_MAX_BYTES;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

use crate::trace::{Event, FaultKind, HostileKind, Trace};
use crate::wire::{MqReply, MqRequest};

pub use self::serve::{MQ_PORT, serve, serve_node};

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
    /// Its foreign ordering key and number, if it carries one.
    pub ordering: Option<crate::wire::WireOrdering>,
}

/// Where hostile messages go, and how.
#[derive(Debug, Clone, Copy)]
pub struct HostileTarget<'a> {
    pub exchange: &'a str,
    pub queue: &'a str,
    /// The subscribers' `max_body_bytes`.
    pub delivery_limit: usize,
    /// The share of messages that carry a foreign ordering key.
    pub keyed: f64,
}

/// The ordering keys a foreign publisher's keyed hostile messages carry
/// (no producer of the simulation writes them).
pub const FOREIGN_KEYS: [&str; 3] = ["foreign-a", "foreign-b", "foreign-c"];

/// What the broker stored: every acked message it kept, in order (one a
/// classic queue out of reach dropped is acked, and not kept).
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
    close_all: Arc<super::Signal>,
    /// Per node, bumped when it goes down: its connections close.
    node_down: Arc<Vec<Arc<super::Signal>>>,
    trace: Trace,
}

impl MqState {
    /// A fresh single-node broker with no queue.
    pub fn new(seed: u64, trace: Trace) -> Self {
        Self::cluster(seed, trace, 1)
    }

    /// A fresh cluster of `nodes` nodes (served as [`node_hosts`](Self::node_hosts)).
    pub fn cluster(seed: u64, trace: Trace, nodes: usize) -> Self {
        Self {
            stored: Arc::default(),
            faults: Arc::default(),
            queues: Arc::new(Mutex::new(queues::Queues::new(trace.clone(), nodes))),
            injected: Arc::default(),
            connections: Arc::default(),
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
            close_all: Arc::default(),
            node_down: Arc::new((0..nodes.max(1)).map(|_| Arc::default()).collect()),
            trace,
        }
    }

    /// The simulated hosts of its nodes: `rabbit` for one node, else
    /// `rabbit-1`, `rabbit-2`, ….
    pub fn node_hosts(&self) -> Vec<String> {
        node_hosts(self.queues.lock().expect("queues").node_count())
    }

    /// Node `node` (0-based) goes down or comes back up, as its host's
    /// crash and restart, or `rabbitmqctl stop_app` and `start_app`, do: a
    /// node that goes down closes every connection to it and refuses new
    /// ones until it is up.
    pub fn set_node_up(&self, node: usize, up: bool, now: Duration) {
        if !up {
            self.trace.now(Event::Fault {
                kind: FaultKind::NodeCrash,
                detail: format!("broker node {} goes down", node + 1),
            });
        }
        self.with_queues(now, |q| q.set_node_up(node, up));
        if !up {
            self.node_down[node].bump();
        }
    }

    /// Whether node `node` is up.
    pub fn node_is_up(&self, node: usize) -> bool {
        self.queues.lock().expect("queues").node_is_up(node)
    }

    /// Changes each time node `node` goes down.
    pub fn node_down_signal(&self, node: usize) -> super::Watcher {
        self.node_down[node].watch()
    }

    /// Node `node` is cut off from the other nodes, or joins them again.
    pub fn set_node_isolated(&self, node: usize, isolated: bool, now: Duration) {
        self.with_queues(now, |q| q.set_node_isolated(node, isolated));
    }

    /// Holds back (or lets go) every quorum queue's leader election, its
    /// leaders stepping down as the hold starts.
    pub fn block_elections(&self, blocked: bool, now: Duration) {
        self.with_queues(now, |q| q.block_elections(blocked, now));
    }

    /// Elects what is due and stores what waited for it.
    pub fn tick(&self, now: Duration) {
        self.with_queues(now, |_| ());
    }

    /// Closes every client connection, as `rabbitmqctl close_all_connections`
    /// does: clients see the connection end.
    pub fn close_all_connections(&self) {
        self.trace.now(Event::Fault {
            kind: FaultKind::MqDrop,
            detail: "broker closes every connection".into(),
        });
        self.close_all.bump();
    }

    fn roll(&self, p: f64) -> bool {
        p > 0.0 && self.rng.lock().expect("rng").random_bool(p.min(1.0))
    }

    /// Puts a hostile message of one of `kinds` (drawn from the broker's
    /// RNG) in `to.queue`, as a foreign publisher on `to.exchange` would.
    /// A share `to.keyed` of them carry one of [`FOREIGN_KEYS`] and its
    /// next number (no draw when the share is 0).
    pub fn inject_hostile(&self, to: &HostileTarget<'_>, kinds: &[HostileKind]) {
        if kinds.is_empty() {
            return;
        }
        let mut injected = self.injected.lock().expect("injected");
        let h = {
            let mut rng = self.rng.lock().expect("rng");
            let kind = kinds[rng.random_range(0..kinds.len())];
            let ordering = (to.keyed > 0.0 && rng.random_bool(to.keyed.min(1.0))).then(|| {
                let key = FOREIGN_KEYS[rng.random_range(0..FOREIGN_KEYS.len())];
                let seq = injected
                    .iter()
                    .filter(|h| h.ordering.as_ref().is_some_and(|(k, _)| k == key))
                    .count() as i64
                    + 1;
                (key.to_owned(), seq)
            });
            hostile::build(kind, &mut rng, to.delivery_limit, ordering)
        };
        self.trace.now(Event::Hostile {
            kind: h.kind,
            message_id: h.message.message_id.clone(),
            envelope_id: h.envelope_id,
            ordering: h.message.ordering.clone(),
        });
        injected.push(Injected {
            kind: h.kind,
            queue: to.queue.to_owned(),
            message_id: h.message.message_id.clone(),
            envelope_id: h.envelope_id,
            ordering: h.message.ordering.clone(),
        });
        drop(injected);
        self.with_queues(crate::sim_now(), |q| q.inject(to.exchange, h.message));
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

    /// The ids the records of keyed hostile messages the subscriber must
    /// give up on take (their `message_id`s, each a UUID).
    pub fn given_up(&self) -> Vec<Uuid> {
        self.injected
            .lock()
            .expect("injected")
            .iter()
            .filter(|h| h.ordering.is_some() && !h.kind.applies())
            .filter_map(|h| h.message_id.as_deref())
            .filter_map(|m| Uuid::parse_str(m).ok())
            .collect()
    }

    /// Whether every unkeyed hostile message that must be dead-lettered is
    /// in its queue's dead-letter queue (the world's quiescence). A keyed
    /// one may be held in the inbox instead (acked): its record there, not
    /// the dead-letter queue, is what the checker asks of it.
    pub fn hostiles_dead_lettered(&self) -> bool {
        let injected = self.injected.lock().expect("injected");
        let queues = self.queues.lock().expect("queues");
        let unkeyed = injected.iter().filter(|h| h.ordering.is_none());
        unkeyed.filter(|h| !h.kind.applies()).all(|h| {
            queues
                .ready(&format!("{}.dlq", h.queue))
                .iter()
                .any(|m| m.message_id == h.message_id)
        })
    }

    /// Runs `f` on the queues, runs the elections that are due, confirms
    /// the publishes that waited for them, then pushes what became
    /// deliverable at `now`.
    fn with_queues<T>(&self, now: Duration, f: impl FnOnce(&mut queues::Queues) -> T) -> T {
        let duplicate_prob = self.faults.lock().expect("faults").duplicate_prob;
        let mut queues = self.queues.lock().expect("queues");
        let out = f(&mut queues);
        for held in queues.elect(now) {
            self.confirm_held(held.confirm, now);
        }
        queues.dispatch(now, || self.roll(duplicate_prob));
        out
    }

    /// A publish that waited for quorum queues is now in every one of
    /// them: stored, and confirmed to its channel if it is still there.
    fn confirm_held(&self, c: queues::HeldConfirm, now: Duration) {
        self.stored
            .lock()
            .expect("stored")
            .messages
            .push((c.message_id, c.routing_key.clone()));
        self.trace.now(Event::Confirmed {
            client: c.client,
            message_id: c.message_id,
            ack: true,
        });
        if let Some(out) = c.out {
            let confirm = MqReply::Confirm {
                channel: c.channel,
                seq: c.seq,
                ack: true,
            };
            let _ = out.send((now + c.delay, confirm));
        }
    }

    /// A new client connection on node `node`, numbered in the order they
    /// opened, whose frames go to `out`.
    pub fn open_connection(&self, out: Frames, node: usize) -> Conn {
        let id = {
            let mut n = self.connections.lock().expect("connections");
            *n += 1;
            *n
        };
        self.queues
            .lock()
            .expect("queues")
            .connection_opened(id, node);
        Conn {
            state: self.clone(),
            node,
            id,
            client: String::from("?"),
            channels: BTreeMap::new(),
            out,
        }
    }

    /// Changes at each `close_all_connections`: every connection closes.
    pub fn close_all_signal(&self) -> super::Watcher {
        self.close_all.watch()
    }
}

#[derive(Debug, Default)]
struct Channel {
    confirm: bool,
    seq: u64,
}

/// Frames to the client, each not before its instant.
pub type Frames = tokio::sync::mpsc::UnboundedSender<(Duration, MqReply)>;

/// The hosts of a cluster of `n` nodes: `rabbit` for one node, else
/// `rabbit-1`, `rabbit-2`, ….
pub fn node_hosts(n: usize) -> Vec<String> {
    if n <= 1 {
        vec!["rabbit".to_owned()]
    } else {
        (1..=n).map(|i| format!("rabbit-{i}")).collect()
    }
}

/// One client connection, as the broker sees it.
pub struct Conn {
    state: MqState,
    /// The node it is connected to.
    node: usize,
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
    ordering: Option<crate::wire::WireOrdering>,
    bucket: Option<String>,
}

impl Conn {
    /// The client's name, once it has said hello.
    pub fn client(&self) -> &str {
        &self.client
    }

    /// The connection is gone: its consumers' deliveries go back to their
    /// queues.
    pub fn close(self, now: Duration) {
        let id = self.id;
        self.state.with_queues(now, |q| q.close(id, None));
    }

    /// The connection was silent past the heartbeat timeout: records that
    /// the broker closes it (the transport then does).
    pub fn heartbeat_timed_out(&self, timeout: Duration) {
        self.state.trace.now(Event::Fault {
            kind: FaultKind::HeartbeatTimeout,
            detail: format!(
                "broker closes {}'s connection: no heartbeat for {} s",
                self.client,
                timeout.as_secs()
            ),
        });
    }

    /// Handles one request that arrived at simulated time `now`: its
    /// answer, if any, goes out at once. `false` when the broker closes the
    /// connection.
    pub fn request(&mut self, req: MqRequest, now: Duration) -> bool {
        match self.handle(req, now) {
            Next::Go(Some(reply)) => {
                let _ = self.out.send((now, reply));
                true
            }
            Next::Go(None) => true,
            Next::Close => false,
        }
    }

    /// An ack or nack of a tag the channel has not delivered, or has
    /// already settled: RabbitMQ closes the channel (its unacknowledged
    /// deliveries go back to their queues).
    fn unknown_tag(&mut self, channel: u32, tag: u64, now: Duration) -> MqReply {
        self.channels.remove(&channel);
        let conn = self.id;
        self.state
            .with_queues(now, |q| q.close(conn, Some(channel)));
        closed(
            channel,
            &format!("PRECONDITION_FAILED - unknown delivery tag {tag}"),
        )
    }

    /// Applies one request.
    fn handle(&mut self, req: MqRequest, now: Duration) -> Next {
        let reply = match req {
            MqRequest::Publish {
                channel,
                exchange,
                routing_key,
                message_id,
                body,
                trace,
                ordering,
                bucket,
            } => {
                let p = Publish {
                    channel,
                    exchange,
                    routing_key,
                    message_id,
                    body,
                    trace,
                    ordering,
                    bucket,
                };
                return self.publish(p, now);
            }
            MqRequest::DeclareSubscription { .. } => self.declare(req, now),
            MqRequest::Qos { .. }
            | MqRequest::Consume { .. }
            | MqRequest::Ack { .. }
            | MqRequest::Nack { .. } => self.consumer_request(req, now),
            other => self.channel_request(other, now),
        };
        Next::Go(reply)
    }

    /// The connection's and its channels' own requests.
    fn channel_request(&mut self, req: MqRequest, now: Duration) -> Option<MqReply> {
        let (state, conn) = (&self.state, self.id);
        match req {
            MqRequest::Hello { client } => {
                let node = state.node_hosts().swap_remove(self.node);
                state.trace.now(Event::MqConnected {
                    client: client.clone(),
                    node,
                });
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
                state.with_queues(now, |q| q.close(conn, Some(channel)));
                None
            }
            other => unreachable!("{other:?} is not a channel request"),
        }
    }

    /// A subscription's queue, dead-letter queue and bindings declared.
    fn declare(&mut self, req: MqRequest, now: Duration) -> Option<MqReply> {
        let MqRequest::DeclareSubscription {
            channel,
            queue,
            exchange,
            bindings,
            arguments,
            dlq_arguments,
            partitions,
            partition,
        } = req
        else {
            unreachable!("only a declaration comes here");
        };
        let node = self.node;
        let topology = queues::Topology {
            queue: &queue,
            exchange: &exchange,
            bindings: &bindings,
            arguments: &arguments,
            dlq_arguments: &dlq_arguments,
            partitions,
            partition,
        };
        match self
            .state
            .with_queues(now, |q| q.declare_subscription(&topology, node))
        {
            Ok(()) => Some(MqReply::Ok { channel }),
            Err(reason) => {
                self.channels.remove(&channel);
                Some(closed(channel, &reason))
            }
        }
    }

    /// A consumer's requests: prefetch, consume, ack and nack.
    fn consumer_request(&mut self, req: MqRequest, now: Duration) -> Option<MqReply> {
        let (state, conn) = (&self.state, self.id);
        match req {
            MqRequest::Qos { channel, prefetch } => {
                state.with_queues(now, |q| q.qos(conn, channel, prefetch));
                Some(MqReply::Ok { channel })
            }
            MqRequest::Consume { channel, queue } => {
                let (out, client) = (self.out.clone(), &self.client);
                if state.with_queues(now, |q| q.consume(conn, channel, client, &queue, out)) {
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
                if state.with_queues(now, |q| q.ack(conn, channel, tag, multiple)) {
                    None
                } else {
                    Some(self.unknown_tag(channel, tag, now))
                }
            }
            MqRequest::Nack {
                channel,
                tag,
                requeue,
            } => {
                if state.with_queues(now, |q| q.nack(conn, channel, tag, requeue)) {
                    None
                } else {
                    Some(self.unknown_tag(channel, tag, now))
                }
            }
            other => unreachable!("{other:?} is not a consumer's request"),
        }
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
        let confirm = self.channels.get(&p.channel).is_some_and(|c| c.confirm);
        let delay = Duration::from_millis(faults.confirm_delay_ms);
        if ack {
            self.store(p, seq, confirm, delay, now);
        } else {
            state.trace.now(Event::Fault {
                kind: FaultKind::MqNack,
                detail: format!("broker nacks {} ({})", p.message_id, p.routing_key),
            });
            self.trace_confirmed(p.message_id, false);
            self.send_confirm(confirm, now + delay, p.channel, seq, false);
        }
        if state.roll(faults.drop_conn_prob / 2.0) {
            state.trace.now(Event::Fault {
                kind: FaultKind::MqDrop,
                detail: format!("broker drops {}'s connection after storing", self.client),
            });
            return Next::Close;
        }
        Next::Go(None)
    }

    /// Stores and routes an acked publish: confirmed once every quorum
    /// queue it routes to has it (at once if none).
    fn store(&self, p: Publish, seq: u64, confirm: bool, delay: Duration, now: Duration) {
        let state = &self.state;
        let message = queues::QueuedMessage {
            message_id: Some(p.message_id.to_string()),
            routing_key: p.routing_key.clone(),
            body: p.body,
            redelivered: false,
            trace: p.trace,
            ordering: p.ordering,
            bucket: p.bucket,
        };
        let held = queues::HeldConfirm {
            client: self.client.clone(),
            message_id: p.message_id,
            routing_key: p.routing_key.clone(),
            channel: p.channel,
            seq,
            out: confirm.then(|| self.out.clone()),
            delay,
        };
        let node = self.node;
        let waits = state.with_queues(now, |q| {
            let routed = q.route(node, &p.exchange, message.clone());
            if routed.held.is_empty() {
                Some((routed.dropped, held))
            } else {
                // Neither ack nor nack until every quorum queue has it.
                q.hold(message, routed, held);
                None
            }
        });
        match waits {
            None => {}
            Some((dropped, _)) if dropped => {
                // Acked, and kept nowhere.
                self.trace_confirmed(p.message_id, true);
                self.send_confirm(confirm, now + delay, p.channel, seq, true);
            }
            Some((_, held)) => state.confirm_held(held, now),
        }
    }

    fn trace_confirmed(&self, message_id: Uuid, ack: bool) {
        self.state.trace.now(Event::Confirmed {
            client: self.client.clone(),
            message_id,
            ack,
        });
    }

    /// Sends a confirm at `at` on a confirm-mode channel.
    fn send_confirm(&self, confirm: bool, at: Duration, channel: u32, seq: u64, ack: bool) {
        if confirm {
            let _ = self.out.send((at, MqReply::Confirm { channel, seq, ack }));
        }
    }
}

fn closed(channel: u32, reason: &str) -> MqReply {
    MqReply::ChannelClosed {
        channel,
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::subscription_arguments;

    /// A publish held by a quorum queue without a leader is confirmed (and
    /// stored) once the queue has one again, however the leader comes back.
    #[test]
    fn a_held_publish_is_confirmed_once_its_queue_has_a_leader_again() {
        for heal in ["election", "node"] {
            let state = MqState::cluster(1, Trace::default(), 3);
            let spec = outbox::core::ports::SubscriptionSpec {
                queue: "q".into(),
                exchange: "x".into(),
                bindings: vec!["#".into()],
                prefetch: 1,
                queue_type: outbox::QueueType::Quorum,
                partitions: 0,
                partition: None,
            };
            let (arguments, dlq_arguments) = subscription_arguments(&spec);
            let (out, mut frames) = tokio::sync::mpsc::unbounded_channel();
            let mut conn = state.open_connection(out, 0);
            let t0 = Duration::from_secs(10);
            for req in [
                MqRequest::ChannelOpen { channel: 1 },
                MqRequest::ConfirmSelect { channel: 1 },
                MqRequest::DeclareSubscription {
                    channel: 1,
                    queue: "q".into(),
                    exchange: "x".into(),
                    bindings: vec!["#".into()],
                    arguments,
                    dlq_arguments,
                    partitions: 0,
                    partition: None,
                },
            ] {
                assert!(conn.request(req, t0));
            }
            if heal == "election" {
                state.block_elections(true, t0);
            } else {
                // The leader (node 1, the declaring node) and a second node
                // go: no majority.
                state.set_node_up(1, false, t0);
                state.set_node_up(0, false, t0);
            }
            let id = Uuid::now_v7();
            assert!(conn.request(
                MqRequest::Publish {
                    channel: 1,
                    exchange: "x".into(),
                    routing_key: "k".into(),
                    message_id: id,
                    body: crate::wire::WireBody::from_bytes(b"{}"),
                    trace: None,
                    ordering: None,
                    bucket: None,
                },
                t0,
            ));
            let later = t0 + queues::ELECTION_DELAY * 2;
            if heal == "election" {
                state.block_elections(false, later);
            } else {
                state.set_node_up(1, true, later);
            }
            let mut confirmed = false;
            while let Ok((_, frame)) = frames.try_recv() {
                confirmed |= matches!(frame, MqReply::Confirm { ack: true, .. });
            }
            assert!(confirmed, "{heal}: the held publish is confirmed");
            assert_eq!(state.stored.lock().unwrap().counts().get(&id), Some(&1));
            assert_eq!(state.queues.lock().unwrap().ready("q").len(), 1);
        }
    }
}
