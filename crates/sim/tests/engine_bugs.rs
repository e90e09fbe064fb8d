//! Engine bugs found by the simulator and fuzz bodies, as the smallest
//! failing cases. Each was a panic or a contract violation before its fix.

use std::sync::Arc;

use vouch_engine::read_superblock;
use vouch_engine::{BlockDevice, DeviceWrites};
use vouch_engine::{CreateOptions, LayoutKind, ObjectId, OpenOptions, SimStorage, Volume};
use vouch_format::journal::encode_record;
use vouch_format::{Context, JournalEntry};

fn closed_volume(layout: LayoutKind) -> SimStorage {
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(32 * 4096);
    options.layout = layout;
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(if layout == LayoutKind::Packed { 31 } else { 16 });
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create");
    sim
}

/// Found by `fuzz::journal` (tests/fuzz_bodies.rs, journal_inputs, seed 3):
/// a journal record with valid checksums whose entry names an LBA past the
/// end of the volume made recovery panic in `Geometry::locate` ("LBA 2052
/// past the volume's 32 blocks") instead of refusing to open with a clear
/// error (contract 3).
#[test]
fn journal_entry_past_the_end_is_a_clear_error() {
    for layout in LayoutKind::ALL {
        for (lba, count, context) in [
            (
                2052,
                1,
                Context::Data {
                    volume_tag: 1,
                    ref_tag: 2052,
                    guard: 0,
                    generation: 1,
                },
            ),
            (30, 9, Context::Unwritten),
            (u64::MAX - 1, 4, Context::Unwritten),
        ] {
            let sim = closed_volume(layout);
            let sb = read_superblock(&sim).expect("superblock");
            let entries = [JournalEntry {
                lba,
                count,
                context,
            }];
            let block = [7u8; 4096];
            let blocks: Vec<&[u8]> = vec![&block[..]];
            let data = (layout == LayoutKind::Packed && count == 1).then_some(&blocks[..]);
            let record = encode_record(
                sb.checkpoint_seq + 1,
                sb.uuid,
                sb.checkpoint_seq,
                &entries,
                data,
            );
            sim.overwrite(ObjectId::Journal, 0, &record);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).map(|_| ())
            }));
            let result = result
                .unwrap_or_else(|_| panic!("{layout:?}: recovery panicked on entry {lba}+{count}"));
            let error = result.expect_err("a record past the end must not open");
            assert!(error.to_string().contains("journal"), "{error}");
        }
    }
}

/// Same family: a packed volume replaying a record whose data entries have
/// no data blocks (a record written without FLAG_HAS_DATA) panicked in
/// `record_data`.
#[test]
fn packed_record_without_data_is_a_clear_error() {
    let sim = closed_volume(LayoutKind::Packed);
    let sb = read_superblock(&sim).expect("superblock");
    let entries = [JournalEntry {
        lba: 3,
        count: 1,
        context: Context::Data {
            volume_tag: sb.volume_tag(),
            ref_tag: 3,
            guard: 0,
            generation: 1,
        },
    }];
    let record = encode_record(
        sb.checkpoint_seq + 1,
        sb.uuid,
        sb.checkpoint_seq,
        &entries,
        None,
    );
    sim.overwrite(ObjectId::Journal, 0, &record);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).map(|_| ())
    }))
    .expect("recovery must not panic");
    assert!(result.is_err());
}

/// Found by `serve_crash.rs` (packed, 1 MiB journal, SIGKILL): a commit too
/// large for one journal record was split into several records, and when
/// the journal filled between two of them, the checkpoint that made room
/// retired the earlier records before their blocks had been written home.
/// A crash in those home writes left a record torn (new data, old context)
/// with nothing to replay: a block unreadable by a crash alone.
#[test]
fn a_checkpoint_never_retires_a_record_whose_blocks_are_not_home() {
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(1024 * 4096);
    options.layout = LayoutKind::Packed;
    options.journal_bytes = Some(1 << 20);
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create");
    let tuning = vouch_engine::Tuning {
        dirty_limit_blocks: 200,
        background_commit: false,
        ..vouch_engine::Tuning::default()
    };
    let open = OpenOptions {
        tuning,
        ..OpenOptions::default()
    };
    let volume = Volume::open(Arc::new(sim.clone()), &open).expect("open");
    // 100 blocks flushed: their record fills ~40% of the journal.
    for lba in 0..100u64 {
        volume
            .write(lba * 4096, &[1u8; 4096], false)
            .expect("write");
    }
    volume.flush().expect("flush");
    // 200 blocks fill the buffer and commit inline, unsynced: one commit
    // whose data needs ~80% of the journal, more than one record holds.
    for lba in 300..500u64 {
        volume
            .write(lba * 4096, &[2u8; 4096], false)
            .expect("write");
    }
    assert!(sim.pending_count() > 0, "the second commit is not synced");
    // Power loss: every unsynced data write torn after its first sector.
    let image = sim.crash_image(|object, _, _| match object {
        ObjectId::Data(_) => 0b1,
        _ => u64::MAX,
    });
    drop(volume);
    let volume = Volume::open(Arc::new(image), &OpenOptions::default()).expect("recover");
    let report = volume.check(|_, _| {}).expect("check");
    assert!(
        report.faults.is_empty(),
        "blocks left unreadable by a crash: {:?}",
        report.faults
    );
    let mut block = [0u8; 4096];
    for lba in 300..500u64 {
        volume.read(lba * 4096, &mut block).expect("read");
        assert!(
            block == [2u8; 4096] || block == [0u8; 4096],
            "LBA {lba} reads neither its old nor its new contents"
        );
    }
}

/// Found by `vouch-sim crash` once its commits ran stepped (split, seed
/// 112): a process crash between a checkpoint's superblock write and its
/// fsync left the new superblock in the kernel only. Recovery trusted it
/// (its journal starts at offset 0 again) and wrote new records from 0,
/// but never synced the superblock itself: a power cut after that
/// recovery brought back the older superblock, whose journal those
/// records had overwritten, and the writes flushed since were lost (the
/// simulator read a context over data it did not seal: guard_mismatch).
#[test]
fn a_superblock_a_process_crash_left_unsynced_is_made_durable_by_recovery() {
    let sim = closed_volume(LayoutKind::Split);
    let recorder = Arc::new(vouch_sim::recorder::Recorder::new(sim));
    let mut open = vouch_sim::foreground_options();
    // Every commit of more than one block checkpoints.
    open.tuning.overlay_limit = 1;
    let volume =
        Volume::open(recorder.clone() as Arc<dyn vouch_engine::Storage>, &open).expect("open");
    // The process dies right after the checkpoint's superblock write:
    // the kernel keeps it, unsynced.
    let crashed: Arc<parking_lot::Mutex<Option<SimStorage>>> = Arc::default();
    let taken = crashed.clone();
    recorder.set_hook(Some(Box::new(move |sim, order| {
        let mut taken = taken.lock();
        if taken.is_none() && order.last() == Some(&ObjectId::Superblock) {
            *taken = Some(sim.duplicate());
        }
    })));
    volume.write(0, &[1u8; 2 * 4096], false).expect("write");
    volume.flush().expect("flush");
    recorder.set_hook(None);
    drop(volume);
    let image = crashed
        .lock()
        .take()
        .expect("the flush's checkpoint wrote the superblock");
    // The restart after the process crash recovers, takes a write and
    // flushes it: the write is durable from here on.
    let restarted = Volume::open(Arc::new(image.clone()), &open).expect("recover");
    restarted.write(4096, &[2u8; 4096], false).expect("write");
    restarted.flush().expect("flush");
    // A power cut now keeps only what was synced.
    let cut = image.crash_image(|_, _, _| 0);
    drop(restarted);
    let volume = Volume::open(Arc::new(cut), &OpenOptions::default()).expect("recover");
    let mut block = [0u8; 4096];
    volume
        .read(4096, &mut block)
        .expect("the flushed block reads");
    assert!(
        block == [2u8; 4096],
        "the write flushed after recovery was lost"
    );
    volume.read(0, &mut block).expect("the first write reads");
    assert!(
        block == [1u8; 4096],
        "the write flushed before the crash was lost"
    );
}
