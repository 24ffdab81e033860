//! HTTPS webhooks, end to end: a local HTTPS receiver whose certificate (IP SAN 127.0.0.1) is
//! signed by a CA made in the test, trusted by the manager only through `SSL_CERT_FILE`,
//! receives a real clock-skew alert — a load-generating host under `faketime +1.5s`. A second
//! receiver whose certificate comes from a CA nobody trusts gets nothing: the certificate is
//! verified, and the failure is logged without the URL.

use std::time::Duration;

use serde_json::json;
use sluice_tests::pki::TestCa;
use sluice_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_skew_alert_reaches_an_https_webhook_trusted_via_ssl_cert_file() {
    let ca = TestCa::new("sluice test webhook CA");
    let leaf = ca.issue_for("receiver", &["IP:127.0.0.1"]);
    let rx = WebhookReceiver::start_tls(&leaf.cert, &leaf.key).await;
    assert!(rx.url.starts_with("https://127.0.0.1:"), "{}", rx.url);
    let rogue_ca = TestCa::new("a CA nobody trusts");
    let rogue_leaf = rogue_ca.issue_for("rogue", &["IP:127.0.0.1"]);
    let rogue = WebhookReceiver::start_tls(&rogue_leaf.cert, &rogue_leaf.key).await;

    let ns = unique_ns("whtls");
    let mut o = ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0");
    o.env = vec![(
        "SSL_CERT_FILE".into(),
        ca.cert.to_str().unwrap().to_string(),
    )];
    let m = Manager::start(o).await;
    m.wait_leader().await;
    let secret_path = "services/T0TLS/B0TLS/tls5ecret";
    let settings = json!({
        "webhooks": [format!("{}/{secret_path}", rx.url), format!("{}/{secret_path}", rogue.url)],
        "skew_threshold_ms": 100,
        "alert_quiet_ms": 30000,
    });
    let (s, v) = m.put("/api/v1/settings", &settings.to_string()).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = m
        .put(
            "/api/v1/tasks/sk",
            r#"{"threshold": 20000, "slice_ms": 1000, "pull": 20}"#,
        )
        .await;
    assert_eq!(s, 201, "{v}");
    m.wait_rolled("sk").await;

    let skewed = format!("{ns}-skewed");
    let _segments = SegmentGuard(vec![(ns.clone(), skewed.clone())]);
    let args = loadgen_args(
        &shared_redis(),
        &ns,
        "sk",
        &skewed,
        2,
        12_000,
        &["--rate", "500"],
    );
    let mut host = Loadgen::spawn_under(&["faketime", "-f", "+1.5s"], &args);
    let alert = wait_until(
        "a clock-skew alert at the HTTPS webhook",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            rx.received()
                .into_iter()
                .find(|a| a["kind"] == "clock_skew" && a["host"] == skewed.as_str())
        },
    )
    .await;
    assert_eq!(alert["state"], "firing", "{alert}");
    let offset = alert["details"]["offset_ms"].as_f64().unwrap();
    assert!((1300.0..=1700.0).contains(&offset), "{alert}");
    assert!(alert["text"].as_str().unwrap().contains(&skewed), "{alert}");

    // The untrusted receiver: handshakes fail, nothing is received, the log names the
    // certificate problem and the redacted URL only.
    wait_until(
        "the untrusted webhook's failure in the log",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async {
            let log = m.proc.log();
            log.lines()
                .any(|l| {
                    l.contains("webhook delivery failed")
                        && l.contains(&format!("{}/…", rogue.url.trim_end_matches("/hook")))
                        && l.to_lowercase().contains("certificate")
                })
                .then_some(())
        },
    )
    .await;
    assert!(rogue.received().is_empty());
    host.wait_json(Duration::from_secs(30)).await;
    let log = m.proc.log();
    assert!(!log.contains("tls5ecret"), "{log}");
}
