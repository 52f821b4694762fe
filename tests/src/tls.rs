//! Throwaway certificate authorities for the TLS tests: `scripts/test.sh` writes one CA and a
//! server certificate for `localhost` with [`write_server_files`] (through the
//! `pg-test-certs` binary) before it starts the TLS test server; tests make strangers with
//! [`TestCa::generate`]. Never used outside tests: the keys are written unencrypted.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// A certificate authority: its certificate (PEM) and what it signs with.
pub struct TestCa {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    /// A new self-signed CA named `name`.
    pub fn generate(name: &str) -> TestCa {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("self-signed CA");
        TestCa { cert_pem: cert.pem(), issuer: Issuer::new(params, key) }
    }

    /// A server certificate for exactly these DNS names: (certificate PEM, PKCS#8 key PEM).
    pub fn server_cert(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().expect("server key");
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("server params");
        params.distinguished_name.push(DnType::CommonName, names.first().copied().unwrap_or("server"));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &self.issuer).expect("server certificate");
        (cert.pem(), key.serialize_pem())
    }
}

/// The name the TLS test server's certificate carries (and nothing else: not `127.0.0.1`, so
/// connecting by address is a wrong host name).
pub const SERVER_NAME: &str = "localhost";

/// Writes `ca.pem`, `server.crt` and `server.key` (mode 0600, as PostgreSQL requires) into
/// `dir`: a new CA and a certificate for [`SERVER_NAME`] it signed.
pub fn write_server_files(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let ca = TestCa::generate("poolmgr test CA");
    let (cert, key) = ca.server_cert(&[SERVER_NAME]);
    std::fs::write(dir.join("ca.pem"), &ca.cert_pem)?;
    std::fs::write(dir.join("server.crt"), cert)?;
    let mut f =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(dir.join("server.key"))?;
    f.write_all(key.as_bytes())
}
