//! Modes `exact_fixed` and `exact_sliding`, the pure core: what Redis's answer to one exact
//! call (TAKE / SLIDE) means for the decision. The call itself is `crate::plumbing::exact`.

use std::time::Duration;

use crate::decision::Decision;
use crate::protocol::Mode;
use crate::protocol::scripts::ExactReply;
use crate::shm::FastMeta;

/// An exact call's answer, for slice `index` decided at `now_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exact {
    /// The decision.
    Decided(Decision),
    /// Redis says the slice is outside its window (`redis_time_us`: Redis's clock): the host's
    /// clock is off; the caller logs it and answers LIMITED.
    OutsideWindow { start_ms: i64, redis_time_us: i64 },
    /// No answer, or no slice in Redis: the task's `on_failure` decides.
    Fallback,
}

/// Maps an exact call's reply (`None`: failed or timed out).
#[inline]
pub(crate) fn decide(reply: Option<ExactReply>, m: &FastMeta, index: u64, now_us: i64) -> Exact {
    match reply {
        Some(ExactReply::Admitted { .. }) => Exact::Decided(Decision::Allowed),
        Some(ExactReply::Refused { retry_after_us, .. }) => {
            let retry_us = match m.mode {
                Mode::ExactSliding => retry_after_us as i64,
                _ => (index + 1) as i64 * (m.slice_ms * 1_000) as i64 - now_us,
            };
            Exact::Decided(Decision::Limited {
                retry_after: Duration::from_micros(retry_us.max(1) as u64),
            })
        }
        Some(ExactReply::OutsideWindow { redis_time_us }) => Exact::OutsideWindow {
            start_ms: (index * m.slice_ms) as i64,
            redis_time_us,
        },
        Some(ExactReply::Missing { .. }) | None => Exact::Fallback,
    }
}
