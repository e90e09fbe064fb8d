//! The control API through a real `vouch serve --control` and real
//! clients: online verify (faults, proof digest), copy checked with
//! qemu-img compare and qemu-io, compare, and the CLI's --server mode.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::clients::{qemu_img, qemu_io_ok};
use common::control::{control, parse_response, request, submit, wait_job};
use common::*;
use serde_json::{json, Value};

const SEED_A: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
const SEED_B: &str = "ff0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

/// A split volume at `dir/name` holding `size` bytes of seeded random data.
fn volume_with_data(dir: &Path, name: &str, size: usize, seed: u64) -> PathBuf {
    let raw = dir.join(format!("{name}.raw"));
    std::fs::write(&raw, random_bytes(size, seed)).expect("write raw");
    let volume = dir.join(name);
    vouch_ok(&["import", s(&raw), s(&volume)]);
    volume
}

/// `vouch ARGS --server CONTROL --json`: (exit code, JSON or Null, stderr).
fn cli_json(server: &Server, args: &[&str]) -> (i32, Value, String) {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--server", control(server), "--json"]);
    let output = vouch(&all);
    let value = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
    (
        output.status.code().expect("exit code"),
        value,
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

fn lbas(result: &Value) -> Vec<(u64, String)> {
    result["faults"]
        .as_array()
        .expect("faults")
        .iter()
        .map(|f| {
            (
                f["lba"].as_u64().expect("lba"),
                f["kind"].as_str().expect("kind").to_string(),
            )
        })
        .collect()
}

#[test]
fn online_verify_finds_exactly_the_corrupted_blocks_and_the_digest_moves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = volume_with_data(dir.path(), "a", 4 << 20, 1);
    let mut server = Server::start(dir.path(), &[s(&volume), "--control", "127.0.0.1:0"]);
    let (code, clean, _) = cli_json(&server, &["verify", "a", "--seed", SEED_A]);
    assert_eq!(code, 0, "{clean}");
    assert_eq!(clean["faults"], json!([]));
    let digest = clean["digest"].as_str().expect("digest").to_string();
    assert_eq!(digest.len(), 32);
    // Another seed, another digest; the same seed again, the same digest.
    let (_, other_seed, _) = cli_json(&server, &["verify", "a", "--seed", SEED_B]);
    assert_ne!(other_seed["digest"], clean["digest"]);
    let (_, again, _) = cli_json(&server, &["verify", "a", "--seed", SEED_A, "--segments"]);
    assert_eq!(again["digest"], clean["digest"]);
    assert_eq!(again["segments"].as_array().expect("segments").len(), 4);
    // A client write changes the digest.
    qemu_io_ok(&server.export_uri("a"), &["write -P 0x5a 1M 4k"]);
    let (_, written, _) = cli_json(&server, &["verify", "a", "--seed", SEED_A]);
    assert_ne!(written["digest"], clean["digest"]);
    server.stop();

    // Corrupt two blocks on disk behind the server's back.
    flip_bit(&volume.join("data.00000"), 7 * BLOCK + 100, 0x04);
    flip_bit(&volume.join("data.00000"), 300 * BLOCK + 9, 0x80);
    let server = server.restart();
    let (code, faulty, stderr) = cli_json(&server, &["verify", "a", "--seed", SEED_A]);
    assert_eq!(code, 1, "faults found exit 1: {faulty} {stderr}");
    assert_eq!(
        lbas(&faulty),
        vec![
            (7, "guard_mismatch".to_string()),
            (300, "guard_mismatch".to_string())
        ]
    );
    assert_ne!(faulty["digest"], written["digest"]);
    // A range that leaves both out is clean.
    let (code, part, _) = cli_json(
        &server,
        &["verify", "a", "--offset", "32K", "--length", "1M"],
    );
    assert_eq!(code, 0, "{part}");
    assert_eq!(part["blocks"], 256);
    assert!(part["digest"].is_null());
}

#[test]
fn copy_between_exports_is_identical_and_moved_blocks_read_back_clean() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 8 << 20, 2);
    let b = dir.path().join("b");
    vouch_ok(&["create", s(&b), "--size", "16M"]);
    let server = Server::start(dir.path(), &[s(&a), s(&b), "--control", "127.0.0.1:0"]);
    let (code, result, stderr) = cli_json(&server, &["copy", "a", "b", "--length", "8M"]);
    assert_eq!(code, 0, "{result} {stderr}");
    assert_eq!(result["blocks"], 2048);
    // Auto says why it chose: reflink impossible here (ext4, tmpfs), or
    // what it measured (btrfs, xfs).
    let why = result["chosen_by"].as_str().expect("chosen_by");
    match result["method"].as_str() {
        Some("pipelined") => assert!(
            why.starts_with("reflink not possible") || why.starts_with("measured"),
            "{result}"
        ),
        Some("reflink") => assert!(why.starts_with("measured"), "{result}"),
        _ => panic!("{result}"),
    }
    let output = run(std::process::Command::new(qemu_img()).args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        &server.export_uri("a"),
        &server.export_uri("b"),
    ]));
    assert!(
        output.status.success(),
        "qemu-img compare a b:\n{}",
        text(&output)
    );

    // Within one export: a block moved to a new LBA reads back clean
    // (its reference tag was remapped) and holds the source's bytes.
    qemu_io_ok(&server.export_uri("a"), &["write -P 0x3c 40k 4k"]);
    let (code, result, stderr) = cli_json(
        &server,
        &[
            "copy",
            "a",
            "a",
            "--length",
            "4K",
            "--source-offset",
            "40K",
            "--destination-offset",
            "6M",
        ],
    );
    assert_eq!(code, 0, "{result} {stderr}");
    qemu_io_ok(&server.export_uri("a"), &["read -P 0x3c 6M 4k"]);
    let (code, verify, _) = cli_json(&server, &["verify", "a"]);
    assert_eq!(code, 0, "{verify}");
    // compare agrees, and finds a difference where there is one.
    let (code, same, _) = cli_json(
        &server,
        &[
            "compare",
            "a",
            "--offset",
            "40K",
            "--length",
            "4K",
            "--with",
            "a",
            "--with-offset",
            "6M",
        ],
    );
    assert_eq!((code, same["equal"].clone()), (0, json!(true)), "{same}");
    let (code, differs, _) = cli_json(&server, &["compare", "a", "--length", "8M", "--with", "b"]);
    assert_eq!(code, 1, "{differs}");
    assert_eq!(differs["first_difference"], 40 * 1024);
    // Against a file's bytes.
    let file = dir.path().join("pattern");
    std::fs::write(&file, vec![0x3cu8; 4096]).expect("write");
    let (code, with_file, _) = cli_json(
        &server,
        &["compare", "a", "--offset", "6M", "--with-file", s(&file)],
    );
    assert_eq!((code, with_file["equal"].clone()), (0, json!(true)));
}

#[test]
fn a_copy_over_a_corrupt_source_block_fails_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 2 << 20, 3);
    let b = volume_with_data(dir.path(), "b", 2 << 20, 4);
    flip_bit(&a.join("data.00000"), 5 * BLOCK + 1, 0x01);
    let server = Server::start(dir.path(), &[s(&a), s(&b), "--control", "127.0.0.1:0"]);
    let (code, result, stderr) = cli_json(&server, &["copy", "a", "b", "--length", "2M"]);
    assert_eq!(code, 1, "{result} {stderr}");
    assert!(stderr.contains("LBA 5"), "{stderr}");
    assert_eq!(result["fault"], true);
    let id = submit(
        &server,
        json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "b"}, "length": 2 << 20}),
    );
    let job = wait_job(&server, id, TIMEOUT);
    assert_eq!(job["state"], "failed", "{job}");
    assert_eq!(job["fault"], json!({"lba": 5, "kind": "guard_mismatch"}));
    // The corrupt block never reached the destination: b's LBA 5 is clean.
    let (code, verify, _) = cli_json(&server, &["verify", "b"]);
    assert_eq!(code, 0, "{verify}");
}

#[test]
fn every_bad_request_gets_its_status_and_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 8 << 20, 5);
    let b = volume_with_data(dir.path(), "b", 8 << 20, 6);
    let server = Server::start(dir.path(), &[s(&a), s(&b), "--control", "127.0.0.1:0"]);
    let addr = control(&server);
    let size = 8u64 << 20;
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            json!({"op": "verify", "export": "a", "offset": 100}),
            400,
            "offset 100 is not a multiple of 4096",
        ),
        (
            json!({"op": "verify", "export": "a", "length": 5000}),
            400,
            "length 5000 is not a multiple of 4096",
        ),
        (
            json!({"op": "verify", "export": "a", "offset": size, "length": 4096}),
            400,
            "past the end",
        ),
        (
            json!({"op": "verify", "export": "a", "length": 0}),
            400,
            "length is 0",
        ),
        (
            json!({"op": "verify", "export": "a", "seed": "abcd"}),
            400,
            "64 hex digits",
        ),
        (
            json!({"op": "verify", "export": "a", "seed": "zz".repeat(32)}),
            400,
            "hex digits only",
        ),
        (
            json!({"op": "compare", "export": "a", "data_base64": "%%%"}),
            400,
            "not base64",
        ),
        (
            json!({"op": "compare", "export": "a"}),
            400,
            "exactly one of",
        ),
        (
            json!({"op": "defrag", "export": "a"}),
            400,
            "unknown op \"defrag\"",
        ),
        (json!({"export": "a"}), 400, "missing \"op\""),
        (
            json!({"op": "verify", "export": "a", "colour": "red"}),
            400,
            "unknown field `colour`",
        ),
        (
            json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "b"}, "length": 4096, "method": "teleport"}),
            400,
            "unknown copy method",
        ),
        (
            json!({"op": "verify", "export": "nope"}),
            404,
            "no export named \"nope\"",
        ),
        (
            json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "b", "offset": size - 4096}, "length": 8192}),
            400,
            "past the end",
        ),
    ];
    for (body, status, message) in cases {
        let (got, answer) = request(addr, "POST", "/v1/jobs", Some(&body), None);
        assert_eq!(got, status, "{body}: {answer}");
        let error = answer["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error for {body}: {answer}"));
        assert!(
            error.contains(message),
            "{body}: {error:?} lacks {message:?}"
        );
        assert!(!error.contains('\n'), "one line: {error:?}");
    }
    let (got, answer) = common::control::request_raw(addr, "POST", "/v1/jobs", b"{not json", None);
    assert_eq!(got, 400, "{answer}");
    assert!(answer["error"]
        .as_str()
        .expect("error")
        .contains("not JSON"));
    for path in ["/v1/jobs/999", "/v1/jobs/abc"] {
        let (got, answer) = request(addr, "GET", path, None, None);
        assert_eq!(got, 404, "{path}: {answer}");
        assert!(answer["error"].as_str().expect("error").contains("no job"));
        let (got, _) = request(addr, "DELETE", path, None, None);
        assert_eq!(got, 404);
    }
    let (got, answer) = request(addr, "GET", "/v2/things", None, None);
    assert_eq!(got, 404, "{answer}");

    // Conflicts. Two slow scrubs fill both job slots (later jobs queue),
    // so the copies below stay active while the conflicting one arrives.
    let scrub_a = submit(
        &server,
        json!({"op": "scrub", "export": "a", "rate": 1 << 20}),
    );
    let (got, answer) = request(
        addr,
        "POST",
        "/v1/jobs",
        Some(&json!({"op": "scrub", "export": "a"})),
        None,
    );
    assert_eq!(got, 409, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .expect("error")
            .contains("a scrub of a is already"),
        "{answer}"
    );
    let scrub_b = submit(
        &server,
        json!({"op": "scrub", "export": "b", "rate": 1 << 20}),
    );
    let copy = json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "b", "offset": 1 << 20}, "length": 1 << 20});
    let first = submit(&server, copy);
    let overlapping = json!({"op": "copy", "source": {"export": "a", "offset": 4 << 20}, "destination": {"export": "b", "offset": (1 << 20) + 4096}, "length": 4096});
    let (got, answer) = request(addr, "POST", "/v1/jobs", Some(&overlapping), None);
    assert_eq!(got, 409, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .expect("error")
            .contains(&format!("copy job {first}")),
        "{answer}"
    );
    // A destination elsewhere is fine.
    let elsewhere = json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "b", "offset": 4 << 20}, "length": 4096});
    let second = submit(&server, elsewhere);
    for id in [scrub_a, scrub_b] {
        wait_until("the scrub to run", TIMEOUT, || {
            common::control::job(&server, id)["state"] == "running"
        });
        let (got, answer) = request(addr, "DELETE", &format!("/v1/jobs/{id}"), None, None);
        assert_eq!(got, 200, "{answer}");
    }
    for id in [scrub_a, scrub_b] {
        let job = wait_job(&server, id, TIMEOUT);
        assert_eq!(job["state"], "cancelled", "{job}");
        assert!(job["result"]["cursor"].as_u64().is_some(), "{job}");
    }
    for id in [first, second] {
        let job = wait_job(&server, id, TIMEOUT);
        assert_eq!(job["state"], "finished", "{job}");
    }
    let (got, answer) = request(addr, "GET", "/v1/jobs", None, None);
    assert_eq!(got, 200);
    assert!(answer["jobs"].as_array().expect("jobs").len() >= 4);
}

#[test]
fn a_copy_into_a_read_only_export_is_forbidden() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 1 << 20, 7);
    let server = Server::start(
        dir.path(),
        &[s(&a), "--read-only", "--control", "127.0.0.1:0"],
    );
    let body = json!({"op": "copy", "source": {"export": "a"}, "destination": {"export": "a", "offset": 4096}, "length": 4096});
    let (got, answer) = request(control(&server), "POST", "/v1/jobs", Some(&body), None);
    assert_eq!(got, 403, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .expect("error")
            .contains("read-only"),
        "{answer}"
    );
    let (_, exports) = request(control(&server), "GET", "/v1/exports", None, None);
    assert_eq!(exports["exports"][0]["read_only"], true, "{exports}");
    // Verify still works on a read-only server.
    let (code, result, _) = cli_json(&server, &["verify", "a"]);
    assert_eq!(code, 0, "{result}");
}

#[test]
fn a_non_loopback_control_needs_a_guard() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = dir.path().join("a");
    vouch_ok(&["create", s(&a), "--size", "1M"]);
    let error = Server::try_start(dir.path(), &[s(&a), "--control", "0.0.0.0:0"])
        .err()
        .expect("an unguarded non-loopback control is refused");
    assert!(
        error.contains("is not a loopback address") && error.contains("--control-token-file"),
        "{error}"
    );
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("token");
    let server = Server::start(
        dir.path(),
        &[
            s(&a),
            "--control",
            "0.0.0.0:0",
            "--control-token-file",
            s(&token),
        ],
    );
    let port = control(&server)
        .rsplit(':')
        .next()
        .expect("port")
        .to_string();
    let (got, _) = request(
        &format!("127.0.0.1:{port}"),
        "GET",
        "/v1/exports",
        None,
        Some("s3cret"),
    );
    assert_eq!(got, 200);
}

#[test]
fn a_token_protected_control_rejects_a_missing_or_wrong_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 1 << 20, 8);
    let token = dir.path().join("token");
    std::fs::write(&token, "let-me-in\n").expect("token");
    let server = Server::start(
        dir.path(),
        &[
            s(&a),
            "--control",
            "127.0.0.1:0",
            "--control-token-file",
            s(&token),
        ],
    );
    let addr = control(&server);
    for (given, status) in [(None, 401), (Some("wrong"), 401), (Some("let-me-in"), 200)] {
        let (got, answer) = request(addr, "GET", "/v1/exports", None, given);
        assert_eq!(got, status, "{given:?}: {answer}");
        if status == 401 {
            assert!(
                answer["error"].as_str().expect("error").contains("token"),
                "{answer}"
            );
        }
    }
    let (got, _) = request(
        addr,
        "POST",
        "/v1/jobs",
        Some(&json!({"op": "scrub", "export": "a"})),
        None,
    );
    assert_eq!(got, 401);
    let (code, _, stderr) = cli_json(&server, &["verify", "a"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("401"), "{stderr}");
    let (code, result, stderr) = cli_json(&server, &["verify", "a", "--token-file", s(&token)]);
    assert_eq!(code, 0, "{result} {stderr}");
}

#[test]
fn the_control_api_on_a_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 1 << 20, 9);
    let socket = dir.path().join("control.sock");
    let server = Server::start(dir.path(), &[s(&a), "--control", s(&socket)]);
    assert_eq!(control(&server), format!("unix:{}", socket.display()));
    let (got, exports) = request(control(&server), "GET", "/v1/exports", None, None);
    assert_eq!(got, 200);
    assert_eq!(exports["exports"][0]["name"], "a");
    assert_eq!(exports["exports"][0]["size"], 1 << 20);
    let output = vouch(&["scrub", "a", "--server", s(&socket), "--json"]);
    assert!(output.status.success(), "{}", text(&output));
    let record: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(record["state"], "finished", "{record}");
    assert_eq!(record["cursor"], 256);
    let status = vouch(&["scrub", "a", "--server", s(&socket), "--status", "--json"]);
    let status: Value = serde_json::from_slice(&status.stdout).expect("json");
    assert_eq!(status["last_scrub"]["state"], "finished", "{status}");
}

/// A connection on which the server is serving `GET /v1/jobs/{id}?wait=60`
/// (job `id` running): sent right behind a plain GET of the job, in one
/// write. HTTP/1 answers a connection's requests in order, so once the
/// plain GET is answered the server goes on to the long-poll it has read
/// with it. The long-poll's answer is left to read from the stream.
fn long_poll_in_flight(control: &str, id: u64) -> TcpStream {
    let mut stream =
        TcpStream::connect(control.trim_start_matches("http://")).expect("connect control API");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let requests = format!(
        "GET /v1/jobs/{id} HTTP/1.1\r\nHost: localhost\r\n\r\n\
         GET /v1/jobs/{id}?wait=60 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(requests.as_bytes())
        .expect("send requests");
    let mut first = Vec::new();
    let mut byte = [0u8; 1];
    while !first.ends_with(b"\r\n\r\n") {
        stream
            .read_exact(&mut byte)
            .expect("the first answer's head");
        first.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&first).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no content-length in {head:?}"));
    let mut body = vec![0u8; length];
    stream
        .read_exact(&mut body)
        .expect("the first answer's body");
    first.extend_from_slice(&body);
    let (status, job) = parse_response(&first);
    assert_eq!((status, &job["state"]), (200, &json!("running")), "{job}");
    stream
}

#[test]
fn sigterm_cancels_jobs_keeps_the_scrub_cursor_and_closes_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 16 << 20, 10);
    let mut server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    let id = submit(
        &server,
        json!({"op": "scrub", "export": "a", "rate": 2 << 20}),
    );
    wait_until("the scrub to run", TIMEOUT, || {
        common::control::job(&server, id)["progress"]["done_blocks"]
            .as_u64()
            .unwrap_or(0)
            > 0
    });
    // A long-poll left open does not hold the shutdown up: stop() fails
    // unless the server exits within 10 s, and the poll waits up to 60 s
    // unless the shutdown answers it, with the job cancelled.
    let mut poll = long_poll_in_flight(control(&server), id);
    server.stop();
    let mut response = Vec::new();
    poll.read_to_end(&mut response)
        .expect("the long-poll's answer");
    assert!(
        !response.is_empty(),
        "the shutdown closed the long-poll unanswered"
    );
    let (status, job) = parse_response(&response);
    assert_eq!(status, 200, "{job}");
    assert_eq!(job["state"], "cancelled", "{job}");
    let record: Value =
        serde_json::from_slice(&std::fs::read(a.join("scrub.json")).expect("scrub.json"))
            .expect("json");
    assert_eq!(record["state"], "cancelled", "{record}");
    assert!(record["cursor"].as_u64().expect("cursor") > 0, "{record}");
    assert_eq!(info_json(&a)["clean"], true, "closed cleanly");
}

#[test]
fn metrics_show_jobs_and_the_last_scrub() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 2 << 20, 14);
    flip_bit(&a.join("data.00000"), 20 * BLOCK, 0x01);
    let server = Server::start(
        dir.path(),
        &[
            s(&a),
            "--control",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let (code, record, _) = cli_json(&server, &["scrub", "a"]);
    assert_eq!(code, 1, "{record}");
    let page = server.metrics_text();
    for (series, value) in [
        ("vouch_offload_jobs{op=\"scrub\",state=\"finished\"}", 1.0),
        ("vouch_offload_jobs{op=\"copy\",state=\"running\"}", 0.0),
        ("vouch_scrub_faults{volume=\"a\"}", 1.0),
        ("vouch_scrub_cursor_blocks{volume=\"a\"}", 512.0),
        ("vouch_scrub_running{volume=\"a\"}", 0.0),
    ] {
        assert_eq!(metric(&page, series), Some(value), "{series} in:\n{page}");
    }
    assert!(
        metric(
            &page,
            "vouch_scrub_last_finished_timestamp_seconds{volume=\"a\"}"
        )
        .unwrap_or(0.0)
            > 0.0
    );
}

/// A file longer than one request carries (16 MiB) is compared in pieces;
/// the difference is counted from the start of the whole range.
#[test]
fn compare_with_a_file_longer_than_one_request_works_in_pieces() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = volume_with_data(dir.path(), "a", 40 << 20, 9);
    let raw = dir.path().join("a.raw");
    let server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    let (code, same, stderr) = cli_json(&server, &["compare", "a", "--with-file", s(&raw)]);
    assert_eq!(
        (code, same["equal"].clone()),
        (0, json!(true)),
        "{same} {stderr}"
    );
    let mut bytes = std::fs::read(&raw).expect("read");
    let at = (35 << 20) + 5;
    bytes[at] ^= 0x40;
    std::fs::write(&raw, &bytes).expect("write");
    let (code, differs, stderr) = cli_json(&server, &["compare", "a", "--with-file", s(&raw)]);
    assert_eq!(code, 1, "{differs} {stderr}");
    assert_eq!(differs["first_difference"], at, "{differs}");
}
