//! Mode `concurrency` and locks (issue 13) against real servers: the lease and lock scripts,
//! the SDK's permits, and the end-to-end bounds with loadgens on several simulated hosts.

use std::time::Duration;

use sluice::protocol::conn::{ConnOptions, Redis, RedisConn, RedisTarget};
use sluice::protocol::lease::{self, LeaseReply, LockReply};
use sluice::protocol::scripts::{self, Fence, RollOutcome, RollRequest};
use sluice::protocol::{Fallback, Keys, Mode, OnFailure, TaskMeta};
use sluice_tests::*;

async fn conn() -> RedisConn {
    let target = RedisTarget::parse(&shared_redis()).expect("redis url");
    Redis::new(target, ConnOptions::default())
        .conn()
        .await
        .expect("connect to the shared Redis")
}

fn conc_meta(threshold: u64, lease_ms: u64, version: i64) -> TaskMeta {
    TaskMeta {
        slice_ms: 1000,
        threshold,
        pull: 0,
        local_limit: 5,
        on_failure: OnFailure::Deny,
        mode: Mode::Concurrency,
        fallback: Fallback::default(),
        version,
        lease_ms,
    }
}

/// Writes the meta of a concurrency task as a leader does (fenced ROLL, no slices).
async fn write_meta(c: &mut RedisConn, keys: &Keys, task: &str, m: &TaskMeta) {
    let f = Fence {
        term: 10,
        epoch: 1,
        stale_after_ms: 10_000,
    };
    let now = now_ms();
    let req = RollRequest {
        task,
        fence: &f,
        full: true,
        expect_rolled_to: 0,
        spec_version: m.version,
        new_rolled_to: now + 60_000,
        force: false,
        refresh: true,
        meta: Some(m),
        slices: &[],
    };
    assert_eq!(
        scripts::roll(c, keys, &req).await.expect("roll"),
        RollOutcome::Written(0)
    );
}

fn held(r: LeaseReply) -> (u64, u64, u64) {
    match r {
        LeaseReply::Held {
            holding,
            cap,
            others,
            ..
        } => (holding, cap, others),
        other => panic!("expected a lease, got {other:?}"),
    }
}

#[tokio::test]
async fn lease_script_grants_within_the_cap_and_orders_calls() {
    let ns = unique_ns("leasescript");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    // Unknown task: nothing granted, nothing written.
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "a", 5, 1).await.unwrap(),
        LeaseReply::Unknown
    );
    write_meta(&mut c, &keys, "t", &conc_meta(10, 60_000, 1)).await;
    // Host a takes 6, host b wants 6 and gets the 4 left, host c gets nothing.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 6, 1).await.unwrap()),
        (6, 10, 0)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 6, 1).await.unwrap()),
        (4, 10, 6)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 3, 1).await.unwrap()),
        (0, 10, 10)
    );
    // A retry (same seq) is idempotent; growth beyond the free room keeps what is held.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 6, 1).await.unwrap()),
        (4, 10, 6)
    );
    // a gives 4 back (shrink is always allowed); c can now take them.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 2, 2).await.unwrap()),
        (2, 10, 4)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 8, 2).await.unwrap()),
        (4, 10, 6)
    );
    // A late duplicate of a's older call (seq 1, want 6) is refused and changes nothing.
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "a", 6, 1).await.unwrap(),
        LeaseReply::Stale { holding: 2 }
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 8, 3).await.unwrap()),
        (4, 10, 6)
    );
    // Threshold decrease to 5: nobody grows while in flight is above it; holdings only fall.
    write_meta(&mut c, &keys, "t", &conc_meta(5, 60_000, 2)).await;
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 5, 3).await.unwrap()),
        (2, 5, 8)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "c", 1, 4).await.unwrap()),
        (1, 5, 6)
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 0, 2).await.unwrap()),
        (0, 5, 3)
    );
    // In flight is 3 ≤ 5 now: a may grow into the 2 free.
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "a", 9, 4).await.unwrap()),
        (4, 5, 1)
    );
    // A task of another mode is unknown to LEASE.
    let mut pooled = conc_meta(5, 0, 3);
    pooled.mode = Mode::Pooled;
    write_meta(&mut c, &keys, "t", &pooled).await;
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "a", 1, 5).await.unwrap(),
        LeaseReply::Unknown
    );
}

#[tokio::test]
async fn a_dead_hosts_lease_expires_after_its_ttl_and_retire_deletes_leases() {
    let ns = unique_ns("leaseexp");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    write_meta(&mut c, &keys, "t", &conc_meta(4, 500, 1)).await;
    let t0 = std::time::Instant::now();
    assert_eq!(
        held(
            lease::lease(&mut c, &keys, "t", "dead", 4, 1)
                .await
                .unwrap()
        )
        .0,
        4
    );
    assert_eq!(
        held(lease::lease(&mut c, &keys, "t", "b", 4, 1).await.unwrap()).0,
        0
    );
    // b keeps asking; it gets the permits once the dead host's lease has expired, not before.
    let mut seq = 2;
    let got_at = loop {
        let (h, _, _) = held(lease::lease(&mut c, &keys, "t", "b", 4, seq).await.unwrap());
        seq += 1;
        if h == 4 {
            break t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        got_at >= Duration::from_millis(450) && got_at < Duration::from_millis(1_000),
        "{got_at:?}"
    );
    // RETIRE (DELETE of the task) deletes the lease hash.
    let f = Fence {
        term: 10,
        epoch: 1,
        stale_after_ms: 10_000,
    };
    scripts::retire(&mut c, &keys, "t", &f, 60_000, 99, false)
        .await
        .unwrap();
    let mut sc = redis_conn(&shared_redis());
    let n: i64 = redis::cmd("EXISTS")
        .arg(keys.lease("t"))
        .query(&mut sc)
        .unwrap();
    assert_eq!(n, 0);
    assert_eq!(
        lease::lease(&mut c, &keys, "t", "b", 1, seq).await.unwrap(),
        LeaseReply::Unknown
    );
}

#[tokio::test]
async fn lock_scripts_hand_out_increasing_tokens_and_check_them() {
    let ns = unique_ns("lockscript");
    let keys = Keys::new(&ns).unwrap();
    let mut c = conn().await;
    let a = lease::lock_acquire(&mut c, &keys, "l", "owner-a", 60_000)
        .await
        .unwrap();
    let LockReply::Acquired { token: ta } = a else {
        panic!("{a:?}")
    };
    // Retry of the same attempt: the same token.
    assert_eq!(
        lease::lock_acquire(&mut c, &keys, "l", "owner-a", 60_000)
            .await
            .unwrap(),
        LockReply::Acquired { token: ta }
    );
    match lease::lock_acquire(&mut c, &keys, "l", "owner-b", 60_000)
        .await
        .unwrap()
    {
        LockReply::Busy { token, pttl_ms } => {
            assert_eq!(token, ta);
            assert!(pttl_ms > 50_000, "{pttl_ms}");
        }
        other => panic!("{other:?}"),
    }
    // Wrong tokens neither renew nor release.
    assert!(
        !lease::lock_renew(&mut c, &keys, "l", ta + 1, 1_000)
            .await
            .unwrap()
    );
    assert!(
        !lease::lock_release(&mut c, &keys, "l", ta + 1)
            .await
            .unwrap()
    );
    // Renew to a short TTL; it expires; b gets a higher token; a's release is refused.
    assert!(
        lease::lock_renew(&mut c, &keys, "l", ta, 200)
            .await
            .unwrap()
    );
    let tb = wait_until(
        "the lock to expire",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let keys = keys.clone();
            async move {
                let mut c = conn().await;
                match lease::lock_acquire(&mut c, &keys, "l", "owner-b", 60_000)
                    .await
                    .unwrap()
                {
                    LockReply::Acquired { token } => Some(token),
                    LockReply::Busy { .. } => None,
                }
            }
        },
    )
    .await;
    assert!(tb > ta);
    assert!(!lease::lock_release(&mut c, &keys, "l", ta).await.unwrap());
    assert!(lease::lock_release(&mut c, &keys, "l", tb).await.unwrap());
    let LockReply::Acquired { token: tc } = lease::lock_acquire(&mut c, &keys, "l", "c", 1_000)
        .await
        .unwrap()
    else {
        panic!("free lock not acquired")
    };
    assert!(tc > tb);
}

/// A manager with concurrency task `c` (`body`) and a namespace of its own.
async fn manager_with(prefix: &str, body: &str) -> (Manager, String) {
    let etcd = shared_etcd();
    let ns = unique_ns(prefix);
    let m = Manager::start(ManagerOpts::new(&etcd, &shared_redis(), &ns, "m1")).await;
    let (s, v) = m.put("/api/v1/tasks/c", body).await;
    assert!(s == 200 || s == 201, "{s} {v}");
    let keys = Keys::new(&ns).unwrap();
    let meta = keys.meta("c");
    wait_until(
        "the leader to write the meta",
        Duration::from_secs(15),
        Duration::from_millis(50),
        || {
            let meta = meta.clone();
            async move {
                let mut c = redis_conn(&shared_redis());
                let mode: Option<String> = redis::cmd("HGET")
                    .arg(&meta)
                    .arg("mode")
                    .query(&mut c)
                    .ok()?;
                (mode.as_deref() == Some("concurrency")).then_some(())
            }
        },
    )
    .await;
    (m, ns)
}

#[tokio::test]
async fn permits_are_bounded_per_host_released_on_drop_and_counted() {
    let (_m, ns) = manager_with(
        "permits",
        r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 2000, "on_failure": "deny"}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, &host)).unwrap();
    let task = client.task("c").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    // try_acquire is not the API of a concurrency task.
    assert_eq!(task.try_acquire(1), sluice::Decision::WouldBlock);
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(
            task.permit_timeout(Duration::from_secs(5))
                .await
                .expect("permit"),
        );
    }
    assert_eq!(
        task.try_permit().unwrap_err(),
        sluice::PermitError::Full,
        "a sixth permit"
    );
    assert_eq!(
        task.permit_timeout(Duration::from_millis(100))
            .await
            .unwrap_err(),
        sluice::PermitError::Timeout
    );
    let st = task.permit_stats().unwrap();
    assert_eq!((st.in_use, st.limit, st.cap), (5, 5, 5), "{st:?}");
    assert!(st.leased);
    // Redis agrees: this host holds 5.
    let mut c = redis_conn(&shared_redis());
    let entry: String = redis::cmd("HGET")
        .arg(Keys::new(&ns).unwrap().lease("c"))
        .arg(&host)
        .query(&mut c)
        .unwrap();
    assert!(entry.starts_with("5:"), "{entry}");
    held.pop();
    held.pop().unwrap().release();
    assert_eq!(task.permit_stats().unwrap().in_use, 3);
    let p = task.try_permit().expect("a released permit is free again");
    assert!(!p.is_fallback());
    drop(p);
    drop(held);
    assert_eq!(task.permit_stats().unwrap().in_use, 0);
    // Idle permits go back to Redis at the next renewal (a quarter of the TTL).
    wait_until(
        "idle permits to be given back",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let ns = ns.clone();
            let host = host.clone();
            async move {
                let mut c = redis_conn(&shared_redis());
                let entry: String = redis::cmd("HGET")
                    .arg(Keys::new(&ns).unwrap().lease("c"))
                    .arg(&host)
                    .query(&mut c)
                    .ok()?;
                entry.starts_with("0:").then_some(())
            }
        },
    )
    .await;
}
