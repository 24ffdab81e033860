//! Test certificates, made with the `openssl` command in a temp dir: a CA, server
//! certificates for 127.0.0.1 / localhost, client certificates, and clients that trust the CA.
//!
//! Keys are EC P-256 (fast to make); certificates live one day.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// A test certificate authority in its own directory.
#[derive(Debug)]
pub struct TestCa {
    /// Where the files are.
    pub dir: tempfile::TempDir,
    /// The CA certificate (PEM).
    pub cert: PathBuf,
    key: PathBuf,
    name: String,
}

/// A certificate and its key, signed by a [`TestCa`].
#[derive(Debug, Clone)]
pub struct CertPair {
    /// Certificate (PEM).
    pub cert: PathBuf,
    /// Private key (PEM, PKCS#8).
    pub key: PathBuf,
}

fn openssl(args: &[&str], cwd: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl (is it installed?): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    /// A new CA named `name` (its subject CN).
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let cert = dir.path().join(format!("{name}.pem"));
        let key = dir.path().join(format!("{name}.key"));
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                &format!("/CN={name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
                "-keyout",
                key.to_str().unwrap(),
                "-out",
                cert.to_str().unwrap(),
            ],
            dir.path(),
        );
        Self {
            dir,
            cert,
            key,
            name: name.to_string(),
        }
    }

    /// A certificate for `cn`, valid as a server for 127.0.0.1 and localhost and as a client.
    pub fn issue(&self, cn: &str) -> CertPair {
        self.issue_for(cn, &["IP:127.0.0.1", "DNS:localhost"])
    }

    /// A certificate for `cn` with the subject alternative names `sans` (`IP:127.0.0.1`,
    /// `DNS:example.test`, …; none for a client-only certificate), valid as a server and as a
    /// client.
    pub fn issue_for(&self, cn: &str, sans: &[&str]) -> CertPair {
        let d = self.dir.path();
        let stem = format!("{}-{cn}", self.name);
        let key = d.join(format!("{stem}.key"));
        let csr = d.join(format!("{stem}.csr"));
        let cert = d.join(format!("{stem}.pem"));
        let ext = d.join(format!("{stem}.ext"));
        std::fs::write(
            &ext,
            format!(
                "basicConstraints=CA:FALSE\n\
                 keyUsage=critical,digitalSignature,keyEncipherment\n\
                 extendedKeyUsage=serverAuth,clientAuth\n{}",
                if sans.is_empty() {
                    String::new()
                } else {
                    format!("subjectAltName={}\n", sans.join(","))
                }
            ),
        )
        .expect("write ext");
        openssl(
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                &format!("/CN={cn}"),
                "-keyout",
                key.to_str().unwrap(),
                "-out",
                csr.to_str().unwrap(),
            ],
            d,
        );
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                csr.to_str().unwrap(),
                "-CA",
                self.cert.to_str().unwrap(),
                "-CAkey",
                self.key.to_str().unwrap(),
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                ext.to_str().unwrap(),
                "-out",
                cert.to_str().unwrap(),
            ],
            d,
        );
        CertPair { cert, key }
    }

    /// A rustls client configuration (ring) trusting only this CA, optionally presenting
    /// `identity`.
    pub fn client_config(&self, identity: Option<&CertPair>) -> rustls::ClientConfig {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(&self.cert).expect("CA pem") {
            roots.add(c.expect("CA cert")).expect("add CA");
        }
        let b = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
        match identity {
            None => b.with_no_client_auth(),
            Some(id) => {
                let certs = CertificateDer::pem_file_iter(&id.cert)
                    .expect("cert pem")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("certs");
                let key = PrivateKeyDer::from_pem_file(&id.key).expect("key");
                b.with_client_auth_cert(certs, key).expect("client auth")
            }
        }
    }

    /// A reqwest client (short timeouts, no proxy) trusting only this CA.
    pub fn https_client(&self) -> reqwest::Client {
        sluice_protocol::tls::install_provider();
        reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(3))
            .no_proxy()
            .tls_backend_preconfigured(self.client_config(None))
            .build()
            .expect("https client")
    }
}
