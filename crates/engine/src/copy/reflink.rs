//! The reflink copy (split layout only): the destination's data segments
//! share the source's extents (`Storage::clone_range`, FICLONERANGE), and
//! only the destination's contexts are written — journaled like any
//! commit's. A copy is cut into steps of at most `PIECES_PER_STEP` pieces
//! (one journal record each), and a step into pieces of `piece_blocks`
//! (the memory it holds). With the committer lock of both volumes held (taken
//! in address order), one step is:
//!
//! 1. if the source range has writes in its write-back buffer, commit the
//!    source first, so its home copy is what was acknowledged;
//! 2. read every source block of the step from home and verify it against
//!    its context (a fault fails the copy naming the LBA: nothing of the
//!    step was written), keeping the destination's seal (the source's
//!    guard when both volumes use the same guard kind);
//! 3. one journal record with the destination's new contexts (the source's
//!    guard, reference tag = destination LBA, this record's generation;
//!    zero-reading blocks as range entries) is written and fsynced —
//!    ORDER POINT A;
//! 4. for each piece: the destination range's buffered writes are dropped
//!    (the copy supersedes them) and the piece's blocks, read and verified
//!    again, become
//!    the destination's `committing` blocks, so its readers see the new
//!    data from memory while the extents change under them; the "home
//!    write": data runs cloned, zero runs trimmed like a trim's (no fsync:
//!    the next flush syncs the destination's segments, ORDER POINT B; a
//!    clone refused now is written instead from the copy in memory, so the
//!    record stays true); the piece's contexts published and `committing`
//!    dropped.
//!
//! A crash before 3 leaves the destination untouched. After 3, recovery
//! re-reads every block of records after `data_durable_seq` and keeps the
//! newest context its data matches: a block whose clone persisted reads
//! new, one whose clone was lost (or not yet issued) reads old. After a
//! flush, every block reads new. The source is read twice (2 and 4), from
//! the page cache in the common case; holding a whole step in memory
//! instead would cost 256 MiB.

use std::collections::BTreeMap;

use vouch_format::journal::JournalHeader;
use vouch_format::{Context, JournalEntry, LayoutKind};

use super::source::{fault, read_data, source_contexts};
use super::Job;
use crate::contexts::context_in_range;
use crate::engine::Engine;
use crate::error::Result;
use crate::journal::Journal;
use crate::protection::Seal;
use crate::state::{shared_block, DirtyBlock, RangeOp, BLOCK};
use crate::storage::{CloneRange, ObjectId};

/// Pieces per step at most: one journal record and one fsync per 16
/// pieces (256 MiB by default), fewer if half the journal holds fewer
/// entries.
const PIECES_PER_STEP: u64 = 16;

/// Blocks cloned at a time within a step: the destination's write-back
/// buffer limit (4096 blocks, 16 MiB, by default) — the memory a copy
/// holds for readers of the blocks whose extents are changing, no more
/// than a commit holds.
pub(crate) fn piece_blocks(destination: &Engine) -> u64 {
    (destination.tuning.dirty_limit_blocks as u64).max(1)
}

/// Can a reflink copy work for this job? `Err` says why not.
pub(super) fn possible(job: &Job<'_>) -> std::result::Result<(), String> {
    for (name, volume) in [("source", job.source), ("destination", job.destination)] {
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
    let source = &job.source.engine().shared.io;
    let destination = &job.destination.engine().shared.io;
    destination
        .storage()
        .probe_clone(source.storage(), ObjectId::Data(0))
        .map_err(|error| error.to_string())
}

pub(super) fn run(job: &Job<'_>) -> Result<()> {
    let source = job.source.engine();
    let destination = job.destination.engine();
    let piece = piece_blocks(destination);
    let mut step = record_blocks(destination, piece * PIECES_PER_STEP);
    if let Some(shift) = job.overlap_shift() {
        // In one file, a clone's source and destination must not overlap.
        step = step.min(shift.max(1));
    }
    let mut buffer = vec![0u8; (step.min(piece).min(job.count) * BLOCK) as usize];
    let mut done = 0u64;
    while done < job.count {
        if job.control.is_cancelled() {
            return Err(job.cancelled(done));
        }
        let n = (job.count - done).min(step);
        let at = if job.backwards() {
            job.count - done - n
        } else {
            done
        };
        let blocks = Blocks {
            source: job.source_first + at,
            destination: job.destination_first + at,
            count: n,
        };
        if job.same_volume() {
            let mut journal = destination.committer.lock();
            copy_step(
                source,
                destination,
                (None, &mut journal),
                blocks,
                &mut buffer,
            )?;
        } else if (source as *const Engine) < (destination as *const Engine) {
            let mut source_journal = source.committer.lock();
            let mut journal = destination.committer.lock();
            let journals = (Some(&mut *source_journal), &mut *journal);
            copy_step(source, destination, journals, blocks, &mut buffer)?;
        } else {
            let mut journal = destination.committer.lock();
            let mut source_journal = source.committer.lock();
            let journals = (Some(&mut *source_journal), &mut *journal);
            copy_step(source, destination, journals, blocks, &mut buffer)?;
        }
        done += n;
        job.control.set_progress(done, job.count);
    }
    Ok(())
}

/// The most blocks one step may journal: `most`, or fewer when
/// their record would not fit in half the destination's journal (a larger
/// record would be cut in two, and a checkpoint could run between them).
fn record_blocks(destination: &Engine, most: u64) -> u64 {
    let half = destination.committer.journal_bytes() / 2;
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

/// One step (module comment), under both committer locks: the source's
/// journal is `None` when the source is the destination.
fn copy_step(
    source: &Engine,
    destination: &Engine,
    (source_journal, journal): (Option<&mut Journal>, &mut Journal),
    blocks: Blocks,
    buffer: &mut [u8],
) -> Result<()> {
    let (first, target, count) = (blocks.source, blocks.destination, blocks.count);
    // 1. The source's acknowledged writes home first.
    let buffered = source
        .shared
        .state
        .read()
        .active
        .range(first..first + count)
        .next()
        .is_some();
    if buffered {
        match source_journal {
            Some(source_journal) => source
                .committer
                .commit(&source.shared, source_journal, &[])?,
            None => source.committer.commit(&source.shared, journal, &[])?,
        }
    }
    // 2. Read and verify every block of the step, piece by piece, keeping
    // only its context and the destination's seal.
    let shared = &destination.shared;
    let same_guard = source.guard == destination.guard;
    let mut contexts = Vec::with_capacity(count as usize);
    let mut seals: Vec<Option<Seal>> = Vec::with_capacity(count as usize);
    let piece_blocks = (buffer.len() as u64 / BLOCK).max(1);
    let mut at = 0;
    while at < count {
        let n = (count - at).min(piece_blocks);
        let data = &mut buffer[..(n * BLOCK) as usize];
        let piece = source_contexts(source, first + at, n)?;
        read_data(source, first + at, &piece, data)?;
        for (index, context) in piece.iter().enumerate() {
            let lba = first + at + index as u64;
            source
                .shared
                .protection
                .open(lba, &Ok(*context), block(data, index))
                .map_err(|kind| fault(source, lba, kind))?;
            let seal = match source.shared.protection.seal_of(context) {
                None => None,
                Some(seal) if same_guard => Some(seal),
                Some(_) => {
                    let lba = target + at + index as u64;
                    let mut copy = [0u8; BLOCK as usize];
                    copy.copy_from_slice(block(data, index));
                    Some(shared.protection.seal(lba, &mut copy))
                }
            };
            seals.push(seal);
        }
        contexts.extend(piece);
        at += n;
    }
    // 4 (sizes first: a checkpoint, if needed, runs before the record).
    let ranges = zero_ranges(destination, target, &contexts);
    let data_blocks = seals.iter().flatten().count();
    let record_len = JournalHeader::record_bytes((data_blocks + ranges.len()) as u32, 0);
    let seq = destination.committer.reserve(shared, journal, record_len)?;
    let mut entries = Vec::with_capacity(data_blocks + ranges.len());
    let mut new_contexts = Vec::with_capacity(count as usize);
    for (index, seal) in seals.iter().enumerate() {
        let lba = target + index as u64;
        let context = seal.map(|seal| shared.protection.context(lba, seal, seq));
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
    let zero_seal = shared.protection.seal(target, &mut [0u8; BLOCK as usize]);
    let result = destination
        .committer
        .append(shared, journal, &entries, None)
        .and_then(|()| {
            // ORDER POINT A passed: 3, 5 and 6, one piece at a time.
            let mut at = 0;
            while at < count {
                let n = (count - at).min(piece_blocks);
                let piece = Piece {
                    blocks: blocks.part(at, n),
                    contexts: &contexts[at as usize..(at + n) as usize],
                    seals: &seals[at as usize..(at + n) as usize],
                    new_contexts: &new_contexts[at as usize..(at + n) as usize],
                    ranges: &ranges,
                    zero_seal,
                };
                let data = &mut buffer[..(n * BLOCK) as usize];
                home_piece(source, destination, journal, &piece, data)?;
                at += n;
            }
            Ok(())
        });
    if let Err(error) = result {
        // As a failed commit: blocks in flight stay in `committing` (reads
        // return them), writes are refused until the volume is reopened.
        return Err(shared.io.fail_stop(error));
    }
    let pending = shared.state.read().contexts.pending();
    destination.committer.committed(shared, journal, pending)
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
        let template = destination.shared.protection.zero_template(allocate);
        match ranges.last_mut() {
            Some(range)
                if range.end == lba
                    && matches!(range.template, Context::Zero { .. }) == allocate =>
            {
                range.end += 1
            }
            _ => ranges.push(RangeOp {
                start: lba,
                end: lba + 1,
                template,
            }),
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
    zero_seal: Seal,
}

/// Steps 3, 5 and 6 for one piece, after the step's record (A).
fn home_piece(
    source: &Engine,
    destination: &Engine,
    journal: &mut Journal,
    piece: &Piece<'_>,
    data: &mut [u8],
) -> Result<()> {
    let shared = &destination.shared;
    let (target, count) = (piece.blocks.destination, piece.blocks.count);
    // The blocks again (the source cannot change: its committer lock is
    // held), for readers while their extents change and for a refused
    // clone's fallback write — verified again, because these are the bytes
    // that leave: a read that now returns other bytes fails the copy (and,
    // after A, stops the volume's writes like a failed commit; recovery
    // keeps the old contexts these blocks' data still matches).
    read_data(source, piece.blocks.source, piece.contexts, data)?;
    for (index, context) in piece.contexts.iter().enumerate() {
        let lba = piece.blocks.source + index as u64;
        source
            .shared
            .protection
            .open(lba, &Ok(*context), block(data, index))
            .map_err(|kind| fault(source, lba, kind))?;
    }
    let mut committing = BTreeMap::new();
    for (index, seal) in piece.seals.iter().enumerate() {
        let dirty = DirtyBlock {
            data: shared_block(block(data, index)),
            seal: seal.unwrap_or(piece.zero_seal),
        };
        committing.insert(target + index as u64, dirty);
    }
    {
        let mut state = shared.state.write();
        assert!(state.committing.is_empty(), "a commit is already in flight");
        state.drop_buffered(target, target + count);
        state.committing = committing;
    }
    clone_home(
        source,
        destination,
        journal,
        piece.blocks,
        piece.seals,
        data,
    )?;
    let pieces: Vec<RangeOp> = piece
        .ranges
        .iter()
        .filter_map(|range| {
            let start = range.start.max(target);
            let end = range.end.min(target + count);
            (start < end).then_some(RangeOp {
                start,
                end,
                template: range.template,
            })
        })
        .collect();
    for range in &pieces {
        shared.layouts.of(range.start).apply_range_home(
            &shared.io,
            range,
            &mut journal.unsynced,
        )?;
    }
    let mut state = shared.state.write();
    for (index, context) in piece.new_contexts.iter().enumerate() {
        if let Some(context) = context {
            state.contexts.set(target + index as u64, *context);
        }
    }
    for range in &pieces {
        state
            .contexts
            .set_range(range.start, range.end, range.template);
    }
    state.committing.clear();
    Ok(())
}

fn block(data: &[u8], index: usize) -> &[u8] {
    &data[index * BLOCK as usize..(index + 1) * BLOCK as usize]
}

/// Clone the data blocks of a step (`seals[i]` is `Some` for a data block)
/// in runs contiguous on both sides. A clone the storage refuses now is
/// written instead from `data` (verified), so the journaled contexts hold.
fn clone_home(
    source: &Engine,
    destination: &Engine,
    journal: &mut Journal,
    blocks: Blocks,
    seals: &[Option<Seal>],
    data: &[u8],
) -> Result<()> {
    let from = source.shared.io.geometry;
    let to = destination.shared.io.geometry;
    let io = &destination.shared.io;
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
            source: source.shared.io.storage(),
            source_object: ObjectId::Data(source_at.segment),
            source_offset: source_at.data_offset,
            len,
        });
        journal.unsynced.insert(object);
        if let Err(error) = cloned {
            tracing::warn!(%error, ?object, offset = target_at.data_offset, "reflink failed after the journal record: writing the blocks instead");
            let bytes = &data[index * BLOCK as usize..end * BLOCK as usize];
            io.write_object(object, target_at.data_offset, bytes)?;
        }
        index = end;
    }
    Ok(())
}
