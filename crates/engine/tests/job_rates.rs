//! Every job of the engine honours its rate and keeps its cursor when
//! cancelled, counted, not timed: at a rate so low that each step is due
//! minutes after the last, a job steps once, waits (one paced wait in its
//! `JobControl`), and a cancel during that wait ends it with the one step
//! done and its cursor there. Without the rate it would not wait.
//! The scan (`check`, `export`), `verify`, a volume's `scrub` and `copy`.

#![allow(clippy::single_range_in_vec_init)] // ranges of LBAs to write

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use vouch_engine::copy::{copy, CopyMethod, CopyOptions};
use vouch_engine::jobs::{scan, JobControl, ScanEnd, ScanOptions, SCAN_CHUNK_BLOCKS};
use vouch_engine::scrub::{last_scrub, scrub, ScrubOptions, ScrubState};
use vouch_engine::verify::{verify, VerifyOptions};
use vouch_engine::{Error, LayoutKind};

/// 4 KiB/s: a 1 MiB step is due 256 s after the job began.
const SLOW: u64 = 4 << 10;

/// Run `job` with a control that a watcher cancels once the first step is
/// behind the job (its progress moved): the job is then waiting for its
/// pace, or about to. Returns the job's result and its control.
fn cancelled_after_the_first_step<R>(job: impl FnOnce(&JobControl) -> R) -> (R, JobControl) {
    let control = JobControl::default();
    let ended = AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        scope.spawn(|| {
            // A hang guard, not a bound on the job's speed.
            let deadline = Instant::now() + Duration::from_secs(60);
            while control.progress().0 == 0 && !ended.load(Ordering::Acquire) {
                assert!(Instant::now() < deadline, "the job never stepped");
                std::thread::sleep(Duration::from_millis(1));
            }
            control.cancel();
        });
        let result = job(&control);
        ended.store(true, Ordering::Release);
        result
    });
    (result, control)
}

/// A volume with data in its first four scan chunks (1024 blocks).
fn four_chunks() -> (tempfile::TempDir, std::path::PathBuf, vouch_engine::Volume) {
    let (dir, path) = volume_dir(LayoutKind::Split, &[0..1024]);
    let volume = open(&path);
    (dir, path, volume)
}

/// One step of 256 blocks, one paced wait, and read no further.
fn assert_one_paced_step(control: &JobControl, what: &str) {
    assert_eq!(control.paced_waits(), 1, "{what}: one wait, after the step");
    assert_eq!(
        control.progress().0,
        SCAN_CHUNK_BLOCKS,
        "{what}: one step done"
    );
}

#[test]
fn a_scan_at_a_rate_waits_after_each_step_and_a_cancel_keeps_its_position() {
    let (_dir, _, volume) = four_chunks();
    let options = ScanOptions {
        rate_bytes_per_second: Some(SLOW),
        ..ScanOptions::default()
    };
    let mut visited = 0;
    let (end, control) = cancelled_after_the_first_step(|control| {
        scan(&volume, options, control, None, |chunk| {
            visited += chunk.count;
            Ok(())
        })
        .expect("scan")
    });
    assert_eq!(
        end,
        ScanEnd::Cancelled {
            at: SCAN_CHUNK_BLOCKS
        }
    );
    assert_eq!(visited, SCAN_CHUNK_BLOCKS);
    assert_eq!(control.read_blocks(), SCAN_CHUNK_BLOCKS);
    assert_one_paced_step(&control, "scan");
}

#[test]
fn a_verify_at_a_rate_waits_after_each_step_and_a_cancel_says_how_far() {
    let (_dir, _, volume) = four_chunks();
    let options = VerifyOptions {
        rate_bytes_per_second: Some(SLOW),
        ..VerifyOptions::default()
    };
    let (result, control) =
        cancelled_after_the_first_step(|control| verify(&volume, 0, 1024, &options, control));
    let error = result.expect_err("cancelled");
    assert!(matches!(error, Error::Cancelled(_)), "{error}");
    assert_one_paced_step(&control, "verify");
}

#[test]
fn a_scrub_at_a_rate_waits_after_each_step_and_a_cancel_keeps_its_cursor() {
    let (_dir, path, volume) = four_chunks();
    let options = ScrubOptions {
        rate_bytes_per_second: Some(SLOW),
        foreground: None,
    };
    let (record, control) =
        cancelled_after_the_first_step(|control| scrub(&volume, &path, &options, control));
    let record = record.expect("scrub");
    assert_eq!(record.state, ScrubState::Cancelled);
    assert_eq!(record.cursor, SCAN_CHUNK_BLOCKS);
    assert_one_paced_step(&control, "scrub");
    let stored = last_scrub(&path).expect("read").expect("a record");
    assert_eq!(stored.cursor, SCAN_CHUNK_BLOCKS, "the cursor is kept");
    // The next scrub, unpaced, starts there and never waits.
    let resumed = JobControl::default();
    let record = scrub(&volume, &path, &ScrubOptions::default(), &resumed).expect("scrub");
    assert_eq!(record.state, ScrubState::Finished);
    assert_eq!(resumed.read_blocks(), 1024 - SCAN_CHUNK_BLOCKS);
    assert_eq!(resumed.paced_waits(), 0);
}

#[test]
fn a_copy_at_a_rate_waits_after_each_step_and_a_cancel_says_how_far() {
    let (_dir, _, volume) = four_chunks();
    let options = CopyOptions {
        method: CopyMethod::Pipelined,
        rate_bytes_per_second: Some(SLOW),
    };
    let (result, control) = cancelled_after_the_first_step(|control| {
        copy(&volume, 0, &volume, 1024, 1024, &options, control)
    });
    let error = result.expect_err("cancelled");
    assert!(matches!(error, Error::Cancelled(_)), "{error}");
    assert!(
        error
            .to_string()
            .contains(&format!("after {SCAN_CHUNK_BLOCKS} of 1024 blocks")),
        "{error}"
    );
    assert_one_paced_step(&control, "copy");
}
