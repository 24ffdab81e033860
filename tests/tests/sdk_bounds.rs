//! Bounds at the SDK's doors, against a real Redis (meta and slices written by the leader's
//! ROLL script, decisions and flushes by a real SDK client).
//!
//! Issue 23 item 4: one huge cost silently stopped a host's counting — the rejection was
//! counted (`rej += 2^63`), the FLUSH that carried it was refused by Redis (HINCRBY overflow)
//! and resent forever, so no `adm`/`rej` of any later slice ever reached Redis again.

use std::time::Duration;

use sluice::{Client, Decision};
use sluice_protocol::{Keys, MAX_COUNT};
use sluice_tests::*;

fn client(ns: &str, host: &str) -> Client {
    let mut cfg = sdk_config(&shared_redis(), ns, host);
    cfg.flush_interval = Duration::from_millis(100);
    Client::new(cfg).expect("client")
}

/// `adm`, `rej` of every slice of `task` in Redis, summed.
fn redis_counts(keys: &Keys, task: &str, starts: &[i64]) -> (u64, u64) {
    let mut c = redis_conn(&shared_redis());
    let mut sum = (0, 0);
    for s in starts {
        let (a, r): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(keys.slice(task, *s))
            .arg("adm")
            .arg("rej")
            .query(&mut c)
            .unwrap();
        sum.0 += a.unwrap_or(0);
        sum.1 += r.unwrap_or(0);
    }
    sum
}

fn starts_around(slice_ms: u64, secs: i64) -> Vec<i64> {
    let now = sluice_protocol::slice::start(now_ms(), slice_ms);
    (-secs..=secs).map(|i| now + i * slice_ms as i64).collect()
}

/// Costs above `MAX_COUNT` answer `Decision::TooLarge` and are counted nowhere; a cost above
/// the slice's cap (within `MAX_COUNT`) is limited and counted as a rejection; the task's
/// normal traffic after them still reaches Redis's counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_cost_is_refused_uncounted_and_counting_goes_on() {
    let ns = unique_ns("bounds");
    let keys = Keys::new(&ns).unwrap();
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    roll_task(&keys, "t", &pooled_meta(100, 1_000, false, 0), 20).await;
    let c = client(&ns, &host);
    let t = c.task("t").unwrap();
    assert!(t.wait_ready(Duration::from_secs(5)));
    for n in [1u64 << 63, u64::MAX, MAX_COUNT + 1] {
        assert_eq!(
            t.try_acquire(n),
            Decision::TooLarge { max: MAX_COUNT },
            "try_acquire({n})"
        );
        assert_eq!(
            t.acquire(n).await,
            Decision::TooLarge { max: MAX_COUNT },
            "acquire({n})"
        );
    }
    // Once the slice's cap is known (after a pull), a cost above it is refused as well.
    assert_eq!(t.acquire(1).await, Decision::Allowed);
    assert!(matches!(t.try_acquire(101), Decision::Limited { .. }));
    assert!(matches!(
        t.acquire(MAX_COUNT).await,
        Decision::Limited { .. }
    ));
    let mut admitted = 1;
    for _ in 0..10 {
        if t.acquire(1).await == Decision::Allowed {
            admitted += 1;
        }
    }
    assert!(admitted >= 10, "{admitted}");
    let starts = starts_around(1_000, 3);
    wait_until(
        "the admitted requests counted in Redis",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let got = redis_counts(&keys, "t", &starts);
            async move { (got.0 >= admitted).then_some(got) }
        },
    )
    .await;
    let (adm, rej) = redis_counts(&keys, "t", &starts);
    assert_eq!(adm, admitted, "admitted counted once");
    assert_eq!(
        rej,
        101 + MAX_COUNT,
        "only the costs within MAX_COUNT counted as rejections"
    );
    assert_eq!(c.flushes_dropped(), 0);
}

/// A flush Redis refuses (a slice's `adm` already at i64::MAX: the next admissions' HINCRBY
/// would overflow; `rej` saturates instead since the review of issue 23) is logged, counted in `Client::flushes_dropped` and dropped; the next slices'
/// counters still reach Redis (main resent the refused batch forever and counted nothing
/// more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_redis_refuses_is_dropped_and_the_next_slices_are_counted() {
    let ns = unique_ns("flushref");
    let keys = Keys::new(&ns).unwrap();
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    roll_task(&keys, "t", &pooled_meta(5, 1_000, false, 0), 20).await;
    let c = client(&ns, &host);
    let t = c.task("t").unwrap();
    assert!(t.wait_ready(Duration::from_secs(5)));
    // Start early in a slice, so the next steps fall in it.
    let now = now_ms();
    let s = sluice_protocol::slice::start(now, 1_000);
    if now - s > 300 {
        tokio::time::sleep(Duration::from_millis((s + 1_000 - now) as u64 + 20)).await;
    }
    let s = sluice_protocol::slice::start(now_ms(), 1_000);
    let mut r = redis_conn(&shared_redis());
    let _: () = redis::cmd("HSET")
        .arg(keys.slice("t", s))
        .arg("adm")
        .arg(i64::MAX)
        .query(&mut r)
        .unwrap();
    for _ in 0..5 {
        assert_eq!(t.acquire(1).await, Decision::Allowed);
    }
    assert!(matches!(t.try_acquire(1), Decision::Limited { .. }));
    // The next slice: three admitted, and they must reach Redis.
    let next = s + 1_000;
    tokio::time::sleep(Duration::from_millis((next - now_ms()).max(0) as u64 + 20)).await;
    assert!(
        sluice_protocol::slice::start(now_ms(), 1_000) == next,
        "slow machine: missed the next slice"
    );
    for _ in 0..3 {
        assert_eq!(t.acquire(1).await, Decision::Allowed);
    }
    wait_until(
        "the next slice's admissions counted in Redis",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let got = redis_counts(&keys, "t", &[next]);
            async move { (got.0 == 3).then_some(()) }
        },
    )
    .await;
    assert!(
        c.flushes_dropped() >= 1,
        "the refused slice was not reported"
    );
}

/// The tower layer's door: a cost above `MAX_COUNT` is refused before any decision with 413,
/// without `Retry-After` (a retry fails the same way), counted nowhere; one above the slice's
/// cap is a 429 like any rejection; a normal cost goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_refuses_costs_no_slice_can_hold() {
    use sluice::layer::SluiceLayer;
    use tower::{Layer, ServiceExt};
    let ns = unique_ns("layerbound");
    let keys = Keys::new(&ns).unwrap();
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    roll_task(&keys, "t", &pooled_meta(100, 1_000, false, 0), 20).await;
    let c = client(&ns, &host);
    let t = c.task("t").unwrap();
    assert!(t.wait_ready(Duration::from_secs(5)));
    let layer = SluiceLayer::new(t.clone()).cost(|p| {
        p.headers
            .get("x-cost")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    });
    let svc = layer.layer(tower::service_fn(|_req: http::Request<String>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::from("ok")))
    }));
    let send = |cost: u64| {
        let svc = svc.clone();
        async move {
            let req = http::Request::builder()
                .header("x-cost", cost.to_string())
                .body(String::new())
                .unwrap();
            svc.oneshot(req).await.unwrap()
        }
    };
    assert_eq!(send(1).await.status(), 200);
    for cost in [u64::MAX, MAX_COUNT + 1] {
        let r = send(cost).await;
        assert_eq!(r.status(), 413, "cost {cost}");
        assert!(r.headers().get("retry-after").is_none(), "cost {cost}");
    }
    assert_eq!(send(101).await.status(), 429);
    assert_eq!(send(2).await.status(), 200);
    let starts = starts_around(1_000, 3);
    wait_until(
        "the admitted requests counted in Redis",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let got = redis_counts(&keys, "t", &starts);
            async move { (got.0 >= 3).then_some(()) }
        },
    )
    .await;
    assert_eq!(redis_counts(&keys, "t", &starts), (3, 101), "(adm, rej)");
}

/// Issue 23 item 18: host ids `web/1` and `web:1` are two hosts, with a segment each (main
/// mapped both to `web_1`: one segment, one host's quota and counters for two hosts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_ids_differing_in_punctuation_get_their_own_segments() {
    let ns = unique_ns("hostids");
    let keys = Keys::new(&ns).unwrap();
    let (h1, h2) = (format!("{ns}/1"), format!("{ns}:1"));
    let _seg = SegmentGuard(vec![(ns.clone(), h1.clone()), (ns.clone(), h2.clone())]);
    roll_task(&keys, "t", &pooled_meta(100, 1_000, false, 0), 20).await;
    let (c1, c2) = (client(&ns, &h1), client(&ns, &h2));
    assert_ne!(c1.segment_path(), c2.segment_path());
    assert!(c1.segment_path().exists() && c2.segment_path().exists());
    let (t1, t2) = (c1.task("t").unwrap(), c2.task("t").unwrap());
    assert!(t1.wait_ready(Duration::from_secs(5)) && t2.wait_ready(Duration::from_secs(5)));
    assert_eq!(t1.acquire(1).await, Decision::Allowed);
    assert_eq!(t2.acquire(1).await, Decision::Allowed);
    // Each host pulled for itself: Redis records a pull of each host id.
    let mut r = redis_conn(&shared_redis());
    let s = sluice_protocol::slice::start(now_ms(), 1_000);
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(keys.slice("t", s))
        .query(&mut r)
        .unwrap();
    for h in [&h1, &h2] {
        assert!(
            fields.iter().any(|f| f == &format!("p:{h}")),
            "no pull of {h} in {fields:?}"
        );
    }
}

/// Found by the adversarial review: one request as large as the slice made its host size every
/// later pull by it (the largest cost asked was remembered for as long as the slot lived), so
/// that host took the whole slice at its first pull of every slice and left nothing for the
/// others while the stock sat unused. Now the largest cost sizes the next pull only (a caller
/// still waiting asks again). Host A asks for the whole cap once, then 20 per second; host B
/// asks for far more than the cap: B gets most of every later slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_of_the_whole_cap_does_not_make_its_host_hoard_every_slice() {
    let ns = unique_ns("hoard");
    let keys = Keys::new(&ns).unwrap();
    let (ha, hb) = (format!("{ns}-a"), format!("{ns}-b"));
    let _seg = SegmentGuard(vec![(ns.clone(), ha.clone()), (ns.clone(), hb.clone())]);
    roll_task(&keys, "t", &pooled_meta(1_000, 1_000, false, 0), 30).await;
    let (ca, cb) = (client(&ns, &ha), client(&ns, &hb));
    let (a, b) = (ca.task("t").unwrap(), cb.task("t").unwrap());
    assert!(a.wait_ready(Duration::from_secs(5)) && b.wait_ready(Duration::from_secs(5)));
    let _ = a.try_acquire(1_000);
    let end = std::time::Instant::now() + Duration::from_millis(6_500);
    let bt = std::thread::spawn(move || {
        let mut per_slice = std::collections::BTreeMap::<i64, u64>::new();
        while std::time::Instant::now() < end {
            let (d, at) = b.try_acquire_stamped(1);
            if d.is_allowed() {
                *per_slice.entry(at / 1_000_000).or_default() += 1;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        per_slice
    });
    while std::time::Instant::now() < end {
        let _ = a.try_acquire(1);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let per_slice = bt.join().unwrap();
    // Whole slices after the first two (the first is A's whole-cap request's).
    let full: Vec<u64> = per_slice.values().copied().skip(2).take(3).collect();
    assert_eq!(full.len(), 3, "{per_slice:?}");
    assert!(
        full.iter().all(|&n| n >= 600),
        "B admitted per slice {per_slice:?}: A hoarded the slices"
    );
}

/// Found by the adversarial review: the keyed door had no bound — `Key::try_acquire(u64::MAX)`
/// was limited and counted as a rejection of 2^64 − 1, and two such keys in one report
/// overflowed its sum (a panic that ended the background thread in debug builds: nothing was
/// pulled or flushed again). Now they are `TooLarge`, counted nowhere, and the keys' normal
/// traffic after them is admitted and reaches Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_key_cost_is_refused_uncounted_and_keys_go_on() {
    let ns = unique_ns("kbounds");
    let keys = Keys::new(&ns).unwrap();
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut m = pooled_meta(100, 1_000, false, 0);
    m.keyed = true;
    roll_task(&keys, "t", &m, 20).await;
    let c = client(&ns, &host);
    let t = c.task("t").unwrap();
    assert!(t.wait_ready(Duration::from_secs(5)));
    for (k, n) in [("a", u64::MAX), ("b", u64::MAX), ("c", MAX_COUNT + 1)] {
        assert_eq!(
            t.key(k).unwrap().try_acquire(n),
            Decision::TooLarge { max: MAX_COUNT },
            "key {k}: try_acquire({n})"
        );
    }
    // Normal key traffic after them: admitted, and counted in Redis (the report and the
    // flush still run).
    let k = t.key("a").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut admitted = 0u64;
    loop {
        if k.acquire(1).await.is_allowed() {
            admitted += 1;
        }
        let (adm, rej) = redis_counts(&keys, "t", &starts_around(1_000, 12));
        assert!(rej < MAX_COUNT, "a huge cost was counted: rej {rej}");
        if adm >= 5 && admitted >= 5 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "key admissions never reached Redis: adm {adm}, admitted {admitted}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
