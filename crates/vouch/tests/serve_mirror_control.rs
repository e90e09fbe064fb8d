//! A mirrored export and the control API: the scrub job checks and repairs
//! every leg and reports found / repaired / left, at its `rate`; a copy
//! into a mirrored export (or offline, into any leg's path) goes through
//! the mirror and lands on every leg; offline writers of a single leg
//! (`vouch key change`) are refused.

mod common;

use std::path::Path;
use std::time::Duration;

use common::control::{submit, wait_job};
use common::*;
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn the_scrub_job_repairs_every_leg_of_a_mirrored_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    vouch_ok(&["create", s(&a), "--size", "1MiB", "--mirror", s(&b)]);
    let mut server = Server::start(dir.path(), &[s(&a)]);
    py_json(
        r#"
h = connect(sys.argv[1])
for lba in range(8):
    h.pwrite(block_data(lba, lba), lba * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    flip_bit(&a.join("data.00000"), BLOCK + 9, 0x01);
    flip_bit(&b.join("data.00000"), 5 * BLOCK + 9, 0x01);
    for leg in [&a, &b] {
        flip_bit(&leg.join("data.00000"), 7 * BLOCK + 9, 0x01);
    }
    let server = Server::start(dir.path(), &[s(&a), "--control", "127.0.0.1:0"]);
    let id = submit(&server, json!({"op": "scrub", "export": "a"}));
    let job = wait_job(&server, id, TIMEOUT);
    assert_eq!(job["state"], "finished", "{job}");
    let mirror = &job["result"]["mirror"];
    assert_eq!(
        (&mirror["found"], &mirror["repaired"], &mirror["left"]),
        (&4.into(), &2.into(), &2.into()),
        "{job}"
    );
    let left: Vec<u64> = job["result"]["faults"]
        .as_array()
        .expect("faults")
        .iter()
        .map(|f| f["lba"].as_u64().expect("lba"))
        .collect();
    assert_eq!(left, vec![7, 7], "{job}");

    drop(server);
    let check = vouch(&["check", s(&a)]);
    assert_eq!(check.status.code(), Some(1));
    let listed = text(&check);
    assert!(
        !listed.contains("LBA 1 ") && !listed.contains("LBA 5 "),
        "{listed}"
    );
    assert!(listed.contains("leg 0: fault: LBA 7") && listed.contains("leg 1: fault: LBA 7"));
}

#[test]
fn writing_one_leg_alone_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    vouch_ok(&["create", s(&a), "--size", "1MiB", "--mirror", s(&b)]);
    let info = info_json(&b);
    assert_eq!(
        info["uuid"],
        info_json(&a)["uuid"],
        "the legs share one uuid"
    );
    assert_eq!(info["mirror"]["leg"], 1);
    for (index, leg) in [&a, &b].iter().enumerate() {
        let row = &info["mirror"]["legs"][index];
        assert_eq!(row["state"], "active", "{info}");
        assert_eq!(
            row["path"],
            leg.canonicalize().expect("path").display().to_string()
        );
    }
    let change = vouch(&["key", "change", s(&a)]);
    assert_eq!(change.status.code(), Some(2));
    assert!(
        text(&change).contains("leg of a mirror"),
        "{}",
        text(&change)
    );
    let again = vouch(&["create", s(&a), "--size", "1MiB", "--mirror", s(&b)]);
    assert_eq!(again.status.code(), Some(2));
    assert!(text(&again).contains("already exists"), "{}", text(&again));
    let one = vouch(&[
        "create",
        s(&dir.path().join("x")),
        "--size",
        "1MiB",
        "--mirror",
        s(&dir.path().join("y")),
        "--mirror",
        s(&dir.path().join("z")),
        "--mirror",
        s(&dir.path().join("w")),
    ]);
    assert_eq!(one.status.code(), Some(2));
    assert!(text(&one).contains("2 or 3 legs"), "{}", text(&one));
    assert!(!dir.path().join("x").exists());
}

/// Each leg of the mirror at `legs[0]` holds `source`'s first `length`
/// bytes at `offset`, read back verified from that leg alone; `vouch
/// check` finds every leg clean.
fn assert_copied_to_every_leg(legs: &[&Path], source: &Path, offset: &str, length: &str) {
    for leg in legs {
        let compare = vouch(&[
            "compare",
            s(leg),
            "--offset",
            offset,
            "--length",
            length,
            "--with",
            s(source),
        ]);
        assert!(
            compare.status.success() && text(&compare).contains("equal"),
            "leg {} does not hold the copy: {}",
            leg.display(),
            text(&compare)
        );
    }
    assert_check_clean(legs[0]);
}

#[test]
fn a_copy_into_a_mirrored_export_lands_on_every_leg_and_its_scrub_keeps_a_rate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = random_bytes(3 << 20, 30);
    let source = volume_from(dir.path(), "src", &data);
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    vouch_ok(&["create", s(&a), "--size", "4MiB", "--mirror", s(&b)]);
    let server = Server::start(dir.path(), &[s(&a), s(&source), "--control", "127.0.0.1:0"]);
    let id = submit(
        &server,
        json!({"op": "copy", "source": {"export": "src", "offset": 0},
               "destination": {"export": "a", "offset": 1 << 20}, "length": 2 << 20}),
    );
    let job = wait_job(&server, id, TIMEOUT);
    assert_eq!(job["state"], "finished", "{job}");
    assert_eq!(job["result"]["method"], "pipelined", "{job}");
    assert_eq!(job["result"]["blocks"], 512, "{job}");

    // Scrubs of the copy's 2 MiB (two chunks on each leg): as fast as it
    // goes, then at 1 MiB/s, which waits after each chunk.
    let id = submit(&server, json!({"op": "scrub", "export": "a"}));
    let fast = wait_job(&server, id, TIMEOUT);
    let id = submit(
        &server,
        json!({"op": "scrub", "export": "a", "rate": 1 << 20}),
    );
    let paced = wait_job(&server, id, TIMEOUT);
    for job in [&fast, &paced] {
        assert_eq!(job["state"], "finished", "{job}");
        assert_eq!(job["result"]["mirror"]["found"], 0, "the legs agree: {job}");
        assert_eq!(job["result"]["blocks_checked"], 512, "{job}");
    }
    assert_eq!(fast["progress"]["paced_waits"], 0, "{fast}");
    let waits = paced["progress"]["paced_waits"]
        .as_u64()
        .expect("paced_waits");
    assert!(waits >= 1, "a scrub at 1 MiB/s waits for its rate: {paced}");
    drop(server);
    assert_copied_to_every_leg(&[&a, &b], &source, "1M", "2M");
}

#[test]
fn an_offline_copy_into_a_leg_writes_the_whole_mirror() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = random_bytes(2 << 20, 31);
    let source = volume_from(dir.path(), "src", &data);
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    vouch_ok(&["create", s(&a), "--size", "4MiB", "--mirror", s(&b)]);
    // Named by leg 1's path: the whole set is the destination.
    let copy = vouch_ok(&[
        "copy",
        s(&source),
        s(&b),
        "--length",
        "2M",
        "--destination-offset",
        "2M",
        "--rate",
        "4M",
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&copy.stdout).expect("copy --json");
    assert_eq!(report["blocks"], 512, "{report}");
    // Two 1 MiB segments at 4 MiB/s: each is due later than it ends.
    assert!(
        report["paced_waits"].as_u64().expect("paced_waits") >= 1,
        "an offline copy keeps --rate: {report}"
    );
    assert_copied_to_every_leg(&[&a, &b], &source, "2M", "2M");
    // Within the mirror too, whichever legs name it (memmove between its
    // own ranges: the source is the set, not leg 0 opened a second time).
    for (from, to, offset) in [(&a, &a, "0"), (&a, &b, "1M")] {
        vouch_ok(&[
            "copy",
            s(from),
            s(to),
            "--length",
            "1M",
            "--source-offset",
            "2M",
            "--destination-offset",
            offset,
        ]);
    }
    assert_copied_to_every_leg(&[&a, &b], &source, "0", "1M");
    assert_copied_to_every_leg(&[&a, &b], &source, "1M", "1M");

    let scrub = vouch_ok(&["scrub", s(&a), "--rate", "1M", "--json"]);
    let scrub: serde_json::Value = serde_json::from_slice(&scrub.stdout).expect("scrub --json");
    assert_eq!(scrub["report"]["found"], 0, "{scrub}");
    assert_eq!(scrub["report"]["blocks_checked"], 1024, "{scrub}");
    assert!(
        scrub["paced_waits"].as_u64().expect("paced_waits") >= 1,
        "an offline mirror scrub keeps --rate: {scrub}"
    );
}

/// A copy job keeps its `rate` as a scrub does (its waits in
/// `progress.paced_waits` and in its result), and a mirrored export's
/// scrub keeps a cursor: cancelled under way, the next scrub resumes
/// where it stood and checks only the rest.
#[test]
fn a_copy_job_keeps_its_rate_and_a_cancelled_mirror_scrub_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = random_bytes(4 << 20, 32);
    let source = volume_from(dir.path(), "src", &data);
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    vouch_ok(&["create", s(&a), "--size", "4MiB", "--mirror", s(&b)]);
    let server = Server::start(dir.path(), &[s(&a), s(&source), "--control", "127.0.0.1:0"]);
    for rate in [None, Some(4u64 << 20)] {
        let mut body = json!({"op": "copy", "source": {"export": "src"},
               "destination": {"export": "a"}, "length": 4 << 20, "method": "pipelined"});
        if let Some(rate) = rate {
            body["rate"] = rate.into();
        }
        let id = submit(&server, body);
        let job = wait_job(&server, id, TIMEOUT);
        assert_eq!(job["state"], "finished", "{job}");
        assert_eq!(job["request"]["rate"], json!(rate), "{job}");
        let waits = job["progress"]["paced_waits"]
            .as_u64()
            .expect("paced_waits");
        assert_eq!(job["result"]["paced_waits"], waits, "{job}");
        match rate {
            None => assert_eq!(waits, 0, "a copy with no rate never waits: {job}"),
            // 1 MiB segments at 4 MiB/s: each is due later than it ends.
            Some(_) => assert!(waits >= 1, "a copy at a rate waits for it: {job}"),
        }
    }

    // A scrub at 1 MiB/s (about a second a chunk), cancelled after its
    // first chunk: its cursor stays in the leg's directory.
    let id = submit(
        &server,
        json!({"op": "scrub", "export": "a", "rate": 1 << 20}),
    );
    wait_until("the scrub's first chunk", TIMEOUT, || {
        common::control::job(&server, id)["progress"]["done_blocks"]
            .as_u64()
            .unwrap_or(0)
            >= 256
    });
    let (status, answer) = common::control::request(
        common::control::control(&server),
        "DELETE",
        &format!("/v1/jobs/{id}"),
        None,
        None,
    );
    assert_eq!(status, 200, "{answer}");
    let cancelled = wait_job(&server, id, TIMEOUT);
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    let cursor_file = a.join("mirror.scrub.cursor");
    let at: u64 = std::fs::read_to_string(&cursor_file)
        .expect("the scrub's cursor")
        .trim()
        .parse()
        .expect("an LBA");
    assert!((256..1024).contains(&at), "cursor {at}");
    let id = submit(&server, json!({"op": "scrub", "export": "a"}));
    let resumed = wait_job(&server, id, TIMEOUT);
    assert_eq!(resumed["state"], "finished", "{resumed}");
    assert_eq!(resumed["result"]["blocks_checked"], 1024 - at, "{resumed}");
    assert_eq!(resumed["progress"]["done_blocks"], 1024, "{resumed}");
    assert!(!cursor_file.exists(), "a finished scrub forgets its cursor");
    drop(server);
    assert_copied_to_every_leg(&[&a, &b], &source, "0", "4M");
}
