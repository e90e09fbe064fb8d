//! `vouch serve --pid-file PATH`: the server's process id, written once it
//! serves and removed when it stops.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

/// A written pid file; dropping it removes the file if it still holds this
/// process's id (a later server may have written its own over it).
#[derive(Debug)]
pub struct PidFile {
    path: PathBuf,
    contents: String,
}

impl PidFile {
    /// Write `PID\n` to `path` so that a reader sees either the old file
    /// (or none) or the whole new one, never a partial id.
    ///
    /// Crash ordering: the id is written to a temporary file in the same
    /// directory and fsynced, then renamed over `path`. A crash before the
    /// rename leaves `path` as it was and a `.PATH.PID.tmp` file behind
    /// (named by the pid, so two servers never share one); a crash after
    /// it leaves a pid file naming a dead process, as any crashed daemon's
    /// does, and the next server replaces it.
    pub fn write(path: &Path) -> Result<PidFile> {
        let pid = std::process::id();
        let contents = format!("{pid}\n");
        let name = path
            .file_name()
            .with_context(|| format!("--pid-file {}: not a file name", path.display()))?;
        let mut temporary_name = std::ffi::OsString::from(".");
        temporary_name.push(name);
        temporary_name.push(format!(".{pid}.tmp"));
        let temporary = path.with_file_name(temporary_name);
        // No directory fsync after the rename: a pid file only means
        // something while its process lives, and a power cut ends that.
        let written = (|| -> std::io::Result<()> {
            let mut file = std::fs::File::create(&temporary)?;
            file.write_all(contents.as_bytes())?;
            file.sync_all()?;
            std::fs::rename(&temporary, path)
        })();
        if let Err(error) = written {
            let _ = std::fs::remove_file(&temporary);
            return Err(error).with_context(|| format!("writing --pid-file {}", path.display()));
        }
        Ok(PidFile {
            path: path.to_path_buf(),
            contents,
        })
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let ours = std::fs::read_to_string(&self.path).is_ok_and(|text| text == self.contents);
        if ours {
            if let Err(error) = std::fs::remove_file(&self.path) {
                tracing::warn!("removing --pid-file {}: {error}", self.path.display());
            }
        }
    }
}
