//! Connections of the callers' own runtimes ([`crate::Config::caller_pulls`]): a keyed
//! decision that needs Redis sends its pull from the caller's task, so its answer wakes the
//! caller's thread directly (one wake-up, like a per-request limiter), not the background
//! thread first and the caller after it (three wake-ups, each of which may wait for a core on
//! a busy host).
//!
//! A thread keeps one connection per client (made on its first such decision, inside the
//! caller's runtime so the connection's driver runs there), at most [`PER_THREAD`] clients,
//! and a client has at most [`MAX_CALLER_CONNS`] over all threads: past that, decisions use
//! the background thread. A connection that fails is dropped (the next decision makes a new
//! one after a second; one connect at a time per thread, a failed one retried at most once a
//! second); one left on a runtime
//! that is no longer driven (a thread alternating between runtimes) times out and is dropped
//! at each switch. Off by default: see [`crate::Config::caller_pulls`] for what it needs.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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

/// Names each connection made here (0: none), so that [`forget`] drops only the one that
/// failed.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A connection of the caller's runtime and its id (for [`forget`]).
pub(crate) type CallerConn = (MultiplexedConnection, u64);

struct Held {
    /// The client's nonce.
    client: u64,
    /// The connection's id (0 while there is none).
    id: u64,
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
                .map(|x| (x.conn.clone(), x.id, x.failed_at))
        })
        .ok()?;
    match found {
        Some((Some(c), id, _)) => return Some((c, id)),
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
            reserved.1 = true; // now the `Held`'s, given back by its drop
            let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            put(sh, Some((c.clone(), id)));
            Some((c, id))
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
    let (conn, id) = match conn {
        Some((c, id)) => (Some(c), id),
        None => (None, 0),
    };
    let held = Held {
        client: sh.nonce,
        id,
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

/// Drops connection `id` for the client of `sh` (it failed or went unanswered) when it is
/// this thread's: the next one is made after the backoff. A caller's task that moved to
/// another thread while it waited finds that thread's connection instead, which is left alone
/// (the failed one is dropped by the next decision that fails on it).
pub(crate) fn forget(sh: &Shared, id: u64) {
    let mine = HELD
        .try_with(|h| {
            h.borrow()
                .iter()
                .any(|x| x.client == sh.nonce && x.id == id && x.conn.is_some())
        })
        .unwrap_or(false);
    if mine {
        put(sh, None);
    }
}
