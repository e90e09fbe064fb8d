//! Scrub on real volume directories: it finds the blocks damaged on disk,
//! keeps its record in `scrub.json`, resumes from its cursor after a
//! cancel or a crash (without re-reading what it finished), keeps its
//! rate, backs off for foreground I/O, and never reports a fault on a
//! healthy volume being written while it runs.

#![allow(clippy::single_range_in_vec_init)] // ranges of LBAs to write

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vouch_engine::DeviceWrites;

use common::*;
use vouch_engine::jobs::JobControl;
use vouch_engine::scrub::{last_scrub, scrub, ScrubOptions, ScrubState, SCRUB_FILE};
use vouch_engine::{
    Admission, Allocation, BlockDevice, Error, Fault, FaultKind, LayoutKind, Result, Submitted,
    Volume, ZeroFlags, BLOCK,
};

/// Data in chunks 0, 1, 3 (partly) and 5; blocks 10 and 1300 damaged.
fn damaged_volume(layout: LayoutKind) -> (tempfile::TempDir, std::path::PathBuf) {
    let (dir, path) = volume_dir(layout, &[0..512, 800..900, 1280..1536]);
    corrupt_data(&path, 10);
    corrupt_context(&path, layout, 1300);
    (dir, path)
}

fn expected_faults() -> Vec<Fault> {
    vec![
        Fault {
            lba: 10,
            kind: FaultKind::GuardMismatch,
        },
        Fault {
            lba: 1300,
            kind: FaultKind::ContextCorrupt,
        },
    ]
}

#[test]
fn a_scrub_finds_the_damage_and_keeps_its_record() {
    for layout in LayoutKind::ALL {
        let (_dir, path) = damaged_volume(layout);
        assert!(last_scrub(&path).expect("no record").is_none());
        let volume = open(&path);
        let control = JobControl::default();
        let record = scrub(&volume, &path, &ScrubOptions::default(), &control).expect("scrub");
        assert_eq!(record.state, ScrubState::Finished);
        assert_eq!(record.faults, expected_faults(), "{layout:?}");
        assert_eq!(record.faults_found, 2);
        assert_eq!(record.cursor, BLOCKS);
        assert_eq!(record.blocks_total, BLOCKS);
        assert_eq!(record.blocks_checked, control.read_blocks());
        assert!(
            record.blocks_checked >= 4 * 256 && record.blocks_checked < BLOCKS,
            "holes skipped"
        );
        assert!(record.finished_unix.expect("finished") >= record.started_unix);
        assert_eq!(record.error, None);
        let stored = last_scrub(&path).expect("read").expect("a record");
        assert_eq!(stored.state, ScrubState::Finished);
        assert_eq!(stored.faults, record.faults);
        assert_eq!(stored.blocks_checked, record.blocks_checked);
        assert_eq!(stored.finished_unix, record.finished_unix);
        assert!(!path.join(format!("{SCRUB_FILE}.tmp")).exists());
        // A finished scrub is not resumed: the next one reads everything again.
        let again = JobControl::default();
        let record = scrub(&volume, &path, &ScrubOptions::default(), &again).expect("scrub");
        assert_eq!(again.read_blocks(), control.read_blocks());
        assert_eq!(record.faults, expected_faults());
    }
}

/// Options whose foreground counter cancels `control` when the scrub has
/// visited `chunks` chunks (the counter is read once per chunk).
fn cancel_after(chunks: u64, control: Arc<JobControl>) -> ScrubOptions {
    let calls = AtomicU64::new(0);
    ScrubOptions {
        rate_bytes_per_second: None,
        foreground: Some(Arc::new(move || {
            // One call when the scrub starts, then one per chunk.
            if calls.fetch_add(1, Ordering::Relaxed) == chunks {
                control.cancel();
            }
            0
        })),
    }
}

#[test]
fn a_cancelled_or_killed_scrub_resumes_from_its_cursor() {
    for layout in LayoutKind::ALL {
        let (_dir, path) = damaged_volume(layout);
        let volume = open(&path);
        let full = JobControl::default();
        let everything = scrub(&volume, &path, &ScrubOptions::default(), &full).expect("scrub");
        std::fs::remove_file(path.join(SCRUB_FILE)).expect("forget it");

        // Cancelled after two chunks (0 and 1): 512 blocks, or on a
        // packed volume 16 whole rows (its chunks end on rows).
        let two_chunks = match layout {
            LayoutKind::Split => 512,
            LayoutKind::Packed => 16 * 31,
        };
        let control = Arc::new(JobControl::default());
        let record =
            scrub(&volume, &path, &cancel_after(2, control.clone()), &control).expect("scrub");
        assert_eq!(record.state, ScrubState::Cancelled, "{layout:?}");
        assert_eq!(record.cursor, two_chunks);
        assert_eq!(record.faults, expected_faults()[..1]);
        assert_eq!(control.read_blocks(), two_chunks);
        let stored = last_scrub(&path).expect("read").expect("a record");
        assert_eq!(
            (stored.state, stored.cursor),
            (ScrubState::Cancelled, two_chunks)
        );

        // The next scrub continues from there and reads only what is left.
        let resumed = JobControl::default();
        let record = scrub(&volume, &path, &ScrubOptions::default(), &resumed).expect("scrub");
        assert_eq!(record.state, ScrubState::Finished);
        assert_eq!(record.faults, expected_faults());
        assert_eq!(record.started_unix, stored.started_unix, "the same scrub");
        assert_eq!(resumed.read_blocks(), full.read_blocks() - two_chunks);
        assert_eq!(record.blocks_checked, everything.blocks_checked);

        // A scrub killed mid-way leaves a Running record with its cursor:
        // the next one resumes from it.
        std::fs::remove_file(path.join(SCRUB_FILE)).expect("forget it");
        let control = Arc::new(JobControl::default());
        scrub(&volume, &path, &cancel_after(3, control.clone()), &control).expect("scrub");
        let text = std::fs::read_to_string(path.join(SCRUB_FILE)).expect("read");
        assert!(text.contains("\"cancelled\""), "{text}");
        std::fs::write(
            path.join(SCRUB_FILE),
            text.replace("\"cancelled\"", "\"running\""),
        )
        .expect("write");
        let running = last_scrub(&path).expect("read").expect("a record");
        assert_eq!(running.state, ScrubState::Running);
        let after_crash = JobControl::default();
        let record = scrub(&volume, &path, &ScrubOptions::default(), &after_crash).expect("scrub");
        assert_eq!(record.state, ScrubState::Finished);
        assert!(after_crash.read_blocks() > 0 && running.cursor > 0);
        assert_eq!(
            after_crash.read_blocks(),
            vouch_engine::verify::verify(
                &volume,
                running.cursor,
                BLOCKS - running.cursor,
                &Default::default(),
                &JobControl::default()
            )
            .expect("verify")
            .blocks_read
        );
        assert_eq!(record.faults, expected_faults());
    }
}

#[test]
fn a_scrub_keeps_its_rate_and_backs_off_for_foreground_io() {
    let (_dir, path) = volume_dir(LayoutKind::Split, &[0..1024]);
    let volume = open(&path);
    // 4 MiB at 16 MiB/s: at least 0.25 s.
    let started = Instant::now();
    let options = ScrubOptions {
        rate_bytes_per_second: Some(16 << 20),
        foreground: None,
    };
    scrub(&volume, &path, &options, &JobControl::default()).expect("scrub");
    assert!(
        started.elapsed() >= Duration::from_millis(240),
        "{:?}",
        started.elapsed()
    );

    // The scrub reads the foreground counter once before it starts and
    // after each chunk it read (it skips holes: the 1024 blocks written);
    // after a back-off it reads it again, so the reads of the counter
    // tell how often it backed off.
    let chunks = 1024 / vouch_engine::jobs::SCAN_CHUNK_BLOCKS;
    // Foreground requests arriving all the time: every chunk waits for them.
    let requests = Arc::new(AtomicU64::new(0));
    let counter = requests.clone();
    let options = ScrubOptions {
        rate_bytes_per_second: None,
        foreground: Some(Arc::new(move || counter.fetch_add(1, Ordering::Relaxed))),
    };
    let started = Instant::now();
    scrub(&volume, &path, &options, &JobControl::default()).expect("scrub");
    let backed_off = started.elapsed();
    assert!(
        backed_off >= vouch_engine::scrub::FOREGROUND_BACKOFF * 4,
        "{backed_off:?}"
    );
    assert_eq!(
        requests.load(Ordering::Relaxed),
        1 + 2 * chunks,
        "a back-off after each of the {chunks} chunks"
    );
    // No foreground requests: no back-off.
    let looked = Arc::new(AtomicU64::new(0));
    let counter = looked.clone();
    let quiet = ScrubOptions {
        rate_bytes_per_second: None,
        foreground: Some(Arc::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
            7
        })),
    };
    scrub(&volume, &path, &quiet, &JobControl::default()).expect("scrub");
    assert_eq!(
        looked.load(Ordering::Relaxed),
        1 + chunks,
        "no back-off over {chunks} quiet chunks"
    );
}

#[test]
fn a_scrub_racing_writes_and_flushes_never_reports_a_fault() {
    for layout in LayoutKind::ALL {
        let (_dir, path) = volume_dir(layout, &[0..BLOCKS]);
        let volume = Arc::new(open(&path));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (volume, stop) = (volume.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut round = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    let lba = round.wrapping_mul(2654435761) % (BLOCKS - 8);
                    let data: Vec<u8> = (lba..lba + 8)
                        .flat_map(|l| pattern(l, round as u8))
                        .collect();
                    volume.write(lba * BLOCK, &data, false).expect("write");
                    if round.is_multiple_of(7) {
                        volume.trim((lba + 3) * BLOCK, BLOCK, false).expect("trim");
                    }
                    if round.is_multiple_of(16) {
                        volume.flush().expect("flush");
                    }
                }
                round
            })
        };
        for _ in 0..6 {
            let record = scrub(
                &*volume,
                &path,
                &ScrubOptions::default(),
                &JobControl::default(),
            )
            .expect("scrub");
            assert_eq!(record.faults, vec![], "{layout:?}");
            assert_eq!(record.state, ScrubState::Finished);
        }
        stop.store(true, Ordering::Relaxed);
        let rounds = writer.join().expect("writer");
        assert!(rounds > 0);
    }
}

#[test]
fn a_scrub_refuses_a_read_only_directory_and_a_second_scrub() {
    let (dir, path) = volume_dir(LayoutKind::Split, &[0..300]);
    let volume = open(&path);
    // Root ignores permission bits; the immutable attribute stops it too.
    let status = std::process::Command::new("chattr")
        .arg("+i")
        .arg(&path)
        .status()
        .expect("chattr (apt-get install e2fsprogs)");
    assert!(
        status.success(),
        "chattr +i needs ext4/xfs and CAP_LINUX_IMMUTABLE"
    );
    let result = scrub(
        &volume,
        &path,
        &ScrubOptions::default(),
        &JobControl::default(),
    );
    std::process::Command::new("chattr")
        .arg("-i")
        .arg(&path)
        .status()
        .expect("chattr -i");
    let error = result.expect_err("a read-only directory");
    let text = error.to_string();
    assert!(
        text.contains("scrub.json") && text.contains("must be writable"),
        "{text}"
    );
    assert!(
        last_scrub(&path).expect("read").is_none(),
        "nothing was written"
    );

    // Two scrubs of one volume directory at once: the second is refused.
    let control = Arc::new(JobControl::default());
    let entered = Arc::new(AtomicBool::new(false));
    let release = Arc::new(AtomicBool::new(false));
    let options = {
        let (entered, release) = (entered.clone(), release.clone());
        ScrubOptions {
            rate_bytes_per_second: None,
            foreground: Some(Arc::new(move || {
                entered.store(true, Ordering::Relaxed);
                while !release.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                0
            })),
        }
    };
    let volume = Arc::new(volume);
    let first = {
        let (volume, path, control) = (volume.clone(), path.clone(), control.clone());
        std::thread::spawn(move || scrub(&*volume, &path, &options, &control))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !entered.load(Ordering::Relaxed) {
        assert!(Instant::now() < deadline, "the first scrub never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let error = scrub(
        &*volume,
        &path,
        &ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect_err("a second scrub");
    assert!(error.to_string().contains("already running"), "{error}");
    release.store(true, Ordering::Relaxed);
    let record = first.join().expect("thread").expect("scrub");
    assert_eq!(record.state, ScrubState::Finished);
    drop(dir);
}

#[test]
fn a_damaged_record_is_reported_and_replaced_by_the_next_scrub() {
    let (_dir, path) = volume_dir(LayoutKind::Split, &[0..300]);
    std::fs::write(path.join(SCRUB_FILE), b"{ not json").expect("write");
    let error = last_scrub(&path).expect_err("garbage");
    assert!(error.to_string().contains("scrub.json"), "{error}");
    let volume = open(&path);
    let record = scrub(
        &volume,
        &path,
        &ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    assert_eq!(record.state, ScrubState::Finished);
    assert_eq!(
        last_scrub(&path).expect("read").expect("record").cursor,
        BLOCKS
    );
}

/// A layer that fails reads from `fail_from` on with an I/O error (as a
/// dying disk would), over a real volume.
struct FailingReads {
    inner: Volume,
    fail_from: u64,
}

impl BlockDevice for FailingReads {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<std::ops::Range<u64>>> {
        self.inner.read(offset, buf)
    }
    fn submit_write(
        &self,
        offset: u64,
        data: &bytes::Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        if admission != Admission::MayWait {
            return Ok(Submitted::Declined);
        }
        self.inner.submit_write(offset, data, fua, admission)
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.inner.trim(offset, length, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> Result<()> {
        self.inner.write_zeroes(offset, length, flags)
    }
    fn block_status(
        &self,
        offset: u64,
        length: u64,
        max_blocks: u64,
    ) -> Result<Vec<(u64, Allocation)>> {
        self.inner.block_status(offset, length, max_blocks)
    }
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        if first >= self.fail_from {
            return Err(Error::Io {
                op: "read",
                object: vouch_engine::ObjectId::Data(0),
                offset: first * BLOCK,
                cause: std::io::Error::from_raw_os_error(libc_eio()),
            });
        }
        self.inner.read_blocks_collecting(first, count, out)
    }
}

fn libc_eio() -> i32 {
    5
}

#[test]
fn a_scrub_stopped_by_an_io_error_is_recorded_failed_and_the_next_starts_anew() {
    let (_dir, path) = damaged_volume(LayoutKind::Split);
    let device = FailingReads {
        inner: open(&path),
        fail_from: 1024,
    };
    let error = scrub(
        &device,
        &path,
        &ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect_err("an I/O error");
    assert!(matches!(error, Error::Io { .. }), "{error}");
    let record = last_scrub(&path).expect("read").expect("a record");
    assert_eq!(record.state, ScrubState::Failed);
    assert!(
        record
            .error
            .as_deref()
            .is_some_and(|e| e.contains("I/O error")),
        "{record:?}"
    );
    assert_eq!(
        record.faults,
        expected_faults()[..1],
        "what it found before stays"
    );
    let control = JobControl::default();
    let record = scrub(&device.inner, &path, &ScrubOptions::default(), &control).expect("scrub");
    assert_eq!(record.state, ScrubState::Finished);
    assert_eq!(record.faults, expected_faults());
    assert_eq!(record.error, None);
    assert_eq!(
        control.read_blocks(),
        record.blocks_checked,
        "from the start"
    );
}
