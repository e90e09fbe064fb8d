//! A packed commit's journal record carries every block it commits (a
//! redo record). Its data is written from the buffered blocks themselves,
//! after the record's head, in one vectored write: no allocation of the
//! whole record and no copy of each block into it first (1 MiB sequential
//! writes spent a quarter of the server's CPU zeroing and filling those
//! records).

mod common;

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use common::*;
use parking_lot::Mutex;
use vouch_engine::{
    BlockDevice, CreateOptions, DeviceWrites, LayoutKind, ObjectId, OpenOptions, SimStorage,
    Storage, Volume, BLOCK,
};

/// The simulator's storage, keeping where each journal write's bytes
/// were in memory (address, length of each part).
#[derive(Default)]
struct Journaling {
    sim: SimStorage,
    journal_writes: Mutex<Vec<Vec<(usize, usize)>>>,
}

impl Journaling {
    fn note(&self, object: ObjectId, parts: &[&[u8]]) {
        if object == ObjectId::Journal {
            self.journal_writes.lock().push(
                parts
                    .iter()
                    .map(|part| (part.as_ptr() as usize, part.len()))
                    .collect(),
            );
        }
    }
}

impl Storage for Journaling {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.sim.read_at(object, offset, buf)
    }
    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        self.note(object, &[data]);
        self.sim.write_at(object, offset, data)
    }
    fn write_vectored_at(&self, object: ObjectId, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        self.note(object, parts);
        self.sim.write_vectored_at(object, offset, parts)
    }
    fn sync(&self, object: ObjectId) -> io::Result<()> {
        self.sim.sync(object)
    }
    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        self.sim.punch_hole(object, offset, len)
    }
    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        self.sim.next_data(object, offset)
    }
    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        self.sim.allocated_bytes(object)
    }
    fn object_len(&self, object: ObjectId) -> io::Result<Option<u64>> {
        self.sim.object_len(object)
    }
}

/// 64 blocks written as one payload and flushed: the journal receives
/// every one of them from the payload's own memory (0 bytes copied into
/// a record), and the blocks read back, also after a crash and the
/// journal's replay.
#[test]
fn a_packed_record_writes_its_blocks_from_where_they_are_buffered() {
    const COUNT: u64 = 64;
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = LayoutKind::Packed;
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create");
    let journaling = Arc::new(Journaling {
        sim: sim.clone(),
        ..Journaling::default()
    });
    let volume = Volume::open(journaling.clone(), &OpenOptions::default()).expect("open");
    journaling.journal_writes.lock().clear();
    let first = 100;
    let payload = Bytes::from(
        (first..first + COUNT)
            .flat_map(|lba| pattern(lba, 4))
            .collect::<Vec<u8>>(),
    );
    volume
        .write_bytes(first * BLOCK, &payload, false)
        .expect("write");
    volume.flush().expect("flush");

    let held = payload.as_ptr() as usize..payload.as_ptr() as usize + payload.len();
    let writes = journaling.journal_writes.lock().clone();
    let journaled: usize = writes.iter().flatten().map(|(_, len)| len).sum();
    let from_payload: usize = writes
        .iter()
        .flatten()
        .filter(|(at, len)| held.contains(at) && at + len <= held.end)
        .map(|(_, len)| len)
        .sum();
    assert!(
        journaled > payload.len(),
        "the flush journaled a record with the data ({journaled} bytes)"
    );
    assert_eq!(
        from_payload,
        payload.len(),
        "every block of the record written from the payload itself, none copied \
         into a record first (journal writes, parts as (address, length): {writes:?})"
    );
    assert_eq!(read_range(&volume, first, COUNT), payload.to_vec());

    // A crash: the record is all the storage has of the commit that
    // matters; the reopened volume replays it.
    drop(volume);
    let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).expect("reopen");
    assert_eq!(read_range(&volume, first, COUNT), payload.to_vec());
    volume.close().expect("close");
}
