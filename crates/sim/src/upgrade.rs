//! `vouch upgrade` crashed between its open and its checkpoint (`vouch-sim
//! upgrade`). The upgrade is a writable open that builds the written map
//! from the metadata on disk (`OpenOptions::rebuild_written_map`): it
//! makes every written unit whole (vacant markers, durable), writes the
//! map's bits (`persist_bits`), fills in the units' expected generations
//! in memory, and checkpoints (the feature flags and the generations copy
//! its superblock names), then closes (another checkpoint).
//!
//! Per seed: a volume written on random data, zeroes and trims (on the
//! production scheduling: `metadata`'s write rounds) and closed cleanly
//! (every block durable), then made to look like one that needs
//! the upgrade — every even seed as made before the written map (no map,
//! no flags, its never-written slots blank), the other as one whose
//! expected generations are not known (its superblock names no
//! generations copy). The upgrade then runs on a recorder that takes,
//! right before every write, hole punch and sync it issues (its open, its
//! checkpoint and its close), a power-cut image (a random strategy:
//! `recorder::crash_image`) and a process-crash image (everything issued
//! kept). Each image is opened as `serve` would, every block read, and
//! `check()` run; then the upgrade is run again on it (as the operator
//! would after the crash), and the blocks read and checked again. Every
//! block must read its data: no written block read as never written
//! (zeros), no false `metadata_lost` (a fault of any kind is a
//! violation: nothing was damaged, only cut short).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use vouch_engine::{
    BlockDevice, CreateOptions, GuardKind, LayoutKind, ObjectId, OpenOptions, OrderingBreaks,
    SimStorage, Storage, Volume,
};
use vouch_format::layout::{PACKED_RECORDS_PER_ROW, PACKED_RECORD_BYTES, PACKED_ROW_BYTES};
use vouch_format::{FeatureFlags, Superblock, CONTEXT_BYTES, KIND_VACANT};

use crate::faults::{segment_blocks, BLOCKS};
use crate::recorder::{crash_image, Recorder, Strategy, STRATEGIES};
use crate::rng::Rng;
use crate::BLOCK;

#[derive(Clone, Debug)]
pub struct UpgradeConfig {
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    pub encrypted: bool,
}

#[derive(Debug, Default)]
pub struct UpgradeReport {
    /// Crash images checked: power cuts and process crashes.
    pub power: u64,
    pub process: u64,
    /// Seeds whose volume was made before the written map (the rest: its
    /// expected generations not known).
    pub before_map: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl UpgradeReport {
    pub fn summary(&self, config: &UpgradeConfig) -> String {
        format!(
            "upgrade: layout={}{} seeds={} (before the map {}) images: power={} process={} violations={} time={:.1}s",
            config.layout.name(),
            if config.encrypted { " encrypted" } else { "" },
            config.seeds,
            self.before_map,
            self.power,
            self.process,
            self.violations.len(),
            self.seconds
        )
    }
}

pub fn run(config: &UpgradeConfig) -> UpgradeReport {
    let started = Instant::now();
    let mut report = UpgradeReport::default();
    for seed in config.seed..config.seed + config.seeds {
        if let Err(violation) = run_seed(config, seed, &mut report) {
            report.violations.push(format!(
                "VIOLATION layout={}{} seed={seed}: {violation}\n  replay: cargo run --release -p vouch-sim -- upgrade --layout {} --seed {seed} --seeds 1{}",
                config.layout.name(),
                if config.encrypted { " encrypted" } else { "" },
                config.layout.name(),
                if config.encrypted { " --encrypted" } else { "" }
            ));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

fn run_seed(config: &UpgradeConfig, seed: u64, report: &mut UpgradeReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let key = config.encrypted.then(|| crate::crash::seed_key(seed));
    let open = OpenOptions {
        key: key.clone(),
        ..OpenOptions::default()
    };
    let storage = small_volume(config.layout, key.clone())?;
    // Written on the production scheduling (`metadata`'s write rounds: a
    // background committer the seed steps, the inline route), twice, so
    // units hold several generations.
    let written_with = OpenOptions {
        key: key.clone(),
        ..crate::stepper::Stepper::new(OrderingBreaks::default())
            .options(crate::stepper::stepped_tuning(&mut rng))
    };
    let mut model = vec![vec![0u8; BLOCK]; BLOCKS as usize];
    let mut scheduled = crate::metadata::Scheduled::default();
    for _ in 0..2 {
        crate::metadata::write_round(
            &storage,
            &written_with,
            &mut model,
            &mut rng,
            50,
            &mut scheduled,
        )?;
    }
    let before_map = seed.is_multiple_of(2);
    report.before_map += u64::from(before_map);
    make_old(&storage, config.layout, before_map)?;

    let upgrade = OpenOptions {
        rebuild_written_map: true,
        ..open.clone()
    };
    let model = Arc::new(model);
    let recorder = Arc::new(Recorder::new(storage.duplicate()));
    let found: Arc<Mutex<(Vec<String>, u64, u64)>> = Arc::default();
    {
        let found = found.clone();
        let (open, upgrade, model) = (open.clone(), upgrade.clone(), model.clone());
        let mut hook_rng = rng.fork();
        let mut point = 0u64;
        recorder.set_hook(Some(Box::new(move |sim, order| {
            point += 1;
            let strategy = STRATEGIES[hook_rng.below(STRATEGIES.len() as u64) as usize];
            let power = crash_image(sim, order, strategy, 4096, &mut hook_rng);
            let process = crash_image(sim, order, Strategy::Persisted, 4096, &mut hook_rng);
            let mut found = found.lock();
            for (image, what) in [
                (power, format!("{strategy:?} power cut")),
                (process, "process crash".into()),
            ] {
                if let Err(error) = verify(image, (&open, &upgrade), &model) {
                    if found.0.len() < 10 {
                        found
                            .0
                            .push(format!("at the upgrade's I/O {point}, {what}: {error}"));
                    }
                }
            }
            found.1 += 1;
            found.2 += 1;
        })));
    }
    let upgraded = Volume::open(recorder.clone() as Arc<dyn Storage>, &upgrade)
        .and_then(Volume::close)
        .map_err(|e| format!("the upgrade failed: {e}"));
    recorder.set_hook(None);
    let (violations, power, process) = std::mem::take(&mut *found.lock());
    report.power += power;
    report.process += process;
    upgraded?;
    if power == 0 {
        return Err("the upgrade issued no I/O: nothing was crashed".into());
    }
    verify(recorder.sim.duplicate(), (&open, &upgrade), &model)
        .map_err(|error| format!("after the upgrade: {error}"))?;
    match violations.into_iter().next() {
        Some(first) => Err(first),
        None => Ok(()),
    }
}

/// A new volume of the simulators' size (`BLOCKS`, a 1 MiB journal,
/// small segments), closed, on simulated storage.
pub(crate) fn small_volume(
    layout: LayoutKind,
    key: Option<vouch_engine::UserSecret>,
) -> Result<SimStorage, String> {
    let storage = SimStorage::new();
    let mut options = CreateOptions::new(BLOCKS * BLOCK as u64);
    options.layout = layout;
    options.guard = GuardKind::Crc32c;
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(segment_blocks(layout));
    options.encrypt = key;
    Volume::create(Arc::new(storage.clone()), &options)
        .and_then(Volume::close)
        .map_err(|e| format!("create: {e}"))?;
    Ok(storage)
}

/// The closed volume as one that needs `vouch upgrade`: made before the
/// written map (`before_map`: no map, neither flag, its never-written
/// slots blank as that binary left them, no expected generations), or
/// with its expected generations not known (its superblock names no
/// generations copy, as a binary from before them writes it).
fn make_old(storage: &SimStorage, layout: LayoutKind, before_map: bool) -> Result<(), String> {
    let mut superblock = vouch_engine::superblock::read_superblock(storage)
        .map_err(|e| format!("read the superblock: {e}"))?;
    superblock.generations_seq = 0;
    if before_map {
        storage.remove(ObjectId::Written);
        superblock.features.incompat &=
            !(FeatureFlags::INCOMPAT_WRITTEN_MAP | FeatureFlags::INCOMPAT_BOUND_UNITS);
        for (object, at) in slots(layout) {
            let mut slot = [0u8; CONTEXT_BYTES];
            storage.peek(object, at, &mut slot);
            if slot[0] == KIND_VACANT {
                storage.overwrite(object, at, &[0u8; CONTEXT_BYTES]);
            }
        }
    }
    write_superblock(storage, &superblock);
    Ok(())
}

/// Where every block's context is: (object, offset).
fn slots(layout: LayoutKind) -> Vec<(ObjectId, u64)> {
    let geometry =
        vouch_format::Geometry::new(layout, BLOCKS * BLOCK as u64, segment_blocks(layout))
            .expect("valid geometry");
    (0..BLOCKS)
        .map(|lba| match layout {
            LayoutKind::Split => (ObjectId::Contexts, lba * CONTEXT_BYTES as u64),
            LayoutKind::Packed => {
                let location = geometry.locate(lba);
                let slot = lba % geometry.segment_blocks;
                let at = (slot / PACKED_RECORDS_PER_ROW) * PACKED_ROW_BYTES
                    + (slot % PACKED_RECORDS_PER_ROW) * PACKED_RECORD_BYTES
                    + BLOCK as u64;
                (ObjectId::Data(location.segment), at)
            }
        })
        .collect()
}

/// Both superblock copies as `superblock` (what an older binary wrote).
fn write_superblock(storage: &SimStorage, superblock: &Superblock) {
    let mut slot = vec![0u8; 4096];
    slot[..vouch_format::SUPERBLOCK_BYTES].copy_from_slice(&superblock.encode());
    storage.overwrite(ObjectId::Superblock, 0, &slot);
    storage.overwrite(ObjectId::Superblock, 4096, &slot);
}

/// Open `image` as `serve` does, read every block and check; then run the
/// upgrade on it again and do the same.
fn verify(
    image: SimStorage,
    (open, upgrade): (&OpenOptions, &OpenOptions),
    model: &[Vec<u8>],
) -> Result<(), String> {
    let storage: Arc<dyn Storage> = Arc::new(image);
    let volume = Volume::open(storage.clone(), open).map_err(|e| format!("reopen: {e}"))?;
    read_all(&volume, model).map_err(|e| format!("reopened: {e}"))?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    Volume::open(storage.clone(), upgrade)
        .and_then(Volume::close)
        .map_err(|e| format!("the upgrade run again: {e}"))?;
    let volume = Volume::open(storage, open).map_err(|e| format!("reopen: {e}"))?;
    if volume.is_read_only() {
        return Err("still read-only after the upgrade ran again".into());
    }
    read_all(&volume, model).map_err(|e| format!("upgraded again: {e}"))?;
    volume.close().map_err(|e| format!("close: {e}"))
}

/// Every block reads its data, and `check()` lists no fault.
fn read_all(volume: &Volume, model: &[Vec<u8>]) -> Result<(), String> {
    let mut buf = vec![0u8; BLOCK];
    for lba in 0..BLOCKS {
        match volume.read(lba * BLOCK as u64, &mut buf) {
            Ok(_) if buf == model[lba as usize] => {}
            Ok(_) if buf.iter().all(|byte| *byte == 0) => {
                return Err(format!("LBA {lba} reads as never written (zeros)"))
            }
            Ok(_) => return Err(format!("LBA {lba} reads wrong data")),
            Err(error) => return Err(format!("LBA {lba} fails: {error}")),
        }
    }
    let report = volume
        .check(|_, _| {})
        .map_err(|e| format!("check failed: {e}"))?;
    let listed: BTreeSet<u64> = report.faults.iter().map(|fault| fault.lba).collect();
    if !listed.is_empty() {
        return Err(format!("check() lists faults at {listed:?}"));
    }
    Ok(())
}
