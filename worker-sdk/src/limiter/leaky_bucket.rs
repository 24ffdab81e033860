//! Leaky bucket (as a meter): every admission pours `n` units into a bucket that leaks at
//! `limit` per window; a request that would overflow the bucket (`burst` units, default 1 % of
//! the limit, at least 1) is denied. The output is a nearly constant drain.
//!
//! The water level at `now` is `max(drained − now, 0)` where `drained` is the time the bucket
//! would be empty: the very word GCRA keeps as its theoretical arrival time, with the bucket's
//! size as the tolerance. So the leaky bucket *is* [`super::token_bucket`]'s algorithm with a
//! small default burst, and shares its word (switching between the two keeps the level). It
//! stays a name of its own because that is how operators reason about it, and its default is
//! the smooth one.

use super::{Input, Verdict, Words, token_bucket};

/// The bucket's size in permits: `burst`, or 1 % of the limit (at least 1) when 0.
fn size(i: &Input) -> u64 {
    if i.p.burst == 0 {
        (i.p.limit / 100).max(1)
    } else {
        i.p.burst
    }
}

pub(super) fn decide(ws: Words<'_>, i: &Input) -> Verdict {
    token_bucket::gcra(ws, i, size(i))
}

pub(super) fn fill(ws: Words<'_>, i: &Input) {
    token_bucket::fill_gcra(ws, i, size(i))
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
        let c = MemCells::default();
        assert!(decide(LeakyBucket, &p, &c, 0, 1).admitted());
        assert!(!decide(LeakyBucket, &p, &c, 50_000, 1).admitted());
        assert!(decide(LeakyBucket, &p, &c, 100_000, 1).admitted());
        let w = admitted_per_window(LeakyBucket, &p, 0, 1_000, 3_000_000);
        assert!(w.iter().all(|x| *x == 10), "{w:?}");
    }
}
