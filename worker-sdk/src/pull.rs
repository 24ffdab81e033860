//! How much quota to pull, and when (pure).
//!
//! The seed pulls `host threshold / 50` per call ("单机阈值与拉取值的比值为50"). Sluice does not
//! know the host's share of the threshold up front, so it estimates it from what this host
//! actually consumed, and sizes every pull from that estimate:
//!
//! ```text
//!  share    = min(cap, max(demand in the last slice, consumption so far projected to the
//!                          whole slice))            (first slice ever: cap)
//!  chunk    = share / PULLS_PER_SLICE               (~25 pulls per slice at a steady share)
//!  chunk   ≥ rate × 4 round trips                   (a chunk outlives the pull that refills it)
//!  chunk   ≥ min(rate × 20 ms, cap / 25)            (and a busy machine's scheduling delay, but
//!                                                    no more of the cap than a steady chunk)
//!  chunk   ≤ rate × time left in the slice × 1.25   (little is stranded at the slice's end)
//!  chunk   ≥ the largest n asked for; a task's fixed `pull` replaces all of this
//!  low water = max(chunk / 2, rate × (2 round trips + 2 ms)), below the chunk
//! ```
//!
//! When the local quota falls below the low-water mark a decision pokes the background puller,
//! so under steady load the refill lands before the quota runs out: with half a chunk left
//! the refill has half a chunk's worth of time (≈ 1/50 of the slice) to arrive, which covers
//! a busy machine's scheduling delays, and it costs no extra pulls (each still brings a chunk). Near a slice's end the
//! next slice's first chunk is prefetched ([`prefetch_lead_ms`]), so the first decisions of a
//! slice do not wait either.
//!
//! With 25 pulls per slice per host, a task shared evenly by `h` hosts costs about `25·h`
//! pulls per `threshold` admitted: 0.025 calls per admitted decision at 2,000/s over 2 hosts,
//! half of the seed's 0.05, and less when demand exceeds the threshold (the slice is spent in
//! fewer, rate-sized chunks). `docs/sdk.md` has the measured numbers.

/// Target pulls per slice for a host consuming its share at a steady rate.
pub const PULLS_PER_SLICE: u64 = 25;

/// How late the background thread that pulls may run on a busy machine, ms: a chunk holds
/// this much of the host's demand when that is no more than `cap / 25` (the largest steady
/// chunk, so a host never holds more of a short slice than before: with several hosts over
/// their share, bigger chunks gave the first hosts to pull everything — the review of issue 23
/// measured 200/200/200/200/200/0/0/0/0/0 for 10 hosts on a cap of 1,000 with 20 ms held),
/// and the next slice's first chunk is prefetched at least this long before it starts (at
/// most a quarter of the slice). Before, a host deciding 150 times a second on 100 ms slices
/// of cap 28 pulled one permit at a time and, while the cores were busy, refused a third of
/// its decisions with quota left in Redis (the soak's seed 523022005, issue 23 item 19: 11 of
/// a cap of 28 admitted with a demand of 31); it now pulls two.
pub const SCHED_MS: f64 = 20.0;

/// What the policy looks at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PullInput {
    /// The task's fixed pull size (0 = automatic).
    pub fixed: u64,
    /// The slice's threshold (the last `cap` Redis reported, else the task threshold).
    pub cap: u64,
    /// Slice length.
    pub slice_ms: u64,
    /// Time since the slice started.
    pub elapsed_ms: f64,
    /// Permits this host admitted in the slice so far.
    pub consumed: u64,
    /// Demand (admitted + rejected) this host saw in the previous slice; 0 = unknown.
    pub demand_prev: u64,
    /// Round trip of the last pull.
    pub rtt_ms: f64,
    /// Largest `n` a decision asked for.
    pub max_n: u64,
}

/// The policy's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullPlan {
    /// Permits to ask for.
    pub want: u64,
    /// Refill when the local quota falls below this.
    pub low_water: u64,
}

/// Sizes a pull.
///
/// ```
/// use sluice::pull::{plan, PullInput};
/// let base = PullInput { fixed: 0, cap: 2_000, slice_ms: 1_000, elapsed_ms: 0.0, consumed: 0,
///                        demand_prev: 1_000, rtt_ms: 0.5, max_n: 1 };
/// // A host that used 1,000 of 2,000 last slice pulls 1,000 / 25 = 40 at a time.
/// assert_eq!(plan(&base).want, 40);
/// // Demand far above the threshold: the share is the whole cap, 80 per pull.
/// assert_eq!(plan(&PullInput { demand_prev: 50_000, ..base }).want, 80);
/// // 20 ms before the end, at 1 permit/ms: at most 1.25 × 20 = 25.
/// assert_eq!(plan(&PullInput { elapsed_ms: 980.0, consumed: 980, ..base }).want, 25);
/// // A fixed pull size wins.
/// assert_eq!(plan(&PullInput { fixed: 7, ..base }).want, 7);
/// ```
pub fn plan(i: &PullInput) -> PullPlan {
    let slice_ms = i.slice_ms.max(1) as f64;
    let cap = i.cap.max(1);
    let elapsed = i.elapsed_ms.clamp(0.0, slice_ms);
    let projected = if elapsed >= (slice_ms / 20.0).max(1.0) && i.consumed > 0 {
        (i.consumed as f64 * slice_ms / elapsed) as u64
    } else {
        0
    };
    let share = if i.demand_prev == 0 && projected == 0 {
        cap
    } else {
        i.demand_prev.max(projected).min(cap).max(1)
    };
    let rate_per_ms = share as f64 / slice_ms;
    let rtt = i.rtt_ms.max(0.2);
    // A cost above the cap is refused (LIMITED) and never sizes a pull: one such request must
    // not make this host hoard whole slices from then on.
    let max_n = i.max_n.clamp(1, cap);
    let want = if i.fixed > 0 {
        i.fixed.max(max_n)
    } else {
        let base = share.div_ceil(PULLS_PER_SLICE);
        let by_rate = ((rate_per_ms * 4.0 * rtt).ceil() as u64)
            .max(((rate_per_ms * SCHED_MS).ceil() as u64).min(cap.div_ceil(PULLS_PER_SLICE)));
        let left = slice_ms - elapsed;
        let by_end = (rate_per_ms * left * 1.25).ceil() as u64;
        base.max(by_rate).min(by_end).max(max_n)
    };
    let want = want.min(crate::shm::MAX_COUNT as u64);
    let by_rate = (rate_per_ms * (2.0 * rtt + 2.0)).ceil() as u64;
    let low_water = want
        .div_ceil(2)
        .max(by_rate)
        .min(want.saturating_sub(1))
        .max(max_n.min(want))
        .max(1);
    PullPlan { want, low_water }
}

/// Sizes the pulls of a paced slice (`"pacing": "smooth"`), from [`plan`]'s answer.
///
/// The pull script grants at most what the pace has released, looking ahead by
/// `ahead = min(slice / 40, 1 s)` (see `PACE_LUA`), and the decision path spends the stock no
/// faster than the pace. So a host's useful stock is about `ahead`'s worth of the pace
/// (`cap / 40` permits): the chunk is at least that, and the low-water mark at most half of it,
/// so the refill is asked for with half the look-ahead (12 ms of a 1 s slice) still in hand.
/// A host at the full pace pulls about 80 times per slice.
///
/// ```
/// use sluice::pull::{paced, PullPlan};
/// // 1,000 per 1 s slice: 25 permits of look-ahead, refill below 12.
/// let p = paced(PullPlan { want: 80, low_water: 40 }, 1_000, 1_000, 1);
/// assert_eq!((p.want, p.low_water), (80, 12));
/// ```
pub fn paced(p: PullPlan, cap: u64, slice_ms: u64, max_n: u64) -> PullPlan {
    let slice_ms = slice_ms.max(1);
    let ahead_ms = (slice_ms / 40).min(1_000);
    let ahead = (cap as u128 * ahead_ms as u128 / slice_ms as u128) as u64;
    let max_n = max_n.clamp(1, cap.max(1));
    let want = p.want.max(ahead).max(max_n);
    let low_water = p
        .low_water
        .min((ahead / 2).max(1))
        .max(max_n.min(want))
        .max(1);
    PullPlan { want, low_water }
}

/// How long before a slice ends its successor's first chunk is prefetched.
///
/// ```
/// assert_eq!(sluice::pull::prefetch_lead_ms(1_000, 0.5), 20.0);
/// assert_eq!(sluice::pull::prefetch_lead_ms(100, 10.0), 25.0);
/// ```
pub fn prefetch_lead_ms(slice_ms: u64, rtt_ms: f64) -> f64 {
    let s = slice_ms as f64;
    (4.0 * rtt_ms).max(s / 50.0).max(SCHED_MS).min(s / 4.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> PullInput {
        PullInput {
            fixed: 0,
            cap: 2_000,
            slice_ms: 1_000,
            elapsed_ms: 0.0,
            consumed: 0,
            demand_prev: 0,
            rtt_ms: 0.5,
            max_n: 1,
        }
    }

    #[test]
    fn first_slice_assumes_the_whole_cap() {
        assert_eq!(plan(&input()).want, 80);
    }

    #[test]
    fn surge_within_a_slice_raises_the_share() {
        // Last slice 100, but this one already consumed 500 in 100 ms: projected 5,000 → cap.
        let p = plan(&PullInput {
            demand_prev: 100,
            elapsed_ms: 100.0,
            consumed: 500,
            ..input()
        });
        assert_eq!(p.want, 80);
    }

    #[test]
    fn slow_hosts_pull_small_chunks_and_never_zero() {
        let p = plan(&PullInput {
            demand_prev: 10,
            ..input()
        });
        assert_eq!(p.want, 1);
        assert_eq!(p.low_water, 1);
        let p = plan(&PullInput {
            demand_prev: 10,
            max_n: 5,
            ..input()
        });
        assert_eq!(p.want, 5);
    }

    #[test]
    fn fast_rate_with_short_slices_keeps_four_round_trips() {
        // 100 ms slices, share 10,000 → 100/ms; rtt 2 ms → at least 800 per pull. The 20 ms
        // of demand (2,000) is more than a steady chunk of the cap (400): not taken.
        let p = plan(&PullInput {
            cap: 10_000,
            slice_ms: 100,
            demand_prev: 20_000,
            rtt_ms: 2.0,
            ..input()
        });
        assert_eq!(p.want, 800);
        assert!(p.low_water < p.want && p.low_water >= 600, "{p:?}");
    }

    /// Issue 23 item 19 (the soak's seed 523022005): 150 decisions a second on 100 ms slices
    /// of cap 28 pulled one permit at a time, so every decision waited for a round trip of the
    /// background thread, and a busy machine refused a third of them with quota in Redis. The
    /// chunk now holds up to 20 ms of demand, never more than a steady chunk of the cap
    /// (`cap / 25`, rounded up: 2 here), and the next slice is prefetched 20 ms ahead.
    #[test]
    fn slow_hosts_on_short_slices_hold_the_scheduling_delays_worth() {
        let p = plan(&PullInput {
            cap: 28,
            slice_ms: 100,
            demand_prev: 15,
            rtt_ms: 1.0,
            ..input()
        });
        assert_eq!((p.want, p.low_water), (2, 1));
        // A larger cap: the whole 20 ms (3).
        let p = plan(&PullInput {
            cap: 100,
            slice_ms: 100,
            demand_prev: 15,
            rtt_ms: 1.0,
            ..input()
        });
        assert_eq!(p.want, 3);
        assert_eq!(prefetch_lead_ms(100, 1.0), 20.0);
        assert_eq!(
            prefetch_lead_ms(40, 1.0),
            10.0,
            "at most a quarter of the slice"
        );
    }

    /// The review of issue 23 (F1): ten hosts, each asking more than the whole cap, every one
    /// pulling the largest chunk the policy allows: no pull takes more of the cap than a
    /// steady chunk (`cap / 25`), so every host gets some of each slice.
    #[test]
    fn no_pull_takes_more_than_a_steady_chunk_of_a_short_slice() {
        for (cap, slice_ms) in [(1_000, 100), (28, 100), (50, 200), (10_000, 1_000)] {
            for rtt_ms in [0.2, 1.0, 3.0] {
                let p = plan(&PullInput {
                    cap,
                    slice_ms,
                    demand_prev: 10 * cap,
                    rtt_ms,
                    ..input()
                });
                let steady = cap.div_ceil(PULLS_PER_SLICE);
                let by_rtt = (cap as f64 / slice_ms as f64 * 4.0 * rtt_ms).ceil() as u64;
                assert!(
                    p.want <= steady.max(by_rtt),
                    "cap {cap}/{slice_ms} ms rtt {rtt_ms}: {p:?}"
                );
            }
        }
    }

    #[test]
    fn low_water_is_below_the_chunk() {
        for demand in [1, 10, 100, 1_000, 100_000] {
            for elapsed in [0.0, 500.0, 999.0] {
                let p = plan(&PullInput {
                    demand_prev: demand,
                    elapsed_ms: elapsed,
                    ..input()
                });
                assert!(p.want >= 1 && p.low_water <= p.want, "{p:?}");
            }
        }
    }
}
