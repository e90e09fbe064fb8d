//! Many threads against one volume while commits and checkpoints run all the
//! time (tiny limits): no false faults, no lost sub-block writes.

use std::sync::Arc;
use std::thread;
use vouch_engine::DeviceWrites;

use vouch_engine::BlockDevice;
use vouch_engine::{CreateOptions, LayoutKind, OpenOptions, SimStorage, Storage, Tuning, Volume};

const THREADS: u64 = 6;
const BLOCKS_PER_THREAD: u64 = 40;

fn stress(layout: LayoutKind) {
    let storage = SimStorage::new();
    let mut options = CreateOptions::new(THREADS * BLOCKS_PER_THREAD * 4096);
    options.layout = layout;
    options.journal_bytes = Some(1 << 20);
    Volume::create(Arc::new(storage.clone()) as Arc<dyn Storage>, &options)
        .expect("create")
        .close()
        .expect("close");
    let tuning = Tuning {
        dirty_limit_blocks: 4,
        context_cache_pages: 1,
        overlay_limit: 8,
        background_commit: true,
        prompt_commits: true,
    };
    let volume = Arc::new(
        Volume::open(
            Arc::new(storage.clone()) as Arc<dyn Storage>,
            &OpenOptions {
                read_only: false,
                direct: false,
                tuning,
                key: None,
                keyless: false,
                rebuild_written_map: false,
                region_member: false,
                schedule: None,
            },
        )
        .expect("open"),
    );
    let workers: Vec<_> = (0..THREADS)
        .map(|thread_index| {
            let volume = volume.clone();
            thread::spawn(move || {
                let base = thread_index * BLOCKS_PER_THREAD;
                let mut model = vec![0u8; (BLOCKS_PER_THREAD * 4096) as usize];
                let mut state = thread_index.wrapping_mul(0x9E37_79B9) | 1;
                for round in 0..1500u64 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let block = state % BLOCKS_PER_THREAD;
                    let offset = (base + block) * 4096;
                    let local = (block * 4096) as usize;
                    match round % 7 {
                        0..=2 => {
                            let data = vec![(round as u8) ^ (thread_index as u8) | 1; 4096];
                            volume.write(offset, &data, round % 11 == 0).expect("write");
                            model[local..local + 4096].copy_from_slice(&data);
                        }
                        3 => {
                            let sector = (state >> 20) % 8;
                            let data = vec![0xA0 | (round as u8 & 0x0F); 512];
                            volume
                                .write(offset + sector * 512, &data, false)
                                .expect("sub-block write");
                            let at = local + (sector * 512) as usize;
                            model[at..at + 512].copy_from_slice(&data);
                        }
                        4 => {
                            volume.trim(offset, 4096, false).expect("trim");
                            model[local..local + 4096].fill(0);
                        }
                        5 => volume.flush().expect("flush"),
                        _ => {}
                    }
                    let mut buf = vec![0u8; 4096];
                    volume
                        .read(offset, &mut buf)
                        .expect("no false faults under concurrency");
                    assert!(
                        buf == model[local..local + 4096],
                        "thread {thread_index} block {block} round {round}"
                    );
                }
                let mut all = vec![0u8; model.len()];
                volume.read(base * 4096, &mut all).expect("read all");
                assert!(all == model, "thread {thread_index} final contents");
            })
        })
        .collect();
    // A scanner reads every block while the workers write, trim and
    // checkpoint: whatever it sees, a read must never fail.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scanner = {
        let (volume, done) = (volume.clone(), done.clone());
        thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            let mut scans = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) || scans == 0 {
                for block in 0..THREADS * BLOCKS_PER_THREAD {
                    volume
                        .read(block * 4096, &mut buf)
                        .expect("a concurrent read reported a false fault");
                }
                scans += 1;
            }
        })
    };
    for worker in workers {
        worker.join().expect("worker");
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    scanner.join().expect("scanner");
    assert!(
        volume.stats().snapshot().checkpoints > 10,
        "checkpoints must have raced the readers"
    );
}

/// Two threads write alternate 512-byte sectors of the same blocks.
fn same_block_sub_writes(layout: LayoutKind) {
    let storage = SimStorage::new();
    let mut options = CreateOptions::new(64 * 4096);
    options.layout = layout;
    options.journal_bytes = Some(1 << 20);
    let volume =
        Arc::new(Volume::create(Arc::new(storage) as Arc<dyn Storage>, &options).expect("create"));
    let workers: Vec<_> = (0..2u64)
        .map(|half| {
            let volume = volume.clone();
            thread::spawn(move || {
                for block in 0..64u64 {
                    for sector in (half..8).step_by(2) {
                        let data = vec![(block as u8) ^ (sector as u8) ^ 0x80; 512];
                        volume
                            .write(block * 4096 + sector * 512, &data, false)
                            .expect("write");
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker");
    }
    for block in 0..64u64 {
        let mut buf = vec![0u8; 4096];
        volume.read(block * 4096, &mut buf).expect("read");
        for sector in 0..8u64 {
            let want = (block as u8) ^ (sector as u8) ^ 0x80;
            assert!(
                buf[(sector * 512) as usize..((sector + 1) * 512) as usize]
                    .iter()
                    .all(|b| *b == want),
                "block {block} sector {sector} lost"
            );
        }
    }
}

#[test]
fn split_under_concurrency() {
    stress(LayoutKind::Split);
    same_block_sub_writes(LayoutKind::Split);
}

#[test]
fn packed_under_concurrency() {
    stress(LayoutKind::Packed);
    same_block_sub_writes(LayoutKind::Packed);
}
