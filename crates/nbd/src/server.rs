//! Listeners, connection lifecycle and graceful shutdown (limits: see [`crate::limits`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{debug, info, warn};

use crate::export::Export;
use crate::handshake::{self, HandshakeContext, HandshakeError, Negotiated, OptionState};
use crate::metrics::Metrics;
use crate::socket_file::SocketFile;
use crate::transmission::{self, ReceiveLowWater, ServerResources};
use crate::worker::{Executor, WorkerPool};

// Re-exported so `vouch_nbd::server::{Limits, DEFAULT_*}` keep working now
// that the limits live in their own module.
pub use crate::limits::{
    Limits, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_DISCARD_BYTES,
    DEFAULT_MAX_IN_FLIGHT_BYTES_PER_CONNECTION, DEFAULT_MAX_IN_FLIGHT_BYTES_PER_SERVER,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION, DEFAULT_MAX_OPTIONS, DEFAULT_MAX_OPTION_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_REPLY_WRITE_TIMEOUT,
};

/// How long a stopping server keeps reaping reads that connections ended
/// on a protocol error left in flight.
const READS_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Where to listen.
#[derive(Debug, Clone)]
pub enum Listen {
    /// `ADDR:PORT`; port 0 picks an ephemeral port (see [`Server::tcp_addrs`]).
    Tcp(SocketAddr),
    /// A Unix socket path. A stale socket file is replaced, a live
    /// server's is refused ([`crate::socket_file::bind_unix`]); the file is
    /// removed when the server stops (or is dropped unstarted).
    Unix(PathBuf),
    /// A TCP socket already listening (bound by the caller, or passed by
    /// systemd socket activation), served as it is.
    TcpListener(Arc<std::net::TcpListener>),
    /// A Unix socket already listening (socket activation): served as it
    /// is; its file belongs to whoever made it and is left in place.
    UnixListener(Arc<std::os::unix::net::UnixListener>),
}

/// Everything needed to build a [`Server`].
#[derive(Clone, Default)]
pub struct ServerConfig {
    /// Exports by name. The key `""` (or `default_export`) serves clients
    /// that ask for the empty name.
    pub exports: HashMap<String, Arc<dyn Export>>,
    /// Name of the export served for the empty name, if not keyed `""`.
    pub default_export: Option<String>,
    pub listen: Vec<Listen>,
    /// TLS material; STARTTLS is offered when set.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// FORCEDTLS mode: every option but STARTTLS/ABORT is refused before TLS.
    pub tls_required: bool,
    pub limits: Limits,
    pub executor: Executor,
    /// Shared metrics; a fresh set is created when `None`.
    pub metrics: Option<Arc<Metrics>>,
}

/// Errors building or running a server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("cannot listen on {what}")]
    Bind {
        what: String,
        source: std::io::Error,
    },
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Requests a graceful shutdown of the server it came from. Cloneable.
#[derive(Clone)]
pub struct ShutdownHandle {
    signal: Arc<watch::Sender<bool>>,
}

impl ShutdownHandle {
    /// Stop accepting, finish and answer in-flight requests, flush every
    /// export; [`Server::run`] returns when that is done.
    pub fn shutdown(&self) {
        self.signal.send_replace(true);
    }
}

enum BoundListener {
    Tcp(TcpListener),
    Unix {
        /// The file this server made, removed with the listener. Declared
        /// first: fields drop in order, and the file must go while the
        /// listener is still open (see [`SocketFile`]).
        _file: Option<SocketFile>,
        listener: UnixListener,
        /// The path, or `@name` for an abstract socket, for logs.
        label: String,
    },
}

/// A bound NBD server. Build with [`Server::bind`], drive with [`Server::run`].
pub struct Server {
    shared: Arc<Shared>,
    listeners: Vec<BoundListener>,
    signal: Arc<watch::Sender<bool>>,
}

struct Shared {
    config: ServerConfig,
    tls_acceptor: Option<tokio_rustls::TlsAcceptor>,
    resources: ServerResources,
    connection_slots: Arc<Semaphore>,
    shutdown: watch::Receiver<bool>,
}

impl Server {
    /// Validate the configuration and bind every listener.
    pub async fn bind(mut config: ServerConfig) -> Result<Server, ServerError> {
        if config.exports.is_empty() {
            return Err(ServerError::Config("no exports".into()));
        }
        if let Some(name) = &config.default_export {
            if !config.exports.contains_key(name) {
                return Err(ServerError::Config(format!(
                    "default export {name:?} is not an export"
                )));
            }
        }
        if config.tls_required && config.tls.is_none() {
            return Err(ServerError::Config(
                "tls_required without a TLS configuration".into(),
            ));
        }
        if config.listen.is_empty() {
            return Err(ServerError::Config("no listeners".into()));
        }
        let mut listeners = Vec::new();
        for listen in std::mem::take(&mut config.listen) {
            listeners.push(bind_listener(listen).await?);
        }
        let (signal, shutdown) = watch::channel(false);
        let metrics = config.metrics.clone().unwrap_or_default();
        // Every export's series from the start, before its first client.
        for name in config.exports.keys() {
            metrics.export(name);
        }
        let resources = ServerResources {
            metrics,
            pool: Arc::new(WorkerPool::new(config.executor)?),
            server_bytes: Arc::new(Semaphore::new(
                usize::try_from(config.limits.max_in_flight_bytes_per_server)
                    .unwrap_or(usize::MAX)
                    .clamp(1, Semaphore::MAX_PERMITS),
            )),
            limits: config.limits.clone(),
        };
        let shared = Arc::new(Shared {
            tls_acceptor: config.tls.clone().map(tokio_rustls::TlsAcceptor::from),
            connection_slots: Arc::new(Semaphore::new(config.limits.max_connections.max(1))),
            resources,
            shutdown,
            config,
        });
        Ok(Server {
            shared,
            listeners,
            signal: Arc::new(signal),
        })
    }

    /// Local addresses of the TCP listeners (to learn an ephemeral port).
    pub fn tcp_addrs(&self) -> Vec<SocketAddr> {
        self.listeners
            .iter()
            .filter_map(|listener| match listener {
                BoundListener::Tcp(tcp) => tcp.local_addr().ok(),
                BoundListener::Unix { .. } => None,
            })
            .collect()
    }

    /// The Unix sockets listened on: their paths (`@name` for an abstract
    /// socket).
    pub fn unix_sockets(&self) -> Vec<String> {
        self.listeners
            .iter()
            .filter_map(|listener| match listener {
                BoundListener::Tcp(_) => None,
                BoundListener::Unix { label, .. } => Some(label.clone()),
            })
            .collect()
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.resources.metrics.clone()
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            signal: self.signal.clone(),
        }
    }

    /// Serve until [`ShutdownHandle::shutdown`], then drain connections
    /// (answering in-flight requests) and flush every export.
    pub async fn run(self) -> Result<(), ServerError> {
        let Server {
            shared,
            listeners,
            signal,
        } = self;
        let mut reapers = Vec::new();
        for export in shared.config.exports.values() {
            match spawn_reaper(export.clone()) {
                Ok(reaper) => reapers.extend(reaper),
                Err(error) => {
                    reapers.iter().for_each(tokio::task::JoinHandle::abort);
                    return Err(error.into());
                }
            }
        }
        // Every connection task holds a clone; recv() returns None when all are gone.
        let (alive, mut all_gone) = mpsc::channel::<()>(1);
        let mut accept_tasks = Vec::new();
        for listener in listeners {
            accept_tasks.push(tokio::spawn(accept_loop(
                listener,
                shared.clone(),
                alive.clone(),
            )));
        }
        drop(alive);
        let mut shutdown = shared.shutdown.clone();
        while !*shutdown.borrow_and_update() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
        info!("NBD server shutting down: draining connections");
        for task in &accept_tasks {
            task.abort();
        }
        for task in accept_tasks {
            let _ = task.await;
        }
        let _ = all_gone.recv().await;
        // A connection that ended on a protocol error did not wait for
        // its started reads: let the reapers finish them (bounded).
        let deadline = tokio::time::Instant::now() + READS_DRAIN_TIMEOUT;
        while shared
            .config
            .exports
            .values()
            .any(|export| export.reads_in_flight() > 0)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for reaper in reapers {
            reaper.abort();
        }
        for (name, export) in &shared.config.exports {
            let export = export.clone();
            match tokio::task::spawn_blocking(move || export.flush()).await {
                Ok(Ok(())) => debug!(export = %name, "flushed"),
                Ok(Err(error)) => warn!(export = %name, %error, "flush at shutdown failed"),
                Err(error) => warn!(export = %name, %error, "flush at shutdown panicked"),
            }
        }
        drop(signal);
        info!("NBD server stopped");
        Ok(())
    }
}

/// Bind (or adopt) one listener. A socket handed over already listening
/// is duplicated when it is still shared, so the caller's copy stays open.
async fn bind_listener(listen: Listen) -> Result<BoundListener, ServerError> {
    Ok(match listen {
        Listen::Tcp(addr) => BoundListener::Tcp(
            TcpListener::bind(addr)
                .await
                .map_err(bind_error(addr.to_string()))?,
        ),
        Listen::Unix(path) => {
            let label = path.display().to_string();
            let (listener, file) =
                crate::socket_file::bind_unix(&path).map_err(bind_error(label.clone()))?;
            listener.set_nonblocking(true)?;
            BoundListener::Unix {
                listener: UnixListener::from_std(listener)?,
                label,
                _file: Some(file),
            }
        }
        Listen::TcpListener(shared) => {
            let listener = Arc::try_unwrap(shared).or_else(|shared| shared.try_clone())?;
            let label = listener
                .local_addr()
                .map_or_else(|_| "an inherited TCP socket".to_string(), |a| a.to_string());
            listener
                .set_nonblocking(true)
                .map_err(bind_error(label.clone()))?;
            BoundListener::Tcp(TcpListener::from_std(listener).map_err(bind_error(label))?)
        }
        Listen::UnixListener(shared) => {
            let listener = Arc::try_unwrap(shared).or_else(|shared| shared.try_clone())?;
            let label = unix_label(&listener);
            listener
                .set_nonblocking(true)
                .map_err(bind_error(label.clone()))?;
            BoundListener::Unix {
                listener: UnixListener::from_std(listener).map_err(bind_error(label.clone()))?,
                label,
                _file: None,
            }
        }
    })
}

/// A bind failure that names the address.
fn bind_error(what: String) -> impl FnOnce(std::io::Error) -> ServerError {
    move |source| ServerError::Bind { what, source }
}

/// A Unix listener's path, `@name` when abstract, for logs.
fn unix_label(listener: &std::os::unix::net::UnixListener) -> String {
    use std::os::linux::net::SocketAddrExt as _;
    match listener.local_addr() {
        Ok(addr) => match (addr.as_pathname(), addr.as_abstract_name()) {
            (Some(path), _) => path.display().to_string(),
            (None, Some(name)) => format!("@{}", String::from_utf8_lossy(name)),
            (None, None) => "an unnamed Unix socket".to_string(),
        },
        Err(_) => "an inherited Unix socket".to_string(),
    }
}

/// The export's reads that complete later (`Export::try_start_read`) are
/// finished by this task, on the server's reactor, when the export's
/// descriptor says some completed: no thread sleeps on them. `None` when
/// the export starts no reads. An export whose descriptor cannot be
/// watched fails the server before it serves.
fn spawn_reaper(export: Arc<dyn Export>) -> std::io::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(fd) = export.read_events() else {
        return Ok(None);
    };
    let events = Events {
        fd,
        _export: Arc::clone(&export),
    };
    // SAFETY: `Events` holds the export, which owns the descriptor and
    // keeps it open (the same one: the export sets it up once) for as
    // long as the `AsyncFd` lives.
    let events = unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) }
        .map_err(std::io::Error::from)?;
    Ok(Some(tokio::spawn(async move {
        loop {
            let mut ready = match events.readable().await {
                Ok(ready) => ready,
                Err(error) => {
                    // Only when the runtime is going away.
                    warn!(%error, "watching started reads failed");
                    return;
                }
            };
            // `reap_reads` returns WouldBlock once nothing more completed,
            // which clears the readiness until the next completion. A
            // panic in a read's completion answers that batch's reads EIO
            // (their completions are dropped) and the reaper goes on.
            let reaped = ready.try_io(|_| {
                catch_unwind(AssertUnwindSafe(|| export.reap_reads())).unwrap_or_else(|_| {
                    warn!("a started read's completion panicked; its batch answered EIO");
                    Ok(())
                })
            });
            match reaped {
                // Still completions coming: let other tasks run first.
                Ok(Ok(())) => tokio::task::yield_now().await,
                Ok(Err(error)) => {
                    warn!(%error, "reaping started reads failed; retrying");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(_would_block) => {}
            }
        }
    })))
}

/// An export's completion descriptor, with the export that owns it (so it
/// stays open while watched).
struct Events {
    fd: RawFd,
    _export: Arc<dyn Export>,
}

impl AsRawFd for Events {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

async fn accept_loop(listener: BoundListener, shared: Arc<Shared>, alive: mpsc::Sender<()>) {
    loop {
        let accepted = match &listener {
            BoundListener::Tcp(tcp) => tcp.accept().await.map(|(stream, peer)| {
                // Replies are batched by the writer; Nagle would only add latency.
                let _ = stream.set_nodelay(true);
                (Accepted::Tcp(stream), peer.to_string())
            }),
            BoundListener::Unix {
                listener, label, ..
            } => listener
                .accept()
                .await
                .map(|(stream, _)| (Accepted::Unix(stream), label.clone())),
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = shared.connection_slots.clone().try_acquire_owned() else {
            warn!(%peer, "connection limit reached; closing new connection");
            continue;
        };
        let shared = shared.clone();
        let alive = alive.clone();
        tokio::spawn(async move {
            let metrics = shared.resources.metrics.clone();
            metrics.connection_opened();
            debug!(%peer, "connection opened");
            let result = match stream {
                Accepted::Tcp(stream) => {
                    let low_water = ReceiveLowWater::new(stream.as_raw_fd());
                    serve_connection(stream, &shared, Some(low_water)).await
                }
                Accepted::Unix(stream) => serve_connection(stream, &shared, None).await,
            };
            match result {
                Ok(()) => debug!(%peer, "connection closed"),
                // A refused TLS client (no certificate, or one the CA did
                // not sign) is worth a line an operator sees.
                Err(error @ ConnectionEnd::Tls(_)) => {
                    warn!(%peer, %error, "TLS client refused")
                }
                Err(error) => debug!(%peer, %error, "connection ended"),
            }
            metrics.connection_closed();
            drop(slot);
            drop(alive);
        });
    }
}

enum Accepted {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

#[derive(Debug, thiserror::Error)]
enum ConnectionEnd {
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    #[error("handshake timed out")]
    HandshakeTimeout,
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    #[error(transparent)]
    Transmission(#[from] transmission::ConnectionError),
}

/// `low_water`: the receive low-water mark of a plain TCP stream, used
/// only if the connection does not start TLS.
async fn serve_connection<S>(
    mut stream: S,
    shared: &Shared,
    low_water: Option<ReceiveLowWater>,
) -> Result<(), ConnectionEnd>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = &shared.config;
    let shutdown = shared.shutdown.clone();
    let shutting_down = move || *shutdown.borrow();
    let context = HandshakeContext {
        exports: &config.exports,
        default_export: config.default_export.as_deref(),
        tls_available: shared.tls_acceptor.is_some(),
        tls_required: config.tls_required,
        limits: &shared.resources.limits,
        shutting_down: &shutting_down,
    };
    let deadline = tokio::time::Instant::now() + shared.resources.limits.handshake_timeout;
    let mut state = OptionState::default();
    let mut shutdown = shared.shutdown.clone();
    let negotiated = tokio::select! {
        result = tokio::time::timeout_at(deadline, async {
            handshake::greet(&mut stream, &mut state).await?;
            handshake::option_loop(&mut stream, &context, &mut state).await
        }) => result.map_err(|_| ConnectionEnd::HandshakeTimeout)??,
        _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
    };
    match negotiated {
        Negotiated::Transmission(session) => {
            let shutdown = shared.shutdown.clone();
            transmission::run(stream, session, &shared.resources, shutdown, low_water).await?;
        }
        Negotiated::StartTls => {
            let acceptor = shared
                .tls_acceptor
                .as_ref()
                .expect("STARTTLS acked only with TLS configured");
            let mut tls = tokio::time::timeout_at(deadline, acceptor.accept(stream))
                .await
                .map_err(|_| ConnectionEnd::HandshakeTimeout)?
                .map_err(ConnectionEnd::Tls)?;
            let negotiated = tokio::select! {
                result = tokio::time::timeout_at(deadline, handshake::option_loop(&mut tls, &context, &mut state)) =>
                    result.map_err(|_| ConnectionEnd::HandshakeTimeout)??,
                _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
            };
            match negotiated {
                Negotiated::Transmission(session) => {
                    let shutdown = shared.shutdown.clone();
                    transmission::run(tls, session, &shared.resources, shutdown, None).await?;
                }
                Negotiated::StartTls => unreachable!("STARTTLS is refused once TLS is active"),
            }
        }
    }
    Ok(())
}
