//! Load generator: P processes of one simulated host hammering one Sluice task.
//!
//! ```text
//! cargo run --release -p sluice-sdk --example loadgen -- --redis URL --namespace NS --task T \
//!     --host-id H --procs P --duration-ms D [--rate R] [--bucket-ms B] [--backend-capacity C] \
//!     [--progress FILE]
//! ```
//!
//! The parent re-executes itself P times (`--child i`); the children share one host segment
//! (`/dev/shm/sluice.NS.H`), start together, decide one permit at a time in a loop for D ms
//! (`--rate` per process per second, 0 = as fast as possible) and report to the parent, which
//! prints ONE JSON line on stdout:
//!
//! ```json
//! {"task":"T","host_id":"H","procs":4,"duration_ms":5000,"admitted":0,"rejected":0,
//!  "fallback_admitted":0,"decisions_per_sec":0.0,"redis_calls":0,
//!  "buckets":{"<bucket_start_ms>":[admitted,rejected]},
//!  "fallback_buckets":{"<bucket_start_ms>":fallback_admitted}}
//! ```
//!
//! `admitted` counts every admitted decision, `fallback_admitted` the part of it admitted by
//! the FAILED fallback (or for an unknown task); `rejected` every rejection. Each decision is
//! bucketed by the time it was decided at (the SDK's slice clock; for exact tasks the time the
//! call started, which picks the slice), so with `--bucket-ms` equal to the slice length a
//! bucket is exactly a slice. `fallback_buckets` (additive to the pinned output) holds the
//! fallback-admitted count of every bucket that has any, so safety can be checked on the
//! globally decided admissions alone (`buckets[b][0] − fallback_buckets[b]`).
//! `shadow_admitted` (additive) is the part of `admitted` that shadow mode admitted
//! (`Decision::ShadowLimited`: enforced, it would have been rejected).
//!
//! # Which SDK call decides
//!
//! Every mode is decided through the call its users make: pooled and local tasks with
//! `try_acquire_stamped` (= `try_acquire`, the synchronous path with its fast clock, plus the
//! time the decision was charged at, which picks its bucket), `exact_fixed` / `exact_sliding` tasks with
//! `acquire_blocking` (one Redis round trip per decision). The mode is read from the task's
//! meta in the host segment (`Task::meta`, a few atomic loads) before every decision, so a mode
//! changed at run time is followed at once. An `exact_fixed` decision that would start less
//! than 1 ms before a slice boundary waits for the boundary, so the slice it is bucketed in is
//! the one the SDK charged (the SDK reads the clock again when the call starts).
//!
//! # Backend capacity
//!
//! `--backend-capacity C` simulates a backend that serves C requests per second for the whole
//! host and fails the rest; outcomes and latencies are reported to the SDK's health API. The
//! count is shared by every loadgen process of the host id (also of other loadgen runs with the
//! same `--host-id` at the same time) through one atomic word `second:32 | count:32` in the file
//! `<segment>.<task>.backend` next to the host segment (one backend per task): created by the
//! first parent, mapped by every child, removed by the last parent to finish (each parent holds a shared `flock` on it while it
//! runs; the one that can upgrade to exclusive at the end is the last).
//!
//! # Signals
//!
//! SIGTERM or SIGINT to the parent is forwarded to the children; they stop their loop at once
//! and report what they did, and the parent still prints its JSON line (exit 0). The children
//! die with the parent (`PR_SET_PDEATHSIG`, SIGKILL): a SIGKILLed parent leaves no process.
//!
//! # Progress
//!
//! `--progress FILE` (extra): every child appends one JSON line per closed bucket, with one
//! `write` on an `O_APPEND` descriptor (so lines of several processes never interleave):
//! `{"host":"H","child":0,"task":"T","bucket":1796023086000,"adm":10,"rej":3,"fb":0}`
//! (`adm` includes `fb`, the fallback-admitted part). A long-running observer (the soak) checks
//! invariants from it while the run goes on, and keeps the data of a host it SIGKILLs. A bucket
//! is closed when a decision falls into a later one, and at the end of the run. With `--rate`,
//! `"late": ms` (additive) says the loop's sleep overslept that long in the bucket (the OS
//! woke the thread late: the machine was busy; time spent deciding does not count; written
//! when 15 ms or more): the soak does not judge liveness there.
//!
//! Additive fields (issue 23): `"sh"`, the shadow-admitted part of `adm` (shadow mode,
//! `Decision::ShadowLimited`). Keyed and concurrency tasks (whose loops run concurrently) write
//! their lines as the buckets close too — every 100 ms, each bucket that ended 200 ms before —
//! and a decision recorded after its bucket was written (a loop resumed late) is written in
//! another line for the same bucket: **lines of one bucket add up**. Keyed tasks also write one
//! line per reported key (`--key-report`) and bucket:
//! `{"host":"H","child":0,"task":"T","bucket":1796023086000,"key":"key-3","adm":4,"rej":1,"fb":0}`
//! (a line with `"key"` is a part of the task's line of that bucket, not an addition to it).
//!
//! # Concurrency tasks
//!
//! For a task in mode `concurrency` every process runs `--workers W` (extra; default 16)
//! concurrent loops on one Tokio runtime, each taking a permit with `Task::permit_timeout`
//! (waits at most 100 ms; a timeout counts as rejected), holding it `--hold-ms H` ms and
//! dropping it. `--intervals FILE` appends one line `start_us end_us` (Unix µs on the host
//! clock, read right after the permit was had and right before it is dropped, so the interval
//! lies inside the time the permit was held) per released permit, one `write` per line on an
//! `O_APPEND` descriptor; a permit handed out by the FAILED fallback (`Permit::is_fallback`)
//! has a third word, `start_us end_us f` (additive). Buckets count permits by their start;
//! `fallback_admitted` counts permits handed out while FAILED. A loop whose task is not (or no
//! longer) in mode `concurrency` (`PermitError::NotConcurrency`) counts nothing and asks again
//! 10 ms later. `--rate` does not apply (the workers are the demand).
//!
//! # Several limits
//!
//! `--all-with T2` (extra): every decision asks this task and `T2` for one permit each with
//! `sluice::acquire_all` (all or nothing; the async call on a current-thread runtime) while
//! both are plain pooled tasks (paced and shadow included, not keyed), and this task alone
//! (as the plain loop decides it) otherwise. One decision in eight is cancelled if it still
//! waits after 1 ms (a timeout drops the future: what its parts took is given back). Each part
//! is counted under its own task, in the bucket of the time it was charged at
//! (`sluice::acquire_all_traced`); a refusal under the task that refused (the parts before it
//! were given back and are counted nowhere); a cancelled decision nowhere. Progress lines of
//! `T2` carry `"task":"T2"`; lines are written as buckets close, 200 ms after their end (lines
//! of one bucket add up); this task's lines carry `"gb"`, the permits its part took and gave
//! back (a later part refused, or the decision was cancelled). The JSON line's own counts are
//! this task's; `all_with` (additive)
//! holds `T2`'s: `{"task","admitted","rejected","buckets","fallback_buckets","cancelled","alone",
//! "kept","inconsistent"}` (`kept`: parts admitted that a refusal or cancellation could not give
//! back — a FAILED fallback admission, an exact part — counted as admitted under their task;
//! `inconsistent`: answers contradicting all-or-nothing, 0; each one is also written to the
//! progress file at once as `{"host","child","task","inconsistent":"<what>"}` and counted
//! nowhere else). `--backend-capacity` applies to
//! the decisions admitted (reported for this task).
//!
//! # Latency
//!
//! `--latency-every N` (extra) times every N-th decision of the synchronous loop (two
//! `Instant::now()` around it, so N = 64 adds well under a nanosecond per decision on average);
//! keyed tasks time every decision. The parent's JSON then carries `lat_hist`
//! (`floor(log2(ns) · 16)` → decisions: the histogram format of the side-by-side benchmark's
//! peers, scripts/bench/peers/README.md) and `lat_clock_ns`, the median cost of the timing
//! itself, measured at start and already subtracted from every sample.
//!
//! # Keyed tasks
//!
//! `--keys K` (📌) spreads the decisions over the keys `key-0 … key-{K-1}` of a keyed task:
//! uniformly, or with `--key-skew S` (📌) by a Zipf law of exponent S (key-0 the hottest).
//! Every process runs `--workers W` (default 16) concurrent loops on one Tokio runtime,
//! each deciding with `Key::acquire` (which waits for a pull of a key with no quota in hand,
//! as an async service would); `--rate` is per process, shared by its loops. Decisions are
//! bucketed by the time the SDK decided them (the slice it charged). `--key-report R` (📌,
//! default 100) adds `"keys": {"key-i": {"<bucket_start_ms>": [admitted, rejected]}}` for
//! every i < R to the JSON line, and `"key_latency_us"` (extra): p50/p99 of the decision
//! time of calls that had to wait for Redis (`cold`) and of those that did not (`hot`).
//!
//! Other extra flags (not part of the pinned interface): `--key-slots N` (key table entries),
//! `--caller-pulls true` (keyed pulls from the decision loops' runtime, `Config::caller_pulls`),
//! `--probe-interval-ms`,
//! `--pull-timeout-ms`, `--clock host|redis`, and the Redis TLS / ACL flags of the manager:
//! `--redis-ca`, `--redis-cert`, `--redis-key`, `--redis-insecure`, `--redis-user`,
//! `--redis-password-file` (with a `rediss://` URL). The parent checks the link once before it
//! starts the children: a TLS or login failure exits 1 naming the endpoint; a Redis that is
//! down is only logged (the SDK rides it out). Logs go to stderr (`RUST_LOG`, default
//! `sluice=info`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use memmap2::MmapMut;
use serde::{Deserialize, Serialize};
use sluice::{Client, ClockSource, Config, Decision, Outcome, Task};
use sluice_protocol::Mode;

#[derive(Debug, Clone, Parser)]
#[command(about = "Sluice load generator: P processes sharing one host segment")]
struct Args {
    /// Redis URL (or comma-separated cluster seeds).
    #[arg(long)]
    redis: String,
    /// Namespace.
    #[arg(long, default_value = "sluice")]
    namespace: String,
    /// Task name.
    #[arg(long)]
    task: String,
    /// Spread decisions round-robin over N tasks named `<task>0` … `<task>{N-1}` instead of
    /// `--task` itself (pooled and exact modes; extra: the manager benchmark's tasks with
    /// traffic). Counts are of all of them together. 0 = the task itself; at most 4,095.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=4095))]
    spread_tasks: u32,
    /// Simulated host id (one segment per host id).
    #[arg(long)]
    host_id: String,
    /// Processes.
    #[arg(long, default_value_t = 1)]
    procs: u32,
    /// How long to run, ms.
    #[arg(long)]
    duration_ms: u64,
    /// Decisions per second per process (0 = as fast as possible).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Bucket width of the per-time counts, ms.
    #[arg(long, default_value_t = 1000)]
    bucket_ms: i64,
    /// Simulated backend capacity per second for the whole host (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    backend_capacity: u64,
    /// Append one JSON line per closed bucket to this file (extra).
    #[arg(long)]
    progress: Option<PathBuf>,
    /// Probe interval while FAILED, ms (extra).
    #[arg(long)]
    probe_interval_ms: Option<u64>,
    /// Pull timeout, ms (extra).
    #[arg(long)]
    pull_timeout_ms: Option<u64>,
    /// Slice clock: host or redis (extra).
    #[arg(long, default_value = "host")]
    clock: String,
    /// CA bundle (PEM) trusted for rediss:// (extra).
    #[arg(long)]
    redis_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS (extra).
    #[arg(long)]
    redis_cert: Option<PathBuf>,
    /// Private key (PEM) of --redis-cert (extra).
    #[arg(long)]
    redis_key: Option<PathBuf>,
    /// Skip verifying the server's certificate (extra; tests only).
    #[arg(long)]
    redis_insecure: bool,
    /// Redis ACL user (extra).
    #[arg(long)]
    redis_user: Option<String>,
    /// File holding the Redis password (extra).
    #[arg(long)]
    redis_password_file: Option<PathBuf>,
    /// Concurrency tasks: how long each admitted permit is held, ms.
    #[arg(long, default_value_t = 0)]
    hold_ms: u64,
    /// Concurrency tasks: append `start_us end_us` per released permit to this file.
    #[arg(long)]
    intervals: Option<PathBuf>,
    /// Concurrency tasks: concurrent permit loops per process (extra).
    #[arg(long, default_value_t = 16)]
    workers: u32,
    /// Keyed tasks: spread decisions over keys key-0 … key-{K-1} (0 = the task itself).
    #[arg(long, default_value_t = 0)]
    keys: u64,
    /// Keyed tasks: Zipf exponent of the key choice (0 = uniform).
    #[arg(long, default_value_t = 0.0)]
    key_skew: f64,
    /// Keyed tasks: report per-bucket counts of keys key-0 … key-{R-1}.
    #[arg(long, default_value_t = 100)]
    key_report: u64,
    /// Keyed tasks: entries of the host's key table (extra; SDK default when absent).
    #[arg(long)]
    key_slots: Option<u32>,
    /// Keyed tasks: `Key::acquire` pulls from the decision loop's own runtime (extra;
    /// `Config::caller_pulls`, off by default as in the SDK).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    caller_pulls: bool,
    /// Time every N-th decision into `lat_hist` (extra; 0 = none; keyed tasks time every one).
    #[arg(long, default_value_t = 0)]
    latency_every: u64,
    /// Decide every permit of this task together with one of task T2, all or nothing
    /// (`sluice::acquire_all`; extra; see the module doc, "Several limits").
    #[arg(long, value_name = "T2")]
    all_with: Option<String>,
    /// Internal: run as child number i.
    #[arg(long, hide = true)]
    child: Option<u32>,
    /// Common start time of every process (Unix ms; extra). Default: 1 s (+ 50 ms per
    /// process) after the parent starts. Several loadgen runs given the same value start
    /// together (the side-by-side benchmark does so for its simulated hosts).
    #[arg(long)]
    start_at_ms: Option<i64>,
    /// Internal: the parent's pid (a child exits when its parent is gone).
    #[arg(long, hide = true)]
    parent_pid: Option<u32>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Report {
    task: String,
    host_id: String,
    procs: u32,
    duration_ms: u64,
    admitted: u64,
    rejected: u64,
    fallback_admitted: u64,
    decisions_per_sec: f64,
    redis_calls: u64,
    buckets: BTreeMap<String, [u64; 2]>,
    fallback_buckets: BTreeMap<String, u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    keys: BTreeMap<String, BTreeMap<String, [u64; 2]>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key_latency_us: Option<KeyLatency>,
    /// Shadow mode (additive): the part of `admitted` that was `Decision::ShadowLimited`
    /// (rejected, had the limit been enforced).
    #[serde(default)]
    shadow_admitted: u64,
    /// Keyed tasks with `--caller-pulls true` (extra): KPULL calls sent from the decision loops'
    /// runtime (`Client::caller_pulls_sent`; part of `redis_calls`).
    #[serde(default)]
    caller_pulls: u64,
    /// Decision latency (additive, with `--latency-every`, and always for keyed tasks):
    /// `floor(log2(ns) · 16)` → decisions, the format of the benchmark's peers
    /// (scripts/bench/peers/README.md). The time of the timing itself is subtracted
    /// (`lat_clock_ns`, the median of back-to-back clock reads measured at start).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    lat_hist: BTreeMap<String, u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lat_clock_ns: Option<u64>,
    /// `--all-with` (additive): the second task's counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    all_with: Option<AllWith>,
}

/// `--all-with T2`: what the all-or-nothing decisions did to the second task, and how many
/// were cancelled or decided alone.
#[derive(Debug, Default, Serialize, Deserialize)]
struct AllWith {
    task: String,
    /// Decisions admitted (every one of them also admitted the first task).
    admitted: u64,
    /// Decisions the second task refused (the first task's part was given back).
    rejected: u64,
    /// Its counts per bucket, `[admitted, rejected]`, as `buckets`.
    buckets: BTreeMap<String, [u64; 2]>,
    /// Decisions cancelled mid-wait (dropped by a timeout: neither admitted nor rejected).
    cancelled: u64,
    /// Decisions of the first task alone, made while one of the two was not a plain pooled task.
    alone: u64,
    /// Parts admitted that a refusal or cancellation could not give back (counted admitted).
    kept: u64,
    /// Answers that contradict all-or-nothing (admitted with a part refused, or refused with
    /// an earlier part refused): must be 0.
    inconsistent: u64,
    /// The second task's fallback-admitted count per bucket (part of `buckets[b][0]`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    fallback_buckets: BTreeMap<String, u64>,
}

/// Adds per-bucket `[admitted, rejected]` counts into `into`.
fn add_pairs(into: &mut BTreeMap<String, [u64; 2]>, from: BTreeMap<String, [u64; 2]>) {
    for (k, v) in from {
        let e = into.entry(k).or_insert([0, 0]);
        e[0] += v[0];
        e[1] += v[1];
    }
}

/// Adds per-bucket counts into `into`.
fn add_counts(into: &mut BTreeMap<String, u64>, from: BTreeMap<String, u64>) {
    for (k, n) in from {
        *into.entry(k).or_insert(0) += n;
    }
}

/// The latency histogram of `lat_hist`: fixed log buckets (16 per power of two).
struct LatHist {
    counts: Vec<u64>,
    clock_ns: u64,
}

impl LatHist {
    fn new() -> Self {
        // What timing a decision costs by itself: two back-to-back `Instant::now()`.
        let mut v: Vec<u64> = (0..1_001)
            .map(|_| {
                let t = Instant::now();
                t.elapsed().as_nanos() as u64
            })
            .collect();
        v.sort_unstable();
        Self {
            counts: vec![0; 64 * 16],
            clock_ns: v[v.len() / 2],
        }
    }

    #[inline]
    fn record(&mut self, elapsed: Duration) {
        let ns = (elapsed.as_nanos() as u64)
            .saturating_sub(self.clock_ns)
            .max(1);
        let i = ((ns as f64).log2() * 16.0) as usize;
        self.counts[i.min(64 * 16 - 1)] += 1;
    }

    fn into_map(self, into: &mut BTreeMap<String, u64>) {
        for (i, n) in self.counts.into_iter().enumerate() {
            if n > 0 {
                *into.entry(i.to_string()).or_insert(0) += n;
            }
        }
    }
}

/// Decision latency of keyed decisions (µs): calls that waited for Redis and those that did not.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct KeyLatency {
    cold_n: u64,
    cold_p50: f64,
    cold_p99: f64,
    hot_n: u64,
    hot_p50: f64,
    hot_p99: f64,
    /// Raw samples (children → parent only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    cold_samples: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    hot_samples: Vec<u32>,
}

fn percentile(v: &mut [u32], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)] as f64
}

impl Report {
    fn new(args: &Args, procs: u32) -> Self {
        Self {
            task: args.task.clone(),
            host_id: args.host_id.clone(),
            procs,
            duration_ms: args.duration_ms,
            ..Self::default()
        }
    }

    /// Adds one bucket's counts: `[admitted, rejected, fallback_admitted]`.
    fn add_bucket(&mut self, start: i64, v: [u64; 3]) {
        let key = start.to_string();
        let e = self.buckets.entry(key.clone()).or_insert([0, 0]);
        e[0] += v[0];
        e[1] += v[1];
        if v[2] > 0 {
            *self.fallback_buckets.entry(key).or_insert(0) += v[2];
        }
    }

    /// Adds a child's report into this (the parent's) total.
    fn merge(&mut self, r: Report) {
        self.admitted += r.admitted;
        self.rejected += r.rejected;
        self.fallback_admitted += r.fallback_admitted;
        self.shadow_admitted += r.shadow_admitted;
        self.caller_pulls += r.caller_pulls;
        self.redis_calls += r.redis_calls;
        for (k, n) in r.lat_hist {
            *self.lat_hist.entry(k).or_insert(0) += n;
        }
        if r.lat_clock_ns.is_some() {
            self.lat_clock_ns = r.lat_clock_ns;
        }
        add_pairs(&mut self.buckets, r.buckets);
        add_counts(&mut self.fallback_buckets, r.fallback_buckets);
        for (k, b) in r.keys {
            add_pairs(self.keys.entry(k).or_default(), b);
        }
        if let Some(a) = r.all_with {
            let t = self.all_with.get_or_insert_with(|| AllWith {
                task: a.task.clone(),
                ..AllWith::default()
            });
            t.admitted += a.admitted;
            t.rejected += a.rejected;
            t.cancelled += a.cancelled;
            t.alone += a.alone;
            t.kept += a.kept;
            t.inconsistent += a.inconsistent;
            add_counts(&mut t.fallback_buckets, a.fallback_buckets);
            add_pairs(&mut t.buckets, a.buckets);
        }
        if let Some(l) = r.key_latency_us {
            let t = self.key_latency_us.get_or_insert_with(KeyLatency::default);
            t.cold_samples.extend(l.cold_samples);
            t.hot_samples.extend(l.hot_samples);
        }
    }

    /// Turns merged latency samples into percentiles.
    fn finish_latency(&mut self) {
        if let Some(l) = &mut self.key_latency_us {
            l.cold_n = l.cold_samples.len() as u64;
            l.hot_n = l.hot_samples.len() as u64;
            l.cold_p50 = percentile(&mut l.cold_samples, 0.5);
            l.cold_p99 = percentile(&mut l.cold_samples, 0.99);
            l.hot_p50 = percentile(&mut l.hot_samples, 0.5);
            l.hot_p99 = percentile(&mut l.hot_samples, 0.99);
            l.cold_samples.clear();
            l.hot_samples.clear();
        }
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "sluice=info".into()),
        )
        .init();
    let args = Args::parse();
    let result = match args.child {
        Some(i) => child(&args, i),
        None => parent(&args),
    };
    if let Err(e) = result {
        eprintln!("loadgen: {e}");
        std::process::exit(1);
    }
}

fn now_ms() -> i64 {
    sluice::clock::host_ms()
}

/// SIGTERM / SIGINT handling: the handler only sets a flag that the loops poll.
mod signals {
    use super::{AtomicBool, Ordering};

    static STOP: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_signal(_: libc::c_int) {
        STOP.store(true, Ordering::SeqCst);
    }

    /// Installs the handler for SIGTERM and SIGINT.
    pub fn install() {
        for sig in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: the handler only stores to an atomic, which is async-signal-safe; the
            // sigaction struct is fully initialised (zeroed, then the fields we use).
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    }

    /// True once SIGTERM or SIGINT arrived.
    pub fn stop_requested() -> bool {
        STOP.load(Ordering::SeqCst)
    }
}

/// Sleeps up to `d` in steps of at most 20 ms; false if a stop was requested meanwhile.
fn sleep_unless_stopped(d: Duration) -> bool {
    let until = Instant::now() + d;
    loop {
        if signals::stop_requested() {
            return false;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

/// The simulated backend of one host: requests served per second, counted in one atomic word
/// `second:32 | count:32` in a file next to the host segment, shared by every process of the
/// host (see the module doc).
struct Backend {
    map: MmapMut,
    capacity: u64,
}

impl Backend {
    /// `<segment>.<task>.backend`, next to the host segment in the SDK's default directory
    /// (one backend per task: each task protects its own service).
    fn path(args: &Args) -> PathBuf {
        let seg = sluice::shm::Segment::path_for(
            &Config::new(args.redis.clone()).shm_dir,
            &args.namespace,
            &args.host_id,
        );
        let mut p = seg.into_os_string();
        p.push(format!(".{}.backend", args.task));
        PathBuf::from(p)
    }

    /// Opens (creating if needed) the counter file, at least one word long.
    fn open_file(path: &Path) -> Result<File, String> {
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| format!("backend counter {}: {e}", path.display()))?;
        if file.metadata().map(|m| m.len()).unwrap_or(0) < 8 {
            file.set_len(8)
                .map_err(|e| format!("backend counter: {e}"))?;
        }
        Ok(file)
    }

    /// Maps the counter word of the file at `path`.
    fn open(path: &Path, capacity: u64) -> Result<Self, String> {
        let file = Self::open_file(path)?;
        // SAFETY: the file is at least 8 bytes and only ever accessed through the atomic word;
        // the mapping outlives the descriptor.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| format!("mmap: {e}"))?;
        Ok(Self { map, capacity })
    }

    fn word(&self) -> &AtomicU64 {
        // SAFETY: the mapping is page-aligned, at least 8 bytes, and lives as long as `self`.
        unsafe { &*(self.map.as_ptr() as *const AtomicU64) }
    }

    /// Counts one request at `now_ms`; true when it is within the host's capacity.
    fn serve(&self, now_ms: i64) -> bool {
        let second = now_ms.div_euclid(1_000) as u32;
        let w = self.word();
        let mut cur = w.load(Ordering::Acquire);
        loop {
            let (s, c) = ((cur >> 32) as u32, cur as u32);
            let count = if s == second { c.saturating_add(1) } else { 1 };
            let next = (u64::from(second) << 32) | u64::from(count);
            match w.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return u64::from(count) <= self.capacity,
                Err(seen) => cur = seen,
            }
        }
    }
}

/// The parent's hold on the backend counter file: a shared `flock` for the run; at the end the
/// file is removed if no other parent holds it.
struct BackendFile {
    path: PathBuf,
    file: File,
}

impl BackendFile {
    fn acquire(path: PathBuf) -> Result<Self, String> {
        loop {
            let file = Backend::open_file(&path)?;
            flock(&file, libc::LOCK_SH)?;
            // Another parent may have removed the file between our open and our lock: then
            // we hold an orphan; start over on the path's current file.
            let same = std::fs::metadata(&path)
                .ok()
                .zip(file.metadata().ok())
                .is_some_and(|(a, b)| a.ino() == b.ino() && a.dev() == b.dev());
            if same {
                return Ok(Self { path, file });
            }
        }
    }
}

impl Drop for BackendFile {
    fn drop(&mut self) {
        if flock(&self.file, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn flock(file: &File, op: libc::c_int) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("flock: {e}"));
        }
    }
}

/// Reads the one JSON line a child prints.
fn read_report(out: Option<std::process::ChildStdout>) -> String {
    let mut line = String::new();
    if let Some(out) = out {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    line
}

impl Args {
    fn redis_security(&self) -> sluice_protocol::conn::RedisSecurity {
        sluice_protocol::conn::RedisSecurity {
            ca_file: self.redis_ca.clone(),
            cert_file: self.redis_cert.clone(),
            key_file: self.redis_key.clone(),
            insecure: self.redis_insecure,
            user: self.redis_user.clone(),
            password: None,
            password_file: self.redis_password_file.clone(),
        }
    }
}

/// Checks the Redis link once (see the module docs): settings, TLS handshake, login.
fn check_redis(args: &Args) -> Result<(), String> {
    use sluice_protocol::conn::{ConnOptions, Redis, RedisTarget};
    sluice_protocol::tls::install_provider();
    let target = RedisTarget::parse(&args.redis).map_err(|e| format!("--redis: {e}"))?;
    let redis = Redis::with_security(target, ConnOptions::default(), &args.redis_security())
        .map_err(|e| format!("--{}: {}", e.flag(), e.message))?;
    if args.redis_insecure {
        tracing::warn!("--redis-insecure: Redis TLS certificate verification is OFF (tests only)");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    match rt.block_on(redis.check()) {
        Ok(()) => Ok(()),
        Err(e) if e.is_config() => Err(e.to_string()),
        Err(e) => {
            tracing::warn!(error = %e, "Redis not reachable at start; running anyway");
            Ok(())
        }
    }
}

fn parent(args: &Args) -> Result<(), String> {
    if args.procs == 0 || args.procs > 256 {
        return Err("--procs must be 1..=256".into());
    }
    check_redis(args)?;
    if args.bucket_ms <= 0 {
        return Err("--bucket-ms must be positive".into());
    }
    signals::install();
    let backend = match args.backend_capacity {
        0 => None,
        _ => Some(BackendFile::acquire(Backend::path(args))?),
    };
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let start_at = args
        .start_at_ms
        .unwrap_or_else(|| now_ms() + 1_000 + 50 * args.procs as i64);
    // The children get the start time as their own flag (not twice).
    let mut raw: Vec<String> = Vec::new();
    let mut given = std::env::args().skip(1);
    while let Some(a) = given.next() {
        if a == "--start-at-ms" {
            given.next();
        } else if !a.starts_with("--start-at-ms=") {
            raw.push(a);
        }
    }
    let me = std::process::id().to_string();
    let mut children = Vec::new();
    for i in 0..args.procs {
        let spawned = Command::new(&exe)
            .args(&raw)
            .args(["--child", &i.to_string()])
            .args(["--start-at-ms", &start_at.to_string()])
            .args(["--parent-pid", &me])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn();
        match spawned {
            Ok(c) => children.push(c),
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start child {i}: {e}"));
            }
        }
    }
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let out = c.stdout.take();
            std::thread::spawn(move || read_report(out))
        })
        .collect();

    // Wait for every child; forward a stop request once; kill what outlives its deadline.
    let mut deadline =
        Instant::now() + Duration::from_millis(args.duration_ms) + Duration::from_secs(60);
    let mut forwarded = false;
    let mut running: Vec<Option<std::process::Child>> = children.into_iter().map(Some).collect();
    while running.iter().any(Option::is_some) {
        if signals::stop_requested() && !forwarded {
            forwarded = true;
            for c in running.iter().flatten() {
                // SAFETY: kill(2) on our own child's pid (not yet reaped, so not reused).
                unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            }
            deadline = deadline.min(Instant::now() + Duration::from_secs(5));
        }
        let late = Instant::now() > deadline;
        for slot in running.iter_mut() {
            let Some(c) = slot else { continue };
            if late {
                let _ = c.kill();
            }
            if !matches!(c.try_wait(), Ok(None)) {
                let _ = c.wait();
                *slot = None;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(backend);

    let mut total = Report::new(args, args.procs);
    let mut failures = Vec::new();
    for (i, reader) in readers.into_iter().enumerate() {
        let line = reader.join().unwrap_or_default();
        match serde_json::from_str::<Report>(line.trim()) {
            Ok(r) => total.merge(r),
            Err(e) => failures.push(format!("child {i}: {e} ({line:?})")),
        }
    }
    if !failures.is_empty() {
        return Err(failures.join("; "));
    }
    // Over the time the children ran: the whole duration, or less when stopped early.
    let ran_ms = (now_ms() - start_at).clamp(1, args.duration_ms.max(1) as i64);
    total.decisions_per_sec = (total.admitted + total.rejected) as f64 / (ran_ms as f64 / 1_000.0);
    total.finish_latency();
    let line = serde_json::to_string(&total).map_err(|e| e.to_string())?;
    // A closed stdout (the reader went away) is not worth a panic.
    let _ = writeln!(std::io::stdout(), "{line}");
    Ok(())
}

/// Makes this child die with its parent (SIGKILL when the parent thread exits), and exits at
/// once if the parent is already gone (it may have died before the prctl).
fn die_with_parent(parent: Option<u32>) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid have no memory-safety preconditions.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        if let Some(p) = parent
            && libc::getppid() as u32 != p
        {
            std::process::exit(1);
        }
    }
}

/// Appends closed buckets to the progress file, one `write` per line.
struct Progress {
    file: Option<File>,
    host: String,
    child: u32,
    task: String,
}

impl Progress {
    fn open(args: &Args, child: u32) -> Result<Self, String> {
        let file = match &args.progress {
            None => None,
            Some(p) => Some(
                File::options()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| format!("progress file {}: {e}", p.display()))?,
            ),
        };
        Ok(Self {
            file,
            host: args.host_id.clone(),
            child,
            task: args.task.clone(),
        })
    }

    /// One bucket's `[admitted, rejected, fallback-admitted, shadow-admitted]`.
    fn bucket(&mut self, start: i64, v: [u64; 4]) {
        self.bucket_late(start, v, 0);
    }

    /// [`Progress::bucket`] with how long (ms) the paced loop's sleeps overslept in the
    /// bucket, at most (written as `"late"` when 15 ms or more).
    fn bucket_late(&mut self, start: i64, v: [u64; 4], late_ms: u64) {
        let mut line = serde_json::json!({
            "host": self.host, "child": self.child, "task": self.task,
            "bucket": start, "adm": v[0], "rej": v[1], "fb": v[2], "sh": v[3],
        });
        if late_ms >= 15 {
            line["late"] = late_ms.into();
        }
        self.write(line);
    }

    /// [`Progress::bucket_late`] of an `--all-with` run's first task, with `"gb"`: the
    /// permits its admitted part took and gave back (a later part refused, or cancelled).
    fn bucket_given_back(&mut self, start: i64, v: [u64; 4], late_ms: u64, gb: u64) {
        let mut line = serde_json::json!({
            "host": self.host, "child": self.child, "task": self.task,
            "bucket": start, "adm": v[0], "rej": v[1], "fb": v[2], "sh": v[3], "gb": gb,
        });
        if late_ms >= 15 {
            line["late"] = late_ms.into();
        }
        self.write(line);
    }

    /// An `--all-with` answer that contradicts all-or-nothing (`"inconsistent"`: the soak's
    /// violation), written at once.
    fn inconsistent(&mut self, what: &str) {
        let line = serde_json::json!({
            "host": self.host, "child": self.child, "task": self.task,
            "inconsistent": what,
        });
        self.write(line);
    }

    /// [`Progress::bucket`] of another task (`--all-with`).
    fn bucket_of(&mut self, task: &str, start: i64, v: [u64; 4]) {
        let line = serde_json::json!({
            "host": self.host, "child": self.child, "task": task,
            "bucket": start, "adm": v[0], "rej": v[1], "fb": v[2], "sh": v[3],
        });
        self.write(line);
    }

    /// One reported key's `[admitted, rejected, fallback-admitted, shadow-admitted]` in one
    /// bucket.
    fn key_bucket(&mut self, key: usize, start: i64, v: [u64; 4]) {
        let line = serde_json::json!({
            "host": self.host, "child": self.child, "task": self.task,
            "bucket": start, "key": format!("key-{key}"), "adm": v[0], "rej": v[1], "fb": v[2],
            "sh": v[3],
        });
        self.write(line);
    }

    fn write(&mut self, line: serde_json::Value) {
        let Some(f) = self.file.as_mut() else { return };
        let line = line.to_string() + "\n";
        // O_APPEND: one write lands whole at the end, whatever the other children write.
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "cannot append to the progress file");
        }
    }
}

/// The counts of the concurrent loops of a keyed or concurrency child not yet written to the
/// progress file: `[admitted, rejected, fallback, shadow]` per bucket, and `[admitted,
/// rejected, fallback]` per reported key and bucket. Written as the buckets close (see the
/// module doc, Progress), so an observer sees them while the run goes on.
#[derive(Default)]
struct Live {
    buckets: BTreeMap<i64, [u64; 4]>,
    keys: BTreeMap<(usize, i64), [u64; 4]>,
}

impl Live {
    /// Writes and forgets the buckets that ended by `before` (every bucket with `None`).
    fn flush(&mut self, progress: &mut Progress, before: Option<i64>, bucket_ms: i64) {
        let done = |b: i64| before.is_none_or(|t| b + bucket_ms <= t);
        let (out, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.buckets)
            .into_iter()
            .partition(|(b, _)| done(*b));
        self.buckets = keep.into_iter().collect();
        for (b, v) in out {
            progress.bucket(b, v);
        }
        let (out, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.keys)
            .into_iter()
            .partition(|((_, b), _)| done(*b));
        self.keys = keep.into_iter().collect();
        for ((k, b), v) in out {
            progress.key_bucket(k, b, v);
        }
    }
}

/// Writes the closed buckets of `live` every 100 ms until the run's time is up.
async fn flush_live(
    live: &std::cell::RefCell<Live>,
    progress: &std::cell::RefCell<&mut Progress>,
    started: Instant,
    duration: Duration,
    bucket_ms: i64,
) {
    while started.elapsed() < duration && !signals::stop_requested() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A bucket is closed 200 ms after its end (a decision is recorded as it returns).
        live.borrow_mut()
            .flush(&mut progress.borrow_mut(), Some(now_ms() - 200), bucket_ms);
    }
}

/// `Some((slice_us, fixed))` when the task is exact (`exact_fixed`: fixed = true), from the
/// meta in the host segment (a few atomic loads, read before every decision so a mode changed
/// at run time is followed at once).
fn exact_mode(task: &Task) -> Option<(i64, bool)> {
    let m = task.meta()?;
    let slice_us = m.slice_ms as i64 * 1_000;
    match m.mode {
        Mode::ExactFixed => Some((slice_us, true)),
        Mode::ExactSliding => Some((slice_us, false)),
        _ => None,
    }
}

/// Decides one permit with the call a user of the task's mode makes; returns the decision and
/// the time it is bucketed at.
///
/// `acquire_blocking` reads the slice clock again when it starts: an `exact_fixed` decision
/// stamped less than 1 ms before a slice boundary is held until the boundary, so the slice it
/// is bucketed in is the slice TAKE charged (the two clock reads are microseconds apart).
fn decide(task: &Task) -> (Decision, i64) {
    match exact_mode(task) {
        // `try_acquire_stamped`: `try_acquire` (its fast clock included, as users call it),
        // with the time the decision was charged at.
        None => match task.try_acquire_stamped(1) {
            // The task became exact between the mode check and the decision.
            (Decision::WouldBlock, now_us) => (task.acquire_blocking(1), now_us),
            d => d,
        },
        Some((slice_us, fixed)) => {
            let now_us = task.now_us();
            let left = slice_us - now_us.rem_euclid(slice_us.max(1));
            let now_us = if fixed && left < 1_000 {
                std::thread::sleep(Duration::from_micros(left as u64));
                task.now_us()
            } else {
                now_us
            };
            (task.acquire_blocking(1), now_us)
        }
    }
}

fn child(args: &Args, index: u32) -> Result<(), String> {
    die_with_parent(args.parent_pid);
    signals::install();
    let mut cfg = Config::new(args.redis.clone());
    cfg.redis_security = args.redis_security();
    cfg.namespace = args.namespace.clone();
    cfg.host_id = args.host_id.clone();
    if let Some(ms) = args.probe_interval_ms {
        cfg.probe_interval = Duration::from_millis(ms);
    }
    if let Some(ms) = args.pull_timeout_ms {
        cfg.pull_timeout = Duration::from_millis(ms);
    }
    if let Some(n) = args.key_slots {
        cfg.key_slots = n;
    }
    if args.spread_tasks > 0 {
        // One slot of the host segment per task (and `--task` itself).
        cfg.max_tasks = cfg.max_tasks.max(args.spread_tasks.saturating_add(1));
    }
    cfg.caller_pulls = args.caller_pulls;
    cfg.clock = match args.clock.as_str() {
        "redis" => ClockSource::Redis,
        _ => ClockSource::Host,
    };
    let backend = match args.backend_capacity {
        0 => None,
        c => Some(Backend::open(&Backend::path(args), c)?),
    };
    let mut progress = Progress::open(args, index)?;
    let client = Client::new(cfg).map_err(|e| e.to_string())?;
    let calls = client.redis_calls_counter();
    let task = client.task(&args.task).map_err(|e| e.to_string())?;
    // `--spread-tasks N`: the tasks decided in turn (the first is `task`'s stand-in below).
    let spread: Vec<sluice::Task> = (0..args.spread_tasks)
        .map(|i| {
            let name = format!("{}{i}", args.task);
            client
                .task(&name)
                .map_err(|e| format!("--spread-tasks: task {name}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    // All opened first, so their metas are fetched together; one deadline for all of them.
    let ready_by = Instant::now() + Duration::from_secs(10);
    for t in &spread {
        while !t.wait_ready(Duration::from_millis(50))
            && Instant::now() < ready_by
            && !signals::stop_requested()
        {}
    }
    if spread.iter().any(|t| t.meta().is_none()) {
        tracing::warn!("--spread-tasks: some task metas not known after 10 s; starting anyway");
    }
    let ready_by = Instant::now() + Duration::from_secs(5);
    while spread.is_empty() && !task.wait_ready(Duration::from_millis(50)) {
        if signals::stop_requested() {
            break;
        }
        if Instant::now() >= ready_by {
            tracing::warn!(task = %args.task, "task meta not known after 5 s; starting anyway");
            break;
        }
    }
    // `--all-with`: the second task is opened and its meta awaited before the common start
    // (never past it: a task whose meta is not known yet is decided alone until it is).
    let other = match &args.all_with {
        Some(name) => {
            let t = client
                .task(name)
                .map_err(|e| format!("--all-with {name}: {e}"))?;
            let until_start = args.start_at_ms.map_or(Duration::ZERO, |at| {
                Duration::from_millis((at - now_ms()).max(0) as u64)
            });
            let ready_by = Instant::now() + until_start.min(Duration::from_secs(5));
            while !t.wait_ready(Duration::from_millis(50))
                && Instant::now() < ready_by
                && !signals::stop_requested()
            {}
            Some(t)
        }
        None => None,
    };
    let start_at = args.start_at_ms.unwrap_or_else(now_ms);
    let wait = start_at - now_ms();
    if wait > 0 {
        sleep_unless_stopped(Duration::from_millis(wait as u64));
    }
    // The modes with their own loops: keyed tasks, concurrency tasks, several limits.
    if !spread.is_empty() && (args.keys > 0 || args.all_with.is_some()) {
        return Err("--spread-tasks cannot be combined with --keys or --all-with".into());
    }
    let own_loop = if args.keys > 0 {
        Some(keyed_child(args, &task, &mut progress)?)
    } else if task.meta().is_some_and(|m| m.mode == Mode::Concurrency) {
        Some(concurrency_child(args, &task, &mut progress)?)
    } else if let Some(other) = &other {
        Some(all_child(
            args,
            &task,
            other,
            backend.as_ref(),
            &mut progress,
        )?)
    } else {
        None
    };
    if let Some(r) = own_loop {
        // The tasks and the client first: their last flush is part of the Redis calls.
        drop(other);
        drop(task);
        drop(client);
        let r = Report {
            redis_calls: calls.get(),
            ..r
        };
        let line = serde_json::to_string(&r).map_err(|e| e.to_string())?;
        let _ = writeln!(std::io::stdout(), "{line}");
        return Ok(());
    }
    let started = Instant::now();
    let duration = Duration::from_millis(args.duration_ms);
    // Bounded in count as well as in time.
    let (interval, max_decisions) = rate_bounds(args);
    let mut r = Report::new(args, 1);
    let bucket_ms = args.bucket_ms;
    let mut cur_bucket = i64::MIN;
    // [admitted, rejected, fallback-admitted, shadow-admitted]
    let mut cur = [0u64; 4];
    let mut cur_late = 0u64;
    let mut done: u64 = 0;
    let every = args.latency_every;
    let mut lat = (every > 0).then(LatHist::new);
    'outer: while done < max_decisions && !signals::stop_requested() {
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        // How many decisions are due now (paced), or a batch of 256 (as fast as possible).
        let due = match interval {
            Some(iv) => {
                let due = (elapsed.as_secs_f64() / iv.as_secs_f64()) as u64 + 1;
                if due <= done {
                    let next = iv.mul_f64(done as f64);
                    let nap = next.saturating_sub(elapsed).min(Duration::from_millis(5));
                    std::thread::sleep(nap);
                    // How late the OS woke this thread (the machine was busy): only the
                    // oversleep, never time spent deciding (a slow SDK must not excuse itself).
                    let over = started.elapsed().saturating_sub(elapsed + nap);
                    cur_late = cur_late.max(over.as_millis() as u64);
                    continue;
                }
                (due - done).min(max_decisions - done)
            }
            None => 256.min(max_decisions - done),
        };
        for i in 0..due {
            // A backlog (decisions slower than the rate: blocking exact decisions while Redis
            // is slow) is cut at the duration too: the run is bounded in time, not only in
            // count (the soak's seed 14: an exact_sliding child decided 104 s of a 60 s run
            // and was killed by its parent's deadline without a report).
            if (interval.is_some() || i % 64 == 63) && started.elapsed() >= duration {
                break 'outer;
            }
            let target = match spread.len() {
                0 => &task,
                n => &spread[(done % n as u64) as usize],
            };
            let (d, now_us) = match &mut lat {
                Some(h) if done.is_multiple_of(every) => {
                    let t0 = Instant::now();
                    let r = decide(target);
                    h.record(t0.elapsed());
                    r
                }
                _ => decide(target),
            };
            let now_ms = now_us.div_euclid(1_000);
            let bucket = now_ms - now_ms.rem_euclid(bucket_ms);
            if bucket != cur_bucket {
                if cur_bucket != i64::MIN {
                    r.add_bucket(cur_bucket, [cur[0], cur[1], cur[2]]);
                    progress.bucket_late(cur_bucket, cur, cur_late);
                    cur_late = 0;
                }
                cur_bucket = bucket;
                cur = [0, 0, 0, 0];
            }
            if d.is_allowed() {
                r.admitted += 1;
                cur[0] += 1;
                if d == Decision::FallbackAllowed {
                    r.fallback_admitted += 1;
                    cur[2] += 1;
                }
                if d.is_shadowed() {
                    r.shadow_admitted += 1;
                    cur[3] += 1;
                }
                if let Some(b) = &backend {
                    let (outcome, latency) = if b.serve(now_ms) {
                        (Outcome::Ok, Duration::from_millis(2))
                    } else {
                        (Outcome::Err, Duration::from_millis(50))
                    };
                    task.report(outcome, latency);
                }
            } else {
                r.rejected += 1;
                cur[1] += 1;
            }
            done += 1;
            if done >= max_decisions || signals::stop_requested() {
                break 'outer;
            }
        }
    }
    if cur_bucket != i64::MIN {
        r.add_bucket(cur_bucket, [cur[0], cur[1], cur[2]]);
        progress.bucket_late(cur_bucket, cur, cur_late);
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    r.decisions_per_sec = (r.admitted + r.rejected) as f64 / secs;
    if let Some(h) = lat {
        r.lat_clock_ns = Some(h.clock_ns);
        h.into_map(&mut r.lat_hist);
    }
    tracing::debug!(
        child = index,
        admitted = r.admitted,
        rejected = r.rejected,
        "child done"
    );
    r.caller_pulls = client.caller_pulls_sent();
    // Drop the client first: its last flush is part of its Redis calls.
    drop(spread);
    drop(task);
    drop(client);
    r.redis_calls = calls.get();
    let line = serde_json::to_string(&r).map_err(|e| e.to_string())?;
    let _ = writeln!(std::io::stdout(), "{line}");
    Ok(())
}

/// A plain pooled task (paced and shadow included; not keyed), by its meta in the segment: the
/// kind `--all-with` decides together (every part of it can be given back).
fn plain_pooled(task: &Task) -> bool {
    task.meta()
        .is_some_and(|m| m.mode == Mode::Pooled && !m.keyed)
}

/// `--all-with T2`: every decision asks this task and T2 for one permit each with
/// `sluice::acquire_all` (the async call, on a current-thread runtime), while both are plain
/// pooled tasks; otherwise this task alone, as the plain loop does. One decision in eight is
/// cancelled if it still waits after 1 ms (a timeout drops it: what its parts took is given
/// back). Each part is counted in the bucket of the time it was charged at, under its own
/// task; a refusal under the task that refused (the parts before it were given back: counted
/// nowhere); a cancelled decision nowhere. Lines are written as buckets close, 200 ms after
/// their end (lines of one bucket add up).
fn all_child(
    args: &Args,
    task: &Task,
    other: &Task,
    backend: Option<&Backend>,
    progress: &mut Progress,
) -> Result<Report, String> {
    let other_name = args.all_with.clone().unwrap_or_default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let names = [args.task.clone(), other_name.clone()];
    let started = Instant::now();
    let duration = Duration::from_millis(args.duration_ms);
    let (interval, max_decisions) = rate_bounds(args);
    let bucket_ms = args.bucket_ms;
    let bucket_of = |us: i64| {
        let ms = us.div_euclid(1_000);
        ms - ms.rem_euclid(bucket_ms)
    };
    let mut r = Report::new(args, 1);
    let mut a = AllWith {
        task: other_name,
        ..AllWith::default()
    };
    // (part, bucket) → [admitted, rejected, fallback, shadow, given back], not yet written.
    let mut live: BTreeMap<(usize, i64), [u64; 5]> = BTreeMap::new();
    let mut trace = Vec::with_capacity(2);
    let mut late = 0u64;
    let mut flushed = Instant::now();
    let mut done = 0u64;
    let mut x = u64::from(std::process::id()) | 1;
    let flush = |live: &mut BTreeMap<(usize, i64), [u64; 5]>,
                 r: &mut Report,
                 a: &mut AllWith,
                 progress: &mut Progress,
                 before: Option<i64>,
                 late: u64| {
        let (out, keep): (Vec<_>, Vec<_>) = std::mem::take(live)
            .into_iter()
            .partition(|((_, b), _)| before.is_none_or(|t| b + bucket_ms <= t));
        *live = keep.into_iter().collect();
        for ((i, b), v) in out {
            if i == 0 {
                r.add_bucket(b, [v[0], v[1], v[2]]);
                progress.bucket_given_back(b, [v[0], v[1], v[2], v[3]], late, v[4]);
            } else {
                let e = a.buckets.entry(b.to_string()).or_insert([0, 0]);
                e[0] += v[0];
                e[1] += v[1];
                if v[2] > 0 {
                    *a.fallback_buckets.entry(b.to_string()).or_insert(0) += v[2];
                }
                progress.bucket_of(&names[1], b, [v[0], v[1], v[2], v[3]]);
            }
        }
    };
    while done < max_decisions && !signals::stop_requested() {
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        if flushed.elapsed() >= Duration::from_millis(100) {
            flushed = Instant::now();
            flush(
                &mut live,
                &mut r,
                &mut a,
                progress,
                Some(now_ms() - 200),
                late,
            );
            late = 0;
        }
        if let Some(iv) = interval {
            let next = iv.mul_f64(done as f64);
            if elapsed < next {
                let nap = (next - elapsed).min(Duration::from_millis(5));
                std::thread::sleep(nap);
                let over = started.elapsed().saturating_sub(elapsed + nap);
                late = late.max(over.as_millis() as u64);
                continue;
            }
        }
        done += 1;
        // A part's decision (`back`: admitted and given back, counted only as such).
        let mut count_part = |part: usize, d: Decision, at_us: i64, back: bool| {
            let e = live.entry((part, bucket_of(at_us))).or_insert([0; 5]);
            if back {
                e[4] += 1;
            } else if d.is_allowed() {
                e[0] += 1;
                e[2] += u64::from(d == Decision::FallbackAllowed);
                e[3] += u64::from(d.is_shadowed());
            } else {
                e[1] += 1;
            }
        };
        if !(plain_pooled(task) && plain_pooled(other)) {
            a.alone += 1;
            let (d, at) = decide(task);
            count_part(0, d, at, false);
            tally(&mut r, d);
            continue;
        }
        // xorshift64: which decisions are cancelled after 1 ms.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        trace.clear();
        let parts = [sluice::Limit::Task(task, 1), sluice::Limit::Task(other, 1)];
        let fut = sluice::acquire_all_traced(&parts, &mut trace);
        let all = if x % 8 == 0 {
            rt.block_on(async { tokio::time::timeout(Duration::from_millis(1), fut).await })
                .ok()
        } else {
            Some(rt.block_on(fut))
        };
        // Parts admitted and not given back by a refusal or a cancellation (a FAILED fallback
        // admission, an exact part after a mode change mid-call) stay spent: counted as
        // admitted under their task, as the SDK's own counters do.
        // Parts given back are counted as such (`gb` on the first task's lines: the host keeps
        // those permits in its stock).
        let mut kept = |trace: &[sluice::PartTrace], upto: usize| {
            for (i, (d, at, back)) in trace.iter().enumerate().take(upto) {
                if d.is_allowed() {
                    count_part(i, *d, *at, *back);
                    a.kept += u64::from(!back);
                }
            }
        };
        match all {
            None => {
                a.cancelled += 1;
                kept(&trace, trace.len());
            }
            Some(all)
                if all.is_allowed()
                    && (trace.len() != parts.len() || trace.iter().any(|p| !p.0.is_allowed())) =>
            {
                // Admitted with a part not admitted: a broken all-or-nothing. Counted nowhere
                // per part; said on the progress file at once (the soak's finding).
                a.inconsistent += 1;
                progress.inconsistent(&format!("admitted {all:?} with parts {trace:?}"));
            }
            Some(all)
                if !all.is_allowed()
                    && all.refused.is_none_or(|i| {
                        trace.len() != i + 1 || trace[..i].iter().any(|p| !p.0.is_allowed())
                    }) =>
            {
                a.inconsistent += 1;
                progress.inconsistent(&format!("refused {all:?} with parts {trace:?}"));
            }
            Some(all) if all.is_allowed() => {
                for (i, (d, at, _)) in trace.iter().enumerate() {
                    count_part(i, *d, *at, false);
                }
                tally(&mut r, trace.first().map_or(all.decision, |p| p.0));
                a.admitted += 1;
                if let Some(b) = backend
                    && let Some((_, at, _)) = trace.first()
                {
                    let (outcome, latency) = if b.serve(at.div_euclid(1_000)) {
                        (Outcome::Ok, Duration::from_millis(2))
                    } else {
                        (Outcome::Err, Duration::from_millis(50))
                    };
                    task.report(outcome, latency);
                }
            }
            Some(all) => {
                let i = all.refused.unwrap_or(0);
                kept(&trace, i);
                if let Some((d, at, _)) = trace.get(i) {
                    count_part(i, *d, *at, false);
                }
                if i == 0 {
                    r.rejected += 1;
                } else {
                    a.rejected += 1;
                }
            }
        }
    }
    flush(&mut live, &mut r, &mut a, progress, None, late);
    r.all_with = Some(a);
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    r.decisions_per_sec = done as f64 / secs;
    Ok(r)
}

/// The interval between decisions (`--rate`; None = as fast as possible) and the most
/// decisions a run makes (the rate over the duration, + 1).
fn rate_bounds(args: &Args) -> (Option<Duration>, u64) {
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / args.rate));
    let max = match interval {
        Some(_) => (args.rate * args.duration_ms as f64 / 1_000.0).ceil() as u64 + 1,
        None => 100_000_000_000,
    };
    (interval, max)
}

/// Adds one decision of the report's own task to its totals.
fn tally(r: &mut Report, d: Decision) {
    if d.is_allowed() {
        r.admitted += 1;
        r.fallback_admitted += u64::from(d == Decision::FallbackAllowed);
        r.shadow_admitted += u64::from(d.is_shadowed());
    } else {
        r.rejected += 1;
    }
}

/// The counts of one concurrency worker loop: `[admitted, rejected, fallback]` per bucket.
type Counts = BTreeMap<i64, [u64; 3]>;

/// A concurrency task: `--workers` loops per process, each holding permits `--hold-ms`.
fn concurrency_child(args: &Args, task: &Task, progress: &mut Progress) -> Result<Report, String> {
    if args.workers == 0 || args.workers > 10_000 {
        return Err("--workers must be 1..=10000".into());
    }
    let intervals = match &args.intervals {
        None => None,
        Some(p) => Some(std::sync::Arc::new(
            File::options()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("intervals file {}: {e}", p.display()))?,
        )),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let duration = Duration::from_millis(args.duration_ms);
    let hold = Duration::from_millis(args.hold_ms);
    let bucket_ms = args.bucket_ms;
    let live = std::cell::RefCell::new(Live::default());
    let progress = std::cell::RefCell::new(progress);
    let counts: Vec<Counts> = rt.block_on(async {
        let live = &live;
        let loops = (0..args.workers).map(|_| {
            let task = task.clone();
            let intervals = intervals.clone();
            async move {
                let mut counts = Counts::new();
                // Bounded by time (and by the stop flag).
                while started.elapsed() < duration && !signals::stop_requested() {
                    let got = task.permit_timeout(Duration::from_millis(100)).await;
                    if let Err(sluice::PermitError::NotConcurrency) = got {
                        // Not (or no longer) a concurrency task: nothing was decided.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    let start_us = sluice::clock::host_us();
                    let ms = start_us.div_euclid(1_000);
                    let b = ms - ms.rem_euclid(bucket_ms);
                    let c = counts.entry(b).or_insert([0; 3]);
                    {
                        let mut l = live.borrow_mut();
                        let x = l.buckets.entry(b).or_insert([0; 4]);
                        x[usize::from(got.is_err())] += 1;
                        if got.as_ref().is_ok_and(|p| p.is_fallback()) {
                            x[2] += 1;
                        }
                    }
                    match got {
                        Ok(p) => {
                            c[0] += 1;
                            let fallback = p.is_fallback();
                            if fallback {
                                c[2] += 1;
                            }
                            if !hold.is_zero() {
                                tokio::time::sleep(hold).await;
                            }
                            let end_us = sluice::clock::host_us();
                            drop(p);
                            if let Some(f) = &intervals {
                                let line = if fallback {
                                    format!("{start_us} {end_us} f\n")
                                } else {
                                    format!("{start_us} {end_us}\n")
                                };
                                // O_APPEND: one write lands whole, whatever others write.
                                if let Err(e) = (&**f).write_all(line.as_bytes()) {
                                    tracing::warn!(error = %e, "cannot append an interval");
                                }
                            }
                        }
                        Err(_) => c[1] += 1,
                    }
                }
                counts
            }
        });
        let flusher = flush_live(live, &progress, started, duration, bucket_ms);
        futures::future::join(futures::future::join_all(loops), flusher)
            .await
            .0
    });
    live.borrow_mut()
        .flush(&mut progress.borrow_mut(), None, bucket_ms);
    let mut r = Report::new(args, 1);
    let mut merged = Counts::new();
    for c in counts {
        for (b, v) in c {
            let e = merged.entry(b).or_insert([0; 3]);
            for i in 0..3 {
                e[i] += v[i];
            }
        }
    }
    for (b, v) in merged {
        r.admitted += v[0];
        r.rejected += v[1];
        r.fallback_admitted += v[2];
        r.add_bucket(b, v);
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    r.decisions_per_sec = (r.admitted + r.rejected) as f64 / secs;
    Ok(r)
}

/// A small xorshift generator (per loop; seeded from the clock, the process and the loop).
struct Rng(u64);

impl Rng {
    /// The seed goes through SplitMix64's finaliser first: xorshift is linear, so loops seeded
    /// `s`, `s + 1`, … (one per worker) would otherwise draw the same keys for their first
    /// decisions and stay correlated (16 loops drew about half the distinct keys they should).
    fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Key choice: uniform, or Zipf with exponent `s` by inverse CDF (binary search).
enum KeyChoice {
    Uniform(u64),
    Zipf(Vec<f64>),
}

impl KeyChoice {
    fn new(keys: u64, s: f64) -> Self {
        if s <= 0.0 {
            return Self::Uniform(keys);
        }
        let mut cdf = Vec::with_capacity(keys as usize);
        let mut sum = 0.0;
        for k in 1..=keys {
            sum += 1.0 / (k as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Self::Zipf(cdf)
    }

    fn pick(&self, rng: &mut Rng) -> usize {
        match self {
            Self::Uniform(k) => ((rng.next_f64() * *k as f64) as u64).min(k - 1) as usize,
            Self::Zipf(cdf) => {
                let u = rng.next_f64();
                cdf.partition_point(|c| *c < u).min(cdf.len() - 1)
            }
        }
    }
}

/// Per-loop counts: totals by bucket `[admitted, rejected, fallback]`, reported keys by bucket,
/// latency samples (µs) of cold and hot decisions.
#[derive(Default)]
struct KeyedCounts {
    buckets: Counts,
    keys: BTreeMap<(usize, i64), [u64; 2]>,
    cold: Vec<u32>,
    hot: Vec<u32>,
    lat_hist: BTreeMap<String, u64>,
    lat_clock_ns: u64,
    /// Shadow-admitted decisions.
    shadow: u64,
}

/// Most latency samples kept per loop (a uniform thinning keeps the percentiles honest).
const MAX_SAMPLES: usize = 20_000;

/// A keyed task: `--workers` loops per process deciding on `--keys` keys.
fn keyed_child(args: &Args, task: &Task, progress: &mut Progress) -> Result<Report, String> {
    if args.workers == 0 || args.workers > 10_000 {
        return Err("--workers must be 1..=10000".into());
    }
    if args.keys > 10_000_000 {
        return Err("--keys must be at most 10000000".into());
    }
    if !(0.0..=10.0).contains(&args.key_skew) {
        return Err("--key-skew must be from 0 to 10".into());
    }
    let handles: Vec<sluice::Key> = (0..args.keys)
        .map(|i| task.key(&format!("key-{i}")))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let handles = std::sync::Arc::new(handles);
    let choice = std::sync::Arc::new(KeyChoice::new(args.keys, args.key_skew));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let duration = Duration::from_millis(args.duration_ms);
    let bucket_ms = args.bucket_ms;
    let report_keys = args.key_report as usize;
    let workers = args.workers;
    let per_loop_rate = args.rate / workers as f64;
    let seed = sluice::clock::host_us() as u64 ^ ((std::process::id() as u64) << 32);
    let live = std::cell::RefCell::new(Live::default());
    let progress = std::cell::RefCell::new(progress);
    let counts: Vec<KeyedCounts> = rt.block_on(async {
        let live = &live;
        let loops = (0..workers).map(|w| {
            let handles = handles.clone();
            let choice = choice.clone();
            async move {
                let mut c = KeyedCounts::default();
                let mut lat = LatHist::new();
                let mut rng = Rng::new(
                    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        .wrapping_add(w as u64),
                );
                let mut done: u64 = 0;
                let max: u64 = if per_loop_rate > 0.0 {
                    (per_loop_rate * duration.as_secs_f64()).ceil() as u64 + 1
                } else {
                    100_000_000_000
                };
                let mut seen: u64 = 0;
                // Bounded in time and count (and by the stop flag).
                // Loop w's decisions are due a w/W-th of its period later than loop 0's, so the
                // loops together offer evenly spaced decisions, as the per-request peer does (at
                // the timer's 1 ms grain), not all W at once.
                let phase = w as f64 / workers as f64;
                while done < max && started.elapsed() < duration && !signals::stop_requested() {
                    if per_loop_rate > 0.0 {
                        let at = started.elapsed().as_secs_f64() * per_loop_rate - phase;
                        let due = if at < 0.0 { 0 } else { at as u64 + 1 };
                        if due <= done {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            continue;
                        }
                    } else if done % 256 == 255 {
                        tokio::task::yield_now().await;
                    }
                    let k = choice.pick(&mut rng);
                    let t0 = Instant::now();
                    let (d, now_us) = handles[k].acquire_stamped(1).await;
                    let took_d = t0.elapsed();
                    lat.record(took_d);
                    let took = took_d.as_micros().min(u32::MAX as u128) as u32;
                    seen += 1;
                    // Cold = it waited for Redis (a pull or a direct call): over 20 µs.
                    let v = if took > 20 { &mut c.cold } else { &mut c.hot };
                    if v.len() < MAX_SAMPLES {
                        v.push(took);
                    } else {
                        let j = (rng.next_f64() * seen as f64) as usize;
                        if j < MAX_SAMPLES {
                            v[j] = took;
                        }
                    }
                    let ms = now_us.div_euclid(1_000);
                    let b = ms - ms.rem_euclid(bucket_ms);
                    let e = c.buckets.entry(b).or_insert([0; 3]);
                    let allowed = d.is_allowed();
                    let fallback = d == Decision::FallbackAllowed;
                    if allowed {
                        e[0] += 1;
                        if fallback {
                            e[2] += 1;
                        }
                        if d.is_shadowed() {
                            c.shadow += 1;
                        }
                    } else {
                        e[1] += 1;
                    }
                    if k < report_keys {
                        let ke = c.keys.entry((k, b)).or_insert([0, 0]);
                        ke[usize::from(!allowed)] += 1;
                    }
                    {
                        let mut l = live.borrow_mut();
                        let x = l.buckets.entry(b).or_insert([0; 4]);
                        x[usize::from(!allowed)] += 1;
                        x[2] += u64::from(fallback);
                        x[3] += u64::from(d.is_shadowed());
                        if k < report_keys {
                            let y = l.keys.entry((k, b)).or_insert([0; 4]);
                            y[usize::from(!allowed)] += 1;
                            y[2] += u64::from(fallback);
                            y[3] += u64::from(d.is_shadowed());
                        }
                    }
                    done += 1;
                }
                c.lat_clock_ns = lat.clock_ns;
                lat.into_map(&mut c.lat_hist);
                c
            }
        });
        let flusher = flush_live(live, &progress, started, duration, bucket_ms);
        futures::future::join(futures::future::join_all(loops), flusher)
            .await
            .0
    });
    live.borrow_mut()
        .flush(&mut progress.borrow_mut(), None, bucket_ms);
    let mut r = Report::new(args, 1);
    let mut merged = Counts::new();
    let mut lat = KeyLatency::default();
    for c in counts {
        for (b, v) in c.buckets {
            let e = merged.entry(b).or_insert([0; 3]);
            for i in 0..3 {
                e[i] += v[i];
            }
        }
        for ((k, b), v) in c.keys {
            let e = r
                .keys
                .entry(format!("key-{k}"))
                .or_default()
                .entry(b.to_string())
                .or_insert([0, 0]);
            e[0] += v[0];
            e[1] += v[1];
        }
        lat.cold_samples.extend(c.cold);
        lat.hot_samples.extend(c.hot);
        for (k, n) in c.lat_hist {
            *r.lat_hist.entry(k).or_insert(0) += n;
        }
        r.lat_clock_ns = Some(c.lat_clock_ns);
        r.shadow_admitted += c.shadow;
    }
    r.key_latency_us = Some(lat);
    for (b, v) in merged {
        r.admitted += v[0];
        r.rejected += v[1];
        r.fallback_admitted += v[2];
        r.add_bucket(b, v);
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    r.decisions_per_sec = (r.admitted + r.rejected) as f64 / secs;
    Ok(r)
}
