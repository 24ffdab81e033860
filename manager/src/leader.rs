//! Leader-only work, started when this replica wins the election and cancelled when it stops
//! leading: rolling slices (with cron schedules and dynamic overrides folded in), harvesting
//! ended slices into the traffic history, clock-skew detection, and the alert loop every
//! detector reports to.
//!
//! ```text
//!   settings::poll ──watch──▶ skew::run ─┐
//!        │                               ├─Signal─▶ alerts::run ──▶ NS:alerts, webhooks
//!        └──────────────────▶ Roller ────┘
//!                             (fence_conflict, invalid_spec)
//! ```
//!
//! # Which writes are fenced
//!
//! Every write a deposed leader could make late is either fenced by the task's fence or
//! harmless:
//!
//! * slices and meta (ROLL), tombstones and task state (RETIRE), dynamic state (ADJUST) and
//!   history records (RECORD_HISTORY): fenced, and refused for a deleted task;
//! * `NS:hosts` pruning: the script deletes only entries still stale by Redis time when it
//!   runs, whoever runs it;
//! * alerts (`NS:alerts`, `NS:alerts:state`, `NS:alerts:sent`): not fenced; a deposed leader's
//!   late write can add one duplicate alert or reopen/close one episode early — an
//!   observation it really made, never a threshold.

use std::sync::Arc;

use sluice_protocol::Keys;
use sluice_protocol::conn::Redis;
use tokio::sync::watch;

use crate::election::LeaderContext;
use crate::history::Harvester;
use crate::metrics::Metrics;
use crate::roller::{DynamicThresholds, RollConfig, Roller};
use crate::tasks::TaskStore;

/// What leader-only work needs.
pub struct LeaderDeps {
    /// Key builder.
    pub keys: Keys,
    /// Redis.
    pub redis: Arc<Redis>,
    /// Task specs.
    pub store: TaskStore,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Rolling settings.
    pub roll: RollConfig,
    /// `--lazy-after`: tasks without traffic this long are left lazy (`None`: never).
    pub lazy_after: Option<std::time::Duration>,
    /// When each task last had traffic (the harvester's, read by the roller).
    pub activity: crate::history::Activity,
    /// Dynamic threshold overrides.
    pub dynamic: DynamicThresholds,
    /// etcd (settings).
    pub etcd: etcd_client::Client,
    /// Dynamic-limiting control period.
    pub control_period: std::time::Duration,
    /// The webhook client and destination policy.
    pub webhooks: crate::webhook::Webhooks,
}

/// Runs every leader-only loop until the leadership ends.
pub async fn lead(ctx: LeaderContext, deps: Arc<LeaderDeps>) {
    // Controlled thresholds first: rolling must never write a base threshold over them.
    crate::dynamic::restore(&deps.redis, &deps.keys, &deps.store, &deps.dynamic).await;
    let initial = crate::settings::load(&deps.etcd, &deps.keys)
        .await
        .map(|(s, _)| s)
        .unwrap_or_default();
    let (settings_tx, settings) = watch::channel(initial);
    let (alerts, signals) = crate::alerts::channel(deps.metrics.clone());
    // Each leadership starts with no memory of what was written: the first tick rewrites
    // every task's window (the script skips slices that already hold the right value).
    // The key-label secret before rolling: a keyed task's meta carries it from the first
    // write. Without it (etcd failing now), SDKs store bare digests until the next leadership.
    let key_secret = match crate::key_secret::ensure(&deps.etcd, &deps.keys).await {
        Ok(s) => Some(s),
        Err(why) => {
            tracing::warn!(%why, "key-label secret unavailable; keyed tasks' keys are stored as bare SHA-256 digests this leadership");
            None
        }
    };
    let roller = Roller::new(
        deps.keys.clone(),
        deps.redis.clone(),
        deps.roll,
        deps.metrics.clone(),
        alerts.clone(),
    )
    .with_key_secret(key_secret)
    .with_lazy(deps.lazy_after, deps.activity.clone());
    let harvester = Harvester::new(
        deps.keys.clone(),
        deps.redis.clone(),
        deps.roll.retention,
        deps.metrics.clone(),
    )
    .with_activity(deps.activity.clone());
    tokio::join!(
        crate::alerts::run(
            ctx.clone(),
            deps.keys.clone(),
            deps.redis.clone(),
            deps.metrics.clone(),
            deps.webhooks.clone(),
            settings.clone(),
            signals,
        ),
        crate::settings::poll(
            ctx.clone(),
            deps.etcd.clone(),
            deps.keys.clone(),
            settings_tx,
            alerts.clone(),
        ),
        roller.run(ctx.clone(), deps.store.clone(), deps.dynamic.clone()),
        crate::envoy_import::mirror(
            ctx.clone(),
            deps.etcd.clone(),
            deps.keys.clone(),
            deps.redis.clone(),
            deps.roll.tick,
        ),
        harvester.run(ctx.clone(), deps.store.clone()),
        crate::leases::run(
            ctx.clone(),
            deps.keys.clone(),
            deps.redis.clone(),
            deps.store.clone(),
            deps.metrics.clone(),
        ),
        crate::dynamic::run(
            ctx.clone(),
            deps.keys.clone(),
            deps.redis.clone(),
            deps.store.clone(),
            deps.dynamic.clone(),
            deps.control_period,
        ),
        crate::skew::run(
            ctx,
            deps.keys.clone(),
            deps.redis.clone(),
            deps.store.clone(),
            deps.metrics.clone(),
            settings,
            alerts,
            deps.activity.clone(),
        ),
    );
}
