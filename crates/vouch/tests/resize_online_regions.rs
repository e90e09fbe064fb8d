//! Online resize of a volume with regions (`vouch resize --server`, the
//! control API; `RegionVolume::resize_online`) through a real `vouch serve
//! --control` and real NBD clients: grown across a region's end while a
//! connection stays open (new connections see the new size, nbdinfo
//! and qemu-img too; the record gains a region in the home layout; the
//! data from before is unchanged), then shrunk back: refused over a
//! written tail, done once it is trimmed; both members and the record
//! follow every step, `check` is clean.

mod common;

use std::process::Command;

use common::clients::{nbd_size, qemu_img};
use common::control::{control, request};
use common::regions::{export_bytes, layouts_and_size};
use common::*;
use serde_json::Value;
use vouch_format::regions::REGION_BLOCKS;

/// One whole region and a part of a second.
const OLD_BLOCKS: u64 = REGION_BLOCKS + 500;
/// Three regions, the third in part.
const NEW_BLOCKS: u64 = 2 * REGION_BLOCKS + 700;

/// One connection open across a grow and a shrink: it writes before
/// and after each; a second connection, made after the grow, writes the
/// new tail (region 1's end, packed; region 2's last block, split); the
/// shrink is refused over it, then done once it is trimmed.
const CLIENT: &str = r#"
import subprocess
h = connect(sys.argv[1])
vouch, ctl, new, old = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
tail_packed, tail_split = int(sys.argv[6]), int(sys.argv[7])
def resize(size):
    r = subprocess.run([vouch, "resize", "--server", ctl, size], capture_output=True, text=True)
    return {"code": r.returncode, "out": r.stdout, "stderr": r.stderr}
h.pwrite(block_data(5, 1), 5 * 4096)
grown = resize(new)
h.pwrite(block_data(6, 1), 6 * 4096)
h.flush()
h2 = connect(sys.argv[1])
grown_size = h2.get_size()
for lba in (tail_packed, tail_split):
    h2.pwrite(block_data(lba, 1), lba * 4096)
h2.flush()
tail_reads = all(h2.pread(4096, lba * 4096) == block_data(lba, 1) for lba in (tail_packed, tail_split))
h2.shutdown()
refused = resize(old)
h3 = connect(sys.argv[1])
h3.trim((int(new) - int(old)), int(old))
h3.flush()
h3.shutdown()
shrunk = resize(old)
h.pwrite(block_data(7, 1), 7 * 4096)
h.flush()
inside = all(h.pread(4096, lba * 4096) == block_data(lba, 1) for lba in (5, 6, 7))
h4 = connect(sys.argv[1])
print(json.dumps({"grown": grown, "grown_size": grown_size, "tail_reads": tail_reads,
    "refused": refused, "shrunk": shrunk, "inside": inside,
    "old_conn_size": h.get_size(), "new_size": h4.get_size()}))
"#;

#[test]
fn a_volume_with_regions_grows_and_shrinks_online_while_a_connection_stays_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let path = split_volume_with_runs(dir, OLD_BLOCKS, &[0, REGION_BLOCKS - 30, OLD_BLOCKS - 64]);
    // Every region to packed: a volume with regions (its home is split).
    vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    let before = export_bytes(&path, &dir.join("before.img"));
    let (old, new) = (OLD_BLOCKS * BLOCK, NEW_BLOCKS * BLOCK);

    let mut server = Server::start(dir, &[s(&path), "--control", "127.0.0.1:0"]);
    let ctl = control(&server).to_string();
    assert_eq!(nbd_size(&server.uri), old);
    let (tail_packed, tail_split) = (REGION_BLOCKS + 600, NEW_BLOCKS - 1);
    let answer = py_json(
        CLIENT,
        &[
            &server.uri,
            vouch_bin(),
            &ctl,
            &new.to_string(),
            &old.to_string(),
            &tail_packed.to_string(),
            &tail_split.to_string(),
        ],
    );
    assert_eq!(answer["grown"]["code"], 0, "{answer}");
    assert!(
        answer["grown"]["out"]
            .as_str()
            .unwrap_or_default()
            .contains("resized export"),
        "{answer}"
    );
    assert_eq!(answer["grown_size"], new, "{answer}");
    assert_eq!(answer["tail_reads"], true, "{answer}");
    // Refused over the written tail, naming its first written LBA (the
    // packed member's, region 1).
    assert_eq!(answer["refused"]["code"], 2, "{answer}");
    let refused = answer["refused"]["stderr"].as_str().unwrap_or_default();
    assert!(
        refused.contains("409") && refused.contains(&format!("LBA {tail_packed} ")),
        "{answer}"
    );
    assert_eq!(answer["shrunk"]["code"], 0, "{answer}");
    assert_eq!(answer["inside"], true, "{answer}");
    assert_eq!(answer["old_conn_size"], old, "{answer}");
    assert_eq!(answer["new_size"], old, "{answer}");
    // Stock clients and the control API see the size now.
    assert_eq!(nbd_size(&server.uri), old);
    let info = run_ok(Command::new(qemu_img()).args(["info", "--output=json", &server.uri]));
    let info: Value = serde_json::from_slice(&info.stdout).expect("qemu-img json");
    assert_eq!(info["virtual-size"].as_u64(), Some(old));
    let (status, exports) = request(&ctl, "GET", "/v1/exports", None, None);
    assert_eq!(status, 200, "{exports}");
    assert_eq!(exports["exports"][0]["size"], old, "{exports}");
    assert_eq!(exports["exports"][0]["resizing"], Value::Null, "{exports}");
    server.stop();

    // The record back to two regions, both members at the old size, the
    // data from before unchanged but for the three blocks written.
    assert_eq!(
        layouts_and_size(&path),
        (vec!["packed".into(), "packed".into()], old)
    );
    assert!(!path.join("regions.resize").exists());
    assert_check_clean(&path);
    let after = export_bytes(&path, &dir.join("after.img"));
    assert_eq!(after.len(), before.len());
    for (lba, (now, then)) in after
        .chunks(BLOCK as usize)
        .zip(before.chunks(BLOCK as usize))
        .enumerate()
    {
        if (5..=7).contains(&lba) {
            continue;
        }
        assert!(now == then, "LBA {lba} changed");
    }
}

/// Grown online once and served again: the region added is in the home
/// layout, both members at the new size, the data the same.
#[test]
fn an_online_grow_of_a_volume_with_regions_adds_a_home_region_that_survives_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let path = split_volume_with_runs(dir, OLD_BLOCKS, &[0, OLD_BLOCKS - 64]);
    vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    let before = export_bytes(&path, &dir.join("before.img"));
    let new = NEW_BLOCKS * BLOCK;
    let mut server = Server::start(dir, &[s(&path), "--control", "127.0.0.1:0"]);
    let ctl = control(&server).to_string();
    vouch_ok(&["resize", "--server", &ctl, &new.to_string()]);
    assert_eq!(nbd_size(&server.uri), new);
    server.stop();
    assert_eq!(
        layouts_and_size(&path),
        (vec!["packed".into(), "packed".into(), "split".into()], new)
    );
    assert_check_clean(&path);
    let grown = export_bytes(&path, &dir.join("grown.img"));
    assert!(grown[..before.len()] == before[..], "the grow changed data");
    assert!(grown[before.len()..].iter().all(|byte| *byte == 0));
    let mut server = Server::start(dir, &[s(&path)]);
    assert_eq!(nbd_size(&server.uri), new);
    server.stop();
}

/// Refused while a background migration runs (naming it), and past the
/// region locks an open volume has (256 GiB); done once the migration is
/// stopped, its regions in both layouts.
#[test]
fn an_online_resize_of_a_volume_with_regions_is_refused_during_a_migration_and_past_its_locks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let path = split_volume_with_runs(dir, OLD_BLOCKS, &[0, OLD_BLOCKS - 64]);
    vouch_ok(&["migrate", s(&path), "--layout", "packed"]);
    let mut server = Server::start(dir, &[s(&path), "--control", "127.0.0.1:0"]);
    let ctl = control(&server).to_string();
    let new = NEW_BLOCKS * BLOCK;
    let body = serde_json::json!({"size": new});
    // Back to split at 8 MiB/s: region 0 alone takes 8 s, and the
    // migration stops only between regions.
    let (status, answer) = request(
        &ctl,
        "POST",
        "/v1/exports/vol/migrate",
        Some(&serde_json::json!({"layout": "split", "rate": "8M"})),
        None,
    );
    assert_eq!(status, 202, "{answer}");
    let (status, answer) = request(&ctl, "POST", "/v1/exports/vol/resize", Some(&body), None);
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap_or_default()
            .contains("a migration of this export is running"),
        "{answer}"
    );
    let (status, answer) = request(&ctl, "DELETE", "/v1/exports/vol/migrate", None, None);
    assert!(status < 300, "{answer}");
    wait_until(
        "the migration to stop",
        std::time::Duration::from_secs(120),
        || request(&ctl, "GET", "/v1/exports/vol/migrate", None, None).1["state"] != "running",
    );
    let (status, answer) = request(
        &ctl,
        "POST",
        "/v1/exports/vol/resize",
        Some(&serde_json::json!({"size": "300G"})),
        None,
    );
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap_or_default()
            .contains("restart the server to grow it further"),
        "{answer}"
    );
    let (status, answer) = request(&ctl, "POST", "/v1/exports/vol/resize", Some(&body), None);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(nbd_size(&server.uri), new);
    server.stop();
    let (layouts, size) = layouts_and_size(&path);
    assert_eq!((layouts.len(), size), (3, new), "{layouts:?}");
    assert_eq!(layouts[2], "split");
    assert_check_clean(&path);
}
