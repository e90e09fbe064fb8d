//! `vouch resize` of a volume with regions (after `vouch migrate`):
//! grown across a region's end (its record gains regions, in the layout
//! it was created in), seen over NBD at the new size, written in the new
//! tail of both members, refused a shrink over that, shrunk back once it
//! is trimmed; both members and the record follow the size, `check` is
//! clean and the data is the same at each step.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::clients::{nbdinfo, qemu_img};
use common::regions::{export_bytes, layouts_and_size};
use common::*;
use vouch_format::regions::REGION_BLOCKS;

/// One whole region and a part of a second.
const OLD_BLOCKS: u64 = REGION_BLOCKS + 500;
/// Three regions, the third in part.
const NEW_BLOCKS: u64 = 2 * REGION_BLOCKS + 700;

/// A split volume with data at its start, across its region boundary and
/// at its end.
fn written_volume(dir: &Path) -> PathBuf {
    split_volume_with_runs(dir, OLD_BLOCKS, &[0, REGION_BLOCKS - 30, OLD_BLOCKS - 64])
}

#[test]
fn a_volume_with_regions_grows_and_shrinks_with_both_members_and_its_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let path = written_volume(dir);
    // Every region to packed: a volume with regions (its home is split).
    vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    let before = export_bytes(&path, &dir.join("before.img"));
    assert_eq!(
        layouts_and_size(&path),
        (vec!["packed".into(), "packed".into()], OLD_BLOCKS * BLOCK)
    );

    // Grow across the second region's end: a third region, in the layout
    // the volume was created in.
    let new = NEW_BLOCKS * BLOCK;
    let output = vouch_ok(&["resize", s(&path), &new.to_string()]);
    assert!(text(&output).contains("resized"), "{}", text(&output));
    assert_eq!(
        layouts_and_size(&path),
        (vec!["packed".into(), "packed".into(), "split".into()], new)
    );
    assert!(!path.join("regions.resize").exists());
    assert_check_clean(&path);
    vouch_ok(&["verify", s(&path)]);
    let grown = export_bytes(&path, &dir.join("grown.img"));
    assert_eq!(grown.len() as u64, new);
    assert!(grown[..before.len()] == before[..], "the grow changed data");
    assert!(
        grown[before.len()..].iter().all(|byte| *byte == 0),
        "the new tail does not read as zeros"
    );

    // Served: qemu-img and nbdinfo see the new size; a client writes in
    // the new tail of region 1 (the packed member) and the last block
    // (region 2, the split member).
    let mut server = Server::start(dir, &[s(&path)]);
    let info = run_ok(Command::new(qemu_img()).args(["info", "--output=json", &server.uri]));
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("qemu-img json");
    assert_eq!(info["virtual-size"].as_u64(), Some(new));
    let nbd = run_ok(Command::new(nbdinfo()).args(["--size", &server.uri]));
    assert_eq!(String::from_utf8_lossy(&nbd.stdout).trim(), new.to_string());
    let (packed_lba, split_lba) = (REGION_BLOCKS + 600, NEW_BLOCKS - 1);
    let block = random_bytes(BLOCK as usize, 42);
    let file = dir.join("block.bin");
    std::fs::write(&file, &block).expect("block");
    let answer = py_json(
        r#"
h = connect(sys.argv[1])
data = open(sys.argv[2], "rb").read()
for lba in (int(sys.argv[3]), int(sys.argv[4])):
    h.pwrite(data, lba * 4096)
h.flush()
same = all(h.pread(4096, lba * 4096) == data for lba in (int(sys.argv[3]), int(sys.argv[4])))
print(json.dumps({"same": same, "size": h.get_size()}))
"#,
        &[
            &server.uri,
            s(&file),
            &packed_lba.to_string(),
            &split_lba.to_string(),
        ],
    );
    server.stop();
    assert_eq!(answer["same"], true, "{answer}");
    assert_eq!(answer["size"].as_u64(), Some(new));
    assert_check_clean(&path);
    let written = export_bytes(&path, &dir.join("written.img"));
    for lba in [packed_lba, split_lba] {
        let at = (lba * BLOCK) as usize;
        assert!(written[at..at + BLOCK as usize] == block[..], "LBA {lba}");
    }

    // A shrink over the written tail is refused naming its first LBA.
    let output = vouch(&["resize", s(&path), &(OLD_BLOCKS * BLOCK).to_string()]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains(&format!("LBA {packed_lba} ")),
        "{}",
        text(&output)
    );
    assert_eq!(layouts_and_size(&path).1, new);

    // Trimmed, the tail holds nothing: the shrink drops the third region.
    let mut server = Server::start(dir, &[s(&path)]);
    py_json(
        r#"
h = connect(sys.argv[1])
h.trim(int(sys.argv[3]) - int(sys.argv[2]), int(sys.argv[2]))
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[
            &server.uri,
            &(OLD_BLOCKS * BLOCK).to_string(),
            &new.to_string(),
        ],
    );
    server.stop();
    vouch_ok(&["resize", s(&path), &(OLD_BLOCKS * BLOCK).to_string()]);
    assert_eq!(
        layouts_and_size(&path),
        (vec!["packed".into(), "packed".into()], OLD_BLOCKS * BLOCK)
    );
    assert_check_clean(&path);
    assert_eq!(export_bytes(&path, &dir.join("shrunk.img")), before);

    // Back home: a one-layout volume with the same data.
    vouch_ok(&["migrate", s(&path), "--layout", "split"]);
    assert!(info_json(&path)["regions"].is_null());
    assert_eq!(export_bytes(&path, &dir.join("home.img")), before);
}

/// A resize cut short between the members (the other member resized, the
/// home not: what a crash there leaves) is undone by the next open: the
/// volume keeps the home's size, both members say it, and it checks
/// clean with the same data; the resize run again finishes.
#[test]
fn a_resize_cut_between_the_members_is_undone_by_the_next_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let path = written_volume(dir);
    vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    let before = export_bytes(&path, &dir.join("before.img"));
    // The other member alone grown, as a crash after step 1 leaves it.
    let home = vouch_engine::volume_superblock(&path).expect("home");
    let member = vouch_engine::regions::member_path(&path, home.layout);
    let stopped = vouch_engine::resize::resize(
        &vouch_engine::snapshot::RealFs::default(),
        &path,
        NEW_BLOCKS * BLOCK,
        vouch_engine::resize::ResizeBreaks {
            stop_after_member: true,
            ..Default::default()
        },
    );
    assert!(stopped.is_err(), "the break did not stop it: {stopped:?}");
    assert_ne!(
        vouch_engine::volume_superblock(&member)
            .expect("member")
            .size_bytes,
        home.size_bytes
    );
    // A snapshot taken now is of the volume the open finishes: both its
    // members at the home's size, checked clean (never the members'
    // files as the cut resize left them).
    vouch_ok(&["snapshot", "create", "--copy", s(&path), "s1"]);
    let snap = path.join("snapshots/s1");
    assert_eq!(layouts_and_size(&snap).1, OLD_BLOCKS * BLOCK);
    assert_check_clean(&snap);
    assert_check_clean(&path);
    assert_eq!(
        layouts_and_size(&path),
        (vec!["packed".into(), "packed".into()], OLD_BLOCKS * BLOCK)
    );
    assert_eq!(export_bytes(&path, &dir.join("after.img")), before);
    vouch_ok(&["resize", s(&path), &(NEW_BLOCKS * BLOCK).to_string()]);
    assert_eq!(layouts_and_size(&path).1, NEW_BLOCKS * BLOCK);
    assert_check_clean(&path);
}

/// A resize across a region's end stopped once the record of the new
/// count is durable in `regions.resize` (the home not switched), and one
/// stopped once the home has the new size (the record not renamed yet):
/// what a crash at those points leaves. The next open keeps the home's
/// size with a record of its region count (removing, or putting in place,
/// `regions.resize`) and both members at that size; the data is the
/// same and `check` is clean.
#[test]
fn a_resize_cut_around_the_record_of_the_new_count_is_finished_by_the_next_open() {
    let stop = |after_record: bool| vouch_engine::resize::ResizeBreaks {
        stop_after_record: after_record,
        stop_after_home: !after_record,
        ..Default::default()
    };
    for (after_record, regions, size) in [(true, 2, OLD_BLOCKS), (false, 3, NEW_BLOCKS)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let dir = dir.path();
        let path = written_volume(dir);
        vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
        let before = export_bytes(&path, &dir.join("before.img"));
        let stopped = vouch_engine::resize::resize(
            &vouch_engine::snapshot::RealFs::default(),
            &path,
            NEW_BLOCKS * BLOCK,
            stop(after_record),
        );
        assert!(stopped.is_err(), "the break did not stop it: {stopped:?}");
        assert!(path.join("regions.resize").exists());
        assert_check_clean(&path);
        assert!(!path.join("regions.resize").exists());
        let (layouts, bytes) = layouts_and_size(&path);
        assert_eq!((layouts.len(), bytes), (regions, size * BLOCK));
        let now = export_bytes(&path, &dir.join("now.img"));
        assert!(now[..before.len()] == before[..], "data changed");
        assert!(now[before.len()..].iter().all(|byte| *byte == 0));
    }
}
