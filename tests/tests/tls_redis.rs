//! Redis over TLS with ACL users, end to end: a `redis-server` with TLS only, client
//! certificates required and the ACL file of `deploy/redis-acl.conf` (the documented one, with
//! this test's namespace and passwords); two `sluice-manager` replicas log in as
//! `sluice-manager`, the loadgen (the SDK) as `sluice-worker`, both over mutual TLS. Rolling,
//! pulling (no over-admission, the threshold used), the exact modes and a leader failover work
//! unchanged, Redis's ACL log records no denial, and no password appears in any log.
//!
//! Misconfigured links fail at start-up, naming the endpoint and never the password: a CA that
//! did not sign the server's certificate, a wrong password, no client certificate; a TLS Redis
//! that is down is tolerated (logged), as a plain one is.
//!
//! A three-node Redis Cluster over TLS (`tls-cluster yes`) works under the same ACL file.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sluice_tests::*;

const MANAGER_PW: &str = "mgr-pw-4f1c9a";
const WORKER_PW: &str = "wrk-pw-77d2e0";
const ADMIN_PW: &str = "adm-pw-0b3e55";

/// The documented ACL file with namespace `ns` and this test's passwords, plus an admin user
/// the harness asserts with.
fn acl_file(dir: &Path, ns: &str) -> PathBuf {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/redis-acl.conf");
    let text = std::fs::read_to_string(&doc).expect("deploy/redis-acl.conf");
    let mut out = String::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let line = line.replace("sluice:", &format!("{ns}:"));
        let line = if line.starts_with("user sluice-worker ") {
            line.replace(">CHANGE-ME", &format!(">{WORKER_PW}"))
        } else if line.starts_with("user sluice-manager ") {
            line.replace(">CHANGE-ME", &format!(">{MANAGER_PW}"))
        } else {
            line
        };
        assert!(!line.contains("CHANGE-ME"), "unexpected ACL line {line}");
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(&format!("user admin on >{ADMIN_PW} ~* &* +@all\n"));
    let path = dir.join("users.acl");
    std::fs::write(&path, out).expect("write ACL file");
    path
}

/// A password file in `dir`.
fn pw_file(dir: &Path, name: &str, pw: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("{pw}\n")).expect("write password file");
    p
}

/// The certificates and password files of a test.
struct Creds {
    pki: Arc<TestPki>,
    dir: tempfile::TempDir,
}

/// A TLS Redis with the documented ACLs, and the credentials for it.
struct TlsWorld {
    creds: Creds,
    redis: RedisServer,
    ns: String,
}

impl std::ops::Deref for TlsWorld {
    type Target = Creds;
    fn deref(&self) -> &Creds {
        &self.creds
    }
}

impl Creds {
    fn new() -> Self {
        Self {
            pki: Arc::new(TestPki::generate("sluice-test-ca")),
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }
}

impl TlsWorld {
    fn start(prefix: &str) -> Self {
        let ns = unique_ns(prefix);
        let creds = Creds::new();
        let acl = acl_file(creds.dir.path(), &ns);
        let redis = RedisServer::start_tls(
            creds.pki.clone(),
            Some(acl),
            Some(("admin".into(), ADMIN_PW.into())),
        );
        Self { creds, redis, ns }
    }

    fn manager_opts(&self, node: &str, flags: Vec<String>) -> ManagerOpts {
        let mut o = ManagerOpts::new(&shared_etcd(), &self.redis.url(), &self.ns, node);
        o.extra = flags;
        o
    }

    /// Runs the loadgen on `task` for `ms` with `procs` processes; returns its report and log.
    async fn loadgen(&self, task: &str, host: &str, procs: u32, ms: u64) -> (Value, String) {
        self.loadgen_with(task, host, procs, ms, &[]).await
    }

    /// [`TlsWorld::loadgen`] with more loadgen flags.
    async fn loadgen_with(
        &self,
        task: &str,
        host: &str,
        procs: u32,
        ms: u64,
        more: &[&str],
    ) -> (Value, String) {
        let flags = self.worker_flags();
        let mut extra: Vec<&str> = flags.iter().map(String::as_str).collect();
        extra.extend(["--bucket-ms", "1000"]);
        extra.extend(more);
        let args = loadgen_args(&self.redis.url(), &self.ns, task, host, procs, ms, &extra);
        let mut lg = Loadgen::spawn(&args);
        let report = lg
            .wait_json(Duration::from_millis(ms) + START_TIMEOUT)
            .await;
        (report, lg.proc.log())
    }

    /// Denials Redis recorded (`ACL LOG`): every command or key a user was refused.
    fn acl_denials(&self) -> Vec<String> {
        acl_denials(&self.redis)
    }
}

impl Creds {
    fn path(p: &Path) -> String {
        p.to_str().expect("utf-8 path").to_string()
    }

    /// Manager flags for mutual TLS as `user` with password file `pw`.
    fn manager_flags(&self, user: &str, pw: &Path, ca: Option<&Path>) -> Vec<String> {
        let mut v = vec![
            "--redis-cert".to_string(),
            Self::path(&self.pki.client_cert),
            "--redis-key".into(),
            Self::path(&self.pki.client_key),
            "--redis-user".into(),
            user.into(),
            "--redis-password-file".into(),
            Self::path(pw),
        ];
        if let Some(ca) = ca {
            v.extend(["--redis-ca".into(), Self::path(ca)]);
        }
        v
    }

    /// Loadgen flags for mutual TLS as the worker user (password file).
    fn worker_flags(&self) -> Vec<String> {
        let pw = pw_file(self.dir.path(), "worker-pw", WORKER_PW);
        vec![
            "--redis-ca".into(),
            Self::path(&self.pki.ca_cert),
            "--redis-cert".into(),
            Self::path(&self.pki.client_cert),
            "--redis-key".into(),
            Self::path(&self.pki.client_key),
            "--redis-user".into(),
            "sluice-worker".into(),
            "--redis-password-file".into(),
            Self::path(&pw),
        ]
    }
}

fn acl_denials(server: &RedisServer) -> Vec<String> {
    let mut c = server.admin_conn();
    let v: redis::Value = redis::cmd("ACL").arg("LOG").query(&mut c).expect("ACL LOG");
    match v {
        redis::Value::Array(entries) => entries.iter().map(|e| format!("{e:?}")).collect(),
        other => vec![format!("{other:?}")],
    }
}

/// Checks a pooled run: every full slice admitted ≤ threshold and ≥ 90 % of it; no fallback.
fn assert_pooled(report: &Value, threshold: u64, what: &str) {
    assert_eq!(
        report["fallback_admitted"].as_u64(),
        Some(0),
        "{what}: fallback admissions (Redis unusable?): {report}"
    );
    let buckets = loadgen_buckets(report);
    let n = buckets.len();
    assert!(n >= 3, "{what}: too few buckets {buckets:?}");
    for (i, (start, (adm, _rej))) in buckets.iter().enumerate() {
        assert!(
            *adm <= threshold,
            "{what}: slice {start} over-admitted: {adm} > {threshold}"
        );
        if i > 0 && i + 1 < n {
            assert!(
                *adm >= threshold * 9 / 10,
                "{what}: slice {start} admitted only {adm} of {threshold}"
            );
        }
    }
    eprintln!("{what}: per-slice admitted {buckets:?}");
}

fn assert_no_secret(log: &str, who: &str) {
    for pw in [MANAGER_PW, WORKER_PW, ADMIN_PW] {
        assert!(!log.contains(pw), "{who} logged a password");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_pulling_and_failover_over_mutual_tls_under_the_documented_acls() {
    let w = TlsWorld::start("tlsr");
    let _seg = SegmentGuard(vec![
        (w.ns.clone(), "h1".into()),
        (w.ns.clone(), "h2".into()),
        (w.ns.clone(), "h3".into()),
    ]);
    let pw = pw_file(w.dir.path(), "manager-pw", MANAGER_PW);
    // n0 trusts the CA by --redis-ca, n1 by SSL_CERT_FILE (pinned: an extra bundle).
    let m0 = Manager::start(w.manager_opts(
        "n0",
        w.manager_flags("sluice-manager", &pw, Some(&w.pki.ca_cert)),
    ))
    .await;
    let mut o1 = w.manager_opts("n1", w.manager_flags("sluice-manager", &pw, None));
    o1.env
        .push(("SSL_CERT_FILE".into(), Creds::path(&w.pki.ca_cert)));
    let m1 = Manager::start(o1).await;
    let mut ms = vec![m0, m1];
    for m in &ms {
        wait_for_log(&m.proc, "Redis reachable", Duration::from_secs(10)).await;
    }
    let refs: Vec<&Manager> = ms.iter().collect();
    let (leader, term) = wait_for_leader(&refs, Duration::from_secs(15)).await;

    const T: u64 = 300;
    let spec = format!(r#"{{"threshold":{T},"slice_ms":1000}}"#);
    let (st, body) = ms[leader].put("/api/v1/tasks/pooled", &spec).await;
    assert!(st == 200 || st == 201, "{st} {body}");
    let (st, body) = ms[leader]
        .put(
            "/api/v1/tasks/exact",
            r#"{"threshold":40,"slice_ms":1000,"local_limit":1000,"on_failure":"local","mode":"exact_fixed"}"#,
        )
        .await;
    assert!(st == 200 || st == 201, "{st} {body}");
    let (st, body) = ms[leader]
        .put(
            "/api/v1/tasks/sliding",
            r#"{"threshold":40,"slice_ms":1000,"local_limit":1000,"on_failure":"local","mode":"exact_sliding"}"#,
        )
        .await;
    assert!(st == 200 || st == 201, "{st} {body}");
    let (st, body) = ms[leader]
        .put(
            "/api/v1/tasks/keyed",
            r#"{"threshold":20,"slice_ms":1000,"keyed":true,"key_overrides":{"key-0":30}}"#,
        )
        .await;
    assert!(st == 200 || st == 201, "{st} {body}");
    assert_eq!(ms[leader].wait_rolled("pooled").await, T as i64);
    ms[leader].wait_rolled("exact").await;
    ms[leader].wait_rolled("sliding").await;
    ms[leader].wait_rolled("keyed").await;

    // Pulling over TLS as the worker user: the threshold per slice, never more.
    let (r, log) = w.loadgen("pooled", "h1", 2, 3_500).await;
    assert_pooled(&r, T, "pooled, first leader");
    assert_no_secret(&log, "loadgen");
    // The exact modes (one round trip per decision) under the worker ACL.
    for task in ["exact", "sliding"] {
        let (r, log) = w.loadgen(task, "h2", 1, 1_500).await;
        assert_eq!(r["fallback_admitted"].as_u64(), Some(0), "{task}: {r}");
        assert!(r["admitted"].as_u64().unwrap_or(0) > 0, "{task}: {r}");
        for (start, (adm, _)) in loadgen_buckets(&r) {
            assert!(adm <= 40, "{task}: slice {start} over-admitted: {adm}");
        }
        assert_no_secret(&log, "loadgen");
    }

    // Keyed tasks (KPULL creating key slices, the hosts' top-key reports) under the worker ACL.
    let (r, log) = w
        .loadgen_with(
            "keyed",
            "h2",
            2,
            2_500,
            &["--keys", "20", "--key-report", "20", "--rate", "400"],
        )
        .await;
    let denials = w.acl_denials();
    assert!(
        denials.is_empty(),
        "ACL denials (keyed): {denials:#?}\n{log}"
    );
    assert_eq!(r["fallback_admitted"].as_u64(), Some(0), "keyed: {r}");
    assert!(r["admitted"].as_u64().unwrap_or(0) > 0, "keyed: {r}");
    for (k, b) in loadgen_key_buckets(&r) {
        let limit = if k == "key-0" { 30 } else { 20 };
        for (start, (adm, _)) in b {
            assert!(
                adm <= limit,
                "keyed {k}: slice {start} over-admitted: {adm}"
            );
        }
    }
    assert_no_secret(&log, "loadgen");

    // The host agent over mutual TLS as the worker user: decisions, the first-sight lookup of
    // a task (HMGET on its meta), the Envoy domains (HGETALL NS:envoy, /readyz).
    {
        let flags = w.worker_flags();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let a = Agent::start(&w.redis.url(), &w.ns, "agent-h", &flags).await;
        a.wait_ready().await;
        let (s, v) = a.decide(&serde_json::json!({"task": "pooled"})).await;
        assert_eq!((s, v["decision"].as_str()), (200, Some("allowed")), "{v}");
        let (s, v) = a
            .decide(&serde_json::json!({"task": "keyed", "key": "agent-key"}))
            .await;
        assert_eq!((s, v["decision"].as_str()), (200, Some("allowed")), "{v}");
        let (s, v) = a.decide(&serde_json::json!({"task": "no-such-task"})).await;
        assert_eq!(s, 404, "{v}");
        let denials = w.acl_denials();
        assert!(
            denials.is_empty(),
            "ACL denials (agent): {denials:#?}\n{}",
            a.proc.log()
        );
        assert_no_secret(&a.proc.log(), "agent");
    }

    // The API's Redis reads (task status, history, alerts, top keys) as the manager user.
    for path in [
        "/api/v1/tasks/pooled",
        "/api/v1/tasks/pooled/history",
        "/api/v1/alerts",
        "/api/v1/tasks/keyed/keys",
    ] {
        assert!(
            ms[leader].get_json(path).await.is_some(),
            "GET {path} failed over TLS"
        );
    }

    // Failover: the survivor takes over and keeps rolling over its own TLS link.
    ms[leader].proc.kill();
    let survivor = ms.remove(1 - leader);
    survivor.wait_leader().await;
    let (_, new_term) = leader_seen_by(&survivor).await.expect("leader");
    assert!(new_term > term, "term must grow: {term} -> {new_term}");
    let ahead = wait_until(
        "the new leader rolls",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let h = survivor.metric("sluice_horizon_ahead_seconds").await?;
            (h > 50.0).then_some(h)
        },
    )
    .await;
    eprintln!("failover: term {term} -> {new_term}, horizon ahead {ahead:.1}s");
    let (r, log) = w.loadgen("pooled", "h3", 2, 3_500).await;
    assert_pooled(&r, T, "pooled, after failover");
    assert_no_secret(&log, "loadgen");

    // The documented ACLs were enough: Redis refused nothing to anyone.
    let denials = w.acl_denials();
    assert!(denials.is_empty(), "ACL denials: {denials:#?}");
    let mlog = survivor.proc.log();
    assert_no_secret(&mlog, "manager");
    for needle in ["NOPERM", "ERROR"] {
        assert!(
            !mlog.contains(needle),
            "{needle} in the manager log:\n{mlog}"
        );
    }
    assert_no_secret(&w.redis.log(), "redis-server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconfigured_tls_links_fail_at_start_up_naming_the_endpoint() {
    let w = TlsWorld::start("tlsbad");
    let _seg = SegmentGuard(vec![(w.ns.clone(), "hbad".into())]);
    let endpoint = format!("127.0.0.1:{}", w.redis.port);
    let good_pw = pw_file(w.dir.path(), "manager-pw", MANAGER_PW);
    let bad_pw = pw_file(w.dir.path(), "bad-pw", "not-the-pw-91c2");
    let other = TestPki::generate("some-other-ca");

    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        (
            "a CA that did not sign the server certificate",
            w.manager_flags("sluice-manager", &good_pw, Some(&other.ca_cert)),
            "TLS handshake failed",
        ),
        (
            "a wrong password",
            w.manager_flags("sluice-manager", &bad_pw, Some(&w.pki.ca_cert)),
            "authentication failed",
        ),
        (
            "no client certificate",
            vec![
                "--redis-ca".into(),
                Creds::path(&w.pki.ca_cert),
                "--redis-user".into(),
                "sluice-manager".into(),
                "--redis-password-file".into(),
                Creds::path(&good_pw),
            ],
            "TLS handshake failed",
        ),
    ];
    for (i, (what, flags, needle)) in cases.into_iter().enumerate() {
        let opts = w.manager_opts(&format!("bad{i}"), flags);
        let (code, log) = Manager::start_expecting_exit(opts, Duration::from_secs(20)).await;
        eprintln!("{what}: exit {code:?}\n{log}");
        assert!(code.is_some_and(|c| c != 0), "{what}: exit code {code:?}");
        assert!(
            log.contains(&endpoint),
            "{what}: endpoint not named:\n{log}"
        );
        assert!(log.contains(needle), "{what}: {needle:?} not in:\n{log}");
        assert!(!log.contains("not-the-pw-91c2"), "{what}: password printed");
        assert_no_secret(&log, what);
    }

    // The loadgen (the SDK) refuses a wrong password the same way.
    let bad = Creds::path(&bad_pw);
    let flags = w.worker_flags();
    let mut extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    let i = extra
        .iter()
        .position(|a| *a == "--redis-password-file")
        .unwrap();
    extra[i + 1] = &bad;
    let args = loadgen_args(&w.redis.url(), &w.ns, "t", "hbad", 1, 500, &extra);
    let mut lg = Loadgen::spawn(&args);
    // Signal 0 sends nothing: this only waits for the exit.
    let st = lg
        .proc
        .signal_and_wait(0, Duration::from_secs(15))
        .expect("the loadgen exits at start-up");
    assert_eq!(st.code(), Some(1), "loadgen: {st}\n{}", lg.proc.log());
    let log = lg.proc.log();
    assert!(
        log.contains(&endpoint) && log.contains("authentication failed"),
        "{log}"
    );
    assert!(
        !log.contains("not-the-pw-91c2"),
        "loadgen printed the password"
    );

    // Credentials in the URL: the same failure, the URL shown redacted.
    let url = format!(
        "rediss://sluice-worker:url-pw-5d1e@127.0.0.1:{}",
        w.redis.port
    );
    let flags = w.worker_flags();
    let extra: Vec<&str> = flags[..6].iter().map(String::as_str).collect();
    assert_eq!(extra[4], "--redis-key", "CA, certificate and key only");
    let mut lg = Loadgen::spawn(&loadgen_args(&url, &w.ns, "t", "hbad", 1, 500, &extra));
    let st = lg
        .proc
        .signal_and_wait(0, Duration::from_secs(15))
        .expect("the loadgen exits at start-up");
    let log = lg.proc.log();
    assert_eq!(st.code(), Some(1), "loadgen: {st}\n{log}");
    assert!(log.contains(&format!("rediss://***@{endpoint}")), "{log}");
    assert!(
        !log.contains("url-pw-5d1e"),
        "loadgen printed the URL password:\n{log}"
    );

    // A TLS Redis that is down is tolerated: the replica starts, names the endpoint, waits.
    let down = format!("rediss://127.0.0.1:{}", free_port());
    let mut o = ManagerOpts::new(&shared_etcd(), &down, &w.ns, "down0");
    o.extra = w.manager_flags("sluice-manager", &good_pw, Some(&w.pki.ca_cert));
    let m = Manager::start(o).await;
    wait_for_log(
        &m.proc,
        "not reachable at start-up",
        Duration::from_secs(10),
    )
    .await;
    assert!(m.proc.log().contains(&down), "{}", m.proc.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_over_tls_under_the_documented_acls() {
    let ns = unique_ns("tlscl");
    let Creds { pki, dir } = Creds::new();
    let acl = acl_file(dir.path(), &ns);
    let cluster = RedisCluster::start_tls(
        3,
        pki.clone(),
        Some(acl),
        Some(("admin".into(), ADMIN_PW.into())),
    );
    let w = Creds { pki, dir };
    let _seg = SegmentGuard(vec![(ns.clone(), "hc".into())]);
    let urls = cluster.urls();
    assert!(urls.starts_with("rediss://"), "{urls}");
    let pw = pw_file(w.dir.path(), "manager-pw", MANAGER_PW);
    let mut o = ManagerOpts::new(&shared_etcd(), &urls, &ns, "c0");
    o.extra = w.manager_flags("sluice-manager", &pw, Some(&w.pki.ca_cert));
    let m = Manager::start(o).await;
    wait_for_log(&m.proc, "Redis reachable", Duration::from_secs(10)).await;
    m.wait_leader().await;
    const T: u64 = 200;
    // Enough tasks to spread over every node's slots.
    for i in 0..6 {
        let (st, v) = m
            .put(
                &format!("/api/v1/tasks/task{i}"),
                &format!(r#"{{"threshold":{T},"slice_ms":1000}}"#),
            )
            .await;
        assert!(st == 200 || st == 201, "{st} {v}");
        m.wait_rolled(&format!("task{i}")).await;
    }
    let flags = w.worker_flags();
    let mut extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    extra.extend(["--bucket-ms", "1000"]);
    for task in ["task1", "task4"] {
        let args = loadgen_args(&urls, &ns, task, "hc", 1, 3_500, &extra);
        let mut lg = Loadgen::spawn(&args);
        let r = lg.wait_json(Duration::from_secs(30)).await;
        assert_pooled(&r, T, &format!("cluster {task}"));
        assert_no_secret(&lg.proc.log(), "loadgen");
    }
    assert_eq!(m.metric("sluice_roll_errors_total").await, Some(0.0));
    for node in &cluster.nodes {
        let d = acl_denials(node);
        assert!(d.is_empty(), "ACL denials on :{}: {d:#?}", node.port);
    }
    assert_no_secret(&m.proc.log(), "manager");
}
