//! Mode `concurrency`: at most `threshold` permits in flight across the cluster, handed out
//! from a block of permits the host leases from Redis ([`crate::protocol::lease`]).
//!
//! # On the host
//!
//! ```text
//!   process A ─ try_permit ─┐                         ┌─ LEASE (one Lua call): take, grow,
//!   process B ─ try_permit ─┼─▶ slot.conc (shm) ◀────┤  renew, shrink; by the holder of
//!   process C ─ drop Permit ┘   permits = limit|in_use │  the host's lease lock
//!                               holders[] per process  └─ background thread of any process
//! ```
//!
//! A permit is handed out by one compare-and-swap on the slot's `permits` word (`limit:32 |
//! in_use:32`) that raises `in_use` while it is below `limit`, the permits the host holds in
//! Redis; no network on that path. The permit is then added to the calling process's entry
//! in the slot's holder table (`participant | generation | count`), and dropping the
//! [`Permit`] takes it off both. A process that dies (even by SIGKILL) loses its participant
//! byte lock; the next scan of any live process of the host (every [`SCAN_MS`]) sees that,
//! clears the entry and gives its count back to `in_use`.
//!
//! # Leases, renewal and the safety margin
//!
//! One process's background thread at a time (the slot's lease lock) sizes the block from
//! demand ([`target`]) and runs LEASE: when callers wait and the block could grow, when the
//! lease is a quarter of its TTL old (renewal), and to give idle permits back (at renewal
//! time). A shrink lowers `limit` in the segment *before* the call, so Redis never believes
//! the host holds fewer than it may hand out.
//!
//! The call is sent at boot-clock time `t0`; Redis sets the entry's expiry to its own `TIME`
//! plus `lease_ms`, which is after `t0 + lease_ms`. The host hands out permits under that
//! lease only until `t0 + lease_ms − lease_ms / 4` ([`valid_for_ms`]): a renewal that keeps
//! failing makes the host stop a quarter of the TTL before Redis can give the permits to
//! another host. The margin absorbs the rate difference of the two clocks and a forward step
//! of Redis' clock of up to a quarter TTL. A decision re-reads the validity *after* its
//! compare-and-swap, so a process stopped between the check and the swap does not hand out a
//! permit of a lapsed lease. The boot clock runs while processes are stopped.
//!
//! # Late answers
//!
//! The lease lock is taken over from a holder stuck past its timeout, so the stuck process
//! may come back with the answer to a call another process has since superseded (the permits
//! given back meanwhile, the threshold lowered). [`finish_call`] applies an answer only while
//! its call is the host's newest ([`begin_call`] draws sequence numbers in one atomic step)
//! and the caller still holds the lock, and [`take`] never passes [`ConcCells::bound`](crate::shm::ConcCells::bound), a
//! word written only by compare-and-swap: lowered to `want` when a call begins, set to
//! `min(holding, cap − others)` by the answer of the newest call. docs/concurrency.md, "The
//! bound", has the argument.
//!
//! What no lease can bound: a permit already handed out is the caller's until it drops it.
//! A host cut off from Redis for longer than the margin keeps its permits in use while Redis
//! lets others take them after the TTL: hold times should be far below the TTL, and work that
//! must never overlap needs a fenced resource ([`Client::lock`](crate::Client::lock)).
//!
//! # FAILED
//!
//! When LEASE calls fail (or the task is unknown to Redis) *and* the lease has lapsed, the
//! host goes FAILED and the task's `on_failure` decides: `local` hands out up to
//! `local_limit` in flight on this host (the same `permits` word, `limit` = local_limit),
//! `allow` everything, `deny` nothing. Permits handed out while FAILED stay counted in
//! `in_use`; back in Redis, the host asks for at least what it has in use, and while Redis
//! grants fewer, `in_use ≥ limit` and nothing new is handed out: no double grant.
//!
//! # Where the code is
//!
//! This module is the [`Permit`] front (`Task::permit` and friends: waiting, timeouts). The
//! permit word, the holders and a leasing round's plan and answer are the pure core
//! `crate::decide::permits` (re-exported here); the background thread's leasing round,
//! give-back and host report are `crate::refill::permits`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::client::Task;
use crate::clock::boot_ms;
use crate::ctx::TaskInner;
pub use crate::decide::permits::*;
use crate::protocol::Mode;
pub use crate::refill::permits::SystemClocks;
use crate::refill::permits::stats;
use crate::shm::{FastMeta, Slot, SlotRef};

/// One permit of a concurrency task, released when dropped (or by [`Permit::release`]).
#[derive(Debug)]
#[must_use = "a permit is released as soon as it is dropped"]
pub struct Permit {
    task: Task,
    slot: SlotRef,
    fallback: bool,
    live: bool,
}

impl Permit {
    /// Whether it was handed out while FAILED (`on_failure` local or allow), not from a lease.
    pub fn is_fallback(&self) -> bool {
        self.fallback
    }

    /// Releases the permit now (the same as dropping it).
    pub fn release(mut self) {
        self.release_now();
    }

    /// Keeps the permit held by this process until the process exits (the host then gets it
    /// back like the permits of a killed process), without running the release now.
    pub fn forget(mut self) {
        self.live = false;
    }

    fn release_now(&mut self) {
        if !self.live {
            return;
        }
        self.live = false;
        let seg = &self.task.shared.seg;
        let Some(slot) = seg.slot(self.slot.index) else {
            return;
        };
        if slot.generation() != self.slot.generation {
            return;
        }
        release(seg, &slot.conc);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.release_now();
    }
}

impl Task {
    fn conc_slot(&self) -> Result<(&Slot, SlotRef, FastMeta), PermitError> {
        let r = self.inner.slot_ref();
        let slot = self.shared.seg.slot(r.index).ok_or(PermitError::Unknown)?;
        let w = slot.meta.fast.load(Ordering::Acquire);
        let m = FastMeta::decode(w).filter(|m| m.generation == r.generation);
        let Some(m) = m else {
            if let Some(new) = self.shared.seg.resolve(&self.inner.name)
                && new != r
            {
                self.inner.set_slot_ref(new);
            }
            self.shared.wake.notify_one();
            return Err(PermitError::Unknown);
        };
        if m.mode != Mode::Concurrency {
            return Err(PermitError::NotConcurrency);
        }
        Ok((slot, r, m))
    }

    /// Takes one permit of a concurrency task now, if the host has one free: one
    /// compare-and-swap in the host segment, no network, never waits. The permit is released
    /// when the returned guard is dropped.
    pub fn try_permit(&self) -> Result<Permit, PermitError> {
        let (slot, r, _) = self.conc_slot()?;
        let k = &slot.conc;
        match take(&self.shared.seg, k, boot_ms) {
            Ok(fallback) => Ok(Permit {
                task: self.clone(),
                slot: r,
                fallback,
                live: true,
            }),
            Err(e) => {
                // Wake the background thread for the host's first demand only: after that its
                // rounds (every millisecond while a caller waits) see the demand; waking it on
                // every refusal would turn waiting into spinning.
                if k.sent_ok_ms.load(Ordering::Relaxed) == 0 {
                    self.shared.wake.notify_one();
                }
                Err(e)
            }
        }
    }

    /// Takes one permit, waiting for one at most [`crate::Config::acquire_timeout`].
    pub async fn permit(&self) -> Result<Permit, PermitError> {
        self.permit_timeout(self.shared.cfg.acquire_timeout).await
    }

    /// Takes one permit, waiting for one at most `timeout`. Works on any executor: the
    /// client's background thread wakes waiters every millisecond while any wait.
    pub async fn permit_timeout(&self, timeout: Duration) -> Result<Permit, PermitError> {
        let deadline = Instant::now().checked_add(timeout);
        let mut waiting: Option<WaitGuard<'_>> = None;
        loop {
            let notified = self.inner.deposited.notified();
            if let Some(done) = self.wait_step(deadline, &mut waiting) {
                return done;
            }
            notified.await;
        }
    }

    /// One round of a wait for a permit: the answer when there is one (a permit, an error
    /// waiting cannot cure, or the deadline passed); otherwise registers the wait (once) so
    /// the background thread grows the lease, and None: wait and try again. No `deadline`
    /// (a timeout too long to add to the clock): no end.
    fn wait_step<'a>(
        &'a self,
        deadline: Option<Instant>,
        waiting: &mut Option<WaitGuard<'a>>,
    ) -> Option<Result<Permit, PermitError>> {
        match self.try_permit() {
            Ok(p) => return Some(Ok(p)),
            Err(e @ (PermitError::NotConcurrency | PermitError::TooManyHolders)) => {
                return Some(Err(e));
            }
            Err(e) if deadline.is_some_and(|d| Instant::now() >= d) => {
                return Some(Err(match e {
                    PermitError::Full | PermitError::NoLease => PermitError::Timeout,
                    other => other,
                }));
            }
            Err(_) => {}
        }
        if waiting.is_none() {
            *waiting = Some(WaitGuard::new(self));
            self.shared.wake.notify_one();
        }
        None
    }

    /// [`Task::permit`] for programs without an async runtime: sleeps in short steps.
    pub fn permit_blocking(&self, timeout: Duration) -> Result<Permit, PermitError> {
        let deadline = Instant::now().checked_add(timeout);
        let mut waiting: Option<WaitGuard<'_>> = None;
        loop {
            if let Some(done) = self.wait_step(deadline, &mut waiting) {
                return done;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// This host's permit accounting for the task (`None` unless it is a known concurrency
    /// task).
    pub fn permit_stats(&self) -> Option<PermitStats> {
        let (slot, _, _) = self.conc_slot().ok()?;
        Some(stats(&slot.conc))
    }
}

/// Counts a caller as waiting (host-wide demand) while it lives, and in this process's task
/// (so the background thread runs its fast rounds).
struct WaitGuard<'a> {
    w: &'a AtomicU64,
    inner: &'a TaskInner,
}

impl<'a> WaitGuard<'a> {
    fn new(task: &'a Task) -> Self {
        let w: &AtomicU64 = match task.shared.seg.slot(task.inner.slot_ref().index) {
            Some(s) => &s.conc.waiting,
            None => &NOWHERE,
        };
        w.fetch_add(1, Ordering::AcqRel);
        task.inner.waiters.fetch_add(1, Ordering::AcqRel);
        Self {
            w,
            inner: &task.inner,
        }
    }
}

static NOWHERE: AtomicU64 = AtomicU64::new(0);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        let _ = self
            .w
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(1))
            });
        self.inner.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_never_exceeds_the_cap_or_drops_below_use() {
        for in_use in 0..30 {
            for limit in in_use..30 {
                for waiting in [0, 1, 10, 100] {
                    for others in [0, 5, 25] {
                        let t = target(in_use, limit, waiting, 0, 20, others, 3);
                        assert!(t >= in_use.min(20), "{in_use} {limit} {waiting} {others}");
                        assert!(t <= 20.max(in_use), "{t}");
                    }
                }
            }
        }
    }
}
