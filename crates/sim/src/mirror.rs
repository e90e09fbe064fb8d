//! Crash points of mirror repair (`crates/mirror/src/`, repair's
//! write order in docs/CRASH_MODEL.md). Two legs of one volume on
//! simulated storage hold the same flushed data; some blocks are then
//! corrupted on leg 1 (data or context), one on both legs. The legs are
//! opened on the recording storage, a `Mirror` reads every block (read
//! repair) and scrubs (scrub repair), and at every write and sync leg 1
//! issues, crash images of leg 1 are built with every strategy. Contract:
//! - every image of leg 1 opens, and each block reads its old contents (a
//!   block that was corrupt still fails verification, naming it) or its
//!   new ones (the good data): never other bytes, never a fault on a
//!   block that was good;
//! - the block bad on both legs is never rewritten: it fails on both;
//! - leg 0, the source, is only read: every block still reads good.
//!
//! The legs run the production scheduling (`crate::stepper`): their
//! background committers, stepped by the seed, take the commits the
//! repair writes request between the reads, so those commits' journal
//! and home writes are crash points too. (Read repair stores with the
//! worker's sealed write; it has no inline route.)
//!
//! `run_with` breaks the route's rule that the sealed block moves whole,
//! from a leg that verifies it: leg 1 "repairs" a block that fails its
//! verification from its own bytes, sealing a context to match them, so
//! the block bad on both legs is rewritten and clients read wrong bytes,
//! which the checks must report.

use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    BlockDevice, CreateOptions, Error, Fault, LayoutKind, ObjectId, OpenOptions, SealedDevice,
    SimStorage, Storage, Volume,
};
use vouch_mirror::{LegState, Mirror, MirrorLeg};

use crate::recorder::{crash_image, Recorder, STRATEGIES};
use crate::rng::Rng;
use crate::BLOCK;

/// Blocks in the volume, and blocks written before the repair.
const BLOCKS: u64 = 64;
const WRITTEN: u64 = 32;

/// What a mirror-repair run found.
#[derive(Debug, Default)]
pub struct MirrorReport {
    pub seeds: u64,
    /// Crash images of leg 1 checked.
    pub images: u64,
    /// Blocks repaired on leg 1 (summed over seeds).
    pub repaired: u64,
    /// Image blocks that read their old (corrupt) and their new contents.
    pub old_blocks: u64,
    pub new_blocks: u64,
    /// Requested commits the simulator ran as the legs' background
    /// committers.
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl MirrorReport {
    pub fn summary(&self) -> String {
        format!(
            "mirror repair: seeds={} images={} repaired={} image blocks old={} new={} leg background commits={} violations={} time={:.1}s",
            self.seeds,
            self.images,
            self.repaired,
            self.old_blocks,
            self.new_blocks,
            self.background_commits,
            self.violations.len(),
            self.seconds
        )
    }
}

/// How crash images and the source leg's final state are opened.
fn open_options() -> OpenOptions {
    crate::foreground_options()
}

/// Run seeds `first..first + seeds`.
pub fn run(first: u64, seeds: u64) -> MirrorReport {
    run_with(first, seeds, false)
}

/// `run`; with `sabotage`, leg 1 reseals the blocks that fail its
/// verification from their own bytes (`ResealsFaults`).
pub fn run_with(first: u64, seeds: u64, sabotage: bool) -> MirrorReport {
    let started = Instant::now();
    let mut report = MirrorReport::default();
    for seed in first..first + seeds {
        if let Err(message) = run_seed(seed, sabotage, &mut report) {
            report.violations.push(format!("seed {seed}: {message}"));
        }
        report.seeds += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// Leg 1 with the repair rule broken (`run_with`): a block that fails
/// verification is read from its storage as it lies, written back as new
/// data (a context sealed to match it) and returned as good; every other
/// call reaches the volume below.
struct ResealsFaults {
    volume: Arc<Volume>,
    storage: Arc<Recorder>,
}

impl BlockDevice for ResealsFaults {
    forward_device!(volume);
    fn read_blocks_collecting(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
    ) -> vouch_engine::Result<Vec<Fault>> {
        let faults = self.volume.read_blocks_collecting(first, count, out)?;
        for fault in faults {
            let location = self.volume.geometry().locate(fault.lba);
            let at = ((fault.lba - first) as usize) * BLOCK;
            let raw = &mut out[at..at + BLOCK];
            self.storage
                .sim
                .peek(ObjectId::Data(location.segment), location.data_offset, raw);
            self.volume.write(fault.lba * BLOCK as u64, raw, false)?;
        }
        Ok(Vec::new())
    }
}

impl SealedDevice for ResealsFaults {
    forward_sealed!(volume);
}

/// One seed; violations are pushed to `report`, setup errors returned.
pub fn run_seed(seed: u64, sabotage: bool, report: &mut MirrorReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(BLOCKS * BLOCK as u64);
    options.layout = LayoutKind::Split;
    let volume = Volume::create(Arc::new(sim.clone()), &options).map_err(|e| e.to_string())?;
    let mut model = Vec::new();
    for lba in 0..WRITTEN {
        let data = rng.bytes(BLOCK);
        volume
            .write(lba * BLOCK as u64, &data, false)
            .map_err(|e| e.to_string())?;
        model.push(data);
    }
    volume.close().map_err(|e| e.to_string())?;
    // Two identical legs (same superblock, so the same uuid and tags).
    let leg0 = sim.crash_image(|_, _, _| u64::MAX);
    let leg1 = sim.crash_image(|_, _, _| u64::MAX);
    let mut corrupt = std::collections::BTreeSet::new();
    for _ in 0..rng.range(1, 6) {
        let lba = rng.below(WRITTEN);
        if rng.chance(1, 3) {
            leg1.corrupt(ObjectId::Contexts, lba * 32 + rng.below(32), 0x10);
        } else {
            leg1.corrupt(
                ObjectId::Data(0),
                lba * BLOCK as u64 + rng.below(4096),
                0x08,
            );
        }
        corrupt.insert(lba);
    }
    let both = loop {
        let lba = rng.below(WRITTEN);
        if !corrupt.contains(&lba) {
            break lba;
        }
    };
    leg0.corrupt(ObjectId::Data(0), both * BLOCK as u64 + 7, 0x01);
    leg1.corrupt(ObjectId::Data(0), both * BLOCK as u64 + 9, 0x01);

    let recorder0 = Arc::new(Recorder::new(leg0));
    let recorder1 = Arc::new(Recorder::new(leg1));
    // A one-block write-back buffer: each repair write requests a commit.
    let mut stepped = crate::stepper::stepped_options(&mut rng);
    stepped.tuning.dirty_limit_blocks = 1;
    let volume0 = Arc::new(
        Volume::open(recorder0.clone() as Arc<dyn Storage>, &stepped)
            .map_err(|e| format!("leg 0: {e}"))?,
    );
    let volume1 = Arc::new(
        Volume::open(recorder1.clone() as Arc<dyn Storage>, &stepped)
            .map_err(|e| format!("leg 1: {e}"))?,
    );
    let images: Arc<Mutex<Vec<SimStorage>>> = Arc::new(Mutex::new(Vec::new()));
    let collected = Arc::clone(&images);
    let mut hook_rng = rng.fork();
    recorder1.set_hook(Some(Box::new(move |sim, order| {
        for strategy in STRATEGIES {
            let image = crash_image(sim, order, strategy, 4096, &mut hook_rng);
            collected.lock().push(image);
        }
    })));
    let legs = vec![
        MirrorLeg {
            name: "leg0".into(),
            device: Some(volume0.clone() as Arc<dyn SealedDevice>),
            state: LegState::Active,
        },
        MirrorLeg {
            name: "leg1".into(),
            device: Some(match sabotage {
                true => Arc::new(ResealsFaults {
                    volume: volume1.clone(),
                    storage: recorder1.clone(),
                }) as Arc<dyn SealedDevice>,
                false => volume1.clone() as Arc<dyn SealedDevice>,
            }),
            state: LegState::Active,
        },
    ];
    let mirror = Mirror::new(legs, None).map_err(|e| e.to_string())?;
    // Read repair (round robin reaches leg 1 for every block read twice),
    // then scrub repair for anything left.
    for lba in 0..WRITTEN {
        for _ in 0..2 {
            let mut buf = vec![0u8; BLOCK];
            match mirror.read(lba * BLOCK as u64, &mut buf) {
                Ok(_) if lba != both && buf == model[lba as usize] => {}
                Err(Error::Fault(fault)) if lba == both && fault.lba == both => {}
                other => report.violations.push(format!(
                    "seed {seed}: mirror read of LBA {lba} (corrupt on both: {}): {:?}",
                    lba == both,
                    other.map(|_| "wrong data")
                )),
            }
        }
        report.background_commits += crate::stepper::step_commits([&*volume0, &*volume1], &mut rng);
    }
    let scrubbed = vouch_mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .map_err(|e| e.to_string())?;
    if scrubbed.left != 2 || scrubbed.repaired != 0 {
        report.violations.push(format!(
            "seed {seed}: after read repair the scrub must leave only LBA {both} on both legs: {scrubbed:?}"
        ));
    }
    report.repaired += mirror.status()[1].corrected;
    recorder1.crash_point();
    recorder1.set_hook(None);
    drop(mirror);
    drop((volume0, volume1));
    let images = std::mem::take(&mut *images.lock());
    for (index, image) in images.into_iter().enumerate() {
        report.images += 1;
        let volume = match Volume::open(Arc::new(image) as Arc<dyn Storage>, &open_options()) {
            Ok(volume) => volume,
            Err(error) => {
                report.violations.push(format!(
                    "seed {seed} image {index}: leg 1 does not open: {error}"
                ));
                continue;
            }
        };
        for lba in 0..WRITTEN {
            let mut buf = vec![0u8; BLOCK];
            let read = volume.read(lba * BLOCK as u64, &mut buf);
            let was_bad = corrupt.contains(&lba) || lba == both;
            match read {
                Ok(_) if buf == model[lba as usize] && lba != both => report.new_blocks += 1,
                Err(Error::Fault(fault)) if was_bad && fault.lba == lba => report.old_blocks += 1,
                other => report.violations.push(format!(
                    "seed {seed} image {index}: leg 1 LBA {lba} (was bad: {was_bad}, on both: {}) reads neither its old nor its new contents: {:?}",
                    lba == both,
                    other.map(|_| if buf.iter().all(|b| *b == 0) { "zeros".to_string() } else {
                        format!("{} bytes differ", buf.iter().zip(&model[lba as usize]).filter(|(a, b)| a != b).count())
                    })
                )),
            }
        }
    }
    // Leg 0 was only read.
    let leg0 = Volume::open(
        Arc::new(recorder0.sim.crash_image(|_, _, _| 0)) as Arc<dyn Storage>,
        &open_options(),
    )
    .map_err(|e| format!("leg 0 after: {e}"))?;
    for lba in (0..WRITTEN).filter(|&lba| lba != both) {
        let mut buf = vec![0u8; BLOCK];
        if leg0.read(lba * BLOCK as u64, &mut buf).is_err() || buf != model[lba as usize] {
            report
                .violations
                .push(format!("seed {seed}: leg 0 LBA {lba} changed"));
        }
    }
    Ok(())
}
