//! The agent's Envoy RLQS (`StreamRateLimitQuotas`) end to end: real etcd, Redis,
//! `sluice-manager` and `sluice-agent` processes; the RLQS client is a simulated Envoy data
//! plane (it enforces the assignments it gets and reports what it allowed and denied every
//! 100 ms, as Envoy's filter does at `reporting_interval`).
//!
//! * assignments follow usage: alone at 50/s a client gets ≈ 50 a slice; two clients on two
//!   agents (two hosts) each demanding 80/s of a 100 per slice task are never assigned more
//!   than 100 in a slice, summed, over ≥ 5 slices, and most of the 100 is assigned;
//! * expiry: every assignment's TTL ends at the slice's end, and each slice gets a new one;
//! * no assignment for a bucket without `sluice_task` or naming an unknown task, while
//!   another bucket of the same stream gets its assignments;
//! * abandon (`--rlqs-abandon-after 1s`): a bucket that stops reporting gets an
//!   `AbandonAction`, one that keeps reporting does not;
//! * `DENY_ALL` until the slice ends once the slice's quota is spent.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use sluice_tests::*;
use tokio::sync::mpsc;

const REPORT: Duration = Duration::from_millis(100);

/// What a client received: when (Unix ms), for which bucket, and what.
#[derive(Debug, Clone)]
struct Got {
    at_ms: i64,
    bucket: BTreeMap<String, String>,
    kind: Kind,
    /// The strategy as sent (to compare successive ones).
    strategy: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Tokens { max: u64, ttl_ms: f64 },
    Allow { ttl_ms: f64 },
    Deny { ttl_ms: f64 },
    Abandon,
    Other,
}

impl Got {
    /// The Unix ms at which the assignment expires (`None`: abandon).
    fn end_ms(&self) -> Option<f64> {
        match self.kind {
            Kind::Tokens { ttl_ms, .. } | Kind::Allow { ttl_ms } | Kind::Deny { ttl_ms } => {
                Some(self.at_ms as f64 + ttl_ms)
            }
            _ => None,
        }
    }
}

fn ms(d: &Option<PbDuration>) -> f64 {
    d.map_or(f64::INFINITY, |d| {
        d.seconds as f64 * 1e3 + d.nanos as f64 / 1e6
    })
}

fn kind_of(a: &Option<Action>) -> Kind {
    match a {
        Some(Action::AbandonAction(_)) => Kind::Abandon,
        Some(Action::QuotaAssignmentAction(q)) => {
            let ttl_ms = ms(&q.assignment_time_to_live);
            match q.rate_limit_strategy.and_then(|s| s.strategy) {
                Some(Strategy::TokenBucket(tb)) => Kind::Tokens {
                    max: tb.max_tokens as u64,
                    ttl_ms,
                },
                Some(Strategy::BlanketRule(r)) if r == BlanketRule::DenyAll as i32 => {
                    Kind::Deny { ttl_ms }
                }
                Some(Strategy::BlanketRule(_)) | None => Kind::Allow { ttl_ms },
                _ => Kind::Other,
            }
        }
        None => Kind::Other,
    }
}

/// The local state of one bucket in the simulated data plane.
#[derive(Default)]
struct Local {
    /// `None`: no assignment (the default no_assignment_behavior: allow).
    strategy: Option<Kind>,
    tokens: u64,
    expires: Option<Instant>,
    allowed: u64,
    denied: u64,
}

/// A simulated Envoy data plane on one RLQS stream.
struct Client {
    got: Arc<Mutex<Vec<Got>>>,
    stop: tokio_util_stop::Stop,
    task: tokio::task::JoinHandle<()>,
}

/// A minimal stop flag (no extra dependency).
mod tokio_util_stop {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    #[derive(Clone, Default)]
    pub struct Stop(Arc<AtomicBool>);
    impl Stop {
        pub fn set(&self) {
            self.0.store(true, Ordering::Release);
        }
        pub fn is_set(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }
}

/// Bucket `entries` with `demand` requests per second; `until`: when it stops reporting.
#[derive(Clone)]
struct Demand {
    entries: Vec<(&'static str, String)>,
    per_sec: f64,
    stop_after: Option<Duration>,
}

fn bucket_id(entries: &[(&'static str, String)]) -> BucketId {
    BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    }
}

fn sorted(b: &HashMap<String, String>) -> BTreeMap<String, String> {
    b.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

impl Client {
    /// Opens a stream to `agent` and runs the buckets for at most `run` (bounded).
    async fn start(agent: &Agent, demands: Vec<Demand>, run: Duration) -> Self {
        let mut rpc = RateLimitQuotaServiceClient::connect(agent.grpc_url())
            .await
            .expect("connect to the agent's gRPC");
        let (tx, rx) = mpsc::channel::<RateLimitQuotaUsageReports>(16);
        let resp = rpc
            .stream_rate_limit_quotas(tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(
                rx,
            ))
            .await
            .expect("StreamRateLimitQuotas");
        let mut inbound = resp.into_inner();
        let got: Arc<Mutex<Vec<Got>>> = Arc::default();
        let stop = tokio_util_stop::Stop::default();
        let locals: Arc<Mutex<HashMap<BTreeMap<String, String>, Local>>> = Arc::default();
        {
            let got = got.clone();
            let locals = locals.clone();
            tokio::spawn(async move {
                while let Ok(Some(m)) = inbound.message().await {
                    apply(&got, &locals, m);
                }
            });
        }
        let task = {
            let stop = stop.clone();
            let locals = locals.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let mut last = t0;
                let mut debt: Vec<f64> = vec![0.0; demands.len()];
                // The first request of each bucket is reported at once (the subscription).
                let mut first = true;
                while !stop.is_set() && t0.elapsed() < run {
                    let now = Instant::now();
                    let dt = now.duration_since(last);
                    last = now;
                    let mut usages = Vec::new();
                    {
                        let mut l = locals.lock().unwrap();
                        for (i, d) in demands.iter().enumerate() {
                            if d.stop_after.is_some_and(|s| t0.elapsed() >= s) {
                                continue;
                            }
                            let id = bucket_id(&d.entries);
                            let st = l.entry(sorted(&id.bucket)).or_default();
                            debt[i] += d.per_sec * dt.as_secs_f64();
                            let mut n = debt[i].floor() as u64;
                            if first {
                                n = n.max(1);
                            }
                            debt[i] -= n as f64;
                            for _ in 0..n {
                                admit(st, now);
                            }
                            usages.push(BucketQuotaUsage {
                                bucket_id: Some(id),
                                time_elapsed: (!first).then(|| PbDuration {
                                    seconds: dt.as_secs() as i64,
                                    nanos: dt.subsec_nanos() as i32,
                                }),
                                num_requests_allowed: std::mem::take(&mut st.allowed),
                                num_requests_denied: std::mem::take(&mut st.denied),
                            });
                        }
                    }
                    first = false;
                    if !usages.is_empty()
                        && tx
                            .send(RateLimitQuotaUsageReports {
                                domain: "test".into(),
                                bucket_quota_usages: usages,
                            })
                            .await
                            .is_err()
                    {
                        break;
                    }
                    tokio::time::sleep(REPORT).await;
                }
            })
        };
        Self { got, stop, task }
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    /// What bucket `entries` received.
    fn got_for(&self, entries: &[(&'static str, String)]) -> Vec<Got> {
        let b = sorted(&bucket_id(entries).bucket);
        self.got().into_iter().filter(|g| g.bucket == b).collect()
    }

    async fn finish(self) -> Vec<Got> {
        self.stop.set();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
        self.got.lock().unwrap().clone()
    }
}

/// One request of a bucket, decided by its current assignment.
fn admit(st: &mut Local, now: Instant) {
    let active = st.expires.is_none_or(|e| now < e);
    let allow = match (&st.strategy, active) {
        (None, _) | (_, false) => true,
        (Some(Kind::Deny { .. }), true) => false,
        (Some(Kind::Tokens { .. }), true) => {
            if st.tokens > 0 {
                st.tokens -= 1;
                true
            } else {
                false
            }
        }
        (Some(_), true) => true,
    };
    if allow {
        st.allowed += 1;
    } else {
        st.denied += 1;
    }
}

fn apply(
    got: &Mutex<Vec<Got>>,
    locals: &Mutex<HashMap<BTreeMap<String, String>, Local>>,
    m: RateLimitQuotaResponse,
) {
    let at_ms = now_ms();
    let now = Instant::now();
    let mut l = locals.lock().unwrap();
    for a in m.bucket_action {
        let bucket = a
            .bucket_id
            .as_ref()
            .map(|b| sorted(&b.bucket))
            .unwrap_or_default();
        let kind = kind_of(&a.bucket_action);
        let strategy = match &a.bucket_action {
            Some(Action::QuotaAssignmentAction(q)) => format!("{:?}", q.rate_limit_strategy),
            _ => String::new(),
        };
        let st = l.entry(bucket.clone()).or_default();
        match &kind {
            Kind::Abandon => {
                st.strategy = None;
                st.expires = None;
            }
            Kind::Tokens { max, ttl_ms } => {
                // "Same strategy extends, a different one replaces": the agent alternates
                // its strategies, so this always replaces (checked below in the tests).
                st.tokens = *max;
                st.expires = Some(now + Duration::from_secs_f64(ttl_ms / 1e3));
                st.strategy = Some(kind.clone());
            }
            Kind::Allow { ttl_ms } | Kind::Deny { ttl_ms } => {
                st.expires = Some(now + Duration::from_secs_f64(ttl_ms / 1e3));
                st.strategy = Some(kind.clone());
            }
            Kind::Other => {}
        }
        got.lock().unwrap().push(Got {
            at_ms,
            bucket,
            kind,
            strategy,
        });
    }
}

async fn task(m: &Manager, redis: &str, ns: &str, name: &str, body: &str) {
    let (status, resp) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
    assert!(status == 200 || status == 201, "{status} {resp}");
    m.wait_rolled(name).await;
    let mut c = redis_conn(redis);
    wait_until(
        &format!("meta of {name}"),
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let ok = !meta_fields(&mut c, ns, name).is_empty();
            async move { ok.then_some(()) }
        },
    )
    .await;
}

/// Checks that assignment `g` (received at `g.at_ms`) ends at the end of the slice it was
/// made in, and returns by how much its end, counted from its receipt, is late. The TTL is
/// relative: the agent counts it from when it made the assignment, the client from when it
/// received it, so receipt + TTL − slice end is the delivery delay (≥ 0, bounded by the time
/// since the slice started, as the assignment was made in the slice). Clocks: the agent's slice
/// clock and the test's are the same host's (± 5 ms allowed for rounding and offset).
fn ends_at_slice_end(g: &Got, slice_ms: f64) -> f64 {
    let end = g.end_ms().expect("an assignment");
    let slice_end = (end / slice_ms).round() * slice_ms;
    let off = end - slice_end;
    let since_start = g.at_ms as f64 - (slice_end - slice_ms);
    assert!(
        off >= -5.0 && off <= since_start + 5.0,
        "assignment ends {off:.1} ms off its slice's end (received {since_start:.1} ms into \
         the slice): {g:?}"
    );
    assert!(
        since_start >= -5.0,
        "received before its slice began: {g:?}"
    );
    off
}

/// A `DENY_ALL` of at most 100 ms: the agent had nothing in hand *yet* (a refill of the host's
/// quota on its way), not a spent slice.
fn is_retry_deny(g: &Got) -> bool {
    matches!(g.kind, Kind::Deny { ttl_ms } if ttl_ms <= 100.5)
}

/// The slice (index) an assignment is for: the one its TTL ends with.
fn slice_of(g: &Got, slice_ms: f64) -> i64 {
    (g.end_ms().expect("an assignment") / slice_ms).round() as i64 - 1
}

fn tokens(g: &Got) -> u64 {
    match g.kind {
        Kind::Tokens { max, .. } => max,
        _ => 0,
    }
}

fn t(name: &str) -> Vec<(&'static str, String)> {
    vec![("sluice_task", name.to_string())]
}

async fn start_manager(etcd: &str, redis: &str, ns: &str) -> Manager {
    let m = Manager::start(ManagerOpts::new(etcd, redis, ns, "m1")).await;
    m.wait_leader().await;
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn assignments_follow_usage_and_never_sum_past_the_limit() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("rlqsuse");
    let m = start_manager(&etcd, &redis, &ns).await;
    task(
        &m,
        &redis,
        &ns,
        "api",
        r#"{"threshold":100,"slice_ms":1000}"#,
    )
    .await;
    let a1 = Agent::start(&redis, &ns, &format!("{ns}-h1"), &[]).await;
    let a2 = Agent::start(&redis, &ns, &format!("{ns}-h2"), &[]).await;

    // Alone at 50/s: each slice is assigned ≈ 50 (summed, top-ups included), once the demand
    // estimate has settled (after 2 s).
    let t0 = now_ms();
    let solo = Client::start(
        &a1,
        vec![Demand {
            entries: t("api"),
            per_sec: 50.0,
            stop_after: None,
        }],
        Duration::from_secs(6),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    let t1 = now_ms();
    let got = solo.finish().await;
    let mut solo_slices: BTreeMap<i64, u64> = BTreeMap::new();
    for g in got.iter().filter(|g| g.end_ms().is_some()) {
        *solo_slices.entry(slice_of(g, 1000.0)).or_default() += tokens(g);
    }
    let settled: Vec<u64> = solo_slices
        .iter()
        .filter(|(s, _)| **s * 1000 >= t0 + 2_000 && (**s + 1) * 1000 <= t1)
        .map(|(_, n)| *n)
        .collect();
    eprintln!("solo 50/s: tokens per slice {solo_slices:?}, settled {settled:?}");
    assert!(
        settled.len() >= 2,
        "settled slices: {solo_slices:?} {got:?}"
    );
    for n in &settled {
        assert!(
            (35..=75).contains(n),
            "assigned {n} in a slice for a demand of 50: {solo_slices:?} {got:?}"
        );
    }

    // Two clients on two hosts, 80/s each: 160 a slice for a limit of 100.
    let t2 = now_ms();
    let c1 = Client::start(
        &a1,
        vec![Demand {
            entries: t("api"),
            per_sec: 80.0,
            stop_after: None,
        }],
        Duration::from_secs(10),
    );
    let c2 = Client::start(
        &a2,
        vec![Demand {
            entries: t("api"),
            per_sec: 80.0,
            stop_after: None,
        }],
        Duration::from_secs(10),
    );
    let (c1, c2) = tokio::join!(c1, c2);
    tokio::time::sleep(Duration::from_millis(9_500)).await;
    let t3 = now_ms();
    let (g1, g2) = tokio::join!(c1.finish(), c2.finish());
    let mut per_slice: BTreeMap<i64, (u64, u64)> = BTreeMap::new();
    for (i, g) in g1.iter().chain(g2.iter()).enumerate() {
        if g.end_ms().is_some() {
            let e = per_slice.entry(slice_of(g, 1000.0)).or_default();
            if i < g1.len() {
                e.0 += tokens(g);
            } else {
                e.1 += tokens(g);
            }
        }
    }
    eprintln!("two hosts at 80/s each, tokens assigned per slice (host 1, host 2): {per_slice:?}");
    for (s, (x, y)) in &per_slice {
        assert!(
            x + y <= 100,
            "slice {s}: {x} + {y} > 100 assigned: {per_slice:?}"
        );
    }
    // Whole slices from 2 s after the start (both demand estimates settled).
    let inner: Vec<u64> = per_slice
        .iter()
        .filter(|(s, _)| **s * 1000 >= t2 + 2_000 && (**s + 1) * 1000 <= t3)
        .map(|(_, (x, y))| x + y)
        .collect();
    assert!(inner.len() >= 5, "slices seen: {per_slice:?}");
    let mean = inner.iter().sum::<u64>() as f64 / inner.len() as f64;
    eprintln!("inner slices {inner:?}, mean {mean:.1} of 100");
    // Halving on refusal gets at least half of what is left at each step, and a client that
    // is denied asks again (top-up): most of the limit is assigned.
    assert!(
        mean >= 75.0,
        "mean assigned {mean:.1} of 100 a slice: {inner:?}"
    );
    for x in &inner {
        assert!(*x >= 50, "a slice assigned {x} of 100: {inner:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expiry_no_assignment_and_deny_all() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("rlqsexp");
    let m = start_manager(&etcd, &redis, &ns).await;
    task(
        &m,
        &redis,
        &ns,
        "web",
        r#"{"threshold":100,"slice_ms":1000}"#,
    )
    .await;
    task(
        &m,
        &redis,
        &ns,
        "tight",
        r#"{"threshold":10,"slice_ms":2000}"#,
    )
    .await;
    let a = Agent::start(&redis, &ns, &format!("{ns}-h1"), &[]).await;
    let no_task = vec![("name", "free".to_string())];
    let unknown = t("no-such-task");
    let c = Client::start(
        &a,
        vec![
            Demand {
                entries: t("web"),
                per_sec: 20.0,
                stop_after: None,
            },
            Demand {
                entries: no_task.clone(),
                per_sec: 20.0,
                stop_after: None,
            },
            Demand {
                entries: unknown.clone(),
                per_sec: 20.0,
                stop_after: None,
            },
            Demand {
                entries: t("tight"),
                per_sec: 100.0,
                stop_after: None,
            },
        ],
        Duration::from_secs(8),
    )
    .await;
    // Bounded: until "web" has 5 boundary assignments.
    wait_until(
        "5 slice-long assignments of web",
        Duration::from_secs(15),
        Duration::from_millis(100),
        || {
            let n = c
                .got_for(&t("web"))
                .iter()
                .filter(|g| matches!(g.kind, Kind::Tokens { ttl_ms, .. } if ttl_ms > 900.0))
                .count();
            async move { (n >= 5).then_some(()) }
        },
    )
    .await;
    let web = c.got_for(&t("web"));
    let tight = c.got_for(&t("tight"));
    let none1 = c.got_for(&no_task);
    let none2 = c.got_for(&unknown);
    let all = c.finish().await;
    eprintln!("web: {web:?}\ntight: {tight:?}");

    // Expiry: every assignment ends at a slice's end, and consecutive slices each got one.
    let mut slices = Vec::new();
    let mut offs = Vec::new();
    for g in &web {
        if is_retry_deny(g) {
            continue;
        }
        offs.push(ends_at_slice_end(g, 1000.0));
        slices.push(slice_of(g, 1000.0));
    }
    offs.sort_by(f64::total_cmp);
    eprintln!("web: receipt + TTL − slice end (ms) {offs:?}");
    slices.dedup();
    let run = slices.windows(2).filter(|w| w[1] == w[0] + 1).count();
    assert!(run >= 4, "consecutive slices assigned: {slices:?}");
    // The boundary assignments (waited for above: 5 with a TTL over 900 ms, i.e. issued by the
    // agent in the first 100 ms of their slice, its TTL counted from its own decision). When
    // the client received them is printed, not asserted: that adds the client task's own
    // scheduling (101 ms seen on a loaded CI machine), which is not the agent's to bound.
    let late: Vec<i64> = web
        .iter()
        .filter(|g| matches!(g.kind, Kind::Tokens { ttl_ms, .. } if ttl_ms > 900.0))
        .map(|g| g.at_ms - slice_of(g, 1000.0) * 1000)
        .collect();
    eprintln!("web: boundary assignments received (ms into their slice) {late:?}");
    // Successive token buckets differ (so a client replaces, not extends, its bucket).
    let tbs: Vec<&Got> = web
        .iter()
        .filter(|g| matches!(g.kind, Kind::Tokens { .. }))
        .collect();
    assert!(tbs.len() >= 5);
    for w in tbs.windows(2) {
        assert_ne!(
            w[0].strategy, w[1].strategy,
            "successive strategies equal: {tbs:?}"
        );
    }

    // No assignment for a bucket without `sluice_task`, nor for an unknown task, in ~50
    // reports; the stream stayed open (web kept getting assignments).
    assert!(none1.is_empty(), "no sluice_task got {none1:?}");
    assert!(none2.is_empty(), "unknown task got {none2:?}");

    // DENY_ALL once the slice's 10 are spent, until that slice's end.
    let denies: Vec<&Got> = tight
        .iter()
        .filter(|g| matches!(g.kind, Kind::Deny { .. }) && !is_retry_deny(g))
        .collect();
    assert!(
        !denies.is_empty(),
        "no DENY_ALL for a demand of 100/s on 10 per 2 s: {tight:?}"
    );
    for d in &denies {
        ends_at_slice_end(d, 2000.0);
    }
    let mut tight_per_slice: BTreeMap<i64, u64> = BTreeMap::new();
    for g in tight.iter().filter(|g| !is_retry_deny(g)) {
        *tight_per_slice.entry(slice_of(g, 2000.0)).or_default() += tokens(g);
    }
    eprintln!("tight tokens per slice {tight_per_slice:?}");
    for (s, n) in &tight_per_slice {
        assert!(*n <= 10, "slice {s} of tight assigned {n} > 10");
    }
    assert!(all.len() >= web.len());
    let metrics = a.metrics().await;
    for needle in [
        r#"sluice_agent_decisions_total{api="rlqs",decision="no_task"}"#,
        r#"sluice_agent_decisions_total{api="rlqs",decision="unknown_task"}"#,
        r#"sluice_agent_decisions_total{api="rlqs",decision="allowed"}"#,
    ] {
        assert!(metrics.contains(needle), "{needle} missing:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_buckets_are_abandoned() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("rlqsab");
    let m = start_manager(&etcd, &redis, &ns).await;
    task(
        &m,
        &redis,
        &ns,
        "svc",
        r#"{"threshold":100,"slice_ms":1000,"keyed":true}"#,
    )
    .await;
    let a = Agent::start(
        &redis,
        &ns,
        &format!("{ns}-h1"),
        &["--rlqs-abandon-after", "1s"],
    )
    .await;
    let quiet = vec![
        ("sluice_task", "svc".to_string()),
        ("user", "q".to_string()),
    ];
    let busy = vec![
        ("sluice_task", "svc".to_string()),
        ("user", "b".to_string()),
    ];
    let c = Client::start(
        &a,
        vec![
            Demand {
                entries: quiet.clone(),
                per_sec: 20.0,
                stop_after: Some(Duration::from_millis(800)),
            },
            Demand {
                entries: busy.clone(),
                per_sec: 20.0,
                stop_after: None,
            },
        ],
        Duration::from_secs(8),
    )
    .await;
    let t0 = Instant::now();
    wait_until(
        "AbandonAction for the quiet bucket",
        Duration::from_secs(6),
        Duration::from_millis(50),
        || {
            let ab = c.got_for(&quiet).iter().any(|g| g.kind == Kind::Abandon);
            async move { ab.then_some(()) }
        },
    )
    .await;
    eprintln!("abandoned {:?} after the test started", t0.elapsed());
    // The busy one keeps its assignments and is not abandoned (for a further 1.5 s).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let busy_got = c.got_for(&busy);
    let quiet_got = c.got_for(&quiet);
    c.finish().await;
    assert!(
        !busy_got.iter().any(|g| g.kind == Kind::Abandon),
        "busy bucket abandoned: {busy_got:?}"
    );
    assert!(
        busy_got
            .iter()
            .filter(|g| matches!(g.kind, Kind::Tokens { .. }))
            .count()
            >= 2,
        "{busy_got:?}"
    );
    // The quiet bucket had a keyed assignment before it went quiet, and nothing after the
    // abandonment.
    let ab = quiet_got
        .iter()
        .position(|g| g.kind == Kind::Abandon)
        .unwrap();
    assert!(
        matches!(quiet_got[0].kind, Kind::Tokens { .. }),
        "{quiet_got:?}"
    );
    assert_eq!(ab, quiet_got.len() - 1, "{quiet_got:?}");
    let metrics = a.metrics().await;
    assert!(
        metrics.contains(r#"sluice_agent_decisions_total{api="rlqs",decision="abandoned"} 1"#),
        "{metrics}"
    );
    // The stream ended: its buckets are dropped.
    wait_until(
        "no RLQS streams nor buckets left",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let m = a.metrics().await;
            (metric_value(&m, "sluice_agent_rlqs_streams") == Some(0.0)
                && metric_value(&m, "sluice_agent_rlqs_buckets") == Some(0.0))
            .then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_follows_on_failure() {
    // A private Redis: this test kills it.
    let mut rs = RedisServer::start();
    let (etcd, redis) = (shared_etcd(), rs.url());
    let ns = unique_ns("rlqsfail");
    let mut m = start_manager(&etcd, &redis, &ns).await;
    let spec = |f: &str| format!(r#"{{"threshold":100,"slice_ms":2000,"on_failure":"{f}"}}"#);
    task(&m, &redis, &ns, "deny", &spec("deny")).await;
    task(&m, &redis, &ns, "allow", &spec("allow")).await;
    let a = Agent::start(
        &redis,
        &ns,
        &format!("{ns}-h1"),
        &["--rlqs-assignment-ttl", "1s"],
    )
    .await;
    let c = Client::start(
        &a,
        vec![
            Demand {
                entries: t("deny"),
                per_sec: 20.0,
                stop_after: None,
            },
            Demand {
                entries: t("allow"),
                per_sec: 20.0,
                stop_after: None,
            },
        ],
        Duration::from_secs(20),
    )
    .await;
    wait_until(
        "token buckets for both tasks",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            let ok = [t("deny"), t("allow")].iter().all(|e| {
                c.got_for(e)
                    .iter()
                    .any(|g| matches!(g.kind, Kind::Tokens { .. }))
            });
            async move { ok.then_some(()) }
        },
    )
    .await;
    m.proc.kill();
    rs.kill();
    let killed_ms = now_ms();
    // FAILED: `deny` → DENY_ALL, `allow` → ALLOW_ALL, both with the short TTL (1 s, the least
    // Envoy can keep; capped to the slice's end), at the latest at the next slice boundaries.
    let short = |g: &Got, deny: bool| {
        g.at_ms > killed_ms
            && match g.kind {
                Kind::Deny { ttl_ms } if deny => ttl_ms <= 1_000.5,
                Kind::Allow { ttl_ms } if !deny => ttl_ms <= 1_000.5,
                _ => false,
            }
    };
    wait_until(
        "on_failure assignments after Redis died",
        Duration::from_secs(15),
        Duration::from_millis(50),
        || {
            let d = c.got_for(&t("deny")).iter().any(|g| short(g, true));
            let al = c.got_for(&t("allow")).iter().any(|g| short(g, false));
            async move { (d && al).then_some(()) }
        },
    )
    .await;
    // Renewed before they expire while Redis stays down: 3 s later, ALLOW_ALL again (the
    // bucket reports no denials, so only the renewal can bring it).
    let first_allow = c
        .got_for(&t("allow"))
        .iter()
        .filter(|g| short(g, false))
        .map(|g| g.at_ms)
        .min()
        .unwrap();
    wait_until(
        "ALLOW_ALL renewed for 3 s",
        Duration::from_secs(6),
        Duration::from_millis(50),
        || {
            let renewals: Vec<i64> = c
                .got_for(&t("allow"))
                .iter()
                .filter(|g| short(g, false))
                .map(|g| g.at_ms)
                .collect();
            let ok = renewals.iter().any(|at| *at >= first_allow + 3_000);
            async move { ok.then_some(()) }
        },
    )
    .await;
    let got = c.finish().await;
    let allows: Vec<i64> = got
        .iter()
        .filter(|g| g.bucket == sorted(&bucket_id(&t("allow")).bucket) && short(g, false))
        .map(|g| g.at_ms)
        .collect();
    // Never a gap longer than the TTL between two of them (the client never expires).
    for w in allows.windows(2) {
        assert!(w[1] - w[0] <= 1_000, "ALLOW_ALL renewals {allows:?}");
    }
    eprintln!("after Redis died: ALLOW_ALL at {allows:?}");
}

/// Opens a stream and returns the status of the call (RESOURCE_EXHAUSTED when refused).
async fn open_stream(a: &Agent) -> Result<(), tonic::Status> {
    let mut rpc = RateLimitQuotaServiceClient::connect(a.grpc_url())
        .await
        .expect("connect to the agent's gRPC");
    let (_tx, rx) = mpsc::channel::<RateLimitQuotaUsageReports>(1);
    rpc.stream_rate_limit_quotas(tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(
        rx,
    ))
    .await
    .map(|_| ())
}

fn users(prefix: &str, n: usize) -> Vec<Demand> {
    (0..n)
        .map(|i| Demand {
            entries: vec![
                ("sluice_task", "api".to_string()),
                ("user", format!("{prefix}{i}")),
            ],
            per_sec: 10.0,
            stop_after: None,
        })
        .collect()
}

/// The buckets of `c` (named `user=<prefix>…`) that received an assignment.
fn assigned_buckets(c: &Client, prefix: &str) -> usize {
    let mut b: Vec<BTreeMap<String, String>> = c
        .got()
        .into_iter()
        .filter(|g| g.bucket.get("user").is_some_and(|u| u.starts_with(prefix)))
        .filter(|g| g.kind != Kind::Abandon)
        .map(|g| g.bucket)
        .collect();
    b.sort();
    b.dedup();
    b.len()
}

/// Issue 23 item 14: RLQS streams and buckets are bounded — per stream, over the agent, and
/// the streams themselves; the over-limit stream is refused RESOURCE_EXHAUSTED, the
/// over-limit buckets get no assignment, and nothing is tracked past the bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_and_buckets_are_bounded() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("rlqsbound");
    let m = start_manager(&etcd, &redis, &ns).await;
    task(
        &m,
        &redis,
        &ns,
        "api",
        r#"{"threshold":10000,"slice_ms":2000,"keyed":true}"#,
    )
    .await;
    let a = Agent::start(
        &redis,
        &ns,
        &format!("{ns}-h1"),
        &[
            "--rlqs-max-streams",
            "2",
            "--rlqs-max-buckets-per-stream",
            "3",
            "--rlqs-max-buckets",
            "4",
        ],
    )
    .await;
    let c1 = Client::start(&a, users("a", 5), Duration::from_secs(30)).await;
    wait_until(
        "3 buckets of the first stream assigned",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let n = assigned_buckets(&c1, "a");
            async move { (n >= 3).then_some(()) }
        },
    )
    .await;
    let c2 = Client::start(&a, users("b", 5), Duration::from_secs(30)).await;
    wait_until(
        "a bucket of the second stream assigned",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let n = assigned_buckets(&c2, "b");
            async move { (n >= 1).then_some(()) }
        },
    )
    .await;
    let third = open_stream(&a).await;
    let e = third.expect_err("a third stream beyond --rlqs-max-streams 2");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("--rlqs-max-streams"), "{e:?}");
    // Reports keep coming for 10 buckets: still 3 + 1 tracked, and only those assigned.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(assigned_buckets(&c1, "a"), 3, "per stream: 3");
    assert_eq!(assigned_buckets(&c2, "b"), 1, "over the agent: 4");
    let metrics = a.metrics().await;
    assert_eq!(
        metric_value(&metrics, "sluice_agent_rlqs_buckets"),
        Some(4.0),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"decision="too_many_buckets""#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"reason="too_many_streams""#),
        "{metrics}"
    );
    // The first stream ends: its stream and its buckets are given back, and the second
    // stream's waiting buckets take the room, up to its own bound (3).
    c1.finish().await;
    wait_until(
        "the first stream's buckets released, the second's grown to 3",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            let m = a.metrics().await;
            (metric_value(&m, "sluice_agent_rlqs_streams") == Some(1.0)
                && metric_value(&m, "sluice_agent_rlqs_buckets") == Some(3.0)
                && assigned_buckets(&c2, "b") == 3)
                .then_some(())
        },
    )
    .await;
    // A new stream is accepted; of its 2 buckets one fits in the agent's 4.
    let c3 = Client::start(&a, users("c", 2), Duration::from_secs(30)).await;
    wait_until(
        "a new stream assigned",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let n = assigned_buckets(&c3, "c");
            async move { (n >= 1).then_some(()) }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(assigned_buckets(&c3, "c"), 1);
    assert_eq!(assigned_buckets(&c2, "b"), 3);
    let m = a.metrics().await;
    assert_eq!(
        metric_value(&m, "sluice_agent_rlqs_buckets"),
        Some(4.0),
        "{m}"
    );
    c2.finish().await;
    c3.finish().await;
}

/// Issue 23 item 18: Envoy arms an assignment's expiry with the whole seconds of its TTL, and
/// the agent's TTLs end at the slice's end: a bucket of a task whose slice is under 1 s gets
/// no assignment (every one would expire at once), and assignments sent with a TTL under 1 s
/// (1 s slices) are counted and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slices_under_one_second_get_no_assignment_and_short_ttls_are_counted() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("rlqsshort");
    let m = start_manager(&etcd, &redis, &ns).await;
    task(
        &m,
        &redis,
        &ns,
        "fast",
        r#"{"threshold":1000,"slice_ms":500}"#,
    )
    .await;
    task(
        &m,
        &redis,
        &ns,
        "second",
        r#"{"threshold":1000,"slice_ms":1000}"#,
    )
    .await;
    let a = Agent::start(&redis, &ns, &format!("{ns}-h1"), &[]).await;
    let demand = |task: &str| Demand {
        entries: t(task),
        per_sec: 20.0,
        stop_after: None,
    };
    let c = Client::start(
        &a,
        vec![demand("fast"), demand("second")],
        Duration::from_secs(10),
    )
    .await;
    wait_until(
        "assignments of the 1 s task",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let n = c.got_for(&t("second")).len();
            async move { (n >= 3).then_some(()) }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let got = c.finish().await;
    let fast: Vec<&Got> = got
        .iter()
        .filter(|g| g.bucket == sorted(&bucket_id(&t("fast")).bucket))
        .collect();
    assert!(
        fast.is_empty(),
        "a 500 ms slice task was assigned: {fast:?}"
    );
    let metrics = a.metrics().await;
    assert!(
        metrics.contains(r#"decision="slice_under_1s""#),
        "{metrics}"
    );
    assert!(
        metric_value(&metrics, "sluice_agent_rlqs_short_ttl_total").unwrap_or(0.0) >= 3.0,
        "{metrics}"
    );
    assert!(
        a.proc.log().contains("time to live under 1 s"),
        "the short TTLs are logged"
    );
}

/// Adversarial review (issue 23): a stream that tracks no bucket for `--rlqs-abandon-after`
/// is ended by the agent, so streams that never report cannot hold every one of
/// `--rlqs-max-streams` forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_streams_are_ended() {
    let redis = shared_redis();
    let ns = unique_ns("rlqsidle");
    let a = Agent::start(
        &redis,
        &ns,
        &format!("{ns}-h1"),
        &["--rlqs-max-streams", "1", "--rlqs-abandon-after", "1s"],
    )
    .await;
    let mut rpc = RateLimitQuotaServiceClient::connect(a.grpc_url())
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel::<RateLimitQuotaUsageReports>(1);
    let resp = rpc
        .stream_rate_limit_quotas(tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(
            rx,
        ))
        .await
        .expect("the first stream");
    let mut inbound = resp.into_inner();
    let e = open_stream(&a).await.expect_err("a second stream");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    // The client keeps its side open and sends nothing: the agent ends the stream.
    let t0 = Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(10), inbound.message())
        .await
        .expect("the idle stream is ended within 10 s");
    assert!(matches!(end, Ok(None)), "{end:?}");
    eprintln!("idle stream ended after {:?}", t0.elapsed());
    drop(tx);
    wait_until(
        "a new stream accepted",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { open_stream(&a).await.ok() },
    )
    .await;
}

/// Adversarial review: a bucket id was bounded by its number of entries only, so buckets with
/// megabyte values could hold gigabytes within the bucket count bounds. A bucket id over
/// 4 KiB (names and values) is refused as invalid; its neighbours are assigned as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bucket_ids_over_4_kib_are_refused() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("rlqsbig");
    let m = start_manager(&etcd, &redis, &ns).await;
    task(
        &m,
        &redis,
        &ns,
        "second",
        r#"{"threshold":1000,"slice_ms":1000}"#,
    )
    .await;
    let a = Agent::start(&redis, &ns, &format!("{ns}-h1"), &[]).await;
    let mut big = t("second");
    big.push(("tenant", "x".repeat(5_000)));
    let c = Client::start(
        &a,
        vec![
            Demand {
                entries: t("second"),
                per_sec: 20.0,
                stop_after: None,
            },
            Demand {
                entries: big.clone(),
                per_sec: 20.0,
                stop_after: None,
            },
        ],
        Duration::from_secs(10),
    )
    .await;
    wait_until(
        "assignments of the normal bucket",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let n = c.got_for(&t("second")).len();
            async move { (n >= 3).then_some(()) }
        },
    )
    .await;
    let got = c.finish().await;
    let big_id = sorted(&bucket_id(&big).bucket);
    assert!(
        got.iter().all(|g| g.bucket != big_id),
        "a bucket id of 5 KB was assigned"
    );
    let metrics = a.metrics().await;
    assert!(
        metrics.contains(r#"api="rlqs",reason="invalid""#),
        "{metrics}"
    );
}
