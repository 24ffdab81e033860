//! The host-shared memory segment: one file in `/dev/shm` per namespace and host, mapped by
//! every process of the host that uses Sluice.
//!
//! # Layout
//!
//! ```text
//!  /dev/shm/sluice.<namespace>.<host id>
//!  ┌──────────────────────────────────────────────────────────────────────────────┐
//!  │ Header   magic "SLUICE", layout version, slot count, size, slot size,       │
//!  │          checksum of those; alloc lock; clock offset to Redis; report clock │
//!  ├──────────────────────────────────────────────────────────────────────────────┤
//!  │ Slot 0   ident    READY flag, task name                                     │
//!  │          meta     last known task meta (packed fast word + the rest)        │
//!  │          control  state word (NORMAL/FAILED), next probe, pull lock, ...    │
//!  │          quota[2] packed quota word per slice parity + accounting           │
//!  │          ring[16] per-slice counters (adm, rej, ok, err, lat) to flush      │
//!  │          limiter  lock + cells + log of the local (fallback) limiter        │
//!  ├──────────────────────────────────────────────────────────────────────────────┤
//!  │ Slot 1 … Slot N-1                                                            │
//!  └──────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! Everything in the file is an atomic integer, so any bit pattern is a valid value and no
//! process can observe undefined behaviour, whatever another process wrote. Groups written by
//! different parties sit on their own cache lines.
//!
//! # The quota word
//!
//! The local quota of one slice is ONE `u64`: `tag:32 | exhausted:1 | count:31`. `tag` is the
//! slice index (`slice start / slice length`, truncated to 32 bits), `exhausted` says that
//! Redis had nothing left for that slice after the last pull (the host is LIMITED once `count`
//! is spent), `count` the permits in hand. A decision is one compare-and-swap that checks the
//! tag and lowers the count, so quota pulled for one slice can never be spent in another: when
//! the clock moves to the next slice the tag no longer matches. Two words (by slice parity)
//! let the next slice's quota be prefetched while the current one is still being spent.
//!
//! # Compatibility
//!
//! The header is checked on open: magic, layout version, slot size, file size and a checksum
//! over them. An incompatible or corrupt file is never read: a fresh file is built under a
//! temporary name and renamed over it (atomic on the same file system), and the replacement is
//! logged. Processes that still map the old file keep deciding from it (their pulls remain
//! globally correct); new processes share the new one. Open and replace run under `flock` on a
//! sidecar `.lock` file so two processes never replace the segment twice.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use memmap2::MmapMut;

use crate::protocol::{
    Fallback, FallbackAlgorithm, MAX_TASK_NAME_LEN, Mode, OnFailure, TaskMeta, slice_field,
};

/// `"SLUICE"` + 2 bytes of format family.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SLUICE\x00\x01");

/// Version of this layout. Bump it with any change to [`Header`] or [`Slot`].
pub const LAYOUT_VERSION: u64 = 1;

/// Slots per segment unless configured otherwise.
pub const DEFAULT_SLOTS: u32 = 64;

/// Most slots a segment may have.
pub const MAX_SLOTS: u32 = 4_096;

/// Counter ring entries per slot (indexed by slice tag).
pub const RING: usize = 16;

/// Words of the local limiter's state.
pub const LIMITER_CELLS: usize = 8;

/// Entries of the sliding-log limiter's log.
pub const LOG_CAP: usize = 1_024;

/// Largest count a quota word holds.
pub const MAX_COUNT: u32 = (1 << 31) - 1;

const EXHAUSTED: u64 = 1 << 31;
const READY: u64 = 1;
const EMPTY_TAG: u64 = u64::MAX;
const RING_BUSY: u64 = u64::MAX - 1;

/// The segment header.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Header {
    magic: AtomicU64,
    version: AtomicU64,
    slots: AtomicU64,
    size: AtomicU64,
    slot_size: AtomicU64,
    checksum: AtomicU64,
    _pad0: [AtomicU64; 2],
    /// Lock for claiming slots.
    pub alloc_lock: AtomicU64,
    /// Host clock minus Redis `TIME`, in µs (best recent measurement).
    pub clock_offset_us: AtomicI64,
    /// Round trip of that measurement, in µs (0 = never measured).
    pub clock_rtt_us: AtomicI64,
    /// When it was measured (host Unix ms).
    pub clock_measured_ms: AtomicI64,
    /// When this host last wrote its entry in `NS:hosts` (host Unix ms).
    pub host_report_ms: AtomicI64,
    _pad1: [AtomicU64; 3],
}

/// Slot identity: whether it is in use and by which task.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Ident {
    state: AtomicU64,
    name_len: AtomicU64,
    name: [AtomicU64; MAX_TASK_NAME_LEN / 8],
}

/// The last known meta of a task (written by whichever process refreshed it).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct MetaCells {
    /// `known:1 | mode:3 | on_failure:3 | algorithm:4 | slice_ms:32` (see [`FastMeta`]).
    pub fast: AtomicU64,
    /// Spec version (etcd mod revision).
    pub version: AtomicI64,
    /// Base threshold.
    pub threshold: AtomicU64,
    /// Fixed pull size (0 = automatic).
    pub pull: AtomicU64,
    /// FAILED-state per-host limit.
    pub local_limit: AtomicU64,
    /// Local limiter burst.
    pub burst: AtomicU64,
    /// When the meta was last read from Redis (host Unix ms), claimed by CAS.
    pub refreshed_ms: AtomicI64,
    /// Since when Redis has answered with an empty meta hash (0 = it has not).
    pub missing_since_ms: AtomicI64,
}

/// Control words of a task on this host.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Control {
    /// [`crate::state::Health`] encoded: NORMAL or FAILED since when.
    pub state: AtomicU64,
    /// When FAILED: the next probe (host Unix ms), claimed by CAS.
    pub next_probe_ms: AtomicI64,
    /// The cross-process pull lock ([`PidLock`]).
    pub pull_lock: AtomicU64,
    /// Slice tag + 1 in which a decision last asked for more quota (0 = none).
    pub want: AtomicU64,
    /// Demand (admitted + rejected) this host saw in the last finished slice.
    pub demand_prev: AtomicU64,
    /// Round trip of the last pull, µs.
    pub rtt_us: AtomicU64,
    /// When the counters were last flushed (host Unix ms), claimed by CAS.
    pub flushed_ms: AtomicI64,
    /// Largest `n` a decision asked for (pull sizes are never smaller).
    pub max_n: AtomicU64,
    /// The slice threshold (`cap`) Redis reported on the last pull.
    pub cap: AtomicU64,
    /// What Redis had left in the slice after the last pull.
    pub remaining: AtomicI64,
}

/// The local quota of one slice (parity) and its accounting.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct QuotaEntry {
    /// The packed quota word (see the module docs).
    pub word: AtomicU64,
    /// Permits granted by Redis for the word's slice (written under the pull lock).
    pub granted: AtomicU64,
    /// Part of `granted − count` already moved to the counter ring as admitted.
    pub accounted: AtomicU64,
    /// Below this count a decision asks for a prefetch.
    pub low_water: AtomicU64,
    /// When the first grant for this slice arrived (host Unix µs).
    pub first_grant_us: AtomicI64,
    _pad: [AtomicU64; 3],
}

/// Counters of one slice, waiting to be flushed into its slice hash.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct CounterEntry {
    /// Full slice index this entry counts for (`u64::MAX` or 0 before first use).
    pub tag: AtomicU64,
    /// `adm, rej, ok, err, lat_sum_us, lat_n` in [`slice_field::COUNTERS`] order.
    pub values: [AtomicU64; 6],
    _pad: AtomicU64,
}

/// State of the local limiter (fallback and mode `local`).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct LimiterCells {
    /// A [`PidLock`] guarding `cells` and the log.
    pub lock: AtomicU64,
    _pad: [AtomicU64; 7],
    /// Algorithm state.
    pub cells: [AtomicU64; LIMITER_CELLS],
}

/// Everything the host knows about one task.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Slot {
    /// In use, and by which task.
    pub ident: Ident,
    /// Last known meta.
    pub meta: MetaCells,
    /// State, lock, demand.
    pub ctl: Control,
    /// Local quota by slice parity.
    pub quota: [QuotaEntry; 2],
    /// Counters by slice, `tag % RING`.
    pub ring: [CounterEntry; RING],
    /// The local limiter.
    pub limiter: LimiterCells,
    /// The sliding-log limiter's ring of `(ms:40 | count:24)` entries.
    pub log: [AtomicU64; LOG_CAP],
}

const HEADER_SIZE: usize = std::mem::size_of::<Header>();
const SLOT_SIZE: usize = std::mem::size_of::<Slot>();
const _: () = assert!(HEADER_SIZE == 128);
const _: () = assert!(SLOT_SIZE.is_multiple_of(64));

/// Size in bytes of a segment with `slots` slots.
pub fn segment_size(slots: u32) -> u64 {
    (HEADER_SIZE + SLOT_SIZE * slots as usize) as u64
}

fn checksum(magic: u64, version: u64, slots: u64, size: u64, slot_size: u64) -> u64 {
    // FNV-1a over the five words.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in [magic, version, slots, size, slot_size] {
        for b in w.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Packs a quota word.
///
/// ```
/// use sluice::shm::{pack_quota, unpack_quota};
/// let w = pack_quota(7, true, 42);
/// assert_eq!(unpack_quota(w), (7, true, 42));
/// ```
pub fn pack_quota(tag: u32, exhausted: bool, count: u32) -> u64 {
    ((tag as u64) << 32) | if exhausted { EXHAUSTED } else { 0 } | (count.min(MAX_COUNT) as u64)
}

/// Unpacks a quota word into `(tag, exhausted, count)`.
pub fn unpack_quota(w: u64) -> (u32, bool, u32) {
    (
        (w >> 32) as u32,
        w & EXHAUSTED != 0,
        (w & MAX_COUNT as u64) as u32,
    )
}

/// True when tag `a` is later than tag `b` (wrapping, like TCP sequence numbers).
pub fn tag_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The fast-path part of a task's meta, packed into one word so a decision reads it with one
/// load and never sees half of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastMeta {
    /// Slice length.
    pub slice_ms: u64,
    /// Limiting mode.
    pub mode: Mode,
    /// FAILED behaviour.
    pub on_failure: OnFailure,
    /// Local limiter algorithm.
    pub algorithm: FallbackAlgorithm,
}

const MODES: [Mode; 4] = [
    Mode::Pooled,
    Mode::Local,
    Mode::ExactFixed,
    Mode::ExactSliding,
];
const ON_FAILURE: [OnFailure; 3] = [OnFailure::Local, OnFailure::Allow, OnFailure::Deny];
const ALGORITHMS: [FallbackAlgorithm; 5] = [
    FallbackAlgorithm::TokenBucket,
    FallbackAlgorithm::FixedWindow,
    FallbackAlgorithm::SlidingWindow,
    FallbackAlgorithm::SlidingLog,
    FallbackAlgorithm::LeakyBucket,
];

impl FastMeta {
    /// Encodes (the `known` bit set).
    pub fn encode(&self) -> u64 {
        let mode = MODES.iter().position(|m| *m == self.mode).unwrap_or(0) as u64;
        let onf = ON_FAILURE
            .iter()
            .position(|m| *m == self.on_failure)
            .unwrap_or(0) as u64;
        let alg = ALGORITHMS
            .iter()
            .position(|m| *m == self.algorithm)
            .unwrap_or(0) as u64;
        (1 << 63) | (mode << 40) | (onf << 36) | (alg << 32) | (self.slice_ms & 0xFFFF_FFFF)
    }

    /// Decodes; `None` when the word says "unknown" (or holds garbage).
    #[inline]
    pub fn decode(w: u64) -> Option<Self> {
        if w >> 63 == 0 {
            return None;
        }
        let slice_ms = w & 0xFFFF_FFFF;
        if slice_ms == 0 {
            return None;
        }
        Some(Self {
            slice_ms,
            mode: *MODES.get(((w >> 40) & 0x7) as usize)?,
            on_failure: *ON_FAILURE.get(((w >> 36) & 0x7) as usize)?,
            algorithm: *ALGORITHMS.get(((w >> 32) & 0xF) as usize)?,
        })
    }
}

impl Slot {
    /// The task name, if the slot is in use.
    pub fn name(&self) -> Option<String> {
        if self.ident.state.load(Ordering::Acquire) != READY {
            return None;
        }
        let len = (self.ident.name_len.load(Ordering::Relaxed) as usize).min(MAX_TASK_NAME_LEN);
        let mut bytes = Vec::with_capacity(MAX_TASK_NAME_LEN);
        for w in &self.ident.name {
            bytes.extend_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
        }
        bytes.truncate(len);
        String::from_utf8(bytes).ok()
    }

    fn name_is(&self, name: &str) -> bool {
        if self.ident.state.load(Ordering::Acquire) != READY
            || self.ident.name_len.load(Ordering::Relaxed) != name.len() as u64
        {
            return false;
        }
        let mut buf = [0u8; MAX_TASK_NAME_LEN];
        buf[..name.len()].copy_from_slice(name.as_bytes());
        self.ident.name.iter().enumerate().all(|(i, w)| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&buf[i * 8..i * 8 + 8]);
            w.load(Ordering::Relaxed) == u64::from_le_bytes(word)
        })
    }

    /// The last known meta, if any.
    pub fn meta(&self) -> Option<TaskMeta> {
        let fast = FastMeta::decode(self.meta.fast.load(Ordering::Acquire))?;
        Some(TaskMeta {
            slice_ms: fast.slice_ms,
            threshold: self.meta.threshold.load(Ordering::Relaxed),
            pull: self.meta.pull.load(Ordering::Relaxed),
            local_limit: self.meta.local_limit.load(Ordering::Relaxed),
            on_failure: fast.on_failure,
            mode: fast.mode,
            fallback: Fallback {
                algorithm: fast.algorithm,
                burst: self.meta.burst.load(Ordering::Relaxed),
            },
            version: self.meta.version.load(Ordering::Relaxed),
        })
    }

    /// Stores `meta` as the last known meta (the slow fields first, then the fast word).
    pub fn store_meta(&self, meta: &TaskMeta) {
        let m = &self.meta;
        m.threshold.store(meta.threshold, Ordering::Relaxed);
        m.pull.store(meta.pull, Ordering::Relaxed);
        m.local_limit.store(meta.local_limit, Ordering::Relaxed);
        m.burst.store(meta.fallback.burst, Ordering::Relaxed);
        m.version.store(meta.version, Ordering::Relaxed);
        let fast = FastMeta {
            slice_ms: meta.slice_ms,
            mode: meta.mode,
            on_failure: meta.on_failure,
            algorithm: meta.fallback.algorithm,
        };
        m.fast.store(fast.encode(), Ordering::Release);
    }

    /// Forgets the meta (the task was deleted).
    pub fn clear_meta(&self) {
        self.meta.fast.store(0, Ordering::Release);
    }

    /// The quota entry of slice `tag`.
    #[inline]
    pub fn entry(&self, tag: u32) -> &QuotaEntry {
        &self.quota[(tag & 1) as usize]
    }

    /// Adds `granted` permits of slice `tag` to the local quota (call under the pull lock).
    ///
    /// If the entry still holds an older slice, that slice is closed first: its admitted
    /// count (`granted − accounted − count left`) goes to the counter ring. A grant for a slice
    /// older than the entry's is dropped (it can no longer be spent). `exhausted` marks that
    /// Redis has nothing left for the slice. Returns false when the grant was dropped.
    pub fn deposit(
        &self,
        tag: u32,
        full_index: u64,
        granted: u64,
        exhausted: bool,
        now_us: i64,
    ) -> bool {
        let e = self.entry(tag);
        let add = granted.min(MAX_COUNT as u64) as u32;
        let mut cur = e.word.load(Ordering::Acquire);
        loop {
            let (t, ex, c) = unpack_quota(cur);
            let next = if t == tag {
                pack_quota(tag, ex || exhausted, c.saturating_add(add))
            } else if tag_after(tag, t) || cur == 0 {
                pack_quota(tag, exhausted, add)
            } else {
                return false;
            };
            match e
                .word
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if t == tag {
                        e.granted.fetch_add(add as u64, Ordering::Relaxed);
                    } else {
                        self.close_entry(e, t, c, full_index);
                        e.granted.store(add as u64, Ordering::Relaxed);
                        e.accounted.store(0, Ordering::Relaxed);
                        e.first_grant_us.store(now_us, Ordering::Relaxed);
                    }
                    return true;
                }
                Err(x) => cur = x,
            }
        }
    }

    /// Moves the admitted count of an entry that held slice `old_tag` (with `left` permits
    /// unspent) into the counter ring. `new_index` is the full index of a slice at or after it.
    fn close_entry(&self, e: &QuotaEntry, old_tag: u32, left: u32, new_index: u64) {
        let granted = e.granted.load(Ordering::Relaxed);
        let accounted = e.accounted.load(Ordering::Relaxed);
        let admitted = granted
            .saturating_sub(accounted)
            .saturating_sub(left as u64);
        if granted == 0 {
            return;
        }
        let old_index = untag(old_tag, new_index);
        self.count(old_index, 0, admitted);
        let rej = self.ring_value(old_index, 1);
        self.ctl
            .demand_prev
            .store(granted.saturating_sub(left as u64) + rej, Ordering::Relaxed);
    }

    /// Moves what was admitted so far from every quota entry into the counter ring (call
    /// under the pull lock). `now_index` is the current full slice index.
    pub fn account(&self, now_index: u64) {
        for e in &self.quota {
            let (t, _, c) = unpack_quota(e.word.load(Ordering::Acquire));
            let granted = e.granted.load(Ordering::Relaxed);
            let accounted = e.accounted.load(Ordering::Relaxed);
            let delta = granted.saturating_sub(accounted).saturating_sub(c as u64);
            if delta > 0 {
                e.accounted.fetch_add(delta, Ordering::Relaxed);
                self.count(untag(t, now_index), 0, delta);
            }
        }
    }

    /// Admitted so far (this host) in slice `tag`, from the quota accounting.
    pub fn consumed(&self, tag: u32) -> u64 {
        let e = self.entry(tag);
        let (t, _, c) = unpack_quota(e.word.load(Ordering::Acquire));
        if t != tag {
            return 0;
        }
        e.granted.load(Ordering::Relaxed).saturating_sub(c as u64)
    }

    /// Adds `v` to counter `field` (index into [`slice_field::COUNTERS`]) of slice `index`.
    ///
    /// An entry still holding another (older) slice is taken over: its tag is set to a busy
    /// marker, its values are zeroed, then the new tag is published, so no concurrent add for
    /// the new slice can be wiped. The old slice's unflushed counts are dropped: the flusher
    /// runs far more often than the ring wraps, so this only happens while Redis is
    /// unreachable for longer than [`RING`] slices.
    #[inline]
    pub fn count(&self, index: u64, field: usize, v: u64) {
        if v == 0 {
            return;
        }
        let e = &self.ring[(index % RING as u64) as usize];
        let mut spins = 0u32;
        loop {
            let t = e.tag.load(Ordering::Acquire);
            if t == index {
                break;
            }
            if t == RING_BUSY {
                spins += 1;
                // A process died between marking and publishing: take the entry over.
                if spins > 100_000
                    && e.tag
                        .compare_exchange(RING_BUSY, index, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    break;
                }
                std::hint::spin_loop();
                continue;
            }
            // Never take an entry back to an older slice.
            if t != EMPTY_TAG && t != 0 && t > index {
                return;
            }
            if e.tag
                .compare_exchange(t, RING_BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                for x in &e.values {
                    x.store(0, Ordering::Relaxed);
                }
                e.tag.store(index, Ordering::Release);
                break;
            }
        }
        if let Some(x) = e.values.get(field) {
            x.fetch_add(v, Ordering::Relaxed);
        }
    }

    fn ring_value(&self, index: u64, field: usize) -> u64 {
        let e = &self.ring[(index % RING as u64) as usize];
        if e.tag.load(Ordering::Acquire) != index {
            return 0;
        }
        e.values[field].load(Ordering::Relaxed)
    }

    /// Takes (and zeroes) every non-zero counter entry: `(full slice index, counters)`.
    pub fn drain_counters(&self) -> Vec<(u64, [u64; 6])> {
        let mut out = Vec::new();
        for e in &self.ring {
            let index = e.tag.load(Ordering::Acquire);
            if index == EMPTY_TAG || index == 0 || index == RING_BUSY {
                continue;
            }
            let mut vals = [0u64; 6];
            for (v, x) in vals.iter_mut().zip(&e.values) {
                *v = x.swap(0, Ordering::AcqRel);
            }
            if vals.iter().any(|v| *v != 0) {
                out.push((index, vals));
            }
        }
        out
    }

    /// Puts counters back after a failed flush.
    pub fn restore_counters(&self, batch: &[(u64, [u64; 6])]) {
        for (index, vals) in batch {
            for (field, v) in vals.iter().enumerate() {
                self.count(*index, field, *v);
            }
        }
    }

    /// The pull lock.
    pub fn pull_lock(&self) -> PidLock<'_> {
        PidLock(&self.ctl.pull_lock)
    }

    /// The limiter lock.
    pub fn limiter_lock(&self) -> PidLock<'_> {
        PidLock(&self.limiter.lock)
    }
}

/// The full slice index of a 32-bit tag, given the full index of a slice at or after it.
pub fn untag(tag: u32, later_index: u64) -> u64 {
    later_index.wrapping_sub((later_index as u32).wrapping_sub(tag) as u64)
}

/// Index of `slice_field` names in [`Slot::count`].
pub mod field {
    /// Admitted.
    pub const ADMITTED: usize = 0;
    /// Rejected.
    pub const REJECTED: usize = 1;
    /// OK outcomes.
    pub const OK: usize = 2;
    /// Failed outcomes.
    pub const ERR: usize = 3;
    /// Latency sum (µs).
    pub const LAT_SUM_US: usize = 4;
    /// Latency count.
    pub const LAT_N: usize = 5;
    const _: () = assert!(super::slice_field::COUNTERS.len() == 6);
}

/// A lock in shared memory: one word holding `pid:32 | acquired_ms:32` (0 = free).
///
/// Taken with compare-and-swap. A waiter takes the lock over when the holder's pid is dead
/// (`kill(pid, 0)` says ESRCH, or the process is a zombie) or the lock is older than the
/// caller's timeout, so a crashed holder costs one check instead of the seed's minute.
#[derive(Debug, Clone, Copy)]
pub struct PidLock<'a>(pub &'a AtomicU64);

/// The outcome of [`PidLock::try_lock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockAttempt {
    /// The caller holds the lock; unlock with this token.
    Acquired {
        /// Pass to [`PidLock::unlock`].
        token: u64,
        /// The pid of a dead or timed-out holder that was replaced, if any.
        took_over_from: Option<u32>,
    },
    /// A live holder has it.
    Busy {
        /// The holder.
        pid: u32,
        /// How long it has held it.
        age_ms: u64,
    },
}

impl PidLock<'_> {
    /// Tries once to take the lock for `pid` at `now_ms`.
    pub fn try_lock(&self, pid: u32, now_ms: i64, timeout_ms: u64) -> LockAttempt {
        let token = ((pid as u64) << 32) | (now_ms as u64 & 0xFFFF_FFFF).max(1);
        let cur = self.0.load(Ordering::Acquire);
        if cur == 0 {
            return match self
                .0
                .compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => LockAttempt::Acquired {
                    token,
                    took_over_from: None,
                },
                Err(x) => busy(x, now_ms),
            };
        }
        let holder = (cur >> 32) as u32;
        let age = (now_ms as u32).wrapping_sub(cur as u32) as u64;
        let age = if age > u32::MAX as u64 / 2 { 0 } else { age };
        if age > timeout_ms || !pid_alive(holder) {
            if self
                .0
                .compare_exchange(cur, token, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return LockAttempt::Acquired {
                    token,
                    took_over_from: Some(holder),
                };
            }
            return busy(self.0.load(Ordering::Acquire), now_ms);
        }
        LockAttempt::Busy {
            pid: holder,
            age_ms: age,
        }
    }

    /// Releases the lock if `token` still holds it (a holder that was taken over does not
    /// release its successor's lock). Returns whether it did.
    pub fn unlock(&self, token: u64) -> bool {
        self.0
            .compare_exchange(token, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The current holder's pid, if held.
    pub fn holder(&self) -> Option<u32> {
        let w = self.0.load(Ordering::Acquire);
        (w != 0).then_some((w >> 32) as u32)
    }
}

fn busy(w: u64, now_ms: i64) -> LockAttempt {
    LockAttempt::Busy {
        pid: (w >> 32) as u32,
        age_ms: (now_ms as u32).wrapping_sub(w as u32) as u64,
    }
}

/// Is `pid` a live (non-zombie) process?
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: kill(2) with signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // A zombie (dead, not yet reaped) still answers kill(0).
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next()),
            Some("Z") | Some("X")
        ),
        Err(_) => rc == 0,
    }
}

/// Why a segment could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("shared memory segment {path}: {source}")]
pub struct SegmentError {
    /// The file.
    pub path: PathBuf,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// A mapped segment.
#[derive(Debug)]
pub struct Segment {
    map: MmapMut,
    path: PathBuf,
    slots: usize,
}

// The mapping is only ever accessed through atomics.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

/// What [`Segment::open`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// A valid segment was there.
    Existing,
    /// There was none; a fresh one was created.
    Created,
    /// An incompatible or corrupt one was replaced; the reason.
    Replaced(String),
}

/// Replaces characters that are not `[A-Za-z0-9_.-]` with `_`.
pub fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(128)
        .collect()
}

impl Segment {
    /// `dir/sluice.<namespace>.<host id>`.
    ///
    /// ```
    /// let p = sluice::shm::Segment::path_for("/dev/shm".as_ref(), "sluice", "web-1");
    /// assert_eq!(p.to_str(), Some("/dev/shm/sluice.sluice.web-1"));
    /// ```
    pub fn path_for(dir: &Path, namespace: &str, host_id: &str) -> PathBuf {
        dir.join(format!(
            "sluice.{}.{}",
            sanitize(namespace),
            sanitize(host_id)
        ))
    }

    /// Opens (creating or replacing as needed) the segment at `path` with `slots` slots for a
    /// new file. An existing valid file keeps its own slot count.
    pub fn open(path: &Path, slots: u32) -> Result<(Segment, Opened), SegmentError> {
        let err = |source| SegmentError {
            path: path.to_path_buf(),
            source,
        };
        let slots = slots.clamp(1, MAX_SLOTS);
        let lock_path = sibling(path, ".lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o660)
            .open(&lock_path)
            .map_err(err)?;
        let _guard = Flock::lock(&lock).map_err(err)?;
        let mut opened = Opened::Existing;
        if path.exists() {
            match Self::map_existing(path) {
                Ok(seg) => return Ok((seg, opened)),
                Err(reason) => {
                    tracing::warn!(path = %path.display(), %reason,
                        "shared memory segment is incompatible or corrupt; replacing it");
                    opened = Opened::Replaced(reason);
                }
            }
        } else {
            opened = Opened::Created;
        }
        Self::create_fresh(path, slots).map_err(err)?;
        let seg = Self::map_existing(path).map_err(|reason| err(std::io::Error::other(reason)))?;
        Ok((seg, opened))
    }

    fn map_existing(path: &Path) -> Result<Segment, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("cannot open: {e}"))?;
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        if len < HEADER_SIZE as u64 {
            return Err(format!("file is {len} bytes, shorter than the header"));
        }
        // SAFETY: the file is a regular file we keep open; every access goes through atomics,
        // so concurrent writers (other processes) cannot cause undefined behaviour.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| format!("mmap: {e}"))?;
        let seg = Segment {
            map,
            path: path.to_path_buf(),
            slots: 0,
        };
        let h = seg.header();
        let magic = h.magic.load(Ordering::Acquire);
        let version = h.version.load(Ordering::Acquire);
        let slots = h.slots.load(Ordering::Acquire);
        let size = h.size.load(Ordering::Acquire);
        let slot_size = h.slot_size.load(Ordering::Acquire);
        let sum = h.checksum.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(format!("bad magic {magic:#x}"));
        }
        if version != LAYOUT_VERSION {
            return Err(format!(
                "layout version {version}, this SDK uses {LAYOUT_VERSION}"
            ));
        }
        if sum != checksum(magic, version, slots, size, slot_size) {
            return Err("header checksum mismatch".into());
        }
        if slot_size != SLOT_SIZE as u64 {
            return Err(format!("slot size {slot_size}, this SDK uses {SLOT_SIZE}"));
        }
        if slots == 0
            || slots > MAX_SLOTS as u64
            || size != segment_size(slots as u32)
            || size != len
        {
            return Err(format!(
                "size {size} / file {len} does not match {slots} slots"
            ));
        }
        Ok(Segment {
            slots: slots as usize,
            ..seg
        })
    }

    fn create_fresh(path: &Path, slots: u32) -> std::io::Result<()> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = sibling(path, &format!(".tmp.{}.{nanos}", std::process::id()));
        let result = (|| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o660)
                .open(&tmp)?;
            let size = segment_size(slots);
            file.set_len(size)?;
            // SAFETY: a file only this process knows about yet.
            let map = unsafe { MmapMut::map_mut(&file)? };
            let seg = Segment {
                map,
                path: tmp.clone(),
                slots: slots as usize,
            };
            let h = seg.header();
            h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
            h.slots.store(slots as u64, Ordering::Relaxed);
            h.size.store(size, Ordering::Relaxed);
            h.slot_size.store(SLOT_SIZE as u64, Ordering::Relaxed);
            h.checksum.store(
                checksum(MAGIC, LAYOUT_VERSION, slots as u64, size, SLOT_SIZE as u64),
                Ordering::Relaxed,
            );
            h.magic.store(MAGIC, Ordering::Release);
            for i in 0..seg.slots {
                if let Some(s) = seg.slot(i) {
                    for e in &s.ring {
                        e.tag.store(EMPTY_TAG, Ordering::Relaxed);
                    }
                }
            }
            seg.map.flush()?;
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The header.
    pub fn header(&self) -> &Header {
        // SAFETY: the map is at least HEADER_SIZE bytes (checked on open), page aligned, and
        // Header consists of atomics only.
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    /// Slot `i`.
    pub fn slot(&self, i: usize) -> Option<&Slot> {
        if i >= self.slots {
            return None;
        }
        // SAFETY: in bounds (size checked on open), 64-byte aligned (header is 128 bytes and
        // Slot a multiple of 64), atomics only.
        Some(unsafe { &*(self.map.as_ptr().add(HEADER_SIZE + i * SLOT_SIZE) as *const Slot) })
    }

    /// The slot of task `name`, if one exists.
    pub fn find(&self, name: &str) -> Option<usize> {
        (0..self.slots).find(|i| self.slot(*i).is_some_and(|s| s.name_is(name)))
    }

    /// The slot of task `name`, claiming a free one if needed. `None` when the segment is full.
    pub fn find_or_claim(&self, name: &str, lock_timeout_ms: u64) -> Option<usize> {
        if let Some(i) = self.find(name) {
            return Some(i);
        }
        let lock = PidLock(&self.header().alloc_lock);
        let pid = std::process::id();
        let deadline =
            std::time::Instant::now() + std::time::Duration::from_millis(lock_timeout_ms * 2);
        let token = loop {
            match lock.try_lock(pid, crate::clock::host_ms(), lock_timeout_ms) {
                LockAttempt::Acquired { token, .. } => break token,
                LockAttempt::Busy { .. } if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_micros(200))
                }
                LockAttempt::Busy { .. } => return None,
            }
        };
        let result = self.find(name).or_else(|| {
            let i = (0..self.slots).find(|i| {
                self.slot(*i)
                    .is_some_and(|s| s.ident.state.load(Ordering::Acquire) != READY)
            })?;
            let s = self.slot(i)?;
            let mut buf = [0u8; MAX_TASK_NAME_LEN];
            let n = name.len().min(MAX_TASK_NAME_LEN);
            buf[..n].copy_from_slice(&name.as_bytes()[..n]);
            for (k, w) in s.ident.name.iter().enumerate() {
                let mut word = [0u8; 8];
                word.copy_from_slice(&buf[k * 8..k * 8 + 8]);
                w.store(u64::from_le_bytes(word), Ordering::Relaxed);
            }
            s.ident.name_len.store(n as u64, Ordering::Relaxed);
            s.ident.state.store(READY, Ordering::Release);
            Some(i)
        });
        lock.unlock(token);
        result
    }

    /// Names and indexes of every slot in use.
    pub fn tasks(&self) -> Vec<(usize, String)> {
        (0..self.slots)
            .filter_map(|i| Some((i, self.slot(i)?.name()?)))
            .collect()
    }
}

/// `path` with `suffix` appended to its file name.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

struct Flock<'a>(&'a File);

impl<'a> Flock<'a> {
    fn lock(f: &'a File) -> std::io::Result<Self> {
        loop {
            // SAFETY: flock on an open descriptor.
            let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(Self(f));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: unlocking our own lock.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_seg(slots: u32) -> (tempfile::TempDir, Segment) {
        let dir = tempfile::tempdir().unwrap();
        let path = Segment::path_for(dir.path(), "ns", "h");
        let (seg, opened) = Segment::open(&path, slots).unwrap();
        assert_eq!(opened, Opened::Created);
        (dir, seg)
    }

    #[test]
    fn quota_word_never_crosses_slices() {
        let (_d, seg) = tmp_seg(2);
        let s = seg.slot(0).unwrap();
        assert!(s.deposit(10, 10, 5, false, 0));
        assert_eq!(
            unpack_quota(s.entry(10).word.load(Ordering::Relaxed)),
            (10, false, 5)
        );
        // Same parity, later slice: replaces (and closes) slice 10.
        assert!(s.deposit(12, 12, 3, true, 0));
        assert_eq!(
            unpack_quota(s.entry(12).word.load(Ordering::Relaxed)),
            (12, true, 3)
        );
        // A late grant for slice 10 is dropped.
        assert!(!s.deposit(10, 12, 9, false, 0));
        // Slice 10 admitted nothing: granted 5, 5 left.
        assert_eq!(s.drain_counters(), vec![]);
    }

    #[test]
    fn accounting_counts_admitted_once() {
        let (_d, seg) = tmp_seg(1);
        let s = seg.slot(0).unwrap();
        s.deposit(4, 4, 10, false, 0);
        let e = s.entry(4);
        e.word.fetch_sub(3, Ordering::Relaxed); // three decisions
        s.account(4);
        e.word.fetch_sub(2, Ordering::Relaxed);
        s.count(4, field::REJECTED, 7);
        s.deposit(6, 6, 1, false, 0); // closes slice 4: 5 admitted in all
        let drained = s.drain_counters();
        assert_eq!(drained, vec![(4, [5, 7, 0, 0, 0, 0])]);
        assert_eq!(s.ctl.demand_prev.load(Ordering::Relaxed), 12);
        assert!(s.drain_counters().is_empty());
    }

    #[test]
    fn slots_are_claimed_once_and_found_by_name() {
        let (_d, seg) = tmp_seg(2);
        let a = seg.find_or_claim("alpha", 1000).unwrap();
        let b = seg.find_or_claim("beta.v2", 1000).unwrap();
        assert_ne!(a, b);
        assert_eq!(seg.find_or_claim("alpha", 1000), Some(a));
        assert_eq!(seg.find_or_claim("gamma", 1000), None);
        assert_eq!(seg.slot(b).unwrap().name().as_deref(), Some("beta.v2"));
    }

    #[test]
    fn meta_round_trips_through_the_segment() {
        let (_d, seg) = tmp_seg(1);
        let s = seg.slot(0).unwrap();
        assert!(s.meta().is_none());
        let meta = TaskMeta {
            slice_ms: 1000,
            threshold: 2000,
            pull: 0,
            local_limit: 300,
            on_failure: OnFailure::Deny,
            mode: Mode::ExactSliding,
            fallback: Fallback {
                algorithm: FallbackAlgorithm::SlidingLog,
                burst: 9,
            },
            version: 3,
        };
        s.store_meta(&meta);
        assert_eq!(s.meta(), Some(meta));
        s.clear_meta();
        assert!(s.meta().is_none());
    }

    #[test]
    fn dead_holder_is_taken_over_live_one_is_not() {
        let w = AtomicU64::new(0);
        let lock = PidLock(&w);
        let me = std::process::id();
        let LockAttempt::Acquired { token, .. } = lock.try_lock(me, 1_000, 5_000) else {
            panic!("free lock not acquired")
        };
        assert!(matches!(
            lock.try_lock(me, 1_010, 5_000),
            LockAttempt::Busy { .. }
        ));
        // Timed out.
        assert!(matches!(
            lock.try_lock(me, 7_000, 5_000),
            LockAttempt::Acquired { took_over_from: Some(p), .. } if p == me
        ));
        assert!(
            !lock.unlock(token),
            "a replaced holder must not unlock its successor"
        );
        // A pid that cannot exist.
        w.store(((i32::MAX as u64 - 1) << 32) | 1_000, Ordering::Relaxed);
        assert!(matches!(
            lock.try_lock(me, 1_001, 5_000),
            LockAttempt::Acquired {
                took_over_from: Some(_),
                ..
            }
        ));
    }

    #[test]
    fn corrupt_and_old_segments_are_replaced_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = Segment::path_for(dir.path(), "ns", "h");
        std::fs::write(&path, vec![0xA5u8; 4096]).unwrap();
        let (seg, opened) = Segment::open(&path, 4).unwrap();
        assert!(
            matches!(opened, Opened::Replaced(ref r) if r.contains("magic")),
            "{opened:?}"
        );
        assert_eq!(seg.slots(), 4);
        drop(seg);
        // An older layout: valid magic, other version.
        let (seg, _) = Segment::open(&path, 4).unwrap();
        seg.header()
            .version
            .store(LAYOUT_VERSION - 1, Ordering::Relaxed);
        drop(seg);
        let (seg, opened) = Segment::open(&path, 4).unwrap();
        assert!(
            matches!(opened, Opened::Replaced(ref r) if r.contains("version")),
            "{opened:?}"
        );
        assert_eq!(seg.header().version.load(Ordering::Relaxed), LAYOUT_VERSION);
        drop(seg);
        // Truncated.
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(1000).unwrap();
        let (_seg, opened) = Segment::open(&path, 4).unwrap();
        assert!(matches!(opened, Opened::Replaced(_)));
        let (_seg, opened) = Segment::open(&path, 4).unwrap();
        assert_eq!(opened, Opened::Existing);
    }

    #[test]
    fn untag_recovers_full_indexes() {
        let big = (1u64 << 34) + 5;
        assert_eq!(untag(big as u32, big), big);
        assert_eq!(untag((big - 3) as u32, big), big - 3);
        assert!(tag_after(1, u32::MAX));
        assert!(!tag_after(5, 5));
    }
}
