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
//! cases). So every decision announces its cost in a pending count before adding it and
//! withdraws it after committing or taking it back, and counts its take-backs (two log words
//! past the ring, each on its own cache line: the pending count changes at every admission). A
//! decision over the limit denies at once only when the sum less everything pending is still
//! over it, with nothing committed or taken back while it read (the pending count is then at
//! least what the sum held uncommitted, so the committed state alone denies). Otherwise it
//! reads again: a few times spinning, then yielding its CPU between reads (a decision preempted
//! between its add and its commit gets to finish: it is the one being waited for), at most
//! `SETTLE_TRIES` reads in all (four times that while others keep committing or taking back).
//! Then it denies anyway; and when nothing moved from its first such read to its last, the
//! pending count is stale (a process stopped between announcing and withdrawing, or one
//! preempted longer than the wait) and is cleared, so one denial pays the wait, not every one.
//! The wait is bounded: ~64 reads and yields, microseconds on an idle CPU.
//!
//! The pending count only ever *withholds* a denial: admissions are decided on the whole sum,
//! uncommitted costs included, as before, so a pending count that is wrong (cleared while a
//! decision was preempted, or never kept by a process of an older SDK on the same segment,
//! whose uncommitted costs are then denied on as before) can cost a denial the settled state
//! would admit, never an admission.
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

/// Log word of the costs announced and not yet committed or taken back (at least what the
/// buckets hold uncommitted, unless cleared as stale). Past the ring, on a cache line of its own.
const PENDING: usize = BUCKETS;

/// Log word counting take-backs (its own cache line too).
const TAKEN: usize = BUCKETS + 8;

/// Reads of a denial that depends on pending costs before it is made anyway.
pub(crate) const SETTLE_TRIES: u32 = 64;

/// Of those, the first ones spin; the rest yield the CPU between reads.
const SPINS: u32 = 8;

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
    let (seq, pending, taken) = (ws.cell(SEQ), ws.log(PENDING), ws.log(TAKEN));
    let mut tries = 0;
    // (commits, take-backs, pending) at the first read whose denial waited on pending costs.
    let mut first: Option<(u64, u64, u64)> = None;
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
            if !moved && !committed_denies && first.is_none() {
                first = Some((q, tb, p));
            }
            if (!moved && (committed_denies || tries >= SETTLE_TRIES)) || tries >= 4 * SETTLE_TRIES
            {
                if !committed_denies
                    && let Some((q0, tb0, p0)) = first
                    && (q0, tb0, p0) == (q, tb, p)
                    && !moved
                {
                    // Nothing settled from the first read to this one: what is pending is
                    // stale (cleared only if it still is what was read).
                    let _ = cas(pending, p0, 0);
                }
                // Nothing can succeed before the oldest counted bucket leaves the window.
                let leaves_ms = oldest - 1 + bk.w - bk.t;
                return Verdict::Deny {
                    retry_after_us: (leaves_ms.max(0) * 1_000 - i.now_us % 1_000).max(1) as u64,
                };
            }
            tries += 1;
            #[cfg(test)]
            tests::on_wait();
            if tries <= SPINS {
                std::hint::spin_loop();
            } else {
                // The decision waited for may be preempted: let it run.
                std::thread::yield_now();
            }
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
        give_up(ws, &bk, word, i.n);
    }
}

/// Takes back `n` added as `word` by a decision that did not commit, counts the take-back and
/// withdraws its pending cost.
fn give_up(ws: Words<'_>, bk: &Buckets, word: u64, n: u64) {
    take_back(ws, bk, word, n);
    ws.log(TAKEN).fetch_add(1, Ordering::AcqRel);
    withdraw(ws.log(PENDING), n);
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

    thread_local! {
        /// Run at each re-read of a denial that waits on pending costs (this thread's decisions).
        static ON_WAIT: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
            const { std::cell::RefCell::new(None) };
    }

    pub(super) fn on_wait() {
        ON_WAIT.with(|h| {
            if let Some(f) = h.borrow_mut().as_mut() {
                f();
            }
        });
    }

    const T: i64 = 1_700_000_000_000_000;
    const P5: Params = Params {
        limit: 5,
        window_us: 1_000_000,
        burst: 0,
    };

    /// The bucket grid of a decision of `n` under `P5` at `T`.
    fn grid(n: u64) -> super::Buckets {
        super::Buckets::new(&crate::limiter::Input {
            alg: SlidingLog,
            p: P5,
            now_us: T,
            n,
        })
    }

    /// A decision's cost added by hand as a decision stopped after its add does: announced,
    /// added, not committed. Returns the word added (for its take-back).
    fn uncommitted(c: &MemCells, n: u64) -> u64 {
        c.words()
            .log(super::PENDING)
            .fetch_add(n, std::sync::atomic::Ordering::AcqRel);
        super::add(c.words(), &grid(n), n).expect("room in the word")
    }

    fn pending(c: &MemCells) -> u64 {
        c.words()
            .log(super::PENDING)
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// The case the pending count is for: 3 committed and 2 of another decision added but not
    /// committed (limit 5). A decision of 1 waits instead of denying, and when the other takes
    /// its 2 back (a third committed first, in the real race) it is admitted: the room was
    /// there all along.
    #[test]
    fn a_denial_waits_for_a_cost_that_is_taken_back() {
        let c = std::sync::Arc::new(MemCells::default());
        assert!(decide(SlidingLog, &P5, &c, T, 3).admitted());
        let word = uncommitted(&c, 2);
        let (c2, waits) = (c.clone(), std::rc::Rc::new(std::cell::Cell::new(0)));
        let w2 = waits.clone();
        ON_WAIT.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                w2.set(w2.get() + 1);
                if w2.get() == 3 {
                    // The other decision gives up (a third committed first, in the real race).
                    super::give_up(c2.words(), &grid(2), word, 2);
                }
            }))
        });
        let admitted = decide(SlidingLog, &P5, &c, T, 1).admitted();
        ON_WAIT.with(|h| *h.borrow_mut() = None);
        assert!(admitted, "denied on a cost that was taken back");
        assert_eq!(waits.get(), 3);
        assert_eq!(pending(&c), 0);
        // 4 committed now: 1 more fits, 2 do not.
        assert!(!decide(SlidingLog, &P5, &c, T, 2).admitted());
        assert!(decide(SlidingLog, &P5, &c, T, 1).admitted());
    }

    /// A decision stopped between adding its cost and committing it still counts against
    /// admissions. A denial on the committed costs alone never waits for it (and leaves its
    /// pending count); the first denial that does wait for it in vain clears the count, so
    /// later denials are decided at once.
    #[test]
    fn a_stopped_decisions_pending_cost_denies_and_is_cleared_once() {
        let c = MemCells::default();
        assert!(decide(SlidingLog, &P5, &c, T, 3).admitted());
        uncommitted(&c, 2);
        // 3 committed + 3 asked: denied on the committed alone, at once.
        let waits = std::rc::Rc::new(std::cell::Cell::new(0));
        let w2 = waits.clone();
        ON_WAIT.with(|h| *h.borrow_mut() = Some(Box::new(move || w2.set(w2.get() + 1))));
        assert!(!decide(SlidingLog, &P5, &c, T, 3).admitted());
        assert_eq!(waits.get(), 0, "a committed denial waited");
        assert_eq!(pending(&c), 2);
        // 3 committed + 2 never committed + 1 asked: the 1 would pass the committed 3 alone,
        // but admissions count the uncommitted too.
        assert!(!decide(SlidingLog, &P5, &c, T, 1).admitted());
        assert_eq!(waits.get(), super::SETTLE_TRIES);
        assert_eq!(pending(&c), 0, "stale count kept");
        assert!(!decide(SlidingLog, &P5, &c, T, 1).admitted());
        assert_eq!(waits.get(), super::SETTLE_TRIES, "waited again");
        ON_WAIT.with(|h| *h.borrow_mut() = None);
    }

    /// Stopped between announcing and adding: a pending count with nothing in the buckets. A
    /// denial waits for it once, and clears it.
    #[test]
    fn a_cost_announced_and_never_added_is_cleared_once() {
        let c = MemCells::default();
        assert!(decide(SlidingLog, &P5, &c, T, 5).admitted());
        c.words()
            .log(super::PENDING)
            .fetch_add(4, std::sync::atomic::Ordering::AcqRel);
        assert!(!decide(SlidingLog, &P5, &c, T, 1).admitted());
        assert_eq!(pending(&c), 0);
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
