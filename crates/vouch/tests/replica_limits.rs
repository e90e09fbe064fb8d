//! What a replica server owes the strangers that can reach its port:
//! memory that stays flat however many connections come and go (every
//! finished connection's task is reaped).

mod common;
mod replica_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use replica_support::*;
use vouch_replica::wire::{Hello, HELLO_BYTES, HELLO_OK, PROTOCOL_VERSION};

/// The server's resident set, from /proc/PID/status (`VmRSS`, KiB).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// Connect, exchange hellos, close at once (a reset: no TIME_WAIT left
/// behind on this side for each of thousands of cycles).
fn hello_and_close(addr: &str) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let hello = Hello {
        version: PROTOCOL_VERSION,
        status: HELLO_OK,
    };
    stream.write_all(&hello.encode()).expect("send hello");
    let mut answer = [0u8; HELLO_BYTES];
    stream.read_exact(&mut answer).expect("the server's hello");
    socket_linger_zero(&stream);
}

fn socket_linger_zero(stream: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    set_socket_option(stream, libc::SO_LINGER, &linger);
}

/// Cycles measured after a warm-up: unreaped, each kept about 3.7 KB
/// (37 MB over these), far past the bound below.
const CYCLES: usize = 10_000;
/// Growth allowed over `CYCLES` connections: allocator slack, not a
/// per-connection cost (that would be 800 bytes each).
const RSS_GROWTH_KIB_MAX: u64 = 8 * 1024;

#[test]
fn a_replica_server_stays_flat_over_thousands_of_connect_hello_close_cycles() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = replica_server(&dir.path().join("replicas"), "127.0.0.1:0", &[], None)
        .unwrap_or_else(|error| panic!("{error}"));
    for _ in 0..1_000 {
        hello_and_close(&server.addr);
    }
    let before = rss_kib(server.pid);
    for _ in 0..CYCLES {
        hello_and_close(&server.addr);
    }
    // The last connections' tasks end a moment after their resets.
    let mut after = rss_kib(server.pid);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while after.saturating_sub(before) >= RSS_GROWTH_KIB_MAX && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
        after = rss_kib(server.pid);
    }
    assert!(
        after.saturating_sub(before) < RSS_GROWTH_KIB_MAX,
        "{CYCLES} connect-hello-close cycles grew the replica server from {before} KiB to {after} KiB"
    );
}

/// Whether the server closed `stream` (EOF or a reset) before `TIMEOUT`.
fn closed_by_server(stream: &mut TcpStream) -> bool {
    stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(error) => !matches!(
            error.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

fn wait_for_log(process: &Process, needle: &str) {
    wait_until(needle, Duration::from_secs(20), || {
        process.log_text().contains(needle)
    });
}

#[test]
fn a_stalled_hello_and_a_payload_that_never_arrives_are_dropped_in_their_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = replica_server(
        &dir.path().join("replicas"),
        "127.0.0.1:0",
        &["--handshake-timeout", "1", "--payload-timeout", "1"],
        None,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    // Connects and says nothing.
    let mut silent = TcpStream::connect(&server.addr).expect("connect");
    assert!(
        closed_by_server(&mut silent),
        "a connection that never sent its hello was kept"
    );
    wait_for_log(&server, "handshake timed out");
    // Half a hello.
    let mut half = TcpStream::connect(&server.addr).expect("connect");
    half.write_all(b"VOUCH").expect("part of a hello");
    assert!(closed_by_server(&mut half), "half a hello was waited on");
    // A request whose payload never arrives: a WRITE_SEALED of one block
    // (4136 bytes announced), 100 of them sent.
    let mut stalled = replica_handshake(&server.addr, None).expect("handshake");
    let request = vouch_replica::wire::encode_request(9, &vouch_replica::wire::Request::Flush);
    let mut header = request[..40].to_vec();
    header[4..6].copy_from_slice(&4u16.to_le_bytes()); // WRITE_SEALED
    header[24..32].copy_from_slice(&1u64.to_le_bytes()); // one block
    header[32..36].copy_from_slice(&4136u32.to_le_bytes());
    stalled.write_all(&header).expect("header");
    stalled.write_all(&[0u8; 100]).expect("a little payload");
    assert!(
        closed_by_server(&mut stalled),
        "a payload that never arrived held the connection"
    );
    wait_for_log(&server, "a request stalled");
}

#[test]
fn past_its_connection_limit_the_server_closes_new_connections_at_accept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = replica_server(
        &dir.path().join("replicas"),
        "127.0.0.1:0",
        &["--max-connections", "4"],
        None,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let mut held: Vec<TcpStream> = (0..4)
        .map(|_| replica_handshake(&server.addr, None).expect("handshake"))
        .collect();
    let mut fifth = TcpStream::connect(&server.addr).expect("connect");
    fifth.write_all(&[0u8; 16]).ok();
    assert!(
        closed_by_server(&mut fifth),
        "a fifth connection was held past --max-connections 4"
    );
    wait_for_log(&server, "holds its limit of 4 connections");
    // One ends: a new one is taken again (once the server saw it end).
    drop(held.pop());
    wait_until("a connection taken again", TIMEOUT, || {
        replica_handshake(&server.addr, None).is_ok()
    });
}

/// A secret file `name` in `dir` holding `secret`, owner-readable only.
fn secret_file(dir: &std::path::Path, name: &str, secret: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, secret).expect("write secret");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    path
}

const SECRET: &str = "4f1c2a9e7b3d5f60a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718";

#[test]
fn with_a_secret_every_connection_proves_it_loopback_included_and_the_server_proves_it_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ours = secret_file(dir.path(), "secret", SECRET);
    let theirs = secret_file(dir.path(), "other", &SECRET.replace("4", "5"));
    let server = replica_server(
        &dir.path().join("replicas"),
        "127.0.0.1:0",
        &["--secret-file", s(&ours)],
        None,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    // A stranger without the secret, or with another, is refused before
    // any request, on loopback too.
    assert!(replica_handshake(&server.addr, None).is_err());
    wait_for_log(&server, "authentication refused");
    let other = vouch_replica::auth::Secret::from_file(&theirs).expect("secret");
    assert!(replica_handshake(&server.addr, Some(&other)).is_err());
    let url = format!("vouch://{}/disk", server.addr);
    let a = dir.path().join("a");
    refused(
        &["create", s(&a), "--size", "16M", "--mirror", &url],
        "requires a shared secret",
    );
    let output = vouch(&[
        "create",
        s(&a),
        "--size",
        "16M",
        "--mirror",
        &url,
        "--replica-secret-file",
        s(&theirs),
    ]);
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        !dir.path().join("replicas").join("disk").exists(),
        "a refused exporter created a replica"
    );
    // The exporter with the secret creates and checks its replica.
    let output = vouch(&[
        "create",
        s(&a),
        "--size",
        "16M",
        "--mirror",
        &url,
        "--replica-secret-file",
        s(&ours),
    ]);
    assert!(output.status.success(), "{}", text(&output));
    let output = vouch(&["check", s(&a), "--replica-secret-file", s(&ours)]);
    assert!(output.status.success(), "{}", text(&output));
    // An exporter with a secret refuses a server that cannot prove it.
    let open = replica_server(&dir.path().join("open"), "127.0.0.1:0", &[], None)
        .unwrap_or_else(|error| panic!("{error}"));
    let b = dir.path().join("b");
    let open_url = format!("vouch://{}/disk", open.addr);
    refused(
        &[
            "create",
            s(&b),
            "--size",
            "16M",
            "--mirror",
            &open_url,
            "--replica-secret-file",
            s(&ours),
        ],
        "checks no shared secret",
    );
    // A secret file others can read is refused at start.
    let loose = dir.path().join("loose");
    std::fs::write(&loose, SECRET).expect("write");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    let error = replica_server(
        &dir.path().join("loose-replicas"),
        "127.0.0.1:0",
        &["--secret-file", s(&loose)],
        None,
    )
    .err()
    .expect("refused");
    assert!(error.contains("chmod 600"), "{error}");
}

/// `vouch ARGS` must fail, saying `why`.
fn refused(args: &[&str], why: &str) {
    let output = vouch(args);
    assert!(!output.status.success(), "{}", text(&output));
    assert!(text(&output).contains(why), "{}", text(&output));
}

#[test]
fn a_create_larger_than_the_servers_policy_is_refused_and_nothing_is_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let replicas = dir.path().join("replicas");
    let server = replica_server(
        &replicas,
        "127.0.0.1:0",
        &["--max-volume-size", "64M", "--max-journal-size", "32M"],
        None,
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let big = format!("vouch://{}/big", server.addr);
    let target = dir.path().join("big");
    let args = ["create", s(&target), "--size", "128M", "--mirror", &big];
    refused(&args, "over this server's limit");
    assert!(!replicas.join("big").exists());
    // A journal over the policy (the default split journal is 128 MiB).
    let journal = format!("vouch://{}/journal", server.addr);
    let target = dir.path().join("journal");
    let args = ["create", s(&target), "--size", "16M", "--mirror", &journal];
    refused(&args, "--max-journal-size");
    assert!(!replicas.join("journal").exists());
    let url = format!("vouch://{}/fits", server.addr);
    let output = vouch(&[
        "create",
        s(&dir.path().join("fits")),
        "--size",
        "16M",
        "--journal",
        "16M",
        "--mirror",
        &url,
    ]);
    assert!(output.status.success(), "{}", text(&output));
}
