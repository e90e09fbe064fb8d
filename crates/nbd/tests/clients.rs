//! Real NBD clients (nbdinfo, qemu-img, qemu-io, nbdcopy) against the server.

mod common;

use std::process::Command;

use common::{require_tool, run, run_ok, TestOptions, TestServer, EXPORT_SIZE};

#[test]
fn nbdinfo_reports_size_flags_list_and_map() {
    require_tool("nbdinfo", "libnbd-bin");
    let server = TestServer::start(TestOptions::default());
    let json = run_ok(Command::new("nbdinfo").args(["--json", &server.uri()]));
    for expected in [
        "\"protocol\": \"newstyle-fixed\"",
        "\"structured\": true",
        &format!("\"export-size\": {EXPORT_SIZE}"),
        "\"export-name\": \"disk\"",
        "\"description\": \"in-memory test export\"",
        "\"base:allocation\"",
        "\"is_read_only\": false",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_fast_zero\": true",
        "\"can_fua\": true",
        "\"can_multi_conn\": true",
        "\"can_cache\": true",
        "\"can_df\": true",
        "\"can_flush\": true",
        "\"block_size_minimum\": 512",
        "\"block_size_preferred\": 4096",
        "\"block_size_maximum\": 33554432",
    ] {
        assert!(json.contains(expected), "missing {expected} in {json}");
    }
    for capability in [
        "trim",
        "zero",
        "fua",
        "multi-conn",
        "cache",
        "flush",
        "df",
        "fast-zero",
    ] {
        let output = run(
            Command::new("nbdinfo").args(["--can", capability, &server.uri()]),
            None,
        );
        assert!(output.status.success(), "--can {capability}");
    }
    let read_only_uri = format!("{}/ro", server.uri());
    let output = run(
        Command::new("nbdinfo").args(["--can", "trim", &read_only_uri]),
        None,
    );
    assert_eq!(
        output.status.code(),
        Some(2),
        "read-only export must not advertise trim"
    );
    let output = run(
        Command::new("nbdinfo").args(["--is", "readonly", &read_only_uri]),
        None,
    );
    assert!(output.status.success());
    let list = run_ok(Command::new("nbdinfo").args(["--list", "--json", &server.uri()]));
    assert!(
        list.contains("\"export-name\": \"disk\"") && list.contains("\"export-name\": \"ro\""),
        "{list}"
    );

    // Map: allocate 64 KiB at 1 MiB, the rest stays a hole.
    server.export.fill_range(1 << 20, 64 << 10, 0xcd);
    let map = run_ok(Command::new("nbdinfo").args(["--map", "--json", &server.uri()]));
    assert!(
        map.contains("\"offset\": 1048576, \"length\": 65536, \"type\": 0"),
        "{map}"
    );
    assert!(
        map.contains("\"offset\": 0, \"length\": 1048576, \"type\": 3"),
        "{map}"
    );
}

#[test]
fn qemu_io_writes_and_verifies_patterns() {
    require_tool("qemu-io", "qemu-utils");
    let server = TestServer::start(TestOptions::default());
    let out = run_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        &server.uri(),
        "-c",
        "write -P 0xab 512 1536",
        "-c",
        "read -P 0xab 512 1536",
        "-c",
        "write -z 8192 8192",
        "-c",
        "read -P 0 8192 8192",
        "-c",
        "write -f -P 0x11 65536 4096",
        "-c",
        "discard 65536 4096",
        "-c",
        "flush",
        "-c",
        "aio_write -P 0x22 131072 4096",
        "-c",
        "aio_flush",
        "-c",
        "read -P 0x22 131072 4096",
    ]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(!out.to_lowercase().contains("error"), "{out}");
    assert_eq!(server.export.contents(512..2048), vec![0xab; 1536]);
    assert_eq!(server.export.contents(131072..135168), vec![0x22; 4096]);
    assert!(
        server
            .export
            .flushes
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    assert!(
        server
            .export
            .fua_writes
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
}

#[test]
fn qemu_img_convert_compare_and_nbdcopy() {
    require_tool("qemu-img", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let server = TestServer::start(TestOptions::default());
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.raw");
    // A sparse image with some data: pattern at 0, 3 MiB and the last 4 KiB.
    let mut image = vec![0u8; EXPORT_SIZE as usize];
    for (index, byte) in image[..1 << 20].iter_mut().enumerate() {
        *byte = (index % 251) as u8;
    }
    image[3 << 20..(3 << 20) + 8192].fill(0x77);
    let last = EXPORT_SIZE as usize - 4096;
    image[last..].fill(0x99);
    std::fs::write(&source, &image).unwrap();

    let info = run_ok(Command::new("qemu-img").args(["info", "--output=json", &server.uri()]));
    assert!(
        info.contains(&format!("\"virtual-size\": {EXPORT_SIZE}")),
        "{info}"
    );

    let source_str = source.to_str().unwrap();
    run_ok(Command::new("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        source_str,
        &server.uri(),
    ]));
    assert_eq!(server.export.contents(0..EXPORT_SIZE), image);
    run_ok(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        source_str,
        &server.uri(),
    ]));

    // And back out, through nbdcopy (multi-conn, block status aware).
    let copy = dir.path().join("copy.raw");
    run_ok(Command::new("nbdcopy").args([&server.uri(), copy.to_str().unwrap()]));
    assert_eq!(std::fs::read(&copy).unwrap(), image);
    // And nbdcopy in: file -> server on the second export path (same export, fresh pattern).
    image[5 << 20..(5 << 20) + 4096].fill(0x31);
    std::fs::write(&source, &image).unwrap();
    run_ok(Command::new("nbdcopy").args([source_str, &server.uri()]));
    assert_eq!(server.export.contents(0..EXPORT_SIZE), image);
}

#[test]
fn unix_socket_listener_serves() {
    require_tool("nbdinfo", "libnbd-bin");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let server = TestServer::start(TestOptions {
        unix_socket: Some(socket.clone()),
        ..TestOptions::default()
    });
    let uri = format!("nbd+unix:///disk?socket={}", socket.display());
    let size = run_ok(Command::new("nbdinfo").args(["--size", &uri]));
    assert_eq!(size.trim(), EXPORT_SIZE.to_string());
    drop(server);
}
