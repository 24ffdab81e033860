//! Fixed window: at most `limit` permits in each window aligned to the slice grid.
//!
//! The simplest counter (the seed's slice keys are fixed windows too). Its known weakness: up
//! to `2 × limit` can pass around a boundary (the end of one window and the start of the
//! next).
//!
//! # State
//!
//! Two words, shared with [`super::sliding_window`]: the *window word* `(end, count)` of the
//! window that counted last, and the *previous word* `(end, count)` of the window before it
//! (only the sliding window reads it; the fixed window keeps it up to date so that the two can
//! be switched without losing anything). An admission is one compare-and-swap of the window
//! word. Moving on to a new window (the first decision in it) is two: the previous word is set
//! to the window that ends, then the window word to the new window. A process that stops
//! between the two has only recorded the previous window (the next decision does the same
//! again); one that stops before the first has changed nothing.
//!
//! Which window the counted admissions belong to is decided by the window's *end*, not its
//! index, so a change of the window length (the slice grid) is safe: the count is forgotten
//! only when the window it counted ended at or before the start of now's window; a window that
//! overlaps now's (a longer or shorter new grid, or a clock that stepped back) has its count
//! carried into now's window.

use std::sync::atomic::Ordering;

use super::{COUNT_MAX, Input, Verdict, Words, cas, pack, unpack};

/// Cell of the window word.
const WINDOW: usize = 2;
/// Cell of the previous window's word.
const PREV: usize = 3;

/// Now on the window grid, in ms (and µs for fractions).
#[derive(Debug, Clone, Copy)]
pub(super) struct Grid {
    /// Now, ms.
    pub t: i64,
    /// Window length, ms.
    pub w: i64,
    /// Start of now's window, ms.
    pub cs: i64,
    /// End of now's window, ms.
    pub ce: i64,
}

impl Grid {
    pub(super) fn new(i: &Input) -> Self {
        let w = i.p.window_us.div_ceil(1_000).max(1) as i64;
        let t = i.now_us / 1_000;
        let cs = t - t % w;
        Self {
            t,
            w,
            cs,
            ce: cs + w,
        }
    }
}

/// The window word once it counts the window of now: `(the grid decided on, the word's
/// value, count, previous window's count)`. Moves the word on to now's window first if needed
/// (see the module docs).
///
/// A word one window *ahead* of now (on the same grid) is where the clock of another caller
/// already is: two processes' clock reads reach the limiter out of order all the time (one is
/// preempted between reading the clock and deciding). Such a decision is made in that window,
/// as if at its start ("the clock stands still"), so a late caller never drags the window
/// back. A word further ahead means the clock itself stepped back: its count is carried into
/// now's window.
pub(super) fn current(ws: Words<'_>, g: &Grid) -> (Grid, u64, u64, u64) {
    let cell = ws.cell(WINDOW);
    let prev_cell = ws.cell(PREV);
    loop {
        let x = cell.load(Ordering::Acquire);
        let (e, c) = unpack(x, g.t);
        let px = prev_cell.load(Ordering::Acquire);
        let (pe, pc) = unpack(px, g.t);
        let at = if e == g.ce + g.w {
            Grid {
                t: g.ce,
                w: g.w,
                cs: g.ce,
                ce: e,
            }
        } else {
            *g
        };
        if e == at.ce {
            // The previous window's count is that of the window that ended where this one
            // started (on another grid: one that ended within the window before).
            let prev = if pe > at.cs - at.w && pe <= at.cs {
                pc
            } else {
                0
            };
            return (at, x, c, prev);
        }
        let mut clear_prev = false;
        let (new_prev, carried) = if e <= g.cs {
            // The counted window is over. If it ended within the window before now's, its
            // admissions are (at most) that window's.
            if e > g.cs - g.w {
                let keep = if pe == g.cs { pc } else { 0 };
                (Some(pack(g.cs, c.max(keep))), 0)
            } else {
                (None, 0)
            }
        } else {
            // It overlaps now's window (new grid, or the clock stepped back): everything it
            // counted may lie in now's window, and so may the previous word's if that ended
            // after now's start.
            let extra = if pe > g.cs { pc } else { 0 };
            clear_prev = extra > 0;
            (None, c.saturating_add(extra).min(COUNT_MAX))
        };
        if let Some(np) = new_prev
            && np != px
            && !cas(prev_cell, px, np)
        {
            continue;
        }
        if cas(cell, x, pack(g.ce, carried)) && clear_prev {
            // The previous word's count now is in the window word: taken out of the previous
            // word only after (a process stopped in between leaves it counted twice, which
            // only denies more).
            let _ = cas(prev_cell, px, pack(pe, 0));
        }
    }
}

pub(super) fn decide(ws: Words<'_>, i: &Input) -> Verdict {
    let g = Grid::new(i);
    let limit = i.p.limit.min(COUNT_MAX);
    loop {
        let (at, x, count, _) = current(ws, &g);
        if count.saturating_add(i.n) > limit {
            return Verdict::Deny {
                retry_after_us: (at.ce * 1_000 - i.now_us).max(1) as u64,
            };
        }
        if cas(ws.cell(WINDOW), x, pack(at.ce, count + i.n)) {
            return Verdict::Admit;
        }
    }
}

/// Counts now's window as full (a change from another family of algorithms).
pub(super) fn fill(ws: Words<'_>, i: &Input) {
    let g = Grid::new(i);
    let limit = i.p.limit.min(COUNT_MAX);
    loop {
        let (at, x, count, _) = current(ws, &g);
        if count >= limit || cas(ws.cell(WINDOW), x, pack(at.ce, limit)) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::limiter::testing::admitted_per_window;
    use crate::limiter::{MemCells, Params, decide};
    use crate::protocol::FallbackAlgorithm::FixedWindow;

    #[test]
    fn exactly_the_limit_per_window() {
        let p = Params {
            limit: 50,
            window_us: 100_000,
            burst: 0,
        };
        let w = admitted_per_window(FixedWindow, &p, 0, 10, 1_000_000);
        assert!(w.iter().all(|x| *x == 50), "{w:?}");
    }

    /// A longer grid whose window holds the old one: what the old window counted stays
    /// counted (a reset would admit the limit again).
    #[test]
    fn a_grid_change_carries_an_overlapping_count() {
        let p = Params {
            limit: 10,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        assert!(decide(FixedWindow, &p, &c, 3_100_000, 10).admitted());
        // Now 2 s windows: [2 s, 4 s) holds the 10 admitted at 3.1 s.
        let q = Params {
            window_us: 2_000_000,
            ..p
        };
        assert!(!decide(FixedWindow, &q, &c, 3_500_000, 1).admitted());
        assert!(decide(FixedWindow, &q, &c, 4_000_000, 10).admitted());
        // And back to 1 s windows at 4.5 s: the word (ending at 6 s) reads as the next 1 s
        // window, so the 10 count in [5 s, 6 s): one window later than they were admitted,
        // which only denies more.
        assert!(!decide(FixedWindow, &p, &c, 4_500_000, 1).admitted());
        assert!(!decide(FixedWindow, &p, &c, 5_000_000, 1).admitted());
        assert!(decide(FixedWindow, &p, &c, 6_000_000, 10).admitted());
    }

    /// A caller whose clock read is late (the window already moved on) counts in the newer
    /// window: it never drags the window back (which would let the newer window count afresh).
    #[test]
    fn a_late_caller_counts_in_the_newer_window() {
        let p = Params {
            limit: 4,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        assert!(decide(FixedWindow, &p, &c, 1_000_100, 3).admitted());
        assert!(decide(FixedWindow, &p, &c, 999_900, 1).admitted());
        assert!(!decide(FixedWindow, &p, &c, 999_950, 1).admitted());
        assert!(!decide(FixedWindow, &p, &c, 1_000_200, 1).admitted());
    }

    /// The clock steps back by an hour: the count is carried into the window of the new now,
    /// then the next window starts afresh (nothing stuck for the hour).
    #[test]
    fn a_step_back_carries_the_count_for_one_window() {
        let p = Params {
            limit: 5,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        let t = 10_000_000_000i64;
        assert!(decide(FixedWindow, &p, &c, t, 5).admitted());
        let back = t - 3_600_000_000 + 300_000;
        assert!(!decide(FixedWindow, &p, &c, back, 1).admitted());
        assert!(decide(FixedWindow, &p, &c, back + 700_000, 5).admitted());
    }
}
