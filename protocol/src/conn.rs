//! One Redis connection type for a single server and for Redis Cluster.
//!
//! A [`RedisTarget`] is parsed from one URL (a single server) or a comma-separated list (the
//! seed nodes of a Redis Cluster). [`Redis`] connects lazily and reconnects by itself, so a
//! process can start while Redis is down; [`RedisConn`] is the cheap, cloneable, multiplexed
//! handle: concurrent commands on it are pipelined on the wire.
//!
//! # TLS and ACL users
//!
//! A `rediss://` URL is a TLS link; [`RedisSecurity`] holds everything else about it, shared by
//! the manager's flags (`--redis-ca`, `--redis-cert`, `--redis-key`, `--redis-insecure`,
//! `--redis-user`, `--redis-password-file`), the SDK's `Config::redis_security` and the
//! loadgen's flags of the same names. Trust is [`super::tls::all_roots`]: the platform bundle,
//! `SSL_CERT_FILE` and the link's CA file. The server's certificate must name the host of the
//! URL (SNI and hostname verification are on) unless `insecure` is set, which skips every
//! check of the server and is logged as a warning by the caller. A client certificate and key
//! (both or neither) make it mutual TLS.
//!
//! The ACL user and password come from the URL (`rediss://user:pass@host:6380`) or from the
//! security settings (a user name, and a password or a password file); giving a password in
//! both places is an error, so there is never a doubt which one is used. Files are read once,
//! when [`Redis::with_security`] is called: a typo in a path is an error at start-up.
//!
//! No URL password ever reaches a log line or an error: [`RedisTarget`]'s `Display` and `Debug`
//! redact it, and errors name the target that way.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

#[cfg(all(feature = "tls", feature = "cluster"))]
use redis::TlsMode;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
#[cfg(feature = "cluster")]
use redis::cluster::ClusterClient;
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;
#[cfg(feature = "tls")]
use redis::{ClientTlsConfig, ConnectionAddr, TlsCertificates};
use redis::{
    Cmd, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, RedisResult, Value,
};
use tokio::sync::Mutex;

use super::tls;

/// Where Redis is: one server, or the seed nodes of a cluster.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server URL (`redis://host:port[/db]`).
    Single(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// `url` without its userinfo (`rediss://***@host:6380`): the form every log line and error
/// shows.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}

impl fmt::Display for RedisTarget {
    /// Shows the URLs without passwords.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let redact = redact_url;
        match self {
            Self::Single(u) => f.write_str(&redact(u)),
            Self::Cluster(us) => {
                let v: Vec<String> = us.iter().map(|u| redact(u)).collect();
                write!(f, "cluster[{}]", v.join(","))
            }
        }
    }
}

impl RedisTarget {
    /// Parses `redis://a:6379` (single) or `redis://a:7000,redis://b:7001` (cluster). Each URL
    /// is checked now, so a typo is an error at start-up, not at the first request.
    ///
    /// ```
    /// use sluice_protocol::conn::RedisTarget;
    /// assert!(matches!(RedisTarget::parse("redis://127.0.0.1:6379"), Ok(RedisTarget::Single(_))));
    /// assert!(matches!(
    ///     RedisTarget::parse("redis://127.0.0.1:7000, redis://127.0.0.1:7001"),
    ///     Ok(RedisTarget::Cluster(v)) if v.len() == 2
    /// ));
    /// assert!(RedisTarget::parse("http://x").is_err());
    /// assert!(RedisTarget::parse(" ").is_err());
    /// ```
    pub fn parse(spec: &str) -> Result<Self, String> {
        let urls: Vec<String> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if urls.is_empty() {
            return Err("no Redis URL given".into());
        }
        #[cfg(not(feature = "cluster"))]
        if urls.len() > 1 {
            return Err(format!(
                "{} Redis URLs name a Redis Cluster, but this build of sluice-protocol has no \
                 `cluster` feature",
                urls.len()
            ));
        }
        #[cfg(not(feature = "tls"))]
        if urls.iter().any(|u| u.starts_with("rediss://")) {
            return Err(
                "a rediss:// URL needs TLS, but this build of sluice-protocol has no `tls` feature"
                    .into(),
            );
        }
        for u in &urls {
            // The error names the URL redacted: a URL may carry a password.
            redis::Client::open(u.as_str())
                .map_err(|e| format!("bad Redis URL {}: {e}", redact_url(u)))?;
        }
        Ok(if urls.len() == 1 {
            Self::Single(urls.into_iter().next().unwrap_or_default())
        } else {
            Self::Cluster(urls)
        })
    }

    /// The URLs (with their passwords: never log these, log the target itself).
    fn urls(&self) -> &[String] {
        match self {
            Self::Single(u) => std::slice::from_ref(u),
            Self::Cluster(us) => us,
        }
    }

    /// True when the link is TLS (`rediss://`).
    pub fn is_tls(&self) -> bool {
        self.urls().iter().any(|u| u.starts_with("rediss://"))
    }

    /// True when a URL carries a password (`redis://user:pass@host`).
    pub fn has_password(&self) -> bool {
        self.urls().iter().any(|u| {
            url_info(u)
                .map(|i| i.redis_settings().password().is_some())
                .unwrap_or(false)
        })
    }
}

fn url_info(url: &str) -> RedisResult<ConnectionInfo> {
    url.into_connection_info()
}

/// TLS and ACL settings of a Redis link (see the module docs). `Default` is a plain link with
/// whatever credentials the URL carries.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisSecurity {
    /// A PEM bundle trusted besides the platform's and `SSL_CERT_FILE` (`--redis-ca`).
    pub ca_file: Option<PathBuf>,
    /// The client certificate chain (PEM) for mutual TLS (`--redis-cert`; with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM) (`--redis-key`; with `cert_file`).
    pub key_file: Option<PathBuf>,
    /// Skip every check of the server's certificate (`--redis-insecure`). For tests against a
    /// server with a throw-away certificate only: anyone on the path can read and change the
    /// traffic. Callers log a warning when it is set.
    pub insecure: bool,
    /// The ACL user (`--redis-user`); the URL's user name when `None`.
    pub user: Option<String>,
    /// The password (`None`: from `password_file` or the URL). Never printed (`Debug` redacts).
    pub password: Option<String>,
    /// A file holding the password (`--redis-password-file`; surrounding whitespace dropped).
    pub password_file: Option<PathBuf>,
}

impl fmt::Debug for RedisSecurity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSecurity")
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("insecure", &self.insecure)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_file", &self.password_file)
            .finish()
    }
}

/// A [`RedisSecurity`] setting that cannot be used: which one, and why (never a secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SecurityError {
    /// The field of [`RedisSecurity`] (`ca_file`, `cert_file`, `key_file`, `insecure`, `user`,
    /// `password`, `password_file`), or `redis` for the URL itself. The manager maps it to its
    /// flag with [`SecurityError::flag`].
    pub field: &'static str,
    /// What is wrong.
    pub message: String,
}

impl SecurityError {
    /// The manager's and the loadgen's flag for [`SecurityError::field`], without dashes.
    pub fn flag(&self) -> &'static str {
        match self.field {
            "ca_file" => "redis-ca",
            "cert_file" => "redis-cert",
            "key_file" => "redis-key",
            "insecure" => "redis-insecure",
            "user" => "redis-user",
            "password" | "password_file" => "redis-password-file",
            _ => "redis",
        }
    }
}

fn sec_err(field: &'static str, message: impl Into<String>) -> SecurityError {
    SecurityError {
        field,
        message: message.into(),
    }
}

/// [`RedisSecurity`] with its files read and checked: what a connection is built from.
#[derive(Clone, Default)]
struct Link {
    /// `Some` for a TLS link: trusted roots and the client identity.
    #[cfg(feature = "tls")]
    tls: Option<TlsCertificates>,
    #[cfg(feature = "tls")]
    insecure: bool,
    user: Option<String>,
    password: Option<String>,
}

impl RedisSecurity {
    /// True when any TLS option is set.
    fn wants_tls(&self) -> bool {
        self.ca_file.is_some()
            || self.cert_file.is_some()
            || self.key_file.is_some()
            || self.insecure
    }

    /// Reads and checks every file against `target` (see the module docs for the rules).
    fn prepare(&self, target: &RedisTarget) -> Result<Link, SecurityError> {
        let tls = target.is_tls();
        if tls && !target.urls().iter().all(|u| u.starts_with("rediss://")) {
            return Err(sec_err(
                "redis",
                format!("{target}: mixes redis:// and rediss:// URLs"),
            ));
        }
        if !tls && self.wants_tls() {
            let field = if self.ca_file.is_some() {
                "ca_file"
            } else if self.cert_file.is_some() {
                "cert_file"
            } else if self.key_file.is_some() {
                "key_file"
            } else {
                "insecure"
            };
            return Err(sec_err(
                field,
                format!("a TLS option needs a rediss:// URL, but the link is {target}"),
            ));
        }
        let mut link = Link {
            #[cfg(feature = "tls")]
            insecure: self.insecure,
            ..Link::default()
        };
        #[cfg(not(feature = "tls"))]
        if tls {
            return Err(sec_err(
                "redis",
                "rediss:// needs the `tls` feature of sluice-protocol",
            ));
        }
        #[cfg(feature = "tls")]
        if tls {
            tls::install_provider();
            let roots = tls::all_roots_pem(self.ca_file.as_deref()).map_err(|e| {
                let field = if e.starts_with("SSL_CERT_FILE") {
                    "redis"
                } else {
                    "ca_file"
                };
                sec_err(field, e)
            })?;
            let client_tls = match (&self.cert_file, &self.key_file) {
                (None, None) => None,
                (Some(_), None) => {
                    return Err(sec_err("key_file", "a client certificate needs its key"));
                }
                (None, Some(_)) => {
                    return Err(sec_err("cert_file", "a client key needs its certificate"));
                }
                (Some(cert), Some(key)) => {
                    // Parsed now so that a bad file is named; the redis crate gets the PEM.
                    tls::load_certs(cert).map_err(|e| sec_err("cert_file", e))?;
                    tls::load_key(key).map_err(|e| sec_err("key_file", e))?;
                    let read = |p: &std::path::Path, field| {
                        std::fs::read(p).map_err(|e| {
                            sec_err(field, format!("cannot read {}: {e}", p.display()))
                        })
                    };
                    Some(ClientTlsConfig {
                        client_cert: read(cert, "cert_file")?,
                        client_key: read(key, "key_file")?,
                    })
                }
            };
            link.tls = Some(TlsCertificates {
                client_tls,
                root_cert: Some(roots),
            });
        }
        let from_settings = match (&self.password, &self.password_file) {
            (Some(_), Some(_)) => {
                return Err(sec_err(
                    "password_file",
                    "give a password or a password file, not both",
                ));
            }
            (Some(p), None) if p.is_empty() => {
                return Err(sec_err("password", "must not be empty when set"));
            }
            (Some(p), None) => Some(p.clone()),
            (None, Some(f)) => {
                Some(tls::read_secret_file(f).map_err(|e| sec_err("password_file", e))?)
            }
            (None, None) => None,
        };
        if from_settings.is_some() && target.has_password() {
            return Err(sec_err(
                "password_file",
                format!("{target} carries a password already: give it in one place"),
            ));
        }
        if let Some(u) = &self.user {
            if u.is_empty() || u.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(sec_err("user", format!("{u:?} is not an ACL user name")));
            }
            if from_settings.is_none() && !target.has_password() {
                return Err(sec_err(
                    "user",
                    "an ACL user needs a password (a password file, or in the URL)",
                ));
            }
        }
        link.user = self.user.clone();
        link.password = from_settings;
        Ok(link)
    }
}

impl Link {
    /// `url`'s connection info with this link's user, password and TLS mode.
    fn info(&self, url: &str) -> RedisResult<ConnectionInfo> {
        let mut info = url_info(url)?;
        let mut rs = info.redis_settings().clone();
        if let Some(u) = &self.user {
            rs = rs.set_username(u);
        }
        if let Some(p) = &self.password {
            rs = rs.set_password(p);
        }
        info = info.set_redis_settings(rs);
        #[cfg(feature = "tls")]
        if self.insecure
            && let ConnectionAddr::TcpTls {
                host,
                port,
                tls_params,
                ..
            } = info.addr().clone()
        {
            info = info.set_addr(ConnectionAddr::TcpTls {
                host,
                port,
                insecure: true,
                tls_params,
            });
        }
        Ok(info)
    }

    fn client(&self, url: &str) -> RedisResult<redis::Client> {
        let info = self.info(url)?;
        #[cfg(feature = "tls")]
        if let Some(certs) = &self.tls {
            return redis::Client::build_with_tls(info, certs.clone());
        }
        redis::Client::open(info)
    }

    #[cfg(feature = "cluster")]
    fn cluster(&self, urls: &[String], o: &ConnOptions) -> RedisResult<ClusterClient> {
        let infos = urls
            .iter()
            .map(|u| self.info(u))
            .collect::<RedisResult<Vec<_>>>()?;
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut b = ClusterClient::builder(infos)
            .connection_timeout(o.connect_timeout)
            .response_timeout(o.response_timeout)
            .retries(1);
        #[cfg(feature = "tls")]
        if let Some(certs) = &self.tls {
            b = b.certs(certs.clone());
            if self.insecure {
                b = b.tls(TlsMode::Insecure);
            }
        }
        b.build()
    }
}

/// Why [`Redis::check`] failed, by what an operator must do about it.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Redis answered, but the link is misconfigured: the TLS handshake failed (unknown CA,
    /// wrong host name, client certificate refused, not a TLS port) or the server refused the
    /// credentials (wrong password, no such user, command not allowed). Retrying will not help.
    #[error("Redis at {target}: {what}: {detail}")]
    Config {
        /// The target, passwords redacted.
        target: String,
        /// `TLS handshake failed` or `authentication failed`.
        what: &'static str,
        /// The cause (never a secret).
        detail: String,
    },
    /// Redis could not be reached (refused, timed out): it may come up later.
    #[error("Redis at {target} is unreachable: {detail}")]
    Down {
        /// The target, passwords redacted.
        target: String,
        /// The cause.
        detail: String,
    },
}

impl CheckError {
    /// True for [`CheckError::Config`].
    pub fn is_config(&self) -> bool {
        matches!(self, Self::Config { .. })
    }
}

/// The rustls error under a connection error, if the TLS handshake is what failed. The redis
/// crate keeps an I/O error as `Arc<dyn Error>`, and an I/O error hides the error it wraps from
/// `source()`, so each layer is unwrapped by hand.
fn tls_cause(e: &RedisError) -> Option<String> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    fn find(e: &(dyn std::error::Error + 'static), depth: u32) -> Option<String> {
        if depth > 8 {
            return None;
        }
        #[cfg(feature = "tls")]
        if let Some(r) = e.downcast_ref::<rustls::Error>() {
            return Some(r.to_string());
        }
        if let Some(a) = e.downcast_ref::<Shared>() {
            return find(a.as_ref(), depth + 1);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
        {
            return find(inner, depth + 1);
        }
        e.source().and_then(|s| find(s, depth + 1))
    }
    if let Some(found) = std::error::Error::source(e).and_then(|s| find(s, 0)) {
        return Some(found);
    }
    // Some paths (the connection manager's reconnect) keep only the message: recognise the
    // messages of rustls's handshake errors.
    const RUSTLS: &[&str] = &[
        "invalid peer certificate",
        "received fatal alert",
        "peer sent no certificates",
        "peer is incompatible",
        "peer misbehaved",
        "received corrupt message",
        "received unexpected message",
        "received unexpected handshake message",
        "cannot decrypt peer's message",
        "handshake not complete",
        "presented server name type wasn't supported",
    ];
    let text = e.to_string();
    RUSTLS.iter().any(|m| text.contains(m)).then_some(text)
}

/// Sorts a failed connect-and-PING into [`CheckError`]. Exposed for the SDK, which classifies
/// its first connection the same way.
pub fn classify(target: &RedisTarget, e: &RedisError) -> CheckError {
    let target_s = target.to_string();
    if let Some(detail) = tls_cause(e) {
        return CheckError::Config {
            target: target_s,
            what: "TLS handshake failed",
            detail,
        };
    }
    let auth = e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"));
    if auth {
        return CheckError::Config {
            target: target_s,
            what: "authentication failed",
            detail: e.to_string(),
        };
    }
    CheckError::Down {
        target: target_s,
        detail: e.to_string(),
    }
}

/// Timeouts of a [`Redis`] connection.
#[derive(Debug, Clone, Copy)]
pub struct ConnOptions {
    /// Bound on establishing a TCP connection.
    pub connect_timeout: Duration,
    /// Bound on one request's answer.
    pub response_timeout: Duration,
}

impl Default for ConnOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
        }
    }
}

/// A connected, multiplexed handle (cheap to clone).
pub enum RedisConn {
    /// A single server, reconnected automatically.
    Single(ConnectionManager),
    /// A cluster, routed by slot (feature `cluster`).
    #[cfg(feature = "cluster")]
    Cluster(ClusterConnection),
    /// An in-process server's connection (feature `sim`: the deterministic simulation; not
    /// part of the supported API).
    #[cfg(feature = "sim")]
    #[doc(hidden)]
    Shared(Box<dyn SharedConn>),
}

/// A connection to an in-process server (feature `sim`), cloned as a [`ConnectionManager`] is:
/// the clones share one connection, which comes back by itself after the server broke it.
#[cfg(feature = "sim")]
#[doc(hidden)]
pub trait SharedConn: ConnectionLike + Send + Sync {
    /// Another handle to the same connection.
    fn clone_conn(&self) -> Box<dyn SharedConn>;
}

impl Clone for RedisConn {
    fn clone(&self) -> Self {
        match self {
            Self::Single(c) => Self::Single(c.clone()),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => Self::Cluster(c.clone()),
            #[cfg(feature = "sim")]
            Self::Shared(c) => Self::Shared(c.clone_conn()),
        }
    }
}

impl RedisConn {
    /// Whether one server answers (not a Cluster): `INFO server` names it.
    pub fn is_single_server(&self) -> bool {
        match self {
            Self::Single(_) => true,
            #[cfg(feature = "cluster")]
            Self::Cluster(_) => false,
            #[cfg(feature = "sim")]
            Self::Shared(_) => true,
        }
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.req_packed_command(cmd),
            #[cfg(feature = "sim")]
            Self::Shared(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "sim")]
            Self::Shared(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.get_db(),
            #[cfg(feature = "sim")]
            Self::Shared(c) => c.get_db(),
        }
    }
}

/// A lazily connected Redis: [`Redis::conn`] connects on first use (and after a failed first
/// connect, on the next use), then hands out clones of one multiplexed connection.
pub struct Redis {
    target: RedisTarget,
    options: ConnOptions,
    link: Link,
    conn: Mutex<Option<RedisConn>>,
    /// An in-process server's connection, handed out instead of connecting (feature `sim`).
    #[cfg(feature = "sim")]
    shared: Option<RedisConn>,
}

impl fmt::Debug for Redis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redis")
            .field("target", &self.target)
            .finish()
    }
}

impl Redis {
    /// A handle to `target` with the credentials its URL carries (TLS for `rediss://`, with
    /// the platform roots and `SSL_CERT_FILE`); nothing is connected yet.
    pub fn new(target: RedisTarget, options: ConnOptions) -> Self {
        let link = RedisSecurity::default()
            .prepare(&target)
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "Redis TLS roots unusable; connecting without them");
                Link::default()
            });
        Self {
            target,
            options,
            link,
            conn: Mutex::new(None),
            #[cfg(feature = "sim")]
            shared: None,
        }
    }

    /// A handle that hands out clones of `conn` (feature `sim`: a simulated server), never
    /// connecting anywhere. Its target reads `redis://sim`.
    #[cfg(feature = "sim")]
    #[doc(hidden)]
    pub fn shared(conn: impl SharedConn + 'static) -> Self {
        Self {
            target: RedisTarget::Single("redis://sim".into()),
            options: ConnOptions::default(),
            link: Link::default(),
            conn: Mutex::new(None),
            shared: Some(RedisConn::Shared(Box::new(conn))),
        }
    }

    /// A handle to `target` with TLS and ACL settings: every file is read now and every rule of
    /// the module docs checked, so a bad setting is an error naming it. Nothing is connected.
    pub fn with_security(
        target: RedisTarget,
        options: ConnOptions,
        security: &RedisSecurity,
    ) -> Result<Self, SecurityError> {
        let link = security.prepare(&target)?;
        Ok(Self {
            target,
            options,
            link,
            conn: Mutex::new(None),
            #[cfg(feature = "sim")]
            shared: None,
        })
    }

    /// Connects (afresh) and sends `PING`: the start-up check. A TLS or authentication failure
    /// is [`CheckError::Config`], anything else [`CheckError::Down`]; both name the target
    /// (passwords redacted) and never a secret.
    pub async fn check(&self) -> Result<(), CheckError> {
        self.reset().await;
        let r = async {
            let mut c = self.conn().await?;
            redis::cmd("PING").query_async::<String>(&mut c).await
        };
        match tokio::time::timeout(self.options.connect_timeout * 4, r).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => {
                self.reset().await;
                Err(classify(&self.target, &e))
            }
            Err(_) => {
                self.reset().await;
                Err(CheckError::Down {
                    target: self.target.to_string(),
                    detail: "no answer in time".into(),
                })
            }
        }
    }

    /// Where this handle connects.
    pub fn target(&self) -> &RedisTarget {
        &self.target
    }

    /// The connection, connecting first if needed (bounded by the connect timeout).
    pub async fn conn(&self) -> RedisResult<RedisConn> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = self.connect().await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Drops the cached connection: the next [`Redis::conn`] connects afresh. For a caller
    /// whose request went unanswered within its deadline (the connection may be stuck; a new
    /// one costs one round trip on a healthy server).
    pub async fn reset(&self) {
        *self.conn.lock().await = None;
    }

    /// A new connection of its own whose I/O runs on the calling task's Tokio runtime (its
    /// driver is spawned there), for a caller that wants its answer without a hop through
    /// another thread; `None` for a cluster (its routing is the shared connection's). The
    /// runtime must have IO and time enabled. Nothing reconnects it: drop it on an error.
    pub async fn connect_here(&self) -> RedisResult<Option<redis::aio::MultiplexedConnection>> {
        let RedisTarget::Single(url) = &self.target else {
            return Ok(None);
        };
        let o = self.options;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(o.connect_timeout))
            .set_response_timeout(Some(o.response_timeout));
        let client = self.link.client(url)?;
        let connect = client.get_multiplexed_async_connection_with_config(&cfg);
        match tokio::time::timeout(o.connect_timeout * 3, connect).await {
            Ok(r) => r.map(Some),
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connecting to Redis at {} timed out", self.target),
            ))),
        }
    }

    async fn connect(&self) -> RedisResult<RedisConn> {
        #[cfg(feature = "sim")]
        if let Some(c) = &self.shared {
            return Ok(c.clone());
        }
        let o = self.options;
        let connect = async {
            match &self.target {
                RedisTarget::Single(url) => {
                    let client = self.link.client(url)?;
                    let cfg = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(o.connect_timeout))
                        .set_response_timeout(Some(o.response_timeout))
                        .set_number_of_retries(1)
                        .set_max_delay(o.connect_timeout);
                    Ok(RedisConn::Single(
                        ConnectionManager::new_with_config(client, cfg).await?,
                    ))
                }
                #[cfg(feature = "cluster")]
                RedisTarget::Cluster(urls) => {
                    let client = self.link.cluster(urls, &o)?;
                    Ok(RedisConn::Cluster(client.get_async_connection().await?))
                }
                #[cfg(not(feature = "cluster"))]
                RedisTarget::Cluster(_) => Err(RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "Redis Cluster needs the `cluster` feature of sluice-protocol",
                ))),
            }
        };
        match tokio::time::timeout(o.connect_timeout * 3, connect).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connecting to Redis at {} timed out", self.target),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(url: &str, s: &RedisSecurity) -> Result<(), SecurityError> {
        Redis::with_security(RedisTarget::parse(url).unwrap(), ConnOptions::default(), s)
            .map(|_| ())
    }

    /// Built without `cluster` / `tls` (scripts/check-crates.sh runs these with
    /// `--no-default-features`): the URL that needs the feature is refused, naming it.
    #[test]
    #[cfg(not(feature = "cluster"))]
    fn without_cluster_a_seed_list_names_the_feature() {
        let e = RedisTarget::parse("redis://a:1,redis://b:2").unwrap_err();
        assert!(e.contains("`cluster` feature"), "{e}");
        assert!(RedisTarget::parse("redis://a:1").is_ok());
    }

    #[test]
    #[cfg(not(feature = "tls"))]
    fn without_tls_rediss_names_the_feature() {
        let e = RedisTarget::parse("rediss://u:hunter2@a:1").unwrap_err();
        assert!(e.contains("`tls` feature") && !e.contains("hunter2"), "{e}");
        let ins = RedisSecurity {
            insecure: true,
            ..RedisSecurity::default()
        };
        let e = check("redis://a:1", &ins).unwrap_err();
        assert_eq!(e.field, "insecure", "{e}");
    }

    #[test]
    #[cfg(feature = "tls")]
    fn security_rules_name_the_field_never_the_secret() {
        let dir = std::env::temp_dir().join(format!("sluice-conn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pw = dir.join("pw");
        std::fs::write(&pw, "file-secret\n").unwrap();
        let missing = dir.join("missing.pem");
        let ok = RedisSecurity {
            user: Some("w".into()),
            password_file: Some(pw.clone()),
            ..RedisSecurity::default()
        };
        assert!(check("rediss://127.0.0.1:6380", &ok).is_ok());
        assert!(check("redis://127.0.0.1:6379", &ok).is_ok());
        for (url, s, field) in [
            (
                "redis://h:1",
                RedisSecurity {
                    insecure: true,
                    ..RedisSecurity::default()
                },
                "insecure",
            ),
            (
                "rediss://h:1",
                RedisSecurity {
                    ca_file: Some(missing.clone()),
                    ..RedisSecurity::default()
                },
                "ca_file",
            ),
            (
                "rediss://h:1",
                RedisSecurity {
                    cert_file: Some(pw.clone()),
                    ..RedisSecurity::default()
                },
                "key_file",
            ),
            (
                "rediss://u:url-secret@h:1",
                RedisSecurity {
                    password_file: Some(pw.clone()),
                    ..RedisSecurity::default()
                },
                "password_file",
            ),
            (
                "rediss://h:1",
                RedisSecurity {
                    password: Some("p".into()),
                    password_file: Some(pw.clone()),
                    ..RedisSecurity::default()
                },
                "password_file",
            ),
            (
                "rediss://h:1",
                RedisSecurity {
                    user: Some("w".into()),
                    ..RedisSecurity::default()
                },
                "user",
            ),
            (
                "redis://a:1,rediss://b:2",
                RedisSecurity::default(),
                "redis",
            ),
        ] {
            let e = check(url, &s).unwrap_err();
            assert_eq!(e.field, field, "{url} {s:?}: {e}");
            let text = e.to_string();
            assert!(!text.contains("secret"), "{text}");
        }
        let dbg = format!(
            "{:?}",
            RedisSecurity {
                password: Some("dbg-secret".into()),
                ..RedisSecurity::default()
            }
        );
        assert!(!dbg.contains("dbg-secret"), "{dbg}");
        assert_eq!(
            RedisTarget::parse("rediss://u:pw@h:1").unwrap().to_string(),
            "rediss://***@h:1"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
