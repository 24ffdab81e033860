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
