//! Each mode's refill step, driven by the background thread (`crate::background`): what to
//! pull, lease, flush or report, and applying Redis's answers to the shared cells through the
//! decision cores (`crate::decide`). Nothing here may import `background` or a front
//! (`client`, `keyed`, `concurrency`).

pub(crate) mod caller;
pub(crate) mod flush;
pub(crate) mod keys;
pub(crate) mod meta;
pub(crate) mod permits;
pub(crate) mod pooled;
pub(crate) mod report;

use crate::ctx::Shared;
use crate::shm::{LockAttempt, ShmLock, Slot};

pub(crate) fn lock(sh: &Shared, slot: &Slot, now_ms: i64) -> Option<u64> {
    try_lock(sh, sh.seg.lock(&slot.ctl.pull_lock), "pull", now_ms)
}

pub(crate) fn try_lock(sh: &Shared, lock: ShmLock<'_>, what: &str, now_ms: i64) -> Option<u64> {
    let timeout = sh.cfg.lock_timeout.as_millis() as u64;
    match lock.try_lock(now_ms, timeout) {
        LockAttempt::Acquired {
            token,
            took_over_from,
        } => {
            if let Some(h) = took_over_from {
                tracing::warn!(
                    lock = what,
                    participant = h.participant,
                    pid = sh.seg.participant_pid(h.participant),
                    "took over a lock from a dead or stuck process"
                );
            }
            Some(token)
        }
        LockAttempt::Busy { .. } => None,
    }
}
