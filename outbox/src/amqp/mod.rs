//! The RabbitMQ adapter (lapin): the only place that names lapin.
//!
//! One connection per [`LapinBroker`], replaced by a single-flight reconnect
//! keyed on a generation number; one channel per drained batch. Connection
//! URLs can hold passwords: they are kept private and never logged or put in
//! an error; [`redact_url`] gives the loggable form.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use crate::core::ports::{Broker, Confirm, OutgoingMessage, PublishChannel};

pub mod consumer;
use crate::error::BrokerError;

/// Bound on establishing a connection (TCP + AMQP handshake).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on closing a replaced connection (lapin's close can hang).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// AMQP delivery mode for messages that survive a broker restart.
const PERSISTENT: u8 = 2;

/// A RabbitMQ connection manager implementing the [`Broker`] port.
pub struct LapinBroker {
    url: String,
    state: tokio::sync::Mutex<Option<Arc<Connection>>>,
    generation: AtomicU64,
}

impl std::fmt::Debug for LapinBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LapinBroker")
            .field("url", &redact_url(&self.url))
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .finish()
    }
}

impl LapinBroker {
    /// A broker for `url` (`amqp://user:pass@host:port/vhost`). Connects
    /// lazily, on the first channel.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            state: tokio::sync::Mutex::new(None),
            generation: AtomicU64::new(0),
        }
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The live connection, connecting if there is none.
    pub async fn connection(&self) -> Result<Arc<Connection>, BrokerError> {
        let mut state = self.state.lock().await;
        if let Some(conn) = state.as_ref()
            && conn.status().connected()
        {
            return Ok(conn.clone());
        }
        if let Some(old) = state.take() {
            close_detached(old);
        }
        let conn = Arc::new(self.connect().await?);
        self.generation.fetch_add(1, Ordering::SeqCst);
        *state = Some(conn.clone());
        Ok(conn)
    }

    async fn connect(&self) -> Result<Connection, BrokerError> {
        let connect = Connection::connect(&self.url, ConnectionProperties::default());
        match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(conn)) => {
                tracing::info!(url = %self.redacted_url(), "connected to broker");
                Ok(conn)
            }
            Ok(Err(e)) => Err(BrokerError::Connection(e.to_string())),
            Err(_) => Err(BrokerError::Connection(format!(
                "no connection within {} s",
                CONNECT_TIMEOUT.as_secs()
            ))),
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
        if let Some(old) = state.take() {
            close_detached(old);
        }
        tracing::info!(url = %self.redacted_url(), "reconnecting to broker");
        let conn = Arc::new(self.connect().await?);
        self.generation.fetch_add(1, Ordering::SeqCst);
        *state = Some(conn);
        Ok(())
    }
}

/// One batch's channel. Dropping it closes it (lapin closes channels on drop
/// without waiting), so a Phase 2 cut short by the deadline leaks nothing.
pub struct LapinChannel {
    channel: Channel,
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
        let properties = BasicProperties::default()
            .with_message_id(message.message_id.to_string().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(PERSISTENT);
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

/// A publisher confirm, mapped to the port's [`Confirm`].
pub struct LapinConfirm(lapin::PublisherConfirm);

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

/// Replaces the password of a `scheme://user:password@host/...` URL, and any
/// `password=` query parameter, with `***`, for logs and errors. Works for
/// AMQP and PostgreSQL URLs.
///
/// ```
/// assert_eq!(
///     outbox::redact_url("amqp://guest:secret@127.0.0.1:5672/%2f"),
///     "amqp://guest:***@127.0.0.1:5672/%2f"
/// );
/// assert_eq!(
///     outbox::redact_url("postgres://app@db/orders?sslmode=require&password=secret"),
///     "postgres://app@db/orders?sslmode=require&password=***"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = redact_userinfo(url);
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let redacted: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out = format!("{head}{}", redacted.join("&"));
    }
    out
}

fn redact_userinfo(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    match userinfo.find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end],
            &userinfo[..colon],
            &rest[at..]
        ),
        None => url.to_owned(),
    }
}
