//! The decisions every API of the agent makes, on the host's shared quota (the SDK's fast
//! path: shared memory, no Redis call unless the host's quota must be refilled, which the
//! SDK's background thread does while the caller's task waits, bounded by
//! `--acquire-timeout`).
//!
//! Task handles are cached per name. A name the agent has not seen is looked up once in Redis
//! (`HMGET NS:{T}:meta version retired`, bounded by 1 s) before a handle is made, so a client
//! sending random names can neither fill the host segment's task slots nor be admitted by the
//! unknown-task fallback: it gets "unknown task" (remembered for [`NEGATIVE_TTL`]). When Redis
//! cannot answer that lookup, the SDK decides as it does for any task it has no meta for yet
//! (admits: `Config::allow_unknown`).

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use sluice::{AllDecision, Client, Decision, Key, Limit, Task};
use sluice_protocol::conn::Redis;
use sluice_protocol::{Keys, Mode};

/// How long a name found missing in Redis is answered "unknown" without asking again.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(1);
/// Most task names remembered as missing (a flood of random names cannot grow memory).
const MAX_NEGATIVE: usize = 10_000;

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
    /// The SDK refused (segment full, key table unusable).
    #[error("{0}")]
    Sdk(String),
}

/// Shared decision state of one agent.
pub struct Decider {
    client: Client,
    redis: Redis,
    keys: Keys,
    tasks: RwLock<HashMap<String, Task>>,
    missing: RwLock<HashMap<String, Instant>>,
    rechecked: RwLock<HashMap<String, Instant>>,
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
}

impl Decider {
    /// A decider over `client`; `redis` is used for the first-sight lookups only.
    pub fn new(client: Client, redis: Redis, keys: Keys) -> Self {
        Self {
            client,
            redis,
            keys,
            tasks: RwLock::new(HashMap::new()),
            missing: RwLock::new(HashMap::new()),
            rechecked: RwLock::new(HashMap::new()),
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

    /// The handle of task `name`, looked up in Redis on first sight.
    pub async fn task(&self, name: &str) -> Result<Task, DecideError> {
        let cached = self.tasks.read().ok().and_then(|m| m.get(name).cloned());
        match cached {
            // The common case: a known task.
            Some(t) if t.meta().is_some() => return Ok(t),
            // Known once, no meta now: deleted (then "unknown" again), or Redis is down (the
            // SDK's on_failure decides).
            Some(t) => {
                if self.recheck_due(name) && self.exists(name).await == Some(false) {
                    if let Ok(mut m) = self.tasks.write() {
                        m.remove(name);
                    }
                    self.remember_missing(name);
                    return Err(DecideError::UnknownTask(name.to_string()));
                }
                return Ok(t);
            }
            None => {}
        }
        sluice_protocol::validate_task_name(name).map_err(|e| DecideError::Invalid {
            field: "task",
            message: e.to_string(),
        })?;
        if let Some(at) = self.missing.read().ok().and_then(|m| m.get(name).copied())
            && at.elapsed() < NEGATIVE_TTL
        {
            return Err(DecideError::UnknownTask(name.to_string()));
        }
        // `None`: Redis could not say; the SDK decides as for any task it has no meta for.
        if self.exists(name).await == Some(false) {
            self.remember_missing(name);
            return Err(DecideError::UnknownTask(name.to_string()));
        }
        let t = self
            .client
            .task(name)
            .map_err(|e| DecideError::Sdk(e.to_string()))?;
        if let Ok(mut m) = self.tasks.write() {
            m.entry(name.to_string()).or_insert_with(|| t.clone());
        }
        if let Ok(mut m) = self.missing.write() {
            m.remove(name);
        }
        // A handle made just now has no meta yet: wait for the SDK's first read of it (one
        // Redis round trip, once per task per host), bounded.
        let deadline = Instant::now() + Duration::from_secs(1);
        while t.meta().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(t)
    }

    /// True at most once per [`NEGATIVE_TTL`] per task: a cached task without meta is looked
    /// up again no more often (while Redis is down, decisions must not wait on it each time).
    fn recheck_due(&self, name: &str) -> bool {
        let Ok(mut m) = self.rechecked.write() else {
            return false;
        };
        match m.get(name) {
            Some(at) if at.elapsed() < NEGATIVE_TTL => false,
            _ => {
                if m.len() >= MAX_NEGATIVE {
                    m.clear();
                }
                m.insert(name.to_string(), Instant::now());
                true
            }
        }
    }

    fn remember_missing(&self, name: &str) {
        if let Ok(mut m) = self.missing.write() {
            if m.len() >= MAX_NEGATIVE {
                m.retain(|_, at| at.elapsed() < NEGATIVE_TTL);
                if m.len() >= MAX_NEGATIVE {
                    m.clear();
                }
            }
            m.insert(name.to_string(), Instant::now());
        }
    }

    /// Whether task `name` is live: its meta has a version and no `retired` mark (a deleted
    /// task's meta keeps the mark for a while). `None` when Redis did not answer in time.
    async fn exists(&self, name: &str) -> Option<bool> {
        use sluice_protocol::meta_field;
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
        match tokio::time::timeout(Duration::from_secs(1), q).await {
            Ok(Some((version, retired))) => Some(version.is_some() && retired.is_none()),
            Ok(None) => None,
            Err(_) => {
                self.redis.reset().await;
                None
            }
        }
    }

    /// A part for `task` (and `key`), checked.
    pub async fn part(
        &self,
        task: &str,
        key: Option<&str>,
        hits: u64,
    ) -> Result<Part, DecideError> {
        let t = self.task(task).await?;
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
        Ok(Part { task: t, key, hits })
    }

    /// Decides one part (waits for a refill of the host's quota at most `--acquire-timeout`).
    pub async fn decide(&self, p: &Part) -> Decision {
        match &p.key {
            Some(k) => k.acquire(p.hits).await,
            None => p.task.acquire(p.hits).await,
        }
    }

    /// Decides every part, all or nothing (the admitted parts of a refused request give their
    /// permits back).
    pub async fn decide_all(&self, parts: &[Part]) -> AllDecision {
        let limits: Vec<Limit<'_>> = parts
            .iter()
            .map(|p| match &p.key {
                Some(k) => Limit::Key(k, p.hits),
                None => Limit::Task(&p.task, p.hits),
            })
            .collect();
        sluice::acquire_all(&limits).await
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
