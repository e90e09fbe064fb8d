//! Opening a volume: replay the journal written since the last checkpoint.
//!
//! Cost is proportional to the journal's contents (bounded by its size and
//! by the checkpoint triggers), never to the volume's size.
//!
//! - Split: contexts of every record are applied in order. Blocks written by
//!   commits after the last record's `data_durable_seq` may not have reached
//!   their home before the crash, so each is read back and given the newest
//!   context its data matches: new, an older write, or the context it had
//!   before (zero-reading contexts always match: a block that was a hole
//!   reads as zeros again). A block matching none was torn below 4 KiB by
//!   the media: it keeps its newest context and reads as a fault.
//! - Packed: the journal is a redo log: every record's blocks are rewritten
//!   from the journal's copy, so each block reads its newest journaled data.
//!
//! A writable open does not checkpoint: it fsyncs what it verified or redid,
//! journals again the contexts it reverted (so a later flush, which advances
//! `data_durable_seq`, cannot make the reverted commits' newer contexts
//! authoritative), marks the superblock open, and appends after the
//! replayed records.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use vouch_format::journal::{decode_entries, record_data, JournalHeader, JOURNAL_ALIGN};
use vouch_format::superblock::{STATE_CLEAN, STATE_OPEN};
use vouch_format::{Context, JournalEntry, LayoutKind};

use crate::commit::RangeOp;
use crate::contexts::{Lookup, CONTEXTS_PER_PAGE};
use crate::error::Result;
use crate::storage::ObjectId;
use crate::volume::{Block, Core, DirtyBlock, BLOCK};

#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    /// The superblock said the volume was closed cleanly.
    pub was_clean: bool,
    pub records_replayed: u64,
    pub blocks_verified: u64,
    /// Blocks whose newest write had not reached home: they read old data.
    pub blocks_reverted: u64,
    /// Blocks torn below 4 KiB (media broke the atomicity assumption).
    pub blocks_torn: Vec<u64>,
    /// Blocks whose data could not be read back to verify them.
    pub blocks_unreadable: Vec<u64>,
    pub duration: Duration,
}

struct Record {
    header: JournalHeader,
    bytes: Vec<u8>,
    entries: Vec<JournalEntry>,
}

impl Core {
    pub(crate) fn recover(mut self) -> Result<Core> {
        let started = Instant::now();
        let mut report = RecoveryReport::default();
        {
            let mut commit = self.commit_lock.lock();
            report.was_clean = commit.superblock.state == STATE_CLEAN;
            let (records, journal_end) = self.read_journal(commit.superblock.checkpoint_seq)?;
            report.records_replayed = records.len() as u64;
            if let Some(last) = records.last() {
                commit.next_seq = last.header.seq + 1;
                commit.data_durable_seq = last.header.data_durable_seq;
            }
            // New records continue after the replayed ones: no checkpoint at
            // open, so recovery costs what the journal holds, nothing more.
            commit.journal_offset = journal_end;
            let resolutions = match self.geometry.layout {
                LayoutKind::Split => self.replay_split(&records, &mut report)?,
                LayoutKind::Packed => {
                    self.replay_packed(&records, &mut commit)?;
                    Vec::new()
                }
            };
            if !self.is_read_only() {
                self.persist_recovery(&mut commit, resolutions)?;
            }
        }
        report.duration = started.elapsed();
        if report.records_replayed > 0 {
            tracing::info!(
                records = report.records_replayed,
                verified = report.blocks_verified,
                reverted = report.blocks_reverted,
                torn = report.blocks_torn.len(),
                "recovered volume from its journal"
            );
        }
        self.recovery = report;
        Ok(self)
    }

    /// Make what recovery decided durable before anything new is written:
    /// redone (packed) or verified (split) data is fsynced, and contexts
    /// reverted to older writes are journaled again, so a later flush that
    /// advances `data_durable_seq` past the replayed commits cannot make
    /// their newer contexts authoritative. Marks the superblock open.
    fn persist_recovery(
        &self,
        commit: &mut crate::volume::CommitState,
        resolutions: Vec<JournalEntry>,
    ) -> Result<()> {
        if !resolutions.is_empty() {
            for segment in 0..self.geometry.segments() {
                commit.unsynced.insert(ObjectId::Data(segment));
            }
        }
        self.sync_data(commit)?;
        if !resolutions.is_empty() {
            self.append_journal(commit, &resolutions, None)?;
        }
        if commit.superblock.state == STATE_CLEAN {
            let mut superblock = commit.superblock;
            superblock.generation += 1;
            superblock.state = STATE_OPEN;
            crate::volume::write_superblock_copy(
                &*self.storage,
                &superblock,
                superblock.generation % 2,
            )?;
            self.sync_object(ObjectId::Superblock)?;
            commit.superblock = superblock;
        }
        Ok(())
    }

    /// Valid records with consecutive sequence numbers after `checkpoint_seq`,
    /// and the journal offset just past the last one.
    fn read_journal(&self, checkpoint_seq: u64) -> Result<(Vec<Record>, u64)> {
        let mut records = Vec::new();
        let mut offset = 0u64;
        let mut expected = checkpoint_seq + 1;
        let mut first_block = vec![0u8; JOURNAL_ALIGN as usize];
        while offset + JOURNAL_ALIGN <= self.journal_bytes {
            self.read_object(ObjectId::Journal, offset, &mut first_block)?;
            let Ok(header) = JournalHeader::decode(&first_block) else {
                break;
            };
            if header.volume_uuid != self.uuid || header.seq != expected {
                break;
            }
            let len = u64::from(header.record_blocks) * JOURNAL_ALIGN;
            if offset + len > self.journal_bytes {
                break;
            }
            let mut bytes = vec![0u8; len as usize];
            self.read_object(ObjectId::Journal, offset, &mut bytes)?;
            // A torn record fails its payload CRC: its commit never reached
            // the data (ORDER POINT A), so the replay ends before it.
            let Ok(entries) = decode_entries(&header, &bytes) else {
                break;
            };
            self.check_record(&header, &entries)?;
            records.push(Record {
                header,
                bytes,
                entries,
            });
            offset += len;
            expected += 1;
        }
        Ok((records, offset))
    }

    /// A record that passed its checksums but names blocks past the end of
    /// the volume, or lacks the data blocks a packed replay needs, was not
    /// written by vouch: refuse to open rather than panic or guess.
    fn check_record(&self, header: &JournalHeader, entries: &[JournalEntry]) -> Result<()> {
        let corrupt = |why: String| {
            Err(crate::error::Error::Volume(format!(
                "corrupt journal record {}: {why}; refusing to open",
                header.seq
            )))
        };
        for entry in entries {
            let end = entry.lba.checked_add(u64::from(entry.count));
            if end.is_none_or(|end| end > self.geometry.blocks) {
                return corrupt(format!(
                    "entry {}+{} is past the end of the volume ({} blocks)",
                    entry.lba, entry.count, self.geometry.blocks
                ));
            }
        }
        if self.geometry.layout == LayoutKind::Packed {
            let data_entries = entries
                .iter()
                .filter(|entry| entry.count == 1 && matches!(entry.context, Context::Data { .. }))
                .count();
            if data_entries != header.data_blocks as usize {
                return corrupt(format!(
                    "{data_entries} data entries but {} data blocks",
                    header.data_blocks
                ));
            }
        }
        Ok(())
    }

    /// The context a block has now, loading its page if needed.
    fn context_now(&self, lba: u64) -> Result<Context> {
        if let Lookup::Found(found) = self.state.read().contexts.lookup(lba) {
            return Ok(found.unwrap_or(Context::Unwritten));
        }
        let page_no = lba / CONTEXTS_PER_PAGE;
        let mut page = Box::new([0u8; 4096]);
        self.read_object(ObjectId::Contexts, page_no * 4096, &mut page[..])?;
        let at = (lba % CONTEXTS_PER_PAGE) as usize * vouch_format::CONTEXT_BYTES;
        let found = Context::decode(&page[at..at + vouch_format::CONTEXT_BYTES]);
        self.state
            .write()
            .contexts
            .insert_page(page_no, std::sync::Arc::from(page));
        Ok(found.unwrap_or(Context::Unwritten))
    }

    /// Returns the contexts recovery reverted (to be journaled again).
    fn replay_split(
        &self,
        records: &[Record],
        report: &mut RecoveryReport,
    ) -> Result<Vec<JournalEntry>> {
        let Some(last) = records.last() else {
            return Ok(Vec::new());
        };
        let mut resolutions = Vec::new();
        let verify_after = last.header.data_durable_seq;
        // For each block an unverified commit wrote: [context before, writes...].
        let mut candidates: BTreeMap<u64, Vec<Context>> = BTreeMap::new();
        for record in records {
            for entry in &record.entries {
                if entry.count == 1 && matches!(entry.context, Context::Data { .. }) {
                    if record.header.seq > verify_after {
                        if let std::collections::btree_map::Entry::Vacant(e) =
                            candidates.entry(entry.lba)
                        {
                            let before = self.context_now(entry.lba)?;
                            e.insert(vec![before]);
                        }
                        candidates
                            .get_mut(&entry.lba)
                            .expect("inserted")
                            .push(entry.context);
                    }
                    self.state.write().contexts.set(entry.lba, entry.context);
                } else {
                    let end = entry.lba + u64::from(entry.count);
                    self.state
                        .write()
                        .contexts
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
        let mut block: Box<Block> = Box::new([0u8; BLOCK as usize]);
        for (lba, options) in candidates {
            let location = self.geometry.locate(lba);
            report.blocks_verified += 1;
            let read = self.read_object(
                ObjectId::Data(location.segment),
                location.data_offset,
                &mut block[..],
            );
            if let Err(error) = read {
                // Not knowing what landed, keep the newest context: reads of
                // this block then report the fault with its LBA instead of
                // recovery silently deciding it was an old hole.
                tracing::warn!(lba, %error, "block unreadable during recovery: it will read as a fault");
                report.blocks_unreadable.push(lba);
                continue;
            }
            let guard = self.guard.compute(&block[..]);
            let newest = *options.last().expect("at least one write");
            let chosen = options.iter().rev().find(|context| match context {
                Context::Data { guard: stored, .. } => *stored == guard,
                other => other.reads_as_zero(),
            });
            match chosen {
                Some(context) if *context == newest => {}
                Some(context) => {
                    report.blocks_reverted += 1;
                    self.state.write().contexts.set(lba, *context);
                    resolutions.push(JournalEntry {
                        lba,
                        count: 1,
                        context: *context,
                    });
                }
                None => {
                    tracing::warn!(
                        lba,
                        "block torn by the crash: it will read as a fault until rewritten"
                    );
                    report.blocks_torn.push(lba);
                }
            }
        }
        Ok(resolutions)
    }

    fn replay_packed(
        &self,
        records: &[Record],
        commit: &mut crate::volume::CommitState,
    ) -> Result<()> {
        for record in records {
            let mut data_index = 0usize;
            for entry in &record.entries {
                if entry.count == 1 && matches!(entry.context, Context::Data { .. }) {
                    let data = record_data(&record.header, &record.bytes, data_index);
                    data_index += 1;
                    if self.is_read_only() {
                        // Cannot redo on disk: serve the journaled data from memory.
                        let mut block: Box<Block> = Box::new([0u8; BLOCK as usize]);
                        block.copy_from_slice(data);
                        let guard = match entry.context {
                            Context::Data { guard, .. } => guard,
                            _ => unreachable!("matched Data above"),
                        };
                        self.state.write().active.insert(
                            entry.lba,
                            DirtyBlock {
                                data: block.into(),
                                guard,
                            },
                        );
                        continue;
                    }
                    let location = self.geometry.locate(entry.lba);
                    let mut recordbuf =
                        vec![0u8; vouch_format::layout::PACKED_RECORD_BYTES as usize];
                    recordbuf[..BLOCK as usize].copy_from_slice(data);
                    recordbuf[BLOCK as usize..].copy_from_slice(&entry.context.encode());
                    let object = ObjectId::Data(location.segment);
                    self.write_object(object, location.data_offset, &recordbuf)?;
                    commit.unsynced.insert(object);
                } else {
                    let range = RangeOp {
                        start: entry.lba,
                        end: entry.lba + u64::from(entry.count),
                        template: entry.context,
                    };
                    if self.is_read_only() {
                        // Cannot redo on disk: serve the range from memory
                        // as a range (its size does not matter), superseding
                        // journaled data buffered before it.
                        let mut state = self.state.write();
                        let stale: Vec<u64> = state
                            .active
                            .range(range.start..range.end)
                            .map(|(lba, _)| *lba)
                            .collect();
                        for lba in stale {
                            state.active.remove(&lba);
                        }
                        state
                            .contexts
                            .set_range(range.start, range.end, range.template);
                        continue;
                    }
                    self.apply_range_home(commit, &range)?;
                }
            }
        }
        Ok(())
    }
}
