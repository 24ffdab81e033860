//! etcd over TLS with client certificates and authentication, the manager's own HTTPS
//! listener, and `/readyz`, end to end: a real etcd started with `--cert-file`,
//! `--client-cert-auth` and auth enabled, real Redis, real `sluice-manager` processes.
//! Certificates are made here with `openssl` (see `sluice_tests::pki`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::pki::{CertPair, TestCa};
use sluice_tests::*;

const PASSWORD: &str = "etcd-pw-Zq81xK";
const ROOT_PASSWORD: &str = "etcd-root-pw-Jm20";

/// A TLS etcd (client certificates required, auth token TTL 3 s so the managers must refresh
/// their token during the test) with auth enabled: user `sluice` may use `/<ns>/` only.
struct SecureEtcd {
    etcd: EtcdServer,
    ca: TestCa,
    /// The managers' client certificate (its CN is no etcd user).
    manager_cert: CertPair,
    password_file: PathBuf,
}

async fn secure_etcd(ns: &str) -> SecureEtcd {
    let ca = TestCa::new("etcd-ca");
    let server = ca.issue("etcd-server");
    let harness = ca.issue("harness");
    let manager_cert = ca.issue("sluice-manager");
    let etcd = EtcdServer::start_tls(
        EtcdTls {
            ca: ca.cert.clone(),
            server,
            client: harness,
        },
        &["--auth-token-ttl", "3"],
    );
    etcd.enable_auth(ROOT_PASSWORD, "sluice", PASSWORD, ns)
        .await;
    let password_file = ca.dir.path().join("etcd-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).expect("password file");
    SecureEtcd {
        etcd,
        ca,
        manager_cert,
        password_file,
    }
}

impl SecureEtcd {
    /// The flags of a manager that uses this etcd properly.
    fn flags(&self) -> Vec<String> {
        let p = |p: &PathBuf| p.to_str().unwrap().to_string();
        vec![
            "--etcd-ca".into(),
            p(&self.ca.cert),
            "--etcd-cert".into(),
            p(&self.manager_cert.cert),
            "--etcd-key".into(),
            p(&self.manager_cert.key),
            "--etcd-user".into(),
            "sluice".into(),
            "--etcd-password-file".into(),
            p(&self.password_file),
        ]
    }
}

fn opts(etcd: &str, redis: &str, ns: &str, id: &str, extra: Vec<String>) -> ManagerOpts {
    let mut o = ManagerOpts::new(etcd, redis, ns, id);
    o.extra = extra;
    o
}

async fn readyz(m: &Manager) -> Option<(u16, Value)> {
    let r = m.client().get(m.url("/readyz")).send().await.ok()?;
    let status = r.status().as_u16();
    Some((status, r.json().await.ok()?))
}

async fn wait_ready(m: &Manager, want: u16, timeout: Duration) -> Value {
    let what = format!("/readyz of {} to answer {want}", m.opts.node_id);
    wait_until(&what, timeout, Duration::from_millis(100), || async {
        readyz(m).await.and_then(|(s, v)| (s == want).then_some(v))
    })
    .await
}

/// Prints the ERROR lines of a log (what an operator would see).
fn show_errors(who: &str, log: &str) {
    for l in log
        .lines()
        .filter(|l| l.contains("ERROR") || l.starts_with("Error"))
    {
        eprintln!("{who}: {l}");
    }
}

fn assert_no_secret(log: &str, who: &str) {
    for secret in [PASSWORD, ROOT_PASSWORD, "wrong-pw-Xy77"] {
        assert!(
            !log.contains(secret),
            "{who}'s log contains a password:\n{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_managers_elect_roll_and_fail_over_over_tls_etcd_with_auth() {
    let ns = unique_ns("tlsetcd");
    let se = secure_etcd(&ns).await;
    let endpoint = se.etcd.endpoint();
    assert!(endpoint.starts_with("https://"), "{endpoint}");
    let redis_url = shared_redis();

    // n0 and n1 trust etcd's CA through --etcd-ca, n2 through SSL_CERT_FILE (pinned: an extra
    // trusted bundle for every TLS link); n1 has its password in SLUICE_ETCD_PASSWORD.
    let mut ms = Vec::new();
    for i in 0..3 {
        let mut o = opts(&endpoint, &redis_url, &ns, &format!("n{i}"), se.flags());
        if i == 1 {
            // The password from the environment instead of a file.
            o.extra.truncate(o.extra.len() - 2);
            o.env.push(("SLUICE_ETCD_PASSWORD".into(), PASSWORD.into()));
        }
        if i == 2 {
            o.extra.drain(..2);
            o.env.push((
                "SSL_CERT_FILE".into(),
                se.ca.cert.to_str().unwrap().to_string(),
            ));
        }
        ms.push(Manager::start(o).await);
    }
    let refs: Vec<&Manager> = ms.iter().collect();
    let started = Instant::now();
    let (leader, term) = wait_for_leader(&refs, Duration::from_secs(20)).await;
    eprintln!(
        "leader n{leader} (term {term}) after {:?}",
        started.elapsed()
    );
    for m in &ms {
        let v = wait_ready(m, 200, Duration::from_secs(10)).await;
        assert_eq!(v["ready"], true, "{v}");
        assert_eq!(v["etcd"]["ok"], true, "{v}");
        assert_eq!(v["task_watch"]["ok"], true, "{v}");
        assert_eq!(v["redis"]["ok"], true, "{v}");
    }

    // A PUT through a follower is stored in etcd (as user `sluice`) and rolled by the leader.
    let follower = (leader + 1) % 3;
    let (status, v) = ms[follower]
        .put(
            "/api/v1/tasks/tls",
            r#"{"threshold": 300, "slice_ms": 1000}"#,
        )
        .await;
    assert!(status == 201 || status == 200, "PUT: {status} {v}");
    let mut conn = redis_conn(&redis_url);
    wait_until(
        "slices of tls written",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let now = now_ms();
            let caps = slice_caps(&mut conn, &ns, "tls", 1000, now, now + 30_000);
            let ok = caps.iter().all(|(_, c)| *c == Some(300));
            async move { ok.then_some(()) }
        },
    )
    .await;

    // Past the token TTL (3 s): every call must still work (the token is refreshed).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (status, v) = ms[leader]
        .put(
            "/api/v1/tasks/tls",
            r#"{"threshold": 400, "slice_ms": 1000}"#,
        )
        .await;
    assert_eq!(status, 200, "update after the token expired: {v}");

    // Failover: SIGKILL the leader; a survivor takes over and rolls the new threshold.
    let killed_at = Instant::now();
    ms[leader].proc.kill();
    let survivors: Vec<&Manager> = ms
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, m)| m)
        .collect();
    let (new_leader, new_term) = wait_for_leader(&survivors, Duration::from_secs(15)).await;
    eprintln!(
        "failover to {} (term {new_term}) took {:?}",
        survivors[new_leader].opts.node_id,
        killed_at.elapsed()
    );
    assert!(new_term > term, "term must grow: {term} -> {new_term}");
    // The new leader sees a task created after the failover (watch over TLS) and rolls it.
    let (status, v) = survivors[(new_leader + 1) % 2]
        .put(
            "/api/v1/tasks/after",
            r#"{"threshold": 700, "slice_ms": 1000}"#,
        )
        .await;
    assert!(
        status == 201 || status == 200,
        "PUT after failover: {status} {v}"
    );
    wait_until(
        "slices of after written by the new leader",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let now = now_ms();
            let caps = slice_caps(&mut conn, &ns, "after", 1000, now, now + 30_000);
            let ok = caps.iter().all(|(_, c)| *c == Some(700));
            async move { ok.then_some(()) }
        },
    )
    .await;
    for m in &survivors {
        assert_eq!(
            wait_ready(m, 200, Duration::from_secs(5)).await["ready"],
            true
        );
    }
    for m in &ms {
        assert_no_secret(&m.proc.log(), &m.opts.node_id);
        assert!(m.proc.log().contains("etcd connected"), "{}", m.proc.log());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_ca_password_or_scheme_fail_loudly_and_unreachable_etcd_is_awaited() {
    let ns = unique_ns("tlsbad");
    let mut se = secure_etcd(&ns).await;
    let endpoint = se.etcd.endpoint();
    let redis_url = shared_redis();

    // A CA that did not sign etcd's certificate: exit 1, the endpoint named, TLS blamed.
    let other_ca = TestCa::new("other-ca");
    let mut flags = se.flags();
    flags[1] = other_ca.cert.to_str().unwrap().to_string();
    let mut m = Manager::spawn(opts(&endpoint, &redis_url, &ns, "badca", flags));
    let (code, log) = m.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(&endpoint), "endpoint not named:\n{log}");
    assert!(log.contains("ERROR"), "not logged at ERROR:\n{log}");
    assert!(
        log.contains("TLS") && log.to_lowercase().contains("certificate"),
        "TLS not blamed:\n{log}"
    );
    assert_no_secret(&log, "badca");
    show_errors("badca", &log);

    // A wrong password: exit 1, the endpoint named, the password not printed.
    let wrong = se.ca.dir.path().join("wrong-password");
    std::fs::write(&wrong, "wrong-pw-Xy77\n").unwrap();
    let mut flags = se.flags();
    let last = flags.len() - 1;
    flags[last] = wrong.to_str().unwrap().to_string();
    let mut m = Manager::spawn(opts(&endpoint, &redis_url, &ns, "badpw", flags));
    let (code, log) = m.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(&endpoint), "endpoint not named:\n{log}");
    assert!(log.contains("authentication failed"), "{log}");
    assert_no_secret(&log, "badpw");
    show_errors("badpw", &log);

    // https:// against a plain-HTTP etcd: exit 1, the endpoint named, TLS blamed.
    let plain = shared_etcd().replace("http://", "https://");
    let flags: Vec<String> = se.flags()[..2].to_vec(); // --etcd-ca only
    let mut m = Manager::spawn(opts(&plain, &redis_url, &ns, "plain", flags));
    let (code, log) = m.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(&plain), "endpoint not named:\n{log}");
    assert!(log.contains("TLS"), "TLS not blamed:\n{log}");
    show_errors("plain", &log);

    // No client certificate while etcd demands one: exit 1, the endpoint named, TLS blamed.
    let mut flags = se.flags();
    flags.drain(2..6);
    let mut m = Manager::spawn(opts(&endpoint, &redis_url, &ns, "nocert", flags));
    let (code, log) = m.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(&endpoint), "endpoint not named:\n{log}");
    assert!(log.contains("TLS"), "TLS not blamed:\n{log}");
    show_errors("nocert", &log);

    // A bad certificate file is a configuration error: exit 2 naming the flag, at once.
    let mut flags = se.flags();
    flags[3] = se.password_file.to_str().unwrap().to_string(); // --etcd-cert: not a PEM
    let mut m = Manager::spawn(opts(&endpoint, &redis_url, &ns, "badfile", flags));
    let (code, log) = m.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("--etcd-cert"), "{log}");
    assert_no_secret(&log, "badfile");

    // etcd down: the manager waits (WARN with the endpoint), serves /healthz, and /readyz says
    // etcd is not there; once etcd is back it connects, leads and is ready.
    se.etcd.kill();
    let m = Manager::start(opts(&endpoint, &redis_url, &ns, "patient", se.flags())).await;
    wait_for_log(&m.proc, "cannot be reached", Duration::from_secs(10)).await;
    assert!(m.proc.log().contains(&endpoint), "{}", m.proc.log());
    let (status, v) = readyz(&m).await.expect("readyz");
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["etcd"]["ok"], false, "{v}");
    assert!(v["etcd"]["reason"].is_string(), "{v}");
    assert_eq!(v["task_watch"]["ok"], false, "{v}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut m = m;
    assert!(m.proc.is_running(), "gave up on an unreachable etcd");
    se.etcd.restart();
    m.wait_leader().await;
    wait_ready(&m, 200, Duration::from_secs(15)).await;
    assert_no_secret(&m.proc.log(), "patient");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_listener_serves_api_dashboard_and_readyz_follows_redis() {
    let ns = unique_ns("https");
    let ca = TestCa::new("listener-ca");
    let cert = ca.issue("manager");
    let mut redis = RedisServer::start();
    let tls_flags = vec![
        "--tls-cert".to_string(),
        cert.cert.to_str().unwrap().to_string(),
        "--tls-key".to_string(),
        cert.key.to_str().unwrap().to_string(),
    ];
    let mut o = opts(&shared_etcd(), &redis.url(), &ns, "h0", tls_flags.clone());
    o.https_client = Some(ca.https_client());
    let m = Manager::start(o).await;
    assert!(m.url("/").starts_with("https://"));
    m.wait_leader().await;

    // /healthz, /readyz, the API and the dashboard over https, trusting the test CA.
    let h = m.get_json("/healthz").await.expect("healthz over https");
    assert_eq!(h["status"], "ok");
    let v = wait_ready(&m, 200, Duration::from_secs(10)).await;
    assert_eq!(v["ready"], true, "{v}");
    let (status, v) = m
        .put(
            "/api/v1/tasks/web",
            r#"{"threshold": 50, "slice_ms": 1000}"#,
        )
        .await;
    assert!(
        status == 201 || status == 200,
        "PUT over https: {status} {v}"
    );
    assert_eq!(m.wait_rolled("web").await, 50);
    let page = m.client().get(m.url("/")).send().await.expect("dashboard");
    assert_eq!(page.status().as_u16(), 200);
    let html = page.text().await.unwrap();
    assert!(html.to_lowercase().contains("<html"), "{html}");

    // Plain http to the https port fails; so does a client trusting another CA.
    let plain = http()
        .get(format!("http://{}/healthz", m.addr))
        .send()
        .await;
    assert!(
        plain.is_err() || !plain.as_ref().unwrap().status().is_success(),
        "plain http answered: {plain:?}"
    );
    let stranger = TestCa::new("stranger-ca").https_client();
    assert!(stranger.get(m.url("/healthz")).send().await.is_err());
    // The server survived both.
    assert!(m.get_json("/healthz").await.is_some());

    // Redis stopped: /readyz 503 naming redis (etcd and the watch still fine); /healthz 200.
    redis.kill();
    let v = wait_ready(&m, 503, Duration::from_secs(10)).await;
    eprintln!("/readyz while Redis is down: {v}");
    assert_eq!(v["ready"], false, "{v}");
    assert_eq!(v["redis"]["ok"], false, "{v}");
    assert!(
        v["redis"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("redis")),
        "{v}"
    );
    assert_eq!(v["etcd"]["ok"], true, "{v}");
    assert_eq!(v["task_watch"]["ok"], true, "{v}");
    assert!(m.get_json("/healthz").await.is_some());
    // Redis back: 200 again.
    let back = Instant::now();
    redis.restart();
    wait_ready(&m, 200, Duration::from_secs(15)).await;
    eprintln!("ready {:?} after Redis came back", back.elapsed());

    // --tls-cert without --tls-key, or a key file that is no key: exit 2 naming the flag.
    for (flags, flag) in [
        (tls_flags[..2].to_vec(), "--tls-key"),
        (
            vec![
                tls_flags[0].clone(),
                tls_flags[1].clone(),
                tls_flags[2].clone(),
                tls_flags[1].clone(),
            ],
            "--tls-key",
        ),
    ] {
        let mut bad = Manager::spawn(opts(&shared_etcd(), &redis.url(), &ns, "bad", flags));
        let (code, log) = bad.wait_exit(Duration::from_secs(10)).await;
        assert_eq!(code, Some(2), "{log}");
        assert!(log.contains(flag), "{log}");
    }
}
