//! TLS: STARTTLS with a self-signed certificate (generated with the openssl
//! CLI), FORCEDTLS refusing plaintext, and optional TLS.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::{python, require_tool, run, run_ok, TestOptions, TestServer, EXPORT_SIZE};

/// Self-signed certificate for localhost/127.0.0.1, written as ca-cert.pem
/// (what libnbd/gnutls loads from a tls-certificates directory).
fn make_certificate(dir: &Path) -> Arc<rustls::ServerConfig> {
    require_tool("openssl", "openssl");
    let key = dir.join("server-key.pem");
    let cert = dir.join("ca-cert.pem");
    run_ok(Command::new("openssl").args([
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=localhost",
        "-addext",
        "subjectAltName=DNS:localhost,IP:127.0.0.1",
        "-keyout",
        key.to_str().unwrap(),
        "-out",
        cert.to_str().unwrap(),
    ]));
    vouch_nbd::tls::server_config_from_pem_files(&cert, &key).expect("load TLS config")
}

#[test]
fn forced_tls_serves_tls_clients_and_refuses_plaintext() {
    require_tool("nbdinfo", "libnbd-bin");
    let dir = tempfile::tempdir().unwrap();
    let tls = make_certificate(dir.path());
    let server = TestServer::start(TestOptions {
        tls: Some(tls),
        tls_required: true,
        ..TestOptions::default()
    });
    let certs = dir.path().display().to_string();
    let uri = format!(
        "nbds://localhost:{}/disk?tls-certificates={certs}",
        server.port
    );
    let json = run_ok(Command::new("nbdinfo").args(["--json", &uri]));
    assert!(json.contains("\"TLS\": true"), "{json}");
    assert!(
        json.contains(&format!("\"export-size\": {EXPORT_SIZE}")),
        "{json}"
    );

    // Plaintext client: refused (libnbd reports that the server requires TLS).
    let output = run(
        Command::new("nbdinfo").args(["--size", &server.uri()]),
        None,
    );
    assert!(!output.status.success(), "plaintext client must be refused");

    let body = format!(
        r#"
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates("{certs}")
h.set_export_name("disk")
h.add_meta_context("base:allocation")
h.connect_tcp("localhost", str(PORT))
assert h.get_tls_negotiated()
h.pwrite(b"\x5c" * 65536, 0, nbd.CMD_FLAG_FUA)
assert h.pread(65536, 0) == b"\x5c" * 65536
h.flush()
seen = []
h.block_status(1048576, 0, lambda ctx, off, entries, err: seen.append(list(entries)) or 0)
assert seen[0][:2] == [65536, 0], seen
big = bytes(range(256)) * 4096
h.pwrite(big, 1048576)
assert h.pread(len(big), 1048576) == big
h.shutdown()

# Plaintext raw client: every option but STARTTLS gets NBD_REP_ERR_TLS_REQD.
import socket, struct
sock = socket.create_connection(("127.0.0.1", PORT)); sock.settimeout(5)
def recv(n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data)); assert chunk, "closed"; data += chunk
    return data
assert recv(18)[:16] == b"NBDMAGICIHAVEOPT"
sock.sendall(struct.pack(">I", 3))
for option, data in ((3, b""), (7, struct.pack(">I", 4) + b"disk" + struct.pack(">H", 0)), (6, struct.pack(">I", 0) + struct.pack(">H", 0))):
    sock.sendall(struct.pack(">QII", 0x49484156454F5054, option, len(data)) + data)
    magic, opt, rtype, length = struct.unpack(">QIII", recv(20)); recv(length)
    assert (opt, rtype) == (option, 0x80000005), (opt, hex(rtype))
# EXPORT_NAME before TLS cannot be refused politely: the server hangs up.
sock.sendall(struct.pack(">QII", 0x49484156454F5054, 1, 4) + b"disk")
assert sock.recv(100) == b""
print("ok")
"#
    );
    assert_eq!(python(&server, &body).trim(), "ok");
    assert_eq!(server.export.contents(0..4), vec![0x5c; 4]);
}

#[test]
fn optional_tls_allows_both() {
    require_tool("nbdinfo", "libnbd-bin");
    let dir = tempfile::tempdir().unwrap();
    let tls = make_certificate(dir.path());
    let server = TestServer::start(TestOptions {
        tls: Some(tls),
        tls_required: false,
        ..TestOptions::default()
    });
    let certs = dir.path().display().to_string();
    let plain = run_ok(Command::new("nbdinfo").args(["--json", &server.uri()]));
    assert!(plain.contains("\"TLS\": false"), "{plain}");
    let uri = format!(
        "nbds://localhost:{}/disk?tls-certificates={certs}",
        server.port
    );
    let secure = run_ok(Command::new("nbdinfo").args(["--json", &uri]));
    assert!(secure.contains("\"TLS\": true"), "{secure}");
    // A client that does not trust our certificate fails the TLS handshake.
    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("ca-cert.pem"), "").unwrap();
    let untrusted = format!(
        "nbds://localhost:{}/disk?tls-certificates={}",
        server.port,
        empty.path().display()
    );
    let output = run(Command::new("nbdinfo").args(["--size", &untrusted]), None);
    assert!(!output.status.success());
    // The server is still fine afterwards.
    run_ok(Command::new("nbdinfo").args(["--size", &uri]));
}
