//! Rolling: the leader keeps every task's slices written from the current one to
//! `now + horizon`, fenced by its term.
//!
//! ```text
//!   tick ──▶ plan (pure) ──▶ one ROLL script call per task, all in flight at once ──▶ apply
//!              │                       │
//!              │                       ├─ Written(n)  remember what was written
//!              │                       ├─ NeedFull    Redis lost the task (restart, FLUSHALL):
//!              │                       │              resend meta + whole window, same tick
//!              │                       ├─ Retired     deleted after the spec we hold: skip
//!              │                       └─ Fenced      a newer leader exists: step down now
//!              └─ only what changed: new slices entering the window, and every not-ended
//!                 slice whose threshold changed (spec version, schedule, dynamic override)
//! ```
//!
//! Every tick sends one call per task even when nothing is new: the call is the probe that
//! notices a Redis that lost its data, which is healed within the same tick. A new leader has no
//! memory of what was written, so its first tick sends every task's whole window (the script
//! skips slices that already hold the right threshold).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sluice::protocol::conn::Redis;
use sluice::protocol::scripts::{self, RetireOutcome, RollOutcome, RollRequest, SliceWrite};
use sluice::protocol::{Keys, slice, unix_ms};
use tracing::{debug, info, warn};

use crate::election::LeaderContext;
use crate::error::{Error, Result, redis as redis_err};
use crate::metrics::Metrics;
use crate::tasks::{TaskEntry, TaskSnapshot, TaskStore};

/// Most slices kept written ahead for one task, whatever the horizon (100 ms slices with a
/// one-hour horizon would otherwise mean 36,000 keys per task).
pub const MAX_SLICES_AHEAD: i64 = 3_600;

/// Most slices sent in one script call.
const MAX_SLICES_PER_CALL: usize = 1_000;

/// Script calls in flight at once (multiplexed on one connection: pipelined on the wire).
const CONCURRENCY: usize = 256;

/// Bound on one script call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Settings of rolling.
#[derive(Debug, Clone, Copy)]
pub struct RollConfig {
    /// How far ahead slices are written.
    pub horizon: Duration,
    /// How long a slice key lives after its slice ended.
    pub retention: Duration,
    /// Loop period.
    pub tick: Duration,
}

/// The effective threshold of the slice starting at `start_ms`: base → schedule → dynamic.
pub fn effective_threshold(entry: &TaskEntry, dynamic: Option<u64>, start_ms: i64) -> u64 {
    let scheduled = entry.schedule.threshold_at(entry.spec.threshold, start_ms);
    dynamic.unwrap_or(scheduled)
}

/// What this leader has written for one task.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskRollState {
    /// Spec version whose meta fields were written.
    pub version: i64,
    /// The dynamic override the caps were computed with.
    pub dynamic: Option<u64>,
    /// End of the last written slice.
    pub rolled_to: i64,
    /// Caps written for slices that have not ended.
    pub caps: BTreeMap<i64, u64>,
}

/// One planned script call for a task (a whole window may take several).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Rewrite meta and window regardless of the stored state.
    pub full: bool,
    /// Write the meta fields.
    pub write_meta: bool,
    /// Slices to create or change, oldest first.
    pub slices: Vec<SliceWrite>,
    /// `rolled_to` the leader believes is stored.
    pub expect_rolled_to: i64,
    /// `rolled_to` after this plan.
    pub new_rolled_to: i64,
    /// State after success.
    pub next: TaskRollState,
}

/// Plans the writes for one task at `now_ms` (pure).
///
/// ```
/// # use sluice_manager::roller::*;
/// # use sluice_manager::tasks::TaskEntry;
/// # use sluice_manager::spec::parse_request;
/// # use std::sync::Arc; use std::time::Duration;
/// let spec = parse_request("t", br#"{"threshold": 100, "slice_ms": 1000}"#).unwrap().spec;
/// let entry = TaskEntry { name: "t".into(), schedule: Arc::default(), spec, version: 5 };
/// let cfg = RollConfig { horizon: Duration::from_secs(10), retention: Duration::from_secs(60),
///                        tick: Duration::from_millis(500) };
/// // A new leader writes the whole window: slices 1000..=11000, meta included.
/// let p = plan(&TaskRollState::default(), &entry, None, 1_500, &cfg, true);
/// assert_eq!(p.slices.len(), 11);
/// assert!(p.write_meta);
/// assert_eq!(p.new_rolled_to, 12_000);
/// // Half a second later nothing is new: the call only probes.
/// let q = plan(&p.next, &entry, None, 2_000 - 1, &cfg, false);
/// assert!(q.slices.is_empty() && !q.write_meta);
/// // One slice later, exactly one new slice enters the window.
/// let r = plan(&p.next, &entry, None, 2_500, &cfg, false);
/// assert_eq!(r.slices.iter().map(|s| s.start_ms).collect::<Vec<_>>(), [12_000]);
/// ```
pub fn plan(
    state: &TaskRollState,
    entry: &TaskEntry,
    dynamic: Option<u64>,
    now_ms: i64,
    cfg: &RollConfig,
    full: bool,
) -> Plan {
    let slice_ms = entry.spec.slice_ms;
    let len = slice_ms as i64;
    let current = slice::start(now_ms, slice_ms);
    let ahead = (cfg.horizon.as_millis() as i64).min(len * MAX_SLICES_AHEAD);
    let until = now_ms + ahead;
    let recompute = full || state.version != entry.version || state.dynamic != dynamic;

    let mut caps = BTreeMap::new();
    let mut slices = Vec::new();
    let retention = cfg.retention.as_millis() as i64;
    for start in slice::starts(current, until, slice_ms) {
        let known = state.caps.get(&start).copied();
        let cap = match known {
            Some(c) if !recompute => c,
            _ => effective_threshold(entry, dynamic, start),
        };
        if full || known != Some(cap) {
            slices.push(SliceWrite {
                start_ms: start,
                cap,
                expire_at_ms: slice::end(start, slice_ms) + retention,
            });
        }
        caps.insert(start, cap);
    }
    let new_rolled_to = caps
        .keys()
        .next_back()
        .map_or(state.rolled_to, |s| (s + len).max(state.rolled_to));
    Plan {
        full,
        write_meta: full || state.version != entry.version,
        slices,
        expect_rolled_to: state.rolled_to,
        new_rolled_to,
        next: TaskRollState {
            version: entry.version,
            dynamic,
            rolled_to: new_rolled_to,
            caps,
        },
    }
}

/// Counts of one tick.
#[derive(Debug, Default, Clone, Copy)]
pub struct TickStats {
    /// Script calls.
    pub calls: u64,
    /// Slices created or changed.
    pub written: u64,
    /// Failed calls.
    pub errors: u64,
    /// Tasks rewritten whole because Redis had lost them.
    pub healed: u64,
}

/// The leader's rolling state and loop.
pub struct Roller {
    keys: Keys,
    redis: Arc<Redis>,
    cfg: RollConfig,
    metrics: Arc<Metrics>,
    state: HashMap<String, TaskRollState>,
}

impl Roller {
    /// A roller with no memory (a new leadership).
    pub fn new(keys: Keys, redis: Arc<Redis>, cfg: RollConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            keys,
            redis,
            cfg,
            metrics,
            state: HashMap::new(),
        }
    }

    /// Runs ticks until leadership ends. A fenced write makes this replica step down.
    pub async fn run(mut self, ctx: LeaderContext, store: TaskStore, dynamic: DynamicThresholds) {
        let mut tasks = store.subscribe();
        let mut interval = tokio::time::interval(self.cfg.tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ctx.token().cancelled() => return,
                _ = interval.tick() => {}
                // Roll at once when a spec changes, so a new threshold is live within
                // milliseconds, not a tick.
                r = tasks.changed() => if r.is_err() { return },
            }
            let snap = store.snapshot();
            if !snap.loaded {
                continue;
            }
            let overrides = dynamic.current();
            let started = Instant::now();
            match self.tick(&ctx, &snap, &overrides).await {
                Ok(stats) => {
                    self.metrics
                        .roll_tick_seconds
                        .observe(started.elapsed().as_secs_f64());
                    if stats.healed > 0 {
                        info!(tasks = stats.healed, "rewrote tasks that Redis had lost");
                    }
                    debug!(?stats, "tick");
                }
                Err(Error::Fenced {
                    task,
                    term,
                    current,
                }) => {
                    warn!(
                        task,
                        term, current, "fenced: a newer leader wrote this task; stepping down"
                    );
                    ctx.step_down(format!("fenced on {task} by term {current}"));
                    return;
                }
                Err(e) => {
                    // Leadership no longer valid (checked before each write).
                    debug!(%e, "tick stopped");
                }
            }
        }
    }

    /// One pass over all tasks. Returns `Err(Fenced)` if any write was refused.
    pub async fn tick(
        &mut self,
        ctx: &LeaderContext,
        snap: &TaskSnapshot,
        dynamic: &HashMap<String, u64>,
    ) -> Result<TickStats> {
        let mut stats = TickStats::default();
        let conn = self.redis.conn().await.map_err(redis_err("connect"))?;
        let now = unix_ms();

        // Tasks gone from etcd: retire their meta (keeps the fence), forget them.
        let gone: Vec<String> = self
            .state
            .keys()
            .filter(|n| !snap.tasks.contains_key(*n))
            .cloned()
            .collect();
        for name in gone {
            if !ctx.is_valid() {
                return Err(Error::NotLeader);
            }
            let ttl = (self.cfg.horizon + self.cfg.retention).as_millis() as u64;
            let mut c = conn.clone();
            match scripts::retire(&mut c, &self.keys, &name, ctx.term(), ttl, snap.revision).await {
                Ok(RetireOutcome::Retired) => {
                    info!(task = name, "task deleted: meta retired");
                    self.state.remove(&name);
                }
                Ok(RetireOutcome::Fenced { current_term }) => {
                    return Err(Error::Fenced {
                        task: name,
                        term: ctx.term(),
                        current: current_term,
                    });
                }
                Err(e) => {
                    warn!(task = name, %e, "retire failed; will retry");
                    stats.errors += 1;
                }
            }
        }

        let mut pending: Vec<(Arc<TaskEntry>, bool)> =
            snap.tasks.values().map(|e| (e.clone(), false)).collect();
        // Two rounds at most: the second resends in full what Redis had lost.
        for _round in 0..2 {
            if pending.is_empty() {
                break;
            }
            let jobs: Vec<(Arc<TaskEntry>, Plan)> = pending
                .drain(..)
                .map(|(entry, full)| {
                    let st = self.state.get(&entry.name).cloned().unwrap_or_default();
                    let full = full || !self.state.contains_key(&entry.name);
                    let p = plan(
                        &st,
                        &entry,
                        dynamic.get(&entry.name).copied(),
                        now,
                        &self.cfg,
                        full,
                    );
                    (entry, p)
                })
                .collect();
            let keys = &self.keys;
            let results: Vec<(Arc<TaskEntry>, Plan, Result<RollOutcome>)> =
                futures::stream::iter(jobs)
                    .map(|(entry, plan)| {
                        let mut c = conn.clone();
                        async move {
                            let r = execute(&mut c, keys, ctx, &entry, &plan).await;
                            (entry, plan, r)
                        }
                    })
                    .buffer_unordered(CONCURRENCY)
                    .collect()
                    .await;
            for (entry, plan, r) in results {
                stats.calls += plan.slices.len().div_ceil(MAX_SLICES_PER_CALL).max(1) as u64;
                match r {
                    Ok(RollOutcome::Written(n)) => {
                        stats.written += n;
                        self.state.insert(entry.name.clone(), plan.next);
                    }
                    Ok(RollOutcome::NeedFull) => {
                        stats.healed += 1;
                        pending.push((entry, true));
                    }
                    Ok(RollOutcome::Retired { revision }) => {
                        // Deleted (through another replica) after the spec we hold; our watch
                        // has not delivered the deletion yet. Never resurrect it.
                        debug!(task = entry.name, revision, "task was deleted; skipping");
                        self.state.remove(&entry.name);
                    }
                    Ok(RollOutcome::Fenced { current_term }) => {
                        self.metrics.fenced.inc();
                        return Err(Error::Fenced {
                            task: entry.name.clone(),
                            term: ctx.term(),
                            current: current_term,
                        });
                    }
                    Err(Error::NotLeader) => return Err(Error::NotLeader),
                    Err(e) => {
                        stats.errors += 1;
                        warn!(task = entry.name, %e, "roll failed; will retry next tick");
                    }
                }
            }
        }

        self.metrics.roll_calls.inc_by(stats.calls);
        self.metrics.slices_written.inc_by(stats.written);
        self.metrics.roll_errors.inc_by(stats.errors);
        self.metrics.tasks.set(snap.tasks.len() as i64);
        let ahead = snap
            .tasks
            .keys()
            .filter_map(|n| self.state.get(n))
            .map(|s| s.rolled_to - now)
            .min();
        self.metrics
            .horizon_ahead
            .set(ahead.map_or(0.0, |ms| ms as f64 / 1000.0));
        Ok(stats)
    }
}

/// Sends one plan (in chunks of at most [`MAX_SLICES_PER_CALL`] slices).
async fn execute(
    conn: &mut sluice::protocol::conn::RedisConn,
    keys: &Keys,
    ctx: &LeaderContext,
    entry: &TaskEntry,
    plan: &Plan,
) -> Result<RollOutcome> {
    let meta = entry.spec.meta(entry.version);
    let chunks: Vec<&[SliceWrite]> = if plan.slices.is_empty() {
        vec![&[]]
    } else {
        plan.slices.chunks(MAX_SLICES_PER_CALL).collect()
    };
    let mut written = 0;
    let mut expect = plan.expect_rolled_to;
    let n = chunks.len();
    for (i, chunk) in chunks.into_iter().enumerate() {
        if !ctx.is_valid() {
            return Err(Error::NotLeader);
        }
        let first = i == 0;
        let rolled_to = if i + 1 == n {
            plan.new_rolled_to
        } else {
            chunk
                .last()
                .map_or(expect, |s| s.start_ms + entry.spec.slice_ms as i64)
        };
        let req = RollRequest {
            task: &entry.name,
            term: ctx.term(),
            full: plan.full && first,
            expect_rolled_to: expect,
            new_rolled_to: rolled_to,
            spec_version: entry.version,
            meta: (plan.write_meta && first).then_some(&meta),
            slices: chunk,
        };
        let call = scripts::roll(conn, keys, &req);
        let out = match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(r) => r.map_err(redis_err("roll"))?,
            Err(_) => {
                return Err(Error::Timeout {
                    op: "roll",
                    after: CALL_TIMEOUT,
                });
            }
        };
        match out {
            RollOutcome::Written(k) => written += k,
            other => return Ok(other),
        }
        expect = expect.max(rolled_to);
    }
    Ok(RollOutcome::Written(written))
}

/// Dynamic threshold overrides by task, set by the dynamic controller, read by the roller.
#[derive(Debug, Clone, Default)]
pub struct DynamicThresholds {
    inner: Arc<std::sync::RwLock<HashMap<String, u64>>>,
}

impl DynamicThresholds {
    /// The current overrides.
    pub fn current(&self) -> HashMap<String, u64> {
        self.inner.read().map(|m| m.clone()).unwrap_or_default()
    }

    /// Removes every override.
    pub fn clear(&self) {
        if let Ok(mut m) = self.inner.write() {
            m.clear();
        }
    }

    /// Sets (Some) or clears (None) a task's override.
    pub fn set(&self, task: &str, value: Option<u64>) {
        if let Ok(mut m) = self.inner.write() {
            match value {
                Some(v) => m.insert(task.to_string(), v),
                None => m.remove(task),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::CompiledSchedule;
    use crate::spec::{ScheduleEntry, parse_request};

    fn entry(body: &str, version: i64) -> TaskEntry {
        let spec = parse_request("t", body.as_bytes()).unwrap().spec;
        TaskEntry {
            name: "t".into(),
            schedule: Arc::new(CompiledSchedule::new(&spec.schedules)),
            spec,
            version,
        }
    }

    fn cfg() -> RollConfig {
        RollConfig {
            horizon: Duration::from_secs(5),
            retention: Duration::from_secs(60),
            tick: Duration::from_millis(500),
        }
    }

    #[test]
    fn threshold_change_reaches_every_unended_slice() {
        let e1 = entry(r#"{"threshold": 100}"#, 1);
        let p = plan(&TaskRollState::default(), &e1, None, 10_200, &cfg(), true);
        assert_eq!(p.slices.len(), 6); // 10000..=15000
        let e2 = entry(r#"{"threshold": 150}"#, 2);
        let q = plan(&p.next, &e2, None, 10_700, &cfg(), false);
        assert!(q.write_meta);
        assert_eq!(q.slices.len(), 6);
        assert!(q.slices.iter().all(|s| s.cap == 150));
        assert_eq!(
            q.slices[0].start_ms, 10_000,
            "the current slice changes too"
        );
        // Replaying the same state changes nothing.
        let r = plan(&q.next, &e2, None, 10_800, &cfg(), false);
        assert!(r.slices.is_empty());
    }

    #[test]
    fn dynamic_overrides_schedule_overrides_base() {
        let mut e = entry(r#"{"threshold": 100}"#, 1);
        e.schedule = Arc::new(CompiledSchedule::new(&[ScheduleEntry {
            cron: "* * * * * *".into(),
            threshold: 300,
        }]));
        assert_eq!(effective_threshold(&e, None, 0), 300);
        assert_eq!(effective_threshold(&e, Some(42), 0), 42);
        let p = plan(&TaskRollState::default(), &e, None, 0, &cfg(), true);
        let q = plan(&p.next, &e, Some(42), 100, &cfg(), false);
        assert!(q.slices.iter().all(|s| s.cap == 42));
        assert!(!q.write_meta);
    }

    #[test]
    fn slices_expire_after_retention() {
        let e = entry(r#"{"threshold": 1, "slice_ms": 250}"#, 1);
        let p = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true);
        assert_eq!(p.slices[0].expire_at_ms, 1_250 + 60_000);
        assert_eq!(p.slices.len(), 20);
    }

    #[test]
    fn horizon_is_capped_in_slices() {
        let e = entry(r#"{"threshold": 1, "slice_ms": 100}"#, 1);
        let c = RollConfig {
            horizon: Duration::from_secs(86_400),
            ..cfg()
        };
        let p = plan(&TaskRollState::default(), &e, None, 0, &c, true);
        assert_eq!(p.slices.len() as i64, MAX_SLICES_AHEAD);
    }
}
