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

use std::path::Path;

use vouch_format::regions::{regions_of, RegionRecord};

use super::{has_regions, member_path, REGIONS_FILE};
use crate::error::{Error, Result};
use crate::resize::{resize_volume, Allowed, ResizeBreaks, Resized};
use crate::snapshot::{io_error, superblock_of, SnapshotFs};
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
