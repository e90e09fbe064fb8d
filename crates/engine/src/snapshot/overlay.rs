//! Overlay snapshots: a snapshot where the filesystem cannot clone
//! (docs/FORMAT.md, "Overlay snapshots"; docs/CRASH_MODEL.md).
//!
//! A fence and the before-image log of `storage/before.rs`, kept for the
//! snapshot's life: `snapshots/NAME/` holds the superblock at the flush
//! point (SNAPSHOT and OVERLAY), a sparse journal, the record, `overlay`
//! (the fence: its id and the imaged files' lengths) and `before` (the
//! log). Nothing is copied, so a create costs O(metadata). Every writable
//! open of the volume arms the layer with `before` before it replays;
//! `storage/overlay.rs` reads the snapshot: each block's first image,
//! else the live file's bytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vouch_format::superblock::STATE_CLEAN;
use vouch_format::{FeatureFlags, Superblock};

use super::fenced::{imaged_files, materialising, partial_with, Fence, BEFORE_FILE};
use super::{
    io_error, partial_path, prepare, snapshot_path, sync_all, tidy, RealFs, Snapshot, SnapshotFs,
    SnapshotRecord, SNAPSHOTS_DIR,
};
use crate::error::{Error, Result};
use crate::storage::before::{BeforeImages, LogEnd};
use crate::storage::overlay::{OverlayStorage, ReadFiles};
use crate::storage::{objects_of, ObjectId};

/// An overlay snapshot's fence (JSON, `Fence`), in `snapshots/NAME/`.
pub const OVERLAY_FILE: &str = "overlay";
/// The index of the blocks its log imaged (`storage/imaged.rs`), beside
/// the log: written by the volume's writable opens and every
/// `before::INDEX_EVERY` bytes of images; never needed (the log is read
/// whole without it).
pub const INDEX_FILE: &str = "imaged";
/// The `method` its record carries.
pub const METHOD: &str = "overlay";
/// Written into an overlay found damaged (its cause): it is no longer
/// armed nor opened, only listed and deleted.
pub const FAILED_FILE: &str = "failed";

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// Whether snapshots of the volume at `dir` are overlays: its filesystem
/// cannot clone files (anything but xfs and btrfs).
pub fn wanted(dir: &Path) -> bool {
    !matches!(super::filesystem_name(dir), Some("xfs" | "btrfs"))
}

/// Whether `dir` (a snapshot's directory) is an overlay.
pub fn is_overlay(fs: &dyn SnapshotFs, dir: &Path) -> bool {
    fs.exists(&dir.join(OVERLAY_FILE))
}

/// Whether `superblock` is an overlay snapshot's.
pub fn is_overlay_superblock(superblock: &Superblock) -> bool {
    superblock.features.incompat & FeatureFlags::INCOMPAT_OVERLAY != 0
}

/// The published overlay snapshots of the volume at `volume`, by name.
pub fn overlays(fs: &dyn SnapshotFs, volume: &Path) -> Result<Vec<String>> {
    let dir = volume.join(SNAPSHOTS_DIR);
    let mut names = fs
        .names(&dir)
        .map_err(|e| io_error("list", &dir, e))?
        .unwrap_or_default();
    names.retain(|name| {
        let path = dir.join(name);
        !name.starts_with('.') && is_overlay(fs, &path) && !fs.exists(&path.join(FAILED_FILE))
    });
    Ok(names)
}

/// Refuse `what` (a resize, a migration, a fenced snapshot: they change
/// the volume's files outside the layer, or arm it with another log)
/// while the volume at `volume` has an overlay snapshot.
pub fn refuse_beside(fs: &dyn SnapshotFs, volume: &Path, what: &str) -> Result<()> {
    match overlays(fs, volume)?.first() {
        None => Ok(()),
        Some(name) => Err(invalid(format!(
            "{} has the overlay snapshot {name:?} (its blocks are the volume's files, read through its log): {what} once it is deleted (`vouch snapshot delete {} {name}`)",
            volume.display(),
            volume.display()
        ))),
    }
}

/// What an overlay needs of the volume at `volume`: no other overlay and
/// no snapshot materialising (one log per layer), not a mirror's leg.
fn check_alone(fs: &dyn SnapshotFs, volume: &Path) -> Result<()> {
    if let Some(name) = overlays(fs, volume)?.first() {
        return Err(invalid(format!(
            "{} has the overlay snapshot {name:?} already: one overlay snapshot per volume on a filesystem that cannot clone (delete it first, or --copy for a full copy)",
            volume.display()
        )));
    }
    if let Some(name) = materialising(fs, volume)?.first() {
        return Err(invalid(format!("snapshot {name:?} is still materialising")));
    }
    if fs.exists(&volume.join(vouch_format::mirror::MIRROR_RECORD_FILE)) {
        return Err(invalid(format!(
            "{} is a leg of a mirror: overlay snapshots of mirrors are not supported (--copy makes full copies)",
            volume.display()
        )));
    }
    Ok(())
}

fn refuse_regions(volume: &Path, superblock: &Superblock) -> Result<()> {
    if superblock.features.incompat & FeatureFlags::INCOMPAT_REGIONS != 0 {
        return Err(invalid(format!(
            "{} is a volume with regions: overlay snapshots of it are not supported (--copy makes a full copy)",
            volume.display()
        )));
    }
    Ok(())
}

/// Arm `layer` with the log at `log_path` (fence `fence`), its index of
/// imaged blocks kept at `index` (where `fs` keeps one).
fn arm_with(
    fs: &dyn SnapshotFs,
    layer: &BeforeImages,
    log_path: &Path,
    fence: u64,
    index: &Path,
) -> Result<()> {
    let log = fs
        .open_log(log_path)
        .map_err(|e| io_error("open", log_path, e))?;
    match layer
        .arm_indexed(log, fence, fs.index_store(index))
        .map_err(|e| io_error("read", log_path, e))?
    {
        LogEnd::Whole | LogEnd::Torn { .. } => Ok(()),
        LogEnd::Corrupt { at, later } => Err(Error::Corrupt(format!(
            "{}: a record at byte {at} does not read whole and a valid one follows at byte {later}: the layer is not armed",
            log_path.display()
        ))),
    }
}

/// Make `.NAME.partial/` at the flush point whose superblock is
/// `superblock`: the marked superblock, the record, a sparse journal, an
/// empty log and the fence (`overlay`), every file and the directory
/// synced. Returns the fence.
fn write_partial(
    fs: &dyn SnapshotFs,
    volume: &Path,
    partial: &Path,
    superblock: &Superblock,
    record: &SnapshotRecord,
) -> Result<Fence> {
    let mut marked = *superblock;
    marked.features.ro_compat |= FeatureFlags::RO_COMPAT_SNAPSHOT;
    marked.features.incompat |= FeatureFlags::INCOMPAT_OVERLAY;
    // The live volume's flag is not the snapshot's.
    marked.features.incompat &= !FeatureFlags::INCOMPAT_OVERLAID;
    marked.state = STATE_CLEAN;
    let (superblock_path, record_path, before) = partial_with(fs, partial, &marked, record)?;
    let journal = partial.join(ObjectId::Journal.file_name());
    fs.new_file(&journal, superblock.journal_bytes, false)
        .map_err(|e| io_error("create", &journal, e))?;
    let fence = Fence {
        fence: rand::random::<u64>() | 1,
        files: imaged_files(fs, volume, superblock)?,
    };
    let fence_path = partial.join(OVERLAY_FILE);
    fs.write_at(
        &fence_path,
        0,
        &serde_json::to_vec_pretty(&fence).expect("a fence serializes"),
    )
    .map_err(|e| io_error("write", &fence_path, e))?;
    let sealed = [superblock_path, record_path, journal, fence_path.clone()];
    for file in &sealed {
        fs.make_read_only(file)
            .map_err(|e| io_error("chmod", file, e))?;
    }
    let mut synced = sealed.to_vec();
    synced.push(before);
    sync_all(fs, partial, &synced)?;
    Ok(fence)
}

/// `.NAME.partial` published as `NAME`, `snapshots/` synced.
fn publish(fs: &dyn SnapshotFs, volume: &Path, name: &str) -> Result<PathBuf> {
    let (partial, target) = (partial_path(volume, name), snapshot_path(volume, name));
    fs.rename(&partial, &target)
        .map_err(|e| io_error("rename", &partial, e))?;
    let snapshots = volume.join(SNAPSHOTS_DIR);
    fs.sync_dir(&snapshots)
        .map_err(|e| io_error("sync", &snapshots, e))?;
    Ok(target)
}

/// Take overlay snapshot `name` (record id `id`) of the stopped volume
/// at `volume`, closed cleanly and held by the caller: the next writable
/// open arms the layer with its log.
pub fn create_offline(
    fs: &dyn SnapshotFs,
    volume: &Path,
    name: &str,
    id: &str,
) -> Result<Snapshot> {
    super::check_name(name)?;
    check_alone(fs, volume)?;
    prepare(fs, volume, name)?;
    tidy(fs, volume)?;
    let superblock = super::superblock_of(fs, volume)?;
    if superblock.state != STATE_CLEAN {
        return Err(invalid(format!(
            "{} was not closed cleanly: open it (vouch check, or serve) so it recovers, then take the snapshot",
            volume.display()
        )));
    }
    refuse_regions(volume, &superblock)?;
    if fs.exists(&volume.join(crate::storage::RESIZE_MAP_FILE)) {
        return Err(invalid(format!(
            "{} has a resize cut short: open it (vouch check, or serve) so it finishes, then take the snapshot",
            volume.display()
        )));
    }
    let record = super::record_at(&superblock, name, id, METHOD, false);
    let partial = partial_path(volume, name);
    write_partial(fs, volume, &partial, &superblock, &record)?;
    // ORDER POINT: the live volume's OVERLAID is durable before the name.
    set_overlaid_offline(fs, volume, true)?;
    let path = publish(fs, volume, name)?;
    Ok(Snapshot {
        path,
        record,
        materialising: false,
        failed: None,
    })
}

/// Set or clear OVERLAID in the superblock of the stopped volume at
/// `volume` (held by the caller): each copy rewritten in turn with a new
/// generation, then synced.
fn set_overlaid_offline(fs: &dyn SnapshotFs, volume: &Path, overlaid: bool) -> Result<()> {
    let mut superblock = super::superblock_of(fs, volume)?;
    if overlaid {
        superblock.features.incompat |= FeatureFlags::INCOMPAT_OVERLAID;
    } else {
        superblock.features.incompat &= !FeatureFlags::INCOMPAT_OVERLAID;
    }
    let path = volume.join(ObjectId::Superblock.file_name());
    let slot_bytes = vouch_format::superblock::SUPERBLOCK_SLOT_BYTES;
    for copy in 0..2 {
        superblock.generation += 1;
        let mut slot = vec![0u8; slot_bytes as usize];
        slot[..vouch_format::SUPERBLOCK_BYTES].copy_from_slice(&superblock.encode());
        fs.write_at(&path, copy * slot_bytes, &slot)
            .map_err(|e| io_error("write", &path, e))?;
        fs.sync_file(&path)
            .map_err(|e| io_error("sync", &path, e))?;
    }
    Ok(())
}

/// Delete snapshot `name` of the stopped volume at `volume` (held by the
/// caller): an overlay's OVERLAID cleared once its delete is durable.
pub fn delete_offline(fs: &dyn SnapshotFs, volume: &Path, name: &str) -> Result<()> {
    let overlay = is_overlay(fs, &snapshot_path(volume, name));
    super::delete(fs, volume, name)?;
    if overlay && overlays(fs, volume)?.is_empty() {
        set_overlaid_offline(fs, volume, false)?;
    }
    Ok(())
}

/// Take overlay snapshot `name` (record id `id`) of the served `volume`
/// at `dir` at its flush point: the partial written and synced, the layer
/// armed with its log, and the name published, all before any home write
/// after the flush point. Callers serialize creates and deletes (the
/// server's online lock).
pub fn create_online(dir: &Path, volume: &crate::Volume, name: &str, id: &str) -> Result<Snapshot> {
    create_online_in(&RealFs::default(), dir, volume, name, id)
}

/// `create_online` on `fs` (the crash simulator's model filesystem, or
/// the real one).
pub fn create_online_in(
    fs: &dyn SnapshotFs,
    dir: &Path,
    volume: &crate::Volume,
    name: &str,
    id: &str,
) -> Result<Snapshot> {
    super::check_name(name)?;
    check_alone(fs, dir)?;
    let storage = volume.storage();
    let layer = storage.before_images().ok_or_else(|| {
        invalid("this volume was opened without the before-image layer".to_string())
    })?;
    if layer.is_armed() {
        return Err(invalid(
            "the volume's before-image layer is in use (a snapshot is materialising)".to_string(),
        ));
    }
    prepare(fs, dir, name)?;
    tidy(fs, dir)?;
    let partial = partial_path(dir, name);
    // ORDER POINT: OVERLAID durable before the name is published (set
    // here: the flush point holds the commit lock a superblock write takes).
    volume.set_overlaid(true)?;
    let taken = volume.at_flush_point(&mut |superblock: &Superblock| {
        refuse_regions(dir, superblock)?;
        let record = super::record_at(superblock, name, id, METHOD, true);
        let fence = write_partial(fs, dir, &partial, superblock, &record)?;
        // ORDER POINT: armed before the name is published, both before
        // any home write after the flush point.
        // The index is saved once enough images are durable, by then
        // under the published name.
        let index = snapshot_path(dir, name).join(INDEX_FILE);
        arm_with(fs, layer, &partial.join(BEFORE_FILE), fence.fence, &index)?;
        match publish(fs, dir, name) {
            Ok(path) => Ok(Snapshot {
                path,
                record,
                materialising: false,
                failed: None,
            }),
            Err(error) => {
                layer.disarm();
                let _ = fs.remove_all(&partial);
                Err(error)
            }
        }
    });
    if taken.is_err() && overlays(fs, dir).is_ok_and(|names| names.is_empty()) {
        return taken
            .map_err(|error| super::flag_left(dir, error, "OVERLAID", volume.set_overlaid(false)));
    }
    taken
}

/// At a writable open of the volume at `dir`, before the engine opens
/// (and replays): the layer over `storage` armed with the log of the
/// volume's overlay snapshot, if it has one. Its name.
pub fn arm_at_open(dir: &Path, storage: &Arc<BeforeImages>) -> Result<Option<String>> {
    arm_at_open_in(&RealFs::default(), dir, storage)
}

/// `arm_at_open` on `fs` (the crash simulator's model filesystem, or the
/// real one).
pub fn arm_at_open_in(
    fs: &dyn SnapshotFs,
    dir: &Path,
    storage: &Arc<BeforeImages>,
) -> Result<Option<String>> {
    let names = overlays(fs, dir)?;
    let Some(name) = names.first() else {
        return Ok(None);
    };
    if names.len() > 1 || storage.is_armed() {
        return Err(Error::Corrupt(format!(
            "{} has more than one snapshot using its before-image layer ({}): delete all but one",
            dir.display(),
            names.join(", ")
        )));
    }
    let snapshot = snapshot_path(dir, name);
    let fence = read_fence(fs, &snapshot)?;
    let log_path = snapshot.join(BEFORE_FILE);
    let log = fs
        .open_log(&log_path)
        .map_err(|e| io_error("open", &log_path, e))?;
    // The index of the blocks imaged: the log is read only past what it
    // covers (or whole, when it is missing or does not match the log).
    let end = storage
        .arm_indexed(log, fence.fence, fs.index_store(&snapshot.join(INDEX_FILE)))
        .map_err(|e| io_error("read", &log_path, e))?;
    if let LogEnd::Corrupt { at, .. } = end {
        // A synced image lost: the snapshot is failed (never read as the
        // live bytes), the volume opens without it.
        let cause = format!(
            "its before-image log {} is damaged at byte {at} (a record that does not read whole, with valid records after it): some blocks' bytes at the fence are lost; delete it",
            log_path.display()
        );
        let failed = snapshot.join(FAILED_FILE);
        fs.write_at(&failed, 0, cause.as_bytes())
            .map_err(|e| io_error("write", &failed, e))?;
        sync_all(fs, &snapshot, &[failed])?;
        tracing::error!(volume = %dir.display(), "overlay snapshot {name} failed: {cause}");
        return Ok(None);
    }
    Ok(Some(name.clone()))
}

/// At a writable open of the volume at `dir` that armed no overlay: its
/// OVERLAID cleared when no overlay snapshot of it is published (a create
/// a crash cut after the flag was made durable and before the name was),
/// so binaries that know no overlays open it again.
pub fn clear_stale_overlaid(fs: &dyn SnapshotFs, dir: &Path, volume: &crate::Volume) -> Result<()> {
    if !volume.overlaid() || !overlays(fs, dir)?.is_empty() {
        return Ok(());
    }
    volume.set_overlaid(false)?;
    tracing::warn!(volume = %dir.display(), "cleared OVERLAID: no overlay snapshot was published (a create cut short)");
    Ok(())
}

fn read_fence(fs: &dyn SnapshotFs, snapshot: &Path) -> Result<Fence> {
    let path = snapshot.join(OVERLAY_FILE);
    let bytes = fs.read(&path).map_err(|e| io_error("read", &path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt(format!("{}: {e}", path.display())))
}

/// The bytes of overlay snapshot `snapshot`'s log (its space).
pub fn space(snapshot: &Path) -> Option<u64> {
    std::fs::metadata(snapshot.join(BEFORE_FILE))
        .ok()
        .map(|metadata| metadata.len())
}

/// The storage of the overlay snapshot at `snapshot` (superblock
/// `superblock`), read-only: its own superblock (under the shared lock,
/// so it is not deleted while open) and journal, the volume's live files
/// two directories up, its log.
pub fn open_storage(snapshot: &Path, superblock: &Superblock) -> Result<OverlayStorage> {
    let fs = RealFs::default();
    let snapshot = &snapshot
        .canonicalize()
        .map_err(|e| io_error("open", snapshot, e))?;
    let volume = snapshot
        .parent()
        .filter(|parent| parent.file_name().is_some_and(|n| n == SNAPSHOTS_DIR))
        .and_then(Path::parent)
        .ok_or_else(|| {
            Error::Corrupt(format!(
                "{} is an overlay snapshot outside its volume's snapshots/ directory: its blocks are the volume's files",
                snapshot.display()
            ))
        })?;
    let live_superblock = crate::volume_superblock(volume)?;
    if live_superblock.uuid != superblock.uuid {
        return Err(Error::Corrupt(format!(
            "{} is an overlay snapshot of another volume than {} (uuids differ)",
            snapshot.display(),
            volume.display()
        )));
    }
    if let Ok(cause) = std::fs::read_to_string(snapshot.join(FAILED_FILE)) {
        return Err(Error::Corrupt(format!(
            "overlay snapshot {} failed: {cause}",
            snapshot.display()
        )));
    }
    let fence = read_fence(&fs, snapshot)?;
    let open = |path: &Path| {
        std::fs::File::open(path).map_err(|e| {
            Error::Corrupt(format!(
                "{}: {e} (an overlay snapshot reads it: its blocks cannot be read without it)",
                path.display()
            ))
        })
    };
    let mut own = HashMap::new();
    let superblock_file = crate::FileStorage::lock_for_reading(snapshot)
        .map_err(|e| io_error("open", snapshot, e))?;
    own.insert(ObjectId::Superblock, superblock_file);
    own.insert(
        ObjectId::Journal,
        open(&snapshot.join(ObjectId::Journal.file_name()))?,
    );
    let geometry = superblock
        .geometry()
        .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")))?;
    let by_name: HashMap<String, ObjectId> = objects_of(&geometry)
        .into_iter()
        .map(|object| (object.file_name(), object))
        .collect();
    let mut live = HashMap::new();
    let mut lengths = HashMap::new();
    for (file, len) in &fence.files {
        let object = *by_name.get(file).ok_or_else(|| {
            Error::Corrupt(format!(
                "{}: {file} is no file of the volume",
                snapshot.join(OVERLAY_FILE).display()
            ))
        })?;
        lengths.insert(object, *len);
        let path = volume.join(file);
        if *len == 0 && !path.exists() {
            continue;
        }
        live.insert(object, open(&path)?);
    }
    let log = open(&snapshot.join(BEFORE_FILE))?;
    Ok(OverlayStorage::new(
        Arc::new(ReadFiles::new(own)),
        Arc::new(ReadFiles::new(live)),
        Box::new(log),
        fence.fence,
        lengths,
    ))
}

/// The storage of the overlay snapshot at `snapshot` on `fs` (the crash
/// simulator's model filesystem): `own` its superblock and journal, `live`
/// the volume's files, the log opened on `fs`; what `open_storage` makes
/// of real files. Refused when the overlay failed.
pub fn overlay_in(
    fs: &dyn SnapshotFs,
    snapshot: &Path,
    geometry: &vouch_format::Geometry,
    own: Arc<dyn crate::storage::Storage>,
    live: Arc<dyn crate::storage::Storage>,
) -> Result<OverlayStorage> {
    let failed = snapshot.join(FAILED_FILE);
    if fs.exists(&failed) {
        let cause = fs.read(&failed).unwrap_or_default();
        return Err(Error::Corrupt(format!(
            "overlay snapshot {} failed: {}",
            snapshot.display(),
            String::from_utf8_lossy(&cause)
        )));
    }
    let fence = read_fence(fs, snapshot)?;
    let by_name: HashMap<String, ObjectId> = objects_of(geometry)
        .into_iter()
        .map(|object| (object.file_name(), object))
        .collect();
    let mut lengths = HashMap::new();
    for (file, len) in &fence.files {
        let object = *by_name.get(file).ok_or_else(|| {
            Error::Corrupt(format!(
                "{}: {file} is no file of the volume",
                snapshot.join(OVERLAY_FILE).display()
            ))
        })?;
        lengths.insert(object, *len);
    }
    let log_path = snapshot.join(BEFORE_FILE);
    let log = fs
        .open_log(&log_path)
        .map_err(|e| io_error("open", &log_path, e))?;
    Ok(OverlayStorage::new(own, live, log, fence.fence, lengths))
}

/// Snapshot `name` of the served `volume` at `dir` deleted (the caller
/// holds the server's snapshot lock and the snapshot's own), and the
/// layer disarmed when it was the overlay: the name goes first (renamed
/// away, synced), so a crash between leaves no overlay to arm.
pub fn delete_served(dir: &Path, volume: Option<&crate::Volume>, name: &str) -> Result<()> {
    delete_served_in(&RealFs::default(), dir, volume, name)
}

/// `delete_served` on `fs` (the crash simulator's model filesystem, or
/// the real one).
pub fn delete_served_in(
    fs: &dyn SnapshotFs,
    dir: &Path,
    volume: Option<&crate::Volume>,
    name: &str,
) -> Result<()> {
    let overlay = is_overlay(fs, &snapshot_path(dir, name));
    super::delete(fs, dir, name)?;
    if overlay {
        if let Some(layer) = volume.map(crate::Volume::storage) {
            if let Some(layer) = layer.before_images() {
                layer.disarm();
            }
        }
        if let Some(volume) = volume.filter(|_| overlays(fs, dir).is_ok_and(|n| n.is_empty())) {
            volume.set_overlaid(false)?;
        }
    }
    Ok(())
}
