//! The adapters' transport: connections to the fakes over the engine's
//! network,
//! one request and reply at a time, each bounded as the production adapters
//! bound theirs, and the client's view of its transactions for the #478
//! check.

use std::time::Duration;

use outbox::StoreError;

use crate::fakes::pg::PG_PORT;
use crate::trace::{Event, Trace};
use crate::wire::{PgReply, PgRequest, read_frame, write_frame};

/// Bound on establishing a simulated connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on one store request: the store port's contract
/// (`outbox::core::ports::STORE_CALL_TIMEOUT`), the production adapter's bound, so a black-holed database connection
/// wedges the simulated drainer exactly as long as the real one.
pub const STORE_REQUEST_TIMEOUT: Duration = outbox::core::ports::STORE_CALL_TIMEOUT;

pub(crate) async fn connect(
    host: &str,
    port: u16,
) -> Result<crate::engine::net::TcpStream, String> {
    match crate::engine::timeout(CONNECT_TIMEOUT, crate::engine::net::connect(host, port)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("connect to {host}: {e}")),
        Err(_) => Err(format!("connect to {host}: timed out")),
    }
}

/// A connection to the fake PostgreSQL, as one client (a drainer replica or
/// the workload) uses it.
pub struct PgClient {
    client: String,
    conn: tokio::sync::Mutex<Option<crate::engine::net::TcpStream>>,
    trace: Trace,
    /// How its sessions commit (`synchronous_commit`).
    synchronous_commit: bool,
}

impl PgClient {
    /// A lazily connecting client named `client` in the trace.
    pub fn new(client: impl Into<String>, trace: Trace) -> Self {
        Self {
            client: client.into(),
            conn: tokio::sync::Mutex::new(None),
            trace,
            synchronous_commit: true,
        }
    }

    /// [`PgClient::new`] for the drainer's own sessions, which commit
    /// asynchronously (`outbox::pg::DRAIN_SESSION_SETTINGS`).
    pub fn drainer(client: impl Into<String>, trace: Trace) -> Self {
        Self {
            synchronous_commit: false,
            ..Self::new(client, trace)
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
        guard: &mut Option<crate::engine::net::TcpStream>,
        req: PgRequest,
    ) -> Result<PgReply, StoreError> {
        if guard.is_none() {
            let (stream, _) = connect_pg_session(&self.client, self.synchronous_commit).await?;
            *guard = Some(stream);
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
pub(crate) async fn connect_pg(client: &str) -> Result<crate::engine::net::TcpStream, StoreError> {
    connect_pg_session(client, true).await.map(|(s, _)| s)
}

/// [`connect_pg`], with the number of the session it opened, committing
/// synchronously or not.
pub(crate) async fn connect_pg_session(
    client: &str,
    synchronous_commit: bool,
) -> Result<(crate::engine::net::TcpStream, u64), StoreError> {
    let mut s = connect("pg", PG_PORT)
        .await
        .map_err(StoreError::Unavailable)?;
    let hello = PgRequest::Hello {
        client: client.to_owned(),
        synchronous_commit,
    };
    match exchange(&mut s, &hello).await {
        Ok(PgReply::Session { id }) => Ok((s, id)),
        Ok(other) => Err(unexpected(other)),
        Err(e) => Err(StoreError::Unavailable(e)),
    }
}

/// Sends one request on the connection in `slot`. A refused statement is a
/// `Statement` error; a transport failure drops the connection (the server
/// rolls back what was open) and is `Unavailable`, as is an empty slot.
///
/// The connection is out of its slot while the request is in flight: a
/// request cancelled midway (its future dropped, by a handler's deadline
/// say) takes the connection with it, as sqlx does not reuse one whose
/// reply it never read. Left in the slot, that reply would answer the next
/// request on it, and every one after (found on madsim, where a partition
/// holds a reply back past the handler's deadline:
/// `producer_and_consumer_swarm` seed 26 retried a consumer's batch in
/// place forever on "unexpected reply Ok").
pub(crate) async fn request(
    slot: &mut Option<crate::engine::net::TcpStream>,
    req: &PgRequest,
) -> Result<PgReply, StoreError> {
    let Some(mut stream) = slot.take() else {
        return Err(StoreError::Unavailable("connection lost".into()));
    };
    match exchange(&mut stream, req).await {
        Ok(PgReply::Error(e)) => {
            *slot = Some(stream);
            Err(e.into_store_error())
        }
        Ok(reply) => {
            *slot = Some(stream);
            Ok(reply)
        }
        Err(e) => Err(StoreError::Unavailable(e)),
    }
}

pub(crate) async fn exchange(
    s: &mut crate::engine::net::TcpStream,
    req: &PgRequest,
) -> Result<PgReply, String> {
    let io = async {
        write_frame(s, req).await?;
        read_frame::<_, PgReply>(s).await
    };
    match crate::engine::timeout(STORE_REQUEST_TIMEOUT, io).await {
        Ok(Ok(Some(reply))) => Ok(reply),
        Ok(Ok(None)) => Err("connection closed by the server".into()),
        Ok(Err(e)) => Err(format!("connection lost: {e}")),
        Err(_) => Err("request timed out".into()),
    }
}

pub(crate) fn unexpected(reply: PgReply) -> StoreError {
    StoreError::Statement(format!("unexpected reply {reply:?}"))
}

/// `replication_positions.sql` on `client`: the durability gates' view
/// of the fake's WAL and its standbys.
pub async fn replication_positions(
    client: &PgClient,
    standbys: &[String],
) -> Result<outbox::core::ports::ReplicationPositions, outbox::StoreError> {
    use outbox::core::ports::{ReplicationPositions, StandbyFlush, WalPosition};
    let reply = client
        .call(crate::wire::PgRequest::ReplicationPositions {
            standbys: standbys.to_vec(),
        })
        .await?;
    match reply {
        crate::wire::PgReply::Replication {
            flushed,
            timeline,
            standbys,
        } => Ok(ReplicationPositions {
            flushed: WalPosition(flushed),
            timeline,
            standbys: standbys
                .into_iter()
                .map(|s| s.map_or(StandbyFlush::Absent, |at| StandbyFlush::At(WalPosition(at))))
                .collect(),
        }),
        other => Err(unexpected(other)),
    }
}
