//! Mode `pooled`, the refill side: when a decision asked for quota (or the next slice needs
//! some), one PULL under the host's pull lock, sized by `crate::pull`, its grant deposited into
//! the slice's quota word and its outcome applied to the task's state; probes while FAILED.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::ctx::{Shared, TaskInner};
use crate::plumbing::{Retry, apply_health, call, outside_window, record_clock};
use crate::protocol::scripts::{self, PullReply, PullRequest};
use crate::pull::{self, PullInput};
use crate::refill::lock;
use crate::shm::{FastMeta, Slot, SlotRef, tag_of, unpack_quota};
use crate::state::{Health, PullOutcome};

/// The pooled-mode round: probe, refill, prefetch. True when something is still pending.
pub(crate) async fn pooled(
    sh: &Shared,
    t: &TaskInner,
    slot: &Slot,
    r: SlotRef,
    m: &FastMeta,
    now_us: i64,
) -> bool {
    let slice_ms = m.slice_ms;
    let slice_us = (slice_ms * 1_000) as i64;
    let index = (now_us.max(0) / slice_us) as u64;
    let start = (index * slice_ms) as i64;
    let next = start + slice_ms as i64;
    let now_ms = now_us / 1_000;
    let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
    let demand = slot.ctl.want.load(Ordering::Acquire) == start as u64 + 1;
    if let Health::Failed { .. } = health {
        let due = slot.ctl.next_probe_ms.load(Ordering::Acquire);
        if !sh.machine.probe_due(health, due, now_ms) {
            return false;
        }
        let claim = now_ms + sh.machine.probe_interval_ms;
        if slot
            .ctl
            .next_probe_ms
            .compare_exchange(due, claim, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let Some(token) = lock(sh, slot, now_ms) else {
            return true;
        };
        pull(sh, t, slot, r, m, start, demand).await;
        sh.seg.lock(&slot.ctl.pull_lock).unlock(token);
        return false;
    }
    // A slice Redis said has not started yet, or whose grant was dropped: no pull for it.
    let held_off = |slot: &Slot, s: i64| {
        t.dropped_start.load(Ordering::Relaxed) == s
            || (slot.ctl.early_start.load(Ordering::Acquire) == s
                && crate::clock::host_ms() < slot.ctl.early_until_ms.load(Ordering::Acquire))
    };
    let holds = |slot: &Slot, s: i64| {
        let w = slot.entry(s, slice_ms).word.load(Ordering::Acquire);
        (w != 0 && unpack_quota(w).0 == tag_of(s)).then(|| unpack_quota(w))
    };
    let need_cur = |slot: &Slot| {
        // The low-water mark was sized at the last deposit; a decision asking for more than
        // the stock since then (a larger cost) needs a pull as well, or it would wait for the
        // next slice with the quota still in Redis (found by tests/tests/pooled_model.rs).
        let low = slot
            .entry(start, slice_ms)
            .low_water
            .load(Ordering::Relaxed)
            .max(slot.ctl.max_n.load(Ordering::Relaxed));
        demand
            && !held_off(slot, start)
            && match holds(slot, start) {
                Some((_, exhausted, c)) => !exhausted && (c as u64) < low,
                None => true,
            }
    };
    let rtt_ms = slot.ctl.rtt_us.load(Ordering::Relaxed) as f64 / 1_000.0;
    let left_ms = (next * 1_000 - now_us) as f64 / 1_000.0;
    let need_next = |slot: &Slot| {
        left_ms <= pull::prefetch_lead_ms(slice_ms, rtt_ms)
            && (demand || slot.consumed(start, slice_ms) > 0)
            && holds(slot, next).is_none()
            && !held_off(slot, next)
    };
    if !need_cur(slot) && !need_next(slot) {
        return false;
    }
    let Some(token) = lock(sh, slot, now_ms) else {
        return true;
    };
    // Another process may have refilled while we waited for the lock.
    if need_cur(slot) {
        pull(sh, t, slot, r, m, start, true).await;
    }
    if need_next(slot) && Health::decode(slot.ctl.state.load(Ordering::Acquire)) == Health::Normal {
        pull(sh, t, slot, r, m, next, true).await;
    }
    sh.seg.lock(&slot.ctl.pull_lock).unlock(token);
    need_cur(slot)
}

/// One PULL for the slice starting at `start_ms` (the current one, or the next when
/// prefetching); call under the pull lock.
async fn pull(
    sh: &Shared,
    t: &TaskInner,
    slot: &Slot,
    r: SlotRef,
    m: &FastMeta,
    start_ms: i64,
    demand: bool,
) {
    let slice_ms = m.slice_ms;
    let now_us = sh.now_us();
    let now_ms = now_us / 1_000;
    let current = now_ms >= start_ms;
    let cap = match slot.ctl.cap.load(Ordering::Relaxed) {
        0 => slot.meta.threshold.load(Ordering::Relaxed),
        c => c,
    };
    let this_slice = if current {
        start_ms
    } else {
        start_ms - slice_ms as i64
    };
    let consumed_now = slot.consumed(this_slice, slice_ms);
    let elapsed_ms = (now_us as f64 / 1_000.0 - start_ms as f64).max(0.0);
    let input = PullInput {
        fixed: slot.meta.pull.load(Ordering::Relaxed),
        cap,
        slice_ms,
        elapsed_ms,
        consumed: if current { consumed_now } else { 0 },
        demand_prev: if current {
            slot.ctl.demand_prev.load(Ordering::Relaxed)
        } else {
            // Prefetch: what this slice is using is the best guess for the next.
            consumed_now.max(slot.ctl.demand_prev.load(Ordering::Relaxed))
        },
        rtt_ms: slot.ctl.rtt_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        max_n: slot.ctl.max_n.load(Ordering::Relaxed),
    };
    let mut plan = pull::plan(&input);
    if m.paced {
        plan = pull::paced(plan, cap, slice_ms, input.max_n);
    }
    let want = if demand { plan.want } else { 0 };
    if want > 0 && input.max_n > 0 {
        // The largest cost asked sizes this pull, and only this one: a caller still waiting
        // for that much asks again when it decides next (`Task::want`), while one request of
        // a large cost long ago no longer makes this host pull (and strand) whole slices.
        let _ =
            slot.ctl
                .max_n
                .compare_exchange(input.max_n, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
    let request_id = sh.request_id();
    let req = PullRequest {
        task: &t.name,
        start_ms,
        slice_ms,
        want,
        host_id: &sh.cfg.host_id,
        request_id: &request_id,
        counters: None,
    };
    let before = crate::clock::host_us();
    let started = Instant::now();
    // A retry (same request id) is answered with the first attempt's grant.
    let res = call(sh, Retry::Idempotent, |mut c| async move {
        scripts::pull(&mut c, &sh.keys, &req).await
    })
    .await;
    let rtt = started.elapsed();
    // The cap this reply was granted under (the pace numbering's curve), not the shared
    // `ctl.cap` another process's reply may have changed meanwhile.
    let mut reply_cap = 0u64;
    let outcome = match res {
        Err(_) => PullOutcome::Timeout,
        Ok(Err(e)) => {
            tracing::debug!(task = %t.name, error = %e, "pull failed");
            PullOutcome::Error
        }
        Ok(Ok(PullReply::Missing { redis_time_us })) => {
            record_clock(sh, before, crate::clock::host_us(), redis_time_us);
            PullOutcome::Missing
        }
        Ok(Ok(PullReply::OutsideWindow { redis_time_us })) => {
            record_clock(sh, before, crate::clock::host_us(), redis_time_us);
            let wait_ms = outside_window(sh, t, start_ms, slice_ms, redis_time_us);
            if redis_time_us / 1_000 > start_ms + slice_ms as i64 {
                // Over: LIMITED for this slice (nothing left to spend, no more pulls).
                if slot.generation() == r.generation {
                    slot.deposit(start_ms, slice_ms, 0, true, sh.now_us());
                }
            } else {
                slot.ctl
                    .early_until_ms
                    .store(crate::clock::host_ms() + wait_ms, Ordering::Release);
                slot.ctl.early_start.store(start_ms, Ordering::Release);
            }
            PullOutcome::OutsideWindow
        }
        Ok(Ok(PullReply::Granted {
            granted,
            remaining,
            cap,
            redis_time_us,
            replayed,
        })) => {
            record_clock(sh, before, crate::clock::host_us(), redis_time_us);
            reply_cap = cap;
            slot.ctl.cap.store(cap, Ordering::Relaxed);
            slot.ctl.remaining.store(remaining, Ordering::Relaxed);
            slot.ctl
                .rtt_us
                .store(rtt.as_micros() as u64, Ordering::Relaxed);
            if replayed {
                tracing::debug!(task = %t.name, granted, "pull retried: first attempt's grant");
            }
            PullOutcome::Granted { granted, remaining }
        }
    };
    let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
    let tr = sh.machine.after_pull(health, outcome, now_ms);
    if let PullOutcome::Granted { granted, .. } = outcome
        && (granted > 0 || tr.exhausted)
    {
        // Never into a slot reclaimed for another task meanwhile; a fresh now decides whether
        // the slice has ended.
        let own = slot.generation() == r.generation;
        if own && let PullOutcome::Granted { remaining, .. } = outcome {
            // Before the deposit, so no decision sees the new stock with an older (lower)
            // number: a paced decision only ever errs towards waiting. The cap also bounds
            // every decision's cost (a larger one is LIMITED and sizes no pull), paced or not.
            let cap = reply_cap;
            let e = slot.entry(start_ms, slice_ms);
            // The top of the numbering only grows within a slice: a reply applied late (a
            // pull whose lock was taken over while it stalled) must not lower it, or the host
            // would number its stock below what it holds (the review of issue 23). The cap of
            // the pace curve only grows within a slice too: stock granted under a cap that a
            // dynamic cut lowered mid-slice is spent on the curve it was granted under (with
            // the lower cap its numbers lay above the cap and went unpaced at once), and a
            // raise paces at the new cap from the first reply that carries it.
            let top = (cap as i64 - remaining).max(0) as u64;
            let (t, _, _) = crate::shm::unpack_quota(e.word.load(Ordering::Acquire));
            let ended = start_ms.saturating_add(slice_ms as i64) <= sh.now_us().div_euclid(1_000);
            if t == crate::shm::tag_of(start_ms) {
                e.pace_cap.fetch_max(cap, Ordering::AcqRel);
                e.pace_granted.fetch_max(top, Ordering::AcqRel);
            } else if !ended {
                // A slice not ended yet whose entry holds an older slice (or nothing): its
                // first grant here. A reply for an ended slice leaves the entry alone — it may
                // hold a newer slice's numbering (deposit drops that grant anyway).
                e.pace_cap.store(cap, Ordering::Relaxed);
                e.pace_granted.store(top, Ordering::Relaxed);
            }
        }
        if !own {
            tracing::debug!(task = %t.name, "slot reclaimed during a pull; grant dropped");
        } else if slot.deposit(start_ms, slice_ms, granted, tr.exhausted, sh.now_us()) {
            slot.entry(start_ms, slice_ms)
                .low_water
                .store(plan.low_water, Ordering::Relaxed);
        } else {
            // The slice ended while the pull was in flight: never pull for it again.
            t.dropped_start.store(start_ms, Ordering::Relaxed);
            tracing::debug!(task = %t.name, slice = start_ms, granted, "grant for an ended slice dropped");
        }
    }
    if tr.health != health || tr.next_probe_ms.is_some() {
        apply_health(t, slot, health, tr.health, tr.next_probe_ms);
    }
    t.deposited.notify_waiters();
    tracing::trace!(task = %t.name, start_ms, want, ?outcome, rtt_us = rtt.as_micros() as u64, "pull");
}
