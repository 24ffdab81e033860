//! Host clock reads for the decision path.
//!
//! `clock_gettime(CLOCK_REALTIME)` through the vDSO: no system call, no allocation. Slices
//! follow this clock by default (as in the seed: hosts are kept in step by NTP); the client can
//! subtract the offset to Redis `TIME` measured on every pull instead (see
//! [`crate::config::ClockSource`]).
//!
//! The admission fast path of [`crate::Task::try_acquire`] reads `CLOCK_REALTIME_COARSE`
//! instead ([`coarse_us`]): the kernel's copy of the real-time clock as of the last timer
//! tick, cheaper than reading the TSC and scaling it. It is never ahead of `CLOCK_REALTIME`
//! and lags it by up to one tick ([`coarse_resolution_us`], 4 ms at `HZ=250`) plus the
//! lateness of the timekeeping CPU's tick (it is advanced by the timer interrupt, not by a
//! thread, so starving the reading process of CPU cannot make it older). The client reads the
//! precise clock whenever the coarse reading is within a guard of three ticks of the slice's
//! end (see `docs/sdk.md`, "The clock of the fast path").
//!
//! Also the two helpers every layer of the SDK uses and that belong to none of them: 64
//! random bits (`random_u64`) and a deadline that cannot overflow (`deadline_after`).
//! This module imports nothing from the crate: it is the bottom of the module graph.

use std::time::{Duration, Instant};

/// Host Unix time in microseconds.
#[inline]
pub fn host_us() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    #[allow(clippy::unnecessary_cast)] // time_t and c_long are not i64 everywhere
    let us = ts.tv_sec as i64 * 1_000_000 + ts.tv_nsec as i64 / 1_000;
    us
}

/// Host Unix time in microseconds on `CLOCK_REALTIME_COARSE`: up to about a tick (plus the
/// tick's lateness) behind [`host_us`], never ahead of it.
#[inline]
pub fn coarse_us() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass; CLOCK_REALTIME_COARSE exists on
    // Linux (since 2.6.32).
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    #[allow(clippy::unnecessary_cast)]
    let us = ts.tv_sec as i64 * 1_000_000 + ts.tv_nsec as i64 / 1_000;
    us
}

/// Resolution of `CLOCK_REALTIME_COARSE` (`clock_getres`) in µs: its tick. `None` if the
/// kernel does not tell.
pub fn coarse_resolution_us() -> Option<i64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_getres writes into the timespec we pass.
    let rc = unsafe { libc::clock_getres(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    #[allow(clippy::unnecessary_cast)]
    let us = ts.tv_sec as i64 * 1_000_000 + (ts.tv_nsec as i64 + 999) / 1_000;
    (rc == 0 && us > 0).then_some(us)
}

/// Host Unix time in milliseconds.
#[inline]
pub fn host_ms() -> i64 {
    host_us().div_euclid(1_000)
}

/// Milliseconds on the boot clock (`CLOCK_BOOTTIME`): monotonic, shared by every process of
/// the host, and running while a process is stopped (SIGSTOP) or the machine is suspended.
/// Lease validity in the host segment is kept on it, so no wall-clock step can extend a lease.
#[inline]
pub fn boot_ms() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass; CLOCK_BOOTTIME exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    #[allow(clippy::unnecessary_cast)]
    let ms = ts.tv_sec as i64 * 1_000 + ts.tv_nsec as i64 / 1_000_000;
    ms
}

/// 64 random bits (`getrandom`; the clock and pid if that fails).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into the buffer we pass.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == b.len() as isize {
        return u64::from_le_bytes(b);
    }
    (host_us() as u64).rotate_left(17) ^ ((std::process::id() as u64) << 40)
}

/// `now + timeout`, or a deadline that never comes when the sum does not fit the clock (a
/// timeout of `Duration::MAX` waits as long as the refill takes instead of panicking).
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

#[cfg(test)]
mod tests {
    #[test]
    fn agrees_with_system_time() {
        let a = crate::protocol::unix_ms();
        let b = super::host_ms();
        assert!((b - a).abs() < 1_000, "{a} vs {b}");
    }

    /// The coarse clock is never ahead of the precise one (what the fast path's stamps rely
    /// on); its lag is printed.
    #[test]
    fn coarse_is_never_ahead_of_the_precise_clock() {
        let res = super::coarse_resolution_us().expect("clock_getres");
        let mut worst = 0;
        for _ in 0..10_000 {
            let p1 = super::host_us();
            let c = super::coarse_us();
            let p2 = super::host_us();
            assert!(c <= p2, "coarse {c} ahead of precise {p2}");
            if p2 - p1 < 50 {
                worst = worst.max(p1 - c);
            }
        }
        // How far it lags depends on how late the kernel's tick is (machine load, a
        // hypervisor's steal): measured and printed, not asserted (docs/sdk.md, "The clock of
        // the fast path", says what a lag beyond the guard costs).
        eprintln!("coarse clock: tick {res} µs, worst lag seen {worst} µs (guard 3 ticks)");
    }
}
