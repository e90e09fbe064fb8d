//! Reads that complete later, through io_uring, for the NBD reactor.
//!
//! Why: a read that must wait for the device (an O_DIRECT volume, or a page
//! not in the page cache) used to go to a worker thread, which slept in
//! `pread` and then woke the reactor to send the reply. On the 2-vCPU VMs
//! this runs on, each of those wakes of a sleeping thread costs about as
//! much as the device read itself: `serve --direct` answered 4 KiB reads at
//! QD1 at 0.6x qemu-nbd's rate. Here the
//! reactor submits the read itself (`ReadRing::start`) and goes on; the
//! ring signals an eventfd when reads complete, the reactor's event loop
//! wakes on it like on a socket, and `reap` hands each finished read to
//! its callback on that thread: the device's completion is the only wake.
//!
//! The ring never blocks its caller: a full ring declines (the caller
//! reads on a worker as before). Each read's buffer is owned by its entry
//! in `pending` until its completion is reaped, so the kernel never writes
//! into freed memory; dropping the ring waits for reads still in flight.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

use super::direct::{AlignedBuf, DIRECT_ALIGN};

/// Reads in flight on one ring at most (more decline to a worker).
const RING_ENTRIES: u32 = 128;
/// Eventfd rounds one `reap` takes before it lets its caller run others.
const REAP_ROUNDS: usize = 64;

/// Called once with the bytes read (exactly the length asked for, the
/// buffer's 4 KiB alignment kept) or why not: an I/O error, a short read.
pub type ReadLater = Box<dyn FnOnce(io::Result<AlignedBuf>) + Send>;

/// One io_uring for reads that complete later, and the eventfd it
/// signals when some have.
pub struct ReadRing {
    inner: Mutex<Inner>,
    events: OwnedFd,
}

struct Inner {
    ring: IoUring,
    pending: HashMap<u64, InFlight>,
    next: u64,
}

struct InFlight {
    buf: AlignedBuf,
    len: usize,
    /// `None` once the read was failed without waiting for the kernel.
    done: Option<ReadLater>,
}

impl ReadRing {
    pub fn new() -> io::Result<ReadRing> {
        let ring = IoUring::builder()
            .setup_cqsize(2 * RING_ENTRIES)
            .build(RING_ENTRIES)?;
        // SAFETY: eventfd takes no pointers; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor that nothing else owns.
        let events = unsafe { OwnedFd::from_raw_fd(fd) };
        ring.submitter().register_eventfd(events.as_raw_fd())?;
        Ok(ReadRing {
            inner: Mutex::new(Inner {
                ring,
                pending: HashMap::new(),
                next: 0,
            }),
            events,
        })
    }

    /// The eventfd that becomes readable when reads have completed: wait
    /// for it, then call `reap`.
    pub fn events_fd(&self) -> RawFd {
        self.events.as_raw_fd()
    }

    /// Start reading `len` bytes (a multiple of 4 KiB) at `offset` of
    /// `file` into a new aligned buffer; `done` gets it from `reap`.
    /// `Err(done)`, with nothing started, when the ring is full or the
    /// kernel refuses the submission. `file` must stay open until `done`
    /// has been called (the storage that owns it outlives its ring).
    pub fn start(
        &self,
        file: RawFd,
        offset: u64,
        len: usize,
        done: ReadLater,
    ) -> Result<(), ReadLater> {
        assert!(
            len > 0 && (len as u64).is_multiple_of(DIRECT_ALIGN),
            "ring reads are whole pages"
        );
        let mut inner = self.inner.lock();
        if inner.pending.len() >= RING_ENTRIES as usize {
            return Err(done);
        }
        let mut buf = AlignedBuf::zeroed(len);
        let id = inner.next;
        let entry = opcode::Read::new(types::Fd(file), buf.as_mut_ptr(), len as u32)
            .offset(offset)
            .build()
            .user_data(id);
        // SAFETY: the buffer is kept in `pending` (its heap address does
        // not move) until this entry's completion is reaped, and the file
        // outlives the ring (see above).
        if unsafe { inner.ring.submission().push(&entry) }.is_err() {
            return Err(done);
        }
        inner.next += 1;
        inner.pending.insert(
            id,
            InFlight {
                buf,
                len,
                done: Some(done),
            },
        );
        match inner.ring.submit() {
            Ok(_) => Ok(()),
            Err(error) => {
                // Even a transient error (EAGAIN, EBUSY, EINTR) fails the
                // read now: nothing would retry it unless another read
                // completed. Whether the kernel took the entry is unknown,
                // so it stays pending, its buffer alive until reaped or
                // the ring is dropped; a later submit may still run it.
                tracing::debug!(%error, "io_uring read submission failed");
                let done = inner
                    .pending
                    .get_mut(&id)
                    .and_then(|read| read.done.take())
                    .expect("just inserted");
                drop(inner);
                done(Err(error));
                Ok(())
            }
        }
    }

    /// Reads started and not yet handed to their callbacks.
    pub fn in_flight(&self) -> usize {
        let inner = self.inner.lock();
        inner
            .pending
            .values()
            .filter(|read| read.done.is_some())
            .count()
    }

    /// Hand every completed read to its callback, on this thread, until
    /// the eventfd says nothing more completed: `Err(WouldBlock)` then (so
    /// an async caller clears its readiness and waits again). `Ok(())`
    /// after `REAP_ROUNDS` rounds with completions still coming: call
    /// again (after letting others run).
    pub fn reap(&self) -> io::Result<()> {
        for _ in 0..REAP_ROUNDS {
            let mut count = [0u8; 8];
            // SAFETY: reads 8 bytes into a buffer of 8 bytes.
            let got = unsafe {
                libc::read(
                    self.events.as_raw_fd(),
                    count.as_mut_ptr().cast(),
                    count.len(),
                )
            };
            if got < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            for (finished, result) in self.completed() {
                finished.finish(result);
            }
        }
        Ok(())
    }

    /// Take the finished reads off the ring (callbacks run without the lock).
    fn completed(&self) -> Vec<(InFlight, i32)> {
        let mut inner = self.inner.lock();
        let Inner { ring, pending, .. } = &mut *inner;
        ring.completion()
            .filter_map(|entry| {
                let read = pending.remove(&entry.user_data())?;
                Some((read, entry.result()))
            })
            .collect()
    }
}

impl InFlight {
    fn finish(self, result: i32) {
        let Some(done) = self.done else { return };
        let outcome = if result < 0 {
            Err(io::Error::from_raw_os_error(-result))
        } else if result as usize != self.len {
            Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("short read: {result} of {} bytes", self.len),
            ))
        } else {
            Ok(self.buf)
        };
        done(outcome);
    }
}

fn is_transient(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EAGAIN) | Some(libc::EBUSY) | Some(libc::EINTR)
    )
}

impl Drop for ReadRing {
    /// Wait for reads still in flight: their buffers must outlive them.
    fn drop(&mut self) {
        let inner = self.inner.get_mut();
        while !inner.pending.is_empty() {
            let waited = inner.ring.submit_and_wait(1);
            if waited.as_ref().is_err_and(is_transient) {
                continue;
            }
            if waited.is_err() {
                // Nothing more can be learned; leak the buffers rather
                // than free memory the kernel may still write.
                for (_, read) in inner.pending.drain() {
                    std::mem::forget(read.buf);
                }
                return;
            }
            let Inner { ring, pending, .. } = &mut *inner;
            let finished: Vec<_> = ring
                .completion()
                .filter_map(|entry| Some((pending.remove(&entry.user_data())?, entry.result())))
                .collect();
            for (read, result) in finished {
                read.finish(result);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::sync::mpsc;

    fn file_with(dir: &std::path::Path, bytes: &[u8]) -> std::fs::File {
        let path = dir.join("f");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .expect("open");
        file.write_all_at(bytes, 0).expect("write");
        file
    }

    /// Reap until `want` outcomes arrived (the eventfd is polled, as the
    /// NBD server's reaper does).
    fn reap_until<T>(ring: &ReadRing, got: &mpsc::Receiver<T>, want: usize) -> Vec<T> {
        let mut out = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while out.len() < want {
            assert!(
                std::time::Instant::now() < deadline,
                "reads never completed"
            );
            let mut poll = libc::pollfd {
                fd: ring.events_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut poll, 1, 100) };
            let reaped = ring.reap();
            assert_eq!(
                reaped.map_err(|e| e.kind()),
                Err(io::ErrorKind::WouldBlock),
                "reap stops when nothing more completed"
            );
            out.extend(got.try_iter());
        }
        out
    }

    #[test]
    fn reads_complete_through_the_eventfd_with_the_right_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 251) as u8).collect();
        let file = file_with(dir.path(), &bytes);
        let ring = ReadRing::new().expect("io_uring");
        let (send, got) = mpsc::channel();
        let asked = [(0u64, 4096usize), (8192, 16384), (61440, 4096)];
        for (offset, len) in asked {
            let send = send.clone();
            ring.start(
                file.as_raw_fd(),
                offset,
                len,
                Box::new(move |read| send.send((offset, read)).expect("send")),
            )
            .map_err(|_| "declined")
            .expect("started");
        }
        let mut outcomes = reap_until(&ring, &got, asked.len());
        outcomes.sort_by_key(|(offset, _)| *offset);
        for ((offset, read), (asked_offset, len)) in outcomes.into_iter().zip(asked) {
            assert_eq!(offset, asked_offset);
            let read = read.expect("read");
            let at = offset as usize;
            assert_eq!(&read[..], &bytes[at..at + len], "bytes at {offset}");
        }
        assert!(got.try_recv().is_err(), "each read completes once");
    }

    #[test]
    fn a_short_read_past_the_end_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = file_with(dir.path(), &[1u8; 4096]);
        let ring = ReadRing::new().expect("io_uring");
        let (send, got) = mpsc::channel();
        ring.start(
            file.as_raw_fd(),
            0,
            8192,
            Box::new(move |read| send.send(read).expect("send")),
        )
        .map_err(|_| "declined")
        .expect("started");
        let read = reap_until(&ring, &got, 1).pop().expect("one");
        assert_eq!(
            read.map(|_| ()).map_err(|e| e.kind()),
            Err(io::ErrorKind::UnexpectedEof)
        );
    }

    #[test]
    fn a_full_ring_declines_and_dropping_it_waits_for_reads_in_flight() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = file_with(dir.path(), &vec![3u8; 4096]);
        let ring = ReadRing::new().expect("io_uring");
        let (send, got) = mpsc::channel();
        for _ in 0..RING_ENTRIES {
            let send = send.clone();
            ring.start(
                file.as_raw_fd(),
                0,
                4096,
                Box::new(move |read| send.send(read).expect("send")),
            )
            .map_err(|_| "declined")
            .expect("room for RING_ENTRIES reads");
        }
        let declined = ring.start(
            file.as_raw_fd(),
            0,
            4096,
            Box::new(|_| panic!("declined reads are not called")),
        );
        assert!(declined.is_err(), "a full ring declines");
        // Never reaped: dropping the ring waits for every read and calls
        // each callback once.
        drop(ring);
        let outcomes: Vec<_> = got.try_iter().collect();
        assert_eq!(outcomes.len(), RING_ENTRIES as usize);
        assert!(outcomes
            .iter()
            .all(|read| read.as_ref().is_ok_and(|buf| buf[0] == 3)));
    }
}
