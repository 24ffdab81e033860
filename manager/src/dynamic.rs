//! Dynamic limiting: thresholds that follow the protected service's health (leader only).
//!
//! Every control period (`--control-period`, 5 s) the leader judges each task with
//! `dynamic.enabled` from what happened since its last change:
//!
//! * **health** — the SDK's outcomes summed over hosts (`ok`, `err`, `lat_sum_us`, `lat_n` in
//!   the slice hashes) and external reports (`POST /api/v1/tasks/{name}/health`, the worst
//!   fresh report per source);
//! * **demand** — whether requests press on the limit (`rej > 0`, or ≥ 90 % of the threshold
//!   admitted).
//!
//! and [`decide`]s:
//!
//! ```text
//!   unhealthy: error rate > target
//!       new = max(cur × ½, goodput × 0.95)        (goodput known and below cur)
//!   unhealthy otherwise (latency > target, or no goodput known)
//!       new = cur × decrease_factor                                        multiplicative
//!   healthy, pressing on the limit, not within the cooldown after a decrease
//!       new = cur + increase_step, up to max                               additive
//!   healthy, no traffic counted (a service reporting only externally)
//!       new = cur + increase_step, up to the base threshold                recovery
//!   always within [min, max]
//! ```
//!
//! *Goodput* is the successful requests per slice: under overload it is the backend's real
//! capacity, so one decrease lands just below it instead of sawing down by halves (AIMD would
//! need several steps and oscillate more). See `docs/dynamic.md` for the comparison with
//! AIMD, the gradient limiter of Netflix's concurrency-limits, Sentinel's system rule and
//! Polaris' climb adjuster.
//!
//! The controller's state and every adjustment are stored in Redis (`NS:{T}:dyn`,
//! `NS:{T}:adj`) by a fenced script, so a new leader continues where the old one stopped.
//! Its threshold replaces the scheduled one in rolling (order: base → schedule → dynamic).
//!
//! The state belongs to one **incarnation** of the task (the spec's etcd create revision): a
//! task deleted and created again under the same name never inherits it (RETIRE deletes it
//! with the task, and state of another incarnation is ignored anyway). Switching dynamic
//! limiting off deletes the state, so switching it on again starts from the base threshold.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sluice_protocol::conn::Redis;
use sluice_protocol::scripts::{self, AdjustOutcome, FenceRefusal, SliceCounters};
use sluice_protocol::{Keys, slice, slice_field, unix_ms};
use tracing::{debug, info, warn};

use crate::election::LeaderContext;
use crate::error::{Error, Result, redis as redis_err};
use crate::roller::{DynamicThresholds, effective_threshold};
use crate::spec::{DynamicSpec, MAX_COUNT};
use crate::tasks::{TaskEntry, TaskSnapshot, TaskStore};

/// Adjustments kept per task.
pub const KEEP_ADJUSTMENTS: usize = 1_000;
/// Outcomes needed before the SDK's error rate or latency counts.
pub const MIN_SAMPLES: u64 = 20;
/// Counters of the last slices may not be flushed by the hosts yet: the window ends this long
/// before now.
pub const FLUSH_LAG_MS: i64 = 1_500;
/// The roller applies a change within a tick; data from the slice it lands in is mixed.
pub const APPLY_LAG_MS: i64 = 500;
/// Goodput anchor: a decrease lands this fraction below the observed goodput.
pub const GOODPUT_MARGIN: f64 = 0.95;

/// What was observed for one task over its window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observation {
    /// Complete slices in the window.
    pub slices: u32,
    /// The slices' counters, summed over the window and over hosts.
    pub counters: SliceCounters,
    /// Worst fresh external error rate.
    pub external_error_rate: Option<f64>,
    /// Worst fresh external latency (ms).
    pub external_latency_ms: Option<f64>,
}

impl Observation {
    /// Error rate: the SDK's (with enough samples) and external reports, whichever is worse.
    pub fn error_rate(&self) -> Option<f64> {
        let c = &self.counters;
        let n = c.ok + c.err;
        let sdk = (n >= MIN_SAMPLES).then(|| c.err as f64 / n as f64);
        worst(sdk, self.external_error_rate)
    }

    /// Mean latency (ms), SDK or external, whichever is worse.
    pub fn latency_ms(&self) -> Option<f64> {
        let c = &self.counters;
        let sdk = (c.lat_n >= MIN_SAMPLES).then(|| c.lat_sum_us as f64 / c.lat_n as f64 / 1000.0);
        worst(sdk, self.external_latency_ms)
    }
}

fn worst(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

/// The controller's memory of one task (stored in `NS:{T}:dyn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerState {
    /// The threshold the controller set.
    pub current: u64,
    /// When it last changed it (Unix ms).
    pub last_change_ms: i64,
    /// When it last decreased it.
    pub last_decrease_ms: i64,
}

/// The controller's settings for one task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Lowest threshold.
    pub min: u64,
    /// Highest threshold.
    pub max: u64,
    /// Error-rate target.
    pub target_error_rate: f64,
    /// Latency target (ms).
    pub target_latency_ms: f64,
    /// Additive increase.
    pub step: u64,
    /// Multiplicative decrease.
    pub decrease_factor: f64,
    /// No increase for this long after a decrease.
    pub cooldown_ms: i64,
    /// Without demand information, recovery stops here (the base/scheduled threshold).
    pub recover_to: u64,
}

impl Params {
    /// Parameters from a spec, with the control period.
    pub fn new(d: &DynamicSpec, period: Duration, recover_to: u64) -> Self {
        Self {
            min: d.min,
            max: d.max,
            target_error_rate: d.target_error_rate,
            target_latency_ms: d.target_latency_ms,
            step: d.step(),
            decrease_factor: d.decrease_factor,
            cooldown_ms: 2 * period.as_millis() as i64,
            recover_to,
        }
    }
}

/// One decided change.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The new threshold.
    pub new: u64,
    /// Why, with the numbers.
    pub reason: String,
}

/// `v` within `[min, max]`; unlike `clamp`, never panics (a `max` below `min` reads as `min`:
/// specs are validated, but this is the decision path of every dynamic task).
///
/// ```
/// use sluice_manager::dynamic::bound;
/// assert_eq!(bound(5, 10, 20), 10);
/// assert_eq!(bound(25, 10, 20), 20);
/// assert_eq!(bound(15, 10, 5), 10);
/// ```
pub fn bound(v: u64, min: u64, max: u64) -> u64 {
    v.min(max).max(min)
}

/// The control law (pure).
///
/// ```
/// use sluice_manager::dynamic::*;
/// use sluice_protocol::scripts::SliceCounters;
/// let p = Params { min: 100, max: 10_000, target_error_rate: 0.05, target_latency_ms: 200.0,
///                  step: 99, decrease_factor: 0.8, cooldown_ms: 10_000, recover_to: 5_000 };
/// let s = ControllerState { current: 5_000, last_change_ms: 0, last_decrease_ms: 0 };
/// // A backend that serves 1,500/s fails the rest: one step lands near its capacity…
/// let c = SliceCounters { admitted: 20_000, rejected: 9_000, ok: 6_000, err: 14_000, ..Default::default() };
/// let o = Observation { slices: 4, counters: c, ..Default::default() };
/// let d = decide(&p, &s, &o, 60_000).unwrap();
/// assert_eq!(d.new, 2_500); // …but never more than halving at once: 5000 → 2500
/// let s = ControllerState { current: 2_500, last_change_ms: 60_000, last_decrease_ms: 60_000 };
/// let c = SliceCounters { admitted: 10_000, rejected: 9_000, ok: 6_000, err: 4_000, ..Default::default() };
/// let o = Observation { slices: 4, counters: c, ..Default::default() };
/// assert_eq!(decide(&p, &s, &o, 65_000).unwrap().new, 1_425); // goodput 1500 × 0.95
/// ```
pub fn decide(p: &Params, s: &ControllerState, o: &Observation, now_ms: i64) -> Option<Decision> {
    let cur = s.current;
    let err = o.error_rate();
    let lat = o.latency_ms();
    if err.is_none() && lat.is_none() && o.counters.admitted + o.counters.rejected == 0 {
        return None; // nothing to judge by
    }
    let bad_err = err.is_some_and(|e| e > p.target_error_rate);
    let bad_lat = lat.is_some_and(|l| l > p.target_latency_ms);
    let fmt_health = || {
        let e = err.map_or("n/a".to_string(), |e| format!("{e:.3}"));
        let l = lat.map_or("n/a".to_string(), |l| format!("{l:.0} ms"));
        format!(
            "error rate {e} (target {}), latency {l} (target {:.0} ms)",
            p.target_error_rate, p.target_latency_ms
        )
    };
    if bad_err || bad_lat {
        // Errors under overload: the successful requests per slice are what the backend can
        // serve; land just below that (but never cut more than half at once). Latency alone,
        // or no goodput known: the plain multiplicative decrease.
        let goodput =
            (o.slices > 0 && o.counters.ok > 0).then(|| o.counters.ok as f64 / o.slices as f64);
        let anchored = goodput
            .filter(|_| bad_err)
            .map(|g| g * GOODPUT_MARGIN)
            .filter(|a| *a < cur as f64);
        let new = anchored.map_or(cur as f64 * p.decrease_factor, |a| a.max(cur as f64 * 0.5));
        let new = bound(new.round() as u64, p.min, p.max);
        if new >= cur {
            return None;
        }
        return Some(Decision {
            new,
            reason: format!(
                "unhealthy: {}; goodput {} per slice over {} slices → decrease",
                fmt_health(),
                goodput.map_or("n/a".to_string(), |g| format!("{g:.0}")),
                o.slices
            ),
        });
    }
    if now_ms - s.last_decrease_ms < p.cooldown_ms {
        return None;
    }
    let used = if o.slices > 0 && cur > 0 {
        o.counters.admitted as f64 / (cur as f64 * o.slices as f64)
    } else {
        0.0
    };
    let pressing = o.counters.rejected > 0 || used >= 0.9;
    let ceiling = if pressing {
        p.max
    } else if o.counters.admitted + o.counters.rejected == 0 {
        bound(p.recover_to, p.min, p.max)
    } else {
        return None; // healthy but demand is below the limit: nothing to learn
    };
    if cur >= ceiling {
        return None;
    }
    let new = cur.saturating_add(p.step).min(ceiling);
    Some(Decision {
        new,
        reason: if pressing {
            format!(
                "healthy and pressing: {}; {} rejected, {:.0}% of the threshold used over {} slices → increase by {}",
                fmt_health(),
                o.counters.rejected,
                used * 100.0,
                o.slices,
                new - cur
            )
        } else {
            format!(
                "healthy (external reports): {}; recovering towards {ceiling} → increase by {}",
                fmt_health(),
                new - cur
            )
        },
    })
}

/// One recorded adjustment (`GET /api/v1/tasks/{name}/adjustments`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Adjustment {
    /// When (Unix ms).
    pub at_ms: i64,
    /// Threshold before.
    pub old: u64,
    /// Threshold after.
    pub new: u64,
    /// Why, with the numbers.
    pub reason: String,
}

/// An external health report (`POST /api/v1/tasks/{name}/health`), stored per source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthReport {
    /// Error rate in [0, 1].
    pub error_rate: Option<f64>,
    /// Latency in ms.
    pub latency_ms: Option<f64>,
    /// When it was received (Unix ms).
    pub at_ms: i64,
}

/// The state field naming the task incarnation (spec create revision) the state belongs to.
const INCARNATION: &str = "incarnation";

fn state_pairs(s: &ControllerState, incarnation: i64) -> Vec<(&'static str, String)> {
    vec![
        ("current", s.current.to_string()),
        ("last_change_ms", s.last_change_ms.to_string()),
        ("last_decrease_ms", s.last_decrease_ms.to_string()),
        (INCARNATION, incarnation.to_string()),
    ]
}

/// Parses `NS:{T}:dyn` as read back from Redis (pure): `None` when it is absent, belongs to
/// another incarnation of the task (or to none: written before incarnations were recorded),
/// or does not hold plausible values; the threshold is then the spec's again.
///
/// ```
/// use std::collections::HashMap;
/// use sluice_manager::dynamic::parse_state;
/// let m = |inc: &str| HashMap::from([
///     ("current".to_string(), "1425".to_string()),
///     ("last_change_ms".to_string(), "1700000000000".to_string()),
///     ("last_decrease_ms".to_string(), "1700000000000".to_string()),
///     ("incarnation".to_string(), inc.to_string()),
/// ]);
/// assert_eq!(parse_state(&m("42"), 42).map(|s| s.current), Some(1425));
/// assert_eq!(parse_state(&m("41"), 42), None); // the dead task's state
/// assert_eq!(parse_state(&HashMap::new(), 42), None);
/// ```
pub fn parse_state(m: &HashMap<String, String>, incarnation: i64) -> Option<ControllerState> {
    let int = |k: &str| m.get(k).and_then(|v| v.parse::<i64>().ok());
    if int(INCARNATION)? != incarnation {
        return None;
    }
    let plausible_ms = |t: i64| (0..=100_000_000_000_000).contains(&t).then_some(t);
    let current = int("current").filter(|c| (0..=MAX_COUNT as i64).contains(c))?;
    Some(ControllerState {
        current: current as u64,
        last_change_ms: int("last_change_ms").and_then(plausible_ms).unwrap_or(0),
        last_decrease_ms: int("last_decrease_ms").and_then(plausible_ms).unwrap_or(0),
    })
}

async fn load_state(
    redis: &Redis,
    keys: &Keys,
    entry: &TaskEntry,
) -> Result<Option<ControllerState>> {
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let m: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.dynamic_state(&entry.name))
        .query_async(&mut c)
        .await
        .map_err(redis_err("dynamic state"))?;
    let s = parse_state(&m, entry.created);
    if s.is_none() && !m.is_empty() {
        debug!(
            task = entry.name,
            incarnation = entry.created,
            "ignoring dynamic state of another incarnation (or unreadable)"
        );
    }
    Ok(s)
}

/// A counter as read back from Redis: absent or unreadable counts as 0.
fn counter(v: &Option<String>) -> u64 {
    v.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Whether an external health report read back from Redis is usable.
fn plausible_report(r: &HealthReport) -> bool {
    r.error_rate.is_none_or(|e| (0.0..=1.0).contains(&e))
        && r.latency_ms
            .is_none_or(|l| l.is_finite() && (0.0..=3_600_000.0).contains(&l))
}

/// Reads the counters of the window and the fresh external reports.
async fn observe(
    redis: &Redis,
    keys: &Keys,
    entry: &TaskEntry,
    from_ms: i64,
    until_ms: i64,
    fresh_ms: i64,
) -> Result<Observation> {
    let slice_ms = entry.spec.slice_ms;
    // Complete slices only: starting at or after `from`, ending at or before `until`.
    let first = slice::start(from_ms + slice_ms as i64 - 1, slice_ms);
    let starts: Vec<i64> = slice::starts(first, until_ms, slice_ms)
        .filter(|s| slice::end(*s, slice_ms) <= until_ms)
        .take(600)
        .collect();
    let mut o = Observation {
        slices: starts.len() as u32,
        ..Default::default()
    };
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    if !starts.is_empty() {
        let mut pipe = redis::pipe();
        for s in &starts {
            pipe.cmd("HMGET")
                .arg(keys.slice(&entry.name, *s))
                .arg(&slice_field::COUNTERS[..]);
        }
        let rows: Vec<Vec<Option<String>>> = pipe
            .query_async(&mut c)
            .await
            .map_err(redis_err("window counters"))?;
        for r in rows {
            let v = |i: usize| r.get(i).map_or(0, counter);
            let t = &mut o.counters;
            t.admitted = t.admitted.saturating_add(v(0));
            t.rejected = t.rejected.saturating_add(v(1));
            t.ok = t.ok.saturating_add(v(2));
            t.err = t.err.saturating_add(v(3));
            t.lat_sum_us = t.lat_sum_us.saturating_add(v(4));
            t.lat_n = t.lat_n.saturating_add(v(5));
        }
    }
    let reports: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.health_reports(&entry.name))
        .query_async(&mut c)
        .await
        .map_err(redis_err("health reports"))?;
    for r in reports
        .values()
        .filter_map(|v| serde_json::from_str::<HealthReport>(v).ok())
        .filter(plausible_report)
    {
        if r.at_ms < fresh_ms {
            continue;
        }
        o.external_error_rate = worst(o.external_error_rate, r.error_rate);
        o.external_latency_ms = worst(o.external_latency_ms, r.latency_ms);
    }
    Ok(o)
}

/// Restores every dynamic task's threshold into `overrides` before rolling starts, so a new
/// leader never writes the base threshold over a controlled one. State of another incarnation
/// of the task is ignored.
pub async fn restore(redis: &Redis, keys: &Keys, store: &TaskStore, overrides: &DynamicThresholds) {
    overrides.clear();
    for entry in store.snapshot().tasks.values() {
        if !entry.spec.dynamic.as_ref().is_some_and(|d| d.enabled) {
            continue;
        }
        match load_state(redis, keys, entry).await {
            Ok(Some(s)) => overrides.set(&entry.name, entry.created, Some(s.current)),
            Ok(None) => {}
            Err(e) => warn!(task = entry.name, %e, "cannot restore the dynamic threshold"),
        }
    }
}

/// What the loop remembers of one dynamic task: its incarnation and the controller state.
type Held = (i64, ControllerState);

/// The controller's leader loop.
pub async fn run(
    ctx: LeaderContext,
    keys: Keys,
    redis: Arc<Redis>,
    store: TaskStore,
    overrides: DynamicThresholds,
    period: Duration,
) {
    let mut states: HashMap<String, Held> = HashMap::new();
    let mut last_eval: HashMap<String, i64> = HashMap::new();
    // Tasks without dynamic limiting known to have no controller state (name → incarnation).
    let mut clean: HashMap<String, i64> = HashMap::new();
    // The snapshot the maps above were last pruned for, and whether every non-dynamic task of
    // it is known clean: at 100,000 tasks, walking them every 500 ms was a large part of an
    // idle leader's CPU (issue 27).
    let mut pruned_for: Option<Arc<crate::tasks::TaskSnapshot>> = None;
    let mut all_clean = false;
    let mut interval = tokio::time::interval(Duration::from_millis(500));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let period_ms = period.as_millis() as i64;
    loop {
        tokio::select! {
            _ = ctx.token().cancelled() => return,
            _ = interval.tick() => {}
        }
        let snap = store.snapshot();
        if !snap.loaded {
            continue;
        }
        let now = unix_ms();
        let enabled = |name: &str| {
            snap.tasks
                .get(name)
                .and_then(|e| e.spec.dynamic.as_ref())
                .is_some_and(|d| d.enabled)
        };
        // Tasks that are gone, re-created or no longer dynamic lose their override and state.
        for (name, (inc, _)) in overrides.current() {
            let same = snap.tasks.get(&name).is_some_and(|e| e.created == inc);
            if !same || !enabled(&name) {
                overrides.set(&name, inc, None);
            }
        }
        // What depends only on the snapshot is redone when it changes.
        let fresh = pruned_for.as_ref().is_none_or(|s| !Arc::ptr_eq(s, &snap));
        if fresh {
            states.retain(|name, (inc, _)| {
                snap.tasks.get(name).is_some_and(|e| e.created == *inc) && enabled(name)
            });
            last_eval.retain(|name, _| states.contains_key(name) || enabled(name));
            clean.retain(|name, inc| {
                snap.tasks.get(name).is_some_and(|e| e.created == *inc) && !enabled(name)
            });
            pruned_for = Some(snap.clone());
            all_clean = false;
        }
        if !all_clean {
            match clear_disabled(&ctx, &keys, &redis, &snap, &mut clean).await {
                Ok(()) => {
                    let non_dynamic = snap
                        .tasks
                        .values()
                        .filter(|e| !e.spec.dynamic.as_ref().is_some_and(|d| d.enabled))
                        .count();
                    all_clean = clean.len() == non_dynamic;
                }
                Err(Error::Fenced { task, current, .. }) => {
                    ctx.step_down(format!("fenced on {task} by term {current}"));
                    return;
                }
                Err(e) => debug!(%e, "clearing dynamic state of non-dynamic tasks failed"),
            }
        }
        for entry in snap.tasks.values() {
            let Some(d) = entry.spec.dynamic.as_ref().filter(|d| d.enabled) else {
                continue;
            };
            if last_eval
                .get(&entry.name)
                .is_some_and(|t| now - t < period_ms)
            {
                continue;
            }
            if !ctx.is_valid() {
                return;
            }
            match step(
                &ctx,
                &keys,
                &redis,
                entry,
                d,
                period,
                now,
                &mut states,
                &overrides,
            )
            .await
            {
                Ok(evaluated) => {
                    if evaluated {
                        last_eval.insert(entry.name.clone(), now);
                    }
                }
                Err(Error::Fenced { task, current, .. }) => {
                    warn!(
                        task,
                        current, "fenced while recording an adjustment; stepping down"
                    );
                    ctx.step_down(format!("fenced on {task} by term {current}"));
                    return;
                }
                Err(e) => warn!(task = entry.name, %e, "dynamic control step failed"),
            }
        }
    }
}

/// Maps a refusal of the fence: `Err(Fenced)` when a newer leader of this etcd history holds
/// the task (step down), `Ok(false)` when another epoch or history does (skip the task; the
/// roller reports the conflict).
fn refused(ctx: &LeaderContext, task: &str, r: &FenceRefusal) -> Result<bool> {
    match r {
        FenceRefusal::Newer { term, .. } if ctx.from_this_history(*term) => Err(Error::Fenced {
            task: task.to_string(),
            term: ctx.term(),
            current: *term,
        }),
        _ => Ok(false),
    }
}

/// Deletes the controller state of tasks without dynamic limiting (fenced), so enabling it
/// again starts from the base threshold. Tasks not in `clean` are checked with an `EXISTS`
/// each (many in flight); at the start of a leadership that is every such task, later only those whose
/// dynamic limiting was just switched off.
async fn clear_disabled(
    ctx: &LeaderContext,
    keys: &Keys,
    redis: &Redis,
    snap: &TaskSnapshot,
    clean: &mut HashMap<String, i64>,
) -> Result<()> {
    let todo: Vec<&Arc<TaskEntry>> = snap
        .tasks
        .values()
        .filter(|e| !e.spec.dynamic.as_ref().is_some_and(|d| d.enabled))
        .filter(|e| !clean.contains_key(&e.name))
        .collect();
    if todo.is_empty() {
        return Ok(());
    }
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    // One `EXISTS` per task, many in flight: a pipeline of many tasks' keys is refused by a
    // Redis Cluster (they lie in different slots).
    let names: Vec<String> = todo.iter().map(|e| keys.dynamic_state(&e.name)).collect();
    let exists: Vec<redis::RedisResult<bool>> = futures::stream::iter(names)
        .map(|key| {
            let mut c = c.clone();
            async move {
                redis::cmd("EXISTS")
                    .arg(key)
                    .query_async::<bool>(&mut c)
                    .await
            }
        })
        .buffered(64)
        .collect()
        .await;
    // A task whose read failed is looked at again next round; the others go on.
    let failed = exists.iter().filter(|r| r.is_err()).count();
    if failed > 0 {
        warn!(
            tasks = failed,
            "cannot read whether non-dynamic tasks keep controller state; retrying"
        );
    }
    for (e, has) in todo.into_iter().zip(exists) {
        let Ok(has) = has else { continue };
        if has {
            if !ctx.is_valid() {
                return Err(Error::NotLeader);
            }
            let out = scripts::adjust(&mut c, keys, &e.name, &ctx.fence(), true, &[], None, 1)
                .await
                .map_err(redis_err("clear dynamic state"))?;
            match out {
                AdjustOutcome::Done => {
                    info!(
                        task = e.name,
                        "dynamic limiting is off: controller state deleted"
                    );
                }
                AdjustOutcome::NoTask => {}
                AdjustOutcome::Refused(r) => {
                    refused(ctx, &e.name, &r)?;
                    continue; // not ours to clear now; try again next round
                }
            }
        }
        clean.insert(e.name.clone(), e.created);
    }
    Ok(())
}

/// One evaluation of one task; false when there was not enough data yet.
#[allow(clippy::too_many_arguments)]
async fn step(
    ctx: &LeaderContext,
    keys: &Keys,
    redis: &Redis,
    entry: &TaskEntry,
    d: &DynamicSpec,
    period: Duration,
    now: i64,
    states: &mut HashMap<String, Held>,
    overrides: &DynamicThresholds,
) -> Result<bool> {
    let base = effective_threshold(entry, None, now);
    let inc = entry.created;
    let state = match states.get(&entry.name) {
        Some((_, s)) => *s,
        None => {
            let s = match load_state(redis, keys, entry).await? {
                Some(s) => s,
                None => ControllerState {
                    current: bound(base, d.min, d.max),
                    last_change_ms: now,
                    last_decrease_ms: 0,
                },
            };
            states.insert(entry.name.clone(), (inc, s));
            s
        }
    };
    // Bounds may have changed in the spec.
    let mut state = state;
    let clamped = bound(state.current, d.min, d.max);
    let period_ms = period.as_millis() as i64;
    let until = now - FLUSH_LAG_MS;
    // At least three slices long, so it holds complete slices whatever the alignment.
    let span = period_ms.max(3 * entry.spec.slice_ms as i64);
    let from = (state.last_change_ms + APPLY_LAG_MS).max(until - span);
    let o = observe(redis, keys, entry, from, until, now - 2 * period_ms).await?;
    debug!(task = entry.name, ?o, ?state, "dynamic observation");
    let decision = if clamped != state.current {
        Some(Decision {
            new: clamped,
            reason: format!("bounds changed to [{}, {}]", d.min, d.max),
        })
    } else if o.slices == 0 && o.external_error_rate.is_none() && o.external_latency_ms.is_none() {
        overrides.set(&entry.name, inc, Some(state.current));
        return Ok(false);
    } else {
        decide(&Params::new(d, period, base), &state, &o, now)
    };
    overrides.set(&entry.name, inc, Some(state.current));
    let Some(dec) = decision else {
        return Ok(true);
    };
    let adj = Adjustment {
        at_ms: now,
        old: state.current,
        new: dec.new,
        reason: dec.reason,
    };
    if dec.new < state.current {
        state.last_decrease_ms = now;
    }
    state.current = dec.new;
    state.last_change_ms = now;
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let json = serde_json::to_string(&adj).unwrap_or_default();
    let out = scripts::adjust(
        &mut c,
        keys,
        &entry.name,
        &ctx.fence(),
        false,
        &state_pairs(&state, inc),
        Some(&json),
        KEEP_ADJUSTMENTS,
    )
    .await
    .map_err(redis_err("record adjustment"))?;
    match out {
        AdjustOutcome::Done => {}
        AdjustOutcome::NoTask => {
            debug!(
                task = entry.name,
                "task meta missing or retired: adjustment not recorded"
            );
            return Ok(false);
        }
        AdjustOutcome::Refused(r) => {
            refused(ctx, &entry.name, &r)?;
            return Ok(false);
        }
    }
    info!(
        task = entry.name,
        old = adj.old,
        new = adj.new,
        reason = adj.reason,
        "dynamic threshold adjusted"
    );
    states.insert(entry.name.clone(), (inc, state));
    overrides.set(&entry.name, inc, Some(state.current));
    Ok(true)
}

/// The newest `limit` adjustments of a task, newest first.
pub async fn adjustments(
    redis: &Redis,
    keys: &Keys,
    task: &str,
    limit: usize,
) -> Result<Vec<Adjustment>> {
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let raw: Vec<String> = redis::cmd("LRANGE")
        .arg(keys.adjustments(task))
        .arg(0)
        .arg(limit.saturating_sub(1))
        .query_async(&mut c)
        .await
        .map_err(redis_err("adjustments"))?;
    Ok(raw
        .iter()
        .filter_map(|r| serde_json::from_str(r).ok())
        .collect())
}

/// Stores an external health report of `source`.
pub async fn record_report(
    redis: &Redis,
    keys: &Keys,
    task: &str,
    source: &str,
    report: &HealthReport,
) -> Result<()> {
    let mut c = redis.conn().await.map_err(redis_err("connect"))?;
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(keys.health_reports(task))
        .arg(source)
        .arg(serde_json::to_string(report).unwrap_or_default())
        .ignore()
        .cmd("PEXPIRE")
        .arg(keys.health_reports(task))
        .arg(10 * 60 * 1000)
        .ignore()
        .query_async(&mut c)
        .await
        .map_err(redis_err("health report"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        Params {
            min: 100,
            max: 10_000,
            target_error_rate: 0.05,
            target_latency_ms: 200.0,
            step: 99,
            decrease_factor: 0.8,
            cooldown_ms: 10_000,
            recover_to: 5_000,
        }
    }

    /// A simulated backend of `capacity` per slice with demand far above the threshold.
    fn overloaded(threshold: u64, capacity: u64, slices: u32) -> Observation {
        let adm = threshold * slices as u64;
        let ok = adm.min(capacity * slices as u64);
        Observation {
            slices,
            counters: SliceCounters {
                admitted: adm,
                rejected: 10_000,
                ok,
                err: adm - ok,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Runs the loop against the simulated backend with a fake clock (5 s periods).
    fn simulate(
        start: u64,
        capacity: u64,
        periods: usize,
        s: &mut ControllerState,
        now: &mut i64,
    ) -> Vec<u64> {
        let mut out = Vec::new();
        for _ in 0..periods {
            *now += 5_000;
            let o = overloaded(s.current, capacity, 4);
            if let Some(d) = decide(&params(), s, &o, *now) {
                if d.new < s.current {
                    s.last_decrease_ms = *now;
                }
                s.current = d.new;
                s.last_change_ms = *now;
            }
            out.push(s.current);
        }
        let _ = start;
        out
    }

    #[test]
    fn settles_near_capacity_and_follows_it_up() {
        let mut s = ControllerState {
            current: 5_000,
            last_change_ms: 0,
            last_decrease_ms: 0,
        };
        let mut now = 0;
        let first = simulate(5_000, 1_500, 12, &mut s, &mut now); // 60 s
        // From the third period on, within ±20 % of 1,500.
        for v in &first[2..] {
            assert!((1_200..=1_800).contains(v), "{first:?}");
        }
        let second = simulate(s.current, 3_000, 12, &mut s, &mut now);
        assert!(second.iter().any(|v| *v >= 2_400), "{second:?}");
        assert!(
            (2_400..=3_600).contains(second.last().unwrap()),
            "{second:?}"
        );
    }

    #[test]
    fn never_below_min_and_recovers_without_traffic() {
        let p = params();
        let mut s = ControllerState {
            current: 300,
            last_change_ms: 0,
            last_decrease_ms: 0,
        };
        let bad = Observation {
            slices: 4,
            external_error_rate: Some(0.5),
            ..Default::default()
        };
        for i in 1..20 {
            if let Some(d) = decide(&p, &s, &bad, i * 5_000) {
                s.current = d.new;
                s.last_decrease_ms = i * 5_000;
            }
            assert!(s.current >= p.min);
        }
        assert_eq!(s.current, p.min);
        let good = Observation {
            slices: 4,
            external_error_rate: Some(0.0),
            ..Default::default()
        };
        // Within the cooldown: hold.
        assert_eq!(decide(&p, &s, &good, s.last_decrease_ms + 5_000), None);
        let d = decide(&p, &s, &good, s.last_decrease_ms + 10_000).unwrap();
        assert_eq!(d.new, p.min + p.step);
        // Without demand information, recovery stops at the base threshold.
        s.current = 4_950;
        assert_eq!(
            decide(&p, &s, &good, s.last_decrease_ms + 20_000)
                .unwrap()
                .new,
            5_000
        );
        s.current = 5_000;
        assert_eq!(decide(&p, &s, &good, s.last_decrease_ms + 20_000), None);
    }

    #[test]
    fn latency_alone_makes_it_unhealthy() {
        let o = Observation {
            slices: 4,
            counters: SliceCounters {
                admitted: 4_000,
                ok: 4_000,
                lat_sum_us: 4_000 * 500_000,
                lat_n: 4_000,
                ..Default::default()
            },
            ..Default::default()
        };
        let s = ControllerState {
            current: 1_000,
            last_change_ms: 0,
            last_decrease_ms: 0,
        };
        let d = decide(&params(), &s, &o, 60_000).unwrap();
        assert_eq!(d.new, 800);
        assert!(d.reason.contains("latency 500 ms"), "{}", d.reason);
    }

    #[test]
    fn healthy_below_the_limit_holds() {
        let o = Observation {
            slices: 4,
            counters: SliceCounters {
                admitted: 1_000,
                ok: 1_000,
                ..Default::default()
            },
            ..Default::default()
        };
        let s = ControllerState {
            current: 1_000,
            last_change_ms: 0,
            last_decrease_ms: 0,
        };
        assert_eq!(decide(&params(), &s, &o, 60_000), None);
    }
}
