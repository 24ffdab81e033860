//! Certificates for TLS tests, made with the `openssl` command in a temporary directory: a
//! private CA and leaf certificates it signs (EC P-256, valid two days).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A private certificate authority in its own temporary directory.
#[derive(Debug)]
pub struct TestCa {
    /// The directory holding every file made here.
    pub dir: tempfile::TempDir,
    /// The CA certificate (PEM): what a client trusts.
    pub cert: PathBuf,
    /// The CA's private key.
    pub key: PathBuf,
}

/// A certificate signed by a [`TestCa`], and its key (PEM files).
#[derive(Debug, Clone)]
pub struct Leaf {
    /// The certificate.
    pub cert: PathBuf,
    /// Its private key (PKCS#8).
    pub key: PathBuf,
}

fn openssl(args: &[&str], cwd: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("openssl is needed by the TLS tests (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    /// A new CA whose subject is `CN=<name>`.
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
        openssl(
            &[
                "req",
                "-x509",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                &format!("/CN={name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
            dir.path(),
        );
        Self { dir, cert, key }
    }

    /// A leaf certificate for `sans` (`IP:127.0.0.1`, `DNS:localhost`, …), usable by servers
    /// and clients; files `<name>.pem` and `<name>.key` beside the CA's.
    pub fn issue(&self, name: &str, sans: &[&str]) -> Leaf {
        let d = self.dir.path();
        let ext = d.join(format!("{name}.ext"));
        std::fs::write(
            &ext,
            format!(
                "subjectAltName={}\nbasicConstraints=critical,CA:FALSE\n\
                 keyUsage=critical,digitalSignature,keyEncipherment\n\
                 extendedKeyUsage=serverAuth,clientAuth\n",
                sans.join(",")
            ),
        )
        .expect("write ext");
        let (key, csr, cert) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        openssl(
            &[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={name}"),
            ],
            d,
        );
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &cert,
                "-days",
                "2",
                "-extfile",
                ext.to_str().expect("utf-8 path"),
            ],
            d,
        );
        Leaf {
            cert: d.join(cert),
            key: d.join(key),
        }
    }
}
