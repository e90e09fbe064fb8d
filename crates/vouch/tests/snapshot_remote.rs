//! Snapshots of a mirror with a remote leg (issue 33): the replica takes
//! its copy (`DIR/NAME/snapshots/SNAP` on its host) through the replica
//! protocol at the mirror's flush point, online while a client writes;
//! the snapshot is served as a read-only mirror whose remote copy is read
//! through the replica protocol (a block bad in the local copy is read
//! from the remote one, nothing rewritten); `check` reports every copy,
//! the remote one too; `delete` removes every copy; a replica server from
//! before the snapshot requests is refused by name, and the mirror goes
//! on serving from both legs.
//!
//! Two network namespaces joined by a veth pair (replica_support.rs): the
//! replica server in one, the exporter and its clients in the other.

mod common;
mod replica_support;

use std::path::Path;
use std::time::Duration;

use common::*;
use replica_support::*;

const SIZE: usize = 8 << 20;
const PY_TIMEOUT: Duration = Duration::from_secs(120);

/// Run `script` (with the libnbd prelude) in `netns`; its JSON answer.
fn py_json_in(netns: &str, script: &str, args: &[String]) -> serde_json::Value {
    let output = py_in(netns, script, args, PY_TIMEOUT);
    assert!(output.status.success(), "python: {}", text(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("json answer")
}

/// The whole NBD export at `uri` (inside `netns`) read into `file`.
fn read_export_in(netns: &str, uri: &str, file: &Path) -> Vec<u8> {
    py_json_in(
        netns,
        r#"
h = connect(sys.argv[1], strict=False)
size = h.get_size()
with open(sys.argv[2], "wb") as out:
    for offset in range(0, size, 1 << 20):
        out.write(h.pread(min(1 << 20, size - offset), offset))
print(json.dumps({"ok": True}))
"#,
        &[uri.to_string(), s(file).to_string()],
    );
    std::fs::read(file).expect("read the export's bytes")
}

/// `vouch snapshot list --json` items (online with `server`).
fn listed(netns: &str, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["snapshot", "list", "--json"];
    all.extend_from_slice(args);
    let output = vouch_in(Some(netns), &all);
    assert!(output.status.success(), "{}", text(&output));
    serde_json::from_slice(&output.stdout).expect("json")
}

/// Online, with a client writing all along: the replica's copy is taken
/// inside the mirror's flush point, equal to the local copy (and, for the
/// one taken between writes, to the data written); served from both
/// copies (a block bad in the local copy is read from the remote one);
/// `check` names the bad block of each copy; `delete` (online and
/// offline) removes the remote copy too. Before this change a mirror with
/// a remote leg refused every snapshot.
#[test]
fn a_remote_leg_takes_its_copy_at_the_flush_point_and_it_is_served_checked_and_deleted() {
    // xfs: the copies share blocks (online, `--copy` with a remote leg is
    // refused: the mirror would be held for the whole copy).
    let fs = LoopFs::xfs();
    let dir = fs.mount.as_path();
    let net = NetnsPair::new("rsnap");
    let replicas = dir.join("replicas");
    let listen = format!("{}:7000", net.replica_ip);
    let mut replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
        .unwrap_or_else(|error| panic!("{error}"));
    let leg0 = dir.join("a");
    let url = format!("vouch://{listen}/disk");
    let output = vouch_in(
        Some(&net.exporter),
        &["create", s(&leg0), "--size", "8MiB", "--mirror", &url],
    );
    assert!(output.status.success(), "{}", text(&output));
    let control = "127.0.0.1:7110";
    let mut exporter = exporter(dir, &[s(&leg0), "--control", control], &net.exporter);
    let uri = format!("nbd://{}", exporter.addr);
    let first = random_bytes(SIZE, 41);
    let first_file = dir.join("first.raw");
    std::fs::write(&first_file, &first).expect("write first");
    py_json_in(
        &net.exporter,
        r#"
import os, random, subprocess, threading
uri, vouch, control, first = sys.argv[1:5]
h = connect(uri)
data = open(first, "rb").read()
for offset in range(0, len(data), 1 << 20):
    h.pwrite(data[offset:offset + (1 << 20)], offset)
h.flush()
def snapshot(name):
    out = subprocess.run([vouch, "snapshot", "create", "--server", control, name],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit("snapshot create " + name + " failed: " + out.stderr)
snapshot("s0")
stop = threading.Event()
written = [0]
def writer():
    w = connect(uri)
    while not stop.is_set():
        w.pwrite(os.urandom(4096), random.randrange(2048) * 4096)
        written[0] += 1
thread = threading.Thread(target=writer, daemon=True)
thread.start()
counts = []
for name in ["w1", "w2"]:
    before = written[0] + 1
    while written[0] < before:
        time.sleep(0.001)
    snapshot(name)
    counts.append(written[0] - before)
stop.set()
thread.join()
if written[0] == 0:
    raise SystemExit("no write was in flight")
print(json.dumps({"ok": True, "written": written[0]}))
"#,
        &[
            uri.clone(),
            vouch_bin().to_string(),
            control.to_string(),
            s(&first_file).to_string(),
        ],
    );
    // Listed online by leg: a copy on each, and they agree.
    let items = listed(&net.exporter, &["--server", control]);
    let items = items.as_array().expect("items");
    assert_eq!(items.len(), 3, "{items:?}");
    for item in items {
        assert!(item.get("disagree").is_none(), "{item}");
        assert!(item["legs"][0]["copy"].is_string(), "{item}");
        let remote = item["legs"][1]["copy"].as_str().expect("a remote copy");
        assert!(remote.starts_with(&url), "{item}");
    }
    exporter.stop();

    let local = |name: &str| leg0.join("snapshots").join(name);
    let remote = |name: &str| replicas.join("disk/snapshots").join(name);
    assert!(
        exported(&remote("s0"), dir, "r0") == first,
        "the replica's copy is not the data at the flush"
    );
    assert!(exported(&local("s0"), dir, "l0") == first);
    for name in ["w1", "w2"] {
        assert!(
            exported(&local(name), dir, "l") == exported(&remote(name), dir, "r"),
            "snapshot {name}: the replica's copy differs from the local one"
        );
    }
    let listed_offline = listed(&net.exporter, &[s(&leg0)]);
    assert_eq!(listed_offline.as_array().map(Vec::len), Some(3));

    // A bad block in each copy: served, the local copy's is read from the
    // replica's copy; `check` names both.
    let (bad_local, bad_remote) = (100u64, 200u64);
    flip_bit(
        &local("s0").join("data.00000"),
        bad_local * BLOCK + 17,
        0x40,
    );
    flip_bit(
        &remote("s0").join("data.00000"),
        bad_remote * BLOCK + 9,
        0x02,
    );
    let mut served = exporter_with(
        dir,
        &["--snapshot", "s0", s(&leg0)],
        Some(&net.exporter),
        &[],
    );
    let read = read_export_in(
        &net.exporter,
        &format!("nbd://{}", served.addr),
        &dir.join("served.raw"),
    );
    assert!(
        read == first,
        "the served snapshot is not the data at the flush"
    );
    served.stop();
    let log = served.log_text();
    assert!(
        log.contains(&format!("lba={bad_local}")) || log.contains(&format!("lba: {bad_local}")),
        "the bad local block is not reported: {log}"
    );
    assert!(log.contains("read through its replica server"), "{log}");
    // Nothing was rewritten: the local copy is still bad.
    let (code, faults) = check_faults(&local("s0"));
    assert_eq!((code, faults.len()), (1, 1));
    let output = vouch_in(Some(&net.exporter), &["check", s(&local("s0"))]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let report = text(&output);
    assert!(
        report.contains("leg 0's copy")
            && report.contains(&format!("fault: LBA {bad_local}"))
            && report.contains(&format!("leg 1's copy {url}/snapshots/s0 (remote)"))
            && report.contains(&format!("LBA {bad_remote}")),
        "{report}"
    );

    // Deleted online (every copy), then offline (the replica reached).
    let mut exporter = exporter_with(
        dir,
        &[s(&leg0), "--control", control],
        Some(&net.exporter),
        &[],
    );
    let output = vouch_in(
        Some(&net.exporter),
        &["snapshot", "delete", "--server", control, "s0"],
    );
    assert!(output.status.success(), "{}", text(&output));
    assert!(!local("s0").exists() && !remote("s0").exists());
    exporter.stop();
    let output = vouch_in(Some(&net.exporter), &["snapshot", "delete", s(&leg0), "w1"]);
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("legs 0, 1"), "{}", text(&output));
    assert!(!local("w1").exists() && !remote("w1").exists());
    assert!(local("w2").exists() && remote("w2").exists());
    replica.stop();
}

/// A replica server from before the snapshot requests (one speaking
/// protocol version 2): the exporter still serves the mirror (its
/// connection agreed on version 2), and a snapshot is refused naming the
/// replica, online and offline; the refusal costs the leg nothing (still
/// active, writes go on) and nothing is made on the local leg.
#[test]
fn a_replica_server_without_snapshots_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let net = NetnsPair::new("rsold");
    let replicas = dir.join("replicas");
    let listen = format!("{}:7000", net.replica_ip);
    let mut replica = replica_server(
        &replicas,
        &listen,
        &["--insecure", "--protocol-version", "2"],
        Some(&net.replica),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let leg0 = dir.join("a");
    let url = format!("vouch://{listen}/disk");
    let output = vouch_in(
        Some(&net.exporter),
        &["create", s(&leg0), "--size", "4MiB", "--mirror", &url],
    );
    assert!(output.status.success(), "{}", text(&output));
    let control = "127.0.0.1:7111";
    let mut exporter = exporter(dir, &[s(&leg0), "--control", control], &net.exporter);
    let output = vouch_in(
        Some(&net.exporter),
        &["snapshot", "create", "--server", control, "s1"],
    );
    assert!(!output.status.success(), "{}", text(&output));
    let refusal = format!("replica at {url} does not support snapshots: upgrade it");
    assert!(text(&output).contains(&refusal), "{}", text(&output));
    let status = mirror_status_online(&net.exporter, control);
    assert_eq!(status["legs"][1]["state"], "active", "{status}");
    let answer = py_json_in(
        &net.exporter,
        r#"
h = connect(sys.argv[1])
h.pwrite(b"\x5a" * 65536, 0)
h.flush()
print(json.dumps({"read": h.pread(4096, 0)[:4].hex()}))
"#,
        &[format!("nbd://{}", exporter.addr)],
    );
    assert_eq!(answer["read"], "5a5a5a5a");
    exporter.stop();
    let output = vouch_in(
        Some(&net.exporter),
        &["snapshot", "create", "--copy", s(&leg0), "s1"],
    );
    assert!(!output.status.success(), "{}", text(&output));
    assert!(text(&output).contains(&refusal), "{}", text(&output));
    assert!(!leg0.join("snapshots/s1").exists());
    assert!(!replicas.join("disk/snapshots").exists());
    replica.stop();
}
