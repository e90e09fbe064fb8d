//! `vouch serve --control ADDR`: the control API's listener (loopback TCP,
//! a Unix socket, or TLS), its guard rules, and its lifetime.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::api::{router, ApiState};
use super::jobs::Jobs;
use vouch_nbd::socket_file::SocketFile;

/// How long a TLS client may take to finish its handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Args, Debug, Default, Clone)]
pub struct ControlArgs {
    /// Serve the control API (JSON over HTTP, docs/PROTOCOL.md: verify,
    /// scrub, copy and compare jobs) on ADDR: a loopback TCP address
    /// (127.0.0.1:PORT, [::1]:PORT; port 0 picks one, printed) or a Unix
    /// socket path (anything containing '/'). It can change data (copy),
    /// so any other TCP address is refused unless --control-token-file or
    /// TLS with client certificates (--control-tls-client-ca) guards it.
    #[arg(long, value_name = "ADDR")]
    pub control: Option<String>,
    /// Require 'Authorization: Bearer TOKEN' on every control request
    /// (TOKEN: the file's contents, trimmed); others get 401.
    #[arg(long, value_name = "FILE", requires = "control")]
    pub control_token_file: Option<PathBuf>,
    /// Serve the control API over TLS with this certificate chain (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["control", "control_tls_key"])]
    pub control_tls_cert: Option<PathBuf>,
    /// The control API's TLS private key (PEM).
    #[arg(long, value_name = "FILE", requires = "control_tls_cert")]
    pub control_tls_key: Option<PathBuf>,
    /// Require TLS client certificates signed by this CA (PEM).
    #[arg(long, value_name = "FILE", requires = "control_tls_cert")]
    pub control_tls_client_ca: Option<PathBuf>,
}

/// Where the control API listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl ControlAddr {
    /// Anything containing '/' is a Unix socket path; else `HOST:PORT`.
    pub fn parse(text: &str) -> Result<ControlAddr> {
        if text.contains('/') {
            return Ok(ControlAddr::Unix(PathBuf::from(text)));
        }
        text.parse().map(ControlAddr::Tcp).map_err(|_| {
            anyhow::anyhow!(
                "{text:?} is neither an IP:PORT address (127.0.0.1:7000, [::1]:7000) nor a Unix socket path (containing '/')"
            )
        })
    }
}

/// How long open control connections may take to finish at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The running control API.
pub struct ControlServer {
    pub jobs: Arc<Jobs>,
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
    /// A Unix socket's file, removed when the server shuts down (or is
    /// dropped).
    socket_file: Option<SocketFile>,
}

impl ControlServer {
    /// Cancel every job and wait for their threads (a cancelled scrub keeps
    /// its cursor and resumes next time), then stop serving: when this
    /// returns nothing of the control API holds a volume any more, so
    /// `serve` can close them cleanly.
    pub async fn shutdown(self) {
        let jobs = self.jobs.clone();
        let _ = tokio::task::spawn_blocking(move || jobs.shutdown()).await;
        // The file goes while the listener is still open (see SocketFile).
        drop(self.socket_file);
        self.stop.send_replace(true);
        let mut task = self.task;
        if tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
            .await
            .is_err()
        {
            task.abort();
            let _ = task.await;
        }
    }
}

fn read_token(path: &PathBuf) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --control-token-file {}", path.display()))?;
    let token = text.trim().to_string();
    if token.is_empty() {
        bail!("--control-token-file {} is empty", path.display());
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!(
            "--control-token-file {}: the token must be one word (no spaces or control characters)",
            path.display()
        );
    }
    Ok(token)
}

fn tls_config(args: &ControlArgs) -> Result<Option<Arc<rustls::ServerConfig>>> {
    let (Some(cert), Some(key)) = (&args.control_tls_cert, &args.control_tls_key) else {
        return Ok(None);
    };
    let config = vouch_nbd::tls::server_config(cert, key, args.control_tls_client_ca.as_deref())
        .context("loading the control API's TLS configuration")?;
    Ok(Some(config))
}

/// The refusal for an unguarded non-loopback address, if it is one.
pub fn check_guard(addr: &ControlAddr, args: &ControlArgs) -> Result<()> {
    if let ControlAddr::Tcp(socket) = addr {
        let guarded = args.control_token_file.is_some()
            || (args.control_tls_cert.is_some() && args.control_tls_client_ca.is_some());
        if !socket.ip().is_loopback() && !guarded {
            bail!(
                "--control {socket} is not a loopback address: the control API can change data (copy), so it needs --control-token-file FILE or --control-tls-cert/--control-tls-key/--control-tls-client-ca"
            );
        }
    }
    Ok(())
}

/// TLS as an axum listener: handshakes run on their own tasks (a slow
/// client does not hold up others) and finished ones are handed over.
struct TlsListener {
    local: SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

impl TlsListener {
    fn new(listener: TcpListener, acceptor: TlsAcceptor) -> Result<TlsListener> {
        let local = listener.local_addr()?;
        let (sender, ready) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let acceptor = acceptor.clone();
                let sender = sender.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await
                    {
                        Ok(Ok(tls)) => {
                            let _ = sender.send((tls, peer)).await;
                        }
                        Ok(Err(error)) => {
                            tracing::info!("control TLS handshake from {peer}: {error}")
                        }
                        Err(_) => tracing::info!("control TLS handshake from {peer} timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { local, ready })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(ready) => ready,
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// Where a bound control API listens.
enum BoundControl {
    Tcp(TcpListener),
    Unix(UnixListener, SocketFile),
}

/// The control API's listener, bound but not serving yet: `vouch serve`
/// binds every listener before it announces any ([`ControlListener::url`]).
pub struct ControlListener {
    bound: BoundControl,
    token: Option<Arc<String>>,
    tls: Option<Arc<rustls::ServerConfig>>,
    url: String,
}

impl ControlListener {
    /// `http://ADDR`, `https://ADDR` or `unix:PATH`.
    pub fn url(&self) -> &str {
        &self.url
    }
}

/// Check `--control` and its guards, load the token and TLS material and
/// bind the listener; `None` without `--control`.
pub async fn bind(args: &ControlArgs) -> Result<Option<ControlListener>> {
    let Some(text) = &args.control else {
        return Ok(None);
    };
    let addr = ControlAddr::parse(text).context("--control")?;
    check_guard(&addr, args)?;
    let token = args
        .control_token_file
        .as_ref()
        .map(read_token)
        .transpose()?
        .map(Arc::new);
    let tls = tls_config(args)?;
    let (bound, url) = match addr {
        ControlAddr::Tcp(socket) => {
            let listener = TcpListener::bind(socket)
                .await
                .with_context(|| format!("cannot listen on {socket} for --control"))?;
            let scheme = if tls.is_some() { "https" } else { "http" };
            let url = format!("{scheme}://{}", listener.local_addr()?);
            (BoundControl::Tcp(listener), url)
        }
        ControlAddr::Unix(path) => {
            if tls.is_some() {
                bail!("--control-tls-* applies to a TCP --control address, not a Unix socket");
            }
            let (listener, file) = vouch_nbd::socket_file::bind_unix(&path)
                .with_context(|| format!("cannot listen on {} for --control", path.display()))?;
            listener.set_nonblocking(true)?;
            let url = format!("unix:{}", path.display());
            (
                BoundControl::Unix(UnixListener::from_std(listener)?, file),
                url,
            )
        }
    };
    Ok(Some(ControlListener {
        bound,
        token,
        tls,
        url,
    }))
}

/// Serve the control API on a bound listener, its jobs run by `jobs`.
fn serve(listener: ControlListener, jobs: Arc<Jobs>) -> Result<ControlServer> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let signal = async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let app = router(ApiState {
        jobs: jobs.clone(),
        token: listener.token,
    });
    let mut socket_file = None;
    let task = match (listener.bound, listener.tls) {
        (BoundControl::Tcp(listener), Some(tls)) => {
            let listener = TlsListener::new(listener, TlsAcceptor::from(tls))?;
            tokio::spawn(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(signal)
                    .await;
            })
        }
        (BoundControl::Tcp(listener), None) => tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(signal)
                .await;
        }),
        (BoundControl::Unix(listener, file), _) => {
            socket_file = Some(file);
            tokio::spawn(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(signal)
                    .await;
            })
        }
    };
    Ok(ControlServer {
        jobs,
        task,
        stop,
        socket_file,
    })
}

/// Start the control API of `vouch serve` on its bound listener: one
/// export per volume (in `names` order), and scrub yields to the NBD
/// server's requests (`metrics`).
pub fn start_for_server(
    listener: ControlListener,
    names: &[String],
    paths: &[PathBuf],
    volumes: &[Arc<vouch_engine::Volume>],
    resyncers: &[Option<Arc<crate::resync::Resyncer>>],
    migrations: &[Option<Arc<crate::migrate_online::Migration>>],
    metrics: Arc<vouch_nbd::Metrics>,
) -> Result<ControlServer> {
    let exports = names
        .iter()
        .zip(paths)
        .zip(volumes)
        .zip(resyncers)
        .zip(migrations)
        .map(
            |((((name, dir), volume), resyncer), migration)| super::jobs::ExportEntry {
                name: name.clone(),
                dir: dir.clone(),
                volume: volume.clone(),
                mirror: resyncer.as_ref().map(|r| r.mirror.clone()),
                resync: resyncer.clone(),
                migration: migration.clone(),
            },
        )
        .collect();
    // Requests started = finished + in flight: moves whenever a client asks.
    let foreground: Arc<dyn Fn() -> u64 + Send + Sync> = Arc::new(move || {
        vouch_nbd::wire::Command::ALL
            .iter()
            .map(|command| metrics.requests(*command))
            .sum::<u64>()
            + metrics.in_flight()
    });
    serve(listener, Jobs::new(exports, Some(foreground)))
}
