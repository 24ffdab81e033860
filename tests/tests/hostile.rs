//! Hostile inputs against a real replica run as in production (admin token from a file, a
//! read-only token, no `--webhook-allow-private`): each is refused with a clear error and
//! nothing is written (settings, tasks and health reports are compared after every case). The
//! same table is in docs/security.md, "Hostile inputs".
//!
//! Deliveries: a receiver answering 302 makes the manager give up (the redirect target gets
//! nothing), and destinations that reach the settings without the API's check (written into
//! etcd by hand) are refused again at delivery time, literal IPs and host names alike.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_protocol::Keys;
use sluice_tests::*;

const ADMIN: &str = "adm1n-hostile-t0ken";
const READER: &str = "r3ad-hostile-t0ken";

struct Replica {
    m: Manager,
    ns: String,
    _dir: tempfile::TempDir,
}

async fn production_replica() -> Replica {
    let ns = unique_ns("hostile");
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin.token");
    std::fs::write(&token_file, format!("{ADMIN}\n")).unwrap();
    let mut o = ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0");
    o.webhook_allow_private = false;
    o.auth = Some(ADMIN.to_string());
    o.extra = vec![
        "--api-token-file".into(),
        token_file.to_str().unwrap().into(),
    ];
    o.env = vec![("SLUICE_API_READ_TOKEN".into(), READER.into())];
    let m = Manager::start(o).await;
    m.wait_leader().await;
    Replica { m, ns, _dir: dir }
}

/// What a refused request must leave as it was.
async fn snapshot(r: &Replica) -> (Value, Value, Vec<(String, String)>) {
    let settings = r.m.get_json("/api/v1/settings").await.expect("settings");
    let tasks = r.m.get_json("/api/v1/tasks").await.expect("tasks");
    let keys = Keys::new(&r.ns).unwrap();
    let mut c = redis_conn(&shared_redis());
    let reports: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.health_reports("t"))
        .query(&mut c)
        .unwrap();
    (settings, tasks, reports)
}

struct Case {
    what: &'static str,
    method: reqwest::Method,
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Option<String>,
    status: u16,
    /// Expected in the error message.
    says: &'static str,
    field: Option<&'static str>,
}

fn json_ct() -> (&'static str, String) {
    ("content-type", "application/json".into())
}
fn bearer(t: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {t}"))
}
fn settings_with(url: &str) -> Option<String> {
    Some(json!({"webhooks": [url], "skew_threshold_ms": 42}).to_string())
}

fn put_settings(what: &'static str, url: &str, says: &'static str) -> Case {
    Case {
        what,
        method: reqwest::Method::PUT,
        path: "/api/v1/settings",
        headers: vec![json_ct(), bearer(ADMIN)],
        body: settings_with(url),
        status: 400,
        says,
        field: Some("webhooks[0]"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_inputs_are_refused_and_change_nothing() {
    let r = production_replica().await;
    let (s, v) = r.m.put("/api/v1/tasks/t", r#"{"threshold": 100}"#).await;
    assert_eq!(s, 201, "{v}");
    let (s, v) =
        r.m.put("/api/v1/settings", r#"{"skew_threshold_ms": 77}"#)
            .await;
    assert_eq!(s, 200, "{v}");
    let before = snapshot(&r).await;
    assert_eq!(before.0["skew_threshold_ms"], 77);
    let origin = format!("http://{}", r.m.addr);
    let task = Some(r#"{"threshold": 1}"#.to_string());
    let health = Some(r#"{"error_rate": 1.0}"#.to_string());
    let private = "--webhook-allow-private";

    let cases = vec![
        put_settings("webhook to loopback", "http://127.0.0.1:9/hook", private),
        put_settings(
            "webhook to loopback, decimal form",
            "http://2130706433/hook",
            private,
        ),
        put_settings("webhook to IPv6 loopback", "http://[::1]:9/hook", private),
        put_settings(
            "webhook to the metadata address",
            "http://169.254.169.254/latest/meta-data/",
            private,
        ),
        put_settings(
            "webhook to a private range",
            "http://10.1.2.3/hook",
            private,
        ),
        put_settings(
            "webhook to IPv4-mapped loopback",
            "http://[::ffff:127.0.0.1]/h",
            private,
        ),
        put_settings(
            "webhook to a name resolving to loopback",
            "http://localhost:9/hook",
            private,
        ),
        put_settings("webhook to 0.0.0.0", "http://0.0.0.0:9/hook", private),
        put_settings(
            "webhook with a password",
            "https://u:pw@hooks.example.com/x",
            "password",
        ),
        put_settings("webhook of another scheme", "file:///etc/passwd", "http"),
        put_settings(
            "a redacted webhook that stands for nothing stored",
            "https://hooks.example.com/…",
            "matches no stored webhook",
        ),
        Case {
            what: "cross-origin task change (Origin of another site)",
            method: reqwest::Method::PUT,
            path: "/api/v1/tasks/t",
            headers: vec![
                json_ct(),
                bearer(ADMIN),
                ("origin", "http://evil.example".into()),
            ],
            body: task.clone(),
            status: 403,
            says: "Origin",
            field: None,
        },
        Case {
            what: "cross-origin health report (another port of the same host)",
            method: reqwest::Method::POST,
            path: "/api/v1/tasks/t/health",
            headers: vec![
                json_ct(),
                bearer(ADMIN),
                ("origin", "http://127.0.0.1:1".into()),
            ],
            body: health.clone(),
            status: 403,
            says: "Origin",
            field: None,
        },
        Case {
            what: "opaque origin (sandboxed page, file://)",
            method: reqwest::Method::DELETE,
            path: "/api/v1/tasks/t",
            headers: vec![bearer(ADMIN), ("origin", "null".into())],
            body: None,
            status: 403,
            says: "Origin",
            field: None,
        },
        Case {
            what: "browser says cross-site",
            method: reqwest::Method::PUT,
            path: "/api/v1/tasks/t",
            headers: vec![
                json_ct(),
                bearer(ADMIN),
                ("sec-fetch-site", "cross-site".into()),
            ],
            body: task.clone(),
            status: 403,
            says: "cross-site",
            field: None,
        },
        Case {
            what: "health report as a form post (text/plain, a CORS-simple request)",
            method: reqwest::Method::POST,
            path: "/api/v1/tasks/t/health",
            headers: vec![("content-type", "text/plain".into()), bearer(ADMIN)],
            body: health.clone(),
            status: 415,
            says: "application/json",
            field: None,
        },
        Case {
            what: "task change without a content type",
            method: reqwest::Method::PUT,
            path: "/api/v1/tasks/t",
            headers: vec![bearer(ADMIN)],
            body: task.clone(),
            status: 415,
            says: "application/json",
            field: None,
        },
        Case {
            what: "settings change as a form",
            method: reqwest::Method::PUT,
            path: "/api/v1/settings",
            headers: vec![
                ("content-type", "application/x-www-form-urlencoded".into()),
                bearer(ADMIN),
            ],
            body: Some(r#"{"skew_threshold_ms": 5}"#.into()),
            status: 415,
            says: "application/json",
            field: None,
        },
        Case {
            what: "settings read without a token",
            method: reqwest::Method::GET,
            path: "/api/v1/settings",
            headers: vec![],
            body: None,
            status: 401,
            says: "token",
            field: None,
        },
        Case {
            what: "settings read with a wrong token",
            method: reqwest::Method::GET,
            path: "/api/v1/settings",
            headers: vec![bearer("guess")],
            body: None,
            status: 401,
            says: "token",
            field: None,
        },
        Case {
            what: "health report without a token",
            method: reqwest::Method::POST,
            path: "/api/v1/tasks/t/health",
            headers: vec![json_ct()],
            body: health.clone(),
            status: 401,
            says: "token",
            field: None,
        },
        Case {
            what: "task delete without a token",
            method: reqwest::Method::DELETE,
            path: "/api/v1/tasks/t",
            headers: vec![],
            body: None,
            status: 401,
            says: "token",
            field: None,
        },
        Case {
            what: "task change with the read-only token",
            method: reqwest::Method::PUT,
            path: "/api/v1/tasks/t",
            headers: vec![json_ct(), bearer(READER)],
            body: task.clone(),
            status: 403,
            says: "read-only",
            field: None,
        },
        Case {
            what: "settings change with the read-only token",
            method: reqwest::Method::PUT,
            path: "/api/v1/settings",
            headers: vec![json_ct(), bearer(READER)],
            body: Some(r#"{"skew_threshold_ms": 5}"#.into()),
            status: 403,
            says: "read-only",
            field: None,
        },
    ];
    println!("| input | answer |");
    for c in &cases {
        let mut req = http().request(c.method.clone(), r.m.url(c.path));
        for (k, v) in &c.headers {
            req = req.header(*k, v);
        }
        if let Some(b) = &c.body {
            req = req.body(b.clone());
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        println!("| {} | {status} {} |", c.what, body["error"]);
        assert_eq!(status, c.status, "{}: {body}", c.what);
        let msg = body["error"].as_str().unwrap_or_default();
        assert!(msg.contains(c.says), "{}: {body}", c.what);
        if let Some(f) = c.field {
            assert_eq!(body["field"], f, "{}: {body}", c.what);
        }
        assert_eq!(
            snapshot(&r).await,
            before,
            "{}: something was written",
            c.what
        );
    }

    // The same calls done right pass: the checks refuse only what they should.
    let r2 = http()
        .get(r.m.url("/api/v1/settings"))
        .bearer_auth(READER)
        .send()
        .await
        .unwrap();
    assert_eq!(r2.status(), 200, "the read-only token reads the settings");
    let ok = http()
        .post(r.m.url("/api/v1/tasks/t/health"))
        .bearer_auth(ADMIN)
        .header("content-type", "application/json; charset=utf-8")
        .header("origin", &origin)
        .header("sec-fetch-site", "same-origin")
        .body(health.clone().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(
        ok.status(),
        204,
        "a same-origin browser request with the token"
    );
    // No secret in any answer above, nor in the log.
    let log = r.m.proc.log();
    assert!(!log.contains(ADMIN) && !log.contains(READER), "{log}");
}

/// Writes a host's report into `NS:hosts` as the SDK does, `offset_ms` off Redis's clock.
fn skewed_host(ns: &str, host: &str, offset_ms: f64) {
    let mut c = redis_conn(&shared_redis());
    set_host_report(&mut c, &Keys::new(ns).unwrap(), host, offset_ms);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_are_not_followed() {
    // Loopback receivers need the allow flag; redirects are refused whatever the flag.
    let target = WebhookReceiver::start(0).await;
    let redirector = WebhookReceiver::redirecting(&target.url).await;
    let ns = unique_ns("redir");
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    m.wait_leader().await;
    let settings = json!({"webhooks": [format!("{}/s3cret-redirect", redirector.url)]});
    let (s, v) = m.put("/api/v1/settings", &settings.to_string()).await;
    assert_eq!(s, 200, "{v}");
    skewed_host(&ns, "far-ahead", 5_000.0);
    wait_until(
        "the manager to give up on the redirect",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || async { (m.proc.log().contains("redirects are not followed")).then_some(()) },
    )
    .await;
    assert_eq!(redirector.requests(), 1, "a redirect is not retried");
    assert_eq!(target.requests(), 0, "the redirect target got nothing");
    let log = m.proc.log();
    assert!(!log.contains("s3cret-redirect"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_are_checked_again_at_delivery() {
    // Settings written into etcd by hand skip the API's check; the delivery refuses them:
    // a literal loopback IP, and a name that resolves to loopback (as a DNS answer changed
    // after the PUT would).
    let literal = WebhookReceiver::start(0).await;
    let named = WebhookReceiver::start(0).await;
    let by_name = named.url.replace("127.0.0.1", "localhost");
    let ns = unique_ns("rebind");
    let keys = Keys::new(&ns).unwrap();
    let settings = json!({"webhooks": [literal.url, by_name], "skew_threshold_ms": 100, "alert_quiet_ms": 10000});
    etcd_put(&shared_etcd(), &keys.etcd_settings(), &settings.to_string()).await;
    let mut o = ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0");
    o.webhook_allow_private = false;
    let m = Manager::start(o).await;
    m.wait_leader().await;
    skewed_host(&ns, "far-ahead", 5_000.0);
    wait_until(
        "both deliveries refused",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let log = m.proc.log();
            (log.contains("webhook destination refused")
                && log.contains("localhost resolves to")
                && log.contains("giving up"))
            .then_some(())
        },
    )
    .await;
    // The alert itself was recorded; nothing reached either receiver.
    let feed = m.get_json("/api/v1/alerts").await.unwrap();
    assert!(
        feed["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["host"] == "far-ahead"),
        "{feed}"
    );
    assert_eq!(literal.requests(), 0);
    assert_eq!(named.requests(), 0);
}
