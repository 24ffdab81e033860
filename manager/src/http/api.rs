//! `/api/v1`: the JSON API (contract in `docs/api.md`).
//!
//! Errors are `{"error": "...", "field": "..."}` (field only when one is at fault): 400 for bad
//! input (nothing is written), 404 unknown task, 409 stale `version`, 422 a stored document
//! (task spec, settings) that fails validation (written into etcd by hand), 503 when etcd or
//! Redis cannot be reached.

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use redis::AsyncCommands;
use serde_json::{Value, json};
use sluice_protocol::scripts;
use sluice_protocol::scripts::{Fence, RetireOutcome};
use sluice_protocol::{Mode, meta_field, slice, slice_field, unix_ms, validate_task_name};
use tracing::{info, warn};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::extract::{ApiBody, ApiPath};
use super::listing::{page_json, parse_list_query};
use super::openapi::{Cluster, ErrorBody, ListParams, TaskList, TaskSpecDoc};
use crate::election::ETCD_TIMEOUT;
use crate::election::cluster_view;
use crate::error::Error;
use crate::spec::{FieldError, parse_request};
use crate::tasks::{InvalidTask, PutOutcome, Stored, TaskEntry};

/// An API error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: Value,
}

impl ApiError {
    /// An error without a field.
    pub fn new(status: StatusCode, error: impl Into<String>) -> Self {
        Self {
            status,
            body: json!({ "error": error.into() }),
        }
    }

    /// An error naming the field at fault.
    pub fn field(status: StatusCode, e: FieldError) -> Self {
        Self {
            status,
            body: json!({ "error": e.error, "field": e.field }),
        }
    }
}

impl ApiError {
    /// Adds a field to the error body (e.g. `current_version` of a 409).
    pub fn set(&mut self, key: &str, value: Value) {
        self.body[key] = value;
    }
}

/// The body answered for a stored spec that fails validation (status 422).
pub fn invalid_task_body(t: &InvalidTask) -> Value {
    json!({
        "error": format!(
            "the stored spec of task {:?} (version {}) is invalid: {}; it is neither rolled nor retired: PUT a valid spec (with \"version\": {}) or DELETE it",
            t.name, t.version, t.error, t.version
        ),
        "field": t.field,
        "name": t.name,
        "version": t.version,
        "invalid": true,
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body)).into_response()
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        warn!(%e, "API backend error");
        match e {
            Error::Etcd { .. } | Error::Timeout { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("etcd unavailable: {e}"),
            ),
            Error::Redis { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("redis unavailable: {e}"),
            ),
            Error::Invalid {
                version, ref error, ..
            } => Self {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                body: json!({
                    "error": e.to_string(),
                    "field": error.field,
                    "version": version,
                    "invalid": true,
                }),
            },
            other => Self::new(StatusCode::INTERNAL_SERVER_ERROR, other.to_string()),
        }
    }
}

/// Result of a handler.
pub type ApiResult<T> = Result<T, ApiError>;

/// The API routes (every one documented: [`super::openapi`]).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(super::openapi::openapi_json))
        .routes(routes!(cluster))
        .routes(routes!(list_tasks))
        .routes(routes!(get_task, put_task, delete_task))
        .merge(super::envoy::routes())
        .merge(super::history::routes())
        .merge(super::keys::routes())
        .merge(super::ops::routes())
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such API endpoint") })
}

fn check_name(name: &str) -> ApiResult<()> {
    validate_task_name(name).map_err(|e| {
        ApiError::field(
            StatusCode::BAD_REQUEST,
            FieldError {
                error: e.to_string(),
                field: "name".into(),
            },
        )
    })
}

/// The leader, the registered members and this replica.
#[utoipa::path(
    get,
    path = "/cluster",
    tag = "cluster",
    responses(
        (status = 200, description = "The cluster", body = Cluster),
        (status = 500, description = "An unexpected backend error (stored data that cannot be decoded)", body = ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = ErrorBody),
    )
)]
async fn cluster(State(s): State<AppState>) -> ApiResult<axum::Json<Value>> {
    let view = cluster_view(&s.etcd, &s.keys).await?;
    Ok(axum::Json(json!({
        "leader": view.leader,
        "members": view.members,
        "self": { "node_id": s.cfg.node_id, "addr": s.cfg.advertise },
    })))
}

/// The tasks (valid specs, and the stored ones that fail validation), in name order: every one,
/// or those the query asks for, a page at a time ([`super::listing`]).
#[utoipa::path(
    get,
    path = "/tasks",
    tag = "tasks",
    params(ListParams),
    responses(
        (status = 200, description = "The tasks", body = TaskList),
        (status = 400, description = "A bad or unknown parameter (`field` names it)", body = ErrorBody),
        (status = 500, description = "An unexpected backend error (stored data that cannot be decoded)", body = ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = ErrorBody),
    )
)]
async fn list_tasks(
    State(s): State<AppState>,
    RawQuery(raw): RawQuery,
) -> ApiResult<axum::Json<Value>> {
    let q = parse_list_query(raw.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, e))?;
    let page = s.store.page(&q.filter, q.limit).await?;
    Ok(axum::Json(page_json(&page)))
}

/// Live status of a task, read from Redis. Fields are null when Redis cannot be read.
async fn status(s: &AppState, t: &TaskEntry) -> Value {
    if t.spec.mode == Mode::Concurrency {
        return concurrency_status(s, t).await;
    }
    let now = unix_ms();
    let current = slice::start(now, t.spec.slice_ms);
    let len = t.spec.slice_ms as i64;
    let read = async {
        let mut c = s.redis.conn().await?;
        let (cap, rem): (Option<i64>, Option<i64>) = redis::cmd("HMGET")
            .arg(s.keys.slice(&t.name, current))
            .arg(slice_field::CAP)
            .arg(slice_field::REM)
            .query_async(&mut c)
            .await?;
        let last = current - t.spec.slice_ms as i64;
        let last_slice: (Option<i64>, Option<i64>, Option<i64>) = redis::cmd("HMGET")
            .arg(s.keys.slice(&t.name, last))
            .arg(slice_field::ADMITTED)
            .arg(slice_field::REJECTED)
            .arg(slice_field::WOULD_REJECT)
            .query_async(&mut c)
            .await?;
        let m: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(s.keys.meta(&t.name))
            .arg(meta_field::ROLLED_TO)
            .arg(meta_field::LZ_CAP)
            .arg(meta_field::LZ_FROM)
            .arg(meta_field::LZ_UNTIL)
            .arg(meta_field::RETIRED)
            .query_async(&mut c)
            .await?;
        // Read back like input: a field that does not parse is absent, not an error.
        let num = |i: usize| m.get(i)?.as_deref()?.parse::<i64>().ok();
        let rolled = num(0);
        // A lazy task (`--lazy-after`): the meta vouches for the slices workers will make.
        let retired = m.get(4).is_some_and(|v| v.is_some());
        let lazy = match (num(1), num(2), num(3)) {
            (Some(c), Some(f), Some(u))
                if c >= 0 && !retired && f <= current && current + len <= u =>
            {
                Some((c, u))
            }
            _ => None,
        };
        Ok::<_, redis::RedisError>((cap, rem, last, last_slice, rolled, lazy))
    };
    let n = |v: Option<i64>| v.unwrap_or(0).max(0);
    match tokio::time::timeout(std::time::Duration::from_secs(1), read).await {
        Ok(Ok((cap, rem, last, (adm, rej, wrej), rolled, lazy))) => json!({
            // The current slice's, or (no slice made yet) the one a lazy task's meta vouches for.
            "effective_threshold": cap.or(lazy.map(|(c, _)| c)),
            "current_slice_ms": current,
            "remaining": if cap.is_some() { rem } else { lazy.map(|(c, _)| c) },
            "horizon_until_ms": rolled.max(lazy.map(|(_, u)| u)),
            "lazy": lazy.is_some(),
            // The slice before the current one, as its workers flushed it (about a second
            // after it ended they all have): `would_reject` is the part of `rejected` that
            // shadow mode admitted.
            "last_slice": {
                "start_ms": last,
                "admitted": n(adm),
                "rejected": n(rej),
                "would_reject": n(wrej),
            },
        }),
        other => json!({
            "effective_threshold": null,
            "current_slice_ms": current,
            "remaining": null,
            "horizon_until_ms": null,
            "error": match other {
                Ok(Err(e)) => format!("redis unavailable: {e}"),
                _ => "redis unavailable: timed out".to_string(),
            },
        }),
    }
}

/// Live status of a concurrency task: its lease hash (`crate::leases`) and the threshold the
/// leader wrote into the meta (what the LEASE script grants against).
async fn concurrency_status(s: &AppState, t: &TaskEntry) -> Value {
    let read = async {
        let mut c = s.redis.conn().await?;
        let view = crate::leases::read(&mut c, &s.keys, &t.name).await?;
        let cap: Option<i64> = c.hget(s.keys.meta(&t.name), meta_field::THRESHOLD).await?;
        Ok::<_, redis::RedisError>((view, cap))
    };
    match tokio::time::timeout(std::time::Duration::from_secs(1), read).await {
        Ok(Ok((view, cap))) => {
            let hosts: Vec<Value> = view
                .hosts
                .iter()
                .map(|h| {
                    json!({
                        "host": h.host,
                        "held": h.held,
                        "expires_in_ms": h.expires_in_ms,
                        "waiting": h.waiting,
                        "expired": h.expired,
                    })
                })
                .collect();
            json!({
                "mode": "concurrency",
                "effective_threshold": cap,
                "held": view.held(),
                "hosts_holding": view.hosts_holding(),
                "hosts_waiting": view.hosts_waiting(),
                "lease_ms": t.spec.lease_ms,
                "hosts": hosts,
                "malformed_entries": view.malformed,
                "now_ms": view.now_ms,
            })
        }
        other => json!({
            "mode": "concurrency",
            "effective_threshold": null,
            "held": null,
            "hosts": null,
            "lease_ms": t.spec.lease_ms,
            "error": match other {
                Ok(Err(e)) => format!("redis unavailable: {e}"),
                _ => "redis unavailable: timed out".to_string(),
            },
        }),
    }
}

/// A task's spec with its live `status` (read from Redis; its fields are null and `error`
/// says why when Redis cannot be read).
#[utoipa::path(
    get,
    path = "/tasks/{name}",
    tag = "tasks",
    params(("name" = String, Path, description = "Task name", pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    responses(
        (status = 200, description = "The task", body = TaskSpecDoc),
        (status = 400, description = "Not a task name (field `name`)", body = ErrorBody),
        (status = 404, description = "No such task", body = ErrorBody),
        (status = 422, description = "The stored spec fails validation (written into etcd by hand)", body = ErrorBody),
        (status = 500, description = "An unexpected backend error (stored data that cannot be decoded)", body = ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = ErrorBody),
    )
)]
async fn get_task(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<axum::Json<Value>> {
    check_name(&name)?;
    let t = match s.store.get(&name).await? {
        Some(Stored::Valid(t)) => t,
        Some(Stored::Invalid(t)) => {
            return Err(ApiError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                body: invalid_task_body(&t),
            });
        }
        None => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no task {name:?}"),
            ));
        }
    };
    let mut v = t.spec.to_api_json(&t.name, t.version);
    v["status"] = status(&s, &t).await;
    Ok(axum::Json(v))
}

/// Creates (201) or replaces (200) a task. The body is validated as a whole before anything is
/// written: a 400 names the field at fault (`schedules[1].cron`).
#[utoipa::path(
    put,
    path = "/tasks/{name}",
    tag = "tasks",
    params(("name" = String, Path, description = "Task name", pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    request_body(content = TaskSpecDoc, content_type = "application/json"),
    responses(
        (status = 200, description = "Replaced", body = TaskSpecDoc),
        (status = 201, description = "Created", body = TaskSpecDoc),
        (status = 400, description = "Bad name or body: `field` names the JSON path at fault", body = ErrorBody),
        (status = 409, description = "`version` is stale (the body has `current_version`)", body = ErrorBody),
        (status = 500, description = "An unexpected backend error", body = ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = ErrorBody),
    )
)]
async fn put_task(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    ApiBody(body): ApiBody,
) -> ApiResult<Response> {
    check_name(&name)?;
    let req =
        parse_request(&name, &body).map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, e))?;
    match s.store.put(&name, &req.spec, req.version).await? {
        PutOutcome::Created(version) => {
            info!(task = name, version, "task created");
            Ok((
                StatusCode::CREATED,
                axum::Json(req.spec.to_api_json(&name, version)),
            )
                .into_response())
        }
        PutOutcome::Replaced(version) => {
            info!(task = name, version, "task replaced");
            Ok((
                StatusCode::OK,
                axum::Json(req.spec.to_api_json(&name, version)),
            )
                .into_response())
        }
        PutOutcome::Conflict { current } => Err(ApiError {
            status: StatusCode::CONFLICT,
            body: json!({
                "error": if current == 0 {
                    format!("task {name:?} does not exist (version {} expected); reload and retry", req.version.unwrap_or(0))
                } else {
                    format!("task {name:?} was changed by someone else (now version {current}); reload and retry")
                },
                "field": "version",
                "current_version": current,
            }),
        }),
    }
}

/// Deletes a task (its meta hash is retired in Redis by the API or the leader).
#[utoipa::path(
    delete,
    path = "/tasks/{name}",
    tag = "tasks",
    params(("name" = String, Path, description = "Task name", pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, description = "Not a task name (field `name`)", body = ErrorBody),
        (status = 404, description = "No such task", body = ErrorBody),
        (status = 500, description = "An unexpected backend error", body = ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = ErrorBody),
    )
)]
async fn delete_task(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<StatusCode> {
    check_name(&name)?;
    let Some((revision, epoch)) = s.store.delete(&name).await? else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no task {name:?}"),
        ));
    };
    info!(task = name, "task deleted");
    // The leader retires the meta hash when it sees the delete; do it here too, in case there
    // is no leader right now. The API is no leader: it writes with the stored term when the
    // stored fence is of its own epoch (so the fence is kept), and with term 0 otherwise, so
    // a live fence of another epoch refuses it (a DELETE through this cluster must not take
    // down a task another cluster writes) and a stale one is taken over by any leader of ours.
    let retire = async {
        let mut c = s.redis.conn().await?;
        let (term, stored_epoch): (Option<i64>, Option<String>) = redis::cmd("HMGET")
            .arg(s.keys.meta(&name))
            .arg(meta_field::TERM)
            .arg(meta_field::EPOCH)
            .query_async(&mut c)
            .await?;
        let ours = stored_epoch.is_none_or(|e| e == epoch.to_string());
        let fence = Fence {
            term: if ours { term.unwrap_or(0) } else { 0 },
            epoch,
            stale_after_ms: s.cfg.fence_stale_after.as_millis() as u64,
        };
        let ttl = (s.cfg.horizon + s.cfg.retention).as_millis() as u64;
        scripts::retire(&mut c, &s.keys, &name, &fence, ttl, revision, false).await
    };
    match tokio::time::timeout(ETCD_TIMEOUT / 2, retire).await {
        Ok(Ok(RetireOutcome::Retired)) => {}
        Ok(Ok(other)) => info!(task = name, ?other, "meta not retired by the API"),
        Ok(Err(e)) => warn!(task = name, %e, "could not retire meta; the leader will"),
        Err(_) => warn!(task = name, "retiring meta timed out; the leader will"),
    }
    Ok(StatusCode::NO_CONTENT)
}
