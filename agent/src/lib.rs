//! # sluice-agent
//!
//! One process per host (or per pod, as a sidecar) that answers rate-limit questions for
//! programs that cannot link the Rust SDK — services in any language, and gateways such as
//! Envoy — from the **same host segment** the SDK uses: its decisions are the SDK's fast path
//! (shared memory), so Redis sees a pull per chunk of permits, not a call per request.
//!
//! * [`rls`]: Envoy's rate-limit service v3 (`ShouldRateLimit`), with envoyproxy/ratelimit's
//!   descriptor matching over domains imported into the manager ([`routes`]);
//! * [`rlqs`]: Envoy's rate-limit quota service (`StreamRateLimitQuotas`): usage reports in,
//!   quota assignments out, sized from the slice quota;
//! * [`http`]: `POST /v1/decide` for everything else, `/metrics`, `/healthz`, `/readyz`;
//! * [`decide`]: the decisions all of them share; [`config`]: flags, environment, TOML;
//! * [`guard`]: authentication and the bound on requests in flight, before any handler.
//!
//! See docs/agent.md.

pub mod config;
pub mod decide;
pub mod guard;
pub mod http;
pub mod metrics;
pub mod rlqs;
pub mod rls;
pub mod routes;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use sluice_protocol::Keys;
use sluice_protocol::conn::{CheckError, ConnOptions, Redis, RedisTarget};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::decide::{Decider, DeciderLimits};
use crate::metrics::Metrics;
use crate::routes::RouteTable;

/// What every front end of the agent shares.
pub struct AppState {
    /// The configuration.
    pub cfg: Config,
    /// Decisions.
    pub decider: Decider,
    /// Envoy domains.
    pub routes: RouteTable,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Permits of the decision requests handled at once (HTTP and RLS together).
    pub inflight: Arc<Semaphore>,
    /// Permits of the open RLQS streams.
    pub rlqs_streams: Arc<Semaphore>,
    /// RLQS buckets tracked over all streams.
    pub rlqs_buckets: AtomicUsize,
    started: Instant,
    /// Milliseconds since `started` of the last successful read of the domains (-1: never).
    routes_read_ms: AtomicI64,
}

impl AppState {
    /// Time since the domains were last read from Redis (`None`: never).
    pub fn routes_age(&self) -> Option<Duration> {
        let at = self.routes_read_ms.load(Ordering::Acquire);
        (at >= 0).then(|| {
            self.started
                .elapsed()
                .saturating_sub(Duration::from_millis(at as u64))
        })
    }
}

/// Runs the agent until `shutdown` completes: binds both listeners, then serves.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let target = RedisTarget::parse(&cfg.redis).map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
    let redis = Redis::with_security(target, ConnOptions::default(), &cfg.redis_security)
        .map_err(|e| anyhow::anyhow!("--{}: {}", e.flag(), e.message))?;
    if cfg.redis_security.insecure {
        tracing::warn!("--redis-insecure: Redis's certificate is not verified (tests only)");
    }
    match redis.check().await {
        Ok(()) => {}
        Err(e @ CheckError::Config { .. }) => anyhow::bail!("{e}"),
        Err(e) => {
            tracing::warn!(error = %e, "Redis is not reachable yet; deciding by each task's on_failure until it is")
        }
    }
    let keys = Keys::new(&cfg.namespace)?;
    let client = sluice::Client::new(cfg.sdk()).context("starting the Sluice client")?;
    let metrics = Arc::new(Metrics::new());
    let limits = DeciderLimits {
        max_tasks: cfg.max_agent_tasks,
        max_waits: cfg.max_concurrent_requests,
        request_timeout: cfg.request_timeout,
    };
    let state = Arc::new(AppState {
        decider: Decider::new(client, redis, keys, metrics.clone(), limits),
        routes: RouteTable::default(),
        metrics,
        inflight: Arc::new(Semaphore::new(cfg.max_concurrent_requests as usize)),
        rlqs_streams: Arc::new(Semaphore::new(cfg.rlqs_max_streams as usize)),
        rlqs_buckets: AtomicUsize::new(0),
        started: Instant::now(),
        routes_read_ms: AtomicI64::new(-1),
        cfg,
    });
    let grpc = tokio::net::TcpListener::bind(state.cfg.grpc_listen)
        .await
        .with_context(|| format!("--grpc-listen {}", state.cfg.grpc_listen))?;
    let http = tokio::net::TcpListener::bind(state.cfg.http_listen)
        .await
        .with_context(|| format!("--http-listen {}", state.cfg.http_listen))?;
    let stop = CancellationToken::new();
    let poller = tokio::spawn(poll_routes(state.clone(), stop.clone()));
    let grpc_task = {
        let stop = stop.clone();
        let max = state.cfg.max_request_bytes as usize;
        let rls = rls::service(state.clone()).max_decoding_message_size(max);
        let rlqs = rlqs::service(state.clone()).max_decoding_message_size(max);
        let guard = guard::GrpcGuardLayer::new(
            state.cfg.api_token.clone(),
            state.inflight.clone(),
            state.cfg.max_concurrent_requests,
            state.metrics.clone(),
        );
        tokio::spawn(async move {
            let r = tonic::transport::Server::builder()
                .layer(guard)
                .add_service(rls)
                .add_service(rlqs)
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
                    stop.clone().cancelled_owned(),
                )
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "gRPC server failed");
            }
            stop.cancel();
        })
    };
    let http_task = {
        let stop = stop.clone();
        let app = http::router(state.clone());
        tokio::spawn(async move {
            use axum::serve::ListenerExt;
            let http = http.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let r = axum::serve(http, app)
                .with_graceful_shutdown(stop.clone().cancelled_owned())
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "HTTP server failed");
            }
            stop.cancel();
        })
    };
    tracing::info!(
        grpc = %state.cfg.grpc_listen,
        http = %state.cfg.http_listen,
        host_id = %state.cfg.host_id,
        namespace = %state.cfg.namespace,
        segment = %state.decider.client().segment_path().display(),
        auth = if state.cfg.api_token.is_some() { "token" } else { "none" },
        "sluice-agent serving"
    );
    let failed = tokio::select! {
        _ = shutdown => { tracing::info!("shutting down"); false }
        _ = stop.cancelled() => true,
    };
    stop.cancel();
    let _ = tokio::join!(poller, grpc_task, http_task);
    if failed {
        anyhow::bail!("a listener failed (see the log)");
    }
    Ok(())
}

/// Re-reads `NS:envoy` every `--routes-refresh` (one HGETALL per period per agent).
async fn poll_routes(state: Arc<AppState>, stop: CancellationToken) {
    let key = match Keys::new(&state.cfg.namespace) {
        Ok(k) => k.envoy_routes(),
        Err(_) => return,
    };
    let mut warned: HashMap<String, String> = HashMap::new();
    let mut down_logged = false;
    loop {
        let read = async {
            let mut c = state.decider.redis().conn().await?;
            redis::cmd("HGETALL")
                .arg(&key)
                .query_async::<HashMap<String, String>>(&mut c)
                .await
        };
        match tokio::time::timeout(Duration::from_secs(2), read).await {
            Ok(Ok(raw)) => {
                let errors = state.routes.apply(&raw);
                for (d, why) in &errors {
                    if warned.get(d) != Some(why) {
                        tracing::warn!(domain = %d, error = %why, "Envoy domain configuration in Redis refused; keeping the previous version");
                        warned.insert(d.clone(), why.clone());
                    }
                }
                warned.retain(|d, _| errors.iter().any(|(e, _)| e == d));
                state.metrics.routes(raw.len(), errors.len());
                state.routes_read_ms.store(
                    state.started.elapsed().as_millis() as i64,
                    Ordering::Release,
                );
                if down_logged {
                    tracing::info!("Envoy domain configurations readable again");
                    down_logged = false;
                }
            }
            Ok(Err(e)) => {
                if !down_logged {
                    tracing::warn!(error = %e, "cannot read the Envoy domain configurations from Redis; keeping what was read");
                    down_logged = true;
                }
            }
            Err(_) => {
                state.decider.redis().reset().await;
                if !down_logged {
                    tracing::warn!(
                        "reading the Envoy domain configurations from Redis timed out; keeping what was read"
                    );
                    down_logged = true;
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(state.cfg.routes_refresh) => {}
        }
    }
}
