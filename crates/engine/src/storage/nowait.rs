//! Reads that never wait for the device (issue 11's inline request path):
//! `preadv2(..., RWF_NOWAIT)` copies what the page cache holds and fails
//! with EAGAIN instead of starting I/O. The NBD server answers such a read
//! on the connection's own task, skipping the hand-off to a worker; a read
//! that would block goes to a worker as before.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Whether a read may wait for the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Wait as long as the I/O takes (every read but the inline path's).
    Block,
    /// Only from memory: `ErrorKind::WouldBlock` when any byte is not there.
    NoWait,
}

/// The error a read that would have to wait returns.
pub fn would_block() -> io::Error {
    io::Error::from(io::ErrorKind::WouldBlock)
}

/// Like `direct::read_full` (past the end of the file reads as zero), but
/// only from the page cache: `WouldBlock` when some byte is not cached, or
/// when the file system cannot tell (EOPNOTSUPP).
pub fn read_full_nowait(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        let at = libc::off_t::try_from(offset + done as u64)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let iov = libc::iovec {
            iov_base: rest.as_mut_ptr().cast(),
            iov_len: rest.len(),
        };
        // SAFETY: `iov` describes `rest`, memory we own and may write for
        // its whole length, and lives across the call; the descriptor is
        // open for as long as `file` is borrowed.
        let read = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, at, libc::RWF_NOWAIT) };
        match read {
            0 => {
                rest.fill(0);
                return Ok(());
            }
            read if read > 0 => done += read as usize,
            _ => {
                let error = io::Error::last_os_error();
                match error.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EAGAIN | libc::EOPNOTSUPP) => return Err(would_block()),
                    _ => return Err(error),
                }
            }
        }
    }
    Ok(())
}
