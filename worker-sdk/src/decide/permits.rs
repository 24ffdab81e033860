//! Mode `concurrency`, the pure core: the permit word, handing out and giving back permits,
//! reclaiming the permits of dead processes, and a leasing round's plan and how its answer is
//! applied. Functions of the shared cells, the meta and the time passed in: no Redis, no
//! thread, no clock read of their own (`crate::refill::permits` calls them).

use std::sync::atomic::Ordering;

use crate::protocol::OnFailure;
use crate::protocol::lease::LeaseReply;
use crate::shm::{ConcCells, FastMeta, Holder, LockAttempt, Segment, Slot};

#[cfg(doc)]
use crate::Task;

/// How often a host looks for permits of dead processes (while any are in use).
pub const SCAN_MS: i64 = 20;

/// Shortest pause before growing again after a LEASE that could not grow the block.
pub const GROW_RETRY_MIN_MS: i64 = 200;

/// Pause between LEASE attempts while they fail.
pub const FAILED_RETRY_MS: i64 = 100;

/// Lease TTL assumed before the first reply (the meta's `lease_ms` when known).
pub const DEFAULT_LEASE_MS: u64 = 10_000;

pub(crate) const REGIME_LEASE: u64 = 0;

pub(crate) const REGIME_LOCAL: u64 = 1;

pub(crate) const REGIME_ALLOW: u64 = 2;

pub(crate) const REGIME_DENY: u64 = 3;

pub(crate) const IN_USE: u64 = 0xFFFF_FFFF;

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
    pub(crate) fn of(slot: &Slot, m: &FastMeta) -> Self {
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

/// A lease lock held longer than this is taken over (its holder is stuck): three pull
/// timeouts, three times the longest a LEASE call may take.
pub fn lease_lock_timeout_ms(pull_timeout: std::time::Duration) -> u64 {
    (pull_timeout.as_millis() as u64).saturating_mul(3)
}

/// The clocks a leasing round reads: the boot clock (lease validity, ms) and the host's
/// wall clock (the lease lock's age, ms; sequence numbers, µs). A model passes its own.
pub trait Clocks {
    /// `CLOCK_BOOTTIME`, ms.
    fn boot_ms(&self) -> i64;
    /// `CLOCK_REALTIME`, µs.
    fn host_us(&self) -> i64;
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
