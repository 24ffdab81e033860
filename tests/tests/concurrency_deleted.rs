//! A concurrency task deleted while a host waits for its permits (found by the soak, issue 23,
//! seed 1014: two loadgen runs of a deleted concurrency task did not exit within 5 s of
//! SIGTERM). Their loops wait in `Task::permit_timeout(100 ms)`; once the task was deleted the
//! SDK's background round for it returned early (the meta forgotten) without waking waiters,
//! so the wait outlived its timeout for good. A decision path never blocks: every round now
//! wakes the task's waiters, which decide again and see their deadline.

use std::time::{Duration, Instant};

use sluice_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_of_a_deleted_concurrency_task_still_stops_on_sigterm() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("concdel");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    let body = r#"{"threshold":3,"mode":"concurrency","lease_ms":1000,"on_failure":"local","local_limit":2}"#;
    let (status, v) = m.put("/api/v1/tasks/c", body).await;
    assert!(status == 200 || status == 201, "{status} {v}");
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let dir = tempfile::tempdir().unwrap();
    let iv = dir.path().join("intervals");
    // 2 processes × 4 loops for 3 permits: loops wait in permit_timeout(100 ms).
    let mut lg = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "c",
        &host,
        2,
        30_000,
        &[
            "--workers",
            "4",
            "--hold-ms",
            "50",
            "--intervals",
            iv.to_str().unwrap(),
        ],
    ));
    tokio::time::sleep(Duration::from_secs(4)).await;
    let held = std::fs::read_to_string(&iv)
        .unwrap_or_default()
        .lines()
        .count();
    assert!(held > 0, "no permit was held before the deletion");
    assert_eq!(m.delete("/api/v1/tasks/c").await, 204);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let t0 = Instant::now();
    signal(lg.proc.pid(), libc::SIGTERM);
    // The children stop their loops at once (each loop waits at most 100 ms): well within the
    // 5 s after which the parent kills them (and reports an error).
    let r = lg.wait_json(Duration::from_secs(4)).await;
    eprintln!(
        "stopped {} ms after SIGTERM; admitted {} rejected {} ({held} permits before the deletion)",
        t0.elapsed().as_millis(),
        r["admitted"],
        r["rejected"]
    );
}
