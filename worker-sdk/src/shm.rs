//! The host-shared memory segment: one file in `/dev/shm` per namespace and host, mapped by
//! every process of the host that uses Sluice.
//!
//! # Layout
//!
//! ```text
//!  /dev/shm/sluice.<namespace>.<host id>
//!  ┌──────────────────────────────────────────────────────────────────────────────┐
//!  │ Header   magic "SLUICE", layout version, slot count, size, slot size,       │
//!  │          participant count, checksum of those; segment id; alloc lock;      │
//!  │          clock offset to Redis; report clock; flush sequence; key report    │
//!  │          clock                                                              │
//!  ├──────────────────────────────────────────────────────────────────────────────┤
//!  │ Participants[1024]   generation + pid of each process (open) of the segment  │
//!  ├──────────────────────────────────────────────────────────────────────────────┤
//!  │ Slot 0   ident    READY flag, task name, slot generation, last use          │
//!  │          meta     last known task meta (packed fast word + the rest)        │
//!  │          control  state word (NORMAL/FAILED), next probe, pull + flush lock │
//!  │          quota[2] packed quota word per slice parity + accounting           │
//!  │          ring[16] per-slice counters (adm, rej, ok, err, lat) to flush      │
//!  │          limiter  cells + bucket ring of the local (fallback) limiter       │
//!  │          conc     mode concurrency: permit word (limit | in use), lease     │
//!  │                   validity, lease lock + seq, demand, per-process holders  │
//!  ├──────────────────────────────────────────────────────────────────────────────┤
//!  │ Slot 1 … Slot N-1                                                            │
//!  └──────────────────────────────────────────────────────────────────────────────┘
//! ```
//!
//! Everything in the file is an atomic integer, so any bit pattern is a valid value and no
//! process can observe undefined behaviour, whatever another process wrote. Groups written by
//! different parties sit on their own cache lines.
//!
//! # Slice identity
//!
//! A slice is named everywhere in the segment by its **start in Unix ms**, the number that
//! names its Redis key `NS:{T}:s:<start_ms>`. That identity survives a change of the task's
//! slice length (the grid): quota pulled from key `s:X` is only ever spent by decisions whose
//! slice (on the grid in force when they decide) starts at `X`, and counters counted for `X`
//! are flushed to `s:X`, whatever the grid is by the time they are flushed. If an old and a new
//! grid share a start, both draw from the same key: safe by key identity.
//!
//! # The quota word
//!
//! The local quota of one slice is ONE `u64`: `tag:32 | exhausted:1 | count:31`. `tag` is the
//! slice's start in Unix ms truncated to 32 bits (compared with wrapping arithmetic, so it is
//! unambiguous within ±24 days); `exhausted` says that Redis had nothing left for that slice
//! after the last pull (the host is LIMITED once `count` is spent), `count` the permits in
//! hand. A decision is one compare-and-swap that checks the tag and lowers the count, so quota
//! pulled for one slice can never be spent in another: when the clock moves to the next slice
//! the tag no longer matches. Two words, chosen by the parity of `start / slice_ms` on the
//! current grid, let the next slice's quota be prefetched while the current one is still being
//! spent. A deposit replaces a word holding another slice unless the deposited slice has
//! already ended ([`Slot::deposit`]); on one grid the other slice of the same parity has always
//! ended by then.
//!
//! # Participants and locks
//!
//! Every open of the segment (every [`Segment`], so every `Client`: two clients in one process
//! are two participants) claims a **participant slot**: an exclusive open-file-description
//! lock (`fcntl(F_OFD_SETLK)`) on one byte of the segment file, held while the `Segment` lives,
//! and a generation in the participant table, bumped on every claim. The kernel releases the
//! byte lock when the process dies, whatever PID namespace it lives in, so liveness needs no
//! pid: a lock word ([`ShmLock`]) holds `participant:16 | generation:16 | acquired_ms:32`, and
//! its holder is alive iff `F_OFD_GETLK` finds the participant's byte locked and the
//! participant's generation still matches (a reused participant slot has a new generation).
//! Lock timeouts stay as a backstop for a live but stuck holder. A child made by `fork()`
//! without `exec` inherits the open file description, so it counts as the same participant as
//! its parent: create clients after forking.
//!
//! # Slot reclamation
//!
//! A slot records when a process last held a live `Task` handle for it (`used_ms`, refreshed
//! about once a second). When no slot is free, [`Segment::claim`] reclaims the slot idle
//! longest, if it has been idle at least the configured bound: it bumps the slot's generation,
//! which is also carried by the meta fast word, so a stale handle (of a process that kept a
//! handle but stopped refreshing, e.g. a stopped process) notices on its next decision and
//! re-resolves its task by name instead of spending another task's quota.
//!
//! # Compatibility
//!
//! The header is checked on open: magic, layout version, slot size, file size and a checksum
//! over them. An incompatible or corrupt file is never read: a fresh file is built under a
//! temporary name and renamed over it (atomic on the same file system), and the replacement is
//! logged. The same happens to a valid file with fewer slots than asked for (segments only
//! grow). Processes that still map the old file keep deciding from it (their pulls remain
//! globally correct); new processes share the new one. Open and replace run under `flock` on a
//! sidecar `.lock` file so two processes never replace the segment twice.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use memmap2::MmapMut;

use crate::protocol::{
    Fallback, FallbackAlgorithm, MAX_TASK_NAME_LEN, Mode, OnFailure, Pacing, TaskMeta, slice_field,
};

/// `"SLUICE"` + 2 bytes of format family.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SLUICE\x00\x01");

/// Version of this layout. Bump it with any change to [`Header`] or [`Slot`].
///
/// * 1: quota tags were slice indexes; pid liveness.
/// * 2: slices named by start (Unix ms), participant table and OFD-lock liveness, slot
///   generations and reclamation, flush lock.
/// * 3: [`ConcCells`] at the end of each slot (mode `concurrency`).
/// * 4: shadow (bit 61) and pacing (bit 62) in the meta fast word, `Control::pace_burst`, a
///   seventh counter (`wrej`, would-reject) in each [`CounterEntry`].
/// * 5: the local limiter is lock-free (`crate::limiter`): its cells and log hold other
///   words (no lock; the sliding log is a bucket ring), so a process of layout 4 must not share
///   them; and [`ConcCells::bound`] (`generation | bound`, written by compare-and-swap) replaces
///   `room` (`cap − others`): a late LEASE answer can no longer raise the host's limit.
pub const LAYOUT_VERSION: u64 = 5;

/// Slots per segment unless configured otherwise.
pub const DEFAULT_SLOTS: u32 = 64;

/// Most slots a segment may have.
pub const MAX_SLOTS: u32 = 4_096;

/// Participant slots per segment: processes (clients) that can use one host segment at once.
pub const PARTICIPANTS: usize = 1_024;

/// Counter ring entries per slot (indexed by `start / slice_ms`).
pub const RING: usize = 16;

/// Words of the local limiter's state.
pub const LIMITER_CELLS: usize = 8;

/// Words of the local limiter's log (the sliding log's bucket ring uses the first 128).
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
    participants: AtomicU64,
    /// This file's own id: random, never 0, written when the file is created (or, for a file
    /// an older build of this layout created, by the first open that finds 0). The key table
    /// outlives a replaced segment; its entries carry this id, so a key entry is only ever
    /// used by processes of the segment that claimed it (see `crate::keyed`).
    pub segment_id: AtomicU64,
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
    /// Last flush sequence number of this host (host µs based, strictly increasing).
    pub flush_seq: AtomicU64,
    /// When this segment's processes last reported their key counters (host Unix ms), claimed
    /// by CAS (`crate::keyed`; per segment, since the key table may be shared by two).
    pub key_report_ms: AtomicI64,
    _pad1: AtomicU64,
}

/// One participant (an open of the segment) in the participant table.
#[repr(C)]
#[derive(Debug)]
pub struct Participant {
    /// Generation, bumped on every claim of this participant slot (low 16 bits used, never 0).
    pub generation: AtomicU64,
    /// The claimer's pid as seen in its own PID namespace (for logs only).
    pub pid: AtomicU64,
}

/// Slot identity: whether it is in use, by which task, and its generation.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Ident {
    state: AtomicU64,
    name_len: AtomicU64,
    name: [AtomicU64; MAX_TASK_NAME_LEN / 8],
    /// Slot generation: bumped when the slot is reclaimed for another task (low 16 bits used).
    pub generation: AtomicU64,
    /// When a process last held a live `Task` handle for this slot (host Unix ms).
    pub used_ms: AtomicI64,
}

/// The last known meta of a task (written by whichever process refreshed it).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct MetaCells {
    /// `known:1 | paced:1 (bit 62) | shadow:1 (bit 61) | keyed (bit 60) | generation:16
    /// (bits 44–59) | mode:3 | on_failure:3 | algorithm:4 | slice_ms:32` (see [`FastMeta`]);
    /// the generation is set even while unknown.
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
    /// The cross-process pull lock ([`ShmLock`]).
    pub pull_lock: AtomicU64,
    /// Slice start + 1 (Unix ms) in which a decision last asked for more quota (0 = none).
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
    /// The cross-process flush lock ([`ShmLock`]): held from draining the counters through
    /// the FLUSH call, so one host's flushes never interleave.
    pub flush_lock: AtomicU64,
    /// Slice start (Unix ms) that Redis said has not started yet (PULL "outside window").
    pub early_start: AtomicI64,
    /// No pull for `early_start` before this host time (Unix ms).
    pub early_until_ms: AtomicI64,
    /// Paced slices: permits released at a slice's start on top of the pace (meta `pace_burst`).
    pub pace_burst: AtomicU64,
    _pad: [AtomicU64; 2],
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
    /// Slice length of the word's slice (its grid), ms.
    pub slice_ms: AtomicU64,
    /// `cap − remaining` Redis reported after the last pull for the word's slice (everything
    /// granted to any host, forfeits included), written before the deposit. On paced slices
    /// the host's stock is taken to be the top of that range (see `docs/sdk.md`).
    pub pace_granted: AtomicU64,
    /// The `cap` Redis reported on that pull: paced slices pace against it, and a decision of
    /// the slice that costs more is LIMITED without asking Redis.
    pub pace_cap: AtomicU64,
}

/// Counters of one slice, waiting to be flushed into its slice hash.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct CounterEntry {
    /// Start (Unix ms) of the slice this entry counts for (`u64::MAX` or 0 before first use).
    pub tag: AtomicU64,
    /// `adm, rej, ok, err, lat_sum_us, lat_n, wrej` in [`slice_field::WIRE_COUNTERS`] order.
    pub values: [AtomicU64; 7],
}

/// State of the local limiter (fallback and mode `local`); see `crate::limiter` for what
/// each word holds. Lock-free since layout 5.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct LimiterCells {
    /// Unused since layout 5 (was the limiter's lock); kept so the layout did not move.
    pub lock: AtomicU64,
    _pad: [AtomicU64; 7],
    /// Algorithm state.
    pub cells: [AtomicU64; LIMITER_CELLS],
}

/// Processes of one host that can hold permits of one concurrency task at once.
pub const HOLDERS: usize = 128;

/// Mode `concurrency` on this host: the leased block of permits and who uses them
/// (see [`Permit`](crate::Permit)).
///
/// `permits` packs `limit:32 | in_use:32`: a permit is handed out by one compare-and-swap
/// that raises `in_use` while it is below `limit`, and the lease holder lowers `limit` with a
/// compare-and-swap that sees `in_use`, so a shrink never leaves more in use than it allows.
/// Each process's share of `in_use` is in `holders` (`participant:16 | generation:16 |
/// count:32`, 0 = free), so the permits of a dead process (its byte lock gone, see the module
/// docs) are subtracted at once by whichever process notices.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct ConcCells {
    /// `limit:32 | in_use:32`.
    pub permits: AtomicU64,
    /// Regime: 0 lease (hand out while `now < valid_until_ms`), 1 FAILED local
    /// (`limit` = local_limit), 2 FAILED allow, 3 FAILED deny.
    pub regime: AtomicU64,
    /// Permits may be handed out under the lease until this time (boot-clock ms; 0 = none).
    pub valid_until_ms: AtomicI64,
    /// The cross-process lease lock ([`ShmLock`]): held through a LEASE call.
    pub lease_lock: AtomicU64,
    /// Sequence number of the host's last LEASE call.
    pub seq: AtomicU64,
    /// Callers waiting for a permit now (demand).
    pub waiting: AtomicU64,
    /// Refused `try_permit`s (demand), ever.
    pub denied: AtomicU64,
    /// Boot-clock ms at which the last successful LEASE call was sent (0 = never).
    pub sent_ok_ms: AtomicI64,
    /// Lease TTL (ms): from the meta, then from each reply.
    pub lease_ms: AtomicU64,
    /// Threshold (permits in flight) from the last reply.
    pub cap: AtomicU64,
    /// Other hosts' unexpired permits from the last reply.
    pub others: AtomicU64,
    /// Boot-clock ms before which the block is not grown again (after a call that got nothing).
    pub grow_after_ms: AtomicI64,
    /// Times the lease lapsed here (renewal failed past the safety margin).
    pub lapses: AtomicU64,
    /// Permits handed out, ever.
    pub granted: AtomicU64,
    /// Permits of dead processes given back to the host, ever.
    pub reclaimed: AtomicU64,
    /// Boot-clock ms of the last scan for dead holders.
    pub scanned_ms: AtomicI64,
    /// Demand seen by the last LEASE round (`denied` then), to size the next one.
    pub denied_seen: AtomicU64,
    /// Boot-clock ms since when LEASE calls fail (0 = they do not).
    pub failing_since_ms: AtomicI64,
    /// Boot-clock ms before which no LEASE call is retried (after a failed one).
    pub next_try_ms: AtomicI64,
    /// What the other hosts asked for and did not get, from the last reply.
    pub others_unmet: AtomicU64,
    /// `generation:32 | bound:32`: under a lease no permit is handed out while `bound` or more
    /// are in use here. `bound` is `min(holding, cap − others)` of the reply applied last
    /// (`cap − others` binds only after a threshold decrease, when the holdings exceed the
    /// new cap), lowered to `want` when a LEASE call begins; every write bumps `generation`,
    /// so a late reply, whose compare-and-swap expects the word it read, cannot overwrite a
    /// newer call's bound (see `concurrency::finish_call`).
    pub bound: AtomicU64,
    /// Per-process shares of `in_use`.
    pub holders: [AtomicU64; HOLDERS],
}

/// Everything the host knows about one task.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Slot {
    /// In use, by which task, generation.
    pub ident: Ident,
    /// Last known meta.
    pub meta: MetaCells,
    /// State, locks, demand.
    pub ctl: Control,
    /// Local quota by slice parity.
    pub quota: [QuotaEntry; 2],
    /// Counters by slice, `(start / slice_ms) % RING`.
    pub ring: [CounterEntry; RING],
    /// The local limiter.
    pub limiter: LimiterCells,
    /// The local limiter's log words (the sliding log's ring of `(end:28 | count:36)` buckets).
    pub log: [AtomicU64; LOG_CAP],
    /// Mode `concurrency`.
    pub conc: ConcCells,
}

const HEADER_SIZE: usize = std::mem::size_of::<Header>();
const PARTICIPANTS_SIZE: usize = std::mem::size_of::<Participant>() * PARTICIPANTS;
const SLOTS_OFFSET: usize = HEADER_SIZE + PARTICIPANTS_SIZE;
const SLOT_SIZE: usize = std::mem::size_of::<Slot>();
const _: () = assert!(HEADER_SIZE == 128);
const _: () = assert!(SLOTS_OFFSET.is_multiple_of(64));
const _: () = assert!(SLOT_SIZE.is_multiple_of(64));

/// Size in bytes of a segment with `slots` slots.
pub fn segment_size(slots: u32) -> u64 {
    (SLOTS_OFFSET + SLOT_SIZE * slots as usize) as u64
}

fn checksum(words: [u64; 6]) -> u64 {
    // FNV-1a over the words.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
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

/// The quota-word tag of the slice starting at `start_ms`: its low 32 bits.
#[inline]
pub fn tag_of(start_ms: i64) -> u32 {
    start_ms as u32
}

/// The full start (Unix ms) nearest to `reference_ms` whose tag is `tag` (exact within ±24
/// days of the reference).
///
/// ```
/// use sluice::shm::{tag_of, untag};
/// let s = 1_700_000_123_000i64;
/// assert_eq!(untag(tag_of(s), s + 5_000), s);
/// assert_eq!(untag(tag_of(s), s - 5_000), s);
/// ```
pub fn untag(tag: u32, reference_ms: i64) -> i64 {
    reference_ms + tag.wrapping_sub(reference_ms as u32) as i32 as i64
}

/// Which of the two quota entries holds the slice starting at `start_ms` on a grid of
/// `slice_ms`.
#[inline]
pub fn parity(start_ms: i64, slice_ms: u64) -> usize {
    ((start_ms.max(0) as u64 / slice_ms.max(1)) & 1) as usize
}

const GEN_SHIFT: u32 = 44;

/// The slot generation carried by a meta fast word (known or not).
#[inline]
pub fn word_generation(w: u64) -> u16 {
    (w >> GEN_SHIFT) as u16
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
    /// The slot generation the meta was written for.
    pub generation: u16,
    /// Keyed task (bit 60).
    pub keyed: bool,
    /// Shadow mode (bit 61): rejections are counted, then admitted.
    pub shadow: bool,
    /// Paced slices (bit 62): the local quota is spent no faster than the slice's pace.
    pub paced: bool,
}

const KEYED_BIT: u64 = 1 << 60;
const SHADOW_BIT: u64 = 1 << 61;
const PACED_BIT: u64 = 1 << 62;

const MODES: [Mode; 5] = [
    Mode::Pooled,
    Mode::Local,
    Mode::ExactFixed,
    Mode::ExactSliding,
    Mode::Concurrency,
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
    ///
    /// ```
    /// use sluice_protocol::{FallbackAlgorithm, Mode, OnFailure};
    /// use sluice::shm::{FastMeta, word_generation};
    /// let m = FastMeta { slice_ms: 1_000, mode: Mode::ExactFixed, on_failure: OnFailure::Deny,
    ///                    algorithm: FallbackAlgorithm::SlidingLog, generation: 513,
    ///                    keyed: true, shadow: true, paced: false };
    /// assert_eq!(FastMeta::decode(m.encode()), Some(m));
    /// assert_eq!(word_generation(m.encode()), 513);
    /// ```
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
        (1 << 63)
            | if self.keyed { KEYED_BIT } else { 0 }
            | if self.paced { PACED_BIT } else { 0 }
            | if self.shadow { SHADOW_BIT } else { 0 }
            | ((self.generation as u64) << GEN_SHIFT)
            | (mode << 40)
            | (onf << 36)
            | (alg << 32)
            | (self.slice_ms & 0xFFFF_FFFF)
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
            generation: word_generation(w),
            keyed: w & KEYED_BIT != 0,
            shadow: w & SHADOW_BIT != 0,
            paced: w & PACED_BIT != 0,
        })
    }
}

/// The meta fast word of an unknown meta in a slot of generation `generation`.
fn unknown_word(generation: u16) -> u64 {
    (generation as u64) << GEN_SHIFT
}

impl Slot {
    /// The slot's generation.
    #[inline]
    pub fn generation(&self) -> u16 {
        self.ident.generation.load(Ordering::Acquire) as u16
    }

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

    /// The slot's generation if it is in use by task `name` (a read racing with a reclaim
    /// answers `None`).
    fn holds(&self, name: &str) -> Option<u16> {
        let gen_before = self.generation();
        if self.ident.state.load(Ordering::Acquire) != READY
            || self.ident.name_len.load(Ordering::Relaxed) != name.len() as u64
        {
            return None;
        }
        let mut buf = [0u8; MAX_TASK_NAME_LEN];
        buf[..name.len()].copy_from_slice(name.as_bytes());
        let same = self.ident.name.iter().enumerate().all(|(i, w)| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&buf[i * 8..i * 8 + 8]);
            w.load(Ordering::Relaxed) == u64::from_le_bytes(word)
        });
        let stable =
            self.ident.state.load(Ordering::Acquire) == READY && self.generation() == gen_before;
        (same && stable).then_some(gen_before)
    }

    /// Records that a process holds a live handle for the slot now.
    pub fn touch(&self, now_ms: i64) {
        self.ident.used_ms.store(now_ms, Ordering::Relaxed);
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
            lease_ms: self.conc.lease_ms.load(Ordering::Relaxed),
            keyed: fast.keyed,
            key_overrides: Default::default(),
            shadow: fast.shadow,
            pacing: if fast.paced {
                Pacing::Smooth
            } else {
                Pacing::None
            },
            pace_burst: self.ctl.pace_burst.load(Ordering::Relaxed),
        })
    }

    /// Stores `meta` as the last known meta of the slot's task of generation `generation`: the
    /// slow fields first, then the fast word by compare-and-swap. Writes nothing (and returns
    /// false) when the slot has been reclaimed since (its generation changed).
    pub fn store_meta(&self, meta: &TaskMeta, generation: u16) -> bool {
        if self.generation() != generation {
            return false;
        }
        let m = &self.meta;
        m.threshold.store(meta.threshold, Ordering::Relaxed);
        m.pull.store(meta.pull, Ordering::Relaxed);
        m.local_limit.store(meta.local_limit, Ordering::Relaxed);
        m.burst.store(meta.fallback.burst, Ordering::Relaxed);
        m.version.store(meta.version, Ordering::Relaxed);
        self.ctl
            .pace_burst
            .store(meta.pace_burst, Ordering::Relaxed);
        if meta.lease_ms > 0 {
            self.conc.lease_ms.store(meta.lease_ms, Ordering::Relaxed);
        }
        let next = FastMeta {
            slice_ms: meta.slice_ms,
            mode: meta.mode,
            on_failure: meta.on_failure,
            algorithm: meta.fallback.algorithm,
            generation,
            keyed: meta.keyed,
            shadow: meta.shadow,
            paced: meta.pacing == Pacing::Smooth && meta.mode == Mode::Pooled,
        }
        .encode();
        let mut cur = m.fast.load(Ordering::Acquire);
        loop {
            if word_generation(cur) != generation {
                return false;
            }
            match m
                .fast
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(x) => cur = x,
            }
        }
    }

    /// Forgets the meta (the task was deleted), unless the slot was reclaimed meanwhile.
    pub fn clear_meta(&self, generation: u16) {
        let cur = self.meta.fast.load(Ordering::Acquire);
        if word_generation(cur) == generation {
            let _ = self.meta.fast.compare_exchange(
                cur,
                unknown_word(generation),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// The quota entry of the slice starting at `start_ms` on a grid of `slice_ms`.
    #[inline]
    pub fn entry(&self, start_ms: i64, slice_ms: u64) -> &QuotaEntry {
        &self.quota[parity(start_ms, slice_ms)]
    }

    /// Adds `granted` permits of the slice starting at `start_ms` (grid `slice_ms`) to the
    /// local quota (call under the pull lock). `now_us` must be read after the pull returned.
    ///
    /// * The entry already holds that slice: the grant is added.
    /// * The slice has already ended at `now_us`: the grant is dropped (nobody can spend it).
    /// * The entry holds another slice: it is replaced. That slice is closed first: its
    ///   admitted count (`granted − accounted − count left`) goes to the counter ring. On one
    ///   grid the other slice of the same parity has always ended by then; after a change of
    ///   the slice length it may be a slice of the old grid, which no decision spends any more.
    ///
    /// `exhausted` marks that Redis has nothing left for the slice. Returns false when the
    /// grant was dropped.
    pub fn deposit(
        &self,
        start_ms: i64,
        slice_ms: u64,
        granted: u64,
        exhausted: bool,
        now_us: i64,
    ) -> bool {
        if start_ms.saturating_add(slice_ms as i64) <= now_us.div_euclid(1_000) {
            return false;
        }
        let tag = tag_of(start_ms);
        let e = self.entry(start_ms, slice_ms);
        let add = granted.min(MAX_COUNT as u64) as u32;
        let mut cur = e.word.load(Ordering::Acquire);
        loop {
            let (t, ex, c) = unpack_quota(cur);
            let next = if t == tag && cur != 0 {
                pack_quota(tag, ex || exhausted, c.saturating_add(add))
            } else {
                pack_quota(tag, exhausted, add)
            };
            match e
                .word
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if t == tag && cur != 0 {
                        e.granted.fetch_add(add as u64, Ordering::Relaxed);
                    } else {
                        if cur != 0 {
                            self.close_entry(e, untag(t, start_ms), c);
                        }
                        e.granted.store(add as u64, Ordering::Relaxed);
                        e.accounted.store(0, Ordering::Relaxed);
                        e.first_grant_us.store(now_us, Ordering::Relaxed);
                        e.slice_ms.store(slice_ms, Ordering::Relaxed);
                    }
                    return true;
                }
                Err(x) => cur = x,
            }
        }
    }

    /// Moves the admitted count of an entry that held the slice starting at `old_start` (with
    /// `left` permits unspent) into the counter ring.
    fn close_entry(&self, e: &QuotaEntry, old_start: i64, left: u32) {
        let granted = e.granted.load(Ordering::Relaxed);
        let accounted = e.accounted.load(Ordering::Relaxed);
        if granted == 0 {
            return;
        }
        let admitted = granted
            .saturating_sub(accounted)
            .saturating_sub(left as u64);
        let old_len = e.slice_ms.load(Ordering::Relaxed);
        self.count(old_start, old_len, field::ADMITTED, admitted);
        let rej = self.ring_value(old_start, old_len, field::REJECTED);
        self.ctl
            .demand_prev
            .store(granted.saturating_sub(left as u64) + rej, Ordering::Relaxed);
    }

    /// Moves what was admitted so far from every quota entry into the counter ring (call
    /// under the pull lock). `now_ms` locates the entries' slices (within ±24 days).
    pub fn account(&self, now_ms: i64) {
        for e in &self.quota {
            let w = e.word.load(Ordering::Acquire);
            if w == 0 {
                continue;
            }
            let (t, _, c) = unpack_quota(w);
            let granted = e.granted.load(Ordering::Relaxed);
            let accounted = e.accounted.load(Ordering::Relaxed);
            let delta = granted.saturating_sub(accounted).saturating_sub(c as u64);
            if delta > 0 {
                e.accounted.fetch_add(delta, Ordering::Relaxed);
                let len = e.slice_ms.load(Ordering::Relaxed);
                self.count(untag(t, now_ms), len, field::ADMITTED, delta);
            }
        }
    }

    /// Admitted so far (this host) in the slice starting at `start_ms`, from the quota
    /// accounting.
    pub fn consumed(&self, start_ms: i64, slice_ms: u64) -> u64 {
        let e = self.entry(start_ms, slice_ms);
        let w = e.word.load(Ordering::Acquire);
        let (t, _, c) = unpack_quota(w);
        if w == 0 || t != tag_of(start_ms) {
            return 0;
        }
        e.granted.load(Ordering::Relaxed).saturating_sub(c as u64)
    }

    /// Adds `v` to counter `field` (index into [`slice_field::COUNTERS`]) of the slice starting
    /// at `start_ms` on a grid of `slice_ms`.
    ///
    /// The entry is taken over when it holds an older slice, or another slice whose counts
    /// were all flushed (zero): its tag is set to a busy marker, its values are zeroed, then the
    /// new tag is published, so no concurrent add for the new slice can be wiped. An older
    /// slice's unflushed counts are dropped: the flusher runs far more often than the ring
    /// wraps, so this only happens while Redis is unreachable for longer than [`RING`] slices.
    /// A count for a slice older than the entry's unflushed one is dropped.
    #[inline]
    pub fn count(&self, start_ms: i64, slice_ms: u64, field: usize, v: u64) {
        let index = start_ms.max(1) as u64 / slice_ms.max(1);
        self.count_at(index, start_ms, field, v);
    }

    /// [`Slot::count`] for a caller that knows the slice's index (`start_ms / slice_ms` on the
    /// slice's grid): the decision path, which saves the division.
    #[inline]
    pub fn count_at(&self, index: u64, start_ms: i64, field: usize, v: u64) {
        if v == 0 {
            return;
        }
        let start = start_ms.max(1) as u64;
        let e = &self.ring[(index % RING as u64) as usize];
        let mut spins = 0u32;
        loop {
            let t = e.tag.load(Ordering::Acquire);
            if t == start {
                break;
            }
            if t == RING_BUSY {
                spins += 1;
                // A process died between marking and publishing: take the entry over.
                if spins > 100_000
                    && e.tag
                        .compare_exchange(RING_BUSY, start, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    break;
                }
                std::hint::spin_loop();
                continue;
            }
            let unused = t == EMPTY_TAG || t == 0;
            let drained = || e.values.iter().all(|x| x.load(Ordering::Relaxed) == 0);
            if !unused && t > start && !drained() {
                return;
            }
            if e.tag
                .compare_exchange(t, RING_BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                for x in &e.values {
                    x.store(0, Ordering::Relaxed);
                }
                e.tag.store(start, Ordering::Release);
                break;
            }
        }
        if let Some(x) = e.values.get(field) {
            x.fetch_add(v, Ordering::Relaxed);
        }
    }

    fn ring_value(&self, start_ms: i64, slice_ms: u64, field: usize) -> u64 {
        let start = start_ms.max(1) as u64;
        let e = &self.ring[((start / slice_ms.max(1)) % RING as u64) as usize];
        if e.tag.load(Ordering::Acquire) != start {
            return 0;
        }
        e.values[field].load(Ordering::Relaxed)
    }

    /// Takes (and zeroes) every non-zero counter entry: `(slice start in Unix ms, counters)`.
    pub fn drain_counters(&self) -> Vec<(i64, [u64; 7])> {
        let mut out = Vec::new();
        for e in &self.ring {
            let start = e.tag.load(Ordering::Acquire);
            if start == EMPTY_TAG || start == 0 || start == RING_BUSY {
                continue;
            }
            let mut vals = [0u64; 7];
            for (v, x) in vals.iter_mut().zip(&e.values) {
                *v = x.swap(0, Ordering::AcqRel);
            }
            if vals.iter().any(|v| *v != 0) {
                out.push((start as i64, vals));
            }
        }
        out
    }

    /// Resets everything but the identity, for a new owner of generation `generation`.
    fn reset(&self, generation: u16) {
        self.meta
            .fast
            .store(unknown_word(generation), Ordering::Release);
        for w in [
            &self.meta.version,
            &self.meta.refreshed_ms,
            &self.meta.missing_since_ms,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for w in [
            &self.meta.threshold,
            &self.meta.pull,
            &self.meta.local_limit,
            &self.meta.burst,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        let c = &self.ctl;
        for w in [
            &c.state,
            &c.pull_lock,
            &c.want,
            &c.demand_prev,
            &c.rtt_us,
            &c.max_n,
            &c.cap,
            &c.flush_lock,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for w in [
            &c.next_probe_ms,
            &c.flushed_ms,
            &c.remaining,
            &c.early_start,
            &c.early_until_ms,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for e in &self.quota {
            e.word.store(0, Ordering::Relaxed);
            e.granted.store(0, Ordering::Relaxed);
            e.accounted.store(0, Ordering::Relaxed);
            e.low_water.store(0, Ordering::Relaxed);
            e.first_grant_us.store(0, Ordering::Relaxed);
            e.slice_ms.store(0, Ordering::Relaxed);
        }
        for e in &self.ring {
            e.tag.store(EMPTY_TAG, Ordering::Relaxed);
            for v in &e.values {
                v.store(0, Ordering::Relaxed);
            }
        }
        self.limiter.lock.store(0, Ordering::Relaxed);
        for c in &self.limiter.cells {
            c.store(0, Ordering::Relaxed);
        }
        for l in &self.log {
            l.store(0, Ordering::Relaxed);
        }
        let k = &self.conc;
        for w in [
            &k.permits,
            &k.regime,
            &k.lease_lock,
            &k.seq,
            &k.waiting,
            &k.denied,
            &k.lease_ms,
            &k.cap,
            &k.others,
            &k.lapses,
            &k.granted,
            &k.reclaimed,
            &k.denied_seen,
            &k.others_unmet,
            &k.bound,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for w in [
            &k.valid_until_ms,
            &k.sent_ok_ms,
            &k.grow_after_ms,
            &k.scanned_ms,
            &k.failing_since_ms,
            &k.next_try_ms,
        ] {
            w.store(0, Ordering::Relaxed);
        }
        for h in &k.holders {
            h.store(0, Ordering::Relaxed);
        }
    }

    fn write_name(&self, name: &str) {
        let mut buf = [0u8; MAX_TASK_NAME_LEN];
        let n = name.len().min(MAX_TASK_NAME_LEN);
        buf[..n].copy_from_slice(&name.as_bytes()[..n]);
        for (k, w) in self.ident.name.iter().enumerate() {
            let mut word = [0u8; 8];
            word.copy_from_slice(&buf[k * 8..k * 8 + 8]);
            w.store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        self.ident.name_len.store(n as u64, Ordering::Relaxed);
    }
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
    /// Shadow mode: rejections that were admitted (`wrej`).
    pub const WOULD_REJECT: usize = 6;
    const _: () = assert!(super::slice_field::COUNTERS.len() == 6);
    const _: () = assert!(super::slice_field::WIRE_COUNTERS.len() == 7);
}

/// A participant of a segment and its generation: who holds a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holder {
    /// Participant slot.
    pub participant: u16,
    /// Its generation when it took the lock.
    pub generation: u16,
}

impl Holder {
    fn token(self, now_ms: i64) -> u64 {
        ((self.participant as u64) << 48)
            | ((self.generation as u64) << 32)
            | (now_ms as u64 & 0xFFFF_FFFF)
    }

    fn of(word: u64) -> Self {
        Self {
            participant: (word >> 48) as u16,
            generation: (word >> 32) as u16,
        }
    }
}

/// A lock in shared memory: one word holding `participant:16 | generation:16 |
/// acquired_ms:32` (0 = free; a generation is never 0, so a held lock is never 0).
///
/// Taken with compare-and-swap. A waiter takes the lock over when the holder is dead (its
/// participant's byte lock is gone, or the participant slot was claimed again since: see the
/// module docs) or the lock is older than the caller's timeout, so a crashed holder costs one
/// check, in any PID namespace.
#[derive(Debug, Clone, Copy)]
pub struct ShmLock<'a> {
    word: &'a AtomicU64,
    seg: &'a Segment,
}

/// The outcome of [`ShmLock::try_lock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockAttempt {
    /// The caller holds the lock; unlock with this token.
    Acquired {
        /// Pass to [`ShmLock::unlock`].
        token: u64,
        /// A dead or timed-out holder that was replaced, if any.
        took_over_from: Option<Holder>,
    },
    /// A live holder has it.
    Busy {
        /// The holder.
        holder: Holder,
        /// How long it has held it.
        age_ms: u64,
    },
}

impl ShmLock<'_> {
    /// Tries once to take the lock at `now_ms` (host clock).
    pub fn try_lock(&self, now_ms: i64, timeout_ms: u64) -> LockAttempt {
        let token = self.seg.me.token(now_ms);
        let cur = self.word.load(Ordering::Acquire);
        if cur == 0 {
            return match self
                .word
                .compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => LockAttempt::Acquired {
                    token,
                    took_over_from: None,
                },
                Err(x) => busy(x, now_ms),
            };
        }
        let holder = Holder::of(cur);
        let age = (now_ms as u32).wrapping_sub(cur as u32) as u64;
        let age = if age > u32::MAX as u64 / 2 { 0 } else { age };
        if age > timeout_ms || !self.seg.alive(holder) {
            if self
                .word
                .compare_exchange(cur, token, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return LockAttempt::Acquired {
                    token,
                    took_over_from: Some(holder),
                };
            }
            return busy(self.word.load(Ordering::Acquire), now_ms);
        }
        LockAttempt::Busy {
            holder,
            age_ms: age,
        }
    }

    /// Takes the lock if it is free (one compare-and-swap, no liveness check): the fast path
    /// of a spinning waiter.
    #[inline]
    pub fn try_fast(&self, now_ms: i64) -> Option<u64> {
        let token = self.seg.me.token(now_ms);
        self.word
            .compare_exchange(0, token, Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            .map(|_| token)
    }

    /// Releases the lock if `token` still holds it (a holder that was taken over does not
    /// release its successor's lock). Returns whether it did.
    pub fn unlock(&self, token: u64) -> bool {
        self.word
            .compare_exchange(token, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether the lock is still held under `token` (not released, not taken over).
    pub fn holds(&self, token: u64) -> bool {
        self.word.load(Ordering::Acquire) == token
    }

    /// The current holder, if held.
    pub fn holder(&self) -> Option<Holder> {
        let w = self.word.load(Ordering::Acquire);
        (w != 0).then(|| Holder::of(w))
    }
}

fn busy(w: u64, now_ms: i64) -> LockAttempt {
    if w == 0 {
        // Released between our two loads: report it as briefly busy; the caller retries.
        return LockAttempt::Busy {
            holder: Holder {
                participant: 0,
                generation: 0,
            },
            age_ms: 0,
        };
    }
    LockAttempt::Busy {
        holder: Holder::of(w),
        age_ms: (now_ms as u32).wrapping_sub(w as u32) as u64,
    }
}

/// A random segment id, never 0.
fn random_id() -> u64 {
    crate::clock::random_u64().max(1)
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

/// A slot of a task, as resolved at one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef {
    /// Slot index.
    pub index: usize,
    /// Its generation when resolved.
    pub generation: u16,
}

/// Settings of [`Segment::claim`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimOptions {
    /// Host time (Unix ms).
    pub now_ms: i64,
    /// Bound on waiting for the alloc lock (twice this) and its lock timeout.
    pub lock_timeout_ms: u64,
    /// A slot no process has used for this long may be reclaimed for another task.
    pub reclaim_idle_ms: u64,
}

/// A mapped segment, and this process's participant slot in it.
#[derive(Debug)]
pub struct Segment {
    map: MmapMut,
    path: PathBuf,
    slots: usize,
    /// The open file: its OFD lock on byte `me.participant` is the participant claim.
    file: File,
    me: Holder,
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
    /// An incompatible, corrupt or too small one was replaced; the reason.
    Replaced(String),
}

/// A file-name component for `s` that is **injective** (two different strings never give the
/// same component): `[A-Za-z0-9_.-]` stay as they are, every other byte of the UTF-8 becomes
/// `%XX` (uppercase hex; `%` itself is never kept, so an escape cannot be forged). A
/// component that would be longer than 120 bytes is its first 80 bytes, `~` and the
/// 32-hex-digit [`crate::protocol::key_digest`] of the whole string (`~` never appears
/// otherwise), so a path stays within the 255 bytes a file name may have.
///
/// ```
/// use sluice::shm::escape_name;
/// assert_eq!(escape_name("web-1.eu_west"), "web-1.eu_west"); // unchanged, as before
/// assert_eq!(escape_name("web/1"), "web%2F1");
/// assert_eq!(escape_name("web:1"), "web%3A1");
/// assert_ne!(escape_name("web%2F1"), escape_name("web/1"));
/// assert!(escape_name(&"ü".repeat(200)).len() <= 120);
/// ```
pub fn escape_name(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.len() > 120 {
        let mut cut = 80;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('~');
        out.push_str(&crate::protocol::key_digest(s));
    }
    out
}

fn ofd_lock(file: &File, byte: u64, cmd: libc::c_int) -> std::io::Result<libc::flock> {
    // SAFETY: a zeroed flock is a valid value; the fields we need are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl.l_pid = 0;
    loop {
        // SAFETY: fcntl with an OFD lock command on an open descriptor and a valid flock.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
        if rc == 0 {
            return Ok(fl);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl Segment {
    /// `dir/sluice.<namespace>.<host id>`, both escaped with [`escape_name`] so that two
    /// different host ids never share a segment (before issue 23 every other character became
    /// `_`: `web/1` and `web:1` shared one, and so did ids equal in their first 128 bytes).
    /// Ids of `[A-Za-z0-9_.-]` only (hostnames) keep the name they always had.
    ///
    /// ```
    /// let p = sluice::shm::Segment::path_for("/dev/shm".as_ref(), "sluice", "web-1");
    /// assert_eq!(p.to_str(), Some("/dev/shm/sluice.sluice.web-1"));
    /// let p = sluice::shm::Segment::path_for("/dev/shm".as_ref(), "sluice", "web/1");
    /// assert_eq!(p.to_str(), Some("/dev/shm/sluice.sluice.web%2F1"));
    /// ```
    pub fn path_for(dir: &Path, namespace: &str, host_id: &str) -> PathBuf {
        dir.join(format!(
            "sluice.{}.{}",
            escape_name(namespace),
            escape_name(host_id)
        ))
    }

    /// Opens (creating or replacing as needed) the segment at `path` with at least `slots`
    /// slots, and claims a participant slot in it. An existing valid file with at least
    /// `slots` slots keeps its own slot count; one with fewer is replaced by a larger one.
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
        remove_stale_tmp(path);
        let mut opened = Opened::Existing;
        if path.exists() {
            match Self::map_existing(path) {
                Ok(seg) if seg.slots >= slots as usize => return Ok((seg, opened)),
                Ok(seg) => {
                    let reason = format!("grown from {} to {slots} slots", seg.slots);
                    tracing::warn!(path = %path.display(), %reason,
                        "shared memory segment has fewer slots than configured; replacing it");
                    opened = Opened::Replaced(reason);
                }
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
        if len < SLOTS_OFFSET as u64 {
            return Err(format!("file is {len} bytes, shorter than the header"));
        }
        // SAFETY: the file is a regular file we keep open; every access goes through atomics,
        // so concurrent writers (other processes) cannot cause undefined behaviour.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| format!("mmap: {e}"))?;
        // SAFETY: at least SLOTS_OFFSET bytes, page aligned, atomics only.
        let h = unsafe { &*(map.as_ptr() as *const Header) };
        let magic = h.magic.load(Ordering::Acquire);
        let version = h.version.load(Ordering::Acquire);
        let slots = h.slots.load(Ordering::Acquire);
        let size = h.size.load(Ordering::Acquire);
        let slot_size = h.slot_size.load(Ordering::Acquire);
        let participants = h.participants.load(Ordering::Acquire);
        let sum = h.checksum.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(format!("bad magic {magic:#x}"));
        }
        if version != LAYOUT_VERSION {
            return Err(format!(
                "layout version {version}, this SDK uses {LAYOUT_VERSION}"
            ));
        }
        if sum != checksum([magic, version, slots, size, slot_size, participants]) {
            return Err("header checksum mismatch".into());
        }
        if slot_size != SLOT_SIZE as u64 || participants != PARTICIPANTS as u64 {
            return Err(format!(
                "slot size {slot_size} / {participants} participants, this SDK uses \
                 {SLOT_SIZE} / {PARTICIPANTS}"
            ));
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
        let mut seg = Segment {
            map,
            path: path.to_path_buf(),
            slots: slots as usize,
            file,
            me: Holder {
                participant: 0,
                generation: 0,
            },
        };
        seg.me = seg.claim_participant()?;
        // Under the open lock: a file of this layout made by a build without segment ids.
        let _ = seg.header().segment_id.compare_exchange(
            0,
            random_id(),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        Ok(seg)
    }

    /// This file's own id (see [`Header::segment_id`]).
    pub fn id(&self) -> u64 {
        self.header().segment_id.load(Ordering::Acquire)
    }

    /// Takes an OFD lock on the first free participant byte and bumps its generation.
    fn claim_participant(&self) -> Result<Holder, String> {
        for p in 0..PARTICIPANTS {
            match ofd_lock(&self.file, p as u64, libc::F_OFD_SETLK) {
                Ok(_) => {
                    let part = self.participant(p);
                    let generation = part
                        .generation
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| {
                            let next = (g as u16).wrapping_add(1);
                            Some(if next == 0 { 1 } else { next } as u64)
                        })
                        .map(|g| {
                            let next = (g as u16).wrapping_add(1);
                            if next == 0 { 1 } else { next }
                        })
                        .unwrap_or(1);
                    part.pid.store(std::process::id() as u64, Ordering::Relaxed);
                    return Ok(Holder {
                        participant: p as u16,
                        generation,
                    });
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                    continue;
                }
                Err(e) => return Err(format!("participant lock: {e}")),
            }
        }
        Err(format!(
            "all {PARTICIPANTS} participant slots are taken by live processes"
        ))
    }

    fn participant(&self, p: usize) -> &Participant {
        let p = p.min(PARTICIPANTS - 1);
        // SAFETY: the table lies between the header and the slots (size checked on open),
        // 8-byte aligned, atomics only.
        unsafe {
            &*(self
                .map
                .as_ptr()
                .add(HEADER_SIZE + p * std::mem::size_of::<Participant>())
                as *const Participant)
        }
    }

    /// This process's (this open's) participant identity.
    pub fn me(&self) -> Holder {
        self.me
    }

    /// The pid a participant recorded when it claimed its slot (as seen in its own PID
    /// namespace: for logs only).
    pub fn participant_pid(&self, participant: u16) -> u32 {
        self.participant(participant as usize)
            .pid
            .load(Ordering::Relaxed) as u32
    }

    /// Is `h` a live participant: its byte is locked by some open file description and its
    /// generation still matches? An error of `F_OFD_GETLK` counts as alive (the lock timeout
    /// is the backstop).
    pub fn alive(&self, h: Holder) -> bool {
        if h.generation == 0 || h.participant as usize >= PARTICIPANTS {
            return false;
        }
        if h.participant == self.me.participant {
            // Our own byte: it is us iff the generation is ours (an earlier owner of this
            // participant slot had to be gone for us to lock the byte).
            return h.generation == self.me.generation;
        }
        let current = self
            .participant(h.participant as usize)
            .generation
            .load(Ordering::Acquire) as u16;
        if current != h.generation {
            return false;
        }
        match ofd_lock(&self.file, h.participant as u64, libc::F_OFD_GETLK) {
            Ok(fl) => fl.l_type != libc::F_UNLCK as libc::c_short,
            Err(_) => true,
        }
    }

    /// A lock stored in `word` (a word of this segment).
    pub fn lock<'a>(&'a self, word: &'a AtomicU64) -> ShmLock<'a> {
        ShmLock { word, seg: self }
    }

    /// The pull lock of slot `i`.
    pub fn pull_lock(&self, i: usize) -> Option<ShmLock<'_>> {
        Some(self.lock(&self.slot(i)?.ctl.pull_lock))
    }

    fn create_fresh(path: &Path, slots: u32) -> std::io::Result<()> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = sibling(path, &format!("{TMP_MARK}{}.{nanos}", std::process::id()));
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
            // SAFETY: the file is `size` bytes, page aligned; atomics only.
            let h = unsafe { &*(map.as_ptr() as *const Header) };
            h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
            h.slots.store(slots as u64, Ordering::Relaxed);
            h.size.store(size, Ordering::Relaxed);
            h.slot_size.store(SLOT_SIZE as u64, Ordering::Relaxed);
            h.participants.store(PARTICIPANTS as u64, Ordering::Relaxed);
            h.segment_id.store(random_id(), Ordering::Relaxed);
            h.checksum.store(
                checksum([
                    MAGIC,
                    LAYOUT_VERSION,
                    slots as u64,
                    size,
                    SLOT_SIZE as u64,
                    PARTICIPANTS as u64,
                ]),
                Ordering::Relaxed,
            );
            for i in 0..slots as usize {
                // SAFETY: in bounds of the file just sized; 64-byte aligned; atomics only.
                let s =
                    unsafe { &*(map.as_ptr().add(SLOTS_OFFSET + i * SLOT_SIZE) as *const Slot) };
                for e in &s.ring {
                    e.tag.store(EMPTY_TAG, Ordering::Relaxed);
                }
            }
            h.magic.store(MAGIC, Ordering::Release);
            map.flush()?;
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
        // SAFETY: the map is at least SLOTS_OFFSET bytes (checked on open), page aligned, and
        // Header consists of atomics only.
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    /// Slot `i`.
    #[inline]
    pub fn slot(&self, i: usize) -> Option<&Slot> {
        if i >= self.slots {
            return None;
        }
        // SAFETY: in bounds (size checked on open), 64-byte aligned (SLOTS_OFFSET and Slot are
        // multiples of 64), atomics only.
        Some(unsafe { &*(self.map.as_ptr().add(SLOTS_OFFSET + i * SLOT_SIZE) as *const Slot) })
    }

    /// The slot of task `name` and its generation, if one exists.
    pub fn resolve(&self, name: &str) -> Option<SlotRef> {
        (0..self.slots).find_map(|i| {
            let generation = self.slot(i)?.holds(name)?;
            Some(SlotRef {
                index: i,
                generation,
            })
        })
    }

    /// The slot of task `name`, if one exists.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.resolve(name).map(|r| r.index)
    }

    /// The slot of task `name`, claiming a free one if needed (without reclaiming); `None`
    /// when the segment is full.
    pub fn find_or_claim(&self, name: &str, lock_timeout_ms: u64) -> Option<usize> {
        self.claim(
            name,
            ClaimOptions {
                now_ms: crate::clock::host_ms(),
                lock_timeout_ms,
                reclaim_idle_ms: u64::MAX,
            },
        )
        .map(|r| r.index)
    }

    /// The slot of task `name`, claiming one if needed: a free one, else the one idle longest
    /// if it has been idle at least `opts.reclaim_idle_ms` (its generation is bumped, so stale
    /// handles notice). `None` when the segment is full (or the alloc lock stays busy).
    pub fn claim(&self, name: &str, opts: ClaimOptions) -> Option<SlotRef> {
        if let Some(r) = self.resolve(name) {
            if let Some(s) = self.slot(r.index) {
                s.touch(opts.now_ms);
            }
            return Some(r);
        }
        let lock = self.lock(&self.header().alloc_lock);
        let deadline = std::time::Instant::now()
            + std::time::Duration::from_millis(opts.lock_timeout_ms.saturating_mul(2));
        let token = loop {
            match lock.try_lock(crate::clock::host_ms(), opts.lock_timeout_ms) {
                LockAttempt::Acquired { token, .. } => break token,
                LockAttempt::Busy { .. } if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_micros(200))
                }
                LockAttempt::Busy { .. } => return None,
            }
        };
        let result = self.resolve(name).or_else(|| {
            let free = (0..self.slots).find(|i| {
                self.slot(*i)
                    .is_some_and(|s| s.ident.state.load(Ordering::Acquire) != READY)
            });
            let i = match free {
                Some(i) => i,
                None => {
                    let (i, used) = (0..self.slots)
                        .filter_map(|i| {
                            Some((i, self.slot(i)?.ident.used_ms.load(Ordering::Relaxed)))
                        })
                        .min_by_key(|(_, used)| *used)?;
                    let idle = opts.now_ms.saturating_sub(used).max(0) as u64;
                    if idle < opts.reclaim_idle_ms {
                        return None;
                    }
                    let s = self.slot(i)?;
                    tracing::info!(slot = i, old = ?s.name(), new = name, idle_ms = idle,
                        "reclaiming an idle segment slot");
                    i
                }
            };
            let s = self.slot(i)?;
            // Invalidate first: stale handles see another generation from here on.
            s.ident.state.store(0, Ordering::Release);
            let generation = (s.ident.generation.load(Ordering::Acquire) as u16).wrapping_add(1);
            s.ident
                .generation
                .store(generation as u64, Ordering::Release);
            s.reset(generation);
            s.write_name(name);
            s.touch(opts.now_ms);
            s.ident.state.store(READY, Ordering::Release);
            Some(SlotRef {
                index: i,
                generation,
            })
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
/// What the temporary file a segment or key table is built in adds to its name:
/// `<file name>~tmp.<pid>.<n>`, renamed into place once written. No segment, key table or lock
/// file name contains `~tmp.` ([`escape_name`] escapes `~` in host ids and namespaces, and the
/// `~` it adds to a long name is followed by hex digits), so the mark names only such files.
pub(crate) const TMP_MARK: &str = "~tmp.";

/// Removes the temporary files of `path` that a process killed while building one left behind
/// (issue 23: a host SIGKILLed in its first second left `sluice.<ns>.<host>.tmp.<pid>.<n>` in
/// `/dev/shm` for good). Call it with `path`'s lock held: nobody else builds one then, so every
/// such file is a leftover. Best effort: an error leaves the file (the next open tries again).
pub(crate) fn remove_stale_tmp(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let prefix = format!("{}{TMP_MARK}", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix)
            && std::fs::remove_file(e.path()).is_ok()
        {
            tracing::warn!(file = %e.path().display(),
                "removed a temporary file left by a process killed while creating it");
        }
    }
}

pub(crate) fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

pub(crate) struct Flock<'a>(&'a File);

impl<'a> Flock<'a> {
    pub(crate) fn lock(f: &'a File) -> std::io::Result<Self> {
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

    const S: u64 = 1_000;
    /// A slice start around 2025 (the tag is its low 32 bits).
    const T0: i64 = 1_750_000_000_000;

    fn word(s: &Slot, start: i64, len: u64) -> (u32, bool, u32) {
        unpack_quota(s.entry(start, len).word.load(Ordering::Relaxed))
    }

    /// Issue 23 (found by the soak, seed 1009): a process SIGKILLed inside `create_fresh`
    /// left its temporary file in the segment directory forever. The next open of the
    /// segment (its lock held) removes it — and nothing else.
    #[test]
    fn a_temporary_file_left_by_a_killed_creator_is_removed_at_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = Segment::path_for(dir.path(), "ns", "h");
        let left = sibling(&path, &format!("{TMP_MARK}999999.123456789"));
        let keys_left = sibling(&path, &format!(".keys{TMP_MARK}999999.1"));
        // Other hosts' files that only look alike: a host id "h.tmp.1.2" and "h~" (escaped).
        let other = Segment::path_for(dir.path(), "ns", "h.tmp.1.2");
        let tilde = Segment::path_for(dir.path(), "ns", "h~tmp.1");
        for f in [&left, &keys_left, &other, &tilde] {
            std::fs::write(f, b"x").unwrap();
        }
        let (_seg, opened) = Segment::open(&path, 2).unwrap();
        assert_eq!(opened, Opened::Created);
        assert!(
            !left.exists(),
            "the leftover of a killed creator is removed"
        );
        assert!(
            keys_left.exists(),
            "the key table's are its own open's business"
        );
        assert!(other.exists() && tilde.exists(), "other hosts' files stay");
        // And an existing segment's open removes one too.
        std::fs::write(&left, b"x").unwrap();
        let (_seg2, opened) = Segment::open(&path, 2).unwrap();
        assert_eq!(opened, Opened::Existing);
        assert!(!left.exists());
    }

    #[test]
    fn quota_word_never_crosses_slices() {
        let (_d, seg) = tmp_seg(2);
        let s = seg.slot(0).unwrap();
        let now = |ms: i64| ms * 1_000;
        assert!(s.deposit(T0, S, 5, false, now(T0)));
        assert_eq!(word(s, T0, S), (tag_of(T0), false, 5));
        // Same parity, two slices later: replaces (and closes) T0.
        let t2 = T0 + 2 * S as i64;
        assert!(s.deposit(t2, S, 3, true, now(t2)));
        assert_eq!(word(s, t2, S), (tag_of(t2), true, 3));
        // A late grant for T0 (ended) is dropped.
        assert!(!s.deposit(T0, S, 9, false, now(t2 + 10)));
        assert_eq!(word(s, t2, S), (tag_of(t2), true, 3));
        // T0 admitted nothing: granted 5, 5 left.
        assert_eq!(s.drain_counters(), vec![]);
    }

    /// Issue 9 item 1: after a change of the slice length, grants for the new grid land (they
    /// were dropped as "older" tags before), and a grant for an ended slice is dropped.
    #[test]
    fn a_new_slice_length_replaces_quota_of_the_old_grid() {
        let (_d, seg) = tmp_seg(1);
        let s = seg.slot(0).unwrap();
        // 1 s grid, slice 1_750_000_005_000 (odd index), 3 admitted of 10.
        let old = T0 + 5_000;
        assert!(s.deposit(old, 1_000, 10, false, (old + 100) * 1_000));
        s.entry(old, 1_000).word.fetch_sub(3, Ordering::Relaxed);
        // Now 2 s slices: the current slice starts at T0 + 4_000 (even index on that grid),
        // which on the old grid would have been an "older" tag.
        let new = T0 + 4_000;
        let now_us = (old + 500) * 1_000;
        assert!(s.deposit(new, 2_000, 40, false, now_us));
        assert_eq!(word(s, new, 2_000), (tag_of(new), false, 40));
        assert_eq!(s.consumed(new, 2_000), 0);
        // The next 2 s slice (prefetch) goes to the other entry.
        assert!(s.deposit(new + 2_000, 2_000, 7, false, now_us));
        assert_eq!(word(s, new + 2_000, 2_000), (tag_of(new + 2_000), false, 7));
        assert_eq!(word(s, new, 2_000), (tag_of(new), false, 40));
        // The old slice's 3 admitted went to its own key, whatever the grid is now.
        s.account(now_us / 1_000);
        let drained = s.drain_counters();
        assert!(
            drained.contains(&(old, [3, 0, 0, 0, 0, 0, 0])),
            "{drained:?}"
        );
    }

    #[test]
    fn accounting_counts_admitted_once() {
        let (_d, seg) = tmp_seg(1);
        let s = seg.slot(0).unwrap();
        let t4 = T0 + 4_000;
        s.deposit(t4, S, 10, false, t4 * 1_000);
        let e = s.entry(t4, S);
        e.word.fetch_sub(3, Ordering::Relaxed); // three decisions
        s.account(t4);
        e.word.fetch_sub(2, Ordering::Relaxed);
        s.count(t4, S, field::REJECTED, 7);
        let t6 = T0 + 6_000;
        s.deposit(t6, S, 1, false, t6 * 1_000); // closes t4: 5 admitted in all
        let drained = s.drain_counters();
        assert_eq!(drained, vec![(t4, [5, 7, 0, 0, 0, 0, 0])]);
        assert_eq!(s.ctl.demand_prev.load(Ordering::Relaxed), 12);
        assert!(s.drain_counters().is_empty());
    }

    #[test]
    fn drained_ring_entries_are_taken_by_any_slice() {
        let (_d, seg) = tmp_seg(1);
        let s = seg.slot(0).unwrap();
        // 1 s grid, slice index 18 (position 2); then on a 2 s grid a slice starting earlier
        // maps to the same position (index 9 → 9 % 16 = 9? use a start that collides).
        let a = 18_000i64;
        s.count(a, 1_000, field::REJECTED, 4);
        let b = 4_000i64; // 2 s grid: index 2 → position 2
        // Not drained yet: the older-start count is dropped rather than wiping `a`.
        s.count(b, 2_000, field::REJECTED, 1);
        assert_eq!(s.drain_counters(), vec![(a, [0, 4, 0, 0, 0, 0, 0])]);
        // Drained: `b` takes the entry.
        s.count(b, 2_000, field::REJECTED, 2);
        assert_eq!(s.drain_counters(), vec![(b, [0, 2, 0, 0, 0, 0, 0])]);
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

    fn opts(now_ms: i64) -> ClaimOptions {
        ClaimOptions {
            now_ms,
            lock_timeout_ms: 1_000,
            reclaim_idle_ms: 60_000,
        }
    }

    /// Issue 9 item 9: 200 task names over time on a 64-slot segment never run out of slots,
    /// and a reclaimed slot has a new generation.
    #[test]
    fn idle_slots_are_reclaimed_for_new_names() {
        let (_d, seg) = tmp_seg(64);
        let mut now = 1_000_000i64;
        let mut seen = std::collections::HashMap::new();
        for i in 0..200 {
            let r = seg
                .claim(&format!("t{i}"), opts(now))
                .unwrap_or_else(|| panic!("task {i}: segment full"));
            if let Some(g) = seen.insert(r.index, r.generation) {
                assert_ne!(
                    g, r.generation,
                    "slot {} reused without a new generation",
                    r.index
                );
            }
            now += 1_000; // each name used for one second, then dropped
        }
        // A slot in use within the bound is never taken.
        let (_d, seg) = tmp_seg(1);
        let r = seg.claim("busy", opts(now)).unwrap();
        assert_eq!(seg.claim("other", opts(now + 59_999)), None);
        seg.slot(r.index).unwrap().touch(now + 59_000);
        assert_eq!(seg.claim("other", opts(now + 60_000)), None);
        let o = seg.claim("other", opts(now + 119_000)).unwrap();
        assert_eq!(o.index, r.index);
        assert_ne!(o.generation, r.generation);
    }

    /// A stale writer (of the reclaimed slot's old task) cannot write its meta into the slot.
    #[test]
    fn meta_of_a_reclaimed_slot_is_not_overwritten_by_a_stale_writer() {
        let (_d, seg) = tmp_seg(1);
        let old = seg.claim("old", opts(0)).unwrap();
        let s = seg.slot(old.index).unwrap();
        let meta = sample_meta();
        assert!(s.store_meta(&meta, old.generation));
        let new = seg.claim("new", opts(120_000)).unwrap();
        assert_eq!(new.index, old.index);
        assert!(s.meta().is_none(), "the new owner starts unknown");
        assert!(!s.store_meta(&meta, old.generation), "stale write accepted");
        assert!(s.meta().is_none());
        s.clear_meta(old.generation);
        let fresh = TaskMeta {
            threshold: 7,
            ..meta
        };
        assert!(s.store_meta(&fresh, new.generation));
        assert_eq!(s.meta().unwrap().threshold, 7);
        assert_eq!(
            word_generation(s.meta.fast.load(Ordering::Relaxed)),
            new.generation
        );
    }

    fn sample_meta() -> TaskMeta {
        TaskMeta {
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
            lease_ms: 0,
            keyed: false,
            key_overrides: Default::default(),
            shadow: false,
            pacing: Pacing::None,
            pace_burst: 0,
        }
    }

    #[test]
    fn meta_round_trips_through_the_segment() {
        let (_d, seg) = tmp_seg(1);
        let s = seg.slot(0).unwrap();
        assert!(s.meta().is_none());
        let meta = sample_meta();
        assert!(s.store_meta(&meta, s.generation()));
        assert_eq!(s.meta(), Some(meta));
        s.clear_meta(s.generation());
        assert!(s.meta().is_none());
    }

    const HELPER_ENV: &str = "SLUICE_SHM_TEST_HOLDER";

    /// Not a test: the lock holder process of `live_holder_in_another_process_is_busy_...`.
    #[test]
    #[ignore = "helper process"]
    fn lock_holder_helper() {
        let Ok(path) = std::env::var(HELPER_ENV) else {
            return;
        };
        let (seg, _) = Segment::open(Path::new(&path), 1).unwrap();
        let lock = seg.pull_lock(0).unwrap();
        let LockAttempt::Acquired { .. } = lock.try_lock(crate::clock::host_ms(), 600_000) else {
            panic!("helper could not lock");
        };
        println!("LOCKED");
        std::thread::sleep(std::time::Duration::from_secs(30));
    }

    /// Issue 9 item 8: a live holder in another process is busy; once it is killed, its lock
    /// is taken over at once (no timeout involved).
    #[test]
    fn live_holder_in_another_process_is_busy_a_killed_one_is_taken_over() {
        let (dir, seg) = tmp_seg(1);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "shm::tests::lock_holder_helper",
                "--ignored",
                "--nocapture",
            ])
            .env(HELPER_ENV, seg.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !line.contains("LOCKED") {
            assert!(std::time::Instant::now() < deadline, "helper never locked");
            line.clear();
            std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        }
        let lock = seg.pull_lock(0).unwrap();
        let now = crate::clock::host_ms();
        let holder = match lock.try_lock(now, 600_000) {
            LockAttempt::Busy { holder, .. } => holder,
            other => panic!("a live holder's lock was taken: {other:?}"),
        };
        assert_ne!(holder, seg.me());
        assert_eq!(seg.participant_pid(holder.participant), child.id());
        assert!(seg.alive(holder));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!seg.alive(holder));
        match lock.try_lock(crate::clock::host_ms(), 600_000) {
            LockAttempt::Acquired {
                took_over_from: Some(h),
                ..
            } => assert_eq!(h, holder),
            other => panic!("a dead holder's lock was not taken over: {other:?}"),
        }
        drop(dir);
    }

    /// A participant slot claimed again (a new process after the old one died) has a new
    /// generation: a token of the old one is dead although the byte is locked again.
    #[test]
    fn a_reused_participant_slot_makes_old_tokens_dead() {
        let (_d, seg) = tmp_seg(1);
        let me = seg.me();
        let (other, _) = Segment::open(seg.path(), 1).unwrap();
        let them = other.me();
        assert_ne!(
            them.participant, me.participant,
            "two opens, two participants"
        );
        let w = AtomicU64::new(0);
        let LockAttempt::Acquired { token, .. } = other.lock(&w).try_lock(1_000, 5_000) else {
            panic!("free lock not acquired")
        };
        assert!(matches!(
            seg.lock(&w).try_lock(1_010, 5_000),
            LockAttempt::Busy { holder, .. } if holder == them
        ));
        drop(other);
        // The same participant slot, claimed again by a new open.
        let (again, _) = Segment::open(seg.path(), 1).unwrap();
        assert_eq!(again.me().participant, them.participant);
        assert_ne!(again.me().generation, them.generation);
        assert!(!seg.alive(them), "old generation must be dead");
        assert!(seg.alive(again.me()));
        assert!(matches!(
            seg.lock(&w).try_lock(1_020, 5_000),
            LockAttempt::Acquired { took_over_from: Some(h), .. } if h == them
        ));
        assert!(
            !again.lock(&w).unlock(token),
            "the old token must not unlock"
        );
        // Our own lock is ours; a timed-out one is taken over even from a live holder.
        let w = AtomicU64::new(0);
        let LockAttempt::Acquired { token, .. } = again.lock(&w).try_lock(2_000, 5_000) else {
            panic!()
        };
        assert!(matches!(
            again.lock(&w).try_lock(2_001, 5_000),
            LockAttempt::Busy { .. }
        ));
        assert!(matches!(
            seg.lock(&w).try_lock(8_000, 5_000),
            LockAttempt::Acquired {
                took_over_from: Some(_),
                ..
            }
        ));
        assert!(!again.lock(&w).unlock(token));
    }

    #[test]
    fn corrupt_old_and_small_segments_are_replaced_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = Segment::path_for(dir.path(), "ns", "h");
        std::fs::write(&path, vec![0xA5u8; 64 * 1024]).unwrap();
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
        // Fewer slots than asked for: grown (never shrunk).
        let (seg, opened) = Segment::open(&path, 16).unwrap();
        assert!(
            matches!(opened, Opened::Replaced(ref r) if r.contains("grown from 4 to 16")),
            "{opened:?}"
        );
        assert_eq!(seg.slots(), 16);
        let (seg, opened) = Segment::open(&path, 4).unwrap();
        assert_eq!((opened, seg.slots()), (Opened::Existing, 16));
    }

    /// Issue 23 item 18: host ids that differ only in characters outside `[A-Za-z0-9_.-]`, or
    /// only after their first 128 bytes, name different segments.
    #[test]
    fn segment_names_are_injective_in_the_host_id() {
        let dir = Path::new("/dev/shm");
        let long = "h".repeat(200);
        let ids = [
            "web/1".to_string(),
            "web:1".to_string(),
            "web_1".to_string(),
            "web%2F1".to_string(),
            "wéb".to_string(),
            "w\u{e8}b".to_string(),
            format!("{long}a"),
            format!("{long}b"),
        ];
        let paths: std::collections::BTreeSet<PathBuf> = ids
            .iter()
            .map(|h| Segment::path_for(dir, "ns", h))
            .collect();
        assert_eq!(paths.len(), ids.len(), "{paths:?}");
        for p in &paths {
            let name = p.file_name().unwrap().to_str().unwrap();
            assert!(name.len() <= 255 && !name.contains('/'), "{name}");
        }
        assert_eq!(
            Segment::path_for(dir, "sluice", "web-1.eu_west"),
            dir.join("sluice.sluice.web-1.eu_west")
        );
    }

    #[test]
    fn tags_are_starts_and_wrap() {
        let big = (1i64 << 34) + 5_000;
        assert_eq!(untag(tag_of(big), big), big);
        assert_eq!(untag(tag_of(big - 3_000), big), big - 3_000);
        assert_eq!(untag(tag_of(big + 3_000), big), big + 3_000);
        assert_eq!(parity(T0, 1_000), 0);
        assert_eq!(parity(T0 + 1_000, 1_000), 1);
        assert_eq!(parity(T0 + 2_000, 2_000), 1);
        assert_eq!(parity(T0 + 4_000, 2_000), 0);
    }
}
