//! The exact modes: one atomic Redis call per decision (`acquire`), for low-rate limits.
//!
//! * `exact_fixed`: exactly `threshold` admissions per slice, counted in the slice hash.
//! * `exact_sliding`: at most `threshold` admissions in any window of one slice length,
//!   with a `Retry-After` pointing at the moment the oldest admission leaves the window.

use std::time::Duration;

use sluice::{Client, Config, Decision};
use sluice_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_modes_decide_in_redis() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("sdkexa");
    let host = format!("{ns}-h");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    for (name, body) in [
        (
            "fx",
            r#"{"threshold":5,"slice_ms":1000,"mode":"exact_fixed","local_limit":1,"on_failure":"deny"}"#,
        ),
        (
            "sl",
            r#"{"threshold":5,"slice_ms":2000,"mode":"exact_sliding","local_limit":1,"on_failure":"deny"}"#,
        ),
    ] {
        let (status, b) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
        assert!(status == 200 || status == 201, "{status} {b}");
    }
    let mut cfg = Config::new(redis.clone());
    cfg.namespace = ns.clone();
    cfg.host_id = host.clone();
    let client = Client::new(cfg).unwrap();
    let fx = client.task("fx").unwrap();
    let sl = client.task("sl").unwrap();
    assert!(fx.wait_ready(Duration::from_secs(10)) && sl.wait_ready(Duration::from_secs(10)));
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);

    // The synchronous path cannot make a Redis call: it says so (and never admits).
    assert_eq!(fx.try_acquire(1), Decision::WouldBlock);

    // exact_fixed: start early in a slice so the eight calls share it.
    let now = fx.now_us() / 1_000;
    let wait = 1_000 - now.rem_euclid(1_000) + 50;
    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    let slice = sluice_protocol::slice::start(fx.now_us() / 1_000, 1_000);
    let mut got = Vec::new();
    for i in 0..8 {
        got.push(if i % 2 == 0 {
            fx.acquire(1).await
        } else {
            fx.acquire_blocking(1)
        });
    }
    let allowed = got.iter().filter(|d| **d == Decision::Allowed).count();
    assert_eq!(allowed, 5, "{got:?}");
    assert!(
        got[5..]
            .iter()
            .all(|d| matches!(d, Decision::Limited { retry_after } if *retry_after <= Duration::from_secs(1))),
        "{got:?}"
    );
    let (rem, adm, rej): (i64, u64, u64) = redis::cmd("HMGET")
        .arg(keys.slice("fx", slice))
        .arg("rem")
        .arg("adm")
        .arg("rej")
        .query(&mut conn)
        .unwrap();
    assert_eq!((rem, adm, rej), (0, 5, 3));

    // exact_sliding: five in the window, then a retry-after until the oldest leaves it.
    for _ in 0..5 {
        assert_eq!(sl.acquire(1).await, Decision::Allowed);
    }
    let refused = sl.acquire(1).await;
    let Decision::Limited { retry_after } = refused else {
        panic!("expected Limited, got {refused:?}");
    };
    assert!(
        retry_after > Duration::from_millis(1_000) && retry_after <= Duration::from_millis(2_000),
        "{retry_after:?}"
    );
    tokio::time::sleep(retry_after + Duration::from_millis(20)).await;
    assert_eq!(sl.acquire(1).await, Decision::Allowed);
    let card: u64 = redis::cmd("ZCARD")
        .arg(keys.sliding_log("sl"))
        .query(&mut conn)
        .unwrap();
    assert!(card <= 5, "{card} admissions in the log");
    drop((fx, sl, client));
    remove_segment(&ns, &host);
}
