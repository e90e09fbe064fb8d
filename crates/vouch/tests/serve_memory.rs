//! Memory a server maps per request: a 1 MiB READ's reply buffer comes
//! from the allocator's heap and goes back to it, instead of being mapped
//! or trimmed and faulted in page by page for every READ (`main.rs`,
//! `keep_large_buffers`; a packed 1 MiB sequential read cost 48-250 page
//! faults and 1.1-1.3x the server CPU per READ without it).

mod common;

use std::process::Command;

use common::*;

/// The server's minor page faults so far (`/proc/PID/stat`, field 10).
fn minor_faults(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // Fields after the command name, which ends at the last ')'.
    let after = &stat[stat.rfind(')').expect("stat has (comm)") + 2..];
    after
        .split_whitespace()
        .nth(7)
        .and_then(|field| field.parse().ok())
        .expect("minflt field")
}

fn fio(uri: &str, rw: &str, ios: Option<u32>) {
    let mut command = Command::new(tool("fio", "fio"));
    command.args([
        "--name=memory",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        &format!("--rw={rw}"),
        "--bs=1M",
        "--iodepth=8",
        "--size=256M",
    ]);
    if let Some(ios) = ios {
        command.arg(format!("--number_ios={ios}"));
    }
    run_ok(&mut command);
}

/// 256 READs of 1 MiB at queue depth 8 from a packed volume written whole
/// (commits at the dirty limit, as a benchmark's prefill makes them),
/// after as many to settle the heaps: fewer than 16 page faults per READ
/// (157 per READ before: most of its 256 reply pages).
#[test]
fn a_large_read_reuses_its_reply_memory() {
    const READS: u64 = 256;
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(
        dir.path(),
        &[s(&volume), "--create", "256MiB", "--layout", "packed"],
    );
    fio(&server.uri, "write", None);
    fio(&server.uri, "read", Some(READS as u32));
    let before = minor_faults(server.pid);
    fio(&server.uri, "read", Some(READS as u32));
    let faults = minor_faults(server.pid) - before;
    assert!(
        faults < READS * 16,
        "{faults} page faults in the server for {READS} READs of 1 MiB"
    );
}
