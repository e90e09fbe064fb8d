//! SIGKILL a server in the middle of a control-API copy and of a scrub:
//! after a restart every destination block reads its old or its new
//! contents, and the scrub resumes from its persisted cursor.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::clients::{qemu_img, qemu_img_compare_ok};
use common::control::{job, request, submit, wait_job};
use common::*;
use serde_json::{json, Value};

/// An export's bytes, read over NBD with qemu-img convert.
fn read_export(server: &Server, name: &str, dir: &Path) -> Vec<u8> {
    let out = dir.join(format!("{name}.read"));
    let _ = std::fs::remove_file(&out);
    run_ok(Command::new(qemu_img()).args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &server.export_uri(name),
        s(&out),
    ]));
    std::fs::read(&out).expect("read back")
}

#[test]
fn sigkill_during_a_copy_leaves_each_destination_block_old_or_new() {
    let dir = tempfile::tempdir().expect("tempdir");
    let size = 256usize << 20;
    let new = random_bytes(size, 11);
    let old = random_bytes(size, 12);
    let a = volume_from(dir.path(), "a", &new);
    let b = volume_from(dir.path(), "b", &old);
    let mut server = Server::start(dir.path(), &[s(&a), s(&b), "--control", "127.0.0.1:0"]);
    let id = submit(
        &server,
        json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "b"}, "length": size}),
    );
    let mut seen = Value::Null;
    wait_until("the copy to make progress", TIMEOUT, || {
        seen = job(&server, id);
        seen["progress"]["done_blocks"].as_u64().unwrap_or(0) >= 2048
    });
    server.kill9();
    let total = (size as u64) / BLOCK;
    let done = seen["progress"]["done_blocks"].as_u64().expect("done");
    assert!(done < total, "the copy finished before the kill: {seen}");

    let mut server = server.restart();
    let after = read_export(&server, "b", dir.path());
    assert_eq!(after.len(), size);
    let (mut new_blocks, mut old_blocks) = (0, 0);
    for (index, block) in after.chunks(BLOCK as usize).enumerate() {
        let range = index * BLOCK as usize..(index + 1) * BLOCK as usize;
        if block == &new[range.clone()] {
            new_blocks += 1;
        } else if block == &old[range] {
            old_blocks += 1;
        } else {
            panic!("LBA {index} of b is neither its old nor its new contents");
        }
    }
    assert_eq!(new_blocks + old_blocks, total as usize);
    eprintln!("after the kill at {done}/{total}: {new_blocks} new, {old_blocks} old blocks");
    // The copy run again completes, and the exports are then identical.
    let again = submit(
        &server,
        json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "b"}, "length": size}),
    );
    let finished = wait_job(&server, again, TIMEOUT);
    assert_eq!(finished["state"], "finished", "{finished}");
    qemu_img_compare_ok(&server.export_uri("a"), &server.export_uri("b"));
    server.stop();
    assert_check_clean(&b);
}

#[test]
fn sigkill_during_a_scrub_resumes_from_its_cursor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let size = 64usize << 20;
    let a = volume_from(dir.path(), "a", &random_bytes(size, 13));
    // One bad block near the end, found by the resumed run.
    let bad = 16000u64;
    flip_bit(&a.join("data.00000"), bad * BLOCK + 17, 0x10);
    let mut server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    let control = server.control.clone().expect("control");
    let id = submit(
        &server,
        json!({"op": "scrub", "export": "a", "rate": 16 << 20}),
    );
    let mut record = Value::Null;
    wait_until("the scrub record to show a cursor", TIMEOUT, || {
        let (_, exports) = request(&control, "GET", "/v1/exports", None, None);
        record = exports["exports"][0]["last_scrub"].clone();
        record["state"] == "running" && record["cursor"].as_u64().unwrap_or(0) > 0
    });
    assert_eq!(job(&server, id)["state"], "running");
    server.kill9();
    let stored: Value =
        serde_json::from_slice(&std::fs::read(a.join("scrub.json")).expect("scrub.json"))
            .expect("json");
    let cursor = stored["cursor"].as_u64().expect("cursor");
    assert!(cursor > 0 && cursor < (size as u64) / BLOCK, "{stored}");
    assert_eq!(stored["state"], "running", "{stored}");

    let server = server.restart();
    let resumed = submit(
        &server,
        json!({"op": "scrub", "export": "a", "rate": 32 << 20}),
    );
    let mut running = Value::Null;
    wait_until("the resumed scrub to run", TIMEOUT, || {
        running = job(&server, resumed);
        running["state"] != "queued"
            && running["progress"]["total_blocks"].as_u64().unwrap_or(0) > 0
    });
    let done = running["progress"]["done_blocks"].as_u64().expect("done");
    assert!(
        done >= cursor,
        "resumed at {done}, the cursor was {cursor}: {running}"
    );
    let finished = wait_job(&server, resumed, Duration::from_secs(120));
    assert_eq!(finished["state"], "finished", "{finished}");
    let result = &finished["result"];
    assert_eq!(
        result["started_unix"], record["started_unix"],
        "the same scrub, resumed: {result}"
    );
    assert_eq!(result["cursor"], (size as u64) / BLOCK);
    assert_eq!(
        result["faults"],
        json!([{"lba": bad, "kind": "guard_mismatch"}])
    );
    // `vouch scrub --status` reads the same record.
    let output = vouch(&[
        "scrub",
        "a",
        "--server",
        &control_of(&server),
        "--status",
        "--json",
    ]);
    let status: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(status["last_scrub"]["state"], "finished", "{status}");
}

fn control_of(server: &Server) -> String {
    server.control.clone().expect("control")
}
