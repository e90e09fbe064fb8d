//! The CLI's client for the control API: one HTTP/1.1 request per
//! connection (hyper) over TCP, TLS or a Unix socket, JSON in and out.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context as _, Result};
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};

/// How to reach a server's control API (`vouch serve --control`).
#[derive(Args, Debug, Clone, Default)]
pub struct ServerArgs {
    /// Act on a running server through its control API instead of opening
    /// a stopped volume: HOST:PORT, http://HOST:PORT, https://HOST:PORT or
    /// a Unix socket path (containing '/').
    #[arg(long, value_name = "ADDR")]
    pub server: Option<String>,
    /// Send 'Authorization: Bearer TOKEN' (the file's contents, trimmed).
    #[arg(long, value_name = "FILE", requires = "server")]
    pub token_file: Option<PathBuf>,
    /// Use TLS and trust this CA (PEM) for the server's certificate.
    #[arg(long, value_name = "FILE", requires = "server")]
    pub tls_ca: Option<PathBuf>,
    /// TLS client certificate chain (PEM), for --control-tls-client-ca.
    #[arg(long, value_name = "FILE", requires_all = ["server", "tls_key"])]
    pub tls_cert: Option<PathBuf>,
    /// TLS client private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

enum Target {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

/// A control API client; blocking calls over a private runtime.
pub struct Client {
    target: Target,
    token: Option<String>,
    tls: Option<tokio_rustls::TlsConnector>,
    runtime: tokio::runtime::Runtime,
}

fn read(path: &PathBuf) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

fn tls_connector(args: &ServerArgs) -> Result<tokio_rustls::TlsConnector> {
    let Some(ca) = &args.tls_ca else {
        bail!("an https:// --server needs --tls-ca FILE (the CA that signed its certificate)");
    };
    let identity = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
        _ => None,
    };
    let config = vouch_nbd::tls::client_config(ca, identity)
        .context("loading the control client's TLS configuration")?;
    Ok(tokio_rustls::TlsConnector::from(config))
}

impl Client {
    pub fn new(args: &ServerArgs) -> Result<Client> {
        let text = args.server.as_deref().context("no --server")?;
        let (https, rest) = if let Some(rest) = text.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = text.strip_prefix("http://") {
            (false, rest)
        } else {
            (args.tls_ca.is_some(), text)
        };
        let rest = rest.trim_end_matches('/');
        let target = if text.contains('/') && !text.contains("://") {
            Target::Unix(PathBuf::from(text))
        } else {
            let (host, port) = rest.rsplit_once(':').with_context(|| {
                format!("--server {text:?}: expected HOST:PORT or a socket path")
            })?;
            let port = port
                .parse()
                .with_context(|| format!("--server {text:?}: bad port {port:?}"))?;
            Target::Tcp {
                host: host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string(),
                port,
            }
        };
        let token = match &args.token_file {
            Some(path) => Some(
                String::from_utf8(read(path)?)
                    .with_context(|| format!("{} is not text", path.display()))?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        let tls = if https {
            Some(tls_connector(args)?)
        } else {
            None
        };
        if tls.is_some() && matches!(target, Target::Unix(_)) {
            bail!("TLS applies to a TCP --server, not a Unix socket");
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Client {
            target,
            token,
            tls,
            runtime,
        })
    }

    /// One request; a 2xx answer's JSON, or an error with the server's message.
    pub fn call(&self, method: Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let (status, value) = self
            .runtime
            .block_on(self.send(method.clone(), path, body))?;
        if status.is_success() {
            return Ok(value);
        }
        let message = value["error"]
            .as_str()
            .map_or_else(|| value.to_string(), str::to_string);
        Err(anyhow!("{method} {path}: {status}: {message}"))
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Value)> {
        let bytes = match body {
            Some(body) => Bytes::from(serde_json::to_vec(body)?),
            None => Bytes::new(),
        };
        let host = match &self.target {
            Target::Tcp { host, port } => format!("{host}:{port}"),
            Target::Unix(_) => "localhost".to_string(),
        };
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host)
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(token) = &self.token {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Full::new(bytes))?;
        match &self.target {
            Target::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path)
                    .await
                    .with_context(|| {
                        format!("connecting to the control socket {}", path.display())
                    })?;
                exchange(stream, request).await
            }
            Target::Tcp { host, port } => {
                let stream = tokio::net::TcpStream::connect((host.as_str(), *port))
                    .await
                    .with_context(|| format!("connecting to the control API at {host}:{port}"))?;
                match &self.tls {
                    Some(tls) => {
                        let name = rustls::pki_types::ServerName::try_from(host.clone())
                            .with_context(|| format!("{host:?} is not a TLS server name"))?;
                        let stream = tls
                            .connect(name, stream)
                            .await
                            .with_context(|| format!("TLS handshake with {host}:{port}"))?;
                        exchange(stream, request).await
                    }
                    None => exchange(stream, request).await,
                }
            }
        }
    }
}

async fn exchange<S>(stream: S, request: Request<Full<Bytes>>) -> Result<(StatusCode, Value)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("HTTP handshake with the control API")?;
    let driver = tokio::spawn(connection);
    let response = sender
        .send_request(request)
        .await
        .context("sending a control request")?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .context("reading a control response")?
        .to_bytes();
    driver.abort();
    let value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap_or_else(
            |_| serde_json::json!({"error": String::from_utf8_lossy(&body).trim().to_string()}),
        )
    };
    Ok((status, value))
}
