//! O_DIRECT data segments: aligned bounce buffers, read-modify-write of
//! unaligned edges, and batched writes through io_uring.
//!
//! With `OpenOptions::direct` the data segment files bypass the host page
//! cache (qemu's cache=none): the guest above the NBD export has its own
//! cache, and a second copy in the host only costs memory and a copy per
//! I/O. O_DIRECT needs offsets, lengths and memory aligned to the device's
//! logical block; this module uses 4096 everywhere, which satisfies every
//! device and filesystem vouch runs on (statx's DIOALIGN is at most that).
//!
//! A commit's home writes are independent of each other (the journal was
//! synced before them: ORDER POINT A in `commit.rs`), so they are submitted
//! together through one io_uring with up to `RING_DEPTH` in flight, instead
//! of one synchronous pwrite each: at 60–100 µs per device write that is the
//! difference between a device at queue depth 1 and at queue depth 64.
//! Where io_uring is unavailable (kernel too old, disabled by sysctl or
//! seccomp) the batch falls back to synchronous pwrite, with one warning.

use std::alloc::{self, Layout};
use std::fs::File;
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::ptr::NonNull;

use io_uring::{opcode, types, IoUring};

use crate::storage::{Run, RunError};

/// Alignment of every O_DIRECT transfer: offset, length and memory.
pub const DIRECT_ALIGN: u64 = 4096;

/// Most operations in flight on the ring at once.
const RING_DEPTH: u32 = 256;

/// Buffers of at least this many bytes that O_DIRECT transfers go through
/// (`AlignedBuf::for_device`: the bounce buffer of a large read, a write
/// arena) are mapped on their own in 2 MiB huge pages where the kernel can.
/// The device sees a transfer as segments of physically contiguous memory,
/// and a virtio disk takes 254 of them in one request: a 1 MiB read into
/// 256 scattered 4 KiB pages was split into two device requests, and a
/// worker whose bounce buffer happened to be scattered split every read it
/// made (`serve --direct` split, 1 MiB reads at QD8: 406 of 455 reads of one
/// worker, 0 on another; docs/BENCHMARKS.md "Stop 41").
pub const HUGE_FROM_BYTES: usize = 512 << 10;
/// The huge page size the large buffers are aligned to and sized in.
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed buffer aligned to `DIRECT_ALIGN`, its length a multiple of it:
/// on the heap, or (`for_device`, large) a mapping of its own.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// `Some(bytes mapped)` when it is a mapping of its own.
    mapped: Option<usize>,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> AlignedBuf {
        assert!(
            len > 0 && len.is_multiple_of(DIRECT_ALIGN as usize),
            "aligned buffers are whole pages"
        );
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf {
            ptr,
            len,
            mapped: None,
        }
    }

    /// `zeroed`, for memory O_DIRECT transfers go through and that is
    /// kept (a thread's bounce buffer, a write arena): from
    /// `HUGE_FROM_BYTES` on, an anonymous mapping aligned to 2 MiB and
    /// advised to be huge pages, so a transfer is a few physically
    /// contiguous segments, not one per 4 KiB page. Where the kernel has
    /// no transparent huge pages, or none free, it is plain pages, as on
    /// the heap; with THP `defrag` at `madvise` (the default) the first
    /// touch of such a buffer may compact memory, once: these buffers are
    /// kept.
    pub fn for_device(len: usize) -> AlignedBuf {
        if len < HUGE_FROM_BYTES {
            return AlignedBuf::zeroed(len);
        }
        AlignedBuf::mapped_huge(len).unwrap_or_else(|| AlignedBuf::zeroed(len))
    }

    /// `len` bytes (whole pages) at the start of a 2 MiB aligned anonymous
    /// mapping of whole huge pages; `None` if it cannot be mapped.
    fn mapped_huge(len: usize) -> Option<AlignedBuf> {
        assert!(
            len > 0 && len.is_multiple_of(DIRECT_ALIGN as usize),
            "aligned buffers are whole pages"
        );
        let map_len = len.next_multiple_of(HUGE_PAGE);
        let reserve = map_len + HUGE_PAGE;
        // SAFETY: a new private anonymous mapping; no pointer is passed in.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let base = raw as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let head = start - base;
        let tail = reserve - head - map_len;
        // SAFETY: both ranges lie in the mapping just made and outside
        // [start, start + map_len), which is kept; nothing refers to them.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + map_len) as *mut libc::c_void, tail);
            }
            // Advice only: refused (no THP in this kernel), the pages are
            // plain ones.
            libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE);
        }
        // An anonymous mapping reads as zeros: the buffer is zeroed.
        Some(AlignedBuf {
            ptr: NonNull::new(start as *mut u8).expect("mmap never returns null here"),
            len,
            mapped: Some(map_len),
        })
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, DIRECT_ALIGN as usize).expect("valid layout")
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.mapped {
            // SAFETY: the mapping made in `mapped_huge`, owned by this buffer.
            Some(map_len) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), map_len);
            },
            // SAFETY: allocated in `zeroed` with this same layout.
            None => unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) },
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

fn round_down(at: u64) -> u64 {
    at / DIRECT_ALIGN * DIRECT_ALIGN
}

fn round_up(at: u64) -> u64 {
    at.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN
}

fn is_aligned(offset: u64, len: usize, ptr: *const u8) -> bool {
    offset.is_multiple_of(DIRECT_ALIGN)
        && (len as u64).is_multiple_of(DIRECT_ALIGN)
        && (ptr as usize).is_multiple_of(DIRECT_ALIGN as usize)
}

/// pread until `buf` is full; past the end of the file reads as zero.
pub fn read_full(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Read from an O_DIRECT file at any offset and length (through an aligned
/// bounce buffer when the request or the memory is not aligned).
pub fn read_direct(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    if is_aligned(offset, buf.len(), buf.as_ptr()) {
        return read_aligned(file, offset, buf);
    }
    let start = round_down(offset);
    let end = round_up(offset + buf.len() as u64);
    with_bounce((end - start) as usize, |bounce| {
        read_aligned(file, start, bounce)?;
        let at = (offset - start) as usize;
        buf.copy_from_slice(&bounce[at..at + buf.len()]);
        Ok(())
    })
}

/// Largest bounce buffer a thread keeps between reads.
const KEEP_BOUNCE_BYTES: usize = 4 << 20;

thread_local! {
    /// Each reading thread's bounce buffer, reused: a fresh large
    /// allocation per read is an mmap, page faults and zeroing every time.
    static BOUNCE: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` on an aligned scratch buffer of `len` bytes (a multiple of
/// `DIRECT_ALIGN`); its contents on entry are unspecified.
fn with_bounce<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    let mut bounce = BOUNCE
        .with(|cell| cell.borrow_mut().take())
        .filter(|bounce| bounce.len() >= len)
        .unwrap_or_else(|| AlignedBuf::for_device(len.max(256 << 10)));
    let result = f(&mut bounce[..len]);
    if bounce.len() <= KEEP_BOUNCE_BYTES {
        BOUNCE.with(|cell| *cell.borrow_mut() = Some(bounce));
    }
    result
}

/// An aligned O_DIRECT read. A short read means the end of the file (the
/// next read would be unaligned): the rest reads as zero.
fn read_aligned(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    loop {
        match file.read_at(buf, offset) {
            Ok(n) => {
                buf[n..].fill(0);
                return Ok(());
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
}

/// A run laid into its aligned envelope `arena[at..at + len]`, to be
/// written at file offset `start`.
struct Envelope {
    start: u64,
    at: usize,
    len: usize,
}

/// Largest write arena kept between batches (a commit's envelopes).
const KEEP_ARENA_BYTES: usize = 64 << 20;

/// Write `runs` (non-overlapping) to an O_DIRECT file: each run becomes one
/// aligned write of its envelope; an unaligned edge is first read back
/// (read-modify-write: writes to one file are serialized by the caller, and
/// runs whose envelopes share a page are written one after the other).
/// The envelopes are laid out in `arena`, grown as needed and kept for the
/// next batch (up to `KEEP_ARENA_BYTES`): every byte of an envelope is
/// either read back (edge pages) or overwritten, so it is never cleared.
pub fn write_runs(
    file: &File,
    ring: Option<&mut IoUring>,
    arena: &mut Option<AlignedBuf>,
    runs: &[Run<'_>],
) -> Result<(), RunError> {
    let mut order: Vec<usize> = (0..runs.len()).filter(|&i| !runs[i].is_empty()).collect();
    order.sort_unstable_by_key(|&i| runs[i].offset);
    let mut envelopes = Vec::with_capacity(order.len());
    let mut edges: Vec<(u64, usize)> = Vec::new(); // (file offset, envelope index)
    let mut total = 0usize;
    for &index in &order {
        let run = &runs[index];
        let start = round_down(run.offset);
        let end = round_up(run.offset + run.len());
        if run.offset != start {
            edges.push((start, envelopes.len()));
        }
        if run.offset + run.len() != end && (end - DIRECT_ALIGN != start || run.offset == start) {
            edges.push((end - DIRECT_ALIGN, envelopes.len()));
        }
        let len = (end - start) as usize;
        envelopes.push(Envelope {
            start,
            at: total,
            len,
        });
        total += len;
    }
    if total == 0 {
        return Ok(());
    }
    let mut buffer = match arena.take() {
        Some(buffer) if buffer.len() >= total => buffer,
        _ => AlignedBuf::for_device(total),
    };
    let result = write_envelopes(file, ring, &mut buffer, runs, &order, &envelopes, &edges);
    if buffer.len() <= KEEP_ARENA_BYTES {
        *arena = Some(buffer);
    }
    result
}

fn write_envelopes(
    file: &File,
    ring: Option<&mut IoUring>,
    arena: &mut [u8],
    runs: &[Run<'_>],
    order: &[usize],
    envelopes: &[Envelope],
    edges: &[(u64, usize)],
) -> Result<(), RunError> {
    let shares_page = order.windows(2).any(|pair| {
        let (a, b) = (&runs[pair[0]], &runs[pair[1]]);
        round_up(a.offset + a.len()) > round_down(b.offset)
    });
    if shares_page {
        // Rare (never for vouch's own commits): keep read-modify-writes of a
        // shared page in order.
        for (number, (envelope, &index)) in envelopes.iter().zip(order).enumerate() {
            let failed = |error| RunError {
                offset: runs[index].offset,
                error,
            };
            let buf = &mut arena[envelope.at..envelope.at + envelope.len];
            for &(at, _) in edges.iter().filter(|(_, owner)| *owner == number) {
                let within = (at - envelope.start) as usize;
                read_aligned(file, at, &mut buf[within..within + DIRECT_ALIGN as usize])
                    .map_err(failed)?;
            }
            fill(buf, envelope.start, &runs[index]);
            write_aligned(file, envelope.start, buf).map_err(failed)?;
        }
        return Ok(());
    }
    let fd = file.as_raw_fd();
    let base = arena.as_mut_ptr();
    // Phase 1: read the pages under unaligned edges.
    let mut reads: Vec<Op> = edges
        .iter()
        .map(|&(at, index)| {
            let envelope = &envelopes[index];
            let within = envelope.at + (at - envelope.start) as usize;
            Op {
                write: false,
                run_offset: runs[order[index]].offset,
                offset: at,
                // SAFETY: `within` + one page lies inside the arena.
                ptr: unsafe { base.add(within) },
                len: DIRECT_ALIGN as usize,
            }
        })
        .collect();
    let mut ring = ring;
    submit_all(file, fd, ring.as_deref_mut(), &mut reads)?;
    // Phase 2: lay the new bytes over them, then write every envelope.
    for (envelope, &index) in envelopes.iter().zip(order) {
        let buf = &mut arena[envelope.at..envelope.at + envelope.len];
        fill(buf, envelope.start, &runs[index]);
    }
    let base = arena.as_mut_ptr();
    let mut writes: Vec<Op> = envelopes
        .iter()
        .zip(order)
        .map(|(envelope, &index)| Op {
            write: true,
            run_offset: runs[index].offset,
            offset: envelope.start,
            // SAFETY: the envelope lies inside the arena.
            ptr: unsafe { base.add(envelope.at) },
            len: envelope.len,
        })
        .collect();
    submit_all(file, fd, ring, &mut writes)
}

/// Copy a run's bytes into its envelope `buf`, which starts at file offset `start`.
fn fill(buf: &mut [u8], start: u64, run: &Run<'_>) {
    let mut at = (run.offset - start) as usize;
    for part in run.parts {
        buf[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
}

/// pwrite until all of `data` is written.
fn write_aligned(file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
    file.write_all_at(data, offset)
}

/// One read or write into memory owned by the caller of `submit_all`.
struct Op {
    write: bool,
    /// The run this op serves: what a failure is reported against.
    run_offset: u64,
    offset: u64,
    ptr: *mut u8,
    len: usize,
}

impl Op {
    fn failed(&self, error: io::Error) -> RunError {
        RunError {
            offset: self.run_offset,
            error,
        }
    }

    /// Finish the op synchronously from `done` bytes on.
    fn finish_sync(&self, file: &File, done: usize) -> io::Result<()> {
        // SAFETY: ptr/len describe a live buffer owned by `write_runs`, not
        // in use by the ring any more (this op completed).
        let buf = unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) };
        if self.write {
            write_aligned(file, self.offset + done as u64, &buf[done..])
        } else {
            read_aligned(file, self.offset + done as u64, &mut buf[done..])
        }
    }
}

/// Run `ops` through the ring, `RING_DEPTH` at a time, or synchronously
/// without one. Every submitted op completes before this returns, even on
/// error: the ring must never outlive the memory it reads or writes.
fn submit_all(
    file: &File,
    fd: i32,
    ring: Option<&mut IoUring>,
    ops: &mut [Op],
) -> Result<(), RunError> {
    let Some(ring) = ring else {
        for op in ops.iter() {
            op.finish_sync(file, 0).map_err(|error| op.failed(error))?;
        }
        return Ok(());
    };
    let mut next = 0usize;
    let mut in_flight = 0u32;
    let mut first_error: Option<RunError> = None;
    while next < ops.len() || in_flight > 0 {
        while first_error.is_none() && next < ops.len() && in_flight < RING_DEPTH {
            let op = &ops[next];
            let entry = if op.write {
                opcode::Write::new(types::Fd(fd), op.ptr, op.len as u32)
                    .offset(op.offset)
                    .build()
            } else {
                opcode::Read::new(types::Fd(fd), op.ptr, op.len as u32)
                    .offset(op.offset)
                    .build()
            }
            .user_data(next as u64);
            // SAFETY: the buffer stays alive and untouched until this op's
            // completion is reaped below (we never return with ops in flight).
            if unsafe { ring.submission().push(&entry) }.is_err() {
                break; // queue full: reap first
            }
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break; // an error stopped new submissions and all have completed
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                ) => {}
            Err(error) => {
                // The ring itself failed: the kernel may still own buffers,
                // so wait for them rather than free them under it. No one
                // run failed; report the batch's first.
                first_error.get_or_insert(ops[0].failed(error));
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        let completed: Vec<(u64, i32)> = ring
            .completion()
            .map(|cqe| (cqe.user_data(), cqe.result()))
            .collect();
        for (index, result) in completed {
            in_flight -= 1;
            let op = &ops[index as usize];
            let outcome = if result < 0 {
                Err(io::Error::from_raw_os_error(-result))
            } else if (result as usize) < op.len {
                // Short transfer (end of file for a read, rare for a write):
                // finish it synchronously.
                op.finish_sync(file, result as usize)
            } else {
                Ok(())
            };
            if let Err(error) = outcome {
                first_error.get_or_insert(op.failed(error));
            }
        }
    }
    match first_error {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// A ring for batched data writes, or `None` (with one warning) when the
/// kernel refuses io_uring.
pub fn new_ring() -> Option<IoUring> {
    match IoUring::new(RING_DEPTH) {
        Ok(ring) => Some(ring),
        Err(error) => {
            tracing::warn!(%error, "io_uring unavailable: direct writes go one pwrite at a time");
            None
        }
    }
}

/// Whether the mapping that holds address `at` is advised huge pages
/// (`hg` in its `VmFlags`, `/proc/self/smaps`): tests of the buffers
/// `AlignedBuf::for_device` makes. A kernel without transparent huge
/// pages refuses the advice and shows no `hg`: those tests then fail,
/// saying so.
#[cfg(test)]
pub(crate) fn advised_huge(at: usize) -> bool {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let mut inside = false;
    for line in smaps.lines() {
        let range = line
            .split(' ')
            .next()
            .and_then(|first| first.split_once('-'));
        if let Some((start, end)) = range {
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                inside = (start..end).contains(&at);
                continue;
            }
        }
        if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
            return flags.split_whitespace().any(|flag| flag == "hg");
        }
    }
    panic!("no mapping holds {at:#x}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn direct_file(dir: &std::path::Path, len: u64) -> File {
        let path = dir.join("f");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .expect("O_DIRECT open");
        file.set_len(len).expect("set_len");
        file
    }

    #[test]
    fn unaligned_runs_read_modify_write_their_edges() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = direct_file(dir.path(), 1 << 20);
        let background: Vec<u8> = (0..(1 << 20)).map(|i| (i % 253) as u8).collect();
        write_aligned(&file, 0, &{
            let mut buf = AlignedBuf::zeroed(1 << 20);
            buf.copy_from_slice(&background);
            buf
        })
        .expect("fill");
        let mut expected = background.clone();
        // One arena across every batch: stale bytes from the last batch must
        // never reach the file.
        let mut arena = None;
        // 4128-byte records like the packed layout's, some adjacent, some
        // sharing a page, plus an aligned one and a multi-part run.
        let a = vec![1u8; 4128];
        let b = vec![2u8; 4128];
        let c = vec![3u8; 4096];
        let d1 = [4u8; 100];
        let d2 = vec![5u8; 9000];
        let runs_owned: Vec<(u64, Vec<&[u8]>)> = vec![
            (4128, vec![&a[..]]),
            (5 * 4128, vec![&b[..]]),
            (40960, vec![&c[..]]),
            (100_000, vec![&d1[..], &d2[..]]),
        ];
        for with_ring in [false, true] {
            let runs: Vec<Run<'_>> = runs_owned
                .iter()
                .map(|(offset, parts)| Run {
                    offset: *offset,
                    parts,
                })
                .collect();
            let mut ring = if with_ring { new_ring() } else { None };
            write_runs(&file, ring.as_mut(), &mut arena, &runs).expect("write_runs");
            for (offset, parts) in &runs_owned {
                let bytes = parts.concat();
                expected[*offset as usize..*offset as usize + bytes.len()].copy_from_slice(&bytes);
            }
            let mut back = vec![0u8; 1 << 20];
            read_direct(&file, 0, &mut back).expect("read");
            assert!(back == expected, "with_ring={with_ring}");
            let mut piece = vec![0u8; 4128];
            read_direct(&file, 5 * 4128, &mut piece).expect("unaligned read");
            assert_eq!(piece, b);
        }
        // Runs whose envelopes share a page take the ordered path.
        let e = [6u8; 10];
        let f = [7u8; 10];
        let shared = [&e[..]];
        let shared2 = [&f[..]];
        let runs = [
            Run {
                offset: 8,
                parts: &shared,
            },
            Run {
                offset: 30,
                parts: &shared2,
            },
        ];
        write_runs(&file, new_ring().as_mut(), &mut arena, &runs).expect("shared page");
        expected[8..18].copy_from_slice(&e);
        expected[30..40].copy_from_slice(&f);
        let mut back = vec![0u8; 4096];
        read_direct(&file, 0, &mut back).expect("read");
        assert!(back[..] == expected[..4096]);
    }

    fn assert_huge_advised(what: &str, at: usize) {
        assert_eq!(at % HUGE_PAGE, 0, "{what} is 2 MiB aligned");
        assert!(
            advised_huge(at),
            "{what} is advised huge pages (MADV_HUGEPAGE; needs a kernel built with \
             transparent huge pages, CONFIG_TRANSPARENT_HUGEPAGE)"
        );
    }

    /// The memory a 1 MiB O_DIRECT read or write goes through (a read's
    /// bounce buffer, a batch's write arena) is 2 MiB aligned and advised
    /// huge pages, so the device gets it as a few contiguous segments,
    /// not 256 scattered pages that a virtio disk (254 segments a request)
    /// splits in two. Smaller transfers keep heap memory.
    #[test]
    fn large_transfers_go_through_memory_advised_huge_pages() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = direct_file(dir.path(), 4 << 20);
        let data: Vec<u8> = (0..1 << 20).map(|i| (i % 253) as u8).collect();
        let mut arena = None;
        let runs = [Run {
            offset: 1 << 20,
            parts: &[&data[..]],
        }];
        write_runs(&file, new_ring().as_mut(), &mut arena, &runs).expect("write 1 MiB");
        let arena_at = arena.as_ref().expect("arena kept").as_ptr() as usize;
        assert_huge_advised("the write arena of a 1 MiB run", arena_at);
        // A destination O_DIRECT cannot take (not page aligned): the read
        // goes through this thread's bounce buffer.
        let mut unaligned = vec![0u8; (1 << 20) + 16];
        read_direct(&file, 1 << 20, &mut unaligned[16..]).expect("read 1 MiB");
        assert!(unaligned[16..] == data[..], "the bytes written come back");
        let bounce_at = BOUNCE.with(|cell| {
            cell.borrow()
                .as_ref()
                .map(|bounce| bounce.as_ptr() as usize)
                .expect("bounce kept")
        });
        assert_huge_advised("the bounce buffer of a 1 MiB read", bounce_at);
        // Below the threshold: heap memory, as before.
        let small = AlignedBuf::for_device(HUGE_FROM_BYTES - 4096);
        assert!(small.mapped.is_none(), "a small buffer stays on the heap");
    }

    #[test]
    fn reads_past_the_end_are_zero() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = direct_file(dir.path(), 8192);
        let mut buf = vec![9u8; 12288];
        read_direct(&file, 4096, &mut buf).expect("read");
        assert!(buf.iter().all(|&b| b == 0));
    }
}
