//! Mode `pooled`, the pure core: a decision is one compare-and-swap on the quota word of the
//! slice it falls in (the fast path's and the precise path's), paced slices spend no faster
//! than their pace, and what is not in hand is told apart: FAILED (the fallback decides),
//! LIMITED for the slice (counted), or a refill to wait for. Functions of the slot, the meta,
//! the slice index, the cost and the time passed in; asking the background thread for a
//! refill (the poke) is the caller's.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::shm::{FastMeta, QuotaEntry, Slot, field, tag_of, unpack_quota};
use crate::state::Health;

/// What the local quota says about `n` permits of one slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pooled {
    /// Admitted (taken from the quota word). `low`: the stock is below low water now (ask for
    /// a refill).
    Admitted { low: bool },
    /// Rejected and counted: a paced slice's stock is in hand but not released yet (`low` as
    /// above), or the slice has nothing left for `n` (its quota exhausted, or `n` beyond its
    /// cap or beyond what a quota word holds).
    Limited { retry_after: Duration, low: bool },
    /// Not enough in hand and the task is FAILED: the `on_failure` policy decides.
    Failed,
    /// Not enough in hand: a refill may bring it (not counted: the caller waits or rejects).
    Want,
}

/// Whether a coarse reading `now_us` may decide in the slice `[start_us, start_us +
/// slice_us)`: inside it and at least `guard_us` before its end. The coarse clock is never
/// ahead of the precise one and lags it by less than the guard, so the precise clock names the
/// same slice.
#[inline]
pub(crate) fn fast_in_slice(now_us: i64, start_us: i64, slice_us: u64, guard_us: i64) -> bool {
    let end_us = start_us.wrapping_add(slice_us as i64);
    now_us >= start_us && now_us < end_us.wrapping_sub(guard_us)
}

/// The fast path's compare-and-swap: takes `n` from quota word `e` if it holds the slice
/// tagged `tag` with at least `n` left (unpaced slices only). `Some(low)` when taken (`low`:
/// below low water now), `None` when not (the precise path decides from scratch).
#[inline]
pub(crate) fn take_fast(e: &QuotaEntry, tag: u32, n: u64) -> Option<bool> {
    let mut q = e.word.load(Ordering::Acquire);
    loop {
        let (t, _, c) = unpack_quota(q);
        if t != tag || (c as u64) < n {
            return None;
        }
        match e
            .word
            .compare_exchange_weak(q, q - n, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(c as u64 - n < e.low_water.load(Ordering::Relaxed)),
            Err(x) => q = x,
        }
    }
}

/// Decides `n` permits of the slice with full index `index` (on the meta's grid) at `now_us`
/// from the slot's local quota.
#[inline]
pub(crate) fn decide(slot: &Slot, m: &FastMeta, index: u64, n: u64, now_us: i64) -> Pooled {
    let start_ms = (index * m.slice_ms) as i64;
    let tag = tag_of(start_ms);
    let e = &slot.quota[(index & 1) as usize];
    let mut q = e.word.load(Ordering::Acquire);
    loop {
        let (t, _, c) = unpack_quota(q);
        if t != tag || (c as u64) < n {
            break;
        }
        // Paced: only what the pace has released (a refusal leaves the stock as it was).
        if m.paced
            && let Pace::Wait(us) = pace_check(slot, e, c, start_ms, m.slice_ms, n, now_us)
        {
            return pace_limited(slot, e, c, index, start_ms, n, us);
        }
        match e
            .word
            .compare_exchange_weak(q, q - n, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                return Pooled::Admitted {
                    low: c as u64 - n < e.low_water.load(Ordering::Relaxed),
                };
            }
            Err(x) => q = x,
        }
    }
    // Not enough local quota for this slice.
    if let Health::Failed { .. } = Health::decode(slot.ctl.state.load(Ordering::Acquire)) {
        return Pooled::Failed;
    }
    let (t, exhausted, _) = unpack_quota(q);
    // More than this slice's cap (as Redis reported it) or than a local quota word holds:
    // LIMITED for the slice and counted (a rejection, as Envoy's ratelimit counts hits
    // over the limit), but never asked of Redis: no pull is sized for it.
    let cap = e.pace_cap.load(Ordering::Relaxed);
    let beyond = t == tag && q != 0 && cap > 0 && n > cap;
    if (t == tag && exhausted && q != 0) || beyond || n > crate::shm::MAX_COUNT as u64 {
        slot.count_at(index, start_ms, field::REJECTED, n);
        let end = start_ms
            .saturating_add(m.slice_ms as i64)
            .saturating_mul(1_000);
        return Pooled::Limited {
            retry_after: Duration::from_micros((end - now_us).max(1) as u64),
            low: false,
        };
    }
    // Not final: the caller decides whether to wait for the refill (acquire) or not.
    Pooled::Want
}

/// A paced slice's local quota is in hand but not released yet: rejected (counted), retry
/// when the pace releases `n` more; a refill is asked for as usual when the stock is low.
#[cold]
fn pace_limited(
    slot: &Slot,
    e: &QuotaEntry,
    c: u32,
    index: u64,
    start_ms: i64,
    n: u64,
    wait_us: u64,
) -> Pooled {
    let low = (c as u64) < e.low_water.load(Ordering::Relaxed);
    slot.count_at(index, start_ms, field::REJECTED, n);
    Pooled::Limited {
        retry_after: Duration::from_micros(wait_us),
        low,
    }
}

/// The slot's side of asking the background thread for quota of the slice starting at
/// `start_ms` for decisions of up to `n` (the caller pokes the thread).
#[inline]
pub(crate) fn want(slot: &Slot, start_ms: i64, n: u64) {
    let w = start_ms as u64 + 1;
    if slot.ctl.want.load(Ordering::Relaxed) != w {
        slot.ctl.want.store(w, Ordering::Relaxed);
    }
    if slot.ctl.max_n.load(Ordering::Relaxed) < n {
        slot.ctl.max_n.fetch_max(n, Ordering::Relaxed);
    }
}

/// What the pace says about spending `n` more of a paced slice's local stock now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pace {
    /// Released: spend `n`.
    Go,
    /// Not released yet: µs until it is. The stock is left as it is.
    Wait(u64),
}

/// Paced slices: may this host spend `n` more now?
///
/// Permits of a paced slice are numbered in the order the pull script hands them out; permit
/// `j` is released at `start + (j − burst) · slice / cap` (the script's curve,
/// [`crate::protocol::scripts::PACE_LUA`], without its look-ahead). The host's stock of
/// `count` is taken to be the top of everything granted so far (`pace_granted`, any host's
/// grants and forfeits included, as Redis reported after this host's last pull), so the
/// permits it has spent are numbered up to `spent = pace_granted − count`. With
/// `paced = floor(cap · elapsed / slice)`:
///
/// ```text
///   spent + n ≤ paced + burst ......... Go
///   otherwise ......................... Wait until elapsed ≥ (spent + n − burst) · slice / cap
/// ```
///
/// A request of any cost up to the slice's cap is admitted as soon as the pace has released
/// it (item 1 of issue 23). Every permit has its own number, each host's stock holds numbers
/// no host else holds (a grant is a range of the sequence; an older leftover numbered at the
/// top is over-estimated, never under), and a permit is admitted at `t` only if its number is
/// below `paced(t) + burst`: so **the whole task** never admits more than `paced(t) + burst`
/// by any time `t`, whatever the hosts.
///
/// Stock numbered below the pace (a host that decided slower than the task's pace, or was
/// paused) is kept and spent: its numbers are below the pace, so spending it at once stays
/// within the bound above; what the pace released while *nobody* pulled is forfeited by the
/// script. (Dropping such stock, as before, lost it for good: with several hosts the numbers
/// interleave and the pace passes a slow host's whole stock at the task's rate — the soak's
/// seed 1001: three hosts at 0.4 × the pace each admitted 56 % of the cap.)
#[inline]
pub(crate) fn pace_check(
    slot: &Slot,
    e: &QuotaEntry,
    count: u32,
    start_ms: i64,
    slice_ms: u64,
    n: u64,
    now_us: i64,
) -> Pace {
    let cap = e.pace_cap.load(Ordering::Relaxed);
    if cap == 0 {
        // No cap known yet: nothing to pace against (Redis still does).
        return Pace::Go;
    }
    let burst = slot.ctl.pace_burst.load(Ordering::Relaxed);
    let count = count as u64;
    let spent = e.pace_granted.load(Ordering::Relaxed).saturating_sub(count);
    let len_us = (slice_ms.saturating_mul(1_000) as u128).max(1);
    let elapsed_us = now_us.saturating_sub(start_ms.saturating_mul(1_000)).max(0) as u128;
    let paced = (cap as u128 * elapsed_us / len_us).min(cap as u128) as u64;
    // Stock numbered below the pace is never dropped: with several hosts the numbers
    // interleave, and a host deciding slower than the task's pace would lose its stock to
    // other hosts' grants (see the doc above).
    let need = spent.saturating_add(n);
    if need <= paced.saturating_add(burst) || need > cap {
        // Released, or beyond the cap (the local quota and Redis decide that).
        return Pace::Go;
    }
    let at_us = ((need - burst) as u128 * len_us).div_ceil(cap as u128);
    Pace::Wait(at_us.saturating_sub(elapsed_us).clamp(1, u64::MAX as u128) as u64)
}
