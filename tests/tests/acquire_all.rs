//! Several limits per request, all or nothing (`sluice::acquire_all`), end to end: a real
//! manager and Redis, one simulated host whose `loadgen --all-with` processes ask a wide task
//! (300 per 1 s slice) and a narrow one (60) together, beside a plain loadgen on the wide task
//! sharing the same host segment.
//!
//! Run twice: the wide task plain pooled, then paced (a refund gives a permit its number back).
//!
//! What must hold, per full slice (globally decided admissions: the local fallback's left out):
//! * neither task admits more than its threshold — the wide task's permits that a refusal of
//!   the narrow one gave back went to the slice they came from, and only once;
//! * every answer is all or nothing (the load generator checks each answer against the
//!   decisions of its parts: `inconsistent` = 0);
//! * the given-back permits are not lost: the wide task, asked far more than its threshold,
//!   still admits ≥ 90 % of it, and the narrow one ≥ 90 % of its own.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use sluice_tests::*;

const WIDE: u64 = 300;
const NARROW: u64 = 60;
const SLICE_MS: i64 = 1_000;

/// `buckets` of a loadgen report (or of its `all_with`), their `fallback_buckets` left out.
fn global(report: &Value, buckets: &Value, fallback: &Value) -> BTreeMap<i64, (u64, u64)> {
    buckets
        .as_object()
        .unwrap_or_else(|| panic!("buckets in {report}"))
        .iter()
        .map(|(k, v)| {
            let fb = fallback[k].as_u64().unwrap_or(0);
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
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &unique_ns("all"), "m1")).await;
    // The wide task plain pooled, then paced (a refund gives a permit its number back). A
    // paced host's waiting `acquire_all` may lose most of what the pace releases to the plain
    // loop's `try_acquire` on the same host (no queue between them; seen: 113 of 1,494 in 5
    // slices), and then the narrow task is never asked past its limit: in the paced run the
    // narrow task's refusals are not required, and its use is judged in the slices where it
    // refused (as in both runs). (A plain run asking
    // less than the pace does not help: the all-or-nothing requests' brief holds of the
    // freshly released permits make its `try_acquire` refuse at the pace's edge, and the
    // demand that could spend the slice was only its cap: 255 of 300.)
    run(&m, &redis, "").await;
    run(&m, &redis, r#","pacing":"smooth""#).await;
}

async fn run(m: &Manager, redis: &str, pacing: &str) {
    let ns = m.opts.namespace.clone();
    let (wide, narrow) = if pacing.is_empty() {
        ("wide", "narrow")
    } else {
        ("wide-paced", "narrow-2")
    };
    for (task, threshold, pacing) in [(wide, WIDE, pacing), (narrow, NARROW, "")] {
        let (status, v) = m
            .put(
                &format!("/api/v1/tasks/{task}"),
                &format!(r#"{{"threshold":{threshold},"slice_ms":{SLICE_MS}{pacing}}}"#),
            )
            .await;
        assert!(status == 200 || status == 201, "{status} {v}");
        m.wait_rolled(task).await;
    }
    let host = format!("{ns}-{wide}");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let start_at = (now_ms() + 1_500).to_string();
    let common = ["--bucket-ms", "1000", "--start-at-ms", start_at.as_str()];
    let mut both = Loadgen::spawn(&loadgen_args(
        redis,
        &ns,
        wide,
        &host,
        2,
        5_000,
        &[&["--rate", "400", "--all-with", narrow], &common[..]].concat(),
    ));
    let mut plain = Loadgen::spawn(&loadgen_args(
        redis,
        &ns,
        wide,
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
    assert_eq!(all["task"], narrow, "{both}");
    assert_eq!(all["alone"], 0, "both tasks are plain pooled ones: {both}");
    // Every answer was all or nothing (the loadgen checks each answer against its parts).
    assert_eq!(all["inconsistent"], 0, "{both}");
    assert_eq!(both["admitted"], all["admitted"], "{both}");
    let narrow_refused = all["rejected"].as_u64().unwrap_or(0) > 0;
    assert!(
        narrow_refused || !pacing.is_empty(),
        "{narrow} never refused"
    );

    let wide_both = global(&both, &both["buckets"], &both["fallback_buckets"]);
    let narrow_c = global(&both, &all["buckets"], &all["fallback_buckets"]);
    let wide_plain = global(&plain, &plain["buckets"], &plain["fallback_buckets"]);
    let fell_back = |fb: &Value, b: i64| fb[b.to_string()].as_u64().unwrap_or(0) > 0;
    let mut slices: Vec<i64> = wide_plain.keys().copied().collect();
    slices.sort();
    // Full slices: not the first and last of the run.
    let full = &slices[1..slices.len().saturating_sub(1)];
    assert!(full.len() >= 3, "{slices:?}");
    let mut judged = 0;
    for s in full {
        let wb = wide_both.get(s).map_or(0, |c| c.0);
        let w = wb + wide_plain.get(s).map_or(0, |c| c.0);
        let n = narrow_c.get(s).map_or(0, |c| c.0);
        eprintln!("{wide}: slice {s}: {w} admitted ({wb} with {narrow}); {narrow}: {n}");
        assert!(w <= WIDE, "slice {s}: {wide} admitted {w} > {WIDE}");
        assert!(n <= NARROW, "slice {s}: {narrow} admitted {n} > {NARROW}");
        // Utilisation says something where no pull failed (no fallback admission).
        if [
            &both["fallback_buckets"],
            &plain["fallback_buckets"],
            &all["fallback_buckets"],
        ]
        .iter()
        .any(|fb| fell_back(fb, *s))
        {
            continue;
        }
        judged += 1;
        assert!(
            w >= WIDE * 9 / 10,
            "slice {s}: {wide} admitted only {w} of {WIDE}"
        );
        // The narrow task's use says something where it was asked past its limit (it refused).
        let pressed = narrow_c.get(s).is_some_and(|c| c.1 > 0);
        assert!(
            n >= NARROW * 9 / 10 || !pressed,
            "slice {s}: {narrow} admitted only {n} of {NARROW}"
        );
    }
    assert!(
        judged >= 1,
        "every full slice had a fallback admission: no pull worked"
    );
}
