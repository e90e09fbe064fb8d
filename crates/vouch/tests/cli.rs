//! The offline commands through the real binary on real files: round trips,
//! every bad input, and on-disk corruption found by `check` at exactly the
//! LBAs that were damaged.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use vouch_engine::DeviceWrites;

use vouch_format::layout::{PACKED_RECORDS_PER_ROW, PACKED_RECORD_BYTES, PACKED_ROW_BYTES};

mod common;

use common::{check_faults, info_json, rewrite_superblock, s, text, vouch};

/// Run and expect success; returns stdout.
fn ok(args: &[&str]) -> String {
    let output = vouch(args);
    assert!(
        output.status.success(),
        "vouch {args:?} failed: {}",
        text(&output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Run and expect failure with `code`; the error must be one clear line.
fn fails(args: &[&str], code: i32, needle: &str) -> String {
    let output = vouch(args);
    let all = text(&output);
    assert_eq!(output.status.code(), Some(code), "vouch {args:?}: {all}");
    assert!(
        all.contains(needle),
        "vouch {args:?}: expected {needle:?} in: {all}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let error_lines: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("error"))
        .collect();
    assert_eq!(
        error_lines.len(),
        1,
        "one clear error line expected: {stderr}"
    );
    all
}

/// A raw image with distinct, non-zero content in every block.
/// A `blocks`-block raw image imported into `dir/vol` on `layout`, and a
/// copy of the volume's `files` as they are now (to restore later as an
/// older copy): (the image, the volume, the copies).
fn imported_with_copies(
    dir: &Path,
    blocks: u64,
    layout: &str,
    files: &[&str],
) -> (PathBuf, PathBuf, Vec<Vec<u8>>) {
    let raw = raw_image(dir, blocks);
    let volume = dir.join("vol");
    ok(&["import", s(&raw), s(&volume), "--layout", layout]);
    let older = files
        .iter()
        .map(|file| std::fs::read(volume.join(file)).expect("the older copy"))
        .collect();
    (raw, volume, older)
}

/// `check` finds no fault and `export` to `out` gives exactly `want`'s bytes.
fn assert_checks_clean_and_exports(volume: &Path, out: &Path, want: &Path, what: &str) {
    assert_eq!(check_faults(volume), (0, vec![]), "{what}");
    ok(&["export", s(volume), s(out)]);
    assert!(
        std::fs::read(want).expect("want") == std::fs::read(out).expect("out"),
        "{what} differs"
    );
}

fn raw_image(dir: &Path, blocks: u64) -> PathBuf {
    let path = dir.join("raw.img");
    let mut bytes = Vec::with_capacity((blocks * 4096) as usize);
    for block in 0..blocks {
        for i in 0..4096u64 {
            bytes.push((block.wrapping_mul(31) ^ i.wrapping_mul(7) ^ 0x5A) as u8 | 1);
        }
    }
    std::fs::write(&path, bytes).expect("write raw");
    path
}

fn xor_byte(path: &Path, offset: u64, mask: u8) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset).expect("read byte");
    byte[0] ^= mask;
    file.write_all_at(&byte, offset).expect("write byte");
}

fn swap(path: &Path, a: u64, b: u64, len: usize) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let (mut first, mut second) = (vec![0u8; len], vec![0u8; len]);
    file.read_exact_at(&mut first, a).expect("read");
    file.read_exact_at(&mut second, b).expect("read");
    file.write_all_at(&second, a).expect("write");
    file.write_all_at(&first, b).expect("write");
}

fn packed_offset(lba: u64) -> u64 {
    (lba / PACKED_RECORDS_PER_ROW) * PACKED_ROW_BYTES
        + (lba % PACKED_RECORDS_PER_ROW) * PACKED_RECORD_BYTES
}

#[test]
fn import_check_export_round_trip_both_layouts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 300);
    for layout in ["split", "packed"] {
        for guard in ["crc32c", "crc64nvme", "crc16t10dif", "xxh3", "none"] {
            let volume = dir.path().join(format!("{layout}-{guard}"));
            let out = dir.path().join(format!("{layout}-{guard}.img"));
            ok(&[
                "import",
                s(&raw),
                s(&volume),
                "--layout",
                layout,
                "--guard",
                guard,
            ]);
            let info = ok(&["info", s(&volume), "--json"]);
            let info: serde_json::Value = serde_json::from_str(&info).expect("info json");
            assert_eq!(info["layout"], layout);
            assert_eq!(info["guard"], guard);
            assert_eq!(info["size_bytes"], 300 * 4096);
            assert_checks_clean_and_exports(&volume, &out, &raw, &format!("{layout}/{guard}"));
        }
    }
}

#[test]
fn create_at_16_tib_is_sparse() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("big");
    // What makes it quick is what is asserted: it allocates (so writes)
    // almost nothing.
    ok(&["create", s(&volume), "--size", "16TiB"]);
    let info: serde_json::Value =
        serde_json::from_str(&ok(&["info", s(&volume), "--json"])).expect("json");
    assert_eq!(info["size_bytes"], 16u64 << 40);
    // Sparse: only the preallocated journal and a few pages are allocated.
    let journal = info["journal_bytes"].as_u64().expect("journal_bytes");
    let allocated = info["allocated_bytes"].as_u64().expect("allocated");
    assert!(
        allocated < journal + (1 << 20),
        "a 16 TiB volume allocated {allocated} bytes (journal {journal})"
    );
    let (code, faults) = check_faults(&volume);
    assert_eq!((code, faults.len()), (0, 0));
}

#[test]
fn bad_inputs_get_one_clear_error_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing");
    fails(&["info", s(&missing)], 2, "does not exist");
    fails(&["check", s(&missing)], 2, "does not exist");
    fails(
        &["export", s(&missing), s(&dir.path().join("x.img"))],
        2,
        "does not exist",
    );
    let volume = dir.path().join("vol");
    ok(&["create", s(&volume), "--size", "1MiB"]);
    let before = std::fs::read(volume.join("superblock")).expect("superblock");
    fails(
        &["create", s(&volume), "--size", "1MiB"],
        2,
        "already exists",
    );
    assert_eq!(
        std::fs::read(volume.join("superblock")).expect("superblock"),
        before,
        "create touched an existing volume"
    );
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"not a volume").expect("write");
    fails(&["create", s(&file), "--size", "1MiB"], 2, "already exists");
    assert_eq!(std::fs::read(&file).expect("file"), b"not a volume");
    fails(&["info", s(&file)], 2, "not a vouch volume");
    // Sizes that do not fit.
    fails(
        &["create", s(&dir.path().join("a")), "--size", "1000"],
        2,
        "multiple of 4096",
    );
    fails(
        &["create", s(&dir.path().join("b")), "--size", "2PiB"],
        2,
        "largest volume",
    );
    // Huge sizes are "too large", not "not a multiple of 4096": a number
    // past 1 PiB, and a unit size past 2^64 bytes (which would saturate).
    fails(
        &[
            "create",
            s(&dir.path().join("d")),
            "--size",
            "18446744073709551615",
        ],
        2,
        "largest volume",
    );
    fails(
        &["create", s(&dir.path().join("e")), "--size", "99EiB"],
        2,
        "too large",
    );
    let output = vouch(&["create", s(&dir.path().join("c")), "--size", "lots"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text(&output).contains("is not a size"));
    assert!(
        ["a", "b", "c", "d", "e"]
            .iter()
            .all(|name| !dir.path().join(name).exists()),
        "failed create left files"
    );
    // Export refuses to overwrite an existing file.
    fails(&["export", s(&volume), s(&file)], 2, "must not exist");
    assert_eq!(std::fs::read(&file).expect("file"), b"not a volume");
}

#[test]
fn truncated_and_corrupt_superblocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    ok(&["create", s(&volume), "--size", "1MiB"]);
    let superblock = volume.join("superblock");
    let good = std::fs::read(&superblock).expect("read");
    // One corrupt copy: the other one is used.
    xor_byte(&superblock, 70, 0xFF);
    ok(&["info", s(&volume)]);
    // Both corrupt: refused, clearly.
    xor_byte(&superblock, 4096 + 70, 0xFF);
    fails(
        &["info", s(&volume)],
        2,
        "both superblock copies are invalid",
    );
    fails(&["check", s(&volume)], 2, "superblock");
    // Truncated.
    std::fs::write(&superblock, &good[..100]).expect("truncate");
    fails(&["info", s(&volume)], 2, "not a usable vouch volume");
    std::fs::write(&superblock, b"").expect("truncate");
    fails(&["check", s(&volume)], 2, "not a usable vouch volume");
}

#[test]
fn feature_flags_are_checked_against_the_supported_mask() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    ok(&["create", s(&volume), "--size", "1MiB"]);
    // `read_only` is the volume's: `info` itself always opens read-only.
    let info = ok(&["info", s(&volume), "--json"]);
    assert!(
        info.contains("\"read_only\": false"),
        "a writable volume: {info}"
    );
    rewrite_superblock(&volume, |sb| sb.features.compat |= 1 << 40);
    ok(&["check", s(&volume)]);
    rewrite_superblock(&volume, |sb| sb.features.ro_compat |= 1 << 7);
    let info = ok(&["info", s(&volume), "--json"]);
    assert!(
        info.contains("\"read_only\": true"),
        "unknown ro_compat must open read-only: {info}"
    );
    let info = ok(&["info", s(&volume)]);
    assert!(
        info.contains("writable:        no: ro_compat features 0x80 are unknown"),
        "{info}"
    );
    use vouch_engine::BlockDevice;
    let engine = vouch_engine::open_volume(&volume, &vouch_engine::OpenOptions::default())
        .expect("opens read-only");
    assert!(engine.is_read_only());
    let error = engine
        .write(0, &[1u8; 4096], false)
        .expect_err("write must be refused");
    assert!(error.to_string().contains("ro-compat"), "{error}");
    drop(engine);
    rewrite_superblock(&volume, |sb| sb.features.incompat |= 1 << 33);
    fails(&["info", s(&volume)], 2, "refusing to open");
    rewrite_superblock(&volume, |sb| {
        sb.features.incompat |= vouch_format::FeatureFlags::INCOMPAT_ENCRYPTED
    });
    fails(&["check", s(&volume)], 2, "refusing to open");
    // ENCRYPTED is supported now: set on a plain volume (no wrapped key),
    // it asks for a key, and no key unlocks it.
    rewrite_superblock(&volume, |sb| sb.features.incompat &= !(1 << 33));
    fails(&["check", s(&volume)], 2, "no key was given");
    let key = dir.path().join("key");
    std::fs::write(&key, [0u8; 32]).expect("write key");
    fails(
        &["check", s(&volume), "--key-file", s(&key)],
        2,
        "wrong key",
    );
}

#[test]
fn check_names_exactly_the_corrupted_lbas_split() {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 64);
    let volume = dir.path().join("vol");
    ok(&["import", s(&raw), s(&volume)]);
    let data = volume.join("data.00000");
    let contexts = volume.join("contexts");
    xor_byte(&data, 5 * 4096 + 100, 0x01); // bit flip in data of LBA 5
    xor_byte(&contexts, 9 * 32 + 17, 0x10); // bit flip in the context of LBA 9
    swap(&data, 20 * 4096, 30 * 4096, 4096); // blocks 20 and 30 swapped on disk
    let (code, faults) = check_faults(&volume);
    assert_eq!(code, 1);
    assert_eq!(
        faults,
        vec![
            (5, "guard_mismatch".to_string()),
            (9, "context_corrupt".to_string()),
            (20, "guard_mismatch".to_string()),
            (30, "guard_mismatch".to_string()),
        ]
    );
    let out = dir.path().join("out.img");
    let error = fails(
        &["export", s(&volume), s(&out)],
        2,
        "LBA 5 (guard_mismatch)",
    );
    assert!(error.contains("LBA 30"), "{error}");
    assert!(
        !out.exists(),
        "a failed export must not leave a partial image"
    );
    ok(&["export", s(&volume), s(&out), "--allow-faults"]);
    let exported = std::fs::read(&out).expect("out");
    let original = std::fs::read(&raw).expect("raw");
    for lba in 0..64usize {
        let block = &exported[lba * 4096..(lba + 1) * 4096];
        if [5, 9, 20, 30].contains(&lba) {
            assert!(
                block.iter().all(|b| *b == 0),
                "faulty LBA {lba} must be zero-filled"
            );
        } else {
            assert_eq!(block, &original[lba * 4096..(lba + 1) * 4096], "LBA {lba}");
        }
    }
}

#[test]
fn check_names_exactly_the_corrupted_lbas_packed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 100);
    let volume = dir.path().join("vol");
    ok(&["import", s(&raw), s(&volume), "--layout", "packed"]);
    let data = volume.join("data.00000");
    xor_byte(&data, packed_offset(3) + 7, 0x80); // data bit flip
    xor_byte(&data, packed_offset(40) + 4096 + 18, 0x04); // context bit flip
    swap(
        &data,
        packed_offset(50),
        packed_offset(77),
        PACKED_RECORD_BYTES as usize,
    ); // records swapped
    let (code, faults) = check_faults(&volume);
    assert_eq!(code, 1);
    assert_eq!(
        faults,
        vec![
            (3, "guard_mismatch".to_string()),
            (40, "context_corrupt".to_string()),
            (50, "ref_tag_mismatch".to_string()),
            (77, "ref_tag_mismatch".to_string()),
        ]
    );
}

#[test]
fn import_of_an_empty_or_missing_raw_fails_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = dir.path().join("empty.img");
    std::fs::write(&empty, b"").expect("write");
    fails(
        &["import", s(&empty), s(&dir.path().join("v"))],
        2,
        "is empty",
    );
    fails(
        &[
            "import",
            s(&dir.path().join("nope.img")),
            s(&dir.path().join("v")),
        ],
        2,
        "cannot open",
    );
    assert!(!dir.path().join("v").exists());
}

#[test]
fn help_documents_every_command() {
    let help = ok(&["--help"]);
    for command in [
        "create", "info", "check", "import", "export", "serve", "bench",
    ] {
        assert!(help.contains(command), "--help lacks {command}");
        let sub = ok(&[command, "--help"]);
        assert!(sub.contains("Usage: vouch"), "{command} --help: {sub}");
    }
}

/// `vouch bench` end to end on a small volume: every configuration runs
/// every selected workload, reads verify real data (engine read counters
/// move), the cold test runs, and write amplification is reported.
#[test]
fn bench_runs_every_configuration_and_workload() {
    for interleave in [false, true] {
        bench_once(interleave);
    }
}

fn bench_once(interleave: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let mut args = vec![
        "bench",
        "--configs",
        "raw,split,packed",
        "--guards",
        "crc32c",
        "--workloads",
        "randread,coldread,randwrite,coldwrite",
        "--qd",
        "1,4",
        "--repeat",
        "1",
        "--seconds",
        "0.3",
        "--size",
        "16MiB",
        "--dir",
        s(dir.path()),
        "--json",
        s(&json),
    ];
    if interleave {
        args.push("--interleave");
    }
    let stdout = ok(&args);
    assert!(stdout.contains("Guard cost on this CPU"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
    let samples = report["samples"].as_array().expect("samples");
    for config in ["raw", "split/crc32c", "packed/crc32c"] {
        for workload in [
            "randread-4k-qd1",
            "randread-4k-qd4",
            "randread-cold-4k-qd1",
            "randread-cold-4k-qd4",
            "randwrite-4k-qd1",
            "randwrite-4k-qd4",
            "randwrite-cold-4k-qd1",
            "randwrite-cold-4k-qd4",
        ] {
            let sample = samples
                .iter()
                .find(|x| x["config"] == config && x["workload"] == workload)
                .unwrap_or_else(|| panic!("no sample for {config} {workload}"));
            assert!(sample["ops"].as_u64().unwrap() > 0, "{sample}");
            if config != "raw" {
                let engine = &sample["detail"]["engine"];
                if workload.starts_with("randread") {
                    assert!(
                        engine["backing_bytes_read"].as_u64().unwrap() > 0,
                        "{sample}"
                    );
                } else {
                    assert!(sample["wa_engine"].as_f64().unwrap() > 0.0, "{sample}");
                }
            }
        }
    }
    // The work directory is removed afterwards.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("bench.json")]);
}

/// How a test loses a volume's metadata (issue 28).
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// The file holding the metadata (split: `contexts`, packed:
    /// `data.00000`) cut to half its length.
    CutShort,
    /// The same file emptied (`: > file`).
    Emptied,
    /// The same file deleted.
    Deleted,
    /// One metadata unit zeroed in place: split, context page 3; packed, row 3.
    UnitZeroed,
    /// Split only: the data file cut to half (contexts intact).
    DataCutShort,
    /// Split only, guard `none` (nothing compares data with its context):
    /// the data file cut to half.
    DataCutShortUnguarded,
    /// Split only, guard `none`: the data file emptied.
    DataEmptiedUnguarded,
    /// One slot of unit 3 zeroed (split: LBA 389's context; packed: LBA
    /// 94's, the second record of row 3).
    ZeroedInPart,
    /// Unit 5 copied over unit 3 (plain volumes: the message reads the
    /// tags, which an encrypted context does not carry in the clear).
    FromElsewhere,
    /// Unit 3 of another volume (the same image imported again) copied
    /// over unit 3 (plain volumes, as above).
    FromOtherVolume,
}

/// Import 2048 distinct blocks into a new volume, lose metadata as
/// `loss` says, and check what `check` and `export` report: a refusal
/// naming the file, or faults naming the LBAs and the cause, once per
/// file or unit — never zeros or a clean check.
fn lost_metadata_is_reported(layout: &str, encrypted: bool, loss: Loss) {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 2048);
    let volume = dir.path().join("vol");
    let key = dir.path().join("key");
    std::fs::write(&key, [7u8; 32]).expect("write key");
    let mut args = vec![
        "import",
        s(&raw),
        s(&volume),
        "--layout",
        layout,
        "--journal",
        "4MiB",
    ];
    if encrypted {
        args.extend(["--encrypt", "--key-file", s(&key)]);
    }
    if matches!(
        loss,
        Loss::DataCutShortUnguarded | Loss::DataEmptiedUnguarded
    ) {
        args.extend(["--guard", "none"]);
    }
    ok(&args);
    let with_key = |args: &[&str]| -> Vec<String> {
        let mut owned: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
        if encrypted {
            owned.push("--key-file".into());
            owned.push(s(&key).to_string());
        }
        owned
    };
    let packed = layout == "packed";
    let file = volume.join(match loss {
        Loss::DataCutShort | Loss::DataCutShortUnguarded | Loss::DataEmptiedUnguarded => {
            "data.00000"
        }
        _ if packed => "data.00000",
        _ => "contexts",
    });
    let full = std::fs::metadata(&file).expect("stat").len();
    // The lines `check` must print, and the LBAs that must be faults.
    let (expected, lost): (String, std::ops::Range<u64>) = match (loss, packed) {
        (Loss::CutShort, false) => (
            "contexts is 32 KiB, the volume needs 64 KiB: LBAs 1024-2047 have no protection information (1024 faults)".into(),
            1024..2048,
        ),
        (Loss::CutShort, true) => (
            "data.00000 is 4224 KiB, the volume needs 8576 KiB: LBAs 1023-2047 are missing (1025 faults)".into(),
            1023..2048,
        ),
        (Loss::Emptied, false) => (
            "contexts is 0 bytes, the volume needs 64 KiB: LBAs 0-2047 have no protection information (2048 faults)".into(),
            0..2048,
        ),
        (Loss::Emptied, true) => (
            "data.00000 is 0 bytes, the volume needs 8576 KiB: LBAs 0-2047 are missing (2048 faults)".into(),
            0..2048,
        ),
        (Loss::UnitZeroed, false) => (
            "contexts: page 3 is zeroed: LBAs 384-511 have no protection information".into(),
            384..512,
        ),
        (Loss::UnitZeroed, true) => (
            "data.00000: row 3 is zeroed: LBAs 93-123 have no protection information".into(),
            93..124,
        ),
        (Loss::ZeroedInPart, false) => (
            "contexts: page 3 has 1 blank slot (cut or zeroed in part): LBA 389 has no protection information".into(),
            389..390,
        ),
        (Loss::ZeroedInPart, true) => (
            "data.00000: row 3 has 1 blank slot (cut or zeroed in part): LBA 94 has no protection information".into(),
            94..95,
        ),
        (Loss::FromElsewhere, false) => (
            "contexts: page 3 belongs to another place (its slots name LBAs 640-767): LBAs 384-511 have no valid protection information".into(),
            384..512,
        ),
        (Loss::FromElsewhere, true) => (
            "data.00000: row 3 belongs to another place (its slots name LBAs 155-185): LBAs 93-123 have no valid protection information".into(),
            93..124,
        ),
        (Loss::FromOtherVolume, false) => (
            "contexts: page 3 belongs to another volume: LBAs 384-511 have no valid protection information".into(),
            384..512,
        ),
        (Loss::FromOtherVolume, true) => (
            "data.00000: row 3 belongs to another volume: LBAs 93-123 have no valid protection information".into(),
            93..124,
        ),
        (Loss::DataEmptiedUnguarded, _) => (
            "data.00000 is 0 bytes, the volume needs 8 MiB: LBAs 0-2047 are missing (2048 faults)".into(),
            0..2048,
        ),
        (Loss::DataCutShort | Loss::DataCutShortUnguarded, _) => (
            "data.00000 is 4 MiB, the volume needs 8 MiB: LBAs 1024-2047 are missing (1024 faults)".into(),
            1024..2048,
        ),
        (Loss::Deleted, _) => (String::new(), 0..0),
    };
    let handle = std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .expect("open");
    match loss {
        Loss::CutShort => handle.set_len(if packed { 33 * 131072 } else { full / 2 }),
        Loss::DataCutShort | Loss::DataCutShortUnguarded => handle.set_len(full / 2),
        Loss::DataEmptiedUnguarded => handle.set_len(0),
        Loss::Emptied => handle.set_len(0),
        Loss::Deleted => std::fs::remove_file(&file),
        Loss::UnitZeroed => {
            let unit = if packed { 131072 } else { 4096 };
            handle.write_all_at(&vec![0u8; unit], 3 * unit as u64)
        }
        Loss::ZeroedInPart => {
            let slot = if packed {
                3 * 131072 + 4128 + 4096
            } else {
                389 * 32
            };
            handle.write_all_at(&[0u8; 32], slot)
        }
        Loss::FromElsewhere | Loss::FromOtherVolume => {
            let unit = if packed { 131072 } else { 4096 };
            let source = if let Loss::FromElsewhere = loss {
                (file.clone(), 5 * unit as u64)
            } else {
                let other = dir.path().join("other");
                let mut args = args.clone();
                args[2] = s(&other);
                ok(&args);
                (
                    other.join(file.file_name().expect("a file name")),
                    3 * unit as u64,
                )
            };
            let mut bytes = vec![0u8; unit];
            std::fs::File::open(&source.0)
                .and_then(|from| from.read_exact_at(&mut bytes, source.1))
                .expect("read the unit to copy");
            handle.write_all_at(&bytes, 3 * unit as u64)
        }
    }
    .expect("lose metadata");
    drop(handle);

    let check = with_key(&["check", s(&volume)]);
    let check: Vec<&str> = check.iter().map(String::as_str).collect();
    if let Loss::Deleted = loss {
        fails(&check, 2, "is missing: every file of the volume is needed");
        let export = with_key(&["export", s(&volume), "out.raw"]);
        let export: Vec<&str> = export.iter().map(String::as_str).collect();
        fails(&export, 2, "is missing");
        return;
    }
    let output = vouch(&check);
    let report = String::from_utf8_lossy(&output.stdout).to_string();
    assert_eq!(
        output.status.code(),
        Some(1),
        "{loss:?}: check must fail: {report}"
    );
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(
        lines.iter().filter(|line| line.contains("LBA")).count(),
        1,
        "{loss:?}: one line for the loss: {report}"
    );
    assert!(
        lines.contains(&expected.as_str()),
        "{loss:?}: expected {expected:?} in:\n{report}"
    );
    assert!(
        !report.contains("fault: LBA"),
        "{loss:?}: the lost blocks are not listed one by one: {report}"
    );
    let mut json = check.clone();
    json.push("--json");
    let json: serde_json::Value =
        serde_json::from_slice(&vouch(&json).stdout).expect("check --json");
    let faults: Vec<u64> = json["faults"]
        .as_array()
        .expect("faults")
        .iter()
        .map(|fault| fault["lba"].as_u64().expect("lba"))
        .collect();
    assert_eq!(faults, lost.clone().collect::<Vec<_>>(), "{loss:?}: {json}");

    // Export refuses, naming the loss once; with --allow-faults it
    // zero-fills exactly the lost blocks and says so.
    let out = dir.path().join("out.raw");
    let export = with_key(&["export", s(&volume), s(&out)]);
    let export: Vec<&str> = export.iter().map(String::as_str).collect();
    fails(&export, 2, &expected);
    assert!(!out.exists(), "nothing exported");
    let mut allowed = export.clone();
    allowed.push("--allow-faults");
    let output = vouch(&allowed);
    assert!(output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains(&format!("zero-filled: {expected}")),
        "{}",
        text(&output)
    );
    let exported = std::fs::read(&out).expect("exported");
    let original = std::fs::read(&raw).expect("raw");
    for lba in 0..2048u64 {
        let at = (lba * 4096) as usize..((lba + 1) * 4096) as usize;
        if lost.contains(&lba) {
            assert!(
                exported[at].iter().all(|b| *b == 0),
                "LBA {lba} zero-filled"
            );
        } else {
            assert_eq!(
                exported[at.clone()],
                original[at],
                "{loss:?}: LBA {lba} must export intact"
            );
        }
    }
}

#[test]
fn lost_metadata_is_a_fault_never_zeros_split() {
    for loss in [
        Loss::CutShort,
        Loss::Emptied,
        Loss::Deleted,
        Loss::UnitZeroed,
        Loss::DataCutShort,
        Loss::DataCutShortUnguarded,
        Loss::DataEmptiedUnguarded,
        Loss::ZeroedInPart,
    ] {
        lost_metadata_is_reported("split", false, loss);
    }
}

#[test]
fn lost_metadata_is_a_fault_never_zeros_packed() {
    for loss in [
        Loss::CutShort,
        Loss::Emptied,
        Loss::Deleted,
        Loss::UnitZeroed,
        Loss::ZeroedInPart,
    ] {
        lost_metadata_is_reported("packed", false, loss);
    }
}

#[test]
fn lost_metadata_is_a_fault_never_zeros_encrypted() {
    for layout in ["split", "packed"] {
        for loss in [
            Loss::CutShort,
            Loss::Emptied,
            Loss::Deleted,
            Loss::UnitZeroed,
            Loss::ZeroedInPart,
        ] {
            lost_metadata_is_reported(layout, true, loss);
        }
    }
}

/// Issue 28: a metadata unit copied in from another place or another
/// volume is named once by `check` and `export`, every block of it a
/// fault — never its neighbour's or the other volume's data, never zeros.
#[test]
fn a_unit_from_elsewhere_is_named_never_read() {
    for layout in ["split", "packed"] {
        for loss in [Loss::FromElsewhere, Loss::FromOtherVolume] {
            lost_metadata_is_reported(layout, false, loss);
        }
    }
}

/// `vouch check` fails (exit 1) with `line` among its output lines.
fn check_says(volume: &Path, line: &str) {
    let output = vouch(&["check", s(volume)]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(
        stdout.lines().any(|found| found == line),
        "expected {line:?} in:
{stdout}"
    );
}

/// The issue's reproduction as written: a 64 MiB import whose `contexts`
/// is cut to 256 KiB checked clean and exported zeros from 32 MiB on.
#[test]
fn issue_28_contexts_cut_short_is_not_clean() {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 16384);
    let volume = dir.path().join("vol");
    ok(&["import", s(&raw), s(&volume)]);
    let contexts = std::fs::OpenOptions::new()
        .write(true)
        .open(volume.join("contexts"))
        .expect("open");
    contexts.set_len(262144).expect("truncate");
    check_says(
        &volume,
        "contexts is 256 KiB, the volume needs 512 KiB: LBAs 8192-16383 have no protection information (8192 faults)",
    );
    fails(
        &["export", s(&volume), s(&dir.path().join("o.raw"))],
        2,
        "nothing exported",
    );
}

/// A volume of an older format: `check` passes noting `note`, a write (a
/// copy within the volume) is refused naming `refusal`, and after `vouch
/// upgrade` (which says `done`) the same copy succeeds.
fn upgrade_makes_writable(volume: &Path, note: &str, refusal: &str, done: &str) {
    let old = vouch(&["check", s(volume)]);
    assert!(
        old.status.success() && text(&old).contains(note),
        "{}",
        text(&old)
    );
    let copy = [
        "copy",
        s(volume),
        s(volume),
        "--length",
        "4096",
        "--destination-offset",
        "8192",
    ];
    fails(&copy, 2, refusal);
    let said = ok(&["upgrade", s(volume)]);
    assert!(said.contains(done), "{said}");
    ok(&copy);
}

/// A volume made before whole metadata units (a written map, but blank
/// slots for never-written blocks, as the binary before wrote them) opens
/// read-only, saying how to upgrade; `vouch upgrade` writes the vacant
/// markers, after which it is writable and a slot zeroed later is caught.
#[test]
fn volumes_before_whole_units_upgrade_explicitly() {
    for layout in ["split", "packed"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let raw = raw_image(dir.path(), 1024);
        let volume = dir.path().join("vol");
        ok(&[
            "import",
            s(&raw),
            s(&volume),
            "--layout",
            layout,
            "--journal",
            "4MiB",
        ]);
        let packed = layout == "packed";
        let (file, slot, line) = if packed {
            (
                "data.00000",
                3 * 131072 + 4128 + 4096,
                "data.00000: row 3 has 1 blank slot (cut or zeroed in part): LBA 94 has no protection information",
            )
        } else {
            (
                "contexts",
                389 * 32,
                "contexts: page 3 has 1 blank slot (cut or zeroed in part): LBA 389 has no protection information",
            )
        };
        let handle = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(volume.join(file))
            .expect("open");
        // What the binary before wrote for a never-written block inside a
        // written unit: a blank slot.
        handle.write_all_at(&[0u8; 32], slot).expect("blank slot");
        let bound = vouch_format::FeatureFlags::INCOMPAT_BOUND_UNITS;
        rewrite_superblock(&volume, |sb| sb.features.incompat &= !bound);
        upgrade_makes_writable(
            &volume,
            "made before whole metadata units",
            "made before whole metadata units: `vouch upgrade PATH`",
            "every written unit whole",
        );
        let flags = info_json(&volume)["features"]["incompat"]
            .as_u64()
            .expect("incompat");
        assert_ne!(flags & bound, 0, "{layout}");
        let mut marker = [0u8; 32];
        handle.read_exact_at(&mut marker, slot).expect("read slot");
        assert_eq!(marker[0], vouch_format::KIND_VACANT, "{layout}: {marker:?}");
        ok(&["check", s(&volume)]);
        // Whole now: the same slot zeroed again is lost, not never written.
        handle.write_all_at(&[0u8; 32], slot).expect("blank slot");
        check_says(&volume, line);
    }
}

/// An older copy of a packed data file taken before `vouch upgrade` made
/// its rows whole (blank records for never-written blocks, as the binary
/// before left them) is still judged older once the volume has moved on:
/// a record blank in context and data alike is a never-written block of
/// such a copy, not damage that may have hidden the row's newest slot, so
/// the row is judged by its other slots. (Judging a whole row with such a
/// record unsure read LBA 35's older data as current.)
#[test]
fn an_older_copy_from_before_whole_units_is_caught_after_the_upgrade() {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 64);
    let volume = dir.path().join("vol");
    ok(&["import", s(&raw), s(&volume), "--layout", "packed"]);
    let data = volume.join("data.00000");
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&data)
        .expect("open");
    // Row 1 holds LBAs 31-61; 41-61 become never written, as the binary
    // before whole units left them: blank records.
    for slot in 10..PACKED_RECORDS_PER_ROW {
        let at = PACKED_ROW_BYTES + slot * PACKED_RECORD_BYTES;
        handle
            .write_all_at(&vec![0u8; PACKED_RECORD_BYTES as usize], at)
            .expect("blank record");
    }
    let bound = vouch_format::FeatureFlags::INCOMPAT_BOUND_UNITS;
    rewrite_superblock(&volume, |sb| sb.features.incompat &= !bound);
    let older = std::fs::read(&data).expect("the copy from before the upgrade");
    ok(&["upgrade", s(&volume)]);
    ok(&["check", s(&volume)]);
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    common::py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(block_data(35, 7035), 35 * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    restore_and_check_row_1_older(&volume, &data, &older);
}

/// Put an older copy of a packed volume's `data.00000` back and check
/// the volume: `check` fails and names row 1 as older than expected.
fn restore_and_check_row_1_older(volume: &Path, data: &Path, older: &[u8]) {
    std::fs::write(data, older).expect("restore the older copy");
    let output = vouch(&["check", s(volume)]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(
        stdout
            .lines()
            .any(|line| line.starts_with("data.00000: row 1 is older than the volume expects")),
        "{stdout}"
    );
}

/// An older copy of a packed data file is caught when the row's last
/// change before the restore was a trim into part of it: the trim writes
/// a vacant marker (no generation), and the row's expectation is read
/// back from its slots after it (LBA 35's rewrite), not forgotten until
/// the row's next record. Here the older copy holds row 1 as the import
/// wrote it; after the copy LBA 35 is rewritten, LBA 40 trimmed and the
/// volume closed (a checkpoint writes the map). The restored copy's row
/// 1 is older: `check` names it, and `export` fails rather than write
/// LBA 35's old data. (With the expectation forgotten, `check` was clean
/// and the export held the import's LBA 35.)
#[test]
fn an_older_packed_row_last_changed_by_a_trim_is_caught() {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 64);
    let volume = dir.path().join("vol");
    ok(&["import", s(&raw), s(&volume), "--layout", "packed"]);
    let data = volume.join("data.00000");
    let older = std::fs::read(&data).expect("the older copy");
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    common::py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(block_data(35, 7035), 35 * 4096)
h.flush()
h.trim(4096, 40 * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    ok(&["check", s(&volume)]);
    restore_and_check_row_1_older(&volume, &data, &older);
    let exported = dir.path().join("out.raw");
    let output = vouch(&["export", s(&volume), s(&exported)]);
    assert_ne!(output.status.code(), Some(0), "{}", text(&output));
}

/// A volume made before the written map opens read-only, saying how to
/// upgrade it; `vouch upgrade` builds the map from its contexts, after
/// which it is writable and a lost page is caught. A `written` file lost
/// later refuses the open, naming the file and the command. Its written
/// zeroes read as zeros before the upgrade too (the read-only open once
/// compared their tags with a volume tag of no volume, and failed them as
/// `context_corrupt`: `vouch-sim upgrade` found it).
#[test]
fn volumes_before_the_written_map_upgrade_explicitly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = raw_image(dir.path(), 1024);
    let volume = dir.path().join("vol");
    ok(&["import", s(&raw), s(&volume), "--journal", "4MiB"]);
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    common::py_json(
        r#"
h = connect(sys.argv[1])
h.zero(2 * 4096, 5 * 4096, nbd.CMD_FLAG_NO_HOLE)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    let zeroed = 5 * 4096..7 * 4096;
    rewrite_superblock(&volume, |sb| {
        sb.features.incompat &= !(vouch_format::FeatureFlags::INCOMPAT_WRITTEN_MAP
            | vouch_format::FeatureFlags::INCOMPAT_BOUND_UNITS)
    });
    std::fs::remove_file(volume.join("written")).expect("remove written");
    let written_map = vouch_format::FeatureFlags::INCOMPAT_WRITTEN_MAP;
    let incompat = |volume: &Path| {
        info_json(volume)["features"]["incompat"]
            .as_u64()
            .expect("incompat")
    };
    assert_eq!(incompat(&volume) & written_map, 0);
    upgrade_makes_writable(
        &volume,
        "was made before the written map",
        "made before the written map: `vouch upgrade PATH`",
        "written map built",
    );
    assert_ne!(incompat(&volume) & written_map, 0);
    ok(&["check", s(&volume)]);
    let out = dir.path().join("out.raw");
    ok(&["export", s(&volume), s(&out)]);
    let mut expected = std::fs::read(&raw).expect("raw");
    expected[zeroed].fill(0);
    // `upgrade_makes_writable`'s copy of LBA 0 to LBA 2.
    expected.copy_within(0..4096, 8192);
    assert!(std::fs::read(&out).expect("export") == expected, "exported");
    // The map built by the upgrade catches a lost page.
    let contexts = std::fs::OpenOptions::new()
        .write(true)
        .open(volume.join("contexts"))
        .expect("open");
    contexts
        .write_all_at(&[0u8; 4096], 4096)
        .expect("zero page 1");
    check_says(
        &volume,
        "contexts: page 1 is zeroed: LBAs 128-255 have no protection information",
    );
    // Upgrading again adds to the map, never drops from it: the page the
    // map knows written stays lost (not made holes).
    ok(&["upgrade", s(&volume)]);
    check_says(
        &volume,
        "contexts: page 1 is zeroed: LBAs 128-255 have no protection information",
    );
    std::fs::write(volume.join("written"), b"").expect("empty the map");
    fails(
        &["check", s(&volume)],
        2,
        "written: the written map is missing or damaged",
    );
}

/// A unit (a packed row, a split context page) trimmed or zeroed whole,
/// then an older copy of the volume's files restored: the unit is caught
/// as older, never read as the data it held in the copy. The unit is
/// changed whole over NBD, by a trim, by WRITE_ZEROES (punched like a
/// trim) and by WRITE_ZEROES with NO_HOLE (a zero context in every slot);
/// the volume is closed (a checkpoint writes the map) and `check` is
/// clean. After the restore, `check` names the unit as older, `export`
/// fails, and a read of each of its LBAs over NBD fails while the unit
/// before it reads as written. (Before zero contexts carried their
/// commit's generation and a unit trimmed whole kept one, the zeroed unit
/// had no expectation and the trimmed unit's clear bit was not checked
/// against what it held: every case read the copy's old data.)
fn an_older_copy_of_a_unit_changed_whole_is_caught(layout: &str) {
    // Unit 1's LBAs, the files an older copy restores, and what `check`
    // says of it.
    let (unit, files, says): (std::ops::Range<u64>, &[&str], &str) = match layout {
        "packed" => (
            31..62,
            &["data.00000"],
            "data.00000: row 1 is older than the volume expects",
        ),
        _ => (
            128..256,
            &["data.00000", "contexts"],
            "contexts: page 1 is older than the volume expects",
        ),
    };
    let (first, count) = (unit.start, unit.end - unit.start);
    // Every case runs, and the failures are listed together.
    let mut failed = Vec::new();
    for (name, op) in [
        ("trim", "h.trim({count} * 4096, {first} * 4096)"),
        (
            "trim in two pieces",
            "h.trim(10 * 4096, {first} * 4096)\nh.trim(({count} - 10) * 4096, ({first} + 10) * 4096)",
        ),
        ("zero", "h.zero({count} * 4096, {first} * 4096)"),
        (
            "zero no-hole",
            "h.zero({count} * 4096, {first} * 4096, nbd.CMD_FLAG_NO_HOLE)",
        ),
    ] {
        let op = op
            .replace("{count}", &count.to_string())
            .replace("{first}", &first.to_string());
        let case = std::panic::catch_unwind(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let (raw, volume, older) = imported_with_copies(dir.path(), unit.end + 8, layout, files);
            let mut server = common::Server::start(dir.path(), &[s(&volume)]);
            common::py_json(
            &format!("h = connect(sys.argv[1])\n{op}\nh.flush()\nprint(json.dumps({{\"ok\": True}}))\n"),
            &[&server.uri],
        );
            server.stop();
            ok(&["check", s(&volume)]);
            for (file, bytes) in files.iter().zip(&older) {
                std::fs::write(volume.join(file), bytes).expect("restore the older copy");
            }
            let output = vouch(&["check", s(&volume)]);
            let stdout = String::from_utf8_lossy(&output.stdout);
            assert_eq!(
                output.status.code(),
                Some(1),
                "{layout} {name}: {}",
                text(&output)
            );
            assert!(
                stdout.lines().any(|line| line.starts_with(says)),
                "{layout} {name}: {stdout}"
            );
            let exported = dir.path().join("out.raw");
            let output = vouch(&["export", s(&volume), s(&exported)]);
            assert_ne!(
                output.status.code(),
                Some(0),
                "{layout} {name}: {}",
                text(&output)
            );
            let mut server = common::Server::start(dir.path(), &[s(&volume)]);
            let reads = common::py_json(
                r#"
h = connect(sys.argv[1])
raw = open(sys.argv[2], "rb").read()
out = {}
for lba in range(int(sys.argv[3]), int(sys.argv[4])):
    try:
        got = h.pread(4096, lba * 4096)
        out[lba] = "current" if got == raw[lba * 4096:(lba + 1) * 4096] else "other"
    except nbd.Error as e:
        out[lba] = "error"
print(json.dumps(out))
"#,
                &[
                    &server.uri,
                    s(&raw),
                    &(first - count.min(first)).to_string(),
                    &unit.end.to_string(),
                ],
            );
            server.stop();
            for lba in first - count.min(first)..unit.end {
                let want = if lba < first { "current" } else { "error" };
                assert_eq!(
                    reads[lba.to_string()],
                    want,
                    "{layout} {name}: LBA {lba}: {reads}"
                );
            }
        });
        if case.is_err() {
            failed.push(name);
        }
    }
    assert!(failed.is_empty(), "{layout}: failed: {failed:?}");
}

#[test]
fn an_older_copy_of_a_packed_row_trimmed_or_zeroed_whole_is_caught() {
    an_older_copy_of_a_unit_changed_whole_is_caught("packed");
}

#[test]
fn an_older_copy_of_a_split_page_trimmed_or_zeroed_whole_is_caught() {
    an_older_copy_of_a_unit_changed_whole_is_caught("split");
}

/// Run `body` (Python over the libnbd handle `h`) against the volume
/// served at `uri`, then flush.
fn nbd_then_flush(uri: &str, body: &str) {
    common::py_json(
        &format!(
            "h = connect(sys.argv[1])\n{body}\nh.flush()\nprint(json.dumps({{\"ok\": True}}))\n"
        ),
        &[uri],
    );
}

/// Read `ranges` (first LBA, count) of the volume served at `uri` and
/// name each 4 KiB block: "zeros", "error" (the read failed) or "data".
fn read_blocks(uri: &str, ranges: &[(u64, u64)]) -> serde_json::Value {
    let ranges = serde_json::to_string(ranges).expect("ranges");
    common::py_json(
        r#"
h = connect(sys.argv[1])
out = {}
for first, count in json.loads(sys.argv[2]):
    for lba in range(first, first + count):
        try:
            got = h.pread(4096, lba * 4096)
            out[lba] = "zeros" if got == bytes(4096) else "data"
        except nbd.Error as e:
            out[lba] = "error"
print(json.dumps(out))
"#,
        &[uri, &ranges],
    )
}

/// A packed row that trims leave vacant (every slot a vacant marker, its
/// bit clear) is trimmed space: after a reopen each LBA of it reads as
/// zeros, `check` is clean, and a later write into the row leaves its
/// other LBAs zeros. Two ways to leave one: one block written into an
/// otherwise empty row and then trimmed (row 1), and a discard in 1 MiB
/// pieces over written data (256 is not a multiple of 31, so the rows
/// that straddle a piece boundary are trimmed in two partial ranges, as
/// `blkdiscard` and `fstrim` do). (When a clear row's vacant markers
/// counted as generation 0 against the trim's, every such row read
/// `metadata_lost`, `check` failed, and the first write into the row
/// made its other slots lost markers.)
#[test]
fn a_packed_row_trims_leave_vacant_reads_as_zeros() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    ok(&["create", s(&volume), "--size", "4MiB", "--layout", "packed"]);
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    nbd_then_flush(
        &server.uri,
        r#"
h.pwrite(block_data(35, 35), 35 * 4096)
h.flush()
h.trim(4096, 35 * 4096)
h.flush()
for lba in range(256, 768):
    h.pwrite(block_data(lba, lba), lba * 4096)
h.flush()
for piece in range(1, 3):
    h.trim(1 << 20, piece << 20)
"#,
    );
    server.stop();
    // Every block of `ranges` but `except` reads as zeros.
    let zeros = |uri: &str, ranges: &[(u64, u64)], except: Option<u64>, when: &str| {
        let reads = read_blocks(uri, ranges);
        let wrong: Vec<String> = ranges
            .iter()
            .flat_map(|(first, count)| *first..first + count)
            .filter(|lba| Some(*lba) != except && reads[lba.to_string()] != "zeros")
            .map(|lba| format!("{lba}: {}", reads[lba.to_string()]))
            .collect();
        assert!(wrong.is_empty(), "{when}: not zeros: {wrong:?}");
        reads
    };
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    zeros(&server.uri, &[(31, 31), (256, 512)], None, "after a reopen");
    server.stop();
    ok(&["check", s(&volume)]);
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    nbd_then_flush(
        &server.uri,
        r#"
h.pwrite(block_data(40, 40), 40 * 4096)
h.pwrite(block_data(300, 300), 300 * 4096)
"#,
    );
    server.stop();
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    let reads = zeros(
        &server.uri,
        &[(31, 31)],
        Some(40),
        "row 1 after a write into it",
    );
    assert_eq!(reads["40"], "data", "{reads}");
    let reads = zeros(
        &server.uri,
        &[(279, 31)],
        Some(300),
        "row 9 after a write into it",
    );
    assert_eq!(reads["300"], "data", "{reads}");
    server.stop();
    ok(&["check", s(&volume)]);
}

/// An older copy of a packed row restored over the row trimmed whole
/// fails only the LBAs the copy held records for: its slots that hold
/// nothing (vacant markers of blocks never written in the copy) read as
/// zeros, before the first older record is read and after it alike, and
/// `check` names the same LBAs. (Before, a read of such a slot returned
/// zeros until a read of a record judged the row older, and failed after
/// it: the same LBA read differently by read order, and `check`, reading
/// the row whole, failed all 31.)
#[test]
fn an_older_copy_of_a_trimmed_packed_row_fails_only_its_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    ok(&["create", s(&volume), "--size", "1MiB", "--layout", "packed"]);
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    nbd_then_flush(
        &server.uri,
        r#"
for lba in range(31, 41):
    h.pwrite(block_data(lba, lba), lba * 4096)
"#,
    );
    server.stop();
    let data = volume.join("data.00000");
    let older = std::fs::read(&data).expect("the older copy");
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    nbd_then_flush(&server.uri, "h.trim(31 * 4096, 31 * 4096)");
    server.stop();
    std::fs::write(&data, &older).expect("restore the older copy");
    let output = vouch(&["check", s(&volume)]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(
        stdout.lines().any(|line| line
            .starts_with("data.00000: row 1 is older than the volume expects")
            && line.contains("LBAs 31-40 have")),
        "{stdout}"
    );
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    let first = read_blocks(&server.uri, &[(45, 1)]);
    let row = read_blocks(&server.uri, &[(31, 31)]);
    server.stop();
    assert_eq!(first["45"], "zeros", "{first}");
    row_1_reads(&row, "after the restore", |lba| {
        if lba < 41 {
            "error"
        } else {
            "zeros"
        }
    });
}

/// A packed row whose written-map bit is clear only because an older bits
/// copy was loaded (the newer copy damaged) still holds live records: a
/// trim into part of it must not give it the trim's generation as its
/// expected value, or after the next checkpoint every record left in it
/// is "older" than the value and fails `metadata_lost` (review finding 2
/// of zeros28: the value was set from the bit alone). Its records read
/// as written after the trim and a reopen, and `check` is clean.
#[test]
fn a_trim_into_a_row_clear_only_because_an_older_bits_copy_was_loaded_keeps_its_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Two map updates: row 0 first, then row 1 (LBAs 31-40), so the
    // older bits copy holds row 1 clear and the newer holds it set.
    let volume = packed_volume_served(
        dir.path(),
        &[
            "h.pwrite(block_data(0, 0), 0)",
            "for lba in range(31, 41):\n    h.pwrite(block_data(lba, lba), lba * 4096)",
        ],
    );
    // 9 units: each bits copy is a 4096-byte header and 4096 bytes of
    // bits (docs/FORMAT.md, "Written map"); `seq` at byte 32 of a header.
    let map = volume.join("written");
    let mut bytes = std::fs::read(&map).expect("read the map");
    let seq = |bytes: &[u8], copy: usize| {
        let at = copy * 8192 + 32;
        u64::from_le_bytes(bytes[at..at + 8].try_into().expect("seq"))
    };
    let newer = if seq(&bytes, 1) > seq(&bytes, 0) {
        1
    } else {
        0
    };
    assert_eq!(
        seq(&bytes, newer),
        seq(&bytes, 1 - newer) + 1,
        "two bits copies, one update apart"
    );
    // The premise: row 1's bit (bit 1 of the first bits byte) is clear in
    // the older copy and set in the newer, so loading the older one is
    // what leaves the row clear.
    let row_1_bit = |copy: usize| bytes[copy * 8192 + 4096] & 0b10 != 0;
    assert!(
        !row_1_bit(1 - newer) && row_1_bit(newer),
        "row 1 clear in the older bits copy, set in the newer"
    );
    bytes[newer * 8192] ^= 0xff; // its magic: the older copy is loaded
    std::fs::write(&map, &bytes).expect("damage the newer bits copy");
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    nbd_then_flush(&server.uri, "h.trim(4096, 31 * 4096)");
    server.stop();
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    let row = read_blocks(&server.uri, &[(31, 31)]);
    server.stop();
    row_1_reads(&row, "after the trim and a reopen", |lba| {
        if (32..41).contains(&lba) {
            "data"
        } else {
            "zeros"
        }
    });
    ok(&["check", s(&volume)]);
}

/// `check`'s cause for a packed row is the verdict the reads reach, which
/// judge a row with its records' data: the context of the row's newest
/// record (LBA 45, rewritten alone) blanked over its data is damage that
/// may have hidden the newest generation, so the row is not judged older
/// and only LBA 45 fails. The cause names that blank slot. (Judged from
/// the contexts alone, the blank slot was skipped and the cause read "row
/// 1 is older than the volume expects ...: LBAs 31-61", for a row whose
/// other 30 blocks read and check as written.)
#[test]
fn a_packed_rows_cause_is_judged_with_its_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = packed_volume_served(
        dir.path(),
        &[
            "for lba in range(31, 62):\n    h.pwrite(block_data(lba, lba), lba * 4096)",
            "h.pwrite(block_data(45, 1045), 45 * 4096)",
        ],
    );
    // Row 1 at 128 KiB; record 14 (LBA 45) is its 4096 bytes of data,
    // then its 32-byte context.
    let handle = std::fs::OpenOptions::new()
        .write(true)
        .open(volume.join("data.00000"))
        .expect("open");
    handle
        .write_all_at(&[0u8; 32], 131072 + 14 * 4128 + 4096)
        .expect("blank LBA 45's context");
    let line = "data.00000: row 1 has 1 blank slot (cut or zeroed in part): LBA 45 has no protection information";
    check_says(&volume, line);
    let output = vouch(&["check", s(&volume)]);
    assert!(
        !text(&output).contains("older than the volume expects"),
        "{}",
        text(&output)
    );
    let mut server = common::Server::start(dir.path(), &[s(&volume)]);
    let row = read_blocks(&server.uri, &[(31, 31)]);
    server.stop();
    row_1_reads(&row, "with LBA 45's context blank", |lba| {
        if lba == 45 {
            "error"
        } else {
            "data"
        }
    });
}

/// Assert that each LBA of packed row 1 (31-61) in `reads` (as
/// `read_blocks` names them) reads as `expect` says.
fn row_1_reads(reads: &serde_json::Value, when: &str, expect: impl Fn(u64) -> &'static str) {
    let wrong: Vec<String> = (31..62)
        .filter(|lba| reads[lba.to_string()] != expect(*lba))
        .map(|lba| format!("{lba}: {}", reads[lba.to_string()]))
        .collect();
    assert!(wrong.is_empty(), "row 1 {when}: {wrong:?}");
}

/// A new 1 MiB packed volume `vol` in `dir`, served once per NBD script
/// of `bodies` (each run ends with a flush and a clean stop: a checkpoint).
fn packed_volume_served(dir: &Path, bodies: &[&str]) -> PathBuf {
    let volume = dir.join("vol");
    ok(&["create", s(&volume), "--size", "1MiB", "--layout", "packed"]);
    for body in bodies {
        let mut server = common::Server::start(dir, &[s(&volume)]);
        nbd_then_flush(&server.uri, body);
        server.stop();
    }
    volume
}

/// Issue 28: an older copy of the data, the contexts and `written`
/// restored together (the superblock and journal current). The data and
/// contexts agree with each other and with the older map's bits; only the
/// expected generations would tell them older, and the older `written`
/// holds another generations copy than the one the superblock names
/// (`generations_seq`). Before the fix no unit's value was known and the
/// older blocks read as current: `check` clean, `export` of the older
/// data, NBD reads of it. Now the open refuses naming `written` and the
/// cause, so `check` and `export` fail and `serve` does not start (no NBD
/// read can return the older data); `vouch upgrade`, the refusal's
/// second remedy, accepts the files as they are.
fn an_older_written_restored_with_the_data_and_contexts_is_refused(layout: &str) {
    let files: &[&str] = match layout {
        "packed" => &["data.00000", "written"],
        _ => &["data.00000", "contexts", "written"],
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (raw, volume, older) = imported_with_copies(dir.path(), 512, layout, files);
    // Two rounds of writes, each closed by a checkpoint: the expected
    // generations move at each, so the copy the superblock names is one
    // the older `written` does not hold.
    for round in 0..2u8 {
        let mut server = common::Server::start(dir.path(), &[s(&volume)]);
        common::py_json(
            "h = connect(sys.argv[1])\nfor lba in range(0, 512, 3):\n    h.pwrite(bytes([int(sys.argv[2])]) * 4096, lba * 4096)\nh.flush()\nprint(json.dumps({\"ok\": True}))\n",
            &[&server.uri, &(0xA0 + round).to_string()],
        );
        server.stop();
    }
    ok(&["check", s(&volume)]);
    for (file, bytes) in files.iter().zip(&older) {
        std::fs::write(volume.join(file), bytes).expect("restore the older copy");
    }
    let output = vouch(&["check", s(&volume)]);
    let said = text(&output);
    assert_ne!(output.status.code(), Some(0), "{layout}: {said}");
    assert!(
        said.contains("written:") && said.contains("an older copy of the file"),
        "{layout}: check must name the file and the cause: {said}"
    );
    assert!(
        said.contains("vouch upgrade"),
        "{layout}: what to do: {said}"
    );
    let exported = dir.path().join("out.raw");
    let output = vouch(&["export", s(&volume), s(&exported)]);
    assert_ne!(output.status.code(), Some(0), "{layout}: {}", text(&output));
    assert!(
        text(&output).contains("written:"),
        "{layout}: {}",
        text(&output)
    );
    let refused = common::Server::try_start(dir.path(), &[s(&volume)])
        .err()
        .unwrap_or_else(|| panic!("{layout}: serve started on the older files"));
    assert!(refused.contains("written:"), "{layout}: {refused}");
    // Accepting the files as they are: the older data is now the volume's.
    ok(&["upgrade", s(&volume)]);
    assert_checks_clean_and_exports(&volume, &exported, &raw, layout);
}

#[test]
fn an_older_written_restored_with_the_data_and_contexts_is_refused_split() {
    an_older_written_restored_with_the_data_and_contexts_is_refused("split");
}

#[test]
fn an_older_written_restored_with_the_data_and_contexts_is_refused_packed() {
    an_older_written_restored_with_the_data_and_contexts_is_refused("packed");
}
