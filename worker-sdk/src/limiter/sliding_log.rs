//! Sliding log: remembers when each admission happened and admits while fewer than `limit`
//! lie within the window ending now. Exact, at 1 ms resolution.
//!
//! The log is a ring of `(ms:44 | count:20)` entries (admissions in the same millisecond share
//! one entry). On a host it is [`crate::shm::LOG_CAP`] entries long; should it fill up (more
//! than that many distinct milliseconds inside one window), later admissions are merged into
//! the newest entry, which makes them expire slightly early: a bounded approximation, only for
//! long windows with sustained traffic.

use super::{Cells, Params, Verdict};

const COUNT_BITS: u32 = 20;
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;

fn entry(ms: u64, count: u64) -> u64 {
    (ms << COUNT_BITS) | count.min(COUNT_MAX)
}

fn parts(e: u64) -> (u64, u64) {
    (e >> COUNT_BITS, e & COUNT_MAX)
}

pub(super) fn decide(p: &Params, cells: &mut impl Cells, now_us: u64, n: u64) -> Verdict {
    let cap = cells.log_cap().max(1) as u64;
    let window_ms = (p.window_us / 1_000).max(1);
    let now_ms = now_us / 1_000;
    let (mut head, mut len, mut total) = (cells.get(1), cells.get(2).min(cap), cells.get(3));
    // Forget admissions that left the window.
    while len > 0 {
        let (ts, c) = parts(cells.log_get(head as usize));
        if ts + window_ms > now_ms {
            break;
        }
        total = total.saturating_sub(c);
        head = (head + 1) % cap;
        len -= 1;
    }
    if len == 0 {
        total = 0;
    }
    let verdict = if total.saturating_add(n) > p.limit || n > COUNT_MAX {
        let oldest = if len > 0 {
            parts(cells.log_get(head as usize)).0
        } else {
            now_ms
        };
        Verdict::Deny {
            retry_after_us: (oldest + window_ms).saturating_sub(now_ms).max(1) * 1_000,
        }
    } else {
        let last_i = ((head + len + cap - 1) % cap) as usize;
        let (last_ts, last_c) = parts(cells.log_get(last_i));
        if len > 0 && (last_ts == now_ms || len == cap) && last_c + n <= COUNT_MAX {
            cells.log_set(last_i, entry(last_ts, last_c + n));
        } else if len < cap {
            cells.log_set(((head + len) % cap) as usize, entry(now_ms, n));
            len += 1;
        } else {
            // Full and the newest entry is saturated: overwrite the oldest (approximation).
            let (_, c) = parts(cells.log_get(head as usize));
            total = total.saturating_sub(c);
            cells.log_set(head as usize, entry(now_ms, n));
            head = (head + 1) % cap;
        }
        total += n;
        Verdict::Admit
    };
    cells.set(1, head);
    cells.set(2, len);
    cells.set(3, total);
    verdict
}

#[cfg(test)]
mod tests {
    use crate::limiter::testing::admitted_per_window;
    use crate::limiter::{MemCells, Params, Verdict, decide};
    use crate::protocol::FallbackAlgorithm::SlidingLog;

    #[test]
    fn any_window_holds_at_most_the_limit() {
        let p = Params {
            limit: 5,
            window_us: 1_000_000,
            burst: 0,
        };
        let mut c = MemCells::new(16);
        let mut times = Vec::new();
        let mut t = 0;
        while t < 5_000_000 {
            if decide(SlidingLog, &p, &mut c, t, 1).admitted() {
                times.push(t);
            }
            t += 7_000;
        }
        for (i, a) in times.iter().enumerate() {
            let inside = times[i..]
                .iter()
                .take_while(|b| **b < a + 1_000_000)
                .count();
            assert!(inside <= 5, "{inside} admissions within 1 s of {a}");
        }
        assert!(times.len() >= 24, "{}", times.len());
    }

    #[test]
    fn retry_after_points_at_the_oldest_expiry() {
        let p = Params {
            limit: 1,
            window_us: 1_000_000,
            burst: 0,
        };
        let mut c = MemCells::new(4);
        assert!(decide(SlidingLog, &p, &mut c, 100_000, 1).admitted());
        assert_eq!(
            decide(SlidingLog, &p, &mut c, 400_000, 1),
            Verdict::Deny {
                retry_after_us: 700_000
            }
        );
        assert!(decide(SlidingLog, &p, &mut c, 1_100_000, 1).admitted());
    }

    #[test]
    fn a_full_log_merges_instead_of_forgetting() {
        let p = Params {
            limit: 1_000,
            window_us: 1_000_000,
            burst: 0,
        };
        let w = admitted_per_window(SlidingLog, &p, 0, 100, 4_000_000);
        assert!(w[1..].iter().all(|x| *x <= 1_000), "{w:?}");
    }
}
