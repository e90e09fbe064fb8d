//! Verified reads, one pipeline for every route (docs/ARCHITECTURE.md,
//! "Routes"). A read is planned once (`Shared::plan_read`: each block's
//! source — the write-back buffer, a context that says "zero" (no data
//! I/O), or home storage verified against its context — and the hole
//! ranges follow from it) and executed once (`Shared::execute`); the
//! routes differ only in how they may wait (`Route`) and what they do with
//! a block they cannot answer (`OnFailure`): the inline and ring routes
//! decline it, the worker re-reads it once and, if it fails again, judges
//! it a fault naming its LBA and kind, and no bytes of it are returned.

use std::ops::Range;

use bytes::BytesMut;
use smallvec::SmallVec;

use vouch_format::{Context, FormatError};

use crate::contexts::Page;
use crate::device::SealedBlock;
use crate::error::{Error, Fault, FaultKind, Result};
use crate::jobs::SCAN_CHUNK_BLOCKS;
use crate::layout::{Allocation, ContextFrom, Planned, StoredContext};
use crate::protection::Seal;
use crate::shared::Shared;
use crate::state::{context_in_page, load_context_page, BlockData, BLOCK};
use crate::storage::Wait;

/// How long a read of blocks being cloned sleeps before it looks again.
const CLONE_WAIT: std::time::Duration = std::time::Duration::from_micros(50);

/// Where one block's bytes come from.
pub(crate) enum Source {
    /// The write-back buffer: the bytes as sealed (ciphertext on an
    /// encrypted volume) and their seal.
    Memory(BlockData, Seal),
    /// A context that reads as zero, kept (a hole and zeroes written move
    /// sealed as what they are: `read_sealed`).
    Zero(Context),
    /// Home storage, verified against its context.
    Home(ContextFrom),
    /// The block's context could not be read.
    Unreadable,
}

impl From<Planned> for Source {
    fn from(planned: Planned) -> Source {
        match planned {
            Planned::Zero(context) => Source::Zero(context),
            Planned::Home(context) => Source::Home(context),
            // Only a worker loads the page; until then nothing is known.
            Planned::NeedPage(_) => Source::Unreadable,
        }
    }
}

/// What `Shared::fetch_block` read a block as.
enum Stored {
    /// From the write-back buffer, sealed with this (its context is made
    /// when it is committed).
    Buffered(Seal),
    /// Zeros, from a context that reads as zero without data I/O (a hole,
    /// or zeroes written).
    Zero(Context),
    /// From home: the context it is checked against.
    Sealed(std::result::Result<Context, FormatError>),
}

/// Each block's source, in LBA order; small reads (the common 4 KiB case)
/// stay on the stack.
pub(crate) type Plan = SmallVec<[Source; 4]>;

/// The route a read takes, which decides only how its plan may wait
/// (docs/ARCHITECTURE.md, "Routes").
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// On the reader task (`try_read`): plans from memory, reads home
    /// only from the page cache.
    Inline,
    /// Submitted to io_uring by the reader task (`plan_ring_read`): plans
    /// from memory; its one I/O completes later.
    Ring,
    /// On a worker: waits for a reflink copy, loads context pages, reads
    /// the device.
    Worker,
}

/// How a read treats faults.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnFault {
    /// Fail on the first faulty block (client reads).
    Stop,
    /// Zero-fill faulty blocks and list them (check, export --allow-faults).
    Collect,
    /// `Collect` without judging: nothing counted or logged. A mirror's
    /// repair re-reads a block the read that found it bad already judged
    /// (`SealedDevice::recheck_blocks`): one fault per bad block per read.
    Recheck,
}

/// What a route does with a block it cannot answer as planned (it would
/// wait, or it fails verification).
pub(crate) enum OnFailure<'a> {
    /// Inline and ring: give the read up with no side effect (nothing
    /// counted or logged); the worker reads it again.
    Decline,
    /// The worker: re-read the block once, then judge it a fault
    /// (`note_fault`); `OnFault` says whether the read goes on.
    Judge(&'a mut Vec<Fault>, OnFault),
}

impl OnFailure<'_> {
    /// How the route's home reads may wait.
    fn wait(&self) -> Wait {
        match self {
            OnFailure::Decline => Wait::NoWait,
            OnFailure::Judge(..) => Wait::Block,
        }
    }

    /// Block `lba` (bytes `block`) failed with `kind`, re-read already if
    /// the route re-reads: true if the read goes on.
    fn failed(&mut self, shared: &Shared, lba: u64, kind: FaultKind, block: &mut [u8]) -> bool {
        match self {
            OnFailure::Decline => false,
            OnFailure::Judge(faults, OnFault::Recheck) => {
                block.fill(0);
                faults.push(Fault { lba, kind });
                true
            }
            OnFailure::Judge(faults, on_fault) => {
                shared.note_fault(lba, kind, block, faults);
                *on_fault == OnFault::Collect
            }
        }
    }
}

/// What executing a plan did.
pub(crate) struct Executed {
    /// Every block answered (or judged, when collecting faults); false
    /// when the route declined or stopped at a fault.
    pub complete: bool,
    /// Bytes of blocks read from home (`Stats::add_read`).
    pub home_bytes: u64,
}

impl Shared {
    /// Read `buf.len()` bytes at `offset` (any byte range), verifying every
    /// block. Returns the byte ranges of `buf` (relative) known to be zero
    /// without data I/O.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.check_range(offset, buf.len() as u64)?;
        self.io().stats.add_client_read(buf.len() as u64);
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

    /// `read_blocks_collecting` without judging what fails (`OnFault::Recheck`).
    pub fn recheck_blocks(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        let mut faults = Vec::new();
        self.read_blocks_with(first, count, out, None, &mut faults, OnFault::Recheck)?;
        Ok(faults)
    }

    pub(crate) fn read_blocks_with(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
        holes: Option<&mut Vec<Range<u64>>>,
        faults: &mut Vec<Fault>,
        on_fault: OnFault,
    ) -> Result<()> {
        assert_eq!(
            out.len() as u64,
            count * BLOCK,
            "output buffer must hold the blocks"
        );
        let plan = self.plan_waiting(first, count);
        let done = self.execute(
            first,
            &plan,
            out,
            holes,
            &mut OnFailure::Judge(faults, on_fault),
        );
        self.io().stats.add_read(done.home_bytes);
        Ok(())
    }

    /// Execute a read's plan into `out` (whole blocks from `first`): the
    /// one place a source becomes bytes. Zero blocks are pushed to
    /// `holes`; a block that cannot be answered goes to `failure`.
    pub(crate) fn execute(
        &self,
        first: u64,
        plan: &[Source],
        out: &mut [u8],
        mut holes: Option<&mut Vec<Range<u64>>>,
        failure: &mut OnFailure<'_>,
    ) -> Executed {
        let mut done = Executed {
            complete: true,
            home_bytes: 0,
        };
        let mut index = 0usize;
        while index < plan.len() {
            let lba = first + index as u64;
            let block = index * BLOCK as usize..(index + 1) * BLOCK as usize;
            let went_on = match &plan[index] {
                Source::Memory(data, seal) => {
                    out[block.clone()].copy_from_slice(&data[..]);
                    index += 1;
                    // Only a buffer corrupted in memory fails here.
                    match self.protection().reveal(lba, seal, &mut out[block.clone()]) {
                        Ok(()) => true,
                        Err(kind) => failure.failed(self, lba, kind, &mut out[block]),
                    }
                }
                Source::Zero(_) => {
                    out[block.clone()].fill(0);
                    if let Some(holes) = holes.as_deref_mut() {
                        push_hole(holes, block.start as u64..block.end as u64);
                    }
                    index += 1;
                    true
                }
                Source::Unreadable => {
                    index += 1;
                    failure.failed(self, lba, FaultKind::Unreadable, &mut out[block])
                }
                Source::Home(_) => {
                    let end = self.home_run_end(first, plan, index);
                    let run = &mut out[index * BLOCK as usize..end * BLOCK as usize];
                    done.home_bytes += run.len() as u64;
                    let went_on = self.read_home_run(lba, &plan[index..end], run, failure);
                    index = end;
                    went_on
                }
            };
            if !went_on {
                done.complete = false;
                return done;
            }
        }
        done
    }

    /// The first LBA at or after `lba` whose data or context may be written:
    /// chunks that are holes on disk and have nothing pending are skipped.
    /// Rounded down to a scan chunk boundary so chunks stay aligned.
    pub fn next_possible_data(&self, lba: u64) -> Result<u64> {
        let blocks = self.io().geometry.blocks;
        {
            let state = self.state().read();
            let pending = state.next_buffered(lba);
            let overlay = state.contexts().next_overlay(lba);
            if pending == Some(lba) || overlay == Some(lba) {
                return Ok(lba);
            }
        }
        let mut found = None;
        let mut from = lba;
        while from < blocks && found.is_none() {
            let span_end = self.layouts().span_end(from);
            found = self
                .layouts()
                .of(from)
                .next_data_on_disk(self.io(), from)?
                .filter(|at| *at < span_end);
            from = span_end;
        }
        let state = self.state().read();
        let pending = [
            state.next_buffered(lba),
            state.contexts().next_overlay(lba),
            found,
        ];
        let next = pending.into_iter().flatten().min().unwrap_or(blocks);
        Ok((next - next % SCAN_CHUNK_BLOCKS).max(lba))
    }

    /// Blocks as stored, each with its context (`SealedDevice::read_sealed`).
    /// A block still in the write-back buffer carries the seal it was
    /// buffered with and the generation its commit will carry; a block that
    /// reads as zeros has a hole's context.
    pub fn read_sealed(&self, first: u64, count: u64, generation: u64) -> Result<Vec<SealedBlock>> {
        self.check_range(first.saturating_mul(BLOCK), count.saturating_mul(BLOCK))?;
        let plan = self.plan_waiting(first, count);
        let mut sealed = Vec::with_capacity(count as usize);
        for (index, source) in plan.iter().enumerate() {
            let lba = first + index as u64;
            let mut bytes = BytesMut::zeroed(BLOCK as usize);
            let context = match self.fetch_block(lba, source, &mut bytes[..]) {
                Ok(Stored::Buffered(seal)) => Ok(self.protection().context(lba, seal, generation)),
                Ok(Stored::Zero(context)) => Ok(context),
                Ok(Stored::Sealed(context)) => context,
                Err(kind) => return Err(Error::Fault(Fault { lba, kind })),
            };
            let context = context.map_err(|error| {
                Error::Fault(Fault {
                    lba,
                    kind: crate::protection::context_fault(&error),
                })
            })?;
            let data = BlockData::from_bytes(bytes.freeze());
            sealed.push(SealedBlock { lba, data, context });
        }
        Ok(sealed)
    }

    /// One block's bytes as stored (ciphertext on an encrypted volume;
    /// zeros for a zero-reading context) into `block`, from its planned
    /// `source`, and what seals them: the one place a single block's source
    /// becomes bytes, for `read_sealed` and the worker's re-read
    /// (`reread_once`). `execute` reads runs of home blocks with one I/O
    /// instead, and opens them as `reread_once` does. Nothing is verified
    /// here.
    fn fetch_block(
        &self,
        lba: u64,
        source: &Source,
        block: &mut [u8],
    ) -> std::result::Result<Stored, FaultKind> {
        match source {
            Source::Memory(data, seal) => {
                block.copy_from_slice(&data[..]);
                Ok(Stored::Buffered(*seal))
            }
            Source::Zero(context) => {
                block.fill(0);
                Ok(Stored::Zero(*context))
            }
            Source::Unreadable => Err(FaultKind::Unreadable),
            Source::Home(from) => {
                let stored = self
                    .layouts()
                    .of(lba)
                    .read_block(self.io(), lba, block)
                    .map_err(|_| FaultKind::Unreadable)?;
                Ok(Stored::Sealed(match from {
                    ContextFrom::Known(found) => found.clone(),
                    ContextFrom::Record => stored.expect("a record carries its context"),
                }))
            }
        }
    }

    /// Where the run of home blocks starting at `plan[index]` (LBA
    /// `first + index`) ends: the index after its last block that one I/O
    /// can read.
    pub(crate) fn home_run_end(&self, first: u64, plan: &[Source], index: usize) -> usize {
        let mut end = index + 1;
        while end < plan.len()
            && matches!(plan[end], Source::Home(_))
            && self.home_contiguous(first + end as u64 - 1, first + end as u64)
        {
            end += 1;
        }
        end
    }

    /// Can one I/O read blocks `a` and `a + 1` = `b` from home?
    fn home_contiguous(&self, a: u64, b: u64) -> bool {
        self.layouts().same_span(a, b) && self.layouts().of(a).geometry().contiguous(a, b)
    }

    /// The plan of a read of blocks `[first, first + count)`, into `plan`
    /// (empty; filled in place, so the hot inline route never moves it):
    /// each block's source, decided under one short lock from what is in
    /// memory (the buffer, the cached contexts, the layout's `plan`). A
    /// block whose context page is not loaded: the worker loads it without
    /// the lock (a page that cannot be read leaves the block
    /// `Unreadable`, a fault naming it); the inline and ring routes
    /// decline (false), as while a reflink copy replaces these blocks'
    /// extents (copy/reflink.rs), which the worker waits out.
    pub(crate) fn plan_read(&self, first: u64, count: u64, route: Route, plan: &mut Plan) -> bool {
        let mut missing = Vec::new();
        while !self.plan_from_memory(first, count, plan, &mut missing) {
            if route != Route::Worker {
                return false;
            }
            // Wait for the blocks' new contexts.
            std::thread::sleep(CLONE_WAIT);
        }
        let broken = match route {
            Route::Inline => self.breaks().inline_read_past_buffer,
            Route::Ring => self.breaks().ring_read_past_buffer,
            Route::Worker => false,
        };
        if broken {
            self.plan_buffered_as_home(first, plan);
        }
        if missing.is_empty() {
            return true;
        }
        if route != Route::Worker {
            return false;
        }
        let mut loaded: Option<(u64, Page)> = None;
        for (index, page_no) in missing {
            let page = match &loaded {
                Some((number, page)) if *number == page_no => page.clone(),
                _ => match load_context_page(self.io(), self.state(), page_no) {
                    Ok(page) => {
                        loaded = Some((page_no, page.clone()));
                        page
                    }
                    // The block's context cannot be read: a fault of this
                    // block, reported with its LBA like any other.
                    Err(_) => continue,
                },
            };
            let lba = first + index as u64;
            plan[index] = Planned::from_context(context_in_page(&page, lba)).into();
        }
        true
    }

    /// A worker's `plan_read`, returned.
    fn plan_waiting(&self, first: u64, count: u64) -> Plan {
        let mut plan = Plan::new();
        self.plan_read(first, count, Route::Worker, &mut plan);
        plan
    }

    /// `plan_read`'s look at memory, into `plan` and `missing` (cleared
    /// first): false while a reflink copy replaces the blocks; blocks
    /// whose context page is not loaded are listed `(index in the plan,
    /// page number)` (and `Unreadable` in the plan).
    fn plan_from_memory(
        &self,
        first: u64,
        count: u64,
        plan: &mut Plan,
        missing: &mut Vec<(usize, u64)>,
    ) -> bool {
        plan.clear();
        missing.clear();
        let state = self.state().read();
        if state.cloning(first, count) {
            return false;
        }
        plan.reserve(count as usize);
        for lba in first..first + count {
            if let Some(dirty) = state.buffered(lba) {
                plan.push(Source::Memory(dirty.data.clone(), dirty.seal));
                continue;
            }
            let planned = self.layouts().of(lba).plan(lba, state.contexts());
            if let Planned::NeedPage(page) = planned {
                missing.push((plan.len(), page));
            }
            plan.push(planned.into());
        }
        true
    }

    /// `OrderingBreaks::ring_read_past_buffer` and
    /// `inline_read_past_buffer` (simulator self-tests only): each block
    /// the buffer holds, planned as at home if its context says it has a
    /// home value.
    fn plan_buffered_as_home(&self, first: u64, plan: &mut Plan) {
        let state = self.state().read();
        for (source, lba) in plan.iter_mut().zip(first..) {
            if !matches!(source, Source::Memory(..)) {
                continue;
            }
            if let Planned::Home(context) = self.layouts().of(lba).plan(lba, state.contexts()) {
                *source = Source::Home(context);
            }
        }
    }

    /// Read and verify a run of consecutive blocks from home with one I/O
    /// (waiting as `failure`'s route may): true if the read goes on.
    fn read_home_run(
        &self,
        first: u64,
        plan: &[Source],
        out: &mut [u8],
        failure: &mut OnFailure<'_>,
    ) -> bool {
        let count = plan.len() as u64;
        let io = self
            .layouts()
            .of(first)
            .read_run(self.io(), first, count, out, failure.wait());
        let Ok(record_contexts) = io else {
            if matches!(failure, OnFailure::Decline) {
                return false;
            }
            // Find which blocks are unreadable, one at a time.
            for (index, lba) in (first..first + count).enumerate() {
                let block = &mut out[index * BLOCK as usize..(index + 1) * BLOCK as usize];
                if let Err(kind) = self.reread_block(lba, block) {
                    if !failure.failed(self, lba, kind, block) {
                        return false;
                    }
                }
            }
            return true;
        };
        self.open_home_run(first, plan, &record_contexts, out, failure)
    }

    /// Verify (and on an encrypted volume decrypt) a run of home blocks
    /// read into `out`, each against its planned context or the one read
    /// with it: the one check of every route's home blocks (the ring's
    /// too, `finish_ring_read`). A block that fails is declined, or
    /// re-read once (a concurrent commit may have moved it) and judged.
    pub(crate) fn open_home_run(
        &self,
        first: u64,
        plan: &[Source],
        record_contexts: &[std::result::Result<Context, FormatError>],
        out: &mut [u8],
        failure: &mut OnFailure<'_>,
    ) -> bool {
        // A client read may take the protection's quicker opening; a
        // failure is re-read and opened with every check.
        let thorough = matches!(
            failure,
            OnFailure::Judge(_, OnFault::Collect | OnFault::Recheck)
        );
        for (index, lba) in (first..first + plan.len() as u64).enumerate() {
            let block = &mut out[index * BLOCK as usize..(index + 1) * BLOCK as usize];
            let context = match &plan[index] {
                Source::Home(ContextFrom::Known(found)) => found.clone(),
                _ => record_contexts[index].clone(),
            };
            let opened = if thorough {
                self.protection().open_in_place(lba, &context, block)
            } else {
                self.protection().open_for_client(lba, &context, block)
            };
            if opened.is_ok() {
                if context.is_ok_and(|c| c.reads_as_zero()) {
                    block.fill(0);
                }
                continue;
            }
            if matches!(failure, OnFailure::Decline) {
                return false;
            }
            match self.reread_block(lba, block) {
                Ok(()) => {
                    self.io()
                        .stats
                        .rechecks_recovered
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Err(kind) => {
                    if !failure.failed(self, lba, kind, block) {
                        return false;
                    }
                }
            }
        }
        true
    }

    fn note_fault(&self, lba: u64, kind: FaultKind, block: &mut [u8], faults: &mut Vec<Fault>) {
        block.fill(0);
        self.io().stats.count_fault(kind);
        // The cause once per unit of a read (it reads the unit again).
        let same_unit = faults.last().is_some_and(|last: &Fault| {
            last.kind == kind
                && self.io().written.unit_of(last.lba) == self.io().written.unit_of(lba)
        });
        if kind == FaultKind::MetadataLost && !same_unit {
            let cause = self.metadata_cause(lba);
            tracing::warn!(lba, kind = kind.name(), %cause, "block failed verification");
        } else {
            tracing::warn!(lba, kind = kind.name(), "block failed verification");
        }
        faults.push(Fault { lba, kind });
    }

    /// Re-read one block from scratch: fresh source, fresh context. A
    /// failure counts as a fault only when the block's context stayed the
    /// same across two attempts: a block rewritten again (or its record
    /// moved) between the plan and the read is read once more, a bounded
    /// number of times, so concurrent writers never cause a false fault.
    fn reread_block(&self, lba: u64, block: &mut [u8]) -> std::result::Result<(), FaultKind> {
        const ATTEMPTS: usize = 8;
        let mut previous = None;
        let mut last = FaultKind::Unreadable;
        for _ in 0..ATTEMPTS {
            match self.reread_once(lba, block) {
                Ok(()) => return Ok(()),
                // Nothing to compare: an I/O error or a fault in memory.
                Err((kind, None)) => return Err(kind),
                Err((kind, context)) => {
                    if previous == context {
                        return Err(kind);
                    }
                    last = kind;
                    previous = context;
                }
            }
        }
        Err(last)
    }

    /// One attempt of `reread_block`; a failure carries the context the
    /// block was checked against (`None` when another attempt cannot help:
    /// the read itself failed, or the block in memory does not verify).
    fn reread_once(
        &self,
        lba: u64,
        block: &mut [u8],
    ) -> std::result::Result<(), (FaultKind, Option<Result<Context, FormatError>>)> {
        let plan = self.plan_waiting(lba, 1);
        let context = match self.fetch_block(lba, &plan[0], block) {
            Err(kind) => return Err((kind, None)),
            Ok(Stored::Buffered(seal)) => {
                return self
                    .protection()
                    .reveal(lba, &seal, block)
                    .map_err(|kind| (kind, None));
            }
            // Zeros without data I/O, as `execute` answers them.
            Ok(Stored::Zero(_)) => return Ok(()),
            Ok(Stored::Sealed(context)) => context,
        };
        self.protection()
            .open_in_place(lba, &context, block)
            .map_err(|kind| (kind, Some(context.clone())))?;
        if context.is_ok_and(|c| c.reads_as_zero()) {
            block.fill(0);
        }
        Ok(())
    }

    /// Allocation of blocks from `offset`, as runs, covering at most `max_blocks`.
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
        // Folded chunk by chunk: block status keeps runs, never a context
        // per block of the whole request.
        self.each_stored_context(first, end - first, &mut |found| {
            let kind = found.allocation();
            match runs.last_mut() {
                Some((blocks, last)) if *last == kind => *blocks += 1,
                _ => runs.push((1, kind)),
            }
        })?;
        Ok(runs)
    }

    /// The protection information of blocks `[first, first + count)` as it
    /// stands, without reading their data (`Layout::stored_contexts`):
    /// what block status reports, and what changed blocks compare
    /// (`vouch diff`, `qemu:dirty-bitmap`).
    pub fn stored_contexts(&self, first: u64, count: u64) -> Result<Vec<StoredContext>> {
        let mut found = Vec::with_capacity(count as usize);
        self.each_stored_context(first, count, &mut |context| found.push(context))?;
        Ok(found)
    }

    /// `stored_contexts` handed to `visit` in LBA order, 4096 blocks
    /// (one layout call) at a time.
    fn each_stored_context(
        &self,
        first: u64,
        count: u64,
        visit: &mut dyn FnMut(StoredContext),
    ) -> Result<()> {
        self.check_range(first.saturating_mul(BLOCK), count.saturating_mul(BLOCK))?;
        let end = first + count;
        let mut lba = first;
        while lba < end {
            let chunk_end = (end - lba).min(4096) + lba;
            for (start, piece_end, layout) in self.layouts().pieces(lba, chunk_end) {
                let buffered: Vec<bool> = {
                    let state = self.state().read();
                    (start..piece_end)
                        .map(|lba| state.buffered(lba).is_some())
                        .collect()
                };
                layout
                    .stored_contexts(self.io(), self.state(), start, &buffered)?
                    .into_iter()
                    .for_each(&mut *visit);
            }
            lba = chunk_end;
        }
        Ok(())
    }
}

pub(crate) fn push_hole(holes: &mut Vec<Range<u64>>, range: Range<u64>) {
    match holes.last_mut() {
        Some(last) if last.end == range.start => last.end = range.end,
        _ => holes.push(range),
    }
}
