//! What a person meets first, through the real binary: output cut short by
//! a closed pipe, paths that are not volumes, size units, which options
//! each command takes, colour on a terminal (a real pty), and `info` on a
//! volume a running server holds.

use std::io::{BufRead as _, BufReader, Read as _};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

mod common;

use common::{info_json, s, text, vouch, vouch_bin, vouch_ok, wait_timeout, Server, TIMEOUT};

/// A pipe whose read end is already closed: every write to it fails.
fn closed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) fills both descriptors, which we then own.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: fds[0] and fds[1] were just opened and are owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

/// A closed pipe must end a command the way it ends `cat`: by SIGPIPE,
/// quietly (no panic, no "Broken pipe" message).
fn assert_ends_by_sigpipe(args: &[&str], status: std::process::ExitStatus, stderr: &str) {
    assert_eq!(
        status.signal(),
        Some(libc::SIGPIPE),
        "vouch {args:?} on a closed stdout: {status:?}, stderr:\n{stderr}"
    );
    for noise in ["panicked", "Broken pipe", "error"] {
        assert!(
            !stderr.contains(noise),
            "vouch {args:?} on a closed stdout printed {noise:?}:\n{stderr}"
        );
    }
}

#[test]
fn a_closed_stdout_ends_every_printing_command_quietly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let leg = dir.path().join("leg1");
    vouch_ok(&["create", s(&volume), "--size", "8MiB", "--mirror", s(&leg)]);
    let raw = dir.path().join("out.raw");
    let commands: Vec<Vec<&str>> = vec![
        vec!["--help"],
        vec!["check", "--help"],
        vec!["--version"],
        vec!["info", s(&volume)],
        vec!["info", s(&volume), "--json"],
        vec!["check", s(&volume)],
        vec!["check", s(&volume), "--json"],
        vec!["verify", s(&volume)],
        vec!["verify", s(&volume), "--json"],
        vec!["scrub", s(&volume), "--status"],
        vec![
            "compare",
            s(&volume),
            "--with",
            s(&volume),
            "--length",
            "4K",
        ],
        vec!["mirror", "status", s(&volume)],
        vec!["export", s(&volume), s(&raw)],
    ];
    for args in &commands {
        let output = Command::new(vouch_bin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(closed_pipe())
            .stderr(Stdio::piped())
            .output()
            .expect("run vouch");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_ends_by_sigpipe(args, output.status, &stderr);
    }
    // The export was complete before its closing line was printed.
    assert_eq!(
        std::fs::metadata(&raw).expect("exported image").len(),
        8 << 20
    );
}

#[test]
fn a_reader_that_stops_after_one_line_ends_the_command_quietly() {
    // 4096 segment digests (about 230 KB): far more than a pipe holds, so
    // the command is still writing when the reader goes away.
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    vouch_ok(&["create", s(&volume), "--size", "4GiB"]);
    let seed = "ab".repeat(32);
    let args = ["verify", s(&volume), "--seed", &seed, "--segments"];
    let mut child = Command::new(vouch_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vouch");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    stdout.read_line(&mut first).expect("first line");
    assert!(first.starts_with("segment: LBA 0 "), "{first}");
    drop(stdout);
    let mut stderr_pipe = child.stderr.take().expect("stderr");
    let status = wait_timeout(&mut child, TIMEOUT).expect("vouch verify ended");
    let mut stderr = String::new();
    stderr_pipe.read_to_string(&mut stderr).expect("stderr");
    assert_ends_by_sigpipe(&args, status, &stderr);
}

/// A server is not a filter: with its stdout closed (a supervisor that
/// drops it, `vouch serve ... | head -0`) it keeps serving, and stops
/// cleanly on SIGTERM.
#[test]
fn a_server_with_a_closed_stdout_keeps_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let socket = dir.path().join("nbd.sock");
    vouch_ok(&["create", s(&volume), "--size", "8MiB"]);
    let mut child = Command::new(vouch_bin())
        .args(["serve", s(&volume), "--socket", s(&socket)])
        .stdin(Stdio::null())
        .stdout(Stdio::from(closed_pipe()))
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vouch serve");
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    common::wait_until("the socket to answer", TIMEOUT, || {
        Command::new(common::tool("nbdinfo", "libnbd-bin"))
            .arg(&uri)
            .output()
            .is_ok_and(|output| output.status.success())
    });
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let mut stderr_pipe = child.stderr.take().expect("stderr");
    let status = wait_timeout(&mut child, TIMEOUT).expect("vouch serve stopped");
    let mut stderr = String::new();
    stderr_pipe.read_to_string(&mut stderr).expect("stderr");
    assert!(status.success(), "{status:?}:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("stopped cleanly"), "{stderr}");
}

/// The one error line of a failed command (exit 2).
fn error_line(args: &[&str]) -> String {
    let output = vouch(args);
    assert_eq!(
        output.status.code(),
        Some(2),
        "vouch {args:?}: {}",
        text(&output)
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "vouch {args:?}: one error line: {stderr}");
    errors[0].to_string()
}

#[test]
fn a_path_that_is_not_a_volume_is_named_and_said_what_it_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    vouch_ok(&["create", s(&volume), "--size", "1MiB"]);
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let others = dir.path().join("others");
    std::fs::create_dir(&others).expect("mkdir");
    std::fs::write(others.join("notes.txt"), b"not a volume").expect("write");
    let file = dir.path().join("file");
    std::fs::write(&file, b"not a volume").expect("write");
    let missing = dir.path().join("missing");
    let cases = [
        (&empty, "is not a vouch volume (an empty directory)"),
        (
            &others,
            "is not a vouch volume (a directory without a superblock file)",
        ),
        (&file, "is not a vouch volume (not a directory"),
        (&missing, "does not exist"),
    ];
    let raw = dir.path().join("out.raw");
    let new_leg = dir.path().join("new-leg");
    for (path, what) in cases {
        let p = s(path);
        let commands: Vec<Vec<&str>> = vec![
            vec!["info", p],
            vec!["info", p, "--json"],
            vec!["check", p],
            vec!["export", p, s(&raw)],
            vec!["serve", p, "--listen", "127.0.0.1:0"],
            vec!["verify", p],
            vec!["scrub", p],
            vec!["scrub", p, "--status"],
            vec!["copy", p, s(&volume), "--length", "4K"],
            vec!["copy", s(&volume), p, "--length", "4K"],
            vec!["compare", p, "--with", s(&volume)],
            vec!["mirror", "status", p],
            vec!["mirror", "resync", p, "--leg", "1"],
            vec!["mirror", "replace", p, "--leg", "1"],
            vec!["mirror", "add", p, s(&new_leg)],
            vec!["mirror", "remove", p, "--leg", "1"],
            vec!["key", "change", p],
        ];
        for args in commands {
            let line = error_line(&args);
            assert!(
                line.contains(&format!("{p} {what}")),
                "vouch {args:?}: expected \"{p} {what}\" in {line:?}"
            );
        }
    }
    assert!(
        !raw.exists() && !new_leg.exists(),
        "a failed command left files"
    );
    assert!(
        !empty.join("superblock").exists(),
        "a failed command wrote into {empty:?}"
    );
    // A plain volume given to a command for mirror legs says so.
    let line = error_line(&["mirror", "status", s(&volume)]);
    assert!(
        line.contains("is a plain volume, not a leg of a mirror"),
        "{line}"
    );
}

#[test]
fn sizes_read_like_qemu_img_and_a_decimal_unit_is_explained() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let line = error_line(&["create", s(&volume), "--size", "2GB"]);
    assert!(
        line.contains(
            "2GB is 2000000000 bytes (GB is decimal; G and GiB are 1024-based): not a positive multiple of 4096"
        ),
        "{line}"
    );
    assert!(!volume.exists());
    let line = error_line(&["serve", s(&volume), "--create", "1MB"]);
    assert!(
        line.contains("1MB is 1000000 bytes (MB is decimal"),
        "{line}"
    );
    assert!(!volume.exists());
    // G and GiB are the same 1024-based unit.
    for (size, bytes) in [("2G", 2u64 << 30), ("2GiB", 2 << 30), ("64k", 64 << 10)] {
        let path = dir.path().join(size);
        vouch_ok(&["create", s(&path), "--size", size]);
        assert_eq!(info_json(&path)["size_bytes"], bytes, "--size {size}");
    }
    let two_g = dir.path().join("2G");
    let line = error_line(&["verify", s(&two_g), "--offset", "1MB"]);
    assert!(
        line.contains("1MB is 1000000 bytes (MB is decimal; M and MiB are 1024-based): not a multiple of 4096"),
        "{line}"
    );
    let line = error_line(&["copy", s(&two_g), s(&two_g), "--length", "1000"]);
    assert!(line.contains("1000 is not a multiple of 4096"), "{line}");
    // Every command's --help says how sizes read where it takes one.
    for command in [
        &["create"][..],
        &["serve"],
        &["import"],
        &["verify"],
        &["scrub"],
        &["copy"],
        &["compare"],
        &["bench"],
        &["mirror", "resync"],
    ] {
        let help = help_of(command);
        assert!(
            help.contains("powers of 1024") && help.contains("powers of 1000"),
            "vouch {command:?} --help does not say how sizes read:\n{help}"
        );
    }
}

/// `vouch COMMAND --help`.
fn help_of(command: &[&str]) -> String {
    let mut args = command.to_vec();
    args.push("--help");
    String::from_utf8_lossy(&vouch_ok(&args).stdout).into_owned()
}

#[test]
fn each_command_lists_only_the_options_it_takes() {
    let key_file = "--key-file";
    let keyless = "--keyless";
    let replica = "--replica-tls-cert";
    // (command, takes --key-file, --keyless, the replica options)
    let table: [(&[&str], bool, bool, bool); 16] = [
        (&["create"], true, false, true),
        (&["info"], true, true, true),
        (&["check"], true, true, true),
        (&["import"], true, false, false),
        (&["export"], true, false, false),
        (&["serve"], true, false, true),
        (&["verify"], true, true, false),
        (&["scrub"], true, true, true),
        (&["copy"], true, false, false),
        (&["compare"], true, false, false),
        (&["bench"], false, false, false),
        (&["mirror", "status"], false, false, true),
        (&["mirror", "replace"], true, false, true),
        (&["mirror", "remove"], false, false, false),
        (&["replica", "serve"], false, false, false),
        (&["key", "change"], true, false, false),
    ];
    for (command, takes_key, takes_keyless, takes_replica) in table {
        let help = help_of(command);
        for (option, takes) in [
            (key_file, takes_key),
            (keyless, takes_keyless),
            (replica, takes_replica),
        ] {
            assert_eq!(
                help.contains(option),
                takes,
                "vouch {command:?} --help {} {option}:\n{help}",
                if takes { "lacks" } else { "lists" }
            );
        }
    }
    let top = help_of(&[]);
    for option in [key_file, keyless, replica, "--replica-timeout"] {
        assert!(!top.contains(option), "vouch --help lists {option}:\n{top}");
    }
}

/// A plain 1 MiB volume and a key file (which a plain volume does not need).
fn plain_volume_and_a_key() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    vouch_ok(&["create", s(&volume), "--size", "1MiB"]);
    let key = dir.path().join("key");
    std::fs::write(&key, [7u8; 32]).expect("key");
    (dir, volume, key)
}

#[test]
fn options_given_before_the_command_still_work_where_they_apply() {
    let (dir, volume, key) = plain_volume_and_a_key();
    // The key file reaches the command: a plain volume needs none, and
    // says so in its log.
    let output = vouch_ok(&["--key-file", s(&key), "info", s(&volume)]);
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("is not encrypted: it needs no key"),
        "{}",
        text(&output)
    );
    vouch_ok(&["--keyless", "check", s(&volume)]);
    // A replica option reaches the command: the README's
    // `vouch --replica-tls-cert ... create|serve` form.
    let line = error_line(&[
        "--replica-timeout",
        "0",
        "create",
        s(&dir.path().join("a")),
        "--size",
        "1MiB",
        "--mirror",
        "vouch://127.0.0.1:9/x",
    ]);
    assert!(
        line.contains("--replica-timeout must be at least 1 second"),
        "{line}"
    );
    for (option, value) in [("--replica-tls-cert", "c.pem"), ("--key-file", s(&key))] {
        let output = vouch(&[option, value, "serve", "--help"]);
        assert!(
            output.status.success(),
            "{option} before serve: {}",
            text(&output)
        );
    }
    // Before a command that does not take it: refused, naming both.
    let line = error_line(&[
        "--keyless",
        "create",
        s(&dir.path().join("b")),
        "--size",
        "1MiB",
    ]);
    assert!(
        line.contains("--keyless does not apply to `vouch create`"),
        "{line}"
    );
    let line = error_line(&[
        "--replica-tls-ca",
        "ca.pem",
        "mirror",
        "remove",
        s(&volume),
        "--leg",
        "1",
    ]);
    assert!(
        line.contains("does not apply to `vouch mirror remove`"),
        "{line}"
    );
    assert!(!dir.path().join("b").exists());
    // After a command that does not take it: clap's usage error.
    let output = vouch(&["bench", "--key-file", s(&key)]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert!(
        text(&output).contains("unexpected argument '--key-file'"),
        "{}",
        text(&output)
    );
}

/// A pseudo-terminal: (master, path of the slave).
fn open_pty() -> (OwnedFd, String) {
    // SAFETY: posix_openpt returns a new descriptor or -1.
    let master = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    assert!(
        master >= 0,
        "posix_openpt: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: master was just opened and is owned by nobody else.
    let master = unsafe { OwnedFd::from_raw_fd(master) };
    // SAFETY: grantpt/unlockpt on the open master.
    let ready = unsafe {
        libc::grantpt(master.as_raw_fd()) == 0 && libc::unlockpt(master.as_raw_fd()) == 0
    };
    assert!(
        ready,
        "grantpt/unlockpt: {}",
        std::io::Error::last_os_error()
    );
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: ptsname_r writes a NUL-terminated name into the buffer.
    let rc = unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) };
    assert_eq!(rc, 0, "ptsname_r");
    // SAFETY: NUL-terminated by ptsname_r.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
    (master, name.to_string_lossy().into_owned())
}

/// Run vouch with stderr on a terminal (a pty); what it wrote there.
fn stderr_on_a_terminal(args: &[&str], no_color: Option<&str>) -> String {
    let (master, slave_path) = open_pty();
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&slave_path)
        .expect("open the pty's slave");
    let mut command = Command::new(vouch_bin());
    command
        .args(args)
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(slave);
    if let Some(value) = no_color {
        command.env("NO_COLOR", value);
    }
    let mut child = command.spawn().expect("spawn vouch");
    // The only open slave is the child's: once it exits, reading the
    // master ends (EIO) after what it wrote.
    drop(command);
    let reader = std::thread::spawn(move || {
        let mut file = std::fs::File::from(master);
        let mut bytes = Vec::new();
        let mut chunk = [0u8; 4096];
        while let Ok(n) = file.read(&mut chunk) {
            if n == 0 {
                break;
            }
            bytes.extend_from_slice(&chunk[..n]);
        }
        bytes
    });
    let status = wait_timeout(&mut child, TIMEOUT).expect("vouch ended");
    assert!(status.success(), "vouch {args:?} on a pty: {status:?}");
    String::from_utf8_lossy(&reader.join().expect("pty reader")).into_owned()
}

/// An ANSI colour (SGR) sequence: ESC [ digits/semicolons m.
fn has_colour(text: &str) -> bool {
    text.split('\x1b').skip(1).any(|rest| {
        rest.strip_prefix('[')
            .and_then(|rest| rest.find('m').map(|end| &rest[..end]))
            .is_some_and(|codes| codes.chars().all(|c| c.is_ascii_digit() || c == ';'))
    })
}

#[test]
fn no_color_is_honoured_on_a_terminal_and_logs_elsewhere_are_plain() {
    let (_dir, volume, key) = plain_volume_and_a_key();
    // A plain volume given a key logs one INFO line saying it needs none.
    let args = ["info", s(&volume), "--key-file", s(&key)];
    let logged = "is not encrypted: it needs no key";
    let coloured = stderr_on_a_terminal(&args, None);
    assert!(coloured.contains(logged), "{coloured:?}");
    assert!(
        has_colour(&coloured),
        "a terminal gets colour: {coloured:?}"
    );
    // NO_COLOR set and not empty: no colour (no-color.org).
    let plain = stderr_on_a_terminal(&args, Some("1"));
    assert!(plain.contains(logged), "{plain:?}");
    assert!(!has_colour(&plain), "NO_COLOR=1 on a terminal: {plain:?}");
    // Empty NO_COLOR does not count.
    assert!(has_colour(&stderr_on_a_terminal(&args, Some(""))));
    // Not a terminal: plain text, no escape sequence at all.
    let output = run_without_no_color(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(logged), "{}", text(&output));
    assert!(!stderr.contains('\x1b'), "logs to a pipe: {stderr:?}");
}

fn run_without_no_color(args: &[&str]) -> std::process::Output {
    common::run_ok(
        Command::new(vouch_bin())
            .args(args)
            .env_remove("NO_COLOR")
            .env_remove("RUST_LOG"),
    )
}

#[test]
fn info_looks_at_a_served_volume_read_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    vouch_ok(&["create", s(&volume), "--size", "8MiB"]);
    let before = info_json(&volume);
    assert_eq!(before["in_use"], false);
    assert_eq!(before["clean"], true);
    assert_eq!(before["read_only"], false, "a fresh volume is writable");
    let mut server = Server::start(dir.path(), &[s(&volume)]);
    let superblock = std::fs::read(volume.join("superblock")).expect("superblock");
    let live = info_json(&volume);
    assert_eq!(live["in_use"], true, "{live}");
    for field in [
        "uuid",
        "size_bytes",
        "layout",
        "guard",
        "journal_bytes",
        "read_only",
    ] {
        assert_eq!(live[field], before[field], "{field}: {live}");
    }
    assert!(
        live["clean"].is_null() && live["journal_records_pending"].is_null(),
        "{live}"
    );
    let output = vouch_ok(&["info", s(&volume)]);
    let shown = String::from_utf8_lossy(&output.stdout);
    assert!(
        shown.contains("in use: another vouch process") && shown.contains("--server"),
        "{shown}"
    );
    assert_eq!(
        std::fs::read(volume.join("superblock")).expect("superblock"),
        superblock,
        "info wrote to a served volume"
    );
    // The server still holds it for writing: an offline check is refused.
    let line = error_line(&["check", s(&volume)]);
    assert!(line.contains("is in use"), "{line}");
    server.stop();
    let after = info_json(&volume);
    assert_eq!(
        (after["in_use"].clone(), after["clean"].clone()),
        (false.into(), true.into())
    );
    common::assert_check_clean(&volume);
}
