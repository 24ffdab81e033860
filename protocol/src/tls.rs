//! The one TLS stack of the workspace: rustls with the `ring` provider, and the trust roots
//! every TLS link (Redis, etcd, webhooks) uses.
//!
//! Trust, for every link: the platform's CA bundle (the first of the usual Linux paths that
//! exists), plus the bundle named by `SSL_CERT_FILE` when set, plus the CA file given for that
//! link (`--redis-ca`, `--etcd-ca`, …). `SSL_CERT_FILE` therefore *adds* to the platform roots
//! here (OpenSSL replaces them); a private CA can be trusted without losing the public ones.
//!
//! Secrets (passwords, tokens) can be read from files with [`read_secret_file`], so they never
//! sit in a process list.
//!
//! Everything but [`read_secret_file`] needs the feature `tls` (on by default).

use std::path::Path;

#[cfg(feature = "tls")]
use rustls::pki_types::pem::PemObject;
#[cfg(feature = "tls")]
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Where Linux distributions keep the platform CA bundle (Debian/Ubuntu, Fedora/RHEL,
/// openSUSE, Alpine).
#[cfg(feature = "tls")]
const PLATFORM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// Makes `ring` the process-wide rustls provider, unless one is installed already. Every
/// entry point that may open a TLS link calls this first; calling it again is harmless.
#[cfg(feature = "tls")]
pub fn install_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race against another thread installing one is fine: one is installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Reads the certificates of a PEM file. An unreadable file, a file that is not PEM, or one
/// with no certificate is an error naming the file.
#[cfg(feature = "tls")]
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate file ({e})", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in this file", path.display()));
    }
    Ok(certs)
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1). The error names the file, never the key.
#[cfg(feature = "tls")]
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|_| format!("{}: no PEM private key in this file", path.display()))
}

/// The platform bundle's certificates (empty when none of the usual paths exists or parses:
/// a container without `ca-certificates` can still trust a private CA given explicitly).
#[cfg(feature = "tls")]
pub fn platform_roots() -> Vec<CertificateDer<'static>> {
    for p in PLATFORM_BUNDLES {
        let path = Path::new(p);
        if path.exists()
            && let Ok(certs) = load_certs(path)
        {
            return certs;
        }
    }
    Vec::new()
}

/// The roots a link adds to the platform's: `SSL_CERT_FILE` (when set) and `ca_file` (the
/// link's own CA flag). A named file that cannot be read or parsed is an error naming it: a
/// typo in a CA path must fail at start-up, not as a handshake error later.
#[cfg(feature = "tls")]
pub fn extra_roots(ca_file: Option<&Path>) -> Result<Vec<CertificateDer<'static>>, String> {
    let mut out = Vec::new();
    if let Some(env) = std::env::var_os("SSL_CERT_FILE").filter(|v| !v.is_empty()) {
        out.extend(load_certs(Path::new(&env)).map_err(|e| format!("SSL_CERT_FILE: {e}"))?);
    }
    if let Some(ca) = ca_file {
        out.extend(load_certs(ca)?);
    }
    Ok(out)
}

/// Every root a link trusts: [`platform_roots`] + [`extra_roots`].
#[cfg(feature = "tls")]
pub fn all_roots(ca_file: Option<&Path>) -> Result<Vec<CertificateDer<'static>>, String> {
    let mut roots = platform_roots();
    roots.extend(extra_roots(ca_file)?);
    Ok(roots)
}

/// The same roots as one PEM bundle, for clients that take PEM bytes (redis, tonic).
#[cfg(feature = "tls")]
pub fn all_roots_pem(ca_file: Option<&Path>) -> Result<Vec<u8>, String> {
    Ok(to_pem(&all_roots(ca_file)?))
}

/// PEM-encodes certificates.
#[cfg(feature = "tls")]
pub fn to_pem(certs: &[CertificateDer<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in certs {
        out.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
        let b64 = base64_encode(c.as_ref());
        for line in b64.as_bytes().chunks(64) {
            out.extend_from_slice(line);
            out.push(b'\n');
        }
        out.extend_from_slice(b"-----END CERTIFICATE-----\n");
    }
    out
}

#[cfg(feature = "tls")]
fn base64_encode(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Reads a secret from a file: surrounding whitespace (the trailing newline editors add) is
/// dropped; an unreadable or empty file is an error naming the file, never its content.
pub fn read_secret_file(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let secret = text.trim();
    if secret.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(secret.to_string())
}

#[cfg(all(test, feature = "tls"))]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64_encode(input.as_bytes()), want, "{input:?}");
        }
    }

    #[test]
    fn pem_round_trips() {
        let certs = vec![
            CertificateDer::from(vec![1u8, 2, 3, 4, 5]),
            CertificateDer::from((0u8..=200).collect::<Vec<_>>()),
        ];
        let pem = to_pem(&certs);
        let back = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        assert_eq!(back, certs);
    }

    #[test]
    fn bad_files_are_named() {
        let dir = std::env::temp_dir().join(format!("sluice-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        assert!(load_certs(&missing).unwrap_err().contains("missing.pem"));
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        assert!(load_certs(&junk).unwrap_err().contains("junk.pem"));
        let key = dir.join("key.pem");
        std::fs::write(&key, "hunter2\n").unwrap();
        let e = load_key(&key).unwrap_err();
        assert!(e.contains("key.pem") && !e.contains("hunter2"), "{e}");
        let secret = dir.join("secret");
        std::fs::write(&secret, "  s3cret\n").unwrap();
        assert_eq!(read_secret_file(&secret).unwrap(), "s3cret");
        std::fs::write(&secret, "\n").unwrap();
        assert!(read_secret_file(&secret).unwrap_err().contains("empty"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
