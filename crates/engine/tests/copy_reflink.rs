//! Reflink copy on a real btrfs: a 1 GiB image in a tempdir, formatted and
//! loop-mounted by the test (needs root and `mkfs.btrfs`), unmounted by a
//! guard. The destination's data segments really share the source's
//! extents (FIEMAP says "shared"), contexts are re-tagged, the source is
//! verified, and buffered writes on either side are ordered correctly.

use std::path::{Path, PathBuf};
use std::process::Command;
use vouch_engine::DeviceWrites;

use vouch_engine::copy::{copy, CopyMethod, CopyOptions};
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    create_volume, open_volume, BlockDevice, CreateOptions, Error, FaultKind, LayoutKind,
    OpenOptions, SealedDevice, Volume, BLOCK,
};
use vouch_format::Context;

/// A loop-mounted btrfs, unmounted (and its image removed) when dropped.
struct Btrfs {
    _dir: tempfile::TempDir,
    mount: PathBuf,
}

impl Btrfs {
    fn new() -> Btrfs {
        let found = Command::new("mkfs.btrfs").arg("--version").output();
        assert!(
            found.is_ok_and(|output| output.status.success()),
            "mkfs.btrfs is missing: apt-get install -y btrfs-progs"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("btrfs.img");
        std::fs::File::create(&image)
            .and_then(|file| file.set_len(1 << 30))
            .expect("image");
        let status = Command::new("mkfs.btrfs")
            .arg("-q")
            .arg(&image)
            .status()
            .expect("mkfs.btrfs");
        assert!(status.success(), "mkfs.btrfs failed");
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).expect("mkdir");
        let status = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&mount)
            .status()
            .expect("mount");
        assert!(
            status.success(),
            "mount -o loop failed (the test needs root)"
        );
        Btrfs { _dir: dir, mount }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.mount.join(name)
    }
}

impl Drop for Btrfs {
    fn drop(&mut self) {
        let status = Command::new("umount").arg(&self.mount).status();
        if !status.is_ok_and(|status| status.success()) {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        }
    }
}

fn pattern(lba: u64, tag: u8) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|i| (i as u8).wrapping_mul(29) ^ (lba as u8) ^ tag.wrapping_mul(11) ^ (lba >> 8) as u8)
        .collect()
}

fn read_block(device: &dyn BlockDevice, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    device.read(lba * BLOCK, &mut buf).expect("read");
    buf
}

fn create(path: &Path, blocks: u64) -> Volume {
    let mut options = CreateOptions::new(blocks * BLOCK);
    options.layout = LayoutKind::Split;
    create_volume(path, &options).expect("create")
}

fn reflink() -> CopyOptions {
    CopyOptions::with(CopyMethod::Reflink)
}

/// Does FIEMAP report the extent at `offset` of `file` as shared?
fn shared_extent(file: &Path, offset: u64) -> bool {
    let output = Command::new("filefrag")
        .args(["-v", "-b4096"])
        .arg(file)
        .output()
        .expect("filefrag (apt-get install -y e2fsprogs)");
    let text = String::from_utf8_lossy(&output.stdout);
    let block = offset / 4096;
    text.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "  0:        0..     255:   3328..  3583:    256:   last,shared,eof"
        let Some(range) = fields.get(1) else {
            return false;
        };
        let mut ends = range.trim_end_matches(':').split("..");
        let (Some(Ok(start)), Some(Ok(end))) = (
            ends.next().map(str::parse::<u64>),
            fields
                .get(2)
                .map(|end| end.trim_end_matches(':').parse::<u64>()),
        ) else {
            return false;
        };
        start <= block && block <= end && line.contains("shared")
    })
}

#[test]
fn reflink_copies_share_extents_and_retag_contexts_on_btrfs() {
    let fs = Btrfs::new();
    let (a_path, b_path) = (fs.path("a"), fs.path("b"));
    let a = create(&a_path, 16384);
    let b = create(&b_path, 16384);
    let count = 5000u64; // more than one 4096-block step
    for lba in 0..count {
        if lba.is_multiple_of(97) {
            continue; // holes stay holes
        }
        a.write(lba * BLOCK, &pattern(lba, 1), false)
            .expect("write");
    }
    a.flush().expect("flush");
    // Buffered, not yet home: the copy must commit them first.
    for lba in 10..20 {
        a.write(lba * BLOCK, &pattern(lba, 2), false)
            .expect("write");
    }
    // Old destination contents, some buffered: the copy supersedes them.
    for lba in 100..200 {
        b.write(lba * BLOCK, &pattern(lba, 3), false)
            .expect("write");
    }
    b.flush().expect("flush");
    for lba in 150..250 {
        b.write(lba * BLOCK, &pattern(lba, 4), false)
            .expect("write");
    }
    let control = JobControl::default();
    let report = copy(&a, 0, &b, 100, count, &reflink(), &control).expect("reflink copy");
    assert_eq!(report.method, CopyMethod::Reflink);
    assert_eq!(control.progress(), (count, count));
    let expected = |lba: u64| match lba {
        _ if lba.is_multiple_of(97) => vec![0u8; BLOCK as usize],
        10..20 => pattern(lba, 2),
        _ => pattern(lba, 1),
    };
    for lba in 0..count {
        assert!(
            read_block(&b, 100 + lba) == expected(lba),
            "LBA {}",
            100 + lba
        );
    }
    // Auto measures once per pair (a clone against a write, each synced),
    // picks the faster, says so, and caches the choice.
    let auto = copy(&a, 0, &a, 8000, count, &CopyOptions::default(), &control).expect("auto");
    let millis = |label: &str| -> f64 {
        let at = auto.chosen_by.find(label).expect(label) + label.len();
        let rest = &auto.chosen_by[at..];
        rest[..rest.find(" ms").expect("ms")]
            .parse()
            .expect("a number")
    };
    assert!(
        auto.chosen_by.starts_with("measured 4096 KiB"),
        "{}",
        auto.chosen_by
    );
    let faster = if millis("cloned and synced in ") < millis("written and synced in ") {
        CopyMethod::Reflink
    } else {
        CopyMethod::Pipelined
    };
    assert_eq!(auto.method, faster, "{}", auto.chosen_by);
    let again = copy(&a, 0, &a, 8000, count, &CopyOptions::default(), &control).expect("auto");
    assert_eq!(again.chosen_by, auto.chosen_by, "the choice is cached");
    b.flush().expect("flush");
    a.close().expect("close");
    b.close().expect("close");
    assert!(
        shared_extent(&b_path.join("data.00000"), 100 * 4096 + 4096),
        "the destination's data shares the source's extents"
    );
    let b = open_volume(&b_path, &OpenOptions::default()).expect("reopen");
    let sealed = b.read_sealed(100, 64).expect("read_sealed");
    for block in &sealed {
        match block.context {
            Context::Data { ref_tag, .. } => assert_eq!(ref_tag, block.lba),
            Context::Unwritten => assert_eq!((block.lba - 100) % 97, 0),
            other => panic!("LBA {}: {other:?}", block.lba),
        }
    }
    for lba in 0..count {
        assert!(
            read_block(&b, 100 + lba) == expected(lba),
            "after reopen: LBA {}",
            100 + lba
        );
    }
    assert!(b.check(|_, _| {}).expect("check").faults.is_empty());
    let a = open_volume(&a_path, &OpenOptions::default()).expect("reopen");
    for lba in 0..count {
        assert!(read_block(&a, 8000 + lba) == expected(lba));
    }
}

#[test]
fn reflink_memmove_and_a_corrupt_source_on_btrfs() {
    let fs = Btrfs::new();
    let path = fs.path("v");
    let volume = create(&path, 8192);
    let control = JobControl::default();
    for (shift, forwards) in [(1u64, true), (1, false), (700, true), (700, false)] {
        let (from, to) = if forwards {
            (100, 100 + shift)
        } else {
            (100 + shift, 100)
        };
        for lba in 0..1000 {
            volume
                .write((from + lba) * BLOCK, &pattern(lba, shift as u8), false)
                .expect("write");
        }
        let report = copy(&volume, from, &volume, to, 1000, &reflink(), &control).expect("copy");
        assert_eq!(report.method, CopyMethod::Reflink);
        for lba in 0..1000 {
            assert!(
                read_block(&volume, to + lba) == pattern(lba, shift as u8),
                "shift {shift} forwards {forwards}: LBA {}",
                to + lba
            );
        }
    }
    for lba in 0..600 {
        volume
            .write((3000 + lba) * BLOCK, &pattern(lba, 5), false)
            .expect("write");
        volume
            .write((5000 + lba) * BLOCK, &pattern(lba, 6), false)
            .expect("write");
    }
    let geometry = volume.geometry();
    volume.close().expect("close");
    {
        use std::os::unix::fs::FileExt;
        let location = geometry.locate(3400);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path.join("data.00000"))
            .expect("open");
        let mut byte = [0u8];
        file.read_at(&mut byte, location.data_offset + 7)
            .expect("read");
        file.write_at(&[byte[0] ^ 1], location.data_offset + 7)
            .expect("write");
    }
    let volume = open_volume(&path, &OpenOptions::default()).expect("open");
    let error =
        copy(&volume, 3000, &volume, 5000, 600, &reflink(), &control).expect_err("corrupt source");
    assert!(
        matches!(&error, Error::Fault(fault) if fault.lba == 3400 && fault.kind == FaultKind::GuardMismatch),
        "{error}"
    );
    for lba in 0..600 {
        assert!(
            read_block(&volume, 5000 + lba) == pattern(lba, 6),
            "destination changed"
        );
    }
}

/// Readers of the destination while a reflink copy replaces its extents
/// see each block's old or new contents — never an error, never a mix.
#[test]
fn readers_during_a_reflink_copy_see_old_or_new_blocks_on_btrfs() {
    let fs = Btrfs::new();
    let a = create(&fs.path("a"), 32768);
    let b = create(&fs.path("b"), 32768);
    let count = 12288u64; // three 4096-block pieces
    let run = 64u64;
    for first in (0..count).step_by(run as usize) {
        let (mut new, mut before) = (Vec::new(), Vec::new());
        for lba in first..first + run {
            new.extend(pattern(lba, 1));
            before.extend(pattern(1000 + lba, 3));
        }
        a.write(first * BLOCK, &new, false).expect("write source");
        b.write((1000 + first) * BLOCK, &before, false)
            .expect("write destination");
    }
    a.flush().expect("flush");
    b.flush().expect("flush");
    let done = std::sync::atomic::AtomicBool::new(false);
    let reads = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| {
        for reader in 0..2u64 {
            let (b, done, reads) = (&b, &done, &reads);
            scope.spawn(move || {
                let mut buffer = vec![0u8; (16 * BLOCK) as usize];
                let mut first = reader * 4096;
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    first = (first + 16 * 37) % (count - 16);
                    b.read((1000 + first) * BLOCK, &mut buffer)
                        .unwrap_or_else(|error| panic!("read at {}: {error}", 1000 + first));
                    for index in 0..16 {
                        let lba = first + index;
                        let got = &buffer[(index * BLOCK) as usize..((index + 1) * BLOCK) as usize];
                        assert!(
                            got == pattern(lba, 1) || got == pattern(1000 + lba, 3),
                            "LBA {} is neither old nor new",
                            1000 + lba
                        );
                    }
                    reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        let control = JobControl::default();
        for _ in 0..3 {
            let report = copy(&a, 0, &b, 1000, count, &reflink(), &control).expect("reflink copy");
            assert_eq!(report.method, CopyMethod::Reflink);
        }
        done.store(true, std::sync::atomic::Ordering::Release);
    });
    assert!(reads.into_inner() > 0, "the readers ran");
    for lba in 0..count {
        assert!(
            read_block(&b, 1000 + lba) == pattern(lba, 1),
            "LBA {}",
            1000 + lba
        );
    }
}

/// The reflink copy keeps a rate too: it waits between its windows (with
/// the committer locks released), counted in its `JobControl`.
#[test]
fn a_reflink_copy_keeps_its_rate_on_btrfs() {
    let fs = Btrfs::new();
    let (a_path, b_path) = (fs.path("a"), fs.path("b"));
    let count = 2048u64; // 8 MiB
    let a = create(&a_path, count);
    let b = create(&b_path, count);
    for lba in 0..count {
        a.write(lba * BLOCK, &pattern(lba, 6), false)
            .expect("write");
    }
    a.flush().expect("flush");
    // 8 MiB at 4 MiB/s: due two seconds after it starts, so it waits.
    let options = CopyOptions {
        method: CopyMethod::Reflink,
        rate_bytes_per_second: Some(4 << 20),
    };
    let control = JobControl::default();
    let report = copy(&a, 0, &b, 0, count, &options, &control).expect("paced reflink copy");
    assert_eq!(report.method, CopyMethod::Reflink);
    assert_eq!(control.progress(), (count, count));
    assert!(control.paced_waits() >= 1, "{report:?}");
    assert_eq!(report.paced_waits, control.paced_waits());
    for lba in 0..count {
        assert!(read_block(&b, lba) == pattern(lba, 6), "LBA {lba}");
    }
}
