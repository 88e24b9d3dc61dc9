//! Scenarios are data: one TOML file per scenario in `scenarios/`, holding a
//! workload, a topology, configuration overrides, a fault schedule (timed
//! faults, [`fault`], or a probabilistic swarm that each seed turns on and
//! off, [`swarm`]), what the faults must make happen, and pinned seeds.

pub mod fault;
pub mod swarm;

use std::path::Path;

use outbox::core::marks::Mark;
use serde::{Deserialize, Serialize};

pub use self::fault::Fault;
pub use self::swarm::{Family, Swarm};

/// One scenario file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Set from the file name.
    #[serde(skip)]
    pub name: String,
    /// What the scenario exercises and why the system should survive it.
    pub description: String,
    /// Seeds that once failed or matter: always run (on turmoil).
    #[serde(default)]
    pub seeds: Vec<u64>,
    /// The same, on madsim, where one seed deals another schedule than on
    /// turmoil.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub madsim_seeds: Vec<u64>,
    pub workload: Workload,
    #[serde(default)]
    pub topology: Topology,
    #[serde(default)]
    pub config: ConfigOverrides,
    pub timing: Timing,
    #[serde(default, rename = "fault")]
    pub faults: Vec<Fault>,
    /// Probabilistic faults drawn per seed (never written: a shrunk
    /// scenario holds its draws as timed faults).
    #[serde(default, skip_serializing)]
    pub swarm: Option<Swarm>,
    /// What the faults must have made happen, so a scenario cannot pass by
    /// not exercising what it is about (FoundationDB's workloads check a
    /// minimum rate in the same spirit).
    #[serde(default)]
    pub expect: Expect,
}

/// Minimum effects of a scenario's faults, checked on every seed.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// At least one claim was released without blame (a Phase-2 failure).
    #[serde(default)]
    pub releases: bool,
    /// At least one row parked.
    #[serde(default)]
    pub parks: bool,
    /// At least one envelope was stored twice (a republish).
    #[serde(default)]
    pub duplicates: bool,
    /// At least one delivery found its event already processed (the inbox
    /// absorbed a duplicate).
    #[serde(default)]
    pub consumer_duplicates: bool,
    /// At least one delivery was dead-lettered after the budget.
    #[serde(default)]
    pub dead_letters: bool,
    /// At least one crash of the database took back an asynchronous
    /// commit of a drainer (a claim, a mark or a release the WAL writer
    /// had not flushed).
    #[serde(default)]
    pub commits_lost: bool,
    /// Coverage marks (`outbox::core::marks::Mark` names) the core must hit
    /// at least once across a sweep of this scenario: the paths the scenario
    /// exists to exercise. Checked by `sim sweep`, not per seed.
    #[serde(default)]
    pub reach: Vec<String>,
    /// Set by the world (never in a file) when a seed runs without any fault:
    /// then no claim may be released and nothing published twice, so a
    /// drainer that throws work away and redoes it cannot pass as correct.
    #[serde(skip)]
    pub quiet: bool,
}

/// What the producer does.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Domain transactions to run.
    pub transactions: u32,
    /// Envelopes per transaction, inclusive range.
    #[serde(default = "one_to_three")]
    pub envelopes_per_tx: [u32; 2],
    /// Fraction of transactions rolled back.
    #[serde(default)]
    pub rollback_ratio: f64,
    /// Pause between transactions in ms, inclusive range.
    #[serde(default = "interval")]
    pub interval_ms: [u64; 2],
    /// Fraction of envelopes whose routing key starts with `poison.`.
    #[serde(default)]
    pub poison_ratio: f64,
    /// Fraction of rows written by hand, bypassing `publish_tx` validation,
    /// with a routing key no broker accepts (empty, or over 255 bytes).
    #[serde(default)]
    pub unpublishable_ratio: f64,
    /// Fraction of envelopes whose routing key is `unique.<n>` or
    /// `trigger.<n>` (n one of a few): their effects write it under the
    /// domain table's deferred unique constraint or deferred constraint
    /// trigger, so of the events sharing a key the first to
    /// commit takes effect and the others can never commit theirs (they
    /// are dead-lettered at their budget, and replays fail again).
    #[serde(default)]
    pub unique_ratio: f64,
    /// Ordering keys (issue 27): envelopes get one of this many keys
    /// (`key-0..K`, drawn uniformly), none when 0 (the default).
    #[serde(default)]
    pub ordering_keys: u32,
    /// With `ordering_keys`, the fraction of envelopes given a key.
    #[serde(default = "all")]
    pub keyed_ratio: f64,
    /// Concurrent writers sharing the transactions (default 1).
    #[serde(default = "one")]
    pub writers: u32,
}

fn all() -> f64 {
    1.0
}

fn one_to_three() -> [u32; 2] {
    [1, 3]
}

fn interval() -> [u64; 2] {
    [1, 20]
}

/// Hosts.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Drainer replicas (`drainer-1..N`).
    pub drainers: u32,
    /// Replicas of one subscription (`consumer-1..M`) consuming every event;
    /// none by default (producer-only scenarios).
    #[serde(default)]
    pub consumers: u32,
    /// Nodes of the broker: one (host `rabbit`) by default; a cluster's
    /// nodes are `rabbit-1..K`. Drainer `i` connects to node `i` first,
    /// consumer `j` to node `K + 1 - j`; the world declares the
    /// subscription on node `K` before the run, as the example does.
    #[serde(default = "one")]
    pub broker_nodes: u32,
}

fn one() -> u32 {
    1
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            drainers: 1,
            consumers: 0,
            broker_nodes: 1,
        }
    }
}

/// Drainer configuration overrides (builder settings; unset ones keep the
/// defaults used by every scenario, which are scaled down for simulation).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigOverrides {
    pub tick_ms: Option<u64>,
    pub batch_size: Option<u32>,
    pub lease_ttl_secs: Option<u64>,
    pub pipeline_depth: Option<u32>,
    pub confirm_timeout_secs: Option<u64>,
    /// The drainer's rate bound (rows claimed per second, 0 for none).
    pub max_rows_per_sec: Option<u32>,
    pub max_attempts: Option<u32>,
    pub retention_secs: Option<u64>,
    pub janitor_interval_secs: Option<u64>,
    pub janitor_batch: Option<u32>,
    /// The stats task's interval in milliseconds (default 1000).
    pub stats_interval_ms: Option<u64>,
    /// Readiness: pending rows over this are unready (default 10 000).
    pub pending_warn: Option<u64>,
    /// Readiness: an oldest pending row older than this many seconds is
    /// unready (default 900).
    pub oldest_warn_secs: Option<u64>,
    /// Subscriber attempt budget (default 3).
    pub consumer_max_attempts: Option<u32>,
    /// Subscriber prefetch (default 8).
    pub consumer_prefetch: Option<u16>,
    /// Subscriber handler concurrency (default 2).
    pub consumer_concurrency: Option<u32>,
    /// Partition queues of an ordered subscription (default 0: not
    /// ordered; the workers are then the partitions).
    pub consumer_partitions: Option<u16>,
    /// Deliveries a subscriber worker applies in one transaction (default
    /// 4: every consumer scenario runs batched).
    pub consumer_batch_max: Option<u32>,
    /// Longest a batch waits for company, in milliseconds (default 5).
    pub consumer_batch_linger_ms: Option<u64>,
    /// One event in this many fails its first handler attempt (after
    /// writing its effect); 0 for none (the default).
    pub consumer_transient_one_in: Option<u64>,
    /// Subscriber size limit (default 16 KiB, so hostile oversized bodies
    /// stay small on the simulated network).
    pub consumer_max_body_bytes: Option<u32>,
    /// The subscription's queue type, `quorum` or `classic` (default: the
    /// library's, `SubscriberSettings::new`).
    pub queue_type: Option<String>,
    /// Inbox retention in seconds (default 30).
    pub inbox_retention_secs: Option<u64>,
    /// Inbox janitor interval in seconds (default 3).
    pub inbox_janitor_interval_secs: Option<u64>,
    /// The partitioned layout (issue 28), partitions this many ms wide
    /// (default: the plain layout, the ADR's).
    pub partition_width_ms: Option<u64>,
    /// The durability gates: the drainers publish and the subscribers ack
    /// only what the database's standby flushed
    /// (`CANOPY_MQ_DURABLE_STANDBYS=standby`; default off).
    pub durable_standby: Option<bool>,
}

/// Phases of a run.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Timing {
    /// Faults happen in `[0, fault_phase_secs)`; then everything heals.
    pub fault_phase_secs: f64,
    /// After healing (and the workload finishing), every committed envelope
    /// must be confirmed by the broker within this bound.
    pub liveness_secs: f64,
}

/// Why a scenario file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a valid scenario: {message}")]
    Parse { path: String, message: String },
}

impl Scenario {
    /// Loads and checks one scenario file.
    pub fn load(path: &Path) -> Result<Self, ScenarioError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: p.clone(),
            source,
        })?;
        let name = path
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self::parse(&p, name, &text)
    }

    /// Parses and checks a scenario's TOML `text`, read from `path` (for
    /// the errors), and names it `name`.
    pub fn parse(path: &str, name: String, text: &str) -> Result<Self, ScenarioError> {
        let mut s: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        s.name = name;
        s.check().map_err(|message| ScenarioError::Parse {
            path: path.to_owned(),
            message,
        })?;
        Ok(s)
    }

    /// Whether the scenario is consistent (what `load` checks after parsing).
    pub fn check(&self) -> Result<(), String> {
        let w = &self.workload;
        if w.envelopes_per_tx[0] == 0 || w.envelopes_per_tx[0] > w.envelopes_per_tx[1] {
            return Err("workload.envelopes_per_tx must be [min, max] with 1 <= min <= max".into());
        }
        if w.interval_ms[0] > w.interval_ms[1] {
            return Err("workload.interval_ms must be [min, max]".into());
        }
        for p in [
            w.rollback_ratio,
            w.poison_ratio,
            w.unpublishable_ratio,
            w.unique_ratio,
            w.keyed_ratio,
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err("ratios must be within [0, 1]".into());
            }
        }
        if w.writers == 0 || w.writers > 16 {
            return Err("workload.writers must be 1..=16".into());
        }
        if self.topology.drainers == 0 || self.topology.drainers > 16 {
            return Err("topology.drainers must be 1..=16".into());
        }
        let nodes = self.topology.broker_nodes;
        if nodes == 0 || nodes > 7 {
            return Err("topology.broker_nodes must be 1..=7".into());
        }
        if let Some(kind) = &self.config.queue_type
            && kind.parse::<outbox::QueueType>().is_err()
        {
            return Err(format!(
                "config.queue_type is {kind:?}; it must be \"quorum\" or \"classic\""
            ));
        }
        for f in &self.faults {
            let (at, len) = f.window();
            if at < 0.0 || len < 0.0 || at + len > self.timing.fault_phase_secs + 1e-9 {
                return Err(format!("fault {f:?} falls outside the fault phase"));
            }
            f.check()?;
            f.check_nodes(nodes)?;
        }
        if nodes < 3
            && self
                .swarm
                .as_ref()
                .is_some_and(|s| s.families.iter().any(|f| f.needs_cluster()))
        {
            return Err("broker node faults need topology.broker_nodes >= 3".into());
        }
        let consumer_faults = self.faults.iter().any(|f| {
            matches!(
                f,
                Fault::Downstream { .. } | Fault::Hostile { .. } | Fault::DomainLock { .. }
            )
        }) || self
            .swarm
            .as_ref()
            .is_some_and(|s| s.families.iter().any(|f| f.needs_consumers()));
        if consumer_faults && self.topology.consumers == 0 {
            return Err("consumer faults need topology.consumers >= 1".into());
        }
        self.check_keyed_hostile()?;
        if let Some(name) = self
            .expect
            .reach
            .iter()
            .find(|n| Mark::from_name(n).is_none())
        {
            let known: Vec<&str> = Mark::ALL.iter().map(|m| m.name()).collect();
            return Err(format!(
                "expect.reach names {name:?}, which is no mark; known: {known:?}"
            ));
        }
        Ok(())
    }

    /// Keyed hostile messages need an ordered subscription.
    fn check_keyed_hostile(&self) -> Result<(), String> {
        let keyed_hostile = self
            .faults
            .iter()
            .any(|f| matches!(f, Fault::Hostile { keyed, .. } if *keyed > 0.0));
        if keyed_hostile && self.config.consumer_partitions.unwrap_or(0) == 0 {
            return Err("keyed hostile messages need an ordered subscription \
                        (config.consumer_partitions > 0)"
                .into());
        }
        Ok(())
    }

    /// The seeds pinned for this build's engine.
    pub fn pinned(&self) -> &[u64] {
        if crate::engine::NAME == "madsim" {
            &self.madsim_seeds
        } else {
            &self.seeds
        }
    }

    /// Pins exactly `seeds` for this build's engine, none for the other.
    pub fn pin_only(&mut self, seeds: Vec<u64>) {
        if crate::engine::NAME == "madsim" {
            self.seeds.clear();
            self.madsim_seeds = seeds;
        } else {
            self.madsim_seeds.clear();
            self.seeds = seeds;
        }
    }

    /// The clean twin of a faulty scenario: the same workload, topology,
    /// configuration and seeds with no faults, named `NAME.clean`. A failure
    /// of the twin points at the workload or the checker, not the faults.
    pub fn clean_twin(&self) -> Option<Scenario> {
        if self.faults.is_empty() && self.swarm.is_none() {
            return None;
        }
        let mut twin = self.clone();
        twin.name = format!("{}.clean", self.name);
        twin.description = format!("Clean twin of {}: {}", self.name, self.description);
        twin.faults.clear();
        twin.swarm = None;
        twin.expect = Expect::default();
        Some(twin)
    }

    /// Loads `NAME` (or its twin, `NAME.clean`) from `dir`, or a path.
    pub fn find(dir: &Path, name: &str) -> Result<Scenario, ScenarioError> {
        let as_path = Path::new(name);
        if as_path.extension().is_some_and(|e| e == "toml") {
            return Scenario::load(as_path);
        }
        if let Some(base) = name.strip_suffix(".clean") {
            let s = Scenario::load(&dir.join(format!("{base}.toml")))?;
            return s.clean_twin().ok_or_else(|| ScenarioError::Parse {
                path: name.to_owned(),
                message: format!("{base} has no faults, so no clean twin"),
            });
        }
        Scenario::load(&dir.join(format!("{name}.toml")))
    }

    /// Every scenario in `dir` followed by its clean twin, sorted by name.
    pub fn load_dir_with_twins(dir: &Path) -> Result<Vec<Scenario>, ScenarioError> {
        let mut out = Vec::new();
        for s in Scenario::load_dir(dir)? {
            let twin = s.clean_twin();
            out.push(s);
            out.extend(twin);
        }
        Ok(out)
    }

    /// Every `*.toml` in `dir`, sorted by name.
    pub fn load_dir(dir: &Path) -> Result<Vec<Scenario>, ScenarioError> {
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .map_err(|source| ScenarioError::Read {
                path: dir.display().to_string(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        paths.sort();
        paths.iter().map(|p| Scenario::load(p)).collect()
    }
}
