//! Crashes of the exporter during mirrored writes (the mirror's `submit_write`, `trim`,
//! `flush`; docs/CRASH_MODEL.md "Mirrors"). Two legs of one volume on
//! recording storage take a random workload of writes, trims and flushes
//! through a `Mirror`. The legs run the production scheduling: each has a
//! background committer the seed steps (`crate::stepper`), so the
//! mirror's inline route (`try_write_shared`) and its completion path
//! (`try_begin_write`, `complete.rs`) reserve room in the legs' write-back
//! buffers and store into it (`SealedAdmission::Reserved`) as they do in
//! production, and the legs' requested commits run between operations.
//! The exporter is one process, so a crash cuts both
//! legs at the same instant: at every write and sync either leg issues, a
//! crash image of *each* leg is built (both with one strategy, or one leg
//! with everything and the other with nothing since its last sync — the
//! crash between the legs), and a process crash of both (every write that
//! returned and the held logs kept: every acknowledged write must read
//! back). Each pair is recovered as a restart does it
//! (reads go to the first leg until a scrub, `read_one_leg_until_scrubbed`)
//! and checked:
//! - every block reads a value the contract allows: what the last
//!   completed flush made durable, or a write issued since;
//! - a scrub repairs every difference (nothing left, no conflict), and
//!   afterwards both legs hold, block for block, what was read before the
//!   scrub: no block changes under a reader without a write.

use std::sync::Arc;
use std::time::Instant;
use vouch_engine::DeviceWrites;

use bytes::Bytes;
use parking_lot::Mutex;
use vouch_engine::jobs::JobControl;
use vouch_engine::{
    BlockDevice, CreateOptions, Fault, LayoutKind, SealedAdmission, SealedBlock, SealedDevice,
    SimStorage, Storage, Submitted, Volume, WriteDone,
};
use vouch_mirror::{LegState, Mirror, MirrorLeg};

use crate::fingerprint;
use crate::recorder::{crash_image, Recorder, Strategy, STRATEGIES};
use crate::rng::Rng;
use crate::stepper::step_commits;
use crate::BLOCK;

/// Blocks in the volume, and operations per seed.
const BLOCKS: u64 = 32;
const OPERATIONS: usize = 14;

/// What an exporter-crash run found.
#[derive(Debug, Default)]
pub struct MirrorWriteReport {
    pub seeds: u64,
    /// Crash points (writes and syncs of either leg) and image pairs checked.
    pub crash_points: u64,
    pub images: u64,
    /// Image pairs whose legs differed on some block after recovery.
    pub diverged: u64,
    /// Blocks the scrubs rewrote.
    pub repaired: u64,
    /// Seeds whose leg 1 took writes as a remote replica does
    /// (`submit_sealed` answering `Started`).
    pub travelling: u64,
    /// Writes that went through the completion path (`try_begin_write`,
    /// leg 1 answering by callback: `SealedAdmission::Callback`).
    pub completed_later: u64,
    /// Writes the mirror's inline route took (`try_write_shared`).
    pub inline_writes: u64,
    /// Writes the worker's route took (`write_shared`, without FUA: a
    /// FUA write is durable before it is acknowledged).
    pub worker_writes: u64,
    /// Image pairs of a process crash (kernel state kept).
    pub process_images: u64,
    /// Requested commits the simulator ran as a leg's background committer.
    pub background_commits: u64,
    pub violations: Vec<String>,
    pub seconds: f64,
}

impl MirrorWriteReport {
    pub fn summary(&self) -> String {
        format!(
            "mirror write: seeds={} (leg 1 remote-style in {}; writes completed by callback {}, inline {}, by the worker without FUA {}; leg background commits {}) crash_points={} image_pairs={} (process {}) diverged={} repaired={} violations={} time={:.1}s",
            self.seeds,
            self.travelling,
            self.completed_later,
            self.inline_writes,
            self.worker_writes,
            self.background_commits,
            self.crash_points,
            self.images,
            self.process_images,
            self.diverged,
            self.repaired,
            self.violations.len(),
            self.seconds
        )
    }
}

/// Per block, the fingerprints a read may return after a crash now.
pub(crate) type Allowed = Vec<Vec<u64>>;

/// A crash: both legs' images and what each block may read.
struct Crash {
    legs: [SimStorage; 2],
    allowed: Allowed,
    process: bool,
}

/// Run seeds `first..first + seeds`.
pub fn run(first: u64, seeds: u64) -> MirrorWriteReport {
    run_with(first, seeds, Sabotage::None)
}

/// A route whose ordering a self-test breaks: leg 0's held log keeps
/// nothing of the writes that take it (the route acknowledging before the
/// local leg holds the write).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    None,
    /// The completion path (`try_begin_write`, `complete.rs`).
    Completion,
    /// The inline route into reserved room (`try_write_shared`,
    /// `SealedAdmission::Reserved`).
    Reserved,
    /// The worker's route (`write_shared`: `SealedAdmission::Here`, a
    /// travelling leg answering `Started`), which may wait.
    Worker,
    /// Not the held log: the mirror's own executor (`admit.rs`
    /// `Issue::run`) counts a travelling leg's started write done without
    /// waiting for it (`Mirror::break_started_writes`).
    Unwaited,
}

/// `run`, breaking `sabotage`'s route.
pub fn run_with(first: u64, seeds: u64, sabotage: Sabotage) -> MirrorWriteReport {
    let started = Instant::now();
    let mut report = MirrorWriteReport::default();
    for seed in first..first + seeds {
        if let Err(message) = run_seed(seed, sabotage, &mut report) {
            report.violations.push(format!("seed {seed}: {message}"));
        }
        report.seeds += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// How leg 1 takes the mirror's writes: as a local volume does
/// (`submit_sealed` done), or as a remote replica does (`Started`:
/// started before the local leg is written, waited for after), its write
/// landing when it is started or only when it is waited for — the two
/// orders a replica's round trip allows against the local leg's writes.
/// With `completes`, leg 1 is named as a remote member and also answers
/// by callback (`SealedAdmission::Callback`), so non-FUA writes take the mirror's
/// completion path (`try_begin_write`), its answer arriving at once or
/// after the local leg was written (`Deferred`).
/// With `Local`, both legs are volumes as they are (their room in the
/// write-back buffers takes the mirror's inline route).
#[derive(Clone)]
pub(crate) enum Leg1 {
    Local,
    Travelling {
        lands_when_waited: bool,
        completes: Option<Deferred>,
    },
}

/// Answers of leg 1 held back until the write's starter returned, then
/// delivered on the simulator's thread (deterministic, like a replica's
/// reader thread answering after the local leg's write).
pub(crate) type Deferred = Arc<Mutex<Vec<Box<dyn FnOnce() + Send>>>>;

pub(crate) fn mirror_over(volumes: [Arc<Volume>; 2], leg1: Leg1) -> Result<Arc<Mirror>, String> {
    let legs = volumes
        .into_iter()
        .enumerate()
        .map(|(index, volume)| {
            let (device, name): (Arc<dyn SealedDevice>, String) = match &leg1 {
                Leg1::Travelling {
                    lands_when_waited,
                    completes,
                } if index == 1 => (
                    Arc::new(Travelling {
                        volume,
                        lands_when_waited: *lands_when_waited,
                        completes: completes.clone(),
                    }),
                    match completes {
                        Some(_) => "vouch://sim:1/leg1".into(),
                        None => format!("leg{index}"),
                    },
                ),
                _ => (volume, format!("leg{index}")),
            };
            MirrorLeg {
                name,
                device: Some(device),
                state: LegState::Active,
            }
        })
        .collect();
    Mirror::new(legs, None).map_err(|e| e.to_string())
}

/// A volume taking sealed writes the way a remote replica does
/// (`vouch_replica::RemoteLeg`): `submit_sealed` starts them and the
/// completion the `StartWrite` is given takes the outcome; a FUA write is flushed there too.
/// They land as the replica server stores them (`land`). Everything else
/// is the volume's; it reserves no room (a remote leg never does).
struct Travelling {
    volume: Arc<Volume>,
    lands_when_waited: bool,
    completes: Option<Deferred>,
}

/// Store blocks on `volume` as the replica server does: its own routes
/// (`vouch_replica::server`, run by `replica_server::serve_write`).
fn land(volume: &Volume, blocks: &[SealedBlock], fua: bool) -> vouch_engine::Result<()> {
    crate::replica_server::serve_write(volume, blocks, fua)
}

impl BlockDevice for Travelling {
    forward_device!(volume);
    fn read_blocks_collecting(
        &self,
        first: u64,
        count: u64,
        out: &mut [u8],
    ) -> vouch_engine::Result<Vec<Fault>> {
        self.volume.read_blocks_collecting(first, count, out)
    }
    fn next_possible_data(&self, lba: u64) -> vouch_engine::Result<u64> {
        self.volume.next_possible_data(lba)
    }
    fn verify(&self, first: u64, count: u64) -> vouch_engine::Result<Vec<Fault>> {
        self.volume.verify(first, count)
    }
}

impl SealedDevice for Travelling {
    fn read_sealed(&self, first: u64, count: u64) -> vouch_engine::Result<Vec<SealedBlock>> {
        self.volume.read_sealed(first, count)
    }
    /// As `RemoteLeg::submit_sealed`: the waiting admissions answer
    /// `Started` (landing now, or when waited for), `Callback` is started
    /// when the leg `completes` (its answer delivered at once or held back
    /// in `Deferred`), `MustNotWait` is declined, no room is reserved.
    fn submit_sealed(
        &self,
        blocks: &[SealedBlock],
        fua: bool,
        admission: SealedAdmission,
    ) -> vouch_engine::Result<Submitted> {
        let volume = Arc::clone(&self.volume);
        match admission {
            SealedAdmission::MayWait | SealedAdmission::Here => {
                if self.lands_when_waited {
                    let blocks = blocks.to_vec();
                    return Ok(Submitted::Started(Box::new(move |done: WriteDone| {
                        done(land(&volume, &blocks, fua))
                    })));
                }
                let landed = land(&volume, blocks, fua);
                Ok(Submitted::Started(Box::new(move |done: WriteDone| {
                    done(landed)
                })))
            }
            SealedAdmission::Callback if self.completes.is_some() => {
                let deferred = self.completes.clone().filter(|_| self.lands_when_waited);
                let blocks = blocks.to_vec();
                Ok(Submitted::Started(Box::new(
                    move |done: WriteDone| match deferred {
                        Some(deferred) => deferred
                            .lock()
                            .push(Box::new(move || done(land(&volume, &blocks, fua)))),
                        None => done(land(&volume, &blocks, fua)),
                    },
                )))
            }
            SealedAdmission::Callback | SealedAdmission::MustNotWait => Ok(Submitted::Declined),
            SealedAdmission::Reserved => Err(vouch_engine::Error::Unsupported(
                "writes into reserved room (a travelling leg reserves none)".into(),
            )),
        }
    }
    fn answers_by_callback(&self) -> bool {
        self.completes.is_some()
    }
    fn seal_blocks(
        &self,
        first: u64,
        data: &Bytes,
        generation: u64,
    ) -> vouch_engine::Result<Vec<SealedBlock>> {
        self.volume.seal_blocks(first, data, generation)
    }
    fn generation_clock(&self) -> u64 {
        self.volume.generation_clock()
    }
}

/// Two legs of one volume of `blocks` blocks (`prefilled_volume`), each
/// opened on its own recording copy: what each block may read (the
/// model), the recorders and the open legs.
#[allow(clippy::type_complexity)]
pub(crate) fn prefilled_legs(
    rng: &mut Rng,
    blocks: u64,
) -> Result<(Allowed, [Arc<Recorder>; 2], [Arc<Volume>; 2]), String> {
    let (allowed, sim) = prefilled_volume(rng, blocks)?;
    let recorders = [0, 1].map(|_| Arc::new(Recorder::new(sim.crash_image(|_, _, _| u64::MAX))));
    let open = crate::stepper::stepped_options(rng);
    let volumes = [0, 1].map(|at| {
        Volume::open(recorders[at].clone() as Arc<dyn Storage>, &open)
            .map(Arc::new)
            .map_err(|e| format!("leg {at}: {e}"))
    });
    let [Ok(volume0), Ok(volume1)] = volumes else {
        return Err("a leg does not open".into());
    };
    Ok((allowed, recorders, [volume0, volume1]))
}

/// A volume of `blocks` blocks (split or packed at random), its first
/// half written with random blocks and closed: what each block may read
/// and its storage.
pub(crate) fn prefilled_volume(
    rng: &mut Rng,
    blocks: u64,
) -> Result<(Allowed, SimStorage), String> {
    let sim = SimStorage::new();
    let mut options = CreateOptions::new(blocks * BLOCK as u64);
    options.layout = if rng.chance(1, 2) {
        LayoutKind::Split
    } else {
        LayoutKind::Packed
    };
    let volume = Volume::create(Arc::new(sim.clone()), &options).map_err(|e| e.to_string())?;
    let zero = fingerprint(&[0u8; BLOCK]);
    let mut allowed: Allowed = vec![vec![zero]; blocks as usize];
    for lba in 0..blocks / 2 {
        let data = rng.bytes(BLOCK);
        volume
            .write(lba * BLOCK as u64, &data, false)
            .map_err(|e| e.to_string())?;
        allowed[lba as usize] = vec![fingerprint(&data)];
    }
    volume.close().map_err(|e| e.to_string())?;
    Ok((allowed, sim))
}

/// One seed; violations are pushed to `report`, setup errors returned.
pub fn run_seed(
    seed: u64,
    sabotage: Sabotage,
    report: &mut MirrorWriteReport,
) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let (allowed, recorders, volumes) = prefilled_legs(&mut rng, BLOCKS)?;
    let zero = fingerprint(&[0u8; BLOCK]);
    let deferred: Deferred = Arc::new(Mutex::new(Vec::new()));
    let leg1 = match rng.below(3) {
        0 => Leg1::Local,
        n => Leg1::Travelling {
            lands_when_waited: n == 2,
            completes: rng.chance(1, 2).then(|| deferred.clone()),
        },
    };
    report.travelling += u64::from(!matches!(leg1, Leg1::Local));
    let mirror = mirror_over(volumes.clone(), leg1)?;
    if sabotage == Sabotage::Unwaited {
        mirror.break_started_writes();
    }

    // The models the hooks read: what each block may hold if the exporter
    // lost power now (`model`), or if the process alone died (`acked`:
    // the last acknowledged value, or one in flight). Updated before each
    // operation (its value is allowed while it runs), after each flush
    // (`model`: only the value from before it) and after each write
    // (`acked`: its value).
    let model = Arc::new(Mutex::new(allowed.clone()));
    let acked = Arc::new(Mutex::new(allowed));
    let crashes: Arc<Mutex<Vec<Crash>>> = Arc::new(Mutex::new(Vec::new()));
    let points = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for at in 0..2 {
        let other = Arc::clone(&recorders[1 - at]);
        let (model, acked, crashes, points) = (
            model.clone(),
            acked.clone(),
            crashes.clone(),
            points.clone(),
        );
        let mut hook_rng = rng.fork();
        recorders[at].set_hook(Some(Box::new(move |sim, order| {
            points.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let other_order = other.order();
            let mut pairs: Vec<(Strategy, Strategy)> = vec![
                (Strategy::Persisted, Strategy::Dropped),
                (Strategy::Dropped, Strategy::Persisted),
            ];
            let strategy = STRATEGIES[hook_rng.below(STRATEGIES.len() as u64) as usize];
            pairs.push((strategy, strategy));
            let in_order = |mine: SimStorage, theirs: SimStorage| {
                if at == 0 {
                    [mine, theirs]
                } else {
                    [theirs, mine]
                }
            };
            for (mine, theirs) in pairs {
                let image = crash_image(sim, order, mine, 4096, &mut hook_rng);
                let other_image =
                    crash_image(&other.sim, &other_order, theirs, 4096, &mut hook_rng);
                crashes.lock().push(Crash {
                    legs: in_order(image, other_image),
                    allowed: model.lock().clone(),
                    process: false,
                });
            }
            // The exporter process dies here: both legs keep every write
            // that returned and their held logs.
            crashes.lock().push(Crash {
                legs: in_order(sim.duplicate(), other.sim.duplicate()),
                allowed: acked.lock().clone(),
                process: true,
            });
        })));
    }

    for _ in 0..OPERATIONS {
        let lba = rng.below(BLOCKS);
        let count = rng.range(1, 4).min(BLOCKS - lba);
        match rng.below(6) {
            0 => flush_modelled(&mirror, &model)?,
            1 => {
                model_write(&acked, lba, &vec![0u8; count as usize * BLOCK]);
                trim_modelled(&mirror, &model, lba, count, zero)?;
                acknowledged(&acked, lba, count);
            }
            _ => {
                let data = rng.bytes(count as usize * BLOCK);
                model_write(&model, lba, &data);
                model_write(&acked, lba, &data);
                let fua = rng.chance(1, 5);
                let offset = lba * BLOCK as u64;
                // The NBD reactor's routes first, as `serve` tries them:
                // the completion path (a mirror with a remote leg), the
                // inline route; else the worker's blocking write.
                // Leg 0's held log keeps nothing while the route under
                // test runs (`None`: never).
                let sabotaged = |route: Option<Sabotage>| {
                    let on = sabotage != Sabotage::None && route == Some(sabotage);
                    recorders[0]
                        .sabotage_held
                        .store(on, std::sync::atomic::Ordering::Relaxed);
                };
                sabotaged(Some(Sabotage::Completion));
                let completed = !fua && write_completing(&mirror, offset, &data, &deferred)?;
                sabotaged(Some(Sabotage::Reserved));
                let inline = !completed
                    && !fua
                    && mirror
                        .submit_write(
                            offset,
                            &Bytes::from(data.clone()),
                            false,
                            vouch_engine::Admission::MustNotWait,
                        )
                        .map_err(|e| format!("inline write: {e}"))?
                        .is_done();
                sabotaged(Some(Sabotage::Worker));
                if completed {
                    report.completed_later += 1;
                } else if inline {
                    report.inline_writes += 1;
                } else {
                    report.worker_writes += u64::from(!fua);
                    mirror
                        .write_bytes(offset, &Bytes::from(data.clone()), fua)
                        .map_err(|e| format!("write: {e}"))?;
                }
                sabotaged(None);
                acknowledged(&acked, lba, count);
            }
        }
        report.background_commits += step_commits(volumes.iter().map(|leg| &**leg), &mut rng);
    }
    for recorder in &recorders {
        recorder.set_hook(None);
    }
    report.crash_points += points.load(std::sync::atomic::Ordering::Relaxed);
    drop(mirror);
    let crashes = std::mem::take(&mut *crashes.lock());
    for (index, crash) in crashes.into_iter().enumerate() {
        report.images += 1;
        report.process_images += u64::from(crash.process);
        let process = crash.process;
        if let Err(message) = check_crash(crash, report) {
            let cut = if process { "process crash" } else { "crash" };
            report
                .violations
                .push(format!("seed {seed} {cut} image pair {index}: {message}"));
        }
    }
    Ok(())
}

/// Blocks `[lba, lba + count)` were acknowledged: a process crash must
/// keep their newest values.
fn acknowledged(acked: &Mutex<Allowed>, lba: u64, count: u64) {
    let mut acked = acked.lock();
    for block in lba..lba + count {
        let values = &mut acked[block as usize];
        let last = *values.last().expect("a value");
        *values = vec![last];
    }
}

/// A write through the mirror's completion path, waited for here:
/// `Ok(false)` when the mirror declines it (nothing written).
/// Flush the mirror; then only each block's value from before the flush
/// may be read after a crash (the model's last value as the flush began).
pub(crate) fn flush_modelled(mirror: &Mirror, model: &Mutex<Allowed>) -> Result<(), String> {
    let before = model.lock().clone();
    mirror.flush().map_err(|e| format!("flush: {e}"))?;
    let mut now = model.lock();
    for (block, values) in now.iter_mut().enumerate() {
        *values = vec![*before[block].last().expect("a value")];
    }
    Ok(())
}

/// Trim `count` blocks from `lba`, the zeros allowed from before it starts.
pub(crate) fn trim_modelled(
    mirror: &Mirror,
    model: &Mutex<Allowed>,
    lba: u64,
    count: u64,
    zero: u64,
) -> Result<(), String> {
    {
        let mut now = model.lock();
        for block in lba..lba + count {
            now[block as usize].push(zero);
        }
    }
    mirror
        .trim(lba * BLOCK as u64, count * BLOCK as u64, false)
        .map_err(|e| format!("trim: {e}"))
}

/// Allow the blocks of `data`, written from `lba`, before the write starts.
pub(crate) fn model_write(model: &Mutex<Allowed>, lba: u64, data: &[u8]) {
    let mut now = model.lock();
    for (index, block) in data.chunks_exact(BLOCK).enumerate() {
        now[lba as usize + index].push(fingerprint(block));
    }
}

pub(crate) fn write_completing(
    mirror: &Arc<Mirror>,
    offset: u64,
    data: &[u8],
    deferred: &Deferred,
) -> Result<bool, String> {
    let begun = mirror
        .submit_write(
            offset,
            &Bytes::copy_from_slice(data),
            false,
            vouch_engine::Admission::Callback,
        )
        .map_err(|e| format!("write: {e}"))?;
    let start = match begun {
        vouch_engine::Submitted::Started(start) => start,
        vouch_engine::Submitted::Declined => return Ok(false),
        vouch_engine::Submitted::Done => {
            return Err("a write with a remote leg was done before it answered".into())
        }
    };
    let (sender, outcome) = std::sync::mpsc::channel();
    start(Box::new(move |result| {
        let _ = sender.send(result);
    }));
    let answers: Vec<_> = std::mem::take(&mut *deferred.lock());
    if !answers.is_empty() && outcome.try_recv().is_ok() {
        return Err("a write was acknowledged before its remote leg answered".into());
    }
    for answer in answers {
        answer();
    }
    outcome
        .try_recv()
        .map_err(|_| "a started write was not done once its legs answered".to_string())?
        .map_err(|e| format!("write: {e}"))?;
    Ok(true)
}

/// Open both legs' crash images as a restart does (each recovers).
pub(crate) fn open_crash_legs(legs: [SimStorage; 2]) -> Result<[Arc<Volume>; 2], String> {
    let [leg0, leg1] = legs;
    let open = |image: SimStorage, at: usize| {
        Volume::open(
            Arc::new(image) as Arc<dyn Storage>,
            &crate::foreground_options(),
        )
        .map(Arc::new)
        .map_err(|e| format!("leg {at} does not open: {e}"))
    };
    Ok([open(leg0, 0)?, open(leg1, 1)?])
}

/// Recover one crash image pair as a restart does and check the contract.
fn check_crash(crash: Crash, report: &mut MirrorWriteReport) -> Result<(), String> {
    let volumes = open_crash_legs(crash.legs)?;
    let mirror = mirror_over([volumes[0].clone(), volumes[1].clone()], Leg1::Local)?;
    mirror.read_one_leg_until_scrubbed();
    let mut seen = Vec::with_capacity(BLOCKS as usize);
    let mut diverged = false;
    for lba in 0..BLOCKS {
        let mut buf = vec![0u8; BLOCK];
        mirror
            .read(lba * BLOCK as u64, &mut buf)
            .map_err(|e| format!("LBA {lba} fails after recovery: {e}"))?;
        let print = fingerprint(&buf);
        if !crash.allowed[lba as usize].contains(&print) {
            return Err(format!(
                "LBA {lba} reads a value no write or flush allows ({} allowed)",
                crash.allowed[lba as usize].len()
            ));
        }
        // Each leg alone holds an allowed value too: after a completed
        // flush, the flushed one (a leg's write that never landed, a
        // remote one not waited for, would show here).
        let mut other = vec![0u8; BLOCK];
        volumes[1]
            .read(lba * BLOCK as u64, &mut other)
            .map_err(|e| format!("leg 1 LBA {lba} fails after recovery: {e}"))?;
        if !crash.allowed[lba as usize].contains(&fingerprint(&other)) {
            return Err(format!(
                "leg 1 LBA {lba} holds a value no write or flush allows"
            ));
        }
        diverged |= other != buf;
        seen.push(print);
    }
    report.diverged += u64::from(diverged);
    let scrubbed = vouch_mirror::scrub::scrub(
        &mirror,
        &vouch_engine::scrub::ScrubOptions::default(),
        &JobControl::default(),
    )
    .map_err(|e| format!("scrub: {e}"))?;
    if scrubbed.left != 0 {
        return Err(format!("the scrub left blocks: {scrubbed:?}"));
    }
    report.repaired += scrubbed.repaired;
    if mirror.reads_one_leg() {
        return Err("a scrub with nothing left must end one-leg reads".into());
    }
    for lba in 0..BLOCKS {
        for (at, volume) in volumes.iter().enumerate() {
            let mut buf = vec![0u8; BLOCK];
            volume
                .read(lba * BLOCK as u64, &mut buf)
                .map_err(|e| format!("leg {at} LBA {lba} fails after the scrub: {e}"))?;
            if fingerprint(&buf) != seen[lba as usize] {
                return Err(format!(
                    "leg {at} LBA {lba} changed under the scrub: it no longer holds what clients read before it"
                ));
            }
        }
    }
    Ok(())
}
