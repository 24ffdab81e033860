//! Sliding window (two weighted fixed windows).
//!
//! Keeps the count of the current and the previous aligned window and estimates the count of
//! the window ending now as `previous × (share of the previous window still inside) + current`,
//! in exact integer arithmetic: `n` is admitted when
//! `previous × (end − now) + (current + n) × window ≤ limit × window`.
//! Smooths the fixed window's boundary burst at the cost of assuming the previous window's
//! admissions were spread evenly. Since the estimate is never below the current count, each
//! aligned window also holds at most `limit`, as in the fixed window.
//!
//! The state is [`super::fixed_window`]'s two words (see there for how a window moves on, and
//! what a grid change or a step back of the clock carries). After a change of the window
//! length, admissions older than the two windows the words describe are not in the estimate's
//! previous part (the per-window bound still holds).

use super::fixed_window::{Grid, current};
use super::{COUNT_MAX, Input, Verdict, Words, cas, pack};

/// Cell of the window word (see [`super::fixed_window`]).
const WINDOW: usize = 2;

pub(super) fn decide(ws: Words<'_>, i: &Input) -> Verdict {
    let g = Grid::new(i);
    let limit = i.p.limit.min(COUNT_MAX) as u128;
    let w_us = g.w as u128 * 1_000;
    loop {
        let (at, x, cur, prev) = current(ws, &g);
        // Standing still at the start of a window ahead (see `current`): all of it is left.
        let left_us = (at.ce * 1_000 - i.now_us.max(at.cs * 1_000)).max(0) as u128;
        let need = (cur as u128 + i.n as u128) * w_us;
        if prev as u128 * left_us + need > limit * w_us {
            let till_end = (at.ce * 1_000 - i.now_us).max(1) as u64;
            let retry_after_us = if need > limit * w_us || prev == 0 {
                till_end
            } else {
                // prev × (end − t') ≤ (limit × window − need)  ⇔  t' ≥ end − room / prev
                let span = (limit * w_us - need) / prev as u128;
                till_end - (span as u64).min(till_end)
            };
            return Verdict::Deny {
                retry_after_us: retry_after_us.max(1),
            };
        }
        if cas(ws.cell(WINDOW), x, pack(at.ce, cur + i.n)) {
            return Verdict::Admit;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::limiter::testing::admitted_per_window;
    use crate::limiter::{MemCells, Params, decide};
    use crate::protocol::FallbackAlgorithm::{FixedWindow, SlidingWindow};

    #[test]
    fn boundary_burst_is_smoothed() {
        let p = Params {
            limit: 100,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        // 100 at the end of window 0 ...
        for _ in 0..100 {
            assert!(decide(SlidingWindow, &p, &c, 999_000, 1).admitted());
        }
        // ... leave almost no room at the start of window 1 (a fixed window would allow 100).
        let mut admitted = 0;
        for _ in 0..100 {
            admitted += decide(SlidingWindow, &p, &c, 1_010_000, 1).admitted() as u32;
        }
        assert!(admitted <= 2, "{admitted}");
        let w = admitted_per_window(SlidingWindow, &p, 0, 500, 6_000_000);
        assert!(w[1..].iter().all(|x| (95..=105).contains(x)), "{w:?}");
    }

    /// Fixed and sliding window share their state: a switch loses nothing.
    #[test]
    fn switching_from_the_fixed_window_keeps_the_counts() {
        let p = Params {
            limit: 10,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        assert!(decide(FixedWindow, &p, &c, 900_000, 10).admitted());
        // Window 1 at 10 %: the estimate holds 9 of the previous 10.
        assert!(decide(SlidingWindow, &p, &c, 1_100_000, 1).admitted());
        assert!(!decide(SlidingWindow, &p, &c, 1_100_000, 1).admitted());
    }
}
