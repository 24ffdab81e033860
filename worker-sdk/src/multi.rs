//! Several limits per request, all or nothing ("per tenant AND global").
//!
//! ```no_run
//! # let client = sluice::Client::new(sluice::Config::new("redis://127.0.0.1:6379"))?;
//! let global = client.task("api")?;
//! let tenant = client.task("api-per-tenant")?.key("tenant-42")?;
//! let d = sluice::try_acquire_all(&[sluice::Limit::Key(&tenant, 1), sluice::Limit::Task(&global, 1)]);
//! match d.refused {
//!     None => { /* serve */ }
//!     Some(0) => { /* the tenant's limit refused */ }
//!     Some(_) => { /* the global limit refused */ }
//! }
//! # Ok::<(), sluice::Error>(())
//! ```
//!
//! The parts are decided in order; at the first one refused the others are not decided, and
//! the permits the admitted parts took are given back to the host's local quota, as if they
//! had never been asked for (the quota stays in this host's hands for the next decisions; it
//! is not returned to Redis). Put the part most likely to refuse first.
//!
//! What can be given back: permits of `pooled` tasks and of keys that came from the host's
//! local quota. A part decided elsewhere cannot be undone: an `exact_fixed` / `exact_sliding`
//! admission (Redis counted it), a key decided by one Redis call because the key table had no
//! room for it, a FAILED fallback admission. Those stay spent (never over-admitted, possibly
//! under-used).

use crate::client::Task;
use crate::decision::{Decision, Refund};
use crate::keyed::Key;

/// One part of an all-or-nothing decision: a limit and the permits it is charged.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Limit<'a> {
    /// A task (as a whole).
    Task(&'a Task, u64),
    /// A key of a keyed task.
    Key(&'a Key, u64),
}

/// The answer to [`try_acquire_all`] / [`acquire_all`] / [`acquire_all_blocking`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllDecision {
    /// [`Decision::Allowed`] when every part was admitted from the global quota,
    /// [`Decision::FallbackAllowed`] when every part was admitted and one by a FAILED fallback,
    /// [`Decision::ShadowLimited`] (the first such part's) when every part was admitted and
    /// shadow mode admitted one that its limit refused; otherwise the refusing part's decision.
    pub decision: Decision,
    /// Which part refused (its index), if one did.
    pub refused: Option<usize>,
}

impl AllDecision {
    /// True when the work may proceed (every part admitted).
    pub fn is_allowed(&self) -> bool {
        self.refused.is_none() && self.decision.is_allowed()
    }
}

// Unit tests only: a hook run right after each part of `acquire_all` is decided (as a
// preempted caller would be), to move the clock across a slice boundary there.
#[cfg(test)]
thread_local! {
    static AFTER_PART: std::cell::RefCell<Option<Box<dyn Fn()>>> =
        const { std::cell::RefCell::new(None) };
}

#[inline]
fn after_part() {
    #[cfg(test)]
    AFTER_PART.with(|h| {
        if let Some(f) = h.borrow().as_ref() {
            f();
        }
    });
}

fn refund_all(parts: &[Limit<'_>], taken: &[Option<Refund>]) {
    for (p, r) in parts.iter().zip(taken) {
        if let Some(r) = r {
            match p {
                Limit::Task(t, n) => t.refund(r, *n),
                Limit::Key(k, n) => k.refund(r, *n),
            }
        }
    }
}

/// Part `i` refused with `d`: give back what the parts before it took.
fn refused(parts: &[Limit<'_>], taken: &[Option<Refund>], d: Decision, i: usize) -> AllDecision {
    refund_all(&parts[..i], taken);
    AllDecision {
        decision: d,
        refused: Some(i),
    }
}

/// What the admitted parts add up to (see [`AllDecision::decision`]).
#[derive(Default)]
struct Admitted {
    fallback: bool,
    shadow: Option<Decision>,
}

impl Admitted {
    fn add(&mut self, d: Decision) {
        self.fallback |= d == Decision::FallbackAllowed;
        if d.is_shadowed() && self.shadow.is_none() {
            self.shadow = Some(d);
        }
    }

    fn all(self) -> AllDecision {
        AllDecision {
            decision: match (self.shadow, self.fallback) {
                (Some(d), _) => d,
                (None, true) => Decision::FallbackAllowed,
                (None, false) => Decision::Allowed,
            },
            refused: None,
        }
    }
}

/// Decides the parts in order with `decide`, all or nothing (the synchronous calls).
fn all_or_nothing(
    parts: &[Limit<'_>],
    mut decide: impl FnMut(&Limit<'_>) -> (Decision, Option<Refund>),
) -> AllDecision {
    let mut taken = Vec::with_capacity(parts.len());
    let mut admitted = Admitted::default();
    for (i, p) in parts.iter().enumerate() {
        let (d, r) = decide(p);
        if !d.is_allowed() {
            return refused(parts, &taken, d, i);
        }
        admitted.add(d);
        taken.push(r);
    }
    admitted.all()
}

/// Decides every part now from the host's local quotas (never waits), all or nothing.
pub fn try_acquire_all(parts: &[Limit<'_>]) -> AllDecision {
    all_or_nothing(parts, |p| match p {
        Limit::Task(t, n) => t.try_refundable(*n, t.now_us()),
        Limit::Key(k, n) => k.try_refundable(*n),
    })
}

/// [`try_acquire_all`], waiting for refills as [`Task::acquire`] / [`Key::acquire`] do (and
/// deciding exact tasks with their Redis call).
pub async fn acquire_all(parts: &[Limit<'_>]) -> AllDecision {
    acquire_all_inner(parts, None).await
}

/// One part of [`acquire_all_traced`]'s record: its decision, when it was charged (Unix µs on
/// the slice clock: the slice it was charged to), and whether a refusal of a later part (or a
/// cancellation) gives its permits back (false: an exact-mode admission, a key decided in
/// Redis, a FAILED fallback admission — they stay spent).
pub type PartTrace = (Decision, i64, bool);

/// [`acquire_all`] that also records each part decided (in order, up to the refusing one).
/// For load generators and tests that count each limit's decisions per slice; parts recorded
/// before a cancellation were given back when their flag says so.
#[doc(hidden)]
pub async fn acquire_all_traced(parts: &[Limit<'_>], trace: &mut Vec<PartTrace>) -> AllDecision {
    acquire_all_inner(parts, Some(trace)).await
}

async fn acquire_all_inner(
    parts: &[Limit<'_>],
    mut trace: Option<&mut Vec<PartTrace>>,
) -> AllDecision {
    let mut guard = Taken {
        parts,
        taken: Vec::with_capacity(parts.len()),
        settled: false,
    };
    let taken = &mut guard.taken;
    let mut admitted = Admitted::default();
    for (i, p) in parts.iter().enumerate() {
        let (d, r, at) = match p {
            Limit::Task(t, n) => {
                // The refund names the slice the decision was charged to (its stamp), never
                // the one the clock reads afterwards: across a boundary that was the next
                // slice, which got permits slice S had taken (issue 23 item 6).
                let (d, at) = t.acquire_stamped(*n).await;
                after_part();
                (d, t.refund_of(d, at), at)
            }
            Limit::Key(k, n) => {
                let (d, at, r) = k.acquire_refundable(*n).await;
                (d, r, at)
            }
        };
        if let Some(t) = trace.as_deref_mut() {
            t.push((d, at, r.is_some()));
        }
        if !d.is_allowed() {
            let out = refused(parts, taken, d, i);
            guard.settled = true;
            return out;
        }
        admitted.add(d);
        taken.push(r);
    }
    guard.settled = true;
    admitted.all()
}

/// The parts `acquire_all` admitted so far: given back if its future is dropped (cancelled,
/// timed out) before the answer. What cannot be given back stays taken, as for a refusal: a
/// part of an exact mode (its Redis call runs on) and a key decided directly in Redis.
struct Taken<'p, 'a> {
    parts: &'p [Limit<'a>],
    taken: Vec<Option<Refund>>,
    settled: bool,
}

impl Drop for Taken<'_, '_> {
    fn drop(&mut self) {
        if !self.settled {
            refund_all(self.parts, &self.taken);
        }
    }
}

/// [`acquire_all`] for programs without an async runtime.
pub fn acquire_all_blocking(parts: &[Limit<'_>]) -> AllDecision {
    all_or_nothing(parts, |p| match p {
        Limit::Task(t, n) => {
            let (d, at) = t.acquire_blocking_stamped(*n);
            after_part();
            (d, t.refund_of(d, at))
        }
        Limit::Key(k, n) => {
            let (d, _, r) = k.acquire_blocking_refundable(*n);
            (d, r)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::tests::meta;
    use crate::protocol::TaskMeta;
    use crate::shm::{Segment, unpack_quota};
    use crate::{Client, ClockSource, Config};
    use std::sync::atomic::Ordering;

    /// Issue 23 item 6: part 0 takes a permit of slice S; the clock passes S's end right after
    /// (a preempted caller); part 1 refuses. The permit goes back to S's local quota — main
    /// gave it to S + 1 (its clock's slice after the decision): S lost one, S + 1 gained one.
    #[tokio::test]
    async fn acquire_all_gives_permits_back_to_the_slice_they_were_taken_from() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new("redis://127.0.0.1:1");
        cfg.shm_dir = dir.path().to_path_buf();
        cfg.host_id = "refund".into();
        cfg.max_tasks = 2;
        cfg.allow_unknown = false;
        // Redis-time clock: host time minus the segment's offset, which this test moves (no
        // pull ever reaches Redis here, so nothing else writes it).
        cfg.clock = ClockSource::Redis;
        let client = Client::new(cfg).unwrap();
        let a = client.task("a").unwrap();
        let b = client.task("b").unwrap(); // meta never known: refuses (FallbackDenied)
        let (seg, _) = Segment::open(client.segment_path(), 2).unwrap();
        let slot = seg.slot(seg.find("a").unwrap()).unwrap();
        let day = 86_400_000u64;
        assert!(slot.store_meta(&meta(day), slot.generation()));
        let now_us = a.now_us();
        let s = (now_us as u64 / (day * 1_000) * day) as i64;
        let next = s + day as i64;
        assert!(slot.deposit(s, day, 10, false, now_us));
        assert!(slot.deposit(next, day, 10, false, now_us));
        let count =
            |start: i64| unpack_quota(slot.entry(start, day).word.load(Ordering::Relaxed)).2;
        let path = client.segment_path().to_path_buf();
        AFTER_PART.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                let (seg, _) = Segment::open(&path, 2).unwrap();
                seg.header()
                    .clock_offset_us
                    .store(-((day * 1_000) as i64), Ordering::Relaxed);
            }))
        });
        let d = acquire_all(&[Limit::Task(&a, 1), Limit::Task(&b, 1)]).await;
        AFTER_PART.with(|h| *h.borrow_mut() = None);
        assert_eq!(d.refused, Some(1), "{d:?}");
        assert_eq!((count(s), count(next)), (10, 10), "(S, S + 1) local quotas");
    }

    /// The same through a key of a task that is not keyed (decided as the task, by
    /// `Task::acquire`): its stamp was read after the decision too, so its refund went to
    /// S + 1 as well.
    #[tokio::test]
    async fn a_key_part_decided_as_its_task_gives_permits_back_to_their_slice() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new("redis://127.0.0.1:1");
        cfg.shm_dir = dir.path().to_path_buf();
        cfg.host_id = "refundkey".into();
        cfg.max_tasks = 2;
        cfg.allow_unknown = false;
        cfg.clock = ClockSource::Redis;
        let client = Client::new(cfg).unwrap();
        let a = client.task("a").unwrap();
        let b = client.task("b").unwrap();
        let (seg, _) = Segment::open(client.segment_path(), 2).unwrap();
        let slot = seg.slot(seg.find("a").unwrap()).unwrap();
        let day = 86_400_000u64;
        assert!(slot.store_meta(&meta(day), slot.generation()));
        let key = a.key("k").unwrap();
        let now_us = a.now_us();
        let s = (now_us as u64 / (day * 1_000) * day) as i64;
        let next = s + day as i64;
        assert!(slot.deposit(s, day, 10, false, now_us));
        assert!(slot.deposit(next, day, 10, false, now_us));
        let count =
            |start: i64| unpack_quota(slot.entry(start, day).word.load(Ordering::Relaxed)).2;
        let path = client.segment_path().to_path_buf();
        AFTER_PART.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                let (seg, _) = Segment::open(&path, 2).unwrap();
                seg.header()
                    .clock_offset_us
                    .store(-((day * 1_000) as i64), Ordering::Relaxed);
            }))
        });
        let d = acquire_all(&[Limit::Key(&key, 1), Limit::Task(&b, 1)]).await;
        AFTER_PART.with(|h| *h.borrow_mut() = None);
        assert_eq!(d.refused, Some(1), "{d:?}");
        assert_eq!((count(s), count(next)), (10, 10), "(S, S + 1) local quotas");
    }

    /// Review of issue 23: an `acquire_all` dropped while a later part waits (a timeout around
    /// it) gave nothing back — the parts admitted before stayed taken. Redis here accepts
    /// connections and never answers, so part 1 waits for its pull.
    #[tokio::test]
    async fn a_cancelled_acquire_all_gives_back_what_it_took() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new(format!("redis://{}", silent.local_addr().unwrap()));
        cfg.shm_dir = dir.path().to_path_buf();
        cfg.host_id = "cancelall".into();
        cfg.max_tasks = 2;
        cfg.allow_unknown = false;
        let client = Client::new(cfg).unwrap();
        let a = client.task("a").unwrap();
        let b = client.task("b").unwrap();
        let (seg, _) = Segment::open(client.segment_path(), 2).unwrap();
        let day = 86_400_000u64;
        let sa = seg.slot(seg.find("a").unwrap()).unwrap();
        let sb = seg.slot(seg.find("b").unwrap()).unwrap();
        assert!(sa.store_meta(&meta(day), sa.generation()));
        assert!(sb.store_meta(&meta(day), sb.generation())); // no quota: waits for a pull
        let now_us = a.now_us();
        let s = (now_us as u64 / (day * 1_000) * day) as i64;
        assert!(sa.deposit(s, day, 10, false, now_us));
        let count = |start: i64| unpack_quota(sa.entry(start, day).word.load(Ordering::Relaxed)).2;
        let r = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            acquire_all(&[Limit::Task(&a, 1), Limit::Task(&b, 1)]),
        )
        .await;
        assert!(r.is_err(), "part 1 did not wait: {r:?}");
        assert_eq!(count(s), 10, "part 0's permit was not given back");
    }

    /// Issue 23 item 10: `try_acquire_all`'s task parts follow shadow mode like every other
    /// decision: a refused part of a shadowed task is admitted (`ShadowLimited`) and counted
    /// as a rejection and a would-reject; main enforced it and counted no would-reject.
    #[test]
    fn try_acquire_all_follows_shadow_mode() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new("redis://127.0.0.1:1");
        cfg.shm_dir = dir.path().to_path_buf();
        cfg.host_id = "shadowall".into();
        cfg.max_tasks = 1;
        let client = Client::new(cfg).unwrap();
        let t = client.task("t").unwrap();
        let (seg, _) = Segment::open(client.segment_path(), 1).unwrap();
        let slot = seg.slot(0).unwrap();
        let day = 86_400_000u64;
        let m = TaskMeta {
            shadow: true,
            ..meta(day)
        };
        assert!(slot.store_meta(&m, slot.generation()));
        let now_us = t.now_us();
        let s = (now_us as u64 / (day * 1_000) * day) as i64;
        // One permit left, and Redis has no more (exhausted): the second part is refused.
        assert!(slot.deposit(s, day, 1, true, now_us));
        let d = try_acquire_all(&[Limit::Task(&t, 1), Limit::Task(&t, 1)]);
        assert!(d.is_allowed(), "{d:?}");
        assert!(d.decision.is_shadowed(), "{d:?}");
        assert_eq!(d.refused, None);
        let counted = slot.drain_counters();
        assert_eq!(counted.len(), 1, "{counted:?}");
        let v = counted[0].1;
        assert_eq!((v[1], v[6]), (1, 1), "rej and wrej: {v:?}");
    }
}
