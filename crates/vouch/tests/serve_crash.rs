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

use common::*;

/// Blocks in the test volume (8 MiB).
const BLOCKS: u64 = 2048;

/// One cycle: verify the state left by the previous cycle, then (when
/// kill_after > 0) run the workload and SIGKILL the server after
/// `kill_after` requests were issued. Prints one JSON line.
const WORKLOAD: &str = r#"
import random
uri, pid, state_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seed, cycle, kill_after, nblocks = (int(a) for a in sys.argv[4:8])
ZERO = -1
rng = random.Random(seed)
state = json.load(open(state_path)) if os.path.exists(state_path) else {"allowed": {}}
h = connect(uri)

def decode(lba, block):
    if block == bytes(4096):
        return ZERO
    magic, who, tag = struct.unpack_from("<4sQQ", block)
    if magic == b"VCH1" and who == lba and block == block_data(lba, tag):
        return tag
    return None

# 1. Every block must hold a value the contract allows.
violations, baseline = [], {}
CHUNK = 64
for start in range(0, nblocks, CHUNK):
    try:
        data = h.pread(CHUNK * 4096, start * 4096)
    except nbd.Error as e:
        violations.append({"lbas": [start, start + CHUNK], "read_error": err_info(e)})
        continue
    for i in range(CHUNK):
        lba = start + i
        tag = decode(lba, data[i * 4096:(i + 1) * 4096])
        allowed = state["allowed"].get(str(lba), [ZERO])
        if tag is None or tag not in allowed:
            violations.append({"lba": lba, "got": "garbage" if tag is None else tag,
                               "allowed": allowed})
        baseline[lba] = tag
if kill_after == 0 or violations:
    print(json.dumps({"violations": violations, "issued": 0}))
    sys.exit(0)

# 2. The workload. Per block: the tags written this cycle in issue order
# (never two requests in flight on one block), the index of the last
# acknowledged one, and the index of the last durable one (flushed after its
# acknowledgement, or FUA).
flush_prob = rng.choice([0.002, 0.01, 0.03, 0.1])
fua_prob = rng.choice([0.0, 0.02, 0.1])
hot = 64
writes, last_acked, durable = {}, {}, {}
busy, inflight = set(), {}
issued, acked_writes, acked_flushes = 0, 0, 0

def complete(info):
    global acked_writes, acked_flushes
    if info[0] == "flush":
        acked_flushes += 1
        for lba, idx in info[1].items():
            if idx > durable.get(lba, -1):
                durable[lba] = idx
        return
    _, pairs, fua = info
    acked_writes += 1
    for lba, idx in pairs:
        busy.discard(lba)
        last_acked[lba] = max(last_acked.get(lba, -1), idx)
        if fua:
            durable[lba] = max(durable.get(lba, -1), idx)

killed = False
while not killed:
    while len(inflight) < 16:
        if issued == kill_after:
            os.kill(pid, signal.SIGKILL)
            killed = True
            break
        if rng.random() < flush_prob:
            inflight[h.aio_flush()] = ("flush", dict(last_acked))
            issued += 1
            continue
        n = rng.choice([1, 1, 1, 1, 2, 3, 8, 31, 64, 256])
        if rng.random() < 0.5:
            lba = rng.randrange(0, hot)
        else:
            lba = rng.randrange(0, nblocks - n + 1)
        n = min(n, nblocks - lba)
        lbas = range(lba, lba + n)
        if any(l in busy for l in lbas):
            continue
        tag = cycle * 1000000 + issued
        kind = rng.random()
        fua = rng.random() < fua_prob
        flags = nbd.CMD_FLAG_FUA if fua else 0
        if kind < 0.06:
            cookie = h.aio_zero(n * 4096, lba * 4096, flags=flags)
            tag = ZERO
        elif kind < 0.10:
            cookie = h.aio_trim(n * 4096, lba * 4096, flags=flags)
            tag = ZERO
        else:
            data = b"".join(block_data(l, tag) for l in lbas)
            cookie = h.aio_pwrite(data, lba * 4096, flags=flags)
        pairs = []
        for l in lbas:
            writes.setdefault(l, []).append(tag)
            pairs.append((l, len(writes[l]) - 1))
            busy.add(l)
        inflight[cookie] = ("write", pairs, fua)
        issued += 1
    if killed:
        break
    h.poll(-1)
    for cookie in list(inflight):
        if h.aio_command_completed(cookie):
            complete(inflight.pop(cookie))

# 3. What each block may read after the crash. A process crash keeps every
# acknowledged write, flushed or not (docs/CRASH_MODEL.md): a block reads
# its last acknowledged value or a later one. Requests still in flight (or
# answered but not yet seen) may or may not have happened.
allowed = {}
acked_unflushed = 0
for lba in range(nblocks):
    tags = writes.get(lba, [])
    if lba in last_acked:
        allowed[lba] = sorted(set(tags[last_acked[lba]:]))
        acked_unflushed += last_acked[lba] > durable.get(lba, -1)
    else:
        allowed[lba] = sorted(set([baseline[lba]] + tags))
with open(state_path + ".tmp", "w") as f:
    json.dump({"allowed": {str(k): v for k, v in allowed.items()}}, f)
os.replace(state_path + ".tmp", state_path)
print(json.dumps({"violations": [], "issued": issued, "in_flight": len(inflight),
                  "acked_writes": acked_writes, "acked_flushes": acked_flushes,
                  "durable_blocks": len(durable), "acked_unflushed": acked_unflushed,
                  "flush_prob": flush_prob}))
"#;

/// splitmix64: the per-cycle seeds and kill points.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

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
            Duration::from_secs(60),
        );
        let context = format!(
            "layout {layout}, journal {journal:?}, direct {}, encrypted {}, mirror {}, seed {seed}, cycle {cycle}, kill after {kill_after}",
            mode.direct, mode.encrypted, mode.mirror
        );
        assert!(
            output.status.success(),
            "{context}: workload failed:\n{}",
            text(&output)
        );
        let result: serde_json::Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("{context}: workload output ({e}):\n{}", text(&output)));
        assert_eq!(
            result["violations"],
            serde_json::json!([]),
            "{context}: after the previous crash, blocks read values the contract forbids\n{}",
            server.log_text()
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
        Duration::from_secs(60),
    );
    assert!(
        output.status.success(),
        "final verification:\n{}",
        text(&output)
    );
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(
        result["violations"],
        serde_json::json!([]),
        "layout {layout}, seed {seed}: after the last crash"
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
        Duration::from_secs(60),
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
