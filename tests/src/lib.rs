//! Harness for Sluice's end-to-end tests: real etcd, Redis and `sluice-manager` processes.
//!
//! # Servers
//!
//! `scripts/test.sh` starts one etcd and one Redis for the whole run and passes their addresses
//! in `SLUICE_TEST_ETCD` and `SLUICE_TEST_REDIS`; tests share them, each in its own namespace
//! ([`unique_ns`]). A test that stops, flushes or kills a server starts a private one
//! ([`RedisServer::start`], [`EtcdServer::start`]) from the binaries on `PATH`.
//! A test that needs a server and cannot get one panics: it never passes silently.
//!
//! # Binaries
//!
//! [`workspace_bin`] finds `sluice-manager` and the `loadgen` example in the target directory
//! this test binary was built into; `scripts/test.sh` builds them before the tests run.
//!
//! # Waiting
//!
//! Tests poll with deadlines ([`wait_until`]) instead of sleeping and hoping.

use std::fs::File;
use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a server may take to come up on a loaded machine.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A free TCP port on 127.0.0.1 (the OS picks; the listener is closed right away).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// A namespace no other test uses: `t<pid>x<n>`.
pub fn unique_ns(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn env_or_panic(var: &str) -> String {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => v,
        _ => panic!(
            "{var} is not set: these tests need real servers. Run them with scripts/test.sh, \
             which starts etcd and Redis and sets SLUICE_TEST_ETCD / SLUICE_TEST_REDIS."
        ),
    }
}

/// The shared etcd endpoint (`SLUICE_TEST_ETCD`), or a panic saying how to get one.
pub fn shared_etcd() -> String {
    env_or_panic("SLUICE_TEST_ETCD")
}

/// The shared Redis URL (`SLUICE_TEST_REDIS`), or a panic saying how to get one.
pub fn shared_redis() -> String {
    env_or_panic("SLUICE_TEST_REDIS")
}

/// The target directory holding this test binary (`target/debug` or `target/release`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test binary>
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary is not inside a target directory")
        .to_path_buf()
}

/// A binary of the workspace: `sluice-manager`, or `examples/loadgen`.
pub fn workspace_bin(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: build it first (scripts/test.sh runs \
         `cargo build --workspace --bins --examples`)",
        p.display()
    );
    p
}

/// Polls `probe` every `every` until it returns `Some`, or panics after `timeout` saying what
/// was awaited.
pub async fn wait_until<T, F, Fut>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut probe: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(every).await;
    }
}

/// Sends a signal to a process.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
}

/// A child process that is killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Self {
        let out = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open log");
        let err = out.try_clone().expect("dup log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}. Is it installed?"));
        Self {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    /// The process id (panics if it was killed).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("process was killed").id()
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends `sig`, then waits up to `timeout` for the exit; returns the exit code (None when
    /// killed by a signal). Panics if it does not exit in time.
    pub fn stop_with(&mut self, sig: i32, timeout: Duration) -> Option<i32> {
        let mut c = self.child.take().expect("process was killed");
        signal(c.id(), sig);
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = c.try_wait().expect("wait") {
                return st.code();
            }
            if Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!(
                    "{} did not exit within {timeout:?} of signal {sig}",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What the process has written so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!(
                "---- last lines of {} ({}) ----",
                self.name,
                self.log.display()
            );
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

/// A private Redis server on a free port (for tests that kill, flush or restart it).
#[derive(Debug)]
pub struct RedisServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: tempfile::TempDir,
    proc: Option<Proc>,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts `redis-server` without persistence and waits until it answers PING.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts `redis-server` with extra arguments (e.g. `["--cluster-enabled", "yes"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        let mut s = Self {
            port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            proc: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.restart();
        s
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port; waits until it answers PING.
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "redis already running");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra);
        let log = self.dir.path().join("redis.log");
        self.proc = Some(Proc::spawn("redis-server", cmd, log));
        let url = self.url();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
            {
                return;
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the server (data is lost: it runs without persistence).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.proc.as_ref().expect("redis not running").pid()
    }
}

/// A private etcd member on free ports, with its own data directory.
#[derive(Debug)]
pub struct EtcdServer {
    /// Client port on 127.0.0.1.
    pub client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    proc: Option<Proc>,
}

impl EtcdServer {
    /// Starts etcd and waits until it is healthy.
    pub fn start() -> Self {
        let mut s = Self {
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            proc: None,
        };
        s.restart();
        s
    }

    /// `http://127.0.0.1:<client port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// (Re)starts etcd on the same ports and data directory; waits until healthy.
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "etcd already running");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .args(["--log-level", "warn"]);
        let log = self.dir.path().join("etcd.log");
        self.proc = Some(Proc::spawn("etcd", cmd, log));
        wait_healthy_blocking(&format!("{client}/health"), "etcd");
    }

    /// SIGKILLs etcd (its data directory is kept for [`EtcdServer::restart`]).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

fn wait_healthy_blocking(url: &str, what: &str) {
    let deadline = Instant::now() + START_TIMEOUT;
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .expect("http client");
    loop {
        if let Ok(r) = client.get(url).send()
            && r.status().is_success()
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not become healthy at {url}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Settings of one `sluice-manager` replica started by [`Manager::start`].
#[derive(Debug, Clone)]
pub struct ManagerOpts {
    /// etcd endpoint(s).
    pub etcd: String,
    /// Redis URL(s).
    pub redis: String,
    /// Namespace.
    pub namespace: String,
    /// Node id.
    pub node_id: String,
    /// `--lease-ttl`.
    pub lease_ttl: String,
    /// Extra arguments.
    pub extra: Vec<String>,
}

impl ManagerOpts {
    /// Options for replica `node_id` on the given servers, lease TTL 2 s.
    pub fn new(etcd: &str, redis: &str, namespace: &str, node_id: &str) -> Self {
        Self {
            etcd: etcd.to_string(),
            redis: redis.to_string(),
            namespace: namespace.to_string(),
            node_id: node_id.to_string(),
            lease_ttl: "2s".to_string(),
            extra: Vec::new(),
        }
    }
}

/// A running `sluice-manager` replica.
#[derive(Debug)]
pub struct Manager {
    /// Its options.
    pub opts: ManagerOpts,
    /// Its HTTP address (`127.0.0.1:<port>`).
    pub addr: String,
    /// The process.
    pub proc: Proc,
    _dir: tempfile::TempDir,
}

impl Manager {
    /// Starts the replica on a free port and waits for `GET /healthz`.
    pub async fn start(opts: ManagerOpts) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(workspace_bin("sluice-manager"));
        cmd.args(["--etcd", &opts.etcd])
            .args(["--redis", &opts.redis])
            .args(["--listen", &addr])
            .args(["--namespace", &opts.namespace])
            .args(["--node-id", &opts.node_id])
            .args(["--lease-ttl", &opts.lease_ttl])
            .args(&opts.extra)
            .env(
                "RUST_LOG",
                std::env::var("SLUICE_TEST_LOG").unwrap_or_else(|_| "info".into()),
            );
        let log = dir.path().join("manager.log");
        let proc = Proc::spawn(&format!("sluice-manager {}", opts.node_id), cmd, log);
        let m = Self {
            opts,
            addr,
            proc,
            _dir: dir,
        };
        let http = http();
        let url = m.url("/healthz");
        wait_until(
            &format!("{} /healthz", m.opts.node_id),
            START_TIMEOUT,
            Duration::from_millis(50),
            || {
                let http = http.clone();
                let url = url.clone();
                async move {
                    match http.get(&url).send().await {
                        Ok(r) if r.status().is_success() => Some(()),
                        _ => None,
                    }
                }
            },
        )
        .await;
        m
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// GET `path` and parse JSON; None on any error (unreachable, non-2xx).
    pub async fn get_json(&self, path: &str) -> Option<Value> {
        let r = http().get(self.url(path)).send().await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.json().await.ok()
    }

    /// `GET /metrics` as text; None when unreachable.
    pub async fn metrics(&self) -> Option<String> {
        http()
            .get(self.url("/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()
    }

    /// The value of an unlabelled metric, if present.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let text = self.metrics().await?;
        metric_value(&text, name)
    }

    /// PUT `body` to `path`; returns (status, JSON body or Null).
    pub async fn put(&self, path: &str, body: &str) -> (u16, Value) {
        let r = http()
            .put(self.url(path))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("PUT");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// DELETE `path`; returns the status.
    pub async fn delete(&self, path: &str) -> u16 {
        http()
            .delete(self.url(path))
            .send()
            .await
            .expect("DELETE")
            .status()
            .as_u16()
    }

    /// Does this replica say it is the leader (`sluice_leader` metric is 1)?
    pub async fn says_leader(&self) -> bool {
        self.metric("sluice_leader").await == Some(1.0)
    }
}

/// Reads `name value` from Prometheus text (an unlabelled sample).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// A shared HTTP client with short timeouts (loopback only).
pub fn http() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            reqwest::Client::builder()
                .timeout(Duration::from_secs(3))
                .no_proxy()
                .build()
                .expect("http client")
        })
        .clone()
}

/// A synchronous Redis connection for assertions.
pub fn redis_conn(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
        .unwrap_or_else(|e| panic!("cannot connect to Redis at {url}: {e}"))
}
