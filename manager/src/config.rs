//! Configuration: command-line flags, each also an environment variable `SLUICE_<FLAG>` and a
//! key of the TOML file given by `--config`. Precedence: flag > environment > file > default.
//!
//! Everything is validated here, once, with errors that name the flag.

// The flags' doc comments are clap's --help text (`[default: …]`, `<value>` as clap prints
// them), not rustdoc markup.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use sluice_protocol::conn::{RedisSecurity, RedisTarget};
use sluice_protocol::flags::{self, RedisArgs, duration, err, pick, token};
use sluice_protocol::validate_namespace;

pub use sluice_protocol::flags::{ConfigError, Token};

sluice_protocol::flags::redis_env!(
    /// The environment variables of the manager's Redis flags (`SLUICE_REDIS`, …).
    pub ManagerEnv = "SLUICE_"
);

/// Command-line flags (every one also `SLUICE_<FLAG>` in the environment).
#[derive(Debug, Default, Parser)]
#[command(
    name = "sluice-manager",
    version,
    about = "Sluice manager replica: leader election, \
slice rolling, schedules, HTTP API and dashboard"
)]
pub struct Cli {
    /// TOML file with any of the settings below (keys as the flags, with `_` for `-`).
    #[arg(long, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,
    /// etcd endpoints, comma-separated [default: http://127.0.0.1:2379]
    #[arg(long, env = "SLUICE_ETCD")]
    pub etcd: Option<String>,
    /// `--redis`, `--redis-ca`, `--redis-cert`, `--redis-key`, `--redis-insecure`,
    /// `--redis-user`, `--redis-password-file` (`SLUICE_REDIS…`): the Redis link, its TLS and ACL.
    #[command(flatten)]
    pub redis_flags: RedisArgs<ManagerEnv>,
    /// HTTP listen address for the API, dashboard and metrics [default: 127.0.0.1:8080]
    #[arg(long, env = "SLUICE_LISTEN")]
    pub listen: Option<String>,
    /// Namespace of every etcd path and Redis key [default: sluice]
    #[arg(long, env = "SLUICE_NAMESPACE")]
    pub namespace: Option<String>,
    /// This replica's id in the cluster [default: <hostname>:<listen port>]
    #[arg(long, env = "SLUICE_NODE_ID")]
    pub node_id: Option<String>,
    /// Address other replicas and the dashboard use to reach this one [default: --listen]
    #[arg(long, env = "SLUICE_ADVERTISE")]
    pub advertise: Option<String>,
    /// etcd lease TTL, whole seconds (leader failover takes at most this long) [default: 3s]
    #[arg(long, env = "SLUICE_LEASE_TTL")]
    pub lease_ttl: Option<String>,
    /// How far ahead the leader keeps slices written [default: 60s]
    #[arg(long, env = "SLUICE_HORIZON")]
    pub horizon: Option<String>,
    /// How long a slice key lives after its slice ended [default: 60s]
    #[arg(long, env = "SLUICE_RETENTION")]
    pub retention: Option<String>,
    /// Period of the leader's rolling loop [default: 500ms]
    #[arg(long, env = "SLUICE_TICK")]
    pub tick: Option<String>,
    /// Period of the dynamic-limiting controller [default: 5s]
    #[arg(long, env = "SLUICE_CONTROL_PERIOD")]
    pub control_period: Option<String>,
    /// A task's fence not refreshed for this long may be taken over by a leader of another
    /// etcd or a lower term (at least 2 × tick + lease TTL) [default: 10s]
    #[arg(long, env = "SLUICE_FENCE_STALE_AFTER")]
    pub fence_stale_after: Option<String>,
    /// Leave a task without traffic for this long lazy: no slices written ahead, workers make
    /// them from its meta (protocol 5; every worker must speak it); `off` or `0` = never
    /// [default: off]
    #[arg(long, env = "SLUICE_LAZY_AFTER")]
    pub lazy_after: Option<String>,
    /// Bearer token required by mutating API calls (unset = no auth)
    #[arg(long, env = "SLUICE_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    // ── API access and webhooks (docs/security.md) ──
    /// File holding the admin API token (instead of --api-token, kept out of the process list)
    #[arg(long, env = "SLUICE_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
    /// Serve --listen beyond loopback without --api-token (anyone who reaches it can change
    /// every task and setting)
    #[arg(long, env = "SLUICE_INSECURE_LISTEN", num_args = 0..=1,
          default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub insecure_listen: Option<bool>,
    /// Read-only API token: reads the settings, cannot change anything (needs --api-token)
    #[arg(long, env = "SLUICE_API_READ_TOKEN", hide_env_values = true)]
    pub api_read_token: Option<String>,
    /// File holding the read-only API token
    #[arg(long, env = "SLUICE_API_READ_TOKEN_FILE")]
    pub api_read_token_file: Option<PathBuf>,
    /// Allow webhooks to loopback, private, link-local and other non-global addresses
    #[arg(long, env = "SLUICE_WEBHOOK_ALLOW_PRIVATE", num_args = 0..=1,
          default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub webhook_allow_private: Option<bool>,
    /// Extra CA bundle (PEM) trusted for https webhooks, besides the platform roots and SSL_CERT_FILE
    #[arg(long, env = "SLUICE_WEBHOOK_CA")]
    pub webhook_ca: Option<PathBuf>,
    /// Log as JSON lines instead of text
    #[arg(long, env = "SLUICE_LOG_JSON")]
    pub log_json: Option<bool>,

    // --- etcd TLS and authentication, the manager's own HTTPS listener ---
    /// CA bundle (PEM) trusted for https:// etcd endpoints, besides the platform roots and
    /// SSL_CERT_FILE
    #[arg(long, env = "SLUICE_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS to etcd (with --etcd-key)
    #[arg(long, env = "SLUICE_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert
    #[arg(long, env = "SLUICE_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd auth); the password comes from --etcd-password-file or the
    /// environment variable SLUICE_ETCD_PASSWORD
    #[arg(long, env = "SLUICE_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (surrounding whitespace ignored)
    #[arg(long, env = "SLUICE_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM; with --tls-key)
    #[arg(long, env = "SLUICE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert
    #[arg(long, env = "SLUICE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
}

/// The TOML file: the same settings as [`Cli`]; unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    etcd: Option<String>,
    redis: Option<String>,
    redis_ca: Option<PathBuf>,
    redis_cert: Option<PathBuf>,
    redis_key: Option<PathBuf>,
    redis_insecure: Option<bool>,
    redis_user: Option<String>,
    redis_password_file: Option<PathBuf>,
    listen: Option<String>,
    namespace: Option<String>,
    node_id: Option<String>,
    advertise: Option<String>,
    lease_ttl: Option<String>,
    horizon: Option<String>,
    retention: Option<String>,
    tick: Option<String>,
    control_period: Option<String>,
    fence_stale_after: Option<String>,
    lazy_after: Option<String>,
    api_token: Option<String>,
    api_token_file: Option<PathBuf>,
    insecure_listen: Option<bool>,
    api_read_token: Option<String>,
    api_read_token_file: Option<PathBuf>,
    webhook_allow_private: Option<bool>,
    webhook_ca: Option<PathBuf>,
    log_json: Option<bool>,

    // etcd TLS and authentication, the manager's own HTTPS listener.
    etcd_ca: Option<PathBuf>,
    etcd_cert: Option<PathBuf>,
    etcd_key: Option<PathBuf>,
    etcd_user: Option<String>,
    etcd_password_file: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
}

/// The validated configuration of one replica.
#[derive(Debug, Clone)]
pub struct Config {
    /// etcd endpoints.
    pub etcd: Vec<String>,
    /// Redis.
    pub redis: RedisTarget,
    /// TLS and ACL settings of the Redis link (files checked when the config was built).
    pub redis_security: RedisSecurity,
    /// HTTP listen address.
    pub listen: SocketAddr,
    /// Namespace.
    pub namespace: String,
    /// Node id.
    pub node_id: String,
    /// Advertised address.
    pub advertise: String,
    /// Lease TTL (whole seconds).
    pub lease_ttl: Duration,
    /// Rolling horizon.
    pub horizon: Duration,
    /// Slice key retention after the slice's end.
    pub retention: Duration,
    /// Rolling loop period.
    pub tick: Duration,
    /// Dynamic-limiting control period.
    pub control_period: Duration,
    /// A fence not refreshed for this long may be taken over.
    pub fence_stale_after: Duration,
    /// `--lazy-after`: tasks without traffic this long are left lazy; `None` = never.
    pub lazy_after: Option<Duration>,
    /// Admin API token (`--api-token` or `--api-token-file`): every call.
    pub api_token: Option<Token>,
    /// Read-only API token (`--api-read-token[-file]`): reads, including the settings.
    pub api_read_token: Option<Token>,
    /// `--insecure-listen`: `listen` may be beyond loopback without an admin token.
    pub insecure_listen: bool,
    /// `--webhook-allow-private`: webhooks may reach non-global addresses.
    pub webhook_allow_private: bool,
    /// `--webhook-ca`: extra trusted roots for https webhooks.
    pub webhook_ca: Option<PathBuf>,
    /// JSON logs.
    pub log_json: bool,
    /// TLS and authentication of the etcd link.
    pub etcd_link: EtcdLink,
    /// HTTPS for the manager's own listener (None = plain HTTP).
    pub tls: Option<ListenerTls>,
}

/// A secret string (the etcd password): the same wrapper as API tokens, its `Debug` never
/// shows it.
pub type Secret = Token;

/// How the manager reaches etcd beyond the endpoints: TLS (for https:// endpoints) and auth.
#[derive(Debug, Clone, Default)]
pub struct EtcdLink {
    /// True when the endpoints are https://.
    pub tls: bool,
    /// `--etcd-ca` (added to the platform roots and `SSL_CERT_FILE`).
    pub ca: Option<PathBuf>,
    /// `--etcd-cert` and `--etcd-key`.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// `--etcd-user` and its password.
    pub user: Option<(String, Secret)>,
}

/// `--tls-cert` and `--tls-key`, validated at start-up.
#[derive(Debug, Clone)]
pub struct ListenerTls {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM).
    pub key: PathBuf,
}

/// A path setting (flag or file, [`pick!`]) that must not be empty when set.
fn non_empty(path: Option<PathBuf>, flag: &'static str) -> Result<Option<PathBuf>, ConfigError> {
    match path {
        Some(p) if p.as_os_str().is_empty() => Err(err(flag, "must not be empty when set")),
        other => Ok(other),
    }
}

/// Validates the etcd link settings against the endpoints (every file is read now, so a typo
/// fails at start-up with the flag named, not as a handshake error later).
fn etcd_link(cli: &Cli, file: &FileConfig, endpoints: &[String]) -> Result<EtcdLink, ConfigError> {
    let mut https = 0;
    for e in endpoints {
        let lower = e.to_ascii_lowercase();
        if lower.starts_with("https://") {
            https += 1;
        } else if !lower.starts_with("http://") && lower.contains("://") {
            return Err(err(
                "etcd",
                format!("{e}: endpoints are http://host:port or https://host:port"),
            ));
        }
    }
    if https != 0 && https != endpoints.len() {
        return Err(err(
            "etcd",
            "mixes http:// and https:// endpoints: use one scheme for every endpoint",
        ));
    }
    let tls = https != 0;
    let ca = non_empty(pick!(cli, file, etcd_ca), "etcd-ca")?;
    let cert = non_empty(pick!(cli, file, etcd_cert), "etcd-cert")?;
    let key = non_empty(pick!(cli, file, etcd_key), "etcd-key")?;
    if !tls {
        for (flag, set) in [
            ("etcd-ca", ca.is_some()),
            ("etcd-cert", cert.is_some()),
            ("etcd-key", key.is_some()),
        ] {
            if set {
                return Err(err(
                    flag,
                    "is for TLS, but the --etcd endpoints are http://: use https:// endpoints",
                ));
            }
        }
    } else {
        // Reads SSL_CERT_FILE and --etcd-ca now; the error names the file.
        sluice_protocol::tls::extra_roots(ca.as_deref()).map_err(|e| err("etcd-ca", e))?;
    }
    let identity = match (cert, key) {
        (Some(c), Some(k)) => {
            sluice_protocol::tls::load_certs(&c).map_err(|e| err("etcd-cert", e))?;
            sluice_protocol::tls::load_key(&k).map_err(|e| err("etcd-key", e))?;
            Some((c, k))
        }
        (None, None) => None,
        (Some(_), None) => return Err(err("etcd-key", "--etcd-cert needs --etcd-key")),
        (None, Some(_)) => return Err(err("etcd-cert", "--etcd-key needs --etcd-cert")),
    };
    let user = pick!(cli, file, etcd_user);
    let password_file = non_empty(pick!(cli, file, etcd_password_file), "etcd-password-file")?;
    let password_env = std::env::var("SLUICE_ETCD_PASSWORD")
        .ok()
        .filter(|v| !v.is_empty());
    let password = match (password_file, password_env) {
        (Some(_), Some(_)) => {
            return Err(err(
                "etcd-password-file",
                "given together with SLUICE_ETCD_PASSWORD: use one",
            ));
        }
        (Some(f), None) => Some(Secret::new(
            sluice_protocol::tls::read_secret_file(&f).map_err(|e| err("etcd-password-file", e))?,
        )),
        (None, Some(p)) => Some(Secret::new(p)),
        (None, None) => None,
    };
    let user = match (user, password) {
        (Some(u), Some(p)) => {
            if u.is_empty() || u.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(err("etcd-user", "1 or more characters, no whitespace"));
            }
            Some((u, p))
        }
        (None, None) => None,
        (Some(_), None) => {
            return Err(err(
                "etcd-user",
                "needs a password: --etcd-password-file (or SLUICE_ETCD_PASSWORD)",
            ));
        }
        (None, Some(_)) => {
            return Err(err(
                "etcd-password-file",
                "a password is given (file or SLUICE_ETCD_PASSWORD) but no --etcd-user",
            ));
        }
    };
    Ok(EtcdLink {
        tls,
        ca,
        identity,
        user,
    })
}

fn listener_tls(cli: &Cli, file: &FileConfig) -> Result<Option<ListenerTls>, ConfigError> {
    let cert = non_empty(pick!(cli, file, tls_cert), "tls-cert")?;
    let key = non_empty(pick!(cli, file, tls_key), "tls-key")?;
    match (cert, key) {
        (None, None) => Ok(None),
        (Some(_), None) => Err(err("tls-key", "--tls-cert needs --tls-key")),
        (None, Some(_)) => Err(err("tls-cert", "--tls-key needs --tls-cert")),
        (Some(cert), Some(key)) => {
            let tls = ListenerTls { cert, key };
            tls.server_config()?;
            Ok(Some(tls))
        }
    }
}

impl ListenerTls {
    /// The rustls server configuration (ring provider; HTTP/1.1, as the server speaks). Reads
    /// both files; errors name the flag and the file, never the key.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, ConfigError> {
        let certs = sluice_protocol::tls::load_certs(&self.cert).map_err(|e| err("tls-cert", e))?;
        let key = sluice_protocol::tls::load_key(&self.key).map_err(|e| err("tls-key", e))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| err("tls-cert", e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            err(
                "tls-key",
                format!(
                    "{} does not fit {} ({e})",
                    self.key.display(),
                    self.cert.display()
                ),
            )
        })?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(cfg)
    }
}

impl Config {
    /// Builds the configuration from parsed flags (and the file they name).
    pub fn from_cli(cli: Cli) -> Result<Self, ConfigError> {
        let file: FileConfig = flags::read_file(cli.config.as_deref())?;

        let etcd_raw: String = pick!(cli, file, etcd, "http://127.0.0.1:2379");
        let etcd: Vec<String> = etcd_raw
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if etcd.is_empty() {
            return Err(err("etcd", "no endpoint given"));
        }
        let etcd_link = etcd_link(&cli, &file, &etcd)?;
        let tls = listener_tls(&cli, &file)?;

        let link = cli.redis_flags.link(&flags::redis_keys!(file))?;
        let (redis, redis_security) = (link.target, link.security);

        let listen_raw: String = pick!(cli, file, listen, "127.0.0.1:8080");
        let listen: SocketAddr = listen_raw.parse().map_err(|e| {
            err(
                "listen",
                format!("{listen_raw:?} is not an address like 127.0.0.1:8080 ({e})"),
            )
        })?;

        let namespace: String = pick!(cli, file, namespace, sluice_protocol::DEFAULT_NAMESPACE);
        validate_namespace(&namespace).map_err(|e| err("namespace", e.to_string()))?;

        let node_id: String = pick!(cli, file, node_id).unwrap_or_else(|| {
            let host = gethostname::gethostname().to_string_lossy().into_owned();
            format!("{host}:{}", listen.port())
        });
        if node_id.is_empty()
            || node_id.len() > 128
            || node_id
                .chars()
                .any(|c| c == '/' || c.is_whitespace() || c.is_control())
        {
            return Err(err(
                "node-id",
                format!("{node_id:?}: 1-128 characters, no '/' or whitespace"),
            ));
        }
        let advertise: String = pick!(cli, file, advertise, listen.to_string());

        let lease_ttl = duration("lease-ttl", &pick!(cli, file, lease_ttl, "3s"))?;
        if lease_ttl.subsec_nanos() != 0 || lease_ttl < Duration::from_secs(1) {
            return Err(err(
                "lease-ttl",
                format!(
                    "{} must be a whole number of seconds, at least 1s (etcd leases count seconds)",
                    humantime::format_duration(lease_ttl)
                ),
            ));
        }
        if lease_ttl > Duration::from_secs(300) {
            return Err(err("lease-ttl", "at most 300s"));
        }
        let tick = duration("tick", &pick!(cli, file, tick, "500ms"))?;
        if !(Duration::from_millis(50)..=Duration::from_secs(10)).contains(&tick) {
            return Err(err("tick", "must be between 50ms and 10s"));
        }
        let control_period = duration("control-period", &pick!(cli, file, control_period, "5s"))?;
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&control_period) {
            return Err(err("control-period", "must be between 1s and 1h"));
        }
        let horizon = duration("horizon", &pick!(cli, file, horizon, "60s"))?;
        if horizon < tick * 2 || horizon > Duration::from_secs(7 * 86_400) {
            return Err(err(
                "horizon",
                "must be at least two ticks and at most 7 days",
            ));
        }
        let retention = duration("retention", &pick!(cli, file, retention, "60s"))?;
        if retention < Duration::from_secs(1) || retention > Duration::from_secs(7 * 86_400) {
            return Err(err("retention", "must be between 1s and 7 days"));
        }
        let fence_stale_after = duration(
            "fence-stale-after",
            &pick!(cli, file, fence_stale_after, "10s"),
        )?;
        let min_stale = tick * 2 + lease_ttl;
        let lazy_after = match pick!(cli, file, lazy_after, "off").trim() {
            "off" | "0" => None,
            v => {
                let d = duration("lazy-after", v)?;
                if d < Duration::from_secs(1) || d > Duration::from_secs(86_400) {
                    return Err(err(
                        "lazy-after",
                        "must be `off`, `0` or between 1s and 24h",
                    ));
                }
                (!d.is_zero()).then_some(d)
            }
        };
        if fence_stale_after < min_stale || fence_stale_after > Duration::from_secs(3600) {
            return Err(err(
                "fence-stale-after",
                format!(
                    "must be at least 2 × --tick + --lease-ttl ({}) and at most 1h",
                    humantime::format_duration(min_stale)
                ),
            ));
        }
        let api_token = token(
            ("api-token", pick!(cli, file, api_token)),
            ("api-token-file", pick!(cli, file, api_token_file)),
        )?;
        let api_read_token = token(
            ("api-read-token", pick!(cli, file, api_read_token)),
            ("api-read-token-file", pick!(cli, file, api_read_token_file)),
        )?;
        let insecure_listen = pick!(cli, file, insecure_listen).unwrap_or(false);
        // Without a token anyone who reaches the listener changes every task and setting:
        // beyond loopback only with a token, or when told so.
        if api_token.is_none() && !insecure_listen && !listen.ip().is_loopback() {
            return Err(err(
                "listen",
                format!(
                    "{listen} is reachable beyond loopback and the manager has no --api-token: \
                     set --api-token-file (or --api-token) to require a token, or \
                     --insecure-listen (SLUICE_INSECURE_LISTEN=true) to serve it without one"
                ),
            ));
        }
        if let Some(read) = &api_read_token {
            match &api_token {
                None => {
                    return Err(err(
                        "api-read-token",
                        "needs --api-token (without an admin token every call is open)",
                    ));
                }
                Some(admin) if admin.matches(read.expose()) => {
                    return Err(err("api-read-token", "must differ from --api-token"));
                }
                Some(_) => {}
            }
        }
        let webhook_allow_private = pick!(cli, file, webhook_allow_private).unwrap_or(false);
        let webhook_ca = pick!(cli, file, webhook_ca);
        if let Some(ca) = &webhook_ca {
            sluice_protocol::tls::load_certs(ca).map_err(|e| err("webhook-ca", e))?;
        }
        let log_json = pick!(cli, file, log_json).unwrap_or(false);

        Ok(Self {
            etcd,
            redis,
            redis_security,
            listen,
            namespace,
            node_id,
            advertise,
            lease_ttl,
            horizon,
            retention,
            tick,
            control_period,
            fence_stale_after,
            lazy_after,
            api_token,
            api_read_token,
            insecure_listen,
            webhook_allow_private,
            webhook_ca,
            log_json,
            etcd_link,
            tls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let mut v = vec!["sluice-manager"];
        v.extend_from_slice(args);
        Config::from_cli(Cli::try_parse_from(v).expect("clap"))
    }

    #[test]
    fn defaults() {
        let c = parse(&["--node-id", "n1"]).unwrap();
        assert_eq!(c.lease_ttl, Duration::from_secs(3));
        assert_eq!(c.horizon, Duration::from_secs(60));
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.advertise, "127.0.0.1:8080");
        assert_eq!(c.namespace, "sluice");
        assert_eq!(c.fence_stale_after, Duration::from_secs(10));
        let c = parse(&["--node-id", "n1", "--fence-stale-after", "4s"]).unwrap();
        assert_eq!(c.fence_stale_after, Duration::from_secs(4));
        assert!(matches!(c.redis, RedisTarget::Single(_)));
        assert_eq!(c.lazy_after, None);
        for (v, want) in [("off", None), ("0", None), ("90s", Some(90))] {
            let c = parse(&["--node-id", "n1", "--lazy-after", v]).unwrap();
            assert_eq!(c.lazy_after, want.map(Duration::from_secs), "{v}");
        }
    }

    #[test]
    fn errors_name_the_flag() {
        for (args, flag) in [
            (&["--lease-ttl", "1500ms"][..], "lease-ttl"),
            (&["--lease-ttl", "soon"][..], "lease-ttl"),
            (&["--listen", "localhost"][..], "listen"),
            (&["--namespace", "a:b"][..], "namespace"),
            (&["--redis", "http://x"][..], "redis"),
            (&["--horizon", "100ms"][..], "horizon"),
            (&["--node-id", "a b"][..], "node-id"),
            (&["--fence-stale-after", "3s"][..], "fence-stale-after"),
            (&["--lazy-after", "500ms"][..], "lazy-after"),
            (&["--lazy-after", "25h"][..], "lazy-after"),
            (&["--lazy-after", "never"][..], "lazy-after"),
            (
                &["--fence-stale-after", "5s", "--lease-ttl", "5s"][..],
                "fence-stale-after",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}: {e}");
            assert!(e.to_string().starts_with(&format!("--{flag}:")), "{e}");
        }
    }

    #[test]
    fn file_is_below_flags() {
        let dir = tempfile_dir();
        let path = dir.join("c.toml");
        std::fs::write(&path, "namespace = \"fromfile\"\nhorizon = \"30s\"\n").unwrap();
        let c = parse(&["--config", path.to_str().unwrap(), "--horizon", "40s"]).unwrap();
        assert_eq!(c.namespace, "fromfile");
        assert_eq!(c.horizon, Duration::from_secs(40));
        std::fs::write(&path, "nmespace = \"typo\"\n").unwrap();
        let e = parse(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert_eq!(e.flag, "config");
        assert!(e.message.contains("nmespace"), "{e}");
    }

    #[test]
    fn tokens_and_webhook_flags() {
        let dir = tempfile_dir();
        let admin = dir.join("admin");
        let read = dir.join("read");
        std::fs::write(&admin, "adm1n-s3cret\n").unwrap();
        std::fs::write(&read, "r3ad-s3cret\n").unwrap();
        let (a, r) = (admin.to_str().unwrap(), read.to_str().unwrap());
        let c = parse(&["--api-token-file", a, "--api-read-token-file", r]).unwrap();
        assert!(c.api_token.as_ref().unwrap().matches("adm1n-s3cret"));
        assert!(c.api_read_token.as_ref().unwrap().matches("r3ad-s3cret"));
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
        assert!(!c.webhook_allow_private);
        assert!(
            parse(&["--webhook-allow-private"])
                .unwrap()
                .webhook_allow_private
        );
        assert!(
            !parse(&["--webhook-allow-private=false"])
                .unwrap()
                .webhook_allow_private
        );
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a cert\n").unwrap();
        for (args, flag) in [
            (vec!["--api-token", "x", "--api-token-file", a], "api-token"),
            (vec!["--api-token-file", "/nonexistent/t"], "api-token-file"),
            (
                vec!["--api-token-file", empty.to_str().unwrap()],
                "api-token-file",
            ),
            (vec!["--api-token", " "], "api-token"),
            (vec!["--api-read-token", "r"], "api-read-token"),
            (
                vec!["--api-token", "same", "--api-read-token", "same"],
                "api-read-token",
            ),
            (vec!["--webhook-ca", junk.to_str().unwrap()], "webhook-ca"),
        ] {
            let e = parse(&args).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}: {e}");
            assert!(!e.to_string().contains("s3cret"), "{e}");
        }
    }

    /// Issue 23 item 4: a TOML error never quotes the file's text: the line at fault may hold
    /// the token or a Redis URL with its password. It says where (line, column) and what.
    #[test]
    fn file_errors_never_quote_the_file() {
        let dir = tempfile_dir();
        let f = dir.join("quoted.toml");
        for text in [
            "api_token = s3cret-unquoted\n",
            "api_token = \"s3cret-quoted\nnamespace = \"n\"\n",
            "redis = redis://u:s3cretpw@h:6379\n",
            "api_token = [\"s3cret-in-a-list\"]\n",
            "api_token = 5339\n",
            "log_json = \"s3cret-for-a-bool\"\n",
            "insecure_listen = \"s3cret\"\n",
            "s3cret-bare-line\n",
        ] {
            std::fs::write(&f, text).unwrap();
            let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
            assert_eq!(e.flag, "config", "{e}");
            let shown = e.to_string();
            assert!(
                !shown.contains("s3cret") && !shown.contains("5339"),
                "{text:?}: {shown}"
            );
            assert!(shown.contains("line 1"), "{text:?}: {shown}");
            assert!(
                shown.contains(f.to_str().unwrap()),
                "the file is named: {shown}"
            );
        }
        // Unknown keys are still named (a key is no secret).
        std::fs::write(&f, "\nnmespace = \"typo\"\n").unwrap();
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
        assert!(
            e.message.contains("nmespace") && e.message.contains("line 2"),
            "{e}"
        );
    }

    /// Issue 23 item 16: the API is not served beyond loopback without a token unless told so.
    #[test]
    fn a_listener_beyond_loopback_needs_a_token_or_the_flag() {
        for addr in ["0.0.0.0:18080", "[::]:18080", "10.1.2.3:18080"] {
            let e = parse(&["--node-id", "n1", "--listen", addr]).unwrap_err();
            assert_eq!(e.flag, "listen", "{e}");
            assert!(
                e.message.contains("--api-token") && e.message.contains("--insecure-listen"),
                "{e}"
            );
            let c = parse(&["--node-id", "n1", "--listen", addr, "--insecure-listen"]).unwrap();
            assert!(c.insecure_listen);
            parse(&["--node-id", "n1", "--listen", addr, "--api-token", "t0k3n"]).unwrap();
            let e = parse(&[
                "--node-id",
                "n1",
                "--listen",
                addr,
                "--insecure-listen=false",
            ])
            .unwrap_err();
            assert_eq!(e.flag, "listen", "{e}");
        }
        // Loopback, v4 and v6, needs neither.
        for addr in ["127.0.0.1:18080", "127.3.4.5:18080", "[::1]:18080"] {
            let c = parse(&["--node-id", "n1", "--listen", addr]).unwrap();
            assert!(!c.insecure_listen);
        }
    }

    #[test]
    fn etcd_tls_and_auth_errors_name_the_flag() {
        let dir = tempfile_dir();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not pem\n").unwrap();
        let missing = dir.join("missing.pem");
        let junk = junk.to_str().unwrap();
        let missing = missing.to_str().unwrap();
        let https = "https://127.0.0.1:2379";
        for (args, flag) in [
            (
                vec!["--etcd", "https://127.0.0.1:2379,http://127.0.0.1:2380"],
                "etcd",
            ),
            (vec!["--etcd", "unix://x"], "etcd"),
            (vec!["--etcd-ca", junk], "etcd-ca"),
            (vec!["--etcd", https, "--etcd-ca", junk], "etcd-ca"),
            (vec!["--etcd", https, "--etcd-ca", missing], "etcd-ca"),
            (vec!["--etcd", https, "--etcd-cert", junk], "etcd-key"),
            (vec!["--etcd", https, "--etcd-key", junk], "etcd-cert"),
            (
                vec!["--etcd", https, "--etcd-cert", missing, "--etcd-key", junk],
                "etcd-cert",
            ),
            (vec!["--etcd-user", "root"], "etcd-user"),
            (vec!["--etcd-password-file", junk], "etcd-password-file"),
            (
                vec!["--etcd-user", "root", "--etcd-password-file", missing],
                "etcd-password-file",
            ),
            (vec!["--tls-cert", junk], "tls-key"),
            (vec!["--tls-key", junk], "tls-cert"),
            (vec!["--tls-cert", missing, "--tls-key", junk], "tls-cert"),
            (vec!["--tls-cert", junk, "--tls-key", junk], "tls-cert"),
        ] {
            let mut a = vec!["--node-id", "n1"];
            a.extend(args.iter().copied());
            let e = parse(&a).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}: {e}");
        }
    }

    #[test]
    fn etcd_password_file_is_read_and_never_shown() {
        let dir = tempfile_dir();
        let pw = dir.join("etcd-password");
        std::fs::write(&pw, "hunter2-etcd\n").unwrap();
        let c = parse(&[
            "--node-id",
            "n1",
            "--etcd",
            "http://127.0.0.1:2379",
            "--etcd-user",
            "sluice",
            "--etcd-password-file",
            pw.to_str().unwrap(),
        ])
        .unwrap();
        let (user, secret) = c.etcd_link.user.clone().unwrap();
        assert_eq!(user, "sluice");
        assert_eq!(secret.expose(), "hunter2-etcd");
        assert!(!c.etcd_link.tls);
        assert!(!format!("{c:?}").contains("hunter2"));
        // An empty file is refused, naming the flag and not the content.
        std::fs::write(&pw, "\n").unwrap();
        let e = parse(&[
            "--etcd-user",
            "sluice",
            "--etcd-password-file",
            pw.to_str().unwrap(),
        ])
        .unwrap_err();
        assert_eq!(e.flag, "etcd-password-file");
        let c = parse(&["--node-id", "n1", "--etcd", "https://a:1,https://b:2"]).unwrap();
        assert!(c.etcd_link.tls);
    }

    #[test]
    fn redis_security_flags() {
        let dir = tempfile_dir();
        let pw = dir.join("redis-pw");
        std::fs::write(&pw, "s3cret-pw\n").unwrap();
        let pw_s = pw.to_str().unwrap();
        let c = parse(&[
            "--node-id",
            "n1",
            "--redis",
            "rediss://127.0.0.1:6380",
            "--redis-user",
            "mgr",
            "--redis-password-file",
            pw_s,
            "--redis-insecure",
        ])
        .unwrap();
        assert!(c.redis_security.insecure);
        assert_eq!(c.redis_security.user.as_deref(), Some("mgr"));
        assert!(!format!("{:?}", c).contains("s3cret-pw"));
        let missing = dir.join("missing.pem");
        let missing_s = missing.to_str().unwrap();
        for (args, flag) in [
            (
                &["--redis", "redis://x:1", "--redis-ca", missing_s][..],
                "redis-ca",
            ),
            (
                &["--redis", "rediss://x:1", "--redis-ca", missing_s][..],
                "redis-ca",
            ),
            (
                &["--redis", "rediss://x:1", "--redis-cert", pw_s][..],
                "redis-key",
            ),
            (
                &["--redis", "rediss://x:1", "--redis-key", pw_s][..],
                "redis-cert",
            ),
            (
                &["--redis", "redis://x:1", "--redis-insecure"][..],
                "redis-insecure",
            ),
            (
                &["--redis", "rediss://u:p@x:1", "--redis-password-file", pw_s][..],
                "redis-password-file",
            ),
            (
                &[
                    "--redis",
                    "rediss://x:1",
                    "--redis-password-file",
                    missing_s,
                ][..],
                "redis-password-file",
            ),
            (
                &["--redis", "rediss://x:1", "--redis-user", "u"][..],
                "redis-user",
            ),
            (
                &["--redis", "redis://u:hunter2@x:1,rediss://y:2"][..],
                "redis",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}: {e}");
            let text = e.to_string();
            assert!(
                !text.contains("s3cret-pw") && !text.contains("hunter2"),
                "{text}"
            );
        }
        // A bad URL with a password is named without it.
        let e = parse(&["--redis", "redis://u:hunter2@"]).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("sluice-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
