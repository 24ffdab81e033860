//! Distributed locks with fencing tokens: [`crate::Client::lock`].
//!
//! A lock is one Redis hash `NS:{L}:lock` (`token`, `owner`) with a TTL, taken by
//! [`crate::protocol::lease::LOCK_ACQUIRE_LUA`], which draws the holder's **fencing token**
//! in the same call, `max(counter + 1, Redis TIME in µs)`: tokens of one lock are strictly
//! increasing across holders, crashes and expiries, and across a Redis that comes back with an
//! older counter (a restart from a dump, a failover to a lagging replica). Acquiring is
//! cancel-safe: a dropped [`crate::Client::lock`] future stops trying, and a lock taken by a
//! call already on its way is released. The guard renews the lock every third of its TTL on
//! the client's background runtime; renewal and release are token-checked scripts, so a
//! holder never renews or deletes a successor's lock.
//!
//! **What a lock does not give**: mutual exclusion in real time. A holder can be paused (GC,
//! SIGSTOP, a swapped-out VM) past its TTL, lose the lock to another holder, wake up and
//! carry on. The guard stops claiming the lock ([`LockGuard::is_held`]) a quarter TTL before
//! Redis can expire it, but a paused process does not look. The safe pattern: pass
//! [`LockGuard::token`] with every write to the protected resource, and have the resource
//! refuse a token lower than the highest it has seen (see `docs/concurrency.md`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use crate::client::{Client, Guard};
use crate::clock::boot_ms;
use crate::concurrency::valid_for_ms;
use crate::ctx::Shared;
use crate::plumbing::{Retry, call};
use crate::protocol::lease::{self, LockReply};
use crate::protocol::{NameError, validate_task_name};

/// Shortest lock TTL.
pub const MIN_LOCK_TTL: Duration = Duration::from_millis(100);

/// Longest lock TTL (one day): how long a crashed holder's lock may stay taken.
pub const MAX_LOCK_TTL: Duration = Duration::from_secs(86_400);

/// Why a lock was not had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lock name is not a valid name (same rules as task names).
    #[error(transparent)]
    Name(#[from] NameError),
    /// The TTL is below [`MIN_LOCK_TTL`] or above [`MAX_LOCK_TTL`].
    #[error("lock ttl {0:?} is outside 100 ms ..= 1 day")]
    Ttl(Duration),
    /// Another holder kept the lock for the whole wait.
    #[error("lock {0:?} is held by another holder")]
    Busy(String),
    /// Redis did not answer (within the pull timeout).
    #[error("Redis unreachable for lock {0:?}")]
    Unreachable(String),
}

struct LockState {
    lost: AtomicBool,
    valid_until_ms: AtomicI64,
}

/// A held lock. Renewed automatically; released (token-checked) when dropped.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    shared: Arc<Shared>,
    _guard: Arc<Guard>,
    name: String,
    token: u64,
    ttl: Duration,
    state: Arc<LockState>,
    renewer: Option<tokio::task::JoinHandle<()>>,
    released: bool,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("held", &self.is_held())
            .finish()
    }
}

impl LockGuard {
    /// The fencing token: strictly increasing per lock. Send it with every write to the
    /// protected resource, which must refuse a token below the highest it has seen.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The TTL the lock is renewed with.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this holder may still believe it holds the lock: no renewal found it lost,
    /// and the last successful renewal is younger than the TTL minus a quarter (the safety
    /// margin). A paused process cannot look; fencing tokens cover that case.
    pub fn is_held(&self) -> bool {
        !self.state.lost.load(Ordering::Acquire)
            && boot_ms() < self.state.valid_until_ms.load(Ordering::Acquire)
    }

    /// Releases the lock now; `Ok(true)` when this token still held it.
    pub async fn release(mut self) -> Result<bool, LockError> {
        self.released = true;
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        let fut = release_call(self.shared.clone(), self.name.clone(), self.token);
        match self.shared.rt.spawn(fut).await {
            Ok(Some(r)) => Ok(r),
            _ => Err(LockError::Unreachable(self.name.clone())),
        }
    }
}

impl LockGuard {
    /// The guard of a lock just taken with `token` by a call sent at boot-clock `t0`: starts
    /// its renewals on the client's runtime.
    fn start(
        shared: Arc<Shared>,
        guard: Arc<Guard>,
        name: String,
        token: u64,
        ttl: Duration,
        t0: i64,
    ) -> Self {
        let state = Arc::new(LockState {
            lost: AtomicBool::new(false),
            valid_until_ms: AtomicI64::new(t0 + valid_for_ms(ttl.as_millis() as u64)),
        });
        let renewer = shared.rt.spawn(renew_loop(
            shared.clone(),
            name.clone(),
            token,
            ttl,
            state.clone(),
        ));
        Self {
            shared,
            _guard: guard,
            name,
            token,
            ttl,
            state,
            renewer: Some(renewer),
            released: false,
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        if !self.released {
            let fut = release_call(self.shared.clone(), self.name.clone(), self.token);
            self.shared.rt.spawn(async move {
                let _ = fut.await;
            });
        }
    }
}

async fn release_call(sh: Arc<Shared>, name: String, token: u64) -> Option<bool> {
    match call(&sh, Retry::Idempotent, |mut c| {
        let (sh, name) = (&sh, &name);
        async move { lease::lock_release(&mut c, &sh.keys, name, token).await }
    })
    .await
    {
        Ok(Ok(r)) => Some(r),
        _ => None,
    }
}

async fn renew_loop(sh: Arc<Shared>, name: String, token: u64, ttl: Duration, st: Arc<LockState>) {
    let ttl_ms = ttl.as_millis() as u64;
    let every = ttl / 3;
    let mut next = tokio::time::Instant::now() + every;
    loop {
        tokio::time::sleep_until(next).await;
        let t0 = boot_ms();
        if t0 >= st.valid_until_ms.load(Ordering::Acquire) {
            st.lost.store(true, Ordering::Release);
            tracing::warn!(lock = %name, token, "lock renewal failed past the safety margin");
            return;
        }
        let r = call(&sh, Retry::Idempotent, |mut c| {
            let (sh, name) = (&sh, &name);
            async move { lease::lock_renew(&mut c, &sh.keys, name, token, ttl_ms).await }
        })
        .await;
        match r {
            Ok(Ok(true)) => {
                st.valid_until_ms
                    .fetch_max(t0 + valid_for_ms(ttl_ms), Ordering::AcqRel);
                next = tokio::time::Instant::now() + every;
            }
            Ok(Ok(false)) => {
                st.lost.store(true, Ordering::Release);
                tracing::warn!(lock = %name, token, "lock lost (expired or taken over)");
                return;
            }
            _ => {
                // Retry soon; the safety margin decides when the guard stops claiming it.
                next = tokio::time::Instant::now() + Duration::from_millis(50).min(every);
            }
        }
    }
}

impl Client {
    /// Takes lock `name` (a name like a task name) for `ttl`, waiting for it at most
    /// [`crate::Config::acquire_timeout`]. The guard renews it every `ttl / 3` and releases it
    /// when dropped.
    pub async fn lock(&self, name: &str, ttl: Duration) -> Result<LockGuard, LockError> {
        self.lock_timeout(name, ttl, self.shared.cfg.acquire_timeout)
            .await
    }

    /// One attempt at lock `name`: `Err(LockError::Busy)` at once if another holder has it.
    pub async fn try_lock(&self, name: &str, ttl: Duration) -> Result<LockGuard, LockError> {
        self.lock_timeout(name, ttl, Duration::ZERO).await
    }

    /// Takes lock `name` for `ttl`, waiting for it at most `wait`.
    ///
    /// Cancel-safe: dropping the returned future (a `tokio::time::timeout`, a `select!`) stops
    /// the attempts, and a lock that an attempt already on its way to Redis takes afterwards
    /// is released at once (its guard is dropped): a cancelled call leaves nothing held.
    pub async fn lock_timeout(
        &self,
        name: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<LockGuard, LockError> {
        validate_task_name(name)?;
        if !(MIN_LOCK_TTL..=MAX_LOCK_TTL).contains(&ttl) {
            return Err(LockError::Ttl(ttl));
        }
        // The attempts run on the client's runtime (this future may be polled by any
        // executor); the guard comes back through a channel. If the caller is gone, the
        // attempts stop (`closed`), and a guard that finds no receiver is dropped: released.
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<LockGuard, LockError>>();
        let (sh, guard, name_s) = (self.shared.clone(), self.guard.clone(), name.to_string());
        self.shared.rt.spawn(async move {
            let mut tx = tx;
            let Some(r) = acquire(&sh, &name_s, ttl, wait, &mut tx).await else {
                return;
            };
            let r = r.map(|(token, t0)| LockGuard::start(sh, guard, name_s, token, ttl, t0));
            // If the caller is gone, the guard comes back here and is dropped: released.
            drop(tx.send(r));
        });
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(LockError::Unreachable(name.to_string())),
        }
    }
}

/// Tries to take lock `name` until `wait` has passed: its token and the boot-clock time the
/// successful call was sent; `None` when the caller went away (`caller` closed) between two
/// calls. A call already sent is always awaited: it may take the lock, and its caller
/// ([`Client::lock_timeout`]) then releases it through the guard it builds.
async fn acquire(
    sh: &Shared,
    name: &str,
    ttl: Duration,
    wait: Duration,
    caller: &mut tokio::sync::oneshot::Sender<Result<LockGuard, LockError>>,
) -> Option<Result<(u64, i64), LockError>> {
    // A wait too long to add to the clock is a wait without end.
    let deadline = Instant::now().checked_add(wait);
    let past = |now: Instant| deadline.is_some_and(|d| now >= d);
    let ttl_ms = ttl.as_millis() as u64;
    // One owner for the whole wait: an attempt whose answer was lost (a call given up after
    // `pull_timeout` while Redis ran it) took the lock for this owner, and the next attempt is
    // answered with that lock (the script is re-entrant for its owner) instead of finding it
    // busy for a whole TTL with nobody holding it.
    let owner = sh.request_id();
    loop {
        if caller.is_closed() {
            return None;
        }
        let t0 = boot_ms();
        let r = call(sh, Retry::Idempotent, |mut c| {
            let owner = &owner;
            async move { lease::lock_acquire(&mut c, &sh.keys, name, owner, ttl_ms).await }
        })
        .await;
        let pause = match r {
            Ok(Ok(LockReply::Acquired { token })) => return Some(Ok((token, t0))),
            Ok(Ok(LockReply::Busy { pttl_ms, .. })) => {
                if past(Instant::now()) {
                    return Some(Err(LockError::Busy(name.to_string())));
                }
                Duration::from_millis(pttl_ms.clamp(1, 20) as u64)
            }
            _ => {
                if past(Instant::now()) {
                    return Some(Err(LockError::Unreachable(name.to_string())));
                }
                Duration::from_millis(50)
            }
        };
        let left = deadline.map_or(pause, |d| d.saturating_duration_since(Instant::now()));
        tokio::select! {
            () = tokio::time::sleep(pause.min(left)) => {}
            () = caller.closed() => return None,
        }
    }
}
