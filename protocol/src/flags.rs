//! Command-line and config-file flags shared by the manager and the agent (feature `flags`):
//! one copy of what both binaries parse the same way.
//!
//! Every setting of `sluice-manager` and `sluice-agent` is a flag, an environment variable
//! (`SLUICE_<FLAG>` and `SLUICE_AGENT_<FLAG>`) and a key of the TOML file given by `--config`.
//! Precedence: flag > environment > file > default. Each binary validates its settings once,
//! with errors that name the flag ([`ConfigError`]). This module holds the parts they share:
//!
//! * [`RedisArgs`], the Redis connection flags (`--redis`, `--redis-ca`, `--redis-cert`,
//!   `--redis-key`, `--redis-insecure`, `--redis-user`, `--redis-password-file`), flattened
//!   into each binary's clap parser (`#[command(flatten)]`). The environment variables differ
//!   by binary: [`redis_env!`] names them from a prefix. [`RedisArgs::link`] lays the flags
//!   over the file's keys ([`redis_keys!`]) and checks the link (every file read now);
//! * [`read_file`], the `--config` file, whose errors never quote the file's text;
//! * [`pick!`], one setting: flag (or environment), else the file, else the default;
//! * [`duration`], a duration flag (`3s`, `500ms`);
//! * [`Token`] and [`token`], a secret given inline (`--x`) or in a file (`--x-file`).
//!
//! The worker SDK does not use this module: its `sluice-protocol` has the feature off, so
//! clap, toml and humantime stay out of its dependency tree.

use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::conn::{ConnOptions, Redis, RedisSecurity, RedisTarget};

/// A configuration error, naming the flag.
#[derive(Debug, thiserror::Error)]
#[error("--{flag}: {message}")]
pub struct ConfigError {
    /// The flag (without dashes).
    pub flag: &'static str,
    /// What is wrong.
    pub message: String,
}

/// A [`ConfigError`] for `--flag`.
pub fn err(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        message: message.into(),
    }
}

/// One setting of a binary's flags `$cli` and its config file `$file` (structs with a field
/// `$field` each, an `Option`): the flag (or its environment variable), else the file's key;
/// with a `$default` (converted with `Into`), that when neither is set. The precedence of
/// every setting of both binaries: flag > environment > file > default.
///
/// ```
/// # use sluice_protocol::flags::pick;
/// struct Flags { namespace: Option<String>, max_batch: Option<u32> }
/// struct File { namespace: Option<String>, max_batch: Option<u32> }
/// let cli = Flags { namespace: None, max_batch: Some(7) };
/// let file = File { namespace: Some("shop".into()), max_batch: Some(9) };
/// let namespace: String = pick!(cli, file, namespace, "sluice");
/// assert_eq!(namespace, "shop");
/// assert_eq!(pick!(cli, file, max_batch), Some(7));
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __flags_pick {
    ($cli:expr, $file:expr, $field:ident) => {
        $cli.$field.clone().or($file.$field.clone())
    };
    ($cli:expr, $file:expr, $field:ident, $default:expr) => {
        $crate::flags::pick!($cli, $file, $field).unwrap_or_else(|| $default.into())
    };
}
#[doc(inline)]
pub use crate::__flags_pick as pick;

/// Reads the config file `path` (`--config`; `None`: no file, every key unset) as TOML into
/// `T`, usually a struct of `Option`s with `#[serde(deny_unknown_fields)]`. Errors name
/// `--config` and the file, and say where (line, column) and what, never quoting the file's
/// text: the line at fault may hold a token or a Redis URL with its password.
pub fn read_file<T: DeserializeOwned + Default>(path: Option<&Path>) -> Result<T, ConfigError> {
    let Some(path) = path else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| err("config", format!("cannot read {}: {e}", path.display())))?;
    toml::from_str::<T>(&text).map_err(|e| {
        err(
            "config",
            format!("{}: {}", path.display(), toml_error(&text, &e)),
        )
    })
}

/// A TOML error as `line L, column C: what`, never quoting the file: the line at fault may
/// hold the token or a Redis URL with its password (toml's `Display` shows the line). serde's
/// "invalid type/value/length" messages name the value found (`integer \`12345\``, `string
/// "…"`): that value is left out too. Key names (`unknown field \`nmespace\``) are kept.
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let at = e.span().map(|sp| {
        let start = sp.start.min(text.len());
        let before = &text[..start];
        let line = before.matches('\n').count() + 1;
        let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        format!("line {line}, column {col}: ")
    });
    let mut msg = e.message().trim().to_string();
    if msg.starts_with("invalid ")
        && let Some(colon) = msg.find(": ")
    {
        let end = msg.rfind(", expected").unwrap_or(msg.len()).max(colon + 2);
        // What kind of value it was (`integer`, `string`, `sequence`): the words before it.
        let found = &msg[colon + 2..end];
        let kind = found[..found.find(['`', '"', '\'']).unwrap_or(found.len())].trim();
        msg = format!(
            "{}: {kind}{}(value not shown){}",
            &msg[..colon],
            if kind.is_empty() { "" } else { " " },
            &msg[end..]
        );
    }
    format!("{}{}", at.unwrap_or_default(), msg.replace('\n', "; "))
}

/// A duration flag (`3s`, `500ms`, `1m 30s`); the error names `--flag` and the value given.
pub fn duration(flag: &'static str, raw: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(raw.trim()).map_err(|e| {
        err(
            flag,
            format!("{raw:?} is not a duration like 3s or 500ms ({e})"),
        )
    })
}

/// A secret (API token, password): compared in constant time, never printed (`Debug` shows
/// `***`).
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// A token (tests, embedding).
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// Is `given` this token? Constant time in the token's content.
    pub fn matches(&self, given: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), given.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    /// The token itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// A token given inline (`--x`) or in a file (`--x-file`), not both; never empty. The file is
/// read now ([`crate::tls::read_secret_file`]): errors name the flag, never the content.
pub fn token(
    (flag, inline): (&'static str, Option<String>),
    (file_flag, path): (&'static str, Option<PathBuf>),
) -> Result<Option<Token>, ConfigError> {
    match (inline, path) {
        (Some(_), Some(_)) => Err(err(
            flag,
            format!("give --{flag} or --{file_flag}, not both"),
        )),
        (Some(t), None) if t.trim().is_empty() => Err(err(flag, "must not be empty when set")),
        (Some(t), None) => Ok(Some(Token(t))),
        (None, Some(p)) => crate::tls::read_secret_file(&p)
            .map(|t| Some(Token(t)))
            .map_err(|e| err(file_flag, e)),
        (None, None) => Ok(None),
    }
}

/// Redis when neither `--redis`, its environment variable nor the file names one.
pub const DEFAULT_REDIS: &str = "redis://127.0.0.1:6379";

/// The environment variables of [`RedisArgs`]' flags in one binary (`SLUICE_REDIS_CA`,
/// `SLUICE_AGENT_REDIS_CA`, …): implemented by [`redis_env!`] from a prefix.
pub trait RedisEnv {
    /// `--redis`.
    const REDIS: &'static str;
    /// `--redis-ca`.
    const REDIS_CA: &'static str;
    /// `--redis-cert`.
    const REDIS_CERT: &'static str;
    /// `--redis-key`.
    const REDIS_KEY: &'static str;
    /// `--redis-insecure`.
    const REDIS_INSECURE: &'static str;
    /// `--redis-user`.
    const REDIS_USER: &'static str;
    /// `--redis-password-file`.
    const REDIS_PASSWORD_FILE: &'static str;
}

/// Declares a unit struct implementing [`RedisEnv`] whose variables are the prefix followed by
/// the flag's name in capitals: `redis_env!(pub AgentEnv = "SLUICE_AGENT_")` gives
/// `SLUICE_AGENT_REDIS`, `SLUICE_AGENT_REDIS_CA`, ….
///
/// ```
/// sluice_protocol::flags::redis_env!(pub ToolEnv = "TOOL_");
/// use sluice_protocol::flags::RedisEnv;
/// assert_eq!(ToolEnv::REDIS_PASSWORD_FILE, "TOOL_REDIS_PASSWORD_FILE");
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __flags_redis_env {
    ($(#[$meta:meta])* $vis:vis $name:ident = $prefix:literal) => {
        $(#[$meta])*
        #[derive(Debug, Default, Clone, Copy)]
        $vis struct $name;

        impl $crate::flags::RedisEnv for $name {
            const REDIS: &'static str = concat!($prefix, "REDIS");
            const REDIS_CA: &'static str = concat!($prefix, "REDIS_CA");
            const REDIS_CERT: &'static str = concat!($prefix, "REDIS_CERT");
            const REDIS_KEY: &'static str = concat!($prefix, "REDIS_KEY");
            const REDIS_INSECURE: &'static str = concat!($prefix, "REDIS_INSECURE");
            const REDIS_USER: &'static str = concat!($prefix, "REDIS_USER");
            const REDIS_PASSWORD_FILE: &'static str = concat!($prefix, "REDIS_PASSWORD_FILE");
        }
    };
}
#[doc(inline)]
pub use crate::__flags_redis_env as redis_env;

/// The Redis connection flags, each also the environment variable `E` names. Flatten them into
/// a binary's parser (`#[command(flatten)]`) and build the link with [`RedisArgs::link`].
/// `Debug` shows the URL without its password.
#[derive(Default, clap::Args)]
pub struct RedisArgs<E: RedisEnv> {
    /// Redis URL, or a comma-separated list of Redis Cluster nodes [default: redis://127.0.0.1:6379]
    #[arg(long, env = E::REDIS)]
    pub redis: Option<String>,
    /// CA bundle (PEM) trusted for rediss:// besides the platform's and SSL_CERT_FILE
    #[arg(long, env = E::REDIS_CA)]
    pub redis_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS to Redis (with --redis-key)
    #[arg(long, env = E::REDIS_CERT)]
    pub redis_cert: Option<PathBuf>,
    /// Private key (PEM) of --redis-cert
    #[arg(long, env = E::REDIS_KEY)]
    pub redis_key: Option<PathBuf>,
    /// Skip verifying Redis's TLS certificate (tests only; logged as a warning)
    #[arg(long, env = E::REDIS_INSECURE, num_args = 0..=1, default_missing_value = "true")]
    pub redis_insecure: Option<bool>,
    /// Redis ACL user (default: the URL's user name)
    #[arg(long, env = E::REDIS_USER)]
    pub redis_user: Option<String>,
    /// File holding the Redis password (default: the URL's password)
    #[arg(long, env = E::REDIS_PASSWORD_FILE)]
    pub redis_password_file: Option<PathBuf>,
    #[arg(skip)]
    env: PhantomData<E>,
}

/// The config file's keys of the Redis flags (`redis`, `redis_ca`, … as the flags, with `_`
/// for `-`): what [`RedisArgs::link`] falls back to. [`redis_keys!`] takes them from a file
/// struct. `Debug` shows the URL without its password.
#[derive(Default, Clone, PartialEq, Eq)]
pub struct RedisKeys {
    /// `redis`.
    pub redis: Option<String>,
    /// `redis_ca`.
    pub redis_ca: Option<PathBuf>,
    /// `redis_cert`.
    pub redis_cert: Option<PathBuf>,
    /// `redis_key`.
    pub redis_key: Option<PathBuf>,
    /// `redis_insecure`.
    pub redis_insecure: Option<bool>,
    /// `redis_user`.
    pub redis_user: Option<String>,
    /// `redis_password_file`.
    pub redis_password_file: Option<PathBuf>,
}

/// The [`RedisKeys`] of `$file`, a config file struct with the seven fields of the same names
/// and types. (The file struct lists them itself: serde's `flatten` would lose the positions
/// of its errors and its `deny_unknown_fields`.)
#[doc(hidden)]
#[macro_export]
macro_rules! __flags_redis_keys {
    ($file:expr) => {{
        let file = &$file;
        $crate::flags::RedisKeys {
            redis: file.redis.clone(),
            redis_ca: file.redis_ca.clone(),
            redis_cert: file.redis_cert.clone(),
            redis_key: file.redis_key.clone(),
            redis_insecure: file.redis_insecure,
            redis_user: file.redis_user.clone(),
            redis_password_file: file.redis_password_file.clone(),
        }
    }};
}
#[doc(inline)]
pub use crate::__flags_redis_keys as redis_keys;

/// A checked Redis link: what [`RedisArgs::link`] gives. `Debug` shows no password.
#[derive(Clone)]
pub struct RedisLink {
    /// `--redis` as given (URL or Cluster node list; may hold a password: never log it, log
    /// `target`).
    pub url: String,
    /// `url` parsed.
    pub target: RedisTarget,
    /// TLS and ACL settings (files checked).
    pub security: RedisSecurity,
}

impl RedisKeys {
    /// `Debug` of these settings under `name`, the URL's password left out.
    fn fmt_as(&self, name: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(name)
            .field("redis", &self.redis.as_deref().map(crate::conn::redact_url))
            .field("redis_ca", &self.redis_ca)
            .field("redis_cert", &self.redis_cert)
            .field("redis_key", &self.redis_key)
            .field("redis_insecure", &self.redis_insecure)
            .field("redis_user", &self.redis_user)
            .field("redis_password_file", &self.redis_password_file)
            .finish()
    }
}

impl fmt::Debug for RedisKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_as("RedisKeys", f)
    }
}

impl<E: RedisEnv> fmt::Debug for RedisArgs<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        RedisKeys {
            redis: self.redis.clone(),
            redis_ca: self.redis_ca.clone(),
            redis_cert: self.redis_cert.clone(),
            redis_key: self.redis_key.clone(),
            redis_insecure: self.redis_insecure,
            redis_user: self.redis_user.clone(),
            redis_password_file: self.redis_password_file.clone(),
        }
        .fmt_as("RedisArgs", f)
    }
}

impl fmt::Debug for RedisLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLink")
            .field("target", &self.target)
            .field("security", &self.security)
            .finish_non_exhaustive()
    }
}

impl<E: RedisEnv> RedisArgs<E> {
    /// The link these flags give, each over the file's key and then the default (plain, or
    /// [`DEFAULT_REDIS`]). Every file is read and every rule of [`crate::conn`] checked now,
    /// so a bad path or a conflict is an error naming its flag (`--redis`, `--redis-ca`, …),
    /// never a secret.
    pub fn link(&self, file: &RedisKeys) -> Result<RedisLink, ConfigError> {
        let url: String = pick!(self, file, redis, DEFAULT_REDIS);
        let target = RedisTarget::parse(&url).map_err(|e| err("redis", e))?;
        let security = RedisSecurity {
            ca_file: pick!(self, file, redis_ca),
            cert_file: pick!(self, file, redis_cert),
            key_file: pick!(self, file, redis_key),
            insecure: pick!(self, file, redis_insecure, false),
            user: pick!(self, file, redis_user),
            password: None,
            password_file: pick!(self, file, redis_password_file),
        };
        Redis::with_security(target.clone(), ConnOptions::default(), &security)
            .map_err(|e| err(e.flag(), e.message))?;
        Ok(RedisLink {
            url,
            target,
            security,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde::Deserialize;

    redis_env!(TestEnv = "SLUICE_FLAGS_TEST_");

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        redis: RedisArgs<TestEnv>,
        #[arg(long)]
        namespace: Option<String>,
    }

    /// A config file with a key of the Redis flags and two of its own.
    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        redis_insecure: Option<bool>,
        namespace: Option<String>,
        log_json: Option<bool>,
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).unwrap()
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sluice-flags-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn redis_env_names_the_variables_from_the_prefix() {
        assert_eq!(TestEnv::REDIS, "SLUICE_FLAGS_TEST_REDIS");
        assert_eq!(TestEnv::REDIS_INSECURE, "SLUICE_FLAGS_TEST_REDIS_INSECURE");
        let cmd = <Cli as clap::CommandFactory>::command();
        let envs: Vec<(String, String)> = cmd
            .get_arguments()
            .filter_map(|a| {
                let env = a.get_env()?.to_str()?.to_owned();
                Some((a.get_long()?.to_owned(), env))
            })
            .collect();
        assert_eq!(envs.len(), 7, "{envs:?}");
        for (long, env) in &envs {
            assert_eq!(
                env,
                &format!(
                    "SLUICE_FLAGS_TEST_{}",
                    long.to_uppercase().replace('-', "_")
                )
            );
        }
    }

    /// flag > file > default, for the URL and each of the six others.
    #[test]
    fn flags_win_over_the_file_and_the_default_comes_last() {
        let keys = RedisKeys {
            redis: Some("redis://file:1".into()),
            redis_ca: Some("ca.pem".into()),
            redis_cert: Some("cert.pem".into()),
            redis_key: Some("key.pem".into()),
            redis_insecure: Some(true),
            redis_user: Some("u".into()),
            redis_password_file: Some("pw".into()),
        };
        assert_eq!(redis_keys!(keys), keys, "each key to its own field");
        let cli = parse(&[]);
        assert_eq!(
            cli.redis.link(&RedisKeys::default()).unwrap().url,
            DEFAULT_REDIS
        );
        let file = RedisKeys {
            redis: Some("redis://file:1".into()),
            ..RedisKeys::default()
        };
        let link = cli.redis.link(&file).unwrap();
        assert_eq!(link.url, "redis://file:1");
        assert!(matches!(link.target, RedisTarget::Single(_)));
        assert_eq!(link.security, RedisSecurity::default());
        let cli = parse(&["--redis", "redis://flag:1", "--namespace", "flag"]);
        assert_eq!(cli.redis.link(&file).unwrap().url, "redis://flag:1");
        let file = File {
            namespace: Some("fromfile".into()),
            ..File::default()
        };
        assert_eq!(pick!(cli, file, namespace), Some("flag".into()));
        let cli = parse(&[]);
        let ns: String = pick!(cli, file, namespace, "sluice");
        assert_eq!(ns, "fromfile");
        let (flags, file) = (&cli.redis, &RedisKeys::default());
        assert!(!pick!(flags, file, redis_insecure, false));
    }

    /// The flags' and the file keys' `Debug` (a binary's parsed `Cli` may be logged) never
    /// show the URL's password (review of issue 24: they derived `Debug`).
    #[test]
    fn debug_never_shows_the_password() {
        let args = parse(&["--redis", "redis://u:hunter2@x:1"]).redis;
        let shown = format!("{args:?}");
        assert!(
            !shown.contains("hunter2") && shown.contains("x:1"),
            "{shown}"
        );
        let keys = RedisKeys {
            redis: Some("redis://:hunter2@y:2".into()),
            ..RedisKeys::default()
        };
        let shown = format!("{keys:?}");
        assert!(
            !shown.contains("hunter2") && shown.contains("y:2"),
            "{shown}"
        );
    }

    /// Link errors name the flag (the file's keys too: the same names), never a password.
    #[cfg(feature = "tls")] // rediss:// needs it
    #[test]
    fn link_errors_name_the_flag() {
        let link = parse(&["--redis", "rediss://u:hunter2@x:1", "--redis-insecure"])
            .redis
            .link(&RedisKeys::default())
            .unwrap();
        assert!(link.security.insecure);
        assert!(!format!("{link:?}").contains("hunter2"), "{link:?}");
        let nowhere = "/nonexistent/sluice-flags";
        for (args, flag) in [
            (&["--redis", "http://x"][..], "redis"),
            (&["--redis", "redis://u:hunter2@"][..], "redis"),
            (
                &["--redis", "redis://x:1", "--redis-insecure"][..],
                "redis-insecure",
            ),
            (
                &["--redis", "rediss://x:1", "--redis-ca", nowhere][..],
                "redis-ca",
            ),
            (
                &["--redis", "rediss://x:1", "--redis-user", "u"][..],
                "redis-user",
            ),
            (
                &["--redis", "rediss://x:1", "--redis-password-file", nowhere][..],
                "redis-password-file",
            ),
        ] {
            let e = parse(args).redis.link(&RedisKeys::default()).unwrap_err();
            assert_eq!(e.flag, flag, "{args:?}: {e}");
            assert!(e.to_string().starts_with(&format!("--{flag}: ")), "{e}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
        let file = RedisKeys {
            redis: Some("redis://x:1".into()),
            redis_ca: Some(nowhere.into()),
            ..RedisKeys::default()
        };
        let e = parse(&[]).redis.link(&file).unwrap_err();
        assert_eq!(e.flag, "redis-ca", "{e}");
    }

    #[test]
    fn the_file_is_read_and_its_errors_never_quote_it() {
        let d = scratch("file");
        let f = d.join("c.toml");
        assert!(read_file::<File>(None).unwrap().namespace.is_none());
        std::fs::write(&f, "namespace = \"n\"\nredis_insecure = true\n").unwrap();
        let file: File = read_file(Some(&f)).unwrap();
        assert_eq!(file.namespace.as_deref(), Some("n"));
        assert_eq!((file.redis_insecure, file.log_json), (Some(true), None));
        for (text, what) in [
            ("namespace = s3cret-unquoted\n", "line 1"),
            (
                "namespace = [\"s3cret-in-a-list\"]\n",
                "sequence (value not shown)",
            ),
            ("namespace = 5339\n", "integer (value not shown)"),
            (
                "log_json = \"s3cret-for-a-bool\"\n",
                "string (value not shown)",
            ),
            (
                "\nnmespace = \"typo\"\n",
                "line 2, column 1: unknown field `nmespace`",
            ),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = read_file::<File>(Some(&f)).unwrap_err();
            assert_eq!(e.flag, "config", "{e}");
            let shown = e.to_string();
            assert!(shown.contains(what), "{text:?}: {shown}");
            assert!(shown.contains(f.to_str().unwrap()), "{shown}");
            assert!(
                !shown.contains("s3cret") && !shown.contains("5339"),
                "{text:?}: {shown}"
            );
        }
        let e = read_file::<File>(Some(&d.join("missing.toml"))).unwrap_err();
        assert_eq!(e.flag, "config");
        assert!(e.message.starts_with("cannot read "), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn durations_and_tokens() {
        assert_eq!(
            duration("tick", " 500ms ").unwrap(),
            Duration::from_millis(500)
        );
        let e = duration("tick", "soon").unwrap_err();
        assert_eq!(e.flag, "tick");
        assert!(
            e.message
                .starts_with("\"soon\" is not a duration like 3s or 500ms ("),
            "{e}"
        );

        let d = scratch("token");
        let f = d.join("t");
        std::fs::write(&f, "t0k3n-s3cret\n").unwrap();
        let t = token(("api-token", None), ("api-token-file", Some(f.clone())))
            .unwrap()
            .unwrap();
        assert!(t.matches("t0k3n-s3cret") && !t.matches("t0k3n"));
        assert_eq!(t.expose(), "t0k3n-s3cret");
        assert_eq!(format!("{t:?}"), "***");
        assert!(
            token(("api-token", None), ("api-token-file", None))
                .unwrap()
                .is_none()
        );
        let e = token(("api-token", Some("x".into())), ("api-token-file", Some(f))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--api-token: give --api-token or --api-token-file, not both"
        );
        let e = token(("api-token", Some(" ".into())), ("api-token-file", None)).unwrap_err();
        assert_eq!(e.to_string(), "--api-token: must not be empty when set");
        let e = token(("api-token", None), ("api-token-file", Some(d.join("no")))).unwrap_err();
        assert_eq!(e.flag, "api-token-file");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
