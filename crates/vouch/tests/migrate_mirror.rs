//! `vouch migrate LEG --layout L` of a mirror (issue 33), through the CLI
//! on real files: a 2-way mirror written through NBD moves split ->
//! packed -> split, each leg exporting the same image and checking clean
//! at each step; a corrupt block on leg 0 is taken from leg 1 and the
//! migration completes; a crash before and after a leg's swap leaves a
//! set that serves (its legs in two layouts) and a rerun finishes it; a
//! remote leg is refused with nothing changed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

const SIZE_BLOCKS: u64 = 2048;

/// Data (two runs, one crossing a packed row), written zeroes and a trim
/// over written blocks, through NBD; the rest never written.
const WRITE: &str = r#"
h = connect(sys.argv[1])
tag = int(sys.argv[2])
for lba in list(range(0, 64)) + list(range(1000, 1100)):
    h.pwrite(block_data(lba, tag + lba), lba * 4096)
h.zero(10 * 4096, 20 * 4096)
h.zero(300 * 4096, 1500 * 4096)
h.trim(10 * 4096, 40 * 4096)
h.trim(5 * 4096, 1090 * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#;

/// The image as a client reads it, hashed.
const READ: &str = r#"
h = connect(sys.argv[1])
size = h.get_size()
digest = hashlib.sha256()
at = 0
while at < size:
    digest.update(h.pread(min(1 << 20, size - at), at))
    at += 1 << 20
print(json.dumps({"sha256": digest.hexdigest()}))
"#;

/// A 2-leg mirror `a` + `b` of `layout` in `dir`, written through NBD.
fn written_mirror(dir: &Path, layout: &str) -> (PathBuf, PathBuf) {
    let (a, b) = (dir.join("a"), dir.join("b"));
    vouch_ok(&[
        "create",
        s(&a),
        "--size",
        "8MiB",
        "--layout",
        layout,
        "--mirror",
        s(&b),
    ]);
    let mut server = Server::start(dir, &[s(&a)]);
    py_json(WRITE, &[&server.uri, "1000"]);
    server.stop();
    (a, b)
}

/// The layout the leg's superblock says.
fn layout_of(leg: &Path) -> String {
    vouch_engine::volume_superblock(leg)
        .unwrap_or_else(|error| panic!("{}: {error}", leg.display()))
        .layout
        .name()
        .to_string()
}

/// The image a client reads from the set served from `leg`.
fn served_sha(dir: &Path, leg: &Path) -> String {
    let mut server = Server::start(dir, &[s(leg)]);
    let read = py_json(READ, &[&server.uri]);
    server.stop();
    read["sha256"].as_str().expect("sha256").to_string()
}

/// Each leg exported alone equals `image`, and the set checks clean (every
/// leg, `check` of a mirror leg).
fn assert_legs_hold(dir: &Path, legs: &[&Path], image: &[u8]) {
    for (index, leg) in legs.iter().enumerate() {
        let exported = exported(leg, dir, &format!("leg{index}"));
        assert!(
            exported == image,
            "leg {index} ({}) does not export the image it held before",
            leg.display()
        );
    }
    assert_check_clean(legs[0]);
}

fn migrate(leg: &Path, layout: &str) -> std::process::Output {
    vouch(&["migrate", s(leg), "--layout", layout])
}

#[test]
fn a_two_way_mirror_moves_split_to_packed_and_back_every_block_the_same() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b) = written_mirror(d, "split");
    let image = exported(&a, d, "before");
    assert_eq!(image.len() as u64, SIZE_BLOCKS * BLOCK);
    let served = served_sha(d, &a);

    let output = migrate(&a, "packed");
    assert!(output.status.success(), "{}", text(&output));
    let said = text(&output);
    assert!(
        said.contains("leg 0") && said.contains("split -> packed"),
        "{said}"
    );
    assert!(
        said.contains("every leg of the mirror is packed now"),
        "{said}"
    );
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("packed".into(), "packed".into())
    );
    assert!(!d.join(".a.migrating").exists() && !d.join(".b.migrating").exists());
    assert_legs_hold(d, &[&a, &b], &image);
    assert_eq!(served_sha(d, &a), served, "the set serves another image");

    // Once more: nothing to do.
    let output = migrate(&b, "packed");
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("in packed already"),
        "{}",
        text(&output)
    );

    // The set written in packed, then back to split from leg b's path.
    let mut server = Server::start(d, &[s(&a)]);
    py_json(WRITE, &[&server.uri, "5000"]);
    server.stop();
    let image = exported(&a, d, "packed");
    let output = migrate(&b, "split");
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("split".into(), "split".into())
    );
    assert_legs_hold(d, &[&a, &b], &image);
}

/// Flip a bit of LBA `lba`'s data in the split leg `leg`.
fn corrupt_split_block(leg: &Path, lba: u64) {
    flip_bit(&leg.join("data.00000"), lba * BLOCK + 100, 0x10);
}

#[test]
fn a_corrupt_block_on_leg_0_is_taken_from_leg_1_and_the_migration_completes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b) = written_mirror(d, "split");
    let image = exported(&a, d, "before");
    corrupt_split_block(&a, 7);
    assert!(
        !vouch(&["check", s(&a)]).status.success(),
        "the flipped block must show"
    );

    let output = migrate(&a, "packed");
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("1 taken from another leg (failed on this one: LBAs 7)"),
        "{}",
        text(&output)
    );
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("packed".into(), "packed".into())
    );
    assert_legs_hold(d, &[&a, &b], &image);
}

#[test]
fn a_block_corrupt_on_every_leg_stops_the_migration_naming_it_every_leg_as_it_was() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b) = written_mirror(d, "split");
    corrupt_split_block(&a, 9);
    corrupt_split_block(&b, 9);
    let output = migrate(&a, "packed");
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("LBA 9 failed verification on mirror leg 0"),
        "{}",
        text(&output)
    );
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("split".into(), "split".into())
    );
    assert!(!d.join(".a.migrating").exists(), "the partial leg must go");
}

/// `vouch migrate` of the mirror at `leg`, aborted at `stage` (`0:before`,
/// `0:after`): a crash there.
fn migrate_crashing(leg: &Path, layout: &str, stage: &str) {
    let output = run(Command::new(vouch_bin())
        .args(["migrate", s(leg), "--layout", layout])
        .env("VOUCH_TEST_MIGRATE_MIRROR_CRASH_AT", stage));
    assert!(
        !output.status.success() && output.status.code().is_none(),
        "the run must die at {stage}: {}",
        text(&output)
    );
}

#[test]
fn a_crash_before_or_after_a_legs_swap_leaves_a_set_that_serves_and_a_rerun_finishes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b) = written_mirror(d, "split");
    let image = exported(&a, d, "before");
    let served = served_sha(d, &a);

    // Before leg 0's swap: leg 0 untouched, its partial rebuild named by
    // nothing.
    migrate_crashing(&a, "packed", "0:before");
    assert!(d.join(".a.migrating").exists());
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("split".into(), "split".into())
    );
    assert_eq!(served_sha(d, &a), served);

    // After it: leg 0 packed, leg 1 split, the old leg 0 left aside. The
    // set serves, and takes writes on both legs.
    migrate_crashing(&a, "packed", "0:after");
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("packed".into(), "split".into())
    );
    assert!(d.join(".a.migrating").exists());
    assert_eq!(
        served_sha(d, &a),
        served,
        "a set of two layouts serves its image"
    );
    assert_legs_hold(d, &[&a, &b], &image);
    let mut server = Server::start(d, &[s(&a)]);
    py_json(WRITE, &[&server.uri, "9000"]);
    server.stop();
    let image = exported(&a, d, "mixed");
    assert_legs_hold(d, &[&a, &b], &image);

    // The rerun removes what the crash left and finishes leg 1.
    let output = migrate(&a, "packed");
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("left by a migration cut short"),
        "{}",
        text(&output)
    );
    assert!(text(&output).contains("leg 0") && text(&output).contains("in packed already"));
    assert!(!d.join(".a.migrating").exists());
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("packed".into(), "packed".into())
    );
    assert_legs_hold(d, &[&a, &b], &image);
}

#[test]
fn a_mirror_with_a_remote_leg_is_refused_with_nothing_changed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b) = written_mirror(d, "split");
    // Leg 1 renamed in the set's records to a replica's URL (never
    // reached: the refusal comes first).
    let mut record = vouch_mirror::set::read_record(&a).expect("record");
    record.members[1].path = "vouch://127.0.0.1:20601/b".into();
    vouch_mirror::set::write_record(&a, &record).expect("write record");
    let before = std::fs::read(a.join("mirror")).expect("read record");
    let output = migrate(&a, "packed");
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains(
            "mirror leg 1 (vouch://127.0.0.1:20601/b) is a remote replica: the replica protocol has no migrate"
        ),
        "{}",
        text(&output)
    );
    assert_eq!(layout_of(&a), "split");
    assert_eq!(
        std::fs::read(a.join("mirror")).expect("read record"),
        before
    );
    assert!(!d.join(".a.migrating").exists());
    let _ = b;
}

#[test]
fn an_encrypted_mirror_moves_to_packed_with_its_key_every_block_the_same() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let key = d.join("test.key");
    std::fs::write(&key, [0x5a; 32]).expect("write key");
    let (a, b) = (d.join("a"), d.join("b"));
    vouch_ok(&[
        "create",
        s(&a),
        "--size",
        "8MiB",
        "--layout",
        "split",
        "--encrypt",
        "--key-file",
        s(&key),
        "--mirror",
        s(&b),
    ]);
    let mut server = Server::start(d, &[s(&a), "--key-file", s(&key)]);
    py_json(WRITE, &[&server.uri, "3000"]);
    server.stop();
    let export = |leg: &Path, name: &str| -> Vec<u8> {
        let raw = d.join(format!("{name}.raw"));
        vouch_ok(&["export", s(leg), s(&raw), "--key-file", s(&key)]);
        std::fs::read(&raw).expect("read export")
    };
    let image = export(&a, "before");
    assert!(image.iter().any(|byte| *byte != 0), "the image holds data");

    let output = vouch(&[
        "migrate",
        s(&a),
        "--layout",
        "packed",
        "--key-file",
        s(&key),
    ]);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(
        (layout_of(&a), layout_of(&b)),
        ("packed".into(), "packed".into())
    );
    assert!(export(&a, "a") == image, "leg a exports another image");
    assert!(export(&b, "b") == image, "leg b exports another image");
    let output = vouch(&["check", s(&a), "--key-file", s(&key)]);
    assert!(output.status.success(), "{}", text(&output));
}
