//! Background jobs as one mechanism. A job is a `Visit`: it goes through
//! a set of positions step by step, paced by one `Pacer` (a fixed rate, or
//! a floor and a ceiling that backs off under foreground load), reporting
//! progress and taking a cancel through a `JobControl`, and keeping where
//! it stands (every position before it done) in a `Cursor` when it
//! resumes. A position is an LBA, or a count of the blocks of a set the
//! job walks in its own order; a set that grows behind the job (a dirty
//! map marked again) moves its end (`Visit::set_end`):
//! - `scan`: a chunked scan over a `BlockDevice` that skips holes, reads
//!   and verifies on reader threads and can resume from a persisted
//!   `Cursor`. `check`, `export`, `verify` and a volume's `scrub` run on it;
//! - a mirror's scrub (vouch-mirror's `scrub.rs`) walks the same chunks on the
//!   same grid (`ChunkWalk`), its step reading every leg and repairing on
//!   the caller's thread, with a cursor of its own;
//! - copy (`copy.rs`, both methods) and `verify::compare_ranges`: positions
//!   are the blocks copied or compared;
//! - a mirror's resync (positions: blocks copied out of its dirty map, the
//!   end the blocks copied plus those the map still marks) and
//!   reconciliation (positions: blocks of the activity log's extents in
//!   their order), each stopping also when the mirror says so
//!   (`Visit::stop_when`), paced by `Pace::FloorCeiling`.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use crate::buffer::PageBuffer;
use crate::device::BlockDevice;
use crate::error::{Error, Fault, Result};
use crate::replace::replace_file;
use crate::state::BLOCK;

/// Blocks read per step of a scan (1 MiB). A scan's chunks end on a fixed
/// grid (`step_end`): the multiples of it, each moved down to the start of
/// the metadata unit holding it on a device whose units are smaller (a
/// packed row), so a resumed scan reads the same chunks.
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
    /// Times the job's pacer waited.
    paced_waits: AtomicU64,
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
    /// Times the job waited for its pace (its rate, or foreground requests).
    pub fn paced_waits(&self) -> u64 {
        self.paced_waits.load(Ordering::Relaxed)
    }

    /// Pace the job after a step that moved `bytes` (`Pacer::pace`), an
    /// early end to the wait on a cancel or once `stop` says so, counting
    /// the waits.
    fn pace(&self, pacer: &mut Pacer<'_>, bytes: u64, stop: Option<&dyn Fn() -> bool>) {
        let stop = || self.is_cancelled() || stop.is_some_and(|stop| stop());
        if pacer.pace(bytes, &stop) {
            self.paced_waits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A job over `total` blocks starts with `done` of them behind it.
    pub(crate) fn start(&self, total: u64, done: u64) {
        self.total_blocks.store(total, Ordering::Relaxed);
        self.done_blocks.store(done, Ordering::Relaxed);
    }

    /// The job's set holds `total` blocks now.
    fn resize(&self, total: u64) {
        self.total_blocks.store(total, Ordering::Relaxed);
    }

    /// `done` blocks of the job are behind it now, `read` more were read.
    pub(crate) fn advance(&self, done: u64, read: u64) {
        self.read_blocks.fetch_add(read, Ordering::Relaxed);
        self.done_blocks.store(done, Ordering::Relaxed);
    }
}

/// Where a job (`Visit`) has got to, kept across restarts.
pub trait Cursor {
    /// The position to resume from, if a job was interrupted.
    fn load(&self) -> Result<Option<u64>>;
    /// Record that every position before `lba` is done.
    fn save(&self, lba: u64) -> Result<()>;
    /// The job finished: forget the cursor.
    fn clear(&self) -> Result<()>;
}

/// A cursor in a small text file, replaced atomically and durably
/// (`replace_file`: temporary file, fsync, rename, directory fsync): after
/// a crash it holds the old or the new LBA.
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
        replace_file(&temporary, &self.path, format!("{lba}\n").as_bytes())
            .map_err(|error| self.error("save the scan cursor", error))
    }

    fn clear(&self) -> Result<()> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(self.error("remove the scan cursor", error)),
        }
    }
}

/// How long a job waits before its next step when foreground requests
/// arrived during the last one (and its pace would not wait longer).
pub const FOREGROUND_BACKOFF: Duration = Duration::from_millis(5);

/// A pacer sleeps in naps of at most this, so that a cancel or a stopping
/// server ends a slow job's wait promptly.
const PACE_NAP: Duration = Duration::from_millis(50);

/// A monotonic count of foreground requests (the NBD server's, or a
/// mirror's own): a job whose count moved during a step yields.
pub type Foreground = Arc<dyn Fn() -> u64 + Send + Sync>;

/// How fast a job may go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pace {
    /// As fast as it goes.
    #[default]
    Unlimited,
    /// At most this many bytes per second, averaged over the job so far.
    Fixed(u64),
    /// A floor and a ceiling in bytes per second (DRBD's
    /// c-min-rate/c-max-rate, md's speed_limit_min/max): each step runs at
    /// the ceiling while no foreground request arrived during the last
    /// one, at the floor while they do.
    FloorCeiling { min: u64, max: u64 },
}

impl Pace {
    /// `Fixed(rate)`, or `Unlimited` for `None` or 0.
    pub fn fixed(bytes_per_second: Option<u64>) -> Pace {
        match bytes_per_second {
            Some(rate) if rate > 0 => Pace::Fixed(rate),
            _ => Pace::Unlimited,
        }
    }
}

/// The one pacing of every job (each `Visit`): after each step the job
/// calls `pace` with the bytes it moved, and the pacer waits as long as `Pace` says (when
/// foreground requests arrived meanwhile: the floor of a `FloorCeiling`,
/// at least `FOREGROUND_BACKOFF` otherwise).
pub struct Pacer<'a> {
    pace: Pace,
    foreground: Option<&'a (dyn Fn() -> u64 + Send + Sync)>,
    /// The foreground count when the current step began.
    seen: u64,
    started: Instant,
    bytes: u64,
    step_started: Instant,
    waits: u64,
}

impl<'a> Pacer<'a> {
    /// A job starts now; `foreground` is read once here, then once per
    /// step (and once more after a wait).
    pub fn new(pace: Pace, foreground: Option<&'a (dyn Fn() -> u64 + Send + Sync)>) -> Pacer<'a> {
        let now = Instant::now();
        Pacer {
            pace,
            foreground,
            seen: foreground.map_or(0, |count| count()),
            started: now,
            bytes: 0,
            step_started: now,
            waits: 0,
        }
    }

    /// How long to wait after a step that moved `bytes` (and whether
    /// foreground requests arrived during it: `busy`).
    fn delay_after(&mut self, bytes: u64, busy: bool) -> Duration {
        self.delay_after_at(bytes, busy, Instant::now())
    }

    /// `delay_after`, the step ending at `now`.
    fn delay_after_at(&mut self, bytes: u64, busy: bool, now: Instant) -> Duration {
        self.bytes += bytes;
        let due = |bytes: u64, rate: u64, since: Instant| {
            Duration::from_secs_f64(bytes as f64 / rate.max(1) as f64)
                .saturating_sub(now.saturating_duration_since(since))
        };
        let paced = match self.pace {
            Pace::Unlimited => Duration::ZERO,
            Pace::Fixed(rate) => due(self.bytes, rate, self.started),
            Pace::FloorCeiling { min, max } => {
                due(bytes, if busy { min } else { max }, self.step_started)
            }
        };
        match self.pace {
            // The floor is the yield.
            Pace::FloorCeiling { .. } => paced,
            _ if busy => paced.max(FOREGROUND_BACKOFF),
            _ => paced,
        }
    }

    /// The step that just ended moved `bytes`: wait before the next one as
    /// the pace says, in naps, returning early once `stop` says so.
    /// Returns whether it waited.
    pub fn pace(&mut self, bytes: u64, stop: &dyn Fn() -> bool) -> bool {
        let busy = match self.foreground {
            Some(count) => {
                let now = count();
                let moved = now != self.seen;
                self.seen = now;
                moved
            }
            None => false,
        };
        let mut left = self.delay_after(bytes, busy);
        let waited = !left.is_zero();
        while !left.is_zero() && !stop() {
            let nap = left.min(PACE_NAP);
            std::thread::sleep(nap);
            left -= nap;
        }
        if waited {
            self.waits += 1;
            // Requests that arrived while waiting were let go first: the
            // next step starts with the count as it is now.
            if let Some(count) = self.foreground {
                self.seen = count();
            }
        }
        self.step_started = Instant::now();
        waited
    }

    /// How many times the pacer waited.
    pub fn waits(&self) -> u64 {
        self.waits
    }
}

/// A job's speed so far and the time it has left at that speed, as the
/// progress of a resync, a reconciliation and a control API job show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Throughput {
    /// Bytes per second over the job so far.
    pub rate: u64,
    /// Seconds to go at that rate (`None` before a rate is known).
    pub eta_seconds: Option<u64>,
    pub elapsed_ms: u64,
}

impl Throughput {
    /// A job started at `started` with `done` blocks behind it and `left`
    /// to go.
    pub fn measure(started: Instant, done: u64, left: u64) -> Throughput {
        let elapsed = started.elapsed();
        let rate = if elapsed.as_secs_f64() > 0.0 {
            (done as f64 * BLOCK as f64 / elapsed.as_secs_f64()) as u64
        } else {
            0
        };
        Throughput {
            rate,
            eta_seconds: (rate > 0).then(|| left * BLOCK / rate),
            elapsed_ms: elapsed.as_millis() as u64,
        }
    }
}

/// One run of a job over the positions `[start, end)` (LBAs, or blocks of
/// the set it walks: a copy's blocks, a resync's blocks copied, a
/// reconciliation's blocks of its extents), the loop every job steps
/// through (scan, a mirror's scrub, copy, compare, resync, reconcile):
/// where it stands (every position before `at` is done),
/// its progress and cancel in a `JobControl`, its `Pacer`, and for a job
/// that resumes a `Cursor`, saved at a pause between steps every
/// `CURSOR_SAVE_INTERVAL` and when cancelled, never ahead of what is done.
pub struct Visit<'a> {
    control: &'a JobControl,
    pacer: Pacer<'a>,
    cursor: Option<&'a dyn Cursor>,
    start: u64,
    end: u64,
    at: u64,
    /// Where this run began.
    began: u64,
    /// Where the cursor was saved last, and when.
    saved: (u64, Instant),
    /// Stops the job as a cancel does (`stop_when`).
    stop: Option<&'a dyn Fn() -> bool>,
}

impl<'a> Visit<'a> {
    /// Start a run over `range` at `pace`, yielding to `foreground`, from
    /// where `cursor` says (clamped to the range) or from the start.
    pub fn begin(
        control: &'a JobControl,
        range: std::ops::Range<u64>,
        pace: Pace,
        foreground: Option<&'a (dyn Fn() -> u64 + Send + Sync)>,
        cursor: Option<&'a dyn Cursor>,
    ) -> Result<Visit<'a>> {
        let (start, end) = (range.start.min(range.end), range.end);
        let resume = match cursor {
            Some(cursor) => cursor.load()?,
            None => None,
        };
        let at = resume.unwrap_or(start).clamp(start, end);
        control.start(end - start, at - start);
        Ok(Visit {
            control,
            pacer: Pacer::new(pace, foreground),
            cursor,
            start,
            end,
            at,
            began: at,
            saved: (at, Instant::now()),
            stop: None,
        })
    }

    /// Stop also once `stop` says so (a mirror stopping, a resyncing leg
    /// that failed), as on a cancel: a wait for the pace ends then.
    pub fn stop_when(self, stop: &'a dyn Fn() -> bool) -> Visit<'a> {
        Visit {
            stop: Some(stop),
            ..self
        }
    }

    /// The set walked now ends at `end` (never before what is done): a
    /// resync's dirty map, marked again behind it, grows.
    pub fn set_end(&mut self, end: u64) {
        self.end = end.max(self.at);
        self.control.resize(self.end - self.start);
    }

    /// Every position before this one is done.
    pub fn at(&self) -> u64 {
        self.at
    }

    /// The run began where an earlier one stopped (its cursor).
    pub fn resumed(&self) -> bool {
        self.began > self.start
    }

    /// Whether the job was cancelled; if so, its cursor now says where it
    /// stands.
    pub fn cancelled(&mut self) -> Result<bool> {
        if !self.control.is_cancelled() && !self.stop.is_some_and(|stop| stop()) {
            return Ok(false);
        }
        if let Some(cursor) = self.cursor {
            if self.saved.0 != self.at {
                cursor.save(self.at)?;
                self.saved = (self.at, Instant::now());
            }
        }
        Ok(true)
    }

    /// Every position before `to` is done; `read` blocks were read on the
    /// way (holes skipped are not).
    pub fn advance(&mut self, to: u64, read: u64) {
        self.at = to.clamp(self.at, self.end);
        self.control.advance(self.at - self.start, read);
    }

    /// A pause between steps (no lock held): save the cursor if it is
    /// due, then wait as the pace says after a step that moved `bytes`.
    pub fn pace(&mut self, bytes: u64) -> Result<()> {
        if let Some(cursor) = self.cursor {
            if self.saved.1.elapsed() >= CURSOR_SAVE_INTERVAL {
                cursor.save(self.at)?;
                self.saved = (self.at, Instant::now());
            }
        }
        self.control.pace(&mut self.pacer, bytes, self.stop);
        Ok(())
    }

    /// `advance` to `to`, then `pace` after the step's `bytes`.
    pub fn step(&mut self, to: u64, read: u64, bytes: u64) -> Result<()> {
        self.advance(to, read);
        self.pace(bytes)
    }

    /// The loop of a job: call `step` until it says nothing is left
    /// (`false`: the run finishes, `ScanEnd::Finished`) or the job is
    /// cancelled or stopped (looked at before each step, its cursor saved:
    /// `ScanEnd::Cancelled`). Each step moves the run itself (`step`, or
    /// `advance` then `pace`; `set_end` if its set grew).
    pub fn run(mut self, mut step: impl FnMut(&mut Visit<'a>) -> Result<bool>) -> Result<ScanEnd> {
        loop {
            if self.cancelled()? {
                return Ok(ScanEnd::Cancelled { at: self.at });
            }
            if !step(&mut self)? {
                self.finish()?;
                return Ok(ScanEnd::Finished);
            }
        }
    }

    /// The run reached its end: the whole range is done and the cursor
    /// forgotten.
    pub fn finish(mut self) -> Result<()> {
        self.advance(self.end, 0);
        match self.cursor {
            Some(cursor) => cursor.clear(),
            None => Ok(()),
        }
    }
}

/// What to scan and how fast.
#[derive(Clone, Default)]
pub struct ScanOptions {
    /// Blocks `[start, end)`; `end` `None` means to the end of the device.
    pub start: u64,
    pub end: Option<u64>,
    /// Bytes per second read at most (`None`: as fast as it goes).
    pub rate_bytes_per_second: Option<u64>,
    /// Foreground requests to yield to (`Pacer`).
    pub foreground: Option<Foreground>,
    /// Chunks end exactly on multiples of `SCAN_CHUNK_BLOCKS`, not moved
    /// to metadata units (a verify's digest segments are defined on them).
    pub fixed_chunks: bool,
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
    let ChunkWalk {
        mut run,
        mut chunks,
    } = ChunkWalk::begin(device, &options, control, cursor)?;
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
        let mut order: VecDeque<u64> = VecDeque::new(); // handed out, not visited
        let mut arrived: HashMap<u64, ChunkDone<T>> = HashMap::new();
        let mut spare: Vec<PageBuffer> = Vec::new();
        let result = (|| -> Result<ScanEnd> {
            loop {
                if run.cancelled()? {
                    return Ok(ScanEnd::Cancelled { at: run.at() });
                }
                while order.len() < SCAN_AHEAD {
                    let Some(chunk) = chunks.next_chunk()? else {
                        break;
                    };
                    let count = chunk.end - chunk.start;
                    let mut data = spare.pop().unwrap_or_default();
                    data.set_len((count * BLOCK) as usize);
                    let read = ChunkRead {
                        lba: chunk.start,
                        count,
                        data,
                    };
                    request_send
                        .send(read)
                        .expect("the scan's readers live until it ends");
                    order.push_back(chunk.start);
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
                run.advance(read.lba + read.count, read.count);
                spare.push(read.data);
                run.pace(read.count * BLOCK)?;
            }
        })();
        // Closing the request channel ends the readers (after the chunk
        // each may be reading); the scope waits for them.
        drop(request_send);
        let end_state = result?;
        if end_state == ScanEnd::Finished {
            run.finish()?;
        }
        Ok(end_state)
    })
}

/// A scan under way without its readers: its `Visit` (range, pace,
/// cursor, progress) and the chunks it steps through. `scan` hands the
/// chunks to reader threads; a job whose step is more than a read (a
/// mirror's scrub reads every leg and repairs under the stripe lock) runs
/// its step on the caller's thread with `run`, on the same grid.
pub struct ChunkWalk<'a> {
    run: Visit<'a>,
    chunks: Chunks<'a>,
}

impl<'a> ChunkWalk<'a> {
    /// Start a scan of `device` as `options` say, from where `cursor` says.
    pub fn begin(
        device: &'a dyn BlockDevice,
        options: &'a ScanOptions,
        control: &'a JobControl,
        cursor: Option<&'a dyn Cursor>,
    ) -> Result<ChunkWalk<'a>> {
        let blocks = device.size() / BLOCK;
        let end = options.end.unwrap_or(blocks).min(blocks);
        let run = Visit::begin(
            control,
            options.start..end,
            Pace::fixed(options.rate_bytes_per_second),
            options.foreground.as_deref(),
            cursor,
        )?;
        let chunks = Chunks {
            device,
            grid: Grid {
                step: SCAN_CHUNK_BLOCKS,
                units: !options.fixed_chunks,
            },
            next: run.at(),
            end,
        };
        Ok(ChunkWalk { run, chunks })
    }

    /// The scan began where an earlier one stopped (its cursor).
    pub fn resumed(&self) -> bool {
        self.run.resumed()
    }

    /// Every block before this one is done.
    pub fn at(&self) -> u64 {
        self.run.at()
    }

    /// Call `step` with each chunk that may hold data, in LBA order, as
    /// `scan` visits them: the cancel looked at before each, progress,
    /// pace and cursor after each (the chunk's blocks counted as read).
    pub fn run(self, mut step: impl FnMut(Range<u64>) -> Result<()>) -> Result<ScanEnd> {
        let ChunkWalk { run, mut chunks } = self;
        run.run(|run| {
            let Some(chunk) = chunks.next_chunk()? else {
                return Ok(false);
            };
            let count = chunk.end - chunk.start;
            step(chunk.clone())?;
            run.step(chunk.end, count, count * BLOCK)?;
            Ok(true)
        })
    }
}

/// The chunks of a scan, in LBA order: from `next` to `end`, holes
/// skipped, each ending on the scan's grid.
struct Chunks<'a> {
    device: &'a dyn BlockDevice,
    grid: Grid,
    /// Where the next chunk starts at the earliest.
    next: u64,
    end: u64,
}

impl Chunks<'_> {
    /// The next chunk that may hold data (`None`: none is left).
    fn next_chunk(&mut self) -> Result<Option<Range<u64>>> {
        if self.next >= self.end {
            return Ok(None);
        }
        let found = self.device.next_possible_data(self.next)?.min(self.end);
        if found >= self.end {
            self.next = self.end;
            return Ok(None);
        }
        // From the start of the chunk that holds it, so chunks stay on
        // their grid after a hole.
        let first = grid_start(self.device, found, self.grid).max(self.next);
        let end = step_end(self.device, first, self.grid).min(self.end);
        self.next = end;
        Ok(Some(first..end))
    }
}

/// Where a scan's steps end: after the multiples of `step`, each moved
/// down to the start of the metadata unit holding it (`units`) when the
/// device's units are smaller than a step. A packed row (31 blocks) that a
/// step boundary splits is read whole by each step holding part of it, to
/// judge the row against its expected generation (`judge_rows`); on the
/// grid of rows each row is read once. Split pages (128 blocks) divide
/// the steps already.
#[derive(Clone, Copy)]
struct Grid {
    step: u64,
    units: bool,
}

impl Grid {
    /// The `k`th boundary.
    fn boundary(self, device: &dyn BlockDevice, k: u64) -> u64 {
        let lba = k * self.step;
        if !self.units || lba >= device.size() / BLOCK {
            return lba;
        }
        let unit = device.metadata_unit(lba);
        if unit.end - unit.start < self.step {
            unit.start.min(lba)
        } else {
            lba
        }
    }
}

/// The end of the scan chunk that holds `at` (on `device`'s grid of
/// metadata units): a job stepping through a range of its own in chunks
/// (a mirror's reconciliation of its extents) ends them where a scan does.
pub fn chunk_end(device: &dyn BlockDevice, at: u64) -> u64 {
    step_end(
        device,
        at,
        Grid {
            step: SCAN_CHUNK_BLOCKS,
            units: true,
        },
    )
}

/// The first boundary of `grid` after `at`.
fn step_end(device: &dyn BlockDevice, at: u64, grid: Grid) -> u64 {
    let mut k = at / grid.step + 1;
    loop {
        let boundary = grid.boundary(device, k);
        if boundary > at {
            return boundary;
        }
        k += 1;
    }
}

/// The last boundary of `grid` at or before `at` (0 is one).
fn grid_start(device: &dyn BlockDevice, at: u64, grid: Grid) -> u64 {
    let mut k = at / grid.step + 1;
    loop {
        let boundary = grid.boundary(device, k);
        if boundary <= at || k == 0 {
            return boundary;
        }
        k -= 1;
    }
}

/// Read and verify a chunk in parts of `READ_PART_BLOCKS` (on their grid,
/// so a part holds whole packed rows), so that each part's CRCs run over
/// bytes still in the core's cache from the copy.
fn read_in_parts(
    device: &dyn BlockDevice,
    first: u64,
    count: u64,
    out: &mut [u8],
) -> Result<Vec<Fault>> {
    let grid = Grid {
        step: READ_PART_BLOCKS,
        units: true,
    };
    let mut faults = Vec::new();
    let mut at = 0;
    while at < count {
        let n = step_end(device, first + at, grid).min(first + count) - (first + at);
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
    fn a_pacer_spaces_bytes_at_its_rate_and_yields() {
        // Each step ends at a given instant, not the clock's now: the
        // delays are exact however slowly the test runs.
        let mut fixed = Pacer::new(Pace::Fixed(1 << 20), None);
        let start = fixed.started;
        // 4 MiB at 1 MiB/s is due after 4 s; 1 s has passed.
        let delay = fixed.delay_after_at(4 << 20, false, start + Duration::from_secs(1));
        assert_eq!(delay, Duration::from_secs(3));
        // Late: 5 MiB were due by 5 s, it is 6 s.
        let late = fixed.delay_after_at(1 << 20, false, start + Duration::from_secs(6));
        assert_eq!(late, Duration::ZERO);
        let mut unlimited = Pacer::new(Pace::fixed(None), None);
        assert_eq!(unlimited.delay_after(1 << 40, false), Duration::ZERO);
        assert_eq!(unlimited.delay_after(1 << 20, true), FOREGROUND_BACKOFF);
        // 1 MiB: a second at a 1 MiB/s floor (busy), 1/64 s at the
        // ceiling, each from its step's start.
        let mut adaptive = Pacer::new(
            Pace::FloorCeiling {
                min: 1 << 20,
                max: 64 << 20,
            },
            None,
        );
        let step = adaptive.step_started;
        let busy = adaptive.delay_after_at(1 << 20, true, step);
        assert_eq!(busy, Duration::from_secs(1));
        let idle = adaptive.delay_after_at(1 << 20, false, step);
        assert_eq!(idle, Duration::from_secs(1) / 64);
    }

    #[test]
    fn a_pacer_counts_its_waits_and_a_stop_ends_one() {
        let requests = AtomicU64::new(0);
        let count = || requests.fetch_add(1, Ordering::Relaxed);
        let mut pacer = Pacer::new(Pace::Fixed(1), Some(&count));
        // Due in 2^20 s: the stop ends the wait at once.
        assert!(pacer.pace(1 << 20, &|| true));
        assert_eq!(pacer.waits(), 1);
        let mut quiet = Pacer::new(Pace::Unlimited, None);
        assert!(!quiet.pace(1 << 20, &|| false));
        assert_eq!(quiet.waits(), 0);
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
