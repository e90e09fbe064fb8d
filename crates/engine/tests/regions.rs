//! The region layer (`vouch_engine::regions`) through the engine's API:
//! what a migration does with a member's reply it cannot trust.

mod common;

use common::pattern;
use vouch_engine::regions::{self, MigrateBreaks, RegionVolume};
use vouch_engine::{create_volume, BlockDevice, CreateOptions, LayoutKind, OpenOptions, BLOCK};

const BLOCKS: u64 = 512;

/// The review of migrate33, L1: a block-status reply that covers less
/// than the chunk asked about stops the migration; the rest of the chunk
/// is never taken for holes (it would be left behind, then trimmed from
/// the old member, and read as zeros).
#[test]
fn a_short_block_status_reply_stops_the_migration_never_read_as_holes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("volume");
    let mut options = CreateOptions::new(BLOCKS * BLOCK);
    options.layout = LayoutKind::Split;
    let volume = create_volume(&path, &options).expect("create");
    let data: Vec<u8> = (0..BLOCKS).flat_map(|lba| pattern(lba, 7)).collect();
    volume.write(0, &data, false).expect("write");
    volume.close().expect("close");

    let breaks = MigrateBreaks {
        short_status: true,
        ..MigrateBreaks::default()
    };
    let error = regions::migrate(
        &path,
        LayoutKind::Packed,
        &OpenOptions::default(),
        &breaks,
        |_, _| {},
    )
    .expect_err("a short reply: stopped");
    assert!(error.to_string().contains("short reply"), "{error}");

    // Every block still reads back from the member serving it.
    let volume = RegionVolume::open(&path, &OpenOptions::default()).expect("open");
    let mut back = vec![0u8; data.len()];
    volume.read(0, &mut back).expect("read");
    assert!(back == data, "a block changed or reads as zeros");
    assert_eq!(
        volume.record().counts(),
        [1, 0],
        "the region was not switched"
    );
    volume.close().expect("close");
}
