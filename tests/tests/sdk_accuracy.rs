//! Accuracy of the pooled design end to end: 2 hosts × 4 processes (the `loadgen` example)
//! share one threshold of 2,000 per 1 s slice through a real manager and Redis, with demand
//! 8× the threshold, for 10 s.
//!
//! Every slice's admitted sum over both hosts must be ≤ 2,000 (never over-admit) and ≥ 1,900
//! for every full slice (≥ 95 % utilisation); the admitted counts the SDK flushed into the
//! slice hashes must match what the load generators saw; and the Redis calls per admitted
//! decision must stay ≤ 0.05.

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_tests::*;

const THRESHOLD: u64 = 2_000;
const SLICE_MS: i64 = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_share_one_threshold_without_over_admission() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("sdkacc");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    let (status, body) = m
        .put(
            "/api/v1/tasks/acc",
            r#"{"threshold":2000,"slice_ms":1000,"local_limit":300,"on_failure":"local"}"#,
        )
        .await;
    assert!(status == 200 || status == 201, "{status} {body}");
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);
    wait_until(
        "slices written",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let now = sluice_protocol::unix_ms();
            let key = keys.slice("acc", sluice_protocol::slice::start(now + 2_000, 1_000));
            let exists: bool = redis::cmd("EXISTS").arg(&key).query(&mut conn).unwrap();
            async move { exists.then_some(()) }
        },
    )
    .await;

    let hosts: Vec<String> = (0..2).map(|i| format!("{ns}-h{i}")).collect();
    let mut runs: Vec<Loadgen> = hosts
        .iter()
        .map(|h| {
            Loadgen::spawn(&loadgen_args(
                &redis,
                &ns,
                "acc",
                h,
                4,
                10_000,
                &["--rate", "2000", "--bucket-ms", &SLICE_MS.to_string()],
            ))
        })
        .collect();
    let mut reports = Vec::new();
    for r in &mut runs {
        reports.push(r.wait_json(Duration::from_secs(90)).await);
    }
    for h in &hosts {
        remove_segment(&ns, h);
    }

    // Sum the hosts' buckets (a bucket is exactly a slice: decisions are bucketed by the
    // slice clock they were decided at).
    let mut sum: BTreeMap<i64, (u64, u64)> = BTreeMap::new();
    for r in &reports {
        for (k, (a, rj)) in loadgen_buckets(r) {
            let e = sum.entry(k).or_default();
            e.0 += a;
            e.1 += rj;
        }
    }
    let first = *sum.keys().next().expect("no buckets");
    let last = *sum.keys().last().unwrap();
    let full: Vec<i64> = sum
        .keys()
        .copied()
        .filter(|k| *k != first && *k != last)
        .collect();
    eprintln!("per-slice admitted (both hosts): {sum:?}");
    assert!(full.len() >= 8, "expected ≥ 8 full slices, got {full:?}");
    for (k, (a, _)) in &sum {
        assert!(
            *a <= THRESHOLD,
            "slice {k} over-admitted: {a} > {THRESHOLD}"
        );
    }
    for k in &full {
        let a = sum[k].0;
        assert!(
            a >= THRESHOLD * 95 / 100,
            "slice {k} under-used: {a} < 1900"
        );
    }

    // What the manager sees: the admitted counts flushed into the slice hashes.
    for k in &full {
        let adm: Option<u64> = redis::cmd("HGET")
            .arg(keys.slice("acc", *k))
            .arg("adm")
            .query(&mut conn)
            .unwrap();
        assert_eq!(
            adm,
            Some(sum[k].0),
            "slice {k}: flushed adm differs from the load generators' count"
        );
    }

    let admitted: u64 = reports
        .iter()
        .map(|r| r["admitted"].as_u64().unwrap())
        .sum();
    let calls: u64 = reports
        .iter()
        .map(|r| r["redis_calls"].as_u64().unwrap())
        .sum();
    let fallback: u64 = reports
        .iter()
        .map(|r| r["fallback_admitted"].as_u64().unwrap())
        .sum();
    let ratio = calls as f64 / admitted as f64;
    eprintln!("admitted {admitted}, redis calls {calls}, calls per admitted {ratio:.4}");
    assert_eq!(
        fallback, 0,
        "no decision may fall back while Redis is healthy"
    );
    assert!(
        ratio <= 0.05,
        "Redis calls per admitted decision {ratio:.4} > 0.05"
    );
}
