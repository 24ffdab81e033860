//! Configuration: command-line flags, each also an environment variable `SLUICE_<FLAG>` and a
//! key of the TOML file given by `--config`. Precedence: flag > environment > file > default.
//!
//! Everything is validated here, once, with errors that name the flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use sluice::protocol::conn::{ConnOptions, Redis, RedisSecurity, RedisTarget};
use sluice::protocol::validate_namespace;

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
    /// Redis URL, or a comma-separated list of Redis Cluster nodes [default: redis://127.0.0.1:6379]
    #[arg(long, env = "SLUICE_REDIS")]
    pub redis: Option<String>,
    // ── Redis TLS and ACL (branch tls-redis) ──
    /// CA bundle (PEM) trusted for rediss:// besides the platform's and SSL_CERT_FILE
    #[arg(long, env = "SLUICE_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS to Redis (with --redis-key)
    #[arg(long, env = "SLUICE_REDIS_CERT")]
    pub redis_cert: Option<PathBuf>,
    /// Private key (PEM) of --redis-cert
    #[arg(long, env = "SLUICE_REDIS_KEY")]
    pub redis_key: Option<PathBuf>,
    /// Skip verifying Redis's TLS certificate (tests only; logged as a warning)
    #[arg(long, env = "SLUICE_REDIS_INSECURE", num_args = 0..=1, default_missing_value = "true")]
    pub redis_insecure: Option<bool>,
    /// Redis ACL user (default: the URL's user name)
    #[arg(long, env = "SLUICE_REDIS_USER")]
    pub redis_user: Option<String>,
    /// File holding the Redis password (default: the URL's password)
    #[arg(long, env = "SLUICE_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,
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
    /// Bearer token required by mutating API calls (unset = no auth)
    #[arg(long, env = "SLUICE_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Log as JSON lines instead of text
    #[arg(long, env = "SLUICE_LOG_JSON")]
    pub log_json: Option<bool>,
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
    api_token: Option<String>,
    log_json: Option<bool>,
}

/// A configuration error, naming the flag.
#[derive(Debug, thiserror::Error)]
#[error("--{flag}: {message}")]
pub struct ConfigError {
    /// The flag (without dashes).
    pub flag: &'static str,
    /// What is wrong.
    pub message: String,
}

fn err(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        message: message.into(),
    }
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
    /// API token.
    pub api_token: Option<String>,
    /// JSON logs.
    pub log_json: bool,
}

fn duration(flag: &'static str, raw: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(raw.trim()).map_err(|e| {
        err(
            flag,
            format!("{raw:?} is not a duration like 3s or 500ms ({e})"),
        )
    })
}

impl Config {
    /// Builds the configuration from parsed flags (and the file they name).
    pub fn from_cli(cli: Cli) -> Result<Self, ConfigError> {
        let file = match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| err("config", format!("cannot read {}: {e}", path.display())))?;
                toml::from_str::<FileConfig>(&text)
                    .map_err(|e| err("config", format!("{}: {e}", path.display())))?
            }
            None => FileConfig::default(),
        };
        macro_rules! pick {
            ($f:ident, $default:expr) => {
                cli.$f
                    .clone()
                    .or(file.$f.clone())
                    .unwrap_or_else(|| $default.into())
            };
        }

        let etcd_raw: String = pick!(etcd, "http://127.0.0.1:2379");
        let etcd: Vec<String> = etcd_raw
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if etcd.is_empty() {
            return Err(err("etcd", "no endpoint given"));
        }
        for e in &etcd {
            if e.starts_with("https://") {
                return Err(err(
                    "etcd",
                    format!("{e}: TLS endpoints are not supported yet"),
                ));
            }
        }

        let redis_raw: String = pick!(redis, "redis://127.0.0.1:6379");
        let redis = RedisTarget::parse(&redis_raw).map_err(|e| err("redis", e))?;
        let redis_security = RedisSecurity {
            ca_file: cli.redis_ca.clone().or(file.redis_ca.clone()),
            cert_file: cli.redis_cert.clone().or(file.redis_cert.clone()),
            key_file: cli.redis_key.clone().or(file.redis_key.clone()),
            insecure: cli.redis_insecure.or(file.redis_insecure).unwrap_or(false),
            user: cli.redis_user.clone().or(file.redis_user.clone()),
            password: None,
            password_file: cli
                .redis_password_file
                .clone()
                .or(file.redis_password_file.clone()),
        };
        // Reads every file now: a bad path or a conflict is an error naming its flag.
        Redis::with_security(redis.clone(), ConnOptions::default(), &redis_security)
            .map_err(|e| err(e.flag(), e.message))?;

        let listen_raw: String = pick!(listen, "127.0.0.1:8080");
        let listen: SocketAddr = listen_raw.parse().map_err(|e| {
            err(
                "listen",
                format!("{listen_raw:?} is not an address like 127.0.0.1:8080 ({e})"),
            )
        })?;

        let namespace: String = pick!(namespace, sluice::protocol::DEFAULT_NAMESPACE);
        validate_namespace(&namespace).map_err(|e| err("namespace", e.to_string()))?;

        let node_id: String = cli
            .node_id
            .clone()
            .or(file.node_id.clone())
            .unwrap_or_else(|| {
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
        let advertise: String = pick!(advertise, listen.to_string());

        let lease_ttl = duration("lease-ttl", &pick!(lease_ttl, "3s"))?;
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
        let tick = duration("tick", &pick!(tick, "500ms"))?;
        if !(Duration::from_millis(50)..=Duration::from_secs(10)).contains(&tick) {
            return Err(err("tick", "must be between 50ms and 10s"));
        }
        let control_period = duration("control-period", &pick!(control_period, "5s"))?;
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&control_period) {
            return Err(err("control-period", "must be between 1s and 1h"));
        }
        let horizon = duration("horizon", &pick!(horizon, "60s"))?;
        if horizon < tick * 2 || horizon > Duration::from_secs(7 * 86_400) {
            return Err(err(
                "horizon",
                "must be at least two ticks and at most 7 days",
            ));
        }
        let retention = duration("retention", &pick!(retention, "60s"))?;
        if retention < Duration::from_secs(1) || retention > Duration::from_secs(7 * 86_400) {
            return Err(err("retention", "must be between 1s and 7 days"));
        }
        let fence_stale_after = duration("fence-stale-after", &pick!(fence_stale_after, "10s"))?;
        let min_stale = tick * 2 + lease_ttl;
        if fence_stale_after < min_stale || fence_stale_after > Duration::from_secs(3600) {
            return Err(err(
                "fence-stale-after",
                format!(
                    "must be at least 2 × --tick + --lease-ttl ({}) and at most 1h",
                    humantime::format_duration(min_stale)
                ),
            ));
        }
        let api_token = cli.api_token.clone().or(file.api_token.clone());
        if api_token.as_deref().is_some_and(str::is_empty) {
            return Err(err("api-token", "must not be empty when set"));
        }
        let log_json = cli.log_json.or(file.log_json).unwrap_or(false);

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
            api_token,
            log_json,
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
