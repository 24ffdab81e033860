//! The HTTP API: `POST /v1/decide` (one decision or a batch), `GET /metrics`, `/healthz`,
//! `/readyz`.
//!
//! ```text
//! POST /v1/decide {"task": "T", "key": "k", "hits": 1}
//!   → 200 {"allowed": true, "decision": "allowed", "retry_after_ms": 0}
//! POST /v1/decide {"requests": [{"task": "T"}, {"task": "U", "key": "k"}]}
//!   → 200 {"results": [{...}, {...}]}            (each decided on its own)
//! ```
//!
//! `decision` is one of `allowed`, `limited`, `fallback_allowed`, `fallback_denied`; a shadow
//! task's would-be rejection answers `allowed` with `"shadow_limited": true`. Bad input is a
//! 400 naming the field (`requests[2].hits`), an unknown task a 404 naming it; in a batch
//! every request is checked before any is decided, so a refused batch consumed nothing.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use sluice::Decision;

use crate::AppState;
use crate::decide::{DecideError, Part};

/// Most requests in one batch.
pub const MAX_BATCH: usize = 1_000;
/// Most permits one request may ask for.
pub const MAX_HITS: u64 = u32::MAX as u64;
/// Largest accepted body.
const MAX_BODY: usize = 1 << 20;

/// The router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/decide", post(decide))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

fn bad(status: StatusCode, field: String, message: String) -> Response {
    (
        status,
        axum::Json(json!({"error": message, "field": field})),
    )
        .into_response()
}

struct Req {
    task: String,
    key: Option<String>,
    hits: u64,
}

fn parse_one(v: &Value, at: &str) -> Result<Req, (String, String)> {
    let field = |f: &str| {
        if at.is_empty() {
            f.to_string()
        } else {
            format!("{at}.{f}")
        }
    };
    let o = v
        .as_object()
        .ok_or_else(|| (at.to_string(), "must be an object".to_string()))?;
    for k in o.keys() {
        if !matches!(k.as_str(), "task" | "key" | "hits") {
            return Err((field(k), "unknown field (expected task, key, hits)".into()));
        }
    }
    let task = match o.get("task") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err((field("task"), "must be a string".into())),
        None => return Err((field("task"), "is required".into())),
    };
    let key = match o.get("key") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err((field("key"), "must be a string".into())),
    };
    let hits = match o.get("hits") {
        None => 1,
        Some(h) => match h.as_u64() {
            Some(n) if (1..=MAX_HITS).contains(&n) => n,
            _ => {
                return Err((
                    field("hits"),
                    format!("must be an integer in 1 ..= {MAX_HITS}"),
                ));
            }
        },
    };
    Ok(Req { task, key, hits })
}

fn answer(d: &Decision) -> Value {
    let (name, shadow) = match d {
        Decision::Allowed => ("allowed", false),
        Decision::ShadowLimited { .. } => ("allowed", true),
        Decision::Limited { .. } | Decision::WouldBlock => ("limited", false),
        Decision::FallbackAllowed => ("fallback_allowed", false),
        Decision::FallbackDenied { .. } => ("fallback_denied", false),
        _ => ("limited", false),
    };
    let retry = d
        .retry_after()
        .map(|r| r.as_micros().div_ceil(1_000) as u64)
        .unwrap_or(0);
    let mut v = json!({"allowed": d.is_allowed(), "decision": name, "retry_after_ms": retry});
    if shadow {
        v["shadow_limited"] = Value::Bool(true);
    }
    v
}

fn refused(e: DecideError, at: &str, s: &AppState) -> Response {
    let field = |f: &str| {
        if at.is_empty() {
            f.to_string()
        } else {
            format!("{at}.{f}")
        }
    };
    match e {
        DecideError::Invalid { field: f, message } => {
            s.metrics.error("http", "invalid");
            bad(StatusCode::BAD_REQUEST, field(f), message)
        }
        e @ DecideError::UnknownTask(_) => {
            s.metrics.error("http", "unknown_task");
            bad(StatusCode::NOT_FOUND, field("task"), e.to_string())
        }
        e @ DecideError::Concurrency(_) => {
            s.metrics.error("http", "concurrency");
            bad(StatusCode::BAD_REQUEST, field("task"), e.to_string())
        }
        DecideError::Sdk(m) => {
            s.metrics.error("http", "sdk");
            bad(StatusCode::SERVICE_UNAVAILABLE, field("task"), m)
        }
    }
}

async fn decide(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let t0 = Instant::now();
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            s.metrics.error("http", "invalid");
            return bad(
                StatusCode::BAD_REQUEST,
                String::new(),
                format!("body is not JSON: {e}"),
            );
        }
    };
    let batch = v.get("requests").is_some();
    let reqs: Vec<(String, Req)> = if batch {
        if let Some(k) = v
            .as_object()
            .and_then(|o| o.keys().find(|k| k.as_str() != "requests"))
        {
            s.metrics.error("http", "invalid");
            return bad(
                StatusCode::BAD_REQUEST,
                k.clone(),
                "unknown field (a batch has only requests)".into(),
            );
        }
        let Some(list) = v["requests"].as_array() else {
            s.metrics.error("http", "invalid");
            return bad(
                StatusCode::BAD_REQUEST,
                "requests".into(),
                "must be an array".into(),
            );
        };
        if list.is_empty() || list.len() > MAX_BATCH {
            s.metrics.error("http", "invalid");
            return bad(
                StatusCode::BAD_REQUEST,
                "requests".into(),
                format!("must hold 1 ..= {MAX_BATCH} requests"),
            );
        }
        let mut out = Vec::with_capacity(list.len());
        for (i, r) in list.iter().enumerate() {
            let at = format!("requests[{i}]");
            match parse_one(r, &at) {
                Ok(q) => out.push((at, q)),
                Err((f, m)) => {
                    s.metrics.error("http", "invalid");
                    return bad(StatusCode::BAD_REQUEST, f, m);
                }
            }
        }
        out
    } else {
        match parse_one(&v, "") {
            Ok(q) => vec![(String::new(), q)],
            Err((f, m)) => {
                s.metrics.error("http", "invalid");
                return bad(StatusCode::BAD_REQUEST, f, m);
            }
        }
    };
    // Every request resolved before any is decided: a refused batch consumes nothing.
    let mut parts: Vec<Part> = Vec::with_capacity(reqs.len());
    for (at, r) in &reqs {
        match s.decider.part(&r.task, r.key.as_deref(), r.hits).await {
            Ok(p) => parts.push(p),
            Err(e) => return refused(e, at, &s),
        }
    }
    let mut results = Vec::with_capacity(parts.len());
    for p in &parts {
        let d = s.decider.decide(p).await;
        s.metrics.decision("http", crate::decide::decision_name(&d));
        results.push(answer(&d));
    }
    s.metrics.request("http", t0.elapsed());
    if batch {
        axum::Json(json!({ "results": results })).into_response()
    } else {
        axum::Json(results.pop().unwrap_or(Value::Null)).into_response()
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn healthz(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    axum::Json(json!({
        "status": "ok",
        "host_id": s.cfg.host_id,
        "namespace": s.cfg.namespace,
        "segment": s.decider.client().segment_path().display().to_string(),
    }))
}

/// Ready when the Envoy domain configurations were read from Redis recently (the agent can
/// resolve descriptors and Redis answers).
async fn readyz(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    let age = s.routes_age();
    let limit = (s.cfg.routes_refresh * 3).max(std::time::Duration::from_secs(3));
    let ok = age.is_some_and(|a| a <= limit);
    let reason = match age {
        None => "the Envoy domain configurations were never read from Redis".to_string(),
        Some(a) if a > limit => format!(
            "redis: the Envoy domain configurations were last read {} ms ago",
            a.as_millis()
        ),
        Some(_) => String::new(),
    };
    let body = json!({
        "ready": ok,
        "redis": if ok { json!({"ok": true}) } else { json!({"ok": false, "reason": reason}) },
        "domains": s.routes.load().versions().len(),
    });
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body))
}
