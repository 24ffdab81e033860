//! The public API: [`Client`], [`Task`], [`Decision`].
//!
//! ```text
//!   business thread                         background thread (one per Client)
//!   ───────────────                         ─────────────────────────────────
//!   task.try_acquire(n)                     loop every ≤10 ms or when poked:
//!     1 load meta word   ─┐                   refresh meta (host-wide, ~1/s)
//!     2 CAS quota word    │ shared memory     pull when below low water / prefetch the
//!     3 below low water?  │ (/dev/shm)          next slice (under the host's pull lock)
//!       → poke ───────────┼──────────────▶    probe while FAILED
//!   → Decision           ─┘                   flush counters, report the host (rate-limited)
//! ```
//!
//! The decision path never touches the network, never allocates, never blocks and never
//! panics; everything that talks to Redis runs on the client's own thread and runtime.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::health::{self, Outcome};
use crate::limiter::{self, Params, Verdict};
use crate::protocol::conn::{
    CheckError, ConnOptions, Redis, RedisSecurity, RedisTarget, SecurityError,
};
use crate::protocol::scripts::ExactReply;
use crate::protocol::{Keys, Mode, NameError, OnFailure, TaskMeta, validate_task_name};
use crate::shm::{
    ClaimOptions, FastMeta, Opened, Segment, SegmentError, Slot, SlotRef, field, tag_of,
    unpack_quota, word_generation,
};
use crate::state::{Health, HostState, Machine, view};

/// Which clock slices follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClockSource {
    /// The host clock (kept in step by NTP), as in the seed. Default.
    #[default]
    Host,
    /// Redis `TIME`: the host clock minus the offset measured on every pull (bounded by half
    /// the round trip). For hosts whose clocks cannot be trusted.
    Redis,
}

/// Client settings. [`Config::new`] gives the defaults; every field is public.
#[derive(Debug, Clone)]
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
    /// Entries of the host's key table for keyed tasks (default
    /// [`crate::keyed::DEFAULT_KEY_SLOTS`] = 16,384, 6 MiB; at most
    /// [`crate::keyed::MAX_KEY_SLOTS`] = 262,144). Like the segment, a table with fewer entries
    /// is replaced by a larger one.
    pub key_slots: u32,
    /// What to answer for a task whose meta is not known yet (never read by any process of
    /// this host): `true` (default) admits ([`Decision::FallbackAllowed`]), `false` rejects.
    pub allow_unknown: bool,
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
            key_slots: crate::keyed::DEFAULT_KEY_SLOTS,
            allow_unknown: true,
        }
    }
}

/// Why a client or task could not be created.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad task name or namespace.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The Redis address does not parse.
    #[error("Redis address: {0}")]
    Redis(String),
    /// A TLS or ACL setting of [`Config::redis_security`] cannot be used (the field is named,
    /// a secret never).
    #[error("{}", security_message(.0))]
    RedisSecurity(#[source] SecurityError),
    /// The shared segment could not be opened.
    #[error(transparent)]
    Segment(#[from] SegmentError),
    /// Every slot of the segment is taken.
    #[error("shared segment {path} has no free slot for task {task:?}")]
    SegmentFull {
        /// The segment.
        path: PathBuf,
        /// The task.
        task: String,
    },
    /// The background thread could not be started.
    #[error("cannot start the background thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The host's key table (keyed tasks) could not be opened.
    #[error("{0}")]
    KeyTable(String),
}

/// `Config::redis_security.<field>: …`, or `Config::redis: …` for the URL itself.
fn security_message(e: &SecurityError) -> String {
    match e.field {
        "redis" => format!("Config::redis: {}", e.message),
        f => format!("Config::redis_security.{f}: {}", e.message),
    }
}

/// The answer to "may I do `n` units of work now?".
///
/// Which call to use: [`Task::try_acquire`] for modes `pooled` and `local` (no network, never
/// waits); [`Task::acquire`] / [`Task::acquire_blocking`] for every mode, and always for
/// `exact_fixed` / `exact_sliding`, whose decisions need a Redis round trip
/// (`try_acquire` answers [`Decision::WouldBlock`] for them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Admitted from the global quota.
    Allowed,
    /// Rejected: the global quota of this slice is spent (LIMITED), or a refill is on its way
    /// (then `retry_after` is short; [`Task::acquire`] waits for it instead).
    Limited {
        /// When a retry may succeed.
        retry_after: Duration,
    },
    /// Admitted without the global quota: the task is FAILED (or not known yet) and its
    /// `on_failure` policy admitted it.
    FallbackAllowed,
    /// Rejected by the `on_failure` policy while FAILED.
    FallbackDenied {
        /// When a retry may succeed.
        retry_after: Duration,
    },
    /// Not decided: this task is exact (`exact_fixed` / `exact_sliding`); its decision needs a
    /// Redis round trip, which [`Task::try_acquire`] never waits for. Call [`Task::acquire`] /
    /// [`Task::acquire_blocking`]. Never admitted, counted nowhere (it is not a decision).
    WouldBlock,
}

impl Decision {
    /// True when the work may proceed.
    #[inline]
    pub fn is_allowed(&self) -> bool {
        matches!(self, Decision::Allowed | Decision::FallbackAllowed)
    }

    /// True when the global quota did not decide (FAILED, unknown task).
    pub fn is_fallback(&self) -> bool {
        matches!(
            self,
            Decision::FallbackAllowed | Decision::FallbackDenied { .. }
        )
    }

    /// When a rejected caller may retry.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Decision::Limited { retry_after } | Decision::FallbackDenied { retry_after } => {
                Some(*retry_after)
            }
            _ => None,
        }
    }
}

/// Retry hint while a refill is in flight.
const PENDING_RETRY: Duration = Duration::from_millis(1);

pub(crate) enum Step {
    Decided(Decision),
    /// A refill of the slice starting at `start_ms` (grid `slice_ms`) is on its way.
    Pending {
        start_ms: i64,
        slice_ms: u64,
    },
}

pub(crate) struct Shared {
    pub(crate) cfg: Config,
    pub(crate) keys: Keys,
    pub(crate) seg: Segment,
    pub(crate) redis: Redis,
    pub(crate) tasks: Mutex<Vec<Arc<TaskInner>>>,
    pub(crate) wake: Notify,
    pub(crate) redis_calls: Arc<AtomicU64>,
    pub(crate) machine: Machine,
    pub(crate) stop: AtomicBool,
    /// The background runtime (exact-mode calls run on it).
    pub(crate) rt: tokio::runtime::Handle,
    /// Random per client: prefixes request ids and sliding-log members.
    pub(crate) nonce: u64,
    /// Sequence of request ids.
    pub(crate) requests: AtomicU64,
    /// When the client was created.
    pub(crate) started: Instant,
    /// Keyed tasks: the key table and pending key pulls.
    pub(crate) keyed: crate::keyed::KeyState,
}

impl Shared {
    #[inline]
    pub(crate) fn now_us(&self) -> i64 {
        let h = crate::clock::host_us();
        match self.cfg.clock {
            ClockSource::Host => h,
            ClockSource::Redis => h - self.seg.header().clock_offset_us.load(Ordering::Relaxed),
        }
    }

    /// A request id unique to this call (a retry of the call reuses it).
    pub(crate) fn request_id(&self) -> String {
        format!(
            "{:016x}.{:x}",
            self.nonce,
            self.requests.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// How to claim a slot now.
    pub(crate) fn claim_options(&self) -> ClaimOptions {
        ClaimOptions {
            now_ms: crate::clock::host_ms(),
            lock_timeout_ms: self.cfg.lock_timeout.as_millis() as u64,
            reclaim_idle_ms: self.cfg.reclaim_idle.as_millis().max(1) as u64,
        }
    }
}

/// 64 random bits (`getrandom`; the clock and pid if that fails).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into the buffer we pass.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == b.len() as isize {
        return u64::from_le_bytes(b);
    }
    (crate::clock::host_us() as u64).rotate_left(17) ^ ((std::process::id() as u64) << 40)
}

pub(crate) struct TaskInner {
    pub(crate) name: String,
    /// The slot: `index:32 | generation:16`, re-resolved when the slot was reclaimed.
    slot_ref: AtomicU64,
    /// Full index of the slice the last decision fell in (saves a division per decision).
    index_cache: AtomicU64,
    pub(crate) poked: AtomicBool,
    pub(crate) deposited: Notify,
    pub(crate) waiters: AtomicUsize,
    /// `try_acquire` on an exact task was warned about (once per task per process).
    warned_would_block: AtomicBool,
    /// Slice start whose grant was dropped (it had ended): never pulled for again.
    pub(crate) dropped_start: AtomicI64,
    /// When this process last refreshed the slot's `used_ms` (host ms).
    pub(crate) touched_ms: AtomicI64,
    /// When this process last warned about pulls outside the slice window (host ms).
    pub(crate) window_warned_ms: AtomicI64,
    /// A flush whose answer was lost: `(seq, batch)`, resent with the same seq.
    pub(crate) pending_flush: Mutex<Option<crate::background::FlushBatch>>,
}

impl TaskInner {
    pub(crate) fn new(name: &str, r: SlotRef) -> Self {
        let t = Self {
            name: name.to_string(),
            slot_ref: AtomicU64::new(0),
            index_cache: AtomicU64::new(0),
            poked: AtomicBool::new(false),
            deposited: Notify::new(),
            waiters: AtomicUsize::new(0),
            warned_would_block: AtomicBool::new(false),
            dropped_start: AtomicI64::new(i64::MIN),
            touched_ms: AtomicI64::new(0),
            window_warned_ms: AtomicI64::new(0),
            pending_flush: Mutex::new(None),
        };
        t.set_slot_ref(r);
        t
    }

    #[inline]
    pub(crate) fn slot_ref(&self) -> SlotRef {
        let w = self.slot_ref.load(Ordering::Acquire);
        SlotRef {
            index: (w >> 16) as usize,
            generation: w as u16,
        }
    }

    pub(crate) fn set_slot_ref(&self, r: SlotRef) {
        self.slot_ref.store(
            ((r.index as u64) << 16) | r.generation as u64,
            Ordering::Release,
        );
    }
}

pub(crate) struct Guard {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_one();
        if let Some(h) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = h.join();
        }
    }
}

/// A connection to Sluice for this process: the host segment, one Redis connection, and the
/// background thread. Cheap to clone; the thread stops (after a last flush) when the last
/// `Client` and [`Task`] are dropped.
#[derive(Clone)]
pub struct Client {
    pub(crate) shared: Arc<Shared>,
    pub(crate) guard: Arc<Guard>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("namespace", &self.shared.cfg.namespace)
            .field("host_id", &self.shared.cfg.host_id)
            .field("segment", &self.shared.seg.path())
            .finish()
    }
}

impl Client {
    /// Opens the host segment (creating or replacing it when needed) and starts the
    /// background thread. Does not wait for Redis: a client starts while Redis is down.
    pub fn new(cfg: Config) -> Result<Self, Error> {
        let keys = Keys::new(&cfg.namespace)?;
        let target = RedisTarget::parse(&cfg.redis).map_err(Error::Redis)?;
        let path = Segment::path_for(&cfg.shm_dir, &cfg.namespace, &cfg.host_id);
        let (seg, opened) = Segment::open(&path, cfg.max_tasks)?;
        match &opened {
            Opened::Existing => tracing::debug!(path = %path.display(), "joined host segment"),
            Opened::Created => tracing::info!(path = %path.display(), "created host segment"),
            Opened::Replaced(why) => {
                tracing::warn!(path = %path.display(), reason = %why, "replaced host segment")
            }
        }
        let redis = Redis::with_security(
            target,
            ConnOptions {
                connect_timeout: cfg.connect_timeout,
                response_timeout: cfg.pull_timeout,
            },
            &cfg.redis_security,
        )
        .map_err(Error::RedisSecurity)?;
        if cfg.redis_security.insecure {
            tracing::warn!(
                redis = %redis.target(),
                "Redis TLS certificate verification is OFF (insecure): anyone on the path can \
                 read and change this link; use it for tests only"
            );
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::Spawn)?;
        let shared = Arc::new(Shared {
            rt: rt.handle().clone(),
            nonce: random_u64(),
            requests: AtomicU64::new(0),
            started: Instant::now(),
            machine: Machine {
                probe_interval_ms: cfg.probe_interval.as_millis().max(1) as i64,
            },
            cfg,
            keys,
            seg,
            redis,
            tasks: Mutex::new(Vec::new()),
            wake: Notify::new(),
            redis_calls: Arc::new(AtomicU64::new(0)),
            stop: AtomicBool::new(false),
            keyed: Default::default(),
        });
        let thread = crate::background::spawn(shared.clone(), rt).map_err(Error::Spawn)?;
        Ok(Self {
            guard: Arc::new(Guard {
                shared: shared.clone(),
                thread: Mutex::new(Some(thread)),
            }),
            shared,
        })
    }

    /// A handle to task `name` (its slot in the host segment is claimed on first use: a free
    /// slot, else one idle for [`Config::reclaim_idle`]; [`Error::SegmentFull`] when there is
    /// none). The process's state for the task is dropped (after a last flush) once no handle
    /// refers to it any more.
    pub fn task(&self, name: &str) -> Result<Task, Error> {
        validate_task_name(name)?;
        let mut tasks = self.shared.tasks.lock().unwrap_or_else(|e| e.into_inner());
        let inner = match tasks.iter().find(|t| t.name == name) {
            Some(t) => t.clone(),
            None => {
                let r = self
                    .shared
                    .seg
                    .claim(name, self.shared.claim_options())
                    .ok_or_else(|| Error::SegmentFull {
                        path: self.shared.seg.path().to_path_buf(),
                        task: name.to_string(),
                    })?;
                let t = Arc::new(TaskInner::new(name, r));
                tasks.push(t.clone());
                t
            }
        };
        if let Some(s) = self.shared.seg.slot(inner.slot_ref().index) {
            let now = crate::clock::host_ms();
            s.touch(now);
            inner.touched_ms.store(now, Ordering::Relaxed);
        }
        drop(tasks);
        self.shared.wake.notify_one();
        Ok(Task {
            inner,
            shared: self.shared.clone(),
            _guard: self.guard.clone(),
        })
    }

    /// Connects to Redis now and sends `PING`, waiting at most a few connect timeouts: for a
    /// program that wants a misconfigured link to fail at start-up. [`CheckError::Config`]:
    /// the TLS handshake or the ACL login failed (wrong CA, certificate, user or password),
    /// which retrying will not fix; [`CheckError::Down`]: Redis is unreachable (the client
    /// keeps working from its `on_failure` policy and reconnects by itself). Both name the
    /// endpoint, passwords redacted. Decisions never wait for this.
    pub fn check_redis(&self) -> Result<(), CheckError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = self.shared.clone();
        self.shared.rt.spawn(async move {
            let _ = tx.send(shared.redis.check().await);
        });
        let wait = self.shared.cfg.connect_timeout * 5 + Duration::from_millis(500);
        rx.recv_timeout(wait).unwrap_or_else(|_| {
            Err(CheckError::Down {
                target: self.shared.redis.target().to_string(),
                detail: "no answer in time".into(),
            })
        })
    }

    /// Redis calls this process has made (pulls, probes, flushes, meta reads, host reports).
    pub fn redis_calls(&self) -> u64 {
        self.shared.redis_calls.load(Ordering::Relaxed)
    }

    /// A handle to the same count that outlives the client (read it after the last flush).
    pub fn redis_calls_counter(&self) -> RedisCalls {
        RedisCalls(self.shared.redis_calls.clone())
    }

    /// The host segment's file.
    pub fn segment_path(&self) -> &std::path::Path {
        self.shared.seg.path()
    }

    /// This host's clock minus Redis `TIME` (best recent measurement) and its round trip;
    /// `None` before the first pull.
    pub fn clock_offset(&self) -> Option<(Duration, bool, Duration)> {
        let h = self.shared.seg.header();
        let rtt = h.clock_rtt_us.load(Ordering::Relaxed);
        if rtt <= 0 {
            return None;
        }
        let off = h.clock_offset_us.load(Ordering::Relaxed);
        Some((
            Duration::from_micros(off.unsigned_abs()),
            off >= 0,
            Duration::from_micros(rtt as u64),
        ))
    }
}

/// A count of Redis calls made by one client ([`Client::redis_calls_counter`]).
#[derive(Debug, Clone)]
pub struct RedisCalls(Arc<AtomicU64>);

impl RedisCalls {
    /// The count now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A handle to one task. Cheap to clone and share between threads.
#[derive(Clone)]
pub struct Task {
    pub(crate) inner: Arc<TaskInner>,
    pub(crate) shared: Arc<Shared>,
    _guard: Arc<Guard>,
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task")
            .field("name", &self.inner.name)
            .field("state", &self.state())
            .finish()
    }
}

impl Task {
    /// The task's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Now on the clock slices follow (Unix µs).
    #[inline]
    pub fn now_us(&self) -> i64 {
        self.shared.now_us()
    }

    /// Decides `n` permits now, from the host's local quota. Never waits.
    #[inline]
    pub fn try_acquire(&self, n: u64) -> Decision {
        self.try_acquire_at(n, self.shared.now_us())
    }

    /// Decides `n` permits as of `now_us` (Unix µs on [`Task::now_us`]'s clock). For callers
    /// that must know which slice a decision was charged to (load generators, tests); the
    /// quota of a slice is only ever spent by decisions that fall in it.
    #[inline]
    ///
    /// For an exact task (`exact_fixed` / `exact_sliding`) this answers
    /// [`Decision::WouldBlock`] (and logs a warning once per task per process): use
    /// [`Task::acquire`] / [`Task::acquire_blocking`].
    pub fn try_acquire_at(&self, n: u64, now_us: i64) -> Decision {
        match self.decide(n, now_us) {
            Step::Decided(d) => d,
            Step::Pending { start_ms, slice_ms } => self.pending_rejected(start_ms, slice_ms, n),
        }
    }

    /// A decision that stays "refill pending" is final here: a rejection, counted as such.
    #[cold]
    pub(crate) fn pending_rejected(&self, start_ms: i64, slice_ms: u64, n: u64) -> Decision {
        if let Some(slot) = self.slot() {
            slot.count(start_ms, slice_ms, field::REJECTED, n);
        }
        Decision::Limited {
            retry_after: PENDING_RETRY,
        }
    }

    /// Like [`Task::try_acquire`], but when the local quota is being refilled, waits for the
    /// refill (at most [`Config::acquire_timeout`]). Works on any executor (it is woken by the
    /// client's background thread, not by a timer of the caller's runtime).
    ///
    /// For tasks in mode `exact_fixed` / `exact_sliding` this is the exact decision: one
    /// atomic Redis call (bounded by the pull timeout; on failure the task's `on_failure`
    /// decides).
    pub async fn acquire(&self, n: u64) -> Decision {
        let deadline = Instant::now() + self.shared.cfg.acquire_timeout;
        loop {
            if let Some((m, index, now_us)) = self.exact_target(n) {
                let sh = self.shared.clone();
                let fut = crate::background::exact(sh, self.inner.name.clone(), m, index, n);
                let reply = self.shared.rt.spawn(fut).await.ok().flatten();
                return self.exact_decision(reply, &m, index, n, now_us);
            }
            let notified = self.inner.deposited.notified();
            match self.decide(n, self.shared.now_us()) {
                // The mode changed to exact between the two reads: decide it exactly.
                Step::Decided(Decision::WouldBlock)
                    if Instant::now() < deadline && !self.is_concurrency() =>
                {
                    continue;
                }
                Step::Decided(d) => return d,
                Step::Pending { start_ms, slice_ms } if Instant::now() >= deadline => {
                    return self.pending_rejected(start_ms, slice_ms, n);
                }
                Step::Pending { .. } => {
                    self.inner.waiters.fetch_add(1, Ordering::AcqRel);
                    self.shared.wake.notify_one();
                    notified.await;
                    self.inner.waiters.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }

    /// [`Task::acquire`] for programs without an async runtime: sleeps in short steps.
    pub fn acquire_blocking(&self, n: u64) -> Decision {
        let deadline = Instant::now() + self.shared.cfg.acquire_timeout;
        loop {
            if let Some((m, index, now_us)) = self.exact_target(n) {
                let (tx, rx) = std::sync::mpsc::channel();
                let fut = crate::background::exact(
                    self.shared.clone(),
                    self.inner.name.clone(),
                    m,
                    index,
                    n,
                );
                self.shared.rt.spawn(async move {
                    let _ = tx.send(fut.await);
                });
                let wait = self.shared.cfg.pull_timeout * 2 + Duration::from_millis(100);
                let reply = rx.recv_timeout(wait).ok().flatten();
                return self.exact_decision(reply, &m, index, n, now_us);
            }
            match self.decide(n, self.shared.now_us()) {
                Step::Decided(Decision::WouldBlock)
                    if Instant::now() < deadline && !self.is_concurrency() =>
                {
                    continue;
                }
                Step::Decided(d) => return d,
                Step::Pending { start_ms, slice_ms } if Instant::now() >= deadline => {
                    return self.pending_rejected(start_ms, slice_ms, n);
                }
                Step::Pending { .. } => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }

    /// Reports how admitted work ended, for the slice's health counters.
    pub fn report(&self, outcome: Outcome, latency: Duration) {
        let Some((slot, m)) = self.slot_meta() else {
            return;
        };
        let index = self.index(self.shared.now_us(), m.slice_ms * 1_000);
        health::record(
            slot,
            (index * m.slice_ms) as i64,
            m.slice_ms,
            outcome,
            latency,
        );
    }

    /// The task's state on this host now.
    pub fn state(&self) -> HostState {
        let Some((slot, m)) = self.slot_meta() else {
            return HostState::Unknown;
        };
        let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
        let index = self.index(self.shared.now_us(), m.slice_ms * 1_000);
        let start = (index * m.slice_ms) as i64;
        let w = slot.entry(start, m.slice_ms).word.load(Ordering::Acquire);
        view(health, w, tag_of(start))
    }

    /// The last known meta (from this host's segment), if any.
    pub fn meta(&self) -> Option<TaskMeta> {
        let (slot, _) = self.slot_meta()?;
        slot.meta()
    }

    /// The slot and its known meta, when the slot is still this task's.
    pub(crate) fn slot_meta(&self) -> Option<(&Slot, FastMeta)> {
        let r = self.inner.slot_ref();
        let slot = self.shared.seg.slot(r.index)?;
        let m = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire))?;
        (m.generation == r.generation).then_some((slot, m))
    }

    /// Waits (blocking, polling) until the task's meta is known, at most `timeout`.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.meta().is_some() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            self.shared.wake.notify_one();
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// When the task is in an exact mode: its meta, slice index and now.
    fn exact_target(&self, n: u64) -> Option<(FastMeta, u64, i64)> {
        let (_, m) = self.slot_meta()?;
        if n == 0 || !matches!(m.mode, Mode::ExactFixed | Mode::ExactSliding) {
            return None;
        }
        let now_us = self.shared.now_us();
        Some((m, self.index(now_us, m.slice_ms * 1_000), now_us))
    }

    fn exact_decision(
        &self,
        reply: Option<ExactReply>,
        m: &FastMeta,
        index: u64,
        n: u64,
        now_us: i64,
    ) -> Decision {
        match reply {
            Some(ExactReply::Admitted { .. }) => Decision::Allowed,
            Some(ExactReply::Refused { retry_after_us, .. }) => {
                let retry_us = match m.mode {
                    Mode::ExactSliding => retry_after_us as i64,
                    _ => (index + 1) as i64 * (m.slice_ms * 1_000) as i64 - now_us,
                };
                Decision::Limited {
                    retry_after: Duration::from_micros(retry_us.max(1) as u64),
                }
            }
            Some(ExactReply::OutsideWindow { redis_time_us }) => {
                let start_ms = (index * m.slice_ms) as i64;
                let retry_ms = crate::background::outside_window(
                    &self.shared,
                    &self.inner,
                    start_ms,
                    m.slice_ms,
                    redis_time_us,
                );
                Decision::Limited {
                    retry_after: Duration::from_millis(retry_ms.max(1) as u64),
                }
            }
            Some(ExactReply::Missing { .. }) | None => match self.slot() {
                Some(slot) => self.fallback(slot, m, index, n, now_us),
                None => self.unknown(),
            },
        }
    }

    #[inline]
    fn slot(&self) -> Option<&Slot> {
        self.shared.seg.slot(self.inner.slot_ref().index)
    }

    /// Full slice index of `now_us`, from a cache when the slice has not changed.
    #[inline]
    fn index(&self, now_us: i64, slice_us: u64) -> u64 {
        let cached = self.inner.index_cache.load(Ordering::Relaxed);
        let start = cached.wrapping_mul(slice_us) as i64;
        if now_us >= start && now_us < start.wrapping_add(slice_us as i64) {
            return cached;
        }
        let index = now_us.max(0) as u64 / slice_us.max(1);
        self.inner.index_cache.store(index, Ordering::Relaxed);
        index
    }

    #[inline]
    pub(crate) fn decide(&self, n: u64, now_us: i64) -> Step {
        if n == 0 {
            return Step::Decided(Decision::Allowed);
        }
        let r = self.inner.slot_ref();
        let Some(slot) = self.shared.seg.slot(r.index) else {
            return Step::Decided(self.unknown());
        };
        let w = slot.meta.fast.load(Ordering::Acquire);
        if word_generation(w) != r.generation {
            return self.reresolve(n, now_us);
        }
        let Some(m) = FastMeta::decode(w) else {
            self.poke();
            return Step::Decided(self.unknown());
        };
        let slice_us = m.slice_ms * 1_000;
        let index = self.index(now_us, slice_us);
        match m.mode {
            Mode::Pooled => self.pooled(slot, &m, index, n, now_us),
            Mode::Local => {
                let d = match self.local(slot, &m, n, now_us) {
                    Verdict::Admit => Decision::Allowed,
                    Verdict::Deny { retry_after_us } => Decision::Limited {
                        retry_after: Duration::from_micros(retry_after_us),
                    },
                };
                self.count(slot, &m, index, n, d.is_allowed());
                Step::Decided(d)
            }
            // Exact modes need a Redis round trip per decision, which the synchronous path
            // never waits for; concurrency tasks hand out permits (`try_permit`).
            Mode::ExactFixed | Mode::ExactSliding | Mode::Concurrency => {
                Step::Decided(self.would_block(&m))
            }
        }
    }

    /// The slot was reclaimed for another task (its generation changed): find the task's
    /// slot again by name, else answer as for an unknown task and let the background thread
    /// claim a new one.
    #[cold]
    fn reresolve(&self, n: u64, now_us: i64) -> Step {
        let r = self.inner.slot_ref();
        match self.shared.seg.resolve(&self.inner.name) {
            Some(new) if new != r => {
                self.inner.set_slot_ref(new);
                let w = self
                    .shared
                    .seg
                    .slot(new.index)
                    .map_or(0, |s| s.meta.fast.load(Ordering::Acquire));
                if word_generation(w) == new.generation {
                    return self.decide(n, now_us);
                }
            }
            _ => {}
        }
        self.poke();
        Step::Decided(self.unknown())
    }

    fn is_concurrency(&self) -> bool {
        self.slot_meta()
            .is_some_and(|(_, m)| m.mode == Mode::Concurrency)
    }

    #[cold]
    fn would_block(&self, m: &FastMeta) -> Decision {
        if m.mode == Mode::Concurrency {
            if !self.inner.warned_would_block.swap(true, Ordering::Relaxed) {
                tracing::warn!(task = %self.inner.name,
                    "try_acquire/acquire on a concurrency task answers WouldBlock: take a permit \
                     with permit or try_permit");
            }
            return Decision::WouldBlock;
        }
        if !self.inner.warned_would_block.swap(true, Ordering::Relaxed) {
            tracing::warn!(task = %self.inner.name, mode = %m.mode,
                "try_acquire on an exact task answers WouldBlock: its decisions need a Redis \
                 round trip; call acquire or acquire_blocking");
        }
        Decision::WouldBlock
    }

    #[inline]
    fn pooled(&self, slot: &Slot, m: &FastMeta, index: u64, n: u64, now_us: i64) -> Step {
        let start_ms = (index * m.slice_ms) as i64;
        let tag = tag_of(start_ms);
        let e = &slot.quota[(index & 1) as usize];
        let mut q = e.word.load(Ordering::Acquire);
        loop {
            let (t, _, c) = unpack_quota(q);
            if t != tag || (c as u64) < n {
                break;
            }
            match e
                .word
                .compare_exchange_weak(q, q - n, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if c as u64 - n < e.low_water.load(Ordering::Relaxed) {
                        self.want(slot, start_ms, n);
                    }
                    return Step::Decided(Decision::Allowed);
                }
                Err(x) => q = x,
            }
        }
        // Not enough local quota for this slice.
        if let Health::Failed { .. } = Health::decode(slot.ctl.state.load(Ordering::Acquire)) {
            return Step::Decided(self.fallback(slot, m, index, n, now_us));
        }
        let (t, exhausted, _) = unpack_quota(q);
        if (t == tag && exhausted && q != 0) || n > crate::shm::MAX_COUNT as u64 {
            slot.count_at(index, start_ms, field::REJECTED, n);
            let end = start_ms
                .saturating_add(m.slice_ms as i64)
                .saturating_mul(1_000);
            return Step::Decided(Decision::Limited {
                retry_after: Duration::from_micros((end - now_us).max(1) as u64),
            });
        }
        // Not final: the caller decides whether to wait for the refill (acquire) or not.
        self.want(slot, start_ms, n);
        Step::Pending {
            start_ms,
            slice_ms: m.slice_ms,
        }
    }

    fn local(&self, slot: &Slot, m: &FastMeta, n: u64, now_us: i64) -> Verdict {
        let p = Params {
            limit: slot.meta.local_limit.load(Ordering::Relaxed),
            window_us: m.slice_ms * 1_000,
            burst: slot.meta.burst.load(Ordering::Relaxed),
        };
        limiter::decide_shared(&self.shared.seg, slot, m.algorithm, &p, now_us, n)
    }

    fn fallback(&self, slot: &Slot, m: &FastMeta, index: u64, n: u64, now_us: i64) -> Decision {
        let d = match m.on_failure {
            OnFailure::Allow => Decision::FallbackAllowed,
            OnFailure::Deny => {
                let next = slot.ctl.next_probe_ms.load(Ordering::Relaxed) * 1_000;
                Decision::FallbackDenied {
                    retry_after: Duration::from_micros((next - now_us).max(1_000) as u64),
                }
            }
            OnFailure::Local => match self.local(slot, m, n, now_us) {
                Verdict::Admit => Decision::FallbackAllowed,
                Verdict::Deny { retry_after_us } => Decision::FallbackDenied {
                    retry_after: Duration::from_micros(retry_after_us),
                },
            },
        };
        self.count(slot, m, index, n, d.is_allowed());
        d
    }

    fn count(&self, slot: &Slot, m: &FastMeta, index: u64, n: u64, admitted: bool) {
        let f = if admitted {
            field::ADMITTED
        } else {
            field::REJECTED
        };
        slot.count_at(index, (index * m.slice_ms) as i64, f, n);
    }

    fn unknown(&self) -> Decision {
        if self.shared.cfg.allow_unknown {
            Decision::FallbackAllowed
        } else {
            Decision::FallbackDenied {
                retry_after: Duration::from_millis(100),
            }
        }
    }

    /// Asks the background thread for quota of the slice starting at `start_ms`.
    #[inline]
    fn want(&self, slot: &Slot, start_ms: i64, n: u64) {
        let w = start_ms as u64 + 1;
        if slot.ctl.want.load(Ordering::Relaxed) != w {
            slot.ctl.want.store(w, Ordering::Relaxed);
        }
        if slot.ctl.max_n.load(Ordering::Relaxed) < n {
            slot.ctl.max_n.fetch_max(n, Ordering::Relaxed);
        }
        self.poke();
    }

    #[inline]
    fn poke(&self) {
        if !self.inner.poked.load(Ordering::Relaxed)
            && !self.inner.poked.swap(true, Ordering::AcqRel)
        {
            self.shared.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Fallback, FallbackAlgorithm};
    use crate::shm::ClaimOptions;

    fn meta(slice_ms: u64) -> TaskMeta {
        TaskMeta {
            slice_ms,
            threshold: 1_000,
            pull: 0,
            local_limit: 1,
            on_failure: OnFailure::Deny,
            mode: Mode::Pooled,
            fallback: Fallback {
                algorithm: FallbackAlgorithm::FixedWindow,
                burst: 0,
            },
            version: 1,
            lease_ms: 0,
            keyed: false,
            key_overrides: Default::default(),
        }
    }

    /// Issue 9 item 9: a handle whose slot was reclaimed for another task (its process kept
    /// the handle but stopped refreshing the slot) never decides from, nor counts into, the
    /// other task's slot: the generation in the meta word tells it.
    #[test]
    fn a_stale_handle_never_uses_a_reclaimed_slot() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new("redis://127.0.0.1:1");
        cfg.shm_dir = dir.path().to_path_buf();
        cfg.host_id = "stale".into();
        cfg.max_tasks = 1;
        cfg.allow_unknown = false;
        let client = Client::new(cfg).unwrap();
        let old = client.task("old").unwrap();
        let (seg, _) = Segment::open(client.segment_path(), 1).unwrap();
        let slot = seg.slot(0).unwrap();
        let day = 86_400_000u64;
        assert!(slot.store_meta(&meta(day), slot.generation()));
        let now_us = old.now_us();
        let start = (now_us as u64 / (day * 1_000) * day) as i64;
        assert!(slot.deposit(start, day, 100, false, now_us));
        assert_eq!(old.try_acquire(1), Decision::Allowed);
        // Another process reclaims the slot (as if "old" had been idle for ten minutes).
        let now_ms = crate::clock::host_ms();
        let r = seg
            .claim(
                "new",
                ClaimOptions {
                    now_ms: now_ms + 600_000,
                    lock_timeout_ms: 1_000,
                    reclaim_idle_ms: 60_000,
                },
            )
            .expect("reclaimed");
        assert_eq!(r.index, 0);
        assert!(slot.store_meta(&meta(day), r.generation));
        assert!(slot.deposit(start, day, 50, false, now_us));
        let word = || slot.entry(start, day).word.load(Ordering::Relaxed);
        let before = word();
        for _ in 0..20 {
            let d = old.try_acquire(1);
            assert!(
                matches!(d, Decision::FallbackDenied { .. }),
                "a stale handle decided {d:?}"
            );
        }
        assert_eq!(
            word(),
            before,
            "the stale handle spent the new task's quota"
        );
        assert!(
            old.meta().is_none(),
            "the stale handle sees the new task's meta"
        );
        assert_eq!(old.state(), HostState::Unknown);
        assert!(
            slot.drain_counters().is_empty(),
            "counted into the new task"
        );
    }
}
