//! Replacing a small file atomically and durably, the one way every such
//! file of the engine is written (job cursors, a scrub's record, a mirror
//! leg's record, a resync map's copy).
//!
//! Crash ordering: the temporary file's bytes are fsynced before the
//! rename, so the name never points at unwritten bytes; the directory is
//! fsynced after it, so the rename itself survives a power cut (without
//! that fsync the directory entry may still name the old file, or, for a
//! first save, none). After a crash the name holds the old file or the
//! new one.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Make `target` hold exactly `bytes`: write them to `temporary` (created
/// or truncated), fsync it, rename it over `target`, fsync the directory.
/// On an error `temporary` may be left behind; `target` is unchanged or
/// replaced, never partly written.
pub fn replace_file(temporary: &Path, target: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = File::create(temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(temporary, target)?;
    sync_parent(target)
}

/// Fsync the directory holding `path`, so that a rename or removal of
/// an entry in it is durable.
pub fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) if dir.as_os_str().is_empty() => File::open(".")?.sync_all(),
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}
