//! The fake PostgreSQL's transport: a listener on the simulated `pg` host
//! of either engine, one task per connection feeding the connection's
//! [`Session`] one request at a time with the simulated time it arrived,
//! waiting out locks (until the lock comes, or `statement_timeout`,
//! `lock_timeout`, a deadlock, a cancel or a terminate ends the wait: never
//! because the client went away, which the server does not notice while a
//! statement waits), enforcing the idle-in-transaction timeout, and
//! streaming notifications to a `LISTEN`ing session.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

use super::{Control, Handled, Kill, PgState, Session};
use crate::engine::{self, HostResult};
use crate::trace::WaitEnd;
use crate::wire::{PgReply, PgRequest, read_frame, write_frame};

/// The fake's port.
pub const PG_PORT: u16 = 5432;

/// Runs the server until the host crashes.
pub async fn serve(state: PgState) -> HostResult {
    let listener = engine::net::bind(PG_PORT).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let session = state.open_session();
        tokio::spawn(connection(state.clone(), session, stream));
    }
}

/// One connection, until either end closes it, a reply is lost, or the
/// server ends the session (idle in transaction too long, terminated by
/// another session). Dropping the session at the end rolls back what it had
/// open.
async fn connection(state: PgState, mut session: Session, stream: engine::net::TcpStream) {
    let control = session.control();
    let (mut r, mut w) = engine::net::split(stream);
    loop {
        let next = tokio::select! {
            biased;
            () = terminated(&control) => {
                let _ = write_frame(&mut w, &Session::terminated()).await;
                return;
            }
            next = next_request(&mut r, session.idle_timeout()) => next,
        };
        let req = match next {
            Next::Request(req) => req,
            Next::Closed => return,
            Next::IdleTimeout => {
                let fatal = session.idle_timed_out();
                let _ = write_frame(&mut w, &fatal).await;
                return;
            }
        };
        let Some(reply) = run(&state, &mut session, &control, &req).await else {
            if control.take() == Some(Kill::Terminate) {
                let _ = write_frame(&mut w, &Session::terminated()).await;
            }
            return;
        };
        let delay = state.reply_delay();
        if !delay.is_zero() {
            engine::sleep(delay).await;
        }
        let listening = matches!((&req, &reply), (PgRequest::Listen, PgReply::Ok));
        if write_frame(&mut w, &reply).await.is_err() {
            return;
        }
        if listening {
            return listen(&state, r, w).await;
        }
    }
}

/// What a connection waiting for its next request got.
enum Next {
    Request(PgRequest),
    /// The client closed it (or it broke).
    Closed,
    /// The open transaction sat idle past its bound.
    IdleTimeout,
}

async fn next_request<R: AsyncRead + Unpin>(r: &mut R, idle: Option<Duration>) -> Next {
    let read = read_frame::<_, PgRequest>(r);
    let next = match idle {
        Some(limit) => match engine::timeout(limit, read).await {
            Ok(next) => next,
            Err(_) => return Next::IdleTimeout,
        },
        None => read.await,
    };
    match next {
        Ok(Some(req)) => Next::Request(req),
        _ => Next::Closed,
    }
}

/// Resolves when another session terminates this one; a cancel of a
/// session that runs no statement does nothing, as in PostgreSQL.
async fn terminated(control: &Control) {
    while control.signalled().await != Kill::Terminate {}
}

/// Runs one request to its reply: waits out the locks it needs, ended
/// early by `statement_timeout`, `lock_timeout`, a deadlock, a cancel or a
/// terminate. `None` if no reply goes out: it was lost, or the session was
/// terminated (then the pending signal says so).
async fn run(
    state: &PgState,
    session: &mut Session,
    control: &Control,
    req: &PgRequest,
) -> Option<PgReply> {
    let arrived = engine::now();
    let (statement_limit, lock_limit) = session.statement_bounds();
    let mut waiting_since: Option<Duration> = None;
    loop {
        let unlocked = state.unlocked().notified();
        tokio::pin!(unlocked);
        unlocked.as_mut().enable();
        let (holders, on) = match session.handle(req, engine::now()) {
            // Applied either way: a wait ends with its lock even when the
            // reply is lost (found on madsim: the wait stayed in the
            // wait-for graph and the trace, `ordering_keys_consumer_swarm`
            // seed 51).
            Handled::Lost => {
                if waiting_since.is_some() {
                    session.wait_ended(WaitEnd::Acquired);
                }
                return None;
            }
            Handled::Reply(reply) => {
                if waiting_since.is_some() {
                    session.wait_ended(WaitEnd::Acquired);
                }
                return Some(reply);
            }
            Handled::Blocked { holders, on } => (holders, on),
        };
        let deadlock = match waiting_since {
            Some(_) => session.still_waiting(&holders),
            None => {
                waiting_since = Some(engine::now());
                session.wait_began(&holders, on)
            }
        };
        if deadlock {
            return session.wait_ended(WaitEnd::Deadlock);
        }
        let since = waiting_since.unwrap_or(arrived);
        let ends = [
            statement_limit.map(|d| (arrived + d, WaitEnd::StatementTimeout)),
            lock_limit.map(|d| (since + d, WaitEnd::LockTimeout)),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|(at, _)| *at);
        tokio::select! {
            biased;
            kill = control.signalled() => match kill {
                Kill::Terminate => {
                    session.wait_ended(WaitEnd::Terminated);
                    control_terminate_again(control);
                    return None;
                }
                Kill::Cancel => return session.wait_ended(WaitEnd::Cancelled),
            },
            how = until(ends) => return session.wait_ended(how),
            () = &mut unlocked => {}
        }
    }
}

/// Puts a terminate back for the caller of [`run`] to see.
fn control_terminate_again(control: &Control) {
    control.resend(Kill::Terminate);
}

/// Resolves at the earliest of `ends` with its reason; never without one.
async fn until(ends: Option<(Duration, WaitEnd)>) -> WaitEnd {
    match ends {
        Some((at, how)) => {
            engine::sleep(at.saturating_sub(engine::now())).await;
            how
        }
        None => std::future::pending().await,
    }
}

/// A listening connection: a notification for every commit that wrote
/// outbox rows, until the client goes away.
async fn listen<R, W>(state: &PgState, mut r: R, mut w: W)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut commits = state.commits();
    loop {
        tokio::select! {
            biased;
            () = commits.changed() => {
                if write_frame(&mut w, &PgReply::Notification).await.is_err() {
                    return;
                }
            }
            // A listener sends nothing more: anything read is the end.
            _ = read_frame::<_, PgRequest>(&mut r) => return,
        }
    }
}
