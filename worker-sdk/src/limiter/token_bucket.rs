//! Token bucket, implemented as GCRA (the generic cell rate algorithm).
//!
//! A bucket of `burst` tokens refilled with `limit` tokens per window is the same as
//! remembering one number, the *theoretical arrival time* `tat`: the time at which the bucket
//! would be full again. With emission interval `T = window / limit` and tolerance
//! `τ = burst × T`, a request for `n` at `now` is admitted when
//! `max(tat, now) + n·T − now ≤ τ`, and then `tat` moves to `max(tat, now) + n·T`.
//! One word of state, no refill timer, and a decision is one compare-and-swap of that word.
//!
//! # Arithmetic
//!
//! `tat` is kept in picoseconds modulo 2^64 and read relative to now (`tat − now` is the debt,
//! valid within ±106 days; `τ` is capped at 2^61 ps, about 26 days). `n·T` is rounded up to a
//! whole picosecond, so each admission may cost up to 1 ps more than exact; `τ` is given a
//! slack of `burst` ps so that a full bucket still admits exactly `burst` in any split (a full
//! bucket holds at most `burst` admissions). The only admission beyond the exact bucket this can
//! allow is `burst` ps worth of refill: none unless `burst × rate` exceeds 10^12 per second.
//!
//! # Costs above the burst
//!
//! A request costing more than `burst` (possible when `burst` < `limit`, and the rule for the
//! leaky bucket's small default) would never fit the bucket. It is admitted when the bucket is
//! full (no debt), and then leaves the bucket that much in debt: the request is paid for before
//! anything else passes. Costs above `limit` are never admitted.
//!
//! # Bound
//!
//! Over any interval `[a, b]` (of effective time, see the module docs of
//! [`crate::limiter`]), `Σ n·window/limit ≤ (b − a) + max(τ, largest n·T) + slack`, each
//! admission weighed with the parameters it was decided under and `τ` the largest in force:
//! with fixed parameters and costs within the burst, at most
//! `burst + limit × (b − a) / window`. The debt is kept in time across a change of parameters
//! (a spent bucket stays spent). A debt deeper than any admission can leave
//! (`max(τ, window) + slack`) can only come from a clock that stepped back: it is cut to
//! `max(τ, window)`, so the bucket is empty now and refills from here.
//!
//! ```
//! use sluice::limiter::{decide, MemCells, Params};
//! use sluice_protocol::FallbackAlgorithm::TokenBucket;
//! // 10 per second, burst 2: T = 100 ms.
//! let p = Params { limit: 10, window_us: 1_000_000, burst: 2 };
//! let c = MemCells::default();
//! assert!(decide(TokenBucket, &p, &c, 0, 1).admitted());
//! assert!(decide(TokenBucket, &p, &c, 0, 1).admitted());
//! // The burst is spent; the next token arrives 100 ms later.
//! let v = decide(TokenBucket, &p, &c, 0, 1);
//! assert_eq!(v, sluice::limiter::Verdict::Deny { retry_after_us: 100_000 });
//! assert!(decide(TokenBucket, &p, &c, 100_000, 1).admitted());
//! ```

use std::sync::atomic::Ordering;

use super::{Input, Verdict, Words, cas};

/// Cell of the theoretical arrival time.
const TAT: usize = 1;

/// Largest `τ`, ps (2^61 ≈ 26.7 days): keeps `tat − now` far inside ±2^63.
pub(super) const TAU_MAX_PS: u128 = 1 << 61;

const PS_PER_US: u128 = 1_000_000;

/// GCRA's constants for one decision, in ps.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gcra {
    /// Tolerance `τ` (capped).
    pub tau: u128,
    /// Rounding slack: `burst` ps.
    pub slack: u128,
    /// `n·T`, rounded up.
    pub inc: u128,
    /// The window (`limit · T`): the cost of the largest admissible request.
    pub window: u128,
    /// Now, ps modulo 2^64.
    pub now: u64,
}

impl Gcra {
    pub(super) fn new(i: &Input, burst: u64) -> Self {
        // Saturating: parameters read back from the segment are not trusted to be in range.
        let w = (i.p.window_us as u128 * PS_PER_US).min(TAU_MAX_PS);
        let limit = i.p.limit as u128;
        Self {
            tau: ((burst as u128).saturating_mul(w) / limit).min(TAU_MAX_PS),
            slack: (burst as u128).min(1 << 40),
            inc: (i.n as u128).saturating_mul(w).div_ceil(limit),
            window: w,
            now: (i.now_us as u64).wrapping_mul(PS_PER_US as u64),
        }
    }

    /// The debt a state word stands for at now: `max(tat − now, 0)` (0 for the unused word 0).
    pub(super) fn debt(&self, tat: u64) -> u128 {
        if tat == 0 {
            return 0;
        }
        (tat.wrapping_sub(self.now) as i64).max(0) as u128
    }

    /// The word for a debt of `d` at now (never 0: 0 means "unused").
    pub(super) fn word(&self, d: u128) -> u64 {
        match self.now.wrapping_add(d as u64) {
            0 => 1,
            w => w,
        }
    }
}

/// The token bucket's burst: `burst`, or `limit` when 0.
fn burst(i: &Input) -> u64 {
    if i.p.burst == 0 { i.p.limit } else { i.p.burst }
}

pub(super) fn decide(ws: Words<'_>, i: &Input) -> Verdict {
    gcra(ws, i, burst(i))
}

pub(super) fn fill(ws: Words<'_>, i: &Input) {
    fill_gcra(ws, i, burst(i))
}

/// One GCRA decision on the word [`TAT`].
pub(super) fn gcra(ws: Words<'_>, i: &Input, burst: u64) -> Verdict {
    let g = Gcra::new(i, burst);
    // A cost above the burst passes a full bucket (and leaves it that much in debt): without
    // this, such a request could never be admitted at all.
    let room = g.tau.max(g.inc) + g.slack;
    // The deepest debt an admission can leave (any admissible cost is at most `limit`, one
    // window); anything deeper means the clock stepped back (or τ shrank).
    let deepest = g.tau.max(g.window) + g.slack;
    let cell = ws.cell(TAT);
    loop {
        let tat = cell.load(Ordering::Acquire);
        let debt = g.debt(tat);
        if debt > deepest {
            // The bucket is "just empty" now: the debt before the step is kept (or cut to the
            // deepest an admission leaves).
            let _ = cas(cell, tat, g.word(g.tau.max(g.window)));
            continue;
        }
        if debt + g.inc > room {
            return Verdict::Deny {
                retry_after_us: ((debt + g.inc - room).div_ceil(PS_PER_US) as u64).max(1),
            };
        }
        if cas(cell, tat, g.word(debt + g.inc)) {
            return Verdict::Admit;
        }
    }
}

/// Empties the bucket now (a change from another family of algorithms): debt at least `τ`.
pub(super) fn fill_gcra(ws: Words<'_>, i: &Input, burst: u64) {
    let g = Gcra::new(i, burst);
    let cell = ws.cell(TAT);
    loop {
        let tat = cell.load(Ordering::Acquire);
        if g.debt(tat) >= g.tau || cas(cell, tat, g.word(g.tau)) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::limiter::testing::admitted_per_window;
    use crate::limiter::{MemCells, Params, decide};
    use crate::protocol::FallbackAlgorithm::TokenBucket;

    #[test]
    fn first_window_carries_the_burst_then_exactly_the_limit() {
        let p = Params {
            limit: 100,
            window_us: 1_000_000,
            burst: 0,
        };
        let w = admitted_per_window(TokenBucket, &p, 0, 1_000, 5_000_000);
        assert!((199..=200).contains(&w[0]), "{w:?}");
        assert!(w[1..].iter().all(|x| (99..=101).contains(x)), "{w:?}");
    }

    /// `T` = 1 s / 3 is no whole number of picoseconds: a full bucket still admits its whole
    /// burst, one at a time.
    #[test]
    fn a_burst_is_admitted_whole_whatever_the_rounding() {
        let p = Params {
            limit: 3,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        for k in 0..3 {
            assert!(decide(TokenBucket, &p, &c, 5_000_000, 1).admitted(), "{k}");
        }
        assert!(!decide(TokenBucket, &p, &c, 5_000_000, 1).admitted());
    }

    /// 30,000,000 per 100 ms: `T` = 3.33 ns. Rounded down to whole nanoseconds (before), the
    /// bucket refilled 11 % too fast; in picoseconds, rounded up, it never refills faster.
    #[test]
    fn a_high_rate_is_never_rounded_up() {
        let p = Params {
            limit: 30_000_000,
            window_us: 100_000,
            burst: 0,
        };
        let c = MemCells::default();
        let mut admitted = 0u64;
        // Demand 4,000,000 every 10 ms for 1 s, in requests of 1,000,000.
        for step in 0..100 {
            for _ in 0..4 {
                if decide(TokenBucket, &p, &c, 9_000_000 + step * 10_000, 1_000_000).admitted() {
                    admitted += 1_000_000;
                }
            }
        }
        // At most the burst (one window) plus ten windows.
        assert!(admitted <= 330_000_000, "{admitted}");
        assert!(admitted >= 320_000_000, "{admitted}");
    }

    /// A clock stepped back by an hour: the bucket is empty at the new now, then refills as
    /// usual (nothing stuck for the hour).
    #[test]
    fn a_step_back_costs_at_most_the_bucket() {
        let p = Params {
            limit: 10,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        let t = 7_200_000_000i64;
        assert!(decide(TokenBucket, &p, &c, t, 10).admitted());
        let back = t - 3_600_000_000;
        assert!(!decide(TokenBucket, &p, &c, back, 1).admitted());
        assert!(decide(TokenBucket, &p, &c, back + 100_000, 1).admitted());
        assert!(!decide(TokenBucket, &p, &c, back + 100_000, 1).admitted());
    }
}
