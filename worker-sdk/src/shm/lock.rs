//! Lock words in the segment ([`ShmLock`]): who holds them (a participant and its
//! generation), when taken, and how a dead or stuck holder is noticed.

use super::*;

/// A participant of a segment and its generation: who holds a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holder {
    /// Participant slot.
    pub participant: u16,
    /// Its generation when it took the lock.
    pub generation: u16,
}

impl Holder {
    fn token(self, now_ms: i64) -> u64 {
        ((self.participant as u64) << 48)
            | ((self.generation as u64) << 32)
            | (now_ms as u64 & 0xFFFF_FFFF)
    }

    fn of(word: u64) -> Self {
        Self {
            participant: (word >> 48) as u16,
            generation: (word >> 32) as u16,
        }
    }
}

/// A lock in shared memory: one word holding `participant:16 | generation:16 |
/// acquired_ms:32` (0 = free; a generation is never 0, so a held lock is never 0).
///
/// Taken with compare-and-swap. A waiter takes the lock over when the holder is dead (its
/// participant's byte lock is gone, or the participant slot was claimed again since: see the
/// module docs) or the lock is older than the caller's timeout, so a crashed holder costs one
/// check, in any PID namespace.
#[derive(Debug, Clone, Copy)]
pub struct ShmLock<'a> {
    pub(super) word: &'a AtomicU64,
    pub(super) seg: &'a Segment,
}

/// The outcome of [`ShmLock::try_lock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockAttempt {
    /// The caller holds the lock; unlock with this token.
    Acquired {
        /// Pass to [`ShmLock::unlock`].
        token: u64,
        /// A dead or timed-out holder that was replaced, if any.
        took_over_from: Option<Holder>,
    },
    /// A live holder has it.
    Busy {
        /// The holder.
        holder: Holder,
        /// How long it has held it.
        age_ms: u64,
    },
}

impl ShmLock<'_> {
    /// Tries once to take the lock at `now_ms` (host clock).
    pub fn try_lock(&self, now_ms: i64, timeout_ms: u64) -> LockAttempt {
        let token = self.seg.me.token(now_ms);
        let cur = self.word.load(Ordering::Acquire);
        if cur == 0 {
            return match self
                .word
                .compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => LockAttempt::Acquired {
                    token,
                    took_over_from: None,
                },
                Err(x) => busy(x, now_ms),
            };
        }
        let holder = Holder::of(cur);
        let age = (now_ms as u32).wrapping_sub(cur as u32) as u64;
        let age = if age > u32::MAX as u64 / 2 { 0 } else { age };
        if age > timeout_ms || !self.seg.alive(holder) {
            if self
                .word
                .compare_exchange(cur, token, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return LockAttempt::Acquired {
                    token,
                    took_over_from: Some(holder),
                };
            }
            return busy(self.word.load(Ordering::Acquire), now_ms);
        }
        LockAttempt::Busy {
            holder,
            age_ms: age,
        }
    }

    /// Takes the lock if it is free (one compare-and-swap, no liveness check): the fast path
    /// of a spinning waiter.
    #[inline]
    pub fn try_fast(&self, now_ms: i64) -> Option<u64> {
        let token = self.seg.me.token(now_ms);
        self.word
            .compare_exchange(0, token, Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            .map(|_| token)
    }

    /// Releases the lock if `token` still holds it (a holder that was taken over does not
    /// release its successor's lock). Returns whether it did.
    pub fn unlock(&self, token: u64) -> bool {
        self.word
            .compare_exchange(token, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether the lock is still held under `token` (not released, not taken over).
    pub fn holds(&self, token: u64) -> bool {
        self.word.load(Ordering::Acquire) == token
    }

    /// The current holder, if held.
    pub fn holder(&self) -> Option<Holder> {
        let w = self.word.load(Ordering::Acquire);
        (w != 0).then(|| Holder::of(w))
    }
}

fn busy(w: u64, now_ms: i64) -> LockAttempt {
    if w == 0 {
        // Released between our two loads: report it as briefly busy; the caller retries.
        return LockAttempt::Busy {
            holder: Holder {
                participant: 0,
                generation: 0,
            },
            age_ms: 0,
        };
    }
    LockAttempt::Busy {
        holder: Holder::of(w),
        age_ms: (now_ms as u32).wrapping_sub(w as u32) as u64,
    }
}

/// A random segment id, never 0.
pub(super) fn random_id() -> u64 {
    crate::clock::random_u64().max(1)
}
