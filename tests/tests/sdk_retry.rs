//! Redis calls that are retried must not charge twice (issue 9 item 11f).
//!
//! A private Redis is made to stall with `DEBUG SLEEP` while the SDK's call is in flight: the
//! SDK's first attempt goes unanswered for more than half the pull timeout, so `call()` may
//! retry on a fresh connection; when Redis wakes up it executes whatever reached it. A TAKE
//! (exact_fixed) must not be retried (it would take twice); a PULL retry carries the same
//! request id, so Redis grants once.

use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice::{Client, Config, Decision};
use sluice_tests::*;

fn stall(url: &str, secs: f64) -> std::thread::JoinHandle<()> {
    let url = url.to_string();
    std::thread::spawn(move || {
        let mut c = redis_conn(&url);
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(secs)
            .query(&mut c)
            .expect("DEBUG SLEEP");
    })
}

async fn setup(body: &str) -> (RedisServer, Manager, String) {
    let etcd = shared_etcd();
    let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let ns = unique_ns("retry");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis.url(), &ns, "m1")).await;
    let (s, v) = m.put("/api/v1/tasks/r", body).await;
    assert!(s == 200 || s == 201, "{s} {v}");
    m.wait_rolled("r").await;
    (redis, m, ns)
}

fn client(url: &str, ns: &str, host: &str) -> Client {
    let mut cfg = Config::new(url);
    cfg.namespace = ns.to_string();
    cfg.host_id = host.to_string();
    cfg.pull_timeout = Duration::from_millis(1_000);
    Client::new(cfg).unwrap()
}

/// Waits until at least 15 s are left in the current 60 s slice; returns its start.
async fn early_in_slice() -> i64 {
    let left = 60_000 - now_ms().rem_euclid(60_000);
    if left < 15_000 {
        tokio::time::sleep(Duration::from_millis(left as u64 + 50)).await;
    }
    sluice::protocol::slice::start(now_ms(), 60_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_that_redis_answers_late_is_charged_once() {
    let (redis, _m, ns) = setup(
        r#"{"threshold":100,"slice_ms":60000,"mode":"exact_fixed","local_limit":1,"on_failure":"deny"}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let c = client(&redis.url(), &ns, &host);
    let t = c.task("r").unwrap();
    assert!(t.wait_ready(Duration::from_secs(10)));
    let start = early_in_slice().await;
    assert_eq!(t.acquire(1).await, Decision::Allowed);
    // Redis stalls for 700 ms: longer than half the pull timeout, shorter than all of it.
    let sleeper = stall(&redis.url(), 0.7);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let d = t.acquire(1).await;
    sleeper.join().unwrap();
    let keys = sluice::protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis.url());
    let (rem, adm): (i64, u64) = redis::cmd("HMGET")
        .arg(keys.slice("r", start))
        .arg("rem")
        .arg("adm")
        .query(&mut conn)
        .unwrap();
    eprintln!("decision during the stall: {d:?}; rem {rem}, adm {adm}");
    assert_eq!((rem, adm), (98, 2), "two TAKEs decided, so two charged");
    assert_eq!(d, Decision::Allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_retried_after_a_stall_is_granted_once() {
    let (redis, _m, ns) = setup(
        r#"{"threshold":1000,"slice_ms":60000,"pull":10,"local_limit":1,"on_failure":"deny"}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let c = client(&redis.url(), &ns, &host);
    let t = c.task("r").unwrap();
    assert!(t.wait_ready(Duration::from_secs(10)));
    let start = early_in_slice().await;
    assert_eq!(t.acquire_blocking(1), Decision::Allowed);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let sleeper = stall(&redis.url(), 0.7);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Spend the local quota: the refill is pulled while Redis sleeps.
    let mut spent = 1;
    while t.try_acquire(1) == Decision::Allowed {
        spent += 1;
    }
    sleeper.join().unwrap();
    // Wait for the refill, then for the background to be idle.
    assert_eq!(t.acquire_blocking(1), Decision::Allowed);
    spent += 1;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let keys = sluice::protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis.url());
    let rem: i64 = redis::cmd("HGET")
        .arg(keys.slice("r", start))
        .arg("rem")
        .query(&mut conn)
        .unwrap();
    let (seg, _) = sluice::shm::Segment::open(c.segment_path(), 1).unwrap();
    let slot = seg.slot(seg.find("r").unwrap()).unwrap();
    let granted = slot.entry(start, 60_000).granted.load(Ordering::Relaxed);
    eprintln!("spent {spent}, host granted {granted}, Redis rem {rem}");
    assert_eq!(
        1_000 - rem,
        granted as i64,
        "Redis gave away {} but the host received {granted}",
        1_000 - rem
    );
}
