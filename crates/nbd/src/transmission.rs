//! The transmission phase of one connection.
//!
//! Pipeline: a reader (this task) parses and validates request headers,
//! reads WRITE payloads, takes in-flight permits (backpressure: it stops
//! reading when a limit is reached) and hands each valid request to the
//! worker pool. Workers call the export and queue an encoded reply on an
//! unbounded channel — bounded in practice by the permits each reply holds
//! until it is written. A writer task drains that channel, coalescing small
//! replies into one buffer and writing large read payloads directly.
//!
//! Invalid requests are answered by the reader itself (no thread hop), after
//! consuming any WRITE payload so the stream never desynchronises.
//!
//! The inline fast path: a small READ, or WRITE without FUA, that the
//! export can complete without blocking (page cache, write-back buffer;
//! `Export::try_read` / `try_write`) is executed by the reader itself, like
//! an invalid request; one that would block goes to the pool exactly as
//! above. A WRITE the export can *start* without blocking and finish on
//! another thread (`Export::try_start_write`: a mirror's remote legs) is
//! started by the reader, and its reply is queued from the thread that
//! finishes it (`WriteCompletion`): no worker sleeps on it. Likewise a
//! READ that must wait for the device is started on the export's ring of
//! reads (`Export::try_start_read`) and answered by the server's reaper
//! task when the ring's eventfd says it completed (`ReadCompletion`); one
//! the export cannot finish that way goes to the pool after all.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{watch, Semaphore};
use tracing::{debug, warn};

use crate::export::{Errno, Export, ExportError, Integrity, PayloadBuffer, ZeroFlags};
use crate::handshake::Session;
use crate::limits::Limits;
use crate::metrics::{ExportMetrics, Metrics};
use crate::permits::Permits;
use crate::wire::{self, Command, Request};
use crate::worker::WorkerPool;

mod completion;

/// Bytes the request reader buffers from the socket.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// The writer flushes its coalescing buffer once it holds this much.
const WRITE_BATCH_BYTES: usize = 256 * 1024;
/// Read payloads up to this size are copied into the coalescing buffer;
/// larger ones are written straight from the read buffer.
const COPY_PAYLOAD_MAX_BYTES: usize = 64 * 1024;
/// Largest READ the reader task executes itself when the export can do so
/// without blocking (`try_inline`); larger ones always go to a worker, so
/// one request never holds the reactor for long.
const INLINE_MAX_BYTES: usize = 128 * 1024;
/// Largest WRITE the reader task executes itself (`try_inline`). Larger
/// than a read's: the reader already spent a copy of the payload receiving
/// it, and an export that can buffer it without waiting only checksums
/// it (~0.1 ms a MiB), which costs less than the two thread hand-offs of a
/// worker (1 MiB writes at QD8: 10-18 % more throughput, 20 % less server
/// CPU per request, docs/BENCHMARKS.md).
const INLINE_WRITE_MAX_BYTES: usize = 1024 * 1024;
/// Servers SHOULD NOT send more than 2^20 block status descriptors per chunk.
const MAX_BLOCK_STATUS_EXTENTS: usize = 1 << 20;

/// Why a connection ended abnormally.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectionError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol violation: {0}")]
    Protocol(String),
}

/// An encoded reply waiting for the writer. Holds the request's in-flight
/// permits so memory stays bounded until the bytes are on the socket.
pub(crate) struct Reply {
    head: Vec<u8>,
    data: Vec<u8>,
    layout: Layout,
    _permits: Option<Permits>,
}

enum Layout {
    /// `head` then all of `data`.
    Single,
    /// Alternating: `head[previous end..head_end]` then `data[data]`.
    Pieces(Vec<Piece>),
}

struct Piece {
    head_end: usize,
    data: Range<usize>,
}

/// Per-connection state shared by the reader and jobs on worker threads.
struct Connection {
    session: Session,
    /// The counters of the session's export.
    metrics: Arc<ExportMetrics>,
    replies: UnboundedSender<Reply>,
    /// The server's workers: a READ the ring gave back runs on them.
    pool: Arc<WorkerPool>,
}

/// Shared, server-wide resources a connection uses.
pub(crate) struct ServerResources {
    pub metrics: Arc<Metrics>,
    pub pool: Arc<WorkerPool>,
    pub server_bytes: Arc<Semaphore>,
    pub limits: Limits,
}

/// Run the transmission phase until DISC, EOF, shutdown or a protocol error.
pub(crate) async fn run<S>(
    stream: S,
    session: Session,
    resources: &ServerResources,
    mut shutdown: watch::Receiver<bool>,
    low_water: Option<ReceiveLowWater>,
) -> Result<(), ConnectionError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (read_half, write_half) = tokio::io::split(stream);
    let (replies, reply_queue) = unbounded_channel();
    let writer = tokio::spawn(write_replies(
        write_half,
        reply_queue,
        resources.limits.reply_write_timeout,
    ));
    let connection = Arc::new(Connection {
        metrics: resources.metrics.export(&session.export_name),
        session,
        replies,
        pool: Arc::clone(&resources.pool),
    });
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, read_half);
    let result = read_requests(
        &mut reader,
        &connection,
        resources,
        &mut shutdown,
        low_water.as_ref(),
    )
    .await;
    // Dropping our sender lets the writer finish once every in-flight job
    // (each holding a sender clone) has queued its reply.
    drop(connection);
    match result {
        Err(ConnectionError::Protocol(reason)) => {
            resources.metrics.protocol_error();
            writer.abort();
            Err(ConnectionError::Protocol(reason))
        }
        other => {
            let written = writer.await.unwrap_or(Ok(()));
            other?;
            written.map_err(ConnectionError::Io)
        }
    }
}

async fn read_requests<R>(
    reader: &mut BufReader<R>,
    connection: &Arc<Connection>,
    resources: &ServerResources,
    shutdown: &mut watch::Receiver<bool>,
    low_water: Option<&ReceiveLowWater>,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
{
    let limits = &resources.limits;
    let request_slots = Arc::new(Semaphore::new(
        limits.max_in_flight_requests_per_connection.max(1),
    ));
    let connection_bytes = Arc::new(Semaphore::new(permits_for(
        limits.max_in_flight_bytes_per_connection,
    )));
    let mut header = [0u8; wire::REQUEST_HEADER_BYTES];
    let mut queued = QueuedHint {
        export: connection.session.export.as_ref(),
        sent: false,
        shallow_run: 0,
    };
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        tokio::select! {
            biased;
            _ = shutdown.changed() => return Ok(()),
            _ = connection.replies.closed() => return Ok(()),
            read = reader.read_exact(&mut header) => match read {
                Ok(_) => {}
                Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(error) => return Err(error.into()),
            },
        }
        let request =
            wire::parse_request(&header).map_err(|e| ConnectionError::Protocol(e.to_string()))?;
        let received = Instant::now();
        let command = match validate(&connection.session, limits, &request) {
            Ok(command) => command,
            Err(errno) => {
                reject(reader, connection, limits, &request, errno).await?;
                continue;
            }
        };
        if command == Command::Disc {
            debug!("client sent NBD_CMD_DISC");
            return Ok(());
        }
        let data_bytes = match command {
            Command::Read | Command::Write => u64::from(request.length),
            _ => 0,
        };
        let permits = acquire_permits(
            &request_slots,
            &connection_bytes,
            &resources.server_bytes,
            data_bytes,
            limits,
        )
        .await;
        let payload = if command == Command::Write {
            let length = request.length as usize;
            let lent = (length >= LEND_FROM_BYTES
                && request.offset.is_multiple_of(LEND_ALIGN)
                && (length as u64).is_multiple_of(LEND_ALIGN))
            .then(|| {
                connection
                    .session
                    .export
                    .payload_buffer(request.offset, length)
            })
            .flatten();
            match lent {
                // One lent with another length is not used, rather than trusted.
                Some(lent) if lent.len() == length => receive_into(reader, lent, low_water).await?,
                _ => read_payload(reader, length, low_water).await?,
            }
        } else {
            Bytes::new()
        };
        connection.metrics.request_started();
        if is_unaligned(&connection.session, &request, command) {
            connection.metrics.request_unaligned(command);
        }
        if command == Command::Write {
            // The next request (or part of it) already received: the
            // client did not wait for this reply to send it.
            queued.set(!reader.buffer().is_empty());
        }
        let permits = match try_inline(connection, &request, command, &payload, permits, received) {
            Ok(()) => continue,
            Err(permits) => permits,
        };
        let started = match command {
            Command::Write => {
                completion::try_start_inline(connection, &request, &payload, permits, received)
            }
            Command::Read => {
                completion::try_start_read_inline(connection, &request, permits, received)
            }
            _ => Err(permits),
        };
        let permits = match started {
            Ok(()) => continue,
            Err(permits) => permits,
        };
        let connection = connection.clone();
        resources.pool.submit(Box::new(move || {
            if command == Command::Flush {
                completion::flush(connection, request, permits, received);
            } else {
                execute(&connection, request, command, payload, permits, received);
            }
        }));
    }
}

/// Writes in a row with nothing received behind them before a connection
/// that told its export `true` tells it `false` (`QueuedHint`).
const SHALLOW_AFTER_WRITES: u32 = 8;

/// What a connection last told its export about requests queued behind
/// its writes (`Export::writes_queued`): `false` until it says otherwise,
/// sent on a change only, and `false` again when the connection ends with
/// `true` sent (the export counts the connections that said `true`). `true` as soon
/// as a write has the next request (or part of it) received behind it;
/// `false` only after `SHALLOW_AFTER_WRITES` writes in a row had none: a
/// deep client's requests come in batches (one receive of up to 64 KiB),
/// and the last write of each batch finds nothing behind it, while a
/// client that waits for each reply never has anything behind.
struct QueuedHint<'a> {
    export: &'a dyn Export,
    sent: bool,
    shallow_run: u32,
}

impl QueuedHint<'_> {
    fn set(&mut self, queued: bool) {
        let queued = if queued {
            self.shallow_run = 0;
            true
        } else {
            self.shallow_run = self.shallow_run.saturating_add(1);
            self.sent && self.shallow_run < SHALLOW_AFTER_WRITES
        };
        if self.sent != queued && self.export.writes_queued(queued) {
            self.sent = queued;
        }
    }
}

impl Drop for QueuedHint<'_> {
    fn drop(&mut self) {
        if self.sent {
            self.export.writes_queued(false);
        }
    }
}

fn permits_for(bytes: u64) -> usize {
    // tokio semaphores hold at most usize::MAX >> 3 permits.
    usize::try_from(bytes)
        .unwrap_or(usize::MAX)
        .clamp(1, Semaphore::MAX_PERMITS)
}

async fn acquire_permits(
    request_slots: &Arc<Semaphore>,
    connection_bytes: &Arc<Semaphore>,
    server_bytes: &Arc<Semaphore>,
    data_bytes: u64,
    limits: &Limits,
) -> Permits {
    let request = request_slots
        .clone()
        .acquire_owned()
        .await
        .expect("semaphore never closed");
    if data_bytes == 0 {
        return Permits {
            _request: request,
            _connection_bytes: None,
            _server_bytes: None,
        };
    }
    // A single request larger than a limit still runs, alone.
    let cost = |limit: u64| u32::try_from(data_bytes.min(limit).max(1)).unwrap_or(u32::MAX);
    // Connection permits first, then server permits: every connection
    // acquires in this order so no cycle can form.
    let connection = connection_bytes
        .clone()
        .acquire_many_owned(cost(limits.max_in_flight_bytes_per_connection))
        .await
        .expect("semaphore never closed");
    let server = server_bytes
        .clone()
        .acquire_many_owned(cost(limits.max_in_flight_bytes_per_server))
        .await
        .expect("semaphore never closed");
    Permits {
        _request: request,
        _connection_bytes: Some(connection),
        _server_bytes: Some(server),
    }
}

/// Protocol-layer validation of a request; the export is only called with
/// requests that pass. Returns the errno to answer otherwise.
fn validate(session: &Session, limits: &Limits, request: &Request) -> Result<Command, Errno> {
    let Some(command) = request.known_command() else {
        return Err(Errno::Inval);
    };
    let flags = session.transmission_flags;
    let mut allowed = if flags & wire::TFLAG_SEND_FUA != 0 {
        wire::CMD_FLAG_FUA
    } else {
        0
    };
    match command {
        Command::Disc => return Ok(command),
        Command::Read if session.structured_replies => allowed |= wire::CMD_FLAG_DF,
        Command::WriteZeroes => {
            allowed |= wire::CMD_FLAG_NO_HOLE;
            if flags & wire::TFLAG_SEND_FAST_ZERO != 0 {
                allowed |= wire::CMD_FLAG_FAST_ZERO;
            }
        }
        Command::BlockStatus => allowed |= wire::CMD_FLAG_REQ_ONE,
        _ => {}
    }
    if request.flags & !allowed != 0 {
        return Err(Errno::Inval);
    }
    let writes = matches!(
        command,
        Command::Write | Command::Trim | Command::WriteZeroes
    );
    if writes && flags & wire::TFLAG_READ_ONLY != 0 {
        return Err(Errno::Perm);
    }
    let advertised = match command {
        Command::Trim => flags & wire::TFLAG_SEND_TRIM != 0,
        Command::WriteZeroes => flags & wire::TFLAG_SEND_WRITE_ZEROES != 0,
        Command::Cache => flags & wire::TFLAG_SEND_CACHE != 0,
        Command::BlockStatus => session.contexts.any(),
        _ => true,
    };
    if !advertised {
        return Err(Errno::Inval);
    }
    if command == Command::Flush {
        // Offset and length are reserved and MUST be zero.
        return if request.offset == 0 && request.length == 0 {
            Ok(command)
        } else {
            Err(Errno::Inval)
        };
    }
    let max_payload = session.block_sizes.maximum.min(limits.max_payload_bytes);
    if request.length > max_payload {
        match command {
            Command::Write => return Err(Errno::Inval),
            // A structured read reply is server-controlled: EOVERFLOW tells
            // the client to retry smaller; a simple read just fails.
            Command::Read if session.structured_replies => return Err(Errno::Overflow),
            Command::Read => return Err(Errno::Inval),
            _ => {}
        }
    }
    let length = u64::from(request.length);
    let in_bounds = request.offset <= session.size && length <= session.size - request.offset;
    if !in_bounds {
        return Err(match command {
            Command::Write | Command::WriteZeroes => Errno::NoSpc,
            _ => Errno::Inval,
        });
    }
    // The advertised minimum binds a client that asked for block sizes;
    // one that did not may use any byte the export can serve
    // (`Session::request_alignment`).
    let minimum = u64::from(session.request_alignment);
    let end = request.offset + length;
    if !request.offset.is_multiple_of(minimum)
        || (!end.is_multiple_of(minimum) && end != session.size)
    {
        return Err(Errno::Inval);
    }
    if command == Command::BlockStatus && request.length == 0 {
        // A block status reply must describe at least one non-empty extent.
        return Err(Errno::Inval);
    }
    Ok(command)
}

/// A valid data request whose offset or length is not a multiple of the
/// preferred block size: an export read-modify-writes the blocks such a
/// write or zeroing covers in part (counted per export:
/// `vouch_nbd_unaligned_requests_total`).
fn is_unaligned(session: &Session, request: &Request, command: Command) -> bool {
    let data = matches!(
        command,
        Command::Read | Command::Write | Command::Trim | Command::WriteZeroes
    );
    let preferred = u64::from(session.block_sizes.preferred);
    data && request.length > 0
        && !(request.offset.is_multiple_of(preferred)
            && u64::from(request.length).is_multiple_of(preferred))
}

/// Answer an invalid request from the reader, discarding any WRITE payload.
async fn reject<R>(
    reader: &mut BufReader<R>,
    connection: &Connection,
    limits: &Limits,
    request: &Request,
    errno: Errno,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
{
    debug!(%request, errno = errno.name(), "request rejected");
    if request.known_command() == Some(Command::Write) && request.length > 0 {
        let length = u64::from(request.length);
        if length > limits.max_discard_bytes {
            return Err(ConnectionError::Protocol(format!(
                "write payload of {length} bytes too large to discard"
            )));
        }
        let copied =
            tokio::io::copy(&mut (&mut *reader).take(length), &mut tokio::io::sink()).await?;
        if copied != length {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    connection.metrics.request_rejected(errno);
    let error = ExportError::new(
        errno,
        format!("{}: {}", errno.name(), rejection_reason(errno)),
    );
    let reply = error_reply(&connection.session, request.cookie, &error, None);
    // The writer may be gone (client vanished); the reader notices on its next read.
    let _ = connection.replies.send(reply);
    Ok(())
}

fn rejection_reason(errno: Errno) -> &'static str {
    match errno {
        Errno::Perm => "export is read-only",
        Errno::NoSpc => "request extends past the end of the export",
        Errno::Overflow => "request larger than the maximum payload",
        _ => "invalid request (command, flags, range or alignment)",
    }
}

/// The inline fast path (issue 11): a READ, or a WRITE without FUA, of at
/// most `INLINE_MAX_BYTES` that the export can complete without blocking
/// (`Export::try_read`: page cache, write-back buffer; `Export::try_write`:
/// a write-back buffer with room) runs here on the reader task, saving the
/// hand-offs to a worker thread and back, which cost more than the work.
/// Gives the permits back when the request would block (or is of another
/// kind); the caller then submits it to the pool as usual.
fn try_inline(
    connection: &Connection,
    request: &Request,
    command: Command,
    payload: &Bytes,
    permits: Permits,
    received: Instant,
) -> Result<(), Permits> {
    let length = request.length as usize;
    let fua = request.flags & wire::CMD_FLAG_FUA != 0;
    let inline = match command {
        Command::Read => true,
        Command::Write => !fua,
        _ => false,
    };
    let max = match command {
        Command::Write => INLINE_WRITE_MAX_BYTES,
        _ => INLINE_MAX_BYTES,
    };
    if !inline || length == 0 || length > max {
        return Err(permits);
    }
    let session = &connection.session;
    let export = session.export.as_ref();
    let outcome = catch_unwind(AssertUnwindSafe(|| match command {
        Command::Read => {
            let mut data = vec![0u8; length];
            let holes = export.try_read(request.offset, &mut data)?;
            Some(holes.map(|holes| read_reply_of(session, request, data, holes)))
        }
        _ => {
            let written = export.try_write(request.offset, payload)?;
            Some(written.map(|()| done_reply(session, request.cookie)))
        }
    }));
    let outcome = match outcome {
        Ok(None) => return Err(permits),
        Ok(Some(reply)) => Ok(reply),
        Err(panic) => Err(panic),
    };
    connection.metrics.request_inline(command);
    finish(connection, request, command, outcome, permits, received);
    Ok(())
}

/// Runs on a worker thread: call the export and queue the reply.
fn execute(
    connection: &Connection,
    request: Request,
    command: Command,
    payload: Bytes,
    permits: Permits,
    received: Instant,
) {
    let export = connection.session.export.as_ref();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        run_command(connection, export, &request, command, &payload)
    }));
    finish(connection, &request, command, outcome, permits, received);
}

/// Encode the outcome of a request (its reply, an export error or a panic),
/// count it and queue the reply for the writer.
fn finish(
    connection: &Connection,
    request: &Request,
    command: Command,
    outcome: std::thread::Result<Result<Reply, ExportError>>,
    permits: Permits,
    received: Instant,
) {
    let mut reply = match outcome {
        Ok(Ok(reply)) => reply,
        Ok(Err(error)) => {
            if let Some(kind) = error.fault_kind {
                connection.metrics.fault(kind);
                warn!(
                    export = %connection.session.export_name,
                    command = command.name(),
                    offset = error.offset.unwrap_or(request.offset),
                    length = request.length,
                    kind,
                    message = %error.message,
                    "verification fault"
                );
            } else {
                debug!(%request, %error, "export error");
            }
            error_reply(&connection.session, request.cookie, &error, Some(request))
        }
        Err(_) => {
            warn!(%request, "export panicked; answering EIO");
            let error = ExportError::new(Errno::Io, "internal error");
            error_reply(&connection.session, request.cookie, &error, None)
        }
    };
    let errno = errno_of(&reply);
    let bytes = match command {
        Command::Flush => 0,
        _ => u64::from(request.length),
    };
    connection
        .metrics
        .request_finished(command, bytes, received.elapsed(), errno);
    reply._permits = Some(permits);
    let _ = connection.replies.send(reply);
}

/// Recover the errno from an encoded reply for metrics (cheap header peek).
fn errno_of(reply: &Reply) -> Option<Errno> {
    let head = &reply.head;
    let wire_errno = if head.len() >= 8 && head[0..4] == wire::SIMPLE_REPLY_MAGIC.to_be_bytes() {
        u32::from_be_bytes([head[4], head[5], head[6], head[7]])
    } else if head.len() >= 24 && u16::from_be_bytes([head[6], head[7]]) & 0x8000 != 0 {
        u32::from_be_bytes([head[20], head[21], head[22], head[23]])
    } else {
        0
    };
    Errno::ALL
        .into_iter()
        .find(|errno| errno.wire_value() == wire_errno)
}

fn run_command(
    connection: &Connection,
    export: &dyn Export,
    request: &Request,
    command: Command,
    payload: &Bytes,
) -> Result<Reply, ExportError> {
    let session = &connection.session;
    let fua = request.flags & wire::CMD_FLAG_FUA != 0;
    let offset = request.offset;
    let length = u64::from(request.length);
    // Zero-length requests are unspecified; succeed without touching the export.
    let empty = length == 0;
    match command {
        Command::Read => read_reply(session, export, request),
        Command::Write => {
            if !empty {
                export.write(offset, payload, fua)?;
            }
            Ok(done_reply(session, request.cookie))
        }
        Command::Trim => {
            if !empty {
                export.trim(offset, length, fua)?;
            }
            Ok(done_reply(session, request.cookie))
        }
        Command::WriteZeroes => {
            if !empty {
                let flags = ZeroFlags {
                    fua,
                    no_hole: request.flags & wire::CMD_FLAG_NO_HOLE != 0,
                    fast_zero: request.flags & wire::CMD_FLAG_FAST_ZERO != 0,
                };
                export.write_zeroes(offset, length, flags)?;
            }
            Ok(done_reply(session, request.cookie))
        }
        Command::Cache => {
            if !empty {
                export.cache(offset, length)?;
            }
            Ok(done_reply(session, request.cookie))
        }
        Command::BlockStatus => block_status_reply(session, export, request),
        Command::Disc => unreachable!("DISC is handled by the reader"),
        Command::Flush => unreachable!("FLUSH runs through Export::flush_then (completion::flush)"),
    }
}

/// Success without payload: a simple reply (allowed for everything but READ
/// even with structured replies, and cheaper to encode).
fn done_reply(_session: &Session, cookie: u64) -> Reply {
    Reply {
        head: wire::simple_reply(0, cookie).to_vec(),
        data: Vec::new(),
        layout: Layout::Single,
        _permits: None,
    }
}

fn error_reply(
    session: &Session,
    cookie: u64,
    error: &ExportError,
    request: Option<&Request>,
) -> Reply {
    let wire_errno = error.errno.wire_value();
    let head = if session.structured_replies {
        // ERROR_OFFSET only when the offset lies inside the request, as the spec requires.
        let offset = match (error.offset, request) {
            (Some(offset), Some(request))
                if request.known_command() != Some(Command::Flush)
                    && offset >= request.offset
                    && offset < request.offset + u64::from(request.length) =>
            {
                Some(offset)
            }
            _ => None,
        };
        let mut head = Vec::with_capacity(wire::STRUCTURED_HEADER_BYTES + 14 + error.message.len());
        wire::push_error_chunk(&mut head, cookie, wire_errno, &error.message, offset);
        head
    } else {
        wire::simple_reply(wire_errno, cookie).to_vec()
    };
    Reply {
        head,
        data: Vec::new(),
        layout: Layout::Single,
        _permits: None,
    }
}

/// Payloads at least this large start on a page boundary (`read_payload`).
const ALIGN_PAYLOAD_FROM_BYTES: usize = 64 * 1024;

/// WRITE payloads at least this large, at offsets and of lengths that are
/// multiples of `LEND_ALIGN`, are received into memory the export lends
/// (`Export::payload_buffer`), if it does: below it the copy the export
/// saves costs less than asking.
const LEND_FROM_BYTES: usize = 64 * 1024;
const LEND_ALIGN: u64 = 4096;

/// `read_payload` into a buffer the export lent: the payload lands where
/// the export keeps it, with no copy after (`Export::payload_buffer`).
async fn receive_into<R>(
    reader: &mut BufReader<R>,
    mut lent: Box<dyn PayloadBuffer>,
    low_water: Option<&ReceiveLowWater>,
) -> std::io::Result<Bytes>
where
    R: AsyncRead + Unpin,
{
    let buffer = lent.as_mut_slice();
    let mut filled = 0;
    while filled < buffer.len() {
        if let Some(low_water) = low_water {
            low_water.expect((buffer.len() - filled).saturating_sub(reader.buffer().len()));
        }
        let read = reader.read(&mut buffer[filled..]).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        filled += read;
    }
    if let Some(low_water) = low_water {
        low_water.expect(0);
    }
    Ok(lent.freeze())
}

/// A write's `length` bytes of data, received into a buffer of their own
/// that the export may keep (`Export::write`): a large one's first byte is
/// on a page boundary (the kernel copies a page-aligned buffer into the
/// page cache fastest, and O_DIRECT writes it without a bounce buffer),
/// and it is not
/// zeroed first (a 1 MiB write would otherwise pay a memset it overwrites).
/// On plain TCP the socket is asked to wake the reader only once the rest
/// of a large payload has arrived (`ReceiveLowWater`).
async fn read_payload<R>(
    reader: &mut BufReader<R>,
    length: usize,
    low_water: Option<&ReceiveLowWater>,
) -> std::io::Result<Bytes>
where
    R: AsyncRead + Unpin,
{
    const PAGE: usize = 4096;
    // Small payloads are not worth up to a page of padding each (they stay
    // in the export's write-back buffer until a commit).
    let align = if length >= ALIGN_PAYLOAD_FROM_BYTES {
        PAGE
    } else {
        1
    };
    // Room for the bytes after any padding, so the Vec never reallocates.
    let mut payload: Vec<u8> = Vec::with_capacity(length + align - 1);
    let pad = payload.as_ptr().align_offset(align).min(align - 1);
    payload.resize(pad, 0);
    let end = pad + length;
    while payload.len() < end {
        let remaining = end - payload.len();
        if let Some(low_water) = low_water {
            low_water.expect(remaining.saturating_sub(reader.buffer().len()));
        }
        let read = (&mut *reader)
            .take(remaining as u64)
            .read_buf(&mut payload)
            .await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    if let Some(low_water) = low_water {
        low_water.expect(0);
    }
    Ok(Bytes::from(payload).slice(pad..))
}

/// The receive low-water mark of a plain TCP connection (`SO_RCVLOWAT`).
/// A 1 MiB WRITE payload arrives over loopback in dozens of segments, and
/// by default each one that finds the reader waiting wakes it (an epoll
/// wake-up and a context switch, which cost more than the copy on a small
/// VM). While the rest of a large payload is on its way, the mark is
/// raised to that many bytes, so the socket reports readable once it is
/// all there; it is lowered again before the next request header, which
/// may be all the client sends. Never set on TLS, where the bytes to come
/// on the socket are not known exactly (records, buffered ciphertext):
/// a mark above them would never be reached.
pub(crate) struct ReceiveLowWater {
    fd: std::os::fd::RawFd,
    /// The mark set now (only the connection's reader task changes it).
    mark: std::sync::atomic::AtomicUsize,
}

impl ReceiveLowWater {
    /// Payloads that still need at least this many bytes from the socket
    /// raise the mark; smaller ones are read as they come.
    const RAISE_FROM_BYTES: usize = 64 * 1024;

    /// For the TCP socket `fd`, which must outlive this value (the
    /// connection owns both).
    pub(crate) fn new(fd: std::os::fd::RawFd) -> ReceiveLowWater {
        ReceiveLowWater {
            fd,
            mark: std::sync::atomic::AtomicUsize::new(1),
        }
    }

    /// Expect `bytes` more of a payload from the socket: the mark is that
    /// many bytes if that is large, else the default of 1 byte.
    fn expect(&self, bytes: usize) {
        let mark = if bytes >= Self::RAISE_FROM_BYTES {
            bytes
        } else {
            1
        };
        if mark == self.mark.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let value = libc::c_int::try_from(mark).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fd` is the connection's open TCP socket (see `new`); the
        // option value is a valid c_int of the size given.
        let result = unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        // A refused mark only costs wake-ups: keep reading either way.
        if result == 0 {
            self.mark.store(mark, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

fn read_reply(
    session: &Session,
    export: &dyn Export,
    request: &Request,
) -> Result<Reply, ExportError> {
    let length = request.length as usize;
    let mut data = vec![0u8; length];
    let holes = if length > 0 {
        export.read(request.offset, &mut data)?
    } else {
        Vec::new()
    };
    Ok(read_reply_of(session, request, data, holes))
}

/// The reply to a READ whose bytes are in `data`, `holes` (relative to the
/// request) known to be zero.
fn read_reply_of(
    session: &Session,
    request: &Request,
    data: Vec<u8>,
    holes: Vec<Range<u64>>,
) -> Reply {
    let length = request.length as usize;
    let cookie = request.cookie;
    if !session.structured_replies {
        return Reply {
            head: wire::simple_reply(0, cookie).to_vec(),
            data,
            layout: Layout::Single,
            _permits: None,
        };
    }
    if length == 0 {
        let head = wire::structured_header(wire::REPLY_FLAG_DONE, wire::REPLY_TYPE_NONE, cookie, 0)
            .to_vec();
        return Reply {
            head,
            data,
            layout: Layout::Single,
            _permits: None,
        };
    }
    let df = request.flags & wire::CMD_FLAG_DF != 0;
    let holes = if df {
        Vec::new()
    } else {
        usable_holes(holes, length as u64)
    };
    if holes.is_empty() {
        // The whole buffer is read already, so no error can follow: DONE on the data chunk.
        let mut head = Vec::with_capacity(wire::STRUCTURED_HEADER_BYTES + 8);
        wire::push_offset_data_header(
            &mut head,
            wire::REPLY_FLAG_DONE,
            cookie,
            request.offset,
            length as u32,
        );
        return Reply {
            head,
            data,
            layout: Layout::Single,
            _permits: None,
        };
    }
    // Split into alternating data / hole chunks.
    let mut segments: Vec<(Range<usize>, bool)> = Vec::with_capacity(holes.len() * 2 + 1);
    let mut cursor = 0usize;
    for hole in &holes {
        let (start, end) = (hole.start as usize, hole.end as usize);
        if start > cursor {
            segments.push((cursor..start, false));
        }
        segments.push((start..end, true));
        cursor = end;
    }
    if cursor < length {
        segments.push((cursor..length, false));
    }
    let mut head = Vec::with_capacity(segments.len() * 32);
    let mut pieces = Vec::with_capacity(segments.len());
    let last = segments.len() - 1;
    for (index, (range, is_hole)) in segments.into_iter().enumerate() {
        let flags = if index == last {
            wire::REPLY_FLAG_DONE
        } else {
            0
        };
        let offset = request.offset + range.start as u64;
        let chunk_len = (range.end - range.start) as u32;
        if is_hole {
            wire::push_offset_hole(&mut head, flags, cookie, offset, chunk_len);
            pieces.push(Piece {
                head_end: head.len(),
                data: 0..0,
            });
        } else {
            wire::push_offset_data_header(&mut head, flags, cookie, offset, chunk_len);
            pieces.push(Piece {
                head_end: head.len(),
                data: range,
            });
        }
    }
    Reply {
        head,
        data,
        layout: Layout::Pieces(pieces),
        _permits: None,
    }
}

/// Hole ranges as the export returned them, if they are well-formed (sorted,
/// non-empty, non-overlapping, inside the read); otherwise none — the data
/// buffer is complete either way, so ignoring holes is always correct.
fn usable_holes(holes: Vec<Range<u64>>, length: u64) -> Vec<Range<u64>> {
    let mut previous_end = 0u64;
    for hole in &holes {
        if hole.start >= hole.end || hole.start < previous_end || hole.end > length {
            debug!(
                ?holes,
                length, "export returned malformed hole list; sending data"
            );
            return Vec::new();
        }
        previous_end = hole.end;
    }
    holes
}

fn block_status_reply(
    session: &Session,
    export: &dyn Export,
    request: &Request,
) -> Result<Reply, ExportError> {
    let req_one = request.flags & wire::CMD_FLAG_REQ_ONE != 0;
    let length = u64::from(request.length);
    // One chunk per selected context (the spec's rule), DONE on the last.
    let mut chunks: Vec<(u32, Vec<(u32, u32)>)> = Vec::with_capacity(2);
    if let Some(context_id) = session.contexts.base_allocation {
        let extents = export.block_status(request.offset, length)?;
        let runs = extents.iter().map(|extent| {
            let status = (if extent.hole { wire::STATE_HOLE } else { 0 })
                | (if extent.zero { wire::STATE_ZERO } else { 0 });
            (extent.length, status)
        });
        chunks.push((context_id, descriptors(runs, length, req_one)));
    }
    if let Some(context_id) = session.contexts.integrity {
        let extents = export.integrity_status(request.offset, length)?;
        let runs = extents.iter().map(|extent| {
            let status = match extent.status {
                Integrity::Verified => wire::INTEGRITY_VERIFIED,
                Integrity::Fault => wire::INTEGRITY_FAULT,
                Integrity::Hole => wire::INTEGRITY_HOLE,
            };
            (extent.length, status)
        });
        chunks.push((context_id, descriptors(runs, length, req_one)));
    }
    if let Some(context_id) = session.contexts.allocation_depth {
        let runs = export.allocation_depth(request.offset, length)?;
        chunks.push((context_id, descriptors(runs, length, req_one)));
    }
    for (context_id, bitmap) in &session.contexts.dirty_bitmaps {
        let runs = export.dirty_status(bitmap, request.offset, length)?;
        let runs = runs
            .into_iter()
            .map(|(bytes, dirty)| (bytes, if dirty { wire::STATE_DIRTY } else { 0 }));
        chunks.push((*context_id, descriptors(runs, length, req_one)));
    }
    debug_assert!(!chunks.is_empty(), "validated: a context was negotiated");
    if chunks.iter().any(|(_, descriptors)| descriptors.is_empty()) {
        return Err(ExportError::new(
            Errno::Io,
            "export returned no block status extents",
        ));
    }
    let descriptor_count: usize = chunks.iter().map(|(_, d)| d.len()).sum();
    let mut head = Vec::with_capacity(
        chunks.len() * (wire::STRUCTURED_HEADER_BYTES + 4) + 8 * descriptor_count,
    );
    let last = chunks.len() - 1;
    for (index, (context_id, descriptors)) in chunks.iter().enumerate() {
        let flags = if index == last {
            wire::REPLY_FLAG_DONE
        } else {
            0
        };
        wire::push_block_status(&mut head, flags, request.cookie, *context_id, descriptors);
    }
    Ok(Reply {
        head,
        data: Vec::new(),
        layout: Layout::Single,
        _permits: None,
    })
}

/// Convert runs of `(length, status)` to wire descriptors: clipped to the
/// request (so every length fits in u32 and REQ_ONE's bound holds), empty
/// runs dropped, equal neighbours merged, capped at 2^20 descriptors.
pub(crate) fn descriptors(
    runs: impl IntoIterator<Item = (u64, u32)>,
    request_length: u64,
    req_one: bool,
) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut covered = 0u64;
    for (length, status) in runs {
        if covered >= request_length {
            break;
        }
        let length = length.min(request_length - covered);
        if length == 0 {
            continue;
        }
        covered += length;
        let length = length as u32; // <= request_length, itself a u32
        match out.last_mut() {
            Some((last_len, last_status)) if *last_status == status => *last_len += length,
            _ => {
                if out.len() == MAX_BLOCK_STATUS_EXTENTS {
                    break;
                }
                out.push((length, status));
            }
        }
    }
    if req_one {
        out.truncate(1);
    }
    out
}

/// The writer task: drain replies, coalesce, write.
async fn write_replies<W>(
    mut writer: tokio::io::WriteHalf<W>,
    mut queue: UnboundedReceiver<Reply>,
    stall_timeout: Duration,
) -> std::io::Result<()>
where
    W: AsyncRead + AsyncWrite,
{
    let mut out: Vec<u8> = Vec::with_capacity(WRITE_BATCH_BYTES + COPY_PAYLOAD_MAX_BYTES);
    while let Some(reply) = queue.recv().await {
        append(&mut writer, &mut out, reply, stall_timeout).await?;
        while let Ok(reply) = queue.try_recv() {
            append(&mut writer, &mut out, reply, stall_timeout).await?;
        }
        write_timed(&mut writer, &out, stall_timeout).await?;
        out.clear();
        writer.flush().await?;
    }
    writer.shutdown().await
}

async fn append<W>(
    writer: &mut W,
    out: &mut Vec<u8>,
    reply: Reply,
    stall_timeout: Duration,
) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    match &reply.layout {
        Layout::Single => {
            push_segment(writer, out, &reply.head, &reply.data, stall_timeout).await?
        }
        Layout::Pieces(pieces) => {
            let mut head_start = 0;
            for piece in pieces {
                let head = &reply.head[head_start..piece.head_end];
                push_segment(
                    writer,
                    out,
                    head,
                    &reply.data[piece.data.clone()],
                    stall_timeout,
                )
                .await?;
                head_start = piece.head_end;
            }
        }
    }
    if out.len() >= WRITE_BATCH_BYTES {
        write_timed(writer, out, stall_timeout).await?;
        out.clear();
    }
    Ok(())
}

async fn push_segment<W>(
    writer: &mut W,
    out: &mut Vec<u8>,
    head: &[u8],
    data: &[u8],
    stall_timeout: Duration,
) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    out.extend_from_slice(head);
    if data.len() <= COPY_PAYLOAD_MAX_BYTES {
        out.extend_from_slice(data);
    } else {
        write_timed(writer, out, stall_timeout).await?;
        out.clear();
        write_timed(writer, data, stall_timeout).await?;
    }
    Ok(())
}

/// A client that stops reading must not pin server-wide in-flight memory
/// forever: give up on it after `stall_timeout` without progress.
async fn write_timed<W>(
    writer: &mut W,
    bytes: &[u8],
    stall_timeout: Duration,
) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    if bytes.is_empty() {
        return Ok(());
    }
    match tokio::time::timeout(stall_timeout, writer.write_all(bytes)).await {
        Ok(result) => result,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "client stopped reading replies",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(length: u64, hole: bool, zero: bool) -> (u64, u32) {
        let status =
            (if hole { wire::STATE_HOLE } else { 0 }) | (if zero { wire::STATE_ZERO } else { 0 });
        (length, status)
    }

    #[test]
    fn descriptors_clip_merge_and_req_one() {
        let extents = [
            extent(4096, false, false),
            extent(4096, false, false),
            extent(1 << 40, true, true),
        ];
        assert_eq!(
            descriptors(extents, 16384, false),
            vec![(8192, 0), (8192, 3)]
        );
        assert_eq!(descriptors(extents, 16384, true), vec![(8192, 0)]);
        assert_eq!(descriptors(extents, 100, true), vec![(100, 0)]);
        assert_eq!(descriptors([extent(0, false, false)], 100, false), vec![]);
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one-hole lists are the point of the test
    fn malformed_holes_are_ignored() {
        assert_eq!(
            usable_holes(vec![0..10, 5..20], 100),
            Vec::<Range<u64>>::new()
        );
        assert_eq!(
            usable_holes(vec![0..10, 20..100], 100),
            vec![0..10, 20..100]
        );
        assert_eq!(
            usable_holes([0..101].to_vec(), 100),
            Vec::<Range<u64>>::new()
        );
        assert_eq!(usable_holes([3..3].to_vec(), 100), Vec::<Range<u64>>::new());
    }
}
