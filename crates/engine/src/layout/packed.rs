//! The `packed` layout: each block's context right after its data in one
//! 4128-byte record, 31 records per 128 KiB row (Crucible-style): one read
//! I/O returns both. A record write is not atomic on the media, so the
//! journal carries the data too (a redo log): recovery rewrites every
//! journaled record, and each block reads its newest journaled data.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;

use parking_lot::RwLock;
use vouch_format::journal::record_data;
use vouch_format::layout::{PACKED_RECORDS_PER_ROW, PACKED_RECORD_BYTES, PACKED_ROW_BYTES};
use vouch_format::{Context, FormatError, Geometry, JournalEntry, LayoutKind, CONTEXT_BYTES};

use super::{
    ContextFrom, Layout, Planned, Replay, RunSpan, StoredContext, UnitPlace, WrittenPages,
};
use crate::backing::Backing;
use crate::buffer::PageBuffer;
use crate::contexts::{context_in_range, ContextStore, Lookup};
use crate::error::{Error, Result};
use crate::journal::Record;
use crate::state::{BlockData, DirtyBlock, RangeOp, VolumeState, BLOCK};
use crate::storage::{ObjectId, Run, Wait};
use crate::written::{Seen, SlotVerdict};

/// The unused bytes at the end of a packed row (zero on disk).
static ROW_PADDING: [u8; (PACKED_ROW_BYTES - PACKED_RECORDS_PER_ROW * PACKED_RECORD_BYTES)
    as usize] = [0; (PACKED_ROW_BYTES - PACKED_RECORDS_PER_ROW * PACKED_RECORD_BYTES) as usize];

/// Alignment of a run's read of whole records (O_DIRECT's unit).
const READ_ALIGN: u64 = 4096;

/// Largest record buffer a reading thread keeps between reads (a read of
/// 1024 blocks spans about 4 MiB of records).
const KEEP_RECORDS_BYTES: usize = 8 << 20;

thread_local! {
    /// Each reading thread's record buffer, reused; O_DIRECT reads land
    /// in it, so a large one is huge pages (`PageBuffer::for_device`).
    static RECORDS: std::cell::Cell<PageBuffer> = std::cell::Cell::new(PageBuffer::for_device());
}

pub(crate) struct PackedLayout {
    geometry: Geometry,
}

impl PackedLayout {
    pub fn new(geometry: Geometry) -> PackedLayout {
        PackedLayout { geometry }
    }

    /// Trim / zero `[start, end)` of one segment: punch whole rows of holes,
    /// rewrite the records at the edges with the range's contexts.
    /// `generation`: the range's commit's (0: not known).
    fn apply_range_in_segment(
        &self,
        io: &Backing,
        object: ObjectId,
        (start, end): (u64, u64),
        (template, generation): (Context, u32),
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
                // Whole rows: punch them in one call, their bits cleared
                // first (`written.rs`). Each keeps the trim's generation
                // as its expectation: a clear row holds nothing older than
                // its trim, so an older copy of it restored later (its
                // records of older generations) is judged older, not read
                // as the data it held then (`WrittenMap::to_judge`).
                let rows = (end - lba) / PACKED_RECORDS_PER_ROW;
                let _change = io.written.change.lock();
                io.written
                    .clear_touched(lba, lba + rows * PACKED_RECORDS_PER_ROW);
                // Set once the punch returns: a punch that failed leaves
                // the rows' records under a value that would make them
                // read as older.
                io.punch(object, row_start, rows * PACKED_ROW_BYTES)?;
                for unit in io.written.unit_of(lba)..io.written.unit_of(lba) + rows {
                    io.written.set_expected_generation(unit, generation);
                }
                lba += rows * PACKED_RECORDS_PER_ROW;
                continue;
            }
            let first = self.geometry.locate(lba).data_offset;
            let unit = io.written.unit_of(lba);
            let trim = matches!(template, Context::Unwritten);
            self.settle_row(io, unit)?;
            if !trim {
                let _ = self.bind_row(io, unit)?;
            }
            // Markers carry no generation and may replace the slot that
            // held the row's newest: the expectation is forgotten before
            // the write and read back from the row's slots after it
            // (`fill_row_expected`), so a row last changed by a trim is
            // still judged. Zero contexts carry their commit's generation,
            // the row's newest once written: it is raised to that after.
            io.written.forget_older(unit, None);
            // A trimmed slot of a whole row is its vacant marker, never
            // blank (a blank slot there is lost metadata).
            let vacant = trim && io.written.bound() && io.written.is_set(unit);
            let mut run = vec![0u8; ((row_end_lba - lba) * PACKED_RECORD_BYTES) as usize];
            for (index, block) in (lba..row_end_lba).enumerate() {
                let at = index * PACKED_RECORD_BYTES as usize + BLOCK as usize;
                let slot = if vacant {
                    io.written.vacant(block)
                } else {
                    context_in_range(template, block).encode()
                };
                run[at..at + CONTEXT_BYTES].copy_from_slice(&slot);
            }
            {
                // A trim may leave the row blank: its bit is cleared
                // before a reader can judge it (under `change`).
                let _change = io.written.change.lock();
                io.write_object(object, first, &run)?;
                if trim {
                    let blank = if io.written.bound() {
                        self.row_vacant(io, unit)?
                    } else {
                        self.row_blank(io, unit, Wait::Block)
                            .map_err(|error| Error::io("read", object, first, error))?
                    };
                    if blank {
                        // Left holding nothing (found so on disk, never
                        // from its bit alone: a bit clear only because an
                        // older map copy was loaded lies over live records
                        // older than this trim): as a row trimmed whole,
                        // it expects nothing older than this trim.
                        io.written.clear(unit);
                        io.written.set_expected_generation(unit, generation);
                    }
                } else {
                    io.written.set(unit);
                }
            }
            // Read back outside `change` (readers take it to judge rows;
            // the commit lock keeps other writers out of the row), and
            // only when part of the row is left: a range over the whole
            // row here is zeros (a trim of it is punched above), whose
            // contexts carry their generation, or none when replayed.
            let whole_row = slot == 0 && row_end_lba - lba == PACKED_RECORDS_PER_ROW;
            if !trim && generation != 0 {
                // Its zero contexts hold this generation: the row reaches
                // it by construction, nothing to read back.
                io.written.raise_expected(unit, generation);
            } else if !whole_row && io.written.is_set(unit) {
                self.fill_row_expected(io, unit);
            }
            lba = row_end_lba;
        }
        Ok(())
    }
}

impl PackedLayout {
    /// Judge row `unit` against its expected generation before a record
    /// or a range's edge is written into it (once per row and open, and
    /// only for a row whose expectation is known: `WrittenMap::to_judge`).
    /// A write would otherwise raise the row's newest generation past the
    /// expectation and make an older copy of the row read as current. A
    /// row found older has every slot made a lost marker (its data kept),
    /// its expectation forgotten first. Called by writers holding
    /// `page_writes_guard`, in a commit's home writes: after the commit's
    /// journal record, which holds the records, is durable (ORDER POINT A).
    /// Crash ordering: the markers are written and fsynced before any
    /// record of the commit is written into the row, and before the
    /// forgotten expectation can reach the map on disk (the next
    /// checkpoint's). A crash after the fsync leaves the markers: those
    /// blocks stay lost (their data kept) and replay writes the records
    /// over their own slots. A crash before it leaves the older row as it
    /// was, and recovery forgets the expectation of every row the journal
    /// touches, this one included: the row is not judged again and its
    /// older blocks read as they decode (this older copy goes undetected,
    /// never a false fault). The fsync is paid only for a row found older.
    fn settle_row(&self, io: &Backing, unit: u64) -> Result<()> {
        if !io.written.to_judge(unit) {
            // Nothing to judge it by (or judged already): the row is
            // current from now on, so reads of the records written into
            // it this open never read it whole to judge it.
            io.written.set_current(unit);
            return Ok(());
        }
        let place = self.unit_place(unit);
        // A row that cannot be read proves nothing older, and a judge
        // must not fail the commit that asked it: a read error here
        // stopped every write to the volume (and faulted a mirror leg
        // whose only fault was that read). The row is left unjudged
        // (judged again at its next write or read); its older copy, if
        // that is what it holds, goes undetected, never a false fault.
        let Some(mut row) =
            Self::read_row_or_warn(io, &place, "to judge it before a write; written unjudged")
        else {
            return Ok(());
        };
        let Some((found, expected)) = io.written.stale_records(unit, Self::row_records(&row))
        else {
            io.written.set_current(unit);
            return Ok(());
        };
        io.written.set_expected_generation(unit, 0);
        let lbas = io.written.lbas_of(unit, self.geometry.blocks);
        for (slot, lba) in self.unit_slots(&mut row).into_iter().zip(lbas.clone()) {
            slot.copy_from_slice(&io.written.lost(lba));
        }
        io.write_object(place.object, place.offset, &row)?;
        io.sync_object(place.object)?;
        io.written.set_current(unit);
        tracing::warn!(
            object = place.object.file_name(),
            row = unit,
            first_lba = lbas.start,
            found,
            expected,
            "packed: a row is older than the volume expects (an older copy of the file?): its blocks are marked lost before a write into it"
        );
        Ok(())
    }

    /// Learn row `unit`'s expectation again, after a range wrote markers
    /// (or zero contexts of no known generation: a copy's zero range) into
    /// it (which forgot it), from its slots as they
    /// lie now: the newest generation one of its whole own slots holds
    /// (`WrittenMap::fill_expected`), so the row reaches it by
    /// construction. Read under the commit lock, where no other writer
    /// runs. Crash ordering: every slot read was written by a commit whose
    /// journal record is durable (this range's own, or an earlier one's);
    /// the value reaches the map on disk only with the next checkpoint's,
    /// after that checkpoint's fsync of the data (`Committer::checkpoint`),
    /// so the slot holding it is durable first, and any later change to
    /// the row is in the journal past that checkpoint, whose replay
    /// forgets the row. A replay's own ranges read back mid-replay too;
    /// `replay` forgets every row it touched at its end. No chain of
    /// raises is involved: the value is one a slot holds, never compared
    /// with the value before.
    /// A row that cannot be read is left with its expectation forgotten
    /// (its older copy goes undetected until its next record, never a
    /// false fault), and the range's commit is not failed for it.
    fn fill_row_expected(&self, io: &Backing, unit: u64) {
        let place = self.unit_place(unit);
        if let Some(row) = Self::read_row_or_warn(
            io,
            &place,
            "back after a trim or zeros; its expected generation stays forgotten",
        ) {
            io.written.fill_expected(unit, Self::row_records(&row));
        }
    }

    /// A row's bytes, or `None` with a warning naming the row and what
    /// its caller does without them (`outcome`): the judges of rows read
    /// to learn, and a read error must not fail the write that asked.
    fn read_row_or_warn(io: &Backing, place: &UnitPlace, outcome: &str) -> Option<PageBuffer> {
        let mut row = PageBuffer::new(place.len);
        match io.read_object(place.object, place.offset, &mut row) {
            Ok(()) => Some(row),
            Err(error) => {
                tracing::warn!(
                    object = place.object.file_name(),
                    offset = place.offset,
                    %error,
                    "a packed row could not be read {outcome}"
                );
                None
            }
        }
    }

    /// Whether `blocks` (sorted by LBA, from the first of row `unit`'s
    /// in a commit) hold every LBA of the row: the row is then replaced
    /// whole and current by construction.
    fn replaces_row(&self, io: &Backing, unit: u64, blocks: &[(u64, DirtyBlock)]) -> bool {
        let lbas = io.written.lbas_of(unit, self.geometry.blocks);
        let mut next = lbas.start;
        for (lba, _) in blocks {
            if *lba != next || next == lbas.end {
                break;
            }
            next += 1;
        }
        next == lbas.end
    }

    /// The 31 records of a row's bytes, in LBA order: (context, data).
    fn row_records(row: &[u8]) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        row.chunks(PACKED_RECORD_BYTES as usize)
            .take(PACKED_RECORDS_PER_ROW as usize)
            .map(|record| {
                let (data, context) = record.split_at(BLOCK as usize);
                (&context[..CONTEXT_BYTES], Some(data))
            })
    }

    /// Judge the rows of blocks `first..first + count` against their
    /// expected generations (an older copy of a data file holds rows
    /// whole, in their place and matching their own data: only the
    /// generation tells them from the rows the volume wrote last).
    /// `span`: the records read from disk, starting at byte `span_start`
    /// of the segment. A row some slot of which in the span is no older
    /// than expected is current. Otherwise, with `read` (`(wait, seen)`,
    /// `seen` taken before the span was read), the row is read whole
    /// (unless the span holds it) and, if its newest own context is older
    /// than expected and no writer ran meanwhile, every block of it in the
    /// run is `MetadataLost`; without `read` (a ring read, which cannot
    /// read more) its blocks are `MetadataLost` for the blocking read to
    /// judge. A row read while a writer ran is judged at a later read.
    fn judge_rows(
        &self,
        io: &Backing,
        (first, count): (u64, u64),
        (span, span_start): (&[u8], u64),
        contexts: &mut [Result<Context, FormatError>],
        read: Option<(Wait, &Seen)>,
    ) -> std::io::Result<()> {
        let end = first + count;
        for unit in io.written.unit_of(first)..=io.written.unit_of(end - 1) {
            if !io.written.to_judge(unit) {
                continue;
            }
            let expected = io.written.expected_generation(unit);
            let lbas = io.written.lbas_of(unit, self.geometry.blocks);
            let (low, high) = (lbas.start.max(first), lbas.end.min(end));
            let record_at = |lba: u64| {
                let at = (self.geometry.locate(lba).data_offset - span_start) as usize;
                let (data, context) =
                    span[at..at + PACKED_RECORD_BYTES as usize].split_at(BLOCK as usize);
                (&context[..CONTEXT_BYTES], Some(data))
            };
            // A clear row's slots that hold nothing (blank, markers) read
            // as zeros whatever its verdict: only its records fail, so the
            // LBAs that fail do not depend on which slot was read first.
            let clear = !io.written.is_set(unit);
            let mark = |contexts: &mut [Result<Context, FormatError>]| {
                for lba in low..high {
                    if !(clear && crate::written::WrittenMap::holds_nothing(record_at(lba).0)) {
                        contexts[(lba - first) as usize] = Err(FormatError::MetadataLost);
                    }
                }
            };
            if io.written.is_older(unit) {
                mark(contexts);
                continue;
            }
            let in_span = io
                .written
                .judge_slots(low, (low..high).map(record_at), expected);
            if in_span == SlotVerdict::Reaches {
                io.written.set_current(unit);
                continue;
            }
            // A clear row (trimmed whole) whose slots read hold nothing
            // older is done with: a blank slot reads as zeros whatever the
            // rest holds, so a read of a trimmed row reads no more than
            // before. One whose slots read are older is judged whole like
            // any row: its bit may be clear because a map copy from before
            // its records was loaded (the newest copy damaged), and then
            // another of its slots holds the expected generation.
            if !io.written.is_set(unit) && !matches!(in_span, SlotVerdict::Older(_)) {
                continue;
            }
            let Some((wait, seen)) = read else {
                mark(contexts);
                continue;
            };
            let verdict = if (low, high) == (lbas.start, lbas.end) {
                in_span
            } else {
                let place = self.unit_place(unit);
                let mut row = PageBuffer::new(place.len);
                match io.try_read_with(place.object, place.offset, &mut row, wait) {
                    Ok(()) => {
                        io.stats.add_read(place.len as u64);
                        io.written
                            .judge_slots(lbas.start, Self::row_records(&row), expected)
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                        return Err(error)
                    }
                    // A row that cannot be read proves nothing older (this
                    // run's own read succeeded).
                    Err(_) => continue,
                }
            };
            let found = match verdict {
                SlotVerdict::Older(found) => found,
                // A row with no own slot is left to its tags.
                SlotVerdict::Reaches | SlotVerdict::NoOwn => {
                    io.written.set_current(unit);
                    continue;
                }
                // A damaged slot is its own block's fault; the row is
                // judged again at a later read.
                SlotVerdict::Unsure => continue,
            };
            if !io.written.settled(seen, unit) {
                continue;
            }
            if io.written.set_older(unit) {
                tracing::warn!(
                object = self.unit_place(unit).object.file_name(),
                row = unit,
                first_lba = lbas.start,
                found,
                expected,
                "packed: a row is older than the volume expects (an older copy of the file?): its blocks have no valid protection information"
            );
            }
            mark(contexts);
        }
        Ok(())
    }

    /// The stored context slot of `lba` (32 bytes after its data).
    fn read_slot(&self, io: &Backing, lba: u64) -> Result<[u8; CONTEXT_BYTES]> {
        let location = self.geometry.locate(lba);
        let mut raw = [0u8; CONTEXT_BYTES];
        io.read_object(
            ObjectId::Data(location.segment),
            location.data_offset + BLOCK,
            &mut raw,
        )?;
        Ok(raw)
    }

    /// `stored_contexts`' judgement of rows against their expected
    /// generations, as reads make it (`judge_rows`), from the rows'
    /// contexts alone: a row found older this open, or whose own slots
    /// are all older than expected (an older copy of the data file) or
    /// damaged, is `Unknown` in every block not buffered, never the older
    /// copy's contexts (a backup would keep stale bytes) nor a hole. A row
    /// that reaches its expectation is current for the rest of the open,
    /// so each row is read whole at most once.
    fn judge_stored_rows(
        &self,
        io: &Backing,
        first: u64,
        kinds: &mut [StoredContext],
    ) -> Result<()> {
        let end = first + kinds.len() as u64;
        for unit in io.written.unit_of(first)..=io.written.unit_of(end - 1) {
            let older = io.written.is_older(unit);
            if !older && !io.written.to_judge(unit) {
                continue;
            }
            let lbas = io.written.lbas_of(unit, self.geometry.blocks);
            let current = !older && {
                let mut slots = Vec::with_capacity((lbas.end - lbas.start) as usize);
                for lba in lbas.clone() {
                    slots.push(self.read_slot(io, lba)?);
                }
                let verdict = io.written.judge_slots(
                    lbas.start,
                    slots.iter().map(|slot| (&slot[..], None)),
                    io.written.expected_generation(unit),
                );
                matches!(verdict, SlotVerdict::Reaches | SlotVerdict::NoOwn)
            };
            if current {
                io.written.set_current(unit);
                continue;
            }
            for lba in lbas.start.max(first)..lbas.end.min(end) {
                let kind = &mut kinds[(lba - first) as usize];
                if *kind != StoredContext::Buffered {
                    *kind = StoredContext::Unknown;
                }
            }
        }
        Ok(())
    }

    /// Each block's data into `out` and its context judged as a slot
    /// (`WrittenMap::judge_slot`), from a span `run_span` named.
    fn contexts_from_span(
        &self,
        io: &Backing,
        first: u64,
        count: u64,
        span: &[u8],
        out: &mut [u8],
    ) -> Vec<Result<Context, FormatError>> {
        let start = self.geometry.locate(first).data_offset;
        let base = (start % READ_ALIGN) as usize;
        (first..first + count)
            .enumerate()
            .map(|(index, lba)| {
                let at = base + (self.geometry.locate(lba).data_offset - start) as usize;
                out[index * BLOCK as usize..(index + 1) * BLOCK as usize]
                    .copy_from_slice(&span[at..at + BLOCK as usize]);
                io.written.judge_slot(
                    lba,
                    &span[at + BLOCK as usize..at + PACKED_RECORD_BYTES as usize],
                )
            })
            .collect()
    }

    /// Make row `unit` whole before its first record is written (volumes
    /// whose units are whole, and only while its bit is clear): every
    /// blank slot of the row gets its vacant marker, in one write of the
    /// row, so once the record is written and the bit set no slot of the
    /// row is blank. The row is read first, so whatever it holds is kept.
    /// Crash ordering: this write, then the records, then the bit (set in
    /// memory, on disk with the next checkpoint's map after the data's
    /// fsync). A crash in between leaves markers and maybe records under
    /// a clear bit, which read as never written until the journal's replay
    /// writes the records again (the row deferred, `defer_bind`).
    /// A row recovery deferred (its bit set, `WrittenMap::defer_bind`) is
    /// bound here too, its replayed slots kept as they are: one of them
    /// blank has lost its record, and stays so. Returns whether it wrote.
    fn bind_row(&self, io: &Backing, unit: u64) -> Result<bool> {
        if !io.written.bound() {
            return Ok(false);
        }
        let replayed = if io.written.is_set(unit) {
            let Some(replayed) = io.written.unbound(unit) else {
                return Ok(false);
            };
            replayed
        } else {
            0
        };
        let place = self.unit_place(unit);
        let mut row = PageBuffer::new(place.len);
        io.read_object(place.object, place.offset, &mut row)?;
        let changed = {
            let mut slots = self.unit_slots(&mut row);
            // A row with nothing in it yet is made whole by its first
            // record: pretend that record is there.
            let first = unit * PACKED_RECORDS_PER_ROW;
            io.written
                .bind_slots((first, self.geometry.blocks), &mut slots, (true, replayed))
        };
        if changed {
            io.write_object(place.object, place.offset, &row)?;
        }
        io.written.bound_now(unit);
        Ok(changed)
    }

    /// Bind every row recovery deferred (`WrittenMap::defer_bind`), and
    /// fsync what that wrote: a checkpoint's, before it writes the map
    /// that sets their bits and retires the journal that would defer them
    /// again. Crash ordering: the markers only fill blank slots that are
    /// not a replayed record's, so a crash anywhere here leaves each row
    /// as recovery left it or bound; the journal is still there, and the
    /// next recovery defers the rows again (a bound one has no blank slot
    /// left to judge). Each row is written under its stripe's guard, as a
    /// commit's rows are (`page_writes_guard`).
    fn bind_deferred(&self, io: &Backing) -> Result<()> {
        let mut touched = BTreeSet::new();
        for (unit, _) in io.written.unbound_rows() {
            let _writes = io.written.page_writes_guard(std::iter::once(unit));
            if self.bind_row(io, unit)? {
                touched.insert(self.unit_place(unit).object);
            }
        }
        for object in touched {
            io.sync_object(object)?;
        }
        Ok(())
    }

    /// Whether every slot of row `unit` is blank or its own vacant marker
    /// (a whole row that holds nothing).
    fn row_vacant(&self, io: &Backing, unit: u64) -> Result<bool> {
        let place = self.unit_place(unit);
        let first = unit * PACKED_RECORDS_PER_ROW;
        for slot in 0..PACKED_RECORDS_PER_ROW {
            let mut raw = [0u8; CONTEXT_BYTES];
            let at = place.offset + slot * PACKED_RECORD_BYTES + BLOCK;
            io.read_object(place.object, at, &mut raw)?;
            let lba = first + slot;
            if raw != [0u8; CONTEXT_BYTES] && raw != io.written.vacant(lba) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The first LBA at or after `lba` whose record may hold data on disk.
    fn next_data_in_segments(&self, io: &Backing, lba: u64) -> Result<Option<u64>> {
        let mut segment_first = lba;
        while segment_first < self.geometry.blocks {
            let location = self.geometry.locate(segment_first);
            let base = segment_first - segment_first % self.geometry.segment_blocks;
            if let Some(at) =
                io.seek_data(ObjectId::Data(location.segment), location.data_offset)?
            {
                let row_lba = base + (at / PACKED_ROW_BYTES) * PACKED_RECORDS_PER_ROW;
                return Ok(Some(row_lba.max(segment_first)));
            }
            segment_first = base + self.geometry.segment_blocks;
        }
        Ok(None)
    }

    /// Whether every context slot of row `unit` reads as zeros. Only the
    /// 31 slots are read, each alone: a slot that cannot be read proves
    /// nothing blank, so the row is not called lost for it (and a read
    /// error of another record never fails this block's read); waiting,
    /// with `Wait::NoWait`, is still an error.
    fn row_blank(&self, io: &Backing, unit: u64, wait: Wait) -> std::io::Result<bool> {
        let place = self.unit_place(unit);
        for slot in 0..PACKED_RECORDS_PER_ROW {
            let mut context = [0u8; CONTEXT_BYTES];
            let at = place.offset + slot * PACKED_RECORD_BYTES + BLOCK;
            match io.try_read_with(place.object, at, &mut context, wait) {
                Ok(()) if context == [0u8; CONTEXT_BYTES] => {}
                Ok(()) => return Ok(false),
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return Err(error),
                Err(_) => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Settle the suspects `run_from_span` marked (blocks `first..`): a
    /// blank context whose row still has its bit set and is blank has
    /// lost its metadata (`MetadataLost` stays); otherwise the block was
    /// never written (`Unwritten`). Judged under `WrittenMap::change`, so
    /// a trim blanking the row is never caught half-way.
    fn judge_suspects(
        &self,
        io: &Backing,
        first: u64,
        contexts: &mut [Result<Context, FormatError>],
        wait: Wait,
    ) -> std::io::Result<()> {
        if io.written.bound() {
            // Whole rows: a blank slot in a row whose bit is set is lost
            // whatever the rest of the row holds (`judge_slot`).
            return Ok(());
        }
        let mut judged: Option<(u64, bool)> = None;
        for (index, context) in contexts.iter_mut().enumerate() {
            if !matches!(context, Err(FormatError::MetadataLost)) {
                continue;
            }
            let unit = io.written.unit_of(first + index as u64);
            let lost = match judged {
                Some((judged_unit, lost)) if judged_unit == unit => lost,
                _ => {
                    let _change = io.written.change.lock();
                    let lost = io.written.is_set(unit) && self.row_blank(io, unit, wait)?;
                    if lost {
                        tracing::warn!(
                            row = unit,
                            first_lba = unit * PACKED_RECORDS_PER_ROW,
                            "packed: a row the written map says was written has no contexts: its blocks have no protection information"
                        );
                    }
                    judged = Some((unit, lost));
                    lost
                }
            };
            if !lost {
                *context = Ok(Context::Unwritten);
            }
        }
        Ok(())
    }
}

impl Layout for PackedLayout {
    fn kind(&self) -> LayoutKind {
        LayoutKind::Packed
    }

    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    fn journals_data(&self) -> bool {
        true
    }

    fn contexts_in_table(&self) -> bool {
        false
    }

    fn plan(&self, lba: u64, contexts: &ContextStore) -> Planned {
        // Contexts live in the records; only a read-only open of an
        // unrecovered volume holds (zeroed) ranges in memory.
        if contexts.ranges.is_empty() {
            return Planned::Home(ContextFrom::Record);
        }
        match contexts.lookup(lba) {
            Lookup::Found(Ok(context)) if context.reads_as_zero() => Planned::Zero(context),
            _ => Planned::Home(ContextFrom::Record),
        }
    }

    fn read_run(
        &self,
        io: &Backing,
        first: u64,
        count: u64,
        out: &mut [u8],
        wait: Wait,
    ) -> std::io::Result<Vec<Result<Context, FormatError>>> {
        let span = self.run_span(first, count);
        RECORDS.with(|cell| {
            // Left empty meanwhile, and after a read too large to keep:
            // a device buffer still (`take` would leave a heap one).
            let mut records = cell.replace(PageBuffer::for_device());
            records.set_len(span.len);
            let seen = io
                .written
                .page_writes(io.written.unit_of(first)..=io.written.unit_of(first + count - 1));
            let judged = io
                .try_read_with(span.object, span.offset, &mut records, wait)
                .and_then(|()| {
                    let mut contexts = self.contexts_from_span(io, first, count, &records, out);
                    self.judge_suspects(io, first, &mut contexts, wait)?;
                    self.judge_rows(
                        io,
                        (first, count),
                        (&records, span.offset),
                        &mut contexts,
                        Some((wait, &seen)),
                    )?;
                    Ok(contexts)
                });
            if records.len() <= KEEP_RECORDS_BYTES {
                cell.replace(records);
            }
            judged
        })
    }

    /// The records' span widened to 4 KiB boundaries (rows are 128 KiB and
    /// a segment whole rows, so it stays inside the run's rows and the
    /// segment): `read_run` reads it into a reused page-aligned buffer, so
    /// an O_DIRECT read needs no bounce buffer, and nothing is zeroed or
    /// allocated per read. Measured: a 1024-block `--direct` read cost 4.9
    /// ms of CPU with a fresh zeroed Vec and a fresh bounce buffer each
    /// time (bench/packed.sh).
    fn run_span(&self, first: u64, count: u64) -> RunSpan {
        let location = self.geometry.locate(first);
        let end = self.geometry.locate(first + count - 1).data_offset + PACKED_RECORD_BYTES;
        let start = location.data_offset - location.data_offset % READ_ALIGN;
        let end = end.next_multiple_of(READ_ALIGN);
        RunSpan {
            object: ObjectId::Data(location.segment),
            offset: start,
            len: (end - start) as usize,
        }
    }

    /// Rows still to be judged against their expected generation, and
    /// not shown current by the span, are `MetadataLost` here: the
    /// blocking read that follows judges them (`judge_rows`).
    fn run_from_span(
        &self,
        io: &Backing,
        first: u64,
        count: u64,
        span: &[u8],
        out: &mut [u8],
    ) -> Vec<Result<Context, FormatError>> {
        let mut contexts = self.contexts_from_span(io, first, count, span, out);
        let span_start = self.run_span(first, count).offset;
        self.judge_rows(io, (first, count), (span, span_start), &mut contexts, None)
            .expect("judging without reading does no I/O");
        contexts
    }

    fn read_block(
        &self,
        io: &Backing,
        lba: u64,
        block: &mut [u8],
    ) -> std::io::Result<Option<Result<Context, FormatError>>> {
        let location = self.geometry.locate(lba);
        let mut record = [0u8; PACKED_RECORD_BYTES as usize];
        let unit = io.written.unit_of(lba);
        let seen = io.written.page_writes(unit..=unit);
        io.try_read(
            ObjectId::Data(location.segment),
            location.data_offset,
            &mut record,
        )?;
        block.copy_from_slice(&record[..BLOCK as usize]);
        let mut context = [io.written.judge_slot(lba, &record[BLOCK as usize..])];
        self.judge_suspects(io, lba, &mut context, Wait::Block)?;
        self.judge_rows(
            io,
            (lba, 1),
            (&record, location.data_offset),
            &mut context,
            Some((Wait::Block, &seen)),
        )?;
        let [context] = context;
        Ok(Some(context))
    }

    fn write_home(
        &self,
        io: &Backing,
        blocks: &[(u64, DirtyBlock)],
        contexts: &[Context],
        unsynced: &mut BTreeSet<ObjectId>,
    ) -> Result<()> {
        // Records straight from the buffered blocks: each block's data, then
        // its encoded context, and the zero padding at a row's end when a run
        // crosses into the next row. Nothing is copied here.
        let encoded: Vec<[u8; CONTEXT_BYTES]> = contexts.iter().map(Context::encode).collect();
        // Readers judging these rows meanwhile leave them for a later read
        // (rows elsewhere are judged as they are read).
        let _writes = io
            .written
            .page_writes_guard(blocks.iter().map(|(lba, _)| io.written.unit_of(*lba)));
        // A row is judged before the first record written into it this
        // open (`settle_row`), and made whole before its first record
        // (`bind_row`). A record older than the row's expected generation
        // forgets it before the write (`forget_older`); the newest record
        // of each row raises it after (`raise_expected`).
        // (unit, newest generation written into it)
        let mut rows: Vec<(u64, u32)> = Vec::new();
        for (index, ((lba, _), context)) in blocks.iter().zip(contexts).enumerate() {
            let unit = io.written.unit_of(*lba);
            if rows.last().is_none_or(|(last, ..)| *last != unit) {
                if self.replaces_row(io, unit, &blocks[index..]) {
                    // Every slot gets a record of this commit: nothing of
                    // the row as it lies is left to judge or make whole,
                    // so it is not read (128 KiB per row).
                    io.written.set_current(unit);
                } else {
                    self.settle_row(io, unit)?;
                    let _ = self.bind_row(io, unit)?;
                }
                rows.push((unit, 0));
            }
            let generation = context.generation();
            io.written.forget_older(unit, generation);
            if let Some(row) = rows.last_mut() {
                if let Some(generation) = generation {
                    if row.1 == 0 || crate::written::newer(generation, row.1) {
                        row.1 = generation;
                    }
                }
            }
        }
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
                parts.push(&encoded[end][..]);
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
        super::write_runs_by_object(io, &runs, unsynced)?;
        // Set once the records are written (`written.rs`); on disk with
        // the next checkpoint's map, after the data's fsync. Until then the
        // journal holds these records and recovery sets the bits again
        // (and forgets the rows' expected generations).
        // A row whose expectation a record forgot (a copy keeping an older
        // generation, zeros written) expects the newest written now.
        for (unit, newest) in rows {
            io.written.set(unit);
            // Whole now: bound above, or every slot replaced.
            io.written.bound_now(unit);
            io.written.raise_expected(unit, newest);
        }
        Ok(())
    }

    fn apply_range_home(
        &self,
        io: &Backing,
        range: &RangeOp,
        unsynced: &mut BTreeSet<ObjectId>,
    ) -> Result<()> {
        // Readers judging these rows meanwhile leave them for a later read
        // (rows elsewhere are judged as they are read). A range's rows are
        // consecutive, so a long one stops at the first rows that cover
        // every stripe.
        let last = io.written.unit_of(range.end.max(range.start + 1) - 1);
        let _writes = io
            .written
            .page_writes_guard(io.written.unit_of(range.start)..=last);
        super::for_each_segment(&self.geometry, range.start, range.end, |lba, end| {
            let object = ObjectId::Data(self.geometry.locate(lba).segment);
            self.apply_range_in_segment(
                io,
                object,
                (lba, end),
                (range.template, range.generation),
            )?;
            unsynced.insert(object);
            Ok(())
        })
    }

    /// A row whose bit is set counts too: it may be lost, and a hole on
    /// disk must not hide that from a scan.
    fn next_data_on_disk(&self, io: &Backing, lba: u64) -> Result<Option<u64>> {
        let on_disk = self.next_data_in_segments(io, lba)?;
        Ok([on_disk, io.written.next_set_lba(lba)]
            .into_iter()
            .flatten()
            .min())
    }

    fn unit_place(&self, unit: u64) -> UnitPlace {
        let first = unit * PACKED_RECORDS_PER_ROW;
        let location = self.geometry.locate(first);
        let row_in_segment = location.data_offset / PACKED_ROW_BYTES;
        UnitPlace {
            object: ObjectId::Data(location.segment),
            offset: location.data_offset,
            len: PACKED_ROW_BYTES as usize,
            name: format!("row {row_in_segment}"),
        }
    }

    fn unit_metadata(&self, bytes: &[u8]) -> Vec<[u8; CONTEXT_BYTES]> {
        (0..PACKED_RECORDS_PER_ROW as usize)
            .map(|slot| {
                let at = slot * PACKED_RECORD_BYTES as usize + BLOCK as usize;
                bytes[at..at + CONTEXT_BYTES].try_into().expect("32 bytes")
            })
            .collect()
    }

    fn unit_slots<'a>(&self, bytes: &'a mut [u8]) -> Vec<&'a mut [u8]> {
        bytes
            .chunks_mut(PACKED_RECORD_BYTES as usize)
            .take(PACKED_RECORDS_PER_ROW as usize)
            .map(|record| &mut record[BLOCK as usize..BLOCK as usize + CONTEXT_BYTES])
            .collect()
    }

    fn unit_records<'a>(&self, bytes: &'a [u8]) -> Vec<(&'a [u8], Option<&'a [u8]>)> {
        Self::row_records(bytes).collect()
    }

    fn stored_contexts(
        &self,
        io: &Backing,
        _state: &RwLock<VolumeState>,
        first: u64,
        buffered: &[bool],
    ) -> Result<Vec<StoredContext>> {
        let count = buffered.len() as u64;
        // Sparse fast path: no data anywhere in these records.
        let start = self.geometry.locate(first);
        let last = self.geometry.locate(first + count - 1);
        let any_data = match io.seek_data(ObjectId::Data(start.segment), start.data_offset)? {
            Some(at) => {
                at < last.data_offset + PACKED_RECORD_BYTES || last.segment != start.segment
            }
            None => last.segment != start.segment,
        } || io.written.any_set(first, first + count);
        let mut kinds = Vec::with_capacity(buffered.len());
        for (index, lba) in (first..first + count).enumerate() {
            if buffered[index] {
                kinds.push(StoredContext::Buffered);
                continue;
            }
            if !any_data {
                kinds.push(StoredContext::Stored(Context::Unwritten));
                continue;
            }
            let raw = self.read_slot(io, lba)?;
            // A lost row is data, never a hole (its reads are faults).
            let mut context = [io.written.judge_slot(lba, &raw)];
            self.judge_suspects(io, lba, &mut context, Wait::Block)
                .map_err(|error| {
                    Error::io(
                        "read",
                        ObjectId::Data(self.geometry.locate(lba).segment),
                        0,
                        error,
                    )
                })?;
            kinds.push(match context[0] {
                Ok(found) => StoredContext::Stored(found),
                Err(_) => StoredContext::Unknown,
            });
        }
        if any_data {
            self.judge_stored_rows(io, first, &mut kinds)?;
        }
        Ok(kinds)
    }

    /// A redo needs every data block the record's entries name.
    fn check_record(&self, record: &Record) -> std::result::Result<(), String> {
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

    /// The journal is a redo log: every record's blocks are rewritten from
    /// the journal's copy. A read-only open cannot write, so it serves the
    /// journaled blocks and ranges from memory instead.
    fn replay(&self, mut replay: Replay<'_>, records: &[Record]) -> Result<Vec<JournalEntry>> {
        let read_only = replay.io.is_read_only();
        // What the journal wrote may be on disk after the map was (a row
        // made older by a trim or a copy too): the expected generation of
        // every row it touches is forgotten before any row is read.
        super::split::forget_replayed_generations(replay.io, records);
        if read_only {
            // A trim since the last checkpoint may have blanked a row whose
            // bit is set in the map on disk; a writable replay redoes the
            // trim, which clears it as the trim did (`written.rs`).
            super::split::clear_trimmed_units(replay.io, records);
        }
        if !read_only && only_block_writes(records) {
            self.redo_last_writes(&mut replay, records)?;
        } else {
            self.replay_in_order(&mut replay, records)?;
        }
        // A range's edge raised its row's expectation from the row as it
        // was then, and a later replayed record may have replaced that
        // row's newest with the older one the journal holds (the journal
        // wins): forgotten again, known at the row's next write.
        super::split::forget_replayed_generations(replay.io, records);
        Ok(Vec::new())
    }

    /// Rows recovery left to bind are bound (and fsynced) before the
    /// checkpoint writes the map (`bind_deferred`).
    fn checkpoint_contexts(
        &self,
        io: &Backing,
        _state: &RwLock<VolumeState>,
        _next: u32,
    ) -> Result<(WrittenPages, Vec<Range<u64>>)> {
        self.bind_deferred(io)?;
        Ok((Vec::new(), Vec::new()))
    }
}

/// Whether every entry of `records` writes one block with its data (no
/// trim or write-zeroes: a range works on the rows as the records before
/// it left them, so such a journal is replayed record by record).
fn only_block_writes(records: &[Record]) -> bool {
    records.iter().all(|record| {
        record
            .entries
            .iter()
            .all(|entry| entry.count == 1 && entry.context.carries_data())
    })
}

/// One block a writable replay writes: its place, its LBA, and the record
/// (data and context) from the last journal record that writes it.
struct Redo<'a> {
    segment: u32,
    offset: u64,
    lba: u64,
    data: &'a [u8],
    context: [u8; CONTEXT_BYTES],
}

impl PackedLayout {
    /// A writable replay of a journal of block writes alone: each block
    /// is written once, from the last record that writes it (a record
    /// rewrites its slot whole), in the order of the data files, the
    /// records adjacent in a row in one write (`Run`), one batch per
    /// segment. A record found at home as the journal holds it is still
    /// written: after a writeback error the dead process saw, the page
    /// cache may hold bytes the disk does not, and only a write dirties
    /// them again. The rows they land in are not read: one whose bit was
    /// clear is made whole later (`WrittenMap::defer_bind`).
    fn redo_last_writes(&self, replay: &mut Replay<'_>, records: &[Record]) -> Result<()> {
        let io = replay.io;
        let mut blocks: Vec<Redo<'_>> = Vec::new();
        let mut last: HashMap<u64, usize> = HashMap::new();
        for record in records {
            for (index, entry) in record.entries.iter().enumerate() {
                let location = self.geometry.locate(entry.lba);
                let redo = Redo {
                    segment: location.segment,
                    offset: location.data_offset,
                    lba: entry.lba,
                    data: record_data(&record.header, &record.bytes, index),
                    context: entry.context.encode(),
                };
                match last.entry(entry.lba) {
                    std::collections::hash_map::Entry::Occupied(at) => blocks[*at.get()] = redo,
                    std::collections::hash_map::Entry::Vacant(at) => {
                        at.insert(blocks.len());
                        blocks.push(redo);
                    }
                }
            }
        }
        blocks.sort_unstable_by_key(|block| (block.segment, block.offset));
        // Rows whose bit is clear on disk (or that wait already) are made
        // whole later, not read now; decided before any bit is set.
        if io.written.bound() {
            for block in &blocks {
                let unit = io.written.unit_of(block.lba);
                if !io.written.is_set(unit) || io.written.unbound(unit).is_some() {
                    io.written.defer_bind(block.lba);
                }
            }
        }
        for segment in blocks.chunk_by(|a, b| a.segment == b.segment) {
            let parts: Vec<&[u8]> = segment
                .iter()
                .flat_map(|block| [block.data, &block.context[..]])
                .collect();
            let mut runs = Vec::new();
            let mut first = 0;
            for end in 1..=segment.len() {
                if end == segment.len()
                    || segment[end].offset != segment[end - 1].offset + PACKED_RECORD_BYTES
                {
                    runs.push(Run {
                        offset: segment[first].offset,
                        parts: &parts[2 * first..2 * end],
                    });
                    first = end;
                }
            }
            let object = ObjectId::Data(segment[0].segment);
            io.write_runs(object, &runs)?;
            replay.unsynced.insert(object);
        }
        for block in &blocks {
            io.written.set(io.written.unit_of(block.lba));
        }
        Ok(())
    }

    /// The replay of a read-only open (served from memory), or of a
    /// journal that holds a range: record by record, entry by entry.
    fn replay_in_order(&self, replay: &mut Replay<'_>, records: &[Record]) -> Result<()> {
        let read_only = replay.io.is_read_only();
        for record in records {
            let mut data_index = 0usize;
            for entry in &record.entries {
                if entry.count == 1 && entry.context.carries_data() {
                    let data = record_data(&record.header, &record.bytes, data_index);
                    data_index += 1;
                    if read_only {
                        // A context of the other protection kind (plain in an
                        // encrypted volume, or the reverse) is corruption.
                        let Some(seal) = replay.protection.seal_of(&entry.context) else {
                            return Err(Error::Corrupt(format!(
                                "journal record {} holds a {:?} context for LBA {}, which this volume does not write",
                                record.header.seq,
                                entry.context.kind(),
                                entry.lba
                            )));
                        };
                        replay.state.write().buffer(
                            entry.lba,
                            DirtyBlock {
                                data: BlockData::copy_from(data),
                                seal,
                            },
                        );
                        continue;
                    }
                    let location = self.geometry.locate(entry.lba);
                    let context = entry.context.encode();
                    let object = ObjectId::Data(location.segment);
                    let unit = replay.io.written.unit_of(entry.lba);
                    if replay.io.written.bound()
                        && (!replay.io.written.is_set(unit)
                            || replay.io.written.unbound(unit).is_some())
                    {
                        // Made whole later, not read now (`defer_bind`).
                        replay.io.written.defer_bind(entry.lba);
                    }
                    replay.io.write_runs(
                        object,
                        &[Run {
                            offset: location.data_offset,
                            parts: &[data, &context],
                        }],
                    )?;
                    replay.unsynced.insert(object);
                    replay.io.written.set(unit);
                } else {
                    let range =
                        RangeOp::new(entry.lba, entry.lba + u64::from(entry.count), entry.context);
                    if read_only {
                        // Served from memory as a range (its size does not
                        // matter), superseding journaled data buffered before it.
                        let mut state = replay.state.write();
                        state.drop_buffered(range.start, range.end);
                        state
                            .contexts_mut()
                            .set_range(range.start, range.end, range.template);
                        continue;
                    }
                    self.apply_range_home(replay.io, &range, replay.unsynced)?;
                }
            }
        }
        Ok(())
    }
}
