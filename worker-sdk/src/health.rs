//! Outcome reporting: how the protected work went, per slice, so the manager can see error
//! rates and latencies (and adjust thresholds when dynamic limiting is on).
//!
//! [`crate::Task::report`] adds to the slice's counters in the host segment (`ok`/`err`,
//! `lat_sum_us`, `lat_n`); the background flusher moves them, batched per host, into the slice
//! hash in Redis together with the admitted/rejected counts.

use std::time::Duration;

use crate::shm::{Slot, field};

/// How one admitted unit of work ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// It succeeded.
    Ok,
    /// It failed (counts against the service's health).
    Err,
}

/// Records `outcome` and `latency` in the slice starting at `start_ms` (grid `slice_ms`) of
/// `slot`.
pub(crate) fn record(
    slot: &Slot,
    start_ms: i64,
    slice_ms: u64,
    outcome: Outcome,
    latency: Duration,
) {
    let f = match outcome {
        Outcome::Ok => field::OK,
        Outcome::Err => field::ERR,
    };
    slot.count(start_ms, slice_ms, f, 1);
    let us = latency.as_micros().min(u64::MAX as u128) as u64;
    slot.count(start_ms, slice_ms, field::LAT_SUM_US, us);
    slot.count(start_ms, slice_ms, field::LAT_N, 1);
}
