//! The two online snapshots that run through the before-image layer
//! (`storage/before.rs`), crashed at every write, sync and file
//! operation: `vouch-sim snapshot-fenced` (xfs, btrfs: a fence at the
//! flush point, the snapshot materialised beside the served volume) and
//! `vouch-sim snapshot-overlay` (filesystems that cannot clone: a fence
//! and the log kept for the snapshot's life, then its delete).
//!
//! Per seed: a volume written and closed (`snapshot::written_volume`) is
//! opened as `vouch serve` opens it (`vouch_engine::open_layered`: its
//! files under the layer, the background committer stepped by the seed, a
//! write-back buffer of 2-11 blocks) and written on as in `vouch-sim
//! snapshot-online` (writes, some on the inline route, zeroes, trims, a
//! flush now and then). Then the engine's own code of the route runs with
//! `snapshots/` on the model filesystem of `vouch-sim snapshot`
//! (`ModelFs`; the log is a file of it, `ModelLog`, so each append, sync
//! and cut is an operation of it) and the volume's files in the
//! simulator's `SimStorage`:
//!
//! - fenced: `fenced::fence_in` (FENCED set, the flush point, the partial,
//!   the fence, the layer armed) with inline writes admitted while the
//!   volume is held at its flush point; then writes while armed (every
//!   home write imaged first, group-committed); then
//!   `fenced::materialise_in` with a client writing (and the committer
//!   writing home) before each of its file operations;
//! - overlay: `overlay::create_online_in` (OVERLAID set, the flush point,
//!   the partial, the layer armed, the name published) with inline writes
//!   at the flush point; writes while it exists (imaged); then
//!   `overlay::delete_served_in` with writes racing it, and writes after.
//!
//! Right before every write, punch and sync of the volume, every append
//! and sync of the log, and every file operation of the route, three
//! crash images are taken, as in `snapshot-online`: a process crash, a
//! power cut losing everything unsynced, one keeping a random subset. On
//! each, after the tidy the next snapshot command does, the volume is
//! opened writable by `open_layered` (which arms a fence's or an
//! overlay's log before the replay and materialises a fence a crash cut
//! short) and:
//!
//! - every block reads its last acknowledged data (process crash), or its
//!   last flushed or a later acknowledged one (power cut); `check` clean;
//! - fenced: after the open no fence is left; a published snapshot reads
//!   exactly the data at the flush point and checks clean; one not
//!   published is absent or marked failed, and absent only if the create
//!   had not returned;
//! - overlay: a published overlay (read through `OverlayStorage` over the
//!   recovered volume's files) reads exactly the data at the flush point
//!   and checks clean, again after the recovered volume is written and
//!   flushed (the re-armed layer images those writes); it exists from the
//!   create's return until the delete's start, and never after the delete
//!   returned;
//! - after the open's close, FENCED is clear, and OVERLAID is set exactly
//!   when an overlay exists: a create or delete a crash cut short leaves
//!   the flag for the next writable open to clear (`clear_stale_overlaid`
//!   in `open_layered`); left set, older binaries would refuse the volume
//!   until the next overlay delete.
//!
//! Deliberate breaks that must be caught: `--break-image-order` (a home
//! write issued before its image is synced, both routes) and, fenced,
//! `--break-last-image` (the materialisation writes each block's last
//! image back instead of its first).

use std::io;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use vouch_engine::snapshot::{self, fenced, overlay, SnapshotFs};
use vouch_engine::storage::before::{BeforeBreaks, BeforeImages, BeforeLog};
use vouch_engine::{BlockDevice, LayoutKind, ObjectId, SimStorage, Storage, Volume};
use vouch_format::{FeatureFlags, Geometry};

use crate::faults::BLOCKS;
use crate::recorder::{crash_image, Recorder, Strategy};
use crate::rng::Rng;
use crate::snapshot::{ModelFs, SnapshotReport};
use crate::snapshot_online::{
    client_op, lengths_of, read_and_check, snapshot_storage, ServedFs, SimFiles, State, NAME,
    VOLUME,
};
use crate::BLOCK;

/// Which snapshot route a run drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Fenced,
    Overlay,
}

impl Route {
    pub fn command(self) -> &'static str {
        match self {
            Route::Fenced => "snapshot-fenced",
            Route::Overlay => "snapshot-overlay",
        }
    }
}

#[derive(Clone, Debug)]
pub struct LayerConfig {
    pub route: Route,
    pub layout: LayoutKind,
    pub seeds: u64,
    pub seed: u64,
    /// Break on purpose: a home write issued before its image is synced.
    pub break_image_order: bool,
    /// Break on purpose (fenced): each block's last image written back.
    pub break_last_image: bool,
}

impl LayerConfig {
    fn breaks(&self) -> BeforeBreaks {
        BeforeBreaks {
            write_before_sync: self.break_image_order,
            last_image_wins: self.break_last_image,
        }
    }

    fn flag(&self) -> Option<&'static str> {
        match (self.break_image_order, self.break_last_image) {
            (true, _) => Some("--break-image-order"),
            (false, true) => Some("--break-last-image"),
            _ => None,
        }
    }
}

/// What the seeds found, beside the snapshot simulator's report.
#[derive(Debug, Default)]
pub struct LayerReport {
    pub report: SnapshotReport,
    /// Writes acknowledged while the layer was armed.
    pub armed_writes: u64,
    /// Images verified with the snapshot published (and read).
    pub published: u64,
    /// Images whose open found the snapshot marked failed.
    pub failed: u64,
}

/// The summary line of `layer` for `config`.
pub fn summary(layer: &LayerReport, config: &LayerConfig) -> String {
    let report = &layer.report;
    format!(
        "{}: layout={}{} seeds={} armed-writes={} crash points={} images={} published={} failed={} violations={} time={:.1}s",
        config.route.command(),
        config.layout.name(),
        match config.flag() {
            Some("--break-image-order") => " BROKEN(home write before its image is synced)",
            Some(_) => " BROKEN(last image written back)",
            None => "",
        },
        config.seeds,
        layer.armed_writes,
        report.points,
        report.images,
        layer.published,
        layer.failed,
        report.violations.len(),
        report.seconds
    )
}

pub fn run(config: &LayerConfig) -> LayerReport {
    let mut layer = LayerReport::default();
    let report = crate::snapshot::run_seeds(
        (config.route.command(), config.layout, config.flag()),
        config.seed..config.seed + config.seeds,
        |seed, report| run_seed(config, seed, report, &mut layer),
    );
    layer.report = report;
    layer
}

/// How far the route got (what an image must show).
#[derive(Clone, Copy, Debug, Default)]
struct Phase {
    /// The create returned (fenced: the fence is armed; overlay: the name
    /// is published).
    created: bool,
    /// The overlay's delete started / returned.
    deleting: bool,
    deleted: bool,
}

/// How a client writes beside the route's file operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Race {
    /// Only inline writes (`MustNotWait`): the volume may be held at its
    /// flush point.
    Held,
    /// Any client operation, flushes, and the committer's steps.
    Free,
}

/// The route's `SnapshotFs`: `ServedFs`, with a client writing on the
/// volume before each operation that changes something, as a served
/// volume's clients do while a snapshot is made.
struct Racing<'a> {
    fs: &'a ServedFs<SimFiles>,
    volume: &'a Volume,
    layer: &'a BeforeImages,
    state: &'a Mutex<State>,
    rng: Mutex<Rng>,
    race: Mutex<Race>,
    armed_writes: Mutex<u64>,
    error: Mutex<Option<String>>,
}

impl Racing<'_> {
    /// Before an operation on `path` (`mkdir`: a new directory).
    fn race(&self, path: &Path, mkdir: bool) {
        let race = *self.race.lock();
        if race == Race::Held && mkdir && path == snapshot::partial_path(Path::new(VOLUME), NAME) {
            // The route's first operation inside the flush point: every
            // write acknowledged so far is durable now, and is what the
            // snapshot must hold (not the writes admitted from here on).
            let mut state = self.state.lock();
            state.flushed();
            state.snapshot = Some(state.acked.clone());
        }
        let mut rng = self.rng.lock();
        if let Err(error) = match race {
            Race::Held => self.held_write(&mut rng),
            Race::Free => self.free_op(&mut rng),
        } {
            self.error.lock().get_or_insert(error);
        }
    }

    /// One time in three, an inline write of a block (declined when the
    /// buffer is full: never written).
    fn held_write(&self, rng: &mut Rng) -> Result<(), String> {
        if !rng.chance(1, 3) {
            return Ok(());
        }
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
            )
            .map_err(|e| format!("an inline write at the flush point: {e}"))?
            .is_done();
        let mut state = self.state.lock();
        match taken {
            true => state.acknowledged(),
            false => state.pending.clear(),
        }
        Ok(())
    }

    /// One time in three a client operation (one in six of them a
    /// flush), then the committer's steps.
    fn free_op(&self, rng: &mut Rng) -> Result<(), String> {
        if rng.chance(1, 3) {
            let armed = self.layer.is_armed();
            if rng.chance(1, 6) {
                self.volume.flush().map_err(|e| format!("flush: {e}"))?;
                self.state.lock().flushed();
            } else {
                client_op(self.volume, self.state, rng).map_err(|e| format!("write: {e}"))?;
                *self.armed_writes.lock() += u64::from(armed);
            }
        }
        crate::stepper::step_commits([self.volume], rng);
        Ok(())
    }

    fn step(&self) -> Result<(), String> {
        let mut rng = self.rng.lock();
        self.free_op(&mut rng)
    }
}

impl SnapshotFs for Racing<'_> {
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.race(path, true);
        self.fs.create_dir(path)
    }
    fn clone_file(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.race(to, false);
        self.fs.clone_file(from, to)
    }
    fn warm_file(&self, from: &Path, to: &Path) -> io::Result<bool> {
        self.race(to, false);
        self.fs.warm_file(from, to)
    }
    fn new_file(&self, path: &Path, len: u64, allocate: bool) -> io::Result<()> {
        self.race(path, false);
        self.fs.new_file(path, len, allocate)
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.fs.read(path)
    }
    fn write_at(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.race(path, false);
        self.fs.write_at(path, offset, bytes)
    }
    fn sync_file(&self, path: &Path) -> io::Result<()> {
        self.race(path, false);
        self.fs.sync_file(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.race(path, false);
        self.fs.sync_dir(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.race(from, false);
        self.fs.rename(from, to)
    }
    fn remove_all(&self, path: &Path) -> io::Result<()> {
        self.race(path, false);
        self.fs.remove_all(path)
    }
    fn names(&self, dir: &Path) -> io::Result<Option<Vec<String>>> {
        self.fs.names(dir)
    }
    fn exists(&self, path: &Path) -> bool {
        self.fs.exists(path)
    }
    fn set_len(&self, path: &Path, len: u64) -> io::Result<()> {
        self.race(path, false);
        self.fs.set_len(path, len)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.race(path, false);
        self.fs.remove_file(path)
    }
    fn open_log(&self, path: &Path) -> io::Result<Box<dyn BeforeLog>> {
        self.fs.open_log(path)
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        self.fs.file_len(path)
    }
}

/// What one image showed beside its violations.
#[derive(Clone, Copy, Default)]
struct Outcome {
    published: bool,
    failed: bool,
}

/// Counts of one seed.
#[derive(Default)]
struct Counts {
    points: u64,
    images: u64,
    published: u64,
    failed: u64,
}

/// Takes the three images at each crash point and judges them.
struct Crasher {
    config: LayerConfig,
    state: Arc<Mutex<State>>,
    phase: Arc<Mutex<Phase>>,
    geometry: Geometry,
    rng: Mutex<Rng>,
    found: Mutex<Vec<String>>,
    counts: Mutex<Counts>,
}

impl Crasher {
    fn crash(&self, sim: &SimStorage, order: &[ObjectId], fs: &ModelFs, what: &str) {
        let state = self.state.lock().clone();
        let phase = *self.phase.lock();
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
        counts.points += 1;
        let point = counts.points;
        if !self.found.lock().is_empty() {
            // The seed failed already: its later images are not judged.
            return;
        }
        for (image, fs, process, kind) in images {
            counts.images += 1;
            match verify(
                image,
                fs,
                process,
                &state,
                phase,
                &self.config,
                &self.geometry,
            ) {
                Ok(outcome) => {
                    counts.published += u64::from(outcome.published);
                    counts.failed += u64::from(outcome.failed);
                }
                Err(error) => {
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
}

fn run_seed(
    config: &LayerConfig,
    seed: u64,
    report: &mut SnapshotReport,
    layer_report: &mut LayerReport,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (storage, model) = crate::snapshot::written_volume(config.layout, &mut rng)?;
    let geometry = crate::snapshot::geometry_of(&storage)?;
    let recorder = Arc::new(Recorder::new(storage));
    let dir = Path::new(VOLUME);
    let mut fs = ModelFs::new();
    fs.put_dir(dir);
    let served = Arc::new(ServedFs::new(recorder.sim.clone(), &geometry, fs));
    let layer = Arc::new(BeforeImages::new(recorder.clone() as Arc<dyn Storage>));
    layer.set_breaks(config.breaks());
    let volume = vouch_engine::open_layered(
        served.as_ref(),
        dir,
        layer.clone(),
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

    let phase = Arc::new(Mutex::new(Phase::default()));
    let crasher = Arc::new(Crasher {
        config: config.clone(),
        state: state.clone(),
        phase: phase.clone(),
        geometry,
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
    let racing = Racing {
        fs: served.as_ref(),
        volume: &volume,
        layer: &layer,
        state: &state,
        rng: Mutex::new(rng.fork()),
        race: Mutex::new(Race::Held),
        armed_writes: Mutex::new(0),
        error: Mutex::new(None),
    };
    let ran = drive(config, &racing, &volume, &layer, &phase, &mut rng);
    recorder.set_hook(None);
    *served.model.hook.lock() = None;
    layer_report.armed_writes += *racing.armed_writes.lock();
    {
        let counts = crasher.counts.lock();
        report.points += counts.points;
        report.images += counts.images;
        layer_report.published += counts.published;
        layer_report.failed += counts.failed;
    }
    ran?;
    if let Some(error) = racing.error.lock().take() {
        return Err(format!("a client beside the route: {error}"));
    }
    // After the route, as the server goes on: a crash of the process now.
    let after = state.lock().clone();
    let phase_now = *phase.lock();
    let model_now = served.model.fs.lock().clone();
    verify(
        recorder.sim.duplicate(),
        model_now,
        true,
        &after,
        phase_now,
        config,
        &geometry,
    )
    .map_err(|e| format!("after the route: {e}"))?;
    volume.close().map_err(|e| format!("close: {e}"))?;
    if crasher.counts.lock().points == 0 {
        return Err("the route issued no operation: nothing was crashed".into());
    }
    let first = crasher.found.lock().first().cloned();
    match first {
        Some(first) => Err(first),
        None => Ok(()),
    }
}

/// The route's production calls, with a client racing each.
fn drive(
    config: &LayerConfig,
    racing: &Racing<'_>,
    volume: &Volume,
    layer: &BeforeImages,
    phase: &Mutex<Phase>,
    rng: &mut Rng,
) -> Result<(), String> {
    let dir = Path::new(VOLUME);
    match config.route {
        Route::Fenced => {
            fenced::fence_in(racing, dir, volume, NAME, "sim")
                .map_err(|e| format!("fence: {e}"))?;
            phase.lock().created = true;
            if !layer.is_armed() {
                return Err("the fence returned with the layer disarmed".into());
            }
            *racing.race.lock() = Race::Free;
            for _ in 0..rng.range(2, 6) {
                racing.step()?;
            }
            fenced::materialise_in(racing, dir, NAME, layer, config.breaks())
                .map_err(|e| format!("materialise: {e}"))?;
            if layer.is_armed() {
                return Err("the materialisation returned with the layer armed".into());
            }
        }
        Route::Overlay => {
            overlay::create_online_in(racing, dir, volume, NAME, "sim")
                .map_err(|e| format!("create: {e}"))?;
            phase.lock().created = true;
            *racing.race.lock() = Race::Free;
            for _ in 0..rng.range(24, 48) {
                racing.step()?;
            }
            phase.lock().deleting = true;
            overlay::delete_served_in(racing, dir, Some(volume), NAME)
                .map_err(|e| format!("delete: {e}"))?;
            phase.lock().deleted = true;
            for _ in 0..rng.range(1, 4) {
                racing.step()?;
            }
        }
    }
    Ok(())
}

/// The recovered volume's files read, written and checked, and the
/// snapshot judged (see the module's comment).
fn verify(
    sim: SimStorage,
    fs: ModelFs,
    process: bool,
    state: &State,
    phase: Phase,
    config: &LayerConfig,
    geometry: &Geometry,
) -> Result<Outcome, String> {
    let dir = Path::new(VOLUME);
    let served = ServedFs::new(sim.clone(), geometry, fs);
    tidy(&served)?;
    let layer = Arc::new(BeforeImages::new(Arc::new(sim.clone())));
    layer.set_breaks(config.breaks());
    let volume = vouch_engine::open_layered(&served, dir, layer, &crate::foreground_options())
        .map_err(|e| format!("the volume: open: {e}"))?;
    let reads = crate::read_blocks(&volume, BLOCKS)?;
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
    let check = volume.check(|_, _| {}).map_err(|e| format!("check: {e}"))?;
    if let Some(fault) = check.faults.first() {
        return Err(format!(
            "the volume: check found {} faults, the first {fault:?}",
            check.faults.len()
        ));
    }
    let outcome = match config.route {
        Route::Fenced => fenced_snapshot(&served, &sim, state, phase, geometry)?,
        Route::Overlay => overlay_snapshot(&served, &volume, &sim, state, phase, geometry)?,
    };
    volume
        .close()
        .map_err(|e| format!("the volume: close: {e}"))?;
    let incompat = vouch_engine::read_superblock(&sim)
        .map_err(|e| format!("the volume's superblock after its close: {e}"))?
        .features
        .incompat;
    if incompat & FeatureFlags::INCOMPAT_FENCED != 0 {
        return Err(
            "FENCED is still set after the open and close: older binaries refuse the volume with no fence left".into(),
        );
    }
    let overlaid = incompat & FeatureFlags::INCOMPAT_OVERLAID != 0;
    if config.route == Route::Overlay {
        let has_overlay = !overlay::overlays(&served, dir)
            .map_err(|e| format!("overlays: {e}"))?
            .is_empty();
        if has_overlay && !overlaid {
            return Err(
                "an overlay exists but OVERLAID is clear: an older binary would write home without images".into(),
            );
        }
        if overlaid && !has_overlay {
            return Err(
                "OVERLAID is still set after the open and close with no overlay: older binaries refuse the volume until the next overlay delete".into(),
            );
        }
    }
    Ok(outcome)
}

/// What the next snapshot command does first (`tidy`): a violation when
/// it fails or leaves a name starting with '.' in `snapshots/` other than
/// a fenced snapshot (the open materialises it) or a failed one (listed
/// until deleted).
fn tidy(fs: &ServedFs<SimFiles>) -> Result<(), String> {
    let dir = Path::new(VOLUME);
    snapshot::tidy(fs, dir).map_err(|e| format!("tidy: {e}"))?;
    let snapshots = dir.join(snapshot::SNAPSHOTS_DIR);
    for name in fs
        .names(&snapshots)
        .map_err(|e| format!("list: {e}"))?
        .unwrap_or_default()
    {
        let path = snapshots.join(&name);
        if name.starts_with('.')
            && !fenced::is_fenced(fs, &path)
            && fenced::failed_cause(fs, &path).is_none()
        {
            return Err(format!("{name} is left in snapshots/ after the tidy"));
        }
    }
    Ok(())
}

/// The fenced snapshot after the open (which materialised any fence left).
fn fenced_snapshot(
    fs: &ServedFs<SimFiles>,
    sim: &SimStorage,
    state: &State,
    phase: Phase,
    geometry: &Geometry,
) -> Result<Outcome, String> {
    let dir = Path::new(VOLUME);
    let path = snapshot::snapshot_path(dir, NAME);
    let partial = fenced::materialising_path(dir, NAME);
    if fenced::is_fenced(fs, &partial) {
        return Err("a fence is left after the open (it materialises every fence)".into());
    }
    let failed = fenced::failed_cause(fs, &partial).is_some();
    if fs.exists(&path) {
        let Some(model) = &state.snapshot else {
            return Err("a snapshot has its name before the create reached its flush point".into());
        };
        for file in [fenced::FENCE_FILE, fenced::BEFORE_FILE] {
            if fs.exists(&path.join(file)) {
                return Err(format!("the published snapshot still has its {file}"));
            }
        }
        let mut model_fs = fs.model.fs.lock().clone();
        let storage = snapshot_storage(&mut model_fs, &path, geometry, &lengths_of(sim, geometry))?;
        read_and_check(Arc::new(storage), true, Some(model))
            .map_err(|e| format!("the snapshot: {e}"))?;
        crate::snapshot::listed_one(&model_fs, dir)?;
        return Ok(Outcome {
            published: true,
            ..Outcome::default()
        });
    }
    if phase.created {
        // No I/O fault is injected: a snapshot whose create was answered
        // and that a crash left failed is a lost snapshot.
        return Err(match failed {
            true => "the fence was armed (the create returned) but the snapshot is marked failed",
            false => "the fence was armed (the create returned) but the snapshot is neither published nor failed",
        }
        .into());
    }
    Ok(Outcome {
        failed,
        ..Outcome::default()
    })
}

/// The overlay snapshot, if it exists, read through `OverlayStorage` over
/// the recovered `volume`'s files, before and after the volume is written.
fn overlay_snapshot(
    fs: &ServedFs<SimFiles>,
    volume: &Volume,
    sim: &SimStorage,
    state: &State,
    phase: Phase,
    geometry: &Geometry,
) -> Result<Outcome, String> {
    let dir = Path::new(VOLUME);
    let path = snapshot::snapshot_path(dir, NAME);
    if !fs.exists(&path) {
        if phase.created && !phase.deleting {
            return Err("the create returned but its overlay is gone".into());
        }
        return Ok(Outcome::default());
    }
    if fs.exists(&path.join(overlay::FAILED_FILE)) {
        if !phase.deleting {
            // No I/O fault is injected: an overlay whose create was
            // answered and that a crash left failed is a lost snapshot.
            return Err("the overlay is marked failed".into());
        }
        return Ok(Outcome {
            failed: true,
            ..Outcome::default()
        });
    }
    if phase.deleted {
        return Err("the delete returned but the overlay is there".into());
    }
    let Some(model) = &state.snapshot else {
        return Err("an overlay has its name before the create reached its flush point".into());
    };
    let read = |when: &str| -> Result<(), String> {
        let own = SimStorage::new();
        let mut model_fs = fs.model.fs.lock().clone();
        for object in [ObjectId::Superblock, ObjectId::Journal] {
            let file = path.join(object.file_name());
            let bytes = model_fs
                .file(&file)
                .map_err(|e| format!("{}: {e}", file.display()))?;
            own.overwrite(object, 0, bytes.as_slice());
        }
        let storage =
            overlay::overlay_in(fs, &path, geometry, Arc::new(own), Arc::new(sim.clone()))
                .map_err(|e| format!("the overlay {when}: {e}"))?;
        read_and_check(Arc::new(storage), true, Some(model))
            .map_err(|e| format!("the overlay {when}: {e}"))
            .map(drop)
    };
    read("after the open")?;
    // The recovered volume written and flushed: the layer the open
    // re-armed images every home write first.
    let mut rng = Rng::new(u64::from_le_bytes(
        model[0][..8].try_into().expect("8 bytes"),
    ));
    for _ in 0..3 {
        let lba = rng.below(BLOCKS);
        vouch_engine::DeviceWrites::write(volume, lba * BLOCK as u64, &rng.bytes(BLOCK), false)
            .map_err(|e| format!("the volume: a write after the open: {e}"))?;
    }
    volume
        .flush()
        .map_err(|e| format!("the volume: flush: {e}"))?;
    read("after the volume was written again")?;
    Ok(Outcome {
        published: true,
        ..Outcome::default()
    })
}
