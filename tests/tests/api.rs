//! The task API against a real replica: bad input is a 400 naming the field and changes
//! nothing; stale versions are 409; the token protects writes.

use std::time::Duration;

use serde_json::Value;
use sluice_protocol::{Keys, meta_field};
use sluice_tests::*;

async fn leader_replica(extra: &[&str]) -> (Manager, String) {
    let ns = unique_ns("api");
    let mut o = ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0");
    o.extra = extra.iter().map(|s| s.to_string()).collect();
    let m = Manager::start(o).await;
    m.wait_leader().await;
    (m, ns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_are_400_with_the_field_and_change_nothing() {
    let (m, ns) = leader_replica(&[]).await;
    let good = r#"{"threshold": 100, "description": "original"}"#;
    let (s, created) = m.put("/api/v1/tasks/t", good).await;
    assert_eq!(s, 201, "{created}");
    let version = created["version"].as_i64().unwrap();
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&shared_redis());
    let meta_version = || {
        let mut conn = redis_conn(&shared_redis());
        redis::cmd("HGET")
            .arg(keys.meta("t"))
            .arg(meta_field::VERSION)
            .query::<Option<i64>>(&mut conn)
            .unwrap()
    };
    wait_until(
        "meta written",
        Duration::from_secs(5),
        Duration::from_millis(20),
        || {
            let v = meta_version();
            async move { (v == Some(version)).then_some(()) }
        },
    )
    .await;

    let cases: &[(&str, &str, &str)] = &[
        ("t", "{", ""),
        ("t", "not json", ""),
        ("t", "[1,2]", ""),
        ("t", "{}", "threshold"),
        ("t", r#"{"threshold": -5}"#, "threshold"),
        ("t", r#"{"threshold": 2.5}"#, "threshold"),
        ("t", r#"{"threshold": "100"}"#, "threshold"),
        ("t", r#"{"threshold": 10000000000000}"#, "threshold"),
        ("t", r#"{"threshold": 1, "slice_ms": 50}"#, "slice_ms"),
        ("t", r#"{"threshold": 1, "slice_ms": 86400001}"#, "slice_ms"),
        ("t", r#"{"threshold": 1, "pull": -1}"#, "pull"),
        (
            "t",
            r#"{"threshold": 1, "local_limit": "x"}"#,
            "local_limit",
        ),
        (
            "t",
            r#"{"threshold": 1, "on_failure": "explode"}"#,
            "on_failure",
        ),
        ("t", r#"{"threshold": 1, "mode": "fast"}"#, "mode"),
        (
            "t",
            r#"{"threshold": 1, "fallback": {"algorithm": "magic"}}"#,
            "fallback.algorithm",
        ),
        (
            "t",
            r#"{"threshold": 1, "fallback": {"burst": -2}}"#,
            "fallback.burst",
        ),
        (
            "t",
            r#"{"threshold": 1, "schedules": [{"cron": "61 * * * * *", "threshold": 5}]}"#,
            "schedules[0].cron",
        ),
        (
            "t",
            r#"{"threshold": 1, "schedules": [{"cron": "* * * * *", "threshold": 5}]}"#,
            "schedules[0].cron",
        ),
        (
            "t",
            r#"{"threshold": 1, "schedules": [{"cron": "* * * * * *"}]}"#,
            "schedules[0].threshold",
        ),
        (
            "t",
            r#"{"threshold": 1, "schedules": [{"cron": "* * * * * *", "threshold": 1, "x": 1}]}"#,
            "schedules[0].x",
        ),
        (
            "t",
            r#"{"threshold": 1, "schedules": [{"cron": "* * * * * *", "threshold": 1, "timezone": "Mars/Olympus"}]}"#,
            "schedules[0].timezone",
        ),
        (
            "t",
            r#"{"threshold": 1, "dynamic": {"enabled": true, "min": 10, "max": 5}}"#,
            "dynamic.min",
        ),
        (
            "t",
            r#"{"threshold": 1, "dynamic": {"target_error_rate": 0}}"#,
            "dynamic.target_error_rate",
        ),
        (
            "t",
            r#"{"threshold": 1, "dynamic": {"target_latency_ms": -1}}"#,
            "dynamic.target_latency_ms",
        ),
        ("t", r#"{"threshold": 1, "unknown": true}"#, "unknown"),
        ("t", r#"{"threshold": 1, "name": "other"}"#, "name"),
        ("t", r#"{"threshold": 1, "version": "v1"}"#, "version"),
        ("bad%20name", r#"{"threshold": 1}"#, "name"),
        ("a:b", r#"{"threshold": 1}"#, "name"),
        (&"x".repeat(65), r#"{"threshold": 1}"#, "name"),
    ];
    for (name, body, field) in cases {
        let (status, v) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
        assert_eq!(status, 400, "{name} {body}: {v}");
        assert_eq!(v["field"], *field, "{name} {body}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }

    // Nothing changed: same spec, same version, in etcd and in Redis; no other task appeared.
    let now = m.get_json("/api/v1/tasks/t").await.unwrap();
    assert_eq!(now["version"], version);
    assert_eq!(now["threshold"], 100);
    assert_eq!(now["description"], "original");
    let list = m.get_json("/api/v1/tasks").await.unwrap();
    assert_eq!(list["tasks"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(meta_version(), Some(version));
    let _: () = redis::cmd("PING").query(&mut conn).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_prevent_lost_updates() {
    let (m, _) = leader_replica(&[]).await;
    let (s, v) = m
        .put("/api/v1/tasks/v", r#"{"threshold": 1, "version": 0}"#)
        .await;
    assert_eq!(s, 201, "version 0 = create only: {v}");
    let v1 = v["version"].as_i64().unwrap();
    let (s, v) = m
        .put("/api/v1/tasks/v", r#"{"threshold": 2, "version": 0}"#)
        .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(v["current_version"], v1);

    // Two clients read v1; the first write wins, the second gets 409.
    let (s, v) = m
        .put(
            "/api/v1/tasks/v",
            &format!(r#"{{"threshold": 3, "version": {v1}}}"#),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let v2 = v["version"].as_i64().unwrap();
    assert!(v2 > v1);
    let (s, v) = m
        .put(
            "/api/v1/tasks/v",
            &format!(r#"{{"threshold": 4, "version": {v1}}}"#),
        )
        .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(v["field"], "version");
    let got = m.get_json("/api/v1/tasks/v").await.unwrap();
    assert_eq!(got["threshold"], 3);

    // A GET body can be sent back as is (name and version included), except read-only status.
    let mut body = got.clone();
    body.as_object_mut().unwrap().remove("status");
    body["threshold"] = Value::from(5);
    let (s, v) = m.put("/api/v1/tasks/v", &body.to_string()).await;
    assert_eq!(s, 200, "{v}");

    assert_eq!(m.delete("/api/v1/tasks/nope").await, 404);
    let r = http()
        .get(m.url("/api/v1/tasks/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http().get(m.url("/api/v1/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_token_protects_mutations_and_the_settings() {
    let (m, _) = leader_replica(&["--api-token", "s3cret"]).await;
    let (s, v) = m.put("/api/v1/tasks/a", r#"{"threshold": 1}"#).await;
    assert_eq!(s, 401, "{v}");
    assert!(
        m.get_json("/api/v1/tasks").await.unwrap()["tasks"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    let r = http()
        .put(m.url("/api/v1/tasks/a"))
        .bearer_auth("wrong")
        .header("content-type", "application/json")
        .body(r#"{"threshold": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http()
        .put(m.url("/api/v1/tasks/a"))
        .bearer_auth("s3cret")
        .header("content-type", "application/json")
        .body(r#"{"threshold": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(m.delete("/api/v1/tasks/a").await, 401);
    // Reads stay open, except the settings.
    assert!(m.get_json("/api/v1/tasks/a").await.is_some());
    assert!(m.metrics().await.unwrap().contains("sluice_leader"));
    let r = http().get(m.url("/api/v1/settings")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http()
        .get(m.url("/api/v1/settings"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// Writes `n` specs `{prefix}{i:05}` into etcd by hand (100 per transaction), each with a
/// description of `pad` bytes.
async fn etcd_specs(ns: &str, prefix: &str, n: usize, spec: &str, pad: usize) {
    let keys = Keys::new(ns).unwrap();
    let mut c = etcd_client::Client::connect([shared_etcd()], None)
        .await
        .expect("etcd client");
    let body = spec.replace("PAD", &"x".repeat(pad));
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let ops: Vec<etcd_client::TxnOp> = chunk
            .iter()
            .map(|i| {
                etcd_client::TxnOp::put(
                    keys.etcd_task(&format!("{prefix}{i:05}")),
                    body.as_str(),
                    None,
                )
            })
            .collect();
        c.txn(etcd_client::Txn::new().and_then(ops))
            .await
            .expect("etcd txn");
    }
}

/// More stored specs than one gRPC message holds (tonic's 4 MiB default): the API lists them
/// all, and a replica started afterwards loads them all into its watched snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specs_beyond_one_grpc_message_are_listed_and_loaded() {
    let ns = unique_ns("apibig");
    // Concurrency tasks: the leader writes their meta only (no slices to roll).
    let n = 5_000;
    etcd_specs(
        &ns,
        "big",
        n,
        r#"{"threshold": 10, "mode": "concurrency", "description": "PAD"}"#,
        1_000,
    )
    .await;
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    wait_until(
        "every spec loaded",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async { (m.metric("sluice_tasks").await == Some(n as f64)).then_some(()) },
    )
    .await;
    let r = http()
        .get(m.url("/api/v1/tasks"))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let tasks = v["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), n);
    assert_eq!(tasks[0]["name"], "big00000");
    assert_eq!(tasks[n - 1]["name"], format!("big{:05}", n - 1));
    assert_eq!(m.log_count("panicked"), 0);
}
