//! Test certificates made with the openssl CLI: CAs, leaves they sign
//! (server or client), and self-signed leaves.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{run_ok, s, tool};

/// (certificate, key) PEM files.
pub type Pair = (PathBuf, PathBuf);

fn openssl(args: &[&str]) {
    run_ok(Command::new(tool("openssl", "openssl")).args(args));
}

/// A self-signed certificate with a 2048-bit RSA key, `subject` and any
/// `-addext` extensions.
fn self_signed(dir: &Path, name: &str, subject: &str, extensions: &[&str]) -> Pair {
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}.key"));
    let mut args = vec![
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        s(&key),
        "-out",
        s(&cert),
        "-days",
        "1",
        "-subj",
        subject,
    ];
    for extension in extensions {
        args.extend(["-addext", extension]);
    }
    openssl(&args);
    (cert, key)
}

/// A CA: (certificate, key).
pub fn make_ca(dir: &Path, name: &str) -> Pair {
    self_signed(dir, name, &format!("/CN={name}"), &[])
}

/// A leaf with a 2048-bit RSA key signed by `ca`, for `usage` serverAuth
/// or clientAuth, valid for localhost and 127.0.0.1.
pub fn make_leaf(dir: &Path, name: &str, ca: &Pair, usage: &str) -> Pair {
    make_leaf_with_key(dir, name, ca, usage, "rsa:2048")
}

/// `make_leaf` with an openssl `-newkey` argument (e.g. `rsa:2432`).
pub fn make_leaf_with_key(dir: &Path, name: &str, ca: &Pair, usage: &str, newkey: &str) -> Pair {
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}.key"));
    let csr = dir.join(format!("{name}.csr"));
    let ext = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        format!("basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"),
    )
    .expect("ext");
    openssl(&[
        "req",
        "-newkey",
        newkey,
        "-nodes",
        "-keyout",
        s(&key),
        "-out",
        s(&csr),
        "-subj",
        &format!("/CN={name}"),
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        s(&csr),
        "-CA",
        s(&ca.0),
        "-CAkey",
        s(&ca.1),
        "-CAcreateserial",
        "-out",
        s(&cert),
        "-days",
        "1",
        "-extfile",
        s(&ext),
    ]);
    (cert, key)
}

/// A self-signed leaf (its own issuer), for `usage`, valid for localhost
/// and 127.0.0.1.
pub fn make_self_signed(dir: &Path, name: &str, usage: &str) -> Pair {
    self_signed(
        dir,
        name,
        "/CN=localhost",
        &[
            &format!("extendedKeyUsage={usage}"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
    )
}

/// A libnbd / qemu certificate directory: `ca-cert.pem` (the CA to verify
/// the server with) and, with `client`, `client-cert.pem` and
/// `client-key.pem` (what both present as their client certificate).
pub fn cert_dir(dir: &Path, name: &str, ca: &Path, client: Option<&Pair>) -> PathBuf {
    let out = dir.join(name);
    std::fs::create_dir(&out).expect("certificate dir");
    std::fs::copy(ca, out.join("ca-cert.pem")).expect("copy CA");
    if let Some((cert, key)) = client {
        std::fs::copy(cert, out.join("client-cert.pem")).expect("copy client cert");
        std::fs::copy(key, out.join("client-key.pem")).expect("copy client key");
    }
    out
}
