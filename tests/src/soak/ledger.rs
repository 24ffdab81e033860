//! What happened during a soak, as data the checks read: the spec versions the soak wrote (and
//! when), the task meta observed in Redis (which slice grid and mode the hosts follow), the
//! disturbances, and the load generators' counts per 100 ms bucket and host.
//!
//! Times are Unix ms on the soak's clock, which is Redis's (one machine). A host under faketime
//! buckets its decisions on its own clock: bucket `b` of a host with offset `o` was decided at
//! real time `b − o` — but it drew on the slice key of `b`, which is what the per-slice bound is
//! about, so counts are kept by the host's own bucket, with the offset beside them.

use std::collections::BTreeMap;

use super::spec::{Class, Spec};

/// Width of the load generators' buckets (`--bucket-ms`), ms.
pub const BUCKET_MS: i64 = 100;

/// One host's counts in one bucket of one task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cell {
    /// Admitted decisions (fallback included).
    pub adm: u64,
    /// Rejected decisions.
    pub rej: u64,
    /// Fallback-admitted decisions (part of `adm`).
    pub fb: u64,
    /// Smallest clock offset of the runs that counted here.
    pub off_min: i64,
    /// Largest clock offset of the runs that counted here.
    pub off_max: i64,
    /// Agent hosts: admissions by the global quota whose slice is not known (the request and
    /// its answer straddle a bucket edge); part of `fb`, so the safety sums leave them out,
    /// and liveness counts them ([`Cell::quota`]).
    pub strad: u64,
    /// Agent hosts: straddling admissions attributed to another bucket whose request was in
    /// flight during this one (the agent may have charged this bucket's slice: liveness counts
    /// them as possibly here, [`Cell::quota`]).
    pub reach: u64,
    /// Shadow-admitted decisions (part of `adm`: the limit would have rejected them).
    pub sh: u64,
    /// Agent hosts: admissions of a task that may have been in shadow mode (part of `sh`:
    /// not the quota's for safety; possibly the quota's for liveness, [`Cell::quota`]).
    pub amb: u64,
    /// `--all-with` runs: permits this task's part took and gave back (a later part refused,
    /// or the decision was cancelled). Not decisions: they stay in the host's stock.
    pub gb: u64,
}

impl Cell {
    /// Admitted by the global quota (neither by fallback nor by shadow mode).
    pub fn global(&self) -> u64 {
        self.adm.saturating_sub(self.fb + self.sh)
    }

    /// Admitted by the global quota, whether or not the slice is known, plus what an agent
    /// host may have admitted here and counted elsewhere (liveness: an upper bound, so the
    /// floor never fires on where an answer arrived).
    pub fn quota(&self) -> u64 {
        self.global() + self.strad.min(self.fb) + self.reach + self.amb
    }

    /// Decisions asked for.
    pub fn demand(&self) -> u64 {
        self.adm + self.rej
    }
}

/// A spec the soak wrote (or deleted: `spec` None).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiVersion {
    /// When the request was sent.
    pub at_ms: i64,
    /// The spec; None for a deletion.
    pub spec: Option<Spec>,
    /// False when the call's outcome is unknown (timeout): it may or may not have been made.
    pub confirmed: bool,
}

/// What the task's meta hash in Redis said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaState {
    /// No meta hash (Redis lost it, or never written).
    Missing,
    /// A deletion tombstone.
    Tombstone,
    /// A live task: the grid and mode the hosts follow.
    Live {
        /// Slice length, ms.
        slice_ms: u64,
        /// Class of the mode.
        class: Class,
    },
}

/// A run of equal meta observations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaRun {
    /// First observation.
    pub first_ms: i64,
    /// Last observation.
    pub last_ms: i64,
    /// What was observed.
    pub state: MetaState,
}

/// What a disturbance disturbed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disturb {
    /// A replica (the leader) killed, stopped or terminated: rolling may pause.
    Leader,
    /// Redis restarted or flushed (`lost`: its data is gone, so the consumption of slices in
    /// progress is forgotten) or sleeping (`DEBUG SLEEP`).
    Redis {
        /// Data was lost.
        lost: bool,
    },
    /// etcd down.
    Etcd,
    /// A host's load generators killed.
    Host(usize),
    /// The faketime host's clock moved.
    Clock,
}

/// A disturbance and when it lasted (`to_ms` None while it lasts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disturbance {
    /// Kind.
    pub kind: Disturb,
    /// Start.
    pub from_ms: i64,
    /// End (repair done), if repaired.
    pub to_ms: Option<i64>,
}

/// Everything recorded.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    /// Spec versions per task, in time order.
    pub api: Vec<Vec<ApiVersion>>,
    /// Meta observations per task, run-length encoded.
    pub meta: Vec<Vec<MetaRun>>,
    /// Disturbances in start order.
    pub disturbances: Vec<Disturbance>,
    /// Counts per task, per host, by the host's bucket start.
    pub cells: Vec<Vec<BTreeMap<i64, Cell>>>,
    /// Largest |clock offset| any host ran with.
    pub max_offset_ms: i64,
    /// When the machine was starved: real-time intervals `[from, to)` in which the soak's
    /// stall probe (a thread sleeping 10 ms in a loop) or a load generator's paced loop (its
    /// progress lines' `late`, placed at the bucket's end) woke up late by at least
    /// [`STALL_MIN_MS`]. Liveness is not judged across them (see `check_liveness`).
    pub stalls: Vec<(i64, i64)>,
    /// Hosts `0 .. sdk_hosts` decide through the SDK in the load generator, which stamps each
    /// bucket with the time the decision was charged at; the others are agents' drivers.
    pub sdk_hosts: usize,
}

/// The smallest wake-up delay of the stall probe recorded as a stall, ms.
pub const STALL_MIN_MS: i64 = 15;

impl Ledger {
    /// Whether a shadow version of `task` may have been applied at `at_ms` (any version from
    /// 10 s before its successor was written back to 10 s after it was written): an agent
    /// host cannot tell a shadow admission from one by the quota (RLS answers OK for both).
    pub fn maybe_shadow(&self, task: usize, at_ms: i64) -> bool {
        let v = &self.api[task];
        v.iter().enumerate().any(|(i, x)| {
            let until = v
                .get(i + 1)
                .map_or(i64::MAX, |n| n.at_ms.saturating_add(10_000));
            x.spec.as_ref().is_some_and(|s| s.modes.shadow)
                && x.at_ms.saturating_sub(10_000) <= at_ms
                && at_ms < until
        })
    }

    /// The longest stall overlapping `[from, to)`, ms (0 = none).
    pub fn longest_stall(&self, from: i64, to: i64) -> i64 {
        self.stalls
            .iter()
            .filter(|(a, b)| *a < to && *b > from)
            .map(|(a, b)| b - a)
            .max()
            .unwrap_or(0)
    }

    /// An empty ledger for `tasks` tasks on `hosts` hosts.
    pub fn new(tasks: usize, hosts: usize) -> Self {
        Self {
            api: vec![Vec::new(); tasks],
            meta: vec![Vec::new(); tasks],
            disturbances: Vec::new(),
            cells: vec![vec![BTreeMap::new(); hosts]; tasks],
            max_offset_ms: 0,
            stalls: Vec::new(),
            sdk_hosts: hosts,
        }
    }

    /// Adds one progress line.
    #[allow(clippy::too_many_arguments)]
    pub fn count(
        &mut self,
        task: usize,
        host: usize,
        bucket: i64,
        adm: u64,
        rej: u64,
        fb: u64,
        offset_ms: i64,
    ) {
        self.max_offset_ms = self.max_offset_ms.max(offset_ms.abs());
        let c = self.cells[task][host].entry(bucket).or_insert(Cell {
            off_min: offset_ms,
            off_max: offset_ms,
            ..Cell::default()
        });
        c.adm += adm;
        c.rej += rej;
        c.fb += fb.min(adm);
        c.off_min = c.off_min.min(offset_ms);
        c.off_max = c.off_max.max(offset_ms);
    }

    /// Adds `n` straddling admissions (already counted in `adm` and `fb`) of an agent host.
    pub fn count_straddled(&mut self, task: usize, host: usize, bucket: i64, n: u64) {
        if let Some(c) = self.cells[task][host].get_mut(&bucket) {
            c.strad += n;
        }
    }

    /// Adds `n` admissions of an agent host that were in flight during `bucket` and counted
    /// in another ([`Cell::reach`]).
    pub fn count_reach(&mut self, task: usize, host: usize, bucket: i64, n: u64) {
        self.cells[task][host].entry(bucket).or_default().reach += n;
    }

    /// Marks `n` of a cell's shadow-admitted decisions as an agent host's ambiguous ones
    /// ([`Cell::amb`]).
    pub fn count_ambiguous(&mut self, task: usize, host: usize, bucket: i64, n: u64) {
        if let Some(c) = self.cells[task][host].get_mut(&bucket) {
            c.amb = (c.amb + n).min(c.sh);
        }
    }

    /// Adds permits an `--all-with` run's part took and gave back ([`Cell::gb`]).
    pub fn count_given_back(&mut self, task: usize, host: usize, bucket: i64, n: u64) {
        if let Some(c) = self.cells[task][host].get_mut(&bucket) {
            c.gb += n;
        }
    }

    /// Adds shadow-admitted decisions to a cell [`Ledger::count`] made.
    pub fn count_shadow(&mut self, task: usize, host: usize, bucket: i64, sh: u64) {
        if let Some(c) = self.cells[task][host].get_mut(&bucket) {
            c.sh = (c.sh + sh).min(c.adm.saturating_sub(c.fb));
        }
    }

    /// Records a meta observation at `at_ms`.
    pub fn observe_meta(&mut self, task: usize, at_ms: i64, state: MetaState) {
        let runs = &mut self.meta[task];
        match runs.last_mut() {
            Some(r) if r.state == state => r.last_ms = at_ms,
            _ => runs.push(MetaRun {
                first_ms: at_ms,
                last_ms: at_ms,
                state,
            }),
        }
    }

    /// Starts a disturbance now; returns its index (for [`Ledger::end`]).
    pub fn begin(&mut self, kind: Disturb, at_ms: i64) -> usize {
        self.disturbances.push(Disturbance {
            kind,
            from_ms: at_ms,
            to_ms: None,
        });
        self.disturbances.len() - 1
    }

    /// Ends disturbance `i`.
    pub fn end(&mut self, i: usize, at_ms: i64) {
        if let Some(d) = self.disturbances.get_mut(i) {
            d.to_ms.get_or_insert(at_ms);
        }
    }

    /// Sum of one host's cells of `task` with buckets in `[from, until)`.
    pub fn host_sum(&self, task: usize, host: usize, from: i64, until: i64) -> Cell {
        let mut s = Cell {
            off_min: i64::MAX,
            off_max: i64::MIN,
            ..Cell::default()
        };
        for c in self.cells[task][host].range(from..until).map(|(_, c)| c) {
            s.adm += c.adm;
            s.rej += c.rej;
            s.fb += c.fb;
            s.strad += c.strad;
            s.amb += c.amb;
            s.reach += c.reach;
            s.sh += c.sh;
            s.gb += c.gb;
            s.off_min = s.off_min.min(c.off_min);
            s.off_max = s.off_max.max(c.off_max);
        }
        s
    }

    /// Per-host sums of `task` over the buckets `[from, until)` (key attribution: the hosts'
    /// own clocks).
    pub fn sums(&self, task: usize, from: i64, until: i64) -> Vec<Cell> {
        (0..self.cells[task].len())
            .map(|h| self.host_sum(task, h, from, until))
            .collect()
    }

    /// Per-host sums of `task` over the decisions made in `[from, until)` of real time (a
    /// host's bucket `b` moved back by its offset: what a sliding window by Redis time sees).
    pub fn real_sums(&self, task: usize, from: i64, until: i64) -> Vec<Cell> {
        let off = self.max_offset_ms;
        (0..self.cells[task].len())
            .map(|h| {
                let mut s = Cell::default();
                for (b, c) in self.cells[task][h].range(from - off..until + off) {
                    if (from..until).contains(&(b - c.off_min)) {
                        s.adm += c.adm;
                        s.rej += c.rej;
                        s.fb += c.fb;
                        s.strad += c.strad;
                        s.amb += c.amb;
                        s.reach += c.reach;
                        s.sh += c.sh;
                        s.gb += c.gb;
                    }
                }
                s
            })
            .collect()
    }

    /// Forgets buckets older than `before` (memory stays bounded on long runs).
    pub fn prune(&mut self, before: i64) {
        for per_task in &mut self.cells {
            for per_host in per_task {
                *per_host = per_host.split_off(&before);
            }
        }
        self.stalls.retain(|(_, to)| *to >= before);
    }

    /// The newest spec version of `task`, if any.
    pub fn newest(&self, task: usize) -> Option<&ApiVersion> {
        self.api[task].last()
    }
}
