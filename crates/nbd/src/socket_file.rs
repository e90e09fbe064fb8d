//! Unix socket files a server makes: bound over a stale file from a run
//! that crashed, never over a live server's, and removed when the server
//! is done with them.

use std::io;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The file of a Unix socket this process bound. Dropping it removes the
/// file, unless something else has been put at the path since (it is
/// removed only while the path is still this socket's inode). Drop it
/// before closing the listener: while the listener is open no other
/// server replaces the file ([`bind_unix`] refuses a live socket), so
/// the file removed is this server's.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    device: u64,
    inode: u64,
}

impl SocketFile {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|meta| meta.dev() == self.device && meta.ino() == self.inode);
        if ours {
            // Best effort: a file left behind is replaced by the next bind.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Bind a listening Unix socket at `path`. An existing socket file that
/// nothing answers on (left by a process that was killed) is replaced; one
/// a live server accepts on is `AddrInUse`, and any other kind of file is
/// refused rather than deleted.
pub fn bind_unix(path: &Path) -> io::Result<(UnixListener, SocketFile)> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "the path exists and is not a socket",
            ));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another server is listening on this socket",
            ));
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
    }
    let listener = UnixListener::bind(path)?;
    let meta = std::fs::symlink_metadata(path)?;
    let file = SocketFile {
        path: path.to_path_buf(),
        device: meta.dev(),
        inode: meta.ino(),
    };
    Ok((listener, file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_goes_with_the_guard() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let (listener, file) = bind_unix(&path).unwrap();
        assert!(path.exists());
        drop(listener);
        drop(file);
        assert!(!path.exists());
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let stale = UnixListener::bind(&path).unwrap();
        drop(stale);
        let (live, _file) = bind_unix(&path).expect("a stale socket file is replaced");
        let error = bind_unix(&path).expect_err("a live socket is not taken over");
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
        drop(live);
    }

    #[test]
    fn a_replaced_file_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let (_listener, file) = bind_unix(&path).unwrap();
        let other = dir.path().join("other");
        std::fs::write(&other, b"someone else's").unwrap();
        std::fs::rename(&other, &path).unwrap();
        drop(file);
        assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
    }

    #[test]
    fn a_regular_file_is_never_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, b"keep").unwrap();
        assert!(bind_unix(&path).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"keep");
    }
}
