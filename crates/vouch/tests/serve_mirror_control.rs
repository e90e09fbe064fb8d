//! A mirrored export and the control API: the scrub job checks and repairs
//! every leg and reports found / repaired / left; a copy into a mirrored
//! export is refused by name (it would write one leg); offline writers of
//! a single leg (`vouch copy`, `vouch key change`) are refused too.

mod common;

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

    let id = submit(
        &server,
        json!({"op": "copy", "source": {"export": "a", "offset": 0},
               "destination": {"export": "a", "offset": 8192}, "length": 4096}),
    );
    let job = wait_job(&server, id, TIMEOUT);
    assert_eq!(job["state"], "failed", "{job}");
    assert!(
        job.to_string().contains("mirrored export"),
        "a copy into a mirror is refused by name: {job}"
    );
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
    let copy = vouch(&["copy", s(&b), s(&b), "--length", "4096"]);
    assert_eq!(copy.status.code(), Some(2), "{}", text(&copy));
    assert!(text(&copy).contains("leg of a mirror"), "{}", text(&copy));
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
