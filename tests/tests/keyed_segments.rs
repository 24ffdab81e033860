//! The key table across segment generations: real etcd, Redis and `sluice-manager`.
//!
//! A host segment is replaced when a process asks for more slots than it has (or finds an
//! incompatible layout) while older processes still map the old file. The key table
//! (`<segment>.keys`) outlives that: both generations of the segment use the same table. A
//! key entry must belong to one segment, or a task of the new segment whose slot has the same
//! index and generation as another task's slot in the old one spends that task's key quota.

use std::time::Duration;

use sluice_tests::*;

async fn keyed_task(m: &Manager, task: &str, body: &str) {
    let (status, resp) = m.put(&format!("/api/v1/tasks/{task}"), body).await;
    assert!(status == 200 || status == 201, "{status} {resp}");
    m.wait_rolled(task).await;
}

/// Client A (4 slots) holds 1,000 permits of key `k` of task `big`; client B (8 slots) then
/// replaces the segment and decides key `k` of task `small` (2 per key per slice), whose slot
/// in the new segment has the same index and generation as `big`'s in the old one. B admits
/// `small`'s 2, never A's permits; A keeps deciding from its own entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_segment_never_spends_the_old_segments_key_quota() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyseg");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "big",
        r#"{"threshold":1000,"slice_ms":5000,"keyed":true}"#,
    )
    .await;
    keyed_task(
        &m,
        "small",
        r#"{"threshold":2,"slice_ms":5000,"keyed":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);

    let mut cfg_a = sdk_config(&redis, &ns, &host);
    cfg_a.max_tasks = 4;
    let a = sluice::Client::new(cfg_a).unwrap();
    let big = a.task("big").unwrap();
    assert!(big.wait_ready(Duration::from_secs(10)));
    let ka = big.key("k").unwrap();

    let mut cfg_b = sdk_config(&redis, &ns, &host);
    cfg_b.max_tasks = 8;
    let b = sluice::Client::new(cfg_b).unwrap();
    let small = b.task("small").unwrap();
    assert!(small.wait_ready(Duration::from_secs(10)));
    let kb = small.key("k").unwrap();

    let slice_us = 5_000_000i64;
    loop {
        if small.now_us() % slice_us > 3_000_000 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        let start = small.now_us() / slice_us;
        assert!(ka.fill_local(1_000, false), "A's entry for k");
        let mut admitted_b = 0;
        for _ in 0..10 {
            if kb.acquire(1).await.is_allowed() {
                admitted_b += 1;
            }
        }
        let mut admitted_a = 0;
        for _ in 0..10 {
            if ka.try_acquire(1).is_allowed() {
                admitted_a += 1;
            }
        }
        if small.now_us() / slice_us != start {
            continue;
        }
        assert_eq!(
            admitted_b, 2,
            "task small's key k admits its own limit, not task big's permits"
        );
        assert_eq!(admitted_a, 10, "A still decides from its own entry");
        break;
    }
}
