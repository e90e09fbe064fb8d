//! WRITEs the export finishes later (`Export::try_start_write`): started
//! on the connection's reader task, answered from whichever thread
//! finishes them (a mirror's remote legs: a replica connection's reader
//! thread), with no worker sleeping on them.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::{done_reply, finish, Connection, Permits};
use crate::export::{Errno, ExportError};
use crate::wire::{self, Command, Request};

/// Largest WRITE the reader task starts itself when the export finishes
/// it later (`try_start_inline`). Smaller than `INLINE_WRITE_MAX_BYTES`:
/// starting a mirrored write sends its payload to the remote legs from
/// the reader (on veth the receiver's TCP work runs in that send), which
/// for 1 MiB writes cost more reader time than the worker's hand-offs
/// (1 MiB QD8 to a remote mirror: 0.95x with it, docs/BENCHMARKS.md
/// Stop 24); 4 KiB writes gain 1.4x at QD32.
const START_WRITE_MAX_BYTES: usize = 128 * 1024;
/// A WRITE the export completes later (`Export::try_start_write`): its
/// reply is queued when `complete` is called, from whichever thread the
/// export finishes it on. Dropped without `complete`, it answers EIO, so
/// a request is never left without a reply nor its permits held.
pub struct WriteCompletion {
    write: Option<StartedWrite>,
}

struct StartedWrite {
    connection: Arc<Connection>,
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
            Command::Write,
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
                "the write was dropped without an answer",
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
