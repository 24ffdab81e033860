//! A small seeded pseudo-random generator (SplitMix64): the soak's and the simulation's only
//! source of randomness, so one seed always gives the same sequence of steps. Written out here
//! (30 lines) rather than taken from a crate so the sequence can never change under a
//! dependency upgrade.
//!
//! ```
//! use sluice_testkit::rng::Rng;
//! let mut a = Rng::new(42);
//! let mut b = Rng::new(42);
//! assert_eq!(a.next_u64(), b.next_u64());
//! assert_eq!(Rng::new(0).next_u64(), 0xe220_a839_7b1d_cdaf); // SplitMix64's reference value
//! ```

/// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit state advanced by a constant and mixed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Multiply-shift: unbiased enough for a test driver, and branch-free.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }

    /// Uniform in `[lo, hi]` of signed numbers (`lo` when `hi < lo`).
    pub fn range_i(&mut self, lo: i64, hi: i64) -> i64 {
        if hi <= lo {
            return lo;
        }
        lo.wrapping_add(self.below(hi.abs_diff(lo).saturating_add(1)) as i64)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }

    /// One element, with probability proportional to its weight (some weight must be > 0).
    pub fn weighted<'a, T>(&mut self, xs: &'a [(T, u32)]) -> &'a T {
        let total: u64 = xs.iter().map(|(_, w)| u64::from(*w)).sum();
        let mut r = self.below(total);
        for (x, w) in xs {
            if r < u64::from(*w) {
                return x;
            }
            r -= u64::from(*w);
        }
        &xs.last().expect("weighted: empty").0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_other_seed_other_sequence() {
        let a: Vec<u64> = (0..5)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..5)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let c: Vec<u64> = (0..5)
            .scan(Rng::new(8), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn ranges_and_weights_stay_in_bounds() {
        let mut r = Rng::new(1);
        for _ in 0..10_000 {
            let x = r.range(3, 5);
            assert!((3..=5).contains(&x));
            let u = r.uniform(1.5, 3.0);
            assert!((1.5..3.0).contains(&u));
        }
        let xs = [("never", 0), ("always", 5)];
        for _ in 0..1_000 {
            assert_eq!(*r.weighted(&xs), "always");
        }
    }
}
