//! Online resync under a client write stream, over real volume
//! directories: writer threads write without pause, over the blocks the
//! map names and beyond, for the whole resync; the resync must still end
//! while they write (30 s is only a hang guard), and then both legs hold,
//! block for block, what each writer wrote last, and the map is gone.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vouch_engine::DeviceWrites;

use vouch_engine::{open_volume, BlockDevice, CreateOptions, OpenOptions, Volume, BLOCK};
use vouch_mirror as mirror;
use vouch_mirror::{create_mirror, open_mirror, Mirror, ResyncRate};

/// 32 MiB legs; leg 1 misses writes to the first 12 MiB.
const SIZE: u64 = 32 << 20;
const MISSED: u64 = 12 << 20;
/// Writers write over the first 16 MiB: in the map and beyond it.
const WRITTEN: u64 = 16 << 20;
const WRITERS: u64 = 2;

fn options() -> OpenOptions {
    OpenOptions::foreground()
}

fn open(
    path: &Path,
) -> (
    Arc<Mirror>,
    Vec<Option<Arc<Volume>>>,
    mirror::set::MirrorRecord,
) {
    let set = open_mirror(path, true, &mut |leg| open_volume(leg, &options())).expect("open set");
    let record = set.record.clone();
    let (mirror, volumes) = set.into_mirror(true).expect("mirror");
    mirror::set::track_stale_legs(&mirror, &record).expect("track stale legs");
    (mirror, volumes, record)
}

fn close(mirror: Arc<Mirror>, volumes: Vec<Option<Arc<Volume>>>) {
    mirror.stop_resyncs().expect("stop resyncs");
    drop(mirror);
    for volume in volumes.into_iter().flatten() {
        Arc::try_unwrap(volume)
            .ok()
            .expect("sole owner")
            .close()
            .expect("close");
    }
}

/// A block's contents for a writer's `n`-th write.
fn block(lba: u64, n: u64) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK as usize];
    for (i, chunk) in out.chunks_exact_mut(16).enumerate() {
        chunk[..8].copy_from_slice(&lba.to_le_bytes());
        chunk[8..].copy_from_slice(&(n ^ i as u64).to_le_bytes());
    }
    out
}

/// Writer `id` writes runs of 1-16 blocks within its own stripes of the
/// first `WRITTEN` bytes until `stop`; returns what it wrote last per
/// block (`None`: never) and how many writes it made.
fn writer(
    mirror: Arc<Mirror>,
    id: u64,
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
) -> Vec<Option<u64>> {
    let blocks = WRITTEN / BLOCK;
    let mut last = vec![None; blocks as usize];
    let mut state = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(id + 1);
    let mut n = 0;
    while !stop.load(Ordering::Acquire) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Runs of 64 blocks alternate between writers: no two write one block.
        let run = (state % (blocks / 64 / WRITERS)) * WRITERS + id;
        let count = state >> 40 & 15;
        let first = run * 64 + (state >> 20) % (64 - count);
        let count = count + 1;
        let mut data = Vec::with_capacity((count * BLOCK) as usize);
        for lba in first..first + count {
            n += 1;
            data.extend(block(lba, n));
            last[lba as usize] = Some(n);
        }
        mirror
            .write(first * BLOCK, &data, false)
            .expect("client write");
        if n % 64 < count {
            mirror.flush().expect("client flush");
        }
        writes.fetch_add(1, Ordering::Relaxed);
    }
    last
}

/// Poll `condition` until it holds; fail after 30 s (a hang guard) naming
/// `what` was awaited.
fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A 2-leg mirror in `dir` whose leg 1 was away while the first `MISSED`
/// bytes were written (0xa5): its map names them. Returns the legs' paths.
fn leg_1_missed_the_first_12_mib(dir: &Path) -> [std::path::PathBuf; 2] {
    let paths = [dir.join("leg0"), dir.join("leg1")];
    create_mirror(&paths, &CreateOptions::new(SIZE))
        .expect("create")
        .close()
        .expect("close");
    let away = dir.join("away");
    std::fs::rename(&paths[1], &away).expect("leg 1 away");
    let (mirror, volumes, _) = open(&paths[0]);
    for at in (0..MISSED).step_by(1 << 20) {
        mirror
            .write(at, &vec![0xa5; 1 << 20], false)
            .expect("write");
    }
    mirror.flush().expect("flush");
    close(mirror, volumes);
    std::fs::rename(&away, &paths[1]).expect("leg 1 back");
    paths
}

#[test]
fn a_resync_ends_while_clients_keep_writing_and_the_legs_then_agree() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = leg_1_missed_the_first_12_mib(dir.path());

    let (mirror, volumes, record) = open(&paths[0]);
    assert_eq!(record.members[1].state, mirror::LegState::Stale);
    assert_eq!(mirror.map_of(1).expect("map").count(), MISSED / BLOCK);
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|id| {
            let (mirror, stop, writes) =
                (Arc::clone(&mirror), Arc::clone(&stop), Arc::clone(&writes));
            std::thread::spawn(move || writer(mirror, id, stop, writes))
        })
        .collect();
    wait_for("the writers to write 50 times", || {
        writes.load(Ordering::Relaxed) >= 50
    });
    // Under client I/O the floor applies: 12 MiB at 8 MiB/s, 1.5 s.
    let rate = ResyncRate {
        min: 8 << 20,
        max: 1 << 30,
    };
    let started = Instant::now();
    mirror.start_resync(1, rate, false).expect("start resync");
    let before = writes.load(Ordering::Relaxed);
    // A hang guard: the resync ends while the writers write, or never.
    wait_for("the resync to end under the writers", || {
        !mirror.status()[1].resyncing
    });
    let took = started.elapsed();
    let during = writes.load(Ordering::Relaxed) - before;
    // The writers are still writing: the resync ended under them.
    wait_for("a write after the resync ended", || {
        writes.load(Ordering::Relaxed) > before + during
    });
    stop.store(true, Ordering::Release);
    let last: Vec<Vec<Option<u64>>> = writers
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect();
    let progress = mirror.status()[1].resync.clone().expect("progress");
    assert_eq!(progress.state, "done", "{progress:?}");
    assert!(
        during >= 100,
        "writers wrote only {during} times during the resync"
    );
    assert!(mirror.map_of(1).is_none(), "the map is gone");
    assert_eq!(mirror.active(), vec![0, 1]);
    eprintln!(
        "resync of {} blocks (copied {}) took {took:?} under {during} client writes",
        MISSED / BLOCK,
        progress.copied
    );
    mirror.flush().expect("flush");
    // Both legs hold what the writers wrote last, and 0xa5 or zeros
    // where they did not write.
    let leg = |index: usize| volumes[index].as_ref().expect("leg open");
    let mut ours = vec![0u8; BLOCK as usize];
    let mut theirs = vec![0u8; BLOCK as usize];
    for lba in 0..SIZE / BLOCK {
        leg(0).read(lba * BLOCK, &mut ours).expect("leg 0");
        leg(1).read(lba * BLOCK, &mut theirs).expect("leg 1");
        assert!(ours == theirs, "the legs differ at LBA {lba}");
        let written = last
            .iter()
            .find_map(|by| by.get(lba as usize).copied().flatten());
        let expected = match written {
            Some(n) => block(lba, n),
            None if lba * BLOCK < MISSED => vec![0xa5; BLOCK as usize],
            None => vec![0; BLOCK as usize],
        };
        assert!(ours == expected, "LBA {lba} is not what was written last");
    }
    close(mirror, volumes);
}

#[test]
fn a_finished_resync_shows_nothing_left_even_when_writes_came_before_it_was_recorded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = [dir.path().join("leg0"), dir.path().join("leg1")];
    create_mirror(&paths, &CreateOptions::new(4 << 20))
        .expect("create")
        .close()
        .expect("close");
    let away = dir.path().join("away");
    std::fs::rename(&paths[1], &away).expect("leg 1 away");
    let (mirror, volumes, _) = open(&paths[0]);
    mirror.write(0, &vec![0x5a; 1 << 20], true).expect("write");
    close(mirror, volumes);
    std::fs::rename(&away, &paths[1]).expect("leg 1 back");
    let (mirror, volumes, _) = open(&paths[0]);
    let mut cursor = mirror.begin_resync(1, false).expect("begin");
    while mirror.resync_step(&mut cursor).expect("step") != mirror::ResyncStep::Finished {}
    // The leg is active; a client writes before the end is recorded.
    mirror
        .write(2 << 20, &vec![0x77; 64 << 10], false)
        .expect("write");
    let progress = mirror.end_resync(cursor, Ok(true));
    assert_eq!(progress.state, "done", "{progress:?}");
    assert_eq!(progress.left, 0, "{progress:?}");
    assert_eq!(mirror.status()[1].resync.as_ref().map(|p| p.left), Some(0));
    close(mirror, volumes);
}

/// Write `count` blocks from `first` to leg 0 alone (bypassing the
/// mirror): the legs then differ there, each copy valid.
fn write_leg0_only(volumes: &[Option<Arc<Volume>>], first: u64, count: u64, tag: u8) {
    let leg0 = volumes[0].as_ref().expect("leg 0");
    leg0.write(first * BLOCK, &vec![tag; (count * BLOCK) as usize], false)
        .expect("write leg 0");
    leg0.flush().expect("flush leg 0");
}

#[test]
fn legs_that_differ_after_a_crash_are_not_counted_against_a_leg_and_a_full_resync_resets_its_count()
{
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = [dir.path().join("leg0"), dir.path().join("leg1")];
    create_mirror(&paths, &CreateOptions::new(4 << 20))
        .expect("create")
        .close()
        .expect("close");
    let (mirror, volumes, record) = open(&paths[0]);
    // After an unclean shutdown 30 blocks differ (more than the
    // threshold of 20): the scrub makes them agree without blaming leg 1.
    mirror.read_one_leg_until_scrubbed();
    write_leg0_only(&volumes, 0, 30, 0x11);
    let control = vouch_engine::jobs::JobControl::default();
    let report = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &control,
    )
    .expect("scrub");
    assert_eq!((report.found, report.repaired), (30, 30), "{report:?}");
    assert_eq!(mirror.active(), vec![0, 1], "leg 1 faulted for a crash");
    assert_eq!(mirror.status()[1].corrected, 0);
    // A leg's own errors count: 15 blocks leg 0 holds older than the
    // mirror wrote them (written to both, then to leg 0 alone with its
    // own, lower, generation: the scrub rewrites leg 0's as `stale`).
    // Leg 1's clock is put ahead of leg 0's first (30 commits of its own
    // to the same blocks, overwritten below), so the mirror's stamp, the
    // highest leg clock, is above what leg 0 stamps alone.
    let leg1 = volumes[1].as_ref().expect("leg 1");
    for round in 0..30u8 {
        leg1.write(100 * BLOCK, &vec![round; 15 * BLOCK as usize], true)
            .expect("write leg 1");
    }
    mirror
        .write(100 * BLOCK, &vec![0x21; 15 * BLOCK as usize], true)
        .expect("write");
    write_leg0_only(&volumes, 100, 15, 0x22);
    let report = mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &control,
    )
    .expect("scrub");
    assert_eq!(report.repaired, 15, "{report:?}");
    assert_eq!(mirror.status()[0].corrected, 15, "{report:?}");
    // Leg 0 is taken out and resynced in full: its count starts afresh.
    mirror.fault(0, "test");
    let blocks = mirror.size() / BLOCK;
    let (map, _) = mirror::DirtyMap::open(
        &mirror::set::map_dirs(&record)[1..],
        0,
        record.uuid,
        blocks,
        false,
    )
    .expect("map");
    map.mark(0, blocks).expect("mark");
    mirror.track(0, Arc::new(map)).expect("track");
    let mut cursor = mirror.begin_resync(0, true).expect("begin");
    while mirror.resync_step(&mut cursor).expect("step") != mirror::ResyncStep::Finished {}
    assert_eq!(mirror.end_resync(cursor, Ok(true)).state, "done");
    assert_eq!(
        mirror.status()[0].corrected,
        0,
        "a full resync keeps old errors"
    );
    close(mirror, volumes);
}

/// 4 KiB/s: a batch of a resync, or a chunk of a reconciliation, is due
/// minutes after the last.
const SLOW: ResyncRate = ResyncRate {
    min: 4 << 10,
    max: 4 << 10,
};

/// A resync is a job like a scan: at its rate it copies one batch (four
/// windows of 256 blocks), then waits (one paced wait); stopped during that
/// wait it ends `stopped` with that batch copied and the map keeping the
/// rest, and the next resync copies only the rest, never waiting unpaced.
/// Counted, not timed.
#[test]
fn a_resync_at_its_rate_waits_after_each_batch_and_a_stop_keeps_what_is_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = leg_1_missed_the_first_12_mib(dir.path());
    let (mirror, volumes, _) = open(&paths[0]);
    let total = MISSED / BLOCK;
    assert_eq!(mirror.map_of(1).expect("map").count(), total);
    mirror.start_resync(1, SLOW, false).expect("start resync");
    // A hang guard: the first batch is copied at once, the second is due
    // 1024 s later.
    wait_for("the first batch", || {
        mirror.status()[1]
            .resync
            .as_ref()
            .is_some_and(|progress| progress.copied > 0)
    });
    mirror.stop_resyncs().expect("stop");
    let progress = mirror.status()[1].resync.clone().expect("progress");
    assert_eq!(progress.state, "stopped", "{progress:?}");
    assert_eq!(progress.copied, 1024, "one batch: {progress:?}");
    assert_eq!(progress.paced_waits, 1, "one wait, after it: {progress:?}");
    assert_eq!(progress.left, total - 1024, "{progress:?}");
    assert_eq!(mirror.map_of(1).expect("map").count(), total - 1024);
    close(mirror, volumes);

    // The map is its cursor: the next resync copies what is left.
    let (mirror, volumes, _) = open(&paths[0]);
    assert_eq!(mirror.map_of(1).expect("map").count(), total - 1024);
    let mut cursor = mirror.begin_resync(1, false).expect("begin");
    while mirror.resync_step(&mut cursor).expect("step") != mirror::ResyncStep::Finished {}
    let progress = mirror.end_resync(cursor, Ok(true));
    assert_eq!(progress.state, "done", "{progress:?}");
    assert_eq!(progress.copied, total - 1024, "{progress:?}");
    assert_eq!(progress.paced_waits, 0, "{progress:?}");
    close(mirror, volumes);
}

/// A reconciliation is a job like a scan: at its rate it checks one chunk
/// (256 blocks) of the extents the activity log named, then waits (one
/// paced wait); stopped during that wait it ends `stopped` one chunk into
/// its extents, every extent still in the log for the next start.
/// Counted, not timed.
#[test]
fn a_reconciliation_at_its_rate_waits_after_each_chunk_and_a_stop_keeps_its_extents() {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = [dir.path().join("leg0"), dir.path().join("leg1")];
    create_mirror(&paths, &CreateOptions::new(SIZE))
        .expect("create")
        .close()
        .expect("close");
    let extent = mirror::EXTENT_BLOCKS;
    let (mirror, volumes, record) = open(&paths[0]);
    let blocks = mirror.size() / BLOCK;
    let (log, _) = mirror::set::open_activity(&record, blocks).expect("log");
    mirror
        .keep_activity_log(Arc::new(log))
        .expect("keep the log");
    // Writes in three extents, the log never closed: an unclean stop.
    for index in [0, 2, 5] {
        mirror
            .write(index * extent * BLOCK, &vec![0x3c; BLOCK as usize], true)
            .expect("write");
    }
    close(mirror, volumes);

    let (mirror, volumes, record) = open(&paths[0]);
    let (log, recovered) = mirror::set::open_activity(&record, blocks).expect("log");
    assert_eq!(recovered, mirror::Recovered::Extents(vec![0, 2, 5]));
    let log = Arc::new(log);
    mirror
        .keep_activity_log(Arc::clone(&log))
        .expect("keep the log");
    assert!(mirror.start_reconcile(SLOW).expect("start"));
    wait_for("the first chunk", || {
        mirror
            .reconcile_progress()
            .is_some_and(|progress| progress.blocks_checked > 0)
    });
    mirror.stop_resyncs().expect("stop");
    let progress = mirror.reconcile_progress().expect("progress");
    assert_eq!(progress.state, "stopped", "{progress:?}");
    assert_eq!(progress.blocks_checked, 256, "one chunk: {progress:?}");
    assert_eq!(progress.paced_waits, 1, "one wait, after it: {progress:?}");
    assert_eq!(progress.blocks_left, 3 * extent - 256, "{progress:?}");
    assert_eq!((progress.extents, progress.extents_left), (3, 3));
    assert_eq!(log.pinned(), vec![0, 2, 5], "every extent left to check");
    close(mirror, volumes);
}
