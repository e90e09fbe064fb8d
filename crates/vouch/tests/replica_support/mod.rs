//! Fixtures for the remote-replica tests: a `vouch replica serve` process
//! (optionally inside a network namespace), an exporter (`vouch serve`)
//! inside a namespace, and a pair of namespaces joined by a veth pair that
//! is removed on drop, even when the test panics.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::{
    python, run_timeout, s, text, tool, vouch_bin, wait_timeout, PY_PRELUDE, STOP_TIMEOUT, TIMEOUT,
};

/// How long a server may take to print its listening line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A child process started by a test, killed by its pid on drop.
pub struct Process {
    pub child: Option<Child>,
    pub pid: u32,
    pub log: PathBuf,
    /// The address it printed (`HOST:PORT`).
    pub addr: String,
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) on the pid of a child this test spawned and has not
    // reaped (the `Child` is still held).
    unsafe {
        libc::kill(pid as i32, signal);
    }
}

impl Process {
    /// Spawn `command` (stderr to `log`), wait for a stdout line starting
    /// with `prefix`, and take the address after `on ` from it.
    fn start(mut command: Command, log: PathBuf, prefix: &str) -> Result<Process, String> {
        let log_file = std::fs::File::create(&log).expect("create log");
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .map_err(|error| format!("spawn {command:?}: {error}"))?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("stdout");
        let (sender, receiver) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut process = Process {
            child: Some(child),
            pid,
            log,
            addr: String::new(),
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match receiver.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => {
                    let after = line.split(" on ").nth(1).expect("an address");
                    let addr = after.split_whitespace().next().expect("address");
                    process.addr = addr.trim_start_matches("nbd://").to_string();
                    return Ok(process);
                }
                Ok(_) => {}
                Err(_) => {
                    let status = process.reap(STOP_TIMEOUT);
                    return Err(format!(
                        "{command:?} not ready ({status:?}):\n{}",
                        process.log_text()
                    ));
                }
            }
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if self.child.is_some() {
            signal(self.pid, libc::SIGKILL);
            self.reap(STOP_TIMEOUT);
        }
    }

    /// Send `signal` (SIGSTOP, SIGCONT: a replica that stops reading).
    pub fn send_signal(&self, signal_number: i32) {
        assert!(self.child.is_some(), "a signal to a reaped process");
        signal(self.pid, signal_number);
    }

    /// SIGTERM, then wait (bounded) for it to exit; SIGKILL if it does not.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_ref()?;
        signal(self.pid, libc::SIGTERM);
        self.reap(STOP_TIMEOUT)
    }

    fn reap(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let status = wait_timeout(&mut child, timeout);
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        status
    }

    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Connect to the replica server at `addr` and shake hands as an
/// exporter would: hellos, then the answer to its challenge (proving
/// `secret` when given). `Err` with the reason when the server refuses or
/// closes.
pub fn replica_handshake(
    addr: &str,
    secret: Option<&vouch_replica::auth::Secret>,
) -> Result<std::net::TcpStream, String> {
    use std::io::{Read, Write};
    use vouch_replica::auth;
    use vouch_replica::wire::{Hello, HELLO_BYTES, HELLO_OK, PROTOCOL_VERSION};
    let mut stream = std::net::TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    let hello = Hello {
        version: PROTOCOL_VERSION,
        status: HELLO_OK,
    };
    stream
        .write_all(&hello.encode())
        .map_err(|e| format!("hello: {e}"))?;
    let mut opening = [0u8; HELLO_BYTES + auth::CHALLENGE_BYTES];
    stream
        .read_exact(&mut opening)
        .map_err(|e| format!("the server's hello and challenge: {e}"))?;
    let challenge = auth::Challenge::decode(opening[HELLO_BYTES..].try_into().expect("40"))?;
    let nonce = auth::nonce();
    let response = match secret {
        Some(secret) => auth::Response {
            flags: auth::HAS_PROOF,
            nonce,
            proof: secret.client_proof(&challenge.nonce, &nonce),
        },
        None => auth::Response {
            flags: 0,
            nonce,
            proof: [0; auth::PROOF_BYTES],
        },
    };
    stream
        .write_all(&response.encode())
        .map_err(|e| format!("response: {e}"))?;
    let mut verdict = [0u8; auth::VERDICT_BYTES];
    stream
        .read_exact(&mut verdict)
        .map_err(|e| format!("verdict: {e}"))?;
    let verdict = auth::Verdict::decode(&verdict)?;
    if verdict.status != auth::ACCEPTED {
        return Err("refused".into());
    }
    Ok(stream)
}

/// Set socket option `name` (level `SOL_SOCKET`) of `stream` to `value`.
pub fn set_socket_option<T>(stream: &std::net::TcpStream, name: libc::c_int, value: &T) {
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt(2) on a socket the caller owns, with a pointer
    // to a live `T` and its size.
    let result = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            value as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    assert_eq!(
        result,
        0,
        "setsockopt {name}: {}",
        std::io::Error::last_os_error()
    );
}

/// `command` run inside namespace `netns` (or as it is with `None`).
pub fn in_netns(netns: Option<&str>, program: &Path) -> Command {
    match netns {
        Some(name) => {
            let mut command = Command::new(tool("ip", "iproute2"));
            command.args(["netns", "exec", name]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// `vouch replica serve DIR --listen LISTEN EXTRA...` (in `netns`).
pub fn replica_server(
    dir: &Path,
    listen: &str,
    extra: &[&str],
    netns: Option<&str>,
) -> Result<Process, String> {
    let mut command = in_netns(netns, Path::new(vouch_bin()));
    command
        .args([
            "replica",
            "serve",
            s(dir),
            "--listen",
            listen,
            "--log",
            "info",
        ])
        .args(extra);
    let log = dir.with_extension(format!("replica-{}.log", listen.replace([':', '.'], "_")));
    Process::start(command, log, "vouch replica: serving")
}

/// `vouch serve ARGS --listen 127.0.0.1:0` inside `netns`.
pub fn exporter(dir: &Path, args: &[&str], netns: &str) -> Process {
    exporter_with(dir, args, Some(netns), &[])
}

/// `vouch serve ARGS --listen 127.0.0.1:0` inside `netns` (or here),
/// with the variables of `env` set.
pub fn exporter_with(
    dir: &Path,
    args: &[&str],
    netns: Option<&str>,
    env: &[(&str, &str)],
) -> Process {
    let mut command = in_netns(netns, Path::new(vouch_bin()));
    command
        .arg("serve")
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--log", "info"])
        .envs(env.iter().copied())
        .current_dir(dir);
    // A log per start: a restarted exporter keeps its predecessor's.
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Process::start(
        command,
        dir.join(format!("exporter-{n}.log")),
        "vouch: serving on nbd://",
    )
    .unwrap_or_else(|error| panic!("{error}"))
}

/// `vouch ARGS` inside `netns` (or here), bounded.
pub fn vouch_in(netns: Option<&str>, args: &[&str]) -> Output {
    let mut command = in_netns(netns, Path::new(vouch_bin()));
    command.args(args);
    run_timeout(&mut command, TIMEOUT)
}

/// Two network namespaces joined by a veth pair: the replica side at
/// 10.231.N.1/24, the exporter side at 10.231.N.2/24. Removed on drop.
pub struct NetnsPair {
    pub replica: String,
    pub exporter: String,
    pub replica_ip: String,
    pub exporter_ip: String,
    /// The veth end inside the replica's namespace.
    pub replica_dev: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let output = run_timeout(Command::new(tool("ip", "iproute2")).args(args), TIMEOUT);
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

impl NetnsPair {
    /// Make the pair; `tag` keeps concurrent tests apart.
    ///
    /// Cut the link with `ip -n REPLICA link set REPLICA_DEV down`.
    pub fn new(tag: &str) -> NetnsPair {
        // Distinct per process and per tag (tests of one binary run at once).
        let salt: u32 = tag.bytes().map(u32::from).sum();
        let id = (std::process::id() + salt * 7) % 200 + 20;
        let veth_r = format!("vr{id}{}r", &tag[..tag.len().min(3)]);
        let veth_e = format!("vr{id}{}e", &tag[..tag.len().min(3)]);
        // Dropped (and cleaned) even if a step below fails.
        let pair = NetnsPair {
            replica: format!("vr-{tag}-{id}-r"),
            exporter: format!("vr-{tag}-{id}-e"),
            replica_ip: format!("10.231.{id}.1"),
            exporter_ip: format!("10.231.{id}.2"),
            replica_dev: veth_r.clone(),
        };
        let setup = || -> Result<(), String> {
            ip(&["netns", "add", &pair.replica])?;
            ip(&["netns", "add", &pair.exporter])?;
            ip(&[
                "link", "add", &veth_r, "type", "veth", "peer", "name", &veth_e,
            ])?;
            ip(&["link", "set", &veth_r, "netns", &pair.replica])?;
            ip(&["link", "set", &veth_e, "netns", &pair.exporter])?;
            for (ns, dev, addr) in [
                (&pair.replica, &veth_r, &pair.replica_ip),
                (&pair.exporter, &veth_e, &pair.exporter_ip),
            ] {
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
            }
            Ok(())
        };
        if let Err(error) = setup() {
            drop(pair);
            panic!("network namespaces: {error} (these tests need root and iproute2)");
        }
        pair
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it (and its peer).
        let _ = ip(&["netns", "del", &self.replica]);
        let _ = ip(&["netns", "del", &self.exporter]);
    }
}

/// A Python script with the libnbd bindings (and `PY_PRELUDE`) run
/// inside `netns`, bounded by `timeout`.
pub fn py_in(netns: &str, script: &str, args: &[String], timeout: Duration) -> Output {
    let mut command = in_netns(Some(netns), Path::new(python()));
    command
        .arg("-c")
        .arg(format!("{PY_PRELUDE}\n{script}"))
        .args(args);
    run_timeout(&mut command, timeout)
}

/// `GET /metrics` from the endpoint at `addr` inside `netns`.
pub fn metrics_in(netns: &str, addr: &str) -> String {
    let script = "import urllib.request\nprint(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())";
    let output = py_in(netns, script, &[format!("http://{addr}/metrics")], TIMEOUT);
    assert!(output.status.success(), "metrics: {}", text(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `vouch mirror status a --json --server CONTROL` of the exporter
/// running in `netns` (its volume's directory is named `a`).
pub fn mirror_status_online(netns: &str, control: &str) -> serde_json::Value {
    let output = vouch_in(
        Some(netns),
        &["mirror", "status", "a", "--json", "--server", control],
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("{error}: {}", text(&output)))
}

/// `vouch mirror resync a --leg 1 --server CONTROL` on the running
/// exporter in `netns`: starts the resync and returns.
pub fn start_resync_leg_1_online(netns: &str, control: &str) {
    let output = vouch_in(
        Some(netns),
        &["mirror", "resync", "a", "--leg", "1", "--server", control],
    );
    assert!(output.status.success(), "resync: {}", text(&output));
}

/// Leg 1's row of the exporter's status once neither its resync nor a
/// reconciliation runs (bounded).
pub fn wait_resync_leg_1(netns: &str, control: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let row = mirror_status_online(netns, control)["legs"][1].clone();
        // After an exporter's crash the leg also reconciles, which can end
        // after the resync: the row is final once neither runs.
        if row["resync"]["state"] != "running" && row["state"] != "reconciling" {
            return row;
        }
        assert!(
            Instant::now() < deadline,
            "resync or reconciliation still running: {row}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `vouch mirror resync a --leg 1 --server CONTROL` on the running
/// exporter, then its status until the resync ended; leg 1's row.
pub fn resync_leg_1_online(netns: &str, control: &str) -> serde_json::Value {
    start_resync_leg_1_online(netns, control);
    wait_resync_leg_1(netns, control)
}
