//! Engine bugs found by the simulator and fuzz bodies, as the smallest
//! failing cases. Each was a panic or a contract violation before its fix.

use std::sync::Arc;

use vouch_engine::read_superblock;
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
