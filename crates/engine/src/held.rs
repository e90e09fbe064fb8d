//! The held log: what makes an acknowledged write survive a crash of the
//! vouch process (docs/CRASH_MODEL.md, "Two failures").
//!
//! A write is acknowledged once it is in the write-back buffer, before its
//! commit. The buffer is process memory, so a `kill -9` would lose it while
//! the kernel — and every NBD client that reconnects — carries on as if
//! nothing happened. So before a block enters the buffer it is appended,
//! sealed (bytes as stored + context), to a slot of the held log: a file in
//! memory that outlives the process (tmpfs: `Storage`'s `Held` objects;
//! `storage/file.rs` says where). A pwrite to it costs a copy in memory,
//! never a device write, and a power cut loses it exactly as it loses the
//! write-back buffer — what the NBD contract allows for unflushed writes.
//!
//! Two slots, one per write-back buffer. Writers append to the *active*
//! slot under the log's lock and insert into the buffer before releasing
//! it, so the buffer and its slot never disagree; a commit swaps the
//! buffer and the slots together (under the same lock), and once the
//! commit's home writes are in the kernel it empties the committing slot
//! (a new epoch in its header: the records left in it are dead). The
//! ORDER: append (pwrite returned) -> buffer -> acknowledge; commit home
//! writes returned -> empty the slot. A crash anywhere keeps every
//! acknowledged block in a slot or in the kernel's copy of the volume.
//!
//! At open, after the journal's recovery, the live records of both slots
//! (the lower epoch first) are put back into the write-back buffer in the
//! order they were written; a writable open then commits and flushes them
//! and empties both slots before it serves anything.

use std::collections::BTreeMap;

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard};
use vouch_format::held::{
    decode_entry, encode_entry, entries_crc, HeldHeader, RecordHeader, ENTRY_BYTES, FLAG_DROP,
    HELD_HEADER_BYTES, RECORD_HEADER_BYTES,
};
use vouch_format::Context;

use crate::backing::Backing;
use crate::error::{Error, Fault, Result};
use crate::protection::Protection;
use crate::state::{BlockData, DirtyBlock, BLOCK};
use crate::storage::ObjectId;

/// One thing the held log recorded, in the order it was written.
pub(crate) enum Held {
    /// Blocks as buffered: LBA, context (with the seal), stored bytes.
    Blocks(Vec<(u64, Context, Bytes)>),
    /// Blocks `[first, first + count)` logged before were superseded.
    Drop { first: u64, count: u64 },
}

/// The log of one volume. `lock` is held across an append and the insert
/// into the write-back buffer that it covers.
pub(crate) struct HeldLog {
    inner: Mutex<HeldSlots>,
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
        let mut slots = HeldSlots {
            enabled,
            uuid,
            boot_id,
            active: 0,
            tail: HELD_HEADER_BYTES,
            epochs: [0; 2],
            used: [false; 2],
        };
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
                inner: Mutex::new(slots),
            },
            held,
        ))
    }

    pub fn lock(&self) -> MutexGuard<'_, HeldSlots> {
        self.inner.lock()
    }

    /// Empty `slot` (a new epoch in its header): its records are dead.
    pub fn empty(&self, io: &Backing, slot: usize) -> Result<()> {
        self.lock().empty(io, slot)
    }

    /// Empty both slots (after the open's replay is durable), making the
    /// headers this boot's.
    pub fn empty_all(&self, io: &Backing) -> Result<()> {
        let mut slots = self.lock();
        if !slots.enabled {
            return Ok(());
        }
        io.storage()
            .prepare_held()
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
    /// No slot holds a live record.
    pub fn is_empty(&self) -> bool {
        !self.used[0] && !self.used[1]
    }

    /// Append `blocks` (as they will be buffered) to the active slot. The
    /// caller then buffers them before releasing the lock.
    pub fn append(
        &mut self,
        io: &Backing,
        protection: &dyn Protection,
        blocks: &[(u64, DirtyBlock)],
    ) -> Result<()> {
        if !self.enabled || blocks.is_empty() {
            return Ok(());
        }
        let mut entries = Vec::with_capacity(blocks.len() * ENTRY_BYTES);
        for (lba, dirty) in blocks {
            let context = protection.context(*lba, dirty.seal, 0);
            encode_entry(&mut entries, *lba, &context.encode());
        }
        let header = RecordHeader {
            epoch: self.epochs[self.active],
            count: blocks.len() as u32,
            flags: 0,
            entries_crc: entries_crc(&entries),
            first: 0,
            blocks: 0,
        };
        let mut parts: Vec<&[u8]> = Vec::with_capacity(blocks.len() + 1);
        parts.push(&entries);
        parts.extend(blocks.iter().map(|(_, dirty)| &dirty.data[..]));
        self.write_record(io, header, &parts)
    }

    /// Append a record saying the blocks `[first, first + count)` logged
    /// so far are superseded (their buffered copies were dropped).
    pub fn append_drop(&mut self, io: &Backing, first: u64, count: u64) -> Result<()> {
        if !self.enabled || !self.used[self.active] {
            return Ok(());
        }
        let header = RecordHeader {
            epoch: self.epochs[self.active],
            count: 0,
            flags: FLAG_DROP,
            entries_crc: entries_crc(&[]),
            first,
            blocks: count,
        };
        self.write_record(io, header, &[])
    }

    /// The body first, then the header: a header found after a crash
    /// means its body is whole (a process crash keeps every write that
    /// returned, in order).
    fn write_record(&mut self, io: &Backing, header: RecordHeader, body: &[&[u8]]) -> Result<()> {
        let object = slot_object(self.active);
        let at = self.tail;
        let storage = io.storage();
        if !body.is_empty() {
            let body_at = at + RECORD_HEADER_BYTES as u64;
            storage
                .write_vectored_at(object, body_at, body)
                .map_err(|cause| Error::HeldLog { op: "write", cause })?;
        }
        storage
            .write_at(object, at, &header.encode())
            .map_err(|cause| Error::HeldLog { op: "write", cause })?;
        self.tail = at + header.record_bytes();
        self.used[self.active] = true;
        Ok(())
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

    fn empty(&mut self, io: &Backing, slot: usize) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let epoch = self.epochs[0].max(self.epochs[1]) + 1;
        let header = HeldHeader {
            slot: slot as u32,
            uuid: self.uuid,
            boot_id: self.boot_id,
            epoch,
        };
        let object = slot_object(slot);
        io.storage()
            .write_at(object, 0, &header.encode())
            .map_err(|cause| Error::HeldLog { op: "write", cause })?;
        self.epochs[slot] = epoch;
        self.used[slot] = false;
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
    let len = storage
        .object_len(object)
        .map_err(|error| Error::io("read", object, 0, error))?
        .unwrap_or(0);
    if len < HELD_HEADER_BYTES {
        return Ok(None);
    }
    let mut page = vec![0u8; HELD_HEADER_BYTES as usize];
    io.read_object(object, 0, &mut page)?;
    let Ok(header) = HeldHeader::decode(&page) else {
        return Ok(None);
    };
    if header.uuid != uuid || header.boot_id != boot_id {
        return Ok(None);
    }
    let mut records = Vec::new();
    let mut at = HELD_HEADER_BYTES;
    let mut raw = [0u8; RECORD_HEADER_BYTES];
    while at + RECORD_HEADER_BYTES as u64 <= len {
        io.read_object(object, at, &mut raw)?;
        let Ok(record) = RecordHeader::decode(&raw) else {
            break;
        };
        if record.epoch != header.epoch || at + record.record_bytes() > len {
            break;
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
        let data_at = at + (RECORD_HEADER_BYTES + entries.len()) as u64;
        io.read_object(object, data_at, &mut data)?;
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
/// record the pwrite finished cannot fail this: a failure is damage, and
/// refuses the open naming the block). Returns the blocks put back.
pub(crate) fn rebuffer(shared: &crate::shared::Shared, held: Vec<Held>) -> Result<u64> {
    let geometry = shared.io.geometry;
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
                    shared
                        .protection
                        .open(lba, &Ok(context), &data)
                        .map_err(|kind| Error::Fault(Fault { lba, kind }))?;
                    let Some(seal) = shared.protection.seal_of(&context) else {
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
    let mut state = shared.state.write();
    for (lba, dirty) in blocks {
        state.buffer(lba, dirty);
    }
    Ok(count)
}
