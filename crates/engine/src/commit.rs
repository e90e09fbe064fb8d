//! Commits and checkpoints: the crash ordering of every write.
//!
//! Commit N (under `commit_lock`):
//!   1. swap the write-back buffer into `committing` (reads still see it);
//!   2. append journal record N (new contexts; in the packed layout also the
//!      data) and fsync the journal.            -- ORDER POINT A
//!   3. write data (split) or records (packed) to their home, and apply range
//!      operations (hole punches); no fsync here.
//!   4. publish the new contexts (split: into the overlay) and drop
//!      `committing`.
//!
//! A crash before A loses commit N entirely: none of its data reached home,
//! so every block reads its old contents. A crash after A: recovery knows
//! every block commit N touched. Split: it reads each back and keeps the
//! newest context its data matches (old or new; a block matching neither
//! was torn by the media and is reported as a fault). Packed: it redoes the
//! record from the journal's copy.
//!
//! Flush = commit + fsync of every data object written since the last sync
//! (ORDER POINT B). The next journal record carries `data_durable_seq`, so
//! recovery verifies only commits after the last point B.
//!
//! Checkpoint (journal nearly full, overlay large, or close):
//!   1. fsync data (B);  2. split: write overlay and ranges into `contexts`,
//!      fsync;  3. write the older superblock copy with `checkpoint_seq` =
//!      last commit, fsync;  4. restart the journal at offset 0.
//!
//! A crash before 3 completes replays the journal from the previous
//! checkpoint onto `contexts`: replay writes absolute values, so it is
//! idempotent. Old records left in the journal carry lower sequence numbers
//! and end the replay.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::Ordering;

use vouch_format::journal::{encode_record, JournalHeader};
use vouch_format::layout::{PACKED_RECORDS_PER_ROW, PACKED_RECORD_BYTES, PACKED_ROW_BYTES};
use vouch_format::superblock::STATE_OPEN;
use vouch_format::{Context, JournalEntry, LayoutKind, Superblock, CONTEXT_BYTES};

use crate::contexts::{context_in_range, ContextStore, Page, CONTEXTS_PER_PAGE};
use crate::error::{Error, Result};
use crate::storage::{ObjectId, Run};
use crate::volume::{write_superblock_copy, CommitState, Core, DirtyBlock, BLOCK};

/// A trim or write-zeroes over whole blocks `[start, end)`.
#[derive(Clone, Copy, Debug)]
pub struct RangeOp {
    pub start: u64,
    pub end: u64,
    /// `Unwritten` (hole) or `Zero` (allocated zeroes); ref tag filled per block.
    pub template: Context,
}

/// Context pages a checkpoint wrote, with their new content when cached.
type WrittenPages = Vec<(u64, Option<Page>)>;

/// The unused bytes at the end of a packed row (zero on disk).
static ROW_PADDING: [u8; (PACKED_ROW_BYTES - PACKED_RECORDS_PER_ROW * PACKED_RECORD_BYTES)
    as usize] = [0; (PACKED_ROW_BYTES - PACKED_RECORDS_PER_ROW * PACKED_RECORD_BYTES) as usize];

/// Largest block count one journal entry may carry.
const MAX_RANGE_ENTRY_BLOCKS: u64 = u32::MAX as u64;

impl Core {
    pub(crate) fn data_context(&self, lba: u64, guard: u64, seq: u64) -> Context {
        Context::Data {
            volume_tag: self.volume_tag,
            ref_tag: lba,
            guard,
            generation: seq as u32,
        }
    }

    /// Commit the write-back buffer and `ranges` (see the module comment).
    pub(crate) fn commit(&self, commit: &mut CommitState, ranges: &[RangeOp]) -> Result<()> {
        self.check_writable()?;
        let blocks: Vec<(u64, DirtyBlock)> = {
            let mut state = self.state.write();
            assert!(state.committing.is_empty(), "a commit is already in flight");
            state.committing = std::mem::take(&mut state.active);
            state
                .committing
                .iter()
                .map(|(lba, dirty)| (*lba, dirty.clone()))
                .collect()
        };
        if blocks.is_empty() && ranges.is_empty() {
            return Ok(());
        }
        let result = self.commit_blocks(commit, &blocks, ranges);
        match result {
            Ok(seq) => {
                let mut state = self.state.write();
                if self.geometry.layout == LayoutKind::Split {
                    for (lba, dirty) in &blocks {
                        state
                            .contexts
                            .set(*lba, self.data_context(*lba, dirty.guard, seq));
                    }
                }
                state.committing.clear();
                let pending = state.contexts.pending();
                drop(state);
                self.stats.commits.fetch_add(1, Ordering::Relaxed);
                let journal_full = commit.journal_offset * 4 > self.journal_bytes * 3;
                if journal_full || pending > self.tuning.overlay_limit {
                    self.checkpoint(commit, STATE_OPEN)?;
                }
                Ok(())
            }
            // The buffered blocks stay in `committing`, so reads still return
            // what was acknowledged; writes are refused until reopened.
            Err(error) => Err(self.fail_stop(error)),
        }
    }

    /// Returns the sequence number whose generation the new contexts carry.
    fn commit_blocks(
        &self,
        commit: &mut CommitState,
        blocks: &[(u64, DirtyBlock)],
        ranges: &[RangeOp],
    ) -> Result<u64> {
        let seq = commit.next_seq;
        let mut entries = Vec::with_capacity(blocks.len() + ranges.len());
        for (lba, dirty) in blocks {
            // A buffer corrupted in memory after its guard was computed is
            // still caught: the context carries the guard of the bytes the
            // client sent, so the read of the home copy fails with this
            // LBA. Re-checking here on every commit (a second CRC of every
            // block) is left to debug builds.
            debug_assert_eq!(
                self.guard.compute(&dirty.data[..]),
                dirty.guard,
                "buffered block {lba} changed in memory"
            );
            entries.push(JournalEntry {
                lba: *lba,
                count: 1,
                context: self.data_context(*lba, dirty.guard, seq),
            });
        }
        for range in ranges {
            let mut start = range.start;
            while start < range.end {
                let count = (range.end - start).min(MAX_RANGE_ENTRY_BLOCKS);
                entries.push(JournalEntry {
                    lba: start,
                    count: count as u32,
                    context: context_in_range(range.template, start),
                });
                start += count;
            }
        }
        let data: Option<Vec<&[u8]>> = (self.geometry.layout == LayoutKind::Packed)
            .then(|| blocks.iter().map(|(_, dirty)| &dirty.data[..]).collect());
        self.append_journal(commit, &entries, data.as_deref())?;
        // ORDER POINT A passed: home writes may now reach the disk in any order.
        if self.geometry.layout == LayoutKind::Split && !ranges.is_empty() {
            // Publish trims before punching their data: a reader must never
            // see punched data under the block's old context.
            let mut state = self.state.write();
            for range in ranges {
                state
                    .contexts
                    .set_range(range.start, range.end, range.template);
            }
        }
        match self.geometry.layout {
            LayoutKind::Split => self.write_split_home(commit, blocks)?,
            LayoutKind::Packed => self.write_packed_home(commit, blocks, seq)?,
        }
        for range in ranges {
            self.apply_range_home(commit, range)?;
        }
        Ok(seq)
    }

    /// Write one journal record (splitting oversized commits) and fsync it.
    pub(crate) fn append_journal(
        &self,
        commit: &mut CommitState,
        entries: &[JournalEntry],
        data: Option<&[&[u8]]>,
    ) -> Result<()> {
        let record_len =
            JournalHeader::record_bytes(entries.len() as u32, data.map_or(0, |d| d.len() as u32));
        if record_len > self.journal_bytes / 2 {
            // Too large for one record: split in halves (rare: only when the
            // buffer overran its limit while another commit ran).
            let half = entries.len() / 2;
            let data_half = data.map(|d| {
                let count = entries[..half]
                    .iter()
                    .filter(|e| matches!(e.context, Context::Data { .. }))
                    .count();
                d.split_at(count)
            });
            self.append_journal(commit, &entries[..half], data_half.map(|(a, _)| a))?;
            return self.append_journal(commit, &entries[half..], data_half.map(|(_, b)| b));
        }
        if commit.journal_offset + record_len > self.journal_bytes {
            self.checkpoint(commit, STATE_OPEN)?;
        }
        let seq = commit.next_seq;
        let record = encode_record(seq, self.uuid, commit.data_durable_seq, entries, data);
        let offset = commit.journal_offset;
        self.write_object(ObjectId::Journal, offset, &record)?;
        self.sync_object(ObjectId::Journal)?;
        commit.journal_offset += record.len() as u64;
        commit.next_seq += 1;
        Ok(())
    }

    fn write_split_home(
        &self,
        commit: &mut CommitState,
        blocks: &[(u64, DirtyBlock)],
    ) -> Result<()> {
        // Runs of consecutive LBAs, each one write straight from the
        // buffered blocks; all of them submitted as one batch.
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
        self.write_home_runs(commit, &runs)
    }

    fn write_packed_home(
        &self,
        commit: &mut CommitState,
        blocks: &[(u64, DirtyBlock)],
        seq: u64,
    ) -> Result<()> {
        // Records straight from the buffered blocks: each block's data, then
        // its encoded context, and the zero padding at a row's end when a run
        // crosses into the next row. Nothing is copied here.
        let contexts: Vec<[u8; CONTEXT_BYTES]> = blocks
            .iter()
            .map(|(lba, dirty)| self.data_context(*lba, dirty.guard, seq).encode())
            .collect();
        let mut runs: Vec<(ObjectId, u64, Vec<&[u8]>)> = Vec::new();
        let mut index = 0;
        while index < blocks.len() {
            let first = self.geometry.locate(blocks[index].0);
            let mut parts: Vec<&[u8]> = Vec::with_capacity(2);
            let mut next_offset = first.data_offset;
            let mut end = index;
            loop {
                let at = self.geometry.locate(blocks[end].0).data_offset;
                if at > next_offset {
                    parts.push(&ROW_PADDING[..(at - next_offset) as usize]);
                }
                parts.push(&blocks[end].1.data[..]);
                parts.push(&contexts[end][..]);
                next_offset = at + PACKED_RECORD_BYTES;
                end += 1;
                if end == blocks.len()
                    || !self.geometry.contiguous(blocks[end - 1].0, blocks[end].0)
                {
                    break;
                }
            }
            runs.push((ObjectId::Data(first.segment), first.data_offset, parts));
            index = end;
        }
        self.write_home_runs(commit, &runs)
    }

    /// Write runs (sorted by object) one batch per object: their order on
    /// the media does not matter once ORDER POINT A has passed.
    fn write_home_runs(
        &self,
        commit: &mut CommitState,
        runs: &[(ObjectId, u64, Vec<&[u8]>)],
    ) -> Result<()> {
        let mut start = 0;
        while start < runs.len() {
            let object = runs[start].0;
            let end = start
                + runs[start..]
                    .iter()
                    .take_while(|run| run.0 == object)
                    .count();
            let batch: Vec<Run<'_>> = runs[start..end]
                .iter()
                .map(|(_, offset, parts)| Run {
                    offset: *offset,
                    parts,
                })
                .collect();
            self.storage
                .write_runs(object, &batch)
                .map_err(|failed| Error::io("write", object, failed.offset, failed.error))?;
            self.stats
                .add_written(object, batch.iter().map(Run::len).sum());
            commit.unsynced.insert(object);
            start = end;
        }
        Ok(())
    }

    /// Apply a trim / write-zeroes to home storage. Split: punch the data (the
    /// context change waits for the checkpoint). Packed: punch whole rows and
    /// rewrite the records at the edges.
    pub(crate) fn apply_range_home(&self, commit: &mut CommitState, range: &RangeOp) -> Result<()> {
        let mut lba = range.start;
        while lba < range.end {
            let segment_end =
                ((lba / self.geometry.segment_blocks) + 1) * self.geometry.segment_blocks;
            let end = range.end.min(segment_end);
            let location = self.geometry.locate(lba);
            let object = ObjectId::Data(location.segment);
            match self.geometry.layout {
                LayoutKind::Split => {
                    if matches!(range.template, Context::Unwritten) {
                        self.punch(object, location.data_offset, (end - lba) * BLOCK)?;
                    }
                }
                LayoutKind::Packed => self.apply_packed_range(object, lba, end, range.template)?,
            }
            commit.unsynced.insert(object);
            lba = end;
        }
        Ok(())
    }

    fn apply_packed_range(
        &self,
        object: ObjectId,
        start: u64,
        end: u64,
        template: Context,
    ) -> Result<()> {
        let mut lba = start;
        while lba < end {
            let slot = lba % PACKED_RECORDS_PER_ROW;
            let row_start = self.geometry.locate(lba).data_offset - slot * PACKED_RECORD_BYTES;
            let row_end_lba = (lba - slot + PACKED_RECORDS_PER_ROW).min(end);
            if slot == 0
                && row_end_lba - lba == PACKED_RECORDS_PER_ROW
                && matches!(template, Context::Unwritten)
            {
                // Whole rows: punch them in one call.
                let rows = (end - lba) / PACKED_RECORDS_PER_ROW;
                self.punch(object, row_start, rows * PACKED_ROW_BYTES)?;
                lba += rows * PACKED_RECORDS_PER_ROW;
                continue;
            }
            let first = self.geometry.locate(lba).data_offset;
            let mut run = vec![0u8; ((row_end_lba - lba) * PACKED_RECORD_BYTES) as usize];
            for (index, block) in (lba..row_end_lba).enumerate() {
                let at = index * PACKED_RECORD_BYTES as usize + BLOCK as usize;
                run[at..at + CONTEXT_BYTES]
                    .copy_from_slice(&context_in_range(template, block).encode());
            }
            self.write_object(object, first, &run)?;
            lba = row_end_lba;
        }
        Ok(())
    }

    /// ORDER POINT B: make all home writes so far durable.
    pub(crate) fn sync_data(&self, commit: &mut CommitState) -> Result<()> {
        let objects = std::mem::take(&mut commit.unsynced);
        for object in &objects {
            if let Err(error) = self.sync_object(*object) {
                return Err(self.fail_stop(error));
            }
        }
        commit.data_durable_seq = commit.next_seq - 1;
        Ok(())
    }

    /// Move committed contexts home and restart the journal (module comment).
    pub(crate) fn checkpoint(&self, commit: &mut CommitState, state_flag: u32) -> Result<()> {
        let result = self.checkpoint_inner(commit, state_flag);
        result.map_err(|error| self.fail_stop(error))
    }

    fn checkpoint_inner(&self, commit: &mut CommitState, state_flag: u32) -> Result<()> {
        self.sync_data(commit)?;
        let (rewritten, dropped) = if self.geometry.layout == LayoutKind::Split {
            self.write_contexts_home()?
        } else {
            (Vec::new(), Vec::new())
        };
        let mut superblock = commit.superblock;
        superblock.generation += 1;
        superblock.checkpoint_seq = commit.next_seq - 1;
        superblock.state = state_flag;
        write_superblock_copy(&*self.storage, &superblock, superblock.generation % 2)?;
        self.stats.add_written(ObjectId::Superblock, 4096);
        self.sync_object(ObjectId::Superblock)?;
        commit.superblock = superblock;
        commit.journal_offset = 0;
        self.state
            .write()
            .contexts
            .clear_pending(rewritten, &dropped);
        self.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Write ranges, then overlay entries in page order, into the
    /// `contexts` file, one page at a time (memory stays bounded), then
    /// fsync it. Returns every page written (with its new content when it
    /// was cached, to refresh it) and the page ranges punched.
    fn write_contexts_home(&self) -> Result<(WrittenPages, Vec<Range<u64>>)> {
        let (mut entries, ranges) = {
            let state = self.state.read();
            let entries: Vec<(u64, Context)> = state
                .contexts
                .overlay
                .iter()
                .map(|(lba, context)| (*lba, *context))
                .collect();
            (entries, state.contexts.ranges.clone())
        };
        entries.sort_unstable_by_key(|(lba, _)| *lba);
        let mut punched = Vec::new();
        let mut edge_pages: BTreeMap<u64, Box<[u8; 4096]>> = BTreeMap::new();
        for (&start, &(end, template)) in &ranges {
            punched.extend(self.write_context_range(start, end, template, &mut edge_pages)?);
        }
        let mut rewritten = Vec::new();
        let mut index = 0;
        while index < entries.len() {
            let page_no = ContextStore::page_of(entries[index].0);
            let mut page = match edge_pages.remove(&page_no) {
                Some(page) => page,
                // Punched just now: its cached copy predates the trim.
                None if punched.iter().any(|range| range.contains(&page_no)) => {
                    Box::new([0u8; 4096])
                }
                None => self.page_for_update(page_no)?,
            };
            while index < entries.len() && ContextStore::page_of(entries[index].0) == page_no {
                let (lba, context) = entries[index];
                let at = (lba % CONTEXTS_PER_PAGE) as usize * CONTEXT_BYTES;
                page[at..at + CONTEXT_BYTES].copy_from_slice(&context.encode());
                index += 1;
            }
            self.write_context_page(page_no, page, &mut rewritten)?;
        }
        for (page_no, page) in edge_pages {
            self.write_context_page(page_no, page, &mut rewritten)?;
        }
        self.sync_object(ObjectId::Contexts)?;
        Ok((rewritten, punched))
    }

    fn write_context_page(
        &self,
        page_no: u64,
        page: Box<[u8; 4096]>,
        written: &mut WrittenPages,
    ) -> Result<()> {
        self.write_object(ObjectId::Contexts, page_no * 4096, &page[..])?;
        let cached = self.state.read().contexts.is_cached(page_no);
        written.push((page_no, cached.then(|| Page::from(page))));
        Ok(())
    }

    /// A context page as it is now (cached copy or disk), to be modified.
    fn page_for_update(&self, page_no: u64) -> Result<Box<[u8; 4096]>> {
        let mut page = Box::new([0u8; 4096]);
        match self.state.read().contexts.cached_page(page_no) {
            Some(cached) => page.copy_from_slice(&cached[..]),
            None => self.read_object(ObjectId::Contexts, page_no * 4096, &mut page[..])?,
        }
        Ok(page)
    }

    /// A range's contexts: whole pages of holes are punched (returned as
    /// page ranges), edge pages are modified in `pages`.
    fn write_context_range(
        &self,
        start: u64,
        end: u64,
        template: Context,
        pages: &mut BTreeMap<u64, Box<[u8; 4096]>>,
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
                self.punch(ObjectId::Contexts, page_no * 4096, whole * 4096)?;
                pages.retain(|page, _| !(page_no..page_no + whole).contains(page));
                punched.push(page_no..page_no + whole);
                lba += whole * CONTEXTS_PER_PAGE;
                continue;
            }
            if let std::collections::btree_map::Entry::Vacant(e) = pages.entry(page_no) {
                let page = self.page_for_update(page_no)?;
                e.insert(page);
            }
            let page = pages.get_mut(&page_no).expect("inserted above");
            for block in lba..page_end {
                let at = (block % CONTEXTS_PER_PAGE) as usize * CONTEXT_BYTES;
                page[at..at + CONTEXT_BYTES]
                    .copy_from_slice(&context_in_range(template, block).encode());
            }
            lba = page_end;
        }
        Ok(punched)
    }

    // --- counted I/O helpers -------------------------------------------------

    pub(crate) fn write_object(&self, object: ObjectId, offset: u64, data: &[u8]) -> Result<()> {
        self.storage
            .write_at(object, offset, data)
            .map_err(|error| Error::io("write", object, offset, error))?;
        self.stats.add_written(object, data.len() as u64);
        Ok(())
    }

    pub(crate) fn read_object(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.storage
            .read_at(object, offset, buf)
            .map_err(|error| Error::io("read", object, offset, error))?;
        self.stats.add_read(buf.len() as u64);
        Ok(())
    }

    pub(crate) fn punch(&self, object: ObjectId, offset: u64, len: u64) -> Result<()> {
        self.storage
            .punch_hole(object, offset, len)
            .map_err(|error| Error::io("punch", object, offset, error))
    }

    pub(crate) fn sync_object(&self, object: ObjectId) -> Result<()> {
        self.storage
            .sync(object)
            .map_err(|error| Error::io("sync", object, 0, error))?;
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The superblock as last written (for tests and `info`).
impl Core {
    pub fn superblock(&self) -> Superblock {
        self.commit_lock.lock().superblock
    }
}
