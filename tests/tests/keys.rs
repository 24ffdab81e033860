//! A keyed task's top keys through the API (`GET /api/v1/tasks/{name}/keys`) against a real
//! replica, and their lifecycle: deleting the task deletes its top-key sets, so a task
//! re-created under the same name shows none of the old task's keys.
//!
//! The sets (`NS:{T}:top:<minute>`, `topr:<minute>`) are written by hand with Redis, as the
//! SDK's hosts write them.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_protocol::Keys;
use sluice_tests::*;

async fn leader_replica() -> (Manager, String) {
    let ns = unique_ns("keys");
    let m = Manager::start(ManagerOpts::new(&shared_etcd(), &shared_redis(), &ns, "n0")).await;
    m.wait_leader().await;
    (m, ns)
}

/// GET `path`: (status, JSON body or Null).
async fn get(m: &Manager, path: &str) -> (u16, Value) {
    let r = m
        .request(reqwest::Method::GET, path)
        .send()
        .await
        .expect("GET");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn minute(ms: i64) -> i64 {
    ms - ms.rem_euclid(60_000)
}

fn zadd(conn: &mut redis::Connection, key: &str, pairs: &[(&str, i64)]) {
    for (member, score) in pairs {
        let _: () = redis::cmd("ZADD")
            .arg(key)
            .arg(*score)
            .arg(*member)
            .query(conn)
            .unwrap();
    }
    let _: () = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(600_000)
        .query(conn)
        .unwrap();
}

fn entries(v: &Value) -> Vec<(String, u64)> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|e| {
            (
                e["key"].as_str().unwrap().to_string(),
                e["permits"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_keys_are_merged_over_the_minutes_asked_for() {
    let (m, ns) = leader_replica().await;
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&shared_redis());
    let (s, b) = m
        .put(
            "/api/v1/tasks/kt",
            r#"{"threshold": 50, "keyed": true, "key_overrides": {"vip": 500, "ключ 1": 7}}"#,
        )
        .await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = m.put("/api/v1/tasks/plain", r#"{"threshold": 50}"#).await;
    assert_eq!(s, 201, "{b}");

    // No sets yet: a keyed task with empty lists.
    let (s, v) = get(&m, "/api/v1/tasks/kt/keys").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["task"], "kt");
    assert_eq!(v["keyed"], true);
    assert_eq!(v["window_ms"], 300_000);
    assert_eq!(v["overrides"], json!({"vip": 500, "ключ 1": 7}));
    assert_eq!(v["top_admitted"], json!([]));
    assert_eq!(v["top_rejected"], json!([]));

    // Minutes m (now), m−1 and m−4 hold admitted counts; m and m−2 rejected ones. A minute
    // boundary passed while this runs shifts the window by one: then the sets are written
    // again for the new minute and read again, until one round fits in one minute.
    let mut round = 0;
    let (now, v3, v5, v1) = loop {
        round += 1;
        assert!(round <= 5, "5 rounds each crossed a minute boundary");
        let now = minute(now_ms());
        for i in -1..=11i64 {
            for k in [
                keys.top_keys("kt", now - i * 60_000),
                keys.top_rejected_keys("kt", now - i * 60_000),
            ] {
                let _: () = redis::cmd("DEL").arg(k).query(&mut conn).unwrap();
            }
        }
        zadd(
            &mut conn,
            &keys.top_keys("kt", now),
            &[("a", 10), ("b", 30), ("ключ 1", 5)],
        );
        zadd(
            &mut conn,
            &keys.top_keys("kt", now - 60_000),
            &[("a", 25), ("c", 1)],
        );
        zadd(
            &mut conn,
            &keys.top_keys("kt", now - 240_000),
            &[("old", 1_000)],
        );
        zadd(&mut conn, &keys.top_rejected_keys("kt", now), &[("b", 4)]);
        zadd(
            &mut conn,
            &keys.top_rejected_keys("kt", now - 120_000),
            &[("a", 9), ("b", 2)],
        );
        // Not a key (not UTF-8): skipped and counted.
        let _: () = redis::cmd("ZADD")
            .arg(keys.top_keys("kt", now))
            .arg(99)
            .arg(&b"\xff\xfe"[..])
            .query(&mut conn)
            .unwrap();
        let v3 = get(&m, "/api/v1/tasks/kt/keys?minutes=3").await;
        let v5 = get(&m, "/api/v1/tasks/kt/keys?limit=2").await;
        let v1 = get(&m, "/api/v1/tasks/kt/keys?minutes=1&limit=1").await;
        if minute(now_ms()) == now {
            break (now, v3, v5, v1);
        }
    };

    // 3 minutes: m, m−1, m−2 (m−4 left out).
    let (s, v) = v3;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["window_ms"], 180_000);
    assert_eq!(
        entries(&v["top_admitted"]),
        vec![
            ("a".to_string(), 35),
            ("b".to_string(), 30),
            ("ключ 1".to_string(), 5),
            ("c".to_string(), 1),
        ],
        "summed over the minutes, busiest first: {v}"
    );
    assert_eq!(
        entries(&v["top_rejected"]),
        vec![("a".to_string(), 9), ("b".to_string(), 6)],
        "{v}"
    );
    assert_eq!(v["malformed_entries"], 1, "{v}");
    // The default window (5 minutes) reaches m−4.
    let (s, v) = v5;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        entries(&v["top_admitted"]),
        vec![("old".to_string(), 1_000), ("a".to_string(), 35)],
        "{v}"
    );
    // One minute: only m.
    let (s, v) = v1;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        entries(&v["top_admitted"]),
        vec![("b".to_string(), 30)],
        "{v}"
    );
    assert_eq!(
        entries(&v["top_rejected"]),
        vec![("b".to_string(), 4)],
        "{v}"
    );

    // A task that is not keyed: keyed false, empty lists, even with sets under its name.
    zadd(&mut conn, &keys.top_keys("plain", now), &[("x", 3)]);
    let (s, v) = get(&m, "/api/v1/tasks/plain/keys").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["keyed"], false);
    assert_eq!(v["overrides"], json!({}));
    assert_eq!(v["top_admitted"], json!([]));
    assert_eq!(v["top_rejected"], json!([]));

    // Bad parameters: 400 naming the parameter.
    for (q, field) in [
        ("minutes=0", "minutes"),
        ("minutes=11", "minutes"),
        ("minutes=five", "minutes"),
        ("minutes=-1", "minutes"),
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=1.5", "limit"),
        ("top=3", "top"),
    ] {
        let (s, v) = get(&m, &format!("/api/v1/tasks/kt/keys?{q}")).await;
        assert_eq!(s, 400, "{q}: {v}");
        assert_eq!(v["field"], field, "{q}: {v}");
    }
    // Unknown task: 404; a bad name: 400 naming `name`.
    let (s, v) = get(&m, "/api/v1/tasks/nope/keys").await;
    assert_eq!(s, 404, "{v}");
    let (s, v) = get(&m, "/api/v1/tasks/bad%20name/keys").await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["field"], "name", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_keyed_task_deletes_its_top_keys() {
    let (m, ns) = leader_replica().await;
    let keys = Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&shared_redis());
    let spec = r#"{"threshold": 50, "keyed": true}"#;
    let (s, b) = m.put("/api/v1/tasks/kt", spec).await;
    assert_eq!(s, 201, "{b}");
    m.wait_rolled("kt").await;

    // Every set a host may have written: the last 11 minutes and one ahead (a host clock
    // running ahead), admitted and rejected.
    let now = minute(now_ms());
    let mut sets = Vec::new();
    for i in -1..=10i64 {
        let at = now - i * 60_000;
        sets.push(keys.top_keys("kt", at));
        sets.push(keys.top_rejected_keys("kt", at));
    }
    for k in &sets {
        zadd(&mut conn, k, &[("old-key", 42)]);
    }
    // Another task's sets are not touched.
    let (s, b) = m.put("/api/v1/tasks/other", spec).await;
    assert_eq!(s, 201, "{b}");
    let other = keys.top_keys("other", now);
    zadd(&mut conn, &other, &[("theirs", 1)]);
    let (s, v) = get(&m, "/api/v1/tasks/kt/keys?minutes=10").await;
    assert_eq!(s, 200, "{v}");
    assert!(
        entries(&v["top_admitted"])
            .iter()
            .any(|(k, _)| k == "old-key"),
        "{v}"
    );

    assert_eq!(m.delete("/api/v1/tasks/kt").await, 204);
    let mut check = redis_conn(&shared_redis());
    wait_until(
        "the top-key sets of the deleted task to be gone",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let left: Vec<&String> = sets
                .iter()
                .filter(|k| {
                    redis::cmd("EXISTS")
                        .arg(k.as_str())
                        .query::<i64>(&mut check)
                        .unwrap()
                        == 1
                })
                .collect();
            let done = left.is_empty();
            async move { done.then_some(()) }
        },
    )
    .await;
    let n: i64 = redis::cmd("EXISTS").arg(&other).query(&mut conn).unwrap();
    assert_eq!(n, 1, "another task's top keys were deleted");

    // Re-created under the same name: none of the old task's keys.
    let (s, b) = m.put("/api/v1/tasks/kt", spec).await;
    assert_eq!(s, 201, "{b}");
    let (s, v) = get(&m, "/api/v1/tasks/kt/keys?minutes=10").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["keyed"], true);
    assert_eq!(v["top_admitted"], json!([]), "{v}");
    assert_eq!(v["top_rejected"], json!([]), "{v}");
}
