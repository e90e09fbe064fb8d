//! `serve --tls-ca`: the NBD port admits only clients whose certificate the
//! CA signed (qemu-nbd's verify-peer=on). Real clients: libnbd (nbdinfo and
//! the Python bindings) and qemu-img with a tls-creds-x509 object. The
//! server's certificate has a 2432-bit RSA key, the size of the NBD
//! reference project's test keys (ring could not load it; aws-lc-rs can).
//! A client with no certificate, one from another CA, or a self-signed one
//! is refused and the server logs why.

mod common;

use std::process::Command;

use common::clients::{nbdinfo, qemu_img};
use common::pki::{cert_dir, make_ca, make_leaf, make_leaf_with_key, make_self_signed};
use common::*;

const WRITE_READ: &str = r#"
uri, cadir = sys.argv[1], sys.argv[2]
out = {}
try:
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(cadir)
    h.set_tls_verify_peer(True)
    h.connect_uri(uri)
    h.pwrite(block_data(5, 55), 5 * 4096)
    h.flush()
    out["read_back"] = h.pread(4096, 5 * 4096) == block_data(5, 55)
except nbd.Error as e:
    out["error"] = err_info(e)
print(json.dumps(out))
"#;

#[test]
fn tls_ca_admits_only_clients_the_ca_signed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let ca = make_ca(d, "ca");
    let other_ca = make_ca(d, "other-ca");
    let server_cert = make_leaf_with_key(d, "server", &ca, "serverAuth", "rsa:2432");
    let client = make_leaf(d, "client", &ca, "clientAuth");
    let stranger = make_leaf(d, "stranger", &other_ca, "clientAuth");
    let self_signed = make_self_signed(d, "self", "clientAuth");
    let good = cert_dir(d, "pki-good", &ca.0, Some(&client));
    let none = cert_dir(d, "pki-none", &ca.0, None);
    let foreign = cert_dir(d, "pki-foreign", &ca.0, Some(&stranger));
    let own = cert_dir(d, "pki-self", &ca.0, Some(&self_signed));

    let volume = d.join("vol");
    let mut server = Server::start(
        d,
        &[
            s(&volume),
            "--create",
            "4MiB",
            "--tls-cert",
            s(&server_cert.0),
            "--tls-key",
            s(&server_cert.1),
            "--tls-ca",
            s(&ca.0),
        ],
    );
    let port = server.addr.port();
    let uri = format!("nbds://localhost:{port}");

    // libnbd with a certificate the CA signed: I/O works.
    let result = py_json(WRITE_READ, &[&uri, s(&good)]);
    assert_eq!(result["read_back"], true, "{result}");
    let json =
        common::clients::nbdinfo_json(&format!("{uri}/?tls-certificates={}", good.display()), &[]);
    assert_eq!(json["TLS"], true, "{json}");
    assert_eq!(json["exports"][0]["export-size"], 4 << 20, "{json}");

    // qemu-img with the same credentials.
    let output = run_ok(Command::new(qemu_img()).args([
        "info",
        "--output=json",
        "--object",
        &format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            good.display()
        ),
        "--image-opts",
        &format!("driver=nbd,host=localhost,port={port},tls-creds=tls0"),
    ]));
    let info: serde_json::Value = serde_json::from_slice(&output.stdout).expect("qemu-img json");
    assert_eq!(info["virtual-size"], 4 << 20, "{info}");

    // Refused: no client certificate, another CA's, a self-signed one.
    let refused_before = server.log_text().matches("TLS client refused").count();
    for (what, certs) in [
        ("no client certificate", &none),
        ("another CA's certificate", &foreign),
        ("a self-signed certificate", &own),
    ] {
        let output = run(
            Command::new(nbdinfo()).arg(format!("{uri}/?tls-certificates={}", certs.display()))
        );
        assert!(
            !output.status.success(),
            "{what}: nbdinfo was admitted:\n{}",
            text(&output)
        );
        let result = py_json(WRITE_READ, &[&uri, s(certs)]);
        assert!(result["error"].is_object(), "{what}: {result}");
    }
    let output = run(Command::new(qemu_img()).args([
        "info",
        "--object",
        &format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            foreign.display()
        ),
        "--image-opts",
        &format!("driver=nbd,host=localhost,port={port},tls-creds=tls0"),
    ]));
    assert!(
        !output.status.success(),
        "qemu-img with another CA's certificate was admitted:\n{}",
        text(&output)
    );
    // gnutls (libnbd, qemu) offers only a certificate from a CA the server
    // names in its request, so the foreign and self-signed clients end as
    // "no certificates" too; rustls clients get "UnknownIssuer".
    wait_until("the refusals are logged", TIMEOUT, || {
        let log = server.log_text();
        log.matches("TLS client refused").count() >= refused_before + 3
            && log.contains("peer sent no certificates")
    });

    // The data written by the admitted client is intact.
    let result = py_json(
        r#"
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates(sys.argv[2])
h.connect_uri(sys.argv[1])
print(json.dumps({"same": h.pread(4096, 5 * 4096) == block_data(5, 55)}))
"#,
        &[&uri, s(&good)],
    );
    assert_eq!(result["same"], true, "{result}");
    server.stop();
}

/// A CA file that holds no certificate, and a key that does not match the
/// certificate: `serve` refuses to start and says which file.
#[test]
fn tls_ca_errors_name_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let ca = make_ca(d, "ca");
    let server_cert = make_leaf(d, "server", &ca, "serverAuth");
    let other = make_leaf(d, "other", &ca, "serverAuth");
    let empty = d.join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").expect("write");
    let volume = d.join("vol");
    vouch_ok(&["create", s(&volume), "--size", "1M"]);
    let error = Server::try_start(
        d,
        &[
            s(&volume),
            "--tls-cert",
            s(&server_cert.0),
            "--tls-key",
            s(&server_cert.1),
            "--tls-ca",
            s(&empty),
        ],
    )
    .err()
    .expect("an empty CA file must be refused");
    assert!(
        error.contains("no certificate found in") && error.contains("empty.pem"),
        "{error}"
    );
    let error = Server::try_start(
        d,
        &[
            s(&volume),
            "--tls-cert",
            s(&server_cert.0),
            "--tls-key",
            s(&other.1),
        ],
    )
    .err()
    .expect("a key that does not match must be refused");
    assert!(error.to_lowercase().contains("key"), "{error}");
}
