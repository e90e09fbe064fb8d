//! `vouch snapshot create` and `delete` of a mirror of two local legs
//! (`snapshot::create_legs`, each leg's copy at one flush point), crashed
//! at every file operation they issue (`vouch-sim snapshot --legs`).
//!
//! Per seed: a small volume written on random data and closed cleanly;
//! its files are put in the model filesystem twice, as the two legs
//! (`/l0`, `/l1`: the engine sees a leg as a volume directory, and the
//! mirror's own files are not part of a snapshot). `create_legs` (the
//! legs stopped) and then the delete the CLI runs (each leg's copy in
//! turn: tidy, delete) run there, crashed before each operation as
//! `vouch-sim snapshot` does (a process crash, a power cut keeping
//! nothing unsynced, one keeping some). On each image, after the tidy of
//! each leg the next command does:
//!
//! - each leg's own files are exactly as before;
//! - each leg's copy is whole or absent: every file as the volume's
//!   (superblocks marked SNAPSHOT, journal new), and, written out, it opens
//!   read-only and reads every block as the volume does;
//! - two copies present are of one snapshot (one record id);
//! - once the create returned (and before the delete began) both copies
//!   are there; legs holding a copy while another does not (a crash
//!   between the renames) are counted: `vouch snapshot list` reports
//!   them, and the delete of the copies present followed by the create
//!   again leaves both legs a whole copy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::snapshot::{self, SnapshotBreaks, StoppedLegs};
use vouch_engine::{BlockDevice, CreateOptions, OpenOptions};

use crate::faults::BLOCKS;
use crate::migrate::TempDir;
use crate::rng::Rng;
use crate::snapshot::{Findings, ModelFs, Recording, SnapshotConfig, SnapshotReport};
use crate::snapshot_regions::{files_under, same_files, write_random};
use crate::BLOCK;

const LEGS: [&str; 2] = ["/l0", "/l1"];
const NAME: &str = "s1";
const BLOCK_U64: u64 = BLOCK as u64;

/// What the steps have finished: the create returned; the delete began.
type Done = (bool, bool);

/// The volume's files (paths relative to its directory) and its image.
struct Expected {
    files: BTreeMap<PathBuf, Vec<u8>>,
    image: Vec<u8>,
}

/// The run's report, and how many crash images found the legs
/// disagreeing (a copy named on one leg only).
pub fn run(config: &SnapshotConfig) -> (SnapshotReport, u64) {
    let flag = if config.breaks.publish_before_sync {
        "--legs --break-publish"
    } else {
        "--legs"
    };
    let disagreeing = Arc::new(AtomicU64::new(0));
    let report = crate::snapshot::run_seeds(
        ("snapshot", config.layout, Some(flag)),
        config.seed..config.seed + config.seeds,
        |seed, report| run_seed(config, seed, report, &disagreeing),
    );
    (report, disagreeing.load(Ordering::Relaxed))
}

fn legs() -> Vec<PathBuf> {
    LEGS.iter().map(PathBuf::from).collect()
}

/// Every block of the volume at `path`, opened with `options`, and
/// whether it opened read-only, or why not (a fault, a refused open).
fn read_image(path: &Path, options: &OpenOptions) -> Result<(Vec<u8>, bool), String> {
    let volume = vouch_engine::open_volume(path, options).map_err(|e| format!("open: {e}"))?;
    let read_only = BlockDevice::is_read_only(&volume);
    let mut image = vec![0u8; (BLOCKS * BLOCK_U64) as usize];
    let faults = volume
        .read_blocks_collecting(0, BLOCKS, &mut image)
        .map_err(|e| format!("read: {e}"))?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    if let Some(fault) = faults.first() {
        return Err(format!("{} faults, the first {fault}", faults.len()));
    }
    Ok((image, read_only))
}

fn run_seed(
    config: &SnapshotConfig,
    seed: u64,
    report: &mut SnapshotReport,
    disagreeing: &Arc<AtomicU64>,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let temp = TempDir::new(&format!("snapshot-legs-{seed}"));
    let real = temp.0.join("v");
    let options = CreateOptions {
        layout: config.layout,
        journal_bytes: Some(1 << 20),
        ..CreateOptions::new(BLOCKS * BLOCK_U64)
    };
    let volume =
        vouch_engine::create_volume(&real, &options).map_err(|e| format!("create: {e}"))?;
    write_random(&volume, &mut rng, 12)?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    let files = files_under(&real);
    let read_only = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let (image, _) = read_image(&real, &read_only)?;
    let mut fs = ModelFs::new();
    for leg in LEGS {
        fs.put_dir(Path::new(leg));
        for (name, bytes) in &files {
            fs.put_file(&Path::new(leg).join(name), bytes.clone());
        }
    }
    fs.sync_all_dirs();
    let expected = Arc::new(Expected { files, image });

    let recording = Recording::new(fs);
    let done = Arc::new(Mutex::new((false, false)));
    let findings = Findings::default();
    {
        let (done, expected) = (done.clone(), expected.clone());
        let breaks = config.breaks;
        let scratch = temp.0.join("images");
        let disagreeing = Arc::clone(disagreeing);
        *recording.hook.lock() = Some(findings.hook(rng.fork(), move |image| {
            let copies = verify(image, &expected, *done.lock(), breaks, &scratch)?;
            if copies == 1 {
                disagreeing.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    let legs = legs();
    snapshot::create_legs(
        &recording,
        &legs,
        NAME,
        "reflink",
        config.breaks,
        &StoppedLegs {
            fs: &recording,
            legs: &legs,
        },
    )
    .map_err(|e| format!("create failed: {e}"))?;
    done.lock().0 = true;
    done.lock().1 = true;
    delete_copies(&recording, &legs).map_err(|e| format!("delete failed: {e}"))?;
    *recording.hook.lock() = None;
    let ended = findings.end(report);
    let after = recording.fs.lock().clone();
    for leg in &legs {
        if after.lookup(&snapshot::snapshot_path(leg, NAME)).is_some() {
            return Err(format!(
                "{}'s copy is still there after the delete",
                leg.display()
            ));
        }
    }
    verify(
        after,
        &expected,
        (true, true),
        config.breaks,
        &temp.0.join("images"),
    )
    .map_err(|e| format!("after every command: {e}"))?;
    ended
}

/// What `vouch snapshot delete` of the mirror does: each leg holding a
/// copy tidied and its copy deleted, in leg order.
fn delete_copies(fs: &Recording, legs: &[PathBuf]) -> vouch_engine::Result<()> {
    for leg in legs {
        if fs
            .fs
            .lock()
            .lookup(&snapshot::snapshot_path(leg, NAME))
            .is_some()
        {
            snapshot::tidy(fs, leg)?;
            snapshot::delete(fs, leg, NAME)?;
        }
    }
    Ok(())
}

/// The copy at `dir` of `fs`, written out to `scratch`, opened (read-only
/// whatever is asked) and read whole: the volume's image, no fault.
fn reads_whole(
    fs: &mut ModelFs,
    dir: &Path,
    expected: &Expected,
    scratch: &Path,
) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(scratch);
    std::fs::create_dir_all(scratch).map_err(|e| e.to_string())?;
    for name in expected.files.keys() {
        let bytes = fs
            .file(&dir.join(name))
            .map_err(|e| format!("{}: {e}", dir.join(name).display()))?;
        std::fs::write(scratch.join(name), bytes).map_err(|e| e.to_string())?;
    }
    let (image, read_only) = read_image(scratch, &OpenOptions::default())
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    if !read_only {
        return Err(format!("{}: a snapshot opened writable", dir.display()));
    }
    if let Some(block) = image
        .chunks(BLOCK)
        .zip(expected.image.chunks(BLOCK))
        .position(|(a, b)| a != b)
    {
        return Err(format!("{}: LBA {block} reads other data", dir.display()));
    }
    Ok(())
}

/// The id in the record of the copy at `dir`.
fn record_id(fs: &mut ModelFs, dir: &Path) -> Result<String, String> {
    let path = dir.join(snapshot::RECORD_FILE);
    let bytes = fs
        .file(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // The record is JSON; this crate reads its one string field here.
    let text = String::from_utf8_lossy(bytes);
    let id = text
        .split("\"id\": \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .ok_or_else(|| format!("{}: no id", path.display()))?;
    Ok(id.to_string())
}

fn verify(
    mut fs: ModelFs,
    expected: &Expected,
    (created, deleting): Done,
    breaks: SnapshotBreaks,
    scratch: &Path,
) -> Result<usize, String> {
    let legs = legs();
    let recovered = Recording::new(fs.clone());
    for leg in &legs {
        snapshot::tidy(&recovered, leg).map_err(|e| format!("tidy: {e}"))?;
    }
    fs = recovered.fs.lock().clone();
    let mut ids = Vec::new();
    for leg in &legs {
        same_files(&mut fs, leg, &expected.files, false, false)
            .map_err(|e| format!("leg {}: {e}", leg.display()))?;
        let copy = snapshot::snapshot_path(leg, NAME);
        if fs.lookup(&copy).is_some() {
            same_files(&mut fs, &copy, &expected.files, true, true)?;
            reads_whole(&mut fs, &copy, expected, scratch)?;
            ids.push(record_id(&mut fs, &copy)?);
        } else if created && !deleting {
            return Err(format!(
                "the create returned but {}'s copy is gone",
                leg.display()
            ));
        }
    }
    let copies = ids.len();
    if ids.windows(2).any(|pair| pair[0] != pair[1]) {
        return Err(format!(
            "the legs' copies are of different snapshots: {ids:?}"
        ));
    }
    // The legs disagree (some copies named, not all) or agree: the delete
    // of what is there and the create again leave both a whole copy.
    let again = Recording::new(fs);
    delete_copies(&again, &legs).map_err(|e| format!("delete again: {e}"))?;
    snapshot::create_legs(
        &again,
        &legs,
        NAME,
        "reflink",
        breaks,
        &StoppedLegs {
            fs: &again,
            legs: &legs,
        },
    )
    .map_err(|e| format!("create again: {e}"))?;
    let mut fs = again.fs.lock().clone();
    for leg in &legs {
        same_files(
            &mut fs,
            &snapshot::snapshot_path(leg, NAME),
            &expected.files,
            true,
            true,
        )
        .map_err(|e| format!("created again: {e}"))?;
    }
    Ok(copies)
}
