//! Flushing a task's counters: admitted counts moved out of the quota accounting, every
//! slice's counters sent with one FLUSH call (by sequence number, so a retry is idempotent),
//! under the host's flush lock.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::ctx::{FlushBatch, Shared, TaskInner};
use crate::plumbing::{Retry, call};
use crate::protocol::scripts::{self, SliceCounters};
use crate::refill::{lock, try_lock};
use crate::shm::Slot;

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
pub(crate) async fn flush(
    sh: &Shared,
    t: &TaskInner,
    slot: &Slot,
    generation: u16,
    now_us: i64,
    force: bool,
) {
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
