//! A tower [`Layer`]: put a Sluice task in front of any `http` service (axum, tonic, hyper).
//!
//! ```no_run
//! # async fn demo(task: sluice::Task) {
//! use tower::ServiceBuilder;
//! let svc = ServiceBuilder::new()
//!     .layer(sluice::layer::SluiceLayer::new(task))
//!     .service(tower::service_fn(|_req: http::Request<String>| async {
//!         Ok::<_, std::convert::Infallible>(http::Response::new(String::from("hello")))
//!     }));
//! # }
//! ```
//!
//! Each request asks for one permit with [`Task::acquire`] (which may wait briefly for a
//! refill). A rejected request never reaches the inner service: it is answered with
//! `429 Too Many Requests` and a `Retry-After` header (whole seconds, at least 1). Admitted
//! requests are reported to the task's health counters: a 5xx response or an inner error
//! counts as a failure, with the inner service's latency.
//!
//! For a task in mode `concurrency` each request holds one permit ([`Task::permit`], waiting
//! at most the client's acquire timeout) until the inner service's response future has
//! resolved (a streamed body is not covered); no permit means `429` with `Retry-After: 1`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use http::{HeaderValue, Request, Response, StatusCode, header};
use tower::{Layer, Service};

use crate::Task;
use crate::health::Outcome;

/// Adds a Sluice task to a service.
#[derive(Debug, Clone)]
pub struct SluiceLayer {
    task: Task,
}

impl SluiceLayer {
    /// Limits requests with `task`.
    pub fn new(task: Task) -> Self {
        Self { task }
    }
}

impl<S> Layer<S> for SluiceLayer {
    type Service = SluiceService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SluiceService {
            inner,
            task: self.task.clone(),
        }
    }
}

/// The service made by [`SluiceLayer`].
#[derive(Debug, Clone)]
pub struct SluiceService<S> {
    inner: S,
    task: Task,
}

/// A `429 Too Many Requests` with `Retry-After` (seconds, rounded up, at least 1).
pub fn too_many_requests<B: Default>(retry_after: Option<std::time::Duration>) -> Response<B> {
    let secs = retry_after
        .map(|d| d.as_millis().div_ceil(1_000).max(1) as u64)
        .unwrap_or(1);
    let mut r = Response::new(B::default());
    *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    r
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for SluiceService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqB: Send + 'static,
    ResB: Default + Send + 'static,
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
        let task = self.task.clone();
        Box::pin(async move {
            if task
                .meta()
                .is_some_and(|m| m.mode == crate::protocol::Mode::Concurrency)
            {
                let Ok(permit) = task.permit().await else {
                    return Ok(too_many_requests(None));
                };
                let res = inner.call(req).await;
                drop(permit);
                return res;
            }
            let d = task.acquire(1).await;
            if !d.is_allowed() {
                return Ok(too_many_requests(d.retry_after()));
            }
            let started = Instant::now();
            let res = inner.call(req).await;
            let failed = match &res {
                Ok(r) => r.status().is_server_error(),
                Err(_) => true,
            };
            let outcome = if failed { Outcome::Err } else { Outcome::Ok };
            task.report(outcome, started.elapsed());
            res
        })
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
            }
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
