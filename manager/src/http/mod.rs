//! The HTTP server: the JSON API (`/api/v1`), `/metrics`, `/healthz`, `/readyz` and the
//! embedded dashboard (everything else); over HTTPS with `--tls-cert` ([`tls`]).
//!
//! Every replica serves everything; writes go to etcd, so they work through any replica.

pub mod api;
pub mod envoy;
pub mod extract;
pub mod history;
pub mod keys;
pub mod listing;
pub mod openapi;
pub mod ops;
pub mod tls;
pub mod ui;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use etcd_client::Client;
use sluice_protocol::Keys;
use sluice_protocol::conn::Redis;
use tokio::sync::watch;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::Config;
use crate::election::Role;
use crate::metrics::Metrics;
use crate::tasks::TaskStore;

/// Everything a handler may need.
#[derive(Clone)]
pub struct AppState {
    /// Configuration.
    pub cfg: Arc<Config>,
    /// Key builder.
    pub keys: Keys,
    /// Task specs.
    pub store: TaskStore,
    /// etcd client.
    pub etcd: Client,
    /// Redis.
    pub redis: Arc<Redis>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// This replica's role.
    pub role: watch::Receiver<Role>,
}

/// Every documented route, with the OpenAPI document they make ([`openapi`]): the router
/// serves exactly these (plus the dashboard's fallback).
pub fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
        .nest("/api/v1", api::routes())
}

/// The whole router.
pub fn router(state: AppState) -> Router {
    let (router, _doc) = api_router().split_for_parts();
    router
        .fallback(ui::serve)
        .layer(middleware::from_fn_with_state(state.clone(), access))
        .with_state(state)
}

/// Liveness: the process answers.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "cluster",
    responses((status = 200, description = "Alive", body = openapi::Health))
)]
async fn healthz(State(s): State<AppState>) -> impl IntoResponse {
    let role = *s.role.borrow();
    axum::Json(serde_json::json!({
        "status": "ok",
        "node_id": s.cfg.node_id,
        "is_leader": matches!(role, Role::Leader { .. }),
    }))
}

/// Bound on each dependency check of `/readyz`.
const READY_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

fn check_json(r: Result<(), String>) -> serde_json::Value {
    match r {
        Ok(()) => serde_json::json!({ "ok": true }),
        Err(reason) => serde_json::json!({ "ok": false, "reason": reason }),
    }
}

/// Ready to serve: etcd answers, the task watch is in sync, Redis answers (200); 503 with the
/// reason of each failed check otherwise. Every check is bounded by 1 s and they run at once.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "cluster",
    responses(
        (status = 200, description = "Ready", body = openapi::Ready),
        (status = 503, description = "Not ready: each failed check says why", body = openapi::Ready),
    )
)]
async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    let etcd_check = async {
        let mut c = s.etcd.clone();
        let key = s.keys.etcd_tasks_prefix();
        let get = c.get(
            key.as_str(),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        );
        match tokio::time::timeout(READY_CHECK_TIMEOUT, get).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("etcd: {e}")),
            Err(_) => Err(format!("etcd: no answer within {READY_CHECK_TIMEOUT:?}")),
        }
    };
    let redis_check = async {
        let ping = async {
            let mut c = s.redis.conn().await?;
            redis::cmd("PING").query_async::<String>(&mut c).await
        };
        match tokio::time::timeout(READY_CHECK_TIMEOUT, ping).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => {
                // A dead cached connection is dropped so the next check connects afresh.
                s.redis.reset().await;
                Err(format!("redis: {e}"))
            }
            Err(_) => {
                s.redis.reset().await;
                Err(format!("redis: no answer within {READY_CHECK_TIMEOUT:?}"))
            }
        }
    };
    let (etcd, redis) = tokio::join!(etcd_check, redis_check);
    let snapshot_loaded = s.store.snapshot().loaded;
    let watch = if s.store.watch_synced() {
        Ok(())
    } else if !snapshot_loaded {
        Err("tasks not loaded from etcd yet".to_string())
    } else {
        Err("task watch is not running (reconnecting to etcd)".to_string())
    };
    let ready = etcd.is_ok() && redis.is_ok() && watch.is_ok();
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        code,
        axum::Json(serde_json::json!({
            "ready": ready,
            "node_id": s.cfg.node_id,
            "etcd": check_json(etcd),
            "task_watch": check_json(watch),
            "redis": check_json(redis),
        })),
    )
}

/// OpenMetrics for clients that ask for it (Prometheus does), the classic text format
/// otherwise (`curl`, `promtool check metrics`).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "cluster",
    responses((status = 200, description = "Prometheus metrics (docs/metrics.md): OpenMetrics when the Accept header asks for application/openmetrics-text, the classic text format otherwise",
        content(
            (String = "text/plain"),
            (String = "application/openmetrics-text"),
        )))
)]
async fn metrics(State(s): State<AppState>, req: Request) -> impl IntoResponse {
    let openmetrics = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    if openmetrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            s.metrics.render(),
        )
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            s.metrics.render_classic(),
        )
    }
}

/// Access rules of every request (contract in `docs/security.md`, "API access"):
///
/// ```text
///  mutation (not GET/HEAD/OPTIONS):
///    Sec-Fetch-Site: cross-site, or an Origin whose host:port is not the Host → 403
///    --api-token set and no admin token                                        → 401
///      (the read-only token                                                    → 403)
///    PUT/POST/PATCH whose content-type is not application/json                → 415
///  GET /api/v1/settings with --api-token set and neither token                 → 401
///  GET /api/v1/tasks/{name}/keys with --api-token set and neither token       → 401
///  every other read: open
/// ```
async fn access(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let read = matches!(method, Method::GET | Method::HEAD | Method::OPTIONS);
    if !read && let Some(why) = cross_origin(&req) {
        return refuse(StatusCode::FORBIDDEN, &why);
    }
    if let Some(admin) = s.cfg.api_token.as_ref() {
        let given = bearer(&req);
        let is_admin = given.is_some_and(|g| admin.matches(g));
        let is_reader = is_admin
            || given.is_some_and(|g| s.cfg.api_read_token.as_ref().is_some_and(|r| r.matches(g)));
        if !read && !is_admin {
            if is_reader {
                return refuse(
                    StatusCode::FORBIDDEN,
                    "this token is read-only (--api-read-token); changes need the admin token (--api-token)",
                );
            }
            return unauthorized(
                "this call needs Authorization: Bearer <token> (the manager runs with --api-token)",
            );
        }
        if read
            && !is_reader
            && let Some(why) = needs_token_to_read(req.uri().path())
        {
            return unauthorized(why);
        }
    }
    if matches!(method, Method::PUT | Method::POST | Method::PATCH)
        && !is_json(&req)
        && !envoy::is_yaml_import(&req)
    {
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "changes must be sent with content-type: application/json",
        );
    }
    next.run(req).await
}

/// Reads that can expose secrets: the settings (webhook URLs are shown redacted, but the
/// settings are still the operators' business) and a task's busiest keys (client keys, in
/// clear when the task opts in with `clear_keys`).
/// The refusal, for a read that needs a token.
fn needs_token_to_read(path: &str) -> Option<&'static str> {
    let p = path.trim_end_matches('/');
    if p == "/api/v1/settings" {
        return Some(
            "reading the settings needs Authorization: Bearer <token> (the manager runs with --api-token)",
        );
    }
    p.strip_prefix("/api/v1/tasks/")
        .and_then(|rest| rest.strip_suffix("/keys"))
        .filter(|name| !name.is_empty() && !name.contains('/'))
        .map(|_| {
            "reading a task's keys needs Authorization: Bearer <token> (the manager runs with --api-token)"
        })
}

fn bearer(req: &Request) -> Option<&str> {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

fn is_json(req: &Request) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// Why a mutation looks like a browser request from another site, if it does: the browser says
/// so (`Sec-Fetch-Site: cross-site`), or its `Origin` is not the server it talks to (`Host`).
/// Requests without `Origin` (curl, scripts, the SDK) pass.
fn cross_origin(req: &Request) -> Option<String> {
    let h = req.headers();
    let site = h.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if site.is_some_and(|v| v.eq_ignore_ascii_case("cross-site")) {
        return Some(
            "cross-site requests cannot change anything (Sec-Fetch-Site: cross-site)".into(),
        );
    }
    let origin = h.get(header::ORIGIN)?;
    let refused = || {
        Some(
            "cross-origin requests cannot change anything: the Origin header does not match the Host (behind a proxy, keep the Host header)"
                .to_string(),
        )
    };
    let Some(origin) = origin
        .to_str()
        .ok()
        .and_then(|o| reqwest::Url::parse(o).ok())
    else {
        return refused(); // "null" (sandboxed pages, file://) or garbage
    };
    let host = h
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let Some(host) =
        host.and_then(|hh| reqwest::Url::parse(&format!("{}://{hh}/", origin.scheme())).ok())
    else {
        return refused();
    };
    let same = origin.host_str().map(str::to_ascii_lowercase)
        == host.host_str().map(str::to_ascii_lowercase)
        && origin.port_or_known_default() == host.port_or_known_default();
    if same { None } else { refused() }
}

fn refuse(status: StatusCode, error: &str) -> Response {
    (status, axum::Json(serde_json::json!({ "error": error }))).into_response()
}

fn unauthorized(error: &str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        axum::Json(serde_json::json!({ "error": error })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)]) -> Request {
        let mut b = Request::builder()
            .method(Method::PUT)
            .uri("/api/v1/tasks/t");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(axum::body::Body::empty()).unwrap()
    }

    #[test]
    fn origins() {
        for ok in [
            vec![],
            vec![
                ("host", "127.0.0.1:8080"),
                ("origin", "http://127.0.0.1:8080"),
            ],
            vec![
                ("host", "Sluice.Example.com"),
                ("origin", "https://sluice.example.com"),
            ],
            vec![
                ("host", "sluice.example.com:443"),
                ("origin", "https://sluice.example.com"),
            ],
            vec![("host", "[::1]:8080"), ("origin", "http://[::1]:8080")],
            vec![("host", "a:1"), ("sec-fetch-site", "same-origin")],
        ] {
            assert_eq!(cross_origin(&req(&ok)), None, "{ok:?}");
        }
        for bad in [
            vec![
                ("host", "127.0.0.1:8080"),
                ("origin", "http://evil.example"),
            ],
            vec![
                ("host", "127.0.0.1:8080"),
                ("origin", "http://127.0.0.1:8081"),
            ],
            vec![
                ("host", "sluice.example.com"),
                ("origin", "http://sluice.example.com:8443"),
            ],
            vec![("host", "127.0.0.1:8080"), ("origin", "null")],
            vec![("origin", "http://127.0.0.1:8080")],
            vec![("sec-fetch-site", "cross-site")],
        ] {
            assert!(cross_origin(&req(&bad)).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn content_types() {
        assert!(is_json(&req(&[("content-type", "application/json")])));
        assert!(is_json(&req(&[(
            "content-type",
            "Application/JSON; charset=utf-8"
        )])));
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/jsonx",
        ] {
            assert!(!is_json(&req(&[("content-type", bad)])), "{bad}");
        }
        assert!(!is_json(&req(&[])));
    }
}
