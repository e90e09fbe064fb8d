//! A remote replica on another "host": two network namespaces joined by a
//! veth pair (10.231.N.1 and .2, only inside them), `vouch replica serve`
//! in one, the exporter (`vouch serve`) and its NBD client (qemu-io) in
//! the other. Written and read back across the link; then the replica is
//! SIGKILLed while writes run: the exporter keeps serving from its local
//! leg, marks the remote leg stale (the log and `vouch mirror status` say
//! so), and every write acknowledged and flushed reads back. A replica
//! killed (or cut off) mid-run and back is resynced online (offline) with
//! only the blocks its resync map marks: those written since the last
//! flush before it failed and while it was away.
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
    // Options before the image (`--cache=writeback nbd://...`).
    command.args(uri.split_whitespace());
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
    // Writes in flight when the leg was taken out fail too; no resync
    // ran, so none of them is reported as a resync stopping.
    assert!(!log.contains("resyncing leg failed"), "{log}");
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
    let cut = CutLink::new(dir.path(), "cut");
    cut.io(&["write -P 0x44 0 4M", "flush"]);
    // The replica's end of the link goes down: packets vanish, nothing
    // answers, the request times out.
    set_replica_link(&cut.net, "down");
    let started = Instant::now();
    cut.io(&[
        "write -P 0x55 4M 4M",
        "flush",
        "read -P 0x55 4M 4M",
        "read -P 0x44 0 4M",
    ]);
    cut.assert_timed_out_and_stale(started.elapsed());
}

#[test]
fn a_cut_link_times_out_writes_nobody_waits_for_and_the_remote_leg_is_marked_stale() {
    // Writes of at most 128 KiB without FUA are started on the NBD reactor
    // and completed by the replica connection's reader thread
    // (`try_begin_write`): no thread waits on them, so that reader thread
    // must time them out.
    let dir = tempfile::tempdir().expect("tempdir");
    let cut = CutLink::new(dir.path(), "cutcb");
    cut.io(&["write -P 0x44 0 256k", "flush"]);
    set_replica_link(&cut.net, "down");
    let started = Instant::now();
    // Write-back cache mode: qemu-io sends no FUA (its default,
    // writethrough, makes every write FUA, which takes a worker).
    let uri_writeback = format!("--cache=writeback {}", cut.uri);
    qemu_io_ok(
        &cut.net.exporter,
        &uri_writeback,
        &[
            "aio_write -P 0x55 1M 64k",
            "aio_write -P 0x56 2M 4k",
            "aio_write -P 0x57 3M 128k",
            // Waits for the three writes only: a request on a worker
            // (the flush below, or a larger write) would time out by
            // itself and take the connection down with it.
            "aio_flush",
            "flush",
            "read -P 0x55 1M 64k",
            "read -P 0x56 2M 4k",
            "read -P 0x57 3M 128k",
            "read -P 0x44 0 256k",
        ],
    );
    cut.assert_timed_out_and_stale(started.elapsed());
}

/// A 64 MiB volume whose leg 1 is a replica across a veth link, served by
/// an exporter with a 2 s replica timeout: the cut-link tests.
struct CutLink {
    net: NetnsPair,
    a: std::path::PathBuf,
    url: String,
    uri: String,
    exporter: Process,
    _replica: Process,
}

impl CutLink {
    fn new(dir: &Path, tag: &str) -> CutLink {
        let net = NetnsPair::new(tag);
        let listen = format!("{}:7000", net.replica_ip);
        let replica = replica_server(
            &dir.join("replicas"),
            &listen,
            &["--insecure"],
            Some(&net.replica),
        )
        .unwrap_or_else(|error| panic!("{error}"));
        let a = dir.join("a");
        let url = format!("vouch://{listen}/disk");
        let output = vouch_in(
            Some(&net.exporter),
            &["create", s(&a), "--size", "64MiB", "--mirror", &url],
        );
        assert!(output.status.success(), "{}", text(&output));
        let exporter = exporter(dir, &[s(&a), "--replica-timeout", "2"], &net.exporter);
        let uri = format!("nbd://{}", exporter.addr);
        CutLink {
            net,
            a,
            url,
            uri,
            exporter,
            _replica: replica,
        }
    }

    /// qemu-io `commands` against the export, from the exporter's netns.
    fn io(&self, commands: &[&str]) {
        qemu_io_ok(&self.net.exporter, &self.uri, commands);
    }

    /// The requests after the cut waited out the 2 s timeout (`took`, at
    /// least that; qemu-io's run_timeout is the hang guard), the leg was
    /// taken out as stale for it and says so, and the exporter stops
    /// cleanly.
    fn assert_timed_out_and_stale(mut self, took: Duration) {
        assert!(
            took >= Duration::from_secs(2),
            "the writes finished after {took:?}, before the 2 s timeout"
        );
        let log = self.exporter.log_text();
        assert!(
            log.contains("STALE (unreachable)") && log.contains("timed out after 2s"),
            "{log}"
        );
        let output = vouch_in(Some(&self.net.exporter), &["mirror", "status", s(&self.a)]);
        assert!(
            text(&output).contains(&format!("leg 1: {}: stale", self.url)),
            "{}",
            text(&output)
        );
        assert!(
            self.exporter.stop().is_some_and(|s| s.success()),
            "{}",
            self.exporter.log_text()
        );
    }
}

/// Take the replica's end of the veth link `down` or bring it `up`.
fn set_replica_link(net: &NetnsPair, state: &str) {
    let output = run_timeout(
        Command::new(tool("ip", "iproute2")).args([
            "-n",
            &net.replica,
            "link",
            "set",
            &net.replica_dev,
            state,
        ]),
        TIMEOUT,
    );
    assert!(output.status.success(), "{}", text(&output));
}

/// A number the exporter logged as `key=N` (the last one).
fn logged_number(log: &str, key: &str) -> Option<u64> {
    log.rsplit(&format!("{key}="))
        .next()
        .filter(|_| log.contains(&format!("{key}=")))
        .and_then(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|digits| digits.parse().ok())
        })
}

/// `vouch mirror resync A --leg 1 --json` offline, retried while the
/// replica still holds the volume for the exporter's old connection (a
/// cut link delays its close); returns leg 1's resync progress.
fn resync_leg_1(netns: &str, a: &Path) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let output = vouch_in(
            Some(netns),
            &["mirror", "resync", s(a), "--leg", "1", "--json"],
        );
        if output.status.success() {
            let value: serde_json::Value = serde_json::from_slice(&output.stdout)
                .unwrap_or_else(|error| panic!("{error}: {}", text(&output)));
            return value["legs"][1]["resync"].clone();
        }
        assert!(
            text(&output).contains("in use by another exporter") && Instant::now() < deadline,
            "resync: {}",
            text(&output)
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// After a resync: the set checks clean on every leg, a scrub finds no
/// block that differs between the legs, the data reads back through a new
/// exporter, and the replica's own directory checks clean.
fn assert_legs_identical_and_clean(
    dir: &Path,
    net: &NetnsPair,
    a: &Path,
    replica: &mut Process,
    reads: &[&str],
) {
    let output = vouch_in(Some(&net.exporter), &["check", s(a)]);
    assert!(output.status.success(), "check: {}", text(&output));
    let output = vouch_in(Some(&net.exporter), &["scrub", s(a), "--json"]);
    let scrub: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|error| panic!("{error}: {}", text(&output)));
    assert!(output.status.success(), "{scrub}");
    assert_eq!(scrub["report"]["found"], 0, "the legs differ: {scrub}");
    assert!(
        scrub["report"]["blocks_checked"].as_u64() > Some(0),
        "{scrub}"
    );
    let mut exporter = exporter(dir, &[s(a)], &net.exporter);
    qemu_io_ok(&net.exporter, &format!("nbd://{}", exporter.addr), reads);
    assert!(exporter.stop().is_some_and(|s| s.success()));
    replica.stop();
    let leg = dir.join("replicas").join("disk");
    let output = vouch_in(None, &["check", s(&leg)]);
    assert!(
        output.status.success(),
        "the replica's volume: {}",
        text(&output)
    );
}

/// Leg 1's resync copied exactly its map, not the volume: at most the
/// blocks written after the leg was last known in sync (`written`), and
/// at least those written after it was marked stale (`after`).
fn assert_map_tracked(progress: &serde_json::Value, written: u64, after: u64, blocks: u64) {
    assert_eq!(progress["state"], "done", "{progress}");
    assert_eq!(progress["full"], false, "a map-tracked resync: {progress}");
    let copied = progress["copied"].as_u64().expect("copied");
    assert_eq!(
        Some(copied),
        progress["blocks_to_copy"].as_u64(),
        "{progress}"
    );
    assert_eq!(progress["left"], 0, "{progress}");
    eprintln!("resync copied {copied} blocks; {written} written since the last common flush, {after} after the leg went stale; the volume has {blocks}");
    assert!(
        (after..=written).contains(&copied),
        "copied {copied}, not within [{after}, {written}]"
    );
    assert!(copied * 4 < blocks, "{copied} of {blocks} blocks");
}

#[test]
fn a_replica_killed_mid_run_is_resynced_online_with_only_the_blocks_it_may_lack() {
    let dir = tempfile::tempdir().expect("tempdir");
    let net = NetnsPair::new("rkill");
    let replicas = dir.path().join("replicas");
    let listen = format!("{}:7000", net.replica_ip);
    let mut replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
        .unwrap_or_else(|error| panic!("{error}"));
    let a = dir.path().join("a");
    let url = format!("vouch://{listen}/disk");
    let output = vouch_in(
        Some(&net.exporter),
        &["create", s(&a), "--size", "256MiB", "--mirror", &url],
    );
    assert!(output.status.success(), "{}", text(&output));
    // The control API on the exporter's own loopback (its namespace).
    let control = "127.0.0.1:7100";
    let mut exporter = exporter(dir.path(), &[s(&a), "--control", control], &net.exporter);
    let uri = format!("nbd://{}", exporter.addr);
    qemu_io_ok(&net.exporter, &uri, &["write -P 0x11 0 8M", "flush"]);
    // 32 writes of 1 MiB, each flushed; the replica is SIGKILLed once
    // 8 of them reached its disk.
    let data = replicas.join("disk").join("data.00000");
    let commands: Vec<String> = (0..32)
        .flat_map(|i| [format!("write -P 0x22 {}M 1M", 8 + i), "flush".to_string()])
        .collect();
    let mut writer = qemu_io_command(&net.exporter, &uri, &commands)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn qemu-io");
    let before = allocated_bytes(&data);
    let deadline = Instant::now() + Duration::from_secs(30);
    while allocated_bytes(&data) < before + (8 << 20) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    replica.kill9();
    let status = wait_timeout(&mut writer, TIMEOUT).expect("qemu-io finished");
    let output = writer.wait_with_output().expect("qemu-io output");
    assert!(status.success(), "{output:?}");
    let reached = allocated_bytes(&data).saturating_sub(before) / BLOCK;
    // Written while it is away.
    qemu_io_ok(&net.exporter, &uri, &["write -P 0x33 40M 2M", "flush"]);
    let log = exporter.log_text();
    assert!(log.contains("STALE (unreachable)"), "{log}");
    // Writes in flight when the leg was taken out fail too; no resync
    // ran, so none of them is reported as a resync stopping.
    assert!(!log.contains("resyncing leg failed"), "{log}");
    let since_flush = logged_number(&log, "since_flush").expect("the map's start logged");
    // Each write is flushed before the next: at most one is unflushed
    // (1 MiB, or the 2 MiB one if the kill came that late).
    assert!(
        since_flush <= 512,
        "{since_flush} blocks since the last flush"
    );

    // The replica comes back; the running exporter reconnects to it and
    // resyncs it online.
    let mut replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
        .unwrap_or_else(|error| panic!("{error}"));
    let row = resync_leg_1_online(&net.exporter, control);
    assert_eq!(row["state"], "active", "{row}");
    let progress = row["resync"].clone();
    // Writes after the resync reach both legs.
    qemu_io_ok(&net.exporter, &uri, &["write -P 0x34 42M 1M", "flush"]);
    assert!(exporter.stop().is_some_and(|s| s.success()));
    // What reached the replica's disk before the kill was flushed there,
    // but for at most the one write in flight.
    let written = (32 + 2) * 256;
    eprintln!("{reached} blocks reached the replica's disk before the kill");
    assert_map_tracked(&progress, written, 2 * 256, 256 * 256);
    assert!(
        progress["copied"].as_u64() <= Some(written - reached + 256),
        "{progress}: the blocks the replica held were copied again"
    );
    assert_legs_identical_and_clean(
        dir.path(),
        &net,
        &a,
        &mut replica,
        &[
            "read -P 0x11 0 8M",
            "read -P 0x22 8M 32M",
            "read -P 0x33 40M 2M",
            "read -P 0x34 42M 1M",
        ],
    );
}

#[test]
fn a_replica_cut_off_mid_run_is_resynced_offline_with_only_the_blocks_it_may_lack() {
    let dir = tempfile::tempdir().expect("tempdir");
    let net = NetnsPair::new("rcut");
    let replicas = dir.path().join("replicas");
    let listen = format!("{}:7000", net.replica_ip);
    let mut replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
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
    // Flushed on both legs, then 1 MiB more (qemu-io flushes it as it
    // exits): the map holds the write that timed out and what follows.
    qemu_io_ok(
        &net.exporter,
        &uri,
        &["write -P 0x44 0 4M", "flush", "write -P 0x45 4M 1M"],
    );
    set_replica_link(&net, "down");
    qemu_io_ok(
        &net.exporter,
        &uri,
        &[
            "write -P 0x55 8M 4M",
            "flush",
            "write -P 0x56 16M 1M",
            "flush",
        ],
    );
    let log = exporter.log_text();
    assert!(log.contains("STALE (unreachable)"), "{log}");
    // Writes in flight when the leg was taken out fail too; no resync
    // ran, so none of them is reported as a resync stopping.
    assert!(!log.contains("resyncing leg failed"), "{log}");
    let since_flush = logged_number(&log, "since_flush").expect("the map's start logged");
    assert!(
        (1024..=256 + 1024).contains(&since_flush),
        "{since_flush}: the failing write (and 1 MiB if qemu-io did not flush it)"
    );
    assert!(exporter.stop().is_some_and(|s| s.success()));
    set_replica_link(&net, "up");
    let progress = resync_leg_1(&net.exporter, &a);
    assert_map_tracked(&progress, 256 + 1024 + 256, 1024 + 256, 64 * 256);
    assert_legs_identical_and_clean(
        dir.path(),
        &net,
        &a,
        &mut replica,
        &[
            "read -P 0x44 0 4M",
            "read -P 0x45 4M 1M",
            "read -P 0x55 8M 4M",
            "read -P 0x56 16M 1M",
        ],
    );
}
