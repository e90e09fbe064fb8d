//! The simulated storage backend: objects held in memory, with *live* bytes
//! (what reads see) and *durable* bytes (what survives a crash), a log of the
//! writes made since each object's last sync, and fault hooks. It serves the
//! same `Storage` trait as real files, so the engine under test is the
//! production engine.
//!
//! `crash_image` builds the state a power loss could leave: the durable
//! bytes plus any chosen subset of the unsynced writes, each whole, dropped
//! or torn at 512-byte sector granularity, and no held log (it is memory).
//! `duplicate` is what a crash of the process alone leaves: every write
//! that returned, synced or not, and the held log.
//!
//! Reads that complete later (`Storage::start_read`, the NBD reactor's
//! ring reads) are taken once the simulator asks for them
//! (`accept_reads`) and complete when it says (`complete_reads`), reading
//! their bytes at that moment, as the device does when the read reaches
//! it: whatever was written in between is what they see.
//!
//! Reads that must not wait (`Storage::read_at_nowait`, the inline read
//! path) decline until the simulator says which pages are cached
//! (`cache_pages`): from then on each such read finds its pages in the
//! page cache, and answers from the live bytes, or does not and declines,
//! as a seeded stream of its own draws.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::storage::direct::AlignedBuf;
use crate::storage::{nowait, CloneRange, ObjectId, ReadLater, Storage};

const PAGE: u64 = 4096;
pub const SECTOR: u64 = 512;

/// Sparse bytes: absent pages read as zero.
#[derive(Clone, Default, Debug)]
pub struct SparseBytes {
    pages: BTreeMap<u64, Box<[u8; PAGE as usize]>>,
}

impl SparseBytes {
    pub fn read(&self, offset: u64, buf: &mut [u8]) {
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let (page, within) = (at / PAGE, (at % PAGE) as usize);
            let n = (PAGE as usize - within).min(buf.len() - done);
            match self.pages.get(&page) {
                Some(bytes) => buf[done..done + n].copy_from_slice(&bytes[within..within + n]),
                None => buf[done..done + n].fill(0),
            }
            done += n;
        }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let (page, within) = (at / PAGE, (at % PAGE) as usize);
            let n = (PAGE as usize - within).min(data.len() - done);
            let bytes = self
                .pages
                .entry(page)
                .or_insert_with(|| Box::new([0u8; PAGE as usize]));
            bytes[within..within + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
    }

    pub fn punch(&mut self, offset: u64, len: u64) {
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let (page, within) = (at / PAGE, at % PAGE);
            let n = (PAGE - within).min(end - at);
            if n == PAGE {
                self.pages.remove(&page);
            } else if let Some(bytes) = self.pages.get_mut(&page) {
                bytes[within as usize..(within + n) as usize].fill(0);
            }
            at += n;
        }
    }

    pub fn next_data(&self, offset: u64) -> Option<u64> {
        self.pages
            .range(offset / PAGE..)
            .next()
            .map(|(page, _)| (page * PAGE).max(offset))
    }

    pub fn allocated(&self) -> u64 {
        self.pages.len() as u64 * PAGE
    }

    /// The end of the last page holding bytes (0 when empty).
    pub fn end(&self) -> u64 {
        self.pages
            .last_key_value()
            .map_or(0, |(page, _)| (page + 1) * PAGE)
    }
}

/// A write (or hole punch) made since the object's last sync.
#[derive(Clone, Debug)]
pub enum PendingOp {
    Write { offset: u64, data: Vec<u8> },
    Punch { offset: u64, len: u64 },
}

impl PendingOp {
    fn apply(&self, bytes: &mut SparseBytes) {
        match self {
            PendingOp::Write { offset, data } => bytes.write(*offset, data),
            PendingOp::Punch { offset, len } => bytes.punch(*offset, *len),
        }
    }
    /// Sectors this op covers (a torn write persists a subset of them).
    pub fn sectors(&self) -> u64 {
        match self {
            PendingOp::Write { offset, data } => {
                let end = offset + data.len() as u64;
                end.div_ceil(SECTOR) - offset / SECTOR
            }
            PendingOp::Punch { .. } => 1,
        }
    }
}

#[derive(Clone, Default, Debug)]
struct SimObject {
    live: SparseBytes,
    durable: SparseBytes,
    pending: Vec<PendingOp>,
}

/// Faults the backend injects on the I/O path. All default to off.
#[derive(Clone, Default, Debug)]
pub struct FaultPlan {
    /// Fail the write that brings the count of successful writes to this.
    pub fail_write_after: Option<u64>,
    /// Fail every sync from now on.
    pub fail_sync: bool,
    /// ENOSPC once this many bytes have been written in total.
    pub enospc_after_bytes: Option<u64>,
    /// Reads overlapping this (object, offset, len) fail with EIO.
    pub read_error: Option<(ObjectId, u64, u64)>,
    /// Writes to (object, from) land at (object, to) instead: a misdirected write.
    pub misdirect_write: Option<(ObjectId, u64, u64)>,
    /// Writes to (object, offset) are acknowledged and dropped: a lost write.
    pub lose_write: Option<(ObjectId, u64)>,
    /// A read whose range holds (object, from) is served from a place
    /// displaced by `to - from`, so the bytes it returns for `from` are
    /// those at (object, to): a misdirected read (the whole I/O lands
    /// elsewhere). A read that starts before `from` (a packed run widened
    /// to 4 KiB) is displaced too, as long as the place exists.
    pub misdirect_read: Option<(ObjectId, u64, u64)>,
}

#[derive(Default)]
struct SimState {
    objects: BTreeMap<ObjectId, SimObject>,
    /// Objects cut to a length (`truncate`): their length from then on, grown
    /// by writes past it. Other objects have no length of their own.
    lengths: BTreeMap<ObjectId, u64>,
    /// Objects deleted (`remove`): opening the volume finds them missing.
    removed: std::collections::BTreeSet<ObjectId>,
    faults: FaultPlan,
    writes_done: u64,
    bytes_written: u64,
    syncs: u64,
    /// `start_read` takes reads (`accept_reads`).
    accepting_reads: bool,
    /// Reads started and not completed yet, in the order started.
    started_reads: Vec<StartedRead>,
    /// Whether `read_at_nowait` finds its pages cached: `None` (never,
    /// the default) or the state of the seeded draws (`cache_pages`).
    cached_draws: Option<u64>,
}

/// Of `CACHED_OF` nowait reads, this many find their pages cached (the
/// rest decline, so the simulator drives both outcomes).
const CACHED: u64 = 3;
const CACHED_OF: u64 = 4;

/// A read `start_read` took, completed by `complete_reads`.
struct StartedRead {
    object: ObjectId,
    offset: u64,
    len: usize,
    done: ReadLater,
}

/// The in-memory backend. Cloning shares the same state.
#[derive(Clone, Default)]
pub struct SimStorage {
    state: Arc<Mutex<SimState>>,
    /// The landing area (`Storage::landing_window`), made when first asked
    /// for: memory that a crash of the process keeps (`duplicate` copies
    /// it) and a power cut does not (`crash_image` leaves it).
    landing: Arc<std::sync::OnceLock<SimLanding>>,
}

/// Bytes of the simulated landing area: enough for the simulator's small
/// volumes (a payload that finds no room is received into process memory,
/// as in production).
const SIM_LANDING_BYTES: usize = 4 << 20;

/// The simulated landing area: fixed memory at a stable address, written
/// through the pointer `landing_window` gives (as a mapping is). Read
/// whole by `duplicate` while nothing writes it: a simulated volume and
/// its crash images are driven by one thread.
struct SimLanding {
    base: std::ptr::NonNull<u8>,
}

// SAFETY: the memory is owned by this value alone and freed in `drop`;
// concurrent access goes through the raw pointer, to disjoint regions
// (the engine's landing allocator hands each out once).
unsafe impl Send for SimLanding {}
// SAFETY: as above.
unsafe impl Sync for SimLanding {}

impl SimLanding {
    fn new(from: Option<&SimLanding>) -> SimLanding {
        let mut bytes = vec![0u8; SIM_LANDING_BYTES].into_boxed_slice();
        if let Some(from) = from {
            bytes.copy_from_slice(from.bytes());
        }
        let base = std::ptr::NonNull::new(Box::into_raw(bytes).cast::<u8>())
            .expect("a boxed slice is never null");
        SimLanding { base }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `base` is a live allocation of SIM_LANDING_BYTES.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), SIM_LANDING_BYTES) }
    }
}

impl Drop for SimLanding {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` of a slice of this length in
        // `new`; nothing uses it after the storage (and every engine
        // region, which holds the storage) is gone.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.base.as_ptr(),
                SIM_LANDING_BYTES,
            ))
        });
    }
}

fn injected(kind: io::ErrorKind, what: &str) -> io::Error {
    io::Error::new(kind, format!("injected fault: {what}"))
}

impl SimStorage {
    pub fn new() -> SimStorage {
        SimStorage::default()
    }

    pub fn set_faults(&self, plan: FaultPlan) {
        self.state.lock().faults = plan;
    }

    /// Take reads that complete later from now on (`Storage::start_read`;
    /// `reads_ready` says so). The simulator stands in for the NBD
    /// reactor's event loop: it completes them itself (`complete_reads`),
    /// so there is no descriptor to wait on (`read_events` stays `None`).
    pub fn accept_reads(&self) {
        self.state.lock().accepting_reads = true;
    }

    /// Answer `read_at_nowait` from now on: each call finds the pages it
    /// reads in the page cache (and reads the live bytes, injected read
    /// faults included, as `read_at`) CACHED times in CACHED_OF, drawn
    /// from `seed`, and declines with `WouldBlock` otherwise.
    pub fn cache_pages(&self, seed: u64) {
        self.state.lock().cached_draws = Some(seed);
    }

    /// Drop the reads in flight without completing them (their callbacks
    /// never run): what a run that stops early does, so that what they
    /// hold (a ring read holds its volume's engine) is freed.
    pub fn drop_reads(&self) -> usize {
        let dropped = std::mem::take(&mut self.state.lock().started_reads);
        dropped.len()
    }

    /// Complete the started reads `pick` chooses (asked once for each, in
    /// the order they started; the others stay in flight): each reads its
    /// bytes now, injected read faults included, and its callback runs on
    /// this thread with no lock held. Returns how many completed.
    pub fn complete_reads(&self, mut pick: impl FnMut() -> bool) -> usize {
        let chosen: Vec<StartedRead> = {
            let mut state = self.state.lock();
            let (chosen, later) = std::mem::take(&mut state.started_reads)
                .into_iter()
                .partition(|_| pick());
            state.started_reads = later;
            chosen
        };
        let count = chosen.len();
        for read in chosen {
            let mut buf = AlignedBuf::zeroed(read.len);
            let result = self.read_at(read.object, read.offset, &mut buf);
            (read.done)(result.map(|()| buf));
        }
        count
    }

    pub fn faults(&self) -> FaultPlan {
        self.state.lock().faults.clone()
    }

    /// Writes and syncs performed so far.
    pub fn counts(&self) -> (u64, u64) {
        let state = self.state.lock();
        (state.writes_done, state.syncs)
    }

    /// Unsynced operations per object, in issue order.
    pub fn pending(&self) -> Vec<(ObjectId, Vec<PendingOp>)> {
        let state = self.state.lock();
        state
            .objects
            .iter()
            .map(|(id, object)| (*id, object.pending.clone()))
            .collect()
    }

    /// Number of unsynced operations across all objects.
    pub fn pending_count(&self) -> usize {
        self.state
            .lock()
            .objects
            .values()
            .map(|object| object.pending.len())
            .sum()
    }

    /// The state after a power loss. `choose(object, index, op)` returns, for
    /// each unsynced op, a mask of the sectors that persist (bit i = sector i
    /// of the op; `u64::MAX` = all, 0 = dropped). Ops are applied in issue
    /// order over the durable bytes.
    pub fn crash_image(
        &self,
        mut choose: impl FnMut(ObjectId, usize, &PendingOp) -> u64,
    ) -> SimStorage {
        let state = self.state.lock();
        let mut objects = BTreeMap::new();
        for (id, object) in &state.objects {
            if matches!(id, ObjectId::Held(_)) {
                // Memory that outlives the process, not the machine.
                continue;
            }
            let mut bytes = object.durable.clone();
            for (index, op) in object.pending.iter().enumerate() {
                let mask = choose(*id, index, op);
                if mask == 0 {
                    continue;
                }
                match op {
                    PendingOp::Write { offset, data } if mask != u64::MAX => {
                        apply_torn(&mut bytes, *offset, data, mask);
                    }
                    _ => op.apply(&mut bytes),
                }
            }
            objects.insert(
                *id,
                SimObject {
                    live: bytes.clone(),
                    durable: bytes,
                    pending: Vec::new(),
                },
            );
        }
        SimStorage {
            state: Arc::new(Mutex::new(SimState {
                objects,
                lengths: state.lengths.clone(),
                removed: state.removed.clone(),
                ..SimState::default()
            })),
            // The landing area is memory, lost with the machine.
            landing: Arc::default(),
        }
    }

    /// Corrupt stored bytes in place (live and durable): XOR `mask` into the
    /// byte at `offset`. For injecting bit rot.
    pub fn corrupt(&self, object: ObjectId, offset: u64, mask: u8) {
        let mut state = self.state.lock();
        let entry = state.objects.entry(object).or_default();
        for bytes in [&mut entry.live, &mut entry.durable] {
            let mut byte = [0u8];
            bytes.read(offset, &mut byte);
            byte[0] ^= mask;
            bytes.write(offset, &byte);
        }
    }

    /// Overwrite stored bytes in place (live and durable).
    pub fn overwrite(&self, object: ObjectId, offset: u64, data: &[u8]) {
        let mut state = self.state.lock();
        let entry = state.objects.entry(object).or_default();
        entry.live.write(offset, data);
        entry.durable.write(offset, data);
    }

    /// Cut `object` to `len` bytes (live and durable), as `truncate(1)`
    /// would: the bytes past it are gone, and `object_len` reports it.
    pub fn truncate(&self, object: ObjectId, len: u64) {
        let mut state = self.state.lock();
        let entry = state.objects.entry(object).or_default();
        for bytes in [&mut entry.live, &mut entry.durable] {
            let end = bytes.end();
            if end > len {
                bytes.punch(len, end - len);
            }
        }
        state.lengths.insert(object, len);
    }

    /// Delete `object`, as `rm` would: `object_len` then fails with
    /// `NotFound`, the way opening a missing file does.
    pub fn remove(&self, object: ObjectId) {
        let mut state = self.state.lock();
        state.objects.remove(&object);
        state.lengths.remove(&object);
        state.removed.insert(object);
    }

    /// A copy of every object (live, durable and pending bytes, lengths and
    /// removals) that shares nothing with this one: damage can be injected
    /// into the copy and the original used again.
    pub fn duplicate(&self) -> SimStorage {
        let state = self.state.lock();
        let landing = std::sync::OnceLock::new();
        if let Some(from) = self.landing.get() {
            let _ = landing.set(SimLanding::new(Some(from)));
        }
        SimStorage {
            state: Arc::new(Mutex::new(SimState {
                objects: state.objects.clone(),
                faults: state.faults.clone(),
                lengths: state.lengths.clone(),
                removed: state.removed.clone(),
                ..SimState::default()
            })),
            landing: Arc::new(landing),
        }
    }

    /// Make `object` what it is in `from` (live and durable bytes, length),
    /// as restoring an older copy of one file would.
    pub fn replace_object(&self, object: ObjectId, from: &SimStorage) {
        let source = from.state.lock();
        let copy = source.objects.get(&object).cloned();
        let len = source.lengths.get(&object).copied();
        drop(source);
        let mut state = self.state.lock();
        state.removed.remove(&object);
        match copy {
            Some(entry) => state.objects.insert(object, entry),
            None => state.objects.remove(&object),
        };
        match len {
            Some(len) => state.lengths.insert(object, len),
            None => state.lengths.remove(&object),
        };
    }

    /// An object's live bytes, up to the last byte written (the file a
    /// crash simulator copies: `vouch-sim snapshot`).
    pub fn object_bytes(&self, object: ObjectId) -> Vec<u8> {
        let state = self.state.lock();
        let Some(entry) = state.objects.get(&object) else {
            return Vec::new();
        };
        let len = state
            .lengths
            .get(&object)
            .copied()
            .unwrap_or_else(|| entry.live.end());
        let mut bytes = vec![0u8; len as usize];
        entry.live.read(0, &mut bytes);
        bytes
    }

    /// Read the live bytes without going through fault hooks.
    pub fn peek(&self, object: ObjectId, offset: u64, buf: &mut [u8]) {
        let state = self.state.lock();
        match state.objects.get(&object) {
            Some(entry) => entry.live.read(offset, buf),
            None => buf.fill(0),
        }
    }
}

fn apply_torn(bytes: &mut SparseBytes, offset: u64, data: &[u8], mask: u64) {
    let first_sector = offset / SECTOR;
    let end = offset + data.len() as u64;
    let mut sector = first_sector;
    while sector * SECTOR < end {
        let index = sector - first_sector;
        if index >= 64 || mask & (1 << index) != 0 {
            let from = (sector * SECTOR).max(offset);
            let to = ((sector + 1) * SECTOR).min(end);
            bytes.write(
                from,
                &data[(from - offset) as usize..(to - offset) as usize],
            );
        }
        sector += 1;
    }
}

fn overlaps(a_offset: u64, a_len: u64, b_offset: u64, b_len: u64) -> bool {
    a_offset < b_offset + b_len && b_offset < a_offset + a_len
}

/// One draw of splitmix64 from `state` (the cached-pages stream).
fn next_draw(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SimState {
    /// `read_at`'s bytes: the live bytes, through the read fault hooks.
    fn read_live(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if let Some((id, at, len)) = self.faults.read_error {
            if id == object && overlaps(offset, buf.len() as u64, at, len) {
                return Err(injected(io::ErrorKind::Other, "read error"));
            }
        }
        let mut source = offset;
        if let Some((id, from, to)) = self.faults.misdirect_read {
            if id == object && overlaps(offset, buf.len() as u64, from, 1) {
                if let Some(displaced) = to.checked_sub(from - offset) {
                    source = displaced;
                }
            }
        }
        match self.objects.get(&object) {
            Some(entry) => entry.live.read(source, buf),
            None => buf.fill(0),
        }
        Ok(())
    }
}

impl Storage for SimStorage {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.state.lock().read_live(object, offset, buf)
    }

    /// Declines (`WouldBlock`) until `cache_pages`, then as its draws say.
    fn read_at_nowait(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut state = self.state.lock();
        let cached = match state.cached_draws.as_mut() {
            Some(draws) => next_draw(draws) % CACHED_OF < CACHED,
            None => false,
        };
        if !cached {
            return Err(nowait::would_block());
        }
        state.read_live(object, offset, buf)
    }

    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut state = self.state.lock();
        if let Some(limit) = state.faults.fail_write_after {
            if state.writes_done >= limit {
                return Err(injected(io::ErrorKind::Other, "write error"));
            }
        }
        if let Some(limit) = state.faults.enospc_after_bytes {
            if state.bytes_written + data.len() as u64 > limit {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        state.writes_done += 1;
        state.bytes_written += data.len() as u64;
        if state.faults.lose_write == Some((object, offset)) {
            return Ok(());
        }
        let mut target = offset;
        if let Some((id, from, to)) = state.faults.misdirect_write {
            if id == object && from == offset {
                target = to;
            }
        }
        if let Some(len) = state.lengths.get_mut(&object) {
            *len = (*len).max(target + data.len() as u64);
        }
        let entry = state.objects.entry(object).or_default();
        entry.live.write(target, data);
        entry.pending.push(PendingOp::Write {
            offset: target,
            data: data.to_vec(),
        });
        Ok(())
    }

    fn sync(&self, object: ObjectId) -> io::Result<()> {
        let mut state = self.state.lock();
        if state.faults.fail_sync {
            return Err(injected(io::ErrorKind::Other, "sync error"));
        }
        state.syncs += 1;
        let entry = state.objects.entry(object).or_default();
        let pending = std::mem::take(&mut entry.pending);
        for op in &pending {
            op.apply(&mut entry.durable);
        }
        Ok(())
    }

    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        let mut state = self.state.lock();
        let entry = state.objects.entry(object).or_default();
        entry.live.punch(offset, len);
        entry.pending.push(PendingOp::Punch { offset, len });
        Ok(())
    }

    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        let state = self.state.lock();
        Ok(state
            .objects
            .get(&object)
            .and_then(|entry| entry.live.next_data(offset)))
    }

    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        let state = self.state.lock();
        Ok(state
            .objects
            .get(&object)
            .map_or(0, |entry| entry.live.allocated()))
    }

    fn has_held(&self) -> bool {
        true
    }

    /// Taken once the simulator accepts reads (`accept_reads`), and only
    /// of whole pages, as the ring's are; completed by `complete_reads`.
    fn start_read(
        &self,
        object: ObjectId,
        offset: u64,
        len: usize,
        done: ReadLater,
    ) -> Result<(), ReadLater> {
        let mut state = self.state.lock();
        if !state.accepting_reads || len == 0 || !(len as u64).is_multiple_of(PAGE) {
            return Err(done);
        }
        state.started_reads.push(StartedRead {
            object,
            offset,
            len,
            done,
        });
        Ok(())
    }

    /// Completes every read in flight now; `WouldBlock` when there was none.
    fn reap_reads(&self) -> io::Result<()> {
        match self.complete_reads(|| true) {
            0 => Err(nowait::would_block()),
            _ => Ok(()),
        }
    }

    fn reads_ready(&self) -> bool {
        self.state.lock().accepting_reads
    }

    fn reads_in_flight(&self) -> usize {
        self.state.lock().started_reads.len()
    }

    fn landing_window(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        let landing = self.landing.get_or_init(|| SimLanding::new(None));
        Some((landing.base, SIM_LANDING_BYTES))
    }

    fn grow_landing(&self, _from: u64, end: u64) -> io::Result<()> {
        match end <= SIM_LANDING_BYTES as u64 {
            true => Ok(()),
            false => Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "the simulated landing area is full",
            )),
        }
    }

    fn read_landing(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        let landing = self
            .landing
            .get()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no landing area"))?;
        let bytes = landing.bytes();
        let range = usize::try_from(at)
            .ok()
            .and_then(|at| Some(at..at.checked_add(buf.len())?))
            .filter(|range| range.end <= bytes.len())
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::UnexpectedEof, "past the landing area's end")
            })?;
        buf.copy_from_slice(&bytes[range]);
        Ok(())
    }

    /// One boot for the simulation: a power cut (`crash_image`) takes the
    /// held log with it instead.
    fn boot_id(&self) -> [u8; 16] {
        [0x5e; 16]
    }

    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        let state = self.state.lock();
        if let ObjectId::Held(_) = object {
            // Held slots grow as written; their length is how far.
            return Ok(state.objects.get(&object).map(|entry| entry.live.end()));
        }
        if state.removed.contains(&object) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is missing", object.file_name()),
            ));
        }
        Ok(state.lengths.get(&object).copied())
    }

    /// A simulated reflink: the source's live bytes become one unsynced
    /// write per 4 KiB block, so a crash keeps or loses each block (and
    /// tears it like any write, if the crash image tears sectors).
    fn clone_range(&self, clone: CloneRange<'_>) -> io::Result<()> {
        let mut bytes = vec![0u8; clone.len as usize];
        clone
            .source
            .read_at(clone.source_object, clone.source_offset, &mut bytes)?;
        for (index, block) in bytes.chunks(PAGE as usize).enumerate() {
            self.write_at(clone.object, clone.offset + index as u64 * PAGE, block)?;
        }
        Ok(())
    }

    fn probe_clone(&self, _source: &dyn Storage, _source_object: ObjectId) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_writes_can_be_dropped_or_torn() {
        let sim = SimStorage::new();
        sim.write_at(ObjectId::Journal, 0, &[1u8; 4096]).unwrap();
        sim.sync(ObjectId::Journal).unwrap();
        sim.write_at(ObjectId::Journal, 0, &[2u8; 4096]).unwrap();
        let dropped = sim.crash_image(|_, _, _| 0);
        let mut buf = [0u8; 4096];
        dropped.read_at(ObjectId::Journal, 0, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 1));
        let torn = sim.crash_image(|_, _, _| 0b1);
        torn.read_at(ObjectId::Journal, 0, &mut buf).unwrap();
        assert!(buf[..512].iter().all(|b| *b == 2) && buf[512..].iter().all(|b| *b == 1));
        let kept = sim.crash_image(|_, _, _| u64::MAX);
        kept.read_at(ObjectId::Journal, 0, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 2));
    }

    #[test]
    fn nowait_reads_decline_until_pages_are_cached_then_as_drawn() {
        let sim = SimStorage::new();
        sim.write_at(ObjectId::Journal, 0, &[3u8; 4096]).unwrap();
        let mut buf = [0u8; 4096];
        let declined = sim.read_at_nowait(ObjectId::Journal, 0, &mut buf);
        assert_eq!(declined.unwrap_err().kind(), io::ErrorKind::WouldBlock);
        sim.cache_pages(7);
        let (mut answered, mut declined) = (0, 0);
        for _ in 0..64 {
            buf.fill(0);
            match sim.read_at_nowait(ObjectId::Journal, 0, &mut buf) {
                Ok(()) => {
                    assert!(buf.iter().all(|b| *b == 3));
                    answered += 1;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => declined += 1,
                Err(error) => panic!("{error}"),
            }
        }
        assert!(
            answered > 0 && declined > 0,
            "{answered} answered, {declined} declined"
        );
    }

    #[test]
    fn dropped_reads_release_what_their_callbacks_hold() {
        let sim = SimStorage::new();
        sim.accept_reads();
        let held = Arc::new(());
        let inside = Arc::clone(&held);
        let done: ReadLater = Box::new(move |_| drop(inside));
        assert!(sim.start_read(ObjectId::Journal, 0, 4096, done).is_ok());
        assert_eq!(Arc::strong_count(&held), 2);
        assert_eq!(sim.drop_reads(), 1);
        assert_eq!(Arc::strong_count(&held), 1);
        assert_eq!(sim.reads_in_flight(), 0);
    }

    #[test]
    fn sparse_bytes_punch_and_seek() {
        let mut bytes = SparseBytes::default();
        bytes.write(10_000, &[7u8; 100]);
        assert_eq!(bytes.next_data(0), Some(8192));
        bytes.punch(8192, 4096);
        assert_eq!(bytes.next_data(0), None);
    }
}
