//! TLS configuration helpers (rustls with the ring provider).

use std::path::Path;
use std::sync::Arc;

/// Errors loading TLS material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("no certificate found in {0}")]
    NoCertificate(String),
    #[error("no private key found in {0}")]
    NoKey(String),
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Build a rustls server configuration from PEM files: a certificate chain
/// (leaf first) and a PKCS#8, PKCS#1 or SEC1 private key. No client auth.
pub fn server_config_from_pem_files(
    cert_path: &Path,
    key_path: &Path,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|cause| TlsError::Read {
            path: path.display().to_string(),
            cause,
        })
    };
    let cert_pem = read(cert_path)?;
    let key_pem = read(key_path)?;
    server_config_from_pem(
        &cert_pem,
        &key_pem,
        &cert_path.display().to_string(),
        &key_path.display().to_string(),
    )
}

/// Like [`server_config_from_pem_files`] with in-memory PEM; names are for messages.
pub fn server_config_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
    cert_name: &str,
    key_name: &str,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut &cert_pem[..])
        .collect::<Result<_, _>>()
        .map_err(|cause| TlsError::Read {
            path: cert_name.to_string(),
            cause,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(cert_name.to_string()));
    }
    let key = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(|cause| TlsError::Read {
            path: key_name.to_string(),
            cause,
        })?
        .ok_or_else(|| TlsError::NoKey(key_name.to_string()))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)?;
    Ok(Arc::new(config))
}
