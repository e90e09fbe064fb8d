//! `BlockDevice::try_read` / `try_write` (issue 11's inline NBD path): a
//! read that would have to wait for the device declines with nothing
//! counted, a warm one returns the very bytes (and holes) the blocking read
//! returns, a corrupt block is left to the blocking read to report with its
//! LBA, a write declines when it would wait for a commit, and reads racing
//! writes see whole, ever newer blocks.

mod common;

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{corrupt_data, data_offset, open, pattern, read_range, try_write, volume_dir};
use rand::{rngs::StdRng, Rng, SeedableRng};
use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, DeviceWrites, Error, Fault, FaultKind,
    LayoutKind, OpenOptions, Tuning, BLOCK,
};

const LAYOUTS: [LayoutKind; 2] = [LayoutKind::Split, LayoutKind::Packed];
/// The blocks `volume_dir` writes.
const WRITTEN: std::ops::Range<u64> = 0..64;

/// Drop `data.00000` from the page cache (it is clean: the volume is
/// committed), so reading it would have to wait for the disk. DONTNEED is
/// advice: on a busy machine a page can survive it, so evict until
/// mincore(2) shows none of the file resident (or give up loudly).
fn evict_data(path: &Path) {
    let file = std::fs::File::open(path.join("data.00000")).expect("open data segment");
    file.sync_all().expect("sync data segment");
    let len = file.metadata().expect("stat").len() as usize;
    for _ in 0..50 {
        // SAFETY: plain syscall on a descriptor `file` keeps open.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0, "posix_fadvise(DONTNEED)");
        if resident_pages(&file, len) == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("data.00000 stays in the page cache after 50 evictions");
}

/// Pages of the first `len` bytes of `file` in the page cache (mincore).
fn resident_pages(file: &std::fs::File, len: usize) -> usize {
    // SAFETY: a read-only shared mapping of an open file, unmapped below;
    // mincore writes one byte per page into a vector of that many bytes.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED, "mmap");
        let mut pages = vec![0u8; len.div_ceil(4096)];
        let rc = libc::mincore(map, len, pages.as_mut_ptr());
        libc::munmap(map, len);
        assert_eq!(rc, 0, "mincore");
        pages.iter().filter(|p| **p & 1 == 1).count()
    }
}

#[test]
fn a_cold_read_declines_and_a_warm_one_returns_the_verified_bytes() {
    for layout in LAYOUTS {
        let (_dir, path) = volume_dir(layout, std::slice::from_ref(&WRITTEN));
        let volume = open(&path);
        // Loads the context pages (split) and the data into the page cache.
        let expected = read_range(&volume, 0, 72);
        let written: Vec<u8> = (0..64).flat_map(|lba| pattern(lba, 1)).collect();
        assert_eq!(expected[..written.len()], written[..], "{layout:?}");

        // A read of an evicted file declines. The kernel starts readahead
        // for the declined read, and on a fast disk that can finish before
        // it looks again: then the read has not waited and may complete,
        // with the right bytes. Evict and try again until it declines
        // (on a loaded machine the reader can lose that race many times in
        // a row: 20 tries once all did, so 200).
        let mut buf = vec![0u8; 16 * BLOCK as usize];
        let mut declined = false;
        for _ in 0..200 {
            evict_data(&path);
            let before = volume.stats().snapshot();
            match volume.try_read(8 * BLOCK, &mut buf).expect("try_read") {
                None => {
                    assert_eq!(
                        volume.stats().snapshot(),
                        before,
                        "{layout:?}: declining counts nothing"
                    );
                    declined = true;
                    break;
                }
                Some(holes) => {
                    assert!(holes.is_empty(), "{layout:?}: {holes:?}");
                    assert_eq!(
                        buf[..],
                        expected[8 * BLOCK as usize..24 * BLOCK as usize],
                        "{layout:?}: a read that completed has the verified bytes"
                    );
                }
            }
        }
        assert!(
            declined,
            "{layout:?}: a read of an evicted file must decline"
        );

        // The blocking read brings it back; now it completes without waiting.
        let blocking = read_range(&volume, 8, 16);
        assert_eq!(
            blocking[..],
            expected[8 * BLOCK as usize..24 * BLOCK as usize]
        );
        let warm = volume.try_read(8 * BLOCK, &mut buf).expect("try_read");
        assert_eq!(warm, Some(Vec::new()), "{layout:?}: a warm read completes");
        assert_eq!(buf, blocking, "{layout:?}: the same verified bytes");

        // A range ending in never-written blocks: same bytes and holes.
        let mut both = vec![0u8; 16 * BLOCK as usize];
        let holes = volume.read(56 * BLOCK, &mut both).expect("read");
        let mut fast = vec![0xAAu8; 16 * BLOCK as usize];
        let fast_holes = volume.try_read(56 * BLOCK, &mut fast).expect("try_read");
        assert_eq!(fast_holes, Some(holes), "{layout:?}: the same holes");
        assert_eq!(fast, both, "{layout:?}: unwritten blocks read as zeros");

        // Part of a block is left to the blocking read.
        let mut part = vec![0u8; 512];
        assert!(volume
            .try_read(8 * BLOCK, &mut part)
            .expect("try_read")
            .is_none());
    }
}

#[test]
fn a_corrupt_block_declines_and_the_blocking_read_names_its_lba() {
    for layout in LAYOUTS {
        let (_dir, path) = volume_dir(layout, std::slice::from_ref(&WRITTEN));
        corrupt_data(&path, 10);
        let offset = data_offset(&path, 10);
        let volume = open(&path);
        read_range(&volume, 0, 8);
        // The corrupt block's bytes are in the page cache (it was just
        // rewritten), so the inline read gets as far as verifying them.
        let data = std::fs::read(path.join("data.00000")).expect("read data segment");
        assert!(data.len() as u64 > offset);

        let before = volume.stats().snapshot();
        let mut buf = vec![0u8; 4 * BLOCK as usize];
        let inline = volume.try_read(8 * BLOCK, &mut buf).expect("try_read");
        assert!(inline.is_none(), "{layout:?}: a fault is not judged inline");
        assert_eq!(
            volume.stats().snapshot(),
            before,
            "{layout:?}: nothing counted"
        );

        let error = volume
            .read(8 * BLOCK, &mut buf)
            .expect_err("the block is corrupt");
        assert!(
            matches!(
                error,
                Error::Fault(Fault {
                    lba: 10,
                    kind: FaultKind::GuardMismatch
                })
            ),
            "{layout:?}: {error}"
        );
        assert_eq!(
            volume
                .stats()
                .snapshot()
                .faults_of(FaultKind::GuardMismatch),
            1
        );
    }
}

/// The tag `pattern(lba, tag)` was written with, if `block` is one.
fn tag_of(lba: u64, block: &[u8]) -> Option<u8> {
    let tag = block[0].wrapping_sub((lba as u8).wrapping_mul(31));
    (block == pattern(lba, tag)).then_some(tag)
}

#[test]
fn reads_racing_writes_and_commits_see_whole_ever_newer_blocks() {
    const BLOCKS: u64 = 256;
    for layout in LAYOUTS {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vol");
        let mut create = CreateOptions::new(4 << 20);
        create.layout = layout;
        create_volume(&path, &create)
            .expect("create")
            .close()
            .expect("close");
        let options = OpenOptions {
            tuning: Tuning {
                dirty_limit_blocks: 16,
                context_cache_pages: 2,
                overlay_limit: 64,
                background_commit: true,
                prompt_commits: true,
            },
            ..OpenOptions::default()
        };
        let volume = open_volume(&path, &options).expect("open");
        let initial: Vec<u8> = (0..BLOCKS).flat_map(|lba| pattern(lba, 1)).collect();
        volume.write(0, &initial, false).expect("write");
        volume.flush().expect("flush");

        let done = AtomicBool::new(false);
        let inline_reads = std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut rng = StdRng::seed_from_u64(11);
                for tag in 2..=200u8 {
                    for _ in 0..8 {
                        let lba = rng.gen_range(0..BLOCKS - 2);
                        let data: Vec<u8> = (lba..lba + 2).flat_map(|l| pattern(l, tag)).collect();
                        if !try_write(&volume, lba * BLOCK, &data).expect("try_write") {
                            volume.write(lba * BLOCK, &data, false).expect("write");
                        }
                    }
                }
                done.store(true, Ordering::Release);
            });
            let mut rng = StdRng::seed_from_u64(12);
            let mut seen = vec![1u8; BLOCKS as usize];
            let mut inline_reads = 0u64;
            while !done.load(Ordering::Acquire) {
                let lba = rng.gen_range(0..BLOCKS - 4);
                let mut buf = vec![0u8; 4 * BLOCK as usize];
                if volume
                    .try_read(lba * BLOCK, &mut buf)
                    .expect("try_read")
                    .is_some()
                {
                    inline_reads += 1;
                } else {
                    volume.read(lba * BLOCK, &mut buf).expect("read");
                }
                for (index, block) in buf.chunks(BLOCK as usize).enumerate() {
                    let at = lba + index as u64;
                    let tag = tag_of(at, block)
                        .unwrap_or_else(|| panic!("{layout:?}: LBA {at} is not a whole block"));
                    assert!(
                        tag >= seen[at as usize],
                        "{layout:?}: LBA {at} went back from tag {} to {tag}",
                        seen[at as usize]
                    );
                    seen[at as usize] = tag;
                }
            }
            inline_reads
        });
        assert!(inline_reads > 0, "{layout:?}: some reads completed inline");
        volume.close().expect("close");
    }
}

#[test]
fn a_write_declines_when_it_would_wait_and_is_kept_when_it_does_not() {
    for layout in LAYOUTS {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vol");
        let mut create = CreateOptions::new(4 << 20);
        create.layout = layout;
        create_volume(&path, &create)
            .expect("create")
            .close()
            .expect("close");
        let tuning = Tuning {
            dirty_limit_blocks: 16,
            context_cache_pages: 2,
            overlay_limit: 64,
            background_commit: true,
            prompt_commits: true,
        };
        let open_with = |tuning: Tuning| {
            open_volume(
                &path,
                &OpenOptions {
                    tuning,
                    ..OpenOptions::default()
                },
            )
            .expect("open")
        };

        // No background committer: the writer would commit itself.
        let volume = open_with(Tuning {
            background_commit: false,
            ..tuning
        });
        let block = pattern(3, 7);
        assert!(!try_write(&volume, 3 * BLOCK, &block).expect("try_write"));
        volume.close().expect("close");

        let volume = open_with(tuning);
        let before = volume.stats().snapshot();
        // Part of a block needs a read-modify-write; twice the buffer limit
        // would make the writer commit itself.
        assert!(!try_write(&volume, 3 * BLOCK, &block[..512]).expect("try_write"));
        let too_many: Vec<u8> = (0..32).flat_map(|lba| pattern(lba, 7)).collect();
        assert!(!try_write(&volume, 0, &too_many).expect("try_write"));
        assert_eq!(
            volume.stats().snapshot(),
            before,
            "{layout:?}: nothing done"
        );
        assert_eq!(read_range(&volume, 0, 32), vec![0u8; 32 * BLOCK as usize]);

        let written: Vec<u8> = (0..8).flat_map(|lba| pattern(lba, 7)).collect();
        assert!(
            try_write(&volume, 0, &written).expect("try_write"),
            "{layout:?}"
        );
        assert_eq!(read_range(&volume, 0, 8), written, "{layout:?}");
        volume.flush().expect("flush");
        volume.close().expect("close");
        let volume = open_with(tuning);
        assert_eq!(
            read_range(&volume, 0, 8),
            written,
            "{layout:?}: durable after flush"
        );
        volume.close().expect("close");
    }
}
