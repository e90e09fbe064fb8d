//! The context journal: its position and durability state (`Journal`, owned
//! by the committer behind its lock), and reading back the records written
//! since the last checkpoint (recovery). Appending lives with the commit
//! (`commit.rs`), because a full journal forces a checkpoint first.

use std::collections::BTreeSet;

use vouch_format::journal::{decode_entries, JournalHeader, JOURNAL_ALIGN};
use vouch_format::{JournalEntry, Superblock};

use crate::backing::Backing;
use crate::error::Result;
use crate::storage::ObjectId;

/// Journal position and durability, serialized by the committer's lock.
/// Its fields change only through the operations below, each named for
/// the step of the commit protocol it records (docs/CRASH_MODEL.md).
pub(crate) struct Journal {
    /// The superblock as last written (checkpoints write the older copy).
    superblock: Superblock,
    next_seq: u64,
    /// Where the next record goes.
    offset: u64,
    /// Commits up to this sequence number have their data durable at home
    /// (ORDER POINT B); recovery verifies only later ones.
    data_durable_seq: u64,
    /// Objects written since their last sync by home writes a flush must
    /// make durable (split: the journal holds only their contexts).
    unsynced: BTreeSet<ObjectId>,
    /// Objects written since their last sync by home writes that journal
    /// records carry a copy of (packed: a redo log, fsynced at A): a flush
    /// leaves them to the next checkpoint, which syncs them before it
    /// retires those records.
    redo_unsynced: BTreeSet<ObjectId>,
}

impl Journal {
    pub fn after_checkpoint(superblock: Superblock) -> Journal {
        Journal {
            superblock,
            next_seq: superblock.checkpoint_seq + 1,
            offset: 0,
            data_durable_seq: superblock.checkpoint_seq,
            unsynced: BTreeSet::new(),
            redo_unsynced: BTreeSet::new(),
        }
    }

    /// The superblock as last written.
    pub fn superblock(&self) -> Superblock {
        self.superblock
    }

    /// `superblock` is written and synced (a key change, marking the
    /// volume open), or is what the next checkpoint writes (with new
    /// feature flags): the copy the next superblock write starts from.
    pub fn set_superblock(&mut self, superblock: Superblock) {
        self.superblock = superblock;
    }

    /// A checkpoint wrote and synced `superblock`, which retires every
    /// record: the journal starts again at its beginning.
    pub fn checkpointed(&mut self, superblock: Superblock) {
        self.superblock = superblock;
        self.offset = 0;
    }

    /// The sequence number the next record takes.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Where the next record goes.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Commits up to this sequence number have their data durable at home.
    pub fn data_durable_seq(&self) -> u64 {
        self.data_durable_seq
    }

    /// A record of `bytes` was written at `offset` and synced (ORDER
    /// POINT A): the next one follows it, with the next sequence number,
    /// which this returns.
    pub fn appended(&mut self, bytes: u64) -> u64 {
        self.offset += bytes;
        self.next_seq += 1;
        self.next_seq
    }

    /// Every home write a record so far needs, outside the redo records,
    /// is synced (ORDER POINT B): their commits are durable at home.
    pub fn data_durable(&mut self) {
        self.data_durable_seq = self.next_seq - 1;
    }

    /// Recovery read the records up to `end`, the last of them `last`
    /// (none: the journal is empty since the checkpoint): new records
    /// continue after them, with the durability the last one recorded.
    pub fn replayed(&mut self, last: Option<&JournalHeader>, end: u64) {
        if let Some(last) = last {
            self.next_seq = last.seq + 1;
            self.data_durable_seq = last.data_durable_seq;
        }
        self.offset = end;
    }

    /// `object` was written at home under a record that does not carry
    /// the data (a reflink clone, recovery's resolutions): the next flush
    /// syncs it before it counts that record's data durable (ORDER POINT
    /// B), so a crash before then falls back on the journal's verify.
    pub fn note_unsynced(&mut self, object: ObjectId) {
        self.unsynced.insert(object);
    }

    /// Where the layouts' home writes record the objects they write until
    /// synced (`Layout::write_home`, `apply_range_home`, replay): with the
    /// redo-covered ones when their record carries their data (`redo`:
    /// this record does, or its layout's records always do,
    /// `Layout::journals_data`).
    pub fn unsynced_for(&mut self, redo: bool) -> &mut BTreeSet<ObjectId> {
        if redo {
            &mut self.redo_unsynced
        } else {
            &mut self.unsynced
        }
    }

    /// The objects `unsynced_for(redo)` holds.
    pub fn unsynced(&self, redo: bool) -> &BTreeSet<ObjectId> {
        if redo {
            &self.redo_unsynced
        } else {
            &self.unsynced
        }
    }

    /// Take the objects `unsynced_for(redo)` holds, to sync them.
    pub fn take_unsynced(&mut self, redo: bool) -> BTreeSet<ObjectId> {
        std::mem::take(self.unsynced_for(redo))
    }
}

/// One journal record read back.
pub(crate) struct Record {
    pub header: JournalHeader,
    pub bytes: Vec<u8>,
    pub entries: Vec<JournalEntry>,
}

/// Valid records with consecutive sequence numbers after `checkpoint_seq`,
/// and the journal offset just past the last one. `check` refuses a record
/// that passed its checksums but cannot have been written by vouch.
///
/// The journal is read front to back in large sequential reads
/// (`JournalWindow`), not two reads per record: prompt commits leave
/// hundreds of small records, and recovery costs what they hold.
pub(crate) fn read_records(
    io: &Backing,
    uuid: [u8; 16],
    journal_bytes: u64,
    checkpoint_seq: u64,
    check: impl Fn(&Record) -> Result<()>,
) -> Result<(Vec<Record>, u64)> {
    let mut records = Vec::new();
    let mut offset = 0u64;
    let mut expected = checkpoint_seq + 1;
    let mut window = JournalWindow::new(journal_bytes);
    while offset + JOURNAL_ALIGN <= journal_bytes {
        let first_block = window.bytes(io, offset, JOURNAL_ALIGN)?;
        let Ok(header) = JournalHeader::decode(first_block) else {
            break;
        };
        if header.volume_uuid != uuid || header.seq != expected {
            break;
        }
        let len = u64::from(header.record_blocks) * JOURNAL_ALIGN;
        if offset + len > journal_bytes {
            break;
        }
        let bytes = window.record(io, offset, len)?;
        // A torn record fails its payload CRC: its commit never reached
        // the data (ORDER POINT A), so the replay ends before it.
        let Ok(entries) = decode_entries(&header, &bytes) else {
            break;
        };
        let record = Record {
            header,
            bytes,
            entries,
        };
        check(&record)?;
        records.push(record);
        offset += len;
        expected += 1;
    }
    Ok((records, offset))
}

/// The first read of the journal at open: 64 KiB (a clean or lightly
/// used journal costs little more than its first record's header).
const WINDOW_FIRST: u64 = 64 << 10;
/// Each read after it doubles, up to this much (a record larger than
/// the window is read whole, in one read).
const WINDOW_MAX: u64 = 4 << 20;

/// A window onto the journal, read ahead sequentially: headers and the
/// records it holds are sliced out of it; a record that runs past its end
/// is read alone, in one `pread` (`record`), and the next window starts
/// after it.
struct JournalWindow {
    journal_bytes: u64,
    /// Journal offset of `buf[0]`.
    start: u64,
    buf: Vec<u8>,
    /// The size of the next read.
    next: u64,
}

impl JournalWindow {
    fn new(journal_bytes: u64) -> JournalWindow {
        JournalWindow {
            journal_bytes,
            start: 0,
            buf: Vec::new(),
            next: WINDOW_FIRST,
        }
    }

    /// The record at `[offset, offset + len)`, as its own buffer. One the
    /// window holds is copied out of it (a small record). One that runs
    /// past the window is read alone, straight into the buffer it is
    /// returned in: a record of a deep client's commit is as large as the
    /// dirty limit (17 MiB at the default), and reading it into the
    /// window first cost a zero-fill of the window's growth and a copy of
    /// the record, each touching every page of it, on top of the read.
    fn record(&mut self, io: &Backing, offset: u64, len: u64) -> Result<Vec<u8>> {
        let end = self.start + self.buf.len() as u64;
        if offset >= self.start && offset + len <= end {
            let at = (offset - self.start) as usize;
            return Ok(self.buf[at..at + len as usize].to_vec());
        }
        // `vec!` of zeros is a fresh zeroed allocation (no pass of its
        // own over the pages), which the read then fills.
        let mut bytes = vec![0u8; len as usize];
        io.read_object(ObjectId::Journal, offset, &mut bytes)?;
        // The window holds nothing past this record: the next header's
        // read starts a new one where it ends.
        self.buf.clear();
        self.start = offset + len;
        Ok(bytes)
    }

    /// The journal's bytes `[offset, offset + len)` (within the journal).
    fn bytes(&mut self, io: &Backing, offset: u64, len: u64) -> Result<&[u8]> {
        let end = self.start + self.buf.len() as u64;
        if offset < self.start || offset + len > end {
            let size = len.max(self.next).min(self.journal_bytes - offset);
            self.buf.resize(size as usize, 0);
            self.start = offset;
            self.next = (self.next * 2).min(WINDOW_MAX);
            if size > len
                && io
                    .try_read(ObjectId::Journal, offset, &mut self.buf)
                    .is_ok()
            {
                io.stats.add_read(size);
            } else {
                // What lies past the record (an unreadable sector of an
                // old record, say) must not fail the open: read only what
                // is needed, as one read per record did.
                self.buf.truncate(len as usize);
                io.read_object(ObjectId::Journal, offset, &mut self.buf)?;
            }
        }
        let at = (offset - self.start) as usize;
        Ok(&self.buf[at..at + len as usize])
    }
}
