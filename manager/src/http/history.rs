//! Traffic endpoints of `/api/v1` (contract in `docs/api.md`): a task's history, the hosts that
//! report to `NS:hosts`, and a one-call traffic summary of every task for the dashboard's task
//! list.
//!
//! ```text
//!  GET /tasks/{name}/history?seconds=N[&resolution=1s|1m]  ring records + live slices
//!  GET /hosts[?task=T]                                      NS:hosts, parsed
//!  GET /traffic[?prefix&mode&keyed&limit&after]            every task (or a page of them, as
//!                                                           GET /tasks): threshold now, rates,
//!                                                           host states
//! ```
//!
//! All three read Redis only (the task list comes from etcd); every Redis round trip is
//! bounded, and a Redis that cannot be reached is a 503.

use std::collections::{BTreeMap, HashMap};

use axum::extract::{Query, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use sluice_protocol::conn::RedisConn;
use sluice_protocol::{HostReport, meta_field, slice, unix_ms, validate_task_name};

use super::AppState;
use super::api::{ApiError, invalid_task_body};
use super::extract::ApiPath;
use super::listing::parse_list_query;
use crate::error::{Error, Result as CrateResult, redis as redis_err};
use crate::history::{self, MINUTES, Record, SECONDS, Series, SliceSample};
use crate::tasks::Stored;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Longest history that can be asked for: the one-minute ring's span (7 days).
pub const MAX_SECONDS: u64 = 7 * 86_400;

/// History returned when `seconds` is not given.
pub const DEFAULT_SECONDS: u64 = 300;

/// A host whose last report is older than this is shown as stale and not counted in
/// `/traffic`.
pub const STALE_HOST_MS: i64 = 60_000;

/// Window of the rates in `/traffic`.
pub const TRAFFIC_WINDOW_MS: i64 = 5_000;

/// Slices that ended less than this ago are left out of the rates: workers flush their counters
/// about once a second, so the newest slice is still filling.
pub const FLUSH_LAG_MS: i64 = 2_000;

/// Bound on a single Redis read of these endpoints.
const HOSTS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The routes of this module (merged into [`super::api::routes`]).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(task_history))
        .routes(routes!(hosts))
        .routes(routes!(traffic))
}

/// A failed request: a backend error (mapped like every API error), or a status with a body.
#[derive(Debug)]
enum Failure {
    Backend(ApiError),
    Reply(StatusCode, Value),
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        match self {
            Self::Backend(e) => e.into_response(),
            Self::Reply(status, body) => (status, axum::Json(body)).into_response(),
        }
    }
}

type Reply = Result<axum::Json<Value>, Failure>;

fn bad(field: &str, error: impl Into<String>) -> Failure {
    Failure::Reply(
        StatusCode::BAD_REQUEST,
        json!({ "error": error.into(), "field": field }),
    )
}

fn backend(e: Error) -> Failure {
    Failure::Backend(ApiError::from(e))
}

fn check_params(q: &HashMap<String, String>, allowed: &[&str]) -> Result<(), Failure> {
    match q.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(bad(
            k,
            format!("unknown parameter; expected one of: {}", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}

fn check_task_name(field: &str, name: &str) -> Result<(), Failure> {
    validate_task_name(name).map_err(|e| bad(field, e.to_string()))
}

/// The validated query of a history request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryQuery {
    /// How far back, in seconds.
    pub seconds: u64,
    /// Which ring.
    pub series: Series,
}

/// Validates `seconds` and `resolution` (pure; the errors name the parameter).
///
/// ```
/// use std::collections::HashMap;
/// use sluice_manager::http::history::parse_history_query;
/// let q = |pairs: &[(&str, &str)]| {
///     let m: HashMap<String, String> =
///         pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
///     parse_history_query(&m)
/// };
/// assert_eq!(q(&[]).unwrap().seconds, 300);
/// assert_eq!(q(&[("seconds", "3600")]).unwrap().series.name, "1s");
/// assert_eq!(q(&[("seconds", "86400")]).unwrap().series.name, "1m");
/// assert_eq!(q(&[("seconds", "0")]).unwrap_err().0, "seconds");
/// assert_eq!(q(&[("seconds", "86400"), ("resolution", "1s")]).unwrap_err().0, "resolution");
/// ```
pub fn parse_history_query(
    q: &HashMap<String, String>,
) -> Result<HistoryQuery, (&'static str, String)> {
    let seconds = match q.get("seconds") {
        None => DEFAULT_SECONDS,
        Some(raw) => match raw.trim().parse::<u64>() {
            Ok(n) if (1..=MAX_SECONDS).contains(&n) => n,
            _ => {
                return Err((
                    "seconds",
                    format!("must be a whole number from 1 to {MAX_SECONDS}, got {raw:?}"),
                ));
            }
        },
    };
    let series = match q.get("resolution") {
        None if seconds as i64 * 1000 <= SECONDS.span_ms() => SECONDS,
        None => MINUTES,
        Some(raw) => Series::by_name(raw.trim())
            .ok_or(("resolution", format!("must be 1s or 1m, got {raw:?}")))?,
    };
    if seconds as i64 * 1000 > series.span_ms() {
        return Err((
            "resolution",
            format!(
                "{} history is kept for {} s; ask for at most that, or resolution=1m",
                series.name,
                series.span_ms() / 1000
            ),
        ));
    }
    Ok(HistoryQuery { seconds, series })
}

/// One record as the API shows it. `slice_ms` (the mean length of its slices), `span_ms` (the
/// time its slices cover) and the per-second rates are the record's own: a record written
/// before a `slice_ms` change keeps the rate it ran at.
fn record_json(r: &Record) -> Value {
    json!({
        "start_ms": r.start_ms,
        "threshold": r.threshold(),
        "admitted": r.admitted,
        "rejected": r.rejected,
        "would_reject": r.would_reject,
        "slice_count": r.slices,
        "slice_ms": r.slice_ms(),
        "span_ms": (r.span_ms > 0).then_some(r.span_ms),
        "admitted_per_s": r.per_s(r.admitted),
        "rejected_per_s": r.per_s(r.rejected),
        "would_reject_per_s": r.per_s(r.would_reject),
        "threshold_per_s": r.per_s(r.cap_sum),
    })
}

/// A task's history: the harvested ring records plus, at resolution 1s, what the live slices
/// hold that the harvest has not written yet.
#[utoipa::path(
    get,
    path = "/tasks/{name}/history",
    tag = "traffic",
    params(
        ("name" = String, Path, description = "Task name", pattern = "^[A-Za-z0-9_.-]{1,64}$"),
        ("seconds" = Option<u64>, Query, description = "How far back (default 300)", minimum = 1, maximum = 604_800),
        ("resolution" = Option<String>, Query, description = "`1s` (kept for the 1 s ring's span) or `1m`; chosen by `seconds` unless given", pattern = "^(1s|1m)$"),
    ),
    responses(
        (status = 200, description = "The history", body = super::openapi::History),
        (status = 400, description = "Bad name or parameter (`field` names it; unknown parameters are refused)", body = super::openapi::ErrorBody),
        (status = 404, description = "No such task", body = super::openapi::ErrorBody),
        (status = 422, description = "The stored spec fails validation", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd or Redis cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn task_history(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Reply {
    check_task_name("name", &name)?;
    check_params(&q, &["seconds", "resolution"])?;
    let hq = parse_history_query(&q).map_err(|(f, e)| bad(f, e))?;
    let task = match s.store.get(&name).await.map_err(backend)? {
        Some(Stored::Valid(t)) => t,
        Some(Stored::Invalid(t)) => {
            return Err(Failure::Reply(
                StatusCode::UNPROCESSABLE_ENTITY,
                invalid_task_body(&t),
            ));
        }
        None => {
            return Err(Failure::Reply(
                StatusCode::NOT_FOUND,
                json!({ "error": format!("no task {name:?}") }),
            ));
        }
    };
    let slice_ms = task.spec.slice_ms;
    let mut conn = s
        .redis
        .conn()
        .await
        .map_err(|e| backend(redis_err("connect")(e)))?;
    let now = unix_ms();
    let from = now - hq.seconds as i64 * 1000;
    let mut records: BTreeMap<i64, Record> =
        history::read_series(&mut conn, &s.keys, &name, hq.series, from, now)
            .await
            .map_err(backend)?
            .into_iter()
            .map(|r| (r.start_ms, r))
            .collect();
    let mut live_from = Value::Null;
    if hq.series == SECONDS {
        // What the harvest has not written yet, read from the slices themselves.
        let lf = history::live_from(now, slice_ms, s.cfg.retention);
        let live = history::read_live(&mut conn, &s.keys, &name, slice_ms, lf, now)
            .await
            .map_err(backend)?;
        records.extend(history::aggregate(&live, SECONDS));
        live_from = json!(lf.max(SECONDS.bucket(from)));
    }
    let first = hq.series.bucket(from);
    let slices: Vec<Value> = records
        .range(first..)
        .map(|(_, r)| record_json(r))
        .collect();
    Ok(axum::Json(json!({
        "task": name,
        "resolution_ms": hq.series.res_ms,
        "slice_ms": slice_ms,
        "now_ms": now,
        "from_ms": first,
        "live_from_ms": live_from,
        "slices": slices,
    })))
}

/// One entry of `NS:hosts`, as the API shows it.
fn host_json(host_id: &str, raw: &str, now_ms: i64) -> Value {
    match serde_json::from_str::<HostReport>(raw) {
        Ok(h) => {
            // `seen_ms` is the host's clock; minus its offset it is Redis time.
            let age = (now_ms as f64 - (h.seen_ms as f64 - h.offset_ms)).max(0.0);
            json!({
                "host_id": host_id,
                "offset_ms": h.offset_ms,
                "rtt_ms": h.rtt_ms,
                "seen_ms": h.seen_ms,
                "sdk": h.sdk,
                "proto": h.proto,
                "tasks": h.tasks,
                "permits": h.permits,
                "age_ms": age.round() as i64,
                "stale": age as i64 > STALE_HOST_MS,
            })
        }
        Err(e) => json!({
            "host_id": host_id,
            "error": format!("unreadable report: {e}"),
        }),
    }
}

async fn read_hosts(s: &AppState) -> CrateResult<Vec<(String, String)>> {
    let mut conn = s.redis.conn().await.map_err(redis_err("connect"))?;
    let mut cmd = redis::cmd("HGETALL");
    cmd.arg(s.keys.hosts());
    let map: HashMap<String, String> =
        match tokio::time::timeout(HOSTS_TIMEOUT, cmd.query_async(&mut conn)).await {
            Ok(r) => r.map_err(redis_err("read hosts"))?,
            Err(_) => {
                return Err(Error::Timeout {
                    op: "read hosts",
                    after: HOSTS_TIMEOUT,
                });
            }
        };
    let mut v: Vec<(String, String)> = map.into_iter().collect();
    v.sort();
    Ok(v)
}

/// The hosts that report to `NS:hosts`, parsed (optionally only those that run `task`).
#[utoipa::path(
    get,
    path = "/hosts",
    tag = "traffic",
    params(("task" = Option<String>, Query, description = "Only hosts running this task", pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    responses(
        (status = 200, description = "The hosts", body = super::openapi::Hosts),
        (status = 400, description = "Bad parameter (`field` names it; unknown parameters are refused)", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "Redis cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn hosts(State(s): State<AppState>, Query(q): Query<HashMap<String, String>>) -> Reply {
    check_params(&q, &["task"])?;
    let task = q.get("task").map(String::as_str);
    if let Some(t) = task {
        check_task_name("task", t)?;
    }
    let raw = read_hosts(&s).await.map_err(backend)?;
    let now = unix_ms();
    let hosts: Vec<Value> = raw
        .iter()
        .map(|(id, json)| host_json(id, json, now))
        .filter(|h| task.is_none_or(|t| h["tasks"].get(t).is_some()))
        .collect();
    Ok(axum::Json(json!({ "now_ms": now, "hosts": hosts })))
}

/// Rates over the slices that ended at least [`FLUSH_LAG_MS`] ago; when none has (long slices),
/// over the elapsed part of the newest ones. Returns (admitted/s, rejected/s, window ms).
///
/// ```
/// use sluice_manager::history::SliceSample;
/// use sluice_manager::http::history::rates;
/// let s = |start_ms, admitted| SliceSample { start_ms, cap: 100, admitted, rejected: 0,
///                                           would_reject: 0, slice_ms: 1_000 };
/// // Two settled 1 s slices (50 and 70 admitted); the one that just ended and the current
/// // one are still being flushed: 60/s.
/// let v = [s(1_000, 50), s(2_000, 70), s(3_000, 20), s(4_000, 5)];
/// assert_eq!(rates(&v, 1_000, 5_000).0, 60.0);
/// // One 60 s slice, 30 s elapsed, 300 admitted: 10/s.
/// assert_eq!(rates(&[s(0, 300)], 60_000, 30_000).0, 10.0);
/// ```
pub fn rates(samples: &[SliceSample], slice_ms: u64, now_ms: i64) -> (f64, f64, i64) {
    let ended: Vec<&SliceSample> = samples
        .iter()
        .filter(|x| slice::end(x.start_ms, slice_ms) <= now_ms - FLUSH_LAG_MS)
        .collect();
    let (used, span): (Vec<&SliceSample>, i64) = if ended.is_empty() {
        let current: Vec<&SliceSample> = samples.iter().collect();
        let span = current
            .iter()
            .map(|x| (now_ms - x.start_ms).clamp(0, slice_ms as i64))
            .sum();
        (current, span)
    } else {
        let n = ended.len() as i64;
        (ended, n * slice_ms as i64)
    };
    if span <= 0 {
        return (0.0, 0.0, 0);
    }
    let adm: u64 = used.iter().map(|x| x.admitted).sum();
    let rej: u64 = used.iter().map(|x| x.rejected).sum();
    let per_s = |n: u64| (n as f64 * 1000.0 / span as f64 * 100.0).round() / 100.0;
    (per_s(adm), per_s(rej), span)
}

/// Shadow mode: the would-reject rate over the same slices as [`rates`] (its `rejected` rate
/// of the `wrej` counters), so `would_reject_per_s ≤ rejected_per_s`.
fn would_reject_rate(samples: &[SliceSample], slice_ms: u64, now_ms: i64) -> f64 {
    let as_rejected: Vec<SliceSample> = samples
        .iter()
        .map(|x| SliceSample {
            rejected: x.would_reject,
            ..*x
        })
        .collect();
    rates(&as_rejected, slice_ms, now_ms).1
}

async fn task_traffic(
    mut conn: RedisConn,
    s: &AppState,
    name: &str,
    slice_ms: u64,
    now: i64,
) -> CrateResult<Value> {
    let from = slice::start(now - TRAFFIC_WINDOW_MS - FLUSH_LAG_MS, slice_ms);
    let mut c2 = conn.clone();
    let mut rolled = redis::cmd("HMGET");
    rolled
        .arg(s.keys.meta(name))
        .arg(meta_field::ROLLED_TO)
        .arg(meta_field::LZ_UNTIL)
        .arg(meta_field::LZ_CAP)
        .arg(meta_field::LZ_FROM);
    type Reach = Vec<Option<String>>;
    let (samples, rolled_to) = tokio::join!(
        history::read_live(&mut conn, &s.keys, name, slice_ms, from, now),
        tokio::time::timeout(HOSTS_TIMEOUT, rolled.query_async::<Reach>(&mut c2)),
    );
    let samples = samples?;
    // A lazy task (`--lazy-after`) is decidable to its lazy window's end, at its `lz_cap`.
    let (horizon_until_ms, lazy_cap) = match rolled_to {
        Ok(r) => {
            let m = r.map_err(redis_err("read rolled_to"))?;
            // Read back like input: a field that does not parse is absent.
            let num = |i: usize| m.get(i)?.as_deref()?.parse::<i64>().ok();
            let (rolled, lz_until, lz_cap, lz_from) = (num(0), num(1), num(2), num(3));
            let lazy_now = lz_from.is_some_and(|f| f <= now) && lz_until > Some(now);
            let cap = lz_cap.filter(|c| *c >= 0 && lazy_now);
            (rolled.max(lz_until), cap.map(|c| c as u64))
        }
        Err(_) => {
            return Err(Error::Timeout {
                op: "read rolled_to",
                after: HOSTS_TIMEOUT,
            });
        }
    };
    let current = slice::start(now, slice_ms);
    let threshold = samples
        .iter()
        .find(|x| x.start_ms == current)
        .map(|x| x.cap)
        .or(lazy_cap);
    let (adm, rej, window) = rates(&samples, slice_ms, now);
    let would_reject_per_s = would_reject_rate(&samples, slice_ms, now);
    Ok(json!({
        "threshold": threshold,
        "admitted_per_s": adm,
        "rejected_per_s": rej,
        "would_reject_per_s": would_reject_per_s,
        "window_ms": window,
        "horizon_until_ms": horizon_until_ms,
    }))
}

/// A concurrency task in `/traffic`: no slices (rates 0), `in_flight` = permits held
/// cluster-wide now (its lease hash), `threshold` = what the leader wrote into the meta.
async fn concurrency_traffic(mut conn: RedisConn, s: &AppState, name: &str) -> CrateResult<Value> {
    let read = async {
        let view = crate::leases::read(&mut conn, &s.keys, name).await?;
        let cap: Option<i64> = redis::cmd("HGET")
            .arg(s.keys.meta(name))
            .arg(meta_field::THRESHOLD)
            .query_async(&mut conn)
            .await?;
        Ok::<_, redis::RedisError>((view, cap))
    };
    let (view, cap) = match tokio::time::timeout(HOSTS_TIMEOUT, read).await {
        Ok(r) => r.map_err(redis_err("read the lease hash"))?,
        Err(_) => {
            return Err(Error::Timeout {
                op: "read the lease hash",
                after: HOSTS_TIMEOUT,
            });
        }
    };
    Ok(json!({
        "threshold": cap,
        "admitted_per_s": 0.0,
        "rejected_per_s": 0.0,
        "would_reject_per_s": 0.0,
        "window_ms": 0,
        "in_flight": view.held(),
        "hosts_waiting": view.hosts_waiting(),
    }))
}

/// The threshold now, admitted/rejected rates and host states of every task, or of the page of
/// tasks the query asks for (the same query as `GET /tasks`: the dashboard's list asks for the
/// traffic of the page it shows).
#[utoipa::path(
    get,
    path = "/traffic",
    tag = "traffic",
    params(super::openapi::ListParams),
    responses(
        (status = 200, description = "The summary", body = super::openapi::Traffic),
        (status = 400, description = "A bad or unknown parameter (`field` names it)", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd or Redis cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn traffic(State(s): State<AppState>, RawQuery(raw): RawQuery) -> Reply {
    let q = parse_list_query(raw.as_deref().unwrap_or("")).map_err(|e| bad(&e.field, e.error))?;
    let page = s.store.page(&q.filter, q.limit).await.map_err(backend)?;
    let (tasks, next) = (page.tasks, page.next);
    let conn = s
        .redis
        .conn()
        .await
        .map_err(|e| backend(redis_err("connect")(e)))?;
    let now = unix_ms();
    let raw_hosts = read_hosts(&s).await.map_err(backend)?;
    let mut states: HashMap<String, BTreeMap<String, u64>> = HashMap::new();
    for (id, raw) in &raw_hosts {
        let h = host_json(id, raw, now);
        if h["stale"] != Value::Bool(false) {
            continue;
        }
        if let Some(ts) = h["tasks"].as_object() {
            for (task, state) in ts {
                let st = state.as_str().unwrap_or("unknown").to_string();
                *states
                    .entry(task.clone())
                    .or_default()
                    .entry(st)
                    .or_default() += 1;
            }
        }
    }
    let s_ref = &s;
    let results: Vec<(String, CrateResult<Value>)> = futures::stream::iter(tasks)
        .map(|t| {
            let c = conn.clone();
            async move {
                let r = if t.spec.mode == sluice_protocol::Mode::Concurrency {
                    concurrency_traffic(c, s_ref, &t.name).await
                } else {
                    task_traffic(c, s_ref, &t.name, t.spec.slice_ms, now).await
                };
                (t.name, r)
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let mut out = serde_json::Map::new();
    for (name, r) in results {
        let mut v = r.map_err(backend)?;
        v["hosts"] = json!(states.remove(&name).unwrap_or_default());
        out.insert(name, v);
    }
    Ok(axum::Json(
        json!({ "now_ms": now, "tasks": out, "next": next }),
    ))
}
