//! Redis calls that are retried must not charge twice (issue 9 item 11f).
//!
//! A private Redis is made to stall with `DEBUG SLEEP` while the SDK's call is in flight: the
//! SDK's first attempt goes unanswered for more than half the pull timeout, so `call()` may
//! retry on a fresh connection; when Redis wakes up it executes whatever reached it. A PULL
//! and a TAKE (exact_fixed) retry carry the same request id as their first attempt, so Redis
//! grants (takes) once.

use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice::{Client, Decision};
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

/// A private Redis that accepts `DEBUG`, a manager with task `r` (`body`), and a client of
/// one host with the task ready, early in a 60 s slice (its start is returned).
struct Setup {
    redis: RedisServer,
    ns: String,
    _m: Manager,
    _segments: SegmentGuard,
    client: Client,
    task: sluice::Task,
    start: i64,
}

async fn setup(body: &str) -> Setup {
    let etcd = shared_etcd();
    let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let ns = unique_ns("retry");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis.url(), &ns, "m1")).await;
    let (s, v) = m.put("/api/v1/tasks/r", body).await;
    assert!(s == 200 || s == 201, "{s} {v}");
    m.wait_rolled("r").await;
    let host = format!("{ns}-h");
    let segments = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&redis.url(), &ns, &host);
    cfg.pull_timeout = Duration::from_millis(1_000);
    let client = Client::new(cfg).unwrap();
    let task = client.task("r").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let start = early_in_slice().await;
    Setup {
        redis,
        ns,
        _m: m,
        _segments: segments,
        client,
        task,
        start,
    }
}

/// Creates slice `key` (as the leader would) with `cap = rem = cap`, expiring in `ttl_ms`.
fn make_slice(sync: &mut redis::Connection, key: &str, cap: u64, ttl_ms: u64) {
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg("cap")
        .arg(cap)
        .arg("rem")
        .arg(cap)
        .query(sync)
        .unwrap();
    let _: () = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(ttl_ms)
        .query(sync)
        .unwrap();
}

/// Keys of a fresh namespace, an async connection for the scripts and a sync one for checks,
/// on the shared Redis.
async fn script_conns(
    prefix: &str,
) -> (
    sluice_protocol::Keys,
    sluice_protocol::conn::RedisConn,
    redis::Connection,
) {
    let url = shared_redis();
    let keys = sluice_protocol::Keys::new(&unique_ns(prefix)).unwrap();
    let redis = sluice_protocol::conn::Redis::new(
        sluice_protocol::conn::RedisTarget::parse(&url).unwrap(),
        Default::default(),
    );
    (keys, redis.conn().await.unwrap(), redis_conn(&url))
}

/// Waits until at least 15 s are left in the current 60 s slice; returns its start.
async fn early_in_slice() -> i64 {
    let left = 60_000 - now_ms().rem_euclid(60_000);
    if left < 15_000 {
        tokio::time::sleep(Duration::from_millis(left as u64 + 50)).await;
    }
    sluice_protocol::slice::start(now_ms(), 60_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_that_redis_answers_late_is_charged_once() {
    let su = setup(
        r#"{"threshold":100,"slice_ms":60000,"mode":"exact_fixed","local_limit":1,"on_failure":"deny"}"#,
    )
    .await;
    let (redis, ns, t, start) = (&su.redis, &su.ns, &su.task, su.start);
    assert_eq!(t.acquire(1).await, Decision::Allowed);
    // Redis stalls for 700 ms: longer than half the pull timeout, shorter than all of it.
    let sleeper = stall(&redis.url(), 0.7);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let d = t.acquire(1).await;
    sleeper.join().unwrap();
    let keys = sluice_protocol::Keys::new(ns).unwrap();
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
    let su = setup(
        r#"{"threshold":1000,"slice_ms":60000,"pull":10,"local_limit":1,"on_failure":"deny"}"#,
    )
    .await;
    let (redis, ns, t, start) = (&su.redis, &su.ns, &su.task, su.start);
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
    let keys = sluice_protocol::Keys::new(ns).unwrap();
    let mut conn = redis_conn(&redis.url());
    let rem: i64 = redis::cmd("HGET")
        .arg(keys.slice("r", start))
        .arg("rem")
        .query(&mut conn)
        .unwrap();
    let (seg, _) = sluice::shm::Segment::open(su.client.segment_path(), 1).unwrap();
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

/// The worker scripts' contracts, against a real Redis: a PULL replayed with the same request
/// id and a FLUSH replayed with the same (or an older) sequence number change nothing; PULL
/// and TAKE grant only within the slice's window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_pulls_and_flushes_change_nothing_and_windows_hold() {
    use sluice_protocol::scripts::{self, ExactReply, PullReply, PullRequest, SliceCounters};
    let (keys, mut c, mut sync) = script_conns("script").await;
    let start = early_in_slice().await;
    let key = keys.slice("t", start);
    make_slice(&mut sync, &key, 100, 120_000);
    let rem = |sync: &mut redis::Connection| -> i64 {
        redis::cmd("HGET").arg(&key).arg("rem").query(sync).unwrap()
    };
    let req = |id: &'static str, want: u64| PullRequest {
        task: "t",
        start_ms: start,
        slice_ms: 60_000,
        want,
        host_id: "h1",
        request_id: id,
        counters: None,
    };
    let granted = |r: PullReply| match r {
        PullReply::Granted {
            granted, replayed, ..
        } => (granted, replayed),
        other => panic!("{other:?}"),
    };
    // A pull, then its retry (same id): one grant.
    let first = scripts::pull(&mut c, &keys, &req("a", 10)).await.unwrap();
    assert_eq!(granted(first), (10, false));
    let again = scripts::pull(&mut c, &keys, &req("a", 10)).await.unwrap();
    assert_eq!(granted(again), (10, true));
    assert_eq!(rem(&mut sync), 90, "a replayed pull must not grant again");
    let next = scripts::pull(&mut c, &keys, &req("b", 5)).await.unwrap();
    assert_eq!(granted(next), (5, false));
    assert_eq!(rem(&mut sync), 85);
    // Another host's ids are its own.
    let other = PullRequest {
        host_id: "h2",
        ..req("b", 5)
    };
    assert_eq!(
        granted(scripts::pull(&mut c, &keys, &other).await.unwrap()),
        (5, false)
    );
    assert_eq!(rem(&mut sync), 80);

    // FLUSH: a retry (same seq) or an older seq is skipped, per host.
    let batch = |adm| {
        vec![(
            start,
            SliceCounters {
                admitted: adm,
                ..SliceCounters::default()
            },
        )]
    };
    let adm = |sync: &mut redis::Connection| -> u64 {
        redis::cmd("HGET").arg(&key).arg("adm").query(sync).unwrap()
    };
    assert_eq!(
        scripts::flush(&mut c, &keys, "t", "h1", 100, &batch(3))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        scripts::flush(&mut c, &keys, "t", "h1", 100, &batch(3))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        scripts::flush(&mut c, &keys, "t", "h1", 99, &batch(7))
            .await
            .unwrap(),
        1
    );
    assert_eq!(adm(&mut sync), 3, "a replayed flush must not count again");
    scripts::flush(&mut c, &keys, "t", "h1", 101, &batch(2))
        .await
        .unwrap();
    scripts::flush(&mut c, &keys, "t", "h2", 50, &batch(1))
        .await
        .unwrap();
    assert_eq!(adm(&mut sync), 6);

    // All or nothing (review of issue 23): a flush one of whose counters would overflow is
    // refused before any write — before, the `adm` added ahead of the failing `rej` stayed
    // without the sequence number, so the SDK's resend added it twice.
    // (`ok` here: `rej` and `wrej` saturate instead, below.)
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("ok")
        .arg(i64::MAX - 5)
        .query(&mut sync)
        .unwrap();
    let both = vec![(
        start,
        SliceCounters {
            admitted: 3,
            ok: 10,
            ..SliceCounters::default()
        },
    )];
    for _ in 0..2 {
        let e = scripts::flush(&mut c, &keys, "t", "h1", 102, &both)
            .await
            .expect_err("an overflowing flush is refused");
        assert!(e.to_string().contains("overflow"), "{e}");
        // A plain ERR: the SDK tells a refusal (dropped) from a lost answer (resent) by it.
        assert_eq!(
            e.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "{e}"
        );
        assert_eq!(adm(&mut sync), 6, "a refused flush wrote nothing");
    }
    // A stored value HINCRBY would refuse (leading zeros: review of issue 23, F8) refuses the
    // whole flush before any write, like an overflow (before, it passed the check and HINCRBY
    // failed after `adm` was added).
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("ok")
        .arg("0012")
        .query(&mut sync)
        .unwrap();
    let e = scripts::flush(&mut c, &keys, "t", "h1", 102, &both)
        .await
        .expect_err("a stored 0012 is refused");
    assert!(e.to_string().contains("not an integer"), "{e}");
    assert_eq!(adm(&mut sync), 6, "a refused flush wrote nothing");
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("ok")
        .arg(0)
        .query(&mut sync)
        .unwrap();
    scripts::flush(&mut c, &keys, "t", "h1", 103, &batch(3))
        .await
        .unwrap();
    assert_eq!(adm(&mut sync), 9);
    // Large deltas are added exactly: a Lua number would reach HINCRBY as `1e+17` (refused,
    // after `adm` was added). `rej` set back first.
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("rej")
        .arg(0)
        .query(&mut sync)
        .unwrap();
    let large = vec![(
        start,
        SliceCounters {
            admitted: 1,
            rejected: 100_000_000_000_000_000,
            ..SliceCounters::default()
        },
    )];
    scripts::flush(&mut c, &keys, "t", "h1", 104, &large)
        .await
        .expect("a large delta is added");
    let rej: u64 = redis::cmd("HGET")
        .arg(&key)
        .arg("rej")
        .query(&mut sync)
        .unwrap();
    assert_eq!((adm(&mut sync), rej), (10, 100_000_000_000_000_000));
    // `rej` and `wrej` are statistics of refused costs, counted at face value (review of
    // issue 23, finding 6): near the limit they saturate at 9.2e18 and the flush's `adm` is
    // still counted — before, the whole slice's counters were refused and dropped.
    let field = |sync: &mut redis::Connection, f: &str| -> String {
        redis::cmd("HGET").arg(&key).arg(f).query(sync).unwrap()
    };
    for (stored, expect) in [
        ("9199999500000000000", "9200000000000000000"),
        ("9223372036854775800", "9223372036854775800"),
    ] {
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg("rej")
            .arg(stored)
            .arg("wrej")
            .arg(stored)
            .query(&mut sync)
            .unwrap();
        let before = adm(&mut sync);
        let hostile = vec![(
            start,
            SliceCounters {
                admitted: 1,
                rejected: 1_000_000_000_000,
                would_reject: 1_000_000_000_000,
                ..SliceCounters::default()
            },
        )];
        let seq = if stored.starts_with("9199") { 105 } else { 106 };
        scripts::flush(&mut c, &keys, "t", "h1", seq, &hostile)
            .await
            .expect("rej and wrej saturate: the flush is counted");
        assert_eq!(adm(&mut sync), before + 1, "adm counted with saturated rej");
        assert_eq!(field(&mut sync, "rej"), expect, "rej from {stored}");
        assert_eq!(field(&mut sync, "wrej"), expect, "wrej from {stored}");
    }

    // Windows: an ended slice and one starting in 2 slices grant nothing and count nothing;
    // the next slice (prefetch) is granted.
    for (s, len) in [(start - 120_000, 60_000), (start + 120_000, 60_000)] {
        let k = keys.slice("t", s);
        make_slice(&mut sync, &k, 10, 120_000);
        let r = PullRequest {
            start_ms: s,
            slice_ms: len,
            ..req("w", 5)
        };
        assert!(
            matches!(
                scripts::pull(&mut c, &keys, &r).await.unwrap(),
                PullReply::OutsideWindow { .. }
            ),
            "slice {s}"
        );
        assert!(matches!(
            scripts::take(&mut c, &keys, "t", s, len, 1, "")
                .await
                .unwrap(),
            ExactReply::OutsideWindow { .. }
        ));
        let (rem, adm, rej): (i64, Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(&k)
            .arg("rem")
            .arg("adm")
            .arg("rej")
            .query(&mut sync)
            .unwrap();
        assert_eq!((rem, adm, rej), (10, None, None));
    }
    let k = keys.slice("t", start + 60_000);
    make_slice(&mut sync, &k, 10, 180_000);
    let r = PullRequest {
        start_ms: start + 60_000,
        ..req("n", 4)
    };
    assert_eq!(
        granted(scripts::pull(&mut c, &keys, &r).await.unwrap()),
        (4, false)
    );
}

/// Switching a task between `exact_fixed` (or `pooled`) and `exact_sliding` inside a slice
/// keeps one cap for the slice: SLIDE takes from the slice's `rem` too, so what one mode
/// admitted counts for the other (before, the sliding log started empty: 2 × cap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mode_switch_inside_a_slice_keeps_one_cap() {
    use sluice_protocol::scripts::{self, ExactReply};
    let (keys, mut c, mut sync) = script_conns("modesw").await;
    let start = sluice_protocol::slice::start(now_ms(), 60_000);
    make_slice(&mut sync, &keys.slice("t", start), 10, 120_000);
    let admitted = |r: ExactReply| matches!(r, ExactReply::Admitted { .. });
    // exact_fixed admits 6 of 10 …
    let mut fixed = 0;
    for _ in 0..6 {
        fixed += admitted(
            scripts::take(&mut c, &keys, "t", start, 60_000, 1, "")
                .await
                .unwrap(),
        ) as u32;
    }
    assert_eq!(fixed, 6);
    // … then the task becomes exact_sliding: 4 more, not 10.
    let mut sliding = 0;
    let mut last = None;
    let mut sent_ms = 0;
    for _ in 0..10 {
        sent_ms = now_ms();
        let r = scripts::slide(&mut c, &keys, "t", start, 60_000, 1, "n1", "")
            .await
            .unwrap();
        sliding += admitted(r) as u32;
        last = Some(r);
    }
    assert_eq!(sliding, 4, "the slice's cap is shared across the switch");
    match last.unwrap() {
        ExactReply::Refused { retry_after_us, .. } => {
            // Redis computed it between the send and now: the slice's end seen from then.
            let most = (start + 60_000 - sent_ms) * 1_000;
            let least = (start + 60_000 - now_ms()) * 1_000 - 5_000_000;
            assert!(
                (least..=most).contains(&(retry_after_us as i64)),
                "a refusal by rem retries at the slice's end: {retry_after_us} µs, not in \
                 [{least}, {most}]"
            );
        }
        other => panic!("{other:?}"),
    }
    // And back to exact_fixed: nothing left.
    assert!(!admitted(
        scripts::take(&mut c, &keys, "t", start, 60_000, 1, "")
            .await
            .unwrap()
    ));
}
