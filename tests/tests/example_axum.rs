//! The axum example service (`examples/axum-service`, binary `sluice-example-axum`) as a
//! newcomer runs it: the built binary next to a real manager, etcd and Redis.
//!
//! * Each client (`x-api-key`, or the client IP without one) is admitted at most its limit per
//!   slice (the task's threshold, or its `key_overrides` entry), however many it sends.
//! * A refusal is `429` with `Retry-After` (whole seconds, within the slice), the RateLimit
//!   fields and the example's JSON body; admitted answers carry the fields too.
//! * One client running out leaves the others untouched; `POST /api/export` costs
//!   `--export-cost` permits of the same limit; `/healthz` is not limited.
//! * The manager's per-key counts (`GET /api/v1/tasks/api/keys`) are exactly the permits the
//!   example admitted and refused.
//! * SIGTERM stops it with exit code 0; bad flags exit with an error naming the flag (and no
//!   password from `--redis`).
//!
//! Needs `cargo build -p sluice-example-axum` (scripts/test.sh builds every binary first).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::*;

/// Slice length of the test task: long enough for one round of requests from a debug build.
const SLICE_MS: i64 = 4_000;
/// The task's per-key threshold, and the override of `key:gold`.
const LIMIT: u64 = 10;
const GOLD_LIMIT: u64 = 20;
/// `--export-cost` given to the example.
const EXPORT_COST: u64 = 5;

/// The namespace's key-label secret, as the managers keep it in etcd.
async fn key_secret(etcd: &str, ns: &str) -> sluice_protocol::KeySecret {
    let mut c = etcd_client::Client::connect([etcd], None).await.unwrap();
    let r = c.get(format!("/{ns}/key_secret"), None).await.unwrap();
    let kv = r.kvs().first().expect("the leader created the key secret");
    sluice_protocol::KeySecret::parse(std::str::from_utf8(kv.value()).unwrap()).unwrap()
}

fn example_bin() -> PathBuf {
    workspace_bin("sluice-example-axum")
}

/// One answer, with when it was sent and received (Unix ms, the clock slices follow).
#[derive(Debug)]
struct Answer {
    client: &'static str,
    cost: u64,
    sent_ms: i64,
    recv_ms: i64,
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    /// Every slice this request may have been charged to (its send and receive times may
    /// straddle a boundary: then both count, which only makes the assertion stricter).
    fn slices(&self) -> Vec<i64> {
        let (a, b) = (
            self.sent_ms.div_euclid(SLICE_MS),
            self.recv_ms.div_euclid(SLICE_MS),
        );
        (a..=b).collect()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Sends one request as `client` (`None` key: no header, limited by the client IP).
async fn send(url: &str, client: &'static str, key: Option<&str>, export: bool) -> Answer {
    let http = http();
    let mut req = if export {
        http.post(format!("{url}/api/export"))
    } else {
        http.get(format!("{url}/api/items"))
    };
    if let Some(k) = key {
        req = req.header("x-api-key", k);
    }
    let sent_ms = now_ms();
    let r = req.send().await.expect("request to the example service");
    let recv_ms = now_ms();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let body = r.text().await.unwrap_or_default();
    Answer {
        client,
        cost: if export { EXPORT_COST } else { 1 },
        sent_ms,
        recv_ms,
        status,
        headers,
        body,
    }
}

/// Sleeps until `margin_ms` after the next slice boundary.
async fn align(margin_ms: i64) {
    let now = now_ms();
    let wait = SLICE_MS - now.rem_euclid(SLICE_MS) + margin_ms;
    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
}

/// Starts the example service on a free port; waits until `/healthz` answers.
async fn start_example(redis: &str, ns: &str, host: &str) -> (Proc, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = Command::new(example_bin());
    cmd.args(["--redis", redis, "--namespace", ns, "--host-id", host])
        .args(["--task", "api", "--listen", &addr])
        .args(["--export-cost", &EXPORT_COST.to_string()])
        .args(["--wait-ready-ms", "15000"])
        .env(
            "RUST_LOG",
            std::env::var("SLUICE_TEST_LOG").unwrap_or_else(|_| "info".into()),
        );
    let mut p = Proc::spawn("sluice-example-axum", cmd, dir.path().join("example.log"));
    let url = format!("http://{addr}");
    let health = format!("{url}/healthz");
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(r) = http().get(&health).send().await
            && r.status() == 200
        {
            break;
        }
        assert!(p.is_running(), "the example exited:\n{}", p.log());
        assert!(
            Instant::now() < deadline,
            "the example did not answer /healthz within {START_TIMEOUT:?}:\n{}",
            p.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (p, url, dir)
}

/// Runs the binary with `args` until it exits (at most 20 s); returns its exit code and output.
fn run_to_exit(args: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("out.log");
    let mut cmd = Command::new(example_bin());
    cmd.args(args).env("RUST_LOG", "warn");
    let mut p = Proc::spawn("sluice-example-axum (bad flags)", cmd, log);
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.is_running() {
        assert!(
            Instant::now() < deadline,
            "still running after 20 s with {args:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (p.exit_code(), p.log())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_service_gives_each_client_its_own_limit_and_429s_say_when_to_retry() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("exax");
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    // The task README.md tells a newcomer to create (with a shorter slice there).
    let spec = format!(
        r#"{{"threshold":{LIMIT},"slice_ms":{SLICE_MS},"keyed":true,
            "key_overrides":{{"key:{}":{GOLD_LIMIT}}},"local_limit":{LIMIT},"on_failure":"deny"}}"#,
        sluice_protocol::key_digest("gold")
    );
    let (status, b) = m.put("/api/v1/tasks/api", &spec).await;
    assert!(status == 200 || status == 201, "{status} {b}");
    m.wait_rolled("api").await;

    let (mut example, url, _dir) = start_example(&redis, &ns, &host).await;
    assert!(
        !example.log().contains("is unknown"),
        "the example never saw the task:\n{}",
        example.log()
    );

    // Not limited: far more health checks than any limit, all 200.
    for _ in 0..(2 * GOLD_LIMIT) {
        let r = http().get(format!("{url}/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }

    // One round: alice (limit 10) far past her limit, then gold (override 20), then carol's
    // exports (5 permits each of 10), then requests without a key (the client IP's limit).
    // A round whose requests did not all fall inside one slice is repeated (at most 3 times);
    // the per-slice bound is asserted on every round anyway.
    let mut answers: Vec<Answer> = Vec::new();
    let mut last_round_first = 0;
    for attempt in 0.. {
        assert!(attempt < 3, "no round stayed inside one slice");
        align(150).await;
        let first = answers.len();
        last_round_first = first;
        for _ in 0..(2 * LIMIT + 5) {
            answers.push(send(&url, "alice", Some("alice"), false).await);
        }
        for _ in 0..(GOLD_LIMIT + 10) {
            answers.push(send(&url, "gold", Some("gold"), false).await);
        }
        for _ in 0..4 {
            answers.push(send(&url, "carol", Some("carol"), true).await);
        }
        for _ in 0..(LIMIT + 5) {
            answers.push(send(&url, "ip", None, false).await);
        }
        let round = &answers[first..];
        let one_slice = round.first().unwrap().sent_ms.div_euclid(SLICE_MS)
            == round.last().unwrap().recv_ms.div_euclid(SLICE_MS);
        let took = round.last().unwrap().recv_ms - round.first().unwrap().sent_ms;
        eprintln!(
            "round {attempt}: {} requests in {took} ms, one slice: {one_slice}",
            round.len()
        );
        if one_slice {
            break;
        }
    }

    // Per client and slice: permits admitted ≤ the client's limit.
    let limit_of = |c: &str| if c == "gold" { GOLD_LIMIT } else { LIMIT };
    let mut admitted: BTreeMap<(&str, i64), u64> = BTreeMap::new();
    let mut rejected: BTreeMap<&str, u64> = BTreeMap::new();
    for a in &answers {
        match a.status {
            200 | 202 => {
                for s in a.slices() {
                    *admitted.entry((a.client, s)).or_default() += a.cost;
                }
            }
            429 => *rejected.entry(a.client).or_default() += 1,
            other => panic!("unexpected status {other}: {a:?}"),
        }
    }
    eprintln!("permits admitted per (client, slice): {admitted:?}; 429s per client: {rejected:?}");
    for ((client, slice), n) in &admitted {
        assert!(
            *n <= limit_of(client),
            "{client} was admitted {n} permits in slice {slice}, its limit is {}",
            limit_of(client)
        );
    }
    for client in ["alice", "gold", "carol", "ip"] {
        assert!(
            admitted.keys().any(|(c, _)| *c == client),
            "{client} was never admitted"
        );
        assert!(
            rejected.get(client).copied().unwrap_or(0) > 0,
            "{client} sent more than its limit and was never refused"
        );
    }

    // The last round, inside one slice: every client got its whole limit (the host pulls each
    // key's quota from Redis as it needs it), exports in steps of 5.
    let last_slice = answers[last_round_first].sent_ms.div_euclid(SLICE_MS);
    let got = |c: &str| admitted.get(&(c, last_slice)).copied().unwrap_or(0);
    assert_eq!(got("alice"), LIMIT, "alice's whole limit");
    assert_eq!(
        got("gold"),
        GOLD_LIMIT,
        "gold's override, untouched by alice"
    );
    assert_eq!(got("carol"), LIMIT, "two exports of {EXPORT_COST} permits");
    assert_eq!(got("ip"), LIMIT, "the client IP's limit");

    // Gold's first request came after alice's refusals and was admitted: alice's exhausted
    // limit is hers alone.
    let last_round = &answers[last_round_first..];
    let first_gold = last_round.iter().position(|a| a.client == "gold").unwrap();
    assert!(
        last_round[..first_gold]
            .iter()
            .any(|a| a.client == "alice" && a.status == 429),
        "alice was refused before gold started"
    );
    assert_eq!(
        last_round[first_gold].status, 200,
        "gold unaffected by alice"
    );

    // Every refusal: Retry-After in whole seconds within the slice, RateLimit r=0 and t =
    // Retry-After, the policy, the JSON body. Every admission: the fields, no Retry-After.
    let slice_s = (SLICE_MS / 1_000) as u64;
    for a in &answers {
        let policy = a.header("ratelimit-policy").unwrap_or_else(|| {
            panic!("no RateLimit-Policy: {a:?}");
        });
        assert!(policy.starts_with(r#""api";q="#), "{policy}");
        let limit = a.header("ratelimit").expect("RateLimit");
        if a.status == 429 {
            let ra: u64 = a
                .header("retry-after")
                .expect("429 without Retry-After")
                .parse()
                .expect("Retry-After is whole seconds");
            assert!((1..=slice_s).contains(&ra), "Retry-After {ra}");
            assert!(
                limit.starts_with(&format!(r#""api";r=0;t={ra};"#)),
                "{limit} vs Retry-After {ra}"
            );
            let body: Value = serde_json::from_str(&a.body).expect("JSON body");
            assert_eq!(body["error"], "rate_limited", "{body}");
            assert_eq!(body["cost"], a.cost, "{body}");
            let ms = body["retry_after_ms"].as_u64().expect("retry_after_ms");
            assert!(ms <= ra * 1_000 && ms + 1_000 >= ra * 1_000, "{ms} vs {ra}");
            assert_eq!(a.header("content-type"), Some("application/json"));
        } else {
            assert!(a.header("retry-after").is_none(), "{a:?}");
            assert!(limit.starts_with(r#""api";r="#), "{limit}");
        }
    }
    // The key's own cap is the policy's q once the host has pulled for it.
    let gold_q = answers
        .iter()
        .rev()
        .find(|a| a.client == "gold")
        .and_then(|a| a.header("ratelimit-policy").map(str::to_string))
        .unwrap();
    assert!(
        gold_q.starts_with(&format!(r#""api";q={GOLD_LIMIT};"#)),
        "{gold_q}"
    );

    // The manager sees what the example admitted and refused per key, exactly (the SDK
    // reports its busiest keys about once a second; this namespace is the test's own).
    // The example hashes API keys (`key:<digest>`); the API shows keys as labels under the
    // namespace's secret (the task does not set `clear_keys`).
    let secret = key_secret(&etcd, &ns).await;
    let key_of = |c: &str| {
        let key = match c {
            "ip" => "ip:127.0.0.1".to_string(),
            c => format!("key:{}", sluice_protocol::key_digest(c)),
        };
        sluice_protocol::key_label(Some(&secret), &key)
    };
    let mut sent: BTreeMap<(&str, String), u64> = BTreeMap::new();
    for a in &answers {
        let list = if a.status == 429 {
            "top_rejected"
        } else {
            "top_admitted"
        };
        *sent.entry((list, key_of(a.client))).or_default() += a.cost;
    }
    let seen = wait_until(
        "the example's counts in GET /api/v1/tasks/api/keys",
        Duration::from_secs(15),
        Duration::from_millis(200),
        || async {
            let v = m.get_json("/api/v1/tasks/api/keys?minutes=5").await?;
            let mut seen = BTreeMap::new();
            for (list, key) in sent.keys() {
                let n = v[*list].as_array()?.iter().find_map(|e| {
                    (e["key"] == key.as_str())
                        .then(|| e["permits"].as_u64())
                        .flatten()
                })?;
                seen.insert((*list, key.clone()), n);
            }
            seen.iter().all(|(k, n)| *n >= sent[k]).then_some(seen)
        },
    )
    .await;
    eprintln!("the manager's per-key permits: {seen:?}");
    assert_eq!(seen, sent, "the manager's counts are the example's answers");

    // SIGTERM: a graceful stop, exit code 0.
    assert_eq!(
        example.stop_with(libc::SIGTERM, Duration::from_secs(10)),
        Some(0)
    );
}

#[test]
fn example_service_refuses_bad_flags_naming_them() {
    let (code, out) = run_to_exit(&["--listen", "nowhere"]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--listen"), "{out}");
    let (code, out) = run_to_exit(&["--export-cost", "0"]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--export-cost"), "{out}");

    // A task name the SDK refuses: named, exit 1, after the client started (it needs Redis
    // for that, and a segment, removed again).
    let redis = shared_redis();
    let ns = unique_ns("exaxflags");
    let host = format!("{ns}-h");
    let _seg = SegmentGuard(vec![(ns.clone(), host.clone())]);
    let (code, out) = run_to_exit(&[
        "--redis",
        &redis,
        "--namespace",
        &ns,
        "--host-id",
        &host,
        "--task",
        "no spaces allowed",
    ]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("--task \"no spaces allowed\""), "{out}");
    // Not a Redis URL: named, and the password in it is not printed.
    let (code, out) = run_to_exit(&["--redis", "http://user:s3cret@127.0.0.1:1"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("--redis"), "{out}");
    assert!(!out.contains("s3cret"), "the password was printed: {out}");
}
