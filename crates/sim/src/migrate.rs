//! `vouch migrate` crashed at every file operation (`vouch-sim migrate`).
//!
//! Per seed: a volume of two regions (the second a part region) written on
//! random data runs, allocated zeroes and trims, closed cleanly; its image
//! read. Then for `n` = 1, 2, ... a copy of it is migrated to the other
//! layout by a child process (`vouch-sim migrate-child`) that aborts right
//! before the migration's `n`th file operation (`MigrateBreaks::crash_at`:
//! the member's creation, its flag, the renames and directory syncs, each
//! write, write-zeroes and trim, each flush, the record's write and its
//! fsync, the superblock's `regions_seq`), until a child finishes. Each
//! image left is opened as a command would (recovering both members) and
//! every block read: it must be the image, with no fault (a block read as
//! zeros, a fault, a refused open: a violation). Then the migration is run
//! again to the end (the operator's retry) and the image read again, and
//! neither member may then hold anything in a region it does not serve
//! (the release pass trimmed what a cut run left there).
//! With `back`, the volume is first migrated to the other layout (not
//! crashed) and the migration back to its own layout is crashed: that one
//! ends by making it a one-layout volume again (the flag cleared, the
//! record and the member removed), each of those steps a crash point.
//!
//! With `online`, the migration is the server's (`RegionVolume::
//! migrate_online`): before each of its file operations a foreground
//! write arrives (about one step in two, none while the region's lock is
//! held exclusive, where it would wait), through the region layer, and
//! is logged once acknowledged; the expected image is the volume's with
//! every logged write applied in order. `--break-recopy` (the chunks
//! written during the copy never copied again) must be caught.
//!
//! A process crash keeps every write issued (the page cache) and each
//! member's held log (memory that outlives the process). With `reboot`,
//! each image is also judged as a machine restart leaves it: a copy with
//! the members' held logs gone (the `held` pointers removed: what was
//! acknowledged but not flushed in a member is lost, as in a power cut),
//! read, migrated again and read again. That is one power-cut outcome,
//! the one where the kernel had written back every file write; cuts that
//! also drop unsynced file writes (the fsync order of the record and the
//! directories) are `vouch-sim migrate --power`'s (`migrate_power`), on
//! the model filesystem.
//! Deliberate breaks must be caught: `--break-release` (the old member
//! trimmed before the switch) and `--break-switch` (the record switched
//! before the new member's flush: caught by the reboot images).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::regions::{
    self, MigrateBreaks, OnlineBreaks, OnlineMigrate, RegionVolume, RegionsFs, Steps,
};
use vouch_engine::{BlockDevice, CreateOptions, LayoutKind, OpenOptions, ZeroFlags};
use vouch_format::regions::REGION_BLOCKS;

use crate::rng::Rng;
use crate::BLOCK;

const BLOCK_U64: u64 = BLOCK as u64;
/// One whole region and a part one.
pub(crate) const BLOCKS: u64 = REGION_BLOCKS + 700;

#[derive(Clone, Debug)]
pub struct MigrateConfig {
    /// The layout the volume is created in; it migrates to the other.
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    /// The `vouch-sim` binary (runs `migrate-child`).
    pub child: PathBuf,
    pub break_release: bool,
    /// Break: switch the record before the new member is flushed.
    pub break_switch: bool,
    /// Also judge each image after a reboot (the held logs gone).
    pub reboot: bool,
    /// The online move, with foreground writes at its steps.
    pub online: bool,
    /// Online: never copy the chunks written mid-move again.
    pub break_recopy: bool,
    /// Run the migration again (and judge it) after every Nth crash
    /// point and the last (1: after each). The judging of every crash
    /// image itself is never skipped.
    pub again_every: u64,
    /// Migrate to the other layout first (uncrashed), then crash the
    /// migration back to the volume's own layout (which ends by making it
    /// a one-layout volume again).
    pub back: bool,
}

#[derive(Debug, Default)]
pub struct MigrateReport {
    /// Crash images checked (process crashes).
    pub images: u64,
    /// Of those, also judged after a reboot.
    pub reboot_images: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl MigrateReport {
    pub fn summary(&self, config: &MigrateConfig) -> String {
        format!(
            "migrate: layout={} -> {}{}{}{} seeds={} process-crash images={} reboot images={} violations={} time={:.1}s",
            config.layout.name(),
            regions::other_layout(config.layout).name(),
            if config.back {
                format!(" -> {} (crashed on the way back)", config.layout.name())
            } else {
                String::new()
            },
            match (config.online, config.break_release, config.break_recopy) {
                (true, _, true) => " online with foreground writes (break: no recopy)",
                (true, _, false) => " online with foreground writes",
                (false, true, _) => " (break: release before switch)",
                (false, false, _) => "",
            },
            if config.break_switch {
                " (break: switch before the new member's flush)"
            } else {
                ""
            },
            config.seeds,
            self.images,
            self.reboot_images,
            self.violations.len(),
            self.seconds
        )
    }
}

/// The child: migrate `path` to `target`, aborting at `crash_at`.
pub fn child(
    path: &Path,
    target: LayoutKind,
    crash_at: u64,
    (break_release, break_switch): (bool, bool),
) -> Result<(), String> {
    let breaks = MigrateBreaks {
        crash_at: Some(crash_at),
        release_before_switch: break_release,
        switch_before_flush: break_switch,
        ..MigrateBreaks::default()
    };
    regions::migrate(path, target, &OpenOptions::default(), &breaks, |_, _| {})
        .map(|_| ())
        .map_err(|error| error.to_string())
}

/// Where the online child logs the foreground writes it had acknowledged.
fn acked_log(path: &Path) -> PathBuf {
    path.with_extension("acked")
}

/// The volume at `path` for an online migration: a volume with regions
/// (made one if it is not), as `serve --migratable` opens it.
fn open_online(path: &Path) -> Result<RegionVolume, String> {
    let superblock = vouch_engine::volume_superblock(path).map_err(|error| error.to_string())?;
    let options = OpenOptions::default();
    if regions::has_regions(&superblock) {
        return RegionVolume::open(path, &options).map_err(|error| error.to_string());
    }
    let home = vouch_engine::open_volume(path, &options).map_err(|error| error.to_string())?;
    regions::open_served(path, home, &options).map_err(|error| error.to_string())
}

/// Migrate `path` online to `target`; with `steps`' hook writing.
fn migrate_online(
    volume: &RegionVolume,
    target: LayoutKind,
    steps: &regions::Steps,
    breaks: OnlineBreaks,
) -> Result<(), String> {
    let stop = AtomicBool::new(false);
    let how = OnlineMigrate {
        target,
        rate: None,
        stop: &stop,
    };
    volume
        .migrate_online_driven(&how, steps, breaks, |_, _| {})
        .map(|_| ())
        .map_err(|error| error.to_string())
}

/// The online child: migrate `path` to `target` with foreground writes
/// at its steps (logged once acknowledged), aborting at `crash_at`.
pub fn child_online(
    path: &Path,
    target: LayoutKind,
    crash_at: u64,
    seed: u64,
    break_recopy: bool,
) -> Result<(), String> {
    let volume = Arc::new(open_online(path)?);
    let log = std::fs::File::create(acked_log(path)).map_err(|error| error.to_string())?;
    let writer = Arc::clone(&volume);
    let state = Mutex::new((Rng::new(seed.wrapping_mul(1_000_003) ^ crash_at), log));
    let hook: regions::StepHook = Box::new(move |locked| {
        if locked {
            return;
        }
        let mut state = state.lock();
        let (rng, log) = &mut *state;
        if !rng.chance(1, 2) {
            return;
        }
        let count = rng.range(1, 8);
        let lba = rng.below(BLOCKS - count);
        let data = rng.bytes((count * BLOCK_U64) as usize);
        writer
            .write(lba * BLOCK_U64, &data, false)
            .expect("a foreground write");
        // Acknowledged: logged (a process crash keeps the page cache).
        let mut record = Vec::with_capacity(16 + data.len());
        record.extend_from_slice(&lba.to_le_bytes());
        record.extend_from_slice(&count.to_le_bytes());
        record.extend_from_slice(&data);
        log.write_all(&record).expect("log the write");
    });
    let steps = regions::Steps::with_hook(Some(crash_at), hook);
    let breaks = OnlineBreaks {
        skip_recopy: break_recopy,
        ..OnlineBreaks::default()
    };
    let result = migrate_online(&volume, target, &steps, breaks);
    drop(steps);
    let volume = Arc::try_unwrap(volume).map_err(|_| "the volume is still shared".to_string())?;
    result?;
    volume.close().map_err(|error| error.to_string())
}

/// `expected` with every write the online child logged applied.
fn apply_acked(path: &Path, expected: &mut [u8]) {
    let log = std::fs::read(acked_log(path)).unwrap_or_default();
    let mut at = 0;
    while at + 16 <= log.len() {
        let lba = u64::from_le_bytes(log[at..at + 8].try_into().expect("8 bytes"));
        let count = u64::from_le_bytes(log[at + 8..at + 16].try_into().expect("8 bytes"));
        let len = (count * BLOCK_U64) as usize;
        let from = (lba * BLOCK_U64) as usize;
        expected[from..from + len].copy_from_slice(&log[at + 16..at + 16 + len]);
        at += 16 + len;
    }
}

/// A temporary directory, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(what: &str) -> TempDir {
        // Unique in the process too: tests run the simulator on threads.
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "vouch-sim-migrate-{}-{made}-{what}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create a temporary directory");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A volume of `BLOCKS` blocks at `path` in `fs`, written on random data
/// runs (one across the region boundary), allocated zeroes and trims, and
/// closed.
pub(crate) fn write_volume(
    fs: &dyn RegionsFs,
    path: &Path,
    (layout, journal_bytes): (LayoutKind, u64),
    rng: &mut Rng,
) {
    let options = CreateOptions {
        layout,
        journal_bytes: Some(journal_bytes),
        ..CreateOptions::new(BLOCKS * BLOCK_U64)
    };
    let volume = fs.create_volume(path, &options).expect("create");
    for _ in 0..12 {
        let count = rng.range(1, 80);
        let lba = rng.below(BLOCKS - count);
        let data = rng.bytes((count * BLOCK_U64) as usize);
        volume.write(lba * BLOCK_U64, &data, false).expect("write");
    }
    // One run across the region boundary.
    let data = rng.bytes((40 * BLOCK_U64) as usize);
    volume
        .write((REGION_BLOCKS - 20) * BLOCK_U64, &data, false)
        .expect("write");
    for _ in 0..3 {
        let count = rng.range(1, 40);
        let lba = rng.below(BLOCKS - count);
        let flags = ZeroFlags {
            fua: false,
            allocate: true,
        };
        if rng.chance(1, 2) {
            volume
                .write_zeroes(lba * BLOCK_U64, count * BLOCK_U64, flags)
                .expect("zeroes");
        } else {
            volume
                .trim(lba * BLOCK_U64, count * BLOCK_U64, false)
                .expect("trim");
        }
    }
    volume.close().expect("close");
}

/// Every block of the volume at `path` as a command reads it, or why not.
fn read_image(path: &Path) -> Result<Vec<u8>, String> {
    read_image_in(&regions::real_fs(), path)
}

/// `read_image` of the volume at `path` in `fs`.
pub(crate) fn read_image_in(fs: &Arc<dyn RegionsFs>, path: &Path) -> Result<Vec<u8>, String> {
    let options = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let superblock = fs.superblock(path).map_err(|error| error.to_string())?;
    let mut image = vec![0u8; (BLOCKS * BLOCK_U64) as usize];
    let faults = if regions::has_regions(&superblock) {
        let volume = open_in(fs, path, &options)?;
        let faults = volume
            .read_blocks_collecting(0, BLOCKS, &mut image)
            .map_err(|error| error.to_string())?;
        volume.close().map_err(|error| error.to_string())?;
        faults
    } else {
        let volume = fs
            .open_volume(path, &options)
            .map_err(|error| error.to_string())?;
        volume
            .read_blocks_collecting(0, BLOCKS, &mut image)
            .map_err(|error| error.to_string())?
    };
    if let Some(fault) = faults.first() {
        return Err(format!("{} faults, the first {fault}", faults.len()));
    }
    Ok(image)
}

/// The operator runs the migration again on the image at `path`: it must
/// finish, every block read as `expected`, nothing left where a member
/// does not serve.
fn run_again(
    report: &mut MigrateReport,
    at: &str,
    path: &Path,
    target: LayoutKind,
    expected: &[u8],
) {
    let again = regions::migrate(
        path,
        target,
        &OpenOptions::default(),
        &MigrateBreaks::default(),
        |_, _| {},
    );
    match again {
        Ok(_) => {
            judge(
                report,
                at,
                "after running it again",
                read_image(path),
                expected,
            );
            if let Err(why) = nothing_unserved(path) {
                report
                    .violations
                    .push(format!("{at} after running it again: {why}"));
            }
        }
        Err(error) => report
            .violations
            .push(format!("{at}: running it again failed: {error}")),
    }
}

/// A machine restart of the volume copy at `path`: its members' held logs
/// (in memory that outlives the process, not the machine) are gone. The
/// copy's `held` pointers name the crashed process's slots, so removing
/// them is the reboot (the slots stay with the original image).
fn forget_held(path: &Path) {
    let mut dirs = vec![path.to_path_buf()];
    if let Ok(entries) = std::fs::read_dir(path) {
        dirs.extend(
            entries
                .flatten()
                .map(|entry| entry.path())
                .filter(|entry| entry.is_dir()),
        );
    }
    for dir in dirs {
        // `FileStorage`'s HELD_POINTER.
        let _ = std::fs::remove_file(dir.join("held"));
    }
}

/// The release pass's promise (docs/CRASH_MODEL.md, "Release pass"): once
/// a migration ran to its end, neither member holds anything in a region
/// it does not serve (what a cut run left there was trimmed), so the space
/// came back. A one-layout volume has nothing to check.
fn nothing_unserved(path: &Path) -> Result<(), String> {
    nothing_unserved_in(&regions::real_fs(), path)
}

/// The volume with regions at `path` in `fs`, opened plainly.
pub(crate) fn open_in(
    fs: &Arc<dyn RegionsFs>,
    path: &Path,
    options: &OpenOptions,
) -> Result<RegionVolume, String> {
    RegionVolume::open_in(
        Arc::clone(fs),
        path,
        options,
        &Steps::new(None),
        &MigrateBreaks::default(),
    )
    .map_err(|error| error.to_string())
}

/// `nothing_unserved` of the volume at `path` in `fs`.
pub(crate) fn nothing_unserved_in(fs: &Arc<dyn RegionsFs>, path: &Path) -> Result<(), String> {
    let superblock = fs.superblock(path).map_err(|error| error.to_string())?;
    if !regions::has_regions(&superblock) {
        return Ok(());
    }
    let options = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let volume = open_in(fs, path, &options)?;
    let record = volume.record();
    let mut found = Ok(());
    for (index, serving) in record.layouts.iter().enumerate() {
        let unserved = regions::other_layout(*serving);
        let lbas = record.lbas(index, BLOCKS);
        let runs = volume
            .member(unserved)
            .block_status(
                lbas.start * BLOCK_U64,
                (lbas.end - lbas.start) * BLOCK_U64,
                lbas.end - lbas.start,
            )
            .map_err(|error| error.to_string())?;
        let mut lba = lbas.start;
        for (blocks, allocation) in runs {
            if allocation != vouch_engine::Allocation::Hole {
                found = Err(format!(
                    "the {} member still holds LBAs {lba}-{} of region {index}, which the {} member serves (the release pass left them)",
                    unserved.name(),
                    lba + blocks - 1,
                    serving.name()
                ));
                break;
            }
            lba += blocks;
        }
        if found.is_err() {
            break;
        }
    }
    volume.close().map_err(|error| error.to_string())?;
    found
}

pub(crate) fn first_difference(a: &[u8], b: &[u8]) -> Option<u64> {
    a.chunks(BLOCK)
        .zip(b.chunks(BLOCK))
        .position(|(x, y)| x != y)
        .map(|block| block as u64)
}

fn copy_dir(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .args(["-a", "--sparse=always"])
        .arg(from)
        .arg(to)
        .status()
        .expect("cp (apt-get install -y coreutils)");
    assert!(
        status.success(),
        "cp -a {} {}",
        from.display(),
        to.display()
    );
}

/// A violation unless `image` is `expected`.
fn judge(
    report: &mut MigrateReport,
    at: &str,
    when: &str,
    image: Result<Vec<u8>, String>,
    expected: &[u8],
) {
    match image {
        Ok(image) => {
            if let Some(block) = first_difference(&image, expected) {
                report.violations.push(format!(
                    "{at} {when}: LBA {block} differs from what was written"
                ));
            }
        }
        Err(why) => report.violations.push(format!("{at} {when}: {why}")),
    }
}

pub fn run(config: &MigrateConfig) -> MigrateReport {
    let started = Instant::now();
    let mut report = MigrateReport::default();
    let target = regions::other_layout(config.layout);
    for seed in config.seed..config.seed + config.seeds {
        let mut rng = Rng::new(seed);
        let dir = TempDir::new(&format!("{seed}"));
        let original = dir.0.join("original");
        let real = vouch_engine::snapshot::RealFs::new(false);
        write_volume(&real, &original, (config.layout, 4 << 20), &mut rng);
        let expected = read_image(&original).expect("the written volume reads");
        let target = if config.back {
            regions::migrate(
                &original,
                target,
                &OpenOptions::default(),
                &MigrateBreaks::default(),
                |_, _| {},
            )
            .expect("the first migration");
            config.layout
        } else {
            target
        };
        for crash_at in 1.. {
            let work = dir.0.join(format!("at{crash_at}"));
            copy_dir(&original, &work);
            let mut child = Command::new(&config.child);
            child.arg("migrate-child").arg(&work).args([
                "--layout",
                target.name(),
                "--crash-at",
                &crash_at.to_string(),
            ]);
            if config.break_release {
                child.arg("--break-release");
            }
            if config.break_switch {
                child.arg("--break-switch");
            }
            if config.online {
                child.args(["--online", "--seed", &seed.to_string()]);
            }
            if config.break_recopy {
                child.arg("--break-recopy");
            }
            let output = child.output().expect("run vouch-sim migrate-child");
            let finished = output.status.success();
            if !finished && output.status.code().is_some() {
                report.violations.push(format!(
                    "seed {seed} crash at {crash_at}: the migration failed: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                ));
                // It did not crash where asked: the next points would fail
                // the same way (and the walk would never reach its end).
                let _ = std::fs::remove_dir_all(&work);
                let _ = std::fs::remove_file(acked_log(&work));
                break;
            }
            report.images += u64::from(!finished);
            let at = format!("seed {seed} crash at {crash_at}");
            let mut expected = expected.clone();
            if config.online {
                apply_acked(&work, &mut expected);
            }
            let expected = &expected[..];
            if config.reboot && !config.online && !finished {
                // Online, a reboot loses the foreground writes acknowledged
                // but not flushed, which the expected image holds.
                // First (the process image's open puts its held logs back).
                let rebooted = dir.0.join(format!("at{crash_at}-reboot"));
                copy_dir(&work, &rebooted);
                forget_held(&rebooted);
                report.reboot_images += 1;
                let at = format!("{at}, rebooted");
                judge(
                    &mut report,
                    &at,
                    "(held logs gone)",
                    read_image(&rebooted),
                    expected,
                );
                run_again(&mut report, &at, &rebooted, target, expected);
                let _ = std::fs::remove_dir_all(&rebooted);
            }
            judge(
                &mut report,
                &at,
                "after the crash",
                read_image(&work),
                expected,
            );
            // The operator runs it again.
            let again = finished || crash_at % config.again_every.max(1) == 0;
            if again && config.online {
                let again = {
                    open_online(&work).and_then(|volume| {
                        migrate_online(
                            &volume,
                            target,
                            &regions::Steps::new(None),
                            OnlineBreaks::default(),
                        )?;
                        volume.close().map_err(|error| error.to_string())
                    })
                };
                match again {
                    Ok(_) => judge(
                        &mut report,
                        &at,
                        "after running it again",
                        read_image(&work),
                        expected,
                    ),
                    Err(error) => report
                        .violations
                        .push(format!("{at}: running it again failed: {error}")),
                }
            } else if again {
                run_again(&mut report, &at, &work, target, expected);
            }
            let _ = std::fs::remove_dir_all(&work);
            let _ = std::fs::remove_file(acked_log(&work));
            // A broken run is there to be caught: its first violation is
            // enough.
            let broken = config.break_release || config.break_switch || config.break_recopy;
            if finished || (broken && !report.violations.is_empty()) {
                break;
            }
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}
