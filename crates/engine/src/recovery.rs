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
//!   the media: it keeps its newest context and reads as a fault. The
//!   blocks, and the table pages of their older contexts, are read back in
//!   runs of adjacent ones after one pass over the records.
//! - Packed: the journal is a redo log: every record's blocks are rewritten
//!   from the journal's copy, so each block reads its newest journaled data.
//!   The rows they land in are not read: one whose bit was clear is made
//!   whole later (`WrittenMap::defer_bind`). A block is written from the
//!   last record that writes it only.
//!
//! The journal is read in large sequential reads (`read_records`), and
//! the objects a crash left unsynced are fsynced together: a journal of
//! hundreds of small records (prompt commits) costs what they hold.
//!
//! A writable open does not checkpoint. What it verified (split) was made
//! durable before it was read (`sync_what_a_crash_left`); when it reverted
//! blocks it fsyncs the data again and journals the contexts it reverted
//! (so a later flush, which advances
//! `data_durable_seq`, cannot make the reverted commits' newer contexts
//! authoritative), marks the superblock open, and appends after the
//! replayed records. What it redid from the journal (packed: every
//! block; split: the blocks of redo records) is left unsynced like any
//! home write a redo record covers: the records stay in the journal until
//! the next checkpoint, which syncs the data before it retires them
//! (`Committer::sync_all`), so a crash before then replays them again.
//! Split: a commit that is not redo syncs them before it writes its record
//! (`Committer::before_plain_record`), as it does a live redo commit's
//! blocks, so a replayed redo block that a new record overwrites is home.

pub(crate) mod report;

use std::time::Instant;

use vouch_format::superblock::STATE_CLEAN;
use vouch_format::JournalEntry;

use crate::commit::Committer;
use crate::error::{Error, Result};
use crate::journal::{read_records, Journal, Record};
use crate::layout::Replay;
use crate::shared::Shared;
use crate::storage::ObjectId;

pub use report::RecoveryReport;

/// Replay the journal onto a freshly opened volume (module comment).
pub(crate) fn recover(shared: &Shared, committer: &Committer) -> Result<RecoveryReport> {
    let started = Instant::now();
    let mut report = RecoveryReport::default();
    {
        let mut journal = committer.lock();
        report.was_clean = journal.superblock().state == STATE_CLEAN;
        if !report.was_clean && !shared.io().is_read_only() {
            sync_what_a_crash_left(shared)?;
        }
        let (records, journal_end) = read_records(
            shared.io(),
            shared.uuid(),
            committer.journal_bytes(),
            journal.superblock().checkpoint_seq,
            |record| check_record(shared, record),
        )?;
        report.records_replayed = records.len() as u64;
        // New records continue after the replayed ones: no checkpoint at
        // open, so recovery costs what the journal holds, nothing more.
        journal.replayed(records.last().map(|last| &last.header), journal_end);
        if !records.is_empty() {
            shared.sealing_from(journal.next_seq());
        }
        let mut resolutions = Vec::new();
        for layout in shared.layouts().layouts() {
            let replay = Replay {
                io: shared.io(),
                protection: shared.protection(),
                state: shared.state(),
                // What a replay writes home it redid from the records
                // (packed: every block; split: the redo records' blocks),
                // which stay in the journal: those writes wait for the
                // checkpoint, as a redo commit's do (`persist`).
                unsynced: journal.unsynced_for(true),
                report: &mut report,
            };
            resolutions.extend(layout.replay(replay, &records)?);
        }
        if !shared.io().is_read_only() {
            persist(shared, committer, &mut journal, resolutions)?;
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
    Ok(report)
}

/// A crash of the process alone (the kernel stayed up) leaves its last
/// writes in the page cache, not yet synced: a journal record written but
/// not fsynced (a crash just before ORDER POINT A), home blocks after it.
/// Recovery reads them as if they were durable — replays the record, keeps
/// the contexts the blocks match, redoes blocks from the record — so they
/// are made durable first: recovery then starts from what a power cut at a
/// synced moment would leave, and a power cut during or after it cannot
/// take a record or a block from under a decision made on it.
///
/// The superblock too: a crash between a checkpoint's superblock write and
/// its fsync leaves the new copy in the page cache only, and the open read
/// it (its journal starts again at offset 0). Left unsynced, a power cut
/// after recovery brought the older copy back, whose journal the records
/// written since had overwritten: writes flushed after the restart were
/// lost (found by `vouch-sim crash` with stepped commits; engine_bugs.rs).
///
/// All at once (`Storage::sync_each`): five objects synced in turn cost
/// five device cache flushes before the replay starts.
fn sync_what_a_crash_left(shared: &Shared) -> Result<()> {
    shared
        .io()
        .sync_objects(&crate::storage::objects_of(&shared.io().geometry))
}

/// Make what recovery decided durable before anything new is written:
/// with reverted blocks (split) the data is fsynced, and contexts reverted to older
/// writes are journaled again, so a later flush that advances
/// `data_durable_seq` past the replayed commits cannot make their newer
/// contexts authoritative. Marks the superblock open. Data redone from
/// the journal (packed, and split's redo records) is not synced here: the
/// journal holds it until a checkpoint syncs it (module comment), and its
/// fsync was most of a packed restart (every replayed record's two pages
/// written back) and the last fsync of a split one.
fn persist(
    shared: &Shared,
    committer: &Committer,
    journal: &mut Journal,
    resolutions: Vec<JournalEntry>,
) -> Result<()> {
    if !resolutions.is_empty() {
        for segment in 0..shared.io().geometry.segments() {
            journal.note_unsynced(ObjectId::Data(segment));
        }
    }
    committer.sync_data(shared, journal)?;
    if !resolutions.is_empty() {
        committer.append(shared, journal, &resolutions, None)?;
    }
    if journal.superblock().state == STATE_CLEAN {
        committer.mark_open(shared, journal)?;
    }
    Ok(())
}

/// A record that passed its checksums but names blocks past the end of
/// the volume, or lacks what its layout's replay needs, was not written by
/// vouch: refuse to open rather than panic or guess.
fn check_record(shared: &Shared, record: &Record) -> Result<()> {
    let corrupt = |why: String| {
        Err(Error::Corrupt(format!(
            "corrupt journal record {}: {why}; refusing to open",
            record.header.seq
        )))
    };
    let blocks = shared.io().geometry.blocks;
    for entry in &record.entries {
        let end = entry.lba.checked_add(u64::from(entry.count));
        if end.is_none_or(|end| end > blocks) {
            return corrupt(format!(
                "entry {}+{} is past the end of the volume ({blocks} blocks)",
                entry.lba, entry.count
            ));
        }
    }
    for layout in shared.layouts().layouts() {
        if let Err(why) = layout.check_record(record) {
            return corrupt(why);
        }
    }
    Ok(())
}
