//! What recovery after a crash costs: proportional to what the journal
//! holds, not to the number of its records, and nothing rewritten that
//! already lies at home (issue 28's "recovery time unchanged").

mod common;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use vouch_engine::{
    BlockDevice, CreateOptions, LayoutKind, ObjectId, OpenOptions, SimStorage, Storage, Volume,
    BLOCK,
};

/// The simulator's storage, counting the reads of the journal.
struct CountingJournalReads {
    sim: SimStorage,
    journal_reads: AtomicU64,
}

impl Storage for CountingJournalReads {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if object == ObjectId::Journal {
            self.journal_reads.fetch_add(1, Ordering::Relaxed);
        }
        self.sim.read_at(object, offset, buf)
    }
    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        self.sim.write_at(object, offset, data)
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

/// Prompt commits leave hundreds of small records; recovery reads the
/// journal in a few large sequential reads, not two per record (two per
/// record: 200 reads here).
#[test]
fn recovery_reads_a_journal_of_many_records_in_a_few_reads() {
    const RECORDS: u64 = 100;
    for layout in LayoutKind::ALL {
        let sim = SimStorage::new();
        let mut options = CreateOptions::new(BLOCKS * BLOCK);
        options.layout = layout;
        options.journal_bytes = Some(16 << 20);
        Volume::create(Arc::new(sim.clone()), &options)
            .and_then(Volume::close)
            .expect("create");
        let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).expect("open");
        for lba in 0..RECORDS {
            let lba = lba * 7 % BLOCKS;
            volume
                .write(lba * BLOCK, &pattern(lba, 2), false)
                .expect("write");
            volume.flush().expect("flush: one record");
        }
        // A crash: the engine's memory is gone, the storage keeps every write.
        drop(volume);

        let counting = Arc::new(CountingJournalReads {
            sim: sim.clone(),
            journal_reads: AtomicU64::new(0),
        });
        let volume = Volume::open(counting.clone(), &OpenOptions::default()).expect("reopen");
        let report = volume.recovery_report();
        assert_eq!(report.records_replayed, RECORDS, "{layout:?}");
        let reads = counting.journal_reads.load(Ordering::Relaxed);
        assert!(
            reads <= 8,
            "{layout:?}: {RECORDS} journal records recovered in {reads} journal reads"
        );
        for lba in 0..RECORDS {
            let lba = lba * 7 % BLOCKS;
            assert_eq!(
                read_range(&volume, lba, 1),
                pattern(lba, 2),
                "{layout:?}: LBA {lba}"
            );
        }
        volume.close().expect("close");
    }
}

/// A crash of the process alone leaves a packed commit's records at home
/// (written, then synced by the recovery before it replays): the replay
/// finds each slot as the journal has it and writes nothing; a slot that
/// does not hold its record (zeroed here, as a crash during the home
/// writes would leave it) is written again, and only that one.
#[test]
fn a_packed_recovery_does_not_rewrite_records_already_home() {
    const RECORD: u64 = BLOCK + 32;
    let lbas: Vec<u64> = (0..40).map(|i| i * 37 % BLOCKS).collect();
    let crashed = |damage: Option<u64>| {
        let (dir, path) = volume_dir(LayoutKind::Packed, &[]);
        let volume = open(&path);
        for (index, lba) in lbas.iter().enumerate() {
            volume
                .write(lba * BLOCK, &pattern(*lba, 2), false)
                .expect("write");
            if index % 10 == 9 {
                volume.flush().expect("flush: one record");
            }
        }
        // Written again by a later record: only its last copy is replayed.
        volume
            .write(lbas[0] * BLOCK, &pattern(lbas[0], 3), false)
            .expect("write");
        volume.flush().expect("flush");
        drop(volume);
        if let Some(lba) = damage {
            use std::os::unix::fs::FileExt;
            let at = data_offset(&path, lba);
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(path.join("data.00000"))
                .expect("open data.00000");
            file.write_all_at(&[0u8; RECORD as usize], at)
                .expect("zero a record");
        }
        let volume = open(&path);
        let report = volume.recovery_report().clone();
        let written = volume.stats().data_bytes_written.load(Ordering::Relaxed);
        for lba in &lbas {
            let tag = if *lba == lbas[0] { 3 } else { 2 };
            assert_eq!(
                read_range(&volume, *lba, 1),
                pattern(*lba, tag),
                "LBA {lba}"
            );
        }
        volume.close().expect("close");
        drop(dir);
        (report, written)
    };

    let (report, written) = crashed(None);
    assert_eq!(report.records_replayed, 5);
    assert_eq!(
        written, 0,
        "every record was home already: the replay wrote {written} bytes of data"
    );
    assert_eq!(report.blocks_verified, lbas.len() as u64);

    let (report, written) = crashed(Some(lbas[5]));
    assert_eq!(report.records_replayed, 5);
    assert_eq!(written, RECORD, "only the zeroed record is written again");
    assert_eq!(report.blocks_verified, lbas.len() as u64 - 1);
}
