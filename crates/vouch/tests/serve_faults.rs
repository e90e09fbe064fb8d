//! `vouch serve` under bad input and bad disks: a bit flipped on disk is
//! an EIO naming the LBA (and counted in metrics), and garbage,
//! out-of-range, misaligned or zero-length requests get what the NBD spec
//! asks for without harming the server or other clients.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::*;

/// (7) A bit flipped on disk under a stopped server: reading that LBA fails
/// with EIO and a message naming it; every other block reads correctly;
/// the metrics count the fault; `vouch check` lists exactly that LBA.
#[test]
fn corrupted_block_fails_with_eio_naming_the_lba() {
    corrupted_block_is_reported(false);
}

/// The same with `serve --direct`: the good blocks are answered from the
/// volume's read ring (no worker), the corrupt one fails its check there,
/// goes to a worker after all, and is reported the same way.
#[test]
fn corrupted_block_fails_with_eio_naming_the_lba_direct() {
    corrupted_block_is_reported(true);
}

fn corrupted_block_is_reported(direct: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let mut server = Server::start(dir.path(), &[s(&volume), "--create", "1MiB"]);
    write_tagged_blocks(&server.uri, 16);
    server.stop();
    assert_eq!(info_json(&volume)["clean"], true);
    flip_bit(&volume.join("data.00000"), 7 * BLOCK + 100, 0x04);

    let mut args = vec![s(&volume), "--metrics", "127.0.0.1:0"];
    if direct {
        args.push("--direct");
    }
    let server = Server::start(dir.path(), &args);
    let result = py_json(
        r#"
# libnbd keeps the server's structured error message out of str(e); it
# reports it through the debug log ("structured error server message: ...").
log = []
h = nbd.NBD()
h.set_debug(True)
h.set_debug_callback(lambda context, message: log.append(message))
h.connect_uri(sys.argv[1])
def failure(e):
    info = err_info(e)
    info["server_messages"] = [m.split("server message: ", 1)[1] for m in log
                               if "server message: " in m]
    return info
out = {"blocks": {}}
for lba in range(16):
    log.clear()
    try:
        out["blocks"][str(lba)] = h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba)
    except nbd.Error as e:
        out["blocks"][str(lba)] = failure(e)
for name, (length, offset) in {"sub_block": (512, 7 * 4096 + 1024),
                               "span": (16 * 4096, 0)}.items():
    log.clear()
    try:
        h.pread(length, offset)
        out[name] = "ok"
    except nbd.Error as e:
        out[name] = failure(e)
# The connection survives the errors.
out["after"] = h.pread(4096, 8 * 4096) == block_data(8, 1008)
print(json.dumps(out))
"#,
        &[&server.uri],
    );
    for lba in 0..16 {
        let entry = &result["blocks"][lba.to_string()];
        if lba == 7 {
            assert_eq!(
                entry["errnum"],
                libc::EIO,
                "LBA 7 must fail with EIO: {result}"
            );
            let messages = &entry["server_messages"];
            assert!(
                messages.as_array().is_some_and(|m| m.len() == 1
                    && m[0]
                        .as_str()
                        .is_some_and(|m| m.contains("LBA 7") && m.contains("guard_mismatch"))),
                "the server's structured error message must name the LBA and kind: {result}"
            );
        } else {
            assert_eq!(*entry, true, "LBA {lba} must read correctly: {result}");
        }
    }
    for name in ["sub_block", "span"] {
        assert_eq!(result[name]["errnum"], libc::EIO, "{name}: {result}");
        let messages = result[name]["server_messages"].to_string();
        assert!(messages.contains("LBA 7"), "{name}: {result}");
    }
    assert_eq!(result["after"], true, "{result}");

    let metrics = server.metrics_text();
    let engine = metric(
        &metrics,
        r#"vouch_engine_checksum_failures_total{volume="vol",kind="guard_mismatch"}"#,
    );
    assert!(
        engine.unwrap_or(0.0) >= 3.0,
        "engine guard_mismatch counter ({engine:?}) must count the 3 failed reads:\n{metrics}"
    );
    let nbd = metric(
        &metrics,
        r#"vouch_nbd_verification_faults_total{kind="guard_mismatch",export="vol"}"#,
    );
    assert!(
        nbd.unwrap_or(0.0) >= 3.0,
        "nbd fault counter {nbd:?}:\n{metrics}"
    );
    let eio = metric(
        &metrics,
        r#"vouch_nbd_errors_total{errno="EIO",export="vol"}"#,
    );
    assert!(eio.unwrap_or(0.0) >= 3.0, "EIO replies {eio:?}:\n{metrics}");
    // Blocks in the page cache were answered on the connection's own task
    // (the inline fast path), with --direct from the read ring; the
    // corrupt one still failed naming its LBA.
    if direct {
        let ring = |outcome: &str| {
            metric(
                &metrics,
                &format!(r#"vouch_nbd_ring_reads_total{{outcome="{outcome}",export="vol"}}"#),
            )
            .unwrap_or(0.0)
        };
        assert!(ring("answered") >= 15.0, "ring reads answered:\n{metrics}");
        assert!(
            ring("worker") >= 2.0,
            "the corrupt block's reads went to a worker:\n{metrics}"
        );
    }
    let inline = metric(
        &metrics,
        r#"vouch_nbd_inline_requests_total{command="read",export="vol"}"#,
    );
    assert!(
        inline.unwrap_or(0.0) >= 1.0,
        "inline reads {inline:?}:\n{metrics}"
    );
    for kind in ["ref_tag_mismatch", "volume_tag_mismatch", "context_corrupt"] {
        let series =
            format!(r#"vouch_engine_checksum_failures_total{{volume="vol",kind="{kind}"}}"#);
        assert_eq!(metric(&metrics, &series), Some(0.0), "{series}:\n{metrics}");
    }
    drop(server);
    assert_eq!(
        check_faults(&volume),
        (1, vec![(7, "guard_mismatch".to_string())])
    );
}

/// Read until EOF/reset; true when the peer closed within `timeout`.
fn closed_by_peer(stream: &mut TcpStream, timeout: Duration) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
    false
}

/// (11) Hostile and out-of-spec input: garbage on the socket is disconnected
/// without harming other clients; out-of-range and misaligned requests get
/// the errno the NBD spec asks for and change nothing; zero-length requests
/// do not drop the connection.
#[test]
fn garbage_out_of_range_and_zero_length_requests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let mut server = Server::start(dir.path(), &[s(&volume), "--create", "1MiB"]);

    // A silent connection that never negotiates must not block anyone.
    let silent = TcpStream::connect(server.addr).expect("connect");
    // Garbage right away.
    let mut garbage = TcpStream::connect(server.addr).expect("connect");
    garbage
        .write_all(&random_bytes(4096, 11))
        .expect("send garbage");
    assert!(
        closed_by_peer(&mut garbage, Duration::from_secs(10)),
        "garbage connection not closed"
    );
    // A valid greeting, then garbage instead of an option.
    let mut stream = TcpStream::connect(server.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC", "greeting {greeting:?}");
    assert_eq!(&greeting[8..16], b"IHAVEOPT", "greeting {greeting:?}");
    stream.write_all(&[0, 0, 0, 3]).expect("client flags");
    stream
        .write_all(b"NOTANOPTION-----garbage garbage garbage")
        .expect("garbage");
    assert!(
        closed_by_peer(&mut stream, Duration::from_secs(10)),
        "bad option not disconnected"
    );
    // An option header claiming a huge payload.
    let mut huge = TcpStream::connect(server.addr).expect("connect");
    huge.read_exact(&mut greeting).expect("greeting");
    huge.write_all(&[0, 0, 0, 3]).expect("client flags");
    let mut option = b"IHAVEOPT".to_vec();
    option.extend_from_slice(&1u32.to_be_bytes()); // NBD_OPT_EXPORT_NAME
    option.extend_from_slice(&0xFFFF_FFF0u32.to_be_bytes());
    huge.write_all(&option).expect("option");
    assert!(
        closed_by_peer(&mut huge, Duration::from_secs(10)),
        "4 GiB option not refused"
    );

    let result = py_json(
        r#"
h = connect(sys.argv[1], strict=False)
size = h.get_size()
out = {"size": size}
h.pwrite(b"\x6b" * 4096, size - 4096)
h.flush()
def attempt(name, op):
    try:
        op()
        out[name] = "ok"
    except nbd.Error as e:
        out[name] = err_info(e)
attempt("read_past_end", lambda: h.pread(4096, size))
attempt("read_across_end", lambda: h.pread(8192, size - 4096))
attempt("read_far_past_end", lambda: h.pread(4096, 1 << 62))
attempt("write_past_end", lambda: h.pwrite(b"\x01" * 4096, size))
attempt("write_across_end", lambda: h.pwrite(b"\x01" * 8192, size - 4096))
attempt("trim_past_end", lambda: h.trim(4096, size))
attempt("zero_past_end", lambda: h.zero(4096, size))
attempt("cache_past_end", lambda: h.cache(4096, size))
attempt("read_unaligned", lambda: h.pread(100, 1))
attempt("write_unaligned", lambda: h.pwrite(b"\x01" * 100, 4097))
attempt("read_zero_length", lambda: h.pread(0, 4096))
attempt("write_zero_length", lambda: h.pwrite(b"", 4096))
attempt("read_zero_length_at_end", lambda: h.pread(0, size))
out["last_block_intact"] = h.pread(4096, size - 4096) == b"\x6b" * 4096
out["first_block_zero"] = h.pread(8192, 0) == bytes(8192)
print(json.dumps(out))
"#,
        &[&server.uri],
    );
    let errnum = |name: &str| result[name]["errnum"].as_i64();
    // NBD spec, "Error values": ENOSPC for writes (and write zeroes) beyond
    // the end, EINVAL for reads and trims beyond it and for misalignment.
    for name in [
        "read_past_end",
        "read_across_end",
        "read_far_past_end",
        "trim_past_end",
        "cache_past_end",
        "read_unaligned",
        "write_unaligned",
    ] {
        assert_eq!(
            errnum(name),
            Some(libc::EINVAL.into()),
            "{name} must be EINVAL: {result}"
        );
    }
    for name in ["write_past_end", "write_across_end", "zero_past_end"] {
        assert_eq!(
            errnum(name),
            Some(libc::ENOSPC.into()),
            "{name} must be ENOSPC: {result}"
        );
    }
    // Zero-length: behaviour unspecified, but the server SHOULD NOT disconnect.
    for name in [
        "read_zero_length",
        "write_zero_length",
        "read_zero_length_at_end",
    ] {
        assert!(
            result[name] == "ok" || errnum(name) == Some(libc::EINVAL.into()),
            "{name}: {result}"
        );
    }
    assert_eq!(
        result["last_block_intact"], true,
        "a refused write changed data: {result}"
    );
    assert_eq!(result["first_block_zero"], true, "{result}");
    assert!(
        server.is_running(),
        "the server died:\n{}",
        server.log_text()
    );
    drop(silent);
    server.stop();
    assert_check_clean(&volume);
}

/// Issue 28: a metadata unit lost under a stopped server (split: context
/// page 0 zeroed; packed: row 0 zeroed) is never served as zeros or
/// reported as a hole: `nbdinfo --map` shows the range allocated, every
/// read of it is EIO naming the LBA, and the server log names the cause.
#[test]
fn a_lost_metadata_unit_is_eio_and_never_a_hole_split() {
    lost_unit_over_nbd("split", UnitLoss::Zeroed);
}

#[test]
fn a_lost_metadata_unit_is_eio_and_never_a_hole_packed() {
    lost_unit_over_nbd("packed", UnitLoss::Zeroed);
}

/// A unit copied in from another volume fails every read of it over NBD
/// with the volume tag named, its never-written blocks included (their
/// vacant markers name the other volume): never zeros, never a hole.
#[test]
fn a_unit_from_another_volume_is_eio_and_never_a_hole_split() {
    lost_unit_over_nbd("split", UnitLoss::FromOtherVolume);
}

#[test]
fn a_unit_from_another_volume_is_eio_and_never_a_hole_packed() {
    lost_unit_over_nbd("packed", UnitLoss::FromOtherVolume);
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum UnitLoss {
    /// Unit 0 zeroed.
    Zeroed,
    /// Unit 0 replaced by unit 0 of another volume written the same way.
    FromOtherVolume,
}

fn lost_unit_over_nbd(layout: &str, loss: UnitLoss) {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let other = dir.path().join("other");
    for volume in [&volume, &other] {
        vouch_ok(&["create", s(volume), "--size", "1MiB", "--layout", layout]);
        let mut server = Server::start(dir.path(), &[s(volume)]);
        write_tagged_blocks(&server.uri, 8);
        server.stop();
    }
    let (file, unit) = if layout == "split" {
        ("contexts", "page 0")
    } else {
        ("data.00000", "row 0")
    };
    let (unit_bytes, lbas) = if layout == "split" {
        (4096, "LBAs 0-127")
    } else {
        (131072, "LBAs 0-30")
    };
    let (bytes, cause, fault) = match loss {
        UnitLoss::Zeroed => (
            vec![0u8; unit_bytes],
            format!("{file}: {unit} is zeroed: {lbas} have no protection information"),
            "metadata_lost",
        ),
        UnitLoss::FromOtherVolume => {
            let mut bytes = vec![0u8; unit_bytes];
            std::fs::File::open(other.join(file))
                .expect("open the other volume's file")
                .read_exact_at(&mut bytes, 0)
                .expect("read its unit");
            (
                bytes,
                format!(
                    "{file}: {unit} belongs to another volume: {lbas} have no valid protection information"
                ),
                "volume_tag_mismatch",
            )
        }
    };
    std::fs::OpenOptions::new()
        .write(true)
        .open(volume.join(file))
        .expect("open")
        .write_all_at(&bytes, 0)
        .expect("replace the unit");

    let mut server = Server::start(dir.path(), &[s(&volume)]);
    let map = clients::nbdinfo_json(&server.uri, &["--map"]);
    let first = map.as_array().and_then(|runs| runs.first()).expect("a run");
    assert_eq!(first["offset"], 0, "{map}");
    assert!(
        first["length"]
            .as_u64()
            .is_some_and(|length| length >= 8 * BLOCK)
            && first["type"].as_u64().is_some_and(|kind| kind & 1 == 0),
        "the lost range must not be a hole: {map}"
    );
    let result = py_json(
        r#"
h, log = connect_logged(sys.argv[1])
out = {}
for lba in [0, 5, 20]:
    log.clear()
    try:
        out[str(lba)] = list(h.pread(4096, lba * 4096)[:4])
    except nbd.Error as e:
        out[str(lba)] = failure(e, log)
print(json.dumps(out))
"#,
        &[&server.uri],
    );
    for lba in [0, 5, 20] {
        let entry = &result[lba.to_string()];
        assert_eq!(entry["errnum"], libc::EIO, "LBA {lba}: {result}");
        assert!(
            entry["server_messages"]
                .to_string()
                .contains(&format!("LBA {lba}"))
                && entry["server_messages"].to_string().contains(fault),
            "LBA {lba}: {result}"
        );
    }
    server.stop();
    if loss == UnitLoss::Zeroed {
        let log = server.log_text();
        assert!(
            log.contains(&cause),
            "the server log names the cause: {log}"
        );
    }
    let check = vouch(&["check", s(&volume)]);
    assert_eq!(check.status.code(), Some(1), "{}", text(&check));
    assert!(text(&check).contains(&cause), "{}", text(&check));
}

/// Issue 28: a split data file cut short under guard `none` (nothing
/// compares data with its context): a read of a written block past the
/// file's end is an EIO naming the LBA and `metadata_lost`, never the
/// hole's zeros. A write past the end (which extends the file and leaves
/// a hole before it) does not make the blocks in between read as zeros
/// after a restart: the open marked them lost on disk.
#[test]
fn a_data_file_cut_short_unguarded_is_eio_never_zeros() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    vouch_ok(&["create", s(&volume), "--size", "1MiB", "--guard", "none"]);
    let mut server = Server::start(dir.path(), &[s(&volume)]);
    write_tagged_blocks(&server.uri, 12);
    server.stop();
    std::fs::OpenOptions::new()
        .write(true)
        .open(volume.join("data.00000"))
        .expect("open")
        .set_len(4 * BLOCK)
        .expect("cut the data file to 4 blocks");

    let read_script = r#"
h, log = connect_logged(sys.argv[1])
out = {}
for lba in range(12):
    log.clear()
    try:
        data = h.pread(4096, lba * 4096)
        out[str(lba)] = {"ok": data == block_data(lba, 1000 + lba), "zeros": data == bytes(4096)}
    except nbd.Error as e:
        out[str(lba)] = failure(e, log)
if sys.argv[2] == "write":
    h.pwrite(block_data(10, 5000), 10 * 4096)
    h.flush()
print(json.dumps(out))
"#;
    let expect_lost = |result: &serde_json::Value, lost: &[u64]| {
        for lba in 0..12u64 {
            let entry = &result[lba.to_string()];
            if lost.contains(&lba) {
                assert_eq!(entry["errnum"], libc::EIO, "LBA {lba}: {result}");
                let messages = entry["server_messages"].to_string();
                assert!(
                    messages.contains(&format!("LBA {lba}")) && messages.contains("metadata_lost"),
                    "LBA {lba}: {result}"
                );
            } else if lba != 10 {
                assert_eq!(entry["ok"], true, "LBA {lba} reads its data: {result}");
            }
        }
    };
    let mut server = Server::start(dir.path(), &[s(&volume)]);
    let result = py_json(read_script, &[&server.uri, "write"]);
    expect_lost(&result, &[4, 5, 6, 7, 8, 9, 10, 11]);
    server.stop();
    let log = server.log_text();
    assert!(
        log.contains("data.00000 is 16 KiB, the volume needs 1 MiB: LBAs 4-255 are missing"),
        "the server log names the cause: {log}"
    );

    // LBA 10 written again: the file now reaches past the lost blocks.
    let mut server = Server::start(dir.path(), &[s(&volume)]);
    let result = py_json(
        &read_script.replace(
            "block_data(lba, 1000 + lba)",
            "block_data(lba, 5000 if lba == 10 else 1000 + lba)",
        ),
        &[&server.uri, "read"],
    );
    expect_lost(&result, &[4, 5, 6, 7, 8, 9, 11]);
    assert_eq!(result["10"]["ok"], true, "{result}");
    server.stop();
    let check = vouch(&["check", s(&volume)]);
    assert_eq!(check.status.code(), Some(1), "{}", text(&check));
    assert!(
        text(&check).contains("contexts: page 0 has 7 lost markers (found lost before): LBAs 4-11 have no protection information"),
        "{}",
        text(&check)
    );
}

/// Issue 28: an older copy of `contexts` restored (split). Its pages are
/// whole and in their place; a page the volume rewrote since is older
/// than the generation the written map expects of it, so every block of
/// it is a fault naming the cause — never a block written since read as
/// never written (zeros), never old data. `check` and `export` name the
/// page once; over NBD its blocks are EIO; the page the volume did not
/// rewrite reads as before.
#[test]
fn an_older_copy_of_the_contexts_is_named_never_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Blocks 130-135 rewritten, 136-140 written for the first time.
    let volume = older_copy_restored(
        dir.path(),
        ("split", "contexts"),
        (136, 130..141),
        "contexts: page 1 is older than the volume expects",
        "an older copy of the file?): LBAs 128-255 have no protection information",
    );
    let server = Server::start(dir.path(), &[s(&volume)]);
    let result = py_json(
        r#"
h, log = connect_logged(sys.argv[1])
out = {}
for lba in [5, 127, 128, 132, 138, 200]:
    log.clear()
    try:
        out[str(lba)] = {"ok": h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba)}
    except nbd.Error as e:
        out[str(lba)] = failure(e, log)
print(json.dumps(out))
"#,
        &[&server.uri],
    );
    for lba in [5, 127] {
        assert_eq!(result[lba.to_string()]["ok"], true, "LBA {lba}: {result}");
    }
    for lba in [128, 132, 138, 200] {
        let entry = &result[lba.to_string()];
        assert_eq!(entry["errnum"], libc::EIO, "LBA {lba}: {result}");
        let messages = entry["server_messages"].to_string();
        assert!(
            messages.contains(&format!("LBA {lba}")) && messages.contains("metadata_lost"),
            "LBA {lba}: {result}"
        );
    }
    drop(server);
}

/// Issue 28: an older copy of a packed data file restored. Its rows are
/// whole, in their place and match their own data; a row the volume
/// wrote since is older than the generation the written map expects of
/// it, so every block of it is a fault naming the file, the row and its
/// LBAs — never old data, never zeros. `check` and `export` name the row
/// once; over NBD its blocks are EIO (after the first, from memory); the
/// row the volume did not rewrite reads as before. A write into the older
/// row marks its other blocks lost on disk before it lands, so they stay
/// faults at the next open instead of reading as current beside it.
#[test]
fn an_older_copy_of_a_packed_data_file_is_named_never_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Blocks 35-39 rewritten, 40-44 written for the first time: row 1
    // (LBAs 31-61) only.
    let volume = older_copy_restored(
        dir.path(),
        ("packed", "data.00000"),
        (40, 35..45),
        "data.00000: row 1 is older than the volume expects",
        "an older copy of the file?): LBAs 31-61 have no protection information",
    );
    let read_script = r#"
h, log = connect_logged(sys.argv[1])
out = {}
if len(sys.argv) > 2:
    h.pwrite(block_data(50, 3050), 50 * 4096)
    h.flush()
for lba in [5, 30, 31, 36, 42, 50, 36]:
    log.clear()
    try:
        data = h.pread(4096, lba * 4096)
        out[str(lba)] = {"ok": data == block_data(lba, (3000 if lba == 50 else 1000) + lba)}
    except nbd.Error as e:
        out[str(lba)] = failure(e, log)
print(json.dumps(out))
"#;
    let expect_older_row = |result: &serde_json::Value, written: bool| {
        for lba in [5, 30] {
            assert_eq!(result[lba.to_string()]["ok"], true, "LBA {lba}: {result}");
        }
        let lost: &[u64] = if written {
            &[31, 36, 42]
        } else {
            &[31, 36, 42, 50]
        };
        for lba in lost {
            let entry = &result[lba.to_string()];
            assert_eq!(entry["errnum"], libc::EIO, "LBA {lba}: {result}");
            let messages = entry["server_messages"].to_string();
            assert!(
                messages.contains(&format!("LBA {lba}")) && messages.contains("metadata_lost"),
                "LBA {lba}: {result}"
            );
        }
        if written {
            assert_eq!(result["50"]["ok"], true, "the new write reads: {result}");
        }
    };
    let mut server = Server::start(dir.path(), &[s(&volume)]);
    expect_older_row(&py_json(read_script, &[&server.uri]), false);
    // A write into the older row: the row's other blocks stay lost, now
    // and after a restart.
    expect_older_row(&py_json(read_script, &[&server.uri, "write"]), true);
    server.stop();
    let log = server.log_text();
    assert!(
        log.contains("a row is older than the volume expects"),
        "the server log names the row: {log}"
    );
    let server = Server::start(dir.path(), &[s(&volume)]);
    expect_older_row(&py_json(read_script, &[&server.uri]), true);
    drop(server);
    let check = vouch(&["check", s(&volume)]);
    assert!(
        text(&check).contains("data.00000: row 1 has 30 lost markers (found lost before)"),
        "{}",
        text(&check)
    );
}

/// Reviewer's finding on issue 28: a binary from before packed
/// generations that trims a row's newest block leaves the row older than
/// the expectation the map holds (it does not update the values, and
/// writes no map at all when no bit changes). Emulated on disk as that
/// binary leaves it: the block's slot a vacant marker, and a superblock
/// written with the bytes it does not know as zeros. The expectation is
/// then not known, never believed: the row reads as current. The same
/// slot change under this binary's own superblock is an older row.
#[test]
fn a_downgrade_that_trims_a_rows_newest_block_is_not_an_older_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    vouch_ok(&["create", s(&volume), "--size", "1MiB", "--layout", "packed"]);
    let write_script = r#"
h = connect(sys.argv[1])
for lba in range(int(sys.argv[2]), int(sys.argv[3])):
    h.pwrite(block_data(lba, 1000 + lba), lba * 4096)
    h.flush()
print(json.dumps({"ok": True}))
"#;
    // Row 1 is LBAs 31-61: its newest block is 39, written last.
    let mut server = Server::start(dir.path(), &[s(&volume)]);
    py_json(write_script, &[&server.uri, "0", "40"]);
    server.stop();
    let uuid: [u8; 16] = std::fs::read(volume.join("superblock")).expect("superblock")[40..56]
        .try_into()
        .expect("uuid");
    let trim_39 = |volume: &std::path::Path| {
        let record = 131072 + (39 - 31) * 4128;
        let data = std::fs::OpenOptions::new()
            .write(true)
            .open(volume.join("data.00000"))
            .expect("open");
        let mut trimmed = vec![0u8; 4128];
        trimmed[4096..].copy_from_slice(&vouch_format::encode_vacant(
            vouch_format::crc32c(&uuid),
            39,
        ));
        data.write_all_at(&trimmed, record).expect("trim 39");
    };
    // Under this binary's superblock the row is older than expected.
    let own = dir.path().join("own");
    run_ok(std::process::Command::new("cp").args(["-a", s(&volume), s(&own)]));
    trim_39(&own);
    let check = vouch(&["check", s(&own)]);
    assert_eq!(check.status.code(), Some(1), "{}", text(&check));
    assert!(
        text(&check).contains("data.00000: row 1 is older than the volume expects"),
        "{}",
        text(&check)
    );
    // Under the older binary's: not known, so the row is current.
    trim_39(&volume);
    rewrite_superblock(&volume, |sb| {
        sb.generation += 1;
        sb.checkpoint_seq += 1;
        sb.generations_seq = 0;
    });
    assert_check_clean(&volume);
    let out = dir.path().join("out.raw");
    vouch_ok(&["export", s(&volume), s(&out)]);
    let exported = std::fs::read(&out).expect("read export");
    let expected = py(
        r#"
out = b"".join(block_data(lba, 1000 + lba) for lba in range(39))
sys.stdout.buffer.write(out)
"#,
        &[],
    )
    .stdout;
    assert_eq!(
        &exported[..39 * 4096],
        &expected[..],
        "blocks 0-38 as written"
    );
    assert!(
        exported[39 * 4096..].iter().all(|byte| *byte == 0),
        "the trimmed block and the rest read as zeros"
    );
}

/// Issue 28: a volume whose expected generations are not known (made
/// before them, or last written by a binary that names none in its
/// superblock) does not catch an older copy of a unit it did not write
/// again; `vouch upgrade` fills the values in from the metadata on disk,
/// after which the same older copy is caught, in both layouts.
#[test]
fn an_upgrade_fills_in_expected_generations() {
    let cases = [
        (
            ("split", "contexts"),
            (136, 130..141),
            (
                "contexts: page 1 is older than the volume expects",
                "an older copy of the file?): LBAs 128-255 have no protection information",
            ),
        ),
        (
            ("packed", "data.00000"),
            (40, 35..45),
            (
                "data.00000: row 1 is older than the volume expects",
                "an older copy of the file?): LBAs 31-61 have no protection information",
            ),
        ),
    ];
    for ((layout, file), writes, cause) in cases {
        let dir = tempfile::tempdir().expect("tempdir");
        older_copy_restored_after(
            dir.path(),
            (layout, file),
            writes,
            cause,
            |volume, older| {
                rewrite_superblock(volume, |sb| sb.generations_seq = 0);
                // Not known: the older copy is not named (packed reads it as
                // current; split's guards see its data changed, block by block).
                let before = dir.path().join("before");
                run_ok(std::process::Command::new("cp").args(["-a", s(volume), s(&before)]));
                std::fs::write(before.join(file), older).expect("restore the older copy");
                let check = vouch(&["check", s(&before)]);
                assert!(!text(&check).contains(cause.0), "{}", text(&check));
                if layout == "packed" {
                    assert_eq!(check.status.code(), Some(0), "{}", text(&check));
                }
                let said = text(&vouch_ok(&["upgrade", s(volume)]));
                assert!(said.contains("expected generations filled in"), "{said}");
            },
        );
    }
}

/// A 1 MiB volume of `layout` in `dir/vol`: blocks `0..first` written
/// (tag 1000 + LBA), `file` copied, blocks `again` written (tag 2000 +
/// LBA), and the copy of `file` restored. `check` must then fail with one
/// line naming the unit, starting `cause_start` and ending `cause_end`,
/// and `export` must fail naming it too, exporting nothing.
fn older_copy_restored(
    dir: &std::path::Path,
    (layout, file): (&str, &str),
    (first, again): (u64, std::ops::Range<u64>),
    cause_start: &str,
    cause_end: &str,
) -> std::path::PathBuf {
    older_copy_restored_after(
        dir,
        (layout, file),
        (first, again),
        (cause_start, cause_end),
        |_, _| {},
    )
}

/// `older_copy_restored`, with `before_restore(volume, older)` run on the
/// volume before the older copy (`older`, the file's bytes) is restored.
fn older_copy_restored_after(
    dir: &std::path::Path,
    (layout, file): (&str, &str),
    (first, again): (u64, std::ops::Range<u64>),
    (cause_start, cause_end): (&str, &str),
    before_restore: impl Fn(&std::path::Path, &[u8]),
) -> std::path::PathBuf {
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "1MiB", "--layout", layout]);
    let write_script = r#"
h = connect(sys.argv[1])
for lba in range(int(sys.argv[2]), int(sys.argv[3])):
    h.pwrite(block_data(lba, int(sys.argv[4]) + lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#;
    let mut server = Server::start(dir, &[s(&volume)]);
    py_json(
        write_script,
        &[&server.uri, "0", &first.to_string(), "1000"],
    );
    server.stop();
    let older = std::fs::read(volume.join(file)).expect("read the file");
    let mut server = Server::start(dir, &[s(&volume)]);
    let (start, end) = (again.start.to_string(), again.end.to_string());
    py_json(write_script, &[&server.uri, &start, &end, "2000"]);
    server.stop();
    before_restore(&volume, &older);
    std::fs::write(volume.join(file), &older).expect("restore the older copy");

    let check = vouch(&["check", s(&volume)]);
    let report = text(&check);
    assert_eq!(check.status.code(), Some(1), "{report}");
    let cause = line_starting(&report, cause_start);
    assert!(cause.ends_with(cause_end), "{report}");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert_eq!(
        stdout.lines().filter(|line| line.contains("LBA")).count(),
        1,
        "one line for the unit: {report}"
    );
    let out = dir.join("out.raw");
    let export = vouch(&["export", s(&volume), s(&out)]);
    assert_eq!(export.status.code(), Some(2), "{}", text(&export));
    assert!(text(&export).contains(&cause), "{}", text(&export));
    assert!(!out.exists(), "nothing exported");
    volume
}

/// The line of `report` that starts with `start` (the test fails without one).
fn line_starting(report: &str, start: &str) -> String {
    report
        .lines()
        .find(|line| line.trim_start().starts_with(start))
        .unwrap_or_else(|| panic!("no line starting {start:?} in:\n{report}"))
        .trim_start()
        .to_string()
}
