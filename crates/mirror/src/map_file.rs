//! Where a resync map's copies live (`dirty.rs`): the real filesystem
//! (`FileMaps`), or a simulated one the crash simulator cuts and tears at
//! every write and sync (`crates/sim`), so the map's own writes are
//! crash-tested like a volume's (docs/RELIABILITY.md).
//!
//! Crash ordering of what the map asks for:
//! - `create` is atomic and durable on return: a crash leaves the old file
//!   (or none) or the new one, never a mix (temporary file, fsync, rename,
//!   directory fsync);
//! - `MapFile::write_at` is not durable until `MapFile::sync`; until then
//!   a crash may keep, lose or tear it (page CRCs catch a torn page);
//! - `remove` is durable on return (directory fsynced).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use vouch_engine::replace::{replace_file, sync_parent};

/// The store of resync map files (see the module's documentation).
pub trait MapStore: Send + Sync {
    /// The whole file at `path`, `None` when there is none.
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>>;
    /// Make `path` hold exactly `image`, atomically and durably, and open
    /// it for page writes.
    fn create(&self, path: &Path, image: &[u8]) -> io::Result<Box<dyn MapFile>>;
    /// Delete `path` durably; a missing file is not an error.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Write `data` at `offset` in each of `files` and sync it (the
    /// activity log's update: one file on each leg's disk); one result per
    /// file, in order. By default the files at once (`write_and_sync_at_once`):
    /// an update costs one sync's time, not one per leg. The crash
    /// simulator runs the files' writes and syncs one at a time, in an
    /// order its seed chooses, so a seed gives the same crash points.
    fn write_and_sync_each(
        &self,
        files: &[&dyn MapFile],
        offset: u64,
        data: &[u8],
    ) -> Vec<io::Result<()>> {
        write_and_sync_at_once(files, offset, data)
    }
}

/// Write and sync every file at once: the first on the caller's thread,
/// each other on a thread of its own (`MapStore::write_and_sync_each`).
pub fn write_and_sync_at_once(
    files: &[&dyn MapFile],
    offset: u64,
    data: &[u8],
) -> Vec<io::Result<()>> {
    let Some((first, others)) = files.split_first() else {
        return Vec::new();
    };
    std::thread::scope(|scope| {
        let writes: Vec<_> = others
            .iter()
            .map(|file| scope.spawn(move || file.write_at(offset, data).and_then(|()| file.sync())))
            .collect();
        let mut outcomes = vec![first.write_at(offset, data).and_then(|()| first.sync())];
        outcomes.extend(writes.into_iter().map(|write| {
            write
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("activity log writer panicked")))
        }));
        outcomes
    })
}

/// One open map file.
pub trait MapFile: Send + Sync {
    /// Write `data` at `offset` (durable after `sync`).
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Make every completed write durable.
    fn sync(&self) -> io::Result<()>;
}

/// Map files on the real filesystem.
pub struct FileMaps;

struct RealMapFile(File);

impl MapFile for RealMapFile {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write_all_at(data, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.0.sync_data()
    }
}

impl MapStore for FileMaps {
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Temporary file (`mirror.dirty.tmp`), fsync, rename, directory fsync:
    /// the name holds the old file or the new one at every instant.
    fn create(&self, path: &Path, image: &[u8]) -> io::Result<Box<dyn MapFile>> {
        replace_file(&path.with_extension("tmp"), path, image)?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        Ok(Box::new(RealMapFile(file)))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        match std::fs::remove_file(path) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => return Err(error),
            _ => {}
        }
        sync_parent(path)
    }
}
