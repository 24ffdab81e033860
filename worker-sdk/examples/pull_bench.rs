//! Pull latency over one Redis link: the cost of TLS (docs/benchmarks.md, `scripts/bench-tls.sh`).
//!
//! ```text
//! cargo run --release -p sluice-sdk --example pull_bench -- --redis URL [--pulls N] [--connects M] \
//!     [--redis-ca F --redis-cert F --redis-key F --redis-user U --redis-password-file F]
//! ```
//!
//! Writes one slice (namespace `bench`, task `pull`, a one-hour slice with an unbounded cap),
//! then runs N PULL scripts of 1 permit one after the other on one multiplexed connection —
//! what the SDK's background thread does for a host — and M fresh connections (TCP, TLS
//! handshake, login, `PING`), what a client pays after Redis restarts. Prints one JSON line:
//! `{"pulls":N,"pull_us":{"p50":..,"p90":..,"p99":..,"mean":..},"connect_us":{...}}`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use sluice_protocol::conn::{ConnOptions, Redis, RedisSecurity, RedisTarget};
use sluice_protocol::scripts::{self, PullRequest};
use sluice_protocol::{Keys, slice};

#[derive(Debug, Parser)]
struct Args {
    /// Redis URL (`redis://` or `rediss://`).
    #[arg(long)]
    redis: String,
    /// Pulls to time.
    #[arg(long, default_value_t = 20_000)]
    pulls: u32,
    /// Fresh connections to time.
    #[arg(long, default_value_t = 200)]
    connects: u32,
    /// CA bundle (PEM).
    #[arg(long)]
    redis_ca: Option<PathBuf>,
    /// Client certificate (PEM).
    #[arg(long)]
    redis_cert: Option<PathBuf>,
    /// Client key (PEM).
    #[arg(long)]
    redis_key: Option<PathBuf>,
    /// ACL user.
    #[arg(long)]
    redis_user: Option<String>,
    /// Password file.
    #[arg(long)]
    redis_password_file: Option<PathBuf>,
}

fn summary(mut v: Vec<u64>) -> serde_json::Value {
    v.sort_unstable();
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
    serde_json::json!({"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": mean.round()})
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let a = Args::parse();
    sluice_protocol::tls::install_provider();
    let target = RedisTarget::parse(&a.redis)?;
    let security = RedisSecurity {
        ca_file: a.redis_ca.clone(),
        cert_file: a.redis_cert.clone(),
        key_file: a.redis_key.clone(),
        user: a.redis_user.clone(),
        password_file: a.redis_password_file.clone(),
        ..RedisSecurity::default()
    };
    let opts = ConnOptions {
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(2),
    };
    let open = || Redis::with_security(target.clone(), opts, &security).map_err(|e| e.to_string());
    let redis = open()?;
    redis.check().await.map_err(|e| e.to_string())?;
    let keys = Keys::new("bench").map_err(|e| e.to_string())?;
    let slice_ms = 3_600_000;
    let start = slice::start(sluice_protocol::unix_ms(), slice_ms);
    let mut c = redis.conn().await.map_err(|e| e.to_string())?;
    let key = keys.slice("pull", start);
    redis::cmd("HSET")
        .arg(&key)
        .arg(&["cap", "1000000000000", "rem", "1000000000000", "term", "1"][..])
        .query_async::<()>(&mut c)
        .await
        .map_err(|e| e.to_string())?;
    let mut pulls = Vec::with_capacity(a.pulls as usize);
    for i in 0..(a.pulls + 500) {
        let id = format!("b{i}");
        let req = PullRequest {
            task: "pull",
            start_ms: start,
            slice_ms,
            want: 1,
            host_id: "bench",
            request_id: &id,
            counters: None,
        };
        let t = Instant::now();
        scripts::pull(&mut c, &keys, &req)
            .await
            .map_err(|e| e.to_string())?;
        // The first 500 warm the connection and the script cache.
        if i >= 500 {
            pulls.push(t.elapsed().as_micros() as u64);
        }
    }
    let mut connects = Vec::with_capacity(a.connects as usize);
    for _ in 0..a.connects {
        let r = open()?;
        let t = Instant::now();
        r.check().await.map_err(|e| e.to_string())?;
        connects.push(t.elapsed().as_micros() as u64);
    }
    redis::cmd("DEL")
        .arg(&key)
        .query_async::<()>(&mut c)
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::json!({
            "target": target.to_string(),
            "pulls": a.pulls,
            "pull_us": summary(pulls),
            "connect_us": summary(connects),
        })
    );
    Ok(())
}
