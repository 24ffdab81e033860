//! Leader-only work, started when this replica wins the election and cancelled when it stops
//! leading: rolling slices (with cron schedules and dynamic overrides folded in), and
//! harvesting ended slices into the traffic history, and clock-skew detection with alerts.

use std::sync::Arc;

use sluice::protocol::Keys;
use sluice::protocol::conn::Redis;

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
    /// Dynamic threshold overrides.
    pub dynamic: DynamicThresholds,
    /// etcd (settings).
    pub etcd: etcd_client::Client,
    /// Dynamic-limiting control period.
    pub control_period: std::time::Duration,
}

/// Runs every leader-only loop until the leadership ends.
pub async fn lead(ctx: LeaderContext, deps: Arc<LeaderDeps>) {
    // Controlled thresholds first: rolling must never write a base threshold over them.
    crate::dynamic::restore(&deps.redis, &deps.keys, &deps.store, &deps.dynamic).await;
    // Each leadership starts with no memory of what was written: the first tick rewrites
    // every task's window (the script skips slices that already hold the right value).
    let roller = Roller::new(
        deps.keys.clone(),
        deps.redis.clone(),
        deps.roll,
        deps.metrics.clone(),
    );
    let harvester = Harvester::new(
        deps.keys.clone(),
        deps.redis.clone(),
        deps.roll.retention,
        deps.metrics.clone(),
    );
    tokio::join!(
        roller.run(ctx.clone(), deps.store.clone(), deps.dynamic.clone()),
        harvester.run(ctx.clone(), deps.store.clone()),
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
            deps.etcd.clone(),
            deps.store.clone(),
            deps.metrics.clone(),
        ),
    );
}
