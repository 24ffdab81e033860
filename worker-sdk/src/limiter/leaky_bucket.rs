//! Leaky bucket (as a meter): every admission pours `n` units into a bucket that leaks at
//! `limit` per window; a request that would overflow the bucket (`burst` units, default 1 % of
//! the limit, at least 1) is denied. The output is a nearly constant drain.
//!
//! Mathematically this is the token bucket with a small burst (both are GCRA); it is kept as
//! its own water-level implementation because that is how operators reason about it, and its
//! default is the smooth one.

use super::{Cells, Params, Verdict};

pub(super) fn decide(p: &Params, cells: &mut impl Cells, now_us: u64, n: u64) -> Verdict {
    if p.limit == 0 {
        return Verdict::Deny {
            retry_after_us: p.window_us,
        };
    }
    let unit_ns = ((p.window_us as u128 * 1_000) / p.limit as u128).max(1) as u64;
    let burst = if p.burst == 0 {
        (p.limit / 100).max(1)
    } else {
        p.burst
    };
    let size = unit_ns.saturating_mul(burst);
    let now = now_us.saturating_mul(1_000);
    let last = cells.get(2);
    let leaked = now.saturating_sub(last);
    let level = cells.get(1).saturating_sub(leaked);
    cells.set(2, now.max(last));
    let pour = unit_ns.saturating_mul(n);
    if level.saturating_add(pour) > size {
        cells.set(1, level);
        return Verdict::Deny {
            retry_after_us: (level + pour - size).div_ceil(1_000),
        };
    }
    cells.set(1, level + pour);
    Verdict::Admit
}

#[cfg(test)]
mod tests {
    use crate::limiter::testing::admitted_per_window;
    use crate::limiter::{MemCells, Params, decide};
    use crate::protocol::FallbackAlgorithm::LeakyBucket;

    #[test]
    fn drains_evenly() {
        let p = Params {
            limit: 10,
            window_us: 1_000_000,
            burst: 1,
        };
        let mut c = MemCells::default();
        assert!(decide(LeakyBucket, &p, &mut c, 0, 1).admitted());
        assert!(!decide(LeakyBucket, &p, &mut c, 50_000, 1).admitted());
        assert!(decide(LeakyBucket, &p, &mut c, 100_000, 1).admitted());
        let w = admitted_per_window(LeakyBucket, &p, 0, 1_000, 3_000_000);
        assert!(w.iter().all(|x| *x == 10), "{w:?}");
    }
}
