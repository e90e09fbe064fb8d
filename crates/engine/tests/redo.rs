//! Redo records (CRASH_MODEL.md, order point B): a small flush journals a
//! copy of its blocks, so it costs one fsync (the journal's), and its home
//! writes may be lost by a crash without losing the flushed data.

use std::sync::Arc;
use vouch_engine::DeviceWrites;

use vouch_engine::{
    BlockDevice, CreateOptions, LayoutKind, ObjectId, OpenOptions, SimStorage, Volume,
};

fn sim_volume(layout: LayoutKind) -> (SimStorage, Volume) {
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(512 * 4096);
    options.layout = layout;
    options.journal_bytes = Some(4 << 20);
    Volume::create(Arc::new(sim.clone()), &options)
        .and_then(Volume::close)
        .expect("create");
    let volume = Volume::open(Arc::new(sim.clone()), &OpenOptions::default()).expect("open");
    (sim, volume)
}

fn block(fill: u8) -> Vec<u8> {
    vec![fill; 4096]
}

/// Everything not synced is lost: the image a power cut leaves.
fn power_cut(sim: &SimStorage) -> SimStorage {
    sim.crash_image(|_, _, _| 0)
}

fn read_block(volume: &Volume, lba: u64) -> Vec<u8> {
    let mut buf = block(0);
    volume.read(lba * 4096, &mut buf).expect("read");
    buf
}

#[test]
fn a_small_flush_is_one_fsync_and_survives_losing_its_home_writes() {
    for layout in LayoutKind::ALL {
        let (sim, volume) = sim_volume(layout);
        for lba in [3u64, 4, 200] {
            volume
                .write(lba * 4096, &block(lba as u8), false)
                .expect("write");
        }
        let (_, syncs_before) = sim.counts();
        volume.flush().expect("flush");
        let (_, syncs_after) = sim.counts();
        assert_eq!(
            syncs_after - syncs_before,
            1,
            "{layout:?}: a 3-block flush must fsync the journal only"
        );
        let data_pending = sim
            .pending()
            .into_iter()
            .filter(|(object, ops)| matches!(object, ObjectId::Data(_)) && !ops.is_empty())
            .count();
        assert!(
            data_pending > 0,
            "{layout:?}: the home writes were left unsynced (else this test proves nothing)"
        );
        let image = power_cut(&sim);
        drop(volume);
        let volume = Volume::open(Arc::new(image), &OpenOptions::default()).expect("reopen");
        for lba in [3u64, 4, 200] {
            assert_eq!(
                read_block(&volume, lba),
                block(lba as u8),
                "{layout:?} LBA {lba}"
            );
        }
        assert_eq!(
            read_block(&volume, 5),
            block(0),
            "{layout:?}: untouched block"
        );
    }
}

/// A redo record's block overwritten by a large flush (a plain commit):
/// the redo block is made durable before the plain record, so whatever the
/// crash keeps, a flushed value is read back, and the last flush wins.
#[test]
fn a_plain_commit_after_a_redo_record_keeps_the_flushed_value() {
    let (sim, volume) = sim_volume(LayoutKind::Split);
    volume.write(3 * 4096, &block(0xa1), false).expect("write");
    volume.flush().expect("small flush: redo");
    // 100 blocks: over the redo limit, so a plain commit (home + fsync).
    let big: Vec<u8> = (0..100u64).flat_map(|i| block(0xb0 ^ i as u8)).collect();
    volume.write(0, &big, false).expect("large write");
    volume.flush().expect("large flush: plain");
    let image = power_cut(&sim);
    drop(volume);
    let volume = Volume::open(Arc::new(image), &OpenOptions::default()).expect("reopen");
    assert_eq!(read_block(&volume, 3), block(0xb0 ^ 3));
    assert_eq!(read_block(&volume, 99), block(0xb0 ^ 99));
}

/// A read-only open serves a redo record's blocks from memory.
#[test]
fn a_read_only_open_serves_redo_blocks_it_cannot_write_home() {
    let (sim, volume) = sim_volume(LayoutKind::Split);
    volume.write(7 * 4096, &block(0x77), false).expect("write");
    volume.flush().expect("flush");
    let image = power_cut(&sim);
    drop(volume);
    let options = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let volume = Volume::open(Arc::new(image), &options).expect("read-only open");
    assert_eq!(read_block(&volume, 7), block(0x77));
}

/// Past a redo flush's worth of blocks since the last flush, the
/// background committer commits as writes come (`Committer::prompt`)
/// instead of waiting for the dirty limit (4096 blocks): 100 single-block
/// writes answered inline (`try_write_shared`, the NBD reactor's route)
/// are committed, journaled and home, with no flush. Below that
/// (`a_small_flush_is_one_fsync...`) they wait for the flush's redo record.
#[test]
fn writes_past_a_redo_flush_are_committed_before_the_dirty_limit() {
    for layout in LayoutKind::ALL {
        let (_sim, volume) = sim_volume(layout);
        volume.flush().expect("flush");
        let commits = volume
            .stats()
            .commits
            .load(std::sync::atomic::Ordering::Relaxed);
        for lba in 0..100u64 {
            let data = bytes::Bytes::from(block(lba as u8 + 1));
            assert!(
                volume
                    .submit_write(
                        lba * 4096,
                        &data,
                        false,
                        vouch_engine::Admission::MustNotWait
                    )
                    .expect("write")
                    .is_done(),
                "{layout:?}: an inline write declined"
            );
        }
        // Only a deadline for failure: the commit is asynchronous.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while volume
            .stats()
            .commits
            .load(std::sync::atomic::Ordering::Relaxed)
            == commits
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{layout:?}: 100 blocks written since the flush, no commit"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for lba in 0..100u64 {
            assert_eq!(
                read_block(&volume, lba),
                block(lba as u8 + 1),
                "{layout:?} LBA {lba}"
            );
        }
    }
}

fn open_options(direct: bool) -> OpenOptions {
    OpenOptions {
        direct,
        ..OpenOptions::default()
    }
}

/// A split volume of 512 blocks in files (its directory, its path), open
/// (`direct`: `--direct`).
fn file_volume(direct: bool) -> (tempfile::TempDir, std::path::PathBuf, Volume) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("volume");
    let mut options = CreateOptions::new(512 * 4096);
    options.layout = LayoutKind::Split;
    options.journal_bytes = Some(4 << 20);
    vouch_engine::create_volume(&path, &options)
        .and_then(Volume::close)
        .expect("create");
    let volume = vouch_engine::open_volume(&path, &open_options(direct)).expect("open");
    (dir, path, volume)
}

/// Blocks `[0, end)` read as `block(1)` below `twos_from`, as `block(2)`
/// from it.
fn assert_ones_then_twos(volume: &Volume, twos_from: u64, end: u64, direct: bool) {
    for lba in 0..end {
        let fill = if lba < twos_from { 1 } else { 2 };
        assert_eq!(
            read_block(volume, lba),
            block(fill),
            "direct {direct}, LBA {lba}"
        );
    }
}

/// Write syscalls this thread has made (`/proc/thread-self/io`: `write`,
/// `pwrite64`, `pwritev` and the like; not `fdatasync`).
fn write_syscalls() -> u64 {
    let io = std::fs::read_to_string("/proc/thread-self/io").expect("/proc/thread-self/io");
    io.lines()
        .find_map(|line| line.strip_prefix("syscw: "))
        .and_then(|count| count.trim().parse().ok())
        .expect("a syscw line")
}

/// A small flush on files (the held log's slots in memory that outlives the
/// process, mapped) makes two write syscalls, both on the caller's thread:
/// its redo record and its home write (with `--direct` only the record:
/// home writes go through io_uring). Emptying the held log's slot after
/// the commit is a 16-byte store into the slot's mapped header page, not a
/// `pwrite` of the page (issue 29's `--direct` flush every 8 writes: one
/// `pwrite64` per flush more than before the held log, made under the
/// log's lock while the next writes waited for it), and a record that
/// crosses a 256 KiB boundary of the journal is one `pwrite64`, not two
/// (`PAGE_CACHE_PIECE`: 1 flush in 8 made a second). That the store is
/// kept by a crash of the process and leaves a valid header is what the
/// held-log restarts (`serve_held.rs`, `serve_crash.rs`) and the next test
/// read back. The split layout: the packed one also zeroes its rows ahead,
/// now and then. Counted on this thread (`/proc/thread-self/io`): a flush
/// commits on the thread that calls it (it takes the commit lock and
/// commits what is buffered, its slot's emptying included), and the
/// background committer, which counts on no thread of this test, is not
/// asked to commit by two blocks a flush (`Committer::prompt`: more than
/// `REDO_MAX_BLOCKS` since the last flush). Nothing else writes on this
/// thread in between (a logged warning would, and fail the count).
#[test]
fn a_small_flush_writes_its_record_and_its_home_and_nothing_for_the_held_log() {
    for direct in [false, true] {
        let (_dir, _path, volume) = file_volume(direct);
        let pair = |fill: u8| [block(fill), block(fill)].concat();
        // Both slots in use once (each grown, and each emptied by a
        // commit) before the measured flushes.
        for lba in (0..8u64).step_by(2) {
            volume.write(lba * 4096, &pair(1), false).expect("write");
            volume.flush().expect("flush");
        }
        // Records of 12 KiB: some cross a 256 KiB boundary of the journal
        // (too few to checkpoint).
        for lba in (8..200u64).step_by(2) {
            volume.write(lba * 4096, &pair(2), false).expect("write");
            let before = write_syscalls();
            volume.flush().expect("flush");
            let made = write_syscalls() - before;
            // `--direct` writes home through io_uring: no write syscall.
            let expected = if direct { 1 } else { 2 };
            assert_eq!(
                made, expected,
                "direct {direct}, LBA {lba}: a flush of two blocks made {made} write syscalls (its redo record, and its home write unless through io_uring)"
            );
        }
        assert_ones_then_twos(&volume, 8, 200, direct);
        volume.close().expect("close");
    }
}

/// A slot emptied by the 16-byte store (every emptying after the open's
/// first) is read back by the next open: after commits that emptied both
/// slots that way, writes acknowledged and never committed, then the
/// process's handle gone without a close (the held log's files stay, as
/// after a crash), the reopen accepts both slots' headers (a header that
/// failed its CRC would refuse the open as a damaged slot) and puts every
/// held block back.
#[test]
fn slots_emptied_by_the_store_are_read_back_after_a_crash() {
    for direct in [false, true] {
        let (_dir, path, volume) = file_volume(direct);
        for lba in 0..6u64 {
            volume.write(lba * 4096, &block(1), false).expect("write");
            volume.flush().expect("flush");
        }
        // Acknowledged, not committed (far below the dirty limit).
        for lba in 3..9u64 {
            volume.write(lba * 4096, &block(2), false).expect("write");
        }
        drop(volume);
        let reopened = vouch_engine::open_volume(&path, &open_options(direct))
            .unwrap_or_else(|error| panic!("direct {direct}: the reopen refused: {error}"));
        assert_eq!(
            reopened.recovery_report().held_blocks,
            6,
            "direct {direct}: every acknowledged, uncommitted block comes back from the held log"
        );
        assert_ones_then_twos(&reopened, 3, 9, direct);
        reopened.close().expect("close");
    }
}
