//! A remote replica on another "host": two network namespaces joined by a
//! veth pair (10.231.N.1 and .2, only inside them), `vouch replica serve`
//! in one, the exporter (`vouch serve`) and its NBD client (qemu-io) in
//! the other. Written and read back across the link; then the replica is
//! SIGKILLed while writes run: the exporter keeps serving from its local
//! leg, marks the remote leg stale (the log and `vouch mirror status` say
//! so), and every write acknowledged and flushed reads back.
//!
//! Plain TCP across the namespaces: the replica server runs with
//! `--insecure` (mutual TLS is tested over loopback in replica_loopback.rs,
//! where the test certificates' names match).

mod common;
mod replica_support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use replica_support::*;

fn qemu_io_command(netns: &str, uri: &str, commands: &[String]) -> Command {
    let mut command = in_netns(Some(netns), &tool("qemu-io", "qemu-utils"));
    command.args(["-f", "raw"]);
    for c in commands {
        command.args(["-c", c]);
    }
    command.arg(uri);
    command
}

fn qemu_io_ok(netns: &str, uri: &str, commands: &[&str]) -> String {
    let commands: Vec<String> = commands.iter().map(|c| c.to_string()).collect();
    let output = run_timeout(&mut qemu_io_command(netns, uri, &commands), TIMEOUT);
    let all = text(&output);
    assert!(
        output.status.success() && !all.contains("failed") && !all.contains("Pattern verification"),
        "qemu-io {commands:?}: {all}"
    );
    all
}

fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

#[test]
fn a_replica_across_a_link_takes_writes_and_a_sigkill_leaves_the_exporter_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let net = NetnsPair::new("kill");
    let replicas = dir.path().join("replicas");
    let listen = format!("{}:7000", net.replica_ip);
    let mut replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
        .unwrap_or_else(|error| panic!("{error}"));
    let a = dir.path().join("a");
    let url = format!("vouch://{listen}/disk");
    let output = vouch_in(
        Some(&net.exporter),
        &["create", s(&a), "--size", "128MiB", "--mirror", &url],
    );
    assert!(output.status.success(), "{}", text(&output));
    // The exporter's namespace cannot reach the replica through loopback:
    // the leg really crosses the veth link.
    let mut exporter = exporter(dir.path(), &[s(&a)], &net.exporter);
    let uri = format!("nbd://{}", exporter.addr);
    qemu_io_ok(&net.exporter, &uri, &["write -P 0x11 0 8M", "flush"]);
    qemu_io_ok(&net.exporter, &uri, &["read -P 0x11 0 8M"]);
    let data = replicas.join("disk").join("data.00000");
    assert!(
        allocated_bytes(&data) >= 8 << 20,
        "the replica holds the data"
    );

    // 64 MiB more, each MiB flushed; SIGKILL the replica once some of it
    // has reached the replica's disk.
    let commands: Vec<String> = (0..64)
        .flat_map(|i| [format!("write -P 0x22 {}M 1M", 8 + i), "flush".to_string()])
        .collect();
    let mut writer = qemu_io_command(&net.exporter, &uri, &commands)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn qemu-io");
    let before = allocated_bytes(&data);
    let deadline = Instant::now() + Duration::from_secs(30);
    while allocated_bytes(&data) <= before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        allocated_bytes(&data) > before,
        "no write reached the replica within 30 s"
    );
    replica.kill9();
    let status = wait_timeout(&mut writer, TIMEOUT).expect("qemu-io finished");
    let output = writer.wait_with_output().expect("qemu-io output");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        status.success() && !all.contains("failed"),
        "qemu-io: {all}"
    );
    assert!(
        allocated_bytes(&data) < (8 + 64) << 20,
        "the kill landed after every write reached the replica: nothing was tested"
    );

    // Every acknowledged and flushed write reads back, from the local leg;
    // new writes still work.
    qemu_io_ok(
        &net.exporter,
        &uri,
        &[
            "read -P 0x11 0 8M",
            "read -P 0x22 8M 64M",
            "write -P 0x33 72M 1M",
            "flush",
            "read -P 0x33 72M 1M",
        ],
    );
    let log = exporter.log_text();
    assert!(log.contains("STALE (unreachable)"), "{log}");
    let output = vouch_in(Some(&net.exporter), &["mirror", "status", s(&a)]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(
        text(&output).contains(&format!("leg 1: {url}: stale")),
        "{}",
        text(&output)
    );
    assert!(
        exporter.stop().is_some_and(|s| s.success()),
        "{}",
        exporter.log_text()
    );
    // The local leg is clean; the stale remote one is reported, not used.
    let output = vouch_in(Some(&net.exporter), &["check", s(&a), "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("{error}: {}", text(&output)));
    assert_eq!(output.status.code(), Some(1), "{report}");
    assert_eq!(
        report["legs"][0]["faults"],
        serde_json::json!([]),
        "{report}"
    );
    assert_eq!(report["legs"][1]["state"], "stale", "{report}");
    // A restarted replica does not make the leg active again (it missed
    // writes): it stays stale until a resync.
    let _replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
        .unwrap_or_else(|error| panic!("{error}"));
    let output = vouch_in(Some(&net.exporter), &["mirror", "status", s(&a)]);
    assert!(
        text(&output).contains(&format!("leg 1: {url}: stale")),
        "{}",
        text(&output)
    );
}

#[test]
fn a_cut_link_times_out_and_the_remote_leg_is_marked_stale() {
    let dir = tempfile::tempdir().expect("tempdir");
    let net = NetnsPair::new("cut");
    let replicas = dir.path().join("replicas");
    let listen = format!("{}:7000", net.replica_ip);
    let _replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
        .unwrap_or_else(|error| panic!("{error}"));
    let a = dir.path().join("a");
    let url = format!("vouch://{listen}/disk");
    let output = vouch_in(
        Some(&net.exporter),
        &["create", s(&a), "--size", "64MiB", "--mirror", &url],
    );
    assert!(output.status.success(), "{}", text(&output));
    let mut exporter = exporter(
        dir.path(),
        &[s(&a), "--replica-timeout", "2"],
        &net.exporter,
    );
    let uri = format!("nbd://{}", exporter.addr);
    qemu_io_ok(&net.exporter, &uri, &["write -P 0x44 0 4M", "flush"]);
    // The replica's end of the link goes down: packets vanish, nothing
    // answers, the request times out.
    let output = run_timeout(
        Command::new(tool("ip", "iproute2")).args([
            "-n",
            &net.replica,
            "link",
            "set",
            &net.replica_dev,
            "down",
        ]),
        TIMEOUT,
    );
    assert!(output.status.success(), "{}", text(&output));
    let started = Instant::now();
    qemu_io_ok(
        &net.exporter,
        &uri,
        &[
            "write -P 0x55 4M 4M",
            "flush",
            "read -P 0x55 4M 4M",
            "read -P 0x44 0 4M",
        ],
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(30),
        "the write waited {took:?} for the timeout"
    );
    let log = exporter.log_text();
    assert!(
        log.contains("STALE (unreachable)") && log.contains("timed out"),
        "{log}"
    );
    let output = vouch_in(Some(&net.exporter), &["mirror", "status", s(&a)]);
    assert!(
        text(&output).contains(&format!("leg 1: {url}: stale")),
        "{}",
        text(&output)
    );
    assert!(
        exporter.stop().is_some_and(|s| s.success()),
        "{}",
        exporter.log_text()
    );
}
