//! What recovery after a crash costs: proportional to what the journal
//! holds, not to the number of its records, and each replayed block
//! written once (issue 28's "recovery time unchanged").

#![allow(clippy::single_range_in_vec_init)] // ranges of LBAs to write

mod common;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use common::*;
use vouch_engine::{
    BlockDevice, CreateOptions, LayoutKind, ObjectId, OpenOptions, SimStorage, Storage, Volume,
    BLOCK,
};

/// The simulator's storage, counting the reads of the journal, the data
/// and the context table, the writes of the data, and the data's syncs
/// after the first of those writes.
#[derive(Default)]
struct Counting {
    sim: SimStorage,
    journal_reads: AtomicU64,
    data_reads: AtomicU64,
    context_reads: AtomicU64,
    data_writes: AtomicU64,
    data_syncs_after_a_write: AtomicU64,
}

impl Counting {
    fn new(sim: &SimStorage) -> Arc<Counting> {
        Arc::new(Counting {
            sim: sim.clone(),
            ..Counting::default()
        })
    }

    fn count_write(&self, object: ObjectId) {
        if matches!(object, ObjectId::Data(_)) {
            self.data_writes.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Storage for Counting {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let counter = match object {
            ObjectId::Journal => Some(&self.journal_reads),
            ObjectId::Data(_) => Some(&self.data_reads),
            ObjectId::Contexts => Some(&self.context_reads),
            _ => None,
        };
        if let Some(counter) = counter {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        self.sim.read_at(object, offset, buf)
    }
    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        self.count_write(object);
        self.sim.write_at(object, offset, data)
    }
    fn write_vectored_at(&self, object: ObjectId, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        self.count_write(object);
        self.sim.write_vectored_at(object, offset, parts)
    }
    fn sync(&self, object: ObjectId) -> io::Result<()> {
        if matches!(object, ObjectId::Data(_)) && self.data_writes.load(Ordering::Relaxed) > 0 {
            self.data_syncs_after_a_write
                .fetch_add(1, Ordering::Relaxed);
        }
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

        let counting = Counting::new(&sim);
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

/// A packed replay writes each block once, from the last record that
/// writes it (each record rewrites the slot whole): 40 blocks in 5
/// records, one of them written again by the last, are 40 record writes
/// (41 before). A record found at home as the journal has it is written
/// all the same (CRASH_MODEL.md: the page cache may hold what the disk
/// does not), so a slot zeroed meanwhile reads its record again.
#[test]
fn a_packed_recovery_writes_each_block_once_from_its_last_record() {
    const RECORD: u64 = BLOCK + 32;
    let lbas: Vec<u64> = (0..40).map(|i| i * 37 % BLOCKS).collect();
    for damage in [None, Some(lbas[5])] {
        let (_dir, path) = volume_dir(LayoutKind::Packed, &[]);
        let volume = open(&path);
        for (index, lba) in lbas.iter().enumerate() {
            volume
                .write(lba * BLOCK, &pattern(*lba, 2), false)
                .expect("write");
            if index % 10 == 9 {
                volume.flush().expect("flush: one record");
            }
        }
        volume
            .write(lbas[0] * BLOCK, &pattern(lbas[0], 3), false)
            .expect("write");
        volume.flush().expect("flush");
        // A crash: the records are in the journal and at home.
        drop(volume);
        if let Some(lba) = damage {
            use std::os::unix::fs::FileExt;
            let at = data_offset(&path, lba);
            std::fs::OpenOptions::new()
                .write(true)
                .open(path.join("data.00000"))
                .expect("open data.00000")
                .write_all_at(&[0u8; RECORD as usize], at)
                .expect("zero a record");
        }
        let volume = open(&path);
        assert_eq!(volume.recovery_report().records_replayed, 5);
        let written = volume.stats().data_bytes_written.load(Ordering::Relaxed);
        assert_eq!(
            written,
            lbas.len() as u64 * RECORD,
            "{damage:?}: one record write per block replayed"
        );
        for lba in &lbas {
            let tag = if *lba == lbas[0] { 3 } else { 2 };
            assert_eq!(
                read_range(&volume, *lba, 1),
                pattern(*lba, tag),
                "LBA {lba}"
            );
        }
        volume.close().expect("close");
    }
}

/// A journal holding a trim is replayed record by record (a trim works on
/// the rows as the records before it left them): a block written, trimmed
/// and written again reads its last write; written then trimmed, zeros.
#[test]
fn a_packed_replay_through_a_trim_reads_the_last_operation() {
    for trim_last in [false, true] {
        let (_dir, path) = volume_dir(LayoutKind::Packed, &[0..64]);
        let volume = open(&path);
        let lba = 40u64;
        volume
            .write(lba * BLOCK, &pattern(lba, 2), false)
            .expect("write A");
        volume.flush().expect("flush");
        volume.trim(lba * BLOCK, BLOCK, false).expect("trim");
        if !trim_last {
            volume
                .write(lba * BLOCK, &pattern(lba, 3), false)
                .expect("write B");
            volume.flush().expect("flush");
        }
        drop(volume);
        let volume = open(&path);
        assert!(volume.recovery_report().records_replayed >= 2);
        let expected = if trim_last {
            vec![0u8; BLOCK as usize]
        } else {
            pattern(lba, 3)
        };
        assert_eq!(
            read_range(&volume, lba, 1),
            expected,
            "trim last: {trim_last}"
        );
        for other in (0..64).filter(|other| *other != lba) {
            assert_eq!(
                read_range(&volume, other, 1),
                pattern(other, 1),
                "LBA {other}"
            );
        }
        volume.close().expect("close");
    }
}

/// A split volume's commits between flushes are verified at recovery: each
/// block they wrote is read back and matched against its contexts, the
/// one it had before among them (from the table on disk). 64 records of 16
/// adjacent blocks are read back in runs of adjacent blocks (4 reads of
/// 256 blocks, not 1,024 reads of one), and the 8 table pages their older
/// contexts are in in one read (not 8). After a power cut that took the
/// unsynced data, every block matches the context it had before, taken
/// from those pages: it reverts to its first write.
#[test]
fn a_split_recovery_reads_back_runs_of_blocks_and_of_table_pages() {
    const RECORD_BLOCKS: u64 = 16;
    const RECORDS: u64 = 64;
    const WRITTEN: u64 = RECORD_BLOCKS * RECORDS;
    for power_cut in [false, true] {
        let sim = SimStorage::new();
        let volume = Volume::create(Arc::new(sim.clone()), &CreateOptions::new(BLOCKS * BLOCK))
            .expect("create");
        // Every block's context in the table on disk (a close checkpoints).
        for lba in 0..WRITTEN {
            volume
                .write(lba * BLOCK, &pattern(lba, 1), false)
                .expect("write");
        }
        volume.close().expect("close");
        let mut options = OpenOptions::foreground();
        options.tuning.dirty_limit_blocks = RECORD_BLOCKS as usize;
        options.tuning.prompt_commits = false;
        let volume = Volume::open(Arc::new(sim.clone()), &options).expect("open");
        for lba in 0..WRITTEN {
            volume
                .write(lba * BLOCK, &pattern(lba, 2), false)
                .expect("write: a commit each 16 blocks");
        }
        // A crash: no flush since, so every record's blocks are verified.
        drop(volume);
        let (image, tag) = if power_cut {
            // The journal kept, the unsynced home writes lost.
            let image = sim.crash_image(|object, _, _| {
                if matches!(object, ObjectId::Data(_)) {
                    0
                } else {
                    u64::MAX
                }
            });
            (image, 1)
        } else {
            (sim, 2)
        };

        let counting = Counting::new(&image);
        let volume = Volume::open(counting.clone(), &OpenOptions::default()).expect("reopen");
        let report = volume.recovery_report();
        assert_eq!(report.records_replayed, RECORDS, "power cut: {power_cut}");
        assert_eq!(report.blocks_verified, WRITTEN, "power cut: {power_cut}");
        let reverted = if power_cut { WRITTEN } else { 0 };
        assert_eq!(report.blocks_reverted, reverted, "power cut: {power_cut}");
        let data_reads = counting.data_reads.load(Ordering::Relaxed);
        let context_reads = counting.context_reads.load(Ordering::Relaxed);
        assert!(
            data_reads <= WRITTEN / 256,
            "power cut: {power_cut}: {WRITTEN} adjacent blocks verified in {data_reads} reads"
        );
        assert!(
            context_reads <= 1,
            "power cut: {power_cut}: 8 adjacent table pages read in {context_reads} reads"
        );
        expect_patterns(&volume, 0..WRITTEN, tag, &format!("power cut: {power_cut}"));
        volume.close().expect("close");
    }
}

/// A split flush of at most 64 blocks journals their data (a redo
/// record); recovery writes them home again from the journal. 16 flushes
/// of 4 adjacent blocks are one write of the 64 blocks at recovery (64
/// writes, one per block, before).
#[test]
fn a_split_recovery_writes_redone_blocks_in_runs() {
    const FLUSHES: u64 = 16;
    const PER_FLUSH: u64 = 4;
    let sim = SimStorage::new();
    Volume::create(Arc::new(sim.clone()), &CreateOptions::new(BLOCKS * BLOCK))
        .and_then(Volume::close)
        .expect("create");
    let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::foreground()).expect("open");
    for flush in 0..FLUSHES {
        let first = flush * PER_FLUSH;
        let data: Vec<u8> = (first..first + PER_FLUSH)
            .flat_map(|lba| pattern(lba, 2))
            .collect();
        volume.write(first * BLOCK, &data, false).expect("write");
        volume.flush().expect("flush: a redo record");
    }
    drop(volume);

    let counting = Counting::new(&sim);
    let volume = Volume::open(counting.clone(), &OpenOptions::default()).expect("reopen");
    assert_eq!(volume.recovery_report().records_replayed, FLUSHES);
    let data_writes = counting.data_writes.load(Ordering::Relaxed);
    assert_eq!(
        data_writes,
        1,
        "{} adjacent blocks redone in {data_writes} writes",
        FLUSHES * PER_FLUSH
    );
    expect_patterns(&volume, 0..FLUSHES * PER_FLUSH, 2, "redone");
    volume.close().expect("close");
}

/// A power cut now, three ways: none of the unsynced writes kept, all of
/// them, every other one. Each image replays `records` records, then
/// passes `check`.
fn after_power_cuts(sim: &SimStorage, records: u64, what: &str, check: impl Fn(&Volume, &str)) {
    for (keep, name) in [(0u64, "none"), (1, "all"), (2, "every other one")] {
        let image = sim.crash_image(|_, index, _| match keep {
            0 => 0,
            1 => u64::MAX,
            _ if index % 2 == 0 => u64::MAX,
            _ => 0,
        });
        let again =
            Volume::open(Arc::new(image), &OpenOptions::default()).expect("open after a power cut");
        let what = format!("{what}, a power cut, unsynced writes kept: {name}");
        assert_eq!(again.recovery_report().records_replayed, records, "{what}");
        check(&again, &what);
        again.close().expect("close");
    }
}

/// Every LBA of `lbas` reads `pattern(lba, tag)`.
fn expect_patterns(volume: &Volume, lbas: std::ops::Range<u64>, tag: u8, what: &str) {
    for lba in lbas {
        assert_eq!(
            read_range(volume, lba, 1),
            pattern(lba, tag),
            "{what}: LBA {lba}"
        );
    }
}
/// A packed replay writes the records of a row that lie side by side in
/// one write (two whole rows: 2 writes, not 62), in data-file order, and
/// leaves their fsync to the next checkpoint: the journal keeps the
/// records until then (before: one write per block and an fsync of the
/// data at the open, 65 writes and 1 sync here). A power cut after such
/// an open, with any of the unsynced writes lost, replays them again.
#[test]
fn a_packed_recovery_writes_a_rows_adjacent_records_at_once_and_syncs_them_at_the_checkpoint() {
    let scattered = [100u64, 500, 1000];
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = LayoutKind::Packed;
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create");
    let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).expect("open");
    // Rows 0 and 1 whole (LBAs 0-61), backwards in three records, then the
    // scattered blocks, then LBA 5 again: 65 blocks in 5 records.
    for range in [40..62u64, 20..40, 0..20] {
        let data: Vec<u8> = range.clone().flat_map(|lba| pattern(lba, 2)).collect();
        volume
            .write(range.start * BLOCK, &data, false)
            .expect("write");
        volume.flush().expect("flush: one record");
    }
    for lba in scattered {
        volume
            .write(lba * BLOCK, &pattern(lba, 2), false)
            .expect("write");
    }
    volume.flush().expect("flush");
    volume
        .write(5 * BLOCK, &pattern(5, 3), false)
        .expect("write");
    volume.flush().expect("flush");
    // A crash of the process: the storage keeps every write.
    drop(volume);

    let counting = Counting::new(&sim);
    let volume = Volume::open(counting.clone(), &OpenOptions::default()).expect("reopen");
    assert_eq!(volume.recovery_report().records_replayed, 5);
    let writes = counting.data_writes.load(Ordering::Relaxed);
    let syncs = counting.data_syncs_after_a_write.load(Ordering::Relaxed);
    assert_eq!(
        (writes, syncs),
        (2 + scattered.len() as u64, 0),
        "writes of the data files, and their syncs, at the recovering open"
    );
    // Blocks 0-61 and the scattered ones; with `later`, LBAs 5 and 70 as
    // the writes after the recovering open left them.
    let expect = |volume: &Volume, later: bool, what: &str| {
        let lbas: Vec<u64> = (0..62)
            .chain(scattered)
            .chain(later.then_some(70))
            .collect();
        for lba in lbas {
            let tag = match lba {
                5 | 70 if later => 4,
                5 => 3,
                _ => 2,
            };
            assert_eq!(
                read_range(volume, lba, 1),
                pattern(lba, tag),
                "{what}: LBA {lba}"
            );
        }
    };
    expect(&volume, false, "after the recovering open");
    let images = |what: &str, records: u64, later: bool| {
        // A power cut now: the redone writes (and any since), unsynced,
        // are lost in part or in whole; the journal still holds their
        // records, and the new ones after them.
        after_power_cuts(&sim, records, what, |again, what| {
            expect(again, later, what)
        });
    };
    images("after the recovering open", 5, false);
    // New records go after the replayed ones: a block of both written
    // again, and a new one; a cut then replays old and new in order.
    for lba in [5u64, 70] {
        volume
            .write(lba * BLOCK, &pattern(lba, 4), false)
            .expect("write after the open");
    }
    volume.flush().expect("flush after the open");
    expect(&volume, true, "after writes behind the replayed records");
    images("after writes behind the replayed records", 6, true);
    // The checkpoint at the close syncs them, and the map binds the rows.
    volume.close().expect("close");
    let syncs = counting.data_syncs_after_a_write.load(Ordering::Relaxed);
    assert!(syncs > 0, "the checkpoint syncs the redone data");
    let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).expect("open");
    assert_eq!(volume.recovery_report().records_replayed, 0);
    expect(&volume, true, "after the close");
    volume.close().expect("close");
}

/// A split replay writes the blocks of redo records home again (a
/// flush's small commit: its data is in the journal) and, as packed does
/// its records, leaves their fsync to the next checkpoint, or to the next
/// commit that is not redo: the journal keeps the records until then
/// (before: an fsync of the data at the open, 1 here). A power cut after
/// such an open, with any of the unsynced writes lost, redoes them again;
/// one after new writes behind them too: redo ones (left unsynced as
/// well), then a plain commit, which syncs the redone blocks before its
/// record may overwrite them.
#[test]
fn a_split_recovery_leaves_redone_blocks_to_the_checkpoints_sync() {
    let sim = SimStorage::new();
    Volume::create(Arc::new(sim.clone()), &CreateOptions::new(BLOCKS * BLOCK))
        .and_then(Volume::close)
        .expect("create");
    let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::foreground()).expect("open");
    // Four redo records: LBAs 0-11 in three, then LBA 5 again and 100.
    for range in [8..12u64, 4..8, 0..4] {
        let data: Vec<u8> = range.clone().flat_map(|lba| pattern(lba, 2)).collect();
        volume
            .write(range.start * BLOCK, &data, false)
            .expect("write");
        volume.flush().expect("flush: a redo record");
    }
    for (lba, tag) in [(5u64, 3u8), (100, 2)] {
        volume
            .write(lba * BLOCK, &pattern(lba, tag), false)
            .expect("write");
    }
    volume.flush().expect("flush: a redo record");
    // A crash of the process: the storage keeps every write.
    drop(volume);

    let counting = Counting::new(&sim);
    // Commits at flushes only: each flush below is one record.
    let mut options = OpenOptions::foreground();
    options.tuning.prompt_commits = false;
    let volume = Volume::open(counting.clone(), &options).expect("reopen");
    assert_eq!(volume.recovery_report().records_replayed, 4);
    let writes = counting.data_writes.load(Ordering::Relaxed);
    let syncs = counting.data_syncs_after_a_write.load(Ordering::Relaxed);
    assert_eq!(
        (writes, syncs),
        (2, 0),
        "writes of the data file (LBAs 0-11 and 100), and its syncs, at the recovering open"
    );
    // What each LBA reads: 0-11 and 100 as redone, LBA 5 its last write;
    // after the writes behind the replayed records, LBAs 5, 6 and 70 (redo)
    // and 200-279 (a plain commit, LBA 6 again in it) as those left them.
    let expect = |volume: &Volume, later: u8, what: &str| {
        let lbas: Vec<u64> = (0..12)
            .chain([100])
            .chain((later > 0).then_some(70))
            .chain((200..280).filter(|_| later > 1))
            .collect();
        for lba in lbas {
            let tag = match lba {
                70 => 4,
                5 | 6 if later > 0 => 4,
                200..280 => 5,
                5 => 3,
                _ => 2,
            };
            let tag = if lba == 6 && later > 1 { 5 } else { tag };
            assert_eq!(
                read_range(volume, lba, 1),
                pattern(lba, tag),
                "{what}: LBA {lba}"
            );
        }
    };
    expect(&volume, 0, "after the recovering open");
    let images = |what: &str, records: u64, later: u8| {
        // A power cut now: the unsynced writes (the redone ones, and any
        // since) are lost in part or in whole; the journal still holds
        // their records, and the new ones after them.
        after_power_cuts(&sim, records, what, |again, what| {
            expect(again, later, what)
        });
    };
    images("after the recovering open", 4, 0);
    // Redo records behind the replayed ones: a block of both written
    // again, a neighbour, and a new one; left unsynced too.
    for lba in [5u64, 6, 70] {
        volume
            .write(lba * BLOCK, &pattern(lba, 4), false)
            .expect("write after the open");
    }
    volume.flush().expect("flush after the open: a redo record");
    assert_eq!(
        counting.data_syncs_after_a_write.load(Ordering::Relaxed),
        0,
        "a redo commit leaves the redone blocks unsynced"
    );
    expect(&volume, 1, "after redo writes behind the replayed records");
    images("after redo writes behind the replayed records", 5, 1);
    // A plain commit (more than a redo record takes) that overwrites a
    // redone block: the redone blocks are synced before its record.
    let data: Vec<u8> = (200..280u64).flat_map(|lba| pattern(lba, 5)).collect();
    volume.write(200 * BLOCK, &data, false).expect("write");
    volume
        .write(6 * BLOCK, &pattern(6, 5), false)
        .expect("write");
    volume.flush().expect("flush: a plain commit");
    assert!(
        counting.data_syncs_after_a_write.load(Ordering::Relaxed) > 0,
        "a plain commit syncs the redone blocks before its record"
    );
    expect(
        &volume,
        2,
        "after a plain commit behind the replayed records",
    );
    images("after a plain commit behind the replayed records", 6, 2);
    volume.close().expect("close");
    let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).expect("open");
    assert_eq!(volume.recovery_report().records_replayed, 0);
    expect(&volume, 2, "after the close");
    volume.close().expect("close");
}

/// A crash that leaves both a redo record's blocks to redo and a plain
/// commit's blocks whose home writes a power cut took: the open redoes
/// the first, reverts the second to the contexts they had, fsyncs the
/// data (the redone blocks with it) and journals the reverted contexts
/// after the replayed records. A power cut after that open (each unsynced
/// write kept or lost: none, all, every other one) reads the same.
/// `drop(volume)` is the `kill -9`: the engine's memory is gone, the
/// storage keeps what it was given.
#[test]
fn a_split_recovery_with_reverted_and_redone_blocks_survives_a_power_cut() {
    const PLAIN: std::ops::Range<u64> = 100..116;
    let sim = SimStorage::new();
    let volume =
        Volume::create(Arc::new(sim.clone()), &CreateOptions::new(BLOCKS * BLOCK)).expect("create");
    for lba in PLAIN {
        volume
            .write(lba * BLOCK, &pattern(lba, 1), false)
            .expect("write");
    }
    // Their contexts in the table (a close checkpoints).
    volume.close().expect("close");
    let mut options = OpenOptions::foreground();
    options.tuning.dirty_limit_blocks = PLAIN.count();
    options.tuning.prompt_commits = false;
    let volume = Volume::open(Arc::new(sim.clone()), &options).expect("open");
    for lba in 0..4u64 {
        volume
            .write(lba * BLOCK, &pattern(lba, 2), false)
            .expect("write");
    }
    volume.flush().expect("flush: a redo record");
    for lba in PLAIN {
        volume
            .write(lba * BLOCK, &pattern(lba, 2), false)
            .expect("write: one plain commit at the dirty limit");
    }
    drop(volume);
    // A power cut: the plain commit's home writes lost (the redo record's
    // were synced before the plain record was written).
    let image = sim.crash_image(|object, _, _| {
        if matches!(object, ObjectId::Data(_)) {
            0
        } else {
            u64::MAX
        }
    });
    let counting = Counting::new(&image);
    let volume = Volume::open(counting.clone(), &OpenOptions::foreground()).expect("reopen");
    let report = volume.recovery_report();
    assert_eq!(report.records_replayed, 2);
    assert_eq!(
        (report.blocks_verified, report.blocks_reverted),
        (PLAIN.count() as u64, PLAIN.count() as u64)
    );
    assert_eq!(
        counting.data_syncs_after_a_write.load(Ordering::Relaxed),
        1,
        "the reverted blocks' fsync of the data, the redone ones with it"
    );
    let expect = |volume: &Volume, what: &str| {
        expect_patterns(volume, 0..4, 2, what);
        expect_patterns(volume, PLAIN, 1, what);
    };
    expect(&volume, "after the recovering open");
    after_power_cuts(
        &image,
        3,
        "a power cut after the open (the replayed records and the resolutions' one)",
        expect,
    );
    volume.close().expect("close");
}
