//! `vouch serve` as a service: systemd socket activation (driven by the
//! real `systemd-socket-activate`), readiness notification seen by a
//! datagram socket of the test's own, --pid-file, host names and repeated
//! --listen, Unix-only serving, and every listener bound before anything
//! is announced.

mod common;

use std::io::Read as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::clients::*;
use common::*;

/// How long a notification may take to arrive.
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(30);

fn systemd_socket_activate() -> PathBuf {
    tool("systemd-socket-activate", "systemd")
}

fn create_volume(dir: &Path, size: &str) -> PathBuf {
    let volume = dir.join("vol");
    vouch_ok(&["create", s(&volume), "--size", size]);
    volume
}

/// `vouch serve ARGS --log info` as given (no `--listen` added, unlike
/// `Server::start`), with `env`, waiting for the lines `expect` names.
fn serve(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    expect: Expect,
) -> Result<Server, String> {
    let mut command = Command::new(vouch_bin());
    command.arg("serve").args(args).args(["--log", "info"]);
    for (name, value) in env {
        command.env(name, value);
    }
    let args = args.iter().map(|a| a.to_string()).collect();
    Server::launch(dir, command, args, expect)
}

/// A port free a moment ago (systemd-socket-activate cannot pick one).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// `systemd-socket-activate -l LISTEN... [--fdname NAMES] [-E VAR=VALUE...]
/// vouch serve ARGS`, returned once it listens. vouch itself starts only on
/// the first connection (it is exec'd in the same process, so the pid is
/// vouch's). `None` when a listen address was taken meanwhile.
fn activate(
    dir: &Path,
    listens: &[String],
    fdnames: Option<&str>,
    env: &[String],
    args: &[&str],
) -> Option<Server> {
    let mut command = Command::new(systemd_socket_activate());
    for listen in listens {
        command.args(["-l", listen]);
    }
    if let Some(names) = fdnames {
        command.arg(format!("--fdname={names}"));
    }
    for variable in env {
        command.args(["-E", variable]);
    }
    command
        .arg(vouch_bin())
        .arg("serve")
        .args(args)
        .args(["--log", "info"]);
    let args = args.iter().map(|a| a.to_string()).collect();
    let mut server =
        Server::launch(dir, command, args, Expect::default()).expect("launch activation");
    let mut exited = false;
    wait_until("systemd-socket-activate to listen", TIMEOUT, || {
        exited = !server.is_running();
        exited || server.log_text().matches("Listening on ").count() == listens.len()
    });
    if exited {
        let log = server.log_text();
        assert!(
            log.contains("in use"),
            "systemd-socket-activate failed:\n{log}"
        );
        return None;
    }
    Some(server)
}

/// `activate` on a free TCP port (retried if another process takes it
/// first); returns the server and its port.
fn activate_tcp(dir: &Path, fdnames: Option<&str>, env: &[String], args: &[&str]) -> (Server, u16) {
    for _ in 0..5 {
        let port = free_port();
        if let Some(server) = activate(dir, &[format!("127.0.0.1:{port}")], fdnames, env, args) {
            return (server, port);
        }
    }
    panic!("no free port for systemd-socket-activate after 5 tries");
}

/// A datagram socket the server is told to notify (`NOTIFY_SOCKET`): an
/// abstract name when `abstract_name` is set, else a file in `dir`.
fn notify_socket(dir: &Path, abstract_name: bool) -> (UnixDatagram, String) {
    let (socket, value) = if abstract_name {
        let name = format!(
            "vouch-test-notify-{}-{}",
            std::process::id(),
            dir.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default()
        );
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .expect("abstract address");
        (
            UnixDatagram::bind_addr(&address).expect("bind abstract"),
            format!("@{name}"),
        )
    } else {
        let path = dir.join("notify.sock");
        (
            UnixDatagram::bind(&path).expect("bind notify socket"),
            s(&path).to_string(),
        )
    };
    socket
        .set_read_timeout(Some(NOTIFY_TIMEOUT))
        .expect("read timeout");
    (socket, value)
}

fn next_notification(socket: &UnixDatagram) -> String {
    let mut buffer = [0u8; 4096];
    let len = socket
        .recv(&mut buffer)
        .unwrap_or_else(|e| panic!("no notification within {NOTIFY_TIMEOUT:?}: {e}"));
    String::from_utf8_lossy(&buffer[..len]).into_owned()
}

fn nothing_notified(socket: &UnixDatagram) -> Option<String> {
    socket.set_nonblocking(true).expect("nonblocking");
    let mut buffer = [0u8; 4096];
    socket
        .recv(&mut buffer)
        .ok()
        .map(|len| String::from_utf8_lossy(&buffer[..len]).into_owned())
}

fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    std::fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_socket())
}

/// systemd-socket-activate holds a TCP port and starts `vouch serve` on
/// the first connection with the socket as descriptor 3: vouch serves it
/// (binding nothing of its own), qemu-io writes and reads through it, the
/// readiness notification reaches an abstract NOTIFY_SOCKET, and SIGTERM
/// stops it cleanly with STOPPING=1.
#[test]
fn socket_activation_serves_the_passed_tcp_socket_to_a_real_client() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "16MiB");
    let (notify, notify_value) = notify_socket(dir.path(), true);
    let env = [format!("NOTIFY_SOCKET={notify_value}")];
    let (mut server, port) = activate_tcp(dir.path(), Some("nbd"), &env, &[s(&volume)]);
    let uri = format!("nbd://127.0.0.1:{port}");
    // The first connection waits in the socket's queue while vouch starts.
    qemu_io_ok(&uri, &["write -P 0x5a 0 64k", "write -P 0xa5 1M 4k"]);
    let ready = next_notification(&notify);
    assert_eq!(
        ready,
        format!("READY=1\nSTATUS=serving 1 export on {uri}"),
        "readiness"
    );
    server.wait_for_line(&format!("vouch: serving on {uri}"));
    let log = server.log_text();
    assert!(
        log.contains("socket activation: TCP") && log.contains("name=nbd"),
        "the passed socket and its name are not logged:\n{log}"
    );
    qemu_io_ok(&uri, &["read -P 0x5a 0 64k", "read -P 0xa5 1M 4k"]);
    server.stop();
    let stopping = next_notification(&notify);
    assert!(stopping.starts_with("STOPPING=1\n"), "{stopping:?}");
    assert_check_clean(&volume);
}

/// The same with a Unix socket: nbdinfo and qemu-io through it, and the
/// socket file, which belongs to the service manager, is left in place.
#[test]
fn socket_activation_serves_a_passed_unix_socket_and_leaves_its_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "16MiB");
    let socket = dir.path().join("activated.sock");
    let mut server = activate(
        dir.path(),
        &[s(&socket).to_string()],
        None,
        &[],
        &[s(&volume)],
    )
    .expect("a Unix socket path cannot be taken");
    let uri = format!("nbd+unix:///?socket={}", s(&socket));
    let info = nbdinfo_json(&uri, &[]);
    assert_eq!(info["exports"][0]["export-size"], 16 << 20, "{info}");
    qemu_io_ok(&uri, &["write -P 0x77 8k 12k", "read -P 0x77 8k 12k"]);
    server.wait_for_line(&format!("vouch: serving on {uri}"));
    assert!(
        !server
            .printed
            .iter()
            .any(|l| l.starts_with("vouch: serving on nbd://")),
        "an activated server bound TCP too: {:?}",
        server.printed
    );
    server.stop();
    assert!(
        is_socket(&socket),
        "vouch removed the service manager's socket file"
    );
    assert_check_clean(&volume);
}

/// Under socket activation the service manager decides the addresses: a
/// --socket (or --listen) given as well is refused with a reason.
#[test]
fn socket_activation_refuses_listeners_of_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "8MiB");
    let socket = dir.path().join("activated.sock");
    let own = dir.path().join("own.sock");
    let mut server = activate(
        dir.path(),
        &[s(&socket).to_string()],
        None,
        &[],
        &[s(&volume), "--socket", s(&own)],
    )
    .expect("a Unix socket path cannot be taken");
    // The first connection starts vouch, which refuses to run.
    let _ = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
    let status = server.reap(STOP_TIMEOUT);
    assert_eq!(status.code(), Some(2), "{}", server.log_text());
    let log = server.log_text();
    assert!(
        log.contains("cannot be combined with socket activation"),
        "{log}"
    );
    assert!(!own.exists(), "its own socket was bound anyway");
}

/// Without socket activation: READY=1 arrives only once the announced
/// port accepts connections (a connection made right then gets the NBD
/// greeting), and SIGTERM sends STOPPING=1 before the clean exit.
#[test]
fn readiness_comes_once_the_port_accepts_and_stopping_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "8MiB");
    let (notify, notify_value) = notify_socket(dir.path(), false);
    let mut server = serve(
        dir.path(),
        &[s(&volume), "--listen", "127.0.0.1:0"],
        &[("NOTIFY_SOCKET", &notify_value)],
        Expect::default(),
    )
    .expect("launch");
    let ready = next_notification(&notify);
    let status = ready
        .strip_prefix("READY=1\nSTATUS=serving 1 export on nbd://")
        .unwrap_or_else(|| panic!("unexpected first notification {ready:?}"));
    let addr: SocketAddr = status.parse().expect("address in STATUS");
    let mut stream = TcpStream::connect(addr).expect("the port accepts once READY=1 is sent");
    stream
        .set_read_timeout(Some(NOTIFY_TIMEOUT))
        .expect("timeout");
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic).expect("greeting");
    assert_eq!(&magic, b"NBDMAGIC");
    drop(stream);
    server.wait_for_line(&format!("vouch: serving on nbd://{addr}"));
    server.stop();
    let stopping = next_notification(&notify);
    assert!(
        stopping.starts_with("STOPPING=1\nSTATUS=stopping"),
        "{stopping:?}"
    );
}

/// --pid-file holds the server's pid once it serves and is gone after a
/// clean stop, with no temporary file left beside it.
#[test]
fn the_pid_file_is_written_once_serving_and_removed_on_a_clean_stop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "8MiB");
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).expect("mkdir");
    let pid_file = run_dir.join("vouch.pid");
    let mut server = Server::start(dir.path(), &[s(&volume), "--pid-file", s(&pid_file)]);
    let contents = std::fs::read_to_string(&pid_file).expect("the pid file exists once serving");
    assert_eq!(contents, format!("{}\n", server.pid));
    server.stop();
    assert!(!pid_file.exists(), "the pid file outlived a clean stop");
    let left: Vec<_> = std::fs::read_dir(&run_dir).expect("ls").collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// --listen takes host names and may be repeated: `localhost` and `[::1]`
/// are both served, each reached by a real client.
#[test]
fn listen_takes_host_names_and_repeats_for_ipv4_and_ipv6() {
    // IPv6 loopback must work for this test; it does on the CI machines.
    TcpListener::bind("[::1]:0").expect("IPv6 loopback ([::1]) is not usable here");
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "8MiB");
    let expect = Expect {
        tcp: true,
        ..Expect::default()
    };
    let args = [s(&volume), "--listen", "localhost:0", "--listen", "[::1]:0"];
    let mut server = serve(dir.path(), &args, &[], expect).expect("start");
    let v4 = server.wait_for_line("vouch: serving on nbd://127.0.0.1:");
    let v6 = server.wait_for_line("vouch: serving on nbd://[::1]:");
    for line in [v4, v6] {
        let uri = line.trim_start_matches("vouch: serving on ");
        let info = nbdinfo_json(uri, &[]);
        assert_eq!(info["exports"][0]["export-size"], 8 << 20, "{uri}: {info}");
    }
    server.stop();
}

/// --socket alone serves only the Unix socket: it starts while the
/// default TCP port is taken, a second server on the same socket is
/// refused while the first runs, and the file is removed on a clean stop
/// (a killed server's stale file is replaced by the next start).
#[test]
fn socket_alone_binds_no_tcp_and_its_file_goes_on_a_clean_stop() {
    // Hold the default port (or find it held already): a server that still
    // bound it by default could not start.
    let _default_port = TcpListener::bind("127.0.0.1:10809");
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "8MiB");
    let other = dir.path().join("other");
    vouch_ok(&["create", s(&other), "--size", "8MiB"]);
    let socket = dir.path().join("nbd.sock");
    let expect = Expect {
        unix: true,
        ..Expect::default()
    };
    let start = |volume: &Path| {
        serve(
            dir.path(),
            &[s(volume), "--socket", s(&socket)],
            &[],
            expect,
        )
    };
    let mut server = start(&volume).expect("--socket alone starts with 10809 taken");
    assert_eq!(
        server.printed,
        [format!(
            "vouch: serving on nbd+unix:///?socket={}",
            s(&socket)
        )],
        "--socket alone announced more than its socket"
    );
    let uri = format!("nbd+unix:///?socket={}", s(&socket));
    qemu_io_ok(&uri, &["write -P 0x31 0 4k", "read -P 0x31 0 4k"]);

    let refused = start(&other)
        .err()
        .expect("a second server took a live socket over");
    assert!(refused.contains("another server is listening"), "{refused}");
    qemu_io_ok(&uri, &["read -P 0x31 0 4k"]);

    server.stop();
    assert!(!socket.exists(), "the socket file outlived a clean stop");

    let mut crashed = start(&volume).expect("restart");
    crashed.kill9();
    assert!(is_socket(&socket), "a killed server leaves its socket file");
    let mut again = start(&volume).expect("a stale socket file is replaced");
    qemu_io_ok(&uri, &["read -P 0x31 0 4k"]);
    again.stop();
    assert!(!socket.exists());
}

/// A busy --metrics, --control or --listen address fails the start before
/// anything is announced: non-zero exit, nothing on stdout, an error
/// naming the address, no socket or pid file left, no READY=1; and the
/// volume serves normally afterwards.
#[test]
fn a_busy_port_fails_the_start_before_anything_is_announced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = create_volume(dir.path(), "8MiB");
    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy_addr = busy.local_addr().expect("addr").to_string();
    let socket = dir.path().join("nbd.sock");
    let control_socket = dir.path().join("control.sock");
    let pid_file = dir.path().join("vouch.pid");
    let (notify, notify_value) = notify_socket(dir.path(), false);
    let unwritable_pid_file = dir.path().join("no-such-dir").join("vouch.pid");
    let busy_error = format!("cannot listen on {busy_addr}");
    let cases: [(&[&str], String); 4] = [
        (
            &["--metrics", &busy_addr, "--pid-file", s(&pid_file)],
            format!("{busy_error} for --metrics"),
        ),
        (
            &["--control", &busy_addr, "--pid-file", s(&pid_file)],
            format!("{busy_error} for --control"),
        ),
        (
            &["--listen", &busy_addr, "--pid-file", s(&pid_file)],
            busy_error.clone(),
        ),
        // Everything binds; the pid file, the last step before the
        // announcement, fails: every socket file goes again.
        (
            &[
                "--control",
                s(&control_socket),
                "--metrics",
                "127.0.0.1:0",
                "--pid-file",
                s(&unwritable_pid_file),
            ],
            format!("writing --pid-file {}", s(&unwritable_pid_file)),
        ),
    ];
    for (extra, error) in cases {
        let output = run(Command::new(vouch_bin())
            .arg("serve")
            .arg(&volume)
            .args(["--socket", s(&socket)])
            .args(extra)
            .env("NOTIFY_SOCKET", &notify_value));
        let all = text(&output);
        assert!(
            !output.status.success(),
            "{extra:?}: started anyway:\n{all}"
        );
        assert!(
            output.stdout.is_empty(),
            "{extra:?}: announced before failing:\n{all}"
        );
        assert!(
            String::from_utf8_lossy(&output.stderr).contains(&error),
            "{extra:?}: the error does not say {error:?}:\n{all}"
        );
        assert!(
            !socket.exists(),
            "{extra:?}: the NBD socket file was left behind"
        );
        assert!(
            !control_socket.exists(),
            "{extra:?}: the control socket file was left behind"
        );
        assert!(!pid_file.exists(), "{extra:?}: a pid file was written");
        assert_eq!(nothing_notified(&notify), None, "{extra:?}: notified");
        notify.set_nonblocking(false).expect("blocking");
    }
    drop(busy);
    let mut server = Server::start(dir.path(), &[s(&volume)]);
    qemu_io_ok(&server.uri, &["write -P 0x42 0 4k", "read -P 0x42 0 4k"]);
    server.stop();
    assert_check_clean(&volume);
}
