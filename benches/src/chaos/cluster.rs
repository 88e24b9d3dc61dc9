//! The broker's nodes under `chaos run --cluster`: the project's local
//! three-node RabbitMQ cluster (`.ci/rabbit-cluster`: nodes
//! `rabbit1..3@localhost`, AMQP ports 5681..5683, run as the `rabbitmq`
//! user), and the node faults done to it.
//!
//! A node is cut off from the others for real: on the cut-off node every
//! other node's Erlang cookie is replaced and the distribution connections
//! to them are closed, so each reconnection, either way, fails its
//! handshake and no distribution traffic passes until the cookies are put
//! back. (There is no packet filter on this machine; this cuts the same
//! links the distribution ports carry.) The cluster runs with
//! `cluster_partition_handling = pause_minority`, RabbitMQ's advice for
//! three nodes: the cut-off node pauses itself (its clients are
//! disconnected) and comes back once it sees the majority again.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The cluster's nodes.
pub const NODES: u16 = 3;

/// Node `n`'s Erlang node name.
pub fn node_name(n: u16) -> String {
    format!("rabbit{n}@localhost")
}

/// Node `n`'s AMQP URL (guest over loopback).
pub fn node_url(n: u16) -> String {
    format!("amqp://guest:guest@127.0.0.1:{}/%2f", 5680 + n)
}

/// The three nodes' URLs, comma-separated, in node order.
pub fn default_list() -> String {
    (1..=NODES).map(node_url).collect::<Vec<_>>().join(",")
}

/// The project's cluster script.
fn script() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/rabbit-cluster")
}

/// Where the script keeps the nodes' data (its `CLUSTER_DIR`).
fn cluster_dir() -> PathBuf {
    std::env::var_os("CLUSTER_DIR")
        .map_or_else(|| "/var/lib/rabbitmq/canopy-cluster".into(), PathBuf::from)
}

/// Runs `program args` off the runtime, bounded by `timeout(1)`; an error
/// names the command and says what it printed.
async fn run(program: &str, args: &[String], limit: Duration) -> Result<String, String> {
    let mut all: Vec<String> = vec![format!("{}", limit.as_secs()), program.to_owned()];
    all.extend(args.iter().cloned());
    let shown = format!("{program} {}", args.join(" "));
    let out = tokio::task::spawn_blocking(move || Command::new("timeout").args(&all).output())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("{shown}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{shown}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// `rabbitmqctl -n rabbitN@localhost ARGS` as the `rabbitmq` user.
pub async fn ctl(n: u16, args: &[&str]) -> Result<String, String> {
    let mut all: Vec<String> = ["-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    all.extend(["rabbitmqctl", "-q", "-n"].map(str::to_owned));
    all.push(node_name(n));
    all.extend(args.iter().map(|s| (*s).to_owned()));
    run("runuser", &all, Duration::from_secs(120)).await
}

/// The other nodes' names, as an Erlang list.
fn others(n: u16) -> String {
    let names: Vec<String> = (1..=NODES)
        .filter(|&m| m != n)
        .map(|m| format!("'{}'", node_name(m)))
        .collect();
    format!("[{}]", names.join(", "))
}

/// SIGKILLs node `n`'s Erlang VM (its pid file's process).
pub async fn kill(n: u16) -> Result<(), String> {
    let pid_file = cluster_dir().join(format!("rabbit{n}")).join("pid");
    let pid =
        std::fs::read_to_string(&pid_file).map_err(|e| format!("{}: {e}", pid_file.display()))?;
    let pid = pid.trim().to_owned();
    run("kill", &["-KILL".into(), pid], Duration::from_secs(10))
        .await
        .map(drop)
}

/// Starts the nodes that are down (the project's script: it waits until
/// each answers and has joined), then waits until all three run.
pub async fn start_down_nodes() -> Result<(), String> {
    let script = script().to_string_lossy().into_owned();
    run(&script, &["start".into()], Duration::from_secs(180)).await?;
    await_all().await
}

/// Waits (bounded) until every node runs the broker, as node 1 sees it.
pub async fn await_all() -> Result<(), String> {
    let until = Instant::now() + Duration::from_secs(90);
    loop {
        let asked = ctl(1, &["await_online_nodes", "3", "--timeout", "30000"]).await;
        let answers = node_answers().await;
        match (asked, answers) {
            (Ok(_), Ok(())) => return Ok(()),
            (Err(e), _) | (_, Err(e)) if Instant::now() > until => {
                return Err(format!("the cluster is not whole again: {e}"));
            }
            _ => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

/// Whether every node takes an AMQP connection.
async fn node_answers() -> Result<(), String> {
    for n in 1..=NODES {
        let c = super::connect_any(&node_url(n)).await?;
        let _ = c.close(200, "OK".into()).await;
    }
    Ok(())
}

/// Cuts node `n`'s distribution links to the other nodes: their cookies
/// replaced on `n`, their connections closed.
pub async fn cut_off(n: u16) -> Result<(), String> {
    let expr = format!(
        "[begin erlang:set_cookie(N, canopy_chaos_cut_off), erlang:disconnect_node(N) end \
         || N <- {}], ok.",
        others(n)
    );
    ctl(n, &["eval", &expr]).await.map(drop)
}

/// Puts node `n`'s cookies for the other nodes back and reconnects.
pub async fn rejoin(n: u16) -> Result<(), String> {
    let expr = format!(
        "C = erlang:get_cookie(), Ns = {}, [erlang:set_cookie(N, C) || N <- Ns], \
         [net_adm:ping(N) || N <- Ns], ok.",
        others(n)
    );
    ctl(n, &["eval", &expr]).await.map(drop)
}
