//! `vouch info` shows the last scrub (state, times, blocks, faults with
//! their first LBAs) in text and JSON, "never" before the first, and an
//! unreadable record without failing.

use std::os::unix::fs::FileExt;
use std::process::Command;
use vouch_engine::DeviceWrites;

use vouch_engine::jobs::JobControl;
use vouch_engine::scrub::{scrub, ScrubOptions};
use vouch_engine::{create_volume, CreateOptions, BLOCK};

fn info(path: &std::path::Path, json: bool) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_vouch"));
    command.arg("info");
    if json {
        command.arg("--json");
    }
    let output = command.arg(path).output().expect("run vouch info");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

#[test]
fn info_shows_the_last_scrub_with_its_faults() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("volume");
    let volume = create_volume(&path, &CreateOptions::new(4 << 20)).expect("create");
    volume
        .write(0, &vec![0x5au8; 64 * BLOCK as usize], false)
        .expect("write");
    volume.close().expect("close");
    assert!(info(&path, false).contains("last scrub:      never"));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&info(&path, true)).expect("json")["last_scrub"],
        serde_json::Value::Null
    );

    // Damage blocks 3 and 40 (split layout: data at LBA * 4096).
    let data = std::fs::OpenOptions::new()
        .write(true)
        .open(path.join("data.00000"))
        .expect("open data");
    data.write_all_at(&[0xff], 3 * BLOCK + 17).expect("write");
    data.write_all_at(&[0xff], 40 * BLOCK + 17).expect("write");
    drop(data);
    let volume = vouch_engine::open_volume(&path, &Default::default()).expect("open");
    let record = scrub(
        &volume,
        &path,
        &ScrubOptions::default(),
        &JobControl::default(),
    )
    .expect("scrub");
    assert_eq!(record.faults_found, 2);
    volume.close().expect("close");

    let text = info(&path, false);
    assert!(
        text.contains("last scrub:      finished, started 20"),
        "{text}"
    );
    assert!(text.contains("1024 of 1024 blocks scanned"), "{text}");
    assert!(text.contains("2 fault(s)"), "{text}");
    assert!(
        text.contains("faulty LBAs: 3 (guard_mismatch), 40 (guard_mismatch)"),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_str(&info(&path, true)).expect("json");
    let scrub = &json["last_scrub"];
    assert_eq!(scrub["state"], "finished");
    assert_eq!(scrub["blocks_total"], 1024);
    assert_eq!(scrub["blocks_checked"], 256);
    assert_eq!(scrub["faults_found"], 2);
    assert_eq!(scrub["first_faults"][1]["lba"], 40);
    assert_eq!(scrub["first_faults"][1]["kind"], "guard_mismatch");
    assert!(
        scrub["finished_unix"].as_u64().expect("finished")
            >= scrub["started_unix"].as_u64().expect("started")
    );

    // A damaged record is shown as such; info still succeeds.
    std::fs::write(path.join("scrub.json"), "{").expect("write");
    assert!(info(&path, false).contains("last scrub:      unknown (cannot parse the scrub record"));
    let json: serde_json::Value = serde_json::from_str(&info(&path, true)).expect("json");
    assert!(json["last_scrub"]["error"]
        .as_str()
        .expect("error")
        .contains("scrub.json"));
}
