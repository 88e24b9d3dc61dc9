//! The local three-node RabbitMQ cluster (rabbit1..3@localhost on AMQP
//! ports 5681..5683, started by `.ci/rabbit-cluster start`; `.ci/run`
//! starts it), held by one test at a time, with nodes stopped and started
//! through `rabbitmqctl` as the `rabbitmq` user (its Erlang cookie).

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

/// A node's AMQP URL (1-based, as the node is named).
pub fn node_url(n: u16) -> String {
    format!("amqp://guest:guest@127.0.0.1:{}/%2f", 5680 + n)
}

/// Runs `rabbitmqctl` against node `n` as the `rabbitmq` user (its Erlang
/// cookie); panics naming the command if it fails.
pub fn ctl(n: u16, args: &[&str]) {
    let node = format!("rabbit{n}@localhost");
    let status = std::process::Command::new("runuser")
        .args(["-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq"])
        .args(["timeout", "120", "rabbitmqctl", "-q", "-n", &node])
        .args(args)
        .status()
        .expect("runuser");
    assert!(status.success(), "rabbitmqctl -n {node} {args:?}: {status}");
}

/// The cluster, held by this test alone (a file lock, so it holds across
/// test processes too), every node up.
pub struct Cluster {
    _lock: std::fs::File,
}

impl Cluster {
    pub async fn hold() -> Self {
        let lock = std::fs::File::create(std::env::temp_dir().join("canopy-rabbit-cluster.lock"))
            .expect("lock file");
        let lock = tokio::task::spawn_blocking(move || {
            lock.lock().expect("lock the cluster");
            lock
        })
        .await
        .unwrap();
        for n in 1..=3 {
            let up = tokio::time::timeout(
                Duration::from_secs(10),
                Connection::connect(&node_url(n), ConnectionProperties::default()),
            )
            .await;
            match up {
                Ok(Ok(conn)) => {
                    let _ = conn.close(200, "OK".into()).await;
                }
                _ => panic!(
                    "RabbitMQ cluster node rabbit{n} is not reachable at 127.0.0.1:{}: \
                     start the cluster with `.ci/rabbit-cluster start`",
                    5680 + n
                ),
            }
        }
        Self { _lock: lock }
    }

    /// Stops node `n`'s app; the node starts again when the guard drops.
    pub fn stop(&self, n: u16) -> Stopped {
        ctl(n, &["stop_app"]);
        Stopped(n)
    }
}

/// A stopped node; dropping it starts the node's app again and waits until
/// it has started (bounded by `rabbitmqctl`'s own timeout).
pub struct Stopped(u16);

impl Stopped {
    /// The stopped node (1-based).
    pub fn node(&self) -> u16 {
        self.0
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        ctl(self.0, &["start_app"]);
        ctl(self.0, &["await_startup", "--timeout", "60"]);
    }
}

/// A connection to node `n`; panics naming the node if it does not answer.
pub async fn connect(n: u16) -> Connection {
    Connection::connect(&node_url(n), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("rabbit{n}: {e}"))
}

/// Messages ready in `queue`, asked of node `n`.
pub async fn queue_len(n: u16, queue: &str) -> u32 {
    let conn = connect(n).await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = conn.close(200, "OK".into()).await;
    q.message_count()
}
