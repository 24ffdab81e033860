//! The per-task, per-host state machine (the seed's 流控状态机), as pure functions.
//!
//! ```text
//!                    pull granted > 0 (or probe succeeded)
//!          ┌─────────────────────────────────────────────────────────┐
//!          ▼                                                         │
//!     ┌─────────┐  slice has nothing left   ┌──────────┐             │
//!     │ NORMAL  │──────────────────────────▶│ LIMITED  │  reject, no │
//!     │ decide  │  (pull: remaining ≤ 0,    │ (this    │  Redis call │
//!     │ from the│   local quota spent)      │  slice)  │  until the  │
//!     │ local   │◀──────────────────────────│          │  slice ends │
//!     │ quota   │     the next slice starts └──────────┘             │
//!     └─────────┘                                 │                  │
//!          │ Redis error or timeout,              │ error            │
//!          │ or the slice key is missing          ▼                  │
//!          │                              ┌──────────────┐           │
//!          └─────────────────────────────▶│   FAILED     │───────────┘
//!                                         │ on_failure:  │  probe every
//!                                         │ local/allow/ │  probe interval
//!                                         │ deny         │  (missing/error: stay)
//!                                         └──────────────┘
//! ```
//!
//! Only NORMAL and FAILED are stored as such ([`Health`], one word in the segment). LIMITED is
//! a property of one slice: the `exhausted` bit of that slice's quota word (see
//! [`crate::shm`]). It therefore ends by itself when the clock reaches the next slice, without
//! anyone having to notice, and a decision sees it in the same load that reads the quota.

use crate::shm::unpack_quota;

/// Why a task is FAILED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Redis answered with an error or the connection failed.
    Error,
    /// Redis did not answer within the pull timeout.
    Timeout,
    /// The slice key does not exist (no manager, or Redis lost its data).
    MissingSlice,
}

/// NORMAL or FAILED, as stored in [`crate::shm::Control::state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Redis answers and the slices exist.
    Normal,
    /// Redis cannot be used since `since_ms` (host Unix ms).
    Failed {
        /// When the failure was first seen.
        since_ms: i64,
        /// Why.
        cause: Cause,
    },
}

const FAILED_BIT: u64 = 1 << 63;

impl Health {
    /// Encodes into one word: `failed:1 | cause:2 | since_ms:61`.
    ///
    /// ```
    /// use sluice::state::{Cause, Health};
    /// let h = Health::Failed { since_ms: 1_700_000_000_000, cause: Cause::Timeout };
    /// assert_eq!(Health::decode(h.encode()), h);
    /// assert_eq!(Health::decode(0), Health::Normal);
    /// ```
    pub fn encode(self) -> u64 {
        match self {
            Health::Normal => 0,
            Health::Failed { since_ms, cause } => {
                let c = match cause {
                    Cause::Error => 0,
                    Cause::Timeout => 1,
                    Cause::MissingSlice => 2,
                };
                FAILED_BIT | (c << 61) | (since_ms.max(0) as u64 & ((1 << 61) - 1))
            }
        }
    }

    /// Decodes a word written by [`Health::encode`] (any other word reads as FAILED/error).
    #[inline]
    pub fn decode(w: u64) -> Self {
        if w & FAILED_BIT == 0 {
            return Health::Normal;
        }
        let cause = match (w >> 61) & 0x3 {
            1 => Cause::Timeout,
            2 => Cause::MissingSlice,
            _ => Cause::Error,
        };
        Health::Failed {
            since_ms: (w & ((1 << 61) - 1)) as i64,
            cause,
        }
    }
}

/// The state of a task on a host, as shown to users.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HostState {
    /// The task's meta has not been read yet (and no process of this host knew it).
    Unknown,
    /// Deciding from the local quota.
    Normal,
    /// The current slice's quota is spent: rejecting until the next slice.
    Limited,
    /// Redis is unusable: deciding by `on_failure`.
    Failed,
}

impl HostState {
    /// The spelling used in `NS:hosts` and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            HostState::Unknown => "unknown",
            HostState::Normal => "normal",
            HostState::Limited => "limited",
            HostState::Failed => "failed",
        }
    }
}

/// The state seen by a decision at slice `tag`, from the health word and that slice's quota
/// word.
///
/// ```
/// use sluice::shm::pack_quota;
/// use sluice::state::{view, Health, HostState};
/// assert_eq!(view(Health::Normal, pack_quota(9, true, 0), 9), HostState::Limited);
/// assert_eq!(view(Health::Normal, pack_quota(9, true, 3), 9), HostState::Normal);
/// // LIMITED ends with its slice:
/// assert_eq!(view(Health::Normal, pack_quota(9, true, 0), 10), HostState::Normal);
/// ```
pub fn view(health: Health, quota_word: u64, tag: u32) -> HostState {
    if let Health::Failed { .. } = health {
        return HostState::Failed;
    }
    let (t, exhausted, count) = unpack_quota(quota_word);
    if t == tag && exhausted && count == 0 {
        HostState::Limited
    } else {
        HostState::Normal
    }
}

/// What a pull (or probe) returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullOutcome {
    /// The slice exists; `granted` may be 0.
    Granted {
        /// Permits granted.
        granted: u64,
        /// What Redis has left for the slice afterwards.
        remaining: i64,
    },
    /// The slice key does not exist.
    Missing,
    /// Redis time is outside the slice's window: Redis works (and the slice exists), but the
    /// host's clock is off; the slice is LIMITED (or not pulled for until its window opens).
    OutsideWindow,
    /// Redis answered with an error, or could not be reached.
    Error,
    /// No answer within the pull timeout.
    Timeout,
}

/// What to do after a pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// The new health.
    pub health: Health,
    /// When FAILED: the time of the next probe.
    pub next_probe_ms: Option<i64>,
    /// Mark the slice exhausted (LIMITED once the local quota is spent).
    pub exhausted: bool,
}

/// The transition rules, parameterised by the probe interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    /// Time between probes while FAILED.
    pub probe_interval_ms: i64,
}

impl Machine {
    /// The state after `outcome` at `now_ms`.
    ///
    /// ```
    /// use sluice::state::*;
    /// let m = Machine { probe_interval_ms: 5_000 };
    /// let t = m.after_pull(Health::Normal, PullOutcome::Timeout, 100);
    /// assert_eq!(t.health, Health::Failed { since_ms: 100, cause: Cause::Timeout });
    /// assert_eq!(t.next_probe_ms, Some(5_100));
    /// // A failed probe keeps the original failure time.
    /// let t2 = m.after_pull(t.health, PullOutcome::Missing, 5_100);
    /// assert_eq!(t2.health, Health::Failed { since_ms: 100, cause: Cause::MissingSlice });
    /// // Success: NORMAL; nothing left: LIMITED for the slice.
    /// let t3 = m.after_pull(t2.health, PullOutcome::Granted { granted: 5, remaining: 0 }, 10_100);
    /// assert_eq!((t3.health, t3.exhausted), (Health::Normal, true));
    /// ```
    pub fn after_pull(&self, health: Health, outcome: PullOutcome, now_ms: i64) -> Transition {
        let fail = |cause| {
            let since_ms = match health {
                Health::Failed { since_ms, .. } => since_ms,
                Health::Normal => now_ms,
            };
            Transition {
                health: Health::Failed { since_ms, cause },
                next_probe_ms: Some(now_ms + self.probe_interval_ms),
                exhausted: false,
            }
        };
        match outcome {
            PullOutcome::Granted { remaining, .. } => Transition {
                health: Health::Normal,
                next_probe_ms: None,
                exhausted: remaining <= 0,
            },
            PullOutcome::OutsideWindow => Transition {
                health: Health::Normal,
                next_probe_ms: None,
                exhausted: false,
            },
            PullOutcome::Missing => fail(Cause::MissingSlice),
            PullOutcome::Error => fail(Cause::Error),
            PullOutcome::Timeout => fail(Cause::Timeout),
        }
    }

    /// True when a FAILED task should probe at `now_ms`.
    pub fn probe_due(&self, health: Health, next_probe_ms: i64, now_ms: i64) -> bool {
        matches!(health, Health::Failed { .. }) && now_ms >= next_probe_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::pack_quota;

    #[test]
    fn failed_wins_over_quota() {
        let h = Health::Failed {
            since_ms: 1,
            cause: Cause::Error,
        };
        assert_eq!(view(h, pack_quota(1, false, 10), 1), HostState::Failed);
    }

    #[test]
    fn full_cycle() {
        let m = Machine {
            probe_interval_ms: 1_000,
        };
        let mut h = Health::Normal;
        let t = m.after_pull(h, PullOutcome::Error, 50);
        h = t.health;
        assert!(!m.probe_due(h, t.next_probe_ms.unwrap(), 1_049));
        assert!(m.probe_due(h, t.next_probe_ms.unwrap(), 1_050));
        let t = m.after_pull(
            h,
            PullOutcome::Granted {
                granted: 10,
                remaining: 90,
            },
            1_050,
        );
        assert_eq!(t.health, Health::Normal);
        assert!(!t.exhausted);
        assert!(!m.probe_due(t.health, 0, 5_000));
        for c in [Cause::Error, Cause::Timeout, Cause::MissingSlice] {
            let h = Health::Failed {
                since_ms: (1 << 60) + 7,
                cause: c,
            };
            assert_eq!(Health::decode(h.encode()), h);
        }
    }
}
