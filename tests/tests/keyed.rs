//! Keyed tasks end to end: real etcd, Redis, `sluice-manager` and loadgen processes.
//!
//! * accuracy: 2 hosts × 2 processes share a per-key limit of 50 per 1 s slice over uniform
//!   keys with demand ≈ 3× per key: no key ever admits more than its limit in a slice (merged
//!   over both hosts), an override key gets its own limit, and limited slices are ≥ 90 % used;
//! * skewed keys (Zipf 1.1 over 10,000 keys, as fast as the loadgen runs): Redis calls per
//!   admitted decision ≤ 0.1, hot keys decided from shared memory, no over-admission; and the
//!   same at a low rate, where most keys stay cold (reported, not bounded: a cold key costs
//!   about one call per decision by design);
//! * a key table far too small for the keys: nothing over-admits (the overflow is decided by
//!   one all-or-nothing call each);
//! * the protocol: a pull under an older meta version never creates a key slice; overrides
//!   follow the task's threshold in proportion; keys longer than 256 bytes are refused; a key
//!   of a task that is not keyed decides on the task.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use sluice_tests::*;

const SLICE_MS: i64 = 1_000;

/// Merges the `keys` of several loadgen reports: key → slice → (admitted, rejected).
fn merged_keys(reports: &[Value]) -> BTreeMap<String, BTreeMap<i64, (u64, u64)>> {
    let mut out: BTreeMap<String, BTreeMap<i64, (u64, u64)>> = BTreeMap::new();
    for r in reports {
        for (k, b) in loadgen_key_buckets(r) {
            let e = out.entry(k).or_default();
            for (s, (a, rj)) in b {
                let x = e.entry(s).or_default();
                x.0 += a;
                x.1 += rj;
            }
        }
    }
    out
}

/// Key-slices admitting more than `limit(key)`.
fn over_admitted(
    keys: &BTreeMap<String, BTreeMap<i64, (u64, u64)>>,
    limit: impl Fn(&str) -> u64,
) -> Vec<String> {
    let mut bad = Vec::new();
    for (k, b) in keys {
        for (s, (a, _)) in b {
            if *a > limit(k) {
                bad.push(format!("{k} slice {s}: {a} > {}", limit(k)));
            }
        }
    }
    bad
}

async fn keyed_task(m: &Manager, task: &str, body: &str) {
    let (status, resp) = m.put(&format!("/api/v1/tasks/{task}"), body).await;
    assert!(status == 200 || status == 201, "{status} {resp}");
    m.wait_rolled(task).await;
}

fn sum_calls(reports: &[Value]) -> (u64, u64, u64) {
    reports.iter().fold((0, 0, 0), |acc, r| {
        (
            acc.0 + r["admitted"].as_u64().unwrap_or(0),
            acc.1 + r["rejected"].as_u64().unwrap_or(0),
            acc.2 + r["redis_calls"].as_u64().unwrap_or(0),
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_limits_hold_per_key_across_two_hosts() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyacc");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "tenants",
        r#"{"threshold":50,"slice_ms":1000,"keyed":true,"key_overrides":{"key-1":100}}"#,
    )
    .await;
    // 200 keys (the debug-built loadgen's pace on a 2-core machine; the 1,000-key run of
    // docs/benchmarks.md uses the release build): demand 150 per key per second ≈ 3× the limit.
    let keys = 200u64;
    let per_proc_rate = (150 * keys / 4).to_string();
    let hosts: Vec<String> = (0..2).map(|i| format!("{ns}-h{i}")).collect();
    let _guard = SegmentGuard(hosts.iter().map(|h| (ns.clone(), h.clone())).collect());
    let mut runs: Vec<Loadgen> = hosts
        .iter()
        .map(|h| {
            Loadgen::spawn(&loadgen_args(
                &redis,
                &ns,
                "tenants",
                h,
                2,
                10_000,
                &[
                    "--keys",
                    &keys.to_string(),
                    "--key-report",
                    &keys.to_string(),
                    "--rate",
                    &per_proc_rate,
                    "--workers",
                    "32",
                ],
            ))
        })
        .collect();
    let mut reports = Vec::new();
    for r in &mut runs {
        reports.push(r.wait_json(Duration::from_secs(90)).await);
    }
    let merged = merged_keys(&reports);
    assert_eq!(merged.len() as u64, keys, "every key reported");
    let limit = |k: &str| if k == "key-1" { 100 } else { 50 };
    let bad = over_admitted(&merged, limit);
    assert!(bad.is_empty(), "over-admission: {bad:?}");

    // Utilisation of the slices where a key's demand exceeded its limit (it had rejections),
    // whole slices only (not the first and last of the run).
    let all: Vec<i64> = merged.values().flat_map(|b| b.keys().copied()).collect();
    let (first, last) = (*all.iter().min().unwrap(), *all.iter().max().unwrap());
    let mut used = Vec::new();
    for (k, b) in &merged {
        for (s, (a, rj)) in b {
            if *s > first && *s < last && *rj > 0 {
                used.push(*a as f64 / limit(k) as f64);
            }
        }
    }
    used.sort_by(|a, b| a.total_cmp(b));
    let (admitted, rejected, calls) = sum_calls(&reports);
    let inner_slices = ((last - first) / SLICE_MS - 1).max(1) as usize;
    eprintln!(
        "keyed accuracy: {} limited key-slices of {}, utilisation min {:.3} median {:.3}; \
         admitted {admitted} rejected {rejected} calls {calls} ({:.3} per admitted)",
        used.len(),
        inner_slices * keys as usize,
        used.first().copied().unwrap_or(0.0),
        used.get(used.len() / 2).copied().unwrap_or(0.0),
        calls as f64 / admitted.max(1) as f64
    );
    assert!(
        used.len() >= inner_slices * keys as usize / 2,
        "demand did not exceed the limit in at least half of the key-slices: {} of {}",
        used.len(),
        inner_slices * keys as usize
    );
    let mean = used.iter().sum::<f64>() / used.len() as f64;
    assert!(
        mean >= 0.9,
        "utilisation of limited key-slices {mean:.3} < 0.9"
    );
    // The override key had its own limit (more than 50 in some slice).
    let k1 = &merged["key-1"];
    assert!(
        k1.values().any(|(a, _)| *a > 50),
        "key-1's override of 100 unused: {k1:?}"
    );

    // The key quota hashes in Redis carry the caps (50, and 100 for the override), and no
    // key in clear (issue 23 item 2: keys are fields named by their digest).
    let mut conn = redis_conn(&redis);
    let found: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{ns}:{{tenants}}:k:*"))
        .query(&mut conn)
        .unwrap();
    assert!(!found.is_empty(), "no key quota hash");
    let field = sluice_protocol::key_field(&sluice_protocol::key_digest("key-1"));
    let mut caps = Vec::new();
    for h in &found {
        let all: Vec<(String, String)> = redis::cmd("HGETALL").arg(h).query(&mut conn).unwrap();
        for (f, v) in &all {
            assert!(
                !f.contains("key-") && !v.contains("key-"),
                "a key in clear in {h}: {f} = {v}"
            );
            if *f == field {
                caps.push(sluice_protocol::parse_key_quota(v));
            }
        }
        let cap: u64 = redis::cmd("HGET")
            .arg(h)
            .arg("cap")
            .query(&mut conn)
            .unwrap();
        assert_eq!(cap, 50, "{h}");
    }
    assert!(
        !caps.is_empty() && caps.iter().all(|c| matches!(c, Some((_, Some(100))))),
        "key-1's field in the key quota hashes: {caps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_keys_are_decided_from_shared_memory_with_few_redis_calls() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyskew");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "skew",
        r#"{"threshold":500,"slice_ms":1000,"keyed":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);

    // As fast as the loadgen runs.
    let mut run = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "skew",
        &host,
        2,
        6_000,
        &[
            "--keys",
            "10000",
            "--key-skew",
            "1.1",
            "--key-report",
            "100",
        ],
    ));
    let r = run.wait_json(Duration::from_secs(90)).await;
    let reports = [r];
    let merged = merged_keys(&reports);
    let bad = over_admitted(&merged, |_| 500);
    assert!(bad.is_empty(), "over-admission: {bad:?}");
    let (admitted, rejected, calls) = sum_calls(&reports);
    let per = calls as f64 / admitted.max(1) as f64;
    let lat = &reports[0]["key_latency_us"];
    eprintln!(
        "skewed keys, unpaced: admitted {admitted} rejected {rejected} calls {calls}: \
         {per:.4} calls per admitted decision; latency {lat}"
    );
    assert!(
        per <= 0.1,
        "{per:.4} Redis calls per admitted decision > 0.1"
    );
    // The hottest key hit its limit and was decided locally: rejections far beyond what one
    // Redis call per decision could have answered, and most decisions needed no Redis call.
    let hot = &merged["key-0"];
    assert!(
        hot.values().any(|(a, rj)| *a == 500 && *rj > 0),
        "key-0 never reached its limit: {hot:?}"
    );
    let (hot_n, cold_n) = (
        lat["hot_n"].as_u64().unwrap(),
        lat["cold_n"].as_u64().unwrap(),
    );
    assert!(
        hot_n > cold_n,
        "most decisions should come from shared memory: {lat}"
    );

    // Paced low enough that most keys stay below their limit: reported honestly.
    let host2 = format!("{ns}-h2");
    let _guard2 = SegmentGuard(vec![(ns.clone(), host2.clone())]);
    let mut run = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "skew",
        &host2,
        2,
        6_000,
        &[
            "--keys",
            "10000",
            "--key-skew",
            "1.1",
            "--key-report",
            "100",
            "--rate",
            "1000",
        ],
    ));
    let r = run.wait_json(Duration::from_secs(90)).await;
    let reports = [r];
    let merged = merged_keys(&reports);
    let bad = over_admitted(&merged, |_| 500);
    assert!(bad.is_empty(), "over-admission: {bad:?}");
    let (admitted, rejected, calls) = sum_calls(&reports);
    eprintln!(
        "skewed keys, 2 × 1,000/s: admitted {admitted} rejected {rejected} calls {calls}: \
         {:.4} calls per admitted decision (cold keys cost about one pull each, batched up to 64 keys per call); latency {}",
        calls as f64 / admitted.max(1) as f64,
        reports[0]["key_latency_us"]
    );
    // Rejections here would be a key limited below its limit: say which kind (a fallback
    // after a timed-out pull shows as fallback_admitted and a FAILED task; a pending pull at
    // the acquire deadline as cold latency near 1 s).
    assert_eq!(
        rejected,
        0,
        "nothing reaches its limit at this rate; fallback_admitted {}, key latency {}, \
         buckets with rejections {:?}",
        reports[0]["fallback_admitted"],
        reports[0]["key_latency_us"],
        reports[0]["buckets"].as_object().map(|b| b
            .iter()
            .filter(|(_, v)| v[1].as_u64().unwrap_or(0) > 0)
            .collect::<Vec<_>>())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_key_table_never_over_admits() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyfull");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "full",
        r#"{"threshold":20,"slice_ms":1000,"keyed":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    // 16 entries for 300 keys: most keys find their bucket full and are decided by one
    // all-or-nothing call each.
    let mut run = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "full",
        &host,
        2,
        4_000,
        &[
            "--keys",
            "300",
            "--key-report",
            "300",
            "--key-slots",
            "16",
            "--rate",
            "6000",
        ],
    ));
    let r = run.wait_json(Duration::from_secs(60)).await;
    let table = sluice::shm::Segment::path_for(std::path::Path::new("/dev/shm"), &ns, &host);
    let mut p = table.into_os_string();
    p.push(".keys");
    let size = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
    assert_eq!(
        size,
        sluice::keyed::KeyTable::size(16),
        "the table did not grow"
    );
    let reports = [r];
    let merged = merged_keys(&reports);
    let bad = over_admitted(&merged, |_| 20);
    assert!(bad.is_empty(), "over-admission with a full table: {bad:?}");
    let (admitted, rejected, calls) = sum_calls(&reports);
    eprintln!("full table: admitted {admitted} rejected {rejected} calls {calls}");
    assert!(
        rejected > 0,
        "demand (10 per key per second × 2) never hit the limit of 20?"
    );
    assert!(admitted > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_slices_come_from_the_current_meta_only() {
    use sluice_protocol::scripts::{KeyPullReply, KeyPullRequest, key_pull};
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyproto");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "p",
        r#"{"threshold":40,"slice_ms":1000,"keyed":true,"key_overrides":{"vip":400}}"#,
    )
    .await;
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let client = redis::Client::open(redis.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let meta: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.meta("p"))
        .query_async(&mut c)
        .await
        .unwrap();
    let version: i64 = meta["version"].parse().unwrap();
    // The current slice or the next (within a pull's window), with time for the calls below.
    let start = sluice_protocol::slice::start(now_ms() + 600, 1_000);
    let pull = |key: &'static str, version: i64, want: u64, id: &'static str| {
        let digest = sluice_protocol::key_digest(key);
        (digest, version, want, id)
    };
    // An older meta version: refused, nothing created.
    let (d, v, want, id) = pull("a", version - 1, 5, "r1");
    let req = KeyPullRequest {
        task: "p",
        digest: &d,
        start_ms: start,
        slice_ms: 1_000,
        want,
        host_id: "t",
        request_id: id,
        meta_version: v,
        all_or_nothing: false,
    };
    let r = key_pull(&mut c, &keys, &req).await.unwrap();
    assert!(
        matches!(r, KeyPullReply::StaleMeta { stored_version, .. } if stored_version == version),
        "{r:?}"
    );
    let exists: bool = redis::cmd("EXISTS")
        .arg(keys.key_slices("p", start))
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(!exists, "a stale pull created the key quota hash");
    // The current version: created with the task slice's cap, the grant taken from it.
    let req = KeyPullRequest {
        meta_version: version,
        request_id: "r2",
        ..req
    };
    let r = key_pull(&mut c, &keys, &req).await.unwrap();
    assert!(
        matches!(
            r,
            KeyPullReply::Granted {
                granted: 5,
                remaining: 35,
                cap: 40,
                ..
            }
        ),
        "{r:?}"
    );
    // A retry with the same request id is answered with the same grant, nothing taken.
    let r = key_pull(&mut c, &keys, &req).await.unwrap();
    assert!(
        matches!(
            r,
            KeyPullReply::Granted {
                granted: 5,
                replayed: true,
                ..
            }
        ),
        "{r:?}"
    );
    // All or nothing: 36 > 35 left → 0.
    let req = KeyPullRequest {
        want: 36,
        all_or_nothing: true,
        request_id: "r3",
        ..req
    };
    let r = key_pull(&mut c, &keys, &req).await.unwrap();
    assert!(
        matches!(
            r,
            KeyPullReply::Granted {
                granted: 0,
                remaining: 35,
                ..
            }
        ),
        "{r:?}"
    );
    // An override follows the threshold in proportion: a schedule doubling the threshold
    // doubles the override's cap too (400 → 800), from the next slice on.
    let (status, body) = m
        .put(
            "/api/v1/tasks/p",
            r#"{"threshold":40,"slice_ms":1000,"keyed":true,"key_overrides":{"vip":400},
                "schedules":[{"cron":"* * * * * *","threshold":80}]}"#,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let mut sync = redis_conn(&redis);
    let later = wait_until(
        "the schedule's cap written",
        Duration::from_secs(15),
        Duration::from_millis(20),
        || {
            let later = sluice_protocol::slice::start(now_ms() + 600, 1_000);
            let cap: Option<u64> = redis::cmd("HGET")
                .arg(keys.slice("p", later))
                .arg("cap")
                .query(&mut sync)
                .unwrap();
            // A slice whose key quotas are not made yet: a spec change reaches keys from the
            // next slice (the slice `start` was made under the old cap).
            async move { (cap == Some(80) && later > start).then_some(later) }
        },
    )
    .await;
    let version2: i64 = redis::cmd("HGET")
        .arg(keys.meta("p"))
        .arg("version")
        .query(&mut sync)
        .unwrap();
    let dv = sluice_protocol::key_digest("vip");
    let req = KeyPullRequest {
        digest: &dv,
        start_ms: later,
        want: 1,
        meta_version: version2,
        request_id: "r4",
        all_or_nothing: false,
        ..req
    };
    let r = key_pull(&mut c, &keys, &req).await.unwrap();
    assert!(
        matches!(
            r,
            KeyPullReply::Granted {
                granted: 1,
                cap: 800,
                ..
            }
        ),
        "{r:?}"
    );
    // Removing the override removes its meta field (overrides are replaced as a whole).
    let (status, body) = m
        .put(
            "/api/v1/tasks/p",
            r#"{"threshold":40,"slice_ms":1000,"keyed":true}"#,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let field = format!("ko:{dv}");
    wait_until(
        "the override's field gone",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let has: bool = redis::cmd("HEXISTS")
                .arg(keys.meta("p"))
                .arg(&field)
                .query(&mut sync)
                .unwrap();
            async move { (!has).then_some(()) }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_keys_decide_per_key_and_refuse_bad_input() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keysdk");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    // A slice of 5 s so the counts below stay within one slice (retried if they straddle).
    keyed_task(&m, "k", r#"{"threshold":30,"slice_ms":5000,"keyed":true}"#).await;
    keyed_task(&m, "plain", r#"{"threshold":1000,"slice_ms":1000}"#).await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let task = client.task("k").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    // A key longer than 256 bytes is an error, not a decision.
    let long = "x".repeat(257);
    assert!(task.key(&long).is_err());
    assert!(
        task.key(&"é".repeat(128)).is_ok(),
        "256 bytes of UTF-8 are fine"
    );
    // Each key has its own 30: count admissions of two keys within one slice.
    let (a, b) = (task.key("alice").unwrap(), task.key("bob").unwrap());
    let slice_us = 5_000_000i64;
    let count = |k: &sluice::Key| {
        let k = k.clone();
        async move {
            loop {
                let start = task_now(&k) / slice_us;
                if task_now(&k) % slice_us > 3_500_000 {
                    tokio::time::sleep(Duration::from_millis(1_600)).await;
                    continue;
                }
                let mut n = 0;
                for _ in 0..100 {
                    if k.acquire(1).await.is_allowed() {
                        n += 1;
                    }
                }
                if task_now(&k) / slice_us == start {
                    return n;
                }
            }
        }
    };
    let (na, nb) = (count(&a).await, count(&b).await);
    assert_eq!((na, nb), (30, 30), "each key its own limit");
    // The key handle of a task that is not keyed decides on the task.
    let plain = client.task("plain").unwrap();
    assert!(plain.wait_ready(Duration::from_secs(10)));
    let pk = plain.key("whatever").unwrap();
    assert!(pk.acquire(1).await.is_allowed());
}

fn task_now(k: &sluice::Key) -> i64 {
    k.task().now_us()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_all_is_all_or_nothing_and_names_the_refusing_limit() {
    use sluice::{Limit, acquire_all};
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyall");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "tenant",
        r#"{"threshold":5,"slice_ms":5000,"keyed":true}"#,
    )
    .await;
    keyed_task(&m, "global", r#"{"threshold":8,"slice_ms":5000}"#).await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let (tenant, global) = (
        client.task("tenant").unwrap(),
        client.task("global").unwrap(),
    );
    assert!(
        tenant.wait_ready(Duration::from_secs(10)) && global.wait_ready(Duration::from_secs(10))
    );
    let (a, b) = (tenant.key("a").unwrap(), tenant.key("b").unwrap());
    let slice_us = 5_000_000i64;
    // Within one slice (retried from a fresh slice if the run straddles a boundary).
    loop {
        if global.now_us() % slice_us > 1_500_000 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let start = global.now_us() / slice_us;
        // Global first, then the tenant: the tenant refuses after 5, and each refusal gives
        // the global permit back.
        let mut admitted_a = 0;
        let mut refused_by = Vec::new();
        for _ in 0..10 {
            let d = acquire_all(&[Limit::Task(&global, 1), Limit::Key(&a, 1)]).await;
            if d.is_allowed() {
                admitted_a += 1;
            } else {
                refused_by.push(d.refused);
            }
        }
        // Tenant b is under its limit: the global limit (8 − 5 used) refuses after 3.
        let mut admitted_b = 0;
        let mut refused_b = Vec::new();
        for _ in 0..5 {
            let d = acquire_all(&[Limit::Task(&global, 1), Limit::Key(&b, 1)]).await;
            if d.is_allowed() {
                admitted_b += 1;
            } else {
                refused_b.push(d.refused);
            }
        }
        if global.now_us() / slice_us != start {
            continue;
        }
        assert_eq!(admitted_a, 5, "tenant a's limit");
        assert!(refused_by.iter().all(|r| *r == Some(1)), "{refused_by:?}");
        assert_eq!(
            admitted_b, 3,
            "the global permits of a's refused requests were given back"
        );
        assert!(refused_b.iter().all(|r| *r == Some(0)), "{refused_b:?}");
        break;
    }
}

/// CPU seconds (user + system) of process `pid` so far, from `/proc/<pid>/stat`.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command.
    (ticks(11) + ticks(12)) / 100.0
}

fn used_memory(conn: &mut redis::Connection) -> i64 {
    let info: String = redis::cmd("INFO").arg("memory").query(conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_keys_stay_bounded() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyscale");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "many",
        r#"{"threshold":3,"slice_ms":1000,"keyed":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut conn = redis_conn(&redis);
    let mem_before = used_memory(&mut conn);
    let cpu_before = cpu_secs(m.proc.pid());
    // 100,000 distinct keys in 30 s (uniform, 4,000 decisions a second: each key about 1.2
    // times), in the default key table of 16,384 entries: entries are reclaimed after two
    // idle slices, and a full bucket falls back to one call per decision.
    let mut run = Loadgen::spawn(&loadgen_args(
        &redis,
        &ns,
        "many",
        &host,
        1,
        30_000,
        &["--keys", "100000", "--key-report", "1000", "--rate", "4000"],
    ));
    // Sample Redis memory and the live key slices while it runs.
    let pattern = format!("{ns}:{{many}}:k:*");
    let mut peak_slices = 0u64;
    let mut peak_mem = 0i64;
    let started = std::time::Instant::now();
    while run.proc.is_running() && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut n = 0u64;
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(10_000)
                .query(&mut conn)
                .unwrap();
            n += batch.len() as u64;
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        let mem = used_memory(&mut conn) - mem_before;
        if n > peak_slices {
            peak_slices = n;
            peak_mem = mem;
        }
    }
    let r = run.wait_json(Duration::from_secs(60)).await;
    let cpu = cpu_secs(m.proc.pid()) - cpu_before;
    let table = sluice::shm::Segment::path_for(std::path::Path::new("/dev/shm"), &ns, &host);
    let seg_size = std::fs::metadata(&table).map(|m| m.len()).unwrap_or(0);
    let mut p = table.into_os_string();
    p.push(".keys");
    let table_size = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
    let reports = [r];
    let merged = merged_keys(&reports);
    let bad = over_admitted(&merged, |_| 3);
    let (admitted, rejected, calls) = sum_calls(&reports);
    eprintln!(
        "100,000 keys in 30 s: admitted {admitted} rejected {rejected} calls {calls}; \
         segment {seg_size} B + key table {table_size} B; peak {peak_slices} live key slices \
         using {peak_mem} B of Redis memory ({:.0} B each); manager CPU {cpu:.2} s",
        peak_mem as f64 / peak_slices.max(1) as f64
    );
    assert!(bad.is_empty(), "over-admission: {bad:?}");
    assert_eq!(
        table_size,
        sluice::keyed::KeyTable::size(sluice::DEFAULT_KEY_SLOTS),
        "the key table keeps its size"
    );
    assert!(admitted > 0);
    // Key slices expire 2 slices + 5 s after their start: at 4,000 decisions a second the
    // live set stays near 4,000 × 7 s, far below the 100,000 keys touched.
    assert!(
        peak_slices < 50_000,
        "{peak_slices} live key slices: they do not expire?"
    );
    // The manager's CPU is reported above, not bounded here (speed lives in benchmarks): the
    // leader does no work per key.
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_redis_is_down_each_key_gets_its_local_limit() {
    let etcd = shared_etcd();
    let mut redis = RedisServer::start();
    let url = redis.url();
    let ns = unique_ns("keyfail");
    let m = Manager::start(ManagerOpts::new(&etcd, &url, &ns, "m1")).await;
    keyed_task(
        &m,
        "kf",
        r#"{"threshold":100,"slice_ms":5000,"keyed":true,"local_limit":3,"on_failure":"local",
            "fallback":{"algorithm":"fixed_window"}}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&url, &ns, &host);
    cfg.pull_timeout = Duration::from_millis(300);
    cfg.probe_interval = Duration::from_millis(500);
    let client = sluice::Client::new(cfg).unwrap();
    let task = client.task("kf").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    assert!(task.key("warm").unwrap().acquire(1).await.is_allowed());
    redis.kill();
    wait_until(
        "the task FAILED",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || {
            // Decisions on fresh keys need pulls, which fail.
            let k = task.key(&format!("probe-{}", now_ms())).unwrap();
            let d = k.try_acquire(1);
            let failed = task.state() == sluice::HostState::Failed;
            async move { (failed && d.is_fallback()).then_some(()) }
        },
    )
    .await;
    // Within one slice: each fresh key admits its own local_limit (3), then is refused.
    let slice_us = 5_000_000i64;
    loop {
        if task.now_us() % slice_us > 3_000_000 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        let start = task.now_us() / slice_us;
        let mut counts = Vec::new();
        for name in ["c", "d"] {
            let k = task.key(name).unwrap();
            let mut n = 0;
            for _ in 0..10 {
                let d = k.try_acquire(1);
                assert!(d.is_fallback(), "{d:?}");
                if d.is_allowed() {
                    n += 1;
                }
            }
            counts.push(n);
        }
        if task.now_us() / slice_us == start {
            assert_eq!(counts, [3, 3], "local_limit per key while FAILED");
            break;
        }
    }
    // Redis back: the task recovers and keys are decided from the global quota again.
    redis.restart();
    wait_until(
        "keys decided globally again",
        Duration::from_secs(20),
        Duration::from_millis(50),
        || {
            let k = task.key("after").unwrap();
            async move { (k.acquire(1).await == sluice::Decision::Allowed).then_some(()) }
        },
    )
    .await;
}

/// Transitions of a keyed task while keys are in use: keyed off (the key handle decides on the
/// task as a whole), keyed on again, a changed slice length, delete and re-create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_tasks_survive_being_switched_edited_and_recreated() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyedit");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(&m, "e", r#"{"threshold":5,"slice_ms":5000,"keyed":true}"#).await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&redis, &ns, &host);
    cfg.meta_refresh = Duration::from_millis(200);
    let client = sluice::Client::new(cfg).unwrap();
    let task = client.task("e").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let key = task.key("a").unwrap();
    // Admissions of `key` out of `tries`, within one slice of `slice_us` (retried otherwise).
    async fn admitted(key: &sluice::Key, tries: u32, slice_us: i64) -> u32 {
        loop {
            let now = key.task().now_us();
            if now % slice_us > slice_us * 6 / 10 {
                tokio::time::sleep(Duration::from_micros(
                    (slice_us - now % slice_us) as u64 + 1_000,
                ))
                .await;
                continue;
            }
            let start = now / slice_us;
            let mut n = 0;
            for _ in 0..tries {
                if key.acquire(1).await.is_allowed() {
                    n += 1;
                }
            }
            if key.task().now_us() / slice_us == start {
                return n;
            }
        }
    }
    async fn wait_meta(
        task: &sluice::Task,
        what: &str,
        ok: impl Fn(&sluice_protocol::TaskMeta) -> bool,
    ) {
        wait_until(
            what,
            Duration::from_secs(10),
            Duration::from_millis(20),
            || {
                let hit = task.meta().is_some_and(|m| ok(&m));
                async move { hit.then_some(()) }
            },
        )
        .await;
    }
    assert_eq!(admitted(&key, 8, 5_000_000).await, 5, "keyed: the key's 5");

    // Keyed off: the same handle decides on the task as a whole (its threshold of 20).
    let (st, body) = m
        .put("/api/v1/tasks/e", r#"{"threshold":20,"slice_ms":5000}"#)
        .await;
    assert_eq!(st, 200, "{body}");
    wait_meta(&task, "keyed off", |m| !m.keyed && m.threshold == 20).await;
    assert_eq!(
        admitted(&key, 30, 5_000_000).await,
        20,
        "the task's limit decides"
    );

    // Keyed on again, with a slice length change (5 s → 2 s): per key again, on the new grid.
    let (st, body) = m
        .put(
            "/api/v1/tasks/e",
            r#"{"threshold":4,"slice_ms":2000,"keyed":true}"#,
        )
        .await;
    assert_eq!(st, 200, "{body}");
    wait_meta(&task, "keyed on, 2 s", |m| m.keyed && m.slice_ms == 2000).await;
    // The first 2 s slice on the new grid may still carry the old cap: wait for a fresh one.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    assert_eq!(
        admitted(&key, 8, 2_000_000).await,
        4,
        "per key on the new grid"
    );
    let other = task.key("b").unwrap();
    assert_eq!(
        admitted(&other, 8, 2_000_000).await,
        4,
        "another key, its own 4"
    );

    // Deleted and re-created with another threshold: the key follows the new spec.
    assert_eq!(m.delete("/api/v1/tasks/e").await, 204);
    keyed_task(&m, "e", r#"{"threshold":7,"slice_ms":2000,"keyed":true}"#).await;
    wait_meta(&task, "re-created", |m| m.keyed && m.threshold == 7).await;
    tokio::time::sleep(Duration::from_millis(4_200)).await;
    assert_eq!(
        admitted(&key, 10, 2_000_000).await,
        7,
        "the re-created task's limit"
    );
}

/// Issue 26: a keyed task's key quotas of a slice are ONE hash (`NS:{T}:k:<start>`), which
/// the leader `UNLINK`s when it harvests the slice (off Redis's main thread: the expiry of a
/// hash of a million keys would stall Redis for hundreds of ms), well before its own expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_unlinks_a_slices_key_quotas_when_it_harvests_it() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyunlink");
    let mut opts = ManagerOpts::new(&etcd, &redis, &ns, "m1");
    // settle = retention / 4 = 2 s.
    opts.extra = vec!["--retention".into(), "8s".into()];
    let m = Manager::start(opts).await;
    keyed_task(&m, "u", r#"{"threshold":10,"slice_ms":5000,"keyed":true}"#).await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let task = client.task("u").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);
    let key = task.key("tenant-1").unwrap();
    let (d, at_us) = key.acquire_stamped(1).await;
    assert!(d.is_allowed(), "{d:?}");
    let start = sluice_protocol::slice::start(at_us.div_euclid(1_000), 5_000);
    let hash = keys.key_slices("u", start);
    let expires_at: i64 = redis::cmd("PEXPIRETIME")
        .arg(&hash)
        .query(&mut conn)
        .unwrap();
    assert_eq!(expires_at, start + 2 * 5_000 + 5_000, "the hash's expiry");
    let field = sluice_protocol::key_field(&sluice_protocol::key_digest("tenant-1"));
    let v: Option<String> = redis::cmd("HGET")
        .arg(&hash)
        .arg(&field)
        .query(&mut conn)
        .unwrap();
    // 10 less the first pull (1) and maybe a prefetch; the cap is the hash's (no override).
    assert!(
        matches!(
            v.as_deref().and_then(sluice_protocol::parse_key_quota),
            Some((0..=9, None))
        ),
        "the key's field: {v:?}"
    );
    // Harvested `settle` (2 s) after the slice's end; it would expire 10 s after its end.
    let gone_at = wait_until(
        "the key quota hash unlinked",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || {
            let exists: bool = redis::cmd("EXISTS").arg(&hash).query(&mut conn).unwrap();
            async move { (!exists).then(now_ms) }
        },
    )
    .await;
    // Never while KPULL still serves the slice (its window ends 250 ms after the slice, by
    // Redis's clock; the leader keeps a second more).
    assert!(
        gone_at >= start + 5_000 + 1_250,
        "unlinked at {gone_at}, before the slice's window closed ({})",
        start + 5_000 + 250
    );
    assert!(
        gone_at < expires_at - 3_000,
        "gone at {gone_at}, only {} ms before its expiry at {expires_at}: not unlinked",
        expires_at - gone_at
    );
}

/// Caller pulls: decides cold keys `prefix0`, `prefix1`, … (each must be admitted) until one
/// is pulled from the caller's own connection, at most 5; whether one was. (The background
/// thread's pump may take a caller's want first, rarely.)
async fn by_caller(client: &sluice::Client, task: &sluice::Task, prefix: &str) -> bool {
    for i in 0..5 {
        let sent = client.caller_pulls_sent();
        let d = task.key(&format!("{prefix}{i}")).unwrap().acquire(1).await;
        assert_eq!(d, sluice::Decision::Allowed, "{prefix}{i}");
        if client.caller_pulls_sent() > sent {
            return true;
        }
    }
    false
}

/// Issue 26, caller pulls (`Config::caller_pulls`): an `acquire` dropped while its pull is in
/// flight from the caller's task (Redis paused, so the KPULL waits) leaves no key pull lock
/// behind: the next `acquire` of the key is admitted at once, not after the lock timeout
/// (3 s, longer than the 1 s acquire timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_acquire_leaves_no_key_lock_behind() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keycancel");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "k",
        r#"{"threshold":1000,"slice_ms":5000,"keyed":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&redis, &ns, &host);
    cfg.caller_pulls = true;
    let client = sluice::Client::new(cfg).unwrap();
    let task = client.task("k").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    // The caller's connection is made (and the script loaded) by a first decision, whose pull
    // goes from the caller's runtime.
    assert!(
        by_caller(&client, &task, "warm").await,
        "no pull was the caller's"
    );
    let mut admin = redis_conn(&redis);
    for round in 0..3 {
        let key = task.key(&format!("x{round}")).unwrap();
        pause_writes(&mut admin, 400);
        let cancelled = tokio::time::timeout(Duration::from_millis(60), key.acquire(1)).await;
        assert!(
            cancelled.is_err(),
            "round {round}: decided while Redis was paused"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t0 = std::time::Instant::now();
        let d = key.acquire(1).await;
        assert_eq!(
            d,
            sluice::Decision::Allowed,
            "round {round}: after {:?}",
            t0.elapsed()
        );
    }
}

/// A `Client` dropped while its background thread has a key pull in flight finishes that pull
/// before it goes: the grant lands in the host's key table, where the next process of the host
/// finds it. Dropped with the runtime instead (the last flush's answer came first), the permits
/// were taken in Redis and lost: with a limit of 1 the key was refused for the rest of the
/// slice (the keyed model's liveness flake in CI, seed 2542367129096667870: a client restarted
/// right after a decision whose prefetch was in flight). Each round drops a client right after
/// a decision started a pull, and the next client of the host must be admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_dropped_with_a_key_pull_in_flight_strands_nothing() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keydrop");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    const SLICE_US: i64 = 10_000_000;
    keyed_task(&m, "d", r#"{"threshold":1,"slice_ms":10000,"keyed":true}"#).await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let open = || {
        let client = sluice::Client::new(sdk_config(&redis, &ns, &host)).unwrap();
        let task = client.task("d").unwrap();
        assert!(task.wait_ready(Duration::from_secs(10)));
        (client, task)
    };
    let (mut checked, mut lost) = (0, Vec::new());
    // Without the fix about one round in 20 lost its permit (measured: 14 and 17 of 300), so
    // 200 rounds (well under a second) miss it with a chance of about 1 in 30,000.
    for round in 0..200u64 {
        let name = format!("k{round}");
        let (client, task) = open();
        let before = task.now_us().div_euclid(SLICE_US);
        let first = task.key(&name).unwrap().try_acquire(1);
        assert_eq!(
            first,
            sluice::Decision::Limited {
                retry_after: Duration::from_millis(1)
            },
            "round {round}: nothing in hand yet, a pull on its way"
        );
        // Dropped at once or up to 1.8 ms later: the pull is queued, sent or being answered.
        let delay = round % 7;
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_micros(delay * 300));
            drop((task, client))
        })
        .await
        .unwrap();
        let (_c2, task2) = open();
        let d = task2.key(&name).unwrap().acquire(1).await;
        // A round that straddles a slice boundary proves nothing.
        if task2.now_us().div_euclid(SLICE_US) != before {
            continue;
        }
        checked += 1;
        if d != sluice::Decision::Allowed {
            lost.push((round, d));
        }
    }
    assert!(checked >= 100, "only {checked} rounds within one slice");
    assert!(
        lost.is_empty(),
        "the permit pulled for a dropped client was lost in {} of {checked} rounds: {lost:?}",
        lost.len()
    );
}

/// Issue 26, caller pulls (`Config::caller_pulls`): a burst of cold keys decided at once from
/// many tasks of the caller's runtime — every want is pulled exactly once between the callers
/// (one sends the wants of the others that came in while it yielded, or joins a pull in
/// flight), none is lost or left waiting: each key's first `acquire` is admitted, its limit
/// holds (the 4th of a limit of 3 is refused), and the calls sent from the callers' runtime
/// are at most one per admitted permit (a limit of 3 pulls one at a time: `cap / 16` < 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_cold_keys_through_caller_pulls_is_decided_whole() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("keyburst");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    const SLICE_US: i64 = 10_000_000;
    keyed_task(&m, "b", r#"{"threshold":3,"slice_ms":10000,"keyed":true}"#).await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let mut cfg = sdk_config(&redis, &ns, &host);
    cfg.caller_pulls = true;
    // It asserts what is admitted, not how fast: a loaded machine's stall must not refuse.
    cfg.acquire_timeout = Duration::from_secs(10);
    cfg.pull_timeout = Duration::from_secs(3);
    let client = sluice::Client::new(cfg).unwrap();
    let task = client.task("b").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    assert!(task.key("warm").unwrap().acquire(1).await.is_allowed());
    const KEYS: usize = 200;
    // A round that straddles a slice boundary is run again with new keys.
    for round in 0..3 {
        let before = task.now_us().div_euclid(SLICE_US);
        let sent0 = client.caller_pulls_sent();
        let burst: Vec<_> = (0..KEYS)
            .map(|i| {
                let key = task.key(&format!("r{round}-k{i}")).unwrap();
                tokio::spawn(async move {
                    let first = key.acquire(1).await;
                    let mut rest = Vec::new();
                    for _ in 0..3 {
                        rest.push(key.acquire(1).await);
                    }
                    (first, rest)
                })
            })
            .collect();
        let mut results = Vec::with_capacity(KEYS);
        for h in burst {
            results.push(h.await.unwrap());
        }
        let sent = client.caller_pulls_sent() - sent0;
        if task.now_us().div_euclid(SLICE_US) != before {
            continue;
        }
        for (i, (first, rest)) in results.iter().enumerate() {
            assert_eq!(
                *first,
                sluice::Decision::Allowed,
                "round {round}: key {i}'s first decision"
            );
            let admitted = rest
                .iter()
                .filter(|d| **d == sluice::Decision::Allowed)
                .count();
            assert_eq!(
                admitted, 2,
                "round {round}: key {i} admitted {} of 3 after its first (limit 3): {rest:?}",
                admitted
            );
        }
        assert!(
            (1..=KEYS as u64 * 3).contains(&sent),
            "round {round}: {sent} calls from the callers' runtime for {KEYS} keys"
        );
        eprintln!("{KEYS} cold keys at once: {sent} KPULL calls from the callers' runtime");
        return;
    }
    panic!("every round straddled a slice boundary");
}

/// Issue 26, caller pulls (`Config::caller_pulls`): a caller's KPULL that goes unanswered for
/// the whole half pull timeout (Redis paused) is the connection's fault — the call is finished
/// by the background thread, the thread drops its connection, and its next cold keys go
/// through the background thread until the 1 s backoff ends (then a new connection). A call
/// that only the decision's own deadline cut short is not: the connection stays. (One
/// worker thread, and the test's body on its own: no task moves between threads here. The
/// background thread's pump may take a caller's want first, rarely: a step that needs the
/// caller's own call tries again with another key.)
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_caller_connection_is_dropped_for_its_own_fault_only() {
    // A Redis of its own: the pauses here (up to 1.5 s) would stall the other tests of this
    // file on the shared one.
    let private = RedisServer::start();
    let (etcd, redis) = (shared_etcd(), private.url());
    let ns = unique_ns("keyforget");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "f",
        r#"{"threshold":1000,"slice_ms":5000,"keyed":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let open = |pull_timeout: Duration, acquire_timeout: Duration| {
        let mut cfg = sdk_config(&redis, &ns, &host);
        cfg.caller_pulls = true;
        cfg.pull_timeout = pull_timeout;
        cfg.acquire_timeout = acquire_timeout;
        let client = sluice::Client::new(cfg).unwrap();
        let task = client.task("f").unwrap();
        assert!(task.wait_ready(Duration::from_secs(10)));
        (client, task)
    };
    let mut admin = redis_conn(&redis);
    // The fault: unanswered for the whole 200 ms (half the pull timeout).
    let (client, task) = open(Duration::from_millis(400), Duration::from_secs(5));
    assert!(by_caller(&client, &task, "warm").await);
    let mut faulted = false;
    for round in 0..3 {
        let sent = client.caller_pulls_sent();
        pause_writes(&mut admin, 500);
        let d = task.key(&format!("a{round}")).unwrap().acquire(1).await;
        assert_eq!(
            d,
            sluice::Decision::Allowed,
            "finished by the background thread"
        );
        if client.caller_pulls_sent() > sent {
            faulted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }
    assert!(faulted, "no round's pull went from the caller's connection");
    let sent = client.caller_pulls_sent();
    for i in 0..3 {
        let d = task.key(&format!("b{i}")).unwrap().acquire(1).await;
        assert_eq!(d, sluice::Decision::Allowed);
    }
    assert_eq!(
        client.caller_pulls_sent(),
        sent,
        "within the backoff a cold key went from the caller's dropped connection"
    );
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert!(
        by_caller(&client, &task, "c").await,
        "no caller connection again after the backoff"
    );
    drop((task, client));
    // Not a fault: the decision's own deadline (1 s) cut the call short (half the pull timeout
    // is 2 s).
    let (client, task) = open(Duration::from_secs(4), Duration::from_secs(1));
    assert!(by_caller(&client, &task, "warm2-").await);
    let mut cut = false;
    for round in 0..3 {
        let sent = client.caller_pulls_sent();
        pause_writes(&mut admin, 1_500);
        let d = task.key(&format!("d{round}")).unwrap().acquire(1).await;
        assert!(!d.is_allowed(), "decided while Redis was paused: {d:?}");
        tokio::time::sleep(Duration::from_millis(1_600)).await;
        if client.caller_pulls_sent() > sent {
            cut = true;
            break;
        }
    }
    assert!(cut, "no round's pull went from the caller's connection");
    assert!(
        by_caller(&client, &task, "e").await,
        "the connection was dropped for a call its deadline cut short"
    );
}

/// A pull tells the process what it left of the key's slice in Redis (`Key::pulled_rem`, what
/// the agent's `limit_remaining` uses instead of reading the field again): the key's `rem` in
/// the slice's hash, for the slice decided in; `None` for a key this process never pulled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_pull_tells_what_it_left_in_redis() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("pulledrem");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    keyed_task(
        &m,
        "r",
        r#"{"threshold":100,"slice_ms":10000,"keyed":true}"#,
    )
    .await;
    let host = format!("{ns}-h");
    let _guard = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let client = sluice::Client::new(sdk_config(&redis, &ns, &host)).unwrap();
    let task = client.task("r").unwrap();
    assert!(task.wait_ready(Duration::from_secs(10)));
    let keys = sluice_protocol::Keys::new(&ns).unwrap();
    let mut conn = redis_conn(&redis);
    let field = sluice_protocol::key_field(&sluice_protocol::key_digest("carol"));
    let never = task.key("dave").unwrap();
    assert!(never.pulled_rem().is_none(), "never pulled");
    let key = task.key("carol").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no slice with room to look at"
        );
        // Not in the slice's last 3 s: the reads below stay in the slice decided in.
        if task.now_us().div_euclid(1_000) % 10_000 > 7_000 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let (d, at_us) = key.acquire_stamped(1).await;
        assert!(d.is_allowed(), "{d:?}");
        let start = sluice_protocol::slice::start(at_us.div_euclid(1_000), 10_000);
        let hash = keys.key_slices("r", start);
        // A prefetch may follow the decision's pull: compare once the two agree (5 s at most).
        let until = std::time::Instant::now() + Duration::from_secs(5);
        let mut agreed = false;
        while !agreed && std::time::Instant::now() < until {
            let v: Option<String> = redis::cmd("HGET")
                .arg(&hash)
                .arg(&field)
                .query(&mut conn)
                .unwrap();
            let in_redis = v.as_deref().and_then(sluice_protocol::parse_key_quota);
            agreed = key.pulled_rem().is_some_and(|(s, rem, at)| {
                s == start && at.elapsed() < Duration::from_secs(5) && in_redis == Some((rem, None))
            });
            if !agreed {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if task.now_us().div_euclid(1_000) / 10_000 != start / 10_000 {
            continue; // the slice ended meanwhile: again in the next one
        }
        assert!(
            agreed,
            "pulled_rem {:?} never matched Redis",
            key.pulled_rem()
        );
        let (_, rem, _) = key.pulled_rem().unwrap();
        assert!((0..100).contains(&rem), "rem {rem}");
        break;
    }
    assert!(
        never.pulled_rem().is_none(),
        "another key's pull is not this one's"
    );
}
