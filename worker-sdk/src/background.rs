//! The client's background thread: everything that talks to Redis.
//!
//! One thread per [`crate::Client`] runs a single-threaded Tokio runtime. Each round (every
//! 10 ms, every 1 ms while a refill is pending or a caller waits, or at once when a decision
//! pokes it) it goes through the process's tasks:
//!
//! 1. **meta**: re-read `NS:{T}:meta` when the host's copy is older than `meta_refresh`
//!    (claimed by CAS on the slot's timestamp, so one process per host does it);
//! 2. **pull** (mode `pooled`): when a decision asked for quota and the local quota is below
//!    the low-water mark, or the slice is about to end and the next one has no quota yet, take
//!    the host's pull lock and run the PULL script ([`crate::pull`] sizes it); apply the
//!    result to the state machine ([`crate::state`]);
//! 3. **probe**: while FAILED, one pull per probe interval per host (claimed by CAS);
//! 4. **flush**: every `flush_interval` (host-wide), move admitted counts out of the quota
//!    accounting and send every slice's counters with one FLUSH call per task;
//! 5. **report**: every `host_report_interval` (host-wide), write this host's clock offset
//!    and task states to `NS:hosts`.
//!
//! Each round also refreshes the slot's `used_ms` (at most once a second) for every task this
//! process holds a handle for, re-claims a slot that was reclaimed under a stale handle, and
//! drops (after a last flush) the state of tasks no handle refers to any more.
//!
//! # Retries
//!
//! [`call`] retries a Redis call on a fresh connection when its first attempt fails at the
//! connection level or goes unanswered for half the pull timeout. That is only safe for calls
//! that are idempotent: meta reads, host reports, PULL (by request id) and FLUSH (by sequence
//! number). TAKE and SLIDE (exact modes) are retried only when the first attempt surely never
//! reached Redis (no connection could be had, or it was refused); otherwise the decision goes
//! to the failure path (`on_failure`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::ctx::{FlushBatch, Shared, TaskInner};
use crate::plumbing::{Retry, apply_health, call, outside_window, record_clock};
use crate::protocol::scripts::{self, PullReply, PullRequest, SliceCounters};
use crate::protocol::{HostReport, Mode, TaskMeta, meta_field};
use crate::pull::{self, PullInput};
use crate::shm::{FastMeta, LockAttempt, ShmLock, Slot, SlotRef, tag_of, unpack_quota};
use crate::state::{Health, PullOutcome, view};

/// Round period when idle.
const IDLE_TICK: Duration = Duration::from_millis(10);
/// Round period while something is pending.
const BUSY_TICK: Duration = Duration::from_millis(1);
/// Meta re-read period while the meta is unknown.
const UNKNOWN_META_RETRY_MS: i64 = 200;
/// How often a process refreshes `used_ms` of the slots it holds handles for.
const TOUCH_MS: i64 = 1_000;

pub(crate) fn spawn(
    shared: Arc<Shared>,
    rt: tokio::runtime::Runtime,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("sluice-bg".into())
        .spawn(move || rt.block_on(run(shared)))
}

async fn run(sh: Arc<Shared>) {
    tokio::spawn(crate::refill::keys::pump(sh.clone()));
    loop {
        let stopping = sh.stop.load(Ordering::Acquire);
        let (tasks, unused) = {
            let mut list = sh.tasks.lock().unwrap_or_else(|e| e.into_inner());
            // Only the list refers to it: no handle is left.
            let unused = if list.iter().any(|t| Arc::strong_count(t) == 1) {
                let (unused, kept): (Vec<_>, Vec<_>) =
                    list.drain(..).partition(|t| Arc::strong_count(t) == 1);
                *list = kept;
                unused
            } else {
                Vec::new()
            };
            (list.clone(), unused)
        };
        for t in &unused {
            // The last flush of a task this process no longer uses.
            step(&sh, t, true).await;
            tracing::debug!(task = %t.name, "no handle left; dropped the task's state");
        }
        drop(unused);
        let (busy, keys_busy) = futures::future::join(
            futures::future::join_all(tasks.iter().map(|t| step(&sh, t, stopping))),
            async {
                if stopping {
                    false
                } else {
                    crate::refill::keys::step(&sh).await
                }
            },
        )
        .await;
        if stopping {
            return;
        }
        report_host(&sh).await;
        let busy = busy.into_iter().any(|b| b)
            || keys_busy
            || tasks.iter().any(|t| t.waiters.load(Ordering::Acquire) > 0);
        drop(tasks);
        let tick = if busy { BUSY_TICK } else { IDLE_TICK };
        let slept = Instant::now();
        tokio::select! {
            _ = sh.wake.notified() => {}
            _ = tokio::time::sleep(tick) => {}
        }
        let late = slept.elapsed().saturating_sub(tick);
        if late > Duration::from_millis(100) {
            tracing::debug!(
                late_ms = late.as_millis() as u64,
                "background thread ran late"
            );
        }
    }
}

/// The task's slot, re-claimed if it was reclaimed for another task under this handle
/// (its generation changed); `None` when no slot can be had now.
fn own_slot<'a>(sh: &'a Shared, t: &TaskInner, stopping: bool) -> Option<(&'a Slot, u16)> {
    let r = t.slot_ref();
    let slot = sh.seg.slot(r.index)?;
    if slot.generation() == r.generation {
        let now = crate::clock::host_ms();
        if now - t.touched_ms.load(Ordering::Relaxed) >= TOUCH_MS {
            slot.touch(now);
            t.touched_ms.store(now, Ordering::Relaxed);
        }
        return Some((slot, r.generation));
    }
    if stopping {
        return None;
    }
    let Some(new) = sh.seg.claim(&t.name, sh.claim_options()) else {
        tracing::debug!(task = %t.name, "slot was reclaimed and no slot is free");
        return None;
    };
    tracing::info!(task = %t.name, old = r.index, new = new.index,
        "the task's segment slot was reclaimed while idle; claimed another");
    t.set_slot_ref(new);
    let slot = sh.seg.slot(new.index)?;
    Some((slot, new.generation))
}

/// One round for one task; true when it wants the next round soon. Whatever the round found,
/// callers waiting for the task (`permit_timeout`, `acquire`) are woken to decide again and
/// check their deadline: a round that returns early (no slot, the meta forgotten because the
/// task was deleted) used to leave them waiting forever, past their timeout (issue 23, found
/// by the soak, seed 1014: a deleted concurrency task's loadgen never stopped).
async fn step(sh: &Shared, t: &TaskInner, stopping: bool) -> bool {
    let busy = step_inner(sh, t, stopping).await;
    // At most every WAITER_WAKE_MS: a woken waiter pokes the background thread, whose next
    // round would wake it again at once — two threads spinning for as long as it waits (the
    // review of issue 23 measured it on a deleted concurrency task's `permit_timeout` loop).
    if t.waiters.load(Ordering::Acquire) > 0 {
        let now = crate::clock::host_ms();
        let last = t.woken_ms.load(Ordering::Relaxed);
        if now - last >= WAITER_WAKE_MS
            && t.woken_ms
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            t.deposited.notify_waiters();
        }
    }
    busy
}

/// How often the background thread wakes a task's waiters whatever its rounds found, ms (so a
/// waiter checks its deadline at least this often even when nothing is deposited).
pub(crate) const WAITER_WAKE_MS: i64 = 10;

async fn step_inner(sh: &Shared, t: &TaskInner, stopping: bool) -> bool {
    t.poked.store(false, Ordering::Release);
    let Some((slot, generation)) = own_slot(sh, t, stopping) else {
        return false;
    };
    let r = SlotRef {
        index: t.slot_ref().index,
        generation,
    };
    if !stopping {
        refresh_meta(sh, t, slot, generation, sh.now_us() / 1_000).await;
    }
    let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
        return false;
    };
    if m.generation != generation {
        return false;
    }
    let busy = if m.mode == Mode::Pooled && !stopping {
        pooled(sh, t, slot, r, &m, sh.now_us()).await
    } else if m.mode == Mode::Concurrency && !stopping {
        crate::refill::permits::step(sh, slot, &m).await
    } else if m.mode == Mode::Concurrency {
        crate::refill::permits::give_back(sh, slot, &m).await;
        false
    } else {
        false
    };
    if t.waiters.load(Ordering::Acquire) > 0 {
        t.deposited.notify_waiters();
    }
    flush(sh, t, slot, generation, sh.now_us(), stopping).await;
    busy
}

async fn refresh_meta(sh: &Shared, t: &TaskInner, slot: &Slot, generation: u16, now_ms: i64) {
    let cells = &slot.meta;
    let last = cells.refreshed_ms.load(Ordering::Acquire);
    let known = FastMeta::decode(cells.fast.load(Ordering::Acquire)).is_some();
    let period = if known {
        sh.cfg.meta_refresh.as_millis() as i64
    } else {
        UNKNOWN_META_RETRY_MS
    };
    if now_ms - last < period && now_ms >= last {
        return;
    }
    if cells
        .refreshed_ms
        .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    let key = sh.keys.meta(&t.name);
    let res = call(sh, Retry::Idempotent, |mut c| {
        let key = key.clone();
        async move {
            redis::cmd("HGETALL")
                .arg(&key)
                .query_async::<Vec<(String, String)>>(&mut c)
                .await
        }
    })
    .await;
    let outcome = match res {
        Err(_) => PullOutcome::Timeout,
        Ok(Err(e)) => {
            tracing::debug!(task = %t.name, error = %e, "meta read failed");
            PullOutcome::Error
        }
        Ok(Ok(pairs)) => {
            if pairs.iter().any(|(k, _)| k == meta_field::RETIRED) {
                if known {
                    tracing::info!(task = %t.name, "task was deleted; forgetting its meta");
                    slot.clear_meta(generation);
                }
            } else {
                match TaskMeta::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
                    Ok(mut meta) => {
                        // Key overrides are read by the KPULL script, not kept in the segment.
                        meta.key_overrides.clear();
                        cells.missing_since_ms.store(0, Ordering::Relaxed);
                        if slot.meta().as_ref() != Some(&meta) {
                            tracing::info!(task = %t.name, version = meta.version,
                                mode = %meta.mode, slice_ms = meta.slice_ms, "task meta loaded");
                            warn_if_newer_protocol(&t.name, &pairs);
                            slot.store_meta(&meta, generation);
                        }
                    }
                    Err(crate::protocol::MetaError::Missing) => {
                        // Empty: Redis lost it (or the task never existed). Keep what we know;
                        // the manager rewrites it within a tick.
                        let _ = cells.missing_since_ms.compare_exchange(
                            0,
                            now_ms,
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        );
                    }
                    Err(e) => {
                        tracing::warn!(task = %t.name, error = %e, "unreadable task meta");
                        warn_if_newer_protocol(&t.name, &pairs);
                    }
                }
            }
            return;
        }
    };
    // Redis is not usable: a NORMAL task goes FAILED now rather than at its next pull.
    let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
    if known && health == Health::Normal {
        let tr = sh.machine.after_pull(health, outcome, now_ms);
        apply_health(t, slot, health, tr.health, tr.next_probe_ms);
    }
}

/// The pooled-mode round: probe, refill, prefetch. True when something is still pending.
async fn pooled(
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

fn lock(sh: &Shared, slot: &Slot, now_ms: i64) -> Option<u64> {
    try_lock(sh, sh.seg.lock(&slot.ctl.pull_lock), "pull", now_ms)
}

fn try_lock(sh: &Shared, lock: ShmLock<'_>, what: &str, now_ms: i64) -> Option<u64> {
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

/// The next flush sequence number of this host: strictly increasing across the host's
/// processes (and across a re-created segment, being based on the host clock in µs).
fn next_flush_seq(sh: &Shared) -> u64 {
    let now = crate::clock::host_us().max(0) as u64;
    let prev = sh
        .seg
        .header()
        .flush_seq
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
            Some(p.saturating_add(1).max(now))
        })
        .unwrap_or(0);
    prev.saturating_add(1).max(now)
}

/// What became of a flush batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flushed {
    /// Redis counted it (or had already: a resent seq counts once).
    Done,
    /// No answer (timeout, connection lost): keep it and resend it with its seq.
    Lost,
    /// Redis answered with an error (an `HINCRBY` that would overflow, a value it cannot
    /// parse): resending it would fail the same way forever.
    Refused,
}

/// Sends one flush batch (a retry inside `call` reuses its seq).
async fn send_flush(sh: &Shared, t: &TaskInner, batch: &FlushBatch) -> Flushed {
    let (seq, counters) = batch;
    let res = call(sh, Retry::Idempotent, |mut c| async move {
        scripts::flush(&mut c, &sh.keys, &t.name, &sh.cfg.host_id, *seq, counters).await
    })
    .await;
    match res {
        Ok(Ok(_)) => Flushed::Done,
        Ok(Err(e))
            if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) =>
        {
            tracing::debug!(task = %t.name, error = %e, "flush refused by Redis");
            Flushed::Refused
        }
        _ => Flushed::Lost,
    }
}

/// Sends a batch; one Redis refuses is split into its slices, each sent alone with the same
/// seq (a slice the refused call already counted is recognised by its seq and not counted
/// again), and a slice refused alone is dropped: logged, counted in
/// [`crate::Client::flushes_dropped`], never resent. So one bad counter never stops the
/// counting of the task's other slices, nor of the slices after it. False: the answer was
/// lost (the caller keeps the batch and resends it).
async fn deliver(sh: &Shared, t: &TaskInner, batch: &FlushBatch) -> bool {
    match send_flush(sh, t, batch).await {
        Flushed::Done => return true,
        Flushed::Lost => return false,
        Flushed::Refused => {}
    }
    let (seq, counters) = batch;
    for one in counters {
        let single = (*seq, vec![*one]);
        let outcome = if counters.len() == 1 {
            Flushed::Refused
        } else {
            send_flush(sh, t, &single).await
        };
        match outcome {
            Flushed::Done => {}
            // Lost on the way: not resent (the batch is treated as delivered); the rare
            // counters lost here are what a lost flush always risked before its seq.
            Flushed::Lost => {
                sh.flushes_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(task = %t.name, slice = one.0,
                    "slice counters dropped: Redis did not answer their resend after refusing \
                     their batch");
            }
            Flushed::Refused => {
                sh.flushes_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(task = %t.name, slice = one.0, counters = ?one.1,
                    "slice counters dropped: Redis refused to add them (a counter would \
                     overflow, or a value out of range); the other slices are counted");
            }
        }
    }
    true
}

/// Moves admitted counts out of the quota accounting and sends every slice's counters with
/// one FLUSH, under the host's flush lock (a busy lock: another process is flushing; skip).
/// A batch whose answer was lost is kept and resent with its sequence number, so it counts
/// once whether or not the first attempt reached Redis.
async fn flush(sh: &Shared, t: &TaskInner, slot: &Slot, generation: u16, now_us: i64, force: bool) {
    let now_ms = now_us / 1_000;
    let last = slot.ctl.flushed_ms.load(Ordering::Acquire);
    if !force && now_ms - last < sh.cfg.flush_interval.as_millis() as i64 && now_ms >= last {
        return;
    }
    if slot
        .ctl
        .flushed_ms
        .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
        && !force
    {
        return;
    }
    // The last flush of a client waits for the locks: what it does not account now may never
    // be (the other processes of the host may be exiting too).
    let patience = if force { 200 } else { 0 };
    let flush_lock = sh.seg.lock(&slot.ctl.flush_lock);
    let mut flush_token = try_lock(sh, flush_lock, "flush", now_ms);
    for _ in 0..patience {
        if flush_token.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        flush_token = try_lock(sh, flush_lock, "flush", crate::clock::host_ms());
    }
    let Some(flush_token) = flush_token else {
        return;
    };
    let mut token = lock(sh, slot, now_ms);
    for _ in 0..patience {
        if token.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        token = lock(sh, slot, crate::clock::host_ms());
    }
    // Never drain another task's counters (the slot was reclaimed meanwhile).
    let own = slot.generation() == generation;
    if let Some(token) = token {
        if own {
            slot.account(now_ms);
        }
        sh.seg.lock(&slot.ctl.pull_lock).unlock(token);
    }
    let pending = t.pending_flush.lock().ok().and_then(|mut p| p.take());
    let mut resent = true;
    if let Some(batch) = pending
        && !deliver(sh, t, &batch).await
    {
        if let Ok(mut p) = t.pending_flush.lock() {
            *p = Some(batch);
        }
        resent = false;
    }
    if resent && own {
        let drained = slot.drain_counters();
        if !drained.is_empty() {
            let counters: Vec<(i64, SliceCounters)> = drained
                .iter()
                .map(|(start, v)| {
                    (
                        *start,
                        SliceCounters {
                            admitted: v[0],
                            rejected: v[1],
                            ok: v[2],
                            err: v[3],
                            lat_sum_us: v[4],
                            lat_n: v[5],
                            would_reject: v[6],
                        },
                    )
                })
                .collect();
            let batch = (next_flush_seq(sh), counters);
            if !deliver(sh, t, &batch).await
                && let Ok(mut p) = t.pending_flush.lock()
            {
                *p = Some(batch);
            }
        }
    }
    flush_lock.unlock(flush_token);
}

async fn report_host(sh: &Shared) {
    let h = sh.seg.header();
    let now_us = sh.now_us();
    let now_ms = crate::clock::host_ms();
    // The first report waits for a clock measurement (a pull), or two seconds.
    if h.clock_rtt_us.load(Ordering::Relaxed) <= 0 && sh.started.elapsed() < Duration::from_secs(2)
    {
        return;
    }
    let last = h.host_report_ms.load(Ordering::Acquire);
    let period = sh.cfg.host_report_interval.as_millis() as i64;
    if now_ms - last < period && now_ms >= last {
        return;
    }
    if h.host_report_ms
        .compare_exchange(last, now_ms, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    let mut tasks = std::collections::BTreeMap::new();
    let mut permits = std::collections::BTreeMap::new();
    for (i, name) in sh.seg.tasks() {
        let Some(slot) = sh.seg.slot(i) else { continue };
        let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
            continue;
        };
        if m.mode == Mode::Concurrency {
            let (state, report) = crate::refill::permits::host_report(&slot.conc);
            tasks.insert(name.clone(), state.as_str().to_string());
            permits.insert(name, report);
            continue;
        }
        let start = slice_start(now_us, m.slice_ms);
        let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
        let w = slot.entry(start, m.slice_ms).word.load(Ordering::Acquire);
        let state = view(health, w, tag_of(start));
        tasks.insert(name, state.as_str().to_string());
    }
    let report = HostReport {
        offset_ms: h.clock_offset_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        rtt_ms: h.clock_rtt_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        seen_ms: now_ms,
        sdk: env!("CARGO_PKG_VERSION").to_string(),
        tasks,
        permits,
    };
    let Ok(json) = serde_json::to_string(&report) else {
        return;
    };
    let key = sh.keys.hosts();
    let _ = call(sh, Retry::Idempotent, |mut c| {
        let (key, json) = (&key, &json);
        async move {
            redis::cmd("HSET")
                .arg(key)
                .arg(&sh.cfg.host_id)
                .arg(json)
                .query_async::<i64>(&mut c)
                .await
        }
    })
    .await;
}

/// Start (Unix ms) of the slice of length `slice_ms` containing `now_us`.
fn slice_start(now_us: i64, slice_ms: u64) -> i64 {
    crate::protocol::slice::start(now_us.div_euclid(1_000), slice_ms)
}

/// The protocol version a task's meta hash was written with (`proto`), when it is newer than
/// this build's: the managers were upgraded past this worker. Nothing refuses the mix
/// (docs/deploy.md, "Version-skew policy"); this says so where an operator looks.
fn newer_protocol(pairs: &[(String, String)]) -> Option<u32> {
    let (_, v) = pairs.iter().find(|(k, _)| k == meta_field::PROTO)?;
    let v: u32 = v.parse().ok()?;
    (v > crate::protocol::PROTOCOL_VERSION).then_some(v)
}

fn warn_if_newer_protocol(task: &str, pairs: &[(String, String)]) {
    if let Some(v) = newer_protocol(pairs) {
        tracing::warn!(
            task = %task,
            meta_protocol = v,
            sdk_protocol = crate::protocol::PROTOCOL_VERSION,
            "task meta was written by managers of a newer protocol than this SDK speaks; \
             upgrade this host's workers (docs/deploy.md, version-skew policy)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(proto: &str) -> Vec<(String, String)> {
        vec![
            ("mode".into(), "pooled".into()),
            (meta_field::PROTO.into(), proto.into()),
        ]
    }

    #[test]
    fn only_a_newer_protocol_in_the_meta_is_reported() {
        let mine = crate::protocol::PROTOCOL_VERSION;
        assert_eq!(
            newer_protocol(&pairs(&(mine + 1).to_string())),
            Some(mine + 1)
        );
        assert_eq!(newer_protocol(&pairs(&mine.to_string())), None);
        assert_eq!(newer_protocol(&pairs("1")), None);
        assert_eq!(newer_protocol(&pairs("x")), None);
        assert_eq!(newer_protocol(&[]), None);
    }
}
