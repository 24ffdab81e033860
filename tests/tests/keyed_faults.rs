//! Keyed tasks when things go wrong: real etcd, Redis and `sluice-manager`.
//!
//! * the task's slices are gone (the leader stopped past the horizon): KPULL answers −1, and
//!   the task is FAILED like a pooled task whose PULL finds no slice — each key decided by
//!   `on_failure` (`local`: `local_limit` per key per slice), never denied outright; a new
//!   leader brings it back;
//! * a `Key` of a shadow task that is not keyed is shadowed like the task (never enforced).

use std::time::Duration;

use sluice_tests::*;

async fn keyed_task(m: &Manager, task: &str, body: &str) {
    let (status, resp) = m.put(&format!("/api/v1/tasks/{task}"), body).await;
    assert!(status == 200 || status == 201, "{status} {resp}");
    m.wait_rolled(task).await;
}

/// Deletes every Redis key of the namespace matching `pattern` (after `ns:`).
fn delete_matching(conn: &mut redis::Connection, ns: &str, pattern: &str) -> usize {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:{pattern}"))
        .query(conn)
        .unwrap();
    for k in &keys {
        let _: () = redis::cmd("DEL").arg(k).query(conn).unwrap();
    }
    keys.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_task_slice_makes_a_keyed_task_failed_and_keys_get_their_local_limit() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keymiss");
    let mut m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "km",
        r#"{"threshold":100,"slice_ms":5000,"keyed":true,"local_limit":3,"on_failure":"local",
            "fallback":{"algorithm":"fixed_window"}}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&redis, &ns, &host);
    cfg.probe_interval = Duration::from_millis(500);
    let client = sluice::Client::new(cfg).unwrap();
    let task = client.task("km").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    assert!(task.key("warm").unwrap().acquire(1).await.is_allowed());

    // The leader is gone and so are the slices it rolled (as past the horizon).
    m.proc.kill();
    let mut conn = redis_conn(&redis);
    assert!(
        delete_matching(&mut conn, &ns, "{km}:s:*") > 0,
        "task slices"
    );
    delete_matching(&mut conn, &ns, "{km}:k:*");

    wait_until(
        "the task FAILED",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || {
            // Fresh keys need pulls, which find no task slice.
            let k = task.key(&format!("probe-{}", now_ms())).unwrap();
            let task = task.clone();
            async move {
                let d = k.acquire(1).await;
                (task.state() == sluice::HostState::Failed && d.is_fallback()).then_some(())
            }
        },
    )
    .await;
    // Within one slice: each fresh key admits its own local_limit (3), then is refused, by
    // the waiting and the non-waiting calls alike.
    let slice_us = 5_000_000i64;
    loop {
        if task.now_us() % slice_us > 3_000_000 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        let start = task.now_us() / slice_us;
        let mut counts = Vec::new();
        for name in ["c", "d"] {
            let k = task.key(name).unwrap();
            let mut n = 0;
            for i in 0..10 {
                let d = if i % 2 == 0 {
                    k.acquire(1).await
                } else {
                    k.try_acquire(1)
                };
                assert!(d.is_fallback(), "{d:?}");
                if d.is_allowed() {
                    n += 1;
                }
            }
            counts.push(n);
        }
        if task.now_us() / slice_us == start {
            assert_eq!(counts, [3, 3], "local_limit per key while FAILED");
            break;
        }
    }
    assert_eq!(task.state(), sluice::HostState::Failed);

    // A leader again: the probe finds the task's slice and keys are decided globally again.
    let _m2 = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m2")).await;
    wait_until(
        "keys decided globally again",
        Duration::from_secs(20),
        Duration::from_millis(50),
        || {
            let k = task.key("after").unwrap();
            async move { (k.acquire(1).await == sluice::Decision::Allowed).then_some(()) }
        },
    )
    .await;
    assert_eq!(task.state(), sluice::HostState::Normal);
}

/// `Key::try_acquire` on a task that is not keyed decides on the task as a whole — and in
/// shadow mode like every other decision of a shadow task: a rejection becomes
/// `ShadowLimited`, counted as a would-reject (`wrej`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_a_shadow_task_that_is_not_keyed_is_shadowed() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyshadow");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "plain",
        r#"{"threshold":3,"slice_ms":5000,"shadow":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let task = client.task("plain").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let key = task.key("whatever").unwrap();
    let slice_us = 5_000_000i64;
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);
    loop {
        if task.now_us() % slice_us > 2_000_000 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        let start = task.now_us() / slice_us;
        let mut decisions = Vec::new();
        for _ in 0..40 {
            decisions.push(key.try_acquire(1));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if task.now_us() / slice_us != start {
            continue;
        }
        let enforced: Vec<_> = decisions.iter().filter(|d| !d.is_allowed()).collect();
        assert!(enforced.is_empty(), "shadow task enforced: {enforced:?}");
        let shadowed = decisions
            .iter()
            .filter(|d| matches!(d, sluice::Decision::ShadowLimited { .. }))
            .count();
        assert!(shadowed >= 30, "{decisions:?}");
        // The would-rejects reach the slice hash with the next flush.
        let slice = keys.slice("plain", start * 5_000);
        wait_until(
            "the would-rejects flushed",
            Duration::from_secs(5),
            Duration::from_millis(100),
            || {
                let wrej: Option<u64> = redis::cmd("HGET")
                    .arg(&slice)
                    .arg("wrej")
                    .query(&mut conn)
                    .unwrap();
                async move { (wrej.unwrap_or(0) >= shadowed as u64).then_some(()) }
            },
        )
        .await;
        break;
    }
}
