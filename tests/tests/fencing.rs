//! A leader paused past its lease (SIGSTOP) must not write once it wakes (SIGCONT): the new
//! leader's threshold change must never be overwritten with the old value.

use std::time::{Duration, Instant};

use sluice_protocol::{Keys, meta_field};
use sluice_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_never_overwrites_the_new_leaders_threshold() {
    let ns = unique_ns("fence");
    let redis_url = shared_redis();
    let keys = Keys::new(&ns).unwrap();
    // A short tick makes the old leader's loop fire many times after it wakes up.
    let ms = start_replicas(&shared_etcd(), &redis_url, &ns, 3, &["--tick", "100ms"]).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (old, old_term) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let (status, _) = ms[0].put("/api/v1/tasks/f", r#"{"threshold": 100}"#).await;
    assert_eq!(status, 201);
    let mut conn = redis_conn(&redis_url);
    let all_caps = |conn: &mut redis::Connection| {
        let now = now_ms();
        slice_caps(conn, &ns, "f", 1000, now, now + 30_000)
    };
    wait_until(
        "slices at 100",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let ok = all_caps(&mut conn).iter().all(|(_, c)| *c == Some(100));
            async move { ok.then_some(()) }
        },
    )
    .await;

    signal(ms[old].proc.pid(), libc::SIGSTOP);
    let others: Vec<&Manager> = ms
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != old)
        .map(|(_, m)| m)
        .collect();
    let (new_idx, new_term) = wait_for_leader(&others, Duration::from_secs(10)).await;
    assert!(new_term > old_term);
    // The new leader has taken over the task: its term is the fence now.
    wait_until(
        "fence raised",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let t: Option<i64> = redis::cmd("HGET")
                .arg(keys.meta("f"))
                .arg(meta_field::TERM)
                .query(&mut conn)
                .ok()
                .flatten();
            async move { (t == Some(new_term)).then_some(()) }
        },
    )
    .await;

    let (status, v) = others[new_idx]
        .put("/api/v1/tasks/f", r#"{"threshold": 200}"#)
        .await;
    assert_eq!(status, 200, "{v}");
    wait_until(
        "slices at 200",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let ok = all_caps(&mut conn).iter().all(|(_, c)| *c == Some(200));
            async move { ok.then_some(()) }
        },
    )
    .await;

    // Wake the old leader; for 5 s (50 of its ticks) no slice may go back to 100.
    signal(ms[old].proc.pid(), libc::SIGCONT);
    let until = Instant::now() + Duration::from_secs(5);
    let mut checks = 0;
    while Instant::now() < until {
        for (start, cap) in all_caps(&mut conn) {
            assert_eq!(
                cap,
                Some(200),
                "slice {start} holds {cap:?} after the old leader woke"
            );
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(checks > 50);
    assert!(
        !ms[old].says_leader().await,
        "the old leader must not act as leader"
    );
    assert!(
        ms[old].proc.log().contains("lease"),
        "the old leader should log its lost lease"
    );
}
