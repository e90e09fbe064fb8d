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

/// Swap the directory entries `a` and `b` in one step (`renameat2` with
/// `RENAME_EXCHANGE`): a crash leaves both names as they were or both
/// swapped, never one name missing, which two renames would. Both must
/// exist, on one filesystem; a filesystem that cannot exchange fails
/// with `EINVAL`. Not durable until the parent directory is fsynced
/// (`sync_parent`).
pub fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt as _;
    let c = |path: &Path| {
        CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both are NUL-terminated strings that outlive the call; the
    // call reads them and nothing else of this process.
    let result = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
