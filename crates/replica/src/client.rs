//! One connection to a replica server: requests carry handles so several
//! are in flight; a reader task hands each answer to its waiting caller.
//! Callers are ordinary threads (the `BlockDevice` is synchronous): each
//! waits for its answer with a timeout. A connection that fails — a read
//! or write error, a malformed answer, a request that timed out — is dead
//! for good: every waiting and later request fails at once with the
//! reason, and only opening the leg again reconnects (never silently
//! mid-run, where writes the replica missed would go unnoticed).
//!
//! Two transports: plain TCP (`plain.rs`: callers write their frames to
//! the socket themselves without waiting, a sender thread finishes what
//! a full socket did not take, a reader thread answers them) and TLS (a tokio
//! runtime: a writer task sends the frames callers queue, a reader task
//! answers them).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use crate::auth::{
    self, Challenge, Secret, Verdict, CHALLENGE_BYTES, RESPONSE_BYTES, VERDICT_BYTES,
};
use crate::plain::Plain;
use crate::url::ReplicaUrl;
use crate::wire::{
    self, encode_request_frame, ErrorBody, Hello, Request, ResponseHeader, Status, HELLO_BYTES,
    HELLO_OK, HELLO_VERSION_REFUSED, OLDEST_VERSION, PROTOCOL_VERSION, RESPONSE_HEADER_BYTES,
};

/// How a client reaches replicas.
#[derive(Clone)]
pub struct ClientOptions {
    /// Bound on each request's round trip.
    pub timeout: Duration,
    /// TLS (server verified against a CA, and a client certificate);
    /// `None`: plain TCP.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The secret shared with replica servers (`auth.rs`): proven at
    /// every connect, and the server must prove it back.
    pub secret: Option<Arc<Secret>>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout: crate::REQUEST_TIMEOUT,
            tls: None,
            secret: None,
        }
    }
}

/// Why a request did not get an answer, or got an error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// Cannot connect, or the connection failed or timed out.
    #[error("{0}")]
    Unreachable(String),
    /// The server refused the handshake (another protocol version, not a
    /// replica server).
    #[error("{0}")]
    Refused(String),
    /// The server answered with an error.
    #[error("{}", body.message)]
    Remote { status: Status, body: ErrorBody },
    /// The server refused our version and speaks this older one, which
    /// we speak too: `Connection::connect` connects again offering it
    /// (never returned from there).
    #[error("the server speaks replica protocol version {0}")]
    Older(u32),
}

type Answer = Result<(Status, Vec<u8>), String>;

/// Called exactly once with a request's outcome (`Connection::send_then`):
/// the payload of an OK answer, or the error.
pub type AnswerDone = Box<dyn FnOnce(Result<Vec<u8>, ClientError>) + Send>;

/// Who takes a request's answer.
enum Waiter {
    /// A thread blocked in `Pending::wait` (which times itself out).
    Thread(SyncSender<Answer>),
    /// A callback; nobody waits, so the connection's reader thread times
    /// the request out (`Shared::overdue`).
    Callback { sent: Instant, done: AnswerDone },
}

pub(crate) struct Shared {
    pending: Mutex<HashMap<u64, Waiter>>,
    /// Why the connection is dead; `None` while it lives.
    dead: Mutex<Option<String>>,
    /// How errors name the peer.
    peer: String,
}

impl Shared {
    /// Hand an answer to its waiter; an answer nobody waits for, or a
    /// malformed error answer, is a broken peer (the reason).
    pub(crate) fn deliver(
        &self,
        handle: u64,
        status: Status,
        payload: Vec<u8>,
    ) -> Result<(), String> {
        let Some(waiter) = self.pending.lock().remove(&handle) else {
            return Err(format!("an answer for unknown handle {handle}"));
        };
        match waiter {
            Waiter::Thread(waiter) => {
                let _ = waiter.try_send(Ok((status, payload)));
                Ok(())
            }
            Waiter::Callback { done, .. } => match interpret(status, payload) {
                Ok(outcome) => {
                    done(outcome);
                    Ok(())
                }
                Err(why) => {
                    done(Err(ClientError::Unreachable(format!(
                        "replica {}: {why}",
                        self.peer
                    ))));
                    Err(why)
                }
            },
        }
    }

    /// Mark the connection dead (the first reason wins) and fail every
    /// waiting request.
    pub(crate) fn kill(&self, reason: String) {
        let mut dead = self.dead.lock();
        if dead.is_none() {
            *dead = Some(reason);
        }
        let reason = dead.clone().expect("set above");
        drop(dead);
        // Callbacks run without the lock: one may send on a connection.
        let waiters: Vec<Waiter> = self.pending.lock().drain().map(|(_, w)| w).collect();
        for waiter in waiters {
            match waiter {
                Waiter::Thread(waiter) => {
                    let _ = waiter.try_send(Err(reason.clone()));
                }
                Waiter::Callback { done, .. } => {
                    done(Err(ClientError::Unreachable(reason.clone())));
                }
            }
        }
    }

    /// Why the connection must be dropped now, if a request answered by
    /// callback has waited longer than `timeout`.
    pub(crate) fn overdue(&self, timeout: Duration) -> Option<String> {
        let pending = self.pending.lock();
        let late = pending.values().any(|waiter| match waiter {
            Waiter::Callback { sent, .. } => sent.elapsed() > timeout,
            Waiter::Thread(_) => false,
        });
        late.then(|| format!("request timed out after {timeout:?}; the connection is dropped"))
    }
}

/// An answer's outcome: the payload of an OK answer or the server's
/// error; `Err(why)` when the error answer is malformed (the connection
/// is then broken).
fn interpret(status: Status, payload: Vec<u8>) -> Result<Result<Vec<u8>, ClientError>, String> {
    if status == Status::Ok {
        return Ok(Ok(payload));
    }
    match ErrorBody::decode(&payload) {
        Ok(body) => Ok(Err(ClientError::Remote { status, body })),
        Err(error) => Err(format!("malformed error answer: {error}")),
    }
}

/// A connection to one replica server.
pub struct Connection {
    transport: Transport,
    shared: Arc<Shared>,
    next_handle: AtomicU64,
    timeout: Duration,
    /// How errors name the peer.
    pub peer: String,
    /// The protocol version the hello agreed on (`wire::SNAPSHOT_VERSION`
    /// and later carry the snapshot requests).
    pub version: u32,
}

enum Transport {
    /// Plain TCP, no runtime (`plain.rs`).
    Plain(Plain),
    /// TLS: the runtime, its writer task's queue, both tasks.
    Tasks {
        runtime: Option<tokio::runtime::Runtime>,
        frames: UnboundedSender<Vec<u8>>,
        tasks: Vec<tokio::task::AbortHandle>,
    },
}

/// Check the server's hello to ours, which offered version `offer`:
/// accepted at that version; or refused by a server of an older version
/// we speak too (`ClientError::Older`: connect again offering it).
pub(crate) fn check_hello(
    bytes: &[u8; HELLO_BYTES],
    peer: &str,
    offer: u32,
) -> Result<(), ClientError> {
    let theirs = Hello::decode(bytes).map_err(|_| {
        ClientError::Refused(format!(
            "replica {peer}: not a vouch replica server (bad handshake magic)"
        ))
    })?;
    if theirs.status == HELLO_VERSION_REFUSED && (OLDEST_VERSION..offer).contains(&theirs.version) {
        return Err(ClientError::Older(theirs.version));
    }
    if theirs.version != offer {
        return Err(ClientError::Refused(format!(
            "replica {peer}: {}",
            wire::version_refusal(theirs.version)
        )));
    }
    match theirs.status {
        HELLO_OK => Ok(()),
        HELLO_VERSION_REFUSED => Err(ClientError::Refused(format!(
            "replica {peer}: the server refused our version: {}",
            wire::version_refusal(offer)
        ))),
        other => Err(ClientError::Refused(format!(
            "replica {peer}: unknown handshake status {other}"
        ))),
    }
}

/// This side's answer to a server's challenge (after the hellos), and
/// what checks the server's verdict: the handshake's authentication step,
/// the same on both transports.
pub(crate) struct ChallengeAnswer {
    pub(crate) response: [u8; RESPONSE_BYTES],
    challenge: Challenge,
    nonce: auth::Nonce,
    peer: String,
}

impl ChallengeAnswer {
    pub(crate) fn new(
        challenge: &[u8; CHALLENGE_BYTES],
        secret: Option<&Secret>,
        peer: &str,
    ) -> Result<ChallengeAnswer, ClientError> {
        let refused = |why: String| ClientError::Refused(format!("replica {peer}: {why}"));
        let challenge = Challenge::decode(challenge).map_err(refused)?;
        let nonce = auth::nonce();
        let response = auth::respond(secret, &challenge, &nonce).map_err(refused)?;
        Ok(ChallengeAnswer {
            response: response.encode(),
            challenge,
            nonce,
            peer: peer.to_string(),
        })
    }

    pub(crate) fn check(
        &self,
        verdict: &[u8; VERDICT_BYTES],
        secret: Option<&Secret>,
    ) -> Result<(), ClientError> {
        let refused = |why: String| ClientError::Refused(format!("replica {}: {why}", self.peer));
        let verdict = Verdict::decode(verdict).map_err(refused)?;
        auth::accept_verdict(secret, &self.challenge, &self.nonce, &verdict).map_err(refused)
    }
}

/// Read exactly `buf.len()` bytes.
async fn read_exact<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> std::io::Result<()> {
    reader.read_exact(buf).await.map(|_| ())
}

impl Connection {
    /// Connect to the server of `url` and shake hands: our version
    /// offered, or the server's older one when it speaks only that (a
    /// second connection: a server from before the snapshot requests
    /// refuses a version it does not know and closes).
    pub fn connect(
        url: &ReplicaUrl,
        options: &ClientOptions,
    ) -> Result<Arc<Connection>, ClientError> {
        match Self::connect_offering(url, options, PROTOCOL_VERSION) {
            Err(ClientError::Older(theirs)) => Self::connect_offering(url, options, theirs)
                .map_err(|error| match error {
                    ClientError::Older(again) => ClientError::Refused(format!(
                        "replica {url}: {}",
                        wire::version_refusal(again)
                    )),
                    other => other,
                }),
            other => other,
        }
    }

    fn connect_offering(
        url: &ReplicaUrl,
        options: &ClientOptions,
        offer: u32,
    ) -> Result<Arc<Connection>, ClientError> {
        let peer = url.to_string();
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            dead: Mutex::new(None),
            peer: peer.clone(),
        });
        let transport = match &options.tls {
            None => Transport::Plain(Plain::connect(url, options, &peer, &shared, offer)?),
            Some(config) => {
                Self::connect_tls(url, Arc::clone(config), options, &peer, &shared, offer)?
            }
        };
        Ok(Arc::new(Connection {
            transport,
            shared,
            next_handle: AtomicU64::new(1),
            timeout: options.timeout,
            peer,
            version: offer,
        }))
    }

    /// The TLS transport: a runtime with a writer and a reader task.
    fn connect_tls(
        url: &ReplicaUrl,
        config: Arc<rustls::ClientConfig>,
        options: &ClientOptions,
        peer: &str,
        shared: &Arc<Shared>,
        offer: u32,
    ) -> Result<Transport, ClientError> {
        let secret = options.secret.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("vouch-replica-client")
            .enable_all()
            .build()
            .map_err(|error| ClientError::Unreachable(format!("{peer}: runtime: {error}")))?;
        let address = url.address();
        let host = url.host.clone();
        let unreachable = |why: String| ClientError::Unreachable(format!("replica {peer}: {why}"));
        let (reader, writer) = runtime.block_on(async {
            let tcp = tokio::time::timeout(crate::CONNECT_TIMEOUT, TcpStream::connect(&address))
                .await
                .map_err(|_| {
                    unreachable(format!(
                        "connecting timed out after {:?}",
                        crate::CONNECT_TIMEOUT
                    ))
                })?
                .map_err(|error| unreachable(format!("cannot connect: {error}")))?;
            let _ = tcp.set_nodelay(true);
            let handshake = async {
                let name = rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|error| unreachable(format!("TLS server name {host:?}: {error}")))?;
                let stream = tokio_rustls::TlsConnector::from(config)
                    .connect(name, tcp)
                    .await
                    .map_err(|error| unreachable(format!("TLS handshake failed: {error}")))?;
                let (reader, writer) = tokio::io::split(stream);
                let secret = secret.as_deref();
                Self::hello(Box::new(reader), Box::new(writer), peer, secret, offer).await
            };
            tokio::time::timeout(crate::CONNECT_TIMEOUT, handshake)
                .await
                .map_err(|_| {
                    unreachable("the handshake timed out (does the server want TLS?)".into())
                })?
        })?;
        let (frames, mut outgoing) = unbounded_channel::<Vec<u8>>();
        let writing = {
            let shared = Arc::clone(shared);
            let peer = peer.to_string();
            runtime.spawn(async move {
                let mut writer = writer;
                while let Some(frame) = outgoing.recv().await {
                    // The TLS stream may keep the end of a frame in its own
                    // buffer when the socket is full (its write returns once
                    // the bytes are accepted): flush before waiting for the
                    // next frame, or a request's tail waits for it.
                    let sent = match writer.write_all(&frame).await {
                        Ok(()) if outgoing.is_empty() => writer.flush().await,
                        sent => sent,
                    };
                    if let Err(error) = sent {
                        shared.kill(format!("replica {peer}: connection lost: {error}"));
                        return;
                    }
                }
                let _ = writer.shutdown().await;
            })
        };
        let reading = {
            let shared = Arc::clone(shared);
            let peer = peer.to_string();
            runtime.spawn(async move {
                let why = Self::read_answers(reader, &shared).await;
                shared.kill(format!("replica {peer}: {why}"));
            })
        };
        Ok(Transport::Tasks {
            runtime: Some(runtime),
            frames,
            tasks: vec![writing.abort_handle(), reading.abort_handle()],
        })
    }

    /// Send our hello, read the server's, refuse another version by name;
    /// then answer the server's challenge and check its verdict.
    async fn hello(
        mut reader: Box<dyn AsyncRead + Send + Unpin>,
        mut writer: Box<dyn AsyncWrite + Send + Unpin>,
        peer: &str,
        secret: Option<&Secret>,
        offer: u32,
    ) -> Result<
        (
            Box<dyn AsyncRead + Send + Unpin>,
            Box<dyn AsyncWrite + Send + Unpin>,
        ),
        ClientError,
    > {
        let ours = Hello {
            version: offer,
            status: HELLO_OK,
        };
        let lost = |error: std::io::Error| {
            ClientError::Unreachable(format!("replica {peer}: handshake: {error}"))
        };
        writer.write_all(&ours.encode()).await.map_err(lost)?;
        writer.flush().await.map_err(lost)?;
        let mut bytes = [0u8; HELLO_BYTES];
        read_exact(&mut reader, &mut bytes).await.map_err(|error| {
            ClientError::Refused(format!(
                "replica {peer}: the server closed the connection during the handshake ({error}): not a vouch replica server, or it wants TLS, or it refused our certificate"
            ))
        })?;
        check_hello(&bytes, peer, offer)?;
        let mut challenge = [0u8; CHALLENGE_BYTES];
        read_exact(&mut reader, &mut challenge)
            .await
            .map_err(lost)?;
        let answer = ChallengeAnswer::new(&challenge, secret, peer)?;
        writer.write_all(&answer.response).await.map_err(lost)?;
        writer.flush().await.map_err(lost)?;
        let mut verdict = [0u8; VERDICT_BYTES];
        read_exact(&mut reader, &mut verdict).await.map_err(lost)?;
        answer.check(&verdict, secret)?;
        Ok((reader, writer))
    }

    /// Hand each answer to its waiter until the connection fails; returns why.
    async fn read_answers(
        mut reader: Box<dyn AsyncRead + Send + Unpin>,
        shared: &Shared,
    ) -> String {
        loop {
            let mut header = [0u8; RESPONSE_HEADER_BYTES];
            if let Err(error) = read_exact(&mut reader, &mut header).await {
                return format!("connection lost: {error}");
            }
            let header = match ResponseHeader::decode(&header) {
                Ok(header) => header,
                Err(error) => return format!("malformed answer: {error}"),
            };
            let mut payload = vec![0u8; header.payload_bytes as usize];
            if let Err(error) = read_exact(&mut reader, &mut payload).await {
                return format!("connection lost: {error}");
            }
            if let Err(why) = shared.deliver(header.handle, header.status, payload) {
                return why;
            }
        }
    }

    /// Send `request` and wait for its answer: the payload of an OK
    /// answer, or the error.
    pub fn call(self: &Arc<Self>, request: &Request) -> Result<Vec<u8>, ClientError> {
        self.send(request)?.wait()
    }

    /// Send `request` without waiting for its answer: `Pending::wait`
    /// collects it (with the same timeout, counted from its call), so a
    /// caller can overlap several round trips, or a round trip with work
    /// of its own.
    pub fn send(self: &Arc<Self>, request: &Request) -> Result<Pending, ClientError> {
        let (waiter, answer) = sync_channel(1);
        self.transmit(request, Waiter::Thread(waiter))
            .map_err(|(error, _)| error)?;
        Ok(Pending {
            connection: Arc::clone(self),
            answer,
        })
    }

    /// Whether `send_then` answers from the connection's own reader
    /// thread without blocking its caller (plain TCP, alive).
    pub fn answers_by_callback(&self) -> bool {
        matches!(self.transport, Transport::Plain(_)) && self.dead().is_none()
    }

    /// Send `request` and return, never waiting on the socket (a full
    /// one is drained by the connection's sender thread, `plain.rs`):
    /// `done` is called exactly once with the outcome, on the
    /// connection's reader thread (or its sender thread, or here, when
    /// the request cannot be sent). Nobody waits, so the reader thread
    /// enforces the timeout: a request unanswered for longer kills the
    /// connection, failing it and every other request. On TLS (no such
    /// reader thread) the caller waits for the answer here, then calls
    /// `done`.
    pub fn send_then(self: &Arc<Self>, request: &Request, done: AnswerDone) {
        if !matches!(self.transport, Transport::Plain(_)) {
            done(self.call(request));
            return;
        }
        let waiter = Waiter::Callback {
            sent: Instant::now(),
            done,
        };
        if let Err((error, Some(Waiter::Callback { done, .. }))) = self.transmit(request, waiter) {
            done(Err(error));
        }
    }

    /// Register `waiter` and send `request`. On an error, the waiter is
    /// given back unless a kill already answered it.
    fn transmit(
        self: &Arc<Self>,
        request: &Request,
        waiter: Waiter,
    ) -> Result<(), (ClientError, Option<Waiter>)> {
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.shared.pending.lock().insert(handle, waiter);
        // Checked after registering: a connection killed before that
        // would never answer this waiter.
        if let Some(reason) = self.shared.dead.lock().clone() {
            let waiter = self.shared.pending.lock().remove(&handle);
            return Err((ClientError::Unreachable(reason), waiter));
        }
        let frame = encode_request_frame(handle, request);
        let sent = match &self.transport {
            Transport::Plain(plain) => plain.send(frame).inspect_err(|reason| {
                // Part of the frame may be out: nothing after it can be.
                // (The kill answers this request's waiter too.)
                self.kill(reason.clone());
            }),
            Transport::Tasks { frames, .. } => frames
                .send(frame.to_vec())
                .map_err(|_| format!("replica {}: connection closed", self.peer)),
        };
        if let Err(reason) = sent {
            let waiter = self.shared.pending.lock().remove(&handle);
            return Err((ClientError::Unreachable(reason), waiter));
        }
        Ok(())
    }

    /// Mark the connection dead now (a malformed answer, a timeout).
    pub fn kill(&self, reason: String) {
        self.shared.kill(reason);
        match &self.transport {
            Transport::Plain(plain) => plain.shutdown(),
            Transport::Tasks { tasks, .. } => {
                for task in tasks {
                    task.abort();
                }
            }
        }
    }

    /// Why the connection is dead, if it is.
    pub fn dead(&self) -> Option<String> {
        self.shared.dead.lock().clone()
    }
}

/// A request sent and not yet answered (`Connection::send`).
pub struct Pending {
    connection: Arc<Connection>,
    answer: Receiver<Answer>,
}

impl Pending {
    /// Wait for the answer: the payload of an OK answer, or the error. A
    /// request unanswered after the connection's timeout kills the
    /// connection (every other waiter fails at once too).
    pub fn wait(self) -> Result<Vec<u8>, ClientError> {
        let connection = &self.connection;
        let answer = match self.answer.recv_timeout(connection.timeout) {
            Ok(answer) => answer,
            Err(RecvTimeoutError::Timeout) => {
                let reason = format!(
                    "replica {}: request timed out after {:?}; the connection is dropped",
                    connection.peer, connection.timeout
                );
                connection.kill(reason.clone());
                return Err(ClientError::Unreachable(reason));
            }
            Err(RecvTimeoutError::Disconnected) => Err("connection closed".to_string()),
        };
        let (status, payload) = answer.map_err(ClientError::Unreachable)?;
        interpret(status, payload).unwrap_or_else(|why| {
            let reason = format!("replica {}: {why}", connection.peer);
            connection.kill(reason.clone());
            Err(ClientError::Unreachable(reason))
        })
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.kill(format!("replica {}: connection closed", self.peer));
        if let Transport::Tasks { runtime, .. } = &mut self.transport {
            if let Some(runtime) = runtime.take() {
                // Allowed on any thread, async or not.
                runtime.shutdown_background();
            }
        }
    }
}
