//! The fake PostgreSQL's transport: a listener on the simulated `pg` host
//! of either engine, one task per connection feeding the connection's
//! [`Session`] one request at a time with the simulated time it arrived,
//! waiting out row locks, enforcing the idle-in-transaction timeout, and
//! streaming notifications to a `LISTEN`ing session.

use tokio::io::{AsyncRead, AsyncWrite};

use super::{Handled, PgState, Session};
use crate::engine::{self, HostResult};
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

/// One connection, until either end closes it or a reply is lost. Dropping
/// the session at the end rolls back what it had open.
async fn connection(state: PgState, mut session: Session, stream: engine::net::TcpStream) {
    let (mut r, mut w) = engine::net::split(stream);
    loop {
        let next = match session.idle_timeout() {
            Some(limit) => {
                match tokio::time::timeout(limit, read_frame::<_, PgRequest>(&mut r)).await {
                    Ok(next) => next,
                    Err(_) => {
                        session.idle_timed_out();
                        return;
                    }
                }
            }
            None => read_frame::<_, PgRequest>(&mut r).await,
        };
        let Ok(Some(req)) = next else { return };
        let reply = loop {
            let unlocked = state.unlocked().notified();
            tokio::pin!(unlocked);
            unlocked.as_mut().enable();
            match session.handle(&req, engine::now()) {
                Handled::Blocked => unlocked.await,
                Handled::Lost => return, // the connection dies with the reply
                Handled::Reply(reply) => break reply,
            }
        };
        let delay = state.reply_delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
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
