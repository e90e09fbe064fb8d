//! The detection matrix's "repaired" column (`vouch-sim mirror-matrix`):
//! the media faults of `faults.rs` injected into one leg of a 2-leg
//! `Mirror` (crc32c, split and packed), each classified by what a client
//! and the bad leg see:
//! - the client's two reads of the block through the mirror (round robin,
//!   so one of them goes to the faulty leg) must return the model's bytes;
//!   wrong bytes are *silent*, an error is *failed*;
//! - the faulty leg is then read directly (transient faults cleared): the
//!   model's bytes there mean the fault was *repaired by the read*;
//!   otherwise a scrub runs, and the model's bytes afterwards mean
//!   *repaired by the scrub*; else *not repaired*;
//! - a fault the faulty leg's own read does not notice at all (the leg
//!   returns the model's bytes before any repair) is *harmless*.
//!
//! After each injection both legs are rewritten from the model through the
//! mirror and flushed, so faults never accumulate.
//!
//! The legs run the production scheduling (`crate::stepper`): each has a
//! background committer the seed steps, run after every write before its
//! flush, so a write fault on leg 1 may hit the background commit's home
//! writes rather than the flush's; and writes take the mirror's inline
//! route (`try_write_shared`: room reserved on both legs, stored without
//! waiting) half the time. `run_with` breaks that route on purpose (leg 1
//! acknowledges reserved writes it never stores), which the matrix must
//! show as wrong bytes served.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use bytes::Bytes;
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    BlockDevice, CreateOptions, Fault, FaultPlan, GuardKind, LayoutKind, ObjectId, OpenOptions,
    SealedAdmission, SealedBlock, SealedDevice, Storage, Submitted, Volume,
};
use vouch_format::layout::PACKED_RECORD_BYTES;
use vouch_mirror::{LegState, Mirror, MirrorLeg};

use crate::faults::{segment_blocks, volume_geometry, Kind, BLOCKS};
use crate::recorder::Recorder;
use crate::rng::Rng;
use crate::stepper::{step_commits, stepped_options, write_as_served};
use crate::BLOCK;

/// The kinds a mirror can act on: faults of one block on one leg. (A
/// misdirected write injects two: its lost block and its victim.)
pub const KINDS: [Kind; 7] = [
    Kind::DataBitFlip,
    Kind::ContextBitFlip,
    Kind::ZeroedSector,
    Kind::MisdirectedRead,
    Kind::ReadError,
    Kind::MisdirectedWriteLost,
    Kind::LostWrite,
];

/// What one injection came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    RepairedByRead,
    RepairedByScrub,
    NotRepaired,
    Harmless,
    Silent,
    /// Silently wrong to a client, then found and repaired by a scrub.
    SilentThenScrubRepaired,
    Failed,
}

/// Counts per outcome for one (layout, kind).
#[derive(Clone, Debug, Default)]
pub struct Tally(pub BTreeMap<Outcome, u64>);

impl Tally {
    fn get(&self, outcome: Outcome) -> u64 {
        self.0.get(&outcome).copied().unwrap_or(0)
    }
    fn total(&self) -> u64 {
        self.0.values().sum()
    }
}

/// A whole run: tallies per (layout, kind), and violations (a client read
/// that returned wrong bytes or failed while the other leg was good).
#[derive(Debug, Default)]
pub struct MirrorMatrix {
    pub tallies: BTreeMap<(String, Kind), Tally>,
    pub injections: u64,
    /// Writes the mirror's inline route took, and the requested commits
    /// the simulator ran as the legs' background committers.
    pub inline_writes: u64,
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl MirrorMatrix {
    /// The matrix as a markdown table: per kind and layout, the share of
    /// injections served correctly and repaired (by the read or the scrub).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "| fault (on one leg of two) | layout | injections | client got the right bytes | repaired by the read | repaired by the scrub | not repaired | harmless | silently wrong | failed |"
        );
        let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
        for ((layout, kind), tally) in &self.tallies {
            let total = tally.total().max(1) as f64;
            let silent = tally.get(Outcome::Silent) + tally.get(Outcome::SilentThenScrubRepaired);
            let right = tally.total() - silent - tally.get(Outcome::Failed);
            let pct = |n: u64| format!("{:.1} %", 100.0 * n as f64 / total);
            let _ = writeln!(
                out,
                "| {} | {layout} | {} | {} | {} | {} | {} | {} | {} | {} |",
                kind.label(),
                tally.total(),
                pct(right),
                pct(tally.get(Outcome::RepairedByRead)),
                pct(tally.get(Outcome::RepairedByScrub)),
                pct(tally.get(Outcome::NotRepaired)),
                pct(tally.get(Outcome::Harmless)),
                if silent == 0 {
                    pct(0)
                } else {
                    format!(
                        "{} (a scrub then repaired {})",
                        pct(silent),
                        pct(tally.get(Outcome::SilentThenScrubRepaired))
                    )
                },
                pct(tally.get(Outcome::Failed)),
            );
        }
        out
    }

    pub fn summary(&self) -> String {
        format!(
            "mirror matrix: injections={} (inline writes {}, leg background commits {}) violations={} time={:.1}s",
            self.injections,
            self.inline_writes,
            self.background_commits,
            self.violations.len(),
            self.seconds
        )
    }
}

struct Cx {
    layout: LayoutKind,
    legs: [Arc<Recorder>; 2],
    volumes: [Arc<Volume>; 2],
    mirror: Arc<Mirror>,
    model: Vec<Vec<u8>>,
    rng: Rng,
    /// Leg 1 drops the reserved writes of the inline route (`run_with`).
    sabotage: bool,
    inline_writes: u64,
    background_commits: u64,
}

/// Leg options: the production scheduling, stepped (`step_commits`), with
/// one context page cached so context faults are read from storage, and
/// a one-block write-back buffer so every write requests a commit (one
/// time in two the background one takes it before the flush).
fn open_options(rng: &mut Rng) -> OpenOptions {
    let mut options = stepped_options(rng);
    options.tuning.context_cache_pages = 1;
    options.tuning.dirty_limit_blocks = 1;
    options
}

/// Leg 1 with the inline route broken (`run_with`): a layer that
/// acknowledges writes into reserved room without storing them (the room
/// is given back); every other call reaches the volume below.
struct DropsReserved {
    volume: Arc<dyn SealedDevice>,
    /// The same device, as `below` names it.
    below: Arc<dyn BlockDevice>,
}

impl DropsReserved {
    fn over(volume: Arc<dyn SealedDevice>) -> DropsReserved {
        DropsReserved {
            below: Arc::clone(&volume) as Arc<dyn BlockDevice>,
            volume,
        }
    }
}

impl BlockDevice for DropsReserved {
    forward_device!(volume);
    fn below(&self) -> Option<&Arc<dyn BlockDevice>> {
        Some(&self.below)
    }
    fn read_blocks_collecting(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
    ) -> vouch_engine::Result<Vec<Fault>> {
        self.volume.read_blocks_collecting(first, count, out)
    }
}

impl SealedDevice for DropsReserved {
    fn read_sealed(&self, first: u64, count: u64) -> vouch_engine::Result<Vec<SealedBlock>> {
        self.volume.read_sealed(first, count)
    }
    fn sealed_below(&self) -> Option<&dyn SealedDevice> {
        Some(&*self.volume)
    }
    /// A write into reserved room is answered done and dropped.
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> vouch_engine::Result<Submitted> {
        if admission == SealedAdmission::Reserved {
            self.volume.release_room(blocks.len());
            return Ok(Submitted::Done);
        }
        self.volume.submit_sealed(blocks, fua, admission)
    }
}

impl Cx {
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

    /// A block that holds data in the model.
    fn data_lba(&mut self) -> u64 {
        loop {
            let lba = self.rng.below(BLOCKS);
            if self.model[lba as usize].iter().any(|b| *b != 0) {
                return lba;
            }
        }
    }

    /// Another data LBA in the same segment.
    fn partner(&mut self, lba: u64) -> u64 {
        let segment = segment_blocks(self.layout);
        let first = lba - lba % segment;
        let end = (first + segment).min(BLOCKS);
        loop {
            let other = self.rng.range(first, end - 1);
            if other != lba && self.model[other as usize].iter().any(|b| *b != 0) {
                return other;
            }
        }
    }

    /// Split: make leg 1's next context lookup of `lba` read its page.
    fn evict(&self, lba: u64) {
        if self.layout == LayoutKind::Split {
            let mut buf = vec![0u8; BLOCK];
            let _ = self.volumes[1].read(((lba + 128) % BLOCKS) * BLOCK as u64, &mut buf);
        }
    }

    fn leg1_reads_model(&self, lba: u64) -> bool {
        self.evict(lba);
        let mut buf = vec![0u8; BLOCK];
        self.volumes[1].read(lba * BLOCK as u64, &mut buf).is_ok()
            && buf == self.model[lba as usize]
    }

    /// Leg 0 never had a fault: a repair must never change it. (A scrub
    /// that let a stale copy win would overwrite it.)
    fn leg0_still_good(&self, lba: u64, kind: Kind, report: &mut MirrorMatrix) {
        let mut buf = vec![0u8; BLOCK];
        if self.volumes[0].read(lba * BLOCK as u64, &mut buf).is_err()
            || buf != self.model[lba as usize]
        {
            report.violations.push(format!(
                "{} {:?} LBA {lba}: the good leg no longer holds the last flushed write",
                kind.label(),
                self.layout
            ));
        }
    }

    /// Write `data` at `lba` through the mirror as the NBD reactor does
    /// (the inline route half the time, else the worker's), then run the
    /// legs' requested background commits.
    fn write_served(&mut self, lba: u64, data: &[u8]) -> vouch_engine::Result<()> {
        let inline = self.rng.chance(1, 2);
        let data = Bytes::copy_from_slice(data);
        if write_as_served(&*self.mirror, lba * BLOCK as u64, &data, false, inline)? {
            self.inline_writes += 1;
        }
        self.background_commits +=
            step_commits(self.volumes.iter().map(|volume| &**volume), &mut self.rng);
        Ok(())
    }

    /// Write `data` at `lba` through the mirror with `plan` on leg 1's
    /// storage only (the legs' background commits included), and flush.
    fn write_with_fault(&mut self, lba: u64, data: &[u8], plan: FaultPlan) -> Result<(), String> {
        self.legs[1].sim.set_faults(plan);
        let written = self
            .write_served(lba, data)
            .and_then(|_| self.mirror.flush());
        self.legs[1].sim.set_faults(FaultPlan::default());
        written.map_err(|e| format!("write of LBA {lba}: {e}"))?;
        self.model[lba as usize] = data.to_vec();
        Ok(())
    }

    /// Restore `lbas` on both legs from the model.
    fn restore(&mut self, lbas: &[u64]) -> Result<(), String> {
        for &lba in lbas {
            let data = self.model[lba as usize].clone();
            self.write_served(lba, &data)
                .map_err(|e| format!("restore of LBA {lba}: {e}"))?;
        }
        self.mirror
            .flush()
            .map_err(|e| format!("restore flush: {e}"))
    }

    /// Classify the block `lba` after a fault on leg 1. `harmless` is
    /// whether leg 1's own read returned the model's bytes before any
    /// repair; `transient` clears leg 1's fault plan before the repair
    /// checks.
    fn classify(
        &mut self,
        lba: u64,
        harmless: bool,
        transient: bool,
        report: &mut MirrorMatrix,
        kind: Kind,
    ) -> Result<Outcome, String> {
        let mut outcome = None;
        for _ in 0..2 {
            let mut buf = vec![0u8; BLOCK];
            match self.mirror.read(lba * BLOCK as u64, &mut buf) {
                Ok(_) if buf == self.model[lba as usize] => {}
                Ok(_) => outcome = Some(Outcome::Silent),
                Err(error) => {
                    report.violations.push(format!(
                        "{} {:?} LBA {lba}: the mirror failed a read another leg could serve: {error}",
                        kind.label(),
                        self.layout
                    ));
                    outcome = Some(Outcome::Failed);
                }
            }
        }
        if transient {
            self.legs[1].sim.set_faults(FaultPlan::default());
        }
        if outcome == Some(Outcome::Silent) {
            vouch_mirror::scrub::scrub(
                &self.mirror,
                &vouch_engine::scrub::ScrubOptions::default(),
                &JobControl::default(),
            )
            .map_err(|e| format!("scrub: {e}"))?;
            self.leg0_still_good(lba, kind, report);
            if self.leg1_reads_model(lba) {
                return Ok(Outcome::SilentThenScrubRepaired);
            }
        }
        if let Some(outcome) = outcome {
            return Ok(outcome);
        }
        if harmless {
            return Ok(Outcome::Harmless);
        }
        if self.leg1_reads_model(lba) {
            return Ok(Outcome::RepairedByRead);
        }
        vouch_mirror::scrub::scrub(
            &self.mirror,
            &vouch_engine::scrub::ScrubOptions::default(),
            &JobControl::default(),
        )
        .map_err(|e| format!("scrub: {e}"))?;
        self.leg0_still_good(lba, kind, report);
        Ok(if self.leg1_reads_model(lba) {
            Outcome::RepairedByScrub
        } else {
            Outcome::NotRepaired
        })
    }
}

fn record(report: &mut MirrorMatrix, layout: LayoutKind, kind: Kind, outcome: Outcome) {
    *report
        .tallies
        .entry((layout.name().to_string(), kind))
        .or_default()
        .0
        .entry(outcome)
        .or_default() += 1;
    report.injections += 1;
}

/// `count` injections of every kind in each layout, from `seed`.
pub fn run(count: u64, seed: u64) -> MirrorMatrix {
    run_with(count, seed, false)
}

/// `run`; with `sabotage`, leg 1 acknowledges the inline route's writes
/// without storing them (`DropsReserved`).
pub fn run_with(count: u64, seed: u64, sabotage: bool) -> MirrorMatrix {
    let started = Instant::now();
    let mut report = MirrorMatrix::default();
    for layout in [LayoutKind::Split, LayoutKind::Packed] {
        if let Err(error) = run_layout(layout, count, (seed, sabotage), &mut report) {
            report.violations.push(format!("{layout:?}: {error}"));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

fn run_layout(
    layout: LayoutKind,
    count: u64,
    (seed, sabotage): (u64, bool),
    report: &mut MirrorMatrix,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let sim = vouch_engine::SimStorage::new();
    let mut options = CreateOptions::new(BLOCKS * BLOCK as u64);
    options.layout = layout;
    options.guard = GuardKind::Crc32c;
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(segment_blocks(layout));
    let volume = Volume::create(Arc::new(sim.clone()), &options).map_err(|e| e.to_string())?;
    let mut model = vec![vec![0u8; BLOCK]; BLOCKS as usize];
    for (lba, block) in model.iter_mut().enumerate() {
        if rng.below(10) < 8 {
            *block = rng.bytes(BLOCK);
            volume
                .write(lba as u64 * BLOCK as u64, block, false)
                .map_err(|e| e.to_string())?;
        }
    }
    volume.close().map_err(|e| e.to_string())?;
    let legs = [0, 1].map(|_| Arc::new(Recorder::new(sim.crash_image(|_, _, _| u64::MAX))));
    let options = open_options(&mut rng);
    let open = |at: usize| {
        Volume::open(legs[at].clone() as Arc<dyn Storage>, &options)
            .map(Arc::new)
            .map_err(|e| format!("leg {at}: {e}"))
    };
    let volumes = [open(0)?, open(1)?];
    let mirror = mirror_over(&volumes, sabotage)?;
    let mut cx = Cx {
        layout,
        legs,
        volumes,
        mirror,
        model,
        rng: rng.fork(),
        sabotage,
        inline_writes: 0,
        background_commits: 0,
    };
    let run = run_injections(&mut cx, count, report);
    report.inline_writes += cx.inline_writes;
    report.background_commits += cx.background_commits;
    run
}

/// `count` injections of every kind on `cx`'s legs.
fn run_injections(cx: &mut Cx, count: u64, report: &mut MirrorMatrix) -> Result<(), String> {
    let layout = cx.layout;
    for _ in 0..count {
        for kind in KINDS {
            let outcome = inject(cx, kind, report)?;
            record(report, layout, kind, outcome.0);
            if let Some(victim) = outcome.1 {
                record(report, layout, Kind::MisdirectedWriteVictim, victim);
            }
            let active = cx.mirror.active().len();
            if active != 2 {
                return Err(format!(
                    "{} faulted a leg ({active} active): the matrix needs both",
                    kind.label()
                ));
            }
            // A fresh mirror over the same legs: its corrected-error counts
            // start at zero, so the fault threshold (md's 20) never trips.
            cx.mirror = mirror_over(&cx.volumes, cx.sabotage)?;
        }
    }
    Ok(())
}

fn mirror_over(volumes: &[Arc<Volume>; 2], sabotage: bool) -> Result<Arc<Mirror>, String> {
    let legs = volumes
        .iter()
        .enumerate()
        .map(|(at, volume)| {
            let device = volume.clone() as Arc<dyn SealedDevice>;
            MirrorLeg {
                name: format!("leg{at}"),
                device: Some(match sabotage && at == 1 {
                    true => Arc::new(DropsReserved::over(device)),
                    false => device,
                }),
                state: LegState::Active,
            }
        })
        .collect();
    Mirror::new(legs, None).map_err(|e| e.to_string())
}

/// One injection of `kind` on leg 1; returns its outcome (and, for a
/// misdirected write, the victim block's).
fn inject(
    cx: &mut Cx,
    kind: Kind,
    report: &mut MirrorMatrix,
) -> Result<(Outcome, Option<Outcome>), String> {
    let lba = cx.data_lba();
    let (object, offset) = cx.object_of(lba);
    let outcome = match kind {
        Kind::DataBitFlip | Kind::ContextBitFlip | Kind::ZeroedSector => {
            let at = match (kind, cx.layout) {
                (Kind::DataBitFlip, _) => (object, offset + cx.rng.below(BLOCK as u64)),
                (Kind::ContextBitFlip, LayoutKind::Split) => {
                    (ObjectId::Contexts, lba * 32 + cx.rng.below(32))
                }
                (Kind::ContextBitFlip, LayoutKind::Packed) => {
                    (object, offset + BLOCK as u64 + cx.rng.below(32))
                }
                _ => (object, offset + cx.rng.below(8) * 512),
            };
            if kind == Kind::ZeroedSector {
                cx.legs[1].sim.overwrite(at.0, at.1, &[0u8; 512]);
            } else {
                cx.legs[1].sim.corrupt(at.0, at.1, 1u8 << cx.rng.below(8));
            }
            let harmless = cx.leg1_reads_model(lba);
            cx.evict(lba);
            cx.classify(lba, harmless, false, report, kind)?
        }
        Kind::MisdirectedRead | Kind::ReadError => {
            let plan = if kind == Kind::ReadError {
                FaultPlan {
                    read_error: Some((object, offset, cx.record_len())),
                    ..FaultPlan::default()
                }
            } else {
                let other = cx.partner(lba);
                FaultPlan {
                    misdirect_read: Some((object, offset, cx.object_of(other).1)),
                    ..FaultPlan::default()
                }
            };
            cx.legs[1].sim.set_faults(plan.clone());
            let harmless = cx.leg1_reads_model(lba);
            cx.legs[1].sim.set_faults(plan);
            cx.classify(lba, harmless, true, report, kind)?
        }
        Kind::LostWrite => {
            let data = cx.rng.bytes(BLOCK);
            cx.write_with_fault(
                lba,
                &data,
                FaultPlan {
                    lose_write: Some((object, offset)),
                    ..FaultPlan::default()
                },
            )?;
            let harmless = cx.leg1_reads_model(lba);
            cx.classify(lba, harmless, false, report, kind)?
        }
        Kind::MisdirectedWriteLost => {
            let other = cx.partner(lba);
            let (_, to) = cx.object_of(other);
            let data = cx.rng.bytes(BLOCK);
            cx.write_with_fault(
                lba,
                &data,
                FaultPlan {
                    misdirect_write: Some((object, offset, to)),
                    ..FaultPlan::default()
                },
            )?;
            // The victim first: its read must not be repaired by the
            // classification of the lost block.
            let harmless = cx.leg1_reads_model(other);
            let victim =
                cx.classify(other, harmless, false, report, Kind::MisdirectedWriteVictim)?;
            let harmless = cx.leg1_reads_model(lba);
            let lost = cx.classify(lba, harmless, false, report, kind)?;
            cx.restore(&[lba, other])?;
            return Ok((lost, Some(victim)));
        }
        other => return Err(format!("{} is not a one-leg fault", other.label())),
    };
    cx.restore(&[lba])?;
    Ok((outcome, None))
}
