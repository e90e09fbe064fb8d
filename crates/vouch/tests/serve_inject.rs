//! `vouch serve --inject`: a fault-injection layer stacked on the volume's
//! `BlockDevice`, driven by a real NBD client (python3-libnbd). Injected
//! faults reach the client as the engine's own would (EIO naming the LBA
//! and kind, ENOSPC), the volume underneath is never touched, and requests
//! outside the rules pass through.

mod common;

use common::*;

#[test]
fn injected_faults_reach_the_client_and_leave_the_volume_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(
        dir.path(),
        &[
            s(&volume),
            "--create",
            "1MiB",
            "--metrics",
            "127.0.0.1:0",
            "--inject",
            "read:ref_tag_mismatch@5,write:nospace@9-10",
        ],
    );
    let result = py_json(
        r#"
h, log = connect_logged(sys.argv[1])
out = {"writes": {}, "reads": {}}
for lba in range(16):
    out["writes"][str(lba)] = attempt(log, lambda: h.pwrite(block_data(lba, 7), lba * 4096))
h.flush()
for lba in range(16):
    def read():
        if h.pread(4096, lba * 4096) != block_data(lba, 7) and lba not in (9, 10):
            raise RuntimeError("wrong data at LBA %d" % lba)
    out["reads"][str(lba)] = attempt(log, read)
out["zero_9"] = attempt(log, lambda: h.zero(4096, 9 * 4096))
print(json.dumps(out))
"#,
        &[&server.uri],
    );
    for lba in 0..16u64 {
        let write = &result["writes"][lba.to_string()];
        if lba == 9 || lba == 10 {
            assert_eq!(write["errnum"], libc::ENOSPC, "write {lba}: {result}");
        } else {
            assert_eq!(*write, "ok", "write {lba}: {result}");
        }
        let read = &result["reads"][lba.to_string()];
        if lba == 5 {
            assert_eq!(read["errnum"], libc::EIO, "read 5: {result}");
            let messages = read["server_messages"].to_string();
            assert!(
                messages.contains("LBA 5") && messages.contains("ref_tag_mismatch"),
                "the injected fault names its LBA and kind: {result}"
            );
        } else {
            assert_eq!(*read, "ok", "read {lba}: {result}");
        }
    }
    assert_eq!(result["zero_9"]["errnum"], libc::ENOSPC, "{result}");
    let metrics = server.metrics_text();
    let faults = metric(
        &metrics,
        r#"vouch_nbd_verification_faults_total{kind="ref_tag_mismatch",export="vol"}"#,
    );
    assert_eq!(faults, Some(1.0), "{metrics}");
    drop(server);
    // The layer failed requests before they reached the volume: every
    // block verifies, and the refused writes left their blocks holes.
    assert_check_clean(&volume);
    let server = Server::start(dir.path(), &[s(&volume)]);
    let reread = py_json(
        r#"
h = connect(sys.argv[1])
print(json.dumps({
    "5": h.pread(4096, 5 * 4096) == block_data(5, 7),
    "9": h.pread(4096, 9 * 4096) == bytes(4096),
}))
"#,
        &[&server.uri],
    );
    assert_eq!(reread["5"], true, "{reread}");
    assert_eq!(reread["9"], true, "{reread}");
}

/// The injector is a layer: what it does not change reaches the volume
/// below, fast paths included. Under `--inject` with `--direct`, 4 KiB
/// writes are stored inline (the reactor's `try_write_shared`) and reads
/// of blocks at home are answered from the volume's read ring, while the
/// rules still hold on those routes: the write rule's LBA fails with EIO
/// on the inline path too, and the read rule's LBA fails with EIO naming
/// it, alone or inside a longer read, and every other LBA reads right.
#[test]
fn injection_keeps_the_inline_and_ring_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(
        dir.path(),
        &[
            s(&volume),
            "--create",
            "16MiB",
            "--direct",
            "--metrics",
            "127.0.0.1:0",
            "--inject",
            "read:guard_mismatch@100,write:io@200",
        ],
    );
    let result = py_json(
        r#"
h, log = connect_logged(sys.argv[1])
blocks = 256
writes = {lba: attempt(log, lambda: h.pwrite(block_data(lba, 3), lba * 4096))
          for lba in range(blocks)}
h.flush()
def read(lba):
    got = []
    outcome = attempt(log, lambda: got.append(h.pread(4096, lba * 4096)))
    want = bytes(4096) if lba == 200 else block_data(lba, 3)
    return "wrong data" if outcome == "ok" and got[0] != want else outcome
reads = {lba: read(lba) for lba in range(blocks)}
print(json.dumps({
    "write_failures": {str(lba): w for lba, w in writes.items() if w != "ok"},
    "read_failures": {str(lba): r for lba, r in reads.items() if r != "ok"},
    "span": attempt(log, lambda: h.pread(8 * 4096, 96 * 4096)),
}))
"#,
        &[&server.uri],
    );
    let write_failures = result["write_failures"].as_object().expect("object");
    assert_eq!(
        write_failures.keys().collect::<Vec<_>>(),
        ["200"],
        "only the write rule's LBA fails: {result}"
    );
    assert_eq!(
        result["write_failures"]["200"]["errnum"],
        libc::EIO,
        "{result}"
    );
    let read_failures = result["read_failures"].as_object().expect("object");
    assert_eq!(
        read_failures.keys().collect::<Vec<_>>(),
        ["100"],
        "only the read rule's LBA fails, every other reads right: {result}"
    );
    for failure in [&result["read_failures"]["100"], &result["span"]] {
        assert_eq!(failure["errnum"], libc::EIO, "{result}");
        let messages = failure["server_messages"].to_string();
        assert!(
            messages.contains("LBA 100") && messages.contains("guard_mismatch"),
            "the injected fault names its LBA and kind: {result}"
        );
    }
    let metrics = server.metrics_text();
    let inline_writes = metric(
        &metrics,
        r#"vouch_nbd_inline_requests_total{command="write",export="vol"}"#,
    )
    .unwrap_or(0.0);
    assert!(
        inline_writes >= 200.0,
        "writes were stored inline under --inject ({inline_writes}):\n{metrics}"
    );
    let ring_answered = metric(
        &metrics,
        r#"vouch_nbd_ring_reads_total{outcome="answered",export="vol"}"#,
    )
    .unwrap_or(0.0);
    assert!(
        ring_answered >= 200.0,
        "reads were answered from the ring under --inject ({ring_answered}):\n{metrics}"
    );
    drop(server);
    // Nothing the rules refused reached the volume; everything else did.
    assert_check_clean(&volume);
}

#[test]
fn a_bad_inject_spec_is_one_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let output = vouch(&[
        "serve",
        s(&volume),
        "--create",
        "1MiB",
        "--inject",
        "read:nospace@3",
    ]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    let all = text(&output);
    assert!(all.contains("unknown read fault"), "{all}");
    assert!(!volume.exists(), "nothing is created on a bad command line");
}
