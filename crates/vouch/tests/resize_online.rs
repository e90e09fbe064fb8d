//! Online resize (`vouch resize --server`, `POST /v1/exports/{export}/resize`)
//! through a real `vouch serve --control` and real NBD clients (libnbd's
//! Python bindings, qemu-img, nbdinfo): a grow while a client writes, a
//! kill -9 right after it, shrinks refused over written data and old
//! connections kept inside the new end, bad requests.

mod common;

use std::process::Command;
use std::time::Duration;

use common::clients::{nbd_size, qemu_img};
use common::control::{control, request, request_raw};
use common::*;
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;

fn qemu_img_size(uri: &str) -> u64 {
    let output = run_ok(Command::new(qemu_img()).args(["info", "--output=json", uri]));
    let info: Value = serde_json::from_slice(&output.stdout).expect("qemu-img json");
    info["virtual-size"].as_u64().expect("virtual-size")
}

/// Write random blocks of the first `blocks` on one connection, each
/// write recorded once acknowledged, until the file `stop` exists; every
/// 16 writes (after a flush) the count acknowledged so far is put in the
/// file `progress`. Prints the last tag of every block written, the count
/// and the size the connection negotiated.
const WRITER: &str = r#"
import random
h = connect(sys.argv[1])
blocks, progress, stop = int(sys.argv[2]), sys.argv[3], sys.argv[4]
rng = random.Random(7)
last, i = {}, 0
while not os.path.exists(stop):
    lba = rng.randrange(blocks)
    i += 1
    h.pwrite(block_data(lba, i), lba * 4096)
    last[lba] = i
    if i % 16 == 0:
        h.flush()
        with open(progress + ".tmp", "w") as f:
            f.write(str(i))
        os.replace(progress + ".tmp", progress)
h.flush()
print(json.dumps({"last": last, "writes": i, "size": h.get_size()}))
"#;

/// The writes the WRITER reports acknowledged so far.
fn acknowledged(progress: &std::path::Path) -> u64 {
    std::fs::read_to_string(progress)
        .ok()
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or(0)
}

/// Every block in `last` (LBA -> tag) and `extra` reads back as written.
const READER: &str = r#"
h = connect(sys.argv[1])
want = json.loads(sys.argv[2])
bad = [lba for lba, tag in want.items() if h.pread(4096, int(lba) * 4096) != block_data(int(lba), tag)]
print(json.dumps({"bad": bad, "size": h.get_size()}))
"#;

fn grow_while_writing(layout: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "8M", "--layout", layout]);
    let mut server = Server::start(dir, &[s(&volume), "--control", "127.0.0.1:0"]);
    let uri = server.uri.clone();
    let ctl = control(&server).to_string();
    assert_eq!(nbd_size(&uri), 8 * MIB);

    // The writer runs until told to stop: the resize starts once it has
    // 64 writes acknowledged, and it is stopped only after 32 more were
    // acknowledged on its connection after the resize returned (MED-4 of
    // the resize review: events, not sleeps).
    let (progress, stop) = (dir.join("progress"), dir.join("stop"));
    let writer = {
        let (uri, progress, stop) = (uri.clone(), progress.clone(), stop.clone());
        std::thread::spawn(move || py_json(WRITER, &[&uri, "2048", s(&progress), s(&stop)]))
    };
    let writing = Duration::from_secs(120);
    wait_until("the writer's first writes", writing, || {
        acknowledged(&progress) >= 64
    });
    let out = vouch_ok(&["resize", "--server", &ctl, "64M"]);
    assert!(text(&out).contains("resized export"), "{}", text(&out));
    let before = acknowledged(&progress);
    wait_until("writes after the resize", writing, || {
        acknowledged(&progress) >= before + 32
    });
    assert!(!writer.is_finished(), "the writer stopped by itself");
    // New connections see the new size; the control API says so.
    assert_eq!(nbd_size(&uri), 64 * MIB);
    assert_eq!(qemu_img_size(&uri), 64 * MIB);
    let (status, exports) = request(&ctl, "GET", "/v1/exports", None, None);
    assert_eq!(status, 200, "{exports}");
    assert_eq!(exports["exports"][0]["size"], 64 * MIB);
    assert_eq!(exports["exports"][0]["resizing"], Value::Null);
    // A new connection writes the new last block.
    let last_lba = 64 * MIB / 4096 - 1;
    py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(block_data(int(sys.argv[2]), 1), int(sys.argv[2]) * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&uri, &last_lba.to_string()],
    );
    std::fs::write(&stop, b"").expect("stop the writer");
    let written = writer.join().expect("writer");
    // The writer's connection kept the size it negotiated.
    assert_eq!(written["size"], 8 * MIB, "{written}");
    assert!(written["writes"].as_u64().unwrap_or(0) >= 96, "{written}");

    // A crash right after: the new size, every acknowledged write and the
    // new tail's block survive.
    server.kill9();
    let mut server = server.restart();
    let mut want = written["last"].as_object().expect("last").clone();
    want.insert(last_lba.to_string(), json!(1));
    let back = py_json(READER, &[&server.uri, &Value::Object(want).to_string()]);
    assert_eq!(back["bad"], json!([]), "blocks lost or changed: {back}");
    assert_eq!(back["size"], 64 * MIB);
    server.stop();
    assert_eq!(info_json(&volume)["size_bytes"], 64 * MIB);
    assert_check_clean(&volume);
}

#[test]
fn a_split_volume_grows_online_while_a_client_writes_and_a_kill_9_keeps_it() {
    grow_while_writing("split");
}

#[test]
fn a_packed_volume_grows_online_while_a_client_writes_and_a_kill_9_keeps_it() {
    grow_while_writing("packed");
}

/// A shrink over written blocks is refused naming the first; trimmed, the
/// tail goes; a connection made before keeps its larger size but cannot
/// write (or read) past the new end, and nothing it wrote there is kept.
#[test]
fn an_online_shrink_cuts_only_an_unwritten_tail_and_old_connections_stop_at_the_new_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "16M"]);
    let mut server = Server::start(dir, &[s(&volume), "--control", "127.0.0.1:0"]);
    let ctl = control(&server).to_string();
    let answer = py_json(
        r#"
import subprocess
h = connect(sys.argv[1])
vouch, ctl = sys.argv[2], sys.argv[3]
def resize(size):
    r = subprocess.run([vouch, "resize", "--server", ctl, size], capture_output=True, text=True)
    return {"code": r.returncode, "stderr": r.stderr}
h.pwrite(block_data(3072, 1), 12 << 20)
h.pwrite(block_data(10, 1), 10 * 4096)
refused = resize("8M")
h.trim(4096, 12 << 20)
h.flush()
done = resize("8M")
def attempt_io(f):
    try:
        f()
        return None
    except nbd.Error as e:
        return e.errno
past_write = attempt_io(lambda: h.pwrite(block_data(3072, 2), 12 << 20))
past_read = attempt_io(lambda: h.pread(4096, 12 << 20))
inside = h.pread(4096, 10 * 4096) == block_data(10, 1)
h2 = connect(sys.argv[1])
print(json.dumps({"refused": refused, "done": done, "past_write": past_write,
    "past_read": past_read, "inside": inside, "old_size": h.get_size(),
    "new_size": h2.get_size()}))
"#,
        &[&server.uri, vouch_bin(), &ctl],
    );
    assert_eq!(answer["refused"]["code"], 2, "{answer}");
    let refused = answer["refused"]["stderr"].as_str().unwrap_or_default();
    assert!(
        refused.contains("409") && refused.contains("LBA 3072 "),
        "{answer}"
    );
    assert_eq!(answer["done"]["code"], 0, "{answer}");
    assert_eq!(answer["past_write"], "EINVAL", "{answer}");
    assert_eq!(answer["past_read"], "EINVAL", "{answer}");
    assert_eq!(answer["inside"], true, "{answer}");
    assert_eq!(answer["old_size"], 16 * MIB, "{answer}");
    assert_eq!(answer["new_size"], 8 * MIB, "{answer}");
    server.stop();
    assert_eq!(info_json(&volume)["size_bytes"], 8 * MIB);
    assert_check_clean(&volume);
    // Grown again, the tail the old connection aimed at reads zeros.
    vouch_ok(&["resize", s(&volume), "16M"]);
    let raw = dir.join("out.raw");
    vouch_ok(&["export", s(&volume), s(&raw)]);
    let bytes = std::fs::read(&raw).expect("export");
    assert!(bytes[8 << 20..].iter().all(|b| *b == 0));
}

fn post_resize(ctl: &str, export: &str, body: &[u8]) -> (u16, Value) {
    request_raw(
        ctl,
        "POST",
        &format!("/v1/exports/{export}/resize"),
        body,
        None,
    )
}

#[test]
fn bad_online_resizes_get_a_clear_4xx() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "4M"]);
    let (a, b) = (dir.join("m0"), dir.join("m1"));
    vouch_ok(&["create", s(&a), "--size", "4M", "--mirror", s(&b)]);
    let snap_source = dir.join("ro");
    vouch_ok(&["create", s(&snap_source), "--size", "4M"]);
    let server = Server::start(
        dir,
        &[
            s(&volume),
            s(&a),
            s(&snap_source),
            "--control",
            "127.0.0.1:0",
        ],
    );
    let ctl = control(&server).to_string();
    let names: Vec<String> = request(&ctl, "GET", "/v1/exports", None, None).1["exports"]
        .as_array()
        .expect("exports")
        .iter()
        .map(|e| e["name"].as_str().expect("name").to_string())
        .collect();
    let (vol, mirror) = (&names[0], &names[1]);
    for (body, status, says) in [
        (
            &b"{\"size\": 0}"[..],
            400,
            "not a positive multiple of 4096",
        ),
        (b"{\"size\": 4097}", 400, "not a positive multiple of 4096"),
        (b"{\"size\": \"1G1\"}", 400, "is not a size"),
        (b"{\"size\": \"2P\"}", 400, "larger than the largest volume"),
        (b"{\"size\": 8388608, \"x\": 1}", 400, "expected {\"size\""),
        (b"{}", 400, "expected {\"size\""),
        (b"[8388608]", 400, "expected {\"size\""),
        (b"garbage", 400, "expected {\"size\""),
    ] {
        let (got, answer) = post_resize(&ctl, vol, body);
        let shown = String::from_utf8_lossy(body);
        assert_eq!(got, status, "{shown}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{shown}: {answer}");
    }
    let (got, answer) = post_resize(&ctl, "nope", b"{\"size\": \"8M\"}");
    assert_eq!(got, 404, "{answer}");
    // A mirror is resized online (`tests/resize_mirror_online.rs`); a
    // bad request to it is refused the same way.
    let (got, answer) = post_resize(&ctl, mirror, b"{\"size\": 4097}");
    assert_eq!(got, 400, "{answer}");
    // Nothing changed size.
    let (_, exports) = request(&ctl, "GET", "/v1/exports", None, None);
    for export in exports["exports"].as_array().expect("exports") {
        assert_eq!(export["size"], 4 * MIB, "{export}");
    }
    // The CLI checks the size before it asks, and names the export.
    let output = vouch(&["resize", "--server", &ctl, vol, "4097"]);
    assert!(!output.status.success());
    assert!(text(&output).contains("not a positive multiple of 4096"));
    let output = vouch(&["resize", "--server", &ctl, "8M"]);
    assert!(
        text(&output).contains("the server has 3 exports"),
        "{}",
        text(&output)
    );
    drop(server);
}

/// A read-only export (`serve --read-only`) is not resized.
#[test]
fn a_read_only_export_is_not_resized_online() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "4M"]);
    let server = Server::start(
        dir,
        &[s(&volume), "--read-only", "--control", "127.0.0.1:0"],
    );
    let output = vouch(&["resize", "--server", control(&server), "8M"]);
    assert!(
        text(&output).contains("409") && text(&output).contains("read-only"),
        "{}",
        text(&output)
    );
    drop(server);
    assert_eq!(info_json(&volume)["size_bytes"], 4 * MIB);
}

/// After an online grow, reads that must wait for the device still go
/// through the volume's read ring (the new engine's storage shares the
/// ring the server watches), not to the worker threads: the answered
/// ring reads count every block read after the resize. `--direct`, so no
/// read is answered from the page cache first. Both layouts.
#[test]
fn reads_after_an_online_resize_still_use_the_read_ring() {
    for layout in ["split", "packed"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let dir = dir.path();
        let volume = dir.join("vol");
        vouch_ok(&["create", s(&volume), "--size", "16M", "--layout", layout]);
        let server = Server::start(
            dir,
            &[
                s(&volume),
                "--direct",
                "--control",
                "127.0.0.1:0",
                "--metrics",
                "127.0.0.1:0",
            ],
        );
        let blocks = 64;
        py_json(
            r#"
h = connect(sys.argv[1])
for lba in range(int(sys.argv[2])):
    h.pwrite(block_data(lba, 1), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
            &[&server.uri, &blocks.to_string()],
        );
        let out = vouch_ok(&["resize", "--server", control(&server), "32M"]);
        assert!(text(&out).contains("resized export"), "{}", text(&out));
        let series = r#"vouch_nbd_ring_reads_total{outcome="answered",export="vol"}"#;
        let before = metric(&server.metrics_text(), series).unwrap_or(0.0);
        let read = py_json(
            r#"
h = connect(sys.argv[1])
n = int(sys.argv[2])
print(json.dumps({"bad": [lba for lba in range(n) if h.pread(4096, lba * 4096) != block_data(lba, 1)], "size": h.get_size()}))
"#,
            &[&server.uri, &blocks.to_string()],
        );
        assert_eq!(read["bad"], json!([]), "{layout}: {read}");
        assert_eq!(read["size"], 32 * MIB, "{layout}: {read}");
        let metrics = server.metrics_text();
        let after = metric(&metrics, series).unwrap_or(0.0);
        assert!(
            after - before >= blocks as f64 / 2.0,
            "{layout}: reads after the resize were not answered from the ring ({before} -> {after}):\n{metrics}"
        );
        drop(server);
        assert_check_clean(&volume);
    }
}
