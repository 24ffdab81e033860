//! The real `sluice-manager` binary at start-up (issue 23 items 16 and 4):
//!
//! * `--listen` beyond loopback without `--api-token` is refused (exit 2, the message names
//!   `--listen`, `--api-token` and `--insecure-listen`) whether it comes as a flag, as
//!   `SLUICE_LISTEN` (the shipped Dockerfile and compose file) or from a TOML file (the shipped
//!   `deploy/manager.toml`); `--insecure-listen` (or `SLUICE_INSECURE_LISTEN=true`) or a token
//!   file make it serve;
//! * a TOML error in `--config` names the file, the line and the column, never the text: the
//!   line at fault may hold a token or a Redis password.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use sluice_tests::*;

/// What a started binary did: exited with a code (and its log), or served `/healthz`.
enum Outcome {
    Exited(i32, String),
    Serving(String),
}

/// Starts `sluice-manager` with `args` and `env` on the shared servers and waits until it
/// exits or serves `/healthz` on `probe` (a loopback address it listens on).
fn start(args: &[&str], env: &[(&str, &str)], probe: &str, dir: &Path) -> Outcome {
    let mut cmd = Command::new(workspace_bin("sluice-manager"));
    cmd.args(["--etcd", &shared_etcd(), "--redis", &shared_redis()])
        .args(["--namespace", &unique_ns("mcfg"), "--node-id", "n1"])
        .args(args)
        .env("RUST_LOG", "info")
        .envs(env.iter().copied());
    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut p = Proc::spawn("sluice-manager", cmd, dir.join(format!("manager-{n}.log")));
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(c) = p.exit_code() {
            return Outcome::Exited(c, p.log());
        }
        if http_get_blocking(&format!("http://{probe}/healthz")).is_some_and(|(s, _)| s == 200) {
            let log = p.log();
            p.stop_with(libc::SIGTERM, Duration::from_secs(10));
            return Outcome::Serving(log);
        }
        assert!(
            Instant::now() < deadline,
            "neither exited nor served within {START_TIMEOUT:?}:\n{}",
            p.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn assert_refused(outcome: Outcome, what: &str) {
    match outcome {
        Outcome::Exited(code, log) => {
            assert_eq!(code, 2, "{what}: {log}");
            assert!(
                log.contains("--listen")
                    && log.contains("--api-token")
                    && log.contains("--insecure-listen"),
                "{what}: the message names the flags: {log}"
            );
        }
        Outcome::Serving(log) => panic!("{what}: served beyond loopback without a token:\n{log}"),
    }
}

fn assert_serving(outcome: Outcome, what: &str) -> String {
    match outcome {
        Outcome::Serving(log) => log,
        Outcome::Exited(code, log) => panic!("{what}: exited {code}:\n{log}"),
    }
}

#[test]
fn a_listener_beyond_loopback_needs_a_token_or_insecure_listen() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let any = format!("0.0.0.0:{port}");
    let probe = format!("127.0.0.1:{port}");

    // Refused: as a flag, as the Dockerfile's environment, as the shipped TOML's key.
    assert_refused(
        start(&["--listen", &any], &[], &probe, dir.path()),
        "--listen 0.0.0.0",
    );
    assert_refused(
        start(&[], &[("SLUICE_LISTEN", &any)], &probe, dir.path()),
        "SLUICE_LISTEN=0.0.0.0",
    );
    let toml = dir.path().join("manager.toml");
    std::fs::write(&toml, format!("listen = \"{any}\"\n")).unwrap();
    assert_refused(
        start(
            &["--config", toml.to_str().unwrap()],
            &[],
            &probe,
            dir.path(),
        ),
        "listen = 0.0.0.0 in the TOML file",
    );
    assert_refused(
        start(
            &["--listen", &any, "--insecure-listen=false"],
            &[],
            &probe,
            dir.path(),
        ),
        "--insecure-listen=false",
    );

    // Served: told so by flag or environment (with a warning), or with a token.
    let log = assert_serving(
        start(
            &["--listen", &any, "--insecure-listen"],
            &[],
            &probe,
            dir.path(),
        ),
        "--insecure-listen",
    );
    assert!(
        log.contains("WARN") && log.contains("--insecure-listen"),
        "{log}"
    );
    assert_serving(
        start(
            &["--listen", &any],
            &[("SLUICE_INSECURE_LISTEN", "true")],
            &probe,
            dir.path(),
        ),
        "SLUICE_INSECURE_LISTEN=true",
    );
    let token = dir.path().join("api-token");
    std::fs::write(&token, "t0ken-for-the-listener\n").unwrap();
    let log = assert_serving(
        start(
            &[
                "--listen",
                &any,
                "--api-token-file",
                token.to_str().unwrap(),
            ],
            &[],
            &probe,
            dir.path(),
        ),
        "--api-token-file",
    );
    assert!(!log.contains("--insecure-listen"), "{log}");
    // Loopback needs neither.
    assert_serving(
        start(&["--listen", &probe], &[], &probe, dir.path()),
        "loopback",
    );
}

#[test]
fn a_toml_error_never_quotes_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let probe = format!("127.0.0.1:{}", free_port());
    let toml = dir.path().join("manager.toml");
    for text in [
        "api_token = Adm1n-s3cret-unquoted\n",
        "redis = \"redis://sluice:Redis-s3cret@10.0.0.21:6379\nlisten = \"127.0.0.1:1\"\n",
        "log_json = \"s3cret-where-a-bool-goes\"\n",
    ] {
        std::fs::write(&toml, text).unwrap();
        match start(
            &["--config", toml.to_str().unwrap()],
            &[],
            &probe,
            dir.path(),
        ) {
            Outcome::Exited(code, log) => {
                assert_eq!(code, 2, "{text:?}: {log}");
                assert!(
                    !log.contains("s3cret"),
                    "{text:?}: the file is quoted: {log}"
                );
                assert!(
                    log.contains("--config") && log.contains("line 1"),
                    "{text:?}: {log}"
                );
            }
            Outcome::Serving(log) => panic!("{text:?}: started:\n{log}"),
        }
    }
}
