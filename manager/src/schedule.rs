//! Cron schedules: which threshold a slice gets.
//!
//! A task's `schedules` is a list of `{cron, threshold, timezone}` entries. **A slice's threshold
//! is that of the last entry whose cron expression matches the slice's start time, read on the
//! wall clock of the entry's time zone (UTC unless it names an IANA zone), else the task's base
//! threshold.** Matching is exact, field by field, at one-second resolution:
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
//! **Daylight-saving changes** follow from reading the wall clock (see `docs/operations.md`):
//! a slice's start instant is converted to the zone's local time, and that time is matched.
//! When clocks jump forward (02:00 → 03:00 in Europe/Berlin) the skipped local times exist on
//! no slice, so they match nothing: a window loses that hour (`* * 0-5 * * *` lasts five hours
//! that night) and an entry that matches only skipped times does not apply that day. When
//! clocks go back (03:00 → 02:00) the repeated local times occur twice and match both times:
//! a window covers both passes (`* * 2 * * *` lasts two hours that night), and so does a point
//! expression (`0 30 2 * * *` matches the 02:30:00 slice of each pass). A slice that straddles
//! a change is matched by its start, like every slice.
//!
//! The effective threshold of a slice is computed in this order (documented in
//! `docs/architecture.md`): base threshold → schedule (this module) → dynamic limiting.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
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

/// The zone a schedule entry names when it names none.
pub const DEFAULT_TIMEZONE: &str = "UTC";

/// Parses an IANA time zone name (`"Europe/Berlin"`, `"UTC"`), with a message fit for an API
/// error. Names are matched exactly, as the tz database spells them (links such as
/// `"US/Eastern"` included); a name that differs only in case gets a suggestion.
pub fn parse_timezone(name: &str) -> Result<Tz, String> {
    let name = name.trim();
    if let Ok(tz) = name.parse::<Tz>() {
        return Ok(tz);
    }
    let hint = chrono_tz::TZ_VARIANTS
        .iter()
        .find(|z| z.name().eq_ignore_ascii_case(name))
        .map_or_else(
            || " (a tz database name such as \"Europe/Berlin\" or \"UTC\")".to_string(),
            |z| format!(" (did you mean {:?}?)", z.name()),
        );
    Err(format!("unknown IANA time zone {name:?}{hint}"))
}

/// A task's schedule entries, parsed once.
#[derive(Debug, Clone, Default)]
pub struct CompiledSchedule {
    entries: Vec<(Schedule, Tz, u64)>,
}

impl CompiledSchedule {
    /// Compiles validated entries (invalid ones, which validation rejects, are skipped).
    pub fn new(entries: &[ScheduleEntry]) -> Self {
        Self {
            entries: entries
                .iter()
                .filter_map(|e| {
                    let s = parse_cron(&e.cron).ok()?;
                    let tz = parse_timezone(&e.timezone).ok()?;
                    Some((s, tz, e.threshold))
                })
                .collect(),
        }
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The threshold of the slice starting at `slice_start_ms`: the last entry whose cron
    /// matches the slice's start on its zone's wall clock, or `base`.
    ///
    /// ```
    /// use sluice_manager::schedule::CompiledSchedule;
    /// use sluice_manager::spec::ScheduleEntry;
    /// let s = CompiledSchedule::new(&[
    ///     ScheduleEntry { cron: "* * 9-17 * * *".into(), threshold: 200, timezone: "UTC".into() },
    ///     ScheduleEntry { cron: "* * 12 * * *".into(), threshold: 300, timezone: "UTC".into() },
    ///     // 1970-01-01 was winter: Europe/Berlin is UTC+1.
    ///     ScheduleEntry { cron: "* * 6 * * *".into(), threshold: 400, timezone: "Europe/Berlin".into() },
    /// ]);
    /// let h = |hour: i64| hour * 3_600_000;
    /// assert_eq!(s.threshold_at(100, h(8)), 100);   // 08:00 UTC: base
    /// assert_eq!(s.threshold_at(100, h(9)), 200);   // 09:00: first entry
    /// assert_eq!(s.threshold_at(100, h(12)), 300);  // 12:00: both match, the last wins
    /// assert_eq!(s.threshold_at(100, h(5)), 400);   // 05:00 UTC = 06:00 in Berlin
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
            .find(|(s, tz, _)| s.includes(t.with_timezone(tz)))
            .map_or(base, |(_, _, th)| *th)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(cron: &str, threshold: u64, timezone: &str) -> ScheduleEntry {
        ScheduleEntry {
            cron: cron.into(),
            threshold,
            timezone: timezone.into(),
        }
    }

    fn ms(rfc3339: &str) -> i64 {
        DateTime::parse_from_rfc3339(rfc3339)
            .unwrap()
            .timestamp_millis()
    }

    /// Seconds in `[from, to)` (1 s slices) whose threshold is the entry's rather than the base.
    fn matching_seconds(s: &CompiledSchedule, from: &str, to: &str) -> Vec<i64> {
        (ms(from)..ms(to))
            .step_by(1_000)
            .filter(|&t| s.threshold_at(0, t) != 0)
            .collect()
    }

    #[test]
    fn field_count_is_checked() {
        assert!(parse_cron("* * * * *").unwrap_err().contains("5 fields"));
        assert!(parse_cron("* * * * * *").is_ok());
        assert!(parse_cron("0 0 9-17 * * Mon-Fri 2030").is_ok());
        assert!(parse_cron("61 * * * * *").is_err());
    }

    #[test]
    fn weekday_window() {
        let s = CompiledSchedule::new(&[entry("* * 9-17 * * Mon-Fri", 20_000, "UTC")]);
        // 2026-11-30 is a Monday.
        let monday_10 = ms("2026-11-30T10:15:30Z");
        let sunday_10 = monday_10 - 86_400_000;
        let monday_18 = monday_10 + 8 * 3_600_000;
        assert_eq!(s.threshold_at(5_000, monday_10), 20_000);
        assert_eq!(s.threshold_at(5_000, monday_10 + 250), 20_000);
        assert_eq!(s.threshold_at(5_000, sunday_10), 5_000);
        assert_eq!(s.threshold_at(5_000, monday_18), 5_000);
    }

    #[test]
    fn point_expression_matches_only_its_second() {
        let s = CompiledSchedule::new(&[entry("0 0 9-17 * * Mon-Fri", 7, "UTC")]);
        let nine = ms("2026-11-30T09:00:00Z");
        assert_eq!(s.threshold_at(1, nine), 7);
        assert_eq!(s.threshold_at(1, nine + 1_000), 1);
    }

    #[test]
    fn zone_names_are_checked() {
        assert_eq!(parse_timezone("Europe/Berlin").unwrap(), Tz::Europe__Berlin);
        assert_eq!(parse_timezone("UTC").unwrap(), Tz::UTC);
        assert_eq!(
            parse_timezone(" America/New_York ").unwrap(),
            Tz::America__New_York
        );
        assert!(
            parse_timezone("US/Eastern").is_ok(),
            "links are tz database names too"
        );
        let e = parse_timezone("Europe/Berln").unwrap_err();
        assert!(
            e.starts_with(r#"unknown IANA time zone "Europe/Berln""#),
            "{e}"
        );
        let e = parse_timezone("europe/berlin").unwrap_err();
        assert!(e.contains(r#"did you mean "Europe/Berlin"?"#), "{e}");
        for bad in ["", "CEST", "+02:00", "Europe/", "Mars/Olympus_Mons"] {
            assert!(parse_timezone(bad).is_err(), "{bad:?}");
        }
    }

    /// A zone moves the window: 09:00–17:59 in Berlin is 08:00–16:59 UTC in winter and
    /// 07:00–15:59 UTC in summer; the UTC entry beside it is unchanged.
    #[test]
    fn a_zone_moves_the_window_with_the_season() {
        let berlin = CompiledSchedule::new(&[entry("* * 9-17 * * *", 5, "Europe/Berlin")]);
        let utc = CompiledSchedule::new(&[entry("* * 9-17 * * *", 5, "UTC")]);
        let winter = matching_seconds(&berlin, "2026-01-15T00:00:00Z", "2026-01-16T00:00:00Z");
        assert_eq!(winter.len(), 9 * 3_600);
        assert_eq!(winter[0], ms("2026-01-15T08:00:00Z"));
        let summer = matching_seconds(&berlin, "2026-07-15T00:00:00Z", "2026-07-16T00:00:00Z");
        assert_eq!(summer.len(), 9 * 3_600);
        assert_eq!(summer[0], ms("2026-07-15T07:00:00Z"));
        let plain = matching_seconds(&utc, "2026-07-15T00:00:00Z", "2026-07-16T00:00:00Z");
        assert_eq!(plain[0], ms("2026-07-15T09:00:00Z"));
        assert_eq!(*plain.last().unwrap(), ms("2026-07-15T17:59:59Z"));
    }

    /// An entry without a zone (as every spec stored before zones existed) is read in UTC, in
    /// every season.
    #[test]
    fn an_entry_without_a_zone_is_read_in_utc() {
        let spec = crate::spec::parse_request(
            "t",
            br#"{"threshold": 1, "schedules": [{"cron": "* * 9 * * *", "threshold": 5}]}"#,
        )
        .unwrap()
        .spec;
        let s = CompiledSchedule::new(&spec.schedules);
        for day in ["2026-01-15", "2026-03-29", "2026-07-15", "2026-10-25"] {
            let m = matching_seconds(&s, &format!("{day}T00:00:00Z"), &format!("{day}T23:59:59Z"));
            assert_eq!(m.len(), 3_600, "{day}");
            assert_eq!(m[0], ms(&format!("{day}T09:00:00Z")), "{day}");
        }
    }

    /// Spring forward in Europe/Berlin, 2026-03-29 01:00 UTC: 02:00 CET becomes 03:00 CEST.
    /// Local 02:00:00–02:59:59 exists on no slice, so nothing matches it (skipped, not moved);
    /// a window across the gap is an hour shorter; 03:00 starts right at the jump.
    #[test]
    fn berlin_spring_forward_skips_the_missing_hour() {
        let night = "2026-03-28T20:00:00Z";
        let morning = "2026-03-29T08:00:00Z";
        let gap_only = CompiledSchedule::new(&[entry("* 30 2 * * *", 7, "Europe/Berlin")]);
        assert!(matching_seconds(&gap_only, night, morning).is_empty());
        // The day before, the same entry matches its 60 seconds (01:30 UTC = 02:30 CET).
        let before = matching_seconds(&gap_only, "2026-03-27T20:00:00Z", "2026-03-28T08:00:00Z");
        assert_eq!(before.len(), 60);
        assert_eq!(before[0], ms("2026-03-28T01:30:00Z"));
        let point = CompiledSchedule::new(&[entry("0 30 2 * * *", 7, "Europe/Berlin")]);
        assert!(matching_seconds(&point, night, morning).is_empty());

        let window = CompiledSchedule::new(&[entry("* * 0-5 * * *", 7, "Europe/Berlin")]);
        let w = matching_seconds(&window, night, morning);
        assert_eq!(
            w.len(),
            5 * 3_600,
            "00:00–05:59 local lasts five hours that night"
        );
        assert_eq!(w[0], ms("2026-03-28T23:00:00Z")); // 00:00 CET
        assert_eq!(*w.last().unwrap(), ms("2026-03-29T03:59:59Z")); // 05:59:59 CEST

        let three = CompiledSchedule::new(&[entry("* * 3 * * *", 7, "Europe/Berlin")]);
        let jump = ms("2026-03-29T01:00:00Z");
        assert_eq!(three.threshold_at(1, jump - 1_000), 1); // 01:59:59 CET
        assert_eq!(three.threshold_at(1, jump), 7); // 03:00:00 CEST
        assert_eq!(matching_seconds(&three, night, morning).len(), 3_600);
    }

    /// Fall back in Europe/Berlin, 2026-10-25 01:00 UTC: 03:00 CEST becomes 02:00 CET. Local
    /// 02:00:00–02:59:59 happens twice and matches both times: a window covers both passes, a
    /// point expression matches the slice of each pass.
    #[test]
    fn berlin_fall_back_matches_both_passes_of_the_repeated_hour() {
        let night = "2026-10-24T20:00:00Z";
        let morning = "2026-10-25T08:00:00Z";
        let hour = CompiledSchedule::new(&[entry("* * 2 * * *", 7, "Europe/Berlin")]);
        let h = matching_seconds(&hour, night, morning);
        assert_eq!(h.len(), 2 * 3_600);
        assert_eq!(h[0], ms("2026-10-25T00:00:00Z")); // 02:00 CEST
        assert_eq!(*h.last().unwrap(), ms("2026-10-25T01:59:59Z")); // 02:59:59 CET

        let point = CompiledSchedule::new(&[entry("0 30 2 * * *", 7, "Europe/Berlin")]);
        assert_eq!(
            matching_seconds(&point, night, morning),
            vec![ms("2026-10-25T00:30:00Z"), ms("2026-10-25T01:30:00Z")]
        );

        let window = CompiledSchedule::new(&[entry("* * 0-5 * * *", 7, "Europe/Berlin")]);
        assert_eq!(
            matching_seconds(&window, night, morning).len(),
            7 * 3_600,
            "00:00–05:59 local lasts seven hours that night"
        );
        // Nothing is skipped: 03:00 CET follows the second pass.
        let three = CompiledSchedule::new(&[entry("* * 3 * * *", 7, "Europe/Berlin")]);
        assert_eq!(
            matching_seconds(&three, night, morning)[0],
            ms("2026-10-25T02:00:00Z")
        );
    }

    /// America/New_York: spring forward 2026-03-08 07:00 UTC (02:00 EST → 03:00 EDT), fall back
    /// 2026-11-01 06:00 UTC (02:00 EDT → 01:00 EST; 01:xx happens twice).
    #[test]
    fn new_york_both_transitions() {
        let two = CompiledSchedule::new(&[entry("* * 2 * * *", 7, "America/New_York")]);
        assert!(
            matching_seconds(&two, "2026-03-08T00:00:00Z", "2026-03-08T12:00:00Z").is_empty(),
            "02:xx does not exist that day"
        );
        let jump = ms("2026-03-08T07:00:00Z");
        let three = CompiledSchedule::new(&[entry("* * 3 * * *", 7, "America/New_York")]);
        assert_eq!(three.threshold_at(1, jump - 1_000), 1); // 01:59:59 EST
        assert_eq!(three.threshold_at(1, jump), 7); // 03:00:00 EDT

        let one = CompiledSchedule::new(&[entry("* * 1 * * *", 7, "America/New_York")]);
        let m = matching_seconds(&one, "2026-11-01T00:00:00Z", "2026-11-01T12:00:00Z");
        assert_eq!(m.len(), 2 * 3_600);
        assert_eq!(m[0], ms("2026-11-01T05:00:00Z")); // 01:00 EDT
        assert_eq!(*m.last().unwrap(), ms("2026-11-01T06:59:59Z")); // 01:59:59 EST
        // The repeated hour is not also matched by the zone's "2" hour.
        assert_eq!(
            matching_seconds(&two, "2026-11-01T00:00:00Z", "2026-11-01T12:00:00Z")[0],
            ms("2026-11-01T07:00:00Z")
        );
    }

    /// A slice that straddles a change is matched by its start: a 2 h slice from 00:00 UTC on
    /// 2026-03-29 starts at 01:00 CET and ends at 04:00 CEST.
    #[test]
    fn a_slice_straddling_a_change_takes_its_start() {
        let s = CompiledSchedule::new(&[
            entry("* * 1 * * *", 10, "Europe/Berlin"),
            entry("* * 3 * * *", 30, "Europe/Berlin"),
        ]);
        let start = ms("2026-03-29T00:00:00Z");
        assert_eq!(start % 7_200_000, 0, "on the 2 h grid");
        assert_eq!(s.threshold_at(1, start), 10);
        assert_eq!(s.threshold_at(1, start + 7_200_000), 1); // 04:00 CEST
        // A 1 s slice at 01:59:59.5 CET (100 ms grid) still reads 01:59:59.
        assert_eq!(s.threshold_at(1, ms("2026-03-29T00:59:59.500Z")), 10);
    }

    /// Entries in different zones in one task: the last match wins, each read on its own clock.
    #[test]
    fn entries_in_different_zones_each_use_their_clock() {
        let s = CompiledSchedule::new(&[
            entry("* * 9-17 * * *", 100, "America/New_York"),
            entry("* * 9-17 * * *", 200, "Europe/Berlin"),
        ]);
        // 2026-07-15 14:00 UTC = 16:00 Berlin = 10:00 New York: both match, Berlin is last.
        assert_eq!(s.threshold_at(1, ms("2026-07-15T14:00:00Z")), 200);
        // 17:00 UTC = 19:00 Berlin = 13:00 New York.
        assert_eq!(s.threshold_at(1, ms("2026-07-15T17:00:00Z")), 100);
        // 06:00 UTC = 08:00 Berlin = 02:00 New York.
        assert_eq!(s.threshold_at(1, ms("2026-07-15T06:00:00Z")), 1);
    }
}
