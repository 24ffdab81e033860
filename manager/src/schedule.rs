//! Cron schedules: which threshold a slice gets.
//!
//! A task's `schedules` is a list of `{cron, threshold}` entries. **A slice's threshold is that
//! of the last entry whose cron expression matches the slice's start time (UTC), else the
//! task's base threshold.** Matching is exact, field by field, at one-second resolution:
//!
//! ```text
//!  sec  min  hour  day-of-month  month  day-of-week  [year]
//!  *    *    9-17  *             *      Mon-Fri          → every slice 09:00:00–17:59:59, weekdays
//!  0    0    9-17  *             *      Mon-Fri          → only slices starting at 09:00:00, 10:00:00, …
//! ```
//!
//! The expressions use the `cron` crate's syntax: six or seven fields (seconds first, an
//! optional year last), ranges, lists, steps and names (`Mon-Fri`, `Jan`).
//!
//! The effective threshold of a slice is computed in this order (documented in
//! `docs/architecture.md`): base threshold → schedule (this module) → dynamic limiting.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use cron::Schedule;

use crate::spec::ScheduleEntry;

/// Parses a cron expression, with a message fit for an API error.
pub fn parse_cron(expr: &str) -> Result<Schedule, String> {
    let expr = expr.trim();
    let fields = expr.split_whitespace().count();
    if !(6..=7).contains(&fields) {
        return Err(format!(
            "{expr:?} has {fields} fields; expected 6 or 7: sec min hour day-of-month month \
             day-of-week [year], e.g. \"* * 9-17 * * Mon-Fri\""
        ));
    }
    Schedule::from_str(expr).map_err(|e| format!("{expr:?} is not a valid cron expression: {e}"))
}

/// A task's schedule entries, parsed once.
#[derive(Debug, Clone, Default)]
pub struct CompiledSchedule {
    entries: Vec<(Schedule, u64)>,
}

impl CompiledSchedule {
    /// Compiles validated entries (invalid ones, which validation rejects, are skipped).
    pub fn new(entries: &[ScheduleEntry]) -> Self {
        Self {
            entries: entries
                .iter()
                .filter_map(|e| parse_cron(&e.cron).ok().map(|s| (s, e.threshold)))
                .collect(),
        }
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The threshold of the slice starting at `slice_start_ms`: the last matching entry's, or
    /// `base`.
    ///
    /// ```
    /// use sluice_manager::schedule::CompiledSchedule;
    /// use sluice_manager::spec::ScheduleEntry;
    /// let s = CompiledSchedule::new(&[
    ///     ScheduleEntry { cron: "* * 9-17 * * *".into(), threshold: 200 },
    ///     ScheduleEntry { cron: "* * 12 * * *".into(), threshold: 300 },
    /// ]);
    /// let h = |hour: i64| hour * 3_600_000;
    /// assert_eq!(s.threshold_at(100, h(8)), 100);   // 08:00 UTC: base
    /// assert_eq!(s.threshold_at(100, h(9)), 200);   // 09:00: first entry
    /// assert_eq!(s.threshold_at(100, h(12)), 300);  // 12:00: both match, the last wins
    /// ```
    pub fn threshold_at(&self, base: u64, slice_start_ms: i64) -> u64 {
        if self.entries.is_empty() {
            return base;
        }
        let Some(t) = DateTime::<Utc>::from_timestamp_millis(slice_start_ms) else {
            return base;
        };
        self.entries
            .iter()
            .rev()
            .find(|(s, _)| s.includes(t))
            .map_or(base, |(_, th)| *th)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_count_is_checked() {
        assert!(parse_cron("* * * * *").unwrap_err().contains("5 fields"));
        assert!(parse_cron("* * * * * *").is_ok());
        assert!(parse_cron("0 0 9-17 * * Mon-Fri 2030").is_ok());
        assert!(parse_cron("61 * * * * *").is_err());
    }

    #[test]
    fn weekday_window() {
        let s = CompiledSchedule::new(&[ScheduleEntry {
            cron: "* * 9-17 * * Mon-Fri".into(),
            threshold: 20_000,
        }]);
        // 2026-11-30 is a Monday.
        let monday_10 = DateTime::parse_from_rfc3339("2026-11-30T10:15:30Z")
            .unwrap()
            .timestamp_millis();
        let sunday_10 = monday_10 - 86_400_000;
        let monday_18 = monday_10 + 8 * 3_600_000;
        assert_eq!(s.threshold_at(5_000, monday_10), 20_000);
        assert_eq!(s.threshold_at(5_000, monday_10 + 250), 20_000);
        assert_eq!(s.threshold_at(5_000, sunday_10), 5_000);
        assert_eq!(s.threshold_at(5_000, monday_18), 5_000);
    }

    #[test]
    fn point_expression_matches_only_its_second() {
        let s = CompiledSchedule::new(&[ScheduleEntry {
            cron: "0 0 9-17 * * Mon-Fri".into(),
            threshold: 7,
        }]);
        let nine = DateTime::parse_from_rfc3339("2026-11-30T09:00:00Z")
            .unwrap()
            .timestamp_millis();
        assert_eq!(s.threshold_at(1, nine), 7);
        assert_eq!(s.threshold_at(1, nine + 1_000), 1);
    }
}
