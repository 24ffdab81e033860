//! The agent's HTTP decision API end to end (real etcd, Redis, `sluice-manager`,
//! `sluice-agent`):
//!
//! * `POST /v1/decide` single and batch, keyed and shadow tasks; bad input is a 400 naming
//!   the field, an unknown task a 404, and a refused batch consumes nothing;
//! * the agent and an in-process SDK client of the same host share one segment: their
//!   decisions draw on one host quota;
//! * Redis killed: the task's `on_failure` decides (`fallback_*`), `/readyz` turns 503 and
//!   back to 200 when Redis returns; a task never seen before is decided by the fallback too.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_tests::*;

async fn task(m: &Manager, name: &str, body: &str) {
    let (status, resp) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
    assert!(status == 200 || status == 201, "{status} {resp}");
    m.wait_rolled(name).await;
}

fn decisions(v: &Value) -> Vec<String> {
    v["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["decision"].as_str().unwrap_or("?").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decide_single_batch_keyed_shadow_and_refusals() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("ahttp");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    task(&m, "five", r#"{"threshold":5,"slice_ms":60000}"#).await;
    task(
        &m,
        "perkey",
        r#"{"threshold":2,"slice_ms":60000,"keyed":true}"#,
    )
    .await;
    task(
        &m,
        "shadowed",
        r#"{"threshold":1,"slice_ms":60000,"shadow":true}"#,
    )
    .await;
    // Not in the last 5 s of a minute (the limits are per minute).
    let into = now_ms().rem_euclid(60_000);
    if into > 55_000 {
        tokio::time::sleep(Duration::from_millis((60_000 - into + 200) as u64)).await;
    }
    let a = Agent::start(&redis, &ns, "h1", &[]).await;

    // Refusals first: each names its field and consumes nothing.
    for (body, code, field) in [
        (json!({}), 400, "task"),
        (json!({"task": 5}), 400, "task"),
        (json!({"task": "a/b"}), 400, "task"),
        (json!({"task": "five", "hits": 0}), 400, "hits"),
        (json!({"task": "five", "hits": -1}), 400, "hits"),
        (json!({"task": "five", "cost": 1}), 400, "cost"),
        (json!({"task": "five", "key": 7}), 400, "key"),
        (json!({"task": "no-such"}), 404, "task"),
        (json!({"requests": []}), 400, "requests"),
        (json!({"requests": [{"task": "five"}], "x": 1}), 400, "x"),
        (
            json!({"requests": [{"task": "five"}, {"task": "five", "hits": 0}]}),
            400,
            "requests[1].hits",
        ),
        (
            json!({"requests": [{"task": "five"}, {"task": "nope"}]}),
            404,
            "requests[1].task",
        ),
        (
            json!({"task": "perkey", "key": "k".repeat(300)}),
            400,
            "key",
        ),
    ] {
        let (status, v) = a.decide(&body).await;
        assert_eq!(status, code, "{body}: {v}");
        assert_eq!(v["field"], field, "{body}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let r = http()
        .post(a.url("/v1/decide"))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);

    // five: nothing was consumed by the refused requests above: 5 admitted, then limited.
    let (s, v) = a
        .decide(&json!({"requests": [
            {"task": "five", "hits": 2}, {"task": "five"}, {"task": "five", "hits": 2},
            {"task": "five"}
        ]}))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        decisions(&v),
        ["allowed", "allowed", "allowed", "limited"],
        "{v}"
    );
    let (_, v) = a.decide(&json!({"task": "five"})).await;
    assert_eq!(v["allowed"], false, "{v}");
    assert_eq!(v["decision"], "limited");
    let retry = v["retry_after_ms"].as_u64().unwrap();
    assert!(retry > 0 && retry <= 60_000, "{v}");

    // Keys: each its own 2.
    for k in ["alice", "bob"] {
        let (_, v) = a
            .decide(&json!({"requests": [
                {"task": "perkey", "key": k}, {"task": "perkey", "key": k},
                {"task": "perkey", "key": k}
            ]}))
            .await;
        assert_eq!(decisions(&v), ["allowed", "allowed", "limited"], "{k}: {v}");
    }

    // Shadow: the would-be rejection is admitted and says so.
    let (_, v) = a.decide(&json!({"task": "shadowed"})).await;
    assert_eq!(
        v,
        json!({"allowed": true, "decision": "allowed", "retry_after_ms": 0})
    );
    let (_, v) = a.decide(&json!({"task": "shadowed"})).await;
    assert_eq!(v["allowed"], true, "{v}");
    assert_eq!(v["decision"], "allowed", "{v}");
    assert_eq!(v["shadow_limited"], true, "{v}");

    // A deleted task becomes unknown (404) again, not a fallback admission.
    assert_eq!(m.delete("/api/v1/tasks/five").await, 204);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, v) = a.decide(&json!({"task": "five"})).await;
        if s == 404 {
            assert_eq!(v["field"], "task", "{v}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "deleted task still answers {s} {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Re-created: found again and decided on the global quota (not a fallback). The current
    // slice keeps what the old task spent of it (slices outlive a deletion until they expire,
    // as envoyproxy/ratelimit's counters outlive a config reload): `limited` within the
    // minute, `allowed` after it.
    task(&m, "five", r#"{"threshold":5,"slice_ms":60000}"#).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, v) = a.decide(&json!({"task": "five"})).await;
        if s == 200 {
            let d = v["decision"].as_str().unwrap_or("?");
            assert!(d == "limited" || d == "allowed", "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "re-created task answers {s} {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_and_the_sdk_of_one_host_share_its_quota() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("ashare");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    task(&m, "shared", r#"{"threshold":10,"slice_ms":60000}"#).await;
    let into = now_ms().rem_euclid(60_000);
    if into > 55_000 {
        tokio::time::sleep(Duration::from_millis((60_000 - into + 200) as u64)).await;
    }
    let a = Agent::start(&redis, &ns, "host-a", &[]).await;
    // An SDK client of the same host: same host id, same segment directory.
    let mut cfg = sluice::Config::new(redis.clone());
    cfg.namespace = ns.clone();
    cfg.host_id = "host-a".into();
    cfg.shm_dir = a.segment_dir.clone();
    let client = sluice::Client::new(cfg).unwrap();
    let t = client.task("shared").unwrap();
    assert!(t.wait_ready(Duration::from_secs(10)));
    let sdk_admitted = (0..6)
        .filter(|_| t.acquire_blocking(1).is_allowed())
        .count();
    assert_eq!(sdk_admitted, 6);
    assert_eq!(
        client.segment_path().parent(),
        Some(a.segment_dir.as_path()),
        "one segment"
    );
    let mut agent_admitted = 0;
    for _ in 0..10 {
        let (s, v) = a.decide(&json!({"task": "shared"})).await;
        assert_eq!(s, 200, "{v}");
        if v["allowed"] == true {
            agent_admitted += 1;
        }
    }
    assert_eq!(
        agent_admitted, 4,
        "the host's 10 were shared: SDK 6 + agent 4"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_follows_on_failure_and_readyz() {
    let etcd = shared_etcd();
    let mut r = RedisServer::start();
    let redis = r.url();
    let ns = unique_ns("afail");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    task(
        &m,
        "open",
        r#"{"threshold":100,"slice_ms":1000,"on_failure":"allow"}"#,
    )
    .await;
    task(
        &m,
        "closed",
        r#"{"threshold":100,"slice_ms":1000,"on_failure":"deny"}"#,
    )
    .await;
    let a = Agent::start(&redis, &ns, "h1", &["--acquire-timeout", "200ms"]).await;
    a.wait_ready().await;
    for t in ["open", "closed"] {
        let (_, v) = a.decide(&json!({"task": t})).await;
        assert_eq!(v["decision"], "allowed", "{t}: {v}");
    }
    r.kill();
    // The SDK notices at its next Redis call (a pull, the meta refresh): poll.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, o) = a.decide(&json!({"task": "open"})).await;
        let (_, c) = a.decide(&json!({"task": "closed"})).await;
        if o["decision"] == "fallback_allowed" && c["decision"] == "fallback_denied" {
            assert_eq!(c["allowed"], false);
            assert!(c["retry_after_ms"].as_u64().unwrap() > 0, "{c}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no fallback decisions with Redis down: {o} {c}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = http()
            .get(a.url("/readyz"))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0);
        if s == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz stayed {s} with Redis down"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // /healthz stays 200: the process is fine.
    let s = http().get(a.url("/healthz")).send().await.unwrap().status();
    assert_eq!(s.as_u16(), 200);
    r.restart();
    a.wait_ready().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, c) = a.decide(&json!({"task": "closed"})).await;
        if c["decision"] == "allowed" {
            break;
        }
        assert!(Instant::now() < deadline, "still {c} after Redis returned");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `adm` and `rej` of the slice of `task` containing `at_ms` (slices of `slice_ms`).
fn counted(redis: &str, ns: &str, task: &str, slice_ms: i64, at_ms: i64) -> (u64, u64) {
    let keys = sluice_protocol::Keys::new(ns).unwrap();
    let start = at_ms - at_ms.rem_euclid(slice_ms);
    let mut c = redis_conn(redis);
    let (a, r): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
        .arg(keys.slice(task, start))
        .arg(sluice_protocol::slice_field::ADMITTED)
        .arg(sluice_protocol::slice_field::REJECTED)
        .query(&mut c)
        .unwrap();
    (a.unwrap_or(0), r.unwrap_or(0))
}

/// Issue 23 item 4 (the HTTP door): a cost above `sluice_protocol::MAX_COUNT` (the largest
/// threshold a task may have, so the largest a slice can ever admit) is refused with a 400
/// naming the field, alone or in a batch, and counted nowhere; `MAX_COUNT` itself is a cost
/// like any other (refused by the limit, counted as rejected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_above_max_count_are_refused_and_counted_nowhere() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("acost");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    task(&m, "five", r#"{"threshold":5,"slice_ms":60000}"#).await;
    let into = now_ms().rem_euclid(60_000);
    if into > 50_000 {
        tokio::time::sleep(Duration::from_millis((60_000 - into + 200) as u64)).await;
    }
    let t0 = now_ms();
    let a = Agent::start(&redis, &ns, "h1", &[]).await;
    let max = sluice_protocol::MAX_COUNT;
    for (body, field) in [
        (json!({"task": "five", "hits": max + 1}), "hits"),
        (json!({"task": "five", "hits": u64::MAX}), "hits"),
        (json!({"task": "five", "hits": 1u64 << 63}), "hits"),
        (
            json!({"requests": [{"task": "five"}, {"task": "five", "hits": max + 1}]}),
            "requests[1].hits",
        ),
    ] {
        let (s, v) = a.decide(&body).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["field"], field, "{body}: {v}");
        assert!(
            v["error"].as_str().unwrap().contains("1000000000000"),
            "{v}"
        );
    }
    let metrics = a.metrics().await;
    assert!(
        !metrics.contains(r#"sluice_agent_decisions_total{api="http""#),
        "nothing decided: {metrics}"
    );
    // The refused requests consumed nothing: 5 admitted, then limited.
    let (_, v) = a
        .decide(&json!({"requests": (0..6).map(|_| json!({"task": "five"})).collect::<Vec<_>>()}))
        .await;
    assert_eq!(
        decisions(&v),
        [
            "allowed", "allowed", "allowed", "allowed", "allowed", "limited"
        ],
        "{v}"
    );
    // MAX_COUNT is a cost like any other: refused by the limit, not by the door.
    let (s, v) = a.decide(&json!({"task": "five", "hits": max})).await;
    assert_eq!((s, &v["decision"]), (200, &json!("limited")), "{v}");
    // What reaches Redis (flushed within ~1 s): 5 admitted, 1 + MAX_COUNT rejected; none of
    // the refused costs.
    wait_until(
        "the agent's counts flushed",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let got = counted(&redis, &ns, "five", 60_000, t0);
            async move { (got == (5, 1 + max)).then_some(()) }
        },
    )
    .await;
}

/// Issue 23 item 4 (the metric): a flush Redis refuses (the slice's `adm` already at
/// i64::MAX, so the next admissions' HINCRBY would overflow) is dropped by the agent's SDK client and counted
/// in `sluice_agent_flushes_dropped_total`; the agent's later admissions are still counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_redis_refuses_is_counted_in_the_agents_metrics() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("aflush");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    task(&m, "five", r#"{"threshold":5,"slice_ms":60000}"#).await;
    let into = now_ms().rem_euclid(60_000);
    if into > 45_000 {
        tokio::time::sleep(Duration::from_millis((60_000 - into + 200) as u64)).await;
    }
    let s = now_ms() - now_ms().rem_euclid(60_000);
    let a = Agent::start(&redis, &ns, "h1", &[]).await;
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut r = redis_conn(&redis);
    let _: () = redis::cmd("HSET")
        .arg(keys.slice("five", s))
        .arg("adm")
        .arg(i64::MAX)
        .query(&mut r)
        .unwrap();
    let (_, v) = a
        .decide(&json!({"requests": (0..6).map(|_| json!({"task": "five"})).collect::<Vec<_>>()}))
        .await;
    assert_eq!(
        decisions(&v).last().map(String::as_str),
        Some("limited"),
        "{v}"
    );
    wait_until(
        "the refused flush counted in the agent's metrics",
        Duration::from_secs(15),
        Duration::from_millis(200),
        || {
            let a = &a;
            async move {
                let m = a.metrics().await;
                (metric_value(&m, "sluice_agent_flushes_dropped_total").unwrap_or(0.0) >= 1.0)
                    .then_some(())
            }
        },
    )
    .await;
}
