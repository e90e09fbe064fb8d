//! Snapshots of a mirrored volume (issue 33): one copy per active leg
//! (`LEG/snapshots/NAME`) taken at one flush point, offline and through
//! the server; served as a read-only mirror of the copies, so a block bad
//! in one copy is read from another; listed by leg (a stale leg has no
//! copy, legs that disagree after an interrupted create are named);
//! deleted from every leg; changed blocks over NBD from a leg's copy. A
//! mirror with a remote leg gets a copy on its replica too.

mod common;
mod replica_support;

use std::path::{Path, PathBuf};

use common::clients::nbdinfo_json;
use common::*;

/// The whole export at `uri` read with nbdcopy.
fn nbdcopied(uri: &str, dir: &Path, name: &str) -> Vec<u8> {
    let raw = dir.join(format!("{name}.nbdcopy"));
    let _ = std::fs::remove_file(&raw);
    run_ok(std::process::Command::new(tool("nbdcopy", "libnbd-bin")).args([uri, s(&raw)]));
    std::fs::read(&raw).expect("read nbdcopy")
}

/// A 2-leg mirror of `size` holding `data`, written through a server.
fn mirror_with(dir: &Path, data: &[u8]) -> (PathBuf, PathBuf) {
    let (leg0, leg1) = (dir.join("m0"), dir.join("m1"));
    let size = format!("{}", data.len());
    vouch_ok(&["create", s(&leg0), "--size", &size, "--mirror", s(&leg1)]);
    write_through_nbd(dir, &[s(&leg0)], 0, data);
    (leg0, leg1)
}

const SIZE: usize = 8 << 20;

/// Offline: a copy on each leg, each the data at the flush, checked per
/// copy; served from both copies (a bad block in one copy read from the
/// other, named by its LBA, never zeros); listed by leg; deleted from
/// both. Before this change `snapshot create` of a leg was refused.
#[test]
fn a_mirror_snapshot_has_a_copy_per_leg_and_a_bad_copy_is_read_from_the_other() {
    let fs = LoopFs::xfs();
    let dir = &fs.mount;
    let first = random_bytes(SIZE, 31);
    let (leg0, leg1) = mirror_with(dir, &first);
    let out = vouch_ok(&["snapshot", "create", s(&leg1), "s1"]);
    assert!(text(&out).contains("2 copies"), "{}", text(&out));
    // Written after s1: in neither copy.
    write_through_nbd(dir, &[s(&leg0)], 0, &random_bytes(1 << 20, 32));
    let copies = [leg0.join("snapshots/s1"), leg1.join("snapshots/s1")];
    for (index, copy) in copies.iter().enumerate() {
        assert!(
            exported(copy, dir, &format!("c{index}")) == first,
            "leg {index}'s copy is not the data at the flush"
        );
        assert_check_clean(copy);
        vouch_ok(&["verify", s(copy)]);
    }
    let list = text(&vouch_ok(&["snapshot", "list", s(&leg0)]));
    assert!(
        list.contains("s1\t") && list.contains("copies: leg 0, leg 1"),
        "{list}"
    );
    let listed: serde_json::Value =
        serde_json::from_slice(&vouch_ok(&["snapshot", "list", "--json", s(&leg1)]).stdout)
            .expect("json");
    assert_eq!(listed[0]["legs"][1]["copy"], s(&copies[1]), "{listed}");

    // One copy's block corrupted: `check` of that copy names its LBA, the
    // other copy is clean.
    let lba = 100u64;
    flip_bit(&copies[0].join("data.00000"), lba * BLOCK + 17, 0x40);
    let (code, faults) = check_faults(&copies[0]);
    assert_eq!(code, 1);
    assert_eq!(faults.iter().map(|f| f.0).collect::<Vec<_>>(), [lba]);
    assert_eq!(check_faults(&copies[1]), (0, Vec::new()));
    // `check` of the mirror's snapshot reports each leg's copy: the bad
    // one by its LBA.
    let output = vouch(&["check", s(&copies[1])]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let report = text(&output);
    assert!(
        report.contains("leg 0's copy")
            && report.contains("leg 1's copy")
            && report.contains(&format!("fault: LBA {lba}"))
            && report.contains(&format!("{}: ", copies[1].display())),
        "{report}"
    );

    // Served (by name, and by a copy's directory as its own export): the
    // export is read-only, reads alternate between the copies, and the bad
    // block is read from the good copy every time.
    for args in [vec!["--snapshot", "s1", s(&leg0)], vec![s(&copies[1])]] {
        let mut server = Server::start(dir, &args);
        let answer = py_json(
            r#"
h = connect(sys.argv[1], strict=False)
ro = h.is_read_only()
try:
    h.pwrite(b"x" * 4096, 0)
    refused = None
except nbd.Error as e:
    refused = e.errno
reads = [h.pread(4096, 4096 * int(sys.argv[2])).hex() for _ in range(6)]
print(json.dumps({"ro": ro, "refused": refused, "reads": reads}))
"#,
            &[&server.uri, &lba.to_string()],
        );
        assert_eq!(answer["ro"], true, "{args:?}");
        assert_eq!(answer["refused"], "EPERM", "{args:?}");
        let want: String = first[(lba * BLOCK) as usize..((lba + 1) * BLOCK) as usize]
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        for read in answer["reads"].as_array().expect("reads") {
            assert!(read == want.as_str(), "{args:?}: LBA {lba} read other data");
        }
        assert!(
            nbdcopied(&server.uri, dir, "whole") == first,
            "{args:?}: the served snapshot is not the data at the flush"
        );
        server.stop();
        let log = server.log_text();
        assert!(
            log.contains(&format!("lba={lba}")) || log.contains(&format!("lba: {lba}")),
            "{args:?}: the bad block is not reported with its LBA: {log}"
        );
    }
    // The copy that was read around stays as it was: nothing writes a
    // snapshot.
    let (code, _) = check_faults(&copies[0]);
    assert_eq!(code, 1);

    // Deleted from both legs.
    let out = vouch_ok(&["snapshot", "delete", s(&leg0), "s1"]);
    assert!(text(&out).contains("legs 0, 1"), "{}", text(&out));
    assert!(!copies[0].exists() && !copies[1].exists());
    let list = text(&vouch_ok(&["snapshot", "list", s(&leg0)]));
    assert!(list.contains("no snapshots"), "{list}");
    assert_check_clean(&leg0);
    assert_check_clean(&leg1);
}

/// What a crash between the legs' renames leaves (one leg's copy named,
/// the other's still `.NAME.partial`): `list` removes the partial copy,
/// names the legs that disagree and exits 1; the snapshot is served from
/// the copy that has its name; `delete` cleans it. A stale leg gets no
/// copy, and `list` says so without calling it a disagreement.
#[test]
fn legs_that_disagree_are_listed_and_cleaned_and_a_stale_leg_gets_no_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let data = random_bytes(4 << 20, 33);
    let (leg0, leg1) = mirror_with(dir, &data);
    // Copies of different snapshots under one name (one left on a leg
    // that was away at a delete, another taken since): never served.
    vouch_ok(&["snapshot", "create", "--copy", s(&leg0), "s0"]);
    let record = leg0.join("snapshots/s0/snapshot");
    let text0 = std::fs::read_to_string(&record).expect("record");
    let id = text0
        .split("\"id\": \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("id");
    std::fs::write(&record, text0.replace(id, "another-snapshot")).expect("write record");
    let refused = Server::try_start(dir, &["--snapshot", "s0", s(&leg1)])
        .err()
        .expect("a snapshot whose copies differ was served");
    assert!(refused.contains("are of different snapshots"), "{refused}");
    let output = vouch(&["snapshot", "list", s(&leg0)]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(text(&output).contains("different ids"), "{}", text(&output));
    vouch_ok(&["snapshot", "delete", s(&leg0), "s0"]);
    vouch_ok(&["snapshot", "create", "--copy", s(&leg0), "s1"]);
    std::fs::rename(
        leg1.join("snapshots/s1"),
        leg1.join("snapshots/.s1.partial"),
    )
    .expect("rename");
    let output = vouch(&["snapshot", "list", s(&leg0)]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let listed = text(&output);
    assert!(
        listed.contains("the legs disagree: active leg 1 has no copy")
            && stderr_of(&output).contains("removed .s1.partial of leg 1"),
        "{listed}"
    );
    assert!(!leg1.join("snapshots/.s1.partial").exists());
    let mut server = Server::start(dir, &["--snapshot", "s1", s(&leg1)]);
    assert!(nbdcopied(&server.uri, dir, "one") == data);
    server.stop();
    vouch_ok(&["snapshot", "delete", s(&leg1), "s1"]);
    assert!(!leg0.join("snapshots/s1").exists());
    let output = vouch_ok(&["snapshot", "list", s(&leg0)]);
    assert!(text(&output).contains("no snapshots"), "{}", text(&output));

    // Leg 1 away while the mirror is served: marked stale. Back, still
    // stale: the snapshot has leg 0's copy only, and `list` says why.
    let away = dir.join("m1.away");
    std::fs::rename(&leg1, &away).expect("rename");
    let mut server = Server::start(dir, &[s(&leg0)]);
    server.stop();
    std::fs::rename(&away, &leg1).expect("rename back");
    // A name a stale leg holds (an older snapshot) is not taken again.
    std::fs::create_dir_all(leg1.join("snapshots/old")).expect("mkdir");
    let output = vouch(&["snapshot", "create", "--copy", s(&leg0), "old"]);
    assert!(
        stderr_of(&output).contains("already exists on leg 1"),
        "{}",
        text(&output)
    );
    std::fs::remove_dir(leg1.join("snapshots/old")).expect("rmdir");
    vouch_ok(&["snapshot", "create", "--copy", s(&leg0), "s2"]);
    assert!(leg0.join("snapshots/s2").is_dir() && !leg1.join("snapshots/s2").exists());
    let output = vouch_ok(&["snapshot", "list", s(&leg0)]);
    assert!(
        text(&output).contains("leg 1 (stale): no copy") && !text(&output).contains("disagree"),
        "{}",
        text(&output)
    );
    // After an unclean stop the set is refused until it is served again.
    let mut server = Server::start(dir, &[s(&leg0)]);
    server.kill9();
    let output = vouch(&["snapshot", "create", "--copy", s(&leg0), "s3"]);
    assert!(
        stderr_of(&output).contains("was not closed cleanly")
            && stderr_of(&output).contains("vouch serve"),
        "{}",
        text(&output)
    );
    assert!(!leg0.join("snapshots/s3").exists());
}

/// Online (`--server`): each active leg's copy at one flush point while
/// the mirror is served; written after, the changed blocks come from a
/// leg's copy over NBD (`nbdinfo --map=qemu:dirty-bitmap:s1`), listed and
/// deleted through the server.
#[test]
fn an_online_mirror_snapshot_copies_every_leg_and_serves_its_changed_blocks() {
    let fs = LoopFs::xfs();
    let dir = &fs.mount;
    let first = random_bytes(4 << 20, 34);
    let (leg0, leg1) = mirror_with(dir, &first);
    let mut server = Server::start(dir, &[s(&leg0), "--control", "127.0.0.1:0"]);
    let control = common::control::control(&server).to_string();
    // Written and flushed before the create: in both copies.
    let before = random_bytes(1 << 20, 35);
    let file = dir.join("before.bin");
    std::fs::write(&file, &before).expect("write");
    pwrite_file(&server.uri, &file, 1 << 20);
    let out = vouch_ok(&["snapshot", "create", "--server", &control, "s1"]);
    assert!(
        text(&out).contains("held at the flush point") && text(&out).contains("m1/snapshots/s1"),
        "{}",
        text(&out)
    );
    // Written after: 8 blocks at 2 MiB, changed since s1.
    let after = random_bytes(8 * BLOCK as usize, 36);
    let file = dir.join("after.bin");
    std::fs::write(&file, &after).expect("write");
    pwrite_file(&server.uri, &file, 2 << 20);
    let map = nbdinfo_json(&server.uri, &["--map=qemu:dirty-bitmap:s1"]);
    let dirty: Vec<(u64, u64)> = map
        .as_array()
        .expect("map")
        .iter()
        .filter(|entry| entry["type"].as_u64() == Some(1))
        .map(|entry| {
            (
                entry["offset"].as_u64().expect("offset"),
                entry["length"].as_u64().expect("length"),
            )
        })
        .collect();
    assert_eq!(dirty, [(2 << 20, 8 * BLOCK)], "{map}");
    let listed = text(&vouch_ok(&["snapshot", "list", "--server", &control]));
    assert!(listed.contains("copies: leg 0, leg 1"), "{listed}");
    server.stop();

    let mut want = first.clone();
    want[1 << 20..2 << 20].copy_from_slice(&before);
    for (index, leg) in [&leg0, &leg1].iter().enumerate() {
        let copy = leg.join("snapshots/s1");
        assert!(
            exported(&copy, dir, &format!("o{index}")) == want,
            "leg {index}'s copy is not the data at the flush point"
        );
        assert_check_clean(&copy);
    }
    // `vouch diff` of a leg's copy, offline, names the same blocks.
    let diff = text(&vouch_ok(&["diff", s(&leg0.join("snapshots/s1"))]));
    assert!(
        diff.contains(&format!("{}\t{}", 2 << 20, 8 * BLOCK)),
        "{diff}"
    );

    let mut server = Server::start(dir, &[s(&leg0), "--control", "127.0.0.1:0"]);
    let control = common::control::control(&server).to_string();
    vouch_ok(&["snapshot", "delete", "--server", &control, "s1"]);
    assert!(!leg0.join("snapshots/s1").exists() && !leg1.join("snapshots/s1").exists());
    server.stop();
}

/// A mirror with a remote leg (a replica server on loopback), offline:
/// the replica takes its copy through the replica protocol (its server's
/// `DIR/NAME/snapshots/s1`), the data at the flush like the local leg's;
/// `list` shows both copies; `delete` removes both. (Online, across
/// hosts, and an old replica server: snapshot_remote.rs.)
#[test]
fn a_mirror_with_a_remote_leg_takes_a_copy_on_the_replica() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    let mut replica =
        replica_support::replica_server(&replicas, "127.0.0.1:0", &[], None).expect("replica");
    let leg0 = dir.path().join("a");
    let url = format!("vouch://{}/disk", replica.addr);
    vouch_ok(&["create", s(&leg0), "--size", "4MiB", "--mirror", &url]);
    let data = random_bytes(4 << 20, 43);
    write_through_nbd(dir.path(), &[s(&leg0)], 0, &data);
    let out = vouch_ok(&["snapshot", "create", "--copy", s(&leg0), "s1"]);
    assert!(text(&out).contains("2 copies"), "{}", text(&out));
    let list = text(&vouch_ok(&["snapshot", "list", s(&leg0)]));
    assert!(list.contains("copies: leg 0, leg 1"), "{list}");
    let remote = replicas.join("disk/snapshots/s1");
    assert!(exported(&remote, dir.path(), "r") == data);
    assert!(exported(&leg0.join("snapshots/s1"), dir.path(), "l") == data);
    vouch_ok(&["snapshot", "delete", s(&leg0), "s1"]);
    assert!(!remote.exists() && !leg0.join("snapshots/s1").exists());
    replica.stop();
}

/// Online snapshots taken while a client writes without pause: every
/// leg's copy holds the same data (the mirror's writes are held while the
/// legs' flush points are entered, so no write lands on one leg's side of
/// the flush point and the other's; were they released first, a write
/// between two legs' commits would be in one copy only).
#[test]
fn copies_taken_while_a_client_writes_are_equal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (leg0, leg1) = mirror_with(dir, &random_bytes(4 << 20, 37));
    let mut server = Server::start(dir, &[s(&leg0), "--control", "127.0.0.1:0"]);
    let control = common::control::control(&server).to_string();
    py_json(
        r#"
import os, random, subprocess, threading
uri, vouch, control = sys.argv[1], sys.argv[2], sys.argv[3]
h = connect(uri)
stop = threading.Event()
def writer():
    while not stop.is_set():
        h.pwrite(os.urandom(4096), random.randrange(1024) * 4096)
thread = threading.Thread(target=writer, daemon=True)
thread.start()
time.sleep(0.2)
for name in ["w1", "w2", "w3"]:
    out = subprocess.run([vouch, "snapshot", "create", "--copy", "--server", control, name],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit("snapshot create failed: " + out.stderr)
stop.set()
thread.join()
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri, vouch_bin(), &control],
    );
    server.stop();
    for name in ["w1", "w2", "w3"] {
        let path = format!("snapshots/{name}");
        assert!(
            exported(&leg0.join(&path), dir, "a") == exported(&leg1.join(&path), dir, "b"),
            "snapshot {name}: the legs' copies differ"
        );
    }
}
