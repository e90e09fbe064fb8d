//! A clone keeps its origin's uuid (tags, AD) but is another volume: its
//! superblock's `instance` differs, so a clone offered as a mirror leg
//! (local) or as a replica (remote) of its origin is refused by name
//! instead of being read as an in-sync copy. A volume whose instance is
//! zero (written by a binary from before the field) still serves and
//! mirrors.

mod common;
mod replica_support;

use std::path::Path;

use common::*;
use replica_support::*;
use vouch_format::superblock::Superblock;

/// Snapshot `volume` and clone the snapshot to `clone` (full copies: the
/// test directory may be on a filesystem that cannot share blocks).
fn clone_of(volume: &Path, clone: &Path) {
    vouch_ok(&["snapshot", "create", s(volume), "s", "--copy"]);
    let snapshot = volume.join("snapshots/s");
    vouch_ok(&["clone", s(&snapshot), s(clone), "--copy"]);
}

fn instance(volume: &Path) -> [u8; 16] {
    vouch_engine::volume_superblock(volume)
        .expect("superblock")
        .instance
}

/// Replace the volume files of `leg` with `clone`'s, keeping `leg`'s
/// mirror record: the clone now sits where the leg was.
fn put_clone_in_place_of(clone: &Path, leg: &Path) {
    let record = std::fs::read(leg.join("mirror")).expect("leg record");
    std::fs::remove_dir_all(leg).expect("remove leg");
    let status = std::process::Command::new("cp")
        .args(["-a", s(clone), s(leg)])
        .status()
        .expect("cp");
    assert!(status.success(), "cp -a");
    std::fs::write(leg.join("mirror"), record).expect("record");
}

#[test]
fn a_clone_gets_its_own_instance_and_is_refused_as_a_leg_of_its_origin() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b, c) = (d.join("a"), d.join("b"), d.join("c"));
    vouch_ok(&["create", s(&a), "--size", "1MiB"]);
    clone_of(&a, &c);
    let snapshot = instance(&a.join("snapshots/s"));
    assert_eq!(snapshot, instance(&a), "a snapshot keeps its volume's");
    assert_ne!(instance(&c), instance(&a), "a clone gets its own");
    assert_ne!(instance(&c), [0; 16]);
    vouch_ok(&["snapshot", "delete", s(&a), "s"]);
    vouch_ok(&["mirror", "add", s(&a), s(&b)]);
    assert_eq!(instance(&b), instance(&a), "a mirror's legs share one");
    assert_check_clean(&a);
    put_clone_in_place_of(&c, &b);
    for args in [
        vec!["mirror", "status", s(&a)],
        vec!["check", s(&a)],
        vec!["serve", s(&a), "--listen", "127.0.0.1:1"],
    ] {
        let output = vouch(&args);
        assert!(!output.status.success(), "{args:?}: {}", text(&output));
        assert!(
            text(&output).contains(&format!("{} is a clone of", b.display()))
                && text(&output).contains("`vouch mirror add` a fresh volume instead"),
            "{args:?}: {}",
            text(&output)
        );
    }
}

/// Zero `volume`'s instance in both superblock copies, as a binary from
/// before the field leaves it when it rewrites the superblock.
fn forget_instance(volume: &Path) {
    let file = volume.join("superblock");
    let mut bytes = std::fs::read(&file).expect("superblock");
    for copy in 0..2 {
        let at = copy * 4096;
        let mut superblock =
            Superblock::decode(&bytes[at..at + 256]).expect("a valid superblock copy");
        superblock.instance = [0; 16];
        bytes[at..at + 256].copy_from_slice(&superblock.encode());
        assert_eq!(&bytes[at + 220..at + 236], &[0; 16]);
    }
    std::fs::write(&file, bytes).expect("write superblock");
}

#[test]
fn a_volume_without_an_instance_still_serves_and_mirrors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let (a, b, c) = (d.join("a"), d.join("b"), d.join("c"));
    vouch_ok(&["create", s(&a), "--size", "1MiB"]);
    forget_instance(&a);
    let data = random_bytes(1 << 20, 33);
    let image = d.join("image");
    std::fs::write(&image, &data).expect("image");
    let mut server = Server::start(d, &[s(&a)]);
    run_ok(
        std::process::Command::new("nbdcopy")
            .arg(&image)
            .arg(&server.uri),
    );
    server.stop();
    assert_eq!(instance(&a), [0; 16], "an unknown instance stays unknown");
    vouch_ok(&["mirror", "add", s(&a), s(&b)]);
    assert_eq!(instance(&b), [0; 16]);
    assert_check_clean(&a);
    let status = text(&vouch_ok(&["mirror", "status", s(&a)]));
    assert!(
        status.contains(&format!("{}: active", b.display())),
        "{status}"
    );
    let mut server = Server::start(d, &[s(&a)]);
    let out = d.join("out");
    run_ok(
        std::process::Command::new("nbdcopy")
            .arg(&server.uri)
            .arg(&out),
    );
    server.stop();
    assert!(
        std::fs::read(&out).expect("out") == data,
        "served data differs"
    );
    // A clone of it gets an instance, so it is never taken for a leg.
    vouch_ok(&["mirror", "remove", s(&a), "--leg", "1"]);
    clone_of(&a, &c);
    assert_ne!(instance(&c), [0; 16]);
}

#[test]
fn a_clone_is_refused_as_a_replica_of_its_origin() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let replicas = d.join("replicas");
    let mut replica = replica_server(&replicas, "127.0.0.1:0", &[], None).expect("replica");
    let (a, c) = (d.join("a"), d.join("c"));
    let url = format!("vouch://{}/ra", replica.addr);
    vouch_ok(&["create", s(&a), "--size", "1MiB", "--mirror", &url]);
    let status = text(&vouch_ok(&["mirror", "status", s(&a)]));
    assert!(status.contains(&format!("{url}: active")), "{status}");
    // Snapshots are of plain volumes: take one with the record aside.
    let record = std::fs::read(a.join("mirror")).expect("record");
    std::fs::remove_file(a.join("mirror")).expect("remove record");
    clone_of(&a, &c);
    std::fs::write(a.join("mirror"), record).expect("record back");
    std::fs::rename(replicas.join("ra"), replicas.join("held")).expect("rename");
    std::fs::rename(&c, replicas.join("ra")).expect("rename");
    let output = vouch(&["mirror", "status", s(&a)]);
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains(&format!("replica {url} is a clone of this volume"))
            && text(&output).contains("`vouch mirror add` a fresh volume instead"),
        "{}",
        text(&output)
    );
    // The real replica back: accepted again.
    std::fs::rename(replicas.join("ra"), d.join("c")).expect("rename");
    std::fs::rename(replicas.join("held"), replicas.join("ra")).expect("rename");
    let status = text(&vouch_ok(&["mirror", "status", s(&a)]));
    assert!(status.contains(&format!("{url}: active")), "{status}");
    replica.stop();
}
