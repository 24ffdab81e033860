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
//! and the caller still holds the lock, and [`take`] never passes [`ConcCells::bound`], a
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::client::Task;
use crate::clock::boot_ms;
use crate::ctx::{Shared, TaskInner};
use crate::protocol::lease::{self, LeaseReply};
use crate::protocol::{Mode, OnFailure};
use crate::shm::{ConcCells, FastMeta, Holder, LockAttempt, Segment, Slot, SlotRef};

/// How often a host looks for permits of dead processes (while any are in use).
pub const SCAN_MS: i64 = 20;
/// Shortest pause before growing again after a LEASE that could not grow the block.
pub const GROW_RETRY_MIN_MS: i64 = 200;
/// Pause between LEASE attempts while they fail.
pub const FAILED_RETRY_MS: i64 = 100;
/// Lease TTL assumed before the first reply (the meta's `lease_ms` when known).
pub const DEFAULT_LEASE_MS: u64 = 10_000;

const REGIME_LEASE: u64 = 0;
const REGIME_LOCAL: u64 = 1;
const REGIME_ALLOW: u64 = 2;
const REGIME_DENY: u64 = 3;

const IN_USE: u64 = 0xFFFF_FFFF;

/// Packs the permit word.
///
/// ```
/// use sluice::concurrency::{pack, unpack};
/// assert_eq!(unpack(pack(20, 7)), (20, 7));
/// ```
#[inline]
pub fn pack(limit: u64, in_use: u64) -> u64 {
    (limit.min(IN_USE) << 32) | in_use.min(IN_USE)
}

/// Unpacks the permit word into `(limit, in_use)`.
#[inline]
pub fn unpack(w: u64) -> (u64, u64) {
    (w >> 32, w & IN_USE)
}

/// The `bound` of a [`ConcCells::bound`] word: under a lease no permit is handed out while
/// this many or more are in use on the host.
#[inline]
pub fn bound_of(w: u64) -> u64 {
    w & IN_USE
}

/// Writes `bound` into a [`ConcCells::bound`] word, bumping its generation.
#[inline]
fn bound_word(prev: u64, bound: u64) -> u64 {
    (((prev >> 32) + 1) << 32 & !IN_USE) | bound.min(IN_USE)
}

/// How long permits may be handed out after a successful LEASE sent at `t0`: the TTL minus
/// the safety margin of a quarter TTL.
///
/// ```
/// assert_eq!(sluice::concurrency::valid_for_ms(2_000), 1_500);
/// ```
pub fn valid_for_ms(lease_ms: u64) -> i64 {
    (lease_ms - lease_ms / 4) as i64
}

/// The block a host asks for (pure): what it has in use, plus those waiting, plus headroom
/// for the demand it refused since the last call (a quarter of its use, at least one), never
/// above the cap; with no demand, what it uses plus an eighth, or exactly what it uses when
/// other hosts wait for permits (`others_unmet > 0`): idle permits go back. When the cluster
/// is over the cap (`others + limit > cap`, after a threshold decrease) the host asks for no
/// more than its room under the cap or, if that is less, what it has in use.
///
/// ```
/// use sluice::concurrency::target;
/// // 10 in use, 5 waiting: 10 + 5 + 2 (headroom), cap 20 with nobody else.
/// assert_eq!(target(10, 10, 5, 0, 20, 0, 0), 17);
/// // Idle: 8 in use of 12 held: give 3 back (keep an eighth); all 4 if another host waits.
/// assert_eq!(target(8, 12, 0, 0, 20, 0, 0), 9);
/// assert_eq!(target(8, 12, 0, 0, 20, 0, 4), 8);
/// // Threshold lowered to 5 while others hold 4 and we hold 6 with 3 in use: keep 3.
/// assert_eq!(target(3, 6, 9, 9, 5, 4, 0), 3);
/// ```
pub fn target(
    in_use: u64,
    limit: u64,
    waiting: u64,
    denied_new: u64,
    cap: u64,
    others: u64,
    others_unmet: u64,
) -> u64 {
    let demand = waiting > 0 || denied_new > 0;
    let want = if demand {
        in_use + waiting.max(denied_new.min(cap)).max(1) + (in_use / 4).max(1)
    } else if others_unmet > 0 {
        in_use
    } else {
        in_use + in_use / 8
    };
    let want = want.min(cap.max(in_use));
    if others + limit > cap {
        return want.min(cap.saturating_sub(others)).max(in_use);
    }
    want
}

/// Why [`Task::try_permit`] gave no permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PermitError {
    /// Every permit the host holds is in use (the cluster-wide threshold is reached, or the
    /// host's block is being grown: [`Task::permit`] waits).
    #[error("all permits are in flight")]
    Full,
    /// The host holds no valid lease now (none yet, or renewal failed past the safety margin).
    #[error("this host holds no valid lease")]
    NoLease,
    /// FAILED with `on_failure = deny` (or `local` with every local permit in use).
    #[error("Redis is unreachable and on_failure denies")]
    Failed,
    /// The task is not in mode `concurrency` (use `try_acquire`).
    #[error("the task is not in mode concurrency")]
    NotConcurrency,
    /// The task's meta is not known yet on this host.
    #[error("the task is not known yet")]
    Unknown,
    /// Every holder entry of the task on this host is taken ([`crate::shm::HOLDERS`]
    /// processes hold permits of this task at once).
    #[error("too many processes of this host hold permits of this task")]
    TooManyHolders,
    /// [`Task::permit`] waited [`crate::Config::acquire_timeout`] (or the given timeout).
    #[error("timed out waiting for a permit")]
    Timeout,
}

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

fn my_id(seg: &Segment) -> u64 {
    let me = seg.me();
    ((me.participant as u64) << 48) | ((me.generation as u64) << 32)
}

/// Adds one permit to this process's holder entry (claiming one if needed).
fn holder_add(seg: &Segment, k: &ConcCells) -> bool {
    let id = my_id(seg);
    for h in &k.holders {
        let w = h.load(Ordering::Acquire);
        if w != 0 && w & !IN_USE == id {
            h.fetch_add(1, Ordering::AcqRel);
            return true;
        }
    }
    k.holders.iter().any(|h| {
        h.load(Ordering::Relaxed) == 0
            && h.compare_exchange(0, id | 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    })
}

/// Takes one permit off this process's holder entry; false if it has none (it was reclaimed).
fn holder_sub(seg: &Segment, k: &ConcCells) -> bool {
    let id = my_id(seg);
    for h in &k.holders {
        let mut w = h.load(Ordering::Acquire);
        while w != 0 && w & !IN_USE == id && w & IN_USE > 0 {
            match h.compare_exchange_weak(w, w - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(x) => w = x,
            }
        }
    }
    false
}

/// Lowers `in_use` by `n` (never below 0).
fn sub_in_use(k: &ConcCells, n: u64) {
    let _ = k
        .permits
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            let (l, u) = unpack(w);
            Some(pack(l, u.saturating_sub(n)))
        });
}

/// Sets `limit`, keeping `in_use`.
fn set_limit(k: &ConcCells, limit: u64) {
    let _ = k
        .permits
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            Some(pack(limit, unpack(w).1))
        });
}

/// Releases one permit of this process: its holder entry first, then the host's count (a
/// crash in between strands one permit, never hands out one too many).
pub fn release(seg: &Segment, k: &ConcCells) {
    if holder_sub(seg, k) {
        sub_in_use(k, 1);
    }
}

/// Gives the permits of dead processes back to the host; returns how many.
pub fn reclaim_dead(seg: &Segment, k: &ConcCells) -> u64 {
    let mut total = 0;
    for h in &k.holders {
        let w = h.load(Ordering::Acquire);
        if w == 0 {
            continue;
        }
        let holder = Holder {
            participant: (w >> 48) as u16,
            generation: (w >> 32) as u16,
        };
        if seg.alive(holder) {
            continue;
        }
        if h.compare_exchange(w, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let n = w & IN_USE;
            if n > 0 {
                sub_in_use(k, n);
                total += n;
            }
        }
    }
    if total > 0 {
        k.reclaimed.fetch_add(total, Ordering::Relaxed);
    }
    total
}

/// The decision of [`Task::try_permit`] on the host's cells (pure: no network, no clock but
/// `clock`, which is read before the swap and again after it): takes one permit for the
/// calling process (`seg`'s participant) and answers whether it is a FAILED-path
/// (`on_failure`) permit. A refusal counts as demand (`denied`).
pub fn take(seg: &Segment, k: &ConcCells, clock: impl Fn() -> i64) -> Result<bool, PermitError> {
    let regime = k.regime.load(Ordering::Acquire);
    let fallback = regime != REGIME_LEASE;
    let res = match regime {
        REGIME_DENY => Err(PermitError::Failed),
        REGIME_ALLOW => k
            .permits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                let (l, u) = unpack(w);
                (u < IN_USE).then(|| pack(l, u + 1))
            })
            .map(|_| ())
            .map_err(|_| PermitError::Full),
        _ => {
            let leased = regime == REGIME_LEASE;
            if leased && clock() >= k.valid_until_ms.load(Ordering::Acquire) {
                Err(PermitError::NoLease)
            } else {
                // Under a lease, `bound` (min(holding, cap − others) of the reply applied
                // last, lowered to `want` while a call runs) binds too: it is what Redis is
                // sure to count for the host even if `limit` was written by a late answer.
                // After a threshold decrease cap − others binds until in flight here has
                // fallen below it.
                let bound = if leased {
                    bound_of(k.bound.load(Ordering::Acquire))
                } else {
                    u64::MAX
                };
                let r = k
                    .permits
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                        let (l, u) = unpack(w);
                        (u < l && u < bound).then(|| pack(l, u + 1))
                    })
                    .map(|w| unpack(w).1 + 1)
                    .map_err(|_| {
                        if leased {
                            PermitError::Full
                        } else {
                            PermitError::Failed
                        }
                    });
                // Re-check after the swap: a process stopped between the first check and
                // the swap must not hand out a permit of a lease that lapsed meanwhile, nor
                // one above a bound a LEASE call lowered meanwhile.
                match r {
                    Ok(_)
                        if leased
                            && (k.regime.load(Ordering::Acquire) != REGIME_LEASE
                                || clock() >= k.valid_until_ms.load(Ordering::Acquire)) =>
                    {
                        sub_in_use(k, 1);
                        Err(PermitError::NoLease)
                    }
                    Ok(after) if leased && after > bound_of(k.bound.load(Ordering::Acquire)) => {
                        sub_in_use(k, 1);
                        Err(PermitError::Full)
                    }
                    Ok(_) => Ok(()),
                    Err(e) => Err(e),
                }
            }
        }
    };
    if let Err(e) = res {
        k.denied.fetch_add(1, Ordering::Relaxed);
        return Err(e);
    }
    if !holder_add(seg, k) {
        // Entries of processes that exited without permits are freed by the scan only
        // while permits are in use: free them now and try once more.
        reclaim_dead(seg, k);
        if !holder_add(seg, k) {
            sub_in_use(k, 1);
            return Err(PermitError::TooManyHolders);
        }
    }
    k.granted.fetch_add(1, Ordering::Relaxed);
    Ok(fallback)
}

/// This host's view of a concurrency task (from the segment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PermitStats {
    /// Permits in use on this host now.
    pub in_use: u64,
    /// Permits the host may hand out (its leased block, or `local_limit` while FAILED).
    pub limit: u64,
    /// Callers waiting in [`Task::permit`] now.
    pub waiting: u64,
    /// The threshold from the last LEASE reply.
    pub cap: u64,
    /// Other hosts' permits from the last LEASE reply.
    pub others: u64,
    /// Whether the host holds a valid lease now.
    pub leased: bool,
    /// Whether the host is FAILED (deciding by `on_failure`).
    pub failed: bool,
    /// Times the lease lapsed on this host.
    pub lapses: u64,
    /// Permits of dead processes given back to the host.
    pub reclaimed: u64,
    /// Permits handed out on this host, ever.
    pub granted: u64,
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

fn stats(k: &ConcCells) -> PermitStats {
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

fn regime_for(on_failure: OnFailure) -> u64 {
    match on_failure {
        OnFailure::Local => REGIME_LOCAL,
        OnFailure::Allow => REGIME_ALLOW,
        OnFailure::Deny => REGIME_DENY,
    }
}

/// What the leasing decisions need of a task's meta.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseParams {
    /// What decides while the host holds no lease and Redis does not answer.
    pub on_failure: OnFailure,
    /// Permits in flight on this host while FAILED with `on_failure = local`.
    pub local_limit: u64,
    /// The threshold of the meta, the cap until a LEASE reply tells it.
    pub threshold: u64,
}

impl LeaseParams {
    fn of(slot: &Slot, m: &FastMeta) -> Self {
        Self {
            on_failure: m.on_failure,
            local_limit: slot.meta.local_limit.load(Ordering::Relaxed),
            threshold: slot.meta.threshold.load(Ordering::Relaxed),
        }
    }
}

/// FAILED, once the lease has lapsed: `on_failure` decides from now on.
fn fail(k: &ConcCells, p: &LeaseParams, now: i64) {
    if now < k.valid_until_ms.load(Ordering::Acquire) {
        // The lease is still good: keep handing out under it while retrying.
        return;
    }
    let regime = regime_for(p.on_failure);
    if regime == REGIME_LOCAL {
        set_limit(k, p.local_limit);
    }
    if k.regime.swap(regime, Ordering::AcqRel) == REGIME_LEASE {
        tracing::warn!(on_failure = %p.on_failure,
            "concurrency lease lost and Redis unreachable: FAILED, deciding by on_failure");
    }
}

/// The bookkeeping of a background round before any call (pure: the host's cells and `now`,
/// boot-clock ms): counts a lapsed lease once, and answers whether a LEASE call is due now
/// (renewal, growth for callers that wait, or a retry while FAILED).
pub fn round_due(k: &ConcCells, now: i64) -> bool {
    let (limit, in_use) = unpack(k.permits.load(Ordering::Acquire));
    let regime = k.regime.load(Ordering::Acquire);
    let valid_until = k.valid_until_ms.load(Ordering::Acquire);
    if regime == REGIME_LEASE && valid_until != 0 && now >= valid_until {
        // Lapsed: count it once.
        if k.valid_until_ms
            .compare_exchange(valid_until, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
            && limit > 0
        {
            k.lapses.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "concurrency lease lapsed (renewal failed past the safety margin): no permits \
                 are handed out until a new lease is held"
            );
        }
    }
    let waiting = k.waiting.load(Ordering::Acquire);
    let denied = k.denied.load(Ordering::Relaxed);
    let denied_new = denied.saturating_sub(k.denied_seen.load(Ordering::Relaxed));
    let demand = waiting > 0 || denied_new > 0;
    let lease_ms = match k.lease_ms.load(Ordering::Relaxed) {
        0 => DEFAULT_LEASE_MS,
        v => v,
    };
    let sent_ok = k.sent_ok_ms.load(Ordering::Relaxed);
    let holds = limit > 0 || in_use > 0 || regime != REGIME_LEASE;
    let renew_due = holds && (sent_ok == 0 || now - sent_ok >= (lease_ms / 4) as i64);
    let cap = k.cap.load(Ordering::Relaxed);
    // With demand, ask again when the last answer left room to grow, and in any case every
    // quarter TTL: the cap of the last answer may be stale (a host that holds nothing never
    // renews, and one told "cap 0" would otherwise never learn of a raised threshold).
    let stale = now - sent_ok >= (lease_ms / 4) as i64;
    let grow_due = demand
        && (sent_ok == 0 || limit < cap || regime != REGIME_LEASE || stale)
        && now >= k.grow_after_ms.load(Ordering::Relaxed);
    (renew_due || grow_due) && now >= k.next_try_ms.load(Ordering::Relaxed)
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

/// A lease lock held longer than this is taken over (its holder is stuck): three pull
/// timeouts, three times the longest a LEASE call may take.
pub fn lease_lock_timeout_ms(pull_timeout: std::time::Duration) -> u64 {
    (pull_timeout.as_millis() as u64).saturating_mul(3)
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

/// The clocks a leasing round reads: the boot clock (lease validity, ms) and the host's
/// wall clock (the lease lock's age, ms; sequence numbers, µs). A model passes its own.
pub trait Clocks {
    /// `CLOCK_BOOTTIME`, ms.
    fn boot_ms(&self) -> i64;
    /// `CLOCK_REALTIME`, µs.
    fn host_us(&self) -> i64;
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

/// One LEASE call under the host's lease lock: takes the lock (`None` when a live holder has
/// it, younger than `lock_timeout_ms`), plans the call ([`begin_call`]), runs `send`, applies
/// the outcome ([`finish_call`], only while the lock is still this caller's) and unlocks.
/// `denied`: the host's refusals, read before.
pub async fn locked_call<C, F, Fut>(
    seg: &Segment,
    k: &ConcCells,
    p: &LeaseParams,
    clocks: &C,
    lock_timeout_ms: u64,
    denied: u64,
    send: F,
) -> Option<Finished>
where
    C: Clocks + ?Sized,
    F: FnOnce(LeaseCall) -> Fut,
    Fut: std::future::Future<Output = LeaseOutcome>,
{
    let lock = seg.lock(&k.lease_lock);
    let token = match lock.try_lock(clocks.host_us().div_euclid(1_000), lock_timeout_ms) {
        LockAttempt::Acquired { token, .. } => token,
        LockAttempt::Busy { .. } => return None,
    };
    let call = begin_call(k, p, denied, clocks.boot_ms(), clocks.host_us());
    let outcome = send(call).await;
    let done = finish_call(k, p, &call, outcome, clocks.boot_ms(), lock.holds(token));
    lock.unlock(token);
    Some(done)
}

/// A LEASE call planned by [`begin_call`]: send `want` with `seq`, then hand the outcome to
/// [`finish_call`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCall {
    /// The absolute number of permits to ask for.
    pub want: u64,
    /// The call's sequence number (strictly increasing per host).
    pub seq: u64,
    /// Boot-clock ms when the call was planned, before it was sent: the lease it wins is
    /// valid from here.
    pub t0: i64,
    /// The host's refusals counted when the call was planned (its demand).
    pub denied: u64,
    /// The local limit when the call was planned.
    pub limit: u64,
}

/// What became of a LEASE call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// Redis answered.
    Reply(LeaseReply),
    /// An error or a timeout: the call may or may not have run.
    Failed,
}

/// Plans a LEASE call (pure: the host's cells, `now` on the boot clock and `host_us`, the
/// host's clock in µs for the sequence number), by the holder of the host's lease lock:
/// sizes the block from demand ([`target`]), lowers the local limit first when the call
/// shrinks the block, and draws the call's sequence number.
pub fn begin_call(
    k: &ConcCells,
    p: &LeaseParams,
    denied: u64,
    now: i64,
    host_us: i64,
) -> LeaseCall {
    let (limit, in_use) = unpack(k.permits.load(Ordering::Acquire));
    let waiting = k.waiting.load(Ordering::Acquire);
    let denied_new = denied.saturating_sub(k.denied_seen.load(Ordering::Relaxed));
    let cap = match k.cap.load(Ordering::Relaxed) {
        0 => p.threshold,
        c => c,
    };
    let others = k.others.load(Ordering::Relaxed);
    let leased = k.regime.load(Ordering::Acquire) == REGIME_LEASE;
    let mut want = target(
        in_use,
        if leased { limit } else { in_use },
        waiting,
        denied_new,
        cap,
        others,
        k.others_unmet.load(Ordering::Relaxed),
    );
    if leased && want < limit {
        // Shrink locally first: never more handed out than Redis will believe we hold.
        let r = k
            .permits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                let (_, u) = unpack(w);
                Some(pack(want.max(u), u))
            });
        let (Ok(w) | Err(w)) = r;
        want = want.max(unpack(w).1);
    }
    // The sequence number, drawn in one atomic step: calls are ordered by it in Redis (an
    // older one arriving late is refused) and here (only the answer to the newest call begun
    // is applied), so both orders agree even when two processes both believe they hold the
    // lease lock (one was stalled past the lock's timeout).
    let host_us = host_us.max(0) as u64;
    let prev = k
        .seq
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |prev| {
            Some((prev + 1).max(host_us))
        });
    let (Ok(prev) | Err(prev)) = prev;
    let seq = (prev + 1).max(host_us);
    // Until its answer is applied, hand out no more than the call asks for: whatever Redis
    // does with it (or with an older call still on its way), it then counts at least
    // min(what it counted, want) for the host, and `bound` never exceeded what it counted.
    let _ = k
        .bound
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
            Some(bound_word(b, bound_of(b).min(want)))
        });
    LeaseCall {
        want,
        seq,
        t0: now,
        denied,
        limit,
    }
}

/// What [`finish_call`] did with an outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// The host holds the lease the reply granted.
    Applied,
    /// Redis refused the call as older than one it already ran (nothing changed there).
    Stale,
    /// The task is unknown to Redis, or the call failed: FAILED once the lease lapses.
    Failed,
    /// Ignored: the caller lost the lease lock, or a newer call has begun since; its answer
    /// decides.
    Superseded,
}

/// Applies the outcome of a LEASE call planned by [`begin_call`] (pure: the host's cells and
/// `now`, boot-clock ms after the answer came), if it is still the host's latest call and the
/// caller still holds the lease lock (`holds_lock`).
///
/// A process stalled past the lease lock's timeout (SIGSTOP, a VM pause, a starved thread)
/// may come back with the answer to a call that another process has since superseded: a
/// newer call may have given the permits back, and the threshold may have been lowered.
/// Applying the old answer would raise the host's limit above what Redis counts for it. So an
/// answer is applied only when no newer call has begun (`seq`) and its `bound` is written by
/// one compare-and-swap against the word read *before* that check: a call that begins after
/// the check bumps the word's generation, and the swap fails.
pub fn finish_call(
    k: &ConcCells,
    p: &LeaseParams,
    call: &LeaseCall,
    outcome: LeaseOutcome,
    now: i64,
    holds_lock: bool,
) -> Finished {
    let b0 = k.bound.load(Ordering::Acquire);
    if !holds_lock || k.seq.load(Ordering::Acquire) != call.seq {
        tracing::debug!(
            seq = call.seq,
            "LEASE answer ignored: a newer call has begun or the lease lock was taken over"
        );
        return Finished::Superseded;
    }
    match outcome {
        LeaseOutcome::Reply(LeaseReply::Held {
            holding,
            cap,
            others,
            lease_ms,
            others_unmet,
            ..
        }) => {
            let bound = holding.min(cap.saturating_sub(others));
            if k.bound
                .compare_exchange(
                    b0,
                    bound_word(b0, bound),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
            {
                tracing::debug!(
                    seq = call.seq,
                    "LEASE answer ignored: a newer call has begun"
                );
                return Finished::Superseded;
            }
            let t0 = call.t0;
            let lease_ms = lease_ms.max(1);
            k.others_unmet.store(others_unmet, Ordering::Relaxed);
            set_limit(k, holding);
            k.cap.store(cap, Ordering::Relaxed);
            k.others.store(others, Ordering::Relaxed);
            k.lease_ms.store(lease_ms, Ordering::Relaxed);
            k.sent_ok_ms.store(t0, Ordering::Relaxed);
            k.denied_seen.store(call.denied, Ordering::Relaxed);
            k.failing_since_ms.store(0, Ordering::Relaxed);
            k.next_try_ms.store(0, Ordering::Relaxed);
            let until = t0 + valid_for_ms(lease_ms);
            k.valid_until_ms.fetch_max(until, Ordering::AcqRel);
            if k.regime.swap(REGIME_LEASE, Ordering::AcqRel) != REGIME_LEASE {
                tracing::info!("concurrency lease held again: back from FAILED");
            }
            let grew = holding > call.limit || holding >= call.want;
            let pause = ((lease_ms / 10) as i64).max(GROW_RETRY_MIN_MS);
            k.grow_after_ms
                .store(if grew { 0 } else { now + pause }, Ordering::Relaxed);
            Finished::Applied
        }
        LeaseOutcome::Reply(LeaseReply::Stale { .. }) => {
            // Another call of this host had a higher sequence number (a clock step back):
            // the next call's seq is above it.
            tracing::debug!("LEASE refused as stale; retrying with a higher sequence number");
            Finished::Stale
        }
        LeaseOutcome::Reply(LeaseReply::Unknown) => {
            k.next_try_ms
                .store(now + FAILED_RETRY_MS, Ordering::Relaxed);
            fail(k, p, now);
            Finished::Failed
        }
        LeaseOutcome::Failed => {
            let _ =
                k.failing_since_ms
                    .compare_exchange(0, now, Ordering::AcqRel, Ordering::Relaxed);
            k.next_try_ms
                .store(now + FAILED_RETRY_MS, Ordering::Relaxed);
            fail(k, p, now);
            Finished::Failed
        }
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
