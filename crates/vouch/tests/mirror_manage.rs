//! `vouch mirror add|remove` (offline membership changes) with real
//! processes and a real NBD client: a plain volume becomes a 2-leg then a
//! 3-leg mirror whose new legs hold every block (proved by corrupting the
//! original leg and reading through NBD: served and repaired from a new
//! leg); legs are removed down to a plain volume that still serves the
//! data; bad requests are refused by name and change nothing.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;

const WRITE: &str = r#"
h = connect(sys.argv[1])
for lba in range(32):
    h.pwrite(block_data(lba, 7000 + lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#;

const READ: &str = r#"
h = connect(sys.argv[1])
bad = [lba for lba in range(32) if h.pread(4096, lba * 4096) != block_data(lba, 7000 + lba)]
print(json.dumps({"bad": bad}))
"#;

/// Serve `path` alone and check every block reads its data.
fn assert_serves_data(dir: &Path, path: &Path) {
    let mut server = Server::start(dir, &[s(path)]);
    let result = py_json(READ, &[&server.uri]);
    assert_eq!(result["bad"], serde_json::json!([]), "{}", path.display());
    server.stop();
}

fn status(path: &Path) -> serde_json::Value {
    let output = vouch(&["mirror", "status", s(path), "--json"]);
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("mirror status --json ({e}):\n{}", text(&output)))
}

fn flip(path: &Path, offset: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path.join("data.00000"))
        .expect("open data");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset).expect("read");
    byte[0] ^= 0x40;
    file.write_all_at(&byte, offset).expect("write");
}

#[test]
fn a_plain_volume_gains_legs_and_loses_them_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b, c) = (d.join("a"), d.join("b"), d.join("c"));
    vouch_ok(&["create", s(&a), "--size", "1MiB"]);
    let mut server = Server::start(d, &[s(&a)]);
    py_json(WRITE, &[&server.uri]);
    server.stop();

    // Plain -> 2 legs: b holds every block, verified.
    let output = vouch_ok(&["mirror", "add", s(&a), s(&b)]);
    assert!(
        text(&output).contains("256 blocks copied and verified"),
        "{}",
        text(&output)
    );
    let legs = status(&a);
    assert_eq!(legs["legs"].as_array().map(Vec::len), Some(2), "{legs}");
    assert_check_clean(&a);
    // Prove b holds the data: corrupt a's copy of LBA 5; reads through NBD
    // are right (from b where a fails), and a scrub repairs a from b.
    flip(&a, 5 * BLOCK + 100);
    assert!(
        !vouch(&["check", s(&a)]).status.success(),
        "leg a must show the fault"
    );
    assert_serves_data(d, &a);
    vouch_ok(&["scrub", s(&a)]);
    assert_check_clean(&a);

    // 2 -> 3 legs, and no fourth.
    vouch_ok(&["mirror", "add", s(&b), s(&c)]);
    assert_eq!(status(&a)["legs"].as_array().map(Vec::len), Some(3));
    let output = vouch(&["mirror", "add", s(&a), s(&d.join("d"))]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains("already has 3 legs"),
        "{}",
        text(&output)
    );
    assert!(!d.join("d").exists(), "a refused add leaves nothing");

    // Remove leg 0 (a): b and c remain and serve the data.
    let output = vouch_ok(&["mirror", "remove", s(&b), "--leg", "0"]);
    assert!(text(&output).contains("2 legs remain"), "{}", text(&output));
    let view = status(&c);
    assert_eq!(view["legs"].as_array().map(Vec::len), Some(2), "{view}");
    assert_serves_data(d, &b);
    // a is a plain volume now, with the data as of its removal.
    let info = info_json(&a);
    assert!(info.get("mirror").is_none_or(|m| m.is_null()), "{info}");
    assert_serves_data(d, &a);

    // Down to one leg: c is a plain volume.
    let output = vouch_ok(&["mirror", "remove", s(&c), "--leg", "0"]);
    assert!(
        text(&output).contains("is a plain volume now"),
        "{}",
        text(&output)
    );
    assert!(!c.join("mirror").exists());
    assert_serves_data(d, &c);
    assert_check_clean(&c);
}

#[test]
fn bad_membership_changes_are_refused_by_name_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b) = (d.join("a"), d.join("b"));
    vouch_ok(&["create", s(&a), "--size", "1MiB", "--mirror", s(&b)]);
    let before = std::fs::read(a.join("mirror")).expect("record");

    // The new leg's directory exists already.
    std::fs::create_dir(d.join("taken")).expect("mkdir");
    let output = vouch(&["mirror", "add", s(&a), s(&d.join("taken"))]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains("already exists"),
        "{}",
        text(&output)
    );
    // An unknown leg.
    let output = vouch(&["mirror", "remove", s(&a), "--leg", "5"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(text(&output).contains("has no leg 5"), "{}", text(&output));
    // While a server has the volume open.
    let mut server = Server::start(d, &[s(&a)]);
    let output = vouch(&["mirror", "remove", s(&a), "--leg", "1"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(text(&output).contains("in use"), "{}", text(&output));
    server.stop();
    assert_eq!(std::fs::read(a.join("mirror")).expect("record"), before);

    // The only active leg cannot go: fault b's record state first by
    // removing its directory and opening the set for writing (b goes stale).
    std::fs::rename(&b, d.join("b-away")).expect("move b away");
    let mut server = Server::start(d, &[s(&a)]);
    server.stop();
    let output = vouch(&["mirror", "remove", s(&a), "--leg", "0"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains("only active leg"),
        "{}",
        text(&output)
    );
    // Removing the stale leg is fine and warns.
    let output = vouch_ok(&["mirror", "remove", s(&a), "--leg", "1"]);
    assert!(
        text(&output).contains("plain volume now"),
        "{}",
        text(&output)
    );
    assert_check_clean(&a);
}

#[test]
fn a_copy_of_a_leg_is_refused_and_the_original_legs_are_left_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b, copy) = (d.join("a"), d.join("b"), d.join("copy"));
    vouch_ok(&["create", s(&a), "--size", "1MiB", "--mirror", s(&b)]);
    let mut server = Server::start(d, &[s(&a)]);
    py_json(WRITE, &[&server.uri]);
    server.stop();
    let status = std::process::Command::new("cp")
        .args(["-a", s(&a), s(&copy)])
        .status()
        .expect("cp");
    assert!(status.success(), "cp -a");
    let records = || {
        (
            std::fs::read(a.join("mirror")).expect("a's record"),
            std::fs::read(b.join("mirror")).expect("b's record"),
        )
    };
    let before = records();
    // Every command that opens the set from the copy refuses, naming the
    // leg it was copied from; none opens (or marks, or writes) a or b.
    for args in [
        vec!["check", s(&copy)],
        vec!["info", s(&copy)],
        vec!["mirror", "status", s(&copy)],
        vec!["serve", s(&copy), "--listen", "127.0.0.1:1"],
    ] {
        let output = vouch(&args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
        assert!(
            text(&output).contains("is a copy of that leg") && text(&output).contains(s(&a)),
            "{args:?}: {}",
            text(&output)
        );
    }
    assert_eq!(records(), before, "the original legs' records changed");
    // A symbolic link to the leg is the leg itself.
    std::os::unix::fs::symlink(&a, d.join("link")).expect("symlink");
    assert_check_clean(&d.join("link"));
    assert_serves_data(d, &a);
}
