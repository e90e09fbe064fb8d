//! TLS configuration (rustls with the aws-lc-rs provider), shared by the
//! NBD port, the control API and the replica protocol: PEM loading, server
//! configurations that optionally require client certificates signed by a
//! CA (what qemu-nbd's `tls-creds-x509,verify-peer=on` and nbdkit's
//! `--tls-verify-peer` do), and client configurations that verify the
//! server against a CA and may present a certificate.
//!
//! aws-lc-rs rather than ring: ring refuses RSA keys whose size is not one
//! it knows (e.g. the 2432-bit key of the NBD reference project's test
//! certificates: "failed to parse private key"); aws-lc-rs loads them.

use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Errors loading TLS material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("no certificate found in {0}")]
    NoCertificate(String),
    #[error("no private key found in {0}")]
    NoKey(String),
    #[error("{path}: {cause}")]
    Invalid { path: String, cause: String },
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The crypto provider every configuration here uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|cause| TlsError::Read {
        path: path.display().to_string(),
        cause,
    })
}

fn parse_certs(pem: &[u8], name: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<_, _>>()
        .map_err(|cause| TlsError::Read {
            path: name.to_string(),
            cause,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(name.to_string()));
    }
    Ok(certs)
}

fn parse_key(pem: &[u8], name: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut &pem[..])
        .map_err(|cause| TlsError::Read {
            path: name.to_string(),
            cause,
        })?
        .ok_or_else(|| TlsError::NoKey(name.to_string()))
}

/// Certificates (PEM, leaf first) from a file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    parse_certs(&read(path)?, &path.display().to_string())
}

/// A PKCS#8, PKCS#1 or SEC1 private key (PEM) from a file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    parse_key(&read(path)?, &path.display().to_string())
}

/// Every certificate of a CA file as trust anchors.
pub fn load_roots(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|cause| TlsError::Invalid {
            path: path.display().to_string(),
            cause: format!("not a usable CA certificate: {cause}"),
        })?;
    }
    Ok(roots)
}

/// A server configuration from PEM files: its certificate chain and key,
/// and with `client_ca` every client must present a certificate signed by
/// that CA (the handshake of any other client fails, and the server logs
/// why).
pub fn server_config(
    cert_path: &Path,
    key_path: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs = load_certs(cert_path)?;
    let key = load_key(key_path)?;
    let provider = provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(load_roots(ca)?),
                provider,
            )
            .build()
            .map_err(|cause| TlsError::Invalid {
                path: ca.display().to_string(),
                cause: format!("building the client certificate verifier: {cause}"),
            })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(builder.with_single_cert(certs, key)?))
}

/// Build a rustls server configuration from PEM files: a certificate chain
/// (leaf first) and a PKCS#8, PKCS#1 or SEC1 private key. No client auth.
pub fn server_config_from_pem_files(
    cert_path: &Path,
    key_path: &Path,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    server_config(cert_path, key_path, None)
}

/// Like [`server_config_from_pem_files`] with in-memory PEM; names are for messages.
pub fn server_config_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
    cert_name: &str,
    key_name: &str,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs = parse_certs(cert_pem, cert_name)?;
    let key = parse_key(key_pem, key_name)?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    Ok(Arc::new(config))
}

/// A client configuration that trusts only `ca` for the server's
/// certificate and, with `identity` (certificate, key), presents it.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let roots = load_roots(ca)?;
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => builder.with_client_auth_cert(load_certs(cert)?, load_key(key)?)?,
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}
