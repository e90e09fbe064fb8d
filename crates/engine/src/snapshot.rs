//! Read-only snapshots of a volume, and writable clones of a snapshot,
//! made of the volume's files (`vouch snapshot`, `vouch clone`;
//! docs/FORMAT.md, "Snapshots").
//!
//! A snapshot is a complete volume directory, `PATH/snapshots/NAME/`: a
//! clone (FICLONE: every extent shared, nothing copied) of each file of
//! the volume taken while the volume is at a flush point and no writer
//! holds it, its superblock marked RO_COMPAT_SNAPSHOT (so every binary,
//! even one from before snapshots, opens it read-only), and a `snapshot`
//! record. Being a volume, it is opened, checked, verified, scrubbed,
//! exported and served as any volume is, in the layout it was taken in.
//!
//! Crash ordering (create): the files are made in `snapshots/.NAME.partial`,
//! each fsynced, then the directory, and only then renamed to
//! `snapshots/NAME` (and `snapshots/` fsynced): the name is published
//! after everything it names is durable, so a power cut or a process crash
//! leaves no snapshot or a complete one. A `.NAME.partial` left by a
//! crash is never served (a name starting with '.' is no snapshot) and is
//! removed by the next create, list or delete. Delete renames `NAME` to
//! `.NAME.deleting` (fsyncing `snapshots/`) before removing its files, so a
//! half-removed snapshot has no name either. A clone is made the same way
//! next to its new path (`.NEWNAME.clone-partial`, renamed to NEWPATH).
//!
//! Online, the volume is held while its files are cloned; its data and
//! contexts are cloned once before (`warm_file`, while it runs), so the
//! clones under the hold re-share only what was written since.
//!
//! The file operations go through `SnapshotFs`, so the crash simulator
//! (`vouch-sim snapshot`) runs this very code on a model filesystem that
//! keeps only what was synced.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use vouch_format::superblock::{STATE_CLEAN, SUPERBLOCK_SLOT_BYTES};
use vouch_format::{FeatureFlags, Superblock};

use crate::error::{Error, Result};
use crate::storage::{objects_of, ObjectId};

pub mod fenced;
pub use fenced::refuse_while_materialising;
mod legs;
pub mod overlay;
pub use legs::{
    create_legs, create_legs_with_id, hold_legs, HeldLegs, LegsFlushPoint, StoppedLegs,
};

/// The directory of a volume that holds its snapshots.
pub const SNAPSHOTS_DIR: &str = "snapshots";
/// A snapshot's record, in its directory (JSON).
pub const RECORD_FILE: &str = "snapshot";
/// A clone's record of the snapshot it was made from, in its directory (JSON).
pub const ORIGIN_FILE: &str = "origin";
const PARTIAL: &str = ".partial";
const DELETING: &str = ".deleting";
const CLONE_PARTIAL: &str = ".clone-partial";
/// Longest snapshot name (bytes).
const NAME_MAX: usize = 128;

/// The file operations a snapshot is made of. Paths are absolute or
/// relative to the process's directory; a file written is created when
/// missing. Nothing is durable until synced: a file's bytes by
/// `sync_file`, a directory's entries (made, renamed, removed) by
/// `sync_dir` of that directory.
pub trait SnapshotFs {
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// Make `to` a copy of `from` sharing its extents (or, where the
    /// filesystem cannot, a full copy if this `SnapshotFs` was asked for
    /// one). `to` must not exist, or be a copy `warm_file` made of `from`
    /// earlier: it then equals `from` as it is now.
    fn clone_file(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Make `to` a copy of `from` as it is while it is being written,
    /// sharing its extents, ahead of a `clone_file` of the same pair at a
    /// flush point: that one then shares only what changed since
    /// (re-sharing an extent `to` already shares costs a reflink
    /// filesystem a small part of sharing it anew). `to` must not exist,
    /// or be a warm copy of `from` from an earlier call, then brought up
    /// to date the same way. Never a full copy: `Ok(false)`, and no `to`,
    /// where extents cannot be shared. Nothing relies on it but the time
    /// `clone_file` takes.
    fn warm_file(&self, _from: &Path, _to: &Path) -> io::Result<bool> {
        Ok(false)
    }
    /// Make `path` (which must not exist) a new file of `len` zero bytes,
    /// its blocks allocated when `allocate` (sparse otherwise).
    fn new_file(&self, path: &Path, len: u64, allocate: bool) -> io::Result<()>;
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    fn write_at(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()>;
    fn sync_file(&self, path: &Path) -> io::Result<()>;
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_all(&self, path: &Path) -> io::Result<()>;
    /// The names in directory `dir`; `None` when it does not exist.
    fn names(&self, dir: &Path) -> io::Result<Option<Vec<String>>>;
    fn exists(&self, path: &Path) -> bool;
    /// Make file `path` `len` bytes long (created when missing): bytes
    /// past its old end read as zeros (sparse), bytes past `len` are gone.
    fn set_len(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Remove file `path`.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Make the file at `path` read-only for everyone (0444): a snapshot's
    /// files are never written again. Metadata, not data: a model
    /// filesystem that keeps only what was synced may ignore it.
    fn make_read_only(&self, _path: &Path) -> io::Result<()> {
        Ok(())
    }
    /// Did some `clone_file` copy the bytes instead of sharing extents?
    fn copied_any(&self) -> bool {
        false
    }
    /// Make the file at `path` writable again (0644) if it exists: a file
    /// `make_read_only` sealed by a materialisation a crash cut short is
    /// written again. Metadata only, like `make_read_only`.
    fn make_writable(&self, _path: &Path) -> io::Result<()> {
        Ok(())
    }
    /// The existing file `path` opened as a before-image log
    /// (`storage/before.rs`): read, appended to and synced in place, and
    /// still the same file after a rename of its directory. A filesystem
    /// that holds no logs refuses.
    fn open_log(&self, path: &Path) -> io::Result<Box<dyn crate::storage::before::BeforeLog>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{}: this filesystem holds no before-image logs",
                path.display()
            ),
        ))
    }
    /// The length of file `path` in bytes.
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        self.read(path).map(|bytes| bytes.len() as u64)
    }
    /// Where an overlay's index of imaged blocks at `path` is kept
    /// (`storage/imaged.rs`): read whole; saved atomically and durably
    /// (the old index or the new, never a mix). `None` (the default): no
    /// index, and every writable open reads the whole log.
    fn index_store(
        &self,
        _path: &Path,
    ) -> Option<std::sync::Arc<dyn crate::storage::imaged::IndexStore>> {
        None
    }
}

/// Orderings `create` can be told to break, to show the crash simulator
/// catches them. Production passes the default (none).
#[derive(Clone, Copy, Debug, Default)]
pub struct SnapshotBreaks {
    /// Publish the name (the rename) before the files are synced.
    pub publish_before_sync: bool,
}

/// The real filesystem. `full_copy`: where extents cannot be shared, copy
/// the files' bytes (holes kept) instead of refusing.
#[derive(Debug, Default)]
pub struct RealFs {
    full_copy: bool,
    /// Some file was copied rather than cloned (`copied_any`).
    copied: std::sync::atomic::AtomicBool,
}

impl RealFs {
    /// `full_copy`: copy where the filesystem cannot share extents.
    pub fn new(full_copy: bool) -> RealFs {
        RealFs {
            full_copy,
            ..RealFs::default()
        }
    }
}

impl SnapshotFs for RealFs {
    fn index_store(
        &self,
        path: &Path,
    ) -> Option<std::sync::Arc<dyn crate::storage::imaged::IndexStore>> {
        Some(std::sync::Arc::new(crate::storage::imaged::IndexFile {
            path: path.to_path_buf(),
        }))
    }
    fn make_writable(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)) {
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }
    fn open_log(&self, path: &Path) -> io::Result<Box<dyn crate::storage::before::BeforeLog>> {
        let log = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        Ok(Box::new(log))
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(std::fs::metadata(path)?.len())
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir(path)
    }
    fn clone_file(&self, from: &Path, to: &Path) -> io::Result<()> {
        let source = File::open(from)?;
        if to.symlink_metadata().is_ok() {
            // A warm copy (`warm_file`): sharing `from` over it again
            // leaves the extents it already shares as they are. Where that
            // fails, it goes and `from` is cloned anew.
            let warm = std::fs::OpenOptions::new().write(true).open(to)?;
            if crate::storage::ficlone(&warm, &source).is_ok() {
                return warm.set_len(source.metadata()?.len());
            }
            drop(warm);
            std::fs::remove_file(to)?;
        }
        let destination = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(to)?;
        match crate::storage::ficlone(&destination, &source) {
            Err(error) if self.full_copy && error.kind() == io::ErrorKind::Unsupported => {
                self.copied
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                copy_sparse(&source, &destination)
            }
            other => other,
        }
    }
    fn warm_file(&self, from: &Path, to: &Path) -> io::Result<bool> {
        let source = File::open(from)?;
        let destination = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(to)?;
        let len = source.metadata()?.len();
        // In pieces: a clone holds both files' locks for its whole range,
        // and the volume's writes to `from` wait for them meanwhile.
        let mut at = 0;
        while at < len {
            let piece = WARM_PIECE.min(len - at);
            if let Err(error) = crate::storage::ficlonerange(&destination, at, &source, at, piece) {
                drop(destination);
                std::fs::remove_file(to)?;
                return match error.kind() {
                    io::ErrorKind::Unsupported => Ok(false),
                    _ => Err(error),
                };
            }
            at += piece;
        }
        destination.set_len(len)?;
        Ok(true)
    }
    fn new_file(&self, path: &Path, len: u64, allocate: bool) -> io::Result<()> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)?;
        if allocate {
            crate::storage::allocate(&file, 0, len)
        } else {
            file.set_len(len)
        }
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }
    fn write_at(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?
            .write_all_at(bytes, offset)
    }
    fn sync_file(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove_all(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(path)
    }
    fn names(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error),
        };
        let mut names = Vec::new();
        for entry in entries {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(Some(names))
    }
    fn exists(&self, path: &Path) -> bool {
        path.symlink_metadata().is_ok()
    }
    fn set_len(&self, path: &Path, len: u64) -> io::Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?
            .set_len(len)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn copied_any(&self) -> bool {
        self.copied.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn make_read_only(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444))
    }
}

/// The range of a volume's file one `warm_file` clone takes (the last
/// may be shorter, ending at the file's end). A clone holds both files'
/// locks (and writes back the source's dirty pages in its range) for the
/// whole piece, and the volume's home writes and reads of the file wait
/// meanwhile: with 8 MiB instead of 64, foreground 4 KiB writes while a
/// fenced snapshot materialises ran about twice as fast (docs/BENCHMARKS.md,
/// stop 42, cowperf33); 2 MiB gained nothing more.
const WARM_PIECE: u64 = 8 << 20;
/// Warm copies are made, then brought up to date this many times more
/// before the flush point: each pass shares anew what was written during
/// the one before, so the hold has only what the last pass missed.
const WARM_PASSES: usize = 2;

/// Copy every data range of `source` into `destination` (`copy_file_range`
/// between `SEEK_DATA` and `SEEK_HOLE`), leaving its holes holes, and
/// give it `source`'s length.
fn copy_sparse(source: &File, destination: &File) -> io::Result<()> {
    let len = source.metadata()?.len();
    let mut at = 0u64;
    while at < len {
        // SAFETY: lseek on an open descriptor.
        let start = unsafe { libc::lseek(source.as_raw_fd(), at as i64, libc::SEEK_DATA) };
        if start < 0 {
            let error = io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::ENXIO) {
                break;
            }
            return Err(error);
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(source.as_raw_fd(), start, libc::SEEK_HOLE) };
        if end < 0 {
            return Err(io::Error::last_os_error());
        }
        let (mut from, mut to) = (start, start);
        while from < end {
            // SAFETY: both descriptors are open; the offsets are ours.
            let done = unsafe {
                libc::copy_file_range(
                    source.as_raw_fd(),
                    &mut from,
                    destination.as_raw_fd(),
                    &mut to,
                    (end - from) as usize,
                    0,
                )
            };
            if done < 0 {
                return Err(io::Error::last_os_error());
            }
            if done == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the file shrank while it was copied",
                ));
            }
        }
        at = end as u64;
    }
    destination.set_len(len)
}

/// What a snapshot records (its `snapshot` file): what it is a snapshot
/// of, and the volume's counters at its flush point, from which the blocks
/// written since can be told (every block of the snapshot carries a
/// generation at most `generations_seq`'s commit).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotRecord {
    pub name: String,
    /// Random at create: two snapshots of one name (one deleted, the other
    /// made later) are told apart, so a clone's `origin` names the one it
    /// was made from. Empty in records made before it.
    #[serde(default)]
    pub id: String,
    /// The volume's uuid (the snapshot keeps it: every block's protection
    /// is bound to it).
    pub uuid: String,
    pub created_unix: u64,
    /// The volume's superblock at the flush point: its generation, its
    /// journal checkpoint (every commit up to it is in the snapshot) and
    /// its generations copy.
    pub superblock_generation: u64,
    pub checkpoint_seq: u64,
    pub generations_seq: u64,
    pub layout: String,
    /// How its files were made: "reflink" (extents shared) or "copy" (a
    /// full copy, `--copy` on a filesystem that cannot share blocks).
    pub method: String,
    /// Taken online (`vouch snapshot create --server`, the control API)
    /// from a served volume at a flush point, or offline from a stopped one.
    #[serde(default)]
    pub online: bool,
}

/// A snapshot found by `list`.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub path: PathBuf,
    pub record: SnapshotRecord,
    /// Fenced and still being materialised (`fenced.rs`): `path` is its
    /// `.NAME.partial`, not yet to be served.
    pub materialising: bool,
    /// Fenced and failed (`fenced.rs`): why. `path` is its
    /// `.NAME.partial`, never served; `vouch snapshot delete` removes it.
    pub failed: Option<String>,
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

pub(crate) fn io_error(action: &'static str, path: &Path, error: io::Error) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: error.to_string(),
    }
}

/// Refuse a name that is not one plain directory entry.
pub fn check_name(name: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-+@:".contains(c);
    let why = if name.is_empty() {
        Some("is empty".to_string())
    } else if name.contains('/') {
        Some("has a '/'".to_string())
    } else if name.starts_with('.') {
        Some("starts with '.'".to_string())
    } else if name.len() > NAME_MAX {
        Some(format!("is longer than {NAME_MAX} bytes"))
    } else {
        name.chars()
            .find(|&c| !allowed(c))
            .map(|c| format!("has {c:?}"))
    };
    match why {
        None => Ok(()),
        Some(why) => Err(invalid(format!(
            "snapshot name {name:?} {why}: a name is one directory entry of letters, digits and . _ - + @ : (not starting with '.')"
        ))),
    }
}

/// Where the volume at `volume` keeps snapshot `name`.
pub fn snapshot_path(volume: &Path, name: &str) -> PathBuf {
    volume.join(SNAPSHOTS_DIR).join(name)
}

/// The superblock of the volume directory `dir`, read through `fs`.
pub(crate) fn superblock_of(fs: &dyn SnapshotFs, dir: &Path) -> Result<Superblock> {
    let path = dir.join(ObjectId::Superblock.file_name());
    let mut bytes = fs.read(&path).map_err(|e| io_error("read", &path, e))?;
    let slot = SUPERBLOCK_SLOT_BYTES as usize;
    bytes.resize(2 * slot, 0);
    let (first, second) = bytes.split_at(slot);
    crate::superblock::select(first, second).map_err(|error| error.in_volume(dir))
}

/// Write `superblock` as both copies of `dir`'s superblock file (not synced).
fn write_superblock(fs: &dyn SnapshotFs, dir: &Path, superblock: &Superblock) -> Result<()> {
    let path = dir.join(ObjectId::Superblock.file_name());
    let mut slot = vec![0u8; SUPERBLOCK_SLOT_BYTES as usize];
    slot[..vouch_format::SUPERBLOCK_BYTES].copy_from_slice(&superblock.encode());
    for copy in 0..2 {
        fs.write_at(&path, copy * SUPERBLOCK_SLOT_BYTES, &slot)
            .map_err(|e| io_error("write", &path, e))?;
    }
    Ok(())
}

pub(crate) fn is_snapshot(superblock: &Superblock) -> bool {
    superblock.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0
}

/// The volume's files, by name.
fn volume_files(superblock: &Superblock) -> Result<Vec<String>> {
    let geometry = superblock
        .geometry()
        .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")))?;
    Ok(objects_of(&geometry)
        .into_iter()
        .map(ObjectId::file_name)
        .collect())
}

/// Clone every file of volume directory `from` into the new directory
/// `to`, then write `superblock` into it and `extra` (a record, made after
/// the files, so it can say how they were made), then sync
/// them all and the directory (unless `breaks` says to leave that to after
/// the publishing rename).
///
/// All but the journal: `from` is closed cleanly, so its journal holds
/// nothing to replay (replay wants `checkpoint_seq + 1` first, and zeros
/// are no record), and a shared journal would make the next journal
/// write of the volume (and of the copy) copy-on-write, a write that can
/// fail on a full filesystem, where a journal is allocated up front so it
/// never is. The copy gets a new journal of the same length: allocated
/// when it is `writable` (a clone), sparse for a snapshot, never written.
fn clone_volume(
    fs: &dyn SnapshotFs,
    from: &Path,
    to: &Path,
    superblock: &Superblock,
    how: How,
    extra: (&str, &mut dyn FnMut() -> Vec<u8>),
) -> Result<Vec<PathBuf>> {
    let mut made = clone_files(fs, from, to, superblock, how)?;
    if crate::regions::has_regions(superblock) {
        made.extend(clone_regions(fs, from, to, superblock, how)?);
    }
    let record = to.join(extra.0);
    fs.write_at(&record, 0, &(extra.1)())
        .map_err(|e| io_error("write", &record, e))?;
    made.push(record);
    Ok(made)
}

/// How `clone_volume` makes its copy.
#[derive(Clone, Copy)]
struct How {
    /// A writable volume (a clone: its journal allocated), or a snapshot.
    writable: bool,
    /// `warm_volume` made the directory and warm copies in it: the clones
    /// go over them. Otherwise the directory must not exist.
    warm: bool,
}

/// The files of one volume directory: `from`'s cloned into the new
/// directory `to` (its journal new), and `superblock` written there.
fn clone_files(
    fs: &dyn SnapshotFs,
    from: &Path,
    to: &Path,
    superblock: &Superblock,
    how: How,
) -> Result<Vec<PathBuf>> {
    if !(how.warm && fs.exists(to)) {
        fs.create_dir(to).map_err(|e| io_error("create", to, e))?;
    }
    let journal = ObjectId::Journal.file_name();
    let mut made = Vec::new();
    for name in volume_files(superblock)? {
        let (source, target) = (from.join(&name), to.join(&name));
        if name == journal {
            fs.new_file(&target, superblock.journal_bytes, how.writable)
                .map_err(|e| io_error("create", &target, e))?;
        } else {
            fs.clone_file(&source, &target)
                .map_err(|e| clone_failed(from, &source, e))?;
        }
        made.push(target);
    }
    write_superblock(fs, to, superblock)?;
    Ok(made)
}

/// A volume with regions (docs/FORMAT.md, "Regions"): its other member
/// (`layout.NAME/`) cloned into `to` as `clone_files` does the home, its
/// superblock marked as the home's is (`home`: a snapshot, or a clone's
/// writable one with its new instance), and the region record copied
/// byte for byte, so the copy serves each region from the member that
/// served it at the flush point. The member's files are at that flush
/// point too (`FlushPoint`: offline closed, online held with the home).
fn clone_regions(
    fs: &dyn SnapshotFs,
    from: &Path,
    to: &Path,
    home: &Superblock,
    how: How,
) -> Result<Vec<PathBuf>> {
    let member_from = crate::regions::member_path(from, home.layout);
    let member_to = crate::regions::member_path(to, home.layout);
    let mut member = superblock_of(fs, &member_from)?;
    member.features.ro_compat = (member.features.ro_compat & !FeatureFlags::RO_COMPAT_SNAPSHOT)
        | (home.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT);
    member.state = STATE_CLEAN;
    if how.writable {
        member.instance = crate::superblock::new_instance();
    }
    let mut made = clone_files(fs, &member_from, &member_to, &member, how)?;
    let (record_from, record_to) = (
        from.join(crate::regions::REGIONS_FILE),
        to.join(crate::regions::REGIONS_FILE),
    );
    let bytes = fs
        .read(&record_from)
        .map_err(|e| io_error("read", &record_from, e))?;
    fs.write_at(&record_to, 0, &bytes)
        .map_err(|e| io_error("write", &record_to, e))?;
    made.push(record_to);
    Ok(made)
}

/// Warm copies (`SnapshotFs::warm_file`) of the large files of the volume
/// directory `from` (its data segments and contexts, a volume with
/// regions' other member's too) in the new directory `to`, made while the
/// volume is written, before its flush point: the clones there then share
/// only what changed since. The files it made, for `publish` to remove
/// any the flush point's clones did not make again.
fn warm_volume(fs: &dyn SnapshotFs, from: &Path, to: &Path) -> Result<Vec<PathBuf>> {
    let mut made: Vec<PathBuf> = Vec::new();
    for _ in 0..WARM_PASSES {
        let superblock = superblock_of(fs, from)?;
        let mut pass = warm_files(fs, from, to, &superblock)?;
        if crate::regions::has_regions(&superblock) {
            let member_from = crate::regions::member_path(from, superblock.layout);
            let member_to = crate::regions::member_path(to, superblock.layout);
            let member = superblock_of(fs, &member_from)?;
            pass.extend(warm_files(fs, &member_from, &member_to, &member)?);
        }
        // Every file any pass made (the geometry may change between).
        for file in pass {
            if !made.contains(&file) {
                made.push(file);
            }
        }
    }
    Ok(made)
}

fn warm_files(
    fs: &dyn SnapshotFs,
    from: &Path,
    to: &Path,
    superblock: &Superblock,
) -> Result<Vec<PathBuf>> {
    let geometry = superblock
        .geometry()
        .map_err(|error| Error::Corrupt(format!("corrupt superblock: {error}")))?;
    if !fs.exists(to) {
        fs.create_dir(to).map_err(|e| io_error("create", to, e))?;
    }
    let mut made = Vec::new();
    for object in objects_of(&geometry) {
        if !matches!(object, ObjectId::Data(_) | ObjectId::Contexts) {
            continue;
        }
        let (source, target) = (from.join(object.file_name()), to.join(object.file_name()));
        if !fs
            .warm_file(&source, &target)
            .map_err(|e| io_error("clone", &source, e))?
        {
            break;
        }
        made.push(target);
    }
    Ok(made)
}

/// Sync `files`, then every directory below `dir` holding some of them
/// (a volume with regions' member, `layout.NAME/`), then `dir`.
fn sync_all(fs: &dyn SnapshotFs, dir: &Path, files: &[PathBuf]) -> Result<()> {
    let mut below: Vec<&Path> = Vec::new();
    for file in files {
        fs.sync_file(file).map_err(|e| io_error("sync", file, e))?;
        if let Some(parent) = file.parent().filter(|parent| *parent != dir) {
            if !below.contains(&parent) {
                below.push(parent);
            }
        }
    }
    for sub in below {
        fs.sync_dir(sub).map_err(|e| io_error("sync", sub, e))?;
    }
    fs.sync_dir(dir).map_err(|e| io_error("sync", dir, e))
}

/// A clone refused: where the filesystem cannot share extents, say which
/// filesystem and what to do.
fn clone_failed(volume: &Path, file: &Path, error: io::Error) -> Error {
    if error.kind() != io::ErrorKind::Unsupported {
        return io_error("clone", file, error);
    }
    let filesystem = filesystem_name(volume).unwrap_or("a filesystem");
    invalid(format!(
        "{} is on {filesystem}, which cannot share blocks: snapshots need xfs or btrfs (or --copy to make a full copy) ({error})",
        volume.display()
    ))
}

/// The name of the filesystem `path` is on, for the common ones.
pub fn filesystem_name(path: &Path) -> Option<&'static str> {
    let text = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs writes one `struct statfs`, zeroed first.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out pointer.
    if unsafe { libc::statfs(text.as_ptr(), &mut stat) } != 0 {
        return None;
    }
    Some(match stat.f_type as i64 {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x2FC1_2FC1 => "zfs",
        0x6969 => "nfs",
        0x794C_7630 => "overlayfs",
        _ => "a filesystem",
    })
}

/// Remove what a crash left in `snapshots/`: half-made (`.NAME.partial`)
/// and half-removed (`.NAME.deleting`) snapshots. Needs the volume's lock.
pub fn tidy(fs: &dyn SnapshotFs, volume: &Path) -> Result<Vec<String>> {
    let dir = volume.join(SNAPSHOTS_DIR);
    let mut removed = Vec::new();
    for name in fs
        .names(&dir)
        .map_err(|e| io_error("list", &dir, e))?
        .unwrap_or_default()
    {
        if name.starts_with('.') && (name.ends_with(PARTIAL) || name.ends_with(DELETING)) {
            let path = dir.join(&name);
            if name.ends_with(PARTIAL)
                && (fenced::is_fenced(fs, &path) || fenced::failed_cause(fs, &path).is_some())
            {
                // A fenced snapshot, answered: the open materialises it;
                // or one that failed: listed until it is deleted.
                continue;
            }
            fs.remove_all(&path)
                .map_err(|e| io_error("remove", &path, e))?;
            removed.push(name);
        }
    }
    if !removed.is_empty() {
        fs.sync_dir(&dir).map_err(|e| io_error("sync", &dir, e))?;
    }
    Ok(removed)
}

/// `error` (a snapshot create that failed after it set the volume's flag
/// `flag`), with `cleared` (the flag's undo) told when that failed too:
/// the flag stays set until the next writable open clears it, and until
/// then binaries that do not know it refuse the volume.
pub(crate) fn flag_left(volume: &Path, error: Error, flag: &str, cleared: Result<()>) -> Error {
    match cleared {
        Ok(()) => error,
        Err(clear) => {
            tracing::error!(volume = %volume.display(), "{flag} could not be cleared after a failed snapshot create: {clear}");
            Error::Path {
                action: "take the snapshot of",
                path: volume.to_path_buf(),
                cause: format!(
                    "{error}; and the volume's {flag} flag, set for it, could not be cleared ({clear}): the next writable open of the volume clears it (until then older binaries refuse it)"
                ),
            }
        }
    }
}

/// Where a snapshot's files come from: a volume at a flush point, its
/// files not changing while `clone` runs.
pub trait FlushPoint {
    /// Run `clone` with the volume's files at a flush point (every write
    /// acknowledged before this was called durable in them) and held
    /// there until it returns, given the superblock that describes them.
    fn at_flush_point(&self, clone: &mut dyn FnMut(&Superblock) -> Result<()>) -> Result<()>;
    /// Was the volume served (an online snapshot)?
    fn online(&self) -> bool;
    /// Does the flush point cover both members of a volume with regions
    /// (and its record)? One that holds only the home member's must not
    /// make a snapshot of such a volume: the other member's files would
    /// be cloned while it writes, without what it buffered.
    fn covers_regions(&self) -> bool {
        false
    }
}

/// A stopped volume, closed cleanly and held by the caller
/// (`FileStorage::lock_for_writing`): its files are the data at its last
/// flush, and no one changes them.
pub struct Stopped<'a> {
    pub fs: &'a dyn SnapshotFs,
    pub volume: &'a Path,
}

impl FlushPoint for Stopped<'_> {
    fn at_flush_point(&self, clone: &mut dyn FnMut(&Superblock) -> Result<()>) -> Result<()> {
        let superblock = superblock_of(self.fs, self.volume)?;
        if superblock.state != STATE_CLEAN {
            return Err(invalid(format!(
                "{} was not closed cleanly: open it (vouch check, or serve) so it recovers, then take the snapshot",
                self.volume.display()
            )));
        }
        if crate::regions::has_regions(&superblock) {
            let member = crate::regions::member_path(self.volume, superblock.layout);
            if superblock_of(self.fs, &member)?.state != STATE_CLEAN {
                return Err(invalid(format!(
                    "{} (the member of {} serving its {} regions) was not closed cleanly: open the volume (vouch check, or serve) so it recovers, then take the snapshot",
                    member.display(),
                    self.volume.display(),
                    crate::regions::other_layout(superblock.layout).name()
                )));
            }
        }
        clone(&superblock)
    }
    fn online(&self) -> bool {
        false
    }
    fn covers_regions(&self) -> bool {
        true
    }
}

/// A served volume: `Volume::at_flush_point` commits what is buffered,
/// checkpoints and holds the commit lock while the files are cloned.
impl FlushPoint for crate::Volume {
    fn at_flush_point(&self, clone: &mut dyn FnMut(&Superblock) -> Result<()>) -> Result<()> {
        crate::Volume::at_flush_point(self, clone)
    }
    fn online(&self) -> bool {
        true
    }
}

/// A served volume with regions: both members at one flush point, the
/// other member's held inside the home's, so that no write reaches either
/// member's files while they and the region record are cloned, and no
/// region switches members meanwhile (`pause_switches`, taken first: a
/// move about to switch waits, without its region's lock, and one in its
/// switch is let finish). The record cloned is then the one in memory,
/// the home superblock's `regions_seq` its own, and it names, for each
/// region, a member holding its blocks at the flush point: a migration
/// flushes the new member before it switches, and trims the old only
/// after (an online move's copy in the member not serving the region is
/// cleared by the next move before it copies there).
impl FlushPoint for crate::regions::RegionVolume {
    fn at_flush_point(&self, clone: &mut dyn FnMut(&Superblock) -> Result<()>) -> Result<()> {
        let _switches = self.pause_switches();
        let other = self.member(crate::regions::other_layout(self.home_layout()));
        self.home()
            .at_flush_point(&mut |home| other.at_flush_point(&mut |_| clone(home)))
    }
    fn online(&self) -> bool {
        true
    }
    fn covers_regions(&self) -> bool {
        true
    }
}

/// Take snapshot `name` of the volume directory `volume`, which must be
/// closed cleanly and held (`FileStorage::lock_for_writing`) by the
/// caller, so its files are the data at its last flush. `method` goes in
/// the record ("reflink" or "copy").
pub fn create(
    fs: &dyn SnapshotFs,
    volume: &Path,
    name: &str,
    method: &str,
    breaks: SnapshotBreaks,
) -> Result<Snapshot> {
    create_from(fs, volume, name, method, breaks, &Stopped { fs, volume })
}

/// Take snapshot `name` of the volume directory `volume` from `point`
/// (the stopped volume, or the served one). Only the clones run at the
/// flush point; the checks before and the syncs and the publishing
/// rename after do not hold the volume. Callers serialize creates and
/// deletes of one volume (the offline lock; the server's per-volume lock).
pub fn create_from(
    fs: &dyn SnapshotFs,
    volume: &Path,
    name: &str,
    method: &str,
    breaks: SnapshotBreaks,
    point: &dyn FlushPoint,
) -> Result<Snapshot> {
    let asked = Asked {
        name,
        method,
        breaks,
    };
    create_asked(fs, volume, &asked, point, &new_id())
}

/// `create_from` (method "reflink", no breaks) with the snapshot's id
/// given: a remote replica's copy of a mirror's snapshot takes the id the
/// exporter gave every copy.
pub fn create_with_id(
    fs: &dyn SnapshotFs,
    volume: &Path,
    point: &dyn FlushPoint,
    name: &str,
    id: &str,
) -> Result<Snapshot> {
    let asked = Asked {
        name,
        method: "reflink",
        breaks: SnapshotBreaks::default(),
    };
    create_asked(fs, volume, &asked, point, id)
}

fn create_asked(
    fs: &dyn SnapshotFs,
    volume: &Path,
    asked: &Asked,
    point: &dyn FlushPoint,
    id: &str,
) -> Result<Snapshot> {
    let name = asked.name;
    check_name(name)?;
    if fs.exists(&volume.join(vouch_format::mirror::MIRROR_RECORD_FILE)) {
        return Err(invalid(format!(
            "{} is a leg of a mirror: its snapshot is taken of every active leg at one flush point (`vouch snapshot create` of the mirror, offline or --server), not of one leg",
            volume.display()
        )));
    }
    let made_dir = prepare(fs, volume, name)?;
    let result = publish(fs, volume, asked, point, id);
    if result.is_err() {
        take_back(fs, volume, made_dir);
    }
    result
}

/// Check that snapshot `name` of the volume at `volume` can be made (the
/// volume is no snapshot, the name is free) and make `snapshots/` if
/// there is none (durably): whether it was made.
fn prepare(fs: &dyn SnapshotFs, volume: &Path, name: &str) -> Result<bool> {
    let superblock = superblock_of(fs, volume)?;
    if is_snapshot(&superblock) {
        return Err(invalid(format!(
            "{} is itself a snapshot: take snapshots of the volume it belongs to (or of a `vouch clone` of it)",
            volume.display()
        )));
    }
    let dir = volume.join(SNAPSHOTS_DIR);
    let target = dir.join(name);
    if fs.exists(&target) {
        return Err(invalid(format!(
            "a snapshot named {name:?} already exists ({}): choose another name or delete it first",
            target.display()
        )));
    }
    let failed = partial_path(volume, name);
    if let Some(cause) = fenced::failed_cause(fs, &failed) {
        return Err(invalid(format!(
            "a snapshot named {name:?} failed and is left in {}: delete it first ({cause})",
            failed.display()
        )));
    }
    let made_dir = fs
        .names(&dir)
        .map_err(|e| io_error("list", &dir, e))?
        .is_none();
    if made_dir {
        fs.create_dir(&dir)
            .map_err(|e| io_error("create", &dir, e))?;
        fs.sync_dir(volume)
            .map_err(|e| io_error("sync", volume, e))?;
    }
    Ok(made_dir)
}

/// A create that failed: what it left in `snapshots/` removed, and a
/// `snapshots/` it made (`made_dir`) too when it is empty (a refused first
/// snapshot, ext4 without --copy, leaves no empty `snapshots/` behind).
fn take_back(fs: &dyn SnapshotFs, volume: &Path, made_dir: bool) {
    if !made_dir {
        return;
    }
    let dir = volume.join(SNAPSHOTS_DIR);
    let _ = tidy(fs, volume);
    if fs
        .names(&dir)
        .ok()
        .flatten()
        .is_some_and(|names| names.is_empty())
    {
        let _ = fs.remove_all(&dir);
        let _ = fs.sync_dir(volume);
    }
}

/// What `create_from` was asked for.
#[derive(Clone, Copy)]
struct Asked<'a> {
    name: &'a str,
    method: &'a str,
    breaks: SnapshotBreaks,
}

/// Clone the volume at `point` into `.NAME.partial`, sync it and publish
/// it as `NAME` (`create_from` has checked the request and made
/// `snapshots/`).
fn publish(
    fs: &dyn SnapshotFs,
    volume: &Path,
    asked: &Asked,
    point: &dyn FlushPoint,
    id: &str,
) -> Result<Snapshot> {
    tidy(fs, volume)?;
    let warm = warm_up(fs, volume, asked.name, point.online());
    let mut taken = None;
    let held = point.at_flush_point(&mut |superblock: &Superblock| {
        let at = Point {
            online: point.online(),
            covers_regions: point.covers_regions(),
            warm: !warm.is_empty(),
        };
        taken = Some(clone_at(fs, volume, superblock, asked, id, at)?);
        Ok(())
    });
    if let Err(error) = held {
        take_back_warm(fs, volume, asked.name, &warm);
        return Err(error);
    }
    let (record, files) = taken.expect("the flush point ran the clone");
    seal(fs, volume, asked, &warm, &files)?;
    name_it(fs, volume, asked, &files)?;
    Ok(Snapshot {
        path: snapshot_path(volume, asked.name),
        record,
        materialising: false,
        failed: None,
    })
}

/// A new snapshot id (`SnapshotRecord::id`).
pub fn new_id() -> String {
    uuid::Uuid::new_v4().hyphenated().to_string()
}

/// `.NAME.partial` of the volume at `volume`.
pub fn partial_path(volume: &Path, name: &str) -> PathBuf {
    volume.join(SNAPSHOTS_DIR).join(format!(".{name}{PARTIAL}"))
}

/// A served volume is held while its files are cloned: clone them first
/// while it runs (`online`), so the clones at the flush point have only
/// the extents written since to share. A failed warm-up only costs time.
/// The warm copies made, in `.NAME.partial` (none: the flush point makes
/// the directory, as offline).
fn warm_up(fs: &dyn SnapshotFs, volume: &Path, name: &str, online: bool) -> Vec<PathBuf> {
    if !online {
        return Vec::new();
    }
    let partial = partial_path(volume, name);
    match warm_volume(fs, volume, &partial) {
        Ok(files) if !files.is_empty() => files,
        other => {
            if let Err(error) = other {
                tracing::debug!("snapshot {name}: no warm copy ({error})");
            }
            // No warm copies (or the filesystem shares no extents).
            let _ = fs.remove_all(&partial);
            Vec::new()
        }
    }
}

/// The warm copies share the whole volume: not left pinned until the
/// next create's tidy when the flush point failed.
fn take_back_warm(fs: &dyn SnapshotFs, volume: &Path, name: &str, warm: &[PathBuf]) {
    if !warm.is_empty() {
        let _ = fs.remove_all(&partial_path(volume, name));
    }
}

/// What the flush point `clone_at` runs in is.
#[derive(Clone, Copy)]
struct Point {
    online: bool,
    covers_regions: bool,
    /// `warm_up` made the directory and warm copies in it.
    warm: bool,
}

/// At the flush point (`superblock` the volume's there): clone the volume
/// at `volume` into `.NAME.partial` with its record (`id`). Returns the
/// record and the files made.
fn clone_at(
    fs: &dyn SnapshotFs,
    volume: &Path,
    superblock: &Superblock,
    asked: &Asked,
    id: &str,
    at: Point,
) -> Result<(SnapshotRecord, Vec<PathBuf>)> {
    if crate::regions::has_regions(superblock) && !at.covers_regions {
        return Err(invalid(format!(
            "{} is a volume with regions: a snapshot of it needs both members (and the region record) at one flush point, and this flush point holds one volume only",
            volume.display()
        )));
    }
    let mut record = record_at(superblock, asked.name, id, asked.method, at.online);
    let mut marked = *superblock;
    marked.features.ro_compat |= FeatureFlags::RO_COMPAT_SNAPSHOT;
    // A served volume's superblock says open; its snapshot is its files
    // at a checkpoint with nothing to replay: closed cleanly.
    marked.state = STATE_CLEAN;
    let mut make_record = || {
        if fs.copied_any() {
            record.method = "copy".to_string();
        }
        serde_json::to_vec_pretty(&record).expect("a record serializes")
    };
    let how = How {
        writable: false,
        warm: at.warm,
    };
    let files = clone_volume(
        fs,
        volume,
        &partial_path(volume, asked.name),
        &marked,
        how,
        (RECORD_FILE, &mut make_record),
    )?;
    Ok((record, files))
}

/// The record of snapshot `name` (`id`) taken at the flush point whose
/// superblock is `superblock`, made by `method`, `online` or not.
pub(crate) fn record_at(
    superblock: &Superblock,
    name: &str,
    id: &str,
    method: &str,
    online: bool,
) -> SnapshotRecord {
    SnapshotRecord {
        name: name.to_string(),
        id: id.to_string(),
        uuid: uuid::Uuid::from_bytes(superblock.uuid)
            .hyphenated()
            .to_string(),
        created_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs()),
        superblock_generation: superblock.generation,
        checkpoint_seq: superblock.checkpoint_seq,
        generations_seq: superblock.generations_seq,
        layout: superblock.layout.name().to_string(),
        method: method.to_string(),
        online,
    }
}

/// The copy in `.NAME.partial` made final: the warm copies no clone made
/// again removed, the files made read-only and synced (with the
/// directories holding them).
fn seal(
    fs: &dyn SnapshotFs,
    volume: &Path,
    asked: &Asked,
    warm: &[PathBuf],
    files: &[PathBuf],
) -> Result<()> {
    for file in warm.iter().filter(|file| !files.contains(file)) {
        // Warmed, but not a file of the volume at its flush point.
        fs.remove_file(file)
            .map_err(|e| io_error("remove", file, e))?;
    }
    for file in files {
        fs.make_read_only(file)
            .map_err(|e| io_error("chmod", file, e))?;
    }
    if !asked.breaks.publish_before_sync {
        sync_all(fs, &partial_path(volume, asked.name), files)?;
    }
    Ok(())
}

/// `.NAME.partial` published as `NAME` (ORDER POINT: `seal` made its files
/// and directory durable before this rename; `snapshots/` synced after).
fn name_it(fs: &dyn SnapshotFs, volume: &Path, asked: &Asked, files: &[PathBuf]) -> Result<()> {
    let dir = volume.join(SNAPSHOTS_DIR);
    let partial = partial_path(volume, asked.name);
    let target = dir.join(asked.name);
    fs.rename(&partial, &target)
        .map_err(|e| io_error("rename", &partial, e))?;
    fs.sync_dir(&dir).map_err(|e| io_error("sync", &dir, e))?;
    if asked.breaks.publish_before_sync {
        let files: Vec<PathBuf> = files
            .iter()
            .map(|file| target.join(file.strip_prefix(&partial).expect("a file made in it")))
            .collect();
        sync_all(fs, &target, &files)?;
    }
    Ok(())
}

/// The snapshots of the volume at `volume`, by name. A directory without
/// a readable record is listed with an error rather than hidden.
pub fn list(fs: &dyn SnapshotFs, volume: &Path) -> Result<Vec<Result<Snapshot>>> {
    let dir = volume.join(SNAPSHOTS_DIR);
    let names = fs
        .names(&dir)
        .map_err(|e| io_error("list", &dir, e))?
        .unwrap_or_default();
    Ok(names
        .into_iter()
        .filter_map(|name| {
            let path = dir.join(&name);
            let partial = name.starts_with('.') && name.ends_with(PARTIAL);
            let failed = partial.then(|| fenced::failed_cause(fs, &path)).flatten();
            let materialising = name.starts_with('.') && failed.is_none();
            if materialising && !(partial && fenced::is_fenced(fs, &path)) {
                return None;
            }
            let file = path.join(RECORD_FILE);
            Some(
                fs.read(&file)
                    .map_err(|e| io_error("read", &file, e))
                    .and_then(|bytes| {
                        serde_json::from_slice(&bytes)
                            .map_err(|e| Error::Corrupt(format!("{}: {e}", file.display())))
                    })
                    .map(|record| Snapshot {
                        path,
                        record,
                        materialising,
                        failed,
                    }),
            )
        })
        .collect())
}

/// Delete snapshot `name` of `volume` (held by the caller).
pub fn delete(fs: &dyn SnapshotFs, volume: &Path, name: &str) -> Result<()> {
    check_name(name)?;
    let dir = volume.join(SNAPSHOTS_DIR);
    let mut target = dir.join(name);
    let failed = partial_path(volume, name);
    if !fs.exists(&target) && fenced::failed_cause(fs, &failed).is_some() {
        // A fenced snapshot that failed (`fenced.rs`): what is left of it.
        target = failed;
    }
    if !fs.exists(&target) {
        return Err(invalid(format!(
            "{} has no snapshot named {name:?} (`vouch snapshot list {}` lists them)",
            volume.display(),
            volume.display()
        )));
    }
    let doomed = dir.join(format!(".{name}{DELETING}"));
    fs.rename(&target, &doomed)
        .map_err(|e| io_error("rename", &target, e))?;
    fs.sync_dir(&dir).map_err(|e| io_error("sync", &dir, e))?;
    fs.remove_all(&doomed)
        .map_err(|e| io_error("remove", &doomed, e))?;
    fs.sync_dir(&dir).map_err(|e| io_error("sync", &dir, e))
}

/// What a clone records of the snapshot it was made from (`origin`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CloneOrigin {
    /// The snapshot's directory, as given.
    pub snapshot: String,
    pub record: SnapshotRecord,
}

/// Make `new_path` a writable volume sharing the blocks of the snapshot at
/// `snapshot`. A half-made clone (`.NEWNAME.clone-partial` next to it) is
/// removed by the next clone to the same path.
pub fn clone(fs: &dyn SnapshotFs, snapshot: &Path, new_path: &Path) -> Result<PathBuf> {
    let superblock = superblock_of(fs, snapshot)?;
    if !is_snapshot(&superblock) {
        return Err(invalid(format!(
            "{} is not a snapshot (`vouch snapshot create PATH NAME` makes one; `vouch copy` copies a volume)",
            snapshot.display()
        )));
    }
    if overlay::is_overlay_superblock(&superblock) {
        return Err(invalid(format!(
            "{} is an overlay snapshot (its blocks are its volume's files, read through its log): clones of it are not supported yet (`vouch export` it and `vouch import` the image, or take a `--copy` snapshot and clone that)",
            snapshot.display()
        )));
    }
    let record_path = snapshot.join(RECORD_FILE);
    let record: SnapshotRecord = fs
        .read(&record_path)
        .map_err(|e| io_error("read", &record_path, e))
        .and_then(|bytes| {
            serde_json::from_slice(&bytes)
                .map_err(|e| Error::Corrupt(format!("{}: {e}", record_path.display())))
        })?;
    if fs.exists(new_path) {
        return Err(invalid(format!(
            "{} already exists: a clone is made at a new path",
            new_path.display()
        )));
    }
    let file_name = new_path
        .file_name()
        .ok_or_else(|| invalid(format!("{} names no directory", new_path.display())))?;
    let parent = match new_path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let partial = parent.join(format!(".{}{CLONE_PARTIAL}", file_name.to_string_lossy()));
    if fs.exists(&partial) {
        fs.remove_all(&partial)
            .map_err(|e| io_error("remove", &partial, e))?;
        fs.sync_dir(&parent)
            .map_err(|e| io_error("sync", &parent, e))?;
    }
    let mut writable = superblock;
    writable.features.ro_compat &= !FeatureFlags::RO_COMPAT_SNAPSHOT;
    // Same uuid (tags, AD, key) as its origin, but another volume from
    // now on: a mirror or replica must never take it for its origin.
    writable.instance = crate::superblock::new_instance();
    let origin = CloneOrigin {
        snapshot: snapshot.display().to_string(),
        record,
    };
    let bytes = serde_json::to_vec_pretty(&origin).expect("a record serializes");
    let files = clone_volume(
        fs,
        snapshot,
        &partial,
        &writable,
        How {
            writable: true,
            warm: false,
        },
        (ORIGIN_FILE, &mut || bytes.clone()),
    )?;
    sync_all(fs, &partial, &files)?;
    fs.rename(&partial, new_path)
        .map_err(|e| io_error("rename", &partial, e))?;
    fs.sync_dir(&parent)
        .map_err(|e| io_error("sync", &parent, e))?;
    Ok(new_path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::check_name;

    #[test]
    fn a_name_is_one_plain_directory_entry() {
        for good in ["daily", "2026-11-27T13:00", "a.b_c+d@e"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("a/b", "has a '/'"),
            ("..", "starts with '.'"),
            (".hidden", "starts with '.'"),
            ("a b", "has ' '"),
        ] {
            let error = check_name(bad).expect_err(bad).to_string();
            assert!(error.contains(why), "{bad}: {error}");
        }
        assert!(check_name(&"x".repeat(129)).is_err());
    }
}
