//! The reflink copy (split layout only): the destination's data segments
//! share the source's extents (`Storage::clone_range`, FICLONERANGE), and
//! only the destination's contexts are written — journaled like any
//! commit's. A copy is cut into steps of at most `PIECES_PER_STEP` pieces
//! (one journal record each), and a step into pieces of `piece_blocks`
//! (the memory it holds). Steps run in windows: with the committer lock of
//! both volumes held (taken in address order) for up to `WINDOW`,
//!
//! 1. if the window's source range has writes in its write-back buffer,
//!    the source is committed first, so its home copy is what was
//!    acknowledged;
//!
//! then for each step of the window:
//!
//! 2. every source block of the step is read from home and verified
//!    against its context, on `VERIFY_THREADS` threads (a fault fails the
//!    copy naming the lowest faulty LBA: nothing of the step was written),
//!    keeping the destination's seal (the source's guard when both
//!    volumes use the same guard kind) — the one read of the source. The
//!    read maps the page cache where it can (`Storage::map_for_check`: the
//!    check keeps nothing, so nothing is copied). Step k + 1 is verified
//!    while step k runs 3 and 4: in memmove order no step's destination is
//!    a later step's source;
//! 3. one journal record with the destination's new contexts (the source's
//!    guard, reference tag = destination LBA, this record's generation;
//!    zero-reading blocks as range entries) is written and fsynced —
//!    ORDER POINT A;
//! 4. for each piece: the piece is marked `cloning`, so its
//!    readers wait (a read that had already started and sees new data
//!    under an old context re-plans, and waits too) while the "home
//!    write" runs: data runs cloned, zero runs trimmed like a trim's (no
//!    fsync: the next flush syncs the destination's segments, ORDER POINT
//!    B; a clone refused now is written instead from the source blocks,
//!    read and verified again, so the record stays true); then the
//!    destination range's buffered writes are dropped (the copy supersedes
//!    them; a drop record in the held log says so too), the piece's
//!    contexts are published and `cloning` cleared.
//!
//! A crash before 3 leaves the destination untouched. After 3, recovery
//! re-reads every block of records after `data_durable_seq` and keeps the
//! newest context its data matches: a block whose clone persisted reads
//! new, one whose clone was lost (or not yet issued) reads old. After a
//! flush, every block reads new. If the home write fails after 3, the
//! volume fail-stops like a failed commit (writes refused until it is
//! reopened); a block whose clone was half done then reads as a fault,
//! never as wrong data, and recovery settles it at the reopen.

use std::sync::atomic::{AtomicU64, Ordering};

use vouch_format::journal::JournalHeader;
use vouch_format::{Context, JournalEntry, LayoutKind};

use super::source::{fault, read_data, source_contexts};
use super::Job;
use crate::buffer::PageBuffer;
use crate::contexts::context_in_range;
use crate::engine::Engine;
use crate::error::Result;
use crate::jobs::Visit;
use crate::journal::Journal;
use crate::protection::Seal;
use crate::state::{RangeOp, BLOCK};
use crate::storage::{CloneRange, Mapped, ObjectId};
use crate::volume::Volume;

/// Pieces per step at most: one journal record and one fsync per 16
/// pieces (256 MiB by default), fewer if half the journal holds fewer
/// entries.
const PIECES_PER_STEP: u64 = 16;

/// Threads that read and verify a step's source blocks, and the blocks
/// each reads at a time (1 MiB, into a page-aligned buffer).
const VERIFY_THREADS: usize = 2;
const VERIFY_PART_BLOCKS: u64 = 256;

/// Blocks cloned at a time within a step: the destination's write-back
/// buffer limit (4096 blocks, 16 MiB, by default) — how many blocks
/// readers may wait for at once.
pub(crate) fn piece_blocks(destination: &Engine) -> u64 {
    (destination.tuning().dirty_limit_blocks as u64).max(1)
}

/// Why a job that is not between two volumes cannot be a reflink copy.
pub(super) const NOT_VOLUMES: &str =
    "source and destination are not both volumes (a mirror or a layer copies with reads and writes)";

/// Can a reflink copy work for this job? The two volumes if so, `Err`
/// says why not.
pub(super) fn possible<'a>(job: &Job<'a>) -> std::result::Result<(&'a Volume, &'a Volume), String> {
    let Some((source, destination)) = job.volumes else {
        return Err(NOT_VOLUMES.to_string());
    };
    for (name, volume) in [("source", source), ("destination", destination)] {
        // The LBA (and volume) are associated data of every encrypted
        // block: a shared extent would not authenticate at its new LBA, so
        // a copy must re-encrypt (the pipelined copy does).
        if volume.encrypted() {
            return Err(format!(
                "the {name} volume is encrypted: each block is bound to its LBA and volume, so it must be re-encrypted for the destination, not shared"
            ));
        }
        if volume.layout() != LayoutKind::Split {
            return Err(format!(
                "the {name} volume has the {} layout; only split volumes keep data blocks whole and aligned",
                volume.layout().name()
            ));
        }
    }
    let engines = (source.engine(), destination.engine());
    let source_io = engines.0.shared().io();
    let destination_io = engines.1.shared().io();
    destination_io
        .storage()
        .probe_clone(source_io.storage(), ObjectId::Data(0))
        .map_err(|error| error.to_string())?;
    Ok((source, destination))
}

/// Run `job` between its two `volumes` (`possible` said it can).
pub(super) fn run(job: &Job<'_>, volumes: (&Volume, &Volume), run: &mut Visit<'_>) -> Result<()> {
    let (source, destination) = (volumes.0.engine(), volumes.1.engine());
    let (source, destination) = (&*source, &*destination);
    let piece = piece_blocks(destination);
    let mut step = record_blocks(destination, piece * PIECES_PER_STEP);
    if let Some(shift) = job.overlap_shift() {
        // In one file, a clone's source and destination must not overlap.
        step = step.min(shift.max(1));
    }
    // The steps in the order they run (memmove's: a step's destination is
    // never a later step's source, so a later step may be verified while
    // an earlier one lands).
    let mut steps = Vec::new();
    let mut planned = 0u64;
    while planned < job.count {
        let n = (job.count - planned).min(step);
        let at = if job.backwards() {
            job.count - planned - n
        } else {
            planned
        };
        steps.push(Blocks {
            source: job.source_first + at,
            destination: job.destination_first + at,
            count: n,
        });
        planned += n;
    }
    let mut next = 0;
    while next < steps.len() {
        if run.cancelled()? {
            return Err(job.cancelled(run.at()));
        }
        let window = Window {
            source,
            destination,
            steps: &steps[next..],
            piece,
        };
        let before = run.at();
        let mut landed = |blocks: u64| {
            next += 1;
            run.advance(run.at() + blocks, blocks);
        };
        if job.same_volume() {
            let mut journal = destination.committer().lock();
            window.run((None, &mut journal), &mut landed)?;
        } else if (source as *const Engine) < (destination as *const Engine) {
            let mut source_journal = source.committer().lock();
            let mut journal = destination.committer().lock();
            let journals = (Some(&mut *source_journal), &mut *journal);
            window.run(journals, &mut landed)?;
        } else {
            let mut journal = destination.committer().lock();
            let mut source_journal = source.committer().lock();
            let journals = (Some(&mut *source_journal), &mut *journal);
            window.run(journals, &mut landed)?;
        }
        // Paced between windows, with the committer locks released: the
        // clients' commits of both volumes run while the copy waits.
        run.pace((run.at() - before) * BLOCK)?;
    }
    Ok(())
}

/// How long one window may hold the committer locks before it stops
/// starting steps (the writes of both volumes' clients wait for a commit
/// meanwhile once their write-back buffers fill).
const WINDOW: std::time::Duration = std::time::Duration::from_millis(100);

/// Steps run under one hold of the committer locks: each step's record and
/// home writes while the next step is read and verified on other threads.
struct Window<'a> {
    source: &'a Engine,
    destination: &'a Engine,
    /// The steps left; the window runs the first and as many after it as
    /// start within `WINDOW`.
    steps: &'a [Blocks],
    piece: u64,
}

impl Window<'_> {
    fn run(
        &self,
        (source_journal, journal): (Option<&mut Journal>, &mut Journal),
        landed: &mut dyn FnMut(u64),
    ) -> Result<()> {
        let (source, destination) = (self.source, self.destination);
        let started = std::time::Instant::now();
        commit_source_first(source, destination, source_journal, journal, self.steps)?;
        let mut verified = verify_step(source, destination, self.steps[0]);
        for (index, blocks) in self.steps.iter().enumerate() {
            let current = verified?;
            let next = self
                .steps
                .get(index + 1)
                .filter(|_| started.elapsed() < WINDOW)
                .copied();
            let (landing, next_verified) = std::thread::scope(|scope| {
                let verifying = next.map(|next| {
                    // The clone would drop the destination's cached pages
                    // under the file's lock, on this (landing) thread:
                    // drop them beforehand, beside the verify.
                    scope.spawn(move || drop_destination_cache(destination, next));
                    scope.spawn(move || verify_step(source, destination, next))
                });
                let landing = land_step(source, destination, journal, *blocks, current, self.piece);
                let next_verified = verifying
                    .map(|verifying| verifying.join().expect("a copy's verify thread panicked"));
                (landing, next_verified)
            });
            landing?;
            landed(blocks.count);
            match next_verified {
                Some(next_verified) => verified = next_verified,
                None => break,
            }
        }
        Ok(())
    }
}

/// Advise the destination's storage that a step's destination range is
/// about to be replaced (`Storage::drop_cached`).
fn drop_destination_cache(destination: &Engine, blocks: Blocks) {
    let io = destination.shared().io();
    let mut lba = blocks.destination;
    let end = blocks.destination + blocks.count;
    while lba < end {
        let at = io.geometry.locate(lba);
        let segment_end = (u64::from(at.segment) + 1) * io.geometry.segment_blocks;
        let n = segment_end.min(end) - lba;
        io.storage()
            .drop_cached(ObjectId::Data(at.segment), at.data_offset, n * BLOCK);
        lba += n;
    }
}

/// If the source range of `steps` has writes in its write-back buffer,
/// commit the source first, so its home copy is what was acknowledged (the
/// source's journal is `None` when the source is the destination).
fn commit_source_first(
    source: &Engine,
    destination: &Engine,
    source_journal: Option<&mut Journal>,
    journal: &mut Journal,
    steps: &[Blocks],
) -> Result<()> {
    let low = steps.iter().map(|step| step.source).min().unwrap_or(0);
    let high = steps
        .iter()
        .map(|step| step.source + step.count)
        .max()
        .unwrap_or(0);
    let buffered = source.shared().state().read().buffers_any(low..high);
    if !buffered {
        return Ok(());
    }
    match source_journal {
        Some(source_journal) => source
            .committer()
            .commit(source.shared(), source_journal, &[]),
        None => destination
            .committer()
            .commit(destination.shared(), journal, &[]),
    }
}

/// The most blocks one step may journal: `most`, or fewer when
/// their record would not fit in half the destination's journal (a larger
/// record would be cut in two, and a checkpoint could run between them).
fn record_blocks(destination: &Engine, most: u64) -> u64 {
    let half = destination.committer().journal_bytes() / 2;
    let mut blocks = most;
    // Every block an entry, plus one range entry per block at worst.
    while blocks > 1 && JournalHeader::record_bytes(2 * blocks as u32, 0) > half {
        blocks /= 2;
    }
    blocks
}

/// The LBAs of one step or piece.
#[derive(Clone, Copy)]
struct Blocks {
    source: u64,
    destination: u64,
    count: u64,
}

impl Blocks {
    /// Blocks `[at, at + count)` of these.
    fn part(&self, at: u64, count: u64) -> Blocks {
        Blocks {
            source: self.source + at,
            destination: self.destination + at,
            count,
        }
    }
}

/// Steps 3 and 4 (module comment) of one step whose source blocks were
/// read and verified (2), under both committer locks.
fn land_step(
    source: &Engine,
    destination: &Engine,
    journal: &mut Journal,
    blocks: Blocks,
    (contexts, seals): Verified,
    piece_blocks: u64,
) -> Result<()> {
    let (target, count) = (blocks.destination, blocks.count);
    let shared = destination.shared();
    // 3 (sizes first: a checkpoint, if needed, runs before the record).
    let ranges = zero_ranges(destination, target, &contexts);
    let data_blocks = seals.iter().flatten().count();
    let record_len = JournalHeader::record_bytes((data_blocks + ranges.len()) as u32, 0);
    destination
        .committer()
        .before_plain_record(shared, journal)?;
    let seq = destination
        .committer()
        .reserve(shared, journal, record_len)?;
    let mut entries = Vec::with_capacity(data_blocks + ranges.len());
    let mut new_contexts = Vec::with_capacity(count as usize);
    for (index, seal) in seals.iter().enumerate() {
        let lba = target + index as u64;
        let context = seal.map(|seal| shared.protection().context(lba, seal, seq));
        if let Some(context) = context {
            entries.push(JournalEntry {
                lba,
                count: 1,
                context,
            });
        }
        new_contexts.push(context);
    }
    for range in &ranges {
        entries.push(JournalEntry {
            lba: range.start,
            count: (range.end - range.start) as u32,
            context: context_in_range(range.template, range.start),
        });
    }
    let result = destination
        .committer()
        .append(shared, journal, &entries, None)
        .and_then(|()| {
            // ORDER POINT A passed: 4, one piece at a time.
            let mut at = 0;
            while at < count {
                let n = (count - at).min(piece_blocks);
                let piece = Piece {
                    blocks: blocks.part(at, n),
                    contexts: &contexts[at as usize..(at + n) as usize],
                    seals: &seals[at as usize..(at + n) as usize],
                    new_contexts: &new_contexts[at as usize..(at + n) as usize],
                    ranges: &ranges,
                };
                home_piece(source, destination, journal, &piece)?;
                at += n;
            }
            Ok(())
        });
    if let Err(error) = result {
        // As a failed commit: writes are refused until the volume is
        // reopened, and recovery settles the step's blocks then.
        shared.state().write().end_clone();
        return Err(shared.io().fail_stop(error));
    }
    let pending = shared.state().read().pending_contexts();
    destination.committer().committed(shared, journal, pending)
}

/// Read the step's source blocks from home and verify each against its
/// context, in parts of `VERIFY_PART_BLOCKS` shared out to
/// `VERIFY_THREADS` threads: each block's context, and the destination's
/// seal for it (`None` for a block that reads as zeros). A fault fails the
/// step naming the lowest faulty LBA.
fn verify_step(source: &Engine, destination: &Engine, blocks: Blocks) -> Result<Verified> {
    let parts = blocks.count.div_ceil(VERIFY_PART_BLOCKS);
    let next = AtomicU64::new(0);
    let mapped = map_step(source, blocks);
    let view = mapped.as_ref();
    let verify_parts = || -> Vec<(u64, Result<Verified>)> {
        let mut buffer = PageBuffer::new((VERIFY_PART_BLOCKS * BLOCK) as usize);
        let mut done = Vec::new();
        loop {
            let part = next.fetch_add(1, Ordering::Relaxed);
            if part >= parts {
                return done;
            }
            let at = part * VERIFY_PART_BLOCKS;
            let n = (blocks.count - at).min(VERIFY_PART_BLOCKS);
            buffer.set_len((n * BLOCK) as usize);
            let blocks = blocks.part(at, n);
            let verified = verify_part(source, destination, blocks, (view, at), &mut buffer);
            let failed = verified.is_err();
            done.push((part, verified));
            if failed {
                // The other threads finish their parts; lower faults win.
                return done;
            }
        }
    };
    let mut done: Vec<_> = std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..VERIFY_THREADS)
            .map(|_| scope.spawn(verify_parts))
            .collect();
        let mut done = verify_parts();
        for helper in helpers {
            done.extend(helper.join().expect("a copy's verify thread panicked"));
        }
        done
    });
    done.sort_by_key(|(part, _)| *part);
    let mut contexts = Vec::with_capacity(blocks.count as usize);
    let mut seals = Vec::with_capacity(blocks.count as usize);
    for (_, verified) in done {
        let (part_contexts, part_seals) = verified?;
        contexts.extend(part_contexts);
        seals.extend(part_seals);
    }
    assert_eq!(
        contexts.len() as u64,
        blocks.count,
        "every part of a step that verified was returned"
    );
    Ok((contexts, seals))
}

/// Verified source blocks: each one's context, and the destination's seal
/// for it (`None` for a block that reads as zeros).
type Verified = (Vec<Context>, Vec<Option<Seal>>);

/// One part of `verify_step`, read into `data`.
fn verify_part(
    source: &Engine,
    destination: &Engine,
    blocks: Blocks,
    (step, at): (Option<&Mapped>, u64),
    data: &mut [u8],
) -> Result<Verified> {
    let same_guard = source.guard() == destination.guard();
    let contexts = source_contexts(source, blocks.source, blocks.count)?;
    // The page cache's own pages when they can be mapped (no copy: the
    // check keeps nothing), else a read into `data`.
    let data: &[u8] = match mapped_part(source, step, at, &contexts) {
        Some(bytes) => bytes,
        None => {
            read_data(source, blocks.source, &contexts, data)?;
            data
        }
    };
    let mut seals = Vec::with_capacity(contexts.len());
    for (index, context) in contexts.iter().enumerate() {
        let lba = blocks.source + index as u64;
        // A zero-reading block is checked as the zeros it reads as (what
        // its slot holds on disk is not its data).
        let bytes = if context.reads_as_zero() {
            &ZERO_BLOCK
        } else {
            block(data, index)
        };
        source
            .shared()
            .protection()
            .open(lba, &Ok(*context), bytes)
            .map_err(|kind| fault(source, lba, kind))?;
        let seal = match source.shared().protection().seal_of(context) {
            None => None,
            // A plain copy is a new write at its destination: its
            // generation is the commit's, not the source's. (An encrypted
            // seal keeps its generation: it is in the associated data.)
            Some(seal) if same_guard && matches!(context, Context::Data { .. }) => Some(Seal {
                generation: 0,
                ..seal
            }),
            Some(seal) if same_guard => Some(seal),
            Some(_) => {
                let lba = blocks.destination + index as u64;
                let mut copy = [0u8; BLOCK as usize];
                copy.copy_from_slice(bytes);
                let generation = destination.shared().sealing_generation();
                Some(
                    destination
                        .shared()
                        .protection()
                        .seal(lba, &mut copy, generation),
                )
            }
        };
        seals.push(seal);
    }
    Ok((contexts, seals))
}

static ZERO_BLOCK: [u8; BLOCK as usize] = [0; BLOCK as usize];

/// The source blocks of a step mapped (`Storage::map_for_check`), when they
/// lie in one data segment; `None` sends every part to `read_data`.
fn map_step(source: &Engine, blocks: Blocks) -> Option<Mapped> {
    let io = source.shared().io();
    let last = blocks.source + blocks.count - 1;
    // (Split layout: one segment's blocks lie end to end.)
    if blocks.source / io.geometry.segment_blocks != last / io.geometry.segment_blocks {
        return None;
    }
    let at = io.geometry.locate(blocks.source);
    io.storage().map_for_check(
        ObjectId::Data(at.segment),
        at.data_offset,
        blocks.count * BLOCK,
    )
}

/// One part's source bytes from the step's mapping, if it has one and they
/// can be read (counted as read: the check reads them).
fn mapped_part<'a>(
    source: &Engine,
    step: Option<&'a Mapped>,
    at: u64,
    contexts: &[Context],
) -> Option<&'a [u8]> {
    if contexts.iter().all(Context::reads_as_zero) {
        return None;
    }
    let bytes = step?.bytes((at * BLOCK) as usize, contexts.len() * BLOCK as usize)?;
    let data_blocks = contexts.iter().filter(|c| !c.reads_as_zero()).count() as u64;
    source.shared().io().stats.add_read(data_blocks * BLOCK);
    Some(bytes)
}

/// Runs of zero-reading source blocks, as the destination's range ops.
fn zero_ranges(destination: &Engine, target: u64, contexts: &[Context]) -> Vec<RangeOp> {
    let mut ranges: Vec<RangeOp> = Vec::new();
    for (index, context) in contexts.iter().enumerate() {
        if !context.reads_as_zero() {
            continue;
        }
        let lba = target + index as u64;
        let allocate = matches!(context, Context::Zero { .. });
        let template = destination.shared().protection().zero_template(allocate);
        match ranges.last_mut() {
            Some(range)
                if range.end == lba
                    && matches!(range.template, Context::Zero { .. }) == allocate =>
            {
                range.end += 1
            }
            _ => ranges.push(RangeOp::new(lba, lba + 1, template)),
        }
    }
    ranges
}

/// One piece of a journaled step.
struct Piece<'a> {
    blocks: Blocks,
    contexts: &'a [Context],
    seals: &'a [Option<Seal>],
    new_contexts: &'a [Option<Context>],
    /// The step's zero ranges (the piece applies its part of them).
    ranges: &'a [RangeOp],
}

/// Step 4 for one piece, after the step's record (A): readers of the
/// piece wait while its extents change, then see its new contexts.
fn home_piece(
    source: &Engine,
    destination: &Engine,
    journal: &mut Journal,
    piece: &Piece<'_>,
) -> Result<()> {
    let shared = destination.shared();
    let (target, count) = (piece.blocks.destination, piece.blocks.count);
    shared.state().write().begin_clone(target..target + count);
    clone_home(
        source,
        destination,
        journal,
        piece.blocks,
        piece.contexts,
        piece.seals,
    )?;
    let pieces: Vec<RangeOp> = piece
        .ranges
        .iter()
        .filter_map(|range| {
            let start = range.start.max(target);
            let end = range.end.min(target + count);
            (start < end).then_some(range.piece(start, end))
        })
        .collect();
    for range in &pieces {
        destination
            .committer()
            .apply_range_home(shared, journal, range)?;
    }
    // The piece is home (in the kernel): the destination's buffered writes
    // it replaces are dropped now, and with a drop record in the held log
    // under the same locks, so a crash of the process replays neither
    // them over the copy nor a write buffered after it. (Dropped before
    // the clone, a crash in between would have lost them while the copy
    // reverted to the old home blocks.)
    let mut held = shared.held().lock();
    let dropped = held.append_drop(shared.io(), target, count);
    shared
        .state()
        .write()
        .publish_clone(target, piece.new_contexts, &pieces);
    drop(held);
    // A held log that missed the drop would bring the writes back after a
    // crash of the process: stop accepting writes instead.
    dropped.map_err(|error| shared.io().fail_stop(error))
}

fn block(data: &[u8], index: usize) -> &[u8] {
    &data[index * BLOCK as usize..(index + 1) * BLOCK as usize]
}

/// Clone the data blocks of a step (`seals[i]` is `Some` for a data block)
/// in runs contiguous on both sides. A clone the storage refuses now is
/// written instead from the source blocks (`contexts`), read and verified
/// again, so the journaled contexts hold.
fn clone_home(
    source: &Engine,
    destination: &Engine,
    journal: &mut Journal,
    blocks: Blocks,
    contexts: &[Context],
    seals: &[Option<Seal>],
) -> Result<()> {
    let from = source.shared().io().geometry;
    let to = destination.shared().io().geometry;
    let io = destination.shared().io();
    let mut index = 0usize;
    while index < seals.len() {
        if seals[index].is_none() {
            index += 1;
            continue;
        }
        let mut end = index + 1;
        while end < seals.len()
            && seals[end].is_some()
            && from.contiguous(blocks.source + end as u64 - 1, blocks.source + end as u64)
            && to.contiguous(
                blocks.destination + end as u64 - 1,
                blocks.destination + end as u64,
            )
        {
            end += 1;
        }
        let source_at = from.locate(blocks.source + index as u64);
        let target_at = to.locate(blocks.destination + index as u64);
        let object = ObjectId::Data(target_at.segment);
        let len = (end - index) as u64 * BLOCK;
        let cloned = io.storage().clone_range(CloneRange {
            object,
            offset: target_at.data_offset,
            source: source.shared().io().storage(),
            source_object: ObjectId::Data(source_at.segment),
            source_offset: source_at.data_offset,
            len,
        });
        journal.note_unsynced(object);
        if let Err(error) = cloned {
            tracing::warn!(%error, ?object, offset = target_at.data_offset, "reflink failed after the journal record: writing the blocks instead");
            let first = blocks.source + index as u64;
            let run = &contexts[index..end];
            let mut data = PageBuffer::new(run.len() * BLOCK as usize);
            read_data(source, first, run, &mut data)?;
            for (offset, context) in run.iter().enumerate() {
                let lba = first + offset as u64;
                source
                    .shared()
                    .protection()
                    .open(lba, &Ok(*context), block(&data, offset))
                    .map_err(|kind| fault(source, lba, kind))?;
            }
            io.write_object(object, target_at.data_offset, &data)?;
        }
        index = end;
    }
    Ok(())
}
