//! Requests the export finishes later, with no worker sleeping on them:
//! WRITEs (`Export::try_start_write`), started on the connection's reader
//! task and answered from whichever thread finishes them (a mirror's
//! remote legs: a replica connection's reader thread), and READs that must
//! wait for the device (`Export::try_start_read`), started on the reader
//! task and answered from the export's ring when the server's reaper task
//! (`reap_reads`, on the same runtime) finds them done.
//!
//! A completion answers through the connection its request came on
//! (`Answer`, which `transmission.rs` implements): the types the `Export`
//! trait names live here, beside it, and the transmission imports them,
//! not the other way round.

use std::sync::Arc;
use std::time::Instant;

use super::ExportError;
use crate::permits::Permits;
use crate::wire::{Command, Request};

/// A request started on the reader task, to answer once the export
/// finishes it: what its reply needs and the permits it holds until then.
pub(crate) struct Started {
    /// `Write` or `Flush` (both answered with a bare reply), or `Read`.
    pub(crate) command: Command,
    pub(crate) request: Request,
    pub(crate) permits: Permits,
    pub(crate) received: Instant,
}

/// How a completion answers its request: the connection it came on
/// (`transmission.rs`). Each call queues the request's one reply (or
/// hands the request to a worker, which replies).
pub(crate) trait Answer: Send + Sync {
    /// A WRITE or FLUSH finished with `outcome`: a bare reply, or the
    /// error.
    fn written(self: Arc<Self>, started: Started, outcome: Result<(), ExportError>);
    /// A READ finished: `data` (exactly the request's length, every block
    /// verified) is its reply.
    fn read(self: Arc<Self>, started: Started, data: Vec<u8>);
    /// A READ the export gave back unanswered: run it on a worker, which
    /// judges and reports whatever stopped it.
    fn read_on_worker(self: Arc<Self>, started: Started);
    /// A READ dropped unanswered: reply `error`.
    fn read_failed(self: Arc<Self>, started: Started, error: ExportError);
}

/// A WRITE the export completes later (`Export::try_start_write`), or a
/// FLUSH it may answer before its call returns (`Export::flush_then`):
/// the reply is queued when `complete` is called, from whichever thread
/// the export finishes it on. Dropped without `complete`, it answers EIO,
/// so a request is never left without a reply nor its permits held.
pub struct WriteCompletion {
    write: Option<(Arc<dyn Answer>, Started)>,
}

impl WriteCompletion {
    /// A WRITE or FLUSH `started` on the reader, answered through `answer`.
    pub(crate) fn new(answer: Arc<dyn Answer>, started: Started) -> WriteCompletion {
        WriteCompletion {
            write: Some((answer, started)),
        }
    }

    /// The write is done: queue its reply (success, or the error).
    pub fn complete(mut self, outcome: Result<(), ExportError>) {
        if let Some((answer, started)) = self.write.take() {
            answer.written(started, outcome);
        }
    }

    /// Declined: the permits back, to run the request on a worker.
    pub(crate) fn into_permits(mut self) -> Permits {
        unanswered(&mut self.write)
    }
}

/// The permits of a completion not answered yet (taking them leaves it
/// nothing to answer when dropped).
fn unanswered(started: &mut Option<(Arc<dyn Answer>, Started)>) -> Permits {
    started
        .take()
        .expect("an unanswered completion holds its request")
        .1
        .permits
}

impl Drop for WriteCompletion {
    fn drop(&mut self) {
        if let Some((answer, started)) = self.write.take() {
            answer.written(
                started,
                Err(ExportError::new(
                    super::Errno::Io,
                    "the request was dropped without an answer",
                )),
            );
        }
    }
}

/// A READ the export completes later (`Export::try_start_read`): answered
/// with the bytes, or run on a worker after all. Dropped without
/// `complete`, it answers EIO.
pub struct ReadCompletion {
    read: Option<(Arc<dyn Answer>, Started)>,
}

impl ReadCompletion {
    /// A READ `started` on the reader, answered through `answer`.
    pub(crate) fn new(answer: Arc<dyn Answer>, started: Started) -> ReadCompletion {
        ReadCompletion {
            read: Some((answer, started)),
        }
    }

    /// The read is done: `Some(bytes)` (every block verified, exactly the
    /// request's length) is the reply; `None` runs the read on a worker,
    /// which judges and reports whatever stopped it here.
    pub fn complete(mut self, bytes: Option<Vec<u8>>) {
        let Some((answer, started)) = self.read.take() else {
            return;
        };
        match bytes {
            Some(data) if data.len() == started.request.length as usize => {
                answer.read(started, data)
            }
            _ => answer.read_on_worker(started),
        }
    }

    /// Declined: the permits back, to run the request on a worker.
    pub(crate) fn into_permits(mut self) -> Permits {
        unanswered(&mut self.read)
    }
}

impl Drop for ReadCompletion {
    fn drop(&mut self) {
        if let Some((answer, started)) = self.read.take() {
            let error =
                ExportError::new(super::Errno::Io, "the read was dropped without an answer");
            answer.read_failed(started, error);
        }
    }
}
