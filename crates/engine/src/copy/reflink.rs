//! The reflink copy (split layout only): the destination's data segments
//! share the source's extents (`Storage::clone_range`, FICLONERANGE), and
//! only the destination's contexts are written — journaled like any
//! commit's. One step of at most `STEP_BLOCKS` blocks, with the committer
//! lock of both volumes held (taken in address order), is:
//!
//! 1. if the source range has writes in its write-back buffer, commit the
//!    source first, so its home copy is what was acknowledged;
//! 2. read the source blocks from home and verify each against its
//!    context (a fault fails the copy naming the LBA; nothing was written);
//! 3. the destination range's buffered writes are dropped (the copy
//!    supersedes them) and the verified blocks become the destination's
//!    `committing` blocks, so its readers see the new data from memory
//!    while the extents change under them;
//! 4. one journal record with the destination's new contexts (the source's
//!    guard, reference tag = destination LBA, this record's generation;
//!    zero-reading blocks as range entries) is written and fsynced —
//!    ORDER POINT A;
//! 5. the "home write": the data runs are cloned, zero runs trimmed like a
//!    trim's home write (no fsync: the next flush syncs the destination's
//!    segments, ORDER POINT B). A clone that fails here is written
//!    instead, from the verified copy in memory, so the record stays true;
//! 6. the contexts are published and `committing` dropped.
//!
//! A crash before 4 leaves the destination untouched. After 4, recovery
//! re-reads every block of records after `data_durable_seq` and keeps the
//! newest context its data matches: a block whose clone persisted reads
//! new, one whose clone was lost reads old. After a flush, every block
//! reads new.

use std::collections::BTreeMap;

use vouch_format::journal::JournalHeader;
use vouch_format::{Context, JournalEntry, LayoutKind};

use super::Job;
use crate::contexts::{context_in_range, Lookup, CONTEXTS_PER_PAGE};
use crate::engine::Engine;
use crate::error::{Error, Fault, FaultKind, Result};
use crate::journal::Journal;
use crate::protection::Seal;
use crate::state::{load_context_page, shared_block, DirtyBlock, RangeOp, BLOCK};
use crate::storage::{CloneRange, ObjectId};

/// Blocks per step (16 MiB, the write-back buffer's size): the memory a
/// step holds, and one journal fsync per step.
pub(crate) const STEP_BLOCKS: u64 = 4096;

/// Can a reflink copy work for this job? `Err` says why not.
pub(super) fn possible(job: &Job<'_>) -> std::result::Result<(), String> {
    for (name, volume) in [("source", job.source), ("destination", job.destination)] {
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
    let step = match job.overlap_shift() {
        // In one file, a clone's source and destination must not overlap.
        Some(shift) => STEP_BLOCKS.min(shift.max(1)),
        None => STEP_BLOCKS,
    };
    let source = job.source.engine();
    let destination = job.destination.engine();
    let mut buffer = vec![0u8; (step.min(job.count) * BLOCK) as usize];
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
        let data = &mut buffer[..(n * BLOCK) as usize];
        if job.same_volume() {
            let mut journal = destination.committer.lock();
            copy_step(source, destination, (None, &mut journal), blocks, data)?;
        } else if (source as *const Engine) < (destination as *const Engine) {
            let mut source_journal = source.committer.lock();
            let mut journal = destination.committer.lock();
            let journals = (Some(&mut *source_journal), &mut *journal);
            copy_step(source, destination, journals, blocks, data)?;
        } else {
            let mut journal = destination.committer.lock();
            let mut source_journal = source.committer.lock();
            let journals = (Some(&mut *source_journal), &mut *journal);
            copy_step(source, destination, journals, blocks, data)?;
        }
        done += n;
        job.control.set_progress(done, job.count);
    }
    Ok(())
}

/// The LBAs of one step.
#[derive(Clone, Copy)]
struct Blocks {
    source: u64,
    destination: u64,
    count: u64,
}

/// One step (module comment), under both committer locks: the source's
/// journal is `None` when the source is the destination.
fn copy_step(
    source: &Engine,
    destination: &Engine,
    (source_journal, journal): (Option<&mut Journal>, &mut Journal),
    blocks: Blocks,
    data: &mut [u8],
) -> Result<()> {
    let Blocks {
        source: first,
        destination: target,
        count,
    } = blocks;
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
    // 2. Read and verify.
    let contexts = read_verified(source, first, count, data)?;
    // 4 (sizes first: a checkpoint, if needed, runs before the record).
    let shared = &destination.shared;
    let same_guard = source.guard == destination.guard;
    let zero_seal = shared.protection.seal(target, &[0u8; BLOCK as usize]);
    let mut seals = Vec::with_capacity(count as usize);
    let mut ranges: Vec<RangeOp> = Vec::new();
    for (index, context) in contexts.iter().enumerate() {
        let lba = target + index as u64;
        if context.reads_as_zero() {
            let template = shared
                .protection
                .zero_template(matches!(context, Context::Zero { .. }));
            match ranges.last_mut() {
                Some(range)
                    if range.end == lba
                        && std::mem::discriminant(&range.template)
                            == std::mem::discriminant(&template) =>
                {
                    range.end += 1
                }
                _ => ranges.push(RangeOp {
                    start: lba,
                    end: lba + 1,
                    template,
                }),
            }
            seals.push(None);
            continue;
        }
        let seal = match source.shared.protection.seal_of(context) {
            Some(seal) if same_guard => seal,
            _ => shared.protection.seal(lba, block(data, index)),
        };
        seals.push(Some(seal));
    }
    let data_blocks = seals.iter().flatten().count();
    let record_len = JournalHeader::record_bytes((data_blocks + ranges.len()) as u32, 0);
    let seq = destination.committer.reserve(shared, journal, record_len)?;
    // 3. Readers see the new blocks from memory from here on.
    {
        let mut state = shared.state.write();
        assert!(state.committing.is_empty(), "a commit is already in flight");
        state.drop_buffered(target, target + count);
        let mut committing = BTreeMap::new();
        for (index, seal) in seals.iter().enumerate() {
            let dirty = DirtyBlock {
                data: shared_block(block(data, index)),
                seal: seal.unwrap_or(zero_seal),
            };
            committing.insert(target + index as u64, dirty);
        }
        state.committing = committing;
    }
    let mut entries = Vec::with_capacity(data_blocks + ranges.len());
    let mut new_contexts = Vec::with_capacity(data_blocks);
    for (index, seal) in seals.iter().enumerate() {
        if let Some(seal) = seal {
            let lba = target + index as u64;
            let context = shared.protection.context(lba, *seal, seq);
            new_contexts.push((lba, context));
            entries.push(JournalEntry {
                lba,
                count: 1,
                context,
            });
        }
    }
    for range in &ranges {
        entries.push(JournalEntry {
            lba: range.start,
            count: (range.end - range.start) as u32,
            context: context_in_range(range.template, range.start),
        });
    }
    let result = destination
        .committer
        .append(shared, journal, &entries, None)
        .and_then(|()| {
            // ORDER POINT A passed: 5. the home writes.
            clone_home(source, destination, journal, blocks, &seals, data)?;
            for range in &ranges {
                shared.layouts.of(range.start).apply_range_home(
                    &shared.io,
                    range,
                    &mut journal.unsynced,
                )?;
            }
            Ok(())
        });
    if let Err(error) = result {
        // As a failed commit: the blocks stay in `committing` (reads return
        // them), writes are refused until the volume is reopened.
        return Err(shared.io.fail_stop(error));
    }
    // 6. Publish.
    let pending = {
        let mut state = shared.state.write();
        for (lba, context) in new_contexts {
            state.contexts.set(lba, context);
        }
        for range in &ranges {
            state
                .contexts
                .set_range(range.start, range.end, range.template);
        }
        state.committing.clear();
        state.contexts.pending()
    };
    destination.committer.committed(shared, journal, pending)
}

fn block(data: &[u8], index: usize) -> &[u8] {
    &data[index * BLOCK as usize..(index + 1) * BLOCK as usize]
}

/// Blocks `[first, first + count)` of `engine` from home (not its write-back
/// buffer: the caller committed it and holds the committer lock, so home
/// and contexts agree), each verified against its context. Returns the
/// contexts; zero-reading blocks are zero-filled.
fn read_verified(engine: &Engine, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Context>> {
    let shared = &engine.shared;
    let mut contexts = Vec::with_capacity(count as usize);
    for lba in first..first + count {
        let lookup = shared.state.read().contexts.lookup(lba);
        let found = match lookup {
            Lookup::Found(found) => found,
            Lookup::NeedPage(page_no) => {
                match load_context_page(&shared.io, &shared.state, page_no) {
                    Ok(page) => {
                        let at = (lba % CONTEXTS_PER_PAGE) as usize * vouch_format::CONTEXT_BYTES;
                        Context::decode(&page[at..at + vouch_format::CONTEXT_BYTES])
                    }
                    Err(_) => return Err(fault(engine, lba, FaultKind::Unreadable)),
                }
            }
        };
        contexts.push(found.map_err(|_| fault(engine, lba, FaultKind::ContextCorrupt))?);
    }
    let geometry = shared.io.geometry;
    let mut index = 0usize;
    while index < contexts.len() {
        if contexts[index].reads_as_zero() {
            out[index * BLOCK as usize..(index + 1) * BLOCK as usize].fill(0);
            index += 1;
            continue;
        }
        let mut end = index + 1;
        while end < contexts.len()
            && !contexts[end].reads_as_zero()
            && geometry.contiguous(first + end as u64 - 1, first + end as u64)
        {
            end += 1;
        }
        let lba = first + index as u64;
        let run = &mut out[index * BLOCK as usize..end * BLOCK as usize];
        let location = geometry.locate(lba);
        let object = ObjectId::Data(location.segment);
        if shared
            .io
            .try_read(object, location.data_offset, run)
            .is_err()
        {
            // Name the first block that cannot be read.
            for (offset, lba) in (lba..first + end as u64).enumerate() {
                let block = &mut run[offset * BLOCK as usize..(offset + 1) * BLOCK as usize];
                let at = geometry.locate(lba).data_offset;
                if shared.io.try_read(object, at, block).is_err() {
                    return Err(fault(engine, lba, FaultKind::Unreadable));
                }
            }
        }
        shared.io.stats.add_read(run.len() as u64);
        for (offset, context) in contexts[index..end].iter().enumerate() {
            let lba = first + (index + offset) as u64;
            let block = &run[offset * BLOCK as usize..(offset + 1) * BLOCK as usize];
            shared
                .protection
                .open(lba, &Ok(*context), block)
                .map_err(|kind| fault(engine, lba, kind))?;
        }
        index = end;
    }
    Ok(contexts)
}

fn fault(engine: &Engine, lba: u64, kind: FaultKind) -> Error {
    engine.shared.io.stats.count_fault(kind);
    tracing::warn!(
        lba,
        kind = kind.name(),
        "copy source block failed verification"
    );
    Error::Fault(Fault { lba, kind })
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
