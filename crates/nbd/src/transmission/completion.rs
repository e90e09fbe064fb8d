//! Starting the requests the export finishes later (`export/completion.rs`)
//! on the reader task, and answering them (`Answer` for the connection).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::{done_reply, execute, finish, read_reply_of, Connection};
use crate::export::completion::{Answer, Started};
use crate::export::{ExportError, ReadCompletion, WriteCompletion};
use crate::permits::Permits;
use crate::wire::{self, Command, Request};

/// Largest WRITE the reader task starts itself when the export finishes
/// it later (`try_start_inline`). Smaller than `INLINE_WRITE_MAX_BYTES`:
/// starting a mirrored write sends its payload to the remote legs from
/// the reader (on veth the receiver's TCP work runs in that send), which
/// for 1 MiB writes cost more reader time than the worker's hand-offs
/// (1 MiB QD8 to a remote mirror measured 0.95x with it); 4 KiB writes
/// gain 1.4x at QD32.
const START_WRITE_MAX_BYTES: usize = 128 * 1024;

impl Answer for Connection {
    fn written(self: Arc<Self>, started: Started, outcome: Result<(), ExportError>) {
        let outcome = outcome.map(|()| done_reply(&self.session, started.request.cookie));
        finish(
            &self,
            &started.request,
            started.command,
            Ok(outcome),
            started.permits,
            started.received,
        );
    }

    fn read(self: Arc<Self>, started: Started, data: Vec<u8>) {
        self.metrics.ring_read_answered();
        let reply = read_reply_of(&self.session, &started.request, data, Vec::new());
        finish(
            &self,
            &started.request,
            Command::Read,
            Ok(Ok(reply)),
            started.permits,
            started.received,
        );
    }

    fn read_on_worker(self: Arc<Self>, started: Started) {
        self.metrics.ring_read_to_worker();
        let pool = Arc::clone(&self.pool);
        pool.submit(Box::new(move || {
            execute(
                &self,
                started.request,
                Command::Read,
                Bytes::new(),
                started.permits,
                started.received,
            );
        }));
    }

    fn read_failed(self: Arc<Self>, started: Started, error: ExportError) {
        finish(
            &self,
            &started.request,
            Command::Read,
            Ok(Err(error)),
            started.permits,
            started.received,
        );
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
    let done = WriteCompletion::new(
        Arc::clone(connection) as Arc<dyn Answer>,
        Started {
            command: Command::Write,
            request: *request,
            permits,
            received,
        },
    );
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

/// A READ the export could not answer from memory (`try_read` declined),
/// started on its ring if it can: no worker sleeps on it. Gives the
/// permits back when the export declines.
pub(super) fn try_start_read_inline(
    connection: &Arc<Connection>,
    request: &Request,
    permits: Permits,
    received: Instant,
) -> Result<(), Permits> {
    let length = request.length as usize;
    if length == 0 || length > START_READ_MAX_BYTES {
        return Err(permits);
    }
    let done = ReadCompletion::new(
        Arc::clone(connection) as Arc<dyn Answer>,
        Started {
            command: Command::Read,
            request: *request,
            permits,
            received,
        },
    );
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
    let done = WriteCompletion::new(
        Arc::clone(&connection) as Arc<dyn Answer>,
        Started {
            command: Command::Flush,
            request,
            permits,
            received,
        },
    );
    let export = connection.session.export.as_ref();
    // A panic inside drops `done` unanswered, which answers EIO.
    let _ = catch_unwind(AssertUnwindSafe(|| export.flush_then(done)));
}
