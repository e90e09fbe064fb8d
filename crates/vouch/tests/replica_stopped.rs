//! A replica that stays connected but stops reading (SIGSTOP) while an
//! NBD client writes through the mirror's completion path: the NBD
//! reactor that starts those writes never waits on the full socket
//! (`replica/src/plain.rs`), so another client's reads keep being
//! answered while those writes wait; the remote leg is taken out as stale
//! when `--replica-timeout` runs out, and only then are the writes
//! acknowledged, each on the local leg (the only live one).

mod common;
mod replica_support;

use common::*;
use replica_support::*;

/// The replica timeout, in seconds.
const REPLICA_TIMEOUT: u64 = 4;

/// Writes of `SIZE` bytes without FUA at `i + 1` MiB (i < COUNT), all in
/// flight at once, each block `block_data(lba, TAG)`; prints when each
/// write completed (seconds after the first was issued), that start (`t0`,
/// on the system's monotonic clock) and the errors.
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
print(json.dumps({"t0": t0, "done": done, "errors": errors}))
"#;

/// 4 KiB reads of blocks 0..256 (written with tag 900 + lba) without
/// pause until the file `argv[2]` exists; touches `argv[3]` after its
/// first 16 reads. Prints when each read was answered (on the system's
/// monotonic clock, which the writer's `t0` shares) and the blocks that
/// read back wrong.
const READER: &str = r#"
h = connect(sys.argv[1])
stop, started = sys.argv[2], sys.argv[3]
answered, bad, lba = [], [], 0
while not os.path.exists(stop):
    got = h.pread(4096, lba * 4096)
    answered.append(round(time.monotonic(), 4))
    if got != block_data(lba, 900 + lba):
        bad.append(lba)
    lba = (lba + 1) % 256
    if len(answered) == 16:
        open(started, "w").close()
print(json.dumps({"answered": answered, "bad": bad}))
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
    // Another client reads without pause from before the writes start
    // until they are all answered.
    let (stop, started) = (dir.path().join("stop"), dir.path().join("started"));
    let reader = {
        let (uri, stop, started) = (uri.clone(), stop.clone(), started.clone());
        std::thread::spawn(move || py_json(READER, &[&uri, s(&stop), s(&started)]))
    };
    wait_until("the reader to start", TIMEOUT, || started.exists());
    // 128 writes of 128 KiB, the most the completion path takes, each in
    // its own MiB (its own stripe: a write that finds its stripe held
    // takes a worker): 16 MiB, far more than the replica connection's
    // socket buffers hold, so the socket fills. (4 KiB writes would not
    // fill it: a connection has at most 256 requests in flight.)
    let (count, size, tag) = (128u64, 128u64 << 10, 7u64);
    let args = [count, size, tag].map(|n| n.to_string());
    let writes = py_json(WRITER, &[uri.as_str(), &args[0], &args[1], &args[2]]);
    std::fs::write(&stop, b"").expect("stop the reader");
    let reads = reader.join().expect("reader thread");
    assert_eq!(reads["bad"], serde_json::json!([]), "{}", reads["bad"]);
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
    // Reads kept being answered while every write waited for the replica:
    // over the last half of that wait, before the first write was
    // acknowledged. A reactor stuck on the full replica socket answers
    // none there (at most the one read it held, as it is let go).
    let first_ack = writes["t0"].as_f64().expect("t0") + earliest;
    let window = (first_ack - REPLICA_TIMEOUT as f64 / 2.0)..first_ack;
    let answered = reads["answered"].as_array().expect("answered");
    let during = answered
        .iter()
        .filter(|at| window.contains(&at.as_f64().expect("time")))
        .count();
    assert!(
        during >= 10,
        "{during} of {} reads answered in the {} s before the first write was: the reads waited for the replica\n{}",
        answered.len(),
        REPLICA_TIMEOUT as f64 / 2.0,
        exporter.log_text()
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
