//! Rolling: the leader keeps every task's slices written from the current one to
//! `now + horizon`, fenced by its term and epoch.
//!
//! ```text
//!   tick ──▶ plan (pure) ──▶ one ROLL script call per task, all in flight at once ──▶ apply
//!              │                       │
//!              │                       ├─ Written(n)  remember what was written
//!              │                       ├─ NeedFull    Redis lost the task (restart, FLUSHALL), or
//!              │                       │              a fence is taken over: resend meta + whole
//!              │                       │              window, same tick
//!              │                       ├─ Retired     deleted after the spec we hold: skip
//!              │                       ├─ StaleSpec   Redis holds a newer spec version: skip
//!              │                       ├─ Refused     Newer (this etcd history): step down now;
//!              │                       │              Foreign, or a term of another history:
//!              │                       │              skip the task, report fence_conflict
//!              └─ only what changed: new slices entering the window, and every not-ended
//!                 slice whose threshold changed (spec version, schedule, dynamic override);
//!                 everything when slice_ms changed (the new grid) or the task was re-created
//! ```
//!
//! A task rolled ahead with nothing new to write is not looked at in Redis: its next roll call
//! (a step of its window, or its fence refresh every `fence_stale_after / 4`) notices a meta
//! Redis lost and heals it. A Redis that lost everything (the task registry missing, checked
//! every tick) or a single server with a new `run_id` (restarted with older data, failed over)
//! has every task with nothing to write probed in that tick (lazy ones at most every 5 s) and
//! healed within it; so does the tick after a task was found lost. A quiet lazy task
//! (`--lazy-after`) sleeps in a due-queue until its refresh (which probes it too,
//! [`scripts::roll_watching`]) or probe is due, or something wakes it (see `Sleep`). A probe is
//! one `HMGET` of the meta ([`scripts::roll_probe`]); only what that cannot vouch for (a lost,
//! rewound, retired, re-fenced or newer meta) costs the script call. A new leader has no memory
//! of what was written, so its first tick sends every task's whole window (the script skips
//! slices that already hold the right threshold).
//!
//! A refusal by another epoch's fence (another etcd, a second manager cluster on the same
//! namespace) does not make this leader step down — stepping down and winning again would
//! only flap. The task is skipped, `sluice_fence_foreign_tasks` counts it, a `fence_conflict`
//! alert is raised while it lasts, and the fence is taken over once its holder has stopped
//! refreshing it for `--fence-stale-after`. Stored spec versions and deletion revisions above
//! this etcd's current revision come from another etcd history (a rebuild, a restore) and are
//! overwritten (`force`).
//!
//! Invalid stored specs ([`TaskSnapshot::invalid`]) are neither rolled nor retired; they are
//! reported as `invalid_spec` until fixed or deleted.
//!
//! # Deletions no leader saw
//!
//! The retire list is the roller's memory, which a new leadership starts without. So the
//! roller keeps a registry of the tasks it rolls (`NS:tasks`): every task is added before its
//! meta can be written (one `SADD` of the names not yet added this leadership) and removed
//! after its retirement. A new leadership walks the registry, one `SSCAN` page of
//! [`RECONCILE_PAGE`] names per tick: a name etcd does not hold whose meta is live and of this
//! etcd's epoch joins the memory and is retired by the same fenced RETIRE as a deletion seen
//! by the watch; a name whose meta is missing or a tombstone is only removed from the set; a
//! live meta of another epoch (another manager cluster on the namespace) is left alone.
//! Managers older than the registry never filled it, so the walk waits until the set holds
//! [`REGISTRY_COMPLETE`]; a leadership that finds it missing first fills it from a `SCAN` of
//! the metas ([`REGISTRY_SCAN_PAGE`] keys per tick; a single Redis server only).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;
use sluice_protocol::conn::Redis;
use sluice_protocol::scripts::{
    self, FenceRefusal, LazyWindow, RetireOutcome, RollOutcome, RollRequest, SliceWrite,
};
use sluice_protocol::{Keys, Mode, slice, unix_ms};
use tracing::{debug, info, warn};

use crate::alerts::{AlertTx, Condition, Signal};
use crate::election::LeaderContext;
use crate::error::{Error, Result, redis as redis_err};
use crate::history::Seen;
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

/// Registry members read per tick while a new leadership reconciles (one `SSCAN` page): a
/// registry of 10,000 names is walked in about 20 ticks (10 s at the default tick).
pub const RECONCILE_PAGE: usize = 500;

/// Keys examined per tick by the one-time `SCAN` that fills a registry older managers did not
/// keep (one page per tick: a keyspace of a million keys takes about 500 ticks, 4 minutes).
pub const REGISTRY_SCAN_PAGE: usize = 1_000;

/// The registry member that says it is complete (every task with a meta is in it): not a task
/// name (names have 1 to 64 characters).
pub const REGISTRY_COMPLETE: &str = "";

/// A fence conflict is logged at most this often.
const CONFLICT_LOG_EVERY: Duration = Duration::from_secs(30);

/// Tasks named in one `fence_conflict` alert.
const CONFLICT_TASKS_SHOWN: usize = 20;

/// Settings of rolling.
#[derive(Debug, Clone, Copy)]
pub struct RollConfig {
    /// How far ahead slices are written.
    pub horizon: Duration,
    /// How long a slice key lives after its slice ended.
    pub retention: Duration,
    /// Loop period.
    pub tick: Duration,
    /// A fence not refreshed for this long may be taken over; a live leader refreshes its
    /// fence at least every quarter of it.
    pub fence_stale_after: Duration,
}

/// How far past the horizon a task's window is written when it is extended: a sixth of the
/// horizon, at most 10 s, and 0 when that is shorter than a slice (one slice at a time, as a
/// 60 s slice is anyway). Slices are always written at least `horizon` ahead; the step adds up
/// to that much more (memory: up to `step / (horizon + retention)` more slice keys, 8 % with
/// the defaults) and divides the roll calls of short slices by the slices in a step.
///
/// ```
/// use std::time::Duration;
/// use sluice_manager::roller::roll_step_ms;
/// assert_eq!(roll_step_ms(Duration::from_secs(60), 1_000), 10_000);
/// assert_eq!(roll_step_ms(Duration::from_secs(6), 100), 1_000);
/// assert_eq!(roll_step_ms(Duration::from_secs(60), 60_000), 0);
/// ```
pub fn roll_step_ms(horizon: Duration, slice_ms: u64) -> i64 {
    let step = (horizon.as_millis() as i64 / 6).min(10_000);
    if step < slice_ms as i64 { 0 } else { step }
}

impl RollConfig {
    /// How far ahead a task of `slice_ms` slices is written at least: the horizon, capped at
    /// [`MAX_SLICES_AHEAD`] slices.
    fn ahead_ms(&self, slice_ms: u64) -> i64 {
        (self.horizon.as_millis() as i64).min(slice_ms as i64 * MAX_SLICES_AHEAD)
    }

    /// How often a live leader refreshes a task's fence: a quarter of `fence_stale_after`.
    fn refresh_every_ms(&self) -> i64 {
        (self.fence_stale_after.as_millis() as i64 / 4).max(1)
    }

    /// How often a lazy task's fence and window are refreshed, and the task probed when no
    /// host reports using it (issue 27: at 100,000 idle tasks a refresh of each every quarter of
    /// `fence_stale_after` was the leader's whole cost): half the horizon, at most
    /// [`LAZY_REFRESH_MAX_MS`], never more often than an eager task's.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use sluice_manager::roller::RollConfig;
    /// let cfg = |h: u64| RollConfig { horizon: Duration::from_secs(h), retention: Duration::from_secs(60),
    ///     tick: Duration::from_millis(500), fence_stale_after: Duration::from_secs(10) };
    /// assert_eq!(cfg(60).lazy_refresh_ms(), 30_000);
    /// assert_eq!(cfg(600).lazy_refresh_ms(), 30_000);
    /// assert_eq!(cfg(20).lazy_refresh_ms(), 10_000);
    /// assert_eq!(cfg(2).lazy_refresh_ms(), 2_500);
    /// // Its fence holds two refreshes (and never less than `fence_stale_after`).
    /// assert_eq!(cfg(60).lazy_fence_ttl_ms(), 60_000);
    /// assert_eq!(cfg(2).lazy_fence_ttl_ms(), 10_000);
    /// ```
    pub fn lazy_refresh_ms(&self) -> i64 {
        (self.horizon.as_millis() as i64 / 2)
            .min(LAZY_REFRESH_MAX_MS)
            .max(self.refresh_every_ms())
    }

    /// How long a lazy task's fence holds (its `fence_ttl`): two of its refreshes, at least
    /// `fence_stale_after`. A lazy window reaches a horizon and a refresh past the write that
    /// claimed the fence, so with the horizon at least twice the refresh (the defaults) a
    /// takeover of a stale fence comes before the window runs out.
    pub fn lazy_fence_ttl_ms(&self) -> u64 {
        (2 * self.lazy_refresh_ms() as u64).max(self.fence_stale_after.as_millis() as u64)
    }
}

/// Names per `SADD` of the task registry.
const REGISTER_BATCH: usize = 10_000;

/// The longest refresh period of a lazy task (ms): see [`RollConfig::lazy_refresh_ms`].
pub const LAZY_REFRESH_MAX_MS: i64 = 30_000;

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
    /// Incarnation (spec create revision) written.
    pub created: i64,
    /// Slice length of the grid written.
    pub slice_ms: u64,
    /// The dynamic override the caps were computed with.
    pub dynamic: Option<u64>,
    /// End of the last written slice.
    pub rolled_to: i64,
    /// When the fence (`fenced_ms`) was last rewritten (leader clock, ms).
    pub refreshed_ms: i64,
    /// Caps written for slices that have not ended.
    pub caps: BTreeMap<i64, u64>,
    /// The lazy window last written into the meta (`--lazy-after`): the task is lazy, its
    /// slices are made by workers ([`scripts::LAZY_LUA`]). `None`: rolled ahead.
    pub lazy: Option<LazyWindow>,
    /// When (leader clock, ms) the task was last rolled ahead because it was new to this
    /// leadership or had traffic again: it is not left lazy before `--lazy-after` from then.
    pub eager_ms: i64,
    /// When (leader clock, ms) the task was left lazy: traffic the harvester finds after it
    /// wakes it.
    pub lazy_since: i64,
    /// A lazy task just woken: its window, cut by [`plan`] at the first slice the next write
    /// rolls ahead and sent once with that write so a worker whose clock is behind still finds (or makes) the
    /// slices before it, as it would those an eager task had written earlier.
    pub tail: Option<LazyWindow>,
    /// When (leader clock, ms) a lazy task was last probed for slices workers made.
    pub probed_ms: i64,
}

impl TaskRollState {
    /// Rolls a lazy task ahead again from `now_ms` on: its window is kept as the tail that
    /// [`plan`] cuts at the first slice it writes. False when it was not lazy.
    fn wake(&mut self, now_ms: i64) -> bool {
        let Some(l) = self.lazy.take() else {
            return false;
        };
        self.tail = Some(l);
        self.eager_ms = now_ms;
        true
    }
}

/// One planned script call for a task (a whole window may take several).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Rewrite meta and window regardless of the stored state.
    pub full: bool,
    /// Write the meta fields.
    pub write_meta: bool,
    /// Rewrite the fence's `fenced_ms` even if `rolled_to` does not advance.
    pub refresh: bool,
    /// Slices to create or change, oldest first.
    pub slices: Vec<SliceWrite>,
    /// `rolled_to` the leader believes is stored.
    pub expect_rolled_to: i64,
    /// `rolled_to` after this plan.
    pub new_rolled_to: i64,
    /// State after success.
    pub next: TaskRollState,
    /// Nothing planned ([`quiet`]): `next` is not filled in and the state stays as it is.
    pub unchanged: bool,
    /// The task is lazy: the window written into its meta (with `refresh`), or for an
    /// `unchanged` plan the one the probe checks is still there.
    pub lazy: Option<LazyWindow>,
    /// For an `unchanged` lazy plan, or a lazy task's refresh (whose call is its probe too):
    /// when the task was last probed (leader clock, ms); the probe looks for slices workers
    /// made since.
    pub probe_from: i64,
}

impl Plan {
    /// Nothing to write ([`quiet`]): the task is only probed, from what `state` says was
    /// written (`next` is not filled in).
    pub fn probe(state: &TaskRollState) -> Self {
        Self {
            full: false,
            write_meta: false,
            refresh: false,
            slices: Vec::new(),
            expect_rolled_to: state.rolled_to,
            new_rolled_to: state.rolled_to,
            next: TaskRollState::default(),
            unchanged: true,
            lazy: state.lazy,
            probe_from: state.probed_ms,
        }
    }
}

/// Whether [`plan`] would plan nothing for this task at `now_ms` (no new slice, no cap to
/// recompute, no meta, no fence refresh): the roller then only probes it, without planning
/// (which copies the window's caps: the leader's CPU at 10,000 idle tasks).
pub fn quiet(
    state: &TaskRollState,
    entry: &TaskEntry,
    dynamic: Option<u64>,
    now_ms: i64,
    cfg: &RollConfig,
) -> bool {
    let slice_ms = entry.spec.slice_ms.max(1);
    state.slice_ms == slice_ms
        && state.created == entry.created
        && state.version == entry.version
        && state.dynamic == dynamic
        && reach(state) >= now_ms + cfg.ahead_ms(slice_ms)
        && !refresh_due(state.refreshed_ms, now_ms, refresh_every(state, cfg))
}

/// How often this task's fence is refreshed: [`RollConfig::lazy_refresh_ms`] while lazy.
fn refresh_every(state: &TaskRollState, cfg: &RollConfig) -> i64 {
    if state.lazy.is_some() {
        cfg.lazy_refresh_ms()
    } else {
        cfg.refresh_every_ms()
    }
}

/// Whether a quiet lazy task is probed this tick: a fresh host reports using it (`in_use`), or
/// [`RollConfig::lazy_refresh_ms`] passed since its last probe (a worker that has not reported
/// yet, or does not report: its traffic wakes the task within that), or the leader's clock
/// stepped back past it.
pub fn lazy_probe_due(state: &TaskRollState, in_use: bool, now_ms: i64, cfg: &RollConfig) -> bool {
    in_use || refresh_due(state.probed_ms, now_ms, cfg.lazy_refresh_ms())
}

/// Until when (leader clock, ms) a quiet lazy task needs no visit (pure): every tick before it
/// finds it [`quiet`] and its probe not due ([`lazy_probe_due`] with no host using it), as long
/// as its spec, its dynamic override and the hosts' use of it stay as they are and the clock
/// does not step back (the roller visits it at once when one of them changes). `None`: it is
/// not lazy, or has no such instant ahead of `now_ms` (visited every tick).
///
/// Issue 27: the roller keeps these in a due-queue instead of visiting 100,000 idle tasks
/// every tick to find them not due.
pub fn lazy_asleep_until(
    state: &TaskRollState,
    entry: &TaskEntry,
    now_ms: i64,
    cfg: &RollConfig,
) -> Option<i64> {
    state.lazy?;
    if now_ms < state.refreshed_ms || now_ms < state.probed_ms {
        return None;
    }
    let every = cfg.lazy_refresh_ms();
    let until = (reach(state) - cfg.ahead_ms(entry.spec.slice_ms.max(1)) + 1)
        .min(state.refreshed_ms.saturating_add(every))
        .min(state.probed_ms.saturating_add(every));
    (until > now_ms).then_some(until)
}

/// How far ahead the task is decidable: its last slice written, or a lazy window's end.
fn reach(state: &TaskRollState) -> i64 {
    state
        .lazy
        .map_or(state.rolled_to, |l| l.until_ms.max(state.rolled_to))
}

/// How far before the leader's clock a lazy window starts at least (ms; else a horizon back):
/// slices a worker whose clock is behind may still ask for. The cap is checked constant over
/// it too.
pub const LAZY_BACK_MS: i64 = 5_000;

/// How long a new leadership's read of which tasks were lazy may take in all.
const READ_LAZY_TIMEOUT: Duration = Duration::from_secs(30);

/// The first protocol whose workers make a lazy task's slices.
pub const LAZY_PROTOCOL: u32 = 5;

/// Workers of a protocol before [`LAZY_PROTOCOL`], as one read of `NS:hosts` found them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OldHosts {
    /// Fresh hosts (seen within [`crate::skew::HOST_FRESH_MS`] by the leader's clock) that
    /// report no `proto`, or one below 5, sorted.
    pub hosts: Vec<String>,
    /// The tasks those hosts report using.
    pub tasks: HashSet<String>,
    /// The tasks any fresh host reports using (of any protocol): a quiet lazy task among them
    /// is probed every tick, the others every [`RollConfig::lazy_refresh_ms`].
    pub used: HashSet<String>,
    /// When it was read (leader clock, ms).
    pub read_ms: i64,
}

/// Which fresh hosts of `NS:hosts` (raw entries) speak a protocol before 5, and the tasks they
/// use (pure). Freshness is on the leader's clock: the host's `seen_ms` less its offset.
/// Entries that do not parse are left out (the leader prunes them).
///
/// ```
/// use sluice_manager::roller::old_workers;
/// let now = 1_000_000;
/// let e = |seen: i64, offset: f64, proto: &str| format!(
///     r#"{{"offset_ms": {offset}, "rtt_ms": 1, "seen_ms": {seen}, "sdk": "x", "tasks": {{"t": "normal"}}{proto}}}"#);
/// let o = old_workers(vec![
///     ("new".into(), e(now, 0.0, r#", "proto": 5"#)),
///     ("old".into(), e(now, 0.0, "")),
///     // 90 s behind, reporting now: fresh by the leader's clock.
///     ("behind".into(), e(now - 90_000, -90_000.0, r#", "proto": 4"#)),
///     ("gone".into(), e(now - 120_000, 0.0, "")),
///     ("garbage".into(), "{".into()),
/// ], now);
/// assert_eq!(o.hosts, ["behind", "old"]);
/// assert!(o.tasks.contains("t") && o.used.contains("t"));
/// ```
pub fn old_workers(raw: Vec<(String, String)>, now_ms: i64) -> OldHosts {
    let mut out = OldHosts {
        read_ms: now_ms,
        ..OldHosts::default()
    };
    for (h, r) in crate::skew::split_hosts(raw, now_ms).reports {
        let seen = r.seen_ms.saturating_sub(r.offset_ms as i64);
        let fresh = now_ms.saturating_sub(seen).saturating_abs() <= crate::skew::HOST_FRESH_MS;
        if !fresh {
            continue;
        }
        if r.proto.unwrap_or(0) < LAZY_PROTOCOL {
            out.tasks.extend(r.tasks.keys().cloned());
            out.hosts.push(h);
        }
        out.used.extend(r.tasks.into_keys());
    }
    out.hosts.sort();
    out
}

/// Whether workers of `mode` make a lazy task's slices (PULL, TAKE, SLIDE do; keyed tasks'
/// KPULL does not yet, and mode `local` counts traffic only through flushes, which never
/// make a slice: both are always rolled ahead, as `concurrency` has no slices at all).
pub fn may_be_lazy(entry: &TaskEntry) -> bool {
    !entry.spec.keyed
        && matches!(
            entry.spec.mode,
            Mode::Pooled | Mode::ExactFixed | Mode::ExactSliding
        )
}

/// Plans leaving the task lazy (pure; `--lazy-after`, issue 27): no slice written, its meta
/// vouches for every slice from a horizon back (at least [`LAZY_BACK_MS`]) to the window's end
/// (the reach an eager write would have), with the fence refreshed. `None` when it may not be
/// lazy now: its mode cannot ([`may_be_lazy`]); not lazy yet, it had traffic (or was rolled
/// ahead) less than `lazy_after_ms` before `now_ms` (`seen`: the harvester's, `None` = not yet
/// harvested); lazy already, the harvester found traffic since it went lazy (it skips lazy
/// tasks, so this is only its catch-up from before the task went lazy: the roller's probe of
/// the slices workers made is what wakes a lazy task); what was written is not this spec version with this
/// dynamic override (a change is written ahead first, the whole window); or the cap is not the
/// same for every slice of the window (a schedule changes it: the task stays rolled ahead
/// around the change).
pub fn plan_lazy(
    state: &TaskRollState,
    entry: &TaskEntry,
    dynamic: Option<u64>,
    now_ms: i64,
    cfg: &RollConfig,
    seen: Option<Seen>,
    lazy_after_ms: i64,
) -> Option<Plan> {
    let idle = match state.lazy {
        // Not harvested yet (a new leadership's first pass over many tasks): no traffic known.
        Some(_) => seen
            .and_then(|s| s.traffic_ms)
            .is_none_or(|t| t <= state.lazy_since),
        None => seen.is_some_and(|s| now_ms - s.busy_ms.max(state.eager_ms) >= lazy_after_ms),
    };
    if lazy_after_ms <= 0
        || !idle
        || state.version != entry.version
        || state.created != entry.created
        || state.slice_ms != entry.spec.slice_ms.max(1)
        || state.dynamic != dynamic
    {
        return None;
    }
    let lazy = lazy_window(state.lazy, entry, dynamic, now_ms, cfg)?;
    let mut next = state.clone();
    let len = entry.spec.slice_ms.max(1) as i64;
    next.caps.retain(|s, _| *s + len > now_ms);
    next.refreshed_ms = now_ms;
    // Already lazy: the refresh's call is also its probe (`probe_from` the last one; see
    // [`scripts::roll_watching`]), so from now on the two come due together, one round trip
    // per period instead of two.
    next.probed_ms = now_ms;
    let mut probe_from = state.probed_ms.min(now_ms);
    if state.lazy.is_none() {
        probe_from = now_ms;
        next.lazy_since = now_ms;
        // Tasks that went idle together (created together, a load test's end) refresh and are
        // probed spread over the period rather than all in one tick (earlier is always safe).
        let spread = refresh_spread(&entry.name, cfg.lazy_refresh_ms());
        next.refreshed_ms = now_ms - spread;
        next.probed_ms = now_ms - spread;
    }
    next.lazy = Some(lazy);
    Some(Plan {
        full: false,
        write_meta: false,
        refresh: true,
        slices: Vec::new(),
        expect_rolled_to: state.rolled_to,
        new_rolled_to: state.rolled_to,
        next,
        unchanged: false,
        lazy: Some(lazy),
        probe_from,
    })
}

/// Plans a new leadership's first write of a task the previous leader had left lazy (pure): in
/// full (meta, fence) but lazy, instead of writing every idle task's whole window at once (at
/// 100,000 tasks, millions of slices in one tick). `rolled_to` becomes the current slice's
/// start, so the probe watches the current and next slice: a task with traffic is woken within
/// a tick (and its slices' caps then rewritten, as a full write would have). `None` when the
/// task may not be lazy (mode, or a cap that changes inside the window).
pub fn plan_lazy_full(
    entry: &TaskEntry,
    dynamic: Option<u64>,
    now_ms: i64,
    cfg: &RollConfig,
) -> Option<Plan> {
    let lazy = lazy_window(None, entry, dynamic, now_ms, cfg)?;
    let slice_ms = entry.spec.slice_ms.max(1);
    let rolled_to = slice::start(now_ms, slice_ms);
    Some(Plan {
        full: true,
        write_meta: true,
        refresh: true,
        slices: Vec::new(),
        expect_rolled_to: 0,
        new_rolled_to: rolled_to,
        next: TaskRollState {
            version: entry.version,
            created: entry.created,
            slice_ms,
            dynamic,
            rolled_to,
            refreshed_ms: now_ms - refresh_spread(&entry.name, cfg.lazy_refresh_ms()),
            caps: BTreeMap::new(),
            lazy: Some(lazy),
            lazy_since: now_ms,
            eager_ms: 0,
            tail: None,
            probed_ms: now_ms - refresh_spread(&entry.name, cfg.lazy_refresh_ms()),
        },
        unchanged: false,
        lazy: Some(lazy),
        probe_from: now_ms,
    })
}

/// The lazy window of `entry` at `now_ms` (see [`plan_lazy`]); `prev` is the window written
/// last for the same version and override, whose cap check is not repeated. `None` when the
/// task's mode cannot be lazy or its cap is not the same over the whole window.
fn lazy_window(
    prev: Option<LazyWindow>,
    entry: &TaskEntry,
    dynamic: Option<u64>,
    now_ms: i64,
    cfg: &RollConfig,
) -> Option<LazyWindow> {
    if !may_be_lazy(entry) {
        return None;
    }
    let slice_ms = entry.spec.slice_ms.max(1);
    let len = slice_ms as i64;
    // From a horizon back (at least a slice and [`LAZY_BACK_MS`]): a worker names its slice by
    // its clock (or Redis's), which may be behind this leader's, and an eager task would have
    // the slices written earlier for it.
    let back = cfg.ahead_ms(slice_ms).max(len).max(LAZY_BACK_MS);
    let from = slice::start(now_ms - back, slice_ms);
    // As far as an eager write reaches (at least a slice past the horizon, so a task whose
    // step is 0 is not rewritten every tick).
    // A lazy window is refreshed every [`RollConfig::lazy_refresh_ms`]: it reaches that much
    // past the horizon.
    let step = roll_step_ms(cfg.horizon, slice_ms)
        .max(len)
        .max(cfg.lazy_refresh_ms());
    // Not capped at MAX_SLICES_AHEAD slices as an eager write is (no key is written ahead, and
    // workers make only slices near Redis's now): capped, a horizon of 3,600 slices or more
    // would leave no refresh period past it, and every lazy task would be refreshed every tick.
    let until = now_ms + cfg.ahead_ms(slice_ms) + step;
    let cap = effective_threshold(entry, dynamic, from);
    // Only what the last window (same version, override and cap) did not cover is checked:
    // a schedule's cron is evaluated for a few slices per refresh, not the whole window.
    let checked_to = prev
        .filter(|p| p.cap == cap && p.from_ms <= from)
        .map_or(from, |p| p.until_ms.max(from));
    let constant = dynamic.is_some()
        || entry.schedule.is_empty()
        || slice::starts(checked_to, until, slice_ms)
            .all(|s| effective_threshold(entry, dynamic, s) == cap);
    if !constant {
        return None;
    }
    // The end of the last slice starting before `until` (not a walk over the window).
    if until <= from {
        return None;
    }
    let end = slice::start(until - 1, slice_ms) + len;
    Some(LazyWindow {
        cap,
        from_ms: from,
        until_ms: end,
        expire_after_ms: cfg.retention.as_millis() as u64,
        fence_ttl_ms: cfg.lazy_fence_ttl_ms(),
    })
}

/// Whether the fence is due for a refresh: `refresh_every` since the last, or the leader's
/// clock stepped back past it (the fence must not go stale while the clock catches up).
fn refresh_due(refreshed_ms: i64, now_ms: i64, refresh_every: i64) -> bool {
    now_ms - refreshed_ms >= refresh_every || now_ms < refreshed_ms
}

/// How much earlier than `now` a task's first write counts its fence refresh, so that the
/// refreshes (and the window's steps that ride on them) of a leadership's tasks, all written
/// at once, spread over the refresh period instead of landing in one tick (an earlier refresh
/// is always safe).
fn refresh_spread(name: &str, refresh_every: i64) -> i64 {
    // FNV-1a: stable across runs and platforms.
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    (h % refresh_every.max(1) as u64) as i64
}

/// When a lazy task probed at `now_ms` counts as probed: the last instant at or before it on
/// the task's own grid of `every` (phased by name), so that the probes of tasks probed together
/// (all of them after Redis lost its keys) spread over the period again instead of coming due
/// in one tick from then on; in steady state a task is probed every `every` exactly. Earlier
/// is always safe (the next probe comes sooner, and looks back further).
///
/// ```
/// # use sluice_manager::roller::probe_phase;
/// let p = probe_phase("t", 1_000_000, 30_000);
/// assert!(p <= 1_000_000 && p > 1_000_000 - 30_000);
/// // Probed when due, it is due again a whole period later.
/// assert_eq!(probe_phase("t", p + 30_000, 30_000), p + 30_000);
/// ```
pub fn probe_phase(name: &str, now_ms: i64, every: i64) -> i64 {
    let every = every.max(1);
    now_ms - (now_ms - refresh_spread(name, every)).rem_euclid(every)
}

/// Plans the writes for one task at `now_ms` (pure).
///
/// A task whose `slice_ms` changed (or that was deleted and created again) is planned in full:
/// every slice of the new grid in the window is sent; the script leaves those that already
/// hold the right cap alone and extends the expiry of keys the old grid shares with the new
/// one (same start). Keys of the old grid that are not on the new one are never read by a
/// worker of the new grid and just expire.
///
/// ```
/// # use sluice_manager::roller::*;
/// # use sluice_manager::tasks::TaskEntry;
/// # use sluice_manager::spec::parse_request;
/// # use std::sync::Arc; use std::time::Duration;
/// let spec = parse_request("t", br#"{"threshold": 100, "slice_ms": 1000}"#).unwrap().spec;
/// let entry = TaskEntry { name: "t".into(), schedule: Arc::default(), spec, version: 5, created: 5 };
/// let cfg = RollConfig { horizon: Duration::from_secs(10), retention: Duration::from_secs(60),
///                        tick: Duration::from_millis(500), fence_stale_after: Duration::from_secs(10) };
/// // A new leader writes the whole window, the horizon and a step (1,666 ms) past it:
/// // slices 1000..=13000, meta included.
/// let p = plan(&TaskRollState::default(), &entry, None, 1_500, &cfg, true);
/// assert_eq!(p.slices.len(), 13);
/// assert!(p.write_meta);
/// assert_eq!(p.new_rolled_to, 14_000);
/// // Half a second later nothing is new: the task is only probed.
/// let q = plan(&p.next, &entry, None, 2_000 - 1, &cfg, false);
/// assert!(q.slices.is_empty() && !q.write_meta && !q.refresh);
/// // Nor while a whole horizon is still written ahead and the fence is fresh.
/// let q = plan(&p.next, &entry, None, 2_700, &cfg, false);
/// assert!(q.slices.is_empty() && !q.refresh);
/// // Then the window grows by a step, here with the fence's refresh (due every quarter of
/// // `fence_stale_after`; this task's first one comes early, as refreshes are spread by name).
/// let r = plan(&p.next, &entry, None, 2_800, &cfg, false);
/// assert!(r.refresh);
/// assert_eq!(r.slices.iter().map(|s| s.start_ms).collect::<Vec<_>>(), [14_000]);
/// assert_eq!(r.new_rolled_to, 15_000);
/// ```
pub fn plan(
    state: &TaskRollState,
    entry: &TaskEntry,
    dynamic: Option<u64>,
    now_ms: i64,
    cfg: &RollConfig,
    full: bool,
) -> Plan {
    let slice_ms = entry.spec.slice_ms.max(1);
    let len = slice_ms as i64;
    let full = full || state.slice_ms != slice_ms || state.created != entry.created;
    let current = slice::start(now_ms, slice_ms);
    let ahead = cfg.ahead_ms(slice_ms);
    // The window is extended in steps: while a whole horizon is still written nothing new
    // enters it; once it is not, it grows to a step past the horizon (issue 27). A call that
    // refreshes the fence anyway extends the window too: with the default
    // `--fence-stale-after` that is every 2.5 s, so a task of 1 s slices costs one call every
    // 2.5 s writing two or three slices, not one call a second.
    let refresh_every = cfg.refresh_every_ms();
    let refresh_due = refresh_due(state.refreshed_ms, now_ms, refresh_every);
    let until = if !full && !refresh_due && state.rolled_to >= now_ms + ahead {
        // Capped like the extension below: a leader clock stepped back (it wrote ahead of
        // today's time) must not recompute or write a window of more than the cap.
        state.rolled_to.min(now_ms + len * MAX_SLICES_AHEAD)
    } else {
        now_ms + (ahead + roll_step_ms(cfg.horizon, slice_ms)).min(len * MAX_SLICES_AHEAD)
    };
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
        // A concurrency task has meta and fence but no slices: its threshold is permits in
        // flight, leased from `NS:{T}:lease` against the meta's threshold.
        // A new spec version resends every slice: the script copies the task's pacing
        // (`pace`, `burst`) into each slice it is given, so a pacing change reaches slices
        // already written (it leaves caps that did not change alone).
        let respec = state.version != entry.version;
        if (full || respec || known != Some(cap)) && entry.spec.mode != Mode::Concurrency {
            slices.push(SliceWrite {
                start_ms: start,
                cap,
                expire_at_ms: slice::end(start, slice_ms) + retention,
            });
        }
        caps.insert(start, cap);
    }
    let window_end = caps.keys().next_back().map(|s| s + len);
    let new_rolled_to = match window_end {
        // A full write sets rolled_to to the new window's end (another grid's may be later).
        Some(end) if full => end,
        Some(end) => end.max(state.rolled_to),
        None => state.rolled_to,
    };
    let refresh = full || refresh_due;
    let fenced_now = refresh || new_rolled_to > state.rolled_to;
    Plan {
        full,
        write_meta: full || state.version != entry.version,
        refresh,
        slices,
        expect_rolled_to: state.rolled_to,
        new_rolled_to,
        next: TaskRollState {
            version: entry.version,
            created: entry.created,
            slice_ms,
            dynamic,
            rolled_to: new_rolled_to,
            refreshed_ms: if full {
                now_ms - refresh_spread(&entry.name, refresh_every)
            } else if fenced_now {
                now_ms
            } else {
                state.refreshed_ms
            },
            caps,
            lazy: None,
            eager_ms: if full || state.lazy.is_some() {
                now_ms
            } else {
                state.eager_ms
            },
            lazy_since: 0,
            tail: None,
            probed_ms: 0,
        },
        unchanged: false,
        // A lazy (or just woken) task's window before the slices written now, unless its cap
        // may have changed (a new version or dynamic threshold) or the write is in full: a
        // worker whose clock is behind still makes the slices before the current one.
        lazy: state
            .tail
            .or(state.lazy)
            .map(|l| LazyWindow {
                until_ms: current.clamp(l.from_ms, l.until_ms),
                // Rolled ahead: the fence is refreshed as any eager task's again.
                fence_ttl_ms: 0,
                ..l
            })
            .filter(|t| !recompute && t.until_ms > t.from_ms && t.until_ms <= current),
        probe_from: now_ms,
    }
}

/// Counts of one tick.
#[derive(Debug, Default, Clone, Copy)]
pub struct TickStats {
    /// Script calls.
    pub calls: u64,
    /// Tasks with nothing to write answered by the one-`HMGET` probe instead of a script call
    /// ([`scripts::roll_probe`]).
    pub probes: u64,
    /// Slices created or changed.
    pub written: u64,
    /// Failed calls.
    pub errors: u64,
    /// Tasks rewritten whole because Redis had lost them.
    pub healed: u64,
    /// Tasks skipped because another epoch (or etcd history) holds their fence.
    pub conflicts: u64,
    /// Lazy tasks rolled ahead again because a worker made one of their slices.
    pub woken: u64,
    /// Tasks visited (the others were quiet lazy tasks not due, [`lazy_asleep_until`]).
    pub visited: u64,
}

/// A task whose fence another writer holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Conflict {
    /// The task.
    pub task: String,
    /// Why.
    pub refusal: FenceRefusal,
}

/// The leader's rolling state and loop.
pub struct Roller {
    keys: Keys,
    redis: Arc<Redis>,
    cfg: RollConfig,
    metrics: Arc<Metrics>,
    alerts: AlertTx,
    state: HashMap<String, TaskRollState>,
    conflicts: Vec<Conflict>,
    last_conflict_log: Option<Instant>,
    /// The namespace's key-label secret, written into the meta of keyed tasks that do not
    /// show their keys in clear (`None`: not loaded; the SDKs then store bare digests).
    key_secret: Option<sluice_protocol::KeySecret>,
    /// Names known to be in the registry (`NS:tasks`) this leadership.
    registered: HashSet<String>,
    /// Tasks whose state this leadership dropped while they were still in etcd (a newer term
    /// of another etcd history refused them, a newer spec is stored, Redis lost them): should
    /// one leave etcd before it is written again, it is retired all the same (it was in no
    /// list the roller retires from). Not those another cluster's fence refused (not ours to
    /// retire). At most the tasks in etcd; a name leaves on its next write or its retire.
    forgotten: HashSet<String>,
    /// Where the registry stands this leadership.
    reconcile: Reconcile,
    /// `--lazy-after` (ms; 0 = never) and when each task last had traffic.
    lazy_after_ms: i64,
    activity: crate::history::Activity,
    /// Tasks the previous leadership left lazy (read once, before this one's first writes):
    /// their first write is lazy too ([`plan_lazy_full`]).
    was_lazy: HashSet<String>,
    /// Whether `was_lazy` was read this leadership.
    lazy_read: bool,
    /// The etcd revision of the snapshot `was_lazy` was read for: a task created after it is
    /// new, and starts lazy too (nothing has asked for it yet).
    lazy_new_after: Option<i64>,
    /// What the last read of `NS:hosts` found of workers that speak a protocol before 5 (they
    /// cannot make a lazy task's slices). `None`: not read yet (no task is left lazy).
    old_hosts: Option<Arc<OldHosts>>,
    /// When `NS:hosts` was last read (leader clock, ms).
    hosts_read_ms: i64,
    /// The lazy tasks published to the harvester and the skew detector (through `activity`).
    published_lazy: HashSet<String>,
    /// Which walks over every task a tick must redo.
    dirty: Dirty,
    /// The snapshot (revision, tasks, invalid specs) the walks were last redone for: a new one
    /// redoes them all.
    walked: Option<(i64, usize, usize)>,
    /// When every lazy task was last probed because the task registry was missing or a task
    /// was healed (leader clock, ms).
    probed_all_ms: i64,
    /// The last tick healed a task Redis had lost.
    healed_last_tick: bool,
    /// The single Redis server's `run_id` as last read (a new one: it restarted, or another
    /// server answers now).
    redis_run_id: Option<String>,
    /// When Redis's ACL last refused `INFO server` (see `redis_run_id`; asked again after
    /// [`INFO_RETRY_MS`]).
    info_refused_ms: Option<i64>,
    /// A reply of `INFO server` without `run_id` was logged.
    run_id_missing_logged: bool,
    /// Redis lost data (the registry missing, a new `run_id`, a task healed): the tasks rolled
    /// ahead are probed every tick until one ends without an error.
    probe_eager_pending: bool,
    /// Redis lost tasks (the registry missing, a task healed) since the last probe of every
    /// task: one is due as soon as the rate limit allows.
    probe_all_pending: bool,
    /// Quiet lazy tasks the ticks skip until something is due ([`lazy_asleep_until`]).
    sleep: Sleep,
}

/// Where [`Roller::tick`] reads etcd's current revision (only when a stored number may come
/// from another etcd history): the task store, or a simulated etcd.
pub trait CurrentRevision {
    /// etcd's revision now.
    fn current_revision(&self) -> impl std::future::Future<Output = Result<i64>> + Send;
}

impl CurrentRevision for TaskStore {
    async fn current_revision(&self) -> Result<i64> {
        TaskStore::current_revision(self).await
    }
}

/// The roller's due-queue of quiet lazy tasks (issue 27: at 100,000 idle tasks, visiting each
/// every tick to find it not due was most of the leader's CPU). A tick visits the tasks awake,
/// the sleepers whose time came, and those woken early: a host reports using it (or workers of
/// an old protocol do), its dynamic override changed, a new snapshot changed its spec. Anything
/// else that could make a sleeper due (Redis losing the tasks, the clock stepping back, a tick
/// cut short, a snapshot that changed many tasks) makes the next tick visit every task and
/// rebuild the queue.
#[derive(Debug, Default)]
struct Sleep {
    /// Each task asleep: (until, its reach) — the reach for the horizon metric.
    asleep: HashMap<String, (i64, i64)>,
    /// The same, ordered by `until`; an entry whose `until` is not `asleep`'s is stale.
    queue: BinaryHeap<Reverse<(i64, String)>>,
    /// The snapshot's tasks not asleep, visited every tick (while `valid`).
    awake: Vec<Arc<TaskEntry>>,
    /// The dynamic overrides of the last complete tick: a change wakes the task.
    dynamic: HashMap<String, (i64, u64)>,
    /// The leader's clock at the last complete tick.
    last_now: i64,
    /// The snapshot the above hold for.
    snap: Option<Arc<TaskSnapshot>>,
    /// Tasks a new snapshot added, changed or removed: visited (or forgotten) at the next
    /// complete tick (a set: snapshots may follow one another while ticks fail).
    changed: HashSet<String>,
    /// The above hold for `snap`; false: the next tick visits every task.
    valid: bool,
}

/// A snapshot that changed more tasks than this (or a tenth of them) is followed by a visit of
/// every task rather than a diff.
const SLEEP_DIFF_MAX: usize = 10_000;

impl Sleep {
    /// Forgets everything: the next tick visits every task.
    fn reset(&mut self) {
        self.asleep.clear();
        self.queue.clear();
        self.awake.clear();
        self.changed.clear();
        self.valid = false;
    }

    /// Takes `name` out of the queue; true when it was asleep.
    fn wake(&mut self, name: &str) -> bool {
        self.asleep.remove(name).is_some()
    }

    /// Follows a new snapshot: the tasks it added, changed or removed (entries not shared
    /// with the last one, compared by pointer in one ordered walk of both) are taken out of
    /// the queue and visited next tick; `awake` is re-pointed at the new entries. Too many
    /// changes, or nothing to diff against: the next tick visits every task.
    fn follow(&mut self, snap: &Arc<TaskSnapshot>) {
        let Some(prev) = self.snap.as_ref() else {
            self.valid = false;
            return;
        };
        if Arc::ptr_eq(prev, snap) || !self.valid {
            return;
        }
        let limit = SLEEP_DIFF_MAX.min(snap.tasks.len() / 10 + 1);
        let mut changed: Vec<String> = Vec::new();
        let (mut a, mut b) = (prev.tasks.iter().peekable(), snap.tasks.iter().peekable());
        loop {
            // Checked at every step: tasks added or removed at the end count too.
            if changed.len() + self.changed.len() > limit {
                self.valid = false;
                return;
            }
            let step = match (a.peek(), b.peek()) {
                (None, None) => break,
                (Some((n, _)), None) => {
                    changed.push((*n).clone());
                    a.next();
                    continue;
                }
                (None, Some((n, _))) => {
                    changed.push((*n).clone());
                    b.next();
                    continue;
                }
                (Some((na, ea)), Some((nb, eb))) => {
                    if Arc::ptr_eq(ea, eb) {
                        std::cmp::Ordering::Equal
                    } else {
                        na.cmp(nb)
                    }
                }
            };
            match step {
                std::cmp::Ordering::Less => {
                    changed.extend(a.next().map(|(n, _)| n.clone()));
                }
                std::cmp::Ordering::Greater => {
                    changed.extend(b.next().map(|(n, _)| n.clone()));
                }
                std::cmp::Ordering::Equal => {
                    let (x, y) = (a.next(), b.next());
                    if let (Some((n, ea)), Some((_, eb))) = (x, y)
                        && !Arc::ptr_eq(ea, eb)
                    {
                        changed.push(n.clone());
                    }
                }
            }
        }
        if changed.len() + self.changed.len() > limit {
            self.valid = false;
            return;
        }
        for n in &changed {
            self.wake(n);
        }
        self.awake = std::mem::take(&mut self.awake)
            .into_iter()
            .filter_map(|e| snap.tasks.get(&e.name).cloned())
            .collect();
        self.changed.extend(changed);
        self.snap = Some(snap.clone());
    }
}

/// Which of a tick's walks over every task must be redone: each only when the snapshot
/// changed or what it depends on did (issue 27: at 100,000 tasks, walking them all every tick
/// was most of the leader's CPU).
#[derive(Debug, Clone, Copy)]
struct Dirty {
    /// Tasks in the state but not in the snapshot (to retire) may exist.
    gone: bool,
    /// Tasks of the snapshot may be missing from the registry.
    register: bool,
    /// A task became lazy or stopped being lazy since the last publication.
    lazy: bool,
}

impl Dirty {
    const ALL: Self = Self {
        gone: true,
        register: true,
        lazy: true,
    };
}

/// The registry's state in a leadership.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reconcile {
    /// Not looked at yet: is it complete?
    Unknown,
    /// Being filled by a `SCAN` of the metas (cursor): managers before the registry never
    /// filled it.
    Filling(u64),
    /// Being walked (`SSCAN` cursor).
    Walking(u64),
    /// Walked.
    Done,
}

/// What to do with a task this round.
#[derive(Debug, Clone, Copy, Default)]
struct Attempt {
    full: bool,
    force: bool,
    /// Written ahead even if it may be lazy: Redis refused a lazy full write (`NotLazy`).
    eager: bool,
}

impl Attempt {
    /// A full write over numbers of another etcd history.
    const FORCED: Self = Self {
        full: true,
        force: true,
        eager: true,
    };
}

impl Roller {
    /// A roller with no memory (a new leadership).
    pub fn new(
        keys: Keys,
        redis: Arc<Redis>,
        cfg: RollConfig,
        metrics: Arc<Metrics>,
        alerts: AlertTx,
    ) -> Self {
        Self {
            keys,
            redis,
            cfg,
            metrics,
            alerts,
            state: HashMap::new(),
            conflicts: Vec::new(),
            last_conflict_log: None,
            key_secret: None,
            registered: HashSet::new(),
            forgotten: HashSet::new(),
            reconcile: Reconcile::Unknown,
            lazy_after_ms: 0,
            activity: crate::history::Activity::default(),
            was_lazy: HashSet::new(),
            lazy_read: false,
            lazy_new_after: None,
            old_hosts: None,
            hosts_read_ms: i64::MIN,
            published_lazy: HashSet::new(),
            dirty: Dirty::ALL,
            walked: None,
            probed_all_ms: i64::MIN,
            healed_last_tick: false,
            redis_run_id: None,
            info_refused_ms: None,
            run_id_missing_logged: false,
            probe_eager_pending: false,
            probe_all_pending: false,
            sleep: Sleep::default(),
        }
    }

    /// Leaves tasks without traffic for `after` lazy ([`plan_lazy`]), by the traffic the
    /// harvester publishes into `activity`. `None`: never.
    pub fn with_lazy(
        mut self,
        after: Option<Duration>,
        activity: crate::history::Activity,
    ) -> Self {
        self.lazy_after_ms = after.map_or(0, |d| d.as_millis() as i64);
        self.activity = activity;
        self
    }

    /// The namespace's key-label secret (see [`sluice_protocol::key_label`]).
    pub fn with_key_secret(mut self, secret: Option<sluice_protocol::KeySecret>) -> Self {
        self.key_secret = secret;
        self
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
                // milliseconds, not a tick (within 100 ms in a burst of changes, which the
                // task watch publishes together).
                r = tasks.changed() => if r.is_err() { return },
            }
            let snap = store.snapshot();
            if !snap.loaded {
                continue;
            }
            let overrides = dynamic.current();
            let started = Instant::now();
            match self.tick(&ctx, &store, &snap, &overrides).await {
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

    /// Maps a refusal: `Err(Fenced)` when a newer leader of this etcd history holds the task
    /// (`this_history`: step down), else the task is recorded as a conflict and skipped; with
    /// `forget`, what was written is forgotten (once the fence is ours again, the task is
    /// written in full).
    fn refused(
        &mut self,
        ctx: &LeaderContext,
        task: &str,
        refusal: FenceRefusal,
        this_history: bool,
        forget: bool,
    ) -> Result<()> {
        if let FenceRefusal::Newer { term, .. } = refusal
            && this_history
        {
            self.metrics.fenced.inc();
            return Err(Error::Fenced {
                task: task.to_string(),
                term: ctx.term(),
                current: term,
            });
        }
        if forget {
            self.state.remove(task);
            // Another cluster's fence: a task it writes is not this cluster's to retire, as
            // the registry walk leaves it alone (`Orphan::Foreign`); ours otherwise.
            if !matches!(refusal, FenceRefusal::Foreign { .. }) {
                self.forgotten.insert(task.to_string());
            }
            self.dirty.lazy = true;
        }
        self.conflicts.push(Conflict {
            task: task.to_string(),
            refusal,
        });
        Ok(())
    }

    /// One pass over the tasks awake and those due (every task after a change it cannot
    /// follow, see `Sleep`). Returns `Err(Fenced)` if a newer leader of this etcd history
    /// refused a write.
    pub async fn tick(
        &mut self,
        ctx: &LeaderContext,
        store: &impl CurrentRevision,
        snap: &Arc<TaskSnapshot>,
        dynamic: &HashMap<String, (i64, u64)>,
    ) -> Result<TickStats> {
        let mut stats = TickStats::default();
        self.conflicts.clear();
        let seen = (snap.revision, snap.tasks.len(), snap.invalid.len());
        if self.walked != Some(seen) {
            self.dirty = Dirty::ALL;
            self.walked = Some(seen);
        }
        self.sleep.follow(snap);
        let conn = self.redis.conn().await.map_err(redis_err("connect"))?;
        let now = unix_ms();
        let fence = ctx.fence();
        // etcd's revision now, read at most once per tick and only when a stored number may
        // come from another etcd history (above it). Unknown (etcd unreachable): no.
        let mut etcd_revision: Option<i64> = None;
        let mut other_history = async |n: i64| -> bool {
            if n <= ctx.known_revision() {
                return false;
            }
            if etcd_revision.is_none() {
                etcd_revision = store.current_revision().await.ok();
            }
            etcd_revision.is_some_and(|r| n > r)
        };

        // A new leadership first learns which tasks Redis holds that etcd no longer has
        // (deleted while no leader ran): they join the tasks to retire below.
        if self.reconcile != Reconcile::Done {
            match self.reconcile_step(&conn, snap, ctx.epoch()).await {
                Ok(next) => self.reconcile = next,
                Err(e) => {
                    warn!(%e, "reconciling the task registry failed; will retry");
                    stats.errors += 1;
                }
            }
        }

        // Tasks gone from etcd: retire their meta (keeps the fence) and state, forget them.
        // A stored spec that fails validation is not gone: it is neither rolled nor retired.
        let gone: Vec<String> = if self.dirty.gone {
            // Forgotten tasks gone from etcd are retired as known ones are; those still there
            // are kept in mind until they leave or this leadership ends.
            let left: Vec<String> = self
                .forgotten
                .iter()
                .filter(|n| !snap.contains(n))
                .cloned()
                .collect();
            for n in left {
                self.forgotten.remove(&n);
                self.state.entry(n).or_default();
            }
            // In name order: the same retires in the same order every run (the deterministic
            // simulation replays a seed bit for bit; a hash map's order is the process's).
            let mut gone: Vec<String> = self
                .state
                .keys()
                .filter(|n| !snap.contains(n))
                .cloned()
                .collect();
            gone.sort_unstable();
            gone
        } else {
            Vec::new()
        };
        if !gone.is_empty() {
            self.dirty.lazy = true;
        }
        let ttl = (self.cfg.horizon + self.cfg.retention).as_millis() as u64;
        // Looked for again next tick (those not retired now: refused, failed), until none.
        self.dirty.gone = !gone.is_empty();
        for name in gone {
            let mut force = false;
            for _attempt in 0..2 {
                if !ctx.is_valid() {
                    return Err(Error::NotLeader);
                }
                let mut c = conn.clone();
                let r =
                    scripts::retire(&mut c, &self.keys, &name, &fence, ttl, snap.revision, force)
                        .await;
                match r {
                    Ok(RetireOutcome::Retired) => {
                        info!(task = name, "task deleted: meta retired, state deleted");
                        self.state.remove(&name);
                        self.unregister(&conn, &name).await;
                    }
                    // Kept in the state: retried next tick, taken over once stale.
                    Ok(RetireOutcome::Refused(refusal)) => {
                        let ours = match &refusal {
                            FenceRefusal::Newer { term, .. } => !other_history(*term).await,
                            FenceRefusal::Foreign { .. } => false,
                        };
                        self.refused(ctx, &name, refusal, ours, false)?
                    }
                    Ok(RetireOutcome::Superseded { stored_version }) => {
                        if !force && other_history(stored_version).await {
                            force = true;
                            continue;
                        }
                        // Re-created (and written by someone) after the snapshot we hold.
                        debug!(task = name, stored_version, "task re-created; not retiring");
                        self.state.remove(&name);
                    }
                    Err(e) => {
                        warn!(task = name, %e, "retire failed; will retry");
                        stats.errors += 1;
                    }
                }
                break;
            }
        }

        // A Redis that lost everything (a restart without persistence, FLUSHALL: `NS:hosts`
        // gone too) is noticed by the task registry, which lives as long as a task does (one
        // command a tick): every task is registered again, and every lazy task (probed rarely
        // otherwise) is probed and healed this tick — at most every few seconds while the
        // registry stays missing (a Redis refusing the SADD).
        // A task healed last tick says the same (the registry may have been written again by
        // that heal before this check).
        let mut probe_all = false;
        // Eager tasks with nothing to write are probed only then (see below).
        let mut probe_eager = false;
        if !snap.tasks.is_empty() {
            let mut c = conn.clone();
            let mut cmd = redis::cmd("EXISTS");
            cmd.arg(self.keys.task_registry());
            // A single server also says which process it is: a restart that kept its data (RDB,
            // AOF: metas rewound to the snapshot) or a failover to a replica keeps the registry
            // but changes `run_id`, and tasks rolled ahead are not probed otherwise (their next
            // roll call would find them, up to a fence refresh later). Unknown when the ACL
            // refuses `INFO server` (asked again every few minutes); a Cluster node's loss, or
            // a failover back to the same process, is found task by task (documented). Sent
            // together with the registry's check (one round trip on the multiplexed link).
            let info = self.ask_run_id(&conn, now);
            let (registry, info) = tokio::join!(
                bounded("check the task registry", cmd.query_async::<i64>(&mut c)),
                info
            );
            let registry = registry.ok();
            let restarted = self.note_run_id(info, now);
            let lost = registry == Some(0) || restarted;
            // At most every few seconds (Redis evicting keys would heal tasks every tick); a
            // loss seen meanwhile is kept until then: one task healed by its own probe writes
            // the registry again, and the loss must not be forgotten with it (the CI run that
            // found 4 of 5 lazy tasks waiting for their periodic probe).
            // The tasks rolled ahead are probed until a tick ends without an error (the one that
            // saw the loss may fail: a Redis still loading its data answers INFO, not the probes).
            if lost || std::mem::take(&mut self.healed_last_tick) {
                self.probe_all_pending = true;
                self.probe_eager_pending = true;
            }
            probe_eager = self.probe_eager_pending;
            if self.probe_all_pending
                && (now.saturating_sub(self.probed_all_ms) >= crate::skew::HOSTS_READ_MS
                    || now < self.probed_all_ms)
            {
                self.probe_all_pending = false;
                self.probed_all_ms = now;
                self.registered.clear();
                self.dirty.register = true;
                probe_all = !self.published_lazy.is_empty();
            }
        } else {
            // No task to roll: still watch which process answers, so a restart from an older
            // dump (live metas of tasks retired since, back in the registry) walks the registry
            // again (the deterministic simulation found a leader with no task that never
            // learned a run_id, and a deleted task that stayed live after such a restart).
            let info = self.ask_run_id(&conn, now).await;
            self.note_run_id(info, now);
        }
        // Every task is in the registry before its meta can be written (a failure is retried
        // next tick; rolling goes on).
        if self.dirty.register {
            self.register(&conn, snap).await;
        }
        if self.lazy_after_ms > 0 {
            // Also when the clock stepped back past the last read.
            if now < self.hosts_read_ms
                || now.saturating_sub(self.hosts_read_ms) >= crate::skew::HOSTS_READ_MS
            {
                self.hosts_read_ms = now;
                self.check_hosts(&conn, now).await;
            }
            if !self.lazy_read {
                self.read_lazy(&conn, snap).await;
            }
            // Tasks that workers of a protocol before 5 use are rolled ahead (they cannot
            // make a lazy task's slices); the others stay lazy.
            if let Some(old) = self.old_hosts.clone() {
                for name in &old.tasks {
                    if let Some(st) = self.state.get_mut(name)
                        && st.wake(now)
                    {
                        stats.woken += 1;
                        self.dirty.lazy = true;
                        if self.sleep.wake(name) {
                            self.sleep.changed.insert(name.clone());
                        }
                        debug!(task = name, "lazy task rolled ahead: old workers use it");
                    }
                }
            }
        }
        // Whether a task may stay lazy (it is, or was under the previous leadership): the
        // setting is on, the hosts were read once, and no worker of a protocol before 5
        // reports using it (a verdict gone stale keeps what is lazy lazy). Whether a task may
        // become lazy: besides, the verdict is fresh and no worker of a protocol before 5
        // reports at all (one may start using any task before its next report).
        let lazy_on = self.lazy_after_ms > 0;
        let verdict = self.old_hosts.clone();
        let fresh = verdict
            .as_ref()
            .is_some_and(|o| now >= o.read_ms && now - o.read_ms <= 3 * crate::skew::HOSTS_READ_MS);
        let keep_ok =
            |name: &str| lazy_on && verdict.as_ref().is_some_and(|o| !o.tasks.contains(name));
        let new_ok = |name: &str| {
            keep_ok(name) && fresh && verdict.as_ref().is_some_and(|o| o.hosts.is_empty())
        };

        let in_use =
            |name: &str| probe_all || verdict.as_ref().is_none_or(|o| o.used.contains(name));
        // The tasks this tick visits: every one, or those awake and those due (see [`Sleep`]).
        // Until this tick completes, the next one visits every task.
        let visit_all =
            !self.sleep.valid || probe_all || now < self.sleep.last_now || self.lazy_after_ms == 0;
        self.sleep.valid = false;
        let visited: Vec<Arc<TaskEntry>> = if visit_all {
            self.sleep.reset();
            snap.tasks.values().cloned().collect()
        } else {
            let sleep = &mut self.sleep;
            let mut v = std::mem::take(&mut sleep.awake);
            // Changed by the snapshot: those not awake are visited (removed ones are not in it).
            let awake: HashSet<&str> = if sleep.changed.is_empty() {
                HashSet::new()
            } else {
                v.iter().map(|e| e.name.as_str()).collect()
            };
            let mut due: Vec<String> = std::mem::take(&mut sleep.changed)
                .into_iter()
                .filter(|n| !awake.contains(n.as_str()))
                .collect();
            drop(awake);
            while let Some(Reverse((at, _))) = sleep.queue.peek()
                && *at <= now
            {
                let Some(Reverse((at, name))) = sleep.queue.pop() else {
                    break;
                };
                if sleep.asleep.get(&name).is_some_and(|(u, _)| *u == at) {
                    sleep.asleep.remove(&name);
                    due.push(name);
                }
            }
            // Woken early: a host reports using it (probed every tick then), workers of an
            // old protocol use it (rolled ahead above), its dynamic override changed.
            if let Some(o) = &verdict {
                due.extend(o.used.iter().filter(|n| sleep.wake(n)).cloned());
            }
            if *dynamic != sleep.dynamic {
                let changed: Vec<String> = dynamic
                    .iter()
                    .filter(|(n, v)| sleep.dynamic.get(*n) != Some(*v))
                    .map(|(n, _)| n)
                    .chain(sleep.dynamic.keys().filter(|n| !dynamic.contains_key(*n)))
                    .cloned()
                    .collect();
                due.extend(changed.into_iter().filter(|n| sleep.wake(n)));
            }
            v.extend(due.iter().filter_map(|n| snap.tasks.get(n).cloned()));
            v
        };
        if *dynamic != self.sleep.dynamic {
            self.sleep.dynamic = dynamic.clone();
        }
        stats.visited = visited.len() as u64;
        // Quiet lazy tasks found not due: (name, until, reach).
        let mut sleepers: Vec<(String, i64, i64)> = Vec::new();
        let mut pending: Vec<(Arc<TaskEntry>, Attempt)> = visited
            .iter()
            .map(|e| (e.clone(), Attempt::default()))
            .collect();
        // Three rounds at most: the second resends in full what Redis had lost (or a fence
        // being taken over), the third forces numbers of another etcd history.
        for round in 0..3 {
            if pending.is_empty() {
                break;
            }
            // A task healed last round is registered again before its full write.
            if round > 0 && self.dirty.register {
                self.register(&conn, snap).await;
            }
            let jobs: Vec<(Arc<TaskEntry>, Attempt, Plan)> = pending
                .drain(..)
                .filter_map(|(entry, attempt)| {
                    let over = dynamic
                        .get(&entry.name)
                        .filter(|(inc, _)| *inc == entry.created)
                        .map(|(_, v)| *v);
                    let known = self.state.get(&entry.name);
                    if let Some(st) = known
                        && !attempt.full
                        && !attempt.force
                        && quiet(st, &entry, over, now, &self.cfg)
                    {
                        // A quiet lazy task is probed only when a host reports using it, or
                        // now and then (issue 27: a probe of 100,000 idle tasks every tick).
                        if st.lazy.is_some()
                            && !lazy_probe_due(st, in_use(&entry.name), now, &self.cfg)
                        {
                            if let Some(until) = lazy_asleep_until(st, &entry, now, &self.cfg) {
                                sleepers.push((entry.name.clone(), until, reach(st)));
                            }
                            return None;
                        }
                        // An eager task is not probed between its roll calls (issue 27: most
                        // of an eager task's round trips): its next one — a step of its window
                        // or its fence refresh, at most `--fence-stale-after / 4` away — finds
                        // what a probe would (a lost, rewound, retired or re-fenced meta) and
                        // heals it. A Redis that lost the task registry (everything) or
                        // answers with a new `run_id`, or a task healed last tick, has them
                        // probed, and healed, in the tick that sees it.
                        if st.lazy.is_none() && !probe_eager && !probe_all {
                            return None;
                        }
                        return Some((entry, attempt, Plan::probe(st)));
                    }
                    if known.is_none()
                        && !attempt.eager
                        && !attempt.force
                        && ((self.was_lazy.contains(&entry.name) && keep_ok(&entry.name))
                            || (self.lazy_new_after.is_some_and(|r| entry.created > r)
                                && new_ok(&entry.name)))
                        && let Some(p) = plan_lazy_full(&entry, over, now, &self.cfg)
                    {
                        return Some((entry, attempt, p));
                    }
                    let st = known.cloned().unwrap_or_default();
                    let full = attempt.full || known.is_none();
                    let may_be_lazy_now = if st.lazy.is_some() {
                        keep_ok(&entry.name)
                    } else {
                        new_ok(&entry.name)
                    };
                    if !full
                        && !attempt.force
                        && may_be_lazy_now
                        && let Some(p) = plan_lazy(
                            &st,
                            &entry,
                            over,
                            now,
                            &self.cfg,
                            self.activity.seen(&entry.name),
                            self.lazy_after_ms,
                        )
                    {
                        return Some((entry, attempt, p));
                    }
                    let p = plan(&st, &entry, over, now, &self.cfg, full);
                    Some((entry, attempt, p))
                })
                .collect();
            let keys = &self.keys;
            let fence = &fence;
            let secret = self.key_secret.as_ref();
            let results: Vec<(Arc<TaskEntry>, Attempt, Plan, Result<Turn>)> =
                futures::stream::iter(jobs)
                    .map(|(entry, attempt, plan)| {
                        let mut c = conn.clone();
                        async move {
                            let r = execute(
                                &mut c,
                                keys,
                                ctx,
                                fence,
                                &entry,
                                &plan,
                                attempt.force,
                                secret,
                            )
                            .await;
                            (entry, attempt, plan, r)
                        }
                    })
                    .buffer_unordered(CONCURRENCY)
                    .collect()
                    .await;
            for (entry, attempt, plan, r) in results {
                let (r, sent) = match r {
                    Ok((out, sent)) => (Ok(out), sent),
                    // Failed somewhere: counted as the call it was meant to be.
                    Err(e) => (
                        Err(e),
                        Sent {
                            probe: false,
                            script: true,
                            made: false,
                        },
                    ),
                };
                if sent.probe {
                    stats.probes += 1;
                }
                if sent.script {
                    stats.calls += plan.slices.len().div_ceil(MAX_SLICES_PER_CALL).max(1) as u64;
                }
                let name = &entry.name;
                match r {
                    Ok(RollOutcome::Written(n)) => {
                        stats.written += n;
                        self.was_lazy.remove(name);
                        // Known again: its state says what to retire should it leave etcd.
                        self.forgotten.remove(name);
                        if !plan.unchanged {
                            let lazy = plan.next.lazy.is_some();
                            if self
                                .state
                                .insert(name.clone(), plan.next)
                                .map(|o| o.lazy.is_some())
                                != Some(lazy)
                            {
                                self.dirty.lazy = true;
                            }
                        } else if plan.lazy.is_some()
                            && let Some(st) = self.state.get_mut(name)
                        {
                            // Probed every tick while a host uses it: from now on (each
                            // probe looks back to the last).
                            st.probed_ms =
                                if verdict.as_ref().is_some_and(|o| o.used.contains(name)) {
                                    now
                                } else {
                                    probe_phase(name, now, self.cfg.lazy_refresh_ms())
                                };
                        }
                        if sent.made
                            && let Some(st) = self.state.get_mut(name)
                            && st.wake(now)
                        {
                            // A worker made a slice: the task has traffic again, roll it
                            // ahead (this round if one is left, else next tick).
                            stats.woken += 1;
                            self.dirty.lazy = true;
                            pending.push((entry, Attempt::default()));
                        }
                    }
                    Ok(RollOutcome::NeedFull) if !attempt.full => {
                        stats.healed += 1;
                        // A lazy task Redis lost is written lazy again (its meta is gone, and
                        // the script refuses a lazy write over anything but a live lazy meta
                        // or none): healing a FLUSHALL does not write every window at once —
                        // unless the same round trip found a slice a worker made (its refresh
                        // watches them): it has traffic, and is written ahead.
                        if !sent.made && self.state.get(name).is_some_and(|s| s.lazy.is_some()) {
                            self.was_lazy.insert(name.clone());
                        }
                        self.state.remove(name);
                        self.forgotten.insert(name.clone());
                        self.dirty.lazy = true;
                        // Redis lost the task, maybe the registry too: add it again.
                        self.registered.remove(name);
                        self.dirty.register = true;
                        pending.push((
                            entry,
                            Attempt {
                                full: true,
                                eager: attempt.eager || sent.made,
                                ..attempt
                            },
                        ));
                    }
                    Ok(RollOutcome::NeedFull) => {
                        debug!(task = name, "a full write was answered NeedFull; next tick");
                    }
                    Ok(RollOutcome::NotLazy) => {
                        // Slices there may hold other caps (a re-created task, a spec changed
                        // while no leader ran): written ahead, in full, this round.
                        self.was_lazy.remove(name);
                        pending.push((
                            entry,
                            Attempt {
                                full: true,
                                eager: true,
                                ..attempt
                            },
                        ));
                    }
                    Ok(RollOutcome::Retired { revision }) => {
                        if !attempt.force && other_history(revision).await {
                            info!(
                                task = name,
                                revision, "tombstone from another etcd history; writing over it"
                            );
                            pending.push((entry, Attempt::FORCED));
                            continue;
                        }
                        // Deleted (through another replica) after the spec we hold; our watch
                        // has not delivered the deletion yet. Never resurrect it.
                        debug!(task = name, revision, "task was deleted; skipping");
                        self.state.remove(name);
                        self.dirty.lazy = true;
                    }
                    Ok(RollOutcome::StaleSpec { stored_version }) => {
                        self.metrics.stale_specs.inc();
                        if !attempt.force && other_history(stored_version).await {
                            info!(
                                task = name,
                                stored_version,
                                "spec version from another etcd history; writing over it"
                            );
                            pending.push((entry, Attempt::FORCED));
                            continue;
                        }
                        // Our snapshot lags behind a spec some leader already wrote.
                        debug!(
                            task = name,
                            version = entry.version,
                            stored_version,
                            "stale spec: a newer version is in Redis; skipping this tick"
                        );
                        self.state.remove(name);
                        self.forgotten.insert(name.clone());
                        self.dirty.lazy = true;
                    }
                    Ok(RollOutcome::Refused(refusal)) => {
                        // A term above this etcd's revision belongs to another etcd history
                        // (rebuilt or restored): a conflict, not a reason to step down.
                        let ours = match &refusal {
                            FenceRefusal::Newer { term, .. } => !other_history(*term).await,
                            FenceRefusal::Foreign { .. } => false,
                        };
                        self.refused(ctx, name, refusal, ours, true)?;
                    }
                    Err(Error::NotLeader) => return Err(Error::NotLeader),
                    Err(e) => {
                        stats.errors += 1;
                        warn!(task = name, %e, "roll failed; will retry next tick");
                    }
                }
            }
        }
        // Those found not due sleep; the others stay awake.
        if sleepers.is_empty() {
            self.sleep.awake = visited;
        } else {
            let names: HashSet<&str> = sleepers.iter().map(|(n, _, _)| n.as_str()).collect();
            self.sleep.awake = visited
                .into_iter()
                .filter(|e| !names.contains(e.name.as_str()))
                .collect();
            for (name, until, reach) in sleepers {
                self.sleep.queue.push(Reverse((until, name.clone())));
                self.sleep.asleep.insert(name, (until, reach));
            }
        }
        self.sleep.last_now = now;
        self.sleep.snap = Some(snap.clone());
        self.sleep.valid = true;
        stats.conflicts = self.conflicts.len() as u64;
        self.healed_last_tick = stats.healed > 0;
        if stats.errors == 0 {
            if probe_eager {
                self.probe_eager_pending = false;
            }
        } else if probe_all {
            // Some of that probe of every task failed: it is owed still.
            self.probe_all_pending = true;
        }
        self.report(ctx, snap);

        self.metrics.roll_calls.inc_by(stats.calls);
        self.metrics.roll_probes.inc_by(stats.probes);
        self.metrics.slices_written.inc_by(stats.written);
        self.metrics.roll_errors.inc_by(stats.errors);
        self.metrics.tasks.set(snap.tasks.len() as i64);
        self.metrics.lazy_woken.inc_by(stats.woken);
        if self.dirty.lazy {
            self.dirty.lazy = false;
            self.publish_lazy(snap);
        }
        self.metrics
            .lazy_tasks
            .set(self.published_lazy.len() as i64);
        let ahead = self
            .sleep
            .awake
            .iter()
            .filter_map(|e| self.state.get(&e.name))
            .map(reach)
            .chain(self.sleep.asleep.values().map(|(_, r)| *r))
            .min()
            .map(|r| r - now);
        self.metrics
            .horizon_ahead
            .set(ahead.map_or(0.0, |ms| ms as f64 / 1000.0));
        Ok(stats)
    }

    /// Tells the harvester and the skew detector which tasks are lazy now (only the changes).
    fn publish_lazy(&mut self, snap: &TaskSnapshot) {
        let mut added = Vec::new();
        let mut removed: Vec<String> = self
            .published_lazy
            .iter()
            .filter(|n| !snap.tasks.contains_key(*n))
            .cloned()
            .collect();
        for name in snap.tasks.keys() {
            let lazy = self.state.get(name).is_some_and(|s| s.lazy.is_some());
            if lazy != self.published_lazy.contains(name) {
                if lazy {
                    added.push(name.clone());
                } else {
                    removed.push(name.clone());
                }
            }
        }
        if added.is_empty() && removed.is_empty() {
            return;
        }
        for n in &removed {
            self.published_lazy.remove(n);
        }
        self.published_lazy.extend(added.iter().cloned());
        self.activity.set_lazy(added, removed);
    }

    /// Reads `NS:hosts`: the tasks that fresh hosts whose workers speak a protocol before 5 use
    /// are held rolled ahead (`sluice_lazy_held_back_hosts`, logged when the set of such hosts
    /// changes). Freshness is judged on the leader's clock (`seen_ms` less the host's offset).
    /// An entry that does not parse is ignored (the leader prunes it). A failed read keeps the
    /// last verdict, which goes stale after a few reads (no more tasks are left lazy then).
    async fn check_hosts(&mut self, conn: &sluice_protocol::conn::RedisConn, now: i64) {
        let mut c = conn.clone();
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(self.keys.hosts());
        let raw: Vec<(String, String)> = match bounded("read hosts", cmd.query_async(&mut c)).await
        {
            Ok(v) => v,
            Err(e) => {
                debug!(%e, "reading the hosts' protocol versions failed");
                return;
            }
        };
        let found = old_workers(raw, now);
        self.metrics
            .lazy_held_back_hosts
            .set(found.hosts.len() as i64);
        let before = self.old_hosts.as_ref().map(|o| &o.hosts);
        if before != Some(&found.hosts) && !found.hosts.is_empty() {
            warn!(
                hosts = found.hosts.len(),
                first = ?found.hosts.iter().take(5).collect::<Vec<_>>(),
                tasks = found.tasks.len(),
                "hosts whose workers speak a protocol before {LAZY_PROTOCOL} report to this namespace: the tasks they use are not left lazy (--lazy-after) until they are upgraded"
            );
        } else if before.is_some_and(|b| !b.is_empty()) && found.hosts.is_empty() {
            info!("every host speaks protocol {LAZY_PROTOCOL}: idle tasks may be left lazy again");
        }
        self.old_hosts = Some(Arc::new(found));
    }

    /// Learns which tasks the previous leadership left lazy (or never wrote: created while no
    /// leader ran, or lost by Redis), one `HMGET` of `lz_until` and `term` per task that may
    /// be lazy, many in flight, once per leadership; tasks created from then on
    /// start lazy too. On failure the tasks are written ahead as usual (correct, only
    /// costlier).
    async fn read_lazy(&mut self, conn: &sluice_protocol::conn::RedisConn, snap: &TaskSnapshot) {
        self.lazy_read = true;
        let names: Vec<&String> = snap
            .tasks
            .values()
            .filter(|e| may_be_lazy(e) && !self.state.contains_key(&e.name))
            .map(|e| &e.name)
            .collect();
        // One command per task, many in flight: a pipeline of many tasks' keys is refused by
        // a Redis Cluster (they lie in different slots).
        let keys = &self.keys;
        type Read = (String, Result<(Option<String>, Option<String>)>);
        let reads = futures::stream::iter(names.into_iter().cloned())
            .map(|name| {
                let mut c = conn.clone();
                async move {
                    let mut cmd = redis::cmd("HMGET");
                    cmd.arg(keys.meta(&name))
                        .arg(sluice_protocol::meta_field::LZ_UNTIL)
                        .arg(sluice_protocol::meta_field::TERM);
                    let r = bounded("read lazy windows", cmd.query_async(&mut c)).await;
                    (name, r)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<Read>>();
        // Bounded as a whole: a Redis that hangs must not hold the first tick for each task's
        // own timeout in turn (the tasks are then written ahead, as without the read).
        let Ok(read) = tokio::time::timeout(READ_LAZY_TIMEOUT, reads).await else {
            warn!("reading which tasks were lazy timed out; writing them ahead");
            return;
        };
        let mut found = 0usize;
        let mut failed = 0usize;
        for (name, r) in read {
            match r {
                Ok((lz_until, term)) => {
                    if lz_until.is_some_and(|v| v.parse::<i64>().is_ok()) || term.is_none() {
                        self.was_lazy.insert(name);
                        found += 1;
                    }
                }
                // Written ahead (correct, only costlier).
                Err(_) => failed += 1,
            }
        }
        if failed > 0 {
            warn!(
                tasks = failed,
                "cannot read whether these tasks were lazy; writing them ahead"
            );
        }
        self.lazy_new_after = Some(snap.revision);
        if found > 0 {
            info!(
                tasks = found,
                "tasks left lazy by the previous leadership (or never written) start lazy"
            );
        }
    }

    /// Adds the tasks of `snap` not yet known to be registered to the registry (one `SADD`).
    async fn register(&mut self, conn: &sluice_protocol::conn::RedisConn, snap: &TaskSnapshot) {
        let new: Vec<&String> = snap
            .tasks
            .keys()
            .filter(|n| !self.registered.contains(*n))
            .collect();
        if new.is_empty() {
            self.dirty.register = false;
            return;
        }
        // In batches (every task again after Redis lost the registry: 100,000 names).
        let mut added: Vec<String> = Vec::with_capacity(new.len());
        for batch in new.chunks(REGISTER_BATCH) {
            let mut c = conn.clone();
            let mut cmd = redis::cmd("SADD");
            cmd.arg(self.keys.task_registry()).arg(batch);
            let call = cmd.query_async::<i64>(&mut c);
            match tokio::time::timeout(CALL_TIMEOUT, call).await {
                Ok(Ok(_)) => added.extend(batch.iter().map(|n| (*n).clone())),
                Ok(Err(e)) => {
                    warn!(%e, "adding tasks to the registry failed; will retry");
                    break;
                }
                Err(_) => {
                    warn!("adding tasks to the registry timed out; will retry");
                    break;
                }
            }
        }
        let done = added.len() == new.len();
        self.registered.extend(added);
        if done {
            self.dirty.register = false;
        }
    }

    /// Removes a retired task from the registry. A failure leaves the name for the next
    /// leadership's walk, which finds it retired and removes it then.
    async fn unregister(&mut self, conn: &sluice_protocol::conn::RedisConn, name: &str) {
        self.registered.remove(name);
        let mut c = conn.clone();
        let mut cmd = redis::cmd("SREM");
        cmd.arg(self.keys.task_registry()).arg(name);
        let call = cmd.query_async::<i64>(&mut c);
        if !matches!(tokio::time::timeout(CALL_TIMEOUT, call).await, Ok(Ok(_))) {
            debug!(
                task = name,
                "removing a retired task from the registry failed"
            );
        }
    }

    /// `INFO server` on a single server (not while the ACL refuses it, asked again every
    /// [`INFO_RETRY_MS`]), for [`Self::note_run_id`]; `None` when not asked.
    fn ask_run_id(
        &self,
        conn: &sluice_protocol::conn::RedisConn,
        now: i64,
    ) -> impl std::future::Future<
        Output = Option<
            std::result::Result<redis::RedisResult<String>, tokio::time::error::Elapsed>,
        >,
    > + use<> {
        let ask = conn.is_single_server()
            && self
                .info_refused_ms
                .is_none_or(|at| now < at || now - at >= INFO_RETRY_MS);
        let mut ci = conn.clone();
        async move {
            if !ask {
                return None;
            }
            let mut info = redis::cmd("INFO");
            info.arg("server");
            Some(tokio::time::timeout(CALL_TIMEOUT, info.query_async::<String>(&mut ci)).await)
        }
    }

    /// Reads the answer of [`Self::ask_run_id`]: whether another process answers than the
    /// last one seen (a restart that kept data from a dump, a failover), remembering this one.
    ///
    /// Another process can hold the live meta of a task retired since (the deterministic
    /// simulation found one, still granting leases to a deleted task a minute later), so the
    /// registry is walked again from its start, as a new leadership does, and every task etcd
    /// no longer has is retired again. Not the fill from the metas (a SCAN of every key): a dump
    /// holds the registry as complete as it was; not after a FLUSHALL alone (nothing survived
    /// it). A check under way goes on (a walk follows it); a fill under way starts again from
    /// the check (its `SCAN` cursor meant something to the old process only: going on with it
    /// could skip metas and then mark the registry complete).
    fn note_run_id(
        &mut self,
        info: Option<std::result::Result<redis::RedisResult<String>, tokio::time::error::Elapsed>>,
        now: i64,
    ) -> bool {
        let run_id = match info {
            Some(Ok(Ok(i))) => {
                self.info_refused_ms = None;
                let id = server_run_id(&i);
                if id.is_none() && !self.run_id_missing_logged {
                    self.run_id_missing_logged = true;
                    warn!(
                        "Redis's INFO server has no run_id: a restart that keeps its data is found task by task"
                    );
                }
                id
            }
            Some(Ok(Err(e)))
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) =>
            {
                if self.info_refused_ms.is_none() {
                    warn!(
                        "Redis's ACL refuses INFO server (see docs/security.md): a restart that keeps its data is found task by task"
                    );
                }
                self.info_refused_ms = Some(now);
                None
            }
            _ => None,
        };
        let restarted =
            run_id.is_some() && self.redis_run_id.is_some() && run_id != self.redis_run_id;
        if restarted && !matches!(self.reconcile, Reconcile::Unknown | Reconcile::Filling(_)) {
            warn!("Redis answers with a new run_id (a restart or a failover): checking every task");
        }
        if run_id.is_some() {
            self.redis_run_id = run_id;
        }
        if restarted {
            self.reconcile = match self.reconcile {
                Reconcile::Unknown | Reconcile::Filling(_) => Reconcile::Unknown,
                Reconcile::Walking(_) | Reconcile::Done => Reconcile::Walking(0),
            };
        }
        restarted
    }

    /// One step of a new leadership's reconciliation: learn whether the registry is complete,
    /// else fill it with one page of a `SCAN` of the metas (a single Redis server only: on a
    /// Redis Cluster a `SCAN` sees one node, so the registry is marked complete without it and
    /// tasks only older managers rolled stay unknown, as docs/architecture.md says), then walk
    /// it one page per tick.
    async fn reconcile_step(
        &mut self,
        conn: &sluice_protocol::conn::RedisConn,
        snap: &TaskSnapshot,
        epoch: u64,
    ) -> Result<Reconcile> {
        let registry = self.keys.task_registry();
        match self.reconcile {
            Reconcile::Unknown => {
                let mut c = conn.clone();
                let mut cmd = redis::cmd("SISMEMBER");
                cmd.arg(&registry).arg(REGISTRY_COMPLETE);
                let complete: bool = bounded("read registry", cmd.query_async(&mut c)).await?;
                let single = conn.is_single_server();
                Ok(match (complete, single) {
                    (true, _) => Reconcile::Walking(0),
                    (false, true) => {
                        info!(
                            "task registry incomplete (older managers): filling it from the metas"
                        );
                        Reconcile::Filling(0)
                    }
                    (false, false) => {
                        self.mark_complete(conn).await?;
                        Reconcile::Walking(0)
                    }
                })
            }
            Reconcile::Filling(cursor) => {
                let mut c = conn.clone();
                let pattern = format!("{}:{{*}}:meta", self.keys.namespace());
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(REGISTRY_SCAN_PAGE);
                let (next, found): (u64, Vec<String>) =
                    bounded("scan metas", cmd.query_async(&mut c)).await?;
                let prefix = format!("{}:{{", self.keys.namespace());
                let names: Vec<&str> = found
                    .iter()
                    .filter_map(|k| k.strip_prefix(&prefix)?.strip_suffix("}:meta"))
                    .filter(|n| sluice_protocol::validate_task_name(n).is_ok())
                    .collect();
                if !names.is_empty() {
                    let mut cmd = redis::cmd("SADD");
                    cmd.arg(&registry).arg(&names);
                    bounded::<i64>("fill registry", cmd.query_async(&mut c)).await?;
                }
                if next != 0 {
                    return Ok(Reconcile::Filling(next));
                }
                self.mark_complete(conn).await?;
                info!("task registry filled from the metas");
                Ok(Reconcile::Walking(0))
            }
            Reconcile::Walking(cursor) => Ok(self
                .reconcile_page(conn, snap, epoch, cursor)
                .await?
                .map_or(Reconcile::Done, Reconcile::Walking)),
            Reconcile::Done => Ok(Reconcile::Done),
        }
    }

    /// Adds [`REGISTRY_COMPLETE`] to the registry.
    async fn mark_complete(&self, conn: &sluice_protocol::conn::RedisConn) -> Result<()> {
        let mut c = conn.clone();
        let mut cmd = redis::cmd("SADD");
        cmd.arg(self.keys.task_registry()).arg(REGISTRY_COMPLETE);
        bounded::<i64>("mark registry", cmd.query_async(&mut c)).await?;
        Ok(())
    }

    /// One page of the registry walk of a new leadership: every registered name that etcd
    /// does not hold (valid or invalid) and whose meta is live and was written by this etcd
    /// cluster (`epoch`) joins the roller's memory, so the tick retires it like a task deleted
    /// under this leader (fenced by epoch and term); one whose meta is missing or already a
    /// tombstone is only removed from the registry. A live meta of another epoch (a second
    /// manager cluster on the namespace, a fresh etcd) is left alone: that task was never in
    /// this etcd, so its absence here says nothing. Returns the next cursor, `None` when the
    /// walk is complete.
    async fn reconcile_page(
        &mut self,
        conn: &sluice_protocol::conn::RedisConn,
        snap: &TaskSnapshot,
        epoch: u64,
        cursor: u64,
    ) -> Result<Option<u64>> {
        let mut c = conn.clone();
        let mut cmd = redis::cmd("SSCAN");
        cmd.arg(self.keys.task_registry())
            .arg(cursor)
            .arg("COUNT")
            .arg(RECONCILE_PAGE);
        let call = cmd.query_async::<(u64, Vec<String>)>(&mut c);
        let (next, names) = match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(r) => r.map_err(redis_err("sscan registry"))?,
            Err(_) => {
                return Err(Error::Timeout {
                    op: "sscan registry",
                    after: CALL_TIMEOUT,
                });
            }
        };
        let orphans: Vec<String> = names
            .into_iter()
            .filter(|n| sluice_protocol::validate_task_name(n).is_ok())
            .filter(|n| !snap.contains(n) && !self.state.contains_key(n))
            // Deduplicated (SSCAN may repeat a name) in name order: the same calls in the same
            // order every run (the deterministic simulation replays a seed bit for bit).
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let keys = &self.keys;
        let ours = epoch.to_string();
        let ours = &ours;
        let checked: Vec<(String, Result<Orphan>)> = futures::stream::iter(orphans)
            .map(|name| {
                let mut c = conn.clone();
                async move {
                    let mut cmd = redis::cmd("HMGET");
                    cmd.arg(keys.meta(&name))
                        .arg(sluice_protocol::meta_field::SLICE_MS)
                        .arg(sluice_protocol::meta_field::RETIRED)
                        .arg(sluice_protocol::meta_field::EPOCH);
                    type Row = (Option<String>, Option<String>, Option<String>);
                    let call = cmd.query_async::<Row>(&mut c);
                    let live = match tokio::time::timeout(CALL_TIMEOUT, call).await {
                        Ok(Ok((slice_ms, retired, stored))) => {
                            Ok(match (slice_ms.is_some() && retired.is_none(), stored) {
                                (false, _) => Orphan::Gone,
                                // No epoch stored: written by protocol 1, as the fence reads it.
                                (true, None) => Orphan::Ours,
                                (true, Some(e)) if e == *ours => Orphan::Ours,
                                (true, Some(_)) => Orphan::Foreign,
                            })
                        }
                        Ok(Err(e)) => Err(redis_err("read meta")(e)),
                        Err(_) => Err(Error::Timeout {
                            op: "read meta",
                            after: CALL_TIMEOUT,
                        }),
                    };
                    (name, live)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (name, live) in checked {
            match live? {
                Orphan::Ours => {
                    info!(
                        task = name,
                        "task in Redis but not in etcd (deleted while no leader ran): retiring it"
                    );
                    self.state.insert(name, TaskRollState::default());
                    self.dirty.gone = true;
                }
                Orphan::Gone => self.unregister(conn, &name).await,
                Orphan::Foreign => {
                    debug!(
                        task = name,
                        "registered by another etcd cluster; left alone"
                    )
                }
            }
        }
        Ok((next != 0).then_some(next))
    }

    /// Metrics, logs and alerts of the conflicts and invalid specs of this tick.
    fn report(&mut self, ctx: &LeaderContext, snap: &TaskSnapshot) {
        self.metrics
            .fence_foreign_tasks
            .set(self.conflicts.len() as i64);
        self.metrics.invalid_tasks.set(snap.invalid.len() as i64);
        let stale_s = self.cfg.fence_stale_after.as_secs_f64();
        // One alert per writer holding our tasks: an epoch, or a term of another history.
        let mut by_holder: BTreeMap<String, Vec<&Conflict>> = BTreeMap::new();
        for c in &self.conflicts {
            let holder = match &c.refusal {
                FenceRefusal::Foreign { epoch, .. } => format!("epoch {epoch}"),
                FenceRefusal::Newer { .. } => "another etcd history".to_string(),
            };
            by_holder.entry(holder).or_default().push(c);
        }
        let ns = self.keys.namespace();
        // Keyed by our epoch: the alert state is shared with the other cluster of a conflict,
        // whose own conflict episodes are not ours to resolve.
        let scope = format!("fence:{}:", ctx.epoch());
        let present: Vec<Condition> = by_holder
            .iter()
            .map(|(holder, cs)| {
                let youngest = cs.iter().map(|c| c.refusal.age_ms()).min().unwrap_or(0);
                let takeover_s = (stale_s - youngest as f64 / 1000.0).max(0.0);
                let what = match &cs[0].refusal {
                    FenceRefusal::Foreign { epoch, term, .. } => format!(
                        "namespace {ns} is written by another manager cluster (etcd cluster id {epoch}, term {term}); this one (etcd cluster id {}) refuses to write",
                        ctx.epoch()
                    ),
                    FenceRefusal::Newer { term, .. } => format!(
                        "namespace {ns} holds fences of term {term}, above every revision of this etcd ({}): written by another etcd history (etcd rebuilt or restored?) or an identically configured etcd; refusing to write",
                        ctx.known_revision()
                    ),
                };
                let tasks: Vec<&str> = cs
                    .iter()
                    .take(CONFLICT_TASKS_SHOWN)
                    .map(|c| c.task.as_str())
                    .collect();
                let mut cond = Condition::new(
                    format!("{scope}{holder}"),
                    "fence_conflict",
                    format!(
                        "{what}: {} task(s) ({}); takeover in {takeover_s:.0} s if it stops",
                        cs.len(),
                        tasks.join(", ")
                    ),
                );
                cond.details = json!({
                    "tasks": tasks,
                    "count": cs.len(),
                    "takeover_in_s": takeover_s.round(),
                    "stale_after_s": stale_s,
                });
                cond
            })
            .collect();
        if let Some(c) = present.first() {
            let due = self
                .last_conflict_log
                .is_none_or(|t| t.elapsed() >= CONFLICT_LOG_EVERY);
            if due {
                self.last_conflict_log = Some(Instant::now());
                warn!("{}", c.message);
            }
        } else {
            self.last_conflict_log = None;
        }
        self.alerts.send(Signal::State {
            kind: "fence_conflict",
            scope,
            present,
        });

        let invalid: Vec<Condition> = snap
            .invalid
            .values()
            .map(|t| {
                let mut c = Condition::new(
                    format!("spec:{}", t.name),
                    "invalid_spec",
                    format!(
                        "task {}: the stored spec (version {}) is invalid: {}: {}; it is neither rolled nor retired (its slices already written serve until the horizon): fix it with PUT or delete it",
                        t.name, t.version, t.field, t.error
                    ),
                );
                c.task = Some(t.name.clone());
                c.details = json!({"version": t.version, "field": t.field, "error": t.error});
                c
            })
            .collect();
        self.alerts.send(Signal::State {
            kind: "invalid_spec",
            scope: String::new(),
            present: invalid,
        });
    }
}

/// The meta fields of a keyed task's key labels: `clear_keys`, and the secret unless clear.
fn key_fields(
    spec: &crate::spec::TaskSpec,
    secret: Option<&sluice_protocol::KeySecret>,
) -> Vec<(&'static str, String)> {
    use sluice_protocol::meta_field::{CLEAR_KEYS, KEY_SECRET};
    if !spec.keyed {
        return Vec::new();
    }
    let mut v = vec![(CLEAR_KEYS, u8::from(spec.clear_keys).to_string())];
    if let Some(s) = secret.filter(|_| !spec.clear_keys) {
        v.push((KEY_SECRET, s.expose().to_string()));
    }
    v
}

/// How long after Redis's ACL refused `INFO server` the leader asks again (an ACL fixed
/// meanwhile takes effect without a leader change).
const INFO_RETRY_MS: i64 = 300_000;

/// The `run_id` field of an `INFO server` reply.
fn server_run_id(info: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// `fut` bounded by [`CALL_TIMEOUT`], its error named `op`.
async fn bounded<T>(
    op: &'static str,
    fut: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(r) => r.map_err(redis_err(op)),
        Err(_) => Err(Error::Timeout {
            op,
            after: CALL_TIMEOUT,
        }),
    }
}

/// A registered name etcd does not hold, by what its meta says.
enum Orphan {
    /// Live, written by this etcd cluster: retire it.
    Ours,
    /// Missing or a tombstone: only drop it from the registry.
    Gone,
    /// Live, written by another etcd cluster: not ours to judge.
    Foreign,
}

/// How many slices one probe of a lazy task looks at, at most (one `EXISTS` of that many keys,
/// all in the task's slot): those nearest the leader's clock. A task of short slices probed
/// rarely can miss older ones; traffic that goes on is seen in the latest.
pub const MAX_PROBE_SLICES: usize = 128;

/// The slices whose existence says a worker made them: for a lazy task, those from the one of
/// its last probe (`plan.probe_from`) to the current one by the leader's clock, widened by
/// [`LAZY_BACK_MS`] (at least a slice) on both sides — workers name slices by Redis's clock,
/// which may be that far from the leader's — where they lie past what the leader wrote
/// (`expect_rolled_to`); at most [`MAX_PROBE_SLICES`]: at most a quarter of them ahead of the
/// current slice, the rest the latest behind it (short slices look back less than the margin).
fn made_by_workers(plan: &Plan, slice_ms: u64, now_ms: i64) -> Vec<i64> {
    if plan.lazy.is_none() {
        return Vec::new();
    }
    let slice_ms = slice_ms.max(1);
    let len = slice_ms as i64;
    let margin = LAZY_BACK_MS.max(len);
    let current = slice::start(now_ms, slice_ms);
    let ahead = (margin / len).clamp(1, MAX_PROBE_SLICES as i64 / 4);
    let last = current + ahead * len;
    let first = slice::start(plan.probe_from.min(now_ms) - margin, slice_ms)
        .max(last - (MAX_PROBE_SLICES as i64 - 1) * len)
        .min(current);
    slice::starts(first, last + 1, slice_ms)
        .filter(|s| *s >= plan.expect_rolled_to)
        .collect()
}

/// Sends one plan (in chunks of at most [`MAX_SLICES_PER_CALL`] slices).
#[allow(clippy::too_many_arguments)]
async fn execute(
    conn: &mut sluice_protocol::conn::RedisConn,
    keys: &Keys,
    ctx: &LeaderContext,
    fence: &scripts::Fence,
    entry: &TaskEntry,
    plan: &Plan,
    force: bool,
    secret: Option<&sluice_protocol::KeySecret>,
) -> Result<Turn> {
    // `rolled_to` must not move either: the script would write it and claim the fence (a
    // concurrency task has no slices, yet its window moves every slice).
    let quiet = plan.slices.is_empty()
        && !plan.write_meta
        && !plan.refresh
        && !plan.full
        && !force
        && plan.new_rolled_to <= plan.expect_rolled_to;
    let mut probed = false;
    let mut made = false;
    if quiet {
        // Nothing to write: one HMGET tells whether the script would write nothing either
        // (the common case, answered without a script); anything else goes to the script.
        let watch = made_by_workers(plan, entry.spec.slice_ms, unix_ms());
        let probe = scripts::roll_probe(
            conn,
            keys,
            &entry.name,
            fence,
            plan.expect_rolled_to,
            entry.version,
            plan.lazy.map(|l| l.until_ms),
            &watch,
        );
        match tokio::time::timeout(CALL_TIMEOUT, probe).await {
            Ok(r) => {
                let p = r.map_err(redis_err("roll probe"))?;
                made = p.made;
                if p.vouch {
                    return Ok((
                        RollOutcome::Written(0),
                        Sent {
                            probe: true,
                            script: false,
                            made,
                        },
                    ));
                }
                probed = true;
            }
            Err(_) => {
                return Err(Error::Timeout {
                    op: "roll probe",
                    after: CALL_TIMEOUT,
                });
            }
        }
    }
    let meta = entry.spec.meta(entry.version);
    let extra = key_fields(&entry.spec, secret);
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
            fence,
            full: plan.full && first,
            expect_rolled_to: expect,
            new_rolled_to: rolled_to,
            spec_version: entry.version,
            force: force && first,
            refresh: plan.refresh && first,
            meta: (plan.write_meta && first).then_some(&meta),
            meta_extra: &extra,
            slices: chunk,
            lazy: plan.lazy.as_ref(),
        };
        // A lazy task's refresh probes it too, in the same round trip (no slice is written
        // with it; what the leader wrote lies before `expect_rolled_to`, which the watch skips).
        let watch = if first && !probed && !plan.full && plan.slices.is_empty() {
            made_by_workers(plan, entry.spec.slice_ms, unix_ms())
        } else {
            Vec::new()
        };
        let call = scripts::roll_watching(conn, keys, &req, &watch);
        let out = match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(r) => {
                let (out, m) = r.map_err(redis_err("roll"))?;
                made |= m;
                out
            }
            Err(_) => {
                return Err(Error::Timeout {
                    op: "roll",
                    after: CALL_TIMEOUT,
                });
            }
        };
        match out {
            RollOutcome::Written(k) => written += k,
            other => {
                return Ok((
                    other,
                    Sent {
                        probe: probed,
                        script: true,
                        made,
                    },
                ));
            }
        }
        expect = if plan.full && first {
            rolled_to
        } else {
            expect.max(rolled_to)
        };
    }
    Ok((
        RollOutcome::Written(written),
        Sent {
            probe: probed,
            script: true,
            made,
        },
    ))
}

/// What one task's turn got, and what it sent.
type Turn = (RollOutcome, Sent);

/// What one task's turn sent to Redis.
#[derive(Debug, Clone, Copy)]
struct Sent {
    /// The one-`HMGET` probe ([`scripts::roll_probe`]).
    probe: bool,
    /// The roll script (after a probe that could not vouch, or instead of one).
    script: bool,
    /// The probe found a slice of the lazy task that only a worker can have made.
    made: bool,
}

/// Dynamic threshold overrides by task, set by the dynamic controller, read by the roller.
/// Each override names the task incarnation (spec create revision) it was computed for; the
/// roller ignores one of another incarnation.
#[derive(Debug, Clone, Default)]
pub struct DynamicThresholds {
    inner: Arc<std::sync::RwLock<HashMap<String, (i64, u64)>>>,
}

impl DynamicThresholds {
    /// The current overrides: task → (incarnation, threshold).
    pub fn current(&self) -> HashMap<String, (i64, u64)> {
        self.inner.read().map(|m| m.clone()).unwrap_or_default()
    }

    /// Removes every override.
    pub fn clear(&self) {
        if let Ok(mut m) = self.inner.write() {
            m.clear();
        }
    }

    /// Sets (Some) or clears (None) the override of incarnation `incarnation` of `task`.
    pub fn set(&self, task: &str, incarnation: i64, value: Option<u64>) {
        if let Ok(mut m) = self.inner.write() {
            match value {
                Some(v) => m.insert(task.to_string(), (incarnation, v)),
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
            created: 1,
        }
    }

    fn cfg() -> RollConfig {
        RollConfig {
            horizon: Duration::from_secs(5),
            retention: Duration::from_secs(60),
            tick: Duration::from_millis(500),
            fence_stale_after: Duration::from_secs(10),
        }
    }

    /// A new `run_id` (a restart from a dump, a failover) walks the registry again from its
    /// start; a fill under way starts again from the check (its SCAN cursor was the old
    /// process's); the first `run_id` seen changes nothing.
    #[test]
    fn a_new_run_id_restarts_the_registry_walk_and_a_fill_from_the_check() {
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let (alerts, _rx) = crate::alerts::channel(metrics.clone());
        let redis = Arc::new(Redis::new(
            sluice_protocol::conn::RedisTarget::Single("redis://127.0.0.1:1".into()),
            sluice_protocol::conn::ConnOptions::default(),
        ));
        let mut r = Roller::new(Keys::new("t").unwrap(), redis, cfg(), metrics, alerts);
        let info = |id: &str| Some(Ok(Ok(format!("# Server\r\nrun_id:{id}\r\n"))));
        r.reconcile = Reconcile::Done;
        assert!(!r.note_run_id(info("a"), 0), "the first run_id seen");
        assert_eq!(r.reconcile, Reconcile::Done);
        assert!(!r.note_run_id(info("a"), 0));
        for (before, after) in [
            (Reconcile::Done, Reconcile::Walking(0)),
            (Reconcile::Walking(42), Reconcile::Walking(0)),
            (Reconcile::Filling(7), Reconcile::Unknown),
            (Reconcile::Unknown, Reconcile::Unknown),
        ] {
            r.reconcile = before;
            let next = if r.redis_run_id.as_deref() == Some("a") {
                "b"
            } else {
                "a"
            };
            assert!(r.note_run_id(info(next), 0), "{before:?}");
            assert_eq!(r.reconcile, after, "from {before:?}");
        }
        // No answer (refused, timed out) is not a restart.
        r.reconcile = Reconcile::Done;
        assert!(!r.note_run_id(None, 0));
        assert_eq!(r.reconcile, Reconcile::Done);
    }

    #[test]
    fn concurrency_tasks_get_meta_and_fence_but_no_slices() {
        let e = entry(
            r#"{"threshold": 20, "mode": "concurrency", "lease_ms": 2000}"#,
            5,
        );
        let p = plan(&TaskRollState::default(), &e, None, 10_500, &cfg(), true);
        assert!(p.full && p.write_meta && p.refresh);
        assert!(p.slices.is_empty());
        assert!(p.new_rolled_to > 10_500);
        let q = plan(&p.next, &e, None, 11_500, &cfg(), false);
        assert!(q.slices.is_empty() && !q.full);
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
            timezone: "UTC".into(),
        }]));
        assert_eq!(effective_threshold(&e, None, 0), 300);
        assert_eq!(effective_threshold(&e, Some(42), 0), 42);
        let p = plan(&TaskRollState::default(), &e, None, 0, &cfg(), true);
        let q = plan(&p.next, &e, Some(42), 100, &cfg(), false);
        assert!(q.slices.iter().all(|s| s.cap == 42));
        assert!(!q.write_meta);
    }

    /// The caps the roller writes follow the schedule's wall clock across a DST change: a
    /// Europe/Berlin `03` hour begins with the slice at the jump (01:00 UTC on 2026-03-29),
    /// not an hour later as UTC would have it.
    #[test]
    fn caps_follow_a_zoned_schedule_across_a_dst_change() {
        let e = entry(
            r#"{"threshold": 100, "schedules": [
                {"cron": "* * 3 * * *", "threshold": 300, "timezone": "Europe/Berlin"}]}"#,
            1,
        );
        let jump = chrono::DateTime::parse_from_rfc3339("2026-03-29T01:00:00Z")
            .unwrap()
            .timestamp_millis();
        let p = plan(
            &TaskRollState::default(),
            &e,
            None,
            jump - 2_500,
            &cfg(),
            true,
        );
        assert!(!p.slices.is_empty());
        for s in &p.slices {
            let want = if s.start_ms >= jump { 300 } else { 100 };
            assert_eq!(s.cap, want, "slice {}", s.start_ms);
            assert_eq!(s.cap, effective_threshold(&e, None, s.start_ms));
        }
        assert!(p.slices.iter().any(|s| s.cap == 100) && p.slices.iter().any(|s| s.cap == 300));
    }

    /// What the harvester says of a task idle since `busy_ms`, without traffic seen.
    fn idle(busy_ms: i64) -> Option<Seen> {
        Some(Seen {
            busy_ms,
            traffic_ms: None,
        })
    }

    /// Issue 27: a lazy task costs its leader one refresh every `lazy_refresh_ms` (not every
    /// quarter of `fence_stale_after`), its window reaching a horizon and that refresh past the
    /// write, its fence holding two refreshes; a quiet lazy task is probed every tick only
    /// while a host reports using it. Woken, its fence is an eager task's again.
    #[test]
    fn a_lazy_task_is_refreshed_and_probed_at_its_own_pace() {
        let c = RollConfig {
            horizon: Duration::from_secs(60),
            ..cfg()
        };
        let e = entry(r#"{"threshold": 100}"#, 1);
        let st = plan(&TaskRollState::default(), &e, None, 1_000, &c, true).next;
        let p = plan_lazy(&st, &e, None, 100_000, &c, idle(0), 60_000).expect("lazy");
        let r = c.lazy_refresh_ms();
        assert!(r > c.refresh_every_ms(), "{r}");
        let w = p.lazy.expect("window");
        assert!(w.until_ms >= 100_000 + c.ahead_ms(1_000) + r, "{w:?}");
        assert_eq!(w.fence_ttl_ms, c.lazy_fence_ttl_ms());
        assert!(w.fence_ttl_ms as i64 >= 2 * r);
        // Its first refresh comes within a period (spread by name), never later.
        let first = p.next.refreshed_ms + r;
        assert!((100_000..=100_000 + r).contains(&first), "{first}");
        assert!(
            quiet(&p.next, &e, None, first - 1, &c),
            "quiet until its refresh"
        );
        assert!(
            !quiet(&p.next, &e, None, first, &c),
            "refreshed at its period"
        );
        // The window still reaches the horizon when the refresh is due.
        assert!(w.until_ms >= first + c.ahead_ms(1_000));
        // That refresh is its probe too (one round trip, issue 27): it watches the slices
        // since the last probe, and the next refresh and probe come due together.
        let mut before = p.next.clone();
        before.probed_ms = first - 7_000;
        let rp = plan_lazy(&before, &e, None, first, &c, idle(0), 60_000).expect("refresh");
        assert!(rp.refresh && !rp.full && rp.slices.is_empty());
        assert_eq!(rp.probe_from, first - 7_000);
        assert_eq!((rp.next.refreshed_ms, rp.next.probed_ms), (first, first));
        let watched = made_by_workers(&rp, 1_000, first);
        assert_eq!(watched.first(), Some(&slice::start(first - 12_000, 1_000)));
        assert_eq!(
            lazy_asleep_until(&rp.next, &e, first, &c),
            Some(first + r),
            "one visit per period"
        );
        // Probed every tick while in use, else once a period (and after a clock step back).
        let probed = p.next.probed_ms;
        assert!(lazy_probe_due(&p.next, true, probed + 1, &c));
        assert!(!lazy_probe_due(&p.next, false, probed + r - 1, &c));
        assert!(lazy_probe_due(&p.next, false, probed + r, &c));
        assert!(lazy_probe_due(&p.next, false, probed - 1, &c));
        // A probe looks at every slice since the last one, widened by LAZY_BACK_MS on both
        // sides (workers go by Redis's clock), past what the leader wrote: a single decision
        // between two rare probes is seen.
        let mut quiet_plan = Plan::probe(&p.next);
        quiet_plan.probe_from = 110_400;
        let made = made_by_workers(&quiet_plan, 1_000, 120_100);
        assert_eq!(made.first(), Some(&105_000));
        assert_eq!(made.last(), Some(&125_000));
        assert_eq!(made.len(), 21);
        quiet_plan.probe_from = 0;
        quiet_plan.expect_rolled_to = 0;
        let made = made_by_workers(&quiet_plan, 1_000, 300_100);
        assert_eq!(made.len(), MAX_PROBE_SLICES);
        assert_eq!(
            made.last(),
            Some(&305_000),
            "the slices ahead are kept whole"
        );
        quiet_plan.expect_rolled_to = 119_000;
        assert_eq!(
            made_by_workers(&quiet_plan, 1_000, 120_100),
            (119_000..=125_000).step_by(1_000).collect::<Vec<_>>()
        );
        // The leader's clock a second ahead of Redis's, 100 ms slices, probed every tick: the
        // slice a worker made by Redis's clock a second back is looked at (the reviewer's case).
        quiet_plan.expect_rolled_to = 0;
        quiet_plan.probe_from = 500_000 - 500;
        let made = made_by_workers(&quiet_plan, 100, 500_000);
        assert!(
            made.contains(&499_000) && made.contains(&499_100),
            "{made:?}"
        );
        // ... and one a second ahead (the leader's clock behind).
        assert!(made.contains(&501_000), "{made:?}");
        assert!(made.len() <= MAX_PROBE_SLICES);
        // Short slices: never more than MAX_PROBE_SLICES, at most a quarter of them ahead, so
        // some look-back is always left (the second review: 10 ms slices probed 501 slices,
        // all ahead of the current one).
        for len in [1_u64, 10, 20, 40, 50] {
            let made = made_by_workers(&quiet_plan, len, 500_000);
            assert_eq!(made.len(), MAX_PROBE_SLICES, "{len} ms");
            let behind = made.iter().filter(|s| **s < 500_000).count();
            assert!(
                behind >= MAX_PROBE_SLICES * 3 / 4 - 1,
                "{len} ms: {behind} behind"
            );
        }
        assert!(made_by_workers(&quiet_plan, 10, 500_000).contains(&499_500));
        quiet_plan.lazy = None;
        assert!(made_by_workers(&quiet_plan, 1_000, 120_100).is_empty());
        // Woken: the window kept before the first slice written again carries no lifetime.
        let mut woken = p.next.clone();
        assert!(woken.wake(101_200));
        let q = plan(&woken, &e, None, 101_200, &c, false);
        assert!(q.lazy.is_some_and(|l| l.fence_ttl_ms == 0), "{:?}", q.lazy);
        assert!(q.refresh || q.new_rolled_to > q.expect_rolled_to);
        // A takeover's lazy write carries the lifetime, its refresh and probe spread likewise.
        let f = plan_lazy_full(&e, None, 200_300, &c).expect("lazy");
        assert_eq!(f.lazy.map(|l| l.fence_ttl_ms), Some(c.lazy_fence_ttl_ms()));
        assert!(f.next.refreshed_ms > 200_300 - r && f.next.probed_ms > 200_300 - r);
    }

    #[test]
    fn the_run_id_is_read_from_an_info_server_reply() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:60d8e3d076a2\r\ntcp_port:6379\r\n";
        assert_eq!(server_run_id(info).as_deref(), Some("60d8e3d076a2"));
        assert_eq!(server_run_id("# Server\r\nredis_version:7.0.15\r\n"), None);
        assert_eq!(server_run_id("run_id:\r\n"), None);
        assert_eq!(server_run_id(""), None);
    }

    /// A new snapshot wakes exactly the tasks it added, changed or removed (compared by entry
    /// pointer), re-points the tasks awake at its entries, and gives up (a visit of every
    /// task) when it changed too many.
    #[test]
    fn a_new_snapshot_wakes_only_the_tasks_it_changed() {
        let mk = |n: &str| {
            let mut e = entry(r#"{"threshold": 100}"#, 1);
            e.name = n.to_string();
            Arc::new(e)
        };
        let mut old = TaskSnapshot::default();
        for i in 0..100 {
            let n = format!("t{i:03}");
            old.tasks.insert(n.clone(), mk(&n));
        }
        let old = Arc::new(old);
        let mut sleep = Sleep {
            snap: Some(old.clone()),
            valid: true,
            ..Sleep::default()
        };
        for (n, _) in old.tasks.iter().skip(10) {
            sleep.asleep.insert(n.clone(), (1, 2));
            sleep.queue.push(Reverse((1, n.clone())));
        }
        sleep.awake = old.tasks.values().take(10).cloned().collect();
        sleep.follow(&old);
        assert!(sleep.changed.is_empty() && sleep.valid);
        // t000 (awake) and t050 (asleep) changed, t099 removed, t100 and a0 added.
        let mut new = (*old).clone();
        new.tasks.insert("t000".into(), mk("t000"));
        new.tasks.insert("t050".into(), mk("t050"));
        new.tasks.remove("t099");
        new.tasks.insert("t100".into(), mk("t100"));
        new.tasks.insert("a0".into(), mk("a0"));
        let new = Arc::new(new);
        sleep.follow(&new);
        assert!(sleep.valid);
        let mut changed: Vec<String> = sleep.changed.iter().cloned().collect();
        changed.sort();
        assert_eq!(changed, ["a0", "t000", "t050", "t099", "t100"]);
        assert!(!sleep.asleep.contains_key("t050") && !sleep.asleep.contains_key("t099"));
        assert_eq!(sleep.asleep.len(), 88);
        assert_eq!(sleep.awake.len(), 10);
        assert!(Arc::ptr_eq(&sleep.awake[0], &new.tasks["t000"]));
        assert!(Arc::ptr_eq(sleep.snap.as_ref().unwrap(), &new));
        // Snapshots that follow one another with no complete tick between them (Redis
        // unreachable): a task changed twice is visited once, and what they changed adds up
        // towards the limit.
        let mut again = (*new).clone();
        again.tasks.insert("t050".into(), mk("t050"));
        let again = Arc::new(again);
        sleep.follow(&again);
        assert!(sleep.valid);
        assert_eq!(sleep.changed.len(), 5, "{:?}", sleep.changed);
        let mut prev = again;
        for i in 60..70 {
            let mut next = (*prev).clone();
            let n = format!("t{i:03}");
            next.tasks.insert(n.clone(), mk(&n));
            let next = Arc::new(next);
            sleep.follow(&next);
            prev = next;
        }
        assert!(!sleep.valid, "{} changes pending", sleep.changed.len());
        // Rebuilt by a complete tick (as `tick` does at its end).
        sleep.reset();
        sleep.snap = Some(new.clone());
        sleep.valid = true;
        // Many tasks removed from the end of the map (the diff's tail) count as well.
        let mut cut = (*new).clone();
        cut.tasks.retain(|n, _| n.as_str() < "t080");
        sleep.follow(&Arc::new(cut));
        assert!(!sleep.valid, "21 removed at the end");
        sleep.reset();
        sleep.snap = Some(new.clone());
        sleep.valid = true;
        // A snapshot that changes a tenth of the tasks or more: every task is visited.
        let mut many = (*new).clone();
        for i in 0..20 {
            let n = format!("t{i:03}");
            many.tasks.insert(n.clone(), mk(&n));
        }
        sleep.follow(&Arc::new(many));
        assert!(!sleep.valid);
    }

    /// The roller's due-queue (issue 27) skips a lazy task until [`lazy_asleep_until`]: every
    /// instant before it must find the task quiet with its probe not due (safety: a visit
    /// skipped is one that would have done nothing), and the instant itself must not
    /// (liveness: it is visited when its refresh, its window's growth or its probe is due, not
    /// later). Random configurations, slice lengths, times and probe times; the task goes
    /// through a chain of refreshes, each planned at the instant its sleep ended.
    #[test]
    fn a_sleeping_lazy_task_is_visited_exactly_when_something_is_due() {
        use proptest::prelude::*;
        let config = sluice_testkit::prop_config("lazy_asleep_until", 2_000);
        proptest!(config, |(
            horizon_ms in 1_000_u64..3_600_000,
            stale_ms in 1_000_u64..120_000,
            slice_ms in prop_oneof![Just(1_000_u64), 100_u64..120_000],
            t0 in 1_600_000_000_000_i64..1_900_000_000_000,
            probe_lag in 0.0_f64..1.0,
            steps in 1_usize..6,
            frac in 0.0_f64..1.0,
        )| {
            let c = RollConfig {
                horizon: Duration::from_millis(horizon_ms),
                retention: Duration::from_secs(60),
                tick: Duration::from_millis(500),
                fence_stale_after: Duration::from_millis(stale_ms),
            };
            let e = entry(&format!(r#"{{"threshold": 100, "slice_ms": {slice_ms}}}"#), 1);
            let Some(p) = plan_lazy_full(&e, None, t0, &c) else {
                return Ok(());
            };
            let mut st = p.next;
            let mut now = t0;
            for _ in 0..steps {
                // Probed some time after the write, as a tick in use would.
                let lag = (probe_lag * c.lazy_refresh_ms() as f64) as i64;
                st.probed_ms = st.probed_ms.max(now - lag).min(now);
                let Some(until) = lazy_asleep_until(&st, &e, now, &c) else {
                    // Only when something is due now.
                    prop_assert!(
                        !quiet(&st, &e, None, now, &c)
                            || lazy_probe_due(&st, false, now, &c)
                    );
                    break;
                };
                prop_assert!(until > now);
                for t in [now, now + ((until - now - 1) as f64 * frac) as i64, until - 1] {
                    prop_assert!(quiet(&st, &e, None, t, &c), "not quiet at {t} (until {until})");
                    prop_assert!(!lazy_probe_due(&st, false, t, &c), "probe due at {t}");
                }
                prop_assert!(
                    !quiet(&st, &e, None, until, &c) || lazy_probe_due(&st, false, until, &c),
                    "nothing due at {until}"
                );
                now = until;
                // What the tick does then: refresh (or probe only).
                match plan_lazy(&st, &e, None, now, &c, idle(0), 1) {
                    Some(q) if !q.unchanged => st = q.next,
                    _ => st.probed_ms = now,
                }
            }
        });
    }

    /// A lazy task stays lazy at each refresh while the harvester finds no traffic since it
    /// went lazy; traffic wakes it. A new leadership's first write of a task left lazy is lazy.
    #[test]
    fn a_lazy_task_stays_lazy_until_traffic_and_across_a_takeover() {
        let e = entry(r#"{"threshold": 100}"#, 1);
        let st = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true).next;
        let p = plan_lazy(&st, &e, None, 100_000, &cfg(), idle(0), 60_000).expect("lazy");
        assert_eq!(p.next.lazy_since, 100_000);
        // Refreshes: the harvester's busy_ms moved (a new leadership's harvest began), no
        // traffic: still lazy, lazy_since kept.
        let seen = Some(Seen {
            busy_ms: 101_000,
            traffic_ms: None,
        });
        let q = plan_lazy(&p.next, &e, None, 102_500, &cfg(), seen, 60_000).expect("lazy");
        assert_eq!(q.next.lazy_since, 100_000);
        // Traffic found before it went lazy: still lazy; after: not.
        let before = Some(Seen {
            busy_ms: 99_000,
            traffic_ms: Some(99_000),
        });
        assert!(plan_lazy(&q.next, &e, None, 105_000, &cfg(), before, 60_000).is_some());
        let after = Some(Seen {
            busy_ms: 104_000,
            traffic_ms: Some(104_000),
        });
        assert!(plan_lazy(&q.next, &e, None, 105_000, &cfg(), after, 60_000).is_none());

        // A takeover: in full (meta, fence) but lazy, rolled_to at the current slice.
        let f = plan_lazy_full(&e, None, 200_300, &cfg()).expect("lazy");
        assert!(f.full && f.write_meta && f.refresh && f.slices.is_empty());
        assert_eq!(f.new_rolled_to, 200_000);
        assert_eq!(f.lazy.map(|l| l.cap), Some(100));
        assert_eq!(f.next.lazy, f.lazy);
        assert!(
            reach(&f.next) >= 200_300 + 5_000,
            "decidable a horizon ahead"
        );
        // Not harvested yet: stays lazy.
        assert!(plan_lazy(&f.next, &e, None, 202_800, &cfg(), None, 60_000).is_some());
        // It stays lazy without waiting for --lazy-after (no traffic seen yet).
        let seen = Some(Seen {
            busy_ms: 200_500,
            traffic_ms: None,
        });
        assert!(plan_lazy(&f.next, &e, None, 203_000, &cfg(), seen, 60_000).is_some());
        // Never for a task whose mode cannot be lazy.
        let k = entry(r#"{"threshold": 5, "keyed": true}"#, 1);
        assert!(plan_lazy_full(&k, None, 200_300, &cfg()).is_none());
    }

    /// `--lazy-after`: an idle task is left lazy only once nothing has happened to it for the
    /// setting, only in the modes whose worker scripts make slices, only for what was written
    /// of this version, and only while its cap is constant over the window.
    #[test]
    fn an_idle_task_is_left_lazy_only_when_nothing_can_tell() {
        let after = 60_000;
        let e = entry(r#"{"threshold": 100}"#, 1);
        let eager = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true).next;
        assert_eq!(
            eager.eager_ms, 1_000,
            "a first write counts as rolled ahead now"
        );
        // Never seen by the harvester, busy recently, or rolled ahead recently: not lazy.
        let now = 100_000;
        assert!(plan_lazy(&eager, &e, None, now, &cfg(), None, after).is_none());
        assert!(plan_lazy(&eager, &e, None, now, &cfg(), idle(50_000), after).is_none());
        assert!(plan_lazy(&eager, &e, None, 60_999, &cfg(), idle(0), after).is_none());
        // Idle for the setting: lazy, no slice, the fence refreshed, rolled_to unchanged.
        let p = plan_lazy(&eager, &e, None, now, &cfg(), idle(0), after).expect("lazy");
        let l = p.lazy.expect("window");
        assert!(p.slices.is_empty() && p.refresh && !p.write_meta && !p.full);
        assert_eq!(p.new_rolled_to, eager.rolled_to);
        assert_eq!(l.cap, 100);
        assert_eq!(
            l.from_ms, 95_000,
            "from 5 s back: a worker's clock may be behind"
        );
        assert!(
            l.until_ms >= now + 5_000,
            "at least a horizon ahead: {}",
            l.until_ms
        );
        assert_eq!(l.until_ms % 1_000, 0);
        assert_eq!(l.expire_after_ms, 60_000);
        assert_eq!(p.next.lazy, Some(l));
        assert!(
            quiet(&p.next, &e, None, now + 500, &cfg()),
            "lazy and fresh: only probed"
        );
        assert!(
            !quiet(&p.next, &e, None, now + 2_500, &cfg()),
            "the fence refresh is due"
        );
        // A new version or dynamic override is rolled ahead first.
        let v2 = entry(r#"{"threshold": 200}"#, 2);
        assert!(plan_lazy(&p.next, &v2, None, now + 3_000, &cfg(), idle(0), after).is_none());
        assert!(plan_lazy(&p.next, &e, Some(7), now + 3_000, &cfg(), idle(0), after).is_none());
        let back = plan(&p.next, &v2, None, now + 3_000, &cfg(), false);
        assert!(back.lazy.is_none() && back.next.lazy.is_none());
        assert_eq!(
            back.next.eager_ms,
            now + 3_000,
            "not lazy again before --lazy-after"
        );
        assert!(
            back.slices
                .iter()
                .any(|s| s.start_ms == 103_000 && s.cap == 200)
        );
        // Modes whose workers do not make slices.
        for body in [
            r#"{"threshold": 5, "keyed": true}"#,
            r#"{"threshold": 5, "mode": "local"}"#,
            r#"{"threshold": 5, "mode": "concurrency", "lease_ms": 2000}"#,
        ] {
            let e = entry(body, 1);
            let st = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true).next;
            assert!(
                plan_lazy(&st, &e, None, now, &cfg(), idle(0), after).is_none(),
                "{body}"
            );
        }
        for body in [
            r#"{"threshold": 5, "mode": "exact_fixed"}"#,
            r#"{"threshold": 5, "mode": "exact_sliding"}"#,
        ] {
            let e = entry(body, 1);
            let st = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true).next;
            assert!(
                plan_lazy(&st, &e, None, now, &cfg(), idle(0), after).is_some(),
                "{body}"
            );
        }
        // Off.
        assert!(plan_lazy(&eager, &e, None, now, &cfg(), idle(0), 0).is_none());
    }

    /// A lazy task woken by a worker's slice is rolled ahead from the current slice, and the
    /// write keeps its window before that slice (a worker whose clock is behind still finds
    /// what an eager task would have had), unless its cap may have changed.
    #[test]
    fn a_woken_task_keeps_its_window_before_the_slices_written_again() {
        let e = entry(r#"{"threshold": 100}"#, 1);
        let st = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true).next;
        let lazy = plan_lazy(&st, &e, None, 100_000, &cfg(), idle(0), 60_000)
            .expect("lazy")
            .next;
        let mut woken = lazy.clone();
        woken.tail = woken.lazy.take().map(|l| LazyWindow {
            until_ms: 101_000,
            ..l
        });
        woken.eager_ms = 101_200;
        assert!(!quiet(&woken, &e, None, 101_200, &cfg()));
        let p = plan(&woken, &e, None, 101_200, &cfg(), false);
        assert_eq!(
            p.lazy.map(|l| (l.cap, l.from_ms, l.until_ms)),
            Some((100, 95_000, 101_000))
        );
        assert_eq!(p.slices.first().map(|s| s.start_ms), Some(101_000));
        assert!(p.slices.iter().all(|s| s.cap == 100));
        assert!(p.next.tail.is_none() && p.next.lazy.is_none());
        // Rolled ahead for a while: the next write drops the window.
        let q = plan(&p.next, &e, None, 104_000, &cfg(), false);
        assert!(q.lazy.is_none());
        // A new version (its cap may differ) or a full write: no window kept.
        let v2 = entry(r#"{"threshold": 200}"#, 2);
        assert!(
            plan(&woken, &v2, None, 101_200, &cfg(), false)
                .lazy
                .is_none()
        );
        assert!(plan(&woken, &e, None, 101_200, &cfg(), true).lazy.is_none());
    }

    /// A schedule that changes the cap within the window keeps the task rolled ahead; once
    /// the window holds one cap again it may be lazy.
    #[test]
    fn a_schedule_change_in_the_window_keeps_the_task_rolled_ahead() {
        let e = entry(
            r#"{"threshold": 100, "schedules": [
                {"cron": "* * 3 * * *", "threshold": 300, "timezone": "UTC"}]}"#,
            1,
        );
        let three = chrono::DateTime::parse_from_rfc3339("2026-03-29T03:00:00Z")
            .unwrap()
            .timestamp_millis();
        let st = plan(&TaskRollState::default(), &e, None, 0, &cfg(), true).next;
        assert!(plan_lazy(&st, &e, None, three - 3_000, &cfg(), idle(0), 1).is_none());
        let p = plan_lazy(&st, &e, None, three + 30_000, &cfg(), idle(0), 1).expect("lazy");
        assert_eq!(p.lazy.map(|l| l.cap), Some(300));
        let p = plan_lazy(&st, &e, None, three - 60_000, &cfg(), idle(0), 1).expect("lazy");
        assert_eq!(p.lazy.map(|l| l.cap), Some(100));
        // Refreshed while the change approaches (only the new part of the window is checked):
        // lazy until the change enters the window, then rolled ahead.
        let mut st = p.next;
        let mut t = three - 60_000;
        let mut lazy_until = 0;
        while let Some(q) = plan_lazy(&st, &e, None, t + 2_500, &cfg(), idle(0), 1) {
            let l = q.lazy.expect("window");
            assert_eq!(l.cap, 100);
            assert!(l.until_ms <= three, "the window never reaches the change");
            lazy_until = l.until_ms;
            st = q.next;
            t += 2_500;
        }
        assert!(
            three - lazy_until < 2_500 + 1_000,
            "lazy until close to the change"
        );
    }

    #[test]
    fn slices_expire_after_retention() {
        let e = entry(r#"{"threshold": 1, "slice_ms": 250}"#, 1);
        let p = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true);
        assert_eq!(p.slices[0].expire_at_ms, 1_250 + 60_000);
        // The 5 s horizon and a step of 833 ms past it: slices 1,000 … 6,750.
        assert_eq!(p.slices.len(), 24);
    }

    #[test]
    fn the_window_grows_in_steps_and_never_falls_below_the_horizon() {
        let e = entry(r#"{"threshold": 1, "slice_ms": 250}"#, 1);
        let c = cfg();
        let horizon = c.horizon.as_millis() as i64;
        let mut st = TaskRollState::default();
        let mut full = true;
        let mut calls_with_slices = 0;
        // 20 s of ticks: the window always reaches a horizon ahead, new slices come in steps.
        for now in (1_000..21_000).step_by(500) {
            let p = plan(&st, &e, None, now, &c, full);
            if !full && quiet(&st, &e, None, now, &c) {
                // The roller skips planning exactly where the plan would be empty.
                assert!(p.slices.is_empty() && !p.write_meta && !p.refresh, "{now}");
                assert_eq!(p.new_rolled_to, st.rolled_to, "{now}");
                assert_eq!(p.next.refreshed_ms, st.refreshed_ms, "{now}");
            } else if !full {
                assert!(
                    !p.slices.is_empty() || p.refresh,
                    "{now}: not quiet, nothing planned"
                );
            }
            full = false;
            if !p.slices.is_empty() {
                calls_with_slices += 1;
                // A step's worth at once (after the first, whole-window write).
                assert!(
                    p.slices.len() >= 3 || now == 1_000,
                    "{now}: {}",
                    p.slices.len()
                );
            }
            assert!(
                p.new_rolled_to >= now + horizon,
                "{now}: {}",
                p.new_rolled_to
            );
            assert!(
                p.new_rolled_to <= now + horizon + roll_step_ms(c.horizon, 250) + 250,
                "{now}"
            );
            st = p.next;
        }
        // One call per step (833 ms, rounded to the ticks: every other tick), not every tick.
        assert!(calls_with_slices <= 21, "{calls_with_slices}");
    }

    /// A slice_ms change: every slice of the new grid in the window is written with the new
    /// threshold and an expiry after the new slice's end; no write targets a start that is off
    /// the new grid, so the only old keys a new-grid worker reads are those whose start
    /// coincides, and they are rewritten (cap, expiry) too.
    #[test]
    fn a_slice_length_change_writes_the_whole_new_grid() {
        let changes = [
            (1_000, 2_000),
            (2_000, 1_000),
            (1_000, 1_500),
            (100, 10_000),
        ];
        for ((old_ms, new_ms), threshold) in changes.into_iter().flat_map(|c| [(c, 100), (c, 70)]) {
            let e1 = entry(&format!(r#"{{"threshold": 100, "slice_ms": {old_ms}}}"#), 1);
            let p = plan(&TaskRollState::default(), &e1, None, 100_250, &cfg(), true);
            let old_starts: Vec<i64> = p.next.caps.keys().copied().collect();
            let e2 = entry(
                &format!(r#"{{"threshold": {threshold}, "slice_ms": {new_ms}}}"#),
                2,
            );
            let now = 100_700;
            let q = plan(&p.next, &e2, None, now, &cfg(), false);
            assert!(q.full && q.write_meta, "{old_ms} → {new_ms}");
            let expected: Vec<i64> =
                slice::starts(now, now + cfg().horizon.as_millis() as i64, new_ms).collect();
            let written: Vec<i64> = q.slices.iter().map(|s| s.start_ms).collect();
            assert_eq!(written, expected, "{old_ms} → {new_ms}");
            for s in &q.slices {
                assert_eq!(s.start_ms.rem_euclid(new_ms as i64), 0);
                assert_eq!(s.cap, threshold);
                assert_eq!(s.expire_at_ms, s.start_ms + new_ms as i64 + 60_000);
            }
            // Coinciding keys of the old grid are among the writes (cap and expiry fixed).
            let coinciding: Vec<&i64> = old_starts
                .iter()
                .filter(|s| s.rem_euclid(new_ms as i64) == 0 && **s >= written[0])
                .collect();
            assert!(
                coinciding.iter().all(|s| written.contains(s)),
                "{old_ms} → {new_ms}"
            );
            assert_eq!(q.new_rolled_to, expected.last().unwrap() + new_ms as i64);
            assert_eq!(q.next.slice_ms, new_ms);
            // The next tick is incremental again.
            let r = plan(&q.next, &e2, None, now + 1, &cfg(), false);
            assert!(!r.full && r.slices.is_empty());
        }
    }

    #[test]
    fn a_recreated_task_is_written_in_full() {
        let e1 = entry(r#"{"threshold": 100}"#, 1);
        let p = plan(&TaskRollState::default(), &e1, None, 10_200, &cfg(), true);
        let mut e2 = entry(r#"{"threshold": 100}"#, 9);
        e2.created = 9;
        let q = plan(&p.next, &e2, None, 10_300, &cfg(), false);
        assert!(q.full);
        assert_eq!(q.slices.len(), 6);
    }

    #[test]
    fn the_fence_is_refreshed_at_least_every_quarter_of_stale_after() {
        // A one-day slice: rolled_to does not move for a day, the fence must still be fresh.
        let e = entry(r#"{"threshold": 1, "slice_ms": 86400000}"#, 1);
        let p = plan(&TaskRollState::default(), &e, None, 10_000, &cfg(), true);
        assert!(p.refresh);
        // A first write counts its refresh up to a period (2.5 s = 10 s / 4) earlier, spread
        // by the task's name, so that a leadership's tasks do not all refresh in one tick.
        let r0 = p.next.refreshed_ms;
        assert!(r0 <= 10_000 && r0 > 10_000 - 2_500, "{r0}");
        let q = plan(&p.next, &e, None, r0 + 2_499, &cfg(), false);
        assert!(!q.refresh && q.slices.is_empty());
        assert!(quiet(&p.next, &e, None, r0 + 2_499, &cfg()));
        assert_eq!(q.next.refreshed_ms, r0);
        let r = plan(&q.next, &e, None, r0 + 2_500, &cfg(), false);
        assert!(r.refresh);
        assert_eq!(r.next.refreshed_ms, r0 + 2_500);
        // The leader's clock stepped back: the fence is refreshed at once, not once the clock
        // has caught up.
        let b = plan(&r.next, &e, None, r0 + 1_000, &cfg(), false);
        assert!(b.refresh);
        assert!(!quiet(&r.next, &e, None, r0 + 1_000, &cfg()));
        // With 1 s slices rolled_to advances every second, which rewrites the fence anyway.
        let e = entry(r#"{"threshold": 1}"#, 1);
        let p = plan(&TaskRollState::default(), &e, None, 1_000, &cfg(), true);
        let q = plan(&p.next, &e, None, 2_000, &cfg(), false);
        assert!(!q.refresh && q.new_rolled_to > p.new_rolled_to);
        assert_eq!(q.next.refreshed_ms, 2_000);
    }

    #[test]
    fn a_clock_stepped_back_never_plans_more_than_the_cap() {
        // Written by a leader whose clock was an hour fast, then the clock is stepped back and
        // the spec changes: the recomputed window stays within the cap (the review's case).
        let e = entry(r#"{"threshold": 1, "slice_ms": 100}"#, 1);
        let c = RollConfig {
            horizon: Duration::from_secs(60),
            ..cfg()
        };
        let t = 1_000_000_000;
        let p = plan(&TaskRollState::default(), &e, None, t + 3_600_000, &c, true);
        let e2 = entry(r#"{"threshold": 2, "slice_ms": 100}"#, 2);
        let q = plan(&p.next, &e2, None, t, &c, false);
        assert!(
            q.slices.len() as i64 <= MAX_SLICES_AHEAD,
            "{}",
            q.slices.len()
        );
        assert!(
            q.next.caps.len() as i64 <= MAX_SLICES_AHEAD,
            "{}",
            q.next.caps.len()
        );
        let d = plan(&p.next, &e, Some(5), t, &c, false);
        assert!(
            d.slices.len() as i64 <= MAX_SLICES_AHEAD,
            "{}",
            d.slices.len()
        );
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
