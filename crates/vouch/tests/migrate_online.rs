//! Online migration (issue 33): a served volume's regions moved split ->
//! packed -> split through the control API and `vouch migrate --server`
//! while fio writes and verifies it over NBD; a kill -9 mid-migration
//! loses nothing acknowledged and the migration finishes when asked
//! again; a corrupt block stops it naming the LBA; `--migrate-on-write`
//! moves exactly the regions written.
//!
//! The issue's end-to-end test takes two online snapshots during the
//! migrations (one split -> packed, one packed -> split) while fio writes
//! and verifies: a libnbd writer owns the first 8 MiB of each region (fio
//! the rest), flushes, writes more, asks for the snapshot and goes on;
//! each snapshot's export holds exactly what the writer had acknowledged
//! when it asked, and checks clean.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::control::{control, request};
use common::*;
use serde_json::{json, Value};
use vouch_engine::{CreateOptions, BLOCK};
use vouch_format::regions::REGION_BLOCKS;
use vouch_format::LayoutKind;

/// 3 whole regions and a part of a fourth.
const BLOCKS: u64 = 3 * REGION_BLOCKS + 1000;

fn new_volume(dir: &Path, layout: LayoutKind) -> PathBuf {
    let path = dir.join("vol");
    let options = CreateOptions {
        layout,
        ..CreateOptions::new(BLOCKS * BLOCK)
    };
    vouch_engine::create_volume(&path, &options)
        .expect("create")
        .close()
        .expect("close");
    path
}

/// fio over NBD: 64 KiB random writes over the whole export, each block
/// stamped with crc32c and verified (during the run and at its end);
/// `verify_only` reads and verifies what the same job wrote.
fn fio(uri: &str, dir: &Path, verify_only: bool) -> Command {
    fio_over(uri, dir, verify_only, &[])
}

/// `fio`, over byte ranges `(offset, size)` of the export (one job each;
/// none: one job over the whole export).
fn fio_over(uri: &str, dir: &Path, verify_only: bool, ranges: &[(u64, u64)]) -> Command {
    fio_with(
        uri,
        dir,
        verify_only,
        ranges,
        &["--verify=crc32c", "--randseed=33"],
    )
}

/// `fio`, but every block filled with the byte `pass` and its offset
/// (`--verify_pattern=0xPASS%o`, checked every 4 KiB): a pass writes other
/// bytes than every other pass at every block, so a verify tells them
/// apart (fio's crc32c blocks carry no such mark: a verify with another
/// `--randseed` passes on the first pass's data, MED-3 of the regions
/// review), and a block read from another offset fails too.
fn fio_pass(uri: &str, dir: &Path, verify_only: bool, pass: u8) -> Command {
    let pattern = format!("--verify_pattern=0x{pass:02x}%o");
    let args = [
        "--verify=pattern",
        &pattern,
        "--verify_interval=4096",
        "--randseed=33",
    ];
    fio_with(uri, dir, verify_only, &[], &args)
}

fn fio_with(
    uri: &str,
    dir: &Path,
    verify_only: bool,
    ranges: &[(u64, u64)],
    verify: &[&str],
) -> Command {
    let fio = tool("fio", "fio");
    let mut command = Command::new(fio);
    if ranges.is_empty() {
        command.arg("--name=migrate");
    }
    command.current_dir(dir).args([
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bs=64k",
        "--iodepth=8",
        "--verify_backlog=64",
        "--verify_fatal=1",
        "--output-format=terse",
    ]);
    command.args(verify);
    if verify_only {
        command.arg("--verify_only");
    }
    // Options before the first job's name are every job's.
    for (index, (offset, size)) in ranges.iter().enumerate() {
        command.args([
            format!("--name=migrate{index}"),
            format!("--offset={offset}"),
            format!("--size={size}"),
        ]);
    }
    command
}

/// The writer's blocks: the first `WRITER_BLOCKS` of each region (all of
/// the last, part region); fio has the rest of each whole region.
const WRITER_BLOCKS: u64 = 2048;

fn writer_areas() -> Vec<(u64, u64)> {
    (0..BLOCKS.div_ceil(REGION_BLOCKS))
        .map(|region| {
            let start = region * REGION_BLOCKS;
            (start, WRITER_BLOCKS.min(BLOCKS - start))
        })
        .collect()
}

fn fio_ranges() -> Vec<(u64, u64)> {
    (0..BLOCKS / REGION_BLOCKS)
        .map(|region| {
            let start = (region * REGION_BLOCKS + WRITER_BLOCKS) * BLOCK;
            (start, (REGION_BLOCKS - WRITER_BLOCKS) * BLOCK)
        })
        .collect()
}

/// A libnbd writer of random runs in `areas` (LBA, blocks): it reads what
/// they hold, writes and flushes, writes more (acknowledged, not flushed),
/// waits for a region to have moved, asks for snapshot `name` through the
/// server (`vouch snapshot create --server`, the migration's state asked
/// right before), then writes and
/// flushes again. It leaves the areas' bytes when it asked in
/// `expect`, and after its last flush in `expect.final`; prints the
/// migration's state before the create and the create's output.
const SNAPSHOT_WRITER: &str = r#"
import random, subprocess, urllib.request
uri, vouch, control, name, areas, expect = sys.argv[1:7]
areas = json.loads(areas)
h = connect(uri)
image = []
for lba, count in areas:
    image.append(bytearray(h.pread(count * 4096, lba * 4096)))
rng = random.Random(name)
def writes(n):
    for _ in range(n):
        area = rng.randrange(len(areas))
        lba, count = areas[area]
        run = rng.randint(1, 16)
        at = rng.randrange(count - run + 1)
        data = rng.randbytes(run * 4096)
        h.pwrite(data, (lba + at) * 4096)
        image[area][at * 4096:(at + run) * 4096] = data
def save(path):
    with open(path, "wb") as out:
        for part in image:
            out.write(part)
def migration():
    base = control if control.startswith("http") else "http://" + control
    with urllib.request.urlopen(base + "/v1/exports/vol/migrate") as reply:
        return json.load(reply)
writes(64)
h.flush()
writes(16)
# Once a region has moved (and not all): the snapshot's record is mixed.
target = migration()["target"]
while True:
    state = migration()
    if state["state"] != "running" or state["regions"][target] >= 1:
        break
    time.sleep(0.02)
out = subprocess.run([vouch, "snapshot", "create", "--server", control, "vol", name],
                     capture_output=True, text=True)
if out.returncode != 0:
    raise SystemExit("snapshot create failed: " + out.stderr)
save(expect)
writes(64)
h.flush()
save(expect + ".final")
print(json.dumps({"migration": state, "create": out.stdout}))
"#;

/// The writer's areas of the volume (or snapshot) at `path`, exported.
fn writer_bytes(path: &Path, raw: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(raw);
    vouch_ok(&["export", s(path), s(raw)]);
    let image = std::fs::read(raw).expect("read the export");
    let _ = std::fs::remove_file(raw);
    writer_areas()
        .iter()
        .flat_map(|(lba, count)| {
            image[(lba * BLOCK) as usize..((lba + count) * BLOCK) as usize].to_vec()
        })
        .collect()
}

fn migrate_status(server: &Server) -> Value {
    let (status, answer) = request(
        control(server),
        "GET",
        "/v1/exports/vol/migrate",
        None,
        None,
    );
    assert_eq!(status, 200, "{answer}");
    answer
}

fn start_migration(server: &Server, layout: &str, rate: &str) {
    let (status, answer) = request(
        control(server),
        "POST",
        "/v1/exports/vol/migrate",
        Some(&json!({"layout": layout, "rate": rate})),
        None,
    );
    assert_eq!(status, 202, "{answer}");
}

fn wait_migration(server: &Server) -> Value {
    let mut last = Value::Null;
    wait_until("the migration to end", Duration::from_secs(300), || {
        last = migrate_status(server);
        last["state"] != "running"
    });
    last
}

fn finish(child: Child, what: &str) {
    let output = child.wait_with_output().expect("wait");
    assert!(output.status.success(), "{what}: {}", text(&output));
}

fn spawn(mut command: Command) -> Child {
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn")
}

/// The issue's end-to-end test: split -> packed -> split online while fio
/// writes and verifies, an online snapshot taken during each migration
/// (each holding exactly what the writer had acknowledged when it asked,
/// checked clean), on xfs (snapshots share blocks).
#[test]
fn online_migration_split_packed_split_under_a_fio_verify_writer() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Both members, their journals and two snapshots' blocks.
    let fs = LoopFs::xfs_of(4 << 30);
    let path = new_volume(&fs.mount, LayoutKind::Split);
    let areas = serde_json::to_string(&writer_areas()).expect("json");
    let mut snapshots = Vec::new();
    let mut server = Server::start(
        dir.path(),
        &[
            s(&path),
            "--control",
            "127.0.0.1:0",
            "--migratable",
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    for layout in ["packed", "split"] {
        // The migration paced so that the writer runs through it.
        let mut migrate = Command::new(vouch_bin());
        migrate.args([
            "migrate",
            "--server",
            control(&server),
            "vol",
            "--layout",
            layout,
            "--rate",
            "48M",
        ]);
        let migrating = spawn(migrate);
        wait_until("the migration to start", Duration::from_secs(30), || {
            migrate_status(&server)["state"] == "running"
        });
        let fio = spawn(fio_over(&server.uri, dir.path(), false, &fio_ranges()));
        // An online snapshot mid-migration, fio writing meanwhile.
        let name = format!("during-{layout}");
        let expect = dir.path().join(format!("{name}.expect"));
        let wrote = py_json(
            SNAPSHOT_WRITER,
            &[
                &server.uri,
                vouch_bin(),
                control(&server),
                &name,
                &areas,
                s(&expect),
            ],
        );
        assert_eq!(wrote["migration"]["state"], "running", "{wrote}");
        // Taken mid-migration: its record has regions in both layouts.
        let regions = &info_json(&path.join("snapshots").join(&name))["regions"];
        assert!(
            regions["split"].as_u64().is_some_and(|n| n >= 1)
                && regions["packed"].as_u64().is_some_and(|n| n >= 1),
            "{name}: {regions}"
        );
        assert!(
            wrote["create"]
                .as_str()
                .is_some_and(|said| said.contains("held at the flush point")),
            "{wrote}"
        );
        eprintln!("{name}: {}", wrote["create"]);
        snapshots.push((name, expect));
        finish(fio, "fio write+verify");
        finish(migrating, "vouch migrate --server");
        let status = migrate_status(&server);
        assert_eq!(status["state"], "done", "{status}");
        assert_eq!(status["regions"][layout], 4, "{status}");
        assert_eq!(status["done_bytes"], BLOCKS * BLOCK, "{status}");
        let metrics = server.metrics_text();
        assert_eq!(
            metric(
                &metrics,
                &format!("vouch_regions{{volume=\"vol\",layout=\"{layout}\"}}")
            ),
            Some(4.0),
            "{metrics}"
        );
        finish(
            spawn(fio_over(&server.uri, dir.path(), true, &fio_ranges())),
            "fio verify",
        );
    }
    // Verify and scrub jobs are refused on it (they would read one member).
    let (status, answer) = request(
        control(&server),
        "POST",
        "/v1/jobs",
        Some(&json!({"op": "verify", "export": "vol"})),
        None,
    );
    assert_eq!(status, 409, "{answer}");
    server.stop();
    assert_check_clean(&path);
    let info = info_json(&path);
    assert_eq!(info["regions"]["split"], 4, "{info}");
    // Each snapshot: what the writer had acknowledged when it asked.
    let raw = dir.path().join("export.raw");
    for (name, expect) in &snapshots {
        let snapshot = path.join("snapshots").join(name);
        assert_check_clean(&snapshot);
        let want = std::fs::read(expect).expect("the writer's image");
        assert!(
            writer_bytes(&snapshot, &raw) == want,
            "snapshot {name} is not the writer's data at its flush point"
        );
    }
    let last = &snapshots.last().expect("snapshots").1;
    let mut last_final = last.clone().into_os_string();
    last_final.push(".final");
    assert!(
        writer_bytes(&path, &raw) == std::fs::read(&last_final).expect("final"),
        "the volume lost a write of the writer"
    );
    // Offline, back home: a one-layout volume again, fio's data intact.
    vouch_ok(&["migrate", s(&path), "--layout", "split"]);
    assert!(info_json(&path)["regions"].is_null());
    let mut server = Server::start(dir.path(), &[s(&path)]);
    finish(
        spawn(fio_over(&server.uri, dir.path(), true, &fio_ranges())),
        "fio verify after",
    );
    server.stop();
}

#[test]
fn a_kill_9_mid_migration_loses_nothing_and_the_migration_finishes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = new_volume(dir.path(), LayoutKind::Split);
    let args = [s(&path), "--control", "127.0.0.1:0", "--migratable"];
    let mut server = Server::start(dir.path(), &args);
    finish(
        spawn(fio_pass(&server.uri, dir.path(), false, 1)),
        "fio write",
    );
    // Paced so slowly that it surely outlasts the second writer (about
    // 50 s for the volume at 4 MiB/s, 16 s for its first region; raised
    // after the restart).
    start_migration(&server, "packed", "4M");
    // The writer again, other bytes at every block (pass 2), while
    // regions move; then the server is killed with the migration in its
    // second region or later. A block that lost its second write reads
    // back with the first pass's bytes, which pass 2's verify refuses
    // (proved here first: the first pass's data fails it).
    let old = fio_pass(&server.uri, dir.path(), true, 2)
        .output()
        .expect("fio");
    assert!(
        !old.status.success(),
        "pass 2's verify passed on pass 1's data: the passes cannot be told apart"
    );
    finish(
        spawn(fio_pass(&server.uri, dir.path(), false, 2)),
        "fio write (pass 2)",
    );
    wait_until("a region moved", Duration::from_secs(60), || {
        migrate_status(&server)["regions"]["packed"]
            .as_u64()
            .is_some_and(|packed| packed >= 1)
    });
    let status = migrate_status(&server);
    assert_eq!(status["state"], "running", "{status}");
    // `info` of the served volume mid-migration: the record on disk.
    let info = info_json(&path);
    assert_eq!(info["in_use"], true, "{info}");
    assert!(
        info["regions"]["packed"]
            .as_u64()
            .is_some_and(|packed| packed >= 1),
        "{info}"
    );
    server.kill9();
    let mut server = Server::start(dir.path(), &args);
    let status = migrate_status(&server);
    assert_eq!(status["state"], "idle", "{status}");
    let packed = status["regions"]["packed"].as_u64().expect("packed");
    assert!((1..4).contains(&packed), "{status}");
    finish(
        spawn(fio_pass(&server.uri, dir.path(), true, 2)),
        "fio verify (pass 2) after kill -9",
    );
    start_migration(&server, "packed", "1G");
    let status = wait_migration(&server);
    assert_eq!(status["state"], "done", "{status}");
    assert_eq!(status["regions"]["packed"], 4, "{status}");
    finish(
        spawn(fio_pass(&server.uri, dir.path(), true, 2)),
        "fio verify (pass 2) after the migration",
    );
    server.stop();
    assert_check_clean(&path);
}

#[test]
fn a_corrupt_block_stops_the_online_migration_naming_its_lba() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = new_volume(dir.path(), LayoutKind::Split);
    let mut server = Server::start(dir.path(), &[s(&path)]);
    finish(spawn(fio(&server.uri, dir.path(), false)), "fio write");
    server.stop();
    let lba = 2 * REGION_BLOCKS + 10;
    flip_bit(&path.join("data.00000"), lba * BLOCK + 7, 0x04);
    let mut server = Server::start(
        dir.path(),
        &[s(&path), "--control", "127.0.0.1:0", "--migratable"],
    );
    start_migration(&server, "packed", "1G");
    let status = wait_migration(&server);
    assert_eq!(status["state"], "failed", "{status}");
    let error = status["error"].as_str().expect("error");
    assert!(error.contains(&format!("LBA {lba}")), "{status}");
    assert_eq!(status["regions"]["packed"], 2, "{status}");
    // The CLI says it too, and fails.
    let output = vouch(&[
        "migrate",
        "--server",
        control(&server),
        "--layout",
        "packed",
    ]);
    assert!(!output.status.success());
    assert!(
        text(&output).contains(&format!("LBA {lba}")),
        "{}",
        text(&output)
    );
    server.stop();
}

/// qemu-io `commands` on `uri`; a failed command or pattern fails the test.
fn qemu_io(uri: &str, commands: &[String]) {
    let mut command = Command::new(tool("qemu-io", "qemu-utils"));
    command.args(["-f", "raw"]);
    for each in commands {
        command.args(["-c", each]);
    }
    let output = run_ok(command.arg(uri));
    let said = text(&output);
    assert!(!said.contains("failed"), "qemu-io {commands:?}: {said}");
}

#[test]
fn migrate_on_write_moves_exactly_the_regions_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = new_volume(dir.path(), LayoutKind::Split);
    let mut server = Server::start(dir.path(), &[s(&path)]);
    // Data in regions 0 and 2 before: it moves with them.
    let early = [10 * BLOCK, (2 * REGION_BLOCKS + 5) * BLOCK];
    for at in early {
        qemu_io(&server.uri, &[format!("write -P 0x11 {at} 65536")]);
    }
    server.stop();
    let mut server = Server::start(
        dir.path(),
        &[
            s(&path),
            "--control",
            "127.0.0.1:0",
            "--migrate-on-write",
            "packed",
        ],
    );
    assert_eq!(migrate_status(&server)["regions"]["packed"], 0);
    // A read moves nothing; a write into region 2 and one into region 3.
    let written = [
        (2 * REGION_BLOCKS + 100) * BLOCK,
        (3 * REGION_BLOCKS + 7) * BLOCK,
    ];
    qemu_io(
        &server.uri,
        &[
            format!("read -P 0x11 {} 65536", early[0]),
            format!("write -P 0x22 {} 8192", written[0]),
            format!("write -P 0x33 {} 4096", written[1]),
        ],
    );
    let status = migrate_status(&server);
    assert_eq!(status["regions"]["packed"], 2, "{status}");
    assert_eq!(status["migrate_on_write"], "packed", "{status}");
    server.kill9();
    let info = info_json(&path);
    assert_eq!(
        info["regions"]["layouts"],
        json!(["split", "split", "packed", "packed"]),
        "{info}"
    );
    let mut server = Server::start(dir.path(), &[s(&path)]);
    qemu_io(
        &server.uri,
        &[
            format!("read -P 0x11 {} 65536", early[0]),
            format!("read -P 0x11 {} 65536", early[1]),
            format!("read -P 0x22 {} 8192", written[0]),
            format!("read -P 0x33 {} 4096", written[1]),
        ],
    );
    server.stop();
    assert_check_clean(&path);
}
