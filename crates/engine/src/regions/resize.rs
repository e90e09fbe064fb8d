//! `vouch resize` of a volume with regions (docs/CRASH_MODEL.md, "Resize
//! of a volume with regions"): both members resized, and the region
//! record when the region count changes. Beside `resize.rs`, which
//! resizes each member as the one volume it is.
//!
//! The home member's superblock is the switch, as it is for a one-layout
//! volume. Everything the new size needs is durable before it:
//! 1. the other member (`layout.NAME/`) resized to the new size (by
//!    `resize::resize_volume`: its own crash ordering);
//! 2. when the region count changes, the record of the new count in
//!    `regions.resize` (the layouts as they are, new regions in the home
//!    layout, the same `seq` in the copy it indexes), fsynced, and the
//!    directory;
//! 3. the home member resized (its superblock's size is the switch);
//! 4. `regions.resize` renamed over `regions`, the directory fsynced.
//!
//! A crash anywhere leaves the home at the old size or the new one. The
//! next open of the volume (or resize) runs `finish` first, under the
//! home's lock: `regions.resize` is kept when it is the record of the
//! size the home says and removed otherwise, and the other member is
//! resized to the home's size when it has another (grown back over a
//! tail a shrink had found unwritten, or cut back to a tail a grow had
//! just made): the home's size is the volume's, and no member is served
//! at a size the other lacks.

use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vouch_format::regions::{regions_of, RegionRecord, REGION_BLOCKS};

use super::{has_regions, member_path, RegionVolume, REGIONS_FILE};
use crate::device::BlockDevice as _;
use crate::error::{Error, Result};
use crate::resize::{resize_volume, Allowed, ResizeBreaks, Resized};
use crate::snapshot::{io_error, superblock_of, SnapshotFs};
use crate::storage::Storage;
use crate::volume::{OnlineResized, Reopen, ResizeSteps};
use crate::BLOCK;

/// The record of the new region count, until the home's switch is
/// followed by its rename over `regions`.
pub const RESIZE_RECORD_FILE: &str = "regions.resize";

/// Is a resize of the volume with regions at `path` cut short (the
/// record of another count waiting, or the members' sizes differing)?
/// A member that cannot be read is not: the open says why.
pub fn pending(fs: &dyn SnapshotFs, path: &Path) -> bool {
    if fs.exists(&path.join(RESIZE_RECORD_FILE)) {
        return true;
    }
    let Ok(home) = superblock_of(fs, path) else {
        return false;
    };
    superblock_of(fs, &member_path(path, home.layout))
        .is_ok_and(|other| other.size_bytes != home.size_bytes)
}

/// Finish what a resize of the volume with regions at `path` cut short
/// (see the module). Needs the volume's lock. Returns what it did.
pub fn finish(fs: &dyn SnapshotFs, path: &Path) -> Result<Option<String>> {
    let mut done = Vec::new();
    if let Some(did) = crate::resize::finish(fs, path)? {
        done.push(did);
    }
    let home = superblock_of(fs, path)?;
    if !has_regions(&home) {
        return Ok(None);
    }
    let pending = path.join(RESIZE_RECORD_FILE);
    if fs.exists(&pending) {
        let bytes = fs
            .read(&pending)
            .map_err(|e| io_error("read", &pending, e))?;
        let blocks = home.size_bytes / BLOCK;
        if RegionRecord::select(&bytes, home.uuid, blocks, home.regions_seq).is_ok() {
            let record = path.join(REGIONS_FILE);
            fs.rename(&pending, &record)
                .map_err(|e| io_error("rename", &pending, e))?;
            done.push(format!(
                "the region record of {} regions put in place",
                regions_of(blocks)
            ));
        } else {
            fs.remove_file(&pending)
                .map_err(|e| io_error("remove", &pending, e))?;
            done.push("the region record of an unfinished size removed".into());
        }
        fs.sync_dir(path).map_err(|e| io_error("sync", path, e))?;
    }
    let member = member_path(path, home.layout);
    if let Some(did) = crate::resize::finish(fs, &member)? {
        done.push(format!("{}: {did}", member.display()));
    }
    if let Ok(other) = superblock_of(fs, &member) {
        if other.size_bytes != home.size_bytes {
            resize_volume(
                fs,
                &member,
                home.size_bytes,
                ResizeBreaks::default(),
                Allowed::MEMBER,
            )?;
            done.push(format!(
                "the {} member resized from {} to the volume's {} bytes",
                other.layout.name(),
                other.size_bytes,
                home.size_bytes
            ));
        }
    }
    Ok((!done.is_empty()).then(|| {
        format!(
            "finished or undid an interrupted resize ({})",
            done.join("; ")
        )
    }))
}

/// Resize the volume with regions at `path`, closed cleanly and held by
/// the caller, to `new_bytes` (see the module). A shrink must have been
/// checked by the caller over the volume (its region layer: what serves
/// each region); the other member's copy of a region it does not serve
/// is cut with it.
pub(crate) fn resize(
    fs: &dyn SnapshotFs,
    path: &Path,
    new_bytes: u64,
    breaks: ResizeBreaks,
) -> Result<Resized> {
    if let Some(done) = finish(fs, path)? {
        tracing::info!(volume = %path.display(), "{done}");
    }
    let home = superblock_of(fs, path)?;
    crate::resize::refuse(fs, path, &home, Allowed::MEMBER)?;
    let member = member_path(path, home.layout);
    let other = superblock_of(fs, &member)?;
    let (old_blocks, new_blocks) = (home.size_bytes / BLOCK, new_bytes / BLOCK);
    let record_file = path.join(REGIONS_FILE);
    let bytes = fs
        .read(&record_file)
        .map_err(|e| io_error("read", &record_file, e))?;
    let record = RegionRecord::select(&bytes, home.uuid, old_blocks, home.regions_seq)
        .map_err(|error| Error::Corrupt(format!("regions: {error}")).in_volume(path))?;
    if other.uuid != record.member_uuid || other.size_bytes != home.size_bytes {
        return Err(Error::Corrupt(format!(
            "{} is not the member the region record names, or not of the volume's size: not resized",
            member.display()
        ))
        .in_volume(path));
    }
    if new_blocks == old_blocks {
        return Ok(Resized {
            old_bytes: home.size_bytes,
            new_bytes,
        });
    }
    resize_volume(fs, &member, new_bytes, breaks, Allowed::MEMBER)?;
    if breaks.stop_after_member {
        return Err(stopped("stop_after_member"));
    }
    let pending = path.join(RESIZE_RECORD_FILE);
    let new_regions = regions_of(new_blocks);
    let recount = new_regions != regions_of(old_blocks);
    if recount {
        let mut next = record.clone();
        next.layouts.resize(new_regions as usize, home.layout);
        let len = 2 * RegionRecord::copy_bytes(new_regions);
        fs.set_len(&pending, len)
            .map_err(|e| io_error("create", &pending, e))?;
        fs.write_at(
            &pending,
            RegionRecord::copy_offset(new_regions, next.copy_index()),
            &next.encode(),
        )
        .map_err(|e| io_error("write", &pending, e))?;
        fs.sync_file(&pending)
            .map_err(|e| io_error("sync", &pending, e))?;
        fs.sync_dir(path).map_err(|e| io_error("sync", path, e))?;
        if breaks.stop_after_record {
            return Err(stopped("stop_after_record"));
        }
    }
    let resized = resize_volume(fs, path, new_bytes, breaks, Allowed::MEMBER)?;
    if recount && breaks.stop_after_home {
        return Err(stopped("stop_after_home"));
    }
    if recount {
        fs.rename(&pending, &record_file)
            .map_err(|e| io_error("rename", &pending, e))?;
        fs.sync_dir(path).map_err(|e| io_error("sync", path, e))?;
    }
    Ok(resized)
}

/// A deliberate stop (`ResizeBreaks`): what a crash there leaves.
fn stopped(at: &str) -> Error {
    Error::InvalidArgument(format!("resize stopped on purpose (ResizeBreaks::{at})"))
}

/// The steps of an online resize of a volume with regions its caller
/// supplies: the files resized, both members closed cleanly (`resize`
/// above: one crash ordering, offline or online), and a member's storage
/// opened again for the geometry its superblock says after it (each
/// member in turn).
pub struct RegionResizeSteps<'a> {
    pub files: &'a mut dyn FnMut(u64) -> Result<()>,
    pub reopen: &'a mut Reopen<'a>,
}

impl RegionVolume {
    /// Resize this open, writable volume with regions to `new_bytes`
    /// (docs/CRASH_MODEL.md, "Online resize of a volume with regions"):
    /// no move and no request in the region layer (every region's lock
    /// held, clients' calls wait), a shrink's tail judged over what serves
    /// each region, then each member's engine closed in turn
    /// (`Volume::resize_online`: the home's, and inside its close the
    /// other's), the files resized by `steps.files` while both are closed,
    /// each member opened again at its new size, and the region record
    /// and size read again from the files. A failure that leaves the
    /// members apart fences writes until a restart, whose open finishes
    /// the resize (`finish`).
    pub fn resize_online(
        &self,
        new_bytes: u64,
        steps: RegionResizeSteps<'_>,
    ) -> Result<OnlineResized> {
        self.resize_online_driven(new_bytes, steps, ResizeBreaks::default())
    }

    /// `resize_online` with the crash simulator's breaks
    /// (`ResizeBreaks::other_left_open`).
    #[doc(hidden)]
    pub fn resize_online_driven(
        &self,
        new_bytes: u64,
        steps: RegionResizeSteps<'_>,
        breaks: ResizeBreaks,
    ) -> Result<OnlineResized> {
        crate::superblock::check_volume_size(new_bytes)?;
        self.check_fence()?;
        if self.is_read_only() {
            return Err(Error::InvalidArgument(
                "the volume is read-only: it is not resized".into(),
            ));
        }
        let new_regions = regions_of(new_bytes / BLOCK) as usize;
        if new_regions > self.regions_held_for() {
            return Err(Error::InvalidArgument(format!(
                "an online grow of a volume with regions goes up to {} bytes ({} regions) while it is served: restart the server to grow it further, or resize it offline",
                self.regions_held_for() as u64 * REGION_BLOCKS * BLOCK,
                self.regions_held_for()
            )));
        }
        // Most of each member's close first, while clients go on (as the
        // one-volume resize does): under the locks, each close has only
        // what came since to commit and move home.
        self.checkpoint_now()?;
        let asked = Instant::now();
        let _still = self.hold_all();
        let waited = asked.elapsed();
        let locked = Instant::now();
        let old_bytes = self.size();
        let resized = |held: Duration| OnlineResized {
            old_bytes,
            new_bytes,
            waited,
            held,
        };
        if new_bytes == old_bytes {
            return Ok(resized(locked.elapsed()));
        }
        if new_bytes < old_bytes {
            // What each member buffered, committed: block status sees it.
            self.flush()?;
            let found = crate::resize::first_written_by(
                &|lba| Ok(lba),
                &|lba, count| self.status_held(lba * BLOCK, count * BLOCK, count),
                new_bytes / BLOCK,
                old_bytes / BLOCK,
            )?;
            if let Some(lba) = found {
                return Err(Error::InvalidArgument(format!(
                    "cannot shrink to {new_bytes} bytes: LBA {lba} (byte {}) is written; a shrink cuts only a tail that holds nothing (never written, or trimmed)",
                    lba * BLOCK
                )));
            }
            // New connections from here on get the smaller size.
            self.blocks.store(new_bytes / BLOCK, Ordering::Release);
        }
        let other = self.member(super::other_layout(self.home_layout));
        // Both members reopened by the one `reopen`, in turn (the other's
        // inside the home's `files` step: never both at once).
        let reopen = RefCell::new(steps.reopen);
        let files = steps.files;
        let mut other_reopen = |storage: &dyn Storage,
                                geometry: &vouch_format::Geometry|
         -> Result<Arc<dyn Storage>> {
            let mut reopen = reopen.borrow_mut();
            (*reopen)(storage, geometry)
        };
        let mut home_files = |bytes: u64| -> Result<()> {
            if breaks.other_left_open {
                return files(bytes);
            }
            other
                .resize_online_as(
                    bytes,
                    ResizeSteps {
                        files: &mut *files,
                        reopen: &mut other_reopen,
                    },
                    true,
                )
                .map(drop)
        };
        let mut home_reopen = |storage: &dyn Storage,
                               geometry: &vouch_format::Geometry|
         -> Result<Arc<dyn Storage>> {
            let mut reopen = reopen.borrow_mut();
            (*reopen)(storage, geometry)
        };
        let outcome = self.home().resize_online_as(
            new_bytes,
            ResizeSteps {
                files: &mut home_files,
                reopen: &mut home_reopen,
            },
            true,
        );
        // The region layer follows the files: their record and size.
        let read = self
            .fs
            .superblock(&self.path)
            .and_then(|home| Ok((super::read_record_in(&*self.fs, &self.path, &home)?, home)));
        match read {
            Ok((record, home))
                if self.home().size() == home.size_bytes && other.size() == home.size_bytes =>
            {
                *self.record.write() = record;
                self.blocks
                    .store(home.size_bytes / BLOCK, Ordering::Release);
            }
            other_state => {
                let why = match other_state {
                    Err(error) => error.to_string(),
                    Ok(_) => "its members were left at different sizes".into(),
                };
                self.fence(format!(
                    "an online resize of {} stopped half way ({why}): restart the server (its open finishes or undoes the resize)",
                    self.path.display()
                ));
            }
        }
        outcome.map(|done| OnlineResized {
            waited,
            held: locked.elapsed(),
            ..done
        })
    }
}

/// Resize the volume with regions `volume`, open and served in this
/// process, on its real files (`RegionVolume::resize_online`, with
/// `resize` above as the files' step).
pub fn resize_open(volume: &RegionVolume, new_bytes: u64) -> Result<OnlineResized> {
    let fs = crate::snapshot::RealFs::default();
    let path = volume.path().to_path_buf();
    volume.resize_online(
        new_bytes,
        RegionResizeSteps {
            files: &mut |bytes| resize(&fs, &path, bytes, ResizeBreaks::default()).map(drop),
            reopen: &mut |storage, geometry| {
                storage.reopen(geometry).map_err(|error| Error::Path {
                    action: "open",
                    path: path.clone(),
                    cause: error.to_string(),
                })
            },
        },
    )
}
