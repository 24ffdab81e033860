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
    /// Largest |clock offset to Redis| over hosts reporting in the last minute (seconds;
    /// leader only).
    pub max_clock_offset_seconds: Gauge<f64, AtomicU64>,
    /// Alert signals dropped because the alert loop's queue was full.
    pub alert_signals_dropped: Counter,
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
    /// Tasks with nothing new to write checked by one `HMGET` of their meta instead of a roll
    /// script call (a script call follows when the probe finds anything unexpected).
    pub roll_probes: Counter,
    /// Slice readings of the clock-skew detector (one script call each).
    pub skew_polls: Counter,
    /// Tasks the leader left lazy (`--lazy-after`): no slices ahead, workers make them.
    pub lazy_tasks: Gauge,
    /// Lazy tasks rolled ahead again because a worker made one of their slices.
    pub lazy_woken: Counter,
    /// Fresh hosts whose workers speak a protocol before 5: no task is left lazy meanwhile.
    pub lazy_held_back_hosts: Gauge,
    /// Failed roll calls (Redis errors, timeouts).
    pub roll_errors: Counter,
    /// Roll calls refused by the fence (a newer leader exists).
    pub fenced: Counter,
    /// Tasks whose fence is held by another epoch (another etcd or manager cluster) or by a
    /// term of another etcd history, in the last rolling tick (leader only).
    pub fence_foreign_tasks: Gauge,
    /// Roll calls refused because the stored spec version was newer (lagging snapshot).
    pub stale_specs: Counter,
    /// Stored task specs that fail validation (neither rolled nor retired).
    pub invalid_tasks: Gauge,
    /// Host entries removed from `NS:hosts` after the host retention (leader only).
    pub hosts_pruned: Counter,
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
    /// Mode `concurrency`, by task: permits held cluster-wide (live lease entries; leader only).
    pub concurrency_permits_held: Family<TaskLabel, Gauge>,
    /// Mode `concurrency`, by task: hosts holding permits under a live lease (leader only).
    pub concurrency_hosts_holding: Family<TaskLabel, Gauge>,
    /// Mode `concurrency`, by task: hosts with a live lease and permits waiting (leader only).
    pub concurrency_hosts_waiting: Family<TaskLabel, Gauge>,
    /// Mode `concurrency`, by task: leases found expired while holding permits, each once.
    pub concurrency_lease_expiries: Family<TaskLabel, Counter>,
    /// Lease hash entries skipped because they do not parse (each read counts).
    pub concurrency_malformed_entries: Counter,
    /// Shadow mode, by task: rejections that shadow mode admitted, counted by the history
    /// harvest from the slices' `wrej` (leader only; a task shows up once it had one).
    pub would_reject: Family<TaskLabel, Counter>,
}

/// Label of the per-task metrics of mode `concurrency` (task names only: bounded by the
/// tasks an operator created; hosts are never labels).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabel {
    /// Task name.
    pub task: String,
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
            max_clock_offset_seconds: Gauge::default(),
            alert_signals_dropped: Counter::default(),
            webhook_deliveries: Counter::default(),
            webhook_failures: Counter::default(),
            webhook_dropped: Counter::default(),
            leader: Gauge::default(),
            term: Gauge::default(),
            leader_changes: Counter::default(),
            slices_written: Counter::default(),
            roll_calls: Counter::default(),
            roll_probes: Counter::default(),
            skew_polls: Counter::default(),
            lazy_tasks: Gauge::default(),
            lazy_woken: Counter::default(),
            lazy_held_back_hosts: Gauge::default(),
            roll_errors: Counter::default(),
            fenced: Counter::default(),
            fence_foreign_tasks: Gauge::default(),
            stale_specs: Counter::default(),
            invalid_tasks: Gauge::default(),
            hosts_pruned: Counter::default(),
            horizon_ahead: Gauge::default(),
            tasks: Gauge::default(),
            roll_tick_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            history_slices: Counter::default(),
            history_records: Counter::default(),
            history_errors: Counter::default(),
            history_tick_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            concurrency_permits_held: Family::default(),
            would_reject: Family::default(),
            concurrency_hosts_holding: Family::default(),
            concurrency_hosts_waiting: Family::default(),
            concurrency_lease_expiries: Family::default(),
            concurrency_malformed_entries: Counter::default(),
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
            "roll_probes",
            "Tasks with nothing new to write checked by one HMGET of their meta instead of a roll script call",
            m.roll_probes.clone(),
        );
        registry.register(
            "lazy_tasks",
            "Tasks the leader left lazy (--lazy-after): no slices written ahead, workers make them from the meta",
            m.lazy_tasks.clone(),
        );
        registry.register(
            "lazy_held_back_hosts",
            "Fresh hosts whose workers speak a protocol before 5 (no task is left lazy meanwhile)",
            m.lazy_held_back_hosts.clone(),
        );
        registry.register(
            "lazy_woken",
            "Lazy tasks rolled ahead again because a worker made one of their slices",
            m.lazy_woken.clone(),
        );
        registry.register(
            "skew_polls",
            "Slice readings of the clock-skew detector (one script call each)",
            m.skew_polls.clone(),
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
            "fence_foreign_tasks",
            "Tasks whose fence another epoch (etcd or manager cluster) holds, last tick (leader only)",
            m.fence_foreign_tasks.clone(),
        );
        registry.register(
            "stale_specs",
            "Roll calls refused because the stored spec version was newer",
            m.stale_specs.clone(),
        );
        registry.register(
            "invalid_tasks",
            "Stored task specs that fail validation (neither rolled nor retired)",
            m.invalid_tasks.clone(),
        );
        registry.register(
            "hosts_pruned",
            "Host entries removed from NS:hosts after the host retention (leader only)",
            m.hosts_pruned.clone(),
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
            "max_clock_offset_seconds",
            "Largest |clock offset to Redis| over hosts reporting in the last minute (leader only)",
            m.max_clock_offset_seconds.clone(),
        );
        registry.register(
            "alert_signals_dropped",
            "Alert signals dropped because the alert loop's queue was full",
            m.alert_signals_dropped.clone(),
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
        registry.register(
            "concurrency_permits_held",
            "Mode concurrency: permits held cluster-wide, sum of live lease entries (leader only)",
            m.concurrency_permits_held.clone(),
        );
        registry.register(
            "concurrency_hosts_holding",
            "Mode concurrency: hosts holding permits under a live lease (leader only)",
            m.concurrency_hosts_holding.clone(),
        );
        registry.register(
            "concurrency_hosts_waiting",
            "Mode concurrency: hosts with a live lease and permits waiting (leader only)",
            m.concurrency_hosts_waiting.clone(),
        );
        registry.register(
            "concurrency_lease_expiries",
            "Mode concurrency: leases found expired while holding permits, each once (leader only)",
            m.concurrency_lease_expiries.clone(),
        );
        registry.register(
            "concurrency_malformed_entries",
            "Lease hash entries skipped because they do not parse (each read counts)",
            m.concurrency_malformed_entries.clone(),
        );
        registry.register(
            "would_reject",
            "Shadow mode: rejections that shadow mode admitted, by task (leader only, from the history harvest)",
            m.would_reject.clone(),
        );
        Self { registry, ..m }
    }

    /// Counts `n` would-rejects (shadow mode) of `task` harvested from its slices.
    pub fn would_reject(&self, task: &str, n: u64) {
        self.would_reject
            .get_or_create(&TaskLabel {
                task: task.to_string(),
            })
            .inc_by(n);
    }

    /// Sets the mode `concurrency` metrics of `task` from one read of its lease hash, with
    /// `expired` leases newly found lapsed.
    pub fn set_concurrency(&self, task: &str, view: &crate::leases::LeaseView, expired: u64) {
        let l = TaskLabel {
            task: task.to_string(),
        };
        self.concurrency_permits_held
            .get_or_create(&l)
            .set(view.held() as i64);
        self.concurrency_hosts_holding
            .get_or_create(&l)
            .set(view.hosts_holding() as i64);
        self.concurrency_hosts_waiting
            .get_or_create(&l)
            .set(view.hosts_waiting() as i64);
        self.concurrency_lease_expiries
            .get_or_create(&l)
            .inc_by(expired);
        self.concurrency_malformed_entries.inc_by(view.malformed);
    }

    /// Removes the gauges of `task` (task gone or leadership ended). The expiry counter stays:
    /// a counter only goes up while the process lives.
    pub fn remove_concurrency_task(&self, task: &str) {
        let l = TaskLabel {
            task: task.to_string(),
        };
        self.concurrency_permits_held.remove(&l);
        self.concurrency_hosts_holding.remove(&l);
        self.concurrency_hosts_waiting.remove(&l);
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
                self.lazy_tasks.set(0);
                self.lazy_held_back_hosts.set(0);
                self.fence_foreign_tasks.set(0);
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

    /// OpenMetrics text exposition (what Prometheus asks for).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The classic Prometheus text format (version 0.0.4), for clients that do not ask for
    /// OpenMetrics (`curl`, `promtool check metrics`): the same samples, with the `_total`
    /// suffix in the `HELP`/`TYPE` lines of counters, and no `# UNIT` or `# EOF` lines.
    pub fn render_classic(&self) -> String {
        to_classic(&self.render())
    }
}

/// Rewrites OpenMetrics text as classic Prometheus text (see [`Metrics::render_classic`]).
///
/// ```
/// let om = "# HELP x_calls Calls.\n# TYPE x_calls counter\nx_calls_total 3\n# EOF\n";
/// assert_eq!(
///     sluice_manager::metrics::to_classic(om),
///     "# HELP x_calls_total Calls.\n# TYPE x_calls_total counter\nx_calls_total 3\n"
/// );
/// ```
pub fn to_classic(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rewritten = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(rewritten.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
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
        let classic = m.render_classic();
        assert!(
            classic.contains("# HELP sluice_fenced_total Roll calls"),
            "{classic}"
        );
        assert!(
            classic.contains("# TYPE sluice_history_errors_total counter"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"));
    }
}
