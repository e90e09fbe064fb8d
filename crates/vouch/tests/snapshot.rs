//! `vouch snapshot` and `vouch clone` through the CLI and NBD, on a real
//! xfs (reflink=1, mkfs's default) and btrfs made on loop devices by the
//! test (needs root, `mkfs.xfs` and `mkfs.btrfs`) and unmounted by a
//! guard, and on this
//! machine's ext4 (which cannot share blocks: an overlay, or `--copy`).

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

const SIZE: usize = 8 << 20;

/// Serve `args` (a snapshot): writes are refused with EPERM (and the
/// export says read-only), and LBA 7 reads `want`.
fn served_read_only(dir: &Path, args: &[&str], want: &[u8]) {
    let mut server = Server::start(dir, args);
    let answer = py_json(
        r#"
h = connect(sys.argv[1], strict=False)   # send the write: the server must refuse it
ro = h.is_read_only()
try:
    h.pwrite(b"x" * 4096, 0)
    refused = None
except nbd.Error as e:
    refused = e.errno
data = h.pread(4096, 4096 * 7)
print(json.dumps({"ro": ro, "refused": refused, "data": data.hex()}))
"#,
        &[&server.uri],
    );
    server.stop();
    assert_eq!(answer["ro"], true, "{args:?}");
    assert_eq!(
        answer["refused"], "EPERM",
        "{args:?}: {}",
        answer["refused"]
    );
    let want: String = want.iter().map(|byte| format!("{byte:02x}")).collect();
    assert!(
        answer["data"] == want.as_str(),
        "{args:?}: the snapshot's export reads other data"
    );
}

#[test]
fn snapshots_hold_the_data_at_their_flush_and_are_served_read_only() {
    snapshots_on(&LoopFs::xfs());
}

#[test]
fn snapshots_on_btrfs_hold_the_data_at_their_flush() {
    snapshots_on(&LoopFs::btrfs());
}

/// Snapshots, their service, checks, clones and deletion on `fs`.
fn snapshots_on(fs: &LoopFs) {
    let dir = &fs.mount;
    let first = random_bytes(SIZE, 1);
    let volume = volume_from(dir, "vol", &first);
    let out = vouch_ok(&["snapshot", "create", s(&volume), "s1"]);
    assert!(text(&out).contains("snapshot s1 of"), "{}", text(&out));

    // Written after s1 (through NBD, flushed), then s2.
    let second_part = random_bytes(1 << 20, 2);
    write_through_nbd(dir, &[s(&volume)], 3 << 20, &second_part);
    let mut second = first.clone();
    second[3 << 20..4 << 20].copy_from_slice(&second_part);
    vouch_ok(&["snapshot", "create", s(&volume), "s2"]);
    // Written after s2: in neither snapshot.
    write_through_nbd(dir, &[s(&volume)], 0, &random_bytes(1 << 20, 3));

    let s1 = volume.join("snapshots/s1");
    let s2 = volume.join("snapshots/s2");
    assert!(
        exported(&s1, dir, "s1") == first,
        "s1 is not the data at its flush"
    );
    assert!(
        exported(&s2, dir, "s2") == second,
        "s2 is not the data at its flush"
    );
    let now = exported(&volume, dir, "now");
    assert!(now[..1 << 20] != first[..1 << 20] && now[1 << 20..] == second[1 << 20..]);

    // Listed by `snapshot list` and `info`; each is a complete volume that
    // check, verify and scrub find clean.
    let list = text(&vouch_ok(&["snapshot", "list", s(&volume)]));
    assert!(list.contains("s1\t") && list.contains("s2\t"), "{list}");
    let info = info_json(&volume);
    let names: Vec<_> = info["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .map(|snap| snap["name"].as_str().expect("name").to_string())
        .collect();
    assert_eq!(names, ["s1", "s2"]);
    assert_eq!(info_json(&s1)["read_only"], true);
    for snap in [&s1, &s2] {
        assert_check_clean(snap);
        vouch_ok(&["verify", s(snap)]);
        vouch_ok(&["scrub", s(snap)]);
    }

    // Served read-only, in its own layout: writes get EPERM, reads the
    // data; by name, or by its directory given as a volume (the flag in
    // its superblock makes it read-only, not an option).
    for args in [vec!["--snapshot", "s1", s(&volume)], vec![s(&s1)]] {
        served_read_only(dir, &args, &first[4096 * 7..4096 * 8]);
    }

    // A corrupted block of a snapshot is caught, naming its LBA; the
    // volume (whose extent it shared) is untouched.
    let lba = 100u64;
    flip_bit(&s1.join("data.00000"), lba * BLOCK + 17, 0x40);
    let (code, faults) = check_faults(&s1);
    assert_eq!(code, 1);
    assert_eq!(faults.iter().map(|f| f.0).collect::<Vec<_>>(), [lba]);
    assert_check_clean(&volume);
    assert!(exported(&s2, dir, "s2b") == second);

    // A clone is writable; written, it diverges; its snapshot stays.
    let clone = dir.join("clone");
    vouch_ok(&["clone", s(&s2), s(&clone)]);
    assert_eq!(info_json(&clone)["read_only"], false);
    assert!(exported(&clone, dir, "c0") == second);
    let third = random_bytes(1 << 20, 4);
    write_through_nbd(dir, &[s(&clone)], 5 << 20, &third);
    let cloned = exported(&clone, dir, "c1");
    assert!(cloned[5 << 20..6 << 20] == third[..] && cloned[..5 << 20] == second[..5 << 20]);
    assert!(
        exported(&s2, dir, "s2c") == second,
        "a clone's write reached its snapshot"
    );
    assert_check_clean(&clone);

    // Delete: gone from the list and the disk; the clone keeps its blocks.
    vouch_ok(&["snapshot", "delete", s(&volume), "s2"]);
    assert!(!s2.exists());
    let list = text(&vouch_ok(&["snapshot", "list", s(&volume)]));
    assert!(list.contains("s1\t") && !list.contains("s2\t"), "{list}");
    assert_check_clean(&clone);
}

#[test]
fn bad_snapshot_input_is_refused_saying_why() {
    let xfs = LoopFs::xfs();
    let dir = &xfs.mount;
    let volume = volume_from(dir, "vol", &random_bytes(1 << 20, 5));
    vouch_ok(&["snapshot", "create", s(&volume), "a"]);
    let cases: &[(&[&str], &str)] = &[
        (&["snapshot", "create", s(&volume), "a"], "already exists"),
        (&["snapshot", "create", s(&volume), "x/y"], "has a '/'"),
        (
            &["snapshot", "create", s(&volume), ".hidden"],
            "starts with '.'",
        ),
        (
            &["snapshot", "delete", s(&volume), "nope"],
            "no snapshot named \"nope\"",
        ),
        (
            &["serve", "--snapshot", "nope", s(&volume)],
            "no snapshot named \"nope\"",
        ),
    ];
    for (args, want) in cases {
        let output = vouch(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
        assert!(
            stderr_of(&output).contains(want),
            "{args:?}: {}",
            text(&output)
        );
    }
    let snap = volume.join("snapshots/a");
    let output = vouch(&["snapshot", "create", s(&snap), "b"]);
    assert!(
        stderr_of(&output).contains("is itself a snapshot"),
        "{}",
        text(&output)
    );
    let output = vouch(&["clone", s(&volume), s(&dir.join("c"))]);
    assert!(
        stderr_of(&output).contains("is not a snapshot"),
        "{}",
        text(&output)
    );
    let output = vouch(&["clone", s(&snap), s(&volume)]);
    assert!(
        stderr_of(&output).contains("already exists"),
        "{}",
        text(&output)
    );
    // A mirror (tests/snapshot_mirror.rs): a copy on each leg.
    let leg0 = dir.join("m0");
    let leg1 = dir.join("m1");
    vouch_ok(&["create", s(&leg0), "--size", "4M", "--mirror", s(&leg1)]);
    vouch_ok(&["snapshot", "create", s(&leg0), "m"]);
    assert!(leg0.join("snapshots/m").is_dir() && leg1.join("snapshots/m").is_dir());
    // A snapshot takes no mirror leg (it would write a record into it).
    let output = vouch(&["mirror", "add", s(&snap), s(&dir.join("leg"))]);
    assert!(
        stderr_of(&output).contains("is a snapshot, read-only"),
        "{}",
        text(&output)
    );
    assert!(!snap.join("mirror").exists() && !dir.join("leg").exists());
    // Also after an unclean stop, and refused before the leg is opened
    // alone: its unclean state is left for the set's next open.
    let mut server = Server::start(dir, &[s(&leg0)]);
    server.kill9();
    let output = vouch(&["snapshot", "create", s(&leg0), "m2"]);
    assert!(
        stderr_of(&output).contains("was not closed cleanly")
            && stderr_of(&output).contains("vouch serve"),
        "{}",
        text(&output)
    );
    let info = text(&vouch_ok(&["info", s(&leg0)]));
    assert!(info.contains("not closed cleanly"), "{info}");
    // What a crash in the middle of a create leaves is never served and
    // is removed by the next list.
    let partial = volume.join("snapshots/.b.partial");
    std::fs::create_dir(&partial).expect("mkdir");
    std::fs::copy(volume.join("superblock"), partial.join("superblock")).expect("copy");
    let output = vouch(&["serve", "--snapshot", ".b.partial", s(&volume)]);
    assert!(
        stderr_of(&output).contains("starts with '.'"),
        "{}",
        text(&output)
    );
    let output = vouch_ok(&["snapshot", "list", s(&volume)]);
    assert!(
        stderr_of(&output).contains("removed .b.partial"),
        "{}",
        text(&output)
    );
    assert!(!partial.exists());
    // Nothing half made was left, and the volume is as it was.
    let list =
        String::from_utf8_lossy(&vouch_ok(&["snapshot", "list", s(&volume)]).stdout).into_owned();
    assert_eq!(list.lines().count(), 1, "{list}");
    assert_check_clean(&volume);
}

#[test]
fn ext4_cannot_share_blocks_so_a_snapshot_is_an_overlay_unless_copied() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let fs_type = text(&run_ok(
        Command::new("stat")
            .args(["-f", "-c", "%T"])
            .arg(dir.path()),
    ));
    assert!(
        fs_type.contains("ext2/ext3"),
        "this test needs ext4 here: {fs_type}"
    );
    let data = random_bytes(1 << 20, 6);
    let volume = volume_from(dir.path(), "vol", &data);
    // Without --copy: an overlay (a fence and a log, nothing copied;
    // tests/snapshot_overlay.rs), listed as such.
    vouch_ok(&["snapshot", "create", s(&volume), "s"]);
    assert_eq!(
        snapshot_record(&volume.join("snapshots/s"))["method"],
        "overlay"
    );
    let listed = text(&vouch_ok(&["snapshot", "list", s(&volume)]));
    assert!(listed.contains("\toverlay, 0 bytes in its log"), "{listed}");
    assert!(exported(&volume.join("snapshots/s"), dir.path(), "o") == data);
    vouch_ok(&["snapshot", "delete", s(&volume), "s"]);
    assert!(text(&vouch_ok(&["snapshot", "list", s(&volume)])).contains("no snapshots"));
    vouch_ok(&["snapshot", "create", "--copy", s(&volume), "s"]);
    let snap = volume.join("snapshots/s");
    assert!(exported(&snap, dir.path(), "s") == data);
    assert_check_clean(&snap);
    // The record says what was done (a full copy), and the files are
    // read-only for everyone.
    let record = snapshot_record(&snap);
    assert_eq!(record["method"], "copy");
    assert_eq!(record["online"], false);
    assert_eq!(record["id"].as_str().map(str::len), Some(36), "{record}");
    for entry in std::fs::read_dir(&snap).expect("snapshot dir") {
        let path = entry.expect("entry").path();
        let mode = std::fs::metadata(&path).expect("metadata").permissions();
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(mode.mode() & 0o777, 0o444, "{}", path.display());
    }
    // A clone names its snapshot by id too: deleted and made again under
    // the same name, the snapshot is another one.
    let clone = dir.path().join("clone");
    vouch_ok(&["clone", "--copy", s(&snap), s(&clone)]);
    let origin: serde_json::Value =
        serde_json::from_slice(&std::fs::read(clone.join("origin")).expect("origin"))
            .expect("origin json");
    assert_eq!(origin["record"]["id"], record["id"]);
    vouch_ok(&["snapshot", "delete", s(&volume), "s"]);
    vouch_ok(&["snapshot", "create", "--copy", s(&volume), "s"]);
    assert_ne!(snapshot_record(&snap)["id"], record["id"]);
}

/// A snapshot's `snapshot` record.
fn snapshot_record(snapshot: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(snapshot.join("snapshot")).expect("record"))
        .expect("record json")
}

#[test]
fn a_key_change_is_refused_while_snapshots_keep_the_old_wrap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (volume, key, new_key) = (
        dir.path().join("vol"),
        dir.path().join("key"),
        dir.path().join("new-key"),
    );
    std::fs::write(&key, random_bytes(32, 1)).expect("key");
    std::fs::write(&new_key, random_bytes(32, 2)).expect("new key");
    vouch_ok(&[
        "create",
        s(&volume),
        "--size",
        "1MiB",
        "--encrypt",
        "--key-file",
        s(&key),
    ]);
    vouch_ok(&["snapshot", "create", "--copy", s(&volume), "before"]);
    let change = || {
        vouch(&[
            "key",
            "change",
            s(&volume),
            "--key-file",
            s(&key),
            "--new-key-file",
            s(&new_key),
        ])
    };
    let output = change();
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        stderr_of(&output).contains("has snapshots (before)"),
        "{}",
        text(&output)
    );
    // The old key still opens the volume: nothing was changed.
    check_with_key(&volume, &key);
    vouch_ok(&["snapshot", "delete", s(&volume), "before"]);
    let output = change();
    assert!(output.status.success(), "{}", text(&output));
    check_with_key(&volume, &new_key);
}

fn check_with_key(volume: &Path, key: &Path) {
    let output = vouch(&["check", s(volume), "--key-file", s(key)]);
    assert!(
        output.status.success(),
        "check with {}: {}",
        key.display(),
        text(&output)
    );
}

#[test]
fn a_snapshot_being_served_is_not_deleted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = random_bytes(1 << 20, 7);
    let volume = volume_from(dir.path(), "vol", &data);
    vouch_ok(&["snapshot", "create", "--copy", s(&volume), "s"]);
    let mut server = Server::start(dir.path(), &["--snapshot", "s", s(&volume)]);
    let output = vouch(&["snapshot", "delete", s(&volume), "s"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        stderr_of(&output).contains("snapshot s of")
            && stderr_of(&output).contains("is open in another vouch process"),
        "{}",
        text(&output)
    );
    assert!(volume.join("snapshots/s").exists());
    server.stop();
    vouch_ok(&["snapshot", "delete", s(&volume), "s"]);
    assert!(!volume.join("snapshots/s").exists());
}

/// A QD1 writer over NBD (each block once, tagged, a flush every 8) runs
/// while two snapshots are taken through the server (`snapshot create
/// --server`); it logs each write's issue and acknowledgement times and
/// each create's call and return. Prints {"writes": [[lba, issued,
/// acked]...], "snaps": [[name, called, returned, held_ms]...],
/// "latency": [seconds per write]}.
const ONLINE_WRITER: &str = r#"
import subprocess, threading
uri, vouch, control, blocks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
h = connect(uri)
writes, snaps, started, created = [], [], threading.Event(), threading.Event()
def writer():
    for lba in range(blocks):
        # The last writes wait for both creates to return: each snapshot
        # has writes issued after it, however long the creates take.
        if lba == blocks - 8:
            created.wait()
        issued = time.monotonic()
        h.pwrite(block_data(lba, 7), lba * 4096)
        if lba % 8 == 7:
            h.flush()
        writes.append([lba, issued, time.monotonic()])
        if lba == 64:
            started.set()
    h.flush()
# A daemon: a failed create exits without waiting for it.
thread = threading.Thread(target=writer, daemon=True)
thread.start()
started.wait()
for name in ["online1", "online2"]:
    called = time.monotonic()
    out = subprocess.run([vouch, "snapshot", "create", "--server", control, name],
                         capture_output=True, text=True)
    returned = time.monotonic()
    if out.returncode != 0:
        raise SystemExit("snapshot create failed: " + out.stderr)
    held = float(out.stdout.split("held at the flush point ")[1].split(" ms")[0])
    snaps.append([name, called, returned, held])
    time.sleep(0.2)
created.set()
thread.join()
latency = [acked - issued for _, issued, acked in writes]
print(json.dumps({"writes": writes, "snaps": snaps, "latency": latency}))
"#;

/// Online snapshots (issue 33): taken through the control API while a
/// client writes, each holds every write acknowledged before its create
/// was called and none issued after it returned; the volume keeps every
/// write; both snapshots and the volume check clean; delete through the
/// server works, and is refused for a snapshot a process serves.
#[test]
fn online_snapshots_hold_every_write_acknowledged_before_the_call_and_none_after() {
    let fs = LoopFs::xfs();
    let dir = &fs.mount;
    let first = random_bytes(SIZE, 11);
    let volume = volume_from(dir, "vol", &first);
    let mut server = Server::start(dir, &[s(&volume), "--control", "127.0.0.1:0"]);
    let control = common::control::control(&server).to_string();
    let blocks = (SIZE as u64 / BLOCK).to_string();
    let log = py_json(
        ONLINE_WRITER,
        &[&server.uri, vouch_bin(), &control, &blocks],
    );
    // What each block of a snapshot must be: the write's data when it was
    // acknowledged before the call, the old data when issued after the
    // return, either in between.
    let tagged: Vec<Vec<u8>> = {
        let script = r#"
print(json.dumps([block_data(lba, 7).hex() for lba in range(int(sys.argv[1]))]))
"#;
        py_json(script, &[&blocks])
            .as_array()
            .expect("blocks")
            .iter()
            .map(|hex| decode_hex(hex.as_str().expect("hex")))
            .collect()
    };
    let writes = log["writes"].as_array().expect("writes");
    assert_eq!(writes.len(), SIZE / BLOCK as usize);
    for snap in log["snaps"].as_array().expect("snaps") {
        let name = snap[0].as_str().expect("name");
        let (called, returned) = (snap[1].as_f64().unwrap(), snap[2].as_f64().unwrap());
        let image = exported(&volume.join("snapshots").join(name), dir, name);
        let (mut before, mut after) = (0, 0);
        for write in writes {
            let lba = write[0].as_u64().unwrap() as usize;
            let (issued, acked) = (write[1].as_f64().unwrap(), write[2].as_f64().unwrap());
            let got = &image[lba * BLOCK as usize..(lba + 1) * BLOCK as usize];
            let old = &first[lba * BLOCK as usize..(lba + 1) * BLOCK as usize];
            if acked < called {
                before += 1;
                assert!(
                    got == &tagged[lba][..],
                    "{name}: LBA {lba}, acknowledged before the create was called, is not in it"
                );
            } else if issued > returned {
                after += 1;
                assert!(
                    got == old,
                    "{name}: LBA {lba}, issued after the create returned, is in it"
                );
            } else {
                assert!(
                    got == old || got == &tagged[lba][..],
                    "{name}: LBA {lba} is neither its old nor its new data"
                );
            }
        }
        assert!(
            before > 64 && after > 0,
            "{name}: the writer did not run across it ({before} before, {after} after)"
        );
        let record = snapshot_record(&volume.join("snapshots").join(name));
        assert_eq!(record["online"], true);
        assert_eq!(record["method"], "reflink");
    }
    let latency: Vec<f64> = log["latency"]
        .as_array()
        .expect("latency")
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let mut sorted = latency.clone();
    sorted.sort_by(f64::total_cmp);
    eprintln!(
        "QD1 write latency during online snapshots: median {:.3} ms, p99 {:.3} ms, max {:.3} ms; held at the flush point: {:?} ms",
        sorted[sorted.len() / 2] * 1e3,
        sorted[sorted.len() * 99 / 100] * 1e3,
        sorted[sorted.len() - 1] * 1e3,
        log["snaps"].as_array().unwrap().iter().map(|s| s[3].as_f64().unwrap()).collect::<Vec<_>>()
    );

    // Listed through the server; a name taken is refused.
    let listed = text(&vouch_ok(&["snapshot", "list", "--server", &control]));
    assert!(
        listed.contains("online1\t") && listed.contains("online2\t"),
        "{listed}"
    );
    let again = vouch(&["snapshot", "create", "--server", &control, "online1"]);
    assert!(
        !again.status.success() && stderr_of(&again).contains("already exists"),
        "{}",
        stderr_of(&again)
    );

    // A snapshot another process serves is not deleted; once stopped it is.
    let mut served = Server::start(dir, &["--snapshot", "online1", s(&volume)]);
    let refused = vouch(&["snapshot", "delete", "--server", &control, "online1"]);
    assert!(
        !refused.status.success()
            && stderr_of(&refused).contains("is open in another vouch process"),
        "{}",
        stderr_of(&refused)
    );
    served.stop();
    vouch_ok(&["snapshot", "delete", "--server", &control, "online1"]);
    assert!(!volume.join("snapshots/online1").exists());
    server.stop();

    let mut want = Vec::with_capacity(SIZE);
    for block in &tagged {
        want.extend_from_slice(block);
    }
    assert!(
        exported(&volume, dir, "after") == want,
        "the volume lost a write"
    );
    assert_check_clean(&volume);
    assert_check_clean(&volume.join("snapshots/online2"));
}

fn decode_hex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).expect("hex"))
        .collect()
}

/// An online create clones the volume's files once before its flush point
/// (`warm_file`, while they are written) and again at it, over those warm
/// copies: the clone at the flush point must leave each file equal to the
/// volume's then, whatever changed since the warm copy (blocks rewritten,
/// a hole punched where the copy has data, data where it has a hole, the
/// file grown or cut), on a real xfs.
#[test]
fn a_clone_over_a_warm_copy_equals_the_file_at_the_flush_point() {
    clone_over_a_warm_copy(&LoopFs::xfs());
}

#[test]
fn a_clone_over_a_warm_copy_on_btrfs_equals_the_file_at_the_flush_point() {
    clone_over_a_warm_copy(&LoopFs::btrfs());
}

/// Where the clone over a warm copy fails (here the "warm copy" is a
/// symlink to a file on another filesystem: FICLONE says EXDEV), the copy
/// goes and the file is cloned anew, on its own filesystem.
#[test]
fn a_warm_copy_that_cannot_be_cloned_over_is_replaced() {
    use vouch_engine::snapshot::{RealFs, SnapshotFs as _};
    let fs = LoopFs::xfs();
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let (from, to) = (fs.mount.join("data"), fs.mount.join("warm"));
    let stale = elsewhere.path().join("stale");
    std::fs::write(&from, random_bytes(1 << 20, 4)).expect("write");
    std::fs::write(&stale, random_bytes(2 << 20, 5)).expect("write");
    std::os::unix::fs::symlink(&stale, &to).expect("symlink");
    RealFs::new(false)
        .clone_file(&from, &to)
        .expect("cloned anew");
    assert!(
        to.symlink_metadata().expect("to").is_file(),
        "a file, not the link"
    );
    assert!(std::fs::read(&to).expect("to") == std::fs::read(&from).expect("from"));
    assert_eq!(
        std::fs::read(&stale).expect("stale").len(),
        2 << 20,
        "untouched"
    );
}

fn clone_over_a_warm_copy(fs: &LoopFs) {
    use std::os::unix::fs::FileExt as _;
    use vouch_engine::snapshot::{RealFs, SnapshotFs as _};
    let (from, to) = (fs.mount.join("data"), fs.mount.join("warm"));
    // Many `WARM_PIECE` pieces of a warm copy, the last short; data scattered.
    let len: u64 = (160 << 20) + (12 << 10);
    let file = std::fs::File::create(&from).expect("create");
    file.set_len(len).expect("set_len");
    let write_blocks = |seed: u64, count: u64| {
        for k in 0..count {
            let block = (k * 7919 + seed * 104_729) % (len / 4096);
            file.write_all_at(&random_bytes(4096, seed * 1000 + k), block * 4096)
                .expect("write");
        }
    };
    let punch = |offset: u64, length: u64| {
        run_ok(Command::new(tool("fallocate", "util-linux")).args([
            "--punch-hole",
            "--offset",
            &offset.to_string(),
            "--length",
            &length.to_string(),
            from.to_str().expect("path"),
        ]));
    };
    let real = RealFs::new(false);
    let equal = |when: &str| {
        let (a, b) = (
            std::fs::read(&from).expect("from"),
            std::fs::read(&to).expect("to"),
        );
        assert_eq!(a.len(), b.len(), "{when}: lengths");
        assert!(a == b, "{when}: the copy differs from the file");
    };
    write_blocks(1, 300);
    assert!(
        real.warm_file(&from, &to).expect("warm"),
        "xfs shares extents"
    );
    equal("the first warm copy");
    write_blocks(2, 200);
    punch(4096 * 7919, 1 << 20);
    file.set_len(len + (8 << 20)).expect("grow");
    file.write_all_at(&random_bytes(4096, 9), len + (4 << 20))
        .expect("write");
    assert!(real.warm_file(&from, &to).expect("warm again"));
    equal("the warm copy brought up to date");
    write_blocks(3, 100);
    punch(64 << 20, 4 << 20);
    file.set_len(len - (16 << 20)).expect("cut");
    file.sync_all().expect("sync");
    real.clone_file(&from, &to)
        .expect("clone over the warm copy");
    equal("the clone at the flush point");
}
