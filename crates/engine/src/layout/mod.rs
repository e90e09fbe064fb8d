//! Layouts: where a block and its context live, and how a run of blocks is
//! written home, read back, replayed after a crash, scanned, and reported
//! by block status. Every difference between `split` and `packed` is a
//! method of `Layout`; nothing outside this folder asks which layout a
//! volume has.
//!
//! `LayoutMap` says which layout serves which range of LBAs. A volume has
//! one span today; online migration between layouts is a second span
//! growing over the first, and every caller already goes through the map.

mod packed;
mod split;

use std::collections::BTreeSet;
use std::ops::Range;

use parking_lot::RwLock;
use vouch_format::{Context, FormatError, Geometry, JournalEntry, LayoutKind};

use crate::backing::Backing;
use crate::contexts::{ContextStore, Page};
use crate::error::Result;
use crate::journal::Record;
use crate::protection::Protection;
use crate::recovery::report::RecoveryReport;
use crate::state::{DirtyBlock, RangeOp, VolumeState};
use crate::storage::{ObjectId, Run, Wait};

pub(crate) use packed::PackedLayout;
pub(crate) use split::SplitLayout;

/// Where a block that is not buffered in memory reads from.
/// The bytes one I/O reads for a run of home blocks (`Layout::run_span`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunSpan {
    pub object: ObjectId,
    pub offset: u64,
    pub len: usize,
}

pub(crate) enum Planned {
    /// Its context reads as zero (a hole, or zeroes written: which one is
    /// kept, so a block moved sealed stays what it was): no data I/O.
    Zero(Context),
    /// Home storage, verified against the context found there.
    Home(ContextFrom),
    /// The context table page holding its context must be loaded first.
    NeedPage(u64),
}

impl Planned {
    /// A block whose context was found (in memory, or in a page just
    /// loaded): zero without data I/O when it reads as zero, else home
    /// verified against it. The one rule: split's `plan` and a worker's
    /// page load (`Shared::plan_read`) both use it.
    pub(crate) fn from_context(found: Result<Context, FormatError>) -> Planned {
        match found {
            Ok(context) if context.reads_as_zero() => Planned::Zero(context),
            found => Planned::Home(ContextFrom::Known(found)),
        }
    }
}

/// Where the context of a block read from home comes from.
#[derive(Clone)]
pub(crate) enum ContextFrom {
    /// Looked up while planning (split: the context table or memory).
    Known(Result<Context, FormatError>),
    /// Stored with the block and read with it (packed records).
    Record,
}

/// What a block status query reports for a run of blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// Never written or trimmed: reads as zeros, holds no data.
    Hole,
    /// Written as zeroes: reads as zeros, counts as allocated.
    Zero,
    Data,
}

/// A block's protection information as it stands (`Layout::stored_contexts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredContext {
    /// In the write-back buffer: newer than anything stored.
    Buffered,
    /// The context stored for it (`Unwritten`: never written, or trimmed
    /// with its whole unit).
    Stored(Context),
    /// Its context cannot be read or does not decode, or its unit's
    /// metadata is lost: what it holds is not known.
    Unknown,
}

impl StoredContext {
    /// What block status reports for it: an unknown context is data (a
    /// read names the fault), never a hole.
    pub fn allocation(self) -> Allocation {
        match self {
            StoredContext::Stored(Context::Unwritten) => Allocation::Hole,
            StoredContext::Stored(Context::Zero { .. }) => Allocation::Zero,
            _ => Allocation::Data,
        }
    }
}

/// Context pages a checkpoint wrote, each with its new content when it is
/// among the last the checkpoint wrote, as many as the context cache holds
/// (`None`: written, content not kept).
pub(crate) type WrittenPages = Vec<(u64, Option<Page>)>;

/// Where a metadata unit lives: its object, byte range, and its name.
pub(crate) struct UnitPlace {
    pub object: ObjectId,
    pub offset: u64,
    pub len: usize,
    /// "page 40" or "row 12" (numbered within its object).
    pub name: String,
}

/// What a layout's replay works with at open.
pub(crate) struct Replay<'a> {
    pub io: &'a Backing,
    pub protection: &'a dyn Protection,
    pub state: &'a RwLock<VolumeState>,
    /// Objects written by the replay (to be synced before anything new).
    pub unsynced: &'a mut BTreeSet<ObjectId>,
    pub report: &'a mut RecoveryReport,
}

/// One layout's behaviour. Methods take what they need (the backing
/// storage, the in-memory state) rather than the whole volume.
pub(crate) trait Layout: Send + Sync {
    fn kind(&self) -> LayoutKind;

    fn geometry(&self) -> &Geometry;

    /// Journal records carry the blocks' data (a redo log), because home
    /// writes are not atomic with their contexts.
    fn journals_data(&self) -> bool;

    /// Contexts live in the context table (and `ContextStore` between
    /// checkpoints) rather than beside each block.
    fn contexts_in_table(&self) -> bool;

    /// Where a block that is not buffered reads from.
    fn plan(&self, lba: u64, contexts: &ContextStore) -> Planned;

    /// Read `count` consecutive blocks from home into `out`. Returns the
    /// contexts stored with them (empty when contexts live elsewhere).
    /// An error means some block of the run is unreadable, or, with
    /// `Wait::NoWait`, that reading it would have to wait for the device.
    fn read_run(
        &self,
        io: &Backing,
        first: u64,
        count: u64,
        out: &mut [u8],
        wait: Wait,
    ) -> std::io::Result<Vec<Result<Context, FormatError>>>;

    /// Where one I/O reads what `read_run(first, count)` reads: its object
    /// and a byte range aligned to 4 KiB (for reads that complete later).
    fn run_span(&self, first: u64, count: u64) -> RunSpan;

    /// `read_run`'s result from the bytes read at `run_span`: the blocks
    /// into `out`, and the contexts stored with them (empty when contexts
    /// live elsewhere). A blank context in a unit the written map says was
    /// written is `MetadataLost` here: only `read_run`, which may read
    /// more, can clear it (a unit that is not blank).
    fn run_from_span(
        &self,
        io: &Backing,
        first: u64,
        count: u64,
        span: &[u8],
        out: &mut [u8],
    ) -> Vec<Result<Context, FormatError>>;

    /// Read one block from home; returns its stored context, if it has one.
    fn read_block(
        &self,
        io: &Backing,
        lba: u64,
        block: &mut [u8],
    ) -> std::io::Result<Option<Result<Context, FormatError>>>;

    /// Write committed blocks home, after ORDER POINT A (their order on the
    /// media no longer matters). `contexts[i]` is `blocks[i]`'s new context.
    fn write_home(
        &self,
        io: &Backing,
        blocks: &[(u64, DirtyBlock)],
        contexts: &[Context],
        unsynced: &mut BTreeSet<ObjectId>,
    ) -> Result<()>;

    /// Apply a trim / write-zeroes to home storage.
    fn apply_range_home(
        &self,
        io: &Backing,
        range: &RangeOp,
        unsynced: &mut BTreeSet<ObjectId>,
    ) -> Result<()>;

    /// The first LBA at or after `lba` that may hold data or a context on
    /// disk (holes are skipped with SEEK_DATA), or `None`.
    fn next_data_on_disk(&self, io: &Backing, lba: u64) -> Result<Option<u64>>;

    /// The protection information of blocks `[first, first + count)` as
    /// it stands, read without their data (split: the context table and
    /// memory; packed: each record's 32 context bytes); `buffered[i]`
    /// says block `first + i` is in the write-back buffer. Judged as a
    /// read judges it: lost metadata is `Unknown`, never a hole. Block
    /// status and changed blocks (`Shared::stored_contexts`) read it.
    fn stored_contexts(
        &self,
        io: &Backing,
        state: &RwLock<VolumeState>,
        first: u64,
        buffered: &[bool],
    ) -> Result<Vec<StoredContext>>;

    /// Where the metadata of written-map unit `unit` lives (a split
    /// context page, a packed row).
    fn unit_place(&self, unit: u64) -> UnitPlace;

    /// The context slots in the bytes of one unit (`unit_place`).
    fn unit_metadata(&self, bytes: &[u8]) -> Vec<[u8; vouch_format::CONTEXT_BYTES]>;

    /// The context slots in the bytes of one unit, to change in place.
    fn unit_slots<'a>(&self, bytes: &'a mut [u8]) -> Vec<&'a mut [u8]>;

    /// The slots of one unit's bytes in LBA order, each with its stored
    /// data when the unit holds it (packed records), to judge or learn
    /// the unit's generation from (`WrittenMap::judge_slots`).
    fn unit_records<'a>(&self, bytes: &'a [u8]) -> Vec<(&'a [u8], Option<&'a [u8]>)>;

    /// Check a record that passed its checksums before replaying it.
    fn check_record(&self, record: &Record) -> std::result::Result<(), String>;

    /// Replay the journal's records at open. Returns the contexts recovery
    /// reverted, to be journaled again.
    fn replay(&self, replay: Replay<'_>, records: &[Record]) -> Result<Vec<JournalEntry>>;

    /// At a checkpoint: move contexts committed since the last one home.
    /// Returns the pages written and the page ranges punched. `next`: the
    /// generation of the next commit (newer than every context so far).
    fn checkpoint_contexts(
        &self,
        io: &Backing,
        state: &RwLock<VolumeState>,
        next: u32,
    ) -> Result<(WrittenPages, Vec<Range<u64>>)>;
}

/// A layout and the LBAs it serves.
struct Span {
    start: u64,
    end: u64,
    layout: Box<dyn Layout>,
}

/// Which layout serves which LBAs (sorted, disjoint spans covering the
/// volume).
pub(crate) struct LayoutMap {
    spans: Vec<Span>,
}

/// The layout a volume of this geometry is created with.
pub(crate) fn for_geometry(geometry: Geometry) -> Box<dyn Layout> {
    match geometry.layout {
        LayoutKind::Split => Box::new(SplitLayout::new(geometry)),
        LayoutKind::Packed => Box::new(PackedLayout::new(geometry)),
    }
}

impl LayoutMap {
    /// One layout for the whole volume.
    pub fn whole(geometry: Geometry) -> LayoutMap {
        LayoutMap {
            spans: vec![Span {
                start: 0,
                end: geometry.blocks,
                layout: for_geometry(geometry),
            }],
        }
    }

    fn span_index(&self, lba: u64) -> usize {
        let index = self.spans.partition_point(|span| span.end <= lba);
        assert!(
            index < self.spans.len() && self.spans[index].start <= lba,
            "LBA {lba} is outside every layout span"
        );
        index
    }

    /// The layout serving `lba`.
    pub fn of(&self, lba: u64) -> &dyn Layout {
        &*self.spans[self.span_index(lba)].layout
    }

    /// Do `a` and `b` belong to the same span (one run may cover both)?
    pub fn same_span(&self, a: u64, b: u64) -> bool {
        self.spans.len() == 1 || self.span_index(a) == self.span_index(b)
    }

    /// The end (exclusive) of the span holding `lba`.
    pub fn span_end(&self, lba: u64) -> u64 {
        self.spans[self.span_index(lba)].end
    }

    /// Every layout, once each.
    pub fn layouts(&self) -> impl Iterator<Item = &dyn Layout> {
        self.spans.iter().map(|span| &*span.layout)
    }

    /// The layout the volume was created with (its first span's).
    pub fn primary(&self) -> &dyn Layout {
        &*self.spans[0].layout
    }

    /// Split `[start, end)` into pieces each served by one layout.
    pub fn pieces(&self, start: u64, end: u64) -> Vec<(u64, u64, &dyn Layout)> {
        let mut pieces = Vec::with_capacity(1);
        let mut at = start;
        while at < end {
            let span = &self.spans[self.span_index(at)];
            let piece_end = span.end.min(end);
            pieces.push((at, piece_end, &*span.layout));
            at = piece_end;
        }
        pieces
    }
}

/// Write runs (sorted by object) one batch per object: their order on the
/// media does not matter once ORDER POINT A has passed.
fn write_runs_by_object(
    io: &Backing,
    runs: &[(ObjectId, u64, Vec<&[u8]>)],
    unsynced: &mut BTreeSet<ObjectId>,
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
        io.write_runs(object, &batch)?;
        unsynced.insert(object);
        start = end;
    }
    Ok(())
}

/// Call `f(start, end)` for each piece of `[start, end)` within one data
/// segment.
fn for_each_segment(
    geometry: &Geometry,
    start: u64,
    end: u64,
    mut f: impl FnMut(u64, u64) -> Result<()>,
) -> Result<()> {
    let mut lba = start;
    while lba < end {
        let segment_end = (lba / geometry.segment_blocks + 1) * geometry.segment_blocks;
        let piece_end = end.min(segment_end);
        f(lba, piece_end)?;
        lba = piece_end;
    }
    Ok(())
}
