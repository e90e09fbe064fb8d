//! A layout per region (docs/FORMAT.md, "Regions"): a REGIONS volume is
//! two members, the volume's directory (its home layout) and
//! `layout.NAME/` (the other), each a whole volume; the region record
//! (`regions`) says which member serves each region. A layer beside the
//! engine: a volume without the flag never comes here.
//!
//! `migrate` moves regions between the members offline, one at a time, in
//! the order docs/CRASH_MODEL.md ("Migration between layouts") gives.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use vouch_format::regions::RegionRecord;
use vouch_format::{FeatureFlags, LayoutKind, Superblock};

use crate::device::{
    Admission, BlockDevice, DeviceWrites, SealedAdmission, SealedBlock, SealedDevice, Submitted,
    ZeroFlags,
};
use crate::error::{Error, Fault, Result};
use crate::layout::Allocation;
use crate::options::{CreateOptions, OpenOptions};
use crate::snapshot::{RealFs, SnapshotFs};
use crate::volume::Volume;
use crate::BLOCK;

mod online;
pub mod resize;
pub use online::{OnlineBreaks, OnlineMigrate, YIELD_RATE};

/// The region record's file in the volume's directory.
pub const REGIONS_FILE: &str = "regions";
/// Blocks moved per read and write of a migration (1 MiB).
const CHUNK_BLOCKS: u64 = 256;

/// The layout that is not `kind`.
pub fn other_layout(kind: LayoutKind) -> LayoutKind {
    match kind {
        LayoutKind::Split => LayoutKind::Packed,
        LayoutKind::Packed => LayoutKind::Split,
    }
}

/// The other member's directory of a volume whose home layout is `home`.
pub fn member_path(path: &Path, home: LayoutKind) -> PathBuf {
    path.join(format!("layout.{}", other_layout(home).name()))
}

/// Does the superblock say the layout is chosen per region?
pub fn has_regions(superblock: &Superblock) -> bool {
    superblock.features.incompat & FeatureFlags::INCOMPAT_REGIONS != 0
}

fn io_error(action: &'static str, path: &Path, error: std::io::Error) -> Error {
    Error::Path {
        action,
        path: path.to_path_buf(),
        cause: error.to_string(),
    }
}

/// Where a volume with regions keeps its files: the snapshot code's file
/// operations (the record's write and fsync, the directories' syncs,
/// renames and removals) and its members' volumes. Production's is the
/// real filesystem (`real_fs`); the crash simulator's (`vouch-sim migrate
/// --power`) a model that keeps, through a power cut, only what was
/// synced, so that every file operation of a migration and of an open is
/// one it can cut.
pub trait RegionsFs: SnapshotFs + Send + Sync {
    /// Open the volume (a member) in directory `dir`.
    fn open_volume(&self, dir: &Path, options: &OpenOptions) -> Result<Volume>;
    /// Make a new volume in directory `dir` (which must not exist), its
    /// files and their directory entry durable when it returns.
    fn create_volume(&self, dir: &Path, options: &CreateOptions) -> Result<Volume>;
    /// The superblock of the volume in `dir`, read without opening it.
    fn superblock(&self, dir: &Path) -> Result<Superblock>;
    /// The lock of the volume in `dir`, taken for a read-only open to
    /// finish a resize cut short (`resize::finish`); `None` when another
    /// process holds it. A model filesystem has no other process.
    fn hold_for_writing(&self, _dir: &Path) -> Result<Option<Box<dyn std::any::Any>>> {
        Ok(Some(Box::new(())))
    }
}

impl RegionsFs for RealFs {
    fn open_volume(&self, dir: &Path, options: &OpenOptions) -> Result<Volume> {
        crate::open_volume(dir, options)
    }
    fn create_volume(&self, dir: &Path, options: &CreateOptions) -> Result<Volume> {
        crate::create_volume(dir, options)
    }
    fn superblock(&self, dir: &Path) -> Result<Superblock> {
        crate::volume_superblock(dir)
    }
    fn hold_for_writing(&self, dir: &Path) -> Result<Option<Box<dyn std::any::Any>>> {
        match crate::FileStorage::lock_for_writing(dir) {
            Ok(held) => Ok(Some(Box::new(held))),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(error) => Err(io_error("lock", dir, error)),
        }
    }
}

/// The real filesystem, for a volume with regions.
pub fn real_fs() -> Arc<dyn RegionsFs> {
    Arc::new(RealFs::new(false))
}

/// The record that holds for the home superblock `home` of the volume at
/// `path`. Missing, damaged or older than the superblock says: refused.
pub fn read_record(path: &Path, home: &Superblock) -> Result<RegionRecord> {
    read_record_in(&RealFs::new(false), path, home)
}

/// `read_record` in `fs`.
pub fn read_record_in(fs: &dyn RegionsFs, path: &Path, home: &Superblock) -> Result<RegionRecord> {
    let file = path.join(REGIONS_FILE);
    let bytes = match fs.read(&file) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(error) => return Err(io_error("read", &file, error)),
    };
    let blocks = home.size_bytes / BLOCK;
    RegionRecord::select(&bytes, home.uuid, blocks, home.regions_seq)
        .map_err(|error| Error::Corrupt(format!("regions: {error}")).in_volume(path))
}

fn being_resized(path: &Path) -> Error {
    Error::InvalidArgument(format!(
        "{} is being resized by another process: try again when it is done",
        path.display()
    ))
}

/// Write `record` into its copy (`seq % 2`) and fsync it: the switch.
fn write_record(
    fs: &dyn RegionsFs,
    path: &Path,
    record: &RegionRecord,
    steps: &Steps,
    breaks: &MigrateBreaks,
) -> Result<()> {
    let name = path.join(REGIONS_FILE);
    let regions = record.layouts.len() as u64;
    let offset = RegionRecord::copy_offset(regions, record.copy_index());
    steps.step();
    fs.write_at(&name, offset, &record.encode())
        .map_err(|error| io_error("write", &name, error))?;
    if breaks.skip_record_sync {
        return Ok(());
    }
    // On real files the write's descriptor is closed and the fsync opens
    // the file again: on Linux fsync flushes the inode whatever the
    // descriptor, and a writeback error not yet seen is reported to the
    // new one too (errseq, 4.16 and later).
    steps.step();
    fs.sync_file(&name)
        .map_err(|error| io_error("sync", &name, error))
}

/// A member's block status that did not cover `[lba, end)`: what it
/// holds there is unknown, so the migration stops rather than take the
/// rest for holes.
fn short_status(path: &Path, layout: LayoutKind, lba: u64, end: u64) -> Error {
    Error::Corrupt(format!(
        "migration stopped: the {} layout's block status did not cover LBAs {}-{} (a short reply); what it holds there is unknown, so nothing is taken for holes",
        layout.name(),
        lba,
        end - 1
    ))
    .in_volume(path)
}

fn sync_dir(fs: &dyn RegionsFs, path: &Path) -> Result<()> {
    fs.sync_dir(path)
        .map_err(|error| io_error("sync", path, error))
}

/// Open one member of a REGIONS volume (or the home of a volume about to
/// become one): a writable open takes the volume's lock.
fn open_member(fs: &dyn RegionsFs, path: &Path, options: &OpenOptions) -> Result<Volume> {
    fs.open_volume(
        path,
        &OpenOptions {
            region_member: true,
            ..options.clone()
        },
    )
}

/// An open REGIONS volume: both members and the record.
pub struct RegionVolume {
    path: PathBuf,
    home_layout: LayoutKind,
    /// Indexed by `LayoutKind as usize`.
    /// Shared so that a server can keep the home for its metrics.
    members: [Arc<Volume>; 2],
    record: RwLock<RegionRecord>,
    /// Its size in blocks (changed by an online resize:
    /// `RegionVolume::resize_online`).
    blocks: AtomicU64,
    /// Online migration's state: per-region locks, the region being moved
    /// and its chunks written meanwhile (`online`).
    online: online::Online,
    /// Where its files are (the record's switches go there).
    fs: Arc<dyn RegionsFs>,
}

/// One piece of a request: a byte range served by one member.
struct Piece {
    offset: u64,
    len: u64,
    layout: LayoutKind,
}

impl RegionVolume {
    /// Open the REGIONS volume at `path` (both members, each recovering
    /// from its journal). Refused when the record or a member is missing,
    /// damaged, older than the superblock says, or of another volume.
    pub fn open(path: &Path, options: &OpenOptions) -> Result<RegionVolume> {
        RegionVolume::open_in(
            real_fs(),
            path,
            options,
            &Steps::new(None),
            &MigrateBreaks::default(),
        )
    }

    /// `open` in `fs`, the record's catching up (`around`) counted in
    /// `steps` and broken as `breaks` say.
    pub fn open_in(
        fs: Arc<dyn RegionsFs>,
        path: &Path,
        options: &OpenOptions,
        steps: &Steps,
        breaks: &MigrateBreaks,
    ) -> Result<RegionVolume> {
        if options.read_only && resize::pending(&*fs, path) {
            // A resize cut short, finished or undone under the volume's
            // lock, taken for it (a read-only open does not hold it).
            let Some(_held) = fs.hold_for_writing(path)? else {
                return Err(being_resized(path));
            };
            if let Some(done) = resize::finish(&*fs, path)? {
                tracing::warn!(volume = %path.display(), "{done}");
            }
        }
        // The home first: its open takes the volume's lock, and everything
        // read after it (the flag, the record, the member) is read under it.
        let home = open_member(&*fs, path, options)?;
        RegionVolume::with_home_in(fs, path, home, options, steps, breaks)
    }

    /// The REGIONS volume at `path` around its home member `home`, already
    /// open (and so locked) by the caller.
    /// Refused (the home closed again) as `open` says.
    pub fn with_home(path: &Path, home: Volume, options: &OpenOptions) -> Result<RegionVolume> {
        RegionVolume::with_home_in(
            real_fs(),
            path,
            home,
            options,
            &Steps::new(None),
            &MigrateBreaks::default(),
        )
    }

    fn with_home_in(
        fs: Arc<dyn RegionsFs>,
        path: &Path,
        home: Volume,
        options: &OpenOptions,
        steps: &Steps,
        breaks: &MigrateBreaks,
    ) -> Result<RegionVolume> {
        let around = Self::around(&*fs, path, &home, options, steps, breaks);
        let (home_superblock, record, other) = match around {
            Ok(parts) => parts,
            Err(error) => {
                let _ = home.close();
                return Err(error);
            }
        };
        let home_layout = home_superblock.layout;
        let (home, other) = (Arc::new(home), Arc::new(other));
        let members = match home_layout {
            LayoutKind::Split => [home, other],
            LayoutKind::Packed => [other, home],
        };
        let regions = record.layouts.len();
        Ok(RegionVolume {
            path: path.to_path_buf(),
            home_layout,
            members,
            blocks: AtomicU64::new(home_superblock.size_bytes / BLOCK),
            record: RwLock::new(record),
            online: online::Online::new(regions),
            fs,
        })
    }

    /// The record and the other member of the REGIONS volume whose home
    /// `home` is open.
    fn around(
        fs: &dyn RegionsFs,
        path: &Path,
        home: &Volume,
        options: &OpenOptions,
        steps: &Steps,
        breaks: &MigrateBreaks,
    ) -> Result<(Superblock, RegionRecord, Volume)> {
        if resize::pending(fs, path) {
            // A resize cut short: finished or undone under the volume's
            // lock, which a writable home holds (a read-only open finished
            // it before its home opened, `open_in`).
            if home.is_read_only() {
                return Err(being_resized(path));
            }
            if let Some(done) = resize::finish(fs, path)? {
                tracing::warn!(volume = %path.display(), "{done}");
            }
        }
        let home_superblock = fs.superblock(path)?;
        if !has_regions(&home_superblock) {
            return Err(Error::InvalidArgument(format!(
                "{} has one layout ({}), not a layout per region",
                path.display(),
                home_superblock.layout.name()
            )));
        }
        let record = read_record_in(fs, path, &home_superblock)?;
        let home_layout = home_superblock.layout;
        let other_path = member_path(path, home_layout);
        let other_superblock = fs.superblock(&other_path).map_err(|error| {
            Error::Corrupt(format!(
                "the region record names a member that cannot be read: {error}"
            ))
            .in_volume(path)
        })?;
        if other_superblock.uuid != record.member_uuid
            || other_superblock.layout != other_layout(home_layout)
            || other_superblock.size_bytes != home_superblock.size_bytes
        {
            return Err(Error::Corrupt(format!(
                "{} is not the member the region record names (another volume's, or made again)",
                other_path.display()
            ))
            .in_volume(path));
        }
        let other = open_member(fs, &other_path, options)?;
        let mut record = record;
        if record.seq > home_superblock.regions_seq && !home.is_read_only() {
            // A switch whose superblock write did not happen (a crash, or
            // a failed write). Its record may be only in the page cache: a
            // failed fsync leaves the page there, clean, while the disk
            // may hold the older copy (review38 MED-1). So it is written
            // again, one newer, into the other copy and fsynced, and the
            // superblock caught up to that, before anything is served from
            // it (a torn write of it leaves the copy read, or refuses the
            // open: never the older layout silently).
            let caught_up = (|| -> Result<RegionRecord> {
                let mut again = record.clone();
                again.seq += 1;
                write_record(fs, path, &again, steps, breaks)?;
                steps.step();
                home.set_regions(again.seq)?;
                Ok(again)
            })();
            match caught_up {
                Ok(again) => record = again,
                Err(error) => {
                    let _ = other.close();
                    return Err(error);
                }
            }
        }
        Ok((home_superblock, record, other))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn home_layout(&self) -> LayoutKind {
        self.home_layout
    }

    /// The member of layout `kind`.
    pub fn member(&self, kind: LayoutKind) -> &Volume {
        &self.members[kind as usize]
    }

    /// The home member (the volume's directory).
    pub fn home(&self) -> &Volume {
        self.member(self.home_layout)
    }

    /// The home member, shared (a server's metrics and description).
    pub fn home_shared(&self) -> Arc<Volume> {
        Arc::clone(&self.members[self.home_layout as usize])
    }

    pub fn record(&self) -> RegionRecord {
        self.record.read().clone()
    }

    pub fn size(&self) -> u64 {
        self.blocks() * BLOCK
    }

    pub fn blocks(&self) -> u64 {
        self.blocks.load(Ordering::Acquire)
    }

    /// The layout serving `lba`: one lookup.
    /// The record's `seq` now: it rises with every switch of a region.
    pub fn record_seq(&self) -> u64 {
        self.record.read().seq
    }

    pub fn layout_of(&self, lba: u64) -> LayoutKind {
        let record = self.record.read();
        record.layouts[record.region_of(lba)]
    }

    /// `[offset, offset + len)` cut where the serving layout changes.
    fn pieces(&self, offset: u64, len: u64) -> Vec<Piece> {
        let record = self.record.read();
        let region_bytes = record.region_blocks * BLOCK;
        let end = offset + len;
        let mut pieces: Vec<Piece> = Vec::with_capacity(1);
        let mut at = offset;
        while at < end {
            let region = (at / region_bytes) as usize;
            let piece_end = ((region as u64 + 1) * region_bytes).min(end);
            let layout = record.layouts[region];
            match pieces.last_mut() {
                Some(last) if last.layout == layout => last.len += piece_end - at,
                _ => pieces.push(Piece {
                    offset: at,
                    len: piece_end - at,
                    layout,
                }),
            }
            at = piece_end;
        }
        pieces
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                offset,
                length: len,
                size,
            });
        }
        Ok(())
    }

    /// `f(member, offset, len)` for each piece of `[offset, offset + len)`,
    /// checked in range first.
    fn each_piece(
        &self,
        offset: u64,
        len: u64,
        f: impl FnMut(&Volume, u64, u64) -> Result<()>,
    ) -> Result<()> {
        self.check_range(offset, len)?;
        self.pieces_held(offset, len, false, f)
    }

    /// `each_piece` for a write, trim or zeroing: the regions it touches
    /// moved first under `--migrate-on-write`, its chunks marked after it
    /// returned if its region is moving (`online`).
    fn each_piece_written(
        &self,
        offset: u64,
        len: u64,
        f: impl FnMut(&Volume, u64, u64) -> Result<()>,
    ) -> Result<()> {
        self.check_range(offset, len)?;
        self.check_fence()?;
        self.move_for_write(offset, len);
        self.pieces_held(offset, len, true, f)
    }

    /// The pieces run with their regions' locks held shared; `written`:
    /// refused if the fence went up while it waited for them (a switch
    /// that failed under the lock it waited on: review38 HIGH-1), and
    /// marked (still under the locks) once every piece returned.
    fn pieces_held(
        &self,
        offset: u64,
        len: u64,
        written: bool,
        mut f: impl FnMut(&Volume, u64, u64) -> Result<()>,
    ) -> Result<()> {
        let _held = self.hold(offset, len);
        if written {
            self.check_fence()?;
        }
        for piece in self.pieces(offset, len) {
            f(self.member(piece.layout), piece.offset, piece.len)?;
        }
        if written {
            self.written(offset, len);
        }
        Ok(())
    }

    /// Read `buf.len()` bytes at `offset`, each block verified by the
    /// member serving it. Returns the holes, as byte ranges of `buf`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        let mut holes = Vec::new();
        self.each_piece(offset, buf.len() as u64, |member, at, len| {
            let from = at - offset;
            let part = &mut buf[from as usize..(from + len) as usize];
            holes.extend(
                member
                    .read(at, part)?
                    .into_iter()
                    .map(|hole| hole.start + from..hole.end + from),
            );
            Ok(())
        })?;
        Ok(holes)
    }

    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.write_bytes(offset, &bytes::Bytes::copy_from_slice(data), fua)
    }

    /// `write` of bytes each member may keep (its piece, not a copy).
    pub fn write_bytes(&self, offset: u64, data: &bytes::Bytes, fua: bool) -> Result<()> {
        self.each_piece_written(offset, data.len() as u64, |member, at, len| {
            let from = (at - offset) as usize;
            member.write_bytes(at, &data.slice(from..from + len as usize), fua)
        })
    }

    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.each_piece_written(offset, len, |member, at, len| member.trim(at, len, fua))
    }

    pub fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.each_piece_written(offset, len, |member, at, len| {
            member.write_zeroes(at, len, flags)
        })
    }

    /// Both members' writes durable.
    pub fn flush(&self) -> Result<()> {
        for member in &self.members {
            member.flush()?;
        }
        Ok(())
    }

    /// Each member's write-back buffer committed and its journal
    /// checkpointed now (`Volume::checkpoint_now`): run before an online
    /// snapshot's flush point, so the hold has only what came since.
    pub fn checkpoint_now(&self) -> Result<()> {
        for member in &self.members {
            member.checkpoint_now()?;
        }
        Ok(())
    }

    /// Whole blocks; faulty blocks zero-filled and listed (export, scans).
    pub fn read_blocks_collecting(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
    ) -> Result<Vec<Fault>> {
        let mut faults = Vec::new();
        let _held = self.hold(first * BLOCK, count * BLOCK);
        for piece in self.pieces(first * BLOCK, count * BLOCK) {
            let from = (piece.offset - first * BLOCK) as usize;
            let part = &mut out[from..from + piece.len as usize];
            faults.extend(self.member(piece.layout).read_blocks_collecting(
                piece.offset / BLOCK,
                piece.len / BLOCK,
                part,
            )?);
        }
        Ok(faults)
    }

    /// `block_status` with the regions held by the caller: the runs of
    /// the piece holding `offset` only.
    fn status_held(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        let Some(piece) = self.pieces(offset, length.max(1)).into_iter().next() else {
            return Ok(Vec::new());
        };
        let piece_blocks = (piece.offset + piece.len).div_ceil(BLOCK) - piece.offset / BLOCK;
        self.member(piece.layout).block_status(
            piece.offset,
            piece.len,
            max_blocks.min(piece_blocks),
        )
    }

    /// Close both members (flush, checkpoint, clean). Every `home_shared`
    /// clone must be dropped first.
    pub fn close(self) -> Result<()> {
        let unshared = |member: Arc<Volume>| {
            Arc::try_unwrap(member).map_err(|_| {
                Error::InvalidArgument("a member of a volume with regions is still in use".into())
            })
        };
        let [first, second] = self.members;
        let closed = unshared(first).and_then(Volume::close);
        unshared(second).and_then(Volume::close)?;
        closed
    }

    /// Does `layout`'s member hold anything (data, zeroes, or metadata)
    /// in `[start, end)`?
    fn holds_any(&self, layout: LayoutKind, start: u64, end: u64) -> Result<bool> {
        let member = self.member(layout);
        let mut lba = start;
        while lba < end {
            let runs = member.block_status(lba * BLOCK, (end - lba) * BLOCK, end - lba)?;
            if runs.iter().all(|(blocks, _)| *blocks == 0) {
                // A reply covering nothing is not "all holes".
                return Err(short_status(&self.path, layout, lba, end));
            }
            for (blocks, allocation) in runs {
                if allocation != Allocation::Hole {
                    return Ok(true);
                }
                lba += blocks;
            }
        }
        Ok(false)
    }

    /// The release pass: trim, in each member, every region it does not
    /// serve that still holds something there (left by a migration cut
    /// short). Returns how many were trimmed.
    fn release_unserved(&self, steps: &Steps) -> Result<u64> {
        let record = self.record();
        let mut released = 0;
        for (index, serving) in record.layouts.iter().enumerate() {
            let lbas = record.lbas(index, self.blocks());
            let unserved = other_layout(*serving);
            if self.holds_any(unserved, lbas.start, lbas.end)? {
                let member = self.member(unserved);
                steps.step();
                member.trim(lbas.start * BLOCK, (lbas.end - lbas.start) * BLOCK, false)?;
                released += 1;
            }
        }
        if released > 0 {
            for member in &self.members {
                steps.step();
                member.flush()?;
            }
        }
        Ok(released)
    }

    /// Copy `range` (LBAs within region `lbas`) from `from`'s member to
    /// `target`'s, 1 MiB at a time: each block read and verified in the
    /// old member (a fault stops it, naming the LBA), written to the new
    /// unflushed; holes stay holes, zeroes stay zeroes. `progress(bytes)`
    /// after each chunk.
    #[allow(clippy::too_many_arguments)]
    fn copy_range(
        &self,
        from: LayoutKind,
        target: LayoutKind,
        range: Range<u64>,
        lbas: &Range<u64>,
        breaks: &MigrateBreaks,
        steps: &Steps,
        progress: &mut dyn FnMut(u64),
    ) -> Result<()> {
        let (old, new) = (self.member(from), self.member(target));
        let mut buf = vec![0u8; (CHUNK_BLOCKS * BLOCK) as usize];
        let mut lba = range.start;
        while lba < range.end {
            let chunk_end = (lba + CHUNK_BLOCKS).min(range.end);
            let asked = if breaks.short_status {
                (chunk_end - lba).div_ceil(2)
            } else {
                chunk_end - lba
            };
            let runs = old.block_status(lba * BLOCK, asked * BLOCK, asked)?;
            let mut at = lba;
            for (blocks, allocation) in runs {
                let blocks = blocks.min(chunk_end - at);
                match allocation {
                    Allocation::Hole => {}
                    Allocation::Zero => {
                        steps.step();
                        new.write_zeroes(
                            at * BLOCK,
                            blocks * BLOCK,
                            ZeroFlags {
                                fua: false,
                                allocate: true,
                            },
                        )?
                    }
                    Allocation::Data => {
                        let part = &mut buf[..(blocks * BLOCK) as usize];
                        let faults = old.read_blocks_collecting(at, blocks, part)?;
                        if let Some(fault) = faults.first() {
                            return Err(Error::Corrupt(format!(
                                "migration stopped: LBA {} failed verification in the {} layout ({}); nothing of its region (LBAs {}-{}) was moved, the regions before it were (repair the block, or restore it, and run the migration again)",
                                fault.lba,
                                from.name(),
                                fault.kind.name(),
                                lbas.start,
                                lbas.end - 1
                            ))
                            .in_volume(&self.path));
                        }
                        if breaks.corrupt_new_copy && at == lbas.start {
                            part[0] ^= 1;
                        }
                        steps.step();
                        new.write(at * BLOCK, part, false)?;
                    }
                }
                at += blocks;
                if at >= chunk_end {
                    break;
                }
            }
            if at < chunk_end {
                // A short reply: the rest is unknown, never read as holes
                // (it would be left behind, then trimmed from the old).
                return Err(short_status(&self.path, from, at, chunk_end));
            }
            progress((chunk_end - lba) * BLOCK);
            lba = chunk_end;
        }
        Ok(())
    }

    /// The whole region `lbas` copied from `from`'s member to `target`'s,
    /// which does not serve it: first cleared of what an earlier cut run
    /// left there.
    fn copy_region(
        &self,
        from: LayoutKind,
        target: LayoutKind,
        lbas: &Range<u64>,
        breaks: &MigrateBreaks,
        steps: &Steps,
        progress: &mut dyn FnMut(u64),
    ) -> Result<()> {
        steps.step();
        self.member(target)
            .trim(lbas.start * BLOCK, (lbas.end - lbas.start) * BLOCK, false)?;
        self.copy_range(from, target, lbas.clone(), lbas, breaks, steps, progress)
    }

    /// Move region `index` to `target` (CRASH_MODEL, "Migration between
    /// layouts"): read and verify it in the member serving it, write it to
    /// `target`'s, flush that, switch the record, then trim the old.
    fn migrate_region(
        &self,
        index: usize,
        target: LayoutKind,
        breaks: &MigrateBreaks,
        steps: &Steps,
        mut progress: impl FnMut(u64),
    ) -> Result<()> {
        let record = self.record();
        let from = record.layouts[index];
        let lbas = record.lbas(index, self.blocks());
        let (old, new) = (self.member(from), self.member(target));
        self.copy_region(from, target, &lbas, breaks, steps, &mut progress)?;
        let release = || -> Result<()> {
            steps.step();
            old.trim(lbas.start * BLOCK, (lbas.end - lbas.start) * BLOCK, false)?;
            steps.step();
            old.flush()
        };
        if !breaks.switch_before_flush {
            steps.step();
            new.flush()?;
        }
        if breaks.release_before_switch {
            release()?;
        }
        let mut next = record;
        next.layouts[index] = target;
        next.seq += 1;
        write_record(&*self.fs, &self.path, &next, steps, breaks)?;
        steps.step();
        self.home().set_regions(next.seq)?;
        *self.record.write() = next;
        if breaks.switch_before_flush {
            steps.step();
            new.flush()?;
        }
        if breaks.release_before_switch {
            return Ok(());
        }
        release()
    }
}

/// Deliberate breaks of the migration's order, for the crash simulator's
/// self-test (each must be caught), and its crash point.
#[derive(Clone, Copy, Debug, Default)]
pub struct MigrateBreaks {
    /// Abort the process (a crash: no close, nothing more written) right
    /// before the migration's `n`th file operation, counted from 1
    /// (`vouch-sim migrate`).
    pub crash_at: Option<u64>,
    /// Trim the region in the old member before switching the record.
    pub release_before_switch: bool,
    /// Switch the record before the new member is flushed.
    pub switch_before_flush: bool,
    /// Change a byte of the first block of each region as it is written
    /// to the new member (a migration that copies wrong).
    pub corrupt_new_copy: bool,
    /// Ask the old member's block status for only the first half of each
    /// chunk: a reply that covers less than the chunk (NBD allows it).
    pub short_status: bool,
    /// Skip the record's fsync after its write (a switch, or an open's
    /// catching up), before the superblock's `regions_seq` names it.
    pub skip_record_sync: bool,
    /// Skip the directory syncs of making a volume one with regions: the
    /// member's rename and the record's entry not durable before the
    /// home's flag.
    pub skip_dir_sync: bool,
}

/// What the crash simulator runs at each step of an online move: a
/// foreground request arriving there. Its argument says whether the
/// region's lock is held exclusive (a request would wait: none is sent).
pub type StepHook = Box<dyn Fn(bool) + Send + Sync>;

/// The migration's file operations, counted: `step` aborts the process
/// at `MigrateBreaks::crash_at`.
pub struct Steps {
    crash_at: Option<u64>,
    taken: std::sync::atomic::AtomicU64,
    /// The simulator's foreground request, before each step.
    hook: Option<StepHook>,
    /// An online move holds its region's lock exclusive.
    locked: std::sync::atomic::AtomicBool,
}

impl Steps {
    pub fn new(crash_at: Option<u64>) -> Steps {
        Steps {
            crash_at,
            taken: std::sync::atomic::AtomicU64::new(0),
            hook: None,
            locked: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// `hook` run right before each step (before the crash, if there).
    pub fn with_hook(crash_at: Option<u64>, hook: StepHook) -> Steps {
        Steps {
            hook: Some(hook),
            ..Steps::new(crash_at)
        }
    }

    fn set_locked(&self, locked: bool) {
        self.locked
            .store(locked, std::sync::atomic::Ordering::SeqCst);
    }

    /// Called right before each file operation.
    fn step(&self) {
        if let Some(hook) = &self.hook {
            hook(self.locked.load(std::sync::atomic::Ordering::SeqCst));
        }
        let taken = self
            .taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if self.crash_at == Some(taken) {
            std::process::abort();
        }
    }

    fn taken(&self) -> u64 {
        self.taken.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// What a migration did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigrateReport {
    /// Regions moved to the target layout.
    pub moved: u64,
    /// Regions that were in it already.
    pub already: u64,
    /// Regions the release pass trimmed in a member not serving them.
    pub released: u64,
    /// File operations it issued (the crash points `crash_at` counts).
    pub steps: u64,
}

/// Make a single-layout volume a REGIONS volume (every region in its home
/// layout): the other member made and renamed into place, the record
/// written, then the home superblock's flag (CRASH_MODEL, "Migration
/// between layouts"). Returns the member's path.
///
/// `opened` is the home, open writable: its lock is held from before the
/// superblock was read until the flag is set, so a second `migrate` (or a
/// server) can neither see the volume without the flag while the member is
/// being made nor remove it (M1 of the migrate33 review).
fn make_regions(
    fs: &dyn RegionsFs,
    path: &Path,
    opened: &Volume,
    options: &OpenOptions,
    (steps, breaks): (&Steps, &MigrateBreaks),
) -> Result<()> {
    let home = &fs.superblock(path)?;
    if has_regions(home) {
        return Ok(());
    }
    let member = member_path(path, home.layout);
    let name = member
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or("layout")
        .to_string();
    let partial = path.join(format!(".{name}.partial"));
    // Without the home flag nothing names these: left by a crash (or by
    // `unmake_regions` cut short). An old record must go too: a copy of
    // it with a higher seq would win over the new one.
    for leftover in [&partial, &member] {
        if fs.exists(leftover) {
            steps.step();
            fs.remove_all(leftover)
                .map_err(|error| io_error("remove", leftover, error))?;
        }
    }
    let record_file = path.join(REGIONS_FILE);
    if fs.exists(&record_file) {
        steps.step();
        fs.remove_file(&record_file)
            .map_err(|error| io_error("remove", &record_file, error))?;
    }
    let encrypted = home.features.incompat & FeatureFlags::INCOMPAT_ENCRYPTED != 0;
    if encrypted && options.key.is_none() {
        // The member would be made unencrypted beside an encrypted home.
        return Err(Error::InvalidArgument(format!(
            "{} is encrypted and no key was given: `vouch migrate` needs its key to make the other layout's member",
            path.display()
        )));
    }
    let create = CreateOptions {
        layout: other_layout(home.layout),
        guard: home.guard,
        encrypt: if encrypted { options.key.clone() } else { None },
        journal_bytes: Some(home.journal_bytes),
        ..CreateOptions::new(home.size_bytes)
    };
    steps.step();
    let made = fs.create_volume(&partial, &create)?;
    steps.step();
    made.set_regions(0)?;
    made.close()?;
    steps.step();
    sync_dir(fs, &partial)?;
    steps.step();
    fs.rename(&partial, &member)
        .map_err(|error| io_error("rename", &partial, error))?;
    if !breaks.skip_dir_sync {
        steps.step();
        sync_dir(fs, path)?;
    }
    let member_uuid = fs.superblock(&member)?.uuid;
    let record =
        RegionRecord::uniform(home.uuid, member_uuid, home.size_bytes / BLOCK, home.layout);
    write_record(fs, path, &record, steps, breaks)?;
    if !breaks.skip_dir_sync {
        steps.step();
        sync_dir(fs, path)?;
    }
    steps.step();
    opened.set_regions(record.seq)
}

/// A server's volume that may migrate online (`serve --migratable`,
/// `--migrate-on-write`): the volume at `path`, whose home `home` the
/// server opened writable (so holds), as a REGIONS volume, made one
/// first (every region in its home layout) if it is not.
pub fn open_served(path: &Path, home: Volume, options: &OpenOptions) -> Result<RegionVolume> {
    let fs = RealFs::new(false);
    let none = (&Steps::new(None), &MigrateBreaks::default());
    if let Err(error) = make_regions(&fs, path, &home, options, none) {
        let _ = home.close();
        return Err(error);
    }
    RegionVolume::with_home(path, home, options)
}

/// Every region is back in the home layout: clear the home flag (its
/// superblock, fsynced: from then on the home member is the volume), then
/// remove the record and the other member, and only then close the home
/// (MED-2 of the regions review: its lock is held until the member is
/// gone, so a server or a second `migrate` that opens the volume meanwhile
/// waits, rather than making a member of its own that this removal would
/// delete under it). The volume was closed by the migration and is opened
/// again here: a failure of that open fails the `migrate` (rerun it: the
/// regions are all home, nothing is lost), it never removes anything.
fn unmake_regions(
    fs: &dyn RegionsFs,
    path: &Path,
    home_layout: LayoutKind,
    options: &OpenOptions,
    steps: &Steps,
) -> Result<()> {
    let home = open_member(fs, path, options)?;
    let removed = (|| -> Result<()> {
        steps.step();
        home.clear_regions()?;
        let record_file = path.join(REGIONS_FILE);
        steps.step();
        fs.remove_file(&record_file)
            .map_err(|error| io_error("remove", &record_file, error))?;
        let member = member_path(path, home_layout);
        steps.step();
        fs.remove_all(&member)
            .map_err(|error| io_error("remove", &member, error))?;
        steps.step();
        sync_dir(fs, path)
    })();
    let closed = home.close();
    removed?;
    closed
}

/// `vouch migrate PATH --layout TARGET`, offline: every region not in
/// `target` moved to it, in LBA order. `progress(done, total)` in bytes.
pub fn migrate(
    path: &Path,
    target: LayoutKind,
    options: &OpenOptions,
    breaks: &MigrateBreaks,
    progress: impl FnMut(u64, u64),
) -> Result<MigrateReport> {
    migrate_driven(
        path,
        target,
        options,
        breaks,
        &Steps::new(breaks.crash_at),
        progress,
    )
}

/// `migrate` with the caller's steps (a hook before each file operation:
/// a test's second opener). `breaks.crash_at` is the steps'.
pub fn migrate_driven(
    path: &Path,
    target: LayoutKind,
    options: &OpenOptions,
    breaks: &MigrateBreaks,
    steps: &Steps,
    progress: impl FnMut(u64, u64),
) -> Result<MigrateReport> {
    let how = Migrate {
        target,
        options,
        breaks,
        steps,
    };
    migrate_in(real_fs(), path, &how, progress)
}

/// What `migrate_in` does: to which layout, opened how, broken how (the
/// simulator's), its steps.
pub struct Migrate<'a> {
    pub target: LayoutKind,
    pub options: &'a OpenOptions,
    pub breaks: &'a MigrateBreaks,
    pub steps: &'a Steps,
}

/// `migrate_driven` of the volume at `path` in `fs`.
pub fn migrate_in(
    fs: Arc<dyn RegionsFs>,
    path: &Path,
    how: &Migrate<'_>,
    mut progress: impl FnMut(u64, u64),
) -> Result<MigrateReport> {
    crate::snapshot::refuse_while_materialising(
        &crate::snapshot::RealFs::default(),
        path,
        "migrate it",
    )?;
    let Migrate {
        target,
        options,
        breaks,
        steps,
    } = *how;
    let home = fs.superblock(path)?;
    if home.features.ro_compat & FeatureFlags::RO_COMPAT_SNAPSHOT != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} is a snapshot: it keeps the layout it was taken in",
            path.display()
        )));
    }
    let blocks = home.size_bytes / BLOCK;
    // The home opened (and locked) before anything is decided or made.
    let opened = open_member(&*fs, path, options)?;
    let home = fs.superblock(path)?;
    if !has_regions(&home) {
        if home.layout == target {
            opened.close()?;
            return Ok(MigrateReport {
                already: vouch_format::regions::regions_of(blocks),
                ..MigrateReport::default()
            });
        }
        if let Err(error) = make_regions(&*fs, path, &opened, options, (steps, breaks)) {
            let _ = opened.close();
            return Err(error);
        }
    }
    let volume = RegionVolume::with_home_in(Arc::clone(&fs), path, opened, options, steps, breaks)?;
    let result = (|| {
        let released = volume.release_unserved(steps)?;
        let record = volume.record();
        let to_move: Vec<usize> = (0..record.layouts.len())
            .filter(|index| record.layouts[*index] != target)
            .collect();
        let total: u64 = to_move
            .iter()
            .map(|index| {
                let lbas = record.lbas(*index, blocks);
                (lbas.end - lbas.start) * BLOCK
            })
            .sum();
        let mut done = 0;
        progress(0, total);
        for index in &to_move {
            volume.migrate_region(*index, target, breaks, steps, |bytes| {
                done += bytes;
                progress(done, total);
            })?;
        }
        Ok(MigrateReport {
            moved: to_move.len() as u64,
            already: record.layouts.len() as u64 - to_move.len() as u64,
            released,
            steps: steps.taken(),
        })
    })();
    let home_layout = volume.home_layout();
    let closed = volume.close();
    let mut report = result?;
    closed?;
    if target == home_layout {
        unmake_regions(&*fs, path, home_layout, options, steps)?;
        report.steps = steps.taken();
    }
    Ok(report)
}

/// The volume a server exports: each request cut where the serving layout
/// changes and each piece passed to the member serving it (a write across
/// two regions goes to both; a flush flushes both). Crash ordering is each
/// member's own: a piece returns once its member holds it by that
/// member's rules (durable against a process crash before it returns), so
/// a write is acknowledged only after every piece is; a power cut loses
/// the unflushed pieces of either member, as of one volume, and a flush
/// returns after both members' flushes. One fast path: a read within
/// one member runs inline when that member's `try_read` can (the page
/// cache), its regions held without waiting (declined while a move holds
/// one exclusive); writes and the ring's reads take the waiting path.
impl BlockDevice for RegionVolume {
    fn size(&self) -> u64 {
        RegionVolume::size(self)
    }

    fn is_read_only(&self) -> bool {
        self.members.iter().any(|member| member.is_read_only())
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        RegionVolume::read(self, offset, buf)
    }

    /// Inline when the read lies in one member and that member can (see
    /// the impl's comment); declines with nothing counted otherwise.
    fn try_read(&self, offset: u64, buf: &mut [u8]) -> Result<Option<Vec<Range<u64>>>> {
        let len = buf.len() as u64;
        if self.check_range(offset, len).is_err() {
            return Ok(None);
        }
        let Some(_held) = self.try_hold(offset, len) else {
            return Ok(None);
        };
        let layout = {
            let Some(record) = self.record.try_read() else {
                return Ok(None);
            };
            let region_bytes = record.region_blocks * BLOCK;
            let (first, last) = (
                offset / region_bytes,
                (offset + len.max(1) - 1) / region_bytes,
            );
            let layout = record.layouts[first as usize];
            if (first..=last).any(|region| record.layouts[region as usize] != layout) {
                return Ok(None);
            }
            layout
        };
        self.member(layout).try_read(offset, buf)
    }

    /// Only the waiting route: a write may span regions of two layouts.
    fn submit_write(
        &self,
        offset: u64,
        data: &bytes::Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        if admission != Admission::MayWait {
            return Ok(Submitted::Declined);
        }
        RegionVolume::write_bytes(self, offset, data, fua)?;
        Ok(Submitted::Done)
    }

    fn flush(&self) -> Result<()> {
        RegionVolume::flush(self)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        RegionVolume::trim(self, offset, length, fua)
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        RegionVolume::write_zeroes(self, offset, length, flags)
    }

    /// The runs of the piece holding `offset` only (a shorter reply than
    /// asked, as the trait allows: the caller asks again from its end).
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.check_range(offset, length)?;
        let _held = self.hold(offset, length);
        self.status_held(offset, length, max_blocks)
    }

    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        RegionVolume::read_blocks_collecting(self, first, count, out)
    }
}

/// The sealed face, each block moved through the member serving it.
impl SealedDevice for RegionVolume {
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        self.check_range(first * BLOCK, count * BLOCK)?;
        let mut blocks = Vec::with_capacity(count as usize);
        let _held = self.hold(first * BLOCK, count * BLOCK);
        for piece in self.pieces(first * BLOCK, count * BLOCK) {
            blocks.extend(
                self.member(piece.layout)
                    .read_sealed(piece.offset / BLOCK, piece.len / BLOCK)?,
            );
        }
        Ok(blocks)
    }

    /// Each member's blocks in one call: all-or-nothing within a member,
    /// not across the two. Only the waiting admissions (passed on to the
    /// members); the others are declined (no room is reserved here, no
    /// write travels).
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> Result<Submitted> {
        match admission {
            SealedAdmission::MayWait | SealedAdmission::Here => {}
            SealedAdmission::Reserved => {
                return Err(Error::Unsupported("writes into reserved room".into()))
            }
            SealedAdmission::MustNotWait | SealedAdmission::Callback => {
                return Ok(Submitted::Declined)
            }
        }
        let (Some(first), Some(last)) = (
            blocks.iter().map(|block| block.lba).min(),
            blocks.iter().map(|block| block.lba).max(),
        ) else {
            return Ok(Submitted::Done);
        };
        let span = (last + 1 - first) * BLOCK;
        self.check_range(first * BLOCK, span)?;
        self.check_fence()?;
        self.move_for_write(first * BLOCK, span);
        let _held = self.hold(first * BLOCK, span);
        self.check_fence()?;
        for layout in [LayoutKind::Split, LayoutKind::Packed] {
            let mine: Vec<SealedBlock> = blocks
                .iter()
                .filter(|block| self.layout_of(block.lba) == layout)
                .cloned()
                .collect();
            if !mine.is_empty() {
                self.member(layout)
                    .submit_sealed(&mine, false, admission)?
                    .wait()?;
            }
        }
        for block in blocks {
            self.written(block.lba * BLOCK, BLOCK);
        }
        if fua {
            self.flush()?;
        }
        Ok(Submitted::Done)
    }
}
