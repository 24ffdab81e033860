//! Traffic history: the leader copies every slice's `cap`, `adm` and `rej` into two compact,
//! fixed-size rings per task before the slice keys expire, so the dashboard can show an hour
//! at one-second resolution and a week at one-minute resolution.
//!
//! # Layout
//!
//! ```text
//!  NS:{T}:hist:1s   string, 3 600 slots × 48 B = 173 KB: one record per second, kept 1 h
//!  NS:{T}:hist:1m   string, 10 080 slots × 48 B = 484 KB: one record per minute, kept 7 days
//!
//!  record, little-endian (48 bytes):
//!  ┌─────────────────────────┬────────────┬─────────────┬──────────────┬──────────────┬───────────────┬─────────────┐
//!  │ tag u32 = start_ms/1000 │ slices u32 │ cap_sum u64 │ admitted u64 │ rejected u64 │ would_rej u64 │ span_ms u64 │
//!  └─────────────────────────┴────────────┴─────────────┴──────────────┴──────────────┴───────────────┴─────────────┘
//!  slot = (start_ms / resolution) mod slots; byte offset = slot × 48
//!
//!  (Records were 32 bytes, without would_reject, before shadow mode, and 40 bytes, without
//!  span_ms, before issue 23: rings written by an older manager read as empty after the
//!  upgrade, since the tags at the new offsets do not match, and are rewritten within the
//!  settle time from the slices still in Redis.)
//! ```
//!
//! A record sums the slices that *start* in its bucket: `slices` of them, whose caps add up to
//! `cap_sum` and whose lengths add up to `span_ms`. The record carries its own slice lengths
//! because a task's `slice_ms` changes: a second that ran 5,000 admitted in one 1 s slice is
//! 5,000/s (`admitted × 1000 / span_ms`), whatever the slice length is today; dividing by the
//! current length (2 s) would draw it at 2,500/s. Only buckets that saw traffic (admitted or rejected) are written, so a task that
//! never sees traffic has no history keys at all, and an idle stretch of a busy task reads as
//! no records (the threshold of idle slices is not kept). A slot whose tag is not the bucket asked for holds an older lap of the ring (or
//! nothing): it reads as empty. Memory per task is therefore bounded (657 KB at most, whatever
//! the traffic; none for a task that never had traffic), writes are `SETRANGE` in place, reads are one or two `GETRANGE`s, and the
//! history survives a leader failover because it lives in Redis. Both keys share the task's
//! hash tag, so they sit in the task's Redis Cluster slot; they expire when no longer written,
//! and deleting the task deletes them (RETIRE), so a task re-created under the same name
//! starts with an empty history. Records are written by a fenced script
//! ([`scripts::record_history`]) that refuses a deleted task, so a harvest racing the
//! deletion cannot bring the rings back.
//!
//! # Harvesting
//!
//! ```text
//!  slices:  │ s │ s │ s │ s │ s │ s │ s │ s │ s │ s │ (current)
//!           ◀── harvested ──▶◀── settling ──▶
//!                        done_to         now − settle − slice_ms
//! ```
//!
//! Every second the leader reads, for every task at once (one pipeline per task, all tasks
//! concurrently), the slices of every one-second bucket that has *settled* (its slices ended at
//! least [`settle`] ago, so workers have flushed their counters), writes the bucket's record and
//! recomputes the record of its minute from the second records of that minute. A record is a
//! pure function of the slices, so harvesting a bucket twice writes the same bytes: a new leader
//! simply starts `retention` back (what is still in Redis) and overwrites what the previous
//! leader may already have written. Slices newer than the harvest are read live by the API
//! ([`read_live`]), so the live chart is current to the second.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sluice_protocol::conn::{Redis, RedisConn};
use sluice_protocol::scripts::{self, RecordOutcome, RingWrites};
use sluice_protocol::{Keys, MAX_SLICE_MS, MIN_SLICE_MS, slice, slice_field, unix_ms};
use tracing::{debug, warn};

use crate::election::LeaderContext;
use crate::error::{Error, Result, redis as redis_err};
use crate::metrics::Metrics;
use crate::tasks::{TaskSnapshot, TaskStore};

/// Size of one encoded [`Record`].
pub const RECORD_BYTES: usize = 48;

/// Most slices read for one task in one tick (a new leader catching up on 100 ms slices reads
/// its backlog over several ticks).
pub const MAX_SLICES_PER_TICK: i64 = 2_000;

/// Longest wait after a slice ends before it is harvested (workers flush late counters).
pub const MAX_SETTLE: Duration = Duration::from_secs(5);

/// Period of the harvest loop.
pub const TICK: Duration = Duration::from_secs(1);

/// A task none of whose harvested buckets had traffic for this long is dormant: harvested
/// every [`dormant_period`] instead of every [`TICK`] (issue 27: an idle task cost a harvest
/// round trip a second for nothing; a dormant one reads the same slices in one pipeline every
/// period).
pub const DORMANT_AFTER_MS: i64 = 60_000;

/// How often a dormant task is harvested: 10 s, and short enough that its slices are still in
/// Redis when they are read — a slice ends, settles, waits at most this period and a tick —
/// so at most half of what `retention` leaves after settle and 3 s (0, i.e. every tick, when
/// `retention` is short). Records are pure functions of the slices, so a late harvest writes
/// what a timely one would have; the API reads that much more of a task's recent slices live
/// ([`live_from`]). Keyed tasks are never dormant: the harvest also `UNLINK`s their key
/// quota hashes, which expire by themselves 5 s after their window.
///
/// ```
/// use std::time::Duration;
/// use sluice_manager::history::dormant_period;
/// assert_eq!(dormant_period(Duration::from_secs(60)), Duration::from_secs(10));
/// assert_eq!(dormant_period(Duration::from_secs(11)), Duration::from_millis(2_625));
/// assert_eq!(dormant_period(Duration::from_secs(4)), Duration::ZERO);
/// ```
pub fn dormant_period(retention: Duration) -> Duration {
    (retention.saturating_sub(settle(retention) + Duration::from_secs(3)) / 2)
        .min(Duration::from_secs(10))
}

/// Harvest calls (per task) in flight at once: multiplexed on one connection, pipelined.
const CONCURRENCY: usize = 128;

/// Bound on one Redis round trip.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// One ring of records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Series {
    /// The name in the key (`NS:{T}:hist:<name>`) and in the API (`resolution=`).
    pub name: &'static str,
    /// Bucket length in ms.
    pub res_ms: i64,
    /// Number of slots (buckets kept).
    pub slots: i64,
}

/// One-second resolution, kept one hour.
pub const SECONDS: Series = Series {
    name: "1s",
    res_ms: 1_000,
    slots: 3_600,
};

/// One-minute resolution, kept seven days.
pub const MINUTES: Series = Series {
    name: "1m",
    res_ms: 60_000,
    slots: 10_080,
};

impl Series {
    /// The series called `name` (`1s` or `1m`).
    pub fn by_name(name: &str) -> Option<Self> {
        [SECONDS, MINUTES].into_iter().find(|s| s.name == name)
    }

    /// How far back this series reaches, in ms.
    pub fn span_ms(&self) -> i64 {
        self.res_ms * self.slots
    }

    /// Start of the bucket containing `t_ms`.
    pub fn bucket(&self, t_ms: i64) -> i64 {
        t_ms - t_ms.rem_euclid(self.res_ms)
    }

    /// Slot of the bucket starting at `start_ms`.
    ///
    /// ```
    /// use sluice_manager::history::SECONDS;
    /// assert_eq!(SECONDS.slot(1_000), 1);
    /// assert_eq!(SECONDS.slot(3_601_000), 1); // one lap later: same slot
    /// ```
    pub fn slot(&self, start_ms: i64) -> i64 {
        (start_ms / self.res_ms).rem_euclid(self.slots)
    }

    /// The runs of consecutive slots holding the buckets `first..=last` (at most one lap): at
    /// most two `(first bucket start, count)` pairs, split where the ring wraps.
    ///
    /// ```
    /// use sluice_manager::history::SECONDS;
    /// assert_eq!(SECONDS.runs(10_000, 12_000), vec![(10_000, 3)]);
    /// // 3 599 s is the last slot; 3 600 s wraps to slot 0.
    /// assert_eq!(SECONDS.runs(3_598_000, 3_601_000), vec![(3_598_000, 2), (3_600_000, 2)]);
    /// ```
    pub fn runs(&self, first: i64, last: i64) -> Vec<(i64, i64)> {
        let first = self
            .bucket(first)
            .max(self.bucket(last) - (self.slots - 1) * self.res_ms);
        let last = self.bucket(last);
        if last < first {
            return Vec::new();
        }
        let count = (last - first) / self.res_ms + 1;
        let to_wrap = self.slots - self.slot(first);
        if count <= to_wrap {
            vec![(first, count)]
        } else {
            vec![
                (first, to_wrap),
                (first + to_wrap * self.res_ms, count - to_wrap),
            ]
        }
    }
}

/// The traffic of the slices that start in one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Record {
    /// Start of the bucket (Unix ms).
    pub start_ms: i64,
    /// Slices found in the bucket.
    pub slices: u32,
    /// Sum of their caps (thresholds).
    pub cap_sum: u64,
    /// Admitted decisions.
    pub admitted: u64,
    /// Rejected decisions.
    pub rejected: u64,
    /// Shadow mode: the part of `rejected` that was admitted (`wrej`).
    pub would_reject: u64,
    /// Sum of their lengths (ms): the time their counts cover.
    pub span_ms: u64,
}

impl Record {
    /// The mean threshold per slice (rounded), or 0 for an empty record.
    ///
    /// ```
    /// use sluice_manager::history::Record;
    /// let r = Record { start_ms: 0, slices: 4, cap_sum: 402, admitted: 0, rejected: 0,
    ///                    would_reject: 0, span_ms: 1_000 };
    /// assert_eq!(r.threshold(), 101);
    /// ```
    pub fn threshold(&self) -> u64 {
        if self.slices == 0 {
            0
        } else {
            (self.cap_sum + u64::from(self.slices) / 2) / u64::from(self.slices)
        }
    }

    /// The mean length of its slices (ms), or None for a record without lengths.
    ///
    /// ```
    /// use sluice_manager::history::Record;
    /// let r = Record { start_ms: 0, slices: 4, span_ms: 1_000, ..Record::default() };
    /// assert_eq!(r.slice_ms(), Some(250));
    /// ```
    pub fn slice_ms(&self) -> Option<u64> {
        (self.slices > 0 && self.span_ms > 0).then(|| self.span_ms / u64::from(self.slices))
    }

    /// Per-second rate of `count` over the time this record's slices cover (two decimals), or
    /// None for a record without lengths.
    ///
    /// ```
    /// use sluice_manager::history::Record;
    /// // One 1 s slice with 5,000 admitted: 5,000/s; one 2 s slice with 5,000: 2,500/s.
    /// let r = Record { start_ms: 0, slices: 1, admitted: 5_000, span_ms: 1_000, ..Record::default() };
    /// assert_eq!(r.per_s(r.admitted), Some(5_000.0));
    /// let r = Record { span_ms: 2_000, ..r };
    /// assert_eq!(r.per_s(r.admitted), Some(2_500.0));
    /// ```
    pub fn per_s(&self, count: u64) -> Option<f64> {
        (self.span_ms > 0)
            .then(|| (count as f64 * 1000.0 / self.span_ms as f64 * 100.0).round() / 100.0)
    }

    /// Adds another record's counts to this one.
    pub fn add(&mut self, o: &Record) {
        self.slices = self.slices.saturating_add(o.slices);
        self.cap_sum = self.cap_sum.saturating_add(o.cap_sum);
        self.admitted = self.admitted.saturating_add(o.admitted);
        self.rejected = self.rejected.saturating_add(o.rejected);
        self.would_reject = self.would_reject.saturating_add(o.would_reject);
        self.span_ms = self.span_ms.saturating_add(o.span_ms);
    }

    /// The 48-byte encoding (see the module docs).
    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        let tag = (self.start_ms / 1000).clamp(0, i64::from(u32::MAX)) as u32;
        b[0..4].copy_from_slice(&tag.to_le_bytes());
        b[4..8].copy_from_slice(&self.slices.to_le_bytes());
        b[8..16].copy_from_slice(&self.cap_sum.to_le_bytes());
        b[16..24].copy_from_slice(&self.admitted.to_le_bytes());
        b[24..32].copy_from_slice(&self.rejected.to_le_bytes());
        b[32..40].copy_from_slice(&self.would_reject.to_le_bytes());
        b[40..48].copy_from_slice(&self.span_ms.to_le_bytes());
        b
    }

    /// Decodes the record in `b` if it belongs to the bucket starting at `start_ms` (else the
    /// slot is empty or holds an older lap).
    ///
    /// ```
    /// use sluice_manager::history::Record;
    /// let r = Record { start_ms: 1_700_000_000_000, slices: 1, cap_sum: 5, admitted: 3, rejected: 1,
    ///                  would_reject: 1, span_ms: 1_000 };
    /// assert_eq!(Record::decode(&r.encode(), r.start_ms), Some(r));
    /// assert_eq!(Record::decode(&r.encode(), r.start_ms - 3_600_000), None);
    /// assert_eq!(Record::decode(&[0; 48], r.start_ms), None);
    /// ```
    pub fn decode(b: &[u8], start_ms: i64) -> Option<Self> {
        let b: &[u8; RECORD_BYTES] = b.get(..RECORD_BYTES)?.try_into().ok()?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let tag = u32_at(0);
        let slices = u32_at(4);
        if tag == 0 || i64::from(tag) * 1000 != start_ms || slices == 0 {
            return None;
        }
        Some(Self {
            start_ms,
            slices,
            cap_sum: u64_at(8),
            admitted: u64_at(16),
            rejected: u64_at(24),
            would_reject: u64_at(32),
            span_ms: u64_at(40),
        })
    }
}

/// What one slice hash held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceSample {
    /// Slice start (Unix ms).
    pub start_ms: i64,
    /// Its cap.
    pub cap: u64,
    /// Admitted decisions flushed into it.
    pub admitted: u64,
    /// Rejected decisions flushed into it.
    pub rejected: u64,
    /// Shadow mode: the part of `rejected` that was admitted (`wrej`).
    pub would_reject: u64,
    /// Its length (the task's `slice_ms` of the grid it was read on).
    pub slice_ms: u64,
}

/// Sums slices into the buckets of `series` (by slice start).
///
/// ```
/// use sluice_manager::history::{aggregate, SliceSample, SECONDS};
/// let s = |start_ms, admitted| SliceSample { start_ms, cap: 10, admitted, rejected: 0,
///                                           would_reject: 0, slice_ms: 500 };
/// let r = aggregate(&[s(1_000, 1), s(1_500, 2), s(2_000, 4)], SECONDS);
/// assert_eq!(r[&1_000].admitted, 3);
/// assert_eq!(r[&1_000].slices, 2);
/// assert_eq!(r[&1_000].span_ms, 1_000);
/// assert_eq!(r[&2_000].cap_sum, 10);
/// ```
pub fn aggregate(samples: &[SliceSample], series: Series) -> BTreeMap<i64, Record> {
    let mut out: BTreeMap<i64, Record> = BTreeMap::new();
    for s in samples {
        let b = series.bucket(s.start_ms);
        out.entry(b)
            .or_insert(Record {
                start_ms: b,
                ..Record::default()
            })
            .add(&Record {
                start_ms: b,
                slices: 1,
                cap_sum: s.cap,
                admitted: s.admitted,
                rejected: s.rejected,
                would_reject: s.would_reject,
                span_ms: s.slice_ms,
            });
    }
    out
}

/// How long after a slice ends it is harvested: long enough for workers to flush their last
/// counters, short enough to leave most of the slice key's `retention`.
///
/// ```
/// use std::time::Duration;
/// use sluice_manager::history::settle;
/// assert_eq!(settle(Duration::from_secs(60)), Duration::from_secs(5));
/// assert_eq!(settle(Duration::from_secs(4)), Duration::from_secs(1));
/// ```
pub fn settle(retention: Duration) -> Duration {
    (retention / 4).min(MAX_SETTLE)
}

/// End (exclusive) of the one-second buckets whose slices have all ended `settle` ago: the
/// bucket of the first slice that has not.
///
/// ```
/// use std::time::Duration;
/// use sluice_manager::history::settled_until;
/// // 1 s slices, settle 5 s: at 20.5 s the bucket [14 s, 15 s) (slice ends 15 s) is settled.
/// assert_eq!(settled_until(20_500, 1_000, Duration::from_secs(5)), 15_000);
/// ```
pub fn settled_until(now_ms: i64, slice_ms: u64, settle: Duration) -> i64 {
    SECONDS.bucket(slice::start(now_ms - settle.as_millis() as i64, slice_ms))
}

/// Where a new leadership starts harvesting a task: as far back as slices may still exist (but
/// within the one-second ring), and never after the start of the slice in progress (so a long
/// slice that began earlier is harvested when it ends).
pub fn first_bucket(now_ms: i64, slice_ms: u64, retention: Duration, settle: Duration) -> i64 {
    let alive = now_ms - retention.as_millis() as i64 + settle.as_millis() as i64 + 1_000;
    let from = alive.max(now_ms - SECONDS.span_ms() + 60_000);
    SECONDS.bucket(from.min(slice::start(now_ms, slice_ms)))
}

/// Reads the slices starting in `[from_ms, until_ms)` on the grid of `slice_ms` (at most
/// `max` of them) with one pipeline; slices that do not exist are left out. Each sample's
/// length is the slice's own `len` (ROLL writes it), else `slice_ms`.
pub async fn read_slices(
    conn: &mut RedisConn,
    keys: &Keys,
    task: &str,
    slice_ms: u64,
    from_ms: i64,
    until_ms: i64,
    max: i64,
) -> Result<Vec<SliceSample>> {
    let starts: Vec<i64> = slice::starts(from_ms, until_ms, slice_ms)
        .filter(|s| *s >= from_ms)
        .take(max.max(0) as usize)
        .collect();
    if starts.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for s in &starts {
        pipe.cmd("HMGET")
            .arg(keys.slice(task, *s))
            .arg(slice_field::CAP)
            .arg(slice_field::ADMITTED)
            .arg(slice_field::REJECTED)
            .arg(slice_field::WOULD_REJECT)
            .arg(slice_field::LEN);
    }
    type Row = (
        Option<i64>,
        Option<i64>,
        Option<i64>,
        Option<i64>,
        Option<i64>,
    );
    let rows: Vec<Row> = bounded("read slices", pipe.query_async(conn)).await?;
    Ok(starts
        .into_iter()
        .zip(rows)
        .filter_map(|(start_ms, (cap, adm, rej, wrej, len))| {
            Some(SliceSample {
                start_ms,
                cap: cap?.max(0) as u64,
                admitted: adm.unwrap_or(0).max(0) as u64,
                rejected: rej.unwrap_or(0).max(0) as u64,
                would_reject: wrej.unwrap_or(0).max(0) as u64,
                // The slice's own length (a key of an older grid whose start lies on this
                // one keeps the length it ran with); the grid's for a slice without one.
                slice_ms: len
                    .map(|l| l as u64)
                    .filter(|l| (MIN_SLICE_MS..=MAX_SLICE_MS).contains(l))
                    .unwrap_or(slice_ms),
            })
        })
        .collect())
}

/// Reads the records of `series` for the buckets `from_ms..=to_ms` (at most one lap), oldest
/// first; empty and stale slots are left out.
pub async fn read_series(
    conn: &mut RedisConn,
    keys: &Keys,
    task: &str,
    series: Series,
    from_ms: i64,
    to_ms: i64,
) -> Result<Vec<Record>> {
    let runs = series.runs(from_ms, to_ms);
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let key = keys.history(task, series.name);
    let mut pipe = redis::pipe();
    for (first, count) in &runs {
        let off = series.slot(*first) * RECORD_BYTES as i64;
        pipe.cmd("GETRANGE")
            .arg(&key)
            .arg(off)
            .arg(off + count * RECORD_BYTES as i64 - 1);
    }
    let blobs: Vec<Vec<u8>> = bounded("read history", pipe.query_async(conn)).await?;
    let mut out = Vec::new();
    for ((first, count), blob) in runs.iter().zip(blobs) {
        for i in 0..*count {
            let at = i as usize * RECORD_BYTES;
            let Some(bytes) = blob.get(at..at + RECORD_BYTES) else {
                break; // the string is shorter: never written that far
            };
            if let Some(r) = Record::decode(bytes, first + i * series.res_ms) {
                out.push(r);
            }
        }
    }
    Ok(out)
}

/// The `SETRANGE` writes of `records` (each into its slot): `(byte offset, bytes)`;
/// consecutive slots are written with one write.
fn ring_writes(series: Series, records: &[Record]) -> Vec<(i64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < records.len() {
        let mut blob = records[i].encode().to_vec();
        let first = records[i].start_ms;
        let mut j = i + 1;
        while j < records.len()
            && records[j].start_ms == records[j - 1].start_ms + series.res_ms
            && series.slot(records[j].start_ms) == series.slot(records[j - 1].start_ms) + 1
        {
            blob.extend_from_slice(&records[j].encode());
            j += 1;
        }
        out.push((series.slot(first) * RECORD_BYTES as i64, blob));
        i = j;
    }
    out
}

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

/// When each task last had traffic, as the harvester saw it (manager clock, ms). Written by the
/// harvester, read by the roller to leave idle tasks lazy (`--lazy-after`).
#[derive(Debug, Clone, Default)]
pub struct Activity {
    inner: Arc<std::sync::RwLock<HashMap<String, Seen>>>,
    /// The tasks the roller left lazy: no slice of theirs exists but what a worker makes, so
    /// the harvester and the skew detector leave them alone until they wake (issue 27).
    lazy: Arc<std::sync::RwLock<HashSet<String>>>,
    /// Bumped whenever `lazy` changes: readers cache what they derive from it.
    lazy_generation: Arc<std::sync::atomic::AtomicU64>,
}

/// What the harvester saw of a task's traffic (manager clock, ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// Its last harvested bucket with traffic, or when its harvest began (a new leadership, a
    /// new task): it has been idle at most since then.
    pub busy_ms: i64,
    /// When a harvest last found traffic; `None`: none this leadership.
    pub traffic_ms: Option<i64>,
}

impl Activity {
    /// What the harvester saw of `task`; `None` while it has not harvested it.
    pub fn seen(&self, task: &str) -> Option<Seen> {
        self.inner.read().ok()?.get(task).copied()
    }

    /// Records what changed (new tasks, tasks with new traffic), forgets deleted tasks.
    fn record(&self, snap: &TaskSnapshot, changed: Vec<(String, Seen)>) {
        if let Ok(mut m) = self.inner.write() {
            if m.len() > snap.tasks.len() {
                m.retain(|n, _| snap.tasks.contains_key(n));
            }
            m.extend(changed);
        }
    }

    /// Forgets everything (a new leadership starts without knowledge).
    pub fn clear(&self) {
        if let Ok(mut m) = self.inner.write() {
            m.clear();
        }
        if let Ok(mut m) = self.lazy.write() {
            m.clear();
        }
        self.bump();
    }

    fn bump(&self) {
        self.lazy_generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Changes whenever the set of lazy tasks does (read it before the set).
    pub fn lazy_generation(&self) -> u64 {
        self.lazy_generation
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the roller left `task` lazy.
    pub fn is_lazy(&self, task: &str) -> bool {
        self.lazy.read().is_ok_and(|m| m.contains(task))
    }

    /// Runs `f` over the set of tasks the roller left lazy (one read lock, no copy).
    pub fn with_lazy_set<T>(&self, f: impl FnOnce(&HashSet<String>) -> T) -> T {
        match self.lazy.read() {
            Ok(m) => f(&m),
            Err(_) => f(&HashSet::new()),
        }
    }

    /// The roller's changes: tasks left lazy, tasks woken (or gone).
    pub fn set_lazy(&self, added: Vec<String>, removed: Vec<String>) {
        if added.is_empty() && removed.is_empty() {
            return;
        }
        if let Ok(mut m) = self.lazy.write() {
            for n in &removed {
                m.remove(n);
            }
            m.extend(added);
        }
        self.bump();
    }
}

/// What the harvester knows of one task.
#[derive(Debug, Clone, Default)]
struct TaskHarvest {
    /// Every one-second bucket before this has been harvested.
    done_to: i64,
    /// Second records of the current and previous minute (to recompute minute records).
    recent: BTreeMap<i64, Record>,
    /// When (manager clock, ms) the task last had traffic in a harvested bucket, or its
    /// harvest began (a new leadership, a new task).
    busy_ms: i64,
    /// When a harvest last found traffic (manager clock, ms); `None`: none this leadership.
    traffic_ms: Option<i64>,
    /// Not harvested again before this (manager clock, ms): set for dormant tasks.
    next_ms: i64,
}

/// The leader's harvest loop.
pub struct Harvester {
    keys: Keys,
    redis: Arc<Redis>,
    metrics: Arc<Metrics>,
    retention: Duration,
    settle: Duration,
    state: HashMap<String, TaskHarvest>,
    activity: Activity,
    /// The snapshot (revision, task count) `state` was last pruned for.
    pruned_revision: Option<(i64, usize)>,
    /// The tasks not lazy, for a snapshot (revision, task count) and a generation of the lazy
    /// set: rebuilt only when either changes (issue 27: a walk of 100,000 names through the
    /// lazy set every second was 8 % of the leader's CPU with 1,000 active tasks).
    eager: Option<(EagerKey, Vec<Arc<crate::tasks::TaskEntry>>)>,
}

/// What the harvester's list of tasks not lazy was built for: the snapshot (revision, task
/// count) and the lazy set's generation.
type EagerKey = (i64, usize, u64);

/// Counts of one harvest tick.
#[derive(Debug, Default, Clone, Copy)]
pub struct HarvestStats {
    /// Slices read.
    pub slices: u64,
    /// Records written (both series).
    pub records: u64,
    /// Tasks whose harvest failed this tick (retried next tick).
    pub errors: u64,
}

impl Harvester {
    /// A harvester for slices kept `retention` after they end.
    pub fn new(keys: Keys, redis: Arc<Redis>, retention: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            keys,
            redis,
            metrics,
            retention,
            settle: settle(retention),
            state: HashMap::new(),
            activity: Activity::default(),
            pruned_revision: None,
            eager: None,
        }
    }

    /// Publishes when each task last had traffic into `activity` (cleared now: a new
    /// leadership knows nothing yet).
    pub fn with_activity(mut self, activity: Activity) -> Self {
        activity.clear();
        self.activity = activity;
        self
    }

    /// Harvests every [`TICK`] until leadership ends.
    pub async fn run(mut self, ctx: LeaderContext, store: TaskStore) {
        let mut interval = tokio::time::interval(TICK);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ctx.token().cancelled() => return,
                _ = interval.tick() => {}
            }
            let snap = store.snapshot();
            if !snap.loaded {
                continue;
            }
            let started = Instant::now();
            match self.tick(&ctx, &snap).await {
                Ok(stats) => {
                    self.metrics
                        .history_tick_seconds
                        .observe(started.elapsed().as_secs_f64());
                    debug!(?stats, "harvest tick");
                }
                Err(e) => debug!(%e, "harvest tick stopped"),
            }
        }
    }

    /// One pass over every task: read settled slices, write their records.
    pub async fn tick(&mut self, ctx: &LeaderContext, snap: &TaskSnapshot) -> Result<HarvestStats> {
        // Deleted tasks are forgotten when the snapshot changes (issue 27: a walk of 100,000
        // names through the snapshot's map every second was a large part of the leader's CPU).
        if self.pruned_revision != Some((snap.revision, snap.tasks.len())) {
            self.state.retain(|name, _| snap.tasks.contains_key(name));
            self.pruned_revision = Some((snap.revision, snap.tasks.len()));
        }
        let mut conn = self.redis.conn().await.map_err(redis_err("connect"))?;
        let now = unix_ms();
        // Key quota hashes are unlinked only once KPULL refuses their slice by REDIS time
        // (its window ends at most 250 ms after the slice): a manager clock ahead of Redis's
        // must not free a slice KPULL still serves (it would make it anew, full).
        let unlink_before = bounded(
            "read time",
            redis::cmd("TIME").query_async::<(i64, i64)>(&mut conn),
        )
        .await
        .ok()
        .map(|(s, us)| (s * 1_000 + us / 1_000).min(now) - UNLINK_MARGIN_MS);
        // A lazy task's slices are made only by workers, and waking it is the roller's probe:
        // it is harvested again once woken, from as far back as its slices may be.
        let key = (
            snap.revision,
            snap.tasks.len(),
            self.activity.lazy_generation(),
        );
        if self.eager.as_ref().is_none_or(|(k, _)| *k != key) {
            let eager = self.activity.with_lazy_set(|lazy| {
                snap.tasks
                    .values()
                    .filter(|e| !lazy.contains(&e.name))
                    .cloned()
                    .collect()
            });
            self.eager = Some((key, eager));
        }
        let state = &self.state;
        let eager = self.eager.as_ref().map_or(&[][..], |(_, v)| &v[..]);
        let jobs: Vec<(String, u64, bool, Option<TaskHarvest>)> = eager
            .iter()
            .filter(|e| state.get(&e.name).is_none_or(|st| st.next_ms <= now))
            .map(|e| {
                (
                    e.name.clone(),
                    e.spec.slice_ms,
                    e.spec.keyed,
                    state.get(&e.name).cloned(),
                )
            })
            .collect();
        let (keys, retention, settle) = (&self.keys, self.retention, self.settle);
        let results: Vec<(String, Result<Harvested>)> = futures::stream::iter(jobs)
            .map(|(name, slice_ms, keyed, st)| {
                let mut c = conn.clone();
                async move {
                    let task = TaskRef {
                        name: &name,
                        slice_ms,
                        unlink_before: if keyed { unlink_before } else { None },
                    };
                    let r = harvest_task(&mut c, keys, ctx, task, st, now, retention, settle).await;
                    (name, r)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut stats = HarvestStats::default();
        let dormant_every = dormant_period(self.retention).as_millis() as i64;
        let mut changed = Vec::new();
        for (name, r) in results {
            match r {
                Ok((mut st, slices, records, would_reject)) => {
                    if self
                        .state
                        .get(&name)
                        .is_none_or(|old| old.busy_ms != st.busy_ms)
                    {
                        let seen = Seen {
                            busy_ms: st.busy_ms,
                            traffic_ms: st.traffic_ms,
                        };
                        changed.push((name.clone(), seen));
                    }
                    st.next_ms = if now - st.busy_ms >= DORMANT_AFTER_MS
                        && !snap.tasks.get(&name).is_some_and(|e| e.spec.keyed)
                    {
                        now + dormant_every
                    } else {
                        0
                    };
                    stats.slices += slices;
                    stats.records += records;
                    if would_reject > 0 {
                        self.metrics.would_reject(&name, would_reject);
                    }
                    self.state.insert(name, st);
                }
                Err(Error::NotLeader) => return Err(Error::NotLeader),
                Err(e) => {
                    stats.errors += 1;
                    warn!(task = name, %e, "history harvest failed; will retry next tick");
                }
            }
        }
        self.activity.record(snap, changed);
        self.metrics.history_slices.inc_by(stats.slices);
        self.metrics.history_records.inc_by(stats.records);
        self.metrics.history_errors.inc_by(stats.errors);
        Ok(stats)
    }
}

/// A task's new harvest state, slices read, records written and would-rejects harvested.
type Harvested = (TaskHarvest, u64, u64, u64);

/// The task a harvest works on.
#[derive(Clone, Copy)]
struct TaskRef<'a> {
    name: &'a str,
    slice_ms: u64,
    /// A keyed task: the key quota hashes of slices that ended before this (Unix ms, the
    /// earlier of the manager's and Redis's clocks, less [`UNLINK_MARGIN_MS`] and KPULL's
    /// grace) are unlinked. `None`: not keyed, or Redis's time unknown this tick.
    unlink_before: Option<i64>,
}

/// Margin (ms) between the end of KPULL's window (a slice's end + at most 250 ms, Redis time)
/// and the leader's `UNLINK` of the slice's key quota hash.
const UNLINK_MARGIN_MS: i64 = 1_000;

/// Harvests one task: returns its new state, slices read and records written. For a keyed
/// task it also `UNLINK`s the key quota hashes of the slices it harvests (`NS:{T}:k:<start>`,
/// which KPULL no longer writes once the slice's window is over): freed off Redis's main
/// thread, where a hash of many keys would stall it while it expires.
#[allow(clippy::too_many_arguments)]
async fn harvest_task(
    conn: &mut RedisConn,
    keys: &Keys,
    ctx: &LeaderContext,
    task: TaskRef<'_>,
    state: Option<TaskHarvest>,
    now: i64,
    retention: Duration,
    settle: Duration,
) -> Result<Harvested> {
    let TaskRef {
        name: task,
        slice_ms,
        unlink_before,
    } = task;
    let mut st = match state {
        Some(s) => s,
        None => {
            // A new leadership: start as far back as slices may exist, and load the second
            // records already written from that minute on (by an earlier leader), so minute
            // records keep what only the ring still holds.
            let done_to = first_bucket(now, slice_ms, retention, settle);
            let recent = read_series(conn, keys, task, SECONDS, MINUTES.bucket(done_to), now)
                .await?
                .into_iter()
                .map(|r| (r.start_ms, r))
                .collect();
            TaskHarvest {
                done_to,
                recent,
                busy_ms: now,
                traffic_ms: None,
                next_ms: 0,
            }
        }
    };
    // A task left lazy for a while is not harvested meanwhile: what it skipped is read only as
    // far back as a slice may still exist (one starting at `s` expires `slice_ms + retention`
    // after `s`; `settle` more for clocks apart). Never past a slice that may exist: a slice
    // long against the retention started well before `first_bucket`.
    let gone_before =
        now - slice_ms as i64 - retention.as_millis() as i64 - settle.as_millis() as i64;
    st.done_to = st.done_to.max(SECONDS.bucket(gone_before));
    let until = settled_until(now, slice_ms, settle);
    if until <= st.done_to {
        return Ok((st, 0, 0, 0));
    }
    // Bound the work of one tick, in whole buckets.
    let span = (MAX_SLICES_PER_TICK * slice_ms as i64).max(SECONDS.res_ms);
    let until = until
        .min(SECONDS.bucket(st.done_to + span))
        .max(st.done_to + SECONDS.res_ms);
    let samples = read_slices(
        conn,
        keys,
        task,
        slice_ms,
        st.done_to,
        until,
        MAX_SLICES_PER_TICK + 1,
    )
    .await?;
    if let Some(before) = unlink_before {
        // A slice skipped here (clocks apart) is not retried: its hash expires by itself.
        let starts: Vec<String> = slice::starts(st.done_to, until, slice_ms)
            .filter(|s| *s >= st.done_to && slice::window_end(*s, slice_ms) <= before)
            .take(MAX_SLICES_PER_TICK.max(0) as usize + 1)
            .map(|s| keys.key_slices(task, s))
            .collect();
        if !starts.is_empty() {
            // Best effort (an ended slice's hash also expires by itself) and harmless from a
            // deposed leader: KPULL refuses a slice whose window is over.
            let r: Result<i64> = bounded(
                "unlink key quotas",
                redis::cmd("UNLINK").arg(&starts).query_async(conn),
            )
            .await;
            if let Err(e) = r {
                // At most once a minute (a missing `+unlink` in the manager's ACL would fail
                // every tick): the hashes still expire by themselves, on Redis's main thread.
                static LAST: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
                let at = LAST.load(std::sync::atomic::Ordering::Relaxed);
                if now - at >= 60_000
                    && LAST
                        .compare_exchange(
                            at,
                            now,
                            std::sync::atomic::Ordering::Relaxed,
                            std::sync::atomic::Ordering::Relaxed,
                        )
                        .is_ok()
                {
                    warn!(task, %e, "key quota hashes of ended slices not unlinked; they expire by themselves");
                }
            }
        }
    }
    // Only buckets that saw traffic are written: an idle task costs no history at all (a ring
    // is a Redis string, allocated up to the highest slot ever written).
    let seconds: Vec<Record> = aggregate(&samples, SECONDS)
        .into_values()
        .filter(|r| r.admitted + r.rejected > 0)
        .collect();
    for r in &seconds {
        st.recent.insert(r.start_ms, *r);
    }
    if !seconds.is_empty() {
        st.busy_ms = now;
        // When the traffic was (its last second's end), not when it was harvested: a new
        // leadership's catch-up finds the last minute's traffic, which is older than its
        // takeover and must not wake the tasks it keeps lazy.
        let last = seconds.iter().map(|r| r.start_ms + SECONDS.res_ms).max();
        st.traffic_ms = last.max(st.traffic_ms);
    }
    // Recompute each touched minute from its second records.
    let mut minutes: Vec<Record> = Vec::new();
    let mut m = MINUTES.bucket(st.done_to);
    while m < until {
        let mut rec = Record {
            start_ms: m,
            ..Record::default()
        };
        for r in st.recent.range(m..m + MINUTES.res_ms).map(|(_, r)| r) {
            rec.add(r);
        }
        if rec.slices > 0 {
            minutes.push(rec);
        }
        m += MINUTES.res_ms;
    }
    let written = (seconds.len() + minutes.len()) as u64;
    if written > 0 {
        if !ctx.is_valid() {
            return Err(Error::NotLeader);
        }
        let k1 = keys.history(task, SECONDS.name);
        let k2 = keys.history(task, MINUTES.name);
        let (w1, w2) = (
            ring_writes(SECONDS, &seconds),
            ring_writes(MINUTES, &minutes),
        );
        // Fenced, and refused once the task is retired (RETIRE deletes the rings); a ring that
        // is no longer written expires once it is all stale.
        let out = bounded(
            "write history",
            scripts::record_history(
                conn,
                keys,
                task,
                &ctx.fence(),
                RingWrites {
                    key: &k1,
                    ttl_ms: (SECONDS.span_ms() + 60_000) as u64,
                    writes: &w1,
                },
                RingWrites {
                    key: &k2,
                    ttl_ms: (MINUTES.span_ms() + 3_600_000) as u64,
                    writes: &w2,
                },
            ),
        )
        .await?;
        if out != RecordOutcome::Done {
            // Another writer holds the task (it harvests it), or the task is gone.
            debug!(task, ?out, "history not written");
        }
    }
    st.done_to = until;
    let keep_from = MINUTES.bucket(st.done_to) - MINUTES.res_ms;
    st.recent = st.recent.split_off(&keep_from);
    let would_reject = seconds.iter().map(|r| r.would_reject).sum();
    Ok((st, samples.len() as u64, written, would_reject))
}

/// Reads the most recent slices of a task straight from their hashes, from `from_ms` to now
/// (the slice in progress included): what the harvest has not reached yet.
pub async fn read_live(
    conn: &mut RedisConn,
    keys: &Keys,
    task: &str,
    slice_ms: u64,
    from_ms: i64,
    now_ms: i64,
) -> Result<Vec<SliceSample>> {
    read_slices(
        conn,
        keys,
        task,
        slice_ms,
        from_ms,
        now_ms + 1,
        MAX_SLICES_PER_TICK,
    )
    .await
}

/// Where the live part of a one-second history starts: what the harvester may not have
/// written yet (settle, one slice, a dormant task's harvest period, a tick of lag and a second
/// of margin), and never after the start of the slice in progress.
pub fn live_from(now_ms: i64, slice_ms: u64, retention: Duration) -> i64 {
    let lag = settle(retention).as_millis() as i64
        + slice_ms as i64
        + dormant_period(retention).as_millis() as i64
        + 3 * TICK.as_millis() as i64;
    SECONDS.bucket((now_ms - lag).min(slice::start(now_ms, slice_ms)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lazy set's generation changes with every change of the set, and only then: the
    /// harvester and the skew detector rebuild what they derive from it on a change alone.
    #[test]
    fn the_lazy_generation_follows_the_lazy_set() {
        let a = Activity::default();
        let shared = a.clone();
        let g0 = a.lazy_generation();
        a.set_lazy(Vec::new(), Vec::new());
        assert_eq!(a.lazy_generation(), g0, "nothing changed");
        a.set_lazy(vec!["x".into()], Vec::new());
        let g1 = shared.lazy_generation();
        assert!(g1 > g0 && shared.is_lazy("x"));
        a.set_lazy(Vec::new(), vec!["x".into()]);
        assert!(a.lazy_generation() > g1 && !a.is_lazy("x"));
        let g2 = a.lazy_generation();
        a.clear();
        assert!(a.lazy_generation() > g2);
    }

    fn sample(start_ms: i64, cap: u64, admitted: u64, rejected: u64) -> SliceSample {
        SliceSample {
            start_ms,
            cap,
            admitted,
            rejected,
            would_reject: 0,
            slice_ms: 100,
        }
    }

    #[test]
    fn record_round_trip_keeps_big_counts() {
        let r = Record {
            start_ms: 4_000_000_000_000 / 1000 * 1000,
            slices: 600,
            cap_sum: 1_000_000_000_000 * 600,
            admitted: u64::MAX / 3,
            rejected: 7,
            would_reject: 5,
            span_ms: 60_000,
        };
        assert_eq!(Record::decode(&r.encode(), r.start_ms), Some(r));
        assert_eq!(r.threshold(), 1_000_000_000_000);
    }

    #[test]
    fn short_slices_sum_into_seconds_and_minutes() {
        let samples: Vec<SliceSample> = (0..1200)
            .map(|i| sample(60_000 + i * 100, 10, 3, 1))
            .collect();
        let secs = aggregate(&samples, SECONDS);
        assert_eq!(secs.len(), 120);
        assert!(
            secs.values()
                .all(|r| r.slices == 10 && r.admitted == 30 && r.span_ms == 1_000)
        );
        let mins = aggregate(&samples, MINUTES);
        assert_eq!(mins.len(), 2);
        assert_eq!(mins[&60_000].admitted, 1_800);
        assert_eq!(mins[&60_000].threshold(), 10);
        assert_eq!(mins[&60_000].span_ms, 60_000);
        assert_eq!(mins[&60_000].per_s(mins[&60_000].admitted), Some(30.0));
    }

    #[test]
    fn long_slices_land_in_the_bucket_of_their_start() {
        let samples = [
            sample(0, 5, 1, 0),
            sample(2_500, 5, 2, 0),
            sample(5_000, 5, 3, 0),
        ];
        let secs = aggregate(&samples, SECONDS);
        assert_eq!(secs.keys().copied().collect::<Vec<_>>(), [0, 2_000, 5_000]);
    }

    #[test]
    fn runs_cover_at_most_one_lap() {
        let lap = SECONDS.span_ms();
        let runs = SECONDS.runs(0, 3 * lap);
        let total: i64 = runs.iter().map(|r| r.1).sum();
        assert_eq!(total, SECONDS.slots);
        assert_eq!(runs.last().map(|r| r.0 + (r.1 - 1) * 1000), Some(3 * lap));
        assert!(SECONDS.runs(5_000, 4_000).is_empty());
        assert_eq!(MINUTES.runs(59_999, 60_000), vec![(0, 2)]);
    }

    #[test]
    fn settling_waits_for_the_slice_end() {
        let settle = Duration::from_secs(5);
        // 100 ms slices: bucket [9 s, 10 s) ends at 10 s, settled from 15 s.
        assert_eq!(settled_until(14_999, 100, settle), 9_000);
        assert_eq!(settled_until(15_000, 100, settle), 10_000);
        // 10 s slices: the slice starting at 0 ends at 10 s, settled from 15 s (and the empty
        // buckets up to the next slice with it).
        assert_eq!(settled_until(14_999, 10_000, settle), 0);
        assert_eq!(settled_until(15_000, 10_000, settle), 10_000);
    }

    #[test]
    fn a_new_leader_starts_where_slices_may_still_exist() {
        let ret = Duration::from_secs(60);
        let settle = settle(ret);
        let now = 10_000_000;
        let first = first_bucket(now, 1_000, ret, settle);
        assert_eq!(first, now - 54_000);
        // The slice in progress started before that: start there.
        let day = 86_400_000;
        assert_eq!(first_bucket(day + 50_000_000, day as u64, ret, settle), day);
        // A week of retention is read back one hour at most.
        let week = Duration::from_secs(7 * 86_400);
        let now = 1_700_000_000_000;
        assert!(first_bucket(now, 1_000, week, settle) >= now - 3_600_000);
    }

    #[test]
    fn live_part_covers_what_the_harvest_has_not_reached() {
        let ret = Duration::from_secs(60);
        let now = 100_500;
        let live = live_from(now, 1_000, ret);
        // Not yet harvested: buckets from settled_until on, and a dormant task's harvest
        // may lag by its period.
        assert!(live <= settled_until(now, 1_000, settle(ret)) - 1_000);
        let period = dormant_period(ret).as_millis() as i64;
        assert!(live <= settled_until(now, 1_000, settle(ret)) - period - 1_000);
        // A long slice in progress is read live until it has been harvested.
        assert!(live_from(now, 60_000, ret) <= 60_000);
    }

    #[test]
    fn writes_coalesce_consecutive_slots() {
        let recs: Vec<Record> = [3_598_000, 3_599_000, 3_600_000, 3_602_000]
            .iter()
            .map(|&s| Record {
                start_ms: s,
                slices: 1,
                ..Record::default()
            })
            .collect();
        let w = ring_writes(SECONDS, &recs);
        // 3598+3599 together; 3600 wraps to slot 0; 3602 is not adjacent.
        assert_eq!(w.len(), 3);
        assert_eq!(
            w[0],
            (3_598 * 48, [recs[0].encode(), recs[1].encode()].concat())
        );
        assert_eq!(w[1].0, 0);
    }
}
