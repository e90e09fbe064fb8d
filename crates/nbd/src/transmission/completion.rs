//! Requests the export finishes later, with no worker sleeping on them:
//! WRITEs (`Export::try_start_write`), started on the connection's reader
//! task and answered from whichever thread finishes them (a mirror's
//! remote legs: a replica connection's reader thread), and READs that must
//! wait for the device (`Export::try_start_read`), started on the reader
//! task and answered from the export's ring when the server's reaper task
//! (`reap_reads`, on the same runtime) finds them done.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::{done_reply, execute, finish, read_reply_of, Connection, Permits};
use crate::export::{Errno, ExportError};
use crate::wire::{self, Command, Request};
use crate::worker::WorkerPool;

/// Largest WRITE the reader task starts itself when the export finishes
/// it later (`try_start_inline`). Smaller than `INLINE_WRITE_MAX_BYTES`:
/// starting a mirrored write sends its payload to the remote legs from
/// the reader (on veth the receiver's TCP work runs in that send), which
/// for 1 MiB writes cost more reader time than the worker's hand-offs
/// (1 MiB QD8 to a remote mirror measured 0.95x with it); 4 KiB writes
/// gain 1.4x at QD32.
const START_WRITE_MAX_BYTES: usize = 128 * 1024;
/// A WRITE the export completes later (`Export::try_start_write`), or a
/// FLUSH it may answer before its call returns (`Export::flush_then`):
/// the reply is queued when `complete` is called, from whichever thread
/// the export finishes it on. Dropped without `complete`, it answers EIO,
/// so a request is never left without a reply nor its permits held.
pub struct WriteCompletion {
    write: Option<StartedWrite>,
}

struct StartedWrite {
    connection: Arc<Connection>,
    /// `Write` or `Flush`: both are answered with a bare reply.
    command: Command,
    request: Request,
    permits: Permits,
    received: Instant,
}

impl WriteCompletion {
    /// The write is done: queue its reply (success, or the error).
    pub fn complete(mut self, outcome: Result<(), ExportError>) {
        if let Some(write) = self.write.take() {
            write.answer(Ok(outcome));
        }
    }

    /// Declined: the permits back, to run the request on a worker.
    fn into_permits(mut self) -> Permits {
        self.write
            .take()
            .expect("an unanswered completion holds its write")
            .permits
    }
}

impl StartedWrite {
    fn answer(self, outcome: std::thread::Result<Result<(), ExportError>>) {
        let connection = &self.connection;
        let outcome = outcome
            .map(|written| written.map(|()| done_reply(&connection.session, self.request.cookie)));
        finish(
            connection,
            &self.request,
            self.command,
            outcome,
            self.permits,
            self.received,
        );
    }
}

impl Drop for WriteCompletion {
    fn drop(&mut self) {
        if let Some(write) = self.write.take() {
            write.answer(Ok(Err(ExportError::new(
                Errno::Io,
                "the request was dropped without an answer",
            ))));
        }
    }
}

/// A WRITE without FUA the export may start without blocking and finish
/// on another thread (`Export::try_start_write`): no worker sleeps on it.
/// Gives the permits back when the export declines.
pub(super) fn try_start_inline(
    connection: &Arc<Connection>,
    request: &Request,
    payload: &Bytes,
    permits: Permits,
    received: Instant,
) -> Result<(), Permits> {
    let fua = request.flags & wire::CMD_FLAG_FUA != 0;
    let length = request.length as usize;
    if fua || length == 0 || length > START_WRITE_MAX_BYTES {
        return Err(permits);
    }
    let done = WriteCompletion {
        write: Some(StartedWrite {
            connection: Arc::clone(connection),
            command: Command::Write,
            request: *request,
            permits,
            received,
        }),
    };
    let export = connection.session.export.as_ref();
    // A panic inside drops `done` unanswered, which answers EIO.
    match catch_unwind(AssertUnwindSafe(|| {
        export.try_start_write(request.offset, payload, done)
    })) {
        Ok(Err(done)) => Err(done.into_permits()),
        Ok(Ok(())) | Err(_) => {
            connection.metrics.request_inline(Command::Write);
            Ok(())
        }
    }
}

/// Largest READ the reader task starts itself on the export's ring
/// (`try_start_read_inline`): like `INLINE_MAX_BYTES`, so that verifying
/// it on the reaper never holds the reactor for long. Larger reads go to
/// the workers, which verify on both CPUs at once: 1 MiB reads at QD8
/// through the ring measured 0.76x (`--direct`) and 0.77x (page cache)
/// of the workers.
const START_READ_MAX_BYTES: usize = 128 * 1024;

/// A READ the export completes later (`Export::try_start_read`): answered
/// with the bytes, or run on a worker after all. Dropped without
/// `complete`, it answers EIO.
pub struct ReadCompletion {
    read: Option<StartedRead>,
}

struct StartedRead {
    connection: Arc<Connection>,
    request: Request,
    permits: Permits,
    received: Instant,
    pool: Arc<WorkerPool>,
}

impl ReadCompletion {
    /// The read is done: `Some(bytes)` (every block verified, exactly the
    /// request's length) is the reply; `None` runs the read on a worker,
    /// which judges and reports whatever stopped it here.
    pub fn complete(mut self, bytes: Option<Vec<u8>>) {
        let Some(read) = self.read.take() else { return };
        let StartedRead {
            connection,
            request,
            permits,
            received,
            pool,
        } = read;
        match bytes {
            Some(data) if data.len() == request.length as usize => {
                connection.metrics.ring_read_answered();
                let reply = read_reply_of(&connection.session, &request, data, Vec::new());
                finish(
                    &connection,
                    &request,
                    Command::Read,
                    Ok(Ok(reply)),
                    permits,
                    received,
                );
            }
            _ => {
                connection.metrics.ring_read_to_worker();
                pool.submit(Box::new(move || {
                    execute(
                        &connection,
                        request,
                        Command::Read,
                        Bytes::new(),
                        permits,
                        received,
                    );
                }));
            }
        }
    }

    fn into_permits(mut self) -> Permits {
        self.read
            .take()
            .expect("an unanswered completion holds its read")
            .permits
    }
}

impl Drop for ReadCompletion {
    fn drop(&mut self) {
        if let Some(read) = self.read.take() {
            let error = ExportError::new(Errno::Io, "the read was dropped without an answer");
            finish(
                &read.connection,
                &read.request,
                Command::Read,
                Ok(Err(error)),
                read.permits,
                read.received,
            );
        }
    }
}

/// A READ the export could not answer from memory (`try_read` declined),
/// started on its ring if it can: no worker sleeps on it. Gives the
/// permits back when the export declines.
pub(super) fn try_start_read_inline(
    connection: &Arc<Connection>,
    request: &Request,
    permits: Permits,
    received: Instant,
    pool: &Arc<WorkerPool>,
) -> Result<(), Permits> {
    let length = request.length as usize;
    if length == 0 || length > START_READ_MAX_BYTES {
        return Err(permits);
    }
    let done = ReadCompletion {
        read: Some(StartedRead {
            connection: Arc::clone(connection),
            request: *request,
            permits,
            received,
            pool: Arc::clone(pool),
        }),
    };
    let export = connection.session.export.as_ref();
    // A panic inside drops `done` unanswered, which answers EIO.
    match catch_unwind(AssertUnwindSafe(|| {
        export.try_start_read(request.offset, length, done)
    })) {
        Ok(Err(done)) => Err(done.into_permits()),
        Ok(Ok(())) | Err(_) => Ok(()),
    }
}

/// Run a FLUSH on this worker through `Export::flush_then`: the export
/// may answer it as soon as it is durable, before the call returns.
pub(super) fn flush(
    connection: Arc<Connection>,
    request: Request,
    permits: Permits,
    received: Instant,
) {
    let done = WriteCompletion {
        write: Some(StartedWrite {
            connection: Arc::clone(&connection),
            command: Command::Flush,
            request,
            permits,
            received,
        }),
    };
    let export = connection.session.export.as_ref();
    // A panic inside drops `done` unanswered, which answers EIO.
    let _ = catch_unwind(AssertUnwindSafe(|| export.flush_then(done)));
}
