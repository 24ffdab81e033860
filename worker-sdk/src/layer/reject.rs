//! The answer to a request the layer does not let through: [`Rejection`] says why, a
//! [`Reject`] builds the response ([`DefaultReject`] unless [`super::SluiceLayer::on_reject`]
//! gives a closure).
//!
//! The default answer:
//!
//! | caller | limited | cost above what a slice can hold | no key (`MissingKey::Reject`) |
//! |---|---|---|---|
//! | HTTP | `429`, `Retry-After`, `RateLimit-Policy`, `RateLimit`, empty body | `413`, `RateLimit-Policy` when known, no `Retry-After` | `400`, empty body |
//! | gRPC (`content-type: application/grpc*`) | HTTP `200` trailers-only: `grpc-status: 8` (`RESOURCE_EXHAUSTED`), `grpc-message`, the same three rate-limit fields as metadata | `grpc-status: 8`, no retry | `grpc-status: 3` (`INVALID_ARGUMENT`) |
//!
//! A trailers-only gRPC answer is a HEADERS frame that ends the stream: the response has an
//! empty body (`B::default()`), which hyper sends as headers with END_STREAM.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};

use super::fields::{LimitInfo, retry_after_secs};
use crate::{Decision, PermitError};

/// Why a request was not let through.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// The task (or the request's key) refused the permits: [`Decision::Limited`] or
    /// [`Decision::FallbackDenied`].
    Limited(Decision),
    /// Mode `concurrency`: no permit within the client's acquire timeout.
    NoPermit(PermitError),
    /// The request has no key (or one the task refuses), under `MissingKey::Reject`.
    MissingKey,
    /// The request's cost is more than any slice can ever admit (above
    /// [`sluice_protocol::MAX_COUNT`], refused at the layer's door, or [`Decision::TooLarge`]):
    /// never decided or counted; a retry would fail the same way.
    TooLarge {
        /// The most a slice could admit at once.
        max: u64,
    },
}

/// Everything the layer knows about a rejected request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    /// Why.
    pub reason: RejectReason,
    /// The limit decided against (`None` for [`RejectReason::MissingKey`], and while the task's
    /// meta is not known on this host yet).
    pub limit: Option<LimitInfo>,
    /// When a retry may succeed, precisely (`Retry-After` is this, rounded up to whole
    /// seconds, at least 1). `None` for [`RejectReason::MissingKey`].
    pub retry_after: Option<Duration>,
    /// The request's key, when it had one.
    pub key: Option<String>,
    /// The permits the request asked for.
    pub cost: u64,
    /// Whether the caller speaks gRPC (request `content-type: application/grpc*`).
    pub grpc: bool,
}

impl Rejection {
    /// `Retry-After`, `RateLimit-Policy` and `RateLimit` (what they are known of).
    pub fn apply_headers(&self, headers: &mut HeaderMap) {
        if let Some(d) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs(d)));
        }
        if let Some(l) = &self.limit {
            l.apply(headers);
        }
    }

    /// The default answer (see the module docs): HTTP 429 / 400, or a gRPC trailers-only
    /// `RESOURCE_EXHAUSTED` / `INVALID_ARGUMENT`. A custom builder can start from it.
    pub fn default_response<B: Default>(&self) -> Response<B> {
        let mut r = Response::new(B::default());
        self.apply_headers(r.headers_mut());
        let missing = self.reason == RejectReason::MissingKey;
        let too_large = matches!(self.reason, RejectReason::TooLarge { .. });
        if self.grpc {
            let (code, msg) = if missing {
                (GRPC_INVALID_ARGUMENT, "request has no rate-limit key")
            } else if too_large {
                (
                    GRPC_RESOURCE_EXHAUSTED,
                    "request costs more than the rate limit ever admits",
                )
            } else {
                (GRPC_RESOURCE_EXHAUSTED, "rate limit exceeded")
            };
            let h = r.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            h.insert("grpc-status", HeaderValue::from(code));
            h.insert("grpc-message", HeaderValue::from_static(msg));
        } else {
            *r.status_mut() = if missing {
                StatusCode::BAD_REQUEST
            } else if too_large {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::TOO_MANY_REQUESTS
            };
        }
        r
    }
}

/// gRPC status code `RESOURCE_EXHAUSTED`.
pub const GRPC_RESOURCE_EXHAUSTED: u16 = 8;
/// gRPC status code `INVALID_ARGUMENT`.
pub const GRPC_INVALID_ARGUMENT: u16 = 3;

/// Builds the response to a rejected request.
pub trait Reject<B>: Clone + Send + Sync + 'static {
    /// The response.
    fn reject(&self, r: &Rejection) -> Response<B>;
}

/// [`Rejection::default_response`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultReject;

impl<B: Default> Reject<B> for DefaultReject {
    fn reject(&self, r: &Rejection) -> Response<B> {
        r.default_response()
    }
}

/// A closure as a [`Reject`] (made by [`super::SluiceLayer::on_reject`]).
pub struct RejectWith<F>(pub(super) Arc<F>);

impl<F> Clone for RejectWith<F> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<F> std::fmt::Debug for RejectWith<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RejectWith(..)")
    }
}

impl<B, F> Reject<B> for RejectWith<F>
where
    F: Fn(&Rejection) -> Response<B> + Send + Sync + 'static,
{
    fn reject(&self, r: &Rejection) -> Response<B> {
        (self.0)(r)
    }
}

/// Whether a request comes from a gRPC client (`content-type: application/grpc`, `+proto`, …).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.len() >= 16
                && v[..16].eq_ignore_ascii_case("application/grpc")
                && matches!(v.as_bytes().get(16), None | Some(b'+') | Some(b';'))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_content_types() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::CONTENT_TYPE, HeaderValue::from_str(v).unwrap());
            is_grpc(&m)
        };
        assert!(h("application/grpc"));
        assert!(h("application/grpc+proto"));
        assert!(h("Application/GRPC;charset=utf-8"));
        assert!(!h("application/grpc-web"));
        assert!(!h("application/json"));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn default_answers() {
        let mut r = Rejection {
            reason: RejectReason::Limited(Decision::Limited {
                retry_after: Duration::from_millis(30),
            }),
            limit: None,
            retry_after: Some(Duration::from_millis(30)),
            key: None,
            cost: 1,
            grpc: false,
        };
        let h: Response<String> = r.default_response();
        assert_eq!(h.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(h.headers()[header::RETRY_AFTER], "1");
        r.grpc = true;
        let g: Response<String> = r.default_response();
        assert_eq!(g.status(), StatusCode::OK);
        assert_eq!(g.headers()["grpc-status"], "8");
        assert_eq!(g.headers()[header::CONTENT_TYPE], "application/grpc");
        r.reason = RejectReason::MissingKey;
        r.retry_after = None;
        let g: Response<String> = r.default_response();
        assert_eq!(g.headers()["grpc-status"], "3");
        assert!(g.headers().get(header::RETRY_AFTER).is_none());
        r.grpc = false;
        let h: Response<String> = r.default_response();
        assert_eq!(h.status(), StatusCode::BAD_REQUEST);
    }
}
