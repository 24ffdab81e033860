//! The tower layer against a real manager and Redis, served in process (axum over HTTP/1.1,
//! tonic over HTTP/2):
//!
//! * admitted and rejected answers carry `RateLimit-Policy` / `RateLimit`, parsed per the
//!   draft's Structured Field syntax, and a rejection's `Retry-After` equals its `t`;
//! * a 100 ms slice answers `Retry-After: 1` (whole seconds, rounded up), the precise reset in
//!   `sluice-reset-ms`, and no `w` (sub-second windows are not expressible) but `sluice-w-ms`;
//! * a tonic client gets `RESOURCE_EXHAUSTED` with the rate-limit metadata;
//! * a custom rejection builder, each key extractor, the missing-key policies, the cost function.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use sluice::layer::{KeyExtractor, MissingKey, Rejection, SluiceLayer};
use sluice::{Client, Config, Task};
use sluice_tests::*;

// ---------------------------------------------------------------------------------------------
// A strict reader of the two fields (RFC 9651 List of Items whose bare item is a String).
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
enum Bare {
    Int(i64),
    Str(String),
}

/// One List member: `(name, params)`.
type Member = (String, BTreeMap<String, Bare>);

fn parse_list(v: &str) -> Result<Vec<Member>, String> {
    let b = v.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    let skip_sp = |i: &mut usize| {
        while *i < b.len() && b[*i] == b' ' {
            *i += 1;
        }
    };
    skip_sp(&mut i);
    loop {
        let Bare::Str(name) = bare(b, &mut i)? else {
            return Err(format!("item is not a String in {v:?}"));
        };
        let mut params = BTreeMap::new();
        while i < b.len() && b[i] == b';' {
            i += 1;
            skip_sp(&mut i);
            let start = i;
            if i >= b.len() || !(b[i].is_ascii_lowercase() || b[i] == b'*') {
                return Err(format!("bad key at {i} in {v:?}"));
            }
            while i < b.len()
                && (b[i].is_ascii_lowercase() || b[i].is_ascii_digit() || b"_-.*".contains(&b[i]))
            {
                i += 1;
            }
            let key = v[start..i].to_string();
            let val = if i < b.len() && b[i] == b'=' {
                i += 1;
                bare(b, &mut i)?
            } else {
                return Err(format!("parameter {key} without a value in {v:?}"));
            };
            if params.insert(key.clone(), val).is_some() {
                return Err(format!("duplicate parameter {key}"));
            }
        }
        out.push((name, params));
        skip_sp(&mut i);
        if i == b.len() {
            return Ok(out);
        }
        if b[i] != b',' {
            return Err(format!("expected ',' at {i} in {v:?}"));
        }
        i += 1;
        skip_sp(&mut i);
    }
}

fn bare(b: &[u8], i: &mut usize) -> Result<Bare, String> {
    match b.get(*i) {
        Some(b'"') => {
            *i += 1;
            let mut s = String::new();
            loop {
                match b.get(*i) {
                    Some(b'\\') => {
                        let c = *b.get(*i + 1).ok_or("dangling escape")?;
                        if c != b'"' && c != b'\\' {
                            return Err("bad escape".into());
                        }
                        s.push(c as char);
                        *i += 2;
                    }
                    Some(b'"') => {
                        *i += 1;
                        return Ok(Bare::Str(s));
                    }
                    Some(&c) if (0x20..0x7f).contains(&c) => {
                        s.push(c as char);
                        *i += 1;
                    }
                    _ => return Err("bad string".into()),
                }
            }
        }
        Some(c) if c.is_ascii_digit() || *c == b'-' => {
            let start = *i;
            *i += 1;
            while *i < b.len() && b[*i].is_ascii_digit() {
                *i += 1;
            }
            if *i < b.len() && b[*i] == b'.' {
                return Err("decimals are not Integers".into());
            }
            let t = std::str::from_utf8(&b[start..*i]).unwrap();
            if t.trim_start_matches('-').len() > 15 {
                return Err("integer longer than 15 digits".into());
            }
            t.parse().map(Bare::Int).map_err(|e| e.to_string())
        }
        _ => Err(format!("unsupported bare item at {i}")),
    }
}

/// The two fields of an answer, each one member, checked against the draft's rules.
#[derive(Debug)]
struct Fields {
    policy: Member,
    limit: Member,
}

impl Fields {
    fn read(h: &reqwest::header::HeaderMap) -> Self {
        Self::from_strs(
            h.get("ratelimit-policy")
                .expect("RateLimit-Policy")
                .to_str()
                .unwrap(),
            h.get("ratelimit").expect("RateLimit").to_str().unwrap(),
        )
    }

    fn from_strs(policy: &str, limit: &str) -> Self {
        let mut p = parse_list(policy).unwrap();
        let mut l = parse_list(limit).unwrap();
        assert_eq!((p.len(), l.len()), (1, 1), "{policy} / {limit}");
        let (policy, limit) = (p.remove(0), l.remove(0));
        assert_eq!(policy.0, limit.0, "the RateLimit item names its policy");
        // q required, non-negative Integer; w optional, positive Integer.
        assert!(
            matches!(policy.1.get("q"), Some(Bare::Int(q)) if *q >= 0),
            "{policy:?}"
        );
        if let Some(w) = policy.1.get("w") {
            assert!(matches!(w, Bare::Int(w) if *w > 0), "{policy:?}");
        }
        // r required, non-negative; t optional, non-negative.
        assert!(
            matches!(limit.1.get("r"), Some(Bare::Int(r)) if *r >= 0),
            "{limit:?}"
        );
        if let Some(t) = limit.1.get("t") {
            assert!(matches!(t, Bare::Int(t) if *t >= 0), "{limit:?}");
        }
        for k in policy.1.keys().chain(limit.1.keys()) {
            assert!(
                ["q", "qu", "w", "r", "t"].contains(&k.as_str()) || k.starts_with("sluice-"),
                "unprefixed extension parameter {k}"
            );
        }
        Fields { policy, limit }
    }

    fn p(&self, k: &str) -> Option<i64> {
        match self.policy.1.get(k)? {
            Bare::Int(i) => Some(*i),
            Bare::Str(_) => None,
        }
    }

    fn l(&self, k: &str) -> Option<i64> {
        match self.limit.1.get(k)? {
            Bare::Int(i) => Some(*i),
            Bare::Str(_) => None,
        }
    }
}

#[test]
fn the_reader_is_strict() {
    let f = Fields::from_strs(r#""a";q=5;w=2"#, r#""a";r=0;t=1;sluice-reset-ms=40"#);
    assert_eq!((f.p("q"), f.p("w"), f.l("t")), (Some(5), Some(2), Some(1)));
    assert!(parse_list("a;q=5").is_err(), "a Token is not a String");
    assert!(parse_list(r#""a";q=1.5"#).is_err());
    assert!(parse_list(r#""a";Q=1"#).is_err());
    assert_eq!(parse_list(r#""a";q=1, "b";q=2"#).unwrap().len(), 2);
}

// ---------------------------------------------------------------------------------------------
// Servers.
// ---------------------------------------------------------------------------------------------

struct Env {
    _m: Manager,
    client: Client,
    ns: String,
    host: String,
}

impl Drop for Env {
    fn drop(&mut self) {
        remove_segment(&self.ns, &self.host);
    }
}

impl Env {
    async fn start(prefix: &str, tasks: &[(&str, &str)]) -> Self {
        let (etcd, redis) = (shared_etcd(), shared_redis());
        let ns = unique_ns(prefix);
        let host = format!("{ns}-h");
        let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
        for (name, body) in tasks {
            let (status, b) = m.put(&format!("/api/v1/tasks/{name}"), body).await;
            assert!(status == 200 || status == 201, "{name}: {status} {b}");
            m.wait_rolled(name).await;
        }
        let mut cfg = Config::new(redis);
        cfg.namespace = ns.clone();
        cfg.host_id = host.clone();
        let client = Client::new(cfg).unwrap();
        Env {
            _m: m,
            client,
            ns,
            host,
        }
    }

    fn task(&self, name: &str) -> Task {
        let t = self.client.task(name).unwrap();
        assert!(t.wait_ready(Duration::from_secs(20)), "{name} never known");
        t
    }
}

/// Serves `app` on a loopback port (with the peer address in `ConnectInfo`); the server task
/// ends with the test's runtime.
async fn serve(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(l, app.into_make_service_with_connect_info::<SocketAddr>())
            .await
            .unwrap();
    });
    format!("http://{addr}")
}

/// Sleeps until `margin_ms` after the start of the next slice of `slice_ms`, so a short run of
/// requests stays inside one slice.
async fn align(task: &Task, slice_ms: i64, margin_ms: i64) {
    let now = task.now_us() / 1_000;
    let wait = slice_ms - now.rem_euclid(slice_ms) + margin_ms;
    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
}

fn hello() -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/{*rest}", get(|| async { "hello" }))
}

// ---------------------------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------------------------

/// Threshold 5 per 2 s slice, no key: requests inside one slice are admitted until 5 permits
/// are spent (the cost header says how many each takes), then 429. Every answer carries both
/// fields; `Retry-After` on the rejection is its `t`, and `t`/`sluice-reset-ms` are within the
/// slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_on_admitted_and_rejected_answers_and_the_cost_function() {
    let env = Env::start(
        "lyhdr",
        &[(
            "web",
            r#"{"threshold":5,"slice_ms":2000,"local_limit":5,"on_failure":"deny"}"#,
        )],
    )
    .await;
    let task = env.task("web");
    let layer = SluiceLayer::new(task.clone()).cost(|p| {
        p.headers
            .get("x-cost")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    });
    let url = serve(hello().layer(layer)).await;
    let http = http();
    // Up to three tries: a try is void when its requests did not all fall in one slice.
    for attempt in 0.. {
        assert!(attempt < 3, "never stayed inside one slice");
        align(&task, 2_000, 50).await;
        let slice = task.now_us() / 2_000_000;
        let mut answers = Vec::new();
        for cost in [2, 2, 2, 1, 0] {
            let r = http
                .get(format!("{url}/x"))
                .header("x-cost", cost.to_string())
                .send()
                .await
                .unwrap();
            answers.push((cost, r.status().as_u16(), r.headers().clone()));
        }
        if task.now_us() / 2_000_000 != slice {
            continue;
        }
        let statuses: Vec<u16> = answers.iter().map(|a| a.1).collect();
        // 2 + 2 admitted, the third 2 would exceed 5, the 1 fits, cost 0 always passes.
        assert_eq!(statuses, [200, 200, 429, 200, 200], "{answers:?}");
        for (cost, status, h) in &answers {
            let f = Fields::read(h);
            assert_eq!(f.policy.0, "web");
            assert_eq!((f.p("q"), f.p("w")), (Some(5), Some(2)), "{f:?}");
            let t = f.l("t").expect("t");
            let ms = f.l("sluice-reset-ms").expect("sluice-reset-ms");
            assert!((1..=2_000).contains(&ms), "{ms}");
            assert_eq!(t, (ms + 999) / 1_000, "t is the reset rounded up");
            let r = f.l("r").unwrap();
            assert!(r <= 5, "{r}");
            if *status == 429 {
                assert_eq!(r, 0);
                let ra: i64 = h["retry-after"].to_str().unwrap().parse().unwrap();
                assert_eq!(ra, t, "Retry-After is the rejection's t (cost {cost})");
            } else {
                assert!(h.get("retry-after").is_none());
            }
        }
        break;
    }
}

/// A 100 ms slice: `Retry-After` is a whole second (rounded up), the precise reset is
/// `sluice-reset-ms` ≤ 100, and the policy has no `w` but `sluice-w-ms=100`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_whole_seconds_for_a_100_ms_slice() {
    let env = Env::start(
        "lyfast",
        &[(
            "fast",
            r#"{"threshold":1,"slice_ms":100,"local_limit":1,"on_failure":"deny"}"#,
        )],
    )
    .await;
    let task = env.task("fast");
    let url = serve(hello().layer(SluiceLayer::new(task))).await;
    let http = http();
    let mut rejected = None;
    for _ in 0..2_000 {
        let r = http.get(&url).send().await.unwrap();
        if r.status() == 429 {
            rejected = Some(r.headers().clone());
            break;
        }
    }
    let h = rejected.expect("no 429 in 2,000 requests to a limit of 1 per 100 ms");
    assert_eq!(h["retry-after"], "1");
    let f = Fields::read(&h);
    assert_eq!(
        (f.p("q"), f.p("w"), f.p("sluice-w-ms")),
        (Some(1), None, Some(100))
    );
    assert_eq!((f.l("r"), f.l("t")), (Some(0), Some(1)));
    let ms = f.l("sluice-reset-ms").unwrap();
    assert!((1..=100).contains(&ms), "{ms}");
}

/// A tonic health server behind the layer: the tonic client sees `RESOURCE_EXHAUSTED` once the
/// task's 2 permits are spent, with `retry-after` and both fields as metadata; admitted calls
/// carry `ratelimit` in their metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_callers_get_resource_exhausted() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let env = Env::start(
        "lygrpc",
        &[(
            "rpc",
            r#"{"threshold":2,"slice_ms":60000,"local_limit":2,"on_failure":"deny"}"#,
        )],
    )
    .await;
    let task = env.task("rpc");
    let (_reporter, health) = tonic_health::server::health_reporter();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let layer = SluiceLayer::new(task);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(l))
            .await
            .unwrap();
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let mut admitted = 0;
    let mut status = None;
    for _ in 0..20 {
        match client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
        {
            Ok(r) => {
                admitted += 1;
                let md = r.metadata();
                let limit = md.get("ratelimit").expect("ratelimit on an admitted call");
                let policy = md.get("ratelimit-policy").unwrap();
                let f = Fields::from_strs(policy.to_str().unwrap(), limit.to_str().unwrap());
                assert_eq!((f.p("q"), f.p("w")), (Some(2), Some(60)));
            }
            Err(s) => {
                status = Some(s);
                break;
            }
        }
    }
    let s = status.expect("never limited");
    assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
    assert!(admitted <= 2, "{admitted}");
    let md = s.metadata();
    let ra: u64 = md
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&ra), "{ra}");
    let f = Fields::from_strs(
        md.get("ratelimit-policy").unwrap().to_str().unwrap(),
        md.get("ratelimit").unwrap().to_str().unwrap(),
    );
    assert_eq!((f.l("r"), f.l("t")), (Some(0), Some(ra as i64)));
}

/// A threshold-0 task rejects everything, so a custom rejection builder that echoes the
/// [`Rejection`] shows what each extractor found; the missing-key policies; gRPC detection on
/// the rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_rejections_show_each_extractor_and_the_missing_key_policies() {
    let env = Env::start(
        "lykey",
        &[(
            "none",
            r#"{"threshold":0,"slice_ms":60000,"local_limit":0,"on_failure":"deny"}"#,
        )],
    )
    .await;
    let task = env.task("none");
    let echo = |r: &Rejection| {
        let body = format!(
            "{}|{}|{}|{:?}",
            r.key.as_deref().unwrap_or("-"),
            r.cost,
            r.grpc,
            r.reason
        );
        let mut res = axum::response::Response::new(axum::body::Body::from(body));
        *res.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        r.apply_headers(res.headers_mut());
        res
    };
    let mk = |k: KeyExtractor| hello().layer(SluiceLayer::new(task.clone()).key(k).on_reject(echo));
    let by_header = serve(mk(KeyExtractor::header("x-api-key"))).await;
    let by_path = serve(mk(KeyExtractor::path_segment(1))).await;
    let by_peer = serve(mk(KeyExtractor::peer_ip())).await;
    let by_fn = serve(mk(KeyExtractor::from_fn(|p| {
        Some(format!("{}:{}", p.method, p.uri.path()))
    })))
    .await;
    let http = http();
    let get = |url: String, key: Option<&'static str>| {
        let http = http.clone();
        async move {
            let mut rq = http.get(url);
            if let Some(k) = key {
                rq = rq.header("x-api-key", k);
            }
            let r = rq.send().await.unwrap();
            let status = r.status().as_u16();
            let h = r.headers().clone();
            (status, h, r.text().await.unwrap())
        }
    };
    let (s, h, body) = get(format!("{by_header}/"), Some("k-123")).await;
    assert_eq!(s, 503);
    assert!(body.starts_with("k-123|1|false|Limited("), "{body}");
    assert!(h.contains_key("retry-after") && h.contains_key("ratelimit"));
    let (_, _, body) = get(format!("{by_path}/tenants/acme/orders"), None).await;
    assert!(body.starts_with("acme|"), "{body}");
    let (_, _, body) = get(format!("{by_peer}/"), None).await;
    assert!(body.starts_with("127.0.0.1|"), "{body}");
    let (_, _, body) = get(format!("{by_fn}/a/b"), None).await;
    assert!(body.starts_with("GET:/a/b|"), "{body}");

    // Missing keys: rejected (default, through the builder), on the task, or one shared key.
    let (s, h, body) = get(format!("{by_header}/"), None).await;
    assert_eq!((s, body.as_str()), (503, "-|1|false|MissingKey"));
    assert!(!h.contains_key("retry-after"));
    let (_, _, body) = get(format!("{by_path}/only-one"), None).await;
    assert_eq!(body, "-|1|false|MissingKey");
    let long = "k".repeat(257);
    let r = http
        .get(format!("{by_header}/"))
        .header("x-api-key", &long)
        .send()
        .await
        .unwrap();
    assert!(
        r.text().await.unwrap().ends_with("|MissingKey"),
        "a 257-byte key is refused"
    );

    let default_missing =
        serve(hello().layer(SluiceLayer::new(task.clone()).key(KeyExtractor::header("x-api-key"))))
            .await;
    let r = http.get(&default_missing).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let whole = serve(
        hello().layer(
            SluiceLayer::new(task.clone())
                .key(KeyExtractor::header("x-api-key"))
                .on_missing_key(MissingKey::WholeTask)
                .on_reject(echo),
        ),
    )
    .await;
    let (_, _, body) = get(whole, None).await;
    assert!(body.starts_with("-|1|false|Limited("), "{body}");
    let shared = serve(
        hello().layer(
            SluiceLayer::new(task.clone())
                .key(KeyExtractor::header("x-api-key"))
                .on_missing_key(MissingKey::Key("anonymous".into()))
                .on_reject(echo),
        ),
    )
    .await;
    let (_, _, body) = get(shared, None).await;
    assert!(body.starts_with("anonymous|"), "{body}");

    // A gRPC content type is flagged on the rejection (the default builder answers grpc-status).
    let r = http
        .get(format!("{by_header}/"))
        .header("x-api-key", "g")
        .header("content-type", "application/grpc+proto")
        .send()
        .await
        .unwrap();
    assert!(r.text().await.unwrap().starts_with("g|1|true|"));
    let r = http
        .get(format!("{default_missing}/"))
        .header("x-api-key", "g")
        .header("content-type", "application/grpc")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["grpc-status"], "8");
    assert!(r.headers().contains_key("ratelimit"));
}

/// A keyed task of 2 per 2 s slice behind a header extractor: inside one slice key `a` is
/// admitted twice then refused (429), while key `b` is still admitted, and an overridden key
/// `vip` (4) gets four; costs count per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_limits_refuse_only_the_exhausted_key() {
    let env = Env::start(
        "lykeyd",
        &[(
            "per",
            r#"{"threshold":2,"slice_ms":2000,"keyed":true,"key_overrides":{"vip":4},"local_limit":2,"on_failure":"deny"}"#,
        )],
    )
    .await;
    let task = env.task("per");
    let layer = SluiceLayer::new(task.clone())
        .key(KeyExtractor::header("x-api-key"))
        .cost(|p| {
            p.headers
                .get("x-cost")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        });
    let url = serve(hello().layer(layer)).await;
    let http = http();
    for attempt in 0.. {
        assert!(attempt < 3, "never stayed inside one slice");
        align(&task, 2_000, 50).await;
        let slice = task.now_us() / 2_000_000;
        let mut got = Vec::new();
        for (key, cost) in [
            ("a", 1),
            ("a", 1),
            ("a", 1),
            ("b", 1),
            ("vip", 3),
            ("vip", 1),
            ("vip", 1),
            ("b", 1),
            ("b", 1),
        ] {
            let r = http
                .get(&url)
                .header("x-api-key", key)
                .header("x-cost", cost.to_string())
                .send()
                .await
                .unwrap();
            let h = r.headers().clone();
            got.push((key, r.status().as_u16(), h));
        }
        if task.now_us() / 2_000_000 != slice {
            continue;
        }
        let statuses: Vec<(&str, u16)> = got.iter().map(|g| (g.0, g.1)).collect();
        assert_eq!(
            statuses,
            [
                ("a", 200),
                ("a", 200),
                ("a", 429),
                ("b", 200),
                ("vip", 200),
                ("vip", 200),
                ("vip", 429),
                ("b", 200),
                ("b", 429),
            ]
        );
        for (key, status, h) in &got {
            let f = Fields::read(h);
            assert_eq!(f.policy.0, "per");
            assert_eq!(f.p("w"), Some(2), "{key}");
            // The key's own limit: the override's cap, as Redis answered the key's pull.
            let q = if *key == "vip" { 4 } else { 2 };
            assert_eq!(f.p("q"), Some(q), "{key}");
            if *status == 429 {
                assert_eq!(f.l("r"), Some(0));
                assert_eq!(
                    h["retry-after"].to_str().unwrap().parse::<i64>().ok(),
                    f.l("t")
                );
            }
        }
        break;
    }
}
