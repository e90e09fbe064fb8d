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
use crate::storage::before::{scan_log, BeforeBreaks, LogEnd, IMAGE_BLOCK, SCAN_PIECE};
use crate::storage::{ObjectId, Storage};

/// The fence of a snapshot being materialised, in `.NAME.partial/`.
pub const FENCE_FILE: &str = "fence";
/// Its before-image log, beside the fence.
pub const BEFORE_FILE: &str = "before";
/// Why a fenced snapshot failed (text), in its `.NAME.partial/`, which
/// then has no fence: never materialised again nor published; listed as
/// failed until `vouch snapshot delete` removes it.
pub const FAILED_FILE: &str = "failed";

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

/// Why the fenced snapshot at `dir` (a `.NAME.partial`) failed, if it did.
pub fn failed_cause(fs: &dyn SnapshotFs, dir: &Path) -> Option<String> {
    let path = dir.join(FAILED_FILE);
    if !fs.exists(&path) {
        return None;
    }
    Some(match fs.read(&path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(error) => format!("(its cause cannot be read: {error})"),
    })
}

/// Mark the fenced `.NAME.partial` at `partial` failed for `cause`:
/// `failed` written (whole or absent: written beside, synced, renamed)
/// and synced with the directory, then the fence removed. ORDER POINT:
/// `failed` is durable before the fence goes and before the caller
/// disarms the layer, so no later open materialises it (home writes
/// without images follow). The log stays until the snapshot is deleted.
fn mark_failed(fs: &dyn SnapshotFs, partial: &Path, cause: &str) -> Result<()> {
    write_whole(fs, partial, FAILED_FILE, cause.as_bytes())?;
    let fence = partial.join(FENCE_FILE);
    if fs.exists(&fence) {
        fs.remove_file(&fence)
            .map_err(|e| io_error("remove", &fence, e))?;
        fs.sync_dir(partial)
            .map_err(|e| io_error("sync", partial, e))?;
    }
    Ok(())
}

/// Why a log damaged after it was synced fails its snapshot.
fn damaged(log: &Path, at: u64, later: u64) -> String {
    format!(
        "its before-image log {} is damaged at byte {at}, after it was synced (a later append's record is at byte {later}): the bytes at the fence of the blocks written since are lost, so the snapshot would read newer data",
        log.display()
    )
}

/// `file` of `partial` written whole or not at all: as `file.new` (a
/// stale one removed first), synced, renamed in, the directory synced.
fn write_whole(fs: &dyn SnapshotFs, partial: &Path, file: &str, bytes: &[u8]) -> Result<()> {
    let path = partial.join(file);
    let written = partial.join(format!("{file}.new"));
    if fs.exists(&written) {
        fs.remove_file(&written)
            .map_err(|e| io_error("remove", &written, e))?;
    }
    fs.write_at(&written, 0, bytes)
        .map_err(|e| io_error("write", &written, e))?;
    fs.sync_file(&written)
        .map_err(|e| io_error("sync", &written, e))?;
    fs.rename(&written, &path)
        .map_err(|e| io_error("rename", &written, e))?;
    fs.sync_dir(partial)
        .map_err(|e| io_error("sync", partial, e))
}

/// What a failed snapshot's `failed` says: the cause and what to do.
fn failure(name: &str, dir: &Path, cause: &str) -> String {
    format!(
        "snapshot {name:?} of {} failed while it was materialised and was never published: {cause}. The volume is unaffected; `vouch snapshot delete {} {name}` removes what is left of it (its before-image log is kept until then), and a new snapshot can be taken",
        dir.display(),
        dir.display()
    )
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
            "snapshot {name:?} of {} is still being materialised: {what} once it is done (`vouch snapshot list` shows it; a writable open such as `vouch serve` finishes one a crash cut short)",
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
    super::check_name(name)?;
    can_fence(dir, volume)?;
    fence_in(&RealFs::default(), dir, volume, name, id)
}

/// `create_fenced` on `fs` (the crash simulator's model filesystem, or the
/// real one), once `can_fence` said yes.
pub fn fence_in(
    fs: &dyn SnapshotFs,
    dir: &Path,
    volume: &crate::Volume,
    name: &str,
    id: &str,
) -> Result<SnapshotRecord> {
    super::check_name(name)?;
    prepare(fs, dir, name)?;
    super::tidy(fs, dir)?;
    let storage = volume.storage();
    let layer = layer_of(&*storage)?;
    let partial = partial_path(dir, name);
    // ORDER POINT: the FENCED flag is durable before the fence, so a
    // binary that knows no fences (and would write home without images)
    // refuses the volume while one exists. A flag without a fence is
    // cleared by the next open.
    volume.set_fenced(true)?;
    let fenced = volume.at_flush_point(&mut |superblock: &Superblock| {
        // The regions flag read here, not through `regions`, which imports
        // this module (refusals while a snapshot materialises).
        if superblock.features.incompat & FeatureFlags::INCOMPAT_REGIONS != 0 {
            return Err(invalid(format!(
                "{} is a volume with regions",
                dir.display()
            )));
        }
        let record = super::record_at(superblock, name, id, "reflink", true);
        let fence = fence_at(fs, dir, &partial, superblock, &record)?;
        // ORDER POINT: the fence is durable before the layer is armed, and
        // the layer is armed before any home write after the flush point.
        let log = fs
            .open_log(&partial.join(BEFORE_FILE))
            .map_err(|e| io_error("open", &partial.join(BEFORE_FILE), e))?;
        let end = layer
            .arm(log, fence.fence)
            .map_err(|e| io_error("write", &partial.join(BEFORE_FILE), e))?;
        debug_assert_eq!(end, LogEnd::Whole, "a new log is empty");
        Ok(record)
    });
    if fenced.is_err() && !layer.is_armed() && !is_fenced(fs, &partial) {
        // No fence armed: the flag is not needed (a fence written but not
        // armed is armed by the next open, which sets nothing).
        return fenced
            .map_err(|error| super::flag_left(dir, error, "FENCED", volume.set_fenced(false)));
    }
    fenced
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
    let mut marked = *superblock;
    marked.features.ro_compat |= FeatureFlags::RO_COMPAT_SNAPSHOT;
    // The live volume's flag (set before the fence), never the snapshot's.
    marked.features.incompat &= !FeatureFlags::INCOMPAT_FENCED;
    marked.state = STATE_CLEAN;
    let (superblock_path, record_path, before) = partial_with(fs, partial, &marked, record)?;
    sync_all(fs, partial, &[superblock_path, record_path, before])?;
    let files = imaged_files(fs, dir, superblock)?;
    let fence = Fence {
        fence: rand::random::<u64>() | 1,
        files,
    };
    write_whole(
        fs,
        partial,
        FENCE_FILE,
        &serde_json::to_vec_pretty(&fence).expect("a fence serializes"),
    )?;
    let snapshots = dir.join(SNAPSHOTS_DIR);
    fs.sync_dir(&snapshots)
        .map_err(|e| io_error("sync", &snapshots, e))?;
    Ok(fence)
}

/// `.NAME.partial` (`partial`) made with `marked` as its superblock,
/// `record` and an empty before-image log: their paths (nothing synced).
/// A fenced snapshot's `fence_at` and an overlay's create both start so.
pub(super) fn partial_with(
    fs: &dyn SnapshotFs,
    partial: &Path,
    marked: &Superblock,
    record: &SnapshotRecord,
) -> Result<(PathBuf, PathBuf, PathBuf)> {
    fs.create_dir(partial)
        .map_err(|e| io_error("create", partial, e))?;
    write_superblock(fs, partial, marked)?;
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
    Ok((superblock_path, record_path, before))
}

/// The imaged files of the volume at `dir` with their lengths now (the
/// journal is new in a snapshot, and its superblock is the one written at
/// the flush point: neither is imaged, the live ones move on).
pub(super) fn imaged_files(
    fs: &dyn SnapshotFs,
    dir: &Path,
    superblock: &Superblock,
) -> Result<Vec<(String, u64)>> {
    let own = [
        ObjectId::Journal.file_name(),
        ObjectId::Superblock.file_name(),
    ];
    let mut files = Vec::new();
    for file in volume_files(superblock)?
        .into_iter()
        .filter(|f| !own.contains(f))
    {
        let path = dir.join(&file);
        let len = fs.file_len(&path).map_err(|e| io_error("stat", &path, e))?;
        files.push((file, len));
    }
    Ok(files)
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
///
/// A materialisation that fails before its publishing rename (a clone or
/// write refused, the log damaged after it was synced) marks the snapshot
/// failed (`mark_failed`) and only then disarms the layer: the volume runs
/// on without images, the snapshot is never published, and the error says
/// what to do. Should even the mark fail, the layer stays armed and the
/// next open tries again.
pub fn materialise_with(
    dir: &Path,
    name: &str,
    storage: &dyn Storage,
    breaks: BeforeBreaks,
) -> Result<Snapshot> {
    materialise_in(&RealFs::default(), dir, name, storage, breaks)
}

/// `materialise_with` on `fs` (the crash simulator's model filesystem, or
/// the real one).
pub fn materialise_in(
    fs: &dyn SnapshotFs,
    dir: &Path,
    name: &str,
    storage: &dyn Storage,
    breaks: BeforeBreaks,
) -> Result<Snapshot> {
    let layer = layer_of(storage)?;
    let partial = partial_path(dir, name);
    if let Err(error) = build(fs, dir, &partial, breaks) {
        let cause = failure(name, dir, &error.to_string());
        mark_failed(fs, &partial, &cause)?;
        layer.disarm();
        return Err(Error::Corrupt(cause));
    }
    // ORDER POINT: everything the name publishes is durable before it.
    let snapshots = dir.join(SNAPSHOTS_DIR);
    let target = snapshots.join(name);
    if let Err(error) = fs.rename(&partial, &target) {
        let cause = failure(name, dir, &io_error("rename", &partial, error).to_string());
        mark_failed(fs, &partial, &cause)?;
        layer.disarm();
        return Err(Error::Corrupt(cause));
    }
    // Not durable yet, the rename may be undone by a crash (the open then
    // materialises the fenced `.NAME.partial` again): the layer stays
    // armed until it is.
    fs.sync_dir(&snapshots)
        .map_err(|e| io_error("sync", &snapshots, e))?;
    layer.disarm();
    tracing::info!(
        "snapshot {name}: materialised; while armed the before-image layer did: {}",
        layer.take_stats()
    );
    let record = unfence(fs, &target)?;
    Ok(Snapshot {
        path: target,
        record,
        materialising: false,
        failed: None,
    })
}

/// The files of `.NAME.partial` (`partial`) of the volume at `dir` made
/// and synced: each cloned and cut to its fenced length, each imaged
/// block's first before-image written back (the log read in pieces), a
/// new journal; all read-only.
fn build(fs: &dyn SnapshotFs, dir: &Path, partial: &Path, breaks: BeforeBreaks) -> Result<()> {
    let fence = read_fence(fs, partial)?;
    let mut made = Vec::new();
    for (file, len) in &fence.files {
        let (from, to) = (dir.join(file), partial.join(file));
        fs.make_writable(&to)
            .map_err(|e| io_error("chmod", &to, e))?;
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
    let superblock = super::superblock_of(fs, partial)?;
    let journal = partial.join(ObjectId::Journal.file_name());
    // Made its full length even where an attempt a crash cut short made
    // it already: a power cut may keep its directory entry and lose its
    // length (the crash simulator found a 0-byte journal published). It is
    // never written, so all zeros: an empty journal.
    fs.make_writable(&journal)
        .map_err(|e| io_error("chmod", &journal, e))?;
    fs.set_len(&journal, superblock.journal_bytes)
        .map_err(|e| io_error("create", &journal, e))?;
    made.push(journal);
    // Read after every clone ended: each home write that reached a clone
    // was issued after its image was synced, so its image is in here.
    let log_path = partial.join(BEFORE_FILE);
    let log = fs
        .open_log(&log_path)
        .map_err(|e| io_error("open", &log_path, e))?;
    let mut records = Vec::new();
    let scanned = scan_log(&*log, fence.fence, SCAN_PIECE, &mut |record| {
        records.push(*record)
    })
    .map_err(|e| io_error("read", &log_path, e))?;
    if let LogEnd::Corrupt { at, later } = scanned.end {
        return Err(Error::Corrupt(damaged(&log_path, at, later)));
    }
    let lengths: std::collections::HashMap<&str, u64> = fence
        .files
        .iter()
        .map(|(file, len)| (file.as_str(), *len))
        .collect();
    // Each block's first image (the last instead, broken on purpose),
    // read from the log a block at a time.
    let mut restored = std::collections::HashSet::new();
    let mut image = vec![0u8; IMAGE_BLOCK as usize];
    let order: Box<dyn Iterator<Item = &crate::storage::before::Record>> = if breaks.last_image_wins
    {
        Box::new(records.iter().rev())
    } else {
        Box::new(records.iter())
    };
    for record in order {
        let file = record.object.file_name();
        let Some(&len) = lengths.get(file.as_str()) else {
            continue;
        };
        let path = partial.join(&file);
        for block in 0..record.len / IMAGE_BLOCK {
            let offset = record.offset + block * IMAGE_BLOCK;
            if offset >= len || !restored.insert((record.object, offset)) {
                continue;
            }
            log.read_at(record.payload_at + block * IMAGE_BLOCK, &mut image)
                .map_err(|e| io_error("read", &log_path, e))?;
            let keep = (len - offset).min(IMAGE_BLOCK) as usize;
            fs.write_at(&path, offset, &image[..keep])
                .map_err(|e| io_error("write", &path, e))?;
        }
    }
    made.push(partial.join(ObjectId::Superblock.file_name()));
    made.push(partial.join(RECORD_FILE));
    for file in &made {
        fs.make_read_only(file)
            .map_err(|e| io_error("chmod", file, e))?;
    }
    sync_all(fs, partial, &made)
}

/// A published snapshot's fence and log removed (its files are complete);
/// its record.
fn unfence(fs: &dyn SnapshotFs, target: &Path) -> Result<SnapshotRecord> {
    // The log before the fence: a crash between leaves the fence, and the
    // next open (`resume`) removes both; the other way round it left the
    // log in the snapshot for good (the crash simulator found it).
    for file in [BEFORE_FILE, FENCE_FILE] {
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
    resume_in(&RealFs::default(), dir, storage)
}

/// `resume` on `fs` (the crash simulator's model filesystem, or the real
/// one).
pub fn resume_in(
    fs: &dyn SnapshotFs,
    dir: &Path,
    storage: &Arc<crate::storage::before::BeforeImages>,
) -> Result<Option<String>> {
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
            if is_fenced(fs, &path) {
                unfence(fs, &path)?;
            }
            continue;
        }
        let Some(name) = entry
            .strip_prefix('.')
            .and_then(|e| e.strip_suffix(PARTIAL))
        else {
            continue;
        };
        if let Some(cause) = failed_cause(fs, &path) {
            if is_fenced(fs, &path) {
                // A crash cut the mark before the fence went.
                mark_failed(fs, &path, &cause)?;
            }
            continue;
        }
        if !is_fenced(fs, &path) || pending.is_some() {
            continue;
        }
        let fence = read_fence(fs, &path)?;
        let log_path = path.join(BEFORE_FILE);
        let log = fs
            .open_log(&log_path)
            .map_err(|e| io_error("open", &log_path, e))?;
        let end = storage
            .arm(log, fence.fence)
            .map_err(|e| io_error("read", &log_path, e))?;
        if let LogEnd::Corrupt { at, later } = end {
            // Not armed: the snapshot cannot be right; the volume opens.
            let cause = failure(name, dir, &damaged(&log_path, at, later));
            mark_failed(fs, &path, &cause)?;
            tracing::error!(volume = %dir.display(), "{cause}");
            continue;
        }
        pending = Some(name.to_string());
    }
    Ok(pending)
}

/// Where snapshot `name` of `dir` is while it is materialised.
pub fn materialising_path(dir: &Path, name: &str) -> PathBuf {
    partial_path(dir, name)
}
