//! Changed blocks: which blocks of a volume differ from a snapshot of it
//! (or one snapshot from another), told from the protection information
//! both keep, never from their data (`vouch diff`, the NBD contexts
//! `qemu:dirty-bitmap:NAME` and, for a clone, `qemu:allocation-depth`).
//!
//! Each block's context as it stands (`BlockDevice::stored_contexts`) is
//! compared with the snapshot's: a block is unchanged only when both are
//! known and equal. Equal contexts are equal data: a data context binds
//! the write's generation and a guard over its bytes (an encrypted one,
//! its random nonce and the AEAD tag over them), so a block rewritten
//! since, even with the same bytes, has a new generation and is changed;
//! a block trimmed or zeroed since has a zero context of its commit's
//! generation, or (trimmed with its whole unit) none where the snapshot
//! had one: changed. Anything not known on either side (lost or damaged
//! metadata, a block still in the write-back buffer, a block past the
//! snapshot's end) is changed: absence is never emptiness, and a backup
//! that skipped such a block could keep stale bytes.
//!
//! Why compare rather than test each generation against the snapshot's
//! checkpoint: a unit trimmed whole keeps its generation only in the
//! written map (its slots are blank or vacant), and generations are the
//! low 32 bits of the journal sequence; comparing needs neither, and both
//! sides are metadata read the way block status reads it.

use crate::device::BlockDevice;
use crate::error::Result;
use crate::layout::StoredContext;
use crate::state::BLOCK;
use vouch_format::Context;

/// Blocks compared per `stored_contexts` call.
const CHUNK_BLOCKS: u64 = 65536;

/// How a block of `now` stands against the same block of `then`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Both never written (or trimmed with their whole unit).
    NeverWritten,
    /// The same context in both: the same data.
    Same,
    /// Written, trimmed or zeroed since, or not known.
    Changed,
}

/// Compare one block's contexts.
fn compare(then: Option<StoredContext>, now: StoredContext) -> Change {
    match (then, now) {
        (Some(StoredContext::Stored(a)), StoredContext::Stored(b)) if a == b => {
            if b == Context::Unwritten {
                Change::NeverWritten
            } else {
                Change::Same
            }
        }
        _ => Change::Changed,
    }
}

/// How each block of `now` in `[first, first + count)` stands against
/// `then`, as runs of `(blocks, change)`. `then` may be shorter than
/// `now` (a volume grown since): the blocks past its end are changed.
pub fn compare_runs(
    then: &dyn BlockDevice,
    now: &dyn BlockDevice,
    first: u64,
    count: u64,
) -> Result<Vec<(u64, Change)>> {
    let then_blocks = then.size() / BLOCK;
    let mut runs: Vec<(u64, Change)> = Vec::new();
    let end = first + count;
    let mut lba = first;
    while lba < end {
        let chunk_end = (lba + CHUNK_BLOCKS).min(end);
        let current = now.stored_contexts(lba, chunk_end - lba)?;
        let before = if lba < then_blocks {
            then.stored_contexts(lba, chunk_end.min(then_blocks) - lba)?
        } else {
            Vec::new()
        };
        for (index, found) in current.into_iter().enumerate() {
            let change = compare(before.get(index).copied(), found);
            match runs.last_mut() {
                Some((blocks, last)) if *last == change => *blocks += 1,
                _ => runs.push((1, change)),
            }
        }
        lba = chunk_end;
    }
    Ok(runs)
}

/// The byte ranges of `now` changed since `then`, merged: `(offset, length)`.
pub fn changed_ranges(then: &dyn BlockDevice, now: &dyn BlockDevice) -> Result<Vec<(u64, u64)>> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    let mut lba = 0;
    for (blocks, change) in compare_runs(then, now, 0, now.size() / BLOCK)? {
        if change == Change::Changed {
            ranges.push((lba * BLOCK, blocks * BLOCK));
        }
        lba += blocks;
    }
    Ok(ranges)
}
