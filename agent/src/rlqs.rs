//! Envoy's rate-limit quota service (`envoy.service.rate_limit_quota.v3`,
//! `StreamRateLimitQuotas`): usage reports in, quota assignments out, sized from the slice
//! quota of the host (docs/agent.md, section "RLQS").
//!
//! * A bucket names its task in the `BucketId` entry `sluice_task`; the other entries, sorted
//!   by key, `k=v` joined with `|` (`\` escapes `|` and `\`; `sha256:<hex>` past 256 bytes),
//!   are the key of a keyed task (ignored for a task that is not keyed). A bucket without
//!   `sluice_task`, naming an unknown task, a concurrency task or a task whose slice is under
//!   1 s (Envoy would expire every assignment at once: it counts whole seconds of a TTL), or
//!   beyond `--rlqs-max-buckets-per-stream` / `--rlqs-max-buckets`, gets no assignment (the
//!   client keeps its `no_assignment_behavior`); logged once per bucket, counted.
//! * Sizing: per bucket the agent estimates the demand (allowed + denied per second, from the
//!   reports); at the first report of a bucket, at each slice boundary of its task while the
//!   bucket is tracked, and when a report shows denials under the current assignment (top-up),
//!   it acquires from the host's quota (the SDK's fast path) the expected demand for the rest of
//!   the slice — at least 1, at most the task's threshold; what the host holds, plus refills
//!   waited for one permit at a time for at most [`ACQUIRE_BUDGET`] (`acquire_up_to`) —
//!   and answers a `token_bucket` of exactly what it got, with no refill to speak of (one token
//!   a day) and an `assignment_time_to_live` ending at the slice's end. Successive assignments
//!   of a bucket alternate `fill_interval` by one nanosecond so that a client always sees a
//!   *different* strategy and replaces its bucket with the fresh, full one (the same strategy
//!   would only extend the old, partly spent bucket).
//! * Granted 0 (the slice's quota is spent): `DENY_ALL` until the slice ends.
//! * FAILED (Redis unusable): the task's `on_failure` decides: `deny` → `DENY_ALL`, `allow`
//!   (and a task whose meta is not known yet) → `ALLOW_ALL`, `local` → a token bucket of what
//!   the local limiter granted; TTL `--rlqs-assignment-ttl` (for `local` capped to the
//!   slice's end: its grant is the slice's).
//! * Shadow tasks: the acquire is made (counted by the SDK as usual, would-rejects included)
//!   and the answer is `ALLOW_ALL` until the slice ends.
//! * A bucket reporting no usage for `--rlqs-abandon-after` gets an `AbandonAction` and is
//!   dropped; when the stream ends every bucket of it is dropped.
//!
//! One tokio task per stream (at most `--rlqs-max-streams`); it sleeps until the next slice
//! boundary, renewal or abandonment of one of its buckets (`Timers`: ordered, so a wake-up
//! or a message costs work in proportion to the buckets it concerns, never a scan of all), or
//! the next message.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use sluice::Decision;
use sluice_protocol::OnFailure;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::AppState;
use crate::decide::{DecideError, Part, decision_name, until_slice_end};
use crate::routes::key_of;

/// The `BucketId` entry naming the Sluice task.
pub const TASK_ENTRY: &str = "sluice_task";
/// Most entries of one `BucketId` (a bucket with more is refused as invalid).
pub const MAX_BUCKET_ENTRIES: usize = 32;
/// Most bytes of one `BucketId`'s names and values together (a larger one is refused as
/// invalid): the agent keeps every bucket id it tracks, so the count bounds
/// (`--rlqs-max-buckets`) bound its memory only with each id bounded too.
pub const MAX_BUCKET_ID_BYTES: usize = 4_096;
/// The shortest slice RLQS assigns for: Envoy arms an assignment's expiry with the whole
/// seconds of its TTL, and a TTL ends at the slice's end, so with shorter slices every
/// assignment would expire at once.
pub const MIN_SLICE: Duration = Duration::from_secs(1);
/// The `fill_interval` of every token bucket assigned: with `tokens_per_fill` 1, one token a
/// day, i.e. no refill within any slice (0 is not a valid `tokens_per_fill`; Envoy computes
/// the rate from whole seconds of the interval, so it must be at least 1 s).
pub const NO_REFILL: Duration = Duration::from_secs(86_400);
/// Reports covering less time than this give no rate: the demand is their count.
const MIN_RATE_WINDOW: Duration = Duration::from_millis(50);
/// Longest time one assignment keeps asking for refills of the host's quota.
pub const ACQUIRE_BUDGET: Duration = Duration::from_millis(50);
/// Longest time one round of assignments (one message of reports, one slice boundary) waits
/// for refills; the buckets after it are assigned from what the host holds (fast path).
pub const ROUND_BUDGET: Duration = Duration::from_millis(100);
/// A refusal lasting until this close to the slice's end says the slice is spent.
const SPENT_SLACK: Duration = Duration::from_millis(5);
/// TTL of the `DENY_ALL` answered when nothing could be acquired *yet* (a refill pending).
const RETRY_DENY: Duration = Duration::from_millis(100);
/// How often a bucket refused for an unknown task is looked up again.
const RECHECK: Duration = Duration::from_secs(5);

/// The service.
pub struct Rlqs {
    state: Arc<AppState>,
}

/// The tonic server of the service.
pub fn service(state: Arc<AppState>) -> RateLimitQuotaServiceServer<Rlqs> {
    RateLimitQuotaServiceServer::new(Rlqs { state })
}

type Out = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = Out;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let Ok(permit) = self.state.rlqs_streams.clone().try_acquire_owned() else {
            self.state.metrics.error("rlqs", "too_many_streams");
            return Err(Status::resource_exhausted(format!(
                "the agent serves --rlqs-max-streams ({}) RLQS streams already",
                self.state.cfg.rlqs_max_streams
            )));
        };
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(run_stream(self.state.clone(), inbound, tx, permit));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Where a bucket's quota comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BucketTarget {
    /// Task `task`; `key` is the key text for a keyed task (built from the other entries).
    Task {
        /// The task name.
        task: String,
        /// The key text (used only when the task is keyed).
        key: String,
    },
    /// No `sluice_task` entry.
    NoTask,
}

/// The task and key text of a bucket.
pub fn bucket_target(bucket: &HashMap<String, String>) -> BucketTarget {
    let Some(task) = bucket.get(TASK_ENTRY) else {
        return BucketTarget::NoTask;
    };
    let rest: BTreeMap<&str, &str> = bucket
        .iter()
        .filter(|(k, _)| k.as_str() != TASK_ENTRY)
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let parts: Vec<String> = rest.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    BucketTarget::Task {
        task: task.clone(),
        key: key_of(&refs),
    }
}

/// A bucket's identity: its entries sorted (the order of a `BucketId` does not matter).
type BucketKey = Vec<(String, String)>;

fn bucket_key(id: &BucketId) -> BucketKey {
    let mut v: BucketKey = id
        .bucket
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    v.sort();
    v
}

/// The wake-up times of a stream's buckets (by bucket number), ordered: the next one is the
/// first, and the due ones are taken from the front — O(log n) per change, never a scan.
#[derive(Debug, Default)]
struct Timers {
    by_time: BTreeSet<(Instant, u64)>,
    at: HashMap<u64, Instant>,
}

impl Timers {
    /// Sets (or clears) the wake-up of bucket `n`.
    fn set(&mut self, n: u64, when: Option<Instant>) {
        if let Some(old) = self.at.remove(&n) {
            self.by_time.remove(&(old, n));
        }
        if let Some(w) = when {
            self.by_time.insert((w, n));
            self.at.insert(n, w);
        }
    }

    /// The earliest wake-up.
    fn next(&self) -> Option<Instant> {
        self.by_time.first().map(|(t, _)| *t)
    }

    /// Takes the buckets due at `now` (their wake-ups are cleared).
    fn due(&mut self, now: Instant) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(&(t, n)) = self.by_time.first() {
            if t > now {
                break;
            }
            self.by_time.pop_first();
            self.at.remove(&n);
            out.push(n);
        }
        out
    }
}

/// One tracked bucket of a stream.
struct Bucket {
    id: BucketId,
    /// Its number in the stream (for [`Timers`]).
    num: u64,
    /// `None`: refused (no assignment), since `refused_at`.
    part: Option<Part>,
    refused_at: Instant,
    /// Demand estimate: requests (allowed + denied) over the time they were reported for,
    /// halved together once the window exceeds two slices.
    win_count: f64,
    win_secs: f64,
    last_report: Instant,
    /// Time between the last two reports.
    interval: Duration,
    /// The last report with usage (or the first report).
    last_usage: Instant,
    /// Slice index of the last assignment, and whether that slice's quota was found spent.
    assigned: Option<i64>,
    assigned_at: Instant,
    spent: Option<i64>,
    seq: u64,
    /// A FAILED assignment (short TTL) is renewed at this time while the bucket is tracked.
    renew_at: Option<Instant>,
}

impl Bucket {
    /// Requests per second expected: 0 once the client has not reported for two report
    /// intervals (or a slice, if longer).
    fn rate(&self, now: Instant, slice: Duration) -> f64 {
        let quiet = (self.interval * 2).max(slice);
        if now.duration_since(self.last_report) > quiet || self.win_secs <= 0.0 {
            return 0.0;
        }
        self.win_count / self.win_secs
    }
}

struct StreamState {
    state: Arc<AppState>,
    buckets: HashMap<BucketKey, Bucket>,
    /// Bucket number → key.
    nums: HashMap<u64, BucketKey>,
    next_num: u64,
    timers: Timers,
    /// Buckets refused because the stream (or the agent) tracks too many (logged once per
    /// stream).
    overflow_logged: bool,
    /// An over-bound bucket id was logged on this stream.
    invalid_logged: bool,
    /// Tasks whose assignments went out with a TTL under 1 s (logged once per task).
    short_ttl_logged: HashSet<String>,
    domain: String,
}

fn pb_duration(d: Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

fn assignment(id: &BucketId, strategy: Strategy, ttl: Duration) -> BucketAction {
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(pb_duration(ttl)),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}

fn blanket(rule: BlanketRule) -> Strategy {
    Strategy::BlanketRule(rule as i32)
}

fn token_bucket(granted: u64, seq: u64) -> Strategy {
    let n = granted.min(u32::MAX as u64) as u32;
    Strategy::TokenBucket(TokenBucket {
        max_tokens: n,
        tokens_per_fill: Some(UInt32Value { value: 1 }),
        fill_interval: Some(pb_duration(NO_REFILL + Duration::from_nanos(seq % 2))),
    })
}

/// The slice index of `part`'s task now (`None` while its meta is unknown).
fn slice_index(part: &Part) -> Option<(i64, u64)> {
    let m = part.task.meta()?;
    let slice_us = m.slice_ms.max(1) as i64 * 1_000;
    Some((part.task.now_us().div_euclid(slice_us), m.slice_ms.max(1)))
}

/// When a FAILED assignment of lifetime `ttl` is renewed: early enough that the renewal's own
/// bounded work (a round's acquire budget, the machine's scheduling) ends before the client's
/// copy expires — a margin of a tenth of the TTL, at least 200 ms (twice [`ROUND_BUDGET`]),
/// at most half the TTL.
fn renew_after(ttl: Duration) -> Duration {
    let margin = (ttl / 10).max(ROUND_BUDGET * 2).min(ttl / 2);
    ttl - margin
}

/// Acquires up to `want` permits for `part` from the host's quota.
///
/// An acquire of `n` is all or nothing, and waiting for `n` when the host holds less can take
/// the whole `--acquire-timeout` (the pulls may deliver less than `n` at a time, or the slice
/// may have less than `n` left), so the agent takes what the host **holds** (fast path, never
/// waits), and while it still needs more asks for **one** permit with the waiting decision,
/// which returns at the next refill of the host's quota (or at once when the slice is spent, or
/// while FAILED with the `on_failure` decision). It stops after [`ACQUIRE_BUDGET`] (each wait
/// is bounded by `--acquire-timeout`).
///
/// Returns the permits got and the decision that got them (or the last refusal).
async fn acquire_up_to(state: &AppState, part: &Part, want: u64, wait: bool) -> (u64, Decision) {
    let deadline = Instant::now() + ACQUIRE_BUDGET.min(state.cfg.acquire_timeout);
    let want = want.max(1);
    let try_n = |n: u64| match &part.key {
        Some(k) => k.try_acquire(n),
        None => part.task.try_acquire(n),
    };
    let mut got = 0u64;
    let mut last = Decision::Allowed;
    for _ in 0..256 {
        let need = want - got;
        if need == 0 {
            break;
        }
        let held = part
            .task
            .limit_info("", None, true, part.key.as_ref())
            .map_or(0, |l| l.remaining);
        if held > 0 {
            let k = held.min(need);
            let d = try_n(k);
            if d.is_allowed() {
                got += k;
                last = d;
                continue;
            }
        }
        if Instant::now() >= deadline && got > 0 {
            break;
        }
        let mut p = part.clone();
        p.hits = 1;
        let d = if wait && Instant::now() < deadline {
            state.decider.decide(&p).await
        } else {
            try_n(1)
        };
        last = d;
        match d {
            Decision::Allowed => got += 1,
            // FAILED (or the meta unknown): the `on_failure` policy decides the rest, halving
            // (all or nothing per amount), without waiting.
            Decision::FallbackAllowed => {
                got += 1;
                let mut n = want - got;
                while n > 0 && got < want {
                    if try_n(n).is_allowed() {
                        got += n;
                    } else {
                        n /= 2;
                    }
                }
                return (got, d);
            }
            // Shadow mode: the enforced decision refused; the answer admits all anyway.
            Decision::ShadowLimited { .. } => return (got.max(1), d),
            _ => break,
        }
    }
    if got > 0 && !matches!(last, Decision::Allowed | Decision::ShadowLimited { .. }) {
        last = Decision::Allowed;
    }
    (got, last)
}

fn ttl_of(a: &BucketAction) -> Option<Duration> {
    match &a.bucket_action {
        Some(Action::QuotaAssignmentAction(q)) => q
            .assignment_time_to_live
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32)),
        _ => None,
    }
}

impl StreamState {
    /// Resolves a bucket seen for the first time: `Err(why)` when it gets no assignment.
    async fn resolve(&mut self, id: &BucketId) -> Result<Part, &'static str> {
        let s = &self.state;
        let refuse = |why: &'static str| {
            s.metrics.decision("rlqs", why);
            Err(why)
        };
        let (task, key) = match bucket_target(&id.bucket) {
            BucketTarget::NoTask => return refuse("no_task"),
            BucketTarget::Task { task, key } => (task, key),
        };
        let keyed = match s.decider.task(&task).await {
            Ok(t) => t.meta().is_some_and(|m| m.keyed),
            Err(e) => return refuse(refusal_name(&e)),
        };
        match s
            .decider
            .part(&task, keyed.then_some(key.as_str()), 1)
            .await
        {
            Ok(p)
                if p.task
                    .meta()
                    .is_some_and(|m| Duration::from_millis(m.slice_ms) < MIN_SLICE) =>
            {
                refuse("slice_under_1s")
            }
            Ok(p) => Ok(p),
            Err(e) => refuse(refusal_name(&e)),
        }
    }

    /// When bucket `b` must be looked at again: its abandonment, its renewal, or just past its
    /// task's next slice boundary (so that the new slice is the current one).
    fn wake_of(&self, b: &Bucket, now: Instant) -> Instant {
        let mut w = b.last_usage + self.state.cfg.rlqs_abandon_after;
        if let Some(r) = b.renew_at {
            w = w.min(r);
        }
        if let Some(p) = &b.part
            && let Some(d) = until_slice_end(&p.task)
        {
            w = w.min(now + d + Duration::from_micros(500));
        }
        w
    }

    /// Re-arms the wake-up of bucket `key`.
    fn reschedule(&mut self, key: &BucketKey, now: Instant) {
        if let Some(b) = self.buckets.get(key) {
            let w = self.wake_of(b, now);
            self.timers.set(b.num, Some(w));
        }
    }

    /// Stops tracking bucket `key`.
    fn remove(&mut self, key: &BucketKey) -> Option<Bucket> {
        let b = self.buckets.remove(key)?;
        self.nums.remove(&b.num);
        self.timers.set(b.num, None);
        self.state.rlqs_buckets.fetch_sub(1, Ordering::AcqRel);
        self.state.metrics.rlqs(0, -1);
        Some(b)
    }

    /// Room for one more bucket, per stream and over the agent (reserved when there is).
    fn reserve(&mut self) -> bool {
        let cfg = &self.state.cfg;
        if self.buckets.len() >= cfg.rlqs_max_buckets_per_stream as usize {
            return false;
        }
        let max = cfg.rlqs_max_buckets as usize;
        self.state
            .rlqs_buckets
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Handles one message of reports, sending each action as soon as it is made (`Err`: the
    /// client is gone).
    async fn on_reports(&mut self, m: RateLimitQuotaUsageReports, tx: &Tx) -> Result<(), ()> {
        if self.domain.is_empty() && !m.domain.is_empty() {
            self.domain = m.domain.clone();
        }
        let now = Instant::now();
        let round_end = now + ROUND_BUDGET;
        for u in m.bucket_quota_usages {
            let Some(id) = u.bucket_id else {
                self.state.metrics.error("rlqs", "no_bucket_id");
                continue;
            };
            if id.bucket.is_empty() {
                self.state.metrics.error("rlqs", "no_bucket_id");
                continue;
            }
            let bytes: usize = id.bucket.iter().map(|(k, v)| k.len() + v.len()).sum();
            if id.bucket.len() > MAX_BUCKET_ENTRIES || bytes > MAX_BUCKET_ID_BYTES {
                self.state.metrics.error("rlqs", "invalid");
                if !self.invalid_logged {
                    // Once per stream: such a bucket gets no assignment (Envoy's no-assignment
                    // behaviour applies), which nobody would notice from a counter alone.
                    tracing::warn!(domain = %self.domain, entries = id.bucket.len(), bytes,
                        max_entries = MAX_BUCKET_ENTRIES, max_bytes = MAX_BUCKET_ID_BYTES,
                        "RLQS bucket ids over the bounds get no assignment");
                    self.invalid_logged = true;
                }
                continue;
            }
            let key = bucket_key(&id);
            // The time this report covers.
            let covered: Duration;
            let count = u.num_requests_allowed.saturating_add(u.num_requests_denied);
            let elapsed = u
                .time_elapsed
                .map(|d| {
                    Duration::new(
                        d.seconds.max(0) as u64,
                        d.nanos.clamp(0, 999_999_999) as u32,
                    )
                })
                .filter(|d| !d.is_zero());
            if !self.buckets.contains_key(&key) {
                if !self.reserve() {
                    self.state.metrics.decision("rlqs", "too_many_buckets");
                    if !self.overflow_logged {
                        tracing::warn!(domain = %self.domain,
                            per_stream = self.state.cfg.rlqs_max_buckets_per_stream,
                            total = self.state.cfg.rlqs_max_buckets,
                            "RLQS stream reports more buckets than tracked (--rlqs-max-buckets-per-stream, --rlqs-max-buckets); the others get no assignment");
                        self.overflow_logged = true;
                    }
                    continue;
                }
                let part = match self.resolve(&id).await {
                    Ok(p) => Some(p),
                    Err(why) => {
                        // Entry names and the task only: values may be user data.
                        let entries: Vec<&str> = key.iter().map(|(k, _)| k.as_str()).collect();
                        let task = id.bucket.get(TASK_ENTRY).map(String::as_str).unwrap_or("");
                        tracing::warn!(domain = %self.domain, task, entries = ?entries, why, "RLQS bucket gets no assignment: it names no task of this namespace (BucketId entry `sluice_task`), an unknown task, a task in mode concurrency or with a slice under 1 s, or the task cannot be opened now");
                        None
                    }
                };
                let num = self.next_num;
                self.next_num += 1;
                self.nums.insert(num, key.clone());
                self.buckets.insert(
                    key.clone(),
                    Bucket {
                        id: id.clone(),
                        num,
                        part,
                        refused_at: now,
                        win_count: 0.0,
                        win_secs: 0.0,
                        last_report: now,
                        interval: Duration::ZERO,
                        last_usage: now,
                        assigned: None,
                        assigned_at: now,
                        spent: None,
                        seq: 0,
                        renew_at: None,
                    },
                );
                self.state.metrics.rlqs(0, 1);
                let Some(b) = self.buckets.get_mut(&key) else {
                    continue;
                };
                // The first report: its count over the time it covers (if it says).
                b.win_count = count as f64;
                b.win_secs = elapsed.map_or(0.0, |e| e.as_secs_f64());
                covered = elapsed.unwrap_or(Duration::ZERO);
            } else {
                let Some(b) = self.buckets.get_mut(&key) else {
                    continue;
                };
                let since = now.duration_since(b.last_report);
                let e = elapsed.unwrap_or(since);
                covered = e;
                b.interval = since;
                b.last_report = now;
                if count > 0 {
                    b.last_usage = now;
                }
                b.win_count += count as f64;
                b.win_secs += e.as_secs_f64();
                if b.part.is_none() && now.duration_since(b.refused_at) >= RECHECK {
                    b.refused_at = now;
                    let id = b.id.clone();
                    let part = self.resolve(&id).await.ok();
                    if let Some(b) = self.buckets.get_mut(&key) {
                        b.part = part;
                    }
                }
            }
            self.reschedule(&key, now);
            let Some(b) = self.buckets.get_mut(&key) else {
                continue;
            };
            let Some(part) = b.part.clone() else {
                continue;
            };
            let slice = slice_index(&part);
            let fresh = slice.is_none_or(|(i, _)| b.assigned != Some(i));
            // Denials under the current assignment (the report covers only time after it: a
            // report sent right after an assignment still counts the old one's denials).
            let topup = u.num_requests_denied > 0
                && slice.is_some_and(|(i, _)| b.spent != Some(i))
                && now.duration_since(b.assigned_at) >= covered;
            if (fresh || topup)
                && let Some(a) = self.assign(&key, now, Instant::now() < round_end).await
            {
                self.reschedule(&key, Instant::now());
                send(tx, a).await?;
            }
        }
        Ok(())
    }

    /// Sizes and makes the assignment of bucket `key` for the rest of the current slice.
    /// `wait`: it may wait for refills of the host's quota (false once a round of assignments
    /// has used its time: the fast path only).
    async fn assign(&mut self, key: &BucketKey, now: Instant, wait: bool) -> Option<BucketAction> {
        let state = self.state.clone();
        let b = self.buckets.get_mut(key)?;
        let part = b.part.clone()?;
        let meta = part.task.meta();
        let slice = Duration::from_millis(meta.as_ref().map_or(1_000, |m| m.slice_ms.max(1)));
        let threshold = meta.as_ref().map_or(1, |m| m.threshold.max(1));
        let remaining = until_slice_end(&part.task).unwrap_or(slice);
        // Too little time reported to make a rate of (a first report is sent right after the
        // first request): the demand is what was counted.
        let want = if b.win_secs < MIN_RATE_WINDOW.as_secs_f64() {
            b.win_count.max(1.0).ceil() as u64
        } else {
            (b.rate(now, slice) * remaining.as_secs_f64()).ceil() as u64
        };
        let want = want.clamp(1, threshold);
        // Keep the estimate to about two slices of history.
        let horizon = (slice * 2).max(Duration::from_secs(1)).as_secs_f64();
        while b.win_secs > horizon {
            b.win_secs /= 2.0;
            b.win_count /= 2.0;
        }
        let mut tries = 0;
        let (granted, decision, index) = loop {
            let before = slice_index(&part);
            let (g, d) = acquire_up_to(&state, &part, want, wait).await;
            let after = slice_index(&part);
            tries += 1;
            // A grant charged to a slice that ended meanwhile is not handed out for the next.
            if before == after || tries >= 2 {
                break (g, d, after.map(|(i, _)| i));
            }
        };
        let ttl_to_end = until_slice_end(&part.task).unwrap_or(slice);
        let b = self.buckets.get_mut(key)?;
        b.assigned = index;
        b.assigned_at = Instant::now();
        b.seq += 1;
        state.metrics.decision("rlqs", decision_name(&decision));
        let shadow = meta.as_ref().is_some_and(|m| m.shadow);
        let local = meta
            .as_ref()
            .is_some_and(|m| m.on_failure == OnFailure::Local);
        // FAILED: `allow` / `deny` do not depend on the slice, so their TTL is not cut at its
        // end (an assignment expiring exactly at the boundary would leave the client without
        // one until the boundary's assignment arrives); `local`'s grant is the slice's.
        let failed_ttl = if local {
            state.cfg.rlqs_assignment_ttl.min(ttl_to_end)
        } else {
            state.cfg.rlqs_assignment_ttl
        };
        let (action, failed_sent) = match decision {
            Decision::FallbackAllowed if local => (
                assignment(&b.id, token_bucket(granted, b.seq), failed_ttl),
                Some(failed_ttl),
            ),
            Decision::FallbackAllowed => (
                assignment(&b.id, blanket(BlanketRule::AllowAll), failed_ttl),
                Some(failed_ttl),
            ),
            Decision::FallbackDenied { retry_after } => {
                let ttl = failed_ttl.min(retry_after.max(Duration::from_millis(1)));
                (
                    assignment(&b.id, blanket(BlanketRule::DenyAll), ttl),
                    Some(ttl),
                )
            }
            _ => (
                self.quota_action(key, decision, granted, index, shadow, ttl_to_end)?,
                None,
            ),
        };
        // A FAILED assignment is renewed shortly before it expires (the same strategy extends
        // it at the client); `local`'s, cut at the slice's end, is renewed by the boundary.
        let b = self.buckets.get_mut(key)?;
        b.renew_at = failed_sent
            .filter(|ttl| !local || *ttl + Duration::from_millis(20) < ttl_to_end)
            .map(|ttl| Instant::now() + renew_after(ttl));
        // Envoy expires an assignment after the whole seconds of its TTL: one under 1 s at
        // once (then its `expired_assignment_behavior` applies). Counted, logged once per task.
        if ttl_of(&action).is_some_and(|t| t < Duration::from_secs(1)) {
            state.metrics.rlqs_short_ttl();
            let task = part.task.name();
            if self.short_ttl_logged.len() < 1_024 && self.short_ttl_logged.insert(task.into()) {
                tracing::warn!(
                    task,
                    slice_ms = slice.as_millis() as u64,
                    "RLQS assignment sent with a time to live under 1 s (the rest of the slice, or a short retry): Envoy counts whole seconds and expires it at once; use slices of several seconds for RLQS (docs/agent.md)"
                );
            }
        }
        Some(action)
    }

    /// The assignment of a decision on the global quota (not FAILED).
    fn quota_action(
        &mut self,
        key: &BucketKey,
        decision: Decision,
        granted: u64,
        index: Option<i64>,
        shadow: bool,
        ttl_to_end: Duration,
    ) -> Option<BucketAction> {
        let b = self.buckets.get_mut(key)?;
        Some(match decision {
            _ if shadow => assignment(&b.id, blanket(BlanketRule::AllowAll), ttl_to_end),
            // The slice's quota is spent (the refusal lasts until the slice's end).
            Decision::Limited { retry_after }
                if granted == 0 && retry_after + SPENT_SLACK >= ttl_to_end =>
            {
                b.spent = index;
                assignment(&b.id, blanket(BlanketRule::DenyAll), ttl_to_end)
            }
            // Nothing in hand yet, a refill on its way: deny briefly; the client's next report
            // (with denials) asks again.
            _ if granted == 0 => assignment(
                &b.id,
                blanket(BlanketRule::DenyAll),
                RETRY_DENY.min(ttl_to_end),
            ),
            _ => assignment(&b.id, token_bucket(granted, b.seq), ttl_to_end),
        })
    }

    /// Abandons the due buckets that are idle and assigns the new slice (or renews a FAILED
    /// assignment) of the other due ones; only the due buckets are looked at.
    async fn on_timer(&mut self, tx: &Tx) -> Result<(), ()> {
        let now = Instant::now();
        let abandon = self.state.cfg.rlqs_abandon_after;
        let mut out = Vec::new();
        let mut due = Vec::new();
        for n in self.timers.due(now) {
            let Some(key) = self.nums.get(&n).cloned() else {
                continue;
            };
            let Some(b) = self.buckets.get(&key) else {
                continue;
            };
            if now.duration_since(b.last_usage) >= abandon {
                if let Some(b) = self.remove(&key)
                    && b.part.is_some()
                {
                    self.state.metrics.decision("rlqs", "abandoned");
                    out.push(BucketAction {
                        bucket_id: Some(b.id),
                        bucket_action: Some(Action::AbandonAction(AbandonAction {})),
                    });
                }
                continue;
            }
            let assign = match &b.part {
                Some(p) => {
                    slice_index(p).is_some_and(|(i, _)| b.assigned != Some(i))
                        || b.renew_at.is_some_and(|r| r <= now)
                }
                None => false,
            };
            if assign {
                due.push(key);
            } else {
                self.reschedule(&key, now);
            }
        }
        if !out.is_empty() {
            tx.send(Ok(RateLimitQuotaResponse { bucket_action: out }))
                .await
                .map_err(|_| ())?;
        }
        let round_end = Instant::now() + ROUND_BUDGET;
        for k in due {
            let a = self.assign(&k, now, Instant::now() < round_end).await;
            self.reschedule(&k, Instant::now());
            if let Some(a) = a {
                send(tx, a).await?;
            }
        }
        Ok(())
    }
}

type Tx = mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

/// Sends one action (its own message: an assignment leaves as soon as it is made, so that its
/// TTL, counted from when it was made, is not delayed behind the others').
async fn send(tx: &Tx, a: BucketAction) -> Result<(), ()> {
    tx.send(Ok(RateLimitQuotaResponse {
        bucket_action: vec![a],
    }))
    .await
    .map_err(|_| ())
}

fn refusal_name(e: &DecideError) -> &'static str {
    match e {
        DecideError::UnknownTask(_) => "unknown_task",
        DecideError::Concurrency(_) => "concurrency",
        DecideError::Invalid { .. } => "invalid",
        DecideError::Sdk(_) => "unavailable",
    }
}

async fn run_stream(
    state: Arc<AppState>,
    mut inbound: Streaming<RateLimitQuotaUsageReports>,
    tx: Tx,
    permit: OwnedSemaphorePermit,
) {
    // One of --rlqs-max-streams, held while the stream lives.
    let _permit = permit;
    state.metrics.rlqs(1, 0);
    let mut s = StreamState {
        state: state.clone(),
        buckets: HashMap::new(),
        nums: HashMap::new(),
        next_num: 0,
        timers: Timers::default(),
        overflow_logged: false,
        invalid_logged: false,
        short_ttl_logged: HashSet::new(),
        domain: String::new(),
    };
    let mut idle_since: Option<Instant> = None;
    loop {
        // A stream without buckets for --rlqs-abandon-after is ended: streams that never
        // report must not hold the --rlqs-max-streams permits forever.
        let now = Instant::now();
        if s.buckets.is_empty() {
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) >= state.cfg.rlqs_abandon_after {
                tracing::debug!("RLQS stream without buckets ended");
                break;
            }
        } else {
            idle_since = None;
        }
        let idle_end = idle_since.map(|t| t + state.cfg.rlqs_abandon_after);
        let wake = match (s.timers.next(), idle_end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let sent = tokio::select! {
            m = inbound.message() => match m {
                Ok(Some(m)) => {
                    let t0 = Instant::now();
                    let r = s.on_reports(m, &tx).await;
                    state.metrics.request("rlqs", t0.elapsed());
                    r
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "RLQS stream ended with an error");
                    break;
                }
            },
            _ = async {
                match wake {
                    Some(w) => tokio::time::sleep_until(w.into()).await,
                    None => std::future::pending().await,
                }
            } => if s.buckets.is_empty() { Ok(()) } else { s.on_timer(&tx).await },
            _ = tx.closed() => break,
        };
        if sent.is_err() {
            break;
        }
    }
    let n = s.buckets.len();
    state.rlqs_buckets.fetch_sub(n, Ordering::AcqRel);
    state.metrics.rlqs(-1, -(n as i64));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewals_leave_room_for_their_own_work() {
        let ms = Duration::from_millis;
        assert_eq!(renew_after(ms(500)), ms(300));
        assert_eq!(renew_after(Duration::from_secs(10)), Duration::from_secs(9));
        assert_eq!(renew_after(ms(200)), ms(100));
    }

    fn map(entries: &[(&str, &str)]) -> HashMap<String, String> {
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_key_is_the_other_entries_sorted_and_escaped() {
        assert_eq!(bucket_target(&map(&[("name", "x")])), BucketTarget::NoTask);
        assert_eq!(
            bucket_target(&map(&[("sluice_task", "t"), ("b", "2|x"), ("a", "1\\")])),
            BucketTarget::Task {
                task: "t".into(),
                key: "a=1\\\\|b=2\\|x".into()
            }
        );
        assert_eq!(
            bucket_target(&map(&[("sluice_task", "t")])),
            BucketTarget::Task {
                task: "t".into(),
                key: String::new()
            }
        );
        let long = "v".repeat(300);
        let BucketTarget::Task { key, .. } =
            bucket_target(&map(&[("sluice_task", "t"), ("k", &long)]))
        else {
            panic!()
        };
        assert!(key.starts_with("sha256:") && key.len() == 7 + 64, "{key}");
    }

    #[test]
    fn timers_take_only_the_due_buckets_in_order() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut t = Timers::default();
        assert_eq!(t.next(), None);
        for n in 0..1_000u64 {
            t.set(n, Some(ms(1_000 + n)));
        }
        t.set(7, Some(ms(5)));
        t.set(3, Some(ms(2)));
        t.set(3, Some(ms(4))); // moved: its old time is gone
        t.set(9, None); // cleared
        assert_eq!(t.next(), Some(ms(4)));
        assert_eq!(t.due(ms(3)), Vec::<u64>::new());
        assert_eq!(t.due(ms(5)), vec![3, 7]);
        assert_eq!(t.due(ms(5)), Vec::<u64>::new(), "taken once");
        assert_eq!(t.due(ms(1_002)), vec![0, 1, 2]);
        assert_eq!(t.due(ms(1_009)), vec![4, 5, 6, 8]);
        assert_eq!(t.by_time.len(), t.at.len());
        assert_eq!(t.at.len(), 1_000 - 10);
    }

    #[test]
    fn successive_token_buckets_differ() {
        assert_ne!(token_bucket(5, 1), token_bucket(5, 2));
        assert_eq!(token_bucket(5, 1), token_bucket(5, 3));
        let Strategy::TokenBucket(tb) = token_bucket(u64::MAX, 0) else {
            panic!()
        };
        assert_eq!(tb.max_tokens, u32::MAX);
    }
}
