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

pub mod pki;

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
    // target/<profile>/deps/<test binary>, or target/<profile>/<bin> (the soak program).
    let dir = exe
        .parent()
        .expect("test binary is not inside a target directory");
    match dir.file_name() {
        Some(n) if n == "deps" => dir.parent().unwrap_or(dir).to_path_buf(),
        _ => dir.to_path_buf(),
    }
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

    /// The exit code of a process that has exited (None while running or when killed by a
    /// signal).
    pub fn exit_code(&mut self) -> Option<i32> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
            .and_then(|st| st.code())
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
    /// Its port on 127.0.0.1 (the TLS port of a [`RedisServer::start_tls`] server).
    pub port: u16,
    dir: tempfile::TempDir,
    proc: Option<Proc>,
    extra: Vec<String>,
    tls: Option<RedisTlsSetup>,
}

impl RedisServer {
    /// Starts `redis-server` without persistence and waits until it answers (itself, not another server on the port).
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts `redis-server` with extra arguments (e.g. `["--cluster-enabled", "yes"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::launch(None, || extra.iter().map(|s| s.to_string()).collect())
    }

    /// Starts a server on a free port with the arguments `extra()` makes — again, on another
    /// port and with `extra()` made again (a cluster bus port it names), when a port was
    /// taken between being picked and being bound (another process's ephemeral port: a CI run
    /// once failed so).
    fn launch(tls: Option<RedisTlsSetup>, extra: impl Fn() -> Vec<String>) -> Self {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut s = Self {
                port: free_port(),
                dir: tempfile::tempdir().expect("tempdir"),
                proc: None,
                extra: extra(),
                tls: tls.clone(),
            };
            match s.try_restart() {
                Ok(()) => return s,
                Err(log) if attempt < 5 && log.contains("Address already in use") => {}
                Err(log) => panic!("redis-server did not start:\n{log}"),
            }
        }
    }

    /// `redis://127.0.0.1:<port>` (`rediss://` for a TLS server).
    pub fn url(&self) -> String {
        match self.tls {
            None => format!("redis://127.0.0.1:{}", self.port),
            Some(_) => format!("rediss://127.0.0.1:{}", self.port),
        }
    }

    /// (Re)starts the server on the same port; waits until it answers (itself, not another server on the port).
    pub fn restart(&mut self) {
        if let Err(log) = self.try_restart() {
            panic!("redis-server did not start:\n{log}");
        }
    }

    /// [`Self::restart`], or the server's log when it did not start (stopped again).
    fn try_restart(&mut self) -> Result<(), String> {
        assert!(self.proc.is_none(), "redis already running");
        let mut cmd = Command::new("redis-server");
        match &self.tls {
            None => {
                cmd.args(["--port", &self.port.to_string()]);
            }
            Some(t) => {
                cmd.args(["--port", "0", "--tls-port", &self.port.to_string()])
                    .arg("--tls-cert-file")
                    .arg(&t.pki.server_cert)
                    .arg("--tls-key-file")
                    .arg(&t.pki.server_key)
                    .arg("--tls-ca-cert-file")
                    .arg(&t.pki.ca_cert)
                    .args(["--tls-auth-clients", "yes"]);
                if let Some(acl) = &t.acl_file {
                    cmd.arg("--aclfile").arg(acl);
                }
            }
        }
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra);
        let log = self.dir.path().join("redis.log");
        self.proc = Some(Proc::spawn("redis-server", cmd, log));
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match self
                .try_admin_conn(Duration::from_millis(200))
                .and_then(|mut c| redis::cmd("INFO").arg("server").query::<String>(&mut c))
            {
                // Ours, not another server that won the port (ours then exits: "Address
                // already in use", handled below).
                Ok(info) if info_pid(&info) == self.proc.as_ref().map(Proc::pid) => return Ok(()),
                Ok(_) => {}
                // Up, with `--requirepass`: the password goes in the client's URL.
                Err(e) if e.to_string().contains("NOAUTH") => return Ok(()),
                Err(_) => {}
            }
            let log = self.log();
            if Instant::now() >= deadline || log.contains("Address already in use") {
                self.kill();
                return Err(log);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn try_admin_conn(&self, timeout: Duration) -> redis::RedisResult<redis::Connection> {
        match &self.tls {
            None => redis::Client::open(self.url().as_str())?.get_connection_with_timeout(timeout),
            Some(t) => t.client(&self.url())?.get_connection_with_timeout(timeout),
        }
    }

    /// A synchronous connection with full rights (over mutual TLS as the ACL file's admin user
    /// for a [`RedisServer::start_tls`] server), for setting up and asserting.
    pub fn admin_conn(&self) -> redis::Connection {
        self.try_admin_conn(Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("cannot connect to Redis at {}: {e}", self.url()))
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

// ─── TLS Redis and test certificates (branch tls-redis; keep this section self-contained) ───

/// A CA, a server certificate for 127.0.0.1 (IP SAN) and a client certificate, made with
/// [`pki::TestCa`] (`openssl`) in a temporary directory.
#[derive(Debug)]
pub struct TestPki {
    /// The CA (its directory holds every file).
    pub ca: pki::TestCa,
    /// The CA certificate (PEM).
    pub ca_cert: PathBuf,
    /// The server certificate, signed by the CA, for IP 127.0.0.1.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate, signed by the CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
}

impl TestPki {
    /// Generates the CA (named `cn`) and the certificates. The server certificate may also
    /// authenticate a client: Redis Cluster nodes present it on the TLS cluster bus.
    pub fn generate(cn: &str) -> Self {
        let ca = pki::TestCa::new(cn);
        let server = ca.issue_for("server", &["IP:127.0.0.1"]);
        let client = ca.issue_for("client", &[]);
        Self {
            ca_cert: ca.cert.clone(),
            server_cert: server.cert,
            server_key: server.key,
            client_cert: client.cert,
            client_key: client.key,
            ca,
        }
    }
}

/// How a [`RedisServer::start_tls`] server runs: its certificates, its ACL file and the admin
/// user of that file the harness logs in as.
#[derive(Debug, Clone)]
struct RedisTlsSetup {
    pki: std::sync::Arc<TestPki>,
    acl_file: Option<PathBuf>,
    admin: Option<(String, String)>,
}

impl RedisTlsSetup {
    fn client(&self, url: &str) -> redis::RedisResult<redis::Client> {
        sluice_protocol::tls::install_provider();
        let mut info = redis::IntoConnectionInfo::into_connection_info(url)?;
        if let Some((u, p)) = &self.admin {
            let rs = info
                .redis_settings()
                .clone()
                .set_username(u)
                .set_password(p);
            info = info.set_redis_settings(rs);
        }
        let read = |p: &Path| std::fs::read(p).expect("read test certificate");
        redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: read(&self.pki.client_cert),
                    client_key: read(&self.pki.client_key),
                }),
                root_cert: Some(read(&self.pki.ca_cert)),
            },
        )
    }
}

impl RedisServer {
    /// Starts `redis-server` with TLS only (`--port 0 --tls-port <port>`), the certificates
    /// of `pki` and client certificates required (`--tls-auth-clients yes`). With `acl_file`,
    /// the server loads it (`--aclfile`) and the harness logs in as `admin` (a user of that
    /// file with every right). Waits until it answers PING over TLS.
    pub fn start_tls(
        pki: std::sync::Arc<TestPki>,
        acl_file: Option<PathBuf>,
        admin: Option<(String, String)>,
    ) -> Self {
        Self::start_tls_with(pki, acl_file, admin, &[])
    }

    /// [`RedisServer::start_tls`] with extra arguments.
    pub fn start_tls_with(
        pki: std::sync::Arc<TestPki>,
        acl_file: Option<PathBuf>,
        admin: Option<(String, String)>,
        extra: &[&str],
    ) -> Self {
        Self::launch(
            Some(RedisTlsSetup {
                pki,
                acl_file,
                admin,
            }),
            || extra.iter().map(|s| s.to_string()).collect(),
        )
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
    /// TLS of the client port ([`EtcdServer::start_tls`]).
    pub tls: Option<EtcdTls>,
    extra: Vec<String>,
}

/// The TLS setup of a private etcd: its server certificate, the CA it trusts for client
/// certificates (`--client-cert-auth`), and a client certificate of that CA (the harness's
/// health checks and admin client use it).
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// CA file (trusted by the server for client certificates, and by clients for the server).
    pub ca: PathBuf,
    /// Server certificate for 127.0.0.1.
    pub server: pki::CertPair,
    /// A client certificate.
    pub client: pki::CertPair,
}

impl EtcdServer {
    /// Starts etcd and waits until it is healthy.
    pub fn start() -> Self {
        Self::start_with(None, &[])
    }

    /// Starts etcd serving clients over TLS only (https://, client certificates required),
    /// with extra arguments (e.g. `["--auth-token-ttl", "3"]`); waits until it is healthy.
    pub fn start_tls(tls: EtcdTls, extra: &[&str]) -> Self {
        Self::start_with(Some(tls), extra)
    }

    fn start_with(tls: Option<EtcdTls>, extra: &[&str]) -> Self {
        let mut s = Self {
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            proc: None,
            tls,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.restart();
        s
    }

    /// `http://127.0.0.1:<client port>` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// An etcd client of this server (TLS with the harness's client certificate when the
    /// server has TLS), authenticated as `user` when given.
    pub async fn client(&self, user: Option<(&str, &str)>) -> etcd_client::Client {
        let mut o = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5));
        if let Some(t) = &self.tls {
            let read = |p: &Path| std::fs::read(p).expect("read pem");
            o = o.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(read(&t.ca)))
                    .identity(etcd_client::Identity::from_pem(
                        read(&t.client.cert),
                        read(&t.client.key),
                    )),
            );
        }
        if let Some((u, p)) = user {
            o = o.with_user(u, p);
        }
        etcd_client::Client::connect([self.endpoint()], Some(o))
            .await
            .unwrap_or_else(|e| panic!("etcd client of {}: {e}", self.endpoint()))
    }

    /// Turns etcd authentication on: user `root` (password `root_password`, role `root`) and
    /// user `user` (password `password`) with role `user`, allowed to read and write the keys
    /// under `/<namespace>/` only: the least privilege a manager needs.
    pub async fn enable_auth(
        &self,
        root_password: &str,
        user: &str,
        password: &str,
        namespace: &str,
    ) {
        let mut c = self.client(None).await;
        c.role_add("root").await.expect("role add root");
        c.user_add("root", root_password, None)
            .await
            .expect("user add root");
        c.user_grant_role("root", "root").await.expect("grant root");
        c.role_add(user).await.expect("role add");
        let prefix = format!("/{namespace}/");
        let mut end = prefix.clone().into_bytes();
        *end.last_mut().expect("prefix") += 1;
        c.role_grant_permission(
            user,
            etcd_client::Permission::read_write(prefix).with_range_end(end),
        )
        .await
        .expect("grant permission");
        c.user_add(user, password, None).await.expect("user add");
        c.user_grant_role(user, user).await.expect("grant role");
        c.auth_enable().await.expect("auth enable");
    }

    /// (Re)starts etcd on the same ports and data directory; waits until healthy.
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "etcd already running");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut tls_args: Vec<std::ffi::OsString> = Vec::new();
        if let Some(t) = &self.tls {
            for (flag, path) in [
                ("--cert-file", &t.server.cert),
                ("--key-file", &t.server.key),
                ("--trusted-ca-file", &t.ca),
            ] {
                tls_args.push(flag.into());
                tls_args.push(path.into());
            }
            tls_args.push("--client-cert-auth".into());
        }
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .args(["--log-level", "warn"])
            .args(&tls_args)
            .args(&self.extra);
        let log = self.dir.path().join("etcd.log");
        self.proc = Some(Proc::spawn("etcd", cmd, log));
        match &self.tls {
            None => wait_healthy_blocking(&format!("{client}/health"), "etcd"),
            Some(t) => wait_tls_healthy_blocking(&format!("{client}/health"), t),
        }
    }

    /// SIGKILLs etcd (its data directory is kept for [`EtcdServer::restart`]).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

/// Polls `url` with `curl` (TLS, the harness's client certificate) until it answers 200.
fn wait_tls_healthy_blocking(url: &str, t: &EtcdTls) {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let ok = Command::new("curl")
            .args(["-sf", "--max-time", "2", "--cacert"])
            .arg(&t.ca)
            .arg("--cert")
            .arg(&t.client.cert)
            .arg("--key")
            .arg(&t.client.key)
            .arg(url)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "etcd (TLS) did not become healthy at {url}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn wait_healthy_blocking(url: &str, what: &str) {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if http_get_blocking(url).is_some_and(|(status, _)| status == 200) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not become healthy at {url}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A minimal blocking HTTP/1.0 GET on loopback (usable inside or outside a runtime): status
/// and body, or None when the server cannot be reached.
pub fn http_get_blocking(url: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let addr: std::net::SocketAddr = host.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
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
    /// Extra environment variables (`SLUICE_<FLAG>` settings; a `RUST_LOG` here wins over the
    /// harness's).
    pub env: Vec<(String, String)>,
    /// `--webhook-allow-private` (default on: the tests' webhook receivers listen on loopback;
    /// tests of the default refusal turn it off).
    pub webhook_allow_private: bool,
    /// Bearer token the helper methods ([`Manager::put`], [`Manager::get_json`], …) send.
    pub auth: Option<String>,
    /// Set for a replica serving HTTPS (`--tls-cert` in `extra`): the harness reaches it over
    /// `https://` with this client (e.g. [`pki::TestCa::https_client`]).
    pub https_client: Option<reqwest::Client>,
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
            env: Vec::new(),
            webhook_allow_private: true,
            auth: None,
            https_client: None,
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
        let mut m = Self::spawn(opts);
        let url = m.url("/healthz");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = m.client().get(&url).send().await
                && r.status().is_success()
            {
                return m;
            }
            assert!(
                m.proc.is_running(),
                "{} exited at start-up:\n{}",
                m.opts.node_id,
                m.proc.log()
            );
            assert!(
                Instant::now() < deadline,
                "{} did not answer /healthz within {START_TIMEOUT:?}",
                m.opts.node_id
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a replica that must refuse to run: waits (up to `timeout`) for it to exit and
    /// returns its exit code and log. Panics if it is still running then.
    pub async fn start_expecting_exit(
        opts: ManagerOpts,
        timeout: Duration,
    ) -> (Option<i32>, String) {
        Self::spawn(opts).wait_exit(timeout).await
    }

    /// Starts the replica on a free port without waiting for anything (for tests of
    /// start-up failures: see [`Manager::wait_exit`]).
    pub fn spawn(opts: ManagerOpts) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(workspace_bin("sluice-manager"));
        cmd.args(["--etcd", &opts.etcd])
            .args(["--redis", &opts.redis])
            .args(["--listen", &addr])
            .args(["--namespace", &opts.namespace])
            .args(["--node-id", &opts.node_id])
            .args(&opts.extra)
            .env(
                "RUST_LOG",
                std::env::var("SLUICE_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(opts.env.iter().map(|(k, v)| (k, v)));
        if !opts.extra.iter().any(|a| a == "--lease-ttl") {
            cmd.args(["--lease-ttl", &opts.lease_ttl]);
        }
        if opts.webhook_allow_private {
            cmd.arg("--webhook-allow-private");
        }
        let log = dir.path().join("manager.log");
        let proc = Proc::spawn(&format!("sluice-manager {}", opts.node_id), cmd, log);
        Self {
            opts,
            addr,
            proc,
            _dir: dir,
        }
    }

    /// Waits up to `timeout` for the process to exit by itself; returns its exit code and its
    /// log. Panics if it is still running then.
    pub async fn wait_exit(&mut self, timeout: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.proc.is_running() {
                let code = self.proc.exit_code();
                return (code, self.proc.log());
            }
            assert!(
                Instant::now() < deadline,
                "{} still runs after {timeout:?}:\n{}",
                self.opts.node_id,
                self.proc.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `http://<addr><path>` (`https://` for a replica started with `https_client`).
    pub fn url(&self, path: &str) -> String {
        let scheme = if self.opts.https_client.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}{path}", self.addr)
    }

    /// The HTTP client this replica is reached with.
    pub fn client(&self) -> reqwest::Client {
        self.opts.https_client.clone().unwrap_or_else(http)
    }

    /// A request to `path` with the [`ManagerOpts::auth`] token, if any.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.client().request(method, self.url(path));
        match &self.opts.auth {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// GET `path` and parse JSON; None on any error (unreachable, non-2xx).
    pub async fn get_json(&self, path: &str) -> Option<Value> {
        let r = self.request(reqwest::Method::GET, path).send().await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.json().await.ok()
    }

    /// `GET /metrics` as text; None when unreachable.
    pub async fn metrics(&self) -> Option<String> {
        self.client()
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
        let r = self
            .request(reqwest::Method::PUT, path)
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
        self.request(reqwest::Method::DELETE, path)
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

    /// The effective threshold of `task`'s current slice (`status.effective_threshold`), or
    /// None while its slice is not written (or the replica cannot be reached).
    pub async fn current_threshold(&self, task: &str) -> Option<i64> {
        self.get_json(&format!("/api/v1/tasks/{task}")).await?["status"]["effective_threshold"]
            .as_i64()
    }

    /// Waits (up to 5 s) until `task`'s current slice is written; returns its threshold.
    pub async fn wait_rolled(&self, task: &str) -> i64 {
        let what = format!("slices of {task}");
        wait_until(
            &what,
            Duration::from_secs(5),
            Duration::from_millis(50),
            || self.current_threshold(task),
        )
        .await
    }

    /// Waits (up to 15 s) until this replica says it is the leader.
    pub async fn wait_leader(&self) {
        let what = format!("{} to lead", self.opts.node_id);
        wait_until(
            &what,
            Duration::from_secs(15),
            Duration::from_millis(50),
            || async { self.says_leader().await.then_some(()) },
        )
        .await
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
            // reqwest is built without a default rustls provider: ring, as everywhere.
            sluice_protocol::tls::install_provider();
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

/// `CLIENT PAUSE ms WRITE` over `conn`: Redis holds every client's write commands (scripts
/// included) for `ms` milliseconds, answering them after; reads go on.
pub fn pause_writes(conn: &mut redis::Connection, ms: u64) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("WRITE")
        .query(conn)
        .unwrap_or_else(|e| panic!("CLIENT PAUSE {ms} WRITE: {e}"));
}

/// Starts `n` replicas named `n0`, `n1`, … on the given servers, each with `extra` flags.
pub async fn start_replicas(
    etcd: &str,
    redis: &str,
    ns: &str,
    n: usize,
    extra: &[&str],
) -> Vec<Manager> {
    let mut v = Vec::new();
    for i in 0..n {
        let mut o = ManagerOpts::new(etcd, redis, ns, &format!("n{i}"));
        o.extra = extra.iter().map(|s| s.to_string()).collect();
        v.push(Manager::start(o).await);
    }
    v
}

/// The leader as replica `m` reports it: `(node_id, term)`; None when there is none or `m`
/// cannot be reached.
pub async fn leader_seen_by(m: &Manager) -> Option<(String, i64)> {
    let v = m.get_json("/api/v1/cluster").await?;
    let l = v.get("leader")?;
    Some((
        l.get("node_id")?.as_str()?.to_string(),
        l.get("term")?.as_i64()?,
    ))
}

/// Waits until every replica in `ms` agrees on one leader; returns its index and term.
pub async fn wait_for_leader(ms: &[&Manager], timeout: Duration) -> (usize, i64) {
    wait_until(
        "an agreed leader",
        timeout,
        Duration::from_millis(50),
        || async {
            let mut seen = None;
            for m in ms {
                let l = leader_seen_by(m).await?;
                if seen.as_ref().is_some_and(|s| s != &l) {
                    return None;
                }
                seen = Some(l);
            }
            let (id, term) = seen?;
            let idx = ms.iter().position(|m| m.opts.node_id == id)?;
            // The winner must also know it: it has confirmed its lease.
            ms[idx].says_leader().await.then_some((idx, term))
        },
    )
    .await
}

/// Reads `cap` of every slice of `task` starting in `[from_ms, until_ms)`: `(start, cap)`, with
/// `None` for a missing slice.
pub fn slice_caps(
    conn: &mut redis::Connection,
    ns: &str,
    task: &str,
    slice_ms: u64,
    from_ms: i64,
    until_ms: i64,
) -> Vec<(i64, Option<u64>)> {
    let keys = sluice_protocol::Keys::new(ns).expect("namespace");
    let starts: Vec<i64> = sluice_protocol::slice::starts(from_ms, until_ms, slice_ms).collect();
    let mut pipe = redis::pipe();
    for s in &starts {
        pipe.hget(keys.slice(task, *s), sluice_protocol::slice_field::CAP);
    }
    let caps: Vec<Option<u64>> = pipe.query(conn).expect("read slices");
    starts.into_iter().zip(caps).collect()
}

/// Now, Unix ms.
pub fn now_ms() -> i64 {
    sluice_protocol::unix_ms()
}

const CLUSTER_ARGS: [&str; 4] = ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"];

/// A cluster node's arguments, each call with a new free bus port.
fn cluster_args(more: &'static [&'static str]) -> impl Fn() -> Vec<String> {
    move || {
        let mut args: Vec<String> = CLUSTER_ARGS
            .iter()
            .chain(more)
            .map(|s| s.to_string())
            .collect();
        args.extend(["--cluster-port".to_string(), free_port().to_string()]);
        args
    }
}

/// `process_id` of an `INFO server` answer.
fn info_pid(info: &str) -> Option<u32> {
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|v| v.trim().parse().ok())
}

/// A private Redis Cluster of `n` primaries (no replicas) on free ports.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `n` (≥ 3) cluster-enabled servers, joins them with `redis-cli --cluster create`
    /// and waits until every node reports `cluster_state:ok`.
    pub fn start(n: usize) -> Self {
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| {
                // The bus port named (free, on loopback): Redis's default, port + 10,000, may
                // be taken by another test's server or lie past 65,535. Picked again with the
                // client port when either was taken meanwhile.
                RedisServer::launch(None, cluster_args(&[]))
            })
            .collect();
        Self::join(nodes, &[], &[])
    }

    /// Like [`RedisCluster::start`] with TLS only (`tls-cluster yes`: the cluster bus too) and
    /// client certificates required, as [`RedisServer::start_tls`]; `redis-cli` joins them
    /// over TLS as the `admin` user of `acl_file`.
    pub fn start_tls(
        n: usize,
        pki: std::sync::Arc<TestPki>,
        acl_file: Option<PathBuf>,
        admin: Option<(String, String)>,
    ) -> Self {
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| {
                RedisServer::launch(
                    Some(RedisTlsSetup {
                        pki: pki.clone(),
                        acl_file: acl_file.clone(),
                        admin: admin.clone(),
                    }),
                    cluster_args(&["--tls-cluster", "yes"]),
                )
            })
            .collect();
        let p = |f: &Path| f.to_str().expect("utf-8 path").to_string();
        let mut cli = vec![
            "--tls".to_string(),
            "--cacert".into(),
            p(&pki.ca_cert),
            "--cert".into(),
            p(&pki.client_cert),
            "--key".into(),
            p(&pki.client_key),
        ];
        let mut env = Vec::new();
        if let Some((user, pw)) = admin {
            cli.extend(["--user".into(), user]);
            // The password through the environment, not the command line.
            env.push(("REDISCLI_AUTH".to_string(), pw));
        }
        Self::join(nodes, &cli, &env)
    }

    fn join(nodes: Vec<RedisServer>, cli: &[String], env: &[(String, String)]) -> Self {
        let addrs: Vec<String> = nodes
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        // Bounded: redis-cli waits for the cluster to join forever if the bus cannot connect.
        let out = Command::new("timeout")
            .args(["60", "redis-cli"])
            .args(cli)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli (package redis-tools) is needed for the cluster test");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + START_TIMEOUT;
        for s in &nodes {
            loop {
                let mut c = s.admin_conn();
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut c)
                    .unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster did not become ok: {info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self { nodes }
    }

    /// The `--redis` value for the cluster: every node URL, comma-separated.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A webhook receiver on 127.0.0.1: records the JSON body of every POST and answers 200
/// (or `fail_first` times 500 first, to exercise retries; or always a redirect; over plain
/// HTTP or HTTPS).
pub struct WebhookReceiver {
    /// `http://127.0.0.1:<port>/hook` (`https://` for [`WebhookReceiver::start_tls`]). Any path
    /// is accepted.
    pub url: String,
    received: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
    requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// How a [`WebhookReceiver`] answers.
#[derive(Debug, Clone)]
enum Answer {
    /// 500 for the first n requests, then 200.
    FailFirst(usize),
    /// Always `302 Found` to this location.
    Redirect(String),
}

impl WebhookReceiver {
    /// Starts the receiver; the first `fail_first` requests get a 500.
    pub async fn start(fail_first: usize) -> Self {
        Self::start_with(Answer::FailFirst(fail_first), None).await
    }

    /// A receiver that answers every POST with `302 Found` to `location` (and records nothing).
    pub async fn redirecting(location: &str) -> Self {
        Self::start_with(Answer::Redirect(location.to_string()), None).await
    }

    /// An HTTPS receiver with this certificate chain and key (PEM files), answering 200.
    pub async fn start_tls(cert: &Path, key: &Path) -> Self {
        sluice_protocol::tls::install_provider();
        let certs = sluice_protocol::tls::load_certs(cert).expect("receiver certificate");
        let key = sluice_protocol::tls::load_key(key).expect("receiver key");
        let cfg = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("receiver TLS config");
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg));
        Self::start_with(Answer::FailFirst(0), Some(acceptor)).await
    }

    async fn start_with(answer: Answer, tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}/hook", listener.local_addr().expect("addr"));
        let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let failures = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(match &answer {
            Answer::FailFirst(n) => *n,
            Answer::Redirect(_) => 0,
        }));
        let (store, count) = (received.clone(), requests.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                let (store, count, failures, answer) = (
                    store.clone(),
                    count.clone(),
                    failures.clone(),
                    answer.clone(),
                );
                let tls = tls.clone();
                tokio::spawn(async move {
                    match tls {
                        None => serve_hook(sock, store, count, failures, answer).await,
                        Some(acceptor) => {
                            if let Ok(s) = acceptor.accept(sock).await {
                                serve_hook(s, store, count, failures, answer).await;
                            }
                        }
                    }
                });
            }
        });
        Self {
            url,
            received,
            requests,
            task,
        }
    }

    /// Every body received (and answered 200) so far.
    pub fn received(&self) -> Vec<Value> {
        self.received.lock().expect("lock").clone()
    }

    /// Requests seen so far, whatever the answer.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// One request of a [`WebhookReceiver`] connection.
async fn serve_hook<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut sock: S,
    store: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
    count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    failures: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    answer: Answer,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    // Read headers, then Content-Length bytes of body.
    let body = loop {
        let Ok(n) = sock.read(&mut chunk).await else {
            return;
        };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if body.len() >= len {
                break body[..len].to_string();
            }
        }
    };
    count.fetch_add(1, Ordering::SeqCst);
    let head = match answer {
        Answer::Redirect(to) => format!("HTTP/1.1 302 Found\r\nlocation: {to}\r\n"),
        Answer::FailFirst(_) => {
            let fail = failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |f| f.checked_sub(1))
                .is_ok();
            if !fail && let Ok(v) = serde_json::from_str::<Value>(&body) {
                store.lock().expect("lock").push(v);
            }
            if fail {
                "HTTP/1.1 500 Internal Server Error\r\n".to_string()
            } else {
                "HTTP/1.1 200 OK\r\n".to_string()
            }
        }
    };
    let _ = sock
        .write_all(format!("{head}content-length: 0\r\nconnection: close\r\n\r\n").as_bytes())
        .await;
    let _ = sock.shutdown().await;
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The pinned arguments of a `loadgen` run, then `extra` flags (`["--rate", "500"]`, …).
pub fn loadgen_args(
    redis: &str,
    namespace: &str,
    task: &str,
    host_id: &str,
    procs: u32,
    duration_ms: u64,
    extra: &[&str],
) -> Vec<String> {
    let mut v: Vec<String> = [
        "--redis",
        redis,
        "--namespace",
        namespace,
        "--task",
        task,
        "--host-id",
        host_id,
        "--procs",
        &procs.to_string(),
        "--duration-ms",
        &duration_ms.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// A running `loadgen` example (one simulated host), see `worker-sdk/examples/loadgen.rs`.
#[derive(Debug)]
pub struct Loadgen {
    /// The process.
    pub proc: Proc,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

impl Loadgen {
    /// Starts `loadgen` with `args` (everything after the binary name); stdout goes to a file
    /// read by [`Loadgen::wait_json`], stderr to the process log.
    pub fn spawn(args: &[String]) -> Self {
        Self::spawn_under(&[], args)
    }

    /// Like [`Loadgen::spawn`], run under a wrapper command, e.g. `["faketime", "-f", "+1.5s"]`
    /// (the re-executed children inherit the wrapper's environment, so they share its clock).
    pub fn spawn_under(wrapper: &[&str], args: &[String]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("stdout.json");
        let log = dir.path().join("loadgen.log");
        let mut cmd = match wrapper.split_first() {
            None => Command::new(workspace_bin("examples/loadgen")),
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(workspace_bin("examples/loadgen"));
                c
            }
        };
        cmd.args(args).env(
            "RUST_LOG",
            std::env::var("SLUICE_TEST_LOG").unwrap_or_else(|_| "sluice=info".into()),
        );
        let stdout = File::create(&out).expect("create stdout file");
        let errlog = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(errlog)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start loadgen: {e}"));
        Self {
            proc: Proc {
                name: "loadgen".into(),
                child: Some(child),
                log,
            },
            out,
            _dir: dir,
        }
    }

    /// Waits (polling, at most `timeout`) for the process to exit 0 and returns its one JSON
    /// line. Panics with the log tail otherwise.
    pub async fn wait_json(&mut self, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.proc.child.as_mut().expect("loadgen was killed");
            if let Some(st) = child.try_wait().expect("wait loadgen") {
                assert!(st.success(), "loadgen failed ({st}):\n{}", self.proc.log());
                let text = std::fs::read_to_string(&self.out).expect("read loadgen stdout");
                let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
                assert_eq!(lines.len(), 1, "loadgen must print one line, got {text:?}");
                return serde_json::from_str(lines[0])
                    .unwrap_or_else(|e| panic!("bad loadgen JSON {:?}: {e}", lines[0]));
            }
            assert!(
                Instant::now() < deadline,
                "loadgen did not finish within {timeout:?}:\n{}",
                self.proc.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Removes the segments of the given `(namespace, host_id)` pairs when dropped (also when the
/// test fails), so runs do not leave files in `/dev/shm`.
#[derive(Debug, Default)]
pub struct SegmentGuard(pub Vec<(String, String)>);

impl Drop for SegmentGuard {
    fn drop(&mut self) {
        for (ns, host) in &self.0 {
            remove_segment(ns, host);
        }
    }
}

/// Removes the shared memory segment (and its lock file) of `namespace` + `host_id` in
/// `/dev/shm`, as the SDK names it.
pub fn remove_segment(namespace: &str, host_id: &str) {
    let path = sluice::shm::Segment::path_for(Path::new("/dev/shm"), namespace, host_id);
    let _ = std::fs::remove_file(&path);
    for suffix in [".lock", ".keys", ".keys.lock"] {
        let mut p = path.clone().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

/// Per key, per bucket `(admitted, rejected)` of a loadgen report's `keys` (keyed tasks).
pub fn loadgen_key_buckets(
    report: &Value,
) -> std::collections::BTreeMap<String, std::collections::BTreeMap<i64, (u64, u64)>> {
    let mut out = std::collections::BTreeMap::new();
    if let Some(keys) = report["keys"].as_object() {
        for (k, b) in keys {
            let e: &mut std::collections::BTreeMap<i64, (u64, u64)> =
                out.entry(k.clone()).or_default();
            for (s, v) in b.as_object().into_iter().flatten() {
                let x = e.entry(s.parse().expect("bucket key")).or_default();
                x.0 += v[0].as_u64().unwrap_or(0);
                x.1 += v[1].as_u64().unwrap_or(0);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// SDK lifecycle helpers (issue 9)
// ---------------------------------------------------------------------------------------------

/// Runs one PULL of `want` from the slice of `task` starting at `start_ms` (slices of
/// `slice_ms`), as a test host with a fresh request id.
pub async fn pull_once<C: redis::aio::ConnectionLike>(
    conn: &mut C,
    keys: &sluice_protocol::Keys,
    task: &str,
    start_ms: i64,
    slice_ms: u64,
    want: u64,
) -> redis::RedisResult<sluice_protocol::scripts::PullReply> {
    static N: AtomicU32 = AtomicU32::new(0);
    let id = format!(
        "test.{}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let req = sluice_protocol::scripts::PullRequest {
        task,
        start_ms,
        slice_ms,
        want,
        host_id: "test-host",
        request_id: &id,
        counters: None,
    };
    sluice_protocol::scripts::pull(conn, keys, &req).await
}

/// Per-bucket `(admitted, rejected)` of a loadgen report, by bucket start (ms).
pub fn loadgen_buckets(report: &Value) -> std::collections::BTreeMap<i64, (u64, u64)> {
    report["buckets"]
        .as_object()
        .expect("buckets")
        .iter()
        .map(|(k, v)| {
            (
                k.parse().expect("bucket key"),
                (v[0].as_u64().unwrap_or(0), v[1].as_u64().unwrap_or(0)),
            )
        })
        .collect()
}

/// Waits (up to `timeout`) until the log of `p` contains `needle`.
pub async fn wait_for_log(p: &Proc, needle: &str, timeout: Duration) {
    let what = format!("{needle:?} in the log of {}", p.name);
    wait_until(&what, timeout, Duration::from_millis(10), || {
        let ok = p.log().contains(needle);
        async move { ok.then_some(()) }
    })
    .await
}

/// SDK settings for host `host_id` of namespace `namespace` on `redis`.
pub fn sdk_config(redis: &str, namespace: &str, host_id: &str) -> sluice::Config {
    let mut cfg = sluice::Config::new(redis);
    cfg.namespace = namespace.to_string();
    cfg.host_id = host_id.to_string();
    cfg
}

// ───────────────────────── lifecycle helpers (manager lifecycle tests) ─────────────────────────

/// Standard base64 (RFC 4648, padded), for the etcd HTTP gateway.
pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= c.len() {
                out.push(A[(n >> shift & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `PUT key = value` through etcd's HTTP gateway (`POST /v3/kv/put`), as an operator writing
/// into etcd by hand would; returns the response header (`cluster_id`, `revision`).
pub async fn etcd_put(endpoint: &str, key: &str, value: &str) -> Value {
    let body =
        serde_json::json!({"key": base64(key.as_bytes()), "value": base64(value.as_bytes())});
    let r = http()
        .post(format!("{endpoint}/v3/kv/put"))
        .body(body.to_string())
        .send()
        .await
        .unwrap_or_else(|e| panic!("etcd put {key} at {endpoint}: {e}"));
    assert!(r.status().is_success(), "etcd put {key}: {}", r.status());
    let v: Value = r.json().await.expect("etcd put reply");
    v["header"].clone()
}

/// etcd's cluster id (decimal, as the gateway prints it) and current revision.
pub async fn etcd_identity(endpoint: &str) -> (String, i64) {
    let r = http()
        .post(format!("{endpoint}/v3/kv/range"))
        .body(serde_json::json!({"key": base64(b"/"), "count_only": true}).to_string())
        .send()
        .await
        .unwrap_or_else(|e| panic!("etcd range at {endpoint}: {e}"));
    let v: Value = r.json().await.expect("etcd range reply");
    let h = &v["header"];
    (
        h["cluster_id"].as_str().expect("cluster_id").to_string(),
        h["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .expect("revision"),
    )
}

/// Makes `n` revisions in etcd (puts of scratch keys, 8 in flight), so terms of managers
/// elected afterwards are large.
pub async fn etcd_burn_revisions(endpoint: &str, n: usize) {
    let mut set = tokio::task::JoinSet::new();
    for w in 0..8 {
        let endpoint = endpoint.to_string();
        let count = n / 8 + usize::from(w < n % 8);
        set.spawn(async move {
            for i in 0..count {
                etcd_put(&endpoint, &format!("/scratch/{w}"), &i.to_string()).await;
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.expect("etcd put task");
    }
}

impl EtcdServer {
    /// Rebuilds etcd as an operator restoring a lost member would: kill it, wipe its data
    /// directory, start it again with the same configuration. etcd derives the cluster id from
    /// the configuration, so it is the same cluster id with revisions starting again at 1.
    pub fn rebuild(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(self.dir.path().join("data"));
        self.restart();
    }
}

impl Manager {
    /// The alerts this replica serves (`GET /api/v1/alerts`), newest first; empty when it
    /// cannot be reached.
    pub async fn alerts(&self) -> Vec<Value> {
        self.get_json("/api/v1/alerts?limit=1000")
            .await
            .and_then(|v| v["alerts"].as_array().cloned())
            .unwrap_or_default()
    }

    /// How many lines of this replica's log contain `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.proc
            .log()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }
}

/// The fields of `NS:{T}:meta`.
pub fn meta_fields(
    conn: &mut redis::Connection,
    ns: &str,
    task: &str,
) -> std::collections::HashMap<String, String> {
    let keys = sluice_protocol::Keys::new(ns).expect("namespace");
    redis::cmd("HGETALL")
        .arg(keys.meta(task))
        .query(conn)
        .expect("read meta")
}

/// Waits until every slice of `task` from now to `ahead_ms` later holds `cap`.
pub async fn wait_caps(
    conn: &mut redis::Connection,
    ns: &str,
    task: &str,
    slice_ms: u64,
    ahead_ms: i64,
    cap: u64,
    timeout: Duration,
) {
    let what = format!("every slice of {task} at {cap}");
    wait_until(&what, timeout, Duration::from_millis(50), || {
        let now = now_ms();
        let ok = slice_caps(conn, ns, task, slice_ms, now, now + ahead_ms)
            .iter()
            .all(|(_, c)| *c == Some(cap));
        async move { ok.then_some(()) }
    })
    .await
}

// ─── Processes, loadgen signals and the soak (branch `soak`; keep this section self-contained) ───

/// The pids of the children of `pid` that have not exited (zombies excluded), from `/proc`.
pub fn child_pids(pid: u32) -> Vec<u32> {
    proc_stats()
        .filter(|s| s.ppid == pid && s.state != 'Z')
        .map(|s| s.pid)
        .collect()
}

/// True when `pid` does not run any more: no such process, or a zombie not reaped yet.
pub fn process_gone(pid: u32) -> bool {
    proc_stat(pid).is_none_or(|s| s.state == 'Z' || s.state == 'X')
}

/// The pids of live processes (zombies excluded) whose command line contains `needle`,
/// other than this process.
pub fn pids_with_cmdline(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    proc_stats()
        .filter(|s| s.pid != me && s.state != 'Z')
        .filter(|s| {
            std::fs::read(format!("/proc/{}/cmdline", s.pid)).is_ok_and(|c| {
                String::from_utf8_lossy(&c)
                    .replace('\0', " ")
                    .contains(needle)
            })
        })
        .map(|s| s.pid)
        .collect()
}

/// One line of `/proc/<pid>/stat`, the fields the helpers above need.
#[derive(Debug, Clone, Copy)]
struct ProcStat {
    pid: u32,
    state: char,
    ppid: u32,
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`; comm may contain spaces and parentheses: split at the last ')'.
    let (_, rest) = text.rsplit_once(')')?;
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some(ProcStat { pid, state, ppid })
}

fn proc_stats() -> impl Iterator<Item = ProcStat> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(proc_stat)
}

/// Waits (polling every 10 ms, at most `timeout`) until every pid in `pids` is gone
/// ([`process_gone`]); returns how long it took, or the pids still running.
pub fn wait_gone(pids: &[u32], timeout: Duration) -> Result<Duration, Vec<u32>> {
    let t0 = Instant::now();
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|p| !process_gone(*p)).collect();
        if alive.is_empty() {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() >= timeout {
            return Err(alive);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Proc {
    /// Sends `sig` and waits up to `timeout` for the exit: its status, or None when it still
    /// runs then (it is left running; [`Proc::kill`] it). Never panics.
    pub fn signal_and_wait(
        &mut self,
        sig: i32,
        timeout: Duration,
    ) -> Option<std::process::ExitStatus> {
        let c = self.child.as_mut()?;
        // SAFETY: kill(2) on our own child, not reaped yet (its pid cannot be reused).
        unsafe { libc::kill(c.id() as libc::pid_t, sig) };
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                self.child = None;
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl RedisServer {
    /// True while the server process has not exited.
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::is_running)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl EtcdServer {
    /// True while the etcd process has not exited.
    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(Proc::is_running)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

/// A host's `NS:hosts` entry as the SDK writes it (a 1 ms round trip, no tasks): `seen_ms` and
/// `offset_ms` (its clock's offset from Redis) as given.
pub fn host_report_json(seen_ms: i64, offset_ms: f64) -> String {
    serde_json::to_string(&sluice_protocol::HostReport {
        offset_ms,
        rtt_ms: 1.0,
        seen_ms,
        sdk: "test".into(),
        proto: Some(sluice_protocol::PROTOCOL_VERSION),
        tasks: Default::default(),
        permits: Default::default(),
    })
    .expect("host report JSON")
}

/// Writes a fresh report of `host`, `offset_ms` off Redis's clock, into `NS:hosts` of `keys`.
pub fn set_host_report(
    conn: &mut redis::Connection,
    keys: &sluice_protocol::Keys,
    host: &str,
    offset_ms: f64,
) {
    let _: () = redis::cmd("HSET")
        .arg(keys.hosts())
        .arg(host)
        .arg(host_report_json(now_ms(), offset_ms))
        .query(conn)
        .expect("HSET NS:hosts");
}

pub mod soak;

/// A running `sluice-agent` (one per simulated host: its own `--host-id` and segment dir).
#[derive(Debug)]
pub struct Agent {
    /// `127.0.0.1:<port>` of its gRPC listener (RLS, RLQS).
    pub grpc: String,
    /// `127.0.0.1:<port>` of its HTTP listener.
    pub http: String,
    /// Host id.
    pub host_id: String,
    /// The process.
    pub proc: Proc,
    /// Its segment directory (the host's shared memory, in a temp dir).
    pub segment_dir: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    /// Starts an agent for `host_id` on `redis` / `namespace` with free ports and its own
    /// segment directory, and waits for `GET /healthz`. `extra`: more flags.
    pub async fn start(redis: &str, namespace: &str, host_id: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let seg = dir.path().join("shm");
        std::fs::create_dir_all(&seg).expect("segment dir");
        Self::start_in(redis, namespace, host_id, &seg, extra, dir).await
    }

    /// [`Agent::start`] with a given segment directory (to share it with SDK clients of the
    /// same simulated host).
    pub async fn start_in(
        redis: &str,
        namespace: &str,
        host_id: &str,
        segment_dir: &std::path::Path,
        extra: &[&str],
        dir: tempfile::TempDir,
    ) -> Self {
        let grpc = format!("127.0.0.1:{}", free_port());
        let http_addr = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(workspace_bin("sluice-agent"));
        cmd.args(["--redis", redis])
            .args(["--namespace", namespace])
            .args(["--host-id", host_id])
            .args(["--grpc-listen", &grpc])
            .args(["--http-listen", &http_addr])
            .arg("--segment-dir")
            .arg(segment_dir)
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("SLUICE_TEST_LOG").unwrap_or_else(|_| "info".into()),
            );
        let log = dir.path().join("agent.log");
        let mut proc = Proc::spawn(&format!("sluice-agent {host_id}"), cmd, log);
        let url = format!("http://{http_addr}/healthz");
        let deadline = Instant::now() + START_TIMEOUT;
        let client = http();
        loop {
            if let Ok(r) = client.get(&url).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                proc.is_running(),
                "sluice-agent {host_id} exited at start-up:\n{}",
                proc.log()
            );
            assert!(
                Instant::now() < deadline,
                "sluice-agent {host_id} did not answer /healthz within {START_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self {
            grpc,
            http: http_addr,
            host_id: host_id.to_string(),
            proc,
            segment_dir: segment_dir.to_path_buf(),
            _dir: dir,
        }
    }

    /// `http://<http addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// `http://<grpc addr>` (for a tonic channel).
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// `POST /v1/decide` with `body`: status and JSON answer.
    pub async fn decide(&self, body: &Value) -> (u16, Value) {
        let r = http()
            .post(self.url("/v1/decide"))
            .json(body)
            .send()
            .await
            .expect("POST /v1/decide");
        let code = r.status().as_u16();
        (code, r.json().await.unwrap_or(Value::Null))
    }

    /// `GET /metrics` (empty when it does not answer).
    pub async fn metrics(&self) -> String {
        match http().get(self.url("/metrics")).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Waits until `/readyz` answers 200 (the domain configurations were read).
    pub async fn wait_ready(&self) {
        let url = self.url("/readyz");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = http().get(&url).send().await
                && r.status().is_success()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sluice-agent {} not ready within {START_TIMEOUT:?}:\n{}",
                self.host_id,
                self.proc.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ─── Concurrency tasks and locks written directly (branch permits) ───

/// The meta of a concurrency task (`threshold` permits in flight, lease TTL `lease_ms`) as a
/// leader writes it, for tests that drive LEASE without a manager.
pub fn conc_meta(threshold: u64, lease_ms: u64, version: i64) -> sluice_protocol::TaskMeta {
    use sluice_protocol::{Fallback, Mode, OnFailure, Pacing, TaskMeta};
    TaskMeta {
        slice_ms: 1000,
        threshold,
        pull: 0,
        local_limit: 5,
        on_failure: OnFailure::Deny,
        mode: Mode::Concurrency,
        fallback: Fallback::default(),
        version,
        lease_ms,
        keyed: false,
        key_overrides: Default::default(),
        shadow: false,
        pacing: Pacing::None,
        pace_burst: 0,
    }
}

/// Writes the meta of task `task` as a leader does (a fenced full ROLL of term 10, epoch 1,
/// no slices); `m.version` must grow from one call to the next.
pub async fn write_meta(
    c: &mut sluice_protocol::conn::RedisConn,
    keys: &sluice_protocol::Keys,
    task: &str,
    m: &sluice_protocol::TaskMeta,
) {
    use sluice_protocol::scripts::{self, Fence, RollOutcome, RollRequest};
    let f = Fence {
        term: 10,
        epoch: 1,
        stale_after_ms: 10_000,
    };
    let req = RollRequest {
        task,
        fence: &f,
        full: true,
        expect_rolled_to: 0,
        spec_version: m.version,
        new_rolled_to: now_ms() + 60_000,
        force: false,
        refresh: true,
        meta: Some(m),
        meta_extra: &[],
        slices: &[],
        lazy: None,
    };
    assert_eq!(
        scripts::roll(c, keys, &req).await.expect("roll"),
        RollOutcome::Written(0)
    );
}

/// Writes meta `m` of task `task` and its slices from the current one on for `secs` seconds
/// (each with cap `m.threshold`), as a leader does: one fenced full ROLL of term 10, epoch 1.
pub async fn roll_task(
    keys: &sluice_protocol::Keys,
    task: &str,
    m: &sluice_protocol::TaskMeta,
    secs: i64,
) {
    use sluice_protocol::scripts::{self, Fence, RollOutcome, RollRequest, SliceWrite};
    let mut c = protocol_conn(&shared_redis()).await;
    let len = m.slice_ms as i64;
    let first = sluice_protocol::slice::start(now_ms(), m.slice_ms);
    let n = secs * 1_000 / len + 2;
    let slices: Vec<SliceWrite> = (0..n)
        .map(|i| SliceWrite {
            start_ms: first + i * len,
            cap: m.threshold,
            expire_at_ms: first + (i + 2) * len + 60_000,
        })
        .collect();
    let f = Fence {
        term: 10,
        epoch: 1,
        stale_after_ms: 10_000,
    };
    let req = RollRequest {
        task,
        fence: &f,
        full: true,
        expect_rolled_to: 0,
        spec_version: m.version,
        new_rolled_to: first + n * len,
        force: false,
        refresh: true,
        meta: Some(m),
        meta_extra: &[],
        slices: &slices,
        lazy: None,
    };
    let out = scripts::roll(&mut c, keys, &req).await.expect("roll");
    assert!(matches!(out, RollOutcome::Written(_)), "{out:?}");
}

/// A pooled task of `threshold` per `slice_ms`: paced (`"pacing": "smooth"`) with `burst`
/// when `paced`.
pub fn pooled_meta(
    threshold: u64,
    slice_ms: u64,
    paced: bool,
    burst: u64,
) -> sluice_protocol::TaskMeta {
    use sluice_protocol::{Fallback, Mode, OnFailure, Pacing, TaskMeta};
    TaskMeta {
        slice_ms,
        threshold,
        pull: 0,
        local_limit: 1,
        on_failure: OnFailure::Deny,
        mode: Mode::Pooled,
        fallback: Fallback::default(),
        version: 1,
        lease_ms: 0,
        keyed: false,
        key_overrides: Default::default(),
        shadow: false,
        pacing: if paced { Pacing::Smooth } else { Pacing::None },
        pace_burst: burst,
    }
}

/// An async protocol connection to the Redis at `url`.
pub async fn protocol_conn(url: &str) -> sluice_protocol::conn::RedisConn {
    use sluice_protocol::conn::{ConnOptions, Redis, RedisTarget};
    let target = RedisTarget::parse(url).expect("redis url");
    Redis::new(target, ConnOptions::default())
        .conn()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Redis at {url}: {e}"))
}

// ───────────────────────── a proxy that loses replies ─────────────────────────

/// A TCP proxy on loopback in front of a server (Redis) that can lose replies: after
/// [`ReplyLoser::lose_replies_of_open_connections`], every byte the server sends on a
/// connection accepted before the call is dropped (the requests still reach the server and run),
/// while connections accepted afterwards work normally (unless
/// [`ReplyLoser::lose_replies_of_next_connections`] says the next few lose theirs too). That is a reply lost on its way back: a
/// client times out, reconnects and retries a call the server already executed. Threads, no
/// runtime; they end when their sockets close (the listener's thread lives with the process).
pub struct ReplyLoser {
    addr: std::net::SocketAddr,
    lose_before: std::sync::Arc<std::sync::atomic::AtomicU64>,
    lose_next: std::sync::Arc<std::sync::atomic::AtomicU64>,
    next_id: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl ReplyLoser {
    /// Starts the proxy in front of `upstream` (`host:port`).
    pub fn start(upstream: &str) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::AtomicU64;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let lose_before = Arc::new(AtomicU64::new(0));
        let lose_next = Arc::new(AtomicU64::new(0));
        let next_id = Arc::new(AtomicU64::new(1));
        let (lb, ln, ni) = (lose_before.clone(), lose_next.clone(), next_id.clone());
        let up = upstream.to_string();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(&up) else {
                    continue;
                };
                let id = ni.fetch_add(1, Ordering::SeqCst);
                let lost_from_start = ln
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut &client, &mut &server);
                    let _ = server.shutdown(std::net::Shutdown::Both);
                });
                let lb = lb.clone();
                std::thread::spawn(move || {
                    use std::io::{Read, Write};
                    let (mut from, mut to) = (s2, c2);
                    let mut buf = [0u8; 16 * 1024];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if lost_from_start || id < lb.load(Ordering::SeqCst) {
                            continue; // lost on the way back
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Self {
            addr,
            lose_before,
            lose_next,
            next_id,
        }
    }

    /// The next `n` connections accepted lose every reply too.
    pub fn lose_replies_of_next_connections(&self, n: u64) {
        self.lose_next.store(n, Ordering::SeqCst);
    }

    /// `redis://` URL of the proxy.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.next_id.load(Ordering::SeqCst) - 1
    }

    /// From now on, replies on every connection already open are lost.
    pub fn lose_replies_of_open_connections(&self) {
        self.lose_before
            .store(self.next_id.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}
