//! The compatibility corpus (issue 33): volumes the da97320 binary wrote,
//! checked in under tests/corpus/ and never regenerated (its README says
//! what each is). Every one, unpacked into a temporary directory, must
//! still be shown by `vouch info`, found clean by `vouch check`, export
//! the image its README records (sha256), serve the same bytes to nbdcopy
//! and qemu-img, and take a write that survives a flush and a reopen. A
//! flipped bit in a corpus copy must be caught, so these checks can fail.
//!
//! Each also migrates to the other layout and back (`vouch migrate`),
//! exporting the same image and checking clean at each step; is found
//! clean by `vouch verify`; and takes a snapshot (checked clean, exporting
//! the recorded image) whose clone takes a write that leaves the snapshot
//! as it was, and another snapshot once migrated to the other layout (a
//! volume with regions), which still exports the same image after the
//! volume is migrated home. A mirror leg's snapshot is refused, saying so.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::clients::qemu_img_compare_ok;
use common::*;

/// One corpus volume: its archive's name (and top directory), the sha256
/// of its exported image (README.md's table), and what it needs.
struct Corpus {
    name: &'static str,
    sha256: &'static str,
    encrypted: bool,
    mirror: bool,
    /// Left by `kill -9` with its journal not checkpointed.
    unclean: bool,
}

const fn plain(name: &'static str, sha256: &'static str) -> Corpus {
    Corpus {
        name,
        sha256,
        encrypted: false,
        mirror: false,
        unclean: false,
    }
}

const CORPUS: &[Corpus] = &[
    plain(
        "split-crc32c",
        "0c6b5201883ca2a9ba815338f4c449a3f4c0f5f70d08c34f842e4e921b957a9c",
    ),
    plain(
        "split-crc64nvme",
        "ae900620a33c1921fafb304583d08a5d0e2fe91717ab920a6bc8ebd992750e0d",
    ),
    plain(
        "split-crc16t10dif",
        "d792682c4e777c60d566fae60d08cc1b09aa671c2b072da3f774b572f929114a",
    ),
    plain(
        "split-xxh3",
        "16168e9b1ee7d7a9c93a343aba7048af04df8ca1688dd351365be9e8e754e8b8",
    ),
    plain(
        "split-none",
        "3ce2449be2fb09af50b14ef4176964706283d4c57cf6718e4ff630866e9858a8",
    ),
    plain(
        "packed-crc32c",
        "492562ce36052fd11463f3e16acaaff567e63c7757fcda165c650739e0ad8f0e",
    ),
    plain(
        "packed-crc64nvme",
        "dfbf3b47e978eb63e74893493fbf396025b0d5d9710893342ea09aa72dd00eee",
    ),
    plain(
        "packed-crc16t10dif",
        "b8a0d1755a42e628f4ad29625ebc9437e5ba1b233616755c6ef0ac15a9db45c0",
    ),
    plain(
        "packed-xxh3",
        "63d935321b8649509a77c8109691c3592a594c0f550c719f0ef0cfe6a69e6796",
    ),
    plain(
        "packed-none",
        "4ea43581b0c5d537743dc4e09aab64b496762afdc68399eddc11daf8f8898681",
    ),
    Corpus {
        encrypted: true,
        ..plain(
            "split-encrypted",
            "c3479ce27f3f364b1119512e00f9a57e86dd23e2ec213ef60576dc8107cff070",
        )
    },
    Corpus {
        encrypted: true,
        ..plain(
            "packed-encrypted",
            "c70629093a9069fbce63f8d32392595e176b4a58b89ede0e070da53815fe3e05",
        )
    },
    plain(
        "split-trim-zero",
        "90dd9b0cd406a89419d24267256d6c659c7d806eeb89c584a9e944ad89bad158",
    ),
    plain(
        "packed-trim-zero",
        "eae595dafb5ae2972257789ea75a3b62c957164b618caf0ff76d689770b1aef9",
    ),
    Corpus {
        unclean: true,
        ..plain(
            "split-unclean",
            "591d096cd84ae4e767c8827bb4571d0df46bfdb354cdb1ce96b864b52d53469d",
        )
    },
    Corpus {
        unclean: true,
        ..plain(
            "packed-unclean",
            "912f751cbc6504ccdc65992576c079b730f3bcd2dc1b872e03f514d3848df5ee",
        )
    },
    Corpus {
        mirror: true,
        ..plain(
            "mirror-split",
            "ea061585b2e9a65542711a2fcb13469e445d39884578bef3ae6f242c8a774260",
        )
    },
];

/// The block a reopened corpus volume is written at: never written in any
/// corpus volume (between the written ranges).
const NEW_LBA: u64 = 800;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/corpus")
}

fn corpus(name: &str) -> &'static Corpus {
    CORPUS
        .iter()
        .find(|volume| volume.name == name)
        .unwrap_or_else(|| panic!("{name} is not in CORPUS"))
}

/// Unpack `volume`'s archive into `dir` and return the path a command is
/// given (a mirror's leg 0, its records rewritten to where its legs now
/// are: a record names legs by absolute path and no command moves a
/// mirror).
fn unpack(dir: &Path, volume: &Corpus) -> PathBuf {
    let archive = corpus_dir().join(format!("{}.tar.gz", volume.name));
    run_ok(Command::new(tool("tar", "tar")).args(["-xzf", s(&archive), "-C", s(dir)]));
    let top = dir.join(volume.name);
    if !volume.mirror {
        return top;
    }
    let legs = [top.join("leg0"), top.join("leg1")];
    for leg in &legs {
        let mut record = vouch_mirror::set::read_record(leg).expect("read mirror record");
        assert_eq!(record.members.len(), legs.len(), "{record:?}");
        for (member, path) in record.members.iter_mut().zip(&legs) {
            assert!(
                member.path.starts_with("/tmp/vouch-corpus/"),
                "the corpus mirror names {}",
                member.path
            );
            member.path = s(path).to_string();
        }
        vouch_mirror::set::write_record(leg, &record).expect("write mirror record");
    }
    legs[0].clone()
}

/// `--key-file test-only.key` for an encrypted volume, else nothing.
fn key_args(volume: &Corpus) -> Vec<String> {
    if volume.encrypted {
        let key = corpus_dir().join("test-only.key");
        vec!["--key-file".to_string(), s(&key).to_string()]
    } else {
        Vec::new()
    }
}

fn vouch_with(args: &[&str], extra: &[String]) -> std::process::Output {
    run(Command::new(vouch_bin()).args(args).args(extra))
}

/// `vouch export` of `path` into `raw`; it must succeed.
fn export(path: &Path, raw: &Path, volume: &Corpus) {
    let output = vouch_with(&["export", s(path), s(raw)], &key_args(volume));
    assert!(
        output.status.success(),
        "export {}: {}",
        volume.name,
        text(&output)
    );
}

/// Everything a corpus volume must still do.
fn exercise(name: &str) {
    let volume = corpus(name);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = unpack(dir.path(), volume);
    let keys = key_args(volume);

    // info: shown, writable by this binary, clean or not as it was left.
    let info = vouch_with(&["info", s(&path)], &[]);
    assert!(info.status.success(), "info {name}: {}", text(&info));
    let json = info_json(&path);
    assert_eq!(json["size_bytes"], 4 * MIB, "{json}");
    assert_eq!(json["read_only"], false, "{json}");
    assert_eq!(json["encrypted"], volume.encrypted, "{json}");
    assert_eq!(json["clean"], !volume.unclean, "{json}");

    // check: clean (an unclean volume's journal replayed in memory).
    let check = vouch_with(&["check", s(&path)], &keys);
    assert!(check.status.success(), "check {name}: {}", text(&check));
    if volume.mirror {
        // Both legs, where they were unpacked: not the generator's paths.
        let out = String::from_utf8_lossy(&check.stdout);
        assert!(
            out.contains(s(&dir.path().join(name).join("leg1"))),
            "{out}"
        );
        assert!(!out.contains("/tmp/vouch-corpus"), "{out}");
    }

    // verify: clean, every block.
    let verify = vouch_with(&["verify", s(&path), "--json"], &keys);
    assert!(verify.status.success(), "verify {name}: {}", text(&verify));
    let report: serde_json::Value = serde_json::from_slice(&verify.stdout).expect("verify --json");
    assert_eq!(report["faults"], serde_json::json!([]), "{name}: {report}");
    assert_eq!(report["blocks"], 4 * MIB / BLOCK, "{name}: {report}");

    // export: the recorded image.
    let image = dir.path().join("export.raw");
    export(&path, &image, volume);
    assert_eq!(sha256(&image), volume.sha256, "{name}: exported image");

    // serve: nbdcopy and qemu-img see the same bytes; then a write + flush.
    let mut args = vec![s(&path).to_string()];
    args.extend(keys.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut server = Server::start(dir.path(), &args);
    let copied = dir.path().join("nbdcopy.raw");
    run_ok(Command::new(tool("nbdcopy", "libnbd-bin")).args([&server.uri, s(&copied)]));
    assert_eq!(
        sha256(&copied),
        volume.sha256,
        "{name}: nbdcopy of the export"
    );
    qemu_img_compare_ok(s(&image), &server.uri);
    py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(bytes([0xa5]) * 4096, int(sys.argv[2]) * 4096)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri, &NEW_LBA.to_string()],
    );
    server.stop();

    // Reopened: the write is there, everything else as recorded, clean.
    let mut expected = std::fs::read(&image).expect("read export");
    let at = (NEW_LBA * BLOCK) as usize;
    expected[at..at + BLOCK as usize].fill(0xa5);
    let after = dir.path().join("after.raw");
    export(&path, &after, volume);
    assert!(
        std::fs::read(&after).expect("read export") == expected,
        "{name}: after a write of LBA {NEW_LBA} and a reopen the image is not the recorded one with that block"
    );
    let check = vouch_with(&["check", s(&path)], &keys);
    assert!(
        check.status.success(),
        "check {name} after a write: {}",
        text(&check)
    );
    assert_eq!(info_json(&path)["clean"], true, "{name}: closed by serve");
    snapshot_and_clone(name, &path, dir.path(), volume, &expected);
    migrate_and_back(name, &path, dir.path(), volume, &expected);
}

/// `vouch snapshot create PATH NAME --copy` (this machine's filesystem may
/// not share blocks); it must succeed.
fn snapshot_ok(path: &Path, snapshot: &str, volume: &Corpus) -> PathBuf {
    let output = vouch_with(&["snapshot", "create", s(path), snapshot, "--copy"], &[]);
    assert!(
        output.status.success(),
        "snapshot {snapshot} of {}: {}",
        volume.name,
        text(&output)
    );
    path.join("snapshots").join(snapshot)
}

/// The snapshot at `snap` checks clean and exports `expected`.
fn snapshot_holds(snap: &Path, dir: &Path, volume: &Corpus, expected: &[u8]) {
    let name = volume.name;
    let keys = key_args(volume);
    let check = vouch_with(&["check", s(snap)], &keys);
    assert!(
        check.status.success(),
        "check {}: {}",
        snap.display(),
        text(&check)
    );
    let image = dir.join("snapshot.raw");
    let _ = std::fs::remove_file(&image);
    export(snap, &image, volume);
    assert!(
        std::fs::read(&image).expect("read export") == expected,
        "{name}: snapshot {} does not export the image it was taken of",
        snap.display()
    );
}

/// A snapshot of the volume (`expected` its image): checked clean, its
/// export `expected`; a clone of it takes a write through NBD, and the
/// snapshot is unchanged. A mirror's is a copy in every leg, each
/// checked clean and exporting `expected`, then deleted from every leg.
fn snapshot_and_clone(name: &str, path: &Path, dir: &Path, volume: &Corpus, expected: &[u8]) {
    if volume.mirror {
        let output = vouch_with(&["snapshot", "create", s(path), "s1", "--copy"], &[]);
        assert!(output.status.success(), "{name}: {}", text(&output));
        let legs: Vec<PathBuf> = ["leg0", "leg1"]
            .iter()
            .map(|leg| path.parent().expect("legs' directory").join(leg))
            .collect();
        for leg in &legs {
            let copy = leg.join("snapshots").join("s1");
            assert!(copy.exists(), "{name}: no copy in {}", leg.display());
            snapshot_holds(&copy, dir, volume, expected);
        }
        let output = vouch_with(&["snapshot", "delete", s(path), "s1"], &[]);
        assert!(output.status.success(), "{name}: {}", text(&output));
        for leg in &legs {
            assert!(!leg.join("snapshots").join("s1").exists(), "{name}");
        }
        return;
    }
    let keys = key_args(volume);
    let snap = snapshot_ok(path, "s1", volume);
    snapshot_holds(&snap, dir, volume, expected);
    let clone = dir.join("clone");
    let output = vouch_with(&["clone", s(&snap), s(&clone), "--copy"], &[]);
    assert!(output.status.success(), "clone {name}: {}", text(&output));
    let mut args = vec![s(&clone).to_string()];
    args.extend(keys.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut server = Server::start(dir, &args);
    py_json(
        r#"
h = connect(sys.argv[1])
h.pwrite(bytes([0x3c]) * 4096, 0)
h.flush()
print(json.dumps({"ok": True}))
"#,
        &[&server.uri],
    );
    server.stop();
    let mut written = expected.to_vec();
    written[..BLOCK as usize].fill(0x3c);
    let image = dir.join("clone.raw");
    export(&clone, &image, volume);
    assert!(
        std::fs::read(&image).expect("read export") == written,
        "{name}: the clone does not hold its write"
    );
    snapshot_holds(&snap, dir, volume, expected);
}

/// `vouch migrate` to the other layout and back: each step exports
/// `expected` and checks clean. A mirror is migrated whole (every leg
/// rebuilt in the other layout, no regions), so it has no snapshot step.
fn migrate_and_back(name: &str, path: &Path, dir: &Path, volume: &Corpus, expected: &[u8]) {
    let keys = key_args(volume);
    let home = if name.starts_with("packed") {
        "packed"
    } else {
        "split"
    };
    let other = if home == "split" { "packed" } else { "split" };
    for layout in [other, home] {
        if layout == home && !volume.mirror {
            // Every region in the other layout: a volume with regions, of
            // which a snapshot keeps that layout.
            let snap = snapshot_ok(path, "migrated", volume);
            snapshot_holds(&snap, dir, volume, expected);
            let record = std::fs::read_to_string(snap.join("snapshot")).expect("record");
            assert!(snap.join("regions").exists(), "{name}: {record}");
            assert!(
                snap.join(format!("layout.{other}"))
                    .join("superblock")
                    .exists(),
                "{name}"
            );
        }
        let output = vouch_with(&["migrate", s(path), "--layout", layout], &keys);
        assert!(
            output.status.success(),
            "migrate {name} to {layout}: {}",
            text(&output)
        );
        let image = dir.join(format!("migrated-{layout}.raw"));
        export(path, &image, volume);
        assert!(
            std::fs::read(&image).expect("read export") == expected,
            "{name}: the image after migrating to {layout} differs"
        );
        let check = vouch_with(&["check", s(path)], &keys);
        assert!(
            check.status.success(),
            "check {name} after migrating to {layout}: {}",
            text(&check)
        );
    }
    if volume.mirror {
        return;
    }
    // Home again, one layout: the snapshot taken with regions is as it was.
    snapshot_holds(&path.join("snapshots/migrated"), dir, volume, expected);
}

macro_rules! corpus_tests {
    ($($test:ident => $name:literal,)*) => {
        $(
            #[test]
            fn $test() {
                exercise($name);
            }
        )*

        /// Every archive in tests/corpus has a test, and every test an archive.
        #[test]
        fn every_archive_is_exercised() {
            let tested = [$($name),*];
            let mut archives: Vec<String> = std::fs::read_dir(corpus_dir())
                .expect("read tests/corpus")
                .filter_map(|entry| {
                    let name = entry.expect("entry").file_name().into_string().expect("utf-8");
                    name.strip_suffix(".tar.gz").map(str::to_string)
                })
                .collect();
            archives.sort();
            let mut tested: Vec<String> = tested.iter().map(|name| name.to_string()).collect();
            tested.sort();
            assert_eq!(archives, tested);
            let mut listed: Vec<&str> = CORPUS.iter().map(|volume| volume.name).collect();
            listed.sort_unstable();
            assert_eq!(listed, tested);
        }
    };
}

corpus_tests! {
    split_crc32c => "split-crc32c",
    split_crc64nvme => "split-crc64nvme",
    split_crc16t10dif => "split-crc16t10dif",
    split_xxh3 => "split-xxh3",
    split_none => "split-none",
    packed_crc32c => "packed-crc32c",
    packed_crc64nvme => "packed-crc64nvme",
    packed_crc16t10dif => "packed-crc16t10dif",
    packed_xxh3 => "packed-xxh3",
    packed_none => "packed-none",
    split_encrypted => "split-encrypted",
    packed_encrypted => "packed-encrypted",
    split_trim_zero => "split-trim-zero",
    packed_trim_zero => "packed-trim-zero",
    split_unclean => "split-unclean",
    packed_unclean => "packed-unclean",
    mirror_split => "mirror-split",
}

/// README.md's table records the same sha256 as CORPUS, once per volume.
#[test]
fn readme_records_each_image() {
    let readme = std::fs::read_to_string(corpus_dir().join("README.md")).expect("README");
    for volume in CORPUS {
        let row = readme
            .lines()
            .find(|line| line.starts_with(&format!("| {} |", volume.name)))
            .unwrap_or_else(|| panic!("README.md has no row for {}", volume.name));
        assert!(
            row.contains(volume.sha256),
            "README.md row of {}: {row}",
            volume.name
        );
    }
}

/// A flipped bit in a corpus copy's data is caught: `check` names the LBA,
/// `export` refuses naming it, and the served block is an error, not data.
#[test]
fn corruption_of_a_corpus_copy_is_caught() {
    let volume = corpus("split-crc32c");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = unpack(dir.path(), volume);
    const LBA: u64 = 3;
    flip_bit(&path.join("data.00000"), LBA * BLOCK + 100, 0x10);

    let (code, faults) = check_faults(&path);
    assert_eq!(code, 1, "check must fail: {faults:?}");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0].0, LBA, "{faults:?}");

    let image = dir.path().join("export.raw");
    let output = vouch(&["export", s(&path), s(&image)]);
    assert!(
        !output.status.success(),
        "export of a corrupt copy: {}",
        text(&output)
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(&LBA.to_string()),
        "export names the LBA: {}",
        text(&output)
    );

    let server = Server::start(dir.path(), &[s(&path)]);
    let read = py_json(
        r#"
h = connect(sys.argv[1])
try:
    h.pread(4096, int(sys.argv[2]) * 4096)
    print(json.dumps({"read": "data"}))
except nbd.Error as e:
    print(json.dumps({"read": "error", "errno": e.errno}))
"#,
        &[&server.uri, &LBA.to_string()],
    );
    assert_eq!(read["read"], "error", "{read}");
    drop(server);
}
