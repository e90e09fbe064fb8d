//! Online resize of a mirror with local legs (`vouch resize --server`,
//! `POST /v1/exports/{export}/resize`) through a real `vouch serve
//! --control` and real NBD clients (libnbd's Python bindings, nbdinfo,
//! qemu-img): a grow with a connection open (it keeps its size, new ones
//! see the new size, writes past the old end land on both legs, the data
//! before is intact, `check` clean on each leg), a shrink over a written
//! tail refused naming its LBA, then done once it is trimmed; a kill -9
//! between two legs: the restart refuses the legs' two sizes, the offline
//! resize finishes it, nothing acknowledged is lost.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::clients::{nbd_size, qemu_img};
use common::control::{control, request};
use common::*;
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// `POST /v1/exports/{export}/resize` of the server's one export.
fn post_resize(ctl: &str, size: &str) -> (u16, Value) {
    let (status, exports) = request(ctl, "GET", "/v1/exports", None, None);
    assert_eq!(status, 200, "{exports}");
    let export = exports["exports"][0]["name"]
        .as_str()
        .expect("name")
        .to_string();
    request(
        ctl,
        "POST",
        &format!("/v1/exports/{export}/resize"),
        Some(&serde_json::json!({ "size": size })),
        None,
    )
}

fn qemu_img_size(uri: &str) -> u64 {
    let output = run_ok(Command::new(qemu_img()).args(["info", "--output=json", uri]));
    let info: Value = serde_json::from_slice(&output.stdout).expect("qemu-img json");
    info["virtual-size"].as_u64().expect("virtual-size")
}

/// Both legs' superblocks' sizes.
fn leg_sizes(a: &Path, b: &Path) -> (u64, u64) {
    let size = |leg: &Path| {
        vouch_engine::volume_superblock(leg)
            .expect("superblock")
            .size_bytes
    };
    (size(a), size(b))
}

/// Blocks `lbas` of one leg, opened alone read-only.
fn leg_blocks(leg: &Path, lbas: &[u64]) -> Vec<Vec<u8>> {
    let volume = vouch_engine::open_volume(
        leg,
        &vouch_engine::OpenOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .expect("open a leg read-only");
    let blocks = lbas
        .iter()
        .map(|lba| {
            let mut block = vec![0u8; BLOCK as usize];
            vouch_engine::BlockDevice::read(&volume, lba * BLOCK, &mut block).expect("read");
            block
        })
        .collect();
    volume.close().expect("close");
    blocks
}

/// A mirror of legs `dir/a` and `dir/b` of `size`.
fn mirror(dir: &Path, size: &str) -> (PathBuf, PathBuf) {
    let (a, b) = (dir.join("a"), dir.join("b"));
    vouch_ok(&["create", s(&a), "--size", size, "--mirror", s(&b)]);
    (a, b)
}

/// On one connection open throughout: tagged blocks 0..32 and the old
/// last block written; the mirror grown to 24M by `vouch resize --server`
/// (run from the script, the connection open); the old connection still
/// reads and writes inside its size; a new connection writes past the old
/// end and the new last block.
const GROW: &str = r#"
import subprocess
h = connect(sys.argv[1])
vouch, ctl = sys.argv[2], sys.argv[3]
for lba in range(32):
    h.pwrite(block_data(lba, 1000 + lba), lba * 4096)
h.pwrite(block_data(2047, 5), 2047 * 4096)
h.flush()
r = subprocess.run([vouch, "resize", "--server", ctl, "24M"], capture_output=True, text=True)
old_same = all(h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba) for lba in range(32))
h.pwrite(block_data(40, 9), 40 * 4096)
h.flush()
h2 = connect(sys.argv[1])
h2.pwrite(block_data(2048, 6), 2048 * 4096)
h2.pwrite(block_data(6143, 7), 6143 * 4096)
h2.flush()
new_same = h2.pread(4096, 40 * 4096) == block_data(40, 9) and h2.pread(4096, 2047 * 4096) == block_data(2047, 5)
print(json.dumps({"code": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
    "old_size": h.get_size(), "new_size": h2.get_size(), "old_same": old_same, "new_same": new_same}))
"#;

#[test]
fn a_served_mirror_grows_online_on_both_legs_then_shrinks_only_over_an_unwritten_tail() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (a, b) = mirror(dir, "8M");
    let mut server = Server::start(dir, &[s(&a), "--control", "127.0.0.1:0"]);
    let ctl = control(&server).to_string();
    let uri = server.uri.clone();
    assert_eq!(nbd_size(&uri), 8 * MIB);

    let grown = py_json(GROW, &[&uri, vouch_bin(), &ctl]);
    assert_eq!(grown["code"], 0, "{grown}");
    assert!(
        grown["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("from 8388608 to 25165824 bytes"),
        "{grown}"
    );
    assert_eq!(grown["old_size"], 8 * MIB, "{grown}");
    assert_eq!(grown["new_size"], 24 * MIB, "{grown}");
    assert_eq!(grown["old_same"], true, "{grown}");
    assert_eq!(grown["new_same"], true, "{grown}");
    // New connections see the new size; the control API says so.
    assert_eq!(nbd_size(&uri), 24 * MIB);
    assert_eq!(qemu_img_size(&uri), 24 * MIB);
    let (status, exports) = request(&ctl, "GET", "/v1/exports", None, None);
    assert_eq!(status, 200, "{exports}");
    assert_eq!(exports["exports"][0]["size"], 24 * MIB, "{exports}");
    assert_eq!(exports["exports"][0]["resizing"], Value::Null, "{exports}");

    // A shrink over the written tail: 409 naming its first written LBA,
    // no leg resized.
    let (status, refused) = post_resize(&ctl, "8M");
    assert_eq!(status, 409, "{refused}");
    assert!(refused.to_string().contains("LBA 2048 "), "{refused}");
    assert_eq!(nbd_size(&uri), 24 * MIB);
    // Trimmed, the tail goes on both legs.
    py_json(
        r#"
h = connect(sys.argv[1])
h.trim(8 << 20, 16 << 20)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&uri],
    );
    let out = vouch_ok(&["resize", "--server", &ctl, "16M"]);
    assert!(text(&out).contains("to 16777216 bytes"), "{}", text(&out));
    assert_eq!(nbd_size(&uri), 16 * MIB);
    server.stop();

    assert_eq!(leg_sizes(&a, &b), (16 * MIB, 16 * MIB));
    assert_check_clean(&a);
    assert_check_clean(&b);
    // Both legs hold the same data: before the old end, and past it.
    let lbas = [0, 31, 40, 2047, 2048];
    let (on_a, on_b) = (leg_blocks(&a, &lbas), leg_blocks(&b, &lbas));
    assert!(on_a == on_b, "the legs differ");
    for (lba, block) in lbas.iter().zip(&on_a) {
        assert!(
            block.iter().any(|byte| *byte != 0),
            "LBA {lba} is empty on the legs"
        );
    }
    // Served again: the same size, the data.
    let mut server = Server::start(dir, &[s(&a)]);
    let back = py_json(
        r#"
h = connect(sys.argv[1])
same = all(h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba) for lba in range(32))
same = same and h.pread(4096, 2048 * 4096) == block_data(2048, 6)
print(json.dumps({"same": same, "size": h.get_size()}))
"#,
        &[&server.uri],
    );
    server.stop();
    assert_eq!(back["same"], true, "{back}");
    assert_eq!(back["size"], 16 * MIB, "{back}");
}

#[test]
fn a_kill_9_between_two_legs_is_refused_at_restart_and_finished_offline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (a, b) = mirror(dir, "8M");
    let marker = dir.join("paused");
    let mut command = Command::new(vouch_bin());
    command
        .arg("serve")
        .args([s(&a), "--control", "127.0.0.1:0"])
        .args(["--listen", "127.0.0.1:0", "--log", "info"])
        .env("VOUCH_TEST_PAUSE_BETWEEN_MIRROR_LEGS", &marker);
    let mut server = Server::launch(
        dir,
        command,
        vec![s(&a).to_string()],
        Expect {
            tcp: true,
            unix: false,
            metrics: false,
            control: true,
        },
    )
    .expect("serve");
    let ctl = control(&server).to_string();
    write_tagged_blocks(&server.uri, 32);
    let mut resize = Command::new(vouch_bin())
        .args(["resize", "--server", &ctl, "12M"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the resize");
    wait_until("the first leg resized", Duration::from_secs(60), || {
        marker.exists()
    });
    server.kill9();
    let _ = resize.wait();
    // The first leg has the new size, the second the old one.
    assert_eq!(leg_sizes(&a, &b), (12 * MIB, 8 * MIB));
    // The restart refuses the legs' two sizes, naming them.
    let refused = Server::try_start(dir, &[s(&a)])
        .err()
        .expect("served legs of two sizes");
    assert!(refused.contains("cut short between legs"), "{refused}");
    // The offline resize finishes it; nothing acknowledged is lost.
    vouch_ok(&["resize", s(&a), "12M"]);
    assert_eq!(leg_sizes(&a, &b), (12 * MIB, 12 * MIB));
    assert_check_clean(&a);
    assert_check_clean(&b);
    let mut server = Server::start(dir, &[s(&a)]);
    assert_eq!(nbd_size(&server.uri), 12 * MIB);
    let back = py_json(
        r#"
h = connect(sys.argv[1])
same = all(h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba) for lba in range(32))
print(json.dumps({"same": same}))
"#,
        &[&server.uri],
    );
    server.stop();
    assert_eq!(back["same"], true, "{back}");
    // The legs agree.
    let lbas: Vec<u64> = (0..32).collect();
    assert!(
        leg_blocks(&a, &lbas) == leg_blocks(&b, &lbas),
        "the legs differ"
    );
}

#[test]
fn a_mirror_with_a_stale_leg_is_not_resized_online() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let (a, b) = mirror(dir, "4M");
    // Served without b: b is stale.
    let hidden = dir.join("b.away");
    std::fs::rename(&b, &hidden).expect("hide b");
    let mut server = Server::start(dir, &[s(&a), "--control", "127.0.0.1:0"]);
    let ctl = control(&server).to_string();
    let (status, refused) = post_resize(&ctl, "8M");
    server.stop();
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused.to_string().contains("every leg must be active"),
        "{refused}"
    );
    std::fs::rename(&hidden, &b).expect("put b back");
    assert_eq!(leg_sizes(&a, &b), (4 * MIB, 4 * MIB));
}
