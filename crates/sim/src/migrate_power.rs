//! `vouch migrate` and the open of a volume with regions under power cuts
//! that drop unsynced writes (`vouch-sim migrate --power`).
//!
//! Every file of the volume, both members' and the region record, and
//! every directory entry is in the model filesystem of `vouch-sim
//! snapshot` (`ModelFs`: a power cut keeps a file's bytes as its last
//! `fsync` left them and a directory's entries as its last directory
//! fsync did, each inode on its own), through `regions::RegionsFs`: the
//! members are engine volumes on `ModelStorage` (each object a file of the
//! model), the record's write and fsync, the member's creation, its
//! rename, the removals and the directory syncs are the model's.
//!
//! Per seed: the volume of `vouch-sim migrate` (one whole region and a
//! part one, written on random data runs, allocated zeroes and trims,
//! closed; with `back`, migrated to the other layout first) is settled
//! (everything durable), then migrated (`regions::migrate_in`) to the
//! other layout (with `back`, back to its own: that ends by making it a
//! one-layout volume again). Right before each of the migration's file
//! operations (its `Steps`: the same crash points as the process crashes
//! of `vouch-sim migrate`) and after it returned, power-cut images are
//! made: nothing unsynced kept, everything issued kept, and `subsets`
//! images keeping a seeded random subset of the unsynced inodes (a file's
//! writes since its fsync, a directory's entries since its sync: a rename
//! not yet made durable is undone in them). Each image is opened as a
//! command opens it and every block read: it must be the volume's data,
//! with no fault (a refused open, a fault, a block of other data: a
//! violation; absence is never emptiness). Then the migration is run
//! again to its end (the operator's retry) and every block read again,
//! and neither member may then hold anything in a region it does not
//! serve.
//!
//! The open's catching up of the record (`RegionVolume::open`: a record
//! newer than the home superblock's `regions_seq` is written again one
//! newer, fsynced, and the superblock updated) is crashed too: wherever
//! the everything-kept image has such a record (a switch cut between the
//! record's fsync and the superblock's update), that image is opened
//! writable with power-cut images made before each of the catching up's
//! steps (the record's write, its fsync, the superblock's update) and
//! after the open returned; each is opened again writable: it must open,
//! read every block as the volume's data, and its superblock's
//! `regions_seq` be the seq of the record that holds.
//!
//! The held logs (memory a process crash keeps) are not modelled: a
//! member here keeps an acknowledged write in its write-back buffer until
//! it commits, so the everything-kept image is a reboot's, and process
//! crashes stay `vouch-sim migrate`'s (real files, a child aborted).
//! Deliberate breaks must be caught: `--break-switch` (the record switched
//! before the new member's flush), `--break-record-sync` (the record not
//! fsynced, when made or at a switch, before the superblock names it),
//! `--break-dir-sync` (the directory syncs of making the volume one with
//! regions skipped: the member's rename and the record's entry not
//! durable before the home's flag), `--break-rewrite-sync` (the open's
//! catching up not fsyncing the record before the superblock's update).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use vouch_engine::regions::{self, Migrate, MigrateBreaks, RegionVolume, RegionsFs, Steps};
use vouch_engine::snapshot::SnapshotFs;
use vouch_engine::storage::objects_of;
use vouch_engine::{CreateOptions, LayoutKind, ObjectId, OpenOptions, SimStorage, Storage, Volume};
use vouch_format::Superblock;

use crate::migrate::{first_difference, nothing_unserved_in, open_in, read_image_in, BLOCKS};
use crate::rng::Rng;
use crate::snapshot::{ModelFs, Recording};

const VOLUME: &str = "/v";
const PAGE: usize = 4096;

/// Breaks of the order, each to be caught.
#[derive(Clone, Copy, Debug, Default)]
pub struct PowerBreaks {
    /// The record switched before the new member is flushed.
    pub switch: bool,
    /// The migration's record not fsynced (when made, at each switch)
    /// before the superblock names it.
    pub record_sync: bool,
    /// The directory syncs of making the volume one with regions skipped.
    pub dir_sync: bool,
    /// The open's catching up not fsyncing the record before the
    /// superblock's update.
    pub rewrite_sync: bool,
}

impl PowerBreaks {
    fn any(&self) -> bool {
        self.switch || self.record_sync || self.dir_sync || self.rewrite_sync
    }

    fn flags(&self) -> String {
        [
            (self.switch, " --break-switch"),
            (self.record_sync, " --break-record-sync"),
            (self.dir_sync, " --break-dir-sync"),
            (self.rewrite_sync, " --break-rewrite-sync"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, flag)| *flag)
        .collect()
    }
}

#[derive(Clone, Debug)]
pub struct PowerConfig {
    /// The layout the volume is created in; it migrates to the other.
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    /// Migrate to the other layout first (uncrashed), then cut the way
    /// back.
    pub back: bool,
    /// Images per crash point keeping a random subset of the unsynced
    /// inodes (besides nothing kept and everything kept).
    pub subsets: u64,
    /// Run the migration again (and judge it) on the images of every Nth
    /// crash point and after it returned (1: at each). Every image is
    /// opened and read whatever this says.
    pub again_every: u64,
    /// Judge the crash points from the migration's `from_point`th
    /// operation on (1: all; a break's test starts near its catch).
    pub from_point: u64,
    pub breaks: PowerBreaks,
}

#[derive(Debug, Default)]
pub struct PowerReport {
    /// The migration's crash points (its steps, and after it returned)
    /// and the images judged at them.
    pub points: u64,
    pub images: u64,
    /// The open's catching up of the record: opens cut, crash points
    /// and images.
    pub rewrites: u64,
    pub rewrite_points: u64,
    pub rewrite_images: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl PowerReport {
    pub fn summary(&self, config: &PowerConfig) -> String {
        let target = regions::other_layout(config.layout);
        format!(
            "migrate --power: layout={} -> {}{}{} seeds={} subsets={} crash points={} images={} record catch-ups={} points={} images={} violations={} time={:.1}s",
            config.layout.name(),
            target.name(),
            if config.back {
                format!(" -> {} (cut on the way back)", config.layout.name())
            } else {
                String::new()
            },
            if config.breaks.any() {
                format!(" BROKEN({})", config.breaks.flags().trim())
            } else {
                String::new()
            },
            config.seeds,
            config.subsets,
            self.points,
            self.images,
            self.rewrites,
            self.rewrite_points,
            self.rewrite_images,
            self.violations.len(),
            self.seconds
        )
    }
}

/// A volume's objects as files of the model, in directory `dir`: written
/// and synced through it (a power cut keeps what `sync` made durable), a
/// missing file an error (never read as empty).
struct ModelStorage {
    fs: Arc<Recording>,
    dir: PathBuf,
}

impl ModelStorage {
    fn path(&self, object: ObjectId) -> PathBuf {
        self.dir.join(object.file_name())
    }
}

impl Storage for ModelStorage {
    fn read_at(&self, object: ObjectId, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let path = self.path(object);
        let fs = self.fs.fs.lock();
        let file = fs.bytes(&path)?;
        let start = (offset as usize).min(file.len());
        let end = (offset as usize + buf.len()).min(file.len());
        buf[..end - start].copy_from_slice(&file[start..end]);
        buf[end - start..].fill(0);
        Ok(())
    }

    fn write_at(&self, object: ObjectId, offset: u64, data: &[u8]) -> io::Result<()> {
        let path = self.path(object);
        self.fs.change("write", &path, |fs| {
            let file = fs.file(&path)?;
            let end = offset as usize + data.len();
            if file.len() < end {
                file.resize(end, 0);
            }
            file[offset as usize..end].copy_from_slice(data);
            Ok(())
        })
    }

    fn sync(&self, object: ObjectId) -> io::Result<()> {
        self.fs.sync_file(&self.path(object))
    }

    fn punch_hole(&self, object: ObjectId, offset: u64, len: u64) -> io::Result<()> {
        let path = self.path(object);
        self.fs.change("punch", &path, |fs| {
            let file = fs.file(&path)?;
            let start = (offset as usize).min(file.len());
            let end = (offset.saturating_add(len) as usize).min(file.len());
            file[start..end].fill(0);
            Ok(())
        })
    }

    /// The first page at or after `offset` holding a non-zero byte: pages
    /// of zeros are holes (they read the same).
    fn next_data(&self, object: ObjectId, offset: u64) -> io::Result<Option<u64>> {
        let path = self.path(object);
        let fs = self.fs.fs.lock();
        let file = fs.bytes(&path)?;
        let mut page = offset as usize / PAGE;
        while page * PAGE < file.len() {
            let end = ((page + 1) * PAGE).min(file.len());
            if file[page * PAGE..end].iter().any(|&byte| byte != 0) {
                return Ok(Some(((page * PAGE) as u64).max(offset)));
            }
            page += 1;
        }
        Ok(None)
    }

    fn allocated_bytes(&self, object: ObjectId) -> io::Result<u64> {
        let path = self.path(object);
        let fs = self.fs.fs.lock();
        Ok(fs.bytes(&path)?.len() as u64)
    }
}

/// The model filesystem as a volume with regions keeps its files there.
#[derive(Clone)]
struct ModelRegions(Arc<Recording>);

impl ModelRegions {
    fn new(fs: ModelFs) -> ModelRegions {
        ModelRegions(Arc::new(Recording::new(fs)))
    }

    fn shared(&self) -> Arc<dyn RegionsFs> {
        Arc::new(self.clone())
    }

    /// The state now.
    fn now(&self) -> ModelFs {
        self.0.fs.lock().clone()
    }
}

fn path_error(
    action: &'static str,
    path: &Path,
    error: impl std::fmt::Display,
) -> vouch_engine::Error {
    vouch_engine::Error::Path {
        action,
        path: path.to_path_buf(),
        cause: error.to_string(),
    }
}

impl RegionsFs for ModelRegions {
    fn open_volume(&self, dir: &Path, options: &OpenOptions) -> vouch_engine::Result<Volume> {
        let superblock = self.superblock(dir)?;
        let geometry = superblock
            .geometry()
            .map_err(|error| path_error("open", dir, error))?;
        // A missing file refuses the open, as `FileStorage` does.
        for object in objects_of(&geometry) {
            let file = dir.join(object.file_name());
            if !self.0.exists(&file) {
                return Err(path_error("open", &file, "no such file"));
            }
        }
        let storage = ModelStorage {
            fs: Arc::clone(&self.0),
            dir: dir.to_path_buf(),
        };
        Volume::open(Arc::new(storage), options)
    }

    /// As `FileStorage::create`: the directory and every object made, the
    /// directory synced, then the volume written.
    fn create_volume(&self, dir: &Path, options: &CreateOptions) -> vouch_engine::Result<Volume> {
        let geometry = vouch_format::Geometry::new(
            options.layout,
            options.size_bytes,
            options.segment_blocks(),
        )
        .map_err(|error| path_error("create", dir, error))?;
        self.0
            .create_dir(dir)
            .map_err(|error| path_error("create", dir, error))?;
        for object in objects_of(&geometry) {
            let file = dir.join(object.file_name());
            self.0
                .new_file(&file, 0, false)
                .map_err(|error| path_error("create", &file, error))?;
        }
        self.0
            .sync_dir(dir)
            .map_err(|error| path_error("sync", dir, error))?;
        let storage = ModelStorage {
            fs: Arc::clone(&self.0),
            dir: dir.to_path_buf(),
        };
        Volume::create(Arc::new(storage), options)
    }

    fn superblock(&self, dir: &Path) -> vouch_engine::Result<Superblock> {
        let file = dir.join(ObjectId::Superblock.file_name());
        let bytes = self
            .0
            .read(&file)
            .map_err(|error| path_error("open", dir, error))?;
        let storage = SimStorage::new();
        storage.overwrite(ObjectId::Superblock, 0, &bytes);
        vouch_engine::read_superblock(&storage)
    }
}

impl SnapshotFs for ModelRegions {
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.0.create_dir(path)
    }
    fn clone_file(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.0.clone_file(from, to)
    }
    fn new_file(&self, path: &Path, len: u64, allocate: bool) -> io::Result<()> {
        self.0.new_file(path, len, allocate)
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.0.read(path)
    }
    fn write_at(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.0.write_at(path, offset, bytes)
    }
    fn sync_file(&self, path: &Path) -> io::Result<()> {
        self.0.sync_file(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.0.sync_dir(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.0.rename(from, to)
    }
    fn remove_all(&self, path: &Path) -> io::Result<()> {
        self.0.remove_all(path)
    }
    fn names(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        self.0.names(dir)
    }
    fn exists(&self, path: &Path) -> bool {
        self.0.exists(path)
    }
    fn set_len(&self, path: &Path, len: u64) -> io::Result<()> {
        self.0.set_len(path, len)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.0.remove_file(path)
    }
}

/// What the images of one seed are judged against, and what they found.
struct Judge {
    config: PowerConfig,
    seed: u64,
    target: LayoutKind,
    expected: Vec<u8>,
    rng: Rng,
    report: PowerReport,
}

impl Judge {
    fn broken(&self) -> bool {
        self.config.breaks.any() && !self.report.violations.is_empty()
    }

    fn violation(&mut self, at: &str, what: String) {
        if self.report.violations.len() < 20 {
            self.report.violations.push(format!(
                "VIOLATION seed {} {at}: {what}\n  replay: cargo run --release -p vouch-sim -- migrate --power --layout {} --seed {} --seeds 1 --subsets {} --again-every {} --from-point {}{}{}",
                self.seed,
                self.config.layout.name(),
                self.seed,
                self.config.subsets,
                self.config.again_every,
                self.config.from_point,
                if self.config.back { " --back" } else { "" },
                self.config.breaks.flags()
            ));
        }
    }

    /// The power-cut images of `fs`: nothing unsynced kept, everything
    /// issued kept, and the subsets.
    fn images(&mut self, fs: &ModelFs) -> Vec<(String, ModelFs)> {
        let mut images = vec![
            ("nothing unsynced kept".to_string(), fs.power_cut(|| false)),
            ("everything issued kept".to_string(), fs.power_cut(|| true)),
        ];
        for subset in 0..self.config.subsets {
            let mut rng = self.rng.fork();
            images.push((
                format!("subset {subset} of the unsynced kept"),
                fs.power_cut(|| rng.chance(1, 2)),
            ));
        }
        images
    }

    /// A crash point of the migration, its state `fs`; `last`: after it
    /// returned.
    fn point(&mut self, at: &str, fs: &ModelFs, last: bool) {
        if self.broken() {
            return;
        }
        self.report.points += 1;
        let again = last
            || self
                .report
                .points
                .is_multiple_of(self.config.again_every.max(1));
        for (kind, image) in self.images(fs) {
            self.report.images += 1;
            let at = format!("{at}, power cut ({kind})");
            if kind == "everything issued kept" {
                self.rewrite_if_behind(&at, &image);
            }
            if let Err(why) = self.judge(image, again) {
                self.violation(&at, why);
            }
        }
    }

    /// One image: opened and read; `again`: migrated again, read again.
    fn judge(&self, image: ModelFs, again: bool) -> Result<(), String> {
        let fs = ModelRegions::new(image).shared();
        let path = Path::new(VOLUME);
        self.same(read_image_in(&fs, path), "after the cut")?;
        if !again {
            return Ok(());
        }
        let none = Steps::new(None);
        let again = Migrate {
            target: self.target,
            options: &OpenOptions::default(),
            breaks: &MigrateBreaks::default(),
            steps: &none,
        };
        regions::migrate_in(Arc::clone(&fs), path, &again, |_, _| {})
            .map_err(|error| format!("running it again failed: {error}"))?;
        self.same(read_image_in(&fs, path), "after running it again")?;
        nothing_unserved_in(&fs, path).map_err(|why| format!("after running it again: {why}"))?;
        agree(&fs, path).map_err(|why| format!("after running it again: {why}"))
    }

    fn same(&self, image: Result<Vec<u8>, String>, when: &str) -> Result<(), String> {
        let image = image.map_err(|why| format!("{when}: {why}"))?;
        match first_difference(&image, &self.expected) {
            Some(lba) => Err(format!("{when}: LBA {lba} differs from what was written")),
            None => Ok(()),
        }
    }

    /// Where `image` has a record newer than its superblock's
    /// `regions_seq`: the open that catches it up, cut at each step.
    fn rewrite_if_behind(&mut self, at: &str, image: &ModelFs) {
        let fs = ModelRegions::new(image.clone());
        let path = Path::new(VOLUME);
        let Ok(superblock) = fs.superblock(path) else {
            return;
        };
        if !regions::has_regions(&superblock) {
            return;
        }
        let Ok(record) = regions::read_record_in(&fs, path, &superblock) else {
            return;
        };
        if record.seq <= superblock.regions_seq {
            return;
        }
        self.report.rewrites += 1;
        let points: Arc<Mutex<Vec<(String, ModelFs)>>> = Arc::default();
        let hook = {
            let (fs, points) = (fs.clone(), Arc::clone(&points));
            Box::new(move |_locked: bool| {
                let mut points = points.lock();
                let step = points.len() + 1;
                points.push((format!("before its step {step}"), fs.now()));
            })
        };
        let steps = Steps::with_hook(None, hook);
        let breaks = MigrateBreaks {
            skip_record_sync: self.config.breaks.rewrite_sync,
            ..MigrateBreaks::default()
        };
        let opened =
            RegionVolume::open_in(fs.shared(), path, &OpenOptions::default(), &steps, &breaks)
                .map_err(|error| error.to_string())
                .and_then(|volume| volume.close().map_err(|error| error.to_string()));
        drop(steps);
        if let Err(why) = opened {
            self.violation(at, format!("the open catching the record up failed: {why}"));
            return;
        }
        let mut points = std::mem::take(&mut *points.lock());
        points.push(("after it returned".to_string(), fs.now()));
        for (when, state) in points {
            if self.broken() {
                return;
            }
            self.report.rewrite_points += 1;
            for (kind, cut) in self.images(&state) {
                self.report.rewrite_images += 1;
                if let Err(why) = self.reopened(cut) {
                    self.violation(
                        at,
                        format!("the open catching the record up, cut {when} ({kind}): {why}"),
                    );
                }
            }
        }
    }

    /// An image of the open's catching up, opened again writable (which
    /// catches up itself where it must): every block the volume's, the
    /// superblock and the record agreeing.
    fn reopened(&self, image: ModelFs) -> Result<(), String> {
        let fs = ModelRegions::new(image).shared();
        let path = Path::new(VOLUME);
        let volume = open_in(&fs, path, &OpenOptions::default())
            .map_err(|why| format!("opened again: {why}"))?;
        let mut image = vec![0u8; self.expected.len()];
        let faults = volume
            .read_blocks_collecting(0, BLOCKS, &mut image)
            .map_err(|error| format!("read: {error}"));
        volume.close().map_err(|error| format!("close: {error}"))?;
        let faults = faults?;
        if let Some(fault) = faults.first() {
            return Err(format!("{} faults, the first {fault}", faults.len()));
        }
        self.same(Ok(image), "opened again")?;
        agree(&fs, path)
    }
}

/// The home superblock's `regions_seq` is the seq of the record that
/// holds (a volume with regions).
fn agree(fs: &Arc<dyn RegionsFs>, path: &Path) -> Result<(), String> {
    let superblock = fs.superblock(path).map_err(|error| error.to_string())?;
    if !regions::has_regions(&superblock) {
        return Ok(());
    }
    let record =
        regions::read_record_in(&**fs, path, &superblock).map_err(|error| error.to_string())?;
    if record.seq != superblock.regions_seq {
        return Err(format!(
            "the superblock's regions_seq is {}, the record's seq {}",
            superblock.regions_seq, record.seq
        ));
    }
    Ok(())
}

pub fn run(config: &PowerConfig) -> PowerReport {
    let started = Instant::now();
    let mut total = PowerReport::default();
    for seed in config.seed..config.seed + config.seeds {
        let report = run_seed(config, seed);
        total.points += report.points;
        total.images += report.images;
        total.rewrites += report.rewrites;
        total.rewrite_points += report.rewrite_points;
        total.rewrite_images += report.rewrite_images;
        total.violations.extend(report.violations);
        if config.breaks.any() && !total.violations.is_empty() {
            break;
        }
    }
    total.seconds = started.elapsed().as_secs_f64();
    total
}

fn run_seed(config: &PowerConfig, seed: u64) -> PowerReport {
    let mut rng = Rng::new(seed);
    let path = Path::new(VOLUME);
    let made = ModelRegions::new(ModelFs::new());
    crate::migrate::write_volume(&made, path, (config.layout, 1 << 20), &mut rng);
    let expected = read_image_in(&made.shared(), path).expect("the written volume reads");
    let other = regions::other_layout(config.layout);
    let target = if config.back {
        let none = Steps::new(None);
        let first = Migrate {
            target: other,
            options: &OpenOptions::default(),
            breaks: &MigrateBreaks::default(),
            steps: &none,
        };
        regions::migrate_in(made.shared(), path, &first, |_, _| {}).expect("the first migration");
        config.layout
    } else {
        other
    };
    // Closed long ago: everything durable.
    let fs = ModelRegions::new(made.now().power_cut(|| true));
    let judge = Arc::new(Mutex::new(Judge {
        config: config.clone(),
        seed,
        target,
        expected,
        rng: rng.fork(),
        report: PowerReport::default(),
    }));
    let hook = {
        let (fs, judge) = (fs.clone(), Arc::clone(&judge));
        let step = std::sync::atomic::AtomicU64::new(0);
        let from_point = config.from_point;
        Box::new(move |_locked: bool| {
            let step = step.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if step < from_point {
                return;
            }
            let state = fs.now();
            judge
                .lock()
                .point(&format!("before operation {step}"), &state, false);
        })
    };
    let steps = Steps::with_hook(None, hook);
    let breaks = MigrateBreaks {
        switch_before_flush: config.breaks.switch,
        skip_record_sync: config.breaks.record_sync,
        skip_dir_sync: config.breaks.dir_sync,
        ..MigrateBreaks::default()
    };
    let how = Migrate {
        target,
        options: &OpenOptions::default(),
        breaks: &breaks,
        steps: &steps,
    };
    let migrated = regions::migrate_in(fs.shared(), path, &how, |_, _| {});
    drop(steps);
    let mut judge = Arc::try_unwrap(judge)
        .unwrap_or_else(|_| panic!("the hook is gone"))
        .into_inner();
    match migrated {
        Ok(_) => judge.point("after it returned", &fs.now(), true),
        Err(error) => judge.violation("", format!("the migration failed: {error}")),
    }
    judge.report
}
