//! A `Connection` over plain TCP without an async runtime: the caller's
//! thread writes its request frame to the socket itself (`writev`, the
//! block data not copied), one writer at a time, and a reader thread of
//! the connection blocks in `read` and hands each answer to its waiter.
//!
//! Why: a mirrored write to a remote leg used to cross the connection's
//! writer task (a channel, an eventfd wake of the runtime's thread, an
//! epoll round) before reaching the socket, and its answer came back
//! through the runtime's reader task; on a CPU-bound exporter those
//! hand-offs cost more than the send itself (docs/BENCHMARKS.md, Stop 23).
//! TLS connections keep the runtime (`client.rs`): a TLS stream's reads
//! and writes share one state machine.
//!
//! Failure is the same as the runtime's: any error on the socket — a
//! failed or timed-out write (`SO_SNDTIMEO` = the request timeout), a
//! failed read, a malformed answer — kills the connection for good
//! (`Shared::kill`), and `shutdown` wakes the reader and any blocked
//! writer.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::client::{check_hello, ClientError, Shared};
use crate::frame::RequestFrame;
use crate::url::ReplicaUrl;
use crate::wire::RESPONSE_HEADER_BYTES;
use crate::wire::{Hello, ResponseHeader, HELLO_BYTES, HELLO_OK, PROTOCOL_VERSION};

/// Bytes the reader takes from the socket at once: several answers per
/// `read` when they queue up.
const READ_BUFFER_BYTES: usize = 64 * 1024;

/// The write side of a plain connection (the reader thread owns the
/// read side).
pub(crate) struct Plain {
    /// Frames waiting for the caller that is writing (`send`).
    queue: Mutex<Outgoing>,
    /// Written only by the caller that set `Outgoing::writing`.
    writer: Mutex<TcpStream>,
    /// Another handle on the socket, for `shutdown` without waiting for
    /// a writer.
    socket: TcpStream,
}

#[derive(Default)]
struct Outgoing {
    /// A caller is writing to the socket; it sends `frames` too before it
    /// stops.
    writing: bool,
    frames: Vec<RequestFrame>,
}

impl Plain {
    /// Connect to `url`, shake hands, start the reader thread.
    pub(crate) fn connect(
        url: &ReplicaUrl,
        timeout: std::time::Duration,
        peer: &str,
        shared: &Arc<Shared>,
    ) -> Result<Plain, ClientError> {
        let unreachable = |why: String| ClientError::Unreachable(format!("replica {peer}: {why}"));
        let addresses = url
            .address()
            .to_socket_addrs()
            .map_err(|error| unreachable(format!("cannot connect: {error}")))?;
        let mut last = None;
        let mut stream = None;
        for address in addresses {
            match TcpStream::connect_timeout(&address, crate::CONNECT_TIMEOUT) {
                Ok(connected) => {
                    stream = Some(connected);
                    break;
                }
                Err(error) => last = Some(error),
            }
        }
        let stream = stream.ok_or_else(|| match last {
            Some(error) if error.kind() == std::io::ErrorKind::TimedOut => unreachable(format!(
                "connecting timed out after {:?}",
                crate::CONNECT_TIMEOUT
            )),
            Some(error) => unreachable(format!("cannot connect: {error}")),
            None => unreachable("cannot connect: the address resolves to nothing".into()),
        })?;
        let setup = |error: std::io::Error| unreachable(format!("socket setup: {error}"));
        stream.set_nodelay(true).map_err(setup)?;
        stream
            .set_read_timeout(Some(crate::CONNECT_TIMEOUT))
            .map_err(setup)?;
        stream
            .set_write_timeout(Some(crate::CONNECT_TIMEOUT))
            .map_err(setup)?;
        hello(&stream, peer)?;
        // Answers may be a long time apart: the reader wakes every `tick`
        // only to time out requests answered by callback (nobody waits
        // for those); waiting threads time themselves out.
        let tick = (timeout / 4).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(1),
        );
        stream.set_read_timeout(Some(tick)).map_err(setup)?;
        stream.set_write_timeout(Some(timeout)).map_err(setup)?;
        let reader = stream.try_clone().map_err(setup)?;
        let socket = stream.try_clone().map_err(setup)?;
        let shared_reader = Arc::clone(shared);
        let reader_peer = peer.to_string();
        std::thread::Builder::new()
            .name("vouch-replica-reader".into())
            .spawn(move || {
                let why = read_answers(&reader, &shared_reader, timeout);
                shared_reader.kill(format!("replica {reader_peer}: {why}"));
                // Wakes a writer blocked on a peer that stopped reading.
                let _ = reader.shutdown(Shutdown::Both);
            })
            .map_err(|error| unreachable(format!("reader thread: {error}")))?;
        Ok(Plain {
            queue: Mutex::new(Outgoing::default()),
            writer: Mutex::new(stream),
            socket,
        })
    }

    /// Send `frame` on the caller's thread, never waiting for another
    /// caller: if one is writing, `frame` is queued and that caller
    /// writes it (with any others queued meanwhile, in one `writev`)
    /// before it stops. Frames go out whole and in the order queued; the
    /// protocol needs no more (each answer names its request, and a
    /// later write of a block is sent only once the earlier one was
    /// answered: the mirror's stripe lock).
    ///
    /// An error leaves the stream in an unknown place, with frames of
    /// other callers perhaps lost: the caller kills the connection, which
    /// fails every waiting request.
    pub(crate) fn send(&self, frame: RequestFrame) -> std::io::Result<()> {
        let mut batch = {
            let mut queue = self.queue.lock();
            if queue.writing {
                queue.frames.push(frame);
                return Ok(());
            }
            queue.writing = true;
            vec![frame]
        };
        let mut writer = self.writer.lock();
        loop {
            // On an error, later callers queue behind a writer that never
            // comes back: the caller kills the connection, so they fail on
            // their waits.
            write_frames(&mut writer, &batch)?;
            let mut queue = self.queue.lock();
            if queue.frames.is_empty() {
                queue.writing = false;
                return Ok(());
            }
            batch = std::mem::take(&mut queue.frames);
        }
    }

    /// Wake the reader thread and any blocked writer: the connection is
    /// dead.
    pub(crate) fn shutdown(&self) {
        let _ = self.socket.shutdown(Shutdown::Both);
    }
}

/// Write `frames` whole, in order.
fn write_frames(out: &mut TcpStream, frames: &[RequestFrame]) -> std::io::Result<()> {
    RequestFrame::write_all(out, frames)?;
    out.flush()
}

/// Send our hello, read the server's, refuse another version by name
/// (as the runtime's `Connection::hello` does).
fn hello(mut stream: &TcpStream, peer: &str) -> Result<(), ClientError> {
    let ours = Hello {
        version: PROTOCOL_VERSION,
        status: HELLO_OK,
    };
    stream
        .write_all(&ours.encode())
        .map_err(|error| ClientError::Unreachable(format!("replica {peer}: handshake: {error}")))?;
    let mut bytes = [0u8; HELLO_BYTES];
    match stream.read_exact(&mut bytes) {
        Ok(()) => check_hello(&bytes, peer),
        Err(error)
            if matches!(
                error.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(ClientError::Unreachable(format!(
                "replica {peer}: the handshake timed out (does the server want TLS?)"
            )))
        }
        Err(error) => Err(ClientError::Refused(format!(
            "replica {peer}: the server closed the connection during the handshake ({error}): not a vouch replica server, or it wants TLS, or it refused our certificate"
        ))),
    }
}

/// The reader thread: hand each answer to its waiter until the connection
/// fails; returns why. The socket's read timeout is a tick: at each one
/// (and at least once a tick while answers flow) a request answered by
/// callback that waited longer than `timeout` fails the connection.
fn read_answers(mut stream: &TcpStream, shared: &Shared, timeout: std::time::Duration) -> String {
    let mut buffer = vec![0u8; READ_BUFFER_BYTES];
    // Bytes received and not yet delivered: `buffer[start..end]`.
    let (mut start, mut end) = (0usize, 0usize);
    let tick = stream
        .read_timeout()
        .ok()
        .flatten()
        .unwrap_or(std::time::Duration::from_secs(1));
    let mut scanned = std::time::Instant::now();
    loop {
        // Deliver every whole answer received.
        while end - start >= RESPONSE_HEADER_BYTES {
            let mut bytes = [0u8; RESPONSE_HEADER_BYTES];
            bytes.copy_from_slice(&buffer[start..start + RESPONSE_HEADER_BYTES]);
            let header = match ResponseHeader::decode(&bytes) {
                Ok(header) => header,
                Err(error) => return format!("malformed answer: {error}"),
            };
            let whole = RESPONSE_HEADER_BYTES + header.payload_bytes as usize;
            if end - start < whole {
                if whole > buffer.len() {
                    buffer.resize(whole, 0);
                }
                break;
            }
            let payload = buffer[start + RESPONSE_HEADER_BYTES..start + whole].to_vec();
            start += whole;
            if let Err(why) = shared.deliver(header.handle, header.status, payload) {
                return why;
            }
        }
        // Only after every answer in hand was delivered: a request whose
        // answer was read is never counted overdue.
        if scanned.elapsed() >= tick {
            scanned = std::time::Instant::now();
            if let Some(why) = shared.overdue(timeout) {
                return why;
            }
        }
        // Keep the partial answer at the front, with room after it.
        if start == end {
            (start, end) = (0, 0);
        } else if start > 0 && buffer.len() - end < RESPONSE_HEADER_BYTES.max(buffer.len() / 4) {
            buffer.copy_within(start..end, 0);
            (start, end) = (0, end - start);
        }
        // A partial answer never fills the buffer (it is grown to fit one).
        assert!(end < buffer.len(), "room to read into");
        match stream.read(&mut buffer[end..]) {
            Ok(0) => return "connection lost: the replica closed the connection".into(),
            Ok(read) => end += read,
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(error) => return format!("connection lost: {error}"),
        }
    }
}
