//! Local limiters: what decides while a task is FAILED with `on_failure: local`, and always in
//! mode `local`. Each allows `limit` permits per `window` (the task's `local_limit` per slice)
//! on this host.
//!
//! # Shared and lock-free
//!
//! On a host the state lives in the task's slot of the shared segment, so every process of the
//! host shares one limiter. A decision never takes a lock: every change is one
//! compare-and-swap of one 64-bit word, and the words are laid out so that whatever a process
//! was doing when it stopped (a preemption, `SIGSTOP`, `SIGKILL` at any instruction), what it
//! left behind is a state some complete run could have produced, or one that errs towards
//! denying (a count added and never taken back), never one that admits more. No decision
//! waits for another beyond a bounded number of re-reads (the sliding log, before a denial
//! that depends on another decision's uncommitted cost: see [`sliding_log`]), and nothing can
//! stay stuck.
//!
//! | algorithm | state (words) | admits | burst |
//! |---|---|---|---|
//! | [`token_bucket`] | theoretical arrival time (GCRA), 1 | `limit` per window, evenly refilled | `burst` (default `limit`) |
//! | [`leaky_bucket`] | the same word, read as a water level | a constant drain of `limit` per window | `burst` (default 1 % of `limit`) |
//! | [`fixed_window`] | window end + count, 1 (+1 shared with the sliding window) | `limit` per aligned window | a whole window at its start |
//! | [`sliding_window`] | the same + the previous window's count | `limit` per aligned window, and in any window as estimated from two | none beyond the estimate |
//! | [`sliding_log`] | 128 time buckets + a commit sequence + the window they were written on + a pending count and a take-back count (log words 128 and 136) | `limit` in any window, exactly up to one bucket (window / 127, ≥ 1 ms) | none |
//!
//! # Time
//!
//! Times in the window words are Unix milliseconds kept modulo 2^28 (±37 hours, read relative
//! to now; windows are at most a day), next to a 36-bit count, so one word holds a window and
//! its count. A state older than that reads as some time within ±37 hours of now: at worst an
//! old count is taken for a recent one (one window denied), never the reverse. The token
//! bucket's word is in picoseconds modulo 2^64 (±106 days).
//!
//! The clock may step back (an NTP correction, or simply two processes whose reads of the clock
//! reach the limiter out of order). A decision at a time earlier than what the state has seen
//! never forgets what was counted: a decision one window behind the window words is made in
//! their window (the clock "stands still": a late caller never drags the window back); a window
//! count further ahead is carried into the window of now (and forgotten when that one ends); a
//! bucket far ahead is moved to now; a token bucket deeper in debt than any admission leaves is
//! set to "just empty". So a step back costs at most about a window of admissions. The bucket
//! algorithms' limits hold on the clock that stands still while the host clock steps back
//! ("effective time"); a window the clock revisits after stepping back by more than a window
//! counts afresh from what was carried (up to twice the limit by timestamps).
//!
//! # Changes of the limit, the window and the algorithm
//!
//! Every state is kept in absolute terms (times, counts), never relative to the parameters, so
//! a change of `local_limit`, `burst` or the slice length never resets it: a count made under
//! the old limit counts against the new one; a window count whose window overlaps the current
//! window on a new grid is carried into it; the token bucket's debt is kept in time. The
//! algorithms of one family share their state (token and leaky bucket; fixed and sliding
//! window). A change to another family starts it "full" (as if it had just admitted its whole
//! limit): nothing more is admitted in the window of the change, so a window straddling the
//! change never holds both algorithms' limits.
//!
//! Every algorithm is tested against a plain reference model (`model.rs`: seeded property tests
//! of safety, liveness and no panic), and processes deciding on one slot are SIGKILLed and
//! SIGSTOPped at random (`crashes`).

pub mod fixed_window;
pub mod leaky_bucket;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

#[cfg(test)]
mod model;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::protocol::FallbackAlgorithm;
use crate::shm::{LIMITER_CELLS, LOG_CAP, Segment, Slot};

/// Largest count a window word holds (2^36 − 1, about 6.9 × 10^10): a `local_limit` above it
/// acts as this (window algorithms only; the token and leaky buckets take any limit).
pub const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;

const COUNT_BITS: u32 = 36;
const TIME_BITS: u32 = 28;
const TIME_MASK: u64 = (1 << TIME_BITS) - 1;

/// Longest window: the longest slice (one day). The window words read times within ±37 hours
/// of now, so they tell a window, its successor and its predecessor apart.
const MAX_WINDOW_US: u64 = crate::protocol::MAX_SLICE_MS * 1_000;

/// Cell 0: which family of algorithms last decided (0 = none yet).
const FAMILY: usize = 0;

/// The words of one limiter: a few cells and a ring of log words, in shared memory (a slot of
/// the segment) or plain memory ([`MemCells`]). Only ever read with loads and changed with
/// compare-and-swap.
#[derive(Clone, Copy)]
pub(crate) struct Words<'a> {
    cells: &'a [AtomicU64; LIMITER_CELLS],
    log: &'a [AtomicU64; LOG_CAP],
}

impl Words<'_> {
    #[inline]
    fn cell(&self, i: usize) -> &AtomicU64 {
        &self.cells[i]
    }

    #[inline]
    fn log(&self, i: usize) -> &AtomicU64 {
        &self.log[i % LOG_CAP]
    }
}

/// Compare-and-swap of one word (acquire-release): true when `new` was stored.
#[inline]
fn cas(w: &AtomicU64, old: u64, new: u64) -> bool {
    w.compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

/// Limiter state in plain memory: the same words as a slot of the segment has (tests, models,
/// single-process use). Shared by reference: decisions on one `MemCells` from several threads
/// behave as processes sharing a slot.
#[derive(Debug)]
pub struct MemCells {
    cells: [AtomicU64; LIMITER_CELLS],
    log: Box<[AtomicU64; LOG_CAP]>,
}

impl Default for MemCells {
    fn default() -> Self {
        Self {
            cells: std::array::from_fn(|_| AtomicU64::new(0)),
            log: Box::new(std::array::from_fn(|_| AtomicU64::new(0))),
        }
    }
}

impl MemCells {
    fn words(&self) -> Words<'_> {
        Words {
            cells: &self.cells,
            log: &self.log,
        }
    }
}

/// What a limiter allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Permits per window.
    pub limit: u64,
    /// Window length (the task's slice), µs. The window algorithms count in whole
    /// milliseconds (rounded up).
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

/// `(end ms, count)` in one word: the end modulo 2^28 above a 36-bit count.
#[inline]
fn pack(end_ms: i64, count: u64) -> u64 {
    ((end_ms as u64 & TIME_MASK) << COUNT_BITS) | count.min(COUNT_MAX)
}

/// The `(end ms, count)` of a word, the end read as the time nearest to `reference_ms` with
/// those low 28 bits.
#[inline]
fn unpack(w: u64, reference_ms: i64) -> (i64, u64) {
    let e = w >> COUNT_BITS;
    let d = e.wrapping_sub(reference_ms as u64) & TIME_MASK;
    let d = if d >= 1 << (TIME_BITS - 1) {
        d as i64 - (1 << TIME_BITS)
    } else {
        d as i64
    };
    (reference_ms + d, w & COUNT_MAX)
}

/// The families of algorithms that share state.
fn family(alg: FallbackAlgorithm) -> u64 {
    match alg {
        FallbackAlgorithm::TokenBucket | FallbackAlgorithm::LeakyBucket => 1,
        FallbackAlgorithm::FixedWindow | FallbackAlgorithm::SlidingWindow => 2,
        FallbackAlgorithm::SlidingLog => 3,
    }
}

/// A decision's inputs, checked: times never negative, windows at least 1 ms.
#[derive(Debug, Clone, Copy)]
struct Input {
    alg: FallbackAlgorithm,
    p: Params,
    now_us: i64,
    n: u64,
}

/// Decides `n` permits at `now_us` with algorithm `alg` on the limiter state `cells`.
///
/// ```
/// use sluice::limiter::{decide, MemCells, Params};
/// use sluice_protocol::FallbackAlgorithm::FixedWindow;
/// let p = Params { limit: 2, window_us: 1_000_000, burst: 0 };
/// let c = MemCells::default();
/// assert!(decide(FixedWindow, &p, &c, 10, 1).admitted());
/// assert!(decide(FixedWindow, &p, &c, 20, 1).admitted());
/// assert!(!decide(FixedWindow, &p, &c, 30, 1).admitted());
/// assert!(decide(FixedWindow, &p, &c, 1_000_000, 1).admitted());
/// ```
pub fn decide(
    alg: FallbackAlgorithm,
    p: &Params,
    cells: &MemCells,
    now_us: i64,
    n: u64,
) -> Verdict {
    decide_in(cells.words(), alg, p, now_us, n)
}

/// Decides with the limiter state of `slot`, shared by every process of the host. Never
/// blocks (see the module docs). `seg` is not used (the state needs no lock); it stays in the
/// signature so callers did not change.
pub fn decide_shared(
    _seg: &Segment,
    slot: &Slot,
    alg: FallbackAlgorithm,
    p: &Params,
    now_us: i64,
    n: u64,
) -> Verdict {
    let words = Words {
        cells: &slot.limiter.cells,
        log: &slot.log,
    };
    decide_in(words, alg, p, now_us, n)
}

fn decide_in(ws: Words<'_>, alg: FallbackAlgorithm, p: &Params, now_us: i64, n: u64) -> Verdict {
    if n == 0 {
        return Verdict::Admit;
    }
    if p.window_us == 0 || p.window_us > MAX_WINDOW_US || p.limit == 0 || n > p.limit {
        // Zero window or limit: a meta that allows nothing; a window beyond the longest slice:
        // a meta no manager writes (the words could not tell its windows apart). A cost above
        // the limit can never be admitted. The window is the nearest honest "later".
        return Verdict::Deny {
            retry_after_us: p.window_us.clamp(1_000_000, MAX_WINDOW_US),
        };
    }
    let i = Input {
        alg,
        p: *p,
        // Unix time before 1970 or after the year 36,000 is no time a host has.
        now_us: now_us.clamp(0, 1 << 60),
        n,
    };
    switch_family(ws, &i);
    match alg {
        FallbackAlgorithm::TokenBucket => token_bucket::decide(ws, &i),
        FallbackAlgorithm::LeakyBucket => leaky_bucket::decide(ws, &i),
        FallbackAlgorithm::FixedWindow => fixed_window::decide(ws, &i),
        FallbackAlgorithm::SlidingWindow => sliding_window::decide(ws, &i),
        FallbackAlgorithm::SlidingLog => sliding_log::decide(ws, &i),
    }
}

/// On a change to another family: fills the new family's state for now (it may hold nothing
/// of what the other family admitted), then records the family. Filling first: a process that
/// stops in between leaves the record unchanged, and the next decision fills again.
fn switch_family(ws: Words<'_>, i: &Input) {
    let f = family(i.alg);
    let seen = ws.cell(FAMILY).load(Ordering::Acquire);
    if seen == f {
        return;
    }
    if seen != 0 {
        match i.alg {
            FallbackAlgorithm::TokenBucket => token_bucket::fill(ws, i),
            FallbackAlgorithm::LeakyBucket => leaky_bucket::fill(ws, i),
            FallbackAlgorithm::FixedWindow | FallbackAlgorithm::SlidingWindow => {
                fixed_window::fill(ws, i)
            }
            FallbackAlgorithm::SlidingLog => sliding_log::fill(ws, i),
        }
    }
    let _ = cas(ws.cell(FAMILY), seen, f);
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
        let c = MemCells::default();
        let windows = (dur_us / p.window_us as i64) as usize;
        let mut out = vec![0u64; windows];
        let mut t = start_us;
        while t < start_us + dur_us {
            if decide(alg, p, &c, t, 1).admitted() {
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

    const ALL: [FallbackAlgorithm; 5] = [
        TokenBucket,
        FixedWindow,
        SlidingWindow,
        SlidingLog,
        LeakyBucket,
    ];

    #[test]
    fn every_algorithm_holds_the_limit_per_window_under_heavy_demand() {
        let p = Params {
            limit: 300,
            window_us: 1_000_000,
            burst: 0,
        };
        for alg in ALL {
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
    fn a_limit_change_keeps_what_was_counted() {
        let c = MemCells::default();
        let p = Params {
            limit: 1,
            window_us: 1_000_000,
            burst: 0,
        };
        assert!(decide(FixedWindow, &p, &c, 0, 1).admitted());
        assert!(!decide(FixedWindow, &p, &c, 1, 1).admitted());
        // Raised to 2: one more in this window, not two (a reset would allow two).
        let q = Params { limit: 2, ..p };
        assert!(decide(FixedWindow, &q, &c, 2, 1).admitted());
        assert!(!decide(FixedWindow, &q, &c, 3, 1).admitted());
    }

    #[test]
    fn zero_limit_and_oversized_costs_deny() {
        let p = Params {
            limit: 0,
            window_us: 1_000,
            burst: 0,
        };
        let q = Params { limit: 5, ..p };
        for alg in ALL {
            let c = MemCells::default();
            assert!(!decide(alg, &p, &c, 5, 1).admitted(), "{alg:?}");
            assert!(!decide(alg, &q, &c, 5, 6).admitted(), "{alg:?}");
            assert!(decide(alg, &q, &c, 5, 5).admitted(), "{alg:?}");
        }
    }

    /// A change to another family of algorithms (their states share nothing) starts the new
    /// one full: the window of the change never holds both algorithms' limits.
    #[test]
    fn a_change_of_family_admits_nothing_more_in_its_window() {
        let p = Params {
            limit: 10,
            window_us: 1_000_000,
            burst: 0,
        };
        for from in ALL {
            for to in ALL {
                if family(from) == family(to) {
                    continue;
                }
                let c = MemCells::default();
                let t = 5_000_000;
                assert!(decide(from, &p, &c, t, 1).admitted(), "{from:?}");
                assert!(
                    !decide(to, &p, &c, t + 1_000, 1).admitted(),
                    "{from:?} → {to:?}"
                );
                // Within two windows it admits again.
                assert!(
                    decide(to, &p, &c, t + 2_100_000, 1).admitted(),
                    "{from:?} → {to:?} stays full"
                );
            }
        }
    }

    #[test]
    fn words_read_times_near_the_reference() {
        let now = 1_700_000_123_456i64;
        for end in [now, now - 86_400_000, now + 86_400_000, now - 1, now + 1] {
            let w = pack(end, 77);
            assert_eq!(unpack(w, now), (end, 77));
        }
        assert_eq!(unpack(pack(now, COUNT_MAX + 5), now).1, COUNT_MAX);
    }
}
#[cfg(test)]
mod stalled_holder {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::protocol::FallbackAlgorithm::*;
    use crate::shm::{LockAttempt, Segment};

    /// Item 11 (issue 23): a process stopped inside the limiter's critical section (here: the
    /// limiter's lock word held by another live participant, re-stamped so it never looks
    /// stale) must neither stall other callers nor be taken over (two writers).
    #[test]
    fn a_stalled_holder_neither_stalls_nor_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let (seg, _) = Segment::open(&path, 5).unwrap();
        let (holder, _) = Segment::open(&path, 5).unwrap();
        let p = Params {
            limit: 10,
            window_us: 1_000_000,
            burst: 0,
        };
        for (k, alg) in [
            TokenBucket,
            FixedWindow,
            SlidingWindow,
            SlidingLog,
            LeakyBucket,
        ]
        .into_iter()
        .enumerate()
        {
            let slot = seg.slot(k).unwrap();
            let word = &slot.limiter.lock;
            let LockAttempt::Acquired { token, .. } =
                holder.lock(word).try_lock(crate::clock::host_ms(), 1_000)
            else {
                panic!("the lock should be free");
            };
            let stop = Arc::new(AtomicBool::new(false));
            let done = Arc::new(AtomicBool::new(false));
            std::thread::scope(|s| {
                // The holder stays alive and keeps its stamp fresh: from outside it is a live
                // process inside the critical section.
                let h = s.spawn(|| {
                    let mut t = token;
                    let deadline = std::time::Instant::now() + Duration::from_secs(5);
                    while !done.load(Ordering::Acquire) && std::time::Instant::now() < deadline {
                        let fresh =
                            (t & !0xFFFF_FFFF) | (crate::clock::host_ms() as u64 & 0xFFFF_FFFF);
                        if word
                            .compare_exchange(t, fresh, Ordering::AcqRel, Ordering::Acquire)
                            .is_err()
                        {
                            return false; // taken over
                        }
                        t = fresh;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    stop.store(true, Ordering::Release);
                    word.store(0, Ordering::Release);
                    true
                });
                let now = crate::clock::host_us();
                let v = decide_shared(&seg, slot, alg, &p, now, 1);
                let finished_while_held = !stop.load(Ordering::Acquire);
                done.store(true, Ordering::Release);
                let kept = h.join().unwrap();
                assert!(v.admitted(), "{alg:?}: {v:?}");
                assert!(
                    finished_while_held,
                    "{alg:?}: the decision waited for the stalled holder"
                );
                assert!(
                    kept,
                    "{alg:?}: the holder's lock was taken over (two writers)"
                );
            });
        }
    }
}

/// Processes killed (`SIGKILL`) or stopped (`SIGSTOP`) at random points of their decisions,
/// while others go on deciding on the same slot: nothing is stuck and no two writers corrupt
/// anything. Every process decides cost 1 at one fixed time (no refill), so exactly `LIMIT` can
/// ever be admitted; each admission is appended to a file after the decision. At the end:
/// `reported + what is still admitted ≤ LIMIT` (never more than the limit), and at most one
/// permit per killed process is lost (killed between its decision and its report, or, for the
/// sliding log, between adding its cost and committing it).
#[cfg(test)]
mod crashes {
    use std::io::Write;
    use std::process::{Child, Command};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::protocol::FallbackAlgorithm::*;
    use crate::shm::Segment;

    const LIMIT: u64 = 1_000_000;
    const P: Params = Params {
        limit: LIMIT,
        window_us: 10_000_000,
        // The leaky bucket's default (1 %) would hold only 10,000 at one time.
        burst: LIMIT,
    };
    const T: i64 = 1_700_000_000_123_456;
    const ALGS: [FallbackAlgorithm; 5] = [
        TokenBucket,
        LeakyBucket,
        FixedWindow,
        SlidingWindow,
        SlidingLog,
    ];
    const ENV: &str = "SLUICE_LIMITER_CHILD";

    /// The child: decides on the slot until killed (does nothing unless started by the parent).
    #[test]
    fn child_hammer() {
        let Ok(spec) = std::env::var(ENV) else {
            return;
        };
        let parts: Vec<&str> = spec.split('|').collect();
        let (seg, _) = Segment::open(parts[0].as_ref(), ALGS.len() as u32).unwrap();
        let k: usize = parts[1].parse().unwrap();
        let slot = seg.slot(k).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(parts[2])
            .unwrap();
        loop {
            if decide_shared(&seg, slot, ALGS[k], &P, T, 1).admitted() {
                f.write_all(b"x").unwrap();
            }
        }
    }

    fn spawn(seg: &std::path::Path, k: usize, report: &std::path::Path) -> Child {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "limiter::crashes::child_hammer",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV, format!("{}|{k}|{}", seg.display(), report.display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    }

    fn signal(c: &Child, sig: i32) {
        // SAFETY: kill(2) on a child of ours that has not been reaped yet.
        unsafe { libc::kill(c.id() as i32, sig) };
    }

    #[test]
    fn killed_and_stopped_processes_leave_nothing_stuck() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let (seg, _) = Segment::open(&path, ALGS.len() as u32).unwrap();
        let mut rng = crate::protocol::unix_ms() as u64 | 1;
        let mut next = move |m: u64| {
            // xorshift: enough to pick victims and pauses.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        for (k, alg) in ALGS.into_iter().enumerate() {
            let report = dir.path().join(format!("admitted-{k}"));
            std::fs::write(&report, b"").unwrap();
            let slot = seg.slot(k).unwrap();
            let mut children: Vec<(Child, bool)> =
                (0..4).map(|_| (spawn(&path, k, &report), false)).collect();
            let (mut kills, mut mine) = (0u64, 0u64);
            let deadline = Instant::now() + Duration::from_millis(1_000);
            while Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5 + next(30)));
                let v = next(children.len() as u64) as usize;
                match next(3) {
                    0 => {
                        signal(&children[v].0, libc::SIGKILL);
                        children[v].0.wait().unwrap();
                        kills += 1;
                        children[v] = (spawn(&path, k, &report), false);
                    }
                    _ => {
                        let stopped = children[v].1;
                        signal(
                            &children[v].0,
                            if stopped {
                                libc::SIGCONT
                            } else {
                                libc::SIGSTOP
                            },
                        );
                        children[v].1 = !stopped;
                    }
                }
                // The parent decides too, whoever is stopped where: it never waits.
                for _ in 0..100 {
                    mine += decide_shared(&seg, slot, alg, &P, T, 1).admitted() as u64;
                }
            }
            for (c, _) in &mut children {
                signal(c, libc::SIGKILL);
                c.wait().unwrap();
                kills += 1;
            }
            let reported = std::fs::metadata(&report).unwrap().len();
            let mut left = 0u64;
            for chunk in [1_000, 1] {
                while decide_shared(&seg, slot, alg, &P, T, chunk).admitted() {
                    left += chunk;
                    assert!(left <= LIMIT, "{alg:?}: admits without end");
                }
            }
            let total = reported + mine + left;
            eprintln!(
                "{alg:?}: children reported {reported}, parent {mine}, left {left}, {kills} kills"
            );
            assert!(total <= LIMIT, "{alg:?}: {total} admitted, limit {LIMIT}");
            assert!(
                total + kills >= LIMIT,
                "{alg:?}: {total} admitted + {kills} kills < limit {LIMIT}: permits lost"
            );
        }
    }
}
