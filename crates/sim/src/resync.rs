//! Crash points of mirror resync under client writes
//! (`crates/mirror/src/resync.rs`, docs/CRASH_MODEL.md "Resync").
//!
//! Two identical legs on simulated storage; leg 1 goes away and a
//! `Mirror` writes, trims and flushes random blocks on leg 0 alone,
//! marking them in a resync map kept in simulated map files (`SimMaps`,
//! 16-block regions so region bits do not cover the whole volume). Leg 1
//! then comes back and is resynced batch by batch (`Mirror::resync_step`,
//! a few blocks per batch), with client writes (some partial blocks, some
//! FUA), trims and flushes between the batches, to blocks in the map and
//! outside it, and after the resync ends. Leg 0, leg 1 and the map files
//! are all recorded: at every write and sync any of them issues (and
//! before each map create and remove) the exporter crashes, and image
//! triples are built: each strategy on all three, and one random
//! strategy on each. The map's unsynced writes are torn at 512 bytes in
//! half the seeds (a torn page fails its CRC). Contract, per image:
//! - leg 0 opens and every block reads its durable value (the last
//!   completed flush or FUA) or a value written since: no acknowledged
//!   and flushed write is lost;
//! - leg 1 opens and every block reads a value once written there; one
//!   that is not allowed now (older than the last flush) must be covered
//!   by the map on disk (its block or region bit), or the map fails its
//!   CRC (unknown history: a full resync); with no map (the resync
//!   finished and removed it) every block must be allowed;
//! - a restart (reads to leg 0 until a scrub, the map's resync run to the
//!   end, then a scrub) leaves both legs equal to what leg 0 read, on
//!   every block.
//!
//! Scheduling as in production (`crate::stepper`): both legs have a
//! background committer the seed steps, run between client operations
//! and resync batches; whole-block writes without FUA take the mirror's
//! inline route (`try_write_shared`: room reserved on each leg, stored
//! without waiting) half the time; and while leg 0's background commit
//! runs, up to two inline client writes run at each of its steps
//! (`CommitStep`), as the NBD reactor's would beside the committer
//! thread. Each crash point also takes a process crash of the exporter
//! (every write that returned and the held logs kept, the map's unsynced
//! writes too): leg 0 must then read every acknowledged write (its last
//! acknowledged value or one in flight). `run_with` breaks an ordering
//! on purpose (`Sabotage`), which these checks must catch.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;
use vouch_engine::DeviceWrites;

use bytes::Bytes;
use parking_lot::Mutex;
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    BlockDevice, CommitStep, CreateOptions, LayoutKind, OpenOptions, OrderingBreaks, SealedDevice,
    SimStorage, Storage, Volume,
};
use vouch_format::dirty::DirtyHeader;
use vouch_mirror::{DirtyMap, LegState, MapStore, Mirror, MirrorLeg, ResyncCursor, ResyncStep};

use crate::map_store::SimMaps;
use crate::recorder::{crash_image, Recorder, Strategy, STRATEGIES};
use crate::rng::Rng;
use crate::stepper::{step_commits, stepped_options, stepped_tuning, write_as_served, Stepper};
use crate::{fingerprint, BLOCK};

/// Blocks in the volume.
const BLOCKS: u64 = 128;
/// Blocks per region bit of the simulated maps.
const REGION_BLOCKS: u32 = 16;
const UUID: [u8; 16] = [0x5e; 16];
/// Where the map lives (a name in `SimMaps`).
const DIR: &str = "/sim/leg0";
/// Batches a resync may take before it counts as not converging.
const MAX_STEPS: u64 = 2000;

fn header() -> DirtyHeader {
    DirtyHeader {
        leg: 1,
        uuid: UUID,
        blocks: BLOCKS,
        region_blocks: REGION_BLOCKS,
    }
}

fn map_path() -> PathBuf {
    Path::new(DIR).join(vouch_mirror::dirty::map_file_name(1))
}

/// What a resync crash run found.
#[derive(Debug, Default)]
pub struct ResyncReport {
    pub seeds: u64,
    /// Crash points (each gives 5 image triples).
    pub points: u64,
    /// Image triples checked (each also restarted to the end).
    pub images: u64,
    /// Images whose map failed its CRC (a full resync at restart).
    pub unknown_maps: u64,
    /// Images with no map (taken after the resync removed it).
    pub no_map: u64,
    /// Image blocks on leg 1 holding a value no longer allowed: each one
    /// must be covered by the map.
    pub covered: u64,
    /// Blocks the resyncs copied, batches they took, client operations
    /// run during them.
    pub copied: u64,
    pub steps: u64,
    pub client_ops: u64,
    /// Map file writes and syncs (each a crash point).
    pub map_writes: u64,
    pub map_syncs: u64,
    /// Image triples of a process crash (kernel state kept).
    pub process_images: u64,
    /// Client writes the mirror's inline route took, those of them run at
    /// a step of leg 0's background commit, and the background commits
    /// the simulator ran on either leg.
    pub inline_writes: u64,
    pub at_step_writes: u64,
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl ResyncReport {
    /// Add what a seed's checker found.
    fn merge(&mut self, found: ResyncReport) {
        self.points += found.points;
        self.images += found.images;
        self.process_images += found.process_images;
        self.unknown_maps += found.unknown_maps;
        self.no_map += found.no_map;
        self.covered += found.covered;
        self.violations.extend(found.violations);
    }

    pub fn summary(&self) -> String {
        format!(
            "mirror resync: seeds={} points={} images={} (process {}, map unknown={} no map={}) stale-covered={} copied={} steps={} client-ops={} (inline {}, at commit steps {}) background commits={} map writes={} syncs={} violations={} time={:.1}s",
            self.seeds,
            self.points,
            self.images,
            self.process_images,
            self.unknown_maps,
            self.no_map,
            self.covered,
            self.copied,
            self.steps,
            self.client_ops,
            self.inline_writes,
            self.at_step_writes,
            self.background_commits,
            self.map_writes,
            self.map_syncs,
            self.violations.len(),
            self.seconds
        )
    }
}

/// Per block: the value durable now, the values written since the last
/// flush, the values a process crash may leave (the last acknowledged
/// one and any in flight), every value it ever held (fingerprints), and
/// its newest bytes.
#[derive(Clone)]
struct Model {
    durable: Vec<u64>,
    since: Vec<Vec<u64>>,
    acked: Vec<Vec<u64>>,
    ever: Vec<Vec<u64>>,
    newest: Vec<Vec<u8>>,
}

impl Model {
    fn new(blocks: Vec<Vec<u8>>) -> Model {
        let prints: Vec<u64> = blocks.iter().map(|b| fingerprint(b)).collect();
        Model {
            durable: prints.clone(),
            since: vec![Vec::new(); blocks.len()],
            acked: prints.iter().map(|&p| vec![p]).collect(),
            ever: prints.iter().map(|&p| vec![p]).collect(),
            newest: blocks,
        }
    }

    fn allowed(&self, lba: usize, print: u64) -> bool {
        self.durable[lba] == print || self.since[lba].contains(&print)
    }

    /// After a process crash: `print` is the last acknowledged value of
    /// block `lba` or one in flight.
    fn kept(&self, lba: usize, print: u64) -> bool {
        self.acked[lba].contains(&print)
    }

    /// A value about to be written (it may or may not land).
    fn write(&mut self, lba: usize, bytes: Vec<u8>) {
        let print = fingerprint(&bytes);
        self.since[lba].push(print);
        self.acked[lba].push(print);
        if !self.ever[lba].contains(&print) {
            self.ever[lba].push(print);
        }
        self.newest[lba] = bytes;
    }

    /// The writes to `lbas` were acknowledged: a process crash keeps them.
    fn acknowledged(&mut self, lbas: impl Iterator<Item = usize>) {
        for lba in lbas {
            self.acked[lba] = vec![fingerprint(&self.newest[lba])];
        }
    }

    /// A flush (or FUA) of `lbas` completed: their newest values are durable.
    fn durable(&mut self, lbas: impl Iterator<Item = usize>) {
        for lba in lbas {
            self.durable[lba] = fingerprint(&self.newest[lba]);
            self.since[lba].clear();
        }
    }
}

/// Open a leg: crash images with foreground commits (a check's own
/// opens run no writer), the workload's legs stepped (`Workload::leg0`).
fn open(storage: Arc<dyn Storage>, options: &OpenOptions) -> Result<Arc<Volume>, String> {
    Volume::open(storage, options)
        .map(Arc::new)
        .map_err(|e| format!("open: {e}"))
}

fn open_image(image: SimStorage) -> Result<Arc<Volume>, String> {
    open(Arc::new(image), &crate::foreground_options())
}

/// An ordering broken on purpose (self-tests: the checks must catch it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sabotage {
    #[default]
    None,
    /// The mirror's inline route acknowledges before leg 0's held log
    /// holds the write (its held-log appends keep nothing).
    InlineBeforeHeld,
    /// Leg 0's background committer empties the committing held-log slot
    /// before its journal record and home writes
    /// (`OrderingBreaks::empty_before_home`).
    EmptyBeforeHome,
}

fn read_all(volume: &dyn BlockDevice) -> std::result::Result<Vec<Vec<u8>>, String> {
    crate::read_blocks(volume, BLOCKS)
}

/// A mirror of `leg0` (active) and `leg1` (`state`; `None`: missing).
fn mirror_of(
    leg0: Arc<Volume>,
    leg1: Option<Arc<Volume>>,
    state: LegState,
) -> Result<Arc<Mirror>, String> {
    Mirror::new(
        vec![
            MirrorLeg {
                name: "leg0".into(),
                device: Some(leg0 as Arc<dyn SealedDevice>),
                state: LegState::Active,
            },
            MirrorLeg {
                name: "leg1".into(),
                device: leg1.map(|v| v as Arc<dyn SealedDevice>),
                state,
            },
        ],
        None,
    )
    .map_err(|e| e.to_string())
}

/// Open leg 1's map from `maps` and track writes in it: why its history is
/// unknown, if it is.
fn track(mirror: &Mirror, maps: &SimMaps, create_clean: bool) -> Result<Option<String>, String> {
    let store: Arc<dyn MapStore> = Arc::new(maps.clone());
    let (map, unknown) =
        DirtyMap::open_in(store, &[PathBuf::from(DIR)], header(), create_clean, &[])
            .map_err(|e| format!("map: {e}"))?;
    mirror.track(1, Arc::new(map)).map_err(|e| e.to_string())?;
    Ok(unknown)
}

/// Run leg 1's resync to its end, batch by batch; the blocks copied.
fn resync_to_end(mirror: &Mirror, full: bool, window: u64) -> Result<(u64, u64), String> {
    let mut cursor = mirror.begin_resync(1, full).map_err(|e| e.to_string())?;
    cursor.set_batch(window, 2);
    let mut steps = 0;
    let result = loop {
        steps += 1;
        match mirror.resync_step(&mut cursor) {
            Ok(ResyncStep::Finished) => break Ok(true),
            Ok(ResyncStep::Copied(_)) if steps < MAX_STEPS => {}
            Ok(ResyncStep::Copied(_)) => break Ok(false),
            Err(error) => break Err(error),
        }
    };
    let progress = mirror.end_resync(cursor, result);
    if progress.state != "done" {
        return Err(format!("resync ended {progress:?} after {steps} batches"));
    }
    Ok((progress.copied, steps))
}

/// Run seeds `first..first + seeds`.
pub fn run(first: u64, seeds: u64) -> ResyncReport {
    run_with(first, seeds, Sabotage::None)
}

/// `run` with `sabotage` broken.
pub fn run_with(first: u64, seeds: u64, sabotage: Sabotage) -> ResyncReport {
    let started = Instant::now();
    let mut report = ResyncReport::default();
    for seed in first..first + seeds {
        if let Err(message) = run_seed(seed, sabotage, &mut report) {
            report.violations.push(format!(
                "seed {seed}: {message} (replay: vouch-sim resync --seed {seed} --seeds 1)"
            ));
        }
        report.seeds += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// The client's side of a seed: the model its operations update, and
/// what its inline writes count and break.
struct Client {
    model: Arc<Mutex<Model>>,
    /// Leg 0's storage: its held-log appends keep nothing during an
    /// inline write with `Sabotage::InlineBeforeHeld`.
    leg0: Arc<Recorder>,
    sabotage: Sabotage,
    inline_writes: AtomicU64,
    at_step_writes: AtomicU64,
}

impl Client {
    /// A write of whole blocks as the NBD reactor takes it (`inline`: the
    /// mirror's inline route if it needs no wait, else the worker's).
    fn write_served(
        &self,
        mirror: &Mirror,
        offset: u64,
        data: &Bytes,
        fua: bool,
        inline: bool,
    ) -> vouch_engine::Result<bool> {
        let sabotage = self.sabotage == Sabotage::InlineBeforeHeld;
        if sabotage {
            self.leg0.sabotage_held.store(true, Ordering::Relaxed);
        }
        let written = write_as_served(mirror, offset, data, fua, inline);
        if sabotage {
            self.leg0.sabotage_held.store(false, Ordering::Relaxed);
        }
        if let Ok(true) = written {
            self.inline_writes.fetch_add(1, Ordering::Relaxed);
        }
        written
    }

    /// At a step of leg 0's background commit: one inline write of 1-4
    /// whole blocks through `mirror`, modelled before it starts,
    /// acknowledged when the route takes it, taken back when it declines
    /// (it waits for nothing, so it never falls back to the worker here).
    fn write_at_step(&self, mirror: &Mirror, rng: &mut Rng) -> Result<(), String> {
        let count = rng.range(1, 4);
        let lba = rng.below(BLOCKS - count + 1);
        let data = Bytes::from(rng.bytes(count as usize * BLOCK));
        let lbas = lba as usize..(lba + count) as usize;
        let before = {
            let mut model = self.model.lock();
            let before = model.clone();
            for (at, block) in lbas.clone().zip(data.chunks_exact(BLOCK)) {
                model.write(at, block.to_vec());
            }
            before
        };
        let sabotage = self.sabotage == Sabotage::InlineBeforeHeld;
        if sabotage {
            self.leg0.sabotage_held.store(true, Ordering::Relaxed);
        }
        let written = mirror
            .submit_write(
                lba * BLOCK as u64,
                &data,
                false,
                vouch_engine::Admission::MustNotWait,
            )
            .map(|submitted| submitted.is_done());
        if sabotage {
            self.leg0.sabotage_held.store(false, Ordering::Relaxed);
        }
        let mut model = self.model.lock();
        match written {
            Ok(true) => {
                self.inline_writes.fetch_add(1, Ordering::Relaxed);
                self.at_step_writes.fetch_add(1, Ordering::Relaxed);
                model.acknowledged(lbas);
                Ok(())
            }
            Ok(false) => {
                *model = before;
                Ok(())
            }
            Err(error) => Err(format!("an inline write at a commit step: {error}")),
        }
    }
}

/// What leg 0's stepped commits run at their steps: inline client writes,
/// only while the simulator runs a commit as the background committer
/// (a commit a writer runs itself holds that writer's locks).
struct AtSteps {
    mirror: Weak<Mirror>,
    rng: Rng,
    background: bool,
    failed: Option<String>,
}

/// The closure leg 0's stepper calls at each step (`Stepper::set`).
fn at_steps(steps: Arc<Mutex<AtSteps>>, client: Arc<Client>) -> crate::stepper::AtStep {
    Box::new(move |_step: CommitStep| {
        let mut steps = steps.lock();
        let steps = &mut *steps;
        if !steps.background || steps.failed.is_some() {
            return;
        }
        let Some(mirror) = steps.mirror.upgrade() else {
            return;
        };
        for _ in 0..steps.rng.below(3) {
            if let Err(error) = client.write_at_step(&mirror, &mut steps.rng) {
                steps.failed = Some(error);
                return;
            }
        }
    })
}

/// Run the requested commits of `legs` as their background committers
/// would by now, leg 0's steps running inline writes (`at_steps`).
fn step_legs(
    legs: &[&Volume],
    steps: &Mutex<AtSteps>,
    rng: &mut Rng,
    report: &mut ResyncReport,
) -> Result<(), String> {
    steps.lock().background = true;
    report.background_commits += step_commits(legs.iter().copied(), rng);
    let mut steps = steps.lock();
    steps.background = false;
    match steps.failed.take() {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// One client operation through `mirror`, the model updated around it.
fn client_op(mirror: &Mirror, client: &Client, rng: &mut Rng) -> Result<(), String> {
    let model = &client.model;
    let lba = rng.below(BLOCKS);
    let count = rng.range(1, 6).min(BLOCKS - lba);
    let bytes = BLOCK as u64;
    let choice = rng.below(16);
    if choice < 2 {
        mirror.flush().map_err(|e| format!("flush: {e}"))?;
        let mut model = model.lock();
        model.durable(0..BLOCKS as usize);
        return Ok(());
    }
    if choice < 4 {
        {
            let mut model = model.lock();
            for at in lba..lba + count {
                model.write(at as usize, vec![0u8; BLOCK]);
            }
        }
        mirror
            .trim(lba * bytes, count * bytes, false)
            .map_err(|e| format!("trim: {e}"))?;
        model
            .lock()
            .acknowledged(lba as usize..(lba + count) as usize);
        return Ok(());
    }
    // A write: one in four partial (512-byte aligned), one in eight FUA.
    let (offset, length) = if choice < 8 {
        let start = lba * bytes + rng.below(8) * 512;
        let end = ((lba + count) * bytes - rng.below(8) * 512).max(start + 512);
        (start, end - start)
    } else {
        (lba * bytes, count * bytes)
    };
    let data = rng.bytes(length as usize);
    let fua = rng.chance(1, 8);
    let first = offset / bytes;
    let end = (offset + length).div_ceil(bytes);
    {
        let mut model = model.lock();
        for at in first..end {
            let mut block = model.newest[at as usize].clone();
            let from = offset.max(at * bytes);
            let to = (offset + length).min((at + 1) * bytes);
            block[(from - at * bytes) as usize..(to - at * bytes) as usize]
                .copy_from_slice(&data[(from - offset) as usize..(to - offset) as usize]);
            model.write(at as usize, block);
        }
    }
    let inline = rng.chance(1, 2);
    client
        .write_served(mirror, offset, &Bytes::from(data), fua, inline)
        .map_err(|e| format!("write: {e}"))?;
    let mut model = model.lock();
    model.acknowledged(first as usize..end as usize);
    if fua {
        model.durable(first as usize..end as usize);
    }
    Ok(())
}

/// The crash checker the hooks of leg 0, leg 1 and the map files call.
struct Checker {
    seed: u64,
    leg0: Arc<Recorder>,
    leg1: Arc<Recorder>,
    maps: SimMaps,
    model: Arc<Mutex<Model>>,
    /// Tearing unit of the map's unsynced writes.
    map_unit: u64,
    window: u64,
    rng: Rng,
    report: ResyncReport,
}

impl Checker {
    /// A crash now: image triples with each strategy on all three, and
    /// one random strategy on each.
    fn point(&mut self) {
        self.report.points += 1;
        let model = self.model.lock().clone();
        let mut choices: Vec<[Strategy; 3]> = STRATEGIES.iter().map(|&s| [s; 3]).collect();
        let mut pick = || STRATEGIES[self.rng.below(STRATEGIES.len() as u64) as usize];
        choices.push([pick(), pick(), pick()]);
        for [s0, s1, sm] in choices {
            let image0 = crash_image(&self.leg0.sim, &self.leg0.order(), s0, 4096, &mut self.rng);
            let image1 = crash_image(&self.leg1.sim, &self.leg1.order(), s1, 4096, &mut self.rng);
            let maps = self.maps.crash_image(sm, self.map_unit, &mut self.rng);
            self.checked(
                [image0, image1],
                maps,
                &model,
                false,
                &format!("{s0:?}/{s1:?}/map {sm:?}"),
            );
        }
        // The exporter process dies here: the kernel keeps every write
        // that returned, the legs' held logs and the map's unsynced writes.
        let legs = [self.leg0.sim.duplicate(), self.leg1.sim.duplicate()];
        let maps = self
            .maps
            .crash_image(Strategy::Persisted, self.map_unit, &mut self.rng);
        self.report.process_images += 1;
        self.checked(legs, maps, &model, true, "process crash");
    }

    /// Check one image triple, a violation recorded as `what`; `process`:
    /// leg 0 must keep every acknowledged write.
    fn checked(
        &mut self,
        [image0, image1]: [SimStorage; 2],
        maps: SimMaps,
        model: &Model,
        process: bool,
        what: &str,
    ) {
        self.report.images += 1;
        if let Err(message) = self.check(image0, image1, maps, model, process) {
            let index = self.report.images;
            self.report.violations.push(format!(
                "seed {} point {} image {index} ({what}): {message}",
                self.seed, self.report.points
            ));
        }
    }

    fn check(
        &mut self,
        image0: SimStorage,
        image1: SimStorage,
        maps: SimMaps,
        model: &Model,
        process: bool,
    ) -> Result<(), String> {
        let leg0 = open_image(image0).map_err(|e| format!("leg 0: {e}"))?;
        let leg1 = open_image(image1).map_err(|e| format!("leg 1: {e}"))?;
        let before0 = read_all(&*leg0).map_err(|e| format!("leg 0: {e}"))?;
        for (lba, block) in before0.iter().enumerate() {
            let print = fingerprint(block);
            if process && !model.kept(lba, print) {
                return Err(format!(
                    "leg 0 LBA {lba} lost an acknowledged write in a process crash"
                ));
            }
            if !model.allowed(lba, print) {
                return Err(format!(
                    "leg 0 LBA {lba} lost a flushed write (holds a value no flush or later write allows)"
                ));
            }
        }
        let mapped = maps.file(&map_path()).is_some();
        let state = if mapped {
            LegState::Stale
        } else {
            LegState::Active
        };
        let mirror = mirror_of(Arc::clone(&leg0), Some(Arc::clone(&leg1)), state)?;
        let unknown = if mapped {
            let unknown = track(&mirror, &maps, false)?;
            self.report.unknown_maps += u64::from(unknown.is_some());
            unknown
        } else {
            self.report.no_map += 1;
            None
        };
        self.check_leg1(&leg1, mirror.map_of(1).as_deref(), unknown.is_some(), model)?;
        // Restart: reads to leg 0 until a scrub; the map resynced to the
        // end; a scrub.
        mirror.read_one_leg_until_scrubbed();
        if mapped {
            resync_to_end(&mirror, unknown.is_some(), self.window)
                .map_err(|e| format!("restarted resync: {e}"))?;
        }
        let scrubbed = vouch_mirror::scrub::scrub(
            &mirror,
            &vouch_engine::scrub::ScrubOptions::default(),
            &JobControl::default(),
        )
        .map_err(|e| format!("scrub: {e}"))?;
        if scrubbed.left != 0 {
            return Err(format!("the scrub left blocks: {scrubbed:?}"));
        }
        let after0 = read_all(&*leg0).map_err(|e| format!("leg 0 after restart: {e}"))?;
        let after1 = read_all(&*leg1).map_err(|e| format!("leg 1 after restart: {e}"))?;
        for lba in 0..BLOCKS as usize {
            if after0[lba] != before0[lba] {
                return Err(format!("leg 0 LBA {lba} changed in the restart"));
            }
            if after1[lba] != after0[lba] {
                return Err(format!(
                    "after the restart's resync and scrub leg 1 LBA {lba} differs from leg 0"
                ));
            }
        }
        Ok(())
    }

    /// Every block of leg 1 holds a value once written there; one older
    /// than the last flush is covered by `map` (or the map's history is
    /// `unknown`: a full resync). With no map, every block is allowed.
    fn check_leg1(
        &mut self,
        leg1: &Volume,
        map: Option<&DirtyMap>,
        unknown: bool,
        model: &Model,
    ) -> Result<(), String> {
        let blocks = read_all(leg1).map_err(|e| format!("leg 1: {e}"))?;
        for (lba, block) in blocks.iter().enumerate() {
            let print = fingerprint(block);
            if !model.ever[lba].contains(&print) {
                return Err(format!("leg 1 LBA {lba} holds bytes never written there"));
            }
            if model.allowed(lba, print) || unknown {
                continue;
            }
            match map {
                Some(map) if map.is_dirty(lba as u64) => self.report.covered += 1,
                Some(_) => {
                    return Err(format!(
                        "leg 1 LBA {lba} holds a value older than the last flush and the map on disk does not cover it"
                    ))
                }
                None => {
                    return Err(format!(
                        "the map is gone but leg 1 LBA {lba} holds a value older than the last flush"
                    ))
                }
            }
        }
        Ok(())
    }
}

/// A new volume, half written and closed: two identical copies of it
/// (leg 0 and leg 1) and its blocks.
fn new_legs(rng: &mut Rng) -> Result<(SimStorage, SimStorage, Vec<Vec<u8>>), String> {
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(BLOCKS * BLOCK as u64);
    options.layout = if rng.chance(1, 2) {
        LayoutKind::Split
    } else {
        LayoutKind::Packed
    };
    let volume = Volume::create(Arc::new(sim.clone()), &options).map_err(|e| e.to_string())?;
    for lba in 0..BLOCKS / 2 {
        volume
            .write(lba * BLOCK as u64, &rng.bytes(BLOCK), false)
            .map_err(|e| e.to_string())?;
    }
    volume.close().map_err(|e| e.to_string())?;
    let leg0 = sim.crash_image(|_, _, _| u64::MAX);
    let leg1 = sim.crash_image(|_, _, _| u64::MAX);
    let blocks = read_all(&*open_image(sim)?)?;
    Ok((leg0, leg1, blocks))
}

/// Call `checker` before every I/O of both legs and the map files
/// (`None`: no more).
fn hook_all(checker: Option<&Arc<Mutex<Checker>>>, legs: [&Recorder; 2], maps: &SimMaps) {
    for recorder in legs {
        let hook = checker.map(Arc::clone);
        recorder.set_hook(hook.map(|checker| -> crate::recorder::Hook {
            Box::new(move |_, _| checker.lock().point())
        }));
    }
    let hook = checker.map(Arc::clone);
    maps.set_hook(
        hook.map(|checker| -> crate::map_store::MapHook {
            Box::new(move || checker.lock().point())
        }),
    );
}

/// A mirror and its two legs' volumes.
type Served = (Arc<Mirror>, Arc<Volume>, Arc<Volume>);

/// How the workload's legs open: leg 0 stepped by `leg0` (its steps run
/// inline writes), leg 1 stepped with nothing at its steps.
struct LegOptions {
    leg0: OpenOptions,
    leg1: OpenOptions,
}

/// Leg 1 back after `mirror` ran without it: attached to the running
/// mirror with its map as in memory (`vouch mirror resync --server`), or,
/// when not `online`, after a clean restart with its map read back from
/// the files. The mirror and both legs' volumes.
fn bring_back(
    online: bool,
    (mirror, leg0): (Arc<Mirror>, Arc<Volume>),
    (recorders, options): ([&Arc<Recorder>; 2], &LegOptions),
    maps: &SimMaps,
    model: &Mutex<Model>,
) -> Result<Served, String> {
    let reopen = |recorder: &Arc<Recorder>, options: &OpenOptions| {
        open(Arc::clone(recorder) as Arc<dyn Storage>, options)
    };
    if online {
        let leg1 = reopen(recorders[1], &options.leg1)?;
        mirror
            .attach(1, Arc::clone(&leg1) as Arc<dyn SealedDevice>)
            .map_err(|e| e.to_string())?;
        return Ok((mirror, leg0, leg1));
    }
    mirror.flush().map_err(|e| e.to_string())?;
    model.lock().durable(0..BLOCKS as usize);
    mirror.stop_resyncs().map_err(|e| e.to_string())?;
    drop(mirror);
    Arc::try_unwrap(leg0)
        .map_err(|_| "leg 0 still shared")?
        .close()
        .map_err(|e| e.to_string())?;
    let leg0 = reopen(recorders[0], &options.leg0)?;
    let leg1 = reopen(recorders[1], &options.leg1)?;
    let mirror = mirror_of(Arc::clone(&leg0), Some(Arc::clone(&leg1)), LegState::Stale)?;
    if let Some(why) = track(&mirror, maps, false)? {
        return Err(format!(
            "the map written while leg 1 was away is unusable: {why}"
        ));
    }
    Ok((mirror, leg0, leg1))
}

/// One seed; violations are pushed to `report`, setup errors returned.
pub fn run_seed(seed: u64, sabotage: Sabotage, report: &mut ResyncReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (leg0_sim, leg1_sim, initial) = new_legs(&mut rng)?;
    let map_unit = if rng.chance(1, 2) { 512 } else { 4096 };
    let window = [4, 8, 16][rng.below(3) as usize];
    let model = Arc::new(Mutex::new(Model::new(initial)));
    let maps = SimMaps::new();
    // Everything recorded from here on: a crash point at each I/O.
    let recorders = [
        Arc::new(Recorder::new(leg0_sim)),
        Arc::new(Recorder::new(leg1_sim)),
    ];
    let checker = Arc::new(Mutex::new(Checker {
        seed,
        leg0: Arc::clone(&recorders[0]),
        leg1: Arc::clone(&recorders[1]),
        maps: maps.clone(),
        model: Arc::clone(&model),
        map_unit,
        window,
        rng: rng.fork(),
        report: ResyncReport::default(),
    }));
    hook_all(Some(&checker), [&recorders[0], &recorders[1]], &maps);

    // The production scheduling: both legs' background committers stepped
    // by the seed, leg 0's steps running inline client writes.
    let client = Arc::new(Client {
        model: Arc::clone(&model),
        leg0: Arc::clone(&recorders[0]),
        sabotage,
        inline_writes: AtomicU64::new(0),
        at_step_writes: AtomicU64::new(0),
    });
    let stepper = Stepper::new(OrderingBreaks {
        empty_before_home: sabotage == Sabotage::EmptyBeforeHome,
        ..OrderingBreaks::default()
    });
    let options = LegOptions {
        leg0: stepper.options(stepped_tuning(&mut rng)),
        leg1: stepped_options(&mut rng),
    };
    let steps = Arc::new(Mutex::new(AtSteps {
        mirror: Weak::new(),
        rng: rng.fork(),
        background: false,
        failed: None,
    }));
    stepper.set(Some(at_steps(Arc::clone(&steps), Arc::clone(&client))));

    // Leg 1 away: client I/O reaches leg 0 only and is marked in the map.
    let leg0 = open(Arc::clone(&recorders[0]) as Arc<dyn Storage>, &options.leg0)?;
    let mirror = mirror_of(Arc::clone(&leg0), None, LegState::Stale)?;
    steps.lock().mirror = Arc::downgrade(&mirror);
    track(&mirror, &maps, true)?;
    for _ in 0..rng.range(4, 24) {
        client_op(&mirror, &client, &mut rng)?;
        step_legs(&[&leg0], &steps, &mut rng, report)?;
    }
    let online = rng.chance(1, 2);
    let (mirror, leg0, leg1) = bring_back(
        online,
        (mirror, leg0),
        ([&recorders[0], &recorders[1]], &options),
        &maps,
        &model,
    )?;
    steps.lock().mirror = Arc::downgrade(&mirror);
    let legs = [&*leg0, &*leg1];
    let mut cursor = mirror.begin_resync(1, false).map_err(|e| e.to_string())?;
    cursor.set_batch(window, 2);
    let (result, steps_taken) = drive(
        (&mirror, &legs),
        &mut cursor,
        (&client, &steps),
        &mut rng,
        report,
    )?;
    let progress = mirror.end_resync(cursor, result);
    report.copied += progress.copied;
    // After the resync (the leg active, its map gone): more client I/O,
    // where the mirror's inline route may take writes (it declines while
    // a leg's map is tracked: marking the map may sync).
    for _ in 0..rng.range(2, 8) {
        client_op(&mirror, &client, &mut rng)?;
        report.client_ops += 1;
        step_legs(&legs, &steps, &mut rng, report)?;
    }
    checker.lock().point();
    hook_all(None, [&recorders[0], &recorders[1]], &maps);
    stepper.set(None);
    let counts = maps.counts();
    report.map_writes += counts.writes;
    report.map_syncs += counts.syncs;
    report.inline_writes += client.inline_writes.load(Ordering::Relaxed);
    report.at_step_writes += client.at_step_writes.load(Ordering::Relaxed);
    report.merge(std::mem::take(&mut checker.lock().report));
    if progress.state != "done" {
        return Err(format!(
            "the resync under client writes ended {progress:?} after {steps_taken} batches"
        ));
    }
    // Both legs now hold what the client wrote last.
    for (leg, name) in [(&leg0, "leg 0"), (&leg1, "leg 1")] {
        let blocks = read_all(&**leg).map_err(|e| format!("{name}: {e}"))?;
        let model = model.lock();
        if let Some(lba) = (0..BLOCKS as usize).find(|&lba| blocks[lba] != model.newest[lba]) {
            return Err(format!(
                "after the resync {name} LBA {lba} is not what the client wrote last"
            ));
        }
    }
    Ok(())
}

/// Run the resync's batches with client I/O and the legs' background
/// commits between them: what the resync came to (`end_resync`'s input)
/// and the batches it took, or a client request's error.
fn drive(
    (mirror, legs): (&Mirror, &[&Volume]),
    cursor: &mut ResyncCursor,
    (client, steps): (&Client, &Mutex<AtSteps>),
    rng: &mut Rng,
    report: &mut ResyncReport,
) -> Result<(vouch_engine::Result<bool>, u64), String> {
    for taken in 1..=MAX_STEPS {
        report.steps += 1;
        match mirror.resync_step(cursor) {
            Ok(ResyncStep::Finished) => return Ok((Ok(true), taken)),
            Ok(ResyncStep::Copied(_)) => {}
            Err(error) => return Ok((Err(error), taken)),
        }
        for _ in 0..rng.range(0, 3) {
            report.client_ops += 1;
            client_op(mirror, client, rng)?;
        }
        step_legs(legs, steps, rng, report)?;
    }
    Ok((Ok(false), MAX_STEPS))
}
