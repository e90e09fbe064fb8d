//! `vouch resize` of a mirror with local legs, offline: every leg grown
//! (qemu-img and nbdinfo see the new size over NBD, a client writes the
//! new last block, the data is the same), a shrink over that refused
//! naming its LBA, shrunk once it is trimmed; `check` clean on every leg.
//! A resize cut short between legs (one leg resized, the other not) is
//! refused by the mirror's open, naming the leg, and finished by the
//! resize run again. A stale leg is refused by name.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::clients::{nbdinfo, qemu_img};
use common::*;

const MIB: u64 = 1 << 20;

/// Both legs' superblocks' sizes.
fn leg_sizes(a: &Path, b: &Path) -> (u64, u64) {
    let size = |leg: &Path| {
        vouch_engine::volume_superblock(leg)
            .expect("superblock")
            .size_bytes
    };
    (size(a), size(b))
}

/// Over NBD: the size qemu-img and nbdinfo see (they must agree), and
/// `tagged` blocks reading as `write_tagged_blocks` wrote them.
fn served_size_and_tagged(dir: &Path, leg: &Path, tagged: u64) -> u64 {
    let mut server = Server::start(dir, &[s(leg)]);
    let info = run_ok(Command::new(qemu_img()).args(["info", "--output=json", &server.uri]));
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("qemu-img json");
    let nbd = run_ok(Command::new(nbdinfo()).args(["--size", &server.uri]));
    let seen = String::from_utf8_lossy(&nbd.stdout).trim().to_string();
    assert_eq!(
        info["virtual-size"].as_u64().map(|v| v.to_string()),
        Some(seen.clone())
    );
    let answer = py_json(
        r#"
h = connect(sys.argv[1])
same = all(h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba) for lba in range(int(sys.argv[2])))
print(json.dumps({"same": same}))
"#,
        &[&server.uri, &tagged.to_string()],
    );
    server.stop();
    assert_eq!(answer["same"], true, "the tagged blocks read other data");
    seen.parse().expect("a size")
}

/// A 4 MiB mirror of legs `dir/a` and `dir/b`, blocks 0..32 tagged.
fn tagged_mirror(dir: &Path) -> (PathBuf, PathBuf) {
    let (a, b) = (dir.join("a"), dir.join("b"));
    vouch_ok(&["create", s(&a), "--size", "4M", "--mirror", s(&b)]);
    let mut server = Server::start(dir, &[s(&a)]);
    write_tagged_blocks(&server.uri, 32);
    server.stop();
    (a, b)
}

#[test]
fn a_mirror_grows_and_shrinks_with_every_leg() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (a, b) = tagged_mirror(dir);

    // Grow through the second leg's path: every leg has the new size.
    let output = vouch_ok(&["resize", s(&b), "10M"]);
    assert!(text(&output).contains("2 legs"), "{}", text(&output));
    assert_eq!(leg_sizes(&a, &b), (10 * MIB, 10 * MIB));
    assert_check_clean(&a);
    assert_check_clean(&b);
    assert_eq!(served_size_and_tagged(dir, &a, 32), 10 * MIB);

    // A client writes the new last block; both legs hold it.
    let last = 10 * MIB / BLOCK - 1;
    let mut server = Server::start(dir, &[s(&a)]);
    py_json(
        r#"
h = connect(sys.argv[1])
lba = int(sys.argv[2])
h.pwrite(block_data(lba, 7), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri, &last.to_string()],
    );
    server.stop();
    assert_check_clean(&a);
    for leg in [&a, &b] {
        let raw = dir.join("leg.raw");
        let _ = std::fs::remove_file(&raw);
        let volume = vouch_engine::open_volume(
            leg,
            &vouch_engine::OpenOptions {
                read_only: true,
                ..Default::default()
            },
        )
        .expect("open a leg read-only");
        let mut block = vec![0u8; BLOCK as usize];
        vouch_engine::BlockDevice::read(&volume, last * BLOCK, &mut block).expect("read");
        volume.close().expect("close");
        assert!(
            block.iter().any(|byte| *byte != 0),
            "{}: the last block is empty",
            leg.display()
        );
    }

    // A shrink over it is refused naming its LBA, on no leg done.
    let output = vouch(&["resize", s(&a), "4M"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains(&format!("LBA {last} ")),
        "{}",
        text(&output)
    );
    assert_eq!(leg_sizes(&a, &b), (10 * MIB, 10 * MIB));

    // Trimmed, the tail holds nothing: every leg is shrunk.
    let mut server = Server::start(dir, &[s(&a)]);
    py_json(
        r#"
h = connect(sys.argv[1])
h.trim(6 * 1048576, 4 * 1048576)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    vouch_ok(&["resize", s(&a), "4M"]);
    assert_eq!(leg_sizes(&a, &b), (4 * MIB, 4 * MIB));
    assert_check_clean(&a);
    assert_check_clean(&b);
    assert_eq!(served_size_and_tagged(dir, &a, 32), 4 * MIB);
}

#[test]
fn a_mirror_resize_cut_between_legs_is_refused_then_finished() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (a, b) = tagged_mirror(dir);

    // One leg resized, the other not: what a crash between them leaves.
    vouch_engine::resize::resize_mirror_leg(
        &vouch_engine::snapshot::RealFs::default(),
        &a,
        6 * MIB,
    )
    .expect("resize one leg");
    assert_eq!(leg_sizes(&a, &b), (6 * MIB, 4 * MIB));
    // Never served at a size one leg lacks: the open refuses, naming it.
    let refused = Server::try_start(dir, &[s(&a)])
        .err()
        .expect("served legs of two sizes");
    assert!(refused.contains("cut short between legs"), "{refused}");
    // The resize run again finishes it.
    vouch_ok(&["resize", s(&a), "6M"]);
    assert_eq!(leg_sizes(&a, &b), (6 * MIB, 6 * MIB));
    assert_check_clean(&a);
    assert_check_clean(&b);
    assert_eq!(served_size_and_tagged(dir, &a, 32), 6 * MIB);
}

#[test]
fn a_mirror_with_a_stale_leg_is_not_resized() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (a, b) = (dir.join("a"), dir.join("b"));
    vouch_ok(&["create", s(&a), "--size", "4M", "--mirror", s(&b)]);
    // Served without b: b is marked stale.
    let hidden = dir.join("b.away");
    std::fs::rename(&b, &hidden).expect("hide b");
    let mut server = Server::start(dir, &[s(&a)]);
    write_tagged_blocks(&server.uri, 4);
    server.stop();
    std::fs::rename(&hidden, &b).expect("put b back");
    let output = vouch(&["resize", s(&a), "8M"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains(&format!("{} is stale", b.display())),
        "{}",
        text(&output)
    );
    assert_eq!(leg_sizes(&a, &b), (4 * MIB, 4 * MIB));
}
