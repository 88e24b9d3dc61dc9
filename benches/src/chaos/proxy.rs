//! A TCP proxy per process and service: every child reaches PostgreSQL and
//! RabbitMQ through one of these, so a fault can black-hole (hold every
//! byte, connections open and silent, as a dead link does) or cut (drop
//! every connection) one process's link and nobody else's.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The state of one link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    /// Bytes are held, not passed.
    held: bool,
    /// Bumped by each cut: connections older than it end.
    cuts: u64,
}

/// One proxy: a listener on `127.0.0.1:port` forwarding to `upstream`.
pub struct Proxy {
    pub port: u16,
    state: Arc<watch::Sender<State>>,
}

impl Proxy {
    /// Listens on an ephemeral port and forwards each connection to
    /// `upstream` (`host:port`).
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(
            watch::channel(State {
                held: false,
                cuts: 0,
            })
            .0,
        );
        let links = state.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let links = links.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return; // the client sees the connection end
                    };
                    let born = links.borrow().cuts;
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(
                        pump(cr, sw, links.subscribe(), born),
                        pump(sr, cw, links.subscribe(), born)
                    );
                });
            }
        });
        Ok(Self { port, state })
    }

    /// Holds every byte from now on (a black-hole).
    pub fn hold(&self) {
        self.state.send_modify(|s| s.held = true);
    }

    /// Passes bytes again, the held ones first.
    pub fn pass(&self) {
        self.state.send_modify(|s| s.held = false);
    }

    /// Ends every connection open now.
    pub fn cut(&self) {
        self.state.send_modify(|s| s.cuts += 1);
    }
}

/// Copies `r` to `w` while the link lives: nothing moves while it is held;
/// a cut after the connection was born ends it.
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mut state: watch::Receiver<State>,
    born: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Wait out a hold before reading, and before writing what was read.
        let n = loop {
            let s = *state.borrow_and_update();
            if s.cuts != born {
                return;
            }
            if s.held {
                if state.changed().await.is_err() {
                    return;
                }
                continue;
            }
            tokio::select! {
                biased;
                changed = state.changed() => if changed.is_err() { return },
                n = r.read(&mut buf) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => break n,
                },
            }
        };
        loop {
            let s = *state.borrow_and_update();
            if s.cuts != born {
                return;
            }
            if !s.held {
                break;
            }
            if state.changed().await.is_err() {
                return;
            }
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
