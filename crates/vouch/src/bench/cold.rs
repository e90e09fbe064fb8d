//! Page-cache eviction for the cold tests, so their I/O goes to the device.

use std::fs::File;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

use super::accounting::sync_all;

/// The files holding a target's data: the raw file, or a volume's data
/// segments (not its superblock, journal or contexts).
pub(super) fn data_files(path: &Path) -> Result<Vec<File>> {
    let mut paths = Vec::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with("data.") {
                paths.push(entry.path());
            }
        }
    } else {
        paths.push(path.to_path_buf());
    }
    paths
        .iter()
        .map(|path| File::open(path).with_context(|| format!("cannot open {}", path.display())))
        .collect()
}

/// Drop every clean cached page of `files` (they were synced before).
pub(super) fn evict(files: &[File]) -> Result<()> {
    for file in files {
        // SAFETY: a valid open descriptor; offset 0, length 0 = whole file.
        let rc = unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(file),
                0,
                0,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        if rc != 0 {
            bail!(
                "posix_fadvise(DONTNEED): {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
    Ok(())
}

/// Run `test` with `files` evicted from the page cache before it starts and,
/// when `keep_evicting`, again every 10 ms while it runs, so its reads go to
/// the device (a block read twice within 10 ms may still hit; the same holds
/// for every config).
pub(super) fn cold<T>(
    files: &[File],
    keep_evicting: bool,
    test: impl FnOnce() -> Result<T>,
) -> Result<T> {
    sync_all();
    evict(files)?;
    if !keep_evicting {
        return test();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let evictor = scope.spawn(|| -> Result<()> {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(10));
                evict(files)?;
            }
            Ok(())
        });
        let result = test();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        evictor.join().expect("evictor thread panicked")?;
        result
    })
}
