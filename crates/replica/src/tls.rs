//! TLS for the replica protocol, on the workspace's one TLS module
//! (`vouch_nbd::tls`, aws-lc-rs): the replica server presents a
//! certificate and requires a client certificate signed by the CA it is
//! given (only its exporter may connect); the exporter verifies the
//! replica against a CA and presents its own certificate.

use std::path::Path;
use std::sync::Arc;

/// PEM files of one side.
#[derive(Clone, Copy, Debug)]
pub struct TlsFiles<'a> {
    /// This side's certificate chain (leaf first).
    pub cert: &'a Path,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: &'a Path,
    /// The CA that signs the other side's certificate.
    pub ca: &'a Path,
}

/// The replica server's configuration: client certificates required,
/// verified against `files.ca`.
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, String> {
    vouch_nbd::tls::server_config(files.cert, files.key, Some(files.ca))
        .map_err(|error| error.to_string())
}

/// The exporter's configuration: the replica verified against `files.ca`,
/// this side's certificate presented.
pub fn client_config(files: &TlsFiles) -> Result<Arc<rustls::ClientConfig>, String> {
    vouch_nbd::tls::client_config(files.ca, Some((files.cert, files.key)))
        .map_err(|error| error.to_string())
}
