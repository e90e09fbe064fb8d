//! TLS for the replica protocol: the server presents a certificate and
//! requires a client certificate signed by a CA it is given (only its
//! exporter may connect); the exporter verifies the server against a CA
//! and presents its own certificate.

use std::path::Path;
use std::sync::Arc;

/// PEM files of one side.
#[derive(Clone, Debug)]
pub struct TlsFiles<'a> {
    /// This side's certificate chain (leaf first).
    pub cert: &'a Path,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: &'a Path,
    /// The CA that signs the other side's certificate.
    pub ca: &'a Path,
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|error| format!("reading {}: {error}", path.display()))
}

fn certificates(path: &Path) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut &read(path)?[..])
        .collect::<Result<_, _>>()
        .map_err(|error| format!("parsing {}: {error}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate in {}", path.display()));
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<rustls::pki_types::PrivateKeyDer<'static>, String> {
    rustls_pemfile::private_key(&mut &read(path)?[..])
        .map_err(|error| format!("parsing {}: {error}", path.display()))?
        .ok_or_else(|| format!("no private key in {}", path.display()))
}

fn roots(path: &Path) -> Result<Arc<rustls::RootCertStore>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(path)? {
        roots
            .add(cert)
            .map_err(|error| format!("adding a CA from {}: {error}", path.display()))?;
    }
    Ok(Arc::new(roots))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The replica server's configuration: client certificates required,
/// verified against `files.ca`.
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, String> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(files.ca)?, provider())
            .build()
            .map_err(|error| format!("client certificate verifier: {error}"))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|error| error.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certificates(files.cert)?, private_key(files.key)?)
        .map_err(|error| {
            format!(
                "{} and {} do not make a certificate and key: {error}",
                files.cert.display(),
                files.key.display()
            )
        })?;
    Ok(Arc::new(config))
}

/// The exporter's configuration: the replica verified against `files.ca`,
/// this side's certificate presented.
pub fn client_config(files: &TlsFiles) -> Result<Arc<rustls::ClientConfig>, String> {
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|error| error.to_string())?
        .with_root_certificates(roots(files.ca)?)
        .with_client_auth_cert(certificates(files.cert)?, private_key(files.key)?)
        .map_err(|error| {
            format!(
                "{} and {} do not make a certificate and key: {error}",
                files.cert.display(),
                files.key.display()
            )
        })?;
    Ok(Arc::new(config))
}
