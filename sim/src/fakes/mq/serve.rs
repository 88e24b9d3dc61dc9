//! The fake RabbitMQ's transport: a listener on each node's simulated host
//! (`rabbit`, or `rabbit-1`… for a cluster) of either engine, a ticker
//! that runs the cluster's elections, and per connection a reader feeding the
//! connection's [`Conn`] one request at a time with the simulated time it
//! arrived, a writer sending its frames (each not before its instant), and
//! AMQP's heartbeats both ways: a client silent past
//! [`HEARTBEAT_TIMEOUT`] is gone.

use std::time::Duration;

use tokio::io::AsyncWrite;

use super::{Frames, MqState};
use crate::engine::{self, HostResult};
use crate::wire::{
    HEARTBEAT_EVERY, HEARTBEAT_TIMEOUT, MqReply, MqRequest, read_frame, write_frame,
};

/// The fake's port.
pub const MQ_PORT: u16 = 5672;

/// How often a node of a cluster runs the elections that are due.
const ELECTION_TICK: Duration = Duration::from_millis(100);

/// Runs node 0 of the broker until the host crashes.
pub async fn serve(state: MqState) -> HostResult {
    serve_node(state, 0).await
}

/// Runs node `node` (0-based) of the broker until its host crashes.
pub async fn serve_node(state: MqState, node: usize) -> HostResult {
    let listener = engine::net::bind(MQ_PORT).await?;
    state.set_node_up(node, true, engine::now());
    if state.node_hosts().len() > 1 {
        let ticker = state.clone();
        tokio::spawn(async move {
            loop {
                engine::sleep(ELECTION_TICK).await;
                ticker.tick(engine::now());
            }
        });
    }
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(connection(state.clone(), stream, node));
    }
}

async fn connection(state: MqState, stream: engine::net::TcpStream, node: usize) {
    let (mut r, w) = engine::net::split(stream);
    let (out, writer) = spawn_writer(w);
    let heartbeat = spawn_heartbeat(out.clone());
    let mut close_all = state.close_all_signal();
    let mut node_down = state.node_down_signal(node);
    if !state.node_is_up(node) {
        // Stopped (`stop_app`): the node takes no connection.
        heartbeat.abort();
        writer.abort();
        return;
    }
    let mut conn = state.open_connection(out, node);
    loop {
        let next = tokio::select! {
            biased;
            () = close_all.changed() => break,
            () = node_down.changed() => break,
            next = engine::timeout(HEARTBEAT_TIMEOUT, read_frame::<_, MqRequest>(&mut r)) => match next {
                Ok(next) => next,
                Err(_) => {
                    conn.heartbeat_timed_out(HEARTBEAT_TIMEOUT);
                    break;
                }
            },
        };
        let Ok(Some(req)) = next else { break };
        if !conn.request(req, engine::now()) {
            break;
        }
    }
    conn.close(engine::now());
    heartbeat.abort();
    writer.abort();
}

/// Writes frames on a task of its own, so a confirm delay holds back
/// confirms without holding back the reading of publishes.
fn spawn_writer<W>(mut w: W) -> (Frames, tokio::task::JoinHandle<()>)
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (out, mut frames) = tokio::sync::mpsc::unbounded_channel::<(Duration, MqReply)>();
    let writer = tokio::spawn(async move {
        while let Some((not_before, frame)) = frames.recv().await {
            let now = engine::now();
            if not_before > now {
                engine::sleep(not_before - now).await;
            }
            if write_frame(&mut w, &frame).await.is_err() {
                return;
            }
        }
    });
    (out, writer)
}

/// Sends heartbeats while the connection lives.
fn spawn_heartbeat(out: Frames) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            engine::sleep(HEARTBEAT_EVERY).await;
            if out.send((Duration::ZERO, MqReply::Heartbeat)).is_err() {
                return;
            }
        }
    })
}
