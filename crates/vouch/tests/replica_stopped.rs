//! A replica that stays connected but stops reading (SIGSTOP) while an
//! NBD client writes through the mirror's completion path: the NBD
//! reactor that starts those writes never waits on the full socket
//! (`replica/src/plain.rs`), so another client's reads keep being
//! answered at once; the remote leg is taken out as stale when
//! `--replica-timeout` runs out, and only then are the writes
//! acknowledged, each on the local leg (the only live one).

mod common;
mod replica_support;

use std::process::{Command, Stdio};

use common::*;
use replica_support::*;

/// The replica timeout, in seconds.
const REPLICA_TIMEOUT: u64 = 4;

/// Writes of `SIZE` bytes without FUA at `i + 1` MiB (i < COUNT), all in
/// flight at once, each block `block_data(lba, TAG)`; prints when each
/// write completed (seconds after the first was issued) and the errors.
const WRITER: &str = r#"
h = connect(sys.argv[1])
count, size, tag = (int(a) for a in sys.argv[2:5])
t0 = time.monotonic()
pending = {}
for i in range(count):
    offset = (i + 1) << 20
    buf = b"".join(block_data(offset // 4096 + j, tag) for j in range(size // 4096))
    pending[h.aio_pwrite(buf, offset)] = buf
done, errors = [], []
while pending:
    h.poll(-1)
    for cookie in list(pending):
        try:
            if not h.aio_command_completed(cookie):
                continue
        except nbd.Error as e:
            errors.append(err_info(e))
        done.append(time.monotonic() - t0)
        del pending[cookie]
h.flush()
print(json.dumps({"done": done, "errors": errors}))
"#;

/// 4 KiB reads of blocks 0..256 (written with tag 900 + lba) for
/// `SECONDS`: the slowest read (or connect), and the blocks that read
/// back wrong.
const READER: &str = r#"
t0 = time.monotonic()
h = connect(sys.argv[1])
worst = time.monotonic() - t0
reads, bad, lba = 0, [], 0
while time.monotonic() - t0 < float(sys.argv[2]):
    t = time.monotonic()
    got = h.pread(4096, lba * 4096)
    worst = max(worst, time.monotonic() - t)
    if got != block_data(lba, 900 + lba):
        bad.append(lba)
    lba = (lba + 1) % 256
    reads += 1
print(json.dumps({"reads": reads, "worst": worst, "bad": bad}))
"#;

/// Which blocks of the `WRITER`'s writes do not read back as written.
fn bad_blocks(uri: &str, count: u64, size: u64, tag: u64) -> serde_json::Value {
    let script = r#"
h = connect(sys.argv[1])
count, size, tag = (int(a) for a in sys.argv[2:5])
bad = []
for i in range(count):
    for lba in range(((i + 1) << 20) // 4096, (((i + 1) << 20) + size) // 4096):
        if h.pread(4096, lba * 4096) != block_data(lba, tag):
            bad.append(lba)
print(json.dumps({"bad": bad}))
"#;
    let args = [count, size, tag].map(|n| n.to_string());
    py_json(script, &[uri, &args[0], &args[1], &args[2]])["bad"].clone()
}

#[test]
fn a_replica_that_stops_reading_stalls_no_other_client_and_is_marked_stale_after_the_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut replica =
        replica_server(&dir.path().join("replicas"), "127.0.0.1:0", &[], None).expect("replica");
    let a = dir.path().join("a");
    let url = format!("vouch://{}/disk", replica.addr);
    vouch_ok(&["create", s(&a), "--size", "256MiB", "--mirror", &url]);
    // One reactor thread: every NBD connection is served by the thread
    // that starts the mirrored writes (with more, tokio's other workers
    // would serve the reads while one blocked).
    let timeout = REPLICA_TIMEOUT.to_string();
    let mut exporter = exporter_with(
        dir.path(),
        &[s(&a), "--replica-timeout", &timeout],
        None,
        &[("TOKIO_WORKER_THREADS", "1")],
    );
    let uri = format!("nbd://{}", exporter.addr);
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(256):
    h.pwrite(block_data(lba, 900 + lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&uri],
    );

    replica.send_signal(libc::SIGSTOP);
    // 128 writes of 128 KiB, the most the completion path takes, each in
    // its own MiB (its own stripe: a write that finds its stripe held
    // takes a worker): 16 MiB, far more than the replica connection's
    // socket buffers hold, so the socket fills. (4 KiB writes would not
    // fill it: a connection has at most 256 requests in flight.)
    let (count, size, tag) = (128u64, 128u64 << 10, 7u64);
    let args = [count, size, tag].map(|n| n.to_string());
    let writer = Command::new(python())
        .arg("-c")
        .arg(format!("{PY_PRELUDE}\n{WRITER}"))
        .args([uri.as_str(), &args[0], &args[1], &args[2]])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the writer");
    // Reads by another client while the writes wait for the replica.
    let reads = py_json(
        READER,
        &[&uri, &(REPLICA_TIMEOUT as f64 * 0.75).to_string()],
    );
    assert_eq!(reads["bad"], serde_json::json!([]), "{reads}");
    let worst = reads["worst"].as_f64().expect("worst");
    assert!(
        worst < 1.0,
        "a read waited {worst:.2} s while the replica read nothing: {reads}\n{}",
        exporter.log_text()
    );

    let output = wait_output(writer);
    assert!(output.status.success(), "writer: {}", text(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let writes: serde_json::Value = serde_json::from_str(stdout.trim()).expect("writer JSON");
    assert_eq!(writes["errors"], serde_json::json!([]), "{writes}");
    let done: Vec<f64> = writes["done"]
        .as_array()
        .expect("done")
        .iter()
        .map(|t| t.as_f64().expect("seconds"))
        .collect();
    assert_eq!(done.len() as u64, count);
    // The replica answered none: a write is acknowledged only once its
    // leg was given up (the timeout), never before.
    let earliest = done.iter().copied().fold(f64::MAX, f64::min);
    assert!(
        earliest >= REPLICA_TIMEOUT as f64 * 0.9,
        "a write was acknowledged after {earliest:.2} s, before the replica timed out"
    );
    let log = exporter.log_text();
    assert!(
        log.contains("STALE (unreachable)") && log.contains("timed out"),
        "{log}"
    );
    // (Exit status 1: degraded.)
    let status = text(&vouch(&["mirror", "status", s(&a)]));
    assert!(status.contains(&format!("leg 1: {url}: stale")), "{status}");
    // Every acknowledged write is on the live leg.
    assert_eq!(bad_blocks(&uri, count, size, tag), serde_json::json!([]));
    assert!(
        exporter.stop().is_some_and(|status| status.success()),
        "{}",
        exporter.log_text()
    );
    replica.send_signal(libc::SIGCONT);
    replica.stop();
}

/// Wait (bounded) for `child` and collect its output.
fn wait_output(mut child: std::process::Child) -> std::process::Output {
    let status = wait_timeout(&mut child, TIMEOUT);
    if status.is_none() {
        let _ = child.kill();
    }
    child.wait_with_output().expect("output")
}
