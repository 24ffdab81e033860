//! Lifecycle operations against real etcd, Redis and manager processes (issue 9): rebuilding
//! etcd, a second manager cluster on the same namespace, deleting and re-creating a dynamic
//! task, specs and settings written into etcd by hand, pruning `NS:hosts`, and `/metrics` as
//! `promtool` sees it.
//!
//! Fence takeovers wait for `--fence-stale-after`, set here through the environment
//! (`SLUICE_FENCE_STALE_AFTER`) so the same tests run against builds without the flag.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_protocol::{Keys, meta_field};
use sluice_tests::*;

/// `--fence-stale-after` of every manager these tests start.
const STALE: Duration = Duration::from_secs(4);

/// `n` replicas on `etcd`, with [`STALE`].
async fn cluster(etcd: &str, redis: &str, ns: &str, prefix: &str, n: usize) -> Vec<Manager> {
    let mut v = Vec::new();
    for i in 0..n {
        let mut o = ManagerOpts::new(etcd, redis, ns, &format!("{prefix}{i}"));
        o.env = vec![(
            "SLUICE_FENCE_STALE_AFTER".into(),
            format!("{}s", STALE.as_secs()),
        )];
        v.push(Manager::start(o).await);
    }
    v
}

/// Waits until every 1 s slice of `task` over the next 10 s holds `cap`.
async fn wait_slices(
    conn: &mut redis::Connection,
    ns: &str,
    task: &str,
    cap: u64,
    timeout: Duration,
) {
    wait_caps(conn, ns, task, 1000, 10_000, cap, timeout).await
}

/// The Redis time (ms) of the last fenced write of `task`.
fn fenced_ms(conn: &mut redis::Connection, ns: &str, task: &str) -> i64 {
    meta_fields(conn, ns, task)[meta_field::FENCED_MS]
        .parse()
        .expect("fenced_ms")
}

/// Checks, by Redis time, that a takeover seen now came at least `--fence-stale-after` after
/// the previous holder's last write (`last_write_ms`).
fn assert_held_for_stale_after(conn: &mut redis::Connection, last_write_ms: i64) {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    let now = s * 1000 + us / 1000;
    assert!(
        now - last_write_ms >= STALE.as_millis() as i64,
        "taken over {} ms after the holder's last write: a fresh fence must hold for --fence-stale-after",
        now - last_write_ms
    );
}

/// How often `m` ended a leadership by stepping down (fenced, or its leader work ended: a
/// panic). Leaderships that end because the lease could not be proven alive (a machine stall
/// longer than the lease TTL, which a loaded 2-core test machine sees now and then) are not
/// step-downs: they say nothing about fencing or specs.
fn step_downs(m: &Manager) -> usize {
    m.log_count("exit=SteppedDown")
}

/// Leaderships `m` lost because its lease could not be proven alive.
fn lease_losses(m: &Manager) -> usize {
    m.log_count("exit=Deadline") + m.log_count("exit=LeaseLost")
}

fn alerts_of<'a>(alerts: &'a [Value], kind: &str, state: &str) -> Vec<&'a Value> {
    alerts
        .iter()
        .filter(|a| a["kind"] == kind && a["state"] == state)
        .collect()
}

/// Waits until `m` serves an alert of `kind` in `state` matching `f`.
async fn wait_alert(
    m: &Manager,
    kind: &str,
    state: &str,
    timeout: Duration,
    f: impl Fn(&Value) -> bool,
) -> Value {
    let what = format!("a {state} {kind} alert");
    wait_until(&what, timeout, Duration::from_millis(100), || async {
        let all = m.alerts().await;
        alerts_of(&all, kind, state)
            .into_iter()
            .find(|a| f(a))
            .cloned()
    })
    .await
}

/// A namespace rolled by managers on an etcd with many revisions (so their term is large) is
/// taken over by managers on another etcd — a fresh one (another cluster id), or the same one
/// rebuilt from scratch (same cluster id, revisions from 1) — within `--fence-stale-after` of
/// the old cluster's last write, without flapping.
async fn takeover_after_etcd_change(rebuild: bool) {
    let ns = unique_ns(if rebuild { "rebuilt" } else { "fresh" });
    let redis_url = shared_redis();
    let mut conn = redis_conn(&redis_url);
    let mut etcd_a = EtcdServer::start();
    etcd_burn_revisions(&etcd_a.endpoint(), 2_000).await;
    let (epoch_a, rev_a) = etcd_identity(&etcd_a.endpoint()).await;
    assert!(rev_a > 2_000, "{rev_a}");

    let mut old = cluster(&etcd_a.endpoint(), &redis_url, &ns, "a", 2).await;
    let refs: Vec<&Manager> = old.iter().collect();
    let (_, term_a) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    assert!(term_a > 2_000, "{term_a}");
    let (s, v) = old[0].put("/api/v1/tasks/t", r#"{"threshold": 100}"#).await;
    assert_eq!(s, 201, "{v}");
    wait_slices(&mut conn, &ns, "t", 100, Duration::from_secs(10)).await;
    for m in old.iter_mut() {
        m.proc.stop_with(libc::SIGTERM, Duration::from_secs(10));
    }
    let stopped = Instant::now();
    let last_old_write = fenced_ms(&mut conn, &ns, "t");

    let mut etcd_b_own = None;
    let etcd_b = if rebuild {
        etcd_a.rebuild();
        etcd_a.endpoint()
    } else {
        let e = EtcdServer::start();
        let endpoint = e.endpoint();
        etcd_b_own = Some(e);
        endpoint
    };
    let (epoch_b, rev_b) = etcd_identity(&etcd_b).await;
    assert!(rev_b < 100, "{rev_b}");
    if rebuild {
        assert_eq!(epoch_b, epoch_a, "a rebuilt etcd keeps its cluster id");
    } else {
        assert_ne!(epoch_b, epoch_a);
    }
    let new = cluster(&etcd_b, &redis_url, &ns, "b", 2).await;
    let refs: Vec<&Manager> = new.iter().collect();
    let (leader, term_b) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    assert!(term_b < term_a, "{term_b} < {term_a}");
    let (s, v) = new[0].put("/api/v1/tasks/t", r#"{"threshold": 300}"#).await;
    assert_eq!(s, 201, "{v}");
    let put_at = Instant::now();
    wait_slices(&mut conn, &ns, "t", 300, STALE + Duration::from_secs(8)).await;
    eprintln!(
        "slices at the new threshold {:?} after the PUT, {:?} after the old cluster stopped",
        put_at.elapsed(),
        stopped.elapsed()
    );
    assert_held_for_stale_after(&mut conn, last_old_write);

    // The fence is the new cluster's now.
    let meta = meta_fields(&mut conn, &ns, "t");
    assert_eq!(meta[meta_field::EPOCH], epoch_b, "{meta:?}");
    let term: i64 = meta[meta_field::TERM].parse().unwrap();
    let (_, term_now) = wait_for_leader(&refs, Duration::from_secs(5)).await;
    assert_eq!(term, term_now, "{meta:?}");
    // No flapping: at most one step-down over the whole takeover (in fact none).
    let downs: usize = new.iter().map(step_downs).sum();
    assert!(downs <= 1, "{downs} step-downs");
    if downs + new.iter().map(lease_losses).sum::<usize>() == 0 {
        assert_eq!(term_now, term_b);
        assert!(new[leader].says_leader().await);
    }
    // The conflict was reported while it lasted, and is over.
    let (l, _) = wait_for_leader(&refs, Duration::from_secs(5)).await;
    let fired = wait_alert(
        &new[l],
        "fence_conflict",
        "firing",
        Duration::from_secs(5),
        |_| true,
    )
    .await;
    eprintln!("conflict alert: {}", fired["message"]);
    wait_alert(
        &new[l],
        "fence_conflict",
        "resolved",
        Duration::from_secs(5),
        |a| a["episode"] == fired["episode"],
    )
    .await;
    assert_eq!(new[l].metric("sluice_fence_foreign_tasks").await, Some(0.0));
    drop(etcd_b_own);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_etcd_takes_over_a_namespace_fenced_by_large_terms() {
    takeover_after_etcd_change(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_etcd_with_the_same_cluster_id_takes_over_without_flapping() {
    takeover_after_etcd_change(true).await;
}

/// Two live manager clusters (two etcds) on one namespace: the second never overwrites the
/// first, reports `fence_conflict` without stepping down, and takes over within
/// `--fence-stale-after` (plus a few ticks) once the first is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_cluster_on_the_namespace_never_overwrites_the_first() {
    let ns = unique_ns("twocl");
    let redis_url = shared_redis();
    let mut conn = redis_conn(&redis_url);
    let mut a = cluster(&shared_etcd(), &redis_url, &ns, "a", 1).await;
    a[0].wait_leader().await;
    let (s, v) = a[0].put("/api/v1/tasks/t", r#"{"threshold": 100}"#).await;
    assert!(s == 201 || s == 200, "{v}");
    wait_slices(&mut conn, &ns, "t", 100, Duration::from_secs(10)).await;

    let etcd_b = EtcdServer::start();
    let b = cluster(&etcd_b.endpoint(), &redis_url, &ns, "b", 1).await;
    b[0].wait_leader().await;
    let (s, v) = b[0].put("/api/v1/tasks/t", r#"{"threshold": 200}"#).await;
    assert_eq!(s, 201, "{v}");

    // Longer than the stale period: the first cluster keeps its fence fresh, so nothing of
    // the second lands.
    let until = Instant::now() + STALE + Duration::from_secs(2);
    let mut checks = 0;
    while Instant::now() < until {
        let now = now_ms();
        for (start, cap) in slice_caps(&mut conn, &ns, "t", 1000, now, now + 30_000) {
            assert_eq!(cap, Some(100), "slice {start} was overwritten");
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(checks > 50);
    let fired = wait_alert(
        &b[0],
        "fence_conflict",
        "firing",
        Duration::from_secs(2),
        |_| true,
    )
    .await;
    let msg = fired["message"].as_str().unwrap();
    assert!(msg.contains("another manager cluster"), "{msg}");
    assert!(msg.contains("takeover in"), "{msg}");
    assert_eq!(fired["details"]["tasks"], json!(["t"]), "{fired}");
    assert_eq!(b[0].metric("sluice_fence_foreign_tasks").await, Some(1.0));
    assert_eq!(
        step_downs(&b[0]),
        0,
        "the second cluster must not step down"
    );
    if lease_losses(&b[0]) == 0 {
        assert!(
            b[0].says_leader().await,
            "the second cluster keeps its leader"
        );
    }
    assert!(b[0].log_count("written by another manager cluster") >= 1);
    assert_eq!(step_downs(&a[0]), 0);

    // The first cluster stops: the second takes over after the stale period.
    a[0].proc.stop_with(libc::SIGTERM, Duration::from_secs(10));
    let stopped = Instant::now();
    let last_old_write = fenced_ms(&mut conn, &ns, "t");
    wait_slices(&mut conn, &ns, "t", 200, STALE + Duration::from_secs(5)).await;
    assert_held_for_stale_after(&mut conn, last_old_write);
    eprintln!(
        "taken over {:?} after the first cluster stopped",
        stopped.elapsed()
    );
    wait_alert(
        &b[0],
        "fence_conflict",
        "resolved",
        Duration::from_secs(5),
        |r| r["episode"] == fired["episode"],
    )
    .await;
    assert_eq!(step_downs(&b[0]), 0);
}

async fn report(m: &Manager, task: &str, error_rate: f64) {
    let r = http()
        .post(m.url(&format!("/api/v1/tasks/{task}/health")))
        .header("content-type", "application/json")
        .body(json!({"error_rate": error_rate, "source": "probe"}).to_string())
        .send()
        .await
        .expect("POST health");
    assert_eq!(r.status(), 204);
}

/// Reports bad health until `task`'s threshold is below `below`; returns it.
async fn drive_down(m: &Manager, task: &str, below: i64) -> i64 {
    let what = format!("{task} controlled below {below}");
    wait_until(
        &what,
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async {
            report(m, task, 0.5).await;
            let c = m.current_threshold(task).await?;
            (c < below).then_some(c)
        },
    )
    .await
}

fn exists(conn: &mut redis::Connection, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query::<i64>(conn).unwrap() == 1
}

/// The issue's scenario: a dynamic task lowered by its controller, deleted, created again with
/// another base, then a leader change: it runs at the new base, not at the dead task's
/// controlled threshold. And switching dynamic limiting off and on again starts from the base.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_dynamic_task_starts_from_its_new_base() {
    let ns = unique_ns("dynre");
    let keys = Keys::new(&ns).unwrap();
    let redis_url = shared_redis();
    let mut conn = redis_conn(&redis_url);
    let mut ms = start_replicas(
        &shared_etcd(),
        &redis_url,
        &ns,
        2,
        &["--control-period", "1s"],
    )
    .await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let spec = |base: u64, enabled: bool| {
        json!({"threshold": base, "dynamic": {"enabled": enabled, "min": 200, "max": 5000,
            "target_error_rate": 0.05, "target_latency_ms": 500}})
        .to_string()
    };
    let (s, v) = ms[0].put("/api/v1/tasks/d", &spec(1000, true)).await;
    assert_eq!(s, 201, "{v}");
    let low = drive_down(&ms[leader], "d", 700).await;
    eprintln!("controlled down to {low}");
    assert!(exists(&mut conn, &keys.dynamic_state("d")));

    // Deleting the task deletes what it accumulated.
    assert_eq!(ms[0].delete("/api/v1/tasks/d").await, 204);
    wait_until(
        "the task's state deleted",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let left: Vec<String> = [
                keys.dynamic_state("d"),
                keys.adjustments("d"),
                keys.health_reports("d"),
            ]
            .into_iter()
            .filter(|k| exists(&mut conn, k))
            .collect();
            async move { left.is_empty().then_some(()) }
        },
    )
    .await;

    // Re-created with another base, then a leader change.
    let (s, v) = ms[0].put("/api/v1/tasks/d", &spec(3000, true)).await;
    assert_eq!(s, 201, "{v}");
    wait_until(
        "the new base on the slices",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { (ms[leader].current_threshold("d").await == Some(3000)).then_some(()) },
    )
    .await;
    ms[leader].proc.kill();
    let other = 1 - leader;
    ms[other].wait_leader().await;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(4) {
        if let Some(c) = ms[other].current_threshold("d").await {
            assert_eq!(c, 3000, "the new leader restored the dead task's threshold");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Lowered again, then dynamic limiting off: the state goes, the base applies.
    let low = drive_down(&ms[other], "d", 3000).await;
    assert!(exists(&mut conn, &keys.dynamic_state("d")));
    let (s, v) = ms[other].put("/api/v1/tasks/d", &spec(3000, false)).await;
    assert_eq!(s, 200, "{v}");
    wait_until(
        "dynamic state deleted when switched off",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let gone = !exists(&mut conn, &keys.dynamic_state("d"));
            async move { gone.then_some(()) }
        },
    )
    .await;
    // On again (the service healthy by now): from the base, not from the old controlled value.
    report(&ms[other], "d", 0.0).await;
    let (s, v) = ms[other].put("/api/v1/tasks/d", &spec(3000, true)).await;
    assert_eq!(s, 200, "{v}");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        if let Some(c) = ms[other].current_threshold("d").await
            && c != 3000
        {
            // A known flake (once in CI, never reproduced): say what the controller and the
            // slices held, so the next failure tells why.
            let adj = ms[other].get_json("/api/v1/tasks/d/adjustments").await;
            let task = ms[other].get_json("/api/v1/tasks/d").await;
            let state: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
                .arg(keys.dynamic_state("d"))
                .query(&mut conn)
                .unwrap();
            panic!(
                "re-enabled at {c}, the value before it was off was {low}; after {:?}; \
                 adjustments {adj:?}; task {task:?}; controller state {state:?}",
                t0.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A stored spec complete enough for serde, but invalid for the API.
fn hand_written(threshold: u64, slice_ms: u64, dynamic: Option<(u64, u64)>) -> String {
    let mut v = json!({"threshold": threshold, "slice_ms": slice_ms, "pull": 0,
        "local_limit": threshold, "on_failure": "local", "mode": "pooled",
        "fallback": {"algorithm": "token_bucket", "burst": 0}, "schedules": [],
        "description": "hand-written"});
    if let Some((min, max)) = dynamic {
        v["dynamic"] = json!({"enabled": true, "min": min, "max": max,
            "target_error_rate": 0.05, "target_latency_ms": 100});
    }
    v.to_string()
}

/// Specs (and settings) written into etcd by hand that the API would refuse: the leader does
/// not panic or flap, keeps rolling the valid task, reports `invalid_spec` per task and
/// `invalid_settings`, lists the invalid tasks, and recovers when they are fixed or deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_in_etcd_are_reported_and_skipped() {
    let ns = unique_ns("inval");
    let etcd = shared_etcd();
    let redis_url = shared_redis();
    let mut conn = redis_conn(&redis_url);
    let ms = start_replicas(&etcd, &redis_url, &ns, 2, &["--control-period", "1s"]).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, term) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let (s, v) = ms[0].put("/api/v1/tasks/ok", r#"{"threshold": 100}"#).await;
    assert_eq!(s, 201, "{v}");
    wait_slices(&mut conn, &ns, "ok", 100, Duration::from_secs(5)).await;

    let keys = Keys::new(&ns).unwrap();
    etcd_put(&etcd, &keys.etcd_task("zero"), &hand_written(10, 0, None)).await;
    etcd_put(
        &etcd,
        &keys.etcd_task("minmax"),
        &hand_written(10, 1000, Some((10, 5))),
    )
    .await;
    etcd_put(
        &etcd,
        &keys.etcd_settings(),
        r#"{"webhooks": [], "skew_threshold_ms": 0, "alert_quiet_ms": 10000}"#,
    )
    .await;

    // Both are reported, per task.
    for (task, field) in [("zero", "slice_ms"), ("minmax", "dynamic.min")] {
        let a = wait_alert(
            &ms[leader],
            "invalid_spec",
            "firing",
            Duration::from_secs(10),
            |a| a["task"] == task,
        )
        .await;
        assert_eq!(a["details"]["field"], field, "{a}");
    }
    let s = wait_alert(
        &ms[leader],
        "invalid_settings",
        "firing",
        Duration::from_secs(10),
        |_| true,
    )
    .await;
    assert_eq!(s["details"]["field"], "skew_threshold_ms", "{s}");

    // The valid task keeps rolling; for a while nothing panics and nobody steps down.
    let (s, v) = ms[1 - leader]
        .put("/api/v1/tasks/ok", r#"{"threshold": 150}"#)
        .await;
    assert_eq!(s, 200, "{v}");
    wait_slices(&mut conn, &ns, "ok", 150, Duration::from_secs(5)).await;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        let now = wait_for_leader(&refs, Duration::from_secs(10)).await;
        if ms.iter().map(lease_losses).sum::<usize>() == 0 {
            assert_eq!(now, (leader, term), "leadership moved");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for m in &ms {
        assert_eq!(m.log_count("panicked"), 0, "{}", m.proc.log());
        assert_eq!(step_downs(m), 0, "{}", m.proc.log());
    }
    let (leader, term) = wait_for_leader(&refs, Duration::from_secs(10)).await;
    assert_eq!(ms[leader].metric("sluice_invalid_tasks").await, Some(2.0));

    // The API lists them and answers their errors; the settings too.
    let list = ms[0].get_json("/api/v1/tasks").await.unwrap();
    let names: Vec<&str> = list["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ok"], "{list}");
    let invalid = list["invalid"].as_array().unwrap();
    assert_eq!(invalid.len(), 2, "{list}");
    let zero = invalid.iter().find(|t| t["name"] == "zero").unwrap();
    assert_eq!(zero["field"], "slice_ms");
    assert!(zero["version"].as_i64().unwrap() > 0);
    let r = http()
        .get(ms[0].url("/api/v1/tasks/minmax"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["field"], "dynamic.min", "{body}");
    let r = http()
        .get(ms[0].url("/api/v1/settings"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);

    // Fixed through the API, or deleted: rolled again, alerts resolved.
    let (s, v) = ms[0]
        .put("/api/v1/tasks/zero", r#"{"threshold": 10}"#)
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(ms[0].delete("/api/v1/tasks/minmax").await, 204);
    let (s, v) = ms[0]
        .put("/api/v1/settings", r#"{"skew_threshold_ms": 100}"#)
        .await;
    assert_eq!(s, 200, "{v}");
    wait_slices(&mut conn, &ns, "zero", 10, Duration::from_secs(5)).await;
    for task in ["zero", "minmax"] {
        wait_alert(
            &ms[leader],
            "invalid_spec",
            "resolved",
            Duration::from_secs(5),
            |a| a["task"] == task,
        )
        .await;
    }
    wait_alert(
        &ms[leader],
        "invalid_settings",
        "resolved",
        Duration::from_secs(5),
        |_| true,
    )
    .await;
    assert_eq!(ms[leader].metric("sluice_invalid_tasks").await, Some(0.0));
    if ms.iter().map(lease_losses).sum::<usize>() == 0 {
        assert_eq!(
            wait_for_leader(&refs, Duration::from_secs(5)).await,
            (leader, term)
        );
    }
    for m in &ms {
        assert_eq!(step_downs(m), 0, "{}", m.proc.log());
    }
}

/// The leader prunes `NS:hosts` entries not seen for ten minutes (and unreadable ones); fresh
/// ones stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_prunes_hosts_not_seen_for_ten_minutes() {
    let ns = unique_ns("prune");
    let keys = Keys::new(&ns).unwrap();
    let redis_url = shared_redis();
    let mut conn = redis_conn(&redis_url);
    let now = now_ms();
    let _: () = redis::cmd("HSET")
        .arg(keys.hosts())
        .arg("gone")
        .arg(host_report_json(now - 11 * 60_000, 0.0))
        .arg("garbage")
        .arg("{not json")
        .arg("fresh")
        .arg(host_report_json(now, 0.0))
        .query(&mut conn)
        .unwrap();
    let ms = start_replicas(&shared_etcd(), &redis_url, &ns, 1, &[]).await;
    ms[0].wait_leader().await;
    wait_until(
        "stale host entries pruned",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let left: Vec<String> = redis::cmd("HKEYS")
                .arg(keys.hosts())
                .query(&mut conn)
                .unwrap();
            async move { (left == ["fresh"]).then_some(()) }
        },
    )
    .await;
    assert_eq!(ms[0].metric("sluice_hosts_pruned_total").await, Some(2.0));
}

/// `promtool check metrics` accepts a real manager's `/metrics` (HELP on every counter, base
/// units). A missing promtool fails the test: install the `prometheus` package.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_metrics() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let ns = unique_ns("prom");
    let ms = start_replicas(&shared_etcd(), &shared_redis(), &ns, 1, &[]).await;
    ms[0].wait_leader().await;
    let (s, _) = ms[0].put("/api/v1/tasks/p", r#"{"threshold": 5}"#).await;
    assert_eq!(s, 201);
    ms[0].wait_rolled("p").await;
    // A concurrency task too: its labelled gauges and counter are checked with the rest.
    let (s, _) = ms[0]
        .put(
            "/api/v1/tasks/q",
            r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 1000}"#,
        )
        .await;
    assert_eq!(s, 201);
    // What promtool's own example does: curl -s …/metrics | promtool check metrics.
    let text = wait_until(
        "the concurrency metrics of task q",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let text = ms[0].metrics().await?;
            text.contains("sluice_concurrency_lease_expiries_total{task=\"q\"} 0")
                .then_some(text)
        },
    )
    .await;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is needed (Debian package prometheus; scripts/test.sh installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool: {said}\n{text}"
    );
    // Prometheus itself asks for OpenMetrics and gets it.
    let om = http()
        .get(ms[0].url("/metrics"))
        .header("accept", "application/openmetrics-text;version=1.0.0")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(om.trim_end().ends_with("# EOF"), "{om}");
}
