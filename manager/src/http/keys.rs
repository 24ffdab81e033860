//! `GET /api/v1/tasks/{name}/keys`: a keyed task's busiest keys (contract in `docs/api.md`).
//!
//! ```text
//!  GET /tasks/{name}/keys[?minutes=M][&limit=L]
//!
//!  NS:{T}:top:<minute>   ZSET key → permits admitted in that minute  ┐ written by the SDK's
//!  NS:{T}:topr:<minute>  ZSET key → permits rejected in that minute  ┘ hosts, once a second,
//!                                                                      each expiring after 10 min
//!  minutes M (1..=10, default 5): the sets of the minute now and the M−1 before it are summed
//!  limit L (1..=100, default 20): entries kept of each list, busiest first
//! ```
//!
//! Reads Redis only (the spec comes from etcd), one pipelined round trip bounded by a timeout.
//! Each minute's set is read up to [`PER_MINUTE`] members (busiest first), so the merge is
//! exact while a minute holds at most that many keys (hosts add at most their 10 busiest keys
//! a second). Members read back are validated like input: a member that is not a key (not
//! UTF-8, longer than 256 bytes) or a score that is not a finite count ≥ 0 is skipped and
//! counted in `malformed_entries`.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use serde_json::{Map, Value, json};
use sluice_protocol::{unix_ms, validate_key, validate_task_name};

use super::AppState;
use super::api::{ApiError, ApiResult, invalid_task_body};
use super::extract::ApiPath;
use crate::spec::FieldError;
use crate::tasks::Stored;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Minutes merged when `minutes` is not given.
pub const DEFAULT_MINUTES: u32 = 5;

/// Most minutes that can be asked for: the top-key sets expire after 10 minutes.
pub const MAX_MINUTES: u32 = 10;

/// Entries of each list when `limit` is not given.
pub const DEFAULT_LIMIT: usize = 20;

/// Most entries of each list.
pub const MAX_LIMIT: usize = 100;

/// Members read of each minute's set (busiest first).
pub const PER_MINUTE: isize = 1_000;

/// Bound on the Redis read.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The routes of this module (merged into [`super::api::routes`]).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(task_keys))
}

/// The validated query of a top-keys request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeysQuery {
    /// Minutes merged (the current one included).
    pub minutes: u32,
    /// Entries of each list.
    pub limit: usize,
}

/// Validates `minutes` and `limit` (pure; the errors name the parameter).
///
/// ```
/// use std::collections::HashMap;
/// use sluice_manager::http::keys::parse_keys_query;
/// let q = |pairs: &[(&str, &str)]| {
///     let m: HashMap<String, String> =
///         pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
///     parse_keys_query(&m)
/// };
/// assert_eq!(q(&[]).unwrap().minutes, 5);
/// assert_eq!(q(&[]).unwrap().limit, 20);
/// assert_eq!(q(&[("minutes", "10"), ("limit", "100")]).unwrap().limit, 100);
/// assert_eq!(q(&[("minutes", "11")]).unwrap_err().field, "minutes");
/// assert_eq!(q(&[("minutes", "0")]).unwrap_err().field, "minutes");
/// assert_eq!(q(&[("limit", "101")]).unwrap_err().field, "limit");
/// assert_eq!(q(&[("limit", "x")]).unwrap_err().field, "limit");
/// assert_eq!(q(&[("top", "3")]).unwrap_err().field, "top");
/// ```
pub fn parse_keys_query(q: &HashMap<String, String>) -> Result<KeysQuery, FieldError> {
    let bad = |field: &str, error: String| FieldError {
        error,
        field: field.to_string(),
    };
    if let Some(k) = q
        .keys()
        .find(|k| !matches!(k.as_str(), "minutes" | "limit"))
    {
        return Err(bad(
            k,
            "unknown parameter; expected one of: minutes, limit".into(),
        ));
    }
    let minutes = match q.get("minutes") {
        None => DEFAULT_MINUTES,
        Some(v) => v
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|m| (1..=MAX_MINUTES).contains(m))
            .ok_or_else(|| {
                bad(
                    "minutes",
                    format!("must be a whole number of minutes from 1 to {MAX_MINUTES}, got {v:?}"),
                )
            })?,
    };
    let limit = match q.get("limit") {
        None => DEFAULT_LIMIT,
        Some(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=MAX_LIMIT).contains(l))
            .ok_or_else(|| {
                bad(
                    "limit",
                    format!("must be a whole number from 1 to {MAX_LIMIT}, got {v:?}"),
                )
            })?,
    };
    Ok(KeysQuery { minutes, limit })
}

/// The starts (Unix ms) of the `minutes` minutes ending with the one holding `now_ms`, newest
/// first.
pub fn minute_starts(now_ms: i64, minutes: u32) -> Vec<i64> {
    let current = now_ms - now_ms.rem_euclid(60_000);
    (0..minutes as i64).map(|i| current - i * 60_000).collect()
}

/// Sums per-minute `(member, score)` lists into one list of the `limit` busiest keys, busiest
/// first (ties by key, so the order is stable). Returns the list and the number of entries
/// skipped as malformed.
pub fn merge_top(minutes: &[Vec<(Vec<u8>, f64)>], limit: usize) -> (Vec<(String, u64)>, u64) {
    let mut sum: HashMap<String, u64> = HashMap::new();
    let mut malformed = 0u64;
    for set in minutes {
        for (member, score) in set {
            let Ok(key) = std::str::from_utf8(member) else {
                malformed += 1;
                continue;
            };
            if validate_key(key).is_err() || !score.is_finite() || *score < 0.0 {
                malformed += 1;
                continue;
            }
            let n = score.round().min(u64::MAX as f64) as u64;
            let e = sum.entry(key.to_string()).or_default();
            *e = e.saturating_add(n);
        }
    }
    let mut out: Vec<(String, u64)> = sum.into_iter().filter(|(_, n)| *n > 0).collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out.truncate(limit);
    (out, malformed)
}

fn list(v: &[(String, u64)]) -> Value {
    Value::Array(
        v.iter()
            .map(|(k, n)| json!({ "key": k, "permits": n }))
            .collect(),
    )
}

/// A keyed task's busiest keys over the last `minutes` minutes (an unkeyed task answers empty
/// lists).
#[utoipa::path(
    get,
    path = "/tasks/{name}/keys",
    tag = "traffic",
    params(
        ("name" = String, Path, description = "Task name", pattern = "^[A-Za-z0-9_.-]{1,64}$"),
        ("minutes" = Option<u32>, Query, description = "Minutes merged, the current one included (default 5)", minimum = 1, maximum = 10),
        ("limit" = Option<u32>, Query, description = "Entries of each list (default 20)", minimum = 1, maximum = 100),
    ),
    responses(
        (status = 200, description = "The busiest keys", body = super::openapi::TopKeys),
        (status = 400, description = "Bad name or parameter (`field` names it; unknown parameters are refused)", body = super::openapi::ErrorBody),
        (status = 404, description = "No such task", body = super::openapi::ErrorBody),
        (status = 422, description = "The stored spec fails validation", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd or Redis cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn task_keys(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<axum::Json<Value>> {
    validate_task_name(&name).map_err(|e| {
        ApiError::field(
            StatusCode::BAD_REQUEST,
            FieldError {
                error: e.to_string(),
                field: "name".into(),
            },
        )
    })?;
    let q = parse_keys_query(&q).map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, e))?;
    let t = match s.store.get(&name).await? {
        Some(Stored::Valid(t)) => t,
        Some(Stored::Invalid(t)) => {
            let mut e = ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "");
            for (k, v) in invalid_task_body(&t).as_object().into_iter().flatten() {
                e.set(k, v.clone());
            }
            return Err(e);
        }
        None => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no task {name:?}"),
            ));
        }
    };
    let overrides: Map<String, Value> = t
        .spec
        .key_overrides
        .iter()
        .map(|(k, n)| (k.clone(), json!(n)))
        .collect();
    let mut out = json!({
        "task": name,
        "keyed": t.spec.keyed,
        "minutes": q.minutes,
        "window_ms": q.minutes as i64 * 60_000,
        "overrides": overrides,
        "top_admitted": [],
        "top_rejected": [],
    });
    if !t.spec.keyed {
        return Ok(axum::Json(out));
    }
    let starts = minute_starts(unix_ms(), q.minutes);
    let read = async {
        let mut c = s.redis.conn().await?;
        let mut pipe = redis::pipe();
        for &m in &starts {
            for k in [
                s.keys.top_keys(&name, m),
                s.keys.top_rejected_keys(&name, m),
            ] {
                pipe.cmd("ZRANGE")
                    .arg(k)
                    .arg(0)
                    .arg(PER_MINUTE - 1)
                    .arg("REV")
                    .arg("WITHSCORES");
            }
        }
        pipe.query_async::<Vec<Vec<(Vec<u8>, f64)>>>(&mut c).await
    };
    let sets = match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(Ok(sets)) => sets,
        Ok(Err(e)) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("redis unavailable: {e}"),
            ));
        }
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "redis unavailable: timed out",
            ));
        }
    };
    let (admitted, rejected): (Vec<_>, Vec<_>) =
        sets.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let admitted: Vec<_> = admitted.into_iter().map(|(_, s)| s).collect();
    let rejected: Vec<_> = rejected.into_iter().map(|(_, s)| s).collect();
    let (a, bad_a) = merge_top(&admitted, q.limit);
    let (r, bad_r) = merge_top(&rejected, q.limit);
    out["top_admitted"] = list(&a);
    out["top_rejected"] = list(&r);
    if bad_a + bad_r > 0 {
        out["malformed_entries"] = json!(bad_a + bad_r);
    }
    Ok(axum::Json(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_sums_minutes_sorts_and_limits() {
        let m1 = vec![(b"a".to_vec(), 5.0), (b"b".to_vec(), 7.0)];
        let m2 = vec![
            (b"a".to_vec(), 4.0),
            (b"c".to_vec(), 9.0),
            (b"d".to_vec(), 0.0),
        ];
        let (top, bad) = merge_top(&[m1.clone(), m2.clone()], 10);
        assert_eq!(bad, 0);
        assert_eq!(
            top,
            vec![("a".into(), 9), ("c".into(), 9), ("b".into(), 7)],
            "summed, busiest first, ties by key, zero scores left out"
        );
        let (top, _) = merge_top(&[m1, m2], 2);
        assert_eq!(top.len(), 2);
    }

    #[test]
    fn merge_skips_what_is_not_a_key_or_a_count() {
        let long = vec![b'x'; 257];
        let m = vec![
            (vec![0xff, 0xfe], 3.0),
            (long, 3.0),
            (b"neg".to_vec(), -1.0),
            (b"nan".to_vec(), f64::NAN),
            (b"inf".to_vec(), f64::INFINITY),
            ("ключ".as_bytes().to_vec(), 2.0),
        ];
        let (top, bad) = merge_top(&[m], 10);
        assert_eq!(bad, 5);
        assert_eq!(top, vec![("ключ".into(), 2)]);
    }

    #[test]
    fn minutes_end_with_the_current_one() {
        let now = 10 * 60_000 + 59_999;
        assert_eq!(minute_starts(now, 3), vec![600_000, 540_000, 480_000]);
    }
}
