//! Background jobs as one mechanism: a chunked scan over a `BlockDevice`
//! that skips holes, can be throttled (bytes per second), reports progress,
//! can be cancelled from another thread, and can resume from a persisted
//! cursor. `check` and `export` run on it today; scrub, resync, copy and
//! layout migration are the same loop with another visitor.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use crate::buffer::PageBuffer;
use crate::device::BlockDevice;
use crate::error::{Error, Fault, Result};
use crate::state::BLOCK;

/// Blocks read per step of a scan (1 MiB). Scans start chunks on multiples
/// of it, so a resumed scan reads the same chunks.
pub const SCAN_CHUNK_BLOCKS: u64 = 256;

/// Threads that read and verify chunks for a scan, and how many chunks
/// may be handed out ahead of the one being visited (bounded memory:
/// SCAN_AHEAD MiB of buffers).
const SCAN_READERS: usize = 2;
const SCAN_AHEAD: usize = 4;
/// Blocks a scan reader copies from the kernel before checking them.
const READ_PART_BLOCKS: u64 = 64;
/// How often a scan waiting for a chunk checks that its readers live.
const READER_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// A scan saves its cursor this often, and when it is cancelled: an fsync
/// per 1 MiB chunk (or per 64 MiB, at page-cache speeds of several GiB/s)
/// costs more than the reading, and a resumed scan redoes at most about
/// one interval of work.
pub const CURSOR_SAVE_INTERVAL: Duration = Duration::from_secs(1);

/// Shared between a running job and whoever watches it: progress counters
/// and the cancel switch. Cheap to poll from any thread.
#[derive(Debug, Default)]
pub struct JobControl {
    cancel: AtomicBool,
    /// Blocks of the range behind the cursor (checked or skipped as holes).
    done_blocks: AtomicU64,
    total_blocks: AtomicU64,
    /// Blocks actually read and verified (holes skipped are not counted).
    read_blocks: AtomicU64,
}

impl JobControl {
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }
    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }
    /// `(done, total)` in blocks.
    pub fn progress(&self) -> (u64, u64) {
        (
            self.done_blocks.load(Ordering::Relaxed),
            self.total_blocks.load(Ordering::Relaxed),
        )
    }
    pub fn read_blocks(&self) -> u64 {
        self.read_blocks.load(Ordering::Relaxed)
    }

    /// A job over `total` blocks starts with `done` of them behind it.
    pub(crate) fn start(&self, total: u64, done: u64) {
        self.total_blocks.store(total, Ordering::Relaxed);
        self.done_blocks.store(done, Ordering::Relaxed);
    }

    /// `done` blocks of the job are behind it now, `read` more were read.
    pub(crate) fn advance(&self, done: u64, read: u64) {
        self.read_blocks.fetch_add(read, Ordering::Relaxed);
        self.done_blocks.store(done, Ordering::Relaxed);
    }

    /// Record progress of a job that is not a `scan` (copy): `done` of
    /// `total` blocks.
    pub fn set_progress(&self, done: u64, total: u64) {
        self.total_blocks.store(total, Ordering::Relaxed);
        self.done_blocks.store(done, Ordering::Relaxed);
    }
}

/// Where a scan has got to, kept across restarts.
pub trait Cursor {
    /// The LBA to resume from, if a scan was interrupted.
    fn load(&self) -> Result<Option<u64>>;
    /// Record that every block before `lba` is done.
    fn save(&self, lba: u64) -> Result<()>;
    /// The scan finished: forget the cursor.
    fn clear(&self) -> Result<()>;
}

/// A cursor in a small text file, replaced atomically (write a temporary
/// file, fsync, rename): after a crash it holds the old or the new LBA.
pub struct CursorFile {
    path: PathBuf,
}

impl CursorFile {
    pub fn new(path: impl Into<PathBuf>) -> CursorFile {
        CursorFile { path: path.into() }
    }

    fn error(&self, action: &'static str, error: impl std::fmt::Display) -> Error {
        Error::Path {
            action,
            path: self.path.clone(),
            cause: error.to_string(),
        }
    }
}

impl Cursor for CursorFile {
    fn load(&self) -> Result<Option<u64>> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => text
                .trim()
                .parse::<u64>()
                .map(Some)
                .map_err(|error| self.error("parse the scan cursor", error)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(self.error("read the scan cursor", error)),
        }
    }

    fn save(&self, lba: u64) -> Result<()> {
        let temporary = self.path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&temporary)?;
            writeln!(file, "{lba}")?;
            file.sync_all()?;
            std::fs::rename(&temporary, &self.path)
        };
        write().map_err(|error| self.error("save the scan cursor", error))
    }

    fn clear(&self) -> Result<()> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(self.error("remove the scan cursor", error)),
        }
    }
}

/// Keeps a job at or under a byte rate by sleeping between chunks.
pub struct Throttle {
    bytes_per_second: Option<u64>,
    started: Instant,
    bytes: u64,
}

impl Throttle {
    /// `None`: no limit.
    pub fn new(bytes_per_second: Option<u64>) -> Throttle {
        Throttle {
            bytes_per_second: bytes_per_second.filter(|rate| *rate > 0),
            started: Instant::now(),
            bytes: 0,
        }
    }

    /// How long to wait after `bytes` more to stay at the rate.
    pub fn delay_after(&mut self, bytes: u64) -> Duration {
        self.bytes += bytes;
        let Some(rate) = self.bytes_per_second else {
            return Duration::ZERO;
        };
        let due = Duration::from_secs_f64(self.bytes as f64 / rate as f64);
        due.saturating_sub(self.started.elapsed())
    }

    pub fn pace(&mut self, bytes: u64) {
        let delay = self.delay_after(bytes);
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
    }
}

/// What to scan and how fast.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanOptions {
    /// Blocks `[start, end)`; `end` `None` means to the end of the device.
    pub start: u64,
    pub end: Option<u64>,
    /// Bytes per second read at most (`None`: as fast as it goes).
    pub rate_bytes_per_second: Option<u64>,
}

/// How a scan ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanEnd {
    Finished,
    /// Cancelled with every block before `at` done.
    Cancelled {
        at: u64,
    },
}

/// One chunk read by a scan: blocks `[lba, lba + count)`, their bytes
/// (faulty blocks zero-filled) and their faults.
pub struct Chunk<'a> {
    pub lba: u64,
    pub count: u64,
    pub data: &'a [u8],
    pub faults: &'a [Fault],
}

/// Scan `device` chunk by chunk, skipping holes, calling `visit` with each
/// chunk. With a `cursor`, resume where it says and save progress every
/// `CURSOR_SAVE_INTERVAL` and when cancelled (the
/// cursor never runs ahead of what `visit` has seen).
pub fn scan(
    device: &dyn BlockDevice,
    options: ScanOptions,
    control: &JobControl,
    cursor: Option<&dyn Cursor>,
    mut visit: impl FnMut(Chunk<'_>) -> Result<()>,
) -> Result<ScanEnd> {
    scan_prepared(
        device,
        options,
        control,
        cursor,
        |_| (),
        |chunk, ()| visit(chunk),
    )
}

/// `scan`, with `prepare` run on each chunk by the reader thread that read
/// it (in parallel, in any order: per-chunk work such as a digest), and its
/// result handed to `visit` with the chunk (in LBA order).
pub fn scan_prepared<T: Send>(
    device: &dyn BlockDevice,
    options: ScanOptions,
    control: &JobControl,
    cursor: Option<&dyn Cursor>,
    prepare: impl Fn(&Chunk<'_>) -> T + Sync,
    mut visit: impl FnMut(Chunk<'_>, T) -> Result<()>,
) -> Result<ScanEnd> {
    let blocks = device.size() / BLOCK;
    let end = options.end.unwrap_or(blocks).min(blocks);
    let resume = match cursor {
        Some(cursor) => cursor.load()?,
        None => None,
    };
    let mut lba = resume.unwrap_or(options.start).clamp(options.start, end);
    control.start(end - options.start, lba - options.start);
    let mut saved = (lba, Instant::now());
    let mut throttle = Throttle::new(options.rate_bytes_per_second);
    // Reading and verifying a chunk is the work (a page-cache copy and a
    // CRC per block): SCAN_READERS threads do it for the chunks ahead of
    // the one being visited. Chunks are handed out and visited in LBA
    // order, so the visitor and the cursor see what a one-thread scan sees.
    let (request_send, request_receive) = mpsc::channel::<ChunkRead>();
    let request_receive = Mutex::new(request_receive);
    let (done_send, done_receive) = mpsc::channel::<ChunkDone<T>>();
    std::thread::scope(|scope| {
        // Owned here, so that a panic below drops it and the readers end
        // before the scope joins them.
        let request_send = request_send;
        let mut readers = Vec::with_capacity(SCAN_READERS);
        for _ in 0..SCAN_READERS {
            let done_send = done_send.clone();
            let request_receive = &request_receive;
            let prepare = &prepare;
            readers.push(scope.spawn(move || loop {
                let request = request_receive.lock().recv();
                let Ok(mut read) = request else {
                    return; // the scan is over
                };
                let faults =
                    read_in_parts(device, read.lba, read.count, &mut read.data).map(|faults| {
                        let prepared = prepare(&Chunk {
                            lba: read.lba,
                            count: read.count,
                            data: &read.data,
                            faults: &faults,
                        });
                        (faults, prepared)
                    });
                if done_send.send((read, faults)).is_err() {
                    return;
                }
            }));
        }
        drop(done_send);
        let mut next = lba; // where the next chunk handed out starts
        let mut order: VecDeque<u64> = VecDeque::new(); // handed out, not visited
        let mut arrived: HashMap<u64, ChunkDone<T>> = HashMap::new();
        let mut spare: Vec<PageBuffer> = Vec::new();
        let result = (|| -> Result<ScanEnd> {
            loop {
                if control.is_cancelled() {
                    if let Some(cursor) = cursor {
                        if saved.0 != lba {
                            cursor.save(lba)?;
                        }
                    }
                    return Ok(ScanEnd::Cancelled { at: lba });
                }
                while order.len() < SCAN_AHEAD && next < end {
                    next = device.next_possible_data(next)?.min(end);
                    if next >= end {
                        break;
                    }
                    let count = (end - next).min(SCAN_CHUNK_BLOCKS - next % SCAN_CHUNK_BLOCKS);
                    let mut data = spare.pop().unwrap_or_default();
                    data.set_len((count * BLOCK) as usize);
                    let read = ChunkRead {
                        lba: next,
                        count,
                        data,
                    };
                    request_send
                        .send(read)
                        .expect("the scan's readers live until it ends");
                    order.push_back(next);
                    next += count;
                }
                let Some(&first) = order.front() else {
                    return Ok(ScanEnd::Finished);
                };
                let (read, faults) = loop {
                    if let Some(done) = arrived.remove(&first) {
                        break done;
                    }
                    // A reader that ended while chunks are handed out
                    // panicked with one of them: fail loudly, never wait
                    // for a chunk that will not come.
                    match done_receive.recv_timeout(READER_CHECK_INTERVAL) {
                        Ok(done) => {
                            arrived.insert(done.0.lba, done);
                        }
                        Err(_) if readers.iter().any(|reader| reader.is_finished()) => {
                            panic!("a scan reader thread panicked")
                        }
                        Err(_) => {}
                    }
                };
                order.pop_front();
                let (faults, prepared) = faults?;
                visit(
                    Chunk {
                        lba: read.lba,
                        count: read.count,
                        data: &read.data,
                        faults: &faults,
                    },
                    prepared,
                )?;
                lba = read.lba + read.count;
                control.advance(lba - options.start, read.count);
                spare.push(read.data);
                if let Some(cursor) = cursor {
                    if saved.1.elapsed() >= CURSOR_SAVE_INTERVAL {
                        cursor.save(lba)?;
                        saved = (lba, Instant::now());
                    }
                }
                throttle.pace(read.count * BLOCK);
            }
        })();
        // Closing the request channel ends the readers (after the chunk
        // each may be reading); the scope waits for them.
        drop(request_send);
        let end_state = result?;
        if end_state == ScanEnd::Finished {
            control
                .done_blocks
                .store(end - options.start, Ordering::Relaxed);
            if let Some(cursor) = cursor {
                cursor.clear()?;
            }
        }
        Ok(end_state)
    })
}

/// Read and verify a chunk in parts of `READ_PART_BLOCKS`, so that each
/// part's CRCs run over bytes still in the core's cache from the copy.
fn read_in_parts(
    device: &dyn BlockDevice,
    first: u64,
    count: u64,
    out: &mut [u8],
) -> Result<Vec<Fault>> {
    let mut faults = Vec::new();
    let mut at = 0;
    while at < count {
        let n = (count - at).min(READ_PART_BLOCKS);
        let part = &mut out[(at * BLOCK) as usize..((at + n) * BLOCK) as usize];
        faults.extend(device.read_blocks_collecting(first + at, n, part)?);
        at += n;
    }
    Ok(faults)
}

/// A chunk back from a scan reader: the chunk, and its faults and the
/// result of `prepare` (or the read's error).
type ChunkDone<T> = (ChunkRead, Result<(Vec<Fault>, T)>);

/// One chunk handed to a scan reader: where, how many blocks, the buffer.
struct ChunkRead {
    lba: u64,
    count: u64,
    data: PageBuffer,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_spaces_bytes_at_its_rate() {
        let mut throttle = Throttle::new(Some(1 << 20));
        // 4 MiB at 1 MiB/s is due after 4 s; almost nothing has elapsed.
        let delay = throttle.delay_after(4 << 20);
        assert!(delay > Duration::from_millis(3900), "{delay:?}");
        let mut unlimited = Throttle::new(None);
        assert_eq!(unlimited.delay_after(1 << 40), Duration::ZERO);
    }

    #[test]
    fn a_cursor_file_survives_and_clears() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cursor = CursorFile::new(dir.path().join("scan.cursor"));
        assert_eq!(cursor.load().expect("load"), None);
        cursor.save(512).expect("save");
        assert_eq!(
            CursorFile::new(dir.path().join("scan.cursor"))
                .load()
                .expect("load"),
            Some(512)
        );
        cursor.clear().expect("clear");
        assert_eq!(cursor.load().expect("load"), None);
        std::fs::write(dir.path().join("scan.cursor"), "not a number").expect("write");
        let error = cursor.load().expect_err("garbage is refused");
        assert!(error.to_string().contains("scan.cursor"), "{error}");
    }
}
