//! A full filesystem and failing I/O: a clear error, fail-stop, and nothing
//! acknowledged lost.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use vouch_engine::BlockDevice;
use vouch_engine::{
    create_volume, open_volume, CreateOptions, Error, FaultPlan, LayoutKind, OpenOptions,
    SimStorage, Storage, Volume,
};

/// A small tmpfs, unmounted on drop. Needs root (CI runs as root).
struct SmallFs {
    dir: tempfile::TempDir,
}

impl SmallFs {
    fn mount(megabytes: u64) -> SmallFs {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}M"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mounting a tmpfs needs root (run the suite as root, as CI does)"
        );
        SmallFs { dir }
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed ^ (i % 251) as u8 ^ 0x33).collect()
}

#[test]
fn full_filesystem_gives_no_space_and_loses_nothing_acknowledged() {
    let fs = SmallFs::mount(24);
    let path = fs.path().join("vol");
    let mut options = CreateOptions::new(1 << 30);
    options.journal_bytes = Some(1 << 20);
    let volume = create_volume(&path, &options).expect("create");
    let flushed = pattern(1, 2 << 20);
    volume.write(0, &flushed, false).expect("write");
    volume.flush().expect("flush");
    // Fill the filesystem.
    let filler = fs.path().join("filler");
    let chunk = vec![0xFFu8; 1 << 20];
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&filler).expect("filler");
        while file.write_all(&chunk).is_ok() {}
    }
    let unflushed = pattern(2, 8 << 20);
    let outcome = volume
        .write(64 << 20, &unflushed, false)
        .and_then(|()| volume.flush());
    // The write or flush that needed the space is told so; when the
    // background committer (woken by the write) met the full disk first,
    // the flush is refused as stopped by it, still as a full disk.
    match outcome {
        Err(Error::NoSpace { .. }) => {}
        Err(Error::StoppedFull(why)) => assert!(why.contains("no space"), "{why}"),
        other => panic!("expected NoSpace, got {other:?}"),
    }
    // Fail-stop: writes are refused until reopened, as a full disk (ENOSPC
    // to an NBD client), with a clear reason.
    match volume.write(0, &[7u8; 4096], false) {
        Err(error @ Error::StoppedFull(_)) => {
            assert!(error.is_no_space());
            let message = error.to_string();
            assert!(message.contains("no space"), "{message}");
            assert!(message.contains("reopen"), "{message}");
        }
        other => panic!("expected StoppedFull, got {other:?}"),
    }
    // What was acknowledged still reads back.
    let mut buf = vec![0u8; flushed.len()];
    volume.read(0, &mut buf).expect("read flushed");
    assert!(buf == flushed);
    let mut buf = vec![0u8; unflushed.len()];
    volume.read(64 << 20, &mut buf).expect("read acknowledged");
    assert!(buf == unflushed, "acknowledged writes must still read back");
    drop(volume);
    std::fs::remove_file(&filler).expect("free space");
    let volume = open_volume(&path, &OpenOptions::default()).expect("reopen");
    let mut buf = vec![0u8; flushed.len()];
    volume.read(0, &mut buf).expect("read after reopen");
    assert!(buf == flushed, "flushed data must survive");
    // Unflushed blocks read old (zero) or new contents in full, never garbage.
    let mut buf = vec![0u8; unflushed.len()];
    volume
        .read(64 << 20, &mut buf)
        .expect("unflushed blocks are readable");
    for (index, block) in buf.chunks(4096).enumerate() {
        let new = &unflushed[index * 4096..(index + 1) * 4096];
        assert!(
            block == new || block.iter().all(|b| *b == 0),
            "block {index} is neither old nor new"
        );
    }
    assert!(volume.check(|_, _| {}).expect("check").faults.is_empty());
}

#[test]
fn create_on_a_full_filesystem_fails_and_leaves_nothing() {
    let fs = SmallFs::mount(4);
    let path = fs.path().join("vol");
    let error = match create_volume(&path, &CreateOptions::new(1 << 30)) {
        Err(error) => error,
        Ok(_) => panic!("a 128 MiB journal cannot fit in 4 MiB"),
    };
    assert!(
        error.to_string().contains("No space left") || error.to_string().contains("no space"),
        "{error}"
    );
    assert!(!path.exists(), "failed create must clean up");
}

fn sim_volume() -> (SimStorage, Volume) {
    let storage = SimStorage::new();
    let mut options = CreateOptions::new(1 << 20);
    options.journal_bytes = Some(1 << 20);
    let volume =
        Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options).expect("create");
    (storage, volume)
}

/// Clear the faults, reopen (recovering), and check that the volume
/// starts with `expected`.
fn reopen_and_expect(storage: &SimStorage, expected: &[u8]) -> Volume {
    storage.set_faults(FaultPlan::default());
    let reopened = Volume::open(
        Arc::new(storage.clone()) as Arc<dyn Storage>,
        &OpenOptions::default(),
    )
    .expect("reopen");
    let mut buf = vec![0u8; expected.len()];
    reopened.read(0, &mut buf).expect("read");
    assert!(buf == expected, "the volume after reopen differs");
    reopened
}

/// A payload received into the landing area is named by its held-log
/// record, not copied into it; its region must not be handed out again
/// while that record is live, even once every block of it was rewritten
/// (the buffer no longer refers to it): a crash replays the record and
/// verifies each of its blocks, which must still be what it names.
#[test]
fn a_landed_region_is_not_reused_while_its_record_is_live() {
    let storage = SimStorage::new();
    let mut options = CreateOptions::new(64 << 20);
    options.journal_bytes = Some(1 << 20);
    let volume =
        Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options).expect("create");
    let landed = |offset: u64, data: &[u8]| -> bool {
        let Some(mut buffer) = volume.landing_buffer(data.len()) else {
            volume.write(offset, data, false).expect("write");
            return false;
        };
        buffer.as_mut_slice().copy_from_slice(data);
        volume
            .write_bytes(offset, &buffer.freeze(), false)
            .expect("landed write");
        true
    };
    assert!(
        landed(0, &pattern(1, 64 << 10)),
        "the sim storage has a landing area"
    );
    // Every block of it rewritten, from memory of its own.
    volume
        .write(0, &pattern(2, 64 << 10), false)
        .expect("rewrite");
    // A payload as large as the simulated area (4 MiB) takes every region
    // that is free: the first write's must not be.
    let large = pattern(3, 4 << 20);
    landed(4 << 20, &large);
    drop(volume);
    let reopened = reopen_and_expect(&storage, &pattern(2, 64 << 10));
    let mut buf = vec![0u8; large.len()];
    reopened.read(4 << 20, &mut buf).expect("read");
    assert!(buf == large, "the large write was lost");
}

#[test]
fn failed_fsync_fails_stop_and_reopen_recovers() {
    let (storage, volume) = sim_volume();
    volume.write(0, &pattern(3, 8192), false).expect("write");
    volume.flush().expect("flush");
    storage.set_faults(FaultPlan {
        fail_sync: true,
        ..FaultPlan::default()
    });
    volume
        .write(8192, &pattern(4, 4096), false)
        .expect("buffered write");
    assert!(matches!(volume.flush(), Err(Error::Io { .. })));
    assert!(matches!(
        volume.write(0, &[0u8; 4096], false),
        Err(Error::FailStopped(_))
    ));
    assert!(
        matches!(volume.flush(), Err(Error::FailStopped(_))),
        "a failed fsync is never retried as success"
    );
    drop(volume);
    let reopened = reopen_and_expect(&storage, &pattern(3, 8192));
    reopened
        .write(0, &[9u8; 4096], true)
        .expect("writable again after reopen");
}

#[test]
fn failed_write_fails_stop() {
    let (storage, volume) = sim_volume();
    volume.write(0, &pattern(5, 4096), false).expect("buffered");
    // The commit's first write fails (the held log's came before).
    let (writes, _) = storage.counts();
    storage.set_faults(FaultPlan {
        fail_write_after: Some(writes),
        ..FaultPlan::default()
    });
    assert!(matches!(volume.flush(), Err(Error::Io { .. })));
    assert!(matches!(
        volume.write(4096, &[1u8; 4096], false),
        Err(Error::FailStopped(_))
    ));
    let mut buf = vec![0u8; 4096];
    volume
        .read(0, &mut buf)
        .expect("acknowledged data still readable");
    assert!(buf == pattern(5, 4096));
}

/// The held log (memory that outlives the process) cannot take a write:
/// the write fails before it is acknowledged, naming the held log; the
/// volume fail-stops like after any failed write, what was acknowledged
/// stays readable, and a reopen is writable again.
#[test]
fn a_write_the_held_log_cannot_take_is_refused_and_changes_nothing() {
    let (storage, volume) = sim_volume();
    volume
        .write(0, &pattern(3, 4096), true)
        .expect("durable write");
    volume
        .write(4096, &pattern(5, 4096), false)
        .expect("acknowledged, not flushed");
    let (writes, _) = storage.counts();
    storage.set_faults(FaultPlan {
        fail_write_after: Some(writes),
        ..FaultPlan::default()
    });
    let refused = volume
        .write(0, &pattern(4, 4096), false)
        .expect_err("the held log failed its write");
    assert!(
        refused.to_string().contains("held log"),
        "the error names the held log: {refused}"
    );
    assert!(matches!(
        volume.write(8192, &[1u8; 4096], false),
        Err(Error::FailStopped(_))
    ));
    let mut buf = vec![0u8; 4096];
    volume.read(0, &mut buf).expect("read");
    assert!(buf == pattern(3, 4096), "a refused write changed the block");
    volume.read(4096, &mut buf).expect("read");
    assert!(
        buf == pattern(5, 4096),
        "an acknowledged write is still read"
    );
    // A crash now (the process gone, the held log kept): both survive.
    drop(volume);
    let reopened = reopen_and_expect(&storage, &pattern(3, 4096));
    reopened.read(4096, &mut buf).expect("read");
    assert!(buf == pattern(5, 4096), "the acknowledged write was lost");
    reopened
        .write(8192, &[1u8; 4096], true)
        .expect("writable after reopen");
}

/// A record of up to 8 blocks keeps its entries and its parts on the
/// writer's stack, a larger one on the heap (`held.rs`, `INLINE_BLOCKS`).
/// Records either side of that limit, acknowledged and never committed,
/// then the process gone (the held log kept, the write-back buffer lost):
/// the reopen puts every block back from the held log, each with its own
/// bytes at its own LBA.
#[test]
fn records_either_side_of_the_on_stack_limit_come_back_from_the_held_log() {
    for layout in LayoutKind::ALL {
        let storage = SimStorage::new();
        let mut options = CreateOptions::new(1 << 20);
        options.layout = layout;
        options.journal_bytes = Some(1 << 20);
        let volume = Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options)
            .expect("create");
        // Far below the dirty limit: nothing is committed before the crash.
        let mut written = Vec::new();
        let mut lba = 0u64;
        for (seed, count) in [(11u8, 1usize), (12, 7), (13, 8), (14, 9), (15, 17)] {
            let data = pattern(seed, count * 4096);
            volume
                .write(lba * 4096, &data, false)
                .expect("acknowledged, not flushed");
            written.push((lba, data));
            lba += count as u64 + 1;
        }
        // The process dies: the kernel's copy of every object is what the
        // next open finds (the held slots included).
        let crashed = storage.duplicate();
        drop(volume);
        let reopened = Volume::open(
            Arc::new(crashed) as Arc<dyn Storage>,
            &OpenOptions::default(),
        )
        .expect("reopen");
        assert_eq!(
            reopened.recovery_report().held_blocks,
            1 + 7 + 8 + 9 + 17,
            "{layout:?}: every acknowledged block is put back from the held log"
        );
        for (first, data) in &written {
            let mut buf = vec![0u8; data.len()];
            reopened.read(first * 4096, &mut buf).expect("read");
            assert!(
                buf == *data,
                "{layout:?}: the {} blocks at LBA {first} differ after the held log's recovery",
                data.len() / 4096
            );
        }
    }
}

#[test]
fn unreadable_context_page_is_a_fault_naming_the_lba() {
    let (storage, volume) = sim_volume();
    volume
        .write(0, &pattern(6, 3 * 4096), false)
        .expect("write");
    volume.close().expect("close: contexts go home");
    let volume = Volume::open(
        Arc::new(storage.clone()) as Arc<dyn Storage>,
        &OpenOptions::default(),
    )
    .expect("open");
    storage.set_faults(FaultPlan {
        read_error: Some((vouch_engine::ObjectId::Contexts, 0, 4096)),
        ..FaultPlan::default()
    });
    let mut buf = vec![0u8; 4096];
    match volume.read(4096, &mut buf) {
        Err(Error::Fault(fault)) => {
            assert_eq!(fault.lba, 1);
            assert_eq!(fault.kind, vouch_engine::FaultKind::Unreadable);
        }
        other => panic!("expected an unreadable fault naming LBA 1, got {other:?}"),
    }
}

#[test]
fn block_unreadable_during_recovery_is_reported_not_reverted() {
    let storage = SimStorage::new();
    let mut options = CreateOptions::new(1 << 20);
    options.journal_bytes = Some(1 << 20);
    Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options)
        .expect("create")
        .close()
        .expect("close");
    // Inline commits: the write must be journaled before `drop`.
    let tuning = vouch_engine::Tuning {
        dirty_limit_blocks: 1,
        background_commit: false,
        ..vouch_engine::Tuning::default()
    };
    let volume = Volume::open(
        Arc::new(storage.clone()) as Arc<dyn Storage>,
        &OpenOptions {
            read_only: false,
            direct: false,
            tuning,
            ..OpenOptions::default()
        },
    )
    .expect("open");
    // Committed (journaled) but never flushed: recovery must verify it.
    volume
        .write(3 * 4096, &pattern(7, 4096), false)
        .expect("write");
    drop(volume);
    storage.set_faults(FaultPlan {
        read_error: Some((vouch_engine::ObjectId::Data(0), 3 * 4096, 4096)),
        ..FaultPlan::default()
    });
    let volume = Volume::open(
        Arc::new(storage.clone()) as Arc<dyn Storage>,
        &OpenOptions::default(),
    )
    .expect("open");
    assert_eq!(volume.recovery_report().blocks_unreadable, vec![3]);
    let mut buf = vec![0u8; 4096];
    match volume.read(3 * 4096, &mut buf) {
        Err(Error::Fault(fault)) => assert_eq!(fault.lba, 3),
        other => panic!("an unreadable block must read as a fault, not as zeros: {other:?}"),
    }
}

#[test]
fn failed_home_write_names_the_failing_run_not_the_batch() {
    let (storage, volume) = sim_volume();
    for lba in [1u64, 5, 9] {
        volume
            .write(lba * 4096, &pattern(lba as u8, 4096), false)
            .expect("buffered");
    }
    // One commit: the journal record, then three runs (LBAs 1, 5, 9) in
    // order. Let the journal and the first run succeed; fail the second.
    let (writes, _) = storage.counts();
    storage.set_faults(FaultPlan {
        fail_write_after: Some(writes + 2),
        ..FaultPlan::default()
    });
    let expected = volume.geometry().locate(5).data_offset;
    match volume.flush() {
        Err(Error::Io { op, offset, .. }) => {
            assert_eq!(op, "write");
            assert_eq!(offset, expected, "the error names LBA 5's run");
        }
        other => panic!("expected a write error, got {other:?}"),
    }
    assert!(matches!(
        volume.write(0, &[1u8; 4096], false),
        Err(Error::FailStopped(_))
    ));
    let mut buf = vec![0u8; 4096];
    volume.read(5 * 4096, &mut buf).expect("still readable");
    assert!(buf == pattern(5, 4096), "acknowledged data still served");
}

/// A small flush is answered when its redo record is durable (ORDER
/// POINT A), before the blocks' home writes: a home write that then fails
/// fail-stops the volume, yet what the flush answered survives a reopen
/// (recovery redoes the record from the journal).
#[test]
fn a_flush_answered_at_its_record_survives_a_failed_home_write() {
    let (storage, volume) = sim_volume();
    volume.write(0, &pattern(6, 8192), false).expect("buffered");
    let (writes, _) = storage.counts();
    // The journal record is written; the home write after it fails.
    storage.set_faults(FaultPlan {
        fail_write_after: Some(writes + 1),
        ..FaultPlan::default()
    });
    let answered = Arc::new(std::sync::Mutex::new(None));
    let slot = Arc::clone(&answered);
    volume.flush_then(Box::new(move |flushed| {
        *slot.lock().expect("lock") = Some(flushed.map_err(|error| error.to_string()));
    }));
    assert_eq!(
        answered.lock().expect("lock").take(),
        Some(Ok(())),
        "the flush is answered at its record, before the failing home write"
    );
    assert!(
        matches!(volume.flush(), Err(Error::FailStopped(_))),
        "the failed home write fail-stopped the volume"
    );
    drop(volume);
    // The answered flush's blocks survive.
    reopen_and_expect(&storage, &pattern(6, 8192));
}
