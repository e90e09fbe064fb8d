//! The online `snapshot create` of a served volume with regions, taken
//! while its region moves between the members (`vouch-sim snapshot-online
//! --regions`).
//!
//! Per seed: a small volume (`faults::BLOCKS` blocks, one region) written
//! on random data in the given layout and closed, then opened as `serve
//! --migratable` opens it (a volume with regions, every region home). Its
//! region is moved online to the other layout and back
//! (`RegionVolume::migrate_online_driven`), a foreground write arriving
//! before about one step in two (none while the region's lock is held
//! exclusive), so each member holds acknowledged writes in its buffer,
//! journal or files. At one step of the two moves, drawn by the seed (or
//! after them, when the moves took fewer steps), the online snapshot is
//! taken as the control API takes it: each member checkpointed now
//! (`RegionVolume::checkpoint_now`), then `snapshot::create_from` with the
//! `RegionVolume` as its flush point (region switches paused, both
//! members held, their files and the record cloned, synced, published);
//! the data it must hold is every write acknowledged before it. The
//! volume's files are real files (read live, as the page cache holds
//! them); `snapshots/` is the model filesystem of `vouch-sim snapshot`.
//!
//! Before every file operation of the create (the clones under the hold,
//! the syncs, the publishing rename), three crash images of `snapshots/`
//! are taken: a process crash, a power cut keeping nothing unsynced, one
//! keeping a random subset. On each image, after the tidy the next
//! command does: nothing half made is left; a snapshot that has its name
//! is complete: written out to real files it opens through its region
//! layer read-only, reads every block as the volume was at the flush
//! point, no fault, and each member's `check` finds nothing; after the
//! create returned, it has its name. The volume itself is not crashed
//! here: its writes and the migration are `vouch-sim migrate --online`'s,
//! a one-layout volume's online snapshot `vouch-sim snapshot-online`'s.
//!
//! `--break-home-only` (the flush point of the home member alone, as the
//! control API had it before: the other member's files cloned while it
//! buffers, without a checkpoint) must be caught.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::regions::{self, OnlineBreaks, OnlineMigrate, RegionVolume};
use vouch_engine::snapshot::{self, FlushPoint, SnapshotBreaks};
use vouch_engine::{BlockDevice, CreateOptions, LayoutKind, OpenOptions};
use vouch_format::Superblock;

use crate::faults::BLOCKS;
use crate::migrate::TempDir;
use crate::rng::Rng;
use crate::snapshot::{Findings, ModelFs, Node, Recording, SnapshotReport};
use crate::snapshot_online::{ServedFs, VolumeFiles};
use crate::BLOCK;

const VOLUME: &str = "/v";
const NAME: &str = "s1";
const BLOCK_U64: u64 = BLOCK as u64;

#[derive(Clone, Debug)]
pub struct RegionsOnlineConfig {
    /// The volume's home layout; its region moves to the other and back.
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    pub breaks: SnapshotBreaks,
    /// Break on purpose: hold only the home member at the flush point.
    pub break_home_only: bool,
}

/// What the seeds found, and where their snapshots were taken.
#[derive(Debug, Default)]
pub struct RegionsOnlineReport {
    pub report: SnapshotReport,
    /// Snapshots taken while the region was in the other member, and
    /// while a move had copied some of it and not switched.
    pub taken_away: u64,
    pub taken_mid_move: u64,
}

pub fn summary(online: &RegionsOnlineReport, config: &RegionsOnlineConfig) -> String {
    let report = &online.report;
    format!(
        "snapshot-online --regions: layout={}{}{} seeds={} taken with the region away={} mid-move={} crash points={} images={} violations={} time={:.1}s",
        config.layout.name(),
        if config.breaks.publish_before_sync {
            " BROKEN(publish before sync)"
        } else {
            ""
        },
        if config.break_home_only {
            " BROKEN(the home member's flush point only)"
        } else {
            ""
        },
        config.seeds,
        online.taken_away,
        online.taken_mid_move,
        report.points,
        report.images,
        report.violations.len(),
        report.seconds
    )
}

pub fn run(config: &RegionsOnlineConfig) -> RegionsOnlineReport {
    let flag = match (config.breaks.publish_before_sync, config.break_home_only) {
        (true, _) => "--regions --break-publish",
        (false, true) => "--regions --break-home-only",
        _ => "--regions",
    };
    let mut online = RegionsOnlineReport::default();
    let (mut away, mut mid) = (0, 0);
    online.report = crate::snapshot::run_seeds(
        ("snapshot-online", config.layout, Some(flag)),
        config.seed..config.seed + config.seeds,
        |seed, report| run_seed(config, seed, report, (&mut away, &mut mid)),
    );
    online.taken_away = away;
    online.taken_mid_move = mid;
    online
}

/// The files of a served volume with regions (anything under `/v` but
/// `snapshots/`): the real files of the volume at `real`.
struct RealFiles {
    real: PathBuf,
}

impl RealFiles {
    fn real_path(&self, path: &Path) -> Option<PathBuf> {
        let relative = path.strip_prefix(VOLUME).ok()?;
        if relative.as_os_str().is_empty() || relative.starts_with(snapshot::SNAPSHOTS_DIR) {
            return None;
        }
        Some(self.real.join(relative))
    }
}

impl VolumeFiles for RealFiles {
    fn owns(&self, path: &Path) -> bool {
        self.real_path(path).is_some()
    }
    fn live(&self, path: &Path) -> io::Result<Vec<u8>> {
        match self.real_path(path) {
            Some(real) => std::fs::read(real),
            None => Err(io::Error::from(io::ErrorKind::NotFound)),
        }
    }
    fn exists(&self, path: &Path) -> bool {
        self.real_path(path)
            .is_some_and(|real| real.symlink_metadata().is_ok())
    }
}

/// The break: the home member's flush point alone (the other member's
/// files cloned as they are), claiming to cover both.
struct HomeOnly<'a>(&'a RegionVolume);

impl FlushPoint for HomeOnly<'_> {
    fn at_flush_point(
        &self,
        clone: &mut dyn FnMut(&Superblock) -> vouch_engine::Result<()>,
    ) -> vouch_engine::Result<()> {
        self.0.home().at_flush_point(clone)
    }
    fn online(&self) -> bool {
        true
    }
    fn covers_regions(&self) -> bool {
        true
    }
}

/// What the images are judged against.
#[derive(Clone, Default)]
struct Taken {
    /// The volume's data at the create's flush point, once it started.
    snapshot: Option<Vec<u8>>,
    /// The create returned.
    done: bool,
}

/// The seed's served volume, its acknowledged data and its snapshot.
struct Served {
    volume: Arc<RegionVolume>,
    real: PathBuf,
    scratch: PathBuf,
    home: LayoutKind,
    /// Every block's last acknowledged data.
    image: Mutex<Vec<u8>>,
    rng: Mutex<Rng>,
    taken: Arc<Mutex<Taken>>,
    /// The step the snapshot is taken at, and the steps so far.
    at_step: u64,
    steps: Mutex<u64>,
    config: RegionsOnlineConfig,
    /// The snapshot's outcome, once taken: crash points and images,
    /// the first violation.
    outcome: Mutex<Option<Result<(), String>>>,
    findings: Findings,
    report: Mutex<SnapshotReport>,
    /// Where the region was when the snapshot was taken: away from home;
    /// mid-move (a move started, not switched).
    placement: Mutex<(bool, bool)>,
    /// The layout a running move moves the region from.
    moving_from: Mutex<Option<LayoutKind>>,
}

impl Served {
    /// A foreground write of a random run, acknowledged into `image`.
    fn write(&self) -> Result<(), String> {
        let mut rng = self.rng.lock();
        let count = rng.range(1, 9);
        let lba = rng.below(BLOCKS - count);
        let data = rng.bytes((count * BLOCK_U64) as usize);
        drop(rng);
        self.volume
            .write(lba * BLOCK_U64, &data, false)
            .map_err(|e| format!("a foreground write: {e}"))?;
        let from = (lba * BLOCK_U64) as usize;
        self.image.lock()[from..from + data.len()].copy_from_slice(&data);
        Ok(())
    }

    /// A step of a move (`locked`: the region's lock is held exclusive,
    /// where a request would wait): a write, maybe; the snapshot, at its
    /// step.
    fn step(&self, locked: bool) {
        if locked {
            return;
        }
        let step = {
            let mut steps = self.steps.lock();
            *steps += 1;
            *steps
        };
        if self.rng.lock().chance(1, 2) {
            if let Err(error) = self.write() {
                self.outcome.lock().get_or_insert(Err(error));
                return;
            }
        }
        if step == self.at_step {
            self.snapshot();
        }
    }

    /// Take the snapshot now (once), as the control API does.
    fn snapshot(&self) {
        if self.outcome.lock().is_some() {
            return;
        }
        let now = self.volume.layout_of(0);
        *self.placement.lock() = (now != self.home, *self.moving_from.lock() == Some(now));
        let result = self.create();
        let mut report = self.report.lock();
        let ended = self.findings.end(&mut report);
        *self.outcome.lock() = Some(result.and(ended));
    }

    fn create(&self) -> Result<(), String> {
        let fs = ServedFs {
            volume: RealFiles {
                real: self.real.clone(),
            },
            model: std::sync::Arc::new(Recording::new({
                let mut fs = ModelFs::new();
                fs.put_dir(Path::new(VOLUME));
                fs.sync_all_dirs();
                fs
            })),
        };
        {
            let taken = self.taken.clone();
            let scratch = self.scratch.clone();
            let member = regions::member_path(Path::new(""), self.home);
            let rng = self.rng.lock().fork();
            *fs.model.hook.lock() = Some(self.findings.hook(rng, move |image| {
                let taken = taken.lock().clone();
                verify(image, &taken, &member, &scratch)
            }));
        }
        // Nothing else writes while the create runs (this thread is the
        // writer): the data at its flush point is what was acknowledged.
        self.taken.lock().snapshot = Some(self.image.lock().clone());
        let home_only = HomeOnly(&self.volume);
        let point: &dyn FlushPoint = if self.config.break_home_only {
            self.volume
                .home()
                .checkpoint_now()
                .map_err(|e| format!("checkpoint: {e}"))?;
            &home_only
        } else {
            self.volume
                .checkpoint_now()
                .map_err(|e| format!("checkpoint: {e}"))?;
            &*self.volume
        };
        snapshot::create_from(
            &fs,
            Path::new(VOLUME),
            NAME,
            "reflink",
            self.config.breaks,
            point,
        )
        .map_err(|e| format!("create failed: {e}"))?;
        *fs.model.hook.lock() = None;
        self.taken.lock().done = true;
        let after = fs.model.fs.lock().clone();
        let taken = self.taken.lock().clone();
        let member = regions::member_path(Path::new(""), self.home);
        verify(after, &taken, &member, &self.scratch).map_err(|e| format!("after the create: {e}"))
    }
}

fn run_seed(
    config: &RegionsOnlineConfig,
    seed: u64,
    report: &mut SnapshotReport,
    (away, mid): (&mut u64, &mut u64),
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let temp = TempDir::new(&format!("snapshot-online-regions-{seed}"));
    let real = temp.0.join("v");
    let options = CreateOptions {
        layout: config.layout,
        journal_bytes: Some(1 << 20),
        ..CreateOptions::new(BLOCKS * BLOCK_U64)
    };
    let volume =
        vouch_engine::create_volume(&real, &options).map_err(|e| format!("create: {e}"))?;
    let mut image = vec![0u8; (BLOCKS * BLOCK_U64) as usize];
    for _ in 0..10 {
        let count = rng.range(1, 24);
        let lba = rng.below(BLOCKS - count);
        let data = rng.bytes((count * BLOCK_U64) as usize);
        volume
            .write(lba * BLOCK_U64, &data, false)
            .map_err(|e| format!("write: {e}"))?;
        let from = (lba * BLOCK_U64) as usize;
        image[from..from + data.len()].copy_from_slice(&data);
    }
    volume.close().map_err(|e| format!("close: {e}"))?;
    // Served as `serve --migratable` opens it: made a volume with regions.
    let home = vouch_engine::open_volume(&real, &OpenOptions::default())
        .map_err(|e| format!("open: {e}"))?;
    let volume = regions::open_served(&real, home, &OpenOptions::default())
        .map_err(|e| format!("open with regions: {e}"))?;
    let served = Arc::new(Served {
        volume: Arc::new(volume),
        real: real.clone(),
        scratch: temp.0.join("image"),
        home: config.layout,
        image: Mutex::new(image),
        at_step: rng.range(1, 60),
        rng: Mutex::new(rng.fork()),
        taken: Arc::default(),
        steps: Mutex::new(0),
        config: config.clone(),
        outcome: Mutex::new(None),
        findings: Findings::default(),
        report: Mutex::new(SnapshotReport::default()),
        placement: Mutex::new((false, false)),
        moving_from: Mutex::new(None),
    });
    for _ in 0..rng.range(2, 8) {
        served.write()?;
    }
    let hook_served = Arc::clone(&served);
    let steps = regions::Steps::with_hook(None, Box::new(move |locked| hook_served.step(locked)));
    let stop = AtomicBool::new(false);
    for target in [regions::other_layout(config.layout), config.layout] {
        let how = OnlineMigrate {
            target,
            rate: None,
            stop: &stop,
        };
        *served.moving_from.lock() = Some(served.volume.layout_of(0));
        served
            .volume
            .migrate_online_driven(&how, &steps, OnlineBreaks::default(), |_, _| {})
            .map_err(|e| format!("migrate to {}: {e}", target.name()))?;
        *served.moving_from.lock() = None;
        for _ in 0..rng.range(1, 4) {
            served.write()?;
        }
    }
    drop(steps);
    if served.outcome.lock().is_none() {
        // The moves took fewer steps: the snapshot after them.
        served.snapshot();
    }
    let outcome = served
        .outcome
        .lock()
        .take()
        .expect("the snapshot was taken");
    let (was_away, was_mid) = *served.placement.lock();
    *away += u64::from(was_away);
    *mid += u64::from(was_mid);
    let seed_report = std::mem::take(&mut *served.report.lock());
    report.points += seed_report.points;
    report.images += seed_report.images;
    // The volume kept every acknowledged write through it all.
    let want = served.image.lock().clone();
    let served = Arc::try_unwrap(served).map_err(|_| "the volume is still shared".to_string())?;
    let volume =
        Arc::try_unwrap(served.volume).map_err(|_| "the volume is still shared".to_string())?;
    let mut now = vec![0u8; want.len()];
    volume
        .read(0, &mut now)
        .map_err(|e| format!("read the volume: {e}"))?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    outcome?;
    if let Some(lba) = first_difference(&now, &want) {
        return Err(format!("the volume: LBA {lba} lost its acknowledged data"));
    }
    Ok(())
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<u64> {
    a.chunks(BLOCK)
        .zip(b.chunks(BLOCK))
        .position(|(x, y)| x != y)
        .map(|lba| lba as u64)
}

/// Write every file under `dir` of `fs` to `to` (directories made).
fn write_out(fs: &mut ModelFs, dir: &Path, to: &Path) -> Result<(), String> {
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    let names = match fs.lookup(dir).map(|id| &fs.nodes[id]) {
        Some(Node::Dir { live, .. }) => live.keys().cloned().collect::<Vec<_>>(),
        _ => return Err(format!("{} is no directory", dir.display())),
    };
    for name in names {
        let path = dir.join(&name);
        let is_dir = matches!(
            fs.lookup(&path).map(|id| &fs.nodes[id]),
            Some(Node::Dir { .. })
        );
        if is_dir {
            write_out(fs, &path, &to.join(&name))?;
        } else {
            let bytes = fs
                .file(&path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            std::fs::write(to.join(&name), bytes).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// One crash image of `snapshots/` (or the end state), judged.
fn verify(fs: ModelFs, taken: &Taken, member: &Path, scratch: &Path) -> Result<(), String> {
    let volume = Path::new(VOLUME);
    let mut fs = crate::snapshot::tidied(fs, volume)?;
    let path = snapshot::snapshot_path(volume, NAME);
    if fs.lookup(&path).is_none() {
        if taken.done {
            return Err("the create returned but its snapshot is gone".into());
        }
        return Ok(());
    }
    let Some(want) = &taken.snapshot else {
        return Err("a snapshot has its name before the create reached its flush point".into());
    };
    crate::snapshot::listed_one(&fs, volume)?;
    let _ = std::fs::remove_dir_all(scratch);
    write_out(&mut fs, &path, scratch)?;
    if !scratch.join(member).join("superblock").exists() {
        return Err(format!("the snapshot has no member {}", member.display()));
    }
    let snap = RegionVolume::open(scratch, &OpenOptions::default())
        .map_err(|e| format!("the snapshot: open: {e}"))?;
    if !BlockDevice::is_read_only(&snap) {
        return Err("the snapshot opened writable".into());
    }
    let mut image = vec![0u8; want.len()];
    let faults = snap
        .read_blocks_collecting(0, BLOCKS, &mut image)
        .map_err(|e| format!("the snapshot: read: {e}"))?;
    if let Some(fault) = faults.first() {
        return Err(format!(
            "the snapshot: {} faults, the first {fault}",
            faults.len()
        ));
    }
    if let Some(lba) = first_difference(&image, want) {
        return Err(format!(
            "the snapshot: LBA {lba} is not its data at the flush point"
        ));
    }
    for layout in LayoutKind::ALL {
        let check = snap
            .member(layout)
            .check(|_, _| {})
            .map_err(|e| format!("the snapshot: check: {e}"))?;
        if let Some(fault) = check.faults.first() {
            return Err(format!(
                "the snapshot: check of its {} member found {} faults, the first {fault:?}",
                layout.name(),
                check.faults.len()
            ));
        }
    }
    snap.close()
        .map_err(|e| format!("the snapshot: close: {e}"))
}
