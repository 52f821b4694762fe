//! An HTTPS front for tests of TLS clients (`poolmgr-client`, `poolmgrctl`): it terminates TLS
//! with a certificate for `localhost` and `127.0.0.1` that a CA generated for the test signed,
//! and relays each connection's bytes to a plain-HTTP upstream (a
//! [`LocalServer`](crate::local::LocalServer)'s endpoint). Never used outside tests.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::tls::TestCa;

/// A listening HTTPS front; it stops with the test's runtime.
pub struct HttpsFront {
    /// `https://localhost:PORT`
    pub endpoint: String,
    /// The CA that signed its certificate (PEM): what a client must trust.
    pub ca_pem: String,
    pub addr: SocketAddr,
}

impl HttpsFront {
    /// Serves `upstream` (`http://HOST:PORT`) over HTTPS on a free loopback port.
    pub async fn start(upstream: &str) -> HttpsFront {
        let upstream: SocketAddr = upstream.trim_start_matches("http://").parse().expect("an http://IP:PORT upstream");
        let ca = TestCa::generate("poolmgr test HTTPS CA");
        let (cert_pem, key_pem) = ca.server_cert(&["localhost", "127.0.0.1"]);
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert_pem.as_bytes()).collect::<Result<_, _>>().expect("certificate PEM");
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key PEM");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("server certificate");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A client that refuses the certificate ends the handshake: nothing to relay.
                    let Ok(mut tls) = acceptor.accept(conn).await else { return };
                    let Ok(mut up) = TcpStream::connect(upstream).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                });
            }
        });
        HttpsFront { endpoint: format!("https://localhost:{}", addr.port()), ca_pem: ca.cert_pem, addr }
    }
}
