//! TLS for every PostgreSQL connection poolmgr opens, with rustls: which `sslmode` a URL asks
//! for, what each mode verifies, and what the server's certificate is checked against
//! (`POOLMGR_DATABASE_CA_PEM`, else the Mozilla roots compiled into the binary, which include
//! Amazon's, so RDS Proxy's certificates verify without configuration).
//!
//! [`crate::db`] opens its pool, its dedicated connections (migrations, tools) and the store's
//! cancel requests through here. Never: connect in plaintext when the mode asks for TLS, or
//! skip a check the mode asks for.
//!
//! | `sslmode` | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (default for a loopback host or a Unix socket) | if the server offers it, else plaintext | not checked; with `POOLMGR_DATABASE_CA_PEM` its chain is |
//! | `require` | always | as `prefer` |
//! | `verify-ca` | always | chain to the CA of `POOLMGR_DATABASE_CA_PEM` (refused without one); any host name |
//! | `verify-full` (default for any other host) | always | chain to a trusted root (the CA PEM, else the compiled-in roots), and issued for the host name of the URL |
//!
//! That is libpq's table, with `POOLMGR_DATABASE_CA_PEM` in the place of libpq's root
//! certificate file (whose presence makes libpq check the chain under `prefer` and `require`
//! too). A URL without `sslmode` gets `POOLMGR_DATABASE_SSLMODE`; unset, `verify-full` unless
//! every host of the URL is loopback (`localhost`, 127.0.0.0/8, `::1`) or a Unix socket, where
//! `prefer` keeps a local server working without certificates: a server reached over a
//! network is never downgradable by default. Two departures from libpq, both to fail closed:
//! `verify-ca` without `POOLMGR_DATABASE_CA_PEM` is refused (against the compiled-in public
//! roots it would accept any certificate any public CA issued, for any name), and `allow`
//! (plaintext first) is refused: tokio-postgres cannot do it.

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, LazyLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, verify_server_name};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

/// A connection's `sslmode`, libpq's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub fn parse(s: &str) -> Result<SslMode, String> {
        match s.trim() {
            "disable" => Ok(SslMode::Disable),
            "prefer" => Ok(SslMode::Prefer),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            "allow" => Err("sslmode=allow is not supported (plaintext first, TLS on refusal); use prefer, \
                            or disable for plaintext"
                .into()),
            other => Err(format!("unknown sslmode {other:?}: use disable, prefer, require, verify-ca or verify-full")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// What tokio-postgres is told: it knows only whether to ask for TLS and whether to
    /// insist; the verify modes are enforced by the certificate verifier.
    fn wire(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => tokio_postgres::config::SslMode::Require,
        }
    }
}

/// The TLS settings of the process: the `sslmode` for URLs that name none, and the trust
/// anchors. Cheap to clone.
#[derive(Clone)]
pub struct DbTls {
    /// `POOLMGR_DATABASE_SSLMODE`: the mode of a URL without `sslmode`; `None`: by its hosts
    /// ([`DbTls::mode_for`]).
    default_mode: Option<SslMode>,
    /// `POOLMGR_DATABASE_CA_PEM`, parsed; `None`: the compiled-in roots.
    ca: Option<Arc<RootCertStore>>,
}

impl Default for DbTls {
    /// The mode by the URL's hosts, no private CA.
    fn default() -> Self {
        DbTls { default_mode: None, ca: None }
    }
}

impl fmt::Debug for DbTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DbTls")
            .field("default_mode", &self.default_mode)
            .field("ca_certificates", &self.ca.as_ref().map(|r| r.len()))
            .finish()
    }
}

impl DbTls {
    /// Reads `POOLMGR_DATABASE_SSLMODE` and `POOLMGR_DATABASE_CA_PEM` (PEM text, recognised by
    /// its `-----BEGIN`, or else the path of a PEM file). The error says what to fix.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<DbTls, String> {
        let mut tls = DbTls::default();
        if let Some(mode) = lookup("POOLMGR_DATABASE_SSLMODE").filter(|s| !s.trim().is_empty()) {
            tls.default_mode = Some(SslMode::parse(&mode).map_err(|e| format!("POOLMGR_DATABASE_SSLMODE: {e}"))?);
        }
        if let Some(ca) = lookup("POOLMGR_DATABASE_CA_PEM").filter(|s| !s.trim().is_empty()) {
            let pem = if ca.trim_start().starts_with("-----BEGIN") {
                ca.into_bytes()
            } else {
                std::fs::read(ca.trim()).map_err(|e| {
                    format!(
                        "POOLMGR_DATABASE_CA_PEM: cannot read {:?} ({e}); give the PEM text itself or the path of \
                         a readable PEM file",
                        ca.trim()
                    )
                })?
            };
            tls = tls.with_ca_pem(&pem).map_err(|e| format!("POOLMGR_DATABASE_CA_PEM: {e}"))?;
        }
        Ok(tls)
    }

    /// [`DbTls::from_lookup`] over the process environment, for command-line tools.
    pub fn from_env() -> Result<DbTls, String> {
        DbTls::from_lookup(|k| std::env::var(k).ok())
    }

    /// Trust exactly the certificates in `pem` (one or more `CERTIFICATE` blocks) instead
    /// of the compiled-in roots.
    pub fn with_ca_pem(self, pem: &[u8]) -> Result<DbTls, String> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| format!("not valid PEM: {e}"))?;
            roots.add(cert).map_err(|e| format!("a certificate that is not a usable CA: {e}"))?;
        }
        if roots.is_empty() {
            return Err("no CERTIFICATE block found: give the PEM of the CA that signed the server's \
                        certificate"
                .into());
        }
        Ok(DbTls { ca: Some(Arc::new(roots)), ..self })
    }

    /// The mode of URLs that name no `sslmode`.
    pub fn with_default_mode(self, mode: SslMode) -> DbTls {
        DbTls { default_mode: Some(mode), ..self }
    }

    /// `POOLMGR_DATABASE_SSLMODE`; `None`: chosen per URL by [`DbTls::mode_for`].
    pub fn default_mode(&self) -> Option<SslMode> {
        self.default_mode
    }

    /// The mode of a URL that names no `sslmode`, for a URL with these hosts: the configured
    /// one, else `prefer` when every host is on this machine (loopback or a Unix socket) and
    /// `verify-full` otherwise.
    fn mode_for(&self, hosts: &[tokio_postgres::config::Host]) -> SslMode {
        use tokio_postgres::config::Host;
        self.default_mode.unwrap_or_else(|| {
            let local = |h: &Host| match h {
                Host::Unix(_) => true,
                Host::Tcp(name) => {
                    let name = name.trim_start_matches('[').trim_end_matches(']');
                    name.eq_ignore_ascii_case("localhost")
                        || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
                }
            };
            if !hosts.is_empty() && hosts.iter().all(local) { SslMode::Prefer } else { SslMode::VerifyFull }
        })
    }

    /// Parses `url` (a `postgres://` URL or `key=value` pairs) with its `sslmode` taken out
    /// (tokio-postgres knows no `verify-*`), and builds the connector that enforces it.
    /// Returns the mode too, for messages.
    pub fn connect_config(&self, url: &str) -> Result<(tokio_postgres::Config, MakeRustlsConnect, SslMode), String> {
        let (rest, mode) = split_sslmode(url)?;
        let mut pg: tokio_postgres::Config = rest.parse().map_err(|e: tokio_postgres::Error| {
            let mut msg = e.to_string();
            if rest.contains("sslrootcert") {
                msg.push_str("; give the CA in POOLMGR_DATABASE_CA_PEM instead of sslrootcert");
            }
            msg
        })?;
        let mode = mode.unwrap_or_else(|| self.mode_for(pg.get_hosts()));
        if mode == SslMode::VerifyCa && self.ca.is_none() {
            return Err("sslmode=verify-ca checks only that the server's certificate chains to a trusted CA, and \
                        without POOLMGR_DATABASE_CA_PEM those are the public roots compiled in: any certificate \
                        any public CA issued, for any name, would pass. Set POOLMGR_DATABASE_CA_PEM to the CA \
                        that signed your server's certificate, or use sslmode=verify-full"
                .into());
        }
        pg.ssl_mode(mode.wire());
        let verifier = Arc::new(PgServerVerifier {
            roots: match mode {
                SslMode::Disable => None,
                SslMode::Prefer | SslMode::Require => self.ca.clone(),
                // verify-ca has a CA (checked above).
                SslMode::VerifyCa | SslMode::VerifyFull => {
                    Some(self.ca.clone().unwrap_or_else(|| WEBPKI_ROOTS.clone()))
                }
            },
            check_name: mode == SslMode::VerifyFull,
            algorithms: PROVIDER.signature_verification_algorithms,
        });
        Ok((pg, MakeRustlsConnect::new(client_config(verifier)), mode))
    }
}

/// The TLS of a cancel request. A cancel carries no credentials, only the backend's id and
/// cancel key, whose worst use (cancelling our statement) is within reach of anyone on the
/// path anyway, so it is encrypted when the connection was but its certificate not checked:
/// the store needs no trust anchors to cancel. tokio-postgres encrypts it exactly when the
/// cancelled connection's mode asks for TLS.
pub(crate) fn cancel_connector() -> MakeRustlsConnect {
    static CANCEL: LazyLock<MakeRustlsConnect> = LazyLock::new(|| {
        MakeRustlsConnect::new(client_config(Arc::new(PgServerVerifier {
            roots: None,
            check_name: false,
            algorithms: PROVIDER.signature_verification_algorithms,
        })))
    });
    CANCEL.clone()
}

/// ring, the provider tonic and reqwest already link.
static PROVIDER: LazyLock<Arc<CryptoProvider>> = LazyLock::new(|| Arc::new(rustls::crypto::ring::default_provider()));

static WEBPKI_ROOTS: LazyLock<Arc<RootCertStore>> =
    LazyLock::new(|| Arc::new(RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() }));

fn client_config(verifier: Arc<PgServerVerifier>) -> ClientConfig {
    ClientConfig::builder_with_provider(PROVIDER.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports TLS 1.2 and 1.3")
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth()
}

/// One verifier for every mode: the handshake's signatures are always checked (the server
/// holds the key of the certificate it shows); the chain only with `roots`; the host name only
/// with `check_name`. rustls's `WebPkiServerVerifier` always checks the name, which
/// `verify-ca` must not, hence the two steps spelled out here.
#[derive(Debug)]
struct PgServerVerifier {
    roots: Option<Arc<RootCertStore>>,
    check_name: bool,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PgServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(roots) = &self.roots else {
            return Ok(ServerCertVerified::assertion());
        };
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(&cert, roots, intermediates, now, self.algorithms.all)?;
        if self.check_name {
            verify_server_name(&cert, server_name)?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// `url` without its `sslmode`, and that mode. A URL (`postgres://…?a=b&sslmode=…`) or
/// libpq's `key=value` form (`host=… sslmode=…`); the last `sslmode` wins, as in libpq.
fn split_sslmode(url: &str) -> Result<(Cow<'_, str>, Option<SslMode>), String> {
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if is_url {
        let Some((base, query)) = url.split_once('?') else {
            return Ok((Cow::Borrowed(url), None));
        };
        let mut mode = None;
        let mut kept = Vec::new();
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some(("sslmode", value)) => mode = Some(SslMode::parse(value)?),
                _ => kept.push(pair),
            }
        }
        if mode.is_none() {
            return Ok((Cow::Borrowed(url), None));
        }
        let rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
        return Ok((Cow::Owned(rest), mode));
    }
    static KEY_VALUE: LazyLock<regex::Regex> =
        LazyLock::new(|| regex::Regex::new(r"(^|\s)sslmode\s*=\s*('[^']*'|\S*)").expect("valid regex"));
    let mut mode = None;
    for c in KEY_VALUE.captures_iter(url) {
        mode = Some(SslMode::parse(c[2].trim_matches('\''))?);
    }
    if mode.is_none() {
        return Ok((Cow::Borrowed(url), None));
    }
    Ok((KEY_VALUE.replace_all(url, "$1"), mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(url: &str) -> (String, Option<SslMode>) {
        let (rest, mode) = split_sslmode(url).unwrap();
        (rest.into_owned(), mode)
    }

    #[test]
    fn sslmode_is_taken_out_of_urls_and_key_value_strings() {
        assert_eq!(mode_of("postgres://u@h/db"), ("postgres://u@h/db".into(), None));
        assert_eq!(
            mode_of("postgres://u@h/db?sslmode=verify-full"),
            ("postgres://u@h/db".into(), Some(SslMode::VerifyFull))
        );
        assert_eq!(
            mode_of("postgresql://u@h/db?application_name=x&sslmode=verify-ca&connect_timeout=3"),
            ("postgresql://u@h/db?application_name=x&connect_timeout=3".into(), Some(SslMode::VerifyCa))
        );
        assert_eq!(mode_of("host=h sslmode=require dbname=d"), ("host=h  dbname=d".into(), Some(SslMode::Require)));
        assert_eq!(mode_of("sslmode='disable' host=h"), (" host=h".into(), Some(SslMode::Disable)));
        assert_eq!(mode_of("host=h user=u"), ("host=h user=u".into(), None));
        // The last one wins, as in libpq.
        assert_eq!(mode_of("postgres://h/d?sslmode=disable&sslmode=prefer").1, Some(SslMode::Prefer));
    }

    #[test]
    fn unknown_and_unsupported_sslmodes_are_refused_with_the_choices() {
        let err = split_sslmode("postgres://h/d?sslmode=verify_full").unwrap_err();
        assert!(err.contains("verify-full"), "{err}");
        let err = split_sslmode("host=h sslmode=allow").unwrap_err();
        assert!(err.contains("not supported"), "{err}");
        let err = DbTls::from_lookup(|k| (k == "POOLMGR_DATABASE_SSLMODE").then(|| "strict".into())).unwrap_err();
        assert!(err.starts_with("POOLMGR_DATABASE_SSLMODE"), "{err}");
    }

    #[test]
    fn the_url_mode_wins_over_the_default_and_the_default_fills_in() {
        let tls = DbTls::default().with_default_mode(SslMode::VerifyFull);
        let (pg, _, mode) = tls.connect_config("postgres://u@h/d").unwrap();
        assert_eq!(mode, SslMode::VerifyFull);
        assert_eq!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        let (pg, _, mode) = tls.connect_config("postgres://u@h/d?sslmode=disable").unwrap();
        assert_eq!(mode, SslMode::Disable);
        assert_eq!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Disable);
        // Without POOLMGR_DATABASE_SSLMODE a remote host gets verify-full.
        assert_eq!(DbTls::default().connect_config("host=h").unwrap().2, SslMode::VerifyFull);
    }

    #[test]
    fn without_a_configured_mode_only_a_server_on_this_machine_gets_prefer() {
        let mode = |url: &str| DbTls::default().connect_config(url).unwrap().2;
        for local in [
            "postgres://u@localhost/d",
            "postgres://u@LocalHost:5433/d",
            "postgres://u@127.0.0.1/d",
            "postgres://u@127.9.8.7/d",
            "postgres://u@[::1]:5433/d",
            "host=/var/run/postgresql dbname=d",
            "host=localhost,127.0.0.1 dbname=d",
        ] {
            assert_eq!(mode(local), SslMode::Prefer, "{local}");
        }
        for remote in [
            "postgres://u@db.example/d",
            "postgres://u@10.0.0.5/d",
            "postgres://u@[2001:db8::1]/d",
            "postgres://u@localhost.example/d",
            // One remote host among local ones: the whole URL is remote.
            "host=localhost,db.example dbname=d",
            // The name is what TLS checks, whatever address it is reached at.
            "host=db.example hostaddr=127.0.0.1 dbname=d",
        ] {
            assert_eq!(mode(remote), SslMode::VerifyFull, "{remote}");
        }
        // A configured mode applies to every host.
        let tls = DbTls::default().with_default_mode(SslMode::Require);
        assert_eq!(tls.connect_config("postgres://u@localhost/d").unwrap().2, SslMode::Require);
        assert_eq!(tls.connect_config("postgres://u@db.example/d").unwrap().2, SslMode::Require);
    }

    #[test]
    fn verify_ca_without_a_ca_of_its_own_is_refused_with_what_to_set() {
        let err = DbTls::default().connect_config("postgres://u@db.example/d?sslmode=verify-ca").err().unwrap();
        assert!(err.contains("POOLMGR_DATABASE_CA_PEM") && err.contains("verify-full"), "{err}");
        let err = DbTls::default().with_default_mode(SslMode::VerifyCa).connect_config("host=h").err().unwrap();
        assert!(err.contains("POOLMGR_DATABASE_CA_PEM"), "{err}");
    }

    #[test]
    fn a_ca_pem_without_certificates_or_an_unreadable_path_is_refused() {
        let err = DbTls::default().with_ca_pem(b"just text").unwrap_err();
        assert!(err.contains("no CERTIFICATE block"), "{err}");
        let err =
            DbTls::from_lookup(|k| (k == "POOLMGR_DATABASE_CA_PEM").then(|| "/nonexistent/ca.pem".into())).unwrap_err();
        assert!(err.contains("cannot read \"/nonexistent/ca.pem\""), "{err}");
        let err = DbTls::from_lookup(|k| {
            (k == "POOLMGR_DATABASE_CA_PEM")
                .then(|| "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n".into())
        })
        .unwrap_err();
        assert!(err.starts_with("POOLMGR_DATABASE_CA_PEM"), "{err}");
    }
}
