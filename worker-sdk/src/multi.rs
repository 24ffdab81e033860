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

use crate::client::{Decision, Step, Task};
use crate::keyed::{Key, Refund};
use crate::protocol::Mode;
use crate::shm::{parity, tag_of};

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
    /// [`Decision::FallbackAllowed`] when every part was admitted and one by a FAILED fallback;
    /// otherwise the refusing part's decision.
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

impl Task {
    /// `try_acquire_at` with how to give the permits back.
    pub(crate) fn try_refundable(&self, n: u64, now_us: i64) -> (Decision, Option<Refund>) {
        let d = match self.decide(n, now_us) {
            Step::Decided(d) => d,
            Step::Pending { start_ms, slice_ms } => {
                return (self.pending_rejected(start_ms, slice_ms, n), None);
            }
        };
        (d, self.refund_of(d, now_us))
    }

    /// Where an admission decided at `at_us` took its permits from, when it can be undone:
    /// an `Allowed` of a pooled task came from the slice's local quota word.
    pub(crate) fn refund_of(&self, d: Decision, at_us: i64) -> Option<Refund> {
        if d != Decision::Allowed {
            return None;
        }
        let (_, m) = self.slot_meta()?;
        if m.mode != Mode::Pooled {
            return None;
        }
        let r = self.inner.slot_ref();
        let slice_us = (m.slice_ms * 1_000) as i64;
        let start = at_us.div_euclid(slice_us) * m.slice_ms as i64;
        Some(Refund::Task {
            slot: r.index,
            generation: r.generation,
            parity: parity(start, m.slice_ms),
            tag: tag_of(start),
        })
    }

    /// Gives back what a [`Refund::Task`] says this task's decision took.
    pub(crate) fn refund(&self, r: &Refund, n: u64) {
        if let Refund::Task {
            slot,
            generation,
            parity,
            tag,
        } = *r
            && let Some(s) = self.shared.seg.slot(slot)
            && s.generation() == generation
        {
            crate::keyed::give_back(&s.quota[parity].word, tag, n);
        }
    }
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

fn all_admitted(fallback: bool) -> AllDecision {
    AllDecision {
        decision: if fallback {
            Decision::FallbackAllowed
        } else {
            Decision::Allowed
        },
        refused: None,
    }
}

/// Decides the parts in order with `decide`, all or nothing (the synchronous calls).
fn all_or_nothing(
    parts: &[Limit<'_>],
    mut decide: impl FnMut(&Limit<'_>) -> (Decision, Option<Refund>),
) -> AllDecision {
    let mut taken = Vec::with_capacity(parts.len());
    let mut fallback = false;
    for (i, p) in parts.iter().enumerate() {
        let (d, r) = decide(p);
        fallback |= d == Decision::FallbackAllowed;
        if !d.is_allowed() {
            return refused(parts, &taken, d, i);
        }
        taken.push(r);
    }
    all_admitted(fallback)
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
    let mut taken = Vec::with_capacity(parts.len());
    let mut fallback = false;
    for (i, p) in parts.iter().enumerate() {
        let (d, r) = match p {
            Limit::Task(t, n) => {
                let d = t.acquire(*n).await;
                (d, t.refund_of(d, t.now_us()))
            }
            Limit::Key(k, n) => {
                let (d, _, r) = k.acquire_refundable(*n).await;
                (d, r)
            }
        };
        fallback |= d == Decision::FallbackAllowed;
        if !d.is_allowed() {
            return refused(parts, &taken, d, i);
        }
        taken.push(r);
    }
    all_admitted(fallback)
}

/// [`acquire_all`] for programs without an async runtime.
pub fn acquire_all_blocking(parts: &[Limit<'_>]) -> AllDecision {
    all_or_nothing(parts, |p| match p {
        Limit::Task(t, n) => {
            let d = t.acquire_blocking(*n);
            (d, t.refund_of(d, t.now_us()))
        }
        Limit::Key(k, n) => {
            let (d, _, r) = k.acquire_blocking_refundable(*n);
            (d, r)
        }
    })
}
