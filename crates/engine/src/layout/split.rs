//! The `split` layout: data blocks in the data segments, their contexts in
//! a separate context table (`contexts` object), DIX-style. Contexts
//! committed since the last checkpoint live in memory (`ContextStore`) and
//! in the journal; a checkpoint writes them into the table.
//!
//! Recovery: a commit after the last ORDER POINT B may not have reached
//! home, so each block it wrote is read back and given the newest context
//! its data matches (new, an older write, or the context it had before;
//! zero-reading contexts always match). A block matching none was torn
//! below 4 KiB by the media: it keeps its newest context and reads as a
//! fault. The records are applied in one pass without I/O; the blocks to
//! verify, the table pages of their older contexts and the blocks to redo
//! are then read and written in runs of adjacent ones, so a journal of
//! many small records costs what its blocks do.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;

use parking_lot::RwLock;
use vouch_format::journal::record_data;
use vouch_format::{Context, FormatError, Geometry, JournalEntry, LayoutKind, CONTEXT_BYTES};

use super::{Layout, Planned, Replay, RunSpan, StoredContext, UnitPlace, WrittenPages};
use crate::backing::Backing;
use crate::contexts::{context_in_range, ContextStore, Lookup, Page, CONTEXTS_PER_PAGE};
use crate::error::{Error, Result};
use crate::journal::Record;
use crate::protection::Protection;
use crate::state::{lookup_loading, Block, BlockData, DirtyBlock, RangeOp, VolumeState, BLOCK};
use crate::storage::{ObjectId, Run, Wait, IOV_MAX};

pub(crate) struct SplitLayout {
    geometry: Geometry,
}

impl SplitLayout {
    pub fn new(geometry: Geometry) -> SplitLayout {
        SplitLayout { geometry }
    }

    /// A context page as it is now (cached copy or disk), to be modified:
    /// a page no one else holds yet (`Arc::get_mut` succeeds on it).
    fn page_for_update(
        &self,
        io: &Backing,
        state: &RwLock<VolumeState>,
        page_no: u64,
    ) -> Result<Page> {
        let mut page = Page::new([0u8; 4096]);
        let bytes = unique(&mut page);
        // (The state lock is released before a read from disk.)
        let cached = state.read().contexts().cached_page(page_no);
        match cached {
            Some(cached) => bytes.copy_from_slice(&cached[..]),
            None => *bytes = crate::state::read_context_page(io, page_no)?,
        }
        Ok(page)
    }

    /// A range's contexts: whole pages of holes are punched (returned as
    /// page ranges), edge pages are modified in `pages`. `next`: the
    /// checkpoint's next generation.
    fn write_context_range(
        &self,
        io: &Backing,
        state: &RwLock<VolumeState>,
        (start, end, template): (u64, u64, Context),
        (pages, next): (&mut BTreeMap<u64, Page>, u32),
    ) -> Result<Vec<Range<u64>>> {
        let mut punched = Vec::new();
        let mut lba = start;
        while lba < end {
            let page_no = ContextStore::page_of(lba);
            let page_end = ((page_no + 1) * CONTEXTS_PER_PAGE).min(end);
            if lba.is_multiple_of(CONTEXTS_PER_PAGE)
                && page_end - lba == CONTEXTS_PER_PAGE
                && matches!(template, Context::Unwritten)
            {
                let whole = (end - lba) / CONTEXTS_PER_PAGE;
                // Cleared before the pages are blank (`written.rs`). Each
                // expects the checkpoint's next generation: a punched page
                // holds nothing as old as that, so an older copy of it
                // restored later (contexts of older generations under a
                // clear bit) is judged older at its load, not read as the
                // data it held then. On disk with this checkpoint's map,
                // after the punch is fsynced; a crash before it replays
                // the trim, and recovery forgets the page's value. Every
                // stripe is odd meanwhile: a reader that loaded a page's
                // contexts before the trim committed must not judge them
                // against the value set here (`WrittenMap::judge_page`).
                // The value is set once the punch returns: a punch that
                // failed leaves the page's records under a value that
                // would make them read as older.
                io.written.begin_page_writes();
                for page in page_no..page_no + whole {
                    io.written.clear(page);
                }
                let punch = io.punch(ObjectId::Contexts, page_no * 4096, whole * 4096);
                if punch.is_ok() {
                    for page in page_no..page_no + whole {
                        io.written.set_expected_generation(page, next);
                    }
                }
                io.written.end_page_writes();
                punch?;
                pages.retain(|page, _| !(page_no..page_no + whole).contains(page));
                punched.push(page_no..page_no + whole);
                lba += whole * CONTEXTS_PER_PAGE;
                continue;
            }
            if let std::collections::btree_map::Entry::Vacant(entry) = pages.entry(page_no) {
                entry.insert(self.page_for_update(io, state, page_no)?);
            }
            let page = unique(pages.get_mut(&page_no).expect("inserted above"));
            for block in lba..page_end {
                let at = (block % CONTEXTS_PER_PAGE) as usize * CONTEXT_BYTES;
                page[at..at + CONTEXT_BYTES]
                    .copy_from_slice(&context_in_range(template, block).encode());
            }
            lba = page_end;
        }
        Ok(punched)
    }

    /// Replay one block of a redo record from the journal's copy: its
    /// context, and (read-only) its data into the write-back buffer; a
    /// writable open writes the data home after the pass (`write_redone`).
    fn redo_block(
        &self,
        io: &Backing,
        state: &mut VolumeState,
        protection: &dyn Protection,
        entry: &JournalEntry,
        data: &[u8],
    ) -> Result<()> {
        if io.is_read_only() {
            let Some(seal) = protection.seal_of(&entry.context) else {
                return Err(Error::Corrupt(format!(
                    "journal record holds a {:?} context for LBA {}, which this volume does not write",
                    entry.context.kind(),
                    entry.lba
                )));
            };
            state.buffer(
                entry.lba,
                DirtyBlock {
                    data: BlockData::copy_from(data),
                    seal,
                },
            );
        }
        state.contexts_mut().set(entry.lba, entry.context);
        Ok(())
    }

    /// Write the blocks a replay redid home, from the journal's copies:
    /// one write per run of adjacent blocks. Not synced here: `unsynced`
    /// is the journal's redo set, synced by the next checkpoint or plain
    /// commit (`recovery.rs`); the records hold the data until then.
    fn write_redone(
        &self,
        io: &Backing,
        unsynced: &mut BTreeSet<ObjectId>,
        redo: &[(u64, &[u8])],
    ) -> Result<()> {
        // Each block is redone from one record, its last: distinct LBAs.
        let blocks: BTreeMap<u64, &[u8]> = redo.iter().copied().collect();
        let mut lbas = blocks.keys().copied().peekable();
        while let Some(first) = lbas.next() {
            let location = self.geometry.locate(first);
            let segment_end = (u64::from(location.segment) + 1) * self.geometry.segment_blocks;
            let mut parts = vec![blocks[&first]];
            let mut end = first + 1;
            while parts.len() < IOV_MAX && end < segment_end && lbas.next_if_eq(&end).is_some() {
                parts.push(blocks[&end]);
                end += 1;
            }
            let object = ObjectId::Data(location.segment);
            io.write_runs(
                object,
                &[Run {
                    offset: location.data_offset,
                    parts: &parts,
                }],
            )?;
            unsynced.insert(object);
        }
        Ok(())
    }
}

/// A block an unverified commit wrote, as the replay found it.
struct Candidate {
    /// Its context before the replayed records.
    before: Before,
    /// The contexts those records wrote, oldest first: the first, then
    /// any later ones (most blocks have one: no allocation for it).
    first: Context,
    later: Vec<Context>,
}

enum Before {
    /// Known in memory (the overlay, a range, a cached page); `None` if the
    /// stored one is corrupt: a corrupt context is no candidate for what
    /// the block holds (taking it as a hole would always "match" and turn
    /// a block whose rewrite was lost into zeros instead of a fault).
    Known(Option<Context>),
    /// In its page of the table on disk, read after the pass with every
    /// other such page (`load_pages_of`). Nothing writes the table during
    /// a replay, so the page then holds what it held when the block was
    /// first met.
    OnDisk,
}

impl Candidate {
    /// Block `lba`, first written by a replayed record with `first`.
    fn new(state: &VolumeState, lba: u64, first: Context) -> Candidate {
        let before = match state.contexts().lookup(lba) {
            Lookup::Found(found) => Before::Known(found.ok()),
            Lookup::NeedPage(_) => Before::OnDisk,
        };
        Candidate {
            before,
            first,
            later: Vec::new(),
        }
    }

    fn newest(&self) -> Context {
        *self.later.last().unwrap_or(&self.first)
    }
}

/// Most context pages one read of a replay loads (1 MiB).
const PAGE_RUN_MAX: u64 = 256;

/// The table pages holding the older contexts of `candidates` that are
/// on disk, loaded (and cached) a run of adjacent pages per read.
fn load_pages_of(
    io: &Backing,
    state: &RwLock<VolumeState>,
    candidates: &BTreeMap<u64, Candidate>,
) -> Result<BTreeMap<u64, Page>> {
    let wanted: BTreeSet<u64> = candidates
        .iter()
        .filter(|(_, candidate)| matches!(candidate.before, Before::OnDisk))
        .map(|(lba, _)| ContextStore::page_of(*lba))
        .collect();
    let mut pages = BTreeMap::new();
    let mut wanted = wanted.into_iter().peekable();
    while let Some(first) = wanted.next() {
        let mut end = first + 1;
        while end - first < PAGE_RUN_MAX && wanted.next_if_eq(&end).is_some() {
            end += 1;
        }
        let loaded = crate::state::load_context_pages(io, state, first..end)?;
        pages.extend((first..end).zip(loaded));
    }
    Ok(pages)
}

/// The largest read back of candidates (1 MiB).
const READ_RUN_MAX_BLOCKS: u64 = 256;

/// The runs of LBAs a replay reads back to verify `lbas` (ascending):
/// adjacent candidates within one data segment. Not across gaps: a gap
/// read costs more than the read it saves (a sparse data file's holes are
/// allocated in the page cache to be read; gaps of up to 8 blocks doubled
/// a replay's CPU time in a busy sample, docs/BENCHMARKS.md stop 39).
fn read_runs(geometry: &Geometry, lbas: impl Iterator<Item = u64>) -> Vec<Range<u64>> {
    let mut runs: Vec<Range<u64>> = Vec::new();
    for lba in lbas {
        match runs.last_mut() {
            Some(run)
                if lba == run.end
                    && lba + 1 - run.start <= READ_RUN_MAX_BLOCKS
                    && lba / geometry.segment_blocks == run.start / geometry.segment_blocks =>
            {
                run.end = lba + 1;
            }
            _ => runs.push(lba..lba + 1),
        }
    }
    runs
}

impl Layout for SplitLayout {
    fn kind(&self) -> LayoutKind {
        LayoutKind::Split
    }

    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    fn journals_data(&self) -> bool {
        false
    }

    fn contexts_in_table(&self) -> bool {
        true
    }

    fn plan(&self, lba: u64, contexts: &ContextStore) -> Planned {
        match contexts.lookup(lba) {
            Lookup::Found(found) => Planned::from_context(found),
            Lookup::NeedPage(page) => Planned::NeedPage(page),
        }
    }

    fn read_run(
        &self,
        io: &Backing,
        first: u64,
        _count: u64,
        out: &mut [u8],
        wait: Wait,
    ) -> std::io::Result<Vec<Result<Context, FormatError>>> {
        let location = self.geometry.locate(first);
        io.try_read_with(
            ObjectId::Data(location.segment),
            location.data_offset,
            out,
            wait,
        )?;
        Ok(Vec::new())
    }

    fn run_span(&self, first: u64, count: u64) -> RunSpan {
        let location = self.geometry.locate(first);
        RunSpan {
            object: ObjectId::Data(location.segment),
            offset: location.data_offset,
            len: (count * BLOCK) as usize,
        }
    }

    fn run_from_span(
        &self,
        _io: &Backing,
        _first: u64,
        _count: u64,
        span: &[u8],
        out: &mut [u8],
    ) -> Vec<Result<Context, FormatError>> {
        out.copy_from_slice(span);
        Vec::new()
    }

    fn read_block(
        &self,
        io: &Backing,
        lba: u64,
        block: &mut [u8],
    ) -> std::io::Result<Option<Result<Context, FormatError>>> {
        let location = self.geometry.locate(lba);
        io.try_read(
            ObjectId::Data(location.segment),
            location.data_offset,
            block,
        )?;
        Ok(None)
    }

    fn write_home(
        &self,
        io: &Backing,
        blocks: &[(u64, DirtyBlock)],
        _contexts: &[Context],
        unsynced: &mut BTreeSet<ObjectId>,
    ) -> Result<()> {
        // Runs of consecutive LBAs, each one write straight from the
        // buffered blocks (into the page cache at most 256 KiB per call:
        // `PAGE_CACHE_PIECE`); all of them submitted as one batch per object.
        let mut runs: Vec<(ObjectId, u64, Vec<&[u8]>)> = Vec::new();
        let mut index = 0;
        while index < blocks.len() {
            let mut end = index + 1;
            while end < blocks.len() && self.geometry.contiguous(blocks[end - 1].0, blocks[end].0) {
                end += 1;
            }
            let location = self.geometry.locate(blocks[index].0);
            let parts = blocks[index..end]
                .iter()
                .map(|(_, dirty)| &dirty.data[..])
                .collect();
            runs.push((
                ObjectId::Data(location.segment),
                location.data_offset,
                parts,
            ));
            index = end;
        }
        super::write_runs_by_object(io, &runs, unsynced)
    }

    fn apply_range_home(
        &self,
        io: &Backing,
        range: &RangeOp,
        unsynced: &mut BTreeSet<ObjectId>,
    ) -> Result<()> {
        // Punch the data of holes; the context change waits for the checkpoint.
        super::for_each_segment(&self.geometry, range.start, range.end, |lba, end| {
            let location = self.geometry.locate(lba);
            let object = ObjectId::Data(location.segment);
            if matches!(range.template, Context::Unwritten) {
                io.punch(object, location.data_offset, (end - lba) * BLOCK)?;
            }
            unsynced.insert(object);
            Ok(())
        })
    }

    /// A unit whose bit is set counts too: its page may be lost, and a
    /// hole on disk must not hide that from a scan.
    fn next_data_on_disk(&self, io: &Backing, lba: u64) -> Result<Option<u64>> {
        let offset = lba * CONTEXT_BYTES as u64;
        let on_disk = io
            .seek_data(ObjectId::Contexts, offset)?
            .map(|at| (at / CONTEXT_BYTES as u64).max(lba));
        Ok([on_disk, io.written.next_set_lba(lba)]
            .into_iter()
            .flatten()
            .min())
    }

    fn unit_place(&self, unit: u64) -> UnitPlace {
        UnitPlace {
            object: ObjectId::Contexts,
            offset: unit * 4096,
            len: 4096,
            name: format!("page {unit}"),
        }
    }

    fn unit_metadata(&self, bytes: &[u8]) -> Vec<[u8; CONTEXT_BYTES]> {
        bytes
            .chunks_exact(CONTEXT_BYTES)
            .map(|slot| slot.try_into().expect("32 bytes"))
            .collect()
    }

    fn unit_slots<'a>(&self, bytes: &'a mut [u8]) -> Vec<&'a mut [u8]> {
        bytes.chunks_exact_mut(CONTEXT_BYTES).collect()
    }

    fn unit_records<'a>(&self, bytes: &'a [u8]) -> Vec<(&'a [u8], Option<&'a [u8]>)> {
        bytes
            .chunks_exact(CONTEXT_BYTES)
            .map(|slot| (slot, None))
            .collect()
    }

    fn stored_contexts(
        &self,
        io: &Backing,
        state: &RwLock<VolumeState>,
        first: u64,
        buffered: &[bool],
    ) -> Result<Vec<StoredContext>> {
        let mut found = Vec::with_capacity(buffered.len());
        for (index, is_buffered) in buffered.iter().enumerate() {
            found.push(if *is_buffered {
                StoredContext::Buffered
            } else {
                match lookup_loading(io, state, first + index as u64) {
                    Ok(Ok(context)) => StoredContext::Stored(context),
                    // An unreadable page or a context that does not decode.
                    _ => StoredContext::Unknown,
                }
            });
        }
        Ok(found)
    }

    /// A redo record (a flush's small commit) needs every data block its
    /// entries name; other records carry contexts only.
    fn check_record(&self, record: &Record) -> std::result::Result<(), String> {
        if !record.header.has_data() {
            return Ok(());
        }
        let data_entries = record
            .entries
            .iter()
            .filter(|entry| entry.count == 1 && entry.context.carries_data())
            .count();
        if data_entries != record.header.data_blocks as usize {
            return Err(format!(
                "{data_entries} data entries but {} data blocks",
                record.header.data_blocks
            ));
        }
        Ok(())
    }

    fn replay(&self, replay: Replay<'_>, records: &[Record]) -> Result<Vec<JournalEntry>> {
        let Replay {
            io,
            protection,
            state,
            unsynced,
            report,
        } = replay;
        let Some(last) = records.last() else {
            return Ok(Vec::new());
        };
        // The checkpoint a replayed trim preceded may have left its pages
        // blank before the crash, with the map on disk still set: their
        // bits are cleared before any page is loaded (`written.rs`).
        clear_trimmed_units(io, records);
        forget_replayed_generations(io, records);
        let verify_after = last.header.data_durable_seq;
        let redo_last = last_records_of_redo_blocks(records);
        // For each block an unverified commit wrote: where its context
        // before the replay is, and the contexts the commits wrote.
        let mut candidates: BTreeMap<u64, Candidate> = BTreeMap::new();
        // Blocks redone from the journal's copy, written home after the pass.
        let mut redo: Vec<(u64, &[u8])> = Vec::new();
        {
            // One pass over the records under one lock, no I/O in it: the
            // pages holding candidates' older contexts are read after it,
            // in runs, and redone blocks written in runs (a journal of many
            // small records costs what its blocks do, not a read or a write
            // per record's block).
            let mut state = state.write();
            for record in records {
                let mut data_index = 0usize;
                for entry in &record.entries {
                    if entry.count == 1 && entry.context.carries_data() {
                        if record.header.has_data() {
                            let data = record_data(&record.header, &record.bytes, data_index);
                            data_index += 1;
                            // The last record to touch the block holds its
                            // copy: redo it (a redo record that a later
                            // record overwrote had its blocks home before
                            // that one).
                            if redo_last.get(&entry.lba) == Some(&record.header.seq) {
                                candidates.remove(&entry.lba);
                                self.redo_block(io, &mut state, protection, entry, data)?;
                                redo.push((entry.lba, data));
                                continue;
                            }
                        }
                        if record.header.seq > verify_after {
                            match candidates.entry(entry.lba) {
                                Entry::Occupied(mut known) => {
                                    known.get_mut().later.push(entry.context);
                                }
                                Entry::Vacant(vacant) => {
                                    vacant.insert(Candidate::new(&state, entry.lba, entry.context));
                                }
                            }
                        }
                        state.contexts_mut().set(entry.lba, entry.context);
                    } else {
                        let end = entry.lba + u64::from(entry.count);
                        state
                            .contexts_mut()
                            .set_range(entry.lba, end, entry.context);
                        let superseded: Vec<u64> = candidates
                            .range(entry.lba..end)
                            .map(|(lba, _)| *lba)
                            .collect();
                        for lba in superseded {
                            candidates.remove(&lba);
                        }
                    }
                }
            }
        }
        if !io.is_read_only() {
            self.write_redone(io, unsynced, &redo)?;
        }
        let pages = load_pages_of(io, state, &candidates)?;
        let mut resolutions = Vec::new();
        let mut run_bytes: Vec<u8> = Vec::new();
        let mut single: Box<Block> = Box::new([0u8; BLOCK as usize]);
        for run in read_runs(&self.geometry, candidates.keys().copied()) {
            let location = self.geometry.locate(run.start);
            let object = ObjectId::Data(location.segment);
            run_bytes.resize(((run.end - run.start) * BLOCK) as usize, 0);
            let whole = io
                .try_read(object, location.data_offset, &mut run_bytes)
                .is_ok();
            if whole {
                io.stats.add_read(run_bytes.len() as u64);
            }
            for (lba, candidate) in candidates.range(run.clone()) {
                report.blocks_verified += 1;
                let block: &[u8] = if whole {
                    let at = ((lba - run.start) * BLOCK) as usize;
                    &run_bytes[at..at + BLOCK as usize]
                } else {
                    // The run's read failed: each of its blocks alone, so
                    // only those that cannot be read are faults.
                    let location = self.geometry.locate(*lba);
                    let read = io.read_object(
                        ObjectId::Data(location.segment),
                        location.data_offset,
                        &mut single[..],
                    );
                    if let Err(error) = read {
                        // Not knowing what landed, keep the newest context:
                        // reads of this block then report the fault with
                        // its LBA instead of recovery silently deciding it
                        // was an old hole.
                        tracing::warn!(lba, %error, "block unreadable during recovery: it will read as a fault");
                        report.blocks_unreadable.push(*lba);
                        continue;
                    }
                    &single[..]
                };
                let before = match candidate.before {
                    Before::Known(before) => before,
                    Before::OnDisk => {
                        let page = &pages[&ContextStore::page_of(*lba)];
                        crate::state::context_in_page(page, *lba).ok()
                    }
                };
                let newest = candidate.newest();
                let chosen = before
                    .iter()
                    .chain(std::iter::once(&candidate.first))
                    .chain(&candidate.later)
                    .rev()
                    .find(|context| protection.matches(context, block));
                match chosen {
                    Some(context) if *context == newest => {}
                    Some(context) => {
                        report.blocks_reverted += 1;
                        state.write().contexts_mut().set(*lba, *context);
                        resolutions.push(JournalEntry {
                            lba: *lba,
                            count: 1,
                            context: *context,
                        });
                    }
                    None => {
                        tracing::warn!(
                            lba,
                            "block torn by the crash: it will read as a fault until rewritten"
                        );
                        report.blocks_torn.push(*lba);
                    }
                }
            }
        }
        Ok(resolutions)
    }

    /// Write ranges, then overlay entries in page order, into the context
    /// table, one page at a time (memory stays bounded), then fsync it.
    fn checkpoint_contexts(
        &self,
        io: &Backing,
        state: &RwLock<VolumeState>,
        next: u32,
    ) -> Result<(WrittenPages, Vec<Range<u64>>)> {
        // The overlay's entries, and its runs of entries of one page: its
        // hash keeps a page's blocks in adjacent buckets, so a page's
        // entries come out together (or in a few runs), and sorting the
        // runs by page groups them without sorting a million entries.
        let (entries, mut runs, ranges, keep) = {
            let state = state.read();
            let overlay = &state.contexts().overlay;
            let mut entries: Vec<(u64, Context)> = Vec::with_capacity(overlay.len());
            let mut runs: Vec<PageRun> = Vec::new();
            for (lba, context) in overlay {
                let page_no = ContextStore::page_of(*lba);
                match runs.last_mut() {
                    Some(run) if run.page_no == page_no => run.len += 1,
                    _ => runs.push(PageRun {
                        page_no,
                        start: entries.len(),
                        len: 1,
                    }),
                }
                entries.push((*lba, *context));
            }
            let keep = state.contexts().cache_limit_pages();
            (entries, runs, state.contexts().ranges.clone(), keep)
        };
        runs.sort_unstable_by_key(|run| run.page_no);
        let mut punched = Vec::new();
        let mut edge_pages: BTreeMap<u64, Page> = BTreeMap::new();
        for (&start, &(end, template)) in &ranges {
            punched.extend(self.write_context_range(
                io,
                state,
                (start, end, template),
                (&mut edge_pages, next),
            )?);
        }
        // Pages are built and written in page order (entries' pages and
        // the ranges' edge pages merged), a batch at a time, so the
        // checkpoint holds at most a batch and the pages the cache can
        // keep, however many it writes.
        let mut pages = CheckpointPages::new(keep, next);
        for page_runs in runs.chunk_by(|a, b| a.page_no == b.page_no) {
            let page_no = page_runs[0].page_no;
            while let Some(edge) = edge_pages.first_entry() {
                if *edge.key() >= page_no {
                    break;
                }
                let (edge_no, edge) = edge.remove_entry();
                pages.push(io, edge_no, edge)?;
            }
            // LBAs are the overlay's keys: distinct.
            let new_contexts: usize = page_runs.iter().map(|run| run.len).sum();
            let mut page = match edge_pages.remove(&page_no) {
                Some(page) => page,
                // Every context of the page is new, or it was punched just
                // now (its cached copy predates the trim): nothing to keep.
                None if new_contexts == CONTEXTS_PER_PAGE as usize
                    || punched.iter().any(|range| range.contains(&page_no)) =>
                {
                    Page::new([0u8; 4096])
                }
                None => self.page_for_update(io, state, page_no)?,
            };
            let bytes = unique(&mut page);
            for run in page_runs {
                for (lba, context) in &entries[run.start..run.start + run.len] {
                    let at = (lba % CONTEXTS_PER_PAGE) as usize * CONTEXT_BYTES;
                    bytes[at..at + CONTEXT_BYTES].copy_from_slice(&context.encode());
                }
            }
            pages.push(io, page_no, page)?;
        }
        for (edge_no, edge) in edge_pages {
            pages.push(io, edge_no, edge)?;
        }
        let rewritten = pages.finish(io)?;
        io.sync_object(ObjectId::Contexts)?;
        Ok((rewritten, punched))
    }
}

/// The pages a checkpoint writes, in batches of up to `IOV_MAX` written
/// as runs of adjacent pages (one `pwritev` each). Of the pages written,
/// only the content of the last `keep` (what the context cache can hold)
/// is kept, to be cached (`ContextStore::clear_pending`); the others are
/// named only, so the cache drops any older copy of them.
struct CheckpointPages {
    batch: Vec<(u64, Page)>,
    written: WrittenPages,
    /// `written[first_kept..]` have their content.
    first_kept: usize,
    keep: usize,
    /// The checkpoint's next generation: the value of a page it leaves
    /// blank (no context of the page as it was is as new).
    next: u32,
}

impl CheckpointPages {
    fn new(keep: usize, next: u32) -> CheckpointPages {
        CheckpointPages {
            batch: Vec::with_capacity(IOV_MAX),
            written: Vec::new(),
            first_kept: 0,
            keep,
            next,
        }
    }

    fn push(&mut self, io: &Backing, page_no: u64, page: Page) -> Result<()> {
        if page.iter().all(|byte| *byte == 0) {
            // A blank page: its bit is cleared before it is written.
            io.written.clear(page_no);
        }
        self.batch.push((page_no, page));
        if self.batch.len() == IOV_MAX {
            self.write_batch(io)?;
        }
        Ok(())
    }

    fn write_batch(&mut self, io: &Backing) -> Result<()> {
        // In memory a never-written slot is blank; on disk, in a page that
        // is not blank, it is its vacant marker (units are whole: a blank
        // slot of a written page is then lost, `WrittenMap::judge_page`).
        // Written in the same run as the page's other slots, so the page
        // is whole on disk whenever its bit is set.
        let on_disk: Vec<Option<Box<[u8; 4096]>>> = self
            .batch
            .iter()
            .map(|(page_no, page)| {
                if !io.written.bound() {
                    return None;
                }
                let mut copy = Box::new(**page);
                let mut slots: Vec<&mut [u8]> = copy.chunks_mut(CONTEXT_BYTES).collect();
                io.written
                    .bind_slots(
                        (page_no * CONTEXTS_PER_PAGE, io.geometry.blocks),
                        &mut slots,
                        (false, 0),
                    )
                    .then_some(copy)
            })
            .collect();
        let mut runs_parts: Vec<Vec<&[u8]>> = Vec::new();
        let mut offsets = Vec::new();
        for (index, (page_no, page)) in self.batch.iter().enumerate() {
            let bytes = on_disk[index].as_deref().unwrap_or(&**page);
            if index > 0 && self.batch[index - 1].0 + 1 == *page_no {
                runs_parts.last_mut().expect("a run").push(&bytes[..]);
            } else {
                runs_parts.push(vec![&bytes[..]]);
                offsets.push(page_no * 4096);
            }
        }
        let runs: Vec<Run<'_>> = offsets
            .iter()
            .zip(&runs_parts)
            .map(|(offset, parts)| Run {
                offset: *offset,
                parts,
            })
            .collect();
        // Readers that load a page meanwhile do not judge it older
        // (`WrittenMap::judge_page`): they may read it before this write
        // and see its expected generation after.
        io.written.begin_page_writes();
        let wrote = io.write_runs(ObjectId::Contexts, &runs);
        if let Err(error) = wrote {
            io.written.end_page_writes();
            return Err(error);
        }
        for (page_no, page) in &self.batch {
            // Set once the page is written; on disk with the checkpoint's
            // map, after the contexts' fsync (`written.rs`). So is the
            // page's generation: the map on disk is never newer than the
            // page, and after a crash before it is written, recovery
            // forgets the generation of every page the journal touches
            // (`forget_replayed_generations`), so a page that a checkpoint
            // made older (a trim or a copy of its newest block) is never
            // judged an older copy.
            if page.iter().any(|byte| *byte != 0) {
                io.written.set(*page_no);
                io.written.set_expected_generation(
                    *page_no,
                    io.written.page_generation(*page_no, &page[..]),
                );
            } else {
                // Left blank (by trims in pieces, say): as a page punched
                // whole, it expects the checkpoint's next generation, so
                // an older copy of it restored later is judged older.
                io.written.set_expected_generation(*page_no, self.next);
            }
        }
        io.written.end_page_writes();
        let batch = self
            .batch
            .drain(..)
            .map(|(page_no, page)| (page_no, Some(page)));
        self.written.extend(batch);
        while self.written.len() - self.first_kept > self.keep {
            self.written[self.first_kept].1 = None;
            self.first_kept += 1;
        }
        Ok(())
    }

    /// Write the last batch; every page written.
    fn finish(mut self, io: &Backing) -> Result<WrittenPages> {
        if !self.batch.is_empty() {
            self.write_batch(io)?;
        }
        Ok(self.written)
    }
}

/// Entries `[start, start + len)` of a checkpoint's overlay entries, all
/// of context page `page_no`.
struct PageRun {
    page_no: u64,
    start: usize,
    len: usize,
}

/// For every block a redo record (one carrying data) holds: the sequence
/// number of the last record that touches it, a redo record, a plain one
/// or a range.
fn last_records_of_redo_blocks(records: &[Record]) -> BTreeMap<u64, u64> {
    let mut last: BTreeMap<u64, u64> = BTreeMap::new();
    for record in records.iter().filter(|record| record.header.has_data()) {
        for entry in &record.entries {
            if entry.count == 1 && entry.context.carries_data() {
                last.insert(entry.lba, 0);
            }
        }
    }
    if last.is_empty() {
        return last;
    }
    for record in records {
        for entry in &record.entries {
            let end = entry.lba.saturating_add(u64::from(entry.count));
            for (_, seq) in last.range_mut(entry.lba..end) {
                *seq = record.header.seq;
            }
        }
    }
    last
}

/// Clear the written-map bit of every unit a trim in `records` touches
/// (recovery, before anything is read: `written.rs`).
pub(super) fn clear_trimmed_units(io: &Backing, records: &[Record]) {
    for record in records {
        for entry in &record.entries {
            if matches!(entry.context, Context::Unwritten) {
                io.written
                    .clear_touched(entry.lba, entry.lba + u64::from(entry.count));
            }
        }
    }
}

/// Forget the expected generation of every unit an entry of `records`
/// touches (recovery, before anything is read): a checkpoint interrupted
/// after writing pages and before writing the map leaves pages newer than
/// the map — or older, where a trim or a copy (which keeps its source's
/// generation) replaced a page's newest context; packed records written
/// since the last checkpoint may have done the same to their rows. Each
/// is known again once the next checkpoint writes the page (packed: the
/// next record written into the row).
pub(super) fn forget_replayed_generations(io: &Backing, records: &[Record]) {
    for record in records {
        for entry in &record.entries {
            io.written
                .forget_generations(entry.lba, entry.lba + u64::from(entry.count.max(1)));
        }
    }
}

/// The bytes of a page this checkpoint built and no one else holds yet.
fn unique(page: &mut Page) -> &mut [u8; 4096] {
    Arc::get_mut(page).expect("a page being built is not shared yet")
}
