//! Keyed tasks, the pure core: the quota words of a key table entry: depositing a grant,
//! giving permits back and taking them back, and the size of a key's next pull. Functions
//! of the entry's cells and the time passed in.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::keytable::{CHUNK_DIVISOR, KeyEntry};
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

/// The size of the next pull of a key for slice `start_ms`: what is needed first, then
/// doubling within the slice, up to `max(need, cap / CHUNK_DIVISOR)`.
pub fn chunk(last: u64, start_ms: i64, slice_ms: u64, cap: u64, need: u64) -> u64 {
    let tag = tag_of(start_ms);
    let size = last & 0xFFFF_FFFF;
    let t = (last >> 32) as u32;
    let max = (cap / CHUNK_DIVISOR).max(1);
    let next = if last == 0 {
        1
    } else if t == tag {
        size.saturating_mul(2)
    } else if t == tag_of(start_ms - slice_ms as i64) {
        // Hot in the previous slice: start the new one at half its last chunk.
        (size / 2).max(1)
    } else {
        1
    };
    next.min(max).max(need)
}
