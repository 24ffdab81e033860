//! etcd stopped for 10 s: slices keep their values, nobody acts as leader without a live lease,
//! and rolling resumes when etcd returns.

use std::time::{Duration, Instant};

use sluice_protocol::{Keys, meta_field};
use sluice_tests::*;

const TTL: Duration = Duration::from_secs(2);

/// A numeric field of the task's meta (0 when absent).
fn meta_i64(conn: &mut redis::Connection, keys: &Keys, task: &str, field: &str) -> i64 {
    redis::cmd("HGET")
        .arg(keys.meta(task))
        .arg(field)
        .query::<Option<i64>>(conn)
        .unwrap()
        .unwrap_or(0)
}

fn rolled_to(conn: &mut redis::Connection, keys: &Keys, task: &str) -> i64 {
    meta_i64(conn, keys, task, meta_field::ROLLED_TO)
}

fn fenced_ms(conn: &mut redis::Connection, keys: &Keys, task: &str) -> i64 {
    meta_i64(conn, keys, task, meta_field::FENCED_MS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_costs_nothing_and_nobody_leads_without_a_lease() {
    let ns = unique_ns("etcd");
    let keys = Keys::new(&ns).unwrap();
    let mut etcd = EtcdServer::start();
    let redis_url = shared_redis();
    let ms = start_replicas(&etcd.endpoint(), &redis_url, &ns, 3, &[]).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    wait_for_leader(&refs, Duration::from_secs(15)).await;
    let (s, _) = ms[0].put("/api/v1/tasks/o", r#"{"threshold": 77}"#).await;
    assert_eq!(s, 201);
    let mut conn = redis_conn(&redis_url);
    let before = wait_until(
        "slices",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let now = now_ms();
            let caps = slice_caps(&mut conn, &ns, "o", 1000, now, now + 50_000);
            async move { caps.iter().all(|(_, c)| *c == Some(77)).then_some(caps) }
        },
    )
    .await;
    let rolled_before = rolled_to(&mut conn, &keys, "o");

    etcd.kill();
    let down_at = Instant::now();
    let mut nobody_leads_since: Option<Instant> = None;
    let mut rolled_at_quiet: Option<i64> = None;
    let mut fenced_at_quiet: Option<i64> = None;
    while down_at.elapsed() < Duration::from_secs(10) {
        // Slices written before the outage keep their values.
        let now = now_ms();
        for (start, cap) in slice_caps(&mut conn, &ns, "o", 1000, now, before.last().unwrap().0 + 1)
        {
            assert_eq!(cap, Some(77), "slice {start} changed during the outage");
        }
        let mut leaders = 0;
        for m in &ms {
            if m.says_leader().await {
                leaders += 1;
            }
        }
        assert!(leaders <= 1);
        if leaders == 0 {
            let since = *nobody_leads_since.get_or_insert(Instant::now());
            // A second after the step-down (a call in flight then has landed), rolled_to is
            // what it stays until a leader is elected again.
            if since.elapsed() >= Duration::from_secs(1) && rolled_at_quiet.is_none() {
                rolled_at_quiet = Some(rolled_to(&mut conn, &keys, "o"));
                fenced_at_quiet = Some(fenced_ms(&mut conn, &keys, "o"));
            }
        } else {
            // A leader may only remain while its lease can still be alive.
            assert!(
                down_at.elapsed() < TTL + Duration::from_millis(500),
                "a replica still acts as leader {:?} after etcd went away",
                down_at.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let since = nobody_leads_since.expect("the leader must step down during the outage");
    eprintln!(
        "leader stepped down {:?} after etcd stopped",
        since - down_at
    );
    assert!(since - down_at <= TTL + Duration::from_millis(500));
    let rolled_during = rolled_to(&mut conn, &keys, "o");
    // The leader may still extend the window while its lease lives (by a step of up to 10 s
    // since issue 27), never after it stepped down.
    assert!(
        rolled_during <= rolled_before + 12_000,
        "{rolled_during} vs {rolled_before}"
    );
    assert_eq!(
        Some(rolled_during),
        rolled_at_quiet,
        "nobody rolled while no lease was live"
    );
    // Nor refreshed the fence (every fenced write does, at least every 2.5 s): a deposed
    // leader that kept writing would show here even between two steps of the window.
    assert_eq!(
        Some(fenced_ms(&mut conn, &keys, "o")),
        fenced_at_quiet,
        "nobody wrote the fence while no lease was live"
    );

    etcd.restart();
    let back_at = Instant::now();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    eprintln!(
        "leader {} elected {:?} after etcd returned",
        ms[leader].opts.node_id,
        back_at.elapsed()
    );
    wait_until(
        "rolling resumes",
        Duration::from_secs(5),
        Duration::from_millis(100),
        || {
            let r = rolled_to(&mut conn, &keys, "o");
            async move { (r >= now_ms() + 59_000).then_some(()) }
        },
    )
    .await;
    // Slices ahead are complete again.
    let now = now_ms();
    assert!(
        slice_caps(&mut conn, &ns, "o", 1000, now, now + 59_000)
            .iter()
            .all(|(_, c)| *c == Some(77))
    );
}
