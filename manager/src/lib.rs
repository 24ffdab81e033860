//! # sluice-manager
//!
//! A manager replica: it serves the API and the dashboard, watches task specs in etcd, and
//! campaigns for leadership; the leader keeps every task's slices written ahead in Redis.
//!
//! # Layout
//!
//! * [`config`]: flags, environment and TOML file, validated once.
//! * [`etcd_link`]: the etcd client: TLS, authentication, the start-up check of every endpoint.
//! * [`election`]: etcd election and lease; leadership bounded by a proven-alive lease.
//! * [`leader`]: the leader-only loops, started and stopped by the election.
//! * [`tasks`]: task specs in etcd, and the watched snapshot the leader rolls from.
//! * [`spec`]: the task spec and its validation (the only place it is validated).
//! * [`schedule`]: cron schedules → a slice's threshold.
//! * [`roller`]: planning and writing slices, fenced by term.
//! * [`dynamic`]: dynamic limiting: thresholds that follow the service's health.
//! * [`skew`]: clock-skew detection (key movement, host offsets).
//! * [`alerts`]: the alert pipeline: detectors' signals, episodes, stream, metrics, webhooks.
//! * [`settings`]: global settings (webhooks, skew threshold) in etcd.
//! * [`webhook`]: webhook URLs (redaction, destination safety) and the client that posts alerts.
//! * [`leases`]: mode `concurrency`: the lease hash read back and validated (API status,
//!   leader metrics).
//! * [`history`]: the leader's harvest of ended slices into compact per-task history rings.
//! * [`http`]: the JSON API, `/metrics`, `/healthz`, `/readyz` and the embedded dashboard,
//!   over HTTP or HTTPS.
//! * [`metrics`]: every metric, in one place.
//! * [`error`](mod@error): the error type.
//!
//! `main.rs` only parses flags, sets up logging and calls [`run`].

pub mod alerts;
pub mod config;
pub mod dynamic;
pub mod election;
pub mod envoy_import;
pub mod error;
pub mod etcd_link;
pub mod history;
pub mod http;
pub mod key_secret;
pub mod leader;
pub mod leases;
pub mod metrics;
pub mod roller;
pub mod schedule;
pub mod settings;
pub mod skew;
pub mod spec;
pub mod tasks;
pub mod webhook;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sluice_protocol::Keys;
use sluice_protocol::conn::{ConnOptions, Redis};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::election::{ElectionConfig, LeaderWork, NodeInfo, Role};
use crate::error::{Error, Result};
use crate::leader::LeaderDeps;
use crate::metrics::Metrics;
use crate::roller::{DynamicThresholds, RollConfig};
use crate::tasks::TaskStore;

/// The Redis handle, checked once: a TLS or authentication failure (wrong CA, certificate,
/// user or password) is a configuration error that retrying will not fix, so it stops the
/// replica at start-up with an error naming the endpoint (a replica that cannot write Redis
/// must not win an election). A Redis that is merely down is tolerated, as before: the
/// replica starts, logs the failure and connects when Redis comes up.
async fn connect_redis(cfg: &Config) -> Result<Redis> {
    sluice_protocol::tls::install_provider();
    let redis = Redis::with_security(
        cfg.redis.clone(),
        ConnOptions::default(),
        &cfg.redis_security,
    )
    .map_err(|e| Error::Startup(format!("--{}: {}", e.flag(), e.message)))?;
    if cfg.redis_security.insecure {
        warn!(
            redis = %cfg.redis,
            "--redis-insecure: Redis TLS certificate verification is OFF; anyone on the path \
             can read and change this link (tests only)"
        );
    }
    match redis.check().await {
        Ok(()) => info!(redis = %cfg.redis, tls = cfg.redis.is_tls(), "Redis reachable"),
        Err(e) if e.is_config() => {
            error!(error = %e, "Redis link misconfigured; stopping");
            return Err(Error::Startup(e.to_string()));
        }
        Err(e) => warn!(error = %e, "Redis not reachable at start-up; will keep trying"),
    }
    Ok(redis)
}

/// Runs a replica until `shutdown` resolves, then stops in order: leader work stops and the
/// leader resigns (a follower takes over at once), the HTTP server drains, watches end.
pub async fn run(cfg: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    sluice_protocol::tls::install_provider();
    let cfg = Arc::new(cfg);
    let webhooks = webhook::Webhooks::new(cfg.webhook_allow_private, cfg.webhook_ca.as_deref())
        .map_err(|e| {
            Error::Startup(format!(
                "webhook trust roots (--webhook-ca, SSL_CERT_FILE): {e}"
            ))
        })?;
    if cfg.insecure_listen && cfg.api_token.is_none() && !cfg.listen.ip().is_loopback() {
        warn!(
            listen = %cfg.listen,
            "--insecure-listen: the API is served beyond loopback without a token; anyone who \
             reaches it can change every task and setting"
        );
    }
    if cfg.webhook_allow_private {
        warn!(
            "--webhook-allow-private: webhooks may reach loopback, private and link-local addresses"
        );
    }
    let keys = Keys::new(&cfg.namespace).map_err(|e| Error::Startup(e.to_string()))?;
    let metrics = Arc::new(Metrics::new());
    let mut etcd = etcd_link::connect(&cfg).await?;
    let redis = Arc::new(connect_redis(&cfg).await?);
    let store = TaskStore::new(etcd.clone(), keys.clone());
    let (role_tx, role_rx) = watch::channel(Role::Follower);

    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| Error::Startup(format!("--listen {}: {e}", cfg.listen)))?;
    let tls = match &cfg.tls {
        Some(t) => Some(
            t.server_config()
                .map_err(|e| Error::Startup(e.to_string()))?,
        ),
        None => None,
    };
    info!(
        listen = %cfg.listen,
        https = tls.is_some(),
        node_id = cfg.node_id,
        namespace = cfg.namespace,
        etcd = ?cfg.etcd,
        redis = %cfg.redis,
        "sluice-manager started"
    );

    let election_stop = CancellationToken::new();
    let rest_stop = CancellationToken::new();
    let tracker = TaskTracker::new();

    // The HTTP server runs from the start (`/healthz` 200, `/readyz` 503 until etcd is
    // established); the election and the task watch start once etcd is.
    let state = http::AppState {
        cfg: cfg.clone(),
        keys: keys.clone(),
        store: store.clone(),
        etcd: etcd.clone(),
        redis: redis.clone(),
        metrics: metrics.clone(),
        role: role_rx,
    };
    let app = http::router(state);
    let drained = rest_stop.clone().cancelled_owned();
    let server = match tls {
        Some(tls) => {
            let listener = http::tls::TlsListener::new(listener, tls)
                .map_err(|e| Error::Startup(format!("--listen {}: {e}", cfg.listen)))?;
            tracker.spawn(async move {
                if let Err(e) = axum::serve(listener, app)
                    .with_graceful_shutdown(drained)
                    .await
                {
                    warn!(%e, "HTTPS server failed");
                }
            })
        }
        None => tracker.spawn(async move {
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(drained)
                .await
            {
                warn!(%e, "HTTP server failed");
            }
        }),
    };

    // SIGTERM during the etcd start-up check stops the check too.
    let shutdown_token = CancellationToken::new();
    let mut shutdown = Box::pin(shutdown);
    let established = tokio::select! {
        r = etcd_link::establish(&mut etcd, &cfg, &shutdown_token) => r,
        _ = &mut shutdown => {
            shutdown_token.cancel();
            Ok(false)
        }
    };
    match established {
        Ok(true) => {}
        other => {
            rest_stop.cancel();
            tracker.close();
            let _ = tokio::time::timeout(Duration::from_secs(5), tracker.wait()).await;
            return other.map(|_| ());
        }
    }

    tracker.spawn(store.clone().run_watch(rest_stop.clone()));

    let deps = Arc::new(LeaderDeps {
        keys: keys.clone(),
        redis: redis.clone(),
        store,
        metrics: metrics.clone(),
        roll: RollConfig {
            horizon: cfg.horizon,
            retention: cfg.retention,
            tick: cfg.tick,
            fence_stale_after: cfg.fence_stale_after,
        },
        lazy_after: cfg.lazy_after,
        activity: crate::history::Activity::default(),
        dynamic: DynamicThresholds::default(),
        etcd: etcd.clone(),
        control_period: cfg.control_period,
        webhooks,
    });
    let work: LeaderWork = Arc::new(move |ctx| Box::pin(leader::lead(ctx, deps.clone())));
    let election_cfg = ElectionConfig {
        keys,
        node: NodeInfo {
            node_id: cfg.node_id.clone(),
            addr: cfg.advertise.clone(),
            started_ms: sluice_protocol::unix_ms(),
        },
        ttl: cfg.lease_ttl,
        fence_stale_after: cfg.fence_stale_after,
    };
    let election = tracker.spawn(election::run(
        etcd.clone(),
        election_cfg,
        work,
        role_tx,
        metrics,
        election_stop.clone(),
    ));
    tracker.close();

    shutdown.await;
    info!("shutting down");
    election_stop.cancel();
    if tokio::time::timeout(Duration::from_secs(5), election)
        .await
        .is_err()
    {
        warn!("election did not stop within 5s");
    }
    rest_stop.cancel();
    if tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .is_err()
    {
        warn!("HTTP server did not drain within 5s");
    }
    if tokio::time::timeout(Duration::from_secs(2), tracker.wait())
        .await
        .is_err()
    {
        warn!("some tasks did not stop within 2s");
    }
    info!("stopped");
    Ok(())
}
