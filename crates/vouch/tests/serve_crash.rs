//! End-to-end crash tests with real processes: a deterministic libnbd client
//! (python3-libnbd, asynchronous, up to 16 requests in flight) writes,
//! zeroes, trims, flushes and FUA-writes blocks whose content encodes
//! (block, write), then SIGKILLs `vouch serve` at a seeded moment with
//! requests in flight. After each kill the volume is checked offline, the
//! server restarted, and every block must read what a process crash keeps
//! (docs/CRASH_MODEL.md): a block whose last write was acknowledged —
//! flushed or not — reads it or a later write; any other block reads a
//! write still in flight or its previous value — never garbage, never an
//! error. For each mode: split and packed, small journals, `--direct`,
//! encrypted, a local 2-way mirror. Plus one kill under a fio workload.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::crash::{cycle_result, mix, CYCLE_TIMEOUT, WORKLOAD};
use common::*;

/// Blocks in the test volume (8 MiB).
const BLOCKS: u64 = 2048;

/// How the crashed server runs its volume.
#[derive(Clone, Copy, Default)]
struct Mode {
    journal: Option<&'static str>,
    /// `serve --direct` (O_DIRECT data, io_uring).
    direct: bool,
    /// An encrypted volume (its key in a file).
    encrypted: bool,
    /// A local 2-way mirror (`create --mirror`).
    mirror: bool,
}

fn crash_cycles(layout: &str, journal: Option<&'static str>, seed: u64, cycles: u64) {
    crash_cycles_in(
        layout,
        Mode {
            journal,
            ..Mode::default()
        },
        seed,
        cycles,
    );
}

fn crash_cycles_in(layout: &str, mode: Mode, seed: u64, cycles: u64) {
    let journal = mode.journal;
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let state = dir.path().join("state.json");
    let size = (BLOCKS * BLOCK).to_string();
    let key = dir.path().join("key");
    std::fs::write(&key, [0x6b; 32]).expect("write key");
    // Arguments `info` and `check` need to open the volume offline.
    let offline: Vec<&str> = if mode.encrypted {
        vec!["--key-file", s(&key)]
    } else {
        vec![]
    };
    let mut args = vec![s(&volume)];
    if mode.mirror {
        let leg = dir.path().join("leg1");
        let mut create = vec!["create", s(&volume), "--size", &size, "--layout", layout];
        create.extend(["--mirror", s(&leg)]);
        if let Some(journal) = journal {
            create.extend(["--journal", journal]);
        }
        vouch_ok(&create);
    } else {
        args.extend(["--create", &size, "--layout", layout]);
        if let Some(journal) = journal {
            args.extend(["--journal", journal]);
        }
    }
    if mode.encrypted {
        args.extend(["--encrypt", "--key-file", s(&key)]);
    }
    if mode.direct {
        args.push("--direct");
    }
    let mut server = Server::start(dir.path(), &args);
    let blocks = BLOCKS.to_string();
    let mut total_issued = 0;
    let mut total_acked_unflushed = 0;
    let mut offline_refused = 0;
    for cycle in 1..=cycles {
        let cycle_seed = mix(seed ^ cycle);
        let kill_after = 20 + mix(cycle_seed) % 3000;
        let pid = server.pid.to_string();
        let output = py_timeout(
            WORKLOAD,
            &[
                &server.uri,
                &pid,
                s(&state),
                &cycle_seed.to_string(),
                &cycle.to_string(),
                &kill_after.to_string(),
                &blocks,
            ],
            CYCLE_TIMEOUT,
        );
        let context = format!(
            "layout {layout}, journal {journal:?}, direct {}, encrypted {}, mirror {}, seed {seed}, cycle {cycle}, kill after {kill_after}",
            mode.direct, mode.encrypted, mode.mirror
        );
        let result = cycle_result(
            &output,
            &format!("{context}: after the previous crash"),
            &server.log_text(),
        );
        total_issued += result["issued"].as_u64().unwrap_or(0);
        total_acked_unflushed += result["acked_unflushed"].as_u64().unwrap_or(0);
        let status = server.reap(Duration::from_secs(10));
        assert!(
            !status.success(),
            "{context}: the server was not killed: {status:?}"
        );
        // The crashed volume, offline: not closed cleanly, yet no faults.
        // (A packed volume whose journal held trims once could not be
        // opened read-only: serve_lifecycle.rs
        // crashed_packed_volume_with_trims_opens_read_only guards that fix.
        // Should the refusal come back, such crash states are counted here.)
        let mut info_args = vec!["info", s(&volume), "--json"];
        info_args.extend(&offline);
        let info = vouch(&info_args);
        if layout == "packed" && text(&info).contains("trims not yet applied") {
            offline_refused += 1;
        } else {
            assert!(
                info.status.success(),
                "{context}: info after the crash:\n{}",
                text(&info)
            );
            let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("info json");
            assert_eq!(info["clean"], false, "{context}: {info}");
            let (code, faults) = offline_check(&volume, &offline, mode.mirror);
            if (code, faults.is_empty()) != (0, true) {
                offline_faults(&context, &volume, &state, &server, code, &faults);
            }
        }
        server = server.restart();
        let log = server.log_text();
        assert!(
            log.lines()
                .filter(|line| line.contains("torn"))
                .all(|line| line.contains(", 0 torn") || line.contains("torn=0")),
            "{context}: recovery reported torn blocks without sector tearing:\n{log}"
        );
    }
    // The last crash's state, then a clean stop.
    let pid = server.pid.to_string();
    let output = py_timeout(
        WORKLOAD,
        &[&server.uri, &pid, s(&state), "0", "0", "0", &blocks],
        CYCLE_TIMEOUT,
    );
    cycle_result(
        &output,
        &format!("layout {layout}, seed {seed}: after the last crash"),
        &server.log_text(),
    );
    server.stop();
    let mut info_args = vec!["info", s(&volume), "--json"];
    info_args.extend(&offline);
    let info: serde_json::Value =
        serde_json::from_slice(&vouch_ok(&info_args).stdout).expect("info --json");
    assert_eq!(info["clean"], true);
    assert_eq!(offline_check(&volume, &offline, mode.mirror), (0, vec![]));
    assert!(
        total_acked_unflushed > 0,
        "no kill found an acknowledged write not yet flushed: the test proved nothing"
    );
    eprintln!(
        "{layout} journal {journal:?}: {cycles} kills, {total_issued} requests, \
         {total_acked_unflushed} blocks acknowledged and not flushed at a kill, \
         {offline_refused} crash states refused read-only, {:?}",
        started.elapsed()
    );
}

/// `vouch check --json` of the volume: (exit code, faults), a mirror's
/// faults those of every leg.
fn offline_check(
    volume: &std::path::Path,
    extra: &[&str],
    mirror: bool,
) -> (i32, Vec<(u64, String)>) {
    if !mirror {
        return check_faults_with(volume, extra);
    }
    let mut args = vec!["check", s(volume), "--json"];
    args.extend(extra);
    let output = vouch(&args);
    let json: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("check --json output ({e}): {}", text(&output)));
    let legs = json["legs"]
        .as_array()
        .expect("a mirror's check lists legs");
    let faults = legs
        .iter()
        .flat_map(|leg| leg["faults"].as_array().cloned().unwrap_or_default())
        .map(|fault| {
            (
                fault["lba"].as_u64().expect("lba"),
                fault["kind"].as_str().expect("kind").to_string(),
            )
        })
        .collect();
    (output.status.code().expect("exit code"), faults)
}

/// `vouch check` found faults in a volume a process kill left behind. Keep
/// the evidence, see what a read-write recovery and the clients make of it,
/// and fail with all of it.
fn offline_faults(
    context: &str,
    volume: &std::path::Path,
    state: &std::path::Path,
    server: &Server,
    code: i32,
    faults: &[(u64, String)],
) -> ! {
    let evidence = std::env::temp_dir().join(format!(
        "vouch-crash-evidence-{}",
        context.replace([' ', ',', '"', '(', ')'], "_")
    ));
    let _ = std::fs::remove_dir_all(&evidence);
    let copied = run(Command::new("cp").args(["-a", s(volume), s(&evidence)]));
    let info = text(&vouch(&["info", s(volume), "--json"]));
    let restarted = server.restart();
    let pid = restarted.pid.to_string();
    let blocks = BLOCKS.to_string();
    let online = py_timeout(
        WORKLOAD,
        &[&restarted.uri, &pid, s(state), "0", "0", "0", &blocks],
        CYCLE_TIMEOUT,
    );
    let recovery_log = restarted.log_text();
    drop(restarted);
    let (after_code, after_faults) = check_faults(volume);
    panic!(
        "{context}: `vouch check` of the crashed volume (a process kill, no \
         power loss) exits {code} with {} faults: {faults:?}\n\
         info: {info}\n\
         evidence (copy of the crashed volume): {} ({:?})\n\
         after a read-write restart the clients read: {}\n\
         recovery log:\n{recovery_log}\n\
         check after that recovery: exit {after_code}, {after_faults:?}",
        faults.len(),
        evidence.display(),
        copied.status,
        String::from_utf8_lossy(&online.stdout).trim(),
    );
}

#[test]
fn sigkill_with_requests_in_flight_split() {
    crash_cycles("split", None, 0x5EED_0001, 10);
}

#[test]
fn sigkill_with_requests_in_flight_packed() {
    crash_cycles("packed", None, 0x5EED_0002, 10);
}

#[test]
fn sigkill_with_requests_in_flight_split_direct() {
    let mode = Mode {
        direct: true,
        ..Mode::default()
    };
    crash_cycles_in("split", mode, 0x5EED_0005, 6);
}

#[test]
fn sigkill_with_requests_in_flight_packed_direct() {
    let mode = Mode {
        direct: true,
        ..Mode::default()
    };
    crash_cycles_in("packed", mode, 0x5EED_0006, 6);
}

#[test]
fn sigkill_with_requests_in_flight_encrypted() {
    let mode = Mode {
        encrypted: true,
        ..Mode::default()
    };
    crash_cycles_in("split", mode, 0x5EED_0007, 6);
}

#[test]
fn sigkill_with_requests_in_flight_encrypted_packed() {
    let mode = Mode {
        encrypted: true,
        ..Mode::default()
    };
    crash_cycles_in("packed", mode, 0x5EED_0008, 4);
}

#[test]
fn sigkill_with_requests_in_flight_local_mirror() {
    let mode = Mode {
        mirror: true,
        ..Mode::default()
    };
    crash_cycles_in("split", mode, 0x5EED_0009, 6);
}

/// The smallest journal: commits split across records and checkpoints run
/// constantly, so kills land inside them.
#[test]
fn sigkill_with_requests_in_flight_split_small_journal() {
    crash_cycles("split", Some("1MiB"), 0x5EED_0003, 6);
}

#[test]
fn sigkill_with_requests_in_flight_packed_small_journal() {
    crash_cycles("packed", Some("1MiB"), 0x5EED_0004, 6);
}

/// fio random writes at queue depth 16, SIGKILL mid-run: the volume checks
/// clean offline, recovers, and every byte reads without error.
#[test]
fn sigkill_under_fio_randwrite() {
    let fio = tool("fio", "fio");
    let nbdcopy = tool("nbdcopy", "libnbd-bin");
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    for layout in ["split", "packed"] {
        let volume = volume.with_extension(layout);
        let mut server = Server::start(
            dir.path(),
            &[
                s(&volume),
                "--create",
                "64MiB",
                "--layout",
                layout,
                "--metrics",
                "127.0.0.1:0",
            ],
        );
        let mut child = Command::new(&fio)
            .current_dir(dir.path())
            .args([
                "--name=crash",
                "--ioengine=nbd",
                &format!("--uri={}", server.uri),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=64m",
                "--time_based",
                "--runtime=30",
                "--fsync=32",
                "--verify=crc32c",
                "--do_verify=0",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn fio");
        // Killed mid-run (fio writes for 30 s): once 1,000 writes and a
        // flush were answered, with more in flight.
        let answered = |command: &str| {
            let text = server.metrics_text();
            let series =
                format!(r#"vouch_nbd_requests_total{{command="{command}",export="vol.{layout}"}}"#);
            metric(&text, &series).unwrap_or(0.0)
        };
        wait_until("fio's writes and a flush answered", TIMEOUT, || {
            answered("write") >= 1000.0 && answered("flush") >= 1.0
        });
        assert!(
            server.is_running(),
            "server died under fio:\n{}",
            server.log_text()
        );
        server.kill9();
        let fio_status = wait_timeout(&mut child, Duration::from_secs(20));
        if fio_status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("fio did not notice the server was gone");
        }
        assert_eq!(info_json(&volume)["clean"], false);
        assert_check_clean(&volume);
        let mut server = server.restart();
        run_ok(Command::new(&nbdcopy).args([&server.uri, "null:"]));
        server.stop();
        assert_check_clean(&volume);
    }
}
