//! The fault injector and detection matrix (`vouch-sim faults`, `matrix`).
//!
//! One prepared volume per (layout, guard) cell: 256 blocks, a mix of data
//! blocks, written zeroes and holes, closed once so every context is at
//! home. Faults are injected into the live simulated storage under an open
//! volume (and undone afterwards), so one volume serves many thousands of
//! injections. Each injection is classified by reading the affected blocks
//! back and comparing them with the model:
//! - detected: the read failed with a fault naming the LBA (or, for the
//!   superblock and I/O-error kinds, the volume coped as designed);
//! - silently wrong: the read returned bytes that are not the model's;
//! - harmless: the read returned the model's bytes (e.g. a bit flipped in a
//!   hole's unused data, a misdirected read of a block that needs no I/O).
//!
//! Every 16th injection also reads the whole volume and runs `check()`,
//! which must list exactly the blocks that fail to read, and only blocks the
//! fault touched.
//!
//! The volume runs the production scheduling (`crate::stepper`): a
//! background committer the seed steps and a two-block write-back buffer,
//! so the write faults (misdirected, lost, I/O errors, ENOSPC) hit the
//! background commit's journal and home writes as well as a flush's, and
//! writes take the inline route (`try_write_shared`) half the time. A
//! background commit that fails stops the volume: the client's next
//! request is refused as fail-stopped, which is how the error reaches it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::BlockDevice;
use vouch_engine::ZeroFlags;
use vouch_engine::{
    CreateOptions, Error, FaultKind, FaultPlan, GuardKind, LayoutKind, ObjectId, OpenOptions,
    OrderingBreaks, Storage, Tuning, Volume,
};
use vouch_format::layout::PACKED_RECORD_BYTES;
use vouch_format::Superblock;

use crate::recorder::Recorder;
use crate::rng::Rng;
use crate::stepper::{step_commits, write_as_served, Stepper};
use crate::BLOCK;

pub(crate) const BLOCKS: u64 = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    DataBitFlip,
    ContextBitFlip,
    ZeroedSector,
    MisdirectedRead,
    MisdirectedReadUnwritten,
    ReadError,
    MisdirectedWriteVictim,
    MisdirectedWriteLost,
    LostWrite,
    SuperblockOneCorrupt,
    SuperblockStale,
    SuperblockBothCorrupt,
    WriteError,
    NoSpace,
}

impl Kind {
    pub const ALL: [Kind; 14] = [
        Kind::DataBitFlip,
        Kind::ContextBitFlip,
        Kind::ZeroedSector,
        Kind::MisdirectedRead,
        Kind::MisdirectedReadUnwritten,
        Kind::ReadError,
        Kind::MisdirectedWriteVictim,
        Kind::MisdirectedWriteLost,
        Kind::LostWrite,
        Kind::SuperblockOneCorrupt,
        Kind::SuperblockStale,
        Kind::SuperblockBothCorrupt,
        Kind::WriteError,
        Kind::NoSpace,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Kind::DataBitFlip => "bit flip in data",
            Kind::ContextBitFlip => "bit flip in context",
            Kind::ZeroedSector => "zeroed 512 B sector",
            Kind::MisdirectedRead => "misdirected read (lands on a written block)",
            Kind::MisdirectedReadUnwritten => "misdirected read (lands on a never-written block)",
            Kind::ReadError => "I/O error on read",
            Kind::MisdirectedWriteVictim => "misdirected write: overwritten LBA",
            Kind::MisdirectedWriteLost => "misdirected write: LBA that missed its write",
            Kind::LostWrite => "lost write (data + context together in packed)",
            Kind::SuperblockOneCorrupt => "superblock: one copy corrupt",
            Kind::SuperblockStale => "superblock: newest copy stale (old generation)",
            Kind::SuperblockBothCorrupt => "superblock: both copies corrupt (clear error)",
            Kind::WriteError => "I/O error on write (fail-stop, reopen)",
            Kind::NoSpace => "ENOSPC (fail-stop, reopen)",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Detected,
    Silent,
    Harmless,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    pub detected: u64,
    pub silent: u64,
    pub harmless: u64,
}

impl Tally {
    pub(crate) fn add(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Detected => self.detected += 1,
            Outcome::Silent => self.silent += 1,
            Outcome::Harmless => self.harmless += 1,
        }
    }
    pub(crate) fn merge(&mut self, other: &Tally) {
        self.detected += other.detected;
        self.silent += other.silent;
        self.harmless += other.harmless;
    }
    /// Detected over the injections that changed what a read would return.
    pub fn fraction(&self) -> Option<f64> {
        let effective = self.detected + self.silent;
        (effective > 0).then(|| self.detected as f64 / effective as f64)
    }
}

pub type Cell = (LayoutKind, GuardKind);

pub fn all_cells() -> Vec<Cell> {
    let mut cells = Vec::new();
    for layout in LayoutKind::ALL {
        for guard in [
            GuardKind::Crc32c,
            GuardKind::Crc64Nvme,
            GuardKind::Crc16T10Dif,
            GuardKind::Xxh3,
            GuardKind::None,
        ] {
            cells.push((layout, guard));
        }
    }
    cells
}

#[derive(Clone, Debug)]
pub struct FaultConfig {
    pub cells: Vec<Cell>,
    /// Injections per fault kind per cell.
    pub count: u64,
    pub seed: u64,
    pub threads: usize,
    /// Encrypted volumes in every cell (AES-256-GCM-SIV; guard crc32c).
    pub encrypted: bool,
}

#[derive(Debug, Default)]
pub struct FaultReport {
    pub tallies: BTreeMap<(usize, Kind), Tally>,
    pub injections: u64,
    pub inline_writes: u64,
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

/// Whether the design claims detection of this fault in this cell. A
/// silently wrong read where detection is claimed is a violation.
fn claimed(kind: Kind, layout: LayoutKind, guard: GuardKind) -> bool {
    // A CRC of width w detects every error of up to w bits (so every single
    // bit flip), but another block's worth of data or a zeroed 512-byte
    // sector is a long error that any w-bit guard lets through with
    // probability 2^-w. At 16 bits that is seen in a million injections
    // (~1 in 65536 per injection); it shows in the matrix as a cell just
    // under 100 %, and is what a 16-bit guard promises, not a violation.
    // 32- and 64-bit guards are held to detecting every injection.
    let guarded = guard != GuardKind::None
        && (guard.bits() >= 32 || matches!(kind, Kind::DataBitFlip | Kind::ContextBitFlip));
    match (kind, layout) {
        (Kind::DataBitFlip | Kind::ZeroedSector, _) => guarded,
        (Kind::ContextBitFlip, _) => true,
        // Split: the context says which data belongs here (guard). Packed: the
        // record read carries another LBA's reference tag.
        (Kind::MisdirectedRead | Kind::MisdirectedReadUnwritten, LayoutKind::Split) => guarded,
        (Kind::MisdirectedRead, LayoutKind::Packed) => true,
        // Packed: an all-zero record is "never written": no tag to check.
        (Kind::MisdirectedReadUnwritten, LayoutKind::Packed) => false,
        (Kind::MisdirectedWriteVictim, LayoutKind::Split) => guarded,
        (Kind::MisdirectedWriteVictim, LayoutKind::Packed) => true,
        (Kind::MisdirectedWriteLost | Kind::LostWrite, LayoutKind::Split) => guarded,
        (Kind::MisdirectedWriteLost | Kind::LostWrite, LayoutKind::Packed) => false,
        _ => true,
    }
}

/// Run `count` injections of every one of `cells` cells on `threads`
/// threads: each cell's count is split into one part per thread,
/// `run_part(cell, part, count)` runs a part, and `merge(cell, result)`
/// takes its result (one at a time).
pub(crate) fn run_cells<R>(
    cells: usize,
    count: u64,
    threads: usize,
    run_part: impl Fn(usize, u64, u64) -> R + Sync,
    merge: impl FnMut(usize, R) + Send,
) {
    let threads = threads.max(1) as u64;
    let mut work = Vec::new();
    for index in 0..cells {
        for part in 0..threads {
            let count = count / threads + u64::from(part < count % threads);
            if count > 0 {
                work.push((index, part, count));
            }
        }
    }
    let queue = Mutex::new(work);
    let merge = Mutex::new(merge);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let Some((index, part, count)) = queue.lock().pop() else {
                    break;
                };
                let result = run_part(index, part, count);
                (merge.lock())(index, result);
            });
        }
    });
}

/// A violation found in one cell, with what replays it.
pub(crate) fn cell_violation(cell: Cell, encrypted: bool, seed: u64, violation: &str) -> String {
    let (layout, guard) = cell;
    format!(
        "VIOLATION layout={} guard={}{} cell-seed={seed}: {violation}",
        layout.name(),
        guard.name(),
        if encrypted { " encrypted" } else { "" }
    )
}

pub fn run(config: &FaultConfig) -> FaultReport {
    let started = Instant::now();
    let report = Mutex::new(FaultReport::default());
    run_cells(
        config.cells.len(),
        config.count,
        config.threads,
        |index, part, count| {
            let (layout, guard) = config.cells[index];
            let seed = config
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add(index as u64 * 101 + part);
            (seed, run_cell(layout, guard, config.encrypted, count, seed))
        },
        |index, (seed, result)| {
            let (layout, guard) = config.cells[index];
            let mut report = report.lock();
            for (kind, tally) in result.tallies {
                report
                    .tallies
                    .entry((index, kind))
                    .or_default()
                    .merge(&tally);
            }
            report.injections += result.injections;
            report.inline_writes += result.inline_writes;
            report.background_commits += result.background_commits;
            for violation in result.violations {
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

impl FaultReport {
    /// The Markdown detection matrix and a summary line.
    pub fn render(&self, config: &FaultConfig) -> String {
        let mut out = String::new();
        let _ = write!(out, "| fault |");
        let encrypted = if config.encrypted { " encrypted" } else { "" };
        for (layout, guard) in &config.cells {
            let _ = write!(out, " {} {}{encrypted} |", layout.name(), guard.name());
        }
        out.push('\n');
        let _ = write!(out, "|---|");
        for _ in &config.cells {
            out.push_str("---|");
        }
        out.push('\n');
        for kind in Kind::ALL {
            let _ = write!(out, "| {} |", kind.label());
            for index in 0..config.cells.len() {
                let tally = self
                    .tallies
                    .get(&(index, kind))
                    .copied()
                    .unwrap_or_default();
                match tally.fraction() {
                    // Never round an escape up to 100 %: show it to 3 decimals.
                    Some(fraction) if fraction < 1.0 && fraction > 0.999 => {
                        let _ = write!(out, " {:.3}% |", fraction * 100.0);
                    }
                    Some(fraction) => {
                        let _ = write!(out, " {:.1}% |", fraction * 100.0);
                    }
                    None => out.push_str(" harmless |"),
                }
            }
            out.push('\n');
        }
        out.push('\n');
        let (mut detected, mut silent, mut harmless) = (0, 0, 0);
        for tally in self.tallies.values() {
            detected += tally.detected;
            silent += tally.silent;
            harmless += tally.harmless;
        }
        for violation in &self.violations {
            let _ = writeln!(out, "{violation}");
        }
        let _ = writeln!(
            out,
            "faults: cells={} injections={} outcomes: detected={} silently-wrong={} harmless={} violations={} time={:.1}s",
            config.cells.len(),
            self.injections,
            detected,
            silent,
            harmless,
            self.violations.len(),
            self.seconds
        );
        out
    }
}

#[derive(Default)]
pub struct CellResult {
    pub tallies: BTreeMap<Kind, Tally>,
    pub injections: u64,
    /// Writes the inline route took, and requested commits the simulator
    /// ran as the background committer.
    pub inline_writes: u64,
    pub background_commits: u64,
    pub violations: Vec<String>,
}

struct Cx {
    layout: LayoutKind,
    guard: GuardKind,
    rec: Arc<Recorder>,
    open: OpenOptions,
    model: Vec<Vec<u8>>,
    rng: Rng,
    result: CellResult,
    /// Superblock bytes from right after creation (an old generation).
    stale_superblock: Vec<u8>,
    step: u64,
}

fn read_block(volume: &Volume, lba: u64) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; BLOCK];
    volume.read(lba * BLOCK as u64, &mut buf)?;
    Ok(buf)
}

impl Cx {
    fn storage(&self) -> Arc<dyn Storage> {
        self.rec.clone()
    }

    fn violation(&mut self, message: String) {
        if self.result.violations.len() < 20 {
            self.result.violations.push(message);
        }
    }

    fn record(&mut self, kind: Kind, outcome: Outcome, detail: &str) {
        if outcome == Outcome::Silent && claimed(kind, self.layout, self.guard) {
            self.violation(format!(
                "{}: silently wrong data where detection is claimed ({detail})",
                kind.label()
            ));
        }
        self.result.tallies.entry(kind).or_default().add(outcome);
    }

    fn object_of(&self, lba: u64) -> (ObjectId, u64) {
        let location = volume_geometry(self.layout).locate(lba);
        (ObjectId::Data(location.segment), location.data_offset)
    }

    fn record_len(&self) -> u64 {
        match self.layout {
            LayoutKind::Split => BLOCK as u64,
            LayoutKind::Packed => PACKED_RECORD_BYTES,
        }
    }

    /// Classify a read of `lba` against `expected`.
    fn classify(&mut self, volume: &Volume, lba: u64, expected: &[u8], kind: Kind) -> Outcome {
        match read_block(volume, lba) {
            Ok(buf) if buf == expected => Outcome::Harmless,
            Ok(_) => Outcome::Silent,
            Err(Error::Fault(fault)) if fault.lba == lba => {
                if kind == Kind::ReadError && fault.kind != FaultKind::Unreadable {
                    self.violation(format!(
                        "read error at LBA {lba} reported as {}",
                        fault.kind.name()
                    ));
                }
                Outcome::Detected
            }
            Err(error) => {
                self.violation(format!(
                    "{}: read of LBA {lba} failed without naming it: {error}",
                    kind.label()
                ));
                Outcome::Detected
            }
        }
    }

    /// Every 16th step: read everything; only `affected` may differ from the
    /// model, and `check()` must list exactly the blocks that fail to read.
    fn sweep(&mut self, volume: &Volume, affected: &[u64], what: &str) {
        self.step += 1;
        if !self.step.is_multiple_of(16) {
            return;
        }
        let mut failing = BTreeSet::new();
        for lba in 0..BLOCKS {
            match read_block(volume, lba) {
                Ok(buf) if buf == self.model[lba as usize] => {}
                Ok(_) if affected.contains(&lba) => {}
                Ok(_) => {
                    self.violation(format!("{what}: LBA {lba}, not touched, reads wrong data"));
                    return;
                }
                Err(Error::Fault(fault)) if fault.lba == lba && affected.contains(&lba) => {
                    failing.insert(lba);
                }
                Err(error) => {
                    self.violation(format!("{what}: LBA {lba}, not touched, fails: {error}"));
                    return;
                }
            }
        }
        match volume.check(|_, _| {}) {
            Ok(report) => {
                let listed: BTreeSet<u64> = report.faults.iter().map(|f| f.lba).collect();
                if listed != failing {
                    self.violation(format!(
                        "{what}: check() lists {listed:?}, reads fail at {failing:?}"
                    ));
                }
            }
            Err(error) => self.violation(format!("{what}: check() failed: {error}")),
        }
    }

    /// Split layout: make the next context lookup of `lba` read its page.
    fn evict_context_page(&mut self, volume: &Volume, lba: u64) {
        if self.layout == LayoutKind::Split {
            let other = (lba + 128) % BLOCKS;
            let _ = read_block(volume, other);
        }
    }

    fn random_lba(&mut self) -> u64 {
        self.rng.below(BLOCKS)
    }

    /// Another LBA in the same data segment.
    fn partner(&mut self, lba: u64) -> u64 {
        let segment_blocks = volume_geometry(self.layout).segment_blocks;
        let first = lba - lba % segment_blocks;
        let end = (first + segment_blocks).min(BLOCKS);
        loop {
            let other = self.rng.range(first, end - 1);
            if other != lba {
                return other;
            }
        }
    }
}

pub(crate) fn segment_blocks(layout: LayoutKind) -> u64 {
    match layout {
        LayoutKind::Split => 128,
        LayoutKind::Packed => 124,
    }
}

pub(crate) fn volume_geometry(layout: LayoutKind) -> vouch_format::Geometry {
    vouch_format::Geometry::new(layout, BLOCKS * BLOCK as u64, segment_blocks(layout))
        .expect("valid geometry")
}

/// Run `count` injections of every kind on one fresh volume.
pub fn run_cell(
    layout: LayoutKind,
    guard: GuardKind,
    encrypted: bool,
    count: u64,
    seed: u64,
) -> CellResult {
    run_cell_with(
        layout,
        guard,
        encrypted,
        count,
        seed,
        OrderingBreaks::default(),
    )
}

/// `run_cell` with the background committer's `breaks` (self-tests: a
/// commit that empties its held-log slot before its home writes loses
/// acknowledged writes when one of those writes fails, which the reopen
/// after the error must show).
pub fn run_cell_with(
    layout: LayoutKind,
    guard: GuardKind,
    encrypted: bool,
    count: u64,
    seed: u64,
    breaks: OrderingBreaks,
) -> CellResult {
    let key = encrypted.then(|| crate::crash::seed_key(seed));
    let mut rng = Rng::new(seed);
    let rec = Arc::new(Recorder::new(vouch_engine::SimStorage::new()));
    let mut options = CreateOptions::new(BLOCKS * BLOCK as u64);
    options.layout = layout;
    options.guard = guard;
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(segment_blocks(layout));
    options.encrypt = key.clone();
    let open = OpenOptions {
        key,
        ..Stepper::new(breaks).options(Tuning {
            dirty_limit_blocks: 2,
            context_cache_pages: 1,
            overlay_limit: 1024,
            background_commit: true,
            prompt_commits: true,
        })
    };
    let mut result = CellResult::default();
    let created = Volume::create(rec.clone(), &options).and_then(Volume::close);
    if let Err(error) = created {
        result.violations.push(format!("create failed: {error}"));
        return result;
    }
    let mut stale_superblock = vec![0u8; 8192];
    rec.sim.peek(ObjectId::Superblock, 0, &mut stale_superblock);
    let mut cx = Cx {
        layout,
        guard,
        rec,
        open,
        model: vec![vec![0u8; BLOCK]; BLOCKS as usize],
        rng: rng.fork(),
        result,
        stale_superblock,
        step: 0,
    };
    if let Err(error) = run_phases(&mut cx, count) {
        cx.violation(error);
    }
    cx.result
}

fn populate(cx: &mut Cx, volume: &Volume) -> Result<(), String> {
    for lba in 0..BLOCKS {
        let roll = cx.rng.below(10);
        if roll < 7 {
            let data = cx.rng.bytes(BLOCK);
            volume
                .write(lba * BLOCK as u64, &data, false)
                .map_err(|e| format!("populate write: {e}"))?;
            cx.model[lba as usize] = data;
        } else if roll < 8 {
            volume
                .write_zeroes(
                    lba * BLOCK as u64,
                    BLOCK as u64,
                    ZeroFlags {
                        fua: false,
                        allocate: true,
                    },
                )
                .map_err(|e| format!("populate zeroes: {e}"))?;
        }
    }
    volume.flush().map_err(|e| format!("populate flush: {e}"))
}

fn run_phases(cx: &mut Cx, count: u64) -> Result<(), String> {
    let volume = Volume::open(cx.storage(), &cx.open).map_err(|e| format!("open: {e}"))?;
    populate(cx, &volume)?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    // Reopen: every context is at home, none in memory.
    let volume = Volume::open(cx.storage(), &cx.open).map_err(|e| format!("reopen: {e}"))?;
    for _ in 0..count {
        data_bit_flip(cx, &volume);
        context_bit_flip(cx, &volume);
        zeroed_sector(cx, &volume);
        misdirected_read(cx, &volume);
        read_error(cx, &volume);
        cx.result.injections += 5;
    }
    for _ in 0..count {
        misdirected_write(cx, &volume)?;
        lost_write(cx, &volume)?;
        cx.result.injections += 2;
    }
    volume.close().map_err(|e| format!("close: {e}"))?;
    for _ in 0..count {
        superblock_fault(cx, Kind::SuperblockOneCorrupt)?;
        superblock_fault(cx, Kind::SuperblockStale)?;
        superblock_fault(cx, Kind::SuperblockBothCorrupt)?;
        cx.result.injections += 3;
    }
    let mut volume = Volume::open(cx.storage(), &cx.open).map_err(|e| format!("reopen: {e}"))?;
    for _ in 0..count {
        volume = write_failure(cx, volume, Kind::WriteError)?;
        volume = write_failure(cx, volume, Kind::NoSpace)?;
        cx.result.injections += 2;
    }
    volume.close().map_err(|e| format!("final close: {e}"))?;
    Ok(())
}

fn data_bit_flip(cx: &mut Cx, volume: &Volume) {
    let lba = cx.random_lba();
    let (object, offset) = cx.object_of(lba);
    let at = offset + cx.rng.below(BLOCK as u64);
    let mask = 1u8 << cx.rng.below(8);
    cx.rec.sim.corrupt(object, at, mask);
    let expected = cx.model[lba as usize].clone();
    let outcome = cx.classify(volume, lba, &expected, Kind::DataBitFlip);
    cx.record(Kind::DataBitFlip, outcome, &format!("LBA {lba} byte {at}"));
    cx.sweep(volume, &[lba], "data bit flip");
    cx.rec.sim.corrupt(object, at, mask);
}

fn context_bit_flip(cx: &mut Cx, volume: &Volume) {
    let lba = cx.random_lba();
    let (object, at) = match cx.layout {
        LayoutKind::Split => (ObjectId::Contexts, lba * 32 + cx.rng.below(32)),
        LayoutKind::Packed => {
            let (object, offset) = cx.object_of(lba);
            (object, offset + BLOCK as u64 + cx.rng.below(32))
        }
    };
    let mask = 1u8 << cx.rng.below(8);
    cx.rec.sim.corrupt(object, at, mask);
    cx.evict_context_page(volume, lba);
    let expected = cx.model[lba as usize].clone();
    let outcome = cx.classify(volume, lba, &expected, Kind::ContextBitFlip);
    cx.record(
        Kind::ContextBitFlip,
        outcome,
        &format!("LBA {lba} byte {at}"),
    );
    cx.sweep(volume, &[lba], "context bit flip");
    cx.rec.sim.corrupt(object, at, mask);
    cx.evict_context_page(volume, lba);
}

fn zeroed_sector(cx: &mut Cx, volume: &Volume) {
    let lba = cx.random_lba();
    let (object, offset) = cx.object_of(lba);
    let at = offset + cx.rng.below(8) * 512;
    let mut saved = [0u8; 512];
    cx.rec.sim.peek(object, at, &mut saved);
    cx.rec.sim.overwrite(object, at, &[0u8; 512]);
    let expected = cx.model[lba as usize].clone();
    let outcome = cx.classify(volume, lba, &expected, Kind::ZeroedSector);
    cx.record(Kind::ZeroedSector, outcome, &format!("LBA {lba} at {at}"));
    cx.sweep(volume, &[lba], "zeroed sector");
    cx.rec.sim.overwrite(object, at, &saved);
}

fn misdirected_read(cx: &mut Cx, volume: &Volume) {
    let lba = cx.random_lba();
    let other = cx.partner(lba);
    let (object, from) = cx.object_of(lba);
    let (_, to) = cx.object_of(other);
    // Classified by what the read lands on: a never-written place holds
    // all zeros (in packed, also an all-zero context = "unwritten").
    let mut target = vec![0u8; cx.record_len() as usize];
    cx.rec.sim.peek(object, to, &mut target);
    let unwritten_target = target.iter().all(|b| *b == 0);
    cx.rec.sim.set_faults(FaultPlan {
        misdirect_read: Some((object, from, to)),
        ..FaultPlan::default()
    });
    let expected = cx.model[lba as usize].clone();
    let outcome = cx.classify(volume, lba, &expected, Kind::MisdirectedRead);
    cx.rec.sim.set_faults(FaultPlan::default());
    let kind = if unwritten_target {
        Kind::MisdirectedReadUnwritten
    } else {
        Kind::MisdirectedRead
    };
    cx.record(
        kind,
        outcome,
        &format!("LBA {lba} read from LBA {other}'s place"),
    );
}

fn read_error(cx: &mut Cx, volume: &Volume) {
    let lba = cx.random_lba();
    let (object, offset) = cx.object_of(lba);
    cx.rec.sim.set_faults(FaultPlan {
        read_error: Some((object, offset, cx.record_len())),
        ..FaultPlan::default()
    });
    // Read a run of up to 3 blocks around it: the fault must name this LBA.
    let first = lba.saturating_sub(cx.rng.below(2));
    let count = (cx.rng.range(1, 3))
        .min(BLOCKS - first)
        .max(lba - first + 1);
    let mut buf = vec![0u8; (count as usize) * BLOCK];
    let outcome = match volume.read(first * BLOCK as u64, &mut buf) {
        Ok(_) => {
            let want: Vec<u8> = (first..first + count)
                .flat_map(|l| cx.model[l as usize].clone())
                .collect();
            if buf == want {
                Outcome::Harmless
            } else {
                Outcome::Silent
            }
        }
        Err(Error::Fault(fault)) if fault.lba == lba && fault.kind == FaultKind::Unreadable => {
            Outcome::Detected
        }
        Err(error) => {
            cx.violation(format!(
                "read error at LBA {lba}: read {first}+{count} failed with {error}, not an unreadable fault at {lba}"
            ));
            Outcome::Detected
        }
    };
    cx.record(Kind::ReadError, outcome, &format!("LBA {lba}"));
    cx.sweep(volume, &[lba], "read error");
    cx.rec.sim.set_faults(FaultPlan::default());
}

/// Write a block as the NBD reactor does (the inline route half the
/// time), then, one time in two, run the commit it requested as the
/// background committer would.
fn write_block(cx: &mut Cx, volume: &Volume, lba: u64, data: &[u8]) -> Result<(), String> {
    write_served(cx, volume, lba * BLOCK as u64, data, false)
        .map_err(|e| format!("write of LBA {lba} failed: {e}"))
}

/// `write_block` of any whole blocks, `fua` taking the worker's route;
/// the engine's error as it is.
fn write_served(
    cx: &mut Cx,
    volume: &Volume,
    offset: u64,
    data: &[u8],
    fua: bool,
) -> vouch_engine::Result<()> {
    let inline = cx.rng.chance(1, 2);
    let data = bytes::Bytes::copy_from_slice(data);
    if write_as_served(volume, offset, &data, fua, inline)? {
        cx.result.inline_writes += 1;
    }
    cx.result.background_commits += step_commits([volume], &mut cx.rng);
    Ok(())
}

fn misdirected_write(cx: &mut Cx, volume: &Volume) -> Result<(), String> {
    let lba = cx.random_lba();
    let other = cx.partner(lba);
    let (object, from) = cx.object_of(lba);
    let (_, to) = cx.object_of(other);
    let data = cx.rng.bytes(BLOCK);
    cx.rec.sim.set_faults(FaultPlan {
        misdirect_write: Some((object, from, to)),
        ..FaultPlan::default()
    });
    write_block(cx, volume, lba, &data)?;
    let flushed = volume.flush();
    cx.rec.sim.set_faults(FaultPlan::default());
    flushed.map_err(|e| format!("flush after misdirected write failed: {e}"))?;
    cx.model[lba as usize] = data;
    let expected_other = cx.model[other as usize].clone();
    let victim = cx.classify(volume, other, &expected_other, Kind::MisdirectedWriteVictim);
    cx.record(
        Kind::MisdirectedWriteVictim,
        victim,
        &format!("write to LBA {lba} landed on LBA {other}"),
    );
    let expected = cx.model[lba as usize].clone();
    let lost = cx.classify(volume, lba, &expected, Kind::MisdirectedWriteLost);
    cx.record(
        Kind::MisdirectedWriteLost,
        lost,
        &format!("write to LBA {lba} landed on LBA {other}"),
    );
    cx.sweep(volume, &[lba, other], "misdirected write");
    // Repair both from the model.
    write_block(cx, volume, lba, &expected)?;
    write_block(cx, volume, other, &expected_other)?;
    volume.flush().map_err(|e| format!("repair flush: {e}"))
}

fn lost_write(cx: &mut Cx, volume: &Volume) -> Result<(), String> {
    let lba = cx.random_lba();
    let (object, offset) = cx.object_of(lba);
    let data = cx.rng.bytes(BLOCK);
    cx.rec.sim.set_faults(FaultPlan {
        lose_write: Some((object, offset)),
        ..FaultPlan::default()
    });
    write_block(cx, volume, lba, &data)?;
    let flushed = volume.flush();
    cx.rec.sim.set_faults(FaultPlan::default());
    flushed.map_err(|e| format!("flush after lost write failed: {e}"))?;
    cx.model[lba as usize] = data.clone();
    let outcome = cx.classify(volume, lba, &data, Kind::LostWrite);
    cx.record(Kind::LostWrite, outcome, &format!("LBA {lba}"));
    cx.sweep(volume, &[lba], "lost write");
    write_block(cx, volume, lba, &data)?;
    volume.flush().map_err(|e| format!("repair flush: {e}"))
}

/// Superblock damage on the closed volume: open, read a sample, restore.
fn superblock_fault(cx: &mut Cx, kind: Kind) -> Result<(), String> {
    let mut saved = vec![0u8; 8192];
    cx.rec.sim.peek(ObjectId::Superblock, 0, &mut saved);
    let generation = |slot: &[u8]| Superblock::decode(slot).map(|s| s.generation).unwrap_or(0);
    let newest = if generation(&saved[4096..]) > generation(&saved[..4096]) {
        1
    } else {
        0
    };
    match kind {
        Kind::SuperblockOneCorrupt => {
            let copy = cx.rng.below(2);
            let at = copy * 4096 + cx.rng.below(vouch_format::SUPERBLOCK_BYTES as u64);
            cx.rec
                .sim
                .corrupt(ObjectId::Superblock, at, 1 << cx.rng.below(8));
        }
        Kind::SuperblockStale => {
            let stale_newest = if generation(&cx.stale_superblock[4096..])
                > generation(&cx.stale_superblock[..4096])
            {
                4096
            } else {
                0
            };
            let stale = cx.stale_superblock[stale_newest..stale_newest + 4096].to_vec();
            cx.rec
                .sim
                .overwrite(ObjectId::Superblock, newest * 4096, &stale);
        }
        _ => {
            for copy in 0..2 {
                let at = copy * 4096 + cx.rng.below(vouch_format::SUPERBLOCK_BYTES as u64);
                cx.rec
                    .sim
                    .corrupt(ObjectId::Superblock, at, 1 << cx.rng.below(8));
            }
        }
    }
    let opened = Volume::open(cx.storage(), &cx.open);
    let outcome = match (kind, opened) {
        (Kind::SuperblockBothCorrupt, Err(Error::Corrupt(message)))
            if message.contains("superblock") =>
        {
            Outcome::Detected
        }
        (Kind::SuperblockBothCorrupt, Err(error)) => {
            cx.violation(format!("both superblocks corrupt: unclear error: {error}"));
            Outcome::Detected
        }
        (Kind::SuperblockBothCorrupt, Ok(_)) => {
            cx.violation("both superblocks corrupt, yet the volume opened".into());
            Outcome::Silent
        }
        (_, Err(error)) => {
            cx.violation(format!(
                "{}: volume did not open from the other copy: {error}",
                kind.label()
            ));
            Outcome::Silent
        }
        (_, Ok(volume)) => {
            let mut outcome = Outcome::Detected;
            let sample: Vec<u64> = if cx.step.is_multiple_of(16) {
                (0..BLOCKS).collect()
            } else {
                (0..8).map(|_| cx.rng.below(BLOCKS)).collect()
            };
            cx.step += 1;
            for lba in sample {
                match read_block(&volume, lba) {
                    Ok(buf) if buf == cx.model[lba as usize] => {}
                    other => {
                        cx.violation(format!(
                            "{}: LBA {lba} reads {:?} after opening from the other copy",
                            kind.label(),
                            other.map(|_| "wrong data")
                        ));
                        outcome = Outcome::Silent;
                        break;
                    }
                }
            }
            outcome
        }
    };
    cx.result.tallies.entry(kind).or_default().add(outcome);
    cx.rec.sim.overwrite(ObjectId::Superblock, 0, &saved);
    Ok(())
}

/// A write error (or ENOSPC) at a random point of a short write/flush
/// sequence: the error reaches the client, further writes are refused,
/// reads still return acknowledged data, and a reopen keeps everything
/// that was durable.
fn write_failure(cx: &mut Cx, volume: Volume, kind: Kind) -> Result<Volume, String> {
    let plan = match kind {
        Kind::WriteError => FaultPlan {
            fail_write_after: Some(cx.rec.sim.counts().0 + cx.rng.below(8)),
            ..FaultPlan::default()
        },
        _ => FaultPlan {
            enospc_after_bytes: Some(cx.rec.bytes_written() + cx.rng.below(48 << 10)),
            ..FaultPlan::default()
        },
    };
    cx.rec.sim.set_faults(plan);
    // Per touched block: values since the last durable one; index of the
    // last acknowledged one.
    let mut versions: BTreeMap<u64, (Vec<Vec<u8>>, usize)> = BTreeMap::new();
    let mut failure: Option<Error> = None;
    let commits_before = cx.result.background_commits;
    let steps = cx.rng.range(1, 4);
    for _ in 0..steps {
        if cx.rng.chance(1, 4) {
            if let Err(error) = volume.flush() {
                failure = Some(error);
                break;
            }
            for (values, acked) in versions.values_mut() {
                values.drain(..*acked);
                *acked = 0;
            }
            continue;
        }
        let first = cx.rng.below(BLOCKS - 2);
        let count = cx.rng.range(1, 3);
        let fua = cx.rng.chance(1, 2);
        let data = cx.rng.bytes(count as usize * BLOCK);
        for (index, lba) in (first..first + count).enumerate() {
            let entry = versions
                .entry(lba)
                .or_insert_with(|| (vec![cx.model[lba as usize].clone()], 0));
            entry
                .0
                .push(data[index * BLOCK..(index + 1) * BLOCK].to_vec());
        }
        match write_served(cx, &volume, first * BLOCK as u64, &data, fua) {
            Ok(()) => {
                for lba in first..first + count {
                    let entry = versions.get_mut(&lba).expect("inserted");
                    entry.1 = entry.0.len() - 1;
                    if fua {
                        entry.0.drain(..entry.1);
                        entry.1 = 0;
                    }
                }
            }
            Err(error) => {
                failure = Some(error);
                break;
            }
        }
    }
    // A background commit that failed told no one: the client learns it
    // at its next request (a flush here, the fault still injected).
    let background = cx.result.background_commits > commits_before;
    if failure.is_none() && background {
        failure = volume.flush().err();
    }
    let Some(error) = failure else {
        cx.rec.sim.set_faults(FaultPlan::default());
        volume
            .flush()
            .map_err(|e| format!("flush without a fault failed: {e}"))?;
        for (lba, (values, _)) in versions {
            cx.model[lba as usize] = values.last().expect("one value").clone();
        }
        cx.result
            .tallies
            .entry(kind)
            .or_default()
            .add(Outcome::Harmless);
        return Ok(volume);
    };
    let mut outcome = Outcome::Detected;
    // The held log (the storage's `Held` objects) fails the same ways and
    // says it is the held log that failed.
    let held_full = |error: &Error| matches!(error, Error::HeldLog { cause, .. } if cause.kind() == std::io::ErrorKind::StorageFull);
    // After a failed background commit, the client's request is refused
    // as fail-stopped (the cause is in the message and the log).
    let stopped = background
        && match kind {
            Kind::WriteError => matches!(error, Error::FailStopped(_)),
            _ => matches!(error, Error::StoppedFull(_)),
        };
    let right_error = stopped
        || match kind {
            Kind::WriteError => {
                matches!(error, Error::Io { .. })
                    || (matches!(error, Error::HeldLog { .. }) && !held_full(&error))
            }
            _ => matches!(error, Error::NoSpace { .. }) || held_full(&error),
        };
    if !right_error {
        cx.violation(format!("{}: the client got {error}", kind.label()));
    }
    // Fail-stop: writes and flushes are refused until reopen.
    if !matches!(
        volume.write(0, &[1u8; 512], false),
        Err(Error::FailStopped(_) | Error::StoppedFull(_))
    ) {
        cx.violation(format!(
            "{}: a write after the error was not refused",
            kind.label()
        ));
        outcome = Outcome::Silent;
    }
    if volume.flush().is_ok() {
        cx.violation(format!(
            "{}: a flush after the error succeeded",
            kind.label()
        ));
        outcome = Outcome::Silent;
    }
    // Reads return acknowledged data (or a write still in flight).
    for (lba, (values, acked)) in &versions {
        match read_block(&volume, *lba) {
            Ok(buf) if values[*acked..].contains(&buf) => {}
            other => {
                cx.violation(format!(
                    "{}: LBA {lba} after the error reads {:?}, not its acknowledged data",
                    kind.label(),
                    other.map(|_| "other data")
                ));
                outcome = Outcome::Silent;
            }
        }
    }
    // Reopen (process restart, no power loss): the held log, which a
    // process crash keeps, gives back every acknowledged write (or one
    // still in flight at the error), durable or not.
    drop(volume);
    cx.rec.sim.set_faults(FaultPlan::default());
    let volume = Volume::open(cx.storage(), &cx.open)
        .map_err(|e| format!("{}: reopen after the error failed: {e}", kind.label()))?;
    for (lba, (values, acked)) in versions {
        match read_block(&volume, lba) {
            Ok(buf) if values[acked..].contains(&buf) => cx.model[lba as usize] = buf,
            other => {
                cx.violation(format!(
                    "{}: LBA {lba} after reopen reads {:?}: an acknowledged write lost in a process restart",
                    kind.label(),
                    other.map(|_| "other data")
                ));
                outcome = Outcome::Silent;
                // Resynchronise the model so later checks stay meaningful.
                let data = values.last().expect("one value").clone();
                write_block(cx, &volume, lba, &data)?;
                cx.model[lba as usize] = data;
            }
        }
    }
    for _ in 0..4 {
        let lba = cx.rng.below(BLOCKS);
        match read_block(&volume, lba) {
            Ok(buf) if buf == cx.model[lba as usize] => {}
            other => {
                cx.violation(format!(
                    "{}: untouched LBA {lba} after reopen reads {:?}",
                    kind.label(),
                    other.map(|_| "other data")
                ));
                outcome = Outcome::Silent;
            }
        }
    }
    cx.result.tallies.entry(kind).or_default().add(outcome);
    Ok(volume)
}
