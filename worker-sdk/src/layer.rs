//! A tower [`Layer`]: put a Sluice task in front of any `http` service (axum, tonic, hyper).
//!
//! ```no_run
//! # async fn demo(task: sluice::Task) {
//! use sluice::layer::{KeyExtractor, SluiceLayer};
//! use tower::ServiceBuilder;
//! let svc = ServiceBuilder::new()
//!     .layer(
//!         SluiceLayer::new(task)
//!             .key(KeyExtractor::header("x-api-key"))     // a limit per API key (keyed task)
//!             .cost(|req| if req.method == http::Method::POST { 5 } else { 1 }),
//!     )
//!     .service(tower::service_fn(|_req: http::Request<String>| async {
//!         Ok::<_, std::convert::Infallible>(http::Response::new(String::from("hello")))
//!     }));
//! # }
//! ```
//!
//! # What it does per request
//!
//! 1. The **key** ([`KeyExtractor`]: a header, a path segment, the peer IP, or a closure) picks
//!    the limit: `task.key(k)` on a keyed task (on a task that is not keyed a key decides on
//!    the task as a whole). Without an extractor every request decides on the task. A request
//!    without a key gets [`MissingKey`] (default: rejected with 400, nothing charged).
//! 2. The **cost** (a closure of the request head, default 1) is the number of permits asked
//!    for, with `acquire` (which may wait briefly for a refill, at most the client's acquire
//!    timeout). A cost of 0 is admitted without a decision. A cost above what any slice can
//!    hold ([`sluice_protocol::MAX_COUNT`]) is refused at the door with
//!    [`RejectReason::TooLarge`] (HTTP `413`, no `Retry-After`) and counted nowhere; one above
//!    the current slice's cap is limited like any other rejection.
//! 3. **Rejected**: the inner service is not called; the answer is built by the rejection
//!    builder from a [`Rejection`] (default [`DefaultReject`]: HTTP `429` with `Retry-After`,
//!    `RateLimit-Policy` and `RateLimit`; a gRPC caller gets a trailers-only
//!    `RESOURCE_EXHAUSTED` instead, see [`reject`]).
//! 4. **Admitted**: the inner service answers; its response gets `RateLimit-Policy` and
//!    `RateLimit` (see [`fields`] for the syntax, the rounding and what `r` means), and the
//!    outcome is reported to the task's health counters (a 5xx response or an inner error is
//!    a failure, with the inner service's latency).
//!
//! `Retry-After` is whole seconds rounded up (at least 1: a 100 ms slice answers
//! `Retry-After: 1`); the precise time is in the `RateLimit` field's `sluice-reset-ms`.
//!
//! For a task in mode `concurrency` each request holds one permit ([`Task::permit`], waiting
//! at most the client's acquire timeout) until the inner service's response future has
//! resolved (a streamed body is not covered); no permit means a rejection with
//! `Retry-After: 1` (keys and costs do not apply: one request, one permit).

pub mod fields;
pub mod key;
pub mod reject;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{HeaderValue, Request, Response, StatusCode, header};
use tower::{Layer, Service};

pub use fields::{LimitInfo, QuotaUnit, ceil_secs, retry_after_secs};
pub use key::{KeyExtractor, MissingKey};
pub use reject::{DefaultReject, Reject, RejectReason, RejectWith, Rejection, is_grpc};

use crate::health::Outcome;
use crate::protocol::Mode;
use crate::shm::{FastMeta, tag_of, unpack_quota};
use crate::state::Health;
use crate::{Decision, Task};
use key::Cost;

/// Adds a Sluice task to a service (see the module docs). `R` builds rejections.
#[derive(Debug, Clone)]
pub struct SluiceLayer<R = DefaultReject> {
    cfg: Arc<Settings>,
    reject: R,
}

/// Everything but the rejection builder.
#[derive(Debug)]
struct Settings {
    task: Task,
    key: Option<KeyExtractor>,
    cost: Cost,
    missing: MissingKey,
    policy: Option<String>,
}

impl SluiceLayer {
    /// Limits requests with `task`: one permit per request, no key, default rejections.
    pub fn new(task: Task) -> Self {
        Self {
            cfg: Arc::new(Settings {
                task,
                key: None,
                cost: Cost::default(),
                missing: MissingKey::default(),
                policy: None,
            }),
            reject: DefaultReject,
        }
    }
}

impl<R> SluiceLayer<R> {
    fn settings(&mut self) -> &mut Settings {
        // Builders run before the layer is cloned into services; a clone made earlier keeps
        // its settings.
        if Arc::get_mut(&mut self.cfg).is_none() {
            let c = &self.cfg;
            self.cfg = Arc::new(Settings {
                task: c.task.clone(),
                key: c.key.clone(),
                cost: c.cost.clone(),
                missing: c.missing.clone(),
                policy: c.policy.clone(),
            });
        }
        Arc::get_mut(&mut self.cfg).expect("just made unique")
    }

    /// Decides each request under the key `extractor` finds in it.
    pub fn key(mut self, extractor: KeyExtractor) -> Self {
        self.settings().key = Some(extractor);
        self
    }

    /// What a request without a key gets (default [`MissingKey::Reject`]: 400).
    pub fn on_missing_key(mut self, m: MissingKey) -> Self {
        self.settings().missing = m;
        self
    }

    /// The permits a request costs, from its head (default: 1).
    pub fn cost<F>(mut self, f: F) -> Self
    where
        F: Fn(&http::request::Parts) -> u64 + Send + Sync + 'static,
    {
        self.settings().cost = Cost::from_fn(f);
        self
    }

    /// The policy name in the RateLimit fields (default: the task's name).
    pub fn policy_name(mut self, name: impl Into<String>) -> Self {
        self.settings().policy = Some(name.into());
        self
    }

    /// Builds rejections with `f` instead of [`DefaultReject`] (its body type must be the
    /// inner service's). [`Rejection::default_response`] and [`Rejection::apply_headers`] help
    /// to stay close to the default.
    ///
    /// ```
    /// # fn demo(task: sluice::Task) {
    /// let layer = sluice::layer::SluiceLayer::new(task).on_reject(|r: &sluice::layer::Rejection| {
    ///     let mut res = http::Response::new(format!("{{\"error\":\"slow down\",\"cost\":{}}}", r.cost));
    ///     *res.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
    ///     r.apply_headers(res.headers_mut());
    ///     res
    /// });
    /// # }
    /// ```
    pub fn on_reject<F, B>(self, f: F) -> SluiceLayer<RejectWith<F>>
    where
        F: Fn(&Rejection) -> Response<B> + Send + Sync + 'static,
    {
        SluiceLayer {
            cfg: self.cfg,
            reject: RejectWith(Arc::new(f)),
        }
    }
}

impl<S, R: Clone> Layer<S> for SluiceLayer<R> {
    type Service = SluiceService<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        SluiceService {
            inner,
            cfg: self.cfg.clone(),
            reject: self.reject.clone(),
        }
    }
}

/// The service made by [`SluiceLayer`].
#[derive(Debug, Clone)]
pub struct SluiceService<S, R = DefaultReject> {
    inner: S,
    cfg: Arc<Settings>,
    reject: R,
}

/// A `429 Too Many Requests` with `Retry-After` (seconds, rounded up, at least 1).
pub fn too_many_requests<B: Default>(retry_after: Option<Duration>) -> Response<B> {
    let secs = retry_after_secs(retry_after.unwrap_or(Duration::from_secs(1)));
    let mut r = Response::new(B::default());
    *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

/// Why a request could not be decided under a key.
#[derive(Debug)]
enum KeyRefused {
    /// The task refused the key (longer than 256 bytes).
    Bad,
}

/// The one place the layer decides. `key = None`: on the task as a whole; a key decides with
/// `task.key(k)` (on a task that is not keyed, a key decides on the task as a whole).
async fn decide(
    task: &Task,
    key: Option<&str>,
    cost: u64,
) -> Result<(Decision, Option<crate::Key>), KeyRefused> {
    if cost == 0 {
        return Ok((Decision::Allowed, None));
    }
    let Some(k) = key else {
        return Ok((task.acquire(cost).await, None));
    };
    match task.key(k) {
        Ok(h) => Ok((h.acquire(cost).await, Some(h))),
        Err(crate::Error::Name(_)) => Err(KeyRefused::Bad),
        Err(e) => {
            // The host's key table cannot be opened: not the caller's fault, and it stays so
            // (the error is kept). The task's own limit still applies.
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(task = %task.name(), error = %e,
                    "layer: no key table, deciding keyed requests on the task as a whole");
            }
            Ok((task.acquire(cost).await, None))
        }
    }
}

impl<S, R, ReqB, ResB> Service<Request<ReqB>> for SluiceService<S, R>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    R: Reject<ResB>,
    ReqB: Send + 'static,
    ResB: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResB>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The clone that was polled ready serves this request (the usual tower idiom).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        let reject = self.reject.clone();
        Box::pin(async move {
            let task = &cfg.task;
            let (parts, body) = req.into_parts();
            let grpc = is_grpc(&parts.headers);
            let policy = cfg.policy.as_deref().unwrap_or(task.name());
            let meta = task.meta();
            if meta.as_ref().is_some_and(|m| m.mode == Mode::Concurrency) {
                let req = Request::from_parts(parts, body);
                let permit = match task.permit().await {
                    Ok(p) => p,
                    Err(e) => {
                        let r = Rejection {
                            reason: RejectReason::NoPermit(e),
                            limit: task.limit_info(policy, None, false, None),
                            retry_after: Some(Duration::from_secs(1)),
                            key: None,
                            cost: 1,
                            grpc,
                        };
                        return Ok(reject.reject(&r));
                    }
                };
                let limit = task.limit_info(policy, None, true, None);
                let mut res = inner.call(req).await;
                drop(permit);
                if let (Ok(res), Some(l)) = (&mut res, limit) {
                    l.apply(res.headers_mut());
                }
                return res;
            }
            let cost = cfg.cost.of(&parts);
            if cost > sluice_protocol::MAX_COUNT {
                // No slice can ever hold it: refused at the door, decided and counted nowhere.
                return Ok(reject.reject(&too_large(
                    task,
                    policy,
                    cost,
                    sluice_protocol::MAX_COUNT,
                    grpc,
                )));
            }
            let key = match &cfg.key {
                None => None,
                Some(x) => match (x.extract(&parts), &cfg.missing) {
                    (Some(k), _) => Some(k),
                    (None, MissingKey::WholeTask) => None,
                    (None, MissingKey::Key(k)) => Some(k.clone()),
                    (None, MissingKey::Reject) => {
                        return Ok(reject.reject(&missing(cost, grpc)));
                    }
                },
            };
            let (d, handle) = match decide(task, key.as_deref(), cost).await {
                Ok(d) => d,
                Err(KeyRefused::Bad) => {
                    let mut r = missing(cost, grpc);
                    r.key = key;
                    return Ok(reject.reject(&r));
                }
            };
            if let Decision::TooLarge { max } = d {
                let mut r = too_large(task, policy, cost, max, grpc);
                r.key = key;
                return Ok(reject.reject(&r));
            }
            if !d.is_allowed() {
                let retry = d.retry_after().unwrap_or(Duration::from_secs(1));
                let r = Rejection {
                    reason: RejectReason::Limited(d),
                    limit: task.limit_info(policy, Some(retry), false, handle.as_ref()),
                    retry_after: Some(retry),
                    key,
                    cost,
                    grpc,
                };
                return Ok(reject.reject(&r));
            }
            let limit = task.limit_info(policy, None, true, handle.as_ref());
            let started = Instant::now();
            let mut res = inner.call(Request::from_parts(parts, body)).await;
            let failed = match &mut res {
                Ok(r) => {
                    if let Some(l) = limit {
                        l.apply(r.headers_mut());
                    }
                    r.status().is_server_error()
                }
                Err(_) => true,
            };
            let outcome = if failed { Outcome::Err } else { Outcome::Ok };
            task.report(outcome, started.elapsed());
            res
        })
    }
}

/// A cost above what a slice can hold: no `Retry-After` (a retry fails the same way).
fn too_large(task: &Task, policy: &str, cost: u64, max: u64, grpc: bool) -> Rejection {
    Rejection {
        reason: RejectReason::TooLarge { max },
        limit: task.limit_info(policy, None, false, None),
        retry_after: None,
        key: None,
        cost,
        grpc,
    }
}

fn missing(cost: u64, grpc: bool) -> Rejection {
    Rejection {
        reason: RejectReason::MissingKey,
        limit: None,
        retry_after: None,
        key: None,
        cost,
        grpc,
    }
}

/// Read-only views the layer needs (kept here, beside their only user).
impl Task {
    /// The RateLimit fields for a decision just made: `reset` = `Some(retry)` after a
    /// rejection, else the end of the current slice; `admitted` says whether `r` may be the
    /// host's local quota (after a rejection it is 0). `None` while the meta is unknown.
    ///
    /// For a key of a keyed task, `q` is the key's cap as Redis last answered this host (its
    /// override, schedules and dynamic limiting included; the task's threshold until known)
    /// and `r` what the host holds of the key's slice.
    ///
    /// Public for other front ends of the host's quota (the `sluice-agent`'s Envoy answers).
    pub fn limit_info(
        &self,
        policy: &str,
        reset: Option<Duration>,
        admitted: bool,
        key: Option<&crate::Key>,
    ) -> Option<LimitInfo> {
        let m = self.meta()?;
        let view = key
            .filter(|_| m.keyed)
            .and_then(|k| k.local_view(self.now_us()));
        let per_key = key.is_some() && m.keyed;
        if m.mode == Mode::Concurrency {
            let remaining = match (admitted, self.permit_stats()) {
                (true, Some(s)) => s.limit.saturating_sub(s.in_use),
                _ => 0,
            };
            return Some(LimitInfo {
                policy: policy.to_string(),
                limit: m.threshold,
                window_ms: 0,
                remaining,
                reset: None,
                unit: QuotaUnit::ConcurrentRequests,
            });
        }
        let now_us = self.now_us();
        let slice_ms = m.slice_ms.max(1);
        let start_ms = crate::protocol::slice::start(now_us.div_euclid(1_000), slice_ms);
        let end_us = (start_ms + slice_ms as i64) * 1_000;
        let reset = reset.unwrap_or(Duration::from_micros((end_us - now_us).max(0) as u64));
        let (limit, remaining) = match view {
            Some((cap, held)) if per_key => (
                if cap > 0 { cap } else { m.threshold },
                if admitted { held } else { 0 },
            ),
            _ if per_key => (m.threshold, 0),
            _ => (
                m.threshold,
                if admitted {
                    self.held_quota(start_ms)
                } else {
                    0
                },
            ),
        };
        Some(LimitInfo {
            policy: policy.to_string(),
            limit,
            window_ms: m.slice_ms,
            remaining,
            reset: Some(reset),
            unit: QuotaUnit::Requests,
        })
    }

    /// The permits this host holds in shared memory for the pooled slice starting at
    /// `start_ms` (0 when it holds none, is FAILED, or the task is not pooled).
    fn held_quota(&self, start_ms: i64) -> u64 {
        let r = self.inner.slot_ref();
        let Some(slot) = self.shared.seg.slot(r.index) else {
            return 0;
        };
        let Some(m) = FastMeta::decode(slot.meta.fast.load(Ordering::Acquire)) else {
            return 0;
        };
        if m.generation != r.generation || m.mode != Mode::Pooled {
            return 0;
        }
        if let Health::Failed { .. } = Health::decode(slot.ctl.state.load(Ordering::Acquire)) {
            return 0;
        }
        let (tag, _, count) = unpack_quota(
            slot.entry(start_ms, m.slice_ms)
                .word
                .load(Ordering::Acquire),
        );
        if tag == tag_of(start_ms) {
            count as u64
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use tower::{ServiceBuilder, ServiceExt};

    use super::*;
    use crate::protocol::{Fallback, FallbackAlgorithm, Mode, OnFailure, TaskMeta};
    use crate::{Client, Config};

    /// A client whose Redis does not exist: the task's meta is put into the segment directly.
    fn task(dir: &std::path::Path, local_limit: u64) -> (Client, Task) {
        task_in(dir, local_limit, Mode::Local, OnFailure::Deny)
    }

    fn task_in(
        dir: &std::path::Path,
        local_limit: u64,
        mode: Mode,
        on_failure: OnFailure,
    ) -> (Client, Task) {
        let mut cfg = Config::new("redis://127.0.0.1:1");
        cfg.shm_dir = dir.to_path_buf();
        cfg.host_id = "layer".into();
        let c = Client::new(cfg).unwrap();
        let t = c.task("api").unwrap();
        let (seg, _) = crate::shm::Segment::open(c.segment_path(), 1).unwrap();
        let slot = seg.slot(seg.find("api").unwrap()).unwrap();
        slot.store_meta(
            &TaskMeta {
                slice_ms: 60_000,
                threshold: 1,
                pull: 0,
                local_limit,
                on_failure,
                mode,
                fallback: Fallback {
                    algorithm: FallbackAlgorithm::FixedWindow,
                    burst: 0,
                },
                version: 1,
                lease_ms: 0,
                keyed: false,
                key_overrides: Default::default(),
                shadow: false,
                pacing: crate::protocol::Pacing::None,
                pace_burst: 0,
            },
            slot.generation(),
        );
        (c, t)
    }

    /// No Redis: the concurrency task is FAILED at once, `on_failure = local` allows
    /// `local_limit` = 1 request in flight.
    #[tokio::test]
    async fn a_concurrency_task_holds_one_permit_per_request_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let (_c, t) = task_in(dir.path(), 1, Mode::Concurrency, OnFailure::Local);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let rx = std::sync::Arc::new(tokio::sync::Mutex::new(Some(rx)));
        let svc = ServiceBuilder::new()
            .layer(SluiceLayer::new(t.clone()))
            .service(tower::service_fn(move |_req: Request<String>| {
                let rx = rx.clone();
                async move {
                    if let Some(rx) = rx.lock().await.take() {
                        let _ = rx.await;
                    }
                    Ok::<_, Infallible>(Response::new("ok".to_string()))
                }
            }));
        let first = tokio::spawn(svc.clone().oneshot(Request::new(String::new())));
        // The first request holds the one permit while the inner service waits.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while t.permit_stats().is_none_or(|s| s.in_use == 0) {
            assert!(
                std::time::Instant::now() < deadline,
                "first request never admitted"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let second = svc
            .clone()
            .oneshot(Request::new(String::new()))
            .await
            .unwrap();
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
        tx.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
        assert_eq!(t.permit_stats().unwrap().in_use, 0);
        let third = svc.oneshot(Request::new(String::new())).await.unwrap();
        assert_eq!(third.status(), StatusCode::OK);
        // Permits in flight: a unit, no window, no reset.
        assert_eq!(
            third.headers()[fields::RATELIMIT_POLICY],
            r#""api";q=1;qu="concurrent-requests""#
        );
        let limit = third.headers()[fields::RATELIMIT].to_str().unwrap();
        assert!(
            limit.starts_with(r#""api";r="#) && !limit.contains(";t="),
            "{limit}"
        );
        assert_eq!(second.headers()[header::RETRY_AFTER], "1");
        assert_eq!(second.headers()[fields::RATELIMIT], r#""api";r=0"#);
    }

    #[tokio::test]
    async fn rejects_with_429_and_retry_after() {
        let dir = tempfile::tempdir().unwrap();
        let (_c, t) = task(dir.path(), 2);
        let svc = ServiceBuilder::new()
            .layer(SluiceLayer::new(t.clone()))
            .service(tower::service_fn(|_req: Request<String>| async {
                Ok::<_, Infallible>(Response::new("ok".to_string()))
            }));
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let r = svc
                .clone()
                .oneshot(Request::new(String::new()))
                .await
                .unwrap();
            statuses.push(r.status());
            if r.status() == StatusCode::TOO_MANY_REQUESTS {
                let secs: u64 = r.headers()[header::RETRY_AFTER]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!((1..=60).contains(&secs), "{secs}");
                assert_eq!(r.body(), "");
                let limit = r.headers()[fields::RATELIMIT].to_str().unwrap();
                assert!(
                    limit.starts_with(&format!(r#""api";r=0;t={secs};sluice-reset-ms="#)),
                    "{limit}"
                );
            } else {
                // Mode local holds no countable pooled quota: r = 0.
                let limit = r.headers()[fields::RATELIMIT].to_str().unwrap();
                assert!(limit.starts_with(r#""api";r=0;t="#), "{limit}");
            }
            assert_eq!(r.headers()[fields::RATELIMIT_POLICY], r#""api";q=1;w=60"#);
        }
        assert_eq!(
            statuses,
            [
                StatusCode::OK,
                StatusCode::OK,
                StatusCode::TOO_MANY_REQUESTS
            ]
        );
        assert_eq!(
            too_many_requests::<String>(Some(Duration::from_millis(1_001))).headers()
                [header::RETRY_AFTER],
            "2"
        );
    }
}
