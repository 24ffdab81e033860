//! `/api/v1/import/envoy-ratelimit`: envoyproxy/ratelimit YAML configs, imported as Sluice
//! tasks ([`crate::envoy_import`]; contract in `docs/api.md`).
//!
//! Errors keep the API's shape, `{"error", "field"}`, plus `line` (1-based, of the YAML) when
//! a line is at fault: 400 bad YAML or a config Sluice cannot express, 409 a task name that
//! belongs to someone else (or writes that kept racing), 404 unknown domain.

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use serde_json::{Value, json};
use tracing::info;

use super::AppState;
use super::api::{ApiError, ApiResult};
use super::extract::{ApiBody, ApiPath};
use crate::envoy_import::{self, ImportError, Refused};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// Path of the import endpoint (below `/api/v1`).
const IMPORT_PATH: &str = "/import/envoy-ratelimit";

/// The routes, merged into `/api/v1`.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_domains, import))
        .routes(routes!(delete_domain))
}

/// Whether a change request is a YAML import (it may then be sent as `application/yaml`,
/// `application/x-yaml`, `text/yaml` or `text/x-yaml`, not only JSON).
pub fn is_yaml_import(req: &Request) -> bool {
    let path = req.uri().path().trim_end_matches('/');
    path == format!("/api/v1{IMPORT_PATH}")
        && req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|t| {
                let t = t.trim().to_ascii_lowercase();
                matches!(
                    t.as_str(),
                    "application/yaml" | "application/x-yaml" | "text/yaml" | "text/x-yaml"
                )
            })
}

fn bad(status: StatusCode, e: ImportError) -> ApiError {
    let mut a = ApiError::new(status, e.error);
    a.set("field", Value::from(e.field));
    a.set("line", e.line.map_or(Value::Null, Value::from));
    a
}

/// Imports one envoyproxy/ratelimit domain config (YAML, or JSON), creating, updating and
/// deleting that domain's tasks.
#[utoipa::path(
    post,
    path = "/import/envoy-ratelimit",
    tag = "import",
    request_body(description = "An envoyproxy/ratelimit config (`domain`, `descriptors`)",
        content(
            (String = "application/yaml"),
            (String = "application/x-yaml"),
            (String = "text/yaml"),
            (String = "text/x-yaml"),
            (Object = "application/json"),
        )),
    responses(
        (status = 200, description = "Imported", body = super::openapi::Imported),
        (status = 400, description = "Bad YAML, or a config Sluice cannot express (`field`, and `line` when a line is at fault)", body = super::openapi::ErrorBody),
        (status = 404, description = "No such imported domain", body = super::openapi::ErrorBody),
        (status = 409, description = "A task of that name belongs to someone else (`task`), or the writes kept racing", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn import(State(s): State<AppState>, ApiBody(body): ApiBody) -> ApiResult<axum::Json<Value>> {
    let text = std::str::from_utf8(&body).map_err(|e| {
        bad(
            StatusCode::BAD_REQUEST,
            ImportError {
                error: format!("the config is not UTF-8: {e}"),
                field: String::new(),
                line: None,
            },
        )
    })?;
    let compiled = envoy_import::prepare(text).map_err(|e| bad(StatusCode::BAD_REQUEST, e))?;
    match envoy_import::apply(&s.etcd, &s.keys, &compiled, text).await? {
        Ok(a) => {
            info!(
                domain = compiled.domain,
                created = a.created.len(),
                updated = a.updated.len(),
                deleted = a.deleted.len(),
                "envoy-ratelimit domain imported"
            );
            Ok(axum::Json(json!({
                "domain": compiled.domain,
                "version": a.version,
                "created": a.created,
                "updated": a.updated,
                "unchanged": a.unchanged,
                "deleted": a.deleted,
                "tasks": compiled.tasks.iter().map(|t| t.to_json()).collect::<Vec<_>>(),
            })))
        }
        Err(r) => Err(refused(&compiled.domain, r)),
    }
}

fn refused(domain: &str, r: Refused) -> ApiError {
    match r {
        Refused::NotOurs { task, field, line } => {
            let mut a = bad(
                StatusCode::CONFLICT,
                ImportError {
                    error: format!(
                        "task {task:?} exists and was not made by an import of domain {domain:?}; it is left as it is: delete or rename it, or change this descriptor"
                    ),
                    field,
                    line: Some(line),
                },
            );
            a.set("task", Value::from(task));
            a
        }
        Refused::Busy => ApiError::new(
            StatusCode::CONFLICT,
            format!("domain {domain:?} or its tasks kept changing during the import; retry"),
        ),
        Refused::NoDomain => ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no imported domain {domain:?}"),
        ),
    }
}

/// The imported domains.
#[utoipa::path(
    get,
    path = "/import/envoy-ratelimit",
    tag = "import",
    responses(
        (status = 200, description = "The domains", body = super::openapi::Domains),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn list_domains(State(s): State<AppState>) -> ApiResult<axum::Json<Value>> {
    let (docs, _) = envoy_import::list(&s.etcd, &s.keys).await?;
    let domains: Vec<Value> = docs
        .iter()
        .map(|(d, version)| {
            json!({
                "domain": d.domain,
                "version": version,
                "imported_ms": d.imported_ms,
                "tasks": d.tasks,
            })
        })
        .collect();
    Ok(axum::Json(json!({ "domains": domains })))
}

/// Deletes an imported domain and its tasks.
#[utoipa::path(
    delete,
    path = "/import/envoy-ratelimit/{domain}",
    tag = "import",
    params(("domain" = String, Path, description = "Domain name (A-Z a-z 0-9 _ -)", pattern = "^[A-Za-z0-9_-]+$")),
    responses(
        (status = 200, description = "Deleted", body = super::openapi::DomainDeleted),
        (status = 400, description = "Not a domain name (field `domain`)", body = super::openapi::ErrorBody),
        (status = 404, description = "No such imported domain", body = super::openapi::ErrorBody),
        (status = 409, description = "The domain or its tasks kept changing; retry", body = super::openapi::ErrorBody),
        (status = 500, description = "An unexpected backend error", body = super::openapi::ErrorBody),
        (status = 503, description = "etcd cannot be reached", body = super::openapi::ErrorBody),
    )
)]
async fn delete_domain(
    State(s): State<AppState>,
    ApiPath(domain): ApiPath<String>,
) -> ApiResult<axum::Json<Value>> {
    if domain.is_empty()
        || domain.len() > envoy_import::MAX_DOMAIN_LEN
        || !domain
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
    {
        return Err(bad(
            StatusCode::BAD_REQUEST,
            ImportError {
                error: "not a domain name (A-Z a-z 0-9 _ -)".into(),
                field: "domain".into(),
                line: None,
            },
        ));
    }
    match envoy_import::remove(&s.etcd, &s.keys, &domain).await? {
        Ok(tasks) => {
            info!(
                domain,
                tasks = tasks.len(),
                "envoy-ratelimit domain deleted"
            );
            Ok(axum::Json(json!({ "domain": domain, "deleted": tasks })))
        }
        Err(r) => Err(refused(&domain, r)),
    }
}
