//! An HTTP API limited by Sluice: the example to copy.
//!
//! Two routes share one **keyed** Sluice task, so every client gets its own cluster-wide limit:
//!
//! * `GET /api/items` costs 1 permit;
//! * `POST /api/export` costs `--export-cost` permits (default 10): an expensive call spends
//!   more of the same limit;
//! * `GET /healthz` is not limited (it is added after the layer).
//!
//! A client is its `x-api-key` header (key `key:<digest>`: the header is a credential, so it is
//! hashed before it becomes a key) or, without one, its IP address (key `ip:<address>`). A refused request gets `429 Too Many Requests` with `Retry-After` and the
//! IETF `RateLimit-Policy` / `RateLimit` fields, and a small JSON body. See README.md beside
//! this file for how to run it next to `scripts/dev.sh`.
//!
//! The layer decides from the host's shared-memory quota: no network call per request. Which
//! limit applies (threshold per slice, per-key overrides, schedules) is the task's spec, set
//! through the manager's API, not here.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::Body;
use axum::http::{HeaderValue, Method, Response, StatusCode, header};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use serde_json::{Value, json};
use sluice::CheckError;
use sluice::layer::{KeyExtractor, RejectReason, Rejection, SluiceLayer};

/// Command-line flags. Every flag has a default that works next to `scripts/dev.sh` except
/// `--redis` (dev.sh picks a free port and prints the URL).
#[derive(Parser, Debug)]
#[command(
    name = "sluice-example-axum",
    about = "An axum HTTP API limited per API key (per client IP without one) by a Sluice task"
)]
struct Args {
    /// Redis URL of the Sluice deployment (the Redis the managers write slices into), e.g.
    /// `redis://127.0.0.1:6379`; `rediss://` for TLS.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis: String,
    /// Address to serve HTTP on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// The Sluice task that limits the API. Create it keyed (`"keyed": true`) so every client
    /// has its own limit; see README.md.
    #[arg(long, default_value = "api")]
    task: String,
    /// Sluice namespace (the managers' `--namespace`).
    #[arg(long, default_value = "sluice")]
    namespace: String,
    /// This host's id: names the shared-memory segment every Sluice process of the host shares
    /// (default: the hostname).
    #[arg(long)]
    host_id: Option<String>,
    /// Permits one `POST /api/export` costs (`GET /api/items` costs 1).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    export_cost: u64,
    /// How long to wait at start-up for the task's spec to reach this host, in milliseconds
    /// (it is served meanwhile; the SDK admits requests of a task it does not know yet).
    #[arg(long, default_value_t = 5_000)]
    wait_ready_ms: u64,
}

/// The header that carries the caller's API key.
const API_KEY_HEADER: &str = "x-api-key";

#[tokio::main]
async fn main() -> ExitCode {
    // Bad flags: clap prints what is wrong with which flag and exits with code 2.
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    // Anything else that stops the service: one line naming the flag, exit code 1.
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    // 1. One Sluice client per process. It owns a background thread (pulls quota, flushes
    //    counts) and must live as long as the server: it is dropped at the end of `run`.
    let mut cfg = sluice::Config::new(args.redis.clone());
    cfg.namespace = args.namespace.clone();
    if let Some(h) = &args.host_id {
        cfg.host_id = h.clone();
    }
    let client = sluice::Client::new(cfg).map_err(|e| {
        let flag = match &e {
            sluice::Error::Name(_) => "--namespace",
            sluice::Error::Redis(_) | sluice::Error::RedisSecurity(_) => "--redis",
            sluice::Error::Segment(_) => "--host-id (the shared-memory segment)",
            _ => "starting the Sluice client",
        };
        anyhow::Error::new(e).context(flag)
    })?;
    // A wrong password or TLS setting will not fix itself: stop. An unreachable Redis is only
    // a warning: the SDK decides with the task's `on_failure` policy and reconnects by itself.
    // (`check_redis` blocks for a moment: `block_in_place` keeps the runtime's other work going.)
    match tokio::task::block_in_place(|| client.check_redis()) {
        Ok(()) => {}
        Err(e @ CheckError::Config { .. }) => {
            return Err(e).context("--redis: the Redis link is misconfigured");
        }
        Err(e) => tracing::warn!(error = %e, "--redis: Redis is unreachable for now"),
    }

    // 2. A handle to the task (cheap, Clone + Send + Sync).
    let task = client
        .task(&args.task)
        .with_context(|| format!("--task {:?}", args.task))?;
    check_task(&task, &args);

    // 3. The layer: which key a request is limited under, and what it costs.
    let export_cost = args.export_cost;
    let limit = SluiceLayer::new(task)
        .key(api_key_or_client_ip())
        .cost(move |req| {
            if req.method == Method::POST && req.uri.path() == "/api/export" {
                export_cost
            } else {
                1
            }
        })
        // The default answer is an empty 429 with the headers; this one adds a JSON body.
        .on_reject(json_rejection);

    // 4. The application. Routes added before `.layer(limit)` are limited, routes added after
    //    it are not.
    let app = Router::new()
        .route("/api/items", get(list_items))
        .route("/api/export", post(start_export))
        .layer(limit)
        .route("/healthz", get(|| async { "ok" }));

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen {}", args.listen))?;
    tracing::info!(
        "listening on http://{} (task {:?}, namespace {:?})",
        listener.local_addr()?,
        args.task,
        args.namespace
    );
    // `with_connect_info` puts the peer address into every request, for the IP fallback.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown())
    .await?;
    tracing::info!("stopped");
    // The last counts are flushed to Redis when the client goes.
    drop(client);
    Ok(())
}

/// The key a request is limited under: `key:<digest of x-api-key>` when the header is present,
/// else `ip:<peer address>`. Both are built from the SDK's own extractors; the API key is a
/// credential, so it is hashed first (`KeyExtractor::hashed`: the first 16 bytes of its SHA-256,
/// 32 hex digits) and never reaches the host's key table or Redis as it was sent. An override
/// for one API key is written for its digest (`printf %s "$KEY" | sha256sum | cut -c1-32`).
///
/// The API key is taken as sent: a real service authenticates it first (an auth layer before
/// this one, or a key taken from the authenticated identity), or a client could escape its
/// limit by inventing new keys.
fn api_key_or_client_ip() -> KeyExtractor {
    let api_key = KeyExtractor::header(API_KEY_HEADER).hashed();
    let client_ip = KeyExtractor::peer_ip();
    KeyExtractor::from_fn(move |req| {
        api_key
            .extract(req)
            .map(|k| format!("key:{k}"))
            .or_else(|| client_ip.extract(req).map(|ip| format!("ip:{ip}")))
    })
}

/// The answer to a refused request: the layer's default (status `429`, `Retry-After`,
/// `RateLimit-Policy`, `RateLimit`; `400` for a key the task refuses) with a JSON body.
fn json_rejection(r: &Rejection) -> Response<Body> {
    let mut res: Response<Body> = r.default_response();
    if r.grpc {
        // A gRPC caller gets a trailers-only RESOURCE_EXHAUSTED: no body.
        return res;
    }
    let body = match &r.reason {
        RejectReason::MissingKey => json!({
            "error": "bad_key",
            "message": format!("no usable client key (the {API_KEY_HEADER} header is at most 252 bytes)"),
        }),
        _ => json!({
            "error": "rate_limited",
            "message": "too many requests for this client; retry after the Retry-After header's seconds",
            "retry_after_ms": r.retry_after.map(|d| d.as_millis() as u64),
            "cost": r.cost,
        }),
    };
    *res.body_mut() = Body::from(body.to_string());
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

/// `GET /api/items`: a page of items (static data: the example is about the limit).
async fn list_items() -> Json<Value> {
    Json(json!({
        "items": [
            {"id": 1, "name": "bolt"},
            {"id": 2, "name": "nut"},
            {"id": 3, "name": "washer"},
        ]
    }))
}

/// `POST /api/export`: starts an (imaginary) export job. It costs more permits than a read.
async fn start_export() -> (StatusCode, Json<Value>) {
    (
        StatusCode::ACCEPTED,
        Json(json!({"export": "queued", "poll": "/api/items"})),
    )
}

/// Waits (at most `--wait-ready-ms`) until the task's spec has reached this host, and says
/// what is wrong if it has not or if the task is not keyed. Never fatal: the service runs
/// either way, and picks the spec up when it is created or changed.
fn check_task(task: &sluice::Task, args: &Args) {
    let wait = Duration::from_millis(args.wait_ready_ms);
    let ready = tokio::task::block_in_place(|| task.wait_ready(wait));
    if !ready {
        tracing::warn!(
            "task {:?} is unknown in namespace {:?} after {wait:?}: requests are admitted \
             until it exists. Create it through a manager, e.g. curl -X PUT \
             http://127.0.0.1:8080/api/v1/tasks/{} -d '{{\"threshold\":10,\"slice_ms\":1000,\"keyed\":true}}'",
            args.task,
            args.namespace,
            args.task
        );
    } else if task.meta().is_some_and(|m| !m.keyed) {
        tracing::warn!(
            "task {:?} is not keyed: every client shares one limit. Set \"keyed\": true in its \
             spec for a limit per client",
            args.task
        );
    }
}

/// Resolves on Ctrl-C or SIGTERM: the server stops accepting, finishes what it serves, and
/// `main` returns (exit code 0).
async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
