//! Overlay snapshots (issue 33): on ext4, which cannot clone, a snapshot
//! is a fence and a before-image log kept for its life. Offline and
//! online creates copy nothing; the snapshot equals the data at its flush
//! while the volume keeps being written, across a kill -9 mid-write and a
//! restart; it is exported, checked and served as any snapshot. Real ext4
//! on a loop device (needs root and `mkfs.ext4`), real NBD clients (fio's
//! nbd engine, nbdsh).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::control::{control, request};
use common::*;
use serde_json::json;

/// Write `data` at `offset` through `uri` and flush (acknowledged).
fn overwrite(dir: &Path, uri: &str, offset: u64, data: &[u8]) {
    let file = dir.join("overwrite.bin");
    std::fs::write(&file, data).expect("payload");
    pwrite_file(uri, &file, offset);
}

/// The first `len` bytes of the export at `uri`.
fn read_through(dir: &Path, uri: &str, len: usize) -> Vec<u8> {
    let out = dir.join("read.raw");
    py_json(
        r#"
h = connect(sys.argv[1])
size = int(sys.argv[3])
with open(sys.argv[2], "wb") as out:
    for at in range(0, size, 1 << 22):
        out.write(h.pread(min(1 << 22, size - at), at))
print(json.dumps({"ok": True}))
"#,
        &[uri, s(&out), &len.to_string()],
    );
    std::fs::read(&out).expect("read back")
}

/// Whether the volume's superblock carries OVERLAID.
fn overlaid(volume: &Path) -> bool {
    let superblock = vouch_engine::volume_superblock(volume).expect("superblock");
    superblock.features.incompat & vouch_format::FeatureFlags::INCOMPAT_OVERLAID != 0
}

/// The snapshot directory has no data segment, context table or written
/// map of its own: nothing was copied.
fn assert_nothing_copied(snapshot: &Path) {
    let mut names: Vec<String> = std::fs::read_dir(snapshot)
        .expect("snapshot dir")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["before", "journal", "overlay", "snapshot", "superblock"],
        "an overlay snapshot holds only its own small files and its log"
    );
}

#[test]
fn an_overlay_snapshot_on_ext4_keeps_its_flush_across_writes_and_a_kill() {
    let fs = LoopFs::ext4(1 << 30);
    let dir = &fs.mount;
    const SIZE: usize = 64 << 20;
    let first = random_bytes(SIZE, 11);
    let volume = volume_from(dir, "vol", &first);

    // Offline: an overlay, listed with its kind and space.
    let started = Instant::now();
    vouch_ok(&["snapshot", "create", s(&volume), "off"]);
    eprintln!("offline overlay create: {:?}", started.elapsed());
    let snapshot = volume.join("snapshots/off");
    assert_nothing_copied(&snapshot);
    assert!(overlaid(&volume), "OVERLAID is not set on the volume");
    let listed = text(&vouch_ok(&["snapshot", "list", s(&volume)]));
    assert!(listed.contains("overlay, 0 bytes in its log"), "{listed}");
    // One overlay per volume.
    let second = vouch(&["snapshot", "create", s(&volume), "second"]);
    assert!(!second.status.success());
    assert!(
        stderr_of(&second).contains("one overlay snapshot per volume"),
        "{}",
        stderr_of(&second)
    );
    // A clone of it is refused by name, not made of missing files.
    let clone = vouch(&["clone", s(&snapshot), s(&dir.join("clone"))]);
    assert!(!clone.status.success());
    assert!(
        stderr_of(&clone).contains("overlay snapshot"),
        "{}",
        stderr_of(&clone)
    );

    let args = [
        s(&volume),
        "--control",
        "127.0.0.1:12201",
        "--metrics",
        "127.0.0.1:0",
    ];
    let mut server = Server::start(dir, &args);
    // Acknowledged after the snapshot: the live volume keeps it, the
    // snapshot does not see it.
    let acknowledged = random_bytes(8 << 20, 12);
    overwrite(dir, &server.uri, 0, &acknowledged);
    // fio writes the second half until the server is killed mid-write.
    let mut fio = Command::new(tool("fio", "fio"))
        .args([
            "--name=killed",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            &format!("--offset={}", SIZE / 2),
            &format!("--size={}", SIZE / 2),
            "--time_based",
            "--runtime=60",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("fio");
    wait_until("fio's writes answered", Duration::from_secs(60), || {
        let text = server.metrics_text();
        metric(
            &text,
            r#"vouch_nbd_requests_total{command="write",export="vol"}"#,
        )
        .unwrap_or(0.0)
            >= 2048.0
    });
    server.kill9();
    let _ = fio.wait();
    // The restart re-arms the layer before its replay.
    let mut server = server.restart();
    let image = exported(&snapshot, dir, "off");
    assert!(
        image == first,
        "the overlay snapshot differs from the data at its flush after a kill -9 and a restart"
    );
    assert!(
        read_through(dir, &server.uri, 8 << 20) == acknowledged,
        "the volume lost an acknowledged write"
    );
    let listed = text(&vouch_ok(&["snapshot", "list", s(&volume)]));
    assert!(!listed.contains("overlay, 0 bytes"), "{listed}");

    // Online: the offline one deleted, another taken at a flush point.
    let (status, answer) = request(
        control(&server),
        "DELETE",
        "/v1/exports/vol/snapshots/off",
        None,
        None,
    );
    assert_eq!(status, 200, "{answer}");
    assert!(!snapshot.exists());
    assert!(!overlaid(&volume), "OVERLAID outlived the overlay");
    let at_flush = read_through(dir, &server.uri, SIZE);
    let (status, answer) = request(
        control(&server),
        "POST",
        "/v1/exports/vol/snapshots",
        Some(&json!({"name": "on"})),
        None,
    );
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["record"]["method"], "overlay", "{answer}");
    eprintln!(
        "online overlay create: held {:.1} ms, {:.1} ms in all",
        answer["held_ms"].as_f64().unwrap(),
        answer["total_ms"].as_f64().unwrap()
    );
    let online = volume.join("snapshots/on");
    assert_nothing_copied(&online);
    // A resize changes the files outside the layer: refused while the
    // overlay lives.
    let (status, answer) = request(
        control(&server),
        "POST",
        "/v1/exports/vol/resize",
        Some(&json!({"size": "128M"})),
        None,
    );
    assert_eq!(status, 409, "{answer}");
    assert!(answer.to_string().contains("overlay snapshot"), "{answer}");
    let later = random_bytes(16 << 20, 13);
    overwrite(dir, &server.uri, 0, &later);
    assert!(
        exported(&online, dir, "on") == at_flush,
        "the online overlay snapshot holds writes issued after its create answered"
    );
    // Served as its own export, beside the live volume.
    let mut served = Server::start(dir, &["--snapshot", "on", s(&volume)]);
    assert!(
        read_through(dir, &served.uri, 16 << 20) == at_flush[..16 << 20],
        "serve --snapshot reads other data than the flush point's"
    );
    served.stop();
    server.stop();
    assert_check_clean(&online);
    assert_check_clean(&volume);
    assert!(
        exported(&volume, dir, "now")[..16 << 20] == later[..],
        "the volume lost a write"
    );
}
