//! Fenced snapshots: an online snapshot that costs the flush point only a
//! fence (docs/FORMAT.md, "Fenced snapshots"; docs/CRASH_MODEL.md).
//!
//! At the flush point (`Volume::at_flush_point`) nothing is cloned:
//! `.NAME.partial/` gets the snapshot's superblock, its record, an empty
//! before-image log (`before`) and, last, the `fence` (the fence id and the
//! length of each file the snapshot takes), all synced with the directory;
//! then the volume's before-image layer (`storage/before.rs`) is armed with
//! the log, and the call returns. From then on every home write to the
//! data, contexts and written map files first has the old bytes of its
//! blocks durable in the log.
//!
//! `materialise` then runs beside the served volume, holding nothing: it
//! clones each file into `.NAME.partial/` in pieces (the clone is the file
//! as it is now, some blocks newer than the fence), writes each imaged
//! block's *first* before-image back over the clone (its bytes at the
//! fence; a block with no image was not written since), cuts each file to
//! its fenced length, syncs, renames `.NAME.partial` to `NAME` (synced),
//! and only then disarms the layer and removes `fence` and `before` from
//! the snapshot. A snapshot being materialised is listed as such and
//! cannot be served until it is done (`serve --snapshot` finds no `NAME`).
//!
//! A crash anywhere after the fence is synced loses nothing: the next
//! writable open (`open_volume`) finds the fence, arms the layer with the
//! log before its own replay (recovery's home writes are imaged too), and
//! materialises again from the start (`resume`). A `NAME` that still has a
//! `fence` was published complete: only the two files are removed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vouch_format::superblock::STATE_CLEAN;
use vouch_format::{FeatureFlags, Superblock};

use super::{
    io_error, partial_path, prepare, sync_all, volume_files, write_superblock, RealFs, Snapshot,
    SnapshotFs, SnapshotRecord, PARTIAL, RECORD_FILE, SNAPSHOTS_DIR,
};
use crate::error::{Error, Result};
use crate::storage::before::{first_images, BeforeBreaks, IMAGE_BLOCK};
use crate::storage::{ObjectId, Storage};

/// The fence of a snapshot being materialised, in `.NAME.partial/`.
pub const FENCE_FILE: &str = "fence";
/// Its before-image log, beside the fence.
pub const BEFORE_FILE: &str = "before";

/// What the fence records (JSON): the id every before-image record
/// carries, and each file the snapshot takes with its length at the fence.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Fence {
    pub fence: u64,
    pub files: Vec<(String, u64)>,
}

/// Whether `dir` (a `.NAME.partial` or a published snapshot) has a fence.
pub fn is_fenced(fs: &dyn SnapshotFs, dir: &Path) -> bool {
    fs.exists(&dir.join(FENCE_FILE))
}

/// The names of the snapshots of `volume` being materialised (a fenced
/// `.NAME.partial`).
pub fn materialising(fs: &dyn SnapshotFs, volume: &Path) -> Result<Vec<String>> {
    let dir = volume.join(SNAPSHOTS_DIR);
    let names = fs
        .names(&dir)
        .map_err(|e| io_error("list", &dir, e))?
        .unwrap_or_default();
    Ok(names
        .into_iter()
        .filter_map(|entry| {
            let name = entry.strip_prefix('.')?.strip_suffix(PARTIAL)?.to_string();
            is_fenced(fs, &dir.join(&entry)).then_some(name)
        })
        .collect())
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// Refuse `what` (a resize, a migration: they change the volume's files
/// outside the before-image layer) while a snapshot of the volume at `dir`
/// is materialising.
pub fn refuse_while_materialising(fs: &dyn SnapshotFs, dir: &Path, what: &str) -> Result<()> {
    super::overlay::refuse_beside(fs, dir, what)?;
    match materialising(fs, dir)?.first() {
        None => Ok(()),
        Some(name) => Err(invalid(format!(
            "snapshot {name:?} of {} is still being materialised: {what} once it is done (`vouch snapshot list` shows it; a writable open such as `vouch check` or `vouch serve` finishes one a crash cut short)",
            dir.display()
        ))),
    }
}

/// The before-image layer of the storage under `volume`, or why a fenced
/// snapshot cannot be taken of it.
fn layer_of(storage: &dyn Storage) -> Result<&crate::storage::before::BeforeImages> {
    storage
        .before_images()
        .ok_or_else(|| invalid("this volume was opened without the before-image layer".to_string()))
}

/// Can a fenced snapshot of the served volume at `dir` be taken: a
/// filesystem that clones (xfs, btrfs), one volume (no regions, no mirror
/// leg), opened with the layer, no other snapshot materialising. `Err`
/// says why not (the caller then takes the snapshot the full way).
pub fn can_fence(dir: &Path, volume: &crate::Volume) -> Result<()> {
    let fs = RealFs::default();
    match super::filesystem_name(dir) {
        Some("xfs" | "btrfs") => {}
        other => {
            return Err(invalid(format!(
                "{} is on {}, which cannot clone files",
                dir.display(),
                other.unwrap_or("a filesystem")
            )))
        }
    }
    if fs.exists(&dir.join(vouch_format::mirror::MIRROR_RECORD_FILE)) {
        return Err(invalid("a leg of a mirror".to_string()));
    }
    layer_of(&*volume.storage())?;
    super::overlay::refuse_beside(&fs, dir, "take a fenced snapshot")?;
    if let Some(name) = materialising(&fs, dir)?.first() {
        return Err(invalid(format!("snapshot {name:?} is still materialising")));
    }
    Ok(())
}

/// Take snapshot `name` (record id `id`) of the served `volume` at `dir`:
/// the fence written and synced and the layer armed at the flush point.
/// Returns when that is done, the snapshot listed as materialising; the
/// caller runs `materialise` next (on another thread).
pub fn create_fenced(
    dir: &Path,
    volume: &crate::Volume,
    name: &str,
    id: &str,
) -> Result<SnapshotRecord> {
    let fs = RealFs::default();
    super::check_name(name)?;
    can_fence(dir, volume)?;
    prepare(&fs, dir, name)?;
    super::tidy(&fs, dir)?;
    let storage = volume.storage();
    let layer = layer_of(&*storage)?;
    let partial = partial_path(dir, name);
    volume.at_flush_point(&mut |superblock: &Superblock| {
        // The regions flag read here, not through `regions`, which imports
        // this module (refusals while a snapshot materialises).
        if superblock.features.incompat & FeatureFlags::INCOMPAT_REGIONS != 0 {
            return Err(invalid(format!(
                "{} is a volume with regions",
                dir.display()
            )));
        }
        let record = super::record_at(superblock, name, id, "reflink", true);
        let fence = fence_at(&fs, dir, &partial, superblock, &record)?;
        // ORDER POINT: the fence is durable before the layer is armed, and
        // the layer is armed before any home write after the flush point.
        let log = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(partial.join(BEFORE_FILE))
            .map_err(|e| io_error("open", &partial.join(BEFORE_FILE), e))?;
        layer
            .arm(Box::new(log), fence.fence)
            .map_err(|e| io_error("write", &partial.join(BEFORE_FILE), e))?;
        Ok(record)
    })
}

/// Write `.NAME.partial` (`partial`) at the flush point: the snapshot's
/// superblock and record, an empty log (its directory entry synced), then
/// the fence, synced with the directories.
fn fence_at(
    fs: &dyn SnapshotFs,
    dir: &Path,
    partial: &Path,
    superblock: &Superblock,
    record: &SnapshotRecord,
) -> Result<Fence> {
    fs.create_dir(partial)
        .map_err(|e| io_error("create", partial, e))?;
    let mut marked = *superblock;
    marked.features.ro_compat |= FeatureFlags::RO_COMPAT_SNAPSHOT;
    marked.state = STATE_CLEAN;
    write_superblock(fs, partial, &marked)?;
    let record_path = partial.join(RECORD_FILE);
    fs.write_at(
        &record_path,
        0,
        &serde_json::to_vec_pretty(record).expect("a record serializes"),
    )
    .map_err(|e| io_error("write", &record_path, e))?;
    let before = partial.join(BEFORE_FILE);
    fs.new_file(&before, 0, false)
        .map_err(|e| io_error("create", &before, e))?;
    let superblock_path = partial.join(ObjectId::Superblock.file_name());
    sync_all(fs, partial, &[superblock_path, record_path, before])?;
    // The journal is new, and the superblock is the one written above at
    // the flush point (never imaged: the live one moves on).
    let skipped = [
        ObjectId::Journal.file_name(),
        ObjectId::Superblock.file_name(),
    ];
    let mut files = Vec::new();
    for file in volume_files(superblock)? {
        if skipped.contains(&file) {
            continue;
        }
        let path = dir.join(&file);
        let len = std::fs::metadata(&path)
            .map_err(|e| io_error("stat", &path, e))?
            .len();
        files.push((file, len));
    }
    let fence = Fence {
        fence: rand::random::<u64>() | 1,
        files,
    };
    // Whole or absent: written and synced beside, then renamed in.
    let fence_path = partial.join(FENCE_FILE);
    let written = partial.join(format!("{FENCE_FILE}.new"));
    fs.write_at(
        &written,
        0,
        &serde_json::to_vec_pretty(&fence).expect("a fence serializes"),
    )
    .map_err(|e| io_error("write", &written, e))?;
    fs.sync_file(&written)
        .map_err(|e| io_error("sync", &written, e))?;
    fs.rename(&written, &fence_path)
        .map_err(|e| io_error("rename", &written, e))?;
    fs.sync_dir(partial)
        .map_err(|e| io_error("sync", partial, e))?;
    let snapshots = dir.join(SNAPSHOTS_DIR);
    fs.sync_dir(&snapshots)
        .map_err(|e| io_error("sync", &snapshots, e))?;
    Ok(fence)
}

fn read_fence(fs: &dyn SnapshotFs, partial: &Path) -> Result<Fence> {
    let path = partial.join(FENCE_FILE);
    let bytes = fs.read(&path).map_err(|e| io_error("read", &path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt(format!("{}: {e}", path.display())))
}

/// Finish snapshot `name` of the volume at `dir` (fenced, its layer armed
/// in `storage`): clone, write the first before-images back, sync,
/// publish, disarm. Holds nothing of the volume; callers run one at a time
/// per volume (the server's online lock, or the open).
pub fn materialise(dir: &Path, name: &str, storage: &dyn Storage) -> Result<Snapshot> {
    materialise_with(dir, name, storage, BeforeBreaks::default())
}

/// `materialise`, with the image order broken on purpose (tests).
pub fn materialise_with(
    dir: &Path,
    name: &str,
    storage: &dyn Storage,
    breaks: BeforeBreaks,
) -> Result<Snapshot> {
    let fs = RealFs::default();
    let layer = layer_of(storage)?;
    let partial = partial_path(dir, name);
    let fence = read_fence(&fs, &partial)?;
    let mut made = Vec::new();
    for (file, len) in &fence.files {
        let (from, to) = (dir.join(file), partial.join(file));
        make_writable(&to)?;
        if !fs
            .warm_file(&from, &to)
            .map_err(|e| io_error("clone", &from, e))?
        {
            return Err(invalid(format!(
                "{} cannot be cloned here (the filesystem shares no extents)",
                from.display()
            )));
        }
        fs.set_len(&to, *len)
            .map_err(|e| io_error("truncate", &to, e))?;
        made.push(to);
    }
    let superblock = super::superblock_of(&fs, &partial)?;
    let journal = partial.join(ObjectId::Journal.file_name());
    if !fs.exists(&journal) {
        fs.new_file(&journal, superblock.journal_bytes, false)
            .map_err(|e| io_error("create", &journal, e))?;
    }
    made.push(journal);
    // Read after every clone ended: each home write that reached a clone
    // was issued after its image was synced, so its image is in here.
    let log_path = partial.join(BEFORE_FILE);
    let log = fs
        .read(&log_path)
        .map_err(|e| io_error("read", &log_path, e))?;
    let lengths: std::collections::HashMap<&str, u64> = fence
        .files
        .iter()
        .map(|(file, len)| (file.as_str(), *len))
        .collect();
    for ((object, offset), image) in first_images(&log, fence.fence, breaks) {
        let file = object.file_name();
        let Some(&len) = lengths.get(file.as_str()) else {
            continue;
        };
        if offset >= len {
            continue;
        }
        let keep = (len - offset).min(IMAGE_BLOCK) as usize;
        let path = partial.join(&file);
        fs.write_at(&path, offset, &image[..keep])
            .map_err(|e| io_error("write", &path, e))?;
    }
    made.push(partial.join(ObjectId::Superblock.file_name()));
    made.push(partial.join(RECORD_FILE));
    for file in &made {
        fs.make_read_only(file)
            .map_err(|e| io_error("chmod", file, e))?;
    }
    sync_all(&fs, &partial, &made)?;
    // ORDER POINT: everything the name publishes is durable before it.
    let snapshots = dir.join(SNAPSHOTS_DIR);
    let target = snapshots.join(name);
    fs.rename(&partial, &target)
        .map_err(|e| io_error("rename", &partial, e))?;
    fs.sync_dir(&snapshots)
        .map_err(|e| io_error("sync", &snapshots, e))?;
    layer.disarm();
    let record = unfence(&fs, &target)?;
    Ok(Snapshot {
        path: target,
        record,
        materialising: false,
    })
}

/// A file `make_read_only` sealed by a materialisation a crash cut short
/// is written again.
fn make_writable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(io_error("chmod", path, error))
        }
        _ => Ok(()),
    }
}

/// A published snapshot's fence and log removed (its files are complete);
/// its record.
fn unfence(fs: &dyn SnapshotFs, target: &Path) -> Result<SnapshotRecord> {
    for file in [FENCE_FILE, BEFORE_FILE] {
        let path = target.join(file);
        if fs.exists(&path) {
            fs.remove_file(&path)
                .map_err(|e| io_error("remove", &path, e))?;
        }
    }
    fs.sync_dir(target)
        .map_err(|e| io_error("sync", target, e))?;
    let path = target.join(RECORD_FILE);
    let bytes = fs.read(&path).map_err(|e| io_error("read", &path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt(format!("{}: {e}", path.display())))
}

/// At a writable open of the volume at `dir`, before the engine opens (and
/// replays): published snapshots' leftover fences removed, and a fenced
/// `.NAME.partial` found: the layer over `storage` armed with its log.
/// Returns the name to `materialise` once the volume is open.
pub fn resume(
    dir: &Path,
    storage: &Arc<crate::storage::before::BeforeImages>,
) -> Result<Option<String>> {
    let fs = RealFs::default();
    let snapshots = dir.join(SNAPSHOTS_DIR);
    let Some(names) = fs
        .names(&snapshots)
        .map_err(|e| io_error("list", &snapshots, e))?
    else {
        return Ok(None);
    };
    let mut pending = None;
    for entry in names {
        let path = snapshots.join(&entry);
        if !entry.starts_with('.') {
            if is_fenced(&fs, &path) {
                unfence(&fs, &path)?;
            }
            continue;
        }
        let Some(name) = entry
            .strip_prefix('.')
            .and_then(|e| e.strip_suffix(PARTIAL))
        else {
            continue;
        };
        if !is_fenced(&fs, &path) || pending.is_some() {
            continue;
        }
        let fence = read_fence(&fs, &path)?;
        let log_path = path.join(BEFORE_FILE);
        let log = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&log_path)
            .map_err(|e| io_error("open", &log_path, e))?;
        storage
            .arm(Box::new(log), fence.fence)
            .map_err(|e| io_error("read", &log_path, e))?;
        pending = Some(name.to_string());
    }
    Ok(pending)
}

/// Where snapshot `name` of `dir` is while it is materialised.
pub fn materialising_path(dir: &Path, name: &str) -> PathBuf {
    partial_path(dir, name)
}
