//! The kernel on top of vouch: nbdfuse exposes the export as a file, a loop
//! device turns it into a block device, ext4 is made and mounted on it,
//! files are written, unmounted, remounted and read back, e2fsck finds the
//! filesystem clean, and `vouch check` finds the volume clean. Needs root
//! (FUSE, loop devices, mount), as CI runs it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Unmounts on drop (also when an assertion failed while mounted).
struct Mount {
    target: PathBuf,
    mounted: bool,
}

impl Mount {
    fn new(device: &str, target: &Path) -> Mount {
        run_ok(Command::new(tool("mount", "mount")).args([device, s(target)]));
        Mount {
            target: target.to_path_buf(),
            mounted: true,
        }
    }

    fn unmount(&mut self) {
        run_ok(Command::new(tool("umount", "mount")).arg(&self.target));
        self.mounted = false;
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = run(Command::new(tool("umount", "mount")).args(["-l", s(&self.target)]));
        }
    }
}

/// Detaches the loop device on drop.
struct Loop {
    device: String,
    attached: bool,
}

impl Loop {
    fn new(file: &Path) -> Loop {
        let output =
            run_ok(Command::new(tool("losetup", "mount")).args(["--find", "--show", s(file)]));
        let device = String::from_utf8_lossy(&output.stdout).trim().to_string();
        assert!(
            device.starts_with("/dev/loop"),
            "losetup printed {device:?}"
        );
        Loop {
            device,
            attached: true,
        }
    }

    fn detach(&mut self) {
        run_ok(Command::new(tool("losetup", "mount")).args(["-d", &self.device]));
        self.attached = false;
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        if self.attached {
            let _ = run(Command::new(tool("losetup", "mount")).args(["-d", &self.device]));
        }
    }
}

/// nbdfuse in the foreground; on drop `fusermount3 -u`, then wait (kill
/// after a timeout).
struct Fuse {
    child: Option<Child>,
    mountpoint: PathBuf,
}

impl Fuse {
    fn new(mountpoint: &Path, uri: &str, pidfile: &Path) -> Fuse {
        let child = Command::new(tool("nbdfuse", "nbdfuse"))
            .args(["-P", s(pidfile), s(mountpoint), uri])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn nbdfuse");
        let mut fuse = Fuse {
            child: Some(child),
            mountpoint: mountpoint.to_path_buf(),
        };
        let file = mountpoint.join("nbd");
        wait_until("nbdfuse to be ready", Duration::from_secs(20), || {
            if let Some(Ok(Some(status))) = fuse.child.as_mut().map(|c| c.try_wait()) {
                panic!("nbdfuse exited early: {status:?}");
            }
            pidfile.exists() && file.exists()
        });
        fuse
    }

    fn unmount(&mut self) {
        run_ok(Command::new(tool("fusermount3", "fuse3")).args(["-u", s(&self.mountpoint)]));
        let mut child = self.child.take().expect("nbdfuse running");
        let status = wait_timeout(&mut child, Duration::from_secs(20));
        assert!(
            status.is_some_and(|s| s.success()),
            "nbdfuse did not exit cleanly after fusermount3 -u: {status:?}"
        );
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = run(Command::new(tool("fusermount3", "fuse3")).args([
                "-u",
                "-z",
                s(&self.mountpoint),
            ]));
            if wait_timeout(&mut child, Duration::from_secs(10)).is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

fn file_content(index: usize) -> Vec<u8> {
    // Sizes from 1 byte to 3 MiB, none a multiple of 4096.
    let len = match index {
        0 => 1,
        1 => 4095,
        2 => 4097,
        _ => (index * 1_048_573) % (3 << 20) + 12_345,
    };
    random_bytes(len, 1000 + index as u64)
}

#[test]
fn nbdfuse_loop_ext4_files_survive_remount_and_check_clean() {
    for (name, package) in [
        ("mkfs.ext4", "e2fsprogs"),
        ("e2fsck", "e2fsprogs"),
        ("losetup", "mount"),
        ("mount", "mount"),
        ("fusermount3", "fuse3"),
        ("nbdfuse", "nbdfuse"),
    ] {
        tool(name, package);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let volume = dir.path().join("vol");
    let fuse_dir = dir.path().join("fuse");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&fuse_dir).expect("mkdir fuse");
    std::fs::create_dir(&mnt).expect("mkdir mnt");
    let mut server = Server::start(dir.path(), &[s(&volume), "--create", "96MiB"]);

    let mut fuse = Fuse::new(&fuse_dir, &server.uri, &dir.path().join("nbdfuse.pid"));
    let nbd_file = fuse_dir.join("nbd");
    assert_eq!(
        std::fs::metadata(&nbd_file).expect("stat nbd").len(),
        96 << 20,
        "nbdfuse file size"
    );
    let mut device = Loop::new(&nbd_file);
    run_ok(Command::new(tool("mkfs.ext4", "e2fsprogs")).args(["-q", "-F", &device.device]));

    let files: Vec<Vec<u8>> = (0..16).map(file_content).collect();
    let total: usize = files.iter().map(Vec::len).sum();
    assert!(total > 20 << 20, "write at least 20 MiB ({total})");
    let mut mount = Mount::new(&device.device, &mnt);
    std::fs::create_dir(mnt.join("sub")).expect("mkdir in ext4");
    for (index, content) in files.iter().enumerate() {
        std::fs::write(mnt.join("sub").join(format!("f{index}")), content).expect("write file");
    }
    run_ok(&mut Command::new(tool("sync", "coreutils")));
    // Rewrite part of one file in place, and delete one.
    std::fs::write(mnt.join("sub/f3"), &files[4]).expect("rewrite");
    std::fs::remove_file(mnt.join("sub/f5")).expect("remove");
    mount.unmount();
    // The loop device's cached pages are dropped by detaching and attaching
    // again, so the remount reads through FUSE and NBD from vouch.
    device.detach();
    let mut device = Loop::new(&nbd_file);
    let fsck = run(Command::new(tool("e2fsck", "e2fsprogs")).args(["-f", "-n", &device.device]));
    assert!(
        fsck.status.success(),
        "e2fsck after unmount:\n{}",
        text(&fsck)
    );

    let mut mount = Mount::new(&device.device, &mnt);
    for (index, content) in files.iter().enumerate() {
        let path = mnt.join("sub").join(format!("f{index}"));
        match index {
            5 => assert!(!path.exists(), "f5 was deleted"),
            3 => assert!(
                std::fs::read(&path).expect("read f3") == files[4],
                "f3 differs"
            ),
            _ => assert!(
                std::fs::read(&path).expect("read file") == *content,
                "f{index} differs after remount"
            ),
        }
    }
    mount.unmount();
    device.detach();
    fuse.unmount();
    server.stop();
    assert_eq!(info_json(&volume)["clean"], true);
    assert_check_clean(&volume);
    // What vouch stores is that filesystem: export it offline, fsck it and
    // read a file out of it without the kernel.
    let image = dir.path().join("export.img");
    vouch_ok(&["export", s(&volume), s(&image)]);
    let fsck = run(Command::new(tool("e2fsck", "e2fsprogs")).args(["-f", "-n", s(&image)]));
    assert!(
        fsck.status.success(),
        "e2fsck of the exported image:\n{}",
        text(&fsck)
    );
    let cat =
        run_ok(Command::new(tool("debugfs", "e2fsprogs")).args(["-R", "cat /sub/f7", s(&image)]));
    assert!(
        cat.stdout == files[7],
        "f7 read by debugfs from the exported image differs"
    );
}
