//! Quota words (`tag | exhausted | count`), slice tags and parity, and the meta fast word.

use super::*;

/// Packs a quota word.
///
/// ```
/// use sluice::shm::{pack_quota, unpack_quota};
/// let w = pack_quota(7, true, 42);
/// assert_eq!(unpack_quota(w), (7, true, 42));
/// ```
pub fn pack_quota(tag: u32, exhausted: bool, count: u32) -> u64 {
    ((tag as u64) << 32) | if exhausted { EXHAUSTED } else { 0 } | (count.min(MAX_COUNT) as u64)
}

/// Unpacks a quota word into `(tag, exhausted, count)`.
pub fn unpack_quota(w: u64) -> (u32, bool, u32) {
    (
        (w >> 32) as u32,
        w & EXHAUSTED != 0,
        (w & MAX_COUNT as u64) as u32,
    )
}

/// The quota-word tag of the slice starting at `start_ms`: its low 32 bits.
#[inline]
pub fn tag_of(start_ms: i64) -> u32 {
    start_ms as u32
}

/// The full start (Unix ms) nearest to `reference_ms` whose tag is `tag` (exact within ±24
/// days of the reference).
///
/// ```
/// use sluice::shm::{tag_of, untag};
/// let s = 1_700_000_123_000i64;
/// assert_eq!(untag(tag_of(s), s + 5_000), s);
/// assert_eq!(untag(tag_of(s), s - 5_000), s);
/// ```
pub fn untag(tag: u32, reference_ms: i64) -> i64 {
    reference_ms + tag.wrapping_sub(reference_ms as u32) as i32 as i64
}

/// Which of the two quota entries holds the slice starting at `start_ms` on a grid of
/// `slice_ms`.
#[inline]
pub fn parity(start_ms: i64, slice_ms: u64) -> usize {
    ((start_ms.max(0) as u64 / slice_ms.max(1)) & 1) as usize
}

const GEN_SHIFT: u32 = 44;

/// The slot generation carried by a meta fast word (known or not).
#[inline]
pub fn word_generation(w: u64) -> u16 {
    (w >> GEN_SHIFT) as u16
}

/// The fast-path part of a task's meta, packed into one word so a decision reads it with one
/// load and never sees half of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastMeta {
    /// Slice length.
    pub slice_ms: u64,
    /// Limiting mode.
    pub mode: Mode,
    /// FAILED behaviour.
    pub on_failure: OnFailure,
    /// Local limiter algorithm.
    pub algorithm: FallbackAlgorithm,
    /// The slot generation the meta was written for.
    pub generation: u16,
    /// Keyed task (bit 60).
    pub keyed: bool,
    /// Shadow mode (bit 61): rejections are counted, then admitted.
    pub shadow: bool,
    /// Paced slices (bit 62): the local quota is spent no faster than the slice's pace.
    pub paced: bool,
}

const KEYED_BIT: u64 = 1 << 60;
const SHADOW_BIT: u64 = 1 << 61;
const PACED_BIT: u64 = 1 << 62;

const MODES: [Mode; 5] = [
    Mode::Pooled,
    Mode::Local,
    Mode::ExactFixed,
    Mode::ExactSliding,
    Mode::Concurrency,
];
const ON_FAILURE: [OnFailure; 3] = [OnFailure::Local, OnFailure::Allow, OnFailure::Deny];
const ALGORITHMS: [FallbackAlgorithm; 5] = [
    FallbackAlgorithm::TokenBucket,
    FallbackAlgorithm::FixedWindow,
    FallbackAlgorithm::SlidingWindow,
    FallbackAlgorithm::SlidingLog,
    FallbackAlgorithm::LeakyBucket,
];

impl FastMeta {
    /// Encodes (the `known` bit set).
    ///
    /// ```
    /// use sluice_protocol::{FallbackAlgorithm, Mode, OnFailure};
    /// use sluice::shm::{FastMeta, word_generation};
    /// let m = FastMeta { slice_ms: 1_000, mode: Mode::ExactFixed, on_failure: OnFailure::Deny,
    ///                    algorithm: FallbackAlgorithm::SlidingLog, generation: 513,
    ///                    keyed: true, shadow: true, paced: false };
    /// assert_eq!(FastMeta::decode(m.encode()), Some(m));
    /// assert_eq!(word_generation(m.encode()), 513);
    /// ```
    pub fn encode(&self) -> u64 {
        let mode = MODES.iter().position(|m| *m == self.mode).unwrap_or(0) as u64;
        let onf = ON_FAILURE
            .iter()
            .position(|m| *m == self.on_failure)
            .unwrap_or(0) as u64;
        let alg = ALGORITHMS
            .iter()
            .position(|m| *m == self.algorithm)
            .unwrap_or(0) as u64;
        (1 << 63)
            | if self.keyed { KEYED_BIT } else { 0 }
            | if self.paced { PACED_BIT } else { 0 }
            | if self.shadow { SHADOW_BIT } else { 0 }
            | ((self.generation as u64) << GEN_SHIFT)
            | (mode << 40)
            | (onf << 36)
            | (alg << 32)
            | (self.slice_ms & 0xFFFF_FFFF)
    }

    /// Decodes; `None` when the word says "unknown" (or holds garbage).
    #[inline]
    pub fn decode(w: u64) -> Option<Self> {
        if w >> 63 == 0 {
            return None;
        }
        let slice_ms = w & 0xFFFF_FFFF;
        if slice_ms == 0 {
            return None;
        }
        Some(Self {
            slice_ms,
            mode: *MODES.get(((w >> 40) & 0x7) as usize)?,
            on_failure: *ON_FAILURE.get(((w >> 36) & 0x7) as usize)?,
            algorithm: *ALGORITHMS.get(((w >> 32) & 0xF) as usize)?,
            generation: word_generation(w),
            keyed: w & KEYED_BIT != 0,
            shadow: w & SHADOW_BIT != 0,
            paced: w & PACED_BIT != 0,
        })
    }
}

/// The meta fast word of an unknown meta in a slot of generation `generation`.
pub(super) fn unknown_word(generation: u16) -> u64 {
    (generation as u64) << GEN_SHIFT
}
