//! Mode `concurrency` as the manager shows it (issue 13): `GET /api/v1/tasks/{name}` status
//! read from the lease hash, and the leader's `sluice_concurrency_*` metrics, against real
//! etcd, Redis, a manager and two loadgen hosts holding permits; then one host SIGKILLed.

use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_protocol::Keys;
use sluice_tests::*;

const THRESHOLD: u64 = 6;
const LEASE_MS: u64 = 1_000;

fn host<'a>(status: &'a Value, id: &str) -> Option<&'a Value> {
    status["hosts"].as_array()?.iter().find(|h| h["host"] == id)
}

fn labelled(text: &str, name: &str, task: &str) -> Option<f64> {
    metric_value(text, &format!("{name}{{task=\"{task}\"}}"))
}

fn spawn_host(ns: &str, host_id: &str, ms: u64) -> Loadgen {
    // Two workers per host holding each permit 50 ms: demand (≈2 per host) fits the cap of
    // 6, so both hosts hold permits at once.
    Loadgen::spawn(&loadgen_args(
        &shared_redis(),
        ns,
        "c",
        host_id,
        1,
        ms,
        &["--hold-ms", "50", "--workers", "2"],
    ))
}

#[tokio::test]
async fn task_status_and_metrics_follow_the_lease_hash() {
    let ns = unique_ns("concapi");
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "m1")).await;
    m.wait_leader().await;
    let body = format!(
        r#"{{"threshold": {THRESHOLD}, "mode": "concurrency", "lease_ms": {LEASE_MS}, "on_failure": "deny"}}"#
    );
    let (s, v) = m.put("/api/v1/tasks/c", &body).await;
    assert_eq!(s, 201, "{v}");
    // The leader writes the meta; the status shows the threshold it grants against.
    wait_until(
        "the status to show the threshold",
        Duration::from_secs(15),
        Duration::from_millis(50),
        || async {
            let t = m.get_json("/api/v1/tasks/c").await?;
            (t["status"]["effective_threshold"] == THRESHOLD).then_some(())
        },
    )
    .await;
    let t = m.get_json("/api/v1/tasks/c").await.unwrap();
    assert_eq!(t["status"]["mode"], "concurrency", "{t}");
    assert_eq!(t["status"]["held"], 0, "{t}");
    assert!(
        t["status"].get("remaining").is_none(),
        "no slice fields: {t}"
    );

    let (ha, hb) = (format!("{ns}-a"), format!("{ns}-b"));
    let _segments = SegmentGuard(vec![(ns.clone(), ha.clone()), (ns.clone(), hb.clone())]);
    let mut ga = spawn_host(&ns, &ha, 20_000);
    let mut gb = spawn_host(&ns, &hb, 20_000);

    // Both hosts hold permits: the API and the metrics agree on 0 < held ≤ threshold.
    let st = wait_until(
        "both hosts to hold permits in the task status",
        Duration::from_secs(20),
        Duration::from_millis(50),
        || async {
            let t = m.get_json("/api/v1/tasks/c").await?;
            let st = t["status"].clone();
            let a = host(&st, &ha)?["held"].as_u64()?;
            let b = host(&st, &hb)?["held"].as_u64()?;
            (a > 0 && b > 0).then_some(st)
        },
    )
    .await;
    let held = st["held"].as_u64().unwrap();
    assert!(held > 0 && held <= THRESHOLD, "{st}");
    assert_eq!(st["hosts_holding"], 2, "{st}");
    assert_eq!(st["malformed_entries"], 0, "{st}");
    for id in [&ha, &hb] {
        let h = host(&st, id).unwrap();
        let exp = h["expires_in_ms"].as_i64().unwrap();
        assert!(exp > 0 && exp <= LEASE_MS as i64, "{h}");
        assert_eq!(h["expired"], false, "{h}");
    }
    let text = wait_until(
        "the metrics to show both hosts holding",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let text = m.metrics().await?;
            (labelled(&text, "sluice_concurrency_hosts_holding", "c")? == 2.0).then_some(text)
        },
    )
    .await;
    let held_metric = labelled(&text, "sluice_concurrency_permits_held", "c").unwrap();
    assert!(
        held_metric > 0.0 && held_metric <= THRESHOLD as f64,
        "{held_metric}"
    );
    let expiries_before = labelled(&text, "sluice_concurrency_lease_expiries_total", "c").unwrap();
    assert!(labelled(&text, "sluice_concurrency_hosts_waiting", "c").is_some());

    // SIGKILL host b (the parent and its worker process): nothing gives its block back, so
    // its entry must expire within the lease TTL, and the leader counts the expiry.
    let pids: Vec<u32> = std::iter::once(gb.proc.pid())
        .chain(child_pids(gb.proc.pid()))
        .collect();
    assert_eq!(pids.len(), 2, "{pids:?}");
    for p in &pids {
        signal(*p, libc::SIGKILL);
    }
    let killed = Instant::now();
    let st = wait_until(
        "host b's entry to expire",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let t = m.get_json("/api/v1/tasks/c").await?;
            let st = t["status"].clone();
            let b = host(&st, &hb)?;
            (b["expired"] == true).then_some(st)
        },
    )
    .await;
    let expired_after = killed.elapsed();
    eprintln!("host b's lease seen expired {expired_after:?} after the kill (lease {LEASE_MS} ms)");
    // The lease was renewed at most LEASE_MS before the kill; 300 ms for polling on a loaded
    // machine.
    assert!(
        expired_after <= Duration::from_millis(LEASE_MS + 300),
        "expired {expired_after:?} after the kill: {st}"
    );
    assert_eq!(host(&st, &hb).unwrap()["held"], 0, "{st}");
    assert!(st["held"].as_u64().unwrap() <= THRESHOLD, "{st}");
    let expiries = wait_until(
        "the expiry counter to increase",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let text = m.metrics().await?;
            let n = labelled(&text, "sluice_concurrency_lease_expiries_total", "c")?;
            (n > expiries_before).then_some(n)
        },
    )
    .await;
    assert_eq!(expiries, expiries_before + 1.0, "one lease lapsed");
    // Host a still holds, alone.
    wait_until(
        "only host a to hold, in the metrics",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let text = m.metrics().await?;
            (labelled(&text, "sluice_concurrency_hosts_holding", "c")? == 1.0).then_some(())
        },
    )
    .await;

    // A malformed entry written into the hash is skipped and counted, never trusted.
    let mut c = redis_conn(&shared_redis());
    let _: () = redis::cmd("HSET")
        .arg(Keys::new(&ns).unwrap().lease("c"))
        .arg("bogus")
        .arg("1.5e+3:x")
        .query(&mut c)
        .unwrap();
    let t = m.get_json("/api/v1/tasks/c").await.unwrap();
    assert_eq!(t["status"]["malformed_entries"], 1, "{t}");
    assert!(host(&t["status"], "bogus").is_none(), "{t}");
    assert!(t["status"]["held"].as_u64().unwrap() <= THRESHOLD, "{t}");

    ga.proc.kill();
    gb.proc.kill();
}
