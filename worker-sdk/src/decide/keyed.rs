//! Keyed tasks, the pure core: a decision on a key table entry's quota word ([`decide`]),
//! what a direct (uncached) key pull's answer means ([`direct`]), depositing a grant, giving
//! permits back and taking them back, and the size of a key's next pull. Functions of the
//! entry's cells, the meta and the time passed in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::decision::Decision;
use crate::protocol::scripts::KeyPullReply;
use crate::shm::{FastMeta, Slot};
use crate::state::{Health, PullOutcome};

use crate::keytable::{CHUNK_DIVISOR, KeyEntry, KeyTable, MIN_MAX_CHUNK};
use crate::shm::{pack_quota, tag_of, unpack_quota};

/// Adds `n` permits back to a quota word that still holds the slice `tag` (a word that moved
/// on to another slice is left alone: those permits are lost, never moved to another slice).
pub(crate) fn give_back(q: &AtomicU64, tag: u32, n: u64) {
    let mut w = q.load(Ordering::Acquire);
    loop {
        let (t, ex, c) = unpack_quota(w);
        if t != tag || w == 0 {
            return;
        }
        let next = pack_quota(
            t,
            ex,
            (c as u64 + n).min(crate::shm::MAX_COUNT as u64) as u32,
        );
        match q.compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return,
            Err(x) => w = x,
        }
    }
}

/// Takes up to `n` permits out of a quota word that still holds the slice `tag` (undoes a
/// [`give_back`] that raced with a reclaim: what was spent of them meanwhile is the other
/// key's excess, at most `n`, and never above the task's slice).
pub(crate) fn take_back(q: &AtomicU64, tag: u32, n: u64) {
    let mut w = q.load(Ordering::Acquire);
    loop {
        let (t, _, c) = unpack_quota(w);
        let k = n.min(c as u64);
        if t != tag || w == 0 || k == 0 {
            return;
        }
        match q.compare_exchange_weak(w, w - k, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return,
            Err(x) => w = x,
        }
    }
}

/// Adds `granted` permits of the slice `start_ms` to an entry's quota word.
pub(crate) fn deposit(
    e: &KeyEntry,
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
    let q = &e.quota[crate::shm::parity(start_ms, slice_ms)];
    let add = granted.min(crate::shm::MAX_COUNT as u64) as u32;
    let mut cur = q.load(Ordering::Acquire);
    loop {
        let (t, ex, c) = unpack_quota(cur);
        let next = if t == tag && cur != 0 {
            pack_quota(tag, ex || exhausted, c.saturating_add(add))
        } else {
            pack_quota(tag, exhausted, add)
        };
        match q.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(x) => cur = x,
        }
    }
}

/// The most a key's pull asks for (beyond what its decision needs) under a cap of `cap`
/// permits per slice: a sixteenth of the cap, at least `min(MIN_MAX_CHUNK, cap / 4)` (4 from a
/// cap of 16 on; a key of a small cap that is hot on a host still gets chunks of 2 or more it
/// can prefetch ahead of its decisions, and no host takes more than a quarter of a small cap at
/// once), at least 1.
#[doc(hidden)]
pub fn max_chunk(cap: u64) -> u64 {
    (cap / CHUNK_DIVISOR).max(MIN_MAX_CHUNK.min(cap / 4)).max(1)
}

/// The size of the next pull of a key for slice `start_ms`: what is needed first, then
/// doubling within the slice, up to `max(need, max_chunk(cap))`; a key whose grant record is
/// of the previous or the next slice pulls that record's size (so a pull after this slice's
/// prefetch of the next one does not double: the record is the prefetch's).
pub fn chunk(last: u64, start_ms: i64, slice_ms: u64, cap: u64, need: u64) -> u64 {
    let tag = tag_of(start_ms);
    let next = if last != 0 && (last >> 32) as u32 == tag {
        (last & 0xFFFF_FFFF).saturating_mul(2)
    } else {
        // Hot in the neighbouring slice: start at its last chunk; else cold: one.
        last_chunk(last, start_ms, slice_ms).unwrap_or(1).max(1)
    };
    next.min(max_chunk(cap)).max(need)
}

/// Records a pull of `want` permits for the slice starting at `start_ms` in the entry's grant
/// word: what the next pull and the low-water mark are sized from.
pub(crate) fn record_grant(e: &KeyEntry, start_ms: i64, want: u64) {
    e.grant.store(
        ((tag_of(start_ms) as u64) << 32) | want.min(0xFFFF_FFFF),
        Ordering::Relaxed,
    );
}

/// The last chunk pulled around the slice starting at `start_ms`, from the entry's grant word
/// `last`: its size when it was for this slice, the previous one or the next one (a prefetch
/// records the next slice's pull: this slice's low-water mark must survive it, and a first
/// chunk prefetched into this slice that sufficed leaves the previous slice's record), else
/// none (cold).
#[inline]
pub(crate) fn last_chunk(last: u64, start_ms: i64, slice_ms: u64) -> Option<u64> {
    let t = (last >> 32) as u32;
    let near = t == tag_of(start_ms)
        || t == tag_of(start_ms - slice_ms as i64)
        || t == tag_of(start_ms + slice_ms as i64);
    (last != 0 && near).then_some(last & 0xFFFF_FFFF)
}

/// Whether `held` permits of the slice starting at `start_ms` are less than half the entry's
/// [`last_chunk`] (grant word `last`), for a chunk of at least 2: a key pulled one permit at a
/// time is cold here, and prefetching for it would double its Redis calls and strand what it
/// brings.
#[inline]
pub(crate) fn below_half(held: u64, last: u64, start_ms: i64, slice_ms: u64) -> bool {
    last_chunk(last, start_ms, slice_ms)
        .is_some_and(|size| size >= 2 && held.saturating_mul(2) < size)
}

/// What entry `e`'s local quota says about `n` permits of slice `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entry {
    /// Admitted (taken and counted). `low`: [`below_half`] the last chunk (prefetch the next).
    Admitted { low: bool },
    /// The entry was reclaimed for another key between the lookup and the take: the permits
    /// were given back; decide again on a fresh lookup.
    Reclaimed,
    /// Not enough in hand and the task is FAILED: the `on_failure` policy decides.
    Failed,
    /// The key's quota of the slice is exhausted (or `n` beyond what a word holds): rejected
    /// (counted), retry after the slice's end.
    Limited { retry_after: Duration },
    /// Not enough in hand: a pull may bring it.
    Pending,
}

/// Decides `n` permits of the slice with full index `index` (on the meta's grid) from the
/// quota of entry `i` of `table` (`e`), whose identity word was `id` when looked up. What it
/// counts marks the entry's bucket for the key report.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn decide(
    slot: &Slot,
    table: &KeyTable,
    i: usize,
    e: &KeyEntry,
    id: u64,
    m: &FastMeta,
    index: u64,
    n: u64,
    now_us: i64,
) -> Entry {
    let start_ms = (index * m.slice_ms) as i64;
    let tag = tag_of(start_ms);
    let q = &e.quota[(index & 1) as usize];
    let mut w = q.load(Ordering::Acquire);
    loop {
        let (t, _, c) = unpack_quota(w);
        if t != tag || w == 0 || (c as u64) < n {
            break;
        }
        match q.compare_exchange_weak(w, w - n, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                if e.ident.load(Ordering::Acquire) != id {
                    // Reclaimed for another key meanwhile: give the permits back.
                    give_back(q, tag, n);
                    return Entry::Reclaimed;
                }
                e.adm.fetch_add(n, Ordering::Relaxed);
                table.touch(i);
                let left = c as u64 - n;
                let last = e.grant.load(Ordering::Relaxed);
                return Entry::Admitted {
                    low: below_half(left, last, start_ms, m.slice_ms),
                };
            }
            Err(x) => w = x,
        }
    }
    if let Health::Failed { .. } = Health::decode(slot.ctl.state.load(Ordering::Acquire)) {
        return Entry::Failed;
    }
    let (t, exhausted, _) = unpack_quota(w);
    if (t == tag && exhausted && w != 0) || n > crate::shm::MAX_COUNT as u64 {
        e.rej.fetch_add(n, Ordering::Relaxed);
        table.touch(i);
        let end_us = (start_ms + m.slice_ms as i64) * 1_000;
        return Entry::Limited {
            retry_after: Duration::from_micros((end_us - now_us).max(1) as u64),
        };
    }
    Entry::Pending
}

/// What a direct (all-or-nothing, uncached) key pull's answer means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direct {
    /// The decision (the caller counts it in the task's slice).
    Decided(Decision),
    /// The host's meta is older than Redis's: refresh it, LIMITED for a moment.
    StaleMeta,
    /// No answer, or no task slice: the task is FAILED (this outcome), the `on_failure`
    /// policy decides.
    Failed(PullOutcome),
}

/// Maps a direct key pull's reply (`None`: failed or timed out) for `n` permits of the slice
/// starting at `start_ms`, at `now_us`.
#[inline]
pub(crate) fn direct(
    reply: Option<KeyPullReply>,
    m: &FastMeta,
    start_ms: i64,
    n: u64,
    now_us: i64,
) -> Direct {
    let end_us = (start_ms + m.slice_ms as i64) * 1_000;
    match reply {
        Some(KeyPullReply::Granted { granted, .. }) if granted >= n => {
            Direct::Decided(Decision::Allowed)
        }
        Some(KeyPullReply::Granted { .. }) | Some(KeyPullReply::OutsideWindow { .. }) => {
            Direct::Decided(Decision::Limited {
                retry_after: Duration::from_micros((end_us - now_us).max(1) as u64),
            })
        }
        Some(KeyPullReply::StaleMeta { .. }) => Direct::StaleMeta,
        Some(KeyPullReply::Missing { .. }) => Direct::Failed(PullOutcome::Missing),
        None => Direct::Failed(PullOutcome::Error),
    }
}
