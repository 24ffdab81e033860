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
