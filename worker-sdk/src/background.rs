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

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::client::{Shared, TaskInner};
use crate::protocol::scripts::{self, ExactReply, PullReply, SliceCounters};
use crate::protocol::{HostReport, Mode, TaskMeta, meta_field};
use crate::pull::{self, PullInput};
use crate::shm::{FastMeta, LockAttempt, Slot, unpack_quota};
use crate::state::{Health, PullOutcome, view};

/// Round period when idle.
const IDLE_TICK: Duration = Duration::from_millis(10);
/// Round period while something is pending.
const BUSY_TICK: Duration = Duration::from_millis(1);
/// Meta re-read period while the meta is unknown.
const UNKNOWN_META_RETRY_MS: i64 = 200;

/// The result of one logical Redis call: `Err(())` when it timed out.
type CallResult<T> = Result<redis::RedisResult<T>, ()>;

/// Runs one Redis call within the pull timeout, in at most two attempts:
///
/// * a connection-level error is retried once after 5 ms: after Redis restarts, a process's
///   first request fails on the dead connection and triggers the reconnect the retry uses;
/// * a first attempt unanswered after half the timeout drops the connection and retries on a
///   fresh one with the other half: a stuck connection is this process's problem, not a
///   reason to declare Redis FAILED for the whole host.
///
/// A Redis that is down fails both attempts at once; one that hangs costs exactly the pull
/// timeout.
async fn call<T, F, Fut>(sh: &Shared, mut f: F) -> CallResult<T>
where
    F: FnMut(crate::protocol::conn::RedisConn) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let started = Instant::now();
    let half = sh.cfg.pull_timeout / 2;
    for attempt in 1..=2 {
        let budget = if attempt == 1 {
            half
        } else {
            sh.cfg.pull_timeout.saturating_sub(started.elapsed())
        };
        sh.redis_calls.fetch_add(1, Ordering::Relaxed);
        let once = async {
            match sh.redis.conn().await {
                Ok(c) => f(c).await,
                Err(e) => Err(e),
            }
        };
        match tokio::time::timeout(budget, once).await {
            Ok(Err(e))
                if attempt == 1
                    && (e.is_io_error()
                        || e.is_connection_dropped()
                        || e.is_connection_refusal()) =>
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(r) => return Ok(r),
            Err(_) if attempt == 1 => {
                tracing::debug!(
                    after_ms = half.as_millis() as u64,
                    "Redis call unanswered; retrying on a fresh connection"
                );
                sh.redis.reset().await;
            }
            Err(_) => {
                tracing::debug!(
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "Redis call timed out"
                );
                sh.redis.reset().await;
                return Err(());
            }
        }
    }
    Err(())
}

pub(crate) fn spawn(
    shared: Arc<Shared>,
    rt: tokio::runtime::Runtime,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("sluice-bg".into())
        .spawn(move || rt.block_on(run(shared)))
}

async fn run(sh: Arc<Shared>) {
    loop {
        let stopping = sh.stop.load(Ordering::Acquire);
        let tasks: Vec<Arc<TaskInner>> = sh.tasks.lock().map(|t| t.clone()).unwrap_or_default();
        let busy = futures::future::join_all(tasks.iter().map(|t| step(&sh, t, stopping))).await;
        if stopping {
            return;
        }
        report_host(&sh).await;
        let busy = busy.into_iter().any(|b| b)
            || tasks.iter().any(|t| t.waiters.load(Ordering::Acquire) > 0);
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

/// One round for one task; true when it wants the next round soon.
async fn step(sh: &Shared, t: &TaskInner, stopping: bool) -> bool {
    t.poked.store(false, Ordering::Release);
    let Some(slot) = sh.seg.slot(t.slot) else {
        return false;
    };
    if !stopping {
        refresh_meta(sh, t, slot, sh.now_us() / 1_000).await;
    }
    let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
        return false;
    };
    let busy = if m.mode == Mode::Pooled && !stopping {
        pooled(sh, t, slot, &m, sh.now_us()).await
    } else {
        false
    };
    if t.waiters.load(Ordering::Acquire) > 0 {
        t.deposited.notify_waiters();
    }
    flush(sh, t, slot, &m, sh.now_us(), stopping).await;
    busy
}

async fn refresh_meta(sh: &Shared, t: &TaskInner, slot: &Slot, now_ms: i64) {
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
    let res = call(sh, |mut c| {
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
                    slot.clear_meta();
                }
            } else {
                match TaskMeta::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
                    Ok(meta) => {
                        cells.missing_since_ms.store(0, Ordering::Relaxed);
                        if slot.meta().as_ref() != Some(&meta) {
                            tracing::info!(task = %t.name, version = meta.version,
                                mode = %meta.mode, slice_ms = meta.slice_ms, "task meta loaded");
                            slot.store_meta(&meta);
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
                    Err(e) => tracing::warn!(task = %t.name, error = %e, "unreadable task meta"),
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

fn apply_health(t: &TaskInner, slot: &Slot, old: Health, new: Health, next_probe: Option<i64>) {
    if let Some(p) = next_probe {
        slot.ctl.next_probe_ms.store(p, Ordering::Release);
    }
    slot.ctl.state.store(new.encode(), Ordering::Release);
    match (old, new) {
        (Health::Normal, Health::Failed { cause, .. }) => {
            tracing::warn!(task = %t.name, ?cause, "FAILED: deciding by on_failure until a probe succeeds")
        }
        (Health::Failed { since_ms, .. }, Health::Normal) => {
            tracing::info!(task = %t.name, failed_for_ms = crate::clock::host_ms() - since_ms, "back to NORMAL")
        }
        _ => {}
    }
}

/// The pooled-mode round: probe, refill, prefetch. True when something is still pending.
async fn pooled(sh: &Shared, t: &TaskInner, slot: &Slot, m: &FastMeta, now_us: i64) -> bool {
    let slice_us = (m.slice_ms * 1_000) as i64;
    let index = (now_us.max(0) / slice_us) as u64;
    let tag = index as u32;
    let now_ms = now_us / 1_000;
    let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
    let demand = slot.ctl.want.load(Ordering::Acquire) == index + 1;
    if let Health::Failed { .. } = health {
        let next = slot.ctl.next_probe_ms.load(Ordering::Acquire);
        if !sh.machine.probe_due(health, next, now_ms) {
            return false;
        }
        let claim = now_ms + sh.machine.probe_interval_ms;
        if slot
            .ctl
            .next_probe_ms
            .compare_exchange(next, claim, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let Some(token) = lock(sh, slot, now_ms) else {
            return true;
        };
        pull(sh, t, slot, m, index, now_us, demand).await;
        slot.pull_lock().unlock(token);
        return false;
    }
    let need_cur = |slot: &Slot| {
        let e = slot.entry(tag);
        let (qt, exhausted, c) = unpack_quota(e.word.load(Ordering::Acquire));
        demand
            && !(qt == tag && exhausted)
            && (qt != tag || (c as u64) < e.low_water.load(Ordering::Relaxed))
    };
    let rtt_ms = slot.ctl.rtt_us.load(Ordering::Relaxed) as f64 / 1_000.0;
    let left_ms = ((index + 1) as i64 * slice_us - now_us) as f64 / 1_000.0;
    let need_next = |slot: &Slot| {
        let next_tag = tag.wrapping_add(1);
        left_ms <= pull::prefetch_lead_ms(m.slice_ms, rtt_ms)
            && (demand || slot.consumed(tag) > 0)
            && unpack_quota(slot.entry(next_tag).word.load(Ordering::Acquire)).0 != next_tag
    };
    if !need_cur(slot) && !need_next(slot) {
        return false;
    }
    let Some(token) = lock(sh, slot, now_ms) else {
        return true;
    };
    // Another process may have refilled while we waited for the lock.
    if need_cur(slot) {
        pull(sh, t, slot, m, index, now_us, true).await;
    }
    if need_next(slot) && Health::decode(slot.ctl.state.load(Ordering::Acquire)) == Health::Normal {
        pull(sh, t, slot, m, index + 1, now_us, true).await;
    }
    slot.pull_lock().unlock(token);
    need_cur(slot)
}

fn lock(sh: &Shared, slot: &Slot, now_ms: i64) -> Option<u64> {
    let timeout = sh.cfg.lock_timeout.as_millis() as u64;
    match slot.pull_lock().try_lock(sh.pid, now_ms, timeout) {
        LockAttempt::Acquired {
            token,
            took_over_from,
        } => {
            if let Some(pid) = took_over_from {
                tracing::warn!(
                    holder = pid,
                    "took over the pull lock from a dead or stuck process"
                );
            }
            Some(token)
        }
        LockAttempt::Busy { .. } => None,
    }
}

/// One PULL for slice `index` (the current one, or the next when prefetching); call under the
/// pull lock.
async fn pull(
    sh: &Shared,
    t: &TaskInner,
    slot: &Slot,
    m: &FastMeta,
    index: u64,
    now_us: i64,
    demand: bool,
) {
    let tag = index as u32;
    let slice_ms = m.slice_ms;
    let start_ms = (index * slice_ms) as i64;
    let now_ms = now_us / 1_000;
    let current = now_ms >= start_ms;
    let cap = match slot.ctl.cap.load(Ordering::Relaxed) {
        0 => slot.meta.threshold.load(Ordering::Relaxed),
        c => c,
    };
    let consumed_now = slot.consumed(tag.wrapping_sub(if current { 0 } else { 1 }));
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
    let plan = pull::plan(&input);
    let want = if demand { plan.want } else { 0 };
    let before = crate::clock::host_us();
    let started = Instant::now();
    let res = call(sh, |mut c| async move {
        scripts::pull(&mut c, &sh.keys, &t.name, start_ms, want, None).await
    })
    .await;
    let rtt = started.elapsed();
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
        Ok(Ok(PullReply::Granted {
            granted,
            remaining,
            cap,
            redis_time_us,
        })) => {
            record_clock(sh, before, crate::clock::host_us(), redis_time_us);
            slot.ctl.cap.store(cap, Ordering::Relaxed);
            slot.ctl.remaining.store(remaining, Ordering::Relaxed);
            slot.ctl
                .rtt_us
                .store(rtt.as_micros() as u64, Ordering::Relaxed);
            PullOutcome::Granted { granted, remaining }
        }
    };
    let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
    let tr = sh.machine.after_pull(health, outcome, now_ms);
    if let PullOutcome::Granted { granted, .. } = outcome
        && (granted > 0 || tr.exhausted)
    {
        slot.deposit(tag, index, granted, tr.exhausted, now_us);
        slot.entry(tag)
            .low_water
            .store(plan.low_water, Ordering::Relaxed);
    }
    if tr.health != health || tr.next_probe_ms.is_some() {
        apply_health(t, slot, health, tr.health, tr.next_probe_ms);
    }
    t.deposited.notify_waiters();
    tracing::trace!(task = %t.name, index, want, ?outcome, rtt_us = rtt.as_micros() as u64, "pull");
}

fn record_clock(sh: &Shared, before_us: i64, after_us: i64, redis_us: i64) {
    let h = sh.seg.header();
    let rtt = (after_us - before_us).max(1);
    let offset = (before_us + after_us) / 2 - redis_us;
    let now_ms = after_us / 1_000;
    let old_rtt = h.clock_rtt_us.load(Ordering::Relaxed);
    let old_at = h.clock_measured_ms.load(Ordering::Relaxed);
    // Keep the tighter measurement unless it is getting old.
    if old_rtt <= 0 || rtt <= old_rtt * 2 || now_ms - old_at > 10_000 {
        h.clock_offset_us.store(offset, Ordering::Relaxed);
        h.clock_rtt_us.store(rtt, Ordering::Relaxed);
        h.clock_measured_ms.store(now_ms, Ordering::Relaxed);
    }
}

async fn flush(sh: &Shared, t: &TaskInner, slot: &Slot, m: &FastMeta, now_us: i64, force: bool) {
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
    let index = (now_us.max(0) as u64) / (m.slice_ms * 1_000);
    // The last flush of a client waits for the lock: what it does not account now may never
    // be (the other processes of the host may be exiting too).
    let patience = if force { 200 } else { 0 };
    let mut token = lock(sh, slot, now_ms);
    for _ in 0..patience {
        if token.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        token = lock(sh, slot, crate::clock::host_ms());
    }
    if let Some(token) = token {
        slot.account(index);
        slot.pull_lock().unlock(token);
    }
    let drained = slot.drain_counters();
    if drained.is_empty() {
        return;
    }
    let batch: Vec<(i64, SliceCounters)> = drained
        .iter()
        .map(|(i, v)| {
            (
                (*i * m.slice_ms) as i64,
                SliceCounters {
                    admitted: v[0],
                    rejected: v[1],
                    ok: v[2],
                    err: v[3],
                    lat_sum_us: v[4],
                    lat_n: v[5],
                },
            )
        })
        .collect();
    let res = call(sh, |mut c| {
        let batch = &batch;
        async move { scripts::flush(&mut c, &sh.keys, &t.name, batch).await }
    })
    .await;
    if !matches!(res, Ok(Ok(_))) {
        slot.restore_counters(&drained);
    }
}

/// One exact-mode decision (`exact_fixed`: TAKE, `exact_sliding`: SLIDE) for slice `index`;
/// `None` when Redis failed or timed out.
pub(crate) async fn exact(
    sh: Arc<Shared>,
    name: String,
    m: FastMeta,
    index: u64,
    n: u64,
) -> Option<ExactReply> {
    let start_ms = (index * m.slice_ms) as i64;
    let member = format!(
        "{}:{}:{}",
        sh.cfg.host_id,
        sh.pid,
        sh.seq.fetch_add(1, Ordering::Relaxed)
    );
    let res = call(&sh, |mut c| {
        let (sh, name, member) = (&sh, &name, &member);
        async move {
            match m.mode {
                Mode::ExactSliding => {
                    scripts::slide(&mut c, &sh.keys, name, start_ms, m.slice_ms, n, member).await
                }
                _ => scripts::take(&mut c, &sh.keys, name, start_ms, n).await,
            }
        }
    })
    .await;
    match res {
        Ok(Ok(r)) => Some(r),
        Ok(Err(e)) => {
            tracing::debug!(task = %name, error = %e, "exact decision failed");
            None
        }
        Err(()) => None,
    }
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
    for (i, name) in sh.seg.tasks() {
        let Some(slot) = sh.seg.slot(i) else { continue };
        let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
            continue;
        };
        let tag = (now_us.max(0) as u64 / (m.slice_ms * 1_000)) as u32;
        let health = Health::decode(slot.ctl.state.load(Ordering::Acquire));
        let state = view(health, slot.entry(tag).word.load(Ordering::Acquire), tag);
        tasks.insert(name, state.as_str().to_string());
    }
    let report = HostReport {
        offset_ms: h.clock_offset_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        rtt_ms: h.clock_rtt_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        seen_ms: now_ms,
        sdk: env!("CARGO_PKG_VERSION").to_string(),
        tasks,
    };
    let Ok(json) = serde_json::to_string(&report) else {
        return;
    };
    let key = sh.keys.hosts();
    let _ = call(sh, |mut c| {
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
