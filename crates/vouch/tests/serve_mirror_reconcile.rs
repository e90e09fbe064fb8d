//! An exporter crash under a write stream, with real processes and a real
//! NBD client (libnbd, 8 writes in flight, flushes): `kill -9` of the
//! server mid-stream, then a restart reconciles the extents the activity
//! log names (`mirror status` shows the leg `reconciling`, then every leg
//! active), and a scrub afterwards finds nothing: no difference between
//! the legs, no leg faulted, nothing counted against a leg (issue 31).
//! Before the restart, an offline `mirror status` reads the log and shows
//! the same regions pending on leg 1.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

/// Writes of 4-64 KiB at random places in the first 16 MiB (4 extents of
/// the activity log), 8 in flight, a flush every 64, until the server
/// goes away. Each completed write bumps the count in the file argv[2].
const WRITE_STREAM: &str = r#"
import random
h = connect(sys.argv[1])
progress = sys.argv[2]
rng = random.Random(31)
done = 0
try:
    while True:
        handles = []
        for _ in range(8):
            length = rng.choice([1, 2, 4, 8, 16]) * 4096
            offset = rng.randrange(0, (16 << 20) - length, 4096)
            handles.append(h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(os.urandom(length))), offset))
        while h.aio_in_flight() > 0:
            h.poll(-1)
        for c in handles:
            h.aio_command_completed(c)
        done += len(handles)
        if done % 64 == 0:
            h.flush()
        with open(progress + ".tmp", "w") as f:
            f.write(str(done))
        os.replace(progress + ".tmp", progress)
except nbd.Error:
    pass
"#;

fn status_json(server: &Server) -> Value {
    let output = vouch(&[
        "mirror",
        "status",
        "a",
        "--server",
        common::control::control(server),
        "--json",
    ]);
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("mirror status JSON ({e}): {}", text(&output)))
}

fn written(progress: &Path) -> u64 {
    std::fs::read_to_string(progress)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn an_exporter_killed_mid_write_stream_reconciles_the_logged_extents_and_faults_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    vouch_ok(&["create", s(&a), "--size", "64MiB", "--mirror", s(&b)]);
    let mut server = Server::start(dir.path(), &[s(&a)]);
    let progress = dir.path().join("progress");
    let writer = {
        let (uri, progress) = (server.uri.clone(), progress.clone());
        std::thread::spawn(move || {
            py_timeout(
                WRITE_STREAM,
                &[&uri, s(&progress)],
                Duration::from_secs(120),
            )
        })
    };
    wait_until(
        "the write stream under way",
        Duration::from_secs(60),
        || written(&progress) >= 1024,
    );
    server.kill9();
    let output = writer.join().expect("writer thread");
    assert!(output.status.success(), "{}", text(&output));

    // Offline, before any restart: the log says which legs may differ.
    let offline = vouch(&["mirror", "status", s(&a), "--json"]);
    assert_eq!(offline.status.code(), Some(1), "{}", text(&offline));
    let offline: Value = serde_json::from_slice(&offline.stdout).expect("status JSON");
    assert_eq!(offline["legs"][0]["state"], "active", "{offline}");
    assert_eq!(offline["legs"][1]["state"], "reconciling", "{offline}");
    let pending = offline["legs"][1]["reconcile"]["regions"]
        .as_u64()
        .expect("regions");
    assert!((1..=7).contains(&pending), "{offline}");
    let text_status = vouch(&["mirror", "status", s(&b)]);
    assert!(
        String::from_utf8_lossy(&text_status.stdout)
            .contains(&format!("may differ in {pending} regions")),
        "{}",
        text(&text_status)
    );

    // Restarted with a slow reconciliation (2 MiB/s: seconds for the
    // logged extents), so its running state is seen.
    let args = [
        s(&a),
        "--control",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
        "--resync-min",
        "1M",
        "--resync-max",
        "2M",
    ];
    let mut server = Server::start(dir.path(), &args);
    let first = status_json(&server);
    let leg1 = &first["legs"][1];
    assert_eq!(leg1["state"], "reconciling", "{first}");
    let regions = leg1["reconcile"]["regions"].as_u64().expect("regions");
    assert_eq!(regions, pending, "the offline status named other regions");
    // The 4 extents written (4 MiB each, 16 MiB written), and at most the
    // 3 the log adds ahead of a writer that looks sequential: not the 16
    // of the volume.
    assert!(
        (1..=7).contains(&regions),
        "the log names the written extents only: {first}"
    );
    assert_eq!(first["legs"][0]["state"], "active", "{first}");
    let metrics = server.metrics_text();
    assert_eq!(
        metric(&metrics, "vouch_mirror_reconcile_regions{volume=\"a\"}"),
        Some(regions as f64),
        "{metrics}"
    );
    let mut last = Value::Null;
    wait_until(
        "the reconciliation to end",
        Duration::from_secs(120),
        || {
            last = status_json(&server);
            last["legs"][1]["state"] == "active"
        },
    );
    let done = &last["legs"][1]["reconcile"];
    assert_eq!(done["state"], "done", "{last}");
    assert_eq!(done["regions_left"], 0, "{last}");
    assert_eq!(done["blocks_checked"], regions * 1024, "{last}");
    let in_sync = vouch(&[
        "mirror",
        "status",
        "a",
        "--server",
        common::control::control(&server),
    ]);
    assert_eq!(in_sync.status.code(), Some(0), "{}", text(&in_sync));
    server.stop();
    assert!(
        !server.log_text().contains("FAULTED"),
        "{}",
        server.log_text()
    );

    // A whole scrub afterwards: nothing differs, nothing is counted.
    let scrub = vouch(&["scrub", s(&a), "--json"]);
    assert!(scrub.status.success(), "{}", text(&scrub));
    let report: Value = serde_json::from_slice(&scrub.stdout).expect("scrub JSON");
    assert_eq!(report["report"]["found"], 0, "{report}");
    for leg in report["legs"].as_array().expect("legs") {
        assert_eq!(leg["state"], "active", "{report}");
        assert_eq!(leg["corrected"], 0, "{report}");
    }
    let status = vouch(&["mirror", "status", s(&a)]);
    assert_eq!(status.status.code(), Some(0), "{}", text(&status));
    // And a clean stop left a log with nothing to reconcile.
    let mut server = Server::start(dir.path(), &[s(&a)]);
    server.stop();
    assert!(
        !server.log_text().contains("may differ"),
        "{}",
        server.log_text()
    );
}
