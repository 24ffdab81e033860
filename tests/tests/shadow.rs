//! Shadow mode end to end (`"shadow": true`): a real manager and Redis, one simulated host of
//! two `loadgen` processes at 10× a task's threshold.
//!
//! Every decision admits (the loadgen sees no rejection), yet the task is counted as if
//! enforced: the quota is consumed exactly as if enforced (each slice's `adm` ≤ threshold),
//! every rejection is counted (`rej`) and flagged as shadowed (`wrej` = `rej`), what the
//! processes admitted per slice is `adm + wrej`, and the would-rejects show in the task's
//! status, its history, `/traffic` and `sluice_would_reject_total{task}`. Also: FLUSH accepts
//! the six counters per slice of a protocol-2 SDK as well as the seven of protocol 3.

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_protocol::Keys;
use sluice_tests::*;

const THRESHOLD: u64 = 200;
const SLICE_MS: i64 = 1_000;

fn counters(conn: &mut redis::Connection, key: &str) -> (u64, u64, u64) {
    let (a, r, w): (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
        .arg(key)
        .arg("adm")
        .arg("rej")
        .arg("wrej")
        .query(conn)
        .unwrap();
    (a.unwrap_or(0), r.unwrap_or(0), w.unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_admits_everything_and_counts_as_if_enforced() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("shadow");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);
    let (status, v) = m
        .put(
            "/api/v1/tasks/sh",
            &format!(r#"{{"threshold":{THRESHOLD},"slice_ms":{SLICE_MS},"shadow":true}}"#),
        )
        .await;
    assert!(status == 200 || status == 201, "{status} {v}");
    assert_eq!(v["shadow"], true, "{v}");
    let (status, v) = m
        .put("/api/v1/tasks/sh2", r#"{"threshold":5,"shadow":"on"}"#)
        .await;
    assert_eq!((status, v["field"].as_str()), (400, Some("shadow")), "{v}");
    m.wait_rolled("sh").await;

    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut lg = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "sh",
        &host,
        2,
        4_000,
        &["--rate", "1000", "--bucket-ms", &SLICE_MS.to_string()],
    ));
    let report = lg.wait_json(Duration::from_secs(60)).await;
    eprintln!("loadgen: {report}");
    assert_eq!(report["rejected"], 0, "shadow mode rejected: {report}");
    let shadowed = report["shadow_admitted"].as_u64().unwrap();
    assert!(shadowed > 0, "nothing was shadowed at 10× demand: {report}");

    let buckets: BTreeMap<i64, (u64, u64)> = loadgen_buckets(&report);
    let starts: Vec<i64> = buckets.keys().copied().collect();
    let full = &starts[1..starts.len() - 1];
    assert!(full.len() >= 2, "too few full slices: {starts:?}");
    // The flushes settle within a second or two: poll until every full slice adds up.
    let want: Vec<(i64, u64)> = full.iter().map(|s| (*s, buckets[s].0)).collect();
    let seen = wait_until(
        "flushed counters of the full slices",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let rows: Vec<(i64, u64, (u64, u64, u64))> = want
                .iter()
                .map(|(s, a)| (*s, *a, counters(&mut conn, &keys.slice("sh", *s))))
                .collect();
            let done = rows.iter().all(|(_, a, (adm, _, w))| adm + w == *a);
            async move { done.then_some(rows) }
        },
    )
    .await;
    for (s, admitted, (adm, rej, wrej)) in &seen {
        eprintln!("slice {s}: loadgen admitted {admitted}, adm {adm} rej {rej} wrej {wrej}");
        assert!(*adm <= THRESHOLD, "slice {s}: quota over-consumed: {adm}");
        assert!(
            *adm >= THRESHOLD * 9 / 10,
            "slice {s}: quota not consumed as if enforced: {adm}"
        );
        assert!(*wrej > 0, "slice {s}: no would-reject");
        assert_eq!(rej, wrej, "slice {s}: every rejection was shadowed");
    }
    let total_wrej: u64 = seen.iter().map(|(_, _, (_, _, w))| w).sum();

    // The API: status of the current slice, history per slice, the traffic rates.
    let t = m.get_json("/api/v1/tasks/sh").await.unwrap();
    assert_eq!(t["shadow"], true);
    assert!(t["status"]["last_slice"]["would_reject"].is_u64(), "{t}");
    let h = m
        .get_json("/api/v1/tasks/sh/history?seconds=60")
        .await
        .unwrap();
    let hist_wrej: u64 = h["slices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| full.contains(&r["start_ms"].as_i64().unwrap()))
        .map(|r| r["would_reject"].as_u64().unwrap())
        .sum();
    assert_eq!(hist_wrej, total_wrej, "{h}");
    let tr = m.get_json("/api/v1/traffic").await.unwrap();
    assert!(tr["tasks"]["sh"]["would_reject_per_s"].is_number(), "{tr}");

    // The metric, from the leader's history harvest (after the slices settle).
    let seen_metric = wait_until(
        "sluice_would_reject_total{task=\"sh\"}",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let text = m.metrics().await?;
            let v: f64 = text
                .lines()
                .find(|l| l.starts_with("sluice_would_reject_total{task=\"sh\"}"))?
                .rsplit(' ')
                .next()?
                .parse()
                .ok()?;
            (v >= total_wrej as f64).then_some(v)
        },
    )
    .await;
    eprintln!("sluice_would_reject_total: {seen_metric}, full slices: {total_wrej}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_takes_six_or_seven_counters_per_slice() {
    let redis = shared_redis();
    let ns = unique_ns("shflush");
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);
    let (a, b) = (keys.slice("t", 1_000), keys.slice("t", 2_000));
    for k in [&a, &b] {
        let _: () = redis::cmd("HSET")
            .arg(k)
            .arg("cap")
            .arg(10)
            .arg("rem")
            .arg(10)
            .query(&mut conn)
            .unwrap();
    }
    let script = redis::Script::new(sluice_protocol::scripts::FLUSH_LUA);
    // A protocol-2 SDK: six per slice.
    let n: u64 = script
        .key(&a)
        .key(&b)
        .arg("h1")
        .arg(1)
        .arg(&[1, 2, 0, 0, 0, 0, 3, 4, 0, 0, 0, 0][..])
        .invoke(&mut conn)
        .unwrap();
    assert_eq!(n, 2);
    assert_eq!(counters(&mut conn, &a), (1, 2, 0));
    assert_eq!(counters(&mut conn, &b), (3, 4, 0));
    // Protocol 3: seven per slice, the seventh is wrej.
    let n: u64 = script
        .key(&a)
        .key(&b)
        .arg("h1")
        .arg(2)
        .arg(&[1, 1, 0, 0, 0, 0, 1, 0, 5, 0, 0, 0, 0, 5][..])
        .invoke(&mut conn)
        .unwrap();
    assert_eq!(n, 2);
    assert_eq!(counters(&mut conn, &a), (2, 3, 1));
    assert_eq!(counters(&mut conn, &b), (3, 9, 5));
    let _: () = redis::cmd("DEL").arg(&a).arg(&b).query(&mut conn).unwrap();
}
