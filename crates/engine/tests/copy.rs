//! `copy::copy` on real volume directories: pipelined and reflink methods,
//! within and between volumes, memmove on overlap, reference tags moved to
//! the new LBAs, corrupt sources refused, bad requests refused, cancel.
//! Reflink on a real btrfs is in `copy_reflink.rs`.

use std::path::Path;
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use vouch_engine::copy::{copy, CopyMethod, CopyOptions};
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, Error, FaultKind, LayoutKind,
    OpenOptions, SealedDevice, SimStorage, Volume, ZeroFlags, BLOCK,
};
use vouch_format::Context;

fn pattern(lba: u64, tag: u8) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|i| (i as u8).wrapping_mul(31) ^ (lba as u8) ^ tag.wrapping_mul(7) ^ (lba >> 8) as u8)
        .collect()
}

fn read_block(device: &dyn BlockDevice, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    device.read(lba * BLOCK, &mut buf).expect("read");
    buf
}

fn create(path: &Path, layout: LayoutKind, blocks: u64) -> Volume {
    let mut options = CreateOptions::new(blocks * BLOCK);
    options.layout = layout;
    create_volume(path, &options).expect("create")
}

fn with(method: CopyMethod) -> CopyOptions {
    CopyOptions::with(method)
}

/// Blocks `first..first + count` written with `tag`, except every 17th
/// trimmed and every 23rd written as zeroes; half flushed home, the rest
/// left in the write-back buffer.
fn fill(volume: &Volume, first: u64, count: u64, tag: u8) -> Vec<Vec<u8>> {
    let mut expected = Vec::new();
    for lba in first..first + count {
        if lba % 17 == 0 {
            volume.trim(lba * BLOCK, BLOCK, false).expect("trim");
            expected.push(vec![0u8; BLOCK as usize]);
        } else if lba % 23 == 0 {
            let flags = ZeroFlags {
                fua: false,
                allocate: true,
            };
            volume
                .write_zeroes(lba * BLOCK, BLOCK, flags)
                .expect("zeroes");
            expected.push(vec![0u8; BLOCK as usize]);
        } else {
            let data = pattern(lba, tag);
            volume.write(lba * BLOCK, &data, false).expect("write");
            expected.push(data);
        }
        if lba == first + count / 2 {
            volume.flush().expect("flush");
        }
    }
    expected
}

fn assert_blocks(volume: &Volume, first: u64, expected: &[Vec<u8>], what: &str) {
    for (index, data) in expected.iter().enumerate() {
        let lba = first + index as u64;
        assert!(
            read_block(volume, lba) == *data,
            "{what}: LBA {lba} differs"
        );
    }
}

#[test]
fn copies_within_and_between_volumes_read_back_byte_exact() {
    for layout in LayoutKind::ALL {
        for method in [CopyMethod::Pipelined, CopyMethod::Auto] {
            let dir = tempfile::tempdir().expect("tempdir");
            let (a_path, b_path) = (dir.path().join("a"), dir.path().join("b"));
            let a = create(&a_path, layout, 2048);
            let b = create(&b_path, layout, 2048);
            let expected = fill(&a, 10, 700, 1);
            // Old destination contents, some of them still buffered.
            fill(&b, 0, 900, 2);
            let control = JobControl::default();
            let report = copy(&a, 10, &b, 150, 700, &with(method), &control).expect("copy");
            // /tmp is not a filesystem that shares extents here.
            assert_eq!(
                report.method,
                CopyMethod::Pipelined,
                "{layout:?} {method:?}"
            );
            assert_eq!(report.blocks, 700);
            assert_eq!(control.progress(), (700, 700));
            let within = copy(&a, 10, &a, 1000, 700, &with(method), &control).expect("copy");
            assert_eq!(within.blocks, 700);
            assert_blocks(&b, 150, &expected, "between");
            assert_blocks(&a, 1000, &expected, "within");
            assert_blocks(&a, 10, &expected, "source unchanged");
            // Untouched neighbours keep their contents.
            assert!(read_block(&b, 149) == pattern(149, 2));
            assert!(read_block(&b, 852) == pattern(852, 2));
            b.flush().expect("flush");
            a.close().expect("close");
            b.close().expect("close");
            let b = open_volume(&b_path, &OpenOptions::default()).expect("reopen");
            assert_blocks(&b, 150, &expected, "between, after reopen");
            assert!(b.check(|_, _| {}).expect("check").faults.is_empty());
        }
    }
}

#[test]
fn overlapping_copies_have_memmove_semantics() {
    let dir = tempfile::tempdir().expect("tempdir");
    for layout in LayoutKind::ALL {
        let path = dir.path().join(layout.name());
        let volume = create(&path, layout, 2048);
        // Sim-backed split volume: its storage shares "extents", so the
        // reflink method's stepping is exercised too.
        let sim_volume = {
            let mut options = CreateOptions::new(2048 * BLOCK);
            options.layout = layout;
            Volume::create(Arc::new(SimStorage::new()), &options).expect("create")
        };
        let mut cases = vec![
            (&volume, CopyMethod::Pipelined),
            (&sim_volume, CopyMethod::Pipelined),
        ];
        if layout == LayoutKind::Split {
            cases.push((&sim_volume, CopyMethod::Reflink));
        }
        for (volume, method) in cases {
            for shift in [1u64, 5, 300] {
                for forwards in [true, false] {
                    let count = 600;
                    let (from, to) = if forwards {
                        (100, 100 + shift)
                    } else {
                        (100 + shift, 100)
                    };
                    let expected = fill(volume, from, count, shift as u8);
                    let control = JobControl::default();
                    let report = copy(volume, from, volume, to, count, &with(method), &control)
                        .expect("copy");
                    assert_eq!(report.method, method);
                    let what = format!("{layout:?} {method:?} shift {shift} forwards {forwards}");
                    assert_blocks(volume, to, &expected, &what);
                }
            }
        }
    }
}

#[test]
fn a_copied_block_reads_clean_at_its_new_lba_with_its_reference_tag_remapped() {
    for layout in LayoutKind::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v");
        let volume = create(&path, layout, 1024);
        for lba in 0..8 {
            volume
                .write(lba * BLOCK, &pattern(lba, 5), false)
                .expect("write");
        }
        volume.flush().expect("flush");
        let control = JobControl::default();
        copy(
            &volume,
            0,
            &volume,
            500,
            8,
            &CopyOptions::default(),
            &control,
        )
        .expect("copy");
        volume.flush().expect("flush");
        volume.close().expect("close");
        let volume = open_volume(&path, &OpenOptions::default()).expect("reopen");
        let sealed = volume.read_sealed(500, 8).expect("read_sealed");
        for (index, block) in sealed.iter().enumerate() {
            let lba = 500 + index as u64;
            match block.context {
                Context::Data { ref_tag, .. } => assert_eq!(ref_tag, lba, "{layout:?}"),
                other => panic!("{layout:?}: LBA {lba} has context {other:?}"),
            }
            assert!(*block.data == pattern(index as u64, 5)[..]);
            assert!(read_block(&volume, lba) == pattern(index as u64, 5));
        }
        assert!(volume.check(|_, _| {}).expect("check").faults.is_empty());
    }
}

/// Flip a byte of `lba`'s stored data in the closed volume at `path`.
fn corrupt_on_disk(path: &Path, geometry: &vouch_format::Geometry, lba: u64) {
    use std::os::unix::fs::FileExt;
    let location = geometry.locate(lba);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path.join(vouch_format::Geometry::segment_name(location.segment)))
        .expect("open segment");
    let mut byte = [0u8];
    file.read_at(&mut byte, location.data_offset + 100)
        .expect("read");
    byte[0] ^= 0x40;
    file.write_at(&byte, location.data_offset + 100)
        .expect("write");
}

#[test]
fn a_corrupt_source_block_fails_the_copy_naming_it_and_is_never_copied() {
    for layout in LayoutKind::ALL {
        for method in [CopyMethod::Pipelined, CopyMethod::Auto] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("v");
            let volume = create(&path, layout, 4096);
            for lba in 0..600 {
                volume
                    .write(lba * BLOCK, &pattern(lba, 3), false)
                    .expect("write");
                volume
                    .write((2000 + lba) * BLOCK, &pattern(lba, 4), false)
                    .expect("write");
            }
            let geometry = volume.geometry();
            volume.close().expect("close");
            corrupt_on_disk(&path, &geometry, 400);
            let volume = open_volume(&path, &OpenOptions::default()).expect("open");
            let control = JobControl::default();
            let error = copy(&volume, 0, &volume, 2000, 600, &with(method), &control)
                .expect_err("a corrupt source block fails the copy");
            match &error {
                Error::Fault(fault) => {
                    assert_eq!((fault.lba, fault.kind), (400, FaultKind::GuardMismatch))
                }
                other => panic!("{layout:?} {method:?}: {other}"),
            }
            assert!(error.to_string().contains("LBA 400"), "{error}");
            // The segment holding the bad block was never written: its
            // destination blocks (and every later one) keep their contents.
            for lba in 256..600 {
                assert!(
                    read_block(&volume, 2000 + lba) == pattern(lba, 4),
                    "{layout:?} {method:?}: destination LBA {} changed",
                    2000 + lba
                );
            }
        }
    }
}

#[test]
fn bad_copy_requests_are_refused_with_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a_path, b_path) = (dir.path().join("a"), dir.path().join("b"));
    let a = create(&a_path, LayoutKind::Split, 256);
    let b = create(&b_path, LayoutKind::Split, 256);
    b.write(0, &pattern(0, 1), false).expect("write");
    b.close().expect("close");
    let control = JobControl::default();
    let options = CopyOptions::default();
    for (from, to, count) in [
        (250, 0, 10),
        (0, 250, 10),
        (1, 0, u64::MAX),
        (u64::MAX, 0, 2),
    ] {
        let error = copy(&a, from, &a, to, count, &options, &control).expect_err("out of range");
        assert!(matches!(error, Error::OutOfRange { .. }), "{error}");
        assert!(error.to_string().contains("past the end"), "{error}");
    }
    let read_only = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let b = open_volume(&b_path, &read_only).expect("open read-only");
    let error = copy(&a, 0, &b, 0, 1, &options, &control).expect_err("read-only destination");
    assert!(matches!(error, Error::ReadOnly(_)), "{error}");
    assert!(read_block(&b, 0) == pattern(0, 1));
    let error = CopyMethod::parse("fast").expect_err("unknown method");
    assert!(matches!(error, Error::InvalidArgument(_)), "{error}");
    assert!(
        error.to_string().contains("auto, reflink or pipelined"),
        "{error}"
    );
    for method in [CopyMethod::Auto, CopyMethod::Reflink, CopyMethod::Pipelined] {
        assert_eq!(CopyMethod::parse(method.name()).expect("parse"), method);
    }
}

#[test]
fn reflink_on_a_filesystem_without_it_falls_back_under_auto_and_fails_when_forced() {
    for layout in LayoutKind::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        let volume = create(&dir.path().join("v"), layout, 16384);
        volume.write(0, &pattern(0, 1), false).expect("write");
        volume.write(BLOCK, &pattern(1, 1), false).expect("write");
        let control = JobControl::default();
        let error = copy(
            &volume,
            0,
            &volume,
            100,
            2,
            &with(CopyMethod::Reflink),
            &control,
        )
        .expect_err("forced reflink on ext4 / a packed volume");
        assert!(matches!(error, Error::Unsupported(_)), "{error}");
        assert!(
            error
                .to_string()
                .contains("reflink copy is not possible here"),
            "{error}"
        );
        assert!(
            read_block(&volume, 100) == vec![0u8; BLOCK as usize],
            "nothing copied"
        );
        let report = copy(
            &volume,
            0,
            &volume,
            100,
            2,
            &CopyOptions::default(),
            &control,
        )
        .expect("auto copy");
        assert_eq!(report.method, CopyMethod::Pipelined);
        assert!(read_block(&volume, 101) == pattern(1, 1));
        // Far enough to clone in whole pieces: Auto says reflink cannot work.
        let far = copy(
            &volume,
            0,
            &volume,
            8192,
            2,
            &CopyOptions::default(),
            &control,
        )
        .expect("auto copy");
        assert_eq!(far.method, CopyMethod::Pipelined);
        assert!(
            far.chosen_by.starts_with("reflink not possible"),
            "{}",
            far.chosen_by
        );
        assert!(read_block(&volume, 8193) == pattern(1, 1));
    }
}

#[test]
fn a_cancelled_copy_leaves_every_destination_block_old_or_new_and_says_how_far() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a_path, b_path) = (dir.path().join("a"), dir.path().join("b"));
    let count = 16384u64; // 64 MiB
    let a = create(&a_path, LayoutKind::Split, count);
    let b = create(&b_path, LayoutKind::Split, count);
    let chunk: Vec<u8> = (0..256).flat_map(|lba| pattern(lba, 7)).collect();
    let old: Vec<u8> = (0..256).flat_map(|lba| pattern(lba, 8)).collect();
    for segment in 0..count / 256 {
        a.write(segment * 256 * BLOCK, &chunk, false)
            .expect("write");
        b.write(segment * 256 * BLOCK, &old, false).expect("write");
    }
    a.flush().expect("flush");
    b.flush().expect("flush");
    // Cancelled before it starts: nothing copied.
    let control = JobControl::default();
    control.cancel();
    let error =
        copy(&a, 0, &b, 0, count, &CopyOptions::default(), &control).expect_err("cancelled");
    assert!(matches!(error, Error::Cancelled(_)), "{error}");
    assert!(error.to_string().contains("nothing was copied"), "{error}");
    // Cancelled from another thread once it is under way.
    let control = Arc::new(JobControl::default());
    let watcher = {
        let control = control.clone();
        std::thread::spawn(move || {
            while control.progress().0 < 1024 {
                std::thread::yield_now();
            }
            control.cancel();
        })
    };
    let result = copy(&a, 0, &b, 0, count, &CopyOptions::default(), &control);
    watcher.join().expect("watcher");
    let error = result.expect_err("cancelled mid-copy");
    let message = error.to_string();
    assert!(matches!(error, Error::Cancelled(_)), "{message}");
    let done = control.progress().0;
    assert!(done > 0 && done < count, "{message}");
    assert!(
        message.contains(&format!("after {done} of {count} blocks")),
        "{message}"
    );
    assert!(
        message.contains(&format!("destination blocks 0..{done} are copied")),
        "{message}"
    );
    b.flush().expect("flush");
    b.close().expect("close");
    let b = open_volume(&b_path, &OpenOptions::default()).expect("reopen");
    for lba in 0..count {
        let expected = if lba < done { 7 } else { 8 };
        assert!(
            read_block(&b, lba) == pattern(lba % 256, expected),
            "LBA {lba} is neither the copy (before {done}) nor the old contents"
        );
    }
}

#[test]
fn volume_copy_is_the_offload() {
    // `BlockDevice::copy` on a volume goes through `copy::copy` (Auto):
    // a corrupt block is named and blocks land with their new tags.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("v");
    let volume = create(&path, LayoutKind::Packed, 1024);
    for lba in 0..300 {
        volume
            .write(lba * BLOCK, &pattern(lba, 9), false)
            .expect("write");
    }
    BlockDevice::copy(&volume, 0, 600, 300).expect("copy");
    for lba in 0..300 {
        assert!(read_block(&volume, 600 + lba) == pattern(lba, 9));
    }
    let error = BlockDevice::copy(&volume, 1000, 0, 30).expect_err("past the end");
    assert!(matches!(error, Error::OutOfRange { .. }), "{error}");
}

/// A copy is a job like a scan: at a rate it waits between its steps
/// (counted in its `JobControl` and its report), as fast as it goes it
/// never waits, and either way the blocks arrive.
#[test]
fn a_copy_keeps_its_rate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a_path, b_path) = (dir.path().join("a"), dir.path().join("b"));
    let count = 1024u64; // 4 MiB: four pipelined segments
    let a = create(&a_path, LayoutKind::Split, count);
    let b = create(&b_path, LayoutKind::Split, count);
    let expected = fill(&a, 0, count, 5);
    for rate in [None, Some(4u64 << 20)] {
        let control = JobControl::default();
        let options = CopyOptions {
            method: CopyMethod::Pipelined,
            rate_bytes_per_second: rate,
        };
        let report = copy(&a, 0, &b, 0, count, &options, &control).expect("copy");
        assert_eq!(control.progress(), (count, count));
        assert_eq!(report.paced_waits, control.paced_waits());
        match rate {
            None => assert_eq!(control.paced_waits(), 0, "unpaced"),
            // 1 MiB per segment at 4 MiB/s: each is due later than it ends.
            Some(_) => assert!(control.paced_waits() >= 1, "{report:?}"),
        }
        assert_blocks(&b, 0, &expected, "copied");
    }
}
