//! What every request passes before its handler: authentication (`--api-token`) and the
//! bound on decision requests handled at once (`--max-concurrent-requests`), for the gRPC
//! listener as a tower layer around both services ([`GrpcGuardLayer`]); the HTTP listener's
//! twin is a middleware in [`crate::http`] built from the same pieces.
//!
//! The token is compared in constant time ([`Token::matches`]) and never logged, echoed or
//! counted: a refusal says only that a token is missing or wrong.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;
use tonic::codegen::http;

use crate::config::Token;
use crate::metrics::Metrics;

/// The gRPC method of RLS (a unary call: bounded by `--max-concurrent-requests`). RLQS streams
/// are bounded by `--rlqs-max-streams` in [`crate::rlqs`].
pub const RLS_METHOD: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Whether an `Authorization` header value carries `token` (`Bearer <token>`; the scheme's
/// case is ignored, as RFC 9110 says). Always true without a token.
pub fn authorized(token: Option<&Token>, header: Option<&http::HeaderValue>) -> bool {
    let Some(token) = token else {
        return true;
    };
    let Some(v) = header.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some((scheme, given)) = v.split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && token.matches(given.trim())
}

/// A permit of the decision requests handled at once, or `None` when all are taken.
pub fn admit(inflight: &Arc<Semaphore>) -> Option<OwnedSemaphorePermit> {
    inflight.clone().try_acquire_owned().ok()
}

/// The gRPC guard: token, then (RLS) a permit of `--max-concurrent-requests`.
#[derive(Clone)]
pub struct GrpcGuardLayer {
    token: Option<Token>,
    inflight: Arc<Semaphore>,
    limit: u32,
    metrics: Arc<Metrics>,
}

impl GrpcGuardLayer {
    /// A guard requiring `token` (if any), sharing `inflight` (of size `limit`) with HTTP.
    pub fn new(
        token: Option<Token>,
        inflight: Arc<Semaphore>,
        limit: u32,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            token,
            inflight,
            limit,
            metrics,
        }
    }
}

impl<S> tower::Layer<S> for GrpcGuardLayer {
    type Service = GrpcGuard<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcGuard {
            inner,
            guard: self.clone(),
        }
    }
}

/// [`GrpcGuardLayer`] around a service.
#[derive(Clone)]
pub struct GrpcGuard<S> {
    inner: S,
    guard: GrpcGuardLayer,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for GrpcGuard<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let g = &self.guard;
        let api = if req.uri().path() == RLS_METHOD {
            "rls"
        } else {
            "rlqs"
        };
        if !authorized(
            g.token.as_ref(),
            req.headers().get(http::header::AUTHORIZATION),
        ) {
            g.metrics.error(api, "unauthenticated");
            let s = Status::unauthenticated(
                "this agent needs the metadata `authorization: Bearer <token>` (it runs with \
                 --api-token): missing or wrong",
            );
            return Box::pin(std::future::ready(Ok(s.into_http())));
        }
        let permit = if api == "rls" {
            match admit(&g.inflight) {
                Some(p) => Some(p),
                None => {
                    g.metrics.error(api, "busy");
                    let s = Status::resource_exhausted(format!(
                        "the agent is handling --max-concurrent-requests ({}) decision requests; \
                         retry",
                        g.limit
                    ));
                    return Box::pin(std::future::ready(Ok(s.into_http())));
                }
            }
        } else {
            None
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            drop(permit);
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        let t = Token::new("s3cret");
        let h = |v: &str| http::HeaderValue::from_str(v).unwrap();
        assert!(authorized(None, None));
        assert!(authorized(Some(&t), Some(&h("Bearer s3cret"))));
        assert!(authorized(Some(&t), Some(&h("bearer s3cret"))));
        assert!(!authorized(Some(&t), None));
        assert!(!authorized(Some(&t), Some(&h("Bearer s3cre"))));
        assert!(!authorized(Some(&t), Some(&h("Bearer s3cretX"))));
        assert!(!authorized(Some(&t), Some(&h("Basic s3cret"))));
        assert!(!authorized(Some(&t), Some(&h("s3cret"))));
        assert!(!authorized(Some(&t), Some(&h("Bearer"))));
    }
}
