//! Leader election end to end: three real `sluice-manager` processes on real etcd and Redis.

use std::time::{Duration, Instant};

use sluice_tests::*;

const TTL: Duration = Duration::from_secs(2);

async fn create_task(m: &Manager, name: &str, body: &str) {
    let (status, v) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
    assert!(status == 201 || status == 200, "PUT {name}: {status} {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_leader_and_everyone_sees_the_members() {
    let ns = unique_ns("el");
    let ms = start_replicas(&shared_etcd(), &shared_redis(), &ns, 3, &[]).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, term) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    assert!(term > 0);

    // Exactly one replica acts as leader.
    let mut acting = 0;
    for m in &ms {
        if m.says_leader().await {
            acting += 1;
        }
        assert_eq!(
            m.metric("sluice_term").await.unwrap_or(-1.0) > 0.0,
            m.says_leader().await
        );
    }
    assert_eq!(acting, 1);

    // Every replica lists all members with the same leader flag.
    for m in &ms {
        let v = m.get_json("/api/v1/cluster").await.expect("cluster");
        let members = v["members"].as_array().expect("members");
        assert_eq!(members.len(), 3, "{v}");
        let flagged: Vec<&str> = members
            .iter()
            .filter(|x| x["is_leader"] == true)
            .map(|x| x["node_id"].as_str().unwrap())
            .collect();
        assert_eq!(flagged, [ms[leader].opts.node_id.as_str()]);
        assert_eq!(v["leader"]["addr"], ms[leader].addr.as_str());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_leader_fails_over_within_ttl_plus_one_second_without_gaps() {
    let ns = unique_ns("kill");
    let redis_url = shared_redis();
    let mut ms = start_replicas(&shared_etcd(), &redis_url, &ns, 3, &[]).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, term) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    create_task(&ms[0], "k", r#"{"threshold": 500, "slice_ms": 1000}"#).await;
    let mut conn = redis_conn(&redis_url);
    wait_until(
        "slices written",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let now = now_ms();
            let ok = slice_caps(&mut conn, &ns, "k", 1000, now, now + 30_000)
                .iter()
                .all(|(_, c)| *c == Some(500));
            async move { ok.then_some(()) }
        },
    )
    .await;

    let killed_at = Instant::now();
    ms[leader].proc.kill();
    let survivors: Vec<&Manager> = ms
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, m)| m)
        .collect();

    // Until a new leader is seen, check every 100 ms that no slice is missing in [now, now+30s].
    let mut checks = 0;
    let new_term = loop {
        let now = now_ms();
        let missing: Vec<i64> = slice_caps(&mut conn, &ns, "k", 1000, now, now + 30_000)
            .into_iter()
            .filter(|(_, c)| c.is_none())
            .map(|(s, _)| s)
            .collect();
        assert!(
            missing.is_empty(),
            "slices missing during failover: {missing:?}"
        );
        checks += 1;
        if let Some((id, t)) = leader_seen_by(survivors[0]).await
            && id != ms[leader].opts.node_id
        {
            let idx = survivors
                .iter()
                .position(|m| m.opts.node_id == id)
                .expect("a survivor");
            if survivors[idx].says_leader().await {
                break t;
            }
        }
        assert!(
            killed_at.elapsed() < TTL + Duration::from_secs(1),
            "no new leader within TTL + 1 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let took = killed_at.elapsed();
    assert!(new_term > term, "term must grow: {term} -> {new_term}");
    eprintln!("failover took {took:?} ({checks} gap checks)");
    assert!(
        took <= TTL + Duration::from_secs(1),
        "failover took {took:?}"
    );

    // The new leader keeps rolling: the horizon moves on.
    let ahead = wait_until(
        "new leader rolls",
        Duration::from_secs(5),
        Duration::from_millis(100),
        || async {
            for m in &survivors {
                if m.says_leader().await {
                    let h = m.metric("sluice_horizon_ahead_seconds").await?;
                    return (h > 50.0).then_some(h);
                }
            }
            None
        },
    )
    .await;
    // At most the horizon and the step the window grows by (issue 27: up to 10 s past the
    // horizon), and a second of margin.
    assert!(ahead <= 71.0, "{ahead}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_over_in_under_a_second() {
    let ns = unique_ns("term");
    let mut ms = start_replicas(
        &shared_etcd(),
        &shared_redis(),
        &ns,
        3,
        &["--lease-ttl", "5s"],
    )
    .await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let old_id = ms[leader].opts.node_id.clone();

    let t0 = Instant::now();
    let code = ms[leader]
        .proc
        .stop_with(libc::SIGTERM, Duration::from_secs(10));
    let survivors: Vec<&Manager> = ms
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, m)| m)
        .collect();
    wait_until(
        "a new leader after SIGTERM",
        Duration::from_secs(3),
        Duration::from_millis(10),
        || async {
            for m in &survivors {
                if m.says_leader().await {
                    return Some(());
                }
            }
            None
        },
    )
    .await;
    let took = t0.elapsed();
    eprintln!("handover took {took:?}");
    assert_eq!(code, Some(0), "the old leader exits cleanly");
    // With a 5 s lease, anything under a second can only be the resignation working.
    assert!(took < Duration::from_secs(1), "handover took {took:?}");
    let (id, _) = leader_seen_by(survivors[0]).await.expect("leader");
    assert_ne!(id, old_id);
    // The old member's registration is gone at once (lease revoked), not after the TTL.
    let v = survivors[0]
        .get_json("/api/v1/cluster")
        .await
        .expect("cluster");
    let ids: Vec<&str> = v["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["node_id"].as_str().unwrap())
        .collect();
    assert!(!ids.contains(&old_id.as_str()), "{ids:?}");
}
