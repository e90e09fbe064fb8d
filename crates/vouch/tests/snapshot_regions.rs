//! Snapshots, clones, verify, scrub and changed blocks of a volume whose
//! regions are in both layouts (issue 33, a volume with regions): the
//! snapshot keeps the layout of each region it was taken in, is checked,
//! verified and served (`serve --snapshot`) with the image of its flush
//! point; its clone is a writable volume with regions; `vouch diff` and
//! `qemu:dirty-bitmap:NAME` tell the changed blocks region by region, a
//! region moved between layouts since counting as changed wherever written,
//! and an incremental backup from them equals the volume.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use vouch_engine::DeviceWrites;

use common::clients::{nbdinfo_json, qemu_img};
use common::*;
use vouch_engine::{CreateOptions, OpenOptions};
use vouch_format::regions::REGION_BLOCKS;
use vouch_format::LayoutKind;

/// 3 whole regions and a part of a fourth.
const BLOCKS: u64 = 3 * REGION_BLOCKS + 1000;

/// A split volume with data runs in each region (one across each region
/// boundary), not yet migrated.
fn written(dir: &Path) -> PathBuf {
    split_volume_with_runs(
        dir,
        BLOCKS,
        &[
            0,
            40,
            REGION_BLOCKS - 30,
            2 * REGION_BLOCKS - 5,
            2 * REGION_BLOCKS + 500,
            BLOCKS - 64,
        ],
    )
}

/// Make `path` (split, from `written`) a volume with regions 0-1 packed
/// and 2-3 split: a corrupt block in region 2 stops `vouch migrate` after
/// region 1, and is then written again whole.
fn mixed(path: &Path) {
    let lba = 2 * REGION_BLOCKS + 510;
    flip_bit(&path.join("data.00000"), lba * BLOCK + 7, 0x04);
    let output = vouch(&["migrate", s(path), "--layout", "packed"]);
    assert!(!output.status.success(), "{}", text(&output));
    let volume = vouch_engine::regions::RegionVolume::open(path, &OpenOptions::default())
        .expect("open the regions");
    volume
        .write(lba * BLOCK, &random_bytes(BLOCK as usize, 77), false)
        .expect("rewrite the block");
    volume.close().expect("close");
    let regions = &info_json(path)["regions"];
    assert_eq!(
        (regions["packed"].as_u64(), regions["split"].as_u64()),
        (Some(2), Some(2)),
        "{regions}"
    );
}

fn export_bytes(path: &Path, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    vouch_ok(&["export", s(path), s(out)]);
    std::fs::read(out).expect("read export")
}

fn qemu_img_compare(image: &Path, uri: &str) {
    run_ok(Command::new(qemu_img()).args(["compare", "-f", "raw", "-F", "raw", s(image), uri]));
}

/// Write `count` blocks of `byte` at each LBA through NBD, then flush.
fn write_through(uri: &str, writes: &[(u64, u64, u8)]) {
    let spec: Vec<String> = writes
        .iter()
        .map(|(lba, count, byte)| format!("{lba}:{count}:{byte}"))
        .collect();
    py_json(
        r#"
h = connect(sys.argv[1])
for spec in sys.argv[2:]:
    lba, count, byte = (int(x) for x in spec.split(":"))
    h.pwrite(bytes([byte]) * (4096 * count), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &std::iter::once(uri)
            .chain(spec.iter().map(String::as_str))
            .collect::<Vec<_>>(),
    );
}

fn apply(image: &mut [u8], writes: &[(u64, u64, u8)]) {
    for (lba, count, byte) in writes {
        image[(lba * BLOCK) as usize..((lba + count) * BLOCK) as usize].fill(*byte);
    }
}

/// A snapshot of a volume with regions keeps each region's layout (the
/// record and the other member are in it), checks, verifies and serves the
/// image of its flush point read-only; the volume verifies and scrubs clean;
/// a clone of the snapshot takes writes across a region boundary and the
/// snapshot stays as it was; a corrupt block of the snapshot's other member
/// is named by `verify`; delete removes it.
#[test]
fn a_snapshot_of_a_volume_with_regions_keeps_its_layouts_and_serves_its_image() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written(dir.path());
    mixed(&path);
    let image = dir.path().join("image.raw");
    let want = export_bytes(&path, &image);

    vouch_ok(&["snapshot", "create", s(&path), "s1", "--copy"]);
    let snap = path.join("snapshots/s1");
    assert!(snap.join("regions").exists());
    assert!(snap.join("layout.packed/superblock").exists());
    let check = text(&vouch_ok(&["check", s(&snap)]));
    assert!(check.contains("2 split, 2 packed"), "{check}");
    assert_eq!(export_bytes(&snap, &dir.path().join("snap.raw")), want);
    let verified = vouch_ok(&["verify", s(&snap), "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&verified.stdout).expect("json");
    assert_eq!(report["blocks"], BLOCKS, "{report}");
    assert_eq!(report["faults"], serde_json::json!([]), "{report}");
    vouch_ok(&["verify", s(&path)]);
    let scrub = text(&vouch_ok(&["scrub", s(&path)]));
    assert!(scrub.contains("scrub finished"), "{scrub}");

    // Served: the image of the flush point, read-only.
    let mut server = Server::start(dir.path(), &["--snapshot", "s1", s(&path)]);
    qemu_img_compare(&image, &server.uri);
    let refused = py_json(
        r#"
h = connect(sys.argv[1])
try:
    h.pwrite(b"x" * 4096, 0)
    print(json.dumps({"write": "taken"}))
except nbd.Error as e:
    print(json.dumps({"write": "refused", "errno": e.errno}))
"#,
        &[&server.uri],
    );
    assert_eq!(refused["write"], "refused", "{refused}");
    server.stop();

    // A clone: writable, with regions, writes across the boundary of
    // region 1 (packed) and region 2 (split).
    let clone = dir.path().join("clone");
    vouch_ok(&["clone", s(&snap), s(&clone), "--copy"]);
    let regions = &info_json(&clone)["regions"];
    assert_eq!(regions["packed"], 2, "{regions}");
    let writes = [(2 * REGION_BLOCKS - 3, 6, 0x5a), (7, 1, 0xa5)];
    let mut server = Server::start(dir.path(), &[s(&clone)]);
    write_through(&server.uri, &writes);
    server.stop();
    let mut cloned = want.clone();
    apply(&mut cloned, &writes);
    assert!(export_bytes(&clone, &dir.path().join("clone.raw")) == cloned);
    assert_check_clean(&clone);
    assert!(export_bytes(&snap, &dir.path().join("snap.raw")) == want);
    assert_check_clean(&snap);
    // The clone migrates as any volume with regions does.
    vouch_ok(&["migrate", s(&clone), "--layout", "split"]);
    assert!(export_bytes(&clone, &dir.path().join("clone.raw")) == cloned);

    // A block of the snapshot's packed member corrupted: verify names it.
    vouch_ok(&["snapshot", "create", s(&path), "s2", "--copy"]);
    let s2 = path.join("snapshots/s2");
    let member_data = s2.join("layout.packed/data.00000");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&member_data, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    corrupt_first_data_block(&s2);
    let output = vouch(&["verify", s(&s2), "--json"]);
    assert!(!output.status.success(), "{}", text(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    let faults = report["faults"].as_array().expect("faults");
    assert_eq!(faults.len(), 1, "{report}");
    assert_eq!(faults[0]["lba"], 0, "{report}");

    vouch_ok(&["snapshot", "delete", s(&path), "s1"]);
    vouch_ok(&["snapshot", "delete", s(&path), "s2"]);
    assert!(!snap.exists() && !s2.exists());
    assert!(export_bytes(&path, &dir.path().join("after.raw")) == want);
}

/// Flip a bit of LBA 0's stored bytes in the packed member of `volume`:
/// the first data block of its data file (whatever the packed layout puts
/// before it, LBA 0 is the first block written, with data nonzero where
/// the layout's row header is not).
fn corrupt_first_data_block(volume: &Path) {
    let member = volume.join("layout.packed");
    let data = member.join("data.00000");
    let want = random_bytes((64 * BLOCK) as usize, 1);
    let bytes = std::fs::read(&data).expect("read the member's data");
    let at = bytes
        .windows(64)
        .position(|window| window == &want[..64])
        .expect("LBA 0's bytes in the packed member");
    flip_bit(&data, at as u64 + 3, 0x01);
}

/// Ranges (offset, length) of a `vouch diff --json`.
fn diff_ranges(args: &[&str]) -> Vec<(u64, u64)> {
    let out = vouch_ok(args);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("diff --json");
    json["ranges"]
        .as_array()
        .expect("ranges")
        .iter()
        .map(|range| {
            (
                range["offset"].as_u64().expect("offset"),
                range["length"].as_u64().expect("length"),
            )
        })
        .collect()
}

fn blocks_of(ranges: &[(u64, u64)]) -> Vec<u64> {
    ranges
        .iter()
        .flat_map(|(offset, length)| offset / BLOCK..(offset + length) / BLOCK)
        .collect()
}

/// `nbdinfo --map=qemu:dirty-bitmap:NAME` as (offset, length) of the dirty runs.
fn dirty_map(uri: &str, name: &str) -> Vec<(u64, u64)> {
    let map = nbdinfo_json(uri, &[&format!("--map=qemu:dirty-bitmap:{name}")]);
    let mut dirty: Vec<(u64, u64)> = Vec::new();
    for extent in map.as_array().expect("extents") {
        if extent["type"].as_u64() == Some(1) {
            let (offset, length) = (
                extent["offset"].as_u64().expect("offset"),
                extent["length"].as_u64().expect("length"),
            );
            match dirty.last_mut() {
                Some((at, len)) if *at + *len == offset => *len += length,
                _ => dirty.push((offset, length)),
            }
        }
    }
    dirty
}

/// Apply the ranges of `now` named by `ranges` to `copy`.
fn patch(copy: &mut [u8], now: &[u8], ranges: &[(u64, u64)]) {
    for (offset, length) in ranges {
        let (from, to) = (*offset as usize, (*offset + *length) as usize);
        copy[from..to].copy_from_slice(&now[from..to]);
    }
}

/// Changed blocks of a volume with regions: since a snapshot of it, the
/// blocks written through NBD in a packed and in a split region exactly
/// (`qemu:dirty-bitmap:s1` and `vouch diff`); after regions 0-1 move back
/// to split, every block written in them is changed (its contexts now the
/// split member's), those of regions 2-3 still exactly what was written;
/// since a snapshot taken before the volume had regions, every written
/// block of the regions it moved. Each set of ranges, applied to the
/// snapshot's image, gives the volume's.
#[test]
fn changed_blocks_of_a_volume_with_regions_are_told_region_by_region() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written(dir.path());
    // Before any region moved: a snapshot of one layout.
    vouch_ok(&["snapshot", "create", s(&path), "p0", "--copy"]);
    let p0 = export_bytes(&path.join("snapshots/p0"), &dir.path().join("p0.raw"));
    mixed(&path);
    vouch_ok(&["snapshot", "create", s(&path), "s1", "--copy"]);
    let s1 = path.join("snapshots/s1");
    let then = export_bytes(&s1, &dir.path().join("s1.raw"));

    let writes = [
        (100, 2, 0x11),                     // region 0, packed
        (REGION_BLOCKS + 7, 1, 0x22),       // region 1, packed
        (2 * REGION_BLOCKS + 9, 3, 0x33),   // region 2, split
        (3 * REGION_BLOCKS + 100, 1, 0x44), // region 3, split
    ];
    let mut server = Server::start(dir.path(), &[s(&path)]);
    write_through(&server.uri, &writes);
    let dirty = dirty_map(&server.uri, "s1");
    server.stop();
    let written_blocks: Vec<u64> = writes
        .iter()
        .flat_map(|(lba, count, _)| *lba..lba + count)
        .collect();
    assert_eq!(blocks_of(&dirty), written_blocks, "{dirty:?}");
    let now = export_bytes(&path, &dir.path().join("now.raw"));
    let mut copy = then.clone();
    patch(&mut copy, &now, &dirty);
    assert!(copy == now, "the incremental backup from s1 differs");
    let s1_arg = s(&s1).to_string();
    assert_eq!(diff_ranges(&["diff", &s1_arg, "--json"]), dirty);

    // Regions 0-1 back to split: each block written in them is changed.
    vouch_ok(&["migrate", s(&path), "--layout", "split"]);
    let moved = diff_ranges(&["diff", &s1_arg, "--json"]);
    let moved_blocks = blocks_of(&moved);
    let data_in = |image: &[u8], lba: u64| {
        image[(lba * BLOCK) as usize..((lba + 1) * BLOCK) as usize]
            .iter()
            .any(|byte| *byte != 0)
    };
    for lba in 0..2 * REGION_BLOCKS {
        if data_in(&now, lba) || data_in(&then, lba) {
            assert!(
                moved_blocks.binary_search(&lba).is_ok(),
                "LBA {lba} of a region moved since s1 is called unchanged"
            );
        }
    }
    let after: Vec<u64> = moved_blocks
        .iter()
        .copied()
        .filter(|lba| *lba >= 2 * REGION_BLOCKS)
        .collect();
    assert_eq!(
        after,
        written_blocks
            .iter()
            .copied()
            .filter(|lba| *lba >= 2 * REGION_BLOCKS)
            .collect::<Vec<_>>()
    );
    let now = export_bytes(&path, &dir.path().join("now.raw"));
    let mut copy = then.clone();
    patch(&mut copy, &now, &moved);
    assert!(copy == now, "the incremental backup after the move differs");

    // Since p0 (one layout, before the migration), served: the bitmap.
    let mut server = Server::start(dir.path(), &[s(&path)]);
    let since_p0 = dirty_map(&server.uri, "p0");
    server.stop();
    let mut copy = p0.clone();
    patch(&mut copy, &now, &since_p0);
    assert!(copy == now, "the incremental backup from p0 differs");
    let p0_arg = s(&path.join("snapshots/p0")).to_string();
    assert_eq!(diff_ranges(&["diff", &p0_arg, "--json"]), since_p0);
}

/// The bitmap of a served volume with regions against a snapshot taken
/// before its regions moved: blocks of a moved region are dirty wherever
/// written, never clean; blocks of regions still home exactly as written.
#[test]
fn a_served_volume_with_regions_answers_the_dirty_bitmap_of_a_snapshot_of_one_layout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = written(dir.path());
    vouch_ok(&["snapshot", "create", s(&path), "p0", "--copy"]);
    let p0 = export_bytes(&path.join("snapshots/p0"), &dir.path().join("p0.raw"));
    mixed(&path);
    let mut server = Server::start(dir.path(), &[s(&path)]);
    write_through(&server.uri, &[(3 * REGION_BLOCKS + 5, 1, 0x66)]);
    let dirty = blocks_of(&dirty_map(&server.uri, "p0"));
    server.stop();
    let now = export_bytes(&path, &dir.path().join("now.raw"));
    for lba in 0..BLOCKS {
        let range = (lba * BLOCK) as usize..((lba + 1) * BLOCK) as usize;
        let differs = p0[range.clone()] != now[range.clone()];
        let written_here = now[range].iter().any(|byte| *byte != 0);
        let moved = lba < 2 * REGION_BLOCKS;
        if differs || (moved && written_here) {
            assert!(
                dirty.binary_search(&lba).is_ok(),
                "LBA {lba} (moved: {moved}) is called clean"
            );
        }
    }
    // Regions 2-3 stayed split: only the block rewritten by `mixed` and
    // the one written now.
    let home: Vec<u64> = dirty
        .into_iter()
        .filter(|lba| *lba >= 2 * REGION_BLOCKS)
        .collect();
    assert_eq!(home, vec![2 * REGION_BLOCKS + 510, 3 * REGION_BLOCKS + 5]);
}

/// A region served by the other member then and now, but by another
/// member (the volume migrated home, its member removed, then migrated
/// again: a new member whose journal starts over), rewritten since with
/// the same layout of writes and no guard: every written block is
/// changed, and the incremental backup from the ranges equals the volume.
/// (Contexts also bind the member's volume tag, so these differ anyway;
/// the comparison counts a region of another member changed whatever its
/// contexts say.)
#[test]
fn a_region_of_a_member_made_again_is_changed_even_where_its_contexts_are_equal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("vol");
    let options = CreateOptions {
        layout: LayoutKind::Split,
        guard: vouch_format::GuardKind::None,
        ..CreateOptions::new(256 * BLOCK)
    };
    let write = |seed: u64| {
        let volume = vouch_engine::open_volume(&path, &OpenOptions::default()).expect("open");
        let data = random_bytes((64 * BLOCK) as usize, seed);
        volume.write(0, &data, false).expect("write");
        volume.close().expect("close");
    };
    vouch_engine::create_volume(&path, &options)
        .expect("create")
        .close()
        .expect("close");
    write(1);
    vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    vouch_ok(&["snapshot", "create", s(&path), "s1", "--copy"]);
    let s1 = path.join("snapshots/s1");
    vouch_ok(&["migrate", s(&path), "--layout", "split"]);
    write(2);
    vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    let then = export_bytes(&s1, &dir.path().join("s1.raw"));
    let now = export_bytes(&path, &dir.path().join("now.raw"));
    assert!(then[..4096] != now[..4096]);
    let changed = blocks_of(&diff_ranges(&["diff", s(&s1), "--json"]));
    assert_eq!(changed, (0..64).collect::<Vec<u64>>());
    let mut copy = then.clone();
    patch(&mut copy, &now, &diff_ranges(&["diff", s(&s1), "--json"]));
    assert!(copy == now, "the incremental backup differs");
}

/// Runs of blocks written: (LBA, blocks, byte).
type Writes<'a> = &'a [(u64, u64, u8)];

/// On `server`, a client writes `flushed` and flushes, writes
/// `unflushed` (acknowledged, not flushed), asks for snapshot `name` with
/// `vouch snapshot create --server`, writes `after` and flushes. Returns
/// what the create printed.
fn write_snapshot_write(
    server: &Server,
    name: &str,
    (flushed, unflushed, after): (Writes, Writes, Writes),
) -> String {
    let spec = serde_json::json!([flushed, unflushed, after]).to_string();
    let control = common::control::control(server).to_string();
    let answer = py_json(
        r#"
import subprocess
uri, vouch, control, name, spec = sys.argv[1:6]
flushed, unflushed, after = json.loads(spec)
h = connect(uri)
def put(writes):
    for lba, count, byte in writes:
        h.pwrite(bytes([byte]) * (4096 * count), lba * 4096)
put(flushed)
h.flush()
put(unflushed)
out = subprocess.run([vouch, "snapshot", "create", "--server", control, name],
                     capture_output=True, text=True)
if out.returncode != 0:
    raise SystemExit("snapshot create failed: " + out.stderr)
put(after)
h.flush()
print(json.dumps({"create": out.stdout}))
"#,
        &[&server.uri, vouch_bin(), &control, name, &spec],
    );
    answer["create"]
        .as_str()
        .expect("create's output")
        .to_string()
}

/// An online snapshot of a served volume with regions (issue 33): taken
/// through the server while regions 0-1 are packed (the other member) and
/// 2-3 split (the home), it holds every write acknowledged before the
/// call, flushed or not, in both members, and none after; it keeps the
/// layouts, checks clean, serves (`serve --snapshot`) the image of its
/// flush point; listed and deleted through the server.
#[test]
fn an_online_snapshot_of_a_served_volume_with_regions_holds_both_members_at_its_flush() {
    let fs = LoopFs::xfs();
    let dir = fs.mount.as_path();
    let path = written(dir);
    mixed(&path);
    let mut want = export_bytes(&path, &dir.join("image.raw"));
    let mut server = Server::start(dir, &[s(&path), "--control", "127.0.0.1:0"]);
    // Across regions 0|1 (both packed) and 1|2 (packed|split), flushed;
    // then in regions 0 (packed), 2 and 3 (split), not flushed.
    let flushed = [
        (REGION_BLOCKS - 3, 6, 0x31),
        (2 * REGION_BLOCKS - 3, 6, 0x32),
    ];
    let unflushed = [
        (10, 2, 0x33),
        (2 * REGION_BLOCKS + 600, 3, 0x34),
        (BLOCKS - 5, 5, 0x35),
    ];
    let after = [
        (REGION_BLOCKS - 3, 6, 0x41),
        (2 * REGION_BLOCKS - 3, 6, 0x42),
        (10, 2, 0x43),
        (2 * REGION_BLOCKS + 600, 3, 0x44),
    ];
    let said = write_snapshot_write(&server, "s1", (&flushed, &unflushed, &after));
    assert!(said.contains("held at the flush point"), "{said}");
    apply(&mut want, &flushed);
    apply(&mut want, &unflushed);
    let mut now = want.clone();
    apply(&mut now, &after);

    let snap = path.join("snapshots/s1");
    let image = dir.join("s1.raw");
    std::fs::write(&image, &want).expect("image");
    // Served (another process) while the volume is: its flush point's image.
    let mut served = Server::start(dir, &["--snapshot", "s1", s(&path)]);
    qemu_img_compare(&image, &served.uri);
    served.stop();
    let control = common::control::control(&server).to_string();
    let listed: serde_json::Value = serde_json::from_slice(
        &vouch_ok(&["snapshot", "list", "--server", &control, "--json"]).stdout,
    )
    .expect("json");
    assert_eq!(listed[0]["name"], "s1", "{listed}");
    assert_eq!(listed[0]["record"]["online"], true, "{listed}");
    server.stop();

    let check = text(&vouch_ok(&["check", s(&snap)]));
    assert!(check.contains("2 split, 2 packed"), "{check}");
    assert!(
        export_bytes(&snap, &dir.join("snap.raw")) == want,
        "the snapshot is not the volume at its flush point"
    );
    assert!(
        export_bytes(&path, &dir.join("after.raw")) == now,
        "the volume lost a write"
    );
    assert_check_clean(&path);
    let mut server = Server::start(dir, &[s(&path), "--control", "127.0.0.1:0"]);
    let control = common::control::control(&server).to_string();
    vouch_ok(&["snapshot", "delete", "--server", &control, "s1"]);
    assert!(!snap.exists());
    server.stop();
}
