//! `vouch migrate` (issue 33, offline): a written volume moved split ->
//! packed -> split (and packed -> split -> packed) exports the same image
//! and checks clean at each step; a corrupt block stops it naming the LBA;
//! the region record lost, or an older one put back, is refused rather
//! than read as emptiness.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use vouch_engine::DeviceWrites;

use common::*;
use vouch_engine::regions::REGIONS_FILE;
use vouch_engine::{BlockDevice, CreateOptions, OpenOptions, UserSecret, ZeroFlags};
use vouch_format::regions::REGION_BLOCKS;
use vouch_format::{GuardKind, LayoutKind};

/// 3 whole regions and a part of a fourth.
const BLOCKS: u64 = 3 * REGION_BLOCKS + 1000;

fn key_file(dir: &Path) -> PathBuf {
    let path = dir.join("test.key");
    std::fs::write(&path, [0x5a; 32]).expect("write key");
    path
}

/// A volume of `layout` and `guard` with data, zeroed and trimmed ranges
/// and never-written ranges across its regions (their boundaries too).
fn written_volume(dir: &Path, layout: LayoutKind, guard: GuardKind, encrypted: bool) -> PathBuf {
    let path = dir.join("vol");
    let options = CreateOptions {
        layout,
        guard,
        encrypt: encrypted.then(|| UserSecret::key(&[0x5a; 32]).expect("key")),
        ..CreateOptions::new(BLOCKS * BLOCK)
    };
    let volume = vouch_engine::create_volume(&path, &options).expect("create");
    // Data runs, one across each region boundary.
    for (index, lba) in [
        0,
        40,
        REGION_BLOCKS - 30,
        2 * REGION_BLOCKS - 5,
        BLOCKS - 64,
    ]
    .into_iter()
    .enumerate()
    {
        let data = random_bytes((64 * BLOCK) as usize, index as u64 + 1);
        volume.write(lba * BLOCK, &data, false).expect("write");
    }
    // Written, then trimmed in part (a hole inside written units).
    let data = random_bytes((300 * BLOCK) as usize, 99);
    volume
        .write((REGION_BLOCKS + 100) * BLOCK, &data, false)
        .expect("write");
    volume
        .trim((REGION_BLOCKS + 150) * BLOCK, 100 * BLOCK, false)
        .expect("trim");
    // Zeroes, allocated, across the boundary of regions 2 and 3.
    volume
        .write_zeroes(
            (3 * REGION_BLOCKS - 10) * BLOCK,
            20 * BLOCK,
            ZeroFlags {
                fua: false,
                allocate: true,
            },
        )
        .expect("zeroes");
    volume.close().expect("close");
    path
}

fn with_key(args: &[&str], key: Option<&Path>) -> std::process::Output {
    let mut all: Vec<&str> = args.to_vec();
    if let Some(key) = key {
        all.extend(["--key-file", s(key)]);
    }
    vouch(&all)
}

fn export_bytes(path: &Path, out: &Path, key: Option<&Path>) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    let output = with_key(&["export", s(path), s(out)], key);
    assert!(output.status.success(), "export: {}", text(&output));
    std::fs::read(out).expect("read export")
}

fn migrate_ok(path: &Path, layout: &str, key: Option<&Path>) {
    let output = with_key(&["migrate", s(path), "--layout", layout], key);
    assert!(
        output.status.success(),
        "migrate to {layout}: {}",
        text(&output)
    );
}

fn round_trip(home: LayoutKind, guard: GuardKind, encrypted: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = encrypted.then(|| key_file(dir.path()));
    let key = key.as_deref();
    let path = written_volume(dir.path(), home, guard, encrypted);
    let image = dir.path().join("image.raw");
    let expected = export_bytes(&path, &image, key);
    assert!(expected.iter().any(|byte| *byte != 0));
    let other = vouch_engine::regions::other_layout(home);
    for layout in [other, home, other] {
        migrate_ok(&path, layout.name(), key);
        assert!(
            export_bytes(&path, &image, key) == expected,
            "{home:?}/{guard:?}: the image after migrating to {layout:?} differs"
        );
        let check = with_key(&["check", s(&path)], key);
        assert!(check.status.success(), "check: {}", text(&check));
        let info = with_key(&["info", s(&path), "--json"], key);
        let json: serde_json::Value = serde_json::from_slice(&info.stdout).expect("info json");
        assert_eq!(json["layout"], home.name(), "{json}");
        let member = vouch_engine::regions::member_path(&path, home);
        if layout == home {
            // Every region home: a one-layout volume again.
            assert!(json["regions"].is_null(), "{json}");
            assert!(!path.join(REGIONS_FILE).exists());
            assert!(!member.exists());
        } else {
            assert_eq!(json["regions"][layout.name()], 4, "{json}");
        }
    }
    // The member the last migration left holds nothing but its journal
    // and metadata: its regions were released (punched).
    let member = vouch_engine::regions::member_path(&path, home);
    let home_data = std::fs::metadata(path.join("data.00000")).expect("home data");
    use std::os::unix::fs::MetadataExt as _;
    assert!(
        home_data.blocks() * 512 < 64 * 1024,
        "the home member's data was not released: {} bytes allocated",
        home_data.blocks() * 512
    );
    assert!(member.join("superblock").exists());
}

#[test]
fn split_migrates_to_packed_and_back_with_every_byte() {
    round_trip(LayoutKind::Split, GuardKind::Crc32c, false);
}

#[test]
fn packed_xxh3_migrates_to_split_and_back_with_every_byte() {
    round_trip(LayoutKind::Packed, GuardKind::Xxh3, false);
}

#[test]
fn an_encrypted_volume_migrates_with_every_byte() {
    round_trip(LayoutKind::Split, GuardKind::Crc32c, true);
}

#[test]
fn a_corrupt_block_stops_the_migration_naming_its_lba() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written_volume(dir.path(), LayoutKind::Split, GuardKind::Crc32c, false);
    let image = dir.path().join("image.raw");
    let expected = export_bytes(&path, &image, None);
    // A data block of region 2 (the run written across regions 1 and 2).
    let lba = 2 * REGION_BLOCKS + 10;
    flip_bit(&path.join("data.00000"), lba * BLOCK + 7, 0x04);
    let output = vouch(&["migrate", s(&path), "--layout", "packed"]);
    assert!(!output.status.success(), "{}", text(&output));
    let said = text(&output);
    assert!(said.contains(&format!("LBA {lba}")), "{said}");
    // Regions 0 and 1 moved; 2 and 3 did not; the volume reads whole but
    // for that block, which check names.
    let json = info_json(&path);
    assert_eq!(json["regions"]["packed"], 2, "{json}");
    assert_eq!(json["regions"]["split"], 2, "{json}");
    let (code, faults) = check_faults(&path);
    assert_eq!(code, 1);
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0].0, lba, "{faults:?}");
    let _ = std::fs::remove_file(&image);
    let output = vouch(&["export", s(&path), s(&image), "--allow-faults"]);
    assert!(output.status.success(), "{}", text(&output));
    let mut want = expected;
    let at = (lba * BLOCK) as usize;
    want[at..at + BLOCK as usize].fill(0);
    assert!(std::fs::read(&image).expect("read") == want);

    // Reads and writes of both layouts in one volume: a write, a trim and
    // zeroes across the boundary of region 1 (packed) and region 2
    // (split), read back through the region layer and exported.
    let volume = vouch_engine::regions::RegionVolume::open(&path, &OpenOptions::default())
        .expect("open the regions");
    assert_eq!(volume.layout_of(2 * REGION_BLOCKS - 1), LayoutKind::Packed);
    assert_eq!(volume.layout_of(2 * REGION_BLOCKS), LayoutKind::Split);
    let at = (2 * REGION_BLOCKS - 8) * BLOCK;
    let data = random_bytes((16 * BLOCK) as usize, 77);
    volume.write(at, &data, false).expect("write across");
    want[at as usize..(at + 16 * BLOCK) as usize].copy_from_slice(&data);
    let trim_at = (2 * REGION_BLOCKS - 2) * BLOCK;
    volume.trim(trim_at, 4 * BLOCK, false).expect("trim across");
    want[trim_at as usize..(trim_at + 4 * BLOCK) as usize].fill(0);
    let zero_at = (2 * REGION_BLOCKS - 50) * BLOCK;
    volume
        .write_zeroes(zero_at, 100 * BLOCK, ZeroFlags::default())
        .expect("zeroes across");
    want[zero_at as usize..(zero_at + 100 * BLOCK) as usize].fill(0);
    volume.flush().expect("flush");
    let mut back = vec![0u8; (200 * BLOCK) as usize];
    let from = (2 * REGION_BLOCKS - 100) * BLOCK;
    volume.read(from, &mut back).expect("read across");
    assert!(back[..] == want[from as usize..(from + 200 * BLOCK) as usize]);
    volume.close().expect("close");
    let _ = std::fs::remove_file(&image);
    let output = vouch(&["export", s(&path), s(&image), "--allow-faults"]);
    assert!(output.status.success(), "{}", text(&output));
    assert!(std::fs::read(&image).expect("read") == want);
}

#[test]
fn a_lost_or_older_region_record_is_refused_never_read_as_zeros() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written_volume(dir.path(), LayoutKind::Split, GuardKind::Crc32c, false);
    migrate_ok(&path, "packed", None);
    // A record older than the superblock names (as if a later switch had
    // been made and the file then put back from before it): refused.
    rewrite_superblock(&path, |superblock| superblock.regions_seq += 1);
    let image = dir.path().join("image.raw");
    let output = vouch(&["export", s(&path), s(&image)]);
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("older than the superblock"),
        "{}",
        text(&output)
    );
    // Lost: refused, not taken as the superblock's one layout.
    std::fs::remove_file(path.join(REGIONS_FILE)).expect("remove");
    for command in ["export", "check", "info"] {
        let args: Vec<&str> = if command == "export" {
            vec![command, s(&path), s(&image)]
        } else {
            vec![command, s(&path)]
        };
        let output = vouch(&args);
        assert!(!output.status.success(), "{command}: {}", text(&output));
        assert!(
            text(&output).contains("missing or damaged"),
            "{command}: {}",
            text(&output)
        );
    }
    // Served as one layout: refused too.
    let opened = vouch_engine::open_volume(&path, &OpenOptions::default());
    assert!(
        opened.is_err(),
        "the engine opened a REGIONS volume as one layout"
    );
}

#[test]
fn a_member_of_another_volume_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = dir.path().join("a");
    let second = dir.path().join("b");
    std::fs::create_dir(&first).expect("mkdir");
    std::fs::create_dir(&second).expect("mkdir");
    let a = written_volume(&first, LayoutKind::Split, GuardKind::Crc32c, false);
    let b = written_volume(&second, LayoutKind::Split, GuardKind::Crc32c, false);
    migrate_ok(&a, "packed", None);
    migrate_ok(&b, "packed", None);
    let member = vouch_engine::regions::member_path(&a, LayoutKind::Split);
    std::fs::remove_dir_all(&member).expect("remove member");
    std::fs::rename(
        vouch_engine::regions::member_path(&b, LayoutKind::Split),
        &member,
    )
    .expect("move b's member");
    let output = vouch(&["check", s(&a)]);
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("not the member"),
        "{}",
        text(&output)
    );
}

#[test]
fn migrating_to_the_layout_a_volume_has_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written_volume(dir.path(), LayoutKind::Packed, GuardKind::Crc32c, false);
    migrate_ok(&path, "packed", None);
    assert!(!path.join(REGIONS_FILE).exists());
    assert!(info_json(&path)["regions"].is_null());
}

/// What a volume with regions does not do yet, `migrate` says when it
/// leaves one with the command that makes it a one-layout volume again,
/// and that command does.
#[test]
fn a_migrated_volume_says_what_it_does_not_do_yet_and_how_to_undo_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written_volume(dir.path(), LayoutKind::Split, GuardKind::Crc32c, false);
    let before = export_bytes(&path, &dir.path().join("before.img"), None);
    let back_home = format!("vouch migrate {} --layout split", path.display());

    let output = vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    let said = text(&output);
    assert!(
        said.contains("not mirrored") && said.contains("rekeyed yet"),
        "{said}"
    );
    assert!(said.contains(&back_home), "{said}");

    // What the note says works: back home, a one-layout volume serves.
    let output = vouch_ok(&["migrate", s(&path), "--layout", "split"]);
    assert!(
        !text(&output).contains("volume with regions"),
        "{}",
        text(&output)
    );
    vouch_ok(&["verify", s(&path)]);
    assert_eq!(
        export_bytes(&path, &dir.path().join("after.img"), None),
        before
    );
}

/// The review of migrate33, H1: a volume whose regions are in both
/// layouts is served. qemu-img compares the served image with the export;
/// qemu-io writes across the region boundary (one flushed, one not), the
/// server is killed with SIGKILL and restarted, and every acknowledged
/// write reads back, nothing as zeros; `check` is clean.
#[test]
fn a_partly_migrated_volume_is_served_and_keeps_every_acknowledged_write() {
    let qemu_img = tool("qemu-img", "qemu-utils");
    let qemu_io = tool("qemu-io", "qemu-utils");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written_volume(dir.path(), LayoutKind::Split, GuardKind::Crc32c, false);
    // A corrupt block in region 2 stops the migration after region 1...
    let lba = 2 * REGION_BLOCKS + 10;
    flip_bit(&path.join("data.00000"), lba * BLOCK + 7, 0x04);
    let output = vouch(&["migrate", s(&path), "--layout", "packed"]);
    assert!(!output.status.success(), "{}", text(&output));
    // ...and is then overwritten whole: regions 0-1 packed, 2-3 split.
    let volume = vouch_engine::regions::RegionVolume::open(&path, &OpenOptions::default())
        .expect("open the regions");
    volume
        .write(lba * BLOCK, &random_bytes(BLOCK as usize, 5), false)
        .expect("rewrite the block");
    volume.close().expect("close");
    assert_eq!(info_json(&path)["regions"]["packed"], 2);
    let image = dir.path().join("image.raw");
    let mut want = export_bytes(&path, &image, None);

    let mut server = Server::start(dir.path(), &[s(&path)]);
    let compare = |server: &Server, image: &Path| {
        run_ok(Command::new(&qemu_img).args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            s(image),
            &server.uri,
        ]));
    };
    compare(&server, &image);
    // Two writes across the boundary of region 1 (packed) and region 2
    // (split): the first flushed, the second acknowledged only.
    let first = (2 * REGION_BLOCKS - 8) * BLOCK;
    let second = (2 * REGION_BLOCKS - 3) * BLOCK + 100;
    run_ok(Command::new(&qemu_io).args([
        "-f",
        "raw",
        "-c",
        &format!("write -P 0x5a {first} {}", 16 * BLOCK),
        "-c",
        "flush",
        "-c",
        &format!("write -P 0xa5 {second} 9000"),
        &server.uri,
    ]));
    want[first as usize..(first + 16 * BLOCK) as usize].fill(0x5a);
    want[second as usize..second as usize + 9000].fill(0xa5);
    std::fs::write(&image, &want).expect("write the image");
    server.kill9();
    let mut server = server.restart();
    compare(&server, &image);
    server.stop();
    assert_check_clean(&path);
    assert_eq!(
        export_bytes(&path, &dir.path().join("after.raw"), None),
        want
    );
}

/// M1 (migrate33 review): `migrate` holds the volume's lock before it
/// decides or makes anything, so a running server's volume is refused
/// with nothing made beside it (it used to build the whole other member
/// and a record first, then fail on the lock).
#[test]
fn migrating_a_served_volume_is_refused_before_anything_is_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written_volume(dir.path(), LayoutKind::Split, GuardKind::Crc32c, false);
    let mut server = Server::start(dir.path(), &[s(&path)]);
    let output = vouch(&["migrate", s(&path), "--layout", "packed"]);
    assert!(!output.status.success(), "{}", text(&output));
    for made in ["layout.packed", ".layout.packed.partial", REGIONS_FILE] {
        assert!(
            !path.join(made).exists(),
            "{made} was made: {}",
            text(&output)
        );
    }
    server.stop();
    assert_check_clean(&path);
    assert!(info_json(&path)["regions"].is_null());
}

/// M1: two `migrate`s of one volume at once: one makes the member and
/// moves, the other waits its turn or is refused; never a volume that
/// no command opens. The volume ends whole and every byte the same.
#[test]
fn two_migrates_at_once_leave_a_volume_every_command_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written_volume(dir.path(), LayoutKind::Split, GuardKind::Crc32c, false);
    let image = dir.path().join("image.raw");
    let expected = export_bytes(&path, &image, None);
    for _ in 0..3 {
        let children: Vec<_> = (0..2)
            .map(|_| {
                Command::new(vouch_bin())
                    .args(["migrate", s(&path), "--layout", "packed"])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("spawn migrate")
            })
            .collect();
        let outputs: Vec<_> = children
            .into_iter()
            .map(|child| child.wait_with_output().expect("wait"))
            .collect();
        assert!(
            outputs.iter().any(|output| output.status.success()),
            "{}\n{}",
            text(&outputs[0]),
            text(&outputs[1])
        );
        // Whatever the loser did, a third run opens it and finishes.
        migrate_ok(&path, "packed", None);
        assert_check_clean(&path);
        assert_eq!(info_json(&path)["regions"]["packed"], 4);
        assert!(export_bytes(&path, &image, None) == expected);
        migrate_ok(&path, "split", None);
        assert!(info_json(&path)["regions"].is_null());
    }
}
