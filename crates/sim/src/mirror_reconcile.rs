//! Crashes of the exporter during mirrored writes with the activity log
//! (`vouch_mirror::activity`, docs/CRASH_MODEL.md "Crash
//! reconciliation by an activity log"), then the reconciliation a restart
//! runs. Two legs on recording storage and the log's two files on the
//! simulator's map store take a random workload of writes (by the three
//! routes: the worker's `write`, the inline `try_write`, the completion
//! path `try_begin_write`), trims and flushes, the legs on the production
//! scheduling (background committers stepped by the seed between
//! operations, `crate::stepper`); extents are 4 blocks and
//! the log keeps 2, so extents are evicted (after a flush the writer
//! forces) all the time. The log's update writes and syncs its two files
//! (at once in production) in an order the seed chooses
//! (`SimMaps::interleave_with`), so a seed replays exactly. At every
//! write and sync of either leg and every
//! write, sync and create of the log, images of both legs and of the log
//! are taken (both legs cut alike, or one with everything and the other
//! with nothing since its last sync). Each is recovered as a restart
//! does and checked:
//! - the log is readable, and every block on which the legs differ lies
//!   in an extent it names (the log's ORDER POINT);
//! - every block reads a value the contract allows (reads go to leg 0
//!   while the reconciliation runs);
//! - the reconciliation of the named extents alone leaves the legs
//!   identical block for block, holding what clients read before it; it
//!   counts no corrected error and faults no leg.
//!
//! `run` with `sabotage` makes the log's store ignore syncs (a write may
//! then reach the legs before the log naming its extent is durable): the
//! checks must find violations.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::{BlockDevice, SimStorage};
use vouch_mirror::{ActivityGeometry, ActivityLog, MapStore, Recovered};

use crate::fingerprint;
use crate::map_store::SimMaps;
use crate::mirror_write::{
    flush_modelled, mirror_over, model_write, open_crash_legs, prefilled_legs, trim_modelled,
    write_completing, Allowed, Deferred, Leg1,
};
use crate::recorder::{crash_image, Strategy, STRATEGIES};
use crate::rng::Rng;
use crate::stepper::step_commits;
use crate::BLOCK;

const BLOCKS: u64 = 32;
const OPERATIONS: usize = 16;
const EXTENT_BLOCKS: u64 = 4;
const ACTIVE_EXTENTS: usize = 2;
const UUID: [u8; 16] = [0x5a; 16];

/// What a run found.
#[derive(Debug, Default)]
pub struct ReconcileReport {
    pub seeds: u64,
    /// Crash points: writes and syncs of either leg, and of the log.
    pub leg_points: u64,
    pub log_points: u64,
    /// Image triples (both legs and the log) checked.
    pub images: u64,
    /// Images whose legs differed after recovery.
    pub diverged: u64,
    /// Extents the recovered logs named, and blocks reconciliation copied.
    pub extents_reconciled: u64,
    pub copied: u64,
    /// Corrected errors counted on any leg, and legs faulted (must be 0).
    pub faults_counted: u64,
    /// Log updates (each an fsync) and the writes by each route.
    pub log_updates: u64,
    pub worker_writes: u64,
    pub inline_writes: u64,
    pub completed_writes: u64,
    /// Requested commits the simulator ran as a leg's background committer.
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl ReconcileReport {
    pub fn summary(&self) -> String {
        format!(
            "mirror reconcile: seeds={} crash_points={} (log {}) image_triples={} diverged={} extents_reconciled={} copied={} faults_counted={} log_updates={} writes worker/inline/completed={}/{}/{} leg background commits={} violations={} time={:.1}s",
            self.seeds,
            self.leg_points + self.log_points,
            self.log_points,
            self.images,
            self.diverged,
            self.extents_reconciled,
            self.copied,
            self.faults_counted,
            self.log_updates,
            self.worker_writes,
            self.inline_writes,
            self.completed_writes,
            self.background_commits,
            self.violations.len(),
            self.seconds
        )
    }
}

/// One crash: both legs' images, the log's files, what each block may read.
struct Crash {
    legs: [SimStorage; 2],
    log: SimMaps,
    allowed: Allowed,
}

fn geometry() -> ActivityGeometry {
    ActivityGeometry {
        uuid: UUID,
        blocks: BLOCKS,
        extent_blocks: EXTENT_BLOCKS,
        active_extents: ACTIVE_EXTENTS,
    }
}

fn log_dirs() -> Vec<PathBuf> {
    vec![PathBuf::from("leg0"), PathBuf::from("leg1")]
}

/// Run seeds `first..first + seeds`; with `sabotage` the log's syncs do
/// nothing.
pub fn run(first: u64, seeds: u64, sabotage: bool) -> ReconcileReport {
    let started = Instant::now();
    let mut report = ReconcileReport::default();
    for seed in first..first + seeds {
        if let Err(message) = run_seed(seed, sabotage, &mut report) {
            report.violations.push(format!("seed {seed}: {message}"));
        }
        report.seeds += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// The crash images now: for each pair of strategies, both legs' and
/// the log's (its pending writes cut by a strategy of its own).
type Snapshot = Arc<dyn Fn(Option<(usize, &SimStorage, &[vouch_engine::ObjectId])>) + Send + Sync>;

fn run_seed(seed: u64, sabotage: bool, report: &mut ReconcileReport) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (allowed, recorders, [volume0, volume1]) = prefilled_legs(&mut rng, BLOCKS)?;
    let zero = fingerprint(&[0u8; BLOCK]);
    let deferred: Deferred = Arc::new(Mutex::new(Vec::new()));
    let leg1 = match rng.below(4) {
        0 | 1 => Leg1::Local,
        n => Leg1::Travelling {
            lands_when_waited: n == 3,
            completes: Some(deferred.clone()),
        },
    };
    let legs = [Arc::clone(&volume0), Arc::clone(&volume1)];
    let mirror = mirror_over([volume0, volume1], leg1)?;
    let maps = SimMaps::new();
    // The log's update writes its two files at once in production: the
    // seed orders their writes and syncs.
    maps.interleave_with(rng.fork());
    if sabotage {
        maps.sabotage_sync();
    }
    let (log, _) = ActivityLog::open(Arc::new(maps.clone()), &log_dirs(), geometry())
        .map_err(|e| format!("activity log: {e}"))?;
    let log = Arc::new(log);
    mirror
        .keep_activity_log(Arc::clone(&log))
        .map_err(|e| e.to_string())?;

    let model = Arc::new(Mutex::new(allowed));
    let crashes: Arc<Mutex<Vec<Crash>>> = Arc::new(Mutex::new(Vec::new()));
    let (leg_points, log_points) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let snapshot: Snapshot = {
        let (recorders, maps) = (recorders.clone(), maps.clone());
        let (model, crashes) = (model.clone(), crashes.clone());
        let rng = Mutex::new(rng.fork());
        Arc::new(move |at_leg| {
            let mut rng = rng.lock();
            let mut pairs = vec![
                (Strategy::Persisted, Strategy::Dropped),
                (Strategy::Dropped, Strategy::Persisted),
            ];
            let strategy = STRATEGIES[rng.below(STRATEGIES.len() as u64) as usize];
            pairs.push((strategy, strategy));
            let orders = [0, 1].map(|leg| match at_leg {
                Some((at, _, order)) if at == leg => order.to_vec(),
                _ => recorders[leg].order(),
            });
            for (first, second) in pairs {
                let legs = [0, 1].map(|leg| {
                    let sim = match at_leg {
                        Some((at, sim, _)) if at == leg => sim,
                        _ => &recorders[leg].sim,
                    };
                    let strategy = if leg == 0 { first } else { second };
                    crash_image(sim, &orders[leg], strategy, 4096, &mut rng)
                });
                let log_strategy = STRATEGIES[rng.below(STRATEGIES.len() as u64) as usize];
                let log = maps.crash_image(log_strategy, 512, &mut rng);
                crashes.lock().push(Crash {
                    legs,
                    log,
                    allowed: model.lock().clone(),
                });
            }
        })
    };
    for (at, recorder) in recorders.iter().enumerate() {
        let (snapshot, points) = (snapshot.clone(), leg_points.clone());
        recorder.set_hook(Some(Box::new(move |sim, order| {
            points.fetch_add(1, Ordering::Relaxed);
            snapshot(Some((at, sim, order)));
        })));
    }
    {
        let (snapshot, points) = (snapshot.clone(), log_points.clone());
        maps.set_hook(Some(Box::new(move || {
            points.fetch_add(1, Ordering::Relaxed);
            snapshot(None);
        })));
    }

    for _ in 0..OPERATIONS {
        let lba = rng.below(BLOCKS);
        let count = rng.range(1, 6).min(BLOCKS - lba);
        match rng.below(7) {
            0 => flush_modelled(&mirror, &model)?,
            1 => trim_modelled(&mirror, &model, lba, count, zero)?,
            _ => {
                let data = rng.bytes(count as usize * BLOCK);
                model_write(&model, lba, &data);
                let offset = lba * BLOCK as u64;
                let fua = rng.chance(1, 6);
                let route = rng.below(3);
                if !fua
                    && route == 0
                    && mirror
                        .submit_write(
                            offset,
                            &bytes::Bytes::copy_from_slice(&data),
                            false,
                            vouch_engine::Admission::MustNotWait,
                        )
                        .map_err(|e| e.to_string())?
                        .is_done()
                {
                    report.inline_writes += 1;
                } else if !fua && route == 1 && write_completing(&mirror, offset, &data, &deferred)?
                {
                    report.completed_writes += 1;
                } else {
                    mirror
                        .write(offset, &data, fua)
                        .map_err(|e| format!("write: {e}"))?;
                    report.worker_writes += 1;
                }
            }
        }
        // The legs' background committers, stepped: their commits'
        // journal and home writes are crash points too.
        report.background_commits += step_commits(legs.iter().map(|leg| &**leg), &mut rng);
    }
    drop(legs);
    for recorder in &recorders {
        recorder.set_hook(None);
    }
    maps.set_hook(None);
    report.leg_points += leg_points.load(Ordering::Relaxed);
    report.log_points += log_points.load(Ordering::Relaxed);
    report.log_updates += log.updates();
    drop(mirror);
    let crashes = std::mem::take(&mut *crashes.lock());
    for (index, crash) in crashes.into_iter().enumerate() {
        report.images += 1;
        if let Err(message) = check_crash(crash, report) {
            report
                .violations
                .push(format!("seed {seed} crash image triple {index}: {message}"));
        }
    }
    Ok(())
}

fn read_block(device: &dyn BlockDevice, lba: u64, what: &str) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; BLOCK];
    device
        .read(lba * BLOCK as u64, &mut buf)
        .map_err(|e| format!("{what} LBA {lba} fails: {e}"))?;
    Ok(buf)
}

/// Recover one crash as a restart does, reconcile, check the contract.
fn check_crash(crash: Crash, report: &mut ReconcileReport) -> Result<(), String> {
    let volumes = open_crash_legs(crash.legs)?;
    let store: Arc<dyn MapStore> = Arc::new(crash.log);
    let (log, recovered) = ActivityLog::open(store, &log_dirs(), geometry())
        .map_err(|e| format!("the activity log does not open: {e}"))?;
    let Recovered::Extents(extents) = recovered else {
        return Err(format!("the activity log is unknown: {recovered:?}"));
    };
    // The ORDER POINT: legs differ only inside logged extents.
    let mut diverged = false;
    for lba in 0..BLOCKS {
        let left = read_block(&*volumes[0], lba, "leg 0")?;
        let right = read_block(&*volumes[1], lba, "leg 1")?;
        if left != right {
            diverged = true;
            if !extents.contains(&(lba / EXTENT_BLOCKS)) {
                return Err(format!(
                    "the legs differ at LBA {lba}, outside the extents the log names ({extents:?})"
                ));
            }
        }
    }
    report.diverged += u64::from(diverged);
    report.extents_reconciled += extents.len() as u64;
    let mirror = mirror_over([volumes[0].clone(), volumes[1].clone()], Leg1::Local)?;
    mirror
        .keep_activity_log(Arc::new(log))
        .map_err(|e| e.to_string())?;
    let cursor = mirror.begin_reconcile();
    if cursor.is_some() == extents.is_empty() {
        return Err("a reconciliation must start exactly when the log names extents".into());
    }
    let mut seen = Vec::with_capacity(BLOCKS as usize);
    for lba in 0..BLOCKS {
        let print = fingerprint(&read_block(&*mirror, lba, "the mirror")?);
        if !crash.allowed[lba as usize].contains(&print) {
            return Err(format!(
                "LBA {lba} reads a value no write or flush allows ({} allowed)",
                crash.allowed[lba as usize].len()
            ));
        }
        seen.push(print);
    }
    if let Some(mut cursor) = cursor {
        while mirror
            .reconcile_step(&mut cursor)
            .map_err(|e| format!("reconcile: {e}"))?
            > 0
        {}
        let progress = mirror.end_reconcile(cursor, Ok(true));
        if progress.state != "done" || progress.error.is_some() || progress.extents_left != 0 {
            return Err(format!("the reconciliation did not settle: {progress:?}"));
        }
        report.copied += progress.blocks_copied;
    }
    if mirror.reads_one_leg() {
        return Err("reads stay on one leg after the reconciliation".into());
    }
    for leg in mirror.status() {
        report.faults_counted += leg.corrected;
        if leg.corrected > 0 || leg.state != vouch_mirror::LegState::Active {
            return Err(format!("the reconciliation blamed a leg: {leg:?}"));
        }
        if leg.repairs.iter().any(|repair| repair.kind != "reconcile") {
            return Err(format!("a repair that is not a reconciliation: {leg:?}"));
        }
    }
    for lba in 0..BLOCKS {
        for (at, volume) in volumes.iter().enumerate() {
            let print = fingerprint(&read_block(&**volume, lba, &format!("leg {at}"))?);
            if print != seen[lba as usize] {
                return Err(format!(
                    "leg {at} LBA {lba} after the reconciliation does not hold what clients read before it"
                ));
            }
        }
    }
    Ok(())
}
