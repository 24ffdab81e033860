//! Local limiters: what decides while a task is FAILED with `on_failure: local`, and always in
//! mode `local`. Each allows `limit` permits per `window` (the task's `local_limit` per slice)
//! on this host.
//!
//! Every algorithm is a pure function of `(its state, now, n)` over a few words of state
//! ([`Cells`]), tested here with a plain array and a fake clock. On a host the state lives in
//! the task's slot of the shared segment and a decision runs the function under the slot's
//! limiter lock ([`decide_shared`]), so all processes of the host share one limiter.
//!
//! | algorithm | state | admits | burst |
//! |---|---|---|---|
//! | [`token_bucket`] | theoretical arrival time (GCRA) | `limit` per window, evenly refilled | `burst` (default `limit`) |
//! | [`fixed_window`] | window, count | `limit` per aligned window | a whole window at its start |
//! | [`sliding_window`] | window, count, previous count | `limit` in any window, estimated from two | none beyond the estimate |
//! | [`sliding_log`] | log of admissions (1 ms resolution) | `limit` in any window, exactly | none |
//! | [`leaky_bucket`] | water level, last leak | a constant drain of `limit` per window | `burst` (default 1: strictly spaced) |

pub mod fixed_window;
pub mod leaky_bucket;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::protocol::FallbackAlgorithm;
use crate::shm::{LIMITER_CELLS, LOG_CAP, LockAttempt, Segment, ShmLock, Slot};

/// The state words an algorithm reads and writes. Cell 0 is reserved (a fingerprint of the
/// parameters: the state is reset when they change); algorithms use cells 1.. and the log.
pub trait Cells {
    /// Cell `i` (0 when out of range).
    fn get(&self, i: usize) -> u64;
    /// Sets cell `i` (ignored when out of range).
    fn set(&mut self, i: usize, v: u64);
    /// Capacity of the log.
    fn log_cap(&self) -> usize;
    /// Log entry `i % log_cap`.
    fn log_get(&self, i: usize) -> u64;
    /// Sets log entry `i % log_cap`.
    fn log_set(&mut self, i: usize, v: u64);
}

/// Plain memory cells (tests, single-process use).
#[derive(Debug, Clone)]
pub struct MemCells {
    cells: [u64; LIMITER_CELLS],
    log: Vec<u64>,
}

impl MemCells {
    /// Zeroed cells with a log of `log_cap` entries.
    pub fn new(log_cap: usize) -> Self {
        Self {
            cells: [0; LIMITER_CELLS],
            log: vec![0; log_cap.max(1)],
        }
    }
}

impl Default for MemCells {
    fn default() -> Self {
        Self::new(LOG_CAP)
    }
}

impl Cells for MemCells {
    fn get(&self, i: usize) -> u64 {
        self.cells.get(i).copied().unwrap_or(0)
    }
    fn set(&mut self, i: usize, v: u64) {
        if let Some(c) = self.cells.get_mut(i) {
            *c = v;
        }
    }
    fn log_cap(&self) -> usize {
        self.log.len()
    }
    fn log_get(&self, i: usize) -> u64 {
        self.log[i % self.log.len()]
    }
    fn log_set(&mut self, i: usize, v: u64) {
        let n = self.log.len();
        self.log[i % n] = v;
    }
}

/// Cells in a slot of the shared segment, accessed while holding the slot's limiter lock.
struct SharedCells<'a> {
    cells: &'a [AtomicU64; LIMITER_CELLS],
    log: &'a [AtomicU64; LOG_CAP],
}

impl Cells for SharedCells<'_> {
    fn get(&self, i: usize) -> u64 {
        self.cells.get(i).map_or(0, |c| c.load(Ordering::Relaxed))
    }
    fn set(&mut self, i: usize, v: u64) {
        if let Some(c) = self.cells.get(i) {
            c.store(v, Ordering::Relaxed);
        }
    }
    fn log_cap(&self) -> usize {
        LOG_CAP
    }
    fn log_get(&self, i: usize) -> u64 {
        self.log[i % LOG_CAP].load(Ordering::Relaxed)
    }
    fn log_set(&mut self, i: usize, v: u64) {
        self.log[i % LOG_CAP].store(v, Ordering::Relaxed);
    }
}

/// What a limiter allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Permits per window.
    pub limit: u64,
    /// Window length (the task's slice), µs.
    pub window_us: u64,
    /// Burst (token bucket capacity, leaky bucket size); 0 = the algorithm's default.
    pub burst: u64,
}

/// A limiter's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Admitted.
    Admit,
    /// Denied; retrying sooner than this cannot succeed.
    Deny {
        /// µs until a retry may succeed.
        retry_after_us: u64,
    },
}

impl Verdict {
    /// True when admitted.
    pub fn admitted(self) -> bool {
        self == Verdict::Admit
    }
}

fn fingerprint(alg: FallbackAlgorithm, p: &Params) -> u64 {
    let a = alg as u64 + 1;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in [a, p.limit, p.window_us, p.burst] {
        h ^= w;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h | 1
}

/// Decides `n` permits at `now_us` with algorithm `alg` (pure: everything is in `cells`).
///
/// ```
/// use sluice::limiter::{decide, MemCells, Params};
/// use sluice_protocol::FallbackAlgorithm::FixedWindow;
/// let p = Params { limit: 2, window_us: 1_000_000, burst: 0 };
/// let mut c = MemCells::default();
/// assert!(decide(FixedWindow, &p, &mut c, 10, 1).admitted());
/// assert!(decide(FixedWindow, &p, &mut c, 20, 1).admitted());
/// assert!(!decide(FixedWindow, &p, &mut c, 30, 1).admitted());
/// assert!(decide(FixedWindow, &p, &mut c, 1_000_000, 1).admitted());
/// ```
pub fn decide(
    alg: FallbackAlgorithm,
    p: &Params,
    cells: &mut impl Cells,
    now_us: i64,
    n: u64,
) -> Verdict {
    let fp = fingerprint(alg, p);
    if cells.get(0) != fp {
        for i in 0..LIMITER_CELLS {
            cells.set(i, 0);
        }
        cells.set(0, fp);
    }
    if p.window_us == 0 {
        return Verdict::Deny {
            retry_after_us: 1_000_000,
        };
    }
    let now_us = now_us.max(0) as u64;
    match alg {
        FallbackAlgorithm::TokenBucket => token_bucket::decide(p, cells, now_us, n),
        FallbackAlgorithm::FixedWindow => fixed_window::decide(p, cells, now_us, n),
        FallbackAlgorithm::SlidingWindow => sliding_window::decide(p, cells, now_us, n),
        FallbackAlgorithm::SlidingLog => sliding_log::decide(p, cells, now_us, n),
        FallbackAlgorithm::LeakyBucket => leaky_bucket::decide(p, cells, now_us, n),
    }
}

/// Lock timeout of the limiter lock: a holder stuck longer than this (it only runs a few
/// arithmetic operations) is presumed dead.
const LIMITER_LOCK_TIMEOUT_MS: u64 = 200;

/// Decides with the limiter state of `slot` (a slot of `seg`), shared by every process of
/// the host.
pub fn decide_shared(
    seg: &Segment,
    slot: &Slot,
    alg: FallbackAlgorithm,
    p: &Params,
    now_us: i64,
    n: u64,
) -> Verdict {
    let lock = seg.lock(&slot.limiter.lock);
    let token = spin_lock(lock);
    let mut cells = SharedCells {
        cells: &slot.limiter.cells,
        log: &slot.log,
    };
    let v = decide(alg, p, &mut cells, now_us, n);
    lock.unlock(token);
    v
}

fn spin_lock(lock: ShmLock<'_>) -> u64 {
    let mut spins: u32 = 0;
    loop {
        let now_ms = crate::clock::host_ms();
        if let Some(token) = lock.try_fast(now_ms) {
            return token;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            // Rarely: is the holder dead or stuck?
            if let LockAttempt::Acquired { token, .. } =
                lock.try_lock(now_ms, LIMITER_LOCK_TIMEOUT_MS)
            {
                return token;
            }
        }
        if spins.is_multiple_of(16) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Runs `alg` with demand every `step_us` for `dur_us`; returns admitted per window.
    pub fn admitted_per_window(
        alg: FallbackAlgorithm,
        p: &Params,
        start_us: i64,
        step_us: i64,
        dur_us: i64,
    ) -> Vec<u64> {
        let mut c = MemCells::default();
        let windows = (dur_us / p.window_us as i64) as usize;
        let mut out = vec![0u64; windows];
        let mut t = start_us;
        while t < start_us + dur_us {
            if decide(alg, p, &mut c, t, 1).admitted() {
                let w = ((t - start_us) / p.window_us as i64) as usize;
                if let Some(x) = out.get_mut(w) {
                    *x += 1;
                }
            }
            t += step_us;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::FallbackAlgorithm::*;

    #[test]
    fn every_algorithm_holds_the_limit_per_window_under_heavy_demand() {
        let p = Params {
            limit: 300,
            window_us: 1_000_000,
            burst: 0,
        };
        for alg in [
            TokenBucket,
            FixedWindow,
            SlidingWindow,
            SlidingLog,
            LeakyBucket,
        ] {
            // Demand 10x the limit for 10 windows, starting on a window boundary.
            let got = testing::admitted_per_window(alg, &p, 5_000_000, 333, 10_000_000);
            for (i, w) in got.iter().enumerate().skip(1) {
                assert!(
                    (270..=330).contains(w),
                    "{alg:?} window {i}: {w} admitted ({got:?})"
                );
            }
        }
    }

    #[test]
    fn parameter_change_resets_state() {
        let mut c = MemCells::default();
        let p = Params {
            limit: 1,
            window_us: 1_000,
            burst: 0,
        };
        assert!(decide(FixedWindow, &p, &mut c, 0, 1).admitted());
        assert!(!decide(FixedWindow, &p, &mut c, 1, 1).admitted());
        let q = Params { limit: 2, ..p };
        assert!(decide(FixedWindow, &q, &mut c, 2, 1).admitted());
    }

    #[test]
    fn zero_limit_denies() {
        let p = Params {
            limit: 0,
            window_us: 1_000,
            burst: 0,
        };
        for alg in [
            TokenBucket,
            FixedWindow,
            SlidingWindow,
            SlidingLog,
            LeakyBucket,
        ] {
            let mut c = MemCells::default();
            assert!(!decide(alg, &p, &mut c, 5, 1).admitted(), "{alg:?}");
        }
    }
}
