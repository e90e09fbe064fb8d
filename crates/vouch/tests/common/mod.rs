//! Shared fixtures for the tests that drive `vouch serve` with real NBD
//! clients from Debian packages (qemu-utils, libnbd-bin, python3-libnbd,
//! nbdfuse, fio). A missing tool fails the test with its install command.

#![allow(dead_code)]

pub mod clients;
pub mod control;
pub mod crash;
pub mod pki;
pub mod regions;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use vouch_engine::DeviceWrites;

/// Default bound on any external command.
pub const TIMEOUT: Duration = Duration::from_secs(60);
/// How long `vouch serve` may take to print its listening line.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a SIGTERMed server may take to exit.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The interpreter that has the `nbd` module (a pyenv python3 may be first on
/// PATH and lacks it).
pub const PYTHON: &str = "/usr/bin/python3";

pub const BLOCK: u64 = 4096;
pub const MIB: u64 = 1 << 20;

pub fn vouch_bin() -> &'static str {
    env!("CARGO_BIN_EXE_vouch")
}

pub fn s(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

/// Find `name` on PATH (or in the sbin directories); fail with the install
/// command when it is missing.
pub fn tool(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    for extra in ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        dirs.push(PathBuf::from(extra));
    }
    for dir in dirs {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!("{name} not found: apt-get install -y {package}");
}

/// `/usr/bin/python3` with the libnbd bindings importable (checked once).
pub fn python() -> &'static str {
    static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();
    let result = CHECKED.get_or_init(|| {
        if !Path::new(PYTHON).is_file() {
            return Err(format!(
                "{PYTHON} not found: apt-get install -y python3 python3-libnbd"
            ));
        }
        let output = Command::new(PYTHON)
            .args(["-c", "import nbd"])
            .output()
            .map_err(|e| format!("cannot run {PYTHON}: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{PYTHON} cannot import nbd ({}): apt-get install -y python3-libnbd",
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    });
    if let Err(message) = result {
        panic!("{message}");
    }
    PYTHON
}

pub fn text(output: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn spawn_reader<R: Read + Send + 'static>(mut reader: R) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = reader.read_to_end(&mut bytes);
        bytes
    })
}

/// Run a command to completion with a deadline; on timeout it is killed and
/// the test fails with what it printed so far.
pub fn run_timeout(command: &mut Command, timeout: Duration) -> Output {
    let description = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {description}: {e}"));
    let stdout = spawn_reader(child.stdout.take().expect("stdout"));
    let stderr = spawn_reader(child.stderr.take().expect("stderr"));
    let status = match wait_timeout(&mut child, timeout) {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            let out = stdout.join().unwrap_or_default();
            let err = stderr.join().unwrap_or_default();
            panic!(
                "{description} did not finish within {timeout:?}\n--- stdout\n{}--- stderr\n{}",
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&err)
            );
        }
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

pub fn run(command: &mut Command) -> Output {
    run_timeout(command, TIMEOUT)
}

/// Run and require exit 0.
pub fn run_ok(command: &mut Command) -> Output {
    let description = format!("{command:?}");
    let output = run(command);
    assert!(
        output.status.success(),
        "{description} failed:\n{}",
        text(&output)
    );
    output
}

/// Poll a child until it exits or the deadline passes.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => {}
            Err(e) => panic!("waiting for child: {e}"),
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Poll `condition` every few milliseconds until it holds; fail after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn vouch(args: &[&str]) -> Output {
    run(Command::new(vouch_bin()).args(args))
}

pub fn vouch_ok(args: &[&str]) -> Output {
    run_ok(Command::new(vouch_bin()).args(args))
}

/// `vouch info PATH --json`.
pub fn info_json(volume: &Path) -> serde_json::Value {
    let output = vouch_ok(&["info", s(volume), "--json"]);
    serde_json::from_slice(&output.stdout).expect("info --json output")
}

/// `vouch check PATH --json`: (exit code, [(lba, kind)]).
pub fn check_faults(volume: &Path) -> (i32, Vec<(u64, String)>) {
    check_faults_with(volume, &[])
}

/// `check_faults` with more arguments (a key file).
pub fn check_faults_with(volume: &Path, extra: &[&str]) -> (i32, Vec<(u64, String)>) {
    let mut args = vec!["check", s(volume), "--json"];
    args.extend(extra);
    let output = vouch(&args);
    let json: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("check --json output ({e}): {}", text(&output)));
    let faults = json["faults"]
        .as_array()
        .expect("faults array")
        .iter()
        .map(|fault| {
            (
                fault["lba"].as_u64().expect("lba"),
                fault["kind"].as_str().expect("kind").to_string(),
            )
        })
        .collect();
    (output.status.code().expect("exit code"), faults)
}

/// `vouch check` must find the volume clean.
pub fn assert_check_clean(volume: &Path) {
    let output = vouch(&["check", s(volume)]);
    assert!(
        output.status.success(),
        "vouch check {} is not clean:\n{}",
        volume.display(),
        text(&output)
    );
}

/// Write blocks `0..count` (each `block_data(lba, 1000 + lba)`) through
/// NBD at `uri` and flush.
pub fn write_tagged_blocks(uri: &str, count: u64) {
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(int(sys.argv[2])):
    h.pwrite(block_data(lba, 1000 + lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[uri, &count.to_string()],
    );
}

/// Run a Python script (with the libnbd bindings) with arguments.
pub fn py(script: &str, args: &[&str]) -> Output {
    py_timeout(script, args, TIMEOUT)
}

pub fn py_timeout(script: &str, args: &[&str], timeout: Duration) -> Output {
    let full = format!("{PY_PRELUDE}\n{script}");
    run_timeout(
        Command::new(python()).arg("-c").arg(full).args(args),
        timeout,
    )
}

/// Run a Python script that must succeed; returns its stdout parsed as JSON
/// (the last line that parses).
pub fn py_json(script: &str, args: &[&str]) -> serde_json::Value {
    let output = py(script, args);
    assert!(
        output.status.success(),
        "python script failed:\n{}",
        text(&output)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON line in python output:\n{}", text(&output)))
}

/// Helpers every Python script gets: `connect`, `connect_unnegotiated`,
/// `block_data`, `err_info`, `connect_logged`, `failure`, `attempt`.
pub const PY_PRELUDE: &str = r#"
import errno, hashlib, json, os, signal, struct, sys, time
import nbd

def connect(uri, strict=True, name=None):
    h = nbd.NBD()
    if not strict:
        h.set_strict_mode(0)
    h.connect_uri(uri)
    return h

def connect_unnegotiated(uri, export_name=False):
    """A client that never asks for block sizes (NBD_OPT_GO without
    NBD_INFO_BLOCK_SIZE), so any byte range is valid. export_name=True: a
    newstyle (not fixed-newstyle) handshake, where libnbd can only use
    NBD_OPT_EXPORT_NAME."""
    h = nbd.NBD()
    h.set_request_block_size(False)
    # libnbd would check alignment against the sizes the server volunteers.
    h.set_strict_mode(nbd.STRICT_MASK & ~nbd.STRICT_ALIGN)
    if export_name:
        h.set_handshake_flags(0)
    h.connect_uri(uri)
    return h

def block_data(lba, tag):
    """4096 deterministic bytes for (lba, tag); tag is an int."""
    head = struct.pack("<4sQQ", b"VCH1", lba, tag)
    return head + hashlib.shake_128(head).digest(4096 - len(head))

def err_info(e):
    return {"errnum": e.errnum, "errno": e.errno, "message": str(e)}

def connect_logged(uri):
    """A client and its libnbd debug log (a list): libnbd keeps the
    server's structured error message out of str(e) and reports it there
    (`failure`, `attempt`). Returns (handle, log)."""
    log = []
    h = nbd.NBD()
    h.set_debug(True)
    h.set_debug_callback(lambda context, message: log.append(message))
    h.connect_uri(uri)
    return h, log

def failure(e, log):
    """err_info(e) with the server messages in log (clear it before the request)."""
    info = err_info(e)
    info["server_messages"] = [m.split("server message: ", 1)[1] for m in log
                               if "server message: " in m]
    return info

def attempt(log, f):
    """"ok" when f() succeeds; else its nbd.Error's `failure`, with the
    server messages sent meanwhile."""
    log.clear()
    try:
        f()
        return "ok"
    except nbd.Error as e:
        return failure(e, log)
"#;

/// A `vouch serve` child process. Drop sends SIGTERM and waits (SIGKILL after
/// a timeout): no leaked servers even when an assertion fails.
pub struct Server {
    child: Option<Child>,
    pub pid: u32,
    /// `nbd://127.0.0.1:PORT` (no export name).
    pub uri: String,
    pub addr: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// The control API's address as printed (`http://...`, `https://...`
    /// or `unix:PATH`), when started with --control.
    pub control: Option<String>,
    pub log: PathBuf,
    /// Every line it printed on stdout so far (see `wait_for_line`).
    pub printed: Vec<String>,
    lines: mpsc::Receiver<String>,
    args: Vec<String>,
    dir: PathBuf,
}

/// The lines a starting server prints that `Server::launch` waits for.
#[derive(Clone, Copy, Debug, Default)]
pub struct Expect {
    /// "serving on nbd://ADDR" (the last one sets `addr` and `uri`).
    pub tcp: bool,
    /// "serving on nbd+unix://...".
    pub unix: bool,
    pub metrics: bool,
    pub control: bool,
}

static SERVER_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Server {
    /// `vouch serve ARGS --listen 127.0.0.1:0`, run with `dir` as its working
    /// directory (its stderr goes to a log file there). Waits for every
    /// "serving on"/"metrics on" line it will print.
    pub fn start(dir: &Path, args: &[&str]) -> Server {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        Server::start_owned(dir, args)
    }

    fn start_owned(dir: &Path, args: Vec<String>) -> Server {
        Server::try_start_owned(dir, args).unwrap_or_else(|error| panic!("{error}"))
    }

    /// Like `start`, but a server that exits before it is ready is an
    /// `Err` with its exit status and log instead of a failure.
    pub fn try_start(dir: &Path, args: &[&str]) -> Result<Server, String> {
        Server::try_start_owned(dir, args.iter().map(|a| a.to_string()).collect())
    }

    fn try_start_owned(dir: &Path, args: Vec<String>) -> Result<Server, String> {
        let mut command = Command::new(vouch_bin());
        command
            .arg("serve")
            .args(&args)
            .args(["--listen", "127.0.0.1:0", "--log", "info"]);
        let expect = Expect {
            tcp: true,
            unix: args.iter().any(|a| a == "--socket"),
            metrics: args.iter().any(|a| a == "--metrics"),
            control: args.iter().any(|a| a == "--control"),
        };
        Server::launch(dir, command, args, expect)
    }

    /// Start `command` (a `vouch serve`, maybe behind a wrapper such as
    /// systemd-socket-activate) in `dir`, its stdout read here and its
    /// stderr logged to a file there, and wait for the lines `expect`
    /// names (none: return at once). `args` are its serve arguments, for
    /// messages and `restart`.
    pub fn launch(
        dir: &Path,
        mut command: Command,
        args: Vec<String>,
        expect: Expect,
    ) -> Result<Server, String> {
        let n = SERVER_COUNTER.fetch_add(1, Ordering::Relaxed);
        let log = dir.join(format!("serve-{n}.log"));
        let log_file = std::fs::File::create(&log).expect("create server log");
        let mut child = command
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .expect("spawn vouch serve");
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
        let mut server = Server {
            child: Some(child),
            pid,
            uri: String::new(),
            addr: "0.0.0.0:0".parse().expect("addr"),
            metrics: None,
            control: None,
            log,
            printed: Vec::new(),
            lines: receiver,
            args,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut seen_unix = false;
        while (expect.tcp && server.uri.is_empty())
            || (expect.metrics && server.metrics.is_none())
            || (expect.unix && !seen_unix)
            || (expect.control && server.control.is_none())
        {
            let left = deadline.saturating_duration_since(Instant::now());
            match server.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("vouch: serving on nbd://") {
                        server.addr = rest
                            .parse()
                            .unwrap_or_else(|e| panic!("bad listening address in {line:?}: {e}"));
                        server.uri = format!("nbd://{}", server.addr);
                    } else if line.starts_with("vouch: serving on nbd+unix://") {
                        seen_unix = true;
                    } else if let Some(rest) = line.strip_prefix("vouch: control on ") {
                        server.control = Some(rest.to_string());
                    } else if let Some(rest) = line.strip_prefix("vouch: metrics on http://") {
                        let addr = rest.trim_end_matches("/metrics");
                        server.metrics =
                            Some(addr.parse().unwrap_or_else(|e| {
                                panic!("bad metrics address in {line:?}: {e}")
                            }));
                    }
                    server.printed.push(line);
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Stdout closed: it exited (or is exiting).
                    let mut child = server.child.take().expect("child");
                    let status = wait_timeout(&mut child, STOP_TIMEOUT);
                    if status.is_none() {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                    return Err(format!(
                        "vouch serve {:?} exited before it was ready ({status:?}):\n{}",
                        server.args,
                        server.log_text()
                    ));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!(
                        "vouch serve {:?} not ready within {READY_TIMEOUT:?}:\n{}",
                        server.args,
                        server.log_text()
                    );
                }
            }
        }
        Ok(server)
    }

    /// The first line printed on stdout that starts with `prefix`, waiting
    /// for it (bounded) if it has not come yet.
    pub fn wait_for_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(line) = self.printed.iter().find(|line| line.starts_with(prefix)) {
                return line.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.printed.push(line),
                Err(error) => panic!(
                    "vouch serve {:?} printed no line starting {prefix:?} ({error:?}); it printed {:?}:\n{}",
                    self.args,
                    self.printed,
                    self.log_text()
                ),
            }
        }
    }

    /// Start again with the same arguments (e.g. after a stop or a kill).
    pub fn restart(&self) -> Server {
        assert!(self.child.is_none(), "restart of a running server");
        Server::start_owned(&self.dir, self.args.clone())
    }

    /// The URI of a named export.
    pub fn export_uri(&self, name: &str) -> String {
        format!("{}/{name}", self.uri)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, signal: i32) {
        assert!(self.child.is_some(), "signal to a stopped server");
        // SAFETY: kill(2) on the pid of our own live (unreaped) child.
        let rc = unsafe { libc::kill(self.pid as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({}, {signal})", self.pid);
    }

    /// SIGTERM and wait; the server must exit 0 within STOP_TIMEOUT (a
    /// hang guard).
    pub fn stop(&mut self) {
        let status = self.stop_status(STOP_TIMEOUT);
        assert!(
            status.success(),
            "vouch serve exited with {status:?} after SIGTERM:\n{}",
            self.log_text()
        );
    }

    /// SIGTERM and wait; returns the exit status (SIGKILL and fail on timeout).
    pub fn stop_status(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        let mut child = self.child.take().expect("running");
        match wait_timeout(&mut child, timeout) {
            Some(status) => status,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "vouch serve did not exit within {timeout:?} of SIGTERM:\n{}",
                    self.log_text()
                );
            }
        }
    }

    /// SIGKILL (a crash) and reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Reap a server that something else (a client script) killed.
    pub fn reap(&mut self, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        match wait_timeout(&mut child, timeout) {
            Some(status) => status,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("vouch serve did not exit within {timeout:?}");
            }
        }
    }

    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().ok().flatten().is_none(),
            None => false,
        }
    }

    /// GET /metrics from the metrics endpoint.
    pub fn metrics_text(&self) -> String {
        let addr = self.metrics.expect("server started with --metrics");
        http_get(addr, "/metrics")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the pid of our own unreaped child.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGTERM) };
            if wait_timeout(&mut child, STOP_TIMEOUT).is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A minimal HTTP/1.0 GET; returns the body of a 200 response.
pub fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("send request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read response");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("malformed HTTP response: {response:?}"));
    assert!(
        head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"),
        "GET {path}: {head}"
    );
    body.to_string()
}

/// The value of one Prometheus series (exact name and labels as rendered).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
}

/// A plain volume `name` in `dir` holding `data` from byte 0 (`vouch
/// import` of a raw file).
pub fn volume_from(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    let raw = dir.join(format!("{name}.raw"));
    std::fs::write(&raw, data).expect("write raw");
    let volume = dir.join(name);
    vouch_ok(&["import", s(&raw), s(&volume)]);
    volume
}

/// A split volume `dir/vol` of `blocks` blocks with a run of 64 blocks of
/// random data (seeded by its index, from 1) at each of `lbas`, closed.
pub fn split_volume_with_runs(dir: &Path, blocks: u64, lbas: &[u64]) -> PathBuf {
    let path = dir.join("vol");
    let options = vouch_engine::CreateOptions {
        layout: vouch_format::LayoutKind::Split,
        ..vouch_engine::CreateOptions::new(blocks * BLOCK)
    };
    let volume = vouch_engine::create_volume(&path, &options).expect("create");
    for (index, lba) in lbas.iter().enumerate() {
        let data = random_bytes((64 * BLOCK) as usize, index as u64 + 1);
        volume.write(lba * BLOCK, &data, false).expect("write");
    }
    volume.close().expect("close");
    path
}

/// Deterministic pseudo-random bytes (xorshift64*), cheaper than pulling in a
/// seeded RNG for large images.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn sha256(path: &Path) -> String {
    let output = run_ok(Command::new(tool("sha256sum", "coreutils")).arg(path));
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .expect("sha256sum output")
        .to_string()
}

/// Flip the bits of `mask` in the byte at `offset` of `path`, durably.
pub fn flip_bit(path: &Path, offset: u64, mask: u8) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open for corruption");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset).expect("read byte");
    byte[0] ^= mask;
    file.write_all_at(&byte, offset).expect("write byte");
    file.sync_all().expect("sync");
}

/// Rewrite both superblock copies with the newest one as `edit` leaves it
/// (what a binary of another format, or an operator, would write).
pub fn rewrite_superblock(volume: &Path, edit: impl Fn(&mut vouch_format::Superblock)) {
    let path = volume.join("superblock");
    let bytes = std::fs::read(&path).expect("read");
    let mut superblock = vouch_format::Superblock::newest(
        vouch_format::Superblock::decode(&bytes[..4096]),
        vouch_format::Superblock::decode(&bytes[4096..]),
    )
    .expect("valid superblock");
    edit(&mut superblock);
    let mut slot = vec![0u8; 4096];
    slot[..256].copy_from_slice(&superblock.encode());
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.write_all_at(&slot, 0).expect("copy 0");
    file.write_all_at(&slot, 4096).expect("copy 1");
}

/// A loop-mounted xfs or btrfs, unmounted (and its image removed) when
/// dropped, even when the test fails.
pub struct LoopFs {
    _dir: tempfile::TempDir,
    pub mount: PathBuf,
}

impl LoopFs {
    pub fn xfs() -> LoopFs {
        LoopFs::xfs_of(1 << 30)
    }

    /// An xfs of `bytes` (its image sparse: only what is written uses space).
    pub fn xfs_of(bytes: u64) -> LoopFs {
        LoopFs::made_by("mkfs.xfs", "xfsprogs", bytes)
    }

    pub fn btrfs() -> LoopFs {
        LoopFs::made_by("mkfs.btrfs", "btrfs-progs", 1 << 30)
    }

    /// A small ext4 of `bytes` (to fill up).
    pub fn ext4(bytes: u64) -> LoopFs {
        LoopFs::made_by("mkfs.ext4", "e2fsprogs", bytes)
    }

    fn made_by(mkfs: &str, package: &str, bytes: u64) -> LoopFs {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("fs.img");
        std::fs::File::create(&image)
            .and_then(|file| file.set_len(bytes))
            .expect("image");
        run_ok(Command::new(tool(mkfs, package)).arg("-q").arg(&image));
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).expect("mkdir");
        run_ok(
            Command::new(tool("mount", "mount"))
                .args(["-o", "loop"])
                .arg(&image)
                .arg(&mount),
        );
        LoopFs { _dir: dir, mount }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let status = Command::new("umount").arg(&self.mount).status();
        if !status.is_ok_and(|status| status.success()) {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        }
    }
}

/// `vouch export` of `volume` into `dir/name.raw`, its bytes.
pub fn exported(volume: &Path, dir: &Path, name: &str) -> Vec<u8> {
    let raw = dir.join(format!("{name}.raw"));
    let _ = std::fs::remove_file(&raw);
    vouch_ok(&["export", s(volume), s(&raw)]);
    std::fs::read(&raw).expect("read export")
}

/// Serve `args`, write `data` at `offset` over NBD and flush, stop.
pub fn write_through_nbd(dir: &Path, args: &[&str], offset: u64, data: &[u8]) {
    let file = dir.join("payload.bin");
    std::fs::write(&file, data).expect("payload");
    let mut server = Server::start(dir, args);
    pwrite_file(&server.uri, &file, offset);
    server.stop();
}

/// Write the bytes of `file` at `offset` through the export at `uri`, and
/// flush.
pub fn pwrite_file(uri: &str, file: &Path, offset: u64) {
    py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(open(sys.argv[2], "rb").read(), int(sys.argv[3]))
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[uri, s(file), &offset.to_string()],
    );
}

/// A command's stderr as text.
pub fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}
