//! The control API over TLS with client certificates (openssl makes a CA,
//! a server and two client certificates): it guards a non-loopback
//! address; the CLI with a certificate from the CA gets in, without one
//! or with another CA's it does not.

mod common;

use common::pki::{make_ca, make_leaf};
use common::*;

#[test]
fn tls_client_certificates_guard_the_control_api() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let ca = make_ca(d, "ca");
    let other_ca = make_ca(d, "other-ca");
    let server_cert = make_leaf(d, "server", &ca, "serverAuth");
    let client = make_leaf(d, "client", &ca, "clientAuth");
    let stranger = make_leaf(d, "stranger", &other_ca, "clientAuth");
    let volume = d.join("v");
    vouch_ok(&["create", s(&volume), "--size", "1M"]);

    // TLS without client certificates does not guard a non-loopback address.
    let error = Server::try_start(
        d,
        &[
            s(&volume),
            "--control",
            "0.0.0.0:0",
            "--control-tls-cert",
            s(&server_cert.0),
            "--control-tls-key",
            s(&server_cert.1),
        ],
    )
    .err()
    .expect("refused");
    assert!(error.contains("not a loopback address"), "{error}");

    let server = Server::start(
        d,
        &[
            s(&volume),
            "--control",
            "0.0.0.0:0",
            "--control-tls-cert",
            s(&server_cert.0),
            "--control-tls-key",
            s(&server_cert.1),
            "--control-tls-client-ca",
            s(&ca.0),
        ],
    );
    let printed = server.control.clone().expect("control");
    let port = printed
        .strip_prefix("https://0.0.0.0:")
        .expect("https address");
    let url = format!("https://127.0.0.1:{port}");
    let verify = |extra: &[&str]| {
        let mut args = vec![
            "verify",
            "v",
            "--json",
            "--server",
            url.as_str(),
            "--tls-ca",
            s(&ca.0),
        ];
        args.extend_from_slice(extra);
        vouch(&args)
    };
    let output = verify(&["--tls-cert", s(&client.0), "--tls-key", s(&client.1)]);
    assert!(output.status.success(), "{}", text(&output));
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(result["blocks"], 256);
    for extra in [
        vec![],
        vec!["--tls-cert", s(&stranger.0), "--tls-key", s(&stranger.1)],
    ] {
        let output = verify(&extra);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{extra:?}: {}",
            text(&output)
        );
    }
    // Plain HTTP to a TLS port gets no answer that a client could take for one.
    let output = vouch(&[
        "verify",
        "v",
        "--server",
        &format!("http://127.0.0.1:{port}"),
    ]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
}
