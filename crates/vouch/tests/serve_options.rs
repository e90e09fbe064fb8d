//! `vouch serve` options seen from real NBD clients: --read-only is
//! advertised and enforced, --socket serves over a Unix socket, --tls-*
//! requires (or offers) verified TLS, --direct opens data segments with
//! O_DIRECT or refuses clearly where the filesystem cannot.

mod common;

use std::path::Path;
use std::process::Command;

use common::clients::*;
use common::*;

/// (3) --read-only is advertised (nbdinfo --is read-only) and enforced.
/// (8) qemu-io cannot write, reads work; libnbd writes get EPERM from the
/// server; the volume is unchanged and still clean.
#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let mut server = Server::start(dir.path(), &[s(&volume), "--create", "4MiB"]);
    qemu_io_ok(&server.uri, &["write -P 0x5c 0 64k"]);
    server.stop();
    let before = std::fs::read(volume.join("data.00000")).expect("data");

    let server = Server::start(dir.path(), &[s(&volume), "--read-only"]);
    let output = run(Command::new(nbdinfo()).args(["--is", "read-only", &server.uri]));
    assert_eq!(
        output.status.code(),
        Some(0),
        "--is read-only must be true:\n{}",
        text(&output)
    );
    let output = run(Command::new(nbdinfo()).args(["--can", "write", &server.uri]));
    assert_ne!(
        output.status.code(),
        Some(0),
        "--can write must be false:\n{}",
        text(&output)
    );

    let output = qemu_io(&server.uri, &[], &["write -P 0x99 0 4k"]);
    let all = text(&output);
    assert!(
        !output.status.success(),
        "qemu-io write on a read-only export succeeded:\n{all}"
    );
    assert!(
        all.contains("Permission denied")
            || all.contains("read-only")
            || all.contains("Operation not permitted"),
        "qemu-io must say why:\n{all}"
    );
    let output = qemu_io(
        &server.uri,
        &["-r"],
        &["read -P 0x5c 0 64k", "read -P 0 64k 64k"],
    );
    assert!(
        output.status.success() && !text(&output).contains("verification failed"),
        "reads on a read-only export:\n{}",
        text(&output)
    );

    let result = py_json(
        r#"
uri = sys.argv[1]
out = {}
h = connect(uri, strict=False)   # send the requests; let the server refuse
out["read_only"] = h.is_read_only()
for name, op in [("write", lambda: h.pwrite(b"\x01" * 4096, 0)),
                 ("fua_write", lambda: h.pwrite(b"\x01" * 4096, 8192, nbd.CMD_FLAG_FUA)),
                 ("trim", lambda: h.trim(4096, 0)),
                 ("zero", lambda: h.zero(4096, 0))]:
    try:
        op()
        out[name] = "ok"
    except nbd.Error as e:
        out[name] = err_info(e)
out["read_ok"] = h.pread(4096, 0) == b"\x5c" * 4096
h.flush()
out["flush"] = "ok"
strict = connect(uri)            # libnbd's own check refuses too
try:
    strict.pwrite(b"\x01" * 4096, 0)
    out["strict_write"] = "ok"
except nbd.Error as e:
    out["strict_write"] = err_info(e)
print(json.dumps(out))
"#,
        &[&server.uri],
    );
    assert_eq!(result["read_only"], true, "{result}");
    for op in ["write", "fua_write", "trim", "zero", "strict_write"] {
        assert_eq!(
            result[op]["errnum"],
            libc::EPERM,
            "{op} on a read-only export must fail with EPERM: {result}"
        );
    }
    assert_eq!(result["read_ok"], true, "{result}");
    drop(server);
    assert_eq!(
        std::fs::read(volume.join("data.00000")).expect("data"),
        before,
        "a read-only server changed the data"
    );
    assert_eq!(info_json(&volume)["clean"], true);
}

/// (12) --socket: the export is reachable over a Unix socket too.
#[test]
fn unix_socket_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let socket = dir.path().join("nbd.sock");
    let server = Server::start(
        dir.path(),
        &[s(&volume), "--create", "2MiB", "--socket", s(&socket)],
    );
    let unix = format!("nbd+unix:///?socket={}", socket.display());
    let json = nbdinfo_json(&unix, &[]);
    assert_eq!(json["exports"][0]["export-size"], 2 * MIB, "{json}");
    qemu_io_ok(&unix, &["write -P 0x21 4096 8192"]);
    // Same volume over TCP and by name over the socket.
    qemu_io_ok(&server.uri, &["read -P 0x21 4096 8192"]);
    qemu_io_ok(
        &format!("nbd+unix:///vol?socket={}", socket.display()),
        &["read -P 0x21 4096 8192", "read -P 0 0 4096"],
    );
}

fn make_cert(dir: &Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    common::pki::make_self_signed(dir, name, "serverAuth")
}

/// A libnbd certificate directory: `ca-cert.pem` is the only required file
/// (client-cert.pem/client-key.pem are optional, for client authentication;
/// see libnbd lib/crypto.c load_certificates).
fn ca_dir(dir: &Path, name: &str, cert: &Path) -> std::path::PathBuf {
    let ca = dir.join(name);
    std::fs::create_dir(&ca).expect("ca dir");
    std::fs::copy(cert, ca.join("ca-cert.pem")).expect("copy cert");
    ca
}

const TLS_CLIENT: &str = r#"
uri, cadir = sys.argv[1], sys.argv[2]
out = {}
try:
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(cadir)
    h.set_tls_verify_peer(True)
    h.connect_uri(uri)
    out["tls"] = h.get_tls_negotiated()
    h.pwrite(block_data(3, 33), 3 * 4096)
    h.flush()
    out["read_back"] = h.pread(4096, 3 * 4096) == block_data(3, 33)
    out["size"] = h.get_size()
except nbd.Error as e:
    out["error"] = err_info(e)
print(json.dumps(out))
"#;

/// (13) TLS: plaintext clients are refused; libnbd with the server's
/// certificate as its CA connects over nbds://, verifies the peer and does
/// I/O; a client trusting another CA is refused; --tls-optional admits
/// plaintext too.
#[test]
fn tls_required_verified_and_optional() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let (cert, key) = make_cert(dir.path(), "server");
    let (other, _) = make_cert(dir.path(), "other");
    let good_ca = ca_dir(dir.path(), "pki-good", &cert);
    let bad_ca = ca_dir(dir.path(), "pki-bad", &other);
    let mut server = Server::start(
        dir.path(),
        &[
            s(&volume),
            "--create",
            "2MiB",
            "--tls-cert",
            s(&cert),
            "--tls-key",
            s(&key),
        ],
    );
    let port = server.addr.port();

    let plain = run(Command::new(nbdinfo()).arg(&server.uri));
    assert!(
        !plain.status.success(),
        "plaintext client accepted:\n{}",
        text(&plain)
    );

    let tls_uri = format!("nbds://localhost:{port}");
    let result = py_json(TLS_CLIENT, &[&tls_uri, s(&good_ca)]);
    assert_eq!(result["tls"], true, "{result}");
    assert_eq!(result["read_back"], true, "{result}");
    assert_eq!(result["size"], 2 * MIB, "{result}");

    let result = py_json(TLS_CLIENT, &[&tls_uri, s(&bad_ca)]);
    assert!(
        result["error"].is_object(),
        "a server certificate from an untrusted CA was accepted: {result}"
    );

    // nbdinfo over TLS, certificates given in the URI.
    let json = nbdinfo_json(
        &format!(
            "nbds://localhost:{port}/?tls-certificates={}",
            good_ca.display()
        ),
        &[],
    );
    assert_eq!(json["TLS"], true, "{json}");
    assert_eq!(json["exports"][0]["export-size"], 2 * MIB, "{json}");
    server.stop();

    let server = Server::start(
        dir.path(),
        &[
            s(&volume),
            "--tls-cert",
            s(&cert),
            "--tls-key",
            s(&key),
            "--tls-optional",
        ],
    );
    let json = nbdinfo_json(&server.uri, &[]);
    assert_eq!(json["TLS"], false, "{json}");
    let tls_uri = format!("nbds://localhost:{}", server.addr.port());
    let result = py_json(
        r#"
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates(sys.argv[2])
h.connect_uri(sys.argv[1])
print(json.dumps({"tls": h.get_tls_negotiated(),
                  "data": h.pread(4096, 3 * 4096) == block_data(3, 33)}))
"#,
        &[&tls_uri, s(&good_ca)],
    );
    assert_eq!(result, serde_json::json!({"tls": true, "data": true}));
    qemu_io_ok(&server.uri, &["read -P 0 0 4096"]);
}

/// The open-file flags of the server's descriptor for `file_name` inside
/// `volume` (from /proc/PID/fdinfo), to see O_DIRECT really is in effect.
fn server_fd_flags(pid: u32, volume: &Path, file_name: &str) -> u32 {
    let target = volume
        .join(file_name)
        .canonicalize()
        .expect("canonical path");
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read /proc/PID/fd") {
        let entry = entry.expect("fd entry");
        if std::fs::read_link(entry.path()).ok().as_deref() != Some(target.as_path()) {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            entry.file_name().to_string_lossy()
        ))
        .expect("fdinfo");
        let flags = info
            .lines()
            .find_map(|line| line.strip_prefix("flags:"))
            .expect("flags line");
        return u32::from_str_radix(flags.trim(), 8).expect("octal flags");
    }
    panic!("server {pid} has no descriptor for {}", target.display());
}

/// `serve --direct`: data segments really are O_DIRECT (and the journal is
/// not); fio's verified random read/write, sub-sector-aligned qemu-io
/// writes, discard and restart all work through the direct path, in both
/// layouts (packed records straddle pages: read-modify-write of the edges).
#[test]
fn direct_data_segments_serve_verified_io_in_both_layouts() {
    for layout in ["split", "packed"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let volume = dir.path().join("vol");
        let mut server = Server::start(
            dir.path(),
            &[
                s(&volume),
                "--create",
                "32MiB",
                "--layout",
                layout,
                "--direct",
            ],
        );
        let data_flags = server_fd_flags(server.pid, &volume, "data.00000");
        let journal_flags = server_fd_flags(server.pid, &volume, "journal");
        let o_direct = libc::O_DIRECT as u32;
        assert!(
            data_flags & o_direct != 0,
            "{layout}: data segment not O_DIRECT (flags {data_flags:o})"
        );
        assert!(
            journal_flags & o_direct == 0,
            "{layout}: journal should stay cached (flags {journal_flags:o})"
        );
        fio_verified_randrw(dir.path(), &server.uri, "32m");
        // 512-byte-aligned writes (read-modify-write of a block), a discard
        // and a zero, read back before and after a restart.
        qemu_io_ok(
            &server.uri,
            &[
                "write -P 0x5a 4608 1024",
                "write -P 0x6b 1048576 65536",
                "discard 2097152 1048576",
                "write -z 3145728 8192",
                "flush",
            ],
        );
        let expect = [
            "read -P 0x5a 4608 1024",
            "read -P 0x6b 1048576 65536",
            "read -P 0 2097152 1048576",
            "read -P 0 3145728 8192",
        ];
        qemu_io_ok(&server.uri, &expect);
        server.stop();
        let server = server.restart();
        qemu_io_ok(&server.uri, &expect);
        drop(server);
        assert_check_clean(&volume);
    }
}

/// A ramfs mount, unmounted on drop. ramfs has no O_DIRECT: an open with it
/// fails with EINVAL. Needs root (CI runs as root).
struct RamFs {
    dir: tempfile::TempDir,
}

impl RamFs {
    fn mount() -> RamFs {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = std::process::Command::new("mount")
            .args(["-t", "ramfs", "ramfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mounting a ramfs needs root (run the suite as root, as CI does)"
        );
        RamFs { dir }
    }
}

impl Drop for RamFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

/// Every file of a volume directory with its SHA-256, sorted by name.
fn volume_digest(volume: &Path) -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = std::fs::read_dir(volume)
        .expect("read volume dir")
        .map(|entry| {
            let path = entry.expect("dir entry").path();
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            (name, sha256(&path))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn direct_on_a_filesystem_without_o_direct_is_a_clear_error() {
    let ramfs = RamFs::mount();
    let logs = tempfile::tempdir().expect("tempdir");
    let volume = ramfs.dir.path().join("vol");
    vouch_ok(&["create", s(&volume), "--size", "8MiB"]);
    let mut server = Server::start(logs.path(), &[s(&volume)]);
    qemu_io_ok(&server.uri, &["write -P 0x3c 0 65536", "flush"]);
    server.stop();
    let before = volume_digest(&volume);
    let refused = match Server::try_start(logs.path(), &[s(&volume), "--direct"]) {
        Err(refused) => refused,
        Ok(server) => {
            drop(server);
            panic!("`serve --direct` started on a ramfs, which has no O_DIRECT");
        }
    };
    let line = refused
        .lines()
        .find(|line| line.contains("O_DIRECT"))
        .unwrap_or_else(|| panic!("no line names O_DIRECT:\n{refused}"));
    assert!(
        line.contains("data.00000") && line.contains("without --direct"),
        "the error names the file and the fix: {line}"
    );
    assert_eq!(
        volume_digest(&volume),
        before,
        "a refused --direct open modified the volume"
    );
    // The same volume still serves, cached, with what was written.
    let server = Server::start(logs.path(), &[s(&volume)]);
    qemu_io_ok(&server.uri, &["read -P 0x3c 0 65536"]);
    drop(server);
    assert_check_clean(&volume);
}

/// `--context-cache` of one page (4 KiB: 128 contexts) with `--direct`:
/// split reads fetch nearly every context page again, packed reads widen
/// each run to 4 KiB boundaries into a reused buffer (`read_run`). Both
/// serve verified data across rows and pages, before and after a restart;
/// a cache smaller than one page is refused, naming the option.
#[test]
fn one_page_context_cache_serves_verified_io_in_both_layouts() {
    for layout in ["split", "packed"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let volume = dir.path().join("vol");
        let args = [s(&volume), "--direct", "--context-cache", "4K"];
        let mut create = vec![s(&volume), "--create", "32MiB", "--layout", layout];
        create.extend_from_slice(&args[1..]);
        let mut server = Server::start(dir.path(), &create);
        fio_verified_randrw(dir.path(), &server.uri, "32m");
        // Runs that start mid-row and cross rows (31 packed records a row)
        // and context pages (128 split contexts a page), up to 4 MiB.
        qemu_io_ok(
            &server.uri,
            &[
                "write -P 0x21 118784 12288",
                "write -P 0x43 520192 4194304",
                "flush",
            ],
        );
        let expect = [
            "read -P 0x21 118784 12288",
            "read -P 0x43 520192 4194304",
            "read -P 0x43 1040384 8192",
        ];
        qemu_io_ok(&server.uri, &expect);
        server.stop();
        let server = Server::start(dir.path(), &args);
        qemu_io_ok(&server.uri, &expect);
        drop(server);
        assert_check_clean(&volume);

        let refused = match Server::try_start(dir.path(), &[s(&volume), "--context-cache", "1K"]) {
            Err(refused) => refused,
            Ok(server) => {
                drop(server);
                panic!("{layout}: `serve --context-cache 1K` started");
            }
        };
        assert!(
            refused.contains("--context-cache must be at least 4K"),
            "{layout}: the refusal names the option and its floor:\n{refused}"
        );
        // Refused before `--create` makes anything.
        let fresh = dir.path().join("fresh");
        let args = [s(&fresh), "--create", "8MiB", "--context-cache", "1K"];
        if let Ok(server) = Server::try_start(dir.path(), &args) {
            drop(server);
            panic!("{layout}: `serve --create --context-cache 1K` started");
        }
        assert!(
            !fresh.exists(),
            "{layout}: a refused serve --create left a volume behind"
        );
    }
}

/// `serve --direct` answers reads that must wait for the device from the
/// volume's read ring, verified against the contexts planned when each
/// read started. Reads raced against writes of the same blocks and
/// against flushes that move the blocks home meanwhile: each returns the
/// block before or after the write it raced, never anything else (a
/// block that changed under a ring read fails its check and is read
/// again on a worker), in both layouts.
#[test]
fn direct_reads_from_the_ring_race_writes_and_commits_safely() {
    for layout in ["split", "packed"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let volume = dir.path().join("vol");
        let server = Server::start(
            dir.path(),
            &[
                s(&volume),
                "--create",
                "16MiB",
                "--layout",
                layout,
                "--direct",
                "--metrics",
                "127.0.0.1:0",
            ],
        );
        let result = py_json(
            r#"
h = connect(sys.argv[1])
blocks = 64
for lba in range(blocks):
    h.pwrite(block_data(lba, 0), lba * 4096)
h.flush()
# Home now: a plain read of every block comes from the ring.
first = all(h.pread(4096, lba * 4096) == block_data(lba, 0) for lba in range(blocks))
bad = []
reads = 0
for gen in range(1, 41):
    pending = []
    for lba in range(blocks):
        buf = nbd.Buffer(4096)
        if lba % 2:
            h.aio_pread(buf, lba * 4096)
            h.aio_pwrite(block_data(lba, gen), lba * 4096)
        else:
            h.aio_pwrite(block_data(lba, gen), lba * 4096)
            h.aio_pread(buf, lba * 4096)
        pending.append((lba, buf))
        if lba == blocks // 2:
            h.aio_flush()
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for lba, buf in pending:
        got = buf.to_bytearray()
        reads += 1
        if got != block_data(lba, gen - 1) and got != block_data(lba, gen):
            bad.append([gen, lba])
    if gen % 4 == 0:
        h.flush()
last = all(h.pread(4096, lba * 4096) == block_data(lba, 40) for lba in range(blocks))
print(json.dumps({"first": first, "bad": bad[:10], "reads": reads, "last": last}))
"#,
            &[&server.uri],
        );
        assert_eq!(result["first"], true, "{layout}: {result}");
        assert_eq!(result["bad"], serde_json::json!([]), "{layout}: {result}");
        assert_eq!(result["reads"], 40 * 64, "{layout}: {result}");
        assert_eq!(result["last"], true, "{layout}: {result}");
        let metrics = server.metrics_text();
        let answered = metric(
            &metrics,
            r#"vouch_nbd_ring_reads_total{outcome="answered",export="vol"}"#,
        );
        assert!(
            answered.unwrap_or(0.0) >= 64.0,
            "{layout}: reads from home were answered from the ring ({answered:?}):\n{metrics}"
        );
        drop(server);
        assert_check_clean(&volume);
    }
}
