//! The Debian NBD clients the serve tests drive, as helpers: qemu-img and
//! qemu-io (qemu-utils), nbdinfo (libnbd-bin) and fio's nbd engine. Shared
//! by the serve_* test files; each fails (never skips) when a tool is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::{run, run_ok, text, tool};

pub fn qemu_img() -> PathBuf {
    tool("qemu-img", "qemu-utils")
}

pub fn nbdinfo() -> PathBuf {
    tool("nbdinfo", "libnbd-bin")
}

/// The size `nbdinfo --size` says of an NBD URI (a new connection).
pub fn nbd_size(uri: &str) -> u64 {
    let output = run_ok(Command::new(nbdinfo()).args(["--size", uri]));
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("nbdinfo --size")
}

/// `qemu-img compare` of two raw images (files or NBD URIs): they must be
/// equal.
pub fn qemu_img_compare_ok(a: &str, b: &str) {
    run_ok(Command::new(qemu_img()).args(["compare", "-f", "raw", "-F", "raw", a, b]));
}

/// qemu-io on a raw NBD export; each entry of `commands` is one `-c`.
pub fn qemu_io(uri: &str, extra: &[&str], commands: &[&str]) -> Output {
    let mut command = Command::new(tool("qemu-io", "qemu-utils"));
    command.args(["-f", "raw"]).args(extra);
    for c in commands {
        command.args(["-c", c]);
    }
    command.arg(uri);
    run(&mut command)
}

/// qemu-io must succeed and every pattern must verify.
pub fn qemu_io_ok(uri: &str, commands: &[&str]) -> String {
    let output = qemu_io(uri, &[], commands);
    let all = text(&output);
    assert!(
        output.status.success() && !all.contains("verification failed") && !all.contains("failed:"),
        "qemu-io {commands:?} on {uri}:\n{all}"
    );
    all
}

pub fn nbdinfo_json(uri: &str, extra: &[&str]) -> serde_json::Value {
    let output = run_ok(Command::new(nbdinfo()).arg("--json").args(extra).arg(uri));
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("nbdinfo --json ({e}):\n{}", text(&output)))
}

pub fn fio(dir: &Path, args: &[&str]) -> serde_json::Value {
    let fio = tool("fio", "fio");
    // fio writes *-verify.state files into its working directory: keep them
    // out of the source tree.
    let output = run(Command::new(fio)
        .args(args)
        .args(["--output-format=json"])
        .current_dir(dir));
    assert!(output.status.success(), "fio {args:?}:\n{}", text(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    // The nbd engine prints a line before the JSON document.
    let start = stdout
        .find('{')
        .unwrap_or_else(|| panic!("no JSON from fio:\n{}", text(&output)));
    let json: serde_json::Value = serde_json::from_str(&stdout[start..])
        .unwrap_or_else(|e| panic!("fio json ({e}):\n{stdout}"));
    for job in json["jobs"].as_array().expect("jobs") {
        assert_eq!(job["error"], 0, "fio job error: {job}");
    }
    json
}

/// fio's nbd engine: 4 KiB random read/write at QD16 over `size`, every
/// block verified (crc32c) when read back; fails unless both directions did I/O.
pub fn fio_verified_randrw(dir: &Path, uri: &str, size: &str) {
    let uri = format!("--uri={uri}");
    let size = format!("--size={size}");
    let json = fio(
        dir,
        &[
            "--name=randrw",
            "--ioengine=nbd",
            &uri,
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=16",
            &size,
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--randrepeat=1",
            "--runtime=20",
        ],
    );
    let job = &json["jobs"][0];
    assert!(
        job["write"]["io_bytes"].as_u64().unwrap_or(0) > 0
            && job["read"]["io_bytes"].as_u64().unwrap_or(0) > 0,
        "fio did no I/O: {job}"
    );
}
