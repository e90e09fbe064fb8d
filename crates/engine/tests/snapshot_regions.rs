//! An online snapshot of a volume with regions (`RegionVolume` as a
//! `snapshot::FlushPoint`): both members held at one flush point while
//! they and the record are cloned, writes acknowledged before it in the
//! snapshot, writes after it not, the served volume going on.

mod common;

use common::pattern;
use vouch_engine::regions::{self, MigrateBreaks, RegionVolume};
use vouch_engine::snapshot::{self, RealFs, SnapshotBreaks};
use vouch_engine::{create_volume, BlockDevice, CreateOptions, LayoutKind, OpenOptions, BLOCK};

const BLOCKS: u64 = 512;

#[test]
fn an_online_snapshot_of_a_volume_with_regions_holds_what_was_written_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("volume");
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = LayoutKind::Split;
    options.journal_bytes = Some(1 << 20);
    let volume = create_volume(&path, &options).expect("create");
    let data: Vec<u8> = (0..BLOCKS).flat_map(|lba| pattern(lba, 7)).collect();
    volume.write(0, &data, false).expect("write");
    volume.close().expect("close");
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
    let snap = RegionVolume::open(&taken.path, &OpenOptions::default()).expect("open it");
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

    let mut now = vec![0u8; (BLOCKS * BLOCK) as usize];
    volume.read(0, &mut now).expect("read the volume");
    want[(100 * BLOCK) as usize..(116 * BLOCK) as usize].copy_from_slice(&after);
    assert!(now == want, "the served volume lost a write");
    volume.close().expect("close");
}
