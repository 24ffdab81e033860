//! Sliding window (two weighted fixed windows).
//!
//! Keeps the count of the current and the previous aligned window and estimates the count of
//! the window ending now as `previous × (share of the previous window still inside) + current`.
//! Smooths the fixed window's boundary burst at the cost of assuming the previous window's
//! admissions were spread evenly.

use super::{Cells, Params, Verdict};

pub(super) fn decide(p: &Params, cells: &mut impl Cells, now_us: u64, n: u64) -> Verdict {
    let w = p.window_us;
    let idx = now_us / w;
    let stored = cells.get(1);
    if stored != idx + 1 {
        let prev = if stored == idx { cells.get(2) } else { 0 };
        cells.set(3, prev);
        cells.set(2, 0);
        cells.set(1, idx + 1);
    }
    let cur = cells.get(2);
    let prev = cells.get(3);
    let frac = (now_us - idx * w) as f64 / w as f64;
    let estimate = prev as f64 * (1.0 - frac) + cur as f64;
    if estimate + n as f64 > p.limit as f64 {
        let room = p.limit as f64 - cur as f64 - n as f64;
        let retry_after_us = if room < 0.0 || prev == 0 {
            (idx + 1) * w - now_us
        } else {
            // prev × (1 − f') ≤ room  ⇔  f' ≥ 1 − room / prev
            let f = 1.0 - room / prev as f64;
            ((f - frac).max(0.0) * w as f64).ceil() as u64 + 1
        };
        return Verdict::Deny { retry_after_us };
    }
    cells.set(2, cur + n);
    Verdict::Admit
}

#[cfg(test)]
mod tests {
    use crate::limiter::testing::admitted_per_window;
    use crate::limiter::{MemCells, Params, decide};
    use crate::protocol::FallbackAlgorithm::SlidingWindow;

    #[test]
    fn boundary_burst_is_smoothed() {
        let p = Params {
            limit: 100,
            window_us: 1_000_000,
            burst: 0,
        };
        let mut c = MemCells::default();
        // 100 at the end of window 0 ...
        for _ in 0..100 {
            assert!(decide(SlidingWindow, &p, &mut c, 999_000, 1).admitted());
        }
        // ... leave almost no room at the start of window 1 (a fixed window would allow 100).
        let mut admitted = 0;
        for _ in 0..100 {
            admitted += decide(SlidingWindow, &p, &mut c, 1_010_000, 1).admitted() as u32;
        }
        assert!(admitted <= 2, "{admitted}");
        let w = admitted_per_window(SlidingWindow, &p, 0, 500, 6_000_000);
        assert!(w[1..].iter().all(|x| (95..=105).contains(x)), "{w:?}");
    }
}
