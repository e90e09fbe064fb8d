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
log = []
h = nbd.NBD()
h.set_debug(True)
h.set_debug_callback(lambda context, message: log.append(message))
h.connect_uri(sys.argv[1])
def attempt(f):
    log.clear()
    try:
        f()
        return "ok"
    except nbd.Error as e:
        info = err_info(e)
        info["server_messages"] = [m.split("server message: ", 1)[1] for m in log
                                   if "server message: " in m]
        return info
out = {"writes": {}, "reads": {}}
for lba in range(16):
    out["writes"][str(lba)] = attempt(lambda: h.pwrite(block_data(lba, 7), lba * 4096))
h.flush()
for lba in range(16):
    def read():
        if h.pread(4096, lba * 4096) != block_data(lba, 7) and lba not in (9, 10):
            raise RuntimeError("wrong data at LBA %d" % lba)
    out["reads"][str(lba)] = attempt(read)
out["zero_9"] = attempt(lambda: h.zero(4096, 9 * 4096))
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
