//! The IETF RateLimit header fields and `Retry-After`, as pure functions of a [`LimitInfo`].
//!
//! Syntax: draft-ietf-httpapi-ratelimit-headers (the working group's current text). Both fields
//! are Structured Field Lists (RFC 9651) of one Item each, a String naming the policy:
//!
//! ```text
//! RateLimit-Policy: "checkout";q=100;w=1                     q = threshold per slice, w = slice (s)
//! RateLimit-Policy: "checkout";q=100;sluice-w-ms=100         a slice that is not whole seconds
//! RateLimit-Policy: "jobs";q=8;qu="concurrent-requests"      mode concurrency (no window)
//! RateLimit: "checkout";r=37;t=1;sluice-reset-ms=412         r = remaining, t = reset (s, rounded up)
//! ```
//!
//! * `w` and `t` are whole seconds: the draft allows nothing else ("sub-second precision is not
//!   supported" for `w`; `t` is a delta-seconds Integer). Sluice rounds **up** (a client that
//!   waits `t` seconds never comes back before the quota is there) and carries the precise
//!   value in the vendor-prefixed parameters the draft provides for ("other parameters are
//!   allowed"; "SHOULD be prefixed with a vendor identifier"): `sluice-reset-ms` (Integer, ms,
//!   rounded up) on `RateLimit`, and `sluice-w-ms` on `RateLimit-Policy` instead of `w` when the
//!   slice is not a whole number of seconds (`w` is optional; a rounded `w` would misstate the
//!   rate).
//! * `Retry-After` (RFC 9110 delay-seconds) is the same rounded-up value as `t` on a
//!   rejection, so it never points earlier than the reset, as the draft asks.
//! * No `pk` (partition key): keys are often API keys or user ids, and the draft says not to
//!   return partition keys that carry sensitive information.

use std::time::Duration;

use http::HeaderValue;

/// What a policy counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuotaUnit {
    /// Permits per slice (modes `pooled`, `local`, `exact_*`): the draft's default unit
    /// `requests` (each request costs what the layer's cost function says).
    Requests,
    /// Permits in flight (mode `concurrency`): the draft's `concurrent-requests`.
    ConcurrentRequests,
}

/// The limit a request was decided against, as the RateLimit fields describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitInfo {
    /// The policy's name: the task's name unless [`super::SluiceLayer::policy_name`] says
    /// otherwise.
    pub policy: String,
    /// The threshold (`q`): permits per slice from the task's spec (also for a key of a keyed
    /// task, even one with an override: the layer cannot read a key's override locally yet),
    /// or permits in flight for mode `concurrency`. Schedules and dynamic limiting
    /// change the effective threshold of a slice; `q` stays the spec's, as the draft wants
    /// the policy field to stay consistent.
    pub limit: u64,
    /// Slice length (the window), ms; 0 for mode `concurrency`.
    pub window_ms: u64,
    /// What Sluice can say locally about what is left (`r`): the permits this host holds in
    /// shared memory for the current slice (or, for mode `concurrency`, the permits this host
    /// may still hand out), 0 after a rejection and when the host holds no countable local
    /// quota (modes `local` and `exact_*`, FAILED) or cannot read it (a key of a keyed task:
    /// the key table has no read accessor for the layer yet). Not the cluster's remaining quota: other
    /// hosts and Redis may hold more, so a client that stops at `r = 0` is merely careful.
    pub remaining: u64,
    /// Until more quota is made available: the end of the current slice for an admitted
    /// request, the decision's retry-after for a rejected one. `None` for mode `concurrency`
    /// (a permit comes back when a request ends, not at a time).
    pub reset: Option<Duration>,
    /// What `q` counts.
    pub unit: QuotaUnit,
}

/// Largest Integer a Structured Field may carry (15 digits).
const SF_INT_MAX: u64 = 999_999_999_999_999;

/// Whole seconds, rounded up (HTTP delay-seconds).
///
/// ```
/// use std::time::Duration;
/// use sluice::layer::ceil_secs;
/// assert_eq!(ceil_secs(Duration::from_millis(40)), 1);
/// assert_eq!(ceil_secs(Duration::from_millis(1_000)), 1);
/// assert_eq!(ceil_secs(Duration::from_millis(1_001)), 2);
/// assert_eq!(ceil_secs(Duration::ZERO), 0);
/// ```
pub fn ceil_secs(d: Duration) -> u64 {
    (d.as_nanos().div_ceil(1_000_000_000) as u64).min(SF_INT_MAX)
}

/// Milliseconds, rounded up.
fn ceil_ms(d: Duration) -> u64 {
    (d.as_nanos().div_ceil(1_000_000) as u64).min(SF_INT_MAX)
}

/// `Retry-After` for a rejection that may be retried after `d`: whole seconds rounded up,
/// at least 1 (a `0` invites an immediate retry storm).
///
/// ```
/// use std::time::Duration;
/// use sluice::layer::retry_after_secs;
/// assert_eq!(retry_after_secs(Duration::from_millis(60)), 1);  // a 100 ms slice
/// assert_eq!(retry_after_secs(Duration::from_millis(2_500)), 3);
/// ```
pub fn retry_after_secs(d: Duration) -> u64 {
    ceil_secs(d).max(1)
}

/// An RFC 9651 sf-string (printable ASCII; `"` and `\` escaped; anything else dropped).
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => {}
        }
    }
    out.push('"');
    out
}

impl LimitInfo {
    /// The `RateLimit-Policy` field value.
    ///
    /// ```
    /// use sluice::layer::{LimitInfo, QuotaUnit};
    /// let mut i = LimitInfo { policy: "api".into(), limit: 50, window_ms: 2_000, remaining: 0,
    ///     reset: None, unit: QuotaUnit::Requests };
    /// assert_eq!(i.policy_field(), r#""api";q=50;w=2"#);
    /// i.window_ms = 100;
    /// assert_eq!(i.policy_field(), r#""api";q=50;sluice-w-ms=100"#);
    /// ```
    pub fn policy_field(&self) -> String {
        let mut v = format!(
            "{};q={}",
            sf_string(&self.policy),
            self.limit.min(SF_INT_MAX)
        );
        match self.unit {
            QuotaUnit::ConcurrentRequests => v.push_str(";qu=\"concurrent-requests\""),
            QuotaUnit::Requests if self.window_ms > 0 && self.window_ms.is_multiple_of(1_000) => {
                v.push_str(&format!(";w={}", (self.window_ms / 1_000).min(SF_INT_MAX)));
            }
            QuotaUnit::Requests if self.window_ms > 0 => {
                v.push_str(&format!(";sluice-w-ms={}", self.window_ms.min(SF_INT_MAX)));
            }
            QuotaUnit::Requests => {}
        }
        v
    }

    /// The `RateLimit` field value.
    ///
    /// ```
    /// use std::time::Duration;
    /// use sluice::layer::{LimitInfo, QuotaUnit};
    /// let i = LimitInfo { policy: "api".into(), limit: 50, window_ms: 100, remaining: 7,
    ///     reset: Some(Duration::from_micros(41_200)), unit: QuotaUnit::Requests };
    /// assert_eq!(i.limit_field(), r#""api";r=7;t=1;sluice-reset-ms=42"#);
    /// ```
    pub fn limit_field(&self) -> String {
        let mut v = format!(
            "{};r={}",
            sf_string(&self.policy),
            self.remaining.min(SF_INT_MAX)
        );
        if let Some(reset) = self.reset {
            v.push_str(&format!(
                ";t={};sluice-reset-ms={}",
                ceil_secs(reset),
                ceil_ms(reset)
            ));
        }
        v
    }

    /// Adds `RateLimit-Policy` and `RateLimit` to `headers` (replacing earlier values).
    pub fn apply(&self, headers: &mut http::HeaderMap) {
        // Both values are printable ASCII by construction.
        if let Ok(v) = HeaderValue::from_str(&self.policy_field()) {
            headers.insert(RATELIMIT_POLICY, v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.limit_field()) {
            headers.insert(RATELIMIT, v);
        }
    }
}

/// `RateLimit-Policy`.
pub const RATELIMIT_POLICY: http::HeaderName = http::HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub const RATELIMIT: http::HeaderName = http::HeaderName::from_static("ratelimit");

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> LimitInfo {
        LimitInfo {
            policy: "a\"b\\c\u{e9}".into(),
            limit: u64::MAX,
            window_ms: 1_500,
            remaining: 3,
            reset: Some(Duration::from_nanos(1)),
            unit: QuotaUnit::Requests,
        }
    }

    #[test]
    fn strings_are_escaped_and_integers_clamped() {
        let i = info();
        assert_eq!(
            i.policy_field(),
            r#""a\"b\\c";q=999999999999999;sluice-w-ms=1500"#
        );
        assert_eq!(i.limit_field(), r#""a\"b\\c";r=3;t=1;sluice-reset-ms=1"#);
    }

    #[test]
    fn concurrency_has_a_unit_and_no_window_or_reset() {
        let i = LimitInfo {
            policy: "jobs".into(),
            limit: 8,
            window_ms: 0,
            remaining: 5,
            reset: None,
            unit: QuotaUnit::ConcurrentRequests,
        };
        assert_eq!(i.policy_field(), r#""jobs";q=8;qu="concurrent-requests""#);
        assert_eq!(i.limit_field(), r#""jobs";r=5"#);
    }

    #[test]
    fn rounding_is_up() {
        assert_eq!(ceil_secs(Duration::from_millis(999)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(86_400)), 86_400);
        assert_eq!(ceil_ms(Duration::from_micros(1_001)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }
}
