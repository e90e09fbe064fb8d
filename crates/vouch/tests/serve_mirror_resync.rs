//! Block-granular resync of a stale mirror leg, with real processes and
//! real NBD clients (qemu-io): a leg missing while the server runs misses
//! exactly the blocks written meanwhile, and an online resync copies
//! exactly those (counted by status and metrics); a SIGKILL mid-resync
//! resumes from the map; unknown history (a damaged map, a re-created
//! leg) gets a full resync; the ceiling bounds the rate; bad requests get
//! clear errors.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::clients::qemu_io_ok;
use common::control::request;
use common::*;
use serde_json::Value;

const SIZE: &str = "64MiB";
const BLOCKS: u64 = 64 * 256;

fn create_mirror(dir: &Path) {
    vouch_ok(&[
        "create",
        s(&dir.join("a")),
        "--size",
        SIZE,
        "--mirror",
        s(&dir.join("b")),
    ]);
}

/// A new 2-leg mirror (`a`, `b`) in `dir` whose leg 1 is then moved away
/// (to `away`): (a, b, away).
fn mirror_with_leg_1_away(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    create_mirror(dir);
    let (a, b, away) = (dir.join("a"), dir.join("b"), dir.join("away"));
    std::fs::rename(&b, &away).expect("take leg 1 away");
    (a, b, away)
}

/// `vouch serve` of leg `a` with the control API and these resync rates.
fn serve_with_rates(dir: &Path, a: &Path, min: &str, max: &str) -> Server {
    let args = [
        s(a),
        "--control",
        "127.0.0.1:0",
        "--resync-min",
        min,
        "--resync-max",
        max,
    ];
    Server::start(dir, &args)
}

/// A mirror served with these resync rates whose leg 1 was away while
/// the first 6 MiB were written (pattern 3), then brought back (not yet
/// resynced): the server and leg 1's path.
fn six_mib_marked_then_leg_1_back(dir: &Path, min: &str, max: &str) -> (Server, PathBuf) {
    let (a, b, away) = mirror_with_leg_1_away(dir);
    let server = serve_with_rates(dir, &a, min, max);
    qemu_io_ok(&server.uri, &["write -P 3 0 6M"]);
    std::fs::rename(&away, &b).expect("bring leg 1 back");
    (server, b)
}

/// Distinct LBAs spread over the volume (every region), each its own pattern.
fn scattered(n: u64) -> Vec<u64> {
    (0..n).map(|i| (i * 7919 + 3) % BLOCKS).collect()
}

fn write_blocks(uri: &str, lbas: &[u64], salt: u64) {
    let commands: Vec<String> = lbas
        .iter()
        .map(|lba| format!("write -P {} {} 4k", (lba + salt) % 251 + 1, lba * 4096))
        .collect();
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    for chunk in commands.chunks(200) {
        qemu_io_ok(uri, chunk);
    }
}

fn mirror_status(server: &Server) -> Value {
    let (status, answer) = request(
        common::control::control(server),
        "GET",
        "/v1/mirrors/a",
        None,
        None,
    );
    assert_eq!(status, 200, "{answer}");
    answer
}

fn leg1(server: &Server) -> Value {
    mirror_status(server)["legs"][1].clone()
}

/// Wait until leg 1's resync has ended (not running); its JSON row.
fn wait_resync_end(server: &Server, timeout: Duration) -> Value {
    let mut last = Value::Null;
    wait_until("the resync to end", timeout, || {
        last = leg1(server);
        last["resync"].is_object() && last["resync"]["state"] != "running"
    });
    last
}

fn leg_bytes(dir: &Path, leg: &Path) -> Vec<u8> {
    let raw = dir.join(format!(
        "{}.raw",
        leg.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&raw);
    vouch_ok(&["export", s(leg), s(&raw)]);
    let bytes = std::fs::read(&raw).expect("read export");
    std::fs::remove_file(&raw).expect("remove export");
    bytes
}

/// Leg 1's resync row: done, the 1,536 blocks of 6 MiB copied, in at
/// least 2.5 s (`how` says why it had to take that long).
fn assert_six_mib_resynced_in_at_least_2500_ms(row: &Value, how: &str) {
    assert_eq!(row["resync"]["state"], "done", "{row}");
    assert_eq!(row["resync"]["copied"], 1536, "{row}");
    let elapsed = row["resync"]["elapsed_ms"].as_u64().expect("elapsed");
    assert!(elapsed >= 2500, "6 MiB {how} took only {elapsed} ms: {row}");
}

/// Every leg active and clean, byte-identical, no resync map left.
fn assert_legs_agree(dir: &Path) {
    let (a, b) = (dir.join("a"), dir.join("b"));
    assert_check_clean(&a);
    let status = vouch(&["mirror", "status", s(&a)]);
    assert_eq!(status.status.code(), Some(0), "{}", text(&status));
    let (left, right) = (leg_bytes(dir, &a), leg_bytes(dir, &b));
    let first = left.iter().zip(&right).position(|(x, y)| x != y);
    assert!(
        left.len() == right.len() && first.is_none(),
        "legs differ (first at byte {first:?})"
    );
    assert!(!a.join("mirror.dirty.1").exists(), "the map is removed");
}

fn control_args(server: &Server) -> Vec<String> {
    vec![
        "--server".into(),
        common::control::control(server).to_string(),
    ]
}

#[test]
fn a_leg_back_online_gets_exactly_the_blocks_written_while_it_was_away() {
    let dir = tempfile::tempdir().expect("tempdir");
    create_mirror(dir.path());
    let (a, b, away) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("away"),
    );
    write_blocks_offline_setup(dir.path());
    std::fs::rename(&b, &away).expect("take leg 1 away");
    let mut server = Server::start(
        dir.path(),
        &[
            s(&a),
            "--control",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    let written = scattered(37);
    write_blocks(&server.uri, &written, 5);
    let row = leg1(&server);
    assert_eq!(row["state"], "stale", "{row}");
    assert_eq!(row["dirty_blocks"], written.len() as u64, "{row}");
    std::fs::rename(&away, &b).expect("bring leg 1 back");
    let mut args = vec!["mirror", "resync", "a", "--leg", "1"];
    let control = control_args(&server);
    args.extend(control.iter().map(String::as_str));
    let started = vouch_ok(&args);
    assert!(
        text(&started).contains("resync of 37 blocks"),
        "{}",
        text(&started)
    );
    let row = wait_resync_end(&server, Duration::from_secs(60));
    assert_eq!(row["resync"]["state"], "done", "{row}");
    assert_eq!(row["state"], "active", "{row}");
    assert_eq!(
        row["resync"]["copied"], 37,
        "exactly the written blocks: {row}"
    );
    assert_eq!(row["resync"]["blocks_to_copy"], 37, "{row}");
    assert_eq!(row["resync"]["left"], 0, "{row}");
    let metrics = server.metrics_text();
    assert_eq!(
        metric(
            &metrics,
            "vouch_mirror_resync_copied_blocks{volume=\"a\",leg=\"1\"}"
        ),
        Some(37.0),
        "{metrics}"
    );
    // The CLI against the server shows the finished resync.
    let mut args = vec!["mirror", "status", "a"];
    args.extend(control.iter().map(String::as_str));
    let status = vouch(&args);
    assert_eq!(status.status.code(), Some(0), "{}", text(&status));
    assert!(
        text(&status).contains("resync done: 37 of 37 blocks copied, 0 left"),
        "{}",
        text(&status)
    );
    // Writes after the resync reach both legs; reads see them.
    write_blocks(&server.uri, &[1, 2, 3], 9);
    server.stop();
    assert_legs_agree(dir.path());
    // The leg opened while serving was closed cleanly too.
    let mut server = Server::start(dir.path(), &[s(&a)]);
    assert!(
        !server.log_text().contains("not shut down cleanly"),
        "{}",
        server.log_text()
    );
    server.stop();
}

/// Some data on both legs before a leg goes away.
fn write_blocks_offline_setup(dir: &Path) {
    let mut server = Server::start(dir, &[s(&dir.join("a"))]);
    write_blocks(&server.uri, &scattered(10), 1);
    server.stop();
}

#[test]
fn a_resync_killed_midway_resumes_from_its_map_and_the_ceiling_bounds_its_rate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, away) = mirror_with_leg_1_away(dir.path());
    let mut server = Server::start(dir.path(), &[s(&a)]);
    // 12 MiB in 3 regions: 3072 blocks.
    qemu_io_ok(
        &server.uri,
        &["write -P 7 0 4M", "write -P 8 20M 4M", "write -P 9 40M 4M"],
    );
    server.stop();
    std::fs::rename(&away, &b).expect("bring leg 1 back");
    // Present at open: the resync starts by itself, at 1 MiB/s at most.
    let started = Instant::now();
    let mut server = serve_with_rates(dir.path(), &a, "512K", "1M");
    let mut row = Value::Null;
    wait_until("some blocks copied", Duration::from_secs(30), || {
        row = leg1(&server);
        row["resync"]["copied"].as_u64().unwrap_or(0) > 0
    });
    assert_eq!(row["state"], "resyncing", "{row}");
    assert_eq!(row["resync"]["blocks_to_copy"], 3072, "{row}");
    // Until it is paced: a MiB past the first batch (4 MiB).
    wait_until(
        "copies past the first batch",
        Duration::from_secs(30),
        || {
            row = leg1(&server);
            row["resync"]["copied"].as_u64().unwrap_or(0) >= 1280
        },
    );
    let copied = row["resync"]["copied"].as_u64().expect("copied");
    // The ceiling: at most 1 MiB/s after the first batch (a lower bound
    // on the time taken, which a slow machine only widens).
    let seconds = started.elapsed().as_secs_f64();
    assert!(
        (copied * 4096) as f64 <= 4.0 * 1048576.0 + 1048576.0 * seconds,
        "{copied} blocks in {seconds:.1}s exceeds a 1 MiB/s ceiling: {row}"
    );
    server.kill9();
    let status = vouch(&["mirror", "status", s(&a), "--json"]);
    let status: Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    let left = status["legs"][1]["dirty_blocks"].as_u64().expect("a map");
    assert!(
        left > 0 && left < 3072,
        "after the kill the map holds what is left ({left} of 3072): {status}"
    );
    assert_eq!(status["legs"][1]["state"], "stale", "{status}");
    let info = vouch_ok(&["info", s(&a)]);
    assert!(
        text(&info).contains(&format!("resync: {left} blocks to copy")),
        "{}",
        text(&info)
    );
    // Restarted at full speed, the resync resumes with what was left.
    let mut server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    let row = wait_resync_end(&server, Duration::from_secs(60));
    assert_eq!(row["resync"]["state"], "done", "{row}");
    assert_eq!(
        row["resync"]["blocks_to_copy"], left,
        "resumed, not restarted: {row}"
    );
    server.stop();
    assert_legs_agree(dir.path());
}

#[test]
fn the_rate_ceiling_makes_a_resync_take_at_least_size_over_rate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, away) = mirror_with_leg_1_away(dir.path());
    let mut server = Server::start(dir.path(), &[s(&a)]);
    qemu_io_ok(&server.uri, &["write -P 3 0 6M"]);
    server.stop();
    std::fs::rename(&away, &b).expect("bring leg 1 back");
    let mut server = serve_with_rates(dir.path(), &a, "1M", "2M");
    let row = wait_resync_end(&server, Duration::from_secs(60));
    // 6 MiB at 2 MiB/s: at least 3 s (loosely: 2.5 s).
    assert_six_mib_resynced_in_at_least_2500_ms(&row, "at a 2 MiB/s ceiling");
    server.stop();
    assert_legs_agree(dir.path());
}

/// Reads 4 KiB blocks at random over the volume without pause until the
/// file `argv[2]` exists; touches `argv[3]` after its first 16 reads;
/// prints how many it read.
const READER: &str = r#"
h = connect(sys.argv[1])
stop, started = sys.argv[2], sys.argv[3]
blocks = h.get_size() // 4096
n = 0
while not os.path.exists(stop):
    h.pread(4096, (n * 7919) % blocks * 4096)
    n += 1
    if n == 16:
        open(started, "w").close()
print(json.dumps({"reads": n}))
"#;

/// Run the client `script` (`READER` or `WRITER`) on a thread against
/// `uri` and return once it has started: the file that stops it (once it
/// exists) and the thread, which yields the JSON it printed.
fn start_client(
    dir: &Path,
    uri: &str,
    script: &'static str,
    what: &'static str,
) -> (PathBuf, std::thread::JoinHandle<Value>) {
    let (stop, started) = (dir.join("stop"), dir.join("started"));
    let client = {
        let (uri, stop, started) = (uri.to_string(), stop.clone(), started.clone());
        std::thread::spawn(move || {
            let output = py_timeout(
                script,
                &[&uri, s(&stop), s(&started)],
                Duration::from_secs(120),
            );
            assert!(output.status.success(), "{what}: {}", text(&output));
            let stdout = String::from_utf8_lossy(&output.stdout).to_string();
            serde_json::from_str::<Value>(stdout.trim())
                .unwrap_or_else(|error| panic!("{what}'s JSON ({error}): {stdout}"))
        })
    };
    wait_until(
        &format!("the {what} to start"),
        Duration::from_secs(30),
        || started.exists(),
    );
    (stop, client)
}

/// Under client I/O the resync runs at its floor, not its ceiling, and the
/// floor keeps it moving: 6 MiB with a 2 MiB/s floor and a 1 GiB/s
/// ceiling, while a client reads without pause the whole time, takes at
/// least 6 MiB / 2 MiB/s (the ceiling would take milliseconds) and ends
/// while the client still reads (it stops only once told, after that).
/// How long a resync under load takes, and what it costs the client, is
/// bench/resync-online.sh's to measure.
#[test]
fn under_client_io_the_resync_runs_at_its_floor_and_finishes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut server, _) = six_mib_marked_then_leg_1_back(dir.path(), "2M", "1G");
    let (stop, reader) = start_client(dir.path(), &server.uri, READER, "reader");
    let mut args = vec!["mirror", "resync", "a", "--leg", "1"];
    let control = control_args(&server);
    args.extend(control.iter().map(String::as_str));
    vouch_ok(&args);
    // 60 s: a hang guard, for a floor that did not keep the resync going.
    let row = wait_resync_end(&server, Duration::from_secs(60));
    std::fs::write(&stop, b"").expect("stop the reader");
    let read = reader.join().expect("reader thread");
    assert_six_mib_resynced_in_at_least_2500_ms(
        &row,
        "under client I/O with a 2 MiB/s floor (the ceiling was used)",
    );
    let reads = read["reads"].as_u64().expect("reads");
    assert!(
        reads > 16 + 64,
        "the client read only {reads} times: {read}"
    );
    server.stop();
    assert_legs_agree(dir.path());
}

#[test]
fn unknown_history_gets_a_full_verified_resync() {
    let dir = tempfile::tempdir().expect("tempdir");
    create_mirror(dir.path());
    let (a, b, away) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("away"),
    );
    write_blocks_offline_setup(dir.path());
    std::fs::rename(&b, &away).expect("take leg 1 away");
    let mut server = Server::start(dir.path(), &[s(&a)]);
    write_blocks(&server.uri, &scattered(20), 2);
    server.stop();
    // A damaged map: status says so, and a full resync follows at open.
    let map = a.join("mirror.dirty.1");
    let mut bytes = std::fs::read(&map).expect("map");
    bytes[5 * 4096 / 2] ^= 0xff;
    std::fs::write(&map, &bytes).expect("damage the map");
    let status = vouch(&["mirror", "status", s(&a)]);
    assert!(
        text(&status).contains("unknown history") && text(&status).contains("checksum"),
        "{}",
        text(&status)
    );
    std::fs::rename(&away, &b).expect("bring leg 1 back");
    let mut server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    assert!(
        server.log_text().contains("unknown history"),
        "{}",
        server.log_text()
    );
    let row = wait_resync_end(&server, Duration::from_secs(120));
    assert_eq!(row["resync"]["state"], "done", "{row}");
    assert_eq!(row["resync"]["full"], true, "{row}");
    assert_eq!(row["resync"]["copied"], BLOCKS, "every block: {row}");
    server.stop();
    assert_legs_agree(dir.path());

    // A leg whose directory is gone, resynced online: re-created, full.
    std::fs::rename(&b, &away).expect("take leg 1 away again");
    let mut server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    write_blocks(&server.uri, &scattered(5), 3);
    std::fs::remove_dir_all(&away).expect("lose leg 1");
    let (code, answer) = request(
        common::control::control(&server),
        "POST",
        "/v1/mirrors/a/resync",
        Some(&serde_json::json!({"leg": 1})),
        None,
    );
    assert_eq!(code, 202, "{answer}");
    assert!(
        answer["message"]
            .as_str()
            .unwrap_or("")
            .contains("unknown history"),
        "{answer}"
    );
    let row = wait_resync_end(&server, Duration::from_secs(120));
    assert_eq!(row["resync"]["state"], "done", "{row}");
    assert_eq!(row["resync"]["copied"], BLOCKS, "{row}");
    server.stop();
    assert_legs_agree(dir.path());
}

#[test]
fn bad_resync_requests_get_clear_errors_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    create_mirror(dir.path());
    let a = dir.path().join("a");
    let server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    let control = common::control::control(&server).to_string();
    for (body, expect) in [
        (
            serde_json::json!({"leg": 0}),
            "is active: nothing to resync",
        ),
        (serde_json::json!({"leg": 7}), "no leg 7"),
        (serde_json::json!({"leg": "x"}), "resync request"),
        (serde_json::json!({"legs": 1}), "resync request"),
    ] {
        let (code, answer) = request(&control, "POST", "/v1/mirrors/a/resync", Some(&body), None);
        assert!(code == 409 || code == 400, "{body}: {code} {answer}");
        assert!(
            answer["error"].as_str().unwrap_or("").contains(expect),
            "{body}: {answer}"
        );
    }
    let out = vouch(&["mirror", "resync", "a", "--leg", "1", "--server", &control]);
    assert_ne!(out.status.code(), Some(0));
    assert!(text(&out).contains("is active"), "{}", text(&out));
    drop(server);
    let out = vouch(&["mirror", "resync", s(&a), "--leg", "0"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out).contains("is active: nothing to resync"),
        "{}",
        text(&out)
    );
    let out = vouch(&["serve", s(&a), "--resync-min", "10M", "--resync-max", "1M"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(text(&out).contains("--resync-min"), "{}", text(&out));
    assert_legs_agree(dir.path());
}

#[test]
fn an_offline_resync_copies_the_map_and_makes_the_leg_active() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, away) = mirror_with_leg_1_away(dir.path());
    let mut server = Server::start(dir.path(), &[s(&a)]);
    write_blocks(&server.uri, &scattered(11), 4);
    server.stop();
    std::fs::rename(&away, &b).expect("bring leg 1 back");
    let out = vouch_ok(&["mirror", "resync", s(&a), "--leg", "1", "--json"]);
    let answer: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let row = &answer["legs"][1];
    assert_eq!(row["state"], "active", "{answer}");
    assert_eq!(row["resync"]["copied"], 11, "{answer}");
    assert_legs_agree(dir.path());
}

/// Writes 64 KiB chunks (a pattern each) over bytes 4-12 MiB without
/// pause, flushing every 16, until the file `argv[2]` exists; touches
/// `argv[3]` after its first 16 writes; then writes 32 more, flushes and
/// prints how many it wrote before and after it saw the file, and the
/// pattern each chunk holds last.
const WRITER: &str = r#"
h = connect(sys.argv[1])
stop, started = sys.argv[2], sys.argv[3]
first, chunks, size = 4 << 20, 128, 65536
last = {}
n, after = 0, 0
while after < 32:
    chunk = (n * 7919) % chunks
    pattern = n % 250 + 4
    h.pwrite(bytes([pattern]) * size, first + chunk * size)
    last[chunk] = pattern
    n += 1
    if n % 16 == 0:
        h.flush()
    if n == 16:
        open(started, "w").close()
    if after or os.path.exists(stop):
        after += 1
h.flush()
print(json.dumps({"before_stop": n - after, "after_stop": after, "last": last}))
"#;

/// Client writes without pause for the whole resync, racing its copies:
/// a stream of 64 KiB writes over 4-12 MiB (half over the 6 MiB the map
/// names, half beyond it). The resync must end while the stream goes on
/// (the 4 MiB no write covers take 4 s at the 1 MiB/s floor; 60 s is the
/// hang guard), and then both legs hold, byte for byte, what the client
/// wrote last — no copy of an older block lands over a newer write —
/// `check` is clean and the map is gone. (Before blocks landed per block,
/// a write kept its region and itself dirty: such a stream kept the
/// resync going for as long as it ran.)
#[test]
fn client_writes_without_pause_during_a_resync_land_on_both_legs_and_it_ends() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut server, b) = six_mib_marked_then_leg_1_back(dir.path(), "1M", "2M");
    let (stop, writer) = start_client(dir.path(), &server.uri, WRITER, "writer");
    let mut args = vec!["mirror", "resync", "a", "--leg", "1"];
    let control = control_args(&server);
    args.extend(control.iter().map(String::as_str));
    let resync_started = Instant::now();
    vouch_ok(&args);
    let row = wait_resync_end(&server, Duration::from_secs(60));
    let took = resync_started.elapsed();
    std::fs::write(&stop, b"").expect("stop the writer");
    let written = writer.join().expect("writer thread");
    assert_eq!(row["resync"]["state"], "done", "{row}");
    // The stream ran the whole time: it was still writing when the resync
    // had ended (it stops only once told, after that).
    let before = written["before_stop"].as_u64().expect("count");
    assert!(
        before > 16 + 64,
        "the client wrote only {before} times: {written}"
    );
    assert_eq!(written["after_stop"], 32, "{written}");
    let copied = row["resync"]["copied"].as_u64().expect("copied");
    assert!(
        (1024..=1536).contains(&copied),
        "the 4 MiB no write covers are copied, and at most the 6 MiB: {row}"
    );
    eprintln!("resync took {took:?} ({copied} blocks copied) under {before} client writes");
    server.stop();
    assert_legs_agree(dir.path());
    let mut model = vec![0u8; (BLOCKS * 4096) as usize];
    model[..6 << 20].fill(3);
    for (chunk, pattern) in written["last"].as_object().expect("last") {
        let at = (4 << 20) + chunk.parse::<usize>().expect("chunk") * 65_536;
        let pattern = pattern.as_u64().expect("pattern") as u8;
        model[at..at + 65_536].fill(pattern);
    }
    let legs = leg_bytes(dir.path(), &b);
    let first = legs.iter().zip(&model).position(|(x, y)| x != y);
    assert!(
        first.is_none(),
        "leg 1 differs from what the client wrote last, first at byte {first:?}"
    );
}
