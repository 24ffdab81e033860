//! The OpenAPI 3.1 document of the manager's HTTP API, served at `GET /api/v1/openapi.json`.
//!
//! It is built from the code: every handler carries a `#[utoipa::path]` attribute (its path,
//! parameters, body and the statuses it answers), and the router is built from those handlers
//! with `utoipa_axum::routes!` ([`super::api_router`]), so a route cannot be registered without
//! being documented. What the access middleware (`super::access`) adds to every change
//! (401/403/415, the bearer tokens) and what the body extractor adds (413, [`super::extract`]) is added here by
//! [`AccessRules`], from the same rules, rather than repeated on each handler.
//!
//! The types below are the document's schemas only (the handlers build their JSON with
//! `serde_json::json!`); the tests compare their enums with the protocol's spellings.

#![allow(dead_code)] // The schema types are never built: they describe JSON.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
use utoipa::{IntoParams, Modify, OpenApi, ToSchema};

/// The document's skeleton: title, tags, schemas referenced by name, and the access rules.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Sluice manager API",
        description = "The manager's JSON API (docs/api.md), its health and metrics endpoints. \
Errors are `{\"error\": \"...\", \"field\": \"...\"}` (`field` names the JSON path or parameter \
at fault; some errors add `current_version`, `line`, `task`, `version`, `invalid`). Access \
(docs/security.md): reads are open, except `GET /api/v1/settings`; when the manager runs with \
`--api-token`, every change needs `Authorization: Bearer <admin token>` and reading the settings \
needs the admin or the read-only token (`--api-read-token`). Without `--api-token` no token is \
asked for. Changes from another site (an `Origin` that is not the `Host`, `Sec-Fetch-Site: \
cross-site`) are refused with 403; PUT/POST bodies must be `application/json` (415).",
        license(name = "Apache-2.0")
    ),
    components(schemas(ErrorBody)),
    tags(
        (name = "tasks", description = "Task specs and their live status"),
        (name = "traffic", description = "History, hosts, busiest keys, traffic summary"),
        (name = "ops", description = "Alerts, settings, dynamic limiting"),
        (name = "import", description = "envoyproxy/ratelimit configs imported as tasks"),
        (name = "cluster", description = "Membership, health, metrics, this document")
    )
)]
pub struct ApiDoc;

/// The served document (built once, from [`super::api_router`]).
pub fn document() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut doc = super::api_router().into_openapi();
        // After the routes are in: the skeleton's own modifiers run before them.
        AccessRules.modify(&mut doc);
        doc.to_pretty_json()
            .expect("the OpenAPI document serializes")
    })
}

/// `GET /api/v1/openapi.json`.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "cluster",
    responses((status = 200, description = "This document (OpenAPI 3.1)", content_type = "application/json", body = Object))
)]
pub async fn openapi_json() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], document())
}

/// Adds the access middleware's answers and the security schemes to every operation it
/// guards (rules in `super::access`).
pub struct AccessRules;

const ADMIN: &str = "admin_token";
const READER: &str = "read_token";

fn error_response(description: &str) -> utoipa::openapi::Response {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build()
}

fn add(op: &mut Operation, status: &str, description: &str) {
    op.responses
        .responses
        .entry(status.to_string())
        .or_insert_with(|| error_response(description).into());
}

/// The operations of a path item with their methods, upper-case.
fn operations(item: &mut PathItem) -> Vec<(&'static str, &mut Operation)> {
    [
        ("GET", item.get.as_mut()),
        ("PUT", item.put.as_mut()),
        ("POST", item.post.as_mut()),
        ("DELETE", item.delete.as_mut()),
        ("PATCH", item.patch.as_mut()),
        ("HEAD", item.head.as_mut()),
        ("OPTIONS", item.options.as_mut()),
    ]
    .into_iter()
    .filter_map(|(m, op)| op.map(|o| (m, o)))
    .collect()
}

impl Modify for AccessRules {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            ADMIN,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The admin token (--api-token): needed for every change when set",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            READER,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "The read-only token (--api-read-token): reads the settings, changes nothing",
                    ))
                    .build(),
            ),
        );
        for (path, item) in doc.paths.paths.iter_mut() {
            for (method, op) in operations(item) {
                let read = matches!(method, "GET" | "HEAD" | "OPTIONS");
                if !read {
                    op.security = Some(vec![SecurityRequirement::new::<_, [&str; 0], &str>(
                        ADMIN,
                        [],
                    )]);
                    add(
                        op,
                        "401",
                        "The manager runs with --api-token and no admin token was given",
                    );
                    add(
                        op,
                        "403",
                        "A read-only token, or a cross-origin request (Origin not the Host, Sec-Fetch-Site: cross-site)",
                    );
                }
                if matches!(method, "PUT" | "POST" | "PATCH") {
                    add(op, "415", "The body is not sent as application/json");
                    add(op, "413", "The body is larger than 2 MiB");
                }
                if read && super::needs_token_to_read(path).is_some() {
                    op.security = Some(vec![
                        SecurityRequirement::new::<_, [&str; 0], &str>(ADMIN, []),
                        SecurityRequirement::new::<_, [&str; 0], &str>(READER, []),
                    ]);
                    add(
                        op,
                        "401",
                        "The manager runs with --api-token and neither token was given",
                    );
                }
            }
        }
    }
}

/// An error answer.
#[derive(ToSchema)]
pub struct ErrorBody {
    /// What is wrong, in words.
    error: String,
    /// The JSON path of the body field (`schedules[1].cron`) or the parameter at fault; `""`
    /// for the whole body.
    #[schema(nullable = false)]
    field: Option<String>,
}

/// A dependency check of `/readyz`.
#[derive(ToSchema)]
pub struct Check {
    ok: bool,
    /// Why not, when not ok.
    #[schema(nullable = false)]
    reason: Option<String>,
}

/// `GET /healthz`.
#[derive(ToSchema)]
pub struct Health {
    /// Always `ok`.
    status: String,
    node_id: String,
    is_leader: bool,
}

/// `GET /readyz`.
#[derive(ToSchema)]
pub struct Ready {
    ready: bool,
    node_id: String,
    etcd: Check,
    task_watch: Check,
    redis: Check,
}

/// The leader, as `/cluster` shows it.
#[derive(ToSchema)]
pub struct LeaderDoc {
    node_id: String,
    addr: String,
    term: i64,
}

/// A registered member.
#[derive(ToSchema)]
pub struct MemberDoc {
    node_id: String,
    addr: String,
    is_leader: bool,
    started_ms: i64,
}

/// This replica.
#[derive(ToSchema)]
pub struct SelfDoc {
    node_id: String,
    addr: String,
}

/// `GET /api/v1/cluster`.
#[derive(ToSchema)]
pub struct Cluster {
    leader: Option<LeaderDoc>,
    members: Vec<MemberDoc>,
    #[schema(rename = "self")]
    this: SelfDoc,
}

/// `mode` of a task.
#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum ModeDoc {
    Pooled,
    Local,
    ExactFixed,
    ExactSliding,
    Concurrency,
}

/// `on_failure` of a task.
#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum OnFailureDoc {
    Local,
    Allow,
    Deny,
}

/// `fallback.algorithm` of a task.
#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum AlgorithmDoc {
    TokenBucket,
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    LeakyBucket,
}

/// `pacing` of a task.
#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum PacingDoc {
    None,
    Smooth,
}

/// The local limiter.
#[derive(ToSchema)]
pub struct FallbackDoc {
    #[schema(required = false)]
    algorithm: AlgorithmDoc,
    /// 0 = `local_limit`.
    #[schema(required = false, minimum = 0, maximum = 1_000_000_000_000_u64)]
    burst: u64,
}

/// A cron schedule entry.
#[derive(ToSchema)]
pub struct ScheduleDoc {
    /// Cron expression with a seconds field (`0 0 9 * * Mon-Fri`).
    cron: String,
    #[schema(minimum = 0, maximum = 1_000_000_000_000_u64)]
    threshold: u64,
    /// IANA time zone (`Europe/Berlin`); UTC unless given (and then not returned).
    #[schema(required = false)]
    timezone: String,
}

/// Dynamic limiting.
#[derive(ToSchema)]
pub struct DynamicDoc {
    #[schema(required = false)]
    enabled: bool,
    #[schema(required = false, minimum = 0, maximum = 1_000_000_000_000_u64)]
    min: u64,
    #[schema(required = false, minimum = 0, maximum = 1_000_000_000_000_u64)]
    max: u64,
    /// In (0, 1].
    #[schema(required = false, exclusive_minimum = 0.0, maximum = 1.0)]
    target_error_rate: f64,
    /// In (0, 3 600 000].
    #[schema(required = false, exclusive_minimum = 0.0, maximum = 3_600_000.0)]
    target_latency_ms: f64,
    #[schema(required = false, minimum = 0, maximum = 1_000_000_000_000_u64)]
    increase_step: u64,
    /// In (0, 1).
    #[schema(required = false, exclusive_minimum = 0.0, exclusive_maximum = 1.0)]
    decrease_factor: f64,
}

/// A task spec, as `PUT /api/v1/tasks/{name}` takes it (absent fields get their defaults;
/// `null` counts as absent) and as `GET` answers it (every field filled in, plus `name`,
/// `version` and the live `status`, which a PUT ignores). docs/api.md explains each field and
/// the rules between them (which fields go with which `mode`).
#[derive(ToSchema)]
pub struct TaskSpecDoc {
    /// Permits per slice (mode `concurrency`: permits in flight).
    #[schema(minimum = 0, maximum = 1_000_000_000_000_u64)]
    threshold: u64,
    #[schema(required = false, minimum = 100, maximum = 86_400_000)]
    slice_ms: u64,
    /// Pull chunk size; 0 = automatic.
    #[schema(required = false, minimum = 0, maximum = 1_000_000_000_000_u64)]
    pull: u64,
    /// `threshold` unless given.
    #[schema(required = false, minimum = 0, maximum = 1_000_000_000_000_u64)]
    local_limit: u64,
    #[schema(required = false)]
    on_failure: OnFailureDoc,
    #[schema(required = false)]
    mode: ModeDoc,
    #[schema(required = false)]
    fallback: FallbackDoc,
    #[schema(required = false, max_items = 64)]
    schedules: Vec<ScheduleDoc>,
    #[schema(required = false, nullable = false)]
    dynamic: Option<DynamicDoc>,
    #[schema(required = false, max_length = 1024)]
    description: String,
    /// Mode `concurrency` only: 500 ..= 600 000, 10 000 unless given.
    #[schema(required = false, minimum = 500, maximum = 600_000)]
    lease_ms: u64,
    /// Mode `pooled` only: every key its own limit.
    #[schema(required = false)]
    keyed: bool,
    /// Keyed tasks: key → threshold (at most 1 000 entries).
    #[schema(required = false)]
    key_overrides: BTreeMap<String, u64>,
    /// Keyed tasks only: store and show keys in clear (top keys, key slices). Default false:
    /// keys are stored and shown as keyed digests (`#` + 32 hex digits).
    #[schema(required = false)]
    clear_keys: bool,
    #[schema(required = false)]
    shadow: bool,
    #[schema(required = false)]
    pacing: PacingDoc,
    /// With `pacing: smooth` only; ≤ `threshold`.
    #[schema(required = false, minimum = 0, maximum = 1_000_000_000_000_u64)]
    burst: u64,
    /// Must equal the name in the path.
    #[schema(required = false, pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    name: String,
    /// The `version` read (etcd mod revision): the PUT is refused with 409 if the task changed
    /// since; 0 = "must not exist yet". Absent: written whatever the current version.
    #[schema(required = false, minimum = 0)]
    version: i64,
    /// Read-only (`GET` adds it); ignored by a PUT.
    #[schema(required = false, value_type = Object)]
    status: Option<serde_json::Value>,
}

/// `GET /api/v1/tasks`: the valid tasks, and the stored specs that fail validation, each list
/// in name order.
#[derive(ToSchema)]
pub struct TaskList {
    tasks: Vec<TaskSpecDoc>,
    invalid: Vec<InvalidTaskDoc>,
    /// With `limit`: the `after` of the next page, null when no stored spec after this page
    /// matches (a non-null `next` says more may). Always null without `limit`.
    #[schema(required = true)]
    next: Option<String>,
}

/// The query of a task listing (`GET /api/v1/tasks`, `GET /api/v1/traffic`), every parameter
/// optional: none lists every task. With `limit`, pages: follow `next` (as `after`) until it is
/// null. `limit` counts `tasks` and `invalid` together; one page examines at most 10,000
/// stored specs, so a page filtered by `mode` or `keyed` may hold fewer (even none) and still
/// have a `next`.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Only names starting with this.
    #[param(pattern = "^[A-Za-z0-9_.-]{0,64}$", nullable = false)]
    prefix: Option<String>,
    /// Only valid specs of this mode (stored specs that fail validation are left out).
    #[param(inline, nullable = false)]
    mode: Option<ModeDoc>,
    /// Only valid specs that are keyed (`true`) or not (`false`) (stored specs that fail
    /// validation are left out).
    #[param(nullable = false)]
    keyed: Option<bool>,
    /// At most this many entries, and a `next`.
    #[param(minimum = 1, maximum = 1000, nullable = false)]
    limit: Option<u32>,
    /// Only names after this one (bytewise): the `next` of the page before.
    #[param(min_length = 1, max_length = 1024, nullable = false)]
    after: Option<String>,
}

/// A stored spec that fails validation.
#[derive(ToSchema)]
pub struct InvalidTaskDoc {
    name: String,
    version: i64,
    error: String,
    field: String,
}

/// `PUT /api/v1/settings`.
#[derive(ToSchema)]
pub struct SettingsDoc {
    /// Alert webhooks (http/https URLs; at most 16). `GET` shows them redacted
    /// (`scheme://host/…`); a redacted entry sent back keeps the stored URL.
    #[schema(required = false)]
    webhooks: Vec<String>,
    #[schema(required = false, minimum = 1, maximum = 60_000)]
    skew_threshold_ms: u64,
    #[schema(required = false, minimum = 1_000, maximum = 3_600_000)]
    alert_quiet_ms: u64,
    /// As returned by `GET`; 409 if stale.
    #[schema(required = false, minimum = 0)]
    version: i64,
}

/// `POST /api/v1/tasks/{name}/health`: at least one of `error_rate`, `latency_ms`.
#[derive(ToSchema)]
pub struct HealthReportDoc {
    #[schema(required = false, nullable = false, minimum = 0.0, maximum = 1.0)]
    error_rate: Option<f64>,
    #[schema(
        required = false,
        nullable = false,
        minimum = 0.0,
        maximum = 3_600_000.0
    )]
    latency_ms: Option<f64>,
    /// Who measured (1 to 64 characters); `default` unless given.
    #[schema(required = false, nullable = false, min_length = 1, max_length = 64)]
    source: Option<String>,
}

/// A key and the permits counted for it.
#[derive(ToSchema)]
pub struct KeyCount {
    key: String,
    permits: u64,
}

/// `GET /api/v1/tasks/{name}/keys`.
#[derive(ToSchema)]
pub struct TopKeys {
    task: String,
    keyed: bool,
    minutes: u32,
    window_ms: i64,
    /// Key → threshold.
    overrides: BTreeMap<String, u64>,
    top_admitted: Vec<KeyCount>,
    top_rejected: Vec<KeyCount>,
    /// Members read back that are not keys or counts (skipped); only when some were.
    #[schema(required = false, nullable = false)]
    malformed_entries: Option<u64>,
}

/// One record of a task's history: the slices that start in its bucket.
#[derive(ToSchema)]
pub struct HistoryRecord {
    start_ms: i64,
    /// Mean threshold per slice.
    threshold: Option<i64>,
    admitted: u64,
    rejected: u64,
    would_reject: u64,
    slice_count: u64,
    /// Mean length of the record's own slices (ms): what they were when they ran, not the
    /// task's `slice_ms` now; null for a record without lengths.
    slice_ms: Option<u64>,
    /// Time the record's slices cover (ms); null for a record without lengths.
    span_ms: Option<u64>,
    /// `admitted × 1000 / span_ms`, two decimals.
    admitted_per_s: Option<f64>,
    /// `rejected × 1000 / span_ms`.
    rejected_per_s: Option<f64>,
    /// `would_reject × 1000 / span_ms`.
    would_reject_per_s: Option<f64>,
    /// The thresholds of the slices per second: `sum of caps × 1000 / span_ms`.
    threshold_per_s: Option<f64>,
}

/// `GET /api/v1/tasks/{name}/history`.
#[derive(ToSchema)]
pub struct History {
    task: String,
    resolution_ms: i64,
    slice_ms: u64,
    now_ms: i64,
    from_ms: i64,
    /// From where the records were read from the live slices (resolution 1s), else null.
    live_from_ms: Option<i64>,
    slices: Vec<HistoryRecord>,
}

/// `GET /api/v1/hosts`: each entry of `NS:hosts` (an unreadable one has `host_id` and `error`).
#[derive(ToSchema)]
pub struct Hosts {
    now_ms: i64,
    #[schema(value_type = Vec<Object>)]
    hosts: Vec<serde_json::Value>,
}

/// `GET /api/v1/traffic`: task name → its threshold now, rates and host states.
#[derive(ToSchema)]
pub struct Traffic {
    now_ms: i64,
    #[schema(value_type = Object)]
    tasks: serde_json::Value,
    /// With `limit`: the `after` of the next page, as `GET /api/v1/tasks` answers it.
    #[schema(required = true)]
    next: Option<String>,
}

/// `GET /api/v1/alerts`.
#[derive(ToSchema)]
pub struct Alerts {
    #[schema(value_type = Vec<Object>)]
    alerts: Vec<serde_json::Value>,
}

/// `GET /api/v1/tasks/{name}/adjustments`.
#[derive(ToSchema)]
pub struct Adjustments {
    #[schema(value_type = Vec<Object>)]
    adjustments: Vec<serde_json::Value>,
}

/// An imported domain.
#[derive(ToSchema)]
pub struct DomainDoc {
    domain: String,
    version: i64,
    imported_ms: i64,
    tasks: Vec<String>,
}

/// `GET /api/v1/import/envoy-ratelimit`.
#[derive(ToSchema)]
pub struct Domains {
    domains: Vec<DomainDoc>,
}

/// `POST /api/v1/import/envoy-ratelimit`: what the import did.
#[derive(ToSchema)]
pub struct Imported {
    domain: String,
    version: i64,
    created: Vec<String>,
    updated: Vec<String>,
    unchanged: Vec<String>,
    deleted: Vec<String>,
    #[schema(value_type = Vec<Object>)]
    tasks: Vec<serde_json::Value>,
}

/// `DELETE /api/v1/import/envoy-ratelimit/{domain}`.
#[derive(ToSchema)]
pub struct DomainDeleted {
    domain: String,
    deleted: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn doc() -> Value {
        serde_json::from_str(document()).unwrap()
    }

    /// Every route of the manager, with its methods. The router is built from the documented
    /// handlers (`routes!`), so this list is what both say; it fails when one is added or
    /// removed without the other (update it, and docs/api.md).
    const ROUTES: &[(&str, &[&str])] = &[
        ("/healthz", &["get"]),
        ("/readyz", &["get"]),
        ("/metrics", &["get"]),
        ("/api/v1/openapi.json", &["get"]),
        ("/api/v1/cluster", &["get"]),
        ("/api/v1/tasks", &["get"]),
        ("/api/v1/tasks/{name}", &["get", "put", "delete"]),
        ("/api/v1/tasks/{name}/keys", &["get"]),
        ("/api/v1/tasks/{name}/history", &["get"]),
        ("/api/v1/tasks/{name}/health", &["post"]),
        ("/api/v1/tasks/{name}/adjustments", &["get"]),
        ("/api/v1/hosts", &["get"]),
        ("/api/v1/traffic", &["get"]),
        ("/api/v1/alerts", &["get"]),
        ("/api/v1/settings", &["get", "put"]),
        ("/api/v1/import/envoy-ratelimit", &["get", "post"]),
        ("/api/v1/import/envoy-ratelimit/{domain}", &["delete"]),
    ];

    #[test]
    fn every_route_is_documented_and_nothing_else() {
        let d = doc();
        let paths = d["paths"].as_object().unwrap();
        let mut documented: Vec<(String, Vec<String>)> = paths
            .iter()
            .map(|(p, item)| {
                let mut m: Vec<String> = item.as_object().unwrap().keys().cloned().collect();
                m.sort();
                (p.clone(), m)
            })
            .collect();
        documented.sort();
        let mut expected: Vec<(String, Vec<String>)> = ROUTES
            .iter()
            .map(|(p, ms)| {
                let mut m: Vec<String> = ms.iter().map(|s| s.to_string()).collect();
                m.sort();
                (p.to_string(), m)
            })
            .collect();
        expected.sort();
        assert_eq!(documented, expected);
    }

    /// The router is only ever built from documented handlers: no module of the HTTP server
    /// registers a route with axum's `.route(` (which `utoipa_axum` passes through without
    /// documenting it).
    #[test]
    fn no_route_bypasses_the_document() {
        for (file, src) in [
            ("mod.rs", include_str!("mod.rs")),
            ("api.rs", include_str!("api.rs")),
            ("keys.rs", include_str!("keys.rs")),
            ("history.rs", include_str!("history.rs")),
            ("ops.rs", include_str!("ops.rs")),
            ("envoy.rs", include_str!("envoy.rs")),
        ] {
            assert!(
                !src.contains(concat!(".route", "(")),
                "{file} registers a route outside utoipa_axum::routes!"
            );
        }
    }

    #[test]
    fn every_operation_documents_its_errors_and_access() {
        let d = doc();
        for (path, item) in d["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let codes: Vec<&str> = op["responses"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(String::as_str)
                    .collect();
                assert!(
                    codes.iter().any(|c| c.starts_with('2')),
                    "{method} {path}: no success"
                );
                if method != "get" {
                    for c in ["401", "403"] {
                        assert!(codes.contains(&c), "{method} {path}: no {c}");
                    }
                    assert_eq!(
                        op["security"][0]["admin_token"],
                        Value::Array(vec![]),
                        "{method} {path}"
                    );
                }
                if method == "put" || method == "post" {
                    assert!(codes.contains(&"415"), "{method} {path}: no 415");
                }
                if path.contains("{name}") {
                    assert!(codes.contains(&"400"), "{method} {path}: no 400 (bad name)");
                }
            }
        }
        let settings = &d["paths"]["/api/v1/settings"]["get"];
        assert!(settings["responses"]["401"].is_object());
        assert_eq!(settings["security"].as_array().unwrap().len(), 2);
        assert!(d["paths"]["/api/v1/tasks"]["get"]["security"].is_null());
    }

    #[test]
    fn enums_are_the_protocol_spellings() {
        use sluice_protocol::{FallbackAlgorithm, Mode, OnFailure, Pacing};
        let d = doc();
        let s = &d["components"]["schemas"];
        for (name, all) in [
            ("ModeDoc", Mode::ALL),
            ("OnFailureDoc", OnFailure::ALL),
            ("AlgorithmDoc", FallbackAlgorithm::ALL),
            ("PacingDoc", Pacing::ALL),
        ] {
            let got: Vec<&str> = s[name]["enum"]
                .as_array()
                .unwrap_or_else(|| panic!("{name}: {}", s[name]))
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert_eq!(got, all, "{name}");
        }
        assert_eq!(
            s["TaskSpecDoc"]["properties"]["slice_ms"]["minimum"],
            sluice_protocol::MIN_SLICE_MS
        );
        assert_eq!(
            s["TaskSpecDoc"]["properties"]["slice_ms"]["maximum"],
            sluice_protocol::MAX_SLICE_MS
        );
        assert_eq!(
            s["TaskSpecDoc"]["properties"]["threshold"]["maximum"],
            crate::spec::MAX_COUNT
        );
    }
}
