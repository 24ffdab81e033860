//! Fixed window: at most `limit` permits in each window aligned to the slice grid.
//!
//! The simplest counter (the seed's slice keys are fixed windows too). Its known weakness: up
//! to `2 × limit` can pass around a boundary (the end of one window and the start of the
//! next).

use super::{Cells, Params, Verdict};

pub(super) fn decide(p: &Params, cells: &mut impl Cells, now_us: u64, n: u64) -> Verdict {
    let idx = now_us / p.window_us;
    if cells.get(1) != idx + 1 {
        cells.set(1, idx + 1);
        cells.set(2, 0);
    }
    let count = cells.get(2);
    if count.saturating_add(n) > p.limit {
        return Verdict::Deny {
            retry_after_us: (idx + 1) * p.window_us - now_us,
        };
    }
    cells.set(2, count + n);
    Verdict::Admit
}

#[cfg(test)]
mod tests {
    use crate::limiter::Params;
    use crate::limiter::testing::admitted_per_window;
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
}
