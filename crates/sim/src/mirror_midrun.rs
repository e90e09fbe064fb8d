//! Crash points of a leg lost mid-run (`crates/mirror/src/written.rs`,
//! docs/CRASH_MODEL.md "A leg lost mid-run"). A mirror of leg 0 (a local
//! volume, its records and maps in a real directory) and leg 1 (a
//! "replica": a volume behind a switch that makes every request fail
//! `Unreachable`, the way a killed replica's do) takes random writes and
//! flushes; the replica is killed at a random point, losing what it had
//! not flushed (its storage's pending writes dropped), and the next
//! request takes it out as stale with a resync map.
//!
//! The exporter "crashes" at each step of that: the directory holding the
//! records and the maps is captured before and after the map is created,
//! before and after the records are written, and with a torn temporary
//! file of each; a state between the map's creation and the records (its
//! late marks and sync) is covered by the capture before the records,
//! since the records still call the leg active there. Each capture is put
//! back and the set reopened as after a crash (leg 1 unreachable).
//! Contract: the set opens; where the records call leg 1 stale, its map
//! is valid and marks every block on which the replica's surviving copy
//! differs from leg 0 at that moment, or the leg has unknown history (a
//! full resync); where they still call it active, no map for it is kept.
//!
//! Both volumes run the production scheduling (`crate::stepper`): their
//! background committers, stepped by the seed, take the commits writers
//! request between the writes (the replica's only while it lives). The
//! replica is a remote leg, which reserves no room, so the mirror's
//! writes take the worker's route, as they do in production.
//!
//! `run_with` breaks the route on purpose: the map is created without the
//! blocks written since the last flush (step 1 of the order in
//! docs/CRASH_MODEL.md skipped), so the records call the leg stale with a
//! map that misses what the replica lost unflushed, which the checks must
//! report.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use parking_lot::Mutex;
use vouch_engine::{
    Admission, Allocation, BlockDevice, CreateOptions, Error, Fault, OpenOptions, Result,
    SealedBlock, SealedDevice, SimStorage, Submitted, Volume,
};
use vouch_format::mirror::MirrorMember;
use vouch_mirror::set::{open_mirror_with, track_stale_legs, write_record, MirrorRecord};
use vouch_mirror::{DirtyMap, FileMembership, LegState, Membership, Mirror, MirrorLeg};

use crate::rng::Rng;
use crate::BLOCK;

const BLOCKS: u64 = 256;
const REMOTE: &str = "vouch://replica.sim:7000/leg1";
/// The set's uuid in its records and maps (the legs' own is not compared).
const UUID: [u8; 16] = [0x6d; 16];

/// What a run found.
#[derive(Debug, Default)]
pub struct MidrunReport {
    pub seeds: u64,
    /// Captures of the exporter's directory put back and reopened.
    pub captures: u64,
    /// Captures where the records called leg 1 stale with a valid map.
    pub mapped: u64,
    /// Blocks those maps marked, and the blocks the replica lacked.
    pub map_blocks: u64,
    pub lacking_blocks: u64,
    /// Requested commits the simulator ran as background committers.
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl MidrunReport {
    pub fn summary(&self) -> String {
        format!(
            "mirror mid-run loss: seeds={} captures={} mapped={} map blocks={} lacking={} background commits={} violations={} time={:.1}s",
            self.seeds,
            self.captures,
            self.mapped,
            self.map_blocks,
            self.lacking_blocks,
            self.background_commits,
            self.violations.len(),
            self.seconds
        )
    }
}

/// A volume that answers `Unreachable` once killed.
struct Replica {
    volume: Arc<Volume>,
    killed: AtomicBool,
}

impl Replica {
    fn live(&self) -> Result<&Volume> {
        if self.killed.load(Ordering::Acquire) {
            return Err(Error::Unreachable("replica killed".into()));
        }
        Ok(&self.volume)
    }
}

impl BlockDevice for Replica {
    fn size(&self) -> u64 {
        self.volume.size()
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<Vec<Range<u64>>> {
        self.live()?.read(offset, buf)
    }
    fn submit_write(
        &self,
        offset: u64,
        data: &bytes::Bytes,
        fua: bool,
        admission: Admission,
    ) -> Result<Submitted> {
        if admission != Admission::MayWait {
            return Ok(Submitted::Declined);
        }
        self.live()?.submit_write(offset, data, fua, admission)
    }
    fn flush(&self) -> Result<()> {
        self.live()?.flush()
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.live()?.trim(offset, length, fua)
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: vouch_engine::ZeroFlags) -> Result<()> {
        self.live()?.write_zeroes(offset, length, flags)
    }
    fn block_status(&self, offset: u64, length: u64, max: u64) -> Result<Vec<(u64, Allocation)>> {
        self.live()?.block_status(offset, length, max)
    }
    fn read_blocks_collecting(&self, first: u64, count: u64, out: &mut [u8]) -> Result<Vec<Fault>> {
        self.live()?.read_blocks_collecting(first, count, out)
    }
}

impl SealedDevice for Replica {
    fn read_sealed(&self, first: u64, count: u64) -> Result<Vec<SealedBlock>> {
        self.live()?.read_sealed(first, count)
    }
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: vouch_engine::SealedAdmission,
    ) -> Result<vouch_engine::Submitted> {
        self.live()?.submit_sealed(blocks, fua, admission)
    }
}

/// Files of a directory, by name.
type Capture = BTreeMap<String, Vec<u8>>;

fn capture(dir: &Path) -> Capture {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().is_file())
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            std::fs::read(entry.path()).ok().map(|bytes| (name, bytes))
        })
        .collect()
}

/// One capture and leg 0's blocks at that moment.
type Point = (&'static str, Capture, Vec<Vec<u8>>);

/// `FileMembership` that captures the directory around each step.
struct Capturing {
    inner: FileMembership,
    dir: PathBuf,
    leg0: Arc<Volume>,
    points: Arc<Mutex<Vec<Point>>>,
    /// Create maps without the blocks the mirror recorded (`run_with`).
    sabotage: bool,
}

impl Capturing {
    fn point(&self, name: &'static str, torn: Option<&str>) {
        let mut files = capture(&self.dir);
        if let Some(torn) = torn {
            // A temporary file cut short: its rename never happened.
            files.insert(torn.to_string(), vec![0x5a; 100]);
        }
        let blocks = read_all(&*self.leg0).unwrap_or_default();
        self.points.lock().push((name, files, blocks));
    }
}

impl Membership for Capturing {
    fn set_state(&self, leg: usize, state: LegState) -> Result<()> {
        self.point("before the records", Some("mirror.tmp"));
        self.point("before the records", None);
        let result = self.inner.set_state(leg, state);
        self.point("after the records", None);
        result
    }
    fn create_map(&self, leg: usize, blocks: u64, marked: &[Range<u64>]) -> Result<DirtyMap> {
        self.point("before the map", None);
        self.point("map half written", Some("mirror.dirty.tmp"));
        let marked = if self.sabotage { &[] } else { marked };
        let map = self.inner.create_map(leg, blocks, marked);
        self.point("after the map", None);
        map
    }
}

fn read_all(volume: &dyn BlockDevice) -> std::result::Result<Vec<Vec<u8>>, String> {
    crate::read_blocks(volume, BLOCKS)
}

fn open(sim: &SimStorage, options: &OpenOptions) -> std::result::Result<Arc<Volume>, String> {
    Volume::open(Arc::new(sim.clone()), options)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// Run seeds `first..first + seeds`.
pub fn run(first: u64, seeds: u64) -> MidrunReport {
    run_with(first, seeds, false)
}

/// `run`; with `sabotage`, each map is created without the blocks written
/// since the last flush.
pub fn run_with(first: u64, seeds: u64, sabotage: bool) -> MidrunReport {
    let started = Instant::now();
    let mut report = MidrunReport::default();
    for seed in first..first + seeds {
        // Per run kind too: a test process runs the plain and the broken
        // run at once.
        let dir = std::env::temp_dir().join(format!(
            "vouch-sim-midrun-{}-{seed}{}",
            std::process::id(),
            if sabotage { "-broken" } else { "" }
        ));
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(message) = std::fs::create_dir_all(&dir)
            .map_err(|e| e.to_string())
            .and_then(|()| run_seed(seed, &dir, sabotage, &mut report))
        {
            report.violations.push(format!("seed {seed}: {message}"));
        }
        let _ = std::fs::remove_dir_all(&dir);
        report.seeds += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// One seed; violations are pushed to `report`, setup errors returned.
pub fn run_seed(
    seed: u64,
    dir: &Path,
    sabotage: bool,
    report: &mut MidrunReport,
) -> std::result::Result<(), String> {
    let mut rng = Rng::new(seed);
    let sim0 = SimStorage::new();
    let volume = Volume::create(
        Arc::new(sim0.clone()),
        &CreateOptions::new(BLOCKS * BLOCK as u64),
    )
    .map_err(|e| e.to_string())?;
    volume.close().map_err(|e| e.to_string())?;
    let sim1 = sim0.crash_image(|_, _, _| u64::MAX);
    let record = MirrorRecord {
        leg: 0,
        uuid: UUID,
        epoch: 1,
        members: vec![
            MirrorMember {
                state: LegState::Active,
                path: dir.to_string_lossy().into_owned(),
            },
            MirrorMember {
                state: LegState::Active,
                path: REMOTE.into(),
            },
        ],
    };
    write_record(dir, &record).map_err(|e| e.to_string())?;

    let stepped = crate::stepper::stepped_options(&mut rng);
    let leg0 = open(&sim0, &stepped)?;
    let replica = Arc::new(Replica {
        volume: open(&sim1, &stepped)?,
        killed: AtomicBool::new(false),
    });
    let points = Arc::new(Mutex::new(Vec::new()));
    let membership = Capturing {
        inner: FileMembership::new(record.clone()),
        dir: dir.to_path_buf(),
        leg0: Arc::clone(&leg0),
        points: Arc::clone(&points),
        sabotage,
    };
    let mirror = Mirror::new(
        vec![
            MirrorLeg {
                name: dir.display().to_string(),
                device: Some(Arc::clone(&leg0) as Arc<dyn SealedDevice>),
                state: LegState::Active,
            },
            MirrorLeg {
                name: REMOTE.into(),
                device: Some(Arc::clone(&replica) as Arc<dyn SealedDevice>),
                state: LegState::Active,
            },
        ],
        Some(Box::new(membership)),
    )
    .map_err(|e| e.to_string())?;
    let kill_at = rng.range(1, 16);
    let mut survivor = None;
    for step in 0..rng.range(kill_at + 1, 24) {
        if step == kill_at {
            // Killed: what it had not flushed is gone.
            replica.killed.store(true, Ordering::Release);
            survivor = Some(sim1.crash_image(|_, _, _| 0));
        }
        let lba = rng.below(BLOCKS);
        let count = rng.range(1, 9).min(BLOCKS - lba);
        mirror
            .write(
                lba * BLOCK as u64,
                &rng.bytes(BLOCK * count as usize),
                false,
            )
            .map_err(|e| e.to_string())?;
        if rng.chance(1, 3) {
            mirror.flush().map_err(|e| e.to_string())?;
        }
        let alive = survivor.is_none();
        let volumes = [Some(&*leg0), alive.then_some(&*replica.volume)];
        report.background_commits +=
            crate::stepper::step_commits(volumes.into_iter().flatten(), &mut rng);
    }
    mirror.stop_resyncs().map_err(|e| e.to_string())?;
    drop(mirror);
    let foreground = crate::foreground_options();
    let survivor = read_all(&*open(&survivor.ok_or("never killed")?, &foreground)?)?;

    let points = std::mem::take(&mut *points.lock());
    if points.is_empty() {
        return Err("the replica was never taken out".into());
    }
    for (index, (name, files, leg0_then)) in points.into_iter().enumerate() {
        report.captures += 1;
        let fail = |what: String| format!("seed {seed} capture {index} ({name}): {what}");
        if let Err(error) = check_capture(dir, &files, &survivor, &leg0_then, &sim0, report) {
            report.violations.push(fail(error));
        }
    }
    Ok(())
}

/// Put `files` back in `dir`, reopen the set as after a crash (leg 1
/// unreachable) and check leg 1's map against what it lacks.
fn check_capture(
    dir: &Path,
    files: &Capture,
    survivor: &[Vec<u8>],
    leg0_then: &[Vec<u8>],
    sim0: &SimStorage,
    report: &mut MidrunReport,
) -> std::result::Result<(), String> {
    for entry in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        std::fs::remove_file(&path).map_err(|e| e.to_string())?;
    }
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).map_err(|e| e.to_string())?;
    }
    let recorded = vouch_mirror::set::read_record(dir).map_err(|e| e.to_string())?;
    let stale_then = recorded.members[1].state == LegState::Stale;
    let set = open_mirror_with(
        dir,
        true,
        &mut |_| {
            Volume::open(
                Arc::new(sim0.crash_image(|_, _, _| u64::MAX)),
                &crate::foreground_options(),
            )
        },
        &mut |url, _| Err(Error::Unreachable(format!("{url}: still down"))),
    )
    .map_err(|e| format!("the set does not open: {e}"))?;
    let view = set.record.clone();
    let (mirror, _) = set.into_mirror(true).map_err(|e| e.to_string())?;
    let tracked = track_stale_legs(&mirror, &view).map_err(|e| e.to_string())?;
    let lacking: Vec<u64> = (0..BLOCKS)
        .filter(|&lba| survivor[lba as usize] != leg0_then[lba as usize])
        .collect();
    if !stale_then {
        // The records still called it active (the crash came before they
        // said stale): it is marked stale now as a leg missing at open,
        // and what it lost unflushed is the unclean shutdown's to settle
        // (reads from one leg until a scrub: docs/CRASH_MODEL.md).
        return Ok(());
    }
    let Some((_, unknown)) = tracked.iter().find(|(leg, _)| *leg == 1) else {
        return Err("leg 1 is stale but not tracked".into());
    };
    if unknown.is_some() {
        return Ok(()); // a full resync
    }
    let map = mirror.map_of(1).ok_or("leg 1 has no map")?;
    report.mapped += 1;
    report.map_blocks += map.count();
    report.lacking_blocks += lacking.len() as u64;
    let missed: Vec<u64> = lacking
        .iter()
        .copied()
        .filter(|&lba| map.dirty_in(lba, lba + 1).is_empty())
        .collect();
    if !missed.is_empty() {
        return Err(format!(
            "the map ({} blocks) misses blocks the replica lacks: {missed:?}",
            map.count()
        ));
    }
    Ok(())
}
