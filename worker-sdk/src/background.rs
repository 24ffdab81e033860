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
//! This module is the scheduler only: each step is `crate::refill`'s (`meta`, `pooled`, `permits`,
//! `keys`, `flush`, `report`), and no mode imports this module.
//!
//! # Retries
//!
//! `crate::plumbing::call` retries a Redis call on a fresh connection when its first attempt fails at the
//! connection level or goes unanswered for half the pull timeout. That is only safe for calls
//! that are idempotent: meta reads, host reports, PULL (by request id) and FLUSH (by sequence
//! number). TAKE and SLIDE (exact modes) are retried only when the first attempt surely never
//! reached Redis (no connection could be had, or it was refused); otherwise the decision goes
//! to the failure path (`on_failure`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::ctx::{Shared, TaskInner};
use crate::protocol::Mode;
use crate::shm::{FastMeta, Slot, SlotRef};

/// Round period when idle.
const IDLE_TICK: Duration = Duration::from_millis(10);
/// Round period while something is pending.
const BUSY_TICK: Duration = Duration::from_millis(1);
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
    let pump = tokio::spawn(crate::refill::keys::pump(sh.clone()));
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
            crate::refill::keys::finish(&sh, pump).await;
            return;
        }
        crate::refill::report::report_host(&sh).await;
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
        crate::refill::meta::refresh_meta(sh, t, slot, generation, sh.now_us() / 1_000).await;
    }
    let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
        return false;
    };
    if m.generation != generation {
        return false;
    }
    let busy = if m.mode == Mode::Pooled && !stopping {
        crate::refill::pooled::pooled(sh, t, slot, r, &m, sh.now_us()).await
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
    crate::refill::flush::flush(sh, t, slot, generation, sh.now_us(), stopping).await;
    busy
}
