//! The local limiters' decisions: mode `local`, and a FAILED task's `on_failure` policy
//! (`allow`, `deny` until the next probe, `local`: the task's local limiter with `local_limit`
//! per host). Counted in the slice's counters like any decision.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::decision::Decision;
use crate::keytable::KeyEntry;
use crate::limiter::{self, Params, Verdict};
use crate::protocol::OnFailure;
use crate::shm::{FastMeta, Segment, Slot, field, tag_of};

/// The local limiter of the slot (algorithm, `local_limit`, burst from the meta) on `n`.
#[inline]
pub(crate) fn local(seg: &Segment, slot: &Slot, m: &FastMeta, n: u64, now_us: i64) -> Verdict {
    let p = Params {
        limit: slot.meta.local_limit.load(Ordering::Relaxed),
        window_us: m.slice_ms * 1_000,
        burst: slot.meta.burst.load(Ordering::Relaxed),
    };
    limiter::decide_shared(seg, slot, m.algorithm, &p, now_us, n)
}

/// Mode `local`: the local limiter decides, counted in slice `index`.
#[inline]
pub(crate) fn local_mode(
    seg: &Segment,
    slot: &Slot,
    m: &FastMeta,
    index: u64,
    n: u64,
    now_us: i64,
) -> Decision {
    let d = match local(seg, slot, m, n, now_us) {
        Verdict::Admit => Decision::Allowed,
        Verdict::Deny { retry_after_us } => Decision::Limited {
            retry_after: Duration::from_micros(retry_after_us),
        },
    };
    count(slot, m, index, n, d.is_allowed());
    d
}

/// A FAILED task: its `on_failure` policy decides, counted in slice `index`.
pub(crate) fn fallback(
    seg: &Segment,
    slot: &Slot,
    m: &FastMeta,
    index: u64,
    n: u64,
    now_us: i64,
) -> Decision {
    let d = match m.on_failure {
        OnFailure::Allow => Decision::FallbackAllowed,
        OnFailure::Deny => {
            let next = slot.ctl.next_probe_ms.load(Ordering::Relaxed) * 1_000;
            Decision::FallbackDenied {
                retry_after: Duration::from_micros((next - now_us).max(1_000) as u64),
            }
        }
        OnFailure::Local => match local(seg, slot, m, n, now_us) {
            Verdict::Admit => Decision::FallbackAllowed,
            Verdict::Deny { retry_after_us } => Decision::FallbackDenied {
                retry_after: Duration::from_micros(retry_after_us),
            },
        },
    };
    count(slot, m, index, n, d.is_allowed());
    d
}

/// Counts a decision of `n` in slice `index`'s counters: admitted or rejected.
#[inline]
pub(crate) fn count(slot: &Slot, m: &FastMeta, index: u64, n: u64, admitted: bool) {
    let f = if admitted {
        field::ADMITTED
    } else {
        field::REJECTED
    };
    slot.count_at(index, (index * m.slice_ms) as i64, f, n);
}

/// A keyed task FAILED: its `on_failure` policy on key entry `e` (`None`: the table had no
/// entry for the key), `local` with `local_limit` per key per slice (a fixed window in the
/// entry; no entry: denied). Counted on the entry, or in the task's slice without one.
pub(crate) fn key(
    slot: &Slot,
    m: &FastMeta,
    e: Option<&KeyEntry>,
    start_ms: i64,
    n: u64,
    now_us: i64,
) -> Decision {
    let end_us = (start_ms + m.slice_ms as i64) * 1_000;
    let denied = |until_us: i64| Decision::FallbackDenied {
        retry_after: Duration::from_micros((until_us - now_us).max(1_000) as u64),
    };
    let d = match m.on_failure {
        OnFailure::Allow => Decision::FallbackAllowed,
        OnFailure::Deny => denied(slot.ctl.next_probe_ms.load(Ordering::Relaxed) * 1_000),
        OnFailure::Local => {
            let limit = slot.meta.local_limit.load(Ordering::Relaxed);
            match e {
                None => denied(end_us),
                Some(e) => {
                    let tag = tag_of(start_ms) as u64;
                    let mut w = e.local.load(Ordering::Acquire);
                    loop {
                        let used = if w >> 32 == tag { w & 0xFFFF_FFFF } else { 0 };
                        if used + n > limit {
                            break denied(end_us);
                        }
                        let next = (tag << 32) | (used + n).min(0xFFFF_FFFF);
                        match e.local.compare_exchange_weak(
                            w,
                            next,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        ) {
                            Ok(_) => break Decision::FallbackAllowed,
                            Err(x) => w = x,
                        }
                    }
                }
            }
        }
    };
    match e {
        Some(e) => {
            let c = if d.is_allowed() { &e.adm } else { &e.rej };
            c.fetch_add(n, Ordering::Relaxed);
        }
        None => {
            let f = if d.is_allowed() {
                field::ADMITTED
            } else {
                field::REJECTED
            };
            slot.count(start_ms, m.slice_ms, f, n);
        }
    }
    d
}
