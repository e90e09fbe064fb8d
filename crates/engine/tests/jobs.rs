//! The background-job mechanism (`jobs::scan`): a scan skips holes, can be
//! cancelled from its visitor or another thread, and resumes from its
//! persisted cursor without revisiting what it finished.

use std::sync::Arc;
use vouch_engine::DeviceWrites;

use vouch_engine::jobs::{scan, Cursor, CursorFile, JobControl, ScanEnd, ScanOptions};
use vouch_engine::{BlockDevice, CreateOptions, SimStorage, Volume, BLOCK};

fn volume_with_data(chunks_with_data: &[u64]) -> Volume {
    let storage = Arc::new(SimStorage::new());
    // 8 chunks of 256 blocks (1 MiB each).
    let volume = Volume::create(storage, &CreateOptions::new(8 << 20)).expect("create");
    for chunk in chunks_with_data {
        let lba = chunk * 256 + 3;
        volume
            .write(lba * BLOCK, &[0xa5u8; BLOCK as usize], false)
            .expect("write");
    }
    volume.flush().expect("flush");
    volume
}

#[test]
fn a_scan_skips_holes_cancels_and_resumes_from_its_cursor() {
    let volume = volume_with_data(&[1, 4, 6]);
    let dir = tempfile::tempdir().expect("tempdir");
    let cursor = CursorFile::new(dir.path().join("scan.cursor"));

    // First run: cancelled after the first chunk it visits.
    let control = JobControl::default();
    let mut visited = Vec::new();
    let end = scan(
        &volume,
        ScanOptions::default(),
        &control,
        Some(&cursor),
        |chunk| {
            visited.push(chunk.lba);
            assert!(chunk.faults.is_empty());
            control.cancel();
            Ok(())
        },
    )
    .expect("scan");
    assert_eq!(visited, vec![256], "holes before chunk 1 are skipped");
    assert_eq!(end, ScanEnd::Cancelled { at: 512 });
    assert_eq!(cursor.load().expect("load"), Some(512));

    // A restart resumes after the cancelled chunk and visits only what is left.
    let control = JobControl::default();
    let mut visited = Vec::new();
    let mut bytes_seen = 0;
    let end = scan(
        &volume,
        ScanOptions::default(),
        &control,
        Some(&cursor),
        |chunk| {
            visited.push(chunk.lba);
            bytes_seen += chunk.data.iter().filter(|b| **b == 0xa5).count();
            Ok(())
        },
    )
    .expect("scan");
    assert_eq!(end, ScanEnd::Finished);
    assert_eq!(visited, vec![4 * 256, 6 * 256]);
    assert_eq!(bytes_seen, 2 * BLOCK as usize);
    assert_eq!(control.progress(), (2048, 2048));
    assert_eq!(control.read_blocks(), 512);
    assert_eq!(
        cursor.load().expect("load"),
        None,
        "a finished scan clears its cursor"
    );
    assert_eq!(volume.size(), 8 << 20);
}

#[test]
fn a_scan_of_a_range_stays_in_it_and_a_throttled_scan_keeps_its_rate() {
    let volume = volume_with_data(&[0, 1, 2, 3]);
    let control = JobControl::default();
    let options = ScanOptions {
        start: 256,
        end: Some(768),
        // 2 MiB at 8 MiB/s: at least 0.25 s.
        rate_bytes_per_second: Some(8 << 20),
        ..ScanOptions::default()
    };
    let started = std::time::Instant::now();
    let mut visited = Vec::new();
    scan(&volume, options, &control, None, |chunk| {
        visited.push((chunk.lba, chunk.count));
        Ok(())
    })
    .expect("scan");
    assert_eq!(visited, vec![(256, 256), (512, 256)]);
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(240),
        "{:?}",
        started.elapsed()
    );
}

/// Counts the saves a scan makes.
#[derive(Default)]
struct CountingCursor {
    saves: std::sync::Mutex<Vec<u64>>,
    cleared: std::sync::atomic::AtomicBool,
}

impl Cursor for CountingCursor {
    fn load(&self) -> vouch_engine::Result<Option<u64>> {
        Ok(None)
    }
    fn save(&self, lba: u64) -> vouch_engine::Result<()> {
        self.saves.lock().expect("lock").push(lba);
        Ok(())
    }
    fn clear(&self) -> vouch_engine::Result<()> {
        self.cleared
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

#[test]
fn a_scan_saves_its_cursor_once_a_second_and_when_cancelled_not_every_chunk() {
    let volume = volume_with_data(&[0, 1, 2, 3, 4, 5, 6, 7]);
    let cursor = CountingCursor::default();
    let control = JobControl::default();
    let started = std::time::Instant::now();
    scan(
        &volume,
        ScanOptions::default(),
        &control,
        Some(&cursor),
        |_| Ok(()),
    )
    .expect("scan");
    assert!(cursor.cleared.load(std::sync::atomic::Ordering::Relaxed));
    if started.elapsed() < vouch_engine::jobs::CURSOR_SAVE_INTERVAL {
        assert_eq!(
            *cursor.saves.lock().expect("lock"),
            Vec::<u64>::new(),
            "8 chunks in under a second: no fsync"
        );
    }

    // Throttled to 4 chunks a second: about one save a second, and one at the cancel.
    let cursor = CountingCursor::default();
    let control = JobControl::default();
    let options = ScanOptions {
        rate_bytes_per_second: Some(4 << 20),
        ..ScanOptions::default()
    };
    let mut chunks = 0;
    let end = scan(&volume, options, &control, Some(&cursor), |_| {
        chunks += 1;
        if chunks == 6 {
            control.cancel();
        }
        Ok(())
    })
    .expect("scan");
    assert_eq!(end, ScanEnd::Cancelled { at: 6 * 256 });
    let saves = cursor.saves.lock().expect("lock").clone();
    assert_eq!(
        saves.last(),
        Some(&(6 * 256)),
        "saved at the cancel: {saves:?}"
    );
    assert!(saves.len() <= 3, "{saves:?}");
    assert!(!cursor.cleared.load(std::sync::atomic::Ordering::Relaxed));
}
