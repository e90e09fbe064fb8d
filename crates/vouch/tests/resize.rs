//! `vouch resize` through the CLI and NBD: a grow that qemu-img sees over
//! NBD and that clients write at its new tail, shrinks of an unwritten
//! tail and refused ones, bad sizes, snapshots and clones, encrypted
//! volumes, and a full filesystem during a grow (a small ext4 made on a
//! loop device by the test: needs root and `mkfs.ext4`).

mod common;

use std::path::Path;
use std::process::Command;

use common::clients::qemu_img;
use common::*;

const OLD: usize = 4 << 20;

fn stderr_of(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `vouch resize` that must fail, its stderr.
fn refused(args: &[&str]) -> String {
    let output = vouch(args);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
    stderr_of(&output)
}

fn exported(volume: &Path, dir: &Path) -> Vec<u8> {
    let raw = dir.join("export.raw");
    let _ = std::fs::remove_file(&raw);
    vouch_ok(&["export", s(volume), s(&raw)]);
    std::fs::read(&raw).expect("read export")
}

fn size_of(volume: &Path) -> u64 {
    info_json(volume)["size_bytes"]
        .as_u64()
        .expect("size_bytes")
}

/// Serve `volume`: qemu-img's size over NBD; then write `tail` at the
/// last block, trim the block before it, flush, read both back.
fn serve_and_write_tail(dir: &Path, volume: &Path, size: u64, tail: &[u8]) -> u64 {
    let mut server = Server::start(dir, &[s(volume)]);
    let info = run_ok(Command::new(qemu_img()).args(["info", "--output=json", &server.uri]));
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("qemu-img json");
    let seen = info["virtual-size"].as_u64().expect("virtual-size");
    let file = dir.join("tail.bin");
    std::fs::write(&file, tail).expect("tail");
    let answer = py_json(
        r#"
h = connect(sys.argv[1])
size = int(sys.argv[3])
data = open(sys.argv[2], "rb").read()
h.pwrite(data, size - 4096)
h.flush()
back = h.pread(4096, size - 4096)
try:
    h.pread(4096, size)
    past = None
except nbd.Error as e:
    past = e.errno
print(json.dumps({"same": back == data, "past": past, "size": h.get_size()}))
"#,
        &[&server.uri, s(&file), &size.to_string()],
    );
    server.stop();
    assert_eq!(answer["same"], true, "the new tail reads other data");
    assert_eq!(answer["size"].as_u64(), Some(size));
    assert!(answer["past"].is_string(), "a read past the end: {answer}");
    seen
}

fn grow_then_shrink(layout: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let data = random_bytes(OLD, 7);
    let raw = dir.join("old.raw");
    std::fs::write(&raw, &data).expect("raw");
    let volume = dir.join("vol");
    vouch_ok(&["import", s(&raw), s(&volume), "--layout", layout]);

    // Grow 4M -> 10M + 12K (not a whole unit: the unit at the old end and
    // the new one straddle).
    let new = (10u64 << 20) + 3 * BLOCK;
    let out = vouch_ok(&["resize", s(&volume), &new.to_string()]);
    assert!(text(&out).contains("resized"), "{}", text(&out));
    assert_eq!(size_of(&volume), new);
    assert_check_clean(&volume);
    let now = exported(&volume, dir);
    assert_eq!(now.len() as u64, new);
    assert!(now[..OLD] == data[..], "old data changed by the grow");
    assert!(
        now[OLD..].iter().all(|byte| *byte == 0),
        "the new tail does not read as zeros"
    );

    // Served: qemu-img sees the new size; a client writes the last block.
    let tail = random_bytes(4096, 8);
    assert_eq!(serve_and_write_tail(dir, &volume, new, &tail), new);
    assert_check_clean(&volume);

    // A shrink over written data is refused naming its first LBA.
    let last_lba = new / BLOCK - 1;
    let error = refused(&["resize", s(&volume), "8M"]);
    assert!(error.contains(&format!("LBA {last_lba} ")), "{error}");
    let error = refused(&["resize", s(&volume), "1M"]);
    assert!(error.contains("LBA 256 "), "{error}");
    assert_eq!(size_of(&volume), new);

    // Trimmed, the tail holds nothing: the shrink goes through.
    let mut server = Server::start(dir, &[s(&volume)]);
    py_json(
        r#"
h = connect(sys.argv[1])
h.trim(4096, int(sys.argv[2]))
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri, &(last_lba * BLOCK).to_string()],
    );
    server.stop();
    vouch_ok(&["resize", s(&volume), "6M"]);
    assert_eq!(size_of(&volume), 6 << 20);
    assert_check_clean(&volume);
    let now = exported(&volume, dir);
    assert!(now[..OLD] == data[..] && now[OLD..].iter().all(|b| *b == 0));
    // The segment files follow the size (split: 4 KiB a block; packed:
    // whole 128 KiB rows of 31 blocks).
    let segment = std::fs::metadata(volume.join("data.00000"))
        .expect("segment")
        .len();
    let blocks = 6u64 << 8;
    let want = if layout == "split" {
        blocks * BLOCK
    } else {
        blocks.div_ceil(31) * (128 << 10)
    };
    assert_eq!(segment, want);

    // Grown again past a cut: the new tail reads zeros, check clean.
    vouch_ok(&["resize", s(&volume), "12M"]);
    assert_check_clean(&volume);
    let now = exported(&volume, dir);
    assert!(now[..OLD] == data[..] && now[OLD..].iter().all(|b| *b == 0));
}

#[test]
fn a_split_volume_grows_and_shrinks_an_unwritten_tail() {
    grow_then_shrink("split");
}

#[test]
fn a_packed_volume_grows_and_shrinks_an_unwritten_tail() {
    grow_then_shrink("packed");
}

#[test]
fn bad_sizes_and_snapshots_are_refused_and_clones_and_mirrors_resize() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let volume = volume_from(dir, "vol", &random_bytes(1 << 20, 3));
    for (size, why) in [
        ("4097", "not a positive multiple of 4096"),
        ("2P", "larger than the largest volume"),
        ("0", "not a positive multiple of 4096"),
    ] {
        let output = vouch(&["resize", s(&volume), size]);
        assert!(!output.status.success(), "{size}");
        assert!(
            stderr_of(&output).contains(why),
            "{size}: {}",
            text(&output)
        );
    }
    assert_eq!(size_of(&volume), 1 << 20);

    // A snapshot is read-only; a clone of it resizes.
    vouch_ok(&["snapshot", "create", "--copy", s(&volume), "s1"]);
    let snap = volume.join("snapshots/s1");
    let error = refused(&["resize", s(&snap), "2M"]);
    assert!(error.contains("is a snapshot"), "{error}");
    let clone = dir.join("clone");
    vouch_ok(&["clone", "--copy", s(&snap), s(&clone)]);
    vouch_ok(&["resize", s(&clone), "2M"]);
    assert_eq!(size_of(&clone), 2 << 20);
    assert_check_clean(&clone);
    assert_eq!(size_of(&snap), 1 << 20);

    // A mirror (any leg's path) has every leg resized
    // (`tests/resize_mirror.rs`).
    let (a, b) = (dir.join("m0"), dir.join("m1"));
    vouch_ok(&["create", s(&a), "--size", "1M", "--mirror", s(&b)]);
    vouch_ok(&["resize", s(&b), "2M"]);
    assert_eq!((size_of(&a), size_of(&b)), (2 << 20, 2 << 20));

    // A served volume is resized through its server, not offline.
    let mut server = Server::start(dir, &[s(&volume)]);
    let error = refused(&["resize", s(&volume), "2M"]);
    assert!(
        error.contains("running `vouch serve`") && error.contains("--server"),
        "{error}"
    );
    server.stop();

    // A volume a newer vouch made (an incompat feature this one does not
    // know) is not rewritten: its superblock stays as it was.
    common::rewrite_superblock(&volume, |sb| sb.features.incompat |= 1 << 40);
    let before = std::fs::read(volume.join("superblock")).expect("superblock");
    let error = refused(&["resize", s(&volume), "2M"]);
    assert!(
        error.contains("features this vouch does not know"),
        "{error}"
    );
    assert_eq!(
        std::fs::read(volume.join("superblock")).expect("superblock"),
        before
    );
}

#[test]
fn an_encrypted_volume_grows_and_shrinks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let key = dir.join("key");
    std::fs::write(&key, random_bytes(32, 9)).expect("key");
    let volume = dir.join("vol");
    vouch_ok(&[
        "create",
        s(&volume),
        "--size",
        "1M",
        "--encrypt",
        "--key-file",
        s(&key),
    ]);
    vouch_ok(&["resize", s(&volume), "3M"]);
    let (code, faults) = check_faults_with(&volume, &["--key-file", s(&key)]);
    assert_eq!((code, faults.len()), (0, 0));
    vouch_ok(&["resize", s(&volume), "2M"]);
    assert_eq!(size_of(&volume), 2 << 20);
    let (code, faults) = check_faults_with(&volume, &["--key-file", s(&key)]);
    assert_eq!((code, faults.len()), (0, 0));
}

/// A grow on a full filesystem fails cleanly: the volume keeps its size
/// and its data, check is clean, and the grow succeeds once there is room.
#[test]
fn a_full_filesystem_during_a_grow_loses_nothing() {
    let fs = LoopFs::ext4(64 << 20);
    let dir = &fs.mount;
    let data = random_bytes(4 << 20, 11);
    let raw = dir.join("old.raw");
    std::fs::write(&raw, &data).expect("raw");
    let volume = dir.join("vol");
    vouch_ok(&["import", s(&raw), s(&volume), "--journal", "1M"]);
    std::fs::remove_file(&raw).expect("rm raw");
    // Fill the filesystem: by MiB, then by 4 KiB what is left.
    let filler = dir.join("filler");
    for (name, bs) in [("filler", "1M"), ("filler2", "4k")] {
        let _ = run(Command::new("dd").args([
            "if=/dev/zero",
            &format!("of={}", dir.join(name).display()),
            &format!("bs={bs}"),
        ]));
    }
    let output = vouch(&["resize", s(&volume), "40000K"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        stderr_of(&output).contains("No space left"),
        "{}",
        text(&output)
    );
    assert_eq!(size_of(&volume), 4 << 20);
    assert_check_clean(&volume);
    let scratch = tempfile::tempdir().expect("tempdir");
    assert!(exported(&volume, scratch.path()) == data);
    std::fs::remove_file(&filler).expect("rm filler");
    std::fs::remove_file(dir.join("filler2")).expect("rm filler2");
    vouch_ok(&["resize", s(&volume), "40000K"]);
    assert_eq!(size_of(&volume), 40000 << 10);
    assert_check_clean(&volume);
    let now = exported(&volume, scratch.path());
    assert!(now[..4 << 20] == data[..] && now[4 << 20..].iter().all(|b| *b == 0));
}

/// What a resize cut between its superblock switch and the rename of the
/// new map leaves (the map of the new size in `written.resize`) is
/// finished by the next open, a read-only one too; cut before the switch,
/// it is undone. Made here from a finished resize by putting the files
/// back as they were at those points.
#[test]
fn an_open_finishes_or_undoes_a_resize_cut_short() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let data = random_bytes(1 << 20, 5);
    let volume = volume_from(dir, "vol", &data);
    let old_superblock = std::fs::read(volume.join("superblock")).expect("superblock");
    let old_map = std::fs::read(volume.join("written")).expect("written");
    vouch_ok(&["resize", s(&volume), "300M"]);
    let new_superblock = std::fs::read(volume.join("superblock")).expect("superblock");
    let new_map = std::fs::read(volume.join("written")).expect("written");
    assert!(new_map != old_map, "the map's layout follows the size");

    for (superblock, size) in [(&new_superblock, 300u64 << 20), (&old_superblock, 1 << 20)] {
        std::fs::write(volume.join("superblock"), superblock).expect("superblock");
        std::fs::write(volume.join("written"), &old_map).expect("written");
        std::fs::write(volume.join("written.resize"), &new_map).expect("written.resize");
        // `check` opens read-only.
        assert_check_clean(&volume);
        assert!(!volume.join("written.resize").exists());
        assert_eq!(size_of(&volume), size);
        let now = exported(&volume, dir);
        assert_eq!(now.len() as u64, size);
        assert!(now[..1 << 20] == data[..]);
    }
}
