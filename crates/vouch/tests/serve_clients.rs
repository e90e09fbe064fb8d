//! `vouch serve` driven by real NBD clients from Debian packages: qemu-img,
//! qemu-io (qemu-utils), nbdinfo, nbdcopy (libnbd-bin) and fio — sizes,
//! flags, extents, sub-block I/O, several exports, bit-exact copies and
//! verified random I/O. Every test has its own temp dir and an ephemeral
//! port; every server is stopped (SIGTERM, then SIGKILL) when its fixture
//! drops.

mod common;

use std::process::Command;
use std::time::Instant;

use common::clients::*;
use common::*;

/// (1) qemu-img sees the size; convert writes an image (including a zero
/// region over old data) and compare finds it identical, and finds a
/// one-byte difference.
#[test]
fn qemu_img_info_convert_and_compare() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "8MiB"]);

    let info = run_ok(Command::new(qemu_img()).args(["info", "--output=json", &server.uri]));
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("qemu-img json");
    assert_eq!(info["virtual-size"], 8 * MIB, "qemu-img info: {info}");

    // Old contents everywhere, so converting zeros must really zero them.
    qemu_io_ok(&server.uri, &["write -P 0xee 0 8M"]);
    let mut image = random_bytes((8 * MIB) as usize, 1);
    image[(2 * MIB) as usize..(3 * MIB) as usize].fill(0);
    let raw = dir.path().join("raw.img");
    std::fs::write(&raw, &image).expect("write raw");
    run_ok(Command::new(qemu_img()).args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        s(&raw),
        &server.uri,
    ]));
    let compare = run_ok(Command::new(qemu_img()).args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        s(&raw),
        &server.uri,
    ]));
    assert!(
        String::from_utf8_lossy(&compare.stdout).contains("identical"),
        "{}",
        text(&compare)
    );

    // The comparison is real: one changed byte is found.
    flip_bit(&raw, 5 * MIB + 77, 0x20);
    let compare = run(Command::new(qemu_img()).args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        s(&raw),
        &server.uri,
    ]));
    assert_eq!(
        compare.status.code(),
        Some(1),
        "compare must report the difference:\n{}",
        text(&compare)
    );
}

/// (2) Sub-block writes and reads at 512-byte granularity, across block
/// boundaries; unwritten space reads zero; discard and write -z read zero.
#[test]
fn qemu_io_sub_block_io_discard_and_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "4MiB"]);
    let uri = &server.uri;
    qemu_io_ok(
        uri,
        &[
            "write -P 0xab 512 1536",
            "read -P 0xab 512 1536",
            "read -P 0 0 512",
            "read -P 0 2048 2048",
            // Crosses the 4096 boundary (blocks 0 and 1).
            "write -P 0xcd 3584 1024",
            "read -P 0xcd 3584 1024",
            "read -P 0xab 512 1536",
            "read -P 0 2048 1536",
            "read -P 0 4608 3584",
            // Odd 512-byte offset spanning blocks 1..4.
            "write -P 0x11 7680 9216",
            "read -P 0x11 7680 9216",
            "read -P 0xcd 3584 1024",
            "read -P 0 16896 512",
            // Never written.
            "read -P 0 1M 64k",
            "read -P 0 4177408 16384",
        ],
    );
    // A new connection sees the same bytes.
    qemu_io_ok(
        uri,
        &[
            "read -P 0xab 512 1536",
            "read -P 0xcd 3584 1024",
            "read -P 0x11 7680 9216",
        ],
    );
    qemu_io_ok(
        uri,
        &[
            // Whole blocks 2 and 3 discarded, block 4 zeroed.
            "discard 8192 8192",
            "read -P 0 8192 8192",
            "write -z 16384 4096",
            "read -P 0 16384 4096",
            "read -P 0x11 7680 512",
            "read -P 0x11 7680 512",
            // Sub-block write -z inside block 0.
            "write -z 1024 512",
            "read -P 0xab 512 512",
            "read -P 0 1024 512",
            "read -P 0xab 1536 512",
            // Zeroing a large range, unaligned at both ends.
            "write -P 0x77 64k 64k",
            "write -z 66048 60928",
            "read -P 0x77 64k 512",
            "read -P 0 66048 60928",
            "read -P 0x77 126976 4096",
        ],
    );
    qemu_io_ok(
        uri,
        &[
            "read -P 0 8192 8192",
            "read -P 0 16384 4096",
            "read -P 0 66048 60928",
        ],
    );
    drop(server);
    assert_check_clean(&volume);
}

/// (3) nbdinfo: size and flags, every --can, --is read-only, --map extents.
#[test]
fn nbdinfo_flags_can_is_and_map() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "16MiB"]);
    let json = nbdinfo_json(&server.uri, &[]);
    let export = &json["exports"][0];
    assert_eq!(export["export-size"], 16 * MIB, "{json}");
    assert_eq!(export["export-name"], "vol", "{json}");
    assert_eq!(export["is_read_only"], false, "{json}");
    assert_eq!(json["structured"], true, "{json}");
    for flag in [
        "can_trim",
        "can_zero",
        "can_fua",
        "can_flush",
        "can_multi_conn",
        "can_cache",
        "can_fast_zero",
        "can_df",
    ] {
        assert_eq!(export[flag], true, "{flag} in {json}");
    }
    assert_eq!(export["block_size_minimum"], 512, "{json}");
    assert_eq!(export["block_size_preferred"], 4096, "{json}");
    for can in [
        "trim",
        "zero",
        "fua",
        "flush",
        "multi-conn",
        "cache",
        "fast-zero",
    ] {
        let output = run(Command::new(nbdinfo()).args(["--can", can, &server.uri]));
        assert_eq!(
            output.status.code(),
            Some(0),
            "nbdinfo --can {can}:\n{}",
            text(&output)
        );
    }
    let output = run(Command::new(nbdinfo()).args(["--is", "read-only", &server.uri]));
    assert_eq!(
        output.status.code(),
        Some(2),
        "--is read-only must be false:\n{}",
        text(&output)
    );

    // Data at blocks 0..2 and 1 MiB..1 MiB+8 KiB, explicit zeroes at 2 MiB.
    qemu_io_ok(
        &server.uri,
        &[
            "write -P 0x42 0 8k",
            "write -P 0x43 1M 8k",
            "write -z 2M 64k",
        ],
    );
    let map = run_ok(Command::new(nbdinfo()).args(["--map", "--json", &server.uri]));
    let map: serde_json::Value = serde_json::from_slice(&map.stdout).expect("map json");
    let extents: Vec<(u64, u64, u64)> = map
        .as_array()
        .expect("map array")
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().expect("offset"),
                e["length"].as_u64().expect("length"),
                e["type"].as_u64().expect("type"),
            )
        })
        .collect();
    let type_at = |offset: u64| {
        extents
            .iter()
            .find(|(start, length, _)| *start <= offset && offset < start + length)
            .map(|e| e.2)
            .unwrap_or_else(|| panic!("no extent covers {offset}: {extents:?}"))
    };
    // type: bit 0 hole, bit 1 zero.
    assert_eq!(type_at(0), 0, "data at 0: {extents:?}");
    assert_eq!(type_at(4096), 0, "data at 4096: {extents:?}");
    assert_eq!(type_at(8192), 3, "hole at 8192: {extents:?}");
    assert_eq!(type_at(MIB), 0, "data at 1M: {extents:?}");
    assert_eq!(type_at(MIB + 8192), 3, "hole after 1M+8k: {extents:?}");
    assert_eq!(type_at(2 * MIB) & 2, 2, "zero at 2M: {extents:?}");
    assert_eq!(type_at(15 * MIB), 3, "hole at the end: {extents:?}");
    let covered: u64 = extents.iter().map(|e| e.1).sum();
    assert_eq!(covered, 16 * MIB, "map must cover the export: {extents:?}");
    // The text form names them too.
    let text_map = run_ok(Command::new(nbdinfo()).args(["--map", &server.uri]));
    let text_map = String::from_utf8_lossy(&text_map.stdout);
    assert!(
        text_map.contains("data") && text_map.contains("hole,zero"),
        "{text_map}"
    );
}

/// (3) One server, two volumes: --list shows both names, each is usable by
/// name and they are independent; an unknown name is refused.
#[test]
fn two_exports_listed_and_usable_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    vouch_ok(&["create", s(&a), "--size", "1MiB"]);
    vouch_ok(&["create", s(&b), "--size", "2MiB", "--layout", "packed"]);
    let server = Server::start(
        dir.path(),
        &[s(&a), s(&b), "--name", "one", "--name", "two"],
    );
    let list = nbdinfo_json(&server.uri, &["--list"]);
    let mut names: Vec<(String, u64)> = list["exports"]
        .as_array()
        .expect("exports")
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().expect("name").to_string(),
                e["export-size"].as_u64().expect("size"),
            )
        })
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![("one".to_string(), MIB), ("two".to_string(), 2 * MIB)],
        "{list}"
    );
    let one = server.export_uri("one");
    let two = server.export_uri("two");
    assert_eq!(
        nbdinfo_json(&two, &[])["exports"][0]["export-size"],
        2 * MIB
    );
    // The default export (empty name) is the first volume.
    assert_eq!(
        nbdinfo_json(&server.uri, &[])["exports"][0]["export-size"],
        MIB
    );
    qemu_io_ok(&one, &["write -P 0x01 0 64k"]);
    qemu_io_ok(&two, &["write -P 0x02 0 32k"]);
    qemu_io_ok(&one, &["read -P 0x01 0 64k"]);
    qemu_io_ok(&two, &["read -P 0x02 0 32k", "read -P 0 32k 32k"]);
    let missing = run(Command::new(nbdinfo()).arg(server.export_uri("three")));
    assert!(
        !missing.status.success(),
        "unknown export accepted:\n{}",
        text(&missing)
    );
    drop(server);
    assert_check_clean(&a);
    assert_check_clean(&b);
}

/// (4) nbdcopy raw -> nbd -> raw is bit-exact, and still after the server is
/// stopped and started again on the same volume.
#[test]
fn nbdcopy_round_trip_survives_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let nbdcopy = tool("nbdcopy", "libnbd-bin");
    let mut image = random_bytes((16 * MIB) as usize, 4);
    image[(3 * MIB) as usize..(5 * MIB) as usize].fill(0); // a hole to skip
    image[(9 * MIB + 512) as usize..(9 * MIB + 1024) as usize].fill(0); // a sub-block run
    let raw = dir.path().join("raw.img");
    std::fs::write(&raw, &image).expect("raw");
    let mut server = Server::start(dir.path(), &[s(&volume), "--create", "16MiB"]);
    run_ok(Command::new(&nbdcopy).args([s(&raw), &server.uri]));
    let out = dir.path().join("out.img");
    run_ok(Command::new(&nbdcopy).args([&server.uri, s(&out)]));
    assert_eq!(sha256(&out), sha256(&raw), "nbdcopy round trip differs");
    server.stop();

    let server = server.restart();
    let again = dir.path().join("again.img");
    run_ok(Command::new(&nbdcopy).args([&server.uri, s(&again)]));
    assert_eq!(sha256(&again), sha256(&raw), "differs after a restart");
    drop(server);
    // And offline, through the engine.
    let exported = dir.path().join("exported.img");
    vouch_ok(&["export", s(&volume), s(&exported)]);
    assert_eq!(sha256(&exported), sha256(&raw), "vouch export differs");
}

/// (5) fio's nbd engine: random read/write at queue depth 16 with crc32c
/// verification, then sequential 1 MiB writes verified by a separate read
/// job; a changed block makes that read job fail (the verification is real).
#[test]
fn fio_randrw_and_sequential_verify() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let server = Server::start(dir.path(), &[s(&volume), "--create", "64MiB"]);
    let uri = format!("--uri={}", server.uri);
    let started = Instant::now();
    fio_verified_randrw(dir.path(), &server.uri, "64m");
    eprintln!("fio randrw 64m: {:?}", started.elapsed());

    fio(
        dir.path(),
        &[
            "--name=seq",
            "--ioengine=nbd",
            &uri,
            "--rw=write",
            "--bs=1M",
            "--size=64m",
            "--iodepth=4",
            "--verify=crc32c",
            "--do_verify=0",
        ],
    );
    let json = fio(
        dir.path(),
        &[
            "--name=seq",
            "--ioengine=nbd",
            &uri,
            "--rw=read",
            "--bs=1M",
            "--size=64m",
            "--iodepth=4",
            "--verify=crc32c",
            "--verify_fatal=1",
        ],
    );
    assert_eq!(json["jobs"][0]["read"]["io_bytes"], 64 * MIB, "{json}");

    // Negative control: overwrite 4 KiB in the middle; the read job fails.
    qemu_io_ok(&server.uri, &["write -P 0x33 33558528 4096"]);
    let output = run(Command::new(tool("fio", "fio"))
        .current_dir(dir.path())
        .args([
            "--name=seq",
            "--ioengine=nbd",
            &uri,
            "--rw=read",
            "--bs=1M",
            "--size=64m",
            "--verify=crc32c",
            "--verify_fatal=1",
        ]));
    assert!(
        !output.status.success() && text(&output).contains("verify failed"),
        "fio verification did not notice a changed block:\n{}",
        text(&output)
    );
    drop(server);
    assert_check_clean(&volume);
}
