//! A new leadership reconciles Redis with etcd (issue 23 item 3), against real etcd, Redis,
//! `sluice-manager` and `sluice-agent` processes: a task deleted from etcd while no manager
//! runs is retired by the next leader (tombstoned meta, its accumulated keys deleted), and the
//! agent stops deciding it (404) instead of serving it from the stale meta, then from
//! `on_failure` forever.

use std::time::{Duration, Instant};

use serde_json::json;
use sluice_protocol::Keys;
use sluice_tests::*;

fn exists(conn: &mut redis::Connection, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query::<i64>(conn).unwrap() == 1
}

/// The keys a task accumulates besides its slices (what RETIRE deletes).
fn state_keys(keys: &Keys, task: &str) -> Vec<String> {
    vec![
        keys.dynamic_state(task),
        keys.adjustments(task),
        keys.health_reports(task),
        keys.sliding_log(task),
        keys.sliding_log_seq(task),
        keys.lease(task),
        keys.history(task, "1s"),
        keys.history(task, "1m"),
    ]
}

/// Fills every key of [`state_keys`] with something, as a running task would have.
fn fill_state(conn: &mut redis::Connection, keys: &Keys, task: &str) {
    let _: () = redis::pipe()
        .hset(keys.dynamic_state(task), "threshold", 700)
        .rpush(keys.adjustments(task), "{}")
        .hset(keys.health_reports(task), "probe", "{}")
        .zadd(keys.sliding_log(task), "n:1:0", 1)
        .set(keys.sliding_log_seq(task), 1)
        .hset(keys.lease(task), "h1", "1:0:1:0")
        .set(keys.history(task, "1s"), "x")
        .set(keys.history(task, "1m"), "x")
        .query(conn)
        .unwrap();
}

/// Stop every manager, delete a task in etcd by hand, start one manager: the task is retired
/// (meta tombstoned with `retired`, dyn/adj/health/log/lease/history keys deleted), the task
/// that still exists is untouched, and the agent answers 404 for the deleted one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_deleted_while_no_leader_runs_is_retired_by_the_next_leader() {
    let (etcd, redis_url) = (shared_etcd(), shared_redis());
    let ns = unique_ns("recon");
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis_url);

    let mut m1 = Manager::start(ManagerOpts::new(&etcd, &redis_url, &ns, "m1")).await;
    m1.wait_leader().await;
    for name in ["gone", "kept"] {
        let (s, v) = m1
            .put(
                &format!("/api/v1/tasks/{name}"),
                r#"{"threshold": 1000, "slice_ms": 1000, "on_failure": "allow"}"#,
            )
            .await;
        assert_eq!(s, 201, "{v}");
        m1.wait_rolled(name).await;
    }
    let agent = Agent::start(&redis_url, &ns, "h1", &[]).await;
    let (s, v) = agent.decide(&json!({"task": "gone"})).await;
    assert_eq!((s, v["allowed"].as_bool()), (200, Some(true)), "{v}");

    // No manager runs; the spec is deleted behind the cluster's back; the task had state.
    m1.proc.stop_with(libc::SIGTERM, Duration::from_secs(10));
    let mut etcd_client = etcd_client::Client::connect([etcd.as_str()], None)
        .await
        .expect("etcd");
    let deleted = etcd_client
        .delete(keys.etcd_task("gone"), None)
        .await
        .expect("etcd delete");
    assert_eq!(deleted.deleted(), 1);
    fill_state(&mut conn, &keys, "gone");
    let _: () = redis::cmd("ZADD")
        .arg(keys.sliding_log("kept"))
        .arg(1)
        .arg("n:1:0")
        .query(&mut conn)
        .unwrap();

    let m2 = Manager::start(ManagerOpts::new(&etcd, &redis_url, &ns, "m2")).await;
    m2.wait_leader().await;
    let t0 = Instant::now();
    wait_until(
        "the deleted task retired by the new leader",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let meta = meta_fields(&mut conn, &ns, "gone");
            let left: Vec<String> = state_keys(&keys, "gone")
                .into_iter()
                .filter(|k| exists(&mut conn, k))
                .collect();
            async move { (meta.contains_key("retired") && left.is_empty()).then_some(()) }
        },
    )
    .await;
    eprintln!(
        "retired {} ms after the new leader was seen",
        t0.elapsed().as_millis()
    );
    let meta = meta_fields(&mut conn, &ns, "gone");
    assert!(
        !meta.contains_key("slice_ms") && !meta.contains_key("threshold"),
        "a tombstone keeps only the fence and `retired`: {meta:?}"
    );

    // The live task is untouched.
    let kept = meta_fields(&mut conn, &ns, "kept");
    assert!(!kept.contains_key("retired"), "{kept:?}");
    assert_eq!(m2.current_threshold("kept").await, Some(1000));
    assert!(
        exists(&mut conn, &keys.sliding_log("kept")),
        "a live task's state deleted"
    );

    // The agent stops deciding the deleted task.
    wait_until(
        "the agent to answer 404 for the deleted task",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let (s, v) = agent.decide(&json!({"task": "gone"})).await;
            (s == 404).then_some(v)
        },
    )
    .await;
    let (s, v) = agent.decide(&json!({"task": "kept"})).await;
    assert_eq!((s, v["decision"].as_str()), (200, Some("allowed")), "{v}");
}

/// The registry is shared by every manager cluster on a namespace, so a leader of another etcd
/// finds names its etcd never held. Those are not deletions: even once the first cluster has
/// stopped and its fences are stale (so RETIRE would be allowed), the other cluster leaves its
/// tasks live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_of_another_etcd_does_not_retire_tasks_it_never_had() {
    let redis_url = shared_redis();
    let ns = unique_ns("reconx");
    let mut conn = redis_conn(&redis_url);
    let stale = ("SLUICE_FENCE_STALE_AFTER".to_string(), "4s".to_string());

    let mut o = ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "a1");
    o.env = vec![stale.clone()];
    let mut a = Manager::start(o).await;
    a.wait_leader().await;
    let (s, v) = a
        .put(
            "/api/v1/tasks/first",
            r#"{"threshold": 100, "slice_ms": 1000}"#,
        )
        .await;
    assert_eq!(s, 201, "{v}");
    a.wait_rolled("first").await;
    a.proc.stop_with(libc::SIGTERM, Duration::from_secs(10));

    let etcd_b = EtcdServer::start();
    let mut o = ManagerOpts::new(&etcd_b.endpoint(), &redis_url, &ns, "b1");
    o.env = vec![stale];
    let b = Manager::start(o).await;
    b.wait_leader().await;
    // Past the fence's stale time, with the registry walked many times over.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let meta = meta_fields(&mut conn, &ns, "first");
    assert!(
        !meta.contains_key("retired") && meta.contains_key("slice_ms"),
        "the other cluster's task was retired: {meta:?}\n{}",
        b.proc.log()
    );
}

/// Managers older than the registry never filled `NS:tasks`: the first leadership that finds
/// it incomplete fills it from a `SCAN` of the metas, so a task they rolled and that was
/// deleted while no leader ran is retired too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_rolled_before_the_registry_existed_is_retired_too() {
    let (etcd, redis_url) = (shared_etcd(), shared_redis());
    let ns = unique_ns("reconold");
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis_url);

    let mut m1 = Manager::start(ManagerOpts::new(&etcd, &redis_url, &ns, "m1")).await;
    m1.wait_leader().await;
    for name in ["old", "kept"] {
        let (s, v) = m1
            .put(
                &format!("/api/v1/tasks/{name}"),
                r#"{"threshold": 10, "slice_ms": 1000}"#,
            )
            .await;
        assert_eq!(s, 201, "{v}");
        m1.wait_rolled(name).await;
    }
    m1.proc.stop_with(libc::SIGTERM, Duration::from_secs(10));
    // As an older manager leaves it: no registry at all.
    let _: i64 = redis::cmd("DEL")
        .arg(keys.task_registry())
        .query(&mut conn)
        .unwrap();
    let mut etcd_client = etcd_client::Client::connect([etcd.as_str()], None)
        .await
        .expect("etcd");
    etcd_client
        .delete(keys.etcd_task("old"), None)
        .await
        .expect("etcd delete");

    let m2 = Manager::start(ManagerOpts::new(&etcd, &redis_url, &ns, "m2")).await;
    m2.wait_leader().await;
    wait_until(
        "the task rolled before the registry retired",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let meta = meta_fields(&mut conn, &ns, "old");
            async move { meta.contains_key("retired").then_some(()) }
        },
    )
    .await;
    assert!(!meta_fields(&mut conn, &ns, "kept").contains_key("retired"));
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.task_registry())
        .query(&mut conn)
        .unwrap();
    let mut members = members;
    members.sort();
    assert_eq!(members, ["", "kept"], "complete, with the live task only");
}
