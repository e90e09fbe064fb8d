//! A `Connection` over plain TCP without an async runtime: the caller's
//! thread writes its request frame to the socket itself (`writev`, the
//! block data not copied), one writer at a time, and a reader thread of
//! the connection blocks in `read` and hands each answer to its waiter.
//!
//! Why: a mirrored write to a remote leg used to cross the connection's
//! writer task (a channel, an eventfd wake of the runtime's thread, an
//! epoll round) before reaching the socket, and its answer came back
//! through the runtime's reader task; on a CPU-bound exporter those
//! hand-offs cost more than the send itself.
//! TLS connections keep the runtime (`client.rs`): a TLS stream's reads
//! and writes share one state machine.
//!
//! Sending never waits on the peer. A caller that finds nobody writing
//! takes the write side and sends with `MSG_DONTWAIT`; frames other
//! callers queue meanwhile are its to send too (one `writev`), so a
//! caller behind a writer only queues. When the socket is full (a slow
//! peer, or one that stopped reading), the writer hands what it could not
//! send — the frames, and how many of their bytes are out — to the
//! connection's sender thread, and returns. That thread finishes them
//! with blocking writes, sends whatever was queued since, and gives the
//! write side back once the queue is empty. So frames go out whole and in
//! the order queued, and no caller blocks on the socket: not the NBD
//! reactor starting a mirrored write (`Connection::send_then`), nor a
//! worker (`send`/`call` wait for their answer, not for the socket).
//!
//! `MSG_DONTWAIT`, not `O_NONBLOCK`: the flag is per call, while
//! `O_NONBLOCK` belongs to the socket's open file, which the reader and
//! sender threads share (`try_clone` is a `dup`); both block on purpose,
//! bounded by `SO_RCVTIMEO` / `SO_SNDTIMEO`.
//!
//! Failure is the same as the runtime's: any error on the socket — a
//! failed write, or one that took nothing for the request timeout
//! (`SO_SNDTIMEO`: a peer that stopped reading), a failed read, a
//! malformed answer — kills the connection for good (`Shared::kill`),
//! failing every waiting request, and `shutdown` wakes the reader and a
//! blocked sender thread. A write that fails on a caller's thread is
//! killed by that caller (`Connection::transmit`), one on the sender
//! thread by that thread.

use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use socket2::SockRef;

use crate::client::{check_hello, ChallengeAnswer, ClientError, ClientOptions, Shared};
use crate::frame::RequestFrame;
use crate::url::ReplicaUrl;
use crate::wire::RESPONSE_HEADER_BYTES;
use crate::wire::{Hello, ResponseHeader, HELLO_BYTES, HELLO_OK};

/// Bytes the reader takes from the socket at once: several answers per
/// `read` when they queue up.
const READ_BUFFER_BYTES: usize = 64 * 1024;

/// The write side of a plain connection (the reader thread owns the
/// read side).
pub(crate) struct Plain {
    out: Arc<Outbox>,
}

/// What the callers and the sender thread share.
struct Outbox {
    state: Mutex<Outgoing>,
    /// Wakes the sender thread: frames handed to it, or the connection
    /// closed.
    wake: Condvar,
    socket: TcpStream,
    /// The request timeout, for the reason a send timed out.
    timeout: Duration,
    /// How errors name the peer.
    peer: String,
}

#[derive(Default)]
struct Outgoing {
    /// The write side is taken, by a caller or the sender thread; whoever
    /// holds it sends `frames` too before it lets go.
    writing: bool,
    /// Frames queued behind the writer.
    frames: Vec<RequestFrame>,
    /// Frames a caller began and could not finish without waiting, and
    /// how many of their bytes are out: the sender thread's to finish.
    handed: Option<(Vec<RequestFrame>, usize)>,
    /// The connection is closed: the sender thread stops.
    closed: bool,
}

impl Plain {
    /// Connect to `url`, shake hands, start the reader thread.
    pub(crate) fn connect(
        url: &ReplicaUrl,
        options: &ClientOptions,
        peer: &str,
        shared: &Arc<Shared>,
        offer: u32,
    ) -> Result<Plain, ClientError> {
        let timeout = options.timeout;
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
        hello(&stream, peer, options.secret.as_deref(), offer)?;
        // Answers may be a long time apart: the reader wakes every `tick`
        // only to time out requests answered by callback (nobody waits
        // for those); waiting threads time themselves out.
        let tick = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        stream.set_read_timeout(Some(tick)).map_err(setup)?;
        stream.set_write_timeout(Some(timeout)).map_err(setup)?;
        let reader = stream.try_clone().map_err(setup)?;
        let shared_reader = Arc::clone(shared);
        let reader_peer = peer.to_string();
        std::thread::Builder::new()
            .name("vouch-replica-reader".into())
            .spawn(move || {
                let why = read_answers(&reader, &shared_reader, timeout);
                shared_reader.kill(format!("replica {reader_peer}: {why}"));
                // Wakes a sender thread blocked on a peer that stopped
                // reading.
                let _ = reader.shutdown(Shutdown::Both);
            })
            .map_err(|error| unreachable(format!("reader thread: {error}")))?;
        let out = Arc::new(Outbox {
            state: Mutex::new(Outgoing::default()),
            wake: Condvar::new(),
            socket: stream,
            timeout,
            peer: peer.to_string(),
        });
        let sender = Arc::clone(&out);
        let shared_sender = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("vouch-replica-sender".into())
            .spawn(move || finish_sends(&sender, &shared_sender));
        if let Err(error) = spawned {
            // The reader thread stops on the shut-down socket.
            let _ = out.socket.shutdown(Shutdown::Both);
            return Err(unreachable(format!("sender thread: {error}")));
        }
        Ok(Plain { out })
    }

    /// Send `frame` without waiting, on the caller's thread: if another
    /// caller or the sender thread is writing, `frame` is queued and that
    /// writer sends it (with any others queued meanwhile, in one
    /// `writev`); if the socket is full, the sender thread finishes it
    /// (module comment). Frames go out whole and in the order queued; the
    /// protocol needs no more (each answer names its request, and a later
    /// write of a block is sent only once the earlier one was answered:
    /// the mirror's stripe lock).
    ///
    /// An error (the reason, to kill the connection with) leaves the
    /// stream in an unknown place, with frames of other callers perhaps
    /// lost: the caller kills the connection, which fails every waiting
    /// request.
    pub(crate) fn send(&self, frame: RequestFrame) -> Result<(), String> {
        let mut batch = {
            let mut state = self.out.state.lock();
            if state.writing {
                state.frames.push(frame);
                return Ok(());
            }
            state.writing = true;
            vec![frame]
        };
        loop {
            // On an error, later callers queue behind a writer that never
            // comes back: the caller kills the connection, so they fail on
            // their waits.
            let sent = RequestFrame::write_from(&batch, 0, |slices| {
                self.out.send(slices, libc::MSG_DONTWAIT)
            })
            .map_err(|error| self.out.failed(&error))?;
            let mut state = self.out.state.lock();
            if sent < RequestFrame::total(&batch) {
                state.handed = Some((batch, sent));
                self.out.wake.notify_one();
                return Ok(());
            }
            if state.frames.is_empty() {
                state.writing = false;
                return Ok(());
            }
            batch = std::mem::take(&mut state.frames);
        }
    }

    /// Wake the reader thread and a blocked sender thread, and stop the
    /// sender thread: the connection is dead.
    pub(crate) fn shutdown(&self) {
        self.out.state.lock().closed = true;
        self.out.wake.notify_one();
        let _ = self.out.socket.shutdown(Shutdown::Both);
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Outbox {
    /// One `sendmsg` of `slices` (`MSG_NOSIGNAL`: a closed peer is an
    /// error, not a signal).
    fn send(&self, slices: &[IoSlice<'_>], flags: libc::c_int) -> std::io::Result<usize> {
        SockRef::from(&self.socket).send_vectored_with_flags(slices, flags | libc::MSG_NOSIGNAL)
    }

    /// Why the connection must die after `error` on a send.
    fn failed(&self, error: &std::io::Error) -> String {
        format!("replica {}: connection lost: {error}", self.peer)
    }

    /// Why the connection must die after a blocking send took nothing
    /// for the whole timeout (`SO_SNDTIMEO`).
    fn timed_out(&self) -> String {
        format!(
            "replica {}: sending a request timed out after {:?}; the connection is dropped",
            self.peer, self.timeout
        )
    }
}

/// The sender thread: finish the frames a caller hands over, with
/// blocking writes, then those queued since, until the queue is empty and
/// the write side is free again; until the connection closes. A peer that
/// takes nothing for the request timeout, or any error, kills the
/// connection.
fn finish_sends(out: &Outbox, shared: &Shared) {
    loop {
        let (mut batch, mut from) = {
            let mut state = out.state.lock();
            loop {
                if state.closed {
                    return;
                }
                if let Some(handed) = state.handed.take() {
                    break handed;
                }
                out.wake.wait(&mut state);
            }
        };
        loop {
            let why = match RequestFrame::write_from(&batch, from, |slices| out.send(slices, 0)) {
                Ok(sent) if sent == RequestFrame::total(&batch) => None,
                Ok(_) => Some(out.timed_out()),
                Err(error) => Some(out.failed(&error)),
            };
            if let Some(why) = why {
                // As `Connection::kill`: fail every request, wake the
                // reader. The write side stays taken: later callers queue
                // and fail on the dead connection.
                shared.kill(why);
                let _ = out.socket.shutdown(Shutdown::Both);
                return;
            }
            let mut state = out.state.lock();
            if state.frames.is_empty() {
                state.writing = false;
                break;
            }
            batch = std::mem::take(&mut state.frames);
            from = 0;
        }
    }
}

/// Send our hello, read the server's, refuse another version by name
/// (as the runtime's `Connection::hello` does).
fn hello(
    mut stream: &TcpStream,
    peer: &str,
    secret: Option<&crate::auth::Secret>,
    offer: u32,
) -> Result<(), ClientError> {
    let ours = Hello {
        version: offer,
        status: HELLO_OK,
    };
    let lost = |error: std::io::Error| {
        if matches!(
            error.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            ClientError::Unreachable(format!(
                "replica {peer}: the handshake timed out (does the server want TLS?)"
            ))
        } else {
            ClientError::Unreachable(format!("replica {peer}: handshake: {error}"))
        }
    };
    stream.write_all(&ours.encode()).map_err(lost)?;
    let mut bytes = [0u8; HELLO_BYTES];
    match stream.read_exact(&mut bytes) {
        Ok(()) => check_hello(&bytes, peer, offer)?,
        Err(error)
            if matches!(
                error.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Err(lost(error))
        }
        Err(error) => return Err(ClientError::Refused(format!(
            "replica {peer}: the server closed the connection during the handshake ({error}): not a vouch replica server, or it wants TLS, or it refused our certificate"
        ))),
    }
    let mut challenge = [0u8; crate::auth::CHALLENGE_BYTES];
    stream.read_exact(&mut challenge).map_err(lost)?;
    let answer = ChallengeAnswer::new(&challenge, secret, peer)?;
    stream.write_all(&answer.response).map_err(lost)?;
    let mut verdict = [0u8; crate::auth::VERDICT_BYTES];
    stream.read_exact(&mut verdict).map_err(lost)?;
    answer.check(&verdict, secret)
}

/// The reader thread: hand each answer to its waiter until the connection
/// fails; returns why. The socket's read timeout is a tick: at each one
/// (and at least once a tick while answers flow) a request answered by
/// callback that waited longer than `timeout` fails the connection.
fn read_answers(mut stream: &TcpStream, shared: &Shared, timeout: Duration) -> String {
    let mut buffer = vec![0u8; READ_BUFFER_BYTES];
    // Bytes received and not yet delivered: `buffer[start..end]`.
    let (mut start, mut end) = (0usize, 0usize);
    let tick = stream
        .read_timeout()
        .ok()
        .flatten()
        .unwrap_or(Duration::from_secs(1));
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
