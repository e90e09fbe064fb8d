//! Process crashes of a 2-way mirror whose second leg is a remote replica
//! on another "host" (network namespaces joined by a veth pair, as in
//! replica_netns.rs), under the crash workload of serve_crash.rs (libnbd,
//! 16 requests in flight, writes of 4 KiB-1 MiB, zeroes, trims, flushes
//! and FUA, most writes not flushed when the kill lands):
//!
//! - `kill -9` of the exporter: after a restart every acknowledged write
//!   reads back, `mirror status` shows the replica `reconciling` and then
//!   active, nothing is counted against a leg (the corrected-error gauge
//!   stays 0), and the legs hold the same bytes (issues 29 and 31).
//! - `kill -9` of the replica server: the exporter goes on answering
//!   writes, the leg goes stale; the replica's own volume holds every
//!   write it acknowledged before the kill; once it is back and resynced,
//!   both legs hold every acknowledged write.
//! - `kill -9` of the exporter while the replica's resync runs: after a
//!   restart every acknowledged write reads back and the resync resumes
//!   and finishes.
//!
//! Each ends with the legs compared: an offline scrub finds no block that
//! differs and corrects nothing, and the replica's volume, served alone,
//! reads every acknowledged write.

mod common;
mod replica_support;

use std::path::PathBuf;
use std::time::Duration;

use common::crash::{cycle_result, mix, Cycle, CYCLE_TIMEOUT, WORKLOAD};
use common::*;
use replica_support::*;
use serde_json::Value;

/// Blocks in the test volume (16 MiB: 4 extents of the activity log).
const BLOCKS: u64 = 4096;
/// The exporter's control API and metrics, on its namespace's loopback.
const CONTROL: &str = "127.0.0.1:7100";
const METRICS: &str = "127.0.0.1:7101";
/// A slow resync and reconciliation (1-2 MiB/s: seconds for what a test
/// writes), so the states they pass through are seen.
const SLOW: &[&str] = &["--resync-min", "1M", "--resync-max", "2M"];

/// A 2-way mirror `a` (a local leg and `vouch://REPLICA:7000/disk`), its
/// replica server and its exporter, each in its own namespace, and the
/// crash workload's state.
struct Remote {
    dir: tempfile::TempDir,
    net: NetnsPair,
    replicas: PathBuf,
    listen: String,
    a: PathBuf,
    state: PathBuf,
    seed: u64,
    /// The exporter's arguments after the volume and its addresses.
    extra: Vec<String>,
    replica: Process,
    exporter: Process,
    /// Blocks acknowledged and not flushed when a kill landed, summed.
    acked_unflushed: u64,
}

impl Remote {
    fn new(tag: &str, seed: u64, extra: &[&str]) -> Remote {
        let dir = tempfile::tempdir().expect("tempdir");
        let net = NetnsPair::new(tag);
        let replicas = dir.path().join("replicas");
        let listen = format!("{}:7000", net.replica_ip);
        let replica = replica_server(&replicas, &listen, &["--insecure"], Some(&net.replica))
            .unwrap_or_else(|error| panic!("{error}"));
        let a = dir.path().join("a");
        let url = format!("vouch://{listen}/disk");
        let size = (BLOCKS * BLOCK).to_string();
        let output = vouch_in(
            Some(&net.exporter),
            &["create", s(&a), "--size", &size, "--mirror", &url],
        );
        assert!(output.status.success(), "{}", text(&output));
        let exporter = exporter(
            dir.path(),
            &exporter_args(&a, &extra.iter().map(|e| e.to_string()).collect::<Vec<_>>()),
            &net.exporter,
        );
        let state = dir.path().join("state.json");
        Remote {
            dir,
            net,
            replicas,
            listen,
            a,
            state,
            seed,
            extra: extra.iter().map(|e| e.to_string()).collect(),
            replica,
            exporter,
            acked_unflushed: 0,
        }
    }

    fn start_exporter(&self) -> Process {
        exporter(
            self.dir.path(),
            &exporter_args(&self.a, &self.extra),
            &self.net.exporter,
        )
    }

    fn start_replica(&self) -> Process {
        replica_server(
            &self.replicas,
            &self.listen,
            &["--insecure"],
            Some(&self.net.replica),
        )
        .unwrap_or_else(|error| panic!("{error}"))
    }

    fn logs(&self) -> String {
        format!(
            "--- exporter\n{}--- replica\n{}",
            self.exporter.log_text(),
            self.replica.log_text()
        )
    }

    /// One cycle of the crash workload from the exporter's namespace:
    /// verify every block, then write and SIGKILL `pid` after
    /// `kill_after` requests (and go on for `after_kill` more).
    fn cycle(&mut self, cycle: u64, pid: u32, kill_after: u64, after_kill: u64) -> Value {
        let uri = format!("nbd://{}", self.exporter.addr);
        let args = Cycle {
            uri: &uri,
            pid,
            state: &self.state,
            seed: mix(self.seed ^ cycle),
            cycle,
            kill_after,
            blocks: BLOCKS,
            after_kill,
        }
        .args();
        let output = py_in(&self.net.exporter, WORKLOAD, &args, CYCLE_TIMEOUT);
        let context = format!(
            "seed {:#x}, cycle {cycle}, kill after {kill_after} (+{after_kill})",
            self.seed
        );
        let result = cycle_result(&output, &context, &self.logs());
        self.acked_unflushed += result["acked_unflushed"].as_u64().unwrap_or(0);
        eprintln!("{context}: {result}");
        result
    }

    /// Every block through the exporter reads what the contract allows.
    fn verify(&mut self, when: &str) {
        let uri = format!("nbd://{}", self.exporter.addr);
        let args = Cycle::verify(&uri, &self.state, BLOCKS).args();
        let output = py_in(&self.net.exporter, WORKLOAD, &args, CYCLE_TIMEOUT);
        cycle_result(&output, when, &self.logs());
    }

    fn status(&self) -> Value {
        mirror_status_online(&self.net.exporter, CONTROL)
    }

    /// The replica's volume served alone (its server stopped or killed):
    /// every block reads what the workload's `state` file allows.
    fn verify_replica_alone(&self, state: &std::path::Path, when: &str) {
        let leg = self.replicas.join("disk");
        let mut server = Server::start(self.dir.path(), &[s(&leg), "--read-only"]);
        let args = Cycle::verify(&server.uri, state, BLOCKS).args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = py_timeout(WORKLOAD, &args, CYCLE_TIMEOUT);
        cycle_result(
            &output,
            &format!("the replica's volume alone, {when}"),
            &server.log_text(),
        );
        server.stop();
    }

    /// The end: the exporter stops cleanly, having faulted nothing; an
    /// offline scrub finds no block that differs between the legs and
    /// counts nothing against either; the replica's volume checks clean
    /// and, served alone, reads every acknowledged write; and some kill
    /// hit blocks acknowledged and not yet flushed.
    fn finish(mut self) {
        let status = self.exporter.stop();
        assert!(status.is_some_and(|s| s.success()), "{}", self.logs());
        let log = self.exporter.log_text();
        assert!(!log.contains("FAULTED"), "{log}");
        let output = vouch_in(Some(&self.net.exporter), &["scrub", s(&self.a), "--json"]);
        let scrub: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|error| panic!("{error}: {}", text(&output)));
        assert!(output.status.success(), "{scrub}");
        assert_eq!(scrub["report"]["found"], 0, "the legs differ: {scrub}");
        assert_eq!(scrub["report"]["blocks_checked"], BLOCKS, "{scrub}");
        for leg in scrub["legs"].as_array().expect("legs") {
            assert_eq!(leg["state"], "active", "{scrub}");
            assert_eq!(leg["corrected"], 0, "{scrub}");
        }
        self.replica.stop();
        let leg = self.replicas.join("disk");
        let output = vouch_in(None, &["check", s(&leg)]);
        assert!(
            output.status.success(),
            "the replica's volume: {}",
            text(&output)
        );
        self.verify_replica_alone(&self.state, "at the end");
        assert!(
            self.acked_unflushed > 0,
            "no kill found an acknowledged write not yet flushed: the test proved nothing"
        );
        eprintln!(
            "{} blocks acknowledged and not flushed at the kills",
            self.acked_unflushed
        );
    }
}

fn exporter_args<'a>(a: &'a std::path::Path, extra: &'a [String]) -> Vec<&'a str> {
    let mut args = vec![s(a), "--control", CONTROL, "--metrics", METRICS];
    args.extend(extra.iter().map(String::as_str));
    args
}

/// Leg 1's status row after its resync: done, nothing left, active.
fn assert_resynced(row: &Value) {
    assert_eq!(row["state"], "active", "{row}");
    assert_eq!(row["resync"]["state"], "done", "{row}");
    assert_eq!(row["resync"]["left"], 0, "{row}");
}

/// A gauge of the exporter's metrics for `volume="a"` and `leg`.
fn leg_gauge(metrics: &str, name: &str, leg: usize) -> Option<f64> {
    metric(metrics, &format!("{name}{{volume=\"a\",leg=\"{leg}\"}}"))
}

#[test]
fn an_exporter_killed_mid_stream_keeps_every_acknowledged_write_and_reconciles_the_replica() {
    let mut t = Remote::new("xkill", 0x5EED_0291, SLOW);
    for cycle in 1..=4 {
        let kill_after = 200 + mix(t.seed ^ cycle ^ 0xA) % 2000;
        let pid = t.exporter.pid;
        t.cycle(cycle, pid, kill_after, 0);
        t.exporter.kill9();
        t.exporter = t.start_exporter();
        // The replica may differ on the extents the activity log names:
        // reconciling, not faulted, not active yet.
        let first = t.status();
        let leg1 = &first["legs"][1];
        assert_eq!(leg1["state"], "reconciling", "cycle {cycle}: {first}");
        assert_eq!(leg1["present"], true, "{first}");
        let regions = leg1["reconcile"]["regions"].as_u64().expect("regions");
        assert!(
            (1..=BLOCKS / 1024).contains(&regions),
            "cycle {cycle}: {first}"
        );
        assert_eq!(first["legs"][0]["state"], "active", "{first}");
        // Reads while it reconciles: every acknowledged write.
        t.verify(&format!("cycle {cycle}: restarted, reconciling"));
        let mut last = Value::Null;
        wait_until(
            "the reconciliation to end",
            Duration::from_secs(120),
            || {
                last = t.status();
                // The leg turns active a moment before the job records
                // itself done (seen: active, "running" with 0 left).
                last["legs"][1]["state"] == "active"
                    && last["legs"][1]["reconcile"]["state"] != "running"
            },
        );
        let done = &last["legs"][1]["reconcile"];
        assert_eq!(done["state"], "done", "{last}");
        assert_eq!(done["regions_left"], 0, "{last}");
        assert_eq!(done["blocks_checked"], regions * 1024, "{last}");
        // Reconciliation is not a fault: nothing counted against a leg.
        let metrics = metrics_in(&t.net.exporter, METRICS);
        for leg in 0..2 {
            assert_eq!(
                leg_gauge(&metrics, "vouch_mirror_corrected_errors", leg),
                Some(0.0),
                "leg {leg}: {metrics}"
            );
            assert_eq!(
                leg_gauge(&metrics, "vouch_mirror_leg_active", leg),
                Some(1.0),
                "leg {leg}: {metrics}"
            );
        }
    }
    t.verify("after the last crash");
    t.finish();
}

#[test]
fn a_replica_killed_mid_stream_goes_stale_and_is_resynced_with_every_acknowledged_write() {
    let mut t = Remote::new("rkill", 0x5EED_0292, &[]);
    for cycle in 1..=3 {
        let kill_after = 100 + mix(t.seed ^ cycle ^ 0xB) % 1500;
        let pid = t.replica.pid;
        let result = t.cycle(cycle, pid, kill_after, 1000);
        t.replica.kill9();
        // The exporter went on answering writes from its local leg.
        assert!(
            result["acked_writes"].as_u64() > Some(900),
            "cycle {cycle}: {result}"
        );
        let status = t.status();
        assert_eq!(
            status["legs"][1]["state"], "stale",
            "cycle {cycle}: {status}"
        );
        assert_eq!(status["legs"][0]["state"], "active", "{status}");
        let log = t.exporter.log_text();
        assert!(log.contains("STALE (unreachable)"), "{log}");
        // The killed replica's own volume kept every write it answered
        // before the kill, flushed or not.
        let at_kill = t.state.with_extension("json.at_kill");
        t.verify_replica_alone(&at_kill, &format!("cycle {cycle}: killed"));
        t.replica = t.start_replica();
        assert_resynced(&resync_leg_1_online(&t.net.exporter, CONTROL));
        t.verify(&format!("cycle {cycle}: resynced"));
    }
    t.finish();
}

#[test]
fn an_exporter_killed_while_a_resync_runs_keeps_every_acknowledged_write_and_the_resync_finishes() {
    // Slow: the kills land while the resync runs.
    let mut t = Remote::new("xresync", 0x5EED_0293, SLOW);
    // The replica killed under writes: its map names what it missed.
    let pid = t.replica.pid;
    t.cycle(1, pid, 300, 2000);
    t.replica.kill9();
    t.replica = t.start_replica();
    start_resync_leg_1_online(&t.net.exporter, CONTROL);
    for cycle in 2..=3 {
        let row = t.status()["legs"][1].clone();
        assert_eq!(row["resync"]["state"], "running", "cycle {cycle}: {row}");
        let kill_after = 100 + mix(t.seed ^ cycle ^ 0xC) % 700;
        let pid = t.exporter.pid;
        t.cycle(cycle, pid, kill_after, 0);
        t.exporter.kill9();
        let log = t.exporter.log_text();
        assert!(
            !log.contains("resync done"),
            "cycle {cycle}: the resync ended before the kill:\n{log}"
        );
        // Restarted: the stale leg is back, its resync resumes from the map.
        t.exporter = t.start_exporter();
        t.verify(&format!("cycle {cycle}: restarted during the resync"));
    }
    assert_resynced(&wait_resync_leg_1(&t.net.exporter, CONTROL));
    t.verify("after the resync");
    t.finish();
}
