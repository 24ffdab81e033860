//! Keys of keyed tasks are client data, often credentials: real etcd, Redis, `sluice-manager`
//! and SDK clients.
//!
//! * With `--api-token`, `GET /api/v1/tasks/{name}/keys` needs a token (admin or read-only):
//!   401 without one or with a wrong one.
//! * After keyed traffic on keys `sk_live_…`, no such string is anywhere in Redis (key names,
//!   hash fields and values, sorted-set members, strings, lists) nor in any API answer: the
//!   top-key sets hold keyed digests (`#` + 32 hex digits, HMAC-SHA-256 under
//!   the namespace's secret in etcd), which the API shows as they are; the secret itself is in
//!   no API answer.
//! * A task with `"clear_keys": true` shows its keys in clear.

use std::time::Duration;

use serde_json::Value;
use sluice_tests::*;

const ADMIN: &str = "adm1n-t0ken";
const READER: &str = "r3ad-t0ken";

async fn get(m: &Manager, path: &str, token: Option<&str>) -> (u16, String) {
    let mut r = m.client().get(m.url(path));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().await.expect("GET");
    (r.status().as_u16(), r.text().await.unwrap_or_default())
}

async fn key_secret(etcd: &str, ns: &str) -> sluice_protocol::KeySecret {
    let mut c = etcd_client::Client::connect([etcd], None).await.unwrap();
    let r = c.get(format!("/{ns}/key_secret"), None).await.unwrap();
    let kv = r.kvs().first().expect("the leader created the key secret");
    sluice_protocol::KeySecret::parse(std::str::from_utf8(kv.value()).unwrap())
        .expect("64 hex digits")
}

/// Every string stored under the namespace: key names, and what each holds.
fn dump_namespace(conn: &mut redis::Connection, ns: &str) -> Vec<String> {
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:*"))
        .query(conn)
        .unwrap();
    let mut out = Vec::new();
    for k in names {
        let t: String = redis::cmd("TYPE").arg(&k).query(conn).unwrap();
        let held: Vec<String> = match t.as_str() {
            "hash" => redis::cmd("HGETALL").arg(&k).query(conn).unwrap(),
            "zset" => redis::cmd("ZRANGE")
                .arg(&k)
                .arg(0)
                .arg(-1)
                .query(conn)
                .unwrap(),
            "set" => redis::cmd("SMEMBERS").arg(&k).query(conn).unwrap(),
            "list" => redis::cmd("LRANGE")
                .arg(&k)
                .arg(0)
                .arg(-1)
                .query(conn)
                .unwrap(),
            "string" => vec![redis::cmd("GET").arg(&k).query(conn).unwrap()],
            "stream" => {
                let v: redis::Value = redis::cmd("XRANGE")
                    .arg(&k)
                    .arg("-")
                    .arg("+")
                    .query(conn)
                    .unwrap();
                vec![format!("{v:?}")]
            }
            other => vec![format!("<{other}>")],
        };
        out.push(k);
        out.extend(held);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_stored_and_shown_as_keyed_digests_and_reading_them_needs_a_token() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keysec");
    let mut opts = ManagerOpts::new(&etcd, &redis, &ns, "m1");
    opts.extra = vec![
        "--api-token".into(),
        ADMIN.into(),
        "--api-read-token".into(),
        READER.into(),
    ];
    opts.auth = Some(ADMIN.into());
    let m = Manager::start(opts).await;
    for (task, body) in [
        ("secret", r#"{"threshold":5,"slice_ms":1000,"keyed":true}"#),
        (
            "clear",
            r#"{"threshold":5,"slice_ms":1000,"keyed":true,"clear_keys":true}"#,
        ),
    ] {
        let (status, resp) = m.put(&format!("/api/v1/tasks/{task}"), body).await;
        assert!(status == 200 || status == 201, "{status} {resp}");
        m.wait_rolled(task).await;
    }
    // clear_keys is for keyed tasks only.
    let (status, resp) = m
        .put(
            "/api/v1/tasks/plain",
            r#"{"threshold":5,"slice_ms":1000,"clear_keys":true}"#,
        )
        .await;
    assert_eq!((status, resp["field"].as_str()), (400, Some("clear_keys")));

    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let (secret_task, clear_task) = (
        client.task("secret").unwrap(),
        client.task("clear").unwrap(),
    );
    assert!(secret_task.wait_ready(Duration::from_secs(10)));
    assert!(clear_task.wait_ready(Duration::from_secs(10)));
    // Traffic on credential-like keys: admitted and rejected, cached and direct decisions.
    for round in 0..2 {
        for i in 0..12 {
            let k = secret_task.key(&format!("sk_live_{i:04}abcdef")).unwrap();
            for _ in 0..8 {
                let _ = k.acquire(1).await;
            }
        }
        let k = clear_task.key("tenant-acme").unwrap();
        for _ in 0..8 {
            let _ = k.acquire(1).await;
        }
        if round == 0 {
            tokio::time::sleep(Duration::from_millis(1_100)).await;
        }
    }

    // Reading keys needs a token.
    let path = "/api/v1/tasks/secret/keys";
    assert_eq!(get(&m, path, None).await.0, 401);
    assert_eq!(get(&m, path, Some("wrong")).await.0, 401);
    assert_eq!(get(&m, "/api/v1/tasks/secret/keys/", None).await.0, 401);
    let (status, body) = get(&m, path, None).await;
    assert!(body.contains("needs Authorization"), "{status} {body}");
    // The top keys arrive with the SDK's once-a-second report.
    let secret = key_secret(&etcd, &ns).await;
    let v: Value = wait_until(
        "the top keys of task secret",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let (s, b) = get(&m, path, Some(READER)).await;
            let v: Value = serde_json::from_str(&b).ok()?;
            (s == 200
                && v["top_admitted"].as_array().is_some_and(|a| a.len() >= 10)
                && v["top_rejected"].as_array().is_some_and(|a| !a.is_empty()))
            .then_some(v)
        },
    )
    .await;
    let labels: Vec<String> = (0..12)
        .map(|i| sluice_protocol::key_label(Some(&secret), &format!("sk_live_{i:04}abcdef")))
        .collect();
    for e in v["top_admitted"].as_array().unwrap() {
        let k = e["key"].as_str().unwrap();
        assert!(
            labels.iter().any(|l| l == k),
            "{k} is not a key's label: {v}"
        );
    }
    assert_eq!(get(&m, path, Some(ADMIN)).await.0, 200);
    // The clear task shows its key as it is.
    let clear = wait_until(
        "the top keys of task clear",
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let (_, b) = get(&m, "/api/v1/tasks/clear/keys", Some(READER)).await;
            b.contains("tenant-acme").then_some(b)
        },
    )
    .await;
    assert!(!clear.contains('#'), "{clear}");

    // Nothing in Redis holds a raw key of the secret task.
    let mut conn = redis_conn(&redis);
    let stored = dump_namespace(&mut conn, &ns);
    let leaks: Vec<&String> = stored.iter().filter(|s| s.contains("sk_live_")).collect();
    assert!(leaks.is_empty(), "raw keys in Redis: {leaks:?}");
    assert!(
        stored.iter().any(|s| labels.contains(s)),
        "no key label stored"
    );
    // No API answer shows a raw key or the secret.
    for p in [
        "/api/v1/tasks",
        "/api/v1/tasks/secret",
        "/api/v1/tasks/secret/keys?minutes=10&limit=100",
        "/api/v1/tasks/secret/traffic",
        "/api/v1/tasks/secret/history",
        "/api/v1/settings",
        "/api/v1/hosts",
        "/api/v1/cluster",
        "/api/v1/openapi.json",
    ] {
        let (_, b) = get(&m, p, Some(ADMIN)).await;
        assert!(!b.contains("sk_live_"), "{p}: {b}");
        assert!(!b.contains(secret.expose()), "{p} shows the key secret");
    }
    let metrics = m.metrics().await.unwrap_or_default();
    assert!(!metrics.contains("sk_live_") && !metrics.contains(secret.expose()));
    assert!(
        !m.proc.log().contains(secret.expose()),
        "the secret in the log"
    );
}
