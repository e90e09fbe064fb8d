//! Crash points of mirror resync (`crates/engine/src/mirror/resync.rs`,
//! docs/CRASH_MODEL.md "Resync"). Two identical legs on simulated storage;
//! leg 1 goes away and a `Mirror` writes random blocks to leg 0 alone,
//! marking them in a resync map (a real file in a temporary directory).
//! Leg 1 then comes back on the recording storage and is resynced; at
//! every write and sync it issues, crash images of leg 1 are built with
//! every strategy, and the map file as it is on disk at that moment is
//! kept. Contract, for every image:
//! - leg 1 opens and each block reads its old contents (before the resync)
//!   or its new ones (leg 0's), never other bytes, never a fault;
//! - the kept map is valid (not unknown history), and a restart resyncing
//!   from it leaves leg 1 equal to leg 0 on every block;
//! - once the map is gone (the resync finished), leg 1 equals leg 0.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use vouch_engine::mirror::{DirtyMap, LegState, Mirror, MirrorLeg, ResyncRate};
use vouch_engine::{
    BlockDevice, CreateOptions, LayoutKind, OpenOptions, SimStorage, Storage, Volume,
};

use crate::recorder::{crash_image, Recorder, STRATEGIES};
use crate::rng::Rng;
use crate::BLOCK;

/// Blocks in the volume (one resync window).
const BLOCKS: u64 = 96;
const UUID: [u8; 16] = [0x5e; 16];
const FAST: ResyncRate = ResyncRate {
    min: 1 << 40,
    max: 1 << 40,
};

/// A crash image of leg 1 and the map file on disk at that moment.
type CrashImage = (SimStorage, Option<Vec<u8>>);

/// What a resync crash run found.
#[derive(Debug, Default)]
pub struct ResyncReport {
    pub seeds: u64,
    /// Crash images of leg 1 checked (each also restarted to the end).
    pub images: u64,
    /// Blocks the resyncs copied (summed over seeds).
    pub copied: u64,
    /// Image blocks that read their old and their new contents.
    pub old_blocks: u64,
    pub new_blocks: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl ResyncReport {
    pub fn summary(&self) -> String {
        format!(
            "mirror resync: seeds={} images={} copied={} image blocks old={} new={} violations={} time={:.1}s",
            self.seeds,
            self.images,
            self.copied,
            self.old_blocks,
            self.new_blocks,
            self.violations.len(),
            self.seconds
        )
    }
}

fn open_options() -> OpenOptions {
    crate::foreground_options()
}

/// Run seeds `first..first + seeds`.
pub fn run(first: u64, seeds: u64) -> ResyncReport {
    let started = Instant::now();
    let mut report = ResyncReport::default();
    for seed in first..first + seeds {
        let dir =
            std::env::temp_dir().join(format!("vouch-sim-resync-{}-{seed}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(message) = std::fs::create_dir_all(&dir)
            .map_err(|e| e.to_string())
            .and_then(|()| run_seed(seed, &dir, &mut report))
        {
            report.violations.push(format!("seed {seed}: {message}"));
        }
        let _ = std::fs::remove_dir_all(&dir);
        report.seeds += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

fn open(storage: Arc<dyn Storage>) -> Result<Arc<Volume>, String> {
    Volume::open(storage, &open_options())
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// A mirror of `leg0` (active) and `leg1` (stale; `None`: missing) whose
/// writes for leg 1 are marked in the map in `dir`.
fn stale_mirror(
    leg0: Arc<Volume>,
    leg1: Option<Arc<Volume>>,
    dir: &Path,
    create_clean: bool,
) -> Result<(Arc<Mirror>, Option<String>), String> {
    let mirror = Mirror::new(
        vec![
            MirrorLeg {
                name: "leg0".into(),
                device: Some(leg0 as Arc<dyn BlockDevice>),
                state: LegState::Active,
            },
            MirrorLeg {
                name: "leg1".into(),
                device: leg1.map(|v| v as Arc<dyn BlockDevice>),
                state: LegState::Stale,
            },
        ],
        None,
    )
    .map_err(|e| e.to_string())?;
    let (map, unknown) = DirtyMap::open(&[dir.to_path_buf()], 1, UUID, BLOCKS, create_clean)
        .map_err(|e| e.to_string())?;
    mirror.track(1, Arc::new(map)).map_err(|e| e.to_string())?;
    Ok((Arc::new(mirror), unknown))
}

/// Resync leg 1 to the end; the blocks copied.
fn resync(mirror: &Arc<Mirror>) -> Result<u64, String> {
    mirror
        .start_resync(1, FAST, false)
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while mirror.status()[1].resyncing {
        if Instant::now() > deadline {
            return Err("resync did not end within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    mirror.stop_resyncs().map_err(|e| e.to_string())?;
    let progress = mirror.status()[1].resync.clone().ok_or("no progress")?;
    if progress.state != "done" {
        return Err(format!("resync ended {progress:?}"));
    }
    Ok(progress.copied)
}

fn read_all(volume: &Volume) -> Result<Vec<Vec<u8>>, String> {
    (0..BLOCKS)
        .map(|lba| {
            let mut buf = vec![0u8; BLOCK];
            volume
                .read(lba * BLOCK as u64, &mut buf)
                .map(|_| buf)
                .map_err(|e| format!("LBA {lba}: {e}"))
        })
        .collect()
}

/// One seed; violations are pushed to `report`, setup errors returned.
pub fn run_seed(seed: u64, dir: &Path, report: &mut ResyncReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(BLOCKS * BLOCK as u64);
    options.layout = if rng.chance(1, 2) {
        LayoutKind::Split
    } else {
        LayoutKind::Packed
    };
    let volume = Volume::create(Arc::new(sim.clone()), &options).map_err(|e| e.to_string())?;
    for lba in 0..BLOCKS / 2 {
        volume
            .write(lba * BLOCK as u64, &rng.bytes(BLOCK), false)
            .map_err(|e| e.to_string())?;
    }
    volume.close().map_err(|e| e.to_string())?;
    let leg0_sim = sim.crash_image(|_, _, _| u64::MAX);
    let leg1_sim = sim.crash_image(|_, _, _| u64::MAX);
    let old = read_all(&*open(Arc::new(leg1_sim.clone()))?)?;

    // Leg 1 away: writes reach leg 0 only and are marked in the map.
    let leg0 = open(Arc::new(leg0_sim.clone()))?;
    let (mirror, _) = stale_mirror(Arc::clone(&leg0), None, dir, true)?;
    for _ in 0..rng.range(1, 12) {
        let lba = rng.below(BLOCKS);
        let count = rng.range(1, 4).min(BLOCKS - lba);
        mirror
            .write(
                lba * BLOCK as u64,
                &rng.bytes(BLOCK * count as usize),
                false,
            )
            .map_err(|e| e.to_string())?;
        if rng.chance(1, 3) {
            mirror.flush().map_err(|e| e.to_string())?;
        }
    }
    mirror.flush().map_err(|e| e.to_string())?;
    mirror.stop_resyncs().map_err(|e| e.to_string())?;
    drop(mirror);
    Arc::try_unwrap(leg0)
        .map_err(|_| "leg 0 still shared")?
        .close()
        .map_err(|e| e.to_string())?;
    let new = read_all(&*open(Arc::new(leg0_sim.clone()))?)?;

    // Leg 1 back on the recorder: resync, crash images at each of its I/Os.
    let recorder = Arc::new(Recorder::new(leg1_sim));
    let map_path: PathBuf = dir.join("mirror.dirty.1");
    let images: Arc<Mutex<Vec<CrashImage>>> = Arc::new(Mutex::new(Vec::new()));
    let collected = Arc::clone(&images);
    let mut hook_rng = rng.fork();
    let hook_map = map_path.clone();
    recorder.set_hook(Some(Box::new(move |sim, order| {
        let map = std::fs::read(&hook_map).ok();
        for strategy in STRATEGIES {
            let image = crash_image(sim, order, strategy, 4096, &mut hook_rng);
            collected.lock().push((image, map.clone()));
        }
    })));
    let leg0 = open(Arc::new(leg0_sim.crash_image(|_, _, _| u64::MAX)))?;
    let leg1 = open(recorder.clone() as Arc<dyn Storage>)?;
    let (mirror, unknown) = stale_mirror(leg0, Some(leg1), dir, false)?;
    if let Some(why) = unknown {
        return Err(format!(
            "the map written while leg 1 was away is unusable: {why}"
        ));
    }
    report.copied += resync(&mirror)?;
    recorder.crash_point();
    recorder.set_hook(None);
    drop(mirror);

    let images = std::mem::take(&mut *images.lock());
    for (index, (image, map)) in images.into_iter().enumerate() {
        report.images += 1;
        let fail = |what: String| format!("seed {seed} image {index}: {what}");
        let volume = match open(Arc::new(image.clone())) {
            Ok(volume) => volume,
            Err(error) => {
                report
                    .violations
                    .push(fail(format!("leg 1 does not open: {error}")));
                continue;
            }
        };
        for lba in 0..BLOCKS {
            let mut buf = vec![0u8; BLOCK];
            match volume.read(lba * BLOCK as u64, &mut buf) {
                Ok(_) if buf == new[lba as usize] => report.new_blocks += 1,
                Ok(_) if buf == old[lba as usize] => report.old_blocks += 1,
                other => report.violations.push(fail(format!(
                    "leg 1 LBA {lba} reads neither its old nor its new contents: {:?}",
                    other.map(|_| "other bytes")
                ))),
            }
        }
        // Restart: the map as it was on disk, the resync run to the end.
        // No map: the resync had finished (the leg is active): it must
        // hold every block.
        let Some(map) = map else {
            match read_all(&volume) {
                Ok(after) if after == new => {}
                other => report.violations.push(fail(format!(
                    "the map is gone but leg 1 differs from leg 0: {:?}",
                    other.map(|_| "some blocks differ")
                ))),
            }
            continue;
        };
        drop(volume);
        std::fs::write(&map_path, &map).map_err(|e| e.to_string())?;
        let leg0 = open(Arc::new(leg0_sim.crash_image(|_, _, _| u64::MAX)))?;
        let leg1 = open(Arc::new(image))?;
        let (mirror, unknown) = stale_mirror(leg0, Some(Arc::clone(&leg1)), dir, false)?;
        if let Some(why) = unknown {
            report
                .violations
                .push(fail(format!("the map on disk is unusable: {why}")));
        }
        if let Err(error) = resync(&mirror) {
            report
                .violations
                .push(fail(format!("restarted resync: {error}")));
            continue;
        }
        drop(mirror);
        match read_all(&leg1) {
            Ok(after) => {
                for lba in 0..BLOCKS {
                    if after[lba as usize] != new[lba as usize] {
                        report.violations.push(fail(format!(
                            "after the restarted resync leg 1 LBA {lba} differs from leg 0"
                        )));
                    }
                }
            }
            Err(error) => report
                .violations
                .push(fail(format!("after restart: {error}"))),
        }
    }
    Ok(())
}
