//! [`Decision`], the answer every mode gives, and `Step`, a decision core's answer before
//! the front resolves a pending refill.

use std::time::Duration;

#[cfg(doc)]
use crate::Task;

/// The answer to "may I do `n` units of work now?".
///
/// Which call to use: [`Task::try_acquire`] for modes `pooled` and `local` (no network, never
/// waits); [`Task::acquire`] / [`Task::acquire_blocking`] for every mode, and always for
/// `exact_fixed` / `exact_sliding`, whose decisions need a Redis round trip
/// (`try_acquire` answers [`Decision::WouldBlock`] for them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Admitted from the global quota.
    Allowed,
    /// Rejected: the global quota of this slice is spent (LIMITED), or a refill is on its way
    /// (then `retry_after` is short; [`Task::acquire`] waits for it instead).
    Limited {
        /// When a retry may succeed.
        retry_after: Duration,
    },
    /// Admitted without the global quota: the task is FAILED (or not known yet) and its
    /// `on_failure` policy admitted it.
    FallbackAllowed,
    /// Rejected by the `on_failure` policy while FAILED.
    FallbackDenied {
        /// When a retry may succeed.
        retry_after: Duration,
    },
    /// Admitted by **shadow mode** (`"shadow": true`): enforced, this decision would have been
    /// [`Decision::Limited`] or [`Decision::FallbackDenied`]. It is counted as a rejection
    /// (`rej`) and as a would-reject (`wrej`) in the slice's counters, so the task's history
    /// shows the limit as if enforced; the caller proceeds ([`Decision::is_allowed`] is true).
    /// `retry_after` is the enforced decision's.
    ShadowLimited {
        /// When a retry would have succeeded, enforced.
        retry_after: Duration,
    },
    /// Not decided: this task is exact (`exact_fixed` / `exact_sliding`); its decision needs a
    /// Redis round trip, which [`Task::try_acquire`] never waits for. Call [`Task::acquire`] /
    /// [`Task::acquire_blocking`]. Never admitted, counted nowhere (it is not a decision).
    WouldBlock,
    /// Refused: the cost is more than any slice can ever hold, above
    /// [`sluice_protocol::MAX_COUNT`] (the largest threshold a spec may give). Retrying does
    /// not help. Counted nowhere (a counter pushed past what Redis can add would stop the
    /// host's counting), not turned into an admission by shadow mode, and logged once per
    /// task per process. (A cost above the current slice's cap but within `MAX_COUNT` is
    /// [`Decision::Limited`] until the slice ends, counted as a rejection.)
    TooLarge {
        /// The most a slice could ever admit at once.
        max: u64,
    },
}

impl Decision {
    /// True when the work may proceed.
    #[inline]
    pub fn is_allowed(&self) -> bool {
        matches!(
            self,
            Decision::Allowed | Decision::FallbackAllowed | Decision::ShadowLimited { .. }
        )
    }

    /// True when shadow mode admitted what the limit would have rejected.
    pub fn is_shadowed(&self) -> bool {
        matches!(self, Decision::ShadowLimited { .. })
    }

    /// True when the global quota did not decide (FAILED, unknown task).
    pub fn is_fallback(&self) -> bool {
        matches!(
            self,
            Decision::FallbackAllowed | Decision::FallbackDenied { .. }
        )
    }

    /// When a rejected caller may retry.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Decision::Limited { retry_after } | Decision::FallbackDenied { retry_after } => {
                Some(*retry_after)
            }
            _ => None,
        }
    }
}

/// Retry hint while a refill is in flight.
pub(crate) const PENDING_RETRY: Duration = Duration::from_millis(1);

pub(crate) enum Step {
    Decided(Decision),
    /// A refill of the slice starting at `start_ms` (grid `slice_ms`) is on its way.
    Pending {
        start_ms: i64,
        slice_ms: u64,
    },
}

/// How to give back the permits of an admitted decision (all-or-nothing decisions).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Refund {
    /// Quota word `parity` of key table entry `entry`, slice tag `tag`.
    Key {
        entry: usize,
        /// The entry's identity word when the permits were taken.
        ident: u64,
        parity: usize,
        tag: u32,
    },
    /// Quota word `parity` of task slot `slot` (generation `generation`), slice tag `tag`.
    Task {
        slot: usize,
        generation: u16,
        parity: usize,
        tag: u32,
    },
}
