//! Changed blocks since a snapshot (issue 33): `qemu:dirty-bitmap:NAME`
//! read by stock clients (libnbd's python bindings, nbdinfo --map, qemu's
//! nbd driver with x-dirty-bitmap under `qemu-img map`), `vouch diff`, a
//! clone's `qemu:allocation-depth`, and the incremental backup: a full
//! copy, a snapshot, 1 % of the blocks changed (writes, trims, zeroes,
//! one whole metadata unit trimmed), only the dirty ranges read and
//! applied to the copy, which then equals the volume, having read at most
//! 2 % of its bytes. Snapshots here are `--copy` (this machine's ext4
//! cannot share blocks): what changed is told from contexts either way.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::clients::{nbdinfo, nbdinfo_json, qemu_img};
use common::*;

/// A volume made with `create_args`, filled with random data through NBD,
/// and the arguments every later command on it needs (its key).
struct Filled {
    volume: PathBuf,
    key: Vec<String>,
}

impl Filled {
    fn args<'a>(&'a self, head: &[&'a str]) -> Vec<&'a str> {
        let mut args = head.to_vec();
        args.extend(self.key.iter().map(String::as_str));
        args
    }
}

fn filled(dir: &Path, size: u64, create_args: &[&str], encrypted: bool) -> Filled {
    let volume = dir.join("vol");
    let mut key = Vec::new();
    if encrypted {
        let file = dir.join("key");
        std::fs::write(&file, [7u8; 32]).expect("key file");
        key = vec!["--key-file".to_string(), s(&file).to_string()];
    }
    let filled = Filled { volume, key };
    let size_arg = size.to_string();
    let mut create = vec!["create", s(&filled.volume), "--size", &size_arg];
    create.extend_from_slice(create_args);
    vouch_ok(&filled.args(&create));
    let mut server = Server::start(dir, &filled.args(&[s(&filled.volume)]));
    through(&server.uri, "size = h.get_size()\nstep = 4 << 20\nfor offset in range(0, size, step):\n    h.pwrite(os.urandom(step), offset)\n");
    server.stop();
    filled
}

/// Change about 1 % of the volume's blocks through NBD and flush: single
/// block writes, two short trims, two zeroed runs (one NO_HOLE), and one
/// whole metadata unit (`unit` blocks, aligned) trimmed. Returns the LBAs
/// changed.
fn change_one_percent(uri: &str, unit: u64, seed: u64) -> Vec<u64> {
    let out = py_json(
        r#"
import random
h = connect(sys.argv[1])
unit, rng = int(sys.argv[2]), random.Random(int(sys.argv[3]))
blocks = h.get_size() // 4096
changed = set()
# One whole unit, aligned, trimmed.
first = (blocks // 3) // unit * unit
h.trim(unit * 4096, first * 4096)
changed.update(range(first, first + unit))
budget = blocks // 100 - len(changed)
runs = [("trim", 8), ("trim", 5), ("zero", 8), ("zero_nohole", 6)]
for kind, count in runs:
    at = rng.randrange(0, blocks - count)
    if kind == "trim":
        h.trim(count * 4096, at * 4096)
    elif kind == "zero":
        h.zero(count * 4096, at * 4096)
    else:
        h.zero(count * 4096, at * 4096, nbd.CMD_FLAG_NO_HOLE)
    changed.update(range(at, at + count))
while len(changed) < blocks // 100:
    lba = rng.randrange(0, blocks)
    h.pwrite(os.urandom(4096), lba * 4096)
    changed.add(lba)
h.flush()
print(json.dumps({"changed": sorted(changed)}))
"#,
        &[uri, &unit.to_string(), &seed.to_string()],
    );
    out["changed"]
        .as_array()
        .expect("changed")
        .iter()
        .map(|lba| lba.as_u64().expect("lba"))
        .collect()
}

/// The incremental backup with libnbd: ask `qemu:dirty-bitmap:SNAP` for
/// the whole export, read only the dirty ranges, write them into `copy`.
/// Returns the dirty ranges (offset, length) and the bytes read.
const BACKUP: &str = r#"
context = "qemu:dirty-bitmap:" + sys.argv[2]
h = nbd.NBD()
h.add_meta_context(context)
h.connect_uri(sys.argv[1])
assert h.can_meta_context(context), "the server did not select " + context
size = h.get_size()
dirty = []
position = [0]
def extents(metacontext, offset, entries, err):
    if metacontext != context:
        return 0
    at = offset
    for i in range(0, len(entries), 2):
        length, flags = entries[i], entries[i + 1]
        if flags & 1:
            if dirty and dirty[-1][0] + dirty[-1][1] == at:
                dirty[-1][1] += length
            else:
                dirty.append([at, length])
        at += length
    position[0] = at
    return 0
offset = 0
while offset < size:
    h.block_status(min(size - offset, 1 << 30), offset, extents)
    assert position[0] > offset
    offset = min(position[0], size)
read = 0
with open(sys.argv[3], "r+b") as copy:
    for at, length in dirty:
        done = 0
        while done < length:
            n = min(length - done, 32 << 20)
            data = h.pread(n, at + done)
            read += len(data)
            copy.seek(at + done)
            copy.write(data)
            done += n
print(json.dumps({"dirty": dirty, "read": read, "size": size}))
"#;

/// Run `body` (python, `h` connected to `uri`) and flush.
fn through(uri: &str, body: &str) {
    let script =
        format!("h = connect(sys.argv[1])\n{body}h.flush()\nprint(json.dumps({{\"ok\": True}}))\n");
    py_json(&script, &[uri]);
}

/// Blocks named by ranges of bytes.
fn blocks_of(ranges: &[(u64, u64)]) -> Vec<u64> {
    let mut blocks = Vec::new();
    for (offset, length) in ranges {
        assert_eq!(
            (offset % BLOCK, length % BLOCK),
            (0, 0),
            "{offset} {length}"
        );
        blocks.extend(offset / BLOCK..(offset + length) / BLOCK);
    }
    blocks
}

fn ranges_of(value: &serde_json::Value) -> Vec<(u64, u64)> {
    value
        .as_array()
        .expect("ranges")
        .iter()
        .map(|range| match range {
            serde_json::Value::Array(pair) => (
                pair[0].as_u64().expect("offset"),
                pair[1].as_u64().expect("length"),
            ),
            object => (
                object["offset"].as_u64().expect("offset"),
                object["length"].as_u64().expect("length"),
            ),
        })
        .collect()
}

/// The whole incremental backup on one kind of volume.
fn incremental_backup(create_args: &[&str], encrypted: bool, unit: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let size = 128 * MIB;
    let vol = filled(dir, size, create_args, encrypted);
    let volume = &vol.volume;
    vouch_ok(&vol.args(&["snapshot", "create", s(volume), "s1", "--copy"]));
    // The previous full copy: the volume at s1.
    let copy = dir.join("copy.raw");
    vouch_ok(&vol.args(&["export", s(&volume.join("snapshots/s1")), s(&copy)]));

    let mut server = Server::start(dir, &vol.args(&[s(volume)]));
    let changed = change_one_percent(&server.uri, unit, 33);
    let backup = py_json(BACKUP, &[&server.uri, "s1", s(&copy)]);
    server.stop();

    let dirty = ranges_of(&backup["dirty"]);
    let dirty_blocks = blocks_of(&dirty);
    let missing: Vec<_> = changed
        .iter()
        .filter(|lba| dirty_blocks.binary_search(lba).is_err())
        .collect();
    assert!(
        missing.is_empty(),
        "{create_args:?}: changed blocks the bitmap calls clean: {missing:?}"
    );
    // And nothing else: contexts tell exactly the blocks changed.
    assert_eq!(dirty_blocks, changed, "{create_args:?}");
    let read = backup["read"].as_u64().expect("read");
    assert!(
        read * 50 <= size,
        "{create_args:?}: the backup read {read} bytes of {size} (> 2 %)"
    );
    eprintln!(
        "{create_args:?} encrypted={encrypted}: {} blocks changed, {} dirty, {read} bytes read of {size} ({:.2} %)",
        changed.len(),
        dirty_blocks.len(),
        read as f64 * 100.0 / size as f64
    );
    // The copy with the changed ranges applied is the volume now.
    let now = dir.join("now.raw");
    vouch_ok(&vol.args(&["export", s(volume), s(&now)]));
    assert!(
        std::fs::read(&copy).expect("copy") == std::fs::read(&now).expect("now"),
        "{create_args:?}: the incremental backup differs from the volume"
    );

    // `vouch diff` offline names the same ranges; against a snapshot taken
    // now (by directory or by name) too; and nothing since that one.
    let diff = |args: &[&str]| -> serde_json::Value {
        let out = vouch_ok(args);
        serde_json::from_slice(&out.stdout).expect("diff --json")
    };
    let s1 = volume.join("snapshots/s1");
    let since = diff(&["diff", s(&s1), "--json"]);
    assert_eq!(ranges_of(&since["ranges"]), dirty, "{create_args:?}");
    assert_eq!(since["size"], size);
    vouch_ok(&vol.args(&["snapshot", "create", s(volume), "s2", "--copy"]));
    let s2 = volume.join("snapshots/s2");
    assert_eq!(
        ranges_of(&diff(&["diff", s(&s1), s(&s2), "--json"])["ranges"]),
        dirty
    );
    assert_eq!(
        ranges_of(&diff(&["diff", s(&s1), "s2", "--json"])["ranges"]),
        dirty
    );
    let none = diff(&["diff", s(&s2), "--json"]);
    assert_eq!(none["changed_bytes"], 0, "{none}");
    let human = text(&vouch_ok(&["diff", s(&s1)]));
    assert!(
        human.contains(&format!("{} ranges", dirty.len())),
        "{human}"
    );
}

#[test]
fn incremental_backup_split_reads_only_the_changed_blocks() {
    incremental_backup(&["--layout", "split"], false, 128);
}

#[test]
fn incremental_backup_packed_reads_only_the_changed_blocks() {
    incremental_backup(&["--layout", "packed", "--guard", "xxh3"], false, 31);
}

#[test]
fn incremental_backup_encrypted_both_layouts() {
    incremental_backup(&["--layout", "split", "--encrypt"], true, 128);
    incremental_backup(&["--layout", "packed", "--encrypt"], true, 31);
}

#[test]
fn incremental_backup_every_guard() {
    for guard in ["crc64nvme", "crc16t10dif", "none"] {
        incremental_backup(&["--layout", "split", "--guard", guard], false, 128);
    }
}

/// A small volume: 64 blocks written at 0, s1, then blocks 8..16 written,
/// 20..24 trimmed, 30..32 zeroed through a server that keeps serving.
fn small_changed(dir: &Path) -> (PathBuf, Server) {
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "4M"]);
    let mut server = Server::start(dir, &[s(&volume)]);
    through(&server.uri, "h.pwrite(os.urandom(64 * 4096), 0)\n");
    server.stop();
    vouch_ok(&["snapshot", "create", s(&volume), "s1", "--copy"]);
    let server = Server::start(dir, &[s(&volume)]);
    through(&server.uri, "h.pwrite(os.urandom(8 * 4096), 8 * 4096)\nh.trim(4 * 4096, 20 * 4096)\nh.zero(2 * 4096, 30 * 4096)\n");
    (volume, server)
}

/// The small volume, stopped, and a clone of its s1: (volume, clone).
fn small_cloned(dir: &Path) -> (PathBuf, PathBuf) {
    let (volume, mut server) = small_changed(dir);
    server.stop();
    let clone = dir.join("clone");
    vouch_ok(&[
        "clone",
        s(&volume.join("snapshots/s1")),
        s(&clone),
        "--copy",
    ]);
    (volume, clone)
}

/// The dirty ranges the small volume must report, in bytes.
const SMALL_DIRTY: [(u64, u64); 3] = [
    (8 * 4096, 8 * 4096),
    (20 * 4096, 4 * 4096),
    (30 * 4096, 2 * 4096),
];

#[test]
fn nbdinfo_and_qemu_img_map_read_the_dirty_bitmap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (volume, mut server) = small_changed(dir);
    let uri = server.uri.clone();

    // Listed: NBD_OPT_LIST_META_CONTEXT names the snapshots.
    let info = nbdinfo_json(&uri, &[]);
    let contexts = info["exports"][0]["contexts"].to_string();
    assert!(contexts.contains("qemu:dirty-bitmap:s1"), "{contexts}");
    assert!(
        !contexts.contains("qemu:allocation-depth"),
        "not a clone: {contexts}"
    );

    // nbdinfo --map: bit 0 set on exactly the changed ranges.
    let map = nbdinfo_json(&uri, &["--map=qemu:dirty-bitmap:s1"]);
    let mut dirty = Vec::new();
    for entry in map.as_array().expect("map") {
        if entry["type"].as_u64() == Some(1) {
            dirty.push((
                entry["offset"].as_u64().expect("offset"),
                entry["length"].as_u64().expect("length"),
            ));
        }
    }
    assert_eq!(dirty, SMALL_DIRTY, "{map}");

    // qemu's nbd driver reads the bitmap in place of base:allocation
    // (x-dirty-bitmap): `qemu-img map` reports dirty runs as data: false.
    let port = server.addr.port().to_string();
    let options = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},x-dirty-bitmap=qemu:dirty-bitmap:s1"
    );
    let output =
        run_ok(Command::new(qemu_img()).args(["map", "--output=json", "--image-opts", &options]));
    let map: serde_json::Value = serde_json::from_slice(&output.stdout).expect("qemu-img map json");
    let mut dirty = Vec::new();
    for entry in map.as_array().expect("map") {
        if entry["data"] == false {
            dirty.push((
                entry["start"].as_u64().expect("start"),
                entry["length"].as_u64().expect("length"),
            ));
        }
    }
    assert_eq!(dirty, SMALL_DIRTY, "{map}");

    // The snapshots are read at each negotiation: one that appears while
    // the server runs (here a copy of s1's directory) is listed, for the
    // `qemu:` and `qemu:dirty-bitmap:` wildcards, by the next connection.
    run_ok(
        Command::new("cp")
            .arg("-a")
            .arg(volume.join("snapshots/s1"))
            .arg(volume.join("snapshots/s9")),
    );
    let listed = py_json(
        r#"
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_uri(sys.argv[1])
found = {}
for query in ["qemu:", "qemu:dirty-bitmap:", "base:"]:
    names = []
    h.clear_meta_contexts()
    h.add_meta_context(query)
    h.opt_list_meta_context(lambda name: names.append(name))
    found[query] = sorted(names)
h.opt_abort()
print(json.dumps(found))
"#,
        &[&uri],
    );
    let bitmaps = serde_json::json!(["qemu:dirty-bitmap:s1", "qemu:dirty-bitmap:s9"]);
    assert_eq!(listed["qemu:"], bitmaps, "{listed}");
    assert_eq!(listed["qemu:dirty-bitmap:"], bitmaps, "{listed}");
    assert_eq!(
        listed["base:"],
        serde_json::json!(["base:allocation"]),
        "{listed}"
    );
    let map = nbdinfo_json(&uri, &["--map=qemu:dirty-bitmap:s9"]);
    assert_eq!(map.as_array().map(Vec::len), Some(7), "{map}");

    // An unknown snapshot is not selected: nbdinfo says the server lacks it.
    let output = run(Command::new(nbdinfo()).args(["--map=qemu:dirty-bitmap:nope", &uri]));
    assert!(!output.status.success(), "{}", text(&output));
    let answer = py_json(
        r#"
h = nbd.NBD()
h.add_meta_context("qemu:dirty-bitmap:nope")
h.add_meta_context("qemu:dirty-bitmap:s1")
h.connect_uri(sys.argv[1])
print(json.dumps({"nope": h.can_meta_context("qemu:dirty-bitmap:nope"),
                  "s1": h.can_meta_context("qemu:dirty-bitmap:s1")}))
"#,
        &[&uri],
    );
    assert_eq!(answer, serde_json::json!({"nope": false, "s1": true}));
    server.stop();
}

/// `vouch ARGS` fails (exit 2) saying `want`.
fn refused(args: &[&str], want: &str) {
    let output = vouch(args);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
    assert!(text(&output).contains(want), "{args:?}: {}", text(&output));
}

#[test]
fn diff_refuses_a_missing_snapshot_and_another_volumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (volume, mut server) = small_changed(dir);
    // Served: `diff` of the live volume says to ask the server.
    let s1 = volume.join("snapshots/s1");
    refused(&["diff", s(&s1)], "qemu:dirty-bitmap:s1");
    server.stop();
    let json = vouch_ok(&["diff", s(&s1), "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    assert_eq!(ranges_of(&json["ranges"]), SMALL_DIRTY);

    // Lost metadata is changed, never clean: the first context page of
    // the volume and of the snapshot zeroed (their written-map bits set:
    // lost, 128 blocks each). Read as never written, both would match and
    // call 0..128 clean; the whole page is reported.
    for dir in [&volume, &s1] {
        let contexts = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("contexts"))
            .expect("contexts");
        std::os::unix::fs::FileExt::write_all_at(&contexts, &[0u8; 4096], 0).expect("zero page 0");
    }
    let json = vouch_ok(&["diff", s(&s1), "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    assert_eq!(ranges_of(&json["ranges"]), [(0, 128 * BLOCK)], "{json}");

    refused(
        &["diff", s(&volume.join("snapshots/nope"))],
        "no snapshot named \"nope\"",
    );
    refused(&["diff", s(&volume)], "is not a snapshot's directory");

    // A snapshot of another volume (another uuid) is refused.
    let other = dir.join("other");
    vouch_ok(&["create", s(&other), "--size", "4M"]);
    vouch_ok(&["snapshot", "create", s(&other), "o1", "--copy"]);
    refused(
        &["diff", s(&s1), s(&other.join("snapshots/o1"))],
        "only snapshots of the same volume",
    );
}

#[test]
fn a_clone_answers_allocation_depth() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (_, clone) = small_cloned(dir);
    let mut server = Server::start(dir, &[s(&clone)]);
    through(
        &server.uri,
        "h.pwrite(os.urandom(4 * 4096), 100 * 4096)\nh.pwrite(os.urandom(2 * 4096), 10 * 4096)\n",
    );
    let map = nbdinfo_json(&server.uri, &["--map=qemu:allocation-depth"]);
    server.stop();
    let runs: Vec<(u64, u64, u64)> = map
        .as_array()
        .expect("map")
        .iter()
        .map(|entry| {
            (
                entry["offset"].as_u64().expect("offset") / BLOCK,
                entry["length"].as_u64().expect("length") / BLOCK,
                entry["type"].as_u64().expect("type"),
            )
        })
        .collect();
    // 0..64 from s1 (depth 2) but 10..12 written in the clone (1); 100..104
    // written in the clone; the rest never written (0).
    assert_eq!(
        runs,
        [
            (0, 10, 2),
            (10, 2, 1),
            (12, 52, 2),
            (64, 36, 0),
            (100, 4, 1),
            (104, 1024 - 104, 0)
        ],
        "{map}"
    );
}

/// Packed: a row restored from an older copy of its data file (the
/// snapshot's) after it was written since is changed, and block status
/// calls none of its blocks a hole or zeros: reads of it fail
/// (metadata_lost), so a backup that skipped it would keep stale bytes.
#[test]
fn a_packed_row_restored_from_an_older_copy_is_changed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "4M", "--layout", "packed"]);
    let mut server = Server::start(dir, &[s(&volume)]);
    through(
        &server.uri,
        "h.pwrite(os.urandom(64 * 4096), 0)\nh.zero(4 * 4096, 40 * 4096)\n",
    );
    server.stop();
    vouch_ok(&["snapshot", "create", s(&volume), "s1", "--copy"]);
    let s1 = volume.join("snapshots/s1");
    // Row 0 (blocks 0..31) and row 1 (31..62) written since s1.
    let mut server = Server::start(dir, &[s(&volume)]);
    through(
        &server.uri,
        "h.pwrite(os.urandom(2 * 4096), 8 * 4096)\nh.pwrite(os.urandom(4 * 4096), 40 * 4096)\n",
    );
    server.stop();
    let data = vouch_format::Geometry::segment_name(0);
    std::fs::copy(s1.join(&data), volume.join(&data)).expect("restore the older copy");

    let json = vouch_ok(&["diff", s(&s1), "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    assert_eq!(ranges_of(&json["ranges"]), [(0, 62 * BLOCK)], "{json}");

    let server = Server::start(dir, &[s(&volume)]);
    let map = nbdinfo_json(&server.uri, &["--map=qemu:dirty-bitmap:s1"]);
    assert_eq!(
        map[0]["offset"].as_u64().zip(map[0]["length"].as_u64()),
        Some((0, 62 * BLOCK)),
        "{map}"
    );
    assert_eq!(map[0]["type"].as_u64(), Some(1), "{map}");
    // base:allocation: 40..44 were zeros in the older copy; its row is
    // not known now, so data (type 0), never zero.
    let map = nbdinfo_json(&server.uri, &["--map=base:allocation"]);
    for entry in map.as_array().expect("map") {
        let (offset, length) = (
            entry["offset"].as_u64().unwrap(),
            entry["length"].as_u64().unwrap(),
        );
        if offset < 44 * BLOCK && offset + length > 40 * BLOCK {
            assert_eq!(entry["type"].as_u64(), Some(0), "{map}");
        }
    }
}

/// `vouch diff` of a volume left unclean (the server killed) is refused,
/// saying how to recover it; after a serve it reports the writes the
/// server acknowledged but never flushed.
#[test]
fn diff_refuses_an_unclean_volume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (volume, mut server) = small_changed(dir);
    py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(os.urandom(4096), 50 * 4096)
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.kill9();
    let s1 = volume.join("snapshots/s1");
    refused(&["diff", s(&s1)], "was not closed cleanly");
    let mut server = Server::start(dir, &[s(&volume)]);
    server.stop();
    let json = vouch_ok(&["diff", s(&s1), "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    let mut want = SMALL_DIRTY.to_vec();
    want.push((50 * 4096, 4096));
    assert_eq!(ranges_of(&json["ranges"]), want, "{json}");
}

/// A clone shares its origin's uuid and commits from the same sequence:
/// a snapshot of the clone is not compared with one of its origin.
#[test]
fn diff_refuses_a_clones_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (volume, clone) = small_cloned(dir);
    vouch_ok(&["snapshot", "create", s(&volume), "s2", "--copy"]);
    vouch_ok(&["snapshot", "create", s(&clone), "x", "--copy"]);
    refused(
        &[
            "diff",
            s(&volume.join("snapshots/s2")),
            s(&clone.join("snapshots/x")),
        ],
        "only snapshots of the same volume",
    );
    // Two snapshots of one volume still compare, by name or directory.
    vouch_ok(&["diff", s(&volume.join("snapshots/s1")), "s2"]);
    vouch_ok(&[
        "diff",
        s(&volume.join("snapshots/s1")),
        s(&volume.join("snapshots/s2")),
    ]);
}

/// A snapshot whose changed blocks a client has read is held open by the
/// server (its lock with it, so the next extent does not reopen it); an
/// online delete through the control API closes it first and succeeds
/// instead of finding it "open in another vouch process".
#[test]
fn an_online_delete_closes_a_snapshot_held_for_its_changed_blocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (volume, mut server) = small_changed(dir);
    server.stop();
    let mut server = Server::start(dir, &[s(&volume), "--control", "127.0.0.1:0"]);
    let control = common::control::control(&server).to_string();
    let map = nbdinfo_json(&server.uri, &["--map=qemu:dirty-bitmap:s1"]);
    assert!(map.as_array().is_some_and(|runs| runs.len() > 1), "{map}");
    vouch_ok(&["snapshot", "delete", "--server", &control, "s1"]);
    assert!(!volume.join("snapshots/s1").exists());
    // Deleting it again: not there, so 404 (not a 409 conflict).
    let (_, exports) = common::control::request(&control, "GET", "/v1/exports", None, None);
    let export = exports["exports"][0]["name"]
        .as_str()
        .expect("export name")
        .to_string();
    let (status, answer) = common::control::request(
        &control,
        "DELETE",
        &format!("/v1/exports/{export}/snapshots/s1"),
        None,
        None,
    );
    assert_eq!(status, 404, "{answer}");
    let info = nbdinfo_json(&server.uri, &[]);
    let contexts = info["exports"][0]["contexts"].to_string();
    assert!(!contexts.contains("qemu:dirty-bitmap:s1"), "{contexts}");
    server.stop();
}
