//! The vouch engine: a volume of 4 KiB blocks, each stored with protection
//! information and verified on every read. See docs/ARCHITECTURE.md.
//!
//! Modules, from the bottom up; each imports only those before it or of
//! its own group (two pairs import each other: `backing` and `written`,
//! `volume` and `copy`; docs/ARCHITECTURE.md, "Modules import downward"):
//! - leaves: `error`, `storage/` (the `Storage` trait and its backends:
//!   files, O_DIRECT + io_uring, simulated), `buffer`, `stats`,
//!   `contexts`, `protection` (sealing and opening blocks), `keys`,
//!   `schedule` (who runs the background committer), `options`, `landing`,
//!   `replace` (a file replaced whole, durably), `recovery/report.rs`,
//!   `damage/short.rs`.
//! - `backing` — storage with counted I/O, errors with context, fail-stop;
//!   `written` — the written map it keeps.
//! - `state`, `journal`, `superblock`, `held` — the in-memory and on-disk
//!   structures; `encryption` — the encrypted volume's protection.
//! - `layout/` — split and packed, behind one trait, per LBA range.
//! - `device` — the `BlockDevice` trait and its plain types; `shared` —
//!   the parts every path borrows.
//! - `commit`, `damage`, `recovery`, `read` — the paths over them;
//!   `jobs`, `check` — background scans; `verify` (with the proof-of-work
//!   digest) and `compare_ranges`; `scrub` (whole-volume verify,
//!   persisted).
//! - `engine` — the parts of one open volume; `read_nowait` — reads that
//!   never wait (inline, the read ring); `write` — its write path.
//! - `volume` — the public handle (`volume/device.rs`: its
//!   `BlockDevice`); `copy` — copy next to the data (reflink or
//!   pipelined). Mirrors over `BlockDevice` legs are a crate above this
//!   one (`vouch-mirror`), built on its public API;
//!   `snapshot` — snapshots and clones, made of a closed volume's files
//!   (it names the mirror record only to refuse a mirror's leg).

mod backing;
pub mod buffer;
pub mod changed;
pub mod check;
mod commit;
pub mod contexts;
pub mod copy;
pub mod damage;
pub mod device;
pub mod encryption;
mod engine;
pub mod error;
mod held;
pub mod jobs;
mod journal;
pub mod keys;
mod landing;

mod layout;
pub mod options;
pub mod protection;
mod read;
mod read_nowait;
pub mod recovery;
pub mod regions;
pub mod replace;
pub mod resize;
pub mod schedule;
pub mod scrub;
mod shared;
pub mod snapshot;
mod state;
pub mod stats;
pub mod storage;
pub mod superblock;
pub mod verify;
pub mod volume;
mod write;
mod written;

pub use check::{check, CheckReport};
pub use device::{
    verify_in_turn, Admission, BlockDevice, DeviceWrites, FlushDone, ReadDone, SealedAdmission,
    SealedBlock, SealedDevice, SealedWrites, StartRead, StartWrite, Submitted, WriteDone,
    ZeroFlags,
};
pub use error::{Error, Fault, FaultKind, Result};
pub use keys::UserSecret;
pub use landing::{LandingBuffer, LANDING_CHUNK};
pub use layout::{Allocation, StoredContext};
pub use options::{CreateOptions, OpenOptions, Tuning};
pub use schedule::{CommitSchedule, CommitStep, OrderingBreaks};
pub use state::{Block, BlockData, RangeOp, BLOCK};
pub use stats::{Stats, StatsSnapshot};
pub use storage::sim::{FaultPlan, SimStorage};
pub use storage::{direct, sim};
pub use storage::{CloneRange, FileOpen, FileStorage, ObjectId, Run, Storage};
pub use superblock::{read_superblock, MAX_VOLUME_BYTES};
pub use volume::{Volume, VolumeInfo};
pub use vouch_format::{GuardKind, LayoutKind};
pub use write::SealCheck;

use std::path::Path;
use std::sync::Arc;

/// Create a volume directory at `path`. On failure nothing is left behind.
pub fn create_volume(path: &Path, options: &CreateOptions) -> Result<Volume> {
    let cannot_create = |error: &dyn std::fmt::Display| Error::Path {
        action: "create",
        path: path.to_path_buf(),
        cause: error.to_string(),
    };
    superblock::check_volume_size(options.size_bytes).map_err(|error| cannot_create(&error))?;
    let geometry =
        vouch_format::Geometry::new(options.layout, options.size_bytes, options.segment_blocks())
            .map_err(|error| cannot_create(&error))?;
    let existed = path.exists();
    let result = FileStorage::create(path, &geometry, options.journal_bytes())
        .map_err(|error| cannot_create(&error))
        .and_then(|storage| Volume::create(Arc::new(storage), options));
    if result.is_err() && !existed {
        let _ = std::fs::remove_dir_all(path);
    }
    result
}

/// Open the volume directory at `path`.
pub fn open_volume(path: &Path, options: &OpenOptions) -> Result<Volume> {
    let cannot_open = |error: &dyn std::fmt::Display| Error::Path {
        action: "open",
        path: path.to_path_buf(),
        cause: error.to_string(),
    };
    let superblock_file =
        FileStorage::open_superblock(path).map_err(|error| cannot_open(&error))?;
    let superblock = read_superblock_file(&superblock_file, path)?;
    let geometry = superblock
        .geometry()
        .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")).in_volume(path))?;
    // A snapshot's files are opened read-only: nothing writes them.
    let snapshot =
        superblock.features.ro_compat & vouch_format::FeatureFlags::RO_COMPAT_SNAPSHOT != 0;
    if !snapshot && path.join(resize::RESIZE_MAP_FILE).exists() {
        finish_resize(path)?;
    }
    if !snapshot && snapshot::overlay::is_overlay_superblock(&superblock) {
        return Err(Error::Corrupt(
            "its superblock says OVERLAY without SNAPSHOT: an overlay is only ever a snapshot; refusing to open".to_string(),
        )
        .in_volume(path));
    }
    if snapshot && snapshot::overlay::is_overlay_superblock(&superblock) {
        // An overlay snapshot: the volume's files through its log.
        let storage = snapshot::overlay::open_storage(path, &superblock)?;
        return Volume::open(Arc::new(storage), options);
    }
    let how = FileOpen {
        writable: !options.read_only && !options.keyless && !snapshot,
        direct: options.direct,
    };
    let storage =
        FileStorage::open_objects(path, &geometry, how).map_err(|error| cannot_open(&error))?;
    if !how.writable {
        return Volume::open(Arc::new(storage), options);
    }
    // Writable: under the before-image layer (disarmed until a fenced
    // snapshot arms it).
    let layered = Arc::new(storage::before::BeforeImages::new(Arc::new(storage)));
    open_layered(&snapshot::RealFs::default(), path, layered, options)
}

/// Open the volume at `path` writable on `layered` (its files under the
/// before-image layer, disarmed), its snapshots on `fs` (the real
/// filesystem, or the crash simulator's model of one). A fence a crash
/// left is armed again before the engine opens, so recovery's own home
/// writes are imaged, and the snapshot is materialised once the volume is
/// open; an overlay snapshot's log is armed for the volume's whole life
/// with it.
pub fn open_layered(
    fs: &dyn snapshot::SnapshotFs,
    path: &Path,
    layered: Arc<storage::before::BeforeImages>,
    options: &OpenOptions,
) -> Result<Volume> {
    let pending = snapshot::fenced::resume_in(fs, path, &layered)?;
    let overlay = snapshot::overlay::arm_at_open_in(fs, path, &layered)?;
    let volume = Volume::open(layered.clone(), options)?;
    if overlay.is_none() {
        // No overlay armed: an OVERLAID a create set before a crash cut it
        // (the flag is durable before the name is published), or one a
        // failed overlay left, keeps older binaries off for nothing.
        snapshot::overlay::clear_stale_overlaid(fs, path, &volume)?;
    }
    if let Some(name) = pending {
        // A failure is marked on the snapshot (and the layer disarmed):
        // the volume opens all the same.
        let breaks = layered.breaks();
        match snapshot::fenced::materialise_in(fs, path, &name, &*layered, breaks) {
            Ok(done) => {
                tracing::warn!(volume = %path.display(), "snapshot {name} (fenced before a crash) materialised at {}", done.path.display());
            }
            Err(error) if !layered.is_armed() => {
                tracing::error!(volume = %path.display(), "{error}");
            }
            Err(error) => return Err(error),
        }
    }
    if !layered.is_armed() {
        // No fence left (published, failed, or the flag was set by a
        // create a crash cut before its fence): an older binary may open
        // it again.
        volume.set_fenced(false)?;
    }
    Ok(volume)
}

/// A resize cut short (`resize::finish`), finished or undone before the
/// volume opens, by whichever open comes first (a read-only one too: the
/// map of the size the superblock says is needed to read it). Under the
/// volume's lock; a process holding the volume already did it.
fn finish_resize(path: &Path) -> Result<()> {
    let in_volume = |error: &dyn std::fmt::Display| Error::Path {
        action: "open",
        path: path.to_path_buf(),
        cause: error.to_string(),
    };
    let _held = match FileStorage::lock_for_writing(path) {
        Ok(held) => held,
        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
        Err(error) => return Err(in_volume(&error)),
    };
    if let Some(done) = resize::finish(&snapshot::RealFs::default(), path)? {
        tracing::warn!(volume = %path.display(), "{done}");
    }
    Ok(())
}

/// A look at the volume directory at `path` without opening it, for a
/// volume another process holds for writing (a running server): what its
/// superblock (the newest valid copy: a checkpoint rewrites the older one,
/// so one copy is whole even mid-write) and its files' allocation say. No
/// lock is taken, the journal is not read and nothing is written; the
/// superblock is as of the holder's last checkpoint, and `clean` says
/// whether that checkpoint closed the volume.
pub fn peek_volume(path: &Path) -> Result<VolumeInfo> {
    use std::os::unix::fs::MetadataExt as _;
    let superblock = volume_superblock(path)?;
    let geometry = superblock
        .geometry()
        .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")).in_volume(path))?;
    let allocated = storage::objects_of(&geometry)
        .into_iter()
        .filter_map(|object| std::fs::metadata(path.join(object.file_name())).ok())
        .map(|metadata| metadata.blocks() * 512)
        .sum();
    Ok(VolumeInfo::of(&superblock, &geometry, allocated))
}

/// Does another process hold the volume directory at `path` open for
/// writing (`FileStorage::held_for_writing`)?
pub fn volume_in_use(path: &Path) -> Result<bool> {
    FileStorage::held_for_writing(path).map_err(|error| Error::Path {
        action: "open",
        path: path.to_path_buf(),
        cause: error.to_string(),
    })
}

/// The superblock of the volume directory at `path` (the newest valid
/// copy), read without opening the volume: what a caller checks before
/// opening (is it encrypted, how is its key given).
pub fn volume_superblock(path: &Path) -> Result<vouch_format::Superblock> {
    let file = FileStorage::open_superblock(path).map_err(|error| Error::Path {
        action: "open",
        path: path.to_path_buf(),
        cause: error.to_string(),
    })?;
    read_superblock_file(&file, path)
}

/// Both superblock slots from the file (short files read as zeros), then
/// the one selection rule (`superblock::select`).
fn read_superblock_file(file: &std::fs::File, path: &Path) -> Result<vouch_format::Superblock> {
    use std::os::unix::fs::FileExt;
    let mut both = vec![0u8; 8192];
    let mut done = 0;
    while done < both.len() {
        match file.read_at(&mut both[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(error) => {
                return Err(Error::Path {
                    action: "read",
                    path: path.join("superblock"),
                    cause: error.to_string(),
                })
            }
        }
    }
    superblock::select(&both[..4096], &both[4096..]).map_err(|error| error.in_volume(path))
}
