//! The link to etcd: endpoints, TLS (`https://` endpoints, `--etcd-ca`, `--etcd-cert`,
//! `--etcd-key`) and authentication (`--etcd-user` with a password from a file or
//! `SLUICE_ETCD_PASSWORD`).
//!
//! # One client, every use
//!
//! The process has one etcd client ([`connect`]); every part of the manager (election, lease
//! keep-alives, task watch, API, settings, the epoch read from response headers) uses clones
//! of it, so they all share its TLS settings, its channel and its auth token. The client
//! reconnects by itself (tonic's balanced channel) with the same TLS settings.
//!
//! # Start-up check
//!
//! Before the election and the task watch start, [`establish`] checks every endpoint on its
//! own (so an error can name it): a TLS handshake, authentication when a user is set, and a
//! read of the namespace. Then:
//!
//! * a TLS failure (unknown CA, wrong host name, https:// against a plain-HTTP etcd) or an
//!   authentication failure (wrong password, unknown user, auth not enabled,
//!   no permission) on **any** endpoint is a configuration error: logged at ERROR with the
//!   endpoint, and the manager exits non-zero. Retrying cannot fix it.
//! * an endpoint that cannot be reached (refused, timed out) is logged at WARN; while no
//!   endpoint can be reached the check is retried with backoff (up to 5 s) for as long as it
//!   takes: etcd may simply be starting. The HTTP server runs meanwhile (`/healthz` 200,
//!   `/readyz` 503).
//!
//! The password is sent only to etcd's `Authenticate` call; it is never logged, and etcd's
//! errors do not contain it. The auth token is refreshed when etcd says it expired
//! (`--auth-token-ttl`, 300 s by default).

use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{Config, EtcdLink};
use crate::error::{Error, Result};

/// Bound on one endpoint's start-up check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// The options every etcd client of the process is built with, without the user (see
/// [`establish`]).
fn options(link: &EtcdLink) -> Result<ConnectOptions> {
    let mut o = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1))
        .with_keep_alive_while_idle(true)
        .with_auto_token_refresh(true);
    if link.tls {
        o = o.with_tls(tls_options(link)?);
    }
    Ok(o)
}

fn tls_options(link: &EtcdLink) -> Result<TlsOptions> {
    let startup = |flag: &str, e: String| Error::Startup(format!("--{flag}: {e}"));
    let roots = sluice_protocol::tls::all_roots_pem(link.ca.as_deref())
        .map_err(|e| startup("etcd-ca", e))?;
    let mut tls = TlsOptions::new()
        .ca_certificate(Certificate::from_pem(roots))
        .timeout(Duration::from_secs(2));
    if let Some((cert, key)) = &link.identity {
        let cert_pem = std::fs::read(cert)
            .map_err(|e| startup("etcd-cert", format!("cannot read {}: {e}", cert.display())))?;
        let key_pem = std::fs::read(key)
            .map_err(|e| startup("etcd-key", format!("cannot read {}: {e}", key.display())))?;
        tls = tls.identity(Identity::from_pem(cert_pem, key_pem));
    }
    Ok(tls)
}

/// The process's etcd client over every endpoint. Nothing is sent yet: the channel connects
/// lazily, and the user is set by [`establish`].
pub async fn connect(cfg: &Config) -> Result<Client> {
    Client::connect(&cfg.etcd, Some(options(&cfg.etcd_link)?))
        .await
        .map_err(|source| Error::Etcd {
            op: "connect",
            source,
        })
}

/// Why an endpoint failed its check.
#[derive(Debug)]
enum Failure {
    /// Cannot be reached: retry.
    Unreachable(String),
    /// TLS or authentication: a configuration error.
    Fatal(String),
    /// A TLS connection that the server closed right after it was set up. With TLS 1.3 the
    /// server checks the client certificate after the client considers the handshake done, so
    /// a refused (or missing) client certificate shows up like this, not as an alert. Once is
    /// an accident (etcd restarting); every time is a configuration error.
    Closed(String),
}

/// Consecutive [`Failure::Closed`] of one endpoint that make it a configuration error.
const CLOSED_FATAL_AFTER: u32 = 3;

/// The error and every source below it, on one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        cur = s.source();
    }
    out
}

fn classify(e: &etcd_client::Error) -> Failure {
    let text = chain(e);
    if let etcd_client::Error::GRpcStatus(status) = e {
        // gRPC codes: 7 PermissionDenied, 16 Unauthenticated (etcd answers a wrong password
        // with 3 InvalidArgument "authentication failed, invalid user ID or password").
        let code = i32::from(status.code());
        let msg = status.message();
        // 14 Unavailable and 4 DeadlineExceeded are transport trouble, whatever they say.
        let auth = code == 7
            || code == 16
            || (code != 14
                && code != 4
                && ["auth", "user name", "permission denied", "password"]
                    .iter()
                    .any(|w| msg.contains(w)));
        if auth {
            return Failure::Fatal(format!("authentication failed: {msg}"));
        }
    }
    let lower = text.to_ascii_lowercase();
    let tls_words = [
        "certificate",
        "tls",
        "handshake",
        "alert",
        "corrupt message",
        "invalidcontenttype",
        "http/2 was not negotiated",
        "h2 protocol error",
        "frame with invalid size",
    ];
    if tls_words.iter().any(|w| lower.contains(w)) {
        return Failure::Fatal(format!("TLS failed: {text}"));
    }
    Failure::Unreachable(text)
}

/// [`classify`], for a TLS link: a connection closed or reset by the server (not refused) is
/// [`Failure::Closed`].
fn classify_link(e: &etcd_client::Error, tls: bool) -> Failure {
    match classify(e) {
        Failure::Unreachable(text) if tls => {
            let lower = text.to_ascii_lowercase();
            let closed = [
                "connection closed",
                "canceled",
                "reset by peer",
                "broken pipe",
            ]
            .iter()
            .any(|w| lower.contains(w));
            if closed && !lower.contains("refused") {
                Failure::Closed(text)
            } else {
                Failure::Unreachable(text)
            }
        }
        other => other,
    }
}

/// Checks one endpoint: connect (TLS), authenticate (with a user), read the namespace.
async fn check(endpoint: &str, cfg: &Config) -> std::result::Result<(), Failure> {
    let mut opts = options(&cfg.etcd_link).map_err(|e| Failure::Fatal(e.to_string()))?;
    if let Some((user, password)) = &cfg.etcd_link.user {
        opts = opts.with_user(user.clone(), password.expose());
    }
    let attempt = async {
        let mut c = Client::connect([endpoint], Some(opts)).await?;
        let prefix = format!("/{}/", cfg.namespace);
        c.get(
            prefix,
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await?;
        Ok::<_, etcd_client::Error>(())
    };
    match tokio::time::timeout(CHECK_TIMEOUT, attempt).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(classify_link(&e, cfg.etcd_link.tls)),
        Err(_) => Err(Failure::Unreachable(format!(
            "no answer within {CHECK_TIMEOUT:?}"
        ))),
    }
}

/// Checks every endpoint (see the module documentation), then authenticates `client` when a
/// user is set. Returns Ok(false) when `stop` was cancelled first; an error is a configuration
/// error the manager must exit on.
pub async fn establish(
    client: &mut Client,
    cfg: &Config,
    stop: &CancellationToken,
) -> Result<bool> {
    if cfg.etcd_link.user.is_some() && !cfg.etcd_link.tls {
        warn!(
            "--etcd-user with http:// endpoints: the password and the token cross the network \
             unencrypted; use https:// endpoints"
        );
    }
    let mut backoff = Duration::from_millis(250);
    let mut attempt = 0u32;
    let mut next_log = 1u32;
    let mut closed_in_a_row = vec![0u32; cfg.etcd.len()];
    loop {
        attempt += 1;
        // Unreachable endpoints: logged on the first attempt, then every tenth (about 50 s).
        let log_unreachable = attempt >= next_log;
        if log_unreachable {
            next_log = attempt + 10;
        }
        let results =
            futures::future::join_all(cfg.etcd.iter().map(|e| check(e.as_str(), cfg))).await;
        let mut fatal = Vec::new();
        let mut reachable = 0;
        for ((endpoint, r), closed) in cfg.etcd.iter().zip(&results).zip(&mut closed_in_a_row) {
            if !matches!(r, Err(Failure::Closed(_))) {
                *closed = 0;
            }
            match r {
                Ok(()) => reachable += 1,
                Err(Failure::Closed(why)) => {
                    *closed += 1;
                    if *closed >= CLOSED_FATAL_AFTER {
                        let why = format!(
                            "TLS failed: the server closed {CLOSED_FATAL_AFTER} connections in \
                             a row right after the handshake (it refuses this client's \
                             certificate: check --etcd-cert, --etcd-key and the server's \
                             client CA): {why}"
                        );
                        error!(endpoint = %endpoint, "etcd endpoint {endpoint}: {why}");
                        fatal.push(format!("{endpoint}: {why}"));
                    } else if log_unreachable {
                        warn!(
                            endpoint = %endpoint,
                            attempt,
                            "etcd endpoint {endpoint} closed the TLS connection: {why}; retrying"
                        );
                    }
                }
                Err(Failure::Fatal(why)) => {
                    error!(endpoint = %endpoint, "etcd endpoint {endpoint}: {why}");
                    fatal.push(format!("{endpoint}: {why}"));
                }
                Err(Failure::Unreachable(why)) => {
                    if log_unreachable {
                        warn!(
                            endpoint = %endpoint,
                            attempt,
                            "etcd endpoint {endpoint} cannot be reached: {why}; retrying"
                        );
                    }
                }
            }
        }
        if !fatal.is_empty() {
            return Err(Error::Startup(format!("etcd: {}", fatal.join("; "))));
        }
        if reachable > 0
            && let Some((user, password)) = &cfg.etcd_link.user
        {
            let auth = tokio::time::timeout(
                CHECK_TIMEOUT,
                client.update_user(Some((user.clone(), password.expose().to_string()))),
            )
            .await;
            match auth {
                Ok(Ok(())) => {}
                Ok(Err(e)) => match classify(&e) {
                    Failure::Fatal(why) => {
                        error!("etcd {:?}: {why}", cfg.etcd);
                        return Err(Error::Startup(format!("etcd: {why}")));
                    }
                    Failure::Unreachable(why) | Failure::Closed(why) => {
                        warn!("etcd authentication did not go through: {why}; retrying");
                        reachable = 0;
                    }
                },
                Err(_) => {
                    warn!("etcd authentication timed out; retrying");
                    reachable = 0;
                }
            }
        }
        if reachable > 0 {
            info!(
                endpoints = ?cfg.etcd,
                reachable,
                tls = cfg.etcd_link.tls,
                client_cert = cfg.etcd_link.identity.is_some(),
                user = cfg.etcd_link.user.as_ref().map(|(u, _)| u.as_str()),
                "etcd connected"
            );
            return Ok(true);
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(false),
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
