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
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on a socket this function's caller owns, with a
    // pointer to a live `linger` and its size.
    let result = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(result, 0, "SO_LINGER");
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
    while after.saturating_sub(before) >= RSS_GROWTH_KIB_MAX
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
        after = rss_kib(server.pid);
    }
    assert!(
        after.saturating_sub(before) < RSS_GROWTH_KIB_MAX,
        "{CYCLES} connect-hello-close cycles grew the replica server from {before} KiB to {after} KiB"
    );
}
