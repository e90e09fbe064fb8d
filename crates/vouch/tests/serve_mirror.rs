//! Mirrored volumes served over NBD to a real client (libnbd's Python
//! binding): a block corrupt on one leg reads correctly and is repaired on
//! that leg's disk, counted in metrics; a block corrupt on every leg is an
//! EIO naming its LBA with nothing rewritten; a leg past the repair
//! threshold is faulted and replaced; a missing leg serves degraded and is
//! marked stale, then resynced from its map when back; offline scrub
//! repairs and reports what it left; after a crash without a usable
//! activity log reads stay on one leg, across restarts, until a scrub.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::*;

/// Create a 2-way mirror `a` + `b` in `dir` and write blocks 0..16 (tag
/// 1000 + LBA) through NBD, then stop the server.
fn mirror_with_data(dir: &Path, legs: &[&str]) {
    mirror_with_data_in(dir, legs, "split");
}

/// `mirror_with_data` with volumes of `layout`.
fn mirror_with_data_in(dir: &Path, legs: &[&str], layout: &str) {
    let a = dir.join("a");
    let mut args = vec!["create", s(&a), "--size", "1MiB", "--layout", layout];
    let others: Vec<String> = legs
        .iter()
        .map(|leg| dir.join(leg).display().to_string())
        .collect();
    for leg in &others {
        args.extend(["--mirror", leg.as_str()]);
    }
    vouch_ok(&args);
    let mut server = Server::start(dir, &[s(&a)]);
    write_tagged_blocks(&server.uri, 16);
    server.stop();
}

/// `mirror_with_data` of legs `a` and `b` in a new directory: the
/// directory and the two legs' paths.
fn two_legs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    mirror_with_data(dir.path(), &["b"]);
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    (dir, a, b)
}

/// Leg `b` checked clean as a volume alone (both legs' mirror records
/// moved aside).
fn assert_leg_b_alone_clean(dir: &Path, a: &Path, b: &Path) {
    std::fs::rename(a.join("mirror"), dir.join("a.mirror")).expect("hide");
    std::fs::rename(b.join("mirror"), dir.join("b.mirror")).expect("hide");
    assert_check_clean(b);
}

fn block_of(path: &Path, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK as usize];
    std::fs::File::open(path.join("data.00000"))
        .expect("open data")
        .read_exact_at(&mut buf, lba * BLOCK)
        .expect("read");
    buf
}

/// Read every block `times` times; each entry is true (good data) or the
/// error with the server's messages.
const READ_ALL: &str = r#"
log = []
h = nbd.NBD()
h.set_debug(True)
h.set_debug_callback(lambda context, message: log.append(message))
h.connect_uri(sys.argv[1])
out = {}
for lba in range(16):
    for _ in range(int(sys.argv[2])):
        log.clear()
        try:
            ok = h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba)
            out.setdefault(str(lba), []).append(ok)
        except nbd.Error as e:
            info = err_info(e)
            info["server_messages"] = [m.split("server message: ", 1)[1] for m in log
                                       if "server message: " in m]
            out.setdefault(str(lba), []).append(info)
print(json.dumps(out))
"#;

#[test]
fn a_block_corrupt_on_one_leg_reads_good_over_nbd_and_is_repaired_on_disk() {
    let (dir, a, b) = two_legs();
    // A data byte of LBA 7 and a context byte of LBA 9, on leg 1 only.
    flip_bit(&b.join("data.00000"), 7 * BLOCK + 100, 0x04);
    flip_bit(&b.join("contexts"), 9 * 32 + 20, 0x01);
    let check = vouch(&["check", s(&a)]);
    assert_eq!(check.status.code(), Some(1), "{}", text(&check));
    assert!(
        text(&check).contains("leg 1: fault: LBA 7 guard_mismatch")
            && text(&check).contains("leg 1: fault: LBA 9 context_corrupt"),
        "check names both faults on leg 1: {}",
        text(&check)
    );

    let mut server = Server::start(dir.path(), &[s(&a), "--metrics", "127.0.0.1:0"]);
    let result = py_json(READ_ALL, &[&server.uri, "3"]);
    for lba in 0..16 {
        for read in result[lba.to_string()].as_array().expect("reads") {
            assert_eq!(*read, true, "LBA {lba} must read good data: {result}");
        }
    }
    let metrics = server.metrics_text();
    for kind in ["guard_mismatch", "context_corrupt"] {
        let series = format!(
            r#"vouch_mirror_repairs_total{{volume="a",leg="1",kind="{kind}",outcome="repaired"}}"#
        );
        assert_eq!(metric(&metrics, &series), Some(1.0), "{series}:\n{metrics}");
    }
    assert_eq!(
        metric(
            &metrics,
            r#"vouch_mirror_corrected_errors{volume="a",leg="1"}"#
        ),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            r#"vouch_mirror_corrected_errors{volume="a",leg="0"}"#
        ),
        Some(0.0)
    );
    server.stop();
    let log = server.log_text();
    assert!(
        log.contains("repaired a block from another leg") && log.contains("lba=7"),
        "{log}"
    );
    // Leg 1 alone: clean, and its data file holds the good block again.
    assert_check_clean(&a);
    assert_eq!(block_of(&b, 7), block_of(&a, 7));
    assert_leg_b_alone_clean(dir.path(), &a, &b);
}

#[test]
fn a_block_corrupt_on_every_leg_is_eio_naming_it_and_nothing_is_rewritten() {
    let (dir, a, b) = two_legs();
    flip_bit(&a.join("data.00000"), 3 * BLOCK + 10, 0x01);
    flip_bit(&b.join("data.00000"), 3 * BLOCK + 20, 0x01);
    let before = (sha256(&a.join("data.00000")), sha256(&b.join("data.00000")));
    let mut server = Server::start(dir.path(), &[s(&a), "--metrics", "127.0.0.1:0"]);
    let result = py_json(READ_ALL, &[&server.uri, "2"]);
    for read in result["3"].as_array().expect("reads") {
        assert_eq!(read["errnum"], libc::EIO, "{result}");
        assert!(
            read["server_messages"].to_string().contains("LBA 3"),
            "the error names LBA 3: {result}"
        );
    }
    assert_eq!(result["4"][0], true, "{result}");
    let metrics = server.metrics_text();
    assert!(
        metric(
            &metrics,
            r#"vouch_mirror_repairs_total{volume="a",leg="0",kind="guard_mismatch",outcome="unrepaired"}"#
        )
        .unwrap_or(0.0)
            + metric(
                &metrics,
                r#"vouch_mirror_repairs_total{volume="a",leg="1",kind="guard_mismatch",outcome="unrepaired"}"#
            )
            .unwrap_or(0.0)
            >= 2.0,
        "{metrics}"
    );
    server.stop();
    assert!(server.log_text().contains("bad on every leg"));
    let after = (sha256(&a.join("data.00000")), sha256(&b.join("data.00000")));
    assert_eq!(before, after, "no leg's data was rewritten");
}

#[test]
fn a_leg_past_twenty_repairs_is_faulted_then_replaced() {
    let (dir, a, b) = two_legs();
    // Write 32 more blocks so 21 can go bad on leg 1.
    let mut server = Server::start(dir.path(), &[s(&a)]);
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(16, 64):
    h.pwrite(block_data(lba, 1000 + lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    for lba in 16..37 {
        flip_bit(&b.join("data.00000"), lba * BLOCK + 5, 0x80);
    }
    let mut server = Server::start(dir.path(), &[s(&a), "--metrics", "127.0.0.1:0"]);
    let result = py_json(
        r#"
h = connect(sys.argv[1])
# Two reads in a row of each block: round robin sends one to each leg.
ok = all(h.pread(4096, lba * 4096) == block_data(lba, 1000 + lba)
         for lba in range(16, 64) for _ in range(2))
print(json.dumps({"ok": ok}))
"#,
        &[&server.uri],
    );
    assert_eq!(result["ok"], true);
    let metrics = server.metrics_text();
    assert_eq!(
        metric(&metrics, r#"vouch_mirror_leg_active{volume="a",leg="1"}"#),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, r#"vouch_mirror_leg_active{volume="a",leg="0"}"#),
        Some(1.0)
    );
    server.stop();
    assert!(
        server.log_text().contains("leg FAULTED"),
        "{}",
        server.log_text()
    );
    let status = vouch(&["mirror", "status", s(&a)]);
    assert_eq!(status.status.code(), Some(1), "{}", text(&status));
    assert!(text(&status).contains("leg 1") && text(&status).contains("faulted"));

    let replaced = vouch_ok(&["mirror", "replace", s(&b), "--leg", "1"]);
    assert!(text(&replaced).contains("active"), "{}", text(&replaced));
    let status = vouch_ok(&["mirror", "status", s(&a)]);
    assert!(text(&status).contains("every leg active"));
    assert_check_clean(&a);
    for lba in 16..37 {
        assert_eq!(block_of(&b, lba), block_of(&a, lba), "LBA {lba}");
    }
}

#[test]
fn a_missing_leg_serves_degraded_then_is_resynced_when_back() {
    let (dir, a, b) = two_legs();
    let away = dir.path().join("away");
    std::fs::rename(&b, &away).expect("take leg 1 away");
    let mut server = Server::start(dir.path(), &[s(&a)]);
    py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(block_data(2, 77), 2 * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    let log = server.log_text();
    assert!(
        log.contains("WARNING") && log.contains(s(&b)) && log.contains("missing"),
        "{log}"
    );
    std::fs::rename(&away, &b).expect("bring leg 1 back");
    let status = vouch(&["mirror", "status", s(&b)]);
    assert_eq!(status.status.code(), Some(1));
    assert!(text(&status).contains("stale"), "{}", text(&status));
    assert!(
        text(&status).contains("1 blocks to copy"),
        "{}",
        text(&status)
    );
    // Served from leg 1, the set still reads the new data (leg 1 is not
    // read while stale), and leg 1, back, is resynced from its map.
    let mut server = Server::start(dir.path(), &[s(&b)]);
    let result = py_json(
        r#"
h = connect(sys.argv[1])
print(json.dumps({"new": h.pread(4096, 2 * 4096) == block_data(2, 77)}))
"#,
        &[&server.uri],
    );
    assert_eq!(result["new"], true);
    wait_until("leg 1 resynced", std::time::Duration::from_secs(30), || {
        vouch(&["mirror", "status", s(&a)]).status.code() == Some(0)
    });
    server.stop();
    assert_check_clean(&a);
    assert_eq!(block_of(&b, 2), block_of(&a, 2));
}

#[test]
fn offline_scrub_repairs_every_leg_and_reports_what_it_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    mirror_with_data(dir.path(), &["b", "c"]);
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    flip_bit(&a.join("data.00000"), 2 * BLOCK, 0x01);
    flip_bit(&b.join("contexts"), 4 * 32 + 8, 0x01);
    for leg in [&a, &b, &c] {
        flip_bit(&leg.join("data.00000"), 6 * BLOCK + 1, 0x02);
    }
    let output = vouch(&["scrub", s(&c), "--json"]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let value: serde_json::Value = serde_json::from_slice(&output.stdout).expect("scrub JSON");
    let report = &value["report"];
    assert_eq!(
        (&report["found"], &report["repaired"], &report["left"]),
        (&5.into(), &2.into(), &3.into()),
        "{value}"
    );
    let findings = report["findings"].as_array().expect("findings");
    assert!(findings.iter().any(|f| f["lba"] == 2
        && f["leg"] == 0
        && f["kind"] == "guard_mismatch"
        && f["repaired"] == true));
    assert!(findings.iter().any(|f| f["lba"] == 4
        && f["leg"] == 1
        && f["kind"] == "context_corrupt"
        && f["repaired"] == true));
    assert_eq!(
        findings
            .iter()
            .filter(|f| f["lba"] == 6 && f["repaired"] == false)
            .count(),
        3,
        "{value}"
    );
    let again = vouch(&["scrub", s(&a)]);
    assert!(
        text(&again).contains("3 found, 0 repaired, 3 left"),
        "{}",
        text(&again)
    );
    let check = vouch(&["check", s(&a), "--json"]);
    let checked: serde_json::Value = serde_json::from_slice(&check.stdout).expect("check JSON");
    for leg in checked["legs"].as_array().expect("legs") {
        let lbas: Vec<u64> = leg["faults"]
            .as_array()
            .expect("faults")
            .iter()
            .map(|f| f["lba"].as_u64().expect("lba"))
            .collect();
        assert_eq!(lbas, vec![6], "only LBA 6 is left on each leg: {checked}");
    }
}

#[test]
fn after_a_crash_without_an_activity_log_reads_stay_on_one_leg_across_restarts_until_a_scrub() {
    let (dir, a, b) = two_legs();
    let marker = |leg: &Path| leg.join("mirror.unsynced").exists();
    // Killed with writes in flight: neither leg is shut down cleanly.
    let mut server = Server::start(dir.path(), &[s(&a)]);
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(16):
    h.pwrite(block_data(lba, 3000 + lba), lba * 4096)
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.signal(libc::SIGKILL);
    server.stop_status(std::time::Duration::from_secs(10));
    assert!(!marker(&a) && !marker(&b));
    // Without a usable activity log (a set from before it, or both copies
    // lost) nothing bounds where the legs differ (with one, only its
    // extents are reconciled: serve_mirror_reconcile.rs).
    for leg in [&a, &b] {
        std::fs::remove_file(leg.join("mirror.active")).expect("the log is there");
    }
    // The next server says the legs may differ and marks both.
    let mut server = Server::start(dir.path(), &[s(&a)]);
    server.stop();
    let log = server.log_text();
    assert!(
        log.contains("may differ") && log.contains("not shut down cleanly"),
        "{log}"
    );
    assert!(marker(&a) && marker(&b), "both legs marked");
    // Shut down cleanly, but not scrubbed: the next one still reads one leg.
    let mut server = Server::start(dir.path(), &[s(&b)]);
    server.stop();
    let log = server.log_text();
    assert!(
        log.contains("may differ") && log.contains("not been scrubbed yet"),
        "{log}"
    );
    // An offline scrub with nothing left clears the marks.
    let scrub = vouch(&["scrub", s(&a)]);
    assert!(scrub.status.success(), "{}", text(&scrub));
    assert!(!marker(&a) && !marker(&b), "{}", text(&scrub));
    let mut server = Server::start(dir.path(), &[s(&a)]);
    server.stop();
    assert!(
        !server.log_text().contains("may differ"),
        "{}",
        server.log_text()
    );
}

/// Issue 28: a context page zeroed on one leg is a `metadata_lost` fault
/// for each of its 128 blocks there, never zeros. Reads over NBD return
/// the other leg's data and repair it; a scrub repairs the rest (the
/// page's never-written blocks as holes); the leg then checks clean alone.
#[test]
fn a_zeroed_context_page_on_one_leg_is_repaired_from_the_other() {
    lost_page_on_one_leg_is_repaired(PageLoss::Zeroed);
}

/// The same with an older copy of leg 1's `contexts` restored (its page 0
/// from before the blocks were written again): older than the generation
/// the leg's written map expects, so lost, never read.
#[test]
fn an_older_context_page_on_one_leg_is_repaired_from_the_other() {
    lost_page_on_one_leg_is_repaired(PageLoss::OlderCopy);
}

/// The same for a packed mirror: an older copy of leg 1's data file
/// restored (row 0 from before its blocks were written again) is older
/// than the generation the leg's written map expects of the row, so all
/// 31 blocks of the row are lost there, never read. The first repair into
/// the row marks its other blocks lost before it lands; the scrub repairs
/// them.
#[test]
fn an_older_packed_row_on_one_leg_is_repaired_from_the_other() {
    lost_page_on_one_leg_is_repaired(PageLoss::OlderPackedRow);
}

/// The same for a packed row that the old 1 MiB scan chunks split (row
/// 8, LBAs 248-278, across LBA 256), with an older copy restored on leg
/// 1: `vouch check` names each of its 31 blocks once, on leg 1 only; an
/// offline `vouch scrub`, whose chunks end on the legs' rows, finds and
/// repairs all 31 from leg 0, after which both legs check clean and hold
/// the same records.
#[test]
fn an_older_packed_row_across_a_chunk_boundary_is_found_once_and_repaired_whole() {
    const ROW: u64 = 31;
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    vouch_ok(&[
        "create",
        s(&a),
        "--size",
        "2MiB",
        "--layout",
        "packed",
        "--mirror",
        s(&b),
    ]);
    let write_rows = || {
        let mut server = Server::start(dir.path(), &[s(&a)]);
        write_tagged_blocks(&server.uri, 9 * ROW);
        server.stop();
    };
    write_rows();
    let older = std::fs::read(b.join("data.00000")).expect("read data");
    // The same data again: newer generations on both legs.
    write_rows();
    let row = 8 * 131072;
    std::fs::OpenOptions::new()
        .write(true)
        .open(b.join("data.00000"))
        .expect("open data")
        .write_all_at(&older[row..row + 131072], row as u64)
        .expect("restore the older row");

    let check = vouch(&["check", s(&a)]);
    assert_eq!(check.status.code(), Some(1), "{}", text(&check));
    let checked = text(&check);
    let faults: Vec<&str> = checked
        .lines()
        .filter(|line| line.contains("fault: LBA"))
        .collect();
    let expected: Vec<String> = (8 * ROW..9 * ROW)
        .map(|lba| format!("leg 1: fault: LBA {lba} metadata_lost"))
        .collect();
    assert_eq!(faults, expected, "{checked}");

    let scrub = vouch(&["scrub", s(&a), "--json"]);
    assert!(scrub.status.success(), "{}", text(&scrub));
    let scrub: serde_json::Value = serde_json::from_slice(&scrub.stdout).expect("scrub --json");
    let report = &scrub["report"];
    assert_eq!(
        (&report["found"], &report["repaired"], &report["left"]),
        (
            &serde_json::json!(ROW),
            &serde_json::json!(ROW),
            &serde_json::json!(0)
        ),
        "{scrub}"
    );
    assert_check_clean(&a);
    let records = |leg: &Path| {
        let data = std::fs::read(leg.join("data.00000")).expect("read data");
        data[row..row + 131072].to_vec()
    };
    assert!(records(&a) == records(&b), "row 8 differs between the legs");
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PageLoss {
    Zeroed,
    OlderCopy,
    OlderPackedRow,
}

fn lost_page_on_one_leg_is_repaired(loss: PageLoss) {
    let dir = tempfile::tempdir().expect("tempdir");
    let packed = loss == PageLoss::OlderPackedRow;
    mirror_with_data_in(dir.path(), &["b"], if packed { "packed" } else { "split" });
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let cause = match loss {
        PageLoss::Zeroed => {
            std::fs::OpenOptions::new()
                .write(true)
                .open(b.join("contexts"))
                .expect("open contexts")
                .write_all_at(&[0u8; 4096], 0)
                .expect("zero page 0");
            "contexts: page 0 is zeroed: LBAs 0-127 have no protection information"
        }
        PageLoss::OlderCopy => {
            let older = std::fs::read(b.join("contexts")).expect("read contexts");
            // The same data written again: newer generations on both legs.
            let mut server = Server::start(dir.path(), &[s(&a)]);
            write_tagged_blocks(&server.uri, 20);
            server.stop();
            std::fs::write(b.join("contexts"), &older).expect("restore the older copy");
            "contexts: page 0 is older than the volume expects (generation "
        }
        PageLoss::OlderPackedRow => {
            let older = std::fs::read(b.join("data.00000")).expect("read data");
            let mut server = Server::start(dir.path(), &[s(&a)]);
            write_tagged_blocks(&server.uri, 16);
            server.stop();
            std::fs::write(b.join("data.00000"), &older).expect("restore the older copy");
            "data.00000: row 0 is older than the volume expects (generation "
        }
    };
    // The unit's last LBA: a split page's, a packed row's.
    let last = if packed { 30 } else { 127 };
    let check = vouch(&["check", s(&a)]);
    assert_eq!(check.status.code(), Some(1), "{}", text(&check));
    assert!(
        text(&check).contains("leg 1: fault: LBA 3 metadata_lost")
            && text(&check).contains(&format!("leg 1: fault: LBA {last} metadata_lost"))
            && !text(&check).contains("leg 0: fault"),
        "check names the lost blocks on leg 1: {}",
        text(&check)
    );

    let mut server = Server::start(dir.path(), &[s(&a), "--metrics", "127.0.0.1:0"]);
    let result = py_json(READ_ALL, &[&server.uri, "1"]);
    for lba in 0..16 {
        for read in result[lba.to_string()].as_array().expect("reads") {
            assert_eq!(*read, true, "LBA {lba} must read good data: {result}");
        }
    }
    let metrics = server.metrics_text();
    let series =
        r#"vouch_mirror_repairs_total{volume="a",leg="1",kind="metadata_lost",outcome="repaired"}"#;
    // Reads go round robin over the legs: those that reached leg 1
    // repaired their block there.
    let repaired = metric(&metrics, series).unwrap_or(0.0);
    assert!((1.0..=16.0).contains(&repaired), "{series}:\n{metrics}");
    server.stop();
    let log = server.log_text();
    assert!(log.contains(cause), "the server log names the cause: {log}");
    let scrub = vouch(&["scrub", s(&a)]);
    assert!(scrub.status.success(), "{}", text(&scrub));
    assert_check_clean(&a);
    // Each block as stored (packed: its record, context included).
    let home_of = |leg: &Path, lba: u64| {
        if !packed {
            return block_of(leg, lba);
        }
        let mut record = vec![0u8; 4128];
        std::fs::File::open(leg.join("data.00000"))
            .expect("open data")
            .read_exact_at(&mut record, (lba / 31) * 131072 + (lba % 31) * 4128)
            .expect("read");
        record
    };
    for lba in 0..16 {
        assert_eq!(home_of(&b, lba), home_of(&a, lba), "LBA {lba}");
    }
    assert_leg_b_alone_clean(dir.path(), &a, &b);
}

/// Read `sys.argv[3]` blocks from LBA `sys.argv[2]` in one request,
/// `sys.argv[4]` times, one request at a time (so the round robin sends
/// every other one to each leg); each entry true if the bytes are right
/// (`block_data(lba, 1000 + lba)`, or zeros past block 15).
const READ_RUN: &str = r#"
h = connect(sys.argv[1])
first, count = int(sys.argv[2]), int(sys.argv[3])
want = b"".join(block_data(lba, 1000 + lba) if lba < 16 else bytes(4096)
                for lba in range(first, first + count))
print(json.dumps([h.pread(4096 * count, first * 4096) == want
                  for _ in range(int(sys.argv[4]))]))
"#;

/// A bad block is one fault per read that finds it and one repair: the
/// leg's read judges it, and neither the repair route's read of the rest
/// of the request on that leg nor the repair's re-reads (is it still
/// bad? did the rewrite take?) judge it again. Two bad blocks of leg 0
/// (the primary, whose engine counters the metrics show) read in one
/// 8 KiB request, four times: two faults, two repairs, two log lines.
#[test]
fn a_bad_block_is_one_fault_and_one_repair() {
    let (dir, a, b) = two_legs();
    flip_bit(&a.join("data.00000"), 7 * BLOCK + 100, 0x04);
    flip_bit(&a.join("data.00000"), 8 * BLOCK + 100, 0x04);
    let mut server = Server::start(dir.path(), &[s(&a), "--metrics", "127.0.0.1:0"]);
    let reads = py_json(READ_RUN, &[&server.uri, "7", "2", "4"]);
    assert_eq!(reads, serde_json::json!([true, true, true, true]));
    let metrics = server.metrics_text();
    let count = |series: &str| metric(&metrics, series).unwrap_or(0.0);
    assert_eq!(
        count(r#"vouch_engine_checksum_failures_total{volume="a",kind="guard_mismatch"}"#),
        2.0,
        "one fault per bad block:\n{metrics}"
    );
    assert_eq!(
        count(
            r#"vouch_mirror_repairs_total{volume="a",leg="0",kind="guard_mismatch",outcome="repaired"}"#
        ),
        2.0,
        "{metrics}"
    );
    assert_eq!(
        count(r#"vouch_mirror_corrected_errors{volume="a",leg="0"}"#),
        2.0,
        "{metrics}"
    );
    server.stop();
    let log = server.log_text();
    let lines = |what: &str| log.lines().filter(|line| line.contains(what)).count();
    assert_eq!(lines("block failed verification"), 2, "{log}");
    assert_eq!(lines("repaired a block from another leg"), 2, "{log}");
    assert_eq!(block_of(&a, 7), block_of(&b, 7));
    assert_eq!(block_of(&a, 8), block_of(&b, 8));
}

/// The kind byte of block `lba`'s context in a split volume's table.
fn context_kind(volume: &Path, lba: u64) -> u8 {
    let mut byte = [0u8];
    std::fs::File::open(volume.join("contexts"))
        .expect("open contexts")
        .read_exact_at(&mut byte, lba * 32)
        .expect("read context");
    byte[0]
}

/// A repair moves a block as what it is: zeroes written (allocated) stay
/// written zeroes on the repaired leg, never a hole (absence is never
/// emptiness), and a trimmed or never-written block stays a hole, never
/// allocated zeros. Leg 1's contexts of such blocks are corrupted; reads
/// over NBD repair them from leg 0.
#[test]
fn a_repair_keeps_written_zeroes_and_holes_what_they_are() {
    let (dir, a, b) = two_legs();
    let mut server = Server::start(dir.path(), &[s(&a)]);
    py_json(
        r#"
h = connect(sys.argv[1])
h.zero(4096, 20 * 4096, nbd.CMD_FLAG_NO_HOLE)
h.trim(4096, 3 * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    // Written zeroes (2), trimmed and never written (holes, not 1 or 2).
    let (zeroed, trimmed, never) = (20, 3, 22);
    assert_eq!(context_kind(&a, zeroed), 2);
    assert_eq!(context_kind(&b, zeroed), 2);
    for lba in [trimmed, never] {
        assert!(![1, 2].contains(&context_kind(&b, lba)), "LBA {lba} a hole");
    }
    for lba in [zeroed, trimmed, never] {
        flip_bit(&b.join("contexts"), lba * 32 + 20, 0x01);
    }
    let check = vouch(&["check", s(&a)]);
    assert!(
        text(&check).contains(&format!("leg 1: fault: LBA {zeroed} context_corrupt")),
        "{}",
        text(&check)
    );
    let mut server = Server::start(dir.path(), &[s(&a), "--metrics", "127.0.0.1:0"]);
    for lba in [zeroed, trimmed, never] {
        let reads = py_json(READ_ZEROS, &[&server.uri, &lba.to_string(), "4"]);
        assert_eq!(
            reads,
            serde_json::json!([true, true, true, true]),
            "LBA {lba}"
        );
    }
    let metrics = server.metrics_text();
    assert_eq!(
        metric(
            &metrics,
            r#"vouch_mirror_repairs_total{volume="a",leg="1",kind="context_corrupt",outcome="repaired"}"#
        ),
        Some(3.0),
        "{metrics}"
    );
    server.stop();
    assert_eq!(
        context_kind(&b, zeroed),
        2,
        "written zeroes repaired as written zeroes, not a hole"
    );
    for lba in [trimmed, never] {
        assert!(
            ![1, 2].contains(&context_kind(&b, lba)),
            "LBA {lba} repaired as a hole, not allocated: {}",
            context_kind(&b, lba)
        );
    }
    assert_check_clean(&a);
    assert_leg_b_alone_clean(dir.path(), &a, &b);
}

/// Read block `sys.argv[2]` `sys.argv[3]` times: true each time it is zeros.
const READ_ZEROS: &str = r#"
h = connect(sys.argv[1])
lba = int(sys.argv[2])
print(json.dumps([h.pread(4096, lba * 4096) == bytes(4096) for _ in range(int(sys.argv[3]))]))
"#;
