//! `vouch verify|scrub|copy|compare` offline, on stopped volumes: results,
//! `--json` shapes, exit codes (0 clean, 1 faults / differs, 2 errors),
//! and the offline digest equals the one a running server returns.

mod common;

use std::path::Path;

use common::control::control;
use common::*;
use serde_json::Value;

const SEED: &str = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed";

fn json_of(args: &[&str]) -> (i32, Value, String) {
    let output = vouch(args);
    let value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{args:?} --json ({e}): {}", text(&output)));
    (
        output.status.code().expect("code"),
        value,
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

fn exported(volume: &Path, dir: &Path) -> Vec<u8> {
    let raw = dir.join("exported.raw");
    let _ = std::fs::remove_file(&raw);
    vouch_ok(&["export", s(volume), s(&raw)]);
    std::fs::read(&raw).expect("read")
}

#[test]
fn offline_verify_finds_faults_and_its_digest_equals_the_servers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = volume_from(dir.path(), "v", &random_bytes(3 << 20, 21));
    let (code, clean, _) = json_of(&["verify", s(&volume), "--seed", SEED, "--segments", "--json"]);
    assert_eq!(code, 0, "{clean}");
    for key in [
        "offset",
        "length",
        "blocks",
        "blocks_read",
        "faults",
        "clean",
        "digest",
        "segments",
        "elapsed_seconds",
    ] {
        assert!(
            clean.get(key).is_some(),
            "verify --json lacks {key}: {clean}"
        );
    }
    assert_eq!(clean["blocks"], 768);
    let segments = clean["segments"].as_array().expect("segments");
    assert_eq!(segments.len(), 3);
    assert_eq!(
        (segments[2]["lba"].as_u64(), segments[2]["count"].as_u64()),
        (Some(512), Some(256))
    );
    // The same volume served: the same digest and segment digests.
    let server = Server::start(dir.path(), &[s(&volume), "--control", "127.0.0.1:0"]);
    let output = vouch(&[
        "verify",
        "v",
        "--seed",
        SEED,
        "--segments",
        "--json",
        "--server",
        control(&server),
    ]);
    let online: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(online["digest"], clean["digest"]);
    assert_eq!(online["segments"], clean["segments"]);
    drop(server);

    flip_bit(&volume.join("data.00000"), 600 * BLOCK, 0x02);
    let (code, faulty, _) = json_of(&["verify", s(&volume), "--json"]);
    assert_eq!(code, 1, "{faulty}");
    assert_eq!(
        faulty["faults"],
        serde_json::json!([{"lba": 600, "kind": "guard_mismatch"}])
    );
    let human = vouch(&["verify", s(&volume), "--offset", "2M"]);
    let out = String::from_utf8_lossy(&human.stdout);
    assert_eq!(human.status.code(), Some(1));
    assert!(
        out.contains("fault: LBA 600 guard_mismatch") && out.contains("256 blocks verified"),
        "{out}"
    );

    // Errors exit 2 with one clear line.
    for (args, message) in [
        (
            vec!["verify", s(&volume), "--offset", "100"],
            "100 is not a multiple of 4096",
        ),
        (
            vec!["verify", s(&volume), "--offset", "4M", "--length", "4K"],
            "past the end",
        ),
        (vec!["verify", s(&volume), "--seed", "abc"], "64 hex digits"),
        (vec!["verify", "/nonexistent/volume"], "nonexistent"),
        (vec!["verify"], "required"),
        (vec!["verify", s(&volume), "--segments"], "--seed"),
    ] {
        let output = vouch(&args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
        assert!(
            String::from_utf8_lossy(&output.stderr).contains(message),
            "{args:?}: {}",
            text(&output)
        );
    }
}

#[test]
fn offline_copy_between_and_within_volumes_and_compare() {
    let dir = tempfile::tempdir().expect("tempdir");
    let source = random_bytes(2 << 20, 22);
    let a = volume_from(dir.path(), "a", &source);
    let b = volume_from(dir.path(), "b", &random_bytes(2 << 20, 23));
    let (code, copied, _) = json_of(&[
        "copy",
        s(&a),
        s(&b),
        "--length",
        "1M",
        "--destination-offset",
        "1M",
        "--json",
    ]);
    assert_eq!(code, 0, "{copied}");
    assert_eq!(copied["blocks"], 256);
    let (code, equal, _) = json_of(&[
        "compare",
        s(&a),
        "--length",
        "1M",
        "--with",
        s(&b),
        "--with-offset",
        "1M",
        "--json",
    ]);
    assert_eq!((code, equal["equal"].as_bool()), (0, Some(true)), "{equal}");
    let (code, differs, _) = json_of(&[
        "compare",
        s(&a),
        "--length",
        "2M",
        "--with",
        s(&b),
        "--json",
    ]);
    assert_eq!(code, 1, "{differs}");
    assert!(differs["first_difference"].as_u64().is_some(), "{differs}");
    assert_check_clean(&b);

    // Within one volume, overlapping: memmove semantics.
    let (code, within, _) = json_of(&[
        "copy",
        s(&a),
        s(&a),
        "--length",
        "1M",
        "--destination-offset",
        "512K",
        "--json",
    ]);
    assert_eq!(code, 0, "{within}");
    let mut expected = source.clone();
    expected.copy_within(0..1 << 20, 512 << 10);
    assert!(exported(&a, dir.path()) == expected, "memmove semantics");
    assert_check_clean(&a);

    // Compare with a file: equal, then a byte off.
    let file = dir.path().join("slice");
    std::fs::write(&file, &expected[8192..16384]).expect("write");
    let human = vouch(&["compare", s(&a), "--offset", "8K", "--with-file", s(&file)]);
    assert_eq!(human.status.code(), Some(0), "{}", text(&human));
    assert!(String::from_utf8_lossy(&human.stdout).contains("equal"));
    let mut changed = expected[8192..16384].to_vec();
    changed[5000] ^= 1;
    std::fs::write(&file, &changed).expect("write");
    let (code, differs, _) = json_of(&[
        "compare",
        s(&a),
        "--offset",
        "8K",
        "--with-file",
        s(&file),
        "--json",
    ]);
    assert_eq!(
        (code, differs["first_difference"].as_u64()),
        (1, Some(5000)),
        "{differs}"
    );

    // A corrupt source block fails the copy naming it (exit 1).
    flip_bit(&a.join("data.00000"), 3 * BLOCK, 0x01);
    let output = vouch(&["copy", s(&a), s(&b), "--length", "64K"]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("LBA 3"),
        "{}",
        text(&output)
    );
    // Bad input: unaligned, past the end, unknown method, compare without a partner.
    for args in [
        vec!["copy", s(&a), s(&b), "--length", "5000"],
        vec!["copy", s(&a), s(&b), "--length", "4M"],
        vec![
            "copy",
            s(&a),
            s(&b),
            "--length",
            "4K",
            "--method",
            "teleport",
        ],
        vec!["compare", s(&a), "--length", "4K"],
    ] {
        let output = vouch(&args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
    }
}

#[test]
fn offline_scrub_keeps_a_record_that_status_shows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = volume_from(dir.path(), "v", &random_bytes(1 << 20, 24));
    let (code, never, _) = json_of(&["scrub", s(&volume), "--status", "--json"]);
    assert_eq!((code, never["last_scrub"].is_null()), (0, true), "{never}");
    let (code, record, _) = json_of(&["scrub", s(&volume), "--json"]);
    assert_eq!(code, 0, "{record}");
    for key in [
        "state",
        "started_unix",
        "finished_unix",
        "cursor",
        "blocks_total",
        "blocks_checked",
        "faults",
        "error",
    ] {
        assert!(
            record.get(key).is_some(),
            "scrub --json lacks {key}: {record}"
        );
    }
    assert_eq!(
        (record["state"].as_str(), record["cursor"].as_u64()),
        (Some("finished"), Some(256))
    );
    flip_bit(&volume.join("data.00000"), 9 * BLOCK + 4, 0x08);
    let (code, record, _) = json_of(&["scrub", s(&volume), "--json"]);
    assert_eq!(code, 1, "{record}");
    assert_eq!(
        record["faults"],
        serde_json::json!([{"lba": 9, "kind": "guard_mismatch"}])
    );
    let (_, status, _) = json_of(&["scrub", s(&volume), "--status", "--json"]);
    assert_eq!(status["last_scrub"], record);
    let output = vouch(&["scrub", s(&volume), "--cancel"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
}
