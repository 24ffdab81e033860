//! Load client for rate-limit decision servers: Envoy RLS v3 over gRPC, or the agent's
//! `POST /v1/decide` over HTTP/1.1 (the Sluice agent and `rls_baseline` speak both). Used by
//! `scripts/bench-agent.sh`; reusable by any benchmark.
//!
//! ```text
//! rls_load --target grpc://127.0.0.1:P | http://127.0.0.1:P
//!          [--connections C] [--concurrency N] [--seconds S] [--warmup-seconds W] [--rate R]
//!          [--domain D] [--descriptor key=value[,key=value]]... [--task T] [--key K]
//!          [--keys K] [--hits H] [--window-ms MS] [--threads T] [--max-decisions M]
//!          [--timeout-ms MS]
//! ```
//!
//! * gRPC: every request carries `--domain` and every `--descriptor` given (each is one RLS
//!   descriptor; default `bench=1`). `--connections` HTTP/2 connections, the `--concurrency`
//!   workers spread over them round robin (HTTP/2 multiplexes).
//! * HTTP: `{"task": T, "key": K?, "hits": H}`; HTTP/1.1 has one request in flight per
//!   connection, so every worker has its own keep-alive connection (`--connections` is not
//!   used; the JSON reports the real count).
//! * `--keys K`: a value `*` (in a descriptor or in `--key`) becomes `v<i mod K>`, `i` the
//!   decision's sequence number, so the load spreads evenly over `K` distinct values.
//! * `--rate 0` (default): closed loop, each worker sends its next request when the previous
//!   answer arrived; latency = answer − send.
//!   `--rate R > 0`: open loop at `R` decisions/s in total. Decision `i` is due at
//!   `t0 + i / R`; a pacing thread releases due decisions to the workers (every ~100 µs), and the
//!   latency is measured from the decision's SCHEDULED time, not from when a worker got to send
//!   it, so a slow server is charged for the requests it delayed (no coordinated omission: a
//!   stall shows up in the percentiles as the queue it caused). The pacing thread's tick adds up
//!   to ~0.1–0.2 ms to every open-loop latency; closed-loop numbers do not have it.
//! * Windows: each answer is counted in the window (`--window-ms`, aligned to multiples of Unix
//!   ms) in which it ARRIVED (the client cannot see when the server decided; arrival is the last
//!   moment it can have been decided). An answer sent in one window and received in the next is
//!   ambiguous; `per_window[].ok_sent_before` counts those so an accuracy check can tell.
//! * Before the clock starts, every worker sends one unrecorded request (a failure there is a
//!   setup failure, exit 2), so connection set-up is not charged to the first decisions.
//! * `--warmup-seconds W`: the same load runs W seconds before the measured S seconds; nothing
//!   from the warm-up is recorded.
//!
//! Bounded: stops at W + S seconds or `--max-decisions` (default 100,000,000), each request
//! times out after `--timeout-ms` (default 5,000; counted as an error). Prints ONE JSON line:
//! `{"target", "protocol", "connections", "concurrency", "rate", "decisions", "seconds",
//! "decisions_per_s", "mean_us", "p50_us", "p90_us", "p99_us", "p999_us", "max_us", "ok",
//! "over_limit", "errors", "first_error", "window_ms", "per_window": [{"start_ms", "ok",
//! "over_limit", "ok_sent_before"}], "lat_hist"}` (decisions = ok + over_limit + errors;
//! `lat_hist`: the latencies as `floor(log2(ns) · 16)` → count, the histogram format of
//! `scripts/bench.sh`'s peers).
//! Exit status: 0 done; 1 no decision was answered at all; 2 bad usage or setup failure
//! (cannot connect), with the reason on stderr.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use clap::Parser;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::sync::Semaphore;
use tonic::transport::Channel;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "rls_load",
    about = "Load client for RLS (gRPC) and /v1/decide (HTTP) servers"
)]
struct Args {
    /// grpc://HOST:PORT or http://HOST:PORT
    #[arg(long)]
    target: String,
    /// gRPC: HTTP/2 connections (HTTP: one per worker, this is not used).
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Workers (requests in flight at most).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Measured seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Seconds of the same load before the measurement, not recorded.
    #[arg(long, default_value_t = 0.0)]
    warmup_seconds: f64,
    /// Total decisions/s (open loop); 0 = closed loop, as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// gRPC: the RLS domain.
    #[arg(long, default_value = "bench")]
    domain: String,
    /// gRPC: one descriptor `key=value[,key=value]` (repeatable: every request carries all).
    #[arg(long)]
    descriptor: Vec<String>,
    /// HTTP: the task.
    #[arg(long, default_value = "bench")]
    task: String,
    /// HTTP: the key (optional).
    #[arg(long)]
    key: Option<String>,
    /// A value `*` becomes `v<i mod keys>`.
    #[arg(long, default_value_t = 1)]
    keys: u64,
    /// Hits per request (RLS hits_addend / HTTP hits).
    #[arg(long, default_value_t = 1)]
    hits: u32,
    /// Window length for the per-window counts, ms.
    #[arg(long, default_value_t = 1000)]
    window_ms: u64,
    /// Runtime threads of this client (default: the machine's CPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// Stop after this many decisions (warm-up included).
    #[arg(long, default_value_t = 100_000_000)]
    max_decisions: u64,
    /// Per-request timeout, ms (an error).
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

enum Target {
    Grpc(String),
    Http(SocketAddr, String),
}

/// One descriptor's entries; values `*` are spread over `--keys`.
type Descriptor = Vec<(String, String)>;

fn parse_descriptor(s: &str) -> anyhow::Result<Descriptor> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| anyhow!("--descriptor {s:?}: {part:?} is not key=value"))?;
        if k.is_empty() {
            bail!("--descriptor {s:?}: empty key");
        }
        out.push((k.to_string(), v.to_string()));
    }
    Ok(out)
}

fn spread(v: &str, i: u64, keys: u64) -> String {
    if v == "*" {
        format!("v{}", i % keys)
    } else {
        v.to_string()
    }
}

/// What one worker records; merged at the end.
struct Record {
    hist: Histogram<u64>,
    ok: u64,
    over: u64,
    errors: u64,
    first_error: Option<String>,
    /// window start ms → (ok, over_limit, ok sent in an earlier window)
    windows: BTreeMap<u64, (u64, u64, u64)>,
}

impl Record {
    fn new() -> Self {
        Record {
            // 1 ns .. 100 s, 3 significant digits.
            hist: Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("histogram bounds"),
            ok: 0,
            over: 0,
            errors: 0,
            first_error: None,
            windows: BTreeMap::new(),
        }
    }
    fn merge(&mut self, o: Record) {
        self.hist.add(&o.hist).expect("same histogram bounds");
        self.ok += o.ok;
        self.over += o.over;
        self.errors += o.errors;
        if self.first_error.is_none() {
            self.first_error = o.first_error;
        }
        for (k, (a, b, c)) in o.windows {
            let e = self.windows.entry(k).or_default();
            e.0 += a;
            e.1 += b;
            e.2 += c;
        }
    }
}

/// The clock: Instants, and their Unix ms.
#[derive(Clone, Copy)]
struct Clock {
    t0: Instant,
    t0_unix_ms: f64,
}

impl Clock {
    fn unix_ms(&self, t: Instant) -> u64 {
        (self.t0_unix_ms + t.duration_since(self.t0).as_secs_f64() * 1000.0) as u64
    }
}

enum Outcome {
    Ok,
    Over,
    Err(String),
}

enum Conn {
    Grpc(RateLimitServiceClient<Channel>),
    Http {
        addr: SocketAddr,
        host: String,
        send: Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>,
    },
}

async fn http_connect(
    addr: SocketAddr,
) -> anyhow::Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("--target: cannot connect to {addr}"))?;
    stream.set_nodelay(true)?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

#[derive(Deserialize)]
struct DecideAnswer {
    allowed: bool,
}

struct Work {
    args: Args,
    descriptors: Vec<Descriptor>,
}

impl Work {
    async fn one(&self, conn: &mut Conn, i: u64) -> Outcome {
        let a = &self.args;
        match conn {
            Conn::Grpc(client) => {
                let req = RateLimitRequest {
                    domain: a.domain.clone(),
                    descriptors: self
                        .descriptors
                        .iter()
                        .map(|d| RateLimitDescriptor {
                            entries: d
                                .iter()
                                .map(|(k, v)| Entry {
                                    key: k.clone(),
                                    value: spread(v, i, a.keys),
                                })
                                .collect(),
                            ..Default::default()
                        })
                        .collect(),
                    hits_addend: a.hits,
                };
                match client.should_rate_limit(req).await {
                    Ok(r) => match Code::try_from(r.into_inner().overall_code) {
                        Ok(Code::Ok) => Outcome::Ok,
                        Ok(Code::OverLimit) => Outcome::Over,
                        other => Outcome::Err(format!("overall_code {other:?}")),
                    },
                    Err(s) => Outcome::Err(format!("gRPC {:?}: {}", s.code(), s.message())),
                }
            }
            Conn::Http { addr, host, send } => {
                let mut body = serde_json::json!({"task": a.task, "hits": a.hits});
                if let Some(k) = &a.key {
                    body["key"] = serde_json::Value::String(spread(k, i, a.keys));
                }
                if send.as_ref().is_none_or(|s| s.is_closed()) {
                    match http_connect(*addr).await {
                        Ok(s) => *send = Some(s),
                        Err(e) => return Outcome::Err(format!("{e:#}")),
                    }
                }
                let s = send.as_mut().expect("connected above");
                let req = hyper::Request::post("/v1/decide")
                    .header(hyper::header::HOST, host.as_str())
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .expect("a valid request");
                let resp = match s.send_request(req).await {
                    Ok(r) => r,
                    Err(e) => {
                        *send = None;
                        return Outcome::Err(format!("HTTP: {e}"));
                    }
                };
                let status = resp.status();
                let bytes = match resp.into_body().collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(e) => {
                        *send = None;
                        return Outcome::Err(format!("HTTP body: {e}"));
                    }
                };
                if status != hyper::StatusCode::OK {
                    return Outcome::Err(format!(
                        "HTTP {status}: {}",
                        String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                    ));
                }
                match serde_json::from_slice::<DecideAnswer>(&bytes) {
                    Ok(d) if d.allowed => Outcome::Ok,
                    Ok(_) => Outcome::Over,
                    Err(e) => Outcome::Err(format!("HTTP answer: {e}")),
                }
            }
        }
    }
}

struct Shared {
    work: Work,
    clock: Clock,
    /// Start of the measurement (after the warm-up).
    measure_from: Instant,
    deadline: Instant,
    next: AtomicU64,
    pacer: Option<Arc<Semaphore>>,
    stop: AtomicBool,
}

async fn worker(sh: Arc<Shared>, mut conn: Conn) -> Record {
    let mut rec = Record::new();
    let a = &sh.work.args;
    let timeout = Duration::from_millis(a.timeout_ms);
    let window = a.window_ms.max(1);
    loop {
        if sh.stop.load(Ordering::Relaxed) {
            break;
        }
        if let Some(p) = &sh.pacer {
            match p.acquire().await {
                Ok(permit) => permit.forget(),
                Err(_) => break, // closed: the run is over
            }
        }
        let i = sh.next.fetch_add(1, Ordering::Relaxed);
        if i >= a.max_decisions {
            sh.stop.store(true, Ordering::Relaxed);
            break;
        }
        // Open loop: the latency counts from the scheduled time (see the module doc).
        let start = if a.rate > 0.0 {
            sh.clock.t0 + Duration::from_secs_f64(i as f64 / a.rate)
        } else {
            Instant::now()
        };
        if start >= sh.deadline {
            break;
        }
        let outcome = match tokio::time::timeout(timeout, sh.work.one(&mut conn, i)).await {
            Ok(o) => o,
            Err(_) => Outcome::Err(format!("timeout after {} ms", a.timeout_ms)),
        };
        let end = Instant::now();
        if start < sh.measure_from {
            continue;
        }
        let ns = end.saturating_duration_since(start).as_nanos().max(1) as u64;
        rec.hist.saturating_record(ns);
        let w_end = sh.clock.unix_ms(end) / window * window;
        match outcome {
            Outcome::Ok => {
                rec.ok += 1;
                let w_start = sh.clock.unix_ms(start) / window * window;
                let e = rec.windows.entry(w_end).or_default();
                e.0 += 1;
                if w_start < w_end {
                    e.2 += 1;
                }
            }
            Outcome::Over => {
                rec.over += 1;
                rec.windows.entry(w_end).or_default().1 += 1;
            }
            Outcome::Err(e) => {
                rec.errors += 1;
                if rec.first_error.is_none() {
                    rec.first_error = Some(e);
                }
            }
        }
    }
    rec
}

fn parse_target(t: &str) -> anyhow::Result<Target> {
    if let Some(rest) = t.strip_prefix("grpc://") {
        rest.parse::<SocketAddr>()
            .with_context(|| format!("--target {t:?}: expected grpc://IP:PORT"))?;
        Ok(Target::Grpc(format!("http://{rest}")))
    } else if let Some(rest) = t.strip_prefix("http://") {
        let hostport = rest.trim_end_matches('/');
        let addr = hostport
            .parse::<SocketAddr>()
            .with_context(|| format!("--target {t:?}: expected http://IP:PORT"))?;
        Ok(Target::Http(addr, hostport.to_string()))
    } else {
        bail!("--target {t:?}: must start with grpc:// or http://")
    }
}

async fn run(args: Args) -> anyhow::Result<serde_json::Value> {
    if args.concurrency == 0 || args.connections == 0 {
        bail!("--concurrency and --connections must be at least 1");
    }
    if args.keys == 0 {
        bail!("--keys must be at least 1");
    }
    if !(args.seconds > 0.0 && args.seconds <= 86_400.0) {
        bail!("--seconds must be in (0, 86400]");
    }
    if !(args.warmup_seconds >= 0.0 && args.warmup_seconds <= 3600.0) {
        bail!("--warmup-seconds must be in [0, 3600]");
    }
    if !(args.rate >= 0.0 && args.rate.is_finite()) {
        bail!("--rate must be 0 (closed loop) or a positive number of decisions/s");
    }
    let target = parse_target(&args.target)?;
    let mut descriptors = args
        .descriptor
        .iter()
        .map(|d| parse_descriptor(d))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if descriptors.is_empty() {
        descriptors.push(vec![("bench".into(), "1".into())]);
    }

    // Connect everything before the clock starts (a failure here is a setup failure).
    let mut conns = Vec::with_capacity(args.concurrency);
    let connections: usize;
    match &target {
        Target::Grpc(uri) => {
            let mut channels = Vec::new();
            for _ in 0..args.connections {
                let ch = tonic::transport::Endpoint::from_shared(uri.clone())?
                    .tcp_nodelay(true)
                    .connect()
                    .await
                    .with_context(|| format!("--target {}: cannot connect", args.target))?;
                channels.push(ch);
            }
            for w in 0..args.concurrency {
                conns.push(Conn::Grpc(RateLimitServiceClient::new(
                    channels[w % channels.len()].clone(),
                )));
            }
            connections = args.connections;
        }
        Target::Http(addr, host) => {
            for _ in 0..args.concurrency {
                conns.push(Conn::Http {
                    addr: *addr,
                    host: host.clone(),
                    send: Some(http_connect(*addr).await?),
                });
            }
            connections = args.concurrency;
        }
    }

    // Pre-flight: one unrecorded request on every worker's connection, all at once, before the
    // clock starts, so lazy set-up (HTTP/2 settings, first use of a connection, the server's
    // first decision for the task) is not charged to the first scheduled decisions of an open
    // loop. A failure here is a setup failure (wrong task, wrong protocol, ...).
    let probe = Work {
        args: args.clone(),
        descriptors: descriptors.clone(),
    };
    let probe = Arc::new(probe);
    let mut flights = Vec::new();
    for (w, mut c) in conns.into_iter().enumerate() {
        let probe = probe.clone();
        let timeout = Duration::from_millis(args.timeout_ms);
        flights.push(tokio::spawn(async move {
            let o = tokio::time::timeout(timeout, probe.one(&mut c, w as u64)).await;
            (c, o)
        }));
    }
    let mut conns = Vec::with_capacity(flights.len());
    for f in flights {
        let (c, o) = f.await.context("a pre-flight request panicked")?;
        match o {
            Ok(Outcome::Err(e)) => bail!("--target {}: the first request failed: {e}", args.target),
            Err(_) => bail!(
                "--target {}: the first request timed out after {} ms",
                args.target,
                args.timeout_ms
            ),
            Ok(_) => conns.push(c),
        }
    }

    let t0 = Instant::now();
    let clock = Clock {
        t0,
        t0_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
            * 1000.0,
    };
    let measure_from = t0 + Duration::from_secs_f64(args.warmup_seconds);
    let deadline = measure_from + Duration::from_secs_f64(args.seconds);
    let pacer = (args.rate > 0.0).then(|| Arc::new(Semaphore::new(0)));
    let sh = Arc::new(Shared {
        work: Work {
            args: args.clone(),
            descriptors,
        },
        clock,
        measure_from,
        deadline,
        next: AtomicU64::new(0),
        pacer: pacer.clone(),
        stop: AtomicBool::new(false),
    });

    // The pacing thread: releases decision i once t0 + i/rate has passed.
    let pacer_thread = pacer.map(|sem| {
        let rate = args.rate;
        let max = args.max_decisions;
        std::thread::spawn(move || {
            let mut released: u64 = 0;
            loop {
                let now = Instant::now();
                let due = ((now.duration_since(t0).as_secs_f64() * rate) as u64 + 1).min(max);
                if due > released {
                    sem.add_permits((due - released) as usize);
                    released = due;
                }
                if now >= deadline || released >= max {
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            sem.close();
        })
    });

    let mut handles = Vec::new();
    for c in conns {
        handles.push(tokio::spawn(worker(sh.clone(), c)));
    }
    let mut total = Record::new();
    for h in handles {
        total.merge(h.await.context("a worker panicked")?);
    }
    if let Some(t) = pacer_thread {
        let _ = t.join();
    }
    let seconds = Instant::now()
        .saturating_duration_since(measure_from)
        .as_secs_f64();
    let decisions = total.ok + total.over + total.errors;
    let us = |q: f64| {
        if total.hist.is_empty() {
            0.0
        } else {
            (total.hist.value_at_quantile(q) as f64 / 100.0).round() / 10.0
        }
    };
    let per_window: Vec<serde_json::Value> = total
        .windows
        .iter()
        .map(|(s, (ok, over, before))| {
            serde_json::json!({"start_ms": s, "ok": ok, "over_limit": over, "ok_sent_before": before})
        })
        .collect();
    // The peers' histogram format (scripts/bench/peers/README.md): floor(log2(ns) · 16) → n.
    let mut lat_hist: BTreeMap<String, u64> = BTreeMap::new();
    for v in total.hist.iter_recorded() {
        let ns = v.value_iterated_to().max(1);
        let b = ((ns as f64).log2() * 16.0).floor() as u32;
        *lat_hist.entry(b.to_string()).or_insert(0) += v.count_since_last_iteration();
    }
    Ok(serde_json::json!({
        "target": args.target,
        "protocol": match target { Target::Grpc(_) => "grpc", Target::Http(..) => "http" },
        "connections": connections,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "decisions": decisions,
        "seconds": (seconds * 1000.0).round() / 1000.0,
        "decisions_per_s": (decisions as f64 / seconds.max(1e-9)).round(),
        "mean_us": if total.hist.is_empty() { 0.0 } else { (total.hist.mean() / 100.0).round() / 10.0 },
        "p50_us": us(0.5),
        "p90_us": us(0.9),
        "p99_us": us(0.99),
        "p999_us": us(0.999),
        "max_us": if total.hist.is_empty() { 0.0 } else { (total.hist.max() as f64 / 100.0).round() / 10.0 },
        "ok": total.ok,
        "over_limit": total.over,
        "errors": total.errors,
        "first_error": total.first_error,
        "window_ms": args.window_ms,
        "per_window": per_window,
        "lat_hist": lat_hist,
    }))
}

fn main() {
    let args = Args::parse();
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
    });
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rls_load: cannot start the runtime: {e}");
            std::process::exit(2);
        }
    };
    match rt.block_on(run(args)) {
        Ok(v) => {
            println!("{v}");
            let answered = v["ok"].as_u64().unwrap_or(0) + v["over_limit"].as_u64().unwrap_or(0);
            if answered == 0 {
                eprintln!(
                    "rls_load: no decision was answered (first error: {})",
                    v["first_error"]
                );
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("rls_load: {e:#}");
            std::process::exit(2);
        }
    }
}
