//! The wire protocol between Sluice managers and workers: the one place key names, Lua scripts
//! and slice arithmetic exist.
//!
//! An SDK in another language implements Sluice by following this module (and `docs/protocol.md`,
//! which is written from it). Nothing here talks to etcd; [`scripts`] and [`conn`] talk to Redis.
//!
//! # Redis layout (namespace `NS`, task `T`)
//!
//! ```text
//!  NS:{T}:meta              hash   spec fields the SDK needs + version, rolled_to, and the
//!                                  fence: term, epoch, fenced_ms
//!  NS:{T}:s:<start_ms>      hash   cap, rem, term, adm, rej, ok, err, lat_sum_us, lat_n
//!  NS:hosts                 hash   host id -> JSON {offset_ms, rtt_ms, seen_ms, sdk}
//!  NS:alerts                stream alert feed (capped)
//!  NS:alerts:state          hash   open alert episodes (leader)
//!  NS:alerts:sent           zset   webhook deliveries (leader)
//!
//!  time ──────────────────────────────────────────────────────────────▶
//!        │ s:1000 │ s:2000 │ s:3000 │ s:4000 │ ... │ s:61000 │
//!          ended    current  ◀──────── written ahead (horizon) ───────▶
//! ```
//!
//! Every key of a task carries the hash tag `{T}`, so a Lua script touching the meta hash and
//! any number of its slices stays in one Redis Cluster slot.
//!
//! # etcd layout
//!
//! ```text
//!  /NS/election          election name (leader key = /NS/election/<lease id>)
//!  /NS/members/<node>    member registration, on the member's lease
//!  /NS/tasks/<T>         task spec JSON (source of truth)
//!  /NS/settings          global settings JSON
//! ```

pub mod conn;
pub mod envoy;
#[cfg(feature = "flags")]
pub mod flags;
pub mod lease;
pub mod scripts;
pub mod tls;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Version of this protocol, written into every task's meta hash as `proto`.
///
/// * 3: shadow mode (`shadow` meta field, `wrej` slice counter: PULL and FLUSH take 6 or 7
///   counters per slice) and paced slices (`pacing`/`pace_burst` meta fields, `pace`/`burst`
///   slice fields written by ROLL, honoured by PULL). Additive: a v2 SDK keeps working
///   against v3 data, but it enforces (never sees shadow) and does not pace: each worker
///   sends its own build's PULL script, and v2's knows no `pace`; the slice's cap still
///   bounds it.
///
///   Also under 3, without a bump (before the first release, see docs/deploy.md): fencing
///   tokens floored at Redis `TIME` ([`lease::LOCK_ACQUIRE_LUA`]). Additive: the older script
///   `INCR`s the same counter, so tokens of both stay strictly increasing together.
/// * 4: a keyed task's key quotas are one hash per task and slice (`NS:{T}:k:<start>`, a field
///   per key; [`Keys::key_slices`]) instead of a hash per key and slice, and KPULL's arguments
///   changed ([`scripts::KPULL_LUA`]); the meta gained `ko_n`. **Not additive for workers of
///   keyed tasks**: v3 and v4 workers count a key's quota in different places (a key may admit
///   its limit once per version while both run); other tasks are unaffected.
/// * 5: **lazy tasks** (issue 27): a leader may leave an idle task without slices ahead and
///   write a lazy window into its meta instead (`lz_cap`, `lz_from`, `lz_until`, `lz_exp`);
///   PULL, TAKE and SLIDE then make a missing slice from it ([`scripts::LAZY_LUA`]); their
///   arguments gained the meta's name (read only: workers still never write it). The manager does this only with
///   `--lazy-after` (off by default): a v4 worker sees no slice of a lazy task (FAILED, its
///   fallback), so every worker of the namespace must speak 5 before it is turned on.
pub const PROTOCOL_VERSION: u32 = 5;

/// The default namespace.
pub const DEFAULT_NAMESPACE: &str = "sluice";

/// Longest task name, in bytes.
pub const MAX_TASK_NAME_LEN: usize = 64;

/// Shortest slice, in milliseconds.
pub const MIN_SLICE_MS: u64 = 100;

/// Longest slice (one day), in milliseconds.
pub const MAX_SLICE_MS: u64 = 86_400_000;

/// Longest key of a keyed task, in bytes (any UTF-8).
pub const MAX_KEY_LEN: usize = 256;

/// Largest threshold (permits per slice) a spec may give, and so the largest cost any decision
/// can ever be admitted for: every door (SDK, tower layer, agent RLS/HTTP) refuses a larger cost
/// without counting it, so no counter of a slice can be pushed past what Redis can add.
pub const MAX_COUNT: u64 = 1_000_000_000_000;

/// Most `key_overrides` one keyed task may have.
pub const MAX_KEY_OVERRIDES: usize = 1_000;

/// The digest that names a key of a keyed task in Redis: the first 16 bytes of the SHA-256 of
/// the key's UTF-8 bytes, as 32 lowercase hex digits. A key's quota of a slice is the field
/// `k:<digest>` of the hash `NS:{T}:k:<start_ms>` ([`Keys::key_slices`]) and overrides are the
/// meta fields `ko:<digest>`.
///
/// ```
/// assert_eq!(sluice_protocol::key_digest("").len(), 32);
/// // SHA-256("abc") = ba7816bf8f01cfea414140de5dae2223…
/// assert_eq!(sluice_protocol::key_digest("abc"), "ba7816bf8f01cfea414140de5dae2223");
/// ```
pub fn key_digest(key: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let d = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let mut out = String::with_capacity(32);
    for b in &d.as_ref()[..16] {
        out.push(HEX[(b >> 4) as usize] as char);
        out.push(HEX[(b & 15) as usize] as char);
    }
    out
}

/// The field of a key in its task's key quota hash ([`Keys::key_slices`]): `k:<digest>`.
pub fn key_field(digest: &str) -> String {
    format!("k:{digest}")
}

/// What a key's field in the key quota hash ([`Keys::key_slices`]) holds: `(remaining, cap)`,
/// the cap only when it differs from the hash's `cap` (an override): `<rem>` or `<rem>:<cap>`.
/// `None` for anything else.
pub fn parse_key_quota(v: &str) -> Option<(i64, Option<u64>)> {
    match v.split_once(':') {
        Some((r, c)) => Some((r.parse().ok()?, Some(c.parse().ok()?))),
        None => Some((v.parse().ok()?, None)),
    }
}

/// The per-namespace secret of key labels (etcd `/NS/key_secret`, 32 random bytes as 64
/// lowercase hex digits): the leader creates it once and writes it into the meta of every
/// keyed task that does not show its keys in clear (meta field `key_secret`), where the
/// workers read it. Never shown by the API; its `Debug` form is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct KeySecret(String);

impl fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeySecret(<redacted>)")
    }
}

impl KeySecret {
    /// A fresh random secret (the system's random source); `None` if it fails.
    pub fn generate() -> Option<Self> {
        use ring::rand::SecureRandom;
        let mut b = [0u8; 32];
        ring::rand::SystemRandom::new().fill(&mut b).ok()?;
        Some(Self(b.iter().map(|x| format!("{x:02x}")).collect()))
    }

    /// A stored secret: exactly 64 lowercase hex digits, else `None`.
    ///
    /// ```
    /// use sluice_protocol::KeySecret;
    /// assert!(KeySecret::parse(&"ab".repeat(32)).is_some());
    /// assert!(KeySecret::parse("ab").is_none());
    /// assert!(KeySecret::parse(&"AB".repeat(32)).is_none());
    /// ```
    pub fn parse(hex: &str) -> Option<Self> {
        (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| Self(hex.to_string()))
    }

    /// The hex form (to store; never to show).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// How a key of a keyed task is stored where people can read it (the top-key sets
/// `NS:{T}:top:*` the API and dashboard show): `#`
/// followed by 32 lowercase hex digits, the first 16 bytes of HMAC-SHA-256 of the key under
/// the namespace's [`KeySecret`] — or, without a secret (a meta written by managers that have
/// none), of SHA-256 ([`key_digest`]). A task whose spec says `"clear_keys": true` stores keys
/// in clear instead (the SDK then does not call this).
///
/// ```
/// use sluice_protocol::{KeySecret, key_label};
/// let s = KeySecret::parse(&"01".repeat(32)).unwrap();
/// let l = key_label(Some(&s), "sk_live_abc");
/// assert!(l.starts_with('#') && l.len() == 33);
/// assert_ne!(l, key_label(None, "sk_live_abc"), "keyed, not a bare SHA");
/// assert_eq!(key_label(None, "abc"), format!("#{}", sluice_protocol::key_digest("abc")));
/// ```
pub fn key_label(secret: Option<&KeySecret>, key: &str) -> String {
    let hex = |d: &[u8]| {
        let mut out = String::with_capacity(33);
        out.push('#');
        for b in &d[..16] {
            out.push_str(&format!("{b:02x}"));
        }
        out
    };
    match secret {
        Some(s) => {
            let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, s.0.as_bytes());
            hex(ring::hmac::sign(&k, key.as_bytes()).as_ref())
        }
        None => format!("#{}", key_digest(key)),
    }
}

/// Checks a key of a keyed task: at most [`MAX_KEY_LEN`] bytes (any UTF-8, empty allowed).
pub fn validate_key(key: &str) -> Result<(), NameError> {
    if key.len() > MAX_KEY_LEN {
        return Err(NameError {
            what: "key",
            name: key.chars().take(32).collect::<String>() + "…",
            why: "must be at most 256 bytes",
        });
    }
    Ok(())
}

/// A name was not acceptable as a namespace or task name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {name:?}: {why}")]
pub struct NameError {
    /// `"task name"` or `"namespace"`.
    pub what: &'static str,
    /// The rejected name.
    pub name: String,
    /// Why it was rejected.
    pub why: &'static str,
}

fn check_name(what: &'static str, name: &str) -> Result<(), NameError> {
    let err = |why| NameError {
        what,
        name: name.to_string(),
        why,
    };
    if name.is_empty() {
        return Err(err("must not be empty"));
    }
    if name.len() > MAX_TASK_NAME_LEN {
        return Err(err("must be at most 64 characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(err("may contain only A-Z a-z 0-9 _ . -"));
    }
    Ok(())
}

/// Checks a task name against `[A-Za-z0-9_.-]{1,64}`.
///
/// ```
/// assert!(sluice_protocol::validate_task_name("checkout.v2").is_ok());
/// assert!(sluice_protocol::validate_task_name("a/b").is_err());
/// assert!(sluice_protocol::validate_task_name("").is_err());
/// ```
pub fn validate_task_name(name: &str) -> Result<(), NameError> {
    check_name("task name", name)
}

/// Checks a namespace: the same alphabet as task names (no `:`, `/`, `{` or `}`, which would
/// break the key layout).
pub fn validate_namespace(ns: &str) -> Result<(), NameError> {
    check_name("namespace", ns)
}

/// Builds every Redis key and etcd path of one namespace.
///
/// ```
/// let keys = sluice_protocol::Keys::new("sluice").unwrap();
/// assert_eq!(keys.meta("checkout"), "sluice:{checkout}:meta");
/// assert_eq!(keys.slice("checkout", 1_700_000_000_000), "sluice:{checkout}:s:1700000000000");
/// assert_eq!(keys.etcd_task("checkout"), "/sluice/tasks/checkout");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    ns: String,
}

impl Keys {
    /// Keys of namespace `ns` (validated with [`validate_namespace`]).
    pub fn new(ns: &str) -> Result<Self, NameError> {
        validate_namespace(ns)?;
        Ok(Self { ns: ns.to_string() })
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// `NS:{T}:meta`: the task's meta hash.
    pub fn meta(&self, task: &str) -> String {
        format!("{}:{{{task}}}:meta", self.ns)
    }

    /// `NS:{T}:s:<start_ms>`: the hash of the slice starting at `start_ms`.
    pub fn slice(&self, task: &str, start_ms: i64) -> String {
        format!("{}:{{{task}}}:s:{start_ms}", self.ns)
    }

    /// `NS:{T}:k:<start_ms>`: the key quotas of a keyed task in the slice starting at
    /// `start_ms`, one hash for all its keys (field [`key_field`] per key); created by the
    /// slice's first key pull (KPULL), never by the leader.
    pub fn key_slices(&self, task: &str, start_ms: i64) -> String {
        format!("{}:{{{task}}}:k:{start_ms}", self.ns)
    }

    /// `NS:{T}:top:<minute_start_ms>`: sorted set of a keyed task's keys by permits admitted in
    /// that minute (hosts add their busiest keys), for the API and dashboard.
    pub fn top_keys(&self, task: &str, minute_ms: i64) -> String {
        format!("{}:{{{task}}}:top:{minute_ms}", self.ns)
    }

    /// `NS:{T}:topr:<minute_start_ms>`: the same by permits rejected.
    pub fn top_rejected_keys(&self, task: &str, minute_ms: i64) -> String {
        format!("{}:{{{task}}}:topr:{minute_ms}", self.ns)
    }

    /// `NS:{T}:hist:<resolution>`: compact per-task traffic history (harvested by the leader).
    pub fn history(&self, task: &str, resolution: &str) -> String {
        format!("{}:{{{task}}}:hist:{resolution}", self.ns)
    }

    /// `NS:{T}:dyn`: the dynamic-limiting controller's state (survives leader failover).
    pub fn dynamic_state(&self, task: &str) -> String {
        format!("{}:{{{task}}}:dyn", self.ns)
    }

    /// `NS:{T}:adj`: the list of dynamic-limiting adjustments.
    pub fn adjustments(&self, task: &str) -> String {
        format!("{}:{{{task}}}:adj", self.ns)
    }

    /// `NS:{T}:health`: external health reports (`POST /api/v1/tasks/{name}/health`).
    pub fn health_reports(&self, task: &str) -> String {
        format!("{}:{{{task}}}:health", self.ns)
    }

    /// `NS:{T}:log`: the sorted set of the `exact_sliding` mode.
    pub fn sliding_log(&self, task: &str) -> String {
        format!("{}:{{{task}}}:log", self.ns)
    }

    /// `NS:tasks`: set of the task names the leader has rolled and not yet retired (added
    /// before a task's meta is first written, removed after its retirement), so a new
    /// leadership can retire tasks deleted from etcd while no leader ran. No hash tag: one key.
    pub fn task_registry(&self) -> String {
        format!("{}:tasks", self.ns)
    }

    /// `NS:hosts`: host id → JSON with the host's clock offset to Redis `TIME`.
    pub fn hosts(&self) -> String {
        format!("{}:hosts", self.ns)
    }

    /// `NS:alerts`: the alert stream.
    pub fn alerts(&self) -> String {
        format!("{}:alerts", self.ns)
    }

    /// `NS:alerts:state`: hash of open alert episodes (`task:<T>` / `host:<H>` → JSON), so a new
    /// leader continues an episode instead of alerting again.
    pub fn alert_state(&self) -> String {
        format!("{}:alerts:state", self.ns)
    }

    /// `NS:alerts:sent`: sorted set of webhook deliveries (`<alert id> <url fingerprint>`, score = when), so
    /// a new leader delivers what is pending and never resends what was delivered.
    pub fn alerts_sent(&self) -> String {
        format!("{}:alerts:sent", self.ns)
    }

    /// `/NS/election`: the etcd election name.
    pub fn etcd_election(&self) -> String {
        format!("/{}/election", self.ns)
    }

    /// `/NS/members/`: prefix of member registrations.
    pub fn etcd_members_prefix(&self) -> String {
        format!("/{}/members/", self.ns)
    }

    /// `/NS/members/<node_id>`.
    pub fn etcd_member(&self, node_id: &str) -> String {
        format!("/{}/members/{node_id}", self.ns)
    }

    /// `/NS/key_secret`: the namespace's [`KeySecret`] (created once by a leader).
    pub fn etcd_key_secret(&self) -> String {
        format!("/{}/key_secret", self.ns)
    }

    /// `/NS/tasks/`: prefix of task specs.
    pub fn etcd_tasks_prefix(&self) -> String {
        format!("/{}/tasks/", self.ns)
    }

    /// `/NS/tasks/<T>`: one task spec.
    pub fn etcd_task(&self, task: &str) -> String {
        format!("/{}/tasks/{task}", self.ns)
    }

    /// `NS:envoy`: hash of the imported envoyproxy/ratelimit domains (field = domain, value =
    /// the compiled JSON); written by the leader, read by host agents (no hash tag: one key).
    pub fn envoy_routes(&self) -> String {
        format!("{}:envoy", self.ns)
    }

    /// `NS:envoy:fence{NS:envoy}`: hash of the fence of each mirrored domain (field = domain,
    /// value = `"<epoch> <term> <fenced_ms>"`), written with `NS:envoy` by the leader's mirror
    /// scripts. The hash tag puts it in `NS:envoy`'s Cluster slot (a tag is hashed alone, and
    /// `NS:envoy` has none, so its whole name is its tag); the `NS:` prefix keeps it under the
    /// manager's ACL pattern.
    pub fn envoy_fence(&self) -> String {
        format!("{ns}:envoy:fence{{{ns}:envoy}}", ns = self.ns)
    }

    /// `/NS/envoy/`: prefix of the imported envoyproxy/ratelimit domain documents.
    pub fn etcd_envoy_prefix(&self) -> String {
        format!("/{}/envoy/", self.ns)
    }

    /// `/NS/envoy/<domain>`: one imported envoyproxy/ratelimit domain document.
    pub fn etcd_envoy_domain(&self, domain: &str) -> String {
        format!("/{}/envoy/{domain}", self.ns)
    }

    /// `/NS/settings`: global settings JSON.
    pub fn etcd_settings(&self) -> String {
        format!("/{}/settings", self.ns)
    }

    /// `NS:{T}:lease`: mode `concurrency`: the permits each host leases (hash: host id →
    /// `<permits>:<expires_ms>:<seq>:<unmet>`; see [`lease`]).
    pub fn lease(&self, task: &str) -> String {
        format!("{}:{{{}}}:lease", self.ns, task)
    }

    /// `NS:{L}:lock`: the hash of lock `L` (`token`, `owner`), expiring with the lock.
    pub fn lock(&self, lock: &str) -> String {
        format!("{}:{{{}}}:lock", self.ns, lock)
    }

    /// `NS:{L}:lock:token`: the fencing-token counter of lock `L` (never expires).
    pub fn lock_token(&self, lock: &str) -> String {
        format!("{}:{{{}}}:lock:token", self.ns, lock)
    }

    /// `NS:{T}:log:seq`: the sequence that makes `exact_sliding` log members unique (expires
    /// with the log, deleted with the task).
    pub fn sliding_log_seq(&self, task: &str) -> String {
        format!("{}:{{{task}}}:log:seq", self.ns)
    }
}

/// Slice arithmetic. A slice of length `slice_ms` starts at a multiple of `slice_ms` (Unix
/// milliseconds), so every host agrees on slice boundaries without talking to anyone.
pub mod slice {
    /// Start of the slice containing `t_ms`.
    ///
    /// ```
    /// use sluice_protocol::slice::start;
    /// assert_eq!(start(12_345, 1_000), 12_000);
    /// assert_eq!(start(12_000, 1_000), 12_000);
    /// assert_eq!(start(-1, 1_000), -1_000);
    /// ```
    pub fn start(t_ms: i64, slice_ms: u64) -> i64 {
        let len = slice_ms.max(1) as i64;
        t_ms - t_ms.rem_euclid(len)
    }

    /// End (exclusive) of the slice starting at `start_ms`.
    pub fn end(start_ms: i64, slice_ms: u64) -> i64 {
        start_ms + slice_ms as i64
    }

    /// The last Redis time (Unix ms) at which PULL, TAKE and KPULL still serve the slice
    /// starting at `start_ms`: its end plus a grace of `min(slice_ms / 4, 250)` ms (the scripts'
    /// window check; after it they answer −2).
    ///
    /// ```
    /// use sluice_protocol::slice::window_end;
    /// assert_eq!(window_end(10_000, 1_000), 11_250);
    /// assert_eq!(window_end(10_000, 200), 10_250);
    /// ```
    pub fn window_end(start_ms: i64, slice_ms: u64) -> i64 {
        end(start_ms, slice_ms) + (slice_ms as i64 / 4).min(250)
    }

    /// Starts of every slice that begins before `until_ms`, from the slice containing `from_ms`.
    ///
    /// ```
    /// use sluice_protocol::slice::starts;
    /// let v: Vec<i64> = starts(1_500, 4_000, 1_000).collect();
    /// assert_eq!(v, [1_000, 2_000, 3_000]);
    /// ```
    pub fn starts(from_ms: i64, until_ms: i64, slice_ms: u64) -> impl Iterator<Item = i64> {
        let len = slice_ms.max(1) as i64;
        let first = start(from_ms, slice_ms);
        (0..)
            .map(move |i| first + i * len)
            .take_while(move |s| *s < until_ms)
    }

    /// Fraction of the slice starting at `start_ms` still ahead at `now_ms`, in `[0, 1]`.
    pub fn remaining_fraction(now_ms: i64, start_ms: i64, slice_ms: u64) -> f64 {
        let left = (end(start_ms, slice_ms) - now_ms) as f64 / slice_ms.max(1) as f64;
        left.clamp(0.0, 1.0)
    }
}

/// The current Unix time in milliseconds from the host clock (with the `sim` feature, from
/// the simulation's clock on a thread that set one: [`sim_clock`]).
pub fn unix_ms() -> i64 {
    #[cfg(feature = "sim")]
    if let Some(ms) = sim_clock::now_ms() {
        return ms;
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The simulation's clock (feature `sim`): a thread that sets one reads it from [`unix_ms`]
/// instead of the host clock. Each simulated world runs on its own thread, so worlds in
/// parallel do not share a clock.
#[cfg(feature = "sim")]
#[doc(hidden)]
pub mod sim_clock {
    use std::cell::RefCell;
    use std::sync::Arc;

    thread_local! {
        static CLOCK: RefCell<Option<Arc<dyn Fn() -> i64 + Send + Sync>>> = const { RefCell::new(None) };
    }

    /// Makes [`super::unix_ms`] on this thread read `clock` (Unix ms); `None`: the host clock.
    pub fn set(clock: Option<Arc<dyn Fn() -> i64 + Send + Sync>>) {
        CLOCK.with(|c| *c.borrow_mut() = clock);
    }

    pub(crate) fn now_ms() -> Option<i64> {
        CLOCK.with(|c| c.borrow().as_ref().map(|f| f()))
    }
}

macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vm])* #[serde(rename = $s)] $variant),+
        }

        impl $name {
            /// Every accepted spelling, for error messages.
            pub const ALL: &'static [&'static str] = &[$($s),+];

            /// The wire spelling.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $s),+ }
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($s => Ok(Self::$variant),)+
                    _ => Err(format!("must be one of {}", Self::ALL.join(", "))),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

string_enum! {
    /// What a host does while it cannot reach the global quota (state FAILED).
    OnFailure {
        /// Decide with a local limiter at `local_limit` permits per slice per host.
        Local = "local",
        /// Admit everything.
        Allow = "allow",
        /// Reject everything.
        Deny = "deny",
    }
}

string_enum! {
    /// How a task is limited.
    Mode {
        /// The slice design: hosts pull chunks of each slice's quota (default).
        Pooled = "pooled",
        /// Per-host only: every host applies `local_limit` per slice, no Redis.
        Local = "local",
        /// One atomic Redis call per decision against the slice (exact fixed window).
        ExactFixed = "exact_fixed",
        /// One atomic Redis call per decision against a sliding log.
        ExactSliding = "exact_sliding",
        /// `threshold` = permits in flight across the cluster: hosts lease blocks of permits
        /// (see [`lease`]); no slices.
        Concurrency = "concurrency",
    }
}

string_enum! {
    /// Algorithm of the local limiter used by mode `local` and by on_failure `local`.
    FallbackAlgorithm {
        /// Token bucket refilled at `local_limit` per slice, holding up to `burst`.
        TokenBucket = "token_bucket",
        /// Fixed window of one slice.
        FixedWindow = "fixed_window",
        /// Sliding window (two weighted fixed windows).
        SlidingWindow = "sliding_window",
        /// Sliding log of admission times.
        SlidingLog = "sliding_log",
        /// Leaky bucket (constant drain).
        LeakyBucket = "leaky_bucket",
    }
}

string_enum! {
    /// How a slice releases its quota (mode `pooled`).
    Pacing {
        /// The whole quota is available from the slice's start (default).
        None = "none",
        /// The quota is released evenly over the slice, plus `burst` permits at its start:
        /// `released(now) = min(cap, floor(cap · (now − start) / slice_ms) + burst)`.
        Smooth = "smooth",
    }
}

/// The local limiter settings of a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fallback {
    /// The algorithm.
    pub algorithm: FallbackAlgorithm,
    /// Burst size (token bucket capacity, leaky bucket queue); 0 = `local_limit`.
    pub burst: u64,
}

impl Default for Fallback {
    fn default() -> Self {
        Self {
            algorithm: FallbackAlgorithm::TokenBucket,
            burst: 0,
        }
    }
}

/// The part of a task spec a worker needs, as stored in `NS:{T}:meta`.
///
/// The manager writes it (fenced, with the slices); the SDK reads it with `HGETALL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskMeta {
    /// Slice length.
    pub slice_ms: u64,
    /// Base threshold (permits per slice) from the spec. Slices carry the effective one (`cap`).
    pub threshold: u64,
    /// Pull chunk size; 0 = automatic.
    pub pull: u64,
    /// Permits per slice per host while FAILED (and in mode `local`).
    pub local_limit: u64,
    /// FAILED behaviour.
    pub on_failure: OnFailure,
    /// Limiting mode.
    pub mode: Mode,
    /// Local limiter settings.
    pub fallback: Fallback,
    /// The spec's version (its etcd mod revision).
    pub version: i64,
    /// Mode `concurrency`: the lease TTL in ms (0 for other modes; an absent field reads as 0).
    pub lease_ms: u64,
    /// Keyed task: every key has its own limit (`threshold` unless overridden). Absent = false.
    pub keyed: bool,
    /// Keyed task: thresholds of overridden keys, by [`key_digest`] (meta fields `ko:<digest>`).
    /// The SDK does not need them (the KPULL script reads them); the manager writes them.
    pub key_overrides: std::collections::BTreeMap<String, u64>,
    /// Shadow mode: decisions are counted as if enforced but always admit (absent = false).
    pub shadow: bool,
    /// How slices release their quota (absent = none).
    pub pacing: Pacing,
    /// Paced slices: permits released at a slice's start on top of the pace (absent = 0).
    pub pace_burst: u64,
}

/// Meta hash field names written by the manager and read by workers.
pub mod meta_field {
    /// Protocol version.
    pub const PROTO: &str = "proto";
    /// Slice length in ms.
    pub const SLICE_MS: &str = "slice_ms";
    /// Base threshold.
    pub const THRESHOLD: &str = "threshold";
    /// Pull chunk size.
    pub const PULL: &str = "pull";
    /// FAILED-state per-host limit.
    pub const LOCAL_LIMIT: &str = "local_limit";
    /// FAILED behaviour.
    pub const ON_FAILURE: &str = "on_failure";
    /// Limiting mode.
    pub const MODE: &str = "mode";
    /// Local limiter algorithm.
    pub const FALLBACK: &str = "fallback";
    /// Local limiter burst.
    pub const FALLBACK_BURST: &str = "fallback_burst";
    /// Spec version.
    pub const VERSION: &str = "version";
    /// Lease TTL (ms) of a `concurrency` task.
    pub const LEASE_MS: &str = "lease_ms";
    /// `1` for a keyed task (absent or `0` otherwise).
    pub const KEYED: &str = "keyed";
    /// Prefix of key overrides: `ko:<digest>` = the key's threshold (keyed tasks).
    pub const KEY_OVERRIDE_PREFIX: &str = "ko:";
    /// How many `ko:` fields the meta has (written with them; absent = not known, as from a
    /// manager older than the field): KPULL reads the meta for a key new in a slice only when
    /// it is not `0`.
    pub const KEY_OVERRIDES: &str = "ko_n";
    /// Keyed tasks: `1` when the spec says `"clear_keys": true` (keys stored and shown in
    /// clear); absent or `0`: keys are stored as [`crate::key_label`]s.
    pub const CLEAR_KEYS: &str = "clear_keys";
    /// Keyed tasks without clear keys: the namespace's [`crate::KeySecret`] (64 hex digits).
    pub const KEY_SECRET: &str = "key_secret";
    /// Shadow mode: `1` or `0` (absent = `0`).
    pub const SHADOW: &str = "shadow";
    /// Slice pacing: `none` | `smooth` (absent = `none`); ROLL copies it into each slice.
    pub const PACING: &str = "pacing";
    /// Burst of paced slices (permits at a slice's start; absent = 0).
    pub const PACE_BURST: &str = "pace_burst";
    /// Term of the leader that last wrote this task: the fence (with [`EPOCH`]).
    pub const TERM: &str = "term";
    /// The etcd cluster id of that leader's election (decimal string): terms of different
    /// epochs are not comparable.
    pub const EPOCH: &str = "epoch";
    /// Redis time (Unix ms) of the last fenced write; a fence not refreshed for the manager's
    /// `--fence-stale-after` may be taken over.
    pub const FENCED_MS: &str = "fenced_ms";
    /// How long the fence holds (ms; protocol 5, a lazy task's, whose leader refreshes it less
    /// often): a writer of another term or epoch takes it over only once `fenced_ms` is older
    /// than the longer of this (counted up to 10 minutes) and its own `--fence-stale-after`.
    /// Absent: the writer's.
    pub const FENCE_TTL: &str = "fence_ttl";
    /// End (exclusive, ms) of the last slice the leader has written.
    pub const ROLLED_TO: &str = "rolled_to";
    /// Present when the task was deleted: the etcd revision of the deletion (the hash then
    /// keeps only this and the fence: `term`, `epoch`, `fenced_ms`).
    pub const RETIRED: &str = "retired";
    /// Lazy task (protocol 5, [`crate::scripts::LAZY_LUA`]): the cap of every slice a worker
    /// may make within [`LZ_FROM`, `LZ_UNTIL`).
    pub const LZ_CAP: &str = "lz_cap";
    /// Lazy task: start of the first slice a worker may make (Unix ms).
    pub const LZ_FROM: &str = "lz_from";
    /// Lazy task: end of the last slice a worker may make (Unix ms).
    pub const LZ_UNTIL: &str = "lz_until";
    /// Lazy task: how long (ms) a slice a worker made is kept after its end.
    pub const LZ_EXP: &str = "lz_exp";
    /// Lazy task: `<term> <epoch>` of the leader that wrote the window; workers use it only
    /// while the meta's fence (`term`, `epoch`) is still that leader's.
    pub const LZ_FENCE: &str = "lz_fence";
}

/// Slice hash field names.
pub mod slice_field {
    /// Threshold of this slice.
    pub const CAP: &str = "cap";
    /// Quota not yet pulled (may be negative after a threshold decrease).
    pub const REM: &str = "rem";
    /// Term of the leader that wrote it.
    pub const TERM: &str = "term";
    /// Length of this slice in ms (written by ROLL from the meta's `slice_ms`; absent in slices
    /// written before it was: then the task's `slice_ms`). The traffic history reads it.
    pub const LEN: &str = "len";
    /// Admitted decisions flushed by workers.
    pub const ADMITTED: &str = "adm";
    /// Rejected decisions flushed by workers.
    pub const REJECTED: &str = "rej";
    /// Successful outcomes reported by workers.
    pub const OK: &str = "ok";
    /// Failed outcomes reported by workers.
    pub const ERR: &str = "err";
    /// Sum of reported latencies in microseconds.
    pub const LAT_SUM_US: &str = "lat_sum_us";
    /// Number of reported latencies.
    pub const LAT_N: &str = "lat_n";
    /// The counter fields, in the order [`crate::scripts::SliceCounters`] uses.
    pub const COUNTERS: [&str; 6] = [ADMITTED, REJECTED, OK, ERR, LAT_SUM_US, LAT_N];
    /// Shadow mode: rejections (also counted in [`REJECTED`]) that shadow mode admitted.
    pub const WOULD_REJECT: &str = "wrej";
    /// The counters PULL and FLUSH carry since protocol 3: [`COUNTERS`] then [`WOULD_REJECT`].
    pub const WIRE_COUNTERS: [&str; 7] =
        [ADMITTED, REJECTED, OK, ERR, LAT_SUM_US, LAT_N, WOULD_REJECT];
    /// `1` when the slice is paced (written by ROLL from the meta's `pacing`; absent = not).
    pub const PACE: &str = "pace";
    /// Burst of a paced slice (permits released at its start).
    pub const BURST: &str = "burst";
}

/// Why a meta hash could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// The hash is empty or retired: the task does not exist (or Redis lost it).
    #[error("task meta missing or retired")]
    Missing,
    /// A field is absent or malformed.
    #[error("meta field {field:?}: {why}")]
    Field {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

impl TaskMeta {
    /// The field/value pairs the manager writes into the meta hash.
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        use meta_field::*;
        vec![
            (PROTO, PROTOCOL_VERSION.to_string()),
            (SLICE_MS, self.slice_ms.to_string()),
            (THRESHOLD, self.threshold.to_string()),
            (PULL, self.pull.to_string()),
            (LOCAL_LIMIT, self.local_limit.to_string()),
            (ON_FAILURE, self.on_failure.as_str().to_string()),
            (MODE, self.mode.as_str().to_string()),
            (FALLBACK, self.fallback.algorithm.as_str().to_string()),
            (FALLBACK_BURST, self.fallback.burst.to_string()),
            (VERSION, self.version.to_string()),
            (LEASE_MS, self.lease_ms.to_string()),
            (KEYED, u8::from(self.keyed).to_string()),
            (KEY_OVERRIDES, self.key_overrides.len().to_string()),
            (SHADOW, if self.shadow { "1" } else { "0" }.to_string()),
            (PACING, self.pacing.as_str().to_string()),
            (PACE_BURST, self.pace_burst.to_string()),
        ]
    }

    /// The key override fields (`ko:<digest>`, threshold) the manager writes with the meta; the
    /// ROLL script replaces all `ko:` fields whenever meta fields are written.
    pub fn override_pairs(&self) -> Vec<(String, String)> {
        self.key_overrides
            .iter()
            .map(|(d, t)| {
                (
                    format!("{}{d}", meta_field::KEY_OVERRIDE_PREFIX),
                    t.to_string(),
                )
            })
            .collect()
    }

    /// Parses the result of `HGETALL NS:{T}:meta`.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, MetaError> {
        use meta_field::*;
        let map: std::collections::HashMap<&str, &str> = pairs.into_iter().collect();
        if map.is_empty() || map.contains_key(RETIRED) || !map.contains_key(SLICE_MS) {
            return Err(MetaError::Missing);
        }
        fn get<T: FromStr>(
            map: &std::collections::HashMap<&str, &str>,
            field: &'static str,
        ) -> Result<T, MetaError>
        where
            T::Err: fmt::Display,
        {
            let raw = map.get(field).ok_or_else(|| MetaError::Field {
                field,
                why: "absent".into(),
            })?;
            raw.parse().map_err(|e: T::Err| MetaError::Field {
                field,
                why: format!("{raw:?}: {e}"),
            })
        }
        let slice_ms: u64 = get(&map, SLICE_MS)?;
        if !(MIN_SLICE_MS..=MAX_SLICE_MS).contains(&slice_ms) {
            return Err(MetaError::Field {
                field: SLICE_MS,
                why: format!("{slice_ms} out of range"),
            });
        }
        Ok(Self {
            slice_ms,
            threshold: get(&map, THRESHOLD)?,
            pull: get(&map, PULL)?,
            local_limit: get(&map, LOCAL_LIMIT)?,
            on_failure: get(&map, ON_FAILURE)?,
            mode: get(&map, MODE)?,
            fallback: Fallback {
                algorithm: get(&map, FALLBACK)?,
                burst: get(&map, FALLBACK_BURST)?,
            },
            version: get(&map, VERSION)?,
            lease_ms: match map.get(LEASE_MS) {
                None => 0,
                Some(_) => get(&map, LEASE_MS)?,
            },
            keyed: match map.get(KEYED) {
                None | Some(&"0") => false,
                Some(&"1") => true,
                Some(v) => {
                    return Err(MetaError::Field {
                        field: KEYED,
                        why: format!("{v:?}: expected 0 or 1"),
                    });
                }
            },
            key_overrides: {
                let mut o = std::collections::BTreeMap::new();
                for (k, v) in &map {
                    if let Some(d) = k.strip_prefix(KEY_OVERRIDE_PREFIX) {
                        let t = v.parse().map_err(|e| MetaError::Field {
                            field: KEY_OVERRIDE_PREFIX,
                            why: format!("{k}={v:?}: {e}"),
                        })?;
                        o.insert(d.to_string(), t);
                    }
                }
                o
            },
            shadow: match map.get(SHADOW) {
                None | Some(&"0") => false,
                Some(&"1") => true,
                Some(v) => {
                    return Err(MetaError::Field {
                        field: SHADOW,
                        why: format!("{v:?}: must be 0 or 1"),
                    });
                }
            },
            pacing: match map.get(PACING) {
                None => Pacing::None,
                Some(_) => get(&map, PACING)?,
            },
            pace_burst: match map.get(PACE_BURST) {
                None => 0,
                Some(_) => get(&map, PACE_BURST)?,
            },
        })
    }
}

/// One host's entry in `NS:hosts` (JSON), written by the SDK.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostReport {
    /// Host clock minus Redis `TIME`, in ms (positive = host ahead).
    pub offset_ms: f64,
    /// Round trip of the measuring call, in ms: the offset's error bound is half of it.
    pub rtt_ms: f64,
    /// When the host last reported (host clock, Unix ms).
    pub seen_ms: i64,
    /// SDK version.
    pub sdk: String,
    /// The worker's protocol version ([`PROTOCOL_VERSION`]; absent in reports of workers
    /// before protocol 5): a leader leaves no task lazy while a fresh host reports less than 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proto: Option<u32>,
    /// Tasks this host uses, with the host's state for each (`normal`/`limited`/`failed`).
    #[serde(default)]
    pub tasks: std::collections::BTreeMap<String, String>,
    /// Concurrency tasks this host uses: its permits (absent in reports of older SDKs).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub permits: std::collections::BTreeMap<String, PermitReport>,
}

/// One host's permits of one concurrency task, in its `NS:hosts` entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitReport {
    /// Permits in use on the host.
    pub in_use: u64,
    /// Permits the host may hand out (its leased block, or `local_limit` while FAILED).
    pub limit: u64,
    /// Callers waiting for a permit.
    pub waiting: u64,
    /// Times the host's lease lapsed (renewal failed past the safety margin).
    pub lapses: u64,
    /// Permits of dead processes given back to the host.
    pub reclaimed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_quota_fields_parse_or_are_refused() {
        assert_eq!(parse_key_quota("17"), Some((17, None)));
        assert_eq!(parse_key_quota("-3"), Some((-3, None)));
        assert_eq!(parse_key_quota("5:100"), Some((5, Some(100))));
        for bad in ["", "x", "5:", ":5", "5:-1", "5:1:2", "1.5"] {
            assert_eq!(parse_key_quota(bad), None, "{bad:?}");
        }
        assert_eq!(key_field("ab"), "k:ab");
        assert_eq!(
            Keys::new("ns").unwrap().key_slices("t", 1_000),
            "ns:{t}:k:1000"
        );
        // The digest is unchanged by the allocation-free hex (SHA-256("abc")).
        assert_eq!(key_digest("abc"), "ba7816bf8f01cfea414140de5dae2223");
    }

    #[test]
    fn names() {
        assert!(validate_task_name(&"a".repeat(64)).is_ok());
        assert!(validate_task_name(&"a".repeat(65)).is_err());
        for bad in ["a b", "a:b", "{a}", "a/b", "é"] {
            assert!(validate_task_name(bad).is_err(), "{bad}");
        }
        assert!(Keys::new("x:y").is_err());
    }

    #[test]
    fn slice_maths() {
        assert_eq!(slice::start(1_999, 1_000), 1_000);
        assert_eq!(slice::end(1_000, 250), 1_250);
        assert_eq!(slice::starts(0, 1, 100).collect::<Vec<_>>(), [0]);
        assert_eq!(slice::starts(100, 100, 100).count(), 0);
        assert_eq!(slice::remaining_fraction(1_250, 1_000, 1_000), 0.75);
        assert_eq!(slice::remaining_fraction(5_000, 1_000, 1_000), 0.0);
    }

    #[test]
    fn meta_round_trip() {
        let meta = TaskMeta {
            slice_ms: 1000,
            threshold: 5000,
            pull: 0,
            local_limit: 500,
            on_failure: OnFailure::Local,
            mode: Mode::Pooled,
            fallback: Fallback::default(),
            version: 7,
            lease_ms: 0,
            keyed: false,
            key_overrides: Default::default(),
            shadow: true,
            pacing: Pacing::Smooth,
            pace_burst: 30,
        };
        let pairs = meta.to_pairs();
        let back = TaskMeta::from_pairs(pairs.iter().map(|(k, v)| (*k, v.as_str()))).unwrap();
        assert_eq!(back, meta);
        assert_eq!(
            TaskMeta::from_pairs([("term", "3"), ("retired", "1")]),
            Err(MetaError::Missing)
        );
        let err = TaskMeta::from_pairs(
            pairs
                .iter()
                .map(|(k, v)| (*k, if *k == "mode" { "nope" } else { v.as_str() })),
        )
        .unwrap_err();
        assert!(matches!(err, MetaError::Field { field: "mode", .. }));
        // A v2 meta (no shadow/pacing fields) reads as unshadowed and unpaced.
        let old = TaskMeta::from_pairs(
            pairs
                .iter()
                .filter(|(k, _)| !["shadow", "pacing", "pace_burst"].contains(k))
                .map(|(k, v)| (*k, v.as_str())),
        )
        .unwrap();
        assert_eq!(
            (old.shadow, old.pacing, old.pace_burst),
            (false, Pacing::None, 0)
        );
        for (field, bad) in [("shadow", "yes"), ("pacing", "jerky"), ("pace_burst", "-1")] {
            let err = TaskMeta::from_pairs(
                pairs
                    .iter()
                    .map(|(k, v)| (*k, if *k == field { bad } else { v.as_str() })),
            )
            .unwrap_err();
            assert!(
                matches!(err, MetaError::Field { field: f, .. } if f == field),
                "{field}"
            );
        }
    }
}

/// The crate README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
