//! Operations endpoints: alerts, global settings, and dynamic limiting's inputs and outputs.
//!
//! * `GET /api/v1/alerts?limit=N` → `{"alerts": [...]}`, newest first (default 100, at most 1,000).
//! * `GET /api/v1/settings` → the settings with their `version`.
//! * `PUT /api/v1/settings` → validated (400 with the field), optional `version` (409 if stale).
//! * `POST /api/v1/tasks/{name}/health` → 204; `{"error_rate", "latency_ms", "source"}`.
//! * `GET /api/v1/tasks/{name}/adjustments?limit=N` → `{"adjustments": [...]}`, newest first.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use serde_json::{Value, json};

use super::AppState;
use super::api::{ApiError, ApiResult};
use super::extract::{ApiBody, ApiPath};
use crate::alerts;
use crate::dynamic::{self, HealthReport};
use crate::settings::{self, Settings};
use crate::spec::FieldError;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The routes of this module.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_alerts))
        .routes(routes!(get_settings, put_settings))
        .routes(routes!(post_health))
        .routes(routes!(list_adjustments))
}

fn bad(field: &str, error: impl Into<String>) -> ApiError {
    ApiError::field(
        StatusCode::BAD_REQUEST,
        FieldError {
            error: error.into(),
            field: field.to_string(),
        },
    )
}

fn limit_param(q: &HashMap<String, String>) -> ApiResult<usize> {
    match q.get("limit").map(|v| v.parse::<usize>()) {
        None => Ok(100),
        Some(Ok(n)) if (1..=1000).contains(&n) => Ok(n),
        Some(_) => Err(bad("limit", "must be a whole number from 1 to 1000")),
    }
}

/// Recent alerts, newest first.
#[utoipa::path(
    get,
    path = "/alerts",
    tag = "ops",
    params(("limit" = Option<u32>, Query, description = "At most this many (default 100)", minimum = 1, maximum = 1000)),
    responses(
        (status = 200, description = "The alerts", body = super::openapi::Alerts),
        (status = 400, description = "Bad `limit`", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "Redis cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn list_alerts(
    State(s): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<axum::Json<Value>> {
    let limit = limit_param(&q)?;
    let a = alerts::recent(&s.redis, &s.keys, limit).await?;
    Ok(axum::Json(alerts::to_json(&a)))
}

/// The settings as answered: webhook URLs always redacted (the URL is the secret).
fn settings_json(st: &Settings, version: i64) -> Value {
    let mut v = serde_json::to_value(st.redacted()).unwrap_or(Value::Null);
    v["version"] = Value::from(version);
    v
}

/// The global settings (webhook URLs redacted) with their `version`.
#[utoipa::path(
    get,
    path = "/settings",
    tag = "ops",
    responses(
        (status = 200, description = "The settings", body = super::openapi::SettingsDoc),
        (status = 422, description = "The stored settings fail validation", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn get_settings(State(s): State<AppState>) -> ApiResult<axum::Json<Value>> {
    let (st, version) = settings::load(&s.etcd, &s.keys).await?;
    Ok(axum::Json(settings_json(&st, version)))
}

/// Validates (400 naming the field), keeps the stored URL of each redacted webhook sent back,
/// checks every destination (private ones only with `--webhook-allow-private`), then writes.
#[utoipa::path(
    put,
    path = "/settings",
    tag = "ops",
    request_body(content = super::openapi::SettingsDoc, content_type = "application/json"),
    responses(
        (status = 200, description = "Written; the settings as stored (webhooks redacted)", body = super::openapi::SettingsDoc),
        (status = 400, description = "Bad body, or a webhook destination refused (`field` names it)", body = super::openapi::ErrorBody),
        (status = 409, description = "`version` is stale (the body has `current_version`)", body = super::openapi::ErrorBody),
        (status = 422, description = "The stored settings fail validation", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn put_settings(
    State(s): State<AppState>,
    ApiBody(body): ApiBody,
) -> ApiResult<axum::Json<Value>> {
    let bad_request = |e| ApiError::field(StatusCode::BAD_REQUEST, e);
    let mut req = settings::parse_request(&body).map_err(bad_request)?;
    if req.settings.has_redacted() {
        let (stored, version) = settings::load(&s.etcd, &s.keys).await?;
        settings::keep_redacted(&mut req.settings.webhooks, &stored.webhooks)
            .map_err(bad_request)?;
        // Written only over what the redacted entries were resolved against.
        req.version.get_or_insert(version);
    }
    settings::check_destinations(&req.settings, s.cfg.webhook_allow_private)
        .await
        .map_err(bad_request)?;
    match settings::store(&s.etcd, &s.keys, &req.settings, req.version).await? {
        Ok(version) => {
            tracing::info!(
                version,
                webhooks = req.settings.webhooks.len(),
                "settings changed"
            );
            Ok(axum::Json(settings_json(&req.settings, version)))
        }
        Err(current) => {
            let mut e = ApiError::field(
                StatusCode::CONFLICT,
                FieldError {
                    error: format!(
                        "settings were changed by someone else (now version {current}); reload and retry"
                    ),
                    field: "version".into(),
                },
            );
            e.set("current_version", Value::from(current));
            Err(e)
        }
    }
}

async fn task_exists(s: &AppState, name: &str) -> ApiResult<()> {
    sluice_protocol::validate_task_name(name).map_err(|e| bad("name", e.to_string()))?;
    // A task whose stored spec is invalid exists too (its reports and adjustments are kept).
    match s.store.get(name).await? {
        Some(_) => Ok(()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no task {name:?}"),
        )),
    }
}

/// The body of a health report (the document's schema is [`super::openapi::HealthReportDoc`]).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HealthBody {
    #[serde(default)]
    error_rate: Option<f64>,
    #[serde(default)]
    latency_ms: Option<f64>,
    #[serde(default)]
    source: Option<String>,
}

/// Most `latency_ms` of a report (an hour).
const MAX_LATENCY_MS: f64 = 3_600_000.0;

/// Parses `{"error_rate": 0..1, "latency_ms": ≥ 0, "source": "..."}`; at least one measure
/// (`null` counts as absent). The structure and types by serde, the ranges here.
fn parse_health(body: &[u8]) -> ApiResult<(String, HealthReport)> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad("", format!("malformed JSON: {e}")))?;
    if !v.is_object() {
        return Err(bad("", "must be a JSON object"));
    }
    let b: HealthBody = crate::spec::from_json(&v, |field| match field {
        "error_rate" => Some("must be a number from 0 to 1".into()),
        "latency_ms" => Some(format!("must be a number from 0 to {MAX_LATENCY_MS}")),
        "source" => Some("must be a string".into()),
        _ => None,
    })
    .map_err(|e| ApiError::field(StatusCode::BAD_REQUEST, e))?;
    let range = |k: &str, x: Option<f64>, max: f64| match x {
        Some(f) if !(0.0..=max).contains(&f) => {
            Err(bad(k, format!("must be a number from 0 to {max}, got {f}")))
        }
        _ => Ok(x),
    };
    let error_rate = range("error_rate", b.error_rate, 1.0)?;
    let latency_ms = range("latency_ms", b.latency_ms, MAX_LATENCY_MS)?;
    if error_rate.is_none() && latency_ms.is_none() {
        return Err(bad("error_rate", "give error_rate and/or latency_ms"));
    }
    let source = match b.source {
        None => "default".to_string(),
        Some(s) if s.is_empty() || s.len() > 64 => {
            return Err(bad("source", "must be 1 to 64 characters"));
        }
        Some(s) => s,
    };
    Ok((
        source,
        HealthReport {
            error_rate,
            latency_ms,
            at_ms: sluice_protocol::unix_ms(),
        },
    ))
}

/// A health report for dynamic limiting (error rate and/or latency, by source).
#[utoipa::path(
    post,
    path = "/tasks/{name}/health",
    tag = "ops",
    params(("name" = String, Path, description = "Task name", pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    request_body(content = super::openapi::HealthReportDoc, content_type = "application/json"),
    responses(
        (status = 204, description = "Recorded"),
        (status = 400, description = "Bad name or body (`field` names it)", body = super::openapi::ErrorBody),
        (status = 404, description = "No such task", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd or Redis cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn post_health(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    ApiBody(body): ApiBody,
) -> ApiResult<StatusCode> {
    task_exists(&s, &name).await?;
    let (source, report) = parse_health(&body)?;
    dynamic::record_report(&s.redis, &s.keys, &name, &source, &report).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The dynamic controller's recent threshold changes of a task, newest first.
#[utoipa::path(
    get,
    path = "/tasks/{name}/adjustments",
    tag = "ops",
    params(
        ("name" = String, Path, description = "Task name", pattern = "^[A-Za-z0-9_.-]{1,64}$"),
        ("limit" = Option<u32>, Query, description = "At most this many (default 100)", minimum = 1, maximum = 1000),
    ),
    responses(
        (status = 200, description = "The adjustments", body = super::openapi::Adjustments),
        (status = 400, description = "Bad name or `limit`", body = super::openapi::ErrorBody),
        (status = 404, description = "No such task", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd or Redis cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn list_adjustments(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<axum::Json<Value>> {
    let limit = limit_param(&q)?;
    task_exists(&s, &name).await?;
    let a = dynamic::adjustments(&s.redis, &s.keys, &name, limit).await?;
    Ok(axum::Json(json!({ "adjustments": a })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    fn field_of(body: &str) -> (String, String) {
        let e = parse_health(body.as_bytes()).unwrap_err().into_response();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{body}");
        let v: Value = futures::executor::block_on(async {
            let b = axum::body::to_bytes(e.into_body(), 1 << 16).await.unwrap();
            serde_json::from_slice(&b).unwrap()
        });
        (
            v["field"].as_str().unwrap().to_string(),
            v["error"].as_str().unwrap().to_string(),
        )
    }

    #[test]
    fn health_reports_are_checked_field_by_field() {
        for (body, field, words) in [
            ("nope", "", "malformed JSON"),
            ("[1]", "", "must be a JSON object"),
            (
                r#"{"error_rate": 1.5}"#,
                "error_rate",
                "from 0 to 1, got 1.5",
            ),
            (
                r#"{"error_rate": "x"}"#,
                "error_rate",
                "must be a number from 0 to 1 (invalid type: string",
            ),
            (r#"{"latency_ms": -1}"#, "latency_ms", "from 0 to 3600000"),
            (r#"{}"#, "error_rate", "give error_rate and/or latency_ms"),
            (
                r#"{"error_rate": null, "latency_ms": null}"#,
                "error_rate",
                "give",
            ),
            (r#"{"error_rate": 0.1, "source": ""}"#, "source", "1 to 64"),
            (
                r#"{"error_rate": 0.1, "source": 3}"#,
                "source",
                "must be a string",
            ),
            (
                r#"{"error_rate": 0.1, "extra": 1}"#,
                "extra",
                "unknown field `extra`, expected one of `error_rate`, `latency_ms`, `source`",
            ),
        ] {
            let (f, m) = field_of(body);
            assert_eq!(f, field, "{body}: {m}");
            assert!(m.contains(words), "{body}: {m}");
        }
        let (source, r) = parse_health(br#"{"latency_ms": 12.5, "source": null}"#).unwrap();
        assert_eq!(
            (source.as_str(), r.error_rate, r.latency_ms),
            ("default", None, Some(12.5))
        );
    }
}
