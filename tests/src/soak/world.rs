//! The processes of a soak and what each step does to them: a private etcd and Redis, three
//! `sluice-manager` replicas, and simulated hosts that run one `loadgen` per task at all times
//! (a run is replaced by its successor a little before it ends, so demand never pauses; one
//! host runs under libfaketime with a clock offset). Monitoring — reading the runs' progress
//! files, polling the task meta and the future slices in Redis, noticing crashes — happens
//! in [`World::idle`], which every step and pause goes through, so the checks run
//! continuously.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_protocol::{Keys, meta_field, slice_field};

use super::check::{self, Coverage, FenceState, SliceRead, Slices, Timing, Violation, applied_by};
use super::ledger::{Disturb, Ledger, MetaState};
use super::modes;
use super::plan::{Shape, Step, task_name};
use super::rng::Rng;
use super::spec::{Class, Spec};
use crate::{
    EtcdServer, Manager, ManagerOpts, RedisServer, child_pids, http, loadgen_args, now_ms,
    pids_with_cmdline, remove_segment, signal, wait_gone, workspace_bin,
};

// The agent hosts' part of the world (a child module: it sees the world's fields).
#[path = "world_agents.rs"]
mod world_agents;
// The Envoy imports' part of the world.
#[path = "world_envoy.rs"]
mod world_envoy;
// A second manager cluster on the namespace.
#[path = "world_cluster2.rs"]
mod world_cluster2;

/// Replicas of the manager.
pub const REPLICAS: usize = 3;
/// `--lease-ttl` of the replicas.
pub const LEASE_TTL: &str = "2s";
/// `--tick` of the replicas.
pub const TICK: &str = "250ms";
/// `--control-period` of the replicas (dynamic limiting).
pub const CONTROL_PERIOD: &str = "2s";
/// `--probe-interval-ms` of the load generators (the SDK default is 5 s).
pub const PROBE_INTERVAL_MS: i64 = 1_000;
/// Where libfaketime may be installed.
const FAKETIME_LIBS: [&str; 4] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
];

/// One manager replica (None while down).
struct Replica {
    node_id: String,
    generation: u32,
    m: Option<Manager>,
    stopped: bool,
}

/// One loadgen run of one host for one task.
struct Run {
    id: u64,
    task: usize,
    offset_ms: i64,
    child: Option<Child>,
    ends: Instant,
    progress: PathBuf,
    pos: u64,
    partial: String,
    out: PathBuf,
    err: PathBuf,
    /// Killed or stopped on purpose (its exit is not checked).
    stopped_by_us: bool,
    /// Exited and reaped.
    exited: bool,
    /// Its processes run permit loops: the `--intervals` file exists (a concurrency child
    /// creates it before its first decision).
    permit_loops: bool,
}

impl Drop for Run {
    fn drop(&mut self) {
        // The children die with their parent (PR_SET_PDEATHSIG).
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A simulated host.
struct Host {
    id: String,
    faketime: bool,
    offset_ms: i64,
    down: bool,
    runs: Vec<Run>,
    /// An agent host's `sluice-agent` (its runs are `agent_host` drivers).
    agent: Option<super::agents::AgentProc>,
}

/// Reads slice hashes from the soak's Redis.
struct RedisSlices<'a> {
    conn: &'a mut Option<redis::Connection>,
    url: &'a str,
    keys: &'a Keys,
}

fn connect(url: &str) -> Option<redis::Connection> {
    let c = redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
        .ok()?;
    c.set_read_timeout(Some(Duration::from_millis(800))).ok()?;
    c.set_write_timeout(Some(Duration::from_millis(800))).ok()?;
    Some(c)
}

/// Runs `f` on the monitoring connection (reconnecting when needed); an error drops the
/// connection and answers None.
fn with_conn<T>(
    conn: &mut Option<redis::Connection>,
    url: &str,
    f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
) -> Option<T> {
    if conn.is_none() {
        *conn = connect(url);
    }
    let c = conn.as_mut()?;
    match f(c) {
        Ok(v) => Some(v),
        Err(_) => {
            *conn = None;
            None
        }
    }
}

/// A count field read back from Redis: a non-negative integer, or nothing.
fn count_field(v: Option<String>) -> Option<u64> {
    v?.trim().parse::<u64>().ok()
}

impl Slices for RedisSlices<'_> {
    fn describe(&mut self, task: usize, start: i64) -> String {
        let key = self.keys.slice(&task_name(task), start);
        let r: Option<(Vec<(String, String)>, i64)> = with_conn(self.conn, self.url, |c| {
            redis::pipe()
                .cmd("HGETALL")
                .arg(&key)
                .cmd("PTTL")
                .arg(&key)
                .query(c)
        });
        match r {
            Some((fields, pttl)) => format!("{key} = {fields:?}, PTTL {pttl} ms"),
            None => format!("{key}: Redis unreachable"),
        }
    }

    fn read(&mut self, task: usize, starts: &[i64]) -> Option<Vec<Option<SliceRead>>> {
        read_slices(self.conn, self.url, self.keys, &task_name(task), starts)
    }
}

/// A slice's `cap`, `adm`, `pace`, `burst`, `len` as stored.
type RawSlice = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// `cap`, `adm` and pacing of the slices of task `name` starting at `starts` (one pipeline); `None`
/// when Redis cannot be read, a slice without a cap as `None`.
fn read_slices(
    conn: &mut Option<redis::Connection>,
    url: &str,
    keys: &Keys,
    name: &str,
    starts: &[i64],
) -> Option<Vec<Option<SliceRead>>> {
    let rows: Vec<RawSlice> = with_conn(conn, url, |c| {
        let mut pipe = redis::pipe();
        for s in starts {
            pipe.cmd("HMGET")
                .arg(keys.slice(name, *s))
                .arg(slice_field::CAP)
                .arg(slice_field::ADMITTED)
                .arg(slice_field::PACE)
                .arg(slice_field::BURST)
                .arg(slice_field::LEN);
        }
        pipe.query(c)
    })?;
    Some(
        rows.into_iter()
            .map(|(cap, adm, pace, burst, len)| {
                Some(SliceRead {
                    cap: count_field(cap)?,
                    adm: count_field(adm).unwrap_or(0),
                    pace_burst: (pace.as_deref() == Some("1"))
                        .then(|| count_field(burst).unwrap_or(0)),
                    len: count_field(len).unwrap_or(0),
                })
            })
            .collect(),
    )
}

/// Settings of a world.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Namespace (unique to the run: everything it starts carries it).
    pub ns: String,
    /// Logs directory.
    pub logs: PathBuf,
    /// Number of tasks.
    pub tasks: usize,
    /// The shape (offered rates, hosts).
    pub shape: Shape,
    /// Seed of the run-time choices (run lengths, processes per run, who is picked).
    pub seed: u64,
    /// Agent hosts: the last `agents.len()` of `shape.hosts` (after the faketime host).
    pub agents: Vec<super::agents::AgentApi>,
    /// The managers' `--lazy-after` (`None`: off).
    pub lazy_after: Option<String>,
}

/// Everything a soak runs, and what it has seen.
pub struct World {
    /// Namespace.
    pub ns: String,
    /// Logs directory.
    pub logs: PathBuf,
    keys: Keys,
    etcd: EtcdServer,
    redis: RedisServer,
    redis_url: String,
    etcd_up: bool,
    redis_up: bool,
    replicas: Vec<Replica>,
    hosts: Vec<Host>,
    /// What happened.
    pub ledger: Ledger,
    /// Offered rates.
    pub shape: Shape,
    conn: Option<redis::Connection>,
    rng: Rng,
    run_seq: u64,
    /// Every violation seen (in order).
    pub violations: Vec<Violation>,
    /// The checks' allowances.
    pub timing: Timing,
    /// What the checks covered.
    pub coverage: Coverage,
    /// Fencing observations made.
    pub fence_observations: u64,
    /// Liveness checks made (tasks × quiet periods).
    pub liveness_checks: u64,
    checked_until: Vec<i64>,
    /// The managers' `--lazy-after`.
    lazy_after: Option<String>,
    changes_done: Vec<Vec<i64>>,
    fence: Vec<FenceState>,
    faketime_lib: PathBuf,
    last_meta: Instant,
    last_second: Instant,
    last_prune: Instant,
    /// Stalls seen by the stall probe, not yet moved to the ledger.
    stalls: std::sync::Arc<std::sync::Mutex<Vec<(i64, i64)>>>,
    log: File,
    envoy: world_envoy::EnvoyWorld,
    /// The lock track (`locks.rs`), once started.
    pub locks: Option<super::locks::Track>,
    /// Paced, shadow, keyed and concurrency tasks: their runs and checks (modes.rs).
    pub modes: super::modes::Watch,
}

/// The complete lines appended to `path` since `pos` (advanced), with the partial last line
/// of the previous read (`partial`) in front and this read's kept in `partial`: how the
/// soak tails the files its processes append to. Empty when the file cannot be read.
pub(super) fn new_lines(path: &Path, pos: &mut u64, partial: &mut String) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    if f.seek(SeekFrom::Start(*pos)).is_err() {
        return String::new();
    }
    let mut buf = String::new();
    let Ok(n) = f.read_to_string(&mut buf) else {
        return String::new();
    };
    *pos += n as u64;
    partial.push_str(&buf);
    match partial.rfind('\n') {
        Some(i) => {
            let rest = partial.split_off(i + 1);
            std::mem::replace(partial, rest)
        }
        None => String::new(),
    }
}

/// Starts the stall probe: a thread that sleeps 10 ms in a loop and records every wake-up
/// late by at least [`super::ledger::STALL_MIN_MS`] as a stall `[due, woke)` (real time): the
/// machine was starved then (other work on the cores), and every process of the soak with it.
/// It runs until the soak exits.
fn stall_probe() -> std::sync::Arc<std::sync::Mutex<Vec<(i64, i64)>>> {
    let out = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let probe = out.clone();
    std::thread::Builder::new()
        .name("stall-probe".into())
        .spawn(move || {
            loop {
                let due = now_ms() + 10;
                std::thread::sleep(Duration::from_millis(10));
                let woke = now_ms();
                if woke - due >= super::ledger::STALL_MIN_MS
                    && let Ok(mut v) = probe.lock()
                {
                    v.push((due, woke));
                }
            }
        })
        .expect("start the stall probe");
    out
}

/// The faketime value for an offset in ms (`+1.200s`, `-0.300s`).
fn faketime_offset(ms: i64) -> String {
    let sign = if ms < 0 { '-' } else { '+' };
    format!("{sign}{}.{:03}s", ms.abs() / 1_000, ms.abs() % 1_000)
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl World {
    /// Starts etcd, Redis (with `DEBUG` enabled) and the replicas; waits for a leader.
    pub async fn start(s: Settings) -> Self {
        std::fs::create_dir_all(s.logs.join("runs")).expect("create the logs directory");
        let faketime_lib = FAKETIME_LIBS
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .unwrap_or_else(|| {
                panic!("libfaketime not found in {FAKETIME_LIBS:?}: install the faketime package")
            });
        let etcd = EtcdServer::start();
        let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
        let redis_url = redis.url();
        let log = File::create(s.logs.join("steps.log")).expect("create steps.log");
        let sdk_hosts = s.shape.hosts - s.agents.len();
        let hosts = (0..s.shape.hosts)
            .map(|i| Host {
                id: format!("{}-h{i}", s.ns),
                faketime: i + 1 == sdk_hosts,
                offset_ms: if i + 1 == sdk_hosts { 300 } else { 0 },
                down: false,
                runs: Vec::new(),
                agent: s.agents.get(i.wrapping_sub(sdk_hosts)).map(|api| {
                    super::agents::AgentProc::new(
                        *api,
                        &format!("{}-h{i}", s.ns),
                        &redis_url,
                        &s.ns,
                        s.logs.clone(),
                    )
                }),
            })
            .collect();
        let t0 = now_ms();
        let hosts_n = s.shape.hosts;
        let mut w = Self {
            keys: Keys::new(&s.ns).expect("namespace"),
            ns: s.ns.clone(),
            logs: s.logs,
            etcd,
            redis,
            redis_url,
            etcd_up: true,
            redis_up: true,
            replicas: (0..REPLICAS)
                .map(|i| Replica {
                    node_id: format!("n{i}"),
                    generation: 0,
                    m: None,
                    stopped: false,
                })
                .collect(),
            hosts,
            ledger: Ledger {
                sdk_hosts,
                ..Ledger::new(s.tasks, s.shape.hosts)
            },
            shape: s.shape,
            conn: None,
            rng: Rng::new(s.seed ^ 0x5eed_0fc0_ffee),
            run_seq: 0,
            violations: Vec::new(),
            timing: Timing::default(),
            coverage: Coverage::default(),
            fence_observations: 0,
            liveness_checks: 0,
            checked_until: vec![t0; s.tasks],
            lazy_after: s.lazy_after,
            changes_done: vec![Vec::new(); s.tasks],
            fence: vec![FenceState::default(); s.tasks],
            faketime_lib,
            last_meta: Instant::now(),
            last_second: Instant::now(),
            last_prune: Instant::now(),
            stalls: stall_probe(),
            log,
            envoy: Default::default(),
            locks: None,
            modes: super::modes::Watch::new(s.tasks, hosts_n, t0),
        };
        for i in 0..REPLICAS {
            w.start_replica(i).await;
        }
        w.wait_leader(Duration::from_secs(20)).await;
        w.start_agents();
        w
    }

    /// Prints a line and appends it to `steps.log`.
    pub fn say(&mut self, line: &str) {
        println!("{line}");
        let _ = writeln!(self.log, "{line}");
    }

    fn violate(&mut self, invariant: &'static str, task: Option<String>, evidence: String) {
        self.violations.push(Violation {
            invariant,
            task,
            slice: None,
            evidence,
        });
    }

    // ── replicas ──────────────────────────────────────────────────────────────────────────

    async fn start_replica(&mut self, i: usize) {
        let r = &mut self.replicas[i];
        r.generation += 1;
        let mut o = ManagerOpts::new(&self.etcd.endpoint(), &self.redis_url, &self.ns, &r.node_id);
        o.lease_ttl = LEASE_TTL.into();
        o.extra = ["--tick", TICK, "--control-period", CONTROL_PERIOD]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if let Some(d) = &self.lazy_after {
            o.extra.extend(["--lazy-after".to_string(), d.clone()]);
        }
        // Manager::start panics when the process dies at start-up: that is a finding.
        match tokio::spawn(Manager::start(o)).await {
            Ok(m) => {
                r.m = Some(m);
                r.stopped = false;
            }
            Err(e) => {
                let node = r.node_id.clone();
                self.violate(
                    "crash.manager_start",
                    None,
                    format!("replica {node} did not start: {e}"),
                );
            }
        }
    }

    /// Saves a replica's log into the logs directory (before its process is dropped).
    fn save_replica_log(&self, i: usize) {
        let r = &self.replicas[i];
        if let Some(m) = &r.m {
            let path = self
                .logs
                .join(format!("manager-{}-{}.log", r.node_id, r.generation));
            let _ = std::fs::write(path, m.proc.log());
        }
    }

    /// Replicas that run and are not stopped.
    fn live_replicas(&self) -> Vec<usize> {
        (0..self.replicas.len())
            .filter(|i| self.replicas[*i].m.is_some() && !self.replicas[*i].stopped)
            .collect()
    }

    /// The replica that says it leads, if any.
    async fn leader(&self) -> Option<usize> {
        for i in self.live_replicas() {
            if let Some(m) = &self.replicas[i].m
                && m.says_leader().await
            {
                return Some(i);
            }
        }
        None
    }

    /// The leader, or (none) a random live replica; with what was picked.
    async fn leader_or_any(&mut self) -> Option<(usize, &'static str)> {
        if let Some(i) = self.leader().await {
            return Some((i, "leader"));
        }
        let live = self.live_replicas();
        if live.is_empty() {
            return None;
        }
        Some((*self.rng.pick(&live), "no leader: a replica"))
    }

    /// Waits until a live replica leads (monitoring meanwhile); false on timeout.
    async fn wait_leader(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.leader().await.is_some() {
                return true;
            }
            self.idle(200).await;
        }
        false
    }

    // ── the API ───────────────────────────────────────────────────────────────────────────

    /// A random live replica's address.
    fn api_target(&mut self) -> Option<String> {
        let live = self.live_replicas();
        if live.is_empty() {
            return None;
        }
        let i = *self.rng.pick(&live);
        self.replicas[i].m.as_ref().map(|m| m.addr.clone())
    }

    /// `PUT` the spec; records the version when written (or maybe written).
    pub async fn put(&mut self, task: usize, spec: &Spec) -> String {
        let Some(addr) = self.api_target() else {
            return "no replica to ask".into();
        };
        let at = now_ms();
        let r = http()
            .put(format!("http://{addr}/api/v1/tasks/{}", task_name(task)))
            .header("content-type", "application/json")
            .body(spec.to_json().to_string())
            .send()
            .await;
        let (confirmed, note) = match r {
            Ok(r) if r.status().is_success() => (Some(true), format!("{} via {addr}", r.status())),
            Ok(r) if r.status().as_u16() == 503 => (None, format!("503 via {addr} (not written)")),
            Ok(r) => {
                let status = r.status();
                let body = r.text().await.unwrap_or_default();
                self.violate(
                    "api.rejected",
                    Some(task_name(task)),
                    format!("PUT {} answered {status}: {body}", spec.to_json()),
                );
                (None, format!("{status}"))
            }
            Err(e) => (
                Some(false),
                format!("no answer from {addr} ({e}): maybe written"),
            ),
        };
        self.record(task, at, Some(spec.clone()), confirmed);
        note
    }

    /// Records a version written at `at` (`confirmed` None: nothing was written).
    fn record(&mut self, task: usize, at: i64, spec: Option<Spec>, confirmed: Option<bool>) {
        if let Some(confirmed) = confirmed {
            self.ledger.api[task].push(super::ledger::ApiVersion {
                at_ms: at,
                spec,
                confirmed,
            });
        }
    }

    /// `DELETE` the task; records the deletion when made (or maybe made).
    pub async fn delete(&mut self, task: usize) -> String {
        let Some(addr) = self.api_target() else {
            return "no replica to ask".into();
        };
        let at = now_ms();
        let r = http()
            .delete(format!("http://{addr}/api/v1/tasks/{}", task_name(task)))
            .send()
            .await;
        let (confirmed, note) = match r {
            Ok(r) if r.status().as_u16() == 204 => (Some(true), format!("204 via {addr}")),
            Ok(r) if r.status().as_u16() == 404 => (None, "404 (not there)".to_string()),
            Ok(r) if r.status().as_u16() == 503 => (None, format!("503 via {addr} (not deleted)")),
            Ok(r) => {
                let status = r.status();
                self.violate(
                    "api.rejected",
                    Some(task_name(task)),
                    format!("DELETE answered {status}"),
                );
                (None, format!("{status}"))
            }
            Err(e) => (
                Some(false),
                format!("no answer from {addr} ({e}): maybe deleted"),
            ),
        };
        self.record(task, at, None, confirmed);
        note
    }

    // ── hosts and their loadgen runs ──────────────────────────────────────────────────────

    fn start_run(&mut self, host: usize, task: usize) {
        self.run_seq += 1;
        let id = self.run_seq;
        let procs = self.rng.range(1, 2) as u32;
        let duration_ms = self.rng.range(20, 60) * 1_000;
        let host_rate = self.shape.host_rate[task];
        let rate = host_rate as f64 / f64::from(procs);
        let capacity = (host_rate as f64 * self.rng.uniform(0.5, 1.5)).round() as u64;
        let h = &self.hosts[host];
        let base = self
            .logs
            .join("runs")
            .join(format!("{id:05}-h{host}-{}", task_name(task)));
        let progress = base.with_extension("progress");
        let out = base.with_extension("out");
        let err = base.with_extension("err");
        let args = loadgen_args(
            &self.redis_url,
            &self.ns,
            &task_name(task),
            &h.id,
            procs,
            duration_ms,
            &[
                "--rate",
                &format!("{rate:.1}"),
                "--bucket-ms",
                "100",
                "--progress",
                &progress.display().to_string(),
                "--probe-interval-ms",
                &PROBE_INTERVAL_MS.to_string(),
                "--backend-capacity",
                &capacity.max(1).to_string(),
            ],
        );
        let spec = self.ledger.newest(task).and_then(|v| v.spec.clone());
        let mut more = self
            .modes
            .run_args(&mut self.rng, spec.as_ref(), &base, task, h.offset_ms);
        // Several limits, all or nothing: a third of the SDK runs of a plain pooled task decide
        // every permit together with another plain pooled task (`acquire_all`; the loadgen
        // decides its task alone while either is not one). Each part is charged to its own
        // task's ledger; a refusal to the task that refused.
        let plain =
            |s: Option<&Spec>| s.is_some_and(|s| s.mode == "pooled" && s.modes.keyed.is_none());
        if h.agent.is_none() && plain(spec.as_ref()) && self.rng.chance(0.35) {
            let partners: Vec<usize> = (0..self.ledger.api.len())
                .filter(|u| *u != task)
                .filter(|u| plain(self.ledger.newest(*u).and_then(|v| v.spec.as_ref())))
                .collect();
            if !partners.is_empty() {
                let u = *self.rng.pick(&partners);
                more.push("--all-with".into());
                more.push(task_name(u));
                self.modes.cov.runs_all += 1;
            }
        }
        let mut cmd = match &h.agent {
            Some(a) => a.driver(
                &task_name(task),
                host_rate as f64 * super::agents::AGENT_RATE_SHARE,
                duration_ms,
                &progress.display().to_string(),
            ),
            None => Command::new(workspace_bin("examples/loadgen")),
        };
        if h.agent.is_none() {
            cmd.args(&args).args(&more).env("RUST_LOG", "sluice=info");
        }
        if h.faketime {
            cmd.env("LD_PRELOAD", &self.faketime_lib)
                .env("FAKETIME", faketime_offset(h.offset_ms))
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(File::create(&out).expect("create run stdout"))
            .stderr(File::create(&err).expect("create run stderr"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start loadgen: {e}"));
        let offset_ms = h.offset_ms;
        let ends =
            Instant::now() + Duration::from_millis(duration_ms + 1_000 + 50 * u64::from(procs));
        // The load generator starts deciding at spawn + 1 s + 50 ms a process.
        let from = now_ms() + 1_000 + 50 * i64::from(procs);
        self.modes.mark_run(task, from, from + duration_ms as i64);
        self.hosts[host].runs.push(Run {
            id,
            task,
            offset_ms,
            child: Some(child),
            ends,
            progress,
            pos: 0,
            partial: String::new(),
            out,
            err,
            stopped_by_us: false,
            exited: false,
            permit_loops: false,
        });
    }

    /// Starts a successor for every (host, task) whose runs all end within 1.5 s.
    fn tend_runs(&mut self) {
        let soon = Instant::now() + Duration::from_millis(1_500);
        for h in 0..self.hosts.len() {
            if self.hosts[h].down {
                continue;
            }
            for t in 0..self.ledger.api.len() {
                let covered = self.hosts[h]
                    .runs
                    .iter()
                    .any(|r| r.task == t && !r.exited && r.ends > soon);
                if !covered {
                    self.start_run(h, t);
                }
            }
        }
    }

    /// Reads new progress lines of every run into the ledger.
    fn read_progress(&mut self) {
        for h in 0..self.hosts.len() {
            let agent = self.hosts[h].agent.is_some();
            for r in &mut self.hosts[h].runs {
                let complete = new_lines(&r.progress, &mut r.pos, &mut r.partial);
                if !r.permit_loops && !agent && !complete.is_empty() {
                    r.permit_loops = r.progress.with_extension("intervals").exists();
                }
                for line in complete.lines() {
                    // Validated like any input: a bad line is a finding, not a crash.
                    let v: Option<Value> = serde_json::from_str(line).ok();
                    // An `--all-with` answer that contradicted all-or-nothing (loadgen.rs).
                    if let Some(what) = v.as_ref().and_then(|v| v["inconsistent"].as_str()) {
                        self.violations.push(Violation {
                            invariant: "acquire_all.inconsistent",
                            task: Some(task_name(r.task)),
                            slice: None,
                            evidence: format!("{}: {what}", r.progress.display()),
                        });
                        continue;
                    }
                    // A key's part of a keyed run's bucket (modes.rs).
                    if let Some(v) = v.as_ref().filter(|v| v.get("key").is_some()) {
                        if !self.modes.key_line(r.task, h, v, r.offset_ms) {
                            self.violations.push(Violation {
                                invariant: "loadgen.progress",
                                task: Some(task_name(r.task)),
                                slice: None,
                                evidence: format!(
                                    "bad key line in {}: {line:?}",
                                    r.progress.display()
                                ),
                            });
                        }
                        continue;
                    }
                    let sh = v.as_ref().and_then(|v| v["sh"].as_u64()).unwrap_or(0);
                    let parsed = v.as_ref().and_then(|v| {
                        Some((
                            v["bucket"].as_i64()?,
                            v["adm"].as_u64()?,
                            v["rej"].as_u64()?,
                            v["fb"].as_u64()?,
                        ))
                    });
                    // An `--all-with` run writes its second task's lines under that task's name.
                    let line_task = v.as_ref().and_then(|v| v["task"].as_str());
                    let t = match line_task {
                        Some(name) if name != task_name(r.task) => name
                            .strip_prefix('t')
                            .and_then(|i| i.parse::<usize>().ok())
                            .filter(|i| *i < self.ledger.api.len()),
                        _ => Some(r.task),
                    };
                    match (parsed, t) {
                        (Some((b, a, rj, fb)), Some(t))
                            if t != r.task && b % 100 == 0 && fb <= a =>
                        {
                            self.modes.cov.all_lines += 1;
                            self.ledger.count(t, h, b, a, rj, fb, r.offset_ms);
                            self.ledger.count_shadow(t, h, b, sh);
                        }
                        (Some((b, a, rj, fb)), Some(_)) if b % 100 == 0 && fb <= a => {
                            self.ledger.count(r.task, h, b, a, rj, fb, r.offset_ms);
                            if let Some(n) = v.as_ref().and_then(|v| v["gb"].as_u64()) {
                                self.ledger.count_given_back(r.task, h, b, n);
                            }
                            if r.permit_loops {
                                self.modes.count_waits(r.task, h, b - r.offset_ms, rj);
                            }
                            // The run's loop woke up `late` ms late in this bucket: a stall,
                            // placed at the bucket's end in real time (see `Ledger::stalls`).
                            let late = v.as_ref().and_then(|v| v["late"].as_i64()).unwrap_or(0);
                            if late >= super::ledger::STALL_MIN_MS {
                                let end = b - r.offset_ms + 100;
                                self.ledger.stalls.push((end - late.min(60_000), end));
                            }
                            // Agent hosts: admissions whose slice is not known (agents.rs).
                            if let Some(n) = v.as_ref().and_then(|v| v["strad"].as_u64()) {
                                self.ledger.count_straddled(r.task, h, b, n);
                            }
                            if let Some(n) = v.as_ref().and_then(|v| v["reach"].as_u64()) {
                                self.ledger.count_reach(r.task, h, b, n);
                            }
                            // An agent host's admissions of a shadow task cannot be told
                            // apart (RLS answers OK either way): all counted as shadow.
                            let amb = agent && self.ledger.maybe_shadow(r.task, b);
                            let sh = if amb { a.saturating_sub(fb) } else { sh };
                            self.ledger.count_shadow(r.task, h, b, sh);
                            if amb {
                                self.ledger.count_ambiguous(r.task, h, b, sh);
                            }
                        }
                        _ => self.violations.push(Violation {
                            invariant: "loadgen.progress",
                            task: Some(task_name(r.task)),
                            slice: None,
                            evidence: format!(
                                "bad progress line in {}: {line:?}",
                                r.progress.display()
                            ),
                        }),
                    }
                }
            }
        }
    }

    /// Reaps runs that exited: an exit we did not cause must be 0 with one JSON line, and no
    /// run may have panicked.
    fn reap_runs(&mut self) {
        let mut found = Vec::new();
        let mut cancelled = 0;
        for h in &mut self.hosts {
            for r in &mut h.runs {
                let Some(c) = r.child.as_mut() else { continue };
                let Ok(Some(st)) = c.try_wait() else { continue };
                r.child = None;
                r.exited = true;
                let err = std::fs::read_to_string(&r.err).unwrap_or_default();
                if let Some(i) = err.find("panicked") {
                    // The panic line and its message.
                    let what: String = err[i..].lines().take(2).collect::<Vec<_>>().join(": ");
                    found.push((
                        "crash.loadgen_panic",
                        r.task,
                        format!("run {} of {} {what} (log {})", r.id, h.id, r.err.display()),
                    ));
                }
                if !r.stopped_by_us {
                    let out = std::fs::read_to_string(&r.out).unwrap_or_default();
                    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
                    let v = (lines.len() == 1)
                        .then(|| serde_json::from_str::<Value>(lines[0]).ok())
                        .flatten();
                    let json_ok = v.as_ref().is_some_and(|v| v["admitted"].is_u64());
                    cancelled += v
                        .as_ref()
                        .and_then(|v| v["all_with"]["cancelled"].as_u64())
                        .unwrap_or(0);
                    if !st.success() || !json_ok {
                        found.push((
                            "crash.loadgen_exit",
                            r.task,
                            format!(
                                "run {} of {} ended with {st} and {} stdout line(s):\n{}",
                                r.id,
                                h.id,
                                lines.len(),
                                tail(&err, 20)
                            ),
                        ));
                    }
                }
            }
        }
        self.modes.cov.all_cancelled += cancelled;
        for (inv, task, evidence) in found {
            self.violations.push(Violation {
                invariant: inv,
                task: Some(task_name(task)),
                slice: None,
                evidence,
            });
        }
        // Drop runs that ended and were read to the end.
        self.read_progress();
        for h in &mut self.hosts {
            h.runs.retain(|r| !r.exited);
        }
    }

    /// SIGKILLs every run of a host (its children die with it) and checks no child is left.
    fn kill_host(&mut self, host: usize) -> String {
        let mut kids = Vec::new();
        let mut n = 0;
        for r in &mut self.hosts[host].runs {
            if let Some(c) = r.child.as_mut() {
                kids.extend(child_pids(c.id()));
                let _ = c.kill();
                let _ = c.wait();
                r.child = None;
                r.exited = true;
                r.stopped_by_us = true;
                n += 1;
            }
        }
        if let Err(left) = wait_gone(&kids, Duration::from_secs(1)) {
            let id = self.hosts[host].id.clone();
            self.violate(
                "leak.loadgen_child",
                None,
                format!("children {left:?} of {id}'s SIGKILLed loadgens still run after 1 s"),
            );
        }
        self.read_progress();
        self.hosts[host].runs.retain(|r| !r.exited);
        format!("SIGKILLed {n} runs ({} processes)", n + kids.len())
    }

    /// SIGTERMs every run of a host: each must exit 0 within 5 s with its JSON line.
    fn stop_host(&mut self, host: usize) -> String {
        let mut n = 0;
        for r in &mut self.hosts[host].runs {
            if let Some(c) = r.child.as_ref() {
                signal(c.id(), libc::SIGTERM);
                n += 1;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut found = Vec::new();
        for r in &mut self.hosts[host].runs {
            let Some(mut c) = r.child.take() else {
                continue;
            };
            let st = loop {
                if let Ok(Some(st)) = c.try_wait() {
                    break Some(st);
                }
                if Instant::now() >= deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            r.exited = true;
            r.stopped_by_us = true;
            let out = std::fs::read_to_string(&r.out).unwrap_or_default();
            let one_json = out.lines().filter(|l| !l.trim().is_empty()).count() == 1;
            match st {
                Some(st) if st.success() && one_json => {}
                other => found.push((
                    r.task,
                    format!(
                        "run {} (SIGTERM): {other:?}, stdout {:?}\n{}",
                        r.id,
                        tail(&out, 2),
                        tail(&std::fs::read_to_string(&r.err).unwrap_or_default(), 10)
                    ),
                )),
            }
        }
        for (task, evidence) in found {
            self.violations.push(Violation {
                invariant: "loadgen.sigterm",
                task: Some(task_name(task)),
                slice: None,
                evidence,
            });
        }
        self.read_progress();
        self.hosts[host].runs.retain(|r| !r.exited);
        format!("SIGTERMed {n} runs")
    }

    /// Starts the first runs of every host.
    pub fn start_hosts(&mut self) {
        self.tend_runs();
    }

    // ── monitoring ────────────────────────────────────────────────────────────────────────

    fn poll_meta(&mut self) {
        let names: Vec<String> = (0..self.ledger.api.len()).map(task_name).collect();
        let keys = &self.keys;
        type Row = (
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
        );
        let rows: Option<Vec<Row>> = with_conn(&mut self.conn, &self.redis_url, |c| {
            let mut pipe = redis::pipe();
            for n in &names {
                pipe.cmd("HMGET")
                    .arg(keys.meta(n))
                    .arg(meta_field::SLICE_MS)
                    .arg(meta_field::MODE)
                    .arg(meta_field::RETIRED)
                    .arg(meta_field::KEYED);
            }
            pipe.query(c)
        });
        let Some(rows) = rows else { return };
        let at = now_ms();
        for (t, (slice_ms, mode, retired, keyed)) in rows.into_iter().enumerate() {
            // A keyed task has a limit per key: no task-wide bound (modes.rs checks keys).
            let keyed = keyed.as_deref() == Some("1");
            // Validated like input: anything but a well-formed live meta is "missing".
            let state = match (retired, count_field(slice_ms), mode) {
                (Some(_), _, _) => MetaState::Tombstone,
                (None, Some(l), Some(m)) if (100..=86_400_000).contains(&l) => MetaState::Live {
                    slice_ms: l,
                    class: if keyed {
                        Class::Local
                    } else {
                        Class::of_mode(&m)
                    },
                },
                _ => MetaState::Missing,
            };
            let keyed_grid = match state {
                MetaState::Live { slice_ms, .. } if keyed => Some(slice_ms),
                _ => None,
            };
            self.modes.observe_keyed(t, at, keyed_grid);
            self.ledger.observe_meta(t, at, state);
        }
    }

    fn poll_fencing(&mut self) {
        let now = now_ms();
        for t in 0..self.ledger.api.len() {
            let Some(spec) = self.ledger.newest(t).and_then(|v| v.spec.clone()) else {
                continue;
            };
            let l = spec.slice_ms as i64;
            let first = (now + 2_000).div_euclid(l) * l + l;
            let until = now + 6_000.max(2 * l + 2_000);
            let starts: Vec<i64> = (0..)
                .map(|i| first + i * l)
                .take_while(|s| *s < until)
                .collect();
            let mut reader = RedisSlices {
                conn: &mut self.conn,
                url: &self.redis_url,
                keys: &self.keys,
            };
            let Some(reads) = reader.read(t, &starts) else {
                continue;
            };
            let future: Vec<(i64, Option<u64>)> = starts
                .iter()
                .zip(reads)
                .map(|(s, r)| (*s, r.map(|r| r.cap)))
                .collect();
            self.fence_observations += 1;
            let v = check::check_fencing(
                &self.ledger,
                t,
                now,
                &future,
                &mut self.fence[t],
                &self.timing,
            );
            self.violations.extend(v);
        }
    }

    fn check_safety(&mut self, until_now: bool) {
        let now = now_ms();
        let lag = if until_now {
            0
        } else {
            self.timing.data_lag_ms
        };
        for t in 0..self.ledger.api.len() {
            let last_obs = self.ledger.meta[t].last().map_or(now, |r| r.last_ms);
            let upto = (now - lag).min(last_obs - 200);
            let from = self.checked_until[t];
            let mut reader = RedisSlices {
                conn: &mut self.conn,
                url: &self.redis_url,
                keys: &self.keys,
            };
            let (mut v, next) = check::check_safety(
                &self.ledger,
                t,
                from,
                upto,
                &mut reader,
                &self.timing,
                &mut self.coverage,
            );
            v.extend(check::check_changes(
                &self.ledger,
                t,
                upto,
                &mut self.changes_done[t],
                &mut reader,
                &self.timing,
                &mut self.coverage,
            ));
            self.checked_until[t] = next;
            self.violations.extend(v);
        }
    }

    fn check_processes(&mut self) {
        let mut found = Vec::new();
        for r in &mut self.replicas {
            if let Some(m) = r.m.as_mut()
                && !m.proc.is_running()
            {
                found.push(format!(
                    "replica {} exited unexpectedly:\n{}",
                    r.node_id,
                    tail(&m.proc.log(), 30)
                ));
            }
        }
        if self.redis_up && !self.redis.is_running() {
            found.push(format!(
                "redis exited unexpectedly:\n{}",
                tail(&self.redis.log(), 20)
            ));
            self.redis_up = false;
        }
        if self.etcd_up && !self.etcd.is_running() {
            found.push(format!(
                "etcd exited unexpectedly:\n{}",
                tail(&self.etcd.log(), 20)
            ));
            self.etcd_up = false;
        }
        for i in 0..self.replicas.len() {
            if self.replicas[i]
                .m
                .as_mut()
                .is_some_and(|m| !m.proc.is_running())
            {
                self.save_replica_log(i);
                self.replicas[i].m = None;
            }
        }
        for e in found {
            self.violate("crash.process", None, e);
        }
        self.check_agents();
    }

    /// One round of monitoring (called every 100 ms by [`World::idle`]).
    fn monitor(&mut self) {
        if let Ok(mut v) = self.stalls.lock() {
            self.ledger.stalls.append(&mut v);
        }
        if let Some(l) = &self.locks {
            self.violations.extend(l.take_violations());
        }
        self.read_progress();
        if self.last_meta.elapsed() >= Duration::from_millis(250) {
            self.last_meta = Instant::now();
            self.poll_meta();
        }
        if self.last_second.elapsed() >= Duration::from_secs(1) {
            self.last_second = Instant::now();
            self.reap_runs();
            self.tend_runs();
            self.check_processes();
            self.poll_fencing();
            self.check_safety(false);
            self.envoy_monitor(false);
            let v = self
                .modes
                .check(&self.ledger, &self.timing, now_ms(), false);
            self.violations.extend(v);
        }
        if self.last_prune.elapsed() >= Duration::from_secs(30) {
            self.last_prune = Instant::now();
            let oldest = self.checked_until.iter().copied().min().unwrap_or(0);
            self.ledger.prune(oldest - 300_000);
        }
    }

    /// Lets `ms` pass, monitoring every 100 ms.
    pub async fn idle(&mut self, ms: u64) {
        let until = Instant::now() + Duration::from_millis(ms);
        loop {
            tokio::task::block_in_place(|| self.monitor());
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || super::run::interrupted() {
                return;
            }
            tokio::time::sleep(left.min(Duration::from_millis(100))).await;
        }
    }

    // ── steps ─────────────────────────────────────────────────────────────────────────────

    /// Applies one step; returns what was done.
    pub async fn apply(&mut self, step: &Step) -> String {
        match step {
            Step::Put { task, spec, .. } => self.put(*task, spec).await,
            Step::Delete { task } => self.delete(*task).await,
            Step::Recreate {
                task,
                pause_ms,
                spec,
            } => {
                let a = self.delete(*task).await;
                self.idle(*pause_ms).await;
                let b = self.put(*task, spec).await;
                format!("delete: {a}; put: {b}")
            }
            Step::LeaderKill { .. } => {
                let Some((i, what)) = self.leader_or_any().await else {
                    return "no replica to kill".into();
                };
                let d = self.ledger.begin(Disturb::Leader, now_ms());
                self.save_replica_log(i);
                if let Some(mut m) = self.replicas[i].m.take() {
                    m.proc.kill();
                }
                self.ledger.end(d, now_ms());
                format!("SIGKILL {} ({what})", self.replicas[i].node_id)
            }
            Step::LeaderTerm { .. } => {
                let Some((i, what)) = self.leader_or_any().await else {
                    return "no replica to stop".into();
                };
                let d = self.ledger.begin(Disturb::Leader, now_ms());
                self.save_replica_log(i);
                let node = self.replicas[i].node_id.clone();
                let mut m = self.replicas[i].m.take().expect("live replica");
                let st = tokio::task::block_in_place(|| {
                    m.proc
                        .signal_and_wait(libc::SIGTERM, Duration::from_secs(10))
                });
                self.ledger.end(d, now_ms());
                match st {
                    Some(st) if st.success() => format!("SIGTERM {node} ({what}): exit 0"),
                    other => {
                        self.violate(
                            "crash.manager_sigterm",
                            None,
                            format!(
                                "{node} after SIGTERM: {other:?}\n{}",
                                tail(&m.proc.log(), 30)
                            ),
                        );
                        m.proc.kill();
                        format!("SIGTERM {node} ({what}): {other:?}")
                    }
                }
            }
            Step::LeaderStop { pause_ms } => {
                let Some((i, what)) = self.leader_or_any().await else {
                    return "no replica to stop".into();
                };
                let d = self.ledger.begin(Disturb::Leader, now_ms());
                let pid = self.replicas[i].m.as_ref().map(|m| m.proc.pid());
                let node = self.replicas[i].node_id.clone();
                let Some(pid) = pid else {
                    return "replica vanished".into();
                };
                signal(pid, libc::SIGSTOP);
                self.replicas[i].stopped = true;
                self.idle(*pause_ms).await;
                signal(pid, libc::SIGCONT);
                self.replicas[i].stopped = false;
                self.ledger.end(d, now_ms());
                format!("SIGSTOP {node} ({what}) for {pause_ms} ms, SIGCONT")
            }
            Step::RestartReplicas => self.restart_replicas().await,
            Step::RedisRestart { down_ms } => {
                let d = self.ledger.begin(Disturb::Redis { lost: true }, now_ms());
                self.redis_up = false;
                self.redis.kill();
                self.conn = None;
                self.idle(*down_ms).await;
                tokio::task::block_in_place(|| self.redis.restart());
                self.redis_up = true;
                self.ledger.end(d, now_ms());
                format!("redis SIGKILLed, restarted after {down_ms} ms")
            }
            Step::RedisFlush => {
                let d = self.ledger.begin(Disturb::Redis { lost: true }, now_ms());
                let r = with_conn(&mut self.conn, &self.redis_url, |c| {
                    redis::cmd("FLUSHALL").query::<String>(c)
                });
                self.ledger.end(d, now_ms());
                format!("FLUSHALL: {r:?}")
            }
            Step::RedisSleep { ms } => {
                let d = self.ledger.begin(Disturb::Redis { lost: false }, now_ms());
                let url = self.redis_url.clone();
                let secs = *ms as f64 / 1_000.0;
                let sleeper = std::thread::spawn(move || {
                    let mut c = redis::Client::open(url.as_str())
                        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
                        .ok()?;
                    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
                    redis::cmd("DEBUG")
                        .arg("SLEEP")
                        .arg(secs)
                        .query::<String>(&mut c)
                        .ok()
                });
                self.idle(ms + 200).await;
                let r = tokio::task::block_in_place(|| sleeper.join().ok().flatten());
                self.ledger.end(d, now_ms());
                format!("DEBUG SLEEP {secs} s: {r:?}")
            }
            Step::EtcdRestart { down_ms } => {
                let d = self.ledger.begin(Disturb::Etcd, now_ms());
                self.etcd_up = false;
                self.etcd.kill();
                self.idle(*down_ms).await;
                tokio::task::block_in_place(|| self.etcd.restart());
                self.etcd_up = true;
                self.ledger.end(d, now_ms());
                format!("etcd SIGKILLed, restarted after {down_ms} ms")
            }
            Step::HostKill { host, down_ms } => {
                let d = self.ledger.begin(Disturb::Host(*host), now_ms());
                self.hosts[*host].down = true;
                if self.hosts[*host].agent.is_some() {
                    return self.kill_agent(*host, *down_ms, d).await;
                }
                let note = tokio::task::block_in_place(|| self.kill_host(*host));
                self.idle(*down_ms).await;
                self.hosts[*host].down = false;
                self.tend_runs();
                self.ledger.end(d, now_ms());
                format!("{note}; restarted after {down_ms} ms")
            }
            Step::ClockShift { offset_ms } => {
                let h = self.hosts.iter().rposition(|h| h.faketime).unwrap_or(0);
                let d = self.ledger.begin(Disturb::Clock, now_ms());
                self.hosts[h].down = true;
                let note = tokio::task::block_in_place(|| self.stop_host(h));
                let old = self.hosts[h].offset_ms;
                self.hosts[h].offset_ms = *offset_ms;
                self.hosts[h].down = false;
                self.tend_runs();
                self.ledger.end(d, now_ms());
                format!("{note}; h{h} clock {old:+} → {offset_ms:+} ms")
            }
            Step::Pause { ms } => {
                self.idle(*ms).await;
                "paused".into()
            }
            Step::Quiet => self.quiet().await,
            Step::EnvoyImport { limits } => self.envoy_import(limits).await,
            Step::EnvoyDelete => self.envoy_delete().await,
            Step::SecondCluster { run_ms } => self.second_cluster(*run_ms).await,
            Step::LockKill | Step::LockStop { .. } | Step::LockRedisRestart { .. } => {
                match &self.locks {
                    Some(l) => tokio::task::block_in_place(|| l.apply(step)),
                    None => "no lock track".into(),
                }
            }
        }
    }

    async fn restart_replicas(&mut self) -> String {
        let mut started = Vec::new();
        for i in 0..self.replicas.len() {
            if self.replicas[i].m.is_none() {
                self.start_replica(i).await;
                started.push(self.replicas[i].node_id.clone());
            }
        }
        format!("restarted {started:?}")
    }

    // ── the quiet period ──────────────────────────────────────────────────────────────────

    /// Repairs everything, waits for the last disturbance and spec change to settle, observes
    /// every checkable task for 3 slices (at least 3 s), and checks liveness.
    pub async fn quiet(&mut self) -> String {
        let mut note = self.restart_replicas().await;
        for h in &mut self.hosts {
            h.down = false;
        }
        self.tend_runs();
        if !self.wait_leader(Duration::from_secs(20)).await {
            self.violate(
                "liveness.leader",
                None,
                "no replica leads 20 s into a quiet period with every replica up".into(),
            );
            return note;
        }
        let now = now_ms();
        let t = self.timing;
        let settled = self
            .ledger
            .disturbances
            .iter()
            .map(|d| {
                let end = d.to_ms.unwrap_or(now);
                end + match d.kind {
                    Disturb::Leader | Disturb::Etcd => t.leader_settle_ms + 1_000,
                    Disturb::Redis { .. } => t.redis_settle_ms + PROBE_INTERVAL_MS,
                    Disturb::Host(_) | Disturb::Clock => 2_500,
                }
            })
            .fold(now, i64::max);
        const LONGEST_QUIET_MS: i64 = 60_000;
        let mut windows = Vec::new();
        let mut skipped = Vec::new();
        for task in 0..self.ledger.api.len() {
            let Some(v) = self.ledger.newest(task).cloned() else {
                continue;
            };
            let Some(spec) = v.spec.filter(|_| v.confirmed) else {
                continue;
            };
            // Keyed and concurrency tasks have no task-wide quota but per-key and in-flight
            // liveness (modes.rs); local and shadow-local ones none.
            let per_mode = spec.modes.keyed.is_some() || spec.mode == "concurrency";
            if spec.class() == Class::Local && !per_mode {
                skipped.push(format!("{} local", task_name(task)));
                continue;
            }
            // A concurrency task's slice length means nothing to it: judged in seconds.
            let l = if spec.mode == "concurrency" {
                1_000
            } else {
                spec.slice_ms as i64
            };
            // A concurrency task's hosts converge on the cap at their renewals (a quarter
            // lease each): two leases after everything settled.
            let lease = 2 * spec.modes.lease_ms.unwrap_or(0) as i64;
            let ready = settled.max(applied_by(&self.ledger, v.at_ms, &t)) + (3 * l).max(lease);
            let w1 = ready + (3 * l).max(3_000);
            if w1 - now > LONGEST_QUIET_MS {
                skipped.push(format!("{} ({l} ms slices: too long)", task_name(task)));
                continue;
            }
            windows.push((task, ready, w1, spec));
        }
        // Each task is checked as soon as its own window is complete (its slice keys expire
        // `--retention`, 60 s, after they end: a short task must not wait for a long one).
        windows.sort_by_key(|w| w.2);
        let mut checked = Vec::new();
        for (task, w0, w1, spec) in windows {
            let wait = w1 + t.data_lag_ms + self.ledger.max_offset_ms + 1_500 - now_ms();
            self.idle(wait.max(0) as u64).await;
            let l = if spec.mode == "concurrency" {
                1_000
            } else {
                spec.slice_ms as i64
            };
            // The hosts follow the spec's grid (the meta says so), else the spec never arrived.
            let grid_ok = self.ledger.meta[task]
                .iter()
                .rev()
                .find_map(|r| match r.state {
                    MetaState::Live { slice_ms, class } => {
                        Some(slice_ms == spec.slice_ms && class == spec.class())
                    }
                    _ => None,
                });
            if grid_ok != Some(true) {
                self.violate(
                    "liveness.meta",
                    Some(task_name(task)),
                    format!(
                        "the task meta in Redis does not follow the newest spec ({}) at the end of a quiet period: {:?}",
                        spec.describe(),
                        self.ledger.meta[task].last()
                    ),
                );
                continue;
            }
            let eligible: Vec<bool> = self
                .hosts
                .iter()
                .map(|h| !h.faketime || (h.offset_ms >= -l / 10 && h.offset_ms <= l / 2))
                .collect();
            // Every host is checked for zero admissions while none leads by more than half a
            // slice; then with what the leading host can take over its lead (its rate × its
            // lead): the check skips a window where that reaches the lowest cap read
            // (seed 31337000: 300 ms ahead at 150/s drained an exact_fixed slice of cap 44).
            let rate = self.shape.host_rate.get(task).copied().unwrap_or(0);
            let per_host = self.hosts.iter().all(|h| h.offset_ms <= l / 2).then(|| {
                self.hosts
                    .iter()
                    .filter(|h| h.offset_ms > 0)
                    .map(|h| rate * h.offset_ms as u64 / 1_000)
                    .max()
                    .unwrap_or(0)
            });
            if spec.modes.keyed.is_some() || spec.mode == "concurrency" {
                let v = if spec.mode == "concurrency" {
                    modes::check_permit_liveness(
                        &self.ledger,
                        &self.modes.intervals[task],
                        &self.modes.waits[task],
                        &self.modes.run_marks[task],
                        &spec,
                        task,
                        w0,
                        w1,
                        &eligible,
                        &mut self.modes.cov,
                    )
                } else {
                    modes::check_key_liveness(
                        &self.ledger,
                        &self.modes.keys[task],
                        &spec,
                        task,
                        w0,
                        w1,
                        &eligible,
                        &mut self.modes.cov,
                    )
                };
                self.liveness_checks += 1;
                checked.push(format!(
                    "{} ({} s, {})",
                    task_name(task),
                    (w1 - w0) / 1_000,
                    if spec.mode == "concurrency" {
                        "permits"
                    } else {
                        "keys"
                    }
                ));
                self.violations.extend(v);
                continue;
            }
            let mut reader = RedisSlices {
                conn: &mut self.conn,
                url: &self.redis_url,
                keys: &self.keys,
            };
            let v = check::check_liveness(
                &self.ledger,
                task,
                w0,
                w1,
                &eligible,
                per_host,
                &mut reader,
                &mut self.coverage,
            );
            self.liveness_checks += 1;
            checked.push(format!("{} ({} s)", task_name(task), (w1 - w0) / 1_000));
            self.violations.extend(v);
        }
        note += &format!("; liveness checked: {checked:?}");
        if !skipped.is_empty() {
            note += &format!(", skipped: {skipped:?}");
        }
        note
    }

    // ── the end ───────────────────────────────────────────────────────────────────────────

    /// Stops everything: loadgens (SIGTERM: exit 0 with a report), the last safety checks,
    /// replicas (SIGTERM: exit 0), servers; then nothing carrying the namespace may run and no
    /// segment of it may be left. Returns every violation seen, and the statistics.
    pub async fn shutdown(mut self) -> (Vec<Violation>, Stats) {
        if let Some(l) = self.locks.take() {
            let (v, note) = tokio::task::block_in_place(|| l.shutdown());
            self.say(&note);
            self.violations.extend(v);
        }
        for h in 0..self.hosts.len() {
            self.hosts[h].down = true;
            tokio::task::block_in_place(|| self.stop_host(h));
        }
        self.idle(0).await;
        tokio::task::block_in_place(|| self.check_safety(true));
        tokio::task::block_in_place(|| self.envoy_shutdown());
        tokio::task::block_in_place(|| self.stop_agents());
        let v = self.modes.check(&self.ledger, &self.timing, now_ms(), true);
        self.violations.extend(v);
        let line = self.modes.summary();
        self.say(&line);
        for i in 0..self.replicas.len() {
            self.save_replica_log(i);
            if let Some(mut m) = self.replicas[i].m.take() {
                let node = self.replicas[i].node_id.clone();
                if self.replicas[i].stopped {
                    signal(m.proc.pid(), libc::SIGCONT);
                }
                let st = tokio::task::block_in_place(|| {
                    m.proc
                        .signal_and_wait(libc::SIGTERM, Duration::from_secs(10))
                });
                if !st.is_some_and(|s| s.success()) {
                    self.violate(
                        "crash.manager_sigterm",
                        None,
                        format!("{node} after SIGTERM at the end: {st:?}"),
                    );
                    m.proc.kill();
                }
            }
        }
        // Panics in any replica's log, of every generation.
        if let Ok(dir) = std::fs::read_dir(&self.logs) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.starts_with("manager-")
                    && let Ok(text) = std::fs::read_to_string(e.path())
                    && let Some(line) = text.lines().find(|l| l.contains("panicked"))
                {
                    self.violate("crash.manager_panic", None, format!("{name}: {line}"));
                }
            }
        }
        let _ = std::fs::write(self.logs.join("redis.log"), self.redis.log());
        let _ = std::fs::write(self.logs.join("etcd.log"), self.etcd.log());
        self.redis.kill();
        self.etcd.kill();
        // Nothing that carries the namespace may be left running.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut left = pids_with_cmdline(&self.ns);
        while !left.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            left = pids_with_cmdline(&self.ns);
        }
        if !left.is_empty() {
            let cmds: Vec<String> = left
                .iter()
                .map(|p| {
                    std::fs::read(format!("/proc/{p}/cmdline"))
                        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                        .unwrap_or_default()
                })
                .collect();
            self.violate("leak.process", None, format!("still running: {cmds:?}"));
        }
        // The segments are the hosts' (kept across restarts on purpose): remove them, then
        // nothing else of the namespace may be in /dev/shm.
        for h in &self.hosts {
            remove_segment(&self.ns, &h.id);
        }
        let prefix = format!("sluice.{}.", self.ns);
        let leaked: Vec<String> = std::fs::read_dir("/dev/shm")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(&prefix))
            .collect();
        if !leaked.is_empty() {
            for n in &leaked {
                let _ = std::fs::remove_file(Path::new("/dev/shm").join(n));
            }
            self.violate(
                "leak.segment",
                None,
                format!("left in /dev/shm: {leaked:?}"),
            );
        }
        // A run whose liveness was mostly not judged (the machine stalled around it) proves
        // little: more than half of at least 6 liveness slices is a finding (the review of
        // issue 23, F4: on a quiet machine stalls are rare; a system that spins the cores
        // must not excuse itself).
        let (live, unjudged) = (self.coverage.live_slices, self.coverage.stalled_slices);
        if live >= 6 && unjudged * 2 > live {
            self.violate(
                "liveness.unjudged",
                None,
                format!(
                    "{unjudged} of {live} liveness slices not judged: the machine stalled around them (load from elsewhere, or the system under test spinning)"
                ),
            );
        }
        let v = std::mem::take(&mut self.violations);
        (
            v,
            Stats {
                coverage: self.coverage,
                fence_observations: self.fence_observations,
                liveness_checks: self.liveness_checks,
                logs: self.logs.clone(),
            },
        )
    }
}

/// A world's statistics, returned by [`World::shutdown`].
#[derive(Debug, Clone)]
pub struct Stats {
    /// What the checks covered.
    pub coverage: Coverage,
    /// Fencing observations.
    pub fence_observations: u64,
    /// Liveness checks.
    pub liveness_checks: u64,
    /// The logs directory.
    pub logs: PathBuf,
}
