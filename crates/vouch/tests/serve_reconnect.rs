//! qemu's own NBD client across a crash of the server (issue 29): qemu-io
//! with `reconnect-delay` writes patterns of mixed sizes without a flush;
//! the server is killed with SIGKILL once it answered them, and started
//! again on the same port; qemu reconnects, its flush succeeds on the new
//! connection, and every pattern reads back. Before the held log the
//! writes still in the write-back buffer came back as what was there
//! before ("Pattern verification failed"), and the guest above never knew.

mod common;

use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};

use common::*;

/// A port on 127.0.0.1 that nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind a free port")
        .port()
}

fn serve_on(dir: &std::path::Path, volume: &std::path::Path, port: u16, create: bool) -> Server {
    let mut args = vec![volume.display().to_string()];
    if create {
        args.extend(["--create".into(), "64MiB".into()]);
    }
    args.extend([
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--metrics".into(),
        "127.0.0.1:0".into(),
        "--log".into(),
        "info".into(),
        // Unflushed writes stay in the held log until the kill (without
        // it, commits follow the writes and may have taken them): what
        // these tests crash and damage is the held log.
        "--commit-at-limit".into(),
    ]);
    let mut command = Command::new(vouch_bin());
    command.arg("serve").args(&args);
    let expect = Expect {
        tcp: true,
        metrics: true,
        ..Expect::default()
    };
    Server::launch(dir, command, args, expect).unwrap_or_else(|error| panic!("{error}"))
}

fn answered(server: &Server, command: &str) -> f64 {
    let series = format!(r#"vouch_nbd_requests_total{{command="{command}",export="vol"}}"#);
    metric(&server.metrics_text(), &series).unwrap_or(0.0)
}

/// Give qemu-io one command and wait until the server answered one more
/// `command` request: qemu-io takes the next line of its input only after
/// the previous one, so each is sent alone.
fn run(stdin: &mut impl std::io::Write, server: &Server, line: &str, command: &str) {
    let before = answered(server, command);
    writeln!(stdin, "{line}").expect("qemu-io stdin");
    stdin.flush().expect("qemu-io stdin");
    wait_until(&format!("qemu-io's {line:?} answered"), TIMEOUT, || {
        answered(server, command) > before
    });
}

/// (offset, length, pattern byte) of the writes, none flushed.
const WRITES: &[(u64, u64, u8)] = &[
    (0, 1 << 20, 0xab),
    (3 << 20, 4096, 0x11),
    (5 << 20, 64 << 10, 0x22),
    (8 << 20, 512 << 10, 0x33),
    (20 << 20, 4 << 20, 0x44),
    (40 << 20, 12 << 10, 0x55),
    // Over the first write in part: the newer pattern must win.
    (512 << 10, 8192, 0x66),
];

#[test]
fn qemu_reconnects_after_a_sigkill_and_reads_every_acknowledged_write() {
    let qemu_io = tool("qemu-io", "qemu-utils");
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let port = free_port();
    let mut server = serve_on(dir.path(), &volume, port, true);
    let image = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export=vol,reconnect-delay=30"
    );
    let mut child = Command::new(&qemu_io)
        .args(["-t", "none", "--image-opts", &image])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn qemu-io");
    let mut stdin = child.stdin.take().expect("stdin");
    for (offset, length, pattern) in WRITES {
        let line = format!("write -P {pattern:#x} {offset} {length}");
        run(&mut stdin, &server, &line, "write");
    }
    // Every write answered (acknowledged to qemu), none flushed: the crash.
    assert_eq!(answered(&server, "flush"), 0.0, "qemu flushed on its own");
    server.kill9();
    let server = serve_on(dir.path(), &volume, port, false);
    // qemu reconnects on its own (within its reconnect-delay).
    run(&mut stdin, &server, "flush", "flush");
    for (offset, length, pattern) in WRITES {
        // The first write's bytes under the last one read the last one's.
        let (offset, length) = if *offset == 0 {
            (0u64, 512u64 << 10)
        } else {
            (*offset, *length)
        };
        let line = format!("read -P {pattern:#x} {offset} {length}");
        run(&mut stdin, &server, &line, "read");
    }
    run(
        &mut stdin,
        &server,
        &format!("read -P 0x66 {} 8192", 512 << 10),
        "read",
    );
    writeln!(stdin, "quit").expect("qemu-io stdin");
    drop(stdin);
    let Some(status) = wait_timeout(&mut child, TIMEOUT) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("qemu-io did not finish: it never reconnected");
    };
    let mut out = String::new();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read>),
    ]
    .into_iter()
    .flatten()
    {
        let mut stream = stream;
        stream.read_to_string(&mut out).expect("qemu-io output");
    }
    assert!(status.success(), "qemu-io failed:\n{out}");
    assert!(
        !out.contains("Pattern verification failed") && !out.contains("error"),
        "an acknowledged write was lost across the server's SIGKILL:\n{out}\nserver log:\n{}",
        server.log_text()
    );
    assert_eq!(
        out.matches("read ").count(),
        WRITES.len() + 1,
        "every read answered:\n{out}"
    );
    assert!(
        server.log_text().contains("put back from its held log"),
        "the restarted server did not replay the held log:\n{}",
        server.log_text()
    );
    drop(server);
    assert_check_clean(&volume);
}
