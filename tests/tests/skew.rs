//! Clock skew, end to end, with a really skewed process: two load-generating hosts, one of them
//! under Debian's `faketime`. The manager must raise a key-movement alert and a host alert
//! (+1.5 s), only the host alert (+0.3 s), and nothing at all without skew.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_tests::*;

struct Setup {
    m: Manager,
    ns: String,
    rx: WebhookReceiver,
}

async fn setup(prefix: &str) -> Setup {
    let ns = unique_ns(prefix);
    let rx = WebhookReceiver::start(0).await;
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    m.wait_leader().await;
    let settings = json!({"webhooks": [rx.url], "skew_threshold_ms": 100, "alert_quiet_ms": 30000});
    let (s, v) = m.put("/api/v1/settings", &settings.to_string()).await;
    assert_eq!(s, 200, "{v}");
    // Demand well below the threshold, so every host keeps pulling from its current slice.
    let (s, v) = m
        .put(
            "/api/v1/tasks/sk",
            r#"{"threshold": 20000, "slice_ms": 1000, "pull": 20}"#,
        )
        .await;
    assert_eq!(s, 201, "{v}");
    m.wait_rolled("sk").await;
    Setup { m, ns, rx }
}

fn host(ns: &str, host_id: &str, offset: Option<&str>, duration_ms: u64) -> Loadgen {
    let args = loadgen_args(
        &shared_redis(),
        ns,
        "sk",
        host_id,
        2,
        duration_ms,
        &["--rate", "500"],
    );
    match offset {
        Some(o) => Loadgen::spawn_under(&["faketime", "-f", o], &args),
        None => Loadgen::spawn(&args),
    }
}

fn alerts_where(rx: &WebhookReceiver, f: impl Fn(&Value) -> bool) -> Vec<Value> {
    rx.received()
        .into_iter()
        .filter(|a| a["kind"] == "clock_skew" && f(a))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_one_and_a_half_seconds_ahead_raises_both_alerts_within_10s() {
    let s = setup("skew15").await;
    let ns = s.ns.clone();
    let skewed = format!("{ns}-skewed");
    let _segments = SegmentGuard(vec![
        (ns.clone(), skewed.clone()),
        (ns.clone(), format!("{ns}-good")),
    ]);
    let mut good = host(&ns, &format!("{ns}-good"), None, 15_000);
    let mut bad = host(&ns, &skewed, Some("+1.5s"), 15_000);
    let t0 = Instant::now();
    let (task_alert, host_alert) = wait_until(
        "a key-movement alert and a host alert at the webhook",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let t = alerts_where(&s.rx, |a| a["task"] == "sk" && a["state"] == "firing");
            let h = alerts_where(&s.rx, |a| {
                a["host"] == skewed.as_str() && a["state"] == "firing"
            });
            (!t.is_empty() && !h.is_empty()).then(|| (t[0].clone(), h[0].clone()))
        },
    )
    .await;
    eprintln!("both alerts after {:?}", t0.elapsed());
    // The key-movement alert lists more than two slices, some ahead of the leader's, and names
    // the skewed host.
    let moved = task_alert["details"]["moved_slices"].as_array().unwrap();
    assert!(moved.len() > 2, "{task_alert}");
    let distances: Vec<i64> = task_alert["details"]["distances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_i64().unwrap())
        .collect();
    assert!(distances.iter().any(|d| *d >= 1), "{task_alert}");
    assert!(
        task_alert["message"].as_str().unwrap().contains(&skewed),
        "{task_alert}"
    );
    let offset = host_alert["details"]["offset_ms"].as_f64().unwrap();
    assert!(
        (1300.0..=1700.0).contains(&offset),
        "measured offset {offset}: {host_alert}"
    );
    // The same alerts are in the feed, and counted.
    let feed = s.m.get_json("/api/v1/alerts").await.unwrap();
    let ids: Vec<&Value> = feed["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| &a["id"])
        .collect();
    assert!(
        ids.contains(&&task_alert["id"]) && ids.contains(&&host_alert["id"]),
        "{feed}"
    );
    let max = s.m.metric("sluice_max_clock_offset_seconds").await.unwrap();
    assert!(max > 1.3, "{max}");
    // One alert per episode, however long the skew lasts.
    good.wait_json(Duration::from_secs(30)).await;
    bad.wait_json(Duration::from_secs(30)).await;
    assert_eq!(
        alerts_where(&s.rx, |a| a["task"] == "sk" && a["state"] == "firing").len(),
        1
    );
    assert_eq!(
        alerts_where(&s.rx, |a| a["host"] == skewed.as_str()
            && a["state"] == "firing")
        .len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_300ms_ahead_raises_only_the_host_alert() {
    let s = setup("skew03").await;
    let ns = s.ns.clone();
    let skewed = format!("{ns}-skewed");
    let _segments = SegmentGuard(vec![
        (ns.clone(), skewed.clone()),
        (ns.clone(), format!("{ns}-good")),
    ]);
    let mut good = host(&ns, &format!("{ns}-good"), None, 12_000);
    let mut bad = host(&ns, &skewed, Some("+0.3s"), 12_000);
    let h = wait_until(
        "a host alert",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let h = alerts_where(&s.rx, |a| {
                a["host"] == skewed.as_str() && a["state"] == "firing"
            });
            h.first().cloned()
        },
    )
    .await;
    let offset = h["details"]["offset_ms"].as_f64().unwrap();
    assert!((200.0..=400.0).contains(&offset), "{h}");
    good.wait_json(Duration::from_secs(30)).await;
    bad.wait_json(Duration::from_secs(30)).await;
    let task_alerts = alerts_where(&s.rx, |a| a["task"] == "sk");
    assert!(
        task_alerts.is_empty(),
        "a 0.3 s skew must not look like key movement: {task_alerts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_seconds_without_skew_raise_nothing() {
    let s = setup("noskew").await;
    let ns = s.ns.clone();
    let _segments = SegmentGuard(vec![
        (ns.clone(), format!("{ns}-a")),
        (ns.clone(), format!("{ns}-b")),
    ]);
    let mut a = host(&ns, &format!("{ns}-a"), None, 30_000);
    let mut b = host(&ns, &format!("{ns}-b"), None, 30_000);
    let ra = a.wait_json(Duration::from_secs(60)).await;
    let rb = b.wait_json(Duration::from_secs(60)).await;
    assert!(
        ra["admitted"].as_u64().unwrap() > 10_000 && rb["admitted"].as_u64().unwrap() > 10_000,
        "{ra} {rb}"
    );
    // Give the detector a last poll and the webhook a last delivery.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(s.rx.received().is_empty(), "{:?}", s.rx.received());
    let feed = s.m.get_json("/api/v1/alerts").await.unwrap();
    assert_eq!(feed["alerts"], json!([]));
    assert_eq!(
        s.m.metrics()
            .await
            .unwrap()
            .matches("sluice_alerts_total{")
            .count(),
        0
    );
}
