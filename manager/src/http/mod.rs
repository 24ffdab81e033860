//! The HTTP server: the JSON API (`/api/v1`), `/metrics`, `/healthz`, `/readyz` and the
//! embedded dashboard (everything else); over HTTPS with `--tls-cert` ([`tls`]).
//!
//! Every replica serves everything; writes go to etcd, so they work through any replica.

pub mod api;
pub mod history;
pub mod ops;
pub mod tls;
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
        .route("/readyz", get(readyz))
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
