//! Paced slices end to end (`"pacing": "smooth"`): a real manager and Redis, one simulated
//! host of two `loadgen` processes sharing its segment, demand 100× a 1 s slice of 1,000.
//!
//! With pacing, a slice releases its quota evenly (plus `burst` at its start), decided in the
//! pull script on Redis time, and the SDK spends its local stock no faster than that pace. So
//! by the end of every 100 ms window (the loadgen's buckets, aligned with the slices, each
//! decision stamped with the instant it was charged) the slice has admitted at most its pace
//! then + burst, merged over both processes; the first 100 ms of a slice at most 100 + burst;
//! and the slice is still used (≥ 90 % of every full slice admitted). Without pacing the same
//! demand would spend each slice in its first milliseconds.
//!
//! The tight bound is cumulative, as docs/sdk.md ("Paced slices") states it: a host that fell
//! behind the pace (its process descheduled on a loaded machine) keeps the stock numbered below
//! the pace and spends it at once when it runs again, so one window may admit more than 100 +
//! burst (seen in CI on a loaded machine: 102, 103) while the slice stays on its pace curve.
//! A single window is held to the looser bound of [`window_bound`].

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_tests::*;

const THRESHOLD: u64 = 1_000;
const SLICE_MS: i64 = 1_000;
const WINDOW_MS: i64 = 100;

/// What one run admitted: per 100 ms bucket, the globally decided admissions (the local
/// fallback's left out), and the slices in which the local fallback admitted anything.
struct Run {
    buckets: BTreeMap<i64, u64>,
    fallback_slices: std::collections::BTreeSet<i64>,
}

/// Runs one host × 2 processes against `task` for `ms` at 50,000/s per process (100× the
/// pace).
async fn run(redis: &str, ns: &str, task: &str, ms: u64) -> Run {
    let host = format!("{ns}-{task}");
    let _seg = SegmentGuard(vec![(ns.to_string(), host.clone())]);
    let mut lg = Loadgen::spawn(&loadgen_args(
        redis,
        ns,
        task,
        &host,
        2,
        ms,
        &["--rate", "50000", "--bucket-ms", &WINDOW_MS.to_string()],
    ));
    let report = lg.wait_json(Duration::from_secs(60)).await;
    let decisions = report["admitted"].as_u64().unwrap() + report["rejected"].as_u64().unwrap();
    eprintln!(
        "{task}: admitted {} rejected {} ({decisions} decisions; {} admitted by the local \
         fallback), redis calls {}",
        report["admitted"], report["rejected"], report["fallback_admitted"], report["redis_calls"]
    );
    // The pace governs what Redis granted: a fallback admission (a pull that timed out on a
    // stalled machine sends the task to `on_failure: local`) is not the pace's.
    let fallback = |k: i64| {
        report["fallback_buckets"][k.to_string()]
            .as_u64()
            .unwrap_or(0)
    };
    let buckets = loadgen_buckets(&report);
    Run {
        fallback_slices: buckets
            .keys()
            .filter(|k| fallback(**k) > 0)
            .map(|k| k - k.rem_euclid(SLICE_MS))
            .collect(),
        buckets: buckets
            .into_iter()
            .map(|(k, (a, _))| (k, a.saturating_sub(fallback(k))))
            .collect(),
    }
}

/// The slices whose every 100 ms bucket the run covered (not its first and last slice).
fn full_slices(buckets: &BTreeMap<i64, u64>) -> Vec<i64> {
    let slices: Vec<i64> = buckets
        .keys()
        .map(|b| b - b.rem_euclid(SLICE_MS))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    slices[1..slices.len().saturating_sub(1)].to_vec()
}

/// What one host may admit in one 100 ms window (docs/sdk.md, "Paced slices"): what the pace
/// releases in it + `burst` + the look-ahead `ahead = cap / 40` the pull script grants beyond
/// the pace (PACE_LUA: a pull forfeits what the pace released and nobody took, so a host that
/// fell behind is granted at most `ahead + burst` past the pace), plus the stock it held when
/// the window began: at most its low-water mark (`ahead / 2`, `pull::paced`) + `ahead + burst`.
/// Without the forfeit, a host descheduled for half a slice would admit half a slice at once.
fn window_bound(burst: u64) -> u64 {
    let ahead = THRESHOLD * (SLICE_MS as u64 / 40) / SLICE_MS as u64;
    THRESHOLD / 10 + 2 * (ahead + burst) + ahead / 2
}

fn check(task: &str, run: &Run, burst: u64) {
    let buckets = &run.buckets;
    eprintln!("{task}: admitted per 100 ms bucket: {buckets:?}");
    let max = buckets.values().max().copied().unwrap_or(0);
    eprintln!(
        "{task}: largest 100 ms window {max} (100 + burst = {})",
        THRESHOLD / 10 + burst
    );
    for (b, a) in buckets {
        assert!(
            *a <= window_bound(burst),
            "{task}: window {b} admitted {a} > {} (100 + 2 × (look-ahead + burst) + low water)",
            window_bound(burst)
        );
    }
    let full = full_slices(buckets);
    // On the pace curve: by each window's end, the slice's admissions so far ≤ its pace + burst.
    // Exact, no slack: a decision is stamped with the very `now_us` its pace check used
    // (`try_acquire_stamped`; paced tasks never take the fast path), each admitted permit has
    // its own number `≤ floor(cap · elapsed / len) + burst` at that instant, and a decision in
    // a window ending at `E` was made before `E`.
    for s in &full {
        let mut so_far = 0;
        for (b, a) in buckets.range(*s..*s + SLICE_MS) {
            so_far += a;
            let end = b + WINDOW_MS - s;
            let paced = THRESHOLD * end as u64 / SLICE_MS as u64;
            assert!(
                so_far <= paced + burst,
                "{task}: slice {s} admitted {so_far} by {end} ms > the pace's {paced} + burst \
                 {burst}"
            );
        }
    }
    assert!(full.len() >= 3, "{task}: too few full slices: {full:?}");
    let mut judged = 0;
    for s in &full {
        let used: u64 = buckets.range(*s..*s + SLICE_MS).map(|(_, a)| a).sum();
        assert!(used <= THRESHOLD, "{task}: slice {s} over-admitted {used}");
        // Utilisation says something only where no pull failed: a slice in which the local
        // fallback admitted (a pull timed out on a stalled machine) is left out.
        if !run.fallback_slices.contains(s) {
            judged += 1;
            assert!(
                used >= THRESHOLD * 9 / 10,
                "{task}: slice {s} admitted only {used} of {THRESHOLD}"
            );
        }
        let first = buckets.get(s).copied().unwrap_or(0);
        // The first window of a slice follows no lag of the same slice: exact.
        assert!(
            first <= THRESHOLD / 10 + burst,
            "{task}: first 100 ms of {s} admitted {first}"
        );
    }
    assert!(
        judged >= 1,
        "{task}: every full slice had a fallback admission: no pull worked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paced_slices_release_their_quota_evenly() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("pace");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);

    // Bad input names the field and writes nothing.
    for (body, field) in [
        (
            r#"{"threshold":1000,"mode":"exact_fixed","pacing":"smooth"}"#,
            "pacing",
        ),
        (
            r#"{"threshold":1000,"pacing":"smooth","burst":1001}"#,
            "burst",
        ),
        (r#"{"threshold":1000,"pacing":"fast"}"#, "pacing"),
    ] {
        let (status, v) = m.put("/api/v1/tasks/bad", body).await;
        assert_eq!(
            (status, v["field"].as_str()),
            (400, Some(field)),
            "{body}: {v}"
        );
    }
    assert_eq!(m.get_json("/api/v1/tasks/bad").await, None);

    for (task, burst) in [("smooth", 0u64), ("bursty", 50)] {
        let body = format!(
            r#"{{"threshold":{THRESHOLD},"slice_ms":{SLICE_MS},"pacing":"smooth","burst":{burst}}}"#
        );
        let (status, v) = m.put(&format!("/api/v1/tasks/{task}"), &body).await;
        assert!(status == 200 || status == 201, "{status} {v}");
        assert_eq!(v["pacing"], "smooth", "{v}");
        m.wait_rolled(task).await;
        // The leader wrote the pacing into the slices themselves (the pull script reads it).
        let next = sluice_protocol::slice::start(now_ms(), SLICE_MS as u64) + SLICE_MS;
        let (pace, b): (Option<String>, Option<u64>) = redis::cmd("HMGET")
            .arg(keys.slice(task, next))
            .arg("pace")
            .arg("burst")
            .query(&mut conn)
            .unwrap();
        assert_eq!((pace.as_deref(), b), (Some("1"), Some(burst)), "{task}");
    }

    let smooth = run(&redis, &ns, "smooth", 5_000).await;
    check("smooth", &smooth, 0);
    let bursty = run(&redis, &ns, "bursty", 5_000).await;
    check("bursty", &bursty, 50);

    // Pacing switched off: the slices already written ahead lose it too.
    let (status, v) = m
        .put(
            "/api/v1/tasks/smooth",
            &format!(r#"{{"threshold":{THRESHOLD},"slice_ms":{SLICE_MS}}}"#),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let key = keys.slice(
        "smooth",
        sluice_protocol::slice::start(now_ms(), SLICE_MS as u64) + 5 * SLICE_MS,
    );
    wait_until(
        "pace removed from the slices written ahead",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let pace: Option<String> = redis::cmd("HGET")
                .arg(&key)
                .arg("pace")
                .query(&mut conn)
                .unwrap();
            async move { pace.is_none().then_some(()) }
        },
    )
    .await;
}
