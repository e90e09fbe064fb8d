//! Verified reads. Every block comes from one of: the write-back buffer
//! (memory, verified when it was buffered and again before it is written),
//! a context that says "zero" (no data I/O), or home storage verified
//! against its context. A block that fails verification is re-read once;
//! if it fails again the read fails with the LBA and kind of fault, and no
//! bytes of it are returned.

use std::ops::Range;
use std::sync::Arc;

use smallvec::SmallVec;

use vouch_format::layout::PACKED_RECORD_BYTES;
use vouch_format::{Context, FormatError, LayoutKind, CONTEXT_BYTES};

use crate::contexts::{Lookup, CONTEXTS_PER_PAGE};
use crate::error::{Error, Fault, FaultKind, Result};
use crate::storage::ObjectId;
use crate::volume::{Block, Core, BLOCK};

/// Where one block's bytes come from.
enum Source {
    Memory(Arc<Block>),
    Zero,
    /// Home storage; split layouts carry the context looked up, packed
    /// layouts find it in the record.
    Disk(Option<Result<Context, FormatError>>),
    /// The block's context could not be read.
    Unreadable,
}

/// Each block's source, in LBA order; small reads (the common 4 KiB case)
/// stay on the stack.
type Plan = SmallVec<[Source; 4]>;

/// How a read treats faults.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnFault {
    /// Fail on the first faulty block (client reads).
    Stop,
    /// Zero-fill faulty blocks and list them (check, export --allow-faults).
    Collect,
}

/// What a block status query reports for a run of blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// Never written or trimmed: reads as zeros, holds no data.
    Hole,
    /// Written as zeroes: reads as zeros, counts as allocated.
    Zero,
    Data,
}

impl Core {
    /// Read `buf.len()` bytes at `offset` (512-byte aligned), verifying every
    /// block. Returns the byte ranges of `buf` (relative) known to be zero
    /// without data I/O.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.check_range(offset, buf.len() as u64)?;
        self.stats.add_client_read(buf.len() as u64);
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        let first = offset / BLOCK;
        let last = (offset + buf.len() as u64 - 1) / BLOCK;
        let count = last - first + 1;
        let mut holes = Vec::new();
        if offset.is_multiple_of(BLOCK) && (buf.len() as u64).is_multiple_of(BLOCK) {
            self.read_blocks(first, count, buf, Some(&mut holes))?;
            return Ok(holes);
        }
        let mut covering = vec![0u8; (count * BLOCK) as usize];
        self.read_blocks(first, count, &mut covering, Some(&mut holes))?;
        let skip = (offset - first * BLOCK) as usize;
        buf.copy_from_slice(&covering[skip..skip + buf.len()]);
        let window = skip as u64..skip as u64 + buf.len() as u64;
        Ok(holes
            .into_iter()
            .filter_map(|hole| {
                let start = hole.start.max(window.start);
                let end = hole.end.min(window.end);
                (start < end).then(|| start - window.start..end - window.start)
            })
            .collect())
    }

    /// Read whole blocks, failing on the first fault.
    pub(crate) fn read_blocks(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
        holes: Option<&mut Vec<Range<u64>>>,
    ) -> Result<()> {
        let mut faults = Vec::new();
        self.read_blocks_with(first, count, out, holes, &mut faults, OnFault::Stop)?;
        match faults.into_iter().next() {
            Some(fault) => Err(Error::Fault(fault)),
            None => Ok(()),
        }
    }

    /// Read whole blocks; faulty blocks are zero-filled and listed.
    pub fn read_blocks_collecting(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
    ) -> Result<Vec<Fault>> {
        let mut faults = Vec::new();
        self.read_blocks_with(first, count, out, None, &mut faults, OnFault::Collect)?;
        Ok(faults)
    }

    pub(crate) fn read_blocks_with(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
        mut holes: Option<&mut Vec<Range<u64>>>,
        faults: &mut Vec<Fault>,
        on_fault: OnFault,
    ) -> Result<()> {
        assert_eq!(
            out.len() as u64,
            count * BLOCK,
            "output buffer must hold the blocks"
        );
        let plan = self.plan(first, count)?;
        let mut index = 0usize;
        while index < plan.len() {
            let lba = first + index as u64;
            let block = index * BLOCK as usize..(index + 1) * BLOCK as usize;
            match &plan[index] {
                Source::Memory(data) => {
                    out[block].copy_from_slice(&data[..]);
                    index += 1;
                }
                Source::Zero => {
                    out[block.clone()].fill(0);
                    if let Some(holes) = holes.as_deref_mut() {
                        push_hole(holes, block.start as u64..block.end as u64);
                    }
                    index += 1;
                }
                Source::Unreadable => {
                    self.note_fault(lba, FaultKind::Unreadable, &mut out[block], faults);
                    if on_fault == OnFault::Stop {
                        return Ok(());
                    }
                    index += 1;
                }
                Source::Disk(_) => {
                    let mut end = index + 1;
                    while end < plan.len()
                        && matches!(plan[end], Source::Disk(_))
                        && self
                            .geometry
                            .contiguous(first + end as u64 - 1, first + end as u64)
                    {
                        end += 1;
                    }
                    let run = &mut out[index * BLOCK as usize..end * BLOCK as usize];
                    self.read_disk_run(lba, &plan[index..end], run, faults, on_fault)?;
                    if on_fault == OnFault::Stop && !faults.is_empty() {
                        return Ok(());
                    }
                    index = end;
                }
            }
        }
        Ok(())
    }

    /// Decide each block's source under one short lock; load missing context
    /// pages (split) without holding it.
    fn plan(&self, first: u64, count: u64) -> Result<Plan> {
        let mut plan = Plan::with_capacity(count as usize);
        let mut missing = Vec::new();
        {
            let state = self.state.read();
            for lba in first..first + count {
                if let Some(dirty) = state
                    .active
                    .get(&lba)
                    .or_else(|| state.committing.get(&lba))
                {
                    plan.push(Source::Memory(dirty.data.clone()));
                    continue;
                }
                if self.geometry.layout == LayoutKind::Packed {
                    // Packed contexts live in the records; only a read-only
                    // open of an unrecovered volume holds ranges in memory.
                    let pending_zero = !state.contexts.ranges.is_empty()
                        && matches!(state.contexts.lookup(lba), Lookup::Found(Ok(context)) if context.reads_as_zero());
                    plan.push(if pending_zero {
                        Source::Zero
                    } else {
                        Source::Disk(None)
                    });
                    continue;
                }
                match state.contexts.lookup(lba) {
                    Lookup::Found(Ok(context)) if context.reads_as_zero() => {
                        plan.push(Source::Zero)
                    }
                    Lookup::Found(found) => plan.push(Source::Disk(Some(found))),
                    Lookup::NeedPage(page) => {
                        missing.push((plan.len(), page));
                        plan.push(Source::Disk(None));
                    }
                }
            }
        }
        let mut loaded: Option<(u64, Arc<[u8; 4096]>)> = None;
        for (index, page_no) in missing {
            let page = match &loaded {
                Some((number, page)) if *number == page_no => page.clone(),
                _ => match self.load_context_page(page_no) {
                    Ok(page) => {
                        loaded = Some((page_no, page.clone()));
                        page
                    }
                    // The block's context cannot be read: a fault of this
                    // block, reported with its LBA like any other.
                    Err(_) => {
                        plan[index] = Source::Unreadable;
                        continue;
                    }
                },
            };
            let lba = first + index as u64;
            let at = (lba % CONTEXTS_PER_PAGE) as usize * CONTEXT_BYTES;
            plan[index] = match Context::decode(&page[at..at + CONTEXT_BYTES]) {
                Ok(context) if context.reads_as_zero() => Source::Zero,
                found => Source::Disk(Some(found)),
            };
        }
        Ok(plan)
    }

    fn load_context_page(&self, page_no: u64) -> Result<Arc<[u8; 4096]>> {
        let epoch = self.state.read().contexts.epoch();
        let mut bytes = [0u8; 4096];
        self.read_object(ObjectId::Contexts, page_no * 4096, &mut bytes)?;
        let page = crate::volume::shared_block(&bytes);
        self.state
            .write()
            .contexts
            .insert_page_from(page_no, page.clone(), epoch);
        Ok(page)
    }

    /// Read and verify a run of consecutive on-disk blocks with one I/O.
    fn read_disk_run(
        &self,
        first: u64,
        plan: &[Source],
        out: &mut [u8],
        faults: &mut Vec<Fault>,
        on_fault: OnFault,
    ) -> Result<()> {
        let count = plan.len() as u64;
        let location = self.geometry.locate(first);
        let object = ObjectId::Data(location.segment);
        let mut packed_contexts = Vec::new();
        let io = match self.geometry.layout {
            LayoutKind::Split => self.storage.read_at(object, location.data_offset, out),
            LayoutKind::Packed => {
                let span = self.geometry.locate(first + count - 1).data_offset
                    + PACKED_RECORD_BYTES
                    - location.data_offset;
                let mut records = vec![0u8; span as usize];
                let result = self
                    .storage
                    .read_at(object, location.data_offset, &mut records);
                if result.is_ok() {
                    for (index, lba) in (first..first + count).enumerate() {
                        let at =
                            (self.geometry.locate(lba).data_offset - location.data_offset) as usize;
                        out[index * BLOCK as usize..(index + 1) * BLOCK as usize]
                            .copy_from_slice(&records[at..at + BLOCK as usize]);
                        packed_contexts.push(Context::decode(
                            &records[at + BLOCK as usize..at + PACKED_RECORD_BYTES as usize],
                        ));
                    }
                }
                result
            }
        };
        self.stats.add_read(out.len() as u64);
        if io.is_err() {
            // Find which blocks are unreadable, one at a time.
            for (index, lba) in (first..first + count).enumerate() {
                let block = &mut out[index * BLOCK as usize..(index + 1) * BLOCK as usize];
                if let Err(kind) = self.reread_block(lba, block) {
                    self.note_fault(lba, kind, block, faults);
                    if on_fault == OnFault::Stop {
                        return Ok(());
                    }
                }
            }
            return Ok(());
        }
        for (index, lba) in (first..first + count).enumerate() {
            let block = &mut out[index * BLOCK as usize..(index + 1) * BLOCK as usize];
            let context = match &plan[index] {
                Source::Disk(Some(found)) => found.clone(),
                _ => packed_contexts[index].clone(),
            };
            if self.verify(lba, &context, block).is_ok() {
                if context.is_ok_and(|c| c.reads_as_zero()) {
                    block.fill(0);
                }
                continue;
            }
            // Recheck once: a concurrent commit may have moved the block.
            match self.reread_block(lba, block) {
                Ok(()) => {
                    self.stats
                        .rechecks_recovered
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Err(kind) => {
                    self.note_fault(lba, kind, block, faults);
                    if on_fault == OnFault::Stop {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    fn note_fault(&self, lba: u64, kind: FaultKind, block: &mut [u8], faults: &mut Vec<Fault>) {
        block.fill(0);
        self.stats.count_fault(kind);
        tracing::warn!(lba, kind = kind.name(), "block failed verification");
        faults.push(Fault { lba, kind });
    }

    /// Re-read one block from scratch: fresh source, fresh context.
    fn reread_block(&self, lba: u64, block: &mut [u8]) -> std::result::Result<(), FaultKind> {
        let plan = self.plan(lba, 1).map_err(|_| FaultKind::Unreadable)?;
        let location = self.geometry.locate(lba);
        let object = ObjectId::Data(location.segment);
        let context = match &plan[0] {
            Source::Memory(data) => {
                block.copy_from_slice(&data[..]);
                return Ok(());
            }
            Source::Zero => {
                block.fill(0);
                return Ok(());
            }
            Source::Unreadable => return Err(FaultKind::Unreadable),
            Source::Disk(Some(found)) => {
                self.storage
                    .read_at(object, location.data_offset, block)
                    .map_err(|_| FaultKind::Unreadable)?;
                found.clone()
            }
            Source::Disk(None) => {
                let mut record = [0u8; PACKED_RECORD_BYTES as usize];
                self.storage
                    .read_at(object, location.data_offset, &mut record)
                    .map_err(|_| FaultKind::Unreadable)?;
                block.copy_from_slice(&record[..BLOCK as usize]);
                Context::decode(&record[BLOCK as usize..])
            }
        };
        self.verify(lba, &context, block)?;
        if context.is_ok_and(|c| c.reads_as_zero()) {
            block.fill(0);
        }
        Ok(())
    }

    /// Check one block's data against its context.
    pub(crate) fn verify(
        &self,
        lba: u64,
        context: &Result<Context, FormatError>,
        data: &[u8],
    ) -> std::result::Result<(), FaultKind> {
        match context {
            Err(_) => Err(FaultKind::ContextCorrupt),
            Ok(Context::Unwritten) => Ok(()),
            Ok(Context::Zero {
                volume_tag,
                ref_tag,
                ..
            }) => self.check_tags(lba, *volume_tag, *ref_tag),
            Ok(Context::Data {
                volume_tag,
                ref_tag,
                guard,
                ..
            }) => {
                self.check_tags(lba, *volume_tag, *ref_tag)?;
                if self.guard.compute(data) != *guard {
                    return Err(FaultKind::GuardMismatch);
                }
                Ok(())
            }
            // Encrypted volumes are refused at open (incompat flag); a stray
            // encrypted context in a plain volume is corruption.
            Ok(Context::Encrypted { .. }) => Err(FaultKind::ContextCorrupt),
        }
    }

    fn check_tags(
        &self,
        lba: u64,
        volume_tag: u32,
        ref_tag: u64,
    ) -> std::result::Result<(), FaultKind> {
        if volume_tag != self.volume_tag {
            return Err(FaultKind::VolumeTagMismatch);
        }
        if ref_tag != lba {
            return Err(FaultKind::RefTagMismatch);
        }
        Ok(())
    }

    /// Allocation of blocks from `first`, as runs, covering at most `max_blocks`.
    pub fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.check_range(offset, length)?;
        let first = offset / BLOCK;
        let end = (offset + length)
            .div_ceil(BLOCK)
            .min(first + max_blocks.max(1));
        let mut runs: Vec<(u64, Allocation)> = Vec::new();
        let mut lba = first;
        while lba < end {
            let chunk = (end - lba).min(4096);
            let kinds = self.allocation_of(lba, chunk)?;
            for kind in kinds {
                match runs.last_mut() {
                    Some((blocks, last)) if *last == kind => *blocks += 1,
                    _ => runs.push((1, kind)),
                }
            }
            lba += chunk;
        }
        Ok(runs)
    }

    fn allocation_of(&self, first: u64, count: u64) -> Result<Vec<Allocation>> {
        let mut kinds = Vec::with_capacity(count as usize);
        match self.geometry.layout {
            LayoutKind::Split => {
                for source in self.plan(first, count)? {
                    kinds.push(match source {
                        Source::Memory(_) | Source::Disk(_) | Source::Unreadable => {
                            Allocation::Data
                        }
                        Source::Zero => Allocation::Hole,
                    });
                }
                // Distinguish written zeroes from holes.
                let state = self.state.read();
                for (index, kind) in kinds.iter_mut().enumerate() {
                    if *kind == Allocation::Hole {
                        if let Lookup::Found(Ok(Context::Zero { .. })) =
                            state.contexts.lookup(first + index as u64)
                        {
                            *kind = Allocation::Zero;
                        }
                    }
                }
            }
            LayoutKind::Packed => {
                // Sparse fast path: no data anywhere in these records.
                let start = self.geometry.locate(first);
                let last = self.geometry.locate(first + count - 1);
                let object = ObjectId::Data(start.segment);
                let any_data = match self.storage.next_data(object, start.data_offset) {
                    Ok(Some(at)) => {
                        at < last.data_offset + PACKED_RECORD_BYTES || last.segment != start.segment
                    }
                    Ok(None) => last.segment != start.segment,
                    Err(error) => return Err(Error::io("seek", object, start.data_offset, error)),
                };
                let dirty: Vec<bool> = {
                    let state = self.state.read();
                    (first..first + count)
                        .map(|lba| {
                            state.active.contains_key(&lba) || state.committing.contains_key(&lba)
                        })
                        .collect()
                };
                for (index, lba) in (first..first + count).enumerate() {
                    if dirty[index] {
                        kinds.push(Allocation::Data);
                        continue;
                    }
                    if !any_data {
                        kinds.push(Allocation::Hole);
                        continue;
                    }
                    let location = self.geometry.locate(lba);
                    let mut raw = [0u8; CONTEXT_BYTES];
                    self.read_object(
                        ObjectId::Data(location.segment),
                        location.data_offset + BLOCK,
                        &mut raw,
                    )?;
                    kinds.push(match Context::decode(&raw) {
                        Ok(Context::Unwritten) => Allocation::Hole,
                        Ok(Context::Zero { .. }) => Allocation::Zero,
                        _ => Allocation::Data,
                    });
                }
            }
        }
        Ok(kinds)
    }
}

fn push_hole(holes: &mut Vec<Range<u64>>, range: Range<u64>) {
    match holes.last_mut() {
        Some(last) if last.end == range.start => last.end = range.end,
        _ => holes.push(range),
    }
}
