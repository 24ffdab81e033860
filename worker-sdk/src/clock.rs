//! Host clock reads for the decision path.
//!
//! `clock_gettime(CLOCK_REALTIME)` through the vDSO: no system call, no allocation. Slices
//! follow this clock by default (as in the seed: hosts are kept in step by NTP); the client can
//! subtract the offset to Redis `TIME` measured on every pull instead (see
//! [`crate::client::ClockSource`]).

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

#[cfg(test)]
mod tests {
    #[test]
    fn agrees_with_system_time() {
        let a = crate::protocol::unix_ms();
        let b = super::host_ms();
        assert!((b - a).abs() < 1_000, "{a} vs {b}");
    }
}
