//! Random operation sequences against an in-memory model, for both layouts
//! and every guard, including clean reopen and crash after flush.

use std::sync::Arc;
use vouch_engine::DeviceWrites;

use proptest::prelude::*;
use vouch_engine::BlockDevice;
use vouch_engine::ZeroFlags;
use vouch_engine::{
    CreateOptions, GuardKind, LayoutKind, OpenOptions, SimStorage, Storage, Tuning, Volume,
};

const BLOCKS: u64 = 70;
const SIZE: u64 = BLOCKS * 4096;

#[derive(Clone, Debug)]
enum Op {
    Write {
        sector: u64,
        sectors: u64,
        byte: u8,
        fua: bool,
    },
    Read {
        sector: u64,
        sectors: u64,
    },
    Trim {
        sector: u64,
        sectors: u64,
    },
    Zero {
        sector: u64,
        sectors: u64,
        allocate: bool,
    },
    Flush,
    Reopen,
    CrashAfterFlush,
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    let sectors = SIZE / 512;
    (0..sectors).prop_flat_map(move |start| (Just(start), 1..=(sectors - start).min(80)))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (range(), any::<u8>(), any::<bool>()).prop_map(|((sector, sectors), byte, fua)| Op::Write { sector, sectors, byte, fua }),
        4 => range().prop_map(|(sector, sectors)| Op::Read { sector, sectors }),
        1 => range().prop_map(|(sector, sectors)| Op::Trim { sector, sectors }),
        1 => (range(), any::<bool>()).prop_map(|((sector, sectors), allocate)| Op::Zero { sector, sectors, allocate }),
        1 => Just(Op::Flush),
        1 => Just(Op::Reopen),
        1 => Just(Op::CrashAfterFlush),
    ]
}

fn tuning() -> Tuning {
    // Tiny limits so commits, checkpoints and cache eviction all happen.
    Tuning {
        dirty_limit_blocks: 8,
        context_cache_pages: 1,
        overlay_limit: 16,
        background_commit: true,
        prompt_commits: true,
    }
}

fn open(storage: &SimStorage) -> Volume {
    let options = OpenOptions {
        read_only: false,
        direct: false,
        tuning: tuning(),
        key: None,
        keyless: false,
        rebuild_written_map: false,
        region_member: false,
        schedule: None,
    };
    Volume::open(Arc::new(storage.clone()) as Arc<dyn Storage>, &options).expect("open")
}

fn run(layout: LayoutKind, guard: GuardKind, ops: &[Op]) {
    let mut storage = SimStorage::new();
    let mut options = CreateOptions::new(SIZE);
    options.layout = layout;
    options.guard = guard;
    options.journal_bytes = Some(1 << 20);
    options.segment_blocks = Some(if layout == LayoutKind::Packed { 62 } else { 16 });
    Volume::create(Arc::new(storage.clone()), &options)
        .expect("create")
        .close()
        .expect("close");
    let mut volume = open(&storage);
    let mut model = vec![0u8; SIZE as usize];
    for op in ops {
        match *op {
            Op::Write {
                sector,
                sectors,
                byte,
                fua,
            } => {
                let data: Vec<u8> = (0..sectors * 512)
                    .map(|i| byte.wrapping_add((i / 512) as u8))
                    .collect();
                volume.write(sector * 512, &data, fua).expect("write");
                model[(sector * 512) as usize..((sector + sectors) * 512) as usize]
                    .copy_from_slice(&data);
            }
            Op::Read { sector, sectors } => {
                let mut buf = vec![0xEEu8; (sectors * 512) as usize];
                let holes = volume.read(sector * 512, &mut buf).expect("read");
                let want = &model[(sector * 512) as usize..((sector + sectors) * 512) as usize];
                assert!(buf == want, "read {sector}+{sectors} differs from model");
                for hole in holes {
                    assert!(
                        buf[hole.start as usize..hole.end as usize]
                            .iter()
                            .all(|b| *b == 0),
                        "hole not zero"
                    );
                }
            }
            Op::Trim { sector, sectors } => {
                volume
                    .trim(sector * 512, sectors * 512, false)
                    .expect("trim");
                model[(sector * 512) as usize..((sector + sectors) * 512) as usize].fill(0);
            }
            Op::Zero {
                sector,
                sectors,
                allocate,
            } => {
                volume
                    .write_zeroes(
                        sector * 512,
                        sectors * 512,
                        ZeroFlags {
                            fua: false,
                            allocate,
                        },
                    )
                    .expect("zero");
                model[(sector * 512) as usize..((sector + sectors) * 512) as usize].fill(0);
            }
            Op::Flush => volume.flush().expect("flush"),
            Op::Reopen => {
                volume.close().expect("close");
                volume = open(&storage);
            }
            Op::CrashAfterFlush => {
                volume.flush().expect("flush");
                // Power loss: only what was synced survives.
                let image = storage.crash_image(|_, _, _| 0);
                drop(volume);
                storage = image;
                volume = open(&storage);
            }
        }
    }
    let mut all = vec![0u8; SIZE as usize];
    volume.read(0, &mut all).expect("final read");
    assert!(all == model, "final contents differ from model");
    let report = volume.check(|_, _| {}).expect("check");
    assert!(
        report.faults.is_empty(),
        "check found faults: {:?}",
        report.faults
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn split_matches_model(guard in prop::sample::select(GuardKind::ALL.to_vec()), ops in prop::collection::vec(op(), 1..60)) {
        run(LayoutKind::Split, guard, &ops);
    }

    #[test]
    fn packed_matches_model(guard in prop::sample::select(GuardKind::ALL.to_vec()), ops in prop::collection::vec(op(), 1..60)) {
        run(LayoutKind::Packed, guard, &ops);
    }
}

/// A trim covering a whole cached context page, then a write into that
/// page, then a checkpoint: the checkpoint must not write the page's stale
/// pre-trim cached copy back (found by the serve crash tests).
#[test]
fn trim_of_a_cached_context_page_then_write_survives_checkpoint() {
    let storage = SimStorage::new();
    let mut options = CreateOptions::new(512 * 4096);
    options.journal_bytes = Some(1 << 20);
    let volume =
        Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options).expect("create");
    volume
        .write(0, &vec![0x5Au8; 256 * 4096], false)
        .expect("write");
    volume.close().expect("close");
    let volume = Volume::open(
        Arc::new(storage.clone()) as Arc<dyn Storage>,
        &OpenOptions::default(),
    )
    .expect("open");
    let mut buf = vec![0u8; 4096];
    volume
        .read(0, &mut buf)
        .expect("read caches context page 0");
    volume
        .trim(0, 128 * 4096, false)
        .expect("trim page 0's blocks");
    volume
        .write(5 * 4096, &[0xC3u8; 4096], false)
        .expect("write into the trimmed page");
    volume.close().expect("close: checkpoint");
    let volume = Volume::open(
        Arc::new(storage) as Arc<dyn Storage>,
        &OpenOptions::default(),
    )
    .expect("reopen");
    let mut all = vec![0u8; 256 * 4096];
    volume
        .read(0, &mut all)
        .expect("no faults after the checkpoint");
    for block in 0..256usize {
        let want = match block {
            5 => 0xC3,
            0..=127 => 0,
            _ => 0x5A,
        };
        assert!(
            all[block * 4096..(block + 1) * 4096]
                .iter()
                .all(|b| *b == want),
            "block {block}"
        );
    }
    assert!(volume.check(|_, _| {}).expect("check").faults.is_empty());
}

/// Checkpoints of whole and partial context pages: a page whose 128
/// contexts are all new is built without reading its old copy; a page
/// with some new contexts keeps the others; a trimmed range's edge page
/// that then gets a full page of writes keeps all of them. Each state is
/// checkpointed (close) and reopened, every block read back and checked.
#[test]
fn checkpoints_of_whole_and_partial_context_pages_keep_every_context() {
    let storage = SimStorage::new();
    let blocks = 5 * 128 + 17;
    let mut options = CreateOptions::new(blocks * 4096);
    options.journal_bytes = Some(4 << 20);
    let open = || {
        Volume::open(
            Arc::new(storage.clone()) as Arc<dyn Storage>,
            &OpenOptions::default(),
        )
        .expect("open")
    };
    let volume =
        Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options).expect("create");
    let mut model = vec![0u8; (blocks * 4096) as usize];
    let write = |volume: &Volume, model: &mut [u8], first: u64, count: u64, seed: u8| {
        let data: Vec<u8> = (0..count * 4096)
            .map(|i| (i / 4096) as u8 ^ seed ^ (i % 251) as u8)
            .collect();
        volume.write(first * 4096, &data, false).expect("write");
        model[(first * 4096) as usize..((first + count) * 4096) as usize].copy_from_slice(&data);
    };
    let check = |volume: &Volume, model: &[u8], what: &str| {
        let mut all = vec![0u8; model.len()];
        volume.read(0, &mut all).expect("read after reopen");
        for block in 0..blocks as usize {
            assert!(
                all[block * 4096..(block + 1) * 4096] == model[block * 4096..(block + 1) * 4096],
                "{what}: block {block}"
            );
        }
        assert!(volume.check(|_, _| {}).expect("check").faults.is_empty());
    };
    // Every page whole (the last partly), checkpointed.
    write(&volume, &mut model, 0, blocks, 1);
    volume.close().expect("close");
    let volume = open();
    check(&volume, &model, "all written");
    // Page 1 whole again over its old contexts; a few blocks of page 3.
    write(&volume, &mut model, 128, 128, 2);
    write(&volume, &mut model, 3 * 128 + 5, 9, 3);
    volume.close().expect("close");
    let volume = open();
    check(&volume, &model, "page 1 rewritten whole, page 3 in part");
    // A trim from inside page 2 into page 4, then page 2 written whole.
    volume
        .trim(
            (2 * 128 + 60) * 4096,
            (4 * 128 + 40 - (2 * 128 + 60)) * 4096,
            false,
        )
        .expect("trim");
    model[((2 * 128 + 60) * 4096) as usize..((4 * 128 + 40) * 4096) as usize].fill(0);
    write(&volume, &mut model, 2 * 128, 128, 4);
    volume.close().expect("close");
    let volume = open();
    check(
        &volume,
        &model,
        "trim across pages, then an edge page written whole",
    );
}

/// A checkpoint that writes more context pages than the cache holds keeps
/// the content of the last ones only; a page it wrote without keeping must
/// still leave the cache, since a reader may have cached its old content
/// while the overlay served the new contexts: here page 0 is cached after
/// a block on it was written, and that block read after the checkpoint.
#[test]
fn a_checkpoint_drops_stale_cached_copies_of_pages_it_does_not_keep() {
    let storage = SimStorage::new();
    let blocks = 24 * 128;
    let mut options = CreateOptions::new(blocks * 4096);
    options.journal_bytes = Some(4 << 20);
    // Old contents in blocks 0 and 5 of every page, checkpointed.
    let volume =
        Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options).expect("create");
    for page in 0..21u64 {
        for block in [0, 5] {
            let at = (page * 128 + block) * 4096;
            volume.write(at, &[0x11; 4096], false).expect("old");
        }
    }
    volume.close().expect("close");
    let volume = Volume::open(
        Arc::new(storage) as Arc<dyn Storage>,
        &OpenOptions {
            tuning: Tuning {
                dirty_limit_blocks: 64,
                context_cache_pages: 16,
                overlay_limit: 20,
                background_commit: false,
                prompt_commits: true,
            },
            ..OpenOptions::default()
        },
    )
    .expect("open");
    let block_of_page = |page: u64, fill: u8| (page * 128 * 4096, vec![fill; 4096]);
    // One block in each of pages 0..11, committed: 11 overlay entries.
    for page in 0..11 {
        let (at, data) = block_of_page(page, 0x40 + page as u8);
        volume.write(at, &data, false).expect("write");
    }
    volume.flush().expect("flush");
    // Block 5 of pages 5 to 19, then of page 0: their pages are loaded and
    // cached, page 0's old (block 0's new context is in the overlay) and
    // last in the cache's FIFO.
    let mut buf = vec![0u8; 4096];
    for page in (5..20).chain([0]) {
        volume
            .read((page * 128 + 5) * 4096, &mut buf)
            .expect("read caches the page");
    }
    // Ten more pages: 21 entries > 20, a checkpoint of 21 pages, the last
    // 16 (pages 5 to 20) kept: all but page 20 replace cached copies in
    // place, so caching them evicts only the FIFO's front, not page 0.
    for page in 11..21 {
        let (at, data) = block_of_page(page, 0x40 + page as u8);
        volume.write(at, &data, false).expect("write");
    }
    volume.flush().expect("flush: checkpoint");
    for page in 0..21 {
        let (at, data) = block_of_page(page, 0x40 + page as u8);
        volume
            .read(at, &mut buf)
            .unwrap_or_else(|e| panic!("page {page}'s block after the checkpoint: {e}"));
        assert!(buf == data, "page {page}'s block reads other bytes");
    }
}
