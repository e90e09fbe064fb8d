//! An online snapshot of a volume with regions (`RegionVolume` as a
//! `snapshot::FlushPoint`): both members held at one flush point while
//! they and the record are cloned, writes acknowledged before it in the
//! snapshot, writes after it not, the served volume going on.

mod common;

use common::pattern;
use vouch_engine::regions::{self, MigrateBreaks, RegionVolume};
use vouch_engine::snapshot::{self, RealFs, SnapshotBreaks};
use vouch_engine::DeviceWrites;
use vouch_engine::{create_volume, BlockDevice, CreateOptions, LayoutKind, OpenOptions, BLOCK};

const BLOCKS: u64 = 512;

/// A split volume of `BLOCKS` blocks at `dir/volume`, `pattern(lba, tag)`
/// in every block, closed; and its data.
fn split_volume(dir: &std::path::Path, tag: u8) -> (std::path::PathBuf, Vec<u8>) {
    let path = dir.join("volume");
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = LayoutKind::Split;
    options.journal_bytes = Some(1 << 20);
    let volume = create_volume(&path, &options).expect("create");
    let data: Vec<u8> = (0..BLOCKS).flat_map(|lba| pattern(lba, tag)).collect();
    volume.write(0, &data, false).expect("write");
    volume.close().expect("close");
    (path, data)
}

/// The snapshot at `path` opens read-only, its region packed, and reads
/// `want` with no fault.
fn reads_packed(path: &std::path::Path, want: &[u8]) {
    let snap = RegionVolume::open(path, &OpenOptions::default()).expect("open it");
    assert!(BlockDevice::is_read_only(&snap), "a snapshot is read-only");
    assert_eq!(snap.record().counts(), [0, 1], "its region packed");
    let mut image = vec![0u8; (BLOCKS * BLOCK) as usize];
    let faults = snap
        .read_blocks_collecting(0, BLOCKS, &mut image)
        .expect("read it");
    assert!(faults.is_empty(), "{faults:?}");
    assert!(
        image == want,
        "the snapshot is not the volume at its flush point"
    );
    snap.close().expect("close it");
}

#[test]
fn an_online_snapshot_of_a_volume_with_regions_holds_what_was_written_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, data) = split_volume(dir.path(), 7);
    regions::migrate(
        &path,
        LayoutKind::Packed,
        &OpenOptions::default(),
        &MigrateBreaks::default(),
        |_, _| {},
    )
    .expect("migrate");

    // Served: written (not flushed), snapshotted, written again.
    let volume = RegionVolume::open(&path, &OpenOptions::default()).expect("open");
    let before: Vec<u8> = (0..16).flat_map(|lba| pattern(lba, 9)).collect();
    volume.write(100 * BLOCK, &before, false).expect("write");
    let taken = snapshot::create_from(
        &RealFs::new(true),
        &path,
        "online",
        "reflink",
        SnapshotBreaks::default(),
        &volume,
    )
    .expect("an online snapshot");
    assert!(taken.record.online);
    let after: Vec<u8> = (0..16).flat_map(|lba| pattern(lba, 11)).collect();
    volume
        .write(100 * BLOCK, &after, false)
        .expect("write after");

    let mut want = data.clone();
    want[(100 * BLOCK) as usize..(116 * BLOCK) as usize].copy_from_slice(&before);
    reads_packed(&taken.path, &want);

    let mut now = vec![0u8; (BLOCKS * BLOCK) as usize];
    volume.read(0, &mut now).expect("read the volume");
    want[(100 * BLOCK) as usize..(116 * BLOCK) as usize].copy_from_slice(&after);
    assert!(now == want, "the served volume lost a write");
    volume.close().expect("close");
}

/// An online snapshot asked while a region switches members (the record
/// written, the home superblock's `regions_seq` not yet) waits for the
/// switch (`RegionVolume::pause_switches`), so the snapshot's record is the
/// one the volume serves with and its home superblock names its `seq`;
/// its data is the volume's at the flush point.
#[test]
fn an_online_snapshot_asked_mid_switch_waits_for_the_switch() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let dir = tempfile::tempdir().expect("tempdir");
    let (path, data) = split_volume(dir.path(), 5);
    let home = vouch_engine::open_volume(&path, &OpenOptions::default()).expect("open");
    let volume =
        Arc::new(regions::open_served(&path, home, &OpenOptions::default()).expect("with regions"));
    let seq = volume.record_seq();

    let taker: Arc<Mutex<Option<std::thread::JoinHandle<snapshot::Snapshot>>>> = Arc::default();
    let finished_mid_switch = Arc::new(AtomicBool::new(false));
    let hook = {
        let (volume, path, taker, finished) = (
            Arc::clone(&volume),
            path.clone(),
            Arc::clone(&taker),
            Arc::clone(&finished_mid_switch),
        );
        Box::new(move |locked: bool| {
            let mut taker = taker.lock().unwrap();
            if !locked || taker.is_some() {
                return;
            }
            // The switch's record is on disk: ask for the snapshot now.
            let superblock = vouch_engine::volume_superblock(&path).expect("superblock");
            let on_disk = regions::read_record(&path, &superblock).expect("record");
            if on_disk.seq == volume.record_seq() {
                return;
            }
            let (volume, path) = (Arc::clone(&volume), path.clone());
            let handle = std::thread::spawn(move || {
                snapshot::create_from(
                    &RealFs::new(true),
                    &path,
                    "mid-switch",
                    "reflink",
                    SnapshotBreaks::default(),
                    &*volume,
                )
                .expect("the snapshot")
            });
            // The switch stays where it is for 3 s: a snapshot not held
            // off by it finishes meanwhile (in milliseconds).
            let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
            while !handle.is_finished() && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            finished.store(handle.is_finished(), Ordering::SeqCst);
            *taker = Some(handle);
        }) as regions::StepHook
    };
    let steps = regions::Steps::with_hook(None, hook);
    let stop = AtomicBool::new(false);
    volume
        .migrate_online_driven(
            &regions::OnlineMigrate {
                target: LayoutKind::Packed,
                rate: None,
                stop: &stop,
            },
            &steps,
            regions::OnlineBreaks::default(),
            |_, _| {},
        )
        .expect("migrate");
    drop(steps);
    let taken = taker
        .lock()
        .unwrap()
        .take()
        .expect("the snapshot was asked mid-switch")
        .join()
        .expect("the snapshot's thread");
    assert!(
        !finished_mid_switch.load(Ordering::SeqCst),
        "the snapshot was taken while the region switched"
    );
    let superblock = vouch_engine::volume_superblock(&taken.path).expect("its superblock");
    let record = regions::read_record(&taken.path, &superblock).expect("its record");
    assert_eq!(
        record.seq,
        seq + 1,
        "the snapshot's record is the switched one"
    );
    assert_eq!(
        superblock.regions_seq, record.seq,
        "the snapshot's home superblock names its record"
    );
    reads_packed(&taken.path, &data);
    Arc::try_unwrap(volume)
        .map_err(|_| "shared")
        .expect("the volume")
        .close()
        .expect("close");
}
