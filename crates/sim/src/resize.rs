//! `vouch resize` crashed at every file operation it issues (`vouch-sim
//! resize`).
//!
//! Per seed: a volume written on random data, zeroes and trims (the
//! production scheduling: `metadata`'s write rounds) and closed cleanly,
//! its files at their nominal lengths in the model filesystem of
//! `vouch-sim snapshot` (`ModelFs`: a power cut keeps only what was
//! synced). Then the engine's own `resize::resize` runs on it three
//! times: a grow to a random size past the end (new segments, a unit
//! that straddled the end), a grow again after random blocks of the new
//! tail were written (so the unit straddling the end holds something and
//! its new slots must be whole), and a shrink back over the unwritten
//! tail. Right before each operation a resize issues, three crash
//! images are taken: a process crash (everything issued kept), a power
//! cut that loses everything not synced, and one that keeps a random
//! subset of the unsynced inodes. On each image, after what the next open
//! does first (`resize::finish`):
//!
//! - the volume opens (writable) at the old size or the new one;
//! - every block reads as the model says (acknowledged data; zeros in a
//!   new tail) and `check` finds nothing;
//! - the resize run again (as an operator would) reaches the new size,
//!   with the same data and a clean check.
//!
//! After each step returned, the volume has the new size.
//!
//! `--online` drives the same three resizes through a served volume
//! (`Volume::resize_online`): the volume open (foreground commits),
//! random writes left in its write-back buffer before each resize, the
//! engine closed by the resize itself, its files then resized on the
//! model filesystem (where the crash images are taken, with every write
//! acknowledged before the resize in the model) and the engine opened
//! again on them; after each, writes through the new engine (into the
//! new tail, its last block always), and at the end the volume closed,
//! read whole and checked.
//!
//! `--break-switch` writes the new size into the superblock before the
//! files and the map of the new size are made
//! (`ResizeBreaks::switch_first`): the images must then show violations.

use std::path::Path;
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::resize::{self, ResizeBreaks};
use vouch_engine::storage::objects_of;
use vouch_engine::{BlockDevice, LayoutKind, ObjectId, OpenOptions, SimStorage, Volume};
use vouch_format::Geometry;

use crate::faults::BLOCKS;
use crate::rng::Rng;
use crate::snapshot::{Findings, ModelFs, Recording};
use crate::BLOCK;

#[derive(Clone, Debug)]
pub struct ResizeConfig {
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    pub breaks: ResizeBreaks,
    /// Through a served volume (`Volume::resize_online`).
    pub online: bool,
    /// A volume with regions (`resize_regions`).
    pub regions: bool,
    /// A served mirror of two local legs (`resize_mirror`, online only).
    pub mirror: bool,
    /// With `mirror`: the legs resized one after the other by the
    /// one-volume online resize (a deliberate break).
    pub leg_by_leg: bool,
}

/// What the seeds found (the snapshot simulator's report).
pub type ResizeReport = crate::snapshot::SnapshotReport;

/// The summary line of `report` for `config`.
pub fn summary(report: &ResizeReport, config: &ResizeConfig) -> String {
    format!(
        "resize{}{}{}: layout={}{} seeds={} crash points={} images={} violations={} time={:.1}s",
        if config.online { " online" } else { "" },
        if config.regions { " regions" } else { "" },
        if config.mirror { " mirror" } else { "" },
        config.layout.name(),
        if config.breaks.switch_first {
            " BROKEN(switch first)"
        } else if config.leg_by_leg {
            " BROKEN(leg by leg)"
        } else {
            ""
        },
        config.seeds,
        report.points,
        report.images,
        report.violations.len(),
        report.seconds
    )
}

const VOLUME: &str = "/v";

pub fn run(config: &ResizeConfig) -> ResizeReport {
    let flag = match (config.online, config.regions, config.breaks.switch_first) {
        (false, false, false) => None,
        (false, false, true) => Some("--break-switch"),
        (true, false, false) => Some("--online"),
        (true, false, true) => Some("--online --break-switch"),
        (true, true, false) => Some("--online --regions"),
        (true, true, true) => Some("--online --regions --break-switch"),
        (false, true, false) => Some("--regions"),
        (false, true, true) => Some("--regions --break-switch"),
    };
    let flag = if config.breaks.other_left_open {
        Some("--online --regions --break-other-open")
    } else if config.mirror {
        Some(if config.leg_by_leg {
            "--online --mirror --break-leg-by-leg"
        } else {
            "--online --mirror"
        })
    } else {
        flag
    };
    crate::snapshot::run_seeds(
        ("resize", config.layout, flag),
        config.seed..config.seed + config.seeds,
        |seed, report| match (config.online, config.regions) {
            _ if config.mirror => crate::resize_mirror::run_seed_online(
                config.layout,
                config.leg_by_leg,
                seed,
                report,
            ),
            (true, true) => crate::resize_regions::run_seed_online(config, seed, report),
            (true, false) => run_seed_online(config, seed, report),
            (false, true) => crate::resize_regions::run_seed(config, seed, report),
            (false, false) => run_seed(config, seed, report),
        },
    )
}

/// The step a crash image belongs to: the sizes before and after, and
/// every block's data (as long as the larger).
#[derive(Clone)]
struct Step {
    from: u64,
    to: u64,
    model: Vec<Vec<u8>>,
}

/// What a seed starts from: the written volume's model, the two sizes it
/// is resized to, the step under way, and the model filesystem with its
/// crash hook.
type Seed = (
    Vec<Vec<u8>>,
    (u64, u64),
    Arc<Mutex<Option<Step>>>,
    Findings,
    Recording,
);

/// A volume written by `metadata`'s write round and closed, as the model
/// filesystem's files, whose hook checks every crash image against the
/// step under way (`step`; none: no check).
fn start_seed(config: &ResizeConfig, rng: &mut Rng) -> Result<Seed, String> {
    let (storage, model) = crate::snapshot::written_volume(config.layout, rng)?;
    let mut fs = ModelFs::new();
    fs.put_dir(Path::new(VOLUME));
    put_volume(&mut fs, &storage, BLOCKS)?;
    let first = BLOCKS + rng.range(1, 160);
    let second = first + rng.range(1, 160);
    let step: Arc<Mutex<Option<Step>>> = Arc::default();
    let findings = Findings::default();
    let recording = Recording::new(fs);
    let (hooked, breaks) = (step.clone(), config.breaks);
    let path = if config.online { "online " } else { "" };
    *recording.hook.lock() = Some(findings.hook(rng.fork(), move |image| {
        let Some(step) = hooked.lock().clone() else {
            return Ok(());
        };
        verify(image, &step, breaks)
            .map_err(|e| format!("{path}{} -> {} blocks: {e}", step.from, step.to))
    }));
    Ok((model, (first, second), step, findings, recording))
}

fn run_seed(config: &ResizeConfig, seed: u64, report: &mut ResizeReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (mut model, (first, second), step, findings, recording) = start_seed(config, &mut rng)?;
    let volume = Path::new(VOLUME);
    let resize_to = |recording: &Recording, from: u64, to: u64, model: &[Vec<u8>]| {
        *step.lock() = Some(Step {
            from,
            to,
            model: model.to_vec(),
        });
        resize::resize(recording, volume, to * BLOCK as u64, config.breaks)
            .map_err(|e| format!("resize {from} -> {to} blocks failed: {e}"))?;
        *step.lock() = None;
        let fs = recording.fs.lock().clone();
        let mut image = fs;
        open_and_read(&mut image, to, model).map_err(|e| format!("after resize to {to}: {e}"))
    };

    model.resize(first as usize, vec![0u8; BLOCK]);
    resize_to(&recording, BLOCKS, first, &model)?;

    // Write into the new tail, so the unit that straddles its end holds
    // something when it grows again.
    {
        let mut fs = recording.fs.lock();
        let storage = storage_of(&mut fs, first)?;
        let opened = Volume::open(Arc::new(storage.clone()), &OpenOptions::foreground())
            .map_err(|e| format!("open at {first} blocks: {e}"))?;
        for _ in 0..rng.range(1, 8) {
            let lba = rng.range(BLOCKS, first - 1);
            let data = rng.bytes(BLOCK);
            opened
                .write(lba * BLOCK as u64, &data, false)
                .map_err(|e| format!("write LBA {lba}: {e}"))?;
            model[lba as usize] = data;
        }
        // The last tail block always: the unit straddling the end is set.
        let data = rng.bytes(BLOCK);
        opened
            .write((first - 1) * BLOCK as u64, &data, false)
            .map_err(|e| format!("write LBA {}: {e}", first - 1))?;
        model[first as usize - 1] = data;
        opened
            .close()
            .map_err(|e| format!("close at {first} blocks: {e}"))?;
        put_volume(&mut fs, &storage, first)?;
    }

    let mut grown = model.clone();
    grown.resize(second as usize, vec![0u8; BLOCK]);
    resize_to(&recording, first, second, &grown)?;
    resize_to(&recording, second, first, &grown)?;

    *recording.hook.lock() = None;
    findings.end(report)
}

/// Random writes of `lbas` through `volume` (left in its write-back
/// buffer: its commits are foreground), and always its block `last`.
fn write_some(
    volume: &Volume,
    model: &mut [Vec<u8>],
    rng: &mut Rng,
    lbas: std::ops::Range<u64>,
    last: u64,
) -> Result<(), String> {
    let count = rng.range(1, 8);
    let lbas: Vec<u64> = (0..count)
        .map(|_| rng.range(lbas.start, lbas.end - 1))
        .chain([last])
        .collect();
    for lba in lbas {
        let data = rng.bytes(BLOCK);
        volume
            .write(lba * BLOCK as u64, &data, false)
            .map_err(|e| format!("write LBA {lba}: {e}"))?;
        model[lba as usize] = data;
    }
    Ok(())
}

fn sim_error(error: String) -> vouch_engine::Error {
    vouch_engine::Error::InvalidArgument(error)
}

fn run_seed_online(
    config: &ResizeConfig,
    seed: u64,
    report: &mut ResizeReport,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (mut model, (first, second), step, findings, recording) = start_seed(config, &mut rng)?;
    let volume_dir = Path::new(VOLUME);
    // The storage the served engine uses now (its files, as the model
    // filesystem had them when it was opened).
    let served = Mutex::new(storage_of(&mut recording.fs.lock(), BLOCKS)?);
    let volume = Volume::open(Arc::new(served.lock().clone()), &OpenOptions::foreground())
        .map_err(|e| format!("open: {e}"))?;
    let resize_online = |from: u64, to: u64, model: &[Vec<u8>]| -> Result<(), String> {
        *step.lock() = Some(Step {
            from,
            to,
            model: model.to_vec(),
        });
        let done = volume.resize_online(
            to * BLOCK as u64,
            vouch_engine::volume::ResizeSteps {
                // The engine was closed into `served`: its files are the
                // model filesystem's, durable (its syncs), then resized.
                files: &mut |bytes| {
                    put_volume(&mut recording.fs.lock(), &served.lock(), from)
                        .map_err(sim_error)?;
                    resize::resize(&recording, volume_dir, bytes, config.breaks).map(drop)
                },
                // At the size the model filesystem's superblock says (the
                // old storage is a copy here, not the same files).
                reopen: &mut |_, _| {
                    let mut fs = recording.fs.lock();
                    let blocks =
                        superblock_of(&mut fs).map_err(sim_error)?.size_bytes / BLOCK as u64;
                    let storage = storage_of(&mut fs, blocks).map_err(sim_error)?;
                    *served.lock() = storage.clone();
                    Ok(Arc::new(storage))
                },
            },
        );
        *step.lock() = None;
        done.map_err(|e| format!("online resize {from} -> {to} blocks failed: {e}"))?;
        if vouch_engine::BlockDevice::size(&volume) != to * BLOCK as u64 {
            return Err(format!(
                "online resize to {to} blocks: the volume says another size"
            ));
        }
        Ok(())
    };

    write_some(&volume, &mut model, &mut rng, 0..BLOCKS, BLOCKS - 1)?;
    model.resize(first as usize, vec![0u8; BLOCK]);
    resize_online(BLOCKS, first, &model)?;
    // Through the new engine: into the new tail, its last block always.
    write_some(&volume, &mut model, &mut rng, BLOCKS..first, first - 1)?;
    let mut grown = model.clone();
    grown.resize(second as usize, vec![0u8; BLOCK]);
    resize_online(first, second, &grown)?;
    write_some(&volume, &mut grown, &mut rng, 0..first, first - 1)?;
    resize_online(second, first, &grown)?;
    volume.close().map_err(|e| format!("close: {e}"))?;

    *recording.hook.lock() = None;
    let mut fs = recording.fs.lock().clone();
    put_volume(&mut fs, &served.lock(), first)?;
    open_and_read(&mut fs, first, &grown).map_err(|e| format!("at the end: {e}"))?;
    findings.end(report)
}

fn geometry(layout: LayoutKind, blocks: u64) -> Result<Geometry, String> {
    Geometry::new(
        layout,
        blocks * BLOCK as u64,
        crate::faults::segment_blocks(layout),
    )
    .map_err(|e| e.to_string())
}

fn superblock_of(fs: &mut ModelFs) -> Result<vouch_format::Superblock, String> {
    let path = Path::new(VOLUME).join(ObjectId::Superblock.file_name());
    let bytes = fs
        .file(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .clone();
    let storage = SimStorage::new();
    storage.overwrite(ObjectId::Superblock, 0, &bytes);
    vouch_engine::read_superblock(&storage).map_err(|e| format!("superblock: {e}"))
}

/// The closed volume in `storage` (of `blocks` blocks) as the model's
/// files, synced: each sized file at its nominal length, as a real
/// volume's files are.
fn put_volume(fs: &mut ModelFs, storage: &SimStorage, blocks: u64) -> Result<(), String> {
    let layout = vouch_engine::read_superblock(storage)
        .map_err(|e| format!("superblock: {e}"))?
        .layout;
    let geometry = geometry(layout, blocks)?;
    for object in objects_of(&geometry) {
        let mut bytes = storage.object_bytes(object);
        let nominal = match object {
            ObjectId::Contexts => geometry.contexts_len(),
            ObjectId::Data(segment) => geometry.segment_len(segment),
            _ => 0,
        };
        if bytes.len() < nominal as usize {
            bytes.resize(nominal as usize, 0);
        }
        let path = Path::new(VOLUME).join(object.file_name());
        match fs.file(&path) {
            Ok(file) => *file = bytes,
            Err(_) => fs.put_file(&path, bytes),
        }
    }
    // Everything as it is now is durable.
    *fs = fs.power_cut(|| true);
    Ok(())
}

/// The volume of `fs` at `blocks` blocks as a `SimStorage`: a file
/// shorter than the volume needs is cut there (a short file), a missing
/// one is an error.
fn storage_of(fs: &mut ModelFs, blocks: u64) -> Result<SimStorage, String> {
    let layout = superblock_of(fs)?.layout;
    let geometry = geometry(layout, blocks)?;
    let storage = SimStorage::new();
    for object in objects_of(&geometry) {
        let path = Path::new(VOLUME).join(object.file_name());
        let bytes = fs
            .file(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        storage.overwrite(object, 0, bytes);
        let nominal = match object {
            ObjectId::Contexts => geometry.contexts_len(),
            ObjectId::Data(segment) => geometry.segment_len(segment),
            _ => 0,
        };
        if (bytes.len() as u64) < nominal {
            storage.truncate(object, bytes.len() as u64);
        }
    }
    Ok(storage)
}

/// Open the volume of `fs` (which must be `blocks` blocks), read every
/// block against `model` (zeros past it), check, close.
fn open_and_read(fs: &mut ModelFs, blocks: u64, model: &[Vec<u8>]) -> Result<(), String> {
    let size = superblock_of(fs)?.size_bytes;
    if size != blocks * BLOCK as u64 {
        return Err(format!(
            "the superblock says {} blocks, want {blocks}",
            size / BLOCK as u64
        ));
    }
    let storage = storage_of(fs, blocks)?;
    let volume = Volume::open(Arc::new(storage), &OpenOptions::default())
        .map_err(|e| format!("open at {blocks} blocks: {e}"))?;
    if volume.is_read_only() {
        return Err("opened read-only".into());
    }
    let zeros = vec![0u8; BLOCK];
    let mut buf = vec![0u8; BLOCK];
    for lba in 0..blocks {
        volume
            .read(lba * BLOCK as u64, &mut buf)
            .map_err(|e| format!("LBA {lba}: {e}"))?;
        if buf != *model.get(lba as usize).unwrap_or(&zeros) {
            return Err(format!("LBA {lba} reads other data"));
        }
    }
    let check = volume.check(|_, _| {}).map_err(|e| format!("check: {e}"))?;
    if !check.faults.is_empty() {
        return Err(format!(
            "check found {} faults, the first {:?}",
            check.faults.len(),
            check.faults[0]
        ));
    }
    volume.close().map_err(|e| format!("close: {e}"))
}

fn verify(fs: ModelFs, step: &Step, breaks: ResizeBreaks) -> Result<(), String> {
    let volume = Path::new(VOLUME);
    // What the next open does first.
    let recovered = Recording::new(fs);
    resize::finish(&recovered, volume).map_err(|e| format!("finish: {e}"))?;
    let mut fs = recovered.fs.lock().clone();
    let blocks = superblock_of(&mut fs)?.size_bytes / BLOCK as u64;
    if blocks != step.from && blocks != step.to {
        return Err(format!(
            "{blocks} blocks: neither the old size nor the new one"
        ));
    }
    open_and_read(&mut fs.clone(), blocks, &step.model)?;
    // The operator runs the resize again.
    let again = Recording::new(fs);
    resize::resize(&again, volume, step.to * BLOCK as u64, breaks)
        .map_err(|e| format!("resize again: {e}"))?;
    let mut fs = again.fs.lock().clone();
    open_and_read(&mut fs, step.to, &step.model).map_err(|e| format!("resized again: {e}"))
}
