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
//!
//! Before the handler, a middleware (`guard`) refuses a decision request without the token
//! (401, with `--api-token`), from a browser (403: it carries `Origin`), or beyond
//! `--max-concurrent-requests` (503). A whole request — every lookup and every decision of a
//! batch — ends within `--request-timeout`: decisions still to make when it passes are made
//! from what the host holds, without waiting.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sluice::Decision;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::{OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;
use crate::decide::{DecideError, Part};

/// Most requests in one batch by default (`--max-batch`).
pub const MAX_BATCH: usize = 1_000;
/// Most permits one request may ask for: the largest threshold a task may have, so the
/// largest cost a slice can ever admit (a larger one is refused, never counted).
pub const MAX_HITS: u64 = sluice_protocol::MAX_COUNT;
/// The path of decisions (the one the guard applies to).
pub const DECIDE_PATH: &str = "/v1/decide";

/// The OpenAPI document's skeleton; the paths come from the handlers ([`api_router`]).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Sluice agent HTTP API",
        description = "The agent's decision API (docs/agent.md) and its health and metrics \
endpoints. `POST /v1/decide` needs `Authorization: Bearer <token>` when the agent runs with \
`--api-token` (401 otherwise; without a token the agent listens on loopback only unless \
`--insecure-listen`); requests from browsers (with an `Origin` header) are refused (403). \
`/metrics`, `/healthz`, `/readyz` and this document are open. Errors are `{\"error\": \"...\", \"field\": \"...\"}`, `field` naming the JSON path at fault \
(`requests[2].hits`); in a batch every request is checked before any is decided, so a refused \
batch consumed nothing.",
        license(name = "Apache-2.0")
    ),
    components(schemas(ErrorBody)),
    tags((name = "agent", description = "Decisions, health, metrics"))
)]
struct ApiDoc;

/// Every route, documented: the router and the OpenAPI document are built from the same list.
pub fn api_router() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(decide))
        .routes(routes!(metrics))
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(openapi_json))
}

/// The router.
pub fn router(state: Arc<AppState>) -> axum::Router {
    let (router, _) = api_router().split_for_parts();
    router
        .layer(axum::extract::DefaultBodyLimit::max(
            state.cfg.max_request_bytes as usize,
        ))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Before a decision's handler (and its body is read): the token, no browser, a permit of
/// `--max-concurrent-requests` (held until the answer is made). Other paths pass.
async fn guard(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if req.uri().path() != DECIDE_PATH {
        return next.run(req).await;
    }
    if !crate::guard::authorized(
        s.cfg.api_token.as_ref(),
        req.headers().get(header::AUTHORIZATION),
    ) {
        s.metrics.error("http", "unauthenticated");
        let mut r = bad(
            StatusCode::UNAUTHORIZED,
            String::new(),
            "this call needs Authorization: Bearer <token> (the agent runs with --api-token): \
             missing or wrong"
                .into(),
        );
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    // A browser sends `Origin` with every POST; the agent serves no page, so such a request
    // comes from some page the user visits, spending quota through a loopback agent.
    if req.headers().contains_key(header::ORIGIN) {
        s.metrics.error("http", "cross_origin");
        return bad(
            StatusCode::FORBIDDEN,
            String::new(),
            "requests from browsers (with an Origin header) cannot decide: the agent serves \
             programs, not pages"
                .into(),
        );
    }
    let Some(permit) = crate::guard::admit(&s.inflight) else {
        s.metrics.error("http", "busy");
        let mut r = bad(
            StatusCode::SERVICE_UNAVAILABLE,
            String::new(),
            format!(
                "the agent is handling --max-concurrent-requests ({}) decision requests; retry",
                s.cfg.max_concurrent_requests
            ),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return r;
    };
    let r = next.run(req).await;
    drop(permit);
    r
}

/// The served OpenAPI document (built once).
pub fn document() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut doc = api_router().into_openapi();
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme(
                "bearer",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        // Decisions: the token when the agent has one; the rest is open. Say so, rather than
        // leave clients to guess.
        for (path, item) in doc.paths.paths.iter_mut() {
            for op in [&mut item.get, &mut item.post].into_iter().flatten() {
                op.security = Some(if path == DECIDE_PATH {
                    vec![
                        SecurityRequirement::new("bearer", Vec::<String>::new()),
                        SecurityRequirement::default(),
                    ]
                } else {
                    vec![SecurityRequirement::default()]
                });
            }
        }
        doc.to_pretty_json()
            .expect("the OpenAPI document serializes")
    })
}

/// `GET /api/v1/openapi.json`: this document.
#[utoipa::path(
    get,
    path = "/api/v1/openapi.json",
    tag = "agent",
    responses((status = 200, description = "This document (OpenAPI 3.1)", content_type = "application/json", body = Object))
)]
async fn openapi_json() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], document())
}

/// An error answer.
#[derive(ToSchema)]
#[allow(dead_code)] // Describes JSON built with `json!`.
struct ErrorBody {
    /// What is wrong.
    error: String,
    /// JSON path of the field at fault (`requests[2].hits`, `task`), `""` for the whole body.
    field: String,
}

fn bad(status: StatusCode, field: String, message: String) -> Response {
    (
        status,
        axum::Json(json!({"error": message, "field": field})),
    )
        .into_response()
}

/// One decision request.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DecideRequest {
    /// The task.
    task: String,
    /// The key, for keyed tasks (at most 256 bytes); null or absent for the others.
    #[serde(default)]
    #[schema(nullable = true, required = false, max_length = 256)]
    key: Option<String>,
    /// Permits asked for (1 ..= 1000000000000, the largest threshold a task may have), 1
    /// unless given.
    #[serde(default = "one")]
    #[schema(required = false, minimum = 1, maximum = 1_000_000_000_000_u64)]
    hits: u64,
}

fn one() -> u64 {
    1
}

/// A batch: each request decided on its own, in order.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DecideBatch {
    /// 1 ..= 1000 requests (`--max-batch`).
    #[schema(min_items = 1, max_items = 1000)]
    requests: Vec<DecideRequest>,
}

/// The body of `POST /v1/decide`: one request, or a batch.
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // The document's schema only: the handler tells them apart by `requests`.
enum DecideBody {
    One(DecideRequest),
    Batch(DecideBatch),
}

/// One decision.
#[derive(serde::Serialize, ToSchema)]
#[allow(dead_code)] // Describes JSON built with `json!`.
struct DecideAnswer {
    allowed: bool,
    /// `allowed`, `limited`, `fallback_allowed` or `fallback_denied`.
    decision: String,
    /// When a retry may succeed (0 when allowed).
    retry_after_ms: u64,
    /// A shadow task's would-be rejection (answered `allowed`).
    #[schema(required = false)]
    shadow_limited: bool,
}

/// The answer to a batch: one decision per request, in order.
#[derive(serde::Serialize, ToSchema)]
#[allow(dead_code)] // Describes JSON built with `json!`.
struct DecideResults {
    results: Vec<DecideAnswer>,
}

/// The answer of `POST /v1/decide`.
#[derive(serde::Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // The document's schema only.
enum DecideReply {
    One(DecideAnswer),
    Batch(DecideResults),
}

/// Deserializes `v` into `T`, or says which field is wrong (its JSON path, as
/// `requests[1].hits`) and how. serde reports a missing field at the object that lacks it: the
/// field's own name is added to the path then.
fn from_json<T: DeserializeOwned>(v: &Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        let mut path = e.path().to_string();
        if path == "." {
            path.clear();
        }
        let message = e.inner().to_string();
        if let Some(name) = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
        {
            path = if path.is_empty() {
                name.to_string()
            } else {
                format!("{path}.{name}")
            };
        }
        (path, message)
    })
}

struct Req {
    task: String,
    key: Option<String>,
    hits: u64,
}

fn checked(r: DecideRequest, at: &str) -> Result<Req, (String, String)> {
    if !(1..=MAX_HITS).contains(&r.hits) {
        let field = if at.is_empty() {
            "hits".to_string()
        } else {
            format!("{at}.hits")
        };
        return Err((field, format!("must be an integer in 1 ..= {MAX_HITS}")));
    }
    Ok(Req {
        task: r.task,
        key: r.key,
        hits: r.hits,
    })
}

/// The requests of a body, each with its JSON path (`""`, `requests[3]`), and whether it was a
/// batch.
type Parsed = (bool, Vec<(String, Req)>);

/// Parses a body: one request, or `{"requests": [...]}` (told apart by `requests`) of at most
/// `max_batch` requests.
fn parse_body(v: &Value, max_batch: usize) -> Result<Parsed, (String, String)> {
    // serde would also take a struct from an array (`["t", null, 1]`): requests are objects.
    let must_be_object = |at: String| (at, "must be an object".to_string());
    if !v.is_object() {
        return Err(must_be_object(String::new()));
    }
    if let Some(list) = v.get("requests").and_then(Value::as_array) {
        // Counted before anything is built from it.
        if list.is_empty() || list.len() > max_batch {
            return Err((
                "requests".into(),
                format!("must hold 1 ..= {max_batch} requests (--max-batch)"),
            ));
        }
        if let Some(i) = list.iter().position(|r| !r.is_object()) {
            return Err(must_be_object(format!("requests[{i}]")));
        }
    }
    if v.get("requests").is_none() {
        let r: DecideRequest = from_json(v)?;
        return Ok((false, vec![(String::new(), checked(r, "")?)]));
    }
    let b: DecideBatch = from_json(v)?;
    let mut out = Vec::with_capacity(b.requests.len());
    for (i, r) in b.requests.into_iter().enumerate() {
        let at = format!("requests[{i}]");
        let q = checked(r, &at)?;
        out.push((at, q));
    }
    Ok((true, out))
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
    // Not decided without a wait the request had no time left for: retry shortly.
    let retry = d
        .retry_after()
        .or((*d == Decision::WouldBlock).then_some(crate::decide::CUT_RETRY))
        .map(|r| r.as_micros().div_ceil(1_000) as u64)
        .unwrap_or(0);
    let mut v = json!({"allowed": d.is_allowed(), "decision": name, "retry_after_ms": retry});
    if shadow {
        v["shadow_limited"] = Value::Bool(true);
    }
    v
}

/// `field` of request `at` (`""` for a single request, `requests[3]` in a batch).
fn field_of(at: &str, f: &str) -> String {
    if at.is_empty() {
        f.to_string()
    } else {
        format!("{at}.{f}")
    }
}

fn refused(e: DecideError, at: &str, s: &AppState) -> Response {
    s.metrics.error("http", e.reason());
    match e {
        DecideError::Invalid { field: f, message } => {
            bad(StatusCode::BAD_REQUEST, field_of(at, f), message)
        }
        e @ DecideError::UnknownTask(_) => {
            bad(StatusCode::NOT_FOUND, field_of(at, "task"), e.to_string())
        }
        e @ DecideError::Concurrency(_) => {
            bad(StatusCode::BAD_REQUEST, field_of(at, "task"), e.to_string())
        }
        DecideError::Sdk(m) => bad(StatusCode::SERVICE_UNAVAILABLE, field_of(at, "task"), m),
    }
}

/// One decision, or a batch of them.
#[utoipa::path(
    post,
    path = "/v1/decide",
    tag = "agent",
    request_body(content = DecideBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Decided (a batch: one answer per request, in order)", body = DecideReply),
        (status = 400, description = "Bad body: `field` names the JSON path at fault (a concurrency task cannot be decided here: field `task`)", body = ErrorBody),
        (status = 401, description = "The agent runs with --api-token and the request has no `Authorization: Bearer <token>`, or a wrong one", body = ErrorBody),
        (status = 403, description = "A request from a browser (it carries `Origin`)", body = ErrorBody),
        (status = 404, description = "Unknown task (`field` names it)", body = ErrorBody),
        (status = 408, description = "The body did not arrive within --request-timeout", body = ErrorBody),
        (status = 413, description = "The body is larger than --max-request-bytes (1 MiB by default; plain text)", content_type = "text/plain"),
        (status = 503, description = "Not decided: the task could not be verified in Redis, the agent's share of the host segment's slots is taken, the SDK refused (`field` names the task); the request's deadline passed while its tasks were looked up; or --max-concurrent-requests requests are in flight (`field` empty)", body = ErrorBody),
    )
)]
async fn decide(State(s): State<Arc<AppState>>, body: Body) -> Response {
    let t0 = Instant::now();
    // The whole request — reading its body, lookups and decisions — ends by then: a client
    // sending its body slowly holds its permit (see [`guard`]) no longer.
    let deadline = t0 + s.cfg.request_timeout;
    let limit = s.cfg.max_request_bytes as usize;
    let body: Bytes =
        match tokio::time::timeout_at(deadline.into(), axum::body::to_bytes(body, limit)).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => {
                s.metrics.error("http", "too_large");
                return (
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "the body is larger than --max-request-bytes ({limit} bytes), or broken"
                    ),
                )
                    .into_response();
            }
            Err(_) => {
                s.metrics.error("http", "deadline");
                return bad(
                    StatusCode::REQUEST_TIMEOUT,
                    String::new(),
                    format!(
                        "the body did not arrive within --request-timeout ({})",
                        humantime::format_duration(s.cfg.request_timeout)
                    ),
                );
            }
        };
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
    let (batch, reqs) = match parse_body(&v, s.cfg.max_batch as usize) {
        Ok(r) => r,
        Err((f, m)) => {
            s.metrics.error("http", "invalid");
            return bad(StatusCode::BAD_REQUEST, f, m);
        }
    };
    // Every request resolved before any is decided: a refused batch consumes nothing.
    let mut parts: Vec<Part> = Vec::with_capacity(reqs.len());
    for (at, r) in &reqs {
        if Instant::now() >= deadline {
            s.metrics.error("http", "deadline");
            return bad(
                StatusCode::SERVICE_UNAVAILABLE,
                field_of(at, "task"),
                format!(
                    "the request's deadline (--request-timeout {}) passed while its tasks were \
                     looked up; nothing was decided",
                    humantime::format_duration(s.cfg.request_timeout)
                ),
            );
        }
        match s
            .decider
            .part_by(&r.task, r.key.as_deref(), r.hits, deadline)
            .await
        {
            Ok(p) => parts.push(p),
            Err(e) => return refused(e, at, &s),
        }
    }
    let mut results = Vec::with_capacity(parts.len());
    for p in &parts {
        let d = s.decider.decide_by(p, deadline).await;
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

/// Prometheus metrics (OpenMetrics).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "agent",
    responses((status = 200, description = "The agent's metrics (docs/agent.md)", body = String, content_type = "application/openmetrics-text"))
)]
async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    s.metrics.flushes_dropped(s.decider.flushes_dropped());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

/// Liveness.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "agent",
    responses((status = 200, description = "Alive", body = Object, example = json!({"status": "ok", "host_id": "h1", "namespace": "sluice", "segment": "/dev/shm/sluice-h1"})))
)]
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
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "agent",
    responses(
        (status = 200, description = "Ready", body = Ready),
        (status = 503, description = "Not ready: `redis.reason` says why", body = Ready),
    )
)]
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

/// `GET /readyz`.
#[derive(ToSchema)]
#[allow(dead_code)] // Describes JSON built with `json!`.
struct Ready {
    ready: bool,
    redis: Check,
    /// Envoy domains known.
    domains: u64,
}

/// A dependency check.
#[derive(ToSchema)]
#[allow(dead_code)] // Describes JSON built with `json!`.
struct Check {
    ok: bool,
    #[schema(required = false)]
    reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<Vec<(String, u64)>, (String, String)> {
        parse_body(&v, MAX_BATCH).map(|(_, r)| r.into_iter().map(|(at, q)| (at, q.hits)).collect())
    }

    #[test]
    fn errors_name_the_json_path() {
        for (body, field, words) in [
            (json!({}), "task", "missing field `task`"),
            (json!({"task": 7}), "task", "expected a string"),
            (
                json!({"task": "t", "cost": 1}),
                "cost",
                "unknown field `cost`",
            ),
            (json!({"task": "t", "key": 7}), "key", "expected a string"),
            (
                json!({"task": "t", "hits": 0}),
                "hits",
                "1 ..= 1000000000000",
            ),
            (json!({"task": "t", "hits": -1}), "hits", "expected u64"),
            (json!({"task": "t", "hits": 1.5}), "hits", "expected u64"),
            (
                json!({"task": "t", "hits": 1_000_000_000_001_u64}),
                "hits",
                "1 ..= 1000000000000",
            ),
            (json!({"task": "t", "hits": u64::MAX}), "hits", "1 ..= "),
            (
                json!({"requests": (0..1001).map(|_| json!({"task": "t"})).collect::<Vec<_>>()}),
                "requests",
                "1 ..= 1000",
            ),
            (json!([1]), "", "must be an object"),
            (json!(["t", null, 1]), "", "must be an object"),
            (json!({"requests": {}}), "requests", "expected a sequence"),
            (json!({"requests": []}), "requests", "1 ..= 1000"),
            (
                json!({"requests": [{"task": "t"}], "x": 1}),
                "x",
                "unknown field `x`",
            ),
            (
                json!({"requests": [{"task": "t"}, {"task": "t", "hits": 0}]}),
                "requests[1].hits",
                "1 ..= ",
            ),
            (
                json!({"requests": [{"task": "t"}, {}]}),
                "requests[1].task",
                "missing field `task`",
            ),
            (
                json!({"requests": [{"task": "t"}, 3]}),
                "requests[1]",
                "must be an object",
            ),
            (
                json!({"requests": [["t"]]}),
                "requests[0]",
                "must be an object",
            ),
            (
                json!({"requests": [{"task": "t", "k": 1}]}),
                "requests[0].k",
                "unknown field `k`",
            ),
        ] {
            let (f, m) = parse(body.clone()).unwrap_err();
            assert_eq!(f, field, "{body}: {m}");
            assert!(m.contains(words), "{body}: {m}");
        }
        assert_eq!(
            parse(json!({"task": "t"})).unwrap(),
            vec![(String::new(), 1)]
        );
        assert_eq!(
            parse(json!({"task": "t", "key": null, "hits": 3})).unwrap(),
            vec![(String::new(), 3)]
        );
        assert_eq!(
            parse(json!({"requests": [{"task": "t"}, {"task": "u", "hits": 2}]})).unwrap(),
            vec![("requests[0]".into(), 1), ("requests[1]".into(), 2)]
        );
    }

    #[test]
    fn every_route_is_documented() {
        let d: Value = serde_json::from_str(document()).unwrap();
        let mut got: Vec<(String, Vec<String>)> = d["paths"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(p, i)| (p.clone(), i.as_object().unwrap().keys().cloned().collect()))
            .collect();
        got.sort();
        let want: Vec<(String, Vec<String>)> = [
            ("/api/v1/openapi.json", "get"),
            ("/healthz", "get"),
            ("/metrics", "get"),
            ("/readyz", "get"),
            ("/v1/decide", "post"),
        ]
        .iter()
        .map(|(p, m)| (p.to_string(), vec![m.to_string()]))
        .collect();
        assert_eq!(got, want);
        let src = include_str!("http.rs");
        assert!(
            !src.contains(concat!(".route", "(")),
            "a route registered outside utoipa_axum::routes! is not documented"
        );
        let codes = d["paths"]["/v1/decide"]["post"]["responses"]
            .as_object()
            .unwrap();
        for c in ["200", "400", "401", "403", "404", "408", "413", "503"] {
            assert!(codes.contains_key(c), "{c}");
        }
    }
}
