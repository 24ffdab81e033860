//! The agent's metrics (OpenMetrics text at `GET /metrics`), prefix `sluice_agent_`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiDecision {
    api: &'static str,
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Api {
    api: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiReason {
    api: &'static str,
    reason: &'static str,
}

/// Every metric of one agent.
pub struct Metrics {
    registry: Registry,
    flushes_dropped: Counter,
    /// The SDK client's total when the counter was last brought up to it.
    flushes_seen: AtomicU64,
    decisions: Family<ApiDecision, Counter>,
    requests: Family<Api, Counter>,
    errors: Family<ApiReason, Counter>,
    latency: Family<Api, Histogram>,
    domains: Gauge,
    route_errors: Counter,
    rlqs_streams: Gauge,
    rlqs_buckets: Gauge,
    open_tasks: Gauge,
    task_refusals: Family<Reason, Counter>,
    rlqs_short_ttl: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("sluice_agent");
        let decisions = Family::<ApiDecision, Counter>::default();
        registry.register(
            "decisions",
            "Decisions by API (rls, rlqs, http) and outcome (allowed, limited, fallback_allowed, fallback_denied, shadow_limited, unlimited, no_limit, unknown_task)",
            decisions.clone(),
        );
        let requests = Family::<Api, Counter>::default();
        registry.register("requests", "Requests by API", requests.clone());
        let errors = Family::<ApiReason, Counter>::default();
        registry.register(
            "request_errors",
            "Requests answered with an error, by API and reason",
            errors.clone(),
        );
        let latency = Family::<Api, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(1e-6, 2.0, 22))
        });
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival at its handler to its answer (decisions only)",
            latency.clone(),
        );
        let domains = Gauge::default();
        registry.register(
            "envoy_domains",
            "Envoy rate-limit domains loaded from Redis",
            domains.clone(),
        );
        let route_errors = Counter::default();
        registry.register(
            "envoy_domain_errors",
            "Domain configurations read from Redis and refused (kept the previous version)",
            route_errors.clone(),
        );
        let rlqs_streams = Gauge::default();
        registry.register("rlqs_streams", "Open RLQS streams", rlqs_streams.clone());
        let rlqs_buckets = Gauge::default();
        registry.register(
            "rlqs_buckets",
            "RLQS buckets tracked over all streams",
            rlqs_buckets.clone(),
        );
        let open_tasks = Gauge::default();
        registry.register(
            "open_tasks",
            "Tasks the agent holds open, each a slot of the host segment (at most --max-agent-tasks)",
            open_tasks.clone(),
        );
        let task_refusals = Family::<Reason, Counter>::default();
        registry.register(
            "task_refusals",
            "Tasks not opened: unverified (Redis did not answer the first-sight lookup), slots_full (--max-agent-tasks), segment_full (the host segment)",
            task_refusals.clone(),
        );
        let rlqs_short_ttl = Counter::default();
        registry.register(
            "rlqs_short_ttl",
            "RLQS assignments sent with a time to live under 1 s (Envoy counts whole seconds: it expires them at once)",
            rlqs_short_ttl.clone(),
        );
        let flushes_dropped = Counter::default();
        registry.register(
            "flushes_dropped",
            "Batches of counters (adm, rej, ... of one slice) Redis refused and the SDK dropped instead of resending forever (logged each time)",
            flushes_dropped.clone(),
        );
        Self {
            flushes_dropped,
            flushes_seen: AtomicU64::new(0),
            registry,
            decisions,
            requests,
            errors,
            latency,
            domains,
            route_errors,
            rlqs_streams,
            rlqs_buckets,
            open_tasks,
            task_refusals,
            rlqs_short_ttl,
        }
    }

    /// Task handles open now.
    pub fn open_tasks(&self, n: usize) {
        self.open_tasks.set(n as i64);
    }

    /// A task not opened, and why.
    pub fn refusal(&self, reason: &'static str) {
        self.task_refusals.get_or_create(&Reason { reason }).inc();
    }

    /// An RLQS assignment sent with a TTL under 1 s.
    pub fn rlqs_short_ttl(&self) {
        self.rlqs_short_ttl.inc();
    }

    /// Counts a decision.
    pub fn decision(&self, api: &'static str, decision: &'static str) {
        self.decisions
            .get_or_create(&ApiDecision { api, decision })
            .inc();
    }

    /// Counts a request and how long it took.
    pub fn request(&self, api: &'static str, took: Duration) {
        self.requests.get_or_create(&Api { api }).inc();
        self.latency
            .get_or_create(&Api { api })
            .observe(took.as_secs_f64());
    }

    /// Counts a refused request.
    pub fn error(&self, api: &'static str, reason: &'static str) {
        self.errors.get_or_create(&ApiReason { api, reason }).inc();
    }

    /// Domains loaded, and refused configurations.
    pub fn routes(&self, domains: usize, refused: usize) {
        self.domains.set(domains as i64);
        self.route_errors.inc_by(refused as u64);
    }

    /// RLQS streams and buckets open.
    pub fn rlqs(&self, streams_delta: i64, buckets_delta: i64) {
        self.rlqs_streams.inc_by(streams_delta);
        self.rlqs_buckets.inc_by(buckets_delta);
    }

    /// Brings the dropped-flush counter up to the SDK client's total (at each scrape).
    pub fn flushes_dropped(&self, total: u64) {
        let prev = self.flushes_seen.fetch_max(total, Ordering::AcqRel);
        if total > prev {
            self.flushes_dropped.inc_by(total - prev);
        }
    }

    /// OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
