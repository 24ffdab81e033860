//! Dynamic limiting closed loop: a load generator whose simulated backend serves 1,500 requests
//! per second (then 3,000) behind a task that starts at 5,000. The threshold must settle within
//! ±20 % of the capacity within 60 s with the backend's error rate under target, and follow the
//! capacity when it grows. The trajectory is written to `target/dynamic-trajectory.csv`
//! (`scripts/plot-dynamic.py` turns it into `docs/dynamic-trajectory.svg`).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use sluice_protocol::{Keys, slice, slice_field};
use sluice_tests::*;

const PHASE: Duration = Duration::from_secs(80);
const SETTLE: Duration = Duration::from_secs(60);

fn loadgen(ns: &str, capacity: u64) -> Loadgen {
    Loadgen::spawn(&loadgen_args(
        &shared_redis(),
        ns,
        "api",
        &format!("{ns}-h"),
        2,
        PHASE.as_millis() as u64,
        &[
            "--rate",
            "4000",
            "--backend-capacity",
            &capacity.to_string(),
        ],
    ))
}

/// Backend error rate over the slices ending in the last `secs` seconds (minus flush lag).
fn error_rate(conn: &mut redis::Connection, keys: &Keys, secs: i64) -> f64 {
    let until = now_ms() - 2_000;
    let mut pipe = redis::pipe();
    for s in slice::starts(until - secs * 1000, until, 1000) {
        pipe.cmd("HMGET")
            .arg(keys.slice("api", s))
            .arg(slice_field::OK)
            .arg(slice_field::ERR);
    }
    let rows: Vec<(Option<u64>, Option<u64>)> = pipe.query(conn).unwrap();
    let (ok, err) = rows.iter().fold((0, 0), |(o, e), (a, b)| {
        (o + a.unwrap_or(0), e + b.unwrap_or(0))
    });
    assert!(ok + err > 0, "no outcomes reported");
    err as f64 / (ok + err) as f64
}

struct Sample {
    t: f64,
    threshold: i64,
}

/// Polls the effective threshold once a second for a phase; returns the samples.
async fn record(
    m: &Manager,
    phase_start: Instant,
    offset: f64,
    csv: &mut String,
    capacity: u64,
) -> Vec<Sample> {
    let mut out = Vec::new();
    while phase_start.elapsed() < PHASE - Duration::from_secs(2) {
        if let Some(v) = m.get_json("/api/v1/tasks/api").await
            && let Some(th) = v["status"]["effective_threshold"].as_i64()
        {
            let t = phase_start.elapsed().as_secs_f64();
            writeln!(csv, "{:.1},{th},{capacity}", offset + t).unwrap();
            out.push(Sample { t, threshold: th });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    out
}

fn check_settled(samples: &[Sample], capacity: f64, what: &str) {
    let late: Vec<i64> = samples
        .iter()
        .filter(|s| s.t >= SETTLE.as_secs_f64())
        .map(|s| s.threshold)
        .collect();
    assert!(late.len() >= 10, "{what}: too few samples after {SETTLE:?}");
    for th in &late {
        assert!(
            (*th as f64 - capacity).abs() <= 0.2 * capacity,
            "{what}: threshold {th} outside ±20 % of {capacity} after {SETTLE:?}: {late:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_threshold_follows_the_backend_capacity() {
    let ns = unique_ns("loop");
    let keys = Keys::new(&ns).unwrap();
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    m.wait_leader().await;
    let spec = r#"{"threshold": 5000, "slice_ms": 1000, "dynamic": {"enabled": true,
        "min": 100, "max": 10000, "target_error_rate": 0.05, "target_latency_ms": 200}}"#;
    let (s, v) = m.put("/api/v1/tasks/api", spec).await;
    assert_eq!(s, 201, "{v}");
    m.wait_rolled("api").await;
    let _segments = SegmentGuard(vec![(ns.clone(), format!("{ns}-h"))]);
    let mut conn = redis_conn(&shared_redis());
    let mut csv = String::from("seconds,threshold,capacity\n");

    // Phase 1: capacity 1,500/s.
    let mut lg = loadgen(&ns, 1500);
    let t1 = Instant::now();
    let first = record(&m, t1, 0.0, &mut csv, 1500).await;
    let err1 = error_rate(&mut conn, &keys, 15);
    lg.wait_json(Duration::from_secs(30)).await;

    // Phase 2: capacity 3,000/s.
    let mut lg = loadgen(&ns, 3000);
    let t2 = Instant::now();
    let second = record(&m, t2, PHASE.as_secs_f64(), &mut csv, 3000).await;
    let err2 = error_rate(&mut conn, &keys, 15);
    lg.wait_json(Duration::from_secs(30)).await;

    let path = target_dir().join("dynamic-trajectory.csv");
    std::fs::write(&path, &csv).unwrap();
    eprintln!(
        "trajectory written to {}; error rates {err1:.3} / {err2:.3}",
        path.display()
    );
    let adj = m.get_json("/api/v1/tasks/api/adjustments").await.unwrap();
    eprintln!(
        "{} adjustments, newest: {}",
        adj["adjustments"].as_array().unwrap().len(),
        adj["adjustments"][0]
    );

    check_settled(&first, 1500.0, "capacity 1500");
    assert!(
        err1 < 0.05,
        "backend error rate {err1:.3} over the last 15 s of phase 1"
    );
    check_settled(&second, 3000.0, "capacity 3000");
    assert!(
        err2 < 0.05,
        "backend error rate {err2:.3} over the last 15 s of phase 2"
    );
    let min = first
        .iter()
        .chain(&second)
        .map(|s| s.threshold)
        .min()
        .unwrap();
    assert!(min >= 100, "never below min");
}
