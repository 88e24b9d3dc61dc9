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

const USAGE: &str = "usage: chaos run [--events N] [--faults F] [--seed S] [--rate R] [--out DIR] \
                     [--settle-secs S] [--keep] [--amqp-url URL[,URL...]] [--cluster] \
                     [--ordering-keys K]";

fn parse(args: &[String]) -> Result<run::Args, String> {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut a = run::Args {
        events: 20_000,
        faults: 8,
        seed: 1,
        rate: 0.0,
        out: workspace.join("target").join("chaos"),
        settle: Duration::from_secs(180),
        pg_admin: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into()),
        amqp: String::new(),
        cluster: false,
        keep: false,
        ordering_keys: 0,
    };
    let mut it = args.iter();
    let num = |flag: &str, v: Option<&String>| -> Result<f64, String> {
        let v = v.ok_or(format!("{flag} needs a value"))?;
        v.parse()
            .map_err(|_| format!("{flag} {v:?} is not a number"))
    };
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--events" => a.events = num(flag, it.next())? as u64,
            "--faults" => a.faults = num(flag, it.next())? as usize,
            "--seed" => a.seed = num(flag, it.next())? as u64,
            "--rate" => a.rate = num(flag, it.next())?,
            "--settle-secs" => a.settle = Duration::from_secs_f64(num(flag, it.next())?),
            "--out" => a.out = it.next().ok_or("--out needs a folder")?.into(),
            "--keep" => a.keep = true,
            "--cluster" => a.cluster = true,
            "--ordering-keys" => a.ordering_keys = num(flag, it.next())? as u64,
            "--amqp-url" => a.amqp = it.next().ok_or("--amqp-url needs a URL list")?.clone(),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if a.events == 0 {
        return Err("--events must be at least 1".into());
    }
    if a.amqp.is_empty() {
        a.amqp = if a.cluster {
            benches::chaos::cluster::default_list()
        } else {
            std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
        };
    }
    outbox::LapinBroker::from_list(&a.amqp).map_err(|e| format!("--amqp-url: {e}"))?;
    let nodes = benches::chaos::nodes(&a.amqp).len();
    if a.cluster && nodes != usize::from(benches::chaos::cluster::NODES) {
        return Err(format!(
            "--cluster needs the cluster's {} nodes in --amqp-url, in node order; it lists {nodes}",
            benches::chaos::cluster::NODES
        ));
    }
    if a.rate <= 0.0 {
        a.rate = run::Args::default_rate(a.events);
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let role = args.first().map(String::as_str);
    if role != Some("run") {
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
        match role {
            Some("run") => {
                let a = parse(&args[1..]).map_err(|e| (e, 2))?;
                let line = format!("chaos {}", args.join(" "));
                match run::run(a, line).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(("a rule broke: see the report".to_owned(), 1)),
                    Err(e) => Err((format!("chaos run failed: {e}"), 2)),
                }
            }
            Some("producer") => roles::producer().await.map_err(|e| (e.to_string(), 1)),
            Some("drainer") => roles::drainer().await.map_err(|e| (e.to_string(), 1)),
            Some("subscriber") => roles::subscriber().await.map_err(|e| (e.to_string(), 1)),
            _ => Err((USAGE.to_owned(), 2)),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err((msg, code)) => {
            eprintln!("{msg}");
            ExitCode::from(code)
        }
    }
}
