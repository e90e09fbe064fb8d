//! The vouch engine: a volume of 4 KiB blocks, each stored with protection
//! information and verified on every read. See docs/ARCHITECTURE.md.

pub mod check;
mod commit;
pub mod contexts;
pub mod direct;
pub mod error;
mod read;
pub mod recovery;
pub mod sim;
pub mod stats;
pub mod storage;
pub mod volume;

pub use check::CheckReport;
pub use commit::RangeOp;
pub use error::{Error, Fault, FaultKind, Result};
pub use read::Allocation;
pub use sim::{FaultPlan, SimStorage};
pub use stats::{Stats, StatsSnapshot};
pub use storage::{FileStorage, ObjectId, Run, Storage};
pub use volume::{CreateOptions, OpenOptions, Tuning, Volume, VolumeInfo, BLOCK};
pub use vouch_format::{GuardKind, LayoutKind};

use std::path::Path;
use std::sync::Arc;

/// Create a volume directory at `path`. On failure nothing is left behind.
pub fn create_volume(path: &Path, options: &CreateOptions) -> Result<Volume> {
    volume::check_volume_size(options.size_bytes)
        .map_err(|error| Error::Volume(format!("cannot create {}: {error}", path.display())))?;
    let segment_blocks = options
        .segment_blocks
        .unwrap_or_else(|| vouch_format::layout::default_segment_blocks(options.layout));
    let geometry = vouch_format::Geometry::new(options.layout, options.size_bytes, segment_blocks)
        .map_err(|error| Error::Volume(format!("cannot create {}: {error}", path.display())))?;
    let existed = path.exists();
    let result = FileStorage::create(path, &geometry, options.journal_bytes())
        .map_err(|error| Error::Volume(format!("cannot create {}: {error}", path.display())))
        .and_then(|storage| Volume::create(Arc::new(storage), options));
    if result.is_err() && !existed {
        let _ = std::fs::remove_dir_all(path);
    }
    result
}

/// Open the volume directory at `path`.
pub fn open_volume(path: &Path, options: &OpenOptions) -> Result<Volume> {
    let mut superblock_file = FileStorage::open_superblock(path)
        .map_err(|error| Error::Volume(format!("cannot open {}: {error}", path.display())))?;
    let superblock = read_superblock_file(&mut superblock_file, path)?;
    let geometry = superblock.geometry().map_err(|error| {
        Error::Volume(format!("{}: corrupt superblock: {error}", path.display()))
    })?;
    let storage = FileStorage::open_objects(path, &geometry, !options.read_only, options.direct)
        .map_err(|error| Error::Volume(format!("cannot open {}: {error}", path.display())))?;
    Volume::open(Arc::new(storage), options)
}

fn read_superblock_file(file: &mut std::fs::File, path: &Path) -> Result<vouch_format::Superblock> {
    use std::os::unix::fs::FileExt;
    let mut both = vec![0u8; 8192];
    let mut done = 0;
    while done < both.len() {
        match file.read_at(&mut both[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(error) => {
                return Err(Error::Volume(format!(
                    "cannot read {}/superblock: {error}",
                    path.display()
                )))
            }
        }
    }
    let first = vouch_format::Superblock::decode(&both[..4096]);
    let second = vouch_format::Superblock::decode(&both[4096..]);
    if let (Err(a), Err(b)) = (&first, &second) {
        return Err(Error::Volume(format!(
            "{}: not a usable vouch volume: both superblock copies are invalid (copy 0: {a}; copy 1: {b})",
            path.display()
        )));
    }
    vouch_format::Superblock::newest(first, second)
        .map_err(|error| Error::Volume(format!("{}: corrupt superblock: {error}", path.display())))
}
