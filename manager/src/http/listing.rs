//! The query of a task listing, `GET /api/v1/tasks` and `GET /api/v1/traffic` (contract in
//! `docs/api.md`): which tasks, and which page of them.
//!
//! ```text
//!  ?prefix=P   names starting with P ([A-Za-z0-9_.-], at most 64 characters)
//!  &mode=M     valid specs of mode M (pooled, local, exact_fixed, exact_sliding, concurrency)
//!  &keyed=K    valid specs that are keyed (true) or not (false)
//!  &limit=L    at most L entries (1 ..= 1000), and `next`: the cursor of the page after
//!  &after=A    names sorted strictly after the task name A (a `next` answered before)
//! ```
//!
//! Every parameter is optional; none at all lists every task, as before paging existed. Each
//! is validated (a 400 names it), an unknown or repeated one too. The query is parsed from the
//! raw query string, so a malformed one is this API's JSON error, not axum's plain text.

use std::num::NonZeroUsize;

use serde_json::{Value, json};
use sluice_protocol::{Mode, validate_task_name};

use crate::spec::FieldError;
use crate::tasks::{TaskFilter, TaskPage};

/// Most entries one page can ask for.
pub const MAX_LIMIT: usize = 1_000;

/// The parameters, in the order the errors list them.
const PARAMS: &[&str] = &["prefix", "mode", "keyed", "limit", "after"];

/// A validated listing query.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    /// Which tasks, from where.
    pub filter: TaskFilter,
    /// Entries of the page; None: every match, no cursor.
    pub limit: Option<NonZeroUsize>,
}

/// Longest `after` accepted: far more than a task name (64), for names written into etcd by
/// hand.
pub const MAX_AFTER_BYTES: usize = 1_024;

/// Validates a raw query string (`prefix=a&limit=10`, without the `?`; pure, the errors name
/// the parameter).
///
/// ```
/// use sluice_manager::http::listing::parse_list_query;
/// let q = parse_list_query("prefix=chk&mode=exact_fixed&keyed=false&limit=10&after=chk.a").unwrap();
/// assert_eq!(q.filter.prefix, "chk");
/// assert_eq!(q.filter.after.as_deref(), Some("chk.a"));
/// assert_eq!(q.limit.map(|l| l.get()), Some(10));
/// assert_eq!(parse_list_query("").unwrap(), Default::default());
/// assert_eq!(parse_list_query("limit=0").unwrap_err().field, "limit");
/// assert_eq!(parse_list_query("limit=1001").unwrap_err().field, "limit");
/// assert_eq!(parse_list_query("mode=fast").unwrap_err().field, "mode");
/// assert_eq!(parse_list_query("keyed=yes").unwrap_err().field, "keyed");
/// assert_eq!(parse_list_query("prefix=a%2Fb").unwrap_err().field, "prefix");
/// assert_eq!(parse_list_query("after=").unwrap_err().field, "after");
/// assert_eq!(parse_list_query("limit=1&limit=2").unwrap_err().field, "limit");
/// assert_eq!(parse_list_query("page=2").unwrap_err().field, "page");
/// ```
pub fn parse_list_query(raw: &str) -> Result<ListQuery, FieldError> {
    let bad = |field: &str, error: String| FieldError {
        error,
        field: field.to_string(),
    };
    let mut q = ListQuery::default();
    let mut seen: Vec<String> = Vec::new();
    for (k, v) in url::form_urlencoded::parse(raw.as_bytes()) {
        if !PARAMS.contains(&k.as_ref()) {
            // The name echoed back, bounded.
            let name: String = k.chars().take(64).collect();
            return Err(bad(
                &name,
                format!("unknown parameter; expected one of: {}", PARAMS.join(", ")),
            ));
        }
        if seen.iter().any(|s| *s == k) {
            return Err(bad(&k, "given more than once".into()));
        }
        seen.push(k.to_string());
        match k.as_ref() {
            "prefix" => {
                // Any start of a task name: the name rules, except that it may be empty.
                if !v.is_empty() {
                    validate_task_name(&v).map_err(|e| {
                        bad("prefix", format!("must be the start of a task name: {e}"))
                    })?;
                }
                q.filter.prefix = v.into_owned();
            }
            "mode" => {
                let mode = v
                    .parse::<Mode>()
                    .map_err(|e| bad("mode", format!("{e}, got {v:?}")))?;
                q.filter.mode = Some(mode);
            }
            "keyed" => {
                q.filter.keyed = Some(match v.as_ref() {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad("keyed", format!("must be true or false, got {v:?}"))),
                });
            }
            "limit" => {
                let limit = v
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=MAX_LIMIT).contains(l))
                    .and_then(NonZeroUsize::new)
                    .ok_or_else(|| {
                        bad(
                            "limit",
                            format!("must be a whole number from 1 to {MAX_LIMIT}, got {v:?}"),
                        )
                    })?;
                q.limit = Some(limit);
            }
            _ => {
                // Any `next` answered before, even the name of a spec written into etcd by
                // hand that no PUT would accept (the review's finding): bounded, not empty.
                if v.is_empty() || v.len() > MAX_AFTER_BYTES {
                    return Err(bad(
                        "after",
                        format!("must be the `next` answered before: 1 to {MAX_AFTER_BYTES} bytes"),
                    ));
                }
                q.filter.after = Some(v.into_owned());
            }
        }
    }
    Ok(q)
}

/// The page as `GET /api/v1/tasks` answers it.
pub fn page_json(page: &TaskPage) -> Value {
    let tasks: Vec<Value> = page
        .tasks
        .iter()
        .map(|t| t.spec.to_api_json(&t.name, t.version))
        .collect();
    let invalid: Vec<Value> = page
        .invalid
        .iter()
        .map(|t| json!({"name": t.name, "version": t.version, "error": t.error, "field": t.field}))
        .collect();
    json!({ "tasks": tasks, "invalid": invalid, "next": page.next })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(raw: &str) -> String {
        parse_list_query(raw).unwrap_err().field
    }

    #[test]
    fn every_parameter_is_checked() {
        for (raw, f) in [
            ("prefix=a%20b", "prefix"),
            ("prefix=a:b", "prefix"),
            (&format!("prefix={}", "p".repeat(65)), "prefix"),
            ("prefix=%FF", "prefix"),
            ("mode=", "mode"),
            ("mode=Pooled", "mode"),
            ("keyed=1", "keyed"),
            ("keyed=", "keyed"),
            ("keyed=TRUE", "keyed"),
            ("limit=", "limit"),
            ("limit=-1", "limit"),
            ("limit=2.5", "limit"),
            ("limit=x", "limit"),
            ("limit=99999999999999999999999", "limit"),
            (
                &format!("after={}", "a".repeat(MAX_AFTER_BYTES + 1)),
                "after",
            ),
            ("mode=local&mode=local", "mode"),
            ("limit=5&Limit=5", "Limit"),
            ("x", "x"),
        ] {
            assert_eq!(field(raw), f, "{raw}");
        }
    }

    #[test]
    fn the_accepted_values() {
        for m in Mode::ALL {
            let q = parse_list_query(&format!("mode={m}")).unwrap();
            assert_eq!(q.filter.mode.map(Mode::as_str), Some(*m));
        }
        let q = parse_list_query("prefix=&keyed=true&limit=1000").unwrap();
        assert_eq!(q.filter.prefix, "");
        assert_eq!(q.filter.keyed, Some(true));
        assert_eq!(q.limit.map(NonZeroUsize::get), Some(1000));
        let q =
            parse_list_query(&format!("prefix={}", "A-z_0.9".repeat(10).split_at(64).0)).unwrap();
        assert_eq!(q.filter.prefix.len(), 64);
        assert_eq!(
            parse_list_query("keyed=false").unwrap().filter.keyed,
            Some(false)
        );
    }

    #[test]
    fn errors_say_what_was_given() {
        let e = parse_list_query("mode=fast").unwrap_err();
        assert!(
            e.error.contains("pooled, local, exact_fixed"),
            "{}",
            e.error
        );
        assert!(e.error.contains("\"fast\""), "{}", e.error);
        let e = parse_list_query("page=2").unwrap_err();
        assert!(
            e.error.contains("prefix, mode, keyed, limit, after"),
            "{}",
            e.error
        );
    }
}
