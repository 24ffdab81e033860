//! Every metric of the manager, in one place, served as Prometheus text at `GET /metrics`.
//!
//! All names start with `sluice_`. Labels are bounded: no task names unless a metric says so.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The manager's metrics.
pub struct Metrics {
    registry: Registry,
    /// Alerts emitted, by kind (firing and resolved).
    pub alerts: Family<KindLabel, Counter>,
    /// Largest |clock offset to Redis| over hosts reporting in the last minute (ms; leader only).
    pub max_clock_offset_ms: Gauge<f64, AtomicU64>,
    /// Webhook deliveries that succeeded.
    pub webhook_deliveries: Counter,
    /// Webhook attempts that failed (each retry counts).
    pub webhook_failures: Counter,
    /// Webhook deliveries dropped because the queue was full.
    pub webhook_dropped: Counter,
    /// 1 while this replica is the leader.
    pub leader: Gauge,
    /// Election term of this replica's current leadership (0 when follower).
    pub term: Gauge,
    /// Times this replica became leader.
    pub leader_changes: Counter,
    /// Slices created or changed in Redis by this replica.
    pub slices_written: Counter,
    /// Roll script calls sent to Redis.
    pub roll_calls: Counter,
    /// Failed roll calls (Redis errors, timeouts).
    pub roll_errors: Counter,
    /// Roll calls refused by the fence (a newer leader exists).
    pub fenced: Counter,
    /// How far ahead slices are written, minimum over tasks (seconds; leader only).
    pub horizon_ahead: Gauge<f64, AtomicU64>,
    /// Tasks known to this replica.
    pub tasks: Gauge,
    /// Duration of one rolling tick over all tasks.
    pub roll_tick_seconds: Histogram,
    /// Slices read by the history harvest (leader only).
    pub history_slices: Counter,
    /// History records written (both resolutions).
    pub history_records: Counter,
    /// Failed history harvests of one task (retried next tick).
    pub history_errors: Counter,
    /// Duration of one history harvest tick over all tasks.
    pub history_tick_seconds: Histogram,
}

/// Label of `sluice_alerts_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// Alert kind (`clock_skew`).
    pub kind: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("sluice");
        let m = Self {
            alerts: Family::default(),
            max_clock_offset_ms: Gauge::default(),
            webhook_deliveries: Counter::default(),
            webhook_failures: Counter::default(),
            webhook_dropped: Counter::default(),
            leader: Gauge::default(),
            term: Gauge::default(),
            leader_changes: Counter::default(),
            slices_written: Counter::default(),
            roll_calls: Counter::default(),
            roll_errors: Counter::default(),
            fenced: Counter::default(),
            horizon_ahead: Gauge::default(),
            tasks: Gauge::default(),
            roll_tick_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            history_slices: Counter::default(),
            history_records: Counter::default(),
            history_errors: Counter::default(),
            history_tick_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            registry: Registry::default(),
        };
        registry.register(
            "leader",
            "1 while this replica is the leader",
            m.leader.clone(),
        );
        registry.register(
            "term",
            "Election term of the current leadership (0 when follower)",
            m.term.clone(),
        );
        registry.register(
            "leader_changes",
            "Times this replica became leader",
            m.leader_changes.clone(),
        );
        registry.register(
            "slices_written",
            "Slices created or changed in Redis",
            m.slices_written.clone(),
        );
        registry.register(
            "roll_calls",
            "Roll script calls sent to Redis",
            m.roll_calls.clone(),
        );
        registry.register(
            "roll_errors",
            "Failed roll calls (Redis errors, timeouts)",
            m.roll_errors.clone(),
        );
        registry.register(
            "fenced",
            "Roll calls refused by the fence (a newer leader exists)",
            m.fenced.clone(),
        );
        registry.register(
            "horizon_ahead_seconds",
            "How far ahead slices are written, minimum over tasks (leader only)",
            m.horizon_ahead.clone(),
        );
        registry.register("tasks", "Tasks known to this replica", m.tasks.clone());
        registry.register(
            "roll_tick_seconds",
            "Duration of one rolling tick over all tasks",
            m.roll_tick_seconds.clone(),
        );
        registry.register(
            "history_slices",
            "Slices read by the history harvest (leader only)",
            m.history_slices.clone(),
        );
        registry.register(
            "history_records",
            "History records written (both resolutions)",
            m.history_records.clone(),
        );
        registry.register(
            "history_errors",
            "Failed history harvests of one task (retried next tick)",
            m.history_errors.clone(),
        );
        registry.register(
            "history_tick_seconds",
            "Duration of one history harvest tick over all tasks",
            m.history_tick_seconds.clone(),
        );
        registry.register(
            "alerts",
            "Alerts emitted, by kind (firing and resolved)",
            m.alerts.clone(),
        );
        registry.register(
            "max_clock_offset_ms",
            "Largest |clock offset to Redis| over hosts reporting in the last minute (leader only)",
            m.max_clock_offset_ms.clone(),
        );
        registry.register(
            "webhook_deliveries",
            "Webhook deliveries that succeeded",
            m.webhook_deliveries.clone(),
        );
        registry.register(
            "webhook_failures",
            "Webhook attempts that failed (each retry counts)",
            m.webhook_failures.clone(),
        );
        registry.register(
            "webhook_dropped",
            "Webhook deliveries dropped because the queue was full",
            m.webhook_dropped.clone(),
        );
        Self { registry, ..m }
    }

    /// Records this replica's role.
    pub fn set_leader(&self, term: Option<i64>) {
        match term {
            Some(t) => {
                self.leader.set(1);
                self.term.set(t);
                self.leader_changes.inc();
            }
            None => {
                self.leader.set(0);
                self.term.set(0);
                self.horizon_ahead.set(0.0);
            }
        }
    }

    /// Counts an alert of `kind`.
    pub fn alert(&self, kind: &str) {
        self.alerts
            .get_or_create(&KindLabel {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prefixed() {
        let m = Metrics::new();
        m.set_leader(Some(42));
        m.slices_written.inc_by(3);
        let text = m.render();
        assert!(text.contains("sluice_leader 1"), "{text}");
        assert!(text.contains("sluice_term 42"), "{text}");
        assert!(text.contains("sluice_slices_written_total 3"), "{text}");
        assert!(text.contains("# EOF"));
    }
}
