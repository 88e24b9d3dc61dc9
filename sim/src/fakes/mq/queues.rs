//! The fake RabbitMQ's queues and consumers, as the subscriber relies on
//! them: topic bindings, durable queues with a dead-letter exchange,
//! consumers with a prefetch window, deliveries with tags, ack, nack with
//! requeue (redelivered at the head of the queue, flagged) and without (to
//! the dead-letter queue), and every unacknowledged delivery of a closed
//! channel or connection back in its queue, flagged redelivered.
//!
//! Every delivery and every settlement (ack, nack with or without requeue)
//! is traced as the broker saw it, with the consumer's client name: the
//! checker judges the subscriber's attempt budget and its handling of
//! hostile messages from these.
//!
//! Fault: **duplicate delivery** (`duplicate_prob` in [`super::MqFaults`]):
//! a delivered message is also put back in its queue, flagged redelivered,
//! as a broker that lost an ack would; the inbox absorbs the repeat.
//!
//! **A cluster** (RabbitMQ 3.10 as measured in `outbox/tests/cluster.rs`):
//! the broker is a set of nodes, each up or down, each reachable from the
//! others or cut off. Every queue has a type:
//! - a **classic** queue lives on the node that declared it. While that
//!   node is down or cut off from the publisher's node, what is routed to
//!   the queue is dropped and the publish is still confirmed: the loss the
//!   quorum default exists to prevent. Its messages are on that node's
//!   disk: they come back with it.
//! - a **quorum** queue is on every node and has a leader (first the
//!   declaring node). A publish routed to it is confirmed once the leader
//!   holds it with a majority of the nodes reachable; without a leader or
//!   without a majority the publish waits (neither ack nor nack, as
//!   measured), and is stored and confirmed when a leader with a majority
//!   is back. A leader that goes down or loses its majority steps down; a
//!   new leader is elected [`ELECTION_DELAY`] later among the nodes that
//!   have a majority. Its dead-lettering is at-least-once: a dead letter
//!   that cannot reach `<queue>.dlq` waits until it can.
//!
//! A node that goes down closes its connections: their consumers'
//! unacknowledged deliveries come back redelivered, and their clients
//! reconnect to another node of their list.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use outbox::QueueType;
use outbox::core::topology::{ArgumentValue, text_argument};
use uuid::Uuid;

use crate::trace::{Event, FaultKind, Settle, Trace};
use crate::wire::{MqReply, WireBody, WireOrdering, WireTrace};

/// How long a quorum queue without a leader takes to elect one.
pub const ELECTION_DELAY: Duration = Duration::from_secs(1);

/// Where a connection's frames go: (not before, frame).
pub type Outbox = tokio::sync::mpsc::UnboundedSender<(Duration, MqReply)>;

/// A message in a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedMessage {
    /// AMQP `message_id`: the envelope id for what the drainer publishes,
    /// anything (or nothing) for what a foreign publisher sends.
    pub message_id: Option<String>,
    pub routing_key: String,
    pub body: WireBody,
    pub redelivered: bool,
    /// Its `traceparent`/`tracestate` headers, as published.
    pub trace: Option<WireTrace>,
    /// Its ordering key and number headers, as published.
    pub ordering: Option<WireOrdering>,
    /// Its `canopy-bucket` header, as published.
    pub bucket: Option<String>,
}

/// A durable queue.
#[derive(Debug)]
pub struct Queue {
    pub ready: VecDeque<QueuedMessage>,
    /// How many of `ready`'s first messages were returned (nacked with
    /// requeue, or unsettled when their consumer went): a quorum queue
    /// serves its returns first, in the order they were returned, and a
    /// consumer's unsettled deliveries are returned in the order they were
    /// delivered (RabbitMQ 3.10's `rabbit_fifo`).
    returns: usize,
    /// `x-single-active-consumer`: only its earliest consumer still
    /// registered gets deliveries.
    single_active: bool,
    /// (exchange, routing key) a message nacked without requeue goes to
    /// (`x-dead-letter-exchange`, `x-dead-letter-routing-key`; without a
    /// routing key the message keeps its own).
    dead_letter: Option<(String, Option<String>)>,
    /// A quorum queue declared with `x-dead-letter-strategy =
    /// at-least-once` and `x-overflow = reject-publish`: a dead letter that
    /// its dead-letter queue cannot take waits. Otherwise dead-lettering is
    /// at-most-once: such a dead letter is dropped.
    at_least_once: bool,
    /// A policy's `max-length` (with `reject-publish`): while the queue
    /// holds more than this many (a quorum queue's limit is checked before
    /// each message, so the first one over it goes in), it takes no dead
    /// letter.
    max_length: Option<usize>,
    pub kind: QueueType,
    /// A classic queue's node; a quorum queue's leader (`None` while it
    /// elects one).
    pub leader: Option<usize>,
    /// A quorum queue without a leader elects one from then on.
    elect_at: Duration,
}

impl Queue {
    /// Puts a returned message back: after the earlier returns, before the
    /// rest.
    fn give_back(&mut self, m: QueuedMessage) {
        self.ready.insert(self.returns, m);
        self.returns += 1;
    }

    /// The next message to deliver.
    fn take(&mut self) -> Option<QueuedMessage> {
        let m = self.ready.pop_front()?;
        self.returns = self.returns.saturating_sub(1);
        Some(m)
    }

    fn new(d: &Declared, node: usize) -> Self {
        Self {
            ready: VecDeque::new(),
            returns: 0,
            single_active: d.single_active,
            dead_letter: d.dead_letter.clone(),
            at_least_once: d.at_least_once,
            max_length: None,
            kind: d.kind,
            leader: Some(node),
            elect_at: Duration::ZERO,
        }
    }
}

/// A node of the cluster, as the others see it.
#[derive(Debug, Clone, Copy)]
struct Node {
    up: bool,
    /// Cut off from the other nodes.
    isolated: bool,
}

/// A publish waiting for quorum queues without a leader or a majority.
#[derive(Debug)]
pub struct Held {
    pub message: QueuedMessage,
    /// The queues it still waits for.
    waiting: BTreeSet<String>,
    /// Who to confirm it to once every queue holds it.
    pub confirm: HeldConfirm,
}

/// The confirm a held publish owes.
#[derive(Debug)]
pub struct HeldConfirm {
    pub client: String,
    pub message_id: Uuid,
    pub routing_key: String,
    pub channel: u32,
    pub seq: u64,
    /// `None` on a channel not in confirm mode.
    pub out: Option<Outbox>,
    /// The confirm delay in force when it was published.
    pub delay: Duration,
}

/// Where a routed message went.
#[derive(Debug, Default)]
pub struct Routed {
    /// Quorum queues that cannot take it now: the publish waits for them.
    pub held: BTreeSet<String>,
    /// A classic queue out of reach dropped it.
    pub dropped: bool,
}

#[derive(Debug)]
struct Consumer {
    /// The client (connection) name, for the trace.
    client: String,
    /// The node its connection is on.
    node: usize,
    queue: String,
    /// When it was registered, among all consumers: a single-active
    /// queue's active consumer is its earliest.
    registered: u64,
    prefetch: u16,
    next_tag: u64,
    unacked: BTreeMap<u64, QueuedMessage>,
    out: Outbox,
}

/// A headers exchange as an ordered subscription declares it.
#[derive(Debug, Default)]
struct HeadersExchange {
    /// Bucket header value → queues bound with it.
    by_bucket: BTreeMap<String, BTreeSet<String>>,
    /// The queue bound to its alternate exchange (a fanout).
    rest: Option<String>,
}

/// What a `DeclareSubscription` declares.
#[derive(Debug)]
pub struct Topology<'a> {
    pub queue: &'a str,
    pub exchange: &'a str,
    pub bindings: &'a [String],
    /// The queue's (or each partition queue's) declaration arguments.
    pub arguments: &'a [(String, ArgumentValue)],
    /// `<queue>.dlq`'s.
    pub dlq_arguments: &'a [(String, ArgumentValue)],
    /// 0: one queue; else the partition count of an ordered subscription.
    pub partitions: u16,
    /// The partition declared (every one if `None`).
    pub partition: Option<u16>,
}

/// What a queue's declaration arguments make of it, as RabbitMQ reads
/// them: the kind (`x-queue-type`, classic when absent), the dead-letter
/// route, the dead-letter strategy and a single active consumer.
#[derive(Debug, Clone)]
struct Declared {
    kind: QueueType,
    dead_letter: Option<(String, Option<String>)>,
    at_least_once: bool,
    single_active: bool,
}

impl Declared {
    fn of(args: &[(String, ArgumentValue)]) -> Self {
        let arg = |name| text_argument(args, name);
        let kind = match arg("x-queue-type") {
            Some("quorum") => QueueType::Quorum,
            _ => QueueType::Classic,
        };
        Self {
            kind,
            dead_letter: arg("x-dead-letter-exchange").map(|x| {
                (
                    x.to_owned(),
                    arg("x-dead-letter-routing-key").map(str::to_owned),
                )
            }),
            at_least_once: kind == QueueType::Quorum
                && arg("x-dead-letter-strategy") == Some("at-least-once")
                && arg("x-overflow") == Some("reject-publish"),
            single_active: args
                .iter()
                .any(|(n, v)| n == "x-single-active-consumer" && *v == ArgumentValue::Bool(true)),
        }
    }
}

/// Every queue, binding and consumer of the broker.
#[derive(Debug)]
pub struct Queues {
    queues: BTreeMap<String, Queue>,
    /// (exchange, pattern, queue); `direct` exchanges use exact patterns.
    bindings: Vec<(String, String, String)>,
    /// Exchange-to-exchange bindings: (source topic exchange, pattern,
    /// destination headers exchange).
    exchange_bindings: Vec<(String, String, String)>,
    /// Headers exchanges: each one's bindings (`x-match: all` on one
    /// `canopy-bucket` value → queue) and its alternate exchange's queue,
    /// which takes what no binding matches.
    headers: BTreeMap<String, HeadersExchange>,
    /// Consumers registered so far (orders them for single-active queues).
    registrations: u64,
    /// Consumers by (connection, channel).
    consumers: BTreeMap<(u64, u32), Consumer>,
    /// Channel prefetch set by `basic.qos`, by (connection, channel).
    prefetch: BTreeMap<(u64, u32), u16>,
    nodes: Vec<Node>,
    /// The node of each open connection.
    conns: BTreeMap<u64, usize>,
    /// Publishes waiting for quorum queues, in arrival order.
    held: Vec<Held>,
    /// Dead letters of quorum queues waiting for their dead-letter queue:
    /// (exchange, message).
    held_dead_letters: VecDeque<(String, QueuedMessage)>,
    /// While set, no quorum queue elects a leader (a slow election).
    elections_blocked: bool,
    trace: Trace,
}

/// The dead-letter exchange subscriptions name.
pub const DLQ_EXCHANGE: &str = outbox::core::ports::DLQ_EXCHANGE;

/// AMQP topic matching: `*` is one word, `#` zero or more.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    fn go(p: &[&str], k: &[&str]) -> bool {
        match (p.first(), k.first()) {
            (None, None) => true,
            (Some(&"#"), _) => go(&p[1..], k) || (!k.is_empty() && go(p, &k[1..])),
            (Some(&"*"), Some(_)) => go(&p[1..], &k[1..]),
            (Some(w), Some(x)) if w == x => go(&p[1..], &k[1..]),
            _ => false,
        }
    }
    let p: Vec<&str> = pattern.split('.').collect();
    let k: Vec<&str> = key.split('.').collect();
    go(&p, &k)
}

impl Queues {
    /// No queues yet, on a cluster of `nodes` nodes (at least one), all up;
    /// deliveries and settlements go into `trace`.
    pub fn new(trace: Trace, nodes: usize) -> Self {
        Self {
            queues: BTreeMap::new(),
            bindings: Vec::new(),
            exchange_bindings: Vec::new(),
            headers: BTreeMap::new(),
            registrations: 0,
            consumers: BTreeMap::new(),
            prefetch: BTreeMap::new(),
            nodes: vec![
                Node {
                    up: true,
                    isolated: false
                };
                nodes.max(1)
            ],
            conns: BTreeMap::new(),
            held: Vec::new(),
            held_dead_letters: VecDeque::new(),
            elections_blocked: false,
            trace,
        }
    }

    /// How many nodes the cluster has.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Whether node `node` is up.
    pub fn node_is_up(&self, node: usize) -> bool {
        self.nodes[node].up
    }

    /// Whether node `a` can reach node `b` (a node reaches itself while up).
    fn reachable(&self, a: usize, b: usize) -> bool {
        let (x, y) = (self.nodes[a], self.nodes[b]);
        x.up && y.up && (a == b || (!x.isolated && !y.isolated))
    }

    /// Whether `node` reaches a majority of the cluster (itself included;
    /// a node that is down reaches nothing).
    fn has_majority(&self, node: usize) -> bool {
        let n = self.nodes.len();
        (0..n).filter(|&m| self.reachable(node, m)).count() * 2 > n
    }

    /// Whether a client on `node` can put messages in (or take them from)
    /// `q`.
    fn available(&self, q: &Queue, node: usize) -> bool {
        match (q.kind, q.leader) {
            (_, None) => false,
            (QueueType::Classic, Some(home)) => self.reachable(node, home),
            (QueueType::Quorum, Some(leader)) => {
                self.reachable(node, leader) && self.has_majority(leader)
            }
        }
    }

    /// A connection opened on `node`.
    pub fn connection_opened(&mut self, conn: u64, node: usize) {
        self.conns.insert(conn, node);
    }

    /// Node `node` goes down (`up == false`) or comes back: a node that
    /// goes down closes its connections. Like the two below, it leaves the
    /// elections to its caller, `MqState::with_queues`, which confirms what
    /// they release.
    pub(super) fn set_node_up(&mut self, node: usize, up: bool) {
        self.nodes[node].up = up;
        if !up {
            let conns: Vec<u64> = self
                .conns
                .iter()
                .filter(|(_, n)| **n == node)
                .map(|(c, _)| *c)
                .collect();
            for c in conns {
                self.close(c, None);
            }
        }
    }

    /// Node `node` is cut off from the other nodes (or joins them again).
    pub(super) fn set_node_isolated(&mut self, node: usize, isolated: bool) {
        self.nodes[node].isolated = isolated;
    }

    /// Holds back every quorum queue's election while `blocked`; starting
    /// the block, every leader steps down (a leader election in the middle
    /// of whatever is being confirmed).
    pub(super) fn block_elections(&mut self, blocked: bool, now: Duration) {
        self.elections_blocked = blocked;
        if blocked {
            let names: Vec<String> = self
                .queues
                .iter()
                .filter(|(_, q)| q.kind == QueueType::Quorum && q.leader.is_some())
                .map(|(n, _)| n.clone())
                .collect();
            for name in names {
                self.step_down(&name, now, "its leader steps down");
            }
        }
    }

    fn step_down(&mut self, name: &str, now: Duration, why: &str) {
        let q = self.queues.get_mut(name).expect("listed");
        let old = q.leader.take();
        q.elect_at = now + ELECTION_DELAY;
        self.trace.now(Event::Fault {
            kind: FaultKind::LeaderElection,
            detail: format!(
                "quorum queue {name}: {why} (node {}); electing",
                old.map_or(0, |n| n + 1)
            ),
        });
    }

    /// Steps down every quorum leader that lost its node or its majority,
    /// elects the due ones, then stores what waited for them. Returns the
    /// publishes now held by every queue they were routed to, whose
    /// confirms the broker owes.
    pub fn elect(&mut self, now: Duration) -> Vec<Held> {
        let names: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| q.kind == QueueType::Quorum)
            .map(|(n, _)| n.clone())
            .collect();
        for name in &names {
            let leader = self.queues[name].leader;
            if let Some(l) = leader
                && !self.has_majority(l)
            {
                self.step_down(name, now, "its leader lost its node or its majority");
            }
            let q = &self.queues[name];
            if q.leader.is_none() && now >= q.elect_at && !self.elections_blocked {
                let n = self.nodes.len();
                let from = q.elect_at.as_millis() as usize % n;
                let candidate = (0..n)
                    .map(|i| (from + i) % n)
                    .find(|&c| self.nodes[c].up && self.has_majority(c));
                if let Some(c) = candidate {
                    self.queues.get_mut(name).expect("listed").leader = Some(c);
                    self.trace.now(Event::Fault {
                        kind: FaultKind::LeaderElection,
                        detail: format!("quorum queue {name}: node {} elected leader", c + 1),
                    });
                }
            }
        }
        self.release_held()
    }

    /// Stores held publishes and dead letters in the queues that can take
    /// them now; returns the publishes every queue now holds.
    fn release_held(&mut self) -> Vec<Held> {
        let mut done = Vec::new();
        for mut h in std::mem::take(&mut self.held) {
            let ready: Vec<String> = h
                .waiting
                .iter()
                .filter(|q| self.quorum_writable(q))
                .cloned()
                .collect();
            for q in ready {
                h.waiting.remove(&q);
                if let Some(queue) = self.queues.get_mut(&q) {
                    queue.ready.push_back(h.message.clone());
                }
            }
            if h.waiting.is_empty() {
                done.push(h);
            } else {
                self.held.push(h);
            }
        }
        for (x, m) in std::mem::take(&mut self.held_dead_letters) {
            self.dead_letter(&x, m, true);
        }
        done
    }

    /// Whether a quorum queue has a leader with a majority.
    fn quorum_writable(&self, name: &str) -> bool {
        self.queues
            .get(name)
            .is_none_or(|q| q.leader.is_some_and(|l| self.has_majority(l)))
    }

    /// Holds a publish until every queue in `routed.held` can take it.
    pub fn hold(&mut self, message: QueuedMessage, routed: Routed, confirm: HeldConfirm) {
        self.held.push(Held {
            message,
            waiting: routed.held,
            confirm,
        });
    }

    /// Publishes waiting for a quorum queue.
    pub fn held_count(&self) -> usize {
        self.held.len() + self.held_dead_letters.len()
    }

    /// A queue's ready messages (for the world and the conformance suite).
    pub fn ready(&self, queue: &str) -> Vec<QueuedMessage> {
        self.queues
            .get(queue)
            .map(|q| q.ready.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Declares `<queue>.dlq` bound to `canopy.dlq`, the queue with its
    /// dead-letter route, and its bindings on `exchange`, both of type
    /// `kind`, on (led by) `node` (idempotent). An ordered subscription
    /// (`partitions` > 0) gets instead of the queue its headers exchange
    /// `<queue>.route`, bound to `exchange` with each binding, whose
    /// unmatched messages go to partition 0 (its alternate exchange), and
    /// the partition queue(s) declared, single-active, each bound by its
    /// buckets. A queue that exists with another type is refused, as
    /// RabbitMQ refuses it (`PRECONDITION_FAILED - inequivalent arg
    /// 'x-queue-type'`).
    pub fn declare_subscription(&mut self, t: &Topology<'_>, node: usize) -> Result<(), String> {
        let (queue, dlq_declared) = (Declared::of(t.arguments), Declared::of(t.dlq_arguments));
        let spec = outbox::core::ports::SubscriptionSpec {
            queue: t.queue.to_owned(),
            exchange: t.exchange.to_owned(),
            bindings: t.bindings.to_vec(),
            prefetch: 1,
            queue_type: queue.kind,
            partitions: t.partitions,
            partition: t.partition,
        };
        let dlq = spec.dlq_name();
        let partitions: Vec<u16> = match (t.partitions, t.partition) {
            (0, _) => Vec::new(),
            (_, Some(p)) => vec![p],
            (n, None) => (0..n).collect(),
        };
        let mut queues = vec![(dlq.clone(), &dlq_declared)];
        if t.partitions == 0 {
            queues.push((t.queue.to_owned(), &queue));
        }
        queues.extend(
            partitions
                .iter()
                .map(|p| (spec.partition_queue(*p), &queue)),
        );
        for (name, declared) in &queues {
            if let Some(q) = self.queues.get(name)
                && q.kind != declared.kind
            {
                return Err(format!(
                    "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue \
                     '{name}': received '{}' but current is '{}'",
                    declared.kind, q.kind
                ));
            }
        }
        for (name, declared) in queues {
            self.queues
                .entry(name)
                .or_insert_with(|| Queue::new(declared, node));
        }
        self.bind(DLQ_EXCHANGE, t.queue, &dlq);
        if t.partitions == 0 {
            for b in t.bindings {
                self.bind(t.exchange, b, t.queue);
            }
            return Ok(());
        }
        let route = spec.route_exchange();
        for b in t.bindings {
            let e2e = (t.exchange.to_owned(), b.clone(), route.clone());
            if !self.exchange_bindings.contains(&e2e) {
                self.exchange_bindings.push(e2e);
            }
        }
        for p in partitions {
            let name = spec.partition_queue(p);
            let exchange = self.headers.entry(route.clone()).or_default();
            for bucket in spec.buckets_of(p) {
                exchange
                    .by_bucket
                    .entry(bucket.to_string())
                    .or_default()
                    .insert(name.clone());
            }
            if p == 0 {
                exchange.rest = Some(name);
            }
        }
        Ok(())
    }

    fn bind(&mut self, exchange: &str, pattern: &str, queue: &str) {
        let b = (exchange.to_owned(), pattern.to_owned(), queue.to_owned());
        if !self.bindings.contains(&b) {
            self.bindings.push(b);
        }
    }

    /// Routes a message published on `node` to every bound queue: a
    /// classic queue out of reach drops it; a quorum queue without a
    /// leader or a majority cannot take it yet (see [`Routed`]).
    pub fn route(&mut self, node: usize, exchange: &str, message: QueuedMessage) -> Routed {
        let mut routed = Routed::default();
        for q in self.targets(exchange, &message) {
            let Some(queue) = self.queues.get(&q) else {
                continue;
            };
            match queue.kind {
                QueueType::Quorum if !self.quorum_writable(&q) => {
                    routed.held.insert(q);
                }
                QueueType::Classic if !self.available(queue, node) => {
                    routed.dropped = true;
                    let home = queue.leader.map_or(0, |n| n + 1);
                    self.trace.now(Event::Fault {
                        kind: FaultKind::QueueUnreachable,
                        detail: format!(
                            "classic queue {q} on node {home}, out of reach of node {}, \
                             drops {:?}",
                            node + 1,
                            message.message_id
                        ),
                    });
                }
                _ => {
                    if let Some(queue) = self.queues.get_mut(&q) {
                        queue.ready.push_back(message.clone());
                    }
                }
            }
        }
        routed
    }

    /// Puts a foreign publisher's message in every queue bound to it, as
    /// stored (the world's hostile messages).
    pub fn inject(&mut self, exchange: &str, message: QueuedMessage) {
        for q in self.targets(exchange, &message) {
            if let Some(queue) = self.queues.get_mut(&q) {
                queue.ready.push_back(message.clone());
            }
        }
    }

    /// The queues a message on `exchange` is routed to: by its routing key
    /// through the queue bindings, and through each headers exchange bound
    /// to `exchange` with a matching pattern, by its bucket header (the
    /// exchange's alternate queue if no binding matches it).
    fn targets(&self, exchange: &str, m: &QueuedMessage) -> Vec<String> {
        let key = m.routing_key.as_str();
        let mut targets: BTreeSet<String> = self
            .bindings
            .iter()
            .filter(|(x, p, _)| {
                x == exchange
                    && if x == DLQ_EXCHANGE {
                        p == key
                    } else {
                        topic_matches(p, key)
                    }
            })
            .map(|(_, _, q)| q.clone())
            .collect();
        let routes: BTreeSet<&String> = self
            .exchange_bindings
            .iter()
            .filter(|(x, p, _)| x == exchange && topic_matches(p, key))
            .map(|(_, _, route)| route)
            .collect();
        for route in routes {
            let Some(h) = self.headers.get(route) else {
                continue;
            };
            match m.bucket.as_ref().and_then(|b| h.by_bucket.get(b)) {
                Some(queues) if !queues.is_empty() => targets.extend(queues.iter().cloned()),
                _ => targets.extend(h.rest.iter().cloned()),
            }
        }
        targets.into_iter().collect()
    }

    /// Dead-letters `m` to `exchange`. At least once (`at_least_once`): a
    /// dead-letter queue that cannot take it yet (a quorum one without a
    /// leader or a majority, or one full under a `max-length` policy)
    /// keeps it waiting. At most once: it is published as it comes, without
    /// confirms, so a quorum queue out of reach drops it and a full one
    /// takes it all the same (as RabbitMQ 3.10 does); a classic one out of
    /// reach drops it (RabbitMQ's classic behaviour).
    fn dead_letter(&mut self, exchange: &str, m: QueuedMessage, at_least_once: bool) {
        let targets = self.targets(exchange, &m);
        let out_of_reach =
            |q: &Queue, name: &str| q.kind == QueueType::Quorum && !self.quorum_writable(name);
        let blocked = targets.iter().any(|name| {
            self.queues.get(name).is_some_and(|q| {
                out_of_reach(q, name)
                    || (at_least_once && q.max_length.is_some_and(|n| q.ready.len() > n))
            })
        });
        if blocked {
            if at_least_once {
                self.held_dead_letters.push_back((exchange.to_owned(), m));
            }
            return;
        }
        // Dead-lettering happens on the queue's leader: its node routes.
        let node = targets
            .first()
            .and_then(|q| self.queues.get(q))
            .and_then(|q| q.leader)
            .unwrap_or(0);
        self.route(node, exchange, m);
    }

    /// The dead letters waiting for their dead-letter queue.
    pub fn waiting_dead_letters(&self) -> impl Iterator<Item = &QueuedMessage> {
        self.held_dead_letters.iter().map(|(_, m)| m)
    }

    /// `queue.purge`: drops the ready messages of `queue`; how many.
    pub fn purge(&mut self, queue: &str) -> usize {
        self.queues.get_mut(queue).map_or(0, |q| {
            q.returns = 0;
            std::mem::take(&mut q.ready).len()
        })
    }

    /// Sets (or with `None` clears) a `max-length` policy on `queue`, as
    /// `rabbitmqctl set_policy` with `reject-publish` overflow does.
    pub fn set_max_length(&mut self, queue: &str, max: Option<usize>) {
        if let Some(q) = self.queues.get_mut(queue) {
            q.max_length = max;
        }
    }

    /// `basic.qos` on a channel.
    pub fn qos(&mut self, conn: u64, channel: u32, prefetch: u16) {
        self.prefetch.insert((conn, channel), prefetch.max(1));
    }

    /// `basic.consume` by `client`: `false` if there is no such queue.
    pub fn consume(
        &mut self,
        conn: u64,
        channel: u32,
        client: &str,
        queue: &str,
        out: Outbox,
    ) -> bool {
        if !self.queues.contains_key(queue) {
            return false;
        }
        let node = self.conns.get(&conn).copied().unwrap_or(0);
        let prefetch = self
            .prefetch
            .get(&(conn, channel))
            .copied()
            .unwrap_or(u16::MAX);
        self.registrations += 1;
        let registered = self.registrations;
        self.consumers.insert(
            (conn, channel),
            Consumer {
                client: client.to_owned(),
                node,
                queue: queue.to_owned(),
                registered,
                prefetch,
                next_tag: 1,
                unacked: BTreeMap::new(),
                out,
            },
        );
        true
    }

    /// `basic.ack`; with `multiple`, of every unacknowledged delivery up
    /// to `tag`, in tag order. False if `tag` is not an unacknowledged
    /// delivery of the channel's consumer (RabbitMQ then closes the channel
    /// with `PRECONDITION_FAILED`).
    pub fn ack(&mut self, conn: u64, channel: u32, tag: u64, multiple: bool) -> bool {
        let Some(c) = self.consumers.get_mut(&(conn, channel)) else {
            return true;
        };
        if !c.unacked.contains_key(&tag) {
            return false;
        }
        let tags: Vec<u64> = if multiple {
            c.unacked.range(..=tag).map(|(t, _)| *t).collect()
        } else {
            vec![tag]
        };
        for t in tags {
            if let Some(m) = c.unacked.remove(&t) {
                self.trace.now(Event::Settled {
                    client: c.client.clone(),
                    message_id: m.message_id,
                    settle: Settle::Ack,
                });
            }
        }
        true
    }

    /// `basic.nack`. False if `tag` is not an unacknowledged delivery of
    /// the channel's consumer (as for [`ack`](Self::ack)).
    pub fn nack(&mut self, conn: u64, channel: u32, tag: u64, requeue: bool) -> bool {
        let Some(c) = self.consumers.get_mut(&(conn, channel)) else {
            return true;
        };
        let Some(mut m) = c.unacked.remove(&tag) else {
            return false;
        };
        self.trace.now(Event::Settled {
            client: c.client.clone(),
            message_id: m.message_id.clone(),
            settle: if requeue {
                Settle::Requeue
            } else {
                Settle::DeadLetter
            },
        });
        let queue = c.queue.clone();
        if requeue {
            m.redelivered = true;
            if let Some(q) = self.queues.get_mut(&queue) {
                q.give_back(m);
            }
        } else if let Some(q) = self.queues.get(&queue)
            && let Some((x, rk)) = q.dead_letter.clone()
        {
            let at_least_once = q.at_least_once;
            if let Some(rk) = rk {
                m.routing_key = rk;
            }
            m.redelivered = false;
            self.dead_letter(&x, m, at_least_once);
        }
        true
    }

    /// A channel (or, with `None`, every channel of a connection) closed:
    /// its consumers' unacknowledged deliveries go back to their queues.
    pub fn close(&mut self, conn: u64, channel: Option<u32>) {
        if channel.is_none() {
            self.conns.remove(&conn);
        }
        let keys: Vec<(u64, u32)> = self
            .consumers
            .keys()
            .filter(|(c, ch)| *c == conn && channel.is_none_or(|x| x == *ch))
            .copied()
            .collect();
        for key in keys {
            let consumer = self.consumers.remove(&key).expect("listed");
            if let Some(q) = self.queues.get_mut(&consumer.queue) {
                for (_, mut m) in consumer.unacked {
                    m.redelivered = true;
                    q.give_back(m);
                }
            }
            self.prefetch.remove(&key);
        }
        self.prefetch
            .retain(|(c, ch), _| !(*c == conn && channel.is_none_or(|x| x == *ch)));
    }

    /// Pushes ready messages to consumers with room in their window, in
    /// consumer order; `duplicate` decides, per delivery, whether the broker
    /// also keeps a redelivered copy.
    pub fn dispatch(&mut self, now: Duration, mut duplicate: impl FnMut() -> bool) {
        // A single-active queue's active consumer: its earliest.
        let mut active: BTreeMap<&str, u64> = BTreeMap::new();
        for c in self.consumers.values() {
            let earliest = active.entry(c.queue.as_str()).or_insert(c.registered);
            *earliest = (*earliest).min(c.registered);
        }
        let keys: Vec<(u64, u32)> = self
            .consumers
            .iter()
            .filter(|(_, c)| {
                self.queues.get(&c.queue).is_some_and(|q| {
                    self.available(q, c.node)
                        && (!q.single_active || active.get(c.queue.as_str()) == Some(&c.registered))
                })
            })
            .map(|(k, _)| *k)
            .collect();
        loop {
            let mut delivered = false;
            for key in &keys {
                let Some(c) = self.consumers.get_mut(key) else {
                    continue;
                };
                if c.unacked.len() >= usize::from(c.prefetch) {
                    continue;
                }
                let Some(q) = self.queues.get_mut(&c.queue) else {
                    continue;
                };
                let Some(m) = q.take() else {
                    continue;
                };
                if duplicate() {
                    self.trace.now(Event::Fault {
                        kind: FaultKind::DuplicateDelivery,
                        detail: format!("{:?} delivered twice", m.message_id),
                    });
                    let mut copy = m.clone();
                    copy.redelivered = true;
                    q.ready.push_back(copy);
                }
                self.trace.now(Event::Delivered {
                    client: c.client.clone(),
                    message_id: m.message_id.clone(),
                    redelivered: m.redelivered,
                    trace: m.trace.clone(),
                });
                let tag = c.next_tag;
                c.next_tag += 1;
                let frame = MqReply::Deliver {
                    channel: key.1,
                    tag,
                    message_id: m.message_id.clone(),
                    routing_key: m.routing_key.clone(),
                    body: m.body.clone(),
                    redelivered: m.redelivered,
                    trace: m.trace.clone(),
                    ordering: m.ordering.clone(),
                };
                c.unacked.insert(tag, m);
                let _ = c.out.send((now, frame));
                delivered = true;
            }
            if !delivered {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::topic_matches;

    #[test]
    fn topic_patterns_match_as_amqp_says() {
        for (p, k, want) in [
            ("orders.*", "orders.created", true),
            ("orders.*", "orders.created.eu", false),
            ("orders.#", "orders", true),
            ("orders.#", "orders.created.eu", true),
            ("#", "anything.at.all", true),
            ("*.created", "orders.created", true),
            ("*.created", "created", false),
            ("orders.#.eu", "orders.created.eu", true),
            ("orders.#.eu", "orders.eu", true),
            ("orders.created", "orders.paid", false),
        ] {
            assert_eq!(topic_matches(p, k), want, "{p} vs {k}");
        }
    }
}
