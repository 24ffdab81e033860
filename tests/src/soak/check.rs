//! The invariants, as pure functions of the [`Ledger`] and of slice hashes read through
//! [`Slices`] (Redis in a soak, a map in the unit tests).
//!
//! # Safety
//!
//! * **Per slice** (`pooled`, `exact_fixed`): for every slice key `s` of length `L`, the
//!   admissions decided by the global quota (admitted − fallback-admitted) summed over every
//!   host's buckets in `[s, s + L)` (each host's own clock picks the key it draws on) are at
//!   most the **bound**: the largest cap any spec version live around the slice allows (base,
//!   every schedule entry, the dynamic maximum while the controller runs; see
//!   [`version_spans`] for "live around"). The cap read from Redis must not exceed the bound
//!   either (a slice holding a cap no live spec allows was written by a stale or deposed
//!   leader) — where a deletion does not count ([`cap_spans`]): slices written before it keep
//!   their caps until they expire.
//! * **Per window** (`exact_sliding`): admissions in every window of `m·L − 200 ms` (100 ms
//!   buckets, real time: a faketime host's buckets are moved back by its offset) are at most
//!   `m` × the bound, with `m = ⌈300 ms / L⌉` (1 for slices of 300 ms and more). The 200 ms
//!   margin covers the distance between the time a decision is stamped (before the Redis call)
//!   and the Redis `TIME` the script ranks it by — a round trip, scheduling delays — so that
//!   decisions stamped within `m·L − 200 ms` were ranked within `m·L` by Redis, where `m`
//!   windows of the log hold at most `m` caps. Windows near a Redis disturbance (a `DEBUG
//!   SLEEP` holds calls for seconds) are skipped.
//! * **Redis data loss.** A slice in progress (or a sliding window) when Redis lost its data
//!   (restart without persistence, `FLUSHALL`) is bounded by twice the bound: what it had
//!   handed out is forgotten and the leader writes it again whole ([`loss_factor`]).
//! * **Ambiguity.** Around a change of slice length or of mode class (observed in the task's
//!   meta hash in Redis, where the hosts read it), hosts follow the old and the new grid for up
//!   to a meta refresh, so buckets cannot be attributed to keys: the bucket check skips
//!   `[last old observation − 200 ms, first new observation + AMBIG]`, and instead the keys of
//!   both grids there are checked in Redis (`adm` flushed by the SDK ≤ the bound), unless a
//!   fallback admission (which the SDK also adds to `adm`) happened around them.
//! * **Fencing.** Once the future slices (2–6 s ahead) of a task all carry caps its newest spec
//!   allows, none may ever carry another cap again while that spec is the newest (a deposed
//!   leader writing after its successor, or a leader rolling an older spec); and a newest spec
//!   must be applied within [`Timing::not_applied_ms`] of the time it could be.
//!
//! # Liveness
//!
//! At the end of a quiet period, in every complete slice of the observation window of a task
//! in a global mode: when the demand of the eligible hosts is ≥ 1.1 × the slice's cap (read
//! from Redis; a missing slice is a violation), the globally admitted total is ≥ 90 % of the
//! cap; and every eligible host that asked admitted something. For `exact_sliding` the 90 %
//! applies to the sum over those slices of the window: its admissions are ranked by Redis
//! time while the buckets are stamped before the round trip, so a short slice's own sum is off
//! by the few decisions near its edges (measured: 100 ms slices of cap 25 at 88–104 %, 96 % on
//! average); the window's sum is not. A host is eligible unless its
//! clock lags by more than a tenth of a slice or leads by more than half a slice (a lagging
//! host arrives at each slice after the others drained it; that is the skew the alert is for).
//! While a host leads by more than half a slice, or by a lead over which its offered rate
//! reaches the lowest cap read in the window, no host is checked for zero admissions: the
//! leading host reaches every slice first and may take all of it (the others admit nothing —
//! see docs/soak.md, "what it found"); the total is still checked. While any host is not
//! eligible, the total's floor is lowered by one host's share (`cap / hosts`): a host whose
//! clock is off may over- or under-admit by up to its share per slice (operations.md, clock
//! skew) — measured: with a host 300 ms ahead on 100 ms slices of cap 57, slices admitted 46–51.

use std::collections::BTreeMap;

use super::ledger::{ApiVersion, BUCKET_MS, Cell, Disturb, Ledger, MetaState};
use super::plan::task_name;
use super::spec::Class;

/// The time allowances of the checks, ms (see the module doc; derived from the soak's settings:
/// lease TTL 2 s, tick 250 ms, meta refresh 1 s, flush 1 s, probe 1 s).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// A new spec reaches the slices and the hosts within this (watch, tick, meta refresh).
    pub apply_lag_ms: i64,
    /// After a leader disturbance ends, a leader rolls again within this (lease TTL + 1 s).
    pub leader_settle_ms: i64,
    /// After a Redis disturbance ends, slices and meta are back within this (tick + probe).
    pub redis_settle_ms: i64,
    /// Hosts follow a changed grid or mode within this of its first observation.
    pub ambig_ms: i64,
    /// Window margin of the sliding check.
    pub sliding_margin_ms: i64,
    /// A bucket is in the ledger within this of its end (bucket close, progress read).
    pub data_lag_ms: i64,
    /// A newest spec not applied this long after it could be is a violation.
    pub not_applied_ms: i64,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            apply_lag_ms: 3_000,
            leader_settle_ms: 3_000,
            redis_settle_ms: 2_500,
            ambig_ms: 2_500,
            sliding_margin_ms: 200,
            data_lag_ms: 2_500,
            not_applied_ms: 10_000,
        }
    }
}

/// A broken invariant and its evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// `safety.slice`, `safety.window`, `safety.cap`, `safety.redis_adm`, `fencing.revert`,
    /// `fencing.not_applied`, `liveness.total`, `liveness.host`, `liveness.slice_missing`, …
    pub invariant: &'static str,
    /// The task, if one.
    pub task: Option<String>,
    /// The slice (or window) start, if one.
    pub slice: Option<i64>,
    /// The numbers.
    pub evidence: String,
}

/// A slice hash as read from Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceRead {
    /// `cap`.
    pub cap: u64,
    /// `adm` flushed by workers.
    pub adm: u64,
    /// `burst` of a paced slice (`pace = 1`), `None` for an unpaced one.
    pub pace_burst: Option<u64>,
    /// `len`: the slice length ROLL last wrote it with (0 when absent).
    pub len: u64,
}

/// Reads slice hashes: `None` when the store cannot be reached, else one entry per start
/// (`None` for a missing key).
pub trait Slices {
    /// The slices of `task` starting at `starts`.
    fn read(&mut self, task: usize, starts: &[i64]) -> Option<Vec<Option<SliceRead>>>;

    /// What the store holds for one slice, as evidence (all fields, time to live).
    fn describe(&mut self, _task: usize, _start: i64) -> String {
        String::new()
    }
}

/// A spec version's time span of legitimacy and the largest cap it allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionSpan {
    /// When it was written.
    pub from_ms: i64,
    /// Until when its caps may still be in slices or in hosts' hands.
    pub until_ms: i64,
    /// Largest cap it allows (0 for a deletion).
    pub max_cap: u64,
    /// Its slice length (0 for a deletion).
    pub slice_ms: u64,
    /// Dynamic limiting runs: the leader may move the cap of a slice in progress.
    pub dynamic: bool,
}

/// When a change written at `at` has surely reached Redis and the hosts: `apply_lag` later,
/// pushed back past every leader, etcd or Redis disturbance that overlaps (plus its settle
/// time), since nobody rolls meanwhile.
pub fn applied_by(ledger: &Ledger, at: i64, t: &Timing) -> i64 {
    let mut end = at + t.apply_lag_ms;
    loop {
        let mut moved = false;
        for d in &ledger.disturbances {
            let settle = match d.kind {
                Disturb::Leader | Disturb::Etcd => t.leader_settle_ms,
                Disturb::Redis { .. } => t.redis_settle_ms,
                Disturb::Host(_) | Disturb::Clock => continue,
            };
            let d_end = d.to_ms.map_or(i64::MAX / 4, |x| x + settle);
            if d.from_ms <= end && d_end >= at && d_end + t.apply_lag_ms > end {
                end = d_end + t.apply_lag_ms;
                moved = true;
            }
        }
        if !moved {
            return end;
        }
    }
}

/// The spans of legitimacy of every version of `task`: from its write until the next
/// confirmed version is applied ([`applied_by`]); an unconfirmed version (unknown outcome)
/// never ends the one before it.
pub fn version_spans(ledger: &Ledger, task: usize, t: &Timing) -> Vec<VersionSpan> {
    spans_of(ledger, &ledger.api[task], t)
}

fn spans_of(ledger: &Ledger, api: &[ApiVersion], t: &Timing) -> Vec<VersionSpan> {
    api.iter()
        .enumerate()
        .map(|(i, v)| {
            let until_ms = api[i + 1..]
                .iter()
                .find(|n| n.confirmed)
                .map_or(i64::MAX / 4, |n| applied_by(ledger, n.at_ms, t));
            VersionSpan {
                from_ms: v.at_ms,
                until_ms,
                max_cap: v.spec.as_ref().map_or(0, |s| s.max_cap()),
                slice_ms: v.spec.as_ref().map_or(0, |s| s.slice_ms),
                dynamic: v.spec.as_ref().is_some_and(|s| s.dynamic_enabled()),
            }
        })
        .collect()
}

/// The spans for the caps a slice may *hold* in Redis: like [`version_spans`], but a deletion
/// does not end its predecessor — slices written before a deletion keep their caps until they
/// expire (harmless: hosts see the tombstone and admit nothing from them); a later spec does.
pub fn cap_spans(ledger: &Ledger, task: usize, t: &Timing) -> Vec<VersionSpan> {
    let live: Vec<ApiVersion> = ledger.api[task]
        .iter()
        .filter(|v| v.spec.is_some())
        .cloned()
        .collect();
    spans_of(ledger, &live, t)
}

/// The bound for a slice whose decisions fell in `[a, b]` (real time), prefetch `l` ms before
/// included: the largest cap of the versions live then.
pub fn bound(spans: &[VersionSpan], a: i64, b: i64, l: i64) -> u64 {
    spans
        .iter()
        .filter(|s| s.from_ms <= b && s.until_ms >= a - l - 1_000)
        .map(|s| s.max_cap)
        .max()
        .unwrap_or(0)
}

/// The bound for the cap that key `s` (decisions in `[a, b]`, real time) may hold in Redis:
/// [`bound`], and also every version written up to one of its own slices after `s` whose grid
/// has a slice starting at `s` — a new grid's current slice can start before the change that
/// created it, and then reuses the key of the old grid's slice with that start (with the new
/// cap; consumption kept).
pub fn cap_bound(spans: &[VersionSpan], s: i64, a: i64, b: i64, l: i64) -> u64 {
    let regrid = spans
        .iter()
        .filter(|v| v.slice_ms > 0 && s.rem_euclid(v.slice_ms as i64) == 0)
        .filter(|v| v.from_ms <= b + v.slice_ms as i64 && v.until_ms >= a - l - 1_000)
        .map(|v| v.max_cap)
        .max()
        .unwrap_or(0);
    bound(spans, a, b, l).max(regrid)
}

/// 2 when Redis lost its data during `[a, b]` (real time), else 1: the consumption of a slice
/// in progress is forgotten and the leader writes it again whole, so such a slice (or sliding
/// window: the log is gone too) may legitimately admit up to twice its cap. That is the cost of
/// running Redis without persistence, not a defect.
pub fn loss_factor(ledger: &Ledger, a: i64, b: i64) -> u64 {
    let lost = ledger.disturbances.iter().any(|d| {
        d.kind == Disturb::Redis { lost: true }
            && d.from_ms <= b
            && d.to_ms.is_none_or(|to| to >= a)
    });
    if lost { 2 } else { 1 }
}

/// The smallest multiple of `m` that is ≥ `x`.
fn ceil_to(x: i64, m: i64) -> i64 {
    x.div_euclid(m) * m + if x.rem_euclid(m) == 0 { 0 } else { m }
}

/// A stretch of time where the hosts followed one grid and mode class without ambiguity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Regime {
    /// Clean from.
    pub from_ms: i64,
    /// Clean until.
    pub to_ms: i64,
    /// Slice length.
    pub slice_ms: u64,
    /// Mode class.
    pub class: Class,
}

/// An ambiguity window: a change from one live meta to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// Window start (last observation of the old meta − 200 ms).
    pub from_ms: i64,
    /// Window end (first observation of the new meta + AMBIG).
    pub to_ms: i64,
    /// Old grid and class.
    pub old: (u64, Class),
    /// New grid and class.
    pub new: (u64, Class),
}

/// The clean regimes and the changes between them, from the observed meta of `task`.
pub fn regimes(ledger: &Ledger, task: usize, t: &Timing) -> (Vec<Regime>, Vec<Change>) {
    // Groups of consecutive live observations with one state (tombstones and missing meta in
    // between do not change the grid the hosts come back to).
    let mut groups: Vec<(i64, i64, u64, Class)> = Vec::new();
    for r in &ledger.meta[task] {
        let MetaState::Live { slice_ms, class } = r.state else {
            continue;
        };
        match groups.last_mut() {
            Some(g) if g.2 == slice_ms && g.3 == class => g.1 = r.last_ms,
            _ => groups.push((r.first_ms, r.last_ms, slice_ms, class)),
        }
    }
    let mut regs = Vec::new();
    let mut changes = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let from = g.0 + t.ambig_ms;
        let to = g.1 - 200;
        if from < to {
            regs.push(Regime {
                from_ms: from,
                to_ms: to,
                slice_ms: g.2,
                class: g.3,
            });
        }
        if let Some(n) = groups.get(i + 1) {
            changes.push(Change {
                from_ms: g.1 - 200,
                to_ms: n.0 + t.ambig_ms,
                old: (g.2, g.3),
                new: (n.2, n.3),
            });
        }
    }
    (regs, changes)
}

fn breakdown(cells: &[Cell]) -> String {
    cells
        .iter()
        .enumerate()
        .map(|(h, c)| {
            let gb = if c.gb > 0 {
                format!(" gave back {}", c.gb)
            } else {
                String::new()
            };
            format!("h{h}: adm {} (fb {}) rej {}{gb}", c.adm, c.fb, c.rej)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Counts of what the checks covered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Slices checked against their bound.
    pub slices: u64,
    /// Sliding windows checked.
    pub windows: u64,
    /// Keys checked in Redis around grid changes.
    pub redis_keys: u64,
    /// Slices checked for liveness.
    pub live_slices: u64,
    /// Slices of liveness windows not judged: the machine stalled around them (see
    /// [`check_liveness`]).
    pub stalled_slices: u64,
    /// Per-host liveness checks not made: the machine stalled in their window.
    pub stalled_host_checks: u64,
    /// Paced slices checked against the pace curve (`safety.pace`).
    pub paced_slices: u64,
}

/// Safety of `task`: the per-slice and per-window bounds, in every clean regime, of the
/// slices (windows) starting at or after `from` whose decisions all fell before `upto`. Returns
/// the violations and the next `from` (the end of the last slice, or the start after the last
/// window, checked), so every slice is checked once.
pub fn check_safety(
    ledger: &Ledger,
    task: usize,
    from: i64,
    upto: i64,
    slices: &mut dyn Slices,
    t: &Timing,
    cov: &mut Coverage,
) -> (Vec<Violation>, i64) {
    let spans = version_spans(ledger, task, t);
    let caps = cap_spans(ledger, task, t);
    let (regs, _) = regimes(ledger, task, t);
    let mut out = Vec::new();
    let mut next = from;
    for r in regs {
        let hi = r.to_ms.min(upto);
        if r.from_ms.max(from) >= hi {
            continue;
        }
        let done = match r.class {
            Class::Slice => slice_bounds(
                ledger, task, &r, from, hi, &spans, &caps, slices, cov, &mut out,
            ),
            Class::Window => window_bounds(ledger, task, &r, from, hi, &spans, t, cov, &mut out),
            Class::Local => None,
        };
        if let Some(d) = done {
            next = next.max(d);
        }
    }
    (out, next)
}

/// Checks the keys `s ≥ from` of regime `r` whose decisions on every host's clock fell
/// within the regime and before `hi`; returns the end of the last one checked.
#[allow(clippy::too_many_arguments)]
fn slice_bounds(
    ledger: &Ledger,
    task: usize,
    r: &Regime,
    from: i64,
    hi: i64,
    spans: &[VersionSpan],
    cap_spans: &[VersionSpan],
    slices: &mut dyn Slices,
    cov: &mut Coverage,
    out: &mut Vec<Violation>,
) -> Option<i64> {
    let l = r.slice_ms as i64;
    let off = ledger.max_offset_ms;
    let lo = (r.from_ms + off).max(from);
    let first = ceil_to(lo, l);
    let starts: Vec<i64> = (0..)
        .map(|i| first + i * l)
        .take_while(|s| s + l + off <= hi)
        .collect();
    let last = *starts.last()?;
    let reads = slices.read(task, &starts);
    for (i, s) in starts.iter().enumerate() {
        let cells = ledger.sums(task, *s, s + l);
        let global: u64 = cells.iter().map(Cell::global).sum();
        let b =
            bound(spans, s - off, s + l + off, l) * loss_factor(ledger, s - off - l, s + l + off);
        cov.slices += 1;
        if global > b {
            out.push(Violation {
                invariant: "safety.slice",
                task: Some(task_name(task)),
                slice: Some(*s),
                evidence: format!(
                    "slice {s} ({l} ms): {global} admitted by the global quota > bound {b}; {}",
                    breakdown(&cells)
                ),
            });
        }
        if let Some(Some(read)) = reads.as_ref().map(|v| v[i]) {
            pace_bound(ledger, task, *s, l, &read, spans, cov, out);
        }
        let cap_bound = cap_bound(cap_spans, *s, s - off, s + l + off, l);
        if let Some(Some(read)) = reads.as_ref().map(|v| v[i])
            && read.cap > cap_bound
        {
            out.push(Violation {
                invariant: "safety.cap",
                task: Some(task_name(task)),
                slice: Some(*s),
                evidence: format!(
                    "slice {s} ({l} ms) holds cap {} in Redis; no spec live around it allows more than {cap_bound}",
                    read.cap
                ),
            });
        }
    }
    Some(last + l)
}

/// `safety.pace` of the paced slice `s` (length `l`, Redis read `read`): at the end of every
/// bucket `s + j · 100 ms` (each host's own clock, the time its decisions were stamped with by
/// `try_acquire_stamped`), what the SDK hosts admitted from the global quota so far in the
/// slice ≤ `floor(cap · j · 100 / l) + burst` (sdk.md, "Paced slices": every permit has its
/// own number and a host admits one only once the pace released it, on its own clock, so the
/// whole task stays on the curve whatever the hosts' offsets). Agent hosts are left out of the
/// sum (their drivers stamp requests, not decisions; a subset of the admissions is still
/// bounded). Judged only where nothing else can explain more: one version live from a slice
/// before to after the slice (a changed cap reaches hosts' pace state late) and no dynamic
/// limiting (the controller moves the cap of a slice in progress; hosts keep pacing on the
/// curve their stock was granted under), the slice's `len` equal to the grid's (a new grid
/// rewrites an ended key it reuses: the review of this check), no Redis data loss around it
/// (the slice is re-created and its numbers handed out again), no host whose clock moved
/// within the slice.
#[allow(clippy::too_many_arguments)]
fn pace_bound(
    ledger: &Ledger,
    task: usize,
    s: i64,
    l: i64,
    read: &SliceRead,
    spans: &[VersionSpan],
    cov: &mut Coverage,
    out: &mut Vec<Violation>,
) {
    let Some(burst) = read.pace_burst else {
        return;
    };
    let off = ledger.max_offset_ms;
    let (a, b) = (s - off - l, s + l + off);
    let live = spans
        .iter()
        .filter(|v| v.from_ms <= b && v.until_ms >= a)
        .count();
    if live != 1
        || spans
            .iter()
            .any(|v| (a..=b).contains(&v.from_ms) || (v.dynamic && v.until_ms >= a))
        || loss_factor(ledger, a, b) != 1
        || read.cap == 0
        || read.len != l as u64
    {
        return;
    }
    let hosts = ledger.sdk_hosts.min(ledger.cells[task].len());
    let per_host = &ledger.cells[task][..hosts];
    if per_host
        .iter()
        .any(|m| m.range(s..s + l).any(|(_, c)| c.off_min != c.off_max))
    {
        return;
    }
    cov.paced_slices += 1;
    let mut so_far = 0u64;
    let mut bucket = s;
    while bucket < s + l {
        so_far += per_host
            .iter()
            .filter_map(|m| m.get(&bucket))
            .map(Cell::global)
            .sum::<u64>();
        let end = bucket + BUCKET_MS;
        let paced = (u128::from(read.cap) * (end - s).min(l) as u128 / l as u128) as u64 + burst;
        if so_far > paced {
            let per: Vec<String> = per_host
                .iter()
                .enumerate()
                .map(|(h, m)| {
                    let n: u64 = m.range(s..end).map(|(_, c)| c.global()).sum();
                    format!("h{h} {n}")
                })
                .collect();
            out.push(Violation {
                invariant: "safety.pace",
                task: Some(task_name(task)),
                slice: Some(s),
                evidence: format!(
                    "paced slice {s} ({l} ms, cap {}, burst {burst}): {so_far} admitted by the SDK hosts by {end} > the pace's {paced} ({})",
                    read.cap,
                    per.join(", ")
                ),
            });
            return;
        }
        bucket = end;
    }
}

/// Checks the windows starting at `w ≥ from` that lie within regime `r` and before `hi`;
/// returns the start after the last one checked.
#[allow(clippy::too_many_arguments)]
fn window_bounds(
    ledger: &Ledger,
    task: usize,
    r: &Regime,
    from: i64,
    hi: i64,
    spans: &[VersionSpan],
    t: &Timing,
    cov: &mut Coverage,
    out: &mut Vec<Violation>,
) -> Option<i64> {
    let l = r.slice_ms as i64;
    let m = (300 + l - 1) / l;
    let k = (m * l - t.sliding_margin_ms) / BUCKET_MS;
    if k <= 0 {
        return None;
    }
    let lo = r.from_ms.max(from);
    let off = ledger.max_offset_ms;
    // Global admissions per real-time bucket; None where a bucket mixes clock offsets.
    let mut real: BTreeMap<i64, Option<u64>> = BTreeMap::new();
    for per_host in &ledger.cells[task] {
        for (b, c) in per_host.range(lo - off - BUCKET_MS..hi + off + BUCKET_MS) {
            let e = real.entry(b - c.off_min).or_insert(Some(0));
            *e = match (*e, c.off_min == c.off_max) {
                (Some(n), true) => Some(n + c.global()),
                _ => None,
            };
        }
    }
    let redis_trouble: Vec<(i64, i64)> = ledger
        .disturbances
        .iter()
        .filter(|d| matches!(d.kind, Disturb::Redis { .. }))
        .map(|d| (d.from_ms - 500, d.to_ms.map_or(i64::MAX / 4, |x| x + 1_500)))
        .collect();
    let mut w = ceil_to(lo, BUCKET_MS);
    let mut next = None;
    while w + k * BUCKET_MS <= hi {
        let end = w + k * BUCKET_MS;
        next = Some(w + BUCKET_MS);
        let troubled = redis_trouble.iter().any(|(a, b)| *a < end && *b > w);
        let sum: Option<u64> = (0..k)
            .map(|i| real.get(&(w + i * BUCKET_MS)).copied().unwrap_or(Some(0)))
            .sum();
        if !troubled && let Some(sum) = sum {
            let b = m as u64
                * bound(spans, w, end, l)
                * loss_factor(ledger, w - l, end).max(super::modes::retire_factor(
                    ledger,
                    task,
                    w - l,
                    end,
                    t,
                ));
            cov.windows += 1;
            if sum > b {
                out.push(Violation {
                    invariant: "safety.window",
                    task: Some(task_name(task)),
                    slice: Some(w),
                    evidence: format!(
                        "window [{w}, {end}) ({} ms, slice {l} ms, m = {m}): {sum} admitted by the global quota > bound {b}",
                        k * BUCKET_MS
                    ),
                });
            }
        }
        w += BUCKET_MS;
    }
    next
}

/// The Redis side of the ambiguity windows of `task` that are complete before `upto` and not
/// in `done` (change start times; the caller keeps it): every key of the old and the new grid
/// there has `adm ≤ bound`, unless a host admitted by fallback around it.
pub fn check_changes(
    ledger: &Ledger,
    task: usize,
    upto: i64,
    done: &mut Vec<i64>,
    slices: &mut dyn Slices,
    t: &Timing,
    cov: &mut Coverage,
) -> Vec<Violation> {
    let spans = version_spans(ledger, task, t);
    let (_, changes) = regimes(ledger, task, t);
    let off = ledger.max_offset_ms;
    let mut out = Vec::new();
    for c in changes {
        if done.contains(&c.from_ms) {
            continue;
        }
        let longest = c.old.0.max(c.new.0) as i64;
        // Flushed counts arrive about a second after the slice.
        if c.to_ms + longest + off + t.data_lag_ms + 1_500 > upto {
            continue;
        }
        done.push(c.from_ms);
        // Only between two per-slice modes: hosts in mode local count their local admissions
        // in `adm`, and SLIDE counts by a window that is not the slice.
        if c.old.1 != Class::Slice || c.new.1 != Class::Slice {
            continue;
        }
        // The keys of both grids there (a key on both grids is one hash: read it once, with
        // the longer slice's allowances).
        let mut keys: BTreeMap<i64, i64> = BTreeMap::new();
        for (l, _) in [c.old, c.new] {
            let l = l as i64;
            for i in (c.from_ms - off).div_euclid(l)..=(c.to_ms + off).div_euclid(l) {
                let e = keys.entry(i * l).or_insert(l);
                *e = (*e).max(l);
            }
        }
        let starts: Vec<i64> = keys.keys().copied().collect();
        let Some(reads) = slices.read(task, &starts) else {
            continue;
        };
        for ((s, l), read) in keys.iter().zip(reads) {
            let Some(read) = read else { continue };
            let fb: u64 = ledger
                .sums(task, s - longest, s + l + longest)
                .iter()
                .map(|c| c.fb)
                .sum();
            if fb > 0 {
                continue;
            }
            let Some(b) = reused_key_bound(ledger, task, &spans, *s, *l, off) else {
                continue;
            };
            cov.redis_keys += 1;
            if read.adm > b {
                out.push(Violation {
                    invariant: "safety.redis_adm",
                    task: Some(task_name(task)),
                    slice: Some(*s),
                    evidence: format!(
                        "slice {s} ({l} ms, around the change {:?} → {:?}): adm {} flushed by the hosts > bound {b} (cap {})",
                        c.old, c.new, read.adm, read.cap
                    ),
                });
            }
        }
    }
    out
}

/// The bound on the `adm` a key `s` (length `l` on the grid of the change) may hold: a key is
/// named by its start only, so any other grid the task lived on whose slice starting at `s`
/// was in use (a later `put.slice`, a re-creation with another length) flushed into the same
/// hash, after the leader wrote it anew with that grid's cap. The bound is the sum, over every
/// such grid, of what one of its slices may admit there ([`cap_bound`]), times the
/// [`loss_factor`]. None when a grid in a mode that is not per-slice (local, exact_sliding)
/// used the key: its hosts count by another rule.
pub fn reused_key_bound(
    ledger: &Ledger,
    task: usize,
    spans: &[VersionSpan],
    s: i64,
    l: i64,
    off: i64,
) -> Option<u64> {
    let mut lengths: Vec<i64> = Vec::new();
    for r in &ledger.meta[task] {
        let MetaState::Live { slice_ms, class } = r.state else {
            continue;
        };
        let len = slice_ms as i64;
        if len <= 0 || s.rem_euclid(len) != 0 {
            continue;
        }
        // Hosts on this grid decided in [s, s + len) (their clocks within `off`).
        if r.first_ms > s + len + off || r.last_ms < s - off {
            continue;
        }
        if class != Class::Slice {
            return None;
        }
        if !lengths.contains(&len) {
            lengths.push(len);
        }
    }
    if lengths.is_empty() {
        lengths.push(l);
    }
    let sum: u64 = lengths
        .iter()
        .map(|&len| cap_bound(spans, s, s - off, s + len + off, len))
        .sum();
    let longest = lengths.iter().copied().max().unwrap_or(l);
    Some(sum * loss_factor(ledger, s - off - longest, s + longest + off))
}

/// What the fencing check remembers per task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FenceState {
    /// Write time of the newest version it tracks.
    pub version_at: i64,
    /// When the future slices first all fitted it.
    pub applied_at: Option<i64>,
    /// "Not applied" was reported for this version.
    pub late_reported: bool,
}

/// One fencing observation of `task` at `now`: the caps of its future slices
/// (`(start, cap)`, None for a missing key) on the newest spec's grid.
pub fn check_fencing(
    ledger: &Ledger,
    task: usize,
    now: i64,
    future: &[(i64, Option<u64>)],
    st: &mut FenceState,
    t: &Timing,
) -> Vec<Violation> {
    let Some(v) = ledger.newest(task) else {
        return Vec::new();
    };
    if st.version_at != v.at_ms {
        *st = FenceState {
            version_at: v.at_ms,
            ..FenceState::default()
        };
    }
    let (Some(spec), true) = (&v.spec, v.confirmed) else {
        return Vec::new();
    };
    let present: Vec<(i64, u64)> = future
        .iter()
        .filter_map(|(s, c)| Some((*s, (*c)?)))
        .collect();
    if present.is_empty() {
        return Vec::new();
    }
    let unfit: Vec<(i64, u64)> = present
        .iter()
        .copied()
        .filter(|(_, c)| !spec.allows(*c))
        .collect();
    if unfit.is_empty() {
        st.applied_at.get_or_insert(now);
        return Vec::new();
    }
    if let Some(at) = st.applied_at {
        return vec![Violation {
            invariant: "fencing.revert",
            task: Some(task_name(task)),
            slice: Some(unfit[0].0),
            evidence: format!(
                "future slices {unfit:?} (start, cap) do not fit the newest spec ({}), which they did at {at}",
                spec.describe()
            ),
        }];
    }
    let due = applied_by(ledger, v.at_ms, t) + t.not_applied_ms;
    if now > due && !st.late_reported {
        st.late_reported = true;
        return vec![Violation {
            invariant: "fencing.not_applied",
            task: Some(task_name(task)),
            slice: Some(unfit[0].0),
            evidence: format!(
                "the spec written at {} ({}) is not in the future slices {} ms after it could be: {unfit:?} (start, cap)",
                v.at_ms,
                spec.describe(),
                now - v.at_ms
            ),
        }];
    }
    Vec::new()
}

/// The decisions the eligible hosts asked for, summed over `cells` (one per host).
pub fn eligible_demand(cells: &[Cell], eligible: &[bool]) -> u64 {
    cells
        .iter()
        .zip(eligible)
        .filter(|(_, e)| **e)
        .map(|(c, _)| c.demand())
        .sum()
}

/// Liveness of `task` over the observation window `[w0, w1)` (real time). `eligible[h]`:
/// host `h`'s demand counts, and (with `per_host`) it must admit something — unless a host
/// leading the others may drain every slice before they reach it: `per_host` is what it can
/// take over its lead (its rate × its lead), and the check is skipped when that reaches the
/// lowest cap read in the window (seed 31337000: 300 ms at 150/s drained a cap of 44). Slices are summed
/// by key (each host's own clock) in the per-slice modes, and by real time for
/// `exact_sliding`, whose window runs on Redis time.
#[allow(clippy::too_many_arguments)]
pub fn check_liveness(
    ledger: &Ledger,
    task: usize,
    w0: i64,
    w1: i64,
    eligible: &[bool],
    per_host: Option<u64>,
    slices: &mut dyn Slices,
    cov: &mut Coverage,
) -> Vec<Violation> {
    let name = Some(task_name(task));
    let Some(spec) = ledger.newest(task).and_then(|v| v.spec.clone()) else {
        return Vec::new();
    };
    if spec.class() == Class::Local {
        return Vec::new();
    }
    let l = spec.slice_ms as i64;
    let off = ledger.max_offset_ms;
    let first = (w0 + off).div_euclid(l) * l + l;
    let starts: Vec<i64> = (0..)
        .map(|i| first + i * l)
        .take_while(|s| s + l + off <= w1)
        .collect();
    if starts.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let Some(reads) = slices.read(task, &starts) else {
        out.push(Violation {
            invariant: "liveness.redis",
            task: name,
            slice: None,
            evidence: "Redis could not be read at the end of a quiet period".into(),
        });
        return out;
    };
    // A host whose clock is off (not eligible) may cost up to one host's share of each slice
    // (documented in operations.md, clock skew): the 90 % is lowered by cap / hosts.
    let skew_share = if eligible.iter().all(|e| *e) {
        0.0
    } else {
        1.0 / eligible.len().max(1) as f64
    };
    let floor = |cap: u64| (0.9 - skew_share) * cap as f64;
    // exact_sliding: the whole window's total (see the module doc).
    let mut window = (0u64, 0u64);
    let mut lowest_cap = u64::MAX;
    for (s, read) in starts.iter().zip(reads) {
        cov.live_slices += 1;
        let Some(read) = read else {
            out.push(Violation {
                invariant: "liveness.slice_missing",
                task: name.clone(),
                slice: Some(*s),
                evidence: format!(
                    "slice {s} ({l} ms) of a live task has no cap in Redis: {}",
                    slices.describe(task, *s)
                ),
            });
            continue;
        };
        lowest_cap = lowest_cap.min(read.cap);
        // A machine starved for longer than a tenth of the slice (at least 25 ms, what the
        // SDK's pull policy absorbs) around it — the slice before included, where its first
        // chunk is prefetched — can lose more than the 10 % margin by itself: no limiter
        // serves a 100 ms slice while its hosts do not run. Not judged, and counted.
        if ledger.longest_stall(s - l - off, s + l + off) >= (l / 10).max(25) {
            cov.stalled_slices += 1;
            continue;
        }
        let cells = match spec.class() {
            Class::Window => ledger.real_sums(task, *s, s + l),
            _ => ledger.sums(task, *s, s + l),
        };
        let demand = eligible_demand(&cells, eligible);
        let admitted: u64 = cells.iter().map(Cell::quota).sum();
        let pressed = demand as f64 >= 1.1 * read.cap as f64;
        // A host whose `acquire_all` gave back more of this task's permits than it admitted
        // keeps them in its stock (docs/sdk.md, several limits: not returned to Redis) and asks
        // for them hollowly (the other part refuses): what it holds may stay unspent at the
        // slice's end — about a chunk and its low-water mark (the pull policy: a steady chunk
        // is share / 25 ≤ cap / 25, low water about half a chunk; a paced chunk at least
        // cap / 40): 3 · cap / 50 per such eligible host (ineligible hosts already have
        // `skew_share`). Approximate: on short slices the `rate × 4 round trips` floor of a
        // chunk can exceed it (a false alarm, never a miss).
        let holding = cells
            .iter()
            .zip(eligible)
            .filter(|(c, e)| **e && c.gb > 0 && c.gb >= c.global())
            .count() as f64;
        let floor = |cap: u64| floor(cap) - holding * (3.0 * cap as f64 / 50.0);
        if spec.class() == Class::Window {
            if pressed {
                window.0 += admitted;
                window.1 += read.cap;
            }
            continue;
        }
        if pressed && (admitted as f64) < floor(read.cap) {
            out.push(Violation {
                invariant: "liveness.total",
                task: name.clone(),
                slice: Some(*s),
                evidence: format!(
                    "slice {s} ({l} ms): {admitted} admitted by the global quota < {:.0} of cap {} ({:.0} %, less {holding} acquire_all host(s)' hold) with demand {demand} ({})",
                    floor(read.cap),
                    read.cap,
                    100.0 * (0.9 - skew_share),
                    breakdown(&cells)
                ),
            });
        }
    }
    if window.1 > 0 && (window.0 as f64) < floor(window.1) {
        out.push(Violation {
            invariant: "liveness.total",
            task: name.clone(),
            slice: Some(starts[0]),
            evidence: format!(
                "{} admitted by the sliding log in the slices of [{}, {}) with demand above their caps < {:.0} % of their caps' sum {}",
                window.0,
                starts[0],
                starts[starts.len() - 1] + l,
                100.0 * (0.9 - skew_share),
                window.1
            ),
        });
    }
    // Every eligible host that asked admitted something over the window — unless the machine
    // stalled in it (as above: its pulls may all have come too late).
    let (a, b) = (starts[0], starts[starts.len() - 1] + l);
    let Some(lead_drain) = per_host else {
        return out;
    };
    if lead_drain > 0 && lead_drain >= lowest_cap {
        return out;
    }
    if ledger.longest_stall(a - l - off, b + off) >= (l / 10).max(25) {
        cov.stalled_host_checks += 1;
        return out;
    }
    for (h, c) in ledger.sums(task, a, b).iter().enumerate() {
        if eligible.get(h).copied().unwrap_or(false) && c.demand() > 0 && c.quota() == 0 {
            out.push(Violation {
                invariant: "liveness.host",
                task: name.clone(),
                slice: Some(a),
                evidence: format!(
                    "host h{h} asked {} times in [{a}, {b}) and admitted nothing from the global quota (fallback {}, rejected {})",
                    c.demand(),
                    c.fb,
                    c.rej
                ),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::ledger::{ApiVersion, MetaState};
    use super::super::spec::Spec;
    use super::*;

    struct Map(HashMap<(usize, i64), SliceRead>);

    impl Slices for Map {
        fn read(&mut self, task: usize, starts: &[i64]) -> Option<Vec<Option<SliceRead>>> {
            Some(
                starts
                    .iter()
                    .map(|s| self.0.get(&(task, *s)).copied())
                    .collect(),
            )
        }
    }

    fn spec(threshold: u64, slice_ms: u64, mode: &'static str) -> Spec {
        Spec {
            threshold,
            slice_ms,
            local_limit: threshold,
            on_failure: "local",
            mode,
            fallback: None,
            schedules: Vec::new(),
            dynamic: None,
            modes: Default::default(),
        }
    }

    /// A ledger where task 0 runs `spec` from t = 0, meta observed every 250 ms until 60 s.
    fn ledger(spec: Spec) -> Ledger {
        let mut l = Ledger::new(1, 2);
        let state = MetaState::Live {
            slice_ms: spec.slice_ms,
            class: spec.class(),
        };
        l.api[0].push(ApiVersion {
            at_ms: 0,
            spec: Some(spec),
            confirmed: true,
        });
        for i in 0..=240 {
            l.observe_meta(0, i * 250, state);
        }
        l
    }

    /// Both hosts admit `per_bucket` in every 100 ms bucket of [from, until).
    fn fill(l: &mut Ledger, from: i64, until: i64, per_bucket: [u64; 2], fb: u64) {
        for b in (from..until).step_by(100) {
            for (h, n) in per_bucket.iter().enumerate() {
                l.count(0, h, b, *n, 5, fb, 0);
            }
        }
    }

    #[test]
    fn a_slice_over_its_cap_is_caught_and_one_within_is_not() {
        let mut l = ledger(spec(100, 1_000, "pooled"));
        fill(&mut l, 0, 60_000, [5, 5], 0); // 100 per slice: at the cap
        let mut cov = Coverage::default();
        let t = Timing::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        assert!(cov.slices >= 40, "{cov:?}");
        l.count(0, 1, 20_500, 1, 0, 0, 0); // one more in slice 20 000
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].invariant, v[0].slice), ("safety.slice", Some(20_000)));
    }

    #[test]
    fn a_paced_slice_ahead_of_its_pace_is_caught_and_agents_are_left_out() {
        let mut paced = spec(100, 1_000, "pooled");
        paced.modes.paced_burst = Some(10);
        let mut l = ledger(paced);
        fill(&mut l, 0, 60_000, [5, 5], 0); // on the curve: 10 per 100 ms of cap 100 / 1 s
        let reads = |burst| {
            let mut m = HashMap::new();
            for s in (0..60_000).step_by(1_000) {
                let r = SliceRead {
                    cap: 100,
                    adm: 100,
                    pace_burst: burst,
                    len: 1_000,
                };
                m.insert((0, s), r);
            }
            Map(m)
        };
        let t = Timing::default();
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut reads(Some(10)), &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        assert!(cov.paced_slices >= 40, "{cov:?}");
        // Slice 20 000: host 1 takes 15 more in the first bucket and 15 fewer in the last —
        // the slice's total is still the cap, but 25 by 20 100 > 10 + burst 10.
        l.count(0, 1, 20_000, 15, 0, 0, 0);
        l.cells[0][1].get_mut(&20_900).unwrap().adm -= 5;
        l.cells[0][0].get_mut(&20_900).unwrap().adm -= 5;
        l.cells[0][1].get_mut(&20_800).unwrap().adm -= 5;
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut reads(Some(10)), &t, &mut cov);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].invariant, v[0].slice), ("safety.pace", Some(20_000)));
        // An unpaced slice may do that; and host 1 as an agent's driver is not summed.
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut reads(None), &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        l.sdk_hosts = 1;
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut reads(Some(10)), &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        // A slice whose `len` is not the grid's (a new grid rewrote the ended key it reused,
        // with its own cap and pace) or a dynamic spec (the leader moves caps mid-slice): not
        // judged.
        l.sdk_hosts = 2;
        let mut other = reads(Some(10));
        for r in other.0.values_mut() {
            r.len = 2_000;
        }
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut other, &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        let mut dynamic = l.api[0][0].spec.clone().unwrap();
        dynamic.dynamic = Some(super::super::spec::Dynamic {
            enabled: true,
            min: 50,
            max: 100,
        });
        let mut ld = ledger(dynamic);
        ld.cells = l.cells.clone();
        let (v, _) = check_safety(&ld, 0, 0, 50_000, &mut reads(Some(10)), &t, &mut cov);
        assert!(v.iter().all(|v| v.invariant != "safety.pace"), "{v:?}");
        // A Redis data loss around the slice: not judged.
        let i = l.begin(Disturb::Redis { lost: true }, 20_400);
        l.end(i, 20_450);
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut reads(Some(10)), &t, &mut cov);
        assert!(v.iter().all(|v| v.invariant != "safety.pace"), "{v:?}");
    }

    #[test]
    fn fallback_admissions_do_not_count_and_the_old_cap_stays_legitimate_for_a_while() {
        let mut l = ledger(spec(200, 1_000, "pooled"));
        fill(&mut l, 0, 60_000, [10, 10], 0); // 200 per slice
        fill(&mut l, 30_000, 31_000, [50, 0], 50); // fallback on top
        l.api[0].push(ApiVersion {
            at_ms: 20_000,
            spec: Some(spec(100, 1_000, "pooled")),
            confirmed: true,
        });
        let t = Timing::default();
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        // 200 per slice is legitimate until the new cap is applied (20 s + 3 s), then not.
        let bad: Vec<i64> = v.iter().filter_map(|v| v.slice).collect();
        // Legitimate: slices starting up to 2 s (prefetch + 1 s) after the old span's end.
        assert!(bad.iter().all(|s| *s >= 26_000), "{bad:?}");
        assert!(bad.contains(&26_000) && bad.contains(&40_000), "{bad:?}");
        assert!(!bad.is_empty() && v.iter().all(|v| v.invariant == "safety.slice"));
    }

    #[test]
    fn a_leader_outage_keeps_the_old_cap_legitimate_until_it_settles() {
        let mut l = ledger(spec(200, 1_000, "pooled"));
        l.api[0].push(ApiVersion {
            at_ms: 20_000,
            spec: Some(spec(100, 1_000, "pooled")),
            confirmed: true,
        });
        let i = l.begin(Disturb::Leader, 19_000);
        l.end(i, 30_000);
        let t = Timing::default();
        assert_eq!(applied_by(&l, 20_000, &t), 30_000 + 3_000 + 3_000);
        let spans = version_spans(&l, 0, &t);
        assert_eq!(bound(&spans, 35_000, 36_000, 1_000), 200);
        assert_eq!(
            bound(&spans, 38_000, 39_000, 1_000),
            200,
            "prefetch allowance"
        );
        assert_eq!(bound(&spans, 39_000, 40_000, 1_000), 100);
    }

    #[test]
    fn after_a_deletion_nothing_is_admitted_but_written_caps_may_stay() {
        let mut l = ledger(spec(100, 1_000, "pooled"));
        l.api[0].push(ApiVersion {
            at_ms: 20_000,
            spec: None,
            confirmed: true,
        });
        fill(&mut l, 0, 22_000, [5, 5], 0);
        let mut m = HashMap::new();
        for s in (0..60_000).step_by(1_000) {
            m.insert(
                (0, s),
                SliceRead {
                    cap: 100,
                    adm: 0,
                    pace_burst: None,
                    len: 0,
                },
            );
        }
        let t = Timing::default();
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(m.clone()), &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        l.count(0, 0, 40_000, 1, 0, 0, 0); // one admission from the global quota, 20 s later
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(m), &t, &mut cov);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].invariant, v[0].slice), ("safety.slice", Some(40_000)));
    }

    #[test]
    fn a_slice_in_progress_when_redis_lost_its_data_may_admit_twice() {
        let mut l = ledger(spec(100, 1_000, "pooled"));
        fill(&mut l, 0, 60_000, [5, 5], 0);
        fill(&mut l, 20_000, 21_000, [5, 5], 0); // 200 in slice 20 000
        fill(&mut l, 40_000, 41_000, [5, 5], 0); // 200 in slice 40 000
        let i = l.begin(Disturb::Redis { lost: true }, 20_400);
        l.end(i, 20_450);
        let i = l.begin(Disturb::Redis { lost: false }, 40_400);
        l.end(i, 40_450);
        let t = Timing::default();
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        let bad: Vec<Option<i64>> = v.iter().map(|v| v.slice).collect();
        assert_eq!(bad, vec![Some(40_000)], "a sleep loses nothing: {v:?}");
    }

    #[test]
    fn a_grid_change_is_ambiguous_and_checked_in_redis() {
        let mut l = ledger(spec(100, 1_000, "pooled"));
        l.meta[0].clear();
        for i in 0..=80 {
            l.observe_meta(
                0,
                i * 250,
                MetaState::Live {
                    slice_ms: 1_000,
                    class: Class::Slice,
                },
            );
        }
        for i in 81..=240 {
            l.observe_meta(
                0,
                i * 250,
                MetaState::Live {
                    slice_ms: 500,
                    class: Class::Slice,
                },
            );
        }
        l.api[0].push(ApiVersion {
            at_ms: 20_100,
            spec: Some(spec(50, 500, "pooled")),
            confirmed: true,
        });
        // Hosts keep the old grid until 21 s: 100 per 1 s, then 50 per 500 ms.
        fill(&mut l, 0, 21_000, [5, 5], 0);
        fill(&mut l, 21_000, 60_000, [5, 5], 0);
        let t = Timing::default();
        let (regs, changes) = regimes(&l, 0, &t);
        assert_eq!(regs.len(), 2);
        assert_eq!(changes.len(), 1);
        assert_eq!((changes[0].from_ms, changes[0].to_ms), (19_800, 22_750));
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        // Redis: one key of the new grid got 80 flushed with cap 50 (bound: max(100, 50)).
        let mut m = HashMap::new();
        m.insert(
            (0, 21_500),
            SliceRead {
                cap: 50,
                adm: 80,
                pace_burst: None,
                len: 0,
            },
        );
        m.insert(
            (0, 22_000),
            SliceRead {
                cap: 50,
                adm: 120,
                pace_burst: None,
                len: 0,
            },
        );
        let mut done = Vec::new();
        let v = check_changes(&l, 0, 40_000, &mut done, &mut Map(m), &t, &mut cov);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(
            (v[0].invariant, v[0].slice),
            ("safety.redis_adm", Some(22_000))
        );
        assert_eq!(done, vec![19_800]);
    }

    #[test]
    fn sliding_windows_shorter_than_the_slice_by_the_margin() {
        let mut l = ledger(spec(40, 1_000, "exact_sliding"));
        // 40 admissions in 800 ms every 2 s: fine; then 41 within 800 ms: caught.
        for start in (4_000..40_000).step_by(2_000) {
            for b in (start..start + 800).step_by(100) {
                l.count(0, 0, b, 5, 0, 0, 0);
            }
        }
        let t = Timing::default();
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        assert!(v.is_empty(), "{v:?}");
        assert!(cov.windows > 300);
        l.count(0, 1, 10_300, 1, 0, 0, 0);
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        assert!(
            !v.is_empty() && v.iter().all(|v| v.invariant == "safety.window"),
            "{v:?}"
        );
    }

    #[test]
    fn a_faketime_host_is_moved_back_by_its_offset_for_windows() {
        let mut l = ledger(spec(40, 1_000, "exact_sliding"));
        // Host 1 is +500 ms: its buckets 10 500..11 300 were decided at 10 000..10 800 real.
        for b in (10_000..10_400).step_by(100) {
            l.count(0, 0, b, 5, 0, 0, 0);
        }
        for b in (10_900..11_300).step_by(100) {
            l.count(0, 1, b, 5, 0, 0, 500);
        }
        let t = Timing::default();
        let mut cov = Coverage::default();
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        assert!(v.is_empty(), "40 in 800 ms real time: {v:?}");
        l.count(0, 1, 11_200, 1, 0, 0, 500);
        let (v, _) = check_safety(&l, 0, 0, 50_000, &mut Map(HashMap::new()), &t, &mut cov);
        assert!(!v.is_empty(), "41 in 800 ms real time");
    }

    #[test]
    fn fencing_catches_a_revert_and_a_spec_never_applied() {
        let mut l = ledger(spec(100, 1_000, "pooled"));
        let t = Timing::default();
        let mut st = FenceState::default();
        let ok = [(10_000, Some(100)), (11_000, Some(100)), (12_000, None)];
        assert!(check_fencing(&l, 0, 5_000, &ok, &mut st, &t).is_empty());
        assert_eq!(st.applied_at, Some(5_000));
        let old = [(11_000, Some(100)), (12_000, Some(70))];
        let v = check_fencing(&l, 0, 6_000, &old, &mut st, &t);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].invariant, "fencing.revert");
        // A new version that never shows up.
        l.api[0].push(ApiVersion {
            at_ms: 20_000,
            spec: Some(spec(300, 1_000, "pooled")),
            confirmed: true,
        });
        let stale = [(30_000, Some(100))];
        assert!(check_fencing(&l, 0, 25_000, &stale, &mut st, &t).is_empty());
        let v = check_fencing(&l, 0, 34_000, &stale, &mut st, &t);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].invariant, "fencing.not_applied");
        assert!(
            check_fencing(&l, 0, 35_000, &stale, &mut st, &t).is_empty(),
            "reported once"
        );
    }

    #[test]
    fn sliding_liveness_is_counted_in_real_time() {
        // Cap 100 per 1 s window: host 0 admits at 500–900 ms of every second, host 1 (clock
        // +300 ms) at 800–1 200 ms of its own seconds — the same real time.
        let mut l = ledger(spec(100, 1_000, "exact_sliding"));
        for s in (0..10_000).step_by(1_000) {
            for b in (s + 500..s + 1_000).step_by(100) {
                l.count(0, 0, b, 10, 20, 0, 0);
                l.count(0, 1, b + 300, 10, 20, 0, 300);
            }
        }
        let mut m = HashMap::new();
        for s in (0..10_000).step_by(1_000) {
            m.insert(
                (0, s),
                SliceRead {
                    cap: 100,
                    adm: 100,
                    pace_burst: None,
                    len: 0,
                },
            );
        }
        let mut cov = Coverage::default();
        let v = check_liveness(
            &l,
            0,
            0,
            10_000,
            &[true, true],
            Some(0),
            &mut Map(m),
            &mut cov,
        );
        assert!(v.is_empty(), "{v:?}");
    }

    #[test]
    fn liveness_needs_ninety_percent_and_every_host() {
        let mut l = ledger(spec(100, 1_000, "pooled"));
        fill(&mut l, 0, 10_000, [9, 0], 0); // host 1 admits nothing
        let mut m = HashMap::new();
        for s in (0..10_000).step_by(1_000) {
            m.insert(
                (0, s),
                SliceRead {
                    cap: 100,
                    adm: 90,
                    pace_burst: None,
                    len: 0,
                },
            );
        }
        let live = |l: &Ledger, eligible: &[bool], per_host: Option<u64>| {
            let mut cov = Coverage::default();
            check_liveness(
                l,
                0,
                0,
                10_000,
                eligible,
                per_host,
                &mut Map(m.clone()),
                &mut cov,
            )
        };
        let v = live(&l, &[true, true], Some(0));
        assert_eq!(v.len(), 1, "{v:?}");
        // A leading host that can take a whole slice (cap 100) over its lead may leave the
        // others nothing: not judged per host; one that cannot, is.
        assert!(live(&l, &[true, true], Some(100)).is_empty());
        assert_eq!(live(&l, &[true, true], Some(99)).len(), 1);
        assert_eq!(v[0].invariant, "liveness.host");
        assert!(
            live(&l, &[true, false], Some(0)).is_empty(),
            "host 1 not eligible"
        );
        assert!(
            live(&l, &[true, true], None).is_empty(),
            "no per-host check"
        );
        // With a host off (not eligible), one host's share may be missing: 90 − 50 = 40 %.
        let mut l3 = ledger(spec(100, 1_000, "pooled"));
        fill(&mut l3, 0, 10_000, [6, 0], 0); // 60 % of the cap; host 0 asks 110 a slice
        assert!(live(&l3, &[true, false], None).is_empty());
        assert!(
            !live(&l3, &[true, true], None).is_empty(),
            "60 % with every host eligible"
        );
        // 80 % of the cap with enough demand: too little.
        let mut l2 = ledger(spec(100, 1_000, "pooled"));
        fill(&mut l2, 0, 10_000, [4, 4], 0);
        let v = live(&l2, &[true, true], Some(0));
        assert!(
            !v.is_empty() && v.iter().all(|v| v.invariant == "liveness.total"),
            "{v:?}"
        );
        // Unless a host's acquire_all gave back more permits than it admitted in the slice:
        // it may hold 3 · cap / 50 unspent (90 − 6 = 84 % of the cap with one such host, 78 %
        // with two). Fewer given back than admitted: no allowance.
        for b in (0..10_000).step_by(100) {
            l2.count_given_back(0, 0, b, 3);
        }
        assert!(
            !live(&l2, &[true, true], Some(0)).is_empty(),
            "gb 30 < adm 40"
        );
        for b in (0..10_000).step_by(100) {
            l2.count_given_back(0, 0, b, 2);
        }
        let v = live(&l2, &[true, true], Some(0));
        assert!(!v.is_empty(), "80 % < 84 %: {v:?}");
        for b in (0..10_000).step_by(100) {
            l2.count_given_back(0, 1, b, 5);
        }
        let v = live(&l2, &[true, true], Some(0));
        assert!(v.is_empty(), "80 % ≥ 78 %: {v:?}");
    }

    /// Issue 23 item 19: a slice around which the machine stalled for more than a tenth of
    /// it (at least 25 ms) is not judged, and counted; a shorter stall changes nothing; the
    /// per-host check of a window with such a stall is not made either.
    #[test]
    fn liveness_skips_slices_around_a_stall_and_counts_them() {
        let mut l = ledger(spec(100, 1_000, "pooled"));
        fill(&mut l, 0, 10_000, [4, 4], 0); // 80 %: too little wherever judged
        let mut m = HashMap::new();
        for s in (0..10_000).step_by(1_000) {
            m.insert(
                (0, s),
                SliceRead {
                    cap: 100,
                    adm: 80,
                    pace_burst: None,
                    len: 0,
                },
            );
        }
        let run = |l: &Ledger| {
            let mut cov = Coverage::default();
            let v = check_liveness(
                l,
                0,
                0,
                10_000,
                &[true, true],
                None,
                &mut Map(m.clone()),
                &mut cov,
            );
            (v.len(), cov.stalled_slices, cov.live_slices)
        };
        let (all, none, judged) = run(&l);
        assert_eq!(none, 0);
        assert_eq!(all as u64, judged, "every slice too low");
        // 99 ms in [5_000, 5_099): shorter than a tenth of a 1 s slice.
        l.stalls.push((5_000, 5_099));
        assert_eq!(run(&l).0, all);
        // 100 ms at 5_500: slices 5_000 (its own) and 6_000 (prefetched in 5_000's) skipped.
        l.stalls.push((5_500, 5_600));
        let (v, stalled, _) = run(&l);
        assert_eq!((v, stalled), (all - 2, 2));
        // The per-host check: host 1 admits nothing; judged without a stall, not with one.
        let mut l = ledger(spec(100, 1_000, "pooled"));
        fill(&mut l, 0, 10_000, [9, 0], 0);
        let host = |l: &Ledger| {
            check_liveness(
                l,
                0,
                0,
                10_000,
                &[true, true],
                Some(0),
                &mut Map(m.clone()),
                &mut Coverage::default(),
            )
            .iter()
            .filter(|v| v.invariant == "liveness.host")
            .count()
        };
        assert_eq!(host(&l), 1);
        l.stalls.push((5_500, 5_600));
        assert_eq!(host(&l), 0);
    }

    #[test]
    fn a_new_grid_may_raise_the_cap_of_an_ended_old_slice_with_the_same_start() {
        // 500 ms slices at 279 until a 2 s spec at 783 is written at 856_700: the new grid's
        // current slice starts at 856_000, the key of the ended old slice [856_000, 856_500).
        let spans = [
            VersionSpan {
                from_ms: 0,
                until_ms: 859_700,
                max_cap: 279,
                slice_ms: 500,
                dynamic: false,
            },
            VersionSpan {
                from_ms: 856_700,
                until_ms: i64::MAX / 4,
                max_cap: 783,
                slice_ms: 2_000,
                dynamic: false,
            },
        ];
        assert_eq!(bound(&spans, 856_000, 856_500, 500), 279);
        assert_eq!(cap_bound(&spans, 856_000, 856_000, 856_500, 500), 783);
        // A key off the new grid cannot get the new cap.
        assert_eq!(cap_bound(&spans, 855_500, 855_500, 856_000, 500), 279);
        // Nor one whose new-grid slice had ended before the change.
        assert_eq!(cap_bound(&spans, 852_000, 852_000, 852_500, 500), 279);
    }

    #[test]
    fn a_key_reused_by_a_later_grid_counts_both_grids_caps() {
        // Seed 203: 2 s slices at 100, then 1 s (put.slice at 10 s), then a re-creation on
        // 10 s slices at 4 000 (at 13 s) whose slice [10 000, 20 000) reuses the key of the
        // 2 s slice and of the 1 s slice starting at 10 000.
        let run = |third_class: Class| {
            let mut l = Ledger::new(1, 2);
            for (at, sp) in [
                (0, spec(100, 2_000, "pooled")),
                (10_000, spec(50, 1_000, "pooled")),
                (13_000, spec(4_000, 10_000, "pooled")),
            ] {
                l.api[0].push(ApiVersion {
                    at_ms: at,
                    spec: Some(sp),
                    confirmed: true,
                });
            }
            for i in 0..=240 {
                let (slice_ms, class) = match i * 250 {
                    t if t < 10_250 => (2_000, Class::Slice),
                    t if t < 13_250 => (1_000, Class::Slice),
                    _ => (10_000, third_class),
                };
                l.observe_meta(0, i * 250, MetaState::Live { slice_ms, class });
            }
            l
        };
        let t = Timing::default();
        let spans = version_spans(&run(Class::Slice), 0, &t);
        let l = run(Class::Slice);
        // 2 s grid 100 + 1 s grid 50 + 10 s grid 4 000 (the caps live around the key).
        let b = reused_key_bound(&l, 0, &spans, 10_000, 2_000, 0).unwrap();
        assert!(b >= 4_150, "{b}");
        // A key no later grid reused keeps the tight bound.
        let b = reused_key_bound(&l, 0, &spans, 6_000, 2_000, 0).unwrap();
        assert_eq!(b, 100);
        // A key a local-mode grid wrote to is not checked (local admissions are counted there).
        let l = run(Class::Local);
        assert_eq!(reused_key_bound(&l, 0, &spans, 10_000, 2_000, 0), None);
    }
}
