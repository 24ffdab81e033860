//! The decisions every API of the agent makes, on the host's shared quota (the SDK's fast
//! path: shared memory, no Redis call unless the host's quota must be refilled, which the
//! SDK's background thread does while the caller's task waits, bounded by
//! `--acquire-timeout`).
//!
//! # First sight of a name
//!
//! Each task the agent decides for holds a slot of the **host segment**, which it shares with
//! every SDK process of the host (`--max-tasks` slots, 64 by default). A client sending random
//! names must neither fill those slots (SDK processes would get `SegmentFull`) nor be admitted
//! by the unknown-task fallback, so a name is opened only once it is **known to exist**:
//!
//! * a name the agent has not verified is looked up in Redis (`HMGET NS:{T}:meta version
//!   retired`, at most [`LOOKUP_TIMEOUT`], at most [`MAX_LOOKUPS`] at once). Missing (or
//!   retired): "unknown task", remembered for [`NEGATIVE_TTL`] (at most [`MAX_REMEMBERED`]
//!   names). Found: remembered as verified (at most [`MAX_REMEMBERED`] names) and opened.
//! * When Redis does not answer the lookup, the name is **not** opened: the request gets
//!   [`DecideError::Sdk`] (HTTP 503, RLS `UNAVAILABLE`, RLQS no assignment — the
//!   caller's own failure policy decides, e.g. Envoy's `failure_mode_deny`), and for
//!   [`LOOKUP_BACKOFF`] further never-verified names are refused without asking Redis (so a
//!   flood of names costs nothing while Redis is slow). Names verified earlier, and tasks
//!   already open, are decided as usual (their `on_failure` while Redis is unusable).
//! * The agent's own share of the slots is bounded (`--max-agent-tasks`, half of
//!   `--max-tasks` by default). A handle nobody uses (no request in flight, no RLQS bucket)
//!   for [`IDLE_CLOSE`] is closed when the share is needed; its slot still counts against the
//!   share for [`SLOT_RELEASE`] after that (the time an SDK process waits before reclaiming an
//!   idle slot). With the share taken, a new task gets [`DecideError::Sdk`].
//!
//! # Waiting, deadlines and cancellation
//!
//! A decision that must wait for a refill runs detached from the request (a spawned task that
//! holds a permit of at most `--max-concurrent-requests` such waits): if the client goes away
//! or the request's deadline passes, the wait still ends normally within `--acquire-timeout`
//! (the SDK's wait is not cancel-safe, and its permits are accounted either way) while the
//! request is answered at once. Past a request's deadline every further decision is made from
//! what the host holds, without waiting.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::{Duration, Instant};

use sluice::{AllDecision, Client, Decision, Key, Limit, Task};
use sluice_protocol::conn::Redis;
use sluice_protocol::{Keys, Mode};
use tokio::sync::Semaphore;

use crate::metrics::Metrics;

/// How long a name found missing in Redis is answered "unknown" without asking again.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(1);
/// Most names remembered as missing, and as verified (a flood of names cannot grow memory).
pub const MAX_REMEMBERED: usize = 10_000;
/// Longest a first-sight lookup waits for Redis.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// After Redis failed to answer a lookup, never-verified names are refused without asking it
/// for this long.
pub const LOOKUP_BACKOFF: Duration = Duration::from_secs(1);
/// Most first-sight lookups in flight at once.
pub const MAX_LOOKUPS: usize = 32;
/// A handle unused this long (no request, no RLQS bucket) may be closed to open another task.
pub const IDLE_CLOSE: Duration = Duration::from_secs(60);
/// How long a closed handle's slot still counts against the agent's share: an SDK process
/// reclaims a slot only once it has been idle this long (`Config::reclaim_idle`'s default).
pub const SLOT_RELEASE: Duration = Duration::from_secs(60);
/// The retry hint of a decision cut by its request's deadline.
pub const CUT_RETRY: Duration = Duration::from_millis(100);

/// Why a decision could not be made.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DecideError {
    /// Not a task name / key.
    #[error("{field}: {message}")]
    Invalid {
        /// The field (`task`, `key`, `hits`).
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// No such task in this namespace.
    #[error("unknown task {0:?} (no meta in Redis: create it through the manager)")]
    UnknownTask(String),
    /// A task of mode `concurrency` holds permits until released: not decidable here.
    #[error("task {0:?} is in mode concurrency: permits must be released, use the SDK")]
    Concurrency(String),
    /// The agent cannot decide for this task now (HTTP 503, RLS `UNAVAILABLE`, no RLQS
    /// assignment): its name could not be verified in Redis, the agent's share of the host
    /// segment's slots is taken, or the SDK refused (segment full, key table unusable). The
    /// message says which.
    #[error("{0}")]
    Sdk(String),
}

impl DecideError {
    /// The `reason` label of `sluice_agent_request_errors_total` for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            DecideError::Invalid { .. } => "invalid",
            DecideError::UnknownTask(_) => "unknown_task",
            DecideError::Concurrency(_) => "concurrency",
            DecideError::Sdk(_) => "unavailable",
        }
    }
}

/// An open task handle.
struct Open {
    task: Task,
    /// When it was opened (its meta is being read for up to [`LOOKUP_TIMEOUT`] after).
    opened: Instant,
    /// The last time a request asked for it.
    used: Instant,
    /// When it was last looked up again while it had no meta.
    rechecked: Option<Instant>,
    /// One clone per [`Part`] alive: a handle in use is never closed.
    hold: Arc<()>,
}

#[derive(Default)]
struct Cache {
    open: HashMap<String, Open>,
    /// Names found missing, and when.
    missing: HashMap<String, Instant>,
    /// Names known to exist (open or not).
    verified: HashMap<String, Instant>,
    /// When handles were closed (they count against the share for [`SLOT_RELEASE`]).
    closed: VecDeque<Instant>,
    /// Never-verified names are refused without a lookup until then.
    backoff_until: Option<Instant>,
    /// Names whose slot is being claimed now, with how many requests are claiming it (each
    /// name counts once against the share: concurrent first requests of one task claim the
    /// same slot).
    opening: HashMap<String, usize>,
}

impl Cache {
    fn remember(map: &mut HashMap<String, Instant>, name: &str, now: Instant, ttl: Duration) {
        if map.len() >= MAX_REMEMBERED && !map.contains_key(name) {
            map.retain(|_, at| now.duration_since(*at) < ttl);
            if map.len() >= MAX_REMEMBERED {
                map.clear();
            }
        }
        map.insert(name.to_string(), now);
    }

    fn close(&mut self, name: &str, now: Instant) {
        if self.open.remove(name).is_some() {
            self.closed.push_back(now);
        }
    }

    /// Slots counted against the agent's share now.
    fn share_used(&mut self, now: Instant) -> usize {
        while self
            .closed
            .front()
            .is_some_and(|at| now.duration_since(*at) >= SLOT_RELEASE)
        {
            self.closed.pop_front();
        }
        self.open.len() + self.closed.len() + self.opening.len()
    }

    /// One request starts claiming `name`'s slot.
    fn start_opening(&mut self, name: &str) {
        *self.opening.entry(name.to_string()).or_insert(0) += 1;
    }

    /// One request is done claiming `name`'s slot; true when it was the last.
    fn end_opening(&mut self, name: &str) -> bool {
        match self.opening.get_mut(name) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.opening.remove(name);
                true
            }
            None => false,
        }
    }
}

/// A slot being claimed (`Cache::opening`). If the last request claiming it is dropped while
/// the claim runs (and the task was not opened by another), the reservation is given back and
/// counted as a closed handle: the claim may still have taken a slot, idle from then on.
struct Opening<'a> {
    decider: &'a Decider,
    name: &'a str,
    done: bool,
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut c = self.decider.lock();
            if c.end_opening(self.name) && !c.open.contains_key(self.name) {
                c.closed.push_back(Instant::now());
            }
        }
    }
}

/// Shared decision state of one agent.
pub struct Decider {
    client: Client,
    redis: Redis,
    keys: Keys,
    metrics: Arc<Metrics>,
    max_tasks: usize,
    request_timeout: Duration,
    cache: Mutex<Cache>,
    lookups: Semaphore,
    waits: Arc<Semaphore>,
    lookups_done: AtomicU64,
}

/// A resolved part of a request: a task, maybe a key, and its cost.
#[derive(Clone)]
pub struct Part {
    /// The task.
    pub task: Task,
    /// The key (keyed tasks).
    pub key: Option<Key>,
    /// Permits.
    pub hits: u64,
    /// Keeps the task's handle open while the part lives.
    _hold: Arc<()>,
}

/// The bounds a [`Decider`] works within (from the configuration).
#[derive(Debug, Clone, Copy)]
pub struct DeciderLimits {
    /// Most task handles (segment slots) held at once (`--max-agent-tasks`).
    pub max_tasks: u32,
    /// Most decisions waiting for a refill at once (`--max-concurrent-requests`).
    pub max_waits: u32,
    /// The deadline of a request that gives none (`--request-timeout`).
    pub request_timeout: Duration,
}

impl Decider {
    /// Counter batches the SDK client dropped because Redis refused them
    /// ([`sluice::Client::flushes_dropped`]).
    pub fn flushes_dropped(&self) -> u64 {
        self.client.flushes_dropped()
    }

    /// A decider over `client`; `redis` is used for the first-sight lookups only.
    pub fn new(
        client: Client,
        redis: Redis,
        keys: Keys,
        metrics: Arc<Metrics>,
        limits: DeciderLimits,
    ) -> Self {
        Self {
            client,
            redis,
            keys,
            metrics,
            max_tasks: limits.max_tasks.max(1) as usize,
            request_timeout: limits.request_timeout,
            cache: Mutex::new(Cache::default()),
            lookups: Semaphore::new(MAX_LOOKUPS),
            waits: Arc::new(Semaphore::new(limits.max_waits.max(1) as usize)),
            lookups_done: AtomicU64::new(0),
        }
    }

    /// The agent's own Redis handle (lookups, the domain configurations).
    pub fn redis(&self) -> &Redis {
        &self.redis
    }

    /// The SDK client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Task handles open now (each holds a slot of the host segment).
    pub fn open_tasks(&self) -> usize {
        self.lock().open.len()
    }

    /// Lookups of names in Redis made so far (answered or not).
    pub fn lookups(&self) -> u64 {
        self.lookups_done.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The handle of task `name`, opened once the name is known to exist (see the module
    /// docs), within the default request deadline.
    pub async fn task(&self, name: &str) -> Result<Task, DecideError> {
        self.open(name, Instant::now() + self.request_timeout)
            .await
            .map(|(t, _)| t)
    }

    async fn open(&self, name: &str, deadline: Instant) -> Result<(Task, Arc<()>), DecideError> {
        let now = Instant::now();
        let hit = {
            let mut c = self.lock();
            c.open.get_mut(name).map(|o| {
                o.used = now;
                let meta_due = o.opened + LOOKUP_TIMEOUT;
                // Known once, no meta now: deleted (then "unknown" again), or Redis is down
                // (the SDK's on_failure decides). Looked up again at most once a NEGATIVE_TTL.
                let due = o.task.meta().is_none()
                    && now >= meta_due
                    && o.rechecked
                        .is_none_or(|at| now.duration_since(at) >= NEGATIVE_TTL);
                if due {
                    o.rechecked = Some(now);
                }
                (o.task.clone(), o.hold.clone(), due, meta_due)
            })
        };
        if let Some((t, hold, due, meta_due)) = hit {
            // Opened just now by another request: its meta is on its way; wait for it as the
            // opener does (not decided by the unknown-task fallback meanwhile).
            wait_meta(&t, deadline.min(meta_due)).await;
            if due && self.exists(name, deadline).await == Some(false) {
                let mut c = self.lock();
                c.close(name, Instant::now());
                self.metrics.open_tasks(c.open.len());
                c.verified.remove(name);
                Cache::remember(&mut c.missing, name, Instant::now(), NEGATIVE_TTL);
                return Err(DecideError::UnknownTask(name.to_string()));
            }
            return Ok((t, hold));
        }
        sluice_protocol::validate_task_name(name).map_err(|e| DecideError::Invalid {
            field: "task",
            message: e.to_string(),
        })?;
        let verified = {
            let c = self.lock();
            if c.missing
                .get(name)
                .is_some_and(|at| now.duration_since(*at) < NEGATIVE_TTL)
            {
                return Err(DecideError::UnknownTask(name.to_string()));
            }
            c.verified.contains_key(name)
        };
        if !verified {
            match self.exists(name, deadline).await {
                Some(true) => {
                    let mut c = self.lock();
                    c.missing.remove(name);
                    // Verified names are never forgotten by age: only the bound clears them.
                    Cache::remember(&mut c.verified, name, Instant::now(), Duration::MAX);
                }
                Some(false) => {
                    let mut c = self.lock();
                    Cache::remember(&mut c.missing, name, Instant::now(), NEGATIVE_TTL);
                    return Err(DecideError::UnknownTask(name.to_string()));
                }
                None => {
                    self.metrics.refusal("unverified");
                    return Err(DecideError::Sdk(format!(
                        "task {name:?} could not be verified: Redis did not answer in time, and \
                         the agent opens a task only once it knows it exists (retry later)"
                    )));
                }
            }
        }
        let existing = {
            let mut c = self.lock();
            let now = Instant::now();
            if let Some(o) = c.open.get_mut(name) {
                // Opened by a concurrent request meanwhile.
                o.used = now;
                Some((o.task.clone(), o.hold.clone()))
            } else {
                if c.share_used(now) >= self.max_tasks {
                    // Close what nobody used for a while (it frees the share SLOT_RELEASE later).
                    let idle: Vec<String> = c
                        .open
                        .iter()
                        .filter(|(_, o)| {
                            Arc::strong_count(&o.hold) == 1
                                && now.duration_since(o.used) >= IDLE_CLOSE
                        })
                        .map(|(n, _)| n.clone())
                        .collect();
                    for n in idle {
                        c.close(&n, now);
                    }
                    self.metrics.open_tasks(c.open.len());
                }
                if !c.opening.contains_key(name) && c.share_used(now) >= self.max_tasks {
                    drop(c);
                    self.metrics.refusal("slots_full");
                    return Err(DecideError::Sdk(format!(
                        "task {name:?} cannot be opened: the agent holds its share of the host \
                         segment's task slots (--max-agent-tasks {}); a task it has not used for \
                         {} s frees its slot {} s after",
                        self.max_tasks,
                        IDLE_CLOSE.as_secs(),
                        SLOT_RELEASE.as_secs()
                    )));
                }
                // Reserved while the slot is claimed, without the lock held (once per name).
                c.start_opening(name);
                None
            }
        };
        let (t, hold) = match existing {
            Some(h) => h,
            None => {
                // Claiming a slot may wait on the segment's cross-process allocation lock: off
                // the async workers, and without the cache's lock held.
                let mut reserved = Opening {
                    decider: self,
                    name,
                    done: false,
                };
                let client = self.client.clone();
                let owned = name.to_string();
                let claimed = tokio::task::spawn_blocking(move || client.task(&owned)).await;
                let mut c = self.lock();
                c.end_opening(name);
                reserved.done = true;
                let t = match claimed {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        drop(c);
                        self.metrics.refusal("segment_full");
                        return Err(DecideError::Sdk(e.to_string()));
                    }
                    Err(e) => {
                        drop(c);
                        return Err(DecideError::Sdk(format!("opening task {name:?}: {e}")));
                    }
                };
                let now = Instant::now();
                let o = c.open.entry(name.to_string()).or_insert_with(|| Open {
                    task: t,
                    opened: now,
                    used: now,
                    rechecked: None,
                    hold: Arc::new(()),
                });
                o.used = now;
                let h = (o.task.clone(), o.hold.clone());
                let n = c.open.len();
                drop(c);
                self.metrics.open_tasks(n);
                h
            }
        };
        // A handle made just now has no meta yet: wait for the SDK's first read of it (one
        // Redis round trip, once per task per host), bounded.
        wait_meta(&t, deadline.min(Instant::now() + LOOKUP_TIMEOUT)).await;
        Ok((t, hold))
    }

    /// Whether task `name` is live: its meta has a version and no `retired` mark (a deleted
    /// task's meta keeps the mark for a while). `None` when Redis did not answer in time (or
    /// is being backed off from, or `deadline` leaves no time to ask).
    async fn exists(&self, name: &str, deadline: Instant) -> Option<bool> {
        use sluice_protocol::meta_field;
        let start = Instant::now();
        if self.lock().backoff_until.is_some_and(|u| start < u) {
            return None;
        }
        let budget = deadline
            .saturating_duration_since(start)
            .min(LOOKUP_TIMEOUT);
        if budget.is_zero() {
            return None;
        }
        let until = start + budget;
        let _permit = tokio::time::timeout_at(until.into(), self.lookups.acquire())
            .await
            .ok()?
            .ok()?;
        let key = self.keys.meta(name);
        let q = async {
            let mut c = self.redis.conn().await.ok()?;
            redis::cmd("HMGET")
                .arg(&key)
                .arg(meta_field::VERSION)
                .arg(meta_field::RETIRED)
                .query_async::<(Option<String>, Option<String>)>(&mut c)
                .await
                .ok()
        };
        self.lookups_done.fetch_add(1, Ordering::Relaxed);
        let answer = tokio::time::timeout_at(until.into(), q).await;
        let failed = match answer {
            Ok(Some((version, retired))) => {
                return Some(version.is_some() && retired.is_none());
            }
            Ok(None) => true,
            Err(_) => {
                self.redis.reset().await;
                // Cut by the request's own short deadline: not Redis's fault.
                budget >= LOOKUP_TIMEOUT / 2
            }
        };
        if failed {
            self.lock().backoff_until = Some(Instant::now() + LOOKUP_BACKOFF);
        }
        None
    }

    /// A part for `task` (and `key`), checked, within the default request deadline.
    pub async fn part(
        &self,
        task: &str,
        key: Option<&str>,
        hits: u64,
    ) -> Result<Part, DecideError> {
        self.part_by(task, key, hits, Instant::now() + self.request_timeout)
            .await
    }

    /// [`Decider::part`] within `deadline` (the first-sight lookup and the wait for a new
    /// handle's meta end by then).
    pub async fn part_by(
        &self,
        task: &str,
        key: Option<&str>,
        hits: u64,
        deadline: Instant,
    ) -> Result<Part, DecideError> {
        let (t, hold) = self.open(task, deadline).await?;
        if t.meta().is_some_and(|m| m.mode == Mode::Concurrency) {
            return Err(DecideError::Concurrency(task.to_string()));
        }
        let key = match key {
            None => None,
            Some(k) => Some(t.key(k).map_err(|e| DecideError::Invalid {
                field: "key",
                message: e.to_string(),
            })?),
        };
        Ok(Part {
            task: t,
            key,
            hits,
            _hold: hold,
        })
    }

    /// Decides one part from what the host holds, never waiting.
    pub fn try_decide(p: &Part) -> Decision {
        match &p.key {
            Some(k) => k.try_acquire(p.hits),
            None => p.task.try_acquire(p.hits),
        }
    }

    /// Decides one part, waiting for a refill of the host's quota at most `--acquire-timeout`,
    /// within the default request deadline.
    pub async fn decide(&self, p: &Part) -> Decision {
        self.decide_by(p, Instant::now() + self.request_timeout)
            .await
    }

    /// Decides one part; a wait for a refill ends by `deadline` (the wait itself goes on,
    /// detached, and ends within `--acquire-timeout`). Past `deadline`, or with
    /// `--max-concurrent-requests` waits already detached, decides without waiting.
    pub async fn decide_by(&self, p: &Part, deadline: Instant) -> Decision {
        let left = deadline.saturating_duration_since(Instant::now());
        let permit = if left.is_zero() {
            None
        } else {
            self.waits.clone().try_acquire_owned().ok()
        };
        let Some(permit) = permit else {
            return Self::try_decide(p);
        };
        let p = p.clone();
        let wait = async move {
            let _permit = permit;
            match &p.key {
                Some(k) => k.acquire(p.hits).await,
                None => p.task.acquire(p.hits).await,
            }
        };
        detached(wait, left).await.unwrap_or(Decision::Limited {
            retry_after: CUT_RETRY,
        })
    }

    /// Decides every part, all or nothing (the admitted parts of a refused request give their
    /// permits back), within the default request deadline (as [`Decider::decide_by`]; a cut
    /// answer refuses at the first part).
    pub async fn decide_all(&self, parts: &[Part]) -> AllDecision {
        let left = self.request_timeout;
        let cut = || {
            let mut a = sluice::try_acquire_all(&[]);
            a.decision = Decision::Limited {
                retry_after: CUT_RETRY,
            };
            a.refused = Some(0);
            a
        };
        let Ok(permit) = self.waits.clone().try_acquire_owned() else {
            let limits = limits_of(parts);
            return sluice::try_acquire_all(&limits);
        };
        let parts = parts.to_vec();
        let wait = async move {
            let _permit = permit;
            let limits = limits_of(&parts);
            sluice::acquire_all(&limits).await
        };
        detached(wait, left).await.unwrap_or_else(cut)
    }
}

/// Waits until `t`'s meta is known, at most until `until`.
async fn wait_meta(t: &Task, until: Instant) {
    while t.meta().is_none() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn limits_of(parts: &[Part]) -> Vec<Limit<'_>> {
    parts
        .iter()
        .map(|p| match &p.key {
            Some(k) => Limit::Key(k, p.hits),
            None => Limit::Task(&p.task, p.hits),
        })
        .collect()
}

/// Runs `fut` to completion whatever happens to the caller: polled once here (a decision made
/// at once costs no task), else spawned; its output if it ends within `limit`.
async fn detached<T: Send + 'static>(
    fut: impl Future<Output = T> + Send + 'static,
    limit: Duration,
) -> Option<T> {
    let mut fut = Box::pin(fut);
    let first = std::future::poll_fn(|cx| {
        Poll::Ready(match fut.as_mut().poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await;
    if let Some(v) = first {
        return Some(v);
    }
    let handle = tokio::spawn(fut);
    // Dropping the handle (timeout, or the caller dropped) does not cancel the task.
    match tokio::time::timeout(limit, handle).await {
        Ok(Ok(v)) => Some(v),
        _ => None,
    }
}

/// The spelling of a decision in the HTTP API and metrics.
pub fn decision_name(d: &Decision) -> &'static str {
    match d {
        Decision::Allowed => "allowed",
        Decision::Limited { .. } => "limited",
        Decision::FallbackAllowed => "fallback_allowed",
        Decision::FallbackDenied { .. } => "fallback_denied",
        Decision::ShadowLimited { .. } => "shadow_limited",
        _ => "would_block",
    }
}

/// The time until the end of the current slice of `task` (`None` while its meta is unknown).
pub fn until_slice_end(task: &Task) -> Option<Duration> {
    let m = task.meta()?;
    let now_us = task.now_us();
    let slice_us = m.slice_ms.max(1) as i64 * 1_000;
    let end = (now_us.div_euclid(slice_us) + 1) * slice_us;
    Some(Duration::from_micros((end - now_us).max(0) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review of issue 26's first run: 100 concurrent first requests of one task each reserved
    /// a slot of the agent's share and most were refused ("holds its share of the host
    /// segment's task slots") although the task takes one slot. A name counts once.
    #[test]
    fn concurrent_openers_of_one_task_reserve_one_slot() {
        let mut c = Cache::default();
        let now = Instant::now();
        for _ in 0..100 {
            c.start_opening("open");
        }
        assert_eq!(c.share_used(now), 1);
        c.start_opening("other");
        assert_eq!(c.share_used(now), 2);
        for i in 0..99 {
            assert!(!c.end_opening("open"), "#{i} was not the last");
        }
        assert!(c.end_opening("open"));
        assert!(!c.end_opening("open"), "already done");
        assert_eq!(c.share_used(now), 1);
    }
}
