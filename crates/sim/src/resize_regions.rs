//! `vouch resize` of a volume with regions crashed at every file
//! operation it issues (`vouch-sim resize --regions`).
//!
//! Per seed: a small volume written in the given layout, migrated to the
//! other (`regions::migrate`: its region is served by the other member,
//! `layout.NAME/`), written again through its region layer and closed
//! cleanly; its files (both members and the record) are put in the model
//! filesystem of `vouch-sim snapshot` (`ModelFs`: a power cut keeps only
//! what was synced). Then the engine's `resize::resize` runs on it three
//! times, as `vouch-sim resize` does: a grow, a grow after random blocks
//! of the new tail (its last always) were written through the region
//! layer, and a shrink back over the unwritten tail. Right before each
//! operation a resize issues (the other member's resize, the home's, the
//! region record's), three crash images are taken (a process crash, a
//! power cut keeping nothing unsynced, one keeping a random subset). On
//! each, after what the next open does first (`regions::resize::finish`):
//!
//! - the home member says the old size or the new one, and the other
//!   member the same (no member is served at a size the other lacks);
//! - written out to real files, the volume opens writable through its
//!   region layer, reads every block as the model says (zeros in a new
//!   tail), and `check` finds nothing;
//! - the resize run again reaches the new size with the same data.
//!
//! The volume has one region (`faults::BLOCKS` blocks): the record of
//! another region count (`regions.resize`) needs a volume past 62 MiB
//! per member; `vouch/tests/resize_regions.rs` grows and shrinks one
//! across a region's end on real files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::regions::{self, RegionVolume};
use vouch_engine::resize::{self, ResizeBreaks};
use vouch_engine::{BlockDevice, OpenOptions};

use crate::faults::BLOCKS;
use crate::migrate::TempDir;
use crate::model_files::{
    check_clean, load_under, reads_as, superblock_in, write_back_of, write_out_of, write_some,
};
use crate::resize::{ResizeConfig, ResizeReport};
use crate::rng::Rng;
use crate::snapshot::{Findings, ModelFs, Recording};
use crate::BLOCK;

const VOLUME: &str = "/v";
const BLOCK_U64: u64 = BLOCK as u64;

/// The resize under way: the sizes before and after, and the volume's
/// image (as long as the larger).
#[derive(Clone)]
struct Step {
    from: u64,
    to: u64,
    image: Arc<Vec<u8>>,
}

/// What a seed starts from: the volume with regions made on real files
/// (`real`, in `temp`), its image, the two sizes, and the model
/// filesystem (holding the volume's files) whose hook judges every crash
/// image against the step under way (`step`; none: no check).
struct Start {
    rng: Rng,
    temp: TempDir,
    real: PathBuf,
    image: Vec<u8>,
    first: u64,
    second: u64,
    recording: Recording,
    step: Arc<Mutex<Option<Step>>>,
    findings: Findings,
}

fn start(config: &ResizeConfig, seed: u64, online: bool) -> Result<Start, String> {
    let mut rng = Rng::new(seed);
    let name = if online {
        "resize-regions-online"
    } else {
        "resize-regions"
    };
    let temp = TempDir::new(&format!("{name}-{seed}"));
    let real = temp.0.join("v");
    crate::snapshot_regions::make_volume(&real, config.layout, &mut rng)?;
    let image = read_whole(&real, BLOCKS)?;
    let mut fs = ModelFs::new();
    load(&mut fs, &real)?;
    let first = BLOCKS + rng.range(1, 160);
    let second = first + rng.range(1, 160);

    let recording = Recording::new(fs);
    let step: Arc<Mutex<Option<Step>>> = Arc::default();
    let findings = Findings::default();
    {
        let (step, breaks) = (step.clone(), config.breaks);
        let scratch = temp.0.join("image");
        let shown = if online { "online " } else { "" };
        *recording.hook.lock() = Some(findings.hook(rng.fork(), move |fs| {
            let Some(step) = step.lock().clone() else {
                return Ok(());
            };
            verify(fs, &step, breaks, &scratch)
                .map_err(|e| format!("{shown}{} -> {} blocks: {e}", step.from, step.to))
        }));
    }
    Ok(Start {
        rng,
        temp,
        real,
        image,
        first,
        second,
        recording,
        step,
        findings,
    })
}

pub(crate) fn run_seed(
    config: &ResizeConfig,
    seed: u64,
    report: &mut ResizeReport,
) -> Result<(), String> {
    let Start {
        mut rng,
        temp,
        mut image,
        first,
        second,
        recording,
        step,
        findings,
        ..
    } = start(config, seed, false)?;
    let scratch = temp.0.join("after");
    let resize_to = |from: u64, to: u64, image: &[u8]| -> Result<(), String> {
        *step.lock() = Some(Step {
            from,
            to,
            image: Arc::new(image.to_vec()),
        });
        let done = resize::resize(&recording, Path::new(VOLUME), to * BLOCK_U64, config.breaks);
        *step.lock() = None;
        done.map_err(|e| format!("resize {from} -> {to} blocks failed: {e}"))?;
        let fs = recording.fs.lock().clone();
        opens_as(fs, to, image, &scratch).map_err(|e| format!("after resize to {to}: {e}"))
    };

    image.resize((first * BLOCK_U64) as usize, 0);
    resize_to(BLOCKS, first, &image)?;

    // Into the new tail through the region layer, its last block always.
    {
        let _ = std::fs::remove_dir_all(&scratch);
        write_out(&recording.fs.lock(), &scratch)?;
        let volume = RegionVolume::open(&scratch, &OpenOptions::default())
            .map_err(|e| format!("open at {first} blocks: {e}"))?;
        let lbas: Vec<u64> = (0..rng.range(1, 8))
            .map(|_| rng.range(BLOCKS, first - 1))
            .chain([first - 1])
            .collect();
        for lba in lbas {
            let data = rng.bytes(BLOCK);
            volume
                .write(lba * BLOCK_U64, &data, false)
                .map_err(|e| format!("write LBA {lba}: {e}"))?;
            image[(lba * BLOCK_U64) as usize..((lba + 1) * BLOCK_U64) as usize]
                .copy_from_slice(&data);
        }
        volume
            .close()
            .map_err(|e| format!("close at {first} blocks: {e}"))?;
        let mut fs = ModelFs::new();
        load(&mut fs, &scratch)?;
        *recording.fs.lock() = fs;
    }

    let mut grown = image.clone();
    grown.resize((second * BLOCK_U64) as usize, 0);
    resize_to(first, second, &grown)?;
    resize_to(second, first, &grown)?;
    *recording.hook.lock() = None;
    findings.end(report)
}

/// Every file under `dir` (a real directory) into `fs` at `VOLUME`,
/// durable.
fn load(fs: &mut ModelFs, dir: &Path) -> Result<(), String> {
    load_under(fs, dir, Path::new(VOLUME))
}

/// Every file of `VOLUME` in `fs` written out under `to` (sparse: zero
/// pages are holes), which must not exist.
fn write_out(fs: &ModelFs, to: &Path) -> Result<(), String> {
    write_out_of(fs, Path::new(VOLUME), to)
}

/// The volume with regions at `path` (of `blocks` blocks) opened
/// writable, read whole (no fault), checked, closed.
fn read_whole(path: &Path, blocks: u64) -> Result<Vec<u8>, String> {
    let volume =
        RegionVolume::open(path, &OpenOptions::default()).map_err(|e| format!("open: {e}"))?;
    if BlockDevice::is_read_only(&volume) {
        return Err("opened read-only".into());
    }
    let image = read_served(&volume, blocks)?;
    check_clean(&volume)?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    Ok(image)
}

/// The open `volume`, of `blocks` blocks, read whole (no fault).
fn read_served(volume: &RegionVolume, blocks: u64) -> Result<Vec<u8>, String> {
    if volume.blocks() != blocks {
        return Err(format!(
            "opened at {} blocks, want {blocks}",
            volume.blocks()
        ));
    }
    let mut image = vec![0u8; (blocks * BLOCK_U64) as usize];
    let faults = volume
        .read_blocks_collecting(0, blocks, &mut image)
        .map_err(|e| format!("read: {e}"))?;
    if let Some(fault) = faults.first() {
        return Err(format!("{} faults, the first {fault}", faults.len()));
    }
    Ok(image)
}

/// The volume of `fs`, written out to `scratch`, opens at `blocks` blocks
/// and reads as `image` (zeros past it), cleanly checked.
fn opens_as(fs: ModelFs, blocks: u64, image: &[u8], scratch: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(scratch);
    write_out(&fs, scratch)?;
    reads_as(&read_whole(scratch, blocks)?, image)
}

/// The sizes in blocks the home member and the other member say.
fn home_and_member_blocks(fs: &ModelFs) -> Result<(u64, u64), String> {
    let volume = Path::new(VOLUME);
    let home = superblock_in(fs, volume)?;
    let other = superblock_in(fs, &regions::member_path(volume, home.layout))?;
    Ok((home.size_bytes / BLOCK_U64, other.size_bytes / BLOCK_U64))
}

fn verify(fs: ModelFs, step: &Step, breaks: ResizeBreaks, scratch: &Path) -> Result<(), String> {
    let volume = Path::new(VOLUME);
    // What the next open does first.
    let recovered = Recording::new(fs);
    regions::resize::finish(&recovered, volume).map_err(|e| format!("finish: {e}"))?;
    let fs = recovered.fs.lock().clone();
    let (blocks, other) = home_and_member_blocks(&fs)?;
    if blocks != step.from && blocks != step.to {
        return Err(format!(
            "{blocks} blocks: neither the old size nor the new one"
        ));
    }
    if other != blocks {
        return Err(format!(
            "after the open's finish the home has {blocks} blocks, the other member {other}"
        ));
    }
    opens_as(fs.clone(), blocks, &step.image, scratch)?;
    // The operator runs the resize again.
    let again = Recording::new(fs);
    resize::resize(&again, volume, step.to * BLOCK_U64, breaks)
        .map_err(|e| format!("resize again: {e}"))?;
    let fs = again.fs.lock().clone();
    opens_as(fs, step.to, &step.image, scratch).map_err(|e| format!("resized again: {e}"))
}

fn sim_error(error: String) -> vouch_engine::Error {
    vouch_engine::Error::InvalidArgument(error)
}

/// The files of `fs` put back over the real volume at `to` (open and
/// held by the served volume: files rewritten in place, those the model
/// lacks removed).
fn write_back(fs: &ModelFs, to: &Path) -> Result<(), String> {
    write_back_of(fs, Path::new(VOLUME), to)
}

/// `vouch-sim resize --online --regions`: the three resizes of `run_seed`
/// through a served volume with regions (`RegionVolume::resize_online`,
/// open on real files): writes in its members' buffers before each, both
/// engines closed by it, their files (durable: the clean close synced
/// them) put in the model filesystem and resized there by the same
/// `resize::resize` (three crash images before each of its operations,
/// each judged as `run_seed` judges it: the writes acknowledged before
/// the resize are in every image), written back, both members opened
/// again; the served volume then has the new size and reads as the model,
/// and after its close the volume opens as it.
pub(crate) fn run_seed_online(
    config: &ResizeConfig,
    seed: u64,
    report: &mut ResizeReport,
) -> Result<(), String> {
    let Start {
        mut rng,
        temp: _temp,
        real,
        mut image,
        first,
        second,
        recording,
        step,
        findings,
    } = start(config, seed, true)?;
    let volume = RegionVolume::open(&real, &OpenOptions::default())
        .map_err(|e| format!("open served: {e}"))?;
    let resize_online = |from: u64, to: u64, image: &[u8]| -> Result<(), String> {
        *step.lock() = Some(Step {
            from,
            to,
            image: Arc::new(image.to_vec()),
        });
        let done = volume.resize_online_driven(
            to * BLOCK_U64,
            regions::resize::RegionResizeSteps {
                files: &mut |bytes| {
                    let mut fs = ModelFs::new();
                    load(&mut fs, &real).map_err(sim_error)?;
                    *recording.fs.lock() = fs;
                    resize::resize(&recording, Path::new(VOLUME), bytes, config.breaks)?;
                    let fs = recording.fs.lock().clone();
                    write_back(&fs, &real).map_err(sim_error)
                },
                reopen: &mut |storage, geometry| {
                    storage
                        .reopen(geometry)
                        .map_err(|e| sim_error(format!("reopen: {e}")))
                },
            },
            config.breaks,
        );
        *step.lock() = None;
        done.map_err(|e| format!("online resize {from} -> {to} blocks failed: {e}"))?;
        read_served(&volume, to)
            .and_then(|read| reads_as(&read, image))
            .map_err(|e| format!("served, after the online resize to {to} blocks: {e}"))
    };

    write_some(&volume, &mut image, &mut rng, 0..BLOCKS, BLOCKS - 1)?;
    image.resize((first * BLOCK_U64) as usize, 0);
    resize_online(BLOCKS, first, &image)?;
    // Into the new tail through the served volume, its last block always.
    write_some(&volume, &mut image, &mut rng, BLOCKS..first, first - 1)?;
    let mut grown = image.clone();
    grown.resize((second * BLOCK_U64) as usize, 0);
    resize_online(first, second, &grown)?;
    write_some(&volume, &mut grown, &mut rng, 0..first, first - 1)?;
    resize_online(second, first, &grown)?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    *recording.hook.lock() = None;
    let read = read_whole(&real, first).map_err(|e| format!("at the end: {e}"))?;
    if read[..] != grown[..(first * BLOCK_U64) as usize] {
        return Err("at the end: the volume reads other data".into());
    }
    findings.end(report)
}
