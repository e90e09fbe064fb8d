//! The before-image layer: a `Storage` wrapper that, while armed, keeps the
//! old bytes of every home write (docs/FORMAT.md, "Before-image log").
//!
//! A fenced snapshot (`snapshot/fenced.rs`) fixes its point in time without
//! cloning anything under the flush point: it writes the fence and arms this
//! layer there. From then on every write, hole punch or clone into the
//! volume's data segments, context table or written map first reads the old
//! bytes of the 4 KiB blocks it covers that are not imaged yet, appends them
//! to the log (`.NAME.partial/before`) as checksummed records bound to their
//! object and offset, and syncs the log; only then is the home write issued
//! (ORDER POINT). The first image of a block is its bytes at the fence: the
//! background materialisation clones the live files and writes each block's
//! first image back over the clone. One sync per call (a `write_runs` batch
//! of a commit or checkpoint is imaged with one sync), not per block.
//!
//! Disarmed, each write costs one atomic load: the layer is beside the
//! engine, not a branch in its write path.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::imaged::{
    decode_index, encode_index, kind_of, object_of, ImagedSet, IndexStore, INDEX_TAIL_BYTES,
};
use super::{CloneRange, CloneTiming, Mapped, ObjectId, ReadLater, Run, RunError, Storage};

/// A record's first 4 bytes: "VBI1".
pub const RECORD_MAGIC: u32 = 0x3149_4256;
/// A record's header, before its payload.
pub const RECORD_HEADER_BYTES: usize = 40;
/// The unit imaged: a record covers whole 4 KiB blocks.
pub const IMAGE_BLOCK: u64 = 4096;

/// A record header's fields: (name, offset, size), as docs/FORMAT.md's
/// table "Before-image record header" lists them (a test compares).
pub const RECORD_FIELDS: &[(&str, usize, usize)] = &[
    ("magic", 0, 4),
    ("kind", 4, 1),
    ("reserved", 5, 3),
    ("segment", 8, 4),
    ("len", 12, 4),
    ("offset", 16, 8),
    ("fence", 24, 8),
    ("crc", 32, 4),
    ("reserved2", 36, 4),
];

/// Orderings the layer can be told to break, to show the checks catch them.
/// Production passes the default (none).
#[derive(Clone, Copy, Debug, Default)]
pub struct BeforeBreaks {
    /// Issue the home write before the log is synced (the image is
    /// appended, the home write goes, then the sync).
    pub write_before_sync: bool,
    /// Image every write again (as a layer that lost count of the blocks
    /// it imaged would), and have `first_images` keep a block's last image
    /// instead of its first.
    pub last_image_wins: bool,
}

/// Whether writes to `object` are imaged: the files a snapshot clones.
pub fn is_imaged(object: ObjectId) -> bool {
    matches!(
        object,
        ObjectId::Data(_) | ObjectId::Contexts | ObjectId::Written
    )
}

/// One record: the old bytes (`payload`, whole blocks) of `object` at
/// `offset`, taken under fence `fence`.
pub fn encode_record(fence: u64, object: ObjectId, offset: u64, payload: &[u8]) -> Vec<u8> {
    debug_assert!(
        offset.is_multiple_of(IMAGE_BLOCK) && (payload.len() as u64).is_multiple_of(IMAGE_BLOCK)
    );
    let (kind, segment) = kind_of(object);
    let mut record = Vec::with_capacity(RECORD_HEADER_BYTES + payload.len());
    record.extend_from_slice(&RECORD_MAGIC.to_le_bytes()); // 0..4
    record.push(kind); // 4
    record.extend_from_slice(&[0; 3]); // 5..8
    record.extend_from_slice(&segment.to_le_bytes()); // 8..12
    record.extend_from_slice(&(payload.len() as u32).to_le_bytes()); // 12..16
    record.extend_from_slice(&offset.to_le_bytes()); // 16..24
    record.extend_from_slice(&fence.to_le_bytes()); // 24..32
    record.extend_from_slice(&[0; 8]); // 32..40: crc, reserved
    record.extend_from_slice(payload);
    let crc = crc32c::crc32c_append(header_crc(&record[..RECORD_HEADER_BYTES]), payload);
    record[32..36].copy_from_slice(&crc.to_le_bytes());
    record
}

/// CRC32C of a record's header with its crc field taken as zero (the
/// payload's is appended to it).
fn header_crc(header: &[u8]) -> u32 {
    let mut bytes = [0u8; RECORD_HEADER_BYTES];
    bytes.copy_from_slice(&header[..RECORD_HEADER_BYTES]);
    bytes[32..36].fill(0);
    crc32c::crc32c(&bytes)
}

/// A record read back: its object, offset, and where its payload is in
/// the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub object: ObjectId,
    pub offset: u64,
    pub payload_at: u64,
    pub len: u64,
}

/// How a log's valid records end.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogEnd {
    /// Every byte is in a valid record.
    Whole,
    /// From byte `at` on nothing is a valid record: the tail a crash tore
    /// (appends never synced, so their home writes were never issued), or
    /// damage to the very last record, which cannot be told from a tear.
    Torn { at: u64 },
    /// The record at byte `at` is bad, yet a valid record of this fence
    /// follows at byte `later`: the bad one was (most likely) damaged
    /// after it was durable (a media error), and its images, the bytes at
    /// the fence of blocks written home since, may be lost. Fail-safe: a
    /// power cut that lands a later page of the unsynced appends before an
    /// earlier one reads so too, and fails the snapshot, never its data.
    Corrupt { at: u64, later: u64 },
}

/// The valid prefix of a log and how it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scanned {
    /// Bytes of valid records from byte 0.
    pub valid: u64,
    pub end: LogEnd,
}

/// The bytes read at a time by `scan_log` (and `fenced::materialise`):
/// the log is never read whole into memory.
pub const SCAN_PIECE: usize = 1 << 20;

/// A log read in pieces of at most `piece` bytes (more only for a single
/// read that asks for more), up to the length it had when made.
struct Pieces<'a> {
    log: &'a dyn BeforeLog,
    len: u64,
    piece: usize,
    buf: Vec<u8>,
    buf_at: u64,
}

impl Pieces<'_> {
    /// Bytes `at..at + n`, or `None` past the end.
    fn get(&mut self, at: u64, n: usize) -> io::Result<Option<&[u8]>> {
        let end = match at.checked_add(n as u64) {
            Some(end) if end <= self.len => end,
            _ => return Ok(None),
        };
        if at < self.buf_at || end > self.buf_at + self.buf.len() as u64 {
            let want = (n.max(self.piece) as u64).min(self.len - at) as usize;
            self.buf.resize(want, 0);
            self.log.read_at(at, &mut self.buf)?;
            self.buf_at = at;
        }
        let from = (at - self.buf_at) as usize;
        Ok(Some(&self.buf[from..from + n]))
    }

    /// The valid record of `fence` at byte `at`, if there is one there
    /// (its checksum computed piece by piece).
    fn record_at(&mut self, at: u64, fence: u64) -> io::Result<Option<Record>> {
        let Some(header) = self.get(at, RECORD_HEADER_BYTES)? else {
            return Ok(None);
        };
        let u32_at = |from: usize| u32::from_le_bytes(header[from..from + 4].try_into().unwrap());
        let u64_at = |from: usize| u64::from_le_bytes(header[from..from + 8].try_into().unwrap());
        if u32_at(0) != RECORD_MAGIC || u64_at(24) != fence {
            return Ok(None);
        }
        let len = u64::from(u32_at(12));
        let Some(object) = object_of(header[4], u32_at(8)) else {
            return Ok(None);
        };
        if len == 0 || !len.is_multiple_of(IMAGE_BLOCK) {
            return Ok(None);
        }
        let (offset, crc) = (u64_at(16), u32_at(32));
        let mut sum = header_crc(header);
        let payload_at = at + RECORD_HEADER_BYTES as u64;
        let mut done = 0u64;
        while done < len {
            let step = (len - done).min(self.piece.max(1) as u64) as usize;
            let Some(bytes) = self.get(payload_at + done, step)? else {
                return Ok(None);
            };
            sum = crc32c::crc32c_append(sum, bytes);
            done += step as u64;
        }
        Ok((sum == crc).then_some(Record {
            object,
            offset,
            payload_at,
            len,
        }))
    }
}

/// Read `log` (records of `fence`) in pieces of `piece` bytes: `visit`
/// is given each valid record from byte 0 in order, and the answer says
/// where they end and how (`LogEnd`). Past the first bad byte the rest is
/// searched for any valid record of this fence: one found makes the end
/// `LogEnd::Corrupt` (the bad record may have been synced and followed by
/// its home write), none a torn tail.
pub fn scan_log(
    log: &dyn BeforeLog,
    fence: u64,
    piece: usize,
    visit: &mut dyn FnMut(&Record),
) -> io::Result<Scanned> {
    scan_log_from(log, fence, 0, piece, visit)
}

/// `scan_log` from byte `from` (a record boundary: the end of the records
/// an index covers), every offset in the answer from the log's start.
pub fn scan_log_from(
    log: &dyn BeforeLog,
    fence: u64,
    from: u64,
    piece: usize,
    visit: &mut dyn FnMut(&Record),
) -> io::Result<Scanned> {
    let mut pieces = Pieces {
        log,
        len: log.bytes()?,
        piece,
        buf: Vec::new(),
        buf_at: 0,
    };
    let mut at = from;
    while let Some(record) = pieces.record_at(at, fence)? {
        visit(&record);
        at = record.payload_at + record.len;
    }
    if at >= pieces.len {
        return Ok(Scanned {
            valid: at,
            end: LogEnd::Whole,
        });
    }
    let magic = RECORD_MAGIC.to_le_bytes();
    let mut later = at + 1;
    while later + RECORD_HEADER_BYTES as u64 <= pieces.len {
        let is_magic = pieces.get(later, 4)?.is_some_and(|bytes| bytes == magic);
        if is_magic && pieces.record_at(later, fence)?.is_some() {
            return Ok(Scanned {
                valid: at,
                end: LogEnd::Corrupt { at, later },
            });
        }
        later += 1;
    }
    Ok(Scanned {
        valid: at,
        end: LogEnd::Torn { at },
    })
}

/// A log held in memory, read as the file would be.
struct SliceLog<'a>(&'a [u8]);

impl BeforeLog for SliceLog<'_> {
    fn bytes(&self) -> io::Result<u64> {
        Ok(self.0.len() as u64)
    }
    fn read_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        let at = at as usize;
        let bytes = self
            .0
            .get(at..at + buf.len())
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(bytes);
        Ok(())
    }
    fn write_at(&self, _: u64, _: &[u8]) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::PermissionDenied))
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    fn truncate(&self, _: u64) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::PermissionDenied))
    }
}

/// The valid records of `log` (under `fence`), in order, and how they end
/// (`scan_log` on bytes in memory).
pub fn read_records(log: &[u8], fence: u64) -> (Vec<Record>, Scanned) {
    let mut records = Vec::new();
    let scanned = scan_log(&SliceLog(log), fence, SCAN_PIECE, &mut |record| {
        records.push(*record)
    })
    .expect("a log in memory reads");
    (records, scanned)
}

/// Each imaged block's first image in `log` (its bytes at the fence), by
/// object and block offset: a slice of `log`. `breaks.last_image_wins`
/// keeps the last instead (a break the tests catch).
pub fn first_images(
    log: &[u8],
    fence: u64,
    breaks: BeforeBreaks,
) -> BTreeMap<(ObjectId, u64), &[u8]> {
    let mut images = BTreeMap::new();
    for record in read_records(log, fence).0 {
        for block in 0..(record.len / IMAGE_BLOCK) {
            let from = (record.payload_at + block * IMAGE_BLOCK) as usize;
            let bytes = &log[from..from + IMAGE_BLOCK as usize];
            let key = (record.object, record.offset + block * IMAGE_BLOCK);
            if breaks.last_image_wins {
                images.insert(key, bytes);
            } else {
                images.entry(key).or_insert(bytes);
            }
        }
    }
    images
}

/// Where the records go: the file `.NAME.partial/before`, or the crash
/// simulator's model of one (`SimLog`).
pub trait BeforeLog: Send + Sync {
    /// Its length in bytes.
    fn bytes(&self) -> io::Result<u64>;
    fn read_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()>;
    fn write_at(&self, at: u64, bytes: &[u8]) -> io::Result<()>;
    /// Make every write before durable.
    fn sync(&self) -> io::Result<()>;
    /// Cut the log at `len` (a torn tail), durably.
    fn truncate(&self, len: u64) -> io::Result<()>;
}

impl BeforeLog for File {
    fn bytes(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn read_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read_exact_at(buf, at)
    }
    fn write_at(&self, at: u64, bytes: &[u8]) -> io::Result<()> {
        self.write_all_at(bytes, at)
    }
    fn sync(&self) -> io::Result<()> {
        self.sync_data()
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.set_len(len)?;
        self.sync_all()
    }
}

/// A log in memory that keeps, as a power cut would, only what was synced
/// (`durable`): the crash simulator's and the tests' log.
#[derive(Clone, Default)]
pub struct SimLog {
    state: Arc<Mutex<(Vec<u8>, Vec<u8>)>>,
}

impl SimLog {
    /// The bytes a crash now leaves (the synced ones).
    pub fn durable(&self) -> Vec<u8> {
        self.state.lock().1.clone()
    }
    /// The bytes written, synced or not.
    pub fn live(&self) -> Vec<u8> {
        self.state.lock().0.clone()
    }
    /// A log holding `bytes`, all durable (after a crash).
    pub fn from_bytes(bytes: Vec<u8>) -> SimLog {
        SimLog {
            state: Arc::new(Mutex::new((bytes.clone(), bytes))),
        }
    }
}

impl BeforeLog for SimLog {
    fn bytes(&self) -> io::Result<u64> {
        Ok(self.state.lock().0.len() as u64)
    }
    fn read_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        SliceLog(&self.state.lock().0).read_at(at, buf)
    }
    fn write_at(&self, at: u64, bytes: &[u8]) -> io::Result<()> {
        let mut state = self.state.lock();
        let at = at as usize;
        if state.0.len() < at + bytes.len() {
            state.0.resize(at + bytes.len(), 0);
        }
        state.0[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        let mut state = self.state.lock();
        state.1 = state.0.clone();
        Ok(())
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        let mut state = self.state.lock();
        state.0.truncate(len as usize);
        state.1 = state.0.clone();
        Ok(())
    }
}

/// The log while armed.
struct Armed {
    log: Arc<dyn BeforeLog>,
    fence: u64,
    /// Bytes of valid records in `log`.
    end: u64,
    /// Blocks imaged already (durably): a later write of one is not
    /// imaged again.
    imaged: ImagedSet,
    /// Bytes of records durable (every append before the last sync's
    /// start): what an index saved now may cover.
    durable_end: u64,
    /// Where the index of `imaged` is kept (an overlay's), if anywhere;
    /// the log bytes the last one saved covers; whether a writer saves one.
    index: Option<Arc<dyn IndexStore>>,
    indexed: u64,
    saving: bool,
    /// Blocks a writer is imaging (reading, appending, or waiting for the
    /// sync): no other writer images them, and none writes them home,
    /// until they are imaged.
    claimed: HashSet<(ObjectId, u64)>,
    /// Appends so far; how many of them a sync made durable; whether a
    /// writer runs a sync now; the appended blocks not yet durable, by
    /// append.
    appended: u64,
    durable: u64,
    syncing: bool,
    unsynced: VecDeque<(u64, ObjectId, Vec<u64>)>,
    /// An append or sync failed: every later imaged write is refused.
    failed: bool,
}

/// What the layer did since it was armed (counts, and nanoseconds summed
/// over the writers): logged when a materialisation disarms it, so the
/// cost of each foreground write while armed can be read from a run.
#[derive(Default)]
struct Counters {
    /// Armed calls for imaged objects, by kind: data, contexts, written.
    calls: [AtomicU64; 3],
    /// Calls that appended an image (the rest found theirs imaged).
    imaging: AtomicU64,
    blocks: AtomicU64,
    bytes: AtomicU64,
    syncs: AtomicU64,
    /// Waiting for the layer's lock, holding it, and in the log's sync.
    wait_ns: AtomicU64,
    hold_ns: AtomicU64,
    sync_ns: AtomicU64,
    /// Waiting for another writer's image of a block to become durable.
    others_ns: AtomicU64,
}

/// A snapshot of `Counters` (see there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BeforeStats {
    pub data_calls: u64,
    pub contexts_calls: u64,
    pub written_calls: u64,
    pub imaging_calls: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub syncs: u64,
    pub lock_wait_ms: u64,
    pub lock_hold_ms: u64,
    pub sync_ms: u64,
    pub others_ms: u64,
}

impl std::fmt::Display for BeforeStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "calls data {} contexts {} written {}, {} imaging: {} blocks, {} bytes, {} syncs; ms summed over writers: lock wait {}, lock held {}, sync {}, waiting for others' images {}",
            self.data_calls,
            self.contexts_calls,
            self.written_calls,
            self.imaging_calls,
            self.blocks,
            self.bytes,
            self.syncs,
            self.lock_wait_ms,
            self.lock_hold_ms,
            self.sync_ms,
            self.others_ms
        )
    }
}

impl Counters {
    fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }
    fn add_since(counter: &AtomicU64, since: std::time::Instant) {
        Counters::add(counter, since.elapsed().as_nanos() as u64);
    }
    fn take(&self) -> BeforeStats {
        let get = |counter: &AtomicU64| counter.swap(0, Ordering::Relaxed);
        let ms = |counter: &AtomicU64| get(counter) / 1_000_000;
        BeforeStats {
            data_calls: get(&self.calls[0]),
            contexts_calls: get(&self.calls[1]),
            written_calls: get(&self.calls[2]),
            imaging_calls: get(&self.imaging),
            blocks: get(&self.blocks),
            bytes: get(&self.bytes),
            syncs: get(&self.syncs),
            lock_wait_ms: ms(&self.wait_ns),
            lock_hold_ms: ms(&self.hold_ns),
            sync_ms: ms(&self.sync_ns),
            others_ms: ms(&self.others_ns),
        }
    }
}

/// What every handle of one layer shares (a resize's `reopen` keeps it).
#[derive(Default)]
struct Layer {
    armed: AtomicBool,
    log: Mutex<Option<Armed>>,
    breaks: Mutex<BeforeBreaks>,
    counters: Counters,
    /// Signalled when a sync ends or a claim is dropped.
    settled: Condvar,
    /// Bytes of durable records between two saves of the index; 0 for
    /// `INDEX_EVERY` (tests set less).
    index_every: AtomicU64,
}

/// The before-image layer over `inner` (see the module's comment).
pub struct BeforeImages {
    inner: Arc<dyn Storage>,
    layer: Arc<Layer>,
}

impl BeforeImages {
    /// `inner`, with the layer disarmed.
    pub fn new(inner: Arc<dyn Storage>) -> BeforeImages {
        BeforeImages {
            inner,
            layer: Arc::default(),
        }
    }

    /// The storage under the layer.
    pub fn inner(&self) -> &Arc<dyn Storage> {
        &self.inner
    }

    /// Save the index every `bytes` of durable records instead of every
    /// `INDEX_EVERY` (tests and the crash simulator).
    pub fn set_index_every(&self, bytes: u64) {
        self.layer.index_every.store(bytes, Ordering::Relaxed);
    }

    /// Orderings to break (tests and the crash simulator only).
    pub fn set_breaks(&self, breaks: BeforeBreaks) {
        *self.layer.breaks.lock() = breaks;
    }

    /// The orderings broken (`set_breaks`; none in production).
    pub fn breaks(&self) -> BeforeBreaks {
        *self.layer.breaks.lock()
    }

    /// Arm the layer with the log `log` of fence `fence`. The records it
    /// holds already (an open that found the fence: a crash cut the
    /// materialisation) are kept, a torn tail cut off, and their blocks
    /// count as imaged. Call it with no home write in flight (at the flush
    /// point, or before the open's replay).
    ///
    /// A log damaged after it was synced (`LogEnd::Corrupt`) is left as
    /// it is and the layer stays disarmed: the caller fails the snapshot
    /// (its images of blocks written since are lost), and the volume runs
    /// on without one.
    pub fn arm(&self, log: Box<dyn BeforeLog>, fence: u64) -> io::Result<LogEnd> {
        self.arm_indexed(log, fence, None)
    }

    /// `arm`, with the blocks imaged kept in `index` too (an overlay's,
    /// for its whole life): read from there when it is valid for this log
    /// (`storage/imaged.rs`), so only the records after it are read; saved
    /// again once armed, and every `INDEX_EVERY` bytes of records made
    /// durable since.
    pub fn arm_indexed(
        &self,
        log: Box<dyn BeforeLog>,
        fence: u64,
        index: Option<Arc<dyn IndexStore>>,
    ) -> io::Result<LogEnd> {
        let (from, mut imaged) = match index
            .as_deref()
            .map(|store| load_index(store, &*log, fence))
        {
            Some(Some((covered, set))) => (covered, set),
            _ => (0, ImagedSet::default()),
        };
        let scanned = scan_log_from(&*log, fence, from, SCAN_PIECE, &mut |record| {
            for block in 0..(record.len / IMAGE_BLOCK) {
                imaged.insert(record.object, record.offset + block * IMAGE_BLOCK);
            }
        })?;
        match scanned.end {
            LogEnd::Corrupt { .. } => return Ok(scanned.end),
            LogEnd::Torn { at } => log.truncate(at)?,
            // Durable before its blocks count as imaged: records a killed
            // process appended but never synced are in the page cache, and
            // a power cut after this open must not lose the image of a
            // block it then writes home.
            LogEnd::Whole if scanned.valid > 0 => log.sync()?,
            LogEnd::Whole => {}
        }
        let mut indexed = from;
        if let Some(store) = index.as_deref() {
            if scanned.valid > from {
                match save_index(store, &*log, fence, scanned.valid, &imaged) {
                    Ok(()) => indexed = scanned.valid,
                    Err(error) => tracing::warn!("cannot save the before-image log's index (the next open reads the log instead): {error}"),
                }
            }
        }
        self.layer.counters.take();
        *self.layer.log.lock() = Some(Armed {
            log: Arc::from(log),
            fence,
            end: scanned.valid,
            durable_end: scanned.valid,
            index,
            indexed,
            saving: false,
            imaged,
            claimed: HashSet::new(),
            appended: 0,
            durable: 0,
            syncing: false,
            unsynced: VecDeque::new(),
            failed: false,
        });
        self.layer.armed.store(true, Ordering::Release);
        Ok(scanned.end)
    }

    /// Stop imaging (the snapshot is materialised and published).
    pub fn disarm(&self) {
        let mut log = self.layer.log.lock();
        self.layer.armed.store(false, Ordering::Release);
        *log = None;
        self.layer.settled.notify_all();
    }

    /// What the layer did since it was armed or last asked (and resets
    /// the counts).
    pub fn take_stats(&self) -> BeforeStats {
        self.layer.counters.take()
    }

    pub fn is_armed(&self) -> bool {
        self.layer.armed.load(Ordering::Acquire)
    }

    /// Blocks imaged since the layer was armed (the log's size in blocks).
    pub fn imaged_blocks(&self) -> usize {
        self.layer
            .log
            .lock()
            .as_ref()
            .map_or(0, |armed| armed.imaged.len())
    }

    /// Bytes the set of imaged blocks takes in memory (0 disarmed).
    pub fn imaged_memory(&self) -> usize {
        self.layer
            .log
            .lock()
            .as_ref()
            .map_or(0, |armed| armed.imaged.memory_bytes())
    }

    /// Image the blocks of `ranges` (offset, length) of `object` not imaged
    /// yet, then run `write` (the home write): the log is synced between,
    /// unless broken on purpose. Disarmed, or for an object that is not
    /// imaged, `write` runs at once.
    ///
    /// Concurrent writers share the work (group commit): each claims the
    /// blocks nobody images yet, reads their old bytes *without* the
    /// layer's lock (a claimed block has no home write until its image is
    /// durable, so they cannot change), appends its records under the lock
    /// (a copy into the page cache), and then one of the writers waiting
    /// for a sync runs it, outside the lock, for every record appended
    /// before it started; the others wait for it and are released
    /// together. A writer whose blocks another writer is imaging waits for
    /// that image to be durable; one whose blocks are all imaged takes the
    /// lock only to look. A failed append or sync fails every writer whose
    /// records it did not make durable, and all later ones: none of their
    /// home writes is issued.
    fn imaged<T>(
        &self,
        object: ObjectId,
        ranges: &mut dyn Iterator<Item = (u64, u64)>,
        write: impl FnOnce() -> T,
    ) -> io::Result<T> {
        if !self.layer.armed.load(Ordering::Acquire) || !is_imaged(object) {
            return Ok(write());
        }
        let breaks = *self.layer.breaks.lock();
        let counters = &self.layer.counters;
        let kind = match object {
            ObjectId::Data(_) => 0,
            ObjectId::Contexts => 1,
            _ => 2,
        };
        Counters::add(&counters.calls[kind], 1);
        let blocks = blocks_of(ranges);
        let waited = Instant::now();
        let mut log = self.layer.log.lock();
        Counters::add_since(&counters.wait_ns, waited);
        let mut held = Instant::now();
        // Appended blocks once: `last_image_wins` images every call again.
        let mut appended_once = false;
        while let Some(armed) = log.as_mut() {
            if armed.failed {
                Counters::add_since(&counters.hold_ns, held);
                return Err(failed_log());
            }
            let again = breaks.last_image_wins && !appended_once;
            let need: Vec<u64> = blocks
                .iter()
                .copied()
                .filter(|&block| again || !armed.imaged.contains(object, block * IMAGE_BLOCK))
                .collect();
            if need.is_empty() || (breaks.last_image_wins && appended_once) {
                break;
            }
            let mine: Vec<u64> = need
                .iter()
                .copied()
                .filter(|&block| again || armed.claimed.insert((object, block * IMAGE_BLOCK)))
                .collect();
            if mine.is_empty() {
                // Another writer images them: wait until it is durable.
                Counters::add_since(&counters.hold_ns, held);
                let others = Instant::now();
                self.layer.settled.wait(&mut log);
                Counters::add_since(&counters.others_ns, others);
                held = Instant::now();
                continue;
            }
            Counters::add(&counters.imaging, 1);
            Counters::add(&counters.blocks, mine.len() as u64);
            let (journal, fence) = (Arc::clone(&armed.log), armed.fence);
            // The old bytes, read outside the lock.
            Counters::add_since(&counters.hold_ns, held);
            let records =
                MutexGuard::unlocked(&mut log, || records(&*self.inner, fence, object, &mine));
            let waited = Instant::now();
            held = waited;
            let Some(armed) = log
                .as_mut()
                .filter(|armed| Arc::ptr_eq(&armed.log, &journal))
            else {
                // Disarmed meanwhile (or armed again for another fence,
                // whose images these are not): look again.
                continue;
            };
            let records = match records {
                Ok(records) => records,
                Err(error) => {
                    armed.unclaim(object, &mine);
                    self.layer.settled.notify_all();
                    Counters::add_since(&counters.hold_ns, held);
                    return Err(error);
                }
            };
            if armed.failed {
                continue;
            }
            if let Err(error) = armed.log.write_at(armed.end, &records) {
                // After a failed append nothing more is logged (a gap
                // would end the log there): fail-stop.
                armed.failed = true;
                self.layer.settled.notify_all();
                Counters::add_since(&counters.hold_ns, held);
                return Err(error);
            }
            Counters::add(&counters.bytes, records.len() as u64);
            armed.end += records.len() as u64;
            armed.appended += 1;
            let seq = armed.appended;
            appended_once = true;
            if breaks.write_before_sync {
                // Broken on purpose: counted imaged at once, the home write
                // issued, and only then the sync.
                armed.unclaim(object, &mine);
                for block in &mine {
                    armed.imaged.insert(object, block * IMAGE_BLOCK);
                }
                drop(log);
                let result = write();
                journal.sync()?;
                return Ok(result);
            }
            armed.unsynced.push_back((seq, object, mine));
            // ORDER POINT: this writer's images are durable (by its own
            // sync or another writer's that started after the append)
            // before its home write is issued.
            self.synced(&mut log, &journal, seq, &mut held);
        }
        drop(log);
        Counters::add_since(&counters.hold_ns, held);
        Ok(write())
    }

    /// Wait until append `seq` of `journal` is durable: run the sync if
    /// no writer runs one (outside the lock, for every append before it
    /// started), or wait for the one running and then look again. Returns
    /// with the lock held; a failed sync marks the log failed (the
    /// caller's loop then refuses).
    fn synced(
        &self,
        log: &mut MutexGuard<'_, Option<Armed>>,
        journal: &Arc<dyn BeforeLog>,
        seq: u64,
        held: &mut Instant,
    ) {
        let counters = &self.layer.counters;
        loop {
            let Some(armed) = log
                .as_mut()
                .filter(|armed| Arc::ptr_eq(&armed.log, journal))
            else {
                return;
            };
            if armed.failed || armed.durable >= seq {
                return;
            }
            if armed.syncing {
                Counters::add_since(&counters.hold_ns, *held);
                let others = Instant::now();
                self.layer.settled.wait(log);
                Counters::add_since(&counters.others_ns, others);
                *held = Instant::now();
                continue;
            }
            armed.syncing = true;
            let (target, target_end) = (armed.appended, armed.end);
            Counters::add_since(&counters.hold_ns, *held);
            let syncing = Instant::now();
            let result = MutexGuard::unlocked(log, || journal.sync());
            Counters::add_since(&counters.sync_ns, syncing);
            Counters::add(&counters.syncs, 1);
            *held = Instant::now();
            if let Some(armed) = log
                .as_mut()
                .filter(|armed| Arc::ptr_eq(&armed.log, journal))
            {
                armed.syncing = false;
                match result {
                    Ok(()) => {
                        armed.settle(target);
                        armed.durable_end = armed.durable_end.max(target_end);
                    }
                    Err(_) => armed.failed = true,
                }
            }
            self.layer.settled.notify_all();
            self.index_if_due(log, journal, held);
        }
    }

    /// Save the index of the imaged blocks when `INDEX_EVERY` bytes of
    /// records were made durable since the last one (by the writer whose
    /// sync made them so, outside the lock: the set is copied under it,
    /// 32 KiB per GiB of volume). A failed save leaves the last index,
    /// which says less, and is only logged.
    fn index_if_due(
        &self,
        log: &mut MutexGuard<'_, Option<Armed>>,
        journal: &Arc<dyn BeforeLog>,
        held: &mut Instant,
    ) {
        let Some(armed) = log
            .as_mut()
            .filter(|armed| Arc::ptr_eq(&armed.log, journal))
        else {
            return;
        };
        let Some(store) = armed.index.clone() else {
            return;
        };
        let every = match self.layer.index_every.load(Ordering::Relaxed) {
            0 => INDEX_EVERY,
            every => every,
        };
        if armed.saving || armed.failed || armed.durable_end < armed.indexed + every {
            return;
        }
        armed.saving = true;
        let (fence, covered, set) = (armed.fence, armed.durable_end, armed.imaged.clone());
        Counters::add_since(&self.layer.counters.hold_ns, *held);
        let saved = MutexGuard::unlocked(log, || {
            save_index(&*store, &**journal, fence, covered, &set)
        });
        *held = Instant::now();
        if let Err(error) = &saved {
            tracing::warn!("cannot save the before-image log's index (the next open reads more of the log): {error}");
        }
        if let Some(armed) = log
            .as_mut()
            .filter(|armed| Arc::ptr_eq(&armed.log, journal))
        {
            armed.saving = false;
            if saved.is_ok() {
                armed.indexed = covered;
            }
        }
    }
}

/// Records made durable between two saves of an overlay's index: after a
/// crash the open reads at most about this much of its log.
pub const INDEX_EVERY: u64 = 16 << 20;

/// The CRC32C of the log's last `INDEX_TAIL_BYTES` (or fewer) bytes
/// before `covered`: binds an index to the records it covers.
fn tail_crc(log: &dyn BeforeLog, covered: u64) -> io::Result<u32> {
    let from = covered.saturating_sub(INDEX_TAIL_BYTES);
    let mut bytes = vec![0u8; (covered - from) as usize];
    log.read_at(from, &mut bytes)?;
    Ok(crc32c::crc32c(&bytes))
}

/// Save the index of `set`, the blocks of the records in the first
/// `covered` bytes of `log` (durable).
fn save_index(
    store: &dyn IndexStore,
    log: &dyn BeforeLog,
    fence: u64,
    covered: u64,
    set: &ImagedSet,
) -> io::Result<()> {
    store.save(&encode_index(fence, covered, tail_crc(log, covered)?, set))
}

/// The index in `store` when it is valid for `log` of `fence` (whole, of
/// this fence, covering no more than the log holds, and the log's bytes
/// before its end the ones it was saved with): the bytes of records it
/// covers and their blocks. `None` (read the log from its start) for
/// anything else, an error reading it included.
fn load_index(store: &dyn IndexStore, log: &dyn BeforeLog, fence: u64) -> Option<(u64, ImagedSet)> {
    let bytes = match store.load() {
        Ok(bytes) => bytes?,
        Err(error) => {
            tracing::warn!(
                "cannot read the before-image log's index (reading the log instead): {error}"
            );
            return None;
        }
    };
    let Some(index) = decode_index(&bytes, fence) else {
        tracing::warn!(
            "the before-image log's index is damaged or of another log: reading the log instead"
        );
        return None;
    };
    let fits = log.bytes().is_ok_and(|len| index.covered <= len)
        && tail_crc(log, index.covered).is_ok_and(|crc| crc == index.tail_crc);
    if !fits {
        tracing::warn!(
            "the before-image log's index does not match the log: reading the log instead"
        );
        return None;
    }
    Some((index.covered, index.set))
}

fn failed_log() -> io::Error {
    io::Error::other(
        "the snapshot's before-image log failed: no home write until the volume is opened again",
    )
}

/// The 4 KiB blocks `ranges` (offset, length) cover, in order, once each.
fn blocks_of(ranges: &mut dyn Iterator<Item = (u64, u64)>) -> Vec<u64> {
    let mut blocks: Vec<u64> = Vec::new();
    for (offset, len) in ranges {
        if len == 0 {
            continue;
        }
        blocks.extend(offset / IMAGE_BLOCK..(offset + len).div_ceil(IMAGE_BLOCK));
    }
    blocks.sort_unstable();
    blocks.dedup();
    blocks
}

/// The records of `blocks` of `object` (their bytes now, in `inner`),
/// one per run of consecutive blocks, under `fence`.
fn records(
    inner: &dyn Storage,
    fence: u64,
    object: ObjectId,
    blocks: &[u64],
) -> io::Result<Vec<u8>> {
    let mut appended = Vec::new();
    let mut at = 0;
    while at < blocks.len() {
        let mut end = at + 1;
        while end < blocks.len() && blocks[end] == blocks[end - 1] + 1 {
            end += 1;
        }
        let offset = blocks[at] * IMAGE_BLOCK;
        let mut old = vec![0u8; (end - at) * IMAGE_BLOCK as usize];
        inner.read_at(object, offset, &mut old)?;
        appended.extend_from_slice(&encode_record(fence, object, offset, &old));
        at = end;
    }
    Ok(appended)
}

impl Armed {
    /// `blocks` of `object` no longer claimed (their imaging failed).
    fn unclaim(&mut self, object: ObjectId, blocks: &[u64]) {
        for block in blocks {
            self.claimed.remove(&(object, block * IMAGE_BLOCK));
        }
    }

    /// Appends up to `target` are durable: their blocks count as imaged.
    fn settle(&mut self, target: u64) {
        self.durable = self.durable.max(target);
        while self
            .unsynced
            .front()
            .is_some_and(|(seq, _, _)| *seq <= target)
        {
            let (_, object, blocks) = self.unsynced.pop_front().expect("a front");
            self.unclaim(object, &blocks);
            for block in &blocks {
                self.imaged.insert(object, block * IMAGE_BLOCK);
            }
        }
    }
}

impl Storage for BeforeImages {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_at(object, offset, buf)
    }
    fn read_at_nowait(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_at_nowait(object, offset, buf)
    }
    fn start_read(
        &self,
        object: ObjectId,
        offset: u64,
        len: usize,
        done: ReadLater,
    ) -> Result<(), ReadLater> {
        self.inner.start_read(object, offset, len, done)
    }
    fn read_events(&self) -> Option<std::os::fd::RawFd> {
        self.inner.read_events()
    }
    fn reap_reads(&self) -> io::Result<()> {
        self.inner.reap_reads()
    }
    fn reads_ready(&self) -> bool {
        self.inner.reads_ready()
    }
    fn reads_in_flight(&self) -> usize {
        self.inner.reads_in_flight()
    }
    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut range = std::iter::once((offset, data.len() as u64));
        self.imaged(object, &mut range, || {
            self.inner.write_at(object, offset, data)
        })?
    }
    fn write_vectored_at(&self, object: ObjectId, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        let len = parts.iter().map(|part| part.len() as u64).sum();
        let mut range = std::iter::once((offset, len));
        self.imaged(object, &mut range, || {
            self.inner.write_vectored_at(object, offset, parts)
        })?
    }
    fn write_runs(&self, object: ObjectId, runs: &[Run<'_>]) -> Result<(), RunError> {
        let mut ranges = runs.iter().map(|run| (run.offset, run.len()));
        self.imaged(object, &mut ranges, || self.inner.write_runs(object, runs))
            .map_err(|error| RunError {
                offset: runs.first().map_or(0, |run| run.offset),
                error,
            })?
    }
    fn sync(&self, object: ObjectId) -> io::Result<()> {
        self.inner.sync(object)
    }
    fn sync_each(&self, objects: &[ObjectId]) -> Result<(), (ObjectId, io::Error)> {
        self.inner.sync_each(objects)
    }
    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        let mut range = std::iter::once((offset, len));
        self.imaged(object, &mut range, || {
            self.inner.punch_hole(object, offset, len)
        })?
    }
    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        self.inner.next_data(object, offset)
    }
    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        self.inner.allocated_bytes(object)
    }
    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        self.inner.object_len(object)
    }
    fn clone_range(&self, clone: CloneRange<'_>) -> io::Result<()> {
        let (object, offset, len) = (clone.object, clone.offset, clone.len);
        let mut range = std::iter::once((offset, len));
        self.imaged(object, &mut range, || self.inner.clone_range(clone))?
    }
    fn probe_clone(&self, source: &dyn Storage, source_object: ObjectId) -> io::Result<()> {
        self.inner.probe_clone(source, source_object)
    }
    fn measure_clone(
        &self,
        source: &dyn Storage,
        source_object: ObjectId,
        len: u64,
    ) -> io::Result<CloneTiming> {
        self.inner.measure_clone(source, source_object, len)
    }
    fn map_for_check(&self, object: ObjectId, offset: u64, len: u64) -> Option<Mapped> {
        self.inner.map_for_check(object, offset, len)
    }
    fn drop_cached(&self, object: ObjectId, offset: u64, len: u64) {
        self.inner.drop_cached(object, offset, len);
    }
    fn has_held(&self) -> bool {
        self.inner.has_held()
    }
    fn boot_id(&self) -> [u8; 16] {
        self.inner.boot_id()
    }
    fn prepare_held(&self, headers: [&[u8]; 2]) -> io::Result<()> {
        self.inner.prepare_held(headers)
    }
    fn held_named(&self) -> bool {
        self.inner.held_named()
    }
    fn grow_held(&self, slot: u8, from: u64, end: u64) -> io::Result<()> {
        self.inner.grow_held(slot, from, end)
    }
    fn write_held(&self, slot: u8, at: u64, parts: &[&[u8]]) -> io::Result<()> {
        self.inner.write_held(slot, at, parts)
    }
    fn publish_held(&self, slot: u8, at: u64, word: u64) -> io::Result<()> {
        self.inner.publish_held(slot, at, word)
    }
    fn store_held_pair(&self, slot: u8, at: u64, bytes: [u8; 16]) -> io::Result<()> {
        self.inner.store_held_pair(slot, at, bytes)
    }
    fn landing_window(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        self.inner.landing_window()
    }
    fn grow_landing(&self, from: u64, end: u64) -> io::Result<()> {
        self.inner.grow_landing(from, end)
    }
    fn read_landing(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_landing(at, buf)
    }
    fn release_held(&self) -> io::Result<()> {
        self.inner.release_held()
    }
    fn reopen(&self, geometry: &vouch_format::Geometry) -> io::Result<Arc<dyn Storage>> {
        // The new files are imaged by the same layer (its log and blocks).
        Ok(Arc::new(BeforeImages {
            inner: self.inner.reopen(geometry)?,
            layer: Arc::clone(&self.layer),
        }))
    }
    fn file_of(&self, object: ObjectId) -> Option<&File> {
        self.inner.file_of(object)
    }
    fn before_images(&self) -> Option<&BeforeImages> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::imaged::{SimIndex, KIND_DATA};
    use crate::storage::sim::SimStorage;
    use std::sync::atomic::AtomicUsize;

    const FENCE: u64 = 0x5eed;
    const OBJECTS: [ObjectId; 4] = [
        ObjectId::Data(0),
        ObjectId::Data(1),
        ObjectId::Contexts,
        ObjectId::Written,
    ];
    const OBJECT_BYTES: u64 = 16 * IMAGE_BLOCK;

    /// The storage under the layer: the simulated files, and a witness
    /// that, at the moment each home write is issued, finds a durable
    /// image of every block it covers in the log (the rule this layer
    /// keeps), counting the writes that have none.
    struct Witness {
        sim: SimStorage,
        log: SimLog,
        unimaged: AtomicUsize,
    }

    impl Witness {
        fn see(&self, object: ObjectId, offset: u64, len: u64) {
            if !is_imaged(object) || len == 0 {
                return;
            }
            let durable = self.log.durable();
            let images = first_images(&durable, FENCE, BeforeBreaks::default());
            let first = offset / IMAGE_BLOCK;
            let last = (offset + len).div_ceil(IMAGE_BLOCK);
            if (first..last).any(|block| !images.contains_key(&(object, block * IMAGE_BLOCK))) {
                self.unimaged.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    impl Storage for Witness {
        fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            self.sim.read_at(object, offset, buf)
        }
        fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
            self.see(object, offset, data.len() as u64);
            self.sim.write_at(object, offset, data)
        }
        fn sync(&self, object: ObjectId) -> io::Result<()> {
            self.sim.sync(object)
        }
        fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
            self.see(object, offset, len);
            self.sim.punch_hole(object, offset, len)
        }
        fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
            self.sim.next_data(object, offset)
        }
        fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
            self.sim.allocated_bytes(object)
        }
    }

    /// The bytes of `object` in `storage`.
    fn bytes_of(storage: &SimStorage, object: ObjectId) -> Vec<u8> {
        let mut bytes = vec![0u8; OBJECT_BYTES as usize];
        storage.read_at(object, 0, &mut bytes).unwrap();
        bytes
    }

    /// Run random home writes through an armed layer; after each, crash
    /// (every unsynced home write landed, the log only as synced), write
    /// the first images back over the crashed files and compare them with
    /// the files at the fence. Returns (home writes issued without a
    /// durable image, crash points whose restore differed).
    fn run(breaks: BeforeBreaks, seed: u64) -> (usize, usize) {
        use rand::{Rng as _, SeedableRng as _};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let sim = SimStorage::new();
        for object in OBJECTS {
            let bytes: Vec<u8> = (0..OBJECT_BYTES).map(|_| rng.gen()).collect();
            sim.write_at(object, 0, &bytes).unwrap();
            sim.sync(object).unwrap();
        }
        let fenced: Vec<Vec<u8>> = OBJECTS.iter().map(|&o| bytes_of(&sim, o)).collect();
        let log = SimLog::default();
        let witness = Arc::new(Witness {
            sim: sim.clone(),
            log: log.clone(),
            unimaged: AtomicUsize::new(0),
        });
        let layer = BeforeImages::new(witness.clone());
        layer.set_breaks(breaks);
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        let mut wrong = 0;
        for _ in 0..60 {
            let object = OBJECTS[rng.gen_range(0..OBJECTS.len())];
            let offset = rng.gen_range(0..OBJECT_BYTES - 3 * IMAGE_BLOCK);
            let len = rng.gen_range(1..3 * IMAGE_BLOCK);
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            match rng.gen_range(0..4) {
                0 => layer.write_at(object, offset, &data).unwrap(),
                1 => layer.punch_hole(object, offset & !4095, 4096).unwrap(),
                2 => {
                    let (one, two) = data.split_at(data.len() / 2);
                    let parts: [&[u8]; 2] = [one, two];
                    let far = (offset + len + IMAGE_BLOCK).min(OBJECT_BYTES - IMAGE_BLOCK);
                    let far_parts: [&[u8]; 1] = [&data[..(len as usize).min(100)]];
                    layer
                        .write_runs(
                            object,
                            &[
                                Run {
                                    offset,
                                    parts: &parts,
                                },
                                Run {
                                    offset: far,
                                    parts: &far_parts,
                                },
                            ],
                        )
                        .unwrap();
                }
                _ => {
                    if rng.gen_bool(0.5) {
                        layer.sync(object).unwrap();
                    }
                }
            }
            // The worst crash: every home write issued has landed.
            let crashed = sim.crash_image(|_, _, _| u64::MAX);
            let durable = log.durable();
            for (&(object, offset), image) in &first_images(&durable, FENCE, breaks) {
                crashed.write_at(object, offset, image).unwrap();
            }
            if OBJECTS
                .iter()
                .zip(&fenced)
                .any(|(&object, at_fence)| bytes_of(&crashed, object) != *at_fence)
            {
                wrong += 1;
            }
        }
        let unimaged = witness.unimaged.load(Ordering::Relaxed);
        // Disarmed, nothing more is imaged.
        let before = log.live().len();
        layer.disarm();
        layer.write_at(ObjectId::Data(0), 0, &[1; 4096]).unwrap();
        assert_eq!(log.live().len(), before);
        (unimaged, wrong)
    }

    /// A log whose first sync waits (at most 10 s) until `gate` appends
    /// were made, so writers deterministically overlap it, and whose
    /// syncs all fail once told to.
    #[derive(Clone, Default)]
    struct GatedLog {
        log: SimLog,
        failing: Arc<AtomicBool>,
        gate: usize,
        /// Appends so far, and whether the first sync went.
        appends: Arc<(Mutex<(usize, bool)>, Condvar)>,
    }

    impl BeforeLog for GatedLog {
        fn bytes(&self) -> io::Result<u64> {
            self.log.bytes()
        }
        fn read_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
            self.log.read_at(at, buf)
        }
        fn write_at(&self, at: u64, bytes: &[u8]) -> io::Result<()> {
            let (count, grew) = &*self.appends;
            count.lock().0 += 1;
            grew.notify_all();
            self.log.write_at(at, bytes)
        }
        fn sync(&self) -> io::Result<()> {
            let (count, grew) = &*self.appends;
            let mut state = count.lock();
            let deadline = Instant::now() + std::time::Duration::from_secs(10);
            while !state.1
                && state.0 < self.gate
                && !grew.wait_until(&mut state, deadline).timed_out()
            {}
            state.1 = true;
            drop(state);
            if self.failing.load(Ordering::Relaxed) {
                return Err(io::Error::other("injected sync failure"));
            }
            self.log.sync()
        }
        fn truncate(&self, len: u64) -> io::Result<()> {
            self.log.truncate(len)
        }
    }

    /// What `concurrent` returns: the layer, the witness, each writer's
    /// results and the file at the fence.
    type Concurrent = (
        BeforeImages,
        Arc<Witness>,
        Vec<Vec<io::Result<()>>>,
        Vec<u8>,
    );

    /// `threads` writers, each `writes` 4 KiB home writes of `Data(0)`
    /// (overlapping blocks) through one armed layer over a witness.
    fn concurrent(threads: u64, writes: u64, log: &GatedLog) -> Concurrent {
        let sim = SimStorage::new();
        let fenced: Vec<u8> = (0..OBJECT_BYTES).map(|at| (at * 7 % 251) as u8).collect();
        sim.write_at(ObjectId::Data(0), 0, &fenced).unwrap();
        sim.sync(ObjectId::Data(0)).unwrap();
        let witness = Arc::new(Witness {
            sim,
            log: log.log.clone(),
            unimaged: AtomicUsize::new(0),
        });
        let layer = BeforeImages::new(witness.clone());
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        let results = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|thread| {
                    let layer = &layer;
                    scope.spawn(move || {
                        (0..writes)
                            .map(|write| {
                                let block = (thread * 5 + write * 3) % (OBJECT_BYTES / IMAGE_BLOCK);
                                let data = [thread as u8 + 1; IMAGE_BLOCK as usize];
                                layer.write_at(ObjectId::Data(0), block * IMAGE_BLOCK, &data)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (layer, witness, results, fenced)
    }

    #[test]
    fn concurrent_writers_share_syncs_and_each_finds_its_image_durable() {
        // 8 writers of 8 distinct blocks; the first sync waits until all
        // 8 appended: it covers its own append, and one more sync (run by
        // one of the 7 waiting) covers the other 7. A layer that holds its
        // lock across the sync lets nobody append meanwhile: 8 syncs.
        let log = GatedLog {
            gate: 8,
            ..GatedLog::default()
        };
        let (layer, witness, results, fenced) = concurrent(8, 1, &log);
        assert!(results.iter().flatten().all(Result::is_ok));
        assert_eq!(witness.unimaged.load(Ordering::Relaxed), 0);
        let stats = layer.take_stats();
        assert_eq!((stats.imaging_calls, stats.blocks), (8, 8), "{stats}");
        assert_eq!(stats.syncs, 2, "{stats}");
        assert_eq!(layer.imaged_blocks(), 8);
        // Every block's first image is its bytes at the fence.
        let durable = log.log.durable();
        let crashed = witness.sim.crash_image(|_, _, _| u64::MAX);
        for (&(object, offset), image) in &first_images(&durable, FENCE, BeforeBreaks::default()) {
            crashed.write_at(object, offset, image).unwrap();
        }
        assert_eq!(bytes_of(&crashed, ObjectId::Data(0)), fenced);
    }

    #[test]
    fn a_group_whose_sync_failed_issues_none_of_its_home_writes() {
        // The first sync waits for 8 appends: the group it fails is the
        // first 8 writers' (some of them possibly others' blocks).
        let log = GatedLog {
            gate: 8,
            ..GatedLog::default()
        };
        log.failing.store(true, Ordering::Relaxed);
        let (layer, witness, results, fenced) = concurrent(8, 3, &log);
        // Every write needed an image, none was made durable: every write
        // failed, and none reached its home (the file is as at the fence).
        assert!(results.iter().flatten().all(Result::is_err));
        assert_eq!(witness.unimaged.load(Ordering::Relaxed), 0);
        assert_eq!(bytes_of(&witness.sim, ObjectId::Data(0)), fenced);
        assert_eq!(layer.imaged_blocks(), 0);
        // Fail-stop: a later write is refused even once syncs work again.
        log.failing.store(false, Ordering::Relaxed);
        assert!(layer.write_at(ObjectId::Data(0), 0, &[9; 4096]).is_err());
        assert_eq!(bytes_of(&witness.sim, ObjectId::Data(0)), fenced);
    }

    /// A log that counts the bytes read from it.
    #[derive(Clone, Default)]
    struct Counted {
        log: SimLog,
        read: Arc<AtomicU64>,
    }

    impl BeforeLog for Counted {
        fn bytes(&self) -> io::Result<u64> {
            self.log.bytes()
        }
        fn read_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
            self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
            self.log.read_at(at, buf)
        }
        fn write_at(&self, at: u64, bytes: &[u8]) -> io::Result<()> {
            self.log.write_at(at, bytes)
        }
        fn sync(&self) -> io::Result<()> {
            self.log.sync()
        }
        fn truncate(&self, len: u64) -> io::Result<()> {
            self.log.truncate(len)
        }
    }

    /// A layer armed with `log` and the index `index`, its index saved
    /// every 8 blocks of images, `blocks` of Data(0) (holding `fill` at
    /// the fence) written once each.
    fn indexed_writes(log: &SimLog, index: &SimIndex, blocks: std::ops::Range<u64>, fill: u8) {
        let sim = SimStorage::new();
        sim.write_at(
            ObjectId::Data(0),
            0,
            &vec![fill; (blocks.end * IMAGE_BLOCK) as usize],
        )
        .unwrap();
        let layer = BeforeImages::new(Arc::new(sim));
        layer.set_index_every(8 * IMAGE_BLOCK);
        let store: Arc<dyn IndexStore> = Arc::new(index.clone());
        assert_eq!(
            layer
                .arm_indexed(Box::new(log.clone()), FENCE, Some(store))
                .unwrap(),
            LogEnd::Whole
        );
        for block in blocks {
            layer
                .write_at(ObjectId::Data(0), block * IMAGE_BLOCK, &[7; 4096])
                .unwrap();
        }
    }

    /// Whether a write of `block` of Data(0) through `layer` images it.
    fn images(layer: &BeforeImages, log: &SimLog, block: u64) -> bool {
        let before = log.live().len();
        layer
            .write_at(ObjectId::Data(0), block * IMAGE_BLOCK, &[8; 4096])
            .unwrap();
        log.live().len() > before
    }

    #[test]
    fn an_open_reads_the_index_and_only_the_records_after_it() {
        let (log, index) = (SimLog::default(), SimIndex::default());
        indexed_writes(&log, &index, 0..60, 1);
        // A crash: the durable log, the index last saved.
        let len = log.durable().len() as u64;
        let saved = decode_index(&index.load().unwrap().expect("saved"), FENCE).expect("valid");
        assert!(
            saved.covered > 0 && saved.covered <= len,
            "{}",
            saved.covered
        );
        let counted = Counted {
            log: SimLog::from_bytes(log.durable()),
            ..Counted::default()
        };
        let layer = BeforeImages::new(Arc::new(SimStorage::new()));
        let store: Arc<dyn IndexStore> = Arc::new(index.clone());
        assert_eq!(
            layer
                .arm_indexed(Box::new(counted.clone()), FENCE, Some(store))
                .unwrap(),
            LogEnd::Whole
        );
        let read = counted.read.load(Ordering::Relaxed);
        // The index's check of the log's bytes before its end, then the
        // records after it (at most 8 blocks' worth, and their re-save's
        // check): never the whole log.
        assert!(
            read <= 2 * INDEX_TAIL_BYTES + (len - saved.covered),
            "read {read} of {len} bytes"
        );
        assert!(len - saved.covered <= 8 * (IMAGE_BLOCK + RECORD_HEADER_BYTES as u64));
        assert!(saved.covered < len, "a tail after the index");
        assert_eq!(layer.imaged_blocks(), 60);
        assert!(layer.imaged_memory() <= 64);
        // Every block the log holds counts imaged; no other.
        assert!(!images(&layer, &counted.log, 5));
        assert!(!images(&layer, &counted.log, 59));
        assert!(images(&layer, &counted.log, 60));
        // And this open saved an index covering the whole log.
        let again = decode_index(&index.load().unwrap().unwrap(), FENCE).unwrap();
        assert_eq!(again.covered, len);
    }

    #[test]
    fn an_index_that_is_not_of_this_log_is_not_used() {
        // An index of another log of the same fence: blocks 0..16 imaged.
        let (other, index) = (SimLog::default(), SimIndex::default());
        indexed_writes(&other, &index, 0..16, 2);
        let covered = decode_index(&index.load().unwrap().unwrap(), FENCE)
            .unwrap()
            .covered;
        // This log images blocks 100..140: longer than the index covers.
        let log = SimLog::default();
        indexed_writes(&log, &SimIndex::default(), 100..140, 3);
        assert!(log.durable().len() as u64 > covered);
        let layer = BeforeImages::new(Arc::new(SimStorage::new()));
        let store: Arc<dyn IndexStore> = Arc::new(index);
        let _ = layer
            .arm_indexed(Box::new(log.clone()), FENCE, Some(store))
            .unwrap();
        // Only this log's blocks count imaged: a write of block 3 (imaged
        // in the other log only) is imaged in this one.
        assert_eq!(layer.imaged_blocks(), 40);
        assert!(images(&layer, &log, 3));
        assert!(!images(&layer, &log, 120));
    }

    #[test]
    fn a_damaged_index_is_not_used() {
        let (log, index) = (SimLog::default(), SimIndex::default());
        indexed_writes(&log, &index, 0..20, 4);
        let mut bytes = index.load().unwrap().unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x80;
        *index.bytes.lock() = Some(bytes);
        let layer = BeforeImages::new(Arc::new(SimStorage::new()));
        let store: Arc<dyn IndexStore> = Arc::new(index);
        let _ = layer
            .arm_indexed(Box::new(log.clone()), FENCE, Some(store))
            .unwrap();
        assert_eq!(layer.imaged_blocks(), 20);
        assert!(!images(&layer, &log, 19));
    }

    /// Records a killed process appended but never synced (in the page
    /// cache, so the open reads them) are made durable before the open
    /// counts their blocks imaged: a power cut after must not lose an
    /// image of a block written home since.
    #[test]
    fn an_open_makes_the_records_it_counts_durable() {
        let log = SimLog::default();
        let record = encode_record(FENCE, ObjectId::Data(0), 0, &[3; 4096]);
        log.write_at(0, &record).unwrap();
        assert!(log.durable().is_empty());
        let layer = BeforeImages::new(Arc::new(SimStorage::new()));
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        assert_eq!(layer.imaged_blocks(), 1);
        assert_eq!(log.durable(), record);
    }

    #[test]
    fn every_crash_point_restores_the_fence_from_the_first_images() {
        for seed in 0..20 {
            assert_eq!(run(BeforeBreaks::default(), seed), (0, 0), "seed {seed}");
        }
    }

    #[test]
    fn a_home_write_before_its_image_is_synced_is_caught() {
        let breaks = BeforeBreaks {
            write_before_sync: true,
            ..BeforeBreaks::default()
        };
        let (unimaged, _) = run(breaks, 1);
        assert!(unimaged > 0);
    }

    #[test]
    fn a_later_image_applied_over_the_first_is_caught() {
        let breaks = BeforeBreaks {
            last_image_wins: true,
            ..BeforeBreaks::default()
        };
        let (unimaged, wrong) = run(breaks, 1);
        assert_eq!(unimaged, 0);
        assert!(wrong > 0);
    }

    #[test]
    fn format_md_describes_the_record_header_the_code_writes() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/FORMAT.md"))
                .expect("docs/FORMAT.md");
        let start = doc
            .find("### Before-image record header (40 bytes)")
            .expect("FORMAT.md has the record header's table");
        let rows: Vec<(String, usize, usize)> = doc[start..]
            .lines()
            .skip(1)
            .take_while(|line| !line.starts_with('#'))
            .filter(|line| line.starts_with('|'))
            .filter_map(|line| {
                let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
                Some((
                    cells[2].to_string(),
                    cells[0].parse().ok()?,
                    cells[1].parse().ok()?,
                ))
            })
            .collect();
        let fields: Vec<(String, usize, usize)> = RECORD_FIELDS
            .iter()
            .map(|&(name, offset, size)| (name.to_string(), offset, size))
            .collect();
        assert_eq!(rows, fields);
        let last = RECORD_FIELDS.last().unwrap();
        assert_eq!(last.1 + last.2, RECORD_HEADER_BYTES);
        // The encoder puts each field where the table says.
        let record = encode_record(3, ObjectId::Data(5), 8192, &[0; 4096]);
        let field = |name: &str| {
            let &(_, offset, size) = RECORD_FIELDS.iter().find(|f| f.0 == name).unwrap();
            let mut word = [0u8; 8];
            word[..size].copy_from_slice(&record[offset..offset + size]);
            u64::from_le_bytes(word)
        };
        assert_eq!(field("magic"), u64::from(RECORD_MAGIC));
        assert_eq!(field("kind"), u64::from(KIND_DATA));
        assert_eq!(field("segment"), 5);
        assert_eq!(field("len"), 4096);
        assert_eq!(field("offset"), 8192);
        assert_eq!(field("fence"), 3);
    }

    #[test]
    fn rearming_cuts_a_torn_tail_and_keeps_what_was_imaged() {
        let sim = Arc::new(SimStorage::new());
        let layer = BeforeImages::new(sim.clone());
        let log = SimLog::default();
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        layer.write_at(ObjectId::Data(0), 0, &[2; 8192]).unwrap();
        let whole = log.durable();
        let mut torn = whole.clone();
        torn.extend_from_slice(&encode_record(FENCE, ObjectId::Data(0), 8192, &[5; 4096])[..100]);
        let again = BeforeImages::new(sim);
        let reopened = SimLog::from_bytes(torn);
        assert_eq!(
            again.arm(Box::new(reopened.clone()), FENCE).unwrap(),
            LogEnd::Torn {
                at: whole.len() as u64
            }
        );
        assert_eq!(reopened.durable(), whole);
        assert_eq!(again.imaged_blocks(), 2);
        // Imaged before the crash: not imaged again.
        again.write_at(ObjectId::Data(0), 4096, &[6; 4096]).unwrap();
        assert_eq!(reopened.durable(), whole);
        // Another fence's records are none of this one's.
        assert!(first_images(&whole, FENCE + 1, BeforeBreaks::default()).is_empty());
    }

    /// A log of `appends` appends, the first of two records (a
    /// `write_runs` of two distant runs), each append's blocks new, and
    /// where each record starts.
    fn log_of(appends: u64) -> (Vec<u8>, Vec<u64>) {
        let sim = Arc::new(SimStorage::new());
        let layer = BeforeImages::new(sim);
        let log = SimLog::default();
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Whole
        );
        let one: [&[u8]; 1] = [&[1; 4096]];
        layer
            .write_runs(
                ObjectId::Data(0),
                &[
                    Run {
                        offset: 0,
                        parts: &one,
                    },
                    Run {
                        offset: 8 * IMAGE_BLOCK,
                        parts: &one,
                    },
                ],
            )
            .unwrap();
        for append in 1..appends {
            layer
                .write_at(ObjectId::Data(1), append * IMAGE_BLOCK, &[3; 4096])
                .unwrap();
        }
        let bytes = log.durable();
        let (records, scanned) = read_records(&bytes, FENCE);
        assert_eq!(scanned.end, LogEnd::Whole);
        assert_eq!(records.len() as u64, appends + 1);
        (bytes, records.iter().map(|r| r.payload_at - 40).collect())
    }

    #[test]
    fn a_record_damaged_with_any_valid_record_after_it_is_corrupt_not_a_torn_tail() {
        let (mut bytes, starts) = log_of(4);
        // A byte of the first record's payload flipped (a media error).
        bytes[starts[0] as usize + RECORD_HEADER_BYTES + 100] ^= 0x40;
        for piece in [SCAN_PIECE, 4096, 41, 7] {
            let scanned = scan_log(&SliceLog(&bytes), FENCE, piece, &mut |_| {}).unwrap();
            assert_eq!(
                scanned.end,
                LogEnd::Corrupt {
                    at: 0,
                    later: starts[1]
                },
                "piece {piece}"
            );
        }
        // Arming refuses it: not armed, and the log is not cut.
        let layer = BeforeImages::new(Arc::new(SimStorage::new()));
        let log = SimLog::from_bytes(bytes.clone());
        assert_eq!(
            layer.arm(Box::new(log.clone()), FENCE).unwrap(),
            LogEnd::Corrupt {
                at: 0,
                later: starts[1]
            }
        );
        assert!(!layer.is_armed());
        assert_eq!(log.durable(), bytes);
        // The second record of the last append damaged, its header: a
        // valid one follows (review42 H1: it was synced, then damaged).
        let (mut bytes, starts) = log_of(2);
        bytes[starts[1] as usize + 2] ^= 1;
        let (records, scanned) = read_records(&bytes, FENCE);
        assert_eq!(records.len(), 1);
        assert_eq!(
            scanned.end,
            LogEnd::Corrupt {
                at: starts[1],
                later: starts[2]
            }
        );
    }

    #[test]
    fn only_a_bad_tail_with_nothing_valid_after_it_is_torn() {
        // A record torn by a crash (its bytes short, or a page of it lost),
        // nothing valid after it: cut there, the rest kept.
        let (whole, starts) = log_of(3);
        for torn in [whole[..starts[3] as usize + 50].to_vec(), {
            let mut bytes = whole.clone();
            bytes[starts[3] as usize + RECORD_HEADER_BYTES + 5] ^= 0xff;
            bytes
        }] {
            let log = SimLog::from_bytes(torn);
            let layer = BeforeImages::new(Arc::new(SimStorage::new()));
            assert_eq!(
                layer.arm(Box::new(log.clone()), FENCE).unwrap(),
                LogEnd::Torn { at: starts[3] }
            );
            assert!(layer.is_armed());
            assert_eq!(log.durable(), whole[..starts[3] as usize]);
            assert_eq!(layer.imaged_blocks(), 3);
        }
    }
}
