//! Load generator: P processes of one simulated host hammering one Sluice task.
//!
//! ```text
//! cargo run --release -p sluice --example loadgen -- --redis URL --namespace NS --task T \
//!     --host-id H --procs P --duration-ms D [--rate R] [--bucket-ms B] [--backend-capacity C]
//! ```
//!
//! The parent re-executes itself P times (`--child i`); the children share one host segment
//! (`/dev/shm/sluice.NS.H`), start together, call `try_acquire(1)` in a loop for D ms (`--rate`
//! per process per second, 0 = as fast as possible) and report to the parent, which prints ONE
//! JSON line on stdout:
//!
//! ```json
//! {"task":"T","host_id":"H","procs":4,"duration_ms":5000,"admitted":0,"rejected":0,
//!  "fallback_admitted":0,"decisions_per_sec":0.0,"redis_calls":0,
//!  "buckets":{"<bucket_start_ms>":[admitted,rejected]}}
//! ```
//!
//! `admitted` counts every admitted decision, `fallback_admitted` the part of it admitted by
//! the FAILED fallback (or for an unknown task); `rejected` every rejection. Each decision is
//! bucketed by the time it was decided at (the SDK's slice clock), so with `--bucket-ms` equal
//! to the slice length a bucket is exactly a slice. `--backend-capacity C` simulates a backend
//! that fails requests above C per second on this host (C/P per process); outcomes and
//! latencies are reported to the SDK's health API.
//!
//! Extra flags (not part of the pinned interface): `--probe-interval-ms`, `--pull-timeout-ms`,
//! `--clock host|redis`. Logs go to stderr (`RUST_LOG`, default `sluice=info`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use serde::{Deserialize, Serialize};
use sluice::{Client, ClockSource, Config, Decision, Outcome};

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
    /// Simulated backend capacity per second on this host (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    backend_capacity: u64,
    /// Probe interval while FAILED, ms (extra).
    #[arg(long)]
    probe_interval_ms: Option<u64>,
    /// Pull timeout, ms (extra).
    #[arg(long)]
    pull_timeout_ms: Option<u64>,
    /// Slice clock: host or redis (extra).
    #[arg(long, default_value = "host")]
    clock: String,
    /// Internal: run as child number i.
    #[arg(long, hide = true)]
    child: Option<u32>,
    /// Internal: common start time (Unix ms).
    #[arg(long, hide = true)]
    start_at_ms: Option<i64>,
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

fn parent(args: &Args) -> Result<(), String> {
    if args.procs == 0 || args.procs > 256 {
        return Err("--procs must be 1..=256".into());
    }
    if args.bucket_ms <= 0 {
        return Err("--bucket-ms must be positive".into());
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let start_at = now_ms() + 1_000 + 50 * args.procs as i64;
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let mut children = Vec::new();
    for i in 0..args.procs {
        let child = Command::new(&exe)
            .args(&raw)
            .args(["--child", &i.to_string()])
            .args(["--start-at-ms", &start_at.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start child {i}: {e}"))?;
        children.push(child);
    }
    let deadline =
        Instant::now() + Duration::from_millis(args.duration_ms) + Duration::from_secs(60);
    let mut total = Report {
        task: args.task.clone(),
        host_id: args.host_id.clone(),
        procs: args.procs,
        duration_ms: args.duration_ms,
        ..Report::default()
    };
    let mut failures = Vec::new();
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let out = c.stdout.take();
            std::thread::spawn(move || {
                let mut line = String::new();
                if let Some(out) = out {
                    let _ = BufReader::new(out).read_line(&mut line);
                }
                line
            })
        })
        .collect();
    for (i, (mut c, reader)) in children.into_iter().zip(readers).enumerate() {
        while matches!(c.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.wait();
        let line = reader.join().unwrap_or_default();
        match serde_json::from_str::<Report>(line.trim()) {
            Ok(r) => {
                total.admitted += r.admitted;
                total.rejected += r.rejected;
                total.fallback_admitted += r.fallback_admitted;
                total.redis_calls += r.redis_calls;
                for (k, v) in r.buckets {
                    let e = total.buckets.entry(k).or_insert([0, 0]);
                    e[0] += v[0];
                    e[1] += v[1];
                }
            }
            Err(e) => failures.push(format!("child {i}: {e} ({line:?})")),
        }
    }
    if !failures.is_empty() {
        return Err(failures.join("; "));
    }
    total.decisions_per_sec =
        (total.admitted + total.rejected) as f64 / (args.duration_ms.max(1) as f64 / 1_000.0);
    println!(
        "{}",
        serde_json::to_string(&total).map_err(|e| e.to_string())?
    );
    Ok(())
}

fn child(args: &Args, index: u32) -> Result<(), String> {
    let mut cfg = Config::new(args.redis.clone());
    cfg.namespace = args.namespace.clone();
    cfg.host_id = args.host_id.clone();
    if let Some(ms) = args.probe_interval_ms {
        cfg.probe_interval = Duration::from_millis(ms);
    }
    if let Some(ms) = args.pull_timeout_ms {
        cfg.pull_timeout = Duration::from_millis(ms);
    }
    cfg.clock = match args.clock.as_str() {
        "redis" => ClockSource::Redis,
        _ => ClockSource::Host,
    };
    let client = Client::new(cfg).map_err(|e| e.to_string())?;
    let calls = client.redis_calls_counter();
    let task = client.task(&args.task).map_err(|e| e.to_string())?;
    if !task.wait_ready(Duration::from_secs(5)) {
        tracing::warn!(task = %args.task, "task meta not known after 5 s; starting anyway");
    }
    let start_at = args.start_at_ms.unwrap_or_else(now_ms);
    let wait = start_at - now_ms();
    if wait > 0 {
        std::thread::sleep(Duration::from_millis(wait as u64));
    }
    let started = Instant::now();
    let duration = Duration::from_millis(args.duration_ms);
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / args.rate));
    // Bounded in count as well as in time.
    let max_decisions: u64 = match interval {
        Some(_) => (args.rate * args.duration_ms as f64 / 1_000.0).ceil() as u64 + 1,
        None => 100_000_000_000,
    };
    let per_proc_capacity = args.backend_capacity.div_ceil(args.procs.max(1) as u64);
    let mut r = Report {
        task: args.task.clone(),
        host_id: args.host_id.clone(),
        procs: 1,
        duration_ms: args.duration_ms,
        ..Report::default()
    };
    let bucket_ms = args.bucket_ms;
    let mut cur_bucket = i64::MIN;
    let mut cur = [0u64; 2];
    let mut backend_second = i64::MIN;
    let mut backend_used = 0u64;
    let mut done: u64 = 0;
    'outer: while done < max_decisions {
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
                    std::thread::sleep(next.saturating_sub(elapsed).min(Duration::from_millis(5)));
                    continue;
                }
                (due - done).min(max_decisions - done)
            }
            None => 256.min(max_decisions - done),
        };
        for _ in 0..due {
            let now_us = task.now_us();
            let d = task.try_acquire_at(1, now_us);
            let now_ms = now_us.div_euclid(1_000);
            let bucket = now_ms - now_ms.rem_euclid(bucket_ms);
            if bucket != cur_bucket {
                if cur_bucket != i64::MIN {
                    add_bucket(&mut r.buckets, cur_bucket, cur);
                }
                cur_bucket = bucket;
                cur = [0, 0];
            }
            if d.is_allowed() {
                r.admitted += 1;
                cur[0] += 1;
                if d == Decision::FallbackAllowed {
                    r.fallback_admitted += 1;
                }
                if per_proc_capacity > 0 {
                    let second = now_ms.div_euclid(1_000);
                    if second != backend_second {
                        backend_second = second;
                        backend_used = 0;
                    }
                    backend_used += 1;
                    let (outcome, latency) = if backend_used <= per_proc_capacity {
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
            if done >= max_decisions {
                break 'outer;
            }
        }
    }
    if cur_bucket != i64::MIN {
        add_bucket(&mut r.buckets, cur_bucket, cur);
    }
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    r.decisions_per_sec = (r.admitted + r.rejected) as f64 / secs;
    tracing::debug!(
        child = index,
        admitted = r.admitted,
        rejected = r.rejected,
        "child done"
    );
    // Drop the client first: its last flush is part of its Redis calls.
    drop(task);
    drop(client);
    r.redis_calls = calls.get();
    println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
    Ok(())
}

fn add_bucket(buckets: &mut BTreeMap<String, [u64; 2]>, start: i64, v: [u64; 2]) {
    let e = buckets.entry(start.to_string()).or_insert([0, 0]);
    e[0] += v[0];
    e[1] += v[1];
}
