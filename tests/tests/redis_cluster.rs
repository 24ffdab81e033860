//! The key layout works unchanged on Redis Cluster: every script of a task stays in the slot
//! of its `{T}` hash tag.

use std::time::Duration;

use sluice_protocol::conn::{ConnOptions, Redis, RedisTarget};
use sluice_protocol::scripts::PullReply;
use sluice_protocol::{Keys, slice};
use sluice_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_rolls_into_a_three_node_cluster_and_workers_can_pull() {
    let cluster = RedisCluster::start(3);
    let ns = unique_ns("cl");
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &cluster.urls(), &ns, "n0")).await;
    m.wait_leader().await;
    // Enough tasks to spread over every node's slots.
    for i in 0..12 {
        let (s, v) = m
            .put(&format!("/api/v1/tasks/task{i}"), r#"{"threshold": 50}"#)
            .await;
        assert_eq!(s, 201, "{v}");
    }
    let redis = Redis::new(
        RedisTarget::parse(&cluster.urls()).unwrap(),
        ConnOptions::default(),
    );
    let keys = Keys::new(&ns).unwrap();
    for i in 0..12 {
        let task = format!("task{i}");
        let granted = wait_until(
            &format!("{task} pullable"),
            Duration::from_secs(10),
            Duration::from_millis(50),
            || {
                let redis = &redis;
                let keys = keys.clone();
                let task = task.clone();
                async move {
                    let mut c = redis.conn().await.ok()?;
                    let cur = slice::start(now_ms(), 1000);
                    match pull_once(&mut c, &keys, &task, cur + 1_000, 1_000, 20)
                        .await
                        .ok()?
                    {
                        PullReply::Granted { granted, cap, .. } => (cap == 50).then_some(granted),
                        _ => None,
                    }
                }
            },
        )
        .await;
        assert_eq!(granted, 20);
    }
    let v = m.get_json("/api/v1/tasks/task3").await.unwrap();
    assert_eq!(v["status"]["effective_threshold"], 50, "{v}");
    assert!(m.metric("sluice_roll_errors_total").await == Some(0.0));
}

/// Lazy tasks on a Redis Cluster (`--lazy-after`): new tasks start lazy, a worker's pull makes
/// its slice from the meta in the task's own slot, and a new leadership reads which tasks were
/// lazy (one command per task: a cross-slot pipeline would be refused) and keeps them lazy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_tasks_on_a_cluster_survive_a_new_leadership() {
    let cluster = RedisCluster::start(3);
    let ns = unique_ns("cllz");
    let opts = || {
        let mut o = ManagerOpts::new(&shared_etcd(), &cluster.urls(), &ns, "n0");
        o.extra = [
            "--lazy-after",
            "2s",
            "--horizon",
            "6s",
            "--retention",
            "10s",
        ]
        .map(String::from)
        .to_vec();
        o
    };
    let mut m = Manager::start(opts()).await;
    m.wait_leader().await;
    for i in 0..12 {
        let (s, v) = m
            .put(&format!("/api/v1/tasks/task{i}"), r#"{"threshold": 50}"#)
            .await;
        assert_eq!(s, 201, "{v}");
    }
    let redis = Redis::new(
        RedisTarget::parse(&cluster.urls()).unwrap(),
        ConnOptions::default(),
    );
    let keys = Keys::new(&ns).unwrap();
    let meta = |task: String, field: &'static str| {
        let (redis, keys) = (&redis, keys.clone());
        async move {
            let mut c = redis.conn().await.ok()?;
            redis::cmd("HGET")
                .arg(keys.meta(&task))
                .arg(field)
                .query_async::<Option<i64>>(&mut c)
                .await
                .ok()?
        }
    };
    for i in 0..12 {
        let task = format!("task{i}");
        wait_until(
            &format!("{task} lazy"),
            Duration::from_secs(10),
            Duration::from_millis(100),
            || {
                let f = meta(task.clone(), "lz_cap");
                async move { (f.await == Some(50)).then_some(()) }
            },
        )
        .await;
    }
    // A worker's pull makes task0's current slice from its meta.
    let mut c = redis.conn().await.unwrap();
    let cur = slice::start(now_ms(), 1000);
    match pull_once(&mut c, &keys, "task0", cur, 1_000, 20)
        .await
        .unwrap()
    {
        PullReply::Granted { granted, cap, .. } => assert_eq!((granted, cap), (20, 50)),
        other => panic!("{other:?}"),
    }
    // A new leadership (the manager restarted) keeps the idle tasks lazy.
    let term = meta("task5".into(), "term").await.expect("term");
    m.proc.kill();
    let mut m2 = Manager::start(opts()).await;
    m2.wait_leader().await;
    wait_until(
        "task5 claimed by the new leadership, lazy",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || {
            let t = meta("task5".into(), "term");
            let l = meta("task5".into(), "lz_cap");
            async move {
                let (t, l) = (t.await, l.await);
                (t.is_some_and(|t| t > term) && l == Some(50)).then_some(())
            }
        },
    )
    .await;
    let now = now_ms();
    let rolled = meta("task5".into(), "rolled_to").await.expect("rolled_to");
    assert!(
        rolled <= now + 1_000,
        "task5 written ahead: {rolled} at {now}"
    );
    let log = m2.proc.log();
    assert!(
        !log.contains("cannot read whether these tasks were lazy"),
        "{log}"
    );
    m2.proc.kill();
}
