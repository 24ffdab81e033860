//! The HTTP server: the JSON API (`/api/v1`), `/metrics`, `/healthz` and the embedded
//! dashboard (everything else).
//!
//! Every replica serves everything; writes go to etcd, so they work through any replica.

pub mod api;
pub mod history;
pub mod ops;
pub mod ui;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use etcd_client::Client;
use sluice::protocol::Keys;
use sluice::protocol::conn::Redis;
use tokio::sync::watch;

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

/// The whole router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .nest("/api/v1", api::routes())
        .fallback(ui::serve)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

async fn healthz(State(s): State<AppState>) -> impl IntoResponse {
    let role = *s.role.borrow();
    axum::Json(serde_json::json!({
        "status": "ok",
        "node_id": s.cfg.node_id,
        "is_leader": matches!(role, Role::Leader { .. }),
    }))
}

/// OpenMetrics for clients that ask for it (Prometheus does), the classic text format
/// otherwise (`curl`, `promtool check metrics`).
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

/// With `--api-token`, mutating calls need `Authorization: Bearer <token>`.
async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let Some(token) = s.cfg.api_token.as_deref() else {
        return next.run(req).await;
    };
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
        return next.run(req).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        axum::Json(serde_json::json!({
            "error": "this call needs Authorization: Bearer <token> (the manager runs with --api-token)"
        })),
    )
        .into_response()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
