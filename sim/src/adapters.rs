//! The simulation adapters of the ports: the production drainer reaches the
//! fakes through these, over `turmoil::net`, exactly as it reaches
//! PostgreSQL and RabbitMQ through sqlx and lapin. Time is tokio's, which
//! turmoil simulates; entropy is a seeded SplitMix64.
//!
//! The adapters also carry the **crash and pause points** of the fault
//! catalogue: when a point fires, the adapter records it and parks the
//! calling task forever (a crash, which the world then applies to the host)
//! or sleeps (a stop-the-world pause).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use outbox::core::ports::{
    Broker, ClaimParams, ClaimedRow, Confirm, ConsumerBroker, Delivery, DeliverySource,
    FailOutcome, OutboxStats, OutboxStore, OutgoingMessage, ParkedRow, PublishChannel, RowFailure,
    SubscriptionSpec, UnparkSelector,
};
use outbox::{BrokerError, StoreError};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::mq_fake::MQ_PORT;
use crate::pg_fake::PG_PORT;
use crate::trace::{Event, Trace};
use crate::wire::{
    HEARTBEAT_EVERY, HEARTBEAT_TIMEOUT, MqReply, MqRequest, PgReply, PgRequest, read_frame,
    write_frame,
};

/// Bound on establishing a simulated connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on one store request: the production adapter's bound
/// (`outbox::pg::STORE_CALL_TIMEOUT`), so a black-holed database connection
/// wedges the simulated drainer exactly as long as the real one.
pub const STORE_REQUEST_TIMEOUT: Duration = outbox::pg::STORE_CALL_TIMEOUT;

/// The claim transaction's idle timeout, as in `pg/sql/outbox_claim_plan.sql`.
pub const CLAIM_IDLE_IN_TX_TIMEOUT: Duration = Duration::from_secs(10);

/// Where in a tick a crash or pause can be injected.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Point {
    /// Phase 1 returned; nothing published yet.
    AfterClaim,
    /// Some of the batch is published, some not.
    MidPublish,
    /// Everything confirmed; the mark not yet sent.
    BeforeMark,
    /// The mark was applied but its reply not yet seen.
    MidMark,
    /// Consumer: the handler's transaction committed; the ack not yet sent.
    AfterCommit,
    /// Consumer: the handler wrote its effect and has not returned.
    MidHandler,
}

/// Crash and pause probabilities per point, shared by a drainer host's
/// adapters and changed by the world.
#[derive(Debug, Clone, Default)]
pub struct Hooks {
    inner: Arc<Mutex<HooksInner>>,
}

#[derive(Debug, Default)]
struct HooksInner {
    crash_prob: BTreeMap<Point, f64>,
    pause: BTreeMap<Point, (f64, Duration)>,
    rng: Option<SmallRng>,
    /// Set when a crash point fired; the world crashes the host.
    crash_requested: bool,
}

impl Hooks {
    /// Hooks with their own seeded RNG.
    pub fn new(seed: u64) -> Self {
        let hooks = Self::default();
        hooks.inner.lock().expect("hooks").rng = Some(SmallRng::seed_from_u64(seed));
        hooks
    }

    /// Sets the crash probability at `point`.
    pub fn set_crash(&self, point: Point, prob: f64) {
        self.inner
            .lock()
            .expect("hooks")
            .crash_prob
            .insert(point, prob);
    }

    /// Sets a pause of `length` with probability `prob` at `point`.
    pub fn set_pause(&self, point: Point, prob: f64, length: Duration) {
        self.inner
            .lock()
            .expect("hooks")
            .pause
            .insert(point, (prob, length));
    }

    /// Clears every crash and pause (faults heal).
    pub fn clear(&self) {
        let mut h = self.inner.lock().expect("hooks");
        h.crash_prob.clear();
        h.pause.clear();
    }

    /// Takes the crash request, if a point fired.
    pub fn take_crash_request(&self) -> bool {
        std::mem::take(&mut self.inner.lock().expect("hooks").crash_requested)
    }

    /// Passes `point`: may pause, or crash (never returns).
    pub async fn at(&self, point: Point, who: &str, trace: &Trace) {
        let (crash, pause) = {
            let mut h = self.inner.lock().expect("hooks");
            let crash_p = h.crash_prob.get(&point).copied().unwrap_or(0.0);
            let pause = h.pause.get(&point).copied();
            if crash_p <= 0.0 && pause.is_none_or(|(p, _)| p <= 0.0) {
                return; // nothing armed here (unseeded hooks never are)
            }
            let rng = h.rng.as_mut().expect("hooks seeded");
            let crash = crash_p > 0.0 && rng.random_bool(crash_p.min(1.0));
            let pause = pause.filter(|(p, _)| *p > 0.0 && rng.random_bool(p.min(1.0)));
            if crash {
                h.crash_requested = true;
            }
            (crash, pause.map(|(_, d)| d))
        };
        if crash {
            trace.now(Event::Fault(format!("{who} crashes at {point:?}")));
            std::future::pending::<()>().await;
        }
        if let Some(d) = pause {
            trace.now(Event::Fault(format!(
                "{who} paused {} ms at {point:?}",
                d.as_millis()
            )));
            tokio::time::sleep(d).await;
        }
    }
}

pub(crate) async fn connect(host: &str, port: u16) -> Result<turmoil::net::TcpStream, String> {
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        turmoil::net::TcpStream::connect((host, port)),
    )
    .await
    {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("connect to {host}: {e}")),
        Err(_) => Err(format!("connect to {host}: timed out")),
    }
}

/// A connection to the fake PostgreSQL, as one client (a drainer replica or
/// the workload) uses it.
pub struct PgClient {
    client: String,
    conn: tokio::sync::Mutex<Option<turmoil::net::TcpStream>>,
    trace: Trace,
}

impl PgClient {
    /// A lazily connecting client named `client` in the trace.
    pub fn new(client: impl Into<String>, trace: Trace) -> Self {
        Self {
            client: client.into(),
            conn: tokio::sync::Mutex::new(None),
            trace,
        }
    }

    /// Sends one request and waits (bounded) for its reply. Any transport
    /// failure drops the connection, so the server rolls back what was open.
    pub async fn call(&self, req: PgRequest) -> Result<PgReply, StoreError> {
        let mut guard = self.conn.lock().await;
        self.call_on(&mut guard, req).await
    }

    async fn call_on(
        &self,
        guard: &mut Option<turmoil::net::TcpStream>,
        req: PgRequest,
    ) -> Result<PgReply, StoreError> {
        if guard.is_none() {
            *guard = Some(connect_pg(&self.client).await?);
        }
        request(guard, &req).await
    }

    /// Drops the connection (the server rolls back an open transaction).
    pub async fn disconnect(&self) {
        *self.conn.lock().await = None;
    }

    /// Runs `BEGIN; body; COMMIT` on one connection, held for the whole
    /// transaction (as a pooled connection is), recording the client's view
    /// of the transaction in the trace. On any failure the connection is
    /// dropped, which rolls the transaction back at the server.
    pub async fn in_tx(&self, body: Vec<PgRequest>) -> Result<Vec<PgReply>, StoreError> {
        let mut guard = self.conn.lock().await;
        self.trace.now(Event::TxBegin {
            client: self.client.clone(),
        });
        let result = async {
            self.call_on(&mut guard, PgRequest::Begin).await?;
            let mut replies = Vec::with_capacity(body.len());
            for req in body.into_iter().map(Some).chain([None]) {
                // Between a reply and the next statement the transaction
                // waits on this client: the checker's #478 rule looks there.
                self.trace.now(Event::TxIdle {
                    client: self.client.clone(),
                });
                self.trace.now(Event::TxResumed {
                    client: self.client.clone(),
                });
                match req {
                    Some(req) => replies.push(self.call_on(&mut guard, req).await?),
                    None => {
                        self.call_on(&mut guard, PgRequest::Commit).await?;
                    }
                }
            }
            Ok(replies)
        }
        .await;
        if result.is_err() {
            *guard = None;
        }
        self.trace.now(Event::TxEnd {
            client: self.client.clone(),
        });
        result
    }
}

/// Opens a connection to the fake PostgreSQL and names `client` on it.
pub(crate) async fn connect_pg(client: &str) -> Result<turmoil::net::TcpStream, StoreError> {
    let mut s = connect("pg", PG_PORT)
        .await
        .map_err(StoreError::Unavailable)?;
    let hello = PgRequest::Hello {
        client: client.to_owned(),
    };
    exchange(&mut s, &hello)
        .await
        .map_err(StoreError::Unavailable)?;
    Ok(s)
}

/// Sends one request on the connection in `slot`. A refused statement is a
/// `Statement` error; a transport failure drops the connection (the server
/// rolls back what was open) and is `Unavailable`, as is an empty slot.
pub(crate) async fn request(
    slot: &mut Option<turmoil::net::TcpStream>,
    req: &PgRequest,
) -> Result<PgReply, StoreError> {
    let Some(stream) = slot.as_mut() else {
        return Err(StoreError::Unavailable("connection lost".into()));
    };
    match exchange(stream, req).await {
        Ok(PgReply::Error(e)) => Err(StoreError::Statement(e)),
        Ok(reply) => Ok(reply),
        Err(e) => {
            *slot = None;
            Err(StoreError::Unavailable(e))
        }
    }
}

pub(crate) async fn exchange(
    s: &mut turmoil::net::TcpStream,
    req: &PgRequest,
) -> Result<PgReply, String> {
    let io = async {
        write_frame(s, req).await?;
        read_frame::<_, PgReply>(s).await
    };
    match tokio::time::timeout(STORE_REQUEST_TIMEOUT, io).await {
        Ok(Ok(Some(reply))) => Ok(reply),
        Ok(Ok(None)) => Err("connection closed by the server".into()),
        Ok(Err(e)) => Err(format!("connection lost: {e}")),
        Err(_) => Err("request timed out".into()),
    }
}

pub(crate) fn unexpected(reply: PgReply) -> StoreError {
    StoreError::Statement(format!("unexpected reply {reply:?}"))
}

/// The `OutboxStore` port over the fake PostgreSQL.
pub struct SimStore {
    pg: PgClient,
    replica: String,
    hooks: Hooks,
    trace: Trace,
}

impl SimStore {
    /// A store for `replica`.
    pub fn new(replica: impl Into<String>, trace: Trace, hooks: Hooks) -> Self {
        let replica = replica.into();
        Self {
            pg: PgClient::new(replica.clone(), trace.clone()),
            replica,
            hooks,
            trace,
        }
    }
}

impl OutboxStore for SimStore {
    async fn outbox_claim(&self, p: ClaimParams<'_>) -> Result<Vec<ClaimedRow>, StoreError> {
        // Like the PostgreSQL adapter: one short transaction around the
        // claim, with the same idle-in-transaction timeout.
        let mut replies = self
            .pg
            .in_tx(vec![
                PgRequest::SetIdleInTxTimeout {
                    ms: CLAIM_IDLE_IN_TX_TIMEOUT.as_millis() as u64,
                },
                PgRequest::Claim {
                    replica: p.replica_id.to_owned(),
                    batch_size: p.batch_size,
                    lease_ttl_ms: p.lease_ttl.as_millis() as u64,
                },
            ])
            .await?;
        let rows = match replies.pop() {
            Some(PgReply::Rows(rows)) => rows,
            Some(other) => return Err(unexpected(other)),
            None => return Err(StoreError::Statement("no reply".into())),
        };
        if !rows.is_empty() {
            self.hooks
                .at(Point::AfterClaim, &self.replica, &self.trace)
                .await;
        }
        Ok(rows
            .into_iter()
            .map(|r| ClaimedRow {
                id: r.id,
                routing_key: r.routing_key,
                body: r.body.into_bytes(),
                attempts: r.attempts,
            })
            .collect())
    }

    async fn outbox_mark_published(
        &self,
        replica_id: &str,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        self.hooks
            .at(Point::BeforeMark, &self.replica, &self.trace)
            .await;
        let reply = self
            .pg
            .call(PgRequest::MarkPublished {
                replica: replica_id.to_owned(),
                ids: ids.to_vec(),
            })
            .await?;
        self.hooks
            .at(Point::MidMark, &self.replica, &self.trace)
            .await;
        match reply {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_mark_failed(
        &self,
        replica_id: &str,
        failures: &[RowFailure],
        max_attempts: u32,
    ) -> Result<FailOutcome, StoreError> {
        let reply = self
            .pg
            .call(PgRequest::MarkFailed {
                replica: replica_id.to_owned(),
                failures: failures.iter().map(|f| (f.id, f.error.clone())).collect(),
                max_attempts,
            })
            .await?;
        match reply {
            PgReply::Failed { recorded, parked } => Ok(FailOutcome { recorded, parked }),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_release(&self, replica_id: &str, ids: &[Uuid]) -> Result<u64, StoreError> {
        match self
            .pg
            .call(PgRequest::Release {
                replica: replica_id.to_owned(),
                ids: ids.to_vec(),
            })
            .await?
        {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        match self.pg.call(PgRequest::Stats).await? {
            PgReply::Stats {
                pending,
                oldest_age_ms,
                parked,
            } => Ok(OutboxStats {
                pending,
                oldest_unpublished_age_secs: oldest_age_ms as f64 / 1000.0,
                parked,
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_delete_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        match self
            .pg
            .call(PgRequest::DeletePublished {
                older_than_ms: older_than.as_millis() as u64,
                limit,
            })
            .await?
        {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_list_parked(&self, limit: u32) -> Result<Vec<ParkedRow>, StoreError> {
        let epoch = time::OffsetDateTime::UNIX_EPOCH;
        match self.pg.call(PgRequest::ListParked { limit }).await? {
            PgReply::Parked(rows) => Ok(rows
                .into_iter()
                .map(|r| ParkedRow {
                    id: r.id,
                    routing_key: r.routing_key,
                    attempts: r.attempts,
                    last_error: r.last_error,
                    enqueued_at: epoch + Duration::from_millis(r.enqueued_ms),
                    parked_at: epoch + Duration::from_millis(r.parked_ms),
                })
                .collect()),
            other => Err(unexpected(other)),
        }
    }

    async fn outbox_unpark(&self, selector: &UnparkSelector) -> Result<u64, StoreError> {
        let ids = match selector {
            UnparkSelector::Ids(ids) => Some(ids.clone()),
            UnparkSelector::All => None,
        };
        match self.pg.call(PgRequest::Unpark { ids }).await? {
            PgReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }
}

/// One live connection to the fake broker.
struct MqConn {
    writer: tokio::sync::Mutex<turmoil::net::tcp::OwnedWriteHalf>,
    waiters: Arc<Mutex<Waiters>>,
    reader: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Waiters {
    ok: BTreeMap<u32, oneshot::Sender<()>>,
    confirms: BTreeMap<(u32, u64), oneshot::Sender<bool>>,
    /// Consumers' delivery queues, by channel.
    deliveries: BTreeMap<u32, tokio::sync::mpsc::UnboundedSender<Delivery>>,
    dead: bool,
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
            conn: tokio::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
            next_channel: AtomicU32::new(1),
            hooks,
            trace,
        }
    }

    async fn connect(&self) -> Result<Arc<MqConn>, BrokerError> {
        let stream = connect("rabbit", MQ_PORT)
            .await
            .map_err(BrokerError::Connection)?;
        let (mut r, mut w) = stream.into_split();
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
        let reader = tokio::spawn(async move {
            // A broker silent past the heartbeat timeout is gone.
            while let Ok(Ok(Some(frame))) =
                tokio::time::timeout(HEARTBEAT_TIMEOUT, read_frame::<_, MqReply>(&mut r)).await
            {
                let mut w = reader_waiters.lock().expect("waiters");
                match frame {
                    MqReply::Ok { channel } => {
                        if let Some(tx) = w.ok.remove(&channel) {
                            let _ = tx.send(());
                        }
                    }
                    MqReply::Confirm { channel, seq, ack } => {
                        if let Some(tx) = w.confirms.remove(&(channel, seq)) {
                            let _ = tx.send(ack);
                        }
                    }
                    MqReply::ChannelClosed { channel, .. } => {
                        w.ok.remove(&channel);
                        w.confirms.retain(|(c, _), _| *c != channel);
                        w.deliveries.remove(&channel);
                    }
                    MqReply::Heartbeat => {}
                    MqReply::Deliver {
                        channel,
                        tag,
                        message_id,
                        routing_key,
                        body,
                        redelivered,
                    } => {
                        if let Some(tx) = w.deliveries.get(&channel) {
                            let _ = tx.send(Delivery {
                                tag,
                                message_id: Some(message_id.to_string()),
                                routing_key,
                                body: body.into_bytes(),
                                redelivered,
                            });
                        }
                    }
                }
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
                tokio::time::sleep(HEARTBEAT_EVERY).await;
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
        *guard = None;
        let c = self.connect().await?;
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
        let c = self.connect().await?;
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
            w.confirms.insert((self.channel, self.seq), tx);
        }
        self.trace.now(Event::PublishSent {
            client: self.client.clone(),
            message_id: m.message_id,
        });
        self.conn
            .send(&MqRequest::Publish {
                channel: self.channel,
                exchange: m.exchange.to_owned(),
                routing_key: m.routing_key.to_owned(),
                message_id: m.message_id,
                body: String::from_utf8_lossy(m.body).into_owned(),
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
        self.call_ok(
            &conn,
            channel,
            MqRequest::DeclareSubscription {
                channel,
                queue: spec.queue.clone(),
                exchange: spec.exchange.clone(),
                bindings: spec.bindings.clone(),
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
                queue: spec.queue.clone(),
            },
        )
        .await?;
        Ok(SimConsumer {
            conn,
            channel,
            rx: tokio::sync::Mutex::new(rx),
            ended: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// A consumer on the fake broker, shared by the subscriber's workers.
pub struct SimConsumer {
    conn: Arc<MqConn>,
    channel: u32,
    rx: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Delivery>>,
    ended: std::sync::atomic::AtomicBool,
}

impl DeliverySource for SimConsumer {
    async fn delivery_next(&self) -> Option<Delivery> {
        if self.ended.load(Ordering::SeqCst) {
            return None;
        }
        let next = self.rx.lock().await.recv().await;
        if next.is_none() {
            self.ended.store(true, Ordering::SeqCst);
        }
        next
    }

    async fn delivery_ack(&self, tag: u64) -> Result<(), BrokerError> {
        self.conn
            .send(&MqRequest::Ack {
                channel: self.channel,
                tag,
            })
            .await
    }

    async fn delivery_nack(&self, tag: u64, requeue: bool) -> Result<(), BrokerError> {
        self.conn
            .send(&MqRequest::Nack {
                channel: self.channel,
                tag,
                requeue,
            })
            .await
    }

    async fn consumer_close(&self) {
        self.ended.store(true, Ordering::SeqCst);
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
