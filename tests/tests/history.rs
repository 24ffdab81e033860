//! Traffic history end to end: the leader harvests slice counters into the history rings
//! before the slice keys go away, the history survives a leader failover without counting
//! anything twice, and `/api/v1/tasks/{name}/history`, `/api/v1/hosts` and `/api/v1/traffic`
//! validate their input and show what workers and hosts reported.

use std::time::Duration;

use serde_json::Value;
use sluice_protocol::conn::{ConnOptions, Redis, RedisConn, RedisTarget};
use sluice_protocol::scripts::{self, SliceCounters};
use sluice_protocol::{HostReport, Keys, slice, unix_ms};
use sluice_tests::*;

/// Short retention so slices are harvested within ~3 s of their end (settle = retention / 4).
const RETENTION: &str = "10s";

async fn redis(url: &str) -> RedisConn {
    Redis::new(RedisTarget::parse(url).unwrap(), ConnOptions::default())
        .conn()
        .await
        .expect("redis")
}

/// Waits until one of `ms` says it leads; returns its index.
async fn leader_of(ms: &[&Manager]) -> usize {
    wait_until(
        "a leader",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            for (i, m) in ms.iter().enumerate() {
                if m.says_leader().await {
                    return Some(i);
                }
            }
            None
        },
    )
    .await
}

/// Adds counters to existing slices, as workers do (the protocol's FLUSH script).
async fn flush(c: &mut RedisConn, keys: &Keys, task: &str, counts: &[(i64, u64, u64)]) {
    let batch: Vec<(i64, SliceCounters)> = counts
        .iter()
        .map(|&(start, admitted, rejected)| {
            (
                start,
                SliceCounters {
                    admitted,
                    rejected,
                    ..SliceCounters::default()
                },
            )
        })
        .collect();
    let seq = sluice::clock::host_us() as u64;
    let n = scripts::flush(c, keys, task, "history-test", seq, &batch)
        .await
        .expect("flush");
    assert_eq!(n as usize, counts.len(), "every slice must exist");
}

async fn wait_slice(c: &RedisConn, keys: &Keys, task: &str, start: i64) {
    wait_until(
        "slice written",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let mut c = c.clone();
            let key = keys.slice(task, start);
            async move {
                let n: i64 = redis::cmd("EXISTS")
                    .arg(key)
                    .query_async(&mut c)
                    .await
                    .ok()?;
                (n == 1).then_some(())
            }
        },
    )
    .await;
}

/// Totals (admitted, rejected) over every entry of a history response.
fn totals(h: &Value) -> (u64, u64) {
    h["slices"]
        .as_array()
        .expect("slices")
        .iter()
        .fold((0, 0), |(a, r), e| {
            (
                a + e["admitted"].as_u64().unwrap(),
                r + e["rejected"].as_u64().unwrap(),
            )
        })
}

fn entry(h: &Value, start: i64) -> Option<&Value> {
    h["slices"]
        .as_array()?
        .iter()
        .find(|e| e["start_ms"].as_i64() == Some(start))
}

/// The one-minute history comes only from the rings: wait until its totals are `want`.
async fn wait_minute_totals(m: &Manager, task: &str, want: (u64, u64)) {
    let path = format!("/api/v1/tasks/{task}/history?seconds=1200&resolution=1m");
    wait_until(
        &format!("minute history totals {want:?}"),
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let h = m.get_json(&path).await?;
            (totals(&h) == want).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_outlives_slices_and_survives_failover_without_double_counting() {
    let ns = unique_ns("hist");
    let redis_url = shared_redis();
    let keys = Keys::new(&ns).unwrap();
    let opts = |id: &str| {
        let mut o = ManagerOpts::new(&shared_etcd(), &redis_url, &ns, id);
        o.extra = vec!["--retention".into(), RETENTION.into()];
        o
    };
    let mut ms = vec![
        Manager::start(opts("h1")).await,
        Manager::start(opts("h2")).await,
    ];
    let li = leader_of(&[&ms[0], &ms[1]]).await;
    let (st, body) = ms[li]
        .put("/api/v1/tasks/h", r#"{"threshold": 100, "slice_ms": 1000}"#)
        .await;
    assert_eq!(st, 201, "{body}");
    let mut c = redis(&redis_url).await;

    // Workers report into the current slice and the next two.
    let s0 = slice::start(unix_ms(), 1000);
    wait_slice(&c, &keys, "h", s0 + 2000).await;
    flush(
        &mut c,
        &keys,
        "h",
        &[(s0, 10, 0), (s0 + 1000, 11, 1), (s0 + 2000, 12, 2)],
    )
    .await;

    // The slice in progress is read live: no waiting for the harvest.
    let live = ms[li]
        .get_json("/api/v1/tasks/h/history?seconds=60")
        .await
        .expect("history");
    assert_eq!(live["resolution_ms"], 1000);
    assert_eq!(live["slice_ms"], 1000);
    let e0 = entry(&live, s0).unwrap_or_else(|| panic!("no live entry for {s0}: {live}"));
    assert_eq!(e0["admitted"], 10, "{e0}");
    assert_eq!(e0["threshold"], 100, "{e0}");
    assert_eq!(e0["slice_count"], 1, "{e0}");

    // Harvested into the rings, then the slice keys go away: the history stays.
    wait_minute_totals(&ms[li], "h", (33, 3)).await;
    for s in [s0, s0 + 1000, s0 + 2000] {
        let _: i64 = redis::cmd("DEL")
            .arg(keys.slice("h", s))
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let follower = 1 - li;
    let h = ms[follower]
        .get_json("/api/v1/tasks/h/history?seconds=120")
        .await
        .expect("history through the follower");
    for (i, (a, r)) in [(10, 0), (11, 1), (12, 2)].into_iter().enumerate() {
        let e = entry(&h, s0 + i as i64 * 1000)
            .unwrap_or_else(|| panic!("slice {i} missing from the ring: {h}"));
        assert_eq!(
            (e["admitted"].as_u64(), e["rejected"].as_u64()),
            (Some(a), Some(r)),
            "{e}"
        );
        assert_eq!(e["threshold"], 100);
    }

    // The leader dies; the new one harvests on from where the rings are, re-harvesting the
    // recent past without counting it twice.
    ms[li].proc.kill();
    let survivor = &ms[follower];
    wait_until(
        "the survivor to lead",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async { survivor.says_leader().await.then_some(()) },
    )
    .await;
    let s1 = slice::start(unix_ms(), 1000);
    wait_slice(&c, &keys, "h", s1 + 1000).await;
    flush(&mut c, &keys, "h", &[(s1, 100, 5), (s1 + 1000, 200, 6)]).await;
    wait_minute_totals(survivor, "h", (333, 14)).await;
    // Several harvest ticks later the totals have not grown (re-harvests overwrite).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let h = survivor
        .get_json("/api/v1/tasks/h/history?seconds=1200&resolution=1m")
        .await
        .unwrap();
    assert_eq!(totals(&h), (333, 14), "{h}");
    let secs = survivor
        .get_json("/api/v1/tasks/h/history?seconds=300")
        .await
        .unwrap();
    assert_eq!(totals(&secs), (333, 14), "{secs}");
    ms.clear();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_hosts_and_traffic_reject_bad_input() {
    let ns = unique_ns("histbad");
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "v1")).await;
    let (st, _) = m.put("/api/v1/tasks/v", r#"{"threshold": 5}"#).await;
    assert_eq!(st, 201);
    for (query, field) in [
        ("seconds=0", "seconds"),
        ("seconds=-5", "seconds"),
        ("seconds=abc", "seconds"),
        ("seconds=604801", "seconds"),
        ("seconds=60&resolution=5m", "resolution"),
        ("seconds=86400&resolution=1s", "resolution"),
        ("secs=60", "secs"),
    ] {
        let r = http()
            .get(m.url(&format!("/api/v1/tasks/v/history?{query}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{query}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["field"], field, "{query}: {body}");
        assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()));
    }
    let r = http()
        .get(m.url("/api/v1/tasks/nope/history"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http()
        .get(m.url("/api/v1/tasks/a%20b/history"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["field"], "name");
    let r = http()
        .get(m.url("/api/v1/hosts?task=a%3Ab"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["field"], "task");
    // The defaults: five minutes at one second.
    let h = m.get_json("/api/v1/tasks/v/history").await.unwrap();
    assert_eq!(h["resolution_ms"], 1000);
    let span = h["now_ms"].as_i64().unwrap() - h["from_ms"].as_i64().unwrap();
    assert!((300_000..301_000).contains(&span), "{h}");
    let h = m
        .get_json("/api/v1/tasks/v/history?seconds=86400")
        .await
        .unwrap();
    assert_eq!(h["resolution_ms"], 60_000);
    assert!(h["live_from_ms"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_and_traffic_show_what_workers_report() {
    let ns = unique_ns("hosts");
    let redis_url = shared_redis();
    let keys = Keys::new(&ns).unwrap();
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "t1")).await;
    leader_of(&[&m]).await;
    let (st, _) = m
        .put(
            "/api/v1/tasks/web",
            r#"{"threshold": 100, "slice_ms": 1000}"#,
        )
        .await;
    assert_eq!(st, 201);
    let mut c = redis(&redis_url).await;
    let now = unix_ms();
    let report = |offset_ms: f64, seen_ms: i64, state: &str| {
        serde_json::to_string(&HostReport {
            offset_ms,
            rtt_ms: 0.4,
            seen_ms,
            sdk: "sluice-rs/test".into(),
            proto: None,
            tasks: [("web".to_string(), state.to_string())].into(),
            permits: Default::default(),
        })
        .unwrap()
    };
    let _: () = redis::cmd("HSET")
        .arg(keys.hosts())
        .arg("host-a")
        .arg(report(3.5, now, "normal"))
        .arg("host-b")
        .arg(report(-250.0, now, "limited"))
        .arg("host-old")
        .arg(report(0.0, now - 3_600_000, "failed"))
        .arg("host-bad")
        .arg("{not json")
        .query_async(&mut c)
        .await
        .unwrap();

    let hosts = m.get_json("/api/v1/hosts?task=web").await.unwrap();
    let list = hosts["hosts"].as_array().unwrap();
    let ids: Vec<&str> = list
        .iter()
        .map(|h| h["host_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["host-a", "host-b", "host-old"], "{hosts}");
    assert_eq!(list[0]["offset_ms"], 3.5);
    assert_eq!(list[1]["tasks"]["web"], "limited");
    assert_eq!(list[0]["stale"], false);
    assert_eq!(list[2]["stale"], true);
    let all = m.get_json("/api/v1/hosts").await.unwrap();
    let bad = all["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["host_id"] == "host-bad")
        .expect("an unreadable report is shown, not hidden");
    assert!(bad["error"].as_str().is_some());

    // Two ended slices with traffic: 40 and 60 admitted, 10 rejected each → 50/s and 10/s.
    let cur = slice::start(unix_ms(), 1000);
    wait_slice(&c, &keys, "web", cur + 2000).await;
    flush(&mut c, &keys, "web", &[(cur, 40, 10), (cur + 1000, 60, 10)]).await;
    // Once both have ended and settled (2 s for the last flushes), the rate window holds them.
    let wait = (cur + 4_100 - unix_ms()).max(0) as u64;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let all = m.get_json("/api/v1/traffic").await.expect("traffic");
    let t = &all["tasks"]["web"];
    let adm = t["admitted_per_s"].as_f64().unwrap();
    let rej = t["rejected_per_s"].as_f64().unwrap();
    assert!(adm > 0.0 && adm <= 50.0, "{t}");
    assert!(rej > 0.0 && rej <= 10.0, "{t}");
    assert_eq!(t["threshold"], 100, "{t}");
    assert!(t["admitted_per_s"].as_f64().unwrap() > 0.0, "{t}");
    assert_eq!(t["hosts"]["normal"], 1, "{t}");
    assert_eq!(t["hosts"]["limited"], 1, "{t}");
    assert!(
        t["hosts"].get("failed").is_none(),
        "stale hosts are not counted: {t}"
    );
}

/// Issue 23 item 17: a slice-length change does not rewrite the rate of what ran before it.
/// 5,000 admitted per 1 s slice, then `slice_ms` 2,000 with 10,000 per 2 s slice: 5,000/s
/// throughout. Every record carries its own slice length (`slice_ms`, `span_ms`) and rates
/// (`admitted_per_s`, `threshold_per_s`), at one-second and one-minute resolution; dividing the
/// old records by today's 2 s slices (what the dashboard did) drew 2,500/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_keeps_each_records_own_slice_length_across_a_change() {
    let ns = unique_ns("histlen");
    let redis_url = shared_redis();
    let keys = Keys::new(&ns).unwrap();
    let mut o = ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "l1");
    o.extra = vec!["--retention".into(), RETENTION.into()];
    let m = Manager::start(o).await;
    m.wait_leader().await;
    let (st, body) = m
        .put(
            "/api/v1/tasks/t",
            r#"{"threshold": 5000, "slice_ms": 1000}"#,
        )
        .await;
    assert_eq!(st, 201, "{body}");
    let mut c = redis(&redis_url).await;

    // Three 1 s slices at 5,000 each, harvested with their length before the change.
    let s0 = slice::start(unix_ms(), 1000);
    wait_slice(&c, &keys, "t", s0 + 2000).await;
    flush(
        &mut c,
        &keys,
        "t",
        &[(s0, 5000, 0), (s0 + 1000, 5000, 0), (s0 + 2000, 5000, 0)],
    )
    .await;
    wait_minute_totals(&m, "t", (15_000, 0)).await;

    // Now 2 s slices at 10,000 each: the same 5,000/s.
    let (st, body) = m
        .put(
            "/api/v1/tasks/t",
            r#"{"threshold": 10000, "slice_ms": 2000}"#,
        )
        .await;
    assert_eq!(st, 200, "{body}");
    wait_until(
        "the 2 s grid rolled",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { (m.current_threshold("t").await == Some(10_000)).then_some(()) },
    )
    .await;
    let s1 = slice::start(unix_ms(), 2000) + 2000;
    wait_slice(&c, &keys, "t", s1 + 2000).await;
    flush(
        &mut c,
        &keys,
        "t",
        &[(s1, 10_000, 0), (s1 + 2000, 10_000, 0)],
    )
    .await;
    wait_minute_totals(&m, "t", (35_000, 0)).await;

    let h = m
        .get_json("/api/v1/tasks/t/history?seconds=120")
        .await
        .expect("history");
    assert_eq!(h["slice_ms"], 2000, "the task's length now");
    let mut seen = 0;
    for e in h["slices"].as_array().unwrap() {
        if e["admitted"].as_u64() == Some(0) {
            continue;
        }
        seen += 1;
        let start = e["start_ms"].as_i64().unwrap();
        let len = if start < s1 { 1000 } else { 2000 };
        assert_eq!(e["slice_ms"].as_u64(), Some(len), "{e}");
        assert_eq!(e["span_ms"].as_u64(), Some(len), "{e}");
        assert_eq!(
            e["admitted_per_s"].as_f64(),
            Some(5000.0),
            "the rate this second ran at: {e}"
        );
        assert_eq!(e["threshold_per_s"].as_f64(), Some(5000.0), "{e}");
    }
    assert_eq!(seen, 5, "{h}");
    let h = m
        .get_json("/api/v1/tasks/t/history?seconds=1200&resolution=1m")
        .await
        .expect("minute history");
    let minutes = h["slices"].as_array().unwrap();
    assert!(!minutes.is_empty(), "{h}");
    for e in minutes {
        assert_eq!(e["admitted_per_s"].as_f64(), Some(5000.0), "{e}");
        assert_eq!(e["threshold_per_s"].as_f64(), Some(5000.0), "{e}");
    }
}

/// A slice that ran on the old grid but is harvested after the `slice_ms` change keeps its own
/// length: 5,000 admitted in a 1 s slice whose start lies on the new 2 s grid, the change made
/// before the harvest reached it, is still 5,000/s (read with today's length it was 2,500/s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_harvested_after_a_length_change_keeps_its_length() {
    let ns = unique_ns("histlate");
    let redis_url = shared_redis();
    let keys = Keys::new(&ns).unwrap();
    let mut o = ManagerOpts::new(&shared_etcd(), &redis_url, &ns, "l1");
    o.extra = vec!["--retention".into(), RETENTION.into()];
    let m = Manager::start(o).await;
    m.wait_leader().await;
    let (st, body) = m
        .put(
            "/api/v1/tasks/t",
            r#"{"threshold": 5000, "slice_ms": 1000}"#,
        )
        .await;
    assert_eq!(st, 201, "{body}");
    m.wait_rolled("t").await;
    let mut c = redis(&redis_url).await;
    // Just after an even second: the 1 s slices [e, e + 1 s) and [e + 1 s, e + 2 s) have
    // ended, e lies on the 2 s grid, and the harvest (settle 2.5 s) has reached neither.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let e = loop {
        let now = unix_ms();
        if (50..300).contains(&now.rem_euclid(2000)) {
            break slice::start(now, 2000) - 2000;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    flush(&mut c, &keys, "t", &[(e, 5000, 0)]).await;
    let (st, body) = m
        .put(
            "/api/v1/tasks/t",
            r#"{"threshold": 10000, "slice_ms": 2000}"#,
        )
        .await;
    assert_eq!(st, 200, "{body}");
    assert!(unix_ms() < e + 3_000, "too slow to beat the harvest; rerun");
    wait_minute_totals(&m, "t", (5_000, 0)).await;
    let h = m
        .get_json("/api/v1/tasks/t/history?seconds=60")
        .await
        .expect("history");
    let rec = entry(&h, e).unwrap_or_else(|| panic!("no entry for {e}: {h}"));
    assert_eq!(rec["span_ms"].as_u64(), Some(1000), "{rec}");
    assert_eq!(rec["admitted_per_s"].as_f64(), Some(5000.0), "{rec}");
}
