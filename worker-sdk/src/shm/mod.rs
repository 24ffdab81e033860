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

mod lock;
mod segment;
mod slot;
mod word;

pub use lock::*;
pub use segment::*;
pub use slot::*;
pub use word::*;

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
