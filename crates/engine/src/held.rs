//! The held log: what makes an acknowledged write survive a crash of the
//! vouch process (docs/CRASH_MODEL.md, "Two failures").
//!
//! A write is acknowledged once it is in the write-back buffer, before its
//! commit. The buffer is process memory, so a `kill -9` would lose it while
//! the kernel — and every NBD client that reconnects — carries on as if
//! nothing happened. So before a block enters the buffer it is appended,
//! sealed (bytes as stored + context), to a slot of the held log: a file in
//! memory that outlives the process (tmpfs: `Storage`'s `Held` objects;
//! `storage/file.rs` says where). A copy into it costs a memcpy,
//! never a device write, and a power cut loses it exactly as it loses the
//! write-back buffer — what the NBD contract allows for unflushed writes.
//!
//! Two slots, one per write-back buffer. A writer takes its record's place
//! in the active slot under the log's lock — the record's header written
//! there, `done` not yet set — and inserts its blocks into the buffer
//! before releasing it, so the buffer and its slot never disagree on
//! order; then it copies the record's body into its place beside other
//! writers' copies, sets the record's `done` word, and only then is the
//! write acknowledged. A commit swaps the buffer and the slots together
//! (under the same lock); once the commit's home writes are in the kernel
//! and the committing slot's copies in flight have finished, it empties
//! that slot (a new epoch in its header: the records left in it are dead).
//! ORDER: header (place taken) -> buffer -> body -> done -> acknowledge;
//! commit home writes returned and copies finished -> empty the slot. A
//! crash anywhere keeps every acknowledged block in a slot (done) or in
//! the kernel's copy of the volume; a record not done was never
//! acknowledged and is skipped.
//!
//! At open, after the journal's recovery, the live records of both slots
//! (the lower epoch first) are put back into the write-back buffer in the
//! order they were written; a writable open then commits and flushes them
//! and empties both slots before it serves anything.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};
use vouch_format::held::{
    decode_entry, done_word, encode_entry, entries_crc, HeldHeader, RecordHeader, SizedWord,
    DONE_AT, ENTRY_BYTES, FLAG_DROP, FLAG_LANDED, HELD_HEADER_BYTES, HELD_VERSION,
    HELD_VERSION_BODY_FIRST, RECORD_HEADER_BYTES, SIZED_AT, SIZED_BYTES,
};
use vouch_format::Context;

use crate::backing::Backing;
use crate::error::{Error, Fault, Result};
use crate::landing::{LandingArea, LandingBuffer};
use crate::protection::Protection;
use crate::state::{BlockData, DirtyBlock, VolumeState, BLOCK};
use crate::storage::ObjectId;

/// One thing the held log recorded, in the order it was written.
pub(crate) enum Held {
    /// Blocks as buffered: LBA, context (with the seal), stored bytes.
    Blocks(Vec<(u64, Context, Bytes)>),
    /// Blocks `[first, first + count)` logged before were superseded.
    Drop { first: u64, count: u64 },
}

/// The log of one volume. Its lock is held while a record's place is
/// taken and its blocks are buffered, never across the body's copy.
pub(crate) struct HeldLog {
    /// The storage keeps held slots (`HeldSlots::enabled`, fixed at open).
    enabled: bool,
    inner: Mutex<HeldSlots>,
    /// Records of each slot whose place is taken and whose body is still
    /// being copied: a slot is emptied only when none is left. Counted
    /// outside the lock, so a finished copy takes no lock...
    copying: [AtomicUsize; 2],
    /// ...unless a commit waits for the count to reach 0 (`empty`): it
    /// sets this, then checks the count, under the lock; a copy lowers the
    /// count, then checks this (both sequentially consistent, so one of
    /// them sees the other) and takes the lock to signal.
    waiting: AtomicBool,
    /// Signalled when a slot's last copy in flight finishes.
    copied: Condvar,
    /// Where large payloads are received (`landing.rs`): a writable open
    /// of a volume whose blocks are stored as written makes it.
    landing: std::sync::OnceLock<std::sync::Arc<LandingArea>>,
}

/// The slots' positions, behind the log's lock.
pub(crate) struct HeldSlots {
    /// The storage has no held objects (a read-only open that found
    /// none): nothing is appended, and nothing needs to be.
    enabled: bool,
    uuid: [u8; 16],
    boot_id: [u8; 16],
    /// The slot writers append to.
    active: usize,
    /// Where the next record of the active slot goes.
    tail: u64,
    /// Each slot's live epoch.
    epochs: [u64; 2],
    /// Whether each slot holds live records.
    used: [bool; 2],
    /// Whether this process wrote each slot's whole header page (its
    /// first emptying, at open): from then on an emptying changes only
    /// the epoch and the CRC (`empty`).
    headed: [bool; 2],
    /// Bytes of each slot the storage made room for (`grow_held`).
    grown: [u64; 2],
    /// Each slot file's length (`object_len`) after it last grew, kept in
    /// its header page (`SizedWord`): a file found shorter was cut.
    sized: [u64; 2],
    /// The blocks of each landed record of each slot: their bytes keep the
    /// landing regions the record names from being reused until the slot
    /// is emptied (`landing.rs`).
    kept: [Vec<BlockData>; 2],
}

/// Records of up to this many blocks keep their entries and their parts
/// on the stack (`Entries`, `HeldLog::fill`): a 4 KiB write, the most
/// common, then allocates nothing for its record (perf of a remote
/// mirror's 4 KiB writes: malloc and free were ~3 % of each side's CPU).
const INLINE_BLOCKS: usize = 8;

/// A record's entries (`HeldLog::entries`): in place for up to
/// `INLINE_BLOCKS` blocks, else on the heap (`Vec::new` allocates nothing
/// for the small ones).
pub(crate) struct Entries {
    inline: [u8; INLINE_BLOCKS * ENTRY_BYTES],
    len: usize,
    heap: Vec<u8>,
}

impl Entries {
    /// Zeroed entries for `count` blocks.
    fn new(count: usize) -> Entries {
        let len = count * ENTRY_BYTES;
        Entries {
            inline: [0; INLINE_BLOCKS * ENTRY_BYTES],
            len,
            heap: if count > INLINE_BLOCKS {
                vec![0; len]
            } else {
                Vec::new()
            },
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len <= self.inline.len() {
            &mut self.inline[..self.len]
        } else {
            &mut self.heap
        }
    }
}

impl std::ops::Deref for Entries {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        if self.len <= self.inline.len() {
            &self.inline[..self.len]
        } else {
            &self.heap
        }
    }
}

/// Where the bytes of a slot's header page that an emptying changes start:
/// the epoch (48-55), the reserved word (56-59, zero) and the CRC (60-63),
/// 16-byte aligned (`HeldSlots::empty`).
const EPOCH_PAIR_AT: usize = 48;

/// Room is made in a slot this much at a time: a write rarely pays for it.
const GROW_STEP: u64 = 8 << 20;

/// A record whose header is in its slot and whose body its writer copies
/// (`HeldLog::fill`).
#[must_use = "a placed record must be filled, or its slot is never emptied"]
pub(crate) struct Placed {
    slot: usize,
    at: u64,
    epoch: u64,
    /// The blocks are in the landing area: the body is the entries only.
    landed: bool,
}

fn slot_object(slot: usize) -> ObjectId {
    ObjectId::Held(slot as u8)
}

impl HeldLog {
    /// Read both slots: the log, and what they hold for this volume and
    /// this boot, oldest first. Nothing is written.
    pub fn open(io: &Backing, uuid: [u8; 16]) -> Result<(HeldLog, Vec<Held>)> {
        let storage = io.storage();
        let enabled = storage.has_held();
        let boot_id = storage.boot_id();
        let mut slots = HeldSlots::new(enabled, uuid, boot_id);
        let mut found: Vec<(u64, Vec<Held>)> = Vec::new();
        if enabled {
            for slot in 0..2 {
                if let Some((epoch, records)) = read_slot(io, slot, uuid, boot_id)? {
                    slots.epochs[slot] = epoch;
                    found.push((epoch, records));
                }
            }
        }
        found.sort_by_key(|(epoch, _)| *epoch);
        let held = found.into_iter().flat_map(|(_, records)| records).collect();
        Ok((
            HeldLog {
                enabled,
                inner: Mutex::new(slots),
                copying: [AtomicUsize::new(0), AtomicUsize::new(0)],
                waiting: AtomicBool::new(false),
                copied: Condvar::new(),
                landing: std::sync::OnceLock::new(),
            },
            held,
        ))
    }

    /// Make the landing area (a writable open, after `empty_all`: nothing
    /// live names it any more), if the storage has one.
    pub fn open_landing(&self, io: &Backing) {
        if !self.enabled {
            return;
        }
        if let Some(area) = LandingArea::new(io.storage_arc()) {
            let _ = self.landing.set(area);
        }
    }

    /// A region of the landing area to receive a payload of `len` bytes
    /// into, if there is an area and room in it.
    pub fn landing_buffer(&self, len: usize) -> Option<LandingBuffer> {
        self.landing.get()?.take(len)
    }

    /// Where `blocks` are in the landing area, if they are one run of it
    /// in LBA order (a payload received there, sealed where it lies).
    pub fn landed(&self, blocks: &[(u64, DirtyBlock)]) -> Option<u64> {
        let area = self.landing.get()?;
        let (_, first) = blocks.first()?;
        let start = first.data.as_ptr();
        let offset = area.offset_of(start, blocks.len() * BLOCK as usize)?;
        let in_a_row = blocks.iter().enumerate().all(|(index, (_, dirty))| {
            std::ptr::eq(
                dirty.data.as_ptr(),
                start.wrapping_add(index * BLOCK as usize),
            )
        });
        in_a_row.then_some(offset)
    }

    pub fn lock(&self) -> MutexGuard<'_, HeldSlots> {
        self.inner.lock()
    }

    /// The entries of a record of `blocks` (as they will be buffered): an
    /// LBA and context each. Made before the lock is taken; empty when
    /// nothing is logged.
    pub fn entries(&self, protection: &dyn Protection, blocks: &[(u64, DirtyBlock)]) -> Entries {
        let count = if self.enabled { blocks.len() } else { 0 };
        let mut entries = Entries::new(count);
        for (index, (lba, dirty)) in blocks.iter().take(count).enumerate() {
            let context = protection.context(*lba, dirty.seal, 0);
            let at = index * ENTRY_BYTES;
            encode_entry(
                &mut entries.bytes_mut()[at..at + ENTRY_BYTES],
                *lba,
                &context.encode(),
            );
        }
        entries
    }

    /// Copy a placed record's body (`entries`, then the blocks' bytes)
    /// into its place and set its `done` word: from then on a crash of
    /// the process keeps it. Runs outside the lock, beside other writers.
    pub fn fill(
        &self,
        io: &Backing,
        placed: Placed,
        entries: &[u8],
        blocks: &[(u64, DirtyBlock)],
    ) -> Result<()> {
        let storage = io.storage();
        let slot = placed.slot as u8;
        // The parts on the stack for a record of a few blocks, as
        // `Entries` keeps its bytes: no allocation for a small write.
        let mut inline: [&[u8]; INLINE_BLOCKS + 1] = [&[]; INLINE_BLOCKS + 1];
        let mut heap: Vec<&[u8]> = Vec::new();
        let bodies = if placed.landed { 0 } else { blocks.len() };
        let parts: &[&[u8]] = if bodies <= INLINE_BLOCKS {
            inline[0] = entries;
            for (part, (_, dirty)) in inline[1..].iter_mut().zip(&blocks[..bodies]) {
                *part = &dirty.data[..];
            }
            &inline[..bodies + 1]
        } else {
            heap.reserve_exact(bodies + 1);
            heap.push(entries);
            heap.extend(blocks.iter().map(|(_, dirty)| &dirty.data[..]));
            &heap
        };
        let result = storage
            .write_held(slot, placed.at + RECORD_HEADER_BYTES as u64, parts)
            .and_then(|()| {
                storage.publish_held(slot, placed.at + DONE_AT as u64, done_word(placed.epoch))
            })
            .map_err(|cause| Error::HeldLog { op: "write", cause });
        if self.copying[placed.slot].fetch_sub(1, Ordering::SeqCst) == 1
            && self.waiting.load(Ordering::SeqCst)
        {
            let _slots = self.lock();
            self.copied.notify_all();
        }
        result
    }

    /// Take the place of a record of `blocks` (whose `entries` `entries`
    /// made) in the active slot of `slots` (this log's, locked): its
    /// header written, its body left to `fill`, which the caller runs
    /// after buffering the blocks and releasing the lock. `None` when
    /// nothing is logged. `landed`: the blocks' offset in the landing area
    /// (`landed`), which the record names instead of holding them.
    pub fn place(
        &self,
        slots: &mut HeldSlots,
        io: &Backing,
        entries: &[u8],
        blocks: &[(u64, DirtyBlock)],
        landed: Option<u64>,
    ) -> Result<Option<Placed>> {
        let placed = slots.place(io, entries, blocks, landed)?;
        if let Some(placed) = &placed {
            self.copying[placed.slot].fetch_add(1, Ordering::SeqCst);
        }
        Ok(placed)
    }

    /// Empty `slot` (a new epoch in its header): its records are dead.
    /// Waits for the copies still in flight into it (they finish without
    /// the lock, so never for long).
    pub fn empty(&self, io: &Backing, slot: usize) -> Result<()> {
        let mut slots = self.lock();
        if self.copying[slot].load(Ordering::SeqCst) > 0 {
            self.waiting.store(true, Ordering::SeqCst);
            while self.copying[slot].load(Ordering::SeqCst) > 0 {
                self.copied.wait(&mut slots);
            }
            self.waiting.store(false, Ordering::SeqCst);
        }
        slots.empty(io, slot)
    }

    /// Empty both slots (after the open's replay is durable), making the
    /// headers this boot's. New slots get their headers before anything
    /// points at them (`Storage::prepare_held`).
    pub fn empty_all(&self, io: &Backing) -> Result<()> {
        let mut slots = self.lock();
        if !slots.enabled {
            return Ok(());
        }
        let next = slots.epochs[0].max(slots.epochs[1]);
        let pages = [
            slots.header_page(0, next + 1),
            slots.header_page(1, next + 2),
        ];
        io.storage()
            .prepare_held([&pages[0], &pages[1]])
            .map_err(|cause| Error::HeldLog {
                op: "create",
                cause,
            })?;
        slots.empty(io, 0)?;
        slots.empty(io, 1)?;
        slots.active = 0;
        slots.tail = HELD_HEADER_BYTES;
        Ok(())
    }
}

impl HeldSlots {
    /// Slots at epoch 0, the first slot active, nothing written by this
    /// process yet.
    fn new(enabled: bool, uuid: [u8; 16], boot_id: [u8; 16]) -> HeldSlots {
        HeldSlots {
            enabled,
            uuid,
            boot_id,
            active: 0,
            tail: HELD_HEADER_BYTES,
            epochs: [0; 2],
            used: [false; 2],
            headed: [false; 2],
            grown: [0; 2],
            sized: [0; 2],
            kept: [Vec::new(), Vec::new()],
        }
    }

    /// No slot holds a live record.
    pub fn is_empty(&self) -> bool {
        !self.used[0] && !self.used[1]
    }

    /// `HeldLog::place`, less the count of copies in flight.
    fn place(
        &mut self,
        io: &Backing,
        entries: &[u8],
        blocks: &[(u64, DirtyBlock)],
        landed: Option<u64>,
    ) -> Result<Option<Placed>> {
        if !self.enabled || blocks.is_empty() {
            return Ok(None);
        }
        let epoch = self.epochs[self.active];
        let header = RecordHeader {
            epoch,
            count: blocks.len() as u32,
            flags: if landed.is_some() { FLAG_LANDED } else { 0 },
            entries_crc: entries_crc(entries),
            first: landed.unwrap_or(0),
            blocks: 0,
        };
        let at = self.write_header(io, &header, header.encode())?;
        if landed.is_some() {
            // The region stays as it is while the record naming it lives:
            // every block is kept (a run that crossed from one region into
            // the next would leave the second free if only one were).
            let kept = &mut self.kept[self.active];
            kept.extend(blocks.iter().map(|(_, dirty)| dirty.data.clone()));
        }
        Ok(Some(Placed {
            slot: self.active,
            at,
            epoch,
            landed: landed.is_some(),
        }))
    }

    /// Append a record saying the blocks `[first, first + count)` logged
    /// so far are superseded (their buffered copies were dropped): no
    /// body, so it is written done.
    pub fn append_drop(&mut self, io: &Backing, first: u64, count: u64) -> Result<()> {
        if !self.enabled || !self.used[self.active] {
            return Ok(());
        }
        let epoch = self.epochs[self.active];
        let header = RecordHeader {
            epoch,
            count: 0,
            flags: FLAG_DROP,
            entries_crc: entries_crc(&[]),
            first,
            blocks: count,
        };
        let mut raw = header.encode();
        raw[DONE_AT..DONE_AT + 8].copy_from_slice(&done_word(epoch).to_le_bytes());
        self.write_header(io, &header, raw).map(|_| ())
    }

    /// Write a record's header at the active slot's tail (room for the
    /// whole record made first) and move the tail past the record.
    /// Headers are written one at a time under the lock, back to back, so
    /// after a crash every record before the last header has its header.
    fn write_header(
        &mut self,
        io: &Backing,
        header: &RecordHeader,
        raw: [u8; RECORD_HEADER_BYTES],
    ) -> Result<u64> {
        let slot = self.active;
        let at = self.tail;
        let end = at + header.record_bytes();
        let storage = io.storage();
        if end > self.grown[slot] {
            // A step at a time, or just what this record needs when the
            // step does not fit (a small runtime directory fills up whole).
            let from = self.grown[slot];
            let step = end.div_ceil(GROW_STEP) * GROW_STEP;
            let exact = end.div_ceil(BLOCK) * BLOCK;
            let grown = match storage.grow_held(slot as u8, from, step) {
                Ok(()) => step,
                Err(_) => storage
                    .grow_held(slot as u8, from, exact)
                    .map(|()| exact)
                    .map_err(|cause| Error::HeldLog { op: "write", cause })?,
            };
            self.grown[slot] = grown;
            self.note_size(io, slot)?;
        }
        storage
            .write_held(slot as u8, at, &[&raw])
            .map_err(|cause| Error::HeldLog { op: "write", cause })?;
        self.tail = end;
        self.used[slot] = true;
        Ok(at)
    }

    /// A commit takes the buffer: writers go on in the other slot (empty:
    /// the previous commit emptied it). Returns the slot the commit must
    /// empty once its home writes are in the kernel, if it holds records.
    ///
    /// Replay orders the slots by epoch, so the slot writers go on in must
    /// have the higher one: a slot that sat out a commit unused kept the
    /// epoch it had, lower than the one now committing, and is emptied
    /// again first. (Without this a crash during the commit replayed the
    /// newer writes first and the older ones over them: found by
    /// serve_crash.rs, packed, with trims.) `reempty_stale` is false only
    /// in the simulator's self-test of that bug (`OrderingBreaks`).
    pub fn swap(&mut self, io: &Backing, reempty_stale: bool) -> Result<Option<usize>> {
        if !self.enabled {
            return Ok(None);
        }
        let committing = self.active;
        let next = 1 - committing;
        debug_assert!(!self.used[next], "the other slot is not empty");
        if reempty_stale && self.epochs[next] < self.epochs[committing] {
            self.empty(io, next)?;
        }
        self.active = next;
        self.tail = HELD_HEADER_BYTES;
        Ok(self.used[committing].then_some(committing))
    }

    /// The header page of `slot` at `epoch`, with the slot's length.
    fn header_page(&self, slot: usize, epoch: u64) -> Vec<u8> {
        let mut page = HeldHeader {
            slot: slot as u32,
            uuid: self.uuid,
            boot_id: self.boot_id,
            epoch,
            version: HELD_VERSION,
        }
        .encode();
        let sized = SizedWord {
            length: self.sized[slot],
        };
        page[SIZED_AT..SIZED_AT + SIZED_BYTES].copy_from_slice(&sized.encode());
        page
    }

    /// Record in `slot`'s header page the file's length now that it grew
    /// (a rare step: `GROW_STEP`). The length is read back rather than
    /// assumed: where the storage cannot allocate ahead, the file is only
    /// as long as what was written, and files never shrink while open. A
    /// crash before this store leaves the smaller length: never a false
    /// refusal.
    fn note_size(&mut self, io: &Backing, slot: usize) -> Result<()> {
        let storage = io.storage();
        let length = storage
            .object_len(slot_object(slot))
            .map_err(|cause| Error::HeldLog { op: "write", cause })?
            .unwrap_or(0);
        if length <= self.sized[slot] {
            return Ok(());
        }
        self.sized[slot] = length;
        storage
            .write_held(
                slot as u8,
                SIZED_AT as u64,
                &[&SizedWord { length }.encode()],
            )
            .map_err(|cause| Error::HeldLog { op: "write", cause })
    }

    /// Write `slot`'s header with a new epoch. No copy may be in flight
    /// into it (`HeldLog::empty` waits for them; the slot `swap` empties
    /// again was not written since the previous commit emptied it).
    ///
    /// The first emptying of a slot (at open) writes its whole header
    /// page. Every later one changes only bytes 48-63 of it (the epoch,
    /// the reserved word, the CRC: the rest of the header is this
    /// process's and the same), replaced together by one 16-byte store
    /// (`Storage::store_held_pair`): no syscall on the commit path, and
    /// a crash of the process leaves the old header or the new, each
    /// valid, never one that fails its CRC (which would refuse the open
    /// as a damaged slot). The old header is a crash just before the
    /// emptying: its records replay before the other slot's, as they
    /// already could.
    fn empty(&mut self, io: &Backing, slot: usize) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let epoch = self.epochs[0].max(self.epochs[1]) + 1;
        let page = self.header_page(slot, epoch);
        let storage = io.storage();
        let stored = if self.headed[slot] {
            let pair: [u8; 16] = page[EPOCH_PAIR_AT..EPOCH_PAIR_AT + 16]
                .try_into()
                .expect("16 bytes");
            storage.store_held_pair(slot as u8, EPOCH_PAIR_AT as u64, pair)
        } else {
            storage.write_at(slot_object(slot), 0, &page)
        };
        stored.map_err(|cause| Error::HeldLog { op: "write", cause })?;
        self.headed[slot] = true;
        self.epochs[slot] = epoch;
        self.used[slot] = false;
        // Its records are dead: the landing regions they named may go.
        self.kept[slot].clear();
        if slot == self.active {
            self.tail = HELD_HEADER_BYTES;
        }
        Ok(())
    }
}

/// The live records of `slot`, if its header is this volume's and this
/// boot's: whole records with the slot's epoch, up to the first that is
/// not (a record cut by the crash, or a dead one from an earlier epoch).
fn read_slot(
    io: &Backing,
    slot: usize,
    uuid: [u8; 16],
    boot_id: [u8; 16],
) -> Result<Option<(u64, Vec<Held>)>> {
    let object = slot_object(slot);
    let storage = io.storage();
    // A slot the volume's `held` file names was given its header before
    // the file named it: one without is damage (truncated, zeroed,
    // replaced), and reading it as empty would lose acknowledged writes
    // silently.
    let named = storage.held_named();
    let damaged = |what: &str| {
        Error::Corrupt(format!(
            "held log slot {slot} {what}: the volume's `held` file names it as holding the writes a vouch process of this boot acknowledged before it stopped, and they cannot be recovered from it; to open the volume without them (they read as they were before), remove the `held` file in the volume directory"
        ))
    };
    let len = storage
        .object_len(object)
        .map_err(|error| Error::io("read", object, 0, error))?
        .unwrap_or(0);
    if len < HELD_HEADER_BYTES {
        return match named {
            true => Err(damaged(&format!("is {len} bytes, shorter than its header"))),
            false => Ok(None),
        };
    }
    let mut page = vec![0u8; HELD_HEADER_BYTES as usize];
    io.read_object(object, 0, &mut page)?;
    let header = match HeldHeader::decode(&page) {
        Ok(header) => header,
        Err(error) if named => return Err(damaged(&format!("has no valid header ({error})"))),
        Err(_) => return Ok(None),
    };
    if header.uuid != uuid || header.boot_id != boot_id {
        return match named {
            true => Err(damaged("belongs to another volume or another boot")),
            false => Ok(None),
        };
    }
    if let Some(sized) = SizedWord::decode(&page[SIZED_AT..SIZED_AT + SIZED_BYTES]) {
        if named && len < sized.length {
            return Err(damaged(&format!(
                "is cut short: {len} bytes, where it had grown to {} (records at its end are gone)",
                sized.length
            )));
        }
    }
    // Version 1 wrote each body before its header: a header means whole.
    let needs_done = header.version != HELD_VERSION_BODY_FIRST;
    let mut records = Vec::new();
    let mut at = HELD_HEADER_BYTES;
    let mut raw = [0u8; RECORD_HEADER_BYTES];
    while at + RECORD_HEADER_BYTES as u64 <= len {
        io.read_object(object, at, &mut raw)?;
        let Ok(record) = RecordHeader::decode(&raw) else {
            break;
        };
        if record.epoch != header.epoch {
            break;
        }
        if at + record.record_bytes() > len {
            // Room for a record is made before its header is written, so
            // a live header whose record runs past the file means the
            // file was cut: damage, not the end of the log.
            if named {
                return Err(damaged(&format!(
                    "is cut short: its record at byte {at} runs past its end ({len} bytes)"
                )));
            }
            break;
        }
        if needs_done && !record.is_done(&raw) {
            // Its place was taken, its copy not finished: never
            // acknowledged. The records after it may be.
            tracing::debug!(
                slot,
                at,
                count = record.count,
                "held log record not done, skipped"
            );
            at += record.record_bytes();
            continue;
        }
        if record.flags & FLAG_DROP != 0 {
            tracing::debug!(
                slot,
                first = record.first,
                blocks = record.blocks,
                "held log drop record"
            );
            records.push(Held::Drop {
                first: record.first,
                count: record.blocks,
            });
            at += record.record_bytes();
            continue;
        }
        let count = record.count as usize;
        let mut entries = vec![0u8; count * ENTRY_BYTES];
        io.read_object(object, at + RECORD_HEADER_BYTES as u64, &mut entries)?;
        if entries_crc(&entries) != record.entries_crc {
            break;
        }
        let mut data = vec![0u8; count * BLOCK as usize];
        if record.flags & FLAG_LANDED != 0 {
            // The blocks are where the payload was received.
            storage.read_landing(record.first, &mut data).map_err(|error| {
                damaged(&format!(
                    "has a record at byte {at} whose blocks are in the landing file at byte {}, which cannot be read ({error})",
                    record.first
                ))
            })?;
        } else {
            let data_at = at + (RECORD_HEADER_BYTES + entries.len()) as u64;
            io.read_object(object, data_at, &mut data)?;
        }
        let data = Bytes::from(data);
        let mut blocks = Vec::with_capacity(count);
        for index in 0..count {
            let (lba, raw_context) = decode_entry(&entries, index);
            let context = Context::decode(raw_context).map_err(|error| {
                Error::Corrupt(format!(
                    "held log slot {slot}: the context logged for LBA {lba} does not decode: {error}"
                ))
            })?;
            let start = index * BLOCK as usize;
            blocks.push((lba, context, data.slice(start..start + BLOCK as usize)));
        }
        tracing::debug!(
            slot,
            epoch = header.epoch,
            at,
            first = blocks.first().map(|(lba, _, _)| *lba),
            count,
            "held log record"
        );
        records.push(Held::Blocks(blocks));
        at += record.record_bytes();
    }
    Ok(Some((header.epoch, records)))
}

/// Put what the held log kept back into the write-back buffer, in order:
/// each block verified against its context for its LBA first (a whole
/// record marked done cannot fail this: a failure is damage, and
/// refuses the open naming the block). Returns the blocks put back.
pub(crate) fn rebuffer(
    io: &Backing,
    protection: &dyn Protection,
    state: &RwLock<VolumeState>,
    held: Vec<Held>,
) -> Result<u64> {
    let geometry = io.geometry;
    let mut blocks: BTreeMap<u64, DirtyBlock> = BTreeMap::new();
    for record in held {
        match record {
            Held::Drop { first, count } => {
                let end = first.saturating_add(count);
                let stale: Vec<u64> = blocks.range(first..end).map(|(lba, _)| *lba).collect();
                for lba in stale {
                    blocks.remove(&lba);
                }
            }
            Held::Blocks(records) => {
                for (lba, context, data) in records {
                    if lba >= geometry.blocks {
                        return Err(Error::Corrupt(format!(
                            "held log: a block logged for LBA {lba}, past the volume's {} blocks",
                            geometry.blocks
                        )));
                    }
                    protection
                        .open(lba, &Ok(context), &data)
                        .map_err(|kind| {
                            Error::Corrupt(format!(
                                "held log: the block a vouch process of this boot acknowledged for LBA {lba} and held there is damaged ({}); to open the volume without the held writes (they read as they were before), remove the `held` file in the volume directory",
                                Fault { lba, kind }
                            ))
                        })?;
                    let Some(seal) = protection.seal_of(&context) else {
                        return Err(Error::Corrupt(format!(
                            "held log: LBA {lba} logged with a {:?} context",
                            context.kind()
                        )));
                    };
                    blocks.insert(
                        lba,
                        DirtyBlock {
                            data: BlockData::from_bytes(data),
                            seal,
                        },
                    );
                }
            }
        }
    }
    let count = blocks.len() as u64;
    let mut state = state.write();
    for (lba, dirty) in blocks {
        state.buffer(lba, dirty);
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vouch_format::CONTEXT_BYTES;

    /// An emptying after the first replaces only bytes 48-63 of a slot's
    /// header page (`HeldSlots::empty`): two epochs' pages differ nowhere
    /// else, and those bytes are one 16-byte-aligned run.
    #[test]
    fn an_emptying_changes_only_the_epoch_pair() {
        let mut slots = HeldSlots::new(true, [3; 16], [5; 16]);
        slots.sized = [8 << 20, 16 << 20];
        assert_eq!(EPOCH_PAIR_AT % 16, 0);
        for slot in 0..2 {
            let old = slots.header_page(slot, 7);
            let new = slots.header_page(slot, 8);
            let changed: Vec<usize> = (0..old.len()).filter(|at| old[*at] != new[*at]).collect();
            assert!(!changed.is_empty(), "the epoch changed");
            assert!(
                changed
                    .iter()
                    .all(|at| (EPOCH_PAIR_AT..EPOCH_PAIR_AT + 16).contains(at)),
                "slot {slot}: bytes {changed:?} changed"
            );
            let mut stored = old.clone();
            stored[EPOCH_PAIR_AT..EPOCH_PAIR_AT + 16]
                .copy_from_slice(&new[EPOCH_PAIR_AT..EPOCH_PAIR_AT + 16]);
            assert_eq!(stored, new);
            assert_eq!(
                HeldHeader::decode(&stored).map(|header| header.epoch),
                Ok(8)
            );
        }
    }

    /// Records of every size keep every entry: in place up to
    /// `INLINE_BLOCKS` blocks, on the heap past it.
    #[test]
    fn entries_keep_every_count_in_place_or_on_the_heap() {
        for count in [0, 1, INLINE_BLOCKS, INLINE_BLOCKS + 1, 300] {
            let mut entries = Entries::new(count);
            for (index, entry) in entries.bytes_mut().chunks_mut(ENTRY_BYTES).enumerate() {
                encode_entry(entry, index as u64 * 7, &[index as u8; CONTEXT_BYTES]);
            }
            assert_eq!(entries.len(), count * ENTRY_BYTES, "{count} blocks");
            for index in 0..count {
                let (lba, context) = decode_entry(&entries, index);
                assert_eq!(lba, index as u64 * 7, "{count} blocks, entry {index}");
                assert_eq!(context, &[index as u8; CONTEXT_BYTES][..]);
            }
        }
    }
}
