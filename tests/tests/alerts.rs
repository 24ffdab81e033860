//! Alert pipeline and settings against real replicas: settings validation, host-offset alerts
//! to a webhook (with retries), no duplicate after a leader failover, resolution after quiet.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_protocol::Keys;
use sluice_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_are_validated_and_versioned() {
    let ns = unique_ns("set");
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    let v = m.get_json("/api/v1/settings").await.expect("settings");
    assert_eq!(v["webhooks"], json!([]));
    assert_eq!(v["skew_threshold_ms"], 100);
    assert_eq!(v["version"], 0);

    let (s, v) = m
        .put(
            "/api/v1/settings",
            r#"{"webhooks": ["http://127.0.0.1:9/x"], "skew_threshold_ms": 50, "version": 0}"#,
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let version = v["version"].as_i64().unwrap();
    for (body, field) in [
        (r#"{"webhooks": ["gopher://x"]}"#, "webhooks[0]"),
        (r#"{"webhooks": "http://x"}"#, "webhooks"),
        (r#"{"skew_threshold_ms": 0}"#, "skew_threshold_ms"),
        (r#"{"skew_threshold_ms": "100"}"#, "skew_threshold_ms"),
        (r#"{"hooks": []}"#, "hooks"),
        ("{", ""),
    ] {
        let (s, v) = m.put("/api/v1/settings", body).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["field"], field, "{body}: {v}");
    }
    let (s, v) = m
        .put(
            "/api/v1/settings",
            r#"{"skew_threshold_ms": 70, "version": 1}"#,
        )
        .await;
    assert_eq!(s, 409, "{v}");
    let now = m.get_json("/api/v1/settings").await.unwrap();
    assert_eq!(now["version"], version, "nothing changed");
    assert_eq!(now["skew_threshold_ms"], 50);
    // Shown redacted (the URL is the secret), kept when sent back as shown.
    assert_eq!(now["webhooks"], json!(["http://127.0.0.1:9/…"]));
    let (s, _) = m.put("/api/v1/alerts", "{}").await;
    assert_eq!(s, 405);
    let r = http()
        .get(m.url("/api/v1/alerts?limit=0"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

fn firing_for(rx: &WebhookReceiver, host: &str, state: &str) -> Vec<Value> {
    rx.received()
        .into_iter()
        .filter(|a| a["kind"] == "clock_skew" && a["host"] == host && a["state"] == state)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_alert_reaches_the_webhook_once_across_a_failover_and_resolves() {
    let ns = unique_ns("alert");
    let keys = Keys::new(&ns).unwrap();
    let redis_url = shared_redis();
    // The receiver refuses the first two attempts: delivery must retry.
    let rx = WebhookReceiver::start(2).await;
    let mut ms = start_replicas(&shared_etcd(), &redis_url, &ns, 2, &[]).await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let settings = json!({"webhooks": [rx.url], "skew_threshold_ms": 100, "alert_quiet_ms": 3000});
    let (s, v) = ms[0].put("/api/v1/settings", &settings.to_string()).await;
    assert_eq!(s, 200, "{v}");

    let mut conn = redis_conn(&redis_url);
    set_host_report(&mut conn, &keys, "skewed-host", 1500.0);
    set_host_report(&mut conn, &keys, "good-host", 3.0);

    let fired = wait_until(
        "a firing host alert at the webhook",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let f = firing_for(&rx, "skewed-host", "firing");
            async move { (!f.is_empty()).then_some(f) }
        },
    )
    .await;
    let alert = &fired[0];
    assert!(
        alert["text"].as_str().unwrap().contains("skewed-host"),
        "Slack text: {alert}"
    );
    assert!(
        alert["message"].as_str().unwrap().contains("+1500 ms"),
        "{alert}"
    );
    assert_eq!(alert["details"]["offset_ms"], 1500.0);
    assert!(firing_for(&rx, "good-host", "firing").is_empty());
    let feed = ms[1 - leader].get_json("/api/v1/alerts").await.unwrap();
    assert!(
        feed["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["id"] == alert["id"] && a["host"] == "skewed-host"),
        "{feed}"
    );
    let metrics = ms[leader].metrics().await.unwrap();
    assert!(
        metrics.contains("sluice_alerts_total{kind=\"clock_skew\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sluice_max_clock_offset_seconds 1.5"),
        "{metrics}"
    );

    // Failover while the condition persists: the new leader continues the episode.
    ms[leader].proc.kill();
    let other = &ms[1 - leader];
    other.wait_leader().await;
    for _ in 0..20 {
        set_host_report(&mut conn, &keys, "skewed-host", 1500.0);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(
        firing_for(&rx, "skewed-host", "firing").len(),
        1,
        "no second alert after the failover"
    );

    // The clock is fixed: one resolved alert for the same episode after the quiet period.
    set_host_report(&mut conn, &keys, "skewed-host", 2.0);
    let resolved = wait_until(
        "a resolved alert",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let r = firing_for(&rx, "skewed-host", "resolved");
            async move { (!r.is_empty()).then_some(r) }
        },
    )
    .await;
    assert_eq!(resolved[0]["episode"], alert["episode"]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(firing_for(&rx, "skewed-host", "resolved").len(), 1);
    assert_eq!(firing_for(&rx, "skewed-host", "firing").len(), 1);
}
