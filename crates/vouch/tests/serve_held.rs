//! The held log's own failures, through the binary (issue 29): a slot the
//! volume's `held` file names that was emptied, zeroed, or cut inside a
//! record or at a record's end, and a landing file (where landed records'
//! payloads are) deleted or zeroed after a crash, are never read as
//! "nothing held" (the acknowledged writes in them would silently come
//! back as what was there before); and a runtime directory with no room
//! left refuses writes with ENOSPC and loses nothing it acknowledged.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// `vouch serve VOLUME [--create 64MiB]` with its held log in `runtime`.
fn serve(dir: &Path, volume: &Path, runtime: &Path, create: bool) -> Result<Server, String> {
    let mut args = vec![volume.display().to_string()];
    if create {
        args.extend(["--create".into(), "64MiB".into()]);
    }
    args.extend([
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--log".into(),
        "info".into(),
        // Unflushed writes stay in the held log until the kill (without
        // it, commits follow the writes and may have taken them): what
        // these tests crash and damage is the held log.
        "--commit-at-limit".into(),
    ]);
    let mut command = Command::new(vouch_bin());
    command
        .env("VOUCH_RUNTIME_DIR", runtime)
        .arg("serve")
        .args(&args);
    let expect = Expect {
        tcp: true,
        ..Expect::default()
    };
    Server::launch(dir, command, args, expect)
}

/// Write `count` MiB, MiB `i` filled with byte `base + i`, each answered,
/// none flushed; stop at the first error. Prints the MiB written and the
/// error's errno name, if any, as JSON.
const WRITE_MIBS: &str = r#"
uri, count, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = connect(uri)
written, error = 0, None
for i in range(count):
    try:
        h.pwrite(bytes([(base + i) % 256]) * (1 << 20), i << 20)
    except nbd.Error as e:
        error = errno.errorcode.get(e.errno, str(e.errno))
        break
    written += 1
# No flush, no clean disconnect: the server is killed after this.
print(json.dumps({"written": written, "error": error}))
"#;

/// How many of the first `count` MiB read back as written (`base + i`),
/// and how many read as zeros.
const READ_MIBS: &str = r#"
uri, count, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = connect(uri)
same = zeros = 0
for i in range(count):
    data = h.pread(1 << 20, i << 20)
    if data == bytes([(base + i) % 256]) * (1 << 20):
        same += 1
    elif data == bytes(1 << 20):
        zeros += 1
print(json.dumps({"same": same, "zeros": zeros}))
"#;

fn write_mibs(uri: &str, count: u64, base: u8) -> serde_json::Value {
    py_json(WRITE_MIBS, &[uri, &count.to_string(), &base.to_string()])
}

fn read_mibs(uri: &str, count: u64, base: u8) -> (u64, u64) {
    let result = py_json(READ_MIBS, &[uri, &count.to_string(), &base.to_string()]);
    (
        result["same"].as_u64().expect("same"),
        result["zeros"].as_u64().expect("zeros"),
    )
}

/// The slot files the volume's `held` file names.
fn held_slots(volume: &Path) -> [PathBuf; 2] {
    let pointer = std::fs::read_to_string(volume.join("held")).expect("the volume's held file");
    let (_boot, prefix) = pointer
        .trim_end()
        .split_once(' ')
        .expect("held is `BOOT_ID PREFIX`");
    [0, 1].map(|slot| PathBuf::from(format!("{prefix}.held{slot}")))
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    /// Cut to nothing (`: > slot`).
    Emptied,
    /// Its header page zeroed.
    HeaderZeroed,
    /// Cut inside its first record (the record's header kept).
    CutInRecord,
    /// Cut exactly where its first record ends: every record is whole,
    /// the ones after it are gone.
    CutAfterRecord,
    /// The landing file (where the payloads of landed records are) deleted.
    LandingRemoved,
    /// The landing file zeroed: landed records name blocks that are not
    /// what was written.
    LandingZeroed,
}

/// The landing file beside the slots (`PREFIX.landing`).
fn landing_file(volume: &Path) -> PathBuf {
    let [slot, _] = held_slots(volume);
    slot.with_extension("landing")
}

/// Records in the slots whose blocks are in the landing file (flags 2).
fn landed_records(volume: &Path) -> usize {
    let mut landed = 0;
    for slot in held_slots(volume) {
        let bytes = std::fs::read(&slot).expect("read slot");
        let mut at = 4096;
        while at + 64 <= bytes.len() && &bytes[at..at + 8] == b"VOUCHHRC" {
            let word =
                |from: usize| u32::from_le_bytes(bytes[from..from + 4].try_into().expect("4"));
            let (count, flags) = (word(at + 16) as usize, word(at + 20));
            landed += usize::from(flags & 2 != 0);
            at += 64 + count * 40 + if flags & 2 != 0 { 0 } else { count * 4096 };
        }
    }
    landed
}

fn damage(volume: &Path, how: Damage) {
    match how {
        Damage::LandingRemoved => {
            std::fs::remove_file(landing_file(volume)).expect("remove the landing file");
            return;
        }
        Damage::LandingZeroed => {
            let path = landing_file(volume);
            let len = std::fs::metadata(&path).expect("landing file").len();
            std::fs::write(&path, vec![0u8; len as usize]).expect("zero the landing file");
            return;
        }
        _ => {}
    }
    for slot in held_slots(volume) {
        damage_slot(&slot, how);
    }
}

fn damage_slot(path: &Path, how: Damage) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open slot");
    match how {
        Damage::Emptied => file.set_len(0).expect("truncate slot"),
        Damage::CutInRecord => file.set_len(4096 + 100_000).expect("truncate slot"),
        Damage::CutAfterRecord => {
            use std::os::unix::fs::FileExt as _;
            // The record header's `count` and `flags` (FORMAT.md "Held
            // log record header"): 64 bytes, then 40 per block, and 4096
            // per block unless the record is landed (flags 2: its blocks
            // are in the landing file).
            let mut head = [0u8; 8];
            file.read_at(&mut head, 4096 + 16).expect("read count");
            let count = u64::from(u32::from_le_bytes(head[..4].try_into().expect("4")));
            let landed = u32::from_le_bytes(head[4..].try_into().expect("4")) & 2 != 0;
            let block = if landed { 0 } else { 4096 };
            file.set_len(4096 + 64 + count * (40 + block))
                .expect("truncate slot");
        }
        Damage::HeaderZeroed => {
            use std::os::unix::fs::FileExt as _;
            file.write_all_at(&[0u8; 4096], 0).expect("zero header");
        }
        Damage::LandingRemoved | Damage::LandingZeroed => unreachable!("not a slot's damage"),
    }
}

/// Acknowledged, unflushed writes; `kill -9`; then each slot damaged:
/// `check` and `serve` refuse, naming the held log and what to do;
/// removing `held` (the operator accepting the loss) opens the volume,
/// the held writes gone and everything else intact. Undamaged, the same
/// writes come back (the control: they were only in the held log).
#[test]
fn a_damaged_held_slot_refuses_the_open_and_says_what_to_do() {
    const MIBS: u64 = 6;
    for how in [
        None,
        Some(Damage::Emptied),
        Some(Damage::HeaderZeroed),
        Some(Damage::CutInRecord),
        Some(Damage::CutAfterRecord),
        Some(Damage::LandingRemoved),
        Some(Damage::LandingZeroed),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let runtime = dir.path().join("runtime");
        std::fs::create_dir(&runtime).expect("runtime dir");
        let volume = dir.path().join("vol");
        let mut server = serve(dir.path(), &volume, &runtime, true).expect("serve");
        let uri = server.export_uri("vol");
        let wrote = write_mibs(&uri, MIBS, 0x40);
        assert_eq!(wrote["written"], MIBS, "{wrote}");
        server.kill9();
        // 1 MiB payloads are received into the landing file and the slots
        // name them there: the landing damages below hit acknowledged writes.
        assert!(landed_records(&volume) > 0, "no landed record in the slots");

        let Some(how) = how else {
            let server = serve(dir.path(), &volume, &runtime, false).expect("restart");
            assert_eq!(
                read_mibs(&server.export_uri("vol"), MIBS, 0x40),
                (MIBS, 0),
                "undamaged, every acknowledged MiB reads back"
            );
            continue;
        };
        damage(&volume, how);
        let check = vouch(&["check", s(&volume)]);
        let said = text(&check);
        assert!(!check.status.success(), "{how:?}: check passed:\n{said}");
        assert!(
            said.contains("held log") && said.contains("remove the `held` file"),
            "{how:?}: check does not name the held log and what to do:\n{said}"
        );
        let refused = serve(dir.path(), &volume, &runtime, false)
            .err()
            .unwrap_or_else(|| panic!("{how:?}: serve opened a volume whose held log is damaged"));
        assert!(
            refused.contains("held log") && refused.contains("remove the `held` file"),
            "{how:?}: serve's refusal does not say what to do:\n{refused}"
        );

        std::fs::remove_file(volume.join("held")).expect("remove held");
        assert_check_clean(&volume);
        let server = serve(dir.path(), &volume, &runtime, false).expect("serve without held");
        assert_eq!(
            read_mibs(&server.export_uri("vol"), MIBS, 0x40),
            (0, MIBS),
            "{how:?}: without the held log the unflushed writes read as before"
        );
    }
}

/// A runtime directory (tmpfs) too small for the held log: the writes it
/// cannot take are refused with ENOSPC, and every write acknowledged
/// before survives a `kill -9` and reads back.
#[test]
fn a_full_runtime_directory_is_enospc_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = dir.path().join("runtime");
    std::fs::create_dir(&runtime).expect("runtime dir");
    let mount = run(Command::new("mount").args([
        "-t",
        "tmpfs",
        "-o",
        "size=6m,mode=0700",
        "vouch-test-held",
        s(&runtime),
    ]));
    assert!(
        mount.status.success(),
        "mounting a small tmpfs (needs root):\n{}",
        text(&mount)
    );
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(runtime.clone());

    let volume = dir.path().join("vol");
    let mut server = serve(dir.path(), &volume, &runtime, true).expect("serve");
    let uri = server.export_uri("vol");
    let wrote = write_mibs(&uri, 16, 0x10);
    let written = wrote["written"].as_u64().expect("written");
    assert_eq!(
        wrote["error"], "ENOSPC",
        "a write the held log has no room for is ENOSPC: {wrote}"
    );
    assert!(written >= 1, "nothing fit in 6 MiB: {wrote}");
    assert!(
        server.log_text().contains("held log"),
        "the server's log names the held log:\n{}",
        server.log_text()
    );
    server.kill9();

    let server = serve(dir.path(), &volume, &runtime, false).expect("restart");
    let (same, _) = read_mibs(&server.export_uri("vol"), written, 0x10);
    assert_eq!(same, written, "acknowledged MiB lost after the crash");
    drop(server);
    assert_check_clean(&volume);
}

/// Write MiB after MiB (MiB `i` filled with `base + i`), each flushed, until
/// one fails; then one more write and flush. Prints the MiB flushed, the
/// failing request's errno name, and the errno names of the write and the
/// flush after it, as JSON.
const FILL_FLUSHED: &str = r#"
uri, count, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = connect(uri)
def name(e):
    return errno.errorcode.get(e.errno, str(e.errno))
flushed, error = 0, None
for i in range(count):
    try:
        h.pwrite(bytes([(base + i) % 256]) * (1 << 20), i << 20)
        h.flush()
    except nbd.Error as e:
        error = name(e)
        break
    flushed += 1
after = []
for op in (lambda: h.pwrite(bytes(4096), 0), h.flush):
    try:
        op()
        after.append(None)
    except nbd.Error as e:
        after.append(name(e))
print(json.dumps({"flushed": flushed, "error": error, "after": after}))
"#;

/// The volume's own filesystem fills while the background committer (woken
/// by the writes) is the first to meet it: the client is told ENOSPC, on the
/// request that needed the space and on every write and flush after it
/// (qemu's `werror=enospc` pauses a guest on ENOSPC where EIO would fail its
/// I/O), and once space is freed, a restart reads back every flushed MiB.
#[test]
fn a_full_volume_filesystem_is_enospc_to_every_request_after_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = dir.path().join("runtime");
    let small = dir.path().join("small");
    std::fs::create_dir(&runtime).expect("runtime dir");
    std::fs::create_dir(&small).expect("volume dir");
    let mount = |options: &str| {
        run(Command::new("mount").args([
            "-t",
            "tmpfs",
            "-o",
            options,
            "vouch-test-full",
            s(&small),
        ]))
    };
    // A 1 MiB journal: the volume's files take ~1.1 MiB, the rest is data.
    let mounted = mount("size=12m,mode=0700");
    assert!(
        mounted.status.success(),
        "mounting a small tmpfs (needs root):\n{}",
        text(&mounted)
    );
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(small.clone());

    let volume = small.join("vol");
    let mut args = vec![
        volume.display().to_string(),
        "--create".into(),
        "64MiB".into(),
        "--journal".into(),
        "1MiB".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--log".into(),
        "info".into(),
    ];
    let mut command = Command::new(vouch_bin());
    command
        .env("VOUCH_RUNTIME_DIR", &runtime)
        .arg("serve")
        .args(&args);
    let expect = Expect {
        tcp: true,
        ..Expect::default()
    };
    let mut server = Server::launch(dir.path(), command, args.clone(), expect).expect("serve");
    let result = py_json(
        FILL_FLUSHED,
        &[&server.export_uri("vol"), "64", &0x20.to_string()],
    );
    let flushed = result["flushed"].as_u64().expect("flushed");
    assert!(flushed >= 1, "nothing fit in 12 MiB: {result}");
    assert_eq!(result["error"], "ENOSPC", "the full disk: {result}");
    assert_eq!(
        result["after"],
        serde_json::json!(["ENOSPC", "ENOSPC"]),
        "a write and a flush after the disk filled: {result}"
    );
    let log = server.log_text();
    assert!(
        log.contains("no space") && log.contains("reopen"),
        "the server's log says the disk is full and what to do:\n{log}"
    );
    server.kill9();

    // Free space (grow the filesystem), restart: every flushed MiB is there.
    let grown = run(Command::new("mount").args(["-o", "remount,size=256m", s(&small)]));
    assert!(grown.status.success(), "remount:\n{}", text(&grown));
    args.drain(1..5);
    let mut command = Command::new(vouch_bin());
    command
        .env("VOUCH_RUNTIME_DIR", &runtime)
        .arg("serve")
        .args(&args);
    let server = Server::launch(dir.path(), command, args, expect).expect("restart");
    let (same, _) = read_mibs(&server.export_uri("vol"), flushed, 0x20);
    assert_eq!(same, flushed, "flushed MiB lost after the disk filled");
    drop(server);
    assert_check_clean(&volume);
}
