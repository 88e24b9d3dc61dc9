//! `sim`: run one scenario with one seed, or sweep scenarios over a seed
//! range. The seed comes first in every report; every failure prints the
//! exact command that reproduces it.
//!
//! ```text
//! sim run broker_blackhole --seed 7 [--trace trace.txt] [--timeline run.svg]
//! sim shrink producer_and_consumer_swarm --seed 48 [--out FILE.toml]
//! sim sweep [SCENARIO...] --seeds 0..200 [--jobs 2] [--scenarios DIR]
//! ```
//! `sim --help` and `sim SUBCOMMAND --help` say the rest. Each takes
//! `--engine turmoil|madsim` (turmoil by default). One build
//! holds one engine; asked for the other, the binary runs the same command
//! on that engine's build through cargo (madsim's: `RUSTFLAGS="--cfg
//! madsim"`, in `target/madsim`), building it first if need be.
//! A sweep without names runs every scenario in `scenarios/` and the clean
//! twin (`NAME.clean`) of each faulty one. It prints, besides the failures,
//! how many runs broke each invariant, how often each coverage mark and
//! each kind of fault was hit, and fails if a scenario never reached a mark
//! its `[expect] reach` list names.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use clap::{Parser, Subcommand};

use sim::checker::Invariant;
use sim::scenario::Scenario;
use sim::world::{self, Coverage, RunOutcome};

/// mimalloc, not the system's: a sweep allocates and frees at a high rate,
/// and glibc's malloc was about a quarter of a madsim sweep's CPU time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs the simulation's scenarios: one seed, a shrink, or a sweep.
#[derive(Debug, Parser)]
#[command(name = "sim", version, about, long_about = None)]
struct Cli {
    /// The engine to run on: turmoil (the default build) or madsim. Asked
    /// for the engine this build does not hold, the same command runs on
    /// that engine's build through cargo, built first if need be.
    #[arg(long, global = true, value_name = "NAME", value_parser = sim::engine::ENGINES)]
    engine: Option<String>,
    #[command(subcommand)]
    command: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Run one scenario with one seed and print its verdict.
    Run(RunArgs),
    /// Shrink a failing seed to the fewest faults and events that still
    /// break the same invariant, written as a scenario file.
    Shrink(ShrinkArgs),
    /// Run scenarios over a seed range (every scenario and its clean twin
    /// when none is named) and report failures, invariants and coverage.
    Sweep(SweepArgs),
}

/// A scenario and a seed, as `run` and `shrink` take them.
#[derive(Debug, clap::Args)]
struct OneSeed {
    /// A scenario's name in the scenarios folder, or a path to its file.
    scenario: String,
    /// The seed to run.
    #[arg(long)]
    seed: u64,
    /// The folder the scenario names are looked up in.
    #[arg(long, value_name = "DIR", default_value_os_t = default_scenarios_dir())]
    scenarios: PathBuf,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    #[command(flatten)]
    one: OneSeed,
    /// Write the run's trace, one event a line, to this file.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Draw the run's timeline as SVG to this file.
    #[arg(long, value_name = "FILE.svg")]
    timeline: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct ShrinkArgs {
    #[command(flatten)]
    one: OneSeed,
    /// The shrunk scenario's file (default `SCENARIO-SEED.shrunk.toml`).
    #[arg(long, value_name = "FILE.toml")]
    out: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct SweepArgs {
    /// Scenarios to sweep (default: every one in the folder, with twins).
    #[arg(value_name = "SCENARIO")]
    names: Vec<String>,
    /// The seed range, A..B (B excluded); pinned seeds run besides.
    #[arg(long, value_name = "A..B", value_parser = parse_range)]
    seeds: std::ops::Range<u64>,
    /// Runs at once (default: the machine's cores).
    #[arg(long, value_name = "J", default_value_t = default_jobs())]
    jobs: usize,
    /// The folder of scenario files.
    #[arg(long, value_name = "DIR", default_value_os_t = default_scenarios_dir())]
    scenarios: PathBuf,
    /// Print each scenario's coverage marks.
    #[arg(long)]
    by_scenario: bool,
}

fn default_jobs() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn default_scenarios_dir() -> PathBuf {
    let here = Path::new("scenarios");
    if here.is_dir() {
        return here.to_owned();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios")
}

fn load(dir: &Path, name: &str) -> Result<Scenario, String> {
    Scenario::find(dir, name).map_err(|e| e.to_string())
}

fn parse_range(s: &str) -> Result<std::ops::Range<u64>, String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("takes A..B, got {s:?}"))?;
    let a: u64 = a.parse().map_err(|_| format!("bad range start in {s:?}"))?;
    let b: u64 = b.parse().map_err(|_| format!("bad range end in {s:?}"))?;
    if a >= b {
        return Err(format!("empty seed range {s:?}"));
    }
    Ok(a..b)
}

/// ` --engine madsim` on the madsim build (turmoil is the default).
fn engine_flag() -> &'static str {
    if sim::engine::NAME == "turmoil" {
        ""
    } else {
        " --engine madsim"
    }
}

fn reproduce(o: &RunOutcome) -> String {
    format!(
        "cargo run --release -p sim -- run {} --seed {}{} --trace {}-{}.trace",
        o.scenario,
        o.seed,
        engine_flag(),
        o.scenario,
        o.seed
    )
}

/// `args` without `--engine NAME` (or `--engine=NAME`), for the other
/// engine's build, which runs on its own engine by default.
fn without_engine(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--engine" {
            it.next();
        } else if !a.starts_with("--engine=") {
            out.push(a.clone());
        }
    }
    out
}
/// Runs `sim ARGS` on `engine`'s build through cargo (building it if need
/// be): madsim's is this workspace's `sim` built with `--cfg madsim` in
/// `target/madsim`, turmoil's the plain build.
fn delegate(engine: &str, args: &[String]) -> Result<ExitCode, String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("sim sits in the workspace");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), PathBuf::from);
    let mut flags: Vec<String> = std::env::var("RUSTFLAGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    while let Some(i) = flags.windows(2).position(|w| w == ["--cfg", "madsim"]) {
        flags.drain(i..i + 2);
    }
    let target = if engine == "madsim" {
        flags.extend(["--cfg".to_owned(), "madsim".to_owned()]);
        target.join("madsim")
    } else {
        // The madsim build lives in `<target>/madsim`; turmoil's is beside.
        match target.file_name() {
            Some(n) if n == "madsim" => target.parent().map_or(target.clone(), Path::to_owned),
            _ => target,
        }
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["run", "--release", "-p", "sim", "--manifest-path"])
        .arg(workspace.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .arg("--")
        .args(args)
        .env("RUSTFLAGS", flags.join(" "));
    eprintln!(
        "sim: this build runs on {}; running on {engine}: RUSTFLAGS={:?} cargo run --release -p sim --target-dir {} -- {}",
        sim::engine::NAME,
        flags.join(" "),
        target.display(),
        args.join(" ")
    );
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run cargo for the {engine} build: {e}"))?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => ExitCode::from(1),
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cli = Cli::parse();
    let result = match cli.engine.as_deref() {
        Some(engine) if engine != sim::engine::NAME => delegate(engine, &without_engine(&args)),
        _ => match cli.command {
            Action::Run(a) => cmd_run(a),
            Action::Shrink(a) => cmd_shrink(a),
            Action::Sweep(a) => cmd_sweep(a),
        },
    };
    match result {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}

fn cmd_run(args: RunArgs) -> Result<ExitCode, String> {
    let RunArgs {
        one:
            OneSeed {
                scenario: name,
                seed,
                scenarios: dir,
            },
        trace: trace_file,
        timeline: timeline_file,
    } = args;
    println!("seed {seed}\nengine {}", sim::engine::NAME);
    let scenario = load(&dir, &name)?;
    let started = Instant::now();
    let o = world::run(&scenario, seed);
    let v = &o.verdict;
    println!("scenario {} ({})", o.scenario, scenario.description.trim());
    for f in &o.faults {
        println!("fault    {f}");
    }
    println!(
        "verdict  {}\ntrace    {:016x} ({} events)\ncounts   committed {} rolled back {} published {} duplicates {} parked {}\ntime     {:.1} simulated s in {:.2} s",
        if v.ok() { "PASS" } else { "FAIL" },
        o.trace_hash(),
        o.trace.events().len(),
        v.committed,
        v.rolled_back,
        v.published,
        v.duplicates,
        v.parked,
        o.sim_secs,
        started.elapsed().as_secs_f64()
    );
    let marks: Vec<String> = o
        .coverage
        .marks
        .iter()
        .map(|(m, n)| format!("{}={n}", m.name()))
        .collect();
    println!("marks    {}", marks.join(" "));
    for violation in &v.violations {
        println!("violated {violation}");
    }
    for (invariant, n) in &v.counts {
        if *n > sim::checker::LISTED_MAX {
            println!("violated {invariant}: {n} in all");
        }
    }
    if let Some(file) = trace_file {
        std::fs::write(&file, o.trace.render())
            .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
        println!("trace written to {}", file.display());
    }
    if let Some(file) = timeline_file {
        let title = format!("{} seed {}", o.scenario, o.seed);
        let svg = sim::timeline::svg(&title, &o.trace.lock(), &v.violations);
        std::fs::write(&file, svg).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
        println!("timeline written to {}", file.display());
    }
    Ok(if v.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn cmd_shrink(args: ShrinkArgs) -> Result<ExitCode, String> {
    let ShrinkArgs {
        one:
            OneSeed {
                scenario: name,
                seed,
                scenarios: dir,
            },
        out,
    } = args;
    println!("seed {seed}\nengine {}", sim::engine::NAME);
    let scenario = load(&dir, &name)?;
    let started = Instant::now();
    let shrunk = sim::shrink::shrink(&scenario, seed, |step| println!("  {step}"))
        .map_err(|e| e.to_string())?;
    let stem = Path::new(&name)
        .file_stem()
        .map_or(name.clone(), |s| s.to_string_lossy().into_owned());
    let out = out.map_or_else(
        || format!("{stem}-{seed}.shrunk.toml"),
        |p| p.display().to_string(),
    );
    let command = format!("sim shrink {name} --seed {seed}{}", engine_flag());
    std::fs::write(&out, sim::shrink::to_toml(&shrunk, &command))
        .map_err(|e| format!("cannot write {out}: {e}"))?;
    println!(
        "invariant {}\nbefore    {}\nafter     {}\nshrunk in {} runs, {:.1} s\nwritten   {out}\nreproduce: cargo run --release -p sim -- run {out} --seed {seed}{} --timeline {stem}-{seed}.svg",
        shrunk.invariant,
        shrunk.before,
        shrunk.after,
        shrunk.runs,
        started.elapsed().as_secs_f64(),
        engine_flag()
    );
    Ok(ExitCode::SUCCESS)
}

fn cmd_sweep(args: SweepArgs) -> Result<ExitCode, String> {
    let SweepArgs {
        names,
        seeds: range,
        jobs,
        scenarios: dir,
        by_scenario,
    } = args;
    let scenarios: Vec<Scenario> = if names.is_empty() {
        Scenario::load_dir_with_twins(&dir).map_err(|e| e.to_string())?
    } else {
        names
            .iter()
            .map(|n| load(&dir, n))
            .collect::<Result<_, _>>()?
    };
    println!(
        "seeds {}..{} over {} scenarios on {}",
        range.start,
        range.end,
        scenarios.len(),
        sim::engine::NAME
    );
    let started = Instant::now();
    let results = run_all(&scenarios, &range, jobs);
    let total = results.len();
    let failures = print_scenarios(&scenarios, &results);
    print_invariants(&results);
    let unreached = print_coverage(&scenarios, &results, by_scenario);
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{} runs in {:.1} s ({:.0} runs/min), {} failed, {} expected marks never reached",
        total,
        secs,
        total as f64 * 60.0 / secs.max(1e-9),
        failures.len(),
        unreached.len()
    );
    for u in &unreached {
        println!("UNREACHED {u}");
    }
    for f in &failures {
        println!("\nFAIL {} seed {}", f.scenario, f.seed);
        for v in &f.verdict.violations {
            println!("  {v}");
        }
        println!("  reproduce: {}", reproduce(f));
    }
    Ok(if failures.is_empty() && unreached.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Runs every scenario on every seed of `range` (and its pinned seeds) on
/// `jobs` threads; returns the outcomes (traces dropped, coverage kept)
/// sorted by scenario and seed.
fn run_all(scenarios: &[Scenario], range: &std::ops::Range<u64>, jobs: usize) -> Vec<RunOutcome> {
    let mut work: Vec<(usize, u64)> = Vec::new();
    for (i, s) in scenarios.iter().enumerate() {
        let pinned = s.pinned().iter().copied().filter(|p| !range.contains(p));
        work.extend(range.clone().chain(pinned).map(|seed| (i, seed)));
    }
    let total = work.len();
    let work = Mutex::new(work.into_iter());
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<RunOutcome>> = Mutex::default();
    let tty = std::io::stderr().is_terminal();
    std::thread::scope(|scope| {
        for _ in 0..jobs.max(1) {
            let (work, done, results) = (&work, &done, &results);
            scope.spawn(move || {
                loop {
                    let next = work.lock().expect("work").next();
                    let Some((i, seed)) = next else { break };
                    let mut o = world::run(&scenarios[i], seed);
                    if !o.verdict.ok() {
                        eprintln!(
                            "\nFAIL seed {seed} {}: {}",
                            o.scenario, o.verdict.violations[0]
                        );
                    }
                    o.trace = Default::default(); // the coverage is kept
                    results.lock().expect("results").push(o);
                    let n = done.fetch_add(1, Ordering::SeqCst) + 1;
                    progress(n, total, tty);
                }
            });
        }
    });
    eprintln!();
    let mut results = results.into_inner().expect("results");
    results.sort_by(|a, b| (a.scenario.as_str(), a.seed).cmp(&(b.scenario.as_str(), b.seed)));
    results
}

/// One line per scenario; returns the failed runs.
fn print_scenarios<'r>(scenarios: &[Scenario], results: &'r [RunOutcome]) -> Vec<&'r RunOutcome> {
    println!(
        "{:<34} {:>6} {:>6} {:>10} {:>10} {:>8} {:>7}",
        "scenario", "seeds", "fail", "committed", "published", "dups", "parked"
    );
    let mut failures = Vec::new();
    for s in scenarios {
        let rs: Vec<&RunOutcome> = results.iter().filter(|r| r.scenario == s.name).collect();
        let fails = rs.iter().filter(|r| !r.verdict.ok()).count();
        let sum = |f: fn(&RunOutcome) -> usize| rs.iter().map(|r| f(r)).sum::<usize>();
        println!(
            "{:<34} {:>6} {:>6} {:>10} {:>10} {:>8} {:>7}",
            s.name,
            rs.len(),
            fails,
            sum(|r| r.verdict.committed),
            sum(|r| r.verdict.published),
            sum(|r| r.verdict.duplicates),
            sum(|r| r.verdict.parked),
        );
        failures.extend(rs.into_iter().filter(|r| !r.verdict.ok()));
    }
    failures
}

/// Runs that broke each invariant, and violations in all.
fn print_invariants(results: &[RunOutcome]) {
    let mut runs: std::collections::BTreeMap<Invariant, (usize, usize)> = Default::default();
    for r in results {
        for (invariant, n) in &r.verdict.counts {
            let e = runs.entry(*invariant).or_default();
            e.0 += 1;
            e.1 += n;
        }
    }
    if runs.is_empty() {
        println!("invariants: every one held in every run");
        return;
    }
    println!(
        "\n{:<36} {:>6} {:>10}",
        "invariant broken", "runs", "violations"
    );
    for (invariant, (n, total)) in runs {
        println!("{:<36} {n:>6} {total:>10}", invariant.name());
    }
}

/// Prints how often each mark and fault kind was hit, and returns the
/// marks a scenario expects to reach but never did.
fn print_coverage(
    scenarios: &[Scenario],
    results: &[RunOutcome],
    by_scenario: bool,
) -> Vec<String> {
    let mut total = Coverage::default();
    let mut reached_by: std::collections::BTreeMap<String, usize> = Default::default();
    let mut unreached = Vec::new();
    for s in scenarios {
        let mut c = Coverage::default();
        for r in results.iter().filter(|r| r.scenario == s.name) {
            c.absorb(&r.coverage);
        }
        for m in c.marks.keys() {
            *reached_by.entry(m.name().to_owned()).or_insert(0) += 1;
        }
        if by_scenario {
            let marks: Vec<String> = c
                .marks
                .iter()
                .map(|(m, n)| format!("{}={n}", m.name()))
                .collect();
            println!("marks of {}: {}", s.name, marks.join(" "));
        }
        for name in &s.expect.reach {
            let hit = outbox::core::marks::Mark::from_name(name)
                .and_then(|m| c.marks.get(&m))
                .copied()
                .unwrap_or(0);
            if hit == 0 {
                unreached.push(format!("{}: mark {name} was never hit", s.name));
            }
        }
        total.absorb(&c);
    }
    println!("\n{:<28} {:>10} {:>10}", "mark", "hits", "scenarios");
    for m in outbox::core::marks::Mark::ALL {
        let hits = total.marks.get(m).copied().unwrap_or(0);
        let by = reached_by.get(m.name()).copied().unwrap_or(0);
        println!("{:<28} {hits:>10} {by:>10}", m.name());
    }
    println!("\n{:<28} {:>10}", "fault", "hits");
    for (kind, n) in &total.faults {
        println!("{:<28} {n:>10}", format!("{kind:?}"));
    }
    unreached
}

fn progress(n: usize, total: usize, tty: bool) {
    const WIDTH: usize = 40;
    let filled = n * WIDTH / total.max(1);
    let step = (total / 20).max(1);
    if tty || n == total || n.is_multiple_of(step) {
        let bar = format!("{}{}", "#".repeat(filled), " ".repeat(WIDTH - filled));
        let mut err = std::io::stderr();
        let _ = write!(err, "\r[{bar}] {n}/{total}");
        if !tty {
            let _ = writeln!(err);
        }
        let _ = err.flush();
    }
}
