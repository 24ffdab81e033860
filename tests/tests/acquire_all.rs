//! Several limits per request, all or nothing (`sluice::acquire_all`), end to end: a real
//! manager and Redis, one simulated host whose `loadgen --all-with` processes ask a wide task
//! (300 per 1 s slice) and a narrow one (60) together, beside a plain loadgen on the wide task
//! sharing the same host segment.
//!
//! What must hold, per full slice (globally decided admissions: the local fallback's left out):
//! * neither task admits more than its threshold — the wide task's permits that a refusal of
//!   the narrow one gave back went to the slice they came from, and only once;
//! * every admitted decision admitted both (the two reports' totals are equal);
//! * the given-back permits are not lost: the wide task, asked far more than its threshold,
//!   still admits ≥ 90 % of it, and the narrow one ≥ 90 % of its own.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use sluice_tests::*;

const WIDE: u64 = 300;
const NARROW: u64 = 60;
const SLICE_MS: i64 = 1_000;

/// `buckets` of a loadgen report (or of its `all_with`), the fallback-admitted part left out
/// where the report says it (the main task's `fallback_buckets`).
fn global(report: &Value, buckets: &Value, fallback: bool) -> BTreeMap<i64, (u64, u64)> {
    buckets
        .as_object()
        .expect("buckets")
        .iter()
        .map(|(k, v)| {
            let fb = if fallback {
                report["fallback_buckets"][k].as_u64().unwrap_or(0)
            } else {
                0
            };
            (
                k.parse().expect("bucket key"),
                (
                    v[0].as_u64().unwrap_or(0).saturating_sub(fb),
                    v[1].as_u64().unwrap_or(0),
                ),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_all_admits_both_or_neither_and_gives_back_to_the_right_slice() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("all");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    for (task, threshold) in [("wide", WIDE), ("narrow", NARROW)] {
        let (status, v) = m
            .put(
                &format!("/api/v1/tasks/{task}"),
                &format!(r#"{{"threshold":{threshold},"slice_ms":{SLICE_MS}}}"#),
            )
            .await;
        assert!(status == 200 || status == 201, "{status} {v}");
        m.wait_rolled(task).await;
    }
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let start_at = (now_ms() + 1_500).to_string();
    let common = ["--bucket-ms", "1000", "--start-at-ms", start_at.as_str()];
    let mut both = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "wide",
        &host,
        2,
        5_000,
        &[&["--rate", "400", "--all-with", "narrow"], &common[..]].concat(),
    ));
    let mut plain = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "wide",
        &host,
        1,
        5_000,
        &[&["--rate", "600"], &common[..]].concat(),
    ));
    let both = both.wait_json(Duration::from_secs(60)).await;
    let plain = plain.wait_json(Duration::from_secs(60)).await;
    let all = &both["all_with"];
    eprintln!(
        "all-with: wide admitted {} rejected {}; narrow admitted {} rejected {}; cancelled {}, \
         alone {}; plain wide: admitted {} rejected {}",
        both["admitted"],
        both["rejected"],
        all["admitted"],
        all["rejected"],
        all["cancelled"],
        all["alone"],
        plain["admitted"],
        plain["rejected"]
    );
    assert_eq!(all["task"], "narrow", "{both}");
    assert_eq!(all["alone"], 0, "both tasks are plain pooled ones: {both}");
    // Every admitted decision admitted both parts.
    assert_eq!(both["admitted"], all["admitted"], "{both}");
    assert!(
        all["rejected"].as_u64().unwrap() > 0,
        "narrow never refused"
    );

    let wide_both = global(&both, &both["buckets"], true);
    let narrow = global(&both, &all["buckets"], false);
    let wide_plain = global(&plain, &plain["buckets"], true);
    let fell_back =
        |r: &Value, b: i64| r["fallback_buckets"][b.to_string()].as_u64().unwrap_or(0) > 0;
    let mut slices: Vec<i64> = wide_plain.keys().copied().collect();
    slices.sort();
    // Full slices: not the first and last of the run.
    let full = &slices[1..slices.len().saturating_sub(1)];
    assert!(full.len() >= 3, "{slices:?}");
    for s in full {
        let w = wide_both.get(s).map_or(0, |c| c.0) + wide_plain.get(s).map_or(0, |c| c.0);
        let n = narrow.get(s).map_or(0, |c| c.0);
        eprintln!(
            "slice {s}: wide {w} (of which with narrow {}), narrow {n}",
            wide_both.get(s).map_or(0, |c| c.0)
        );
        assert!(w <= WIDE, "slice {s}: wide admitted {w} > {WIDE}");
        assert!(n <= NARROW, "slice {s}: narrow admitted {n} > {NARROW}");
        // Utilisation says something where no pull failed (no fallback admission).
        if !fell_back(&both, *s) && !fell_back(&plain, *s) {
            assert!(
                w >= WIDE * 9 / 10,
                "slice {s}: wide admitted only {w} of {WIDE}"
            );
            assert!(
                n >= NARROW * 9 / 10,
                "slice {s}: narrow admitted only {n} of {NARROW}"
            );
        }
    }
}
