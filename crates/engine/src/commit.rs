//! Commits and checkpoints: the crash ordering of every write.
//!
//! A commit (under the committer's lock on `Journal`):
//!   1. swap the write-back buffer into `committing` (reads still see it);
//!   2. for each group of blocks (one group unless its records would not
//!      fit in the rest of the journal: `group_end`), as record N (a record
//!      over half the journal is written as several, back to back):
//!      - if the record does not fit in the journal, checkpoint first
//!        (below); append record N (new contexts; in the packed layout
//!        also the data) and fsync the journal.   -- ORDER POINT A
//!      - write data (split) or records (packed) to their home, and with
//!        the last group apply range operations (hole punches); no fsync;
//!      - publish the group's new contexts (split: into the overlay);
//!   3. drop `committing`.
//!
//! Writers that do not wait go on meanwhile, into the other buffer and
//! held-log slot. A volume whose caller steps its commits (the simulator,
//! `schedule.rs`) is called after 1, after each record and each group's
//! home writes, and before a checkpoint: the orders those writers and a
//! crash can take against the commit.
//!
//! A checkpoint never runs between a record and its home writes: it would
//! retire a record whose blocks had not been written, and a crash in the
//! home writes that follow would leave them torn (packed) or under their
//! old contexts (split) with nothing to replay. (Found by
//! `serve_crash.rs` with a 1 MiB packed journal: a commit split into four
//! records, a checkpoint between the second and third.)
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
//! recovery verifies only commits after the last point B. Home writes that
//! a record holds a copy of (a *redo* record: every packed record, and a
//! split flush's commit of at most `REDO_MAX_BLOCKS`, ZFS's intent log for
//! small synchronous writes) are durable at A already: a flush does not
//! fsync them. They are fsynced by the next checkpoint, and (split) before
//! the next commit that is not redo writes its record, so a redo record
//! that a later record overwrites always has its blocks home (`replay`).
//! Such a flush is answered at A (`commit_for_flush`) when no earlier home
//! write waits for B: its blocks are durable in the journal, and its home
//! writes follow the answer (a failure there fail-stops the volume and
//! recovery redoes them).
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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard};
use vouch_format::journal::{encode_record_head, JournalHeader, JOURNAL_ALIGN};
use vouch_format::superblock::STATE_OPEN;
use vouch_format::{JournalEntry, Superblock};

use crate::contexts::context_in_range;
use crate::device::FlushDone;
use crate::error::Result;
use crate::journal::Journal;
use crate::schedule::{CommitSchedule, CommitStep, OrderingBreaks};
use crate::shared::Shared;
use crate::state::{DirtyBlock, RangeOp};
use crate::storage::ObjectId;
use crate::superblock::write_superblock_copy;

/// Largest block count one journal entry may carry.
const MAX_RANGE_ENTRY_BLOCKS: u64 = u32::MAX as u64;

/// The largest flush commit journaled as a redo record (256 KiB): the
/// small synchronous writes whose flush then costs one fsync, not two.
/// Larger ones are written once, home, and fsynced there.
pub const REDO_MAX_BLOCKS: usize = 64;

/// The component that commits: it owns the journal position and
/// durability state (`Journal`, behind its lock) and the background
/// committer's signal. Everything else it needs it is handed (`Shared`).
pub(crate) struct Committer {
    journal: Mutex<Journal>,
    journal_bytes: u64,
    /// Pending contexts that force a checkpoint (`Tuning::overlay_limit`).
    overlay_limit: usize,
    /// `Tuning::prompt_commits`.
    prompt_commits: bool,
    /// Set while a background committer runs (a thread, or the caller
    /// of a stepped volume: `schedule`).
    background: AtomicBool,
    signal: Mutex<SignalFlags>,
    wake: Condvar,
    /// Whether the background committer is neither committing nor asked
    /// to (`prompt` asks only then, once).
    idle: AtomicBool,
    /// Blocks buffered since the last flush's commit (`prompt`).
    since_flush: AtomicUsize,
    /// Connections whose client has requests waiting behind its writes
    /// (`writes_queued`): no prompt commits while any has.
    queued: AtomicUsize,
    /// Called at each commit's steps when the caller steps the commits
    /// (`schedule.rs`); `None` in production.
    schedule: Option<Arc<dyn CommitSchedule>>,
    /// The schedule's self-test breaks, read once.
    breaks: OrderingBreaks,
}

#[derive(Default)]
struct SignalFlags {
    wanted: bool,
    stop: bool,
}

impl Committer {
    pub fn new(
        journal: Journal,
        journal_bytes: u64,
        overlay_limit: usize,
        prompt_commits: bool,
        schedule: Option<Arc<dyn CommitSchedule>>,
        breaks: OrderingBreaks,
    ) -> Committer {
        Committer {
            journal: Mutex::new(journal),
            journal_bytes,
            overlay_limit,
            prompt_commits,
            background: AtomicBool::new(false),
            signal: Mutex::new(SignalFlags::default()),
            wake: Condvar::new(),
            idle: AtomicBool::new(true),
            since_flush: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            schedule,
            breaks,
        }
    }

    /// Whether the caller steps the background commits (`schedule.rs`).
    pub fn is_stepped(&self) -> bool {
        self.schedule.is_some()
    }

    /// A commit reached `step`: a stepped volume's caller may run
    /// non-waiting writers now. One `Option` test per step, a few per
    /// commit, none per write (`schedule.rs`, "Cost").
    fn reached(&self, step: CommitStep) {
        if let Some(schedule) = &self.schedule {
            schedule.reached(step);
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Journal> {
        self.journal.lock()
    }

    pub fn try_lock(&self) -> Option<MutexGuard<'_, Journal>> {
        self.journal.try_lock()
    }

    pub fn journal_bytes(&self) -> u64 {
        self.journal_bytes
    }

    // --- the background committer ------------------------------------------

    pub fn is_background(&self) -> bool {
        self.background.load(Ordering::Acquire)
    }

    pub fn set_background(&self, running: bool) {
        if running {
            // A committer started again (an online resize that stopped it,
            // then refused) must not find the last one's stop, nor a
            // prompt it never took.
            self.signal.lock().stop = false;
            self.idle.store(true, Ordering::Release);
        }
        self.background.store(running, Ordering::Release);
    }

    /// Wake the background committer to commit the write-back buffer.
    pub fn request(&self) {
        let mut flags = self.signal.lock();
        if !flags.wanted {
            flags.wanted = true;
            self.wake.notify_one();
        }
    }

    /// `count` blocks entered the write-back buffer, which holds `buffered`
    /// now: ask the background committer to commit when the buffer reached
    /// `dirty_limit`, or promptly (`prompt`).
    pub fn after_buffered(&self, count: usize, buffered: usize, dirty_limit: usize) {
        if buffered >= dirty_limit {
            self.request();
        } else {
            self.prompt(count);
        }
    }

    /// Commit promptly once more blocks than a flush's redo commit takes
    /// (`REDO_MAX_BLOCKS`) were buffered since the last flush: a write
    /// answered on the reactor (the inline and reserved routes; a worker's
    /// write does not ask, see `buffer_sealed`) that finds the committer
    /// idle wakes it, so commits follow the
    /// writes instead of waiting for the dirty limit (a burst's last
    /// blocks, buffered while a commit ran, wait for the next write, a
    /// flush or the limit: the held log keeps them meanwhile). Below that, a flush
    /// soon will commit the blocks as one redo record, durable at its
    /// journal fsync (ORDER POINT A) without a data fsync: committing them
    /// earlier would make that flush wait for B. Why commit before the
    /// limit at all: the acknowledgement never waits for a commit (the
    /// held log keeps a buffered write through a crash of the process),
    /// but a committer that runs beside a stream of small writes keeps the
    /// second CPU busy. On a virtual machine whose idle vCPUs halt (no
    /// halt polling, the default), a client woken on a halted vCPU waits
    /// for it to be woken by the host; a busy one takes the client at
    /// once. At QD1 that is the difference between 17-20k and 45-50k 4 KiB
    /// writes/s on 2 vCPUs. The cost is a journal record and its fsync per
    /// commit, each taking what was buffered while the previous one ran:
    /// at QD1 ~13 blocks a commit, journal bytes 8 % of the data written
    /// instead of 1.2 %; at QD32 2.3 %. Commits run one at a time, so a
    /// device with slow fsyncs gets fewer, larger ones.
    ///
    /// A client with requests waiting behind the write (`writes_queued`:
    /// the NBD server found the next request already received) gets no
    /// prompt commits while it has (nor does any other client of the
    /// volume meanwhile: the deep one keeps the committer busy enough): it keeps the CPUs busy itself, and a
    /// commit per idle moment of the committer is one more journal record
    /// and fsync (a device cache flush) for the same blocks. At QD32 that
    /// was 10-100x a345690's commits (one per 20-330 writes, not one per
    /// 2,200-5,000) and ~1.5x its server CPU per `--direct` write
    /// (docs/BENCHMARKS.md, stop 42, perf28). Its writes are
    /// committed at the dirty limit, as `--commit-at-limit` does. The
    /// server says `false` again after 8 writes in a row with nothing
    /// behind them (a QD1 client right after a QD32 one gets its prompt
    /// commits back within 8 writes, not after limit-sized commits).
    pub fn prompt(&self, count: usize) {
        let since = self.since_flush.fetch_add(count, Ordering::Relaxed) + count;
        if self.prompt_commits
            && since > REDO_MAX_BLOCKS
            && self.queued.load(Ordering::Relaxed) == 0
            && self.idle.swap(false, Ordering::AcqRel)
        {
            self.request();
        }
    }

    /// A connection's client has (`true`) or no longer has (`false`)
    /// requests waiting behind the write it sends next
    /// (`BlockDevice::writes_queued`): counted, each `true` undone by one
    /// `false` (a `false` with none counted, e.g. one sent to an engine
    /// that replaced the one counted by an online resize, counts nothing).
    pub fn writes_queued(&self, queued: bool) {
        if queued {
            self.queued.fetch_add(1, Ordering::Relaxed);
        } else {
            let _ = self
                .queued
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |count| {
                    count.checked_sub(1)
                });
        }
    }

    /// A flush commits everything buffered: count again from here.
    fn flushed(&self) {
        self.since_flush.store(0, Ordering::Relaxed);
    }

    /// Ask the background committer to stop (it finishes the commit it is in).
    pub fn stop(&self) {
        self.set_background(false);
        self.signal.lock().stop = true;
        self.wake.notify_all();
    }

    /// The background committer's loop: commit the write-back buffer each
    /// time a writer fills it.
    pub fn run(&self, shared: &Shared) {
        loop {
            {
                let mut flags = self.signal.lock();
                while !flags.wanted && !flags.stop {
                    self.wake.wait(&mut flags);
                }
                if flags.stop {
                    return;
                }
                flags.wanted = false;
            }
            self.commit_requested(shared);
        }
    }

    /// One turn of `run` on the caller's thread, for a stepped volume
    /// (`schedule.rs`): the requested commit, if a writer requested one.
    /// Returns whether it ran.
    pub fn run_requested(&self, shared: &Shared) -> bool {
        {
            let mut flags = self.signal.lock();
            if !flags.wanted || flags.stop {
                return false;
            }
            flags.wanted = false;
        }
        self.commit_requested(shared);
        true
    }

    /// The background commit a writer requested. A failed commit has
    /// already fail-stopped the volume, so writers see the error on their
    /// next call.
    fn commit_requested(&self, shared: &Shared) {
        self.idle.store(false, Ordering::Release);
        let mut journal = self.lock();
        if let Err(error) = self.commit(shared, &mut journal, &[]) {
            tracing::debug!(%error, "background commit failed");
        }
        drop(journal);
        self.idle.store(true, Ordering::Release);
    }

    // --- commits -------------------------------------------------------------

    /// Commit the write-back buffer and `ranges` (see the module comment).
    pub fn commit(&self, shared: &Shared, journal: &mut Journal, ranges: &[RangeOp]) -> Result<()> {
        self.commit_as(shared, journal, ranges, None)
    }

    /// The commit a flush (or FUA) runs: a redo record when the buffer holds
    /// at most `REDO_MAX_BLOCKS` (its fsync is then all the flush needs for
    /// them; see the module comment), else a plain commit.
    ///
    /// `answer` (taken, if given) is the flush's reply: a redo commit that
    /// finds no earlier home write waiting for ORDER POINT B calls it at A,
    /// before the home writes: the flush is durable then (its blocks are in
    /// the journal, redone home by recovery), so the client need not wait
    /// for a device write it does not depend on. Otherwise the caller
    /// answers when the flush is done.
    pub fn commit_for_flush(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        answer: &mut Option<FlushDone>,
    ) -> Result<()> {
        self.flushed();
        let buffered = shared.state().read().buffered_blocks();
        let redo = buffered <= REDO_MAX_BLOCKS;
        self.commit_as(shared, journal, &[], redo.then_some(answer))
    }

    fn commit_as(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        ranges: &[RangeOp],
        mut redo_answer: Option<&mut Option<FlushDone>>,
    ) -> Result<()> {
        let redo = redo_answer.is_some();
        shared.io().check_writable()?;
        if !redo {
            self.before_plain_record(shared, journal)?;
        }
        // The buffer and its held-log slot are taken together: every block
        // in the one is in the other (`held.rs`).
        let (blocks, mut held_slot): (Vec<(u64, DirtyBlock)>, Option<usize>) = {
            let mut held = shared.held().lock();
            let held_slot = held
                .swap(shared.io(), !self.breaks.keep_stale_epoch)
                .map_err(|error| shared.io().fail_stop(error))?;
            let blocks = shared.state().write().take_for_commit();
            (blocks, held_slot)
        };
        if blocks.is_empty() && ranges.is_empty() {
            return self.release_held(shared, held_slot);
        }
        if self.breaks.empty_before_home {
            self.release_held(shared, held_slot.take())?;
        }
        self.reached(CommitStep::Taken);
        let mut start = 0;
        let result = loop {
            let end = self.group_end(shared, journal, &blocks, (start, ranges.len()), redo);
            // The ranges go with the last group.
            let last = end == blocks.len();
            let group_ranges = if last { ranges } else { &[] };
            let answer = redo_answer.as_deref_mut().filter(|_| last);
            if let Err(error) = self.commit_group(
                shared,
                journal,
                &blocks[start..end],
                group_ranges,
                (redo, answer),
            ) {
                break Err(error);
            }
            if end == blocks.len() {
                break Ok(());
            }
            start = end;
        };
        if let Err(error) = result {
            // The buffered blocks stay in `committing`, so reads still return
            // what was acknowledged; writes are refused until reopened.
            return Err(shared.io().fail_stop(error));
        }
        let pending = shared.state().write().commit_done();
        self.release_held(shared, held_slot)?;
        self.committed(shared, journal, pending)
    }

    /// The commit's blocks are in the kernel (journal record and home
    /// writes returned): their held-log slot can be emptied, before the
    /// commit (and any flush or trim that ran it) is answered. A failure
    /// fail-stops the volume: the slot's records would otherwise come back
    /// after a crash over what was written since.
    fn release_held(&self, shared: &Shared, slot: Option<usize>) -> Result<()> {
        match slot {
            Some(slot) => shared
                .held()
                .empty(shared.io(), slot)
                .map_err(|error| shared.io().fail_stop(error)),
            None => Ok(()),
        }
    }

    /// After a commit (or another journaled change, such as a reflink copy,
    /// `copy/reflink.rs`) published its contexts: count it, and checkpoint
    /// when the journal is 3/4 full or `pending` contexts are over the limit.
    pub(crate) fn committed(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        pending: usize,
    ) -> Result<()> {
        shared.io().stats.commits.fetch_add(1, Ordering::Relaxed);
        let journal_full = journal.offset() * 4 > self.journal_bytes * 3;
        if journal_full || pending > self.overlay_limit {
            self.reached(CommitStep::Checkpointing);
            self.checkpoint(shared, journal, STATE_OPEN)?;
        }
        Ok(())
    }

    /// Apply `range` (a zero range a journaled record carries) at home,
    /// after its record is written (ORDER POINT A) and before its
    /// contexts are published, recording the objects it writes until
    /// synced, as a commit's home writes do: a flush syncs them before it
    /// counts the record's data durable (ORDER POINT B). For journaled
    /// changes outside `commit` (`copy/reflink.rs`).
    pub(crate) fn apply_range_home(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        range: &RangeOp,
    ) -> Result<()> {
        let layout = shared.layouts().of(range.start);
        layout.apply_range_home(
            shared.io(),
            range,
            journal.unsynced_for(layout.journals_data()),
        )
    }

    /// Make room for a record of `record_len` bytes before building it (a
    /// checkpoint, if one must run, runs now, never between a record and its
    /// home writes). Returns the record's sequence number. For journaled
    /// changes outside `commit` (`copy/reflink.rs`).
    pub(crate) fn reserve(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        record_len: u64,
    ) -> Result<u64> {
        if journal.offset() + record_len > self.journal_bytes {
            self.checkpoint(shared, journal, STATE_OPEN)?;
        }
        Ok(journal.next_seq())
    }

    /// The end of the group of blocks from `start` to journal and write
    /// home together. Each group is journaled and written home before the
    /// next is journaled, so a checkpoint that a later group's record forces
    /// finds every earlier group home (and, split, its contexts published)
    /// and may retire their records; a checkpoint between the records of
    /// one group would claim blocks that had not been written.
    ///
    /// - The rest of the commit is one group when its record fits in half
    ///   the journal, or when the records `append` cuts it into all fit in
    ///   the rest of the journal (nothing can checkpoint between them).
    /// - Otherwise it is cut into groups of equal size, each within half the
    ///   journal (equal records pack the journal like the old halves; a
    ///   full-size record and a remainder would checkpoint more often).
    fn group_end(
        &self,
        shared: &Shared,
        journal: &Journal,
        blocks: &[(u64, DirtyBlock)],
        (start, range_entries): (usize, usize),
        redo: bool,
    ) -> usize {
        let half = self.journal_bytes / 2;
        let reserved = range_entries as u32 * 2;
        let journals_data =
            |index: usize| redo || shared.layouts().of(blocks[index].0).journals_data();
        let remaining = blocks.len() - start;
        let remaining_data = (start..blocks.len()).filter(|i| journals_data(*i)).count();
        let total = JournalHeader::record_bytes(remaining as u32 + reserved, remaining_data as u32);
        let records = total.div_ceil(half).max(1);
        // Each extra record costs at most a header block and a partly
        // filled entries block.
        let with_headers = total + 2 * records * 2 * JOURNAL_ALIGN;
        if total <= half || journal.offset() + with_headers <= self.journal_bytes {
            return blocks.len();
        }
        let target = total / records;
        let mut entries = 0u32;
        let mut data = 0u32;
        let mut end = start;
        while end < blocks.len() {
            let with_data = u32::from(journals_data(end));
            let bytes = JournalHeader::record_bytes(entries + 1 + reserved, data + with_data);
            if end > start && (bytes > half || bytes > target) {
                break;
            }
            entries += 1;
            data += with_data;
            end += 1;
        }
        end
    }

    /// Journal one group of blocks (and, with the last group, the ranges)
    /// as one record, write them home and publish their contexts.
    fn commit_group(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        blocks: &[(u64, DirtyBlock)],
        ranges: &[RangeOp],
        (redo, answer): (bool, Option<&mut Option<FlushDone>>),
    ) -> Result<()> {
        let mut entries = Vec::with_capacity(blocks.len() + ranges.len());
        let mut contexts = Vec::with_capacity(blocks.len());
        let mut journaled_data: Vec<&[u8]> = Vec::new();
        let seq = self.reserve_record(shared, journal, blocks, ranges, redo)?;
        let ranges: Vec<RangeOp> = ranges.iter().map(|range| range.stamped(seq)).collect();
        let ranges = &ranges[..];
        for (lba, dirty) in blocks {
            // A buffer corrupted in memory after it was sealed is still
            // caught: the context carries the seal of the bytes the client
            // sent, so the read of the home copy fails with this LBA.
            // Re-sealing here on every commit is left to debug builds.
            let context = shared.protection().context(*lba, dirty.seal, seq);
            debug_assert!(
                shared.protection().matches(&context, &dirty.data[..]),
                "buffered block {lba} changed in memory"
            );
            contexts.push(context);
            entries.push(JournalEntry {
                lba: *lba,
                count: 1,
                context,
            });
            if redo || shared.layouts().of(*lba).journals_data() {
                journaled_data.push(&dirty.data[..]);
            }
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
        let journals_data = redo
            || shared
                .layouts()
                .layouts()
                .any(|layout| layout.journals_data());
        let data = journals_data.then_some(&journaled_data[..]);
        let generation = journal.superblock().generation;
        self.append(shared, journal, &entries, data)?;
        assert_eq!(
            journal.superblock().generation,
            generation,
            "a checkpoint ran between the records of one group"
        );
        // ORDER POINT A passed: home writes may now reach the disk in any order.
        // A flush whose last record this is, with no earlier home write
        // waiting for B, is durable now (`commit_for_flush`).
        if journal.unsynced(false).is_empty() {
            if let Some(answer) = answer.and_then(Option::take) {
                answer(Ok(()));
            }
        }
        self.reached(CommitStep::Journaled);
        let ranges_in_table = ranges.iter().any(|range| {
            shared
                .layouts()
                .pieces(range.start, range.end)
                .iter()
                .any(|(_, _, layout)| layout.contexts_in_table())
        });
        if ranges_in_table {
            // Publish trims before punching their data: a reader must never
            // see punched data under the block's old context.
            let mut state = shared.state().write();
            for range in ranges {
                state
                    .contexts_mut()
                    .set_range(range.start, range.end, range.template);
            }
        }
        let mut index = 0;
        while index < blocks.len() {
            let layout = shared.layouts().of(blocks[index].0);
            let span_end = shared.layouts().span_end(blocks[index].0);
            let end = index + blocks[index..].partition_point(|(lba, _)| *lba < span_end);
            layout.write_home(
                shared.io(),
                &blocks[index..end],
                &contexts[index..end],
                journal.unsynced_for(redo || layout.journals_data()),
            )?;
            index = end;
        }
        for range in ranges {
            for (start, end, layout) in shared.layouts().pieces(range.start, range.end) {
                let piece = range.piece(start, end);
                layout.apply_range_home(
                    shared.io(),
                    &piece,
                    journal.unsynced_for(layout.journals_data()),
                )?;
            }
        }
        // Publish the group's contexts now, not after the whole commit: a
        // checkpoint forced by the next group's record writes the context
        // table and retires this group's record.
        if shared
            .layouts()
            .layouts()
            .any(|layout| layout.contexts_in_table())
        {
            let mut state = shared.state().write();
            for ((lba, _), context) in blocks.iter().zip(&contexts) {
                if shared.layouts().of(*lba).contexts_in_table() {
                    state.contexts_mut().set(*lba, *context);
                }
            }
        }
        self.reached(CommitStep::WrittenHome);
        Ok(())
    }

    /// Make room for one group's record before building it: a checkpoint,
    /// if it must run, runs before the record is written (never between a
    /// record and its home writes). Returns the record's sequence number.
    fn reserve_record(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        blocks: &[(u64, DirtyBlock)],
        ranges: &[RangeOp],
        redo: bool,
    ) -> Result<u64> {
        let data = blocks
            .iter()
            .filter(|(lba, _)| redo || shared.layouts().of(*lba).journals_data())
            .count() as u32;
        let range_entries: u64 = ranges
            .iter()
            .map(|range| (range.end - range.start).div_ceil(MAX_RANGE_ENTRY_BLOCKS))
            .sum();
        let record_len =
            JournalHeader::record_bytes(blocks.len() as u32 + range_entries as u32, data);
        if journal.offset() + record_len > self.journal_bytes {
            self.checkpoint(shared, journal, STATE_OPEN)?;
        }
        Ok(journal.next_seq())
    }

    /// Write one journal record (splitting oversized commits) and fsync it.
    pub fn append(
        &self,
        shared: &Shared,
        journal: &mut Journal,
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
                    .filter(|e| e.context.carries_data())
                    .count();
                d.split_at(count)
            });
            self.append(shared, journal, &entries[..half], data_half.map(|(a, _)| a))?;
            return self.append(shared, journal, &entries[half..], data_half.map(|(_, b)| b));
        }
        if journal.offset() + record_len > self.journal_bytes {
            self.checkpoint(shared, journal, STATE_OPEN)?;
        }
        let seq = journal.next_seq();
        // The record's data blocks are written from where they are (the
        // buffered blocks), after its head: a packed record carries every
        // block it commits, and copying them into one record first cost a
        // zeroed allocation and a copy of each block per commit.
        let head = encode_record_head(
            seq,
            shared.uuid(),
            journal.data_durable_seq(),
            entries,
            data,
        );
        let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + data.map_or(0, <[_]>::len));
        parts.push(&head);
        parts.extend(data.into_iter().flatten().copied());
        shared
            .io()
            .write_object_parts(ObjectId::Journal, journal.offset(), &parts)?;
        shared.io().sync_object(ObjectId::Journal)?;
        let next_seq = journal.appended(record_len);
        shared.sealing_from(next_seq);
        Ok(())
    }

    /// ORDER POINT B, as a flush needs it: make every home write so far
    /// durable that no journal record holds a copy of. Home writes covered
    /// by a redo record (packed) are durable already, in the journal (A);
    /// `sync_all` syncs them before a checkpoint retires those records.
    pub fn sync_data(&self, shared: &Shared, journal: &mut Journal) -> Result<()> {
        let objects = journal.take_unsynced(false);
        for object in &objects {
            if let Err(error) = shared.io().sync_object(*object) {
                return Err(shared.io().fail_stop(error));
            }
        }
        journal.data_durable();
        Ok(())
    }

    /// ORDER POINT B for every home write so far, redo-covered ones too:
    /// what a checkpoint needs before it retires the records.
    pub fn sync_all(&self, shared: &Shared, journal: &mut Journal) -> Result<()> {
        self.sync_redo(shared, journal)?;
        self.sync_data(shared, journal)
    }

    /// Before a journal record that does not carry its blocks' data (a
    /// plain commit, a reflink copy's record): the home writes of earlier
    /// redo records are made durable, since such a record may overwrite
    /// their blocks and replay then trusts home for them (module comment).
    pub(crate) fn before_plain_record(&self, shared: &Shared, journal: &mut Journal) -> Result<()> {
        if journal.unsynced(true).is_empty() || self.all_journal_data(shared) {
            return Ok(());
        }
        self.sync_redo(shared, journal)
    }

    /// Make the home writes of redo records durable.
    fn sync_redo(&self, shared: &Shared, journal: &mut Journal) -> Result<()> {
        let objects = journal.take_unsynced(true);
        for object in &objects {
            if let Err(error) = shared.io().sync_object(*object) {
                return Err(shared.io().fail_stop(error));
            }
        }
        Ok(())
    }

    /// Every layout's records carry their data (packed): no commit needs
    /// redo-covered writes home first.
    fn all_journal_data(&self, shared: &Shared) -> bool {
        shared
            .layouts()
            .layouts()
            .all(|layout| layout.journals_data())
    }

    /// Move committed contexts home and restart the journal (module comment).
    pub fn checkpoint(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        state_flag: u32,
    ) -> Result<()> {
        let result = self.checkpoint_inner(shared, journal, state_flag);
        result.map_err(|error| shared.io().fail_stop(error))
    }

    fn checkpoint_inner(
        &self,
        shared: &Shared,
        journal: &mut Journal,
        state_flag: u32,
    ) -> Result<()> {
        // Never after a fail-stop: a later fsync that succeeds says
        // nothing of the writes an earlier failed one lost, and retiring
        // the journal would drop the only copy of them. The commit and
        // close paths check this before they come here; a reflink copy's
        // records (`reserve`, `append`) reach it too.
        if shared.io().has_failed() {
            shared.io().check_writable()?;
        }
        self.sync_all(shared, journal)?;
        let mut rewritten = Vec::new();
        let mut dropped = Vec::new();
        for layout in shared.layouts().layouts() {
            let (pages, punched) = layout.checkpoint_contexts(
                shared.io(),
                shared.state(),
                journal.next_seq() as u32,
            )?;
            rewritten.extend(pages);
            dropped.extend(punched);
        }
        // The written map after what it describes is durable (contexts
        // above, data in `sync_all`) and before the superblock retires
        // the journal that would otherwise restore its bits (`written.rs`),
        // its values into the copy the superblock on disk does not name.
        shared
            .io()
            .written
            .persist(shared.io(), journal.superblock().generations_seq)?;
        let mut superblock = journal.superblock();
        superblock.generation += 1;
        superblock.checkpoint_seq = journal.next_seq() - 1;
        // The expected generations hold as of this checkpoint: the copy
        // just written (or the one named before, if none changed).
        superblock.generations_seq = shared.io().written.generations_seq();
        superblock.state = state_flag;
        write_superblock_copy(
            shared.io().storage(),
            &superblock,
            superblock.generation % 2,
        )?;
        shared.io().stats.add_written(ObjectId::Superblock, 4096);
        shared.io().sync_object(ObjectId::Superblock)?;
        journal.checkpointed(superblock);
        shared
            .state()
            .write()
            .contexts_mut()
            .clear_pending(rewritten, &dropped);
        shared
            .io()
            .stats
            .checkpoints
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Mark the superblock open (recovery, before anything new is written).
    pub fn mark_open(&self, shared: &Shared, journal: &mut Journal) -> Result<()> {
        let mut superblock: Superblock = journal.superblock();
        superblock.generation += 1;
        superblock.state = STATE_OPEN;
        write_superblock(shared, journal, superblock)
    }
}

/// Write `superblock` to the copy its generation names, sync it, and keep
/// it as the journal's last written: a crash leaves this copy or the
/// other, each whole (the newer valid one is read at open).
pub(crate) fn write_superblock(
    shared: &Shared,
    journal: &mut Journal,
    superblock: Superblock,
) -> Result<()> {
    write_superblock_copy(
        shared.io().storage(),
        &superblock,
        superblock.generation % 2,
    )?;
    shared.io().sync_object(ObjectId::Superblock)?;
    journal.set_superblock(superblock);
    Ok(())
}
