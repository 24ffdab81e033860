//! The soak's agent host driver: one simulated host's demand for one task, decided by a
//! `sluice-agent` over Envoy RLS v3 (`ShouldRateLimit`) or HTTP (`POST /v1/decide`) instead of
//! an in-process SDK, counted in the same `--progress` lines the `loadgen` example writes
//! (worker-sdk/examples/loadgen.rs, "Progress"), so the soak's per-slice ledger, safety and
//! liveness checks cover the agent's decisions (docs/soak.md, "Agent hosts").
//!
//! ```text
//! agent_host --api rls|http --grpc ADDR --http ADDR --host H --task T --rate R
//!            --duration-ms MS --progress FILE [--domain D --descriptor k=v[,k=v]]
//! ```
//!
//! * Open loop at `--rate` decisions/s (decision `i` due at `t0 + i / R`), at most 64 in flight
//!   (a due decision beyond that is skipped: not counted at all); each request times out after
//!   2 s (an error: not counted).
//! * RLS: domain `--domain` (default `soak`) and one descriptor: `--descriptor` if given, else
//!   the direct form `sluice_task = T`. HTTP: `{"task": T}`.
//! * **Bucketing.** The agent decides at some instant between the request's send `s` and its
//!   answer's arrival `r` on the same clock (no faketime on agent hosts), and the slice it
//!   charges is the one that holds that instant. Slice lengths are multiples of the 100 ms
//!   bucket, so when `s` and `r` fall in one bucket the charged slice is known exactly: the
//!   decision is counted in that bucket. When they straddle a bucket edge the slice is not
//!   known: an admission is counted in the bucket of `r` as **`fb`** (admitted outside what
//!   the per-slice bound covers), so the safety sum never attributes it to a wrong slice. The
//!   straddlers are few (a round trip of about a millisecond per 100 ms bucket; more while
//!   a decision waits for a refill).
//! * **What is `fb`** (admitted, not by the slice's global quota): HTTP `fallback_allowed`, an
//!   `allowed` with `shadow_limited`; RLS `OK` without `current_limit` (no task: a deleted task
//!   or domain, an `unlimited` node) and — RLS answers do not say whether the task's
//!   `on_failure` decided — every admission in a bucket within 200 ms of a scrape of the
//!   agent's `/metrics` that saw `sluice_agent_decisions_total{api="rls",
//!   decision="fallback_allowed"}` grow (or reset: a restarted agent). Rejected: HTTP
//!   `limited`, `fallback_denied`; RLS `OVER_LIMIT`. Anything else (404, 503, transport
//!   errors while the agent is down) is an error, counted in neither.
//! * Progress: one line per closed bucket (closed 400 ms after its end: the answers are in and
//!   the metrics scrapes that cover it are done), `{"host", "task", "bucket", "adm", "rej",
//!   "fb", "nolim", "lmin", "lmax", "strad"}` (`nolim`: OK answers without a limit, part of
//!   `fb`; `lmin`/`lmax`: the smallest and largest `current_limit.requests_per_unit` seen, -1
//!   none; `strad`: admissions counted `fb` for straddling).
//! * Ends after `--duration-ms` or at SIGTERM: every bucket flushed, one JSON line
//!   `{"admitted", "rejected", "fallback", "errors", "skipped", "first_error"}` on stdout,
//!   exit 0. Exit 2: bad usage.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use serde_json::{Value, json};
use tonic::transport::Channel;

const BUCKET_MS: i64 = 100;
const MAX_IN_FLIGHT: usize = 64;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A bucket is written this long after its end.
const CLOSE_AFTER_MS: i64 = 400;
/// Buckets within this of a scrape interval that saw RLS fallback admissions are tainted.
const TAINT_MARGIN_MS: i64 = 200;

#[derive(Debug, Clone)]
struct Args {
    api: String,
    grpc: String,
    http: String,
    host: String,
    task: String,
    rate: f64,
    duration_ms: u64,
    progress: String,
    domain: String,
    descriptor: Vec<(String, String)>,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        api: String::new(),
        grpc: String::new(),
        http: String::new(),
        host: String::new(),
        task: String::new(),
        rate: 0.0,
        duration_ms: 0,
        progress: String::new(),
        domain: "soak".into(),
        descriptor: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--api" => a.api = v()?,
            "--grpc" => a.grpc = v()?,
            "--http" => a.http = v()?,
            "--host" => a.host = v()?,
            "--task" => a.task = v()?,
            "--rate" => {
                a.rate = v()?
                    .parse()
                    .map_err(|_| "--rate: not a number".to_string())?
            }
            "--duration-ms" => {
                a.duration_ms = v()?
                    .parse()
                    .map_err(|_| "--duration-ms: not a number".to_string())?
            }
            "--progress" => a.progress = v()?,
            "--domain" => a.domain = v()?,
            "--descriptor" => {
                for kv in v()?.split(',') {
                    let (k, v) = kv
                        .split_once('=')
                        .ok_or(format!("--descriptor: {kv:?} is not key=value"))?;
                    a.descriptor.push((k.to_string(), v.to_string()));
                }
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.api != "rls" && a.api != "http" {
        return Err("--api must be rls or http".into());
    }
    if a.task.is_empty() || a.progress.is_empty() {
        return Err("--task and --progress are required".into());
    }
    if !(a.rate > 0.0 && a.rate <= 100_000.0) {
        return Err("--rate must be in (0, 100000]".into());
    }
    if (a.api == "rls" && a.grpc.is_empty()) || a.http.is_empty() {
        return Err("--http (and --grpc for rls) are required".into());
    }
    Ok(a)
}

/// One bucket's counts.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    adm: u64,
    rej: u64,
    fb: u64,
    nolim: u64,
    strad: u64,
    lmin: Option<u64>,
    lmax: Option<u64>,
}

/// What one answer said.
enum Outcome {
    /// Admitted; `outside`: not by the slice's global quota; `limit`: the RLS limit stated.
    Admitted {
        outside: bool,
        nolim: bool,
        limit: Option<u64>,
    },
    Rejected {
        limit: Option<u64>,
    },
    Error(String),
}

#[derive(Default)]
struct Shared {
    buckets: BTreeMap<i64, Counts>,
    /// Intervals `[from, to]` in which the agent's RLS fallback admissions grew.
    taint: Vec<(i64, i64)>,
    /// RLS: start of the last scrape that answered (it covers every answer before it); a
    /// bucket is closed only once a scrape covers it (or 2 s after its end).
    scraped_until: Option<i64>,
    admitted: u64,
    rejected: u64,
    fallback: u64,
    errors: u64,
    skipped: u64,
    first_error: Option<String>,
    /// Per bucket: admitted straddlers in flight during it and counted in another.
    reach: BTreeMap<i64, u64>,
    /// Answer latencies, ms (at most 100,000 kept).
    lat: Vec<u32>,
}

impl Shared {
    fn record(&mut self, sent: i64, got: i64, o: Outcome) {
        let b = got.div_euclid(BUCKET_MS) * BUCKET_MS;
        let straddle = sent.div_euclid(BUCKET_MS) != got.div_euclid(BUCKET_MS);
        if self.lat.len() < 100_000 {
            self.lat.push((got - sent).clamp(0, u32::MAX as i64) as u32);
        }
        let note_limit = |c: &mut Counts, l: Option<u64>| {
            if let Some(l) = l {
                c.lmin = Some(c.lmin.map_or(l, |m| m.min(l)));
                c.lmax = Some(c.lmax.map_or(l, |m| m.max(l)));
            }
        };
        match o {
            Outcome::Admitted {
                outside,
                nolim,
                limit,
            } => {
                let c = self.buckets.entry(b).or_default();
                c.adm += 1;
                self.admitted += 1;
                if outside || straddle {
                    c.fb += 1;
                }
                if outside {
                    self.fallback += 1;
                }
                if nolim {
                    c.nolim += 1;
                }
                if straddle && !outside {
                    c.strad += 1;
                    let mut x = sent.div_euclid(BUCKET_MS) * BUCKET_MS;
                    while x < b {
                        *self.reach.entry(x).or_default() += 1;
                        x += BUCKET_MS;
                    }
                }
                note_limit(c, limit);
            }
            Outcome::Rejected { limit } => {
                let c = self.buckets.entry(b).or_default();
                c.rej += 1;
                self.rejected += 1;
                note_limit(c, limit);
            }
            Outcome::Error(e) => {
                self.errors += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    /// Writes the buckets that ended `CLOSE_AFTER_MS` before `now` (all with `now` None).
    fn flush(&mut self, now: Option<i64>, args: &Args, out: &mut File) {
        let keep = match now {
            Some(n) => {
                let mut upto = n - CLOSE_AFTER_MS - BUCKET_MS + 1;
                if let Some(s) = self.scraped_until {
                    upto = upto.min((s - TAINT_MARGIN_MS - BUCKET_MS + 1).max(n - 2_000));
                }
                self.buckets.split_off(&upto)
            }
            None => BTreeMap::new(),
        };
        let done = std::mem::replace(&mut self.buckets, keep);
        let mut text = String::new();
        for (b, mut c) in done {
            let tainted = self
                .taint
                .iter()
                .any(|(f, t)| *f - TAINT_MARGIN_MS < b + BUCKET_MS && b < *t + TAINT_MARGIN_MS);
            if tainted {
                c.fb = c.adm;
                c.strad = 0;
            }
            let line = json!({
                "host": args.host, "child": 0, "task": args.task, "bucket": b,
                "adm": c.adm, "rej": c.rej, "fb": c.fb, "nolim": c.nolim, "strad": c.strad,
                "lmin": c.lmin.map_or(-1, |v| v as i64), "lmax": c.lmax.map_or(-1, |v| v as i64),
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        // Reach of buckets written before (a late answer): lines of their own (the soak adds
        // lines of one bucket up). Only for buckets already closed, so a bucket's own line
        // carries the rest.
        let closed_before = self
            .buckets
            .keys()
            .next()
            .copied()
            .unwrap_or(i64::MAX)
            .min(now.unwrap_or(i64::MAX));
        let late = match now {
            Some(_) => {
                let keep = self.reach.split_off(&closed_before);
                std::mem::replace(&mut self.reach, keep)
            }
            None => std::mem::take(&mut self.reach),
        };
        for (b, n) in late {
            let line = json!({
                "host": args.host, "child": 0, "task": args.task, "bucket": b,
                "adm": 0, "rej": 0, "fb": 0, "reach": n,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        if let Some(n) = now {
            self.taint.retain(|(_, t)| *t > n - 10_000);
        }
        if !text.is_empty() {
            // One write per flush on an O_APPEND descriptor: whole lines only.
            let _ = out.write_all(text.as_bytes());
        }
    }
}

/// `sluice_agent_decisions_total{api="rls",decision="fallback_allowed"}` of a scrape.
fn rls_fallbacks(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("sluice_agent_decisions_total")
                && l.contains("api=\"rls\"")
                && l.contains("decision=\"fallback_allowed\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

async fn decide_rls(mut client: RateLimitServiceClient<Channel>, req: RateLimitRequest) -> Outcome {
    match tokio::time::timeout(REQUEST_TIMEOUT, client.should_rate_limit(req)).await {
        Err(_) => Outcome::Error("rls: timeout".into()),
        Ok(Err(s)) => Outcome::Error(format!("rls: {:?} {}", s.code(), s.message())),
        Ok(Ok(r)) => {
            let r = r.into_inner();
            let st = r.statuses.first();
            let limit = st
                .and_then(|s| s.current_limit.as_ref())
                .map(|l| u64::from(l.requests_per_unit));
            if r.overall_code == Code::OverLimit as i32 {
                Outcome::Rejected { limit }
            } else if r.overall_code == Code::Ok as i32 {
                Outcome::Admitted {
                    outside: limit.is_none(),
                    nolim: limit.is_none(),
                    limit,
                }
            } else {
                Outcome::Error(format!("rls: overall_code {}", r.overall_code))
            }
        }
    }
}

async fn decide_http(client: reqwest::Client, url: String, body: Value) -> Outcome {
    let r = client
        .post(&url)
        .timeout(REQUEST_TIMEOUT)
        .json(&body)
        .send()
        .await;
    let r = match r {
        Ok(r) => r,
        Err(e) => return Outcome::Error(format!("http: {e}")),
    };
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    if status != 200 {
        return Outcome::Error(format!("http: {status} {v}"));
    }
    let shadow = v["shadow_limited"].as_bool() == Some(true);
    match v["decision"].as_str() {
        Some("allowed") => Outcome::Admitted {
            outside: shadow,
            nolim: false,
            limit: None,
        },
        Some("fallback_allowed") => Outcome::Admitted {
            outside: true,
            nolim: false,
            limit: None,
        },
        Some("limited") | Some("fallback_denied") => Outcome::Rejected { limit: None },
        _ => Outcome::Error(format!("http: unexpected answer {v}")),
    }
}

async fn run(args: Args) -> Value {
    let mut out = File::options()
        .create(true)
        .append(true)
        .open(&args.progress)
        .unwrap_or_else(|e| {
            eprintln!("agent_host: progress file {}: {e}", args.progress);
            std::process::exit(2);
        });
    // SIGTERM is a clean end from the start on.
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal");
    let shared = Arc::new(Mutex::new(Shared::default()));
    // reqwest is built without a default rustls provider: ring, as everywhere.
    sluice_protocol::tls::install_provider();
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(MAX_IN_FLIGHT)
        .build()
        .expect("http client");
    let rls = if args.api == "rls" {
        let ch = Channel::from_shared(format!("http://{}", args.grpc))
            .map_err(|e| e.to_string())
            .map(|e| e.connect_timeout(Duration::from_millis(500)).connect_lazy());
        match ch {
            Ok(ch) => Some(RateLimitServiceClient::new(ch)),
            Err(e) => {
                eprintln!("agent_host: --grpc {}: {e}", args.grpc);
                std::process::exit(2);
            }
        }
    } else {
        None
    };
    let entries: Vec<Entry> = if args.descriptor.is_empty() {
        vec![Entry {
            key: "sluice_task".into(),
            value: args.task.clone(),
        }]
    } else {
        args.descriptor
            .iter()
            .map(|(k, v)| Entry {
                key: k.clone(),
                value: v.clone(),
            })
            .collect()
    };
    let req = RateLimitRequest {
        domain: args.domain.clone(),
        descriptors: vec![RateLimitDescriptor {
            entries,
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let url = format!("http://{}/v1/decide", args.http);
    let body = json!({ "task": args.task });

    // The metrics scraper (RLS only): taints the intervals in which fallback admissions grew.
    if args.api == "rls" {
        let sh = shared.clone();
        let metrics_url = format!("http://{}/metrics", args.http);
        let client = http.clone();
        tokio::spawn(async move {
            let mut last: Option<(i64, u64)> = None;
            // The first scrape is the baseline (the counter counts since the agent started).
            let mut first = true;
            loop {
                let t0 = now_ms();
                let r = client
                    .get(&metrics_url)
                    .timeout(Duration::from_millis(500))
                    .send()
                    .await;
                let text = match r {
                    Ok(r) => r.text().await.ok(),
                    Err(_) => None,
                };
                let t1 = now_ms();
                if let Some(text) = text {
                    let n = rls_fallbacks(&text);
                    match last {
                        // Grew (or the agent restarted and counts again).
                        Some((at, prev)) if n > prev || (n < prev && n > 0) => {
                            sh.lock().unwrap().taint.push((at, t1));
                        }
                        None if n > 0 && !first => sh.lock().unwrap().taint.push((t0 - 1_000, t1)),
                        _ => {}
                    }
                    first = false;
                    last = Some((t0, n));
                    sh.lock().unwrap().scraped_until = Some(t0);
                } else {
                    // The agent does not answer: whatever it decided meanwhile is unknown.
                    last = None;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }

    // RLS: the baseline scrape first (at most 2 s: the agent may be down).
    if args.api == "rls" {
        let t = Instant::now();
        while shared.lock().unwrap().scraped_until.is_none() && t.elapsed() < Duration::from_secs(2)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let sem = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let start = Instant::now();
    let end = start + Duration::from_millis(args.duration_ms);
    let mut i: u64 = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let mut last_flush = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = term.recv() => break,
        }
        let now = Instant::now();
        if now >= end {
            break;
        }
        let due = (now.duration_since(start).as_secs_f64() * args.rate) as u64;
        while i < due {
            i += 1;
            let Ok(permit) = sem.clone().try_acquire_owned() else {
                shared.lock().unwrap().skipped += 1;
                continue;
            };
            let sh = shared.clone();
            let sent = now_ms();
            match &rls {
                Some(c) => {
                    let (c, req) = (c.clone(), req.clone());
                    tokio::spawn(async move {
                        let o = decide_rls(c, req).await;
                        sh.lock().unwrap().record(sent, now_ms(), o);
                        drop(permit);
                    });
                }
                None => {
                    let (c, url, body) = (http.clone(), url.clone(), body.clone());
                    tokio::spawn(async move {
                        let o = decide_http(c, url, body).await;
                        sh.lock().unwrap().record(sent, now_ms(), o);
                        drop(permit);
                    });
                }
            }
        }
        if last_flush.elapsed() >= Duration::from_millis(100) {
            last_flush = Instant::now();
            shared
                .lock()
                .unwrap()
                .flush(Some(now_ms()), &args, &mut out);
        }
    }
    // Answers in flight: wait for them (each times out), then flush everything.
    let _ = tokio::time::timeout(
        REQUEST_TIMEOUT + Duration::from_millis(200),
        sem.acquire_many(MAX_IN_FLIGHT as u32),
    )
    .await;
    let mut s = shared.lock().unwrap();
    s.flush(None, &args, &mut out);
    s.lat.sort_unstable();
    let pct = |p: f64| {
        s.lat
            .get(((s.lat.len() as f64 * p) as usize).min(s.lat.len().saturating_sub(1)))
            .copied()
    };
    let (p50, p99) = (pct(0.5), pct(0.99));
    json!({
        "latency_ms_p50": p50, "latency_ms_p99": p99,
        "admitted": s.admitted, "rejected": s.rejected, "fallback": s.fallback,
        "errors": s.errors, "skipped": s.skipped, "first_error": s.first_error,
    })
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("agent_host: {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let v = rt.block_on(run(args));
    println!("{v}");
}
