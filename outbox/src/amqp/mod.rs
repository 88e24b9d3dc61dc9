//! The RabbitMQ adapter (lapin): the only place that names lapin.
//!
//! One connection per [`LapinBroker`], to one node of its list, replaced by
//! a single-flight reconnect keyed on a generation number that moves on to
//! the next node; one channel per drained batch. Connection
//! URLs can hold passwords: they are kept private and never logged or put in
//! an error; [`redact_url`] gives the loggable form.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use crate::core::ports::{
    BUCKET_HEADER, Broker, Confirm, KEY_SEQ_HEADER, KeySeq, ORDERING_KEY_HEADER, OutgoingMessage,
    PublishChannel, bucket_of,
};

pub mod consumer;
use crate::error::{BrokerError, ConfigError};
use crate::trace_context::{TRACEPARENT, TRACESTATE, TraceContext};

/// Bound on establishing a connection (TCP + AMQP handshake).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The AMQP heartbeat every connection asks for, in seconds (the broker
/// may only lower it): a connection that has heard nothing from its node
/// for twice this long is closed and the next node tried, so a node that
/// stops answering without closing (a hung process, a link that drops
/// packets) is left after about 10 s. What the broker had sent down the
/// silent link comes back to another consumer once the broker closes that
/// link itself, after about three heartbeats: a subscription applies again
/// about 15 s after its link went silent (measured, `subscribe.rs`; 29.9 s
/// at 10 s, against a bound of 30). RabbitMQ advises against less than
/// 5 s (false positives on a busy host). The broker's own default is 60 s,
/// which lapin waits out twice: two minutes.
pub const HEARTBEAT_SECS_DEFAULT: u16 = 5;
/// Longest heartbeat accepted, in seconds.
pub const HEARTBEAT_SECS_MAX: u16 = 300;
/// Bound on closing a replaced connection (lapin's close can hang).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// AMQP delivery mode for messages that survive a broker restart.
const PERSISTENT: u8 = 2;

/// A RabbitMQ connection manager implementing the [`Broker`] port, over one
/// node or several nodes of a cluster.
///
/// It holds one connection at a time, to one node. A connection is made to
/// the node the last one went to, or, when that connection was lost or is
/// being replaced, to the next node in the list, trying each node once in
/// turn; the error when none answers names every node (password hidden).
pub struct LapinBroker {
    nodes: Vec<String>,
    /// The heartbeat each connection asks for, seconds.
    heartbeat: u16,
    /// The node of the current (or last) connection; a replacement starts
    /// with the node after it.
    node: AtomicUsize,
    state: tokio::sync::Mutex<Option<Arc<Connection>>>,
    generation: AtomicU64,
}

impl std::fmt::Debug for LapinBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LapinBroker")
            .field("nodes", &self.redacted_nodes())
            .field("heartbeat_secs", &self.heartbeat)
            .field("node", &self.node.load(Ordering::Relaxed))
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .finish()
    }
}

impl LapinBroker {
    /// A broker of one node at `url` (`amqp://user:pass@host:port/vhost`).
    /// Connects lazily, on the first channel.
    pub fn new(url: impl Into<String>) -> Self {
        Self::of_nodes(vec![url.into()])
    }

    fn of_nodes(nodes: Vec<String>) -> Self {
        Self {
            nodes,
            heartbeat: HEARTBEAT_SECS_DEFAULT,
            node: AtomicUsize::new(0),
            state: tokio::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
        }
    }

    /// A broker of the cluster whose nodes `list` names: AMQP URLs
    /// separated by commas, and by nothing else (spaces around a comma are
    /// ignored; a comma inside a password is written `%2C`), tried in that
    /// order. An address holding a second `://` or a space (two addresses
    /// joined by `;`, say) is refused. Every URL is checked here; an error names
    /// `CANOPY_MQ_AMQP_URLS` and shows the list with its passwords hidden.
    ///
    /// ```
    /// let broker = outbox::LapinBroker::from_list(
    ///     "amqp://app:secret@10.0.0.1:5672/%2f, amqp://app:secret@10.0.0.2:5672/%2f",
    /// )
    /// .unwrap();
    /// assert_eq!(broker.redacted_nodes().len(), 2);
    /// let e = outbox::LapinBroker::from_list("amqp://app:secret@10.0.0.1,,").unwrap_err();
    /// assert!(e.to_string().starts_with("CANOPY_MQ_AMQP_URLS=amqp://app:***@10.0.0.1,, is invalid"));
    /// ```
    pub fn from_list(list: &str) -> Result<Self, ConfigError> {
        let invalid = |rule: String| ConfigError::Invalid {
            var: crate::config::vars::AMQP_URLS.into(),
            value: redact_list(list),
            rule,
        };
        let pieces: Vec<&str> = list.split(',').map(str::trim).collect();
        if let Some((i, _)) = split_userinfo(&pieces).first() {
            return Err(invalid(format!(
                "address {} holds a comma in its user or password: write it as %2C",
                i + 1
            )));
        }
        let mut nodes = Vec::new();
        for (i, url) in pieces.into_iter().enumerate() {
            if url.is_empty() {
                return Err(invalid(format!("address {} is empty", i + 1)));
            }
            // Only a comma separates addresses: two addresses joined by
            // anything else (`;`, `|`, a space) are one piece here.
            if url.matches("://").count() > 1 || url.contains(char::is_whitespace) {
                return Err(invalid(format!(
                    "address {} holds more than one address or a space: separate \
                     addresses with commas only",
                    i + 1
                )));
            }
            if let Err(e) = url.parse::<lapin::uri::AMQPUri>() {
                return Err(invalid(format!(
                    "address {} is not an AMQP URL: {}",
                    i + 1,
                    scrub(&e, url)
                )));
            }
            nodes.push(url.to_owned());
        }
        Ok(Self::of_nodes(nodes))
    }

    /// [`from_list`](Self::from_list) of `CANOPY_MQ_AMQP_URLS`, which must
    /// be set, with the heartbeat of `CANOPY_MQ_AMQP_HEARTBEAT_SECS` (default
    /// [`HEARTBEAT_SECS_DEFAULT`]).
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_env_in(&crate::config::Env::default())
    }

    /// [`from_env`](Self::from_env) with the variables under `env`'s prefix.
    pub fn from_env_in(env: &crate::config::Env) -> Result<Self, ConfigError> {
        use crate::config::vars;
        env.read(|lookup| {
            // Both read before either is judged: a value that is not UTF-8
            // is named even when the other is missing.
            let (list, heartbeat) = (lookup(vars::AMQP_URLS), lookup(vars::AMQP_HEARTBEAT_SECS));
            let Some(list) = list else {
                return Err(ConfigError::Invalid {
                    var: vars::AMQP_URLS.into(),
                    value: String::new(),
                    rule: "must be set to the broker's AMQP URLs, comma-separated".into(),
                });
            };
            let broker = Self::from_list(&list)?;
            match heartbeat {
                None => Ok(broker),
                Some(v) => {
                    let secs: u16 = crate::config::parse_whole(vars::AMQP_HEARTBEAT_SECS, &v)?;
                    broker.with_heartbeat(Duration::from_secs(u64::from(secs)))
                }
            }
        })
    }

    /// The same broker, its connections asking for an AMQP heartbeat of
    /// `every` (whole seconds, 1 to [`HEARTBEAT_SECS_MAX`]; default
    /// [`HEARTBEAT_SECS_DEFAULT`]). A URL's own `heartbeat` parameter wins
    /// only when shorter. There is no "off": a connection without one
    /// trusts a silent node for as long as TCP does (hours).
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = outbox::LapinBroker::new("amqp://localhost").with_heartbeat(Duration::from_secs(5));
    /// assert!(b.is_ok());
    /// let e = outbox::LapinBroker::new("amqp://localhost").with_heartbeat(Duration::ZERO);
    /// assert!(e.unwrap_err().to_string().contains("CANOPY_MQ_AMQP_HEARTBEAT_SECS=0"));
    /// ```
    pub fn with_heartbeat(mut self, every: Duration) -> Result<Self, ConfigError> {
        let secs = every.as_secs();
        if secs == 0 || secs > u64::from(HEARTBEAT_SECS_MAX) || every.subsec_nanos() != 0 {
            return Err(ConfigError::Invalid {
                var: crate::config::vars::AMQP_HEARTBEAT_SECS.into(),
                value: format!("{}", every.as_secs_f64()),
                rule: format!("must be whole seconds, >= 1 and <= {HEARTBEAT_SECS_MAX}"),
            });
        }
        self.heartbeat = secs as u16;
        Ok(self)
    }

    /// The first node's URL with any password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.nodes[0])
    }

    /// Every node's URL, passwords replaced by `***`.
    pub fn redacted_nodes(&self) -> Vec<String> {
        self.nodes.iter().map(|u| redact_url(u)).collect()
    }

    /// The live connection, connecting if there is none.
    pub async fn connection(&self) -> Result<Arc<Connection>, BrokerError> {
        let mut state = self.state.lock().await;
        if let Some(conn) = state.as_ref()
            && conn.status().connected()
        {
            return Ok(conn.clone());
        }
        self.replace(&mut state).await
    }

    /// Replaces the connection in `state` (closing the old one in the
    /// background) and bumps the generation. A connection that was made
    /// and is being replaced: its node is the one most likely down, so the
    /// next node goes first.
    async fn replace(
        &self,
        state: &mut Option<Arc<Connection>>,
    ) -> Result<Arc<Connection>, BrokerError> {
        let had = state.take().map(close_detached).is_some();
        let conn = Arc::new(self.connect(had).await?);
        self.generation.fetch_add(1, Ordering::SeqCst);
        *state = Some(conn.clone());
        Ok(conn)
    }

    /// A connection to the first node that answers, trying each node once:
    /// from the current one, or from the one after it if `move_on`.
    async fn connect(&self, move_on: bool) -> Result<Connection, BrokerError> {
        let first = self.node.load(Ordering::SeqCst) + usize::from(move_on);
        let mut failures = Vec::new();
        for k in 0..self.nodes.len() {
            let i = (first + k) % self.nodes.len();
            let url = &self.nodes[i];
            match self.connect_to(url).await {
                Ok(conn) => {
                    self.node.store(i, Ordering::SeqCst);
                    tracing::info!(node = %redact_url(url), "connected to broker");
                    return Ok(conn);
                }
                Err(why) => {
                    tracing::warn!(node = %redact_url(url), error = %why, "broker node did not answer");
                    failures.push(format!("{}: {why}", redact_url(url)));
                }
            }
        }
        Err(BrokerError::Connection(failures.join("; ")))
    }

    async fn connect_to(&self, url: &str) -> Result<Connection, String> {
        let mut uri: lapin::uri::AMQPUri = url.parse().map_err(|e: String| scrub(&e, url))?;
        uri.query.heartbeat = Some(match uri.query.heartbeat {
            Some(theirs) if theirs > 0 => theirs.min(self.heartbeat),
            _ => self.heartbeat,
        });
        let connect = Connection::connect_uri(uri, ConnectionProperties::default());
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(scrub(&e.to_string(), url)),
            Err(_) => Err(format!(
                "no connection within {} s",
                CONNECT_TIMEOUT.as_secs()
            )),
        }
    }

    /// Declares a durable topic exchange (idempotent).
    pub async fn declare_topic_exchange(&self, name: &str) -> Result<(), BrokerError> {
        let conn = self.connection().await?;
        let channel = conn.create_channel().await.map_err(channel_err)?;
        channel
            .exchange_declare(
                name.into(),
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(channel_err)
    }

    /// Closes the connection, bounded by [`CLOSE_TIMEOUT`].
    pub async fn close(&self) {
        if let Some(conn) = self.state.lock().await.take() {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, conn.close(200, "OK".into())).await;
        }
    }
}

/// A list of addresses, for an error: each one that is an AMQP URL with its
/// password hidden, every other one as `<invalid>` (empty stays empty). A
/// password holding an unencoded comma splits its URL in two: the tail
/// (`rest@host`) is no URL, and the head is hidden with it.
fn redact_list(list: &str) -> String {
    let pieces: Vec<&str> = list.split(',').map(str::trim).collect();
    let is_url = |p: &str| p.parse::<lapin::uri::AMQPUri>().is_ok();
    let cut = split_userinfo(&pieces);
    let shown: Vec<String> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if p.is_empty() {
                String::new()
            } else if is_url(p) && !cut.iter().any(|(from, to)| (*from..=*to).contains(&i)) {
                redact_url(p)
            } else {
                "<invalid>".into()
            }
        })
        .collect();
    shown.join(",")
}

/// The addresses of a comma-split list whose user or password holds a
/// comma, as spans of pieces (first, last): a piece that begins an address
/// (an `amqp:` or `amqps:` scheme) and has no `@`, up to the next piece
/// with an `@` before another address begins. Its pieces are fragments of a
/// secret, none of them to be shown (found by fuzzing `redact_url`, issue
/// 30: a password `x,,y` showed `x`; and, with a `://` later in the
/// address, `x,y@host/a://b` showed `x`).
fn split_userinfo(pieces: &[&str]) -> Vec<(usize, usize)> {
    let begins_address = |p: &str| {
        let p = p.to_ascii_lowercase();
        p.starts_with("amqp:") || p.starts_with("amqps:")
    };
    let mut spans = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        if !begins_address(p) || p.contains('@') {
            continue;
        }
        let tail = pieces[i + 1..]
            .iter()
            .take_while(|n| !begins_address(n))
            .position(|n| n.contains('@'));
        if let Some(k) = tail {
            spans.push((i, i + 1 + k));
        }
    }
    spans
}

/// Closes a replaced connection in the background, bounded: lapin's close can
/// error or never return on a broken connection.
fn close_detached(conn: Arc<Connection>) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, conn.close(200, "OK".into())).await;
        });
    }
}

fn channel_err(e: lapin::Error) -> BrokerError {
    match e.kind() {
        lapin::ErrorKind::IOError(_)
        | lapin::ErrorKind::InvalidConnectionState(_)
        | lapin::ErrorKind::MissingHeartbeatError
        | lapin::ErrorKind::RuntimeShutdownError(_) => BrokerError::Connection(e.to_string()),
        _ => BrokerError::Channel(e.to_string()),
    }
}

impl Broker for LapinBroker {
    type Channel = LapinChannel;

    async fn connection_close(&self) {
        self.close().await;
    }

    fn connection_generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    async fn channel_open(&self) -> Result<LapinChannel, BrokerError> {
        let conn = self.connection().await?;
        let channel = conn.create_channel().await.map_err(channel_err)?;
        Ok(LapinChannel { channel })
    }

    async fn connection_reconnect(&self, generation: u64) -> Result<(), BrokerError> {
        let mut state = self.state.lock().await;
        if self.generation.load(Ordering::SeqCst) != generation {
            return Ok(()); // someone else already replaced it
        }
        tracing::info!(nodes = self.nodes.len(), "reconnecting to broker");
        self.replace(&mut state).await.map(drop)
    }
}

/// One batch's channel. Dropping it closes it (lapin closes channels on drop
/// without waiting), so a Phase 2 cut short by the deadline leaks nothing.
pub struct LapinChannel {
    channel: Channel,
}

impl std::fmt::Debug for LapinChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LapinChannel")
            .field("channel", &self.channel.id())
            .finish()
    }
}

impl PublishChannel for LapinChannel {
    type Confirm = LapinConfirm;

    async fn channel_confirm_select(&mut self) -> Result<(), BrokerError> {
        self.channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(channel_err)
    }

    async fn channel_publish(
        &mut self,
        message: OutgoingMessage<'_>,
    ) -> Result<LapinConfirm, BrokerError> {
        let mut properties = BasicProperties::default()
            .with_message_id(message.message_id.to_string().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(PERSISTENT);
        properties = properties.with_headers(message_headers(&message));
        let confirm = self
            .channel
            .basic_publish(
                message.exchange.into(),
                message.routing_key.into(),
                // mandatory unset (#478): "no queue bound" is normal on a
                // fan-out topic exchange, not a failure.
                BasicPublishOptions::default(),
                message.body,
                properties,
            )
            .await
            .map_err(channel_err)?;
        Ok(LapinConfirm(confirm))
    }

    async fn channel_close(self) {
        drop(self);
    }
}

/// A message's AMQP headers: its bucket (a long string, see
/// [`bucket_of`]), the W3C trace context if it has one (long strings, as
/// every OpenTelemetry AMQP propagator reads them) and the ordering key if
/// it has one (a long string) with its number (a 64-bit integer).
fn message_headers(message: &OutgoingMessage<'_>) -> FieldTable {
    let (trace, ordering) = (message.trace, message.ordering);
    let mut headers = FieldTable::default();
    headers.insert(
        BUCKET_HEADER.into(),
        AMQPValue::LongString(bucket_of(ordering, message.message_id).to_string().into()),
    );
    if let Some(trace) = trace {
        headers.insert(
            TRACEPARENT.into(),
            AMQPValue::LongString(trace.traceparent().into()),
        );
        if let Some(state) = trace.tracestate() {
            headers.insert(TRACESTATE.into(), AMQPValue::LongString(state.into()));
        }
    }
    if let Some(o) = ordering {
        headers.insert(
            ORDERING_KEY_HEADER.into(),
            AMQPValue::LongString(o.key.as_str().into()),
        );
        headers.insert(KEY_SEQ_HEADER.into(), AMQPValue::LongLongInt(o.seq));
    }
    headers
}

/// A delivery's ordering key and number from its AMQP headers, if it
/// carries both and they are well formed (a key as
/// [`crate::EventEnvelope::with_ordering_key`] accepts it, a positive
/// integer of any AMQP integer type); anything else is no ordering.
pub(crate) fn ordering_from_headers(headers: Option<&FieldTable>) -> Option<KeySeq> {
    let headers = headers?.inner();
    let key = match headers.get(ORDERING_KEY_HEADER)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.to_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        _ => return None,
    };
    let seq = match headers.get(KEY_SEQ_HEADER)? {
        AMQPValue::LongLongInt(n) => *n,
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        _ => return None,
    };
    KeySeq::from_headers(key, seq)
}

/// A valid trace context from a delivery's AMQP headers, if it has one.
pub(crate) fn trace_from_headers(headers: Option<&FieldTable>) -> Option<TraceContext> {
    let headers = headers?.inner();
    let text = |name: &str| match headers.get(name)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    };
    TraceContext::parse(text(TRACEPARENT)?, text(TRACESTATE)).ok()
}

/// A publisher confirm, mapped to the port's [`Confirm`].
pub struct LapinConfirm(lapin::PublisherConfirm);

impl std::fmt::Debug for LapinConfirm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LapinConfirm")
    }
}

impl Future for LapinConfirm {
    type Output = Result<Confirm, BrokerError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map(|res| match res {
            Ok(Confirmation::Ack(_)) => Ok(Confirm::Ack),
            Ok(Confirmation::Nack(_)) => Ok(Confirm::Nack(
                "basic.nack: the broker refused the message (queue full with \
                 reject-publish overflow, or an internal error)"
                    .into(),
            )),
            Ok(Confirmation::NotRequested) => Err(BrokerError::Channel(
                "publisher confirms are not enabled on this channel".into(),
            )),
            Err(e) => Err(channel_err(e)),
        })
    }
}

/// Hides the secrets of a database or broker address, for logs and errors:
/// the password of `scheme://user:password@host/...` (also without the
/// `//`, and with `/`, `#`, `?` or `@` left unencoded in the password: all
/// up to the last `@` is hidden), and the value of every `password=` and
/// `sslpassword=` pair, in a URL query or a `key=value` connection string
/// (quoted values included). When in doubt it hides too much, never too
/// little.
///
/// ```
/// assert_eq!(
///     outbox::amqp::redact_url("amqp://guest:secret@127.0.0.1:5672/%2f"),
///     "amqp://guest:***@127.0.0.1:5672/%2f"
/// );
/// assert_eq!(
///     outbox::amqp::redact_url("postgres://app@db/orders?sslmode=require&password=secret"),
///     "postgres://app@db/orders?sslmode=require&password=***"
/// );
/// assert_eq!(
///     outbox::amqp::redact_url("host=db user=app password='s e c' dbname=orders"),
///     "host=db user=app password=*** dbname=orders"
/// );
/// assert_eq!(
///     outbox::amqp::redact_url(r"host=db password = 'hun\'ter 2' dbname=orders"),
///     "host=db password = *** dbname=orders"
/// );
/// assert_eq!(outbox::amqp::redact_url("password=hun;ter2 user=app"), "password=*** user=app");
/// ```
pub fn redact_url(url: &str) -> String {
    redact_pairs(&redact_userinfo(url))
}

/// Replaces each secret of `address` (as written and percent-decoded)
/// wherever it appears in `text` (an error message that may quote the
/// address), then redacts whatever address shapes remain.
pub(crate) fn scrub(text: &str, address: &str) -> String {
    let mut out = text.to_owned();
    for secret in secrets_of(address) {
        if !secret.is_empty() {
            out = out.replace(&secret, "***");
        }
    }
    redact_url(&out)
}

/// The secrets an address holds, as written and percent-decoded, longest
/// first.
fn secrets_of(address: &str) -> Vec<String> {
    let mut found = Vec::new();
    if let Some((colon, at)) = userinfo_bounds(address) {
        found.push(address[colon + 1..at].to_owned());
    }
    for (from, to) in pair_values(address) {
        let value = &address[from..to];
        found.push(value.to_owned());
        if let Some(inner) = value.strip_prefix('\'') {
            let inner = inner.strip_suffix('\'').unwrap_or(inner);
            found.push(inner.to_owned());
            // As libpq reads it (what an error message may quote).
            found.push(inner.replace("\\'", "'").replace("\\\\", "\\"));
        }
    }
    let decoded: Vec<String> = found.iter().map(|s| percent_decode(s)).collect();
    found.extend(decoded);
    found.sort_by_key(|s| std::cmp::Reverse(s.len()));
    found.dedup();
    found
}

/// Where a password sits in `scheme://user:password@rest`,
/// `scheme:user:password@rest` or a scheme-less `user:password@rest`: (the
/// colon before it, the last `@`). Without `://` (or with no userinfo after
/// it) the text before it is read as a scheme, a user and a password when
/// it has two colons before the `@`, else as a user and a password: a
/// forgotten scheme, or an address run into another, must not show the
/// password (both found by fuzzing `redact_url`).
fn userinfo_bounds(url: &str) -> Option<(usize, usize)> {
    let head = match url.find("://") {
        Some(i) => {
            let start = i + 3;
            let after = url[start..].rfind('@').and_then(|at| {
                let colon = url[start..start + at].find(':')?;
                Some((start + colon, start + at))
            });
            if after.is_some() {
                return after;
            }
            &url[..i]
        }
        None => url,
    };
    let first = head.find(':')?;
    // A scheme or a user: one word (free text around a colon is neither).
    let word = &head[..first];
    if word.is_empty() || word.contains(|c: char| c.is_whitespace() || "/@?#'\"".contains(c)) {
        return None;
    }
    let at = first + head[first..].rfind('@')?;
    // A second colon starts the password only when no `@` comes before it:
    // `u:pw@h:x@y` is a user and a password, then more text.
    let colon = head[first + 1..at]
        .find(':')
        .map(|c| first + 1 + c)
        .filter(|&second| !head[first..second].contains('@'))
        .unwrap_or(first);
    Some((colon, at))
}

fn redact_userinfo(url: &str) -> String {
    match userinfo_bounds(url) {
        Some((colon, at)) => format!("{}:***{}", &url[..colon], &url[at..]),
        None => url.to_owned(),
    }
}

/// The value spans of every `password` / `sslpassword` pair: the key
/// after the start, `?`, `&`, `;` or whitespace, then `=` with optional
/// whitespace around it (libpq's `key = value`). In a URL query (the key
/// after `?` or `&`) an unquoted value runs to the next `&`, `#` or
/// whitespace; elsewhere (a libpq connection string) to the next
/// whitespace, as libpq reads it, `;` and `&` included. A quoted value runs
/// to its closing quote, past `\'` and `\\` escapes.
fn pair_values(text: &str) -> Vec<(usize, usize)> {
    let lower = text.to_ascii_lowercase();
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for key in ["sslpassword", "password"] {
        let mut from = 0;
        while let Some(i) = lower[from..].find(key).map(|i| i + from) {
            from = i + key.len();
            let before = lower[..i].chars().next_back();
            let boundary = before.is_none_or(|c| "?&;".contains(c) || c.is_whitespace());
            let in_query = before.is_some_and(|c| "?&".contains(c));
            let rest = &text[from..];
            let after_key = rest.len() - rest.trim_start().len();
            if !boundary || !rest[after_key..].starts_with('=') {
                continue;
            }
            let value_at = from + after_key + 1;
            let value = &text[value_at..];
            let start = value_at + (value.len() - value.trim_start().len());
            let value = &text[start..];
            let len = match value.strip_prefix('\'') {
                Some(quoted) => quoted_len(quoted).map_or(value.len(), |end| end + 2),
                None => value
                    .find(|c: char| c.is_whitespace() || (in_query && "&#".contains(c)))
                    .unwrap_or(value.len()),
            };
            spans.push((start, start + len));
        }
    }
    spans.sort();
    spans
}

/// Where the closing quote of a libpq quoted value is (`quoted` starts
/// after the opening one), past `\` escapes.
fn quoted_len(quoted: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in quoted.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '\'' => return Some(i),
            _ => {}
        }
    }
    None
}

fn redact_pairs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for (from, to) in pair_values(text) {
        if from < last {
            continue;
        }
        out.push_str(&text[last..from]);
        out.push_str("***");
        last = to;
    }
    out.push_str(&text[last..]);
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let (Some(h), Some(l)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_node_list_keeps_its_order_and_trims() {
        let b = LapinBroker::from_list(" amqp://u:p@a:5672/%2f ,amqp://u:p@b:5672/%2f").unwrap();
        assert_eq!(
            b.redacted_nodes(),
            ["amqp://u:***@a:5672/%2f", "amqp://u:***@b:5672/%2f"]
        );
        assert_eq!(b.redacted_url(), "amqp://u:***@a:5672/%2f");
        assert_eq!(LapinBroker::new("amqp://x@h").redacted_nodes().len(), 1);
    }

    #[test]
    fn a_bad_node_list_names_the_variable_and_the_address_never_a_password() {
        for (list, rule) in [
            ("", "address 1 is empty"),
            ("amqp://u:secret@a,", "address 2 is empty"),
            (
                "amqp://u:secret@a,http://u:secret@b",
                "address 2 is not an AMQP URL",
            ),
            ("amqp://u:secret@a:notaport", "address 1 is not an AMQP URL"),
        ] {
            let e = LapinBroker::from_list(list).unwrap_err().to_string();
            assert!(e.starts_with("CANOPY_MQ_AMQP_URLS="), "{e}");
            assert!(e.contains(rule), "{rule:?} not in {e}");
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn a_listed_password_is_hidden_even_when_an_unencoded_comma_splits_it() {
        for list in [
            "amqp://u:pa,ss@h/%2f",
            "amqp://u:12,34@h/%2f",
            "amqp://u:ok@a,amqp://u:pa,ss@h",
        ] {
            let shown = redact_list(list);
            for secret in ["pa", "ss@", "12", "34@"] {
                assert!(
                    !shown.contains(secret),
                    "{secret:?} shown in {shown} of {list}"
                );
            }
        }
        assert_eq!(redact_list("amqp://u:p@a,,"), "amqp://u:***@a,,");
    }

    /// The headers of a message with this trace context and ordering.
    fn headers_of(trace: Option<&TraceContext>, ordering: Option<&KeySeq>) -> FieldTable {
        message_headers(&OutgoingMessage {
            exchange: "canopy.events",
            routing_key: "orders.created",
            message_id: uuid::Uuid::nil(),
            body: b"{}",
            trace,
            ordering,
        })
    }

    #[test]
    fn trace_headers_round_trip() {
        let tc = TraceContext::parse(TP, Some("congo=t61rcWkgMzE")).unwrap();
        let headers = headers_of(Some(&tc), None);
        assert_eq!(trace_from_headers(Some(&headers)), Some(tc));
    }

    #[test]
    fn every_message_carries_its_bucket_as_a_long_string() {
        let ks = KeySeq {
            key: "order-7".into(),
            seq: 42,
        };
        let bucket = |h: &FieldTable| match h.inner().get(BUCKET_HEADER) {
            Some(AMQPValue::LongString(s)) => s.to_string(),
            other => panic!("bucket header {other:?}"),
        };
        let keyed = headers_of(None, Some(&ks));
        assert_eq!(
            bucket(&keyed),
            bucket_of(Some(&ks), uuid::Uuid::nil()).to_string()
        );
        let plain = headers_of(None, None);
        assert_eq!(
            bucket(&plain),
            bucket_of(None, uuid::Uuid::nil()).to_string()
        );
        assert_eq!(plain.inner().len(), 1, "{plain:?}");
    }

    #[test]
    fn ordering_headers_round_trip_beside_the_trace_context() {
        let tc = TraceContext::parse(TP, None).unwrap();
        let ks = KeySeq {
            key: "order-7".into(),
            seq: 42,
        };
        let both = headers_of(Some(&tc), Some(&ks));
        assert_eq!(trace_from_headers(Some(&both)), Some(tc));
        assert_eq!(ordering_from_headers(Some(&both)), Some(ks.clone()));
        let alone = headers_of(None, Some(&ks));
        assert_eq!(ordering_from_headers(Some(&alone)), Some(ks));
        assert_eq!(ordering_from_headers(Some(&headers_of(None, None))), None);
    }

    #[test]
    fn malformed_ordering_headers_are_no_ordering() {
        let table = |key: AMQPValue, seq: Option<AMQPValue>| {
            let mut t = FieldTable::default();
            t.insert(ORDERING_KEY_HEADER.into(), key);
            if let Some(seq) = seq {
                t.insert(KEY_SEQ_HEADER.into(), seq);
            }
            t
        };
        let key = || AMQPValue::LongString("k".into());
        for hostile in [
            table(key(), None),
            table(key(), Some(AMQPValue::LongLongInt(0))),
            table(key(), Some(AMQPValue::LongLongInt(-3))),
            table(key(), Some(AMQPValue::LongString("7".into()))),
            table(key(), Some(AMQPValue::Double(7.0))),
            table(
                AMQPValue::LongString("".into()),
                Some(AMQPValue::LongLongInt(1)),
            ),
            table(
                AMQPValue::LongString("a\0b".into()),
                Some(AMQPValue::LongLongInt(1)),
            ),
            table(
                AMQPValue::LongString(vec![0xff, 0xfe].into()),
                Some(AMQPValue::LongLongInt(1)),
            ),
            table(
                AMQPValue::LongString("x".repeat(256).into()),
                Some(AMQPValue::LongLongInt(1)),
            ),
            table(AMQPValue::Boolean(true), Some(AMQPValue::LongLongInt(1))),
            FieldTable::default(),
        ] {
            assert_eq!(ordering_from_headers(Some(&hostile)), None, "{hostile:?}");
        }
        let narrow = table(key(), Some(AMQPValue::ShortUInt(9)));
        assert_eq!(ordering_from_headers(Some(&narrow)).map(|o| o.seq), Some(9));
    }

    #[test]
    fn whatever_a_broker_delivers_as_trace_headers_is_ignored_unless_valid() {
        let table = |value: AMQPValue| {
            let mut t = FieldTable::default();
            t.insert(TRACEPARENT.into(), value);
            t
        };
        for hostile in [
            table(AMQPValue::Boolean(true)),
            table(AMQPValue::LongString("garbage".into())),
            table(AMQPValue::LongString(vec![0xff, 0xfe, 0x00].into())),
            table(AMQPValue::LongString(
                format!("{TP}{}", "x".repeat(1 << 16)).into(),
            )),
            table(AMQPValue::FieldTable(FieldTable::default())),
            FieldTable::default(),
        ] {
            assert_eq!(trace_from_headers(Some(&hostile)), None, "{hostile:?}");
        }
        assert_eq!(trace_from_headers(None), None);
        // A valid parent with a tracestate that is not text: the parent
        // still counts, the state is dropped.
        let mut t = table(AMQPValue::LongString(TP.into()));
        t.insert(TRACESTATE.into(), AMQPValue::LongLongInt(7));
        assert_eq!(
            trace_from_headers(Some(&t)).map(|c| c.tracestate().map(str::to_owned)),
            Some(None)
        );
    }
}
