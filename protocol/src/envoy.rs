//! The envoyproxy/ratelimit configuration as Sluice stores it: the units a slice can be, shared
//! by the manager's import and the host agent's RLS answers.

/// A `rate_limit.unit` Sluice can express: one slice of that length. (envoyproxy/ratelimit
/// also has `week`, `month`, `year`; Sluice's slices are at most one day.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// 1 s slices.
    Second,
    /// 60 s slices.
    Minute,
    /// 1 h slices.
    Hour,
    /// 1 day slices.
    Day,
}

impl Unit {
    /// Every unit.
    pub const ALL: [Unit; 4] = [Unit::Second, Unit::Minute, Unit::Hour, Unit::Day];

    /// The unit named `s` (lower case, as in the YAML and the compiled JSON).
    ///
    /// ```
    /// use sluice_protocol::envoy::Unit;
    /// assert_eq!(Unit::parse("minute"), Some(Unit::Minute));
    /// assert_eq!(Unit::parse("week"), None);
    /// ```
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|u| u.as_str() == s)
    }

    /// The name (lower case).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Second => "second",
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
        }
    }

    /// The slice length, ms.
    pub fn slice_ms(self) -> u64 {
        match self {
            Self::Second => 1_000,
            Self::Minute => 60_000,
            Self::Hour => 3_600_000,
            Self::Day => 86_400_000,
        }
    }

    /// The unit whose slice is `ms` long, if any.
    ///
    /// ```
    /// use sluice_protocol::envoy::Unit;
    /// assert_eq!(Unit::of_slice_ms(3_600_000), Some(Unit::Hour));
    /// assert_eq!(Unit::of_slice_ms(500), None);
    /// ```
    pub fn of_slice_ms(ms: u64) -> Option<Self> {
        Self::ALL.into_iter().find(|u| u.slice_ms() == ms)
    }

    /// The value of Envoy's `RateLimitResponse.RateLimit.Unit` enum (`SECOND` = 1 … `DAY` = 4).
    pub fn proto(self) -> i32 {
        match self {
            Self::Second => 1,
            Self::Minute => 2,
            Self::Hour => 3,
            Self::Day => 4,
        }
    }
}
