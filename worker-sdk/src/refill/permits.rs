//! Mode `concurrency`, the refill side: the background thread's leasing round (LEASE calls
//! under the host's lease lock), giving the block back when the task stops, and what the host
//! reports.

use std::sync::atomic::Ordering;

use crate::clock::boot_ms;
use crate::ctx::Shared;
use crate::decide::permits::*;
use crate::protocol::lease::{self, LeaseReply};
use crate::shm::{ConcCells, FastMeta, Slot};

/// The host's state and permits of a concurrency task, for its `NS:hosts` entry: FAILED while
/// `on_failure` decides, NORMAL while it holds a valid lease, LIMITED otherwise.
pub(crate) fn host_report(k: &ConcCells) -> (crate::HostState, crate::protocol::PermitReport) {
    let s = stats(k);
    let state = if s.failed {
        crate::HostState::Failed
    } else if s.leased {
        crate::HostState::Normal
    } else {
        crate::HostState::Limited
    };
    (
        state,
        crate::protocol::PermitReport {
            in_use: s.in_use,
            limit: s.limit,
            waiting: s.waiting,
            lapses: s.lapses,
            reclaimed: s.reclaimed,
        },
    )
}

pub(crate) fn stats(k: &ConcCells) -> PermitStats {
    let (limit, in_use) = unpack(k.permits.load(Ordering::Acquire));
    let regime = k.regime.load(Ordering::Acquire);
    PermitStats {
        in_use,
        limit,
        waiting: k.waiting.load(Ordering::Relaxed),
        cap: k.cap.load(Ordering::Relaxed),
        others: k.others.load(Ordering::Relaxed),
        leased: regime == REGIME_LEASE && boot_ms() < k.valid_until_ms.load(Ordering::Acquire),
        failed: regime != REGIME_LEASE,
        lapses: k.lapses.load(Ordering::Relaxed),
        reclaimed: k.reclaimed.load(Ordering::Relaxed),
        granted: k.granted.load(Ordering::Relaxed),
    }
}

/// One background round for a concurrency task: reclaim dead processes' permits, and lease
/// (grow, renew, shrink) when due. True when it wants the next round soon.
pub(crate) async fn step(sh: &Shared, slot: &Slot, m: &FastMeta) -> bool {
    let k = &slot.conc;
    let now = boot_ms();
    let in_use = unpack(k.permits.load(Ordering::Acquire)).1;
    let scanned = k.scanned_ms.load(Ordering::Relaxed);
    if in_use > 0
        && now - scanned >= SCAN_MS
        && k.scanned_ms
            .compare_exchange(scanned, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        let n = reclaim_dead(&sh.seg, k);
        if n > 0 {
            tracing::info!(
                permits = n,
                "gave the permits of a dead process back to the host"
            );
        }
    }
    let waiting = k.waiting.load(Ordering::Acquire);
    if round_due(k, now) {
        let denied = k.denied.load(Ordering::Relaxed);
        lease_call(sh, slot, m, denied).await;
    }
    waiting > 0
}

/// The last round of a process that stops using the task: give the host's idle permits back
/// at once (the holding shrinks to what the host's other processes have in use), instead of
/// leaving them to the next renewal or to the lease's expiry.
pub(crate) async fn give_back(sh: &Shared, slot: &Slot, m: &FastMeta) {
    let k = &slot.conc;
    reclaim_dead(&sh.seg, k);
    let (limit, in_use) = unpack(k.permits.load(Ordering::Acquire));
    if k.regime.load(Ordering::Acquire) != REGIME_LEASE
        || limit <= in_use
        || k.waiting.load(Ordering::Acquire) > 0
    {
        return;
    }
    // No demand: the target is what is in use (plus an eighth unless others wait).
    let denied = k.denied.load(Ordering::Relaxed);
    k.denied_seen.store(denied, Ordering::Relaxed);
    lease_call(sh, slot, m, denied).await;
}

/// The system's clocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClocks;

impl Clocks for SystemClocks {
    fn boot_ms(&self) -> i64 {
        boot_ms()
    }
    fn host_us(&self) -> i64 {
        crate::clock::host_us()
    }
}

async fn lease_call(sh: &Shared, slot: &Slot, m: &FastMeta, denied: u64) {
    let k = &slot.conc;
    let p = LeaseParams::of(slot, m);
    let task = slot.name().unwrap_or_default();
    let send = |call: LeaseCall| async move {
        let before_us = crate::clock::host_us();
        let res = crate::plumbing::call(sh, crate::plumbing::Retry::Idempotent, |mut c| {
            let (task, host) = (&task, &sh.cfg.host_id);
            async move { lease::lease(&mut c, &sh.keys, task, host, call.want, call.seq).await }
        })
        .await;
        match res {
            Ok(Ok(reply)) => {
                if let LeaseReply::Held { redis_time_us, .. } = reply {
                    // The clock offset to Redis, as every pull measures it (skew detection).
                    crate::plumbing::record_clock(
                        sh,
                        before_us,
                        crate::clock::host_us(),
                        redis_time_us,
                    );
                }
                LeaseOutcome::Reply(reply)
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "LEASE failed");
                LeaseOutcome::Failed
            }
            Err(()) => LeaseOutcome::Failed,
        }
    };
    let timeout = lease_lock_timeout_ms(sh.cfg.pull_timeout);
    locked_call(&sh.seg, k, &p, &SystemClocks, timeout, denied, send).await;
}
