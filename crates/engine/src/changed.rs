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

/// A volume as changed blocks see it, region by region: which member
/// serves each region, and which member that is. A volume of one layout
/// is its home member throughout; a volume with regions (`RegionVolume`)
/// serves a region from its home member or from its other member, named
/// by the member's uuid (a member made again by a later migration is
/// another member: its generations start over).
pub struct Serving<'a> {
    home: &'a dyn BlockDevice,
    /// The regions' record and the other member, for a volume with regions.
    regions: Option<(vouch_format::regions::RegionRecord, &'a dyn BlockDevice)>,
    home_layout: Option<vouch_format::LayoutKind>,
    blocks: u64,
    /// The volume the record was read from, when it may still move
    /// regions (an online migration): a piece compared while its record
    /// changed is reported changed.
    live: Option<&'a crate::regions::RegionVolume>,
}

/// Which member serves a block: the home, or the other member of this uuid.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Member {
    Home,
    Other([u8; 16]),
}

impl<'a> Serving<'a> {
    /// A volume of one layout (or a snapshot of one).
    pub fn one(device: &'a dyn BlockDevice) -> Serving<'a> {
        Serving {
            home: device,
            regions: None,
            home_layout: None,
            blocks: device.size() / BLOCK,
            live: None,
        }
    }

    /// A volume with regions (or a snapshot of one), by its record now.
    pub fn regions(volume: &'a crate::regions::RegionVolume) -> Serving<'a> {
        let home = volume.home_layout();
        Serving {
            home: volume.home(),
            regions: Some((
                volume.record(),
                volume.member(crate::regions::other_layout(home)),
            )),
            home_layout: Some(home),
            blocks: volume.blocks(),
            live: Some(volume),
        }
    }

    pub fn size(&self) -> u64 {
        self.blocks * BLOCK
    }

    /// Whether the volume switched a region since its record was read.
    fn switched(&self) -> bool {
        match (&self.regions, self.live) {
            (Some((record, _)), Some(volume)) => record.seq != volume.record_seq(),
            _ => false,
        }
    }

    /// The member serving `lba`, its device, and the end of the run of
    /// blocks from `lba` it serves (the end of `lba`'s region).
    fn at(&self, lba: u64) -> (Member, &'a dyn BlockDevice, u64) {
        match &self.regions {
            Some((record, other)) if lba < self.blocks => {
                let region = record.region_of(lba);
                let end = record.lbas(region, self.blocks).end;
                if Some(record.layouts[region]) == self.home_layout {
                    (Member::Home, self.home, end)
                } else {
                    (Member::Other(record.member_uuid), *other, end)
                }
            }
            _ => (Member::Home, self.home, u64::MAX),
        }
    }
}

/// `compare_runs` of two volumes either of which may have regions: each
/// region compared in the members serving it on each side. A region the
/// same member serves on both sides (the home; or the other member, the
/// same one) compares contexts as `compare_runs` does; a region served by
/// different members (moved between layouts since, or its member made
/// again) has each block written on either side changed, even where the
/// contexts are equal (two journals' generations say nothing of each
/// other), and only blocks never written on both sides unchanged.
pub fn compare_serving_runs(
    then: &Serving,
    now: &Serving,
    first: u64,
    count: u64,
) -> Result<Vec<(u64, Change)>> {
    let mut runs: Vec<(u64, Change)> = Vec::new();
    let end = first + count;
    let mut lba = first;
    while lba < end {
        let (then_member, then_device, then_end) = then.at(lba);
        let (now_member, now_device, now_end) = now.at(lba);
        let piece_end = end.min(then_end).min(now_end);
        let moved = then_member != now_member;
        let compared = compare_runs(then_device, now_device, lba, piece_end - lba)?;
        // A region switched (and its old copy trimmed) since the record
        // was read may have been read as never written: the record no
        // longer says who serves it, so nothing is known (reported changed,
        // while an online migration runs, until the next query).
        let switched = then.switched() || now.switched();
        for (blocks, change) in compared {
            let change = match change {
                Change::Same | Change::NeverWritten if switched => Change::Changed,
                Change::Same if moved => Change::Changed,
                other => other,
            };
            match runs.last_mut() {
                Some((count, last)) if *last == change => *count += blocks,
                _ => runs.push((blocks, change)),
            }
        }
        lba = piece_end;
    }
    Ok(runs)
}

/// `changed_ranges` of two volumes either of which may have regions.
pub fn changed_serving_ranges(then: &Serving, now: &Serving) -> Result<Vec<(u64, u64)>> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    let mut lba = 0;
    for (blocks, change) in compare_serving_runs(then, now, 0, now.blocks)? {
        if change == Change::Changed {
            match ranges.last_mut() {
                Some((offset, length)) if *offset + *length == lba * BLOCK => {
                    *length += blocks * BLOCK
                }
                _ => ranges.push((lba * BLOCK, blocks * BLOCK)),
            }
        }
        lba += blocks;
    }
    Ok(ranges)
}
