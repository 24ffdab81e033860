//! Dynamic limiting end to end, driven by external health reports: the threshold falls under
//! bad reports (never below `min`), reaches the slices, survives a leader failover, and climbs
//! back under healthy reports.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_tests::*;

async fn report(m: &Manager, task: &str, error_rate: f64) {
    let r = http()
        .post(m.url(&format!("/api/v1/tasks/{task}/health")))
        .header("content-type", "application/json")
        .body(json!({"error_rate": error_rate, "latency_ms": 20, "source": "probe"}).to_string())
        .send()
        .await
        .expect("POST health");
    assert_eq!(r.status(), 204);
}

async fn adjustments(m: &Manager, task: &str) -> Vec<Value> {
    m.get_json(&format!("/api/v1/tasks/{task}/adjustments"))
        .await
        .map(|v| v["adjustments"].as_array().cloned().unwrap_or_default())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_reports_drive_the_threshold_down_to_min_and_back_up() {
    let ns = unique_ns("dyn");
    let ms = start_replicas(
        &shared_etcd(),
        &shared_redis(),
        &ns,
        2,
        &["--control-period", "1s"],
    )
    .await;
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let spec = json!({"threshold": 1000, "dynamic": {"enabled": true, "min": 200, "max": 2000,
        "target_error_rate": 0.05, "target_latency_ms": 500}});
    let (s, v) = ms[0].put("/api/v1/tasks/d", &spec.to_string()).await;
    assert_eq!(s, 201, "{v}");

    // Bad input is refused and changes nothing.
    for (body, field) in [
        (r#"{"error_rate": 1.5}"#, "error_rate"),
        (r#"{"latency_ms": -1}"#, "latency_ms"),
        (r#"{}"#, "error_rate"),
        (r#"{"error_rate": 0.1, "source": ""}"#, "source"),
        (r#"{"error_rate": 0.1, "extra": 1}"#, "extra"),
    ] {
        let r = http()
            .post(ms[0].url("/api/v1/tasks/d/health"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["field"], field, "{body}: {v}");
    }
    let r = http()
        .post(ms[0].url("/api/v1/tasks/nope/health"))
        .header("content-type", "application/json")
        .body(r#"{"error_rate": 0.1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // 20 s of error rate 0.5.
    let bad_until = Instant::now() + Duration::from_secs(20);
    let mut lowest = i64::MAX;
    while Instant::now() < bad_until {
        report(&ms[0], "d", 0.5).await;
        if let Some(c) = ms[leader].current_threshold("d").await {
            assert!(c >= 200, "threshold {c} fell below min");
            lowest = lowest.min(c);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        lowest, 200,
        "it should reach min within 20 s of bad reports"
    );
    let adj = adjustments(&ms[1 - leader], "d").await;
    assert!(adj.len() >= 5, "{adj:?}");
    assert!(adj.iter().all(|a| a["new"].as_i64().unwrap() >= 200));
    assert!(
        adj[0]["reason"]
            .as_str()
            .unwrap()
            .contains("error rate 0.500"),
        "{}",
        adj[0]
    );

    // Failover: the new leader keeps the controlled threshold instead of the base 1000.
    let mut ms = ms;
    ms[leader].proc.kill();
    let other = 1 - leader;
    ms[other].wait_leader().await;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        report(&ms[other], "d", 0.5).await;
        let c = ms[other].current_threshold("d").await.unwrap_or(200);
        assert_eq!(c, 200, "the new leader must not reset the threshold");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Healthy reports: it climbs back (towards the base threshold, with no traffic measured).
    let climbed = wait_until(
        "the threshold climbs back",
        Duration::from_secs(30),
        Duration::from_millis(250),
        || async {
            report(&ms[other], "d", 0.0).await;
            let c = ms[other].current_threshold("d").await?;
            (c >= 300).then_some(c)
        },
    )
    .await;
    assert!(climbed <= 1000);
    let adj = adjustments(&ms[other], "d").await;
    assert!(
        adj[0]["new"].as_i64().unwrap() > adj[0]["old"].as_i64().unwrap(),
        "{}",
        adj[0]
    );
    assert!(
        adj[0]["reason"].as_str().unwrap().contains("healthy"),
        "{}",
        adj[0]
    );
}
