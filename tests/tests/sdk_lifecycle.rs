//! SDK lifecycle regressions (issue 9): what ordinary operations (changing a task's slice
//! length, deleting and re-creating it, two clients in one process, a lagging host clock, a
//! slow Redis) must not do to the limiter.
//!
//! Every test runs real `sluice-manager`, Redis and (where a host is simulated) `loadgen`
//! processes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice::{Client, Config, Decision};
use sluice_tests::*;

async fn put_task(m: &Manager, name: &str, body: &str) {
    let (status, v) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
    assert!(status == 200 || status == 201, "PUT {name}: {status} {v}");
}

/// Waits until the task's meta hash says `slice_ms` and its current slice on that grid exists.
async fn wait_grid(redis: &str, ns: &str, task: &str, slice_ms: u64) {
    let keys = sluice_protocol::Keys::new(ns).unwrap();
    let url = redis.to_string();
    wait_until(
        &format!("{task} rolled on {slice_ms} ms slices"),
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let mut c = redis_conn(&url);
            let meta: Option<u64> = redis::cmd("HGET")
                .arg(keys.meta(task))
                .arg("slice_ms")
                .query(&mut c)
                .unwrap_or(None);
            let cur = sluice_protocol::slice::start(now_ms(), slice_ms);
            let exists: bool = redis::cmd("EXISTS")
                .arg(keys.slice(task, cur + slice_ms as i64))
                .query(&mut c)
                .unwrap_or(false);
            async move { (meta == Some(slice_ms) && exists).then_some(()) }
        },
    )
    .await;
}

/// Runs one loadgen per host (1 process, `rate` per second) for `duration_ms` with buckets of
/// `bucket_ms`; returns the reports.
async fn run_hosts(
    redis: &str,
    ns: &str,
    task: &str,
    hosts: &[String],
    rate: u64,
    duration_ms: u64,
    bucket_ms: u64,
) -> Vec<Value> {
    let mut runs: Vec<Loadgen> = hosts
        .iter()
        .map(|h| {
            Loadgen::spawn(&loadgen_args(
                redis,
                ns,
                task,
                h,
                1,
                duration_ms,
                &[
                    "--rate",
                    &rate.to_string(),
                    "--bucket-ms",
                    &bucket_ms.to_string(),
                ],
            ))
        })
        .collect();
    let mut out = Vec::new();
    for r in &mut runs {
        out.push(r.wait_json(Duration::from_secs(90)).await);
    }
    out
}

/// Checks a run on `slice_ms` slices with threshold `cap`: every bucket (= slice) of the hosts
/// together ≤ cap, every complete slice after the first two ≥ 90 % of cap, and the Redis calls
/// of each host bounded (a few dozen per second, not hundreds).
fn check_run(what: &str, reports: &[Value], cap: u64, duration_ms: u64) {
    let mut sum: BTreeMap<i64, u64> = BTreeMap::new();
    for r in reports {
        for (k, (a, _)) in loadgen_buckets(r) {
            *sum.entry(k).or_default() += a;
        }
    }
    eprintln!("{what}: admitted per slice (all hosts) {sum:?}");
    for (k, a) in &sum {
        assert!(*a <= cap, "{what}: slice {k} over-admitted: {a} > {cap}");
    }
    let keys: Vec<i64> = sum.keys().copied().collect();
    assert!(keys.len() >= 4, "{what}: too few slices {keys:?}");
    // Skip the first two slices (the first may be partial) and the last (partial).
    let complete = &keys[2..keys.len() - 1];
    for k in complete {
        assert!(
            sum[k] >= cap * 9 / 10,
            "{what}: slice {k} admitted {} < 90 % of {cap} ({sum:?})",
            sum[k]
        );
    }
    for r in reports {
        let calls = r["redis_calls"].as_u64().unwrap();
        let per_s = calls as f64 * 1_000.0 / duration_ms as f64;
        eprintln!(
            "{what}: host {} made {calls} Redis calls ({per_s:.1}/s)",
            r["host_id"]
        );
        assert!(
            per_s <= 50.0,
            "{what}: host {} made {calls} Redis calls in {duration_ms} ms: the puller spins",
            r["host_id"]
        );
    }
}

/// Issue 9 item 1: changing `slice_ms` (and deleting + re-creating the task with another slice
/// length) must not take the task down on hosts whose segment holds quota of the old grid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slice_length_change_and_recreate_keep_admitting() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lcslc");
    let hosts: Vec<String> = (0..2).map(|i| format!("{ns}-h{i}")).collect();
    let _segments = SegmentGuard(hosts.iter().map(|h| (ns.clone(), h.clone())).collect());
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    let spec = |slice_ms: u64| {
        format!(
            r#"{{"threshold":1000,"slice_ms":{slice_ms},"local_limit":100,"on_failure":"deny"}}"#
        )
    };
    put_task(&m, "slc", &spec(1_000)).await;
    wait_grid(&redis, &ns, "slc", 1_000).await;
    // Demand above the threshold on both hosts: their segments hold quota words of the 1 s grid.
    let before = run_hosts(&redis, &ns, "slc", &hosts, 1_500, 3_000, 1_000).await;
    check_run("1 s slices", &before, 1_000, 3_000);

    put_task(&m, "slc", &spec(2_000)).await;
    wait_grid(&redis, &ns, "slc", 2_000).await;
    let after = run_hosts(&redis, &ns, "slc", &hosts, 1_500, 10_000, 2_000).await;
    check_run("after the change to 2 s slices", &after, 1_000, 10_000);

    assert_eq!(m.delete("/api/v1/tasks/slc").await, 204);
    put_task(&m, "slc", &spec(500)).await;
    wait_grid(&redis, &ns, "slc", 500).await;
    let recreated = run_hosts(&redis, &ns, "slc", &hosts, 3_000, 5_000, 500).await;
    check_run("re-created with 500 ms slices", &recreated, 1_000, 5_000);
}

/// Issue 9 item 3: two clients of one process (same host id) must not share sliding-log
/// members: together they admit at most the limit in one window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_in_one_process_share_the_sliding_limit() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lcsld");
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    put_task(
        &m,
        "sld",
        r#"{"threshold":10,"slice_ms":1000,"mode":"exact_sliding","local_limit":1,"on_failure":"deny"}"#,
    )
    .await;
    wait_grid(&redis, &ns, "sld", 1_000).await;
    let client = || Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let (a, b) = (client(), client());
    let (ta, tb) = (a.task("sld").unwrap(), b.task("sld").unwrap());
    assert!(ta.wait_ready(Duration::from_secs(10)) && tb.wait_ready(Duration::from_secs(10)));
    // Alternate 40 calls, well within one 1 s window.
    let t0 = Instant::now();
    let mut admitted = 0;
    for i in 0..40 {
        let t = if i % 2 == 0 { &ta } else { &tb };
        if t.acquire(1).await == Decision::Allowed {
            admitted += 1;
        }
    }
    let took = t0.elapsed();
    eprintln!("40 alternating calls took {took:?}, {admitted} admitted");
    assert!(took < Duration::from_millis(900), "too slow for one window");
    assert!(
        admitted <= 10,
        "{admitted} admitted in one window, limit 10"
    );
    assert_eq!(admitted, 10, "the limit must be reachable");
}

/// Issue 9 item 4: the synchronous path never admits on an exact task (before: it answered
/// as FAILED would, by the local fallback, so 2 hosts × 2 processes admitted ~4× the limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_never_admits_on_an_exact_task() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lcwb");
    let hosts = [format!("{ns}-h0"), format!("{ns}-h1")];
    let _segments = SegmentGuard(hosts.iter().map(|h| (ns.clone(), h.clone())).collect());
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    put_task(
        &m,
        "wb",
        r#"{"threshold":100,"slice_ms":1000,"mode":"exact_sliding","local_limit":100,"on_failure":"local"}"#,
    )
    .await;
    wait_grid(&redis, &ns, "wb", 1_000).await;
    let mut clients = Vec::new();
    for h in &hosts {
        for _ in 0..2 {
            let c = Client::new(sdk_config(&redis, &ns, h)).unwrap();
            let t = c.task("wb").unwrap();
            assert!(t.wait_ready(Duration::from_secs(10)));
            clients.push((c, t));
        }
    }
    let mut admitted = 0;
    let mut other = Vec::new();
    for _ in 0..200 {
        for (_, t) in &clients {
            let d = t.try_acquire(1);
            if d.is_allowed() {
                admitted += 1;
            }
            if d != Decision::WouldBlock && other.len() < 5 {
                other.push(d);
            }
            assert!(d.retry_after().is_none() && !d.is_fallback(), "{d:?}");
        }
    }
    assert_eq!(
        admitted, 0,
        "try_acquire admitted {admitted} on an exact task"
    );
    assert!(other.is_empty(), "answers other than WouldBlock: {other:?}");
    // acquire is the exact decision: it still admits up to the limit.
    let mut exact = 0;
    for _ in 0..30 {
        if clients[0].1.acquire(1).await == Decision::Allowed {
            exact += 1;
        }
    }
    assert!(exact > 0, "acquire admitted nothing");
}

/// Issue 9 item 11a: `acquire` counts a request as rejected only when its decision is final,
/// not each time it waits for a refill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_that_waits_then_admits_counts_no_rejection() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lcrej");
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    // Chunks of 5: the loop below outruns every refill and waits for it.
    put_task(
        &m,
        "rj",
        r#"{"threshold":100000,"slice_ms":10000,"pull":5,"local_limit":1,"on_failure":"deny"}"#,
    )
    .await;
    wait_grid(&redis, &ns, "rj", 10_000).await;
    let client = Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let task = client.task("rj").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let from = now_ms();
    const N: u64 = 300;
    for i in 0..N {
        let d = task.acquire(1).await;
        assert_eq!(d, Decision::Allowed, "acquire {i}");
    }
    let until = now_ms();
    drop(task);
    drop(client); // the last flush
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut c = redis_conn(&redis);
    let (mut adm, mut rej) = (0u64, 0u64);
    for s in sluice_protocol::slice::starts(from, until + 1, 10_000) {
        let (a, r): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(keys.slice("rj", s))
            .arg("adm")
            .arg("rej")
            .query(&mut c)
            .unwrap();
        adm += a.unwrap_or(0);
        rej += r.unwrap_or(0);
    }
    assert_eq!(
        (adm, rej),
        (N, 0),
        "flushed adm/rej after {N} admitted acquires"
    );
}

/// Issue 9 item 7: a host whose clock lags by 3 s (1 s slices) must not spend the leftovers of
/// slices that ended in Redis time: both hosts together stay ≤ the threshold in every real
/// second, and the lagging host is LIMITED (never FAILED: with `on_failure: allow` a FAILED
/// host would admit by fallback).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_host_does_not_spend_ended_slices() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("lclag");
    let (good, lag) = (format!("{ns}-good"), format!("{ns}-lag"));
    let _segments = SegmentGuard(vec![(ns.clone(), good.clone()), (ns.clone(), lag.clone())]);
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    put_task(
        &m,
        "lag",
        r#"{"threshold":1000,"slice_ms":1000,"local_limit":100,"on_failure":"allow"}"#,
    )
    .await;
    wait_grid(&redis, &ns, "lag", 1_000).await;
    // Let the slices the lagging host will see as current be written (and left untouched).
    tokio::time::sleep(Duration::from_secs(4)).await;
    const LAG_MS: i64 = 3_000;
    let args = |h: &str| loadgen_args(&redis, &ns, "lag", h, 1, 6_000, &["--rate", "1500"]);
    let mut g = Loadgen::spawn(&args(&good));
    let mut l = Loadgen::spawn_under(&["faketime", "-f", "-3s"], &args(&lag));
    let rg = g.wait_json(Duration::from_secs(60)).await;
    let rl = l.wait_json(Duration::from_secs(60)).await;
    // Per real second: the lagging host's bucket b covers real [b + 3 s, b + 4 s).
    let mut real: BTreeMap<i64, (u64, u64)> = BTreeMap::new();
    for (k, (a, _)) in loadgen_buckets(&rg) {
        real.entry(k).or_default().0 += a;
    }
    for (k, (a, _)) in loadgen_buckets(&rl) {
        real.entry(k + LAG_MS).or_default().1 += a;
    }
    eprintln!("admitted per real second (good, lagging): {real:?}");
    eprintln!("lagging host: {rl}");
    for (k, (a, b)) in &real {
        assert!(
            a + b <= 1_000,
            "real second {k}: {a} + {b} admitted > threshold 1000"
        );
    }
    assert_eq!(
        rl["fallback_admitted"].as_u64(),
        Some(0),
        "lagging host went FAILED: {rl}"
    );
    let calls = rl["redis_calls"].as_u64().unwrap();
    assert!(calls <= 200, "lagging host made {calls} Redis calls in 6 s");
}

/// Issue 9 item 9: slots of tasks no process uses any more are reclaimed, so a host can use
/// any number of task names over time on a 64-slot segment.
#[test]
fn two_hundred_task_names_over_time_fit_in_64_slots() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new("redis://127.0.0.1:1");
    cfg.shm_dir = dir.path().to_path_buf();
    cfg.host_id = "names".into();
    cfg.max_tasks = 64;
    cfg.reclaim_idle = Duration::from_secs(1);
    let client = Client::new(cfg).unwrap();
    let t0 = Instant::now();
    for i in 0..200 {
        let name = format!("task-{i}");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match client.task(&name) {
                Ok(t) => {
                    let _ = t.try_acquire(1);
                    break;
                }
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "task {i} after {:?}: {e}",
                        t0.elapsed()
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
