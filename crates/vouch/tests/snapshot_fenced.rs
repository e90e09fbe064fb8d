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
    // Cleared by the server once published (no open since).
    assert!(!fenced_flag(&volume), "the FENCED flag outlived the fence");
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
    // The server holds the materialisation (a test hook) once the fence is
    // answered, so the kill below always finds the snapshot fenced.
    let held = dir.join("held");
    let mut command = Command::new(vouch_bin());
    command
        .arg("serve")
        .args([s(&volume), "--control", "127.0.0.1:12781"])
        .args(["--listen", "127.0.0.1:0", "--log", "info"])
        .env("VOUCH_TEST_HOLD_MATERIALISE", &held);
    let mut server = Server::launch(
        dir,
        command,
        [s(&volume), "--control", "127.0.0.1:12781"]
            .map(String::from)
            .to_vec(),
        Expect {
            tcp: true,
            unix: false,
            metrics: false,
            control: true,
        },
    )
    .expect("serve");
    // Random 4 KiB writes into the sparse volume make as many extents,
    // then the whole volume is read back: the data at the flush.
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
    wait_until("the materialisation held", Duration::from_secs(60), || {
        held.exists()
    });
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
        !cut || fenced_flag(&volume),
        "a fence without the FENCED flag"
    );
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
    assert!(!fenced_flag(&volume), "the FENCED flag outlived the fence");
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

/// Snapshot `name` of `volume` (on xfs) fenced through the engine API,
/// then `rounds` writes of 64 KiB, each flushed and checkpointed (its
/// home writes imaged: appends to the log), and the volume dropped
/// unclosed before the snapshot is materialised, as a crash leaves it.
/// Returns the data at the fence.
fn fence_and_crash(volume: &Path, name: &str, rounds: u64) -> Vec<u8> {
    use vouch_engine::{BlockDevice as _, DeviceWrites as _};
    let opened = vouch_engine::open_volume(volume, &Default::default()).expect("open");
    let size = opened.size() as usize;
    let mut at_fence = vec![0u8; size];
    for (at, chunk) in at_fence.chunks_mut(1 << 20).enumerate() {
        opened.read((at << 20) as u64, chunk).expect("read");
    }
    vouch_engine::snapshot::fenced::create_fenced(volume, &opened, name, "fenced-test")
        .expect("fenced create");
    assert!(fenced_flag(volume), "no FENCED flag while a fence exists");
    for round in 0..rounds {
        let data = random_bytes(64 << 10, 100 + round);
        opened
            .write(round * (1 << 20), &data, false)
            .expect("write");
        opened.flush().expect("flush");
        opened.checkpoint_now().expect("checkpoint");
    }
    drop(opened);
    at_fence
}

/// Open `volume` writable (as `serve` does: a fence left is armed, the
/// snapshot materialised or failed) and close it.
fn reopen(volume: &Path) {
    vouch_engine::open_volume(volume, &Default::default())
        .expect("the volume opens")
        .close()
        .expect("close");
}

/// Is the FENCED flag set in the volume's superblock?
fn fenced_flag(volume: &Path) -> bool {
    let superblock = vouch_engine::volume_superblock(volume).expect("superblock");
    superblock.features.incompat & vouch_format::FeatureFlags::INCOMPAT_FENCED != 0
}

/// The fence id of the fenced `.NAME.partial` at `partial`.
fn fence_id(partial: &Path) -> u64 {
    let fence: Value =
        serde_json::from_slice(&std::fs::read(partial.join("fence")).expect("fence"))
            .expect("fence json");
    fence["fence"].as_u64().expect("fence id")
}

#[test]
fn a_before_image_log_damaged_mid_log_fails_the_snapshot_and_the_volume_opens() {
    use vouch_engine::storage::before::read_records;
    let fs = LoopFs::xfs();
    let dir = &fs.mount;
    let volume = volume_from(dir, "vol", &random_bytes(64 << 20, 21));
    fence_and_crash(&volume, "cut", 6);
    let partial = volume.join("snapshots/.cut.partial");
    let log_path = partial.join("before");
    let mut log = std::fs::read(&log_path).expect("log");
    let (records, scanned) = read_records(&log, fence_id(&partial));
    assert!(
        records.len() >= 3,
        "too few records to damage one mid-log: {scanned:?}"
    );
    // A media error in the first record's payload, synced long ago.
    log[40 + 1000] ^= 0x20;
    std::fs::write(&log_path, &log).expect("damage the log");
    assert!(fenced_flag(&volume));
    // The next (writable) open fails the snapshot and opens the volume.
    reopen(&volume);
    assert_check_clean(&volume);
    assert!(partial.join("failed").exists() && !partial.join("fence").exists());
    assert_eq!(std::fs::read(&log_path).expect("log kept"), log);
    assert!(
        !volume.join("snapshots/cut").exists(),
        "a failed snapshot got its name"
    );
    assert!(!fenced_flag(&volume), "the FENCED flag outlived the fence");
    let failed = std::fs::read_to_string(partial.join("failed")).expect("failed");
    assert!(
        failed.contains("damaged at byte 0") && failed.contains("vouch snapshot delete"),
        "{failed}"
    );
    // `snapshot list` says it failed, with the cause (and succeeds).
    let listed = vouch_ok(&["snapshot", "list", s(&volume)]);
    let out = String::from_utf8_lossy(&listed.stdout);
    assert!(
        out.contains("cut\t") && out.contains("\tfailed: ") && out.contains("damaged at byte 0"),
        "{out}"
    );
    // The volume is writable; a new snapshot of the name waits for the
    // delete, which removes what is left.
    let written = random_bytes(4096, 22);
    {
        use vouch_engine::{BlockDevice as _, DeviceWrites as _};
        let opened = vouch_engine::open_volume(&volume, &Default::default()).expect("open");
        opened.write(0, &written, false).expect("write");
        opened.flush().expect("flush");
        opened.close().expect("close");
    }
    let refused = vouch(&["snapshot", "create", s(&volume), "cut"]);
    assert!(!refused.status.success());
    vouch_ok(&["snapshot", "delete", s(&volume), "cut"]);
    assert!(!partial.exists());
    vouch_ok(&["snapshot", "create", s(&volume), "cut"]);
    assert_eq!(
        &exported(&volume.join("snapshots/cut"), dir, "cut")[..4096],
        &written[..]
    );
    assert_check_clean(&volume);
}

#[test]
fn a_torn_last_append_still_finishes_the_snapshot() {
    use vouch_engine::storage::before::{encode_record, read_records};
    use vouch_engine::ObjectId;
    let fs = LoopFs::xfs();
    let dir = &fs.mount;
    let volume = volume_from(dir, "vol", &random_bytes(64 << 20, 31));
    let at_fence = fence_and_crash(&volume, "torn", 4);
    let partial = volume.join("snapshots/.torn.partial");
    let log_path = partial.join("before");
    let mut log = std::fs::read(&log_path).expect("log");
    let fence = fence_id(&partial);
    let (_, scanned) = read_records(&log, fence);
    assert_eq!(scanned.end, vouch_engine::storage::before::LogEnd::Whole);
    // An append a crash tore before its sync (so its home write was never
    // issued): a page of its record lost.
    let mut torn = encode_record(fence, ObjectId::Data(0), 0, &[7; 8192]);
    torn[40 + 4096] ^= 1;
    log.extend_from_slice(&torn);
    std::fs::write(&log_path, &log).expect("tear the log");
    assert!(fenced_flag(&volume));
    reopen(&volume);
    assert_check_clean(&volume);
    assert!(!partial.exists());
    assert!(!fenced_flag(&volume), "the FENCED flag outlived the fence");
    let snapshot = volume.join("snapshots/torn");
    assert_fenced_superblock(&snapshot);
    assert!(
        exported(&snapshot, dir, "torn") == at_fence,
        "the snapshot differs from the data at its fence"
    );
    assert_check_clean(&snapshot);
}

#[test]
fn a_failed_materialisation_disarms_the_layer_and_says_what_to_do() {
    let fs = LoopFs::xfs();
    let dir = &fs.mount;
    let volume = volume_from(dir, "vol", &random_bytes(64 << 20, 41));
    let opened = vouch_engine::open_volume(&volume, &Default::default()).expect("open");
    vouch_engine::snapshot::fenced::create_fenced(&volume, &opened, "stuck", "fenced-test")
        .expect("fenced create");
    let partial = volume.join("snapshots/.stuck.partial");
    // A directory where the first clone goes: the clone fails.
    let fence: Value =
        serde_json::from_slice(&std::fs::read(partial.join("fence")).expect("fence"))
            .expect("fence json");
    let first = fence["files"][0][0].as_str().expect("a file").to_string();
    std::fs::create_dir(partial.join(&first)).expect("in the way");
    let storage = opened.storage();
    let layer = storage.before_images().expect("the layer");
    assert!(layer.is_armed());
    let error = vouch_engine::snapshot::fenced::materialise(&volume, "stuck", &*storage)
        .expect_err("a clone onto a directory");
    assert!(
        !layer.is_armed(),
        "a failed materialisation left the layer armed"
    );
    let message = error.to_string();
    assert!(
        message.contains("never published") && message.contains("vouch snapshot delete"),
        "{message}"
    );
    assert!(partial.join("failed").exists() && !partial.join("fence").exists());
    // Writes go on, unimaged.
    use vouch_engine::{BlockDevice as _, DeviceWrites as _};
    opened.write(0, &[9; 4096], false).expect("write");
    opened.flush().expect("flush");
    opened.checkpoint_now().expect("checkpoint");
    drop(storage);
    drop(opened);
    // The next open leaves it failed, clears the flag; the volume is clean.
    reopen(&volume);
    assert_check_clean(&volume);
    assert!(partial.join("failed").exists() && !volume.join("snapshots/stuck").exists());
    assert!(!fenced_flag(&volume));
    vouch_ok(&["snapshot", "delete", s(&volume), "stuck"]);
    assert!(!partial.exists());
}
