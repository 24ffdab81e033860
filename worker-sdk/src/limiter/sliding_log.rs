//! Sliding log: admits while fewer than `limit` admissions lie within the window ending now.
//!
//! # Buckets instead of a log
//!
//! An exact log of admissions cannot be shared lock-free by many processes (appending and
//! expiring entries would have to be one atomic step with the count). So the log is kept at
//! the resolution of [`BUCKETS`] − 1 buckets per window (`b = ⌈window / 127⌉` ms, at least
//! 1 ms): a ring of words `(bucket end, count)`, and an admission's time is known only to
//! within its bucket. A bucket counts as long as any part of it is within the window, so an
//! admission leaves the window up to `b` (≤ 0.8 % of the window, or 1 ms) *later* than in an
//! exact log: the algorithm never admits more than the exact sliding log, and denies at most
//! what leaves the window during that last bucket.
//!
//! # One commit word
//!
//! A decision reads the commit sequence (cell 4), sums the buckets, adds its cost to now's
//! bucket, and then commits by raising the sequence by one with a compare-and-swap. If another
//! admission committed in between, the sequence moved: the decision takes its cost back out of
//! the bucket and starts over. So no two admissions ever both count on the same room, and a
//! process stopped at any point has either committed (an admission), or left a cost in a bucket
//! that was never admitted (which only denies more, until that bucket leaves the window). The
//! sequence is 64 bits: it never wraps.
//!
//! # Denials are decided on what is committed
//!
//! A sum may include costs that are not committed: another decision's, between its add and its
//! commit, which that decision takes back when a third committed first. Denied on such a sum, a
//! decision would be refused room that the state left afterwards holds (`limiter::model::
//! prop_concurrent`, four threads deciding at one time per round, met it about once in 1,000
//! cases). So every decision announces its cost in a pending count (cell 6) before adding it
//! and withdraws it after committing or taking it back, and counts its take-backs (cell 7). A
//! decision over the limit denies only when the sum less everything pending is still over it,
//! with nothing committed or taken back while it read (the pending count is then at least what
//! the sum held uncommitted, so the committed state alone denies). Otherwise it reads again,
//! at most [`SETTLE_TRIES`] times, and then denies anyway and clears the pending count (which
//! nothing settled while it read, so it is stale: a process stopped between announcing and
//! withdrawing). The pending count only ever *withholds* a denial; admissions are decided on
//! the whole sum, uncommitted costs included, as before, so nothing it holds can admit more.
//!
//! # Time
//!
//! Buckets are found by their end, never by their place in the ring, so a change of the
//! window length merges rather than loses: a ring word still within the window when its place
//! is reused keeps its count (under the later of the two ends). A bucket that lies more than a
//! window ahead of now (the clock stepped back) is moved to now's bucket, so it counts one
//! more window and is then forgotten. A *longer* window than the ring was written on (cell 5
//! records it) may reach admissions whose words a shorter window's buckets already reused, so
//! nothing more is admitted in the window of the change, whatever limit follows in it: the
//! ring is filled to the most a word counts (found by the model, seeds 7828340290572986977 and
//! 2275979523880801410).

use std::sync::atomic::{AtomicU64, Ordering};

use super::{COUNT_MAX, Input, Verdict, Words, cas, pack, unpack};

/// Buckets in the ring (one more than per window, so a reused place has always left it).
pub const BUCKETS: usize = 128;

/// Cell of the commit sequence.
const SEQ: usize = 4;

/// Cell of the window length (ms) the ring was last written on (0 = none recorded).
const WINDOW: usize = 5;

/// Cell of the costs announced and not yet committed or taken back (at least what the buckets
/// hold uncommitted, unless cleared as stale).
const PENDING: usize = 6;

/// Cell counting take-backs.
const TAKEN: usize = 7;

/// Reads of a denial that depends on pending costs before it is made anyway.
pub const SETTLE_TRIES: u32 = 64;

/// Now on the bucket grid, ms.
#[derive(Debug, Clone, Copy)]
struct Buckets {
    t: i64,
    w: i64,
    /// Bucket length.
    b: i64,
    /// Place of now's bucket in the ring.
    place: usize,
    /// End of now's bucket.
    end: i64,
}

impl Buckets {
    fn new(i: &Input) -> Self {
        let w = i.p.window_us.div_ceil(1_000).max(1) as i64;
        let b = (w as u64).div_ceil(BUCKETS as u64 - 1) as i64;
        let t = i.now_us / 1_000;
        let k = t / b;
        Self {
            t,
            w,
            b,
            place: (k as u64 % BUCKETS as u64) as usize,
            end: (k + 1) * b,
        }
    }

    /// Whether a bucket ending at `e` may hold an admission within the window ending now
    /// (admissions at ms `s` with `s > t − w`; a bucket holds `s < e`).
    fn inside(&self, e: i64) -> bool {
        e - 1 > self.t - self.w
    }

    /// Whether a bucket ending at `e` lies more than a window ahead of now.
    fn ahead(&self, e: i64) -> bool {
        e > self.t + self.w + self.b
    }
}

/// Sums the buckets within the window (moving those far ahead to now); returns the sum and
/// the end of the oldest counted bucket.
fn sum(ws: Words<'_>, bk: &Buckets) -> (u64, i64) {
    let mut total = 0u64;
    let mut oldest = bk.end;
    for j in 0..BUCKETS {
        let cell = ws.log(j);
        let x = cell.load(Ordering::Acquire);
        let (e, c) = unpack(x, bk.t);
        if c == 0 || !bk.inside(e) {
            continue;
        }
        if bk.ahead(e) {
            let _ = cas(cell, x, pack(bk.end, c));
        }
        total = total.saturating_add(c);
        oldest = oldest.min(e.min(bk.end));
    }
    (total, oldest)
}

/// Adds `n` to now's bucket: the word stored, or `None` when the count would not fit.
fn add(ws: Words<'_>, bk: &Buckets, n: u64) -> Option<u64> {
    let cell = ws.log(bk.place);
    loop {
        let x = cell.load(Ordering::Acquire);
        let (e, c) = unpack(x, bk.t);
        let new = if e == bk.end {
            (bk.end, c.checked_add(n)?)
        } else if c == 0 || !bk.inside(e) {
            (bk.end, n)
        } else {
            // Another grid's bucket still within the window: merged, under the later end.
            (e.max(bk.end), c.checked_add(n)?)
        };
        if new.1 > COUNT_MAX {
            return None;
        }
        let w = pack(new.0, new.1);
        if cas(cell, x, w) {
            return Some(w);
        }
    }
}

/// Takes back `n` added as `word` (when the bucket still is that bucket).
fn take_back(ws: Words<'_>, bk: &Buckets, word: u64, n: u64) {
    let cell = ws.log(bk.place);
    let (end, _) = unpack(word, bk.t);
    loop {
        let x = cell.load(Ordering::Acquire);
        let (e, c) = unpack(x, bk.t);
        if e != end || c < n || cas(cell, x, pack(e, c - n)) {
            return;
        }
    }
}

/// A longer window than the ring was written on: the ring holds only about one old window of
/// admissions (its places were reused at the old bucket length), so what was admitted between
/// the old and the new window's reach may be gone, and how much is unknown (the old window
/// could admit its limit many times over in the new one). The ring is then filled to the most a
/// word counts, not to the limit: nothing more is admitted in the window of the change whatever
/// limit follows within it (filled to the limit, a limit raised next let the lost admissions
/// in again: the model, seed 2275979523880801410). A shorter window loses nothing. Filled
/// before the record moves: a process stopped in between leaves the old record, and the next
/// decision fills again (which adds nothing once full).
fn follow_window(ws: Words<'_>, i: &Input, w: i64) {
    let cell = ws.cell(WINDOW);
    let seen = cell.load(Ordering::Acquire);
    if seen == w as u64 {
        return;
    }
    if seen != 0 && (w as u64) > seen {
        fill_to(ws, i, COUNT_MAX);
    }
    let _ = cas(cell, seen, w as u64);
}

pub(super) fn decide(ws: Words<'_>, i: &Input) -> Verdict {
    let bk = Buckets::new(i);
    follow_window(ws, i, bk.w);
    let limit = i.p.limit.min(COUNT_MAX);
    let (seq, pending, taken) = (ws.cell(SEQ), ws.cell(PENDING), ws.cell(TAKEN));
    let mut tries = 0;
    loop {
        let q = seq.load(Ordering::Acquire);
        let tb = taken.load(Ordering::Acquire);
        let (total, oldest) = sum(ws, &bk);
        if total.saturating_add(i.n) > limit {
            // Read after the sum: a withdrawal it sees was preceded by its take-back's count
            // or its commit, which the checks below then see.
            let p = pending.load(Ordering::Acquire);
            let committed_denies = total.saturating_sub(p).saturating_add(i.n) > limit;
            let moved = seq.load(Ordering::Acquire) != q || taken.load(Ordering::Acquire) != tb;
            // Bounded also while others keep committing or taking back (a denial then may be
            // one the settled state would admit: liveness, never safety).
            if (!moved && (committed_denies || tries >= SETTLE_TRIES)) || tries >= 4 * SETTLE_TRIES
            {
                if !moved && !committed_denies {
                    // Nothing settled in all those reads: what is pending is stale.
                    let _ = cas(pending, p, 0);
                }
                // Nothing can succeed before the oldest counted bucket leaves the window.
                let leaves_ms = oldest - 1 + bk.w - bk.t;
                return Verdict::Deny {
                    retry_after_us: (leaves_ms.max(0) * 1_000 - i.now_us % 1_000).max(1) as u64,
                };
            }
            tries += 1;
            std::hint::spin_loop();
            continue;
        }
        pending.fetch_add(i.n, Ordering::AcqRel);
        let Some(word) = add(ws, &bk, i.n) else {
            withdraw(pending, i.n);
            return Verdict::Deny {
                retry_after_us: (bk.b * 1_000) as u64,
            };
        };
        if cas(seq, q, q.wrapping_add(1)) {
            withdraw(pending, i.n);
            return Verdict::Admit;
        }
        take_back(ws, &bk, word, i.n);
        taken.fetch_add(1, Ordering::AcqRel);
        withdraw(pending, i.n);
    }
}

/// Withdraws `n` from the pending count (never below 0: it may have been cleared as stale).
fn withdraw(pending: &AtomicU64, n: u64) {
    let _ = pending.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
        Some(p.saturating_sub(n))
    });
}

/// Counts now's bucket as holding the whole limit (a change from another family of
/// algorithms): nothing more is admitted for a window. An increase: needs no commit.
pub(super) fn fill(ws: Words<'_>, i: &Input) {
    fill_to(ws, i, i.p.limit.min(COUNT_MAX));
}

/// Counts now's bucket so that the window holds at least `target`.
fn fill_to(ws: Words<'_>, i: &Input, target: u64) {
    let bk = Buckets::new(i);
    let (total, _) = sum(ws, &bk);
    if total < target && add(ws, &bk, target - total).is_some() {
        // Like an admission: a decision that summed before the fill starts over.
        ws.cell(SEQ).fetch_add(1, Ordering::AcqRel);
    }
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
        let c = MemCells::default();
        let mut times = Vec::new();
        let mut t = 0;
        while t < 5_000_000 {
            if decide(SlidingLog, &p, &c, t, 1).admitted() {
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

    /// Retry-after points at the oldest admission's expiry, to within a bucket (8 ms here).
    #[test]
    fn retry_after_points_at_the_oldest_expiry() {
        let p = Params {
            limit: 1,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        assert!(decide(SlidingLog, &p, &c, 100_000, 1).admitted());
        let Verdict::Deny { retry_after_us } = decide(SlidingLog, &p, &c, 400_000, 1) else {
            panic!("admitted twice in one window");
        };
        assert!(
            (700_000..=708_000).contains(&retry_after_us),
            "{retry_after_us}"
        );
        assert!(!decide(SlidingLog, &p, &c, 1_099_000, 1).admitted());
        assert!(decide(SlidingLog, &p, &c, 400_000 + retry_after_us as i64, 1).admitted());
    }

    #[test]
    fn heavy_demand_holds_the_limit_in_every_window() {
        let p = Params {
            limit: 1_000,
            window_us: 1_000_000,
            burst: 0,
        };
        let w = admitted_per_window(SlidingLog, &p, 0, 100, 4_000_000);
        assert!(w[1..].iter().all(|x| (990..=1_000).contains(x)), "{w:?}");
    }

    /// A decision stopped between adding its cost and committing it (here: made by hand) still
    /// counts against admissions, and its pending count is cleared by the first denial that
    /// waits on it in vain: later denials are decided at once.
    #[test]
    fn a_stopped_decisions_pending_cost_denies_and_is_cleared_once() {
        use super::{Buckets, PENDING, add};
        use crate::limiter::Input;
        use std::sync::atomic::Ordering;

        let p = Params {
            limit: 5,
            window_us: 1_000_000,
            burst: 0,
        };
        let c = MemCells::default();
        let t = 1_700_000_000_000_000;
        assert!(decide(SlidingLog, &p, &c, t, 3).admitted());
        let ws = c.words();
        let bk = Buckets::new(&Input {
            alg: SlidingLog,
            p,
            now_us: t,
            n: 2,
        });
        ws.cell(PENDING).fetch_add(2, Ordering::AcqRel);
        assert!(add(ws, &bk, 2).is_some());
        // 3 committed + 2 never committed: 1 more would pass the committed 3 alone, but
        // admissions count the uncommitted too.
        assert!(!decide(SlidingLog, &p, &c, t, 1).admitted());
        assert_eq!(ws.cell(PENDING).load(Ordering::Acquire), 0, "stale count kept");
        assert!(!decide(SlidingLog, &p, &c, t, 1).admitted());
        // A denial on committed costs alone never waits: 3 committed + 3 asked.
        assert!(!decide(SlidingLog, &p, &c, t, 3).admitted());
    }

    /// Found by `model::prop_param_changes` (seed 7828340290572986977): a short window reuses
    /// the ring's places at its short bucket length, so when the window grows again the
    /// admissions made before the short period were gone and the limit was admitted again.
    #[test]
    fn a_longer_window_never_forgets_what_the_ring_lost() {
        let long = Params {
            limit: 33,
            window_us: 1_500_000,
            burst: 0,
        };
        let short = Params {
            limit: 33,
            window_us: 137_000,
            burst: 0,
        };
        let c = MemCells::default();
        let mut log = Vec::new();
        let t0 = 1_700_000_000_000_000i64;
        assert!(decide(SlidingLog, &long, &c, t0, 30).admitted());
        log.push((t0, 30));
        // One short-window admission at the ring place of the 30 (on its 2 ms grid), after
        // they left the short window: it overwrites their word.
        let place = |t: i64, b: i64| (t / 1_000 / b) % super::BUCKETS as i64;
        let mut t = t0 + 140_000;
        while place(t, 2) != place(t0, 12) {
            t += 1_000;
        }
        assert!(t < t0 + 1_000_000);
        assert!(decide(SlidingLog, &short, &c, t, 1).admitted());
        log.push((t, 1));
        // Back to 1.5 s: what the last 1.5 s admitted counts.
        for _ in 0..40 {
            t += 1_000;
            let inside: u64 = log
                .iter()
                .filter(|e| e.0 > t - 1_500_000)
                .map(|e| e.1)
                .sum();
            if decide(SlidingLog, &long, &c, t, 1).admitted() {
                assert!(
                    inside < 33,
                    "admitted with {inside} in the last 1.5 s at {t}"
                );
                log.push((t, 1));
            }
        }
    }
}
