//! `vouch snapshot create`, `vouch clone` and `vouch snapshot delete` of
//! a volume with regions (docs/FORMAT.md, "Regions"), crashed at every
//! file operation they issue (`vouch-sim snapshot --regions`).
//!
//! Per seed: a small volume written on random data in the given layout,
//! migrated (`regions::migrate`) to the other one, so that it is a volume
//! with regions: its home member, its other member `layout.NAME/` serving
//! its region, and the record `regions`; more random writes go through
//! the region layer, and it is closed cleanly. Every file of it (the
//! member's too) is put in the model filesystem (`snapshot::ModelFs`),
//! and the engine's `snapshot::create`, `clone` and `delete` run there in
//! turn, crashed before each operation as `vouch-sim snapshot` does (a
//! process crash, a power cut keeping nothing unsynced, one keeping some).
//! On each image, after the tidy the next command does:
//!
//! - the volume's files, every one in both members and the record, are
//!   exactly as before;
//! - a snapshot that has its name is complete: every file byte for byte
//!   the volume's (both superblocks but for the snapshot flag, journals
//!   new), and, written out to real files, it opens through its region
//!   layer read-only and reads every block as the volume does, no fault;
//! - a clone at its path is complete, opens writable with the same data;
//! - what a step finished is there, and the command run again succeeds
//!   (or says the snapshot exists), leaving it complete.
//!
//! The volume has one region (`faults::BLOCKS` blocks): a region of
//! 62 MiB per member would make every crash image copy them. Both members
//! and the record are in every snapshot whatever they serve, so one
//! region served by the other member crashes the same operations as
//! more; `vouch/tests/snapshot_regions.rs` serves snapshots of regions in
//! both layouts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::regions::{self, MigrateBreaks, RegionVolume};
use vouch_engine::snapshot::{self, SnapshotBreaks};
use vouch_engine::{BlockDevice, CreateOptions, LayoutKind, OpenOptions};

use crate::faults::BLOCKS;
use crate::migrate::TempDir;
use crate::rng::Rng;
use crate::snapshot::{
    file_as_expected, Findings, ModelFs, Node, Recording, SnapshotConfig, SnapshotReport,
};
use crate::BLOCK;

const VOLUME: &str = "/v";
const CLONE: &str = "/c";
const NAME: &str = "s1";
const BLOCK_U64: u64 = BLOCK as u64;

/// What the steps have finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Done {
    Nothing,
    Created,
    Cloned,
}

/// The volume's files (paths relative to its directory) and its image.
struct Expected {
    files: BTreeMap<PathBuf, Vec<u8>>,
    image: Vec<u8>,
    /// The other member's directory name (`layout.NAME`).
    member: PathBuf,
}

pub fn run(config: &SnapshotConfig) -> SnapshotReport {
    let flag = if config.breaks.publish_before_sync {
        "--regions --break-publish"
    } else {
        "--regions"
    };
    crate::snapshot::run_seeds(
        ("snapshot", config.layout, Some(flag)),
        config.seed..config.seed + config.seeds,
        |seed, report| run_seed(config, seed, report),
    )
}

pub(crate) fn write_random(
    device: &dyn BlockDevice,
    rng: &mut Rng,
    runs: u64,
) -> Result<(), String> {
    for _ in 0..runs {
        let count = rng.range(1, 24);
        let lba = rng.below(BLOCKS - count);
        let data = rng.bytes((count * BLOCK_U64) as usize);
        device
            .write(lba * BLOCK_U64, &data, false)
            .map_err(|e| format!("write: {e}"))?;
    }
    Ok(())
}

/// A volume with regions at `path`: written in `layout`, migrated to the
/// other, written again through its region layer, closed cleanly.
pub(crate) fn make_volume(path: &Path, layout: LayoutKind, rng: &mut Rng) -> Result<(), String> {
    let options = CreateOptions {
        layout,
        journal_bytes: Some(1 << 20),
        ..CreateOptions::new(BLOCKS * BLOCK_U64)
    };
    let volume = vouch_engine::create_volume(path, &options).map_err(|e| format!("create: {e}"))?;
    write_random(&volume, rng, 10)?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    regions::migrate(
        path,
        regions::other_layout(layout),
        &OpenOptions::default(),
        &MigrateBreaks::default(),
        |_, _| {},
    )
    .map_err(|e| format!("migrate: {e}"))?;
    let volume =
        RegionVolume::open(path, &OpenOptions::default()).map_err(|e| format!("open: {e}"))?;
    write_random(&volume, rng, 6)?;
    volume.close().map_err(|e| format!("close: {e}"))
}

/// Every file under `dir`, by path relative to it.
pub(crate) fn files_under(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        for entry in std::fs::read_dir(dir.join(&relative)).expect("read a directory") {
            let entry = entry.expect("an entry");
            let name = relative.join(entry.file_name());
            if entry.file_type().expect("a type").is_dir() {
                pending.push(name);
            } else {
                files.insert(name, std::fs::read(entry.path()).expect("read a file"));
            }
        }
    }
    files
}

/// Every block of the volume with regions at `path`, opened with
/// `options`, or why not (a fault, a refused open).
fn read_image(path: &Path, options: &OpenOptions) -> Result<(Vec<u8>, bool), String> {
    let volume = RegionVolume::open(path, options).map_err(|e| format!("open: {e}"))?;
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

fn run_seed(config: &SnapshotConfig, seed: u64, report: &mut SnapshotReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let temp = TempDir::new(&format!("snapshot-regions-{seed}"));
    let real = temp.0.join("v");
    make_volume(&real, config.layout, &mut rng)?;
    let files = files_under(&real);
    let (image, _) = read_image(
        &real,
        &OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )?;
    let member = PathBuf::from(
        regions::member_path(Path::new(""), config.layout)
            .file_name()
            .expect("a member name"),
    );
    if !files.contains_key(&member.join("superblock")) {
        return Err(format!(
            "no member {} after the migration",
            member.display()
        ));
    }
    let mut fs = ModelFs::new();
    fs.put_dir(Path::new(VOLUME));
    fs.put_dir(&Path::new(VOLUME).join(&member));
    for (name, bytes) in &files {
        fs.put_file(&Path::new(VOLUME).join(name), bytes.clone());
    }
    fs.sync_all_dirs();
    let expected = Arc::new(Expected {
        files,
        image,
        member,
    });

    let recording = Recording::new(fs);
    let done = Arc::new(Mutex::new(Done::Nothing));
    let deleting = Arc::new(Mutex::new(false));
    let findings = Findings::default();
    {
        let (done, deleting, expected) = (done.clone(), deleting.clone(), expected.clone());
        let breaks = config.breaks;
        let scratch = temp.0.join("images");
        *recording.hook.lock() = Some(findings.hook(rng.fork(), move |image| {
            verify(
                image,
                &expected,
                (*done.lock(), *deleting.lock()),
                breaks,
                &scratch,
            )
        }));
    }
    let volume = Path::new(VOLUME);
    snapshot::create(&recording, volume, NAME, "reflink", config.breaks)
        .map_err(|e| format!("create failed: {e}"))?;
    *done.lock() = Done::Created;
    snapshot::clone(
        &recording,
        &snapshot::snapshot_path(volume, NAME),
        Path::new(CLONE),
    )
    .map_err(|e| format!("clone failed: {e}"))?;
    *done.lock() = Done::Cloned;
    *deleting.lock() = true;
    snapshot::delete(&recording, volume, NAME).map_err(|e| format!("delete failed: {e}"))?;
    *recording.hook.lock() = None;
    let ended = findings.end(report);
    let after = recording.fs.lock().clone();
    if after
        .lookup(&snapshot::snapshot_path(volume, NAME))
        .is_some()
    {
        return Err("the snapshot is still there after its delete".into());
    }
    verify(
        after,
        &expected,
        (Done::Cloned, true),
        config.breaks,
        &temp.0.join("images"),
    )
    .map_err(|e| format!("after every command: {e}"))?;
    ended
}

/// The files of `dir` in `fs`: as the volume's, its superblocks marked
/// `flag` (and a clone's instances new), its journals new (`copy`).
pub(crate) fn same_files(
    fs: &mut ModelFs,
    dir: &Path,
    files: &BTreeMap<PathBuf, Vec<u8>>,
    flag: bool,
    copy: bool,
) -> Result<(), String> {
    for (name, bytes) in files {
        let path = dir.join(name);
        let got = fs
            .file(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        file_as_expected(&path, got, bytes, flag, copy)?;
    }
    Ok(())
}

/// Write the files of `dir` in `fs` (the volume's names) to `to`.
fn write_out(fs: &mut ModelFs, dir: &Path, expected: &Expected, to: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to.join(&expected.member)).map_err(|e| e.to_string())?;
    for name in expected.files.keys() {
        let bytes = fs
            .file(&dir.join(name))
            .map_err(|e| format!("{}: {e}", dir.join(name).display()))?;
        std::fs::write(to.join(name), bytes).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The volume with regions at `dir` of `fs`, written out to `scratch`,
/// opened through its region layer (read-only or not as `read_only`
/// wants) and read whole: the volume's image, no fault.
fn reads_whole(
    fs: &mut ModelFs,
    dir: &Path,
    expected: &Expected,
    read_only: bool,
    scratch: &Path,
) -> Result<(), String> {
    write_out(fs, dir, expected, scratch)?;
    let (image, opened_read_only) = read_image(scratch, &OpenOptions::default())
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    if opened_read_only != read_only {
        return Err(format!(
            "{}: opened read-only {opened_read_only}, want {read_only}",
            dir.display()
        ));
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

fn verify(
    mut fs: ModelFs,
    expected: &Expected,
    (done, deleting): (Done, bool),
    breaks: SnapshotBreaks,
    scratch: &Path,
) -> Result<(), String> {
    let volume = Path::new(VOLUME);
    let recovered = Recording::new(fs.clone());
    snapshot::tidy(&recovered, volume).map_err(|e| format!("tidy: {e}"))?;
    fs = recovered.fs.lock().clone();
    same_files(&mut fs, volume, &expected.files, false, false)
        .map_err(|e| format!("the volume: {e}"))?;
    let snapshots = volume.join(snapshot::SNAPSHOTS_DIR);
    if let Some(id) = fs.lookup(&snapshots) {
        if let Node::Dir { live, .. } = &fs.nodes[id] {
            if let Some(left) = live.keys().find(|name| name.starts_with('.')) {
                return Err(format!("{left} is left in snapshots/ after the tidy"));
            }
        }
    }
    let path = snapshot::snapshot_path(volume, NAME);
    let present = fs.lookup(&path).is_some();
    if present {
        same_files(&mut fs, &path, &expected.files, true, true)?;
        reads_whole(&mut fs, &path, expected, true, scratch)?;
    } else if done >= Done::Created && !deleting {
        return Err("the snapshot create returned but its snapshot is gone".into());
    }
    let clone = Path::new(CLONE);
    if fs.lookup(clone).is_some() {
        same_files(&mut fs, clone, &expected.files, false, true)
            .map_err(|e| format!("the clone: {e}"))?;
        reads_whole(&mut fs, clone, expected, false, scratch)?;
    } else if done >= Done::Cloned {
        return Err("the clone returned but its volume is gone".into());
    }
    let again = Recording::new(fs);
    match snapshot::create(&again, volume, NAME, "reflink", breaks) {
        Ok(_) => {}
        Err(error) if present && error.to_string().contains("already exists") => {}
        Err(error) => return Err(format!("create again: {error}")),
    }
    let mut fs = again.fs.lock().clone();
    same_files(&mut fs, &path, &expected.files, true, true)
        .map_err(|e| format!("created again: {e}"))?;
    if fs.lookup(clone).is_none() {
        let again = Recording::new(fs);
        snapshot::clone(&again, &path, clone).map_err(|e| format!("clone again: {e}"))?;
        let mut fs = again.fs.lock().clone();
        same_files(&mut fs, clone, &expected.files, false, true)
            .map_err(|e| format!("cloned again: {e}"))?;
    }
    Ok(())
}
