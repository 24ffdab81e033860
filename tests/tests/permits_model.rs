//! Mode `concurrency` driven step by step through the SDK's decision core
//! (`sluice::concurrency::{take, begin_call, finish_call, …}`) on real host segments, against
//! a real Redis: the test is the scheduler, so it can stall a lease holder between a LEASE
//! call and its answer, let another process take the lease lock over, and deliver the answer
//! late — interleavings the background thread produces only under rare stalls.

use std::path::Path;

use sluice::concurrency::{self as conc, LeaseOutcome, LeaseParams};
use sluice::shm::{ConcCells, LockAttempt, Segment};
use sluice_protocol::lease::{self, LeaseReply};
use sluice_protocol::{Keys, OnFailure};
use sluice_tests::*;

/// Lease-lock timeout the SDK uses with the default pull timeout (3 × 1 s).
const LOCK_TIMEOUT_MS: u64 = 3_000;

/// One process of a host: its own open of the host's segment (its own participant).
struct Process {
    seg: Segment,
    slot: usize,
}

impl Process {
    fn open(path: &Path, task: &str) -> Self {
        let (seg, _) = Segment::open(path, 8).expect("open segment");
        let slot = seg.find_or_claim(task, 1_000).expect("a slot");
        Self { seg, slot }
    }

    fn k(&self) -> &ConcCells {
        &self.seg.slot(self.slot).expect("slot").conc
    }

    /// Takes permits until the host refuses; how many it handed out.
    fn take_all(&self) -> u64 {
        let mut n = 0;
        while conc::take(&self.seg, self.k(), sluice::clock::boot_ms).is_ok() {
            n += 1;
            assert!(n <= 1_000, "unbounded permits");
        }
        n
    }
}

fn params(threshold: u64) -> LeaseParams {
    LeaseParams {
        on_failure: OnFailure::Deny,
        local_limit: 0,
        threshold,
    }
}

/// The permits Redis counts for `host` now (0 once its entry expired).
fn redis_holding(keys: &Keys, task: &str, host: &str) -> u64 {
    let mut c = redis_conn(&shared_redis());
    let e: Option<String> = redis::cmd("HGET")
        .arg(keys.lease(task))
        .arg(host)
        .query(&mut c)
        .unwrap();
    let Some(e) = e else { return 0 };
    let f: Vec<i64> = e.split(':').map(|x| x.parse().unwrap()).collect();
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut c).unwrap();
    let now_ms = s * 1_000 + us / 1_000;
    if f[1] > now_ms { f[0] as u64 } else { 0 }
}

/// Item 7 of issue 23: process A of a host sends LEASE (want 5, cap 5) and stalls before it
/// applies the answer; past the lease lock's timeout process B of the same host takes the lock
/// over, the threshold is lowered to 2, and B's LEASE gives every permit back (no demand left).
/// A's answer then arrives late. Applying it would raise the host's limit to 5 while Redis
/// counts the host at 0 and lets another host take both permits of the new cap.
#[tokio::test]
async fn a_late_lease_reply_after_a_takeover_hands_out_nothing_redis_counts_as_free() {
    let ns = unique_ns("latelease");
    let keys = Keys::new(&ns).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    write_meta(&mut c, &keys, "t", &conc_meta(5, 60_000, 1)).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("segment");
    let a = Process::open(&path, "t");
    let b = Process::open(&path, "t");
    let host = "h";

    // A: five callers wait; A holds the lease lock and sends LEASE for 5 …
    a.k().waiting.store(5, std::sync::atomic::Ordering::Release);
    let lock_a = a.seg.lock(&a.k().lease_lock);
    let LockAttempt::Acquired { token: token_a, .. } =
        lock_a.try_lock(sluice::clock::host_ms(), LOCK_TIMEOUT_MS)
    else {
        panic!("the lease lock is free")
    };
    let call_a = conc::begin_call(
        a.k(),
        &params(5),
        0,
        sluice::clock::boot_ms(),
        sluice::clock::host_us(),
    );
    assert_eq!(call_a.want, 5);
    let reply_a = lease::lease(&mut c, &keys, "t", host, call_a.want, call_a.seq)
        .await
        .unwrap();
    assert!(
        matches!(reply_a, LeaseReply::Held { holding: 5, .. }),
        "{reply_a:?}"
    );
    // … and stalls here. The callers give up; the threshold is lowered to 2.
    a.k().waiting.store(0, std::sync::atomic::Ordering::Release);
    write_meta(&mut c, &keys, "t", &conc_meta(2, 60_000, 2)).await;

    // B finds the lease lock older than its timeout and takes it over; with no demand it
    // gives the host's permits back.
    let lock_b = b.seg.lock(&b.k().lease_lock);
    let later = sluice::clock::host_ms() + LOCK_TIMEOUT_MS as i64 + 1;
    let LockAttempt::Acquired {
        token: token_b,
        took_over_from: Some(_),
    } = lock_b.try_lock(later, LOCK_TIMEOUT_MS)
    else {
        panic!("B did not take the stale lease lock over")
    };
    let call_b = conc::begin_call(
        b.k(),
        &params(5),
        0,
        sluice::clock::boot_ms(),
        sluice::clock::host_us(),
    );
    assert_eq!(call_b.want, 0);
    let reply_b = lease::lease(&mut c, &keys, "t", host, call_b.want, call_b.seq)
        .await
        .unwrap();
    assert!(
        matches!(
            reply_b,
            LeaseReply::Held {
                holding: 0,
                cap: 2,
                ..
            }
        ),
        "{reply_b:?}"
    );
    conc::finish_call(
        b.k(),
        &params(5),
        &call_b,
        LeaseOutcome::Reply(reply_b),
        sluice::clock::boot_ms(),
        lock_b.holds(token_b),
    );
    assert!(lock_b.unlock(token_b));

    // A wakes up and delivers its late answer: ignored, because A lost the lease lock and,
    // on its own, because a newer call (B's) has begun since A's.
    assert!(!lock_a.holds(token_a));
    for holds_lock in [lock_a.holds(token_a), true] {
        let done = conc::finish_call(
            a.k(),
            &params(5),
            &call_a,
            LeaseOutcome::Reply(reply_a),
            sluice::clock::boot_ms(),
            holds_lock,
        );
        assert_eq!(done, conc::Finished::Superseded);
    }
    assert!(!lock_a.unlock(token_a), "A no longer holds the lease lock");

    // Another host takes the 2 permits Redis counts as free.
    let other = lease::lease(&mut c, &keys, "t", "other", 2, 1)
        .await
        .unwrap();
    assert!(
        matches!(other, LeaseReply::Held { holding: 2, .. }),
        "{other:?}"
    );

    // This host must hand out no more than Redis counts for it (0): in flight ≤ the cap of 2.
    let here = a.take_all() + b.take_all();
    let counted = redis_holding(&keys, "t", host);
    assert!(
        here <= counted,
        "the host handed out {here} permits while Redis counts {counted} for it (and 2 for \
         another host, cap 2)"
    );
}

/// Waits given by the caller are bounded by nothing but the caller: `Duration::MAX` (a wait
/// too long to add to the clock) is a wait without end, never a panic; lock TTLs outside
/// 100 ms ..= 1 day are refused by name.
#[tokio::test]
async fn waits_of_any_length_never_panic_and_lock_ttls_are_bounded() {
    let ns = unique_ns("waitmax");
    let keys = Keys::new(&ns).unwrap();
    let mut c = protocol_conn(&shared_redis()).await;
    write_meta(&mut c, &keys, "t", &conc_meta(2, 60_000, 1)).await;
    let host = format!("{ns}-h");
    let _segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&shared_redis(), &ns, &host)).unwrap();
    let task = client.task("t").unwrap();
    assert!(task.wait_ready(std::time::Duration::from_secs(10)));
    let p = task
        .permit_timeout(std::time::Duration::MAX)
        .await
        .expect("a free permit");
    let q = task
        .permit_blocking(std::time::Duration::MAX)
        .expect("the second");
    drop((p, q));
    let g = client
        .lock_timeout(
            "l",
            std::time::Duration::from_secs(5),
            std::time::Duration::MAX,
        )
        .await
        .expect("a free lock");
    assert!(g.release().await.unwrap());
    for ttl in [
        std::time::Duration::from_millis(99),
        sluice::MAX_LOCK_TTL + std::time::Duration::from_millis(1),
        std::time::Duration::MAX,
    ] {
        let e = client.try_lock("l", ttl).await.expect_err("refused");
        assert_eq!(e, sluice::LockError::Ttl(ttl));
        assert!(e.to_string().contains("ttl"), "{e}");
    }
}
