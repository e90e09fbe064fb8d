//! Lost metadata in the detection matrix (`vouch-sim metadata`): damage to
//! the files of a closed volume as a bad copy, a full disk or an operator's
//! mistake leaves it — a file cut short, emptied or deleted, a metadata unit
//! (a split context page, a packed row) or a 4 KiB page zeroed, a unit copied
//! in from another place or from another volume, an older copy of a file
//! restored, the written map lost — then the volume is opened as `serve`
//! opens it (writable) and every block is read.
//!
//! Absence is never emptiness: each block must read as its data or fail
//! with a fault naming its LBA — or the open must refuse, naming the damaged
//! file. Each injection is classified like the media faults (`faults.rs`):
//! detected (a fault or a refusal naming the file), silently wrong (a block
//! the damage touched returned bytes that are not the model's: zeros for a
//! written block is the case this exists for), harmless (every block read
//! right). Beside that, on every injection:
//! - blocks the damage did not touch read right (no collateral);
//! - `check()` lists exactly the blocks whose reads fail;
//! - after a close (a checkpoint) and a reopen, every block that failed still
//!   fails or reads right: a checkpoint never turns a loss into zeros.
//!
//! Volumes are written and opened on the production scheduling
//! (`crate::stepper`): a background committer the seed steps, after each
//! operation of a write round, and writes taking the inline route
//! (`try_write_shared`) half the time, so the metadata damaged is what
//! those commits and their checkpoints left.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use vouch_engine::{
    BlockDevice, CreateOptions, Error, GuardKind, LayoutKind, ObjectId, OpenOptions,
    OrderingBreaks, SimStorage, Storage, Tuning, Volume, ZeroFlags,
};
use vouch_format::layout::{PACKED_RECORDS_PER_ROW, PACKED_RECORD_BYTES, PACKED_ROW_BYTES};

use crate::faults::{
    all_cells, cell_violation, run_cells, segment_blocks, Cell, Outcome, Tally, BLOCKS,
};
use crate::rng::Rng;
use crate::BLOCK;

/// Contexts in one 4 KiB page of the split layout's `contexts` file.
const CONTEXTS_PER_PAGE: u64 = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MetaKind {
    UnitZeroed,
    PageZeroed,
    CutShort,
    Emptied,
    Deleted,
    UnitFromElsewhere,
    UnitFromOtherVolume,
    OlderCopy,
    OlderVolumeCopy,
    WrittenMapLost,
    NewestGenerationFlipped,
}

impl MetaKind {
    pub const ALL: [MetaKind; 11] = [
        MetaKind::UnitZeroed,
        MetaKind::PageZeroed,
        MetaKind::CutShort,
        MetaKind::Emptied,
        MetaKind::Deleted,
        MetaKind::UnitFromElsewhere,
        MetaKind::UnitFromOtherVolume,
        MetaKind::OlderCopy,
        MetaKind::OlderVolumeCopy,
        MetaKind::WrittenMapLost,
        MetaKind::NewestGenerationFlipped,
    ];

    pub fn label(self) -> &'static str {
        match self {
            MetaKind::UnitZeroed => "metadata unit zeroed (split: context page; packed: row)",
            MetaKind::PageZeroed => "4 KiB page of a file zeroed (contexts or data)",
            MetaKind::CutShort => "file cut short",
            MetaKind::Emptied => "file emptied",
            MetaKind::Deleted => "file deleted",
            MetaKind::UnitFromElsewhere => "unit copied from another place",
            MetaKind::UnitFromOtherVolume => "unit copied from another volume",
            MetaKind::OlderCopy => "older copy of a file restored",
            MetaKind::OlderVolumeCopy => {
                "older copy of every data and contexts file restored together"
            }
            MetaKind::WrittenMapLost => "written map damaged or lost",
            MetaKind::NewestGenerationFlipped => {
                "one or two bits flipped in a unit's newest generation (split: context page; packed: row)"
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct MetaConfig {
    pub cells: Vec<Cell>,
    /// Injections per kind per cell.
    pub count: u64,
    pub seed: u64,
    pub threads: usize,
    pub encrypted: bool,
}

impl MetaConfig {
    pub fn all(count: u64, seed: u64, encrypted: bool) -> MetaConfig {
        MetaConfig {
            cells: all_cells(),
            count,
            seed,
            threads: 2,
            encrypted,
        }
    }
}

#[derive(Debug, Default)]
pub struct MetaReport {
    pub tallies: BTreeMap<(usize, MetaKind), Tally>,
    /// Injections the open refused, naming the damaged file.
    pub refused: BTreeMap<(usize, MetaKind), u64>,
    pub injections: u64,
    /// Writes of the write rounds the inline route took, and requested
    /// commits the simulator ran as the background committer.
    pub inline_writes: u64,
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

/// Whether the design claims that this damage is never silent in this
/// cell: what the written map (a bit per split context page / packed row,
/// kept apart from the metadata), whole units (every slot of a written
/// unit holds a context or a vacant marker bound to its LBA and volume)
/// and the files' expected lengths catch today. Claimed in every cell: a
/// unit zeroed, copied from another place or another volume, a deleted
/// file, a damaged map, a file cut short or emptied (packed: a blank slot
/// in a written row is lost; split contexts: blank slots of written
/// pages; split data: a block with a data context past the end of its
/// segment is lost, whatever the guard). A zeroed 4 KiB page is claimed
/// where the guard has 32 bits or more: a page of data only is a long
/// error, and a 16-bit guard lets one in 65536 through (the media
/// matrix's rule).
/// An older copy of a file is claimed in split with a guard of 32 bits or
/// more: a context page older than expected is lost, and an older data
/// file fails the guard (encrypted: its AEAD; a 16-bit guard, as for a
/// zeroed page, lets a long error through once in 65536). In packed it is
/// claimed in every cell: a row older than its expected generation is
/// lost whatever the guard (only generations judge it), and a trim or
/// zeros written into part of a row read its expectation back from its
/// slots rather than forget it.
/// One or two bits flipped in the generation of a unit's newest slot are claimed
/// everywhere, and only its own block may fail (the rest of the unit must
/// read right: `affected` holds that block alone): a plain context's CRC
/// fails, and an encrypted one's keyless guard over its data (read whole
/// with a packed row; read for a split page that looks older than
/// expected, `WrittenMap::stale_page_read`).
/// An older copy of every data and contexts file and of `written` restored
/// together (the superblock and journal current) is claimed everywhere:
/// the open refuses when the map's generations copy is not the one the
/// superblock names, else it is judged as follows: a split
/// page's contexts and data agree with each other, so only the page's
/// expected generation catches it, under any guard (a page trimmed or
/// zeroed whole since expects its checkpoint's next generation); a packed
/// row as for one file.
/// Not claimed (measured, listed in docs/RELIABILITY.md): an older copy of
/// a split data file under guard `none` (nothing compares data with its
/// context: out of reach by design).
fn claimed(kind: MetaKind, layout: LayoutKind, guard: GuardKind) -> bool {
    let guarded = guard != GuardKind::None;
    match kind {
        MetaKind::UnitZeroed
        | MetaKind::Deleted
        | MetaKind::WrittenMapLost
        | MetaKind::UnitFromElsewhere
        | MetaKind::UnitFromOtherVolume
        | MetaKind::Emptied
        | MetaKind::CutShort
        | MetaKind::OlderVolumeCopy
        | MetaKind::NewestGenerationFlipped => true,
        MetaKind::PageZeroed => guarded && guard.bits() >= 32,
        MetaKind::OlderCopy => layout == LayoutKind::Packed || (guarded && guard.bits() >= 32),
    }
}

pub fn run(config: &MetaConfig) -> MetaReport {
    let started = Instant::now();
    let report = Mutex::new(MetaReport::default());
    run_cells(
        config.cells.len(),
        config.count,
        config.threads,
        |index, part, count| {
            let (layout, guard) = config.cells[index];
            let seed = config
                .seed
                .wrapping_mul(1_000_033)
                .wrapping_add(index as u64 * 131 + part);
            (seed, run_cell(layout, guard, config.encrypted, count, seed))
        },
        |index, (seed, cell)| {
            let (layout, guard) = config.cells[index];
            let mut report = report.lock();
            for (kind, tally) in cell.tallies {
                report
                    .tallies
                    .entry((index, kind))
                    .or_default()
                    .merge(&tally);
            }
            for (kind, refused) in cell.refused {
                *report.refused.entry((index, kind)).or_default() += refused;
            }
            report.injections += cell.injections;
            report.inline_writes += cell.scheduled.inline_writes;
            report.background_commits += cell.scheduled.background_commits;
            for violation in cell.violations {
                report.violations.push(cell_violation(
                    (layout, guard),
                    config.encrypted,
                    seed,
                    &violation,
                ));
            }
        },
    );
    let mut report = report.into_inner();
    report.seconds = started.elapsed().as_secs_f64();
    report
}

impl MetaReport {
    /// The Markdown rows (silently wrong over the injections that changed
    /// what a read returns, and how many of the detections were refusals at
    /// open) and a summary line.
    pub fn render(&self, config: &MetaConfig) -> String {
        let mut out = String::new();
        let encrypted = if config.encrypted { " encrypted" } else { "" };
        let _ = write!(out, "| damage |");
        for (layout, guard) in &config.cells {
            let _ = write!(out, " {} {}{encrypted} |", layout.name(), guard.name());
        }
        out.push_str("\n|---|");
        for _ in &config.cells {
            out.push_str("---|");
        }
        out.push('\n');
        for kind in MetaKind::ALL {
            let _ = write!(out, "| {} |", kind.label());
            for index in 0..config.cells.len() {
                let tally = self
                    .tallies
                    .get(&(index, kind))
                    .copied()
                    .unwrap_or_default();
                let refused = self.refused.get(&(index, kind)).copied().unwrap_or(0);
                let tried = tally.detected + tally.silent + tally.harmless;
                let _ = write!(
                    out,
                    " {tried} tried: {} silent, {} detected ({refused} at open) |",
                    tally.silent, tally.detected
                );
            }
            out.push('\n');
        }
        for violation in &self.violations {
            let _ = writeln!(out, "{violation}");
        }
        let (mut detected, mut silent, mut harmless) = (0, 0, 0);
        for tally in self.tallies.values() {
            detected += tally.detected;
            silent += tally.silent;
            harmless += tally.harmless;
        }
        let _ = writeln!(
            out,
            "metadata: cells={} injections={} (inline writes {}, background commits {}) outcomes: detected={detected} silently-wrong={silent} harmless={harmless} violations={} time={:.1}s",
            config.cells.len(),
            self.injections,
            self.inline_writes,
            self.background_commits,
            self.violations.len(),
            self.seconds
        );
        out
    }
}

/// What the production scheduling took in a cell's write rounds.
#[derive(Default)]
pub(crate) struct Scheduled {
    pub(crate) inline_writes: u64,
    pub(crate) background_commits: u64,
}

#[derive(Default)]
struct CellResult {
    tallies: BTreeMap<MetaKind, Tally>,
    refused: BTreeMap<MetaKind, u64>,
    injections: u64,
    scheduled: Scheduled,
    violations: Vec<String>,
}

/// One prepared volume and what each injection starts from.
struct Cx {
    layout: LayoutKind,
    guard: GuardKind,
    open: OpenOptions,
    geometry: vouch_format::Geometry,
    /// The volume, closed, every context at home.
    pristine: SimStorage,
    /// The same volume before its second round of writes.
    older: SimStorage,
    /// Another volume of the same shape (another uuid, other data).
    other: SimStorage,
    model: Vec<Vec<u8>>,
    rng: Rng,
    /// `NewestGenerationFlipped`'s own stream (`inject`).
    flip_rng: Rng,
    result: CellResult,
    /// The kind being classified (`claimed` is asked per kind).
    kind_now: MetaKind,
}

/// What one injection did: the storage to open, the blocks it may have
/// touched, and the file it damaged (a refusal must name it).
struct Damage {
    storage: SimStorage,
    affected: BTreeSet<u64>,
    file: String,
    what: String,
}

fn create_options(
    layout: LayoutKind,
    guard: GuardKind,
    key: Option<vouch_engine::UserSecret>,
) -> CreateOptions {
    let mut options = CreateOptions::new(BLOCKS * BLOCK as u64);
    options.layout = layout;
    options.guard = guard;
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(segment_blocks(layout));
    options.encrypt = key;
    options
}

/// Write a random mix over `fraction_percent` of the blocks: data (kept in
/// `model`; the inline route half the time), written zeroes and trims,
/// each followed, one time in two, by the commit it requested; then close.
pub(crate) fn write_round(
    storage: &SimStorage,
    open: &OpenOptions,
    model: &mut [Vec<u8>],
    rng: &mut Rng,
    fraction_percent: u64,
    scheduled: &mut Scheduled,
) -> Result<(), String> {
    let volume = Volume::open(Arc::new(storage.clone()), open).map_err(|e| format!("open: {e}"))?;
    for lba in 0..BLOCKS {
        if rng.below(100) >= fraction_percent {
            continue;
        }
        let offset = lba * BLOCK as u64;
        match rng.below(10) {
            0 => {
                volume
                    .write_zeroes(
                        offset,
                        BLOCK as u64,
                        ZeroFlags {
                            fua: false,
                            allocate: true,
                        },
                    )
                    .map_err(|e| format!("zeroes: {e}"))?;
                model[lba as usize] = vec![0u8; BLOCK];
            }
            1 => {
                volume
                    .trim(offset, BLOCK as u64, false)
                    .map_err(|e| format!("trim: {e}"))?;
                model[lba as usize] = vec![0u8; BLOCK];
            }
            _ => {
                let data = bytes::Bytes::from(rng.bytes(BLOCK));
                let inline = rng.chance(1, 2);
                if crate::stepper::write_as_served(&volume, offset, &data, false, inline)
                    .map_err(|e| format!("write: {e}"))?
                {
                    scheduled.inline_writes += 1;
                }
                model[lba as usize] = data.to_vec();
            }
        }
        scheduled.background_commits += crate::stepper::step_commits([&volume], rng);
    }
    volume.close().map_err(|e| format!("close: {e}"))
}

/// After the rounds of writes, change whole units (a packed row, a split
/// context page) as a filesystem's discard or a zeroing tool does: each,
/// one time in three, is trimmed (whole, or in two partial pieces that
/// leave it vacant), zeroed by a write-zeroes that may punch
/// (as a trim does) or zeroed by one that keeps it allocated (a zero
/// context in every slot), then the volume is closed. Run after the older
/// copy is taken, so the older copy's units changed whole since are
/// restored over them: their expectation is then the trim's or the zeros'
/// generation, and the older copy is judged older, not read as current.
fn whole_unit_round(
    storage: &SimStorage,
    open: &OpenOptions,
    (layout, model): (LayoutKind, &mut [Vec<u8>]),
    rng: &mut Rng,
    scheduled: &mut Scheduled,
) -> Result<(), String> {
    let volume = Volume::open(Arc::new(storage.clone()), open).map_err(|e| format!("open: {e}"))?;
    let unit_blocks = match layout {
        LayoutKind::Packed => PACKED_RECORDS_PER_ROW,
        LayoutKind::Split => CONTEXTS_PER_PAGE,
    };
    let units = BLOCKS / unit_blocks;
    let mut changed = 0;
    for unit in 0..units {
        // One unit at least keeps its records (a split volume has two):
        // a damage class that needs a unit holding something finds one.
        if unit == units - 1 && changed == units - 1 {
            break;
        }
        let (offset, length) = (
            unit * unit_blocks * BLOCK as u64,
            unit_blocks * BLOCK as u64,
        );
        match rng.below(12) {
            0 => volume.trim(offset, length, false),
            // Trimmed in two pieces (`blkdiscard` in pieces not aligned to
            // units): each partial, together leaving the unit vacant.
            3 => {
                let cut = rng.range(1, unit_blocks - 1) * BLOCK as u64;
                volume
                    .trim(offset, cut, false)
                    .and_then(|()| volume.trim(offset + cut, length - cut, false))
            }
            1 | 2 => volume.write_zeroes(
                offset,
                length,
                ZeroFlags {
                    fua: false,
                    allocate: rng.below(2) == 1,
                },
            ),
            _ => continue,
        }
        .map_err(|e| format!("unit {unit} zeroed or trimmed whole: {e}"))?;
        changed += 1;
        let first = (unit * unit_blocks) as usize;
        for block in &mut model[first..first + unit_blocks as usize] {
            *block = vec![0u8; BLOCK];
        }
        scheduled.background_commits += crate::stepper::step_commits([&volume], rng);
    }
    volume.close().map_err(|e| format!("close: {e}"))
}

/// The volume after both rounds of writes, the same volume after the
/// first, another volume, and the model of the first.
type Prepared = (SimStorage, SimStorage, SimStorage, Vec<Vec<u8>>);

fn run_cell(
    layout: LayoutKind,
    guard: GuardKind,
    encrypted: bool,
    count: u64,
    seed: u64,
) -> CellResult {
    let key = encrypted.then(|| crate::crash::seed_key(seed));
    let mut rng = Rng::new(seed);
    // `serve`'s scheduling, stepped: a background committer, and a
    // write-back buffer small enough that writers request commits.
    let open = OpenOptions {
        key: key.clone(),
        ..crate::stepper::Stepper::new(OrderingBreaks::default()).options(Tuning {
            context_cache_pages: 1,
            overlay_limit: 1024,
            ..crate::stepper::stepped_tuning(&mut rng)
        })
    };
    let mut result = CellResult::default();
    let scheduled = &mut result.scheduled;
    let prepared = (|| -> Result<Prepared, String> {
        let options = create_options(layout, guard, key.clone());
        let storage = SimStorage::new();
        Volume::create(Arc::new(storage.clone()), &options)
            .and_then(Volume::close)
            .map_err(|e| format!("create: {e}"))?;
        let mut model = vec![vec![0u8; BLOCK]; BLOCKS as usize];
        write_round(&storage, &open, &mut model, &mut rng, 60, scheduled)?;
        let older = storage.duplicate();
        write_round(&storage, &open, &mut model, &mut rng, 40, scheduled)?;
        // Its own stream: the rounds above draw as they did before it.
        let mut whole = Rng::new(seed ^ 0x7768_6f6c_6500);
        whole_unit_round(&storage, &open, (layout, &mut model), &mut whole, scheduled)?;
        let other = SimStorage::new();
        Volume::create(Arc::new(other.clone()), &options)
            .and_then(Volume::close)
            .map_err(|e| format!("create the other volume: {e}"))?;
        let mut other_model = vec![vec![0u8; BLOCK]; BLOCKS as usize];
        write_round(&other, &open, &mut other_model, &mut rng, 90, scheduled)?;
        Ok((storage, older, other, model))
    })();
    let (pristine, older, other, model) = match prepared {
        Ok(prepared) => prepared,
        Err(error) => {
            result.violations.push(format!("prepare: {error}"));
            return result;
        }
    };
    let geometry =
        vouch_format::Geometry::new(layout, BLOCKS * BLOCK as u64, segment_blocks(layout))
            .expect("valid geometry");
    let mut cx = Cx {
        layout,
        guard,
        open,
        geometry,
        pristine,
        older,
        other,
        model,
        rng: rng.fork(),
        flip_rng: rng.fork(),
        result,
        kind_now: MetaKind::UnitZeroed,
    };
    for _ in 0..count {
        for kind in MetaKind::ALL {
            let damage = cx.inject(kind);
            cx.classify(kind, damage);
            cx.result.injections += 1;
        }
    }
    cx.result
}

impl Cx {
    fn violation(&mut self, message: String) {
        if self.result.violations.len() < 20 {
            self.result.violations.push(message);
        }
    }

    /// The files that hold a block's data or metadata.
    fn files(&self) -> Vec<ObjectId> {
        let mut files = Vec::new();
        if self.layout == LayoutKind::Split {
            files.push(ObjectId::Contexts);
        }
        files.extend((0..self.geometry.segments()).map(ObjectId::Data));
        files
    }

    fn nominal_len(&self, object: ObjectId) -> u64 {
        match object {
            ObjectId::Contexts => self.geometry.contexts_len(),
            ObjectId::Data(segment) => self.geometry.segment_len(segment),
            _ => 0,
        }
    }

    fn segment_lbas(&self, segment: u32) -> Range<u64> {
        let first = u64::from(segment) * self.geometry.segment_blocks;
        first..(first + self.geometry.segment_blocks).min(BLOCKS)
    }

    /// Blocks whose data or metadata overlaps bytes `range` of `object`,
    /// widened to whole metadata units (a unit is lost or kept whole).
    fn blocks_at(&self, object: ObjectId, range: Range<u64>) -> BTreeSet<u64> {
        let mut blocks = BTreeSet::new();
        if range.is_empty() {
            return blocks;
        }
        match (object, self.layout) {
            (ObjectId::Contexts, _) => {
                let first = range.start / 32;
                let end = range.end.div_ceil(32).min(BLOCKS);
                let first = first - first % CONTEXTS_PER_PAGE;
                let end = end.div_ceil(CONTEXTS_PER_PAGE) * CONTEXTS_PER_PAGE;
                blocks.extend(first..end.min(BLOCKS));
            }
            (ObjectId::Data(segment), LayoutKind::Split) => {
                let lbas = self.segment_lbas(segment);
                for slot in range.start / BLOCK as u64..range.end.div_ceil(BLOCK as u64) {
                    if lbas.start + slot < lbas.end {
                        blocks.insert(lbas.start + slot);
                    }
                }
            }
            (ObjectId::Data(segment), LayoutKind::Packed) => {
                let lbas = self.segment_lbas(segment);
                for lba in lbas.clone() {
                    let slot = lba - lbas.start;
                    let row = slot / PACKED_RECORDS_PER_ROW;
                    let at = row * PACKED_ROW_BYTES
                        + (slot % PACKED_RECORDS_PER_ROW) * PACKED_RECORD_BYTES;
                    if at < range.end && range.start < at + PACKED_RECORD_BYTES {
                        // The whole row: its unit.
                        let row_first = lbas.start + row * PACKED_RECORDS_PER_ROW;
                        blocks
                            .extend(row_first..(row_first + PACKED_RECORDS_PER_ROW).min(lbas.end));
                    }
                }
            }
            _ => {}
        }
        blocks
    }

    /// A metadata unit: its object and byte range (split: a context page;
    /// packed: a row of a segment).
    /// Whether a unit's bytes (`random_unit`'s) hold a record: a context
    /// slot that is neither blank nor a marker (vacant, lost).
    fn holds_record(&self, bytes: &[u8]) -> bool {
        let slots: Vec<&[u8]> = match self.layout {
            LayoutKind::Split => bytes.chunks(32).collect(),
            LayoutKind::Packed => (0..PACKED_RECORDS_PER_ROW as usize)
                .map(|slot| {
                    let at = slot * PACKED_RECORD_BYTES as usize + BLOCK;
                    &bytes[at..at + 32]
                })
                .collect(),
        };
        slots.iter().any(|slot| {
            slot.iter().any(|byte| *byte != 0)
                && !matches!(slot[0], vouch_format::KIND_VACANT | vouch_format::KIND_LOST)
        })
    }

    fn random_unit(&mut self) -> (ObjectId, Range<u64>) {
        match self.layout {
            LayoutKind::Split => {
                let pages = BLOCKS.div_ceil(CONTEXTS_PER_PAGE);
                let page = self.rng.below(pages);
                (ObjectId::Contexts, page * 4096..(page + 1) * 4096)
            }
            LayoutKind::Packed => {
                let segment = self.rng.below(u64::from(self.geometry.segments())) as u32;
                let rows = self.nominal_len(ObjectId::Data(segment)) / PACKED_ROW_BYTES;
                let row = self.rng.below(rows.max(1));
                (
                    ObjectId::Data(segment),
                    row * PACKED_ROW_BYTES..(row + 1) * PACKED_ROW_BYTES,
                )
            }
        }
    }

    /// A random unit's slots holding its newest generation (a plain
    /// context's or an encrypted one's; a commit gives every block it
    /// writes the same one, so there may be several), or the unit's first
    /// slot holding anything if none does: its object, and for each slot
    /// its LBA and the byte and bit of its generation to flip (in every
    /// other injection two bits of each such slot, see below). A bit that
    /// is set: cleared, it makes the slot look older than the unit's
    /// expected generation, the damage that could condemn the unit (a bit
    /// set makes it look newer, which condemns nothing).
    fn newest_generation_bits(&mut self) -> (ObjectId, Vec<(u64, u64, u8)>) {
        let (object, range) = self.random_unit();
        let unit = Self::read_bytes(&self.pristine, object, &range);
        // (LBA, byte offset in `object` of the slot's context)
        let slots: Vec<(u64, u64)> = match self.layout {
            LayoutKind::Split => (0..CONTEXTS_PER_PAGE)
                .map(|slot| (range.start / 32 + slot, range.start + slot * 32))
                .filter(|(lba, _)| *lba < BLOCKS)
                .collect(),
            LayoutKind::Packed => {
                let ObjectId::Data(segment) = object else {
                    unreachable!("a packed row is in a data segment")
                };
                let lbas = self.segment_lbas(segment);
                let first = lbas.start + range.start / PACKED_ROW_BYTES * PACKED_RECORDS_PER_ROW;
                (0..PACKED_RECORDS_PER_ROW)
                    .map(|record| {
                        let at = range.start + record * PACKED_RECORD_BYTES + BLOCK as u64;
                        (first + record, at)
                    })
                    .filter(|(lba, _)| lbas.contains(lba))
                    .collect()
            }
        };
        let context = |at: u64| &unit[(at - range.start) as usize..][..32];
        // The generation field: bytes 24..28 of a plain context (kinds 1
        // and 2), 1..5 of an encrypted one (kind 3).
        let generation_of = |at: u64| {
            let bytes = context(at);
            let offset = match bytes[0] {
                1 | 2 => 24,
                3 => 1,
                _ => return None,
            };
            let generation = u32::from_le_bytes(bytes[offset..offset + 4].try_into().expect("4"));
            Some((generation, at + offset as u64))
        };
        let newest = slots
            .iter()
            .filter_map(|(_, at)| generation_of(*at))
            .map(|(generation, _)| generation)
            .reduce(|newest, generation| {
                if generation != newest && (generation.wrapping_sub(newest) as i32) > 0 {
                    generation
                } else {
                    newest
                }
            });
        let mut flips = Vec::new();
        if let Some(newest) = newest.filter(|newest| *newest != 0) {
            let set: Vec<u64> = (0..32).filter(|bit| newest >> bit & 1 == 1).collect();
            // Every other injection flips two bits: the set one cleared
            // and the one below it changed (older either way).
            let two = self.rng.below(2) == 1;
            for (lba, at) in &slots {
                if let Some((generation, field)) = generation_of(*at) {
                    if generation == newest {
                        let bit = set[self.rng.below(set.len() as u64) as usize];
                        flips.push((*lba, field + bit / 8, 1u8 << (bit % 8)));
                        if two && bit > 0 {
                            let below = bit - 1;
                            flips.push((*lba, field + below / 8, 1u8 << (below % 8)));
                        }
                    }
                }
            }
        } else {
            let (lba, at) = slots
                .iter()
                .copied()
                .find(|(_, at)| context(*at).iter().any(|byte| *byte != 0))
                .unwrap_or(slots[0]);
            flips.push((lba, at + self.rng.below(32), 1 << self.rng.below(8)));
        }
        (object, flips)
    }

    fn read_bytes(storage: &SimStorage, object: ObjectId, range: &Range<u64>) -> Vec<u8> {
        let mut bytes = vec![0u8; (range.end - range.start) as usize];
        storage.peek(object, range.start, &mut bytes);
        bytes
    }

    fn inject(&mut self, kind: MetaKind) -> Damage {
        let storage = self.pristine.duplicate();
        if kind == MetaKind::NewestGenerationFlipped {
            // Its own random stream: the other kinds' injections stay the
            // ones the table measured before this kind was added.
            std::mem::swap(&mut self.rng, &mut self.flip_rng);
            let (object, flips) = self.newest_generation_bits();
            std::mem::swap(&mut self.rng, &mut self.flip_rng);
            for (_, at, mask) in &flips {
                storage.corrupt(object, *at, *mask);
            }
            let lbas: Vec<u64> = flips.iter().map(|(lba, _, _)| *lba).collect();
            return Damage {
                storage,
                affected: lbas.iter().copied().collect(),
                file: object.file_name(),
                what: format!("generation bits flipped at LBAs {lbas:?}"),
            };
        }
        let files = self.files();
        if kind == MetaKind::OlderVolumeCopy {
            // Draws nothing (before the file drawn below): the other
            // kinds' injections stay the ones measured before it.
            let mut affected = BTreeSet::new();
            for object in &files {
                storage.replace_object(*object, &self.older);
                affected.extend(self.blocks_at(*object, 0..self.nominal_len(*object)));
            }
            // And the written map of their time (issue 28): its expected
            // generations are not the copy the superblock names, so the
            // open must refuse naming `written`, never read them as current.
            storage.replace_object(ObjectId::Written, &self.older);
            return Damage {
                storage,
                affected,
                file: ObjectId::Written.file_name(),
                what: "older copies of every data and contexts file and of written".to_string(),
            };
        }
        let file = files[self.rng.below(files.len() as u64) as usize];
        let (object, affected, what) = match kind {
            MetaKind::UnitZeroed => {
                // A unit that holds a record (a never-written or trimmed
                // unit zeroed loses nothing): not blank, and not only
                // vacant markers (a unit trimmed in pieces).
                let (mut object, mut range) = self.random_unit();
                for _ in 0..16 {
                    if self.holds_record(&Self::read_bytes(&self.pristine, object, &range)) {
                        break;
                    }
                    (object, range) = self.random_unit();
                }
                storage.overwrite(
                    object,
                    range.start,
                    &vec![0u8; (range.end - range.start) as usize],
                );
                let affected = self.blocks_at(object, range.clone());
                (object, affected, format!("bytes {range:?} zeroed"))
            }
            MetaKind::PageZeroed => {
                let len = self.nominal_len(file);
                let page = self.rng.below(len / 4096);
                let range = page * 4096..(page + 1) * 4096;
                storage.overwrite(file, range.start, &[0u8; 4096]);
                (
                    file,
                    self.blocks_at(file, range.clone()),
                    format!("bytes {range:?} zeroed"),
                )
            }
            MetaKind::CutShort | MetaKind::Emptied => {
                let len = self.nominal_len(file);
                let cut = if kind == MetaKind::Emptied {
                    0
                } else {
                    self.rng.below(len / 4096) * 4096
                };
                storage.truncate(file, cut);
                (
                    file,
                    self.blocks_at(file, cut..len),
                    format!("cut to {cut} of {len} bytes"),
                )
            }
            MetaKind::Deleted => {
                storage.remove(file);
                let len = self.nominal_len(file);
                (file, self.blocks_at(file, 0..len), "deleted".to_string())
            }
            MetaKind::UnitFromElsewhere => {
                let (object, range) = self.random_unit();
                let (from_object, from) = loop {
                    let candidate = self.random_unit();
                    if candidate != (object, range.clone()) {
                        break candidate;
                    }
                };
                let bytes = Self::read_bytes(&self.pristine, from_object, &from);
                storage.overwrite(object, range.start, &bytes);
                let affected = self.blocks_at(object, range.clone());
                (
                    object,
                    affected,
                    format!("bytes {range:?} from {} {from:?}", from_object.file_name()),
                )
            }
            MetaKind::UnitFromOtherVolume => {
                let (object, range) = self.random_unit();
                let bytes = Self::read_bytes(&self.other, object, &range);
                storage.overwrite(object, range.start, &bytes);
                let affected = self.blocks_at(object, range.clone());
                (
                    object,
                    affected,
                    format!("bytes {range:?} from another volume"),
                )
            }
            MetaKind::OlderCopy => {
                storage.replace_object(file, &self.older);
                let len = self.nominal_len(file);
                (
                    file,
                    self.blocks_at(file, 0..len),
                    "an older copy".to_string(),
                )
            }
            MetaKind::OlderVolumeCopy => unreachable!("injected above"),
            MetaKind::NewestGenerationFlipped => unreachable!("injected above"),
            MetaKind::WrittenMapLost => {
                let what = match self.rng.below(4) {
                    0 => {
                        storage.remove(ObjectId::Written);
                        "deleted"
                    }
                    1 => {
                        storage.truncate(ObjectId::Written, 0);
                        "emptied"
                    }
                    // A bit flipped in one of the map's two copies, or in both.
                    copies => {
                        let mut bytes = vec![0u8; 64 * 1024];
                        self.pristine.peek(ObjectId::Written, 0, &mut bytes);
                        let end = bytes.iter().rposition(|b| *b != 0).unwrap_or(0) as u64 + 1;
                        let half = end.div_ceil(2);
                        for copy in 0..(copies - 1) {
                            let at = copy * half + self.rng.below(half.min(64));
                            storage.corrupt(ObjectId::Written, at, 1 << self.rng.below(8));
                        }
                        if copies == 2 {
                            "one copy corrupt"
                        } else {
                            "both copies corrupt"
                        }
                    }
                };
                // The map damaged, the metadata intact: every block must still
                // read right, or the open refuse naming the map.
                (ObjectId::Written, BTreeSet::new(), what.to_string())
            }
        };
        Damage {
            storage,
            affected,
            file: object.file_name(),
            what,
        }
    }

    fn read_block(volume: &Volume, lba: u64) -> Result<Vec<u8>, Error> {
        let mut buf = vec![0u8; BLOCK];
        volume.read(lba * BLOCK as u64, &mut buf)?;
        Ok(buf)
    }

    /// Read every block: the outcome over `affected`, the LBAs that failed,
    /// and a violation for any block outside `affected` that reads wrong.
    fn read_all(
        &mut self,
        volume: &Volume,
        damage: &Damage,
        label: &str,
    ) -> (Outcome, BTreeSet<u64>) {
        let (mut silent, mut detected) = (Vec::new(), 0u64);
        let mut failing = BTreeSet::new();
        for lba in 0..BLOCKS {
            let touched = damage.affected.contains(&lba);
            match Self::read_block(volume, lba) {
                Ok(buf) if buf == self.model[lba as usize] => {}
                Ok(buf) if touched => {
                    let zeros = buf.iter().all(|b| *b == 0);
                    silent.push((lba, zeros));
                }
                Ok(_) => self.violation(format!(
                    "{label}: {} {}: LBA {lba}, not touched, reads wrong data",
                    damage.file, damage.what
                )),
                Err(Error::Fault(fault)) if fault.lba == lba && touched => {
                    detected += 1;
                    failing.insert(lba);
                }
                Err(error) => {
                    failing.insert(lba);
                    self.violation(format!(
                        "{label}: {} {}: LBA {lba}{} fails: {error}",
                        damage.file,
                        damage.what,
                        if touched { "" } else { ", not touched," }
                    ));
                }
            }
        }
        let outcome = if let Some((lba, zeros)) = silent.first() {
            if claimed(self.kind_now, self.layout, self.guard) {
                self.violation(format!(
                    "{label}: {} {}: {} blocks silently wrong, first LBA {lba}{}",
                    damage.file,
                    damage.what,
                    silent.len(),
                    if *zeros { " (read as zeros)" } else { "" }
                ));
            }
            Outcome::Silent
        } else if detected > 0 {
            Outcome::Detected
        } else {
            Outcome::Harmless
        };
        (outcome, failing)
    }
}

impl Cx {
    fn classify(&mut self, kind: MetaKind, damage: Damage) {
        self.kind_now = kind;
        let storage: Arc<dyn Storage> = Arc::new(damage.storage.clone());
        let volume = match Volume::open(storage.clone(), &self.open) {
            Ok(volume) => volume,
            Err(error) => {
                let message = error.to_string();
                if !message.contains(&damage.file) {
                    self.violation(format!(
                        "{} {}: the open refused without naming the file: {message}",
                        damage.file, damage.what
                    ));
                }
                *self.result.refused.entry(kind).or_default() += 1;
                self.result.tallies.entry(kind).or_default().detected += 1;
                return;
            }
        };
        let (outcome, failing) = self.read_all(&volume, &damage, kind.label());
        match volume.check(|_, _| {}) {
            Ok(report) => {
                let listed: BTreeSet<u64> = report.faults.iter().map(|f| f.lba).collect();
                if listed != failing {
                    self.violation(format!(
                        "{}: {} {}: check() lists {} blocks, reads fail at {} (first listed {:?}, first failing {:?})",
                        kind.label(),
                        damage.file,
                        damage.what,
                        listed.len(),
                        failing.len(),
                        listed.iter().next(),
                        failing.iter().next()
                    ));
                }
            }
            Err(error) => self.violation(format!("{}: check() failed: {error}", kind.label())),
        }
        match volume
            .close()
            .and_then(|()| Volume::open(storage, &self.open))
        {
            Ok(reopened) => {
                // A checkpoint keeps the loss: nothing that failed reads
                // as anything but its data now.
                let (again, _) = self.read_all(&reopened, &damage, "after a close and reopen");
                if outcome != Outcome::Silent && again == Outcome::Silent {
                    self.violation(format!(
                        "{}: {} {}: detected, then silently wrong after a checkpoint",
                        kind.label(),
                        damage.file,
                        damage.what
                    ));
                }
                if let Err(error) = reopened.close() {
                    self.violation(format!("{}: close after reopen: {error}", kind.label()));
                }
            }
            Err(error) => self.violation(format!(
                "{}: {} {}: close and reopen failed: {error}",
                kind.label(),
                damage.file,
                damage.what
            )),
        }
        self.result.tallies.entry(kind).or_default().add(outcome);
    }
}
