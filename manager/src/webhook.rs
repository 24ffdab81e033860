//! Webhook destinations: which URLs are accepted, how they are shown, and the HTTP client that
//! delivers alerts to them.
//!
//! A webhook URL is a secret (a Slack incoming-webhook URL *is* the credential), so it is never
//! shown whole: logs, errors and the settings API show [`redact`]ed URLs, `scheme://host/…`.
//!
//! # Destination safety
//!
//! An alert POST goes wherever the settings say, from inside the manager's network. Unless the
//! manager runs with `--webhook-allow-private`, only *global* addresses ([`is_global`]) are
//! reached: loopback, private ranges, link-local (cloud metadata services live at
//! 169.254.169.254), unspecified, CGNAT, documentation, multicast and reserved addresses are
//! refused. Checked twice:
//!
//! ```text
//!  PUT /api/v1/settings ── check_destination: literal IP, or every address the host resolves to
//!                          now → 400 naming webhooks[i]
//!  delivery ────────────── literal IP checked again; host names resolved by GlobalOnly, which
//!                          drops non-global addresses (a DNS answer that changed since the
//!                          PUT — "DNS rebinding" — reaches nothing)
//! ```
//!
//! The client never follows redirects (a 3xx is a failed delivery: a redirect could point
//! anywhere), uses no proxy from the environment (the proxy would resolve the name, out of
//! reach of the check), and is bounded in time (connect and total).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Bound on connecting to a webhook (TCP + TLS handshake).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on one POST, connect included.
pub const POST_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on resolving a webhook host at `PUT /api/v1/settings`.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);

/// Where a redacted URL ends: `https://hooks.slack.com/…`.
pub const REDACTED_TAIL: &str = "/…";

/// The URL without what may be secret: `scheme://host[:port]/…` (userinfo, path, query and
/// fragment dropped). Something that is not a URL is shown as `<not a URL>`.
///
/// ```
/// use sluice_manager::webhook::redact;
/// assert_eq!(redact("https://hooks.slack.com/services/T0/B0/XyZ"), "https://hooks.slack.com/…");
/// assert_eq!(redact("http://127.0.0.1:9000/hook?k=s3cret"), "http://127.0.0.1:9000/…");
/// assert_eq!(redact("http://user:pw@[::1]:80/x"), "http://[::1]/…");
/// assert_eq!(redact("no url"), "<not a URL>");
/// ```
pub fn redact(url: &str) -> String {
    match Url::parse(url) {
        Ok(u) => match u.host_str() {
            Some(host) => match u.port() {
                Some(p) => format!("{}://{host}:{p}{REDACTED_TAIL}", u.scheme()),
                None => format!("{}://{host}{REDACTED_TAIL}", u.scheme()),
            },
            None => format!("{}:{REDACTED_TAIL}", u.scheme()),
        },
        Err(_) => "<not a URL>".to_string(),
    }
}

/// Is `s` a redacted URL (as the settings API shows them)?
pub fn is_redacted(s: &str) -> bool {
    s.ends_with(REDACTED_TAIL)
}

/// Checks a webhook URL's form: `http://` or `https://`, a host, no user name or password
/// (the secret belongs in the path, where every receiver puts it). The error never repeats the
/// URL.
pub fn check_syntax(raw: &str) -> Result<Url, String> {
    let url = Url::parse(raw).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(format!(
            "{} must be an http:// or https:// URL with a host",
            redact(raw)
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!(
            "{}: a user name or password in a webhook URL is not supported (put the secret in the path)",
            redact(raw)
        ));
    }
    Ok(url)
}

/// Is `ip` a global (publicly routable) address? Only these are reached without
/// `--webhook-allow-private`.
///
/// IPv4: everything except 0.0.0.0/8, 10/8, 100.64/10 (CGNAT), 127/8, 169.254/16, 172.16/12,
/// 192.0.0/24, the documentation ranges, 192.168/16, 198.18/15, 224/4 (multicast) and 240/4
/// (reserved, broadcast). IPv6: only 2000::/3 (global unicast) less 2001::/23 (protocol
/// assignments, Teredo) and 2001:db8::/32 (documentation); IPv4-mapped, NAT64 (64:ff9b::/96)
/// and 6to4 (2002::/16) addresses are judged by the IPv4 address they carry.
///
/// ```
/// use sluice_manager::webhook::is_global;
/// for bad in ["127.0.0.1", "169.254.169.254", "10.1.2.3", "172.31.0.1", "192.168.1.1",
///             "0.0.0.0", "100.64.0.1", "::1", "::", "fe80::1", "fd00::1", "::ffff:127.0.0.1",
///             "fd00:ec2::254", "2002:7f00:1::1", "ff02::1", "2001:db8::1"] {
///     assert!(!is_global(bad.parse().unwrap()), "{bad}");
/// }
/// for good in ["1.1.1.1", "52.1.2.3", "2606:4700::1111", "::ffff:8.8.8.8"] {
///     assert!(is_global(good.parse().unwrap()), "{good}");
/// }
/// ```
pub fn is_global(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_global_v4(v4),
        IpAddr::V6(v6) => is_global_v6(v6),
    }
}

fn is_global_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b))
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && c == 0)
        || (a == 192 && b == 0 && c == 2)
        || (a == 192 && b == 168)
        || (a == 198 && (b == 18 || b == 19))
        || (a == 198 && b == 51 && c == 100)
        || (a == 203 && b == 0 && c == 113)
        || a >= 224)
}

fn is_global_v6(ip: Ipv6Addr) -> bool {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return is_global_v4(v4);
    }
    let s = ip.segments();
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        return is_global_v4(Ipv4Addr::new(
            (s[6] >> 8) as u8,
            s[6] as u8,
            (s[7] >> 8) as u8,
            s[7] as u8,
        ));
    }
    if s[0] == 0x2002 {
        return is_global_v4(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    (s[0] & 0xe000) == 0x2000
        && !(s[0] == 0x2001 && s[1] < 0x0200)
        && !(s[0] == 0x2001 && s[1] == 0x0db8)
}

fn refused(host: &str, ip: IpAddr) -> String {
    let what = match host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        Ok(literal) if literal == ip => format!("{ip} is not a global address"),
        Ok(literal) => format!("{literal} is {ip}, not a global address"),
        Err(_) => format!("{host} resolves to {ip}, not a global address"),
    };
    format!(
        "{what} (loopback, private, link-local and similar destinations are refused; start the manager with --webhook-allow-private to allow them)"
    )
}

/// The literal IP of `url`'s host, if it is one.
fn literal_ip(url: &Url) -> Option<IpAddr> {
    match url.host()? {
        url::Host::Ipv4(ip) => Some(IpAddr::V4(ip)),
        url::Host::Ipv6(ip) => Some(IpAddr::V6(ip)),
        url::Host::Domain(_) => None,
    }
}

/// The delivery-time check of a literal-IP host (host names are checked by the resolver).
pub fn check_literal(url: &Url, allow_private: bool) -> Result<(), String> {
    match literal_ip(url) {
        Some(ip) if !allow_private && !is_global(ip) => {
            Err(refused(url.host_str().unwrap_or("?"), ip))
        }
        _ => Ok(()),
    }
}

/// The `PUT /api/v1/settings` check of a destination: unless private destinations are allowed,
/// a literal IP must be global, and a host name must resolve (now) to global addresses only.
pub async fn check_destination(url: &Url, allow_private: bool) -> Result<(), String> {
    if allow_private {
        return Ok(());
    }
    check_literal(url, false)?;
    let Some(url::Host::Domain(host)) = url.host() else {
        return Ok(());
    };
    let port = url.port_or_known_default().unwrap_or(443);
    let addrs = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port)))
        .await
        .map_err(|_| format!("{host} did not resolve within {RESOLVE_TIMEOUT:?}"))?
        .map_err(|e| format!("{host} does not resolve ({e})"))?;
    let mut any = false;
    for a in addrs {
        any = true;
        if !is_global(a.ip()) {
            return Err(refused(host, a.ip()));
        }
    }
    if !any {
        return Err(format!("{host} resolves to no address"));
    }
    Ok(())
}

/// A resolver that drops non-global addresses (see the module doc); a name left with none is
/// an error naming the host.
#[derive(Debug, Clone, Copy)]
struct GlobalOnly;

impl Resolve for GlobalOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let global: Vec<SocketAddr> =
                all.iter().copied().filter(|a| is_global(a.ip())).collect();
            if global.is_empty() {
                let msg = match all.first() {
                    Some(a) => refused(&host, a.ip()),
                    None => format!("{host} resolves to no address"),
                };
                return Err(msg.into());
            }
            Ok(Box::new(global.into_iter()) as Addrs)
        })
    }
}

/// How alerts are delivered: the HTTP client and the destination policy.
#[derive(Clone, Debug)]
pub struct Webhooks {
    /// The client: trusted roots, resolver, no redirects, no proxy, timeouts.
    pub http: reqwest::Client,
    /// `--webhook-allow-private`.
    pub allow_private: bool,
}

impl Webhooks {
    /// The client for `--webhook-allow-private` = `allow_private`, trusting the platform roots,
    /// `SSL_CERT_FILE` and `ca_file` (`--webhook-ca`). An unreadable CA file is an error naming
    /// it.
    pub fn new(allow_private: bool, ca_file: Option<&Path>) -> Result<Self, String> {
        sluice_protocol::tls::install_provider();
        let roots = sluice_protocol::tls::all_roots(ca_file)?;
        let certs = roots
            .iter()
            .map(|c| reqwest::Certificate::from_der(c.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("a trusted root certificate is unusable: {e}"))?;
        let mut b = reqwest::Client::builder()
            .tls_backend_rustls()
            .tls_certs_only(certs)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(POST_TIMEOUT)
            .user_agent(concat!("sluice-manager/", env!("CARGO_PKG_VERSION")));
        if !allow_private {
            b = b.dns_resolver(Arc::new(GlobalOnly));
        }
        let http = b
            .build()
            .map_err(|e| format!("cannot build the webhook client: {e}"))?;
        Ok(Self {
            http,
            allow_private,
        })
    }
}

/// A short fingerprint of a webhook URL (hex of the first 16 bytes of its SHA-256): how a
/// delivery is recorded in `NS:alerts:sent` without storing the URL.
pub fn fingerprint(url: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, url.as_bytes());
    d.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The text of an error and its sources, without any URL: reqwest's own messages name the URL
/// they were sending to, so it is dropped first.
pub fn error_text(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syntax_errors_never_repeat_the_url() {
        for bad in [
            "ftp://host/s3cretpath",
            "https://user:s3cretpw@host/x",
            "https://s3cretuser@host/x",
            "not a url s3cret",
            "file:///s3cret",
        ] {
            let e = check_syntax(bad).unwrap_err();
            assert!(!e.contains("s3cret"), "{bad}: {e}");
        }
        assert!(check_syntax("https://hooks.slack.com/services/T/B/x").is_ok());
    }

    #[tokio::test]
    async fn destinations() {
        for bad in [
            "http://127.0.0.1:9/x",
            "http://[::1]/x",
            "http://169.254.169.254/latest/meta-data",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://localhost:8080/x",
            "http://10.0.0.1/",
        ] {
            let url = check_syntax(bad).unwrap();
            let e = check_destination(&url, false).await.unwrap_err();
            assert!(e.contains("--webhook-allow-private"), "{bad}: {e}");
            assert!(check_destination(&url, true).await.is_ok());
        }
        let url = check_syntax("http://1.1.1.1/x").unwrap();
        assert!(check_destination(&url, false).await.is_ok());
    }

    #[test]
    fn fingerprints_are_stable_and_short() {
        assert_eq!(fingerprint("abc"), "ba7816bf8f01cfea414140de5dae2223");
    }
}
