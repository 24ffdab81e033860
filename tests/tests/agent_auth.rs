//! The agent's authentication end to end (issue 23 item 16; docs/agent.md, "Authentication"):
//!
//! * with `--api-token-file`, `POST /v1/decide` needs `Authorization: Bearer <token>` (401
//!   without it or with a wrong one), RLS and RLQS need the metadata `authorization: Bearer
//!   <token>` (`UNAUTHENTICATED` otherwise); `/healthz`, `/readyz`, `/metrics` and the OpenAPI
//!   document stay open;
//! * requests from browsers (with `Origin`) cannot decide (403), with or without a token;
//! * the token appears in no log line, metric or error answer;
//! * a listener beyond loopback without a token is refused at start-up (exit 2) naming the flag
//!   and the two ways out (`--api-token`, `--insecure-listen`). (Binding beyond loopback for
//!   real is not done here: network tests stay on loopback; the accepting cases are unit
//!   tests of `agent/src/config.rs`.)

use std::process::Command;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use serde_json::json;
use sluice_tests::*;

const TOKEN: &str = "agent-t0ken-8f3a91c2e7";

fn rls_request(task: &str, token: Option<&str>) -> tonic::Request<RateLimitRequest> {
    let mut r = tonic::Request::new(RateLimitRequest {
        domain: "d".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "sluice_task".into(),
                value: task.into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    });
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

async fn rlqs_call(a: &Agent, token: Option<&str>) -> Result<(), tonic::Status> {
    let mut rpc = RateLimitQuotaServiceClient::connect(a.grpc_url())
        .await
        .expect("connect");
    let (_tx, rx) = tokio::sync::mpsc::channel::<RateLimitQuotaUsageReports>(1);
    let mut r = tonic::Request::new(tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(
        rx,
    ));
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    rpc.stream_rate_limit_quotas(r).await.map(|_| ())
}

async fn post(a: &Agent, auth: Option<&str>, origin: Option<&str>) -> (u16, String) {
    let mut r = http().post(a.url("/v1/decide")).json(&json!({"task": "t"}));
    if let Some(v) = auth {
        r = r.header("authorization", v);
    }
    if let Some(o) = origin {
        r = r.header("origin", o);
    }
    let resp = r.send().await.unwrap();
    (
        resp.status().as_u16(),
        resp.text().await.unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_need_the_token_and_it_never_shows() {
    let (etcd, redis) = (shared_etcd(), shared_redis());
    let ns = unique_ns("aauth");
    let m = Manager::start(ManagerOpts::new(&etcd, &redis, &ns, "m1")).await;
    let (s, v) = m
        .put("/api/v1/tasks/t", r#"{"threshold":1000,"slice_ms":1000}"#)
        .await;
    assert!(s == 200 || s == 201, "{s} {v}");
    m.wait_rolled("t").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let a = Agent::start(
        &redis,
        &ns,
        "h1",
        &["--api-token-file", file.to_str().unwrap()],
    )
    .await;
    a.wait_ready().await;

    // HTTP.
    let mut answers = Vec::new();
    for (auth, want) in [
        (None, 401),
        (Some("Bearer wrong"), 401),
        (Some(&format!("Bearer {TOKEN}x")[..]), 401),
        (Some(&format!("Basic {TOKEN}")[..]), 401),
        (Some(TOKEN), 401),
        (Some(&format!("Bearer {TOKEN}")[..]), 200),
        (Some(&format!("bearer {TOKEN}")[..]), 200),
    ] {
        let (s, body) = post(&a, auth, None).await;
        assert_eq!(s, want, "{auth:?}: {body}");
        answers.push(body);
    }
    assert!(answers[0].contains("--api-token"), "{}", answers[0]);
    // A browser cannot decide, token or not.
    let (s, body) = post(
        &a,
        Some(&format!("Bearer {TOKEN}")),
        Some("http://127.0.0.1"),
    )
    .await;
    assert_eq!(s, 403, "{body}");
    answers.push(body);
    for p in ["/healthz", "/readyz", "/metrics", "/api/v1/openapi.json"] {
        let r = http().get(a.url(p)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{p} stays open");
    }

    // gRPC: RLS and RLQS.
    let mut rls = RateLimitServiceClient::connect(a.grpc_url()).await.unwrap();
    for token in [None, Some("wrong"), Some(&format!("{TOKEN}x")[..])] {
        let e = rls
            .should_rate_limit(rls_request("t", token))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{token:?}: {e:?}");
        assert!(!e.message().contains(TOKEN), "{e:?}");
        answers.push(e.message().to_string());
        let e = rlqs_call(&a, token).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{token:?}: {e:?}");
    }
    let ok = rls
        .should_rate_limit(rls_request("t", Some(TOKEN)))
        .await
        .expect("RLS with the token");
    assert_eq!(ok.into_inner().overall_code, 1, "OK");
    rlqs_call(&a, Some(TOKEN))
        .await
        .expect("RLQS with the token");

    // Nowhere: answers, metrics, the log.
    for body in &answers {
        assert!(!body.contains(TOKEN), "{body}");
    }
    let metrics = a.metrics().await;
    assert!(!metrics.contains(TOKEN));
    assert!(
        metrics.contains(r#"api="http",reason="unauthenticated""#)
            && metrics.contains(r#"api="rls",reason="unauthenticated""#)
            && metrics.contains(r#"api="rlqs",reason="unauthenticated""#)
            && metrics.contains(r#"api="http",reason="cross_origin""#),
        "{metrics}"
    );
    let log = a.proc.log();
    assert!(!log.contains(TOKEN), "the token is in the log:\n{log}");
    let plain = strip_ansi(&log);
    assert!(
        plain.contains(r#"auth="token""#),
        "the log says a token is required:\n{plain}"
    );
}

/// `text` without its terminal colour sequences (`ESC [ … m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Without a token, even a loopback agent refuses browsers (a page the user visits could
/// otherwise spend quota through it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsers_cannot_decide_without_a_token_either() {
    let redis = shared_redis();
    let ns = unique_ns("aorigin");
    let a = Agent::start(&redis, &ns, "h1", &[]).await;
    let (s, body) = post(&a, None, Some("https://evil.example")).await;
    assert_eq!(s, 403, "{body}");
    let (s, body) = post(&a, None, None).await;
    assert_eq!(s, 404, "no such task, but past the guard: {body}");
}

#[test]
fn a_listener_beyond_loopback_without_a_token_is_refused() {
    let redis = shared_redis();
    for (flag, other) in [
        ("--http-listen", "--grpc-listen"),
        ("--grpc-listen", "--http-listen"),
    ] {
        let addr = format!("0.0.0.0:{}", free_port());
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(workspace_bin("sluice-agent"));
        cmd.args(["--redis", &redis, "--host-id", "h1"])
            .arg("--segment-dir")
            .arg(dir.path())
            .args([other, &format!("127.0.0.1:{}", free_port())])
            .args([flag, &addr]);
        let mut p = Proc::spawn("sluice-agent", cmd, dir.path().join("agent.log"));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let code = loop {
            if let Some(c) = p.exit_code() {
                break c;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the agent serves {flag} {addr} without a token:\n{}",
                p.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let log = p.log();
        assert_eq!(code, 2, "{log}");
        assert!(
            log.contains(flag) && log.contains("--api-token") && log.contains("--insecure-listen"),
            "{log}"
        );
    }
}
