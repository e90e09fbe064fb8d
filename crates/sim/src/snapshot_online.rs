//! The online `snapshot create` (control API `/v1/exports/{export}/snapshots`)
//! crashed at every file operation (`vouch-sim snapshot-online`).
//!
//! Per seed: a volume written and closed (`snapshot::written_volume`) is
//! opened as `serve` opens it (the background committer, stepped by the
//! seed; a write-back buffer of 2-11 blocks) and written on: writes, some
//! on the inline route, zeroes and trims, a flush now and then, so when
//! the create starts some writes are flushed and some only acknowledged
//! (in the buffer and the held log). Then the engine's own
//! `snapshot::create_from` runs with the served volume as its flush point,
//! as `vouch serve` runs it (`checkpoint_now`, a few more writes, then
//! `Volume::at_flush_point` and the clones under it, writes on the inline
//! route admitted while it is held), then the syncs and the publishing
//! rename. The volume's files are the simulator's `SimStorage` (a power
//! cut keeps what was synced; a process crash keeps everything issued and
//! the held log), `snapshots/` is the model filesystem of `vouch-sim
//! snapshot` (`ModelFs`); a clone copies a volume file's live bytes,
//! durable only once synced.
//!
//! Right before every write, punch and sync of the volume (the flush
//! point's commit and checkpoint, the held log's appends) and every file
//! operation of the create, three crash images are taken: a process crash
//! (everything issued kept, the held log too), a power cut that loses
//! everything not synced, and one that keeps a random subset of the
//! unsynced writes and inodes. On each image, after the tidy the next
//! command does:
//!
//! - the volume opens writable and every block reads its last acknowledged
//!   data (process crash) or its last flushed data or a later acknowledged
//!   one (power cut); `check` finds nothing;
//! - a snapshot that has its name holds exactly the data acknowledged
//!   before the create's flush point (not the writes admitted while it was
//!   held), opens read-only and `check` finds nothing; before the flush
//!   point, no snapshot has the name; after the create returned, it has;
//! - nothing half made is left in `snapshots/`;
//! - the create run again on the recovered volume (online) succeeds, or
//!   says the snapshot exists, and the snapshot it makes holds what the
//!   volume reads.
//!
//! Two deliberate breaks must be caught: `--break-publish` (the name
//! published before the clones are synced: `SnapshotBreaks`) and
//! `--break-outside` (the clones taken outside the flush point: no commit,
//! no checkpoint, the volume's files as they are).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::snapshot::{self, FlushPoint, SnapshotBreaks, SnapshotFs};
use vouch_engine::storage::objects_of;
use vouch_engine::{BlockDevice, LayoutKind, ObjectId, SimStorage, Storage, Volume, ZeroFlags};
use vouch_format::{Geometry, Superblock};

use crate::faults::BLOCKS;
use crate::recorder::{crash_image, Recorder, Strategy};
use crate::rng::Rng;
use crate::snapshot::{ModelFs, Recording, SnapshotReport};
use crate::BLOCK;

#[derive(Clone, Debug)]
pub struct OnlineConfig {
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    pub breaks: SnapshotBreaks,
    /// Break on purpose: clone the files outside the flush point.
    pub break_outside: bool,
}

/// What the seeds found: the snapshot simulator's report, and how many
/// writes were admitted while the volume was held at its flush point.
#[derive(Debug, Default)]
pub struct OnlineReport {
    pub report: SnapshotReport,
    pub held_writes: u64,
}

/// The summary line of `report` for `config`.
pub fn summary(online: &OnlineReport, config: &OnlineConfig) -> String {
    let report = &online.report;
    format!(
        "snapshot-online: layout={}{}{} seeds={} writes-while-held={} crash points={} images={} violations={} time={:.1}s",
        config.layout.name(),
        if config.breaks.publish_before_sync {
            " BROKEN(publish before sync)"
        } else {
            ""
        },
        if config.break_outside {
            " BROKEN(clone outside the flush point)"
        } else {
            ""
        },
        config.seeds,
        online.held_writes,
        report.points,
        report.images,
        report.violations.len(),
        report.seconds
    )
}

pub(crate) const VOLUME: &str = "/v";
pub(crate) const NAME: &str = "s1";

pub fn run(config: &OnlineConfig) -> OnlineReport {
    let flag = match (config.breaks.publish_before_sync, config.break_outside) {
        (true, _) => Some("--break-publish"),
        (false, true) => Some("--break-outside"),
        _ => None,
    };
    let mut held_writes = 0;
    let report = crate::snapshot::run_seeds(
        ("snapshot-online", config.layout, flag),
        config.seed..config.seed + config.seeds,
        |seed, report| run_seed(config, seed, report, &mut held_writes),
    );
    OnlineReport {
        report,
        held_writes,
    }
}

/// What the images are judged against, kept as the volume is written.
#[derive(Clone)]
pub(crate) struct State {
    /// Every block's last acknowledged data (a process crash keeps it).
    pub(crate) acked: Vec<Vec<u8>>,
    /// Every block's last flushed data and each issued since (a power cut
    /// may leave any of them).
    pub(crate) allowed: Vec<Vec<Vec<u8>>>,
    /// The blocks of the write being issued: not acknowledged yet, so a
    /// crash may keep them or not.
    pub(crate) pending: BTreeMap<u64, Vec<u8>>,
    /// The data at the create's flush point, once it was reached.
    pub(crate) snapshot: Option<Vec<Vec<u8>>>,
    /// The create returned.
    pub(crate) done: bool,
}

impl State {
    pub(crate) fn new(model: Vec<Vec<u8>>) -> State {
        State {
            allowed: model.iter().map(|data| vec![data.clone()]).collect(),
            acked: model,
            pending: BTreeMap::new(),
            snapshot: None,
            done: false,
        }
    }

    /// Block `lba` is being written with `data`.
    pub(crate) fn issuing(&mut self, lba: u64, data: Vec<u8>) {
        self.allowed[lba as usize].push(data.clone());
        self.pending.insert(lba, data);
    }

    /// The writes issued are acknowledged.
    pub(crate) fn acknowledged(&mut self) {
        for (lba, data) in std::mem::take(&mut self.pending) {
            self.acked[lba as usize] = data;
        }
    }

    /// Everything acknowledged is durable now.
    pub(crate) fn flushed(&mut self) {
        for (allowed, acked) in self.allowed.iter_mut().zip(&self.acked) {
            *allowed = vec![acked.clone()];
        }
    }

    /// Does `read` keep block `lba`'s acknowledged data (`process`: a
    /// crash of the process), or its flushed data (a power cut)?
    pub(crate) fn keeps(&self, lba: usize, read: &[u8], process: bool) -> bool {
        if process {
            self.acked[lba] == read || self.pending.get(&(lba as u64)).is_some_and(|p| p == read)
        } else {
            self.allowed[lba].iter().any(|data| data == read)
        }
    }
}

/// A served volume's own files, read live (what the page cache holds) and
/// never written by a snapshot.
pub(crate) trait VolumeFiles: Send + Sync {
    /// Is `path` one of the volume's files (not the model filesystem's)?
    fn owns(&self, path: &Path) -> bool;
    /// The bytes of the volume's file at `path` now.
    fn live(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Does the volume's file at `path` (one it `owns`) exist?
    fn exists(&self, path: &Path) -> bool;
}

/// The volume's files of this simulator: `/v/NAME` for each of its
/// objects, in its `SimStorage`.
pub(crate) struct SimFiles {
    sim: SimStorage,
    files: BTreeMap<PathBuf, ObjectId>,
}

impl VolumeFiles for SimFiles {
    fn owns(&self, path: &Path) -> bool {
        self.files.contains_key(path)
    }
    fn live(&self, path: &Path) -> io::Result<Vec<u8>> {
        match self.files.get(path) {
            Some(object) => Ok(self.sim.object_bytes(*object)),
            None => Err(io::Error::from(io::ErrorKind::NotFound)),
        }
    }
    fn exists(&self, path: &Path) -> bool {
        self.owns(path)
    }
}

/// `SnapshotFs` over a served volume: its files (`V`) read live, never
/// written; everything else (`snapshots/`) is the model filesystem.
pub(crate) struct ServedFs<V> {
    pub(crate) volume: V,
    pub(crate) model: Arc<Recording>,
}

impl ServedFs<SimFiles> {
    pub(crate) fn new(sim: SimStorage, geometry: &Geometry, fs: ModelFs) -> ServedFs<SimFiles> {
        let files = objects_of(geometry)
            .into_iter()
            .map(|object| (Path::new(VOLUME).join(object.file_name()), object))
            .collect();
        ServedFs {
            volume: SimFiles { sim, files },
            model: Arc::new(Recording::new(fs)),
        }
    }
}

fn not_written(path: &Path) -> io::Error {
    io::Error::other(format!(
        "{}: a snapshot never changes the volume's files",
        path.display()
    ))
}

impl<V: VolumeFiles> ServedFs<V> {
    /// `Err` for a file of the volume, which a snapshot never changes.
    fn model_only(&self, path: &Path) -> io::Result<()> {
        match self.volume.owns(path) {
            true => Err(not_written(path)),
            false => Ok(()),
        }
    }
}

impl<V: VolumeFiles> SnapshotFs for ServedFs<V> {
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.model.create_dir(path)
    }
    fn clone_file(&self, from: &Path, to: &Path) -> io::Result<()> {
        if !self.volume.owns(from) {
            return self.model.clone_file(from, to);
        }
        let bytes = self.volume.live(from)?;
        self.model
            .change("clone", to, |fs| fs.put_unsynced(to, bytes))
    }
    fn warm_file(&self, from: &Path, to: &Path) -> io::Result<bool> {
        if !self.volume.owns(from) {
            return self.model.warm_file(from, to);
        }
        // The file as the volume's writes leave it now, not at a flush
        // point: the clone at the flush point must replace every byte.
        let bytes = self.volume.live(from)?;
        self.model
            .change("warm", to, |fs| fs.put_unsynced(to, bytes))
            .map(|()| true)
    }
    fn new_file(&self, path: &Path, len: u64, allocate: bool) -> io::Result<()> {
        self.model.new_file(path, len, allocate)
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        match self.volume.owns(path) {
            true => self.volume.live(path),
            false => self.model.read(path),
        }
    }
    fn write_at(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.model_only(path)?;
        self.model.write_at(path, offset, bytes)
    }
    fn sync_file(&self, path: &Path) -> io::Result<()> {
        self.model_only(path)?;
        self.model.sync_file(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.model.sync_dir(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.model_only(from)?;
        self.model_only(to)?;
        self.model.rename(from, to)
    }
    fn remove_all(&self, path: &Path) -> io::Result<()> {
        self.model_only(path)?;
        self.model.remove_all(path)
    }
    fn names(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        self.model.names(dir)
    }
    fn exists(&self, path: &Path) -> bool {
        match self.volume.owns(path) {
            true => self.volume.exists(path),
            false => self.model.exists(path),
        }
    }
    fn set_len(&self, path: &Path, len: u64) -> io::Result<()> {
        self.model_only(path)?;
        self.model.set_len(path, len)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.model_only(path)?;
        self.model.remove_file(path)
    }
    fn open_log(
        &self,
        path: &Path,
    ) -> io::Result<Box<dyn vouch_engine::storage::before::BeforeLog>> {
        self.model_only(path)?;
        Ok(Box::new(crate::snapshot::ModelLog::open(
            &self.model,
            path,
        )?))
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        match self.volume.owns(path) {
            true => self.volume.live(path).map(|bytes| bytes.len() as u64),
            false => self.model.file_len(path),
        }
    }
}

/// Write on the served volume as a client would: one to four blocks of
/// random data (on the inline route one time in two), or zeroes, or a
/// trim; each acknowledged into `state`.
pub(crate) fn client_op(
    volume: &Volume,
    state: &Mutex<State>,
    rng: &mut Rng,
) -> vouch_engine::Result<()> {
    let count = rng.range(1, 5);
    let lba = rng.below(BLOCKS - count);
    let offset = lba * BLOCK as u64;
    let len = count * BLOCK as u64;
    let zeros = vec![0u8; BLOCK];
    match rng.below(8) {
        0 => {
            issue(state, lba, count, |_| zeros.clone());
            volume.write_zeroes(
                offset,
                len,
                ZeroFlags {
                    fua: false,
                    allocate: rng.chance(1, 2),
                },
            )?;
        }
        1 => {
            issue(state, lba, count, |_| zeros.clone());
            volume.trim(offset, len, false)?;
        }
        _ => {
            let data = bytes::Bytes::from(rng.bytes(len as usize));
            issue(state, lba, count, |at| {
                let start = ((at - lba) as usize) * BLOCK;
                data[start..start + BLOCK].to_vec()
            });
            crate::stepper::write_as_served(volume, offset, &data, false, rng.chance(1, 2))?;
        }
    }
    state.lock().acknowledged();
    Ok(())
}

/// Blocks `lba..lba + count` are being written, each with `data(lba)`.
fn issue(state: &Mutex<State>, lba: u64, count: u64, data: impl Fn(u64) -> Vec<u8>) {
    let mut state = state.lock();
    for at in lba..lba + count {
        state.issuing(at, data(at));
    }
}

/// The served volume as the create's flush point, as `vouch serve`'s
/// (`create_online`): most of the flush first (`checkpoint_now`), writes
/// meanwhile, then `at_flush_point`, where the data the snapshot must hold
/// is taken and more writes are admitted (the inline route, which never
/// waits) before the clones.
struct Served<'a> {
    volume: &'a Volume,
    sim: &'a SimStorage,
    state: &'a Mutex<State>,
    rng: Mutex<Rng>,
    break_outside: bool,
    /// Writes admitted while the volume was held.
    held_writes: Mutex<u64>,
}

impl FlushPoint for Served<'_> {
    fn at_flush_point(
        &self,
        clone: &mut dyn FnMut(&Superblock) -> vouch_engine::Result<()>,
    ) -> vouch_engine::Result<()> {
        let mut rng = self.rng.lock();
        if self.break_outside {
            // The files as they are: what the buffer and the journal hold
            // is not in them.
            for _ in 0..rng.range(1, 4) {
                client_op(self.volume, self.state, &mut rng)?;
            }
            let superblock = vouch_engine::read_superblock(self.sim)?;
            let mut state = self.state.lock();
            state.snapshot = Some(state.acked.clone());
            drop(state);
            return clone(&superblock);
        }
        self.volume.checkpoint_now()?;
        for _ in 0..rng.range(1, 4) {
            client_op(self.volume, self.state, &mut rng)?;
        }
        self.volume.at_flush_point(&mut |superblock| {
            {
                let mut state = self.state.lock();
                state.flushed();
                state.snapshot = Some(state.acked.clone());
            }
            // Writers are admitted while the volume is held (into the
            // buffer and the held log, never its files).
            for _ in 0..rng.range(0, 4) {
                let lba = rng.below(BLOCKS);
                let data = bytes::Bytes::from(rng.bytes(BLOCK));
                self.state.lock().issuing(lba, data.to_vec());
                let taken = self
                    .volume
                    .submit_write(
                        lba * BLOCK as u64,
                        &data,
                        false,
                        vouch_engine::Admission::MustNotWait,
                    )?
                    .is_done();
                let mut state = self.state.lock();
                match taken {
                    true => {
                        state.acknowledged();
                        *self.held_writes.lock() += 1;
                    }
                    // Declined (the buffer is full): never written.
                    false => state.pending.clear(),
                }
            }
            clone(superblock)
        })
    }
    fn online(&self) -> bool {
        true
    }
}

/// Takes the three images at each crash point and judges them.
struct Crasher {
    state: Arc<Mutex<State>>,
    geometry: Geometry,
    breaks: SnapshotBreaks,
    rng: Mutex<Rng>,
    found: Mutex<Vec<String>>,
    /// Crash points, images.
    counts: Mutex<(u64, u64)>,
}

impl Crasher {
    fn crash(&self, sim: &SimStorage, order: &[ObjectId], fs: &ModelFs, what: &str) {
        let state = self.state.lock().clone();
        let mut rng = self.rng.lock();
        let images = [
            (sim.duplicate(), fs.clone(), true, "process crash"),
            (
                crash_image(sim, order, Strategy::Dropped, BLOCK as u64, &mut rng),
                fs.power_cut(|| false),
                false,
                "power cut (nothing unsynced kept)",
            ),
            (
                crash_image(sim, order, Strategy::Subset, BLOCK as u64, &mut rng),
                fs.power_cut(|| rng.chance(1, 2)),
                false,
                "power cut (some unsynced kept)",
            ),
        ];
        let mut counts = self.counts.lock();
        counts.0 += 1;
        let point = counts.0;
        for (image, fs, process, kind) in images {
            counts.1 += 1;
            if let Err(error) = verify(image, fs, process, &state, &self.geometry, self.breaks) {
                let mut found = self.found.lock();
                if found.len() < 10 {
                    found.push(format!(
                        "before operation {point} ({what}), {kind}: {error}"
                    ));
                }
            }
        }
    }
}

fn run_seed(
    config: &OnlineConfig,
    seed: u64,
    report: &mut SnapshotReport,
    held_writes: &mut u64,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (storage, model) = crate::snapshot::written_volume(config.layout, &mut rng)?;
    let geometry = crate::snapshot::geometry_of(&storage)?;
    let recorder = Arc::new(Recorder::new(storage));
    let volume = Volume::open(
        recorder.clone() as Arc<dyn Storage>,
        &crate::stepper::stepped_options(&mut rng),
    )
    .map_err(|e| format!("open: {e}"))?;
    let state = Arc::new(Mutex::new(State::new(model)));
    for index in 0..rng.range(20, 40) {
        if rng.chance(1, 6) {
            volume.flush().map_err(|e| format!("flush: {e}"))?;
            state.lock().flushed();
        } else {
            client_op(&volume, &state, &mut rng).map_err(|e| format!("op {index}: {e}"))?;
        }
        crate::stepper::step_commits([&volume], &mut rng);
    }

    let mut fs = ModelFs::new();
    fs.put_dir(Path::new(VOLUME));
    let served = Arc::new(ServedFs::new(recorder.sim.clone(), &geometry, fs));
    let crasher = Arc::new(Crasher {
        state: state.clone(),
        geometry,
        breaks: config.breaks,
        rng: Mutex::new(rng.fork()),
        found: Mutex::default(),
        counts: Mutex::default(),
    });
    {
        let (crasher, served) = (crasher.clone(), served.clone());
        recorder.set_hook(Some(Box::new(move |sim, order| {
            let fs = served.model.fs.lock().clone();
            crasher.crash(sim, order, &fs, "a write or sync of the volume");
        })));
    }
    {
        let (crasher, recorder) = (crasher.clone(), recorder.clone());
        *served.model.hook.lock() = Some(Box::new(move |fs, what| {
            crasher.crash(&recorder.sim, &recorder.order(), fs, what);
        }));
    }
    let point = Served {
        volume: &volume,
        sim: &recorder.sim,
        state: &state,
        rng: Mutex::new(rng.fork()),
        break_outside: config.break_outside,
        held_writes: Mutex::new(0),
    };
    let created = snapshot::create_from(
        served.as_ref(),
        Path::new(VOLUME),
        NAME,
        "reflink",
        config.breaks,
        &point,
    );
    recorder.set_hook(None);
    *served.model.hook.lock() = None;
    *held_writes += *point.held_writes.lock();
    let (points, images) = *crasher.counts.lock();
    report.points += points;
    report.images += images;
    created.map_err(|e| format!("create failed: {e}"))?;
    state.lock().done = true;
    // After the create, as the server goes on: a crash of the process now.
    let after = state.lock().clone();
    verify(
        recorder.sim.duplicate(),
        served.model.fs.lock().clone(),
        true,
        &after,
        &geometry,
        config.breaks,
    )
    .map_err(|e| format!("after the create: {e}"))?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    if points == 0 {
        return Err("the create issued no operation: nothing was crashed".into());
    }
    let first = crasher.found.lock().first().cloned();
    match first {
        Some(first) => Err(first),
        None => Ok(()),
    }
}

/// The snapshot directory `dir` of `fs` as a `SimStorage`; a file shorter
/// than the volume's (`lengths`) is cut there, as a short file would be.
pub(crate) fn snapshot_storage(
    fs: &mut ModelFs,
    dir: &Path,
    geometry: &Geometry,
    lengths: &BTreeMap<ObjectId, usize>,
) -> Result<SimStorage, String> {
    let storage = SimStorage::new();
    for object in objects_of(geometry) {
        let path = dir.join(object.file_name());
        let bytes = fs
            .file(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        storage.overwrite(object, 0, bytes);
        if bytes.len() < lengths.get(&object).copied().unwrap_or(0) {
            storage.truncate(object, bytes.len() as u64);
        }
    }
    Ok(storage)
}

/// Open `storage`, which must open read-only (a snapshot) or writable,
/// read every block (each must be `model`'s when given) and check.
pub(crate) fn read_and_check(
    storage: Arc<dyn Storage>,
    want_read_only: bool,
    model: Option<&[Vec<u8>]>,
) -> Result<(Volume, Vec<Vec<u8>>), String> {
    let volume =
        Volume::open(storage, &crate::foreground_options()).map_err(|e| format!("open: {e}"))?;
    if volume.is_read_only() != want_read_only {
        return Err(format!(
            "opened {}",
            if want_read_only {
                "writable"
            } else {
                "read-only"
            }
        ));
    }
    let reads = crate::read_blocks(&volume, BLOCKS)?;
    if let Some(model) = model {
        if let Some(lba) = (0..reads.len()).find(|&lba| reads[lba] != model[lba]) {
            return Err(format!("LBA {lba} reads other data"));
        }
    }
    let check = volume.check(|_, _| {}).map_err(|e| format!("check: {e}"))?;
    if let Some(fault) = check.faults.first() {
        return Err(format!(
            "check found {} faults, the first {fault:?}",
            check.faults.len()
        ));
    }
    Ok((volume, reads))
}

/// The lengths of the volume's files in `sim`.
pub(crate) fn lengths_of(sim: &SimStorage, geometry: &Geometry) -> BTreeMap<ObjectId, usize> {
    objects_of(geometry)
        .into_iter()
        .map(|object| (object, sim.object_bytes(object).len()))
        .collect()
}

fn verify(
    sim: SimStorage,
    fs: ModelFs,
    process: bool,
    state: &State,
    geometry: &Geometry,
    breaks: SnapshotBreaks,
) -> Result<(), String> {
    let volume_dir = Path::new(VOLUME);
    let mut fs = crate::snapshot::tidied(fs, volume_dir)?;
    let path = snapshot::snapshot_path(volume_dir, NAME);
    let present = fs.lookup(&path).is_some();
    // The volume's files as they were at the flush point: what a snapshot
    // file shorter than them lost.
    let lengths = lengths_of(&sim, geometry);
    if present {
        let Some(model) = &state.snapshot else {
            return Err("a snapshot has its name before the create reached its flush point".into());
        };
        let storage = snapshot_storage(&mut fs, &path, geometry, &lengths)?;
        read_and_check(Arc::new(storage), true, Some(model))
            .map_err(|e| format!("the snapshot: {e}"))?;
        crate::snapshot::listed_one(&fs, volume_dir)?;
    } else if state.done {
        return Err("the create returned but its snapshot is gone".into());
    }
    // The volume, recovered as the next serve opens it.
    let (volume, reads) = read_and_check(Arc::new(sim.clone()), false, None)
        .map_err(|e| format!("the volume: {e}"))?;
    for (lba, read) in reads.iter().enumerate() {
        if !state.keeps(lba, read, process) {
            return Err(format!(
                "the volume: LBA {lba} reads other data than was {} ({})",
                if process { "acknowledged" } else { "flushed" },
                if state.acked[lba] == *read {
                    "its last acknowledged data, but that was never flushed"
                } else {
                    "neither its flushed data nor a later acknowledged one"
                }
            ));
        }
    }
    // The operator takes the snapshot again, online.
    let again = ServedFs::new(sim.clone(), geometry, fs);
    match snapshot::create_from(&again, volume_dir, NAME, "reflink", breaks, &volume) {
        Ok(_) => {}
        Err(error) if present && error.to_string().contains("already exists") => {}
        Err(error) => return Err(format!("create again: {error}")),
    }
    if !present {
        let lengths = lengths_of(&sim, geometry);
        let mut fs = again.model.fs.lock().clone();
        let storage = snapshot_storage(&mut fs, &path, geometry, &lengths)?;
        read_and_check(Arc::new(storage), true, Some(&reads))
            .map_err(|e| format!("the snapshot made again: {e}"))?;
    }
    volume
        .close()
        .map_err(|e| format!("the volume: close: {e}"))
}
