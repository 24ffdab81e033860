//! Which key a request is limited under ([`KeyExtractor`]) and what it costs ([`Cost`]).
//!
//! An extractor looks at the request head (`http::request::Parts`: method, URI, headers,
//! extensions) and answers a key or nothing. Nothing (no header, a value that is not visible
//! ASCII, no such path segment, no peer address) is a *missing* key, handled by
//! [`MissingKey`]. A key longer than 256 bytes is refused by the task (it is a bad key, answered
//! like a missing one under `MissingKey::Reject`).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use http::request::Parts;

type KeyFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Picks the key a request is limited under.
#[derive(Clone)]
pub struct KeyExtractor {
    f: Arc<KeyFn>,
    what: String,
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

impl KeyExtractor {
    /// The first value of header `name` (e.g. `x-api-key`), when it is non-empty visible
    /// ASCII. An invalid header name is a key that is always missing.
    ///
    /// ```
    /// use sluice::layer::KeyExtractor;
    /// let k = KeyExtractor::header("x-api-key");
    /// let (parts, ()) = http::Request::get("/").header("x-api-key", "k1").body(()).unwrap().into_parts();
    /// assert_eq!(k.extract(&parts).as_deref(), Some("k1"));
    /// ```
    pub fn header(name: &str) -> Self {
        let name = http::HeaderName::from_bytes(name.as_bytes()).ok();
        let what = format!("header({name:?})");
        Self::new(what, move |p: &Parts| {
            let v = p.headers.get(name.as_ref()?)?.to_str().ok()?;
            (!v.is_empty()).then(|| v.to_string())
        })
    }

    /// Path segment `index` (0-based, empty segments skipped, percent-encoding kept as sent):
    /// for `/v1/tenants/acme/orders`, segment 2 is `acme`.
    ///
    /// ```
    /// use sluice::layer::KeyExtractor;
    /// let k = KeyExtractor::path_segment(2);
    /// let (parts, ()) = http::Request::get("/v1/tenants/acme/orders?x=1").body(()).unwrap().into_parts();
    /// assert_eq!(k.extract(&parts).as_deref(), Some("acme"));
    /// ```
    pub fn path_segment(index: usize) -> Self {
        Self::new(format!("path_segment({index})"), move |p: &Parts| {
            p.uri
                .path()
                .split('/')
                .filter(|s| !s.is_empty())
                .nth(index)
                .map(str::to_string)
        })
    }

    /// The peer's IP address (no port: one client opens many connections), e.g.
    /// `127.0.0.1` or `::1`. Read from the request's extensions: a `std::net::SocketAddr`, or
    /// with the crate feature `axum`, axum's `ConnectInfo<SocketAddr>` (serve with
    /// `into_make_service_with_connect_info::<SocketAddr>()`). Behind a proxy the peer is the
    /// proxy: use [`KeyExtractor::header`] on the header it sets instead.
    pub fn peer_ip() -> Self {
        Self::new("peer_ip".into(), |p: &Parts| {
            peer(&p.extensions).map(|a| a.ip().to_string())
        })
    }

    /// Any function of the request head.
    ///
    /// ```
    /// use sluice::layer::KeyExtractor;
    /// let k = KeyExtractor::from_fn(|p| Some(format!("{}:{}", p.method, p.uri.path())));
    /// let (parts, ()) = http::Request::post("/orders").body(()).unwrap().into_parts();
    /// assert_eq!(k.extract(&parts).as_deref(), Some("POST:/orders"));
    /// ```
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        Self::new("from_fn".into(), f)
    }

    /// This extractor's key, hashed: the first 16 bytes of its SHA-256 as 32 hex digits.
    /// Use it when the key is a credential (an API key, a session token): the key never
    /// leaves the process as it came (not in the host's shared key table, not in Redis), yet
    /// each credential still has its own limit. (The top keys the API shows are keyed digests
    /// anyway unless the task sets `clear_keys`; see docs/sdk.md.)
    ///
    /// ```
    /// use sluice::layer::KeyExtractor;
    /// let k = KeyExtractor::header("x-api-key").hashed();
    /// let (parts, ()) = http::Request::get("/").header("x-api-key", "sk_live_123").body(()).unwrap().into_parts();
    /// let key = k.extract(&parts).unwrap();
    /// assert_eq!(key.len(), 32);
    /// assert!(!key.contains("sk_live"));
    /// assert_eq!(key, sluice::protocol::key_digest("sk_live_123"));
    /// ```
    pub fn hashed(self) -> Self {
        let what = format!("hashed({})", self.what);
        let inner = self.f;
        Self::new(what, move |p: &Parts| {
            inner(p).map(|k| crate::protocol::key_digest(&k))
        })
    }

    fn new<F>(what: String, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        Self {
            f: Arc::new(f),
            what,
        }
    }

    /// The key of a request, or `None` when it has none.
    pub fn extract(&self, parts: &Parts) -> Option<String> {
        (self.f)(parts)
    }
}

fn peer(ext: &http::Extensions) -> Option<SocketAddr> {
    if let Some(a) = ext.get::<SocketAddr>() {
        return Some(*a);
    }
    #[cfg(feature = "axum")]
    if let Some(a) = ext.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(a.0);
    }
    None
}

/// What a request without a key (or with a key the task refuses: longer than 256 bytes) gets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// The default: rejected without a decision, `400 Bad Request` (gRPC `INVALID_ARGUMENT`),
    /// through the rejection builder with [`super::RejectReason::MissingKey`]. Nothing is
    /// charged. Chosen so that leaving the header out never escapes the per-key limit, and a
    /// misconfigured extractor shows at once instead of silently limiting nothing per key.
    #[default]
    Reject,
    /// Decided on the task as a whole (every keyless request shares the task's own limit).
    WholeTask,
    /// Decided under this one key (every keyless request shares it).
    Key(String),
}

type CostFn = dyn Fn(&Parts) -> u64 + Send + Sync;

/// How many permits a request costs (default: 1). A cost of 0 admits without a decision.
#[derive(Clone)]
pub struct Cost(Arc<CostFn>);

impl fmt::Debug for Cost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Cost(..)")
    }
}

impl Default for Cost {
    fn default() -> Self {
        Self::fixed(1)
    }
}

impl Cost {
    /// Every request costs `n`.
    pub fn fixed(n: u64) -> Self {
        Self(Arc::new(move |_| n))
    }

    /// A function of the request head, e.g. by method or by a declared size.
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&Parts) -> u64 + Send + Sync + 'static,
    {
        Self(Arc::new(f))
    }

    /// The cost of a request.
    pub fn of(&self, parts: &Parts) -> u64 {
        (self.0)(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(b: http::request::Builder) -> Parts {
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn header_values_must_be_visible_ascii_and_non_empty() {
        let k = KeyExtractor::header("X-Tenant");
        assert_eq!(
            k.extract(&parts(http::Request::get("/").header("x-tenant", "t1"))),
            Some("t1".into())
        );
        assert_eq!(
            k.extract(&parts(http::Request::get("/").header("x-tenant", ""))),
            None
        );
        let odd = http::HeaderValue::from_bytes(b"caf\xe9").unwrap();
        assert_eq!(
            k.extract(&parts(http::Request::get("/").header("x-tenant", odd))),
            None
        );
        assert_eq!(k.extract(&parts(http::Request::get("/"))), None);
        assert_eq!(
            KeyExtractor::header("bad header").extract(&parts(http::Request::get("/"))),
            None
        );
    }

    #[test]
    fn path_segments_skip_empty_ones() {
        let k = KeyExtractor::path_segment(1);
        assert_eq!(
            k.extract(&parts(http::Request::get("//a//b/c"))),
            Some("b".into())
        );
        assert_eq!(k.extract(&parts(http::Request::get("/a"))), None);
    }

    #[test]
    fn peer_ip_reads_a_socket_addr_extension() {
        let mut p = parts(http::Request::get("/"));
        assert_eq!(KeyExtractor::peer_ip().extract(&p), None);
        p.extensions
            .insert("[::1]:4000".parse::<SocketAddr>().unwrap());
        assert_eq!(KeyExtractor::peer_ip().extract(&p), Some("::1".into()));
    }

    #[test]
    fn cost_defaults_to_one() {
        let p = parts(http::Request::get("/"));
        assert_eq!(Cost::default().of(&p), 1);
        assert_eq!(Cost::from_fn(|p| p.uri.path().len() as u64).of(&p), 1);
    }
}
