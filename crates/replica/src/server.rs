//! `vouch replica serve DIR`: replicas are volume directories `DIR/NAME`,
//! served to exporters over TCP (or TLS). Each connection shakes hands,
//! opens or creates one replica, then sends requests; the server runs up
//! to `MAX_IN_FLIGHT` of them at once (each on a blocking thread) and
//! answers in any order, by handle. A replica is held by one connection at
//! a time (two exporters writing one replica would make it a mix of
//! both): it is opened when that connection opens it and closed cleanly
//! when the connection ends.
//!
//! A frame that breaks the protocol gets a `MALFORMED` answer naming the
//! rule, and the connection is closed (its framing can no longer be
//! trusted); a request the volume refuses gets an error answer and the
//! connection goes on.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};
use vouch_engine::{
    BlockDevice, Error, OpenOptions, SealedAdmission, SealedDevice, SealedWrites, Submitted,
    Volume, ZeroFlags, BLOCK,
};
use vouch_mirror::LegTemplate;

use crate::auth::{self, Challenge, Response, Secret, RESPONSE_BYTES};
use crate::wire::{
    self, decode_request, encode_faults, encode_read_entries, encode_runs, ErrorBody, Hello,
    ReadEntry, ReplicaInfo, Request, RequestHeader, ResponseHeader, Status, WireError, HELLO_BYTES,
    HELLO_OK, HELLO_VERSION_REFUSED, OLDEST_VERSION, PROTOCOL_VERSION, REQUEST_HEADER_BYTES,
    SNAPSHOT_VERSION,
};
use crate::MAX_IN_FLIGHT;

mod snapshot;

/// Connections a server holds at once (`ServerOptions::max_connections`):
/// one past it is closed at accept, so strangers who only connect cannot
/// exhaust the server's memory or tasks.
pub const MAX_CONNECTIONS: usize = 64;
/// Bound on a connection's TLS handshake, hello and authentication
/// (`ServerOptions::handshake_timeout`): a peer that connects and says
/// nothing is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on the rest of a request once its first byte arrived, header
/// and payload (`ServerOptions::payload_timeout`): a payload that never
/// arrives drops the connection. (Between requests a connection may be
/// idle: TCP keepalive finds a dead exporter.)
pub const PAYLOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest journal a CREATE may ask for unless the server's policy
/// says otherwise (8x the engine's largest default).
pub const MAX_JOURNAL_BYTES: u64 = 1 << 30;

/// Bytes a connection takes from its socket at once, and gathers its
/// answers in before a send: with many writes in flight, one `recv`
/// brings several requests and one `send` carries several answers,
/// where a request used to cost three `recv`s (its first byte, the rest
/// of its header, its payload) and an answer one `send` of 24 bytes.
/// A larger payload bypasses the buffer (read straight into its own).
const SOCKET_BUFFER_BYTES: usize = 64 * 1024;

/// What a server allows its peers (`vouch replica serve`'s options).
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub max_connections: usize,
    pub handshake_timeout: Duration,
    pub payload_timeout: Duration,
    /// Every connection must prove it (`auth.rs`); `None`: every peer
    /// that reaches the port is trusted.
    pub secret: Option<Arc<Secret>>,
    /// The newest protocol version this server speaks: `PROTOCOL_VERSION`,
    /// or an older one to stand in for a server from before it (tests of
    /// the refusals an old replica server gets: `vouch replica serve
    /// --protocol-version 2`).
    pub newest_version: u32,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_connections: MAX_CONNECTIONS,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            payload_timeout: PAYLOAD_TIMEOUT,
            secret: None,
            newest_version: PROTOCOL_VERSION,
        }
    }
}

/// What a CREATE may ask of this server (its policy, not the peer's).
#[derive(Clone, Copy, Debug)]
pub struct CreatePolicy {
    /// The largest volume a CREATE may make, in bytes.
    pub max_volume_bytes: u64,
    /// The largest journal (the template's superblock says its size).
    pub max_journal_bytes: u64,
}

impl Default for CreatePolicy {
    fn default() -> Self {
        CreatePolicy {
            max_volume_bytes: vouch_engine::MAX_VOLUME_BYTES,
            max_journal_bytes: MAX_JOURNAL_BYTES,
        }
    }
}

struct Replica {
    volume: Arc<Volume>,
    /// The peer holding it.
    holder: String,
}

/// The replicas under one directory; the open ones, by name.
/// How long a connection waits for a replica another connection holds
/// before it is refused as in use (`Registry::open`).
const IN_USE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

pub struct Registry {
    dir: PathBuf,
    replicas: Mutex<HashMap<String, Replica>>,
    policy: CreatePolicy,
}

/// An error answer.
type Refusal = (Status, ErrorBody);

fn refusal(status: Status, message: String) -> Refusal {
    (
        status,
        ErrorBody {
            detail: [0; 3],
            kind: 0,
            message,
        },
    )
}

/// The answer for an engine error.
fn engine_refusal(error: &Error) -> Refusal {
    let message = error.to_string();
    let mut body = ErrorBody {
        detail: [0; 3],
        kind: 0,
        message,
    };
    let status = match error {
        Error::Fault(fault) => {
            body.detail[0] = fault.lba;
            body.kind = wire::fault_kind_code(fault.kind);
            Status::Fault
        }
        Error::OutOfRange {
            offset,
            length,
            size,
        } => {
            body.detail = [*offset, *length, *size];
            Status::OutOfRange
        }
        Error::Misaligned { offset, length } => {
            body.detail = [*offset, *length, 0];
            Status::Misaligned
        }
        Error::ReadOnly(_) => Status::ReadOnly,
        Error::InvalidArgument(_) => Status::InvalidArgument,
        Error::Unsupported(_) => Status::Unsupported,
        Error::Corrupt(_) | Error::Key(_) | Error::Path { .. } | Error::InVolume { .. } => {
            Status::Corrupt
        }
        _ => Status::Io,
    };
    (status, body)
}

impl Registry {
    pub fn new(dir: &Path, policy: CreatePolicy) -> Registry {
        Registry {
            dir: dir.to_path_buf(),
            replicas: Mutex::new(HashMap::new()),
            policy,
        }
    }

    /// Refuse a CREATE whose sizes the policy does not allow. The journal
    /// is the template's (its superblock records the size, and every
    /// leg of a set shares that superblock); the request's own journal
    /// field must agree with it, so the size checked is the size made.
    fn allowed(
        &self,
        template: &LegTemplate,
        superblock: &vouch_format::Superblock,
    ) -> Result<(), Refusal> {
        let policy = &self.policy;
        if superblock.size_bytes > policy.max_volume_bytes {
            return Err(refusal(
                Status::InvalidArgument,
                format!(
                    "a replica of {} bytes is over this server's limit of {} bytes (--max-volume-size)",
                    superblock.size_bytes, policy.max_volume_bytes
                ),
            ));
        }
        if template.journal_bytes != superblock.journal_bytes {
            return Err(refusal(
                Status::InvalidArgument,
                format!(
                    "CREATE asks for a journal of {} bytes, but its superblock says {}",
                    template.journal_bytes, superblock.journal_bytes
                ),
            ));
        }
        if superblock.journal_bytes > policy.max_journal_bytes {
            return Err(refusal(
                Status::InvalidArgument,
                format!(
                    "a journal of {} bytes is over this server's limit of {} bytes (--max-journal-size)",
                    superblock.journal_bytes, policy.max_journal_bytes
                ),
            ));
        }
        Ok(())
    }

    fn info(volume: &Volume, path: &Path) -> Result<ReplicaInfo, Refusal> {
        let superblock = vouch_engine::volume_superblock(path).map_err(|e| engine_refusal(&e))?;
        let geometry = volume.geometry();
        Ok(ReplicaInfo {
            size_bytes: volume.size(),
            uuid: superblock.uuid,
            block_size: BLOCK as u32,
            volume_tag: superblock.volume_tag(),
            guard: volume.guard() as u8,
            layout: volume.layout() as u8,
            encrypted: volume.encrypted(),
            read_only: volume.is_read_only(),
            instance_tag: superblock.instance_tag(),
            segment_blocks: geometry.segment_blocks,
            journal_bytes: superblock.journal_bytes,
        })
    }

    /// Hold replica `name` for `peer`, opening it if needed. A replica
    /// held by another connection is waited for up to `IN_USE_GRACE`
    /// first: its exporter may just have stopped (a restarted `serve`, a
    /// `check` right after one), and this server sees that connection
    /// end, and closes the volume, a moment after the exporter does.
    fn open(&self, name: &str, peer: &str) -> Result<(Arc<Volume>, ReplicaInfo), Refusal> {
        let asked = std::time::Instant::now();
        // Held across the open, so two connections cannot both open it.
        let mut replicas = loop {
            let replicas = self.replicas.lock();
            match replicas.get(name) {
                None => break replicas,
                Some(replica) if asked.elapsed() >= IN_USE_GRACE => {
                    return Err(refusal(
                        Status::InUse,
                        format!(
                            "replica {name} is in use by another exporter ({})",
                            replica.holder
                        ),
                    ));
                }
                Some(_) => {
                    drop(replicas);
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        };
        let path = self.dir.join(name);
        if !path.join("superblock").exists() {
            return Err(refusal(
                Status::UnknownName,
                format!("no replica named {name} in {}", self.dir.display()),
            ));
        }
        let superblock = vouch_engine::volume_superblock(&path).map_err(|e| engine_refusal(&e))?;
        if superblock.features.incompat & vouch_format::FeatureFlags::INCOMPAT_ENCRYPTED != 0 {
            return Err(refusal(
                Status::Unsupported,
                format!("replica {name} is encrypted: remote replicas of encrypted volumes are not supported yet"),
            ));
        }
        let volume = Arc::new(
            vouch_engine::open_volume(&path, &OpenOptions::default())
                .map_err(|e| engine_refusal(&e))?,
        );
        let info = Registry::info(&volume, &path)?;
        replicas.insert(
            name.to_string(),
            Replica {
                volume: Arc::clone(&volume),
                holder: peer.to_string(),
            },
        );
        tracing::info!(name, peer, "replica opened");
        Ok((volume, info))
    }

    /// Create replica `name` from `template` and hold it for `peer`.
    fn create(
        &self,
        name: &str,
        template: &LegTemplate,
        peer: &str,
    ) -> Result<(Arc<Volume>, ReplicaInfo), Refusal> {
        let path = self.dir.join(name);
        {
            let replicas = self.replicas.lock();
            if replicas.contains_key(name) || path.exists() {
                return Err(refusal(
                    Status::Exists,
                    format!("replica {name} already exists in {}", self.dir.display()),
                ));
            }
        }
        let superblock = template.superblock().map_err(|e| engine_refusal(&e))?;
        if superblock.features.incompat & vouch_format::FeatureFlags::INCOMPAT_ENCRYPTED != 0 {
            return Err(refusal(
                Status::Unsupported,
                "remote replicas of encrypted volumes are not supported yet".into(),
            ));
        }
        self.allowed(template, &superblock)?;
        template.create(&path).map_err(|e| engine_refusal(&e))?;
        tracing::info!(name, peer, "replica created");
        self.open(name, peer)
    }

    /// The connection of `peer` ended: close its replica cleanly. The map
    /// stays locked until the volume is closed, so an exporter that opens
    /// it right after (a restart) waits rather than finding it locked.
    fn release(&self, name: &str, peer: &str) {
        let mut replicas = self.replicas.lock();
        if replicas.get(name).is_some_and(|r| r.holder == peer) {
            let replica = replicas.remove(name).expect("present");
            close(name, replica.volume);
            tracing::info!(name, peer, "replica released and closed");
        }
    }

    /// Close every replica cleanly (at shutdown, after connections end).
    pub fn close_all(&self) {
        let replicas: Vec<(String, Replica)> = self.replicas.lock().drain().collect();
        for (name, replica) in replicas {
            close(&name, replica.volume);
        }
    }
}

/// Close a replica's volume (flush only, if a request still holds it).
fn close(name: &str, volume: Arc<Volume>) {
    let result = match Arc::try_unwrap(volume) {
        Ok(volume) => volume.close(),
        Err(shared) => shared.flush(),
    };
    if let Err(error) = result {
        tracing::error!(name, %error, "closing a replica failed");
    }
}

/// Orderings the server's write routes break on purpose, for the crash
/// simulator's self-tests only (`vouch_sim::replica_server`): each makes
/// a route answer before the step its answer promises, and the
/// simulator must catch it. The socket loop always passes `NONE`; the
/// broken orders live in `serve_broken` and one test in
/// `try_serve_inline`, off the production path.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteBreaks {
    /// A WRITE_SEALED is answered before its blocks are written (so
    /// before the replica's held log has them).
    pub answer_before_write: bool,
    /// A FLUSH, or a FUA WRITE_SEALED's flush, is answered before the
    /// flush (its commit) ran.
    pub answer_before_flush: bool,
}

impl RouteBreaks {
    /// Every route in its order (production).
    pub const NONE: RouteBreaks = RouteBreaks {
        answer_before_write: false,
        answer_before_flush: false,
    };
}

/// The server's inline route: answer `request` (number `handle`) on
/// `volume` if it completes without waiting (`WriteSealed` without FUA,
/// when the volume's write-back buffer has room:
/// `submit_sealed` with `SealedAdmission::MustNotWait`, which verifies
/// every block first),
/// handing the answer frame to `reply` once the volume holds the blocks
/// (in its held log: a crash of this process keeps them). Anything
/// else, or a write that would wait, is handed back untouched for
/// `serve_request` on a blocking thread. The socket loop runs this on
/// the connection's task; the crash simulator runs it as is, without a
/// socket.
pub fn try_serve_inline(
    volume: &Volume,
    handle: u64,
    request: Request,
    breaks: RouteBreaks,
    reply: impl FnOnce(Vec<u8>),
) -> Result<(), Request> {
    match &request {
        Request::WriteSealed { blocks, fua: false } => {
            if breaks.answer_before_write {
                // Answered, then written if that needs no wait (this
                // route never waits; a block it then declines is lost).
                reply(answer(handle, Ok(Vec::new())));
                let _ = volume.try_write_sealed(blocks);
                return Ok(());
            }
            match volume.try_write_sealed(blocks) {
                Ok(true) => reply(answer(handle, Ok(Vec::new()))),
                Ok(false) => return Err(request),
                Err(error) => reply(answer(handle, Err(engine_refusal(&error)))),
            }
            Ok(())
        }
        _ => Err(request),
    }
}

/// The server's blocking route: run `request` (number `handle`) on
/// `volume` and hand its answer frame to `reply` once what the answer
/// promises holds (a write in the volume's held log, a flush committed).
/// The socket loop runs this on a blocking thread; the crash simulator
/// runs it as is, without a socket.
pub fn serve_request(
    volume: &Volume,
    handle: u64,
    request: Request,
    breaks: RouteBreaks,
    reply: impl FnOnce(Vec<u8>),
) {
    if breaks != RouteBreaks::NONE {
        return serve_broken(volume, handle, request, breaks, reply);
    }
    reply(answer(handle, execute(volume, request)));
}

/// `serve_request` with `breaks` (self-tests only): the answer first,
/// then the steps it should have waited for.
fn serve_broken(
    volume: &Volume,
    handle: u64,
    request: Request,
    breaks: RouteBreaks,
    reply: impl FnOnce(Vec<u8>),
) {
    let refuse = |error: Error| engine_refusal(&error);
    match request {
        Request::WriteSealed { blocks, fua } => {
            if breaks.answer_before_write {
                reply(answer(handle, Ok(Vec::new())));
                let _ = volume.write_sealed(&blocks).and_then(|()| match fua {
                    true => volume.flush(),
                    false => Ok(()),
                });
                return;
            }
            if let Err(error) = volume.write_sealed(&blocks) {
                return reply(answer(handle, Err(refuse(error))));
            }
            if fua && breaks.answer_before_flush {
                reply(answer(handle, Ok(Vec::new())));
                let _ = volume.flush();
                return;
            }
            let flushed = match fua {
                true => volume.flush().map_err(refuse),
                false => Ok(()),
            };
            reply(answer(handle, flushed.map(|()| Vec::new())));
        }
        Request::Flush if breaks.answer_before_flush => {
            reply(answer(handle, Ok(Vec::new())));
            let _ = volume.flush();
        }
        request => reply(answer(handle, execute(volume, request))),
    }
}

/// Run one request on the replica's volume (a blocking thread).
fn execute(volume: &Volume, request: Request) -> Result<Vec<u8>, Refusal> {
    let refuse = |error: Error| engine_refusal(&error);
    match request {
        Request::ReadSealed { first, count } => {
            let entries = match volume.read_sealed(first, count) {
                Ok(blocks) => blocks.into_iter().map(ReadEntry::Sealed).collect(),
                // Name each block the volume cannot hand over, keep the rest.
                Err(Error::Fault(_)) => (first..first + count)
                    .map(|lba| match volume.read_sealed(lba, 1) {
                        Ok(mut one) => Ok(ReadEntry::Sealed(one.remove(0))),
                        Err(Error::Fault(fault)) => Ok(ReadEntry::Fault(fault)),
                        Err(error) => Err(refuse(error)),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                Err(error) => return Err(refuse(error)),
            };
            Ok(encode_read_entries(&entries))
        }
        Request::WriteSealed { blocks, fua } => {
            volume
                .submit_sealed(&blocks, fua, SealedAdmission::MayWait)
                .and_then(Submitted::wait)
                .map_err(refuse)?;
            Ok(Vec::new())
        }
        Request::Flush => volume.flush().map(|_| Vec::new()).map_err(refuse),
        Request::Trim {
            offset,
            length,
            fua,
        } => volume
            .trim(offset, length, fua)
            .map(|_| Vec::new())
            .map_err(refuse),
        Request::WriteZeroes {
            offset,
            length,
            fua,
            allocate,
        } => volume
            .write_zeroes(offset, length, ZeroFlags { fua, allocate })
            .map(|_| Vec::new())
            .map_err(refuse),
        Request::Verify { first, count } => {
            let blocks = volume.size() / BLOCK;
            if first.checked_add(count).is_none_or(|end| end > blocks) {
                return Err(refuse(Error::OutOfRange {
                    offset: first.saturating_mul(BLOCK),
                    length: count.saturating_mul(BLOCK),
                    size: volume.size(),
                }));
            }
            volume
                .verify(first, count)
                .map(|faults| encode_faults(&faults))
                .map_err(refuse)
        }
        Request::BlockStatus {
            offset,
            length,
            max_blocks,
        } => volume
            .block_status(offset, length, max_blocks)
            .map(|runs| encode_runs(&runs))
            .map_err(refuse),
        Request::NextData { lba } => volume
            .next_possible_data(lba)
            .map(|next| next.to_le_bytes().to_vec())
            .map_err(refuse),
        Request::Open { .. } | Request::Create { .. } | Request::OpenSnapshot { .. } => {
            Err(refusal(
                Status::InvalidArgument,
                "a replica is already open on this connection".into(),
            ))
        }
        Request::SnapshotCreate { .. } | Request::SnapshotList | Request::SnapshotDelete { .. } => {
            Err(refusal(
                Status::InvalidArgument,
                "a snapshot request runs on the connection's task (server/snapshot.rs), not here"
                    .into(),
            ))
        }
    }
}

fn answer(handle: u64, result: Result<Vec<u8>, Refusal>) -> Vec<u8> {
    let (status, payload) = match result {
        Ok(payload) => (Status::Ok, payload),
        Err((status, body)) => (status, body.encode()),
    };
    let mut frame = ResponseHeader {
        status,
        handle,
        payload_bytes: payload.len() as u32,
    }
    .encode()
    .to_vec();
    frame.extend_from_slice(&payload);
    frame
}

/// TCP keepalive probes after this long idle, then every
/// `KEEPALIVE_INTERVAL`, `KEEPALIVE_RETRIES` times: an exporter whose host
/// died without closing the connection releases its replica within about
/// a minute (a restarted exporter can then open it again).
pub const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(30);
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
pub const KEEPALIVE_RETRIES: u32 = 3;

fn keep_alive(tcp: &tokio::net::TcpStream) {
    let settings = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    if let Err(error) = socket2::SockRef::from(tcp).set_tcp_keepalive(&settings) {
        tracing::warn!(%error, "replica: cannot set TCP keepalive");
    }
}

/// Serve connections from `listener` until `shutdown` completes; then
/// wait for open connections to end (bounded) and close every replica.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    options: ServerOptions,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let options = Arc::new(options);
    let mut connections = tokio::task::JoinSet::new();
    let mut over_limit = OverLimit::default();
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            // Reap every finished connection's task: a `JoinSet` keeps a
            // task's result (and its allocation) until it is joined, so a
            // server that only spawned would grow with every connection
            // it ever had.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (tcp, address) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        continue;
                    }
                };
                if connections.len() >= options.max_connections {
                    over_limit.refuse(address, options.max_connections);
                    continue;
                }
                let _ = tcp.set_nodelay(true);
                keep_alive(&tcp);
                let registry = Arc::clone(&registry);
                let tls = tls.clone();
                let options = Arc::clone(&options);
                connections.spawn(async move {
                    let peer = address.to_string();
                    match tls {
                        Some(acceptor) => {
                            let accepted = tokio::time::timeout(
                                options.handshake_timeout,
                                acceptor.accept(tcp),
                            )
                            .await;
                            match accepted {
                                Ok(Ok(stream)) => serve_connection(stream, peer, registry, &options).await,
                                Ok(Err(error)) => tracing::warn!(peer, %error, "replica: TLS handshake refused"),
                                Err(_) => tracing::warn!(peer, "replica: TLS handshake timed out"),
                            }
                        }
                        None => serve_connection(tcp, peer, registry, &options).await,
                    }
                });
            }
        }
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    registry.close_all();
}

/// Connections closed at accept because the server was full, logged at
/// most once a second (a flood must not become a flood of log lines).
#[derive(Default)]
struct OverLimit {
    refused: u64,
    logged: Option<Instant>,
}

impl OverLimit {
    fn refuse(&mut self, address: std::net::SocketAddr, limit: usize) {
        self.refused += 1;
        if self
            .logged
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(1))
        {
            tracing::warn!(
                peer = %address,
                refused = self.refused,
                "replica: connection refused: the server holds its limit of {limit} connections (--max-connections)"
            );
            self.logged = Some(Instant::now());
        }
    }
}

/// Connections refused by authentication since the server started (logs
/// carry it, so a flood of bad proofs is visible without a line each).
static AUTH_REFUSED: AtomicU64 = AtomicU64::new(0);

/// The hello and the authentication (`auth.rs`), bounded by the caller:
/// the version agreed (the peer's, when this server speaks it: from
/// `OLDEST_VERSION` to `newest`) when the peer may send requests.
async fn handshake<R, W>(
    reader: &mut R,
    writer: &mut W,
    peer: &str,
    secret: Option<&Secret>,
    newest: u32,
) -> Option<u32>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut hello = [0u8; HELLO_BYTES];
    if reader.read_exact(&mut hello).await.is_err() {
        return None;
    }
    let Ok(theirs) = Hello::decode(&hello) else {
        tracing::warn!(
            peer,
            "replica: refused a connection: not the vouch replica handshake"
        );
        return None;
    };
    let (version, status) = if (OLDEST_VERSION..=newest).contains(&theirs.version) {
        (theirs.version, HELLO_OK)
    } else {
        (newest, HELLO_VERSION_REFUSED)
    };
    let ours = Hello { version, status };
    if status != HELLO_OK {
        let _ = writer.write_all(&ours.encode()).await;
        let _ = writer.flush().await;
        tracing::warn!(
            peer,
            "replica: refused: {}",
            wire::version_refusal_by(theirs.version, newest)
        );
        return None;
    }
    let challenge = Challenge {
        flags: if secret.is_some() {
            auth::SECRET_REQUIRED
        } else {
            0
        },
        nonce: auth::nonce(),
    };
    let mut opening = ours.encode().to_vec();
    opening.extend_from_slice(&challenge.encode());
    if writer.write_all(&opening).await.is_err() || writer.flush().await.is_err() {
        return None;
    }
    let mut bytes = [0u8; RESPONSE_BYTES];
    if reader.read_exact(&mut bytes).await.is_err() {
        return None;
    }
    let response = match Response::decode(&bytes) {
        Ok(response) => response,
        Err(why) => {
            tracing::warn!(peer, "replica: refused a connection: {why}");
            return None;
        }
    };
    let (verdict, accepted) = auth::judge(secret, &challenge.nonce, &response);
    if writer.write_all(&verdict.encode()).await.is_err() || writer.flush().await.is_err() {
        return None;
    }
    if !accepted {
        let refused = AUTH_REFUSED.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(
            peer,
            refused,
            "replica: authentication refused: no proof of the shared secret, or a wrong one"
        );
    }
    accepted.then_some(version)
}

/// One connection: handshake (bounded by `options.handshake_timeout`),
/// then requests until it ends.
pub async fn serve_connection<S>(
    stream: S,
    peer: String,
    registry: Arc<Registry>,
    options: &ServerOptions,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let shaken = tokio::time::timeout(
        options.handshake_timeout,
        handshake(
            &mut reader,
            &mut writer,
            &peer,
            options.secret.as_deref(),
            options.newest_version,
        ),
    )
    .await;
    let version = match shaken {
        Ok(Some(version)) => version,
        Ok(None) => return,
        Err(_) => {
            tracing::warn!(
                peer,
                "replica: handshake timed out after {:?}: connection dropped",
                options.handshake_timeout
            );
            return;
        }
    };
    let (answers, mut outgoing) = mpsc::channel::<Vec<u8>>(2 * MAX_IN_FLIGHT);
    // Answers gather in `writer`'s buffer while more are queued, and go
    // out when the queue is empty (or the buffer full): an answer waits
    // only for answers already made, never for a request.
    let mut writer = BufWriter::with_capacity(SOCKET_BUFFER_BYTES, writer);
    let writing = tokio::spawn(async move {
        while let Some(frame) = outgoing.recv().await {
            if writer.write_all(&frame).await.is_err() {
                return;
            }
            // Flush before waiting for the next answer: the buffer's
            // bytes, and a TLS stream's (its write returns once its
            // buffer *accepted* them: with the socket full, the end of
            // a large READ_SEALED answer with nothing after it would
            // never arrive whole, and the exporter time out).
            if outgoing.is_empty() && writer.flush().await.is_err() {
                return;
            }
        }
        let _ = writer.shutdown().await;
    });
    let mut session = Session {
        peer: peer.clone(),
        registry: Arc::clone(&registry),
        opened: None,
        answers,
        in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        payload_timeout: options.payload_timeout,
        version,
    };
    let mut reader = BufReader::with_capacity(SOCKET_BUFFER_BYTES, reader);
    if let Err(reason) = session.run(&mut reader).await {
        tracing::warn!(peer, "replica: connection closed: {reason}");
    }
    // Let requests in flight finish before the replica is released.
    let in_flight = Arc::clone(&session.in_flight);
    let _all = in_flight.acquire_many(MAX_IN_FLIGHT as u32).await;
    if let Some((name, volume)) = session.opened.take() {
        drop(volume);
        let peer = peer.clone();
        let _ = tokio::task::spawn_blocking(move || registry.release(&name, &peer)).await;
    }
    drop(session);
    let _ = writing.await;
}

/// Read exactly `length` bytes into `payload` (empty, with that much
/// room): an error at the end of the stream before them.
async fn read_payload<R: AsyncRead + Unpin>(
    reader: &mut R,
    payload: &mut bytes::BytesMut,
    length: usize,
) -> std::io::Result<()> {
    let mut limited = reader.take(length as u64);
    while payload.len() < length {
        if limited.read_buf(payload).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

struct Session {
    peer: String,
    registry: Arc<Registry>,
    opened: Option<(String, Arc<Volume>)>,
    answers: mpsc::Sender<Vec<u8>>,
    in_flight: Arc<Semaphore>,
    payload_timeout: Duration,
    /// The version the hello agreed on.
    version: u32,
}

impl Session {
    /// Read and dispatch requests; `Ok` at a clean end of stream, `Err`
    /// with the reason when a frame broke the protocol.
    async fn run<R: AsyncRead + Unpin>(&mut self, reader: &mut R) -> Result<(), String> {
        loop {
            let permit = Arc::clone(&self.in_flight)
                .acquire_owned()
                .await
                .map_err(|_| "closing".to_string())?;
            let mut bytes = [0u8; REQUEST_HEADER_BYTES];
            // Idle between requests as long as the exporter likes; once a
            // request began, all of it within the payload timeout.
            if reader.read_exact(&mut bytes[..1]).await.is_err() {
                return Ok(());
            }
            let timeout = self.payload_timeout;
            let stalled = || format!("a request stalled: not all of it arrived within {timeout:?}");
            match tokio::time::timeout(timeout, reader.read_exact(&mut bytes[1..])).await {
                Ok(Ok(_)) => {}
                Ok(Err(_)) => return Err("the connection ended inside a request".into()),
                Err(_) => return Err(stalled()),
            }
            let handle = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
            let header = match RequestHeader::decode(&bytes) {
                // A snapshot request on a connection of an older version
                // is malformed, as a server of that version finds it.
                Ok(header) if header.op.is_snapshot() && self.version < SNAPSHOT_VERSION => {
                    let unknown = WireError::UnknownOp(header.op as u16);
                    return Err(self.malformed(handle, unknown).await);
                }
                Ok(header) => header,
                Err(error) => return Err(self.malformed(handle, error).await),
            };
            // Received into memory never zeroed first (a WRITE_SEALED's
            // blocks stay in it: `decode_request`).
            let length = header.payload_bytes as usize;
            let mut payload = bytes::BytesMut::with_capacity(length);
            match tokio::time::timeout(timeout, read_payload(reader, &mut payload, length)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err("the connection ended inside a request".into()),
                Err(_) => return Err(stalled()),
            }
            let payload = payload.freeze();
            let request = match decode_request(&header, &payload) {
                Ok(request) => request,
                Err(WireError::BadContext(lba)) => {
                    let body = ErrorBody {
                        detail: [lba, 0, 0],
                        kind: wire::fault_kind_code(vouch_engine::FaultKind::ContextCorrupt),
                        message: format!("LBA {lba}: its context does not decode"),
                    };
                    self.send(answer(handle, Err((Status::Fault, body)))).await;
                    continue;
                }
                Err(error) => return Err(self.malformed(handle, error).await),
            };
            drop(payload);
            match request {
                Request::OpenSnapshot { name, snapshot } if self.opened.is_none() => {
                    let result = self.open_snapshot(name, snapshot).await;
                    self.send(answer(handle, result)).await;
                }
                Request::Open { .. } | Request::Create { .. } if self.opened.is_none() => {
                    let result = self.open(request).await;
                    self.send(answer(handle, result)).await;
                }
                request => {
                    let Some((_, volume)) = &self.opened else {
                        let refused = refusal(
                            Status::NotOpen,
                            "no replica is open on this connection: send OPEN or CREATE first"
                                .into(),
                        );
                        self.send(answer(handle, Err(refused))).await;
                        continue;
                    };
                    // A write the volume can buffer without waiting is
                    // answered here, on the connection's task: the hand-off
                    // to a blocking thread and back cost more than the
                    // write (the NBD server's inline path, issue 11). It may
                    // overtake an earlier request still on a blocking
                    // thread, as spawned requests already overtake each
                    // other: the exporter never has two writes of one
                    // block in flight (its stripe lock is held until every
                    // leg answered).
                    if matches!(
                        request,
                        Request::SnapshotCreate { .. }
                            | Request::SnapshotList
                            | Request::SnapshotDelete { .. }
                    ) {
                        self.spawn_snapshot(handle, request, permit);
                        continue;
                    }
                    // The answer is sent once the route returns (the
                    // channel's send may wait, a route may not).
                    let mut frame = None;
                    let inline =
                        try_serve_inline(volume, handle, request, RouteBreaks::NONE, |f| {
                            frame = Some(f)
                        });
                    let request = match inline {
                        Ok(()) => {
                            if let Some(frame) = frame {
                                self.send(frame).await;
                            }
                            drop(permit);
                            continue;
                        }
                        Err(request) => request,
                    };
                    let volume = Arc::clone(volume);
                    let answers = self.answers.clone();
                    tokio::spawn(async move {
                        let frame = tokio::task::spawn_blocking(move || {
                            let mut frame = None;
                            serve_request(&volume, handle, request, RouteBreaks::NONE, |f| {
                                frame = Some(f)
                            });
                            frame
                        })
                        .await
                        .map_err(|error| format!("request failed: {error}"))
                        .and_then(|frame| frame.ok_or_else(|| "request not answered".to_string()))
                        .unwrap_or_else(|error| answer(handle, Err(refusal(Status::Io, error))));
                        let _ = answers.send(frame).await;
                        drop(permit);
                    });
                }
            }
        }
    }

    /// A snapshot request (`snapshot.rs`), on a blocking thread.
    fn spawn_snapshot(
        &self,
        handle: u64,
        request: Request,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) {
        let Some((name, volume)) = self.opened.clone() else {
            unreachable!("a snapshot request is spawned on an open replica only");
        };
        let registry = Arc::clone(&self.registry);
        let answers = self.answers.clone();
        tokio::spawn(async move {
            let result = tokio::task::spawn_blocking(move || {
                snapshot::execute(&registry, &name, &volume, request)
            })
            .await
            .unwrap_or_else(|error| Err(refusal(Status::Io, format!("request failed: {error}"))));
            let _ = answers.send(answer(handle, result)).await;
            drop(permit);
        });
    }

    async fn send(&self, frame: Vec<u8>) {
        let _ = self.answers.send(frame).await;
    }

    async fn malformed(&self, handle: u64, error: WireError) -> String {
        let reason = format!("malformed request: {error}");
        self.send(answer(
            handle,
            Err(refusal(Status::Malformed, reason.clone())),
        ))
        .await;
        reason
    }

    async fn open(&mut self, request: Request) -> Result<Vec<u8>, Refusal> {
        let registry = Arc::clone(&self.registry);
        let peer = self.peer.clone();
        let (name, opened) = match request {
            Request::Open { name } => {
                let task_name = name.clone();
                (
                    name,
                    tokio::task::spawn_blocking(move || registry.open(&task_name, &peer)).await,
                )
            }
            Request::Create {
                name,
                journal_bytes,
                superblock,
            } => {
                let task_name = name.clone();
                let template = LegTemplate {
                    superblock,
                    journal_bytes,
                };
                (
                    name,
                    tokio::task::spawn_blocking(move || {
                        registry.create(&task_name, &template, &peer)
                    })
                    .await,
                )
            }
            _ => unreachable!("only OPEN and CREATE come here"),
        };
        let (volume, info) = opened
            .unwrap_or_else(|error| Err(refusal(Status::Io, format!("open failed: {error}"))))
            .inspect_err(|(_, body)| {
                tracing::warn!(peer = self.peer, name, "replica: refused: {}", body.message)
            })?;
        self.opened = Some((name, volume));
        Ok(info.encode().to_vec())
    }
}
