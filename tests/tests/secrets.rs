//! No secret in any log line, metric, error or API answer, end to end: two replicas with an
//! admin token from a file, a read-only token from the environment, Redis behind a password
//! (`requirepass`), webhook URLs with secrets in their paths and queries — one that takes the
//! alert, one that always fails (500), one where nothing listens — and a third replica given a
//! wrong Redis password. After deliveries that succeed and fail, settings read and written back
//! as shown (redacted: the webhooks are kept, a second alert arrives) and a round of bad requests,
//! every secret is searched for in: each manager's log (at debug level), every API answer
//! collected (settings, alerts, errors), `/metrics`, and what the alert pipeline keeps in Redis.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_protocol::Keys;
use sluice_tests::*;

const ADMIN: &str = "Adm1nT0ken-5ecret-9f2c";
const READER: &str = "R3adT0ken-5ecret-4b7e";
const REDIS_PW: &str = "R3disPassw0rd-5ecret-77aa";
const WRONG_PW: &str = "Wr0ngPassw0rd-5ecret-0c1d";
const HOOK_OK: &str = "T0OK/B0OK/HookPath5ecret1";
const HOOK_FAIL: &str = "T0FAIL/B0FAIL/HookPath5ecret2";
const HOOK_DOWN: &str = "HookPath5ecret3";
const HOOK_QUERY: &str = "QueryKey5ecret4";
const REFUSED_PW: &str = "UserInf0Passw0rd-5ecret";

fn secrets() -> [&'static str; 9] {
    [
        ADMIN, READER, REDIS_PW, WRONG_PW, HOOK_OK, HOOK_FAIL, HOOK_DOWN, HOOK_QUERY, REFUSED_PW,
    ]
}

/// Every piece of text seen, with where it came from.
#[derive(Default)]
struct Seen(Vec<(String, String)>);

impl Seen {
    fn add(&mut self, what: impl Into<String>, text: impl Into<String>) {
        self.0.push((what.into(), text.into()));
    }

    async fn call(&mut self, what: &str, req: reqwest::RequestBuilder) -> (u16, Value) {
        let r = req.send().await.expect(what);
        let status = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        self.add(format!("{what} ({status})"), text.clone());
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_is_ever_shown() {
    let redis = RedisServer::start_with(&["--requirepass", REDIS_PW]);
    let redis_url = format!("redis://:{REDIS_PW}@127.0.0.1:{}", redis.port);
    let ns = unique_ns("secrets");
    let keys = Keys::new(&ns).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin.token");
    std::fs::write(&token_file, format!("{ADMIN}\n")).unwrap();

    let ok = WebhookReceiver::start(0).await;
    let failing = WebhookReceiver::start(1_000).await;
    let down = format!("http://127.0.0.1:{}/{HOOK_DOWN}", free_port());
    let hook_ok = format!("{}/{HOOK_OK}?key={HOOK_QUERY}", ok.url);
    let hook_fail = format!("{}/{HOOK_FAIL}", failing.url);

    let opts = |node: &str, redis: &str, ns: &str| {
        let mut o = ManagerOpts::new(&shared_etcd(), redis, ns, node);
        o.auth = Some(ADMIN.to_string());
        o.extra = vec![
            "--api-token-file".into(),
            token_file.to_str().unwrap().into(),
        ];
        o.env = vec![
            ("SLUICE_API_READ_TOKEN".into(), READER.into()),
            ("RUST_LOG".into(), "debug".into()),
        ];
        o
    };
    let ms = vec![
        Manager::start(opts("n0", &redis_url, &ns)).await,
        Manager::start(opts("n1", &redis_url, &ns)).await,
    ];
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, _) = wait_for_leader(&refs, Duration::from_secs(15)).await;
    let m = &ms[leader];
    let wrong_url = format!("redis://:{WRONG_PW}@127.0.0.1:{}", redis.port);
    // A wrong Redis password is a configuration error: the replica exits 1 at start-up,
    // naming the endpoint (its log is searched below).
    let (code, wrong_log) = Manager::start_expecting_exit(
        opts("w0", &wrong_url, &unique_ns("wrongpw")),
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(code, Some(1), "{wrong_log}");
    let lower = wrong_log.to_lowercase();
    assert!(
        lower.contains("auth") && wrong_log.contains(&format!("127.0.0.1:{}", redis.port)),
        "the wrong Redis password is reported with the endpoint:\n{wrong_log}"
    );

    let mut seen = Seen::default();
    let settings = json!({
        "webhooks": [hook_ok, hook_fail, down],
        "skew_threshold_ms": 100,
        "alert_quiet_ms": 60000,
    });
    let (s, v) = seen
        .call(
            "PUT settings",
            m.request(reqwest::Method::PUT, "/api/v1/settings")
                .header("content-type", "application/json")
                .body(settings.to_string()),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["webhooks"],
        json!([
            format!("{}/…", ok.url.trim_end_matches("/hook")),
            format!("{}/…", failing.url.trim_end_matches("/hook")),
            format!("{}/…", down.trim_end_matches(&format!("/{HOOK_DOWN}"))),
        ]),
        "redacted"
    );

    // An alert: a host reports a clock 5 s ahead.
    let mut conn = redis_conn(&redis_url);
    set_host_report(&mut conn, &keys, "far-ahead", 5_000.0);
    // Delivered to one; five failed attempts at the second; the third unreachable.
    wait_until(
        "deliveries that succeed and fail",
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let log = m.proc.log();
            (!ok.received().is_empty()
                && failing.requests() >= 5
                && log.matches("giving up").count() >= 2)
                .then_some(())
        },
    )
    .await;

    // Settings read (redacted), edited and written back keep their webhooks: an alert of
    // another host still reaches the receiver.
    let (_, shown) = seen
        .call(
            "GET settings before editing",
            m.request(reqwest::Method::GET, "/api/v1/settings"),
        )
        .await;
    let mut back = shown.clone();
    back["skew_threshold_ms"] = json!(150);
    let (s, v) = seen
        .call(
            "PUT settings back as shown",
            m.request(reqwest::Method::PUT, "/api/v1/settings")
                .header("content-type", "application/json")
                .body(back.to_string()),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["webhooks"], shown["webhooks"]);
    set_host_report(&mut conn, &keys, "far-behind", -5_000.0);
    wait_until(
        "the second alert at the kept webhook",
        Duration::from_secs(15),
        Duration::from_millis(200),
        || async {
            ok.received()
                .iter()
                .any(|a| a["host"] == "far-behind")
                .then_some(())
        },
    )
    .await;

    // Bad requests of every kind; their answers are kept.
    let bad: Vec<(&str, reqwest::RequestBuilder)> = vec![
        (
            "a webhook with a password",
            m.request(reqwest::Method::PUT, "/api/v1/settings")
                .header("content-type", "application/json")
                .body(
                    json!({"webhooks": [format!("https://u:{REFUSED_PW}@hooks.example.com/x")]})
                        .to_string(),
                ),
        ),
        (
            "a private webhook on a replica that allows it, but not a URL",
            m.request(reqwest::Method::PUT, "/api/v1/settings")
                .header("content-type", "application/json")
                .body(json!({"webhooks": [format!("http//{HOOK_DOWN}")]}).to_string()),
        ),
        (
            "a wrong token",
            http()
                .put(m.url("/api/v1/settings"))
                .bearer_auth(WRONG_PW)
                .header("content-type", "application/json")
                .body("{}"),
        ),
        (
            "the read token writing",
            http()
                .put(m.url("/api/v1/tasks/x"))
                .bearer_auth(READER)
                .header("content-type", "application/json")
                .body(r#"{"threshold": 1}"#),
        ),
        (
            "no token reading the settings",
            http().get(m.url("/api/v1/settings")),
        ),
        (
            "a bad task",
            m.request(reqwest::Method::PUT, "/api/v1/tasks/x")
                .header("content-type", "application/json")
                .body(r#"{"threshold": -1}"#),
        ),
    ];
    for (what, req) in bad {
        let (s, v) = seen.call(what, req).await;
        assert!((400..500).contains(&s), "{what}: {s} {v}");
    }
    // Everything readable.
    for (what, req) in [
        (
            "GET settings (admin)",
            m.request(reqwest::Method::GET, "/api/v1/settings"),
        ),
        (
            "GET settings (reader)",
            http().get(m.url("/api/v1/settings")).bearer_auth(READER),
        ),
        ("GET alerts", http().get(m.url("/api/v1/alerts"))),
        ("GET cluster", http().get(m.url("/api/v1/cluster"))),
        ("GET hosts", http().get(m.url("/api/v1/hosts"))),
        ("GET tasks", http().get(m.url("/api/v1/tasks"))),
    ] {
        let (s, v) = seen.call(what, req).await;
        assert_eq!(s, 200, "{what}: {v}");
    }
    for (i, mm) in ms.iter().enumerate() {
        seen.add(
            format!("/metrics of replica {i}"),
            mm.metrics().await.unwrap(),
        );
    }
    // What the alert pipeline keeps in Redis.
    let sent: Vec<String> = redis::cmd("ZRANGE")
        .arg(keys.alerts_sent())
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .unwrap();
    assert!(!sent.is_empty(), "a delivery is recorded");
    seen.add("NS:alerts:sent", sent.join("\n"));
    let stream: redis::Value = redis::cmd("XRANGE")
        .arg(keys.alerts())
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .unwrap();
    seen.add("NS:alerts", format!("{stream:?}"));
    // Stop them (shutdown lines too), then read every log.
    seen.add("log of w0 (wrong Redis password)", wrong_log);
    let mut all = ms;
    for mm in &mut all {
        mm.proc.stop_with(libc::SIGTERM, Duration::from_secs(10));
        seen.add(format!("log of {}", mm.opts.node_id), mm.proc.log());
    }
    let total: usize = seen.0.iter().map(|(_, t)| t.len()).sum();
    eprintln!("searched {} texts, {total} bytes", seen.0.len());
    assert!(total > 10_000, "too little was searched to mean anything");
    for secret in secrets() {
        for (what, text) in &seen.0 {
            assert!(
                !text.contains(secret),
                "secret {secret:?} found in {what}:\n{text}"
            );
        }
    }
    // The receivers got what they were sent, and the redacted forms are in the logs.
    let log = &seen
        .0
        .iter()
        .find(|(w, _)| w.starts_with(&format!("log of n{leader}")))
        .unwrap()
        .1;
    assert!(
        log.contains("/…"),
        "failures are logged with the redacted URL"
    );
    assert_eq!(ok.received()[0]["host"], "far-ahead");
}
