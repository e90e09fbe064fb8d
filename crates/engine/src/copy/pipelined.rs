//! The pipelined copy: a reader thread reads and verifies source segments
//! (1 MiB) into one of `SLOTS` buffers while this thread writes the ones
//! already read to the destination. Memory is bounded by the slots (plus
//! the destination's write-back buffer); buffers go back to the reader
//! once written.
//!
//! Order (memmove): segments go from the start, or from the end when the
//! destination starts inside the source, and each is read before it is
//! written. Going forwards the destination is below the source, so a
//! segment's write ends below the start of every segment not yet read
//! (the reader is ahead); going backwards the mirror image. So a write
//! never lands on source blocks still to be read, whatever the shift.
//!
//! The destination writes are the destination device's ordinary writes
//! (a volume's: sealed for the destination LBAs, buffered, committed in
//! groups; a mirror's: its activity log first, then every leg): the crash
//! contract of writes, durable after the next flush. A fault in a source
//! segment stops the reader; nothing of that segment is written.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use super::Job;
use crate::buffer::PageBuffer;
use crate::error::Result;
use crate::jobs::Visit;
use crate::state::BLOCK;

/// Blocks per segment (1 MiB).
pub(crate) const SEGMENT_BLOCKS: u64 = 256;

/// Segments in flight at most (read, queued or being written).
const SLOTS: usize = 8;

/// One segment read: blocks `[at, at + count)` of the job (relative).
struct Segment {
    at: u64,
    count: u64,
    data: PageBuffer,
}

pub(super) fn run(job: &Job<'_>, run: &mut Visit<'_>) -> Result<()> {
    let step = SEGMENT_BLOCKS;
    let (full_tx, full_rx) = sync_channel::<Result<Segment>>(SLOTS);
    let (free_tx, free_rx) = sync_channel::<PageBuffer>(SLOTS);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_segments(job, step, full_tx, free_rx, &stop));
        let result = write_segments(job, run, full_rx, free_tx);
        stop.store(true, Ordering::Release);
        let _ = reader.join();
        result
    })
}

/// The segments of the job in copy order: `(at, count)`.
fn segments(job: &Job<'_>, step: u64) -> impl Iterator<Item = (u64, u64)> {
    let count = job.count;
    let backwards = job.backwards();
    let steps = count.div_ceil(step);
    (0..steps).map(move |index| {
        let done = index * step;
        let n = (count - done).min(step);
        let at = if backwards { count - done - n } else { done };
        (at, n)
    })
}

fn read_segments(
    job: &Job<'_>,
    step: u64,
    full: SyncSender<Result<Segment>>,
    free: Receiver<PageBuffer>,
    stop: &AtomicBool,
) {
    let mut allocated = 0usize;
    for (at, count) in segments(job, step) {
        if stop.load(Ordering::Acquire) || job.control.is_cancelled() {
            return;
        }
        let mut data = if allocated < SLOTS {
            allocated += 1;
            PageBuffer::new((step * BLOCK) as usize)
        } else {
            match free.recv() {
                Ok(buffer) => buffer,
                Err(_) => return, // the writer stopped
            }
        };
        data.set_len((count * BLOCK) as usize);
        let read = job
            .source
            .read((job.source_first + at) * BLOCK, &mut data)
            .map(|_| Segment { at, count, data });
        let failed = read.is_err();
        if full.send(read).is_err() || failed {
            return;
        }
    }
}

/// Write the segments read, in copy order, pacing after each (the reader
/// waits for a free slot meanwhile).
fn write_segments(
    job: &Job<'_>,
    run: &mut Visit<'_>,
    full: Receiver<Result<Segment>>,
    free: SyncSender<PageBuffer>,
) -> Result<()> {
    while run.at() < job.count {
        if run.cancelled()? {
            return Err(job.cancelled(run.at()));
        }
        let segment = match full.recv() {
            Ok(segment) => segment?,
            // The reader saw the cancel before this thread did.
            Err(_) => return Err(job.cancelled(run.at())),
        };
        crate::device::DeviceWrites::write(
            job.destination,
            (job.destination_first + segment.at) * BLOCK,
            &segment.data,
            false,
        )?;
        let done = run.at() + segment.count;
        // The reader may have finished and dropped its end: fine.
        let _ = free.try_send(segment.data);
        run.step(done, segment.count, segment.count * BLOCK)?;
    }
    Ok(())
}

/// A copy of a range onto itself moves nothing; it still fails on a
/// corrupt source block, like any copy.
pub(super) fn verify_only(job: &Job<'_>, run: &mut Visit<'_>) -> Result<()> {
    let step = SEGMENT_BLOCKS;
    let mut buffer = PageBuffer::new((step * BLOCK) as usize);
    for (at, count) in segments(job, step) {
        if run.cancelled()? {
            return Err(job.cancelled(run.at()));
        }
        let data = &mut buffer[..(count * BLOCK) as usize];
        job.source.read((job.source_first + at) * BLOCK, data)?;
        run.step(run.at() + count, count, count * BLOCK)?;
    }
    Ok(())
}
