//! The Debian package (scripts/deb.sh), built from the binary these tests
//! run: it unpacks into a fresh directory tree where `vouch --version`
//! runs, it carries a manual page for every command `--help` lists, the
//! copyright and changelog Debian asks for, and unit files that
//! `systemd-analyze verify` accepts without a warning.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// Building the package strips and compresses a large binary.
const BUILD_TIMEOUT: Duration = Duration::from_secs(300);

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The commands a `--help` text lists (its "Commands:" section, without
/// `help`).
fn listed_commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_string)
        .collect()
}

/// Every manual page the package must hold, found from `--help` alone:
/// `vouch.1` and `vouch-CMD[-SUB].1` for each command listed.
fn expected_pages(binary: &Path, path: &[String], pages: &mut Vec<String>) {
    pages.push(format!(
        "{}.1.gz",
        ["vouch".to_string()]
            .iter()
            .chain(path)
            .cloned()
            .collect::<Vec<_>>()
            .join("-")
    ));
    let help = run_ok(Command::new(binary).args(path).arg("--help"));
    for command in listed_commands(&String::from_utf8_lossy(&help.stdout)) {
        let mut sub = path.to_vec();
        sub.push(command);
        expected_pages(binary, &sub, pages);
    }
}

#[test]
fn the_debian_package_installs_into_a_fresh_tree_and_runs() {
    let dpkg_deb = tool("dpkg-deb", "dpkg");
    tool("dpkg-shlibdeps", "dpkg-dev");
    let systemd_analyze = tool("systemd-analyze", "systemd");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");

    let started = Instant::now();
    let built = run_timeout(
        Command::new(workspace().join("scripts/deb.sh")).args([
            "--binary",
            vouch_bin(),
            "--out",
            s(&out),
        ]),
        BUILD_TIMEOUT,
    );
    assert!(built.status.success(), "scripts/deb.sh:\n{}", text(&built));
    eprintln!("scripts/deb.sh took {:?}", started.elapsed());
    let deb = PathBuf::from(String::from_utf8_lossy(&built.stdout).trim().to_string());
    let version =
        String::from_utf8_lossy(&run_ok(Command::new(vouch_bin()).arg("--version")).stdout)
            .trim()
            .to_string();
    assert!(
        deb.file_name().is_some_and(|name| name
            .to_string_lossy()
            .starts_with(&format!("vouch_{}_", version.trim_start_matches("vouch ")))),
        "{deb:?} for {version}"
    );
    let fields = run_ok(Command::new(&dpkg_deb).arg("--field").arg(&deb));
    let fields = String::from_utf8_lossy(&fields.stdout);
    assert!(fields.contains("Package: vouch\n"), "{fields}");
    assert!(
        fields.contains("Depends: libc6"),
        "no shared-library dependencies:\n{fields}"
    );

    let root = dir.path().join("root");
    run_ok(Command::new(&dpkg_deb).arg("-x").arg(&deb).arg(&root));
    let installed = root.join("usr/bin/vouch");
    let output = run_ok(Command::new(&installed).arg("--version"));
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), version);

    let man = root.join("usr/share/man/man1");
    let mut expected = Vec::new();
    expected_pages(&installed, &[], &mut expected);
    assert!(
        expected.len() > 15,
        "too few commands found in --help: {expected:?}"
    );
    for page in &expected {
        assert!(
            man.join(page).is_file(),
            "no manual page {page} in the package"
        );
    }
    for file in ["copyright", "changelog.gz"] {
        assert!(
            root.join("usr/share/doc/vouch").join(file).is_file(),
            "no /usr/share/doc/vouch/{file}"
        );
    }

    // The units as installed, with ExecStart pointing into the unpacked
    // tree (systemd-analyze checks the binary exists) and the manual pages
    // they cite looked up there. It reports bad settings as warnings and
    // still exits 0, so any output fails the test.
    let units = dir.path().join("units");
    std::fs::create_dir(&units).expect("mkdir");
    for unit in ["vouch.socket", "vouch@.service"] {
        let text = std::fs::read_to_string(root.join("usr/lib/systemd/system").join(unit))
            .unwrap_or_else(|e| panic!("{unit} not in the package: {e}"));
        std::fs::write(
            units.join(unit),
            text.replace("/usr/bin/vouch", s(&installed)),
        )
        .expect("write unit");
    }
    let verified = run(Command::new(systemd_analyze)
        .arg("verify")
        .arg(units.join("vouch.socket"))
        .arg(units.join("vouch@default.service"))
        .env("MANPATH", root.join("usr/share/man")));
    assert!(
        verified.status.success() && verified.stdout.is_empty() && verified.stderr.is_empty(),
        "systemd-analyze verify:\n{}",
        text(&verified)
    );
}
