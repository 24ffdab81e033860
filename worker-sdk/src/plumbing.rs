//! Redis plumbing every mode uses, downward: one call with its retry rule and timeout, the
//! host's clock offset to Redis measured on each call, the task state a call's outcome moves,
//! the "outside the slice window" answer, and the exact-mode calls. Nothing here decides from
//! shared memory or schedules work.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::ctx::{Shared, TaskInner};
use crate::protocol::Mode;
use crate::protocol::scripts::{self, ExactReply};
use crate::shm::{FastMeta, Slot};
use crate::state::Health;

/// Whether a call may be sent twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Idempotent: retry after a connection error or half the timeout.
    Idempotent,
    /// Not idempotent: retry only when the first attempt surely never reached Redis.
    OnlyUnsent,
}

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
/// With [`Retry::OnlyUnsent`] the first attempt gets the whole timeout and only an error that
/// guarantees the request never reached Redis (no connection, connection refused) is retried.
/// A Redis that is down fails both attempts at once; one that hangs costs exactly the pull
/// timeout.
pub(crate) async fn call<T, F, Fut>(sh: &Shared, retry: Retry, mut f: F) -> CallResult<T>
where
    F: FnMut(crate::protocol::conn::RedisConn) -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let started = Instant::now();
    let half = match retry {
        Retry::Idempotent => sh.cfg.pull_timeout / 2,
        Retry::OnlyUnsent => sh.cfg.pull_timeout,
    };
    for attempt in 1..=2 {
        let budget = if attempt == 1 {
            half
        } else {
            sh.cfg.pull_timeout.saturating_sub(started.elapsed())
        };
        sh.redis_calls.fetch_add(1, Ordering::Relaxed);
        let once = async {
            match sh.redis.conn().await {
                Ok(c) => (true, f(c).await),
                Err(e) => (false, Err(e)),
            }
        };
        match tokio::time::timeout(budget, once).await {
            Ok((sent, Err(e)))
                if attempt == 1
                    && (e.is_io_error()
                        || e.is_connection_dropped()
                        || e.is_connection_refusal())
                    && (retry == Retry::Idempotent || !sent || e.is_connection_refusal()) =>
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok((_, r)) => return Ok(r),
            Err(_) if attempt == 1 && retry == Retry::Idempotent => {
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

pub(crate) fn apply_health(
    t: &TaskInner,
    slot: &Slot,
    old: Health,
    new: Health,
    next_probe: Option<i64>,
) {
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

/// Handles "outside the window" from PULL or TAKE for the slice starting at `start_ms`:
/// a slice that is over (this host's clock lags Redis) is LIMITED for the rest of the host's
/// slice; one that has not started (the host leads) is not pulled for until its window opens.
/// Logs at WARN, at most every 10 s per task, with the measured clock offset. Returns how
/// long (ms, host clock) a retry cannot succeed.
pub(crate) fn outside_window(
    sh: &Shared,
    t: &TaskInner,
    start_ms: i64,
    slice_ms: u64,
    redis_time_us: i64,
) -> i64 {
    let redis_ms = redis_time_us / 1_000;
    let host_ms = sh.now_us() / 1_000;
    let len = slice_ms as i64;
    let over = redis_ms > start_ms + len;
    let now = crate::clock::host_ms();
    let last = t.window_warned_ms.load(Ordering::Relaxed);
    if now - last >= WINDOW_WARN_MS
        && t.window_warned_ms
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        let offset_ms = sh.seg.header().clock_offset_us.load(Ordering::Relaxed) as f64 / 1_000.0;
        tracing::warn!(task = %t.name, slice = start_ms, redis_ms, host_ms, offset_ms,
            over, "Redis time is outside the slice's window: LIMITED for it (is this host's clock off?)");
    }
    if over {
        // The host's own slice ends at start + len on its clock.
        (start_ms + len - host_ms).max(1)
    } else {
        // Its window opens at start − len in Redis time.
        (start_ms - len - redis_ms).max(1)
    }
}

pub(crate) fn record_clock(sh: &Shared, before_us: i64, after_us: i64, redis_us: i64) {
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
    let nonce = format!("{:016x}", sh.nonce);
    // Idempotent by request id (unique per decision of this client), so resent like a pull.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let rid = format!("{nonce}:{}", SEQ.fetch_add(1, Ordering::Relaxed));
    let res = call(&sh, Retry::Idempotent, |mut c| {
        let (sh, name, nonce, rid) = (&sh, &name, &nonce, &rid);
        async move {
            match m.mode {
                Mode::ExactSliding => {
                    let w = m.slice_ms;
                    scripts::slide(&mut c, &sh.keys, name, start_ms, w, n, nonce, rid).await
                }
                _ => scripts::take(&mut c, &sh.keys, name, start_ms, m.slice_ms, n, rid).await,
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

/// Shortest time between two warnings about pulls outside the slice window (per task).
const WINDOW_WARN_MS: i64 = 10_000;
