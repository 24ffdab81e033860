//! [`Config`], its builder and its checks, and [`ClockSource`].

use std::path::PathBuf;
use std::time::Duration;

use crate::error::Error;
use crate::protocol::conn::{RedisSecurity, RedisTarget};

#[cfg(doc)]
use crate::{Client, Decision, Task};

/// Which clock slices follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClockSource {
    /// The host clock (kept in step by NTP), as in the seed. Default.
    #[default]
    Host,
    /// Redis `TIME`: the host clock minus the offset measured on every pull (bounded by half
    /// the round trip). For hosts whose clocks cannot be trusted.
    Redis,
}

/// Client settings. [`Config::new`] gives the defaults, [`Config::builder`] builds and checks
/// them; every field is public and may be set after `new` (`cfg.namespace = …`). The struct is
/// `#[non_exhaustive]`: new settings arrive with defaults, so code that starts from
/// [`Config::new`] or the builder keeps compiling.
///
/// ```
/// use std::time::Duration;
///
/// let cfg = sluice::Config::builder("redis://127.0.0.1:6379")
///     .namespace("shop")
///     .host_id("web-1")
///     .pull_timeout(Duration::from_millis(500))
///     .build()?;
/// assert_eq!(cfg.namespace, "shop");
///
/// let err = sluice::Config::builder("redis://127.0.0.1:6379").max_tasks(0).build().unwrap_err();
/// assert_eq!(err.to_string(), "Config::max_tasks: 0 is outside 1 ..= 4096");
/// # Ok::<(), sluice::Error>(())
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Config {
    /// One Redis URL, or a comma-separated list of Redis Cluster seed nodes. `rediss://` is
    /// TLS; `rediss://user:password@host:port` carries the ACL user and password (or give them
    /// in [`Config::redis_security`], a password file keeping it out of the source).
    pub redis: String,
    /// TLS and ACL settings of the Redis link (default: none beyond the URL's):
    ///
    /// * `ca_file`: a PEM bundle trusted besides the platform's and `SSL_CERT_FILE`;
    /// * `cert_file` + `key_file`: the client certificate and key for mutual TLS;
    /// * `insecure`: skip verifying the server (tests only; logged as a warning);
    /// * `user`: the ACL user (else the URL's);
    /// * `password` / `password_file`: the password (else the URL's; one place only).
    ///
    /// Files are read by [`Client::new`]: a bad one is [`Error::RedisSecurity`] naming it.
    /// The host name of the URL must match the server certificate (SNI and hostname checks
    /// are on). See docs/security.md for the worker ACL.
    pub redis_security: RedisSecurity,
    /// Namespace (default `sluice`).
    pub namespace: String,
    /// This host's id: names the shared segment and the entry in `NS:hosts` (default: the
    /// hostname).
    pub host_id: String,
    /// Directory of the shared segment (default `/dev/shm`).
    pub shm_dir: PathBuf,
    /// Task slots of the host segment (default 64, at most [`crate::shm::MAX_SLOTS`] = 4,096).
    /// A new segment gets this many; an existing one with fewer is replaced by a larger one
    /// (segments only grow), one with more keeps its size.
    pub max_tasks: u32,
    /// A segment slot whose task no process of the host has held a handle for during this
    /// long may be reclaimed for another task when no slot is free (default 60 s).
    pub reclaim_idle: Duration,
    /// Bound on one Redis call (a pull that takes longer makes the task FAILED).
    pub pull_timeout: Duration,
    /// Bound on connecting to Redis.
    pub connect_timeout: Duration,
    /// Time between probes while FAILED (default 5 s).
    pub probe_interval: Duration,
    /// How often the task meta is re-read (host-wide; default 1 s).
    pub meta_refresh: Duration,
    /// How often counters are flushed into the slice hashes (host-wide; default 1 s).
    pub flush_interval: Duration,
    /// How often this host writes its entry in `NS:hosts` (host-wide; default 10 s).
    pub host_report_interval: Duration,
    /// A pull lock held longer than this is taken over even if its holder lives.
    pub lock_timeout: Duration,
    /// Longest wait of [`Task::acquire`] / [`Task::acquire_blocking`] for a refill.
    pub acquire_timeout: Duration,
    /// Which clock slices follow.
    pub clock: ClockSource,
    /// Admissions of [`Task::try_acquire`] read the coarse clock (`CLOCK_REALTIME_COARSE`,
    /// default `true`): a decision that falls well inside its slice (more than three ticks of
    /// the coarse clock, 12 ms at `HZ=250`, before its end) and is admitted from the local quota
    /// costs less. Every other decision (near the slice's end, rejected, pending,
    /// FAILED, paced, not pooled, and all of [`Task::try_acquire_precise`] /
    /// [`Task::acquire`]) reads the precise clock as before. The slice a decision is charged
    /// to is the same either way unless the kernel's tick is late by more than the guard; see
    /// docs/sdk.md, "The clock of the fast path". `false`: always the precise clock.
    pub fast_clock: bool,
    /// Entries of the host's key table for keyed tasks (default
    /// [`crate::keyed::DEFAULT_KEY_SLOTS`] = 16,384, 6 MiB; at most
    /// [`crate::keyed::MAX_KEY_SLOTS`] = 4,194,304, 1.5 GiB). Like the segment, a table with fewer entries
    /// is replaced by a larger one.
    pub key_slots: u32,
    /// What to answer for a task whose meta is not known yet (never read by any process of
    /// this host): `true` (default) admits ([`Decision::FallbackAllowed`]), `false` rejects.
    pub allow_unknown: bool,
    /// A keyed decision of [`crate::Key::acquire`] that needs Redis sends its pull itself,
    /// from the caller's task over a connection of the caller's runtime (one per thread that
    /// decides, made on first use), instead of through the background thread (default
    /// `false`: opt in): a cold key then waits one round trip woken on the caller's thread, not
    /// the background thread first (docs/sdk.md, "Keyed limits"). Turn it on only where every
    /// runtime that calls `acquire` has IO and time enabled and is driven (`#[tokio::main]`,
    /// `#[tokio::test]`, `Builder::enable_all`): Tokio panics on a socket or timer in a runtime
    /// built without them, and a runtime entered but not driven would never answer. Each
    /// deciding thread opens a Redis connection of its own (at most 64 per client). Only a
    /// single Redis (not a cluster) is pulled from the caller; callers outside Tokio and
    /// [`crate::Key::acquire_blocking`] use the background thread.
    pub caller_pulls: bool,
}

impl Config {
    /// Defaults for the Redis at `redis`.
    pub fn new(redis: impl Into<String>) -> Self {
        Self {
            redis: redis.into(),
            redis_security: RedisSecurity::default(),
            namespace: crate::protocol::DEFAULT_NAMESPACE.to_string(),
            host_id: gethostname::gethostname().to_string_lossy().into_owned(),
            shm_dir: PathBuf::from("/dev/shm"),
            max_tasks: crate::shm::DEFAULT_SLOTS,
            reclaim_idle: Duration::from_secs(60),
            pull_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            probe_interval: Duration::from_secs(5),
            meta_refresh: Duration::from_secs(1),
            flush_interval: Duration::from_secs(1),
            host_report_interval: Duration::from_secs(10),
            lock_timeout: Duration::from_secs(3),
            acquire_timeout: Duration::from_secs(1),
            clock: ClockSource::Host,
            fast_clock: true,
            key_slots: crate::keytable::DEFAULT_KEY_SLOTS,
            allow_unknown: true,
            caller_pulls: false,
        }
    }

    /// A builder starting from the defaults of [`Config::new`]; [`ConfigBuilder::build`]
    /// checks every setting.
    pub fn builder(redis: impl Into<String>) -> ConfigBuilder {
        ConfigBuilder(Self::new(redis))
    }

    /// Checks every setting ([`Client::new`] calls it first): the Redis address parses, the
    /// namespace is a valid name, the host id is 1–255 printable characters, the slot counts
    /// are in range and the intervals and timeouts are above zero. The error names the field
    /// (never a secret).
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |field: &'static str, message: String| Err(Error::Config { field, message });
        RedisTarget::parse(&self.redis).map_err(Error::Redis)?;
        crate::protocol::validate_namespace(&self.namespace)?;
        if self.host_id.is_empty() || self.host_id.len() > 255 {
            return bad(
                "host_id",
                format!("must be 1 ..= 255 bytes, is {}", self.host_id.len()),
            );
        }
        if self.host_id.chars().any(char::is_control) {
            return bad("host_id", "must not contain control characters".into());
        }
        if self.max_tasks == 0 || self.max_tasks > crate::shm::MAX_SLOTS {
            return bad(
                "max_tasks",
                format!(
                    "{} is outside 1 ..= {}",
                    self.max_tasks,
                    crate::shm::MAX_SLOTS
                ),
            );
        }
        if self.key_slots == 0 || self.key_slots > crate::keytable::MAX_KEY_SLOTS {
            return bad(
                "key_slots",
                format!(
                    "{} is outside 1 ..= {}",
                    self.key_slots,
                    crate::keytable::MAX_KEY_SLOTS
                ),
            );
        }
        for (field, d) in [
            ("pull_timeout", self.pull_timeout),
            ("connect_timeout", self.connect_timeout),
            ("probe_interval", self.probe_interval),
            ("meta_refresh", self.meta_refresh),
            ("flush_interval", self.flush_interval),
            ("host_report_interval", self.host_report_interval),
            ("lock_timeout", self.lock_timeout),
        ] {
            if d.is_zero() {
                return bad(field, "must be above zero".into());
            }
        }
        Ok(())
    }
}

/// Builds a [`Config`] from the defaults; [`build`](ConfigBuilder::build) validates it.
/// Each method sets the [`Config`] field of the same name (see there for what it means).
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until build() is called"]
pub struct ConfigBuilder(Config);

/// One builder method per field: `name: into T` takes `impl Into<T>` (strings, paths), `name: T`
/// takes `T` itself (numbers, durations, flags: literals need no annotation).
macro_rules! setters {
    () => {};
    ($(#[$doc:meta])* $field:ident: into $ty:ty, $($rest:tt)*) => {
        $(#[$doc])*
        pub fn $field(mut self, value: impl Into<$ty>) -> Self {
            self.0.$field = value.into();
            self
        }
        setters! { $($rest)* }
    };
    ($(#[$doc:meta])* $field:ident: $ty:ty, $($rest:tt)*) => {
        $(#[$doc])*
        pub fn $field(mut self, value: $ty) -> Self {
            self.0.$field = value;
            self
        }
        setters! { $($rest)* }
    };
}

impl ConfigBuilder {
    setters! {
        /// [`Config::redis_security`].
        redis_security: RedisSecurity,
        /// [`Config::namespace`].
        namespace: into String,
        /// [`Config::host_id`].
        host_id: into String,
        /// [`Config::shm_dir`].
        shm_dir: into PathBuf,
        /// [`Config::max_tasks`].
        max_tasks: u32,
        /// [`Config::reclaim_idle`].
        reclaim_idle: Duration,
        /// [`Config::pull_timeout`].
        pull_timeout: Duration,
        /// [`Config::connect_timeout`].
        connect_timeout: Duration,
        /// [`Config::probe_interval`].
        probe_interval: Duration,
        /// [`Config::meta_refresh`].
        meta_refresh: Duration,
        /// [`Config::flush_interval`].
        flush_interval: Duration,
        /// [`Config::host_report_interval`].
        host_report_interval: Duration,
        /// [`Config::lock_timeout`].
        lock_timeout: Duration,
        /// [`Config::acquire_timeout`].
        acquire_timeout: Duration,
        /// [`Config::clock`].
        clock: ClockSource,
        /// [`Config::fast_clock`].
        fast_clock: bool,
        /// [`Config::key_slots`].
        key_slots: u32,
        /// [`Config::allow_unknown`].
        allow_unknown: bool,
        /// [`Config::caller_pulls`].
        caller_pulls: bool,
    }

    /// The checked [`Config`] ([`Config::validate`]).
    pub fn build(self) -> Result<Config, Error> {
        self.0.validate()?;
        Ok(self.0)
    }
}
