//! Connections of the callers' own runtimes ([`crate::Config::caller_pulls`]): a keyed
//! decision that needs Redis sends its pull from the caller's task, so its answer wakes the
//! caller's thread directly (one wake-up, like a per-request limiter), not the background
//! thread first and the caller after it (three wake-ups, each of which may wait for a core on
//! a busy host).
//!
//! A thread keeps one connection per client (made on its first such decision, inside the
//! caller's runtime so the connection's driver runs there), at most [`PER_THREAD`] clients,
//! and a client has at most [`MAX_CALLER_CONNS`] over all threads: past that, decisions use
//! the background thread. A connection that fails (an error, or a call unanswered for half the
//! pull timeout) is marked failed from whatever thread the caller's task runs on by then, and
//! dropped by the thread that holds it at its next decision (the next decision makes a new
//! one after a second; one connect at a time per thread, a failed one retried at most once a
//! second); one left on a runtime
//! that is no longer driven (a thread alternating between runtimes) times out and is dropped
//! at each switch. Off by default: see [`crate::Config::caller_pulls`] for what it needs.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::ctx::Shared;

/// Connections of callers' runtimes one client keeps at most, over all threads.
pub(crate) const MAX_CALLER_CONNS: usize = 64;

/// Clients one thread keeps a connection to at most (the oldest is dropped beyond).
const PER_THREAD: usize = 4;

/// After a failed connect, the thread does not try again for this long.
const BACKOFF: Duration = Duration::from_secs(1);

/// A connection of the caller's runtime and its "failed" mark (set by [`forget`] from any
/// thread: the caller's task may have moved to another thread while its call went unanswered).
pub(crate) type CallerConn = (MultiplexedConnection, Arc<AtomicBool>);

struct Held {
    /// The client's nonce.
    client: u64,
    /// Set when the connection failed: the thread drops it at its next decision.
    failed: Arc<AtomicBool>,
    /// The client's count of caller connections (gone with the client).
    count: Weak<AtomicUsize>,
    conn: Option<MultiplexedConnection>,
    failed_at: Instant,
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.conn.is_some()
            && let Some(c) = self.count.upgrade()
        {
            c.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

thread_local! {
    static HELD: RefCell<Vec<Held>> = const { RefCell::new(Vec::new()) };
}

/// This thread's connection for the client of `sh`, made now if needed (bounded by the
/// connect timeout and `deadline`); `None`: decide through the background thread (caller pulls off, outside
/// Tokio, a cluster, the client's bound reached, a recent failure).
pub(crate) async fn conn(sh: &Shared, deadline: Instant) -> Option<CallerConn> {
    if !sh.cfg.caller_pulls || sh.keyed.caller_off.load(Ordering::Relaxed) {
        return None;
    }
    tokio::runtime::Handle::try_current().ok()?;
    // `try_with`: a thread being torn down has no connections (the pump decides).
    let found = HELD
        .try_with(|h| {
            let mut h = h.borrow_mut();
            h.retain(|x| x.count.strong_count() > 0);
            h.iter()
                .find(|x| x.client == sh.nonce)
                .map(|x| (x.conn.clone(), x.failed.clone(), x.failed_at))
        })
        .ok()?;
    match found {
        Some((Some(_), failed, _)) if failed.load(Ordering::Acquire) => {
            // It failed for a task that had moved on: dropped now, the backoff from now.
            put(sh, None);
            return None;
        }
        Some((Some(c), failed, _)) => return Some((c, failed)),
        Some((None, _, at)) if at.elapsed() < BACKOFF => return None,
        _ => {}
    }
    let count = &sh.keyed.caller_conns;
    if count.fetch_add(1, Ordering::AcqRel) >= MAX_CALLER_CONNS {
        count.fetch_sub(1, Ordering::AcqRel);
        return None;
    }
    // The reservation is given back however this ends (a connect that fails, or a caller's
    // future dropped while connecting), unless a connection is kept.
    struct Reserved<'a>(&'a AtomicUsize, bool);
    impl Drop for Reserved<'_> {
        fn drop(&mut self) {
            if !self.1 {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
    let mut reserved = Reserved(count, false);
    // While this connects, the thread's other decisions use the background thread (one
    // connect at a time per thread); a connect that fails or is cancelled leaves this as the
    // backoff.
    put(sh, None);
    let budget = deadline.saturating_duration_since(Instant::now());
    let made = tokio::time::timeout(budget, sh.redis.connect_here())
        .await
        .unwrap_or_else(|_| {
            Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "no connection before the decision's deadline",
            )))
        });
    match made {
        Ok(Some(c)) => {
            let failed = Arc::new(AtomicBool::new(false));
            // Kept unless the task moved to a thread that has a live connection of the client
            // (then this one serves this call only, and the reservation is given back).
            reserved.1 = keep(sh, (c.clone(), failed.clone()));
            Some((c, failed))
        }
        Ok(None) => {
            sh.keyed.caller_off.store(true, Ordering::Relaxed);
            None
        }
        Err(e) => {
            tracing::debug!(error = %e, "caller connection to Redis failed; pulling through the background thread");
            None
        }
    }
}

/// Sets this thread's entry for the client of `sh`: a connection, or none since now (a
/// connect under way, or a backoff after a failure).
fn put(sh: &Shared, conn: Option<CallerConn>) {
    let (conn, failed) = match conn {
        Some((c, f)) => (Some(c), f),
        None => (None, Arc::new(AtomicBool::new(false))),
    };
    let held = Held {
        client: sh.nonce,
        failed,
        count: Arc::downgrade(&sh.keyed.caller_conns),
        conn,
        failed_at: Instant::now(),
    };
    let old = HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        let mut old: Vec<Held> = Vec::new();
        if let Some(i) = h.iter().position(|x| x.client == sh.nonce) {
            old.push(h.remove(i));
        }
        if h.len() >= PER_THREAD {
            old.push(h.remove(0));
        }
        h.push(held);
        old
    });
    drop(old);
}

/// Keeps a new connection as this thread's for the client of `sh`, unless the thread already
/// has a live one not marked failed (the connecting task moved here from the thread that
/// asked for it): true when kept. The thread it was asked for keeps its placeholder until its backoff ends.
fn keep(sh: &Shared, conn: CallerConn) -> bool {
    let live = HELD
        .try_with(|h| {
            h.borrow().iter().any(|x| {
                x.client == sh.nonce && x.conn.is_some() && !x.failed.load(Ordering::Acquire)
            })
        })
        .unwrap_or(true);
    if live {
        return false;
    }
    put(sh, Some(conn));
    true
}

/// Marks the connection `failed` belongs to as failed (it errored or went unanswered), from
/// whatever thread the caller's task runs on now: the thread that holds it drops it at its
/// next decision (this one at once), and makes the next after the backoff.
pub(crate) fn forget(sh: &Shared, failed: &Arc<AtomicBool>) {
    failed.store(true, Ordering::Release);
    let mine = HELD
        .try_with(|h| {
            h.borrow()
                .iter()
                .any(|x| x.client == sh.nonce && Arc::ptr_eq(&x.failed, failed))
        })
        .unwrap_or(false);
    if mine {
        put(sh, None);
    }
}
