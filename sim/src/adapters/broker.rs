//! The `Broker` and `ConsumerBroker` ports over the fake RabbitMQ: one
//! connection per client with heartbeats (as lapin keeps them), channels in
//! confirm mode, pipelined publishes whose confirms resolve futures, and
//! consumers whose deliveries arrive on the connection. It records each
//! publish as sent (with the envelope id its body holds) and each confirm as
//! received, so the checker can judge Phase 2's deadline from the drainer's
//! side of the wire.
//!
//! Like `LapinBroker`, it takes a list of nodes: it connects to the first
//! that answers, starting from the node it last used, and a connection that
//! died moves it on to the next node.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use outbox::BrokerError;
use outbox::core::ports::{
    Broker, Confirm, ConsumerBroker, Delivery, DeliverySource, OutgoingMessage, PublishChannel,
    SubscriptionSpec, Unsettled,
};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::hooks::{Hooks, Point};
use super::net::connect;
use crate::fakes::mq::MQ_PORT;
use crate::trace::{Event, Trace};
use crate::wire::{
    HEARTBEAT_EVERY, HEARTBEAT_TIMEOUT, MqReply, MqRequest, WireBody, read_frame,
    subscription_arguments, write_frame,
};

/// One live connection to the fake broker.
struct MqConn {
    writer: tokio::sync::Mutex<crate::engine::net::WriteHalf>,
    waiters: Arc<Mutex<Waiters>>,
    reader: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Waiters {
    ok: BTreeMap<u32, oneshot::Sender<()>>,
    /// Outstanding confirms by (channel, sequence number), with the message
    /// they confirm.
    confirms: BTreeMap<(u32, u64), (oneshot::Sender<bool>, Uuid)>,
    /// Consumers' delivery queues, by channel.
    deliveries: BTreeMap<u32, tokio::sync::mpsc::UnboundedSender<Delivery>>,
    dead: bool,
}

impl Waiters {
    /// Hands one frame from the broker to whoever waits for it.
    fn dispatch(&mut self, frame: MqReply, client: &str, trace: &Trace) {
        match frame {
            MqReply::Ok { channel } => {
                if let Some(tx) = self.ok.remove(&channel) {
                    let _ = tx.send(());
                }
            }
            MqReply::Confirm { channel, seq, ack } => {
                if let Some((tx, message_id)) = self.confirms.remove(&(channel, seq)) {
                    trace.now(Event::ConfirmReceived {
                        client: client.to_owned(),
                        message_id,
                    });
                    let _ = tx.send(ack);
                }
            }
            MqReply::ChannelClosed { channel, .. } => {
                self.ok.remove(&channel);
                self.confirms.retain(|(c, _), _| *c != channel);
                self.deliveries.remove(&channel);
            }
            MqReply::Heartbeat => {}
            MqReply::Deliver {
                channel,
                tag,
                message_id,
                routing_key,
                body,
                redelivered,
                trace,
                ordering,
            } => {
                if let Some(tx) = self.deliveries.get(&channel) {
                    let _ = tx.send(Delivery {
                        tag,
                        message_id,
                        routing_key,
                        body: body.into_bytes(),
                        redelivered,
                        trace: trace.and_then(|(tp, ts)| {
                            outbox::trace_context::TraceContext::parse(&tp, ts.as_deref()).ok()
                        }),
                        ordering: ordering.and_then(|(key, seq)| {
                            outbox::core::ports::KeySeq::from_headers(key, seq)
                        }),
                    });
                }
            }
        }
    }
}

impl Drop for MqConn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl MqConn {
    async fn send(&self, req: &MqRequest) -> Result<(), BrokerError> {
        let mut w = self.writer.lock().await;
        write_frame(&mut *w, req)
            .await
            .map_err(|e| BrokerError::Connection(format!("send failed: {e}")))
    }
}

/// The `Broker` port over the fake RabbitMQ.
pub struct SimBroker {
    client: String,
    /// The broker's node hosts, in the order they are tried.
    nodes: Vec<String>,
    /// The node last connected to (an index into `nodes`).
    node: AtomicUsize,
    conn: tokio::sync::Mutex<Option<Arc<MqConn>>>,
    generation: AtomicU64,
    next_channel: AtomicU32,
    hooks: Hooks,
    trace: Trace,
}

impl SimBroker {
    /// A lazily connecting broker client for `client`.
    pub fn new(client: impl Into<String>, trace: Trace, hooks: Hooks) -> Self {
        Self {
            client: client.into(),
            nodes: vec!["rabbit".to_owned()],
            node: AtomicUsize::new(0),
            conn: tokio::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
            next_channel: AtomicU32::new(1),
            hooks,
            trace,
        }
    }

    /// The same client on the cluster whose node hosts are `nodes`, trying
    /// `nodes[first]` first (empty: the single node `rabbit`).
    pub fn with_nodes(mut self, nodes: Vec<String>, first: usize) -> Self {
        if !nodes.is_empty() {
            self.trace.now(Event::BrokerAssigned {
                client: self.client.clone(),
                node: nodes[first % nodes.len()].clone(),
            });
            self.node = AtomicUsize::new(first % nodes.len());
            self.nodes = nodes;
        }
        self
    }

    /// Connects to the first node that answers, each tried once, starting
    /// from the node last used, or (`move_on`, its connection died) from
    /// the next one.
    async fn connect(&self, move_on: bool) -> Result<Arc<MqConn>, BrokerError> {
        let n = self.nodes.len();
        let start = self.node.load(Ordering::SeqCst) + usize::from(move_on);
        let mut errors = Vec::new();
        for i in 0..n {
            let node = (start + i) % n;
            self.trace.now(Event::BrokerConnecting {
                client: self.client.clone(),
                node: self.nodes[node].clone(),
            });
            match connect(&self.nodes[node], MQ_PORT).await {
                Ok(stream) => {
                    self.node.store(node, Ordering::SeqCst);
                    return self.open(stream).await;
                }
                Err(e) => errors.push(e),
            }
        }
        Err(BrokerError::Connection(errors.join("; ")))
    }

    async fn open(
        &self,
        stream: crate::engine::net::TcpStream,
    ) -> Result<Arc<MqConn>, BrokerError> {
        let (mut r, mut w) = crate::engine::net::split(stream);
        write_frame(
            &mut w,
            &MqRequest::Hello {
                client: self.client.clone(),
            },
        )
        .await
        .map_err(|e| BrokerError::Connection(e.to_string()))?;
        let waiters: Arc<Mutex<Waiters>> = Arc::default();
        let reader_waiters = waiters.clone();
        let (client, trace) = (self.client.clone(), self.trace.clone());
        let reader = tokio::spawn(async move {
            // A broker silent past the heartbeat timeout is gone.
            while let Ok(Ok(Some(frame))) =
                crate::engine::timeout(HEARTBEAT_TIMEOUT, read_frame::<_, MqReply>(&mut r)).await
            {
                let mut w = reader_waiters.lock().expect("waiters");
                w.dispatch(frame, &client, &trace);
            }
            // Connection gone: every waiter fails, every consumer ends.
            let mut w = reader_waiters.lock().expect("waiters");
            w.dead = true;
            w.ok.clear();
            w.confirms.clear();
            w.deliveries.clear();
        });
        self.generation.fetch_add(1, Ordering::SeqCst);
        let conn = Arc::new(MqConn {
            writer: tokio::sync::Mutex::new(w),
            waiters,
            reader,
        });
        // Heartbeats while the connection lives (lapin sends them too).
        let weak = Arc::downgrade(&conn);
        tokio::spawn(async move {
            loop {
                crate::engine::sleep(HEARTBEAT_EVERY).await;
                let Some(conn) = weak.upgrade() else { return };
                if conn.waiters.lock().expect("waiters").dead {
                    return;
                }
                let _ = conn.send(&MqRequest::Heartbeat).await;
            }
        });
        Ok(conn)
    }

    async fn live_conn(&self) -> Result<Arc<MqConn>, BrokerError> {
        let mut guard = self.conn.lock().await;
        if let Some(c) = guard.as_ref()
            && !c.waiters.lock().expect("waiters").dead
        {
            return Ok(c.clone());
        }
        let move_on = guard.take().is_some();
        let c = self.connect(move_on).await?;
        *guard = Some(c.clone());
        Ok(c)
    }
}

impl Broker for SimBroker {
    type Channel = SimChannel;

    fn connection_generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    async fn channel_open(&self) -> Result<SimChannel, BrokerError> {
        let conn = self.live_conn().await?;
        let channel = self.next_channel.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut w = conn.waiters.lock().expect("waiters");
            if w.dead {
                return Err(BrokerError::Connection("connection lost".into()));
            }
            w.ok.insert(channel, tx);
        }
        conn.send(&MqRequest::ChannelOpen { channel }).await?;
        rx.await
            .map_err(|_| BrokerError::Channel("channel open failed".into()))?;
        Ok(SimChannel {
            conn,
            channel,
            seq: 0,
            published: 0,
            client: self.client.clone(),
            hooks: self.hooks.clone(),
            trace: self.trace.clone(),
        })
    }

    async fn connection_reconnect(&self, generation: u64) -> Result<(), BrokerError> {
        let mut guard = self.conn.lock().await;
        if self.generation.load(Ordering::SeqCst) != generation {
            return Ok(());
        }
        *guard = None;
        let c = self.connect(true).await?;
        *guard = Some(c);
        Ok(())
    }
}

/// A channel of [`SimBroker`].
pub struct SimChannel {
    conn: Arc<MqConn>,
    channel: u32,
    seq: u64,
    published: u64,
    client: String,
    hooks: Hooks,
    trace: Trace,
}

impl PublishChannel for SimChannel {
    type Confirm = SimConfirm;

    async fn channel_confirm_select(&mut self) -> Result<(), BrokerError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut w = self.conn.waiters.lock().expect("waiters");
            if w.dead {
                return Err(BrokerError::Connection("connection lost".into()));
            }
            w.ok.insert(self.channel, tx);
        }
        self.conn
            .send(&MqRequest::ConfirmSelect {
                channel: self.channel,
            })
            .await?;
        rx.await
            .map_err(|_| BrokerError::Channel("confirm.select failed".into()))
    }

    async fn channel_publish(&mut self, m: OutgoingMessage<'_>) -> Result<SimConfirm, BrokerError> {
        if self.published > 0 {
            self.hooks
                .at(Point::MidPublish, &self.client, &self.trace)
                .await;
        }
        self.seq += 1;
        let (tx, rx) = oneshot::channel();
        {
            let mut w = self.conn.waiters.lock().expect("waiters");
            if w.dead {
                return Err(BrokerError::Connection("connection lost".into()));
            }
            w.confirms
                .insert((self.channel, self.seq), (tx, m.message_id));
        }
        self.trace.now(Event::PublishSent {
            client: self.client.clone(),
            message_id: m.message_id,
            body_id: envelope_id(m.body),
        });
        self.conn
            .send(&MqRequest::Publish {
                channel: self.channel,
                exchange: m.exchange.to_owned(),
                routing_key: m.routing_key.to_owned(),
                message_id: m.message_id,
                body: WireBody::from_bytes(m.body),
                trace: m.trace.map(|t| {
                    (
                        t.traceparent().to_owned(),
                        t.tracestate().map(str::to_owned),
                    )
                }),
                ordering: m.ordering.map(|o| (o.key.clone(), o.seq)),
                bucket: Some(outbox::core::ports::bucket_of(m.ordering, m.message_id).to_string()),
            })
            .await?;
        self.published += 1;
        Ok(SimConfirm(rx))
    }

    async fn channel_close(self) {
        let _ = self
            .conn
            .send(&MqRequest::ChannelClose {
                channel: self.channel,
            })
            .await;
    }
}

/// A pending confirm of [`SimChannel`].
pub struct SimConfirm(oneshot::Receiver<bool>);

impl Future for SimConfirm {
    type Output = Result<Confirm, BrokerError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map(|r| match r {
            Ok(true) => Ok(Confirm::Ack),
            Ok(false) => Ok(Confirm::Nack(
                "basic.nack (simulated reject-publish)".into(),
            )),
            Err(_) => Err(BrokerError::Connection(
                "connection lost before the confirm".into(),
            )),
        })
    }
}

impl SimBroker {
    /// Sends `req` on `channel` and waits for the broker's `Ok`.
    async fn call_ok(
        &self,
        conn: &MqConn,
        channel: u32,
        req: MqRequest,
    ) -> Result<(), BrokerError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut w = conn.waiters.lock().expect("waiters");
            if w.dead {
                return Err(BrokerError::Connection("connection lost".into()));
            }
            w.ok.insert(channel, tx);
        }
        conn.send(&req).await?;
        rx.await.map_err(|_| {
            // The waiter was dropped: by the connection's end (everything
            // fails), or by the broker closing this channel.
            if conn.waiters.lock().expect("waiters").dead {
                BrokerError::Connection("connection lost".into())
            } else {
                BrokerError::Channel(format!("channel {channel} closed by the broker"))
            }
        })
    }
}

impl ConsumerBroker for SimBroker {
    type Consumer = SimConsumer;

    async fn subscription_open(&self, spec: &SubscriptionSpec) -> Result<SimConsumer, BrokerError> {
        let conn = self.live_conn().await?;
        let channel = self.next_channel.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        conn.waiters
            .lock()
            .expect("waiters")
            .deliveries
            .insert(channel, tx);
        self.call_ok(&conn, channel, MqRequest::ChannelOpen { channel })
            .await?;
        let (arguments, dlq_arguments) = subscription_arguments(spec);
        self.call_ok(
            &conn,
            channel,
            MqRequest::DeclareSubscription {
                channel,
                queue: spec.queue.clone(),
                exchange: spec.exchange.clone(),
                bindings: spec.bindings.clone(),
                arguments,
                dlq_arguments,
                partitions: spec.partitions,
                partition: spec.partition,
            },
        )
        .await?;
        self.call_ok(
            &conn,
            channel,
            MqRequest::Qos {
                channel,
                prefetch: spec.prefetch,
            },
        )
        .await?;
        self.call_ok(
            &conn,
            channel,
            MqRequest::Consume {
                channel,
                queue: spec.consumed_queue(),
            },
        )
        .await?;
        Ok(SimConsumer {
            conn,
            channel,
            rx: tokio::sync::Mutex::new(rx),
            ended: std::sync::atomic::AtomicBool::new(false),
            unsettled: Unsettled::default(),
        })
    }
}

/// A consumer on the fake broker, on a channel of its own.
pub struct SimConsumer {
    conn: Arc<MqConn>,
    channel: u32,
    rx: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Delivery>>,
    ended: std::sync::atomic::AtomicBool,
    unsettled: Unsettled,
}

impl SimConsumer {
    async fn ack(&self, tag: u64, multiple: bool) -> Result<(), BrokerError> {
        self.conn
            .send(&MqRequest::Ack {
                channel: self.channel,
                tag,
                multiple,
            })
            .await
    }
}

impl DeliverySource for SimConsumer {
    async fn delivery_next(&self) -> Option<Delivery> {
        if self.ended.load(Ordering::SeqCst) {
            return None;
        }
        let next = self.rx.lock().await.recv().await;
        match &next {
            Some(d) => self.unsettled.delivered(d.tag),
            None => self.ended.store(true, Ordering::SeqCst),
        }
        next
    }

    async fn delivery_ack(&self, tag: u64) -> Result<(), BrokerError> {
        let sent = self.ack(tag, false).await;
        self.unsettled.settled(&[tag]);
        sent
    }

    async fn delivery_ack_many(&self, tags: &[u64]) -> Result<(), BrokerError> {
        self.unsettled
            .ack(tags, |tag, multiple| self.ack(tag, multiple))
            .await
    }

    async fn delivery_nack(&self, tag: u64, requeue: bool) -> Result<(), BrokerError> {
        let sent = self
            .conn
            .send(&MqRequest::Nack {
                channel: self.channel,
                tag,
                requeue,
            })
            .await;
        self.unsettled.settled(&[tag]);
        sent
    }

    async fn consumer_close(&self) {
        self.ended.store(true, Ordering::SeqCst);
        self.unsettled.clear();
        self.conn
            .waiters
            .lock()
            .expect("waiters")
            .deliveries
            .remove(&self.channel);
        let _ = self
            .conn
            .send(&MqRequest::ChannelClose {
                channel: self.channel,
            })
            .await;
    }
}

/// The envelope id a published body holds, if it holds one.
fn envelope_id(body: &[u8]) -> Option<Uuid> {
    #[derive(serde::Deserialize)]
    struct IdOnly {
        id: Uuid,
    }
    serde_json::from_slice::<IdOnly>(body).ok().map(|e| e.id)
}
