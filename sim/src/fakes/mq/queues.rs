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

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use crate::trace::{Event, FaultKind, Settle, Trace};
use crate::wire::{MqReply, WireBody, WireTrace};

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
}

/// A durable queue.
#[derive(Debug, Default)]
pub struct Queue {
    pub ready: VecDeque<QueuedMessage>,
    /// (exchange, routing key) a message nacked without requeue goes to.
    dead_letter: Option<(String, String)>,
}

#[derive(Debug)]
struct Consumer {
    /// The client (connection) name, for the trace.
    client: String,
    queue: String,
    prefetch: u16,
    next_tag: u64,
    unacked: BTreeMap<u64, QueuedMessage>,
    out: Outbox,
}

/// Every queue, binding and consumer of the broker.
#[derive(Debug)]
pub struct Queues {
    queues: BTreeMap<String, Queue>,
    /// (exchange, pattern, queue); `direct` exchanges use exact patterns.
    bindings: Vec<(String, String, String)>,
    /// Consumers by (connection, channel).
    consumers: BTreeMap<(u64, u32), Consumer>,
    /// Channel prefetch set by `basic.qos`, by (connection, channel).
    prefetch: BTreeMap<(u64, u32), u16>,
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
    /// No queues yet; deliveries and settlements go into `trace`.
    pub fn new(trace: Trace) -> Self {
        Self {
            queues: BTreeMap::new(),
            bindings: Vec::new(),
            consumers: BTreeMap::new(),
            prefetch: BTreeMap::new(),
            trace,
        }
    }

    /// A queue's ready messages (for the world and the conformance suite).
    pub fn ready(&self, queue: &str) -> Vec<QueuedMessage> {
        self.queues
            .get(queue)
            .map(|q| q.ready.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Declares `<queue>.dlq` bound to `canopy.dlq`, the queue with its
    /// dead-letter route, and its bindings on `exchange` (idempotent).
    pub fn declare_subscription(&mut self, queue: &str, exchange: &str, bindings: &[String]) {
        let dlq = format!("{queue}.dlq");
        self.queues.entry(dlq.clone()).or_default();
        self.bind(DLQ_EXCHANGE, queue, &dlq);
        self.queues.entry(queue.to_owned()).or_default().dead_letter =
            Some((DLQ_EXCHANGE.to_owned(), queue.to_owned()));
        for b in bindings {
            self.bind(exchange, b, queue);
        }
    }

    fn bind(&mut self, exchange: &str, pattern: &str, queue: &str) {
        let b = (exchange.to_owned(), pattern.to_owned(), queue.to_owned());
        if !self.bindings.contains(&b) {
            self.bindings.push(b);
        }
    }

    /// Routes a stored message to every bound queue.
    pub fn route(&mut self, exchange: &str, message: QueuedMessage) {
        let targets: Vec<String> = self
            .bindings
            .iter()
            .filter(|(x, p, _)| {
                x == exchange
                    && if x == DLQ_EXCHANGE {
                        *p == message.routing_key
                    } else {
                        topic_matches(p, &message.routing_key)
                    }
            })
            .map(|(_, _, q)| q.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for q in targets {
            if let Some(queue) = self.queues.get_mut(&q) {
                queue.ready.push_back(message.clone());
            }
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
        let prefetch = self
            .prefetch
            .get(&(conn, channel))
            .copied()
            .unwrap_or(u16::MAX);
        self.consumers.insert(
            (conn, channel),
            Consumer {
                client: client.to_owned(),
                queue: queue.to_owned(),
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
                q.ready.push_front(m);
            }
        } else if let Some((x, rk)) = self.queues.get(&queue).and_then(|q| q.dead_letter.clone()) {
            m.routing_key = rk;
            m.redelivered = false;
            self.route(&x, m);
        }
        true
    }

    /// A channel (or, with `None`, every channel of a connection) closed:
    /// its consumers' unacknowledged deliveries go back to their queues.
    pub fn close(&mut self, conn: u64, channel: Option<u32>) {
        let keys: Vec<(u64, u32)> = self
            .consumers
            .keys()
            .filter(|(c, ch)| *c == conn && channel.is_none_or(|x| x == *ch))
            .copied()
            .collect();
        for key in keys {
            let consumer = self.consumers.remove(&key).expect("listed");
            if let Some(q) = self.queues.get_mut(&consumer.queue) {
                for (_, mut m) in consumer.unacked.into_iter().rev() {
                    m.redelivered = true;
                    q.ready.push_front(m);
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
        let keys: Vec<(u64, u32)> = self.consumers.keys().copied().collect();
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
                let Some(m) = q.ready.pop_front() else {
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
