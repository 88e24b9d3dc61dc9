//! `chaos`: the whole system on the real PostgreSQL and RabbitMQ, as
//! separate processes, under a seeded schedule of real faults, judged by an
//! independent observer (see `benches::chaos`).
//!
//! ```text
//! chaos run [--events N] [--faults F] [--seed S] [--rate R] [--out DIR]
//!           [--settle-secs S] [--keep] [--amqp-url URL[,URL...]] [--cluster]
//!           [--ordering-keys K]
//! ```
//! Defaults: 20 000 events, 8 faults, seed 1, about a minute of production
//! (300 to 3 000 events/s), `target/chaos`, a settle bound of 180 s (after
//! the faults heal, the run must never go that long without progress, and
//! must be done within as long again as it took to heal, at least the
//! bound). Exit status 0
//! if every rule held, 1 if one broke, 2 on a usage or set-up error. The
//! services come from `DATABASE_URL` (any database of the server: the run
//! creates and drops its own) and `AMQP_URL` (or `--amqp-url`, a list of
//! a cluster's nodes), with the local defaults. `--cluster` runs on the
//! project's three-node cluster (`.ci/rabbit-cluster start`; its nodes'
//! URLs unless `--amqp-url` lists them, in node order) with node faults:
//! a node SIGKILLed, stopped (`stop_app`), cut off from the others.
//! `--ordering-keys K` spreads the order events over K ordering keys and
//! makes both subscriptions ordered; the report then judges each key's
//! order at the broker (the observer) and in each subscription's effects.
//! `chaos producer|drainer|subscriber` are the run's processes (the
//! orchestrator starts them).

use std::process::ExitCode;
use std::time::Duration;

use benches::chaos::{roles, run};
use clap::{Parser, Subcommand};

/// The whole system on the real services under a seeded schedule of real
/// faults, judged by an independent observer.
#[derive(Debug, Parser)]
#[command(name = "chaos", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Run the whole system under faults and judge it (exit 0 if every rule
    /// held, 1 if one broke, 2 on a usage or set-up error).
    Run(RunCli),
    /// One of the run's producers (the orchestrator starts it).
    Producer,
    /// One of the run's drainers (the orchestrator starts it).
    Drainer,
    /// One of the run's subscribers (the orchestrator starts it).
    Subscriber,
}

#[derive(Debug, clap::Args)]
struct RunCli {
    /// Events the producers commit.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    events: u64,
    /// Faults injected over the production.
    #[arg(long, default_value_t = 8)]
    faults: usize,
    /// The seed of the fault plan and the producers' draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Events per second the producers aim at (default: about a minute of
    /// production, 300 to 3 000 events/s).
    #[arg(long)]
    rate: Option<f64>,
    /// Where the report, logs and records go.
    #[arg(long, value_name = "DIR")]
    out: Option<std::path::PathBuf>,
    /// After the heal, the longest the run may go without progress (and
    /// the least it is given to finish).
    #[arg(long, value_name = "S", default_value_t = 180.0)]
    settle_secs: f64,
    /// Keep the run's database and queues.
    #[arg(long)]
    keep: bool,
    /// The broker's nodes, comma-separated (default `AMQP_URL`, or the
    /// cluster's nodes with `--cluster`).
    #[arg(long, value_name = "URL[,URL...]")]
    amqp_url: Option<String>,
    /// Run on the project's three-node cluster, with node faults.
    #[arg(long)]
    cluster: bool,
    /// Spread the order events over K ordering keys and make both
    /// subscriptions ordered.
    #[arg(long, value_name = "K", default_value_t = 0)]
    ordering_keys: u64,
}

fn parse(c: RunCli) -> Result<run::Args, String> {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if !(c.settle_secs.is_finite() && c.settle_secs >= 0.0) {
        return Err(format!(
            "--settle-secs must be a number of seconds, got {}",
            c.settle_secs
        ));
    }
    let amqp = c.amqp_url.unwrap_or_else(|| {
        if c.cluster {
            benches::chaos::cluster::default_list()
        } else {
            std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
        }
    });
    outbox::LapinBroker::from_list(&amqp).map_err(|e| format!("--amqp-url: {e}"))?;
    let nodes = benches::chaos::nodes(&amqp).len();
    if c.cluster && nodes != usize::from(benches::chaos::cluster::NODES) {
        return Err(format!(
            "--cluster needs the cluster's {} nodes in --amqp-url, in node order; it lists {nodes}",
            benches::chaos::cluster::NODES
        ));
    }
    Ok(run::Args {
        events: c.events,
        faults: c.faults,
        seed: c.seed,
        rate: c
            .rate
            .filter(|r| *r > 0.0)
            .unwrap_or_else(|| run::Args::default_rate(c.events)),
        out: c
            .out
            .unwrap_or_else(|| workspace.join("target").join("chaos")),
        settle: Duration::from_secs_f64(c.settle_secs),
        pg_admin: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into()),
        amqp,
        cluster: c.cluster,
        keep: c.keep,
        ordering_keys: c.ordering_keys,
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if !matches!(cli.role, Role::Run(_)) {
        // The run's processes log warnings and errors to their log files.
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_ansi(false)
            .init();
    }
    let result = runtime.block_on(async {
        match cli.role {
            Role::Run(c) => {
                let a = parse(c).map_err(|e| (e, 2))?;
                let line = format!("chaos {}", args.join(" "));
                match run::run(a, line).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(("a rule broke: see the report".to_owned(), 1)),
                    Err(e) => Err((format!("chaos run failed: {e}"), 2)),
                }
            }
            Role::Producer => roles::producer().await.map_err(|e| (e.to_string(), 1)),
            Role::Drainer => roles::drainer().await.map_err(|e| (e.to_string(), 1)),
            Role::Subscriber => roles::subscriber().await.map_err(|e| (e.to_string(), 1)),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err((msg, code)) => {
            eprintln!("error: {msg}");
            ExitCode::from(code)
        }
    }
}
