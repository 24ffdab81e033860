//! Token bucket, implemented as GCRA (the generic cell rate algorithm).
//!
//! A bucket of `burst` tokens refilled with `limit` tokens per window is the same as
//! remembering one number, the *theoretical arrival time* `tat`: the time at which the bucket
//! would be full again. With emission interval `T = window / limit` and tolerance
//! `τ = burst × T`, a request for `n` at `now` is admitted when
//! `max(tat, now) + n·T − now ≤ τ`, and then `tat` moves to `max(tat, now) + n·T`.
//! One word of state, no refill timer, exact integer arithmetic in nanoseconds.
//!
//! ```
//! use sluice::limiter::{decide, MemCells, Params};
//! use sluice_protocol::FallbackAlgorithm::TokenBucket;
//! // 10 per second, burst 2: T = 100 ms.
//! let p = Params { limit: 10, window_us: 1_000_000, burst: 2 };
//! let mut c = MemCells::default();
//! assert!(decide(TokenBucket, &p, &mut c, 0, 1).admitted());
//! assert!(decide(TokenBucket, &p, &mut c, 0, 1).admitted());
//! // The burst is spent; the next token arrives 100 ms later.
//! let v = decide(TokenBucket, &p, &mut c, 0, 1);
//! assert_eq!(v, sluice::limiter::Verdict::Deny { retry_after_us: 100_000 });
//! assert!(decide(TokenBucket, &p, &mut c, 100_000, 1).admitted());
//! ```

use super::{Cells, Params, Verdict};

pub(super) fn decide(p: &Params, cells: &mut impl Cells, now_us: u64, n: u64) -> Verdict {
    if p.limit == 0 {
        return Verdict::Deny {
            retry_after_us: p.window_us,
        };
    }
    let t_ns = ((p.window_us as u128 * 1_000) / p.limit as u128).max(1) as u64;
    let burst = if p.burst == 0 { p.limit } else { p.burst };
    let tau = t_ns.saturating_mul(burst);
    let now = now_us.saturating_mul(1_000);
    let tat = cells.get(1).max(now);
    let new_tat = tat.saturating_add(t_ns.saturating_mul(n));
    if new_tat - now > tau {
        return Verdict::Deny {
            retry_after_us: (new_tat - tau - now).div_ceil(1_000),
        };
    }
    cells.set(1, new_tat);
    Verdict::Admit
}

#[cfg(test)]
mod tests {
    use crate::limiter::Params;
    use crate::limiter::testing::admitted_per_window;
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
}
