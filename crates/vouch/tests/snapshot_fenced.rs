//! Fenced online snapshots (issue 33): on xfs the control API's create
//! answers at the fence (`"wait": false`), the files are cloned after
//! while clients write, and the snapshot equals the data at its flush; a
//! kill -9 while it is materialised is finished by the next open. Real xfs
//! on a loop device (needs root and `mkfs.xfs`), real NBD clients (fio's
//! nbd engine, nbdsh).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::control::{control, request};
use common::*;
use serde_json::{json, Value};

/// `POST` a snapshot `name` of export `vol` with `"wait": false`: the
/// answer, which must say it is materialising (the fenced route).
fn create_at_fence(server: &Server, name: &str) -> Value {
    let (status, answer) = request(
        control(server),
        "POST",
        "/v1/exports/vol/snapshots",
        Some(&json!({"name": name, "wait": false})),
        None,
    );
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["materialising"], true, "not fenced: {answer}");
    eprintln!(
        "fenced create: held {:.1} ms, {:.1} ms in all",
        answer["held_ms"].as_f64().unwrap(),
        answer["total_ms"].as_f64().unwrap()
    );
    answer
}

/// Wait until no snapshot of export `vol` is materialising.
fn wait_materialised(server: &Server) {
    wait_until(
        "the snapshot materialised",
        Duration::from_secs(120),
        || {
            let (status, answer) = request(
                control(server),
                "GET",
                "/v1/exports/vol/snapshots",
                None,
                None,
            );
            status == 200
                && answer["snapshots"]
                    .as_array()
                    .is_some_and(|items| items.iter().all(|item| item["materialising"] == false))
        },
    );
}

/// The published snapshot at `snapshot` has its flush point's superblock
/// (marked a snapshot, the record's generation), not the live one's, and
/// no fence or log left.
fn assert_fenced_superblock(snapshot: &Path) {
    assert!(!snapshot.join("fence").exists() && !snapshot.join("before").exists());
    let superblock = vouch_engine::volume_superblock(snapshot).expect("superblock");
    assert_ne!(
        superblock.features.ro_compat & vouch_format::FeatureFlags::RO_COMPAT_SNAPSHOT,
        0,
        "the snapshot's superblock is not marked a snapshot"
    );
    let record: Value =
        serde_json::from_slice(&std::fs::read(snapshot.join("snapshot")).expect("record"))
            .expect("record json");
    assert_eq!(
        record["superblock_generation"].as_u64(),
        Some(superblock.generation),
        "the snapshot's superblock is not the one of its flush point"
    );
}

/// Write `data` at `offset` through `uri` and flush (acknowledged).
fn overwrite(dir: &Path, uri: &str, offset: u64, data: &[u8]) {
    let file = dir.join("overwrite.bin");
    std::fs::write(&file, data).expect("payload");
    pwrite_file(uri, &file, offset);
}

#[test]
fn a_fenced_snapshot_taken_during_fio_writes_equals_the_data_at_its_flush() {
    let fs = LoopFs::xfs();
    let dir = &fs.mount;
    const SIZE: usize = 64 << 20;
    let first = random_bytes(SIZE, 3);
    let volume = volume_from(dir, "vol", &first);
    let mut server = Server::start(
        dir,
        &[
            s(&volume),
            "--control",
            "127.0.0.1:12780",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    // fio writes the second half, with verification, across the create.
    let mut fio = Command::new(tool("fio", "fio"))
        .args([
            "--name=across",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            &format!("--offset={}", SIZE / 2),
            &format!("--size={}", SIZE / 2),
            "--time_based",
            "--runtime=4",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("fio");
    // The create is taken once fio's writes are being answered (an event,
    // not a sleep), so it lands among them.
    wait_until(
        "fio's first writes answered",
        Duration::from_secs(60),
        || {
            let text = server.metrics_text();
            metric(
                &text,
                r#"vouch_nbd_requests_total{command="write",export="vol"}"#,
            )
            .unwrap_or(0.0)
                >= 256.0
        },
    );
    create_at_fence(&server, "during");
    // The first half is written only after the answer: the snapshot keeps
    // its old data there, imaged before each home write.
    let second = random_bytes(SIZE / 2, 4);
    overwrite(dir, &server.uri, 0, &second);
    assert!(fio.wait().expect("fio").success(), "fio failed");
    wait_materialised(&server);
    server.stop();
    let snapshot = volume.join("snapshots/during");
    assert_fenced_superblock(&snapshot);
    let image = exported(&snapshot, dir, "during");
    assert!(
        image[..SIZE / 2] == first[..SIZE / 2],
        "the snapshot holds writes issued after its create answered"
    );
    let now = exported(&volume, dir, "now");
    assert!(now[..SIZE / 2] == second[..], "the volume lost a write");
    // Every block of both verifies (data and context of one time).
    assert_check_clean(&snapshot);
    assert_check_clean(&volume);
}

#[test]
fn a_kill_while_a_fenced_snapshot_materialises_is_finished_by_the_next_open() {
    let fs = LoopFs::xfs_of(2 << 30);
    let dir = &fs.mount;
    let volume = dir.join("vol");
    vouch_ok(&["create", "--size", "512M", s(&volume)]);
    let mut server = Server::start(dir, &[s(&volume), "--control", "127.0.0.1:12781"]);
    // Random 4 KiB writes into the sparse volume make as many extents (so
    // the clones take a while), then the whole volume is read back: the
    // data at the flush.
    let at_flush = dir.join("at_flush.raw");
    py_json(
        r#"
import random
h = connect(sys.argv[1])
size = h.get_size()
rng = random.Random(9)
for _ in range(30000):
    lba = rng.randrange(size // 4096)
    h.pwrite(rng.randbytes(4096), lba * 4096)
h.flush()
with open(sys.argv[2], "wb") as out:
    for at in range(0, size, 1 << 22):
        out.write(h.pread(1 << 22, at))
print(json.dumps({"ok": True}))
"#,
        &[&server.uri, s(&at_flush)],
    );
    create_at_fence(&server, "cut");
    // Written after the fence, and the server killed by the client the
    // moment its flush is acknowledged: the writes are in the journal, and
    // the reopen's replay moves them home (imaged: it re-arms first).
    let overwritten = random_bytes(8 << 20, 6);
    let file = dir.join("overwrite.bin");
    std::fs::write(&file, &overwritten).expect("payload");
    let partial = volume.join("snapshots/.cut.partial");
    py_json(
        r#"
import os, signal
h = connect(sys.argv[1])
h.pwrite(open(sys.argv[2], "rb").read(), 0)
h.flush()
os.kill(int(sys.argv[3]), signal.SIGKILL)
print(json.dumps({"ok": True}))
"#,
        &[&server.uri, s(&file), &server.pid.to_string()],
    );
    let cut = partial.join("fence").exists();
    let _ = server.reap(Duration::from_secs(10));
    assert!(
        cut,
        "the snapshot materialised before the kill: nothing was cut"
    );
    // The next open re-arms the fence before its replay and finishes it.
    let started = Instant::now();
    let mut again = server.restart();
    eprintln!("reopen with a fence: {:?}", started.elapsed());
    wait_materialised(&again);
    again.stop();
    assert!(!partial.exists());
    let snapshot = volume.join("snapshots/cut");
    assert_fenced_superblock(&snapshot);
    let image = exported(&snapshot, dir, "cut");
    assert!(
        image == std::fs::read(&at_flush).expect("at flush"),
        "the snapshot differs from the data at its flush"
    );
    let now = exported(&volume, dir, "now");
    assert!(
        now[..8 << 20] == overwritten[..],
        "the volume lost an acknowledged write"
    );
    assert_check_clean(&snapshot);
    assert_check_clean(&volume);
}
