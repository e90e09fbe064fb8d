//! A mirror of a local and a remote leg (`vouch replica serve` over
//! loopback), served over NBD to real clients: written and read back,
//! `vouch check` clean on both legs; a block corrupt in the remote
//! replica's file reads correctly and is repaired there (counted in
//! metrics); and the refusals: another protocol version, an unknown
//! replica name, a replica of another volume, malformed frames, bad
//! URLs, plain TCP on a non-loopback address, and TLS peers the other side
//! did not sign.

mod common;
mod replica_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use common::*;
use replica_support::*;

fn write_blocks(uri: &str, tag: u64) {
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(32):
    h.pwrite(block_data(lba, int(sys.argv[2]) + lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[uri, &tag.to_string()],
    );
}

/// Which of blocks 0..32 read back as written with `tag`.
fn read_blocks(uri: &str, tag: u64) -> serde_json::Value {
    py_json(
        r#"
h = connect(sys.argv[1])
bad = []
for lba in range(32):
    try:
        if h.pread(4096, lba * 4096) != block_data(lba, int(sys.argv[2]) + lba):
            bad.append(lba)
    except nbd.Error as e:
        bad.append({"lba": lba, "error": err_info(e)})
print(json.dumps({"bad": bad}))
"#,
        &[uri, &tag.to_string()],
    )
}

fn check_json(volume: &Path) -> (i32, serde_json::Value) {
    let output = vouch(&["check", s(volume), "--json"]);
    let value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("check --json: {error}: {}", text(&output)));
    (output.status.code().unwrap_or(-1), value)
}

#[test]
fn a_local_and_a_remote_leg_serve_over_nbd_reads_stay_local_and_both_copies_are_repaired() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    let mut replica = replica_server(&replicas, "127.0.0.1:0", &[], None).expect("replica");
    let a = dir.path().join("a");
    let url = format!("vouch://{}/disk", replica.addr);
    vouch_ok(&["create", s(&a), "--size", "4MiB", "--mirror", &url]);
    let status = text(&vouch_ok(&["mirror", "status", s(&a)]));
    assert!(
        status.contains(&format!("leg 1: {url}: active")),
        "{status}"
    );

    let mut server = Server::start(dir.path(), &[s(&a)]);
    // While the exporter holds the replica, status still counts it present.
    let status = text(&vouch_ok(&["mirror", "status", s(&a)]));
    assert!(
        status.contains(&format!("leg 1: {url}: active")),
        "{status}"
    );
    write_blocks(&server.uri, 500);
    assert_eq!(read_blocks(&server.uri, 500)["bad"], serde_json::json!([]));
    server.stop();
    let (code, report) = check_json(&a);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["legs"][1]["path"], url.as_str());
    assert_eq!(report["legs"][1]["faults"], serde_json::json!([]));

    // LBA 7 bad in the replica's file, LBA 9 bad in the local leg's (split
    // layout: data at LBA * 4096).
    flip_bit(
        &replicas.join("disk").join("data.00000"),
        7 * BLOCK + 50,
        0x10,
    );
    flip_bit(&a.join("data.00000"), 9 * BLOCK + 50, 0x10);
    let (code, report) = check_json(&a);
    assert_eq!(code, 1, "{report}");
    assert_eq!(
        report["legs"][1]["faults"],
        serde_json::json!([{"lba": 7, "kind": "guard_mismatch"}]),
        "{report}"
    );
    assert_eq!(
        report["legs"][0]["faults"],
        serde_json::json!([{"lba": 9, "kind": "guard_mismatch"}])
    );

    let mut server = Server::start(dir.path(), &[s(&a), "--metrics", "127.0.0.1:0"]);
    // Reads stay on the local leg (prefer-local): every block reads good,
    // LBA 9 is served from the replica and rewritten on the local leg, and
    // the replica's bad LBA 7 is not read at all.
    for _ in 0..2 {
        assert_eq!(read_blocks(&server.uri, 500)["bad"], serde_json::json!([]));
    }
    let metrics = server.metrics_text();
    let repairs = |leg: &str| -> Vec<String> {
        metrics
            .lines()
            .filter(|line| {
                line.starts_with("vouch_mirror_repairs_total")
                    && line.contains(&format!("leg=\"{leg}\""))
                    && !line.ends_with(" 0")
            })
            .map(str::to_string)
            .collect()
    };
    let local = repairs("0");
    assert!(
        local.len() == 1
            && local[0].contains("guard_mismatch")
            && local[0].contains("outcome=\"repaired\"")
            && local[0].ends_with(" 1"),
        "one repair of the local leg from the replica:\n{metrics}"
    );
    assert_eq!(repairs("1"), Vec::<String>::new(), "{metrics}");
    server.stop();
    let (code, report) = check_json(&a);
    assert_eq!(code, 1, "{report}");
    assert_eq!(report["legs"][0]["faults"], serde_json::json!([]));
    assert_eq!(
        report["legs"][1]["faults"],
        serde_json::json!([{"lba": 7, "kind": "guard_mismatch"}]),
        "the replica's copy is not read by clients: {report}"
    );
    // Scrub reads every leg, the replica too, and repairs its copy.
    let scrub = vouch(&["scrub", s(&a)]);
    assert_eq!(scrub.status.code(), Some(0), "{}", text(&scrub));
    let (code, report) = check_json(&a);
    assert_eq!(code, 0, "the remote copy was repaired by scrub: {report}");
    replica.stop();
}

/// A client that negotiated no block size writes, zeroes and trims byte
/// ranges on a mirror with a remote leg: a partial block is sealed once
/// by the exporter and sent whole, and the bytes of a trim or zeroing
/// outside whole 512-byte sectors are written as zeros the same way (the
/// replica protocol takes trims and zeroes in sectors), so both legs
/// store the same bytes and verify clean.
#[test]
fn byte_ranges_reach_a_remote_leg_alike() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    let mut replica = replica_server(&replicas, "127.0.0.1:0", &[], None).expect("replica");
    let a = dir.path().join("a");
    let url = format!("vouch://{}/disk", replica.addr);
    vouch_ok(&["create", s(&a), "--size", "1MiB", "--mirror", &url]);
    let mut server = Server::start(dir.path(), &[s(&a)]);
    let body = r#"
h = connect_unnegotiated(sys.argv[1])
model = bytearray(4 * 4096)
for lba in range(4):
    data = block_data(lba, 3)
    h.pwrite(data, lba * 4096)
    model[lba * 4096:(lba + 1) * 4096] = data
for kind, offset, length in (("w", 1, 1), ("z", 4095, 3), ("t", 8191, 4099), ("w", 700, 5000)):
    if kind == "w":
        data = bytes((offset + i) % 253 + 1 for i in range(length))
        h.pwrite(data, offset)
        model[offset:offset + length] = data
    elif kind == "z":
        h.zero(length, offset)
        model[offset:offset + length] = bytes(length)
    else:
        h.trim(length, offset)
        model[offset:offset + length] = bytes(length)
h.flush()
assert h.pread(len(model), 0) == bytes(model)
h.shutdown()
print(json.dumps({"ok": True}))
"#;
    assert_eq!(py_json(body, &[&server.uri])["ok"], true);
    server.stop();
    // Both legs verify (the replica is opened again once the exporter's
    // connection has released it, so its writes are home).
    let (code, report) = check_json(&a);
    assert_eq!(code, 0, "{report}");
    // Split layout: block LBA at LBA * 4096 of the first data file, on
    // each leg (the trimmed block 2 is a hole on both: zeros).
    let home = |volume: &Path| {
        let mut bytes = vec![0u8; 4 * BLOCK as usize];
        let mut file = std::fs::File::open(volume.join("data.00000")).expect("data file");
        file.read_exact(&mut bytes).expect("read data file");
        bytes
    };
    assert!(
        home(&a) == home(&replicas.join("disk")),
        "the local and the remote leg hold the same bytes"
    );
    replica.stop();
}

fn hello(version: u32) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(b"VOUCHREP");
    bytes[8..12].copy_from_slice(&version.to_le_bytes());
    bytes
}

fn wait_for_log(process: &Process, needle: &str) {
    wait_until(needle, Duration::from_secs(10), || {
        process.log_text().contains(needle)
    });
}

#[test]
fn bad_input_is_refused_by_name_and_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    let replica = replica_server(&replicas, "127.0.0.1:0", &[], None).expect("replica");
    let port = &replica.addr;

    // Another protocol version: the server answers with its own and the
    // refusal, and logs it by name.
    let mut stream = TcpStream::connect(port.as_str()).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream.write_all(&hello(4)).expect("hello");
    let mut answer = [0u8; 16];
    stream.read_exact(&mut answer).expect("answer");
    assert_eq!(&answer[..8], b"VOUCHREP");
    assert_eq!(u32::from_le_bytes(answer[8..12].try_into().unwrap()), 3);
    assert_eq!(u32::from_le_bytes(answer[12..16].try_into().unwrap()), 1);
    wait_for_log(
        &replica,
        "replica protocol version 4 is not supported (this side speaks 2 to 3)",
    );

    // A malformed frame: a header with a bad magic gets a MALFORMED
    // answer (status 1) and the connection is closed.
    let mut stream = replica_handshake(port, None).expect("handshake");
    stream.write_all(&[0xee; 40]).expect("garbage");
    let mut header = [0u8; 24];
    stream.read_exact(&mut header).expect("answer header");
    assert_eq!(&header[..4], b"VRRS");
    assert_eq!(u16::from_le_bytes([header[4], header[5]]), 1, "MALFORMED");
    let mut rest = Vec::new();
    stream
        .read_to_end(&mut rest)
        .expect("closed after the answer");
    wait_for_log(&replica, "malformed request: bad magic");

    // Bad URLs never reach a server; nothing is created.
    let a = dir.path().join("a");
    for bad in [
        format!("vouch://{port}/../x"),
        format!("vouch://{port}/"),
        "vouch://nohost/x".to_string(),
    ] {
        let output = vouch(&["create", s(&a), "--size", "1MiB", "--mirror", &bad]);
        assert_eq!(output.status.code(), Some(2), "{}", text(&output));
        assert!(
            text(&output).contains("not a replica URL"),
            "{}",
            text(&output)
        );
        assert!(!a.exists(), "a failed create left {}", a.display());
    }

    // Two sets; then each one's remote member is swapped for the other's.
    let b = dir.path().join("b");
    vouch_ok(&[
        "create",
        s(&a),
        "--size",
        "1MiB",
        "--mirror",
        &format!("vouch://{port}/ra"),
    ]);
    vouch_ok(&[
        "create",
        s(&b),
        "--size",
        "1MiB",
        "--mirror",
        &format!("vouch://{port}/rb"),
    ]);
    std::fs::rename(replicas.join("ra"), replicas.join("held")).expect("rename");
    // An unknown name: reported missing, by name.
    let output = vouch(&["mirror", "status", s(&a)]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(
        text(&output).contains("no replica named ra"),
        "{}",
        text(&output)
    );
    assert!(text(&output).contains("missing"), "{}", text(&output));
    // A replica of another volume under the expected name: refused by name.
    std::fs::rename(replicas.join("rb"), replicas.join("ra")).expect("rename");
    let output = vouch(&["mirror", "status", s(&a)]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(
        text(&output).contains("belongs to another volume"),
        "{}",
        text(&output)
    );
    // Serving marks it stale and serves from the local leg.
    let mut server = Server::start(dir.path(), &[s(&a)]);
    write_blocks(&server.uri, 10);
    assert_eq!(read_blocks(&server.uri, 10)["bad"], serde_json::json!([]));
    server.stop();
    assert!(
        server.log_text().contains("belongs to another volume"),
        "{}",
        server.log_text()
    );
    let status = text(&vouch(&["mirror", "status", s(&a)]));
    assert!(status.contains(": stale"), "{status}");
    // The other volume's replica was not written.
    std::fs::rename(replicas.join("ra"), replicas.join("rb")).expect("rename");
    let (code, report) = check_json(&b);
    assert_eq!(code, 0, "{report}");
}

#[test]
fn plain_tcp_on_a_non_loopback_address_needs_insecure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let output = vouch(&[
        "replica",
        "serve",
        s(&dir.path().join("r")),
        "--listen",
        "0.0.0.0:0",
    ]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains("is not a loopback address") && text(&output).contains("--insecure"),
        "{}",
        text(&output)
    );
    let help = text(&vouch_ok(&["replica", "serve", "--help"]));
    for flag in [
        "--listen",
        "--insecure",
        "--tls-cert",
        "--tls-key",
        "--tls-ca",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help:\n{help}");
    }
    let help = text(&vouch_ok(&["create", "--help"]));
    assert!(help.contains("vouch://HOST:PORT/NAME"), "{help}");
    assert!(help.contains("--replica-tls-ca"), "{help}");
}

#[test]
fn mutual_tls_admits_only_peers_the_other_side_signed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = pki::make_ca(dir.path(), "ca");
    let server_pair = pki::make_leaf(dir.path(), "replica", &ca, "serverAuth");
    let client_pair = pki::make_leaf(dir.path(), "exporter", &ca, "clientAuth");
    let stranger = pki::make_self_signed(dir.path(), "stranger", "clientAuth");
    let replicas = dir.path().join("replicas");
    let replica = replica_server(
        &replicas,
        "127.0.0.1:0",
        &[
            "--tls-cert",
            s(&server_pair.0),
            "--tls-key",
            s(&server_pair.1),
            "--tls-ca",
            s(&ca.0),
        ],
        None,
    )
    .expect("replica");
    // `localhost` is in the test certificate's names.
    let port = replica.addr.rsplit_once(':').expect("port").1.to_string();
    let url = format!("vouch://localhost:{port}/disk");
    let a = dir.path().join("a");
    let tls = |pair: &(std::path::PathBuf, std::path::PathBuf)| {
        vec![
            "--replica-tls-cert".to_string(),
            s(&pair.0).to_string(),
            "--replica-tls-key".to_string(),
            s(&pair.1).to_string(),
            "--replica-tls-ca".to_string(),
            s(&ca.0).to_string(),
        ]
    };
    let args = |extra: Vec<String>, command: &[&str]| -> Vec<String> {
        let mut all: Vec<String> = command.iter().map(|c| c.to_string()).collect();
        all.extend(extra);
        all
    };
    let run = |all: Vec<String>| {
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        vouch(&refs)
    };
    // Plain TCP to a TLS replica: refused, nothing created.
    let output = run(args(
        vec![],
        &["create", s(&a), "--size", "1MiB", "--mirror", &url],
    ));
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(!a.exists());
    // A client certificate the replica's CA did not sign: refused, logged.
    let output = run(args(
        tls(&stranger),
        &["create", s(&a), "--size", "1MiB", "--mirror", &url],
    ));
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    wait_for_log(&replica, "TLS handshake refused");
    assert!(!a.exists());
    // Signed: created, and status reaches it.
    let output = run(args(
        tls(&client_pair),
        &["create", s(&a), "--size", "1MiB", "--mirror", &url],
    ));
    assert!(output.status.success(), "{}", text(&output));
    let output = run(args(tls(&client_pair), &["mirror", "status", s(&a)]));
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains(": active"), "{}", text(&output));
    // Without the client options, the same status cannot reach it.
    let output = vouch(&["mirror", "status", s(&a)]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
}
