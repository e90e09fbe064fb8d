//! Shared integration-test harness: an in-process server on an ephemeral
//! port and helpers to run real NBD clients (never skipped when missing).

#![allow(dead_code)]

pub mod memexport;

use std::io::Write;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use memexport::MemExport;
use vouch_nbd::{Export, Limits, Listen, Metrics, Server, ServerConfig, ShutdownHandle};

/// Default test export size.
pub const EXPORT_SIZE: u64 = 16 << 20;
/// A client run longer than this is killed and fails the test.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Options for [`TestServer::start`].
#[derive(Default)]
pub struct TestOptions {
    pub read_only_export: bool,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    pub tls_required: bool,
    pub limits: Limits,
    pub unix_socket: Option<std::path::PathBuf>,
}

/// A running server: exports "" / "disk" (read-write) and "ro" (read-only).
pub struct TestServer {
    pub port: u16,
    pub export: Arc<MemExport>,
    pub read_only: Arc<MemExport>,
    pub metrics: Arc<Metrics>,
    shutdown: ShutdownHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    pub fn start(options: TestOptions) -> TestServer {
        let export = Arc::new(MemExport::new(EXPORT_SIZE, options.read_only_export));
        let read_only = Arc::new(MemExport::new(1 << 20, true));
        let mut config = ServerConfig::default();
        config
            .exports
            .insert("disk".into(), export.clone() as Arc<dyn Export>);
        config
            .exports
            .insert("ro".into(), read_only.clone() as Arc<dyn Export>);
        config.default_export = Some("disk".into());
        config
            .listen
            .push(Listen::Tcp("127.0.0.1:0".parse().unwrap()));
        if let Some(path) = options.unix_socket {
            config.listen.push(Listen::Unix(path));
        }
        config.tls = options.tls;
        config.tls_required = options.tls_required;
        config.limits = options.limits;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let server = Server::bind(config).await.expect("bind");
                let port = server.tcp_addrs()[0].port();
                ready_tx
                    .send((port, server.metrics(), server.shutdown_handle()))
                    .unwrap();
                server.run().await.expect("server run");
            });
        });
        let (port, metrics, shutdown) = ready_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("server started");
        TestServer {
            port,
            export,
            read_only,
            metrics,
            shutdown,
            thread: Some(thread),
        }
    }

    pub fn uri(&self) -> String {
        format!("nbd://127.0.0.1:{}", self.port)
    }

    /// Shut down gracefully and wait for `run()` to return.
    pub fn stop(&mut self) {
        self.shutdown.shutdown();
        if let Some(thread) = self.thread.take() {
            thread.join().expect("server thread");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.shutdown();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Fail (never skip) when a client tool is missing.
pub fn require_tool(tool: &str, package: &str) {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success());
    assert!(
        matches!(found, Ok(true)),
        "{tool} not found: apt-get install -y {package}"
    );
}

/// Kills the child if the test panics or times out.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Run a command with optional stdin, a timeout, and captured output.
pub fn run(command: &mut Command, stdin: Option<&str>) -> Output {
    command.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let description = format!("{command:?}");
    let mut child = KillOnDrop(Some(
        command
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {description}: {e}")),
    ));
    if let Some(input) = stdin {
        let mut pipe = child.0.as_mut().unwrap().stdin.take().unwrap();
        pipe.write_all(input.as_bytes()).unwrap();
    }
    wait_until(&description, CLIENT_TIMEOUT, || {
        child.0.as_mut().unwrap().try_wait().unwrap().is_some()
    });
    child.0.take().unwrap().wait_with_output().unwrap()
}

/// Poll `condition` every few milliseconds until it holds; fail naming
/// `what` once `timeout` (a hang guard) has passed.
pub fn wait_until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Run and require success; returns stdout.
pub fn run_ok(command: &mut Command) -> String {
    let description = format!("{command:?}");
    let output = run(command, None);
    assert!(
        output.status.success(),
        "{description} failed: {}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Run a Python script with Debian's python3 and python3-libnbd (`import nbd`).
/// The script sees `URI` and `PORT` variables. Returns stdout.
pub fn python(server: &TestServer, script: &str) -> String {
    let check = run(
        Command::new("/usr/bin/python3").args(["-c", "import nbd"]),
        None,
    );
    assert!(
        check.status.success(),
        "python3 nbd module not found: apt-get install -y python3-libnbd"
    );
    let prelude = format!(
        "import nbd, errno, sys\nURI = '{}'\nPORT = {}\n",
        server.uri(),
        server.port
    );
    let output = run(
        Command::new("/usr/bin/python3").arg("-"),
        Some(&format!("{prelude}{script}")),
    );
    assert!(
        output.status.success(),
        "python script failed:\n{script}\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
