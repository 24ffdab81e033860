//! Configuration: command-line flags, each also an environment variable `SLUICE_AGENT_<FLAG>`
//! and a key of the TOML file given by `--config`. Precedence: flag > environment > file >
//! default. Everything is validated here, once, with errors that name the flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use sluice_protocol::conn::RedisSecurity;
use sluice_protocol::flags::{self, RedisArgs, duration, err, pick, token};
use sluice_protocol::validate_namespace;

pub use sluice_protocol::flags::{ConfigError, Token};

sluice_protocol::flags::redis_env!(
    /// The environment variables of the agent's Redis flags (`SLUICE_AGENT_REDIS`, …).
    pub AgentEnv = "SLUICE_AGENT_"
);

/// Command-line flags (every one also `SLUICE_AGENT_<FLAG>` in the environment).
#[derive(Debug, Default, Parser)]
#[command(
    name = "sluice-agent",
    version,
    about = "Sluice host agent: Envoy's rate-limit service (RLS v3), its quota service (RLQS) \
and an HTTP decision API, decided from the host's shared Sluice quota"
)]
pub struct Cli {
    /// TOML file with any of the settings below (keys as the flags, with `_` for `-`).
    #[arg(long, env = "SLUICE_AGENT_CONFIG")]
    pub config: Option<PathBuf>,
    /// `--redis`, `--redis-ca`, `--redis-cert`, `--redis-key`, `--redis-insecure`,
    /// `--redis-user`, `--redis-password-file` (`SLUICE_AGENT_REDIS…`).
    #[command(flatten)]
    pub redis_flags: RedisArgs<AgentEnv>,
    /// Namespace of every Redis key [default: sluice]
    #[arg(long, env = "SLUICE_AGENT_NAMESPACE")]
    pub namespace: Option<String>,
    /// This host's id: names the shared segment (shared with the host's SDK users) [default: the hostname]
    #[arg(long, env = "SLUICE_AGENT_HOST_ID")]
    pub host_id: Option<String>,
    /// Directory of the host's shared segment [default: /dev/shm]
    #[arg(long, env = "SLUICE_AGENT_SEGMENT_DIR")]
    pub segment_dir: Option<PathBuf>,
    /// Task slots of a new host segment [default: 64]
    #[arg(long, env = "SLUICE_AGENT_MAX_TASKS")]
    pub max_tasks: Option<u32>,
    /// Entries of a new host key table (keyed tasks) [default: 16384]
    #[arg(long, env = "SLUICE_AGENT_KEY_SLOTS")]
    pub key_slots: Option<u32>,
    /// gRPC listen address (Envoy RLS v3 and RLQS) [default: 127.0.0.1:8081]
    #[arg(long, env = "SLUICE_AGENT_GRPC_LISTEN")]
    pub grpc_listen: Option<String>,
    /// HTTP listen address (POST /v1/decide, /metrics, /healthz, /readyz) [default: 127.0.0.1:8082]
    #[arg(long, env = "SLUICE_AGENT_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    /// Add x-ratelimit-limit / -remaining / -reset to RLS answers (as envoyproxy/ratelimit's
    /// LIMIT_RESPONSE_HEADERS_ENABLED does)
    #[arg(long, env = "SLUICE_AGENT_RESPONSE_HEADERS", num_args = 0..=1, default_missing_value = "true")]
    pub response_headers: Option<bool>,
    /// Longest wait of one decision for a refill of its quota [default: 1s]
    #[arg(long, env = "SLUICE_AGENT_ACQUIRE_TIMEOUT")]
    pub acquire_timeout: Option<String>,
    /// How often the Envoy domain configurations are re-read from Redis [default: 1s]
    #[arg(long, env = "SLUICE_AGENT_ROUTES_REFRESH")]
    pub routes_refresh: Option<String>,
    /// RLQS: lifetime of the assignments made while Redis is unusable (FAILED), capped to the
    /// slice's end; at least 1s (Envoy counts whole seconds) [default: 10s]
    #[arg(long, env = "SLUICE_AGENT_RLQS_ASSIGNMENT_TTL")]
    pub rlqs_assignment_ttl: Option<String>,
    /// RLQS: a bucket without reports for this long is abandoned [default: 60s]
    #[arg(long, env = "SLUICE_AGENT_RLQS_ABANDON_AFTER")]
    pub rlqs_abandon_after: Option<String>,
    /// Log as JSON lines
    #[arg(long, env = "SLUICE_AGENT_LOG_JSON", num_args = 0..=1, default_missing_value = "true")]
    pub log_json: Option<bool>,
    // ── Authentication (docs/agent.md, "Authentication") ──
    /// Bearer token required on decisions: HTTP `POST /v1/decide` (`Authorization: Bearer …`)
    /// and gRPC RLS/RLQS (metadata `authorization: Bearer …`) (unset = no auth)
    #[arg(long, env = "SLUICE_AGENT_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// File holding the API token (instead of --api-token, kept out of the process list)
    #[arg(long, env = "SLUICE_AGENT_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
    /// Serve listeners beyond loopback without a token (anyone who reaches them can spend any
    /// task's quota)
    #[arg(long, env = "SLUICE_AGENT_INSECURE_LISTEN", num_args = 0..=1, default_missing_value = "true")]
    pub insecure_listen: Option<bool>,
    // ── Bounds (docs/agent.md, "Bounds") ──
    /// Most tasks the agent holds open at once, each a slot of the host segment [default: half
    /// of --max-tasks]
    #[arg(long, env = "SLUICE_AGENT_MAX_AGENT_TASKS")]
    pub max_agent_tasks: Option<u32>,
    /// Most decision requests handled at once (HTTP `POST /v1/decide` and RLS calls together)
    /// [default: 1024]
    #[arg(long, env = "SLUICE_AGENT_MAX_CONCURRENT_REQUESTS")]
    pub max_concurrent_requests: Option<u32>,
    /// Longest time one decision request (a whole batch, an RLS call) takes [default: 2s]
    #[arg(long, env = "SLUICE_AGENT_REQUEST_TIMEOUT")]
    pub request_timeout: Option<String>,
    /// Most requests in one `POST /v1/decide` batch [default: 1000]
    #[arg(long, env = "SLUICE_AGENT_MAX_BATCH")]
    pub max_batch: Option<u32>,
    /// Largest HTTP body and gRPC message accepted, in bytes [default: 1048576]
    #[arg(long, env = "SLUICE_AGENT_MAX_REQUEST_BYTES")]
    pub max_request_bytes: Option<u32>,
    /// Most RLQS streams open at once [default: 256]
    #[arg(long, env = "SLUICE_AGENT_RLQS_MAX_STREAMS")]
    pub rlqs_max_streams: Option<u32>,
    /// Most RLQS buckets tracked per stream [default: 10000]
    #[arg(long, env = "SLUICE_AGENT_RLQS_MAX_BUCKETS_PER_STREAM")]
    pub rlqs_max_buckets_per_stream: Option<u32>,
    /// Most RLQS buckets tracked over all streams [default: 50000]
    #[arg(long, env = "SLUICE_AGENT_RLQS_MAX_BUCKETS")]
    pub rlqs_max_buckets: Option<u32>,
}

/// The TOML file: the same settings as [`Cli`]; unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    redis: Option<String>,
    redis_ca: Option<PathBuf>,
    redis_cert: Option<PathBuf>,
    redis_key: Option<PathBuf>,
    redis_insecure: Option<bool>,
    redis_user: Option<String>,
    redis_password_file: Option<PathBuf>,
    namespace: Option<String>,
    host_id: Option<String>,
    segment_dir: Option<PathBuf>,
    max_tasks: Option<u32>,
    key_slots: Option<u32>,
    grpc_listen: Option<String>,
    http_listen: Option<String>,
    response_headers: Option<bool>,
    acquire_timeout: Option<String>,
    routes_refresh: Option<String>,
    rlqs_assignment_ttl: Option<String>,
    rlqs_abandon_after: Option<String>,
    log_json: Option<bool>,
    api_token: Option<String>,
    api_token_file: Option<PathBuf>,
    insecure_listen: Option<bool>,
    max_agent_tasks: Option<u32>,
    max_concurrent_requests: Option<u32>,
    request_timeout: Option<String>,
    max_batch: Option<u32>,
    max_request_bytes: Option<u32>,
    rlqs_max_streams: Option<u32>,
    rlqs_max_buckets_per_stream: Option<u32>,
    rlqs_max_buckets: Option<u32>,
}

/// The validated configuration of one agent.
#[derive(Debug, Clone)]
pub struct Config {
    /// Redis (URL or Cluster node list, as given).
    pub redis: String,
    /// TLS and ACL settings of the Redis link (files checked when the config was built).
    pub redis_security: RedisSecurity,
    /// Namespace.
    pub namespace: String,
    /// Host id (names the shared segment).
    pub host_id: String,
    /// Directory of the shared segment.
    pub segment_dir: PathBuf,
    /// Task slots of a new segment.
    pub max_tasks: u32,
    /// Entries of a new key table.
    pub key_slots: u32,
    /// gRPC listen address.
    pub grpc_listen: SocketAddr,
    /// HTTP listen address.
    pub http_listen: SocketAddr,
    /// Fill `x-ratelimit-*` headers in RLS answers.
    pub response_headers: bool,
    /// Longest wait of one decision for a refill.
    pub acquire_timeout: Duration,
    /// Period of re-reading the Envoy domain configurations.
    pub routes_refresh: Duration,
    /// RLQS: lifetime of the assignments made while FAILED (for `on_failure: local` capped to the slice's end).
    pub rlqs_assignment_ttl: Duration,
    /// RLQS: abandon a bucket unreported for this long.
    pub rlqs_abandon_after: Duration,
    /// JSON logs.
    pub log_json: bool,
    /// Token required on decisions (HTTP and gRPC); `None`: no authentication.
    pub api_token: Option<Token>,
    /// Listeners beyond loopback are allowed without a token.
    pub insecure_listen: bool,
    /// Most tasks the agent holds open (segment slots) at once.
    pub max_agent_tasks: u32,
    /// Most decision requests handled at once.
    pub max_concurrent_requests: u32,
    /// Longest time of one decision request (a whole batch, an RLS call).
    pub request_timeout: Duration,
    /// Most requests in one batch.
    pub max_batch: u32,
    /// Largest HTTP body / gRPC message.
    pub max_request_bytes: u32,
    /// Most RLQS streams open at once.
    pub rlqs_max_streams: u32,
    /// Most RLQS buckets per stream.
    pub rlqs_max_buckets_per_stream: u32,
    /// Most RLQS buckets over all streams.
    pub rlqs_max_buckets: u32,
}

/// A count flag within `min ..= max`.
fn count(flag: &'static str, v: u32, min: u32, max: u32) -> Result<u32, ConfigError> {
    if v < min || v > max {
        return Err(err(flag, format!("{v} is outside {min} ..= {max}")));
    }
    Ok(v)
}

fn bounded(
    flag: &'static str,
    raw: &str,
    min: Duration,
    max: Duration,
) -> Result<Duration, ConfigError> {
    let d = duration(flag, raw)?;
    if d < min || d > max {
        return Err(err(
            flag,
            format!(
                "{} is outside {} ..= {}",
                humantime::format_duration(d),
                humantime::format_duration(min),
                humantime::format_duration(max)
            ),
        ));
    }
    Ok(d)
}

fn address(flag: &'static str, raw: &str) -> Result<SocketAddr, ConfigError> {
    raw.parse().map_err(|e| {
        err(
            flag,
            format!("{raw:?} is not an address like 127.0.0.1:8081 ({e})"),
        )
    })
}

impl Config {
    /// Builds the configuration from parsed flags (and the file they name).
    pub fn from_cli(cli: Cli) -> Result<Self, ConfigError> {
        let file: FileConfig = flags::read_file(cli.config.as_deref())?;
        let link = cli.redis_flags.link(&flags::redis_keys!(file))?;
        let (redis, redis_security) = (link.url, link.security);

        let namespace: String = pick!(cli, file, namespace, sluice_protocol::DEFAULT_NAMESPACE);
        validate_namespace(&namespace).map_err(|e| err("namespace", e.to_string()))?;

        let host_id: String = pick!(
            cli,
            file,
            host_id,
            gethostname::gethostname().to_string_lossy().into_owned()
        );
        if host_id.is_empty()
            || host_id.len() > 128
            || !host_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b':'))
        {
            return Err(err(
                "host-id",
                format!("{host_id:?}: 1-128 characters of A-Z a-z 0-9 _ . - :"),
            ));
        }
        let segment_dir: PathBuf = pick!(cli, file, segment_dir, PathBuf::from("/dev/shm"));
        let max_tasks = pick!(cli, file, max_tasks).unwrap_or(sluice::DEFAULT_MAX_TASKS);
        if max_tasks == 0 || max_tasks > sluice::MAX_TASKS {
            return Err(err(
                "max-tasks",
                format!("{max_tasks} is outside 1 ..= {}", sluice::MAX_TASKS),
            ));
        }
        let key_slots = pick!(cli, file, key_slots).unwrap_or(sluice::DEFAULT_KEY_SLOTS);
        if key_slots == 0 || key_slots > sluice::MAX_KEY_SLOTS {
            return Err(err(
                "key-slots",
                format!("{key_slots} is outside 1 ..= {}", sluice::MAX_KEY_SLOTS),
            ));
        }
        let grpc_listen = address(
            "grpc-listen",
            &pick!(cli, file, grpc_listen, "127.0.0.1:8081"),
        )?;
        let http_listen = address(
            "http-listen",
            &pick!(cli, file, http_listen, "127.0.0.1:8082"),
        )?;
        if grpc_listen == http_listen {
            return Err(err(
                "http-listen",
                format!("{http_listen} is also --grpc-listen"),
            ));
        }
        let acquire_timeout = bounded(
            "acquire-timeout",
            &pick!(cli, file, acquire_timeout, "1s"),
            Duration::from_millis(1),
            Duration::from_secs(60),
        )?;
        let routes_refresh = bounded(
            "routes-refresh",
            &pick!(cli, file, routes_refresh, "1s"),
            Duration::from_millis(50),
            Duration::from_secs(300),
        )?;
        // Envoy counts whole seconds of a TTL: under 1 s it would expire at once.
        let rlqs_assignment_ttl = bounded(
            "rlqs-assignment-ttl",
            &pick!(cli, file, rlqs_assignment_ttl, "10s"),
            Duration::from_secs(1),
            Duration::from_secs(86_400),
        )?;
        let rlqs_abandon_after = bounded(
            "rlqs-abandon-after",
            &pick!(cli, file, rlqs_abandon_after, "60s"),
            Duration::from_millis(100),
            Duration::from_secs(86_400),
        )?;
        let api_token = token(
            ("api-token", pick!(cli, file, api_token)),
            ("api-token-file", pick!(cli, file, api_token_file)),
        )?;
        let insecure_listen = pick!(cli, file, insecure_listen).unwrap_or(false);
        // Anyone who reaches a decision listener can spend any task's quota: beyond loopback
        // only with a token, or when told so.
        if api_token.is_none() && !insecure_listen {
            for (flag, addr) in [("grpc-listen", grpc_listen), ("http-listen", http_listen)] {
                if !addr.ip().is_loopback() {
                    return Err(err(
                        flag,
                        format!(
                            "{addr} is reachable beyond loopback and the agent has no \
                             --api-token: set --api-token (or --api-token-file) to require \
                             a token, or --insecure-listen to serve it without one"
                        ),
                    ));
                }
            }
        }
        let max_agent_tasks = match pick!(cli, file, max_agent_tasks) {
            Some(n) => count("max-agent-tasks", n, 1, max_tasks)?,
            None => (max_tasks / 2).max(1),
        };
        let max_concurrent_requests = count(
            "max-concurrent-requests",
            pick!(cli, file, max_concurrent_requests).unwrap_or(1_024),
            1,
            1_000_000,
        )?;
        let request_timeout = bounded(
            "request-timeout",
            &pick!(cli, file, request_timeout, "2s"),
            Duration::from_millis(1),
            Duration::from_secs(600),
        )?;
        if request_timeout < acquire_timeout {
            return Err(err(
                "request-timeout",
                format!(
                    "{} is shorter than --acquire-timeout ({}): a request must be able to wait \
                     for one decision",
                    humantime::format_duration(request_timeout),
                    humantime::format_duration(acquire_timeout)
                ),
            ));
        }
        let max_batch = count(
            "max-batch",
            pick!(cli, file, max_batch).unwrap_or(1_000),
            1,
            100_000,
        )?;
        let max_request_bytes = count(
            "max-request-bytes",
            pick!(cli, file, max_request_bytes).unwrap_or(1 << 20),
            1 << 10,
            64 << 20,
        )?;
        let rlqs_max_streams = count(
            "rlqs-max-streams",
            pick!(cli, file, rlqs_max_streams).unwrap_or(256),
            1,
            100_000,
        )?;
        let rlqs_max_buckets = count(
            "rlqs-max-buckets",
            pick!(cli, file, rlqs_max_buckets).unwrap_or(50_000),
            1,
            10_000_000,
        )?;
        let rlqs_max_buckets_per_stream = count(
            "rlqs-max-buckets-per-stream",
            pick!(cli, file, rlqs_max_buckets_per_stream).unwrap_or(10_000.min(rlqs_max_buckets)),
            1,
            rlqs_max_buckets,
        )?;
        Ok(Self {
            redis,
            redis_security,
            namespace,
            host_id,
            segment_dir,
            max_tasks,
            key_slots,
            grpc_listen,
            http_listen,
            response_headers: pick!(cli, file, response_headers).unwrap_or(false),
            acquire_timeout,
            routes_refresh,
            rlqs_assignment_ttl,
            rlqs_abandon_after,
            log_json: pick!(cli, file, log_json).unwrap_or(false),
            api_token,
            insecure_listen,
            max_agent_tasks,
            max_concurrent_requests,
            request_timeout,
            max_batch,
            max_request_bytes,
            rlqs_max_streams,
            rlqs_max_buckets_per_stream,
            rlqs_max_buckets,
        })
    }

    /// The SDK configuration this agent runs its client with.
    pub fn sdk(&self) -> sluice::Config {
        let mut c = sluice::Config::new(self.redis.clone());
        c.redis_security = self.redis_security.clone();
        c.namespace = self.namespace.clone();
        c.host_id = self.host_id.clone();
        c.shm_dir = self.segment_dir.clone();
        c.max_tasks = self.max_tasks;
        c.key_slots = self.key_slots;
        c.acquire_timeout = self.acquire_timeout;
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(args: &[&str]) -> Result<Config, ConfigError> {
        let mut v = vec!["sluice-agent"];
        v.extend_from_slice(args);
        Config::from_cli(Cli::try_parse_from(v).unwrap())
    }

    #[test]
    fn defaults_and_errors_name_the_flag() {
        let c = cfg(&["--host-id", "h1"]).unwrap();
        assert_eq!(c.grpc_listen.to_string(), "127.0.0.1:8081");
        assert_eq!(c.http_listen.to_string(), "127.0.0.1:8082");
        assert_eq!(c.namespace, "sluice");
        for (args, flag) in [
            (vec!["--grpc-listen", "nope"], "grpc-listen"),
            (vec!["--namespace", "a:b"], "namespace"),
            (vec!["--host-id", "a b"], "host-id"),
            (vec!["--acquire-timeout", "2 parsecs"], "acquire-timeout"),
            (vec!["--routes-refresh", "1ms"], "routes-refresh"),
            (vec!["--key-slots", "0"], "key-slots"),
            (
                vec![
                    "--grpc-listen",
                    "127.0.0.1:9",
                    "--http-listen",
                    "127.0.0.1:9",
                ],
                "http-listen",
            ),
            (vec!["--redis", "http://x"], "redis"),
            // Envoy counts whole seconds of an RLQS TTL (issue 23 item 18).
            (
                vec!["--rlqs-assignment-ttl", "500ms"],
                "rlqs-assignment-ttl",
            ),
            (vec!["--max-agent-tasks", "0"], "max-agent-tasks"),
            (
                vec!["--max-tasks", "8", "--max-agent-tasks", "9"],
                "max-agent-tasks",
            ),
            (vec!["--max-batch", "0"], "max-batch"),
            (vec!["--max-request-bytes", "10"], "max-request-bytes"),
            (
                vec!["--max-concurrent-requests", "0"],
                "max-concurrent-requests",
            ),
            (vec!["--request-timeout", "10ms"], "request-timeout"),
            (vec!["--rlqs-max-streams", "0"], "rlqs-max-streams"),
            (
                vec![
                    "--rlqs-max-buckets",
                    "5",
                    "--rlqs-max-buckets-per-stream",
                    "6",
                ],
                "rlqs-max-buckets-per-stream",
            ),
        ] {
            let e = cfg(&args).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}: {e}");
        }
    }

    #[test]
    fn bounds_have_defaults() {
        let c = cfg(&["--host-id", "h1"]).unwrap();
        assert_eq!(c.max_agent_tasks, sluice::DEFAULT_MAX_TASKS / 2);
        assert_eq!(c.max_concurrent_requests, 1_024);
        assert_eq!(c.request_timeout, Duration::from_secs(2));
        assert_eq!(c.max_batch, 1_000);
        assert_eq!(c.max_request_bytes, 1 << 20);
        assert_eq!(c.rlqs_max_streams, 256);
        assert_eq!(c.rlqs_max_buckets_per_stream, 10_000);
        assert_eq!(c.rlqs_max_buckets, 50_000);
        assert_eq!(
            cfg(&["--max-tasks", "1"]).unwrap().max_agent_tasks,
            1,
            "at least one"
        );
    }

    /// Issue 23 item 16: nothing listens beyond loopback without a token unless told so.
    #[test]
    fn listeners_beyond_loopback_need_a_token_or_the_flag() {
        for (flag, addr) in [
            ("grpc-listen", "0.0.0.0:18081"),
            ("http-listen", "0.0.0.0:18082"),
            ("http-listen", "[::]:18082"),
            ("grpc-listen", "10.1.2.3:18081"),
        ] {
            let e = cfg(&[&format!("--{flag}"), addr]).unwrap_err();
            assert_eq!(e.flag, flag, "{e}");
            assert!(
                e.message.contains("--api-token") && e.message.contains("--insecure-listen"),
                "{e}"
            );
            cfg(&[&format!("--{flag}"), addr, "--insecure-listen"]).unwrap();
            cfg(&[&format!("--{flag}"), addr, "--api-token", "t0k3n"]).unwrap();
        }
        // Loopback, v4 and v6, needs neither.
        cfg(&[
            "--grpc-listen",
            "127.0.0.2:18081",
            "--http-listen",
            "[::1]:18082",
        ])
        .unwrap();
    }

    /// The token: inline or from a file (not both, never empty), never shown by `Debug`.
    #[test]
    fn the_token_is_read_and_never_shown() {
        let dir = std::env::temp_dir().join(format!("sluice-agent-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "s3cret-t0ken\n").unwrap();
        let path = f.to_str().unwrap();
        let c = cfg(&["--api-token-file", path]).unwrap();
        assert!(c.api_token.as_ref().unwrap().matches("s3cret-t0ken"));
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
        let c = cfg(&["--api-token", "inline-s3cret"]).unwrap();
        assert!(c.api_token.as_ref().unwrap().matches("inline-s3cret"));
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        for (args, flag) in [
            (
                vec!["--api-token", "x", "--api-token-file", path],
                "api-token",
            ),
            (vec!["--api-token", " "], "api-token"),
            (vec!["--api-token-file", "/nonexistent/t"], "api-token-file"),
            (
                vec!["--api-token-file", empty.to_str().unwrap()],
                "api-token-file",
            ),
        ] {
            let e = cfg(&args).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}: {e}");
            assert!(!e.message.contains("s3cret"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A TOML error never quotes the file's text: the line at fault may hold the token (or a
    /// Redis URL with its password).
    #[test]
    fn file_errors_never_quote_the_file() {
        let dir = std::env::temp_dir().join(format!("sluice-agent-toml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("agent.toml");
        for text in [
            "api_token = s3cret-unquoted\n",
            "api_token = \"s3cret-quoted\nhost_id = \"h\"\n",
            "redis = redis://u:s3cretpw@h:6379\n",
            "api_token = [\"s3cret-in-a-list\"]\n",
            "api_token = 5339\n",
            // A string where a bool or a number belongs: the value is not shown either.
            "log_json = \"s3cret-for-a-bool\"\n",
            "max_batch = \"s3cret-for-a-count\"\n",
        ] {
            std::fs::write(&f, text).unwrap();
            let e = cfg(&["--config", f.to_str().unwrap()]).unwrap_err();
            assert_eq!(e.flag, "config", "{e}");
            assert!(
                !e.message.contains("s3cret") && !e.message.contains("5339"),
                "{text:?}: {e}"
            );
            assert!(e.message.contains("line 1"), "{text:?}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_file_is_read_and_flags_win() {
        let dir = std::env::temp_dir().join(format!("sluice-agent-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("agent.toml");
        std::fs::write(
            &f,
            "namespace = \"filens\"\nhttp_listen = \"127.0.0.1:9999\"\n",
        )
        .unwrap();
        let c = cfg(&["--config", f.to_str().unwrap(), "--namespace", "flagns"]).unwrap();
        assert_eq!(c.namespace, "flagns");
        assert_eq!(c.http_listen.port(), 9999);
        std::fs::write(&f, "nmespace = \"x\"\n").unwrap();
        let e = cfg(&["--config", f.to_str().unwrap()]).unwrap_err();
        assert_eq!(e.flag, "config");
        assert!(e.message.contains("nmespace"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
